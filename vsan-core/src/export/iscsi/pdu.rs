//! iSCSI PDUs (RFC 7143 section 11): the 48-byte Basic Header Segment, additional
//! header segments, CRC32C digests and padded data segments.
//!
//! [`Decoder`] is total: whatever bytes arrive, [`Decoder::decode`] gives a whole
//! [`Request`], "need more bytes" (`Ok(None)`), or a [`PduError`] saying whether the
//! connection's framing can still be trusted. It never allocates from a length the peer
//! declares beyond the negotiated data segment limit: a longer data segment is answered
//! with a Reject and skipped as it arrives, never buffered.
//!
//! ```text
//!  0      48        48+AHS     +4 (HeaderDigest)   +DSL+pad          +4 (DataDigest)
//!  | BHS  | AHS ... | CRC32C   | data segment ... 0-3 pad | CRC32C  |
//! ```
//!
//! The target side decodes [`Request`]s and encodes [`Reply`]s; the opposite directions
//! ([`Request::encode`], [`ReplyDecoder`]) are for tests, fuzzing and initiator tools.
//! Every integer on the wire is big-endian; digests are CRC32C sent least significant
//! byte first (RFC 7143 appendix B.4).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Length of the Basic Header Segment.
pub const BHS_LEN: usize = 48;
/// Length of a digest on the wire.
pub const DIGEST_LEN: usize = 4;
/// The data segment limit before any is negotiated (the MaxRecvDataSegmentLength default).
pub const DEFAULT_MAX_DATA_SEGMENT: u32 = 8192;
/// The largest data segment the 24-bit DataSegmentLength field can describe.
pub const MAX_DATA_SEGMENT_FIELD: u32 = (1 << 24) - 1;

/// Initiator opcodes.
pub mod opcode {
    /// NOP-Out.
    pub const NOP_OUT: u8 = 0x00;
    /// SCSI Command.
    pub const SCSI_COMMAND: u8 = 0x01;
    /// SCSI Task Management Function Request.
    pub const TASK_MGMT: u8 = 0x02;
    /// Login Request.
    pub const LOGIN: u8 = 0x03;
    /// Text Request.
    pub const TEXT: u8 = 0x04;
    /// SCSI Data-Out.
    pub const DATA_OUT: u8 = 0x05;
    /// Logout Request.
    pub const LOGOUT: u8 = 0x06;
    /// SNACK Request.
    pub const SNACK: u8 = 0x10;
    /// NOP-In.
    pub const NOP_IN: u8 = 0x20;
    /// SCSI Response.
    pub const SCSI_RESPONSE: u8 = 0x21;
    /// SCSI Task Management Function Response.
    pub const TASK_MGMT_RESP: u8 = 0x22;
    /// Login Response.
    pub const LOGIN_RESP: u8 = 0x23;
    /// Text Response.
    pub const TEXT_RESP: u8 = 0x24;
    /// SCSI Data-In.
    pub const DATA_IN: u8 = 0x25;
    /// Logout Response.
    pub const LOGOUT_RESP: u8 = 0x26;
    /// Ready To Transfer.
    pub const R2T: u8 = 0x31;
    /// Asynchronous Message.
    pub const ASYNC: u8 = 0x32;
    /// Reject.
    pub const REJECT: u8 = 0x3f;
}

/// Reject reason codes (RFC 7143 11.17.1).
pub mod reject_reason {
    /// Data (payload) digest error.
    pub const DATA_DIGEST_ERROR: u8 = 0x02;
    /// SNACK reject.
    pub const SNACK_REJECT: u8 = 0x03;
    /// Protocol error (e.g. a SNACK for a status already acknowledged).
    pub const PROTOCOL_ERROR: u8 = 0x04;
    /// Command not supported.
    pub const COMMAND_NOT_SUPPORTED: u8 = 0x05;
    /// Immediate command reject: too many immediate commands.
    pub const IMMEDIATE_COMMAND_REJECT: u8 = 0x06;
    /// Task in progress.
    pub const TASK_IN_PROGRESS: u8 = 0x07;
    /// Invalid data ACK.
    pub const INVALID_DATA_ACK: u8 = 0x08;
    /// Invalid PDU field.
    pub const INVALID_PDU_FIELD: u8 = 0x09;
    /// Long op reject: out of resources to generate a target task tag.
    pub const LONG_OP_REJECT: u8 = 0x0a;
    /// Waiting for Logout.
    pub const WAITING_FOR_LOGOUT: u8 = 0x0c;
}

