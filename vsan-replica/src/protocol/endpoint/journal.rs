//! The metadata journal: the replica's metadata (superblock, activity log, bitmap) as
//! the endpoint keeps it in memory, and how changes to it become durable.
//!
//! Every change is made in memory first and then [`touch`](Journal::touch)ed, which
//! gives it a *metadata generation*; the journal writes everything changed in one batch
//! (the activity log, the bitmap blocks, the superblock last), one batch at a time, and
//! a generation is durable once a batch that started after it finished
//! ([`is_durable`](Journal::is_durable)). What must not happen before a change is
//! durable waits for its generation: an apply entry's `gate`, or a [`MetaWaiter`] that
//! the endpoint runs when the journal releases it.
//!
//! Ordering rules that live here:
//! - the activity log names every extent with a replica write in flight before that
//!   write starts (an apply entry waits for the generation [`al_acquire`](Journal::al_acquire)
//!   returns), and forgets an extent only with a replica flush in the same batch;
//! - bits a resync cleared in memory are persisted only with a replica flush before
//!   them (the data they stood for must be durable first);
//! - the superblock is written last in a batch: it names the state the rest belongs to;
//! - a failed metadata write releases every waiter at once (nothing will be persisted
//!   any more) and the endpoint detaches the replica.
//!
//! Generation ids (of the data, not of the journal) are made here too: a node that goes
//! on without its peer moves to a new one, and a finished resync retires the old one.

use std::collections::BTreeSet;
use std::time::Instant;

use bytes::Bytes;
use tracing::{info, warn};
use vsan_core::ErrorKind;

use super::{Endpoint, Event, Lifecycle, LinkState, LocalIo, LocalResult, OpPurpose, RequestId};
use crate::meta::{
    AL_EXTENT_SIZE, AL_SLOTS, Bitmap, Layout, Loaded, META_BLOCK, Superblock, encode_al,
};
use crate::protocol::fastmap::FastMap;
use crate::protocol::message::{GEN_JUST_CREATED, Generations, Message, Status};
use crate::protocol::ranges::Range;

/// The activity-log extents one write holds: nearly always one, two where it crosses
/// an extent's end, kept inline.
pub(super) type Extents = smallvec::SmallVec<[u64; 2]>;

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

/// Something that waits for a metadata generation to be durable, run by the endpoint
/// when the journal releases it.
#[derive(Debug, Clone, Copy)]
pub(super) enum MetaWaiter {
    /// An own write completes once its bits (and generation) are durable.
    OwnWrite(RequestId),
    /// An own flush completed without the peer: once its new generation is durable.
    OwnFlush(RequestId),
    /// The target's answer to a resync checkpoint.
    CheckpointAck(u64),
    /// A finished resync's `SyncDone` for the target, on link `epoch` (then the grant
    /// goes back to the witness).
    SyncDone {
        epoch: u64,
        generations: Generations,
    },
    /// `ReplicaDetached` for the peer on link `epoch` (after a `SyncDone`).
    ReplicaDetached { epoch: u64 },
    /// The clean-shutdown state is durable.
    Shutdown,
}

/// A batch of metadata writes for the driver.
pub(super) struct Batch {
    /// `(offset in the metadata area, bytes)`.
    pub(super) writes: Vec<(u64, Bytes)>,
    /// Flush the replica before writing.
    pub(super) flush_data: bool,
}

/// The metadata as the endpoint keeps it, and what of it still has to be written.
#[derive(Debug, Clone)]
pub(super) struct Journal {
    layout: Layout,
    sb: Superblock,
    al_seq: u64,
    al: FastMap<u64, AlSlot>,
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
    /// The generation of the batch being written.
    inflight: Option<u64>,
    failed: bool,
    /// Deferred replies, sent once `persisted` reaches the generation.
    waiters: Vec<(u64, MetaWaiter)>,
    /// The generation-id generator's state.
    rng: u64,
}

impl Journal {
    /// The journal over the metadata `loaded` from the replica.
    ///
    /// When the metadata says the node did not shut down cleanly, the extents of its
    /// activity log are marked out of sync (they may differ from the peer's). The first
    /// batch marks the metadata "in use" (not clean).
    pub(super) fn open(loaded: Loaded, disk_name: &str, seed: u64) -> Journal {
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
                disk = %disk_name,
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
        Journal {
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
            rng: seed ^ 0x9e37_79b9_7f4a_7c15,
        }
    }

    // ----- reading -----

    /// The replica's layout (chunk size, areas).
    pub(super) fn layout(&self) -> Layout {
        self.layout
    }

