//! virtio-blk as the backend sees it: the feature bits, the config space, and the
//! parsing of one descriptor chain into a request, checked against guest memory.
//!
//! Nothing here trusts the guest. A chain is walked once, every descriptor's range is
//! checked against the mapped regions before anything is read or written, and every
//! length and sector count is checked for overflow; a chain that fails any check becomes
//! a [`Parsed::Bad`] (answered IOERR where it carries a writable status byte).

use std::mem::offset_of;

use virtio_bindings::virtio_blk::{self as blk, virtio_blk_config};
use virtio_queue::DescriptorChain;
use vm_memory::{Address, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};

/// Bytes in a virtio-blk sector: request offsets and config sizes count these, whatever
/// the disk's block size.
pub(crate) const SECTOR: u64 = 512;

/// The request header: type (u32), reserved (u32), sector (u64).
const HEADER_LEN: u64 = 16;

/// One discard / write-zeroes range: sector (u64), num_sectors (u32), flags (u32).
const RANGE_LEN: u64 = 16;

/// The virtio-blk and ring features this backend offers (before `RO`, which depends on
/// the export).
pub(crate) fn device_features(read_only: bool) -> u64 {
    let bit = |b: u32| 1u64 << b;
    let mut f = bit(virtio_bindings::virtio_config::VIRTIO_F_VERSION_1)
        | bit(virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC)
        | bit(virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX)
        | bit(blk::VIRTIO_BLK_F_SEG_MAX)
        | bit(blk::VIRTIO_BLK_F_SIZE_MAX)
        | bit(blk::VIRTIO_BLK_F_BLK_SIZE)
        | bit(blk::VIRTIO_BLK_F_TOPOLOGY)
        | bit(blk::VIRTIO_BLK_F_FLUSH)
        | bit(blk::VIRTIO_BLK_F_CONFIG_WCE)
        | bit(blk::VIRTIO_BLK_F_MQ);
    if read_only {
        f |= bit(blk::VIRTIO_BLK_F_RO);
    } else {
        f |= bit(blk::VIRTIO_BLK_F_DISCARD) | bit(blk::VIRTIO_BLK_F_WRITE_ZEROES);
    }
    f
}

/// What the config space and the request checks are built from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Disk size in bytes (a multiple of `block_size`).
    pub size: u64,
    /// The disk's block size: reported as `blk_size`; every I/O must be aligned to it.
    pub block_size: u32,
    /// The most bytes one descriptor may carry (`size_max`).
    pub size_max: u32,
    /// The most data descriptors in one request (`seg_max`).
    pub seg_max: u32,
    /// The most bytes one read or write may carry in all.
    pub max_transfer: u64,
    /// The most sectors one discard or write-zeroes range may cover.
    pub max_range_sectors: u32,
    /// The most ranges in one discard or write-zeroes request.
    pub max_ranges: u32,
    /// Queues offered (`num_queues`).
    pub queues: u16,
}

/// Offset and length of the config space this backend fills: up to and including
/// `write_zeroes_may_unmap` and its padding (secure erase and zoned fields are not offered).
pub(crate) const CONFIG_LEN: usize = offset_of!(virtio_blk_config, max_secure_erase_sectors);

/// Offset of the `wce` (writeback) byte, the one field the driver may write.
pub(crate) const CONFIG_WCE_OFFSET: usize = offset_of!(virtio_blk_config, wce);

