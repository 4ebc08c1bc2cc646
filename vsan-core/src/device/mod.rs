//! The block device abstraction every layer of vsan implements and consumes.
//!
//! ```text
//!            Arc<dyn BlockDevice>           (what callers hold)
//!                      ^
//!     +----------------+-----------------+-------------------+
//!     |                |                 |                   |
//! MemDevice       FileDevice      FaultyDevice<D>     (later: WriteBackCache,
//! (RAM, sparse)   (file / blkdev)  (test-utils)        MirroredDisk)
//! ```
//!
//! The contract every implementation keeps:
//! - methods take `&self` and the type is `Send + Sync`, so one device serves many
//!   connections and tasks at once through an `Arc`;
//! - buffers are owned (`Bytes` in, `Bytes` out), so the same buffer can go to a local disk
//!   and a network link without a copy;
//! - every operation first passes [`Geometry::validate`]: misaligned, zero-length,
//!   oversized or out-of-range requests fail with [`ErrorKind::InvalidArgument`] or
//!   [`ErrorKind::OutOfRange`] and change nothing;
//! - a write that completed before `flush` was called is durable when `flush` completes;
//!   a write with [`IoFlags::FUA`] is durable when it completes;
//! - after `discard` or `write_zeroes` the range reads back as zeros;
//! - a device that loses data it had acknowledged (a write-back cache whose fast device
//!   failed) says so through [`BlockDevice::data_loss_count`] before anything it
//!   completes can show the loss.

use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;

use crate::error::{Error, ErrorKind, Result};

mod file;
mod mem;

#[cfg(feature = "test-utils")]
mod faulty;

pub use file::{FileDevice, FileOptions};
pub use mem::MemDevice;

#[cfg(feature = "test-utils")]
pub use faulty::{FaultConfig, FaultyDevice, OpKind, PowerCut};

/// The future every [`BlockDevice`] operation returns: boxed so the trait stays usable as
/// `dyn BlockDevice`, `Send` so it can be driven by any runtime thread.
pub type IoFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// The largest single read or write a device accepts by default (32 MiB, what NBD clients
/// commonly assume).
pub const DEFAULT_MAX_IO: u32 = 32 << 20;

/// The shape of a device: its size, the unit every request is aligned to, and the largest
/// read or write it accepts in one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    size: u64,
    block_size: u32,
    max_io: u32,
}

/// Which operation a request is, for validation and error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A read.
    Read,
    /// A write.
    Write,
    /// A discard (trim).
    Discard,
    /// A write of zeroes.
    WriteZeroes,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Discard => "discard",
            Op::WriteZeroes => "write_zeroes",
        }
    }
}

impl Geometry {
    /// A geometry of `size` bytes in blocks of `block_size` bytes, with the default maximum
    /// request size.
    ///
    /// `block_size` must be a power of two from 512 to 65536, and `size` a non-zero
    /// multiple of it.
    pub fn new(size: u64, block_size: u32) -> Result<Geometry> {
        Geometry::with_max_io(size, block_size, DEFAULT_MAX_IO)
    }

    /// Like [`Geometry::new`] with an explicit maximum request size, itself a multiple of
    /// `block_size`.
    pub fn with_max_io(size: u64, block_size: u32, max_io: u32) -> Result<Geometry> {
        if !block_size.is_power_of_two() || !(512..=65536).contains(&block_size) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("block size {block_size} is not a power of two from 512 to 65536"),
            ));
        }
        if size == 0 || size % u64::from(block_size) != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("size {size} is not a non-zero multiple of the block size {block_size}"),
            ));
        }
        if max_io < block_size || max_io % block_size != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("maximum I/O {max_io} is not a multiple of the block size {block_size}"),
            ));
        }
        Ok(Geometry {
            size,
            block_size,
            max_io,
        })
    }

    /// Size of the device in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The logical block size: every offset and length is a multiple of it.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The largest read or write accepted in one request, in bytes.
    pub fn max_io(&self) -> u32 {
        self.max_io
    }

    /// The one validation path for every operation on every device.
    ///
    /// Checks, in order: non-zero length, the maximum request size (reads and writes only;
    /// discard and write_zeroes carry no payload), alignment of offset and length to the
    /// block size, and that the range lies inside the device.
    pub fn validate(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        let what = || format!("{} of {len} bytes at offset {offset}", op.name());
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: zero length", what()),
            ));
        }
        if matches!(op, Op::Read | Op::Write) && len > u64::from(self.max_io) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "{}: larger than the maximum request of {} bytes",
                    what(),
                    self.max_io
                ),
            ));
        }
        let bs = u64::from(self.block_size);
        if offset % bs != 0 || len % bs != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: not aligned to the block size {bs}", what()),
            ));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::new(
                ErrorKind::OutOfRange,
                format!(
                    "{}: beyond the end of the device ({} bytes)",
                    what(),
                    self.size
                ),
            )),
        }
    }
}

/// Flags that change how a write is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct IoFlags(u32);

impl IoFlags {
    /// Force unit access: the write is durable when it completes, as if a flush of just
    /// this write followed it.
    pub const FUA: IoFlags = IoFlags(1);

    /// No flags.
    pub const fn empty() -> IoFlags {
        IoFlags(0)
    }

