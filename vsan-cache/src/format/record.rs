//! Log records: the 64-byte header in front of each append, and where in the log the next
//! record goes.

use super::{CACHE_BLOCK, FormatError, RECORD_ALIGN, check_log_len, le_u32, le_u64, put};

/// Bytes in a record header.
pub const HEADER_LEN: usize = 64;
/// The first four bytes of every record header (`"VCRL"` read as a big-endian number; on
/// media, little-endian, `4c 52 43 56`).
pub const RECORD_MAGIC: u32 = 0x5643_524c;
/// Record flag bit 0: a WRAP record; the log continues at the next multiple of `log_len`.
pub const FLAG_WRAP: u32 = 1 << 0;
/// Record flag bit 1: a FLUSH mark; no data, it only takes a sequence number.
pub const FLAG_FLUSH: u32 = 1 << 1;
/// Record flag bit 2: a ZERO record; blocks `lba .. lba + nblocks` read as zeroes, and
/// the record carries no data.
pub const FLAG_ZERO: u32 = 1 << 2;
/// Record flag bit 3: a DISCARD record; like [`FLAG_ZERO`] in the cache, destaged as a
/// discard of the backing range.
pub const FLAG_DISCARD: u32 = 1 << 3;
const KNOWN_FLAGS: u32 = FLAG_WRAP | FLAG_FLUSH | FLAG_ZERO | FLAG_DISCARD;

// Field offsets; the module docs hold the same table.
const AT_FLAGS: usize = 4;
const AT_SEQ: usize = 8;
const AT_LBA: usize = 16;
const AT_NBLOCKS: usize = 24;
const AT_DATA_CRC: usize = 28;
const AT_RESERVED: usize = 32;
const AT_HEADER_CRC: usize = 60;

/// The decoded header of one log record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// [`FLAG_WRAP`], [`FLAG_FLUSH`], or 0 for a data record.
    pub flags: u32,
    /// The record's sequence number: one more than the record before it.
    pub seq: u64,
    /// First block written, in cache blocks of 4096 bytes (0 for WRAP and FLUSH).
    pub lba: u64,
    /// Data blocks after the header (0 for WRAP and FLUSH).
    pub nblocks: u32,
    /// crc32 of the data (of nothing, 0, for WRAP and FLUSH).
    pub data_crc: u32,
}

impl RecordHeader {
    /// The header of a data record writing `data` at block `lba`; `data` must be a
    /// non-zero whole number of 4096-byte blocks (fewer than 2^32).
    pub fn data(seq: u64, lba: u64, data: &[u8]) -> Result<RecordHeader, FormatError> {
        let block = CACHE_BLOCK as usize;
        let bad = FormatError::BadDataLength { len: data.len() };
        if data.is_empty() || data.len() % block != 0 {
            return Err(bad);
        }
        let nblocks = u32::try_from(data.len() / block).map_err(|_| bad)?;
        if lba.checked_add(u64::from(nblocks)).is_none() {
            return Err(FormatError::RangeOverflow { lba, nblocks });
        }
        Ok(RecordHeader {
            flags: 0,
            seq,
            lba,
            nblocks,
            data_crc: crc32fast::hash(data),
        })
    }

    /// A WRAP record with sequence number `seq`.
    pub fn wrap(seq: u64) -> RecordHeader {
        RecordHeader::marker(FLAG_WRAP, seq)
    }

    /// A FLUSH mark with sequence number `seq`.
    pub fn flush_mark(seq: u64) -> RecordHeader {
        RecordHeader::marker(FLAG_FLUSH, seq)
    }

    /// A ZERO record (`discard == false`) or DISCARD record for `nblocks` blocks at
    /// `lba`; it carries no data. `nblocks` must be non-zero and the range must not
    /// overflow.
    pub fn range(
        seq: u64,
        lba: u64,
        nblocks: u32,
        discard: bool,
    ) -> Result<RecordHeader, FormatError> {
        if nblocks == 0 {
            return Err(FormatError::EmptyRecord);
        }
        if lba.checked_add(u64::from(nblocks)).is_none() {
            return Err(FormatError::RangeOverflow { lba, nblocks });
        }
        let flags = if discard { FLAG_DISCARD } else { FLAG_ZERO };
        Ok(RecordHeader {
            flags,
            seq,
            lba,
            nblocks,
            data_crc: crc32fast::hash(&[]),
        })
    }

