//! The properties the metadata fuzz targets check on `vsan_replica::meta`, one function
//! per target.
//!
//! This file is also compiled into `vsan-replica/tests/meta_corpus.rs` (with `#[path]`),
//! which replays the committed corpora as an ordinary test; so it uses only what that
//! test can see too (`vsan_replica`, `vsan_core`, `crc32fast`), no fuzzing crate.
//!
//! * [`check_superblock`] (`meta_superblock`): one 4096-byte block.
//! * [`check_al`] (`meta_al`): a layout and one activity log record.
//! * [`check_open`] (`meta_open`): a whole metadata area, with valid superblock and
//!   activity log copies sealed into it (and torn over older ones) as the input says.
//!
//! The input formats are in `fuzz/README.md`; [`superblock_input`], [`al_input`] and
//! [`open_input`] build inputs (for seeding the corpora).

use std::future::Future;
use std::task::{Context, Poll, Waker};

use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};
use vsan_replica::meta::{
    self, AL_SLOTS, Bitmap, Layout, META_BLOCK, MetaParams, Superblock, decode_al, encode_al,
};
use vsan_replica::protocol::{DiskId, Generations};

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
        let rest = self.data.get(self.at..).unwrap_or(&[]);
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

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
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

/// Runs a future that must complete at once: every `MemDevice` operation does.
pub fn now<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a metadata operation on a MemDevice did not complete at once"),
    }
}

// ---------------------------------------------------------------------------------------
// meta_superblock

const SB_MAGIC: &[u8; 8] = b"VSANMETA";
/// Where the superblock's disk name starts; its length is the `u16` just before.
const SB_NAME: usize = 106;

/// Whether `b` is a superblock by the format's rules (module docs of `vsan_replica::meta`),
/// checked here field by field, independently of the decoder.
fn superblock_rules(b: &[u8]) -> Result<(), &'static str> {
    if b.len() < META_BLOCK {
        return Err("short");
    }
    if &b[..8] != SB_MAGIC {
        return Err("magic");
    }
    if le32(b, META_BLOCK - 4) != crc32fast::hash(&b[..META_BLOCK - 4]) {
        return Err("crc");
    }
    if le32(b, 8) != 1 {
        return Err("version");
    }
    if le32(b, 12) & !0b111 != 0 {
        return Err("flags");
    }
    let name_len = usize::from(le16(b, 104));
    if name_len > 255 {
        return Err("name length");
    }
    std::str::from_utf8(&b[SB_NAME..SB_NAME + name_len]).map_err(|_| "name not UTF-8")?;
    Ok(())
}

/// `b` decodes as a superblock exactly when it follows the rules; a decoded one holds
/// the block's fields, and encodes to the block itself with its reserved bytes zeroed
/// (and the crc recomputed), which decodes to the same value. Returns whether it decoded.
fn superblock_block(b: &[u8]) -> bool {
    let got = Superblock::decode(b);
    let rules = superblock_rules(b);
    let sb = match (got, rules) {
        (Ok(sb), Ok(())) => sb,
        (Err(_), Err(_)) => return false,
        (got, rules) => panic!("decode gave {got:?}, the rules say {rules:?}"),
    };
    let flags = le32(b, 12);
    let name_len = usize::from(le16(b, 104));
    let want = Superblock {
        seq: le64(b, 16),
        disk_id: DiskId(b[24..40].try_into().expect("16 bytes")),
        disk_name: String::from_utf8(b[SB_NAME..SB_NAME + name_len].to_vec()).expect("UTF-8"),
        node_id: le32(b, 40),
        peer_id: le32(b, 44),
        size: le64(b, 48),
        block_size: le32(b, 56),
        chunk_size: le64(b, 64),
        generations: Generations {
            current: le64(b, 72),
            bitmap: le64(b, 80),
            history: [le64(b, 88), le64(b, 96)],
        },
        inconsistent: flags & 1 != 0,
        crashed: flags & 2 != 0,
        clean_shutdown: flags & 4 != 0,
    };
    assert_eq!(sb, want, "decoded fields differ from the block's");
    let mut canonical = b[..META_BLOCK].to_vec();
    canonical[60..64].fill(0);
    canonical[SB_NAME + name_len..META_BLOCK - 4].fill(0);
    seal_crc(&mut canonical, META_BLOCK);
    let encoded = sb.encode();
    assert!(
        encoded[..] == canonical[..],
        "re-encoding differs from the block outside its reserved bytes"
    );
    assert_eq!(Superblock::decode(&encoded).ok(), Some(sb), "no round trip");
    true
}

