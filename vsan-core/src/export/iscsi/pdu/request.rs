//! The PDUs an initiator sends: decoded by the target, encoded for tests and tools.

use bytes::BytesMut;

use super::frame::{Frame, Framer, be16, be32, be64, pad, put_pdu, put16, put32, put64};
use super::{
    AHS_BIDI_READ_LEN, AHS_EXTENDED_CDB, BHS_LEN, DataOut, Digests, LoginReq, LogoutReq, NopOut,
    PduError, Request, ScsiCommand, SnackReq, TaskMgmtReq, TextReq, opcode, reject_reason,
};

/// Decodes the PDUs an initiator sends (the target side).
#[derive(Debug)]
pub struct Decoder {
    framer: Framer,
}

impl Decoder {
    /// A decoder for a connection in the login phase (no digests) whose data segments
    /// may be up to `max_data_segment` bytes (8192 until login negotiates more).
    pub fn new(max_data_segment: u32) -> Decoder {
        Decoder {
            framer: Framer::new(max_data_segment),
        }
    }

    /// Starts checking the digests negotiated at login (from the next PDU on).
    pub fn set_digests(&mut self, d: Digests) {
        self.framer.digests = d;
    }

    /// Sets the largest data segment accepted (our MaxRecvDataSegmentLength).
    pub fn set_max_data_segment(&mut self, n: u32) {
        self.framer.max_data_segment = n;
    }

    /// The digests checked now.
    pub fn digests(&self) -> Digests {
        self.framer.digests
    }

    /// Takes one whole PDU off the front of `buf` (BHS, AHS, header digest, data segment
    /// and padding, data digest): `Ok(None)` if more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Request>, PduError> {
        let Some(frame) = self.framer.next(buf)? else {
            return Ok(None);
        };
        parse_request(frame).map(Some)
    }
}

pub(super) fn reject(reason: u8, header: &[u8; BHS_LEN], detail: impl Into<String>) -> PduError {
    PduError::Reject {
        reason,
        header: *header,
        detail: detail.into(),
    }
}

