//! Why bytes are not a superblock or a record, or why a record cannot be placed.

/// A superblock or record header that does not decode, or arguments that do not describe
/// a log. Each message names the structure and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// Fewer bytes than the structure needs.
    #[error("short {what}: {len} bytes where {need} are needed")]
    Short {
        /// "superblock" or "record header".
        what: &'static str,
        /// Bytes given.
        len: usize,
        /// Bytes the structure takes.
        need: usize,
    },
    /// The superblock does not start with `VSANCACH`: not a cache device, or never
    /// formatted.
    #[error("bad superblock magic{}", if *.zeroed { " (all zeros: never written)" } else { "" })]
    BadSuperblockMagic {
        /// The whole block is zero.
        zeroed: bool,
    },
    /// The superblock was written by a format version this build does not read.
    #[error("unsupported cache format version {0} (this build reads version 1)")]
    UnsupportedVersion(u32),
    /// The superblock's crc does not match its bytes: a torn or corrupted write.
    #[error("superblock crc mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    SuperblockCrc {
        /// The crc in the block.
        stored: u32,
        /// The crc of the block's bytes.
        computed: u32,
    },
    /// The superblock sets flag bits this version does not know.
    #[error("unknown superblock flags {0:#x}")]
    UnknownSuperblockFlags(u32),
    /// The superblock's cache mode is none of the four known.
    #[error("unknown cache mode {0}")]
    UnknownMode(u32),
    /// Sizes or positions that cannot describe a cache: a bad `log_len`, a block size that
    /// is not a power of two, `tail > head` on a clean log, ...
    #[error("bad geometry: {0}")]
    BadGeometry(String),
    /// A sound superblock copy sits in the slot its seq does not choose: it was not
    /// written there by this format, so it is not trusted.
    #[error("superblock copy {slot} holds seq {seq}, which belongs in copy {}", .seq % 2)]
    WrongSlot {
        /// The slot it was read from.
        slot: usize,
        /// Its sequence number.
        seq: u64,
    },
    /// Neither superblock copy is usable.
    #[error("no valid superblock: copy 0: {copy0}; copy 1: {copy1}")]
    NoValidSuperblock {
        /// Why copy 0 was refused.
        copy0: Box<FormatError>,
        /// Why copy 1 was refused.
        copy1: Box<FormatError>,
    },
    /// The record header does not start with the record magic: unwritten (zero) or
    /// foreign space.
    #[error("bad record magic {found:#010x}")]
    BadRecordMagic {
        /// The first four bytes, as a little-endian `u32`.
        found: u32,
    },
    /// The record header's crc does not match its bytes: a torn header.
    #[error("record header crc mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    HeaderCrc {
        /// The crc in the header.
        stored: u32,
        /// The crc of the header's bytes.
        computed: u32,
    },
    /// The record header sets flag bits this version does not know, or both WRAP and
    /// FLUSH.
    #[error("bad record flags {0:#x}")]
    BadRecordFlags(u32),
    /// A WRAP record or FLUSH mark that claims data blocks.
    #[error("{kind} record claims {nblocks} data blocks; it carries none")]
    MarkerWithData {
        /// "WRAP" or "FLUSH mark".
        kind: &'static str,
        /// The block count it claims.
        nblocks: u32,
    },
    /// A data record with no data blocks.
    #[error("data record with no data blocks")]
    EmptyRecord,
    /// The record header's reserved bytes are not zero.
    #[error("record header reserved bytes are not zero")]
    ReservedNotZero,
    /// `lba + nblocks` does not fit in a `u64`.
    #[error("record range overflows: lba {lba} + {nblocks} blocks")]
    RangeOverflow {
        /// First block.
        lba: u64,
        /// Block count.
        nblocks: u32,
    },
    /// Data that is not a whole, non-zero number of cache blocks (or more than a record
    /// holds).
    #[error("record data of {len} bytes is not 1 ..= 2^32 - 1 whole 4096-byte blocks")]
    BadDataLength {
        /// The data length given.
        len: usize,
    },
    /// A record longer than the whole log.
    #[error("record of {len} bytes does not fit a log of {log_len} bytes")]
    RecordTooLarge {
        /// The record's length, header included.
        len: u64,
        /// The log's length.
        log_len: u64,
    },
    /// A log position where no record can start (not a multiple of 64).
    #[error("log position {0} is not a multiple of 64")]
    MisalignedPosition(u64),
    /// Log positions would pass `u64::MAX`.
    #[error("log position overflow")]
    PositionOverflow,
}
