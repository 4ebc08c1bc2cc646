//! NBD wire constants and the fixed-size transmission headers (simple replies only).
//!
//! Numbers are from the NBD protocol specification (fixed newstyle negotiation); all
//! integers on the wire are big-endian.

use crate::error::ErrorKind;

/// "NBDMAGIC": first thing the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": newstyle magic, and the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply.
pub const REPLY_MAGIC_OPT: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple transmission reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags (server).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the 124 zero bytes after EXPORT_NAME may be omitted.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: client wants no zero padding.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// The export is read-only.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// FLUSH is supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// The FUA command flag is supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// TRIM is supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// WRITE_ZEROES is supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// A FLUSH on one connection covers writes completed on every connection.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
/// Abort negotiation.
pub const OPT_ABORT: u32 = 2;
/// List exports.
pub const OPT_LIST: u32 = 3;
/// Ask about an export without selecting it.
pub const OPT_INFO: u32 = 6;
/// Select an export and start transmission.
pub const OPT_GO: u32 = 7;

/// Option replies.
pub const REP_ACK: u32 = 1;
/// One export in a LIST reply.
pub const REP_SERVER: u32 = 2;
/// One piece of information in an INFO/GO reply.
pub const REP_INFO: u32 = 3;
/// Option not supported.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// Option malformed.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// Export unknown.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// Server shutting down.
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
/// Option payload too large.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Info types.
pub const INFO_EXPORT: u16 = 0;
/// Export name.
pub const INFO_NAME: u16 = 1;
/// Export description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Commands.
pub const CMD_READ: u16 = 0;
/// Write.
pub const CMD_WRITE: u16 = 1;
/// Disconnect.
pub const CMD_DISC: u16 = 2;
/// Flush.
pub const CMD_FLUSH: u16 = 3;
/// Trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: WRITE_ZEROES must allocate (we always may, so it is accepted).
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Error values of a reply (Linux errno numbers, as the spec fixes them).
pub const EPERM: u32 = 1;
/// I/O error.
pub const EIO: u32 = 5;
/// Out of memory.
pub const ENOMEM: u32 = 12;
/// Invalid argument.
pub const EINVAL: u32 = 22;
/// No space left.
pub const ENOSPC: u32 = 28;
/// Value too large.
pub const EOVERFLOW: u32 = 75;
/// Not supported.
pub const ENOTSUP: u32 = 95;
/// Server shutting down.
pub const ESHUTDOWN: u32 = 108;

/// Size of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;

/// A decoded transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub kind: u16,
    /// Opaque cookie echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length.
    pub length: u32,
}

impl Request {
    /// Decode a 28-byte request header; `None` if the magic is wrong (the stream cannot be
    /// trusted after that).
    pub fn decode(b: &[u8; REQUEST_LEN]) -> Option<Request> {
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        if magic != REQUEST_MAGIC {
            return None;
        }
        let mut cookie = [0u8; 8];
        cookie.copy_from_slice(&b[8..16]);
        let mut offset = [0u8; 8];
        offset.copy_from_slice(&b[16..24]);
        Some(Request {
            flags: u16_at(4),
            kind: u16_at(6),
            cookie: u64::from_be_bytes(cookie),
            offset: u64::from_be_bytes(offset),
            length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
        })
    }

    /// Encode as a 28-byte header (for clients and tests).
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// Encode a simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// The NBD error a failed device operation is reported with.
pub fn errno_for(kind: ErrorKind, is_write: bool) -> u32 {
    match kind {
        ErrorKind::InvalidArgument => EINVAL,
        // The spec asks for ENOSPC when a write reaches past the end, EINVAL for reads.
        ErrorKind::OutOfRange if is_write => ENOSPC,
        ErrorKind::OutOfRange => EINVAL,
        ErrorKind::NoSpace => ENOSPC,
        ErrorKind::ReadOnly => EPERM,
        ErrorKind::NotSupported => ENOTSUP,
        ErrorKind::Closed => ESHUTDOWN,
        _ => EIO,
    }
}

/// The error kind an NBD reply error maps back to (for the client).
pub fn kind_for_errno(errno: u32) -> ErrorKind {
    match errno {
        EPERM => ErrorKind::ReadOnly,
        EINVAL | EOVERFLOW => ErrorKind::InvalidArgument,
        ENOSPC => ErrorKind::NoSpace,
        ENOTSUP => ErrorKind::NotSupported,
        ESHUTDOWN => ErrorKind::Closed,
        ENOMEM => ErrorKind::Io,
        _ => ErrorKind::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip_and_bad_magic() {
        let r = Request {
            flags: 1,
            kind: CMD_WRITE,
            cookie: 7,
            offset: 4096,
            length: 512,
        };
        let b = r.encode();
        assert_eq!(Request::decode(&b), Some(r));
        let mut bad = b;
        bad[0] ^= 0xff;
        assert_eq!(Request::decode(&bad), None);
    }
}
