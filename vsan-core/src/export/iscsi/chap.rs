//! CHAP for iSCSI login (RFC 7143 12.1.3, RFC 1994), with MD5 (CHAP_A=5) and SHA-256
//! (CHAP_A=7), one-way and mutual.
//!
//! The exchange, in the security stage:
//!
//! ```text
//! I->T  AuthMethod=CHAP,None              T->I  AuthMethod=CHAP
//! I->T  CHAP_A=7,5                        T->I  CHAP_A=7 CHAP_I=<id> CHAP_C=<challenge>
//! I->T  CHAP_N=<name> CHAP_R=<response>   T->I  (mutual: CHAP_N=<name> CHAP_R=<response>)
//!      [CHAP_I=<id> CHAP_C=<challenge>]
//! ```
//!
//! The response is `H(id || secret || challenge)`. Responses are compared in constant
//! time; no secret, challenge answer or response is ever logged or shown by `Debug`.

use subtle::ConstantTimeEq;

use super::Chap;
use super::keys::{Pair, TextBuilder, answer, parse_number};

/// The longest challenge taken from an initiator (mutual CHAP).
pub const MAX_CHALLENGE_LEN: usize = 1024;

/// A CHAP hash algorithm (the CHAP_A value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// MD5 (5).
    Md5,
    /// SHA-256 (7).
    Sha256,
}

impl Algorithm {
    /// The algorithm of a CHAP_A code, if supported.
    pub fn from_code(code: u64) -> Option<Algorithm> {
        match code {
            5 => Some(Algorithm::Md5),
            7 => Some(Algorithm::Sha256),
            _ => None,
        }
    }

    /// The CHAP_A code.
    pub fn code(self) -> u8 {
        match self {
            Algorithm::Md5 => 5,
            Algorithm::Sha256 => 7,
        }
    }

    /// The digest (and so response) length in bytes.
    pub fn digest_len(self) -> usize {
        match self {
            Algorithm::Md5 => 16,
            Algorithm::Sha256 => 32,
        }
    }

    /// The length of the challenges this target sends (at least 16 bytes).
    pub fn challenge_len(self) -> usize {
        self.digest_len()
    }
}

/// The CHAP response `H(id || secret || challenge)`.
pub fn response(alg: Algorithm, id: u8, secret: &[u8], challenge: &[u8]) -> Vec<u8> {
    use md5::Digest as _;
    match alg {
        Algorithm::Md5 => {
            let mut h = md5::Md5::new();
            h.update([id]);
            h.update(secret);
            h.update(challenge);
            h.finalize().to_vec()
        }
        Algorithm::Sha256 => {
            let mut h = sha2::Sha256::new();
            h.update([id]);
            h.update(secret);
            h.update(challenge);
            h.finalize().to_vec()
        }
    }
}

/// Whether `got` equals `want`, in time that depends only on the lengths.
pub fn verify(want: &[u8], got: &[u8]) -> bool {
    want.len() == got.len() && bool::from(want.ct_eq(got))
}

/// A binary value: `0x` + hex digits (an odd count as if a leading 0 were there) or
/// `0b` + base64 (RFC 7143 6.1 binary-value).
pub fn decode_binary(value: &str) -> Option<Vec<u8>> {
    let (prefix, body) = value.split_at_checked(2)?;
    match prefix {
        "0x" | "0X" => decode_hex(body),
        "0b" | "0B" => decode_base64(body),
        _ => None,
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len().div_ceil(2));
    let rest = if bytes.len() % 2 == 1 {
        out.push(digit(bytes[0])?);
        &bytes[1..]
    } else {
        bytes
    };
    for pair in rest.chunks_exact(2) {
        out.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(out)
}

fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let body = s.trim_end_matches('=');
    if body.is_empty() || s.len() - body.len() > 2 || body.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(body.len() * 3 / 4);
    for chunk in body.as_bytes().chunks(4) {
        let mut acc = 0u32;
        for &c in chunk {
            acc = acc << 6 | val(c)?;
        }
        acc <<= 6 * (4 - chunk.len() as u32);
        let b = acc.to_be_bytes();
        out.extend_from_slice(&b[1..chunk.len()]);
    }
    Some(out)
}

