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
//! copied out is decoded by the total [`wire::decode`], so garbage is a protocol error,
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

use std::fmt;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;
use socket2::SockRef;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use crate::transport::accept::AcceptQueue;
use crate::transport::stream_tx::{StreamSink, StreamTx, frame_parts};
use crate::transport::{Link, LinkRx, Listener, Transport, remember};
use crate::wire::Message;
use crate::wire::{self, Frame};

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

// ----- the shared memory -----

/// One ring's place in the mapping.
#[derive(Debug, Clone, Copy)]
struct RingGeom {
    /// Offset of its control block.
    control: usize,
    /// Offset of its bytes.
    data: usize,
    /// Bytes in the ring, a power of two.
    size: u64,
}

/// The mapped shared memory of one link: header, control blocks, both rings.
///
/// Invariant: the mapping is at least `SHM_HEADER_LEN + size0 + size1` bytes, the
/// geometries lie inside it, and the file under it cannot shrink (it is sealed), so
/// every offset this type computes stays inside mapped memory.
struct Region {
    map: MmapRaw,
    rings: [RingGeom; 2],
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.map.len())
            .field("rings", &self.rings)
            .finish()
    }
}

impl Region {
    /// The connector's side: a fresh sealed memfd with two rings of `ring_size` bytes,
    /// mapped. Returns the file too, to hand to the peer.
    fn create(ring_size: usize) -> io::Result<(Region, File)> {
        let size = ring_size as u64;
        let total = SHM_HEADER_LEN as u64 + 2 * size;
        let file = File::from(memfd()?);
        file.set_len(total)?;
        let mut header = [0u8; 32];
        header[0..8].copy_from_slice(&SHM_MAGIC);
        header[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
        header[12..16].copy_from_slice(&(SHM_HEADER_LEN as u32).to_ne_bytes());
        header[16..24].copy_from_slice(&size.to_ne_bytes());
        header[24..32].copy_from_slice(&size.to_ne_bytes());
        file.write_all_at(&header, 0)?;
        add_seals(
            file.as_fd(),
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )?;
        let map = MmapOptions::new().len(total as usize).map_raw(&file)?;
        Ok((Region::new(map, [size, size]), file))
    }

    /// The acceptor's side: checks and maps the memory the peer handed over. The error is
    /// the reason to give the peer.
    fn open(file: &File) -> std::result::Result<Region, String> {
        // Only a tmpfs memfd sealed against shrinking, checked before any read: a read of
        // another kind of file may block a runtime thread, and a hugetlbfs page the peer
        // punches out cannot be faulted back in (SIGBUS).
        let seals = get_seals(file.as_fd())
            .map_err(|e| format!("the shared memory is not a sealable memfd: {e}"))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err("the shared memory is not sealed against shrinking".into());
        }
        let mut fs = MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: fstatfs writes a statfs into `fs` on success.
        if unsafe { libc::fstatfs(file.as_raw_fd(), fs.as_mut_ptr()) } < 0 {
            return Err(format!(
                "cannot statfs the shared memory: {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: initialised by the successful fstatfs.
        let fs_type = unsafe { fs.assume_init() }.f_type;
        if fs_type != libc::TMPFS_MAGIC as _ {
            return Err(format!(
                "the shared memory is not a tmpfs memfd (file system {fs_type:#x})"
            ));
        }
        let mut header = [0u8; 32];
        file.read_exact_at(&mut header, 0)
            .map_err(|e| format!("cannot read the shared memory header: {e}"))?;
        if header[0..8] != SHM_MAGIC {
            return Err("bad shared memory magic".into());
        }
        let word = |at: usize| u32::from_ne_bytes([0, 1, 2, 3].map(|i| header[at + i]));
        let size_at =
            |at: usize| u64::from_ne_bytes([0, 1, 2, 3, 4, 5, 6, 7].map(|i| header[at + i]));
        let version = word(8);
        if version != SHM_VERSION {
            return Err(format!(
                "shared memory layout version {version}, this side speaks {SHM_VERSION}"
            ));
        }
        let header_len = word(12);
        if header_len as usize != SHM_HEADER_LEN {
            return Err(format!(
                "shared memory header length {header_len}, expected {SHM_HEADER_LEN}"
            ));
        }
        let sizes = OFF_RING_SIZE.map(size_at);
        for (i, s) in sizes.iter().enumerate() {
            if !valid_ring_size(*s) {
                return Err(format!(
                    "ring {i} size {s} is not a power of two between {MIN_RING_SIZE} and \
                     {MAX_RING_SIZE}"
                ));
            }
        }
        let total = SHM_HEADER_LEN as u64 + sizes[0] + sizes[1];
        // Seals first: once it cannot shrink, the size checked next stays true.
        let seals = get_seals(file.as_fd())
            .map_err(|e| format!("the shared memory is not a sealable memfd: {e}"))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err("the shared memory is not sealed against shrinking".into());
        }
        let len = file
            .metadata()
            .map_err(|e| format!("cannot stat the shared memory: {e}"))?
            .len();
        if len < total {
            return Err(format!(
                "the shared memory is {len} bytes, its header needs {total}"
            ));
        }
        let map = MmapOptions::new()
            .len(total as usize)
            .map_raw(file)
            .map_err(|e| format!("cannot map the shared memory: {e}"))?;
        Ok(Region::new(map, sizes))
    }

    /// `map` must hold the header and both rings of `sizes`.
    fn new(map: MmapRaw, sizes: [u64; 2]) -> Region {
        let rings = [
            RingGeom {
                control: OFF_CONTROL[0],
                data: SHM_HEADER_LEN,
                size: sizes[0],
            },
            RingGeom {
                control: OFF_CONTROL[1],
                data: SHM_HEADER_LEN + sizes[0] as usize,
                size: sizes[1],
            },
        ];
        debug_assert!(map.len() >= SHM_HEADER_LEN + (sizes[0] + sizes[1]) as usize);
        Region { map, rings }
    }

    fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= SHM_HEADER_LEN);
        // SAFETY: `offset` is one of the fixed control-block offsets, 8-aligned and inside
        // the header page, which is inside the mapping (page-aligned, so the address is
        // 8-aligned) for as long as `self` lives; this process only ever accesses these
        // words atomically.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast()) }
    }

    fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % 4 == 0 && offset + 4 <= SHM_HEADER_LEN);
        // SAFETY: as in `atomic_u64`, for a 4-aligned control-block word.
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(offset).cast()) }
    }
}

/// A view of one ring of a region, from one side.
#[derive(Debug, Clone)]
struct Ring {
    region: Arc<Region>,
    geom: RingGeom,
}

impl Ring {
    fn new(region: &Arc<Region>, index: usize) -> Ring {
        Ring {
            region: Arc::clone(region),
            geom: region.rings[index],
        }
    }

    fn size(&self) -> u64 {
        self.geom.size
    }

    fn tail(&self) -> &AtomicU64 {
        self.region.atomic_u64(self.geom.control + CTL_TAIL)
    }

    fn head(&self) -> &AtomicU64 {
        self.region.atomic_u64(self.geom.control + CTL_HEAD)
    }

    fn closed(&self) -> &AtomicU32 {
        self.region.atomic_u32(self.geom.control + CTL_CLOSED)
    }

    fn producer_sleeping(&self) -> &AtomicU32 {
        self.region
            .atomic_u32(self.geom.control + CTL_PRODUCER_SLEEPING)
    }

    fn consumer_sleeping(&self) -> &AtomicU32 {
        self.region
            .atomic_u32(self.geom.control + CTL_CONSUMER_SLEEPING)
    }

    fn consumer_gone(&self) -> &AtomicU32 {
        self.region
            .atomic_u32(self.geom.control + CTL_CONSUMER_GONE)
    }

    /// Bytes the producer at `tail` may write now; fails when the peer's head is out of
    /// range.
    fn room(&self, tail: u64) -> std::result::Result<u64, String> {
        let head = self.head().load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.size() {
            return Err(format!(
                "the peer's ring head {head} is out of range (tail {tail}, size {})",
                self.size()
            ));
        }
        Ok(self.size() - used)
    }

    /// Bytes the consumer at `head` may read up to the returned tail; fails when the
    /// peer's tail is out of range.
    fn available(&self, head: u64) -> std::result::Result<(u64, u64), String> {
        let tail = self.tail().load(Ordering::Acquire);
        let avail = tail.wrapping_sub(head);
        if avail > self.size() {
            return Err(format!(
                "the peer's ring tail {tail} is out of range (head {head}, size {})",
                self.size()
            ));
        }
        Ok((avail, tail))
    }

    /// Where `pos` falls in the ring and how many bytes of `len` fit before the end.
    fn split(&self, pos: u64, len: usize) -> (usize, usize, usize) {
        let size = self.size() as usize;
        let len = len.min(size);
        let at = (pos & (self.size() - 1)) as usize;
        let first = len.min(size - at);
        (at, first, len - first)
    }

    /// Copies `src` (at most the ring's size of it) into the ring at position `pos`,
    /// wrapping at the end. Only the producer calls this, on bytes the consumer is done
    /// with.
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let (at, first, second) = self.split(pos, src.len());
        let base = self.region.map.as_mut_ptr();
        // SAFETY: `at + first <= size` and `second <= at`, so both ranges lie within this
        // ring's `size` bytes at `geom.data`, which the region's invariant keeps inside the
        // mapping; `src` is private memory of this process, so the ranges do not overlap,
        // and `first + second <= src.len()`. Raw copies: no reference to the shared bytes
        // is ever formed.
        unsafe {
            let ring = base.add(self.geom.data);
            std::ptr::copy_nonoverlapping(src.as_ptr(), ring.add(at), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), ring, second);
        }
    }

    /// Copies `dst.len()` bytes (at most the ring's size) out of the ring from position
    /// `pos`, wrapping at the end; returns how many it wrote to the front of `dst`.
    fn copy_out(&self, pos: u64, dst: &mut [MaybeUninit<u8>]) -> usize {
        let (at, first, second) = self.split(pos, dst.len());
        let base = self.region.map.as_ptr();
        // SAFETY: as in `copy_in`, both source ranges lie in the ring inside the mapping,
        // and `first + second <= dst.len()`, private memory that does not overlap it.
        unsafe {
            let ring = base.add(self.geom.data);
            let out = dst.as_mut_ptr().cast::<u8>();
            std::ptr::copy_nonoverlapping(ring.add(at), out, first);
            std::ptr::copy_nonoverlapping(ring, out.add(first), second);
        }
        first + second
    }
}

// ----- system calls -----

