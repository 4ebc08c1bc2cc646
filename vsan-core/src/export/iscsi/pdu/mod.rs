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

use bytes::Bytes;

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

mod frame;
mod reply;
mod request;

pub use frame::crc32c;
pub use reply::ReplyDecoder;
pub use request::Decoder;

#[cfg(test)]
mod tests;
