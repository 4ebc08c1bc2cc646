//! The NBD server: accept loop, per-connection negotiation, and the transmission loop.
//!
//! One task per connection runs a single poll loop over three things at once: bytes
//! arriving from the client, device operations in flight, and replies going out. Requests
//! are parsed straight out of the receive buffer (a write's payload becomes a `Bytes`
//! slice of it, no copy), each one is started on the device at once and polled once
//! inline — page-cache I/O completes there and then, so most requests never touch the
//! in-flight set — and replies are batched into one buffer and written with as few
//! syscalls as the socket allows: once per pass over the receive buffer, not once per
//! request. The requests of one pass are started under a [`Plug`](crate::plug::Plug),
//! so a device that batches sees them together. Replies go out in completion order (NBD allows it), so
//! a slow flush never holds back reads.

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures_buffered::FuturesUnordered;
use futures_util::stream::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::handshake::{Outcome, negotiate};
use super::proto::*;
use crate::device::{BlockDevice, IoFlags, IoFuture};
use crate::error::{Error, ErrorKind, Result};

/// Requests in flight per connection before the server stops reading more from it.
const MAX_IN_FLIGHT: usize = 512;
/// Reply bytes buffered before the server stops reading requests (backpressure).
const OUT_HIGH_WATER: usize = 8 << 20;
/// Writes longer than this are not buffered: the connection is dropped.
const MAX_WRITE_PAYLOAD: u32 = 64 << 20;
/// Bytes asked of the socket per read when nothing larger is pending.
const READ_CHUNK: usize = 256 << 10;
/// How long a closing connection keeps draining unread client input.
const LINGER: Duration = Duration::from_secs(2);
/// How long a client may take to finish negotiation.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// One exported device.
pub struct Export {
    name: String,
    description: String,
    device: Arc<dyn BlockDevice>,
    read_only: bool,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("geometry", &self.device.geometry())
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Export {
    /// Export `device` under `name`.
    pub fn new(name: impl Into<String>, device: Arc<dyn BlockDevice>) -> Export {
        Export {
            name: name.into(),
            description: String::new(),
            device,
            read_only: false,
        }
    }

    /// A description shown by `nbdinfo --list` and friends.
    pub fn with_description(mut self, description: impl Into<String>) -> Export {
        self.description = description.into();
        self
    }

    /// Refuse writes, trims and write-zeroes with EPERM.
    pub fn read_only(mut self, read_only: bool) -> Export {
        self.read_only = read_only;
        self
    }

    /// The export name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The export description.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The exported device.
    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.device
    }

    pub(crate) fn size(&self) -> u64 {
        self.device.geometry().size()
    }

    pub(crate) fn transmission_flags(&self) -> u16 {
        let mut f = TFLAG_HAS_FLAGS
            | TFLAG_SEND_FLUSH
            | TFLAG_SEND_FUA
            | TFLAG_SEND_TRIM
            | TFLAG_SEND_WRITE_ZEROES
            // Every flush goes to the one shared device, so it covers writes completed on
            // any connection.
            | TFLAG_CAN_MULTI_CONN;
        if self.read_only {
            f |= TFLAG_READ_ONLY;
        }
        f
    }

    /// (minimum, preferred, maximum) block sizes advertised to clients.
    pub(crate) fn block_sizes(&self) -> (u32, u32, u32) {
        let g = self.device.geometry();
        (g.block_size(), g.block_size().max(4096), g.max_io())
    }
}

/// Counters of a running server.
#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    requests: AtomicU64,
}

struct Shared {
    exports: Vec<Arc<Export>>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    counters: Counters,
}

/// An NBD server for a set of exports. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("exports", &self.shared.exports)
            .field("open_connections", &self.shared.tracker.len())
            .finish()
    }
}

/// A stream a connection can run on (TCP, Unix socket, in-memory duplex).
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