/// The reserved task tag (no task), used by unsolicited PDUs.
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// AHS types.
const AHS_EXTENDED_CDB: u8 = 1;
const AHS_BIDI_READ_LEN: u8 = 2;

/// Which CRC32C digests a connection carries (negotiated by HeaderDigest/DataDigest).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    /// A digest after the BHS and AHS.
    pub header: bool,
    /// A digest after a non-empty data segment and its padding.
    pub data: bool,
}

/// Why a PDU could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PduError {
    /// The framing cannot be trusted any more (a header digest error, say): close the
    /// connection.
    #[error("iSCSI framing lost: {0}")]
    Fatal(String),
    /// One PDU is bad but the framing is intact: answer a Reject with `reason` quoting
    /// `header`, and go on. The PDU's bytes were consumed (or are being skipped).
    #[error("iSCSI PDU rejected (reason {reason:#04x}): {detail}")]
    Reject {
        /// RFC 7143 11.17.1 reason code.
        reason: u8,
        /// The offending BHS.
        header: [u8; BHS_LEN],
        /// What was wrong, for the log.
        detail: String,
    },
}

/// A PDU from an initiator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// NOP-Out.
    NopOut(NopOut),
    /// SCSI Command.
    Command(ScsiCommand),
    /// Task Management Function Request.
    TaskMgmt(TaskMgmtReq),
    /// Login Request.
    Login(LoginReq),
    /// Text Request.
    Text(TextReq),
    /// SCSI Data-Out.
    DataOut(DataOut),
    /// Logout Request.
    Logout(LogoutReq),
    /// SNACK Request.
    Snack(SnackReq),
}

/// SCSI Command (RFC 7143 11.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScsiCommand {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// No unsolicited Data-Out follows (F bit).
    pub final_: bool,
    /// Data from the target is expected (R bit).
    pub read: bool,
    /// Data to the target is expected (W bit).
    pub write: bool,
    /// Task attribute (0 untagged, 1 simple, 2 ordered, 3 head of queue, 4 ACA).
    pub attr: u8,
    /// The LUN field, as sent.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Expected Data Transfer Length.
    pub expected_len: u32,
    /// CmdSN.
    pub cmd_sn: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// The 16-byte CDB, extended by an Extended-CDB AHS if present.
    pub cdb: Bytes,
    /// Bidirectional Read Expected Data Transfer Length (its AHS), if sent.
    pub bidi_read_len: Option<u32>,
    /// Immediate data.
    pub data: Bytes,
}

/// SCSI Data-Out (RFC 7143 11.7).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataOut {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Last PDU of the sequence (F bit).
    pub final_: bool,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Target Transfer Tag (the R2T's, or the reserved tag for unsolicited data).
    pub ttt: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// DataSN.
    pub data_sn: u32,
    /// Buffer Offset.
    pub offset: u32,
    /// The data.
    pub data: Bytes,
}

/// NOP-Out (RFC 7143 11.18).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NopOut {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag (the reserved tag when answering a NOP-In).
    pub itt: u32,
    /// Target Transfer Tag (the NOP-In's when answering one).
    pub ttt: u32,
    /// CmdSN.
    pub cmd_sn: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// Ping data, echoed in the NOP-In.
    pub data: Bytes,
}

/// Task Management Function Request (RFC 7143 11.5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskMgmtReq {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// Function (1 ABORT TASK ... 8 TASK REASSIGN).
    pub function: u8,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Referenced Task Tag.
    pub ref_itt: u32,
    /// CmdSN.
    pub cmd_sn: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// RefCmdSN.
    pub ref_cmd_sn: u32,
    /// ExpDataSN.
    pub exp_data_sn: u32,
}

/// Login Request (RFC 7143 11.12).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoginReq {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Transit to the next stage (T bit).
    pub transit: bool,
    /// The text continues in the next Login Request (C bit).
    pub cont: bool,
    /// Current stage (0 security, 1 operational, 3 full feature).
    pub csg: u8,
    /// Next stage.
    pub nsg: u8,
    /// Version-max.
    pub version_max: u8,
    /// Version-min.
    pub version_min: u8,
    /// ISID.
    pub isid: [u8; 6],
    /// TSIH (0 for a new session).
    pub tsih: u16,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Connection ID.
    pub cid: u16,
    /// CmdSN.
    pub cmd_sn: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// Text keys.
    pub data: Bytes,
}