/// `meta_superblock`: the input (any length) as a superblock block; then its first 4096
/// bytes (zero padded) with the magic and crc made right, so the field rules are reached;
/// then the same with the version, flag bits and name length made valid too, so the name
/// and the round trip are reached. Each decodes exactly when the format's rules hold (a
/// decoded superblock re-encodes to the same block, reserved bytes aside). Returns which
/// of the three decoded.
pub fn check_superblock(input: &[u8]) -> [bool; 3] {
    let raw = superblock_block(input);
    let mut b = input.to_vec();
    b.resize(META_BLOCK, 0);
    b[..8].copy_from_slice(SB_MAGIC);
    seal_crc(&mut b, META_BLOCK);
    let sealed = superblock_block(&b);
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    b[12] &= 0b111;
    b[13..16].fill(0);
    let name_len = le16(&b, 104) % 256;
    b[104..106].copy_from_slice(&name_len.to_le_bytes());
    seal_crc(&mut b, META_BLOCK);
    [raw, sealed, superblock_block(&b)]
}

/// The `meta_superblock` input that is `sb`'s block.
pub fn superblock_input(sb: &Superblock) -> Vec<u8> {
    sb.encode().to_vec()
}

// ---------------------------------------------------------------------------------------
// meta_al

const AL_MAGIC: &[u8; 8] = b"VSANALOG";
/// Where the extents of an activity log record start.
const AL_EXTENTS: usize = 24;

/// The layout a `meta_al` input starts with: a disk size (`u64`, 0 read as 1) and a
/// chunk size `4096 << (byte % 16)`.
fn al_layout(r: &mut Reader<'_>) -> Layout {
    let size = r.u64().max(1);
    let chunk_size = 4096u64 << (r.u8() % 16);
    Layout::checked(size, chunk_size, 512).expect("a valid layout")
}

/// Whether `b` is an activity log record for `layout` by the format's rules, checked
/// here independently of the decoder.
fn al_rules(layout: &Layout, b: &[u8]) -> Result<(), &'static str> {
    let len = layout.al_len();
    if b.len() < len {
        return Err("short");
    }
    if &b[..8] != AL_MAGIC {
        return Err("magic");
    }
    if le32(b, len - 4) != crc32fast::hash(&b[..len - 4]) {
        return Err("crc");
    }
    let count = le32(b, 16) as usize;
    if count > AL_SLOTS {
        return Err("count");
    }
    if (0..count).any(|i| le64(b, AL_EXTENTS + 8 * i) >= layout.extents()) {
        return Err("extent past the end");
    }
    Ok(())
}

/// `b` decodes for `layout` exactly when it follows the rules; then the count is bounded,
/// every extent is on the disk, and the record re-encodes to `b` with its unused bytes
/// zeroed, which decodes to the same. Returns whether it decoded.
fn al_record(layout: &Layout, b: &[u8]) -> bool {
    let (seq, extents) = match (decode_al(layout, b), al_rules(layout, b)) {
        (Ok(r), Ok(())) => r,
        (Err(_), Err(_)) => return false,
        (got, rules) => panic!("decode_al gave {got:?}, the rules say {rules:?}"),
    };
    assert!(extents.len() <= AL_SLOTS, "{} extents", extents.len());
    assert!(extents.iter().all(|&e| e < layout.extents()));
    assert_eq!(seq, le64(b, 8));
    let len = layout.al_len();
    let mut canonical = b[..len].to_vec();
    canonical[20..24].fill(0);
    canonical[AL_EXTENTS + 8 * extents.len()..len - 4].fill(0);
    seal_crc(&mut canonical, len);
    let encoded = encode_al(layout, seq, &extents);
    assert!(
        encoded[..] == canonical[..],
        "re-encoding differs from the record outside its unused bytes"
    );
    assert_eq!(
        decode_al(layout, &encoded).ok(),
        Some((seq, extents)),
        "no round trip"
    );
    true
}

