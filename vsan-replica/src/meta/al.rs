//! The activity log's on-disk record: the extents that may hold writes in flight.

use bytes::Bytes;

use vsan_core::Result;

use super::{AL_SLOTS, Layout, corrupt, le_u32, le_u64, put};

const MAGIC: [u8; 8] = *b"VSANALOG";
const AT_SEQ: usize = 8;
const AT_COUNT: usize = 16;
const AT_EXTENTS: usize = 24;

/// Bytes a record needs before rounding up to whole blocks: header, every slot, crc.
pub(super) const AL_RECORD_MIN: usize = AT_EXTENTS + AL_SLOTS * 8 + 4;

/// The activity log record with `seq` holding `extents` (extent numbers, at most
/// [`AL_SLOTS`] of them): [`Layout::al_len`] bytes, to be written at
/// [`Layout::al_offset`]`(seq)`.
///
/// # Panics
///
/// If `extents` holds more than [`AL_SLOTS`] extents: the log's owner evicts an extent
/// before it admits another, so more is a bug, and dropping one would lose a write in
/// flight after a crash.
pub fn encode_al(layout: &Layout, seq: u64, extents: &[u64]) -> Bytes {
    assert!(
        extents.len() <= AL_SLOTS,
        "activity log of {} extents, over its {AL_SLOTS} slots",
        extents.len()
    );
    let len = layout.al_len();
    let mut b = vec![0u8; len];
    put(&mut b, 0, &MAGIC);
    put(&mut b, AT_SEQ, &seq.to_le_bytes());
    put(&mut b, AT_COUNT, &(extents.len() as u32).to_le_bytes());
    for (i, e) in extents.iter().enumerate() {
        put(&mut b, AT_EXTENTS + i * 8, &e.to_le_bytes());
    }
    let crc = crc32fast::hash(&b[..len - 4]);
    put(&mut b, len - 4, &crc.to_le_bytes());
    Bytes::from(b)
}

/// Reads a stored activity log record: its seq and extents. The error says why it is not
/// one ("short record", "bad magic", "crc mismatch", a count over the slots, an extent past
/// the end of the disk).
pub fn decode_al(layout: &Layout, bytes: &[u8]) -> Result<(u64, Vec<u64>)> {
    let len = layout.al_len();
    if bytes.len() < len {
        return Err(corrupt(format!(
            "short record ({} bytes, an activity log copy is {len})",
            bytes.len()
        )));
    }
    let b = &bytes[..len];
    if b[..MAGIC.len()] != MAGIC {
        if b.iter().all(|&x| x == 0) {
            return Err(corrupt("bad magic (all zeros: never written)"));
        }
        return Err(corrupt("bad magic"));
    }
    let (stored, actual) = (le_u32(b, len - 4), crc32fast::hash(&b[..len - 4]));
    if stored != actual {
        return Err(corrupt(format!(
            "crc mismatch (stored {stored:#010x}, computed {actual:#010x})"
        )));
    }
    let seq = le_u64(b, AT_SEQ);
    let count = le_u32(b, AT_COUNT) as usize;
    if count > AL_SLOTS {
        return Err(corrupt(format!(
            "count {count} is over the {AL_SLOTS} slots of the activity log"
        )));
    }
    let extents: Vec<u64> = (0..count).map(|i| le_u64(b, AT_EXTENTS + i * 8)).collect();
    if let Some(e) = extents.iter().find(|&&e| e >= layout.extents()) {
        return Err(corrupt(format!(
            "extent {e} is past the end of the disk ({} extents)",
            layout.extents()
        )));
    }
    Ok((seq, extents))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::DEFAULT_CHUNK_SIZE;

    fn layout() -> Layout {
        // 4 GiB: exactly as many extents as the log has slots.
        Layout::new(4 << 30, DEFAULT_CHUNK_SIZE)
    }

    #[test]
    fn round_trip() {
        let l = layout();
        for extents in [
            vec![],
            vec![0, 255, 17],
            (0..AL_SLOTS as u64).rev().collect(),
        ] {
            let b = encode_al(&l, 9, &extents);
            assert_eq!(b.len(), l.al_len());
            assert_eq!(decode_al(&l, &b).unwrap(), (9, extents));
        }
    }

    #[test]
    fn refusals_say_why() {
        let l = layout();
        let good = encode_al(&l, 3, &[1, 2]);
        let err = |b: &[u8]| decode_al(&l, b).unwrap_err().context().to_string();
        assert!(err(&good[..10]).starts_with("short record"));
        assert!(err(&vec![0u8; l.al_len()]).starts_with("bad magic"));
        let mut b = good.to_vec();
        b[AT_EXTENTS] ^= 1;
        assert!(err(&b).starts_with("crc mismatch"));
        let refresh = |b: &mut Vec<u8>| {
            let n = b.len();
            let crc = crc32fast::hash(&b[..n - 4]);
            put(b, n - 4, &crc.to_le_bytes());
        };
        let mut b = good.to_vec();
        put(&mut b, AT_COUNT, &(AL_SLOTS as u32 + 1).to_le_bytes());
        refresh(&mut b);
        assert!(err(&b).contains("over the 1024 slots"));
        let b = encode_al(&l, 3, &[1024]);
        assert_eq!(
            err(&b),
            "extent 1024 is past the end of the disk (1024 extents)"
        );
    }

    #[test]
    #[should_panic(expected = "over its 1024 slots")]
    fn too_many_extents_is_a_bug() {
        let extents: Vec<u64> = (0..=AL_SLOTS as u64).collect();
        encode_al(&layout(), 1, &extents);
    }
}