    /// Whether every flag in `other` is set in `self`.
    pub const fn contains(self, other: IoFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits, for wire formats.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw bits; unknown bits are an error rather than silently dropped.
    pub fn from_bits(bits: u32) -> Result<IoFlags> {
        if bits & !IoFlags::FUA.0 != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("unknown I/O flags {bits:#x}"),
            ));
        }
        Ok(IoFlags(bits))
    }
}

impl std::ops::BitOr for IoFlags {
    type Output = IoFlags;
    fn bitor(self, rhs: IoFlags) -> IoFlags {
        IoFlags(self.0 | rhs.0)
    }
}

/// A virtual disk: the one interface every layer of vsan implements.
///
/// See the [module docs](self) for the contract.
pub trait BlockDevice: Send + Sync {
    /// Size, block size and maximum request of the device.
    fn geometry(&self) -> Geometry;

    /// Read `len` bytes at `offset`.
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes>;

    /// Write `data` at `offset`. With [`IoFlags::FUA`] the data is durable on completion.
    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()>;

    /// [`write`](Self::write) carried out at once on the calling thread, where this
    /// device can do that cheaply (a buffered write into the page cache), without a
    /// future; `None` where it cannot (the caller then uses `write`, and nothing was
    /// done). A caller that issues many small writes (the mirror's driver) saves a
    /// boxed future and a poll per write. By default, `None`, which is always correct: a
    /// device that wraps another and does something in `write` (counts, injects faults,
    /// caches) must not forward this call to the inner device without doing the same
    /// here, or writes would bypass it.
    fn try_write_now(&self, offset: u64, data: &Bytes, flags: IoFlags) -> Option<Result<()>> {
        let _ = (offset, data, flags);
        None
    }

    /// Make every write that completed before this call durable.
    fn flush(&self) -> IoFuture<'_, ()>;

    /// Deallocate a range; it reads back as zeros afterwards. With [`IoFlags::FUA`] that
    /// is durable on completion.
    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()>;

    /// Write zeros over a range; with [`IoFlags::FUA`] durable on completion.
    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()>;

    /// [`read`](Self::read) for a pass over the disk that reads each range once (a
    /// resync or verify): a device with a cache should not let it push out what the
    /// application keeps there, nor keep what the pass brought in. Returns what `read`
    /// would. By default, `read`.
    fn read_once(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        self.read(offset, len)
    }

    /// How many times this device has lost data it had already acknowledged (a
    /// write-back cache whose fast device failed with dirty data on it, say). It only
    /// grows. After it grows, reads may return older data for some blocks, with no
    /// error: a layer above that holds a copy of the data elsewhere (a mirror's peer)
    /// should resync this device from it, and must not trust reads of it until then.
    ///
    /// A device bumps it *before* it completes any operation that could observe the
    /// loss, so a caller that reads it after an operation completes knows whether that
    /// operation's result may be affected. By default 0: the device never loses
    /// acknowledged data.
    fn data_loss_count(&self) -> u64 {
        0
    }
}

/// A future that is already complete; what synchronous devices return.
pub(crate) fn ready<'a, T: Send + 'a>(r: Result<T>) -> IoFuture<'a, T> {
    Box::pin(std::future::ready(r))
}

/// [`ready`] for an operation with no result: a success costs no allocation (its
/// future is zero-sized), which matters on the path of every page-cache write.
pub(crate) fn done<'a>(r: Result<()>) -> IoFuture<'a, ()> {
    /// `Ok(())` at once; zero-sized, so its box allocates nothing.
    struct Done;
    impl Future for Done {
        type Output = Result<()>;
        fn poll(
            self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }
    match r {
        Ok(()) => Box::pin(Done),
        Err(e) => ready(Err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_rejects_bad_shapes() {
        assert_eq!(
            Geometry::new(0, 512).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            Geometry::new(1000, 512).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            Geometry::new(4096, 1000).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            Geometry::new(4096, 256).unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        assert!(Geometry::new(4096, 4096).is_ok());
    }

    #[test]
    fn validate_classes() {
        let g = Geometry::with_max_io(1 << 20, 512, 64 << 10).unwrap();
        assert!(g.validate(Op::Write, 0, 512).is_ok());
        assert!(g.validate(Op::Write, (1 << 20) - 512, 512).is_ok());
        let kind = |op, off, len| g.validate(op, off, len).unwrap_err().kind();
        assert_eq!(kind(Op::Write, 0, 0), ErrorKind::InvalidArgument);
        assert_eq!(kind(Op::Write, 1, 512), ErrorKind::InvalidArgument);
        assert_eq!(kind(Op::Read, 0, 513), ErrorKind::InvalidArgument);
        assert_eq!(kind(Op::Read, 0, 128 << 10), ErrorKind::InvalidArgument);
        assert_eq!(kind(Op::Write, 1 << 20, 512), ErrorKind::OutOfRange);
        assert_eq!(kind(Op::Write, u64::MAX - 511, 512), ErrorKind::OutOfRange);
        // discard has no payload, so no maximum; the range check still applies.
        assert!(g.validate(Op::Discard, 0, 1 << 20).is_ok());
        assert_eq!(kind(Op::Discard, 512, 1 << 20), ErrorKind::OutOfRange);
    }

    #[test]
    fn flags_reject_unknown_bits() {
        assert_eq!(IoFlags::from_bits(1).unwrap(), IoFlags::FUA);
        assert!(IoFlags::from_bits(2).is_err());
        assert!((IoFlags::empty() | IoFlags::FUA).contains(IoFlags::FUA));
    }
}
