//! The `VhostUserBackend` of one front-end connection: config space, features, and the
//! per-queue worker that turns descriptor chains into `BlockDevice` calls.
//!
//! Each queue has its own worker thread (the vhost-user-backend crate's epoll loop). The
//! worker pops chains, parses them ([`virtio::parse`]), and runs each request's future
//! *on the worker thread itself*, in a per-queue `FuturesUnordered`: a device that
//! completes at once (a memory disk, a cached read) completes without any thread
//! hand-off; a device that waits (the mirror waiting for its peer) wakes the worker
//! through an eventfd registered on the same epoll. Requests complete in any order;
//! each completion is added to the used ring and the guest is signalled once per batch,
//! as event-idx allows.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, Stream};
use parking_lot::{Condvar, Mutex};
use tracing::{debug, info, warn};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk as blk;
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{
    GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use super::virtio::{self, Limits, Op, Parsed, Request, Seg};
use super::{Shared, VhostUserOptions};
use crate::{BlockDevice, IoFlags};

type Mem = GuestMemoryAtomic<GuestMemoryMmap>;
type Done = (u16, u32);
type Work = Pin<Box<dyn std::future::Future<Output = Done> + Send>>;

/// Chains refused per queue and connection that are logged at `warn`; the rest at
/// `debug` (a hostile guest must not flood the log).
const BAD_CHAIN_WARNINGS: u64 = 8;

/// Wakes a queue's worker: an eventfd on its epoll, written once per arming.
struct FdWaker {
    notifier: EventNotifier,
    armed: AtomicBool,
}

impl Wake for FdWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            let _ = self.notifier.notify();
        }
    }
}

/// One queue of one connection.
struct Queue {
    index: u16,
    work: Mutex<FuturesUnordered<Work>>,
    waker: Arc<FdWaker>,
    consumer: EventConsumer,
    in_flight: Mutex<usize>,
    idle: Condvar,
    bad_logged: AtomicU64,
    /// The guest published an avail index more than a ring ahead: the queue is broken
    /// until the front end resets it (a new connection), and ignored meanwhile.
    broken: AtomicBool,
}

/// The backend of one front-end connection (the vhost-user-backend crate's handler and
/// workers hold clones of it). Dropped, with its queues, when the connection ends.
#[derive(Clone)]
pub(super) struct Conn {
    inner: Arc<ConnInner>,
}

struct ConnInner {
    shared: Arc<Shared>,
    mem: Mem,
    queues: Vec<Queue>,
    event_idx: AtomicBool,
    writeback: AtomicBool,
    acked: AtomicU64,
}

impl Conn {
    /// A connection's backend over `mem` (the map the daemon was created with).
    pub(super) fn new(shared: Arc<Shared>, mem: Mem) -> io::Result<Conn> {
        let mut queues = Vec::new();
        for index in 0..shared.options.queues {
            let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK)?;
            queues.push(Queue {
                index,
                work: Mutex::new(FuturesUnordered::new()),
                waker: Arc::new(FdWaker {
                    notifier,
                    armed: AtomicBool::new(false),
                }),
                consumer,
                in_flight: Mutex::new(0),
                idle: Condvar::new(),
                bad_logged: AtomicU64::new(0),
                broken: AtomicBool::new(false),
            });
        }
        Ok(Conn {
            inner: Arc::new(ConnInner {
                shared,
                mem,
                queues,
                event_idx: AtomicBool::new(false),
                writeback: AtomicBool::new(true),
                acked: AtomicU64::new(0),
            }),
        })
    }

    /// The wake-up fd of each queue, with the epoll data value its worker must see.
    pub(super) fn wake_fds(&self) -> Vec<(std::os::fd::RawFd, u64)> {
        use std::os::fd::AsRawFd;
        let nq = self.inner.queues.len() as u64;
        self.inner
            .queues
            .iter()
            .map(|q| (q.consumer.as_raw_fd(), nq + 1 + u64::from(q.index)))
            .collect()
    }

    /// Virtio features the front end acknowledged.
    pub(super) fn acked_features(&self) -> u64 {
        self.inner.acked.load(Ordering::Relaxed)
    }

    /// Wait until no request of any queue is in flight (after the front end went away,
    /// before the workers stop).
    pub(super) fn drain(&self) {
        for q in &self.inner.queues {
            self.inner.wait_idle(q);
        }
    }
}

impl ConnInner {
    fn options(&self) -> &VhostUserOptions {
        &self.shared.options
    }

