//! Cross-process loopback links over shared-memory rings.
//!
//! [`ShmTransport`] links two processes on one host without the TCP stack. Each
//! direction of a link is a single-producer single-consumer byte ring in one shared
//! memory file (a sealed memfd); the rings carry the same frames as TCP (the
//! [`crate::wire`] codec), so every transport accepts and refuses the same messages. A
//! Unix stream socket, whose path is the address, is the rendezvous that hands the
//! memory over and then the liveness channel: when either process dies or drops the
//! link, the other sees the socket hang up. Small "doorbell" sockets wake a side that
//! sleeps.
//!
//! Under load, and always in busy-poll mode ([`ShmConfig::busy_poll`]), a message costs
//! no system call at all: the sender copies the frame into the ring and publishes it
//! with one atomic store; it rings the peer's doorbell only when the peer has said it
//! is about to sleep.
//!
//! # Setting up a link
//!
//! ```text
//!   connector                                              acceptor (listens on PATH)
//!   connect(PATH) ───────────────── Unix stream ─────────▶ accept
//!   memfd_create, ftruncate, write the header,
//!   seal (no shrinking, no growing), map it
//!   hello (16 bytes)
//!     + SCM_RIGHTS [memfd, data bell, room bell] ────────▶ check the hello, the seals,
//!                                                          the header and the file size;
//!                                                          map it
//!                  ◀──────── reply (128 bytes: ok, or refused and why)
//!                            + SCM_RIGHTS [data bell, room bell] (when ok)
//! ```
//!
//! Both messages start with the 8 bytes `"vsan-shm"` and a `u32` version (1); integers
//! are in the host's byte order, as both ends run on one host. The hello's last 4 bytes
//! are reserved (0). The reply's next `u32` is 0 (accepted) or 1 (refused), then a
//! `u32` length and that many bytes of UTF-8 reason (at most 108). A connector that gets
//! a refusal fails `connect` with [`Protocol`](ErrorKind::Protocol) and the reason; the
//! acceptor's `accept` fails the same way for that connection, and keeps listening.
//!
//! The acceptor trusts nothing it is given: the memfd must carry the `F_SEAL_SHRINK`
//! seal (checked before its size, so it cannot shrink under the mapping and fault the
//! process with `SIGBUS`), the header must hold the magic, version 1, a header length of
//! 4096 and ring sizes that are powers of two within [`MIN_RING_SIZE`]..=[`MAX_RING_SIZE`],
//! and the file must be at least as large as the header says. Anything else is refused.
//!
//! # Shared memory layout (version 1)
//!
//! ```text
//!  offset            size   field
//!  ----------------  -----  -----------------------------------------------------
//!  0                 8      magic "vsanshm\0"
//!  8                 4      layout version, 1
//!  12                4      header length, 4096
//!  16                8      size of ring 0 (connector -> acceptor), a power of two
//!  24                8      size of ring 1 (acceptor -> connector), a power of two
//!  1024              384    control block of ring 0 (below)
//!  2048              384    control block of ring 1
//!  4096              size0  ring 0's bytes
//!  4096 + size0      size1  ring 1's bytes
//!
//!  control block (each group on its own 128-byte line, written by one side only)
//!  +0     8   tail       producer: bytes ever written (the next byte goes at
//!                        tail mod size); stored with Release after the bytes
//!  +8     4   closed     producer: 1 = no bytes will follow tail (close or drop)
//!  +12    4   producer sleeping: 1 = the producer waits for room (see below)
//!  +128   8   head       consumer: bytes ever consumed; stored with Release after the
//!                        bytes are copied out, so the producer may reuse them
//!  +136   4   consumer sleeping: 1 = the consumer waits for data
//!  +140   4   consumer gone: 1 = the consumer dropped its receiving half
//! ```
//!
//! Positions are free-running `u64` byte counts; a ring holds `tail - head` bytes, never
//! more than its size. Each side keeps its own position in private memory and only
//! stores it into the shared word, so a peer that scribbles on the memory cannot move it;
//! the peer's position is checked on every load (`tail - head` must stay within
//! `0..=size`), and a position out of range fails the link with
//! [`Protocol`](ErrorKind::Protocol) instead of reading or writing out of bounds. The
//! ring bytes are only ever copied with raw pointer copies, never borrowed, and what is
//! copied out is decoded by the total [`wire::decode`](crate::wire::decode), so garbage is a protocol error,
//! not undefined behaviour.
//!
//! Frames are a plain byte stream in the ring and may wrap around its end or be larger
//! than the whole ring (a 64 MiB write goes through an 8 MiB ring in pieces): the
//! receiver copies whatever is there into its buffer, frees the space, and decodes
//! frames from the buffer as TCP does; decoded data are zero-copy slices of that buffer.
//!
//! # Wake-ups
//!
//! A consumer that finds its ring empty spins first when busy-poll is on (checking the
//! tail, for up to [`ShmConfig::busy_poll`]), then declares it sleeps: it stores 1 into
//! "consumer sleeping", issues a `SeqCst` fence, checks the ring once more, and only then
//! waits for its data doorbell (and the control socket). A producer stores the tail,
//! issues a `SeqCst` fence, then reads "consumer sleeping"; only when it finds 1 does it
//! clear it and ring the doorbell (one byte, `MSG_DONTWAIT`). The two fences make a lost
//! wake-up impossible: either the consumer sees the new tail, or the producer sees the
//! flag. A producer waiting for room does the same with "producer sleeping" and its room
//! doorbell, and the consumer rings it after freeing space.
//!
//! Each side creates the doorbells it waits on (a Unix socket pair: it keeps one end and
//! hands the other to the peer) rather than eventfds: a byte sent or received with
//! `MSG_DONTWAIT` can never block, whatever the peer does to the file description it
//! shares (an eventfd whose `O_NONBLOCK` the peer clears, or whose counter it fills,
//! could block a runtime thread), and a peer that dies closes its ends, which wakes the
//! sleeper too.
//!
//! # Closing and failures
//!
//! `close` waits (bounded by [`ShmConfig::close_timeout`]) until everything queued is in
//! the ring, then stores 1 into its ring's "closed" and rings the peer: the peer's `recv`
//! returns every message before and then fails with [`Closed`](ErrorKind::Closed). The
//! other direction keeps working. Dropping the sending half does the same at once
//! (without draining what is queued); dropping the receiving half sets "consumer gone",
//! and the peer's sends then fail with `Closed`. When both halves are dropped the socket
//! closes; the peer's `recv` then drains the ring and fails with `Closed`, and its sends
//! fail. The socket is not shut down by a graceful `close`, so it keeps telling each side
//! whether the other still lives for as long as either direction is in use.
//!
//! A frame the decoder refuses, a position out of range, or bytes written to the control
//! socket after the handshake fail the link with [`Protocol`](ErrorKind::Protocol) and
//! shut the socket down in both directions, so both ends drop it. A process that dies
//! while sending leaves at most a partial frame, which the other side reports as the link
//! closing in the middle of a frame.
//!
//! # Files
//!
//! This file holds the settings, the transport and the listener; `handshake.rs` the
//! setup over the Unix socket and the acceptor's checks; `region.rs` the memfd, its seals
//! and the mapping; `ring.rs` one direction's ring; `doorbell.rs` the wake-ups;
//! `link.rs` both halves of a link (the sending half is the shared byte-stream send
//! side over the ring).