/// Text Request (RFC 7143 11.10).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextReq {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// Last PDU of the request (F bit).
    pub final_: bool,
    /// The text continues in the next Text Request (C bit).
    pub cont: bool,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Target Transfer Tag (the reserved tag to start, the target's to continue).
    pub ttt: u32,
    /// CmdSN.
    pub cmd_sn: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// Text keys.
    pub data: Bytes,
}

/// Logout Request (RFC 7143 11.14).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogoutReq {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Immediate delivery (I bit).
    pub immediate: bool,
    /// Reason (0 close the session, 1 the connection, 2 remove it for recovery).
    pub reason: u8,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Connection ID.
    pub cid: u16,
    /// CmdSN.
    pub cmd_sn: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
}

/// SNACK Request (RFC 7143 11.16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnackReq {
    /// The raw BHS.
    pub header: [u8; BHS_LEN],
    /// Type (0 Data/R2T, 1 status, 2 DataACK, 3 R-Data).
    pub kind: u8,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Target Transfer Tag.
    pub ttt: u32,
    /// ExpStatSN.
    pub exp_stat_sn: u32,
    /// BegRun.
    pub beg_run: u32,
    /// RunLength.
    pub run_length: u32,
}

/// A PDU from the target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// NOP-In.
    NopIn(NopIn),
    /// SCSI Response.
    ScsiResponse(ScsiResponse),
    /// Task Management Function Response.
    TaskMgmtResp(TaskMgmtResp),
    /// Login Response.
    LoginResp(LoginResp),
    /// Text Response.
    TextResp(TextResp),
    /// SCSI Data-In.
    DataIn(DataIn),
    /// Logout Response.
    LogoutResp(LogoutResp),
    /// Ready To Transfer.
    R2t(R2t),
    /// Asynchronous Message.
    Async(AsyncMsg),
    /// Reject.
    Reject(Reject),
}

/// SCSI Response (RFC 7143 11.4).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScsiResponse {
    /// Initiator Task Tag.
    pub itt: u32,
    /// iSCSI response (0 command completed at target, 1 target failure).
    pub response: u8,
    /// SCSI status.
    pub status: u8,
    /// Residual overflow (O bit).
    pub overflow: bool,
    /// Residual underflow (U bit).
    pub underflow: bool,
    /// Residual Count.
    pub residual: u32,
    /// Bidirectional read residual overflow (o bit).
    pub bidi_overflow: bool,
    /// Bidirectional read residual underflow (u bit).
    pub bidi_underflow: bool,
    /// Bidirectional Read Residual Count.
    pub bidi_residual: u32,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// ExpDataSN (Data-In and R2T PDUs sent for the command).
    pub exp_data_sn: u32,
    /// Raw sense data; the encoder prefixes the 2-byte SenseLength.
    pub sense: Bytes,
}

/// SCSI Data-In (RFC 7143 11.7).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataIn {
    /// Last PDU of the sequence (F bit).
    pub final_: bool,
    /// The S bit, with this status: the command's status collapsed into this PDU.
    pub status: Option<u8>,
    /// Residual overflow (valid with `status`).
    pub overflow: bool,
    /// Residual underflow (valid with `status`).
    pub underflow: bool,
    /// Residual Count (valid with `status`).
    pub residual: u32,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Target Transfer Tag (reserved unless an ACK is asked for).
    pub ttt: u32,
    /// StatSN (valid with `status`).
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// DataSN.
    pub data_sn: u32,
    /// Buffer Offset.
    pub offset: u32,
    /// The data.
    pub data: Bytes,
}

/// Ready To Transfer (RFC 7143 11.8).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct R2t {
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Target Transfer Tag the Data-Out PDUs carry back.
    pub ttt: u32,
    /// StatSN (the next one, not advanced).
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// R2TSN.
    pub r2t_sn: u32,
    /// Buffer Offset.
    pub offset: u32,
    /// Desired Data Transfer Length.
    pub len: u32,
}

/// NOP-In (RFC 7143 11.19).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NopIn {
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag (the NOP-Out's, or reserved for a target ping).
    pub itt: u32,
    /// Target Transfer Tag (reserved, or a tag the initiator must answer).
    pub ttt: u32,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// Ping data.
    pub data: Bytes,
}

/// Task Management Function Response (RFC 7143 11.6).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskMgmtResp {
    /// Response (0 function complete, 1 task does not exist, ...).
    pub response: u8,
    /// Initiator Task Tag.
    pub itt: u32,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
}