pub(super) fn parse_request(f: Frame) -> Result<Request, PduError> {
    let h = &f.bhs;
    let immediate = h[0] & 0x40 != 0;
    let op = h[0] & 0x3f;
    let flags = h[1];
    let lun = be64(h, 8);
    let itt = be32(h, 16);
    // Only a SCSI Command may carry an AHS.
    if op != opcode::SCSI_COMMAND && !f.ahs.is_empty() {
        return Err(reject(
            reject_reason::INVALID_PDU_FIELD,
            h,
            format!("opcode {op:#04x} with an AHS"),
        ));
    }
    let no_data = |what: &str| {
        if f.data.is_empty() {
            Ok(())
        } else {
            Err(reject(
                reject_reason::INVALID_PDU_FIELD,
                h,
                format!("{what} with a data segment"),
            ))
        }
    };
    Ok(match op {
        opcode::NOP_OUT => Request::NopOut(NopOut {
            header: *h,
            immediate,
            lun,
            itt,
            ttt: be32(h, 20),
            cmd_sn: be32(h, 24),
            exp_stat_sn: be32(h, 28),
            data: f.data,
        }),
        opcode::SCSI_COMMAND => {
            let mut cdb = BytesMut::from(&h[32..48]);
            let mut bidi_read_len = None;
            let mut ahs = &f.ahs[..];
            let mut seen_ext = false;
            while !ahs.is_empty() {
                if ahs.len() < 4 {
                    return Err(reject(reject_reason::INVALID_PDU_FIELD, h, "truncated AHS"));
                }
                let len = usize::from(be16(ahs, 0));
                let kind = ahs[2];
                let size = 3 + len + pad(3 + len);
                if len == 0 || size > ahs.len() {
                    return Err(reject(
                        reject_reason::INVALID_PDU_FIELD,
                        h,
                        format!("AHS length {len} past TotalAHSLength"),
                    ));
                }
                // The byte after the type is reserved in both types we know.
                let body = &ahs[4..3 + len];
                match kind {
                    AHS_EXTENDED_CDB if !seen_ext => {
                        seen_ext = true;
                        cdb.extend_from_slice(body);
                    }
                    AHS_BIDI_READ_LEN if len == 5 && bidi_read_len.is_none() => {
                        bidi_read_len = Some(be32(body, 0));
                    }
                    _ => {
                        return Err(reject(
                            reject_reason::INVALID_PDU_FIELD,
                            h,
                            format!("AHS type {kind} of length {len}"),
                        ));
                    }
                }
                ahs = &ahs[size..];
            }
            Request::Command(ScsiCommand {
                header: *h,
                immediate,
                final_: flags & 0x80 != 0,
                read: flags & 0x40 != 0,
                write: flags & 0x20 != 0,
                attr: flags & 0x07,
                lun,
                itt,
                expected_len: be32(h, 20),
                cmd_sn: be32(h, 24),
                exp_stat_sn: be32(h, 28),
                cdb: cdb.freeze(),
                bidi_read_len,
                data: f.data,
            })
        }
        opcode::TASK_MGMT => {
            no_data("a task management request")?;
            Request::TaskMgmt(TaskMgmtReq {
                header: *h,
                immediate,
                function: flags & 0x7f,
                lun,
                itt,
                ref_itt: be32(h, 20),
                cmd_sn: be32(h, 24),
                exp_stat_sn: be32(h, 28),
                ref_cmd_sn: be32(h, 32),
                exp_data_sn: be32(h, 36),
            })
        }
        opcode::LOGIN => {
            let mut isid = [0u8; 6];
            isid.copy_from_slice(&h[8..14]);
            Request::Login(LoginReq {
                header: *h,
                transit: flags & 0x80 != 0,
                cont: flags & 0x40 != 0,
                csg: (flags >> 2) & 3,
                nsg: flags & 3,
                version_max: h[2],
                version_min: h[3],
                isid,
                tsih: be16(h, 14),
                itt,
                cid: be16(h, 20),
                cmd_sn: be32(h, 24),
                exp_stat_sn: be32(h, 28),
                data: f.data,
            })
        }
        opcode::TEXT => Request::Text(TextReq {
            header: *h,
            immediate,
            final_: flags & 0x80 != 0,
            cont: flags & 0x40 != 0,
            lun,
            itt,
            ttt: be32(h, 20),
            cmd_sn: be32(h, 24),
            exp_stat_sn: be32(h, 28),
            data: f.data,
        }),
        opcode::DATA_OUT => Request::DataOut(DataOut {
            header: *h,
            final_: flags & 0x80 != 0,
            lun,
            itt,
            ttt: be32(h, 20),
            exp_stat_sn: be32(h, 28),
            data_sn: be32(h, 36),
            offset: be32(h, 40),
            data: f.data,
        }),
        opcode::LOGOUT => {
            no_data("a logout request")?;
            Request::Logout(LogoutReq {
                header: *h,
                immediate,
                reason: flags & 0x7f,
                itt,
                cid: be16(h, 20),
                cmd_sn: be32(h, 24),
                exp_stat_sn: be32(h, 28),
            })
        }
        opcode::SNACK => {
            no_data("a SNACK")?;
            Request::Snack(SnackReq {
                header: *h,
                kind: flags & 0x0f,
                lun,
                itt,
                ttt: be32(h, 20),
                exp_stat_sn: be32(h, 28),
                beg_run: be32(h, 40),
                run_length: be32(h, 44),
            })
        }
        0x20..=0x3f => {
            return Err(reject(
                reject_reason::PROTOCOL_ERROR,
                h,
                format!("target opcode {op:#04x} from an initiator"),
            ));
        }
        _ => {
            return Err(reject(
                reject_reason::COMMAND_NOT_SUPPORTED,
                h,
                format!("opcode {op:#04x}"),
            ));
        }
    })
}

impl Request {
    /// The raw BHS it was decoded from (what a Reject quotes).
    pub fn header(&self) -> &[u8; BHS_LEN] {
        match self {
            Request::NopOut(r) => &r.header,
            Request::Command(r) => &r.header,
            Request::TaskMgmt(r) => &r.header,
            Request::Login(r) => &r.header,
            Request::Text(r) => &r.header,
            Request::DataOut(r) => &r.header,
            Request::Logout(r) => &r.header,
            Request::Snack(r) => &r.header,
        }
    }

    /// The raw BHS, to overwrite (tests compare requests with it cleared).
    pub fn header_mut(&mut self) -> &mut [u8; BHS_LEN] {
        match self {
            Request::NopOut(r) => &mut r.header,
            Request::Command(r) => &mut r.header,
            Request::TaskMgmt(r) => &mut r.header,
            Request::Login(r) => &mut r.header,
            Request::Text(r) => &mut r.header,
            Request::DataOut(r) => &mut r.header,
            Request::Logout(r) => &mut r.header,
            Request::Snack(r) => &mut r.header,
        }
    }