    fn marker(flags: u32, seq: u64) -> RecordHeader {
        RecordHeader {
            flags,
            seq,
            lba: 0,
            nblocks: 0,
            data_crc: crc32fast::hash(&[]),
        }
    }

    /// This is a WRAP record.
    pub fn is_wrap(&self) -> bool {
        self.flags & FLAG_WRAP != 0
    }

    /// This is a FLUSH mark.
    pub fn is_flush_mark(&self) -> bool {
        self.flags & FLAG_FLUSH != 0
    }

    /// This is a ZERO or DISCARD record: a block range without data.
    pub fn is_range(&self) -> bool {
        self.flags & (FLAG_ZERO | FLAG_DISCARD) != 0
    }

    /// This is a DISCARD record.
    pub fn is_discard(&self) -> bool {
        self.flags & FLAG_DISCARD != 0
    }

    /// This record carries data: not a WRAP, FLUSH, ZERO or DISCARD record.
    pub fn has_data(&self) -> bool {
        self.flags == 0
    }

    /// Bytes of data after the header (0 for every record but a data record).
    pub fn data_len(&self) -> u64 {
        if self.has_data() {
            u64::from(self.nblocks) * u64::from(CACHE_BLOCK)
        } else {
            0
        }
    }

    /// Bytes this record takes in the log: the header plus its data rounded up to 64.
    pub fn stored_len(&self) -> u64 {
        if self.has_data() {
            record_len(self.nblocks)
        } else {
            HEADER_LEN as u64
        }
    }
}

/// The header as stored: fields little-endian, reserved bytes zero, and the crc32 of bytes
/// 0..60 (which hold `data_crc`) in bytes 60..64.
pub fn encode_header(h: &RecordHeader) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    put(&mut b, 0, &RECORD_MAGIC.to_le_bytes());
    put(&mut b, AT_FLAGS, &h.flags.to_le_bytes());
    put(&mut b, AT_SEQ, &h.seq.to_le_bytes());
    put(&mut b, AT_LBA, &h.lba.to_le_bytes());
    put(&mut b, AT_NBLOCKS, &h.nblocks.to_le_bytes());
    put(&mut b, AT_DATA_CRC, &h.data_crc.to_le_bytes());
    let crc = crc32fast::hash(&b[..AT_HEADER_CRC]);
    put(&mut b, AT_HEADER_CRC, &crc.to_le_bytes());
    b
}

/// Reads a record header from the first [`HEADER_LEN`] bytes of `b`; the error says why it
/// is not one (short, bad magic, header crc mismatch, bad flags, a marker with data, ...).
///
/// The data crc is not checked here: the data is not in `b`. [`scan`](super::scan) checks
/// it.
pub fn decode_header(b: &[u8]) -> Result<RecordHeader, FormatError> {
    if b.len() < HEADER_LEN {
        return Err(FormatError::Short {
            what: "record header",
            len: b.len(),
            need: HEADER_LEN,
        });
    }
    let b = &b[..HEADER_LEN];
    let magic = le_u32(b, 0);
    if magic != RECORD_MAGIC {
        return Err(FormatError::BadRecordMagic { found: magic });
    }
    let (stored, computed) = (
        le_u32(b, AT_HEADER_CRC),
        crc32fast::hash(&b[..AT_HEADER_CRC]),
    );
    if stored != computed {
        return Err(FormatError::HeaderCrc { stored, computed });
    }
    let flags = le_u32(b, AT_FLAGS);
    if flags & !KNOWN_FLAGS != 0 || flags.count_ones() > 1 {
        return Err(FormatError::BadRecordFlags(flags));
    }
    if b[AT_RESERVED..AT_HEADER_CRC].iter().any(|&x| x != 0) {
        return Err(FormatError::ReservedNotZero);
    }
    let h = RecordHeader {
        flags,
        seq: le_u64(b, AT_SEQ),
        lba: le_u64(b, AT_LBA),
        nblocks: le_u32(b, AT_NBLOCKS),
        data_crc: le_u32(b, AT_DATA_CRC),
    };
    let marker = h.is_wrap() || h.is_flush_mark();
    if marker && h.nblocks != 0 {
        let kind = if h.is_wrap() { "WRAP" } else { "FLUSH mark" };
        return Err(FormatError::MarkerWithData {
            kind,
            nblocks: h.nblocks,
        });
    }
    if !marker && h.nblocks == 0 {
        return Err(FormatError::EmptyRecord);
    }
    if h.lba.checked_add(u64::from(h.nblocks)).is_none() {
        return Err(FormatError::RangeOverflow {
            lba: h.lba,
            nblocks: h.nblocks,
        });
    }
    Ok(h)
}

