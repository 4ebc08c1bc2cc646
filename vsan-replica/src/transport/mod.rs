//! Links between two replicas: the [`Transport`] trait and its implementations.
//!
//! ```text
//!   Transport ──connect(addr)──────────────────────────────▶ Link
//!       │                                                    │ into_split()
//!       └──listen(addr)──▶ Listener ──accept()──▶ Link       ▼
//!                                              Box<dyn LinkTx>   Box<dyn LinkRx>
//!                                              send(Message)     recv() -> Message
//!                                              queue_depth()     (one task reads)
//!                                              close()
//!                                              (&self: any task sends)
//! ```
//!
//! A link carries [`Message`] values. Byte-stream transports frame them with the one
//! codec in [`crate::wire`]; the in-process transport passes the values themselves,
//! zero-copy, but checks them with [`wire::validate`](crate::wire::validate) so every
//! transport accepts and refuses the same messages. The byte-stream links (tcp, shm,
//! quic) share both halves: `stream_tx.rs` is their sending half (queue, room, close and
//! drain), `stream_rx.rs` their receiving half (decode, the bad-frame rule); each
//! transport supplies only its end of the stream, a sink and a source.
//!
//! | transport | module | addresses | what it is for |
//! |---|---|---|---|
//! | tcp | [`tcp`] | `host:port` | any two hosts; optional HMAC peer authentication |
//! | loopback | [`loopback`] | `inproc:NAME` or a Unix socket path | peers on one host: in one process ([`loopback::inproc`]) or over shared-memory rings ([`loopback::shm`]), busy-poll optional |
//! | quic | [`quic`] | `host:port` (UDP) | untrusted networks: mutual TLS, pinned certificates or a CA |
//! | rdma | [`rdma`] | `host:port` | RDMA fabrics (feature `rdma`), falling back to tcp |
//! | lanes | [`lanes`] | the inner transport's | several links of any of the above used as one, in order |
//!
//! The traits are object-safe (boxed futures, as [`BlockDevice`](vsan_core::BlockDevice)
//! uses), so a driver holds `Box<dyn Transport>` and links of any kind alike. A link is
//! two halves so one task can receive while others send; [`Link`] bundles them for
//! callers that do both from one place.
//!
//! Errors from a link are final: after `recv` or `send` fails (peer gone, garbage or a
//! bad crc received, link closed) every later call fails too, and the caller drops the
//! link and connects again. Kinds: [`Closed`](vsan_core::ErrorKind::Closed) when the peer
//! or this side closed the link, [`Protocol`](vsan_core::ErrorKind::Protocol) when the
//! peer sent something the codec refuses or failed authentication,
//! [`Timeout`](vsan_core::ErrorKind::Timeout) for connect and handshake deadlines, and
//! I/O kinds for socket errors.

use std::fmt;

use vsan_core::{Error, ErrorKind, IoFuture, Result};

use crate::wire::Message;

pub mod lanes;
pub mod loopback;
pub mod quic;
pub mod rdma;
pub mod tcp;

mod accept;
mod auth;
mod stream_rx;
mod stream_tx;

pub use lanes::LanesTransport;
pub use loopback::LoopbackTransport;
pub use quic::{Fingerprint, Identity, QuicConfig, QuicTransport};
pub use rdma::{RdmaConfig, RdmaTransport};
pub use tcp::{SharedSecret, TcpConfig, TcpTransport};

/// Makes links: dials a peer or listens for one.
pub trait Transport: Send + Sync + fmt::Debug {
    /// Short name for status and logs ("tcp", "loopback", ...).
    fn name(&self) -> &'static str;

    /// Opens a link to the peer at `addr` (the transport's own address syntax, e.g.
    /// `"127.0.0.1:7002"` for TCP), including any handshake the transport does
    /// (authentication), so the link returned is ready for the first [`Message`].
    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link>;

    /// Starts listening at `addr` (for TCP, port 0 picks a free port; see
    /// [`Listener::local_addr`]).
    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>>;
}

/// Accepts links from peers.
///
/// Dropping the listener stops listening; links already accepted live on.
pub trait Listener: Send + Sync + fmt::Debug {
    /// The next incoming link, after its handshake.
    ///
    /// An error refers to one incoming connection (its handshake failed, the peer had
    /// the wrong secret, an accept error): the listener keeps listening, and the caller
    /// calls `accept` again. [`Closed`](vsan_core::ErrorKind::Closed) means the listener
    /// itself is gone.
    fn accept(&self) -> IoFuture<'_, Link>;

    /// The address peers connect to, in the form [`Transport::connect`] takes.
    fn local_addr(&self) -> String;
}

/// How much a link has accepted from `send` that is not yet handed to the network.
///
/// Lanes are scheduled by least queue depth, and a driver may hold back while it grows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueDepth {
    /// Messages not yet completely written.
    pub messages: usize,
    /// Bytes not yet written (framing included for byte-stream transports).
    pub bytes: usize,
}

/// The sending half of a link. Takes `&self`, so several tasks may send through one
/// `Arc<dyn LinkTx>`; messages go out in the order `send` calls return.
pub trait LinkTx: Send + Sync + fmt::Debug {
    /// Queues `msg` for the peer.
    ///
    /// `Ok` means the message is accepted and will be sent in order unless the link
    /// fails; it does not mean the peer has it (the protocol's acks say that). The
    /// future usually completes at once; it waits while the link's send queue is above
    /// the transport's limit (backpressure). A message is accepted on the future's first
    /// poll: dropping the future after that, while it waits for room, still sends it. Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) for a message
    /// [`wire::validate`](crate::wire::validate) refuses, and with the link's error once
    /// the link has failed or been closed.
    fn send(&self, msg: Message) -> IoFuture<'_, ()>;

