//! The checks behind the iSCSI fuzz targets (`vsan-core/fuzz/`), shared with the test
//! that replays their committed corpora (`tests/iscsi_corpus.rs`): one function per
//! target, and the seeds a fresh corpus starts from.
//!
//! * [`check_pdu`]: a mode byte, then bytes an initiator sends, cut into pieces. Whatever
//!   they are, the [`Decoder`] gives PDUs, waits, or errs without panicking; a Reject
//!   always consumes bytes; every PDU decoded re-encodes to bytes that decode to the
//!   same PDU and encode to the same bytes again. The same bytes are also read as a
//!   target's PDUs ([`ReplyDecoder`]), with the same round trip.
//! * [`check_login`]: bytes an initiator sends during login, decoded as PDUs and fed
//!   to one [`Login`] on a portal with three targets (no CHAP, CHAP, mutual CHAP).
//!   Every response is well formed (status, stages, TSIH only when done, key text that
//!   parses), nothing follows a refusal or the end, a session's parameters stay within
//!   the RFC's ranges and our limits, and a CHAP target is never entered without a
//!   correct CHAP response. A `CHAP_R=@` in the input is replaced with the correct
//!   response to the last challenge (and `CHAP_R=@x` with a wrong one), so inputs reach
//!   the whole CHAP exchange.
//!
//! Not a stable API: compiled only with the `test-utils` feature, hidden from the docs.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::chap::{self, Algorithm, decode_binary, encode_hex};
use super::keys::{self, TextBuilder, parse_number};
use super::login::{Limits, Login, LoginConfig, LoginStep, LoginTarget, SessionKind};
use super::pdu::*;
use super::{Chap, ChapPair};

/// What one [`check_pdu`] run saw (for the replay test to show it is not vacuous).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PduOutcome {
    /// Opcodes of the requests decoded.
    pub requests: Vec<u8>,
    /// Reason codes of the Rejects.
    pub rejects: Vec<u8>,
    /// Whether the framing was lost.
    pub fatal: bool,
    /// Opcodes of the replies decoded by the initiator-side decoder.
    pub replies: Vec<u8>,
}

/// The mode byte of [`check_pdu`]: bit 0 header digests, bit 1 data digests, bit 2 a
/// 512-byte data segment limit (else 64 KiB); the rest of the byte, plus one, is the
/// size of the pieces the input is fed in (bit 3 up: 0 means all at once).
pub fn check_pdu(data: &[u8]) -> PduOutcome {
    let Some((&mode, input)) = data.split_first() else {
        return PduOutcome::default();
    };
    let digests = Digests {
        header: mode & 1 != 0,
        data: mode & 2 != 0,
    };
    let max = if mode & 4 != 0 { 512 } else { 64 << 10 };
    let piece = match usize::from(mode >> 3) {
        0 => input.len().max(1),
        n => n,
    };
    let mut out = PduOutcome::default();
    let mut dec = Decoder::new(max);
    dec.set_digests(digests);
    let mut buf = BytesMut::new();
    'feed: for chunk in input.chunks(piece) {
        buf.extend_from_slice(chunk);
        loop {
            let before = buf.len();
            match dec.decode(&mut buf) {
                Ok(None) => break,
                Ok(Some(req)) => {
                    assert!(buf.len() < before, "a request consumed nothing");
                    out.requests.push(req.header()[0] & 0x3f);
                    request_round_trip(req, digests, max);
                }
                Err(PduError::Reject { reason, .. }) => {
                    assert!(buf.len() < before, "a Reject consumed nothing");
                    out.rejects.push(reason);
                }
                Err(PduError::Fatal(_)) => {
                    out.fatal = true;
                    break 'feed;
                }
            }
        }
    }
    let mut dec = ReplyDecoder::new(max);
    dec.set_digests(digests);
    let mut buf = BytesMut::from(input);
    loop {
        match dec.decode(&mut buf) {
            Ok(None) | Err(PduError::Fatal(_)) => break,
            Err(PduError::Reject { .. }) => {}
            Ok(Some(rep)) => {
                let mut e1 = BytesMut::new();
                rep.encode(digests, &mut e1);
                out.replies.push(e1[0] & 0x3f);
                let mut again = ReplyDecoder::new(max);
                again.set_digests(digests);
                let mut b = e1.clone();
                let d2 = again
                    .decode(&mut b)
                    .unwrap_or_else(|e| panic!("a re-encoded reply does not decode: {e}"))
                    .expect("a re-encoded reply is whole");
                assert!(b.is_empty(), "a re-encoded reply left bytes");
                let mut e2 = BytesMut::new();
                d2.encode(digests, &mut e2);
                assert_eq!(e1, e2, "a reply's encoding is not stable");
            }
        }
    }
    out
}

