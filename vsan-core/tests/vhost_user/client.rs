//! A vhost-user-blk front end for the tests: libblkio's `virtio-blk-vhost-user` driver
//! (the `blkio` crate), with one shared memory region for all buffers.

use std::mem::MaybeUninit;
use std::path::Path;

use blkio::{Blkio, Blkioq, Completion, MemoryRegion, ReqFlags};

/// A connected libblkio instance with `queues` queues and a buffer region.
pub struct Client {
    blkio: Blkio,
    pub queues: Vec<Blkioq>,
    region: MemoryRegion,
}

impl Client {
    /// Connect to `path` with `queues` queues and `buf_len` bytes of shared buffers.
    pub fn connect(path: &Path, queues: i32, buf_len: usize) -> blkio::Result<Client> {
        Client::connect_sized(path, queues, buf_len, None)
    }

    /// [`Client::connect`] with `queue_size` descriptors per queue instead of libblkio's
    /// default.
    pub fn connect_sized(
        path: &Path,
        queues: i32,
        buf_len: usize,
        queue_size: Option<i32>,
    ) -> blkio::Result<Client> {
        let mut blkio = Blkio::new("virtio-blk-vhost-user")?;
        blkio.set_str("path", path.to_str().expect("utf-8 path"))?;
        blkio.connect()?;
        blkio.set_i32("num-queues", queues)?;
        if let Some(size) = queue_size {
            blkio.set_i32("queue-size", size)?;
        }
        let started = blkio.start()?;
        let region = blkio.alloc_mem_region(buf_len)?;
        blkio.map_mem_region(&region)?;
        Ok(Client {
            blkio,
            queues: started.queues,
            region,
        })
    }

    /// A property of the device (`capacity`, `max-transfer`, ...).
    pub fn get_u64(&self, name: &str) -> u64 {
        self.blkio.get_u64(name).expect("property")
    }

    /// An i32 property of the device.
    pub fn get_i32(&self, name: &str) -> i32 {
        self.blkio.get_i32(name).expect("property")
    }

    /// The whole buffer region.
    pub fn buf(&mut self) -> &mut [u8] {
        // SAFETY: the region was allocated by libblkio for this instance, is `len` bytes
        // long and stays mapped until `free_mem_region` in drop; `&mut self` keeps this
        // the only slice over it while the caller holds it.
        unsafe { std::slice::from_raw_parts_mut(self.region.addr as *mut u8, self.region.len) }
    }

    /// Pointer `at` bytes into the buffer region.
    pub fn ptr(&self, at: usize) -> *mut u8 {
        assert!(at <= self.region.len);
        (self.region.addr + at) as *mut u8
    }

    /// Wait for at least `min` completions on queue `q`; (user_data, ret) of each.
    pub fn wait(&mut self, q: usize, min: usize) -> Vec<(usize, i32)> {
        let mut c: Vec<MaybeUninit<Completion>> = (0..256).map(|_| MaybeUninit::uninit()).collect();
        let n = self.queues[q]
            .do_io(&mut c, min, None, None)
            .expect("do_io");
        c[..n]
            .iter()
            .map(|c| {
                // SAFETY: do_io initialised the first n completions.
                let c = unsafe { c.assume_init_ref() };
                (c.user_data, c.ret)
            })
            .collect()
    }

    /// Run one request on queue 0 and return its result (0 or -errno).
    pub fn one(&mut self, submit: impl FnOnce(&mut Blkioq, *mut u8)) -> i32 {
        let p = self.ptr(0);
        submit(&mut self.queues[0], p);
        let done = self.wait(0, 1);
        assert_eq!(done.len(), 1);
        done[0].1
    }

    /// The buffer at the start of the region as iovecs no longer than the device's
    /// `max-segment-len`, as a driver must split it.
    fn iovecs(&self, len: usize) -> Vec<blkio::iovec> {
        let seg = usize::try_from(self.get_i32("max-segment-len")).expect("segment length");
        (0..len)
            .step_by(seg)
            .map(|at| blkio::iovec {
                iov_base: self.ptr(at).cast(),
                iov_len: seg.min(len - at),
            })
            .collect()
    }

    /// Write `data` at `offset` through queue 0 (via the start of the buffer region).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> i32 {
        self.buf()[..data.len()].copy_from_slice(data);
        let iov = self.iovecs(data.len());
        self.one(|q, _| q.writev(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty()))
    }

    /// Read `len` bytes at `offset` through queue 0.
    pub fn read(&mut self, offset: u64, len: usize) -> Result<Vec<u8>, i32> {
        let iov = self.iovecs(len);
        let r =
            self.one(|q, _| q.readv(offset, iov.as_ptr(), iov.len() as u32, 0, ReqFlags::empty()));
        if r != 0 {
            return Err(r);
        }
        Ok(self.buf()[..len].to_vec())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.blkio.unmap_mem_region(&self.region);
        self.blkio.free_mem_region(&self.region);
    }
}
