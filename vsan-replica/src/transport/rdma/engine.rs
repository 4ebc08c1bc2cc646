//! The protocol core of an RDMA link: chunk framing and credit-based flow control over
//! a small verbs seam ([`Verbs`]). It does no I/O and never waits; the link driver in
//! [`super::link`] calls it, and the unit tests drive two of them over a fake verbs
//! pair. The design is described in the [module docs](super).

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};
use vsan_core::{Error, ErrorKind, Result};

use crate::transport::QueueDepth;
use crate::wire::Message;
use crate::wire::{self, Frame};

/// Bytes of the header in front of every chunk.
pub(crate) const CHUNK_HEADER_LEN: usize = 12;
/// Smallest registered buffer a side may announce (header plus 52 bytes of payload).
pub(crate) const MIN_BUFFER_LEN: usize = 64;
/// Largest registered buffer a side may announce.
pub(crate) const MAX_BUFFER_LEN: usize = 16 << 20;
/// Fewest receive buffers (credits) a side may announce: the credit update threshold is
/// half of them, and it must be at least 2 so credit updates never answer each other.
pub(crate) const MIN_CREDITS: u32 = 4;
/// Most receive buffers (credits) a side may announce (the grant field is 16 bits).
pub(crate) const MAX_CREDITS: u32 = 4096;

/// Chunk type: a slice of the frame stream.
const TYPE_DATA: u8 = 1;
/// Chunk type: credits only.
const TYPE_CREDIT: u8 = 2;
/// Chunk type: the sender will send no more frames (credits may still follow).
const TYPE_CLOSE: u8 = 3;

/// One finished work request, as the verbs layer reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Completion {
    /// The SEND from send buffer `buf` is done; the buffer may be reused.
    Sent {
        /// The send buffer.
        buf: usize,
    },
    /// A SEND from the peer landed in receive buffer `buf` (`len` bytes); the buffer is
    /// no longer posted.
    Received {
        /// The receive buffer.
        buf: usize,
        /// Bytes received.
        len: usize,
    },
    /// A work request failed (the connection is broken, or flushed after a disconnect).
    Failed {
        /// The verbs status, in words.
        status: String,
    },
}

/// The verbs operations the protocol core needs: a registered buffer pool, posting
/// SENDs and RECVs on one reliable-connected queue pair, and polling its completions.
///
/// Receive completions come in the order the peer's SENDs were posted (reliable
/// connected service); send completions may come in any order relative to them.
pub(crate) trait Verbs: Send + 'static {
    /// Bytes in every registered buffer, send and receive.
    fn buf_len(&self) -> usize;
    /// Send buffers in the pool (ids `0..send_bufs()`).
    fn send_bufs(&self) -> usize;
    /// Receive buffers in the pool (ids `0..recv_bufs()`).
    fn recv_bufs(&self) -> usize;
    /// Send buffer `id`, to fill before [`post_send`](Verbs::post_send). Only called for
    /// a buffer that is not posted.
    fn send_buf(&mut self, id: usize) -> &mut [u8];
    /// Receive buffer `id`, to read after its [`Completion::Received`] and before it is
    /// posted again.
    fn recv_buf(&self, id: usize) -> &[u8];
    /// Posts a signalled SEND of the first `len` bytes of send buffer `id`.
    fn post_send(&mut self, id: usize, len: usize) -> Result<()>;
    /// Posts receive buffer `id` for the peer's next SEND.
    fn post_recv(&mut self, id: usize) -> Result<()>;
    /// Appends the completions ready now to `out`, without waiting.
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()>;
}

/// What the peer announced when the connection was set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PeerParams {
    /// The peer's posted receive buffers: the credits this side starts with.
    pub credits: u32,
    /// Bytes in each of the peer's receive buffers.
    pub buf_len: usize,
}

