//! Where each part of a metadata area lies, and how disk bytes map to chunks and extents.

use std::ops::Range;

use vsan_core::{Error, ErrorKind, Result};

use super::al::AL_RECORD_MIN;
use super::{AL_EXTENT_SIZE, META_BLOCK};

/// Bitmap bits one metadata block holds.
pub(super) const BITS_PER_BLOCK: u64 = META_BLOCK as u64 * 8;

/// Bytes of one activity log copy: the record rounded up to whole metadata blocks.
const AL_LEN: usize = AL_RECORD_MIN.div_ceil(META_BLOCK) * META_BLOCK;

/// The smallest chunk size: one bitmap bit per page-sized piece of disk.
const MIN_CHUNK_SIZE: u64 = 4096;

// Two superblock copies, then two activity log copies, then the bitmap.
const AL_START: u64 = 2 * META_BLOCK as u64;

/// Geometry of a metadata area (all offsets in bytes from its start).
///
/// See the [module docs](super) for the picture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    size: u64,
    chunk_size: u64,
    chunks: u64,
}

impl Layout {
    /// The layout for a disk of `size` bytes with `chunk_size` bytes per bitmap bit.
    ///
    /// Assumes valid input (`chunk_size` a power of two of at least 4096, `size` non-zero;
    /// a zero `chunk_size` panics); use [`Layout::checked`] for values from a configuration.
    pub fn new(size: u64, chunk_size: u64) -> Layout {
        Layout {
            size,
            chunk_size,
            chunks: size.div_ceil(chunk_size),
        }
    }

    /// Like [`Layout::new`], but refuses (with [`ErrorKind::InvalidArgument`]) a zero size
    /// and a chunk size that is not a power of two, smaller than 4096 bytes, or not a
    /// multiple of the disk's `block_size`.
    pub fn checked(size: u64, chunk_size: u64, block_size: u32) -> Result<Layout> {
        let invalid = |msg: String| Err(Error::new(ErrorKind::InvalidArgument, msg));
        if size == 0 {
            return invalid("disk size is 0: a mirrored disk needs at least one block".into());
        }
        if !chunk_size.is_power_of_two() {
            return invalid(format!("chunk size {chunk_size} is not a power of two"));
        }
        if chunk_size < MIN_CHUNK_SIZE {
            return invalid(format!(
                "chunk size {chunk_size} is smaller than the minimum of {MIN_CHUNK_SIZE} bytes"
            ));
        }
        if block_size == 0 || chunk_size % u64::from(block_size) != 0 {
            return invalid(format!(
                "chunk size {chunk_size} is not a multiple of the block size {block_size}"
            ));
        }
        Ok(Layout::new(size, chunk_size))
    }

    /// Bytes of disk one bitmap bit covers.
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Chunks of the disk (bits of the bitmap): `ceil(size / chunk_size)`.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// Size of the disk in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Activity log extents of the disk: `ceil(size / AL_EXTENT_SIZE)`.
    pub fn extents(&self) -> u64 {
        self.size.div_ceil(AL_EXTENT_SIZE)
    }

    /// Offset of the superblock copy that the superblock with `seq` goes to
    /// (block 0 for even `seq`, block 1 for odd).
    pub fn superblock_offset(&self, seq: u64) -> u64 {
        (seq % 2) * META_BLOCK as u64
    }

    /// Offset of the activity log copy that the record with `seq` goes to.
    pub fn al_offset(&self, seq: u64) -> u64 {
        AL_START + (seq % 2) * AL_LEN as u64
    }

    /// Bytes of one activity log copy (a multiple of [`META_BLOCK`]).
    pub fn al_len(&self) -> usize {
        AL_LEN
    }

    /// Offset of the first bitmap block.
    pub fn bitmap_offset(&self) -> u64 {
        AL_START + 2 * AL_LEN as u64
    }

    /// Blocks of the bitmap: `ceil(chunks / (META_BLOCK * 8))`, at least 1.
    pub fn bitmap_blocks(&self) -> usize {
        self.chunks.div_ceil(BITS_PER_BLOCK).max(1) as usize
    }

    /// Bytes the whole metadata area needs.
    pub fn total_len(&self) -> u64 {
        self.bitmap_offset() + self.bitmap_blocks() as u64 * META_BLOCK as u64
    }

    /// Offset of the SCSI state copy that the record with `seq` goes to (after the
    /// bitmap; see [`super::scsi`]).
    pub fn scsi_offset(&self, seq: u64) -> u64 {
        self.total_len() + (seq % 2) * super::scsi::SCSI_COPY_LEN as u64
    }

    /// Bytes of a metadata area with the SCSI state area: [`Layout::total_len`] and
    /// its two copies.
    pub fn total_len_with_scsi(&self) -> u64 {
        self.total_len() + 2 * super::scsi::SCSI_COPY_LEN as u64
    }

