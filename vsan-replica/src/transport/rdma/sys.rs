//! The verbs backend (feature `rdma`): rdma-core's `libibverbs` and `librdmacm` through
//! the `rdma-sys` binding. Connections are set up with `rdma_cm` (address and route
//! resolution, connect and accept with a hello in the private data) on reliable
//! connected queue pairs; the data path is SEND/RECV from one registered buffer pool,
//! driven by [`Engine`](super::engine::Engine).
//!
//! Every failure before a connection is established is a reason to fall back to TCP
//! ([`Setup::Unavailable`]); after it is established (authentication) failures are
//! reported.

use std::ffi::CStr;
use std::fmt;
use std::future::Future;
use std::io;
use std::mem;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::os::raw::{c_int, c_void};
use std::pin::Pin;
use std::ptr;
use std::sync::Arc;

use rdma_sys as ffi;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::engine::{Completion, Engine, PeerParams, Verbs};
use super::link::{self, LinkParams, Notifier, Wake};
use super::{Link, Listener, RdmaConfig, Setup};
use crate::transport::auth::Role;

/// Private data both sides send: magic, version, 3 zero bytes, receive buffers, buffer
/// size (big-endian).
const HELLO_MAGIC: &[u8; 4] = b"VSRD";
const HELLO_VERSION: u8 = 1;
const HELLO_LEN: usize = 16;
/// Marks a receive work request's id (send ids are plain buffer numbers).
const RECV_BIT: u64 = 1 << 63;
/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// Incoming connection requests queued by the `rdma_cm` listener.
const LISTEN_BACKLOG: c_int = 16;
/// Links accepted and not yet taken by `accept`.
const ACCEPT_BACKLOG: usize = 16;

fn os_error(what: &str) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

/// `Ok` when at least one RDMA device is present.
fn probe() -> std::result::Result<(), String> {
    let mut count: c_int = 0;
    // SAFETY: `ibv_get_device_list` only writes the count through the valid pointer.
    let list = unsafe { ffi::ibv_get_device_list(&mut count) };
    if list.is_null() {
        return Err(format!(
            "no RDMA device: ibv_get_device_list: {}",
            io::Error::last_os_error()
        ));
    }
    // SAFETY: `list` came from `ibv_get_device_list` and is freed once, here.
    unsafe { ffi::ibv_free_device_list(list) };
    if count <= 0 {
        return Err("no RDMA device".to_string());
    }
    Ok(())
}

fn set_nonblocking(fd: RawFd) -> std::result::Result<(), String> {
    // SAFETY: fcntl on a descriptor we own (it belongs to an rdma-core channel we hold);
    // it reads and sets flags, touching no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_error("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

/// Watches an rdma-core descriptor for readability.
///
/// # Safety
///
/// `raw` must stay open, and refer to the same description, until the returned value is
/// dropped.
unsafe fn watch(raw: RawFd, what: &str) -> std::result::Result<AsyncFd<Fd>, String> {
    set_nonblocking(raw)?;
    // SAFETY: upheld by the caller.
    unsafe { AsyncFd::register_with_interest(Fd(raw), Interest::READABLE) }
        .map_err(|e| format!("watch {what}: {e}"))
}

/// A C socket address for `addr`.
fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: an all-zero sockaddr_storage is a valid (unspecified) address.
    let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { ptr::write((&raw mut storage).cast::<libc::sockaddr_in>(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { ptr::write((&raw mut storage).cast::<libc::sockaddr_in6>(), sin6) };
        }
    }
    storage
}

fn hello(config: &RdmaConfig) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..4].copy_from_slice(HELLO_MAGIC);
    out[4] = HELLO_VERSION;
    out[8..12].copy_from_slice(&config.credits.to_be_bytes());
    // Checked against MAX_BUFFER_LEN (16 MiB).
    out[12..16].copy_from_slice(&(config.buffer_size as u32).to_be_bytes());
    out
}

fn parse_hello(data: &[u8]) -> std::result::Result<PeerParams, String> {
    // The transport may pad private data; only the first bytes are ours.
    let Some(h) = data.get(..HELLO_LEN) else {
        return Err("the peer sent no vsan hello (is it a vsan node?)".to_string());
    };
    if &h[..4] != HELLO_MAGIC || h[4] != HELLO_VERSION || h[5..8] != [0, 0, 0] {
        return Err("the peer's rdma hello is not one this version speaks".to_string());
    }
    let params = PeerParams {
        credits: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
        buf_len: u32::from_be_bytes([h[12], h[13], h[14], h[15]]) as usize,
    };
    params.check()?;
    Ok(params)
}

