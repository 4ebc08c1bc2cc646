//! The properties the cache fuzz targets check, one function per target, so each target
//! is a one-line wrapper and a crash input replays from a plain test too.
//!
//! This file is also compiled into `vsan-cache/tests/log_corpus.rs` (with `#[path]`),
//! which replays the committed corpora as an ordinary test; so it uses only what that
//! test can see too (`vsan_cache`, `vsan_core`, `bytes`, `crc32fast`, `tokio`).
//!
//! * [`check_record`] (`cache_record`): one log record, its header decoded as given and
//!   as made sound, and scanned where it lies in a log.
//! * [`check_superblock`] (`cache_superblock`): two superblock copies, decoded and picked.
//! * [`check_recover`] (`cache_recover`): a crashed cache device (a log built from the
//!   input's records or by real writes, then damaged as the input says) opened with
//!   `WriteBackCache::open`, read, reopened, closed and opened clean.
//!
//! The input formats are in `fuzz/README.md`; [`RecordInput`] and [`RecoverInput`] build
//! inputs (for seeding the corpora).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use vsan_cache::format::{
    self, CACHE_BLOCK, FLAG_DISCARD, FLAG_FLUSH, FLAG_WRAP, FLAG_ZERO, FormatError, HEADER_LEN,
    LOG_START, RECORD_MAGIC, RecordHeader, SUPERBLOCK_LEN, ScanEnd, StopReason, Superblock,
};
use vsan_cache::{CacheConfig, CacheMode, FastDevice, WriteBackCache};
use vsan_core::{BlockDevice, Error, ErrorKind, Geometry, IoFlags, MemDevice};

/// Reads fields from a fuzz input, front to back; past its end every byte reads as 0, so
/// any input is a complete one.
#[derive(Debug)]
pub struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader at the start of `data`.
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data, at: 0 }
    }

    /// The next `N` bytes (zeros past the end).
    pub fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let rest = self.rest();
        let n = rest.len().min(N);
        out[..n].copy_from_slice(&rest[..n]);
        self.at = self.at.saturating_add(N);
        out
    }

    /// The next byte.
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }

    /// The next little-endian `u16`.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }

    /// The next little-endian `u32`.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }

    /// The next little-endian `u64`.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }

    /// Everything not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.data.get(self.at..).unwrap_or(&[])
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Puts the crc32 of `b[..len - 4]` into the last four bytes of `b[..len]`.
fn seal_crc(b: &mut [u8], len: usize) {
    let crc = crc32fast::hash(&b[..len - 4]);
    b[len - 4..len].copy_from_slice(&crc.to_le_bytes());
}

const BS: u64 = CACHE_BLOCK as u64;

// ---------------------------------------------------------------------------------------
// cache_record

/// The log `cache_record` scans: the smallest one (16 blocks).
const RECORD_LOG: u64 = format::MIN_LOG_LEN;

/// Whether the first 64 bytes of `b` are a record header by the format's rules (module
/// docs of `vsan_cache::format`), checked here independently of the decoder.
fn header_rules(b: &[u8]) -> Result<(), &'static str> {
    if b.len() < HEADER_LEN {
        return Err("short");
    }
    if le32(b, 0) != RECORD_MAGIC {
        return Err("magic");
    }
    if le32(b, 60) != crc32fast::hash(&b[..60]) {
        return Err("header crc");
    }
    let flags = le32(b, 4);
    if flags & !0b1111 != 0 || flags.count_ones() > 1 {
        return Err("flags");
    }
    if b[32..60].iter().any(|&x| x != 0) {
        return Err("reserved");
    }
    let nblocks = le32(b, 24);
    let marker = flags & (FLAG_WRAP | FLAG_FLUSH) != 0;
    if marker && nblocks != 0 {
        return Err("a marker with blocks");
    }
    if !marker && nblocks == 0 {
        return Err("no blocks");
    }
    if le64(b, 16).checked_add(u64::from(nblocks)).is_none() {
        return Err("range overflows");
    }
    Ok(())
}

