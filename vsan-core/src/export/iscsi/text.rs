//! Text requests in the full feature phase (RFC 7143 11.10, 11.11, 13.3 and appendix C):
//! SendTargets in discovery and normal sessions; other keys are answered NotUnderstood
//! (unknown) or Reject (login-only keys, which cannot be renegotiated here).
//!
//! [`respond`] turns one whole request text into one whole answer text. A request may
//! arrive in pieces (C bit) and an answer may be longer than the initiator takes in one
//! PDU: [`TextExchange`] joins the pieces and hands the answer out in pieces, each with
//! the C bit and a Target Transfer Tag the initiator sends back to ask for the next.

use bytes::{Bytes, BytesMut};

use super::keys::{self, TextBuilder, answer};
use super::login::{LoginConfig, OPERATIONAL_KEYS, SessionKind};
use super::pdu::{RESERVED_TAG, TextReq, TextResp};

/// The longest request text joined across C-bit pieces.
pub const MAX_TEXT_REQUEST: usize = 64 << 10;

/// The answer to one whole Text Request text; `portal` is this connection's local
/// address (`"127.0.0.1:3260"`, `"[::1]:3260"`), reported as every target's address.
pub fn respond(
    config: &LoginConfig,
    kind: &SessionKind,
    portal: &str,
    request: &[u8],
) -> Result<Bytes, String> {
    let pairs = keys::parse(request).map_err(|e| e.to_string())?;
    let mut out = TextBuilder::new();
    let report = |out: &mut TextBuilder, i: usize| {
        if let Some(t) = config.targets.get(i) {
            out.push("TargetName", &t.name);
            out.push("TargetAddress", &format!("{portal},{}", config.tag_of(i)));
        }
    };
    for p in &pairs {
        match p.key.as_str() {
            "SendTargets" => match (kind, p.value.as_str()) {
                (SessionKind::Discovery, "All") => {
                    for i in 0..config.targets.len() {
                        report(&mut out, i);
                    }
                }
                // The session's own target.
                (SessionKind::Normal { target }, "") => report(&mut out, *target),
                // All is for discovery sessions only.
                (SessionKind::Normal { .. }, "All") => {
                    out.push("SendTargets", answer::REJECT);
                }
                // Discovery with no value: nothing to report.
                (SessionKind::Discovery, "") => {}
                (kind, name) => {
                    let found = config
                        .targets
                        .iter()
                        .position(|t| t.name.eq_ignore_ascii_case(name));
                    match (kind, found) {
                        (SessionKind::Discovery, Some(i)) => report(&mut out, i),
                        (SessionKind::Normal { target }, Some(i)) if i == *target => {
                            report(&mut out, i)
                        }
                        // Unknown (or another) target: an empty answer.
                        _ => {}
                    }
                }
            },
            // Operational and declarative keys are negotiated only at login; an
            // initiator's declaration of a new MaxRecvDataSegmentLength is not taken.
            k if OPERATIONAL_KEYS.contains(&k)
                || matches!(
                    k,
                    "AuthMethod"
                        | "InitiatorName"
                        | "TargetName"
                        | "SessionType"
                        | "TargetAlias"
                        | "TargetAddress"
                        | "TargetPortalGroupTag"
                ) =>
            {
                out.push(&p.key, answer::REJECT);
            }
            _ => {
                out.push(&p.key, answer::NOT_UNDERSTOOD);
            }
        }
    }
    Ok(out.finish())
}

/// Why a Text Request could not be answered (the session answers with a Reject).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    /// The request text is malformed.
    #[error("bad text request: {0}")]
    Malformed(String),
    /// The request, joined, is longer than [`MAX_TEXT_REQUEST`].
    #[error("text request over {MAX_TEXT_REQUEST} bytes")]
    TooLong,
    /// A continuation names a Target Transfer Tag no exchange has.
    #[error("text continuation with an unknown target transfer tag {0:#x}")]
    UnknownTag(u32),
}

/// Where a text exchange stands.
#[derive(Debug, Default)]
enum Exchange {
    /// None in flight.
    #[default]
    Idle,
    /// Request text arriving in C-bit pieces.
    Gathering {
        itt: u32,
        ttt: u32,
        request: BytesMut,
    },
    /// An answer being handed out in pieces.
    Answering {
        itt: u32,
        ttt: u32,
        answer: Bytes,
        sent: usize,
    },
}

/// One text exchange of a session (one in flight at a time: RFC 7143 11.10.1).
#[derive(Debug, Default)]
pub struct TextExchange {
    state: Exchange,
}

