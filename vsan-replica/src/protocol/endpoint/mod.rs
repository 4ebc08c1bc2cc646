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
//!
//! ## Map: which file owns what
//! `Endpoint` (this file) is the coordinator: it holds one value of each sub-state,
//! dispatches messages from the peer (`handle_message`) and hands out the outputs.
//!
//! | file | owns | ordering rules and decisions that live there |
//! |---|---|---|
//! | `types.rs` | the public vocabulary: [`Config`], [`LocalIo`], [`Event`], [`LinkState`], ids | — |
//! | `journal.rs` | [`Journal`]: superblock, activity log, bitmap, metadata generations, waiters, generation ids | a change is durable only once its generation is; the activity log names an extent before a write there starts and forgets it only after a replica flush; bits a resync cleared are persisted only after a flush; the superblock is written last |
//! | `writes.rs` | the caller's writes and flushes (`OwnWrite`, `OwnFlush`) | a write completes once its local and remote halves are settled and, when it was not mirrored, its bits are durable; a flush alone moves the generation first |
//! | `apply.rs` | the apply list (`Apply`), peer writes, local completions | write-ordering rules 1–3 above; a resync read or write is ordered like any write; an entry starts only once its metadata gate is durable |
//! | `reads.rs` | read routing and held reads | a chunk not known current here (a sync target's unsynced chunk, a replica that lost data) is read from the peer, never from here |
//! | `handshake.rs` | [`Handshake`] (Hellos, Welcomes, the decision), [`OwnData`] | the Hello waits for unmirrored writes in flight; a handshake from degraded mode holds new writes; nothing may have moved between the Hello and Connected |
//! | `failure.rs` | [`Replica`] (attached, detached, detached alone), [`PeerCopy`], [`Quorum`] | a lost peer's waiting writes are marked and completed alone, held or failed as quorum says; a failure with no complete copy elsewhere fails I/O instead of distrusting the only copy |
//! | `freshness.rs` | whether the replica is proven current, and the startup policy | nothing is served from a replica before a handshake, the witness or the operator proves it current |
//! | `sync/` | a resync or online verify (`SyncRun`); `source.rs` and `target.rs` its two sides | a chunk's bit clears only after a checkpoint both sides made durable; a chunk marked again during the pass is not cleared; `SyncDone` only once the source's metadata no longer names it the only writer |
//! | `shutdown.rs` | [`Lifecycle`] | the clean state is written only after every request finished and the replica was flushed |
//! | `timers.rs` | when `handle_timeout` is due and what it does | — |
//!
//! The write path: `submit_write` (writes.rs) → `start_ready` / `start_own_write`
//! (apply.rs, writes.rs) → `LocalIo::Write` and `Message::Write` → `handle_local_done`
//! (apply.rs) and the peer's `WriteAck` (this file) → `finish_own_write` (writes.rs). The
//! resync: `start_sync` (sync/mod.rs) → `sync_pump` (sync/source.rs) → `on_sync_*`
//! (sync/target.rs, sync/source.rs) → `finish_sync`. The failure handling: `lose_peer`,
//! `local_failed`, `local_data_lost` (failure.rs), and `meta_done` for a failed metadata
//! write (journal.rs).

use std::collections::VecDeque;

use super::fastmap::FastMap;
use std::time::Instant;

use bytes::Bytes;
use tracing::warn;
use vsan_core::{ErrorKind, Geometry, Op};

use super::message::{Generations, Message, Status};
use crate::meta::Loaded;

mod apply;
mod failure;
mod freshness;
mod handshake;
mod journal;
mod reads;
mod scsi;
mod shutdown;
mod sync;
mod timers;
mod types;
mod writes;

use apply::{Apply, ApplyKind, OpPurpose, PeerWrite};
use failure::{Alone, PeerCopy, Quorum, Replica};
use handshake::{Handshake, OwnData};
use journal::{Journal, MetaWaiter};
use shutdown::Lifecycle;
pub use types::{
    Config, Event, LinkState, LocalIo, LocalOpId, LocalResult, QuorumPolicy, RequestId,
    ResyncConfig, ResyncRate,
};
use writes::{Local, OwnFlush, OwnWrite, Remote};

/// An operator's request refused in the endpoint's current state (the text says why).
fn refused(why: impl Into<String>) -> vsan_core::Error {
    vsan_core::Error::new(ErrorKind::WrongState, why)
}