/// `meta_al`: a layout (disk size `u64`, chunk size byte), a byte of choices (bit 0:
/// make the magic and crc right; bit 1: bring the count within the slots; bit 2: bring
/// every extent within the disk), then the record. The record as given, and as the
/// choices make it, decode exactly when the rules hold and round-trip. Returns which of
/// the two decoded.
pub fn check_al(input: &[u8]) -> [bool; 2] {
    let mut r = Reader::new(input);
    let layout = al_layout(&mut r);
    let choice = r.u8();
    let raw = r.rest();
    let decoded = al_record(&layout, raw);
    let len = layout.al_len();
    let mut b = raw.to_vec();
    b.resize(len, 0);
    if choice & 2 != 0 {
        let count = le32(&b, 16) % (AL_SLOTS as u32 + 1);
        b[16..20].copy_from_slice(&count.to_le_bytes());
    }
    if choice & 4 != 0 {
        let count = (le32(&b, 16) as usize).min(AL_SLOTS);
        for i in 0..count {
            let at = AL_EXTENTS + 8 * i;
            let e = le64(&b, at) % layout.extents();
            b[at..at + 8].copy_from_slice(&e.to_le_bytes());
        }
    }
    if choice & 1 != 0 {
        b[..8].copy_from_slice(AL_MAGIC);
        seal_crc(&mut b, len);
    }
    [decoded, al_record(&layout, &b)]
}

/// The `meta_al` input for the record `seq` holding `extents`, on a disk of `size` bytes
/// with chunk size `4096 << chunk_shift`.
pub fn al_input(size: u64, chunk_shift: u8, seq: u64, extents: &[u64]) -> Vec<u8> {
    let mut out = size.to_le_bytes().to_vec();
    out.push(chunk_shift);
    let layout = Layout::new(size, 4096 << chunk_shift);
    out.push(0);
    out.extend_from_slice(&encode_al(&layout, seq, extents));
    out
}

// ---------------------------------------------------------------------------------------
// meta_open

/// The disk every `meta_open` input's area is opened for: all but the geometry fixed.
pub fn open_params(geometry: u8, size: u32) -> MetaParams {
    MetaParams {
        disk_id: DiskId([0x5a; 16]),
        disk_name: "fuzz0".into(),
        node_id: 1,
        peer_id: 2,
        size: 1 + u64::from(size) % (1 << 28),
        block_size: 512 << ((geometry >> 3) % 4),
        chunk_size: 4096 << (geometry % 8),
    }
}

/// Bytes of the fixed header of a `meta_open` input, before the area bytes.
pub const OPEN_HEADER: usize = 94;

/// The choices a `meta_open` input starts with ([`OPEN_HEADER`] bytes; see the README).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenChoices {
    /// Bits 0-2: chunk size `4096 << n`; bits 3-4: block size `512 << n`.
    pub geometry: u8,
    /// Disk size: `1 + size % 2^28` bytes.
    pub size: u32,
    /// Bit 0/1: seal a superblock into copy 0/1; bit 2/3: an activity log record into copy
    /// 0/1; bit 4/5: the newer sealed superblock / activity log copy is a write torn over
    /// an older record in its slot; bit 6: superblock copy 1 names another node; bit 7:
    /// superblock copy 0 holds an odd seq.
    pub seal: u8,
    /// Under 128: the device is as long as the layout; else `512 * (1 + (n & 63))` bytes
    /// longer (bit 6) or shorter.
    pub length: u8,
    /// Superblock seq (copy `c` gets `(seq & !1) + c`).
    pub sb_seq: u64,
    /// Activity log seq (likewise).
    pub al_seq: u64,
    /// Superblock flags (the low three bits).
    pub flags: u8,
    /// Generations `current, bitmap, history[0], history[1]`.
    pub generations: [u64; 4],
    /// 512-byte sectors of a torn write that landed (0..=8).
    pub torn_sectors: u8,
    /// Extents in the sealed activity log records (`% 17`).
    pub extent_count: u8,
    /// The extents (each `% (extents + 1)`, so one past the end is possible).
    pub extents: [u16; 16],
    /// The chunk whose bit the write-back step sets after a successful open.
    pub chunk: u32,
}

