//! `Endpoint`: one node's half of the mirror protocol for one disk, as a state machine.
//!
//! Inputs are `handle_*` and `submit_*` calls, each given `now`; outputs are drained with
//! `poll_transmit` (messages for the peer), `poll_local_io` (operations the driver must run
//! on the local replica and report back with `handle_local_done`), `poll_event`
//! (completions and state changes) and `poll_timeout` (when to call `handle_timeout`).
//!
//! ## Write ordering (why both replicas end identical)
//! 1. Every node applies overlapping writes to its own replica one after another, in the
//!    order it *starts* them (the apply list). A node's own write starts — local write
//!    and send at the same moment — only when no earlier started write overlaps it is
//!    still being applied locally. Because the link is FIFO, the peer receives writes in
//!    the order they started and applies them in that order too.
//! 2. An own write that overlaps a peer write not yet applied waits for it; the ack for
//!    the peer write is queued before the own write is sent, so the peer sees its write
//!    completed before ours arrives and orders them the same way.
//! 3. The remaining conflict is true concurrency: each side sent an overlapping write
//!    before it saw the other's. The resolver (the lower node id) decides: its own write
//!    wins on both sides. On the resolver, the peer's write is applied only outside the
//!    ranges of its own writes still awaiting an ack; on the other node the resolver's
//!    write is applied after its own overlapping write finished locally.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{info, warn};
use vsan_core::ErrorKind;

use super::message::{DiskId, Hello, Message, PROTOCOL_VERSION, Status, WritePayload};
use super::ranges::{Range, any_overlap, subtract};

/// Static settings of an endpoint.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's id.
    pub node_id: u32,
    /// The mirror partner's id.
    pub peer_id: u32,
    /// The replicated disk.
    pub disk_id: DiskId,
    /// The disk's name, for messages.
    pub disk_name: String,
    /// Disk size in bytes.
    pub size: u64,
    /// Logical block size.
    pub block_size: u32,
    /// No message from the peer (or no ack for a request) for this long means it is lost.
    pub peer_timeout: Duration,
    /// How often to ping an idle link.
    pub ping_interval: Duration,
    /// How long writes wait for a first connection before completing on this node alone.
    pub connect_timeout: Duration,
}