    fn wait_idle(&self, q: &Queue) {
        let mut n = q.in_flight.lock();
        let mut since = Instant::now();
        while *n > 0 {
            if q.idle.wait_for(&mut n, Duration::from_secs(5)).timed_out() {
                warn!(
                    socket = %self.shared.path.display(),
                    queue = q.index,
                    in_flight = *n,
                    waited_s = since.elapsed().as_secs(),
                    "vhost-user queue still waiting for its requests to complete"
                );
                since = Instant::now();
            }
        }
    }

    /// Pop and start every available chain, then reap what completed; with event-idx,
    /// repeat until the ring stays empty after notifications are re-enabled. With a
    /// busy-poll window, keep polling (notifications off) while work keeps coming.
    fn process(&self, q: &Queue, vring: &VringRwLock<Mem>) {
        let _rt = self.shared.runtime.enter();
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        let busy = self.options().busy_poll;
        let mut last_work = Instant::now();
        // Notifications are turned off while the ring is drained (and while polling),
        // then back on, and the ring checked once more: a chain offered in between would
        // otherwise wait for a kick that never comes.
        let rearm = event_idx || !busy.is_zero();
        loop {
            if rearm {
                let _ = vring.disable_notification();
            }
            // The front end may add memory regions at any time (libblkio maps its
            // buffers after the queues start) and offers a chain in them only after the
            // backend acknowledged the region. So a chain is parsed with a map loaded
            // after it was popped: if the map changed meanwhile, the pop is undone and
            // redone with the new map.
            let mut mem = self.mem.memory();
            if self.ring_overrun(q, vring, &mem) {
                return;
            }
            let mut started = 0usize;
            loop {
                let chain = vring
                    .get_mut()
                    .get_queue_mut()
                    .pop_descriptor_chain(mem.clone());
                let Some(chain) = chain else { break };
                let now = self.mem.memory();
                if !std::ptr::eq::<GuestMemoryMmap>(&*now, &*mem) {
                    vring.get_mut().get_queue_mut().go_to_previous_position();
                    mem = now;
                    continue;
                }
                let parsed =
                    virtio::parse(chain, &mem, &self.shared.limits, self.options().read_only);
                self.start(q, parsed, &mem, vring);
                started += 1;
            }
            let reaped = self.reap(q, vring);
            if started + reaped > 0 {
                last_work = Instant::now();
            }
            if !busy.is_zero() && last_work.elapsed() < busy {
                std::hint::spin_loop();
                continue;
            }
            if !rearm {
                break;
            }
            match vring.enable_notification() {
                Ok(true) => continue,
                _ => break,
            }
        }
    }

    /// Whether the queue is broken: its avail index runs more than a ring ahead of what
    /// was taken (a hostile or corrupt guest). Marked once, logged once, counted as a
    /// refused chain; the queue then serves nothing (other queues and disks go on).
    fn ring_overrun(
        &self,
        q: &Queue,
        vring: &VringRwLock<Mem>,
        mem: &GuestMemoryLoadGuard<GuestMemoryMmap>,
    ) -> bool {
        if q.broken.load(Ordering::Relaxed) {
            return true;
        }
        let state = vring.get_ref();
        let queue = state.get_queue();
        let Ok(avail) = queue.avail_idx(&**mem, Ordering::Acquire) else {
            return false;
        };
        let pending = avail.0.wrapping_sub(queue.next_avail());
        if pending <= queue.size() {
            return false;
        }
        drop(state);
        q.broken.store(true, Ordering::Relaxed);
        self.shared.stats.queues[usize::from(q.index)]
            .bad_chains
            .fetch_add(1, Ordering::Relaxed);
        warn!(
            socket = %self.shared.path.display(),
            queue = q.index,
            pending,
            "vhost-user: the guest's avail index is more than a ring ahead; the queue is \
             broken and serves nothing until the front end reconnects"
        );
        true
    }

