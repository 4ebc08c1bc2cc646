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
use smallvec::SmallVec;
use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::accept::AcceptQueue;
use super::auth::{self, Role};
use super::stream_rx::{StreamSource, peer_closed, stream_link};
use super::stream_tx::{StreamSink, frame_parts};
use super::{Link, Listener, Transport};
use crate::wire::Frame;

/// Most slices handed to one vectored write.
const MAX_IOVECS: usize = 64;

/// The slices of one vectored send, on the stack up to [`MAX_IOVECS`] (no allocation per
/// send).
type IoSlices<'a> = SmallVec<[IoSlice<'a>; MAX_IOVECS]>;

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
    // Halves of their own: the receiving half reads through tokio's `AsyncRead`, which
    // takes a short read as the socket drained (no read that only says "would block"
    // per batch of messages).
    let (read, write) = stream.into_split();
    let sink = TcpSink {
        stream: write,
        peer: peer.clone(),
    };
    Ok(stream_link(
        sink,
        TcpSource { stream: read, peer },
        received,
        config.send_queue_limit,
        config.close_timeout,
    ))
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

/// The TCP end of a link's sending half: the socket, written without `SIGPIPE`.
#[derive(Debug)]
struct TcpSink {
    stream: OwnedWriteHalf,
    peer: String,
}

impl TcpSink {
    fn send_error(&self, e: io::Error) -> Error {
        Error::io(format!("{}: send", self.peer), e)
    }
}

impl StreamSink for TcpSink {
    const TRANSPORT: &'static str = "tcp";
    const WRITES_INLINE: bool = true;
    const FAILURE_DROPS_QUEUE: bool = false;
    const CLOSE_UNDONE: &'static str = "sent";

    fn batch_limits(&self) -> (usize, usize) {
        (MAX_IOVECS, MAX_BATCH_BYTES)
    }

    fn write_now(&self, frames: &[Frame]) -> Result<usize> {
        write_now_many(self.stream.as_ref(), frames).map_err(|e| self.send_error(e))
    }

    async fn write(&self, batch: &mut [Bytes]) -> Result<usize> {
        let slices: IoSlices<'_> = batch.iter().map(|b| IoSlice::new(b)).collect();
        let stream: &TcpStream = self.stream.as_ref();
        let sent = stream
            .async_io(Interest::WRITABLE, || {
                SockRef::from(stream).send_vectored_with_flags(&slices, SEND_FLAGS)
            })
            .await;
        match sent {
            Ok(0) => Err(self.send_error(io::ErrorKind::WriteZero.into())),
            Ok(n) => Ok(n),
            Err(e) => Err(self.send_error(e)),
        }
    }

    fn shut(&self) -> Result<()> {
        SockRef::from(self.stream.as_ref())
            .shutdown(Shutdown::Write)
            .map_err(|e| Error::io(format!("{}: close", self.peer), e))
    }

    fn abandon(&self) {
        let _ = SockRef::from(self.stream.as_ref()).shutdown(Shutdown::Both);
    }
}

/// Writes as much of `frames` (in order) as the socket takes without waiting, up to
/// [`MAX_IOVECS`] slices per system call; returns the bytes written.
fn write_now_many(stream: &TcpStream, frames: &[Frame]) -> io::Result<usize> {
    let total: usize = frames.iter().map(Frame::len).sum();
    let mut done = 0;
    while done < total {
        let slices: IoSlices<'_> = frame_parts(frames, done)
            .take(MAX_IOVECS)
            .map(IoSlice::new)
            .collect();
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

/// The TCP end of a link's receiving half: the socket.
#[derive(Debug)]
struct TcpSource {
    stream: OwnedReadHalf,
    peer: String,
}

impl StreamSource for TcpSource {
    fn peer(&self) -> &str {
        &self.peer
    }

    async fn fill(&mut self, buf: &mut BytesMut) -> Result<()> {
        if buf.capacity() - buf.len() < READ_MIN_ROOM {
            buf.reserve(READ_CHUNK);
        }
        match read_some(&mut self.stream, buf).await {
            Ok(0) => Err(peer_closed(&self.peer, buf.len())),
            Ok(_) => Ok(()),
            Err(e) => Err(Error::io(format!("{}: receive", self.peer), e)),
        }
    }

    fn distrust(&mut self, _err: &Error) {
        let _ = SockRef::from(self.stream.as_ref()).shutdown(Shutdown::Both);
    }
}

/// Reads what the socket has into `buf`'s spare room, waiting until it has something.
async fn read_some(stream: &mut OwnedReadHalf, buf: &mut BytesMut) -> io::Result<usize> {
    loop {
        match tokio::io::AsyncReadExt::read_buf(stream, buf).await {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            result => return result,
        }
    }
}
