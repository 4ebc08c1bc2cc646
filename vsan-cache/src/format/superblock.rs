//! The superblock: which backing store the cache belongs to, its geometry, where the live
//! log starts, and whether the last shutdown was clean. Two alternating checksummed copies.

use super::{
    CACHE_BLOCK, FormatError, RECORD_ALIGN, SUPERBLOCK_LEN, check_log_len, le_u32, le_u64, put,
};

/// The first eight bytes of every superblock copy.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"VSANCACH";
/// The format this code writes and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;
/// Superblock flag bit 0: the cache shut down cleanly, `head` and `next_seq` are valid and
/// start-up needs no scan.
pub const FLAG_CLEAN_SHUTDOWN: u32 = 1 << 0;
/// Superblock flag bit 1: the cache device failed while in use; its log is stale (writes
/// went to the backing store since) and must not be replayed.
pub const FLAG_FAILED: u32 = 1 << 1;
const KNOWN_FLAGS: u32 = FLAG_CLEAN_SHUTDOWN | FLAG_FAILED;
/// The smallest backing block size accepted.
const MIN_BACKING_BLOCK: u32 = 512;

/// Where the crc lives in every format version: the last four bytes of the block.
const CRC_AT: usize = SUPERBLOCK_LEN - 4;

// Field offsets; the module docs hold the same table.
const AT_VERSION: usize = 8;
const AT_FLAGS: usize = 12;
const AT_SEQ: usize = 16;
const AT_CACHE_ID: usize = 24;
const AT_BACKING_SIZE: usize = 40;
const AT_BACKING_BLOCK: usize = 48;
const AT_CACHE_BLOCK: usize = 52;
const AT_LOG_LEN: usize = 56;
const AT_TAIL: usize = 64;
const AT_TAIL_SEQ: usize = 72;
const AT_HEAD: usize = 80;
const AT_NEXT_SEQ: usize = 88;
const AT_MODE: usize = 96;

/// What the cache does with writes (and reads); stored in the superblock so a restart
/// comes back in the same mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// Writes go to the log and are acknowledged; destage copies them to the backing
    /// store later.
    WriteBack,
    /// Writes go to the backing store and the cache; reads may hit the cache.
    WriteThrough,
    /// Writes go to the backing store only (invalidating cached copies); reads may hit.
    WriteAround,
    /// The cache is bypassed entirely.
    PassThrough,
}

impl CacheMode {
    /// The mode's number in the superblock.
    pub fn to_u32(self) -> u32 {
        match self {
            CacheMode::WriteBack => 0,
            CacheMode::WriteThrough => 1,
            CacheMode::WriteAround => 2,
            CacheMode::PassThrough => 3,
        }
    }

    /// The mode stored as `v`, or [`FormatError::UnknownMode`].
    pub fn from_u32(v: u32) -> Result<CacheMode, FormatError> {
        match v {
            0 => Ok(CacheMode::WriteBack),
            1 => Ok(CacheMode::WriteThrough),
            2 => Ok(CacheMode::WriteAround),
            3 => Ok(CacheMode::PassThrough),
            other => Err(FormatError::UnknownMode(other)),
        }
    }
}

/// The cache device's superblock.
///
/// Stored as two alternating copies: the one with `seq` goes to copy `seq % 2`
/// ([`superblock_offset`]); [`pick`] reads back the newest valid one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Incremented on every write; the copy written is `seq % 2`.
    pub seq: u64,
    /// Random, set at format: ties the device to one cache instance.
    pub cache_id: [u8; 16],
    /// Size of the backing store in bytes, as it was at format.
    pub backing_size: u64,
    /// The backing store's block size: a power of two from 512 to `cache_block_size`.
    pub backing_block_size: u32,
    /// The cache block size; format version 1 knows only 4096.
    pub cache_block_size: u32,
    /// Bytes in the log region: a multiple of 4096, at least 64 KiB.
    pub log_len: u64,
    /// Log position of the oldest record not yet destaged.
    pub tail: u64,
    /// Sequence number of the record at `tail`.
    pub tail_seq: u64,
    /// Position after the last record; meaningful only when `clean_shutdown`.
    pub head: u64,
    /// Sequence number of the next record; meaningful only when `clean_shutdown`.
    pub next_seq: u64,
    /// The cache shut down cleanly: `head` and `next_seq` are valid, no scan needed.
    pub clean_shutdown: bool,
    /// The cache device failed while in use: the log is stale, format the device again.
    pub failed: bool,
    /// The mode the cache runs in.
    pub mode: CacheMode,
}

