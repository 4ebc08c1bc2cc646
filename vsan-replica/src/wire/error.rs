//! What can be wrong with a frame.

use super::Kind;

/// Why bytes could not be decoded into a message, or a message cannot be sent.
///
/// Every decoding error means the peer broke the protocol (or the link corrupted the
/// stream): the link is dropped, never resynchronised. Converts into a
/// [`vsan_core::Error`] of kind [`Protocol`](vsan_core::ErrorKind::Protocol).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The frame does not start with [`MAGIC`](super::MAGIC).
    #[error("bad magic {found:#010x} (expected {:#010x})", super::MAGIC)]
    BadMagic {
        /// The four bytes found, big-endian.
        found: u32,
    },
    /// The frame's wire version is not [`WIRE_VERSION`](super::WIRE_VERSION).
    #[error("unsupported wire version {0} (this side speaks {ours})", ours = super::WIRE_VERSION)]
    UnsupportedVersion(u8),
    /// Reserved header flags are set.
    #[error("reserved header flags set: {0:#06x}")]
    ReservedFlags(u16),
    /// The kind byte names no known kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A known kind where it does not belong (a transport frame in the message stream).
    #[error("unexpected {0:?} frame")]
    UnexpectedKind(Kind),
    /// A section is longer than its limit.
    #[error("{what} section of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// "meta" or "data".
        what: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A frame of a kind that has no such section carries one.
    #[error("{kind:?} frame carries {len} bytes of {section}; it has none")]
    UnexpectedSection {
        /// The frame's kind.
        kind: Kind,
        /// "meta" or "data".
        section: &'static str,
        /// The section's length.
        len: u64,
    },
    /// The checksum does not match the frame's bytes.
    #[error("crc mismatch: header says {expected:#010x}, frame hashes to {actual:#010x}")]
    BadCrc {
        /// The crc in the header.
        expected: u32,
        /// The crc of the bytes received.
        actual: u32,
    },
    /// The meta section is not a valid protobuf message for the kind.
    #[error("malformed {kind:?} meta: {detail}")]
    MalformedMeta {
        /// The frame's kind.
        kind: Kind,
        /// What the protobuf decoder said.
        detail: String,
    },
    /// The message is well-formed but breaks a rule of the protocol (a zero-length
    /// write, a range past `u64::MAX`, data on a failed read, ...).
    #[error("invalid {kind:?} message: {reason}")]
    Invalid {
        /// The message's kind.
        kind: Kind,
        /// The rule it breaks.
        reason: &'static str,
    },
}

impl From<WireError> for vsan_core::Error {
    fn from(err: WireError) -> vsan_core::Error {
        vsan_core::Error::with_source(vsan_core::ErrorKind::Protocol, "replication frame", err)
    }
}