    /// `(offset, len)` of `chunk` on the disk; the last chunk is clipped to the disk size,
    /// and a chunk past the end has length 0.
    pub fn chunk_range(&self, chunk: u64) -> (u64, u64) {
        let offset = chunk.saturating_mul(self.chunk_size);
        (
            offset,
            self.size.saturating_sub(offset).min(self.chunk_size),
        )
    }

    /// The chunks a byte range of the disk touches (`len` > 0; an empty range touches
    /// none). Chunks past the end of the disk are left out.
    pub fn chunks_of(&self, offset: u64, len: u64) -> Range<u64> {
        let first = (offset / self.chunk_size).min(self.chunks);
        if len == 0 {
            return first..first;
        }
        let last = offset.saturating_add(len - 1) / self.chunk_size;
        first..last.saturating_add(1).min(self.chunks)
    }

    /// The activity log extent a byte offset of the disk falls in.
    pub fn extent_of(offset: u64) -> u64 {
        offset / AL_EXTENT_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::DEFAULT_CHUNK_SIZE;

    #[test]
    fn one_gib_at_64k() {
        let l = Layout::checked(1 << 30, DEFAULT_CHUNK_SIZE, 512).unwrap();
        assert_eq!(l.chunks(), 16384);
        assert_eq!(l.size(), 1 << 30);
        assert_eq!(l.chunk_size(), 65536);
        assert_eq!(l.extents(), 256);
        assert_eq!(l.superblock_offset(0), 0);
        assert_eq!(l.superblock_offset(7), 4096);
        // 24 + 8 x 1024 + 4 bytes of record: three blocks.
        assert_eq!(l.al_len(), 12288);
        assert_eq!(l.al_offset(2), 8192);
        assert_eq!(l.al_offset(3), 8192 + 12288);
        assert_eq!(l.bitmap_offset(), 8192 + 2 * 12288);
        assert_eq!(l.bitmap_blocks(), 1);
        assert_eq!(l.total_len(), 8192 + 2 * 12288 + 4096);
        assert_eq!(l.chunk_range(16383), ((1 << 30) - 65536, 65536));
        assert_eq!(l.chunks_of(0, 1), 0..1);
        assert_eq!(l.chunks_of(65535, 2), 0..2);
        assert_eq!(l.chunks_of(65536, 65536), 1..2);
        assert_eq!(l.chunks_of((1 << 30) - 512, 512), 16383..16384);
        // Past the end: clipped, never a chunk that does not exist.
        assert_eq!(l.chunks_of((1 << 30) - 512, 1 << 20), 16383..16384);
        assert_eq!(l.chunks_of(1 << 31, 512), 16384..16384);
        assert_eq!(Layout::extent_of(AL_EXTENT_SIZE - 1), 0);
        assert_eq!(Layout::extent_of(AL_EXTENT_SIZE * 3 + 5), 3);
    }

    #[test]
    fn bitmap_spans_blocks_for_large_disks() {
        // 4 TiB at 64 KiB: 2^26 chunks, 2^26 / 32768 = 2048 bitmap blocks.
        let l = Layout::new(4 << 40, DEFAULT_CHUNK_SIZE);
        assert_eq!(l.bitmap_blocks(), 2048);
        assert_eq!(l.total_len(), 8192 + 2 * 12288 + 2048 * 4096);
        // One chunk more than a block holds needs a second block.
        let l = Layout::new((BITS_PER_BLOCK + 1) * 4096, 4096);
        assert_eq!(l.bitmap_blocks(), 2);
    }

    #[test]
    fn tiny_disk_not_a_multiple_of_the_chunk() {
        let l = Layout::checked(100 * 1024, DEFAULT_CHUNK_SIZE, 512).unwrap();
        assert_eq!(l.chunks(), 2);
        assert_eq!(l.chunk_range(0), (0, 65536));
        assert_eq!(l.chunk_range(1), (65536, 36 * 1024));
        assert_eq!(l.chunk_range(2), (131072, 0));
        assert_eq!(l.chunks_of(0, 100 * 1024), 0..2);
        assert_eq!(l.bitmap_blocks(), 1);
        assert_eq!(l.total_len(), 8192 + 2 * 12288 + 4096);
        assert_eq!(l.extents(), 1);
        let l = Layout::checked(512, 4096, 512).unwrap();
        assert_eq!(l.chunks(), 1);
        assert_eq!(l.chunk_range(0), (0, 512));
    }

    #[test]
    fn checked_refuses_bad_geometry() {
        let msg = |size, cs, bs| {
            let e = Layout::checked(size, cs, bs).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            e.to_string()
        };
        assert!(msg(0, 65536, 512).contains("disk size is 0"));
        assert!(msg(1 << 30, 65536 + 4096, 512).contains("not a power of two"));
        assert!(msg(1 << 30, 2048, 512).contains("smaller than the minimum"));
        assert!(msg(1 << 30, 4096, 8192).contains("not a multiple of the block size 8192"));
        assert!(msg(1 << 30, 4096, 0).contains("not a multiple of the block size 0"));
        assert!(Layout::checked(1 << 30, 4096, 4096).is_ok());
    }
}