    /// The out-of-sync bitmap as it stands in memory.
    pub(super) fn bitmap(&self) -> &Bitmap {
        &self.bitmap
    }

    /// The replica's generation ids.
    pub(super) fn generations(&self) -> Generations {
        self.sb.generations
    }

    /// An unfinished sync target: its data is not usable alone.
    pub(super) fn is_inconsistent(&self) -> bool {
        self.sb.inconsistent
    }

    /// The node crashed with writes in flight, as the superblock says.
    pub(super) fn crashed(&self) -> bool {
        self.sb.crashed
    }

    /// Writing the metadata failed: nothing will be persisted any more.
    pub(super) fn failed(&self) -> bool {
        self.failed
    }

    /// The newest generation: everything changed so far is durable once it is.
    pub(super) fn latest(&self) -> u64 {
        self.requested
    }

    /// Whether generation `mgen` is durable.
    pub(super) fn is_durable(&self, mgen: u64) -> bool {
        self.persisted >= mgen
    }

    /// Whether a waiter `pred` picks is still waiting.
    pub(super) fn is_waiting(&self, pred: impl Fn(&MetaWaiter) -> bool) -> bool {
        self.waiters.iter().any(|(_, w)| pred(w))
    }

    // ----- changes (in memory; `touch` gives the generation that makes them durable) -----

    /// A change was made in memory; returns the generation that makes it durable.
    pub(super) fn touch(&mut self) -> u64 {
        self.requested += 1;
        self.requested
    }

    /// Run `waiter` once generation `mgen` is durable.
    pub(super) fn wait(&mut self, mgen: u64, waiter: MetaWaiter) {
        self.waiters.push((mgen, waiter));
    }

    /// Mark or unmark the replica as an unfinished sync target.
    pub(super) fn set_inconsistent(&mut self, inconsistent: bool) {
        self.sb.inconsistent = inconsistent;
        self.dirty_sb = true;
    }

    /// The replicas were compared in full (a handshake in sync, a finished resync):
    /// forget the crash.
    pub(super) fn clear_crashed(&mut self) {
        self.sb.crashed = false;
        self.dirty_sb = true;
    }

    /// Mark chunk `c` out of sync; false if it was marked already.
    pub(super) fn mark(&mut self, c: u64) -> bool {
        if !self.bitmap.set(c) {
            return false;
        }
        let b = Bitmap::block_of(c);
        if self.cleared_blocks.contains(&b) {
            self.flush_data = true;
        }
        self.dirty_blocks.insert(b);
        true
    }

    /// Mark every chunk out of sync.
    pub(super) fn mark_all(&mut self) {
        self.bitmap.set_all();
        self.dirty_blocks.extend(0..self.layout.bitmap_blocks());
    }

    /// Clear chunk `c`'s bit, durably with the next batch (the source's side of a
    /// checkpoint); false if it was clear.
    pub(super) fn clear(&mut self, c: u64) -> bool {
        if !self.bitmap.clear(c) {
            return false;
        }
        self.dirty_blocks.insert(Bitmap::block_of(c));
        true
    }

    /// Clear chunk `c`'s bit in memory only (a sync target's chunk that holds the
    /// source's data now): it is persisted at the next checkpoint, after a flush. False
    /// if it was clear.
    pub(super) fn clear_until_checkpoint(&mut self, c: u64) -> bool {
        if !self.bitmap.clear(c) {
            return false;
        }
        self.cleared_blocks.insert(Bitmap::block_of(c));
        true
    }

    /// Persist the bits cleared in memory with the next batch, after a replica flush.
    pub(super) fn persist_cleared(&mut self) {
        let cleared = std::mem::take(&mut self.cleared_blocks);
        self.dirty_blocks.extend(cleared);
        self.flush_data = true;
    }

    /// A sync target that finished takes the source's generations and is consistent,
    /// uncrashed and in sync, with what it received flushed before that is durable.
    pub(super) fn finish_as_target(&mut self, generations: Generations) {
        self.sb.generations = generations;
        self.sb.inconsistent = false;
        self.sb.crashed = false;
        self.dirty_sb = true;
        if self.bitmap.count() > 0 {
            self.bitmap = Bitmap::new(self.layout.chunks());
            self.dirty_blocks.extend(0..self.layout.bitmap_blocks());
        }
        self.persist_cleared();
    }

    /// A sync source that finished: the bitmap generation goes to history (the
    /// replicas are one again), a just-created replica gets its first generation, the
    /// crash is forgotten.
    pub(super) fn finish_as_source(&mut self) {
        let g = &mut self.sb.generations;
        if g.bitmap != 0 {
            g.history = [g.bitmap, g.history[0]];
            g.bitmap = 0;
        }
        if g.current == GEN_JUST_CREATED {
            self.sb.generations.current = self.random_generation();
        }
        self.clear_crashed();
    }

