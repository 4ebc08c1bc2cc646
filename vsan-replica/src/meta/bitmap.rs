//! The out-of-sync bitmap, in memory, and its stored form.

use bytes::Bytes;

use super::layout::BITS_PER_BLOCK;
use super::{META_BLOCK, le_u64};

/// 64-bit words in one metadata block.
const WORDS_PER_BLOCK: usize = META_BLOCK / 8;

/// One bit per chunk of the disk; a set bit means the chunk may differ from the peer's.
///
/// Stored in the bitmap area of the metadata with chunk `c` as bit `c % 8` (least
/// significant first) of byte `c / 8`; that is the words below in little-endian order.
/// Bits past the last chunk are always zero.
///
/// The stored blocks carry no crc, on purpose. A bit is persisted before the write it
/// covers is issued, so a torn block write while bits are being set can lose only the bits
/// that write was adding, for writes not yet issued and so never acknowledged; every bit
/// set earlier is in both the old and the new contents. Bits are cleared only after a
/// checkpoint (the chunks are in sync and flushed on both replicas), so a torn write while
/// clearing leaves at worst some bits set: an extra resync, never a missed one. A crc would
/// turn either harmless tear into an unreadable block and lose every bit in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
    chunks: u64,
    /// Set bits, kept up to date by every change.
    count: u64,
}

impl Bitmap {
    /// A clear bitmap of `chunks` bits.
    pub fn new(chunks: u64) -> Bitmap {
        Bitmap {
            words: vec![0; chunks.div_ceil(64) as usize],
            chunks,
            count: 0,
        }
    }

    /// Bits (chunks) in the bitmap.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// Bits set: chunks out of sync.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Whether `chunk`'s bit is set (false for a chunk past the end).
    pub fn get(&self, chunk: u64) -> bool {
        chunk < self.chunks && self.words[(chunk / 64) as usize] & bit(chunk) != 0
    }

    /// Sets `chunk`'s bit; true if it was clear. A chunk past the end is a caller bug:
    /// it changes nothing (and panics in debug builds).
    pub fn set(&mut self, chunk: u64) -> bool {
        debug_assert!(chunk < self.chunks, "chunk {chunk} of {}", self.chunks);
        if chunk >= self.chunks {
            return false;
        }
        let w = &mut self.words[(chunk / 64) as usize];
        let was_clear = *w & bit(chunk) == 0;
        *w |= bit(chunk);
        self.count += u64::from(was_clear);
        was_clear
    }

    /// Clears `chunk`'s bit; true if it was set. A chunk past the end is a caller bug:
    /// it changes nothing (and panics in debug builds).
    pub fn clear(&mut self, chunk: u64) -> bool {
        debug_assert!(chunk < self.chunks, "chunk {chunk} of {}", self.chunks);
        if chunk >= self.chunks {
            return false;
        }
        let w = &mut self.words[(chunk / 64) as usize];
        let was_set = *w & bit(chunk) != 0;
        *w &= !bit(chunk);
        self.count -= u64::from(was_set);
        was_set
    }

    /// Sets every bit (a full resync).
    pub fn set_all(&mut self) {
        self.set_range(0, self.chunks);
    }

    /// The bitmap block that holds `chunk`'s bit (0 is the block at
    /// [`Layout::bitmap_offset`](super::Layout::bitmap_offset)).
    pub fn block_of(chunk: u64) -> usize {
        (chunk / BITS_PER_BLOCK) as usize
    }

    /// The [`META_BLOCK`] bytes of bitmap block `block`, as stored (zeros past the end).
    pub fn block_bytes(&self, block: usize) -> Bytes {
        let start = block.saturating_mul(WORDS_PER_BLOCK).min(self.words.len());
        let end = start.saturating_add(WORDS_PER_BLOCK).min(self.words.len());
        let mut out = Vec::with_capacity(META_BLOCK);
        for w in &self.words[start..end] {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.resize(META_BLOCK, 0);
        Bytes::from(out)
    }

    /// The first set chunk at or after `from`.
    pub fn next_set(&self, from: u64) -> Option<u64> {
        self.next_matching(from, |w| w)
    }

    /// `(first, count)` of every run of set bits, ascending.
    pub fn runs(&self) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut at = 0;
        while let Some(first) = self.next_set(at) {
            let end = self.next_matching(first, |w| !w).unwrap_or(self.chunks);
            runs.push((first, end - first));
            at = end;
        }
        runs
    }

