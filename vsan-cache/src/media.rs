//! The fast device under the cache: a memory-mapped file, or any [`BlockDevice`].

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use memmap2::MmapRaw;
use vsan_core::{BlockDevice, Error, ErrorKind, IoFlags, Result};

/// The persistent device a [`WriteBackCache`](crate::WriteBackCache) keeps its log on.
///
/// Two kinds:
/// - [`map_file`](Self::map_file): a file mapped with memmap2 — a file on a DAX file
///   system (persistent memory), on an NVMe SSD, or on `/dev/shm` for tests and
///   benchmarks. Appends are `memcpy` into the mapping; persisting is `msync` of the
///   range written. This is the fast path.
/// - [`block`](Self::block): any [`BlockDevice`]. Appends become block writes (the first
///   and last block of an append that does not cover them whole are read and merged
///   first), persisting is a device flush. Slower; it exists so the cache can be tested
///   on a `FaultyDevice` (errors and power cuts), and for devices that cannot be mapped.
///
/// A mapped file whose storage fails under it (an I/O error in `msync`) is reported as an
/// error; one that is truncated under the mapping raises `SIGBUS`, which no user-space
/// program can recover from — keep cache files where nobody else truncates them.
pub struct FastDevice {
    kind: Kind,
    len: u64,
}

enum Kind {
    Mapped {
        map: MmapRaw,
        file: Arc<File>,
        /// `msync` is a memory operation here (tmpfs): persist on the caller's thread.
        /// Otherwise persisting is real I/O and goes to the blocking pool, so the
        /// caller's task (an NBD connection with other requests) is not stalled.
        inline_persist: bool,
    },
    Block(Arc<dyn BlockDevice>),
}

/// Whether the file lives on tmpfs (`/dev/shm`), where `msync` costs no I/O.
fn on_tmpfs(file: &File) -> bool {
    const TMPFS_MAGIC: u64 = 0x0102_1994;
    rustix::fs::fstatfs(file).is_ok_and(|s| s.f_type as u64 == TMPFS_MAGIC)
}

impl std::fmt::Debug for FastDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Mapped { .. } => "mapped",
            Kind::Block(_) => "block",
        };
        f.debug_struct("FastDevice")
            .field("kind", &kind)
            .field("len", &self.len)
            .finish()
    }
}

