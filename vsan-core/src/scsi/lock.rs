//! The range lock that makes COMPARE AND WRITE atomic: the LBA space is cut into
//! regions, regions hash onto a fixed set of stripes, every write takes its stripes
//! shared and a COMPARE AND WRITE takes them exclusive. Stripes are always taken in
//! ascending order, so two commands never wait on each other in a cycle. Uncontended, a
//! one-region write costs one semaphore permit; nothing allocates unless a command spans
//! more than two stripes.

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Number of stripes.
const STRIPES: usize = 64;
/// A region is 2^REGION_SHIFT blocks.
const REGION_SHIFT: u32 = 11;

/// See the module docs.
#[derive(Debug)]
pub struct StripeLock {
    stripes: Box<[RwLock<()>]>,
}

/// Held stripes (shared or exclusive); released on drop.
#[allow(dead_code)] // the guards are held only to be dropped
#[derive(Debug)]
pub enum Held<'a> {
    /// Nothing (an empty range).
    None,
    /// Shared stripes.
    Shared(Vec<RwLockReadGuard<'a, ()>>),
    /// One shared stripe.
    SharedOne(RwLockReadGuard<'a, ()>),
    /// Exclusive stripes.
    Exclusive(Vec<RwLockWriteGuard<'a, ()>>),
}

impl Default for StripeLock {
    fn default() -> Self {
        StripeLock {
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
        }
    }
}

impl StripeLock {
    /// The stripes a range of blocks touches, as a bit set.
    fn mask(lba: u64, blocks: u64) -> u64 {
        if blocks == 0 {
            return 0;
        }
        let first = lba >> REGION_SHIFT;
        let last = lba.saturating_add(blocks - 1) >> REGION_SHIFT;
        if last - first >= STRIPES as u64 - 1 {
            return u64::MAX;
        }
        let mut m = 0u64;
        for r in first..=last {
            m |= 1 << (r % STRIPES as u64);
        }
        m
    }

    /// Take the stripes of a range shared (a write).
    pub async fn shared(&self, lba: u64, blocks: u64) -> Held<'_> {
        let m = Self::mask(lba, blocks);
        if m == 0 {
            return Held::None;
        }
        if m.count_ones() == 1 {
            return Held::SharedOne(self.stripes[m.trailing_zeros() as usize].read().await);
        }
        let mut v = Vec::with_capacity(m.count_ones() as usize);
        for (i, s) in self.stripes.iter().enumerate() {
            if m & (1 << i) != 0 {
                v.push(s.read().await);
            }
        }
        Held::Shared(v)
    }

    /// Take the stripes of a range exclusive (a COMPARE AND WRITE).
    pub async fn exclusive(&self, lba: u64, blocks: u64) -> Held<'_> {
        let m = Self::mask(lba, blocks);
        let mut v = Vec::with_capacity(m.count_ones() as usize);
        for (i, s) in self.stripes.iter().enumerate() {
            if m & (1 << i) != 0 {
                v.push(s.write().await);
            }
        }
        Held::Exclusive(v)
    }
}