/// The device config space, little endian as VERSION_1 requires.
pub(crate) fn config_space(l: &Limits, writeback: bool) -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    let mut put = |off: usize, bytes: &[u8]| c[off..off + bytes.len()].copy_from_slice(bytes);
    put(
        offset_of!(virtio_blk_config, capacity),
        &(l.size / SECTOR).to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, size_max),
        &l.size_max.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, seg_max),
        &l.seg_max.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, blk_size),
        &l.block_size.to_le_bytes(),
    );
    // Topology: one logical block per physical block, no offset; the minimum and best
    // I/O are one block (counted in logical blocks).
    put(offset_of!(virtio_blk_config, physical_block_exp), &[0]);
    put(offset_of!(virtio_blk_config, alignment_offset), &[0]);
    put(
        offset_of!(virtio_blk_config, min_io_size),
        &1u16.to_le_bytes(),
    );
    put(
        offset_of!(virtio_blk_config, opt_io_size),
        &1u32.to_le_bytes(),
    );
    put(CONFIG_WCE_OFFSET, &[u8::from(writeback)]);
    put(
        offset_of!(virtio_blk_config, num_queues),
        &l.queues.to_le_bytes(),
    );
    let align = (l.block_size as u64 / SECTOR) as u32;
    for (sectors, seg, align_off) in [
        (
            offset_of!(virtio_blk_config, max_discard_sectors),
            offset_of!(virtio_blk_config, max_discard_seg),
            Some(offset_of!(virtio_blk_config, discard_sector_alignment)),
        ),
        (
            offset_of!(virtio_blk_config, max_write_zeroes_sectors),
            offset_of!(virtio_blk_config, max_write_zeroes_seg),
            None,
        ),
    ] {
        put(sectors, &l.max_range_sectors.to_le_bytes());
        put(seg, &l.max_ranges.to_le_bytes());
        if let Some(off) = align_off {
            put(off, &align.to_le_bytes());
        }
    }
    put(offset_of!(virtio_blk_config, write_zeroes_may_unmap), &[1]);
    c
}

/// A run of guest memory one request reads or writes, already checked to lie in the
/// mapped regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seg {
    pub addr: GuestAddress,
    pub len: u32,
}

/// One discard or write-zeroes range, in bytes, checked against the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub offset: u64,
    pub len: u64,
    /// Write zeroes only: the driver allows deallocation (`VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`).
    pub unmap: bool,
}

/// What one well-formed chain asks for.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Read `len` bytes at `offset` into `segs`.
    In {
        offset: u64,
        len: u64,
        segs: Vec<Seg>,
    },
    /// Write the bytes of `segs` at `offset`.
    Out {
        offset: u64,
        len: u64,
        segs: Vec<Seg>,
    },
    /// Make completed writes durable.
    Flush,
    /// Copy the disk's serial into `segs` (up to 20 bytes).
    GetId { segs: Vec<Seg> },
    /// Deallocate the ranges.
    Discard { ranges: Vec<Range> },
    /// Zero the ranges (deallocating where `unmap` allows).
    WriteZeroes { ranges: Vec<Range> },
    /// A request type this backend does not implement: answered UNSUPP.
    Unsupported { kind: u32 },
}

/// A request ready to run: its op and where its status byte goes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub head: u16,
    pub op: Op,
    pub status: GuestAddress,
}

/// Why a chain was refused (logged and counted, never trusted further).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bad {
    /// The chain ended on a descriptor that still points on: a loop, a next index
    /// beyond the queue, an unreadable descriptor table, or an indirect table inside one.
    Broken,
    /// A descriptor's range is not wholly inside guest memory (or wraps around).
    OutsideMemory,
    /// A device-readable descriptor after a device-writable one.
    Order,
    /// Fewer readable bytes than a header, or no writable byte for the status.
    TooShort,
    /// More data than the limits advertised (segments, bytes, ranges) or a length that
    /// is not a whole number of sectors.
    TooLong,
    /// The status byte is in a device-readable buffer.
    StatusReadOnly,
    /// Data in a buffer of the wrong direction (a read into readable buffers, a write
    /// from writable ones, or a stray payload).
    Direction,
    /// A sector count that overflows, lies beyond the disk or is not aligned to its
    /// block size.
    Range,
    /// A write, discard or write-zeroes on a read-only export.
    ReadOnly,
}

impl Bad {
    /// A short name for logs and counters.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Bad::Broken => "broken chain",
            Bad::OutsideMemory => "buffer outside guest memory",
            Bad::Order => "readable buffer after a writable one",
            Bad::TooShort => "chain too short",
            Bad::TooLong => "chain too long",
            Bad::StatusReadOnly => "status byte in a read-only buffer",
            Bad::Direction => "data buffer of the wrong direction",
            Bad::Range => "sector range outside the disk or unaligned",
            Bad::ReadOnly => "write to a read-only export",
        }
    }
}