    /// Start one parsed chain: a refused one completes at once (IOERR where it has a
    /// status byte); a request becomes a future on this queue.
    fn start(
        &self,
        q: &Queue,
        parsed: Parsed,
        mem: &GuestMemoryLoadGuard<GuestMemoryMmap>,
        vring: &VringRwLock<Mem>,
    ) {
        let stats = &self.shared.stats.queues[usize::from(q.index)];
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let req = match parsed {
            Parsed::Ok(req) => req,
            Parsed::Bad { head, why, status } => {
                stats.bad_chains.fetch_add(1, Ordering::Relaxed);
                let n = q.bad_logged.fetch_add(1, Ordering::Relaxed);
                if n < BAD_CHAIN_WARNINGS {
                    warn!(socket = %self.shared.path.display(), queue = q.index, head, reason = why.name(), "vhost-user: refused a descriptor chain (IOERR)");
                } else {
                    debug!(socket = %self.shared.path.display(), queue = q.index, head, reason = why.name(), "vhost-user: refused a descriptor chain (IOERR)");
                }
                let len = match status {
                    Some(at) if put_status(mem, at, blk::VIRTIO_BLK_S_IOERR) => 1,
                    _ => 0,
                };
                self.complete(q, vring, [(head, len)]);
                return;
            }
        };
        let writeback = self.writeback.load(Ordering::Relaxed);
        let mem = mem.clone();
        let shared = self.shared.clone();
        let qi = usize::from(q.index);
        let fut: Work = match req.op {
            Op::Out {
                offset,
                len,
                ref segs,
            } => {
                // Copy the payload now: the guest may change its buffers once the request
                // is on its way, and the write must be of what was there at submission.
                let mut buf = BytesMut::zeroed(len as usize);
                if !virtio::read_segs(&mem, segs, &mut buf) {
                    let len = u32::from(put_status(&mem, req.status, blk::VIRTIO_BLK_S_IOERR));
                    self.complete(q, vring, [(req.head, len)]);
                    return;
                }
                let data = buf.freeze();
                let flags = if writeback {
                    IoFlags::empty()
                } else {
                    IoFlags::FUA
                };
                Box::pin(async move {
                    let dev = &*shared.device;
                    let ok = write_chunks(dev, offset, data, flags).await;
                    let s = &shared.stats.queues[qi];
                    s.writes.fetch_add(1, Ordering::Relaxed);
                    if ok {
                        s.written_bytes.fetch_add(len, Ordering::Relaxed);
                    }
                    finish(&shared, qi, &mem, &req, ok, 0)
                })
            }
            Op::In {
                offset,
                len,
                ref segs,
            } => {
                let segs = segs.clone();
                Box::pin(async move {
                    let dev = &*shared.device;
                    let ok = match read_chunks(dev, offset, len).await {
                        Some(chunks) => write_chunks_to(&mem, &segs, &chunks),
                        None => false,
                    };
                    let s = &shared.stats.queues[qi];
                    s.reads.fetch_add(1, Ordering::Relaxed);
                    if ok {
                        s.read_bytes.fetch_add(len, Ordering::Relaxed);
                    }
                    finish(&shared, qi, &mem, &req, ok, if ok { len as u32 } else { 0 })
                })
            }
            Op::Flush => Box::pin(async move {
                let dev = &*shared.device;
                let ok = dev.flush().await.is_ok();
                shared.stats.queues[qi]
                    .flushes
                    .fetch_add(1, Ordering::Relaxed);
                finish(&shared, qi, &mem, &req, ok, 0)
            }),
            Op::GetId { ref segs } => {
                let mut id = [0u8; blk::VIRTIO_BLK_ID_BYTES as usize];
                let serial = self.options().serial.as_bytes();
                let n = serial.len().min(id.len());
                id[..n].copy_from_slice(&serial[..n]);
                let wlen = segs
                    .iter()
                    .map(|s| u64::from(s.len))
                    .sum::<u64>()
                    .min(id.len() as u64);
                let ok = virtio::write_segs(&mem, segs, &id[..wlen as usize]);
                self.shared.stats.queues[qi]
                    .get_ids
                    .fetch_add(1, Ordering::Relaxed);
                let done = finish(&self.shared, qi, &mem, &req, ok, wlen as u32);
                self.complete(q, vring, [done]);
                return;
            }
            Op::Discard { ref ranges } | Op::WriteZeroes { ref ranges } => {
                let ranges = ranges.clone();
                let zeroes = matches!(req.op, Op::WriteZeroes { .. });
                let flags = if writeback {
                    IoFlags::empty()
                } else {
                    IoFlags::FUA
                };
                Box::pin(async move {
                    let dev = &*shared.device;
                    let mut ok = true;
                    for r in &ranges {
                        let res = if zeroes && !r.unmap {
                            dev.write_zeroes(r.offset, r.len, flags).await
                        } else {
                            // A discard reads back as zeros (the BlockDevice contract), so
                            // it serves a write-zeroes that allows deallocation too.
                            dev.discard(r.offset, r.len, flags).await
                        };
                        ok &= res.is_ok();
                        if !ok {
                            break;
                        }
                    }
                    let s = &shared.stats.queues[qi];
                    if zeroes { &s.write_zeroes } else { &s.discards }
                        .fetch_add(1, Ordering::Relaxed);
                    finish(&shared, qi, &mem, &req, ok, 0)
                })
            }
            Op::Unsupported { kind } => {
                let s = &self.shared.stats.queues[qi];
                s.unsupported.fetch_add(1, Ordering::Relaxed);
                debug!(
                    queue = q.index,
                    kind, "vhost-user: unsupported request type (UNSUPP)"
                );
                let len = u32::from(put_status(&mem, req.status, blk::VIRTIO_BLK_S_UNSUPP));
                self.complete(q, vring, [(req.head, len)]);
                return;
            }
        };
        *q.in_flight.lock() += 1;
        self.shared.stats.queues[qi]
            .in_flight
            .fetch_add(1, Ordering::Relaxed);
        q.work.lock().push(fut);
    }

