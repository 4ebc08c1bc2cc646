//! RDMA links (rdma-core verbs, reliable-connected queue pairs set up through
//! `rdma_cm`), falling back to TCP when RDMA cannot be set up.
//!
//! [`RdmaTransport`] is always compiled. The verbs backend is built with the cargo
//! feature `rdma` (binding: the `rdma-sys` crate, linked against the system's
//! `libibverbs` and `librdmacm`); without it, or without a usable device, every link is
//! a TCP link and says so.
//!
//! # Falling back to TCP
//!
//! `connect("host:port")` first tries RDMA: resolve the address and route with
//! `rdma_cm`, create the queue pair, connect. When that cannot be done (built without
//! the feature, no RDMA device, address or route resolution fails, the peer rejects or
//! does not answer in [`RdmaConfig::connect_timeout`]) it logs, once per distinct
//! reason and at warn level, `rdma unavailable (<why>); using tcp`, and connects over
//! TCP to the same `host:port` with [`RdmaConfig::tcp`]. The link's
//! [`transport()`](super::LinkTx::transport) then says `"tcp"` (an RDMA link says
//! `"rdma"`), so the mirror's status ([`MirrorStatus::link_transport`]) shows the
//! transport actually in use, and [`RdmaTransport::fallback_reason`] tells why.
//!
//! `listen("host:port")` always listens on TCP (port 0 picks a free port), and also
//! with `rdma_cm` on the same port number when RDMA is available; `accept` returns
//! links from either. A node with RDMA and one without therefore still link (over TCP).
//! On iWARP devices `rdma_cm` shares the kernel's TCP port space, so the RDMA listener
//! cannot take the port the TCP listener holds: such a node accepts over TCP only (and
//! logs why), while its outgoing links may still use RDMA.
//!
//! # Connection setup
//!
//! Both sides exchange a 16-byte hello in the `rdma_cm` private data (the connect
//! request and the accept): magic `"VSRD"`, version 1, three zero bytes, then their
//! receive buffer count and buffer size as big-endian u32. The queue pair is RC with one
//! completion queue and completion channel; every buffer is registered once, at setup,
//! with local write access only.
//!
//! # Framing: SEND/RECV into pre-registered buffers
//!
//! A link carries the byte stream of [`crate::wire`] frames, as TCP does, cut into
//! chunks that each fit one registered buffer and go out as one SEND. A small frame
//! shares a chunk with the frames queued behind it; a frame larger than a buffer spans
//! several. Every chunk starts with a 12-byte header:
//!
//! ```text
//!  offset  size  field
//!       0     1  type: 1 data, 2 credit, 3 close
//!       1     1  flags: 0
//!       2     2  grant: credits returned to the receiver of this chunk
//!       4     4  seq: chunks sent before this one on the link (wrapping)
//!       8     4  len: payload bytes after the header (0 for credit and close)
//! ```
//!
//! Payloads are copied into a registered send buffer and out of a registered receive
//! buffer rather than moved by RDMA WRITE into the peer's memory. Mirror I/O is mostly
//! 4 KiB to 1 MiB, where a memory copy costs far less than the network transfer, while
//! registering each payload would cost a system call and page pinning per I/O, and an
//! RDMA WRITE protocol needs a rendezvous round trip and a way to tell the receiver the
//! data is there. With SEND/RECV the receiver learns of data by its own receive
//! completion, and no remote access rights are granted at all: the peer can only fill
//! the buffers this side posted, in order.
//!
//! # Credits
//!
//! A SEND that finds no posted receive buffer at the peer would stall the queue pair
//! (receiver not ready), so a side posts a SEND only with a credit:
//!
//! - Each side starts with as many credits as the peer announced receive buffers, and
//!   spends one per SEND.
//! - A receive buffer is posted again once its payload has been consumed (copied into
//!   the decode buffer as `recv` needs it); each repost owes the peer one credit. A
//!   reader that stops reading therefore stops the peer, with memory bounded by the
//!   buffers (backpressure, as TCP's window gives).
//! - Credits owed ride back in the `grant` field of every chunk sent. When none flow
//!   back (the link is one-way), an explicit credit chunk is sent once half the receive
//!   buffers are owed.
//! - Data and close chunks leave the last credit unused; only a credit chunk may spend
//!   it. So when both sides send at once and run out, each can still return credits to
//!   the other: no deadlock. Because the threshold is at least 2 (at least 4 receive
//!   buffers), one credit chunk never triggers another, so credit chunks do not
//!   ping-pong on an idle link.
//! - A grant larger than the credits outstanding, a chunk out of sequence, an unknown
//!   type or flag, a length that does not match what arrived, data after close, and any
//!   frame the codec refuses fail the link with
//!   [`Protocol`](vsan_core::ErrorKind::Protocol); nothing from the peer can panic it.
//!
//! # Closing
//!
//! [`close`](super::LinkTx::close) sends what is queued, then a close chunk; the peer's
//! `recv` reports [`Closed`](vsan_core::ErrorKind::Closed) after the last message, and
//! credits still flow so the peer can go on sending. Dropping both halves disconnects
//! the queue pair; the peer sees the disconnect event, delivers what it received, then
//! reports `Closed`.
//!
//! # Authentication
//!
//! With [`TcpConfig::secret`](super::TcpConfig::secret) set in [`RdmaConfig::tcp`], RDMA
//! links run the same HMAC challenge as TCP links (see [`super::tcp`]) over the link
//! before its first message; TCP fall-back links run it as TCP links do.
//!
//! # Structure
//!
//! The framing and credit logic is a state machine with no I/O of its own over a small
//! verbs seam (post a SEND of a buffer, post a RECV, poll completions, a registered
//! buffer pool). A tokio driver feeds it completion events; the unit tests run it over
//! an in-memory fake of two connected queue pairs, with random delivery and completion
//! orders, and check that every message arrives in order, that no SEND is ever posted
//! without a credit, and that both sides sending at full pressure never deadlock.
//!
//! [`MirrorStatus::link_transport`]: crate::MirrorStatus::link_transport

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tracing::{debug, warn};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::{Link, Listener, TcpConfig, TcpTransport, Transport};

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod engine;
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod link;