/// `b` decodes as a record header exactly when it follows the rules; a decoded header
/// holds the bytes' fields, says what kind of record it is and how long, and encodes to
/// exactly those 64 bytes.
fn header_block(b: &[u8]) -> Option<RecordHeader> {
    let h = match (format::decode_header(b), header_rules(b)) {
        (Ok(h), Ok(())) => h,
        (Err(_), Err(_)) => return None,
        (got, rules) => panic!("decode_header gave {got:?}, the rules say {rules:?}"),
    };
    let want = RecordHeader {
        flags: le32(b, 4),
        seq: le64(b, 8),
        lba: le64(b, 16),
        nblocks: le32(b, 24),
        data_crc: le32(b, 28),
    };
    assert_eq!(h, want, "decoded fields differ from the bytes'");
    assert_eq!(
        format::encode_header(&h)[..],
        b[..HEADER_LEN],
        "no round trip"
    );
    assert_eq!(h.is_wrap(), h.flags == FLAG_WRAP);
    assert_eq!(h.is_flush_mark(), h.flags == FLAG_FLUSH);
    assert_eq!(h.is_discard(), h.flags == FLAG_DISCARD);
    assert_eq!(
        h.is_range(),
        h.flags == FLAG_ZERO || h.flags == FLAG_DISCARD
    );
    assert_eq!(h.has_data(), h.flags == 0);
    let data = if h.flags == 0 {
        u64::from(h.nblocks) * BS
    } else {
        0
    };
    assert_eq!(h.data_len(), data);
    assert_eq!(h.stored_len(), HEADER_LEN as u64 + data);
    Some(h)
}

/// A `cache_record` input, field by field (see [`check_record`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordInput {
    /// The record header as stored (64 bytes).
    pub header: [u8; HEADER_LEN],
    /// Bit 0: make the magic and header crc right; bit 1: zero the reserved bytes; bit 2:
    /// make the data crc that of the data the record lies in front of; bit 3: scan
    /// expecting the seq after the header's.
    pub choices: u8,
    /// Where in the log the record lies: `slot * 64 % log_len`.
    pub slot: u16,
    /// Which lap: under 0xf0 the lap number, else one of the last positions there are.
    pub lap: u8,
    /// The log bytes after the header (cut at the end of the log).
    pub data: Vec<u8>,
}

impl RecordInput {
    fn read(input: &[u8]) -> RecordInput {
        let mut r = Reader::new(input);
        RecordInput {
            header: r.array(),
            choices: r.u8(),
            slot: r.u16(),
            lap: r.u8(),
            data: r.rest().to_vec(),
        }
    }

    /// The input bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.header.to_vec();
        out.push(self.choices);
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.push(self.lap);
        out.extend_from_slice(&self.data);
        out
    }
}

/// What one `cache_record` run saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordOutcome {
    /// The header as given decoded.
    pub raw: bool,
    /// The header as made sound decoded.
    pub prepared: bool,
    /// Records the scan accepted.
    pub scanned: usize,
}

/// Where the record goes (`cache_record`): a position of lap `lap` at `slot`, or near the
/// end of the positions.
fn record_tail(slot: u16, lap: u8) -> u64 {
    let off = u64::from(slot) * 64 % RECORD_LOG;
    if lap < 0xf0 {
        u64::from(lap) * RECORD_LOG + off
    } else {
        (u64::MAX - u64::from(0xff - lap) * 4096 - off) & !63
    }
}

/// Checks a [`format::scan`] result against the log it walked: positions ascending
/// within one lap of the tail, seqs consecutive, the head after the last record.
fn check_scan(
    log_len: u64,
    tail: u64,
    tail_seq: u64,
    seen: &[(u64, RecordHeader, Vec<u8>)],
    end: &ScanEnd,
) {
    let limit = tail.saturating_add(log_len);
    let (mut pos, mut seq) = (tail, tail_seq);
    for (at, h, data) in seen {
        assert_eq!((*at, h.seq), (pos, seq), "records out of order");
        assert_eq!(data.len() as u64, h.data_len());
        assert_eq!(crc32fast::hash(data), h.data_crc);
        let off = at % log_len;
        let next = if h.is_wrap() {
            (at - off).checked_add(log_len)
        } else {
            assert!(
                off + h.stored_len() <= log_len,
                "a record straddles the end"
            );
            at.checked_add(h.stored_len())
        };
        let next = next.expect("an accepted record ends past the last position");
        assert!(next <= limit, "a record past one lap");
        assert!(next > pos);
        pos = next;
        seq = seq.wrapping_add(1);
    }
    assert!(seen.len() as u64 <= log_len / 64 + 1);
    assert_eq!((end.head, end.next_seq), (pos, seq));
    assert!(!matches!(end.stopped, StopReason::BadLog(_)), "{end:?}");
}

