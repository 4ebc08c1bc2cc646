//! The TCP transport: tokio sockets with `TCP_NODELAY`, the [`crate::wire`] codec,
//! and optional peer authentication.
//!
//! # Sending
//!
//! `send` encodes the message (the data is shared, never copied into a frame buffer),
//! and when nothing is queued it writes the frame to the socket at once, without
//! waiting, in one vectored non-blocking write of header + meta and data: a QD1 write
//! costs no task switch. When the socket is full or other frames are queued, the frame
//! joins a queue that a writer task drains with vectored writes of many frames at once,
//! so frames batch exactly when they pile up. The only copy of a payload on this side is
//! the kernel's.
//!
//! # Receiving
//!
//! `recv` reads into one buffer and decodes frames from it; the data of a write or read
//! reply is a slice of that buffer, not a copy. Anything the codec refuses (garbage, a
//! bad crc, an oversized frame) fails `recv` with
//! [`Protocol`](vsan_core::ErrorKind::Protocol) and shuts the socket in both directions:
//! the peer is not trusted again on this connection.
//!
//! # Authentication
//!
//! With [`TcpConfig::secret`] set, `connect` and `accept` run an HMAC-SHA256 challenge
//! before the link is handed out; both nodes must set the same secret:
//!
//! ```text
//!   connector                                   acceptor
//!   AuthChallenge{nonce_c}  ────────▶  ◀─────── AuthChallenge{nonce_a}
//!   AuthResponse{mac(C, nonce_a, nonce_c)} ──▶ ◀── AuthResponse{mac(A, nonce_c, nonce_a)}
//!   check the acceptor's mac                    check the connector's mac
//!
//!   mac(role, challenge, own) =
//!       HMAC-SHA256(secret, "vsan-replica auth v1" | role | challenge | own)
//! ```
//!
//! Nonces are 32 fresh random bytes, so a recorded exchange cannot be replayed, and the
//! role byte keeps one side's answer from being reflected back as the other's. A wrong
//! or missing secret on either side is refused on both: `connect` and `accept` fail
//! with [`Protocol`](vsan_core::ErrorKind::Protocol) (a silent peer with
//! [`Timeout`](vsan_core::ErrorKind::Timeout)). This proves who connected; it does not
//! encrypt or protect the stream afterwards (that is what QUIC with mutual TLS is for).

use std::fmt;
use std::io::{self, IoSlice};
use std::net::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::auth::{self, Role};
use super::txqueue::{AcceptQueue, FrameQueue, remember};
use super::{Link, LinkRx, LinkTx, Listener, QueueDepth, Transport};
use crate::wire::Message;
use crate::wire::{self, Frame};

/// Most slices handed to one vectored write.
const MAX_IOVECS: usize = 64;
/// Most bytes handed to one vectored write.
const MAX_BATCH_BYTES: usize = 1 << 20;
/// The receive buffer grows by this much when it runs low.
const READ_CHUNK: usize = 64 * 1024;
/// Below this much free room, the receive buffer grows before the next read.
const READ_MIN_ROOM: usize = 4 * 1024;
/// Pause after a failed `accept` (e.g. out of file descriptors) before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);
/// Incoming links accepted and authenticated but not yet taken by `accept`.
const ACCEPT_BACKLOG: usize = 16;

/// Writes that hit a peer which has gone report an error instead of raising SIGPIPE, so
/// a C or Go program embedding the library is not killed by one.
#[cfg(any(target_os = "linux", target_os = "android"))]
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const SEND_FLAGS: libc::c_int = 0;

/// A secret both nodes know, for [`TcpConfig::secret`]. Its bytes never appear in
/// `Debug` output.
#[derive(Clone)]
pub struct SharedSecret(Arc<[u8]>);

impl SharedSecret {
    /// A secret from its bytes; fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) when empty.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<SharedSecret> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "shared secret: empty",
            ));
        }
        Ok(SharedSecret(Arc::from(secret)))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedSecret(<redacted>)")
    }
}

