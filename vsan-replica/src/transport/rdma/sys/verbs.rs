//! Safe wrappers over the verbs objects one connection owns: the `rdma_cm` event
//! channel, the connection (id, protection domain, completion queue, queue pair and
//! registered buffer pool), and the [`Verbs`] and [`Notifier`] the engine and the link
//! drive them through.

use std::ffi::CStr;
use std::fmt;
use std::future::Future;
use std::io;
use std::mem;
use std::os::fd::{AsRawFd, RawFd};
use std::os::raw::{c_int, c_void};
use std::pin::Pin;
use std::ptr;
use std::sync::Arc;

use rdma_sys as ffi;
use tokio::io::unix::AsyncFd;
use vsan_core::{Error, ErrorKind, Result};

use super::super::RdmaConfig;
use super::super::engine::{Completion, Verbs};
use super::super::link::{Notifier, Wake};
use super::{POLL_BATCH, RECV_BIT, event_name, os_error, watch};

/// A file descriptor owned by rdma-core, watched by tokio.
#[derive(Debug)]
pub(super) struct Fd(pub(super) RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A connection manager id; only ever used through the connection that owns it.
#[derive(Debug, Clone, Copy)]
pub(super) struct IdPtr(pub(super) *mut ffi::rdma_cm_id);

// SAFETY: an rdma_cm id may be used from any thread (librdmacm locks internally); the
// pointer is only passed to librdmacm and owned by exactly one holder.
unsafe impl Send for IdPtr {}

/// One `rdma_cm` event, copied out before it is acknowledged.
#[derive(Debug)]
pub(super) struct CmEvent {
    pub(super) kind: ffi::rdma_cm_event_type::Type,
    pub(super) status: c_int,
    pub(super) id: IdPtr,
    pub(super) private: Vec<u8>,
}

impl CmEvent {
    pub(super) fn describe(&self) -> String {
        format!("{} (status {})", event_name(self.kind), self.status)
    }
}

/// An `rdma_cm` event channel with a non-blocking descriptor tokio watches.
pub(super) struct EventChannel {
    pub(super) ch: *mut ffi::rdma_event_channel,
    pub(super) fd: Option<AsyncFd<Fd>>,
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
    pub(super) fn new() -> Result<EventChannel> {
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
    pub(super) async fn next(&self) -> io::Result<CmEvent> {
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

    pub(super) fn try_next(&self) -> io::Result<Option<CmEvent>> {
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
    pub(super) async fn expect(
        &self,
        want: ffi::rdma_cm_event_type::Type,
        what: &str,
    ) -> Result<CmEvent> {
        let event = self
            .next()
            .await
            .map_err(|e| verbs_error(format!("{what}: rdma_get_cm_event: {e}")))?;
        if event.kind == want && event.status == 0 {
            Ok(event)
        } else {
            Err(verbs_error(format!("{what} failed: {}", event.describe())))
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
pub(super) struct Conn {
    pub(super) id: *mut ffi::rdma_cm_id,
    pub(super) pd: *mut ffi::ibv_pd,
    pub(super) comp: *mut ffi::ibv_comp_channel,
    pub(super) comp_fd: Option<AsyncFd<Fd>>,
    pub(super) cq: *mut ffi::ibv_cq,
    pub(super) qp_created: bool,
    pub(super) mem: *mut [u8],
    pub(super) mr: *mut ffi::ibv_mr,
    pub(super) buf_len: usize,
    pub(super) send_bufs: usize,
    pub(super) recv_bufs: usize,
    /// The id's event channel (disconnect events); dropped after the id.
    pub(super) events: EventChannel,
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
    pub(super) fn new(events: EventChannel, id: *mut ffi::rdma_cm_id, config: &RdmaConfig) -> Conn {
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
    pub(super) fn build(&mut self) -> Result<()> {
        // SAFETY: `self.id` is a valid id owned by this connection.
        let verbs = unsafe { (*self.id).verbs };
        if verbs.is_null() {
            return Err(Error::new(
                ErrorKind::NotSupported,
                "the address is not on an RDMA device",
            ));
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
        let cqe = c_int::try_from(entries)
            .map_err(|_| Error::new(ErrorKind::InvalidArgument, "too many buffers"))?;
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

    pub(super) fn buf_addr(&self, index: usize) -> *mut u8 {
        self.mem.cast::<u8>().wrapping_add(index * self.buf_len)
    }

    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: `self.mr` is a valid registration once `build` succeeded, which is
        // the only time buffers are posted.
        unsafe { (*self.mr).lkey }
    }

    pub(super) fn qp(&self) -> *mut ffi::ibv_qp {
        // SAFETY: `self.id` is valid; its qp field is set by rdma_create_qp.
        unsafe { (*self.id).qp }
    }

    pub(super) fn post_send(&self, id: usize, len: usize) -> Result<()> {
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
            return Err(verbs_error(format!(
                "ibv_post_send: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    pub(super) fn post_recv(&self, id: usize) -> Result<()> {
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
            return Err(verbs_error(format!(
                "ibv_post_recv: {}",
                io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    pub(super) fn poll(&self, out: &mut Vec<Completion>) -> Result<()> {
        loop {
            // SAFETY: an all-zero work completion array is valid plain data.
            let mut wcs: [ffi::ibv_wc; POLL_BATCH] = unsafe { mem::zeroed() };
            // SAFETY: valid CQ; `wcs` has room for POLL_BATCH entries.
            let n = unsafe { ffi::ibv_poll_cq(self.cq, POLL_BATCH as c_int, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(verbs_error(format!("ibv_poll_cq failed ({n})")));
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
    pub(super) fn take_cq_events(&self) -> io::Result<bool> {
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
pub(super) struct RealVerbs {
    pub(super) conn: Arc<Conn>,
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

    fn post_send(&mut self, id: usize, len: usize) -> Result<()> {
        self.conn.post_send(id, len)
    }

    fn post_recv(&mut self, id: usize) -> Result<()> {
        self.conn.post_recv(id)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        self.conn.poll(out)
    }
}

/// Wakes the link driver on completion events and connection events.
#[derive(Debug)]
pub(super) struct RealNotifier {
    pub(super) conn: Arc<Conn>,
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

/// A verbs or `rdma_cm` call that failed: [`Io`](ErrorKind::Io).
fn verbs_error(why: String) -> Error {
    Error::new(ErrorKind::Io, why)
}