/// `cache_record`: the input is a [`RecordInput`]. Its header as given and as the choices
/// make it decode exactly when the format's rules hold, and a decoded header encodes to
/// its own bytes. Then the prepared record is put in a log at the chosen position (its
/// data after it) and scanned from there: the scan accepts it exactly when its seq is
/// the one expected, it does not straddle the log's end, it fits in one lap of positions
/// and its data matches its crc, and otherwise stops at it for that reason; whatever
/// follows, the records it accepts are in order and the head follows the last.
pub fn check_record(input: &[u8]) -> RecordOutcome {
    let raw = header_block(input).is_some();
    let rec = RecordInput::read(input);
    let mut b = rec.header;
    if rec.choices & 2 != 0 {
        b[32..60].fill(0);
    }
    let tail = record_tail(rec.slot, rec.lap);
    let off = (tail % RECORD_LOG) as usize;
    let mut log = vec![0u8; RECORD_LOG as usize];
    let data_at = off + HEADER_LEN;
    let n = rec.data.len().min(log.len() - data_at);
    log[data_at..data_at + n].copy_from_slice(&rec.data[..n]);
    if rec.choices & 4 != 0 {
        let nblocks = u64::from(le32(&b, 24));
        let len = (nblocks * BS).min((log.len() - data_at) as u64) as usize;
        let crc = crc32fast::hash(&log[data_at..data_at + len]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
    }
    if rec.choices & 1 != 0 {
        b[..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        seal_crc(&mut b, HEADER_LEN);
    }
    let prepared = header_block(&b);
    log[off..off + HEADER_LEN].copy_from_slice(&b);

    let seq = le64(&b, 8);
    let tail_seq = if rec.choices & 8 != 0 {
        seq.wrapping_add(1)
    } else {
        seq
    };
    let mut seen = Vec::new();
    let end = format::scan(&log, RECORD_LOG, tail, tail_seq, |pos, h, data| {
        seen.push((pos, *h, data.to_vec()));
    });
    check_scan(RECORD_LOG, tail, tail_seq, &seen, &end);
    // What must happen at the first record, by the rules in `scan`'s docs.
    let limit = tail.saturating_add(RECORD_LOG);
    let first = if tail.saturating_add(HEADER_LEN as u64) > limit {
        Err(StopReason::FullCircle)
    } else {
        match (&prepared, format::decode_header(&b)) {
            (None, Err(e)) => Err(StopReason::BadHeader(e)),
            (Some(h), Ok(_)) if h.seq != tail_seq => Err(StopReason::StaleSeq {
                expected: tail_seq,
                found: h.seq,
            }),
            (Some(h), Ok(_)) if !h.is_wrap() && off as u64 + h.stored_len() > RECORD_LOG => {
                Err(StopReason::Straddles {
                    len: h.stored_len(),
                })
            }
            (Some(h), Ok(_)) => {
                let next = if h.is_wrap() {
                    (tail - off as u64).checked_add(RECORD_LOG)
                } else {
                    tail.checked_add(h.stored_len())
                };
                let data = &log[data_at..data_at + h.data_len() as usize];
                let computed = crc32fast::hash(data);
                if next.is_none_or(|n| n > limit) {
                    Err(StopReason::FullCircle)
                } else if computed != h.data_crc {
                    Err(StopReason::DataCrc {
                        stored: h.data_crc,
                        computed,
                    })
                } else {
                    Ok((tail, *h, data.to_vec()))
                }
            }
            (p, d) => panic!("header_block said {p:?}, decode_header {d:?}"),
        }
    };
    match first {
        Ok(want) => assert_eq!(seen.first(), Some(&want), "the record was not accepted"),
        Err(why) => {
            assert!(seen.is_empty(), "a record accepted that must not be");
            assert_eq!(end.stopped, why);
        }
    }
    RecordOutcome {
        raw,
        prepared: prepared.is_some(),
        scanned: seen.len(),
    }
}

// ---------------------------------------------------------------------------------------
// cache_superblock

/// Whether `b` is a cache superblock by the format's rules (module docs of
/// `vsan_cache::format` and `Superblock::check`), checked here independently of the
/// decoder.
fn superblock_rules(b: &[u8]) -> Result<(), &'static str> {
    if b.len() < SUPERBLOCK_LEN {
        return Err("short");
    }
    if b[..8] != format::SUPERBLOCK_MAGIC {
        return Err("magic");
    }
    if le32(b, SUPERBLOCK_LEN - 4) != crc32fast::hash(&b[..SUPERBLOCK_LEN - 4]) {
        return Err("crc");
    }
    if le32(b, 8) != format::FORMAT_VERSION {
        return Err("version");
    }
    let flags = le32(b, 12);
    if flags & !0b11 != 0 {
        return Err("flags");
    }
    if le32(b, 96) > 3 {
        return Err("mode");
    }
    let (backing_size, bbs, cbs) = (le64(b, 40), le32(b, 48), le32(b, 52));
    let (log_len, tail, tail_seq, head, next_seq) = (
        le64(b, 56),
        le64(b, 64),
        le64(b, 72),
        le64(b, 80),
        le64(b, 88),
    );
    if cbs != CACHE_BLOCK {
        return Err("cache block size");
    }
    if !bbs.is_power_of_two() || !(512..=CACHE_BLOCK).contains(&bbs) {
        return Err("backing block size");
    }
    if backing_size == 0 || backing_size % u64::from(bbs) != 0 {
        return Err("backing size");
    }
    if log_len % 4096 != 0 || log_len < 64 * 1024 {
        return Err("log length");
    }
    if tail % 64 != 0 {
        return Err("tail");
    }
    if [le64(b, 16), tail_seq, tail]
        .iter()
        .any(|&v| v > u64::MAX / 2)
    {
        return Err("implausible seq or tail");
    }
    if flags & 1 != 0 {
        if head % 64 != 0 || head < tail || head - tail > log_len {
            return Err("head");
        }
        let records = next_seq.wrapping_sub(tail_seq);
        if records > (head - tail) / 64 || (records == 0) != (head == tail) {
            return Err("seqs");
        }
    }
    Ok(())
}

/// `b` decodes as a superblock exactly when it follows the rules; a decoded one holds
/// the block's fields and encodes to the block with its reserved bytes zeroed (and the
/// crc recomputed).
fn superblock_block(b: &[u8]) -> Option<Superblock> {
    let sb = match (Superblock::decode(b), superblock_rules(b)) {
        (Ok(sb), Ok(())) => sb,
        (Err(_), Err(_)) => return None,
        (got, rules) => panic!("decode gave {got:?}, the rules say {rules:?}"),
    };
    let flags = le32(b, 12);
    let want = Superblock {
        seq: le64(b, 16),
        cache_id: b[24..40].try_into().expect("16 bytes"),
        backing_size: le64(b, 40),
        backing_block_size: le32(b, 48),
        cache_block_size: le32(b, 52),
        log_len: le64(b, 56),
        tail: le64(b, 64),
        tail_seq: le64(b, 72),
        head: le64(b, 80),
        next_seq: le64(b, 88),
        clean_shutdown: flags & 1 != 0,
        failed: flags & 2 != 0,
        mode: CacheMode::from_u32(le32(b, 96)).expect("a mode"),
    };
    assert_eq!(sb, want, "decoded fields differ from the block's");
    assert_eq!(sb.check(), Ok(()));
    let mut canonical = b[..SUPERBLOCK_LEN].to_vec();
    canonical[100..SUPERBLOCK_LEN - 4].fill(0);
    seal_crc(&mut canonical, SUPERBLOCK_LEN);
    let encoded = sb.encode();
    assert!(encoded[..] == canonical[..], "re-encoding differs");
    assert_eq!(Superblock::decode(&encoded).as_ref(), Ok(&sb));
    Some(sb)
}

/// `pick` chooses the valid copy (decodes, in the slot its seq chooses) with the higher
/// seq, or refuses when neither is valid.
fn check_pick(copy0: &[u8], copy1: &[u8]) -> Option<Superblock> {
    let valid = |slot: u64, b: &[u8]| superblock_block(b).filter(|sb| sb.seq % 2 == slot);
    let want = match (valid(0, copy0), valid(1, copy1)) {
        (Some(a), Some(b)) => Some(if a.seq > b.seq { a } else { b }),
        (a, b) => a.or(b),
    };
    let got = format::pick(copy0, copy1);
    match (&got, &want) {
        (Ok(g), Some(w)) => assert_eq!(g, w),
        (Err(FormatError::NoValidSuperblock { .. }), None) => {}
        _ => panic!("pick gave {got:?}, the rules say {want:?}"),
    }
    want
}

/// `cache_superblock`: bytes 0..4096 of the input are superblock copy 0, bytes
/// 4096..8192 copy 1 (zero padded). Each decodes exactly when the format's rules hold
/// and round-trips, and `pick` takes the newer valid one in its slot. Then again with
/// both copies made sound (magic and crc), and again with the version, flags, mode,
/// block sizes and log length made valid too, so the geometry rules are reached.
/// Returns which of the three picks found a superblock.
pub fn check_superblock(input: &[u8]) -> [bool; 3] {
    let mut copies = [[0u8; SUPERBLOCK_LEN]; 2];
    for (i, c) in copies.iter_mut().enumerate() {
        let part = input.get(i * SUPERBLOCK_LEN..).unwrap_or(&[]);
        let n = part.len().min(SUPERBLOCK_LEN);
        c[..n].copy_from_slice(&part[..n]);
        assert!(superblock_block(&part[..n]).is_none() || n == SUPERBLOCK_LEN);
    }
    let raw = check_pick(&copies[0], &copies[1]).is_some();
    for c in &mut copies {
        c[..8].copy_from_slice(&format::SUPERBLOCK_MAGIC);
        seal_crc(c, SUPERBLOCK_LEN);
    }
    let sealed = check_pick(&copies[0], &copies[1]).is_some();
    for c in &mut copies {
        c[8..12].copy_from_slice(&format::FORMAT_VERSION.to_le_bytes());
        c[12] &= 0b11;
        c[13..16].fill(0);
        let bbs = 512u32 << (c[48] % 4);
        c[48..52].copy_from_slice(&bbs.to_le_bytes());
        c[52..56].copy_from_slice(&CACHE_BLOCK.to_le_bytes());
        let log_len = (le64(c, 56) % (1 << 40)).max(64 * 1024) / 4096 * 4096;
        c[56..64].copy_from_slice(&log_len.to_le_bytes());
        c[64] &= !63;
        c[80] &= !63;
        let mode = u32::from(c[96] % 4);
        c[96..100].copy_from_slice(&mode.to_le_bytes());
        seal_crc(c, SUPERBLOCK_LEN);
    }
    [raw, sealed, check_pick(&copies[0], &copies[1]).is_some()]
}

// ---------------------------------------------------------------------------------------
// cache_recover

/// A `cache_recover` input, field by field (see [`check_recover`] and the README).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoverInput {
    /// Bit 0: a real log (format, then writes through the cache) instead of a superblock
    /// and records built from the fields below; bits 1-2: the fast device's block size
    /// `512 << n`; bit 3: 4096-byte backing blocks (else 512); bit 4: a 128 KiB log (else
    /// 64 KiB); bit 5: the fast device is 4 KiB longer than superblocks and log.
    pub setup: u8,
    /// Backing store blocks: `8 + n % 57`.
    pub blocks: u8,
    /// Built superblock: its seq.
    pub seq: u64,
    /// Built superblock: its tail (`% (8 * log_len)` unless `sb_flags` bit 5), aligned.
    pub tail: u64,
    /// Built superblock: the seq at the tail.
    pub tail_seq: u64,
    /// Built superblock: its head (unless `sb_flags` bit 4).
    pub head: u64,
    /// Built superblock: its next seq (unless `sb_flags` bit 4).
    pub next_seq: u64,
    /// Built superblock: bit 0 clean shutdown, bit 1 failed, bits 2-3 mode, bit 4 head and
    /// next seq where the built records end, bit 5 the tail as given, bit 6 formatted for
    /// a backing store one block longer.
    pub sb_flags: u8,
    /// Built records, or the real writes: `(kind, lba, blocks)`. Built records: `kind % 5`
    /// is data (0, 4), ZERO (1), DISCARD (2) or a FLUSH mark (3), bit 6 puts the range
    /// far past the backing store, and `blocks % 4 + 1` blocks. Writes: `kind % 6` is a
    /// write (0), a FUA write (1), write-zeroes (2), a discard (3), a flush (4) or a
    /// destage (5), of `blocks % 8 + 1` blocks.
    pub ops: Vec<(u8, u16, u8)>,
    /// Then bytes of the fast device changed: `(at, value)`; `at` with bit 31 zeroes the
    /// 512-byte sector there instead.
    pub edits: Vec<(u32, u8)>,
    /// Where `raw` goes in the log: `slot * 64 % log_len`.
    pub raw_slot: u16,
    /// Bytes written over the log at `raw_slot` (cut at its end).
    pub raw: Vec<u8>,
}