use freshness::FreshnessState;
pub use freshness::{Awaiting, Freshness, Proof, StartupPolicy};

pub use sync::{SyncKind, SyncProgress, SyncRole, SyncSummary};

/// One node's protocol state for one mirrored disk.
///
/// The coordinator of the sub-states below; each is changed by the file named beside
/// it (see the module doc for the map).
#[derive(Debug, Clone)]
pub struct Endpoint {
    cfg: Config,

    // ----- the replica (journal.rs, failure.rs, freshness.rs, shutdown.rs) -----
    /// The metadata and its journal.
    journal: Journal,
    /// The disk's geometry for checking the peer's requests (no size limit: the peer's
    /// requests are as large as its callers'); `None` if the config's size and block
    /// size make none, and then every peer request is refused.
    peer_geometry: Option<Geometry>,
    /// Attached, detached, or detached with no complete copy anywhere.
    replica: Replica,
    /// Whether the replica is proven current.
    fresh: FreshnessState,
    /// What the next Hello says of this replica's data (the operator may give it up).
    own_data: OwnData,
    /// Local operations with ids below this were issued before the local replica last
    /// lost data (`local_data_lost`): their results are not trusted.
    loss_op_mark: u64,
    /// The metadata generation that records the replica as distrusted (0: never):
    /// writes that reach the peer only wait for it to be durable.
    distrust_mgen: u64,
    lifecycle: Lifecycle,
    created: Instant,

    // ----- the link and the peer (handshake.rs, failure.rs, timers.rs) -----
    state: LinkState,
    /// The handshake on the current link.
    handshake: Handshake,
    /// Whether the peer's replica is a complete copy, as this link has shown.
    peer_copy: PeerCopy,
    /// The witness's answer while the peer is away.
    quorum: Quorum,
    /// Counts links: bumped by every `handle_connected`.
    link_epoch: u64,
    /// What this link's handshake decided about this node's replica: the resync source
    /// or target (the replicas were apart), or `None` (in sync).
    link_role: Option<SyncRole>,
    /// The current link came up while this node, current, held its writes for quorum:
    /// when it came up. Writes held from before then fail if the handshake finds that
    /// the peer went on without this node (`fail_fenced_writes`).
    fence_from: Option<Instant>,
    last_rx: Instant,
    last_tx: Instant,
    next_ping: u64,

    // ----- resync and verify (sync/) -----
    sync: Option<sync::SyncRun>,
    last_sync: Option<SyncSummary>,

    // ----- the caller's requests (writes.rs, reads.rs) -----
    next_request: u64,
    own_writes: FastMap<RequestId, OwnWrite>,
    /// Own writes not started yet, in submission order.
    pending_own: VecDeque<RequestId>,
    /// Own writes started but not yet sent (the link is not up), in start order.
    unsent: VecDeque<RequestId>,
    own_flushes: FastMap<RequestId, OwnFlush>,
    /// Reads running on the local replica: (offset, len), kept to retry on the peer.
    local_reads: FastMap<RequestId, (u64, u32)>,
    /// Reads sent to the peer, with their lengths.
    remote_reads: FastMap<RequestId, u32>,
    /// SCSI calls sent to the peer on the current link (scsi.rs).
    scsi_calls: FastMap<RequestId, ()>,
    /// Reads waiting for quorum or for the peer, with when they were submitted.
    held_reads: VecDeque<(RequestId, u64, u32, Instant)>,
    last_app_io: Instant,

    // ----- local I/O in order (apply.rs) -----
    /// Peer writes being applied, by (link epoch, the peer's id).
    peer_writes: FastMap<(u64, u64), PeerWrite>,
    apply: VecDeque<Apply>,
    next_apply: u64,
    ops: FastMap<LocalOpId, OpPurpose>,
    next_op: u64,

