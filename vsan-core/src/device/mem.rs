//! `MemDevice`: a sparse RAM disk for tests, simulation and `backing = "mem"` disks.
//!
//! Storage is split into 64 KiB segments, each behind its own lock and allocated on first
//! write, so a large device costs memory only for what was written and concurrent I/O to
//! different segments never contends. Everything is "durable" at once; flush is a no-op.

use bytes::{Bytes, BytesMut};
use parking_lot::RwLock;

use super::{BlockDevice, Geometry, IoFlags, IoFuture, Op, done, ready};
use crate::error::Result;

const SEGMENT: usize = 64 << 10;

/// One segment: `None` until first written (reads as zeros).
type Segment = RwLock<Option<Box<[u8]>>>;

/// A sparse in-memory block device.
pub struct MemDevice {
    geometry: Geometry,
    segments: Box<[Segment]>,
}

impl std::fmt::Debug for MemDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemDevice")
            .field("geometry", &self.geometry)
            .finish_non_exhaustive()
    }
}

impl MemDevice {
    /// A zero-filled device with the given geometry.
    pub fn new(geometry: Geometry) -> MemDevice {
        let n = geometry.size().div_ceil(SEGMENT as u64) as usize;
        let segments = (0..n).map(|_| RwLock::new(None)).collect();
        MemDevice { geometry, segments }
    }

    /// Bytes of RAM currently holding data (allocated segments).
    pub fn allocated_bytes(&self) -> u64 {
        self.segments.iter().filter(|s| s.read().is_some()).count() as u64 * SEGMENT as u64
    }

    /// Visit the (segment, offset-in-segment, length, position-in-request) pieces of a range.
    fn pieces(offset: u64, len: u64, mut f: impl FnMut(usize, usize, usize, usize)) {
        let mut pos = 0u64;
        while pos < len {
            let abs = offset + pos;
            let seg = (abs / SEGMENT as u64) as usize;
            let within = (abs % SEGMENT as u64) as usize;
            let n = (SEGMENT - within).min((len - pos) as usize);
            f(seg, within, n, pos as usize);
            pos += n as u64;
        }
    }

    fn read_sync(&self, offset: u64, len: usize) -> Result<Bytes> {
        self.geometry.validate(Op::Read, offset, len as u64)?;
        let mut out = BytesMut::zeroed(len);
        Self::pieces(offset, len as u64, |seg, within, n, pos| {
            if let Some(data) = self.segments[seg].read().as_deref() {
                out[pos..pos + n].copy_from_slice(&data[within..within + n]);
            }
        });
        Ok(out.freeze())
    }

    fn write_sync(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.geometry
            .validate(Op::Write, offset, data.len() as u64)?;
        Self::pieces(offset, data.len() as u64, |seg, within, n, pos| {
            let mut slot = self.segments[seg].write();
            let buf = slot.get_or_insert_with(|| vec![0u8; SEGMENT].into_boxed_slice());
            buf[within..within + n].copy_from_slice(&data[pos..pos + n]);
        });
        Ok(())
    }

    fn zero_sync(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        self.geometry.validate(op, offset, len)?;
        Self::pieces(offset, len, |seg, within, n, _| {
            let mut slot = self.segments[seg].write();
            if n == SEGMENT {
                *slot = None; // a whole segment: give the memory back
            } else if let Some(buf) = slot.as_deref_mut() {
                buf[within..within + n].fill(0);
            }
        });
        Ok(())
    }
}

impl BlockDevice for MemDevice {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        ready(self.read_sync(offset, len))
    }

    fn write(&self, offset: u64, data: Bytes, _flags: IoFlags) -> IoFuture<'_, ()> {
        done(self.write_sync(offset, &data))
    }

    /// Always at once (memory is as durable as this device gets).
    fn try_write_now(&self, offset: u64, data: &Bytes, _flags: IoFlags) -> Option<Result<()>> {
        Some(self.write_sync(offset, data))
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        done(Ok(()))
    }

    fn discard(&self, offset: u64, len: u64, _flags: IoFlags) -> IoFuture<'_, ()> {
        ready(self.zero_sync(Op::Discard, offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: IoFlags) -> IoFuture<'_, ()> {
        ready(self.zero_sync(Op::WriteZeroes, offset, len))
    }
}