impl RecoverInput {
    fn read(input: &[u8]) -> RecoverInput {
        let mut r = Reader::new(input);
        let mut x = RecoverInput {
            setup: r.u8(),
            blocks: r.u8(),
            seq: r.u64(),
            tail: r.u64(),
            tail_seq: r.u64(),
            head: r.u64(),
            next_seq: r.u64(),
            sb_flags: r.u8(),
            ops: Vec::new(),
            edits: Vec::new(),
            raw_slot: 0,
            raw: Vec::new(),
        };
        for _ in 0..r.u8() % 33 {
            x.ops.push((r.u8(), r.u16(), r.u8()));
        }
        for _ in 0..r.u8() % 17 {
            x.edits.push((r.u32(), r.u8()));
        }
        x.raw_slot = r.u16();
        x.raw = r.rest().to_vec();
        x
    }

    /// The input bytes (at most 32 ops and 16 edits are kept).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![self.setup, self.blocks];
        for v in [self.seq, self.tail, self.tail_seq, self.head, self.next_seq] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.push(self.sb_flags);
        let ops = &self.ops[..self.ops.len().min(32)];
        out.push(ops.len() as u8);
        for &(kind, lba, n) in ops {
            out.push(kind);
            out.extend_from_slice(&lba.to_le_bytes());
            out.push(n);
        }
        let edits = &self.edits[..self.edits.len().min(16)];
        out.push(edits.len() as u8);
        for &(at, v) in edits {
            out.extend_from_slice(&at.to_le_bytes());
            out.push(v);
        }
        out.extend_from_slice(&self.raw_slot.to_le_bytes());
        out.extend_from_slice(&self.raw);
        out
    }

    fn log_len(&self) -> u64 {
        if self.setup & 16 != 0 {
            128 << 10
        } else {
            64 << 10
        }
    }

    fn fast_len(&self) -> u64 {
        LOG_START + self.log_len() + if self.setup & 32 != 0 { 4096 } else { 0 }
    }

    fn backing_block(&self) -> u32 {
        if self.setup & 8 != 0 { 4096 } else { 512 }
    }

    fn backing_blocks(&self) -> u64 {
        8 + u64::from(self.blocks % 57)
    }
}