fn memfd() -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated string; memfd_create has no other
    // preconditions.
    let fd = unsafe {
        libc::memfd_create(
            c"vsan-shm".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created for us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn add_seals(fd: BorrowedFd<'_>, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS takes an int argument; `fd` is open for the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn get_seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: F_GET_SEALS takes no argument; `fd` is open for the call.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(seals)
}

/// A doorbell: (the end this side waits on, the end to hand to the peer).
fn doorbell() -> io::Result<(OwnedFd, OwnedFd)> {
    let (wait, ring) = std::os::unix::net::UnixStream::pair()?;
    wait.set_nonblocking(true)?;
    ring.set_nonblocking(true)?;
    Ok((OwnedFd::from(wait), OwnedFd::from(ring)))
}

/// Wakes the side waiting on the other end of `bell`. Never blocks; errors are ignored
/// (a full bell already has a wake-up pending; a closed one belongs to a peer that is
/// gone, which the control socket reports).
fn ring_bell(bell: &OwnedFd) {
    let _ = SockRef::from(bell).send_with_flags(&[1], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
}

/// What draining a doorbell found.
enum Bell {
    /// Read everything there was (maybe nothing).
    Drained,
    /// More may be there; the peer keeps ringing.
    More,
    /// The peer closed its end.
    Hangup,
}

fn drain_bell(bell: &OwnedFd) -> io::Result<Bell> {
    let mut buf = [MaybeUninit::<u8>::uninit(); 64];
    for _ in 0..MAX_BELL_READS {
        match SockRef::from(bell).recv_with_flags(&mut buf, libc::MSG_DONTWAIT) {
            Ok(0) => return Ok(Bell::Hangup),
            // A short read took all there was; no need for a second call to see EAGAIN
            // (a byte that arrives after it is a new readiness event, which
            // `clear_ready` leaves alone).
            Ok(n) if n < buf.len() => return Ok(Bell::Drained),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Bell::Drained),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Bell::More)
}

/// One `sendmsg` of `data` with `fds` attached (non-blocking).
fn sendmsg_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let fds = &fds[..fds.len().min(MAX_FDS)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    let mut control = [0u64; CMSG_WORDS];
    // SAFETY: msghdr is plain data; all zeroes is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = (fds.len() * size_of::<RawFd>()) as u32;
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is plain arithmetic; the result fits `control` as
        // `fds.len() <= MAX_FDS`.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(payload) } as _;
        // SAFETY: `msg_control` points at `msg_controllen` writable, 8-aligned bytes, room
        // for one header and `payload` bytes of descriptors, so CMSG_FIRSTHDR is non-null
        // and the writes stay inside `control` (unaligned writes for the data).
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            let out = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                out.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at `iov` (over `data`) and `control`, both alive for the call.
    let sent = unsafe {
        libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// One `recvmsg` into `buf` (non-blocking); descriptors received are appended to `fds`.
/// Returns the bytes read and whether descriptors were cut off for lack of room.
fn recvmsg_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<(usize, bool)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; CMSG_WORDS];
    // SAFETY: msghdr is plain data; all zeroes is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control) as _;
    // SAFETY: `msg` points at `iov` (over `buf`, writable) and `control`, both alive for
    // the call and of the lengths given.
    let read = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
        )
    };
    if read < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `msg` was filled in by recvmsg; CMSG_FIRSTHDR returns null or a header
    // inside `control`.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: a non-null `cmsg` from CMSG_FIRSTHDR/CMSG_NXTHDR is a complete header
        // inside `control`.
        let (level, kind, len) = unsafe {
            (
                (*cmsg).cmsg_level,
                (*cmsg).cmsg_type,
                (*cmsg).cmsg_len as usize,
            )
        };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: plain arithmetic.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header) / size_of::<RawFd>();
            // SAFETY: the kernel wrote `count` descriptors after this header, inside
            // `control` (it cuts the message, and says so, when they do not fit).
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: in bounds as above; CMSG_DATA need not be aligned for an int.
                let raw = unsafe { data.add(i).read_unaligned() };
                // SAFETY: the kernel just installed this descriptor for us; nothing else
                // owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
            }
        }
        // SAFETY: `cmsg` is a header inside `msg`'s control buffer.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok((read as usize, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

/// Sends all of `data`, with `fds` attached to its first byte.
async fn send_handshake(sock: &UnixStream, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        let attach = if done == 0 { fds } else { &[] };
        let sent = sock
            .async_io(Interest::WRITABLE, || {
                sendmsg_fds(sock.as_fd(), &data[done..], attach)
            })
            .await?;
        if sent == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += sent;
    }
    Ok(())
}

/// Reads exactly `len` bytes and the descriptors that come with them. `Ok(None)` when
/// the peer hangs up first.
async fn recv_handshake(
    sock: &UnixStream,
    len: usize,
) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>, bool)>> {
    let mut buf = vec![0u8; len];
    let mut fds = Vec::new();
    let mut truncated = false;
    let mut got = 0;
    while got < len {
        let (n, cut) = sock
            .async_io(Interest::READABLE, || {
                recvmsg_fds(sock.as_fd(), &mut buf[got..], &mut fds)
            })
            .await?;
        truncated |= cut;
        if n == 0 {
            return Ok(None);
        }
        got += n;
        if fds.len() > MAX_FDS {
            truncated = true;
            break;
        }
    }
    Ok(Some((buf, fds, truncated)))
}

// ----- handshake -----

fn hello() -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..8].copy_from_slice(&HANDSHAKE_MAGIC);
    h[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
    h
}