/// Login Response (RFC 7143 11.13).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoginResp {
    /// Transit to the next stage (T bit).
    pub transit: bool,
    /// The text continues in the next Login Response (C bit).
    pub cont: bool,
    /// Current stage.
    pub csg: u8,
    /// Next stage.
    pub nsg: u8,
    /// Version-max.
    pub version_max: u8,
    /// Version-active.
    pub version_active: u8,
    /// ISID.
    pub isid: [u8; 6],
    /// TSIH (set in the final response).
    pub tsih: u16,
    /// Initiator Task Tag.
    pub itt: u32,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// Status-Class (0 success, 1 redirection, 2 initiator error, 3 target error).
    pub status_class: u8,
    /// Status-Detail.
    pub status_detail: u8,
    /// Text keys.
    pub data: Bytes,
}

/// Text Response (RFC 7143 11.11).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextResp {
    /// Last PDU of the response (F bit).
    pub final_: bool,
    /// The text continues in the next Text Response (C bit).
    pub cont: bool,
    /// LUN.
    pub lun: u64,
    /// Initiator Task Tag.
    pub itt: u32,
    /// Target Transfer Tag (reserved when final, else one to continue with).
    pub ttt: u32,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// Text keys.
    pub data: Bytes,
}

/// Logout Response (RFC 7143 11.15).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogoutResp {
    /// Response (0 closed successfully, 1 CID not found, ...).
    pub response: u8,
    /// Initiator Task Tag.
    pub itt: u32,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// Time2Wait.
    pub time2wait: u16,
    /// Time2Retain.
    pub time2retain: u16,
}

/// Asynchronous Message (RFC 7143 11.9).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncMsg {
    /// LUN.
    pub lun: u64,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// AsyncEvent (0 SCSI event with sense data, 1 logout request, ...).
    pub event: u8,
    /// AsyncVCode.
    pub vcode: u8,
    /// Parameter1.
    pub param1: u16,
    /// Parameter2.
    pub param2: u16,
    /// Parameter3.
    pub param3: u16,
    /// Sense data and iSCSI event data, as sent.
    pub data: Bytes,
}

/// Reject (RFC 7143 11.17).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// Reason code ([`reject_reason`]).
    pub reason: u8,
    /// StatSN.
    pub stat_sn: u32,
    /// ExpCmdSN.
    pub exp_cmd_sn: u32,
    /// MaxCmdSN.
    pub max_cmd_sn: u32,
    /// DataSN/R2TSN (for a rejected SNACK).
    pub data_sn: u32,
    /// The rejected PDU's BHS, sent as the data segment.
    pub header: [u8; BHS_LEN],
}

// --- framing ---------------------------------------------------------------------

/// CRC32C as the digests carry it.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn be16(b: &[u8], at: usize) -> u16 {
    let mut v = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        v.copy_from_slice(s);
    }
    u16::from_be_bytes(v)
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        v.copy_from_slice(s);
    }
    u32::from_be_bytes(v)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        v.copy_from_slice(s);
    }
    u64::from_be_bytes(v)
}

