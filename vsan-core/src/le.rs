//! Little-endian fields in fixed on-media layouts (the cache's superblock and records,
//! a replica's metadata): read at, and write at, a byte offset the caller has checked.

/// The little-endian `u32` at `b[at..at + 4]`. Panics if `b` is shorter: callers check
/// the length of the block first.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// The little-endian `u64` at `b[at..at + 8]`. Panics if `b` is shorter, like
/// [`u32_at`].
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Copy `bytes` (a field already in little-endian order) into `b` at `at`.
pub fn put(b: &mut [u8], at: usize, bytes: &[u8]) {
    b[at..at + bytes.len()].copy_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_at_an_offset() {
        let mut b = [0u8; 16];
        put(&mut b, 2, &0x0102_0304u32.to_le_bytes());
        put(&mut b, 8, &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(u32_at(&b, 2), 0x0102_0304);
        assert_eq!(u64_at(&b, 8), 0x1122_3344_5566_7788);
        assert_eq!(b[2], 0x04, "little-endian");
    }
}