fn reply(status: u32, reason: &str) -> [u8; REPLY_LEN] {
    let mut r = [0u8; REPLY_LEN];
    r[0..8].copy_from_slice(&HANDSHAKE_MAGIC);
    r[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
    r[12..16].copy_from_slice(&status.to_ne_bytes());
    let mut end = reason.len().min(REPLY_LEN - REPLY_REASON_AT);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    r[16..20].copy_from_slice(&(end as u32).to_ne_bytes());
    r[REPLY_REASON_AT..REPLY_REASON_AT + end].copy_from_slice(&reason.as_bytes()[..end]);
    r
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn protocol(peer: &str, what: impl fmt::Display) -> Error {
    Error::new(ErrorKind::Protocol, format!("{peer}: {what}"))
}

/// The connector's handshake over `stream`, handing over `region` (backed by `file`),
/// bounded by the handshake timeout.
async fn connect_with(
    stream: UnixStream,
    region: Arc<Region>,
    file: File,
    config: &ShmConfig,
    peer: String,
) -> Result<Link> {
    let limit = config.handshake_timeout;
    match tokio::time::timeout(
        limit,
        connector_handshake(stream, region, file, config, &peer),
    )
    .await
    {
        Ok(link) => link,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!("{peer}: handshake not done within {limit:?}"),
        )),
    }
}

async fn connector_handshake(
    stream: UnixStream,
    region: Arc<Region>,
    file: File,
    config: &ShmConfig,
    peer: &str,
) -> Result<Link> {
    let io_err = |e| Error::io(format!("{peer}: handshake"), e);
    let (data_wait, data_give) = doorbell().map_err(io_err)?;
    let (room_wait, room_give) = doorbell().map_err(io_err)?;
    send_handshake(
        &stream,
        &hello(),
        &[file.as_fd(), data_give.as_fd(), room_give.as_fd()],
    )
    .await
    .map_err(io_err)?;
    // The peer has its copies; ours would keep our own bells from seeing it hang up.
    drop((file, data_give, room_give));
    let Some((answer, fds, truncated)) =
        recv_handshake(&stream, REPLY_LEN).await.map_err(io_err)?
    else {
        return Err(protocol(
            peer,
            "the listener hung up during the handshake (not a vsan shm listener?)",
        ));
    };
    // Whatever is refused below goes to the reaper, not closed on this runtime thread.
    let mut fds = PeerFds(fds);
    if answer[0..8] != HANDSHAKE_MAGIC {
        return Err(protocol(
            peer,
            "the listener's reply is not a vsan shm reply",
        ));
    }
    let version = u32_at(&answer, 8);
    let status = u32_at(&answer, 12);
    if status == REPLY_REFUSED {
        let len = (u32_at(&answer, 16) as usize).min(REPLY_LEN - REPLY_REASON_AT);
        let reason = String::from_utf8_lossy(&answer[REPLY_REASON_AT..REPLY_REASON_AT + len]);
        return Err(protocol(
            peer,
            format!("the listener refused the link: {reason}"),
        ));
    }
    if version != SHM_VERSION || status != REPLY_OK {
        return Err(protocol(
            peer,
            format!("the listener answered version {version} status {status}"),
        ));
    }
    if truncated || fds.0.len() != REPLY_FDS || !fds.0.iter().all(is_unix_socket) {
        return Err(protocol(
            peer,
            format!(
                "the listener sent {} descriptors, expected {REPLY_FDS} Unix doorbell sockets",
                fds.0.len()
            ),
        ));
    }
    let [peer_data, peer_room]: [OwnedFd; REPLY_FDS] = std::mem::take(&mut fds.0)
        .try_into()
        .map_err(|_| protocol(peer, "doorbells missing"))?;
    let conn = Conn::new(
        stream,
        &region,
        Side::Connector,
        Bells {
            data_wait,
            room_wait,
            peer_data,
            peer_room,
        },
        config,
        peer.to_string(),
    )
    .map_err(io_err)?;
    Ok(link_over(conn, config))
}

async fn accept_with(stream: UnixStream, config: &ShmConfig, peer: String) -> Result<Link> {
    let io_err = |e| Error::io(format!("{peer}: handshake"), e);
    let Some((hello, fds, truncated)) = recv_handshake(&stream, HELLO_LEN).await.map_err(io_err)?
    else {
        return Err(Error::new(
            ErrorKind::Closed,
            format!("{peer}: the peer hung up during the handshake"),
        ));
    };
    let mut fds = fds;
    let checked = check_hello(&hello, &mut fds, truncated);
    let (region, peer_data, peer_room) = match checked {
        Ok(parts) => parts,
        Err(reason) => {
            reap(std::mem::take(&mut fds));
            // Best effort: tell the peer why before hanging up.
            let _ = tokio::time::timeout(
                Duration::from_millis(100),
                send_handshake(&stream, &reply(REPLY_REFUSED, &reason), &[]),
            )
            .await;
            return Err(protocol(&peer, format!("refused the link: {reason}")));
        }
    };
    let (data_wait, data_give) = doorbell().map_err(io_err)?;
    let (room_wait, room_give) = doorbell().map_err(io_err)?;
    send_handshake(
        &stream,
        &reply(REPLY_OK, ""),
        &[data_give.as_fd(), room_give.as_fd()],
    )
    .await
    .map_err(io_err)?;
    drop((data_give, room_give));
    let conn = Conn::new(
        stream,
        &Arc::new(region),
        Side::Acceptor,
        Bells {
            data_wait,
            room_wait,
            peer_data,
            peer_room,
        },
        config,
        peer.clone(),
    )
    .map_err(io_err)?;
    Ok(link_over(conn, config))
}

