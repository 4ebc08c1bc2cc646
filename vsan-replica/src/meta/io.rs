//! Creating, opening and writing a metadata area on any [`BlockDevice`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use tracing::warn;
use vsan_core::{BlockDevice, Error, ErrorKind, FileOptions, IoFlags, Result};

use super::superblock::name_fits;
use super::{Bitmap, Layout, META_BLOCK, Superblock, decode_al, encode_al};
use crate::protocol::{DiskId, GEN_JUST_CREATED, Generations};

/// The block size the metadata file is opened with.
const FILE_BLOCK_SIZE: u32 = 512;

/// What a replica's metadata must say: the configured identity and geometry of the disk.
#[derive(Debug, Clone)]
pub struct MetaParams {
    /// The replicated disk's id.
    pub disk_id: DiskId,
    /// The disk's name (at most 255 bytes).
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
}

/// A metadata area as read (or just written).
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Where everything lies.
    pub layout: Layout,
    /// The newest valid superblock.
    pub superblock: Superblock,
    /// Seq of the newest valid activity log record.
    pub al_seq: u64,
    /// Extents of that record.
    pub al: Vec<u64>,
    /// The stored bitmap.
    pub bitmap: Bitmap,
}

/// Writes fresh metadata for `p` on `dev` and flushes it: superblock seq 1 (generations
/// `{current: GEN_JUST_CREATED, bitmap: 0, history: [0, 0]}`, consistent, not crashed,
/// clean shutdown), an empty activity log in both copies, a clear bitmap.
///
/// `dev` must be exactly [`Layout::total_len`] bytes, or
/// [`Layout::total_len_with_scsi`] with the SCSI state area (left empty). The superblocks are written last,
/// after a flush, so a crash part way leaves no valid superblock behind a half-written area.
pub async fn create(dev: &dyn BlockDevice, p: &MetaParams) -> Result<Loaded> {
    let layout = check_params(p)?;
    check_device(dev, p)?;
    let size = dev.geometry().size();
    if size != layout.total_len() && size != layout.total_len_with_scsi() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{}: the device is {size} bytes, the layout needs {} (or {} with the SCSI state area)",
                what(p),
                layout.total_len(),
                layout.total_len_with_scsi()
            ),
        ));
    }
    let io = |e: Error| e.context_prefix(what(p));

    let piece = max_piece(dev);
    let zeros = Bytes::from(vec![0u8; piece]);
    // The bitmap, and the SCSI state area when there is one (empty slots).
    let (mut at, end) = (layout.bitmap_offset(), size);
    while at < end {
        let n = (end - at).min(piece as u64);
        dev.write(at, zeros.slice(..n as usize), IoFlags::empty())
            .await
            .map_err(io)?;
        at += n;
    }
    for seq in 0..2 {
        dev.write(
            layout.al_offset(seq),
            encode_al(&layout, seq, &[]),
            IoFlags::empty(),
        )
        .await
        .map_err(io)?;
    }
    dev.flush().await.map_err(io)?;

    let mut sb = Superblock {
        seq: 0,
        disk_id: p.disk_id,
        disk_name: p.disk_name.clone(),
        node_id: p.node_id,
        peer_id: p.peer_id,
        size: p.size,
        block_size: p.block_size,
        chunk_size: p.chunk_size,
        generations: Generations {
            current: GEN_JUST_CREATED,
            bitmap: 0,
            history: [0, 0],
        },
        inconsistent: false,
        crashed: false,
        clean_shutdown: true,
    };
    // Both copies, so the first open finds two good ones and has nothing to warn about.
    for seq in 0..2 {
        sb.seq = seq;
        dev.write(layout.superblock_offset(seq), sb.encode(), IoFlags::empty())
            .await
            .map_err(io)?;
    }
    dev.flush().await.map_err(io)?;
    Ok(Loaded {
        layout,
        superblock: sb,
        al_seq: 1,
        al: Vec::new(),
        bitmap: Bitmap::new(layout.chunks()),
    })
}