/// `0x` + lower-case hex.
pub fn encode_hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * bytes.len());
    s.push_str("0x");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Why CHAP failed (all are login status 0x0201, authentication failure).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChapError {
    /// No CHAP_A value offered is one we support.
    #[error("no supported CHAP algorithm offered")]
    NoAlgorithm,
    /// A key the step needs is missing or malformed.
    #[error("CHAP key {0} missing or malformed")]
    BadKey(&'static str),
    /// A CHAP key came at the wrong step.
    #[error("CHAP key {0} out of sequence")]
    OutOfSequence(String),
    /// CHAP_N is not the configured user.
    #[error("unknown CHAP user")]
    UnknownUser,
    /// CHAP_R is wrong: the secret is not the configured one.
    #[error("wrong CHAP response")]
    WrongResponse,
    /// The initiator asked for mutual CHAP, which the target is not configured for.
    #[error("mutual CHAP asked for but not configured")]
    MutualNotConfigured,
    /// The initiator's challenge is ours sent back (a reflection attack).
    #[error("the initiator's challenge reflects the target's")]
    Reflected,
}

/// Where a CHAP exchange stands.
enum Step {
    /// AuthMethod=CHAP agreed; CHAP_A next.
    Algorithm,
    /// Challenge sent; CHAP_N and CHAP_R next.
    Response {
        alg: Algorithm,
        id: u8,
        challenge: Vec<u8>,
    },
    /// Authenticated.
    Done,
}

/// The target side of one CHAP exchange (sans-IO: keys in, keys out).
pub struct ChapAuth {
    chap: Chap,
    step: Step,
}

impl std::fmt::Debug for ChapAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let step = match self.step {
            Step::Algorithm => "algorithm",
            Step::Response { .. } => "response",
            Step::Done => "done",
        };
        f.debug_struct("ChapAuth")
            .field("user", &self.chap.initiator.user)
            .field("step", &step)
            .finish()
    }
}

/// Whether a key belongs to CHAP.
pub fn is_chap_key(key: &str) -> bool {
    matches!(key, "CHAP_A" | "CHAP_I" | "CHAP_C" | "CHAP_N" | "CHAP_R")
}

impl ChapAuth {
    /// A CHAP exchange against `chap`, after AuthMethod=CHAP was agreed.
    pub fn new(chap: Chap) -> ChapAuth {
        ChapAuth {
            chap,
            step: Step::Algorithm,
        }
    }

    /// Whether the initiator has proved it knows the secret (and, for mutual CHAP, the
    /// target's answer was written).
    pub fn done(&self) -> bool {
        matches!(self.step, Step::Done)
    }

    /// Takes the CHAP keys of one Login Request (`pairs` holds only CHAP keys) and
    /// writes the answer to `out`.
    pub fn step(&mut self, pairs: &[&Pair], out: &mut TextBuilder) -> Result<(), ChapError> {
        let get = |k: &str| pairs.iter().find(|p| p.key == k).map(|p| p.value.as_str());
        match &self.step {
            Step::Algorithm => {
                if let Some(p) = pairs.iter().find(|p| p.key != "CHAP_A") {
                    return Err(ChapError::OutOfSequence(p.key.clone()));
                }
                let Some(list) = get("CHAP_A") else {
                    // Nothing yet (an empty request): wait.
                    return Ok(());
                };
                let alg = list
                    .split(',')
                    .filter_map(|v| parse_number(v, 0, 255).and_then(Algorithm::from_code))
                    .next();
                let Some(alg) = alg else {
                    out.push("CHAP_A", answer::REJECT);
                    return Err(ChapError::NoAlgorithm);
                };
                let id: u8 = rand::random();
                let mut challenge = vec![0u8; alg.challenge_len()];
                rand::fill(&mut challenge[..]);
                out.push("CHAP_A", &alg.code().to_string());
                out.push("CHAP_I", &id.to_string());
                out.push("CHAP_C", &encode_hex(&challenge));
                self.step = Step::Response { alg, id, challenge };
                Ok(())
            }
            Step::Response { alg, id, challenge } => {
                if let Some(p) = pairs.iter().find(|p| p.key == "CHAP_A") {
                    return Err(ChapError::OutOfSequence(p.key.clone()));
                }
                let name = get("CHAP_N").ok_or(ChapError::BadKey("CHAP_N"))?;
                let resp = get("CHAP_R")
                    .and_then(decode_binary)
                    .ok_or(ChapError::BadKey("CHAP_R"))?;
                // Mutual CHAP: both CHAP_I and CHAP_C, or neither.
                let mutual = match (get("CHAP_I"), get("CHAP_C")) {
                    (None, None) => None,
                    (Some(i), Some(c)) => {
                        let i = parse_number(i, 0, 255).ok_or(ChapError::BadKey("CHAP_I"))? as u8;
                        let c = decode_binary(c)
                            .filter(|c| !c.is_empty() && c.len() <= MAX_CHALLENGE_LEN)
                            .ok_or(ChapError::BadKey("CHAP_C"))?;
                        Some((i, c))
                    }
                    (None, Some(_)) => return Err(ChapError::BadKey("CHAP_I")),
                    (Some(_), None) => return Err(ChapError::BadKey("CHAP_C")),
                };
                if name != self.chap.initiator.user {
                    return Err(ChapError::UnknownUser);
                }
                let want = response(*alg, *id, &self.chap.initiator.secret, challenge);
                if !verify(&want, &resp) {
                    return Err(ChapError::WrongResponse);
                }
                if let Some((i, c)) = mutual {
                    let Some(target) = &self.chap.target else {
                        return Err(ChapError::MutualNotConfigured);
                    };
                    if verify(&c, challenge) {
                        return Err(ChapError::Reflected);
                    }
                    out.push("CHAP_N", &target.user);
                    out.push(
                        "CHAP_R",
                        &encode_hex(&response(*alg, i, &target.secret, &c)),
                    );
                }
                self.step = Step::Done;
                Ok(())
            }
            Step::Done => match pairs.first() {
                Some(p) => Err(ChapError::OutOfSequence(p.key.clone())),
                None => Ok(()),
            },
        }
    }

