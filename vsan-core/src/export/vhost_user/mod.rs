//! vhost-user-blk: the shared-memory path from a VM on the same host (QEMU,
//! cloud-hypervisor, libblkio) to any [`BlockDevice`].
//!
//! The front end (the VMM) connects to a Unix socket and hands over the guest's memory
//! and virtqueues; this backend serves virtio-blk requests straight from those queues,
//! with no socket syscall per I/O. It is built on the rust-vmm crates made for this
//! (`vhost`, `vhost-user-backend`, `virtio-queue`, `vm-memory`, `virtio-bindings`,
//! `vmm-sys-util`; Apache-2.0 / BSD-3-Clause, fit for linking into MIT OR Apache-2.0
//! code). It lives in `vsan-core` beside NBD and iSCSI because, like them, it needs
//! nothing but a `BlockDevice`; it is Linux only, as vhost-user is.
//!
//! # What the guest sees
//! - Features: VERSION_1, RING_INDIRECT_DESC, RING_EVENT_IDX, SEG_MAX, SIZE_MAX,
//!   BLK_SIZE, TOPOLOGY, FLUSH, CONFIG_WCE, MQ, and DISCARD + WRITE_ZEROES (or RO for a
//!   read-only export); protocol features CONFIG, MQ and REPLY_ACK.
//! - Config space from the disk's geometry: capacity, `blk_size` (the disk's block
//!   size; every request must be aligned to it), discard and write-zeroes limits (one
//!   range of up to 1 GiB per request), the queue count.
//! - Requests IN, OUT, FLUSH, GET_ID (the serial in [`VhostUserOptions::serial`]: give
//!   both mirror nodes the same), DISCARD and WRITE_ZEROES (with the unmap flag served
//!   by a discard, which reads back as zeros); anything else is answered UNSUPP.
//! - The write cache starts in writeback mode; a guest that turns it off (writing the
//!   `wce` config byte) gets every write with FUA.
//!
//! # How it runs
//! One worker thread per queue pops chains and runs each request's future on that
//! thread, many per queue at once, completing them in any order (see `backend`). With
//! event-idx the worker re-checks the ring after re-enabling notifications. With
//! [`VhostUserOptions::busy_poll`] it keeps polling the ring and its requests for that
//! long after the last work before it sleeps: lower latency for a core's worth of CPU.
//!
//! # A hostile guest
//! Every chain is checked before it is used (`virtio::parse`): descriptors outside
//! guest memory, loops, chains too short or too long, a status byte in a read-only
//! buffer, sector counts that overflow or lie beyond the disk, and data in the wrong
//! direction are answered IOERR (or completed with nothing written when there is no
//! writable status byte), counted in [`QueueCounters::bad_chains`] and logged (the
//! first few per queue and connection at `warn`). All guest memory is reached through
//! `vm-memory`'s bounds-checked accessors: nothing outside the mapped regions is ever
//! read or written, and other queues and exports keep running.
//!
//! # Reconnects and restarts
//! The export accepts one front end at a time, and a new one after it goes (QEMU's
//! `reconnect-ms`). When a front end disconnects, the requests it had in flight are
//! completed into its rings before the workers stop. Not implemented: the
//! INFLIGHT_SHMFD protocol feature, with which a *restarted backend* learns which
//! requests were in flight. What a backend restart (the node process killed) with I/O
//! in flight costs, precisely: QEMU restores each queue's next request to the used
//! ring's index. Requests that had completed in order are safe; a request that was
//! still running when a later one completed is resubmitted or lost depending on its
//! position, so with out-of-order completions in flight at the kill the guest may hang
//! on a request or see one completed twice (its virtio driver then marks the device
//! broken). A restart with nothing in flight, or with completions in order (QD1), costs
//! nothing. Acknowledged data is never lost either way: a write is only completed to
//! the guest after the device (the mirror: both replicas) accepted it.

mod backend;
mod virtio;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;

use crate::{BlockDevice, Error, ErrorKind, Result};
use backend::{Conn, QueueStats, Stats};

/// Options of one vhost-user-blk export.
#[derive(Debug, Clone)]
pub struct VhostUserOptions {
    /// Queues offered to the front end (1 to 64), each with its own worker thread.
    pub queues: u16,
    /// The most descriptors per queue the front end may ask for (a power of two, 2 to
    /// 32768; QEMU asks for 128 or 256).
    pub queue_size: u16,
    /// Refuse writes, discards and write-zeroes, and offer the RO feature.
    pub read_only: bool,
    /// What GET_ID answers (up to 20 bytes, printable ASCII): the same on every node
    /// that serves the disk, so a guest sees one disk whichever node it uses.
    pub serial: String,
    /// How long each queue's worker keeps polling after its last work before it
    /// sleeps; zero (the default) never polls.
    pub busy_poll: Duration,
}