    /// Poll the queue's requests; add every completed one to the used ring.
    fn reap(&self, q: &Queue, vring: &VringRwLock<Mem>) -> usize {
        q.waker.armed.store(false, Ordering::Release);
        let waker = Waker::from(q.waker.clone());
        let mut cx = Context::from_waker(&waker);
        let mut done = Vec::new();
        {
            let mut work = q.work.lock();
            {
                // Requests popped together start together: a device that batches (a
                // mirror) carries them out at the unplug, with one send for all.
                let _plug = crate::plug::Plug::new();
                while let Poll::Ready(Some(d)) = Pin::new(&mut *work).poll_next(&mut cx) {
                    done.push(d);
                }
            }
            // What the unplug completed.
            while let Poll::Ready(Some(d)) = Pin::new(&mut *work).poll_next(&mut cx) {
                done.push(d);
            }
        }
        let n = done.len();
        if n > 0 {
            let s = &self.shared.stats.queues[usize::from(q.index)];
            s.in_flight.fetch_sub(n as u64, Ordering::Relaxed);
            self.complete(q, vring, done);
            let mut f = q.in_flight.lock();
            *f -= n;
            if *f == 0 {
                q.idle.notify_all();
            }
        }
        n
    }

    fn complete(&self, q: &Queue, vring: &VringRwLock<Mem>, done: impl IntoIterator<Item = Done>) {
        let mut any = false;
        for (head, len) in done {
            if let Err(e) = vring.add_used(head, len) {
                warn!(
                    queue = q.index,
                    head, "vhost-user: cannot add to the used ring: {e}"
                );
            }
            any = true;
        }
        if any && vring.needs_notification().unwrap_or(true) {
            let _ = vring.signal_used_queue();
        }
    }
}

/// Write a status byte; false if it could not be written.
fn put_status(mem: &GuestMemoryMmap, at: GuestAddress, status: u32) -> bool {
    vm_memory::Bytes::write_slice(mem, &[status as u8], at).is_ok()
}

/// The completion of one request: its status written, the bytes it wrote into the
/// guest's buffers (`data_len` plus the status byte).
fn finish(
    shared: &Shared,
    qi: usize,
    mem: &GuestMemoryMmap,
    req: &Request,
    ok: bool,
    data_len: u32,
) -> Done {
    if !ok {
        shared.stats.queues[qi]
            .errors
            .fetch_add(1, Ordering::Relaxed);
    }
    let status = if ok {
        blk::VIRTIO_BLK_S_OK
    } else {
        blk::VIRTIO_BLK_S_IOERR
    };
    let wrote = put_status(mem, req.status, status);
    (req.head, if wrote { data_len + 1 } else { 0 })
}

/// Read `len` bytes at `offset` in pieces the device accepts.
async fn read_chunks(dev: &dyn BlockDevice, offset: u64, len: u64) -> Option<Vec<Bytes>> {
    let max = u64::from(dev.geometry().max_io());
    let mut out = Vec::with_capacity(len.div_ceil(max) as usize);
    let mut at = 0;
    while at < len {
        let n = (len - at).min(max);
        match dev.read(offset + at, n as usize).await {
            Ok(b) if b.len() as u64 == n => out.push(b),
            _ => return None,
        }
        at += n;
    }
    Some(out)
}

