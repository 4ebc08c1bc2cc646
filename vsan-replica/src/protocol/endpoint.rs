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

use std::collections::{BTreeSet, HashMap, VecDeque};

use super::fastmap::FastMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{info, warn};
use vsan_core::ErrorKind;

use super::generations::{Decision, Side, decide};
use super::message::{
    DiskId, Generations, Hello, Message, PROTOCOL_VERSION, SplitBrainPolicy, Status, WritePayload,
};
use super::ranges::{Range, any_overlap, subtract};
use crate::meta::{AL_EXTENT_SIZE, AL_SLOTS, Bitmap, Layout, Loaded, Superblock, encode_al};

mod freshness;
mod sync;

/// An operator's request refused in the endpoint's current state (the text says why).
fn refused(why: impl Into<String>) -> vsan_core::Error {
    vsan_core::Error::new(ErrorKind::WrongState, why)
}

use freshness::FreshnessState;
pub use freshness::{Awaiting, Freshness, Proof, StartupPolicy};

pub use sync::{SyncKind, SyncProgress, SyncRole, SyncSummary};

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
    /// How long requests wait at start for the peer's first connection; then the
    /// startup policy (or, with a witness, the witness) decides.
    pub connect_timeout: Duration,
    /// What an unproven node does when its peer does not connect within
    /// `connect_timeout` and no witness is configured (see [`StartupPolicy`]).
    pub startup: StartupPolicy,
    /// What to do in a split brain.
    pub split_brain: SplitBrainPolicy,
    /// Resync speed and pacing.
    pub resync: ResyncConfig,
    /// Quorum policy when a witness is configured (`None`: no witness, a node that lost
    /// its peer goes on alone).
    pub quorum: Option<QuorumPolicy>,
    /// Seed for the generation ids this node makes: random from [`Config::new`] (two
    /// nodes, or two starts of one node, with the same seed would make the same "new"
    /// generations, and two sides written apart could look like one history); a
    /// simulation sets a fixed one.
    pub seed: u64,
}

/// How fast a resync (or online verify) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncRate {
    /// At most this many bytes per second, whatever the application does.
    Fixed(u64),
    /// As fast as possible (at most `max` bytes per second; 0: no cap) while the
    /// application is idle; one chunk at a time while it has I/O in flight.
    Dynamic {
        /// Cap in bytes per second (0: none).
        max: u64,
    },
}

/// Resync settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResyncConfig {
    /// Pacing.
    pub rate: ResyncRate,
    /// Chunks in flight at most.
    pub window: usize,
    /// How often progress is made durable on both nodes (a checkpoint); an interrupted
    /// resync resumes from the last one.
    pub checkpoint_interval: Duration,
}

impl Default for ResyncConfig {
    fn default() -> ResyncConfig {
        ResyncConfig {
            rate: ResyncRate::Dynamic { max: 0 },
            window: 64,
            checkpoint_interval: Duration::from_secs(1),
        }
    }
}

/// What a node without its peer and without quorum does with I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuorumPolicy {
    /// Fail it with [`ErrorKind::NoQuorum`].
    IoError,
    /// Hold it until the peer is back or quorum is granted.
    Suspend,
}

impl Config {
    /// A config with the default timeouts (peer 5 s, ping 1 s, first connection 5 s), no
    /// witness, startup policy wait-for-peer, split brains refused, dynamic resync rate, a random generation seed.
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
            startup: StartupPolicy::WaitForPeer,
            split_brain: SplitBrainPolicy::Refuse,
            resync: ResyncConfig::default(),
            quorum: None,
            seed: rand::random(),
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
        /// A resync or verify read: run it with `BlockDevice::read_once`.
        once: bool,
    },
    /// Write these blocks of the metadata area, then make them durable. With
    /// `flush_data`, flush the local replica first (the metadata is about to forget
    /// writes that must be durable by then).
    Meta {
        /// Report back with this id.
        op: LocalOpId,
        /// `(offset in the metadata area, bytes)`, block aligned.
        writes: Vec<(u64, Bytes)>,
        /// Flush the replica before writing.
        flush_data: bool,
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
    /// The local replica lost data it had acknowledged (see
    /// [`Endpoint::local_data_lost`]); `action` says, in words for the operator, what
    /// the endpoint did about it (a checksum resync from the peer, a detach, or I/O
    /// failing until the peer is back).
    LocalDataLost {
        /// What happens now.
        action: String,
    },
    /// The peer is gone and a witness is configured: the driver must ask it for the
    /// disk's grant and report with [`Endpoint::handle_quorum`].
    NeedQuorum,
    /// The replicas are in sync again: the driver releases the witness's grant.
    ReleaseQuorum,
    /// A resync or verify started.
    SyncStarted {
        /// This node's role.
        role: SyncRole,
        /// Bitmap, checksum or verify.
        kind: SyncKind,
        /// Bytes to go through.
        total_bytes: u64,
    },
    /// A resync or verify ended (finished or interrupted).
    SyncEnded(SyncSummary),
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
    /// Waiting for its bitmap bits (and generation) to be durable before completing.
    bits_pending: bool,
    /// Its local copy failed and left no complete copy anywhere (`detached_alone`):
    /// it fails, even if the peer takes it later.
    failed_alone: bool,
}

#[derive(Debug, Clone)]
struct OwnFlush {
    local: Local,
    /// `Unsent`: waiting for the link or for quorum.
    remote: Remote,
    submitted: Instant,
    /// Alone without quorum: fails with this.
    refused: Option<ErrorKind>,
    /// Completed without the peer: waiting for the new generation to be durable.
    gen_pending: bool,
}

/// An entry in the apply list: local replica I/O that must be ordered against
/// overlapping writes (application writes, resync copies, resync reads).
#[derive(Debug, Clone)]
struct Apply {
    id: u64,
    /// The link it belongs to (`Endpoint::link_epoch` when it was made): results for the
    /// peer from an earlier link are dropped, never sent on a later one.
    epoch: u64,
    kind: ApplyKind,
    ranges: Vec<Range>,
    started: bool,
    running_ops: usize,
    failed: Option<ErrorKind>,
    /// Metadata generation that must be durable before it starts.
    gate: u64,
    /// Activity-log extents it holds (writes only); `None` while it waits for a slot.
    extents: Option<Vec<u64>>,
    /// Read result (resync reads and compares).
    data: Option<Bytes>,
    /// One of its operations was issued before the local replica lost data and
    /// completed after: what it read or wrote may be gone.
    suspect: bool,
    /// A peer write that lost parts to own writes awaiting their acks (rule 3): only
    /// these parts are written. It still waits, over its whole range, for the own
    /// writes before it, and then flushes (see `peer_write`).
    keep: Option<Vec<Range>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ApplyKind {
    Own(RequestId),
    /// A peer write, by the peer's message id.
    Peer(u64),
    /// Resync data from the peer for the chunk at `offset`.
    SyncWrite {
        offset: u64,
        data: Bytes,
    },
    /// Read a chunk to send it (or its crc).
    SyncRead {
        offset: u64,
        len: u32,
        mode: sync::ReadMode,
    },
    /// Read a chunk to compare it with the peer's crc.
    SyncCompare {
        offset: u64,
        len: u32,
        crc: u32,
        verify: bool,
    },
}

impl ApplyKind {
    fn is_write(&self) -> bool {
        matches!(
            self,
            ApplyKind::Own(_) | ApplyKind::Peer(_) | ApplyKind::SyncWrite { .. }
        )
    }
}

#[derive(Debug, Clone)]
struct PeerWrite {
    offset: u64,
    payload: WritePayload,
    fua: bool,
}

#[derive(Debug, Clone, Copy)]
enum OpPurpose {
    Apply(u64),
    Meta,
    OwnFlush(RequestId),
    PeerFlush(u64, u64),
    OwnRead(RequestId),
    PeerRead(u64, u64),
}

/// Quorum as the endpoint knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quorum {
    /// Not asked (connected, or no witness).
    Idle,
    /// Asked, no answer yet.
    Pending,
    /// Granted: this node may go on alone.
    Granted,
    /// Denied or the witness is unreachable.
    Denied,
}

/// What a request may do while the peer is away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alone {
    Allowed,
    Hold,
    Fail(ErrorKind),
}

/// An activity-log slot.
#[derive(Debug, Clone, Copy)]
struct AlSlot {
    /// Metadata generation that made it durable.
    mgen: u64,
    /// Apply entries using it.
    users: u32,
    /// Last use (for eviction).
    tick: u64,
}

/// The metadata as the endpoint keeps it, and what of it still has to be written.
#[derive(Debug, Clone)]
struct Meta {
    layout: Layout,
    sb: Superblock,
    al_seq: u64,
    al: HashMap<u64, AlSlot>,
    tick: u64,
    bitmap: Bitmap,
    dirty_sb: bool,
    dirty_al: bool,
    dirty_blocks: BTreeSet<usize>,
    /// Blocks with bits cleared in memory that are persisted only at a checkpoint.
    cleared_blocks: BTreeSet<usize>,
    flush_data: bool,
    /// Bumped on every change; a change is durable once `persisted` reaches it.
    requested: u64,
    persisted: u64,
    inflight: Option<(LocalOpId, u64)>,
    failed: bool,
    /// Deferred replies, sent once `persisted` reaches the generation.
    waiters: Vec<(u64, MetaWaiter)>,
}

#[derive(Debug, Clone, Copy)]
enum MetaWaiter {
    OwnWrite(RequestId),
    OwnFlush(RequestId),
    CheckpointAck(u64),
    /// A finished resync's `SyncDone` for the target, on link `epoch` (then the grant
    /// goes back to the witness).
    SyncDone {
        epoch: u64,
        generations: Generations,
    },
    /// `ReplicaDetached` for the peer on link `epoch` (after a `SyncDone`).
    ReplicaDetached {
        epoch: u64,
    },
    Shutdown,
}