fn event_name(kind: ffi::rdma_cm_event_type::Type) -> String {
    // SAFETY: `rdma_event_str` returns a pointer to a static NUL-terminated string.
    let name = unsafe { ffi::rdma_event_str(kind) };
    if name.is_null() {
        return format!("event {kind}");
    }
    // SAFETY: checked non-null above; the string is static.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

/// A file descriptor owned by rdma-core, watched by tokio.
#[derive(Debug)]
struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A connection manager id; only ever used through the connection that owns it.
#[derive(Debug, Clone, Copy)]
struct IdPtr(*mut ffi::rdma_cm_id);

// SAFETY: an rdma_cm id may be used from any thread (librdmacm locks internally); the
// pointer is only passed to librdmacm and owned by exactly one holder.
unsafe impl Send for IdPtr {}

/// One `rdma_cm` event, copied out before it is acknowledged.
#[derive(Debug)]
struct CmEvent {
    kind: ffi::rdma_cm_event_type::Type,
    status: c_int,
    id: IdPtr,
    private: Vec<u8>,
}

impl CmEvent {
    fn describe(&self) -> String {
        format!("{} (status {})", event_name(self.kind), self.status)
    }
}

/// An `rdma_cm` event channel with a non-blocking descriptor tokio watches.
struct EventChannel {
    ch: *mut ffi::rdma_event_channel,
    fd: Option<AsyncFd<Fd>>,
}

// SAFETY: the channel is used only through librdmacm calls, which are thread-safe.
unsafe impl Send for EventChannel {}
// SAFETY: as above; `next` takes `&self` and librdmacm serialises event retrieval.
unsafe impl Sync for EventChannel {}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel").finish_non_exhaustive()
    }
}

impl EventChannel {
    fn new() -> std::result::Result<EventChannel, String> {
        // SAFETY: no arguments; returns an owned channel or null.
        let ch = unsafe { ffi::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(os_error("rdma_create_event_channel"));
        }
        let mut channel = EventChannel { ch, fd: None };
        // SAFETY: `ch` is a valid channel; its fd field is plain data.
        let raw = unsafe { (*ch).fd };
        // SAFETY: the descriptor belongs to the channel, which `Drop` destroys only
        // after dropping the watcher.
        channel.fd = Some(unsafe { watch(raw, "rdma_cm channel") }?);
        Ok(channel)
    }

    /// The next event, acknowledged.
    async fn next(&self) -> io::Result<CmEvent> {
        let Some(fd) = &self.fd else {
            return Err(io::ErrorKind::NotConnected.into());
        };
        loop {
            let mut guard = fd.readable().await?;
            if let Some(event) = self.try_next()? {
                return Ok(event);
            }
            guard.clear_ready();
        }
    }

    fn try_next(&self) -> io::Result<Option<CmEvent>> {
        let mut ev: *mut ffi::rdma_cm_event = ptr::null_mut();
        // SAFETY: `self.ch` is valid while self lives; `ev` receives an event we own
        // until it is acknowledged below.
        if unsafe { ffi::rdma_get_cm_event(self.ch, &mut ev) } != 0 {
            let err = io::Error::last_os_error();
            return match err.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(err),
            };
        }
        // SAFETY: `ev` is a valid event until acknowledged; the private data pointer
        // and length describe memory owned by the event. Reading the `conn` member of
        // the union is right for connection events and harmless (a null pointer or a
        // length we bound-check) for the others.
        let event = unsafe {
            let e = &*ev;
            let conn = e.param.conn;
            let private = if conn.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
                .to_vec()
            };
            CmEvent {
                kind: e.event,
                status: e.status,
                id: IdPtr(e.id),
                private,
            }
        };
        // SAFETY: acknowledges the event obtained above, once.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        Ok(Some(event))
    }

    /// Waits for `want`; anything else is an error.
    async fn expect(
        &self,
        want: ffi::rdma_cm_event_type::Type,
        what: &str,
    ) -> std::result::Result<CmEvent, String> {
        let event = self
            .next()
            .await
            .map_err(|e| format!("{what}: rdma_get_cm_event: {e}"))?;
        if event.kind == want && event.status == 0 {
            Ok(event)
        } else {
            Err(format!("{what} failed: {}", event.describe()))
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // Stop watching the descriptor before rdma-core closes it.
        self.fd = None;
        // SAFETY: the channel is valid and destroyed once; every id on it has been
        // destroyed or migrated by its owner (fields drop after their owners' ids).
        unsafe { ffi::rdma_destroy_event_channel(self.ch) };
    }
}

