//! A link over the shared memory: what both halves share, the sending half's
//! [`StreamSink`] (the ring this side writes) and the receiving half's [`StreamSource`]
//! (the ring this side reads).

use std::io;
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use socket2::SockRef;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;
use vsan_core::{Error, ErrorKind, Result};

use super::doorbell::{Bell, Bells};
use super::doorbell::{drain_bell, ring_bell};
use super::region::Region;
use super::ring::Ring;
use super::{MAX_BATCH_BYTES, MAX_BATCH_PARTS, SPIN_CHECKS, ShmConfig, protocol};
use crate::transport::stream_rx::{StreamSource, stream_link};
use crate::transport::stream_tx::{StreamSink, frame_parts};
use crate::transport::{Link, remember};
use crate::wire::Frame;

/// Which end of the link this side is: the connector writes ring 0 and reads ring 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Connector,
    Acceptor,
}

/// What both halves of a link share.
#[derive(Debug)]
pub(super) struct Conn {
    sock: UnixStream,
    data_wait: AsyncFd<OwnedFd>,
    room_wait: AsyncFd<OwnedFd>,
    peer_data: OwnedFd,
    peer_room: OwnedFd,
    /// The ring this side writes.
    tx_ring: Ring,
    /// The ring this side reads.
    rx_ring: Ring,
    busy_poll: Option<Duration>,
    peer: String,
    /// Set once the link is over as a whole (peer gone, protocol error, close timeout).
    down: AtomicBool,
    /// Why, for every later call.
    down_reason: Mutex<Option<(ErrorKind, String)>>,
}

impl Conn {
    pub(super) fn new(
        sock: UnixStream,
        region: &Arc<Region>,
        side: Side,
        bells: Bells,
        config: &ShmConfig,
        peer: String,
    ) -> io::Result<Conn> {
        let (tx, rx) = match side {
            Side::Connector => (0, 1),
            Side::Acceptor => (1, 0),
        };
        // SAFETY: an `OwnedFd` stays open, and names the same descriptor, until dropped.
        let data_wait =
            unsafe { AsyncFd::register_with_interest(bells.data_wait, Interest::READABLE) }?;
        // SAFETY: as above.
        let room_wait =
            unsafe { AsyncFd::register_with_interest(bells.room_wait, Interest::READABLE) }?;
        Ok(Conn {
            sock,
            data_wait,
            room_wait,
            peer_data: bells.peer_data,
            peer_room: bells.peer_room,
            tx_ring: Ring::new(region, tx),
            rx_ring: Ring::new(region, rx),
            busy_poll: config.busy_poll.filter(|d| !d.is_zero()),
            peer,
            down: AtomicBool::new(false),
            down_reason: Mutex::new(None),
        })
    }

    pub(super) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    pub(super) fn down_error(&self) -> Option<Error> {
        if !self.is_down() {
            return None;
        }
        let reason = self.down_reason.lock();
        let (kind, text) = reason.as_ref()?;
        Some(Error::new(*kind, text.clone()))
    }