    /// Appends the PDU as an initiator sends it (the `header` fields are ignored: the
    /// BHS is built from the other fields, reserved bits zero). A CDB shorter than 16
    /// bytes is zero-padded; a longer one gets an Extended-CDB AHS.
    pub fn encode(&self, digests: Digests, out: &mut BytesMut) {
        let mut h = [0u8; BHS_LEN];
        let imm = |i: bool| if i { 0x40 } else { 0 };
        let bit = |b: bool, v: u8| if b { v } else { 0 };
        match self {
            Request::NopOut(r) => {
                h[0] = opcode::NOP_OUT | imm(r.immediate);
                h[1] = 0x80;
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                put32(&mut h, 24, r.cmd_sn);
                put32(&mut h, 28, r.exp_stat_sn);
                put_pdu(h, &[], &r.data, digests, out);
            }
            Request::Command(r) => {
                h[0] = opcode::SCSI_COMMAND | imm(r.immediate);
                h[1] = bit(r.final_, 0x80) | bit(r.read, 0x40) | bit(r.write, 0x20) | (r.attr & 7);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.expected_len);
                put32(&mut h, 24, r.cmd_sn);
                put32(&mut h, 28, r.exp_stat_sn);
                let n = r.cdb.len().min(16);
                h[32..32 + n].copy_from_slice(&r.cdb[..n]);
                let mut ahs = Vec::new();
                if r.cdb.len() > 16 {
                    // At most what the 8-bit TotalAHSLength leaves room for.
                    let room = 255 * 4 - 4 - if r.bidi_read_len.is_some() { 8 } else { 0 };
                    let ext = &r.cdb[16..r.cdb.len().min(16 + room)];
                    ahs.extend_from_slice(&((ext.len() + 1) as u16).to_be_bytes());
                    ahs.push(AHS_EXTENDED_CDB);
                    ahs.push(0);
                    ahs.extend_from_slice(ext);
                    ahs.resize(ahs.len() + pad(ahs.len()), 0);
                }
                if let Some(len) = r.bidi_read_len {
                    ahs.extend_from_slice(&[0, 5, AHS_BIDI_READ_LEN, 0]);
                    ahs.extend_from_slice(&len.to_be_bytes());
                }
                put_pdu(h, &ahs, &r.data, digests, out);
            }
            Request::TaskMgmt(r) => {
                h[0] = opcode::TASK_MGMT | imm(r.immediate);
                h[1] = 0x80 | (r.function & 0x7f);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ref_itt);
                put32(&mut h, 24, r.cmd_sn);
                put32(&mut h, 28, r.exp_stat_sn);
                put32(&mut h, 32, r.ref_cmd_sn);
                put32(&mut h, 36, r.exp_data_sn);
                put_pdu(h, &[], &[], digests, out);
            }
            Request::Login(r) => {
                h[0] = opcode::LOGIN | 0x40;
                h[1] = bit(r.transit, 0x80) | bit(r.cont, 0x40) | ((r.csg & 3) << 2) | (r.nsg & 3);
                h[2] = r.version_max;
                h[3] = r.version_min;
                h[8..14].copy_from_slice(&r.isid);
                put16(&mut h, 14, r.tsih);
                put32(&mut h, 16, r.itt);
                put16(&mut h, 20, r.cid);
                put32(&mut h, 24, r.cmd_sn);
                put32(&mut h, 28, r.exp_stat_sn);
                put_pdu(h, &[], &r.data, digests, out);
            }
            Request::Text(r) => {
                h[0] = opcode::TEXT | imm(r.immediate);
                h[1] = bit(r.final_, 0x80) | bit(r.cont, 0x40);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                put32(&mut h, 24, r.cmd_sn);
                put32(&mut h, 28, r.exp_stat_sn);
                put_pdu(h, &[], &r.data, digests, out);
            }
            Request::DataOut(r) => {
                h[0] = opcode::DATA_OUT;
                h[1] = bit(r.final_, 0x80);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                put32(&mut h, 28, r.exp_stat_sn);
                put32(&mut h, 36, r.data_sn);
                put32(&mut h, 40, r.offset);
                put_pdu(h, &[], &r.data, digests, out);
            }
            Request::Logout(r) => {
                h[0] = opcode::LOGOUT | imm(r.immediate);
                h[1] = 0x80 | (r.reason & 0x7f);
                put32(&mut h, 16, r.itt);
                put16(&mut h, 20, r.cid);
                put32(&mut h, 24, r.cmd_sn);
                put32(&mut h, 28, r.exp_stat_sn);
                put_pdu(h, &[], &[], digests, out);
            }
            Request::Snack(r) => {
                h[0] = opcode::SNACK;
                h[1] = 0x80 | (r.kind & 0x0f);
                put64(&mut h, 8, r.lun);
                put32(&mut h, 16, r.itt);
                put32(&mut h, 20, r.ttt);
                put32(&mut h, 28, r.exp_stat_sn);
                put32(&mut h, 40, r.beg_run);
                put32(&mut h, 44, r.run_length);
                put_pdu(h, &[], &[], digests, out);
            }
        }
    }
}