use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use crate::transport::accept::AcceptQueue;
use crate::transport::{Link, Listener, Transport};
use handshake::{accept_with, connect_with};
use region::Region;

mod doorbell;
mod handshake;
mod link;
mod region;
mod ring;
#[cfg(test)]
mod tests;

/// The smallest ring [`ShmConfig::ring_size`] may ask for (and an acceptor accepts).
pub const MIN_RING_SIZE: usize = 4096;
/// The largest ring [`ShmConfig::ring_size`] may ask for (and an acceptor accepts).
pub const MAX_RING_SIZE: usize = 1 << 30;

/// First bytes of the shared memory.
const SHM_MAGIC: [u8; 8] = *b"vsanshm\0";
/// Version of the shared memory layout and of the handshake.
const SHM_VERSION: u32 = 1;
/// Bytes before ring 0: the header and both control blocks.
const SHM_HEADER_LEN: usize = 4096;
/// Where the header holds the ring sizes.
const OFF_RING_SIZE: [usize; 2] = [16, 24];
/// Where each ring's control block starts.
const OFF_CONTROL: [usize; 2] = [1024, 2048];
/// Control block fields, from its start.
const CTL_TAIL: usize = 0;
const CTL_CLOSED: usize = 8;
const CTL_PRODUCER_SLEEPING: usize = 12;
const CTL_HEAD: usize = 128;
const CTL_CONSUMER_SLEEPING: usize = 136;
const CTL_CONSUMER_GONE: usize = 140;