    /// Sets every bit in `runs` (`(first, count)` pairs), clipped to the bitmap: how a
    /// peer's bitmap is merged in.
    pub fn set_runs(&mut self, runs: &[(u64, u64)]) {
        for &(first, count) in runs {
            let end = first.saturating_add(count).min(self.chunks);
            if first < end {
                self.set_range(first, end);
            }
        }
    }

    /// A bitmap of `chunks` bits from the stored bitmap area `bytes`; bits past `chunks`
    /// are ignored, and bytes missing from a short area read as zero.
    pub fn from_blocks(chunks: u64, bytes: &[u8]) -> Bitmap {
        let mut bm = Bitmap::new(chunks);
        for (i, w) in bm.words.iter_mut().enumerate() {
            let at = i * 8;
            *w = if at + 8 <= bytes.len() {
                le_u64(bytes, at)
            } else {
                let mut a = [0u8; 8];
                let tail = bytes.get(at..).unwrap_or(&[]);
                a[..tail.len()].copy_from_slice(tail);
                u64::from_le_bytes(a)
            };
        }
        if let Some(last) = bm.words.last_mut() {
            *last &= tail_mask(chunks);
        }
        bm.count = bm.words.iter().map(|w| u64::from(w.count_ones())).sum();
        bm
    }

    /// The first chunk at or after `from` whose bit, after `view` is applied to its word,
    /// is set. Skips whole words at a time.
    fn next_matching(&self, from: u64, view: impl Fn(u64) -> u64) -> Option<u64> {
        if from >= self.chunks {
            return None;
        }
        let mut i = (from / 64) as usize;
        let mut word = view(self.words[i]) & (u64::MAX << (from % 64));
        loop {
            if word != 0 {
                let chunk = i as u64 * 64 + u64::from(word.trailing_zeros());
                return (chunk < self.chunks).then_some(chunk);
            }
            i += 1;
            word = view(*self.words.get(i)?);
        }
    }

    /// Sets the bits of chunks `start..end` (`end <= chunks`), a word at a time.
    fn set_range(&mut self, start: u64, end: u64) {
        let mut at = start;
        while at < end {
            let i = (at / 64) as usize;
            let lo = at % 64;
            let hi = (end - i as u64 * 64).min(64);
            let mask = (u64::MAX >> (64 - (hi - lo))) << lo;
            let w = &mut self.words[i];
            self.count += u64::from((mask & !*w).count_ones());
            *w |= mask;
            at = i as u64 * 64 + hi;
        }
    }
}

/// `chunk`'s bit within its word.
fn bit(chunk: u64) -> u64 {
    1 << (chunk % 64)
}

