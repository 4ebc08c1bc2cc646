//! `FileDevice`: a regular file or a block device as a [`BlockDevice`].
//!
//! Buffered reads and writes go to the page cache and complete inline on the calling
//! thread (a `pread`/`pwrite` of a few KiB is cheaper than handing it to another thread).
//! Everything that waits for the disk (flush, FUA, O_DIRECT I/O, hole punching) runs on
//! tokio's blocking pool when called inside a runtime, so a slow disk never stalls the
//! async workers. `flush` is `fdatasync`. With O_DIRECT the page cache is bypassed and
//! data goes through an aligned bounce buffer.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rustix::fs::FallocateFlags;

use super::{BlockDevice, Geometry, IoFlags, IoFuture, Op, done, ready};
use crate::error::{Error, ErrorKind, Result};

/// Alignment used for O_DIRECT buffers (covers 512 and 4096-byte logical sectors).
const DIRECT_ALIGN: usize = 4096;

/// How to open or create a [`FileDevice`].
#[derive(Debug, Clone)]
pub struct FileOptions {
    block_size: u32,
    direct: bool,
    size: Option<u64>,
}

impl Default for FileOptions {
    fn default() -> FileOptions {
        FileOptions {
            block_size: 512,
            direct: false,
            size: None,
        }
    }
}

impl FileOptions {
    /// Defaults: 512-byte blocks, buffered I/O, open an existing file at its current size.
    pub fn new() -> FileOptions {
        FileOptions::default()
    }

    /// The logical block size requests must be aligned to.
    pub fn block_size(mut self, block_size: u32) -> FileOptions {
        self.block_size = block_size;
        self
    }

    /// Open with O_DIRECT, bypassing the page cache.
    pub fn direct(mut self, direct: bool) -> FileOptions {
        self.direct = direct;
        self
    }

    /// Create the file with this size if it does not exist; if it exists, its size must be
    /// exactly this (an existing image is never silently grown or truncated).
    pub fn create(mut self, size: u64) -> FileOptions {
        self.size = Some(size);
        self
    }

    /// Open (or create) `path`.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<FileDevice> {
        FileDevice::open_with(path.as_ref(), self)
    }
}

struct Inner {
    file: File,
    path: PathBuf,
    geometry: Geometry,
    direct: bool,
    block_device: bool,
    /// Bytes `forget` was told about per [`FORGET_WINDOW`]-aligned window, until the
    /// whole window is covered and dropped at once.
    forgotten: parking_lot::Mutex<std::collections::HashMap<u64, u64>>,
}

/// The page cache keeps large folios (up to 2 MiB): dropping a range smaller than its
/// folio drops nothing, so `forget` drops whole windows of this size once all of one
/// has been forgotten.
const FORGET_WINDOW: u64 = 2 << 20;

/// A block device backed by a regular file or a host block device.
#[derive(Clone)]
pub struct FileDevice {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for FileDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileDevice")
            .field("path", &self.inner.path)
            .field("geometry", &self.inner.geometry)
            .field("direct", &self.inner.direct)
            .finish()
    }
}

impl FileDevice {
    /// Open an existing file or block device with default options; its size must be a
    /// multiple of 512.
    pub fn open(path: impl AsRef<Path>) -> Result<FileDevice> {
        FileOptions::new().open(path)
    }

    fn open_with(path: &Path, opts: &FileOptions) -> Result<FileDevice> {
        let ctx = |what: &str| format!("{what} {}", path.display());
        if let Some(want) = opts.size {
            // Check the shape before anything touches the file system.
            Geometry::new(want, opts.block_size).map_err(|e| e.context_prefix(path.display()))?;
        }
        let mut oo = OpenOptions::new();
        oo.read(true).write(true);
        if opts.direct {
            oo.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
        }
        // Only a file this call creates is sized; an existing one must already fit.
        let (mut file, created) = match oo.open(path) {
            Ok(f) => (f, false),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && opts.size.is_some() => {
                let f = oo
                    .clone()
                    .create_new(true)
                    .open(path)
                    .map_err(|e| Error::io(ctx("create"), e))?;
                (f, true)
            }
            Err(e) => return Err(Error::io(ctx("open"), e)),
        };
        let meta = file.metadata().map_err(|e| Error::io(ctx("stat"), e))?;
        let block_device = meta.file_type().is_block_device();
        let current = if block_device {
            file.seek(SeekFrom::End(0))
                .map_err(|e| Error::io(ctx("size of"), e))?
        } else {
            meta.len()
        };
        let size = match opts.size {
            Some(want) if created => {
                if let Err(e) = file.set_len(want) {
                    let _ = std::fs::remove_file(path);
                    return Err(Error::io(ctx("set size of"), e));
                }
                want
            }
            Some(want) if want != current => {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "existing image {} is {current} bytes, not the configured {want} bytes",
                        path.display()
                    ),
                ));
            }
            _ => current,
        };
        let geometry =
            Geometry::new(size, opts.block_size).map_err(|e| e.context_prefix(path.display()))?;
        let inner = Inner {
            file,
            path: path.to_owned(),
            geometry,
            direct: opts.direct,
            block_device,
            forgotten: parking_lot::Mutex::new(std::collections::HashMap::new()),
        };
        if opts.direct {
            // O_DIRECT needs requests aligned to the device's own sector or file system
            // block; find out now rather than on the first misaligned request.
            inner.read_at(0, opts.block_size as usize).map_err(|e| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{}: O_DIRECT refuses {}-byte blocks here ({e}); use a larger block_size",
                        path.display(),
                        opts.block_size
                    ),
                )
            })?;
        }
        Ok(FileDevice {
            inner: Arc::new(inner),
        })
    }

    /// The path this device was opened from.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

