//! The range lock that makes COMPARE AND WRITE atomic: the LBA space is cut into
//! regions, regions hash onto a fixed set of stripes, every write takes its stripes
//! shared and a COMPARE AND WRITE takes them exclusive. Stripes are always taken in
//! ascending order, so two commands never wait on each other in a cycle. Uncontended, a
//! one-region write costs one semaphore permit; nothing allocates unless a command spans
//! more than two stripes (a write of more than a region).

use tokio::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Number of stripes.
pub(super) const STRIPES: usize = 64;
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
    /// Two shared stripes (a write across a region boundary).
    SharedTwo(RwLockReadGuard<'a, ()>, RwLockReadGuard<'a, ()>),
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
    pub(super) fn mask(lba: u64, blocks: u64) -> u64 {
        if blocks == 0 {
            return 0;
        }
        Self::mask_of(Self::regions_of(lba, blocks))
    }

    /// The first and last region a range of blocks touches (`None`: an empty range).
    pub(super) fn regions(lba: u64, blocks: u64) -> Option<(u64, u64)> {
        (blocks > 0).then(|| Self::regions_of(lba, blocks))
    }

    /// The first and last region of a range of blocks (`blocks` > 0).
    pub(super) fn regions_of(lba: u64, blocks: u64) -> (u64, u64) {
        (
            lba >> REGION_SHIFT,
            lba.saturating_add(blocks - 1) >> REGION_SHIFT,
        )
    }

    /// The stripes of regions `first..=last`, as a bit set.
    pub(super) fn mask_of((first, last): (u64, u64)) -> u64 {
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
    #[cfg(test)]
    pub async fn shared(&self, lba: u64, blocks: u64) -> Held<'_> {
        self.shared_mask(Self::mask(lba, blocks)).await
    }

    /// Take the stripes of a bit set ([`Self::mask`]) shared.
    pub async fn shared_mask(&self, m: u64) -> Held<'_> {
        if m == 0 {
            return Held::None;
        }
        let first = m.trailing_zeros() as usize;
        match m.count_ones() {
            1 => return Held::SharedOne(self.stripes[first].read().await),
            2 => {
                let second = 63 - m.leading_zeros() as usize;
                let a = self.stripes[first].read().await;
                let b = self.stripes[second].read().await;
                return Held::SharedTwo(a, b);
            }
            _ => {}
        }
        let mut v = Vec::with_capacity(m.count_ones() as usize);
        for (i, s) in self.stripes.iter().enumerate() {
            if m & (1 << i) != 0 {
                v.push(s.read().await);
            }
        }
        Held::Shared(v)
    }

    /// Take the stripes of a range shared if none is held exclusive now (`None`: one
    /// is; nothing is held then).
    #[cfg(test)]
    pub fn try_shared(&self, lba: u64, blocks: u64) -> Option<Held<'_>> {
        self.try_shared_mask(Self::mask(lba, blocks))
    }

    /// Take the stripes of a bit set ([`Self::mask`]) shared if none is held exclusive
    /// now (`None`: one is; nothing is held then).
    pub fn try_shared_mask(&self, m: u64) -> Option<Held<'_>> {
        if m == 0 {
            return Some(Held::None);
        }
        let first = m.trailing_zeros() as usize;
        match m.count_ones() {
            1 => return self.stripes[first].try_read().ok().map(Held::SharedOne),
            2 => {
                let second = 63 - m.leading_zeros() as usize;
                let a = self.stripes[first].try_read().ok()?;
                let b = self.stripes[second].try_read().ok()?;
                return Some(Held::SharedTwo(a, b));
            }
            _ => {}
        }
        let mut v = Vec::with_capacity(m.count_ones() as usize);
        for (i, s) in self.stripes.iter().enumerate() {
            if m & (1 << i) != 0 {
                v.push(s.try_read().ok()?);
            }
        }
        Some(Held::Shared(v))
    }

    /// Take the stripes of a range exclusive (a COMPARE AND WRITE).
    pub async fn exclusive(&self, lba: u64, blocks: u64) -> Held<'_> {
        self.exclusive_mask(Self::mask(lba, blocks)).await
    }

    /// Take the stripes of a bit set ([`Self::mask`]) exclusive.
    pub async fn exclusive_mask(&self, m: u64) -> Held<'_> {
        let mut v = Vec::with_capacity(m.count_ones() as usize);
        for (i, s) in self.stripes.iter().enumerate() {
            if m & (1 << i) != 0 {
                v.push(s.write().await);
            }
        }
        Held::Exclusive(v)
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    #[test]
    fn exclusive_excludes_overlapping_writes_only() {
        let l = StripeLock::default();
        let region = 1u64 << REGION_SHIFT;
        let held = l.exclusive(10, 1).now_or_never().unwrap();
        assert!(l.shared(0, 1).now_or_never().is_none(), "same region waits");
        assert!(
            l.shared(region * 3, 8).now_or_never().is_some(),
            "other region runs"
        );
        // A write across a region boundary takes both stripes.
        assert!(l.shared(region - 1, 2).now_or_never().is_none());
        drop(held);
        let two = l.shared(region - 1, 2).now_or_never().unwrap();
        assert!(matches!(two, Held::SharedTwo(..)));
        assert!(
            l.exclusive(region, 1).now_or_never().is_none(),
            "a CAW waits for writes"
        );
        drop(two);
        assert!(
            matches!(l.shared(0, u64::MAX).now_or_never(), Some(Held::Shared(v)) if v.len() == STRIPES)
        );
        assert!(matches!(l.shared(5, 0).now_or_never(), Some(Held::None)));
    }

    #[test]
    fn try_shared_takes_free_stripes_and_nothing_when_one_is_held() {
        let l = StripeLock::default();
        let region = 1u64 << REGION_SHIFT;
        let held = l.exclusive(region, 1).now_or_never().unwrap();
        assert!(matches!(l.try_shared(0, 1), Some(Held::SharedOne(_))));
        assert!(l.try_shared(region + 5, 1).is_none());
        assert!(
            l.try_shared(region - 1, 2).is_none(),
            "the second stripe is held"
        );
        assert!(l.try_shared(0, region * 4).is_none());
        // Nothing stays held by a failed try: the first stripe is free for a CAW.
        assert!(l.exclusive(0, 1).now_or_never().is_some());
        drop(held);
        assert!(matches!(
            l.try_shared(region - 1, 2),
            Some(Held::SharedTwo(..))
        ));
        assert!(matches!(l.try_shared(0, region * 4), Some(Held::Shared(v)) if v.len() == 4));
        assert!(matches!(l.try_shared(3, 0), Some(Held::None)));
    }
}