impl Server {
    /// A server for `exports`. Names must be unique.
    pub fn new(exports: Vec<Export>) -> Result<Server> {
        let mut names: Vec<&str> = exports.iter().map(|e| e.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("export {:?} given twice", w[0]),
            ));
        }
        if exports.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "an NBD server needs at least one export",
            ));
        }
        Ok(Server {
            shared: Arc::new(Shared {
                exports: exports.into_iter().map(Arc::new).collect(),
                cancel: CancellationToken::new(),
                tracker: TaskTracker::new(),
                counters: Counters::default(),
            }),
        })
    }

    /// Accept TCP clients until [`Server::shutdown`]; each connection runs in its own task.
    pub async fn serve_tcp(&self, listener: TcpListener) -> Result<()> {
        let local = listener.local_addr().ok();
        info!(addr = ?local, "NBD server listening on TCP");
        loop {
            tokio::select! {
                _ = self.shared.cancel.cancelled() => return Ok(()),
                r = listener.accept() => match r {
                    Ok((stream, peer)) => {
                        // Replies are small and latency-bound: never let Nagle hold them.
                        let _ = stream.set_nodelay(true);
                        self.spawn_connection(stream, peer_name(Some(peer)));
                    }
                    Err(e) => accept_failed(e).await,
                },
            }
        }
    }

    /// Accept Unix-socket clients until [`Server::shutdown`].
    pub async fn serve_unix(&self, listener: UnixListener) -> Result<()> {
        info!(addr = ?listener.local_addr().ok(), "NBD server listening on Unix socket");
        loop {
            tokio::select! {
                _ = self.shared.cancel.cancelled() => return Ok(()),
                r = listener.accept() => match r {
                    Ok((stream, _)) => self.spawn_connection(stream, "unix".to_string()),
                    Err(e) => accept_failed(e).await,
                },
            }
        }
    }

    /// Serve one already-accepted connection in a new task tracked by this server.
    pub fn spawn_connection<S: Stream>(&self, stream: S, peer: String) {
        let this = self.clone();
        self.shared.tracker.spawn(async move {
            if let Err(e) = this.serve_connection(stream, &peer).await {
                match e.kind() {
                    ErrorKind::Closed => debug!(%peer, "client went away: {e}"),
                    _ => warn!(%peer, "connection closed: {e}"),
                }
            }
        });
    }

    /// Serve one connection to the end (negotiation, then transmission) in the caller's
    /// task.
    pub async fn serve_connection<S: Stream>(&self, mut stream: S, peer: &str) -> Result<()> {
        let n = self
            .shared
            .counters
            .connections
            .fetch_add(1, Ordering::Relaxed)
            + 1;
        debug!(%peer, connection = n, "client connected");
        let outcome = tokio::time::timeout(
            HANDSHAKE_TIMEOUT,
            negotiate(&mut stream, &self.shared.exports, &self.shared.cancel),
        )
        .await
        .map_err(|_| Error::new(ErrorKind::Timeout, "negotiation took too long"))??;
        let export = match outcome {
            Outcome::Transmit(export) => export,
            Outcome::Closed => return Ok(()),
        };
        info!(%peer, export = export.name(), "client attached");
        let mut conn = Connection::new(&export, &self.shared.counters);
        let result = conn.run(&mut stream, &self.shared.cancel).await;
        info!(%peer, export = export.name(), requests = conn.requests, "client detached");
        result
    }

    /// Stop accepting, stop reading new requests, and let requests already received
    /// finish and be answered. Pair with [`Server::wait_idle`].
    pub fn shutdown(&self) {
        self.shared.cancel.cancel();
        self.shared.tracker.close();
    }

    /// Wait until every connection has ended after [`Server::shutdown`].
    pub async fn wait_idle(&self) {
        self.shared.tracker.wait().await;
    }

    /// Connections currently open.
    pub fn open_connections(&self) -> usize {
        self.shared.tracker.len()
    }

    /// Requests served since start, over all connections.
    pub fn requests_served(&self) -> u64 {
        self.shared.counters.requests.load(Ordering::Relaxed)
    }

    /// The exports, in the order given.
    pub fn exports(&self) -> impl Iterator<Item = &Export> {
        self.shared.exports.iter().map(|e| e.as_ref())
    }
}

fn peer_name(addr: Option<SocketAddr>) -> String {
    addr.map_or_else(|| "unknown".to_string(), |a| a.to_string())
}

async fn accept_failed(e: std::io::Error) {
    // Out of file descriptors and friends: back off instead of spinning.
    warn!("accept failed: {e}");
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// The outcome of one request, ready to be encoded as a reply.
struct Done {
    cookie: u64,
    errno: u32,
    data: Option<Bytes>,
}

/// A request running on the device.
enum InFlight<'a> {
    Read {
        cookie: u64,
        fut: IoFuture<'a, Bytes>,
    },
    Other {
        cookie: u64,
        is_write: bool,
        fut: IoFuture<'a, ()>,
    },
}

impl Future for InFlight<'_> {
    type Output = Done;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Done> {
        match self.get_mut() {
            InFlight::Read { cookie, fut } => fut.as_mut().poll(cx).map(|r| match r {
                Ok(data) => Done {
                    cookie: *cookie,
                    errno: 0,
                    data: Some(data),
                },
                Err(e) => {
                    debug!("read failed: {e}");
                    Done {
                        cookie: *cookie,
                        errno: errno_for(e.kind(), false),
                        data: None,
                    }
                }
            }),
            InFlight::Other {
                cookie,
                is_write,
                fut,
            } => fut.as_mut().poll(cx).map(|r| match r {
                Ok(()) => Done {
                    cookie: *cookie,
                    errno: 0,
                    data: None,
                },
                Err(e) => {
                    debug!("request failed: {e}");
                    Done {
                        cookie: *cookie,
                        errno: errno_for(e.kind(), *is_write),
                        data: None,
                    }
                }
            }),
        }
    }
}