impl Default for VhostUserOptions {
    fn default() -> VhostUserOptions {
        VhostUserOptions {
            queues: 1,
            queue_size: 256,
            read_only: false,
            serial: String::new(),
            busy_poll: Duration::ZERO,
        }
    }
}

impl VhostUserOptions {
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::new(ErrorKind::InvalidArgument, m));
        if !(1..=64).contains(&self.queues) {
            return bad(format!(
                "vhost-user queues must be 1 to 64, not {}",
                self.queues
            ));
        }
        if !self.queue_size.is_power_of_two() || self.queue_size < 2 {
            return bad(format!(
                "vhost-user queue size must be a power of two from 2 to 32768, not {}",
                self.queue_size
            ));
        }
        if self.serial.len() > 20 || !self.serial.bytes().all(|b| b.is_ascii_graphic()) {
            return bad(format!(
                "vhost-user serial must be up to 20 printable ASCII bytes: {:?}",
                self.serial
            ));
        }
        Ok(())
    }
}

/// What every connection of one export shares.
struct Shared {
    device: Arc<dyn BlockDevice>,
    options: VhostUserOptions,
    limits: virtio::Limits,
    path: PathBuf,
    runtime: tokio::runtime::Handle,
    stats: Stats,
}

/// Counters of one queue of an export, summed over its connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueCounters {
    /// Chains taken from the ring.
    pub requests: u64,
    /// Reads completed (with or without error).
    pub reads: u64,
    /// Writes completed.
    pub writes: u64,
    /// Flushes completed.
    pub flushes: u64,
    /// Discards completed.
    pub discards: u64,
    /// Write-zeroes completed.
    pub write_zeroes: u64,
    /// GET_ID requests answered.
    pub get_ids: u64,
    /// Requests of a type this backend does not implement (answered UNSUPP).
    pub unsupported: u64,
    /// Requests answered IOERR because the device failed them.
    pub errors: u64,
    /// Chains refused as malformed or hostile (answered IOERR where possible).
    pub bad_chains: u64,
    /// Bytes read successfully.
    pub read_bytes: u64,
    /// Bytes written successfully.
    pub written_bytes: u64,
    /// Requests running now.
    pub in_flight: u64,
}

/// A snapshot of an export's state and counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VhostUserStatus {
    /// A front end is connected now.
    pub connected: bool,
    /// Front ends accepted since the export started.
    pub connections: u64,
    /// The virtio features the current (or last) front end acknowledged.
    pub features: u64,
    /// Per-queue counters.
    pub queues: Vec<QueueCounters>,
}

/// A vhost-user-blk export of one device on one Unix socket.
///
/// [`start`](Self::start) binds the socket and serves front ends on a thread of its own,
/// one at a time; [`shutdown`](Self::shutdown) (or drop) disconnects the current one
/// after its requests in flight completed, and removes the socket.
pub struct VhostUserExport {
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<vhost_user_backend::ShutdownHandle>>>,
    listen_fd: std::os::fd::RawFd,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for VhostUserExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserExport")
            .field("path", &self.shared.path)
            .field("options", &self.shared.options)
            .finish_non_exhaustive()
    }
}