#[cfg(test)]
mod fake;
#[cfg(feature = "rdma")]
mod sys;
#[cfg(test)]
mod tests;

use engine::{MAX_BUFFER_LEN, MAX_CREDITS, MIN_BUFFER_LEN, MIN_CREDITS};

/// Settings of an [`RdmaTransport`]. Start from `RdmaConfig::default()` and set fields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RdmaConfig {
    /// Settings of the TCP fall-back links. Its `secret`, `handshake_timeout`,
    /// `send_queue_limit` and `close_timeout` apply to RDMA links as well.
    pub tcp: TcpConfig,
    /// Receive buffers posted per link, which are the credits the peer may spend: how
    /// many chunks may be in flight towards this side (default 64, allowed 4..=4096).
    pub credits: u32,
    /// Send buffers per link: how many chunks this side may have posted at once
    /// (default 64, at least 1).
    pub send_buffers: u32,
    /// Bytes in each registered buffer, send and receive, including the 12-byte chunk
    /// header (default 64 KiB, allowed 64 bytes..=16 MiB). A link registers
    /// `(credits + send_buffers) * buffer_size` bytes.
    pub buffer_size: usize,
    /// How long `connect` may take to set up RDMA (address and route resolution, the
    /// connection handshake) before falling back to TCP (default 2 s).
    pub connect_timeout: Duration,
    /// How long each of `rdma_cm`'s address and route resolution steps may take
    /// (default 1 s).
    pub resolve_timeout: Duration,
}

impl Default for RdmaConfig {
    fn default() -> RdmaConfig {
        RdmaConfig {
            tcp: TcpConfig::default(),
            credits: 64,
            send_buffers: 64,
            buffer_size: 64 << 10,
            connect_timeout: Duration::from_secs(2),
            resolve_timeout: Duration::from_secs(1),
        }
    }
}

impl RdmaConfig {
    /// Fails with [`InvalidArgument`](ErrorKind::InvalidArgument) for values out of
    /// range.
    fn check(&self) -> Result<()> {
        let invalid = |what: String| Err(Error::new(ErrorKind::InvalidArgument, what));
        if !(MIN_CREDITS..=MAX_CREDITS).contains(&self.credits) {
            return invalid(format!(
                "rdma: credits {} out of range {MIN_CREDITS}..={MAX_CREDITS}",
                self.credits
            ));
        }
        if self.send_buffers == 0 || self.send_buffers > MAX_CREDITS {
            return invalid(format!(
                "rdma: send_buffers {} out of range 1..={MAX_CREDITS}",
                self.send_buffers
            ));
        }
        if !(MIN_BUFFER_LEN..=MAX_BUFFER_LEN).contains(&self.buffer_size) {
            return invalid(format!(
                "rdma: buffer_size {} out of range {MIN_BUFFER_LEN}..={MAX_BUFFER_LEN}",
                self.buffer_size
            ));
        }
        Ok(())
    }
}

/// Why RDMA was not used for a link or a listener.
#[derive(Debug)]
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
enum Setup {
    /// RDMA cannot be set up: fall back to TCP (why; its context is the reason shown).
    Unavailable(Error),
    /// RDMA was set up but the link failed in a way TCP would not fix (the peer's
    /// authentication failed): report it.
    Failed(Error),
}

/// Replication links over RDMA, or over TCP where RDMA cannot be set up. Addresses are
/// `host:port`, for both. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: RdmaConfig,
    tcp: TcpTransport,
    reasons: Mutex<Reasons>,
}