impl PeerParams {
    /// Checks announced values against the limits both sides follow.
    /// A value out of range fails with [`Protocol`](ErrorKind::Protocol).
    pub(crate) fn check(&self) -> Result<()> {
        if !(MIN_CREDITS..=MAX_CREDITS).contains(&self.credits) {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer announced {} receive buffers (allowed {MIN_CREDITS}..={MAX_CREDITS})",
                    self.credits
                ),
            ));
        }
        if !(MIN_BUFFER_LEN..=MAX_BUFFER_LEN).contains(&self.buf_len) {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer announced {}-byte buffers (allowed {MIN_BUFFER_LEN}..={MAX_BUFFER_LEN})",
                    self.buf_len
                ),
            ));
        }
        Ok(())
    }
}

/// A chunk header, as sent in front of every SEND.
///
/// ```text
///  offset  size  field
///       0     1  type: 1 data, 2 credit, 3 close
///       1     1  flags: 0
///       2     2  grant: receive buffers re-posted since the last grant (credits returned)
///       4     4  seq: chunks sent before this one on this link (wrapping)
///       8     4  len: payload bytes after the header
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkHeader {
    pub kind: u8,
    pub flags: u8,
    pub grant: u16,
    pub seq: u32,
    pub len: u32,
}

impl ChunkHeader {
    pub(crate) fn put(&self, out: &mut [u8]) {
        out[0] = self.kind;
        out[1] = self.flags;
        out[2..4].copy_from_slice(&self.grant.to_be_bytes());
        out[4..8].copy_from_slice(&self.seq.to_be_bytes());
        out[8..12].copy_from_slice(&self.len.to_be_bytes());
    }

    fn parse(bytes: &[u8]) -> Option<ChunkHeader> {
        let h = bytes.get(..CHUNK_HEADER_LEN)?;
        Some(ChunkHeader {
            kind: h[0],
            flags: h[1],
            grant: u16::from_be_bytes([h[2], h[3]]),
            seq: u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
            len: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
        })
    }
}

/// Bytes waiting to be sent, and whether they end a message (for queue depth).
#[derive(Debug)]
struct Part {
    bytes: Bytes,
    ends_message: bool,
}

/// Where the receive side stands once nothing more can be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerEnd {
    /// The peer may still send.
    Open,
    /// The peer sent a close chunk.
    Closed,
}

/// One side of an RDMA link's protocol: see the [module docs](super).
#[derive(Debug)]
pub(crate) struct Engine<V: Verbs> {
    verbs: V,
    /// `rdma:<address>`, for errors.
    peer: String,
    /// Most bytes in one SEND, header included: the smaller of our buffers and the peer's.
    chunk_len: usize,

    /// Send buffers not posted.
    free_send: Vec<usize>,
    /// SENDs this side may post: receive buffers the peer has posted for us.
    credits: u32,
    /// The peer's receive buffers: `credits` plus the credits not yet returned.
    peer_credits: u32,
    /// Bytes not yet copied into a posted SEND, oldest first.
    tx: VecDeque<Part>,
    tx_bytes: usize,
    tx_msgs: usize,
    tx_seq: u32,
    /// No more data is accepted; a close chunk follows what is queued.
    close_requested: bool,
    close_sent: bool,

    /// Which receive buffers are posted.
    posted: Vec<bool>,
    /// Receive buffers re-posted and not yet granted back to the peer.
    owed: u32,
    /// An explicit credit chunk goes out once `owed` reaches this.
    threshold: u32,
    rx_seq: u32,
    /// Data chunks received and not yet consumed: (buffer, length). Their buffers stay
    /// out of the receive queue until the consumer takes the bytes, so a slow reader
    /// stops the peer (backpressure) instead of growing memory.
    ready: VecDeque<(usize, usize)>,
    /// Received stream bytes not yet decoded.
    acc: BytesMut,
    peer_end: PeerEnd,
    /// The connection went away (disconnect event); why.
    gone: Option<String>,
    /// The first fatal error; every later call reports it.
    failed: Option<(ErrorKind, String)>,
    completions: Vec<Completion>,
}

