//! iSCSI text keys (RFC 7143 section 6.1): `key=value` pairs, each ended by a NUL, in
//! Login and Text data segments.
//!
//! [`parse`] is total: any bytes give the pairs in order or a [`KeyError`] saying what
//! is wrong (bad UTF-8, a pair without `=`, a key name with characters the RFC does not
//! allow or longer than 63 bytes, an over-long value, a key given twice, text without
//! its final NUL). [`TextBuilder`] writes pairs back. The values themselves (numbers,
//! booleans, lists, binary) are read by the helpers here as negotiation needs them.

use bytes::{BufMut, Bytes, BytesMut};

/// The longest key name (RFC 7143 6.1).
pub const MAX_KEY_LEN: usize = 63;
/// The longest value taken: large enough for any binary value CHAP sends (a 1024-byte
/// challenge as base64 or hex), far under the 64 KiB a whole text may reach.
pub const MAX_VALUE_LEN: usize = 8192;

/// Why key text could not be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A pair is not UTF-8.
    #[error("text pair {index} is not UTF-8")]
    NotUtf8 {
        /// Which pair (from 0).
        index: usize,
    },
    /// A pair has no `=`.
    #[error("text pair {index} has no '='")]
    MissingEquals {
        /// Which pair (from 0).
        index: usize,
    },
    /// A key name is empty, too long or has characters the RFC does not allow.
    #[error("invalid key name {0:?}")]
    BadKey(String),
    /// A value is longer than [`MAX_VALUE_LEN`].
    #[error("the value of {key} is {len} bytes long")]
    ValueTooLong {
        /// The key.
        key: String,
        /// The value's length.
        len: usize,
    },
    /// A key appears twice.
    #[error("key {0} given twice")]
    Duplicate(String),
    /// The last pair has no terminating NUL.
    #[error("the text does not end with a NUL")]
    Unterminated,
}

/// One `key=value` pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// The key name.
    pub key: String,
    /// The value, as sent.
    pub value: String,
}

/// Whether `key` is a valid key name: 1 to 63 letters, digits, `.`, `-`, `+`, `@`, `_`.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+' | b'@' | b'_'))
}

/// Parses a whole text (all the PDUs of a C-bit sequence joined): every pair, in order.
/// Empty pairs (two NULs in a row) are skipped.
pub fn parse(text: &[u8]) -> Result<Vec<Pair>, KeyError> {
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let Some((&last, body)) = text.split_last() else {
        return Ok(Vec::new());
    };
    if last != 0 {
        return Err(KeyError::Unterminated);
    }
    let mut pairs: Vec<Pair> = Vec::new();
    for (index, raw) in body.split(|&b| b == 0).enumerate() {
        if raw.is_empty() {
            continue;
        }
        let s = std::str::from_utf8(raw).map_err(|_| KeyError::NotUtf8 { index })?;
        let Some((key, value)) = s.split_once('=') else {
            return Err(KeyError::MissingEquals { index });
        };
        if !valid_key(key) {
            let mut shown = key.to_string();
            shown.truncate(shown.floor_char_boundary_compat(MAX_KEY_LEN + 1));
            return Err(KeyError::BadKey(shown));
        }
        if value.len() > MAX_VALUE_LEN {
            return Err(KeyError::ValueTooLong {
                key: key.to_string(),
                len: value.len(),
            });
        }
        if pairs.iter().any(|p| p.key == key) {
            return Err(KeyError::Duplicate(key.to_string()));
        }
        pairs.push(Pair {
            key: key.to_string(),
            value: value.to_string(),
        });
    }
    Ok(pairs)
}