/// Checks the connector's hello and what came with it; the error is the reason to give.
fn check_hello(
    hello: &[u8],
    fds: &mut Vec<OwnedFd>,
    truncated: bool,
) -> std::result::Result<(Region, OwnedFd, OwnedFd), String> {
    if hello[0..8] != HANDSHAKE_MAGIC {
        return Err("not a vsan shm hello".into());
    }
    let version = u32_at(hello, 8);
    if version != SHM_VERSION {
        return Err(format!(
            "handshake version {version}, this side speaks {SHM_VERSION}"
        ));
    }
    if truncated || fds.len() != HELLO_FDS {
        return Err(format!(
            "{} descriptors came with the hello, expected {HELLO_FDS}",
            fds.len()
        ));
    }
    // Unix sockets only (their close never blocks; a TCP socket's may linger).
    if !is_unix_socket(&fds[1]) || !is_unix_socket(&fds[2]) {
        return Err("the doorbells are not sockets (of the Unix domain)".into());
    }
    let file = File::from(fds.remove(0));
    match Region::open(&file) {
        Ok(region) => {
            let room = fds.pop().unwrap();
            let data = fds.pop().unwrap();
            Ok((region, data, room))
        }
        Err(why) => {
            fds.insert(0, OwnedFd::from(file));
            Err(why)
        }
    }
}

/// Whether `fd` is a Unix domain socket (whose close never blocks).
fn is_unix_socket(fd: &OwnedFd) -> bool {
    SockRef::from(fd)
        .domain()
        .is_ok_and(|d| d == socket2::Domain::UNIX)
}

/// Closes descriptors a peer handed over and this side did not take, on one reaper
/// thread instead of a runtime worker: closing an unknown descriptor may block (a TCP
/// socket's linger, a FUSE flush), and a stuck reaper stalls nothing but itself.
fn reap(fds: Vec<OwnedFd>) {
    static REAPER: std::sync::OnceLock<
        Option<std::sync::Mutex<std::sync::mpsc::Sender<Vec<OwnedFd>>>>,
    > = std::sync::OnceLock::new();
    if fds.is_empty() {
        return;
    }
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<OwnedFd>>();
        std::thread::Builder::new()
            .name("vsan-shm-reaper".into())
            .spawn(move || {
                for fds in rx {
                    drop(fds);
                }
            })
            .ok()
            .map(|_| std::sync::Mutex::new(tx))
    });
    match reaper {
        Some(tx) => {
            if let Ok(tx) = tx.lock() {
                let _ = tx.send(fds);
            }
        }
        // No thread could be started: close them here rather than leak them.
        None => drop(fds),
    }
}

/// Descriptors from the peer that go to the reaper unless taken.
struct PeerFds(Vec<OwnedFd>);

impl Drop for PeerFds {
    fn drop(&mut self) {
        reap(std::mem::take(&mut self.0));
    }
}

// ----- a link -----

/// Which end of the link this side is: the connector writes ring 0 and reads ring 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Connector,
    Acceptor,
}

/// The doorbells of one side.
struct Bells {
    /// Ours: the peer rings it after writing into the ring we read.
    data_wait: OwnedFd,
    /// Ours: the peer rings it after freeing room in the ring we write.
    room_wait: OwnedFd,
    /// The peer's data bell: we ring it after writing into the ring it reads.
    peer_data: OwnedFd,
    /// The peer's room bell: we ring it after freeing room in the ring it writes.
    peer_room: OwnedFd,
}