fn request_round_trip(req: Request, digests: Digests, max: u32) {
    let mut e1 = BytesMut::new();
    req.encode(digests, &mut e1);
    let mut dec = Decoder::new(max);
    dec.set_digests(digests);
    let mut b = e1.clone();
    let mut d2 = dec
        .decode(&mut b)
        .unwrap_or_else(|e| panic!("a re-encoded {req:?} does not decode: {e}"))
        .expect("a re-encoded request is whole");
    assert!(b.is_empty(), "a re-encoded request left bytes");
    let mut e2 = BytesMut::new();
    d2.encode(digests, &mut e2);
    assert_eq!(e1, e2, "a request's encoding is not stable");
    let mut d1 = req;
    *d1.header_mut() = [0; BHS_LEN];
    *d2.header_mut() = [0; BHS_LEN];
    assert_eq!(d1, d2, "a request changed on re-encoding");
}

/// The targets of [`check_login`]'s portal, in order.
pub const LOGIN_TARGETS: [&str; 3] = [
    "iqn.2026-12.io.vsan:open",
    "iqn.2026-12.io.vsan:chap",
    "iqn.2026-12.io.vsan:mutual",
];
/// The CHAP user of the CHAP targets.
pub const CHAP_USER: &str = "fuzz-initiator";
/// The initiator's CHAP secret.
pub const CHAP_SECRET: &[u8] = b"fuzz-initiator-secret";
/// The CHAP secret the mutual target proves it knows.
pub const MUTUAL_SECRET: &[u8] = b"fuzz-target-secret";

/// The portal of [`check_login`].
pub fn login_config() -> Arc<LoginConfig> {
    let pair = |user: &str, secret: &[u8]| ChapPair {
        user: user.into(),
        secret: secret.to_vec(),
    };
    let chap = |mutual: bool| Chap {
        initiator: pair(CHAP_USER, CHAP_SECRET),
        target: mutual.then(|| pair("fuzz-target", MUTUAL_SECRET)),
    };
    Arc::new(LoginConfig {
        targets: vec![
            LoginTarget {
                name: LOGIN_TARGETS[0].into(),
                alias: Some("open".into()),
                chap: None,
                portal_group_tag: None,
            },
            LoginTarget {
                name: LOGIN_TARGETS[1].into(),
                alias: None,
                chap: Some(chap(false)),
                portal_group_tag: None,
            },
            LoginTarget {
                name: LOGIN_TARGETS[2].into(),
                alias: None,
                chap: Some(chap(true)),
                portal_group_tag: None,
            },
        ],
        portal_group_tag: 1,
        limits: Limits::default(),
    })
}

/// What one [`check_login`] run ended with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoginOutcome {
    /// Login Requests stepped.
    pub steps: usize,
    /// The session started: its kind.
    pub done: Option<SessionKind>,
    /// The login was refused with this status.
    pub refused: Option<u16>,
    /// A correct CHAP response was sent (the session passed CHAP).
    pub chap_passed: bool,
    /// The target answered a mutual CHAP challenge.
    pub mutual_answered: bool,
}