/// What one `cache_recover` run ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovered {
    /// The cache opened, replaying this many log records (0 after a clean shutdown).
    Opened {
        /// The superblock said clean: nothing was scanned.
        clean: bool,
        /// Records replayed (WRAP records and FLUSH marks included).
        records: u64,
    },
    /// Open refused the device, as the rules say it must, with this kind of error.
    Refused(ErrorKind),
}

/// Block `lba` of the backing store before anything is cached: its number, then a byte
/// pattern.
fn backing_block(lba: u64) -> Vec<u8> {
    let mut b = vec![(lba as u8) ^ 0x5a; BS as usize];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b
}

/// The data a record or write `id` puts in block `lba`.
fn data_block(id: u64, lba: u64, fill: u8) -> Vec<u8> {
    let mut b = vec![fill; BS as usize];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&id.to_le_bytes());
    b
}

/// Builds the records `x.ops` name into `log`, from `tail` and `tail_seq`, as the cache
/// appends them (`place`, WRAP records, one seq each) until the log is full; returns
/// where they end and the next seq.
fn build_log(
    x: &RecoverInput,
    log: &mut [u8],
    tail: u64,
    tail_seq: u64,
    blocks: u64,
) -> (u64, u64) {
    let log_len = log.len() as u64;
    let (mut pos, mut seq) = (tail, tail_seq);
    for &(kind, lba, n) in &x.ops {
        // Now and then a range that runs past the backing store, or far past it.
        let lba = if kind & 0x40 != 0 {
            (u64::from(lba) << 48) | u64::from(lba)
        } else {
            u64::from(lba) % (blocks + 2)
        };
        let nblocks = u32::from(n % 4 + 1);
        let data_blocks = if kind % 5 == 0 || kind % 5 == 4 {
            nblocks
        } else {
            0
        };
        let Ok(p) = format::place(pos, data_blocks, log_len) else {
            break;
        };
        if p.next - tail > log_len {
            break;
        }
        let mut put = |at: u64, h: &RecordHeader, data: &[u8]| {
            let off = (at % log_len) as usize;
            log[off..off + HEADER_LEN].copy_from_slice(&format::encode_header(h));
            log[off + HEADER_LEN..off + HEADER_LEN + data.len()].copy_from_slice(data);
        };
        if let Some(w) = p.wrap_at {
            put(w, &RecordHeader::wrap(seq), &[]);
            seq = seq.wrapping_add(1);
        }
        let (h, data) = match kind % 5 {
            1 => (RecordHeader::range(seq, lba, nblocks, false), Vec::new()),
            2 => (RecordHeader::range(seq, lba, nblocks, true), Vec::new()),
            3 => (Ok(RecordHeader::flush_mark(seq)), Vec::new()),
            _ => {
                let data: Vec<u8> = (0..u64::from(nblocks))
                    .flat_map(|i| data_block(seq, lba + i, kind))
                    .collect();
                (RecordHeader::data(seq, lba, &data), data)
            }
        };
        put(p.start, &h.expect("a record header"), &data);
        seq = seq.wrapping_add(1);
        pos = p.next;
    }
    (pos, seq)
}