    /// Whether this replica has moved to its own generation since it was last in sync.
    pub(super) fn went_on_alone(&self) -> bool {
        self.sb.generations.bitmap != 0
    }

    /// This replica goes on without the peer: a new generation (once per separation),
    /// the old one kept as the bitmap generation.
    pub(super) fn new_generation_alone(&mut self, disk_name: &str) {
        let g = &mut self.sb.generations;
        g.bitmap = g.current;
        let new = self.random_generation();
        self.sb.generations.current = new;
        info!(
            disk = %disk_name,
            "first acknowledgement without the peer: new generation {new:016x} (bitmap generation {:016x})",
            self.sb.generations.bitmap
        );
        self.dirty_sb = true;
    }

    fn random_generation(&mut self) -> u64 {
        // splitmix64: deterministic for a given seed; never 0 or "just created", and
        // never one this replica already has (a node restarted with the seed it had
        // before would otherwise make the same "new" generation again, and its writes
        // alone would look like no change at all).
        let g = self.sb.generations;
        loop {
            self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.rng;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z > GEN_JUST_CREATED && z != g.current && z != g.bitmap && !g.history.contains(&z) {
                return z;
            }
        }
    }

    /// Take activity-log slots for `ranges`; `None` when the log is full of extents
    /// with writes in flight. Returns the extents and the generation that makes them
    /// durable.
    pub(super) fn al_acquire(&mut self, ranges: &[Range]) -> Option<(Extents, u64)> {
        let mut extents = Extents::new();
        for r in ranges {
            let first = Layout::extent_of(r.start);
            let last = Layout::extent_of(r.end.saturating_sub(1).max(r.start));
            for e in first..=last {
                if !extents.contains(&e) {
                    extents.push(e);
                }
            }
        }
        let missing = extents.iter().filter(|e| !self.al.contains_key(e)).count();
        let free = AL_SLOTS.saturating_sub(self.al.len());
        if missing > free {
            let mut idle: Vec<(u64, u64)> = self
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
                self.al.remove(&e);
            }
            // The log forgets these extents: their writes must be durable first.
            self.flush_data = true;
            self.dirty_al = true;
        }
        let mut gate = 0;
        let mut added = false;
        self.tick += 1;
        let tick = self.tick;
        let next = self.requested + 1;
        for e in &extents {
            let slot = self.al.entry(*e).or_insert_with(|| {
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
        if added || self.dirty_al {
            self.dirty_al = true;
            let g = self.touch();
            gate = gate.max(g);
        }
        Some((extents, gate))
    }

    /// The writes holding `extents` finished.
    pub(super) fn al_release(&mut self, extents: &[u64]) {
        for e in extents {
            if let Some(s) = self.al.get_mut(e) {
                s.users = s.users.saturating_sub(1);
            }
        }
    }

    /// The clean-shutdown state in memory: an empty activity log (after a replica
    /// flush, which also lets the bits a resync cleared be persisted) and the clean
    /// flag. Returns the generation that makes it durable.
    pub(super) fn mark_clean(&mut self) -> u64 {
        self.al.clear();
        self.dirty_al = true;
        self.sb.clean_shutdown = true;
        self.dirty_sb = true;
        // Bits cleared in memory by a resync are persisted only after a flush: the
        // flush this sets is that flush.
        self.persist_cleared();
        self.touch()
    }

    // ----- writing -----

    /// The next batch to write, unless one is being written or nothing waits for one.
    /// The caller hands it to the driver and reports with [`written`](Self::written).
    pub(super) fn next_batch(&mut self) -> Option<Batch> {
        if self.inflight.is_some() || self.persisted >= self.requested {
            return None;
        }
        if !(self.dirty_sb || self.dirty_al || !self.dirty_blocks.is_empty() || self.flush_data) {
            // Nothing left to write: what was asked for is durable already.
            self.persisted = self.requested;
            return None;
        }
        let mgen = self.requested;
        let mut writes = Vec::new();
        let layout = self.layout;
        if self.dirty_al {
            self.al_seq += 1;
            let mut extents: Vec<u64> = self.al.keys().copied().collect();
            extents.sort_unstable();
            writes.push((
                layout.al_offset(self.al_seq),
                encode_al(&layout, self.al_seq, &extents),
            ));
        }
        for b in std::mem::take(&mut self.dirty_blocks) {
            // A block with bits a resync cleared in memory: the data those bits stood
            // for must be durable before the cleared bits are.
            if self.cleared_blocks.remove(&b) {
                self.flush_data = true;
            }
            writes.push((
                layout.bitmap_offset() + (b * META_BLOCK) as u64,
                self.bitmap.block_bytes(b),
            ));
        }
        // The superblock last: it is what names the state the rest belongs to.
        if self.dirty_sb {
            self.sb.seq += 1;
            writes.push((layout.superblock_offset(self.sb.seq), self.sb.encode()));
        }
        let flush_data = self.flush_data;
        self.dirty_sb = false;
        self.dirty_al = false;
        self.flush_data = false;
        self.inflight = Some(mgen);
        Some(Batch { writes, flush_data })
    }

    /// The batch being written finished (`ok` false: it failed, and nothing will be
    /// persisted any more, so every waiter is released). False if none was in flight.
    pub(super) fn written(&mut self, ok: bool) -> bool {
        let Some(mgen) = self.inflight.take() else {
            return false;
        };
        if ok {
            self.persisted = self.persisted.max(mgen);
        } else {
            self.failed = true;
            self.persisted = u64::MAX;
        }
        true
    }

    /// The waiters whose generation is durable, in the order they were added.
    pub(super) fn take_ready(&mut self) -> Vec<MetaWaiter> {
        let persisted = self.persisted;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|(g, _)| *g <= persisted);
        self.waiters = waiting;
        ready.into_iter().map(|(_, w)| w).collect()
    }
}

impl Endpoint {
    /// Hand the driver the next metadata batch, if one is due.
    pub(super) fn issue_meta(&mut self) {
        let Some(batch) = self.journal.next_batch() else {
            return;
        };
        let op = self.op_id(OpPurpose::Meta);
        self.local_io.push_back(LocalIo::Meta {
            op,
            writes: batch.writes,
            flush_data: batch.flush_data,
        });
    }