impl OpenChoices {
    fn read(r: &mut Reader<'_>) -> OpenChoices {
        let mut c = OpenChoices {
            geometry: r.u8(),
            size: r.u32(),
            seal: r.u8(),
            length: r.u8(),
            sb_seq: r.u64(),
            al_seq: r.u64(),
            flags: r.u8(),
            generations: [r.u64(), r.u64(), r.u64(), r.u64()],
            torn_sectors: r.u8(),
            extent_count: r.u8(),
            extents: [0; 16],
            chunk: r.u32(),
        };
        for e in &mut c.extents {
            *e = r.u16();
        }
        c
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.push(self.geometry);
        out.extend_from_slice(&self.size.to_le_bytes());
        out.push(self.seal);
        out.push(self.length);
        out.extend_from_slice(&self.sb_seq.to_le_bytes());
        out.extend_from_slice(&self.al_seq.to_le_bytes());
        out.push(self.flags);
        for g in self.generations {
            out.extend_from_slice(&g.to_le_bytes());
        }
        out.push(self.torn_sectors);
        out.push(self.extent_count);
        out.extend_from_slice(&self.chunk.to_le_bytes());
        for e in self.extents {
            out.extend_from_slice(&e.to_le_bytes());
        }
    }
}

/// The `meta_open` input made of `choices` and then `area` (the device's bytes before
/// sealing).
pub fn open_input(choices: &OpenChoices, area: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(OPEN_HEADER + area.len());
    choices.write(&mut out);
    assert_eq!(out.len(), OPEN_HEADER);
    out.extend_from_slice(area);
    out
}

/// The superblock the choices seal into a copy, with sequence number `seq`.
fn sealed_superblock(p: &MetaParams, c: &OpenChoices, seq: u64) -> Superblock {
    let [current, bitmap, h0, h1] = c.generations;
    Superblock {
        seq,
        disk_id: p.disk_id,
        disk_name: p.disk_name.clone(),
        node_id: p.node_id,
        peer_id: p.peer_id,
        size: p.size,
        block_size: p.block_size,
        chunk_size: p.chunk_size,
        generations: Generations {
            current,
            bitmap,
            history: [h0, h1],
        },
        inconsistent: c.flags & 1 != 0,
        crashed: c.flags & 2 != 0,
        clean_shutdown: c.flags & 4 != 0,
    }
}

/// Writes `new` at `at` in `area`, cut short as a power cut would: when `torn`, `old` is
/// written first (an older record in the same slot) and only the first `sectors`
/// 512-byte sectors of `new` land over it.
fn land(area: &mut [u8], at: u64, new: &[u8], old: &[u8], torn: bool, sectors: u8) {
    let at = at as usize;
    let Some(dst) = area.get_mut(at..at + new.len()) else {
        return;
    };
    if torn {
        dst.copy_from_slice(old);
        let n = (usize::from(sectors) * 512).min(new.len());
        dst[..n].copy_from_slice(&new[..n]);
    } else {
        dst.copy_from_slice(new);
    }
}

