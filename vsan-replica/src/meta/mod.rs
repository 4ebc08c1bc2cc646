//! Per-replica metadata of a mirrored disk, as stored on disk.
//!
//! Each replica keeps, next to its data, a small metadata area (a file opened as a
//! [`BlockDevice`](vsan_core::BlockDevice)) that survives restarts and crashes:
//!
//! - the **superblock**: which disk this is, the geometry it was created with, the data
//!   generations, and state flags;
//! - the **activity log** (AL): the 4 MiB extents that may hold writes in flight, so a
//!   crashed node knows which parts of the disk might differ from its peer's;
//! - the **bitmap**: one bit per chunk, set when the chunk may differ from the peer
//!   (written while the peer was away, or merged in from the activity log after a crash).
//!
//! # Layout of the area
//!
//! Every write is a whole [`META_BLOCK`] (4096 bytes) at a multiple of it. Offsets are from
//! the start of the area; see [`Layout`].
//!
//! | offset                  | size                      | what                        |
//! |-------------------------|---------------------------|-----------------------------|
//! | 0                       | 4096                      | superblock copy 0 (even seq) |
//! | 4096                    | 4096                      | superblock copy 1 (odd seq)  |
//! | 8192                    | `al_len` (12288)          | activity log copy 0 (even seq) |
//! | 8192 + `al_len`         | `al_len`                  | activity log copy 1 (odd seq)  |
//! | 8192 + 2 × `al_len`     | `bitmap_blocks` × 4096    | bitmap                      |
//! | [`Layout::total_len`]   | 2 × [`SCSI_COPY_LEN`]     | SCSI state, two copies (optional; see [`scsi`]) |
//!
//! # Superblock (one [`META_BLOCK`], integers little-endian)
//!
//! | offset | size | field                                                          |
//! |--------|------|----------------------------------------------------------------|
//! | 0      | 8    | magic `VSANMETA`                                               |
//! | 8      | 4    | format version (1)                                             |
//! | 12     | 4    | flags: bit 0 inconsistent, bit 1 crashed, bit 2 clean shutdown; others 0 |
//! | 16     | 8    | seq                                                            |
//! | 24     | 16   | disk id                                                        |
//! | 40     | 4    | node id                                                        |
//! | 44     | 4    | peer id                                                        |
//! | 48     | 8    | disk size in bytes                                             |
//! | 56     | 4    | block size                                                     |
//! | 60     | 4    | reserved, 0                                                    |
//! | 64     | 8    | chunk size (bytes per bitmap bit)                              |
//! | 72     | 8    | current generation                                             |
//! | 80     | 8    | bitmap generation                                              |
//! | 88     | 8    | history generation 0 (newer)                                   |
//! | 96     | 8    | history generation 1 (older)                                   |
//! | 104    | 2    | disk name length, at most 255                                  |
//! | 106    | 255  | disk name, UTF-8, zero padded                                  |
//! | 361    | 3731 | zero                                                           |
//! | 4092   | 4    | crc32 of bytes 0..4092                                         |
//!
//! # Activity log record (`al_len` bytes, integers little-endian)
//!
//! | offset       | size      | field                                       |
//! |--------------|-----------|---------------------------------------------|
//! | 0            | 8         | magic `VSANALOG`                            |
//! | 8            | 8         | seq                                         |
//! | 16           | 4         | count of extents, at most [`AL_SLOTS`]      |
//! | 20           | 4         | reserved, 0                                 |
//! | 24           | 8 × count | extent numbers (byte offset / [`AL_EXTENT_SIZE`]) |
//! | ...          |           | zero                                        |
//! | `al_len` − 4 | 4         | crc32 of bytes 0..`al_len` − 4              |
//!
//! # Bitmap
//!
//! Chunk `c` is bit `c % 8` (least significant first) of byte `c / 8` of the bitmap area;
//! bits past the last chunk are zero. Bitmap blocks carry no crc, see [`Bitmap`].
//!
//! # Rules
//!
//! - **Two alternating copies.** The superblock and the activity log each have a `seq`,
//!   incremented on every write; the record with seq `s` goes to copy `s % 2`. A write
//!   therefore never overwrites the newest good copy: if it is torn by a crash, the other
//!   copy (seq `s − 1`) is still whole. A reader takes the copy with a valid crc and the
//!   highest seq, and warns when one copy is bad. A copy whose seq does not belong in its
//!   slot counts as bad.
//! - **crc32.** The superblock and the activity log record end in a crc32 of everything
//!   before it. The crc stays in the last four bytes in every format version, so a reader
//!   can tell corruption from a format it does not know.
//! - **Bitmap before data.** A bit is set and its bitmap block persisted before the write
//!   it covers is issued; bits are cleared only after a checkpoint (the chunk is in sync and
//!   flushed on both replicas).
//! - **Activity log before a cold extent.** Before a write lands in an extent the activity
//!   log does not hold, the log is rewritten with that extent and persisted. After a crash,
//!   the extents in the log are merged into the bitmap (and `crashed` set in the
//!   superblock until they are resynced), so a write that reached only one replica is
//!   never missed.
//! - **Never re-initialise.** Opening refuses, with an error naming the disk, metadata that
//!   is truncated, corrupt, or belongs to another disk or geometry; only a missing file is
//!   created.

mod al;
mod bitmap;
mod io;
mod layout;
pub mod scsi;
mod superblock;
#[cfg(test)]
mod tests;

pub use al::{decode_al, encode_al};
pub use bitmap::Bitmap;
pub use io::{
    Loaded, MetaParams, create, open, open_or_create_file, write_al, write_bitmap_block,
    write_superblock,
};
pub use layout::Layout;
pub use scsi::{
    SCSI_COPY_LEN, SCSI_STATE_MAX, ScsiArea, decode_scsi, encode_scsi, has_scsi_area,
    read_scsi_area, write_scsi_area,
};
pub use superblock::Superblock;

/// The unit of every metadata write, in bytes.
pub const META_BLOCK: usize = 4096;

/// The default bytes of disk one bitmap bit covers.
pub const DEFAULT_CHUNK_SIZE: u64 = 64 * 1024;

/// The bytes of disk one activity-log extent covers.
pub const AL_EXTENT_SIZE: u64 = 4 * 1024 * 1024;

/// How many extents the activity log holds at most.
pub const AL_SLOTS: usize = 1024;

/// A little-endian `u16` at `at` (the caller has checked the length).
fn le_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

use vsan_core::le::{put, u32_at as le_u32, u64_at as le_u64};

/// A stored record that is not one (a decoder's refusal): [`vsan_core::ErrorKind::Corrupt`]
/// with why.
fn corrupt(why: impl Into<String>) -> vsan_core::Error {
    vsan_core::Error::new(vsan_core::ErrorKind::Corrupt, why)
}
