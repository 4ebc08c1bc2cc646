//! A hostile guest: a vhost-user front end (the `vhost` crate's `Frontend`) over a memfd
//! of guest memory whose descriptors this test writes by hand, so that every malformed
//! chain a guest could build reaches the backend.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;

/// Guest memory size.
pub const MEM: u64 = 4 << 20;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
/// The first byte free for buffers.
pub const BUFS: u64 = 0x10000;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_INDIRECT: u16 = 4;

/// One queue of a hand-driven front end.
pub struct Guest {
    _frontend: Frontend,
    _file: File,
    mem: MmapMut,
    kick: EventFd,
    _call: EventFd,
    size: u16,
    avail_idx: u16,
    used_seen: u16,
}

/// A descriptor as the guest writes it.
#[derive(Clone, Copy, Debug)]
pub struct D {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

impl Guest {
    /// Connect to `path` and set up queue 0 of `size` descriptors (no event-idx, with
    /// indirect descriptors).
    pub fn connect(path: &Path, size: u16) -> Guest {
        let file = memfd();
        file.set_len(MEM).unwrap();
        // SAFETY: the memfd is ours, sized above, and only this test maps it (besides
        // the backend, which is the point).
        let mem = unsafe { MmapMut::map_mut(&file) }.unwrap();
        let mut fe = Frontend::connect(path, 1).unwrap();
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        let want = features
            & ((1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1)
                | (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC)
                | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
                | 0x7fff);
        fe.set_features(want).unwrap();
        let proto = fe.get_protocol_features().unwrap();
        fe.set_protocol_features(
            proto & (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ),
        )
        .unwrap();
        use std::os::fd::AsRawFd;
        fe.set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: MEM,
            userspace_addr: mem.as_ptr() as u64,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        }])
        .unwrap();
        fe.set_vring_num(0, size).unwrap();
        // Ring addresses travel in the front end's own address space (the backend
        // translates them through the memory table); buffers in guest addresses.
        let va = mem.as_ptr() as u64;
        fe.set_vring_addr(
            0,
            &VringConfigData {
                queue_max_size: size,
                queue_size: size,
                flags: 0,
                desc_table_addr: va + DESC,
                used_ring_addr: va + USED,
                avail_ring_addr: va + AVAIL,
                log_addr: None,
            },
        )
        .unwrap();
        fe.set_vring_base(0, 0).unwrap();
        let call = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        fe.set_vring_call(0, &call).unwrap();
        fe.set_vring_kick(0, &kick).unwrap();
        fe.set_vring_enable(0, true).unwrap();
        Guest {
            _frontend: fe,
            _file: file,
            mem,
            kick,
            _call: call,
            size,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    pub fn put(&mut self, at: u64, bytes: &[u8]) {
        self.mem[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    }

    pub fn get(&self, at: u64, len: usize) -> Vec<u8> {
        self.mem[at as usize..at as usize + len].to_vec()
    }

    /// Write descriptor `i` of the table at `table`.
    pub fn desc_at(&mut self, table: u64, i: u16, d: D) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&d.addr.to_le_bytes());
        b[8..12].copy_from_slice(&d.len.to_le_bytes());
        b[12..14].copy_from_slice(&d.flags.to_le_bytes());
        b[14..16].copy_from_slice(&d.next.to_le_bytes());
        self.put(table + 16 * u64::from(i), &b);
    }

    /// Write descriptor `i` of the queue's table.
    pub fn desc(&mut self, i: u16, d: D) {
        self.desc_at(DESC, i, d);
    }

    /// A request header at `at`.
    pub fn header(&mut self, at: u64, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.put(at, &h);
    }

    /// Offer the chain at `head` and kick.
    pub fn submit(&mut self, head: u16) {
        self.submit_raw(head, 1);
    }

    /// Put `head` in the next avail slot and advance the avail index by `advance`
    /// (a hostile guest may advance it by more than it filled).
    pub fn submit_raw(&mut self, head: u16, advance: u16) {
        let slot = AVAIL + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.put(slot, &head.to_le_bytes());
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(advance);
        let idx = self.avail_idx;
        self.put(AVAIL + 2, &idx.to_le_bytes());
        fence(Ordering::SeqCst);
        self.kick.write(1).unwrap();
    }

    fn used_idx(&self) -> u16 {
        fence(Ordering::SeqCst);
        u16::from_le_bytes(self.get(USED + 2, 2).try_into().unwrap())
    }

    /// Wait for the next used element: (id, len), or None after `timeout`.
    pub fn wait_used(&mut self, timeout: Duration) -> Option<(u32, u32)> {
        let deadline = Instant::now() + timeout;
        while self.used_idx() == self.used_seen {
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let e = USED + 4 + 8 * u64::from(self.used_seen % self.size);
        self.used_seen = self.used_seen.wrapping_add(1);
        let b = self.get(e, 8);
        Some((
            u32::from_le_bytes(b[0..4].try_into().unwrap()),
            u32::from_le_bytes(b[4..8].try_into().unwrap()),
        ))
    }
}

fn memfd() -> File {
    let fd = rustix::fs::memfd_create("vsan-hostile-guest", rustix::fs::MemfdFlags::CLOEXEC)
        .expect("memfd_create");
    File::from(fd)
}