impl Superblock {
    /// The superblock as stored: magic, format version, fields little-endian, zeros, and
    /// the crc32 of everything before it in the last four bytes.
    pub fn encode(&self) -> [u8; SUPERBLOCK_LEN] {
        let mut b = [0u8; SUPERBLOCK_LEN];
        let mut flags = if self.clean_shutdown {
            FLAG_CLEAN_SHUTDOWN
        } else {
            0
        };
        if self.failed {
            flags |= FLAG_FAILED;
        }
        put(&mut b, 0, &SUPERBLOCK_MAGIC);
        put(&mut b, AT_VERSION, &FORMAT_VERSION.to_le_bytes());
        put(&mut b, AT_FLAGS, &flags.to_le_bytes());
        put(&mut b, AT_SEQ, &self.seq.to_le_bytes());
        put(&mut b, AT_CACHE_ID, &self.cache_id);
        put(&mut b, AT_BACKING_SIZE, &self.backing_size.to_le_bytes());
        put(
            &mut b,
            AT_BACKING_BLOCK,
            &self.backing_block_size.to_le_bytes(),
        );
        put(&mut b, AT_CACHE_BLOCK, &self.cache_block_size.to_le_bytes());
        put(&mut b, AT_LOG_LEN, &self.log_len.to_le_bytes());
        put(&mut b, AT_TAIL, &self.tail.to_le_bytes());
        put(&mut b, AT_TAIL_SEQ, &self.tail_seq.to_le_bytes());
        put(&mut b, AT_HEAD, &self.head.to_le_bytes());
        put(&mut b, AT_NEXT_SEQ, &self.next_seq.to_le_bytes());
        put(&mut b, AT_MODE, &self.mode.to_u32().to_le_bytes());
        let crc = crc32fast::hash(&b[..CRC_AT]);
        put(&mut b, CRC_AT, &crc.to_le_bytes());
        b
    }