/// First bytes of both handshake messages.
const HANDSHAKE_MAGIC: [u8; 8] = *b"vsan-shm";
/// Bytes of the connector's hello.
const HELLO_LEN: usize = 16;
/// Bytes of the acceptor's reply.
const REPLY_LEN: usize = 128;
/// Where the reason starts in a reply.
const REPLY_REASON_AT: usize = 20;
/// Reply status: accepted.
const REPLY_OK: u32 = 0;
/// Reply status: refused.
const REPLY_REFUSED: u32 = 1;
/// File descriptors the hello carries: memfd, data bell, room bell.
const HELLO_FDS: usize = 3;
/// File descriptors an accepting reply carries: data bell, room bell.
const REPLY_FDS: usize = 2;
/// The most descriptors one handshake read takes; more means the peer is confused.
const MAX_FDS: usize = 4;
/// Room for `MAX_FDS` descriptors in one control message, in `u64`s (for alignment).
const CMSG_WORDS: usize = {
    // SAFETY: CMSG_SPACE is plain arithmetic on its argument.
    let bytes = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    bytes.div_ceil(8)
};

/// Checks of the ring per poll while busy-polling.
const SPIN_CHECKS: usize = 64;
/// Most bytes the writer task copies into the ring per step.
const MAX_BATCH_BYTES: usize = 4 << 20;
/// Most frames the writer task gathers per step.
const MAX_BATCH_PARTS: usize = 256;
/// Doorbell bytes drained per wake-up at most (a peer that keeps ringing cannot pin us).
const MAX_BELL_READS: usize = 16;
/// Pause after a failed `accept` before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(20);
/// Incoming links handshaken but not yet taken by `accept`.
const ACCEPT_BACKLOG: usize = 16;
/// How long `listen` waits for an existing socket file to answer before calling it busy.
const STALE_PROBE: Duration = Duration::from_secs(1);

/// Settings of a [`ShmTransport`]. Start from `ShmConfig::default()` and set fields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShmConfig {
    /// Bytes of each ring, one per direction: a power of two within
    /// [`MIN_RING_SIZE`]..=[`MAX_RING_SIZE`] (default 8 MiB). The connecting side's
    /// setting applies to both directions of the link; the accepting side takes any
    /// valid size. Frames larger than the ring still pass, in pieces.
    pub ring_size: usize,
    /// Busy-poll mode: when set, a side that finds its ring empty (or, sending, full)
    /// spins checking it for up to this long before it goes to sleep, trading a core for
    /// latency; a message to a spinning receiver costs no system call on either side.
    /// A spinner stays runnable and lets its runtime worker run other tasks between
    /// short bursts of checks (the worker never parks). Spinning needs a free core per
    /// spinning side; `None` (the default) sleeps at once.
    pub busy_poll: Option<Duration>,
    /// Bytes a link may queue beyond what the ring holds before `send` waits for the peer
    /// to read (default 8 MiB). A single larger message is still accepted.
    pub send_queue_limit: usize,
    /// How long `connect` waits for the socket connection (default 5 s).
    pub connect_timeout: Duration,
    /// How long the handshake may take, on either side (default 5 s).
    pub handshake_timeout: Duration,
    /// How long `close` waits for queued messages to go into the ring before it drops
    /// them and fails with [`Timeout`](ErrorKind::Timeout) (default 5 s).
    pub close_timeout: Duration,
}

impl Default for ShmConfig {
    fn default() -> ShmConfig {
        ShmConfig {
            ring_size: 8 << 20,
            busy_poll: None,
            send_queue_limit: 8 << 20,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            close_timeout: Duration::from_secs(5),
        }
    }
}

/// Replication links between processes on one host, over shared-memory rings (see the
/// [module docs](self)). Addresses are Unix socket paths (`"/run/vsan/r0.sock"`);
/// `listen` creates the socket file (replacing a stale one nothing listens on) and
/// removes it when the listener is dropped.
#[derive(Debug, Clone, Default)]
pub struct ShmTransport {
    config: Arc<ShmConfig>,
}

impl ShmTransport {
    /// A transport with the default settings.
    pub fn new() -> ShmTransport {
        ShmTransport::default()
    }