/// Settings of a [`TcpTransport`]. Start from `TcpConfig::default()` and set fields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TcpConfig {
    /// When set, both sides prove they know this secret before a link opens (see
    /// "Authentication" in the [module docs](self)); a peer without it, or with
    /// another, is refused on both sides. Both nodes must set the same secret, or none.
    pub secret: Option<SharedSecret>,
    /// How long `connect` waits for the TCP connection (default 5 s).
    pub connect_timeout: Duration,
    /// How long the authentication exchange may take, on either side (default 5 s).
    pub handshake_timeout: Duration,
    /// Bytes a link may queue before `send` waits for the socket to take some (default
    /// 16 MiB). A single larger message is still accepted.
    pub send_queue_limit: usize,
    /// How long `close` waits for queued messages to go out before it drops them and
    /// fails with [`Timeout`](vsan_core::ErrorKind::Timeout) (default 5 s), so closing
    /// a link to a peer that stopped reading never hangs.
    pub close_timeout: Duration,
}

impl Default for TcpConfig {
    fn default() -> TcpConfig {
        TcpConfig {
            secret: None,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            send_queue_limit: 16 << 20,
            close_timeout: Duration::from_secs(5),
        }
    }
}

/// Replication links over TCP. Addresses are `host:port` (`"127.0.0.1:7002"`).
#[derive(Debug, Clone, Default)]
pub struct TcpTransport {
    config: Arc<TcpConfig>,
}

impl TcpTransport {
    /// A transport with the default settings (no authentication).
    pub fn new() -> TcpTransport {
        TcpTransport::default()
    }

    /// A transport with `config`.
    pub fn with_config(config: TcpConfig) -> TcpTransport {
        TcpTransport {
            config: Arc::new(config),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        Box::pin(async move {
            let limit = self.config.connect_timeout;
            let stream = match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return Err(Error::io(format!("tcp connect {addr}"), e)),
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("tcp connect {addr}: no connection within {limit:?}"),
                    ));
                }
            };
            establish(stream, Role::Connector, &self.config).await
        })
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        Box::pin(async move {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| Error::io(format!("tcp listen {addr}"), e))?;
            let local = listener
                .local_addr()
                .map_err(|e| Error::io(format!("tcp listen {addr}"), e))?;
            let (incoming_tx, incoming) =
                AcceptQueue::new(format!("tcp listener {local}"), ACCEPT_BACKLOG);
            let task = tokio::spawn(accept_loop(listener, Arc::clone(&self.config), incoming_tx));
            Ok(Box::new(TcpLinkListener {
                local: local.to_string(),
                incoming,
                task,
            }) as Box<dyn Listener>)
        })
    }
}

/// Turns a connected socket into a link: `TCP_NODELAY`, authentication when configured.
async fn establish(mut stream: TcpStream, role: Role, config: &TcpConfig) -> Result<Link> {
    let peer = match stream.peer_addr() {
        Ok(addr) => format!("tcp:{addr}"),
        Err(e) => return Err(Error::io("tcp: peer address", e)),
    };
    stream
        .set_nodelay(true)
        .map_err(|e| Error::io(format!("{peer}: set TCP_NODELAY"), e))?;
    let received = match &config.secret {
        None => BytesMut::new(),
        Some(secret) => {
            let limit = config.handshake_timeout;
            let exchange = auth::authenticate(&mut stream, secret, role, &peer);
            match tokio::time::timeout(limit, exchange).await {
                Ok(result) => result?,
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("{peer}: peer authentication not done within {limit:?}"),
                    ));
                }
            }
        }
    };
    let stream = Arc::new(stream);
    let shared = Arc::new(TxShared {
        stream: Arc::clone(&stream),
        state: Mutex::new(TxState::default()),
        work: Notify::new(),
        progress: Notify::new(),
        limit: config.send_queue_limit,
        close_timeout: config.close_timeout,
        peer: peer.clone(),
    });
    let writer = tokio::spawn(write_loop(Arc::clone(&shared)));
    let tx = TcpTx { shared, writer };
    let rx = TcpRx {
        stream,
        buf: received,
        failed: None,
        peer,
    };
    Ok(Link::new(Box::new(tx), Box::new(rx)))
}

async fn accept_loop(
    listener: TcpListener,
    config: Arc<TcpConfig>,
    incoming: mpsc::Sender<Result<Link>>,
) {
    // Handshakes run beside the accept loop, so a slow or silent peer cannot hold up
    // the next one; they end with the loop when the listener is dropped.
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let incoming = incoming.clone();
                    let config = Arc::clone(&config);
                    handshakes.spawn(async move {
                        let link = establish(stream, Role::Acceptor, &config).await;
                        // The listener may be gone; the link then just closes.
                        let _ = incoming.send(link).await;
                    });
                }
                Err(e) => {
                    let err = Error::io("tcp accept", e);
                    if incoming.send(Err(err)).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            },
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            () = incoming.closed() => return,
        }
    }
}