/// Reads and validates the metadata on `dev` for the disk `p` describes.
///
/// Takes the superblock copy with a valid crc and the highest seq, and likewise for the
/// activity log; one bad copy of either is logged as a warning and tolerated. Refuses,
/// and changes nothing, when:
/// - both superblock copies or both activity log copies are corrupt
///   ([`ErrorKind::Corrupt`]);
/// - the metadata belongs to another disk (name or id), or its node id, peer id, size,
///   block size or chunk size differs from `p` ([`ErrorKind::InvalidArgument`]);
/// - the device is shorter ("truncated") or longer than the layout
///   ([`ErrorKind::Corrupt`]).
///
/// The identity is checked before the length, so metadata opened with a changed chunk
/// size or disk size is reported as that, not as a damaged file.
pub async fn open(dev: &dyn BlockDevice, p: &MetaParams) -> Result<Loaded> {
    let layout = check_params(p)?;
    check_device(dev, p)?;
    let have = dev.geometry().size();
    if have < 2 * META_BLOCK as u64 {
        return Err(length_error(p, have, &layout));
    }
    let io = |e: Error| e.context_prefix(what(p));

    let mut copies = Vec::with_capacity(2);
    for seq in 0..2 {
        let block = dev
            .read(layout.superblock_offset(seq), META_BLOCK)
            .await
            .map_err(io)?;
        copies.push(
            Superblock::decode(&block)
                .and_then(|sb| in_its_copy(sb.seq, seq).map(|()| (sb.seq, sb))),
        );
    }
    let superblock = newest(p, "superblock", copies)?;
    check_identity(p, &superblock)?;
    if have != layout.total_len() && have != layout.total_len_with_scsi() {
        return Err(length_error(p, have, &layout));
    }

    let mut copies = Vec::with_capacity(2);
    for seq in 0..2 {
        let bytes = dev
            .read(layout.al_offset(seq), layout.al_len())
            .await
            .map_err(io)?;
        copies.push(
            decode_al(&layout, &bytes).and_then(|r| in_its_copy(r.0, seq).map(|()| (r.0, r))),
        );
    }
    let (al_seq, al) = newest(p, "activity log", copies)?;
    // Sequence numbers only grow by one per write: one this large is damage, and the next
    // write would wrap it and lose to the stale copy.
    for (what_seq, seq) in [("superblock", superblock.seq), ("activity log", al_seq)] {
        if seq > u64::MAX / 2 {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "{}: {what_seq} sequence number {seq} is implausible",
                    what(p)
                ),
            ));
        }
    }

    let piece = max_piece(dev);
    let (mut at, end) = (layout.bitmap_offset(), layout.total_len());
    let mut area = Vec::with_capacity((end - at) as usize);
    while at < end {
        let n = (end - at).min(piece as u64);
        area.extend_from_slice(&dev.read(at, n as usize).await.map_err(io)?);
        at += n;
    }
    Ok(Loaded {
        layout,
        superblock,
        al_seq,
        al,
        bitmap: Bitmap::from_blocks(layout.chunks(), &area),
    })
}