    pub(super) fn check_up(&self) -> Result<()> {
        match self.down_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Ends the link as a whole: every later call on either half fails with `err`'s kind
    /// and text (the first reason wins), and the socket is shut down so the peer (and
    /// our own waiters) see it.
    pub(super) fn tear_down(&self, err: &Error) {
        {
            let mut reason = self.down_reason.lock();
            if reason.is_none() {
                *reason = Some(remember(err));
            }
            self.down.store(true, Ordering::Release);
        }
        let _ = SockRef::from(&self.sock).shutdown(Shutdown::Both);
    }

    /// The control socket became readable: the peer hung up, or wrote to it (which the
    /// protocol never does after the handshake).
    pub(super) fn check_socket(&self) {
        let mut byte = [MaybeUninit::<u8>::uninit(); 1];
        let peeked = self.sock.try_io(Interest::READABLE, || {
            SockRef::from(&self.sock).peek(&mut byte)
        });
        match peeked {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(0) => self.tear_down(&Error::new(
                ErrorKind::Closed,
                format!("{}: the peer closed the link", self.peer),
            )),
            Ok(_) => self.tear_down(&protocol(
                &self.peer,
                "the peer wrote to the control socket after the handshake",
            )),
            Err(e) => self.tear_down(&Error::io(format!("{}: control socket", self.peer), e)),
        }
    }

    /// Waits until `bell` rings or the control socket wakes (it then notes the link is
    /// down). May return spuriously; callers check their condition again.
    pub(super) async fn wait_bell(&self, bell: &AsyncFd<OwnedFd>) {
        tokio::select! {
            ready = bell.readable() => match ready {
                Ok(mut guard) => match drain_bell(guard.get_inner()) {
                    Ok(Bell::Drained) => guard.clear_ready(),
                    Ok(Bell::More) => {}
                    Ok(Bell::Hangup) => self.tear_down(&Error::new(
                        ErrorKind::Closed,
                        format!("{}: the peer closed the link", self.peer),
                    )),
                    Err(e) => self.tear_down(&Error::io(format!("{}: doorbell", self.peer), e)),
                },
                Err(e) => self.tear_down(&Error::io(format!("{}: doorbell", self.peer), e)),
            },
            ready = self.sock.readable() => match ready {
                Ok(()) => self.check_socket(),
                Err(e) => self.tear_down(&Error::io(format!("{}: control socket", self.peer), e)),
            },
        }
    }
}

/// Busy-polls for up to `budget` until `ready` holds; returns whether it did.
///
/// Each poll checks `ready` a few times, then asks to be polled again at once and
/// returns, so the worker runs its other tasks (the mirror's own) between rounds and
/// never parks: a message from the peer then needs no wake-up. (Spinning through the
/// whole budget inside one poll held the worker away from the tasks that make the next
/// message: in the mirror that was ten times slower than not spinning at all.)
pub(super) async fn spin_until(budget: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    std::future::poll_fn(|cx| {
        for _ in 0..SPIN_CHECKS {
            if ready() {
                return std::task::Poll::Ready(true);
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= budget {
            return std::task::Poll::Ready(ready());
        }
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await
}

pub(super) fn link_over(conn: Conn, config: &ShmConfig) -> Link {
    let conn = Arc::new(conn);
    let sink = ShmSink {
        ring: conn.tx_ring.clone(),
        conn: Arc::clone(&conn),
        tail: AtomicU64::new(0),
    };
    let source = ShmSource {
        ring: conn.rx_ring.clone(),
        conn,
        head: 0,
    };
    stream_link(
        sink,
        source,
        BytesMut::new(),
        config.send_queue_limit,
        config.close_timeout,
    )
}

// ----- sending -----

/// The shared-memory end of a link's sending half: the ring this side writes.
#[derive(Debug)]
pub(super) struct ShmSink {
    conn: Arc<Conn>,
    ring: Ring,
    /// This side's tail, in private memory; only the current writer touches it.
    tail: AtomicU64,
}

impl ShmSink {
    pub(super) fn peer(&self) -> &str {
        &self.conn.peer
    }

    /// Copies as many bytes of `parts` as the ring has room for, publishes them and wakes
    /// the peer if it sleeps; returns how many. Only the current writer calls this.
    pub(super) fn write_parts<'p>(&self, parts: impl Iterator<Item = &'p [u8]>) -> Result<usize> {
        let tail = self.tail.load(Ordering::Relaxed);
        let mut room = match self.ring.room(tail) {
            Ok(room) => room as usize,
            Err(why) => {
                let err = why.context_prefix(self.peer());
                self.conn.tear_down(&err);
                return Err(err);
            }
        };
        let mut pos = tail;
        for part in parts {
            if room == 0 {
                break;
            }
            let n = part.len().min(room);
            self.ring.copy_in(pos, &part[..n]);
            pos = pos.wrapping_add(n as u64);
            room -= n;
        }
        let done = pos.wrapping_sub(tail) as usize;
        if done > 0 {
            self.tail.store(pos, Ordering::Relaxed);
            self.ring.tail().store(pos, Ordering::Release);
            fence(Ordering::SeqCst);
            let sleeping = self.ring.consumer_sleeping();
            if sleeping.load(Ordering::Relaxed) != 0 && sleeping.swap(0, Ordering::Relaxed) != 0 {
                ring_bell(&self.conn.peer_data);
            }
        }
        Ok(done)
    }

    /// Whether the ring has room (errors count as ready: the caller sees them next).
    pub(super) fn ring_has_room(&self) -> bool {
        let tail = self.tail.load(Ordering::Relaxed);
        self.check_link().is_err() || self.ring.room(tail).map_or(true, |r| r > 0)
    }

    /// The writer task waits here while the ring is full.
    pub(super) async fn wait_for_ring(&self) -> Result<()> {
        let mut spun = false;
        loop {
            self.check_link()?;
            if self.ring_has_room() {
                return Ok(());
            }
            if let (Some(budget), false) = (self.conn.busy_poll, spun) {
                spun = true;
                if spin_until(budget, || self.ring_has_room()).await {
                    continue;
                }
            }
            let sleeping = self.ring.producer_sleeping();
            sleeping.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if !self.ring_has_room() {
                self.conn.wait_bell(&self.conn.room_wait).await;
            }
            sleeping.store(0, Ordering::Relaxed);
        }
    }
}

impl StreamSink for ShmSink {
    const TRANSPORT: &'static str = "shm";
    const WRITES_INLINE: bool = true;
    const FAILURE_DROPS_QUEUE: bool = false;
    const CLOSE_UNDONE: &'static str = "sent";

    fn batch_limits(&self) -> (usize, usize) {
        (
            MAX_BATCH_PARTS,
            MAX_BATCH_BYTES.min(self.ring.size() as usize),
        )
    }

    /// Fails when the link can no longer carry what is sent.
    fn check_link(&self) -> Result<()> {
        self.conn.check_up()?;
        if self.ring.consumer_gone().load(Ordering::Acquire) != 0 {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{}: send: the peer no longer receives", self.peer()),
            ));
        }
        Ok(())
    }

    fn write_now(&self, frames: &[Frame]) -> Result<usize> {
        self.write_parts(frame_parts(frames, 0))
    }

    async fn write(&self, batch: &mut [Bytes]) -> Result<usize> {
        loop {
            let n = self.write_parts(batch.iter().map(|b| &b[..]))?;
            if n > 0 {
                return Ok(n);
            }
            self.wait_for_ring().await?;
        }
    }

    /// Marks the ring closed and wakes the peer.
    fn shut(&self) -> Result<()> {
        self.ring.closed().store(1, Ordering::Release);
        ring_bell(&self.conn.peer_data);
        Ok(())
    }

    /// Gives up on the link as a whole.
    fn abandon(&self) {
        self.conn.tear_down(&Error::new(
            ErrorKind::Closed,
            format!("{}: link closed by this side", self.peer()),
        ));
    }
}

// ----- receiving -----

/// The shared-memory end of a link's receiving half: the ring this side reads.
#[derive(Debug)]
pub(super) struct ShmSource {
    conn: Arc<Conn>,
    ring: Ring,
    /// This side's head, in private memory.
    head: u64,
}

impl ShmSource {
    /// Copies everything in the ring into `buf` and frees it; returns how much.
    pub(super) fn pull(&mut self, buf: &mut BytesMut) -> Result<usize> {
        let (avail, tail) = match self.ring.available(self.head) {
            Ok(found) => found,
            Err(why) => {
                let err = why.context_prefix(&self.conn.peer);
                self.conn.tear_down(&err);
                return Err(err);
            }
        };
        if avail == 0 {
            return Ok(0);
        }
        let n = avail as usize;
        buf.reserve(n);
        let copied = self
            .ring
            .copy_out(self.head, &mut buf.spare_capacity_mut()[..n]);
        debug_assert_eq!(copied, n);
        // SAFETY: `copy_out` initialised the first `copied` bytes of the spare capacity.
        unsafe { buf.set_len(buf.len() + copied) };
        self.head = tail;
        self.ring.head().store(tail, Ordering::Release);
        fence(Ordering::SeqCst);
        let sleeping = self.ring.producer_sleeping();
        if sleeping.load(Ordering::Relaxed) != 0 && sleeping.swap(0, Ordering::Relaxed) != 0 {
            ring_bell(&self.conn.peer_room);
        }
        Ok(n)
    }

    /// Whether waiting is over: data, the end of the stream, or the link down.
    pub(super) fn ready(&self) -> bool {
        self.ring.tail().load(Ordering::Acquire) != self.head
            || self.ring.closed().load(Ordering::Acquire) != 0
            || self.conn.is_down()
    }

    pub(super) async fn wait(&self) {
        if let Some(budget) = self.conn.busy_poll {
            if spin_until(budget, || self.ready()).await {
                return;
            }
        }
        let sleeping = self.ring.consumer_sleeping();
        sleeping.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if !self.ready() {
            self.conn.wait_bell(&self.conn.data_wait).await;
        }
        sleeping.store(0, Ordering::Relaxed);
    }

    /// How the stream's end is reported, `buffered` bytes of an unfinished frame left.
    pub(super) fn end_error(&self, mut err: Error, buffered: usize) -> Error {
        if err.kind() == ErrorKind::Closed && buffered > 0 {
            err = Error::new(
                ErrorKind::Closed,
                format!(
                    "{}: the peer closed the link in the middle of a frame ({buffered} bytes \
                     of it received)",
                    self.conn.peer,
                ),
            );
        }
        err
    }
}

impl StreamSource for ShmSource {
    fn peer(&self) -> &str {
        &self.conn.peer
    }

    async fn fill(&mut self, buf: &mut BytesMut) -> Result<()> {
        loop {
            if self.pull(buf)? > 0 {
                return Ok(());
            }
            // The ring is empty. The flag is read before the tail again, so a close seen
            // here comes after every byte the peer wrote.
            let closed = self.ring.closed().load(Ordering::Acquire) != 0;
            let down = self.conn.down_error();
            if closed || down.is_some() {
                if self.pull(buf)? > 0 {
                    return Ok(());
                }
                let err = match down {
                    Some(err) if !closed => err,
                    _ => Error::new(
                        ErrorKind::Closed,
                        format!("{}: the peer closed the link", self.conn.peer),
                    ),
                };
                return Err(self.end_error(err, buf.len()));
            }
            self.wait().await;
        }
    }

    fn distrust(&mut self, err: &Error) {
        self.conn.tear_down(err);
    }
}

impl Drop for ShmSource {
    fn drop(&mut self) {
        self.ring.consumer_gone().store(1, Ordering::Release);
        ring_bell(&self.conn.peer_room);
    }
}
