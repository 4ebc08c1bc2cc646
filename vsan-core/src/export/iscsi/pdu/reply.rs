//! The PDUs a target sends: encoded by the target, decoded for tests and tools.

use bytes::{Bytes, BytesMut};

use super::frame::{Frame, Framer, be16, be32, be64, put_pdu, put16, put32, put64};
use super::request::reject;
use super::{
    AsyncMsg, BHS_LEN, DataIn, Digests, LoginResp, LogoutResp, MAX_DATA_SEGMENT_FIELD, NopIn,
    PduError, R2t, RESERVED_TAG, Reject, Reply, ScsiResponse, TaskMgmtResp, TextResp, opcode,
    reject_reason,
};

impl Reply {
    /// Appends one whole PDU (BHS, header digest, data segment, padding, data digest).
    /// A data segment is cut at the 24-bit limit; the session keeps them far smaller.
    pub fn encode(&self, digests: Digests, out: &mut BytesMut) {
        let mut h = [0u8; BHS_LEN];
        let bit = |b: bool, v: u8| if b { v } else { 0 };
        let sns = |h: &mut [u8; BHS_LEN], stat: u32, exp: u32, max: u32| {
            put32(h, 24, stat);
            put32(h, 28, exp);
            put32(h, 32, max);
        };
        let cap = |d: &[u8]| d.len().min(MAX_DATA_SEGMENT_FIELD as usize);
        match self {
            Reply::NopIn(r) => {
                h[0] = opcode::NOP_IN;
                h[1] = 0x80;
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put_pdu(h, &[], &r.data[..cap(&r.data)], digests, out);
            }
            Reply::ScsiResponse(r) => {
                h[0] = opcode::SCSI_RESPONSE;
                h[1] = 0x80
                    | bit(r.bidi_overflow, 0x10)
                    | bit(r.bidi_underflow, 0x08)
                    | bit(r.overflow, 0x04)
                    | bit(r.underflow, 0x02);
                h[2] = r.response;
                h[3] = r.status;
                put32(&mut h, 16, r.itt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put32(&mut h, 36, r.exp_data_sn);
                put32(&mut h, 40, r.bidi_residual);
                put32(&mut h, 44, r.residual);
                if r.sense.is_empty() {
                    put_pdu(h, &[], &[], digests, out);
                } else {
                    let sense = &r.sense[..r.sense.len().min(u16::MAX as usize)];
                    let mut data = Vec::with_capacity(2 + sense.len());
                    data.extend_from_slice(&(sense.len() as u16).to_be_bytes());
                    data.extend_from_slice(sense);
                    put_pdu(h, &[], &data, digests, out);
                }
            }
            Reply::TaskMgmtResp(r) => {
                h[0] = opcode::TASK_MGMT_RESP;
                h[1] = 0x80;
                h[2] = r.response;
                put32(&mut h, 16, r.itt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put_pdu(h, &[], &[], digests, out);
            }
            Reply::LoginResp(r) => {
                h[0] = opcode::LOGIN_RESP;
                h[1] = bit(r.transit, 0x80) | bit(r.cont, 0x40) | ((r.csg & 3) << 2) | (r.nsg & 3);
                h[2] = r.version_max;
                h[3] = r.version_active;
                h[8..14].copy_from_slice(&r.isid);
                put16(&mut h, 14, r.tsih);
                put32(&mut h, 16, r.itt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                h[36] = r.status_class;
                h[37] = r.status_detail;
                put_pdu(h, &[], &r.data[..cap(&r.data)], digests, out);
            }
            Reply::TextResp(r) => {
                h[0] = opcode::TEXT_RESP;
                h[1] = bit(r.final_, 0x80) | bit(r.cont, 0x40);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put_pdu(h, &[], &r.data[..cap(&r.data)], digests, out);
            }
            Reply::DataIn(r) => {
                h[0] = opcode::DATA_IN;
                let s = r.status.is_some();
                h[1] = bit(r.final_ || s, 0x80)
                    | bit(s && r.overflow, 0x04)
                    | bit(s && r.underflow, 0x02)
                    | bit(s, 0x01);
                h[3] = r.status.unwrap_or(0);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                sns(
                    &mut h,
                    if s { r.stat_sn } else { 0 },
                    r.exp_cmd_sn,
                    r.max_cmd_sn,
                );
                put32(&mut h, 36, r.data_sn);
                put32(&mut h, 40, r.offset);
                put32(&mut h, 44, if s { r.residual } else { 0 });
                put_pdu(h, &[], &r.data[..cap(&r.data)], digests, out);
            }
            Reply::LogoutResp(r) => {
                h[0] = opcode::LOGOUT_RESP;
                h[1] = 0x80;
                h[2] = r.response;
                put32(&mut h, 16, r.itt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put16(&mut h, 40, r.time2wait);
                put16(&mut h, 42, r.time2retain);
                put_pdu(h, &[], &[], digests, out);
            }
            Reply::R2t(r) => {
                h[0] = opcode::R2T;
                h[1] = 0x80;
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put32(&mut h, 36, r.r2t_sn);
                put32(&mut h, 40, r.offset);
                put32(&mut h, 44, r.len);
                put_pdu(h, &[], &[], digests, out);
            }
            Reply::Async(r) => {
                h[0] = opcode::ASYNC;
                h[1] = 0x80;
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, RESERVED_TAG);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                h[36] = r.event;
                h[37] = r.vcode;
                put16(&mut h, 38, r.param1);
                put16(&mut h, 40, r.param2);
                put16(&mut h, 42, r.param3);
                put_pdu(h, &[], &r.data[..cap(&r.data)], digests, out);
            }
            Reply::Reject(r) => {
                h[0] = opcode::REJECT;
                h[1] = 0x80;
                h[2] = r.reason;
                put32(&mut h, 16, RESERVED_TAG);
                sns(&mut h, r.stat_sn, r.exp_cmd_sn, r.max_cmd_sn);
                put32(&mut h, 36, r.data_sn);
                put_pdu(h, &[], &r.header, digests, out);
            }
        }
    }
}

/// Decodes the PDUs a target sends (the initiator side: tests and tools).
#[derive(Debug)]
pub struct ReplyDecoder {
    framer: Framer,
}

impl ReplyDecoder {
    /// A decoder accepting data segments up to `max_data_segment` bytes, no digests.
    pub fn new(max_data_segment: u32) -> ReplyDecoder {
        ReplyDecoder {
            framer: Framer::new(max_data_segment),
        }
    }

    /// Starts checking digests.
    pub fn set_digests(&mut self, d: Digests) {
        self.framer.digests = d;
    }

    /// Sets the largest data segment accepted.
    pub fn set_max_data_segment(&mut self, n: u32) {
        self.framer.max_data_segment = n;
    }

    /// Takes one whole PDU off the front of `buf`; `Ok(None)` if more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Reply>, PduError> {
        let Some(f) = self.framer.next(buf)? else {
            return Ok(None);
        };
        parse_reply(f).map(Some)
    }
}

pub(super) fn parse_reply(f: Frame) -> Result<Reply, PduError> {
    let h = &f.bhs;
    let op = h[0] & 0x3f;
    let flags = h[1];
    let lun = be64(h, 8);
    let itt = be32(h, 16);
    let (stat_sn, exp_cmd_sn, max_cmd_sn) = (be32(h, 24), be32(h, 28), be32(h, 32));
    if !f.ahs.is_empty() {
        return Err(reject(
            reject_reason::INVALID_PDU_FIELD,
            h,
            "a reply with an AHS",
        ));
    }
    Ok(match op {
        opcode::NOP_IN => Reply::NopIn(NopIn {
            lun,
            itt,
            ttt: be32(h, 20),
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            data: f.data,
        }),
        opcode::SCSI_RESPONSE => {
            let sense = if f.data.len() >= 2 {
                let n = usize::from(be16(&f.data, 0));
                if 2 + n > f.data.len() {
                    return Err(reject(
                        reject_reason::INVALID_PDU_FIELD,
                        h,
                        "SenseLength past the data segment",
                    ));
                }
                f.data.slice(2..2 + n)
            } else if f.data.is_empty() {
                Bytes::new()
            } else {
                return Err(reject(
                    reject_reason::INVALID_PDU_FIELD,
                    h,
                    "1-byte data segment",
                ));
            };
            Reply::ScsiResponse(ScsiResponse {
                itt,
                response: h[2],
                status: h[3],
                overflow: flags & 0x04 != 0,
                underflow: flags & 0x02 != 0,
                residual: be32(h, 44),
                bidi_overflow: flags & 0x10 != 0,
                bidi_underflow: flags & 0x08 != 0,
                bidi_residual: be32(h, 40),
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn,
                exp_data_sn: be32(h, 36),
                sense,
            })
        }
        opcode::TASK_MGMT_RESP => Reply::TaskMgmtResp(TaskMgmtResp {
            response: h[2],
            itt,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
        }),
        opcode::LOGIN_RESP => {
            let mut isid = [0u8; 6];
            isid.copy_from_slice(&h[8..14]);
            Reply::LoginResp(LoginResp {
                transit: flags & 0x80 != 0,
                cont: flags & 0x40 != 0,
                csg: (flags >> 2) & 3,
                nsg: flags & 3,
                version_max: h[2],
                version_active: h[3],
                isid,
                tsih: be16(h, 14),
                itt,
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn,
                status_class: h[36],
                status_detail: h[37],
                data: f.data,
            })
        }
        opcode::TEXT_RESP => Reply::TextResp(TextResp {
            final_: flags & 0x80 != 0,
            cont: flags & 0x40 != 0,
            lun,
            itt,
            ttt: be32(h, 20),
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            data: f.data,
        }),
        opcode::DATA_IN => {
            let s = flags & 0x01 != 0;
            Reply::DataIn(DataIn {
                final_: flags & 0x80 != 0,
                status: s.then_some(h[3]),
                overflow: s && flags & 0x04 != 0,
                underflow: s && flags & 0x02 != 0,
                residual: if s { be32(h, 44) } else { 0 },
                lun,
                itt,
                ttt: be32(h, 20),
                stat_sn: if s { stat_sn } else { 0 },
                exp_cmd_sn,
                max_cmd_sn,
                data_sn: be32(h, 36),
                offset: be32(h, 40),
                data: f.data,
            })
        }
        opcode::LOGOUT_RESP => Reply::LogoutResp(LogoutResp {
            response: h[2],
            itt,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            time2wait: be16(h, 40),
            time2retain: be16(h, 42),
        }),
        opcode::R2T => Reply::R2t(R2t {
            lun,
            itt,
            ttt: be32(h, 20),
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            r2t_sn: be32(h, 36),
            offset: be32(h, 40),
            len: be32(h, 44),
        }),
        opcode::ASYNC => Reply::Async(AsyncMsg {
            lun,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            event: h[36],
            vcode: h[37],
            param1: be16(h, 38),
            param2: be16(h, 40),
            param3: be16(h, 42),
            data: f.data,
        }),
        opcode::REJECT => {
            let Some(quoted) = f.data.get(..BHS_LEN) else {
                return Err(reject(
                    reject_reason::INVALID_PDU_FIELD,
                    h,
                    "a Reject without the rejected header",
                ));
            };
            let mut header = [0u8; BHS_LEN];
            header.copy_from_slice(quoted);
            Reply::Reject(Reject {
                reason: h[2],
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn,
                data_sn: be32(h, 36),
                header,
            })
        }
        _ => {
            return Err(reject(
                reject_reason::PROTOCOL_ERROR,
                h,
                format!("opcode {op:#04x} from a target"),
            ));
        }
    })
}