/// The bits of the last word that hold chunks, for a bitmap of `chunks` bits.
fn tail_mask(chunks: u64) -> u64 {
    match chunks % 64 {
        0 => u64::MAX,
        r => (1 << r) - 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stored bitmap area of `bm`, block by block, as the metadata holds it.
    fn stored(bm: &Bitmap) -> Vec<u8> {
        let blocks = bm.chunks().div_ceil(BITS_PER_BLOCK).max(1) as usize;
        (0..blocks).flat_map(|b| bm.block_bytes(b)).collect()
    }

    #[test]
    fn set_clear_count_get() {
        let mut bm = Bitmap::new(130);
        assert_eq!((bm.chunks(), bm.count()), (130, 0));
        assert!(bm.set(0));
        assert!(!bm.set(0));
        assert!(bm.set(129));
        assert!(bm.set(64));
        assert_eq!(bm.count(), 3);
        assert!(bm.get(64) && !bm.get(65) && !bm.get(130) && !bm.get(u64::MAX));
        assert!(bm.clear(64));
        assert!(!bm.clear(64));
        assert_eq!(bm.count(), 2);
        bm.set_all();
        assert_eq!(bm.count(), 130);
        assert_eq!(bm.runs(), vec![(0, 130)]);
        // set_all leaves the padding bits of the last word clear.
        assert_eq!(Bitmap::from_blocks(130, &stored(&bm)), bm);
        assert_eq!(stored(&bm)[16], 0b11);
    }

    #[test]
    fn bit_order_on_disk() {
        let mut bm = Bitmap::new(100);
        bm.set(0);
        bm.set(11);
        bm.set(99);
        let b = bm.block_bytes(0);
        assert_eq!(b.len(), META_BLOCK);
        assert_eq!(b[0], 0b1);
        assert_eq!(b[1], 0b1000);
        assert_eq!(b[12], 0b1000);
        assert_eq!(b.iter().map(|x| x.count_ones()).sum::<u32>(), 3);
    }

    #[test]
    fn next_set_and_runs() {
        let mut bm = Bitmap::new(1000);
        assert_eq!(bm.next_set(0), None);
        assert!(bm.runs().is_empty());
        for c in [3, 4, 5, 63, 64, 500, 999] {
            bm.set(c);
        }
        assert_eq!(bm.next_set(0), Some(3));
        assert_eq!(bm.next_set(6), Some(63));
        assert_eq!(bm.next_set(65), Some(500));
        assert_eq!(bm.next_set(501), Some(999));
        assert_eq!(bm.next_set(1000), None);
        assert_eq!(bm.runs(), vec![(3, 3), (63, 2), (500, 1), (999, 1)]);
    }

    #[test]
    fn set_runs_merges_and_clips() {
        let mut bm = Bitmap::new(200);
        bm.set(10);
        bm.set_runs(&[
            (5, 10),
            (60, 70),
            (190, 50),
            (500, 3),
            (0, 0),
            (7, u64::MAX),
        ]);
        assert_eq!(bm.runs(), vec![(5, 195)]);
        assert_eq!(bm.count(), 195);
        let mut bm = Bitmap::new(200);
        bm.set_runs(&[(1, 1), (63, 2), (128, 64), (199, 9)]);
        assert_eq!(bm.runs(), vec![(1, 1), (63, 2), (128, 64), (199, 1)]);
        assert_eq!(bm.count(), 68);
        let mut again = Bitmap::new(200);
        again.set_runs(&bm.runs());
        assert_eq!(again, bm);
    }

    #[test]
    fn stored_form_round_trips_across_blocks() {
        // Three blocks, the last one partial and not a multiple of 64 bits.
        let chunks = 2 * BITS_PER_BLOCK + 1000 + 37;
        let mut bm = Bitmap::new(chunks);
        let picks = [
            0,
            BITS_PER_BLOCK - 1,
            BITS_PER_BLOCK,
            BITS_PER_BLOCK + 1,
            2 * BITS_PER_BLOCK - 64,
            2 * BITS_PER_BLOCK + 5,
            chunks - 1,
        ];
        for c in picks {
            bm.set(c);
        }
        bm.set_runs(&[(BITS_PER_BLOCK - 10, 20)]);
        assert_eq!(Bitmap::block_of(BITS_PER_BLOCK - 1), 0);
        assert_eq!(Bitmap::block_of(BITS_PER_BLOCK), 1);
        assert_eq!(Bitmap::block_of(chunks - 1), 2);
        let area = stored(&bm);
        assert_eq!(area.len(), 3 * META_BLOCK);
        let back = Bitmap::from_blocks(chunks, &area);
        assert_eq!(back, bm);
        assert_eq!(back.count(), bm.count());
        assert_eq!(back.runs(), bm.runs());
        // Only the block holding a chunk changes when that chunk's bit does.
        let mut changed = bm.clone();
        changed.clear(2 * BITS_PER_BLOCK + 5);
        assert_eq!(changed.block_bytes(0), bm.block_bytes(0));
        assert_eq!(changed.block_bytes(1), bm.block_bytes(1));
        assert_ne!(changed.block_bytes(2), bm.block_bytes(2));
        // A block past the end reads as zeros.
        assert!(bm.block_bytes(9).iter().all(|&b| b == 0));
    }

    #[test]
    fn from_blocks_ignores_bits_past_the_end() {
        let area = vec![0xffu8; META_BLOCK];
        let bm = Bitmap::from_blocks(70, &area);
        assert_eq!(bm.count(), 70);
        assert_eq!(bm.runs(), vec![(0, 70)]);
        let mut expect = Bitmap::new(70);
        expect.set_all();
        assert_eq!(bm, expect);
        // A short area reads as zeros where it is missing.
        let bm = Bitmap::from_blocks(70, &[0xff, 0x01]);
        assert_eq!(bm.runs(), vec![(0, 9)]);
    }
}