    // ----- outputs -----
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
    /// An endpoint, not yet connected, over the replica metadata `loaded` (read by
    /// `meta::open` or made by `meta::create`).
    ///
    /// When the metadata says the node did not shut down cleanly, the extents of its
    /// activity log are marked out of sync (they may differ from the peer's). The first
    /// local operation the endpoint asks for marks the metadata "in use" (not clean);
    /// no replica write is issued before that is durable.
    pub fn new(cfg: Config, loaded: Loaded, now: Instant) -> Endpoint {
        let journal = Journal::open(loaded, &cfg.disk_name, cfg.seed);
        let bs = cfg.block_size.max(1);
        let peer_geometry = Geometry::with_max_io(cfg.size, bs, u32::MAX / bs * bs).ok();
        let mut ep = Endpoint {
            cfg,
            journal,
            peer_geometry,
            replica: Replica::Attached,
            fresh: FreshnessState::Unproven { timed_out: false },
            own_data: OwnData::Keep,
            loss_op_mark: 0,
            distrust_mgen: 0,
            lifecycle: Lifecycle::Running,
            created: now,
            state: LinkState::Waiting,
            handshake: Handshake::Idle,
            peer_copy: PeerCopy::Complete,
            quorum: Quorum::Idle,
            link_epoch: 0,
            link_role: None,
            fence_from: None,
            last_rx: now,
            last_tx: now,
            next_ping: 1,
            sync: None,
            last_sync: None,
            next_request: 1,
            own_writes: FastMap::default(),
            pending_own: VecDeque::new(),
            unsent: VecDeque::new(),
            own_flushes: FastMap::default(),
            local_reads: FastMap::default(),
            remote_reads: FastMap::default(),
            scsi_calls: FastMap::default(),
            held_reads: VecDeque::new(),
            last_app_io: now,
            peer_writes: FastMap::default(),
            apply: VecDeque::new(),
            next_apply: 1,
            ops: FastMap::default(),
            next_op: 1,
            transmit: VecDeque::new(),
            local_io: VecDeque::new(),
            events: VecDeque::new(),
        };
        ep.initial_freshness();
        ep
    }