/// The listening side of a [`TcpTransport`].
struct TcpLinkListener {
    local: String,
    incoming: AcceptQueue,
    task: JoinHandle<()>,
}

impl fmt::Debug for TcpLinkListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpLinkListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Listener for TcpLinkListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(self.incoming.next())
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

impl Drop for TcpLinkListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Who may write to the socket right now; exactly one writer keeps frames in order.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// Nobody: the queue is empty and the next `send` writes directly.
    #[default]
    Idle,
    /// A `send` is writing its frame directly.
    Inline,
    /// The writer task is draining the queue.
    Task,
}

#[derive(Debug, Default)]
struct TxState {
    /// Frames not yet written, and the first error.
    q: FrameQueue,
    writer: Writer,
    /// `close` was called: no more sends.
    closing: bool,
    /// The write side has been shut down.
    shut: bool,
}

impl TxState {
    fn check_open(&self, peer: &str) -> Result<()> {
        self.q.check_failed()?;
        if self.closing {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{peer}: send: link closed by this side"),
            ));
        }
        Ok(())
    }

    fn fail(&mut self, peer: &str, e: io::Error) -> Error {
        self.q.fail(Error::io(format!("{peer}: send"), e))
    }
}

#[derive(Debug)]
struct TxShared {
    stream: Arc<TcpStream>,
    state: Mutex<TxState>,
    /// Wakes the writer task when it owns a non-empty queue.
    work: Notify,
    /// Wakes senders waiting for room and `close` waiting for the queue to drain.
    progress: Notify,
    limit: usize,
    close_timeout: Duration,
    peer: String,
}

impl TxShared {
    /// Queues `frame`, or writes it at once when the socket is idle. Returns whether the
    /// queue is now above the limit.
    fn enqueue(&self, frame: Frame) -> Result<bool> {
        self.enqueue_many(vec![frame])
    }

    /// Queues `frames` in order, writing as many as the socket takes at once when it is
    /// idle (one vectored write for the lot). Returns whether the queue is now above the
    /// limit.
    fn enqueue_many(&self, frames: Vec<Frame>) -> Result<bool> {
        let mut st = self.state.lock();
        st.check_open(&self.peer)?;
        if st.writer != Writer::Idle {
            for f in frames {
                st.q.push(f);
            }
            return Ok(st.q.bytes > self.limit);
        }
        // Idle means the queue is empty: these frames are next on the wire.
        st.writer = Writer::Inline;
        drop(st);
        let written = write_now_many(&self.stream, &frames);
        let mut st = self.state.lock();
        match written {
            Ok(mut n) => {
                // Frames queued meanwhile go after these.
                let mut rest = Vec::new();
                for f in frames {
                    if n >= f.len() {
                        n -= f.len();
                    } else {
                        rest.push((f, n));
                        n = 0;
                    }
                }
                for (f, partial) in rest.into_iter().rev() {
                    st.q.bytes += f.len() - partial;
                    st.q.frames.push_front(f);
                    st.q.front_written = partial;
                }
            }
            Err(e) => {
                st.writer = Writer::Idle;
                let err = st.fail(&self.peer, e);
                drop(st);
                self.progress.notify_waiters();
                return Err(err);
            }
        }
        if st.q.frames.is_empty() {
            st.writer = Writer::Idle;
            if st.closing {
                self.progress.notify_waiters();
            }
        } else {
            st.writer = Writer::Task;
            self.work.notify_one();
        }
        Ok(st.q.bytes > self.limit)
    }

    /// Waits until the queue is at most the limit.
    async fn wait_for_room(&self) -> Result<()> {
        loop {
            let progress = self.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            {
                let st = self.state.lock();
                st.q.check_failed()?;
                if st.q.bytes <= self.limit {
                    return Ok(());
                }
            }
            progress.await;
        }
    }

    fn shutdown_write(&self) -> io::Result<()> {
        SockRef::from(&*self.stream).shutdown(Shutdown::Write)
    }
}