/// Drives one [`Login`] with the Login Requests decoded from `data`; see the module doc.
pub fn check_login(data: &[u8]) -> LoginOutcome {
    let config = login_config();
    let mut login = Login::new(config.clone(), 0x0101);
    let mut dec = Decoder::new(DEFAULT_MAX_DATA_SEGMENT);
    let mut buf = BytesMut::from(data);
    let mut out = LoginOutcome::default();
    // The last challenge the target sent.
    let mut challenge: Option<(Algorithm, u8, Vec<u8>)> = None;
    let mut good_chap_r = false;
    loop {
        let req = match dec.decode(&mut buf) {
            Ok(Some(Request::Login(req))) => req,
            Ok(Some(other)) => {
                if out.done.is_none() && out.refused.is_none() {
                    let h = other.header();
                    let itt = u32::from_be_bytes([h[16], h[17], h[18], h[19]]);
                    let r = login.refuse_invalid_during_login(itt);
                    assert_eq!((r.status_class, r.status_detail), (2, 0x0b));
                    out.refused = Some(0x020b);
                }
                break;
            }
            Ok(None) | Err(PduError::Fatal(_)) => break,
            Err(PduError::Reject { .. }) => continue,
        };
        let (req, sent_good) = fill_chap_response(req, challenge.as_ref());
        good_chap_r |= sent_good;
        out.steps += 1;
        let step = login.step(&req);
        let over = out.done.is_some() || out.refused.is_some();
        let resp = match &step {
            LoginStep::Continue(r) | LoginStep::Done(r, _) | LoginStep::Refuse(r) => r,
        };
        assert_eq!(resp.itt, req.itt, "the response's ITT");
        assert_eq!(resp.isid, req.isid, "the response's ISID");
        assert_eq!((resp.version_max, resp.version_active), (0, 0));
        assert!(resp.data.len() <= DEFAULT_MAX_DATA_SEGMENT as usize);
        let pairs = keys::parse(&resp.data)
            .unwrap_or_else(|e| panic!("the target's login text is malformed: {e}"));
        for p in &pairs {
            assert!(p.key != "CHAP_R" || !p.value.is_empty());
            assert!(
                !p.value.contains("secret"),
                "a secret in the response: {p:?}"
            );
        }
        if !matches!(step, LoginStep::Refuse(_)) && pairs.iter().any(|p| p.key == "CHAP_R") {
            out.mutual_answered = true;
            check_mutual_answer(&req, &pairs);
        }
        match step {
            LoginStep::Refuse(r) => {
                assert!(r.status_class != 0, "a refusal with success status");
                assert!(!r.transit && r.tsih == 0);
                if !over {
                    out.refused = Some(u16::from(r.status_class) << 8 | u16::from(r.status_detail));
                }
            }
            _ if over => panic!("a login step answered after the login ended"),
            LoginStep::Continue(r) => {
                assert_eq!((r.status_class, r.status_detail), (0, 0));
                assert_eq!(r.tsih, 0, "TSIH before the final response");
                assert_eq!(r.csg, req.csg);
                if r.transit {
                    assert!(req.transit, "the target transits unasked");
                    assert_eq!((r.csg, r.nsg), (0, 1));
                }
                let get = |k: &str| pairs.iter().find(|p| p.key == k).map(|p| p.value.as_str());
                if let (Some(a), Some(i), Some(c)) = (get("CHAP_A"), get("CHAP_I"), get("CHAP_C")) {
                    let alg = parse_number(a, 0, 255).and_then(Algorithm::from_code);
                    let id = parse_number(i, 0, 255);
                    let c = decode_binary(c);
                    let (Some(alg), Some(id), Some(c)) = (alg, id, c) else {
                        panic!("a malformed challenge: {a} {i}");
                    };
                    assert!(c.len() >= 16, "a short challenge");
                    challenge = Some((alg, id as u8, c));
                }
            }
            LoginStep::Done(r, n) => {
                assert_eq!((r.status_class, r.status_detail), (0, 0));
                assert!(r.transit && r.nsg == 3 && r.csg == req.csg);
                assert_eq!(r.tsih, 0x0101);
                assert_eq!(n.tsih, 0x0101);
                assert_eq!(n.isid, req.isid);
                assert!(!n.initiator_name.is_empty());
                let p = n.params;
                let lim = config.limits;
                assert!(p.max_burst_length >= 512 && p.max_burst_length <= lim.max_burst_length);
                assert!(p.first_burst_length >= 512 && p.first_burst_length <= p.max_burst_length);
                assert!(p.first_burst_length <= lim.first_burst_length.max(65536));
                assert!((512..=MAX_DATA_SEGMENT_FIELD).contains(&p.max_xmit_data_segment_length));
                assert!(
                    p.max_recv_data_segment_length == DEFAULT_MAX_DATA_SEGMENT
                        || p.max_recv_data_segment_length == lim.max_recv_data_segment_length
                );
                assert!(
                    p.max_outstanding_r2t >= 1 && p.max_outstanding_r2t <= lim.max_outstanding_r2t
                );
                assert!(p.default_time2wait <= 3600 && p.default_time2retain <= 20);
                assert!(p.data_pdu_in_order && p.data_sequence_in_order);
                assert_eq!((p.error_recovery_level, p.max_connections), (0, 1));
                if let SessionKind::Normal { target } = n.kind {
                    assert!(target < config.targets.len());
                    if config.targets[target].chap.is_some() {
                        assert!(good_chap_r, "a CHAP target entered without CHAP");
                        out.chap_passed = true;
                    }
                }
                out.done = Some(n.kind);
            }
        }
    }
    out
}