/// Bytes a record with `nblocks` data blocks takes in the log: the header plus the data,
/// rounded up to a multiple of 64.
pub fn record_len(nblocks: u32) -> u64 {
    let data = u64::from(nblocks) * u64::from(CACHE_BLOCK);
    HEADER_LEN as u64 + data.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// Where a record goes in the log, from [`place`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Where a WRAP record must be written first, when the record would straddle the end
    /// of the log region; `None` when it fits where it is.
    pub wrap_at: Option<u64>,
    /// The record's position.
    pub start: u64,
    /// The position after the record: where the next one is placed from.
    pub next: u64,
}

/// Where a record of `nblocks` data blocks goes when the log ends at position `pos`: at
/// `pos` if it fits before the end of the log region, otherwise after a WRAP record at
/// `pos`, at the next multiple of `log_len`.
///
/// Refuses a `pos` that is not a multiple of 64, a `log_len` that
/// [`check_log_len`](super::check_log_len) refuses, and a record longer than the log.
/// Whether the log has room (`next - tail <= log_len`) is the caller's question.
pub fn place(pos: u64, nblocks: u32, log_len: u64) -> Result<Placement, FormatError> {
    check_log_len(log_len)?;
    if pos % RECORD_ALIGN != 0 {
        return Err(FormatError::MisalignedPosition(pos));
    }
    let len = record_len(nblocks);
    if len > log_len {
        return Err(FormatError::RecordTooLarge { len, log_len });
    }
    let off = pos % log_len;
    let (wrap_at, start) = if off + len <= log_len {
        (None, pos)
    } else {
        // `off` is a multiple of 64 below `log_len`, so the WRAP header always fits.
        let lap = (pos - off)
            .checked_add(log_len)
            .ok_or(FormatError::PositionOverflow)?;
        (Some(pos), lap)
    };
    let next = start
        .checked_add(len)
        .ok_or(FormatError::PositionOverflow)?;
    Ok(Placement {
        wrap_at,
        start,
        next,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::MIN_LOG_LEN;

    fn data_header() -> RecordHeader {
        RecordHeader {
            flags: 0,
            seq: 0x0102_0304_0506_0708,
            lba: 77,
            nblocks: 3,
            data_crc: 0xdead_beef,
        }
    }

    /// Rewrites the header crc so a test can reach the checks behind it.
    fn recrc(b: &mut [u8; HEADER_LEN]) {
        let crc = crc32fast::hash(&b[..AT_HEADER_CRC]);
        b[AT_HEADER_CRC..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn headers_round_trip() {
        for h in [
            data_header(),
            RecordHeader::wrap(5),
            RecordHeader::flush_mark(u64::MAX),
            RecordHeader::data(9, 100, &[7u8; 8192]).unwrap(),
        ] {
            assert_eq!(decode_header(&encode_header(&h)), Ok(h));
        }
        let h = RecordHeader::data(9, 100, &[7u8; 8192]).unwrap();
        assert_eq!(h.nblocks, 2);
        assert_eq!(h.data_len(), 8192);
        assert_eq!(h.data_crc, crc32fast::hash(&[7u8; 8192]));
        assert!(RecordHeader::wrap(1).is_wrap() && !RecordHeader::wrap(1).is_flush_mark());
        assert!(RecordHeader::flush_mark(1).is_flush_mark());
        assert_eq!(RecordHeader::wrap(1).data_crc, 0, "crc32 of nothing");
    }

    #[test]
    fn layout_matches_the_docs() {
        let b = encode_header(&data_header());
        assert_eq!(&b[..4], &[0x4c, 0x52, 0x43, 0x56]);
        assert_eq!(le_u32(&b, 4), 0);
        assert_eq!(le_u64(&b, 8), 0x0102_0304_0506_0708);
        assert_eq!(le_u64(&b, 16), 77);
        assert_eq!(le_u32(&b, 24), 3);
        assert_eq!(le_u32(&b, 28), 0xdead_beef);
        assert!(b[32..60].iter().all(|&x| x == 0));
        assert_eq!(le_u32(&b, 60), crc32fast::hash(&b[..60]));
        assert_eq!(le_u32(&encode_header(&RecordHeader::wrap(1)), 4), 1);
        assert_eq!(le_u32(&encode_header(&RecordHeader::flush_mark(1)), 4), 2);
    }

    #[test]
    fn refuses_bad_headers() {
        let good = encode_header(&data_header());
        assert_eq!(
            decode_header(&good[..63]),
            Err(FormatError::Short {
                what: "record header",
                len: 63,
                need: 64
            })
        );
        assert_eq!(
            decode_header(&[0u8; 64]),
            Err(FormatError::BadRecordMagic { found: 0 })
        );
        let mut b = good;
        b[3] ^= 0x80;
        assert!(matches!(
            decode_header(&b),
            Err(FormatError::BadRecordMagic { .. })
        ));
        // Any flipped bit after the magic breaks the header crc, data crc included.
        for at in 4..HEADER_LEN {
            let mut b = good;
            b[at] ^= 0x10;
            assert!(
                matches!(decode_header(&b), Err(FormatError::HeaderCrc { .. })),
                "flip at {at}"
            );
        }
    }

    fn with(h: RecordHeader, edit: impl FnOnce(&mut [u8; HEADER_LEN])) -> [u8; HEADER_LEN] {
        let mut b = encode_header(&h);
        edit(&mut b);
        recrc(&mut b);
        b
    }

    #[test]
    fn refuses_bad_flags_and_fields() {
        let b = with(data_header(), |b| put(b, AT_FLAGS, &16u32.to_le_bytes()));
        assert_eq!(decode_header(&b), Err(FormatError::BadRecordFlags(16)));
        let b = with(data_header(), |b| put(b, AT_FLAGS, &12u32.to_le_bytes()));
        assert_eq!(decode_header(&b), Err(FormatError::BadRecordFlags(12)));
        // A ZERO record names a range and carries no data; it needs blocks.
        let z = RecordHeader::range(5, 10, 7, false).unwrap();
        assert_eq!(decode_header(&encode_header(&z)), Ok(z));
        assert!(z.is_range() && !z.is_discard() && !z.has_data());
        assert_eq!((z.data_len(), z.stored_len()), (0, HEADER_LEN as u64));
        let d = RecordHeader::range(5, 10, 7, true).unwrap();
        assert!(d.is_discard() && d.is_range());
        assert_eq!(
            RecordHeader::range(1, 0, 0, false),
            Err(FormatError::EmptyRecord)
        );
        assert!(RecordHeader::range(1, u64::MAX, 2, true).is_err());
        let b = with(z, |b| put(b, AT_NBLOCKS, &0u32.to_le_bytes()));
        assert_eq!(decode_header(&b), Err(FormatError::EmptyRecord));
        let b = with(data_header(), |b| put(b, AT_FLAGS, &3u32.to_le_bytes()));
        assert_eq!(decode_header(&b), Err(FormatError::BadRecordFlags(3)));
        let e = decode_header(&encode_header(&RecordHeader {
            flags: FLAG_WRAP,
            ..data_header()
        }))
        .unwrap_err();
        assert_eq!(
            e,
            FormatError::MarkerWithData {
                kind: "WRAP",
                nblocks: 3
            }
        );
        assert!(e.to_string().contains("WRAP record claims 3"), "{e}");
        assert_eq!(
            decode_header(&encode_header(&RecordHeader {
                flags: FLAG_FLUSH,
                ..data_header()
            })),
            Err(FormatError::MarkerWithData {
                kind: "FLUSH mark",
                nblocks: 3
            })
        );
        assert_eq!(
            decode_header(&encode_header(&RecordHeader {
                nblocks: 0,
                ..data_header()
            })),
            Err(FormatError::EmptyRecord)
        );
        let b = with(data_header(), |b| b[45] = 1);
        assert_eq!(decode_header(&b), Err(FormatError::ReservedNotZero));
        assert_eq!(
            decode_header(&encode_header(&RecordHeader {
                lba: u64::MAX - 1,
                ..data_header()
            })),
            Err(FormatError::RangeOverflow {
                lba: u64::MAX - 1,
                nblocks: 3
            })
        );
    }

    #[test]
    fn data_headers_need_whole_blocks() {
        for len in [0, 1, 4095, 4097] {
            assert_eq!(
                RecordHeader::data(1, 0, &vec![0; len]),
                Err(FormatError::BadDataLength { len })
            );
        }
        assert!(matches!(
            RecordHeader::data(1, u64::MAX, &[0; 4096]),
            Err(FormatError::RangeOverflow { .. })
        ));
    }

    #[test]
    fn record_lengths() {
        assert_eq!(record_len(0), 64);
        assert_eq!(record_len(1), 64 + 4096);
        assert_eq!(record_len(16), 64 + 16 * 4096);
        assert_eq!(record_len(u32::MAX), 64 + u64::from(u32::MAX) * 4096);
    }

    const LOG: u64 = MIN_LOG_LEN; // 16 blocks

    #[test]
    fn place_inside_the_log() {
        assert_eq!(
            place(0, 1, LOG),
            Ok(Placement {
                wrap_at: None,
                start: 0,
                next: 4160
            })
        );
        assert_eq!(
            place(2 * LOG + 4160, 0, LOG),
            Ok(Placement {
                wrap_at: None,
                start: 2 * LOG + 4160,
                next: 2 * LOG + 4224
            })
        );
    }

    #[test]
    fn place_at_the_wrap_point() {
        // Exactly fits up to the end of the region: no WRAP, next is the lap boundary.
        let pos = 3 * LOG + LOG - record_len(2);
        assert_eq!(
            place(pos, 2, LOG),
            Ok(Placement {
                wrap_at: None,
                start: pos,
                next: 4 * LOG
            })
        );
        // 64 bytes later it straddles: WRAP at pos, record at the next lap.
        assert_eq!(
            place(pos + 64, 2, LOG),
            Ok(Placement {
                wrap_at: Some(pos + 64),
                start: 4 * LOG,
                next: 4 * LOG + record_len(2)
            })
        );
        // The last 64 bytes of the region hold a FLUSH mark, or a WRAP.
        assert_eq!(place(LOG - 64, 0, LOG).map(|p| p.wrap_at), Ok(None));
        assert_eq!(
            place(LOG - 64, 1, LOG),
            Ok(Placement {
                wrap_at: Some(LOG - 64),
                start: LOG,
                next: LOG + 4160
            })
        );
        // At a lap boundary nothing wraps.
        assert_eq!(place(LOG, 3, LOG).map(|p| p.wrap_at), Ok(None));
    }

    #[test]
    fn place_the_largest_records() {
        // 17 blocks of log: the largest record (16 blocks) is 4032 bytes short of it, so it
        // fits only from the first 4032 bytes of a lap.
        let log = 4096 * 17;
        assert_eq!(record_len(16), log - 4032);
        assert_eq!(place(log, 16, log).map(|p| p.wrap_at), Ok(None));
        assert_eq!(
            place(log + 4032, 16, log),
            Ok(Placement {
                wrap_at: None,
                start: log + 4032,
                next: 2 * log
            })
        );
        assert_eq!(
            place(log + 4096, 16, log),
            Ok(Placement {
                wrap_at: Some(log + 4096),
                start: 2 * log,
                next: 2 * log + record_len(16)
            })
        );
        assert_eq!(
            place(0, 16, LOG),
            Err(FormatError::RecordTooLarge {
                len: record_len(16),
                log_len: LOG
            })
        );
        assert!(matches!(
            place(0, u32::MAX, LOG),
            Err(FormatError::RecordTooLarge { .. })
        ));
    }

    #[test]
    fn place_refuses_bad_arguments() {
        assert_eq!(place(32, 1, LOG), Err(FormatError::MisalignedPosition(32)));
        assert!(matches!(
            place(0, 1, LOG + 64),
            Err(FormatError::BadGeometry(_))
        ));
        assert!(matches!(place(0, 1, 0), Err(FormatError::BadGeometry(_))));
        // The last 64 bytes of the last lap: the next lap does not exist.
        assert_eq!(
            place(u64::MAX - 63, 1, LOG),
            Err(FormatError::PositionOverflow)
        );
    }
}