/// Writes as much of `frames` (in order) as the socket takes without waiting, up to 64
/// slices per system call; returns the bytes written.
fn write_now_many(stream: &TcpStream, frames: &[Frame]) -> io::Result<usize> {
    let total: usize = frames.iter().map(Frame::len).sum();
    let mut done = 0;
    while done < total {
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(64);
        let mut skip = done;
        'fill: for f in frames {
            for part in [f.head(), f.data()] {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                slices.push(IoSlice::new(&part[skip..]));
                skip = 0;
                if slices.len() == 64 {
                    break 'fill;
                }
            }
        }
        let sent = stream.try_io(Interest::WRITABLE, || {
            SockRef::from(stream).send_vectored_with_flags(&slices, SEND_FLAGS)
        });
        match sent {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The parts of `frame` after its first `skip` bytes, into `out`; returns how many.
fn unwritten(frame: &Frame, mut skip: usize, out: &mut [Bytes; 2]) -> usize {
    let mut count = 0;
    for part in [frame.head(), frame.data()] {
        if skip >= part.len() {
            skip -= part.len();
            continue;
        }
        out[count] = part.slice(skip..);
        skip = 0;
        count += 1;
    }
    count
}

/// Drains the queue whenever `enqueue` hands it over, many frames per write.
async fn write_loop(shared: Arc<TxShared>) {
    let mut batch: Vec<Bytes> = Vec::with_capacity(MAX_IOVECS);
    loop {
        shared.work.notified().await;
        loop {
            batch.clear();
            {
                let mut st = shared.state.lock();
                if st.writer != Writer::Task || st.q.failed.is_some() {
                    break;
                }
                let mut skip = st.q.front_written;
                let mut bytes = 0;
                for frame in &st.q.frames {
                    let mut parts = [Bytes::new(), Bytes::new()];
                    let count = unwritten(frame, skip, &mut parts);
                    skip = 0;
                    for part in parts.into_iter().take(count) {
                        bytes += part.len();
                        batch.push(part);
                    }
                    if batch.len() + 2 > MAX_IOVECS || bytes >= MAX_BATCH_BYTES {
                        break;
                    }
                }
                if batch.is_empty() {
                    st.writer = Writer::Idle;
                    drop(st);
                    shared.progress.notify_waiters();
                    break;
                }
            }
            let slices: Vec<IoSlice<'_>> = batch.iter().map(|b| IoSlice::new(b)).collect();
            let sent = shared
                .stream
                .async_io(Interest::WRITABLE, || {
                    SockRef::from(&*shared.stream).send_vectored_with_flags(&slices, SEND_FLAGS)
                })
                .await;
            let mut st = shared.state.lock();
            match sent {
                Ok(0) => {
                    st.writer = Writer::Idle;
                    st.fail(&shared.peer, io::ErrorKind::WriteZero.into());
                }
                Ok(n) => st.q.advance(n),
                Err(e) => {
                    st.writer = Writer::Idle;
                    st.fail(&shared.peer, e);
                }
            }
            let failed = st.q.failed.is_some();
            let idle = st.q.frames.is_empty() || failed;
            if idle {
                st.writer = Writer::Idle;
            }
            let room = st.q.bytes <= shared.limit;
            drop(st);
            if idle || room {
                shared.progress.notify_waiters();
            }
            if idle {
                break;
            }
        }
    }
}

/// The sending half of a TCP link.
#[derive(Debug)]
struct TcpTx {
    shared: Arc<TxShared>,
    writer: JoinHandle<()>,
}

impl LinkTx for TcpTx {
    fn send(&self, msg: Message) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let frame = wire::encode(&msg).map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidArgument,
                    format!("{}: send", self.shared.peer),
                    e,
                )
            })?;
            if self.shared.enqueue(frame)? {
                self.shared.wait_for_room().await?;
            }
            Ok(())
        })
    }

    fn send_batch(&self, msgs: Vec<Message>) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let mut frames = Vec::with_capacity(msgs.len());
            for msg in &msgs {
                frames.push(wire::encode(msg).map_err(|e| {
                    Error::with_source(
                        ErrorKind::InvalidArgument,
                        format!("{}: send", self.shared.peer),
                        e,
                    )
                })?);
            }
            if self.shared.enqueue_many(frames)? {
                self.shared.wait_for_room().await?;
            }
            Ok(())
        })
    }

    fn queue_depth(&self) -> QueueDepth {
        let st = self.shared.state.lock();
        QueueDepth {
            messages: st.q.frames.len(),
            bytes: st.q.bytes,
        }
    }

    fn close(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let shared = &self.shared;
            shared.state.lock().closing = true;
            let drained = async {
                loop {
                    let progress = shared.progress.notified();
                    tokio::pin!(progress);
                    progress.as_mut().enable();
                    {
                        let mut st = shared.state.lock();
                        st.q.check_failed()?;
                        if st.writer == Writer::Idle && st.q.frames.is_empty() {
                            // False when an earlier close already shut the socket.
                            return Ok(!std::mem::replace(&mut st.shut, true));
                        }
                    }
                    progress.await;
                }
            };
            match tokio::time::timeout(shared.close_timeout, drained).await {
                Ok(Ok(true)) => shared
                    .shutdown_write()
                    .map_err(|e| Error::io(format!("{}: close", shared.peer), e)),
                Ok(Ok(false)) => Ok(()),
                Ok(Err(e)) => Err(e),
                Err(_) => {
                    // The peer is not reading: give up on what is queued.
                    let err = {
                        let mut st = shared.state.lock();
                        let err = Error::new(
                            ErrorKind::Timeout,
                            format!(
                                "{}: close: {} queued bytes not sent within {:?}",
                                shared.peer, st.q.bytes, shared.close_timeout
                            ),
                        );
                        if st.q.failed.is_none() {
                            st.q.failed = Some(remember(&err));
                        }
                        st.shut = true;
                        err
                    };
                    let _ = SockRef::from(&*shared.stream).shutdown(Shutdown::Both);
                    shared.progress.notify_waiters();
                    Err(err)
                }
            }
        })
    }

    fn peer(&self) -> &str {
        &self.shared.peer
    }

    fn transport(&self) -> &str {
        "tcp"
    }
}