/// What parsing the receive buffer found.
enum Parsed {
    /// A complete request (and its payload for writes).
    Request(Request, Option<Bytes>),
    /// More bytes are needed; at least this many in total.
    NeedMore(usize),
}

/// The transmission phase of one connection.
struct Connection<'a> {
    export: &'a Export,
    counters: &'a Counters,
    inbuf: BytesMut,
    out: BytesMut,
    /// Requests that did not complete inline. futures-buffered's set keeps its slots
    /// and their wakers from one request to the next: no allocation per request. (It
    /// polls at most 61 futures per `poll_next` before it yields, which is harmless
    /// here because [`Connection::start`] polls every request once, under the pass's
    /// plug, before it joins the set; the iSCSI and vhost-user front doors, which start
    /// their requests by polling the set under a plug, keep `futures_util`'s set, which
    /// polls all of them first.)
    in_flight: FuturesUnordered<InFlight<'a>>,
    /// False after DISC, end of input, or shutdown: no more requests are read.
    reading: bool,
    requests: u64,
}

impl<'a> Connection<'a> {
    fn new(export: &'a Export, counters: &'a Counters) -> Connection<'a> {
        Connection {
            export,
            counters,
            inbuf: BytesMut::with_capacity(READ_CHUNK),
            out: BytesMut::with_capacity(64 << 10),
            in_flight: FuturesUnordered::new(),
            reading: true,
            requests: 0,
        }
    }

    async fn run<S: Stream>(&mut self, stream: &mut S, cancel: &CancellationToken) -> Result<()> {
        let mut cancelled = std::pin::pin!(cancel.cancelled());
        poll_fn(|cx| {
            if self.reading && cancelled.as_mut().poll(cx).is_ready() {
                debug!("server shutting down: finishing requests in flight");
                self.reading = false;
            }
            self.poll_io(cx, stream)
        })
        .await?;
        // Orderly close; the client may already be gone, which is fine.
        let _ = poll_fn(|cx| Pin::new(&mut *stream).poll_shutdown(cx)).await;
        // Closing a socket with unread input makes the kernel send a reset, which would
        // destroy replies still queued for the client. Read and drop what the client still
        // sends (requests we never started) until it closes, for a bounded time.
        let _ = tokio::time::timeout(LINGER, async {
            let mut scratch = [0u8; 16 << 10];
            loop {
                match tokio::io::AsyncReadExt::read(&mut *stream, &mut scratch).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        Ok(())
    }

    /// One pass after another until nothing moves: start every complete request the
    /// receive buffer holds (under one [`Plug`](crate::plug::Plug), so a device that
    /// batches — a mirror — carries them out together, with one send for all), collect
    /// what completed, write all the replies with as few syscalls as the socket takes,
    /// then read more. Replies are written once per pass, not once per request: a
    /// client that keeps many requests in flight gets them in batches.
    fn poll_io<S: Stream>(&mut self, cx: &mut Context<'_>, stream: &mut S) -> Poll<Result<()>> {
        loop {
            let mut progress = false;

            let mut need_more = false;
            // A request that cannot be parsed ends the connection, once the replies to
            // the requests before it went out (as far as the socket takes them now).
            let mut broken = None;
            if self.reading {
                let _plug = crate::plug::Plug::new();
                // (DISC stops reading: nothing after it is started.)
                while self.reading
                    && self.in_flight.len() < MAX_IN_FLIGHT
                    && self.out.len() < OUT_HIGH_WATER
                {
                    match self.parse() {
                        Ok(Parsed::Request(req, payload)) => {
                            self.start(req, payload, cx);
                            progress = true;
                        }
                        Ok(Parsed::NeedMore(total)) => {
                            let want = total.saturating_sub(self.inbuf.len()).max(READ_CHUNK);
                            self.inbuf.reserve(want);
                            need_more = true;
                            break;
                        }
                        Err(e) => {
                            broken = Some(e);
                            break;
                        }
                    }
                }
                // The unplug here carries out what the batch deferred.
            }

            while let Poll::Ready(Some(done)) = self.in_flight.poll_next_unpin(cx) {
                self.encode(done);
                progress = true;
            }

            while !self.out.is_empty() {
                match Pin::new(&mut *stream).poll_write(cx, &self.out) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(Error::new(ErrorKind::Closed, "client closed")));
                    }
                    Poll::Ready(Ok(n)) => {
                        self.out.advance(n);
                        progress = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Error::io("send reply", e))),
                    Poll::Pending => break,
                }
            }
            if let Some(e) = broken {
                return Poll::Ready(Err(e));
            }

            if self.reading && need_more {
                match tokio_util::io::poll_read_buf(Pin::new(&mut *stream), cx, &mut self.inbuf) {
                    Poll::Ready(Ok(0)) => {
                        if !self.inbuf.is_empty() {
                            debug!(bytes = self.inbuf.len(), "client went away mid-request");
                        }
                        self.reading = false;
                        progress = true;
                    }
                    Poll::Ready(Ok(_)) => progress = true,
                    Poll::Ready(Err(e)) => {
                        // Reset by the client: nothing more can be delivered.
                        return Poll::Ready(Err(Error::io("receive request", e)));
                    }
                    Poll::Pending => {}
                }
            }

            if !self.reading && self.in_flight.is_empty() && self.out.is_empty() {
                return Poll::Ready(Ok(()));
            }
            if !progress {
                return Poll::Pending;
            }
        }
    }

    /// Take the next complete request out of the receive buffer.
    fn parse(&mut self) -> Result<Parsed> {
        let Some(head) = self.inbuf.get(..REQUEST_LEN) else {
            return Ok(Parsed::NeedMore(REQUEST_LEN));
        };
        let head: &[u8; REQUEST_LEN] = head
            .try_into()
            .map_err(|_| Error::new(ErrorKind::Protocol, "short header"))?;
        let Some(req) = Request::decode(head) else {
            return Err(Error::new(
                ErrorKind::Protocol,
                "bad request magic; dropping the client",
            ));
        };
        if req.kind != CMD_WRITE {
            self.inbuf.advance(REQUEST_LEN);
            return Ok(Parsed::Request(req, None));
        }
        if req.length > MAX_WRITE_PAYLOAD {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "write of {} bytes is beyond any limit; dropping the client",
                    req.length
                ),
            ));
        }
        let total = REQUEST_LEN + req.length as usize;
        if self.inbuf.len() < total {
            return Ok(Parsed::NeedMore(total));
        }
        self.inbuf.advance(REQUEST_LEN);
        let payload = self.inbuf.split_to(req.length as usize).freeze();
        Ok(Parsed::Request(req, Some(payload)))
    }

    /// Start a request on the device; answer it at once if it completes inline.
    fn start(&mut self, req: Request, payload: Option<Bytes>, cx: &mut Context<'_>) {
        self.requests += 1;
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let cookie = req.cookie;
        let reply_err = |errno| Done {
            cookie,
            errno,
            data: None,
        };
        let dev: &'a dyn BlockDevice = self.export.device.as_ref();
        let writes = matches!(req.kind, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        let allowed_flags = match req.kind {
            CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
            // FUA is advertised, and the spec has servers accept (and ignore) it on
            // commands that write nothing; real clients do set it on reads and flushes.
            _ => CMD_FLAG_FUA,
        };
        if req.flags & !allowed_flags != 0 {
            return self.encode(reply_err(EINVAL));
        }
        if writes && self.export.read_only {
            return self.encode(reply_err(EPERM));
        }
        let flags = if req.flags & CMD_FLAG_FUA != 0 {
            IoFlags::FUA
        } else {
            IoFlags::empty()
        };
        let len = u64::from(req.length);
        let mut op = match req.kind {
            CMD_READ => InFlight::Read {
                cookie,
                fut: dev.read(req.offset, req.length as usize),
            },
            CMD_WRITE => {
                let data = payload.unwrap_or_default();
                InFlight::Other {
                    cookie,
                    is_write: true,
                    fut: dev.write(req.offset, data, flags),
                }
            }
            CMD_FLUSH => InFlight::Other {
                cookie,
                is_write: false,
                fut: dev.flush(),
            },
            CMD_TRIM => InFlight::Other {
                cookie,
                is_write: true,
                fut: dev.discard(req.offset, len, flags),
            },
            CMD_WRITE_ZEROES => InFlight::Other {
                cookie,
                is_write: true,
                fut: dev.write_zeroes(req.offset, len, flags),
            },
            CMD_DISC => {
                debug!("client sent DISC");
                self.reading = false;
                return;
            }
            other => {
                debug!(command = other, "unknown command");
                return self.encode(reply_err(EINVAL));
            }
        };
        match Pin::new(&mut op).poll(cx) {
            Poll::Ready(done) => self.encode(done),
            Poll::Pending => self.in_flight.push(op),
        }
    }

    fn encode(&mut self, done: Done) {
        self.out
            .extend_from_slice(&simple_reply(done.errno, done.cookie));
        if let Some(data) = done.data {
            self.out.extend_from_slice(&data);
        }
    }
}