/// vsan-node's entry point: opens the metadata file at `path`, or creates it when it does
/// not exist.
///
/// A new file is built under a temporary name next to `path` (exactly
/// [`Layout::total_len_with_scsi`] bytes, a [`FileDevice`](vsan_core::FileDevice) with
/// 512-byte blocks), filled by [`create`], and renamed into place only when complete, so
/// a crash during creation never leaves a half-made file at `path`. An existing file must
/// be long enough to hold the superblocks before [`open`] reads it; one of
/// [`Layout::total_len`] bytes (made before the SCSI state area existed) is grown by it
/// first. Returns the device to keep
/// writing metadata through, what was loaded, and whether the file was created.
///
/// Called once when a disk starts; the file system calls here are blocking.
pub async fn open_or_create_file(
    path: &Path,
    p: &MetaParams,
) -> Result<(Arc<dyn BlockDevice>, Loaded, bool)> {
    let layout = check_params(p)?;
    let at_path = |e: Error| e.context_prefix(path.display());
    let opts = FileOptions::new().block_size(FILE_BLOCK_SIZE);
    match std::fs::metadata(path) {
        Ok(m) => {
            let len = m.len();
            // A regular file's length decides whether it can be opened as a device at all;
            // a block device reports 0 here and its size is checked by `open`.
            if m.is_file() && (len < 2 * META_BLOCK as u64 || len % u64::from(FILE_BLOCK_SIZE) != 0)
            {
                return Err(at_path(length_error(p, len, &layout)));
            }
            if m.is_file() && len == layout.total_len() {
                // Made before the SCSI state area existed: grown by it (zeroes, empty
                // slots) before it is opened; nothing already there moves.
                grow_file(path, layout.total_len_with_scsi())?;
                tracing::info!(
                    disk = %p.disk_name,
                    "metadata file {} grown by the SCSI state area",
                    path.display()
                );
            }
            let dev = opts.open(path)?;
            let loaded = open(&dev, p).await.map_err(at_path)?;
            Ok((Arc::new(dev), loaded, false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let tmp = creating_path(path);
            match std::fs::remove_file(&tmp) {
                Ok(()) => warn!(
                    disk = %p.disk_name,
                    "removed {}, left by a metadata creation that did not finish",
                    tmp.display()
                ),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(format!("remove {}", tmp.display()), e)),
            }
            let dev = opts
                .clone()
                .create(layout.total_len_with_scsi())
                .open(&tmp)?;
            let loaded = match create(&dev, p).await {
                Ok(l) => l,
                Err(e) => {
                    drop(dev);
                    let _ = std::fs::remove_file(&tmp);
                    return Err(at_path(e));
                }
            };
            drop(dev);
            std::fs::rename(&tmp, path).map_err(|e| {
                Error::io(format!("rename {} to {}", tmp.display(), path.display()), e)
            })?;
            sync_parent(path)?;
            let dev = opts.open(path)?;
            Ok((Arc::new(dev), loaded, true))
        }
        Err(e) => Err(Error::io(format!("stat {}", path.display()), e)),
    }
}

/// Extend the file at `path` to `len` bytes (zeroes) and make the new length durable.
fn grow_file(path: &Path, len: u64) -> Result<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
    f.set_len(len)
        .and_then(|()| f.sync_all())
        .map_err(|e| Error::io(format!("grow {}", path.display()), e))
}

/// Writes `sb` to its copy (`sb.seq % 2`); durable when it returns.
pub async fn write_superblock(
    dev: &dyn BlockDevice,
    layout: &Layout,
    sb: &Superblock,
) -> Result<()> {
    dev.write(layout.superblock_offset(sb.seq), sb.encode(), IoFlags::FUA)
        .await
}

/// Writes the activity log record `seq` holding `extents` to its copy (`seq % 2`); durable
/// when it returns.
pub async fn write_al(
    dev: &dyn BlockDevice,
    layout: &Layout,
    seq: u64,
    extents: &[u64],
) -> Result<()> {
    dev.write(
        layout.al_offset(seq),
        encode_al(layout, seq, extents),
        IoFlags::FUA,
    )
    .await
}

/// Writes bitmap block `block` of `bitmap` (see [`Bitmap::block_of`]); durable when it
/// returns.
pub async fn write_bitmap_block(
    dev: &dyn BlockDevice,
    layout: &Layout,
    bitmap: &Bitmap,
    block: usize,
) -> Result<()> {
    if block >= layout.bitmap_blocks() {
        return Err(Error::new(
            ErrorKind::OutOfRange,
            format!(
                "bitmap block {block} of a bitmap of {} blocks",
                layout.bitmap_blocks()
            ),
        ));
    }
    let offset = layout.bitmap_offset() + (block * META_BLOCK) as u64;
    dev.write(offset, bitmap.block_bytes(block), IoFlags::FUA)
        .await
}

/// How errors name the metadata: `metadata for disk "vol0"`.
fn what(p: &MetaParams) -> String {
    format!("metadata for disk {:?}", p.disk_name)
}

/// The one validation of `p` every entry point runs first.
fn check_params(p: &MetaParams) -> Result<Layout> {
    if !name_fits(&p.disk_name) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{}: the disk name is {} bytes, over the limit of 255",
                what(p),
                p.disk_name.len()
            ),
        ));
    }
    Layout::checked(p.size, p.chunk_size, p.block_size).map_err(|e| e.context_prefix(what(p)))
}