impl Drop for TcpTx {
    fn drop(&mut self) {
        self.writer.abort();
        let mut st = self.shared.state.lock();
        st.closing = true;
        if !std::mem::replace(&mut st.shut, true) {
            // Best effort: the peer sees the link end even while our receive half lives.
            let _ = self.shared.shutdown_write();
        }
    }
}

/// The receiving half of a TCP link.
#[derive(Debug)]
struct TcpRx {
    stream: Arc<TcpStream>,
    /// Received bytes not yet decoded; decoded data are slices of it.
    buf: BytesMut,
    /// The first error; every later `recv` reports it.
    failed: Option<(ErrorKind, String)>,
    peer: String,
}

impl TcpRx {
    async fn next(&mut self) -> Result<Message> {
        if let Some((kind, context)) = &self.failed {
            return Err(Error::new(*kind, context.clone()));
        }
        loop {
            match wire::decode(&mut self.buf) {
                Ok(Some(msg)) => return Ok(msg),
                Ok(None) => {}
                Err(e) => {
                    // Never trusted again: the send half fails too, and the peer sees
                    // the connection end.
                    let _ = SockRef::from(&*self.stream).shutdown(Shutdown::Both);
                    let err = Error::with_source(
                        ErrorKind::Protocol,
                        format!("{}: received a bad frame", self.peer),
                        e,
                    );
                    return Err(self.fail(err));
                }
            }
            if self.buf.capacity() - self.buf.len() < READ_MIN_ROOM {
                self.buf.reserve(READ_CHUNK);
            }
            let read = read_some(&self.stream, &mut self.buf).await;
            let err = match read {
                Ok(0) if self.buf.is_empty() => Error::new(
                    ErrorKind::Closed,
                    format!("{}: peer closed the link", self.peer),
                ),
                Ok(0) => Error::new(
                    ErrorKind::Closed,
                    format!(
                        "{}: peer closed the link in the middle of a frame ({} bytes of it received)",
                        self.peer,
                        self.buf.len()
                    ),
                ),
                Ok(_) => continue,
                Err(e) => Error::io(format!("{}: receive", self.peer), e),
            };
            return Err(self.fail(err));
        }
    }

    fn fail(&mut self, err: Error) -> Error {
        self.failed = Some(remember(&err));
        err
    }
}

/// Reads what the socket has into `buf`'s spare room, waiting until it has something.
async fn read_some(stream: &TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_read_buf(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            result => return result,
        }
    }
}

impl LinkRx for TcpRx {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(self.next())
    }

    fn peer(&self) -> &str {
        &self.peer
    }
}