/// What `meta::open` must return for `area` (the whole device), by the rules in its docs:
/// the newest valid copy of each record (valid: decodes, and its seq belongs in its
/// slot), the identity, then the length, then plausible sequence numbers.
fn expected_open(p: &MetaParams, layout: &Layout, area: &[u8]) -> Result<meta::Loaded, ErrorKind> {
    let total = layout.total_len() as usize;
    if area.len() < 2 * META_BLOCK {
        return Err(ErrorKind::Corrupt);
    }
    let sb = (0..2u64)
        .filter_map(|slot| {
            let at = layout.superblock_offset(slot) as usize;
            Superblock::decode(&area[at..at + META_BLOCK])
                .ok()
                .filter(|sb| sb.seq % 2 == slot)
        })
        .max_by_key(|sb| sb.seq)
        .ok_or(ErrorKind::Corrupt)?;
    let identity = (
        &sb.disk_name,
        sb.disk_id,
        sb.node_id,
        sb.peer_id,
        sb.size,
        sb.block_size,
        sb.chunk_size,
    );
    let configured = (
        &p.disk_name,
        p.disk_id,
        p.node_id,
        p.peer_id,
        p.size,
        p.block_size,
        p.chunk_size,
    );
    if identity != configured {
        return Err(ErrorKind::InvalidArgument);
    }
    if area.len() != total {
        return Err(ErrorKind::Corrupt);
    }
    let (al_seq, al) = (0..2u64)
        .filter_map(|slot| {
            let at = layout.al_offset(slot) as usize;
            decode_al(layout, &area[at..at + layout.al_len()])
                .ok()
                .filter(|(seq, _)| seq % 2 == slot)
        })
        .max_by_key(|(seq, _)| *seq)
        .ok_or(ErrorKind::Corrupt)?;
    if sb.seq > u64::MAX / 2 || al_seq > u64::MAX / 2 {
        return Err(ErrorKind::Corrupt);
    }
    let bitmap = Bitmap::from_blocks(layout.chunks(), &area[layout.bitmap_offset() as usize..]);
    Ok(meta::Loaded {
        layout: *layout,
        superblock: sb,
        al_seq,
        al,
        bitmap,
    })
}

/// What a `meta_open` run ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// `open` loaded the area (and the write-back step reopened it).
    Loaded,
    /// `open` refused it, as the rules say it must, with this kind of error.
    Refused(ErrorKind),
}

/// Checks what `open` loaded against the area it came from, independently of the
/// decoders: the layout is the configured one, every activity log extent is on the disk,
/// the bitmap has one bit per chunk, each bit as stored (none past the last chunk), its
/// count right, and it stores back to the area's bytes (bits past the end cleared).
fn check_loaded(p: &MetaParams, l: &meta::Loaded, area: &[u8]) {
    let layout = &l.layout;
    assert_eq!(
        Some(*layout),
        Layout::checked(p.size, p.chunk_size, p.block_size).ok()
    );
    assert_eq!(layout.total_len(), area.len() as u64);
    assert!(l.al.len() <= AL_SLOTS);
    assert!(l.al.iter().all(|&e| e < layout.extents()), "{:?}", l.al);
    assert!(l.superblock.seq <= u64::MAX / 2 && l.al_seq <= u64::MAX / 2);
    let bm = &l.bitmap;
    assert_eq!(bm.chunks(), layout.chunks());
    let stored = &area[layout.bitmap_offset() as usize..];
    let bit = |c: u64| (stored[(c / 8) as usize] >> (c % 8)) & 1 == 1;
    let mut count = 0;
    for c in 0..layout.chunks() {
        assert_eq!(bm.get(c), bit(c), "chunk {c}");
        count += u64::from(bit(c));
    }
    assert_eq!(bm.count(), count);
    for block in 0..layout.bitmap_blocks() {
        let mut want = stored[block * META_BLOCK..(block + 1) * META_BLOCK].to_vec();
        for (i, byte) in want.iter_mut().enumerate() {
            for b in 0..8 {
                let c = ((block * META_BLOCK + i) * 8 + b) as u64;
                if c >= layout.chunks() {
                    *byte &= !(1 << b);
                }
            }
        }
        assert!(
            bm.block_bytes(block)[..] == want[..],
            "bitmap block {block}"
        );
    }
}

