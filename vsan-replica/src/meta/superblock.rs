//! The superblock: which disk a metadata area belongs to, its geometry, generations and
//! state flags, in one checksummed [`META_BLOCK`].

use bytes::Bytes;

use vsan_core::Result;

use super::{META_BLOCK, corrupt, le_u16, le_u32, le_u64, put};
use crate::protocol::{DiskId, Generations};

const MAGIC: [u8; 8] = *b"VSANMETA";
/// The format this code writes and the only one it reads.
const FORMAT_VERSION: u32 = 1;
/// Where the crc lives in every format version: the last four bytes of the block.
const CRC_AT: usize = META_BLOCK - 4;
/// The longest disk name stored, in bytes.
const MAX_NAME: usize = 255;

const FLAG_INCONSISTENT: u32 = 1 << 0;
const FLAG_CRASHED: u32 = 1 << 1;
const FLAG_CLEAN_SHUTDOWN: u32 = 1 << 2;
const KNOWN_FLAGS: u32 = FLAG_INCONSISTENT | FLAG_CRASHED | FLAG_CLEAN_SHUTDOWN;

// Field offsets; the module docs hold the same table.
const AT_VERSION: usize = 8;
const AT_FLAGS: usize = 12;
const AT_SEQ: usize = 16;
const AT_DISK_ID: usize = 24;
const AT_NODE_ID: usize = 40;
const AT_PEER_ID: usize = 44;
const AT_SIZE: usize = 48;
const AT_BLOCK_SIZE: usize = 56;
const AT_CHUNK_SIZE: usize = 64;
const AT_GEN_CURRENT: usize = 72;
const AT_GEN_BITMAP: usize = 80;
const AT_GEN_HISTORY: usize = 88;
const AT_NAME_LEN: usize = 104;
const AT_NAME: usize = 106;

/// The superblock of one replica's metadata.
///
/// Stored as two alternating copies: the one with `seq` goes to copy `seq % 2`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// Incremented on every write; the copy written is `seq % 2`.
    pub seq: u64,
    /// The replicated disk's id, the same on both nodes.
    pub disk_id: DiskId,
    /// The disk's name, at most 255 bytes of UTF-8.
    pub disk_name: String,
    /// This node's id.
    pub node_id: u32,
    /// The peer node's id.
    pub peer_id: u32,
    /// Disk size in bytes.
    pub size: u64,
    /// The disk's block size in bytes.
    pub block_size: u32,
    /// Bytes of disk one bitmap bit covers.
    pub chunk_size: u64,
    /// The replica's data generations.
    pub generations: Generations,
    /// This replica is the target of a sync that has not completed: its data is not usable
    /// on its own.
    pub inconsistent: bool,
    /// Activity log extents were merged into the bitmap after a crash and are not resynced
    /// yet.
    pub crashed: bool,
    /// The node shut down cleanly: no writes were in flight, the activity log is empty of
    /// anything that matters.
    pub clean_shutdown: bool,
}

impl Superblock {
    /// The superblock as stored: exactly [`META_BLOCK`] bytes (magic, format version, fields
    /// little-endian, crc32 of everything before it in the last four bytes).
    ///
    /// A name longer than 255 bytes is cut at a character boundary; the entry points refuse
    /// such names before anything is written.
    pub fn encode(&self) -> Bytes {
        let mut b = vec![0u8; META_BLOCK];
        let mut flags = 0;
        for (on, bit) in [
            (self.inconsistent, FLAG_INCONSISTENT),
            (self.crashed, FLAG_CRASHED),
            (self.clean_shutdown, FLAG_CLEAN_SHUTDOWN),
        ] {
            if on {
                flags |= bit;
            }
        }
        let name = name_prefix(&self.disk_name);
        put(&mut b, 0, &MAGIC);
        put(&mut b, AT_VERSION, &FORMAT_VERSION.to_le_bytes());
        put(&mut b, AT_FLAGS, &flags.to_le_bytes());
        put(&mut b, AT_SEQ, &self.seq.to_le_bytes());
        put(&mut b, AT_DISK_ID, &self.disk_id.0);
        put(&mut b, AT_NODE_ID, &self.node_id.to_le_bytes());
        put(&mut b, AT_PEER_ID, &self.peer_id.to_le_bytes());
        put(&mut b, AT_SIZE, &self.size.to_le_bytes());
        put(&mut b, AT_BLOCK_SIZE, &self.block_size.to_le_bytes());
        put(&mut b, AT_CHUNK_SIZE, &self.chunk_size.to_le_bytes());
        let g = &self.generations;
        put(&mut b, AT_GEN_CURRENT, &g.current.to_le_bytes());
        put(&mut b, AT_GEN_BITMAP, &g.bitmap.to_le_bytes());
        put(&mut b, AT_GEN_HISTORY, &g.history[0].to_le_bytes());
        put(&mut b, AT_GEN_HISTORY + 8, &g.history[1].to_le_bytes());
        put(&mut b, AT_NAME_LEN, &(name.len() as u16).to_le_bytes());
        put(&mut b, AT_NAME, name.as_bytes());
        let crc = crc32fast::hash(&b[..CRC_AT]);
        put(&mut b, CRC_AT, &crc.to_le_bytes());
        Bytes::from(b)
    }