/// The superblock and log `x` describes (synthetic mode), as the fast device's bytes.
fn build_device(x: &RecoverInput) -> Vec<u8> {
    let log_len = x.log_len();
    let mut img = vec![0u8; x.fast_len() as usize];
    let tail = if x.sb_flags & 32 != 0 {
        x.tail & !63
    } else {
        (x.tail % (8 * log_len)) & !63
    };
    let blocks = x.backing_blocks();
    let log = &mut img[LOG_START as usize..(LOG_START + log_len) as usize];
    let (end, end_seq) = build_log(x, log, tail, x.tail_seq, blocks);
    let (head, next_seq) = if x.sb_flags & 16 != 0 {
        (end, end_seq)
    } else {
        (x.head, x.next_seq)
    };
    let extra = if x.sb_flags & 64 != 0 { 1 } else { 0 };
    let sb = Superblock {
        seq: x.seq,
        cache_id: [7; 16],
        backing_size: (blocks + extra) * BS,
        backing_block_size: x.backing_block(),
        cache_block_size: CACHE_BLOCK,
        log_len,
        tail,
        tail_seq: x.tail_seq,
        head,
        next_seq,
        clean_shutdown: x.sb_flags & 1 != 0,
        failed: x.sb_flags & 2 != 0,
        mode: CacheMode::from_u32(u32::from((x.sb_flags >> 2) & 3)).expect("a mode"),
    };
    let at = format::superblock_offset(sb.seq) as usize;
    img[at..at + SUPERBLOCK_LEN].copy_from_slice(&sb.encode());
    img
}