    /// Reads a stored superblock from the first [`SUPERBLOCK_LEN`] bytes of `block`; the
    /// error says why it is not one (short, bad magic, crc mismatch, unsupported version,
    /// unknown flags or mode, bad geometry).
    pub fn decode(block: &[u8]) -> Result<Superblock, FormatError> {
        if block.len() < SUPERBLOCK_LEN {
            return Err(FormatError::Short {
                what: "superblock",
                len: block.len(),
                need: SUPERBLOCK_LEN,
            });
        }
        let b = &block[..SUPERBLOCK_LEN];
        if b[..SUPERBLOCK_MAGIC.len()] != SUPERBLOCK_MAGIC {
            return Err(FormatError::BadSuperblockMagic {
                zeroed: b.iter().all(|&x| x == 0),
            });
        }
        let (stored, computed) = (le_u32(b, CRC_AT), crc32fast::hash(&b[..CRC_AT]));
        if stored != computed {
            return Err(FormatError::SuperblockCrc { stored, computed });
        }
        let version = le_u32(b, AT_VERSION);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let flags = le_u32(b, AT_FLAGS);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(FormatError::UnknownSuperblockFlags(flags & !KNOWN_FLAGS));
        }
        let mut cache_id = [0u8; 16];
        cache_id.copy_from_slice(&b[AT_CACHE_ID..AT_CACHE_ID + 16]);
        let sb = Superblock {
            seq: le_u64(b, AT_SEQ),
            cache_id,
            backing_size: le_u64(b, AT_BACKING_SIZE),
            backing_block_size: le_u32(b, AT_BACKING_BLOCK),
            cache_block_size: le_u32(b, AT_CACHE_BLOCK),
            log_len: le_u64(b, AT_LOG_LEN),
            tail: le_u64(b, AT_TAIL),
            tail_seq: le_u64(b, AT_TAIL_SEQ),
            head: le_u64(b, AT_HEAD),
            next_seq: le_u64(b, AT_NEXT_SEQ),
            clean_shutdown: flags & FLAG_CLEAN_SHUTDOWN != 0,
            failed: flags & FLAG_FAILED != 0,
            mode: CacheMode::from_u32(le_u32(b, AT_MODE))?,
        };
        sb.check()?;
        Ok(sb)
    }

    /// Checks that the fields describe a usable cache: block sizes, log length, record
    /// alignment of `tail`, `seq`, `tail_seq` and `tail` at most `u64::MAX / 2`, and, when
    /// clean, a `head`/`next_seq` that fit `tail`/`tail_seq`.
    ///
    /// [`decode`](Self::decode) runs it; whoever formats a device should run it before
    /// writing.
    pub fn check(&self) -> Result<(), FormatError> {
        let bad = |msg: String| Err(FormatError::BadGeometry(msg));
        let (cbs, bbs) = (self.cache_block_size, self.backing_block_size);
        if !cbs.is_power_of_two() {
            return bad(format!("cache block size {cbs} is not a power of two"));
        }
        if cbs != CACHE_BLOCK {
            return bad(format!(
                "cache block size {cbs} is not {CACHE_BLOCK}, the only one format version 1 has"
            ));
        }
        if !bbs.is_power_of_two() {
            return bad(format!("backing block size {bbs} is not a power of two"));
        }
        // A cache block must be whole backing blocks, so destage never needs a
        // read-modify-write of the backing store.
        if !(MIN_BACKING_BLOCK..=cbs).contains(&bbs) {
            return bad(format!(
                "backing block size {bbs} is outside {MIN_BACKING_BLOCK} ..= {cbs}"
            ));
        }
        if self.backing_size == 0 || self.backing_size % u64::from(bbs) != 0 {
            return bad(format!(
                "backing size {} is not a non-zero multiple of its block size {bbs}",
                self.backing_size
            ));
        }
        check_log_len(self.log_len)?;
        if self.tail % RECORD_ALIGN != 0 {
            return bad(format!("tail {} is not a multiple of 64", self.tail));
        }
        // Sequence numbers grow by one per write and positions by its bytes: past half
        // their range is damage, and counting on from there would overflow.
        for (what, v) in [
            ("seq", self.seq),
            ("tail seq", self.tail_seq),
            ("tail", self.tail),
        ] {
            if v > u64::MAX / 2 {
                return bad(format!("{what} {v} is implausible"));
            }
        }
        if self.clean_shutdown {
            let (tail, head) = (self.tail, self.head);
            if head % RECORD_ALIGN != 0 {
                return bad(format!("head {head} is not a multiple of 64"));
            }
            if tail > head {
                return bad(format!("tail {tail} is past head {head}"));
            }
            if head - tail > self.log_len {
                return bad(format!(
                    "tail {tail} to head {head} is longer than the log ({})",
                    self.log_len
                ));
            }
            // Every record takes one seq and at least 64 bytes: the count of seqs
            // between tail and head is bounded by the bytes between them.
            let records = self.next_seq.wrapping_sub(self.tail_seq);
            let most = (head - tail) / RECORD_ALIGN;
            if records > most || (records == 0) != (head == tail) {
                return bad(format!(
                    "{records} records (seq {} to {}) cannot fill tail {tail} to head {head}",
                    self.tail_seq, self.next_seq
                ));
            }
        }
        Ok(())
    }
}

/// Where the superblock with sequence number `seq` is written on the cache device, in
/// bytes: copy `seq % 2`.
pub fn superblock_offset(seq: u64) -> u64 {
    (seq % 2) * SUPERBLOCK_LEN as u64
}