    /// The challenge sent, with its algorithm and identifier (tests play the initiator).
    pub fn challenge(&self) -> Option<(Algorithm, u8, &[u8])> {
        match &self.step {
            Step::Response { alg, id, challenge } => Some((*alg, *id, challenge)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        decode_hex(s).unwrap()
    }

    #[test]
    fn responses_match_a_reference_calculation() {
        // MD5 of (id 0x01, "secret", 16 bytes 0x00..0x0f), as `printf` piped to md5sum.
        let challenge: Vec<u8> = (0..16).collect();
        let mut input = vec![1u8];
        input.extend_from_slice(b"secretsecret");
        input.extend_from_slice(&challenge);
        assert_eq!(
            response(Algorithm::Md5, 1, b"secretsecret", &challenge),
            hex(&md5_hex(&input))
        );
        // RFC 1321's and FIPS 180-2's "abc" vectors, split as id 'a', secret "b", challenge "c".
        assert_eq!(
            response(Algorithm::Md5, b'a', b"b", b"c"),
            hex("900150983cd24fb0d6963f7d28e17f72")
        );
        assert_eq!(
            response(Algorithm::Sha256, b'a', b"b", b"c"),
            hex("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        );
        assert_eq!(response(Algorithm::Md5, 0, b"", b"").len(), 16);
        assert_eq!(response(Algorithm::Sha256, 0, b"", b"").len(), 32);
    }

    fn md5_hex(input: &[u8]) -> String {
        use md5::Digest as _;
        md5::Md5::digest(input)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn binary_values_take_hex_and_base64() {
        assert_eq!(decode_binary("0x0aff"), Some(vec![0x0a, 0xff]));
        assert_eq!(decode_binary("0XABC"), Some(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0bAQID"), Some(vec![1, 2, 3]));
        assert_eq!(decode_binary("0bAQI="), Some(vec![1, 2]));
        assert_eq!(decode_binary("0bAQ=="), Some(vec![1]));
        assert_eq!(decode_binary("0bAQ"), Some(vec![1]));
        assert_eq!(decode_binary("0b"), None);
        assert_eq!(decode_binary("0bA"), None);
        assert_eq!(decode_binary("0bA==="), None);
        assert_eq!(decode_binary("0x"), None);
        assert_eq!(decode_binary("0xzz"), None);
        assert_eq!(decode_binary("1234"), None);
        assert_eq!(decode_binary("é"), None);
        assert_eq!(encode_hex(&[0, 0xab]), "0x00ab");
        let v: Vec<u8> = (0..=255).collect();
        assert_eq!(decode_binary(&encode_hex(&v)), Some(v));
    }

    #[test]
    fn verify_needs_equal_length_and_bytes() {
        assert!(verify(b"abcd", b"abcd"));
        assert!(!verify(b"abcd", b"abce"));
        assert!(!verify(b"abcd", b"abc"));
    }
}
