//! One direction of a link: a single-producer single-consumer byte ring in the shared
//! memory, its control words, and copies in and out that never leave it.

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use vsan_core::{Error, ErrorKind, Result};

use super::region::{Region, RingGeom};
use super::{
    CTL_CLOSED, CTL_CONSUMER_GONE, CTL_CONSUMER_SLEEPING, CTL_HEAD, CTL_PRODUCER_SLEEPING, CTL_TAIL,
};

/// A view of one ring of a region, from one side.
#[derive(Debug, Clone)]
pub(super) struct Ring {
    region: Arc<Region>,
    geom: RingGeom,
}

impl Ring {
    pub(super) fn new(region: &Arc<Region>, index: usize) -> Ring {
        Ring {
            region: Arc::clone(region),
            geom: region.rings[index],
        }
    }

    pub(super) fn size(&self) -> u64 {
        self.geom.size
    }

    pub(super) fn tail(&self) -> &AtomicU64 {
        self.region.atomic_u64(self.geom.control + CTL_TAIL)
    }

    pub(super) fn head(&self) -> &AtomicU64 {
        self.region.atomic_u64(self.geom.control + CTL_HEAD)
    }

    pub(super) fn closed(&self) -> &AtomicU32 {
        self.region.atomic_u32(self.geom.control + CTL_CLOSED)
    }

    pub(super) fn producer_sleeping(&self) -> &AtomicU32 {
        self.region
            .atomic_u32(self.geom.control + CTL_PRODUCER_SLEEPING)
    }

    pub(super) fn consumer_sleeping(&self) -> &AtomicU32 {
        self.region
            .atomic_u32(self.geom.control + CTL_CONSUMER_SLEEPING)
    }

    pub(super) fn consumer_gone(&self) -> &AtomicU32 {
        self.region
            .atomic_u32(self.geom.control + CTL_CONSUMER_GONE)
    }

    /// Bytes the producer at `tail` may write now; fails when the peer's head is out of
    /// range.
    pub(super) fn room(&self, tail: u64) -> Result<u64> {
        let head = self.head().load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.size() {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer's ring head {head} is out of range (tail {tail}, size {})",
                    self.size()
                ),
            ));
        }
        Ok(self.size() - used)
    }

    /// Bytes the consumer at `head` may read up to the returned tail; fails when the
    /// peer's tail is out of range.
    pub(super) fn available(&self, head: u64) -> Result<(u64, u64)> {
        let tail = self.tail().load(Ordering::Acquire);
        let avail = tail.wrapping_sub(head);
        if avail > self.size() {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer's ring tail {tail} is out of range (head {head}, size {})",
                    self.size()
                ),
            ));
        }
        Ok((avail, tail))
    }

    /// Where `pos` falls in the ring and how many bytes of `len` fit before the end.
    pub(super) fn split(&self, pos: u64, len: usize) -> (usize, usize, usize) {
        let size = self.size() as usize;
        let len = len.min(size);
        let at = (pos & (self.size() - 1)) as usize;
        let first = len.min(size - at);
        (at, first, len - first)
    }

    /// Copies `src` (at most the ring's size of it) into the ring at position `pos`,
    /// wrapping at the end. Only the producer calls this, on bytes the consumer is done
    /// with.
    pub(super) fn copy_in(&self, pos: u64, src: &[u8]) {
        let (at, first, second) = self.split(pos, src.len());
        let base = self.region.map.as_mut_ptr();
        // SAFETY: `at + first <= size` and `second <= at`, so both ranges lie within this
        // ring's `size` bytes at `geom.data`, which the region's invariant keeps inside the
        // mapping; `src` is private memory of this process, so the ranges do not overlap,
        // and `first + second <= src.len()`. Raw copies: no reference to the shared bytes
        // is ever formed.
        unsafe {
            let ring = base.add(self.geom.data);
            std::ptr::copy_nonoverlapping(src.as_ptr(), ring.add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), ring, second);
        }
    }

    /// Copies `dst.len()` bytes (at most the ring's size) out of the ring from position
    /// `pos`, wrapping at the end; returns how many it wrote to the front of `dst`.
    pub(super) fn copy_out(&self, pos: u64, dst: &mut [MaybeUninit<u8>]) -> usize {
        let (at, first, second) = self.split(pos, dst.len());
        let base = self.region.map.as_ptr();
        // SAFETY: as in `copy_in`, both source ranges lie in the ring inside the mapping,
        // and `first + second <= dst.len()`, private memory that does not overlap it.
        unsafe {
            let ring = base.add(self.geom.data);
            let out = dst.as_mut_ptr().cast::<u8>();
            std::ptr::copy_nonoverlapping(ring.add(at), out, first);
            std::ptr::copy_nonoverlapping(ring, out.add(first), second);
        }
        first + second
    }
}