impl VhostUserExport {
    /// Bind `path` and serve `device` on it. Requests run on `runtime` (the device's
    /// futures may need its timers and sockets). Only a stale socket at `path` (one
    /// nobody answers on) is replaced: any other file there is refused and left as it
    /// is, and so is a socket another server still listens on.
    ///
    /// Errors: `InvalidArgument` for bad options or a device whose block size virtio
    /// cannot express; `InUse` when the path is taken; `Io` when the socket cannot be
    /// bound.
    pub fn start(
        path: impl AsRef<Path>,
        device: Arc<dyn BlockDevice>,
        options: VhostUserOptions,
        runtime: tokio::runtime::Handle,
    ) -> Result<VhostUserExport> {
        options.check()?;
        let path = path.as_ref().to_path_buf();
        let limits = backend::limits(&*device, &options);
        if limits.block_size < 512 || limits.size % virtio::SECTOR != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "vhost-user needs a block size of at least 512 bytes",
            ));
        }
        super::claim_socket_path(&path).map_err(|e| {
            let kind = match e.kind() {
                io::ErrorKind::AlreadyExists | io::ErrorKind::AddrInUse => ErrorKind::InUse,
                _ => ErrorKind::Io,
            };
            Error::new(
                kind,
                format!("cannot bind vhost-user socket {}: {e}", path.display()),
            )
        })?;
        let listener = Listener::new(&path, false).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("cannot bind vhost-user socket {}: {e}", path.display()),
            )
        })?;
        let stats = Stats {
            queues: (0..options.queues).map(|_| QueueStats::default()).collect(),
            ..Stats::default()
        };
        let shared = Arc::new(Shared {
            device,
            options,
            limits,
            path,
            runtime,
            stats,
        });
        let stop = Arc::new(AtomicBool::new(false));
        let current = Arc::new(Mutex::new(None));
        let listen_fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
        let thread = std::thread::Builder::new()
            .name("vsan-vhost-user".into())
            .spawn({
                let (shared, stop, current) = (shared.clone(), stop.clone(), current.clone());
                move || serve(shared, listener, stop, current)
            })
            .map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("cannot start vhost-user thread: {e}"),
                )
            })?;
        info!(
            socket = %shared.path.display(),
            queues = shared.options.queues,
            queue_size = shared.options.queue_size,
            read_only = shared.options.read_only,
            busy_poll_us = shared.options.busy_poll.as_micros() as u64,
            "vhost-user-blk export listening"
        );
        Ok(VhostUserExport {
            shared,
            stop,
            current,
            listen_fd,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The export's state and counters now.
    pub fn status(&self) -> VhostUserStatus {
        let s = &self.shared.stats;
        let r = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        VhostUserStatus {
            connected: s.connected.load(Ordering::Relaxed),
            connections: r(&s.connections),
            features: r(&s.features),
            queues: s
                .queues
                .iter()
                .map(|q| QueueCounters {
                    requests: r(&q.requests),
                    reads: r(&q.reads),
                    writes: r(&q.writes),
                    flushes: r(&q.flushes),
                    discards: r(&q.discards),
                    write_zeroes: r(&q.write_zeroes),
                    get_ids: r(&q.get_ids),
                    unsupported: r(&q.unsupported),
                    errors: r(&q.errors),
                    bad_chains: r(&q.bad_chains),
                    read_bytes: r(&q.read_bytes),
                    written_bytes: r(&q.written_bytes),
                    in_flight: r(&q.in_flight),
                })
                .collect(),
        }
    }

    /// Stop serving: disconnect the front end once its requests in flight completed,
    /// stop the workers and remove the socket. Blocks until done (call it off the
    /// runtime's threads: the requests in flight may need them to complete); later
    /// calls return at once.
    pub fn shutdown(&self) {
        let Some(thread) = self.thread.lock().take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.current.lock().as_ref() {
            h.shutdown();
        }
        // Wake an accept that is waiting for a front end: shutting the listening
        // socket down makes a blocked accept fail at once on Linux, whether or not the
        // socket's path still exists.
        // SAFETY: the serving thread owns the listener and is still running (joined
        // below), so the fd is open for the duration of this borrow.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.listen_fd) };
        let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        let _ = thread.join();
        let _ = std::fs::remove_file(&self.shared.path);
        info!(socket = %self.shared.path.display(), "vhost-user-blk export stopped");
    }
}

impl Drop for VhostUserExport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Accept front ends one after another until told to stop.
fn serve(
    shared: Arc<Shared>,
    mut listener: Listener,
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<vhost_user_backend::ShutdownHandle>>>,
) {
    while !stop.load(Ordering::SeqCst) {
        if let Err(e) = serve_one(&shared, &mut listener, &stop, &current) {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            warn!(socket = %shared.path.display(), "vhost-user connection failed: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn serve_one(
    shared: &Arc<Shared>,
    listener: &mut Listener,
    stop: &AtomicBool,
    current: &Mutex<Option<vhost_user_backend::ShutdownHandle>>,
) -> io::Result<()> {
    let other = |e: vhost_user_backend::Error| io::Error::other(e.to_string());
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
    let conn = Conn::new(shared.clone(), mem.clone())?;
    let mut daemon =
        VhostUserDaemon::new("vsan-vhost-user".into(), conn.clone(), mem).map_err(other)?;
    let handlers = daemon.get_epoll_handlers();
    for ((fd, data), h) in conn.wake_fds().into_iter().zip(&handlers) {
        h.register_listener(fd, EventSet::IN, data)?;
    }
    let result = daemon.start(listener).map_err(other);
    if result.is_ok() {
        *current.lock() = daemon.shutdown_handle();
        if stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
        } else {
            shared.stats.connected.store(true, Ordering::SeqCst);
            shared.stats.connections.fetch_add(1, Ordering::Relaxed);
            info!(socket = %shared.path.display(), "vhost-user front end connected");
        }
    }
    // A front end that goes away ends the connection; that is no failure.
    let ended = result.and_then(|()| match daemon.wait() {
        Err(vhost_user_backend::Error::HandleRequest(
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
        )) => Ok(()),
        r => r.map_err(other),
    });
    *current.lock() = None;
    let was = shared.stats.connected.swap(false, Ordering::SeqCst);
    // The front end is gone: let its requests in flight complete into its rings, then
    // stop this connection's workers.
    conn.drain();
    for h in &handlers {
        h.send_exit_event();
    }
    if was {
        info!(
            socket = %shared.path.display(),
            features = format_args!("{:#x}", conn.acked_features()),
            "vhost-user front end disconnected"
        );
    }
    ended
}