/// Every metadata I/O is whole [`META_BLOCK`]s; the device must take them.
fn check_device(dev: &dyn BlockDevice, p: &MetaParams) -> Result<()> {
    let g = dev.geometry();
    if META_BLOCK % g.block_size() as usize != 0 || (g.max_io() as usize) < META_BLOCK {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{}: the device's block size {} or maximum request {} does not fit \
                 {META_BLOCK}-byte metadata blocks",
                what(p),
                g.block_size(),
                g.max_io()
            ),
        ));
    }
    Ok(())
}

/// The largest read or write of the bitmap area to issue at once: whole metadata blocks,
/// within the device's maximum request, at most 1 MiB.
fn max_piece(dev: &dyn BlockDevice) -> usize {
    let max = (dev.geometry().max_io() as usize).min(1 << 20);
    (max / META_BLOCK * META_BLOCK).max(META_BLOCK)
}

fn length_error(p: &MetaParams, have: u64, layout: &Layout) -> Error {
    let need = layout.total_len();
    let msg = if have < need {
        format!(
            "{} is truncated: {have} bytes, the layout needs {need}",
            what(p)
        )
    } else {
        format!(
            "{} is {have} bytes: its layout needs {need}, or {} with the SCSI state area",
            what(p),
            layout.total_len_with_scsi()
        )
    };
    Error::new(ErrorKind::Corrupt, msg)
}

/// A record with `seq` belongs in copy `seq % 2`; one found in the other copy was not
/// written by this code and is not trusted.
fn in_its_copy(seq: u64, copy: u64) -> Result<()> {
    if seq % 2 == copy {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::Corrupt,
            format!("holds seq {seq}, which belongs in copy {}", seq % 2),
        ))
    }
}

/// The newer of two copies, each `(seq, value)` or why it is bad; one bad copy is a
/// warning, two are [`ErrorKind::Corrupt`].
fn newest<T>(p: &MetaParams, name: &str, copies: Vec<Result<(u64, T)>>) -> Result<T> {
    let mut good: Option<(u64, T)> = None;
    let mut bad = Vec::new();
    for (copy, c) in copies.into_iter().enumerate() {
        match c {
            Ok((seq, v)) => {
                if good.as_ref().is_none_or(|(s, _)| seq > *s) {
                    good = Some((seq, v));
                }
            }
            Err(why) => bad.push(format!("copy {copy}: {}", why.context())),
        }
    }
    match good {
        Some((seq, v)) => {
            if !bad.is_empty() {
                warn!(
                    disk = %p.disk_name,
                    "{name} {}; using the other copy (seq {seq})",
                    bad.join("; ")
                );
            }
            Ok(v)
        }
        None => Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "{}: both {name} copies are corrupt ({})",
                what(p),
                bad.join("; ")
            ),
        )),
    }
}

/// The stored superblock must describe the configured disk.
fn check_identity(p: &MetaParams, sb: &Superblock) -> Result<()> {
    if sb.disk_name != p.disk_name || sb.disk_id != p.disk_id {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "the metadata opened for disk {:?} (id {}) belongs to disk {:?} (id {})",
                p.disk_name, p.disk_id, sb.disk_name, sb.disk_id
            ),
        ));
    }
    let fields: [(&str, u64, u64); 5] = [
        ("node id", sb.node_id.into(), p.node_id.into()),
        ("peer id", sb.peer_id.into(), p.peer_id.into()),
        ("size", sb.size, p.size),
        ("block size", sb.block_size.into(), p.block_size.into()),
        ("chunk size", sb.chunk_size, p.chunk_size),
    ];
    for (field, stored, configured) in fields {
        if stored != configured {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "{}: {field} {stored} in the metadata, {configured} in the config",
                    what(p)
                ),
            ));
        }
    }
    Ok(())
}

/// Where a new metadata file is built before it is renamed to `path`.
fn creating_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".creating");
    path.with_file_name(name)
}

/// Makes a rename in `path`'s directory durable.
fn sync_parent(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(format!("sync directory {}", dir.display()), e))
}