/// Replaces `CHAP_R=@` with the right response to `challenge` (`@x`: a wrong one);
/// says whether a right one went in.
fn fill_chap_response(
    mut req: LoginReq,
    challenge: Option<&(Algorithm, u8, Vec<u8>)>,
) -> (LoginReq, bool) {
    let Ok(pairs) = keys::parse(&req.data) else {
        return (req, false);
    };
    let Some(at) = pairs
        .iter()
        .position(|p| p.key == "CHAP_R" && p.value.starts_with('@'))
    else {
        return (req, false);
    };
    let Some((alg, id, c)) = challenge else {
        return (req, false);
    };
    let right = pairs[at].value == "@";
    let secret: &[u8] = if right {
        CHAP_SECRET
    } else {
        b"not-the-secret"
    };
    let name_ok = pairs
        .iter()
        .any(|p| p.key == "CHAP_N" && p.value == CHAP_USER);
    let mut t = TextBuilder::new();
    for (i, p) in pairs.iter().enumerate() {
        if i == at {
            t.push("CHAP_R", &encode_hex(&chap::response(*alg, *id, secret, c)));
        } else {
            t.push(&p.key, &p.value);
        }
    }
    req.data = t.finish();
    (req, right && name_ok)
}

/// Checks the target's mutual CHAP answer against the initiator's challenge in `req`.
fn check_mutual_answer(req: &LoginReq, resp: &[keys::Pair]) {
    let Ok(sent) = keys::parse(&req.data) else {
        panic!("a mutual answer to malformed text");
    };
    let get = |ps: &[keys::Pair], k: &str| ps.iter().find(|p| p.key == k).map(|p| p.value.clone());
    let (Some(i), Some(c)) = (get(&sent, "CHAP_I"), get(&sent, "CHAP_C")) else {
        panic!("a mutual answer nobody asked for");
    };
    let (Some(i), Some(c)) = (parse_number(&i, 0, 255), decode_binary(&c)) else {
        panic!("a mutual answer to a malformed challenge");
    };
    let got = get(resp, "CHAP_R")
        .and_then(|r| decode_binary(&r))
        .expect("CHAP_R");
    let ok = [Algorithm::Md5, Algorithm::Sha256]
        .iter()
        .any(|&a| chap::response(a, i as u8, MUTUAL_SECRET, &c) == got);
    assert!(ok, "a wrong mutual CHAP answer");
}

// --- seeds -----------------------------------------------------------------------