/// What both halves of a link share.
#[derive(Debug)]
struct Conn {
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
    fn new(
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

    fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    fn down_error(&self) -> Option<Error> {
        if !self.is_down() {
            return None;
        }
        let reason = self.down_reason.lock();
        let (kind, text) = reason.as_ref()?;
        Some(Error::new(*kind, text.clone()))
    }

    fn check_up(&self) -> Result<()> {
        match self.down_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Ends the link as a whole: every later call on either half fails with `err`'s kind
    /// and text (the first reason wins), and the socket is shut down so the peer (and
    /// our own waiters) see it.
    fn tear_down(&self, err: &Error) {
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
    fn check_socket(&self) {
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
    async fn wait_bell(&self, bell: &AsyncFd<OwnedFd>) {
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
async fn spin_until(budget: Duration, mut ready: impl FnMut() -> bool) -> bool {
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

fn link_over(conn: Conn, config: &ShmConfig) -> Link {
    let conn = Arc::new(conn);
    let sink = ShmSink {
        ring: conn.tx_ring.clone(),
        conn: Arc::clone(&conn),
        tail: AtomicU64::new(0),
    };
    let tx = StreamTx::new(
        sink,
        conn.peer.clone(),
        config.send_queue_limit,
        config.close_timeout,
    );
    let rx = ShmRx {
        ring: conn.rx_ring.clone(),
        conn,
        head: 0,
        buf: BytesMut::new(),
        failed: None,
    };
    Link::new(Box::new(tx), Box::new(rx))
}

// ----- sending -----

/// The shared-memory end of a link's sending half: the ring this side writes.
#[derive(Debug)]
struct ShmSink {
    conn: Arc<Conn>,
    ring: Ring,
    /// This side's tail, in private memory; only the current writer touches it.
    tail: AtomicU64,
}

impl ShmSink {
    fn peer(&self) -> &str {
        &self.conn.peer
    }

    /// Copies as many bytes of `parts` as the ring has room for, publishes them and wakes
    /// the peer if it sleeps; returns how many. Only the current writer calls this.
    fn write_parts<'p>(&self, parts: impl Iterator<Item = &'p [u8]>) -> Result<usize> {
        let tail = self.tail.load(Ordering::Relaxed);
        let mut room = match self.ring.room(tail) {
            Ok(room) => room as usize,
            Err(why) => {
                let err = protocol(self.peer(), why);
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
    fn ring_has_room(&self) -> bool {
        let tail = self.tail.load(Ordering::Relaxed);
        self.check_link().is_err() || self.ring.room(tail).map_or(true, |r| r > 0)
    }

    /// The writer task waits here while the ring is full.
    async fn wait_for_ring(&self) -> Result<()> {
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

/// The receiving half of a shared-memory link.
#[derive(Debug)]
struct ShmRx {
    conn: Arc<Conn>,
    ring: Ring,
    /// This side's head, in private memory.
    head: u64,
    /// Bytes copied out of the ring and not yet decoded; decoded data are slices of it.
    buf: BytesMut,
    /// The first error; every later `recv` reports it.
    failed: Option<(ErrorKind, String)>,
}

impl ShmRx {
    fn fail(&mut self, err: Error) -> Error {
        self.failed = Some(remember(&err));
        err
    }

    /// Decodes the next frame of the buffer, if it is all there.
    fn decode(&mut self) -> Result<Option<Message>> {
        match wire::decode(&mut self.buf) {
            Ok(msg) => Ok(msg),
            Err(e) => {
                let err = Error::with_source(
                    ErrorKind::Protocol,
                    format!("{}: received a bad frame", self.conn.peer),
                    e,
                );
                // Never trusted again: the send half fails too, and the peer sees the end.
                self.conn.tear_down(&err);
                Err(self.fail(err))
            }
        }
    }

    /// Copies everything in the ring into the buffer and frees it; returns how much.
    fn pull(&mut self) -> Result<usize> {
        let (avail, tail) = match self.ring.available(self.head) {
            Ok(found) => found,
            Err(why) => {
                let err = protocol(&self.conn.peer, why);
                self.conn.tear_down(&err);
                return Err(self.fail(err));
            }
        };
        if avail == 0 {
            return Ok(0);
        }
        let n = avail as usize;
        self.buf.reserve(n);
        let copied = self
            .ring
            .copy_out(self.head, &mut self.buf.spare_capacity_mut()[..n]);
        debug_assert_eq!(copied, n);
        // SAFETY: `copy_out` initialised the first `copied` bytes of the spare capacity.
        unsafe { self.buf.set_len(self.buf.len() + copied) };
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
    fn ready(&self) -> bool {
        self.ring.tail().load(Ordering::Acquire) != self.head
            || self.ring.closed().load(Ordering::Acquire) != 0
            || self.conn.is_down()
    }

    async fn wait(&self) {
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

    fn end_error(&self, mut err: Error) -> Error {
        if err.kind() == ErrorKind::Closed && !self.buf.is_empty() {
            err = Error::new(
                ErrorKind::Closed,
                format!(
                    "{}: the peer closed the link in the middle of a frame ({} bytes of it \
                     received)",
                    self.conn.peer,
                    self.buf.len()
                ),
            );
        }
        err
    }

    async fn next(&mut self) -> Result<Message> {
        if let Some((kind, context)) = &self.failed {
            return Err(Error::new(*kind, context.clone()));
        }
        loop {
            if let Some(msg) = self.decode()? {
                return Ok(msg);
            }
            if self.pull()? > 0 {
                continue;
            }
            // The ring is empty. The flag is read before the tail again, so a close seen
            // here comes after every byte the peer wrote.
            let closed = self.ring.closed().load(Ordering::Acquire) != 0;
            let down = self.conn.down_error();
            if closed || down.is_some() {
                if self.pull()? > 0 {
                    continue;
                }
                let err = match down {
                    Some(err) if !closed => err,
                    _ => Error::new(
                        ErrorKind::Closed,
                        format!("{}: the peer closed the link", self.conn.peer),
                    ),
                };
                let err = self.end_error(err);
                return Err(self.fail(err));
            }
            self.wait().await;
        }
    }
}

impl LinkRx for ShmRx {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(self.next())
    }

    fn peer(&self) -> &str {
        &self.conn.peer
    }
}

impl Drop for ShmRx {
    fn drop(&mut self) {
        self.ring.consumer_gone().store(1, Ordering::Release);
        ring_bell(&self.conn.peer_room);
    }
}

#[cfg(test)]
mod tests {
    //! Hostile peers: forged or undersized memory, wrong descriptors, and a peer that
    //! scribbles on the shared memory of a live link. None may panic or hang; each is
    //! refused (or fails the link) with `Protocol`, and the listener keeps working.

    use super::*;

    const WAIT: Duration = Duration::from_secs(10);

    async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
        match tokio::time::timeout(WAIT, fut).await {
            Ok(v) => v,
            Err(_) => panic!("{what}: no result within {WAIT:?}"),
        }
    }

    /// A memfd with a header claiming rings of `ring` bytes, `len` bytes long, sealed
    /// against shrinking or not.
    fn forged(ring: u64, len: u64, seal: bool) -> File {
        let file = File::from(memfd().unwrap());
        file.set_len(len).unwrap();
        let mut header = [0u8; 32];
        header[0..8].copy_from_slice(&SHM_MAGIC);
        header[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
        header[12..16].copy_from_slice(&(SHM_HEADER_LEN as u32).to_ne_bytes());
        header[16..24].copy_from_slice(&ring.to_ne_bytes());
        header[24..32].copy_from_slice(&ring.to_ne_bytes());
        file.write_all_at(&header, 0).unwrap();
        if seal {
            add_seals(file.as_fd(), libc::F_SEAL_SHRINK).unwrap();
        }
        file
    }

    /// Sends a hello with `fds` over a fresh connection; returns the acceptor's verdict
    /// (from `accept`) and the reason the connector was told.
    async fn offer(listener: &dyn Listener, addr: &str, fds: &[BorrowedFd<'_>]) -> (Error, String) {
        let stream = UnixStream::connect(addr).await.unwrap();
        send_handshake(&stream, &hello(), fds).await.unwrap();
        let err = within("accept", listener.accept()).await.unwrap_err();
        let (answer, got, _) = within("reply", recv_handshake(&stream, REPLY_LEN))
            .await
            .unwrap()
            .expect("a refusal");
        assert!(got.is_empty());
        assert_eq!(u32_at(&answer, 12), REPLY_REFUSED);
        let len = u32_at(&answer, 16) as usize;
        let reason = String::from_utf8(answer[REPLY_REASON_AT..REPLY_REASON_AT + len].to_vec());
        (err, reason.unwrap())
    }

    async fn still_works(t: &ShmTransport, listener: &dyn Listener, addr: &str) {
        let (a, b) = within("connect", async {
            tokio::join!(t.connect(addr), listener.accept())
        })
        .await;
        let (a, mut b) = (a.unwrap(), b.unwrap());
        within("send", a.send(Message::Ping { id: 7 }))
            .await
            .unwrap();
        assert_eq!(
            within("recv", b.recv()).await.unwrap(),
            Message::Ping { id: 7 }
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forged_memory_and_descriptors_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let addr = dir.path().join("f.sock").to_str().unwrap().to_string();
        let t = ShmTransport::new();
        let listener = t.listen(&addr).await.unwrap();
        let (_, bell) = doorbell().unwrap();
        let (_, bell2) = doorbell().unwrap();
        let cases: Vec<(File, &str)> = vec![
            // Claims two 8 MiB rings, holds one page: mapping it would fault.
            (forged(8 << 20, 4096, true), "bytes, its header needs"),
            // Right size, but the peer could shrink it under our mapping.
            (
                forged(4096, 3 * 4096, false),
                "not sealed against shrinking",
            ),
            (forged(5000, 1 << 20, true), "not a power of two"),
            (forged(1 << 31, 1 << 20, true), "not a power of two between"),
            (forged(4096, 100, true), "bytes, its header needs"),
        ];
        for (file, expect) in cases {
            let (err, reason) = offer(
                &*listener,
                &addr,
                &[file.as_fd(), bell.as_fd(), bell2.as_fd()],
            )
            .await;
            assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
            assert!(reason.contains(expect), "{reason:?} lacks {expect:?}");
            assert!(err.to_string().contains(expect), "{err}");
        }
        // Not a shared memory file at all, and the wrong count or kind of descriptors.
        let good = forged(4096, 3 * 4096, true);
        let plain = tempfile::tempfile().unwrap();
        let (err, reason) = offer(
            &*listener,
            &addr,
            &[plain.as_fd(), bell.as_fd(), bell2.as_fd()],
        )
        .await;
        assert_eq!(err.kind(), ErrorKind::Protocol);
        assert!(
            reason.contains("header") || reason.contains("memfd"),
            "{reason}"
        );
        let (_, reason) = offer(&*listener, &addr, &[good.as_fd(), bell.as_fd()]).await;
        assert!(reason.contains("descriptors"), "{reason}");
        let (_, reason) = offer(
            &*listener,
            &addr,
            &[good.as_fd(), good.as_fd(), good.as_fd()],
        )
        .await;
        assert!(reason.contains("not sockets"), "{reason}");
        // Sockets, but TCP ones: closing one may linger on a runtime thread (review).
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c1 = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
        let c2 = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
        let (_, reason) = offer(&*listener, &addr, &[good.as_fd(), c1.as_fd(), c2.as_fd()]).await;
        assert!(reason.contains("Unix domain"), "{reason}");
        // A pipe handed over as the memory: refused by its seals before anything reads
        // it (a read of some descriptors blocks).
        let (pipe_r, _pipe_w) = std::io::pipe().unwrap();
        let (_, reason) = offer(
            &*listener,
            &addr,
            &[pipe_r.as_fd(), bell.as_fd(), bell2.as_fd()],
        )
        .await;
        assert!(reason.contains("not a sealable memfd"), "{reason}");
        still_works(&t, &*listener, &addr).await;
    }

    /// A connected pair whose connector's shared memory the test can scribble on.
    async fn exposed_pair() -> (Link, Link, Arc<Region>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let addr = dir.path().join("s.sock").to_str().unwrap().to_string();
        let config = ShmConfig {
            ring_size: 4096,
            ..ShmConfig::default()
        };
        let t = ShmTransport::with_config(config.clone());
        let listener = t.listen(&addr).await.unwrap();
        let (region, file) = Region::create(4096).unwrap();
        let region = Arc::new(region);
        let stream = UnixStream::connect(&addr).await.unwrap();
        let (a, b) = within("handshake", async {
            tokio::join!(
                connect_with(stream, Arc::clone(&region), file, &config, "test".into()),
                listener.accept()
            )
        })
        .await;
        (a.unwrap(), b.unwrap(), region, dir)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tail_out_of_range_fails_the_receiver_with_protocol() {
        // Behind the head, far ahead, just more than the ring ahead.
        for ahead in [u64::MAX, 1 << 40, 4097] {
            let (a, mut b, region, _dir) = exposed_pair().await;
            within("send", a.send(Message::Ping { id: 1 }))
                .await
                .unwrap();
            assert_eq!(
                within("recv", b.recv()).await.unwrap(),
                Message::Ping { id: 1 }
            );
            let ring = Ring::new(&region, 0);
            let head = ring.head().load(Ordering::Acquire);
            assert!(head > 0);
            ring.tail()
                .store(head.wrapping_add(ahead), Ordering::Release);
            let err = within("recv", b.recv()).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
            assert!(err.to_string().contains("out of range"), "{err}");
            // Every later call fails too, and the other side sees the link end.
            let again = within("recv", b.recv()).await.unwrap_err();
            assert_eq!(again.kind(), ErrorKind::Protocol);
            let mut a = a;
            let end = within("peer recv", a.recv()).await.unwrap_err();
            assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_head_out_of_range_fails_the_sender_with_protocol() {
        let (a, mut b, region, _dir) = exposed_pair().await;
        // The acceptor's head on ring 0 is what the connector trusts for room.
        Ring::new(&region, 0)
            .head()
            .store(1 << 50, Ordering::Release);
        let err = within("send", a.send(Message::Ping { id: 1 }))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        let again = within("send", a.send(Message::Ping { id: 2 }))
            .await
            .unwrap_err();
        assert_eq!(again.kind(), ErrorKind::Protocol);
        let end = within("peer recv", b.recv()).await.unwrap_err();
        assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_in_the_ring_fails_the_receiver_with_protocol() {
        let (a, mut b, region, _dir) = exposed_pair().await;
        let ring = Ring::new(&region, 0);
        let junk = [0x5au8; 300];
        ring.copy_in(0, &junk);
        ring.tail().store(junk.len() as u64, Ordering::Release);
        let err = within("recv", b.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains("bad frame"), "{err}");
        drop(a);
    }

    /// A peer that does the handshake by hand, then writes to the control socket, fails
    /// the link with `Protocol`; one that hangs up ends it with `Closed`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hand_made_peer_that_misuses_the_socket_fails_the_link() {
        let dir = tempfile::tempdir().unwrap();
        let addr = dir.path().join("m.sock").to_str().unwrap().to_string();
        let t = ShmTransport::new();
        let listener = t.listen(&addr).await.unwrap();
        for garbage in [true, false] {
            let (_region, file) = Region::create(4096).unwrap();
            let (_data_wait, data_give) = doorbell().unwrap();
            let (_room_wait, room_give) = doorbell().unwrap();
            let mut stream = UnixStream::connect(&addr).await.unwrap();
            send_handshake(
                &stream,
                &hello(),
                &[file.as_fd(), data_give.as_fd(), room_give.as_fd()],
            )
            .await
            .unwrap();
            let mut link = within("accept", listener.accept()).await.unwrap();
            let (answer, bells, _) = within("reply", recv_handshake(&stream, REPLY_LEN))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(u32_at(&answer, 12), REPLY_OK);
            assert_eq!(bells.len(), REPLY_FDS);
            let want = if garbage {
                tokio::io::AsyncWriteExt::write_all(&mut stream, b"hi")
                    .await
                    .unwrap();
                ErrorKind::Protocol
            } else {
                drop(stream);
                drop(bells);
                ErrorKind::Closed
            };
            let err = within("recv", link.recv()).await.unwrap_err();
            assert_eq!(err.kind(), want, "{err}");
            let err = within("send", link.send(Message::Ping { id: 1 }))
                .await
                .unwrap_err();
            assert_eq!(err.kind(), want, "{err}");
        }
        still_works(&t, &*listener, &addr).await;
    }

    #[test]
    fn ring_copies_wrap_and_never_leave_the_ring() {
        let (region, _file) = Region::create(4096).unwrap();
        let region = Arc::new(region);
        let ring = Ring::new(&region, 1);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        for pos in [0u64, 1, 4000, 4095, 4096, u64::MAX - 10] {
            ring.copy_in(pos, &data[..3000]);
            let mut out = vec![MaybeUninit::<u8>::uninit(); 3000];
            assert_eq!(ring.copy_out(pos, &mut out), 3000);
            // SAFETY: copy_out initialised all 3000 bytes.
            let out: Vec<u8> = out
                .into_iter()
                .map(|b| unsafe { b.assume_init() })
                .collect();
            assert_eq!(out, data[..3000]);
        }
        // Asked for more than the ring: clamped to the ring's size.
        let mut big = vec![MaybeUninit::<u8>::uninit(); 10_000];
        assert_eq!(ring.copy_out(5, &mut big), 4096);
        ring.copy_in(5, &[1u8; 10_000]);
        // Ring 0's bytes are untouched by ring 1's copies.
        let mut first = vec![MaybeUninit::<u8>::uninit(); 4096];
        Ring::new(&region, 0).copy_out(0, &mut first);
        // SAFETY: copy_out initialised all of it.
        assert!(first.iter().all(|b| unsafe { b.assume_init() } == 0));
    }
}