    /// Check a peer's read or write against the disk's geometry (a request that fails
    /// it is a protocol violation).
    fn check_peer_request(&self, op: Op, offset: u64, len: u64) -> vsan_core::Result<()> {
        match &self.peer_geometry {
            Some(g) => g.validate(op, offset, len),
            None => Err(vsan_core::Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "the disk's size {} and block size {} make no geometry",
                    self.cfg.size, self.cfg.block_size
                ),
            )),
        }
    }

    /// The link state.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Whether the local replica is detached.
    pub fn is_detached(&self) -> bool {
        self.replica != Replica::Attached
    }

    /// Whether this replica's bitmap marks chunks out of sync with the peer (a resync
    /// is due, or running).
    pub fn is_diverged(&self) -> bool {
        self.journal.bitmap().count() > 0
    }

    /// Chunks this replica's bitmap marks out of sync.
    pub fn dirty_chunks(&self) -> u64 {
        self.journal.bitmap().count()
    }

    /// This replica's generation ids.
    pub fn generations(&self) -> Generations {
        self.journal.generations()
    }

    /// True while this replica is an unfinished sync target (its data is not usable
    /// alone).
    pub fn is_inconsistent(&self) -> bool {
        self.journal.is_inconsistent()
    }

    /// Whether this node decides overlapping concurrent writes.
    pub fn is_resolver(&self) -> bool {
        self.cfg.node_id < self.cfg.peer_id
    }

    /// Whether this node may serve I/O without its peer right now, as far as quorum
    /// goes (`None`: no witness configured).
    pub fn has_quorum(&self) -> Option<bool> {
        self.cfg.quorum.map(|_| self.quorum == Quorum::Granted)
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

    /// A message from the peer.
    pub fn handle_message(&mut self, now: Instant, msg: Message) {
        self.last_rx = now;
        match msg {
            Message::Hello(h) => self.evaluate_hello(now, h),
            Message::Welcome => self.handle_welcome(now),
            Message::ReplicaDetached => {
                warn!(
                    disk = %self.cfg.disk_name,
                    "node {}'s replica is detached: this replica is the only complete copy",
                    self.cfg.peer_id
                );
                self.peer_copy = PeerCopy::Incomplete;
            }
            Message::Refuse { reason } => {
                warn!(disk = %self.cfg.disk_name, "refused by the peer: {reason}");
                if self.state == LinkState::Connected {
                    // The peer gave up on this link after all (it saw our generations
                    // move): the link is lost, not merely refused.
                    self.lose_peer(now, format!("refused by the peer: {reason}"));
                } else {
                    self.events.push_back(Event::Refused { reason });
                    self.end_handshake(now);
                }
            }
            Message::Ping { id } => self.send(now, Message::Pong { id }),
            Message::Pong { .. } => {}
            other if self.state != LinkState::Connected => {
                self.protocol_violation(now, format!("{other:?} before the handshake finished"));
            }
            Message::Write {
                id,
                offset,
                payload,
                fua,
            } => self.peer_write(now, id, offset, payload, fua),
            Message::WriteAck { id, status } => {
                let req = RequestId(id);
                if status != Status::Ok {
                    self.peer_copy = PeerCopy::Incomplete;
                }
                match self.own_writes.get_mut(&req) {
                    Some(w) if matches!(w.remote, Remote::Sent(_)) => {
                        w.remote = Remote::Done(status);
                        self.finish_own_write(now, req);
                    }
                    _ => self.protocol_violation(now, format!("ack for unknown write {id}")),
                }
            }
            Message::Flush { id } => {
                let op = self.op_id(OpPurpose::PeerFlush(self.link_epoch, id));
                if self.is_detached() {
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
                if status != Status::Ok {
                    self.peer_copy = PeerCopy::Incomplete;
                }
                let req = RequestId(id);
                match self.own_flushes.get_mut(&req) {
                    Some(f) if matches!(f.remote, Remote::Sent(_)) => {
                        f.remote = Remote::Done(status);
                        self.finish_flush(req);
                    }
                    _ => self.protocol_violation(now, format!("ack for unknown flush {id}")),
                }
            }
            Message::Read { id, offset, len } => {
                if let Err(e) = self.check_peer_request(Op::Read, offset, u64::from(len)) {
                    return self.protocol_violation(now, format!("read {id} is invalid: {e}"));
                }
                // A replica that is out of sync there (a sync target whose chunk has not
                // arrived, or one that lost data) must not answer with what it has.
                if self.is_detached() || self.stale(offset, u64::from(len)) {
                    self.send(
                        now,
                        Message::ReadReply {
                            id,
                            status: Status::Failed(ErrorKind::Io as u32),
                            data: Bytes::new(),
                        },
                    );
                } else {
                    let op = self.op_id(OpPurpose::PeerRead(self.link_epoch, id));
                    self.local_io.push_back(LocalIo::Read {
                        op,
                        offset,
                        len,
                        once: false,
                    });
                }
            }
            Message::ReadReply { id, status, data } => {
                let req = RequestId(id);
                let Some(want) = self.remote_reads.remove(&req) else {
                    return self.protocol_violation(now, format!("reply for unknown read {id}"));
                };
                let result = match status {
                    Status::Ok if data.len() == want as usize => Ok(Some(data)),
                    Status::Ok => {
                        self.protocol_violation(
                            now,
                            format!("reply for read {id}: {} bytes, {want} asked", data.len()),
                        );
                        Err(ErrorKind::Io)
                    }
                    Status::Failed(_) => Err(ErrorKind::Io),
                };
                self.events.push_back(Event::Completed {
                    request: req,
                    result,
                });
            }
            Message::Scsi { id, body } => self.peer_scsi(id, body),
            Message::ScsiReply { id, status, body } => self.peer_scsi_reply(now, id, status, body),
            m @ (Message::SyncBitmap { .. }
            | Message::SyncData { .. }
            | Message::SyncAck { .. }
            | Message::SyncCrc { .. }
            | Message::SyncCrcReply { .. }
            | Message::SyncCheckpoint { .. }
            | Message::SyncCheckpointAck { .. }
            | Message::SyncDone { .. }
            | Message::SyncRequest) => self.sync_message(now, m),
            Message::LaneSeq { .. } | Message::LaneJoin { .. } => {
                self.protocol_violation(now, "a lane frame reached the protocol".into())
            }
        }
    }

    fn protocol_violation(&mut self, now: Instant, what: String) {
        warn!(disk = %self.cfg.disk_name, "peer broke the protocol: {what}");
        if self.state == LinkState::Connected {
            self.lose_peer(now, format!("protocol violation: {what}"));
        } else {
            self.events.push_back(Event::Refused {
                reason: format!("protocol violation: {what}"),
            });
            self.end_handshake(now);
        }
    }

    /// The next message for the peer.
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmit.pop_front()
    }

    /// The next operation to run on the local replica.
    pub fn poll_local_io(&mut self) -> Option<LocalIo> {
        if self.local_io.is_empty() {
            self.issue_meta();
        }
        self.local_io.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }
}