fn login_pdu(csg: u8, nsg: u8, transit: bool, cont: bool, text: &[u8]) -> Vec<u8> {
    let req = Request::Login(LoginReq {
        header: [0; BHS_LEN],
        transit,
        cont,
        csg,
        nsg,
        version_max: 0,
        version_min: 0,
        isid: [0x80, 0x12, 0x34, 0x56, 0, 1],
        tsih: 0,
        itt: 0x1000,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
        data: Bytes::copy_from_slice(text),
    });
    let mut b = BytesMut::new();
    req.encode(Digests::default(), &mut b);
    b.to_vec()
}

fn text(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut t = TextBuilder::new();
    for (k, v) in pairs {
        t.push(k, v);
    }
    t.finish().to_vec()
}

/// Seed inputs for `iscsi_login`.
pub fn login_seeds() -> Vec<Vec<u8>> {
    let who = |target: usize, auth: &str| {
        text(&[
            ("InitiatorName", "iqn.1994-05.com.example:fuzz"),
            ("TargetName", LOGIN_TARGETS[target]),
            ("SessionType", "Normal"),
            ("AuthMethod", auth),
        ])
    };
    let ops = text(&[
        ("HeaderDigest", "CRC32C,None"),
        ("DataDigest", "None"),
        ("MaxConnections", "1"),
        ("InitialR2T", "No"),
        ("ImmediateData", "Yes"),
        ("MaxRecvDataSegmentLength", "262144"),
        ("MaxBurstLength", "16776192"),
        ("FirstBurstLength", "262144"),
        ("DefaultTime2Wait", "2"),
        ("DefaultTime2Retain", "0"),
        ("MaxOutstandingR2T", "1"),
        ("DataPDUInOrder", "Yes"),
        ("DataSequenceInOrder", "Yes"),
        ("ErrorRecoveryLevel", "0"),
        ("IFMarker", "No"),
        ("OFMarker", "No"),
        ("X-com.example.Key", "1"),
    ]);
    let chap = |target: usize, alg: &str, resp: &[(&str, &str)]| {
        let mut s = login_pdu(0, 1, false, false, &who(target, "CHAP,None"));
        s.extend(login_pdu(0, 1, false, false, &text(&[("CHAP_A", alg)])));
        s.extend(login_pdu(0, 1, true, false, &text(resp)));
        s.extend(login_pdu(1, 3, true, false, &ops));
        s
    };
    let mut seeds = Vec::new();
    // No authentication, every operational key.
    let mut s = login_pdu(0, 1, true, false, &who(0, "None"));
    s.extend(login_pdu(1, 3, true, false, &ops));
    seeds.push(s);
    // Straight to the operational stage, and straight to full feature.
    seeds.push(login_pdu(
        1,
        3,
        true,
        false,
        &text(&[("InitiatorName", "iqn.x"), ("TargetName", LOGIN_TARGETS[0])]),
    ));
    seeds.push(login_pdu(0, 3, true, false, &who(0, "None")));
    // Discovery.
    let mut s = login_pdu(
        0,
        1,
        true,
        false,
        &text(&[
            ("InitiatorName", "iqn.x"),
            ("SessionType", "Discovery"),
            ("AuthMethod", "None"),
        ]),
    );
    s.extend(login_pdu(1, 3, true, false, &ops));
    seeds.push(s);
    // CHAP: MD5, SHA-256, mutual, wrong secret, wrong user.
    seeds.push(chap(1, "5", &[("CHAP_N", CHAP_USER), ("CHAP_R", "@")]));
    seeds.push(chap(1, "7,5", &[("CHAP_N", CHAP_USER), ("CHAP_R", "@")]));
    seeds.push(chap(
        2,
        "7",
        &[
            ("CHAP_N", CHAP_USER),
            ("CHAP_R", "@"),
            ("CHAP_I", "9"),
            ("CHAP_C", "0x00112233445566778899aabbccddeeff"),
        ],
    ));
    seeds.push(chap(1, "5", &[("CHAP_N", CHAP_USER), ("CHAP_R", "@x")]));
    seeds.push(chap(1, "5", &[("CHAP_N", "someone"), ("CHAP_R", "@")]));
    seeds.push(chap(1, "6", &[("CHAP_N", CHAP_USER), ("CHAP_R", "@")]));
    // Refusals: AuthMethod=None on a CHAP target, unknown target, missing names.
    seeds.push(login_pdu(0, 1, true, false, &who(1, "None")));
    seeds.push(login_pdu(
        0,
        1,
        true,
        false,
        &text(&[("InitiatorName", "iqn.x"), ("TargetName", "iqn.nope")]),
    ));
    seeds.push(login_pdu(
        0,
        1,
        true,
        false,
        &text(&[("TargetName", LOGIN_TARGETS[0])]),
    ));
    // Bad values, a key twice, malformed text.
    let mut s = login_pdu(0, 1, true, false, &who(0, "None"));
    s.extend(login_pdu(
        1,
        3,
        false,
        false,
        &text(&[("MaxBurstLength", "1"), ("HeaderDigest", "MD5")]),
    ));
    s.extend(login_pdu(
        1,
        3,
        true,
        false,
        &text(&[("MaxBurstLength", "4096")]),
    ));
    seeds.push(s);
    seeds.push(login_pdu(0, 1, true, false, b"InitiatorName=x\0Oops\0"));
    // C-bit continuation.
    let whole = who(0, "None");
    let (a, b) = whole.split_at(13);
    let mut s = login_pdu(0, 1, false, true, a);
    s.extend(login_pdu(0, 1, true, false, b));
    s.extend(login_pdu(1, 3, true, false, &[]));
    seeds.push(s);
    // A non-login PDU during login.
    let mut s = login_pdu(0, 1, true, false, &who(0, "None"));
    let mut b = BytesMut::new();
    Request::Logout(LogoutReq {
        header: [0; BHS_LEN],
        immediate: true,
        reason: 0,
        itt: 1,
        cid: 0,
        cmd_sn: 1,
        exp_stat_sn: 0,
    })
    .encode(Digests::default(), &mut b);
    s.extend_from_slice(&b);
    seeds.push(s);
    seeds
}