fn put16(b: &mut [u8; BHS_LEN], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

fn put32(b: &mut [u8; BHS_LEN], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(b: &mut [u8; BHS_LEN], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Bytes of padding after a segment of `len` bytes.
fn pad(len: usize) -> usize {
    (4 - len % 4) % 4
}

/// One PDU cut off the stream: the BHS, the AHS and the data segment (without padding).
struct Frame {
    bhs: [u8; BHS_LEN],
    ahs: Bytes,
    data: Bytes,
}

/// Cuts whole PDUs off a byte stream, checking digests and the data segment limit.
#[derive(Debug)]
struct Framer {
    max_data_segment: u32,
    digests: Digests,
    /// Bytes of an oversized PDU still to throw away as they arrive.
    skip: usize,
}

impl Framer {
    fn new(max_data_segment: u32) -> Framer {
        Framer {
            max_data_segment,
            digests: Digests::default(),
            skip: 0,
        }
    }

    fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, PduError> {
        if self.skip > 0 {
            let n = self.skip.min(buf.len());
            buf.advance(n);
            self.skip -= n;
            if self.skip > 0 {
                return Ok(None);
            }
        }
        if buf.len() < BHS_LEN {
            return Ok(None);
        }
        let mut bhs = [0u8; BHS_LEN];
        bhs.copy_from_slice(&buf[..BHS_LEN]);
        let ahs_len = usize::from(bhs[4]) * 4;
        let dsl = be32(&bhs, 4) & MAX_DATA_SEGMENT_FIELD;
        let hd = if self.digests.header { DIGEST_LEN } else { 0 };
        let head_len = BHS_LEN + ahs_len + hd;
        let data_len = dsl as usize;
        let dd = if self.digests.data && data_len > 0 {
            DIGEST_LEN
        } else {
            0
        };
        let total = head_len + data_len + pad(data_len) + dd;
        if dsl > self.max_data_segment {
            // Check the header before trusting its length enough to skip by it.
            if buf.len() < head_len {
                return Ok(None);
            }
            self.check_header_digest(&buf[..head_len])?;
            let have = buf.len().min(total);
            buf.advance(have);
            self.skip = total - have;
            return Err(PduError::Reject {
                reason: reject_reason::PROTOCOL_ERROR,
                header: bhs,
                detail: format!(
                    "data segment of {dsl} bytes over the limit of {}",
                    self.max_data_segment
                ),
            });
        }
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        let mut pdu = buf.split_to(total).freeze();
        self.check_header_digest(&pdu[..head_len])?;
        let head = pdu.split_to(head_len);
        let ahs = head.slice(BHS_LEN..BHS_LEN + ahs_len);
        let padded = data_len + pad(data_len);
        if dd > 0 {
            let want = crc32c(&pdu[..padded]);
            let got = u32::from_le_bytes([
                pdu[padded],
                pdu[padded + 1],
                pdu[padded + 2],
                pdu[padded + 3],
            ]);
            if want != got {
                return Err(PduError::Reject {
                    reason: reject_reason::DATA_DIGEST_ERROR,
                    header: bhs,
                    detail: format!("data digest {got:#010x}, computed {want:#010x}"),
                });
            }
        }
        Ok(Some(Frame {
            bhs,
            ahs,
            data: pdu.slice(..data_len),
        }))
    }

    fn check_header_digest(&self, head: &[u8]) -> Result<(), PduError> {
        if !self.digests.header {
            return Ok(());
        }
        let n = head.len() - DIGEST_LEN;
        let want = crc32c(&head[..n]);
        let got = u32::from_le_bytes([head[n], head[n + 1], head[n + 2], head[n + 3]]);
        if want != got {
            return Err(PduError::Fatal(format!(
                "header digest {got:#010x}, computed {want:#010x}"
            )));
        }
        Ok(())
    }
}

/// Appends one whole PDU: `bhs` (its TotalAHSLength and DataSegmentLength filled in
/// here), `ahs` (a multiple of 4 bytes), `data` with its padding, and the digests.
fn put_pdu(mut bhs: [u8; BHS_LEN], ahs: &[u8], data: &[u8], digests: Digests, out: &mut BytesMut) {
    debug_assert!(ahs.len() % 4 == 0 && ahs.len() <= 255 * 4);
    debug_assert!(data.len() <= MAX_DATA_SEGMENT_FIELD as usize);
    bhs[4] = (ahs.len() / 4) as u8;
    let dsl = (data.len() as u32)
        .min(MAX_DATA_SEGMENT_FIELD)
        .to_be_bytes();
    bhs[5..8].copy_from_slice(&dsl[1..]);
    let padding = pad(data.len());
    out.reserve(BHS_LEN + ahs.len() + data.len() + padding + 2 * DIGEST_LEN);
    let start = out.len();
    out.put_slice(&bhs);
    out.put_slice(ahs);
    if digests.header {
        let crc = crc32c(&out[start..]);
        out.put_u32_le(crc);
    }
    if !data.is_empty() {
        let start = out.len();
        out.put_slice(data);
        out.put_bytes(0, padding);
        if digests.data {
            let crc = crc32c(&out[start..]);
            out.put_u32_le(crc);
        }
    }
}

// --- requests --------------------------------------------------------------------

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

fn reject(reason: u8, header: &[u8; BHS_LEN], detail: impl Into<String>) -> PduError {
    PduError::Reject {
        reason,
        header: *header,
        detail: detail.into(),
    }
}

fn parse_request(f: Frame) -> Result<Request, PduError> {
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

// --- replies ---------------------------------------------------------------------

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

fn parse_reply(f: Frame) -> Result<Reply, PduError> {
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

#[cfg(test)]
#[path = "pdu_tests.rs"]
mod tests;
