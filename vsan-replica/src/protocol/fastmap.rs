//! Hash maps keyed by the protocol's own integers (request ids, op ids, offsets), with a
//! multiply-rotate hasher instead of SipHash: the maps are touched several times per
//! request on the hot path, and their keys are numbers this node hands out (or a
//! connected, authenticated peer's ids), so flooding resistance buys nothing here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with [`IdHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Mixes each integer written into the state with a rotate, xor and multiply by an odd
/// constant, so sequential ids spread over the table's high bits.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

const K: u64 = 0x517c_c1b7_2722_0a95;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_and_round_trip() {
        let mut m: FastMap<u64, u64> = FastMap::default();
        for i in 0..100_000u64 {
            m.insert(i, i * 2);
        }
        for i in 0..100_000u64 {
            assert_eq!(m.get(&i), Some(&(i * 2)));
        }
        let mut tops = std::collections::HashSet::new();
        for i in 0..1024u64 {
            let mut h = IdHasher::default();
            h.write_u64(i);
            tops.insert(h.finish() >> 57);
        }
        assert!(tops.len() > 100, "top bits vary: {}", tops.len());
    }
}