/// Seed inputs for `iscsi_pdu`: one of every request, in every digest mode and in
/// pieces, and broken ones (bad digests, bad AHS, oversized, unknown opcodes, replies).
pub fn pdu_seeds() -> Vec<Vec<u8>> {
    let reqs = sample_requests();
    let mut seeds = Vec::new();
    for mode in [0u8, 1, 2, 3, 4, 3 | (7 << 3), 1 << 3] {
        let d = Digests {
            header: mode & 1 != 0,
            data: mode & 2 != 0,
        };
        let mut s = vec![mode];
        for r in &reqs {
            let mut b = BytesMut::new();
            r.encode(d, &mut b);
            s.extend_from_slice(&b);
        }
        seeds.push(s);
    }
    // A flipped data digest, then a flipped header digest.
    let mut b = BytesMut::new();
    reqs[0].encode(
        Digests {
            header: true,
            data: true,
        },
        &mut b,
    );
    let mut s = vec![3];
    s.extend_from_slice(&b);
    if let Some(last) = s.last_mut() {
        *last ^= 1;
    }
    seeds.push(s.clone());
    s[2] ^= 1;
    seeds.push(s);
    // Oversized data segment under the 512-byte limit.
    let mut s = vec![4];
    let mut b = BytesMut::new();
    reqs[6].encode(Digests::default(), &mut b);
    s.extend_from_slice(&b);
    seeds.push(s);
    // Unknown and target opcodes, a bad AHS, replies.
    for op in [0x07u8, 0x1e, 0x21, 0x3f] {
        let mut h = vec![0u8; 1 + BHS_LEN];
        h[1] = op;
        seeds.push(h);
    }
    let mut s = vec![0u8; 1 + BHS_LEN];
    s[1] = opcode::SCSI_COMMAND;
    s[5] = 2;
    s.extend_from_slice(&[0, 9, 1, 0, 1, 2, 3, 4]);
    seeds.push(s);
    let mut s = vec![0u8];
    for rep in [
        Reply::R2t(R2t {
            ttt: 1,
            len: 4096,
            ..R2t::default()
        }),
        Reply::ScsiResponse(ScsiResponse {
            status: 2,
            sense: Bytes::from_static(&[0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0]),
            ..ScsiResponse::default()
        }),
        Reply::DataIn(DataIn {
            final_: true,
            status: Some(0),
            data: Bytes::from_static(b"data"),
            ..DataIn::default()
        }),
    ] {
        let mut b = BytesMut::new();
        rep.encode(Digests::default(), &mut b);
        s.extend_from_slice(&b);
    }
    seeds.push(s);
    seeds
}