impl<V: Verbs> Engine<V> {
    /// Posts every receive buffer and starts with the peer's announced credits.
    #[cfg(test)]
    pub(crate) fn new(verbs: V, peer_params: PeerParams, peer: String) -> Result<Engine<V>> {
        Engine::build(verbs, peer_params, peer, true)
    }

    /// Like [`new`](Engine::new), for a verbs layer whose receive buffers are all
    /// posted already (before the connection was established, as they must be).
    pub(crate) fn new_posted(verbs: V, peer_params: PeerParams, peer: String) -> Result<Engine<V>> {
        Engine::build(verbs, peer_params, peer, false)
    }

    fn build(mut verbs: V, peer_params: PeerParams, peer: String, post: bool) -> Result<Engine<V>> {
        peer_params
            .check()
            .map_err(|why| why.context_prefix(&peer))?;
        let recv_bufs = verbs.recv_bufs();
        let local_len = verbs.buf_len();
        if local_len < MIN_BUFFER_LEN || verbs.send_bufs() == 0 || recv_bufs == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("{peer}: buffer pool too small"),
            ));
        }
        for id in (0..recv_bufs).filter(|_| post) {
            verbs.post_recv(id).map_err(|why| {
                Error::new(
                    ErrorKind::Io,
                    format!("{peer}: post receive: {}", why.context()),
                )
            })?;
        }
        let threshold = u32::try_from(recv_bufs / 2).unwrap_or(u32::MAX).max(1);
        Ok(Engine {
            chunk_len: local_len.min(peer_params.buf_len),
            free_send: (0..verbs.send_bufs()).rev().collect(),
            credits: peer_params.credits,
            peer_credits: peer_params.credits,
            tx: VecDeque::new(),
            tx_bytes: 0,
            tx_msgs: 0,
            tx_seq: 0,
            close_requested: false,
            close_sent: false,
            posted: vec![true; recv_bufs],
            owed: 0,
            threshold,
            rx_seq: 0,
            ready: VecDeque::new(),
            acc: BytesMut::new(),
            peer_end: PeerEnd::Open,
            gone: None,
            failed: None,
            completions: Vec::new(),
            verbs,
            peer,
        })
    }

    /// The peer, for messages.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    // ----- errors -----

    fn fail(&mut self, err: Error) -> Error {
        if self.failed.is_none() {
            let mut text = err.context().to_string();
            if let Some(source) = std::error::Error::source(&err) {
                text = format!("{text}: {source}");
            }
            self.failed = Some((err.kind(), text));
        }
        err
    }

    fn protocol(&mut self, why: &str) -> Error {
        let err = Error::new(
            ErrorKind::Protocol,
            format!("{}: received a bad chunk: {why}", self.peer),
        );
        self.fail(err)
    }

    fn io(&mut self, what: &str, why: &str) -> Error {
        let err = Error::new(ErrorKind::Io, format!("{}: {what}: {why}", self.peer));
        self.fail(err)
    }

    /// Fails the link from outside (the driver lost its event source, a timeout).
    pub(crate) fn fail_with(&mut self, kind: ErrorKind, why: &str) -> Error {
        let err = Error::new(kind, format!("{}: {why}", self.peer));
        self.fail(err)
    }

    /// The link's first fatal error, if any.
    pub(crate) fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some((kind, text)) => Err(Error::new(*kind, text.clone())),
            None => Ok(()),
        }
    }

    /// Whether the link has failed.
    pub(crate) fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Why the connection went away, once it has.
    pub(crate) fn gone(&self) -> Option<&str> {
        self.gone.as_deref()
    }

    /// Whether new data may be queued.
    pub(crate) fn check_tx(&self) -> Result<()> {
        self.check_failed()?;
        if let Some(why) = &self.gone {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{}: send: {why}", self.peer),
            ));
        }
        if self.close_requested {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{}: send: link closed by this side", self.peer),
            ));
        }
        Ok(())
    }

    /// The connection is gone (the peer disconnected or the device went away): nothing
    /// more is sent or received; what was received is still delivered.
    pub(crate) fn on_disconnect(&mut self, why: &str) {
        if self.gone.is_none() {
            self.gone = Some(why.to_string());
        }
    }

    // ----- sending -----

    /// Queues an encoded frame.
    pub(crate) fn queue_frame(&mut self, frame: Frame) {
        let (head, data) = frame.into_parts();
        let has_data = !data.is_empty();
        self.queue_bytes(head, !has_data);
        if has_data {
            self.queue_bytes(data, true);
        }
    }

    /// Queues raw stream bytes (the authentication exchange before the first message).
    pub(crate) fn queue_bytes(&mut self, bytes: Bytes, ends_message: bool) {
        if ends_message {
            self.tx_msgs += 1;
        }
        if bytes.is_empty() {
            if ends_message {
                self.tx_msgs -= 1;
            }
            return;
        }
        self.tx_bytes += bytes.len();
        self.tx.push_back(Part {
            bytes,
            ends_message,
        });
    }

    /// What is queued and not yet in a posted SEND.
    pub(crate) fn queue_depth(&self) -> QueueDepth {
        QueueDepth {
            messages: self.tx_msgs,
            bytes: self.tx_bytes,
        }
    }

    /// Bytes queued and not yet in a posted SEND.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.tx_bytes
    }

    /// No more data: a close chunk goes out after what is queued.
    pub(crate) fn request_close(&mut self) {
        self.close_requested = true;
        let _ = self.flush();
    }

    /// Whether the close chunk has been posted.
    pub(crate) fn close_sent(&self) -> bool {
        self.close_sent
    }

    /// Whether a close was requested.
    pub(crate) fn close_requested(&self) -> bool {
        self.close_requested
    }

    /// Drops what is queued and closes (the send half was dropped).
    pub(crate) fn abandon(&mut self) {
        self.tx.clear();
        self.tx_bytes = 0;
        self.tx_msgs = 0;
        self.request_close();
    }

    /// Gives up on what is queued after a failed close.
    pub(crate) fn drop_queue(&mut self) {
        self.tx.clear();
        self.tx_bytes = 0;
        self.tx_msgs = 0;
    }

    /// Posts every SEND the credits and free buffers allow: data chunks (each returning
    /// the credits owed), then the close chunk, then an explicit credit chunk when
    /// enough credits are owed. Data and close leave one credit unused, which only a
    /// credit chunk may take, so both sides can always return credits to each other.
    /// Returns whether anything was posted.
    pub(crate) fn flush(&mut self) -> Result<bool> {
        self.check_failed()?;
        if self.gone.is_some() {
            return Ok(false);
        }
        let mut progress = false;
        while !self.free_send.is_empty() {
            let may_send_data = self.credits >= 2;
            if may_send_data && self.tx_bytes > 0 {
                self.post_chunk(TYPE_DATA)?;
            } else if may_send_data && self.close_requested && !self.close_sent {
                self.post_chunk(TYPE_CLOSE)?;
                self.close_sent = true;
            } else if self.credits >= 1 && self.owed >= self.threshold {
                self.post_chunk(TYPE_CREDIT)?;
            } else {
                break;
            }
            progress = true;
        }
        Ok(progress)
    }

    fn post_chunk(&mut self, kind: u8) -> Result<()> {
        let Some(id) = self.free_send.pop() else {
            return Ok(());
        };
        let room = self.chunk_len - CHUNK_HEADER_LEN;
        let grant = u16::try_from(self.owed).unwrap_or(u16::MAX);
        let buf = self.verbs.send_buf(id);
        let mut len = 0;
        if kind == TYPE_DATA {
            let out = &mut buf[CHUNK_HEADER_LEN..CHUNK_HEADER_LEN + room];
            while len < room {
                let Some(part) = self.tx.front_mut() else {
                    break;
                };
                let n = (room - len).min(part.bytes.len());
                out[len..len + n].copy_from_slice(&part.bytes[..n]);
                part.bytes.advance(n);
                len += n;
                if part.bytes.is_empty() {
                    if part.ends_message {
                        self.tx_msgs -= 1;
                    }
                    self.tx.pop_front();
                }
            }
            self.tx_bytes -= len;
        }
        ChunkHeader {
            kind,
            flags: 0,
            grant,
            seq: self.tx_seq,
            // At most MAX_BUFFER_LEN.
            len: len as u32,
        }
        .put(&mut buf[..CHUNK_HEADER_LEN]);
        if let Err(why) = self.verbs.post_send(id, CHUNK_HEADER_LEN + len) {
            return Err(self.io("post send", why.context()));
        }
        self.credits -= 1;
        self.owed -= u32::from(grant);
        self.tx_seq = self.tx_seq.wrapping_add(1);
        Ok(())
    }

    // ----- completions -----

    /// Takes the completions the verbs layer has, applies them, and posts what they
    /// allow.
    pub(crate) fn pump(&mut self) -> Result<()> {
        self.check_failed()?;
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        let polled = self.verbs.poll(&mut completions);
        let mut result = match polled {
            Ok(()) => Ok(()),
            Err(why) => Err(self.io("poll completions", why.context())),
        };
        for c in completions.drain(..) {
            if result.is_err() {
                break;
            }
            result = self.complete(c);
        }
        self.completions = completions;
        result?;
        self.flush().map(|_| ())
    }

    fn complete(&mut self, c: Completion) -> Result<()> {
        match c {
            Completion::Sent { buf } => {
                if buf >= self.verbs.send_bufs() || self.free_send.contains(&buf) {
                    return Err(self.io("send completion", "for a buffer not in flight"));
                }
                self.free_send.push(buf);
                Ok(())
            }
            Completion::Received { buf, len } => self.received(buf, len),
            Completion::Failed { status } => {
                if self.gone.is_some() || self.close_sent {
                    // Flushed work requests after a disconnect.
                    Ok(())
                } else {
                    Err(self.io("work request failed", &status))
                }
            }
        }
    }

    fn received(&mut self, buf: usize, len: usize) -> Result<()> {
        if buf >= self.posted.len() || !self.posted[buf] {
            return Err(self.io("receive completion", "for a buffer not posted"));
        }
        if len > self.verbs.buf_len() {
            return Err(self.io("receive completion", "longer than its buffer"));
        }
        self.posted[buf] = false;
        let Some(h) = ChunkHeader::parse(&self.verbs.recv_buf(buf)[..len]) else {
            return Err(self.protocol("shorter than a chunk header"));
        };
        if h.flags != 0 {
            return Err(self.protocol("unknown flags"));
        }
        if h.seq != self.rx_seq {
            return Err(self.protocol(&format!(
                "out of sequence (chunk {}, expected {})",
                h.seq, self.rx_seq
            )));
        }
        if h.len as usize != len - CHUNK_HEADER_LEN {
            return Err(self.protocol("its length field does not match what arrived"));
        }
        let outstanding = self.peer_credits - self.credits;
        if u32::from(h.grant) > outstanding {
            return Err(self.protocol(&format!(
                "it returns {} credits, but only {outstanding} are out",
                h.grant
            )));
        }
        self.credits += u32::from(h.grant);
        self.rx_seq = self.rx_seq.wrapping_add(1);
        match h.kind {
            TYPE_DATA if self.peer_end == PeerEnd::Closed => {
                Err(self.protocol("data after the peer closed"))
            }
            TYPE_DATA if h.len > 0 => {
                self.ready.push_back((buf, len));
                Ok(())
            }
            TYPE_DATA => self.repost(buf),
            TYPE_CREDIT | TYPE_CLOSE if h.len != 0 => {
                Err(self.protocol("a credit or close chunk with a payload"))
            }
            TYPE_CREDIT => self.repost(buf),
            TYPE_CLOSE if self.peer_end == PeerEnd::Closed => Err(self.protocol("a second close")),
            TYPE_CLOSE => {
                self.peer_end = PeerEnd::Closed;
                self.repost(buf)
            }
            other => Err(self.protocol(&format!("unknown type {other}"))),
        }
    }

    fn repost(&mut self, buf: usize) -> Result<()> {
        if let Err(why) = self.verbs.post_recv(buf) {
            return Err(self.io("post receive", why.context()));
        }
        self.posted[buf] = true;
        self.owed += 1;
        Ok(())
    }

    // ----- receiving -----

    /// Moves the oldest received data chunk into the decode buffer and posts its
    /// receive buffer again. Returns false when none is waiting.
    fn pull_chunk(&mut self) -> Result<bool> {
        let Some((buf, len)) = self.ready.pop_front() else {
            return Ok(false);
        };
        self.acc
            .extend_from_slice(&self.verbs.recv_buf(buf)[CHUNK_HEADER_LEN..len]);
        self.repost(buf)?;
        Ok(true)
    }

    /// The next message, if a whole one has arrived. Fails with
    /// [`Closed`](ErrorKind::Closed) once the peer closed (after its last message) and
    /// with [`Protocol`](ErrorKind::Protocol) for bytes the codec refuses.
    pub(crate) fn take_message(&mut self) -> Result<Option<Message>> {
        self.check_failed()?;
        loop {
            match wire::decode(&mut self.acc) {
                Ok(Some(msg)) => {
                    // Credits for what was consumed; an error is kept for the next call.
                    let _ = self.flush();
                    return Ok(Some(msg));
                }
                Ok(None) => {}
                Err(e) => {
                    let err = Error::with_source(
                        ErrorKind::Protocol,
                        format!("{}: received a bad frame", self.peer),
                        e,
                    );
                    return Err(self.fail(err));
                }
            }
            if !self.pull_chunk()? {
                break;
            }
        }
        self.flush()?;
        self.check_rx_end().map(|()| None)
    }

    /// Stream bytes for the authentication exchange: `Some(n)` bytes copied into `out`,
    /// `Some(0)` at the end of the stream, `None` when nothing has arrived yet.
    pub(crate) fn read_bytes(&mut self, out: &mut [u8]) -> Result<Option<usize>> {
        self.check_failed()?;
        if out.is_empty() {
            return Ok(Some(0));
        }
        if self.acc.is_empty() {
            self.pull_chunk()?;
        }
        if self.acc.is_empty() {
            self.flush()?;
            return match self.check_rx_end() {
                Ok(()) => Ok(None),
                Err(e) if e.kind() == ErrorKind::Closed => Ok(Some(0)),
                Err(e) => Err(e),
            };
        }
        let n = out.len().min(self.acc.len());
        out[..n].copy_from_slice(&self.acc[..n]);
        self.acc.advance(n);
        self.flush()?;
        Ok(Some(n))
    }

    /// Puts bytes read ahead (past the authentication exchange) back in front of the
    /// decode buffer.
    pub(crate) fn unread(&mut self, mut bytes: BytesMut) {
        bytes.extend_from_slice(&self.acc);
        self.acc = bytes;
    }

    /// With nothing left to decode: `Ok` while the peer may still send, else why not.
    fn check_rx_end(&self) -> Result<()> {
        if !self.ready.is_empty() {
            return Ok(());
        }
        let why = match (&self.peer_end, &self.gone) {
            (PeerEnd::Closed, _) => "peer closed the link".to_string(),
            (PeerEnd::Open, Some(why)) => why.clone(),
            (PeerEnd::Open, None) => return Ok(()),
        };
        let text = if self.acc.is_empty() {
            format!("{}: {why}", self.peer)
        } else {
            format!(
                "{}: {why} in the middle of a frame ({} bytes of it received)",
                self.peer,
                self.acc.len()
            )
        };
        Err(Error::new(ErrorKind::Closed, text))
    }

    // ----- for tests -----

    /// Credits this side holds now.
    #[cfg(test)]
    pub(crate) fn credits(&self) -> u32 {
        self.credits
    }

    /// Credits owed to the peer now.
    #[cfg(test)]
    pub(crate) fn owed(&self) -> u32 {
        self.owed
    }
}