impl TextExchange {
    /// No exchange yet.
    pub fn new() -> TextExchange {
        TextExchange::default()
    }

    /// Takes one Text Request and gives the Text Response to send (StatSN, ExpCmdSN and
    /// MaxCmdSN left for the session). `max_xmit` is the initiator's
    /// MaxRecvDataSegmentLength; `next_ttt` is a fresh Target Transfer Tag, used if
    /// this response has more to follow; `answer` answers a whole request text
    /// (normally [`respond`]). A request with the reserved TTT starts a new exchange,
    /// dropping any unfinished one.
    pub fn handle(
        &mut self,
        req: &TextReq,
        max_xmit: u32,
        next_ttt: u32,
        answer: impl FnOnce(&[u8]) -> Result<Bytes, String>,
    ) -> Result<TextResp, TextError> {
        let state = std::mem::take(&mut self.state);
        let state = if req.ttt == RESERVED_TAG {
            Exchange::Gathering {
                itt: req.itt,
                ttt: RESERVED_TAG,
                request: BytesMut::new(),
            }
        } else {
            match state {
                Exchange::Gathering { itt, ttt, .. } | Exchange::Answering { itt, ttt, .. }
                    if itt == req.itt && ttt == req.ttt =>
                {
                    state
                }
                _ => return Err(TextError::UnknownTag(req.ttt)),
            }
        };
        let mut resp = TextResp {
            lun: req.lun,
            itt: req.itt,
            ttt: RESERVED_TAG,
            ..TextResp::default()
        };
        let (answer, sent) = match state {
            Exchange::Gathering { mut request, .. } => {
                if request.len() + req.data.len() > MAX_TEXT_REQUEST {
                    return Err(TextError::TooLong);
                }
                request.extend_from_slice(&req.data);
                if req.cont {
                    // More request text follows: an empty answer asks for it.
                    resp.ttt = next_ttt;
                    self.state = Exchange::Gathering {
                        itt: req.itt,
                        ttt: next_ttt,
                        request,
                    };
                    return Ok(resp);
                }
                (answer(&request).map_err(TextError::Malformed)?, 0)
            }
            Exchange::Answering { answer, sent, .. } => (answer, sent),
            Exchange::Idle => return Err(TextError::UnknownTag(req.ttt)),
        };
        let room = (max_xmit.max(512) as usize).min(answer.len() - sent);
        resp.data = answer.slice(sent..sent + room);
        let sent = sent + room;
        if sent < answer.len() {
            resp.cont = true;
            resp.ttt = next_ttt;
            self.state = Exchange::Answering {
                itt: req.itt,
                ttt: next_ttt,
                answer,
                sent,
            };
        } else {
            resp.final_ = true;
        }
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::super::login::{Limits, LoginTarget};
    use super::*;

    fn config() -> LoginConfig {
        LoginConfig {
            targets: ["iqn.2026-12.io.vsan:a", "iqn.2026-12.io.vsan:b"]
                .into_iter()
                .map(|n| LoginTarget {
                    name: n.into(),
                    alias: None,
                    chap: None,
                    // Target b is reached through another portal group (a mirror
                    // node's own port of a shared target).
                    portal_group_tag: n.ends_with(":b").then_some(2),
                })
                .collect(),
            portal_group_tag: 1,
            limits: Limits::default(),
        }
    }

    fn ask(kind: SessionKind, text: &[u8]) -> Vec<u8> {
        respond(&config(), &kind, "127.0.0.1:3260", text)
            .unwrap()
            .to_vec()
    }

    #[test]
    fn send_targets_all_in_discovery_lists_every_target_with_its_portal() {
        assert_eq!(
            ask(SessionKind::Discovery, b"SendTargets=All\0"),
            b"TargetName=iqn.2026-12.io.vsan:a\0TargetAddress=127.0.0.1:3260,1\0\
              TargetName=iqn.2026-12.io.vsan:b\0TargetAddress=127.0.0.1:3260,2\0"
        );
        assert_eq!(
            ask(
                SessionKind::Discovery,
                b"SendTargets=iqn.2026-12.io.vsan:b\0"
            ),
            b"TargetName=iqn.2026-12.io.vsan:b\0TargetAddress=127.0.0.1:3260,2\0"
        );
        assert_eq!(ask(SessionKind::Discovery, b"SendTargets=iqn.nope\0"), b"");
    }

    #[test]
    fn send_targets_in_a_normal_session_reports_only_its_target() {
        let kind = SessionKind::Normal { target: 1 };
        let own = b"TargetName=iqn.2026-12.io.vsan:b\0TargetAddress=127.0.0.1:3260,2\0";
        assert_eq!(ask(kind, b"SendTargets=\0"), own);
        assert_eq!(ask(kind, b"SendTargets=iqn.2026-12.io.vsan:b\0"), own);
        assert_eq!(ask(kind, b"SendTargets=iqn.2026-12.io.vsan:a\0"), b"");
        assert_eq!(ask(kind, b"SendTargets=All\0"), b"SendTargets=Reject\0");
    }

    #[test]
    fn other_keys_are_rejected_or_not_understood_and_bad_text_is_an_error() {
        assert_eq!(
            ask(SessionKind::Discovery, b"MaxBurstLength=512\0X-foo=1\0"),
            b"MaxBurstLength=Reject\0X-foo=NotUnderstood\0"
        );
        assert!(respond(&config(), &SessionKind::Discovery, "p", b"SendTargets").is_err());
    }

    fn text_req(itt: u32, ttt: u32, cont: bool, data: &'static [u8]) -> TextReq {
        TextReq {
            header: [0; 48],
            immediate: true,
            final_: !cont,
            cont,
            lun: 0,
            itt,
            ttt,
            cmd_sn: 1,
            exp_stat_sn: 1,
            data: Bytes::from_static(data),
        }
    }

    #[test]
    fn long_answers_are_split_with_the_c_bit_and_a_transfer_tag() {
        let long: Bytes = Bytes::from(vec![b'x'; 1300]);
        let mut ex = TextExchange::new();
        let answer = |_: &[u8]| Ok(long.clone());
        let r1 = ex
            .handle(
                &text_req(5, RESERVED_TAG, false, b"SendTargets=All\0"),
                512,
                100,
                answer,
            )
            .unwrap();
        assert!(r1.cont && !r1.final_);
        assert_eq!((r1.ttt, r1.data.len()), (100, 512));
        let r2 = ex
            .handle(&text_req(5, 100, false, b""), 512, 101, |_| unreachable!())
            .unwrap();
        assert!(r2.cont && r2.ttt == 101 && r2.data.len() == 512);
        let r3 = ex
            .handle(&text_req(5, 101, false, b""), 512, 102, |_| unreachable!())
            .unwrap();
        assert!(!r3.cont && r3.final_ && r3.ttt == RESERVED_TAG);
        assert_eq!(r3.data.len(), 1300 - 1024);
        let joined: Vec<u8> = [r1.data, r2.data, r3.data].concat();
        assert_eq!(joined, long);
        // The exchange is over: the old tag is unknown.
        assert_eq!(
            ex.handle(&text_req(5, 101, false, b""), 512, 103, |_| unreachable!()),
            Err(TextError::UnknownTag(101))
        );
    }

    #[test]
    fn a_request_in_pieces_is_joined_before_it_is_answered() {
        let mut ex = TextExchange::new();
        let r = ex
            .handle(
                &text_req(9, RESERVED_TAG, true, b"SendTar"),
                8192,
                7,
                |_| unreachable!(),
            )
            .unwrap();
        assert!(r.data.is_empty() && !r.final_ && r.ttt == 7);
        let r = ex
            .handle(&text_req(9, 7, false, b"gets=All\0"), 8192, 8, |text| {
                assert_eq!(text, b"SendTargets=All\0");
                Ok(Bytes::from_static(b"TargetName=x\0"))
            })
            .unwrap();
        assert!(r.final_ && !r.cont && r.ttt == RESERVED_TAG);
        assert_eq!(&r.data[..], b"TargetName=x\0");
    }

    #[test]
    fn a_new_request_with_the_reserved_tag_resets_an_unfinished_exchange() {
        let mut ex = TextExchange::new();
        let long = Bytes::from(vec![b'y'; 2000]);
        ex.handle(&text_req(1, RESERVED_TAG, false, b"A=1\0"), 512, 50, |_| {
            Ok(long.clone())
        })
        .unwrap();
        let r = ex
            .handle(&text_req(2, RESERVED_TAG, false, b"B=1\0"), 512, 51, |t| {
                assert_eq!(t, b"B=1\0");
                Ok(Bytes::from_static(b"B=NotUnderstood\0"))
            })
            .unwrap();
        assert!(r.final_);
        assert_eq!(r.itt, 2);
    }
}