impl Inner {
    /// Count `[offset, offset + len)` as read once; drop each [`FORGET_WINDOW`] from the
    /// page cache once all of it has been.
    fn forget(&self, offset: u64, len: u64) {
        let size = self.geometry.size();
        let end = offset.saturating_add(len).min(size);
        let mut ready = Vec::new();
        {
            let mut windows = self.forgotten.lock();
            let mut at = offset;
            while at < end {
                let w = at / FORGET_WINDOW;
                let w_end = ((w + 1) * FORGET_WINDOW).min(size);
                let piece = end.min(w_end) - at;
                let got = windows.entry(w).or_insert(0);
                *got += piece;
                if *got >= w_end - w * FORGET_WINDOW {
                    windows.remove(&w);
                    ready.push((w * FORGET_WINDOW, w_end - w * FORGET_WINDOW));
                }
                at += piece;
            }
        }
        for (from, n) in ready {
            let _ = rustix::fs::fadvise(
                &self.file,
                from,
                std::num::NonZeroU64::new(n),
                rustix::fs::Advice::DontNeed,
            );
        }
    }

    fn sync(&self) -> Result<()> {
        rustix::fs::fdatasync(&self.file)
            .map_err(|e| Error::io(format!("fdatasync {}", self.path.display()), e.into()))
    }

    fn read_at(&self, offset: u64, len: usize) -> Result<Bytes> {
        let ctx = || {
            format!(
                "read of {len} bytes at {offset} from {}",
                self.path.display()
            )
        };
        if self.direct {
            let mut bounce = AlignedBuf::new(len);
            self.file
                .read_exact_at(bounce.as_mut(), offset)
                .map_err(|e| Error::io(ctx(), e))?;
            return Ok(Bytes::copy_from_slice(bounce.as_mut()));
        }
        let mut buf = BytesMut::zeroed(len);
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(|e| Error::io(ctx(), e))?;
        Ok(buf.freeze())
    }

    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let ctx = || {
            format!(
                "write of {} bytes at {offset} to {}",
                data.len(),
                self.path.display()
            )
        };
        if self.direct {
            let mut bounce = AlignedBuf::new(data.len());
            bounce.as_mut().copy_from_slice(data);
            self.file
                .write_all_at(bounce.as_mut(), offset)
                .map_err(|e| Error::io(ctx(), e))?;
        } else {
            self.file
                .write_all_at(data, offset)
                .map_err(|e| Error::io(ctx(), e))?;
        }
        if fua { self.sync() } else { Ok(()) }
    }

    /// Zero a range: punch a hole (discard) or zero it in place, falling back to writing
    /// zeros where the file system or device cannot do either.
    fn zero_range(&self, offset: u64, len: u64, punch: bool, fua: bool) -> Result<()> {
        let modes: &[FallocateFlags] = if punch {
            &[FallocateFlags::PUNCH_HOLE.union(FallocateFlags::KEEP_SIZE)]
        } else if self.block_device {
            &[FallocateFlags::ZERO_RANGE.union(FallocateFlags::KEEP_SIZE)]
        } else {
            &[
                FallocateFlags::ZERO_RANGE.union(FallocateFlags::KEEP_SIZE),
                FallocateFlags::PUNCH_HOLE.union(FallocateFlags::KEEP_SIZE),
            ]
        };
        let mut done = false;
        for mode in modes {
            if rustix::fs::fallocate(&self.file, *mode, offset, len).is_ok() {
                done = true;
                break;
            }
        }
        if !done {
            let chunk = vec![0u8; (1usize << 20).min(len as usize)];
            let mut pos = 0u64;
            while pos < len {
                let n = chunk.len().min((len - pos) as usize);
                self.write_at(offset + pos, &chunk[..n], false)?;
                pos += n as u64;
            }
        }
        if fua { self.sync() } else { Ok(()) }
    }
}

