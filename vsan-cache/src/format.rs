//! The on-media format of the write-back cache, as pure functions over byte slices.
//!
//! Nothing here does I/O: the cache maps its fast device and hands these functions the
//! bytes. Every decoder is total — any byte string yields a value or a [`FormatError`] —
//! so a torn or foreign device is reported, never a panic.
//!
//! # Layout of the cache device
//!
//! | offset | size      | what                                          |
//! |--------|-----------|-----------------------------------------------|
//! | 0      | 4096      | superblock copy 0 (even seq)                  |
//! | 4096   | 4096      | superblock copy 1 (odd seq)                   |
//! | 8192   | `log_len` | log ([`LOG_START`]), `log_len` a multiple of 4096, at least 64 KiB |
//!
//! The superblock is written as two alternating copies: the one with sequence number
//! `seq` goes to copy `seq % 2`, so a write torn by a power cut leaves the other copy
//! intact, and [`pick`] chooses the newest valid one.
//!
//! # Superblock (4096 bytes, integers little-endian)
//!
//! | offset | size | field                                                          |
//! |--------|------|----------------------------------------------------------------|
//! | 0      | 8    | magic `VSANCACH`                                               |
//! | 8      | 4    | format version (1)                                             |
//! | 12     | 4    | flags: bit 0 clean shutdown, bit 1 failed (log stale); others 0 |
//! | 16     | 8    | seq (this copy lives in slot `seq % 2`)                        |
//! | 24     | 16   | cache id, random, set at format                                |
//! | 40     | 8    | backing store size in bytes                                    |
//! | 48     | 4    | backing store block size (a power of two, 512 ..= cache block) |
//! | 52     | 4    | cache block size (4096)                                        |
//! | 56     | 8    | `log_len`                                                      |
//! | 64     | 8    | tail: log position of the oldest record not yet destaged       |
//! | 72     | 8    | tail seq: sequence number of the record at `tail`              |
//! | 80     | 8    | head: position after the last record (valid only when clean)   |
//! | 88     | 8    | next seq: seq of the next record (valid only when clean)       |
//! | 96     | 4    | mode: 0 write-back, 1 write-through, 2 write-around, 3 pass-through |
//! | 100    | 3992 | zero                                                           |
//! | 4092   | 4    | crc32 of bytes 0..4092                                         |
//!
//! # Log positions
//!
//! A log position is a `u64` counter that only grows; the byte at position `p` lives at
//! `p % log_len` in the log region ([`device_offset`]). Because positions never go back,
//! "which lap" is part of a position, and `tail`/`head` compare as plain numbers: the
//! live log is `tail..head`, never longer than `log_len`.
//!
//! Records start at multiples of 64 ([`RECORD_ALIGN`]) and never straddle the end of the
//! log region. When the next record would, the writer puts a **WRAP** record (a header,
//! no data) where it is and starts the record at the next multiple of `log_len`;
//! [`place`] does that arithmetic.
//!
//! # Record (64-byte header, then data padded to a multiple of 64)
//!
//! | offset | size | field                                                          |
//! |--------|------|----------------------------------------------------------------|
//! | 0      | 4    | magic `0x5643524c` (bytes `4c 52 43 56`)                       |
//! | 4      | 4    | flags: bit 0 WRAP, bit 1 FLUSH mark, bit 2 ZERO, bit 3 DISCARD; at most one set |
//! | 8      | 8    | seq                                                            |
//! | 16     | 8    | lba, in cache blocks of 4096 bytes                             |
//! | 24     | 4    | nblocks: data is `nblocks * 4096` bytes; 0 for WRAP and FLUSH; for ZERO and DISCARD the range's length (no data follows) |
//! | 28     | 4    | crc32 of the data                                              |
//! | 32     | 28   | zero                                                           |
//! | 60     | 4    | crc32 of bytes 0..60                                           |
//!
//! Every record, WRAP and FLUSH marks included, takes the next sequence number: records
//! in `tail..head` carry `tail_seq, tail_seq + 1, ...` with no gaps. A FLUSH mark carries
//! no data; it exists so a flush that follows no new write still gets a sequence number
//! to wait on.
//!
//! # Recovery
//!
//! [`scan`] walks the log from `tail` expecting `tail_seq`, and stops at the first record
//! whose header crc, sequence number or data crc does not fit: that is where the last
//! persisted append ended. A record from an earlier lap has a smaller seq than expected,
//! so stale space is never mistaken for new records.
//!
//! **Reformatting needs care:** a record left by an earlier format of the same device
//! passes every check if its seq happens to be the one expected. Whoever formats a cache
//! must therefore either zero the log or start `tail_seq` at a fresh random value (well
//! away from any seq the old format can have reached).