/// Write `data` at `offset` in pieces the device accepts.
async fn write_chunks(dev: &dyn BlockDevice, offset: u64, data: Bytes, flags: IoFlags) -> bool {
    let max = dev.geometry().max_io() as usize;
    let mut at = 0;
    while at < data.len() {
        let n = (data.len() - at).min(max);
        if dev
            .write(offset + at as u64, data.slice(at..at + n), flags)
            .await
            .is_err()
        {
            return false;
        }
        at += n;
    }
    true
}

/// Copy read chunks into the request's buffers, in order.
fn write_chunks_to(mem: &GuestMemoryMmap, segs: &[Seg], chunks: &[Bytes]) -> bool {
    if let [one] = chunks {
        return virtio::write_segs(mem, segs, one);
    }
    let all: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
    virtio::write_segs(mem, segs, &all)
}

impl VhostUserBackend for Conn {
    type Bitmap = ();
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        self.inner.queues.len()
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.inner.options().queue_size)
    }

    fn features(&self) -> u64 {
        virtio::device_features(self.inner.options().read_only)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        self.inner.acked.store(features, Ordering::Relaxed);
        self.inner
            .shared
            .stats
            .features
            .store(features, Ordering::Relaxed);
        info!(socket = %self.inner.shared.path.display(), features = format_args!("{features:#x}"), "vhost-user front end negotiated features");
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
    }

    fn set_event_idx(&self, enabled: bool) {
        self.inner.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = virtio::config_space(
            &self.inner.shared.limits,
            self.inner.writeback.load(Ordering::Relaxed),
        );
        let start = (offset as usize).min(c.len());
        let end = start.saturating_add(size as usize).min(c.len());
        c[start..end].to_vec()
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        if offset as usize == virtio::CONFIG_WCE_OFFSET && buf.len() == 1 {
            let wb = buf[0] != 0;
            let was = self.inner.writeback.swap(wb, Ordering::Relaxed);
            if was != wb {
                info!(socket = %self.inner.shared.path.display(), writeback = wb, "vhost-user: guest set the write cache mode (writethrough: every write is FUA)");
            }
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "only the wce byte of the virtio-blk config is writable",
        ))
    }

    fn update_memory(&self, _mem: Mem) -> io::Result<()> {
        // The daemon updates the map we were created with in place.
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.inner.queues.len()).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if let Some(q) = self.inner.queues.get(queue_index as usize) {
            self.inner.wait_idle(q);
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        // One queue per worker thread (`queues_per_thread`): a kick carries the queue's
        // index within its thread (0), a wake-up the value `wake_fds` registered.
        let nq = self.inner.queues.len();
        let (qi, wake) = match usize::from(device_event) {
            e if e < nq => (thread_id, false),
            e if e > nq && e <= 2 * nq => (e - nq - 1, true),
            _ => return Ok(()),
        };
        let (Some(q), Some(vring)) = (self.inner.queues.get(qi), vrings.first()) else {
            return Ok(());
        };
        if wake {
            let _ = q.consumer.consume();
        }
        self.inner.process(q, vring);
        Ok(())
    }
}

/// Per-queue counters, shared by every connection of one export.
#[derive(Debug, Default)]
pub(super) struct QueueStats {
    pub requests: AtomicU64,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub write_zeroes: AtomicU64,
    pub get_ids: AtomicU64,
    pub unsupported: AtomicU64,
    pub errors: AtomicU64,
    pub bad_chains: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub in_flight: AtomicU64,
}

/// Counters of one export.
#[derive(Debug, Default)]
pub(super) struct Stats {
    pub queues: Vec<QueueStats>,
    pub connected: AtomicBool,
    pub connections: AtomicU64,
    pub features: AtomicU64,
}

pub(super) fn limits(dev: &dyn BlockDevice, o: &VhostUserOptions) -> Limits {
    let g = dev.geometry();
    let seg_max = u32::from(o.queue_size.saturating_sub(2)).clamp(1, 128);
    let size_max = 1u32 << 20;
    let bs = u64::from(g.block_size());
    let max_range = ((1u64 << 30) / bs * bs / virtio::SECTOR) as u32;
    Limits {
        size: g.size(),
        block_size: g.block_size(),
        size_max,
        seg_max,
        max_transfer: (u64::from(seg_max) * u64::from(size_max)).min(16 << 20),
        max_range_sectors: max_range,
        max_ranges: 1,
        queues: o.queues,
    }
}