/// Run `f` on tokio's blocking pool when inside a runtime, inline otherwise.
fn blocking<'a, T, F>(inner: &Arc<Inner>, f: F) -> IoFuture<'a, T>
where
    T: Send + 'static,
    F: FnOnce(&Inner) -> Result<T> + Send + 'static,
{
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            let inner = Arc::clone(inner);
            let task = handle.spawn_blocking(move || f(&inner));
            Box::pin(async move {
                task.await
                    .map_err(|e| Error::with_source(ErrorKind::Io, "blocking I/O task failed", e))?
            })
        }
        Err(_) => ready(f(inner)),
    }
}

impl BlockDevice for FileDevice {
    fn geometry(&self) -> Geometry {
        self.inner.geometry
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        if let Err(e) = self.inner.geometry.validate(Op::Read, offset, len as u64) {
            return ready(Err(e));
        }
        if self.inner.direct {
            return blocking(&self.inner, move |i| i.read_at(offset, len));
        }
        ready(self.inner.read_at(offset, len))
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        if let Some(r) = self.try_write_now(offset, &data, flags) {
            return done(r);
        }
        if let Err(e) = self
            .inner
            .geometry
            .validate(Op::Write, offset, data.len() as u64)
        {
            return ready(Err(e));
        }
        let fua = flags.contains(IoFlags::FUA);
        blocking(&self.inner, move |i| i.write_at(offset, &data, fua))
    }

    /// Buffered writes without FUA (a `pwrite` into the page cache), and their requests
    /// that fail validation; O_DIRECT and FUA writes wait for the disk, on the blocking
    /// pool, so this leaves them (validation included) to `write`: a caller that falls
    /// back to `write` (the mirror's driver) has them checked once.
    fn try_write_now(&self, offset: u64, data: &Bytes, flags: IoFlags) -> Option<Result<()>> {
        if self.inner.direct || flags.contains(IoFlags::FUA) {
            return None;
        }
        Some(
            self.inner
                .geometry
                .validate(Op::Write, offset, data.len() as u64)
                .and_then(|()| self.inner.write_at(offset, data, false)),
        )
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        blocking(&self.inner, |i| i.sync())
    }

    /// A range that is all hole (`SEEK_DATA` finds no data in it, which counts dirty
    /// cached pages as data) reads as zeros without touching the page cache; data already
    /// in the page cache is read from it and stays (`preadv2` with `RWF_NOWAIT`);
    /// anything else is read normally and then dropped from the cache
    /// (`POSIX_FADV_DONTNEED`, a 2 MiB window at a time). Besides leaving the
    /// application's cached pages alone, this matters for sparse images: pages read from
    /// holes and left cached make later small writes into them several times slower on
    /// ext4.
    fn read_once(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        if let Err(e) = self.inner.geometry.validate(Op::Read, offset, len as u64) {
            return ready(Err(e));
        }
        if self.inner.direct {
            return self.read(offset, len);
        }
        let mut buf = BytesMut::zeroed(len);
        if !self.inner.block_device {
            let end = offset + len as u64;
            // A file cut short behind our back is not a hole: `read` reports it.
            let whole = self.inner.file.metadata().is_ok_and(|m| m.len() >= end);
            match rustix::fs::seek(&self.inner.file, rustix::fs::SeekFrom::Data(offset)) {
                Ok(data) if whole && data >= end => return ready(Ok(buf.freeze())),
                Err(rustix::io::Errno::NXIO) if whole => return ready(Ok(buf.freeze())),
                _ => {}
            }
        }
        let cached = {
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            rustix::io::preadv2(
                &self.inner.file,
                &mut iov,
                offset,
                rustix::io::ReadWriteFlags::NOWAIT,
            )
        };
        if matches!(cached, Ok(n) if n == len) {
            return ready(Ok(buf.freeze()));
        }
        let r = self.inner.read_at(offset, len);
        self.inner.forget(offset, len as u64);
        ready(r)
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        if let Err(e) = self.inner.geometry.validate(Op::Discard, offset, len) {
            return ready(Err(e));
        }
        let fua = flags.contains(IoFlags::FUA);
        blocking(&self.inner, move |i| i.zero_range(offset, len, true, fua))
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        if let Err(e) = self.inner.geometry.validate(Op::WriteZeroes, offset, len) {
            return ready(Err(e));
        }
        let fua = flags.contains(IoFlags::FUA);
        blocking(&self.inner, move |i| i.zero_range(offset, len, false, fua))
    }
}

/// A heap buffer whose start is aligned for O_DIRECT, carved out of a larger `Vec` so no
/// unsafe allocation is needed.
struct AlignedBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let storage = vec![0u8; len + DIRECT_ALIGN];
        let start = storage.as_ptr().align_offset(DIRECT_ALIGN);
        AlignedBuf {
            storage,
            start,
            len,
        }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}
