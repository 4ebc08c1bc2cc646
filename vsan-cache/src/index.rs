//! The index: cache block -> where its newest cached contents are in the log.
//!
//! Sharded by block number (runs of 16 blocks share a shard, so a typical request takes
//! one or two shard locks); no lock covers the whole index. A shard lock is held only for
//! a lookup and, for a mapped fast device, the copy of that block out of the log, which
//! is what keeps the log space from being reused under the copy: the destager removes
//! entries under the same lock before it frees their space.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::{Mutex, MutexGuard};

const SHARDS: usize = 64;
const RUN_SHIFT: u32 = 4;

/// What a cached block reads as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Content {
    /// 4096 bytes at this log position.
    Data(u64),
    /// Zeroes (a ZERO or DISCARD record).
    Zero,
}

/// One index entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    /// Log position of the record that wrote the block.
    pub rec: u64,
    /// What the block reads as.
    pub content: Content,
}

/// A multiply-shift hasher for block numbers (SipHash is several times slower and the
/// keys are not attacker-chosen in a way that matters to a per-node cache).
#[derive(Default)]
pub(crate) struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(crate) type Shard = HashMap<u64, Slot, BuildHasherDefault<BlockHasher>>;

/// The sharded index.
pub(crate) struct Index {
    shards: Box<[Mutex<Shard>]>,
    /// Entries, counted per change (signed: a `clear` racing a removal may briefly
    /// take it below the truth; `len` never reports less than 0).
    entries: AtomicI64,
}

impl Index {
    /// An empty index with room for about `blocks` entries without growing (a growing
    /// hash map rehashes under its shard lock, on the write path).
    pub fn with_capacity(blocks: u64) -> Index {
        let per_shard = (blocks / SHARDS as u64).min(1 << 20) as usize;
        Index {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard::with_capacity_and_hasher(
                        per_shard,
                        Default::default(),
                    ))
                })
                .collect(),
            entries: AtomicI64::new(0),
        }
    }

    fn shard_of(lba: u64) -> usize {
        ((lba >> RUN_SHIFT) as usize) % SHARDS
    }

    /// Lock the shard holding `lba`.
    pub fn lock(&self, lba: u64) -> MutexGuard<'_, Shard> {
        self.shards[Self::shard_of(lba)].lock()
    }

    /// Blocks `lba .. lba + n` in runs that share a shard: `(first, count)`.
    pub fn runs(lba: u64, n: u64) -> impl Iterator<Item = (u64, u64)> {
        let end = lba + n;
        let mut at = lba;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let run_end = ((at >> RUN_SHIFT) + 1) << RUN_SHIFT;
            let n = run_end.min(end) - at;
            let first = at;
            at += n;
            Some((first, n))
        })
    }

    /// Point blocks `lba ..` at record `rec`; `data` gives the data position of the first
    /// block (`None` for zeroes).
    pub fn insert(&self, lba: u64, n: u64, rec: u64, data: Option<u64>) {
        let mut added = 0;
        for (first, count) in Self::runs(lba, n) {
            let mut shard = self.lock(first);
            for b in first..first + count {
                let content = match data {
                    Some(d) => Content::Data(d + (b - lba) * crate::format::CACHE_BLOCK as u64),
                    None => Content::Zero,
                };
                if shard.insert(b, Slot { rec, content }).is_none() {
                    added += 1;
                }
            }
        }
        self.entries.fetch_add(added, Ordering::Relaxed);
    }

    /// Remove the entries of blocks `lba ..` that still point at record `rec`.
    pub fn remove_if(&self, lba: u64, n: u64, rec: u64) {
        let mut removed = 0;
        for (first, count) in Self::runs(lba, n) {
            let mut shard = self.lock(first);
            for b in first..first + count {
                if shard.get(&b).is_some_and(|s| s.rec == rec) {
                    shard.remove(&b);
                    removed += 1;
                }
            }
        }
        self.entries.fetch_sub(removed, Ordering::Relaxed);
    }

    /// Remove every entry of blocks `lba ..`, whatever record they point at.
    pub fn remove_all_in(&self, lba: u64, n: u64) {
        let mut removed = 0;
        for (first, count) in Self::runs(lba, n) {
            let mut shard = self.lock(first);
            for b in first..first + count {
                if shard.remove(&b).is_some() {
                    removed += 1;
                }
            }
        }
        self.entries.fetch_sub(removed, Ordering::Relaxed);
    }

    /// The newest record (largest position) any of blocks `lba ..` points at.
    pub fn newest_in(&self, lba: u64, n: u64) -> Option<u64> {
        let mut newest = None;
        for (first, count) in Self::runs(lba, n) {
            let shard = self.lock(first);
            if shard.is_empty() {
                continue;
            }
            for b in first..first + count {
                if let Some(s) = shard.get(&b) {
                    newest = newest.max(Some(s.rec));
                }
            }
        }
        newest
    }

    /// Whether any of blocks `lba ..` has an entry.
    #[cfg(test)]
    pub fn any_in(&self, lba: u64, n: u64) -> bool {
        self.newest_in(lba, n).is_some()
    }

    /// Drop every entry.
    pub fn clear(&self) {
        self.retain(|_| false);
    }

    /// Keep only the entries for which `keep` is true.
    pub fn retain(&self, mut keep: impl FnMut(&Slot) -> bool) {
        for s in self.shards.iter() {
            let mut shard = s.lock();
            let before = shard.len();
            shard.retain(|_, slot| keep(slot));
            let gone = (before - shard.len()) as i64;
            self.entries.fetch_sub(gone, Ordering::Relaxed);
        }
    }

    /// Blocks with an entry.
    pub fn len(&self) -> u64 {
        self.entries.load(Ordering::Relaxed).max(0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_shard_boundaries() {
        let r: Vec<_> = Index::runs(14, 20).collect();
        assert_eq!(r, vec![(14, 2), (16, 16), (32, 2)]);
        assert_eq!(Index::runs(0, 0).count(), 0);
    }

    #[test]
    fn insert_replace_remove() {
        let ix = Index::with_capacity(0);
        ix.insert(10, 4, 0, Some(64));
        assert_eq!(ix.len(), 4);
        assert_eq!(
            ix.lock(12).get(&12).copied(),
            Some(Slot {
                rec: 0,
                content: Content::Data(64 + 2 * 4096)
            })
        );
        ix.insert(12, 4, 9000, None);
        assert_eq!(ix.len(), 6);
        assert_eq!(ix.newest_in(0, 100), Some(9000));
        // Only entries still pointing at record 0 go.
        ix.remove_if(10, 4, 0);
        assert_eq!(ix.len(), 4);
        assert!(!ix.any_in(10, 2));
        assert_eq!(ix.lock(13).get(&13).unwrap().content, Content::Zero);
        ix.remove_all_in(0, 1000);
        assert_eq!(ix.len(), 0);
    }
}