/// One connection's verbs resources. Built step by step; `Drop` releases whatever was
/// made, in reverse order.
struct Conn {
    id: *mut ffi::rdma_cm_id,
    pd: *mut ffi::ibv_pd,
    comp: *mut ffi::ibv_comp_channel,
    comp_fd: Option<AsyncFd<Fd>>,
    cq: *mut ffi::ibv_cq,
    qp_created: bool,
    mem: *mut [u8],
    mr: *mut ffi::ibv_mr,
    buf_len: usize,
    send_bufs: usize,
    recv_bufs: usize,
    /// The id's event channel (disconnect events); dropped after the id.
    events: EventChannel,
}

// SAFETY: verbs and rdma_cm objects may be used from any thread (rdma-core locks
// internally). The buffer memory is written by the CPU only through `RealVerbs`, which
// the engine's mutex serialises, and by the device only while a buffer is posted.
unsafe impl Send for Conn {}
// SAFETY: shared use (`&Conn`) is limited to thread-safe verbs calls and the fds.
unsafe impl Sync for Conn {}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("buf_len", &self.buf_len)
            .field("send_bufs", &self.send_bufs)
            .field("recv_bufs", &self.recv_bufs)
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// A connection owning `id` (on `events`), with no resources yet.
    fn new(events: EventChannel, id: *mut ffi::rdma_cm_id, config: &RdmaConfig) -> Conn {
        Conn {
            id,
            pd: ptr::null_mut(),
            comp: ptr::null_mut(),
            comp_fd: None,
            cq: ptr::null_mut(),
            qp_created: false,
            mem: ptr::slice_from_raw_parts_mut(ptr::null_mut(), 0),
            mr: ptr::null_mut(),
            buf_len: config.buffer_size,
            send_bufs: config.send_buffers as usize,
            recv_bufs: config.credits as usize,
            events,
        }
    }

    /// Protection domain, completion channel and queue, RC queue pair, registered
    /// buffers, all receives posted. The id must be bound to a device (address
    /// resolved, or a connection request).
    fn build(&mut self) -> std::result::Result<(), String> {
        // SAFETY: `self.id` is a valid id owned by this connection.
        let verbs = unsafe { (*self.id).verbs };
        if verbs.is_null() {
            return Err("the address is not on an RDMA device".to_string());
        }
        let entries = self.send_bufs + self.recv_bufs;
        // SAFETY: `verbs` is the id's open device context.
        self.pd = unsafe { ffi::ibv_alloc_pd(verbs) };
        if self.pd.is_null() {
            return Err(os_error("ibv_alloc_pd"));
        }
        // SAFETY: as above.
        self.comp = unsafe { ffi::ibv_create_comp_channel(verbs) };
        if self.comp.is_null() {
            return Err(os_error("ibv_create_comp_channel"));
        }
        // SAFETY: `self.comp` is valid; its fd field is plain data.
        let raw = unsafe { (*self.comp).fd };
        // SAFETY: the descriptor belongs to the completion channel, which `Drop`
        // destroys only after dropping the watcher.
        self.comp_fd = Some(unsafe { watch(raw, "completion channel") }?);
        let cqe = c_int::try_from(entries).map_err(|_| "too many buffers".to_string())?;
        // SAFETY: valid context and completion channel; no CQ context pointer.
        self.cq = unsafe { ffi::ibv_create_cq(verbs, cqe, ptr::null_mut(), self.comp, 0) };
        if self.cq.is_null() {
            return Err(os_error("ibv_create_cq"));
        }
        // SAFETY: `self.cq` is a valid CQ.
        if unsafe { ffi::ibv_req_notify_cq(self.cq, 0) } != 0 {
            return Err(os_error("ibv_req_notify_cq"));
        }
        // SAFETY: an all-zero init attr is valid; the fields that matter are set below.
        let mut attr: ffi::ibv_qp_init_attr = unsafe { mem::zeroed() };
        attr.send_cq = self.cq;
        attr.recv_cq = self.cq;
        attr.cap.max_send_wr = self.send_bufs as u32;
        attr.cap.max_recv_wr = self.recv_bufs as u32;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 1;
        // SAFETY: valid id and protection domain; `attr` outlives the call.
        if unsafe { ffi::rdma_create_qp(self.id, self.pd, &mut attr) } != 0 {
            return Err(os_error("rdma_create_qp"));
        }
        self.qp_created = true;
        let len = entries * self.buf_len;
        self.mem = Box::into_raw(vec![0u8; len].into_boxed_slice());
        // SAFETY: `self.mem` is a live allocation of `len` bytes, deregistered before
        // it is freed (Drop). Local write access only: the peer gets no rights on it.
        self.mr = unsafe {
            ffi::ibv_reg_mr(
                self.pd,
                self.mem.cast::<c_void>(),
                len,
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as c_int,
            )
        };
        if self.mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        for id in 0..self.recv_bufs {
            self.post_recv(id)?;
        }
        Ok(())
    }

    fn buf_addr(&self, index: usize) -> *mut u8 {
        self.mem.cast::<u8>().wrapping_add(index * self.buf_len)
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `self.mr` is a valid registration once `build` succeeded, which is
        // the only time buffers are posted.
        unsafe { (*self.mr).lkey }
    }

    fn qp(&self) -> *mut ffi::ibv_qp {
        // SAFETY: `self.id` is valid; its qp field is set by rdma_create_qp.
        unsafe { (*self.id).qp }
    }

    fn post_send(&self, id: usize, len: usize) -> std::result::Result<(), String> {
        let mut sge = ffi::ibv_sge {
            addr: self.buf_addr(id) as u64,
            length: len as u32,
            lkey: self.lkey(),
        };
        // SAFETY: an all-zero work request is valid (no next, no flags); the fields a
        // SEND uses are set below.
        let mut wr: ffi::ibv_send_wr = unsafe { mem::zeroed() };
        wr.wr_id = id as u64;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: valid queue pair; `wr` and `sge` live across the call (the device
        // copies them); the buffer stays registered and untouched until completion.
        let rc = unsafe { ffi::ibv_post_send(self.qp(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(format!(
                "ibv_post_send: {}",
                io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(())
    }

    fn post_recv(&self, id: usize) -> std::result::Result<(), String> {
        let mut sge = ffi::ibv_sge {
            addr: self.buf_addr(self.send_bufs + id) as u64,
            length: self.buf_len as u32,
            lkey: self.lkey(),
        };
        let mut wr = ffi::ibv_recv_wr {
            wr_id: RECV_BIT | id as u64,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: valid queue pair; `wr` and `sge` live across the call; the buffer
        // stays registered and is read by the engine only after its completion.
        let rc = unsafe { ffi::ibv_post_recv(self.qp(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(format!(
                "ibv_post_recv: {}",
                io::Error::from_raw_os_error(rc)
            ));
        }
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>) -> std::result::Result<(), String> {
        loop {
            // SAFETY: an all-zero work completion array is valid plain data.
            let mut wcs: [ffi::ibv_wc; POLL_BATCH] = unsafe { mem::zeroed() };
            // SAFETY: valid CQ; `wcs` has room for POLL_BATCH entries.
            let n = unsafe { ffi::ibv_poll_cq(self.cq, POLL_BATCH as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(format!("ibv_poll_cq failed ({n})"));
            }
            for wc in &wcs[..n as usize] {
                if wc.status != ffi::ibv_wc_status::IBV_WC_SUCCESS {
                    // SAFETY: returns a static string for any status value.
                    let text = unsafe { ffi::ibv_wc_status_str(wc.status) };
                    let status = if text.is_null() {
                        format!("status {}", wc.status)
                    } else {
                        // SAFETY: non-null static NUL-terminated string.
                        unsafe { CStr::from_ptr(text) }
                            .to_string_lossy()
                            .into_owned()
                    };
                    out.push(Completion::Failed { status });
                } else if wc.wr_id & RECV_BIT != 0 {
                    out.push(Completion::Received {
                        buf: (wc.wr_id & !RECV_BIT) as usize,
                        len: wc.byte_len as usize,
                    });
                } else {
                    out.push(Completion::Sent {
                        buf: wc.wr_id as usize,
                    });
                }
            }
            if (n as usize) < POLL_BATCH {
                return Ok(());
            }
        }
    }

    /// Drains completion channel events and re-arms the CQ. Returns false when the
    /// descriptor had nothing (a spurious wake-up).
    fn take_cq_events(&self) -> io::Result<bool> {
        let mut taken: u32 = 0;
        loop {
            let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
            let mut ctx: *mut c_void = ptr::null_mut();
            // SAFETY: valid non-blocking completion channel; outputs are written only.
            if unsafe { ffi::ibv_get_cq_event(self.comp, &mut cq, &mut ctx) } != 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(err);
            }
            taken += 1;
        }
        if taken > 0 {
            // SAFETY: acknowledges exactly the events taken above on our CQ, then
            // re-arms it; the engine polls after this, so nothing is missed.
            unsafe { ffi::ibv_ack_cq_events(self.cq, taken) };
            // SAFETY: valid CQ.
            if unsafe { ffi::ibv_req_notify_cq(self.cq, 0) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(taken > 0)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.comp_fd = None;
        // SAFETY: each object is released once, in the reverse order of creation, and
        // only if it was created; the id's events have all been acknowledged.
        unsafe {
            if self.qp_created {
                ffi::rdma_disconnect(self.id);
                ffi::rdma_destroy_qp(self.id);
            }
            if !self.mr.is_null() {
                ffi::ibv_dereg_mr(self.mr);
            }
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.comp.is_null() {
                ffi::ibv_destroy_comp_channel(self.comp);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            if !self.id.is_null() {
                ffi::rdma_destroy_id(self.id);
            }
            if !self.mem.cast::<u8>().is_null() {
                drop(Box::from_raw(self.mem));
            }
        }
    }
}

/// The engine's view of a connection.
#[derive(Debug)]
struct RealVerbs {
    conn: Arc<Conn>,
}

impl Verbs for RealVerbs {
    fn buf_len(&self) -> usize {
        self.conn.buf_len
    }

    fn send_bufs(&self) -> usize {
        self.conn.send_bufs
    }

    fn recv_bufs(&self) -> usize {
        self.conn.recv_bufs
    }

    fn send_buf(&mut self, id: usize) -> &mut [u8] {
        assert!(id < self.conn.send_bufs, "send buffer {id} out of range");
        // SAFETY: buffer `id` lies inside the live allocation the Arc keeps; only this
        // RealVerbs (one per connection, used under the engine's lock) makes references
        // to it, `&mut self` keeps them exclusive, and the engine asks only for a buffer
        // not posted, which the device does not read.
        unsafe { std::slice::from_raw_parts_mut(self.conn.buf_addr(id), self.conn.buf_len) }
    }

    fn recv_buf(&self, id: usize) -> &[u8] {
        assert!(id < self.conn.recv_bufs, "receive buffer {id} out of range");
        // SAFETY: as for `send_buf`; the engine reads a receive buffer only between its
        // completion and its next post, while the device does not write it.
        unsafe {
            std::slice::from_raw_parts(
                self.conn.buf_addr(self.conn.send_bufs + id),
                self.conn.buf_len,
            )
        }
    }

    fn post_send(&mut self, id: usize, len: usize) -> std::result::Result<(), String> {
        self.conn.post_send(id, len)
    }

    fn post_recv(&mut self, id: usize) -> std::result::Result<(), String> {
        self.conn.post_recv(id)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> std::result::Result<(), String> {
        self.conn.poll(out)
    }
}

/// Wakes the link driver on completion events and connection events.
#[derive(Debug)]
struct RealNotifier {
    conn: Arc<Conn>,
}

impl Notifier for RealNotifier {
    fn wait(&self) -> Pin<Box<dyn Future<Output = Wake> + Send + '_>> {
        Box::pin(async move {
            let Some(comp_fd) = &self.conn.comp_fd else {
                return Wake::Failed("no completion channel".into());
            };
            loop {
                tokio::select! {
                    ready = comp_fd.readable() => {
                        let mut guard = match ready {
                            Ok(g) => g,
                            Err(e) => return Wake::Failed(format!("completion channel: {e}")),
                        };
                        match self.conn.take_cq_events() {
                            Ok(true) => return Wake::Completions,
                            Ok(false) => guard.clear_ready(),
                            Err(e) => return Wake::Failed(format!("completion channel: {e}")),
                        }
                    }
                    event = self.conn.events.next() => match event {
                        Ok(e) if e.kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                            || e.kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL =>
                        {
                            return Wake::Disconnected(format!("peer disconnected ({})", e.describe()));
                        }
                        Ok(_) => {}
                        Err(e) => return Wake::Failed(format!("rdma_cm channel: {e}")),
                    },
                }
            }
        })
    }
}

fn link_params(config: &RdmaConfig, role: Role) -> LinkParams {
    LinkParams {
        transport: "rdma",
        send_queue_limit: config.tcp.send_queue_limit,
        close_timeout: config.tcp.close_timeout,
        secret: config.tcp.secret.clone(),
        handshake_timeout: config.tcp.handshake_timeout,
        role,
    }
}

fn millis(d: std::time::Duration) -> c_int {
    c_int::try_from(d.as_millis()).unwrap_or(c_int::MAX).max(1)
}

/// Sets up an RDMA connection to `target`: the connection with its receives posted and
/// the peer's announced parameters.
async fn dial(
    target: SocketAddr,
    config: &RdmaConfig,
) -> std::result::Result<(Conn, PeerParams), String> {
    let events = EventChannel::new()?;
    let mut conn = {
        let mut id: *mut ffi::rdma_cm_id = ptr::null_mut();
        // SAFETY: valid channel; `id` receives a new id, owned by `conn` right after.
        let rc = unsafe {
            ffi::rdma_create_id(
                events.ch,
                &mut id,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(os_error("rdma_create_id"));
        }
        Conn::new(events, id, config)
    };
    let step = millis(config.resolve_timeout);
    {
        let mut dst = sockaddr(target);
        // SAFETY: valid id; `dst` is a valid address for the call's duration.
        let rc = unsafe {
            ffi::rdma_resolve_addr(
                conn.id,
                ptr::null_mut(),
                (&raw mut dst).cast::<libc::sockaddr>(),
                step,
            )
        };
        if rc != 0 {
            return Err(os_error(&format!(
                "rdma_cm address resolution for {target}"
            )));
        }
    }
    conn.events
        .expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            &format!("rdma_cm address resolution for {target}"),
        )
        .await?;
    // SAFETY: valid id with a resolved address.
    if unsafe { ffi::rdma_resolve_route(conn.id, step) } != 0 {
        return Err(os_error(&format!("rdma_cm route resolution to {target}")));
    }
    conn.events
        .expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            &format!("rdma_cm route resolution to {target}"),
        )
        .await?;
    conn.build()?;
    {
        let hello = hello(config);
        // SAFETY: an all-zero connection parameter block is valid; fields set below.
        let mut param: ffi::rdma_conn_param = unsafe { mem::zeroed() };
        param.private_data = hello.as_ptr().cast::<c_void>();
        param.private_data_len = HELLO_LEN as u8;
        param.retry_count = 7;
        param.rnr_retry_count = 7;
        // SAFETY: valid id with a queue pair; `param` and `hello` outlive the call,
        // which copies the private data.
        if unsafe { ffi::rdma_connect(conn.id, &mut param) } != 0 {
            return Err(os_error(&format!("rdma_connect to {target}")));
        }
    }
    let event = conn
        .events
        .next()
        .await
        .map_err(|e| format!("rdma_connect to {target}: {e}"))?;
    match event.kind {
        ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {
            let params = parse_hello(&event.private)?;
            Ok((conn, params))
        }
        ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => Err(format!(
            "{target} refused the rdma connection (no rdma listener there?): {}",
            event.describe()
        )),
        _ => Err(format!(
            "rdma_connect to {target} failed: {}",
            event.describe()
        )),
    }
}

/// Connects over RDMA, or says why it cannot.
pub(super) async fn connect(addr: &str, config: &RdmaConfig) -> std::result::Result<Link, Setup> {
    probe().map_err(Setup::Unavailable)?;
    let target = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Setup::Unavailable(format!("resolve {addr}: {e}")))?
        .next()
        .ok_or_else(|| Setup::Unavailable(format!("resolve {addr}: no address")))?;
    let limit = config.connect_timeout;
    let (conn, params) = match tokio::time::timeout(limit, dial(target, config)).await {
        Ok(Ok(done)) => done,
        Ok(Err(why)) => return Err(Setup::Unavailable(why)),
        Err(_) => {
            return Err(Setup::Unavailable(format!(
                "no rdma connection to {target} within {limit:?}"
            )));
        }
    };
    start_link(
        conn,
        params,
        format!("rdma:{target}"),
        config,
        Role::Connector,
    )
    .await
    .map_err(Setup::Failed)
}

async fn start_link(
    conn: Conn,
    params: PeerParams,
    peer: String,
    config: &RdmaConfig,
    role: Role,
) -> Result<Link> {
    let conn = Arc::new(conn);
    let verbs = RealVerbs {
        conn: Arc::clone(&conn),
    };
    let engine = Engine::new_posted(verbs, params, peer)?;
    link::establish(engine, RealNotifier { conn }, link_params(config, role)).await
}

/// A listening `rdma_cm` id.
struct Listening {
    id: *mut ffi::rdma_cm_id,
    events: EventChannel,
}

// SAFETY: the id is used only through thread-safe librdmacm calls, by its one owner.
unsafe impl Send for Listening {}
// SAFETY: as above; shared access only waits on the event channel.
unsafe impl Sync for Listening {}

impl Drop for Listening {
    fn drop(&mut self) {
        // SAFETY: the listening id is valid and destroyed once, before its channel (a
        // field, dropped after this).
        unsafe { ffi::rdma_destroy_id(self.id) };
    }
}

/// Listens with `rdma_cm` on `addr` (the TCP listener's address), or says why not.
pub(super) async fn listen(
    addr: &str,
    config: &RdmaConfig,
) -> std::result::Result<Box<dyn Listener>, String> {
    probe()?;
    let local: SocketAddr = addr
        .parse()
        .map_err(|e| format!("rdma listen on {addr}: {e}"))?;
    let events = EventChannel::new()?;
    let mut id: *mut ffi::rdma_cm_id = ptr::null_mut();
    // SAFETY: valid channel; `id` receives a new id, owned by `listening` right after.
    if unsafe {
        ffi::rdma_create_id(
            events.ch,
            &mut id,
            ptr::null_mut(),
            ffi::rdma_port_space::RDMA_PS_TCP,
        )
    } != 0
    {
        return Err(os_error("rdma_create_id"));
    }
    let listening = Listening { id, events };
    let mut sa = sockaddr(local);
    // SAFETY: valid id; `sa` is a valid address for the call's duration.
    if unsafe { ffi::rdma_bind_addr(listening.id, (&raw mut sa).cast::<libc::sockaddr>()) } != 0 {
        return Err(os_error(&format!("rdma_bind_addr {local}")));
    }
    // SAFETY: valid bound id.
    if unsafe { ffi::rdma_listen(listening.id, LISTEN_BACKLOG) } != 0 {
        return Err(os_error(&format!("rdma_listen {local}")));
    }
    let (incoming_tx, incoming) = mpsc::channel(ACCEPT_BACKLOG);
    let task = tokio::spawn(accept_loop(listening, config.clone(), incoming_tx));
    Ok(Box::new(RdmaCmListener {
        local: local.to_string(),
        incoming: tokio::sync::Mutex::new(incoming),
        task,
    }))
}

async fn accept_loop(
    listening: Listening,
    config: RdmaConfig,
    incoming: mpsc::Sender<Result<Link>>,
) {
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            event = listening.events.next() => match event {
                Ok(e) if e.kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                    // Taken off the listener's channel at once, so the listener can be
                    // dropped with no request id left on it.
                    match adopt(e.id, &e.private, &config) {
                        Ok((conn, params)) => {
                            let incoming = incoming.clone();
                            let config = config.clone();
                            handshakes.spawn(async move {
                                let link = accept_one(conn, params, &config).await;
                                let _ = incoming.send(link).await;
                            });
                        }
                        Err(err) => {
                            let _ = incoming.send(Err(err)).await;
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = incoming
                        .send(Err(Error::io("rdma listener: rdma_get_cm_event", e)))
                        .await;
                    return;
                }
            },
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            () = incoming.closed() => return,
        }
    }
}

fn reject(id: IdPtr) {
    // SAFETY: `id` is a connection request id we own and no longer use; rejecting and
    // destroying it releases it.
    unsafe {
        ffi::rdma_reject(id.0, ptr::null(), 0);
        ffi::rdma_destroy_id(id.0);
    }
}

/// Takes a connection request: checks the peer's hello and moves the request id to a
/// channel of its own, owned by the returned connection.
fn adopt(id: IdPtr, private: &[u8], config: &RdmaConfig) -> Result<(Conn, PeerParams)> {
    let params = match parse_hello(private) {
        Ok(p) => p,
        Err(why) => {
            reject(id);
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("rdma accept: {why}"),
            ));
        }
    };
    let events = match EventChannel::new() {
        Ok(ch) => ch,
        Err(why) => {
            reject(id);
            return Err(Error::new(ErrorKind::Io, format!("rdma accept: {why}")));
        }
    };
    // SAFETY: moves our request id to its own channel (its request event was
    // acknowledged when it was read), so its events do not mix with the listener's.
    if unsafe { ffi::rdma_migrate_id(id.0, events.ch) } != 0 {
        let why = os_error("rdma_migrate_id");
        reject(id);
        return Err(Error::new(ErrorKind::Io, format!("rdma accept: {why}")));
    }
    Ok((Conn::new(events, id.0, config), params))
}

/// Accepts one connection request taken by [`adopt`].
async fn accept_one(mut conn: Conn, params: PeerParams, config: &RdmaConfig) -> Result<Link> {
    let peer = {
        // SAFETY: valid id; the destination address is plain data in its route.
        let storage = unsafe { (*conn.id).route.addr.dst_addr_union.dst_storage };
        peer_name(&storage)
    };
    let io = |why: String| Error::new(ErrorKind::Io, format!("rdma accept from {peer}: {why}"));
    if let Err(why) = conn.build() {
        // SAFETY: valid request id, rejected once; `conn` destroys it.
        unsafe { ffi::rdma_reject(conn.id, ptr::null(), 0) };
        return Err(io(why));
    }
    {
        let hello = hello(config);
        // SAFETY: an all-zero connection parameter block is valid; fields set below.
        let mut param: ffi::rdma_conn_param = unsafe { mem::zeroed() };
        param.private_data = hello.as_ptr().cast::<c_void>();
        param.private_data_len = HELLO_LEN as u8;
        param.retry_count = 7;
        param.rnr_retry_count = 7;
        // SAFETY: valid request id with a queue pair; `param` and `hello` outlive the
        // call, which copies the private data.
        if unsafe { ffi::rdma_accept(conn.id, &mut param) } != 0 {
            return Err(io(os_error("rdma_accept")));
        }
    }
    let established = tokio::time::timeout(
        config.connect_timeout,
        conn.events.expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            "rdma connection",
        ),
    )
    .await;
    match established {
        Ok(Ok(_)) => {}
        Ok(Err(why)) => return Err(io(why)),
        Err(_) => {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "rdma accept from {peer}: not established within {:?}",
                    config.connect_timeout
                ),
            ));
        }
    }
    start_link(conn, params, format!("rdma:{peer}"), config, Role::Acceptor).await
}

fn peer_name(storage: &libc::sockaddr_storage) -> String {
    match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            SocketAddr::from((ip, u16::from_be(sin.sin_port))).to_string()
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            SocketAddr::from((ip, u16::from_be(sin6.sin6_port))).to_string()
        }
        _ => "unknown".to_string(),
    }
}

/// The `rdma_cm` side of an [`RdmaTransport`](super::RdmaTransport) listener.
struct RdmaCmListener {
    local: String,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Result<Link>>>,
    task: JoinHandle<()>,
}

impl fmt::Debug for RdmaCmListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaCmListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Listener for RdmaCmListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(async move {
            match self.incoming.lock().await.recv().await {
                Some(link) => link,
                None => Err(Error::new(
                    ErrorKind::Closed,
                    format!("rdma listener {}: stopped", self.local),
                )),
            }
        })
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

impl Drop for RdmaCmListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}