impl Config {
    /// A config with the default timeouts (peer 5 s, ping 1 s, first connection 5 s).
    pub fn new(
        node_id: u32,
        peer_id: u32,
        disk_id: DiskId,
        disk_name: &str,
        size: u64,
        block_size: u32,
    ) -> Config {
        Config {
            node_id,
            peer_id,
            disk_id,
            disk_name: disk_name.to_string(),
            size,
            block_size,
            peer_timeout: Duration::from_secs(5),
            ping_interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// A caller's request (write, flush, read), echoed in its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A local replica operation the driver runs and reports back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalOpId(pub u64);

/// I/O the driver must perform on the local replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalIo {
    /// Write (data, zeroes or discard) at `offset`.
    Write {
        /// Report back with this id.
        op: LocalOpId,
        /// Byte offset.
        offset: u64,
        /// What to write.
        payload: WritePayload,
        /// With FUA.
        fua: bool,
    },
    /// Flush the local replica.
    Flush {
        /// Report back with this id.
        op: LocalOpId,
    },
    /// Read from the local replica.
    Read {
        /// Report back with this id.
        op: LocalOpId,
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
    },
}

/// The outcome of a local operation, reported by the driver.
pub type LocalResult = Result<Option<Bytes>, ErrorKind>;

/// Where the link to the peer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    /// No link yet, never connected.
    Waiting,
    /// Link up, Hellos being exchanged.
    Handshaking,
    /// Mirroring.
    Connected,
    /// The peer was lost (or never came); writes complete on this node alone.
    Degraded,
}

/// Something the caller or operator should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request finished. Reads carry their data.
    Completed {
        /// Which request.
        request: RequestId,
        /// Outcome.
        result: Result<Option<Bytes>, ErrorKind>,
    },
    /// The handshake succeeded; writes are mirrored from now on.
    Connected,
    /// The handshake failed; the driver must close the link. `reason` is shown on both
    /// nodes.
    Refused {
        /// Why.
        reason: String,
    },
    /// The peer is gone; the driver must close the link. I/O continues on this node.
    PeerLost {
        /// Why.
        reason: String,
    },
    /// The local replica failed and is detached; I/O is served through the peer.
    LocalDetached {
        /// The failure.
        reason: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Remote {
    /// Not sent yet (waiting for the link).
    Unsent,
    /// Sent at this time, no ack yet.
    Sent(Instant),
    /// Answered by the peer.
    Done(Status),
    /// Not mirrored (degraded).
    Skipped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Local {
    Pending,
    Running,
    Done(Result<(), ErrorKind>),
}

#[derive(Debug, Clone)]
struct OwnWrite {
    offset: u64,
    payload: WritePayload,
    fua: bool,
    submitted: Instant,
    started: bool,
    local: Local,
    remote: Remote,
}

#[derive(Debug, Clone)]
struct OwnFlush {
    local: Local,
    remote: Remote,
}

/// An entry in the apply list: a write being applied to the local replica.
#[derive(Debug, Clone)]
struct Apply {
    source: Source,
    ranges: Vec<Range>,
    started: bool,
    running_ops: usize,
    failed: Option<ErrorKind>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Own(RequestId),
    /// A peer write, by the peer's message id.
    Peer(u64),
}

#[derive(Debug, Clone)]
struct PeerWrite {
    offset: u64,
    payload: WritePayload,
    fua: bool,
}

#[derive(Debug, Clone, Copy)]
enum OpPurpose {
    Apply(Source),
    OwnFlush(RequestId),
    PeerFlush(u64),
    OwnRead(RequestId),
    PeerRead(u64),
}

/// One node's protocol state for one mirrored disk.
#[derive(Debug, Clone)]
pub struct Endpoint {
    cfg: Config,
    state: LinkState,
    created: Instant,
    /// We validated the peer's Hello and sent Welcome.
    sent_welcome: bool,
    /// We received the peer's Welcome.
    got_welcome: bool,
    /// A link is attached and its handshake has not finished (in any state: a degraded
    /// node handshakes too, to learn it must refuse).
    handshaking: bool,
    /// Data diverged from the peer's (a write completed without it).
    diverged: bool,
    /// The local replica failed.
    detached: bool,
    last_rx: Instant,
    last_tx: Instant,
    next_request: u64,
    next_op: u64,
    next_ping: u64,
    own_writes: HashMap<RequestId, OwnWrite>,
    /// Own writes not started yet, in submission order.
    pending_own: VecDeque<RequestId>,
    /// Own writes started but not yet sent (the link is not up), in start order.
    unsent: VecDeque<RequestId>,
    own_flushes: HashMap<RequestId, OwnFlush>,
    /// Reads running on the local replica: (offset, len), kept to retry on the peer.
    local_reads: HashMap<RequestId, (u64, u32)>,
    /// Reads sent to the peer.
    remote_reads: HashSet<RequestId>,
    peer_writes: HashMap<u64, PeerWrite>,
    apply: Vec<Apply>,
    ops: HashMap<LocalOpId, OpPurpose>,
    transmit: VecDeque<Message>,
    local_io: VecDeque<LocalIo>,
    events: VecDeque<Event>,
}

fn status_of(r: Result<(), ErrorKind>) -> Status {
    match r {
        Ok(()) => Status::Ok,
        Err(k) => Status::Failed(k as u32),
    }
}

impl Endpoint {
    /// A fresh endpoint, not yet connected.
    pub fn new(cfg: Config, now: Instant) -> Endpoint {
        Endpoint {
            cfg,
            state: LinkState::Waiting,
            created: now,
            sent_welcome: false,
            got_welcome: false,
            handshaking: false,
            diverged: false,
            detached: false,
            last_rx: now,
            last_tx: now,
            next_request: 1,
            next_op: 1,
            next_ping: 1,
            own_writes: HashMap::new(),
            pending_own: VecDeque::new(),
            unsent: VecDeque::new(),
            own_flushes: HashMap::new(),
            local_reads: HashMap::new(),
            remote_reads: HashSet::new(),
            peer_writes: HashMap::new(),
            apply: Vec::new(),
            ops: HashMap::new(),
            transmit: VecDeque::new(),
            local_io: VecDeque::new(),
            events: VecDeque::new(),
        }
    }

    /// The link state.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Whether the local replica is detached.
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// Whether this replica has writes the peer lacks (a resync is required).
    pub fn is_diverged(&self) -> bool {
        self.diverged
    }

    /// Whether this node decides overlapping concurrent writes.
    pub fn is_resolver(&self) -> bool {
        self.cfg.node_id < self.cfg.peer_id
    }

    fn request_id(&mut self) -> RequestId {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        id
    }

    fn op_id(&mut self, purpose: OpPurpose) -> LocalOpId {
        let id = LocalOpId(self.next_op);
        self.next_op += 1;
        self.ops.insert(id, purpose);
        id
    }

    fn send(&mut self, now: Instant, msg: Message) {
        self.last_tx = now;
        self.transmit.push_back(msg);
    }

    // ----- link -----

    /// A link to the peer is up: start the handshake.
    pub fn handle_connected(&mut self, now: Instant) {
        self.sent_welcome = false;
        self.got_welcome = false;
        self.handshaking = true;
        self.last_rx = now;
        self.transmit.clear();
        if self.state != LinkState::Degraded {
            self.state = LinkState::Handshaking;
        }
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: self.cfg.node_id,
            peer_id: self.cfg.peer_id,
            disk_id: self.cfg.disk_id,
            disk_name: self.cfg.disk_name.clone(),
            size: self.cfg.size,
            block_size: self.cfg.block_size,
            needs_resync: self.diverged || self.state == LinkState::Degraded,
        };
        self.send(now, Message::Hello(hello));
    }

    /// The link is gone (reset, closed, or closed by the driver after an event).
    pub fn handle_disconnected(&mut self, _now: Instant, reason: &str) {
        self.handshaking = false;
        match self.state {
            LinkState::Connected => self.lose_peer(format!("link lost: {reason}")),
            LinkState::Handshaking => {
                self.state = LinkState::Waiting;
                // A link that never finished its handshake changes nothing else.
            }
            LinkState::Waiting | LinkState::Degraded => {}
        }
        self.transmit.clear();
    }

    fn refuse(&mut self, now: Instant, reason: String) {
        warn!(disk = %self.cfg.disk_name, "refusing the peer: {reason}");
        self.send(
            now,
            Message::Refuse {
                reason: reason.clone(),
            },
        );
        self.events.push_back(Event::Refused { reason });
        self.end_handshake();
    }

    /// The handshake on the current link failed: the driver drops the link.
    fn end_handshake(&mut self) {
        self.handshaking = false;
        if self.state == LinkState::Handshaking {
            self.state = LinkState::Waiting;
        }
    }

    fn check_hello(&self, h: &Hello) -> Result<(), String> {
        let me = &self.cfg;
        if h.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "protocol version mismatch: node {} speaks {}, node {} speaks {}",
                me.node_id, PROTOCOL_VERSION, h.node_id, h.protocol_version
            ));
        }
        if h.node_id != me.peer_id || h.peer_id != me.node_id {
            return Err(format!(
                "node id mismatch: node {} expects peer {}, but the peer is node {} expecting {}",
                me.node_id, me.peer_id, h.node_id, h.peer_id
            ));
        }
        if h.disk_id != me.disk_id {
            return Err(format!(
                "disk id mismatch for disk {:?}: {} here, {} on node {}",
                me.disk_name, me.disk_id, h.disk_id, h.node_id
            ));
        }
        if h.size != me.size {
            return Err(format!(
                "disk size mismatch for disk {:?}: {} bytes here, {} bytes on node {}",
                me.disk_name, me.size, h.size, h.node_id
            ));
        }
        if h.block_size != me.block_size {
            return Err(format!(
                "block size mismatch for disk {:?}: {} here, {} on node {}",
                me.disk_name, me.block_size, h.block_size, h.node_id
            ));
        }
        if self.diverged || self.state == LinkState::Degraded {
            return Err(format!(
                "resync required: node {} went on with disk {:?} without its peer",
                me.node_id, me.disk_name
            ));
        }
        if h.needs_resync {
            return Err(format!(
                "resync required: node {} went on with disk {:?} without its peer",
                h.node_id, me.disk_name
            ));
        }
        Ok(())
    }

    /// A message from the peer.
    pub fn handle_message(&mut self, now: Instant, msg: Message) {
        self.last_rx = now;
        match msg {
            Message::Hello(h) => match self.check_hello(&h) {
                Ok(()) => {
                    self.sent_welcome = true;
                    self.send(now, Message::Welcome);
                    self.maybe_connected(now);
                }
                Err(reason) => self.refuse(now, reason),
            },
            Message::Welcome => {
                self.got_welcome = true;
                self.maybe_connected(now);
            }
            Message::Refuse { reason } => {
                warn!(disk = %self.cfg.disk_name, "refused by the peer: {reason}");
                self.events.push_back(Event::Refused { reason });
                self.end_handshake();
            }
            Message::Ping { id } => self.send(now, Message::Pong { id }),
            Message::Pong { .. } => {}
            other if self.state != LinkState::Connected => {
                self.protocol_violation(format!("{other:?} before the handshake finished"));
            }
            Message::Write {
                id,
                offset,
                payload,
                fua,
            } => self.peer_write(now, id, offset, payload, fua),
            Message::WriteAck { id, status } => {
                let req = RequestId(id);
                match self.own_writes.get_mut(&req) {
                    Some(w) if matches!(w.remote, Remote::Sent(_)) => {
                        w.remote = Remote::Done(status);
                        self.finish_own_write(req);
                    }
                    _ => self.protocol_violation(format!("ack for unknown write {id}")),
                }
            }
            Message::Flush { id } => {
                let op = self.op_id(OpPurpose::PeerFlush(id));
                if self.detached {
                    self.ops.remove(&op);
                    self.send(
                        now,
                        Message::FlushAck {
                            id,
                            status: Status::Failed(ErrorKind::Io as u32),
                        },
                    );
                } else {
                    self.local_io.push_back(LocalIo::Flush { op });
                }
            }
            Message::FlushAck { id, status } => {
                let req = RequestId(id);
                match self.own_flushes.get_mut(&req) {
                    Some(f) if matches!(f.remote, Remote::Sent(_)) => {
                        f.remote = Remote::Done(status);
                        self.finish_flush(req);
                    }
                    _ => self.protocol_violation(format!("ack for unknown flush {id}")),
                }
            }
            Message::Read { id, offset, len } => {
                if self.detached {
                    self.send(
                        now,
                        Message::ReadReply {
                            id,
                            status: Status::Failed(ErrorKind::Io as u32),
                            data: Bytes::new(),
                        },
                    );
                } else {
                    let op = self.op_id(OpPurpose::PeerRead(id));
                    self.local_io.push_back(LocalIo::Read { op, offset, len });
                }
            }
            Message::ReadReply { id, status, data } => {
                let req = RequestId(id);
                if !self.remote_reads.remove(&req) {
                    return self.protocol_violation(format!("reply for unknown read {id}"));
                }
                let result = match status {
                    Status::Ok => Ok(Some(data)),
                    Status::Failed(_) => Err(ErrorKind::Io),
                };
                self.events.push_back(Event::Completed {
                    request: req,
                    result,
                });
            }
        }
    }

    fn protocol_violation(&mut self, what: String) {
        warn!(disk = %self.cfg.disk_name, "peer broke the protocol: {what}");
        if self.state == LinkState::Connected {
            self.lose_peer(format!("protocol violation: {what}"));
        } else {
            self.events.push_back(Event::Refused {
                reason: format!("protocol violation: {what}"),
            });
            self.end_handshake();
        }
    }

    fn maybe_connected(&mut self, now: Instant) {
        if !(self.sent_welcome && self.got_welcome) || self.state == LinkState::Connected {
            return;
        }
        self.state = LinkState::Connected;
        self.handshaking = false;
        info!(disk = %self.cfg.disk_name, peer = self.cfg.peer_id, "peer connected: mirroring");
        self.events.push_back(Event::Connected);
        // Writes started while waiting for the first connection go out now, in order.
        while let Some(req) = self.unsent.pop_front() {
            self.send_own_write(now, req);
        }
    }

    fn lose_peer(&mut self, reason: String) {
        warn!(disk = %self.cfg.disk_name, peer = self.cfg.peer_id, "peer lost: {reason}; continuing degraded");
        self.state = LinkState::Degraded;
        self.events.push_back(Event::PeerLost { reason });
        self.transmit.clear();
        // Everything waiting on the peer completes without it.
        let waiting: Vec<RequestId> = self
            .own_writes
            .iter()
            .filter(|(_, w)| w.started && matches!(w.remote, Remote::Sent(_) | Remote::Unsent))
            .map(|(r, _)| *r)
            .collect();
        self.unsent.clear();
        for req in waiting {
            if let Some(w) = self.own_writes.get_mut(&req) {
                w.remote = Remote::Skipped;
            }
            self.finish_own_write(req);
        }
        let flushes: Vec<RequestId> = self
            .own_flushes
            .iter()
            .filter(|(_, f)| matches!(f.remote, Remote::Sent(_)))
            .map(|(r, _)| *r)
            .collect();
        for req in flushes {
            if let Some(f) = self.own_flushes.get_mut(&req) {
                f.remote = Remote::Skipped;
            }
            self.finish_flush(req);
        }
        for req in self.remote_reads.drain() {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
        }
    }

    // ----- caller requests -----

    /// Write `payload` at `offset` (validated by the caller against the geometry).
    pub fn submit_write(
        &mut self,
        now: Instant,
        offset: u64,
        payload: WritePayload,
        fua: bool,
    ) -> RequestId {
        let req = self.request_id();
        self.own_writes.insert(
            req,
            OwnWrite {
                offset,
                payload,
                fua,
                submitted: now,
                started: false,
                local: Local::Pending,
                remote: Remote::Unsent,
            },
        );
        self.pending_own.push_back(req);
        self.start_ready(now);
        req
    }

    /// Flush both replicas: completes when every write completed before it is durable on
    /// both nodes.
    pub fn submit_flush(&mut self, now: Instant) -> RequestId {
        let req = self.request_id();
        let local = if self.detached {
            Local::Done(Ok(()))
        } else {
            let op = self.op_id(OpPurpose::OwnFlush(req));
            self.local_io.push_back(LocalIo::Flush { op });
            Local::Running
        };
        let remote = if self.state == LinkState::Connected {
            self.send(now, Message::Flush { id: req.0 });
            Remote::Sent(now)
        } else {
            Remote::Skipped
        };
        self.own_flushes.insert(req, OwnFlush { local, remote });
        self.finish_flush(req);
        req
    }

    /// Read from the local replica, or from the peer while the local one is detached.
    pub fn submit_read(&mut self, now: Instant, offset: u64, len: u32) -> RequestId {
        let req = self.request_id();
        if !self.detached {
            let op = self.op_id(OpPurpose::OwnRead(req));
            self.local_reads.insert(req, (offset, len));
            self.local_io.push_back(LocalIo::Read { op, offset, len });
        } else {
            self.read_from_peer(now, req, offset, len);
        }
        req
    }

    fn read_from_peer(&mut self, now: Instant, req: RequestId, offset: u64, len: u32) {
        if self.state == LinkState::Connected {
            self.remote_reads.insert(req);
            self.send(
                now,
                Message::Read {
                    id: req.0,
                    offset,
                    len,
                },
            );
        } else {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
        }
    }

    // ----- ordering -----

    fn overlaps_running_apply(&self, ranges: &[Range], before: usize) -> bool {
        self.apply[..before]
            .iter()
            .any(|a| any_overlap(&a.ranges, ranges))
    }

    /// Start every waiting apply entry and own write that no earlier write blocks.
    fn start_ready(&mut self, now: Instant) {
        // Peer writes waiting in the apply list.
        let mut i = 0;
        while i < self.apply.len() {
            if !self.apply[i].started
                && !self.overlaps_running_apply(&self.apply[i].ranges.clone(), i)
            {
                self.start_apply(i);
            }
            i += 1;
        }
        // Own writes, in submission order; one blocked write blocks later overlapping ones.
        let mut blocked: Vec<Range> = Vec::new();
        let mut idx = 0;
        while idx < self.pending_own.len() {
            let req = self.pending_own[idx];
            let Some(w) = self.own_writes.get(&req) else {
                self.pending_own.remove(idx);
                continue;
            };
            let r = [Range::new(w.offset, w.payload.len())];
            if any_overlap(&blocked, &r) || self.overlaps_running_apply(&r, self.apply.len()) {
                blocked.push(r[0]);
                idx += 1;
                continue;
            }
            self.pending_own.remove(idx);
            self.start_own_write(now, req);
        }
    }

    fn start_own_write(&mut self, now: Instant, req: RequestId) {
        let Some(w) = self.own_writes.get_mut(&req) else {
            return;
        };
        w.started = true;
        let range = Range::new(w.offset, w.payload.len());
        if self.detached {
            w.local = Local::Done(Ok(()));
        } else {
            self.apply.push(Apply {
                source: Source::Own(req),
                ranges: vec![range],
                started: false,
                running_ops: 0,
                failed: None,
            });
            let at = self.apply.len() - 1;
            self.start_apply(at);
        }
        match self.state {
            LinkState::Connected => self.send_own_write(now, req),
            LinkState::Waiting | LinkState::Handshaking => self.unsent.push_back(req),
            LinkState::Degraded => {
                if let Some(w) = self.own_writes.get_mut(&req) {
                    w.remote = Remote::Skipped;
                }
            }
        }
        self.finish_own_write(req);
    }

    fn send_own_write(&mut self, now: Instant, req: RequestId) {
        let Some(w) = self.own_writes.get_mut(&req) else {
            return;
        };
        w.remote = Remote::Sent(now);
        let msg = Message::Write {
            id: req.0,
            offset: w.offset,
            payload: w.payload.clone(),
            fua: w.fua,
        };
        self.send(now, msg);
    }

    /// Issue the local writes of apply entry `i`.
    fn start_apply(&mut self, i: usize) {
        let source = self.apply[i].source;
        let (offset, payload, fua) = match source {
            Source::Own(req) => match self.own_writes.get_mut(&req) {
                Some(w) => {
                    w.local = Local::Running;
                    (w.offset, w.payload.clone(), w.fua)
                }
                None => return,
            },
            Source::Peer(id) => match self.peer_writes.get(&id) {
                Some(p) => (p.offset, p.payload.clone(), p.fua),
                None => return,
            },
        };
        let pieces = self.apply[i].ranges.clone();
        self.apply[i].started = true;
        self.apply[i].running_ops = pieces.len();
        for piece in pieces {
            let sub = slice_payload(&payload, offset, piece);
            let op = self.op_id(OpPurpose::Apply(source));
            self.local_io.push_back(LocalIo::Write {
                op,
                offset: piece.start,
                payload: sub,
                fua,
            });
        }
    }

    fn peer_write(&mut self, now: Instant, id: u64, offset: u64, payload: WritePayload, fua: bool) {
        let range = Range::new(offset, payload.len());
        if payload.is_empty() || range.end > self.cfg.size {
            return self.protocol_violation(format!(
                "write {id} of {} bytes at {offset} is invalid",
                payload.len()
            ));
        }
        if self.detached {
            self.send(
                now,
                Message::WriteAck {
                    id,
                    status: Status::Failed(ErrorKind::Io as u32),
                },
            );
            return;
        }
        // Rule 3: on the resolver, the peer's write loses wherever an own write is still
        // awaiting its ack.
        let ranges = if self.is_resolver() {
            let mask: Vec<Range> = self
                .own_writes
                .values()
                .filter(|w| matches!(w.remote, Remote::Sent(_)))
                .map(|w| Range::new(w.offset, w.payload.len()))
                .collect();
            subtract(range, &mask)
        } else {
            vec![range]
        };
        if ranges.is_empty() {
            self.send(
                now,
                Message::WriteAck {
                    id,
                    status: Status::Ok,
                },
            );
            return;
        }
        self.peer_writes.insert(
            id,
            PeerWrite {
                offset,
                payload,
                fua,
            },
        );
        self.apply.push(Apply {
            source: Source::Peer(id),
            ranges,
            started: false,
            running_ops: 0,
            failed: None,
        });
        self.start_ready(now);
    }

    // ----- local completions -----

    /// The driver finished local operation `op`.
    pub fn handle_local_done(&mut self, now: Instant, op: LocalOpId, result: LocalResult) {
        let Some(purpose) = self.ops.remove(&op) else {
            return;
        };
        if let Err(kind) = &result {
            self.local_failed(*kind);
        }
        match purpose {
            OpPurpose::Apply(source) => {
                let Some(i) = self.apply.iter().position(|a| a.source == source) else {
                    return;
                };
                let entry = &mut self.apply[i];
                entry.running_ops = entry.running_ops.saturating_sub(1);
                if let Err(k) = result {
                    entry.failed = Some(k);
                }
                if entry.running_ops > 0 {
                    return;
                }
                let entry = self.apply.remove(i);
                let outcome = entry.failed.map_or(Ok(()), Err);
                match source {
                    Source::Own(req) => {
                        if let Some(w) = self.own_writes.get_mut(&req) {
                            w.local = Local::Done(outcome);
                        }
                        self.finish_own_write(req);
                    }
                    Source::Peer(id) => {
                        self.peer_writes.remove(&id);
                        if self.state == LinkState::Connected {
                            self.send(
                                now,
                                Message::WriteAck {
                                    id,
                                    status: status_of(outcome),
                                },
                            );
                        }
                    }
                }
                self.start_ready(now);
            }
            OpPurpose::OwnFlush(req) => {
                if let Some(f) = self.own_flushes.get_mut(&req) {
                    f.local = Local::Done(result.map(drop));
                }
                self.finish_flush(req);
            }
            OpPurpose::PeerFlush(id) => {
                if self.state == LinkState::Connected {
                    self.send(
                        now,
                        Message::FlushAck {
                            id,
                            status: status_of(result.map(drop)),
                        },
                    );
                }
            }
            OpPurpose::OwnRead(req) => {
                let Some((offset, len)) = self.local_reads.remove(&req) else {
                    return;
                };
                match result {
                    Ok(data) => self.events.push_back(Event::Completed {
                        request: req,
                        result: Ok(data),
                    }),
                    // The local replica is detached now: the peer serves the read and the
                    // caller sees no error.
                    Err(_) => self.read_from_peer(now, req, offset, len),
                }
            }
            OpPurpose::PeerRead(id) => {
                if self.state == LinkState::Connected {
                    let (status, data) = match result {
                        Ok(d) => (Status::Ok, d.unwrap_or_default()),
                        Err(k) => (Status::Failed(k as u32), Bytes::new()),
                    };
                    self.send(now, Message::ReadReply { id, status, data });
                }
            }
        }
    }

    fn local_failed(&mut self, kind: ErrorKind) {
        if self.detached {
            return;
        }
        self.detached = true;
        let reason = format!("local replica failed ({kind}); serving I/O through the peer");
        warn!(disk = %self.cfg.disk_name, "{reason}");
        self.events.push_back(Event::LocalDetached { reason });
    }

    fn finish_own_write(&mut self, req: RequestId) {
        let Some((local, remote)) = self
            .own_writes
            .get(&req)
            .and_then(|w| settled(w.local, w.remote))
        else {
            return;
        };
        let result = match (local, remote) {
            (Ok(()), Some(Status::Ok)) => Ok(()),
            // One good copy: the write is done, the replicas differ until a resync.
            (Ok(()), _) => {
                self.diverged = true;
                Ok(())
            }
            (Err(_), Some(Status::Ok)) => {
                // Local replica detached; the peer holds the data.
                Ok(())
            }
            (Err(k), _) => Err(k),
        };
        self.own_writes.remove(&req);
        self.events.push_back(Event::Completed {
            request: req,
            result: result.map(|()| None),
        });
    }

    fn finish_flush(&mut self, req: RequestId) {
        let Some((local, remote)) = self
            .own_flushes
            .get(&req)
            .and_then(|f| settled(f.local, f.remote))
        else {
            return;
        };
        let result = match (local, remote) {
            (Ok(()), _) => Ok(None),
            (Err(_), Some(Status::Ok)) => Ok(None),
            (Err(k), _) => Err(k),
        };
        self.own_flushes.remove(&req);
        self.events.push_back(Event::Completed {
            request: req,
            result,
        });
    }

    // ----- time -----

    /// When `handle_timeout` must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| t = Some(t.map_or(x, |y| y.min(x)));
        if self.handshaking {
            at(self.last_rx + self.cfg.peer_timeout);
        }
        match self.state {
            LinkState::Connected => {
                at(self.last_rx + self.cfg.peer_timeout);
                at(self.last_tx + self.cfg.ping_interval);
                if let Some(oldest) = self.oldest_unacked() {
                    at(oldest + self.cfg.peer_timeout);
                }
            }
            LinkState::Handshaking => {}
            LinkState::Waiting => {
                if let Some(first) = self
                    .unsent
                    .iter()
                    .filter_map(|r| self.own_writes.get(r))
                    .map(|w| w.submitted)
                    .min()
                {
                    at(first.max(self.created) + self.cfg.connect_timeout);
                }
            }
            LinkState::Degraded => {}
        }
        t
    }

    fn oldest_unacked(&self) -> Option<Instant> {
        let writes = self.own_writes.values().filter_map(|w| match w.remote {
            Remote::Sent(t) => Some(t),
            _ => None,
        });
        let flushes = self.own_flushes.values().filter_map(|f| match f.remote {
            Remote::Sent(t) => Some(t),
            _ => None,
        });
        writes.chain(flushes).min()
    }

    /// Time has reached (or passed) what `poll_timeout` asked for.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.handshaking && now >= self.last_rx + self.cfg.peer_timeout {
            self.end_handshake();
            self.events.push_back(Event::Refused {
                reason: "handshake timed out".into(),
            });
        }
        match self.state {
            LinkState::Connected => {
                if now >= self.last_rx + self.cfg.peer_timeout {
                    let t = self.cfg.peer_timeout;
                    return self.lose_peer(format!("no message from the peer for {t:?}"));
                }
                if let Some(oldest) = self.oldest_unacked()
                    && now >= oldest + self.cfg.peer_timeout
                {
                    let t = self.cfg.peer_timeout;
                    return self.lose_peer(format!("no answer from the peer for {t:?}"));
                }
                if now >= self.last_tx + self.cfg.ping_interval {
                    let id = self.next_ping;
                    self.next_ping += 1;
                    self.send(now, Message::Ping { id });
                }
            }
            LinkState::Handshaking => {}
            LinkState::Waiting => {
                let due = self
                    .unsent
                    .iter()
                    .filter_map(|r| self.own_writes.get(r))
                    .any(|w| now >= w.submitted.max(self.created) + self.cfg.connect_timeout);
                if due {
                    let t = self.cfg.connect_timeout;
                    self.lose_peer(format!("the peer did not connect within {t:?}"));
                }
            }
            LinkState::Degraded => {}
        }
    }

    // ----- outputs -----

    /// The next message for the peer.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmit.pop_front()
    }

    /// The next operation to run on the local replica.
    pub fn poll_local_io(&mut self) -> Option<LocalIo> {
        self.local_io.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}

/// Both halves of a request are settled: the local outcome, and the peer's status
/// (`None` when the request was not mirrored).
fn settled(local: Local, remote: Remote) -> Option<(Result<(), ErrorKind>, Option<Status>)> {
    let Local::Done(local) = local else {
        return None;
    };
    match remote {
        Remote::Done(s) => Some((local, Some(s))),
        Remote::Skipped => Some((local, None)),
        Remote::Unsent | Remote::Sent(_) => None,
    }
}

/// The part of a write's payload that covers `piece`.
fn slice_payload(payload: &WritePayload, offset: u64, piece: Range) -> WritePayload {
    match payload {
        WritePayload::Data(d) => {
            let from = (piece.start - offset) as usize;
            WritePayload::Data(d.slice(from..from + piece.len() as usize))
        }
        WritePayload::Zeroes { .. } => WritePayload::Zeroes { len: piece.len() },
        WritePayload::Discard { .. } => WritePayload::Discard { len: piece.len() },
    }
}