/// Fall-back reasons: the last one, and those already logged at warn level.
#[derive(Debug, Default)]
struct Reasons {
    last: Option<String>,
    logged: HashSet<String>,
}

impl Default for RdmaTransport {
    fn default() -> RdmaTransport {
        RdmaTransport::with_config(RdmaConfig::default())
    }
}

impl RdmaTransport {
    /// A transport with the default settings.
    pub fn new() -> RdmaTransport {
        RdmaTransport::default()
    }

    /// A transport with `config`.
    pub fn with_config(config: RdmaConfig) -> RdmaTransport {
        let tcp = TcpTransport::with_config(config.tcp.clone());
        RdmaTransport {
            inner: Arc::new(Inner {
                config,
                tcp,
                reasons: Mutex::new(Reasons::default()),
            }),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &RdmaConfig {
        &self.inner.config
    }

    /// Why the last link or listener of this transport (or of a clone of it) fell back
    /// to TCP; `None` when the last one used RDMA or none was made yet. For status.
    pub fn fallback_reason(&self) -> Option<String> {
        self.inner.reasons.lock().last.clone()
    }

    /// Records a fall-back; logs it at warn level the first time this reason is seen.
    /// Returns whether it was logged at warn level.
    fn note_fallback(&self, why: &str) -> bool {
        let first = {
            let mut reasons = self.inner.reasons.lock();
            reasons.last = Some(why.to_string());
            reasons.logged.insert(why.to_string())
        };
        if first {
            warn!("rdma unavailable ({why}); using tcp");
        } else {
            debug!("rdma unavailable ({why}); using tcp");
        }
        first
    }

    fn note_rdma_used(&self) {
        self.inner.reasons.lock().last = None;
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        Box::pin(async move {
            self.inner.config.check()?;
            match backend::connect(addr, &self.inner.config).await {
                Ok(link) => {
                    self.note_rdma_used();
                    Ok(link)
                }
                Err(Setup::Failed(e)) => Err(e),
                Err(Setup::Unavailable(why)) => {
                    self.note_fallback(why.context());
                    self.inner.tcp.connect(addr).await
                }
            }
        })
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        Box::pin(async move {
            self.inner.config.check()?;
            let tcp = self.inner.tcp.listen(addr).await?;
            let local = tcp.local_addr();
            let rdma = match backend::listen(&local, &self.inner.config).await {
                Ok(listener) => {
                    self.note_rdma_used();
                    Some(listener)
                }
                Err(why) => {
                    self.note_fallback(why.context());
                    None
                }
            };
            Ok(Box::new(RdmaLinkListener {
                local,
                tcp,
                rdma,
                rdma_stopped: AtomicBool::new(false),
            }) as Box<dyn Listener>)
        })
    }
}

/// Accepts links over TCP, and over RDMA where it could listen.
struct RdmaLinkListener {
    local: String,
    tcp: Box<dyn Listener>,
    rdma: Option<Box<dyn Listener>>,
    /// The RDMA listener reported itself gone; TCP goes on alone.
    rdma_stopped: AtomicBool,
}

impl fmt::Debug for RdmaLinkListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaLinkListener")
            .field("local", &self.local)
            .field("rdma", &self.rdma.is_some())
            .finish_non_exhaustive()
    }
}

impl Listener for RdmaLinkListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(async move {
            loop {
                let rdma = match &self.rdma {
                    Some(r) if !self.rdma_stopped.load(Ordering::Relaxed) => r,
                    _ => return self.tcp.accept().await,
                };
                // Both accepts are cancel-safe (a channel receive each).
                tokio::select! {
                    link = self.tcp.accept() => return link,
                    link = rdma.accept() => match link {
                        Err(e) if e.kind() == ErrorKind::Closed => {
                            warn!("rdma listener {} stopped ({e}); accepting tcp only", self.local);
                            self.rdma_stopped.store(true, Ordering::Relaxed);
                        }
                        other => return other,
                    },
                }
            }
        })
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

/// Builds without the `rdma` feature: RDMA is never available.
#[cfg(not(feature = "rdma"))]
mod backend {
    use vsan_core::{Error, ErrorKind, Result};

    use super::{Link, Listener, RdmaConfig, Setup};

    fn why() -> Error {
        Error::new(ErrorKind::NotSupported, "built without the rdma feature")
    }

    pub(super) async fn connect(
        _addr: &str,
        _config: &RdmaConfig,
    ) -> std::result::Result<Link, Setup> {
        Err(Setup::Unavailable(why()))
    }

    pub(super) async fn listen(_addr: &str, _config: &RdmaConfig) -> Result<Box<dyn Listener>> {
        Err(why())
    }
}

#[cfg(feature = "rdma")]
use sys as backend;