impl FastDevice {
    /// Map the file at `path` (read-write). With `create_len`, a missing file is created
    /// with that length, and an existing shorter one is extended; without it the file
    /// must exist. The device is the whole file.
    pub fn map_file(path: &Path, create_len: Option<u64>) -> Result<FastDevice> {
        let ctx = || format!("cache device {}", path.display());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create_len.is_some())
            .truncate(false)
            .open(path)
            .map_err(|e| Error::io(ctx(), e))?;
        let meta = file.metadata().map_err(|e| Error::io(ctx(), e))?;
        let mut len = meta.len();
        let device = {
            use std::os::unix::fs::FileTypeExt;
            meta.file_type().is_block_device() || meta.file_type().is_char_device()
        };
        if device {
            // A device node (/dev/pmem0, /dev/dax0.0, an NVMe namespace): its size is
            // where a seek to the end lands.
            use std::io::Seek;
            len = (&file)
                .seek(std::io::SeekFrom::End(0))
                .map_err(|e| Error::io(ctx(), e))?;
        } else if let Some(want) = create_len {
            if len < want {
                file.set_len(want).map_err(|e| Error::io(ctx(), e))?;
                len = want;
            }
        }
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: empty file", ctx()),
            ));
        }
        let map = memmap2::MmapOptions::new()
            .len(len as usize)
            .map_raw(&file)
            .map_err(|e| Error::io(ctx(), e))?;
        let inline_persist = on_tmpfs(&file);
        Ok(FastDevice {
            kind: Kind::Mapped {
                map,
                file: Arc::new(file),
                inline_persist,
            },
            len,
        })
    }

    /// Use any block device as the fast device (see the type's docs).
    pub fn block(dev: Arc<dyn BlockDevice>) -> FastDevice {
        let len = dev.geometry().size();
        FastDevice {
            kind: Kind::Block(dev),
            len,
        }
    }

    /// The device's size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the device has no bytes (never true for a device that opened).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The unit of a write that a power cut leaves whole or not at all: the block size of
    /// a block device; 64 (a cache line) for a mapped file.
    pub fn block_size(&self) -> u32 {
        match &self.kind {
            Kind::Mapped { .. } => 64,
            Kind::Block(dev) => dev.geometry().block_size(),
        }
    }

    /// Whether appends complete on the caller's thread with nothing left in flight: a
    /// mapped file whose persist is an inline `msync` (tmpfs).
    pub(crate) fn appends_inline(&self) -> bool {
        matches!(
            self.kind,
            Kind::Mapped {
                inline_persist: true,
                ..
            }
        )
    }

    /// Whether this is a mapped file (reads and appends are memory copies).
    pub fn is_mapped(&self) -> bool {
        matches!(self.kind, Kind::Mapped { .. })
    }

    fn check(&self, off: u64, len: usize) -> Result<()> {
        match off.checked_add(len as u64) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::new(
                ErrorKind::OutOfRange,
                format!(
                    "cache device access of {len} bytes at {off} past its end ({})",
                    self.len
                ),
            )),
        }
    }

    /// The mapped bytes `[off, off + len)`, for a mapped device.
    ///
    /// # Safety
    /// Nobody may write those bytes while the slice lives (the cache only writes log space
    /// that no index entry and no destage refers to).
    pub(crate) unsafe fn mapped_slice(&self, off: u64, len: usize) -> Option<&[u8]> {
        match &self.kind {
            Kind::Mapped { map, .. } if self.check(off, len).is_ok() => {
                // SAFETY: in bounds (checked); the caller guarantees no concurrent writer.
                Some(unsafe { std::slice::from_raw_parts(map.as_ptr().add(off as usize), len) })
            }
            _ => None,
        }
    }

    /// Copy `data` into the mapping at `off` (mapped devices only; no persist).
    ///
    /// # Safety
    /// Nobody may read or write those bytes at the same time.
    pub(crate) unsafe fn mapped_write(&self, off: u64, data: &[u8]) -> Result<()> {
        self.check(off, data.len())?;
        let Kind::Mapped { map, .. } = &self.kind else {
            return Err(Error::new(ErrorKind::Io, "not a mapped cache device"));
        };
        // SAFETY: in bounds (checked); the caller guarantees exclusive access.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                map.as_mut_ptr().add(off as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Make `[off, off + len)` durable: `msync` for a mapped file (synchronous, on the
    /// caller's thread), a device flush otherwise.
    pub(crate) async fn persist(&self, off: u64, len: u64) -> Result<()> {
        match &self.kind {
            Kind::Mapped {
                map,
                file,
                inline_persist,
            } => {
                self.check(off, len as usize)?;
                if *inline_persist {
                    return map
                        .flush_range(off as usize, len as usize)
                        .map_err(|e| Error::io("persisting the cache device", e));
                }
                // fdatasync writes back the mapping's dirty pages of the file: the same
                // effect as msync, on a thread that may block.
                let file = Arc::clone(file);
                tokio::task::spawn_blocking(move || file.sync_data())
                    .await
                    .map_err(|e| Error::new(ErrorKind::Io, format!("persist task failed: {e}")))?
                    .map_err(|e| Error::io("persisting the cache device", e))
            }
            Kind::Block(dev) => dev.flush().await,
        }
    }

    /// Read `len` bytes at `off`.
    pub(crate) async fn read(&self, off: u64, len: usize) -> Result<Bytes> {
        self.check(off, len)?;
        match &self.kind {
            Kind::Mapped { .. } => {
                // SAFETY: the cache reads only space it owns (see `mapped_slice`).
                let s = unsafe { self.mapped_slice(off, len) }.unwrap_or(&[]);
                Ok(Bytes::copy_from_slice(s))
            }
            Kind::Block(dev) => {
                let bs = u64::from(dev.geometry().block_size());
                let start = off / bs * bs;
                let end = (off + len as u64).div_ceil(bs) * bs;
                if start == off && end == off + len as u64 {
                    return read_chunked(dev.as_ref(), off, len).await;
                }
                let whole = read_chunked(dev.as_ref(), start, (end - start) as usize).await?;
                let from = (off - start) as usize;
                Ok(whole.slice(from..from + len))
            }
        }
    }

    /// Write `data` at `off` (not yet durable: [`persist`](Self::persist) makes it so).
    ///
    /// On a block device, blocks that `data` covers only in part are read and merged
    /// first. A torn write then leaves each such block old or new as a whole, and both
    /// hold the bytes outside `data` unchanged, so records already persisted there
    /// survive.
    pub(crate) async fn write(&self, off: u64, data: &[u8]) -> Result<()> {
        self.check(off, data.len())?;
        match &self.kind {
            // SAFETY: the cache writes only log space nobody refers to, and superblock
            // slots only from its one superblock writer.
            Kind::Mapped { .. } => unsafe { self.mapped_write(off, data) },
            Kind::Block(dev) => {
                let bs = u64::from(dev.geometry().block_size());
                let end = off + data.len() as u64;
                let (start, aend) = (off / bs * bs, end.div_ceil(bs) * bs);
                let buf = if start == off && aend == end {
                    Bytes::copy_from_slice(data)
                } else {
                    let mut buf = BytesMut::zeroed((aend - start) as usize);
                    let head = dev.read(start, bs as usize).await?;
                    buf[..bs as usize].copy_from_slice(&head);
                    if aend - bs > start {
                        let tail = dev.read(aend - bs, bs as usize).await?;
                        let at = (aend - bs - start) as usize;
                        buf[at..].copy_from_slice(&tail);
                    }
                    let at = (off - start) as usize;
                    buf[at..at + data.len()].copy_from_slice(data);
                    buf.freeze()
                };
                let max = u64::from(dev.geometry().max_io()) / bs * bs;
                let mut done = 0u64;
                while done < buf.len() as u64 {
                    let n = max.min(buf.len() as u64 - done);
                    dev.write(
                        start + done,
                        buf.slice(done as usize..(done + n) as usize),
                        IoFlags::empty(),
                    )
                    .await?;
                    done += n;
                }
                Ok(())
            }
        }
    }
}

/// Read `len` bytes at `off` from `dev` in pieces no larger than its maximum request.
pub(crate) async fn read_chunked(dev: &dyn BlockDevice, off: u64, len: usize) -> Result<Bytes> {
    let max = dev.geometry().max_io() as usize;
    if len <= max {
        return dev.read(off, len).await;
    }
    let mut out = BytesMut::with_capacity(len);
    let mut done = 0usize;
    while done < len {
        let n = max.min(len - done);
        out.extend_from_slice(&dev.read(off + done as u64, n).await?);
        done += n;
    }
    Ok(out.freeze())
}