    /// Queues several messages, in order, as if by one [`send`](LinkTx::send) each, and
    /// adjacent: no message of another `send` lands between them (lanes rely on it).
    /// The provided method sends them one by one, which keeps them adjacent only while
    /// one task sends; every transport in this crate overrides it.
    /// Byte-stream transports put them on the wire with as few writes as they can (a
    /// driver that answers many requests in one turn pays one syscall, not one each).
    fn send_batch(&self, msgs: Vec<Message>) -> IoFuture<'_, ()> {
        Box::pin(async move {
            for m in msgs {
                self.send(m).await?;
            }
            Ok(())
        })
    }

    /// What is queued and not yet sent.
    fn queue_depth(&self) -> QueueDepth;

    /// Sends everything already queued, then tells the peer no more will come (the
    /// peer's `recv` sees [`Closed`](vsan_core::ErrorKind::Closed) after the last
    /// message). Later sends fail with `Closed`; closing again is a no-op. Bounded: when
    /// the queue does not drain in the transport's close timeout (the peer stopped
    /// reading), what is queued is dropped and `close` fails with
    /// [`Timeout`](vsan_core::ErrorKind::Timeout). Dropping the half instead abandons
    /// what is queued at once.
    fn close(&self) -> IoFuture<'_, ()>;

    /// The peer, for messages and logs (e.g. `"tcp:127.0.0.1:7002"`).
    fn peer(&self) -> &str;

    /// The transport actually carrying this link ("tcp", "quic", "loopback", "shm",
    /// "rdma"), for status: a transport that falls back to another (RDMA to TCP) makes
    /// links that name the one in use.
    fn transport(&self) -> &str;
}

/// The receiving half of a link.
pub trait LinkRx: Send + Sync + fmt::Debug {
    /// The next message from the peer.
    ///
    /// Cancel-safe: dropping the future before it completes loses no message, so it can
    /// sit in a `select!` loop. Fails with [`Closed`](vsan_core::ErrorKind::Closed) once
    /// the peer has closed the link (after every message it sent before), and with
    /// [`Protocol`](vsan_core::ErrorKind::Protocol) for bytes the codec refuses.
    fn recv(&mut self) -> IoFuture<'_, Message>;

    /// The next message if it has already arrived, without waiting: what the next
    /// [`recv`](Self::recv) would return at once (errors included), or `None` when that
    /// would wait, or when the transport cannot tell (the default). Lets a receiver take
    /// every message one read brought in without a future per message.
    fn try_recv(&mut self) -> Option<Result<Message>> {
        None
    }

    /// The peer, for messages and logs.
    fn peer(&self) -> &str;
}

/// A link to one peer: both halves together.
#[derive(Debug)]
pub struct Link {
    tx: Box<dyn LinkTx>,
    rx: Box<dyn LinkRx>,
}

impl Link {
    /// A link from its halves (for transport implementations).
    pub fn new(tx: Box<dyn LinkTx>, rx: Box<dyn LinkRx>) -> Link {
        Link { tx, rx }
    }

    /// See [`LinkTx::send`].
    pub async fn send(&self, msg: Message) -> Result<()> {
        self.tx.send(msg).await
    }

    /// See [`LinkTx::send_batch`].
    pub async fn send_batch(&self, msgs: Vec<Message>) -> Result<()> {
        self.tx.send_batch(msgs).await
    }

    /// See [`LinkRx::recv`].
    pub async fn recv(&mut self) -> Result<Message> {
        self.rx.recv().await
    }

    /// See [`LinkTx::queue_depth`].
    pub fn queue_depth(&self) -> QueueDepth {
        self.tx.queue_depth()
    }

    /// See [`LinkTx::close`].
    pub async fn close(&self) -> Result<()> {
        self.tx.close().await
    }

    /// The peer, for messages and logs.
    pub fn peer(&self) -> &str {
        self.tx.peer()
    }

    /// See [`LinkTx::transport`].
    pub fn transport(&self) -> &str {
        self.tx.transport()
    }

    /// The two halves, to send and receive from different tasks.
    pub fn into_split(self) -> (Box<dyn LinkTx>, Box<dyn LinkRx>) {
        (self.tx, self.rx)
    }
}

/// The frames of `msgs`, in order, for the link to `peer` (their heads share one buffer:
/// [`crate::wire::encode_batch`]); a message the codec refuses fails the send with
/// `InvalidArgument`, naming the peer. Every transport that encodes frames itself
/// (the stream links, RDMA) sends through this.
pub(crate) fn encode_frames(peer: &str, msgs: &[Message]) -> Result<Vec<crate::wire::Frame>> {
    crate::wire::encode_batch(msgs)
        .map_err(|e| Error::with_source(ErrorKind::InvalidArgument, format!("{peer}: send"), e))
}

/// What a link keeps of its first error, to report it again on every later call.
pub(crate) fn remember(err: &Error) -> (ErrorKind, String) {
    let mut text = err.context().to_string();
    if let Some(source) = std::error::Error::source(err) {
        text = format!("{text}: {source}");
    }
    (err.kind(), text)
}