    /// Reads a stored superblock from the first [`META_BLOCK`] bytes of `block`; the error
    /// says why it is not one ("short block", "bad magic", "crc mismatch", "unsupported
    /// format version N", ...).
    pub fn decode(block: &[u8]) -> Result<Superblock> {
        if block.len() < META_BLOCK {
            return Err(corrupt(format!(
                "short block ({} bytes, a superblock is {META_BLOCK})",
                block.len()
            )));
        }
        let b = &block[..META_BLOCK];
        if b[..MAGIC.len()] != MAGIC {
            if b.iter().all(|&x| x == 0) {
                return Err(corrupt("bad magic (all zeros: never written)"));
            }
            return Err(corrupt("bad magic"));
        }
        let (stored, actual) = (le_u32(b, CRC_AT), crc32fast::hash(&b[..CRC_AT]));
        if stored != actual {
            return Err(corrupt(format!(
                "crc mismatch (stored {stored:#010x}, computed {actual:#010x})"
            )));
        }
        let version = le_u32(b, AT_VERSION);
        if version != FORMAT_VERSION {
            return Err(corrupt(format!("unsupported format version {version}")));
        }
        let flags = le_u32(b, AT_FLAGS);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(corrupt(format!(
                "unknown flags {:#x}",
                flags & !KNOWN_FLAGS
            )));
        }
        let name_len = usize::from(le_u16(b, AT_NAME_LEN));
        if name_len > MAX_NAME {
            return Err(corrupt(format!(
                "disk name length {name_len} is over the limit of {MAX_NAME}"
            )));
        }
        let disk_name = std::str::from_utf8(&b[AT_NAME..AT_NAME + name_len])
            .map_err(|_| corrupt("disk name is not UTF-8"))?
            .to_string();
        let mut disk_id = [0u8; 16];
        disk_id.copy_from_slice(&b[AT_DISK_ID..AT_DISK_ID + 16]);
        Ok(Superblock {
            seq: le_u64(b, AT_SEQ),
            disk_id: DiskId(disk_id),
            disk_name,
            node_id: le_u32(b, AT_NODE_ID),
            peer_id: le_u32(b, AT_PEER_ID),
            size: le_u64(b, AT_SIZE),
            block_size: le_u32(b, AT_BLOCK_SIZE),
            chunk_size: le_u64(b, AT_CHUNK_SIZE),
            generations: Generations {
                current: le_u64(b, AT_GEN_CURRENT),
                bitmap: le_u64(b, AT_GEN_BITMAP),
                history: [le_u64(b, AT_GEN_HISTORY), le_u64(b, AT_GEN_HISTORY + 8)],
            },
            inconsistent: flags & FLAG_INCONSISTENT != 0,
            crashed: flags & FLAG_CRASHED != 0,
            clean_shutdown: flags & FLAG_CLEAN_SHUTDOWN != 0,
        })
    }
}

/// Whether `name` fits the superblock.
pub(super) fn name_fits(name: &str) -> bool {
    name.len() <= MAX_NAME
}

/// The longest prefix of `name` that fits, cut at a character boundary.
fn name_prefix(name: &str) -> &str {
    debug_assert!(name_fits(name), "disk name over {MAX_NAME} bytes");
    let mut end = name.len().min(MAX_NAME);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            seq: 42,
            disk_id: DiskId([0xab; 16]),
            disk_name: "vol0-ünïcode".into(),
            node_id: 1,
            peer_id: 2,
            size: 1 << 30,
            block_size: 512,
            chunk_size: 65536,
            generations: Generations {
                current: 0x1234_5678_9abc_def1,
                bitmap: 77,
                history: [66, 55],
            },
            inconsistent: true,
            crashed: false,
            clean_shutdown: true,
        }
    }

    #[test]
    fn round_trip() {
        let sb = sample();
        let b = sb.encode();
        assert_eq!(b.len(), META_BLOCK);
        assert_eq!(Superblock::decode(&b).unwrap(), sb);
        for flags in 0..8 {
            let sb = Superblock {
                inconsistent: flags & 1 != 0,
                crashed: flags & 2 != 0,
                clean_shutdown: flags & 4 != 0,
                disk_name: "n".repeat(MAX_NAME),
                ..sample()
            };
            assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
        }
    }

    #[test]
    fn refusals_say_why() {
        let good = sample().encode();
        let err = |b: &[u8]| Superblock::decode(b).unwrap_err().context().to_string();
        assert!(err(&good[..100]).starts_with("short block"));
        assert!(err(&[0u8; META_BLOCK]).starts_with("bad magic"));
        let mut b = good.to_vec();
        b[0] ^= 1;
        assert_eq!(err(&b), "bad magic");
        let mut b = good.to_vec();
        b[AT_SIZE] ^= 1;
        assert!(err(&b).starts_with("crc mismatch"));
        // A version this code does not know, with a valid crc.
        let mut b = good.to_vec();
        put(&mut b, AT_VERSION, &7u32.to_le_bytes());
        let crc = crc32fast::hash(&b[..CRC_AT]);
        put(&mut b, CRC_AT, &crc.to_le_bytes());
        assert_eq!(err(&b), "unsupported format version 7");
        let mut b = good.to_vec();
        put(&mut b, AT_FLAGS, &0x100u32.to_le_bytes());
        let crc = crc32fast::hash(&b[..CRC_AT]);
        put(&mut b, CRC_AT, &crc.to_le_bytes());
        assert!(err(&b).starts_with("unknown flags"));
    }
}