/// The edits and raw log bytes of `x`, applied to the fast device's bytes.
fn damage(x: &RecoverInput, img: &mut [u8]) {
    let len = img.len();
    for &(at, v) in &x.edits {
        let spot = (at & !(1 << 31)) as usize % len;
        if at & (1 << 31) != 0 {
            let sector = spot / 512 * 512;
            img[sector..(sector + 512).min(len)].fill(0);
        } else {
            img[spot] = v;
        }
    }
    let log_len = x.log_len() as usize;
    let off = usize::from(x.raw_slot) * 64 % log_len;
    let n = x.raw.len().min(log_len - off);
    let at = LOG_START as usize + off;
    img[at..at + n].copy_from_slice(&x.raw[..n]);
}

/// What the cache must read after opening `img` over `backing` (the backing store's
/// blocks), by the rules in `WriteBackCache::open`'s docs: the newest valid superblock;
/// after a clean shutdown with an empty log, the backing store; otherwise the records a
/// scan from the tail accepts, replayed over it. Or the kind of error it must refuse
/// with. Also returns the records replayed and whether the log was clean.
fn expected_image(
    img: &[u8],
    backing: &[u8],
    backing_block: u32,
) -> Result<(Vec<u8>, u64, bool), ErrorKind> {
    let sb = format::pick(
        &img[..SUPERBLOCK_LEN],
        &img[SUPERBLOCK_LEN..2 * SUPERBLOCK_LEN],
    )
    .map_err(|_| ErrorKind::Corrupt)?;
    if sb.failed {
        return Err(ErrorKind::Corrupt);
    }
    if sb.backing_size != backing.len() as u64 || sb.backing_block_size != backing_block {
        return Err(ErrorKind::InvalidArgument);
    }
    if (img.len() as u64) < LOG_START + sb.log_len {
        return Err(ErrorKind::Corrupt);
    }
    let mut image = backing.to_vec();
    if sb.clean_shutdown && sb.head == sb.tail {
        return Ok((image, 0, true));
    }
    let log = &img[LOG_START as usize..(LOG_START + sb.log_len) as usize];
    let mut records = Vec::new();
    let end = format::scan(log, sb.log_len, sb.tail, sb.tail_seq, |pos, h, data| {
        records.push((pos, *h, data.to_vec()));
    });
    check_scan(sb.log_len, sb.tail, sb.tail_seq, &records, &end);
    let blocks = backing.len() as u64 / BS;
    for (_, h, data) in &records {
        if h.is_wrap() || h.is_flush_mark() {
            continue;
        }
        let end = h.lba.checked_add(u64::from(h.nblocks));
        if end.is_none_or(|e| e > blocks) {
            return Err(ErrorKind::Corrupt);
        }
        let at = (h.lba * BS) as usize;
        let len = u64::from(h.nblocks) as usize * BS as usize;
        if h.has_data() {
            image[at..at + len].copy_from_slice(data);
        } else {
            image[at..at + len].fill(0);
        }
    }
    Ok((image, records.len() as u64, false))
}

fn settings() -> CacheConfig {
    CacheConfig {
        background: false,
        sequential_cutoff: 0,
        epoch_bytes: 16 << 10,
        ..CacheConfig::default()
    }
}

fn mem(size: u64, block: u32) -> Arc<MemDevice> {
    Arc::new(MemDevice::new(
        Geometry::new(size, block).expect("a geometry"),
    ))
}

async fn open(fast: &Arc<MemDevice>, backing: &Arc<MemDevice>) -> Result<WriteBackCache, Error> {
    WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), settings()).await
}

async fn read_all(dev: &dyn BlockDevice) -> Vec<u8> {
    let size = dev.geometry().size() as usize;
    dev.read(0, size)
        .await
        .expect("read the whole disk")
        .to_vec()
}