    /// The metadata batch finished: run what waited for it.
    pub(super) fn meta_done(&mut self, now: Instant, result: LocalResult) {
        let was_failed = self.journal.failed();
        if !self.journal.written(result.is_ok()) {
            return;
        }
        if let Err(kind) = result {
            if !was_failed {
                warn!(disk = %self.cfg.disk_name, "metadata write failed ({kind}): detaching the local replica");
            }
            self.local_failed(now, kind);
        }
        for w in self.journal.take_ready() {
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
                    self.maybe_send_hello(now);
                }
                MetaWaiter::CheckpointAck(id) => {
                    if self.state == LinkState::Connected {
                        let status = if self.journal.failed() {
                            Status::Failed(ErrorKind::Io as u32)
                        } else {
                            Status::Ok
                        };
                        self.send(now, Message::SyncCheckpointAck { id, status });
                    }
                }
                MetaWaiter::SyncDone { epoch, generations } => {
                    if self.journal.failed() {
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
                    if !self.journal.failed()
                        && self.state == LinkState::Connected
                        && epoch == self.link_epoch
                    {
                        self.send(now, Message::ReplicaDetached);
                    }
                }
                MetaWaiter::Shutdown => self.lifecycle = Lifecycle::ShutDown,
            }
        }
        self.start_ready(now);
    }

    /// Mark the chunks of `range` out of sync; with `acknowledge`, the write will be
    /// acknowledged without the peer, so this replica moves to a new generation first
    /// (once per disconnect). Returns the metadata generation to wait for.
    pub(super) fn mark_unmirrored(&mut self, range: Range, acknowledge: bool) -> u64 {
        let mut changed = false;
        for c in self.journal.layout().chunks_of(range.start, range.len()) {
            self.sync_remarked(c);
            if self.journal.mark(c) {
                changed = true;
            }
        }
        if acknowledge && !self.journal.went_on_alone() {
            self.journal.new_generation_alone(&self.cfg.disk_name);
            changed = true;
        }
        if changed {
            self.journal.touch();
        }
        // Anything already queued or in flight may hold these bits: wait for all of it.
        self.journal.latest()
    }

    /// As [`Self::mark_unmirrored`] for a flush completed alone: a new generation if
    /// this separation has none yet. Returns the metadata generation to wait for.
    pub(super) fn move_generation_alone(&mut self) -> u64 {
        if !self.journal.went_on_alone() {
            self.journal.new_generation_alone(&self.cfg.disk_name);
            self.journal.touch();
        }
        self.journal.latest()
    }

    /// Whether writing the metadata failed: the local replica is detached, reads go
    /// through the peer, and writes fail until a restart (nothing durable could say
    /// which blocks the replica misses).
    pub fn meta_failed(&self) -> bool {
        self.journal.failed()
    }
}