/// The outcome of parsing one chain.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed {
    /// A request to run.
    Ok(Request),
    /// A chain refused: answer IOERR at `status` if it has one, else complete it with
    /// nothing written.
    Bad {
        head: u16,
        why: Bad,
        status: Option<GuestAddress>,
    },
}

/// Split `segs` after `n` bytes: the first `n` bytes (as segments) and the rest.
fn split_segs(segs: &[Seg], mut n: u64) -> (Vec<Seg>, Vec<Seg>) {
    let mut head = Vec::new();
    let mut tail = Vec::new();
    for s in segs {
        if n == 0 {
            tail.push(*s);
        } else if u64::from(s.len) <= n {
            n -= u64::from(s.len);
            head.push(*s);
        } else {
            head.push(Seg {
                addr: s.addr,
                len: n as u32,
            });
            tail.push(Seg {
                addr: s.addr.unchecked_add(n),
                len: s.len - n as u32,
            });
            n = 0;
        }
    }
    (head, tail.into_iter().filter(|s| s.len > 0).collect())
}

fn total(segs: &[Seg]) -> u64 {
    segs.iter().map(|s| u64::from(s.len)).sum()
}

/// Copy `buf.len()` bytes out of guest memory along `segs`.
pub(crate) fn read_segs(mem: &GuestMemoryMmap, segs: &[Seg], buf: &mut [u8]) -> bool {
    let mut at = 0usize;
    for s in segs {
        let n = (s.len as usize).min(buf.len() - at);
        if n == 0 {
            break;
        }
        if vm_memory::Bytes::read_slice(mem, &mut buf[at..at + n], s.addr).is_err() {
            return false;
        }
        at += n;
    }
    at == buf.len()
}

/// Copy `data` into guest memory along `segs` (up to their length).
pub(crate) fn write_segs(mem: &GuestMemoryMmap, segs: &[Seg], data: &[u8]) -> bool {
    let mut at = 0usize;
    for s in segs {
        let n = (s.len as usize).min(data.len() - at);
        if n == 0 {
            break;
        }
        if vm_memory::Bytes::write_slice(mem, &data[at..at + n], s.addr).is_err() {
            return false;
        }
        at += n;
    }
    true
}

/// Bytes of a sector range `[sector, sector + sectors)`, checked for overflow, against
/// the disk's end and against its block size.
fn byte_range(l: &Limits, sector: u64, sectors: u64) -> Option<(u64, u64)> {
    let offset = sector.checked_mul(SECTOR)?;
    let len = sectors.checked_mul(SECTOR)?;
    let end = offset.checked_add(len)?;
    let bs = u64::from(l.block_size);
    (end <= l.size && offset % bs == 0 && len % bs == 0).then_some((offset, len))
}