    /// A transport with `config`.
    pub fn with_config(config: ShmConfig) -> ShmTransport {
        ShmTransport {
            config: Arc::new(config),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &ShmConfig {
        &self.config
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        Box::pin(async move {
            let size = self.config.ring_size;
            if !valid_ring_size(size as u64) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "shm connect {addr}: ring size {size} is not a power of two between \
                         {MIN_RING_SIZE} and {MAX_RING_SIZE}"
                    ),
                ));
            }
            if addr.is_empty() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "shm connect: empty socket path",
                ));
            }
            let limit = self.config.connect_timeout;
            let stream = match tokio::time::timeout(limit, UnixStream::connect(addr)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    let what = match e.kind() {
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
                            format!("shm connect {addr}: nothing listens there")
                        }
                        _ => format!("shm connect {addr}"),
                    };
                    return Err(Error::io(what, e));
                }
                Err(_) => {
                    return Err(Error::new(
                        ErrorKind::Timeout,
                        format!("shm connect {addr}: no connection within {limit:?}"),
                    ));
                }
            };
            let peer = format!("shm:{addr}");
            let (region, file) = Region::create(size)
                .map_err(|e| Error::io(format!("{peer}: create the shared memory"), e))?;
            connect_with(stream, Arc::new(region), file, &self.config, peer).await
        })
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        Box::pin(async move {
            if addr.is_empty() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "shm listen: empty socket path",
                ));
            }
            remove_stale_socket(addr).await?;
            let listener =
                UnixListener::bind(addr).map_err(|e| Error::io(format!("shm listen {addr}"), e))?;
            let ident = std::fs::symlink_metadata(addr)
                .ok()
                .map(|m| (m.dev(), m.ino()));
            let (incoming_tx, incoming) =
                AcceptQueue::new(format!("shm listener {addr}"), ACCEPT_BACKLOG);
            let task = tokio::spawn(accept_loop(
                listener,
                addr.to_string(),
                Arc::clone(&self.config),
                incoming_tx,
            ));
            Ok(Box::new(ShmListener {
                path: addr.to_string(),
                ident,
                incoming,
                task,
            }) as Box<dyn Listener>)
        })
    }
}

fn valid_ring_size(size: u64) -> bool {
    size.is_power_of_two() && (MIN_RING_SIZE as u64..=MAX_RING_SIZE as u64).contains(&size)
}

/// Makes room for a listener at `path`: nothing there is fine, a socket file nobody
/// listens on is removed, anything else is refused.
async fn remove_stale_socket(path: &str) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("shm listen {path}"), e)),
    };
    if !meta.file_type().is_socket() {
        return Err(Error::new(
            ErrorKind::InUse,
            format!("shm listen {path}: the path exists and is not a socket"),
        ));
    }
    match tokio::time::timeout(STALE_PROBE, UnixStream::connect(path)).await {
        Ok(Ok(_)) => Err(Error::new(
            ErrorKind::InUse,
            format!("shm listen {path}: another listener is there"),
        )),
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => {
            match std::fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::io(
                    format!("shm listen {path}: remove the stale socket"),
                    e,
                )),
                _ => Ok(()),
            }
        }
        Ok(Err(e)) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => Err(Error::new(
            ErrorKind::InUse,
            format!("shm listen {path}: another listener is there (its backlog is full)"),
        )),
        Ok(Err(e)) => Err(Error::io(format!("shm listen {path}: probe the socket"), e)),
        Err(_) => Err(Error::new(
            ErrorKind::InUse,
            format!("shm listen {path}: another listener is there (it does not answer)"),
        )),
    }
}

async fn accept_loop(
    listener: UnixListener,
    path: String,
    config: Arc<ShmConfig>,
    incoming: mpsc::Sender<Result<Link>>,
) {
    // Handshakes run beside the accept loop, so a slow or silent peer cannot hold up the
    // next one; they end with the loop when the listener is dropped.
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let incoming = incoming.clone();
                    let config = Arc::clone(&config);
                    let peer = match stream.peer_cred().ok().and_then(|c| c.pid()) {
                        Some(pid) => format!("shm:{path} (pid {pid})"),
                        None => format!("shm:{path}"),
                    };
                    handshakes.spawn(async move {
                        let limit = config.handshake_timeout;
                        let link = match tokio::time::timeout(
                            limit,
                            accept_with(stream, &config, peer.clone()),
                        )
                        .await
                        {
                            Ok(link) => link,
                            Err(_) => Err(Error::new(
                                ErrorKind::Timeout,
                                format!("{peer}: handshake not done within {limit:?}"),
                            )),
                        };
                        // The listener may be gone; the link then just closes.
                        let _ = incoming.send(link).await;
                    });
                }
                Err(e) => {
                    let err = Error::io(format!("shm accept on {path}"), e);
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

/// The listening side of a [`ShmTransport`].
struct ShmListener {
    path: String,
    /// Device and inode of the socket file this listener created, to remove only that.
    ident: Option<(u64, u64)>,
    incoming: AcceptQueue,
    task: JoinHandle<()>,
}

impl fmt::Debug for ShmListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmListener")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl Listener for ShmListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(self.incoming.next())
    }

    fn local_addr(&self) -> String {
        self.path.clone()
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.task.abort();
        let ours = std::fs::symlink_metadata(&self.path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        if ours.is_some() && ours == self.ident {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn protocol(peer: &str, what: impl fmt::Display) -> Error {
    Error::new(ErrorKind::Protocol, format!("{peer}: {what}"))
}