/// One of every request, with every field set to something distinct.
pub fn sample_requests() -> Vec<Request> {
    let h = [0u8; BHS_LEN];
    vec![
        Request::NopOut(NopOut {
            header: h,
            immediate: true,
            lun: 0x0001_0000_0000_0000,
            itt: 7,
            ttt: RESERVED_TAG,
            cmd_sn: 11,
            exp_stat_sn: 12,
            data: Bytes::from_static(b"ping!"),
        }),
        Request::Command(ScsiCommand {
            header: h,
            immediate: false,
            final_: true,
            read: true,
            write: false,
            attr: 1,
            lun: 0,
            itt: 0x1234_5678,
            expected_len: 4096,
            cmd_sn: 99,
            exp_stat_sn: 98,
            cdb: Bytes::from(vec![0x28, 0, 0, 0, 0, 8, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0]),
            bidi_read_len: None,
            data: Bytes::new(),
        }),
        Request::Command(ScsiCommand {
            header: h,
            immediate: true,
            final_: false,
            read: true,
            write: true,
            attr: 2,
            lun: 3,
            itt: 1,
            expected_len: 512,
            cmd_sn: 2,
            exp_stat_sn: 3,
            cdb: Bytes::from(vec![0x7f; 32]),
            bidi_read_len: Some(1024),
            data: Bytes::from(vec![0xa5; 511]),
        }),
        Request::TaskMgmt(TaskMgmtReq {
            header: h,
            immediate: true,
            function: 1,
            lun: 5,
            itt: 6,
            ref_itt: 7,
            cmd_sn: 8,
            exp_stat_sn: 9,
            ref_cmd_sn: 10,
            exp_data_sn: 11,
        }),
        Request::Login(LoginReq {
            header: h,
            transit: true,
            cont: false,
            csg: 1,
            nsg: 3,
            version_max: 0,
            version_min: 0,
            isid: [0x80, 1, 2, 3, 4, 5],
            tsih: 0,
            itt: 0,
            cid: 1,
            cmd_sn: 0,
            exp_stat_sn: 0,
            data: Bytes::from_static(b"InitiatorName=iqn.x\0"),
        }),
        Request::Text(TextReq {
            header: h,
            immediate: true,
            final_: true,
            cont: false,
            lun: 0,
            itt: 3,
            ttt: RESERVED_TAG,
            cmd_sn: 4,
            exp_stat_sn: 5,
            data: Bytes::from_static(b"SendTargets=All\0"),
        }),
        Request::DataOut(DataOut {
            header: h,
            final_: true,
            lun: 0,
            itt: 9,
            ttt: 0x10,
            exp_stat_sn: 4,
            data_sn: 2,
            offset: 8192,
            data: Bytes::from(vec![1; 8192]),
        }),
        Request::Logout(LogoutReq {
            header: h,
            immediate: true,
            reason: 0,
            itt: 44,
            cid: 1,
            cmd_sn: 45,
            exp_stat_sn: 46,
        }),
        Request::Snack(SnackReq {
            header: h,
            kind: 1,
            lun: 0,
            itt: 4,
            ttt: 5,
            exp_stat_sn: 6,
            beg_run: 7,
            run_length: 8,
        }),
    ]
}