/// One node's protocol state for one mirrored disk.
#[derive(Debug, Clone)]
pub struct Endpoint {
    cfg: Config,
    meta: Meta,
    sync: Option<sync::SyncRun>,
    last_sync: Option<SyncSummary>,
    /// The Hello this node sent on the current link, and the peer's.
    sent_hello: Option<Hello>,
    peer_hello: Option<Hello>,
    decision: Option<Decision>,
    /// Own writes wait (not started) while a handshake from degraded mode runs.
    hold_writes: bool,
    /// The Hello waits for unmirrored writes in flight to finish.
    hello_deferred: bool,
    discard_my_data: bool,
    quorum: Quorum,
    /// Reads waiting for quorum or for the peer, with when they were submitted.
    held_reads: VecDeque<(RequestId, u64, u32, Instant)>,
    rng: u64,
    next_apply: u64,
    last_app_io: Instant,
    shutting_down: bool,
    shut_down: bool,
    state: LinkState,
    /// Whether the replica is proven current (see the `freshness` module).
    fresh: FreshnessState,
    created: Instant,
    /// We validated the peer's Hello and sent Welcome.
    sent_welcome: bool,
    /// We received the peer's Welcome.
    got_welcome: bool,
    /// A link is attached and its handshake has not finished (in any state: a degraded
    /// node handshakes too, to learn it must refuse).
    handshaking: bool,
    /// The local replica failed.
    detached: bool,
    /// The replica was detached by a failure while no complete copy was on the peer
    /// (the peer away, or an unfinished sync target of this node): every request fails
    /// until it is back, so it misses nothing and is not distrusted; but it may hold
    /// writes the peer lacks, so no handshake is accepted until the operator attaches it
    /// again (or discards its data).
    detached_alone: bool,
    /// The peer failed a write or flush on this link: its replica is detached (or
    /// distrusted), so it holds no complete copy. Cleared by a new link's handshake.
    peer_incomplete: bool,
    /// Local operations with ids below this were issued before the local replica last
    /// lost data (`local_data_lost`): their results are not trusted.
    loss_op_mark: u64,
    /// The metadata generation that records the replica as distrusted (0: never):
    /// writes that reach the peer only wait for it to be durable.
    distrust_mgen: u64,
    last_rx: Instant,
    last_tx: Instant,
    next_request: u64,
    next_op: u64,
    next_ping: u64,
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
    /// Peer writes being applied, by (link epoch, the peer's id).
    peer_writes: FastMap<(u64, u64), PeerWrite>,
    /// Counts links: bumped by every `handle_connected`.
    link_epoch: u64,
    apply: Vec<Apply>,
    ops: FastMap<LocalOpId, OpPurpose>,
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
        let Loaded {
            layout,
            mut superblock,
            al_seq,
            al,
            mut bitmap,
        } = loaded;
        if !superblock.clean_shutdown {
            let mut marked = 0;
            for extent in &al {
                let start = extent * AL_EXTENT_SIZE;
                if start >= layout.size() {
                    continue;
                }
                let len = AL_EXTENT_SIZE.min(layout.size() - start);
                for c in layout.chunks_of(start, len) {
                    if bitmap.set(c) {
                        marked += 1;
                    }
                }
            }
            if !al.is_empty() {
                superblock.crashed = true;
            }
            warn!(
                disk = %cfg.disk_name,
                "not shut down cleanly: {} activity-log extents ({marked} chunks) marked for resync",
                al.len()
            );
        }
        superblock.clean_shutdown = false;
        let blocks = if superblock.crashed {
            layout.bitmap_blocks()
        } else {
            0
        };
        // The extents of the log on disk stay in the log (idle, already durable): they
        // leave it only by eviction, after a replica flush, and by then the bitmap that
        // now marks them is durable too. (Writing an emptied log first could lose them:
        // a crash after that write and before the bitmap's would forget them.)
        let al = al
            .iter()
            .take(AL_SLOTS)
            .map(|e| {
                (
                    *e,
                    AlSlot {
                        mgen: 0,
                        users: 0,
                        tick: 0,
                    },
                )
            })
            .collect();
        let meta = Meta {
            layout,
            sb: superblock,
            al_seq,
            al,
            tick: 0,
            bitmap,
            dirty_sb: true,
            dirty_al: false,
            dirty_blocks: (0..blocks).collect(),
            cleared_blocks: BTreeSet::new(),
            flush_data: false,
            requested: 1,
            persisted: 0,
            inflight: None,
            failed: false,
            waiters: Vec::new(),
        };
        let rng = cfg.seed ^ 0x9e37_79b9_7f4a_7c15;
        let mut ep = Endpoint {
            cfg,
            meta,
            sync: None,
            last_sync: None,
            sent_hello: None,
            peer_hello: None,
            decision: None,
            hold_writes: false,
            hello_deferred: false,
            discard_my_data: false,
            quorum: Quorum::Idle,
            held_reads: VecDeque::new(),
            rng,
            next_apply: 1,
            last_app_io: now,
            shutting_down: false,
            shut_down: false,
            state: LinkState::Waiting,
            fresh: FreshnessState::Unproven { timed_out: false },
            created: now,
            sent_welcome: false,
            got_welcome: false,
            handshaking: false,
            detached: false,
            detached_alone: false,
            peer_incomplete: false,
            loss_op_mark: 0,
            distrust_mgen: 0,
            last_rx: now,
            last_tx: now,
            next_request: 1,
            next_op: 1,
            next_ping: 1,
            own_writes: FastMap::default(),
            pending_own: VecDeque::new(),
            unsent: VecDeque::new(),
            own_flushes: FastMap::default(),
            local_reads: FastMap::default(),
            remote_reads: FastMap::default(),
            peer_writes: FastMap::default(),
            link_epoch: 0,
            apply: Vec::new(),
            ops: FastMap::default(),
            transmit: VecDeque::new(),
            local_io: VecDeque::new(),
            events: VecDeque::new(),
        };
        ep.initial_freshness();
        ep
    }

    /// The link state.
    pub fn state(&self) -> LinkState {
        self.state
    }

    /// Whether the local replica is detached.
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// Whether this replica's bitmap marks chunks out of sync with the peer (a resync
    /// is due, or running).
    pub fn is_diverged(&self) -> bool {
        self.meta.bitmap.count() > 0
    }

    /// Chunks this replica's bitmap marks out of sync.
    pub fn dirty_chunks(&self) -> u64 {
        self.meta.bitmap.count()
    }

    /// This replica's generation ids.
    pub fn generations(&self) -> Generations {
        self.meta.sb.generations
    }

    /// True while this replica is an unfinished sync target (its data is not usable
    /// alone).
    pub fn is_inconsistent(&self) -> bool {
        self.meta.sb.inconsistent
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

    fn random_generation(&mut self) -> u64 {
        // splitmix64: deterministic for a given seed; never 0 or "just created", and
        // never one this replica already has (a node restarted with the seed it had
        // before would otherwise make the same "new" generation again, and its writes
        // alone would look like no change at all).
        let g = self.meta.sb.generations;
        loop {
            self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.rng;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z > super::message::GEN_JUST_CREATED
                && z != g.current
                && z != g.bitmap
                && !g.history.contains(&z)
            {
                return z;
            }
        }
    }

    // ----- metadata -----

    /// A metadata change was made in memory; returns the generation that makes it
    /// durable.
    fn meta_touch(&mut self) -> u64 {
        self.meta.requested += 1;
        self.meta.requested
    }

    fn meta_durable(&self, mgen: u64) -> bool {
        self.meta.persisted >= mgen
    }

    /// Queue a metadata write for everything changed, unless one is running.
    fn issue_meta(&mut self) {
        let m = &self.meta;
        if m.inflight.is_some() || m.persisted >= m.requested {
            return;
        }
        if !(m.dirty_sb || m.dirty_al || !m.dirty_blocks.is_empty() || m.flush_data) {
            // Nothing left to write: what was asked for is durable already.
            self.meta.persisted = self.meta.requested;
            return;
        }
        let mgen = self.meta.requested;
        let mut writes = Vec::new();
        let layout = self.meta.layout;
        if self.meta.dirty_al {
            self.meta.al_seq += 1;
            let mut extents: Vec<u64> = self.meta.al.keys().copied().collect();
            extents.sort_unstable();
            writes.push((
                layout.al_offset(self.meta.al_seq),
                encode_al(&layout, self.meta.al_seq, &extents),
            ));
        }
        for b in std::mem::take(&mut self.meta.dirty_blocks) {
            // A block with bits a resync cleared in memory: the data those bits stood
            // for must be durable before the cleared bits are.
            if self.meta.cleared_blocks.remove(&b) {
                self.meta.flush_data = true;
            }
            writes.push((
                layout.bitmap_offset() + (b * crate::meta::META_BLOCK) as u64,
                self.meta.bitmap.block_bytes(b),
            ));
        }
        // The superblock last: it is what names the state the rest belongs to.
        if self.meta.dirty_sb {
            self.meta.sb.seq += 1;
            writes.push((
                layout.superblock_offset(self.meta.sb.seq),
                self.meta.sb.encode(),
            ));
        }
        let flush_data = self.meta.flush_data;
        self.meta.dirty_sb = false;
        self.meta.dirty_al = false;
        self.meta.flush_data = false;
        let op = self.op_id(OpPurpose::Meta);
        self.meta.inflight = Some((op, mgen));
        self.local_io.push_back(LocalIo::Meta {
            op,
            writes,
            flush_data,
        });
    }

    fn meta_done(&mut self, now: Instant, result: LocalResult) {
        let Some((_, mgen)) = self.meta.inflight.take() else {
            return;
        };
        if let Err(kind) = result {
            if !self.meta.failed {
                warn!(disk = %self.cfg.disk_name, "metadata write failed ({kind}): detaching the local replica");
            }
            self.meta.failed = true;
            self.local_failed(now, kind);
            // Nothing will be persisted any more: release everything that waits.
            self.meta.persisted = u64::MAX;
        } else {
            self.meta.persisted = self.meta.persisted.max(mgen);
        }
        let persisted = self.meta.persisted;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.meta.waiters)
            .into_iter()
            .partition(|(g, _)| *g <= persisted);
        self.meta.waiters = waiting;
        for (_, w) in ready {
            match w {
                MetaWaiter::OwnWrite(req) => {
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.bits_pending = false;
                    }
                    self.finish_own_write(now, req);
                }
                MetaWaiter::OwnFlush(req) => {
                    if let Some(f) = self.own_flushes.get_mut(&req) {
                        f.gen_pending = false;
                    }
                    self.finish_flush(req);
                }
                MetaWaiter::CheckpointAck(id) => {
                    if self.state == LinkState::Connected {
                        let status = if self.meta.failed {
                            Status::Failed(ErrorKind::Io as u32)
                        } else {
                            Status::Ok
                        };
                        self.send(now, Message::SyncCheckpointAck { id, status });
                    }
                }
                MetaWaiter::SyncDone { epoch, generations } => {
                    if self.meta.failed {
                        // (Released because nothing will be persisted any more.) This
                        // replica's metadata still names it the only writer: the target
                        // must not become consistent beside it; it stays a target.
                        warn!(disk = %self.cfg.disk_name, "resync done, but the metadata failed: the peer is not told; it stays a resync target");
                    } else if self.state == LinkState::Connected && epoch == self.link_epoch {
                        self.send(now, Message::SyncDone { generations });
                        if self.cfg.quorum.is_some() {
                            self.events.push_back(Event::ReleaseQuorum);
                        }
                    }
                }
                MetaWaiter::ReplicaDetached { epoch } => {
                    if !self.meta.failed
                        && self.state == LinkState::Connected
                        && epoch == self.link_epoch
                    {
                        self.send(now, Message::ReplicaDetached);
                    }
                }
                MetaWaiter::Shutdown => self.shut_down = true,
            }
        }
        self.start_ready(now);
    }

    /// Mark the chunks of `range` out of sync; with `acknowledge`, the write will be
    /// acknowledged without the peer, so this replica moves to a new generation first
    /// (once per disconnect). Returns the metadata generation to wait for.
    fn mark_unmirrored(&mut self, range: Range, acknowledge: bool) -> u64 {
        let mut changed = false;
        for c in self.meta.layout.chunks_of(range.start, range.len()) {
            self.sync_remarked(c);
            if self.meta.bitmap.set(c) {
                let b = Bitmap::block_of(c);
                if self.meta.cleared_blocks.contains(&b) {
                    self.meta.flush_data = true;
                }
                self.meta.dirty_blocks.insert(b);
                changed = true;
            }
        }
        if acknowledge && self.meta.sb.generations.bitmap == 0 {
            self.new_generation_alone();
            changed = true;
        }
        if changed {
            self.meta_touch();
        }
        // Anything already queued or in flight may hold these bits: wait for all of it.
        self.meta.requested
    }

    /// This replica goes on without the peer: a new generation (once per separation),
    /// the old one kept as the bitmap generation.
    fn new_generation_alone(&mut self) {
        let g = &mut self.meta.sb.generations;
        g.bitmap = g.current;
        let new = self.random_generation();
        self.meta.sb.generations.current = new;
        info!(
            disk = %self.cfg.disk_name,
            "first acknowledgement without the peer: new generation {new:016x} (bitmap generation {:016x})",
            self.meta.sb.generations.bitmap
        );
        self.meta.dirty_sb = true;
    }

    /// As [`Self::mark_unmirrored`] for a flush completed alone: a new generation if
    /// this separation has none yet. Returns the metadata generation to wait for.
    fn move_generation_alone(&mut self) -> u64 {
        if self.meta.sb.generations.bitmap == 0 {
            self.new_generation_alone();
            self.meta_touch();
        }
        self.meta.requested
    }

    /// Take activity-log slots for `ranges`; `None` when the log is full of extents
    /// with writes in flight. Returns the generation that makes them durable.
    fn al_acquire(&mut self, ranges: &[Range]) -> Option<(Vec<u64>, u64)> {
        let mut extents: Vec<u64> = Vec::new();
        for r in ranges {
            let first = Layout::extent_of(r.start);
            let last = Layout::extent_of(r.end.saturating_sub(1).max(r.start));
            for e in first..=last {
                if !extents.contains(&e) {
                    extents.push(e);
                }
            }
        }
        let missing = extents
            .iter()
            .filter(|e| !self.meta.al.contains_key(e))
            .count();
        let free = AL_SLOTS.saturating_sub(self.meta.al.len());
        if missing > free {
            let mut idle: Vec<(u64, u64)> = self
                .meta
                .al
                .iter()
                .filter(|(e, s)| s.users == 0 && !extents.contains(e))
                .map(|(e, s)| (s.tick, *e))
                .collect();
            if idle.len() < missing - free {
                return None;
            }
            idle.sort_unstable();
            // Evict an eighth of the log at once (the least recently used idle extents):
            // each eviction costs a flush of the replica, so a working set wider than
            // the log pays one flush per many new extents, not one per extent.
            let evict = (missing - free).max(AL_SLOTS / 8).min(idle.len());
            for (_, e) in idle.into_iter().take(evict) {
                self.meta.al.remove(&e);
            }
            // The log forgets these extents: their writes must be durable first.
            self.meta.flush_data = true;
            self.meta.dirty_al = true;
        }
        let mut gate = 0;
        let mut added = false;
        self.meta.tick += 1;
        let tick = self.meta.tick;
        let next = self.meta.requested + 1;
        for e in &extents {
            let slot = self.meta.al.entry(*e).or_insert_with(|| {
                added = true;
                AlSlot {
                    mgen: next,
                    users: 0,
                    tick,
                }
            });
            slot.users += 1;
            slot.tick = tick;
            gate = gate.max(slot.mgen);
        }
        if added || self.meta.dirty_al {
            self.meta.dirty_al = true;
            let g = self.meta_touch();
            gate = gate.max(g);
        }
        Some((extents, gate))
    }

    fn al_release(&mut self, extents: &[u64]) {
        for e in extents {
            if let Some(s) = self.meta.al.get_mut(e) {
                s.users = s.users.saturating_sub(1);
            }
        }
    }

    /// Clean shutdown: once every request is done, flush the replica, empty the
    /// activity log and mark the metadata clean. [`is_shut_down`](Self::is_shut_down)
    /// turns true when that is durable.
    ///
    /// The link to the peer is dropped first (the peer goes on alone and marks what it
    /// writes), new links are refused, and new writes fail with [`ErrorKind::Closed`]:
    /// nothing may reach the replica once the metadata says it is clean.
    pub fn begin_shutdown(&mut self, now: Instant) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        info!(disk = %self.cfg.disk_name, "shutting down: dropping the link to the peer");
        if !self.is_current() {
            // Nothing held for an unproven replica may now be served from it.
            self.fail_held(|_| true, ErrorKind::Closed);
        }
        match self.state {
            LinkState::Connected => self.lose_peer(now, "this node is shutting down".into()),
            LinkState::Waiting | LinkState::Handshaking => {
                if self.handshaking {
                    self.events.push_back(Event::Refused {
                        reason: "this node is shutting down".into(),
                    });
                    self.end_handshake(now);
                }
                self.state = LinkState::Degraded;
                let waiting: Vec<RequestId> = self.unsent.drain(..).collect();
                self.settle_waiting_writes(now, waiting);
            }
            LinkState::Degraded => {
                if self.handshaking {
                    self.events.push_back(Event::Refused {
                        reason: "this node is shutting down".into(),
                    });
                    self.end_handshake(now);
                }
                self.settle_held(now);
            }
        }
        self.try_shutdown();
    }

    /// Whether writing the metadata failed: the local replica is detached, reads go
    /// through the peer, and writes fail until a restart (nothing durable could say
    /// which blocks the replica misses).
    pub fn meta_failed(&self) -> bool {
        self.meta.failed
    }

    /// The clean-shutdown state is durable (or the metadata failed).
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    fn try_shutdown(&mut self) {
        if !self.shutting_down || self.shut_down {
            return;
        }
        let busy =
            !self.own_writes.is_empty()
                || !self.own_flushes.is_empty()
                || !self.apply.is_empty()
                || self.meta.waiters.iter().any(|(_, w)| {
                    matches!(w, MetaWaiter::OwnWrite(_) | MetaWaiter::CheckpointAck(_))
                });
        if busy
            || self
                .meta
                .waiters
                .iter()
                .any(|(_, w)| matches!(w, MetaWaiter::Shutdown))
        {
            return;
        }
        if self.meta.failed || self.detached {
            self.shut_down = true;
            return;
        }
        self.meta.al.clear();
        self.meta.dirty_al = true;
        self.meta.flush_data = true;
        self.meta.sb.clean_shutdown = true;
        self.meta.dirty_sb = true;
        // Bits cleared in memory by a resync are persisted only after a flush: the
        // flush above is that flush.
        let cleared = std::mem::take(&mut self.meta.cleared_blocks);
        self.meta.dirty_blocks.extend(cleared);
        let mgen = self.meta_touch();
        self.meta.waiters.push((mgen, MetaWaiter::Shutdown));
    }

    // ----- link -----

    /// A link to the peer is up: start the handshake.
    pub fn handle_connected(&mut self, now: Instant) {
        if self.shutting_down {
            self.link_epoch += 1;
            self.transmit.clear();
            return self.events.push_back(Event::Refused {
                reason: "this node is shutting down".into(),
            });
        }
        if self.state == LinkState::Connected {
            self.lose_peer(now, "the link was replaced".into());
        }
        if self.detached_alone && self.discard_my_data {
            // The operator gave up this replica's data: the peer's is taken in full.
            self.distrust_replica();
            self.detached_alone = false;
        }
        self.link_epoch += 1;
        self.peer_incomplete = false;
        self.sent_welcome = false;
        self.got_welcome = false;
        self.handshaking = true;
        self.sent_hello = None;
        self.peer_hello = None;
        self.decision = None;
        self.last_rx = now;
        self.transmit.clear();
        if self.state != LinkState::Degraded {
            self.state = LinkState::Handshaking;
        } else {
            // Generations must not move while the two sides compare them: new writes
            // wait, and the Hello waits for writes already going on alone.
            self.hold_writes = true;
        }
        self.hello_deferred = true;
        self.maybe_send_hello(now);
    }

    fn unmirrored_in_flight(&self) -> bool {
        self.own_writes
            .values()
            .any(|w| w.started && matches!(w.remote, Remote::Skipped))
    }

    fn maybe_send_hello(&mut self, now: Instant) {
        if !self.hello_deferred || !self.handshaking || self.unmirrored_in_flight() {
            return;
        }
        self.hello_deferred = false;
        let sb = &self.meta.sb;
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: self.cfg.node_id,
            peer_id: self.cfg.peer_id,
            disk_id: self.cfg.disk_id,
            disk_name: self.cfg.disk_name.clone(),
            size: self.cfg.size,
            block_size: self.cfg.block_size,
            chunk_size: self.meta.layout.chunk_size(),
            generations: sb.generations,
            dirty_chunks: self.meta.bitmap.count(),
            crashed: sb.crashed,
            inconsistent: sb.inconsistent,
            discard_my_data: self.discard_my_data,
            split_brain_policy: self.cfg.split_brain.code(),
        };
        self.sent_hello = Some(hello.clone());
        self.send(now, Message::Hello(hello));
        if let Some(peer) = self.peer_hello.take() {
            self.evaluate_hello(now, peer);
        }
    }

    /// The link is gone (reset, closed, or closed by the driver after an event).
    pub fn handle_disconnected(&mut self, now: Instant, reason: &str) {
        self.handshaking = false;
        self.hello_deferred = false;
        match self.state {
            LinkState::Connected => self.lose_peer(now, format!("link lost: {reason}")),
            LinkState::Handshaking => {
                self.state = LinkState::Waiting;
                // A link that never finished its handshake changes nothing else.
            }
            LinkState::Waiting | LinkState::Degraded => {}
        }
        self.release_hold(now);
        if self.state == LinkState::Degraded && self.alone() != Alone::Hold {
            self.settle_held(now);
        }
        // Reads that waited for the handshake to reach the peer.
        self.run_held_reads(now);
        self.transmit.clear();
    }

    fn release_hold(&mut self, now: Instant) {
        if self.hold_writes {
            self.hold_writes = false;
            self.start_ready(now);
        }
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
        self.end_handshake(now);
    }

    /// The handshake on the current link failed: the driver drops the link.
    fn end_handshake(&mut self, now: Instant) {
        self.handshaking = false;
        self.hello_deferred = false;
        if self.state == LinkState::Handshaking {
            self.state = LinkState::Waiting;
        }
        self.release_hold(now);
        if self.state == LinkState::Degraded && self.alone() != Alone::Hold {
            // A quorum answer that came during the handshake.
            self.settle_held(now);
        }
        // Reads that waited for the handshake to reach the peer.
        self.run_held_reads(now);
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
        if h.chunk_size != self.meta.layout.chunk_size() {
            return Err(format!(
                "bitmap chunk size mismatch for disk {:?}: {} here, {} on node {}",
                me.disk_name,
                self.meta.layout.chunk_size(),
                h.chunk_size,
                h.node_id
            ));
        }
        if h.split_brain_policy != me.split_brain.code() {
            let theirs = SplitBrainPolicy::from_code(h.split_brain_policy).map_or_else(
                || format!("code {}", h.split_brain_policy),
                |p| p.to_string(),
            );
            return Err(format!(
                "split-brain policy mismatch for disk {:?}: {} here, {theirs} on node {}",
                me.disk_name, me.split_brain, h.node_id
            ));
        }
        Ok(())
    }

    fn side_of(h: &Hello) -> Side {
        Side {
            node_id: h.node_id,
            generations: h.generations,
            dirty_chunks: h.dirty_chunks,
            chunks: if h.chunk_size == 0 {
                0
            } else {
                h.size.div_ceil(h.chunk_size)
            },
            crashed: h.crashed,
            inconsistent: h.inconsistent,
            discard_my_data: h.discard_my_data,
        }
    }

    fn evaluate_hello(&mut self, now: Instant, h: Hello) {
        if let Err(reason) = self.check_hello(&h) {
            return self.refuse(now, reason);
        }
        if self.detached_alone {
            let (me, peer) = (self.cfg.node_id, self.cfg.peer_id);
            return self.refuse(
                now,
                format!(
                    "node {me}'s replica failed while node {peer} was away and is detached; it may \
                     hold writes node {peer} lacks: attach it again (or discard its data) first"
                ),
            );
        }
        let Some(mine) = self.sent_hello.as_ref() else {
            // Our Hello is not out yet: decide when it is.
            self.peer_hello = Some(h);
            return;
        };
        let decision = decide(
            &Self::side_of(mine),
            &Self::side_of(&h),
            self.cfg.split_brain,
        );
        if let Decision::Refuse(reason) = decision {
            return self.refuse(now, reason);
        }
        self.decision = Some(decision);
        self.sent_welcome = true;
        self.send(now, Message::Welcome);
        self.maybe_connected(now);
    }

    /// A message from the peer.
    pub fn handle_message(&mut self, now: Instant, msg: Message) {
        self.last_rx = now;
        match msg {
            Message::Hello(h) => self.evaluate_hello(now, h),
            Message::Welcome => {
                self.got_welcome = true;
                self.maybe_connected(now);
            }
            Message::ReplicaDetached => {
                warn!(
                    disk = %self.cfg.disk_name,
                    "node {}'s replica is detached: this replica is the only complete copy",
                    self.cfg.peer_id
                );
                self.peer_incomplete = true;
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
                    self.peer_incomplete = true;
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
                if status != Status::Ok {
                    self.peer_incomplete = true;
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
                let bs = u64::from(self.cfg.block_size);
                let end = offset.checked_add(u64::from(len));
                if len == 0
                    || end.is_none_or(|e| e > self.cfg.size)
                    || offset % bs != 0
                    || u64::from(len) % bs != 0
                {
                    return self.protocol_violation(
                        now,
                        format!("read {id} of {len} bytes at {offset} is invalid"),
                    );
                }
                // A replica that is out of sync there (a sync target whose chunk has not
                // arrived, or one that lost data) must not answer with what it has.
                if self.detached || self.stale(offset, u64::from(len)) {
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

    fn maybe_connected(&mut self, now: Instant) {
        if !(self.sent_welcome && self.got_welcome) || self.state == LinkState::Connected {
            return;
        }
        let Some(decision) = self.decision.take() else {
            return;
        };
        let moved = self.sent_hello.as_ref().is_none_or(|h| {
            h.generations != self.meta.sb.generations
                || h.dirty_chunks != self.meta.bitmap.count()
                || h.inconsistent != self.meta.sb.inconsistent
        });
        if moved {
            return self.refuse(
                now,
                "generations or marked chunks changed during the handshake; reconnecting".into(),
            );
        }
        self.state = LinkState::Connected;
        self.handshaking = false;
        self.quorum = Quorum::Idle;
        self.become_current(freshness::Proof::Handshake);
        info!(disk = %self.cfg.disk_name, peer = self.cfg.peer_id, "peer connected: mirroring ({decision:?})");
        self.events.push_back(Event::Connected);
        // Writes started while waiting for the link go out now, in order, then the
        // flushes that waited (each covers the writes before it).
        while let Some(req) = self.unsent.pop_front() {
            self.send_own_write(now, req);
        }
        let mut flushes: Vec<RequestId> = self
            .own_flushes
            .iter()
            .filter(|(_, f)| f.remote == Remote::Unsent)
            .map(|(r, _)| *r)
            .collect();
        flushes.sort_unstable();
        for req in flushes {
            if let Some(f) = self.own_flushes.get_mut(&req) {
                f.remote = Remote::Sent(now);
            }
            self.send(now, Message::Flush { id: req.0 });
        }
        match decision {
            Decision::InSync => {
                if self.meta.sb.crashed {
                    self.meta.sb.crashed = false;
                    self.meta.dirty_sb = true;
                    self.meta_touch();
                }
                if self.cfg.quorum.is_some() {
                    self.events.push_back(Event::ReleaseQuorum);
                }
            }
            Decision::Source { full } => {
                if self.meta.sb.inconsistent {
                    // Both were inconsistent and the peer's operator discarded its data:
                    // this replica is taken as the data from now on.
                    warn!(disk = %self.cfg.disk_name, "the peer discards its data: this inconsistent replica becomes the resync source");
                    self.meta.sb.inconsistent = false;
                    self.meta.dirty_sb = true;
                    self.meta_touch();
                }
                self.start_sync(now, SyncRole::Source, full)
            }
            Decision::Target { full } => self.start_sync(now, SyncRole::Target, full),
            Decision::Refuse(_) => {}
        }
        self.discard_my_data = false;
        self.release_hold(now);
        // Writes held while the replica was unproven start now, in submission order.
        self.start_ready(now);
        self.run_held_reads(now);
    }

    fn lose_peer(&mut self, now: Instant, reason: String) {
        warn!(disk = %self.cfg.disk_name, peer = self.cfg.peer_id, "peer lost: {reason}; continuing degraded");
        self.state = LinkState::Degraded;
        self.events.push_back(Event::PeerLost { reason });
        self.transmit.clear();
        self.abort_sync(now, "the link to the peer was lost");
        if self.cfg.quorum.is_some() && self.quorum != Quorum::Granted {
            self.quorum = Quorum::Pending;
            self.events.push_back(Event::NeedQuorum);
        }
        // Everything waiting on the peer completes without it (or waits for quorum).
        let mut waiting: Vec<RequestId> = self
            .own_writes
            .iter()
            .filter(|(_, w)| w.started && matches!(w.remote, Remote::Sent(_) | Remote::Unsent))
            .map(|(r, _)| *r)
            .collect();
        waiting.sort_unstable();
        // A write sent on the lost link may or may not have reached the peer's replica
        // (and lost or won there against overlapping writes): whatever happens to it
        // now (held and sent again, completed alone, failed), its chunks are marked, so
        // the next resync makes both replicas agree on them.
        let sent: Vec<Range> = waiting
            .iter()
            .filter_map(|r| self.own_writes.get(r))
            .filter(|w| matches!(w.remote, Remote::Sent(_)))
            .map(|w| Range::new(w.offset, w.payload.len()))
            .collect();
        for r in sent {
            self.mark_unmirrored(r, false);
        }
        self.unsent.clear();
        self.settle_waiting_writes(now, waiting);
        self.settle_waiting_flushes();
        for (req, _) in self.remote_reads.drain() {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
        }
    }

    /// Flushes sent to the peer or waiting for it, while the peer is away: complete
    /// them alone, fail them, or keep them for the peer, as quorum says.
    fn settle_waiting_flushes(&mut self) {
        let verdict = self.alone();
        let mut waiting: Vec<RequestId> = self
            .own_flushes
            .iter()
            .filter(|(_, f)| matches!(f.remote, Remote::Sent(_) | Remote::Unsent))
            .map(|(r, _)| *r)
            .collect();
        waiting.sort_unstable();
        for req in waiting {
            let Some(f) = self.own_flushes.get_mut(&req) else {
                continue;
            };
            match verdict {
                Alone::Hold => f.remote = Remote::Unsent,
                Alone::Allowed => f.remote = Remote::Skipped,
                Alone::Fail(k) => {
                    f.remote = Remote::Skipped;
                    f.refused = Some(k);
                }
            }
            self.finish_flush(req);
        }
    }

    /// Writes started but not mirrored, while the peer is away: complete them alone,
    /// fail them, or keep them for the peer, as quorum says.
    fn settle_waiting_writes(&mut self, now: Instant, waiting: Vec<RequestId>) {
        match self.alone() {
            Alone::Hold => {
                for req in waiting {
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.remote = Remote::Unsent;
                        self.unsent.push_back(req);
                    }
                }
            }
            Alone::Allowed | Alone::Fail(_) => {
                for req in waiting {
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.remote = Remote::Skipped;
                    }
                    self.finish_own_write(now, req);
                }
            }
        }
    }

    /// What a request may do while the peer is away.
    fn alone(&self) -> Alone {
        if self.meta.sb.inconsistent {
            return Alone::Fail(ErrorKind::Io);
        }
        if self.shutting_down {
            // Nothing is held through a shutdown: it would never end.
            return match (self.cfg.quorum, self.quorum) {
                (None, _) | (Some(_), Quorum::Granted) => Alone::Allowed,
                _ => Alone::Fail(ErrorKind::Closed),
            };
        }
        match (self.cfg.quorum, self.quorum) {
            (None, _) | (Some(_), Quorum::Granted) => Alone::Allowed,
            (Some(_), Quorum::Pending) | (Some(QuorumPolicy::Suspend), _) => Alone::Hold,
            (Some(QuorumPolicy::IoError), _) => Alone::Fail(ErrorKind::NoQuorum),
        }
    }

    /// The witness answered (or could not be reached: `granted` false).
    pub fn handle_quorum(&mut self, now: Instant, granted: bool) {
        if self.cfg.quorum.is_none() || self.state == LinkState::Connected {
            return;
        }
        let before = self.quorum;
        self.quorum = if granted {
            Quorum::Granted
        } else {
            Quorum::Denied
        };
        if granted {
            // The peer cannot have written alone since: it would hold the grant.
            self.become_current(freshness::Proof::Witness);
        }
        if before != self.quorum {
            if granted {
                info!(disk = %self.cfg.disk_name, "quorum granted by the witness: serving I/O without the peer");
            } else {
                warn!(disk = %self.cfg.disk_name, "no quorum: the witness did not grant this node the disk");
            }
        }
        // While a handshake compares generations and marks, held writes stay held:
        // settling them now could mark chunks behind the decision's back.
        if self.state == LinkState::Degraded && !self.handshaking {
            self.settle_held(now);
        }
    }

    fn settle_held(&mut self, now: Instant) {
        if !self.is_current()
            && let Some(kind) = self.unproven_refusal()
        {
            // Unproven and refused alone (the witness gave the disk to the peer): the
            // held requests fail, none of them touched the replica.
            self.fail_held(|_| true, kind);
        }
        let waiting: Vec<RequestId> = self.unsent.drain(..).collect();
        self.settle_waiting_writes(now, waiting);
        self.settle_waiting_flushes();
        self.run_held_reads(now);
        self.start_ready(now);
    }

    /// The operator resolves a split brain on this node: on the next handshake this
    /// replica becomes the sync target and its changes are discarded.
    pub fn discard_my_data(&mut self) {
        warn!(disk = %self.cfg.disk_name, "operator: discard this node's data on the next connect");
        self.discard_my_data = true;
        self.undo_only_writer_start();
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
        self.last_app_io = now;
        if self.shutting_down {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Closed),
            });
            return req;
        }
        if self.meta.failed || self.detached_alone {
            // The replica is detached, and its metadata cannot record that it misses this
            // write: acknowledged by the peer alone, it would be lost to the restart that
            // attaches the replica again (which trusts it). Fail it; reads still go
            // through the peer. (Detached with no complete copy on the peer: see
            // `detached_alone`.)
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
            return req;
        }
        if self.state == LinkState::Degraded
            && let Alone::Fail(kind) = self.alone()
        {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(kind),
            });
            return req;
        }
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
                bits_pending: false,
                failed_alone: false,
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
        if self.detached_alone {
            // No complete copy anywhere (see `detached_alone`): nothing to make durable.
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
            return req;
        }
        let local = if self.detached {
            Local::Done(Err(ErrorKind::Io))
        } else if !self.is_current() {
            // Unproven: no write of the callers' reached this replica, so there is
            // nothing here to make durable (and the replica is not touched before the
            // proof; the peer's half still runs once the link is up).
            Local::Done(Ok(()))
        } else {
            let op = self.op_id(OpPurpose::OwnFlush(req));
            self.local_io.push_back(LocalIo::Flush { op });
            Local::Running
        };
        let mut refused = None;
        let remote = match self.state {
            // Not proven current: the flush waits for the proof like every request, and
            // never completes alone (that would move the generation of data nobody has
            // proven).
            _ if !self.is_current() => {
                if self.shutting_down {
                    refused = Some(ErrorKind::Closed);
                    Remote::Skipped
                } else {
                    Remote::Unsent
                }
            }
            LinkState::Connected => {
                self.send(now, Message::Flush { id: req.0 });
                Remote::Sent(now)
            }
            // Like writes: wait for the first link (the connect timeout bounds it).
            LinkState::Waiting | LinkState::Handshaking => Remote::Unsent,
            // Durable on this node alone: only with quorum (or without a witness).
            LinkState::Degraded => match self.alone() {
                Alone::Allowed => Remote::Skipped,
                Alone::Hold => Remote::Unsent,
                Alone::Fail(k) => {
                    refused = Some(k);
                    Remote::Skipped
                }
            },
        };
        self.own_flushes.insert(
            req,
            OwnFlush {
                local,
                remote,
                submitted: now,
                refused,
                gen_pending: false,
            },
        );
        self.finish_flush(req);
        req
    }

    /// Read from the local replica; from the peer while the local one is detached or,
    /// on a sync target, not yet synced for that range.
    pub fn submit_read(&mut self, now: Instant, offset: u64, len: u32) -> RequestId {
        let req = self.request_id();
        self.last_app_io = now;
        self.route_read(now, req, offset, len, now);
        req
    }

    /// Send a read where it can be served; `since`: when it was submitted.
    fn route_read(&mut self, now: Instant, req: RequestId, offset: u64, len: u32, since: Instant) {
        if self.detached_alone {
            // No replica here, and none complete on the peer.
            return self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
        }
        if !self.is_current() {
            // Not proven current: never answered from this replica. It waits for the
            // proof (the connect timeout bounds it), or fails as quorum says.
            return match self.unproven_refusal() {
                Some(kind) => self.events.push_back(Event::Completed {
                    request: req,
                    result: Err(kind),
                }),
                None => self.held_reads.push_back((req, offset, len, since)),
            };
        }
        if self.state == LinkState::Degraded {
            match self.alone() {
                Alone::Hold => return self.held_reads.push_back((req, offset, len, since)),
                Alone::Fail(ErrorKind::NoQuorum) => {
                    return self.events.push_back(Event::Completed {
                        request: req,
                        result: Err(ErrorKind::NoQuorum),
                    });
                }
                Alone::Allowed => {}
                Alone::Fail(_) => {
                    // An inconsistent replica fails writes alone but may serve reads of
                    // the chunks it has synced: with a witness, only while it holds the
                    // grant (without it, the peer may be writing alone right now).
                    if self.cfg.quorum.is_some() && self.quorum != Quorum::Granted {
                        if self.quorum == Quorum::Pending
                            || (self.cfg.quorum == Some(QuorumPolicy::Suspend)
                                && !self.shutting_down)
                        {
                            return self.held_reads.push_back((req, offset, len, since));
                        }
                        let kind = if self.shutting_down {
                            ErrorKind::Closed
                        } else {
                            ErrorKind::NoQuorum
                        };
                        return self.events.push_back(Event::Completed {
                            request: req,
                            result: Err(kind),
                        });
                    }
                }
            }
        }
        // (Waiting or handshaking without the grant is never reached here: a node is
        // proven current only connected or degraded; see the freshness gate above.)
        if self.detached || self.stale(offset, u64::from(len)) {
            if self.state != LinkState::Connected
                && (self.handshaking || self.state == LinkState::Waiting)
            {
                // Only the peer can serve it, and its link is coming up (or has not come
                // up yet): wait for it, as writes do, rather than fail; the connect
                // timeout bounds the wait.
                return self.held_reads.push_back((req, offset, len, since));
            }
            self.read_from_peer(now, req, offset, len);
        } else {
            let op = self.op_id(OpPurpose::OwnRead(req));
            self.local_reads.insert(req, (offset, len));
            self.local_io.push_back(LocalIo::Read {
                op,
                offset,
                len,
                once: false,
            });
        }
    }

    /// Whether this replica's data in `[offset, offset + len)` may be older than the
    /// peer's: it is a sync target (or lost data) and a chunk there is not synced yet.
    fn stale(&self, offset: u64, len: u64) -> bool {
        if matches!(&self.sync, Some(s) if s.role == SyncRole::Target && !s.got_peer_bitmap()) {
            // The source's marks (what it wrote while apart) have not arrived: any chunk
            // may be older here.
            return true;
        }
        (self.meta.sb.inconsistent || matches!(&self.sync, Some(s) if s.role == SyncRole::Target))
            && self
                .meta
                .layout
                .chunks_of(offset, len.max(1))
                .any(|c| self.meta.bitmap.get(c))
    }

    fn run_held_reads(&mut self, now: Instant) {
        if self.state == LinkState::Degraded && self.alone() == Alone::Hold {
            return;
        }
        for (req, offset, len, since) in std::mem::take(&mut self.held_reads) {
            self.route_read(now, req, offset, len, since);
        }
    }

    fn read_from_peer(&mut self, now: Instant, req: RequestId, offset: u64, len: u32) {
        if self.state == LinkState::Connected {
            self.remote_reads.insert(req, len);
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

    fn overlaps_apply(&self, ranges: &[Range], before: usize) -> bool {
        self.apply[..before]
            .iter()
            .any(|a| any_overlap(&a.ranges, ranges))
    }

    fn push_apply(&mut self, kind: ApplyKind, ranges: Vec<Range>, gate: u64) -> usize {
        self.push_apply_keeping(kind, ranges, gate, None)
    }

    /// As [`Self::push_apply`], writing only `keep` of `ranges` (a trimmed peer write).
    fn push_apply_keeping(
        &mut self,
        kind: ApplyKind,
        ranges: Vec<Range>,
        gate: u64,
        keep: Option<Vec<Range>>,
    ) -> usize {
        let id = self.next_apply;
        self.next_apply += 1;
        let extents = if kind.is_write() && !matches!(kind, ApplyKind::SyncWrite { .. }) {
            None
        } else {
            Some(Vec::new())
        };
        self.apply.push(Apply {
            id,
            epoch: self.link_epoch,
            kind,
            ranges,
            started: false,
            running_ops: 0,
            failed: None,
            gate,
            extents,
            data: None,
            suspect: false,
            keep,
        });
        let at = self.apply.len() - 1;
        self.try_start_apply(at);
        at
    }

    /// Start apply entry `i` if nothing earlier overlaps it and its metadata is durable.
    fn try_start_apply(&mut self, i: usize) {
        let (before, rest) = self.apply.split_at(i);
        if rest[0].started
            || before
                .iter()
                .any(|a| any_overlap(&a.ranges, &rest[0].ranges))
        {
            return;
        }
        if self.apply[i].extents.is_none() {
            let ranges = self.apply[i].ranges.clone();
            let span: u64 = ranges
                .iter()
                .map(|r| {
                    Layout::extent_of(r.end.saturating_sub(1)) - Layout::extent_of(r.start) + 1
                })
                .sum();
            if span > (AL_SLOTS / 2) as u64 {
                // Too big for the activity log (a discard of many GiB, say): its chunks
                // are marked in the bitmap instead, durably before it starts, and stay
                // marked until the next resync copies them.
                let mut gate = 0;
                for r in &ranges {
                    gate = gate.max(self.mark_unmirrored(*r, false));
                }
                let a = &mut self.apply[i];
                a.extents = Some(Vec::new());
                a.gate = a.gate.max(gate);
            }
        }
        if self.apply[i].extents.is_none() {
            let ranges = self.apply[i].ranges.clone();
            match self.al_acquire(&ranges) {
                Some((extents, gate)) => {
                    let a = &mut self.apply[i];
                    a.extents = Some(extents);
                    a.gate = a.gate.max(gate);
                }
                None => return,
            }
        }
        if !self.meta_durable(self.apply[i].gate) {
            return;
        }
        self.start_apply(i);
    }

    /// Start every waiting apply entry and own write that no earlier write blocks.
    fn start_ready(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.apply.len() {
            self.try_start_apply(i);
            i += 1;
        }
        if self.hold_writes || !self.is_current() {
            // (Unproven: nothing lands on the replica before the handshake, the witness
            // or an operator says it is current, and the resync orders it.)
            return self.try_shutdown();
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
            if any_overlap(&blocked, &r) || self.overlaps_apply(&r, self.apply.len()) {
                blocked.push(r[0]);
                idx += 1;
                continue;
            }
            self.pending_own.remove(idx);
            self.start_own_write(now, req);
        }
        self.try_shutdown();
    }

    fn start_own_write(&mut self, now: Instant, req: RequestId) {
        let Some(w) = self.own_writes.get_mut(&req) else {
            return;
        };
        w.started = true;
        let range = Range::new(w.offset, w.payload.len());
        if self.detached {
            // No local copy: the write stands only if the peer takes it (and the peer
            // holds a complete copy).
            w.local = Local::Done(Err(ErrorKind::Io));
            w.failed_alone = self.detached_alone;
        } else {
            self.push_apply(ApplyKind::Own(req), vec![range], 0);
        }
        match self.state {
            LinkState::Connected => self.send_own_write(now, req),
            LinkState::Waiting | LinkState::Handshaking => self.unsent.push_back(req),
            LinkState::Degraded => match self.alone() {
                Alone::Hold => self.unsent.push_back(req),
                Alone::Allowed | Alone::Fail(_) => {
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.remote = Remote::Skipped;
                    }
                }
            },
        }
        self.finish_own_write(now, req);
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

    /// Issue the local I/O of apply entry `i`.
    fn start_apply(&mut self, i: usize) {
        let id = self.apply[i].id;
        let (offset, payload, fua) = match self.apply[i].kind.clone() {
            ApplyKind::Own(req) => match self.own_writes.get_mut(&req) {
                Some(w) => {
                    w.local = Local::Running;
                    (w.offset, w.payload.clone(), w.fua)
                }
                None => return,
            },
            ApplyKind::Peer(pid) => match self.peer_writes.get(&(self.apply[i].epoch, pid)) {
                Some(p) => (p.offset, p.payload.clone(), p.fua),
                None => return,
            },
            ApplyKind::SyncWrite { offset, data } => (offset, WritePayload::Data(data), false),
            ApplyKind::SyncRead { offset, len, .. }
            | ApplyKind::SyncCompare { offset, len, .. } => {
                self.apply[i].started = true;
                self.apply[i].running_ops = 1;
                let op = self.op_id(OpPurpose::Apply(id));
                self.local_io.push_back(LocalIo::Read {
                    op,
                    offset,
                    len,
                    once: true,
                });
                return;
            }
        };
        let trimmed = self.apply[i].keep.is_some();
        let pieces = self.apply[i]
            .keep
            .clone()
            .unwrap_or_else(|| self.apply[i].ranges.clone());
        // A trimmed peer write is acknowledged only once the own writes that won its
        // other parts are in place, and, for FUA, durable: a flush after them (also the
        // one operation when nothing of it is left to write).
        let flush = trimmed && (fua || pieces.is_empty());
        self.apply[i].started = true;
        self.apply[i].running_ops = pieces.len() + usize::from(flush);
        for piece in pieces {
            let sub = slice_payload(&payload, offset, piece);
            let op = self.op_id(OpPurpose::Apply(id));
            self.local_io.push_back(LocalIo::Write {
                op,
                offset: piece.start,
                payload: sub,
                fua,
            });
        }
        if flush {
            let op = self.op_id(OpPurpose::Apply(id));
            self.local_io.push_back(LocalIo::Flush { op });
        }
    }

    /// Ranges of own writes the peer has not acknowledged yet: a peer write (on the
    /// resolver) or resync data (always) must not overwrite them.
    fn unacked_own_ranges(&self) -> Vec<Range> {
        self.own_writes
            .values()
            .filter(|w| matches!(w.remote, Remote::Sent(_)))
            .map(|w| Range::new(w.offset, w.payload.len()))
            .collect()
    }

    fn peer_write(&mut self, now: Instant, id: u64, offset: u64, payload: WritePayload, fua: bool) {
        let range = Range::new(offset, payload.len());
        let bs = u64::from(self.cfg.block_size);
        if payload.is_empty()
            || range.end > self.cfg.size
            || offset % bs != 0
            || payload.len() % bs != 0
        {
            return self.protocol_violation(
                now,
                format!(
                    "write {id} of {} bytes at {offset} is invalid",
                    payload.len()
                ),
            );
        }
        self.last_app_io = now;
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
        // It is acknowledged only after the own writes that won are applied here (and
        // durable, for FUA): acknowledging it at once would let a read here, after the
        // peer's caller saw its write complete, return data older than both.
        let keep = if self.is_resolver() {
            let keep = subtract(range, &self.unacked_own_ranges());
            (keep.len() != 1 || keep[0] != range).then_some(keep)
        } else {
            None
        };
        self.peer_writes.insert(
            (self.link_epoch, id),
            PeerWrite {
                offset,
                payload,
                fua,
            },
        );
        self.push_apply_keeping(ApplyKind::Peer(id), vec![range], 0, keep);
    }

    // ----- local completions -----

    /// The driver finished local operation `op`.
    pub fn handle_local_done(&mut self, now: Instant, op: LocalOpId, result: LocalResult) {
        let Some(purpose) = self.ops.remove(&op) else {
            return;
        };
        if let OpPurpose::Meta = purpose {
            return self.meta_done(now, result);
        }
        if let Err(kind) = &result {
            self.local_failed(now, *kind);
        }
        // Issued before the replica lost data, done after: its result may be gone.
        let suspect = op.0 < self.loss_op_mark;
        match purpose {
            OpPurpose::Meta => {}
            OpPurpose::Apply(id) => {
                let Some(i) = self.apply.iter().position(|a| a.id == id) else {
                    return;
                };
                let entry = &mut self.apply[i];
                entry.running_ops = entry.running_ops.saturating_sub(1);
                entry.suspect |= suspect;
                match result {
                    Err(k) => entry.failed = Some(k),
                    Ok(Some(data)) => entry.data = Some(data),
                    Ok(None) => {}
                }
                if entry.running_ops > 0 {
                    return;
                }
                let entry = self.apply.remove(i);
                if let Some(extents) = &entry.extents {
                    self.al_release(extents);
                }
                let outcome = entry.failed.map_or(Ok(()), Err);
                match entry.kind {
                    ApplyKind::Own(req) => {
                        let alone = outcome.is_err() && self.detached_alone;
                        if let Some(w) = self.own_writes.get_mut(&req) {
                            w.local = Local::Done(outcome);
                            if alone {
                                w.failed_alone = true;
                                if w.remote == Remote::Unsent {
                                    // Not sent yet: it never will be.
                                    w.remote = Remote::Skipped;
                                    self.unsent.retain(|r| *r != req);
                                }
                            }
                        }
                        self.finish_own_write(now, req);
                    }
                    ApplyKind::Peer(pid) => {
                        self.peer_writes.remove(&(entry.epoch, pid));
                        if self.state == LinkState::Connected && entry.epoch == self.link_epoch {
                            self.send(
                                now,
                                Message::WriteAck {
                                    id: pid,
                                    status: status_of(outcome),
                                },
                            );
                        }
                    }
                    kind if entry.epoch == self.link_epoch => {
                        self.sync_apply_done(now, kind, outcome, entry.data, entry.suspect)
                    }
                    // Resync I/O of an earlier link: its data is written (an earlier
                    // copy from that link's source, ordered before anything newer), but
                    // nothing is acknowledged or cleared; the chunk is still marked and
                    // travels again.
                    _ => {}
                }
                self.start_ready(now);
            }
            OpPurpose::OwnFlush(req) => {
                if let Some(f) = self.own_flushes.get_mut(&req) {
                    f.local = Local::Done(result.map(drop));
                }
                self.finish_flush(req);
            }
            OpPurpose::PeerFlush(epoch, id) => {
                if self.state == LinkState::Connected && epoch == self.link_epoch {
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
                    Ok(data) if !suspect && !self.stale(offset, u64::from(len)) => {
                        self.events.push_back(Event::Completed {
                            request: req,
                            result: Ok(data),
                        })
                    }
                    // The replica lost data since the read was issued, or the range is
                    // out of sync now: what it read may be older than what the caller
                    // was acknowledged. The peer serves it; nothing is detached.
                    Ok(_) => self.read_from_peer(now, req, offset, len),
                    // The local replica is detached now: the peer serves the read and the
                    // caller sees no error.
                    Err(_) => self.read_from_peer(now, req, offset, len),
                }
            }
            OpPurpose::PeerRead(epoch, id) => {
                if self.state == LinkState::Connected && epoch == self.link_epoch {
                    let (status, data) = match result {
                        // Read before the replica lost data: it may hold older data.
                        Ok(_) if suspect => (Status::Failed(ErrorKind::Io as u32), Bytes::new()),
                        Ok(d) => (Status::Ok, d.unwrap_or_default()),
                        Err(k) => (Status::Failed(k as u32), Bytes::new()),
                    };
                    self.send(now, Message::ReadReply { id, status, data });
                }
            }
        }
    }

    /// Whether the peer's replica is a complete copy: it reported no failure on this
    /// link, and it is not the target of a resync from this node.
    fn peer_holds_all(&self) -> bool {
        !self.peer_incomplete
            && !matches!(&self.sync, Some(s) if s.role == SyncRole::Source && s.kind != SyncKind::Verify)
    }

    fn local_failed(&mut self, now: Instant, kind: ErrorKind) {
        if !self.detached && !self.meta.failed {
            if self.state == LinkState::Connected && self.peer_holds_all() {
                // Writes from now on reach the peer only: a restart must not trust the
                // replica (its disk may work again, with old data), so it is marked,
                // durably, for a full resync. The peer learns its copy is the only one.
                self.distrust_replica();
                self.send(now, Message::ReplicaDetached);
            } else if !self.meta.sb.inconsistent {
                // Alone, or with a peer that is an unfinished sync target of this node:
                // no complete copy is left, so nothing is served or written until this
                // replica is back; it misses nothing, and it may be the only copy of
                // the newest data. Keep it (see `detached_alone`). (A replica that is
                // not complete itself holds nothing the peer lacks: it is only detached.)
                self.detached_alone = true;
            }
        }
        if !self.detached {
            self.detach(format!(
                "local replica failed ({kind}); serving I/O through the peer"
            ));
        }
        if matches!(&self.sync, Some(s) if s.role == SyncRole::Target) {
            // A detached replica takes no resync data: end this side of the run (the
            // source ends its side on the failed ack), so the operator can attach it.
            self.abort_sync(now, "the local replica failed and is detached");
        }
    }

    /// Detach the local replica on the operator's request: I/O is served through the
    /// peer, which must be connected (nothing else would serve it), with no resync
    /// running.
    pub fn detach_local(&mut self, now: Instant) -> vsan_core::Result<String> {
        if self.detached {
            return Err(refused("the local replica is detached already"));
        }
        if self.state != LinkState::Connected {
            return Err(refused(
                "detaching needs the peer connected: it serves the I/O",
            ));
        }
        if let Some(s) = &self.sync {
            return Err(refused(format!(
                "a {} is running; detach once it ends",
                s.kind
            )));
        }
        let peer = self.cfg.peer_id;
        // Writes from now on reach the peer only: the replica is marked, durably, as
        // needing a full resync, so a restart while detached cannot trust it.
        self.distrust_replica();
        self.send(now, Message::ReplicaDetached);
        self.detach(format!(
            "local replica detached by the operator; I/O is served by node {peer}"
        ));
        Ok(format!(
            "local replica detached; node {peer} serves the I/O; `attach` resyncs it in full"
        ))
    }

    /// Attach a detached local replica again. It missed every write since it was
    /// detached, so it becomes the target of a full checksum resync from the peer at
    /// once (reads of chunks not synced yet go to the peer). Needs the peer connected,
    /// no resync running and working metadata.
    pub fn attach_local(&mut self, now: Instant) -> vsan_core::Result<String> {
        if !self.detached {
            return Err(refused("the local replica is attached"));
        }
        if self.detached_alone {
            // Nothing was written anywhere since it failed: it is taken back as it is.
            self.detached = false;
            self.detached_alone = false;
            info!(disk = %self.cfg.disk_name, "local replica attached again; it missed no write");
            if self.state == LinkState::Connected {
                // A resync to the peer stopped when the replica failed: connect again,
                // and the handshake resumes it.
                self.lose_peer(
                    now,
                    "the local replica is attached again: reconnecting to resume the resync".into(),
                );
            }
            return Ok(
                "local replica attached; no write was accepted while it was detached with the \
                 peer away, so it needs no resync"
                    .into(),
            );
        }
        if self.state != LinkState::Connected {
            return Err(refused(
                "attaching needs the peer connected: the replica is resynced from it",
            ));
        }
        if let Some(s) = &self.sync {
            return Err(refused(format!(
                "a {} is running; attach once it ends",
                s.kind
            )));
        }
        if self.meta.failed {
            return Err(refused(
                "the replica's metadata failed: restart the node to attach it",
            ));
        }
        let peer = self.cfg.peer_id;
        self.detached = false;
        // Nothing the replica did before now is trusted.
        self.distrust_replica();
        self.send(now, Message::SyncRequest);
        self.start_sync(now, SyncRole::Target, true);
        info!(disk = %self.cfg.disk_name, "local replica attached again: resyncing it in full from node {peer}");
        Ok(format!(
            "local replica attached; resyncing every chunk from node {peer} by checksum"
        ))
    }

    /// Trust nothing of the local replica until a full resync has compared it with the
    /// peer's: local operations issued so far do not count, it is marked inconsistent
    /// with every chunk out of sync, durably.
    fn distrust_replica(&mut self) {
        self.loss_op_mark = self.next_op;
        self.meta.sb.inconsistent = true;
        self.meta.dirty_sb = true;
        self.meta.bitmap.set_all();
        self.meta
            .dirty_blocks
            .extend(0..self.meta.layout.bitmap_blocks());
        self.distrust_mgen = self.meta_touch();
    }

    fn detach(&mut self, reason: String) {
        if self.detached {
            return;
        }
        self.detached = true;
        warn!(disk = %self.cfg.disk_name, "{reason}");
        self.events.push_back(Event::LocalDetached { reason });
    }

    /// The local replica lost data it had already acknowledged: its
    /// [`data_loss_count`](vsan_core::BlockDevice::data_loss_count) grew (a write-back
    /// cache whose fast device failed with dirty data on it). Some of its blocks may now
    /// read older data, with no error, and nothing says which, so none of it is trusted
    /// until a resync has compared it with the peer's:
    ///
    /// - connected, no resync running (a verify this node runs is aborted): this replica
    ///   becomes the target of a full checksum resync from the peer at once, on the same
    ///   link ([`Message::SyncRequest`]); reads of chunks not synced yet go to the peer,
    ///   writes go on mirrored, the caller sees no error;
    /// - connected while a resync, or the peer's verify, runs (it cannot be restarted on
    ///   this link): the run is aborted and the replica detached; I/O goes through the
    ///   peer;
    /// - not connected: I/O fails until the peer is back (nothing here can be trusted
    ///   and there is no other copy); the next connection makes this replica the
    ///   target of a full checksum resync;
    /// - already detached: nothing changes.
    ///
    /// In every case but the last the replica is marked inconsistent with every chunk
    /// out of sync, durably (a restart resyncs it too), and [`Event::LocalDataLost`]
    /// says what happened. Local operations issued before this call that complete after
    /// it are not trusted: such a read is served by the peer instead, and resync data
    /// written or compared by one does not count as synced.
    ///
    /// The driver must call this before it hands the endpoint any local completion
    /// that came after the loss.
    pub fn local_data_lost(&mut self, now: Instant) {
        if self.detached {
            warn!(
                disk = %self.cfg.disk_name,
                "local replica reports lost data; it is detached already and serves nothing"
            );
            return;
        }
        self.distrust_replica();
        let peer = self.cfg.peer_id;
        let running = self.sync.as_ref().map(|s| (s.kind, s.role));
        let action = match (self.state, running.map(|(k, _)| k)) {
            // A verify this node runs is only a comparison: the peer has no run of its own,
            // so the verify gives way to the resync this replica needs now (replies of
            // the verify still on the wire are told apart by their verify flag).
            (LinkState::Connected, None | Some(SyncKind::Verify))
                if matches!(running, None | Some((SyncKind::Verify, SyncRole::Source))) =>
            {
                if running.is_some() {
                    self.abort_sync(now, "the local replica lost data; a resync replaces it");
                }
                self.send(now, Message::SyncRequest);
                self.start_sync(now, SyncRole::Target, true);
                format!(
                    "resyncing every chunk from node {peer} by checksum; until a chunk is \
                     synced its reads are served by node {peer}"
                )
            }
            (LinkState::Connected, Some(kind)) => {
                self.abort_sync(now, "the local replica lost data");
                let action = format!(
                    "a {kind} was running, which cannot restart on this link: the local \
                     replica is detached and I/O is served by node {peer}; it stays \
                     inconsistent and is resynced in full once it is attached again"
                );
                self.detach(format!("local replica lost acknowledged data; {action}"));
                action
            }
            _ => {
                if self.state == LinkState::Degraded && !self.handshaking {
                    // Held requests can no longer be served here.
                    self.settle_held(now);
                }
                format!(
                    "node {peer} is not connected: I/O fails until it is (no copy here \
                     can be trusted); the next connection resyncs every chunk from it by \
                     checksum"
                )
            }
        };
        warn!(
            disk = %self.cfg.disk_name,
            "local replica lost data it had acknowledged (a cache device failed?); marked \
             inconsistent with every chunk out of sync: {action}"
        );
        self.events.push_back(Event::LocalDataLost { action });
    }

    fn finish_own_write(&mut self, now: Instant, req: RequestId) {
        let Some((local, remote, range, bits_pending, failed_alone)) =
            self.own_writes.get(&req).and_then(|w| {
                settled(w.local, w.remote).map(|(l, r)| {
                    let range = Range::new(w.offset, w.payload.len());
                    (l, r, range, w.bits_pending, w.failed_alone)
                })
            })
        else {
            return;
        };
        if bits_pending {
            return;
        }
        let mirrored = remote == Some(Status::Ok);
        let result = match local {
            Ok(()) if mirrored => Ok(()),
            // Local replica detached; the peer holds the data. Acknowledged once the
            // metadata says, durably, that the replica is not to be trusted: a restart
            // must not serve this block from it. Failed metadata can never say so.
            Err(k) if mirrored && self.meta.failed => Err(k),
            // The local copy failed with no complete copy on the peer: the peer's copy
            // of this write is not the data (mark the chunks so a resync evens them).
            Err(k) if mirrored && failed_alone => {
                self.mark_unmirrored(range, false);
                Err(k)
            }
            Err(_) if mirrored => {
                if !self.meta_durable(self.distrust_mgen) {
                    let mgen = self.distrust_mgen;
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.bits_pending = true;
                    }
                    self.meta.waiters.push((mgen, MetaWaiter::OwnWrite(req)));
                    return;
                }
                Ok(())
            }
            Err(k) => Err(k),
            // One good copy, on this node: the chunks differ from the peer's until a
            // resync, and the bitmap must say so durably before anyone is told.
            Ok(()) => {
                let verdict = self.alone();
                // An unfinished sync target is no complete copy: a write only it holds
                // is marked (so the resync copies that chunk again) but not acknowledged.
                let incomplete = self.meta.sb.inconsistent;
                let acknowledge = !incomplete
                    && (self.state != LinkState::Connected && verdict == Alone::Allowed
                        || self.state == LinkState::Connected);
                let mgen = self.mark_unmirrored(range, acknowledge);
                if self.meta.failed {
                    Err(ErrorKind::Io)
                } else if !self.meta_durable(mgen) {
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.bits_pending = true;
                    }
                    self.meta.waiters.push((mgen, MetaWaiter::OwnWrite(req)));
                    return;
                } else {
                    match verdict {
                        Alone::Fail(k) if self.state != LinkState::Connected => Err(k),
                        _ if incomplete => Err(ErrorKind::Io),
                        _ => Ok(()),
                    }
                }
            }
        };
        self.own_writes.remove(&req);
        self.events.push_back(Event::Completed {
            request: req,
            result: result.map(|()| None),
        });
        self.maybe_send_hello_now(now);
        self.try_shutdown();
    }

    fn maybe_send_hello_now(&mut self, now: Instant) {
        if self.hello_deferred && self.handshaking {
            self.maybe_send_hello(now);
        }
    }

    fn finish_flush(&mut self, req: RequestId) {
        let Some((local, remote, refused, gen_pending)) =
            self.own_flushes.get(&req).and_then(|f| {
                settled(f.local, f.remote).map(|(l, r)| (l, r, f.refused, f.gen_pending))
            })
        else {
            return;
        };
        if gen_pending {
            return;
        }
        if let Some(k) = refused {
            self.own_flushes.remove(&req);
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(k),
            });
            return;
        }
        if remote.is_none() && local.is_ok() && !self.meta.sb.inconsistent && self.is_current() {
            // Durable here and not (known to be) on the peer: this replica is now
            // ahead of it, as after a write acknowledged alone. Its generation moves
            // on, durably, before the flush is acknowledged, so a restart of both
            // cannot take the peer's copy over this one.
            let mgen = self.move_generation_alone();
            if !self.meta_durable(mgen) {
                if let Some(f) = self.own_flushes.get_mut(&req) {
                    f.gen_pending = true;
                }
                self.meta.waiters.push((mgen, MetaWaiter::OwnFlush(req)));
                return;
            }
        }
        // Durable on a complete copy: this replica if it is not an unfinished sync
        // target, or the peer's if it is not one (of this node) and took everything.
        let local_counts = local.is_ok() && !self.meta.sb.inconsistent;
        let peer_counts = remote == Some(Status::Ok) && self.peer_holds_all();
        let result = match local {
            _ if local_counts || peer_counts => Ok(None),
            Err(k) => Err(k),
            Ok(()) => Err(ErrorKind::Io),
        };
        self.own_flushes.remove(&req);
        self.events.push_back(Event::Completed {
            request: req,
            result,
        });
        self.try_shutdown();
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
                if let Some(x) = self.sync_timeout() {
                    at(x);
                }
            }
            LinkState::Handshaking => {}
            // (Waiting is the unproven start: a proven node is connected or degraded.)
            LinkState::Waiting => {
                if let Some(x) = self.unproven_deadline() {
                    at(x);
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
            self.end_handshake(now);
            self.events.push_back(Event::Refused {
                reason: "handshake timed out".into(),
            });
        }
        match self.state {
            LinkState::Connected => {
                if now >= self.last_rx + self.cfg.peer_timeout {
                    let t = self.cfg.peer_timeout;
                    return self.lose_peer(now, format!("no message from the peer for {t:?}"));
                }
                if let Some(oldest) = self.oldest_unacked()
                    && now >= oldest + self.cfg.peer_timeout
                {
                    let t = self.cfg.peer_timeout;
                    return self.lose_peer(now, format!("no answer from the peer for {t:?}"));
                }
                if now >= self.last_tx + self.cfg.ping_interval {
                    let id = self.next_ping;
                    self.next_ping += 1;
                    self.send(now, Message::Ping { id });
                }
                self.sync_tick(now);
            }
            LinkState::Handshaking => {}
            LinkState::Waiting => self.unproven_tick(now),
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