/// The superblock to trust from the two stored copies: the valid one with the highest
/// seq, where a copy counts as valid only if it sits in the slot its seq chooses
/// (`seq % 2`). When neither is, the error names both reasons.
pub fn pick(copy0: &[u8], copy1: &[u8]) -> Result<Superblock, FormatError> {
    let read = |slot: usize, bytes: &[u8]| {
        let sb = Superblock::decode(bytes)?;
        if sb.seq % 2 != slot as u64 {
            return Err(FormatError::WrongSlot { slot, seq: sb.seq });
        }
        Ok(sb)
    };
    match (read(0, copy0), read(1, copy1)) {
        (Ok(a), Ok(b)) => Ok(if a.seq > b.seq { a } else { b }),
        (Ok(a), Err(_)) => Ok(a),
        (Err(_), Ok(b)) => Ok(b),
        (Err(e0), Err(e1)) => Err(FormatError::NoValidSuperblock {
            copy0: Box::new(e0),
            copy1: Box::new(e1),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::MIN_LOG_LEN;

    fn sample() -> Superblock {
        Superblock {
            seq: 42,
            cache_id: [0x5a; 16],
            backing_size: 10 << 30,
            backing_block_size: 512,
            cache_block_size: 4096,
            log_len: 1 << 20,
            tail: 3 * (1 << 20) + 640,
            tail_seq: 1000,
            head: 3 * (1 << 20) + 640 + 8192,
            next_seq: 1003,
            clean_shutdown: true,
            failed: false,
            mode: CacheMode::WriteBack,
        }
    }

    /// Rewrites the crc so a test can reach the checks behind it.
    fn recrc(b: &mut [u8; SUPERBLOCK_LEN]) {
        let crc = crc32fast::hash(&b[..CRC_AT]);
        b[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
    }

    fn geometry_error(sb: &Superblock) -> String {
        match Superblock::decode(&sb.encode()) {
            Err(FormatError::BadGeometry(msg)) => msg,
            other => panic!("expected bad geometry, got {other:?}"),
        }
    }

    #[test]
    fn round_trips() {
        let sb = sample();
        let b = sb.encode();
        assert_eq!(&b[..8], b"VSANCACH");
        assert_eq!(Superblock::decode(&b), Ok(sb.clone()));
        // A longer buffer decodes from its first block.
        let mut long = b.to_vec();
        long.extend_from_slice(&[0xff; 100]);
        assert_eq!(Superblock::decode(&long), Ok(sb));
    }

    #[test]
    fn round_trips_every_mode_and_a_dirty_log() {
        for mode in [
            CacheMode::WriteBack,
            CacheMode::WriteThrough,
            CacheMode::WriteAround,
            CacheMode::PassThrough,
        ] {
            // Dirty: head and next_seq are whatever was left there and are not checked.
            let sb = Superblock {
                mode,
                clean_shutdown: false,
                head: 7,
                next_seq: 0,
                ..sample()
            };
            assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));
            assert_eq!(CacheMode::from_u32(mode.to_u32()), Ok(mode));
        }
    }

    #[test]
    fn layout_matches_the_docs() {
        let b = sample().encode();
        assert_eq!(le_u32(&b, 8), 1, "version");
        assert_eq!(le_u32(&b, 12), 1, "flags: clean");
        assert_eq!(le_u64(&b, 16), 42);
        assert_eq!(&b[24..40], &[0x5a; 16]);
        assert_eq!(le_u64(&b, 40), 10 << 30);
        assert_eq!(le_u32(&b, 48), 512);
        assert_eq!(le_u32(&b, 52), 4096);
        assert_eq!(le_u64(&b, 56), 1 << 20);
        assert_eq!(le_u64(&b, 64), 3 * (1 << 20) + 640);
        assert_eq!(le_u64(&b, 72), 1000);
        assert_eq!(le_u64(&b, 80), 3 * (1 << 20) + 640 + 8192);
        assert_eq!(le_u64(&b, 88), 1003);
        assert_eq!(le_u32(&b, 96), 0);
        assert!(b[100..4092].iter().all(|&x| x == 0));
        assert_eq!(le_u32(&b, 4092), crc32fast::hash(&b[..4092]));
    }

    #[test]
    fn refuses_short_blocks() {
        let b = sample().encode();
        assert_eq!(
            Superblock::decode(&b[..4095]),
            Err(FormatError::Short {
                what: "superblock",
                len: 4095,
                need: 4096
            })
        );
        assert!(Superblock::decode(&[]).is_err());
    }

    #[test]
    fn refuses_bad_magic() {
        let zero = [0u8; SUPERBLOCK_LEN];
        let e = Superblock::decode(&zero).unwrap_err();
        assert_eq!(e, FormatError::BadSuperblockMagic { zeroed: true });
        assert!(e.to_string().contains("never written"), "{e}");
        let mut b = sample().encode();
        b[0] = b'X';
        recrc(&mut b);
        assert_eq!(
            Superblock::decode(&b),
            Err(FormatError::BadSuperblockMagic { zeroed: false })
        );
    }

    #[test]
    fn refuses_a_crc_mismatch_anywhere() {
        let good = sample().encode();
        for at in [8, 16, 30, 64, 100, 2000, 4091, 4092, 4095] {
            let mut b = good;
            b[at] ^= 0x01;
            assert!(
                matches!(
                    Superblock::decode(&b),
                    Err(FormatError::SuperblockCrc { .. })
                ),
                "flip at {at}"
            );
        }
    }

    #[test]
    fn refuses_another_version() {
        let mut b = sample().encode();
        put(&mut b, AT_VERSION, &2u32.to_le_bytes());
        recrc(&mut b);
        let e = Superblock::decode(&b).unwrap_err();
        assert_eq!(e, FormatError::UnsupportedVersion(2));
        assert!(e.to_string().contains("version 2"), "{e}");
    }

    #[test]
    fn refuses_unknown_flags_and_modes() {
        let mut b = sample().encode();
        put(&mut b, AT_FLAGS, &0x11u32.to_le_bytes());
        recrc(&mut b);
        assert_eq!(
            Superblock::decode(&b),
            Err(FormatError::UnknownSuperblockFlags(0x10))
        );
        let mut b = sample().encode();
        put(&mut b, AT_MODE, &4u32.to_le_bytes());
        recrc(&mut b);
        assert_eq!(Superblock::decode(&b), Err(FormatError::UnknownMode(4)));
    }

    #[test]
    fn refuses_bad_log_lengths() {
        let msg = geometry_error(&Superblock {
            log_len: (1 << 20) + 512,
            ..sample()
        });
        assert!(msg.contains("not a multiple of 4096"), "{msg}");
        let msg = geometry_error(&Superblock {
            log_len: MIN_LOG_LEN - 4096,
            ..sample()
        });
        assert!(msg.contains("minimum"), "{msg}");
        geometry_error(&Superblock {
            log_len: 0,
            ..sample()
        });
    }

    #[test]
    fn refuses_bad_block_sizes() {
        for (cbs, bbs, want) in [
            (4096, 768, "backing block size 768 is not a power of two"),
            (4096, 0, "backing block size 0 is not a power of two"),
            (4096, 256, "outside 512"),
            (4096, 8192, "outside 512"),
            (3000, 512, "cache block size 3000 is not a power of two"),
            (8192, 512, "only one format version 1 has"),
        ] {
            let msg = geometry_error(&Superblock {
                cache_block_size: cbs,
                backing_block_size: bbs,
                ..sample()
            });
            assert!(msg.contains(want), "{cbs}/{bbs}: {msg}");
        }
        let msg = geometry_error(&Superblock {
            backing_size: (10 << 30) + 100,
            ..sample()
        });
        assert!(msg.contains("backing size"), "{msg}");
        geometry_error(&Superblock {
            backing_size: 0,
            ..sample()
        });
    }

    #[test]
    fn refuses_positions_that_do_not_fit() {
        let s = sample();
        let msg = geometry_error(&Superblock {
            tail: s.tail + 1,
            ..s.clone()
        });
        assert!(msg.contains("tail"), "{msg}");
        let msg = geometry_error(&Superblock {
            head: s.tail - 64,
            next_seq: s.tail_seq,
            ..s.clone()
        });
        assert!(msg.contains("past head"), "{msg}");
        let msg = geometry_error(&Superblock {
            head: s.head + 32,
            ..s.clone()
        });
        assert!(msg.contains("head"), "{msg}");
        let msg = geometry_error(&Superblock {
            head: s.tail + s.log_len + 64,
            ..s.clone()
        });
        assert!(msg.contains("longer than the log"), "{msg}");
        // More records than 64-byte slots between tail and head.
        let msg = geometry_error(&Superblock {
            head: s.tail + 128,
            next_seq: s.tail_seq + 3,
            ..s.clone()
        });
        assert!(msg.contains("records"), "{msg}");
        // Seq going backwards.
        geometry_error(&Superblock {
            next_seq: s.tail_seq - 1,
            ..s.clone()
        });
        // Bytes but no records, records but no bytes.
        geometry_error(&Superblock {
            next_seq: s.tail_seq,
            ..s.clone()
        });
        geometry_error(&Superblock {
            head: s.tail,
            ..s.clone()
        });
        // An empty clean log, and a full one, are fine.
        let empty = Superblock {
            head: s.tail,
            next_seq: s.tail_seq,
            ..s.clone()
        };
        assert_eq!(Superblock::decode(&empty.encode()), Ok(empty));
        let full = Superblock {
            head: s.tail + s.log_len,
            ..s
        };
        assert_eq!(Superblock::decode(&full.encode()), Ok(full));
    }

    #[test]
    fn tail_past_head_is_fine_when_not_clean() {
        let sb = Superblock {
            clean_shutdown: false,
            head: 0,
            ..sample()
        };
        assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));
    }

    fn at_seq(seq: u64) -> [u8; SUPERBLOCK_LEN] {
        Superblock { seq, ..sample() }.encode()
    }

    #[test]
    fn pick_takes_the_newest_valid_copy() {
        let (c0, c1) = (at_seq(10), at_seq(11));
        assert_eq!(pick(&c0, &c1).map(|s| s.seq), Ok(11));
        let (c0, c1) = (at_seq(12), at_seq(11));
        assert_eq!(pick(&c0, &c1).map(|s| s.seq), Ok(12));
    }

    #[test]
    fn pick_survives_one_torn_copy() {
        // Writing seq 13 into slot 1 was torn: fall back to slot 0's seq 12.
        let c0 = at_seq(12);
        let mut c1 = at_seq(13);
        c1[2000..].fill(0);
        assert_eq!(pick(&c0, &c1).map(|s| s.seq), Ok(12));
        // And the other way round.
        let mut c0 = at_seq(14);
        c0[40] ^= 0xff;
        assert_eq!(pick(&c0, &at_seq(13)).map(|s| s.seq), Ok(13));
    }

    #[test]
    fn pick_ignores_a_copy_in_the_wrong_slot() {
        // Slot 1 holds a sound block with an even seq higher than slot 0's.
        let (c0, c1) = (at_seq(10), at_seq(20));
        assert_eq!(pick(&c0, &c1).map(|s| s.seq), Ok(10));
        let (c0, c1) = (at_seq(21), at_seq(11));
        assert_eq!(pick(&c0, &c1).map(|s| s.seq), Ok(11));
    }

    #[test]
    fn pick_names_both_reasons_when_both_are_bad() {
        let mut c1 = at_seq(11);
        c1[100] = 1;
        let e = pick(&[0u8; SUPERBLOCK_LEN], &c1).unwrap_err();
        match &e {
            FormatError::NoValidSuperblock { copy0, copy1 } => {
                assert_eq!(**copy0, FormatError::BadSuperblockMagic { zeroed: true });
                assert!(matches!(**copy1, FormatError::SuperblockCrc { .. }));
            }
            other => panic!("{other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("copy 0: bad superblock magic"), "{msg}");
        assert!(msg.contains("copy 1: superblock crc mismatch"), "{msg}");

        let e = pick(&at_seq(11), &at_seq(10)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("copy 0 holds seq 11"), "{msg}");
        assert!(msg.contains("copy 1 holds seq 10"), "{msg}");
        assert!(pick(&[], &[]).is_err());
    }

    #[test]
    fn copies_live_at_the_start_of_the_device() {
        assert_eq!(superblock_offset(42), 0);
        assert_eq!(superblock_offset(43), 4096);
    }
}
