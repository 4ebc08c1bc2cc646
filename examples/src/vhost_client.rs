//! A vhost-user-blk front end for the benchmarks and process tests: libblkio's own
//! `virtio-blk-vhost-user` driver (the `blkio` crate), with one shared memory region for
//! every buffer.

use std::mem::MaybeUninit;
use std::path::Path;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// A started libblkio instance on a vhost-user socket, with its queues and a buffer
/// region the backend can reach.
pub struct VhostClient {
    blkio: Blkio,
    /// The queues (libblkio's `num-queues`).
    pub queues: Vec<Blkioq>,
    region: MemoryRegion,
    segment: usize,
}

impl std::fmt::Debug for VhostClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostClient")
            .field("queues", &self.queues.len())
            .field("buffer", &self.region.len)
            .finish_non_exhaustive()
    }
}

fn e(what: &str, err: blkio::Error) -> String {
    format!("libblkio {what}: {}", err.message())
}

impl VhostClient {
    /// Connect to `path` with `queues` queues and `buf_len` bytes of buffers.
    pub fn connect(path: &Path, queues: i32, buf_len: usize) -> Result<VhostClient, String> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user").map_err(|x| e("new", x))?;
        let p = path.to_str().ok_or("socket path is not UTF-8")?;
        blkio.set_str("path", p).map_err(|x| e("path", x))?;
        blkio.connect().map_err(|x| e("connect", x))?;
        blkio
            .set_i32("num-queues", queues)
            .map_err(|x| e("num-queues", x))?;
        let started = blkio.start().map_err(|x| e("start", x))?;
        let region = blkio
            .alloc_mem_region(buf_len)
            .map_err(|x| e("alloc_mem_region", x))?;
        blkio
            .map_mem_region(&region)
            .map_err(|x| e("map_mem_region", x))?;
        let segment = blkio
            .get_i32("max-segment-len")
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
            .unwrap_or(usize::MAX);
        Ok(VhostClient {
            blkio,
            queues: started.queues,
            region,
            segment,
        })
    }

    /// The device's size in bytes.
    pub fn capacity(&self) -> u64 {
        self.blkio.get_u64("capacity").unwrap_or(0)
    }

    /// The whole buffer region.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: libblkio allocated the region for this instance, `len` bytes long; it
        // stays mapped until drop frees it, and `&mut self` makes this the only slice.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// A pointer `at` bytes into the buffer region.
    pub fn ptr(&self, at: usize) -> *mut u8 {
        assert!(at <= self.region.len, "offset beyond the buffer region");
        (self.region.addr + at) as *mut u8
    }

    /// Queue a read of `len` bytes at `offset` into the buffer at `at` on queue `q`.
    pub fn submit_read(&mut self, q: usize, offset: u64, at: usize, len: usize, user: usize) {
        let p = self.ptr(at);
        self.queues[q].read(offset, p, len, user, ReqFlags::empty());
    }

    /// Queue a write of `len` bytes from the buffer at `at` to `offset` on queue `q`.
    pub fn submit_write(&mut self, q: usize, offset: u64, at: usize, len: usize, user: usize) {
        let p = self.ptr(at);
        self.queues[q].write(offset, p, len, user, ReqFlags::empty());
    }

    /// Submit what is queued on `q` and wait for at least `min` completions:
    /// `(user_data, ret)` of each (`ret` 0 or -errno).
    pub fn wait(&mut self, q: usize, min: usize) -> Result<Vec<(usize, i32)>, String> {
        let mut c: Vec<MaybeUninit<Completion>> = (0..256).map(|_| MaybeUninit::uninit()).collect();
        let n = self.queues[q]
            .do_io(&mut c, min, None, None)
            .map_err(|x| e("do_io", x))?;
        Ok(c[..n]
            .iter()
            .map(|c| {
                // SAFETY: do_io initialised the first n completions.
                let c = unsafe { c.assume_init_ref() };
                (c.user_data, c.ret)
            })
            .collect())
    }

    fn one(&mut self, what: &str, submit: impl FnOnce(&mut Blkioq)) -> Result<(), String> {
        submit(&mut self.queues[0]);
        match self.wait(0, 1)?.as_slice() {
            [(_, 0)] => Ok(()),
            [(_, r)] => Err(format!("{what} failed: errno {}", -r)),
            other => Err(format!(
                "{what}: {} completions for one request",
                other.len()
            )),
        }
    }

    /// The start of the buffer region as iovecs of at most the device's segment size.
    fn iovecs(&self, len: usize) -> Vec<blkio::iovec> {
        (0..len)
            .step_by(self.segment.min(len.max(1)))
            .map(|at| blkio::iovec {
                iov_base: self.ptr(at).cast(),
                iov_len: self.segment.min(len - at),
            })
            .collect()
    }

    /// Write `data` at `offset` (through queue 0 and the start of the buffer region).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.buf()[..data.len()].copy_from_slice(data);
        let iov = self.iovecs(data.len());
        self.one("write", |q| {
            q.writev(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty())
        })
    }

    /// Read `len` bytes at `offset` (through queue 0).
    pub fn read(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, String> {
        let iov = self.iovecs(len);
        self.one("read", |q| {
            q.readv(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty())
        })?;
        Ok(self.buf()[..len].to_vec())
    }

    /// Flush (through queue 0).
    pub fn flush(&mut self) -> Result<(), String> {
        self.one("flush", |q| q.flush(0, ReqFlags::empty()))
    }
}

impl Drop for VhostClient {
    fn drop(&mut self) {
        self.blkio.unmap_mem_region(&self.region);
        self.blkio.free_mem_region(&self.region);
    }
}