/// `str::floor_char_boundary` for the toolchains we build on.
trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorCharBoundary for String {
    fn floor_char_boundary_compat(&self, i: usize) -> usize {
        let mut i = i.min(self.len());
        while !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

/// Writes `key=value\0` pairs.
#[derive(Clone, Debug, Default)]
pub struct TextBuilder {
    buf: BytesMut,
}

impl TextBuilder {
    /// An empty text.
    pub fn new() -> TextBuilder {
        TextBuilder::default()
    }

    /// Appends `key=value\0`.
    pub fn push(&mut self, key: &str, value: &str) -> &mut TextBuilder {
        self.buf.reserve(key.len() + value.len() + 2);
        self.buf.put_slice(key.as_bytes());
        self.buf.put_u8(b'=');
        self.buf.put_slice(value.as_bytes());
        self.buf.put_u8(0);
        self
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The bytes so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The text.
    pub fn finish(self) -> Bytes {
        self.buf.freeze()
    }
}

/// The special values a responder may answer with (RFC 7143 6.2).
pub mod answer {
    /// The key is not known.
    pub const NOT_UNDERSTOOD: &str = "NotUnderstood";
    /// The value is invalid, out of range or unacceptable.
    pub const REJECT: &str = "Reject";
    /// The key does not apply here.
    pub const IRRELEVANT: &str = "Irrelevant";
}

/// A boolean value: `Yes` or `No`.
pub fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

/// `Yes` or `No`.
pub fn bool_str(b: bool) -> &'static str {
    if b { "Yes" } else { "No" }
}

/// A numerical value (decimal, or a `0x` hex constant) within `min..=max`.
pub fn parse_number(value: &str, min: u64, max: u64) -> Option<u64> {
    let n = if let Some(hex) = value
        .strip_prefix("0x")
        .or_else(|| value.strip_prefix("0X"))
    {
        if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()?
    } else {
        if value.is_empty() || value.len() > 20 || !value.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        value.parse::<u64>().ok()?
    };
    (min..=max).contains(&n).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(k: &str, v: &str) -> Pair {
        Pair {
            key: k.into(),
            value: v.into(),
        }
    }

    #[test]
    fn pairs_come_back_in_order_with_empty_values_and_equals_in_values() {
        let got = parse(b"InitiatorName=iqn.a:b\0X-a=b=c\0SendTargets=\0").unwrap();
        assert_eq!(
            got,
            vec![
                pair("InitiatorName", "iqn.a:b"),
                pair("X-a", "b=c"),
                pair("SendTargets", "")
            ]
        );
        assert_eq!(parse(b"").unwrap(), vec![]);
        assert_eq!(parse(b"\0\0A=1\0\0").unwrap(), vec![pair("A", "1")]);
    }

    #[test]
    fn malformed_text_gets_a_typed_error() {
        assert_eq!(parse(b"A=1"), Err(KeyError::Unterminated));
        assert_eq!(
            parse(b"A=1\0B\0"),
            Err(KeyError::MissingEquals { index: 1 })
        );
        assert_eq!(parse(b"A=\xff\0"), Err(KeyError::NotUtf8 { index: 0 }));
        assert_eq!(parse(b"=1\0"), Err(KeyError::BadKey(String::new())));
        assert_eq!(parse(b"A B=1\0"), Err(KeyError::BadKey("A B".into())));
        let long = format!("{}=1\0", "K".repeat(64));
        assert!(matches!(parse(long.as_bytes()), Err(KeyError::BadKey(_))));
        let ok = format!("{}=1\0", "K".repeat(63));
        assert!(parse(ok.as_bytes()).is_ok());
        let big = format!("A={}\0", "v".repeat(MAX_VALUE_LEN + 1));
        assert!(matches!(
            parse(big.as_bytes()),
            Err(KeyError::ValueTooLong { .. })
        ));
        assert_eq!(
            parse(b"A=1\0B=2\0A=1\0"),
            Err(KeyError::Duplicate("A".into()))
        );
        // A long key name with multi-byte characters is cut on a character boundary.
        let wide = format!("{}=1\0", "é".repeat(40));
        assert!(matches!(parse(wide.as_bytes()), Err(KeyError::BadKey(_))));
    }

    #[test]
    fn the_builder_writes_what_the_parser_reads() {
        let mut b = TextBuilder::new();
        b.push("HeaderDigest", "None")
            .push("MaxBurstLength", "262144");
        assert_eq!(b.as_bytes(), b"HeaderDigest=None\0MaxBurstLength=262144\0");
        let text = b.finish();
        assert_eq!(parse(&text).unwrap().len(), 2);
    }

    #[test]
    fn numbers_and_booleans_follow_the_rfc_forms() {
        assert_eq!(parse_number("8192", 512, 16_777_215), Some(8192));
        assert_eq!(parse_number("0x2000", 512, 16_777_215), Some(8192));
        assert_eq!(parse_number("511", 512, 16_777_215), None);
        assert_eq!(parse_number("16777216", 512, 16_777_215), None);
        assert_eq!(parse_number("", 0, 10), None);
        assert_eq!(parse_number("-1", 0, 10), None);
        assert_eq!(parse_number("1 ", 0, 10), None);
        assert_eq!(parse_number("99999999999999999999999", 0, u64::MAX), None);
        assert_eq!(parse_bool("Yes"), Some(true));
        assert_eq!(parse_bool("no"), None);
    }
}