/// Walk one chain and check it against guest memory and the limits.
pub(crate) fn parse<M>(
    chain: DescriptorChain<M>,
    mem: &GuestMemoryMmap,
    l: &Limits,
    read_only: bool,
) -> Parsed
where
    M: std::ops::Deref,
    M::Target: GuestMemory,
{
    let head = chain.head_index();
    let mut readable: Vec<Seg> = Vec::new();
    let mut writable: Vec<Seg> = Vec::new();
    let mut last_has_next = false;
    let mut why: Option<Bad> = None;
    for d in chain {
        last_has_next = d.has_next();
        let seg = Seg {
            addr: d.addr(),
            len: d.len(),
        };
        let access = if d.is_write_only() {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if why.is_none() && seg.len > 0 && !mem.check_range(seg.addr, seg.len as usize, access) {
            why = Some(Bad::OutsideMemory);
        }
        if d.is_write_only() {
            writable.push(seg);
        } else {
            if !writable.is_empty() && why.is_none() {
                why = Some(Bad::Order);
            }
            readable.push(seg);
        }
    }
    // The status byte: the last byte of the writable part, if that part is sound.
    let status = writable
        .iter()
        .rev()
        .find(|s| s.len > 0)
        .filter(|s| mem.check_range(s.addr, s.len as usize, Permissions::Write))
        .map(|s| s.addr.unchecked_add(u64::from(s.len) - 1));
    let bad = |why| Parsed::Bad { head, why, status };
    if last_has_next {
        return bad(Bad::Broken);
    }
    if let Some(w) = why {
        return bad(w);
    }
    let Some(status) = status else {
        let last_readable_nonempty = readable.iter().any(|s| s.len > 0);
        return bad(if last_readable_nonempty && writable.is_empty() {
            Bad::StatusReadOnly
        } else {
            Bad::TooShort
        });
    };
    if total(&readable) < HEADER_LEN {
        return bad(Bad::TooShort);
    }
    let mut hdr = [0u8; HEADER_LEN as usize];
    if !read_segs(mem, &readable, &mut hdr) {
        return bad(Bad::OutsideMemory);
    }
    let kind = u32::from_le_bytes(hdr[0..4].try_into().unwrap_or_default());
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or_default());
    let (_, rdata) = split_segs(&readable, HEADER_LEN);
    let (wdata, _) = split_segs(&writable, total(&writable) - 1);
    let rlen = total(&rdata);
    let wlen = total(&wdata);
    let too_many = |segs: &[Seg]| {
        segs.len() as u64 > u64::from(l.seg_max) || segs.iter().any(|s| s.len > l.size_max)
    };
    let op = match kind {
        blk::VIRTIO_BLK_T_IN | blk::VIRTIO_BLK_T_OUT => {
            let is_in = kind == blk::VIRTIO_BLK_T_IN;
            let (data, stray) = if is_in { (wdata, rlen) } else { (rdata, wlen) };
            let len = total(&data);
            if stray != 0 {
                return bad(Bad::Direction);
            }
            if len == 0 || len % SECTOR != 0 || len > l.max_transfer || too_many(&data) {
                return bad(Bad::TooLong);
            }
            let Some((offset, len)) = byte_range(l, sector, len / SECTOR) else {
                return bad(Bad::Range);
            };
            if is_in {
                Op::In {
                    offset,
                    len,
                    segs: data,
                }
            } else if read_only {
                return bad(Bad::ReadOnly);
            } else {
                Op::Out {
                    offset,
                    len,
                    segs: data,
                }
            }
        }
        blk::VIRTIO_BLK_T_FLUSH => Op::Flush,
        blk::VIRTIO_BLK_T_GET_ID => {
            if rlen != 0 {
                return bad(Bad::Direction);
            }
            Op::GetId { segs: wdata }
        }
        blk::VIRTIO_BLK_T_DISCARD | blk::VIRTIO_BLK_T_WRITE_ZEROES => {
            if read_only {
                return bad(Bad::ReadOnly);
            }
            if wlen != 0 {
                return bad(Bad::Direction);
            }
            if rlen == 0 || rlen % RANGE_LEN != 0 || rlen / RANGE_LEN > u64::from(l.max_ranges) {
                return bad(Bad::TooLong);
            }
            let mut raw = vec![0u8; rlen as usize];
            if !read_segs(mem, &rdata, &mut raw) {
                return bad(Bad::OutsideMemory);
            }
            let zeroes = kind == blk::VIRTIO_BLK_T_WRITE_ZEROES;
            let mut ranges = Vec::with_capacity(raw.len() / RANGE_LEN as usize);
            for r in raw.chunks_exact(RANGE_LEN as usize) {
                let sector = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
                let sectors = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
                let flags = u32::from_le_bytes(r[12..16].try_into().unwrap_or_default());
                // Unknown flags, the unmap flag on a discard, or a range beyond the
                // advertised maximum: refused (VIRTIO 1.2, 5.2.6.2).
                let known = if zeroes {
                    blk::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
                } else {
                    0
                };
                if flags & !known != 0 || sectors == 0 || sectors > l.max_range_sectors {
                    return bad(Bad::Range);
                }
                let Some((offset, len)) = byte_range(l, sector, u64::from(sectors)) else {
                    return bad(Bad::Range);
                };
                ranges.push(Range {
                    offset,
                    len,
                    unmap: flags & blk::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
                });
            }
            if zeroes {
                Op::WriteZeroes { ranges }
            } else {
                Op::Discard { ranges }
            }
        }
        other => Op::Unsupported { kind: other },
    };
    Parsed::Ok(Request { head, op, status })
}

#[cfg(test)]
#[path = "virtio_tests.rs"]
mod tests;
