//! Self-describing block contents for verified workloads.
//!
//! Block `b` at generation `g` (the g-th write to it) holds `b` and `g` in its first 16
//! bytes followed by a pseudo-random stream seeded from both, so a read can be checked
//! against exactly one expected value, and a misplaced or stale block is recognisable.
//! Generation 0 means "never written": all zeros.

use std::sync::atomic::{AtomicU32, Ordering};

/// The workload's block size.
pub const BLOCK: usize = 4096;

/// The expected contents of `block` after its `generation`-th write.
pub fn expected_block(block: u64, generation: u32) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK];
    if generation == 0 {
        return out;
    }
    out[0..8].copy_from_slice(&block.to_le_bytes());
    out[8..16].copy_from_slice(&u64::from(generation).to_le_bytes());
    // xorshift64*: fast, and plenty to tell blocks apart.
    let mut x =
        block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(generation) ^ 0x2545_f491_4f6c_dd1d;
    for chunk in out[16..].chunks_exact_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        chunk.copy_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out
}

/// The last acknowledged generation of every block.
#[derive(Debug)]
pub struct BlockLog {
    generations: Vec<AtomicU32>,
}

impl BlockLog {
    /// A log for `blocks` blocks, all never written.
    pub fn new(blocks: u64) -> BlockLog {
        BlockLog {
            generations: (0..blocks).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// The last acknowledged generation of `block` (0 if never written or out of range).
    pub fn generation(&self, block: u64) -> u32 {
        self.generations
            .get(block as usize)
            .map_or(0, |g| g.load(Ordering::Acquire))
    }

    /// Record that the write of `generation` to `block` was acknowledged.
    pub fn set_generation(&self, block: u64, generation: u32) {
        if let Some(g) = self.generations.get(block as usize) {
            g.store(generation, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_generations_differ() {
        assert_eq!(expected_block(3, 0), vec![0; BLOCK]);
        assert_ne!(expected_block(3, 1), expected_block(3, 2));
        assert_ne!(expected_block(3, 1), expected_block(4, 1));
        assert_eq!(expected_block(3, 1), expected_block(3, 1));
    }
}