/// Runs the workload `x.ops` names through a freshly formatted cache on `fast` over
/// `backing` (whose blocks `image` holds), updating `image` with every write as it is
/// acknowledged; then drops the cache without closing it, as a crash does.
async fn run_writes(
    x: &RecoverInput,
    fast: &Arc<MemDevice>,
    backing: &Arc<MemDevice>,
    image: &mut [u8],
) {
    WriteBackCache::format(
        &FastDevice::block(fast.clone()),
        backing.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .expect("format");
    let c = open(fast, backing).await.expect("open a formatted cache");
    let blocks = x.backing_blocks();
    for (id, &(kind, lba, n)) in x.ops.iter().enumerate() {
        let lba = u64::from(lba) % blocks;
        let n = (u64::from(n % 8) + 1).min(blocks - lba);
        let (at, len) = (lba * BS, n * BS);
        let range = at as usize..(at + len) as usize;
        match kind % 6 {
            0 | 1 => {
                let data: Vec<u8> = (0..n)
                    .flat_map(|i| data_block(id as u64, lba + i, kind))
                    .collect();
                let flags = if kind % 6 == 1 {
                    IoFlags::FUA
                } else {
                    IoFlags::empty()
                };
                c.write(at, Bytes::from(data.clone()), flags)
                    .await
                    .expect("write");
                image[range].copy_from_slice(&data);
            }
            2 => {
                c.write_zeroes(at, len, IoFlags::empty())
                    .await
                    .expect("write zeroes");
                image[range].fill(0);
            }
            3 => {
                c.discard(at, len, IoFlags::empty()).await.expect("discard");
                image[range].fill(0);
            }
            4 => c.flush().await.expect("flush"),
            _ => {
                c.destage().await.expect("destage");
            }
        }
    }
    drop(c);
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a tokio runtime");
}

/// `cache_recover`: the input is a [`RecoverInput`]. A fast device (a `MemDevice` behind
/// `FastDevice::block`) holds either a superblock and log records built from the input,
/// or the log a few real writes left when the cache was dropped without a close; then
/// the input's edits and raw bytes damage it. `WriteBackCache::open` over a backing
/// `MemDevice` must then return what the rules say (see [`expected_image`]), within 30
/// seconds and without a panic. Once open, the whole disk reads as expected (for an
/// undamaged real log: exactly the acknowledged writes); a write of one block lands; the
/// cache dropped and opened again reads the same; closed (destaging everything), the
/// backing store holds that image, and it opens clean with the same image.
pub fn check_recover(input: &[u8]) -> Recovered {
    let x = RecoverInput::read(input);
    RUNTIME.with(|rt| {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(30), recover(&x))
                .await
                .expect("recovery hung")
        })
    })
}

async fn recover(x: &RecoverInput) -> Recovered {
    let blocks = x.backing_blocks();
    let size = blocks * BS;
    let backing = mem(size, x.backing_block());
    let mut image: Vec<u8> = (0..blocks).flat_map(backing_block).collect();
    backing
        .write(0, Bytes::from(image.clone()), IoFlags::empty())
        .await
        .expect("fill the backing store");
    let fast = mem(x.fast_len(), 512 << ((x.setup >> 1) & 3));
    let real = x.setup & 1 != 0;
    let mut img = if real {
        run_writes(x, &fast, &backing, &mut image).await;
        fast.read(0, x.fast_len() as usize)
            .await
            .expect("read")
            .to_vec()
    } else {
        build_device(x)
    };
    let undamaged = img.clone();
    damage(x, &mut img);
    fast.write(0, Bytes::from(img.clone()), IoFlags::empty())
        .await
        .expect("write the fast device");
    let backing_now = read_all(backing.as_ref()).await;
    let expected = expected_image(&img, &backing_now, x.backing_block());
    if real && img == undamaged {
        // Nothing damaged: every acknowledged write is there.
        let (want, _, _) = expected.as_ref().expect("an undamaged log opens");
        assert!(*want == image, "the log lost acknowledged writes");
    }
    let c = open(&fast, &backing).await;
    let (c, (mut want, records, clean)) = match (c, expected) {
        (Ok(c), Ok(want)) => (c, want),
        (Err(e), Err(kind)) => {
            assert_eq!(e.kind(), kind, "refused for another reason: {e}");
            return Recovered::Refused(kind);
        }
        (got, want) => panic!(
            "open gave {:?}, the rules say {:?}",
            got.map(|c| c.recovery().clone()),
            want.map(|w| (w.1, w.2))
        ),
    };
    assert_eq!((c.recovery().clean, c.recovery().records), (clean, records));
    assert!(read_all(&c).await == want, "the recovered image differs");

    // One more write lands after the replayed records.
    let lba = u64::from(x.raw_slot) % blocks;
    let data = data_block(u64::MAX, lba, 0xee);
    c.write(lba * BS, Bytes::from(data.clone()), IoFlags::empty())
        .await
        .expect("a write after recovery");
    want[(lba * BS) as usize..((lba + 1) * BS) as usize].copy_from_slice(&data);
    assert!(
        read_all(&c).await == want,
        "the write after recovery did not land"
    );
    drop(c);

    let c = open(&fast, &backing)
        .await
        .expect("open again after a crash");
    assert!(
        read_all(&c).await == want,
        "a second open reads another image"
    );
    c.close().await.expect("close");
    assert!(
        read_all(backing.as_ref()).await == want,
        "close left another image behind"
    );
    let c = open(&fast, &backing).await.expect("open after a close");
    assert!(c.recovery().clean, "{:?}", c.recovery());
    assert!(
        read_all(&c).await == want,
        "an open after a close reads another image"
    );
    c.close().await.expect("close");
    Recovered::Opened { clean, records }
}