/// `meta_open`: the header ([`OpenChoices`]) picks a small disk's geometry, a device
/// length, and which superblock and activity log copies to seal (valid records, some
/// torn over older ones, one naming the wrong node, one in the wrong slot); the rest of
/// the input is the area's bytes (zero padded). Written to a `MemDevice`, `meta::open`
/// must return what the rules in its docs say: the newest valid copies, or a refusal of
/// the right kind; never a panic. On success what it loaded is checked against the
/// bytes ([`check_loaded`]), and a new superblock, activity log record and bitmap bit
/// written through `write_superblock`, `write_al` and `write_bitmap_block` are what the
/// next open loads.
pub fn check_open(input: &[u8]) -> Opened {
    let mut r = Reader::new(input);
    let c = OpenChoices::read(&mut r);
    let p = open_params(c.geometry, c.size);
    let layout = Layout::checked(p.size, p.chunk_size, p.block_size).expect("a valid layout");
    let total = layout.total_len();
    let len = if c.length < 128 {
        total
    } else {
        let step = 512 * (1 + u64::from(c.length & 63));
        if c.length & 64 != 0 {
            total + step
        } else {
            total.saturating_sub(step).max(512)
        }
    };
    let mut area = r.rest().to_vec();
    area.resize(len as usize, 0);

    for slot in 0..2u64 {
        if c.seal & (1 << slot) == 0 {
            continue;
        }
        let mut seq = (c.sb_seq & !1) + slot;
        if slot == 0 && c.seal & 0x80 != 0 {
            seq += 1;
        }
        let mut sb = sealed_superblock(&p, &c, seq);
        if slot == 1 && c.seal & 0x40 != 0 {
            sb.node_id = 3;
        }
        let old = Superblock {
            seq: seq.wrapping_sub(2),
            ..sb.clone()
        };
        // The newer copy is the odd one.
        let torn = slot == 1 && c.seal & 0x10 != 0;
        let at = layout.superblock_offset(slot);
        land(
            &mut area,
            at,
            &sb.encode(),
            &old.encode(),
            torn,
            c.torn_sectors % 9,
        );
    }
    let extents: Vec<u64> = c.extents[..usize::from(c.extent_count % 17)]
        .iter()
        .map(|&e| u64::from(e) % (layout.extents() + 1))
        .collect();
    for slot in 0..2u64 {
        if c.seal & (4 << slot) == 0 {
            continue;
        }
        let seq = (c.al_seq & !1) + slot;
        let new = encode_al(&layout, seq, &extents);
        let old = encode_al(
            &layout,
            seq.wrapping_sub(2),
            &extents[..extents.len().saturating_sub(1)],
        );
        let torn = slot == 1 && c.seal & 0x20 != 0;
        land(
            &mut area,
            layout.al_offset(slot),
            &new,
            &old,
            torn,
            c.torn_sectors % 9,
        );
    }

    let dev = MemDevice::new(Geometry::new(len, 512).expect("a device geometry"));
    now(dev.write(0, area.clone().into(), IoFlags::empty())).expect("write the area");
    let expected = expected_open(&p, &layout, &area);
    let loaded = match (now(meta::open(&dev, &p)), expected) {
        (Ok(l), Ok(want)) => {
            assert_eq!(l.superblock, want.superblock);
            assert_eq!((l.al_seq, &l.al), (want.al_seq, &want.al));
            assert_eq!(l.bitmap, want.bitmap);
            assert_eq!(l.layout, want.layout);
            l
        }
        (Err(e), Err(kind)) => {
            assert_eq!(e.kind(), kind, "refused for another reason: {e}");
            return Opened::Refused(kind);
        }
        (got, want) => panic!(
            "open gave {:?}, the rules say {:?}",
            got.map(|l| l.superblock),
            want.map(|l| l.superblock)
        ),
    };
    check_loaded(&p, &loaded, &area);

    // What the mirror does next: a new superblock and activity log record (each to the
    // other copy) and a bitmap bit; the next open loads exactly those.
    let mut sb = loaded.superblock.clone();
    sb.seq += 1;
    sb.crashed = !sb.crashed;
    let al_seq = loaded.al_seq + 1;
    let al: Vec<u64> = loaded.al.iter().rev().copied().collect();
    let mut bitmap = loaded.bitmap.clone();
    let chunk = u64::from(c.chunk) % layout.chunks();
    bitmap.set(chunk);
    now(meta::write_superblock(&dev, &layout, &sb)).expect("write the superblock");
    now(meta::write_al(&dev, &layout, al_seq, &al)).expect("write the activity log");
    now(meta::write_bitmap_block(
        &dev,
        &layout,
        &bitmap,
        Bitmap::block_of(chunk),
    ))
    .expect("write a bitmap block");
    let again = now(meta::open(&dev, &p)).expect("open after writing");
    assert_eq!(again.superblock, sb);
    assert_eq!((again.al_seq, &again.al), (al_seq, &al));
    assert_eq!(again.bitmap, bitmap);
    Opened::Loaded
}