mod error;
mod record;
mod scan;
mod superblock;

pub use error::FormatError;
pub use record::{
    FLAG_DISCARD, FLAG_FLUSH, FLAG_WRAP, FLAG_ZERO, HEADER_LEN, Placement, RECORD_MAGIC,
    RecordHeader, decode_header, encode_header, place, record_len,
};
pub use scan::{ScanEnd, StopReason, scan};
pub use superblock::{
    CacheMode, FLAG_CLEAN_SHUTDOWN, FLAG_FAILED, FORMAT_VERSION, SUPERBLOCK_MAGIC, Superblock,
    pick, superblock_offset,
};

/// Bytes in one superblock copy.
pub const SUPERBLOCK_LEN: usize = 4096;
/// Where the log region starts on the cache device: after both superblock copies.
pub const LOG_START: u64 = 2 * SUPERBLOCK_LEN as u64;
/// The cache's block size: the unit of a record's `lba` and data.
pub const CACHE_BLOCK: u32 = 4096;
/// `log_len` is a multiple of this.
pub const LOG_ALIGN: u64 = 4096;
/// The smallest log: room for several of the largest common writes.
pub const MIN_LOG_LEN: u64 = 64 * 1024;
/// Records start at multiples of this, and their length is a multiple of it.
pub const RECORD_ALIGN: u64 = 64;

/// Checks that `log_len` can be a log: a multiple of [`LOG_ALIGN`], at least
/// [`MIN_LOG_LEN`].
pub fn check_log_len(log_len: u64) -> Result<(), FormatError> {
    if log_len % LOG_ALIGN != 0 {
        return Err(FormatError::BadGeometry(format!(
            "log length {log_len} is not a multiple of {LOG_ALIGN}"
        )));
    }
    if log_len < MIN_LOG_LEN {
        return Err(FormatError::BadGeometry(format!(
            "log length {log_len} is under the minimum of {MIN_LOG_LEN}"
        )));
    }
    Ok(())
}

/// Where log position `pos` lives on the cache device, in bytes from its start.
///
/// `log_len` must be non-zero (any value [`check_log_len`] accepts).
pub fn device_offset(pos: u64, log_len: u64) -> u64 {
    LOG_START + pos % log_len
}

use vsan_core::le::{put, u32_at as le_u32, u64_at as le_u64};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_len_limits() {
        assert!(check_log_len(MIN_LOG_LEN).is_ok());
        assert!(check_log_len(1 << 30).is_ok());
        assert!(matches!(
            check_log_len(MIN_LOG_LEN - LOG_ALIGN),
            Err(FormatError::BadGeometry(_))
        ));
        assert!(matches!(
            check_log_len(MIN_LOG_LEN + 512),
            Err(FormatError::BadGeometry(_))
        ));
        assert!(check_log_len(0).is_err());
    }

    #[test]
    fn positions_map_onto_the_log_region() {
        let len = MIN_LOG_LEN;
        assert_eq!(device_offset(0, len), 8192);
        assert_eq!(device_offset(64, len), 8192 + 64);
        assert_eq!(device_offset(len, len), 8192);
        assert_eq!(device_offset(3 * len + 128, len), 8192 + 128);
    }
}
