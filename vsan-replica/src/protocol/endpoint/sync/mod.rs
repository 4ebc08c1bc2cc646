//! Resync and online verify: the part of the [`Endpoint`] that copies out-of-sync
//! chunks from the sync source to the target while both keep serving I/O.
//!
//! ## How a chunk travels
//! The source reads the chunk through the apply list, so the read waits for every
//! earlier overlapping write and later overlapping own writes wait for the read: the
//! data it sends holds every write the peer will see before it (the link is FIFO) and
//! none it will see after. The target writes it through the apply list too, except
//! where one of its own writes has not been acknowledged by the source yet (the source
//! read the chunk before applying that write, which is newer): those bytes are kept.
//! Reads on the target for chunks not yet synced go to the source.
//!
//! In a checksum resync (full syncs) and an online verify the source sends the
//! chunk's crc32 first; the target compares it with its own and only a differing
//! chunk's data travels.
//!
//! ## Progress that survives
//! The source clears a chunk's bit only after a checkpoint: it asks the target to
//! flush what it wrote and persist its cleared bits, and on the answer persists its own.
//! An interrupted resync therefore resumes from the last checkpoint, on either side.
//! When no bit is left, the source moves its bitmap generation to history and sends
//! its generations; the target takes them and is consistent again.
//!
//! ## A replica that lost data
//! A node whose replica lost acknowledged data while connected and in sync sends
//! `SyncRequest` and then its bitmap (every chunk) as a checksum target; the peer aborts
//! whatever it runs (a verify) and starts a full checksum resync as the source. Replies
//! of the aborted run still on the wire cannot be mistaken for the new run's: crc
//! replies carry the verify flag, checkpoint ids go on counting, and a data ack can only
//! arrive before the new run asks for that chunk's data (the target answers in its apply
//! order). A target fails resync data only when its replica is detached, so a failed
//! ack ends the run instead of retrying it forever.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{info, warn};
use vsan_core::ErrorKind;

use super::{
    ApplyKind, Endpoint, Event, LinkState, MetaWaiter, PeerCopy, Replica, ResyncRate, refused,
};
use crate::protocol::message::Message;

mod source;
mod target;

/// Which end of a resync this node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncRole {
    /// Sends data (or, for verify, starts the comparison).
    Source,
    /// Receives data.
    Target,
}

/// What kind of pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncKind {
    /// Copy the chunks both bitmaps mark.
    Bitmap,
    /// Full sync: compare every chunk by crc, copy the ones that differ.
    Checksum,
    /// Online verify: compare every chunk by crc while in sync, repair mismatches from
    /// the node that started it.
    Verify,
}

impl std::fmt::Display for SyncKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SyncKind::Bitmap => "resync",
            SyncKind::Checksum => "checksum resync",
            SyncKind::Verify => "verify",
        })
    }
}

/// Where a running resync or verify stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncProgress {
    /// This node's role.
    pub role: SyncRole,
    /// The kind of pass.
    pub kind: SyncKind,
    /// Bytes the pass goes through.
    pub total_bytes: u64,
    /// Bytes done.
    pub done_bytes: u64,
    /// Data bytes sent (source) or received (target) so far.
    pub transferred_bytes: u64,
    /// Since the pass started.
    pub elapsed: Duration,
    /// Bytes done per second so far.
    pub rate: u64,
    /// Estimated time left at that rate.
    pub eta: Option<Duration>,
    /// Verify: chunks found different so far.
    pub mismatches: u64,
}

impl SyncProgress {
    /// Bytes left.
    pub fn remaining_bytes(&self) -> u64 {
        self.total_bytes.saturating_sub(self.done_bytes)
    }

    /// Done, in percent.
    pub fn percent(&self) -> f64 {
        if self.total_bytes == 0 {
            100.0
        } else {
            self.done_bytes as f64 * 100.0 / self.total_bytes as f64
        }
    }
}

/// How a resync or verify ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncSummary {
    /// This node's role.
    pub role: SyncRole,
    /// The kind of pass.
    pub kind: SyncKind,
    /// Ran to the end (false: interrupted; it resumes on the next connection).
    pub completed: bool,
    /// Bytes the pass went through.
    pub total_bytes: u64,
    /// Bytes done.
    pub done_bytes: u64,
    /// Data bytes sent (source) or received (target).
    pub transferred_bytes: u64,
    /// Chunks found different (verify and checksum resync).
    pub mismatches: u64,
    /// How long it ran.
    pub elapsed: Duration,
}

/// What a resync read is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::protocol) enum ReadMode {
    Data,
    Crc,
    Verify,
}

#[derive(Debug, Clone)]
pub(in crate::protocol) struct SyncRun {
    pub(super) role: SyncRole,
    pub(super) kind: SyncKind,
    started: Instant,
    got_peer_bitmap: bool,
    /// Target: metadata generation (inconsistent flag, merged bitmap) to be durable
    /// before resync data is written.
    gate: u64,
    cursor: u64,
    inflight: HashSet<u64>,
    /// Source: data transfers in flight, first chunk -> chunks (adjacent dirty chunks
    /// travel together).
    runs: HashMap<u64, u64>,
    /// Source: chunks done since the last checkpoint was sent.
    acked: Vec<u64>,
    /// Source: acked or in the running checkpoint (bits still set until it is durable).
    pending_clear: HashSet<u64>,
    checkpoint: Option<(u64, Vec<u64>)>,
    next_checkpoint: u64,
    /// The first checkpoint id of this run: acks of lower ids belong to a run this one
    /// replaced on the same link, and are ignored.
    first_checkpoint: u64,
    last_checkpoint: Instant,
    total_bytes: u64,
    done_bytes: u64,
    transferred_bytes: u64,
    mismatches: u64,
    budget: f64,
    last_refill: Instant,
    /// When the pump last ran (see `sync_timeout`).
    pumped: Instant,
}

impl SyncRun {
    /// Whether the peer's bitmap arrived (until then a target knows only its own marks).
    pub(super) fn got_peer_bitmap(&self) -> bool {
        self.got_peer_bitmap
    }

    fn new(role: SyncRole, kind: SyncKind, now: Instant) -> SyncRun {
        SyncRun {
            role,
            kind,
            started: now,
            got_peer_bitmap: false,
            gate: 0,
            cursor: 0,
            inflight: HashSet::new(),
            runs: HashMap::new(),
            acked: Vec::new(),
            pending_clear: HashSet::new(),
            checkpoint: None,
            next_checkpoint: 1,
            first_checkpoint: 1,
            last_checkpoint: now,
            total_bytes: 0,
            done_bytes: 0,
            transferred_bytes: 0,
            mismatches: 0,
            budget: 0.0,
            last_refill: now,
            pumped: now,
        }
    }

    /// Where the pass stands (`None` until the peer's bitmap arrived and the amount of
    /// work is known).
    fn progress(&self, now: Instant) -> Option<SyncProgress> {
        if !self.got_peer_bitmap {
            return None;
        }
        let elapsed = now.saturating_duration_since(self.started);
        let secs = elapsed.as_secs_f64();
        let rate = if secs > 0.0 {
            (self.done_bytes as f64 / secs) as u64
        } else {
            0
        };
        let left = self.total_bytes.saturating_sub(self.done_bytes);
        let eta = (rate > 0).then(|| Duration::from_secs_f64(left as f64 / rate as f64));
        Some(SyncProgress {
            role: self.role,
            kind: self.kind,
            total_bytes: self.total_bytes,
            done_bytes: self.done_bytes,
            transferred_bytes: self.transferred_bytes,
            elapsed,
            rate,
            eta,
            mismatches: self.mismatches,
        })
    }

    fn summary(&self, now: Instant, completed: bool) -> SyncSummary {
        SyncSummary {
            role: self.role,
            kind: self.kind,
            completed,
            total_bytes: self.total_bytes,
            done_bytes: self.done_bytes,
            transferred_bytes: self.transferred_bytes,
            mismatches: self.mismatches,
            elapsed: now.saturating_duration_since(self.started),
        }
    }
}

/// Adjacent dirty chunks sent in one message at most (bitmap resync while the
/// application is quiet).
const MAX_RUN: u64 = 16;

/// App I/O this recent makes a dynamic-rate resync yield.
const APP_QUIET: Duration = Duration::from_millis(5);

/// How soon the sync pump looks again at a deadline it could not act on.
const SYNC_RETRY: Duration = Duration::from_millis(1);

impl Endpoint {
    /// Where the running resync or verify stands, if one runs.
    /// (`None` until both bitmaps are exchanged and the amount of work is known.)
    pub fn sync_progress(&self, now: Instant) -> Option<SyncProgress> {
        self.sync.as_ref().and_then(|s| s.progress(now))
    }

    /// How the last resync or verify ended.
    pub fn last_sync(&self) -> Option<SyncSummary> {
        self.last_sync
    }

    /// Start an online verify from this node: every chunk's crc is compared with the
    /// peer's while the disk stays in use; chunks that differ are marked out of sync
    /// and copied from this node. Fails when not connected or a resync runs.
    pub fn start_verify(&mut self, now: Instant) -> vsan_core::Result<()> {
        if self.state != LinkState::Connected {
            return Err(refused("verify needs a connected peer"));
        }
        if let Some(s) = &self.sync {
            return Err(refused(format!("a {} is running", s.kind)));
        }
        let mut run = SyncRun::new(SyncRole::Source, SyncKind::Verify, now);
        run.got_peer_bitmap = true;
        run.total_bytes = self.cfg.size;
        info!(disk = %self.cfg.disk_name, "online verify started ({} bytes)", self.cfg.size);
        self.events.push_back(Event::SyncStarted {
            role: SyncRole::Source,
            kind: SyncKind::Verify,
            total_bytes: run.total_bytes,
        });
        self.sync = Some(run);
        self.sync_pump(now);
        Ok(())
    }

    /// Stop the online verify this node runs. Chunks it found different stay marked
    /// out of sync (their copy may have been cut short) and are copied at the next
    /// resync; replies still on the wire are ignored.
    pub fn cancel_verify(&mut self, now: Instant) -> vsan_core::Result<String> {
        match &self.sync {
            Some(s) if s.kind == SyncKind::Verify && s.role == SyncRole::Source => {
                let (done, total) = (s.done_bytes, s.total_bytes);
                self.abort_sync(now, "cancelled by the operator");
                Ok(format!(
                    "online verify cancelled after {done} of {total} bytes"
                ))
            }
            Some(s) => Err(refused(format!(
                "no verify from this node runs (a {} runs as {:?})",
                s.kind, s.role
            ))),
            None => Err(refused("no verify from this node runs")),
        }
    }

    /// Change the resync rate, effective for the running pass too.
    pub fn set_resync_rate(&mut self, now: Instant, rate: ResyncRate) -> String {
        self.cfg.resync.rate = rate;
        info!(disk = %self.cfg.disk_name, ?rate, "resync rate changed");
        self.sync_pump(now);
        match rate {
            ResyncRate::Fixed(r) => format!("resync rate set to {r} bytes/s"),
            ResyncRate::Dynamic { .. } => "resync rate set to dynamic".into(),
        }
    }

    pub(super) fn start_sync(&mut self, now: Instant, role: SyncRole, full: bool) {
        let kind = if full {
            SyncKind::Checksum
        } else {
            SyncKind::Bitmap
        };
        if full {
            self.journal.mark_all();
        }
        if role == SyncRole::Target && !self.journal.is_inconsistent() {
            self.journal.set_inconsistent(true);
        }
        self.journal.touch();
        let runs = self.journal.bitmap().runs();
        self.send(now, Message::SyncBitmap { runs });
        info!(disk = %self.cfg.disk_name, "{kind} starting as {role:?}; {} chunks marked here", self.journal.bitmap().count());
        self.sync = Some(SyncRun::new(role, kind, now));
    }

    pub(super) fn abort_sync(&mut self, now: Instant, why: &str) {
        let Some(s) = self.sync.take() else {
            return;
        };
        let summary = s.summary(now, false);
        warn!(
            disk = %self.cfg.disk_name,
            "{} interrupted ({why}) after {} of {} bytes; it resumes on the next connection",
            s.kind, s.done_bytes, s.total_bytes
        );
        if s.role == SyncRole::Target && !s.got_peer_bitmap() {
            // The source's marks (what it wrote while apart) never arrived: any chunk
            // may be older here, now and after a restart. All of them are marked, so
            // nothing is served from this replica alone and the next run compares
            // every chunk by checksum.
            self.journal.mark_all();
            self.journal.touch();
        }
        self.last_sync = Some(summary);
        self.events.push_back(Event::SyncEnded(summary));
    }

    pub(super) fn sync_message(&mut self, now: Instant, msg: Message) {
        match msg {
            Message::SyncBitmap { runs } => self.on_peer_bitmap(now, runs),
            Message::SyncData { offset, data } => self.on_sync_data(now, offset, data),
            Message::SyncAck { offset, status } => self.on_sync_ack(now, offset, status),
            Message::SyncCrc {
                offset,
                len,
                crc,
                verify,
            } => self.on_sync_crc(now, offset, len, crc, verify),
            Message::SyncCrcReply {
                offset,
                equal,
                verify,
            } => self.on_sync_crc_reply(now, offset, equal, verify),
            Message::SyncCheckpoint { id } => self.on_sync_checkpoint(id),
            Message::SyncCheckpointAck { id, status } => {
                self.on_sync_checkpoint_ack(now, id, status)
            }
            Message::SyncDone { generations } => self.on_sync_done(now, generations),
            Message::SyncRequest => self.sync_requested(now),
            _ => {}
        }
    }

    /// The peer's bitmap: its marks join this node's, and the pass knows its work.
    pub(super) fn on_peer_bitmap(&mut self, now: Instant, runs: Vec<(u64, u64)>) {
        let chunks = self.journal.layout().chunks();
        if runs.iter().any(|(f, n)| f.saturating_add(*n) > chunks) {
            return self.protocol_violation(now, "bitmap runs past the disk".into());
        }
        let Some(s) = self.sync.as_ref() else {
            return self.protocol_violation(now, "bitmap without a resync".into());
        };
        if s.got_peer_bitmap {
            return self.protocol_violation(now, "second bitmap".into());
        }
        let mut changed = false;
        for (first, count) in &runs {
            for c in *first..first + count {
                if self.journal.mark(c) {
                    changed = true;
                }
            }
        }
        let gate = if changed {
            self.journal.touch()
        } else {
            self.journal.latest()
        };
        let count = self.journal.bitmap().count();
        let total = (count * self.journal.layout().chunk_size()).min(self.cfg.size);
        let Some(s) = self.sync.as_mut() else { return };
        s.got_peer_bitmap = true;
        s.gate = gate;
        s.total_bytes = total;
        let (role, kind) = (s.role, s.kind);
        info!(disk = %self.cfg.disk_name, "{kind} as {role:?}: {count} chunks ({total} bytes) to go through");
        self.events.push_back(Event::SyncStarted {
            role,
            kind,
            total_bytes: total,
        });
        self.sync_pump(now);
    }

    /// A resync read, write or compare finished on the local replica. `suspect`: it was
    /// issued before the replica lost data, so what it wrote or read may be gone.
    pub(super) fn sync_apply_done(
        &mut self,
        now: Instant,
        kind: ApplyKind,
        outcome: Result<(), ErrorKind>,
        data: Option<Bytes>,
        suspect: bool,
    ) {
        let connected = self.state == LinkState::Connected;
        match kind {
            ApplyKind::SyncWrite { offset, data } => {
                // A suspect write may be lost: its chunks stay marked, and the checksum
                // pass that follows compares them again.
                if outcome.is_ok() && !suspect {
                    self.clear_synced_range(offset, data.len() as u64);
                }
                if connected {
                    self.send(
                        now,
                        Message::SyncAck {
                            offset,
                            status: super::status_of(outcome),
                        },
                    );
                }
            }
            ApplyKind::SyncRead { offset, len, mode } => {
                if suspect {
                    // Issued before this replica lost data: what it read is not sent. A
                    // loss ends every run this node is the source of (it detaches, or
                    // its verify gives way to a resync it is the target of).
                    return;
                }
                let Some(chunk) = self.chunk_of(offset) else {
                    return;
                };
                let data = match (outcome, data) {
                    (Ok(()), Some(d)) if d.len() == len as usize && !suspect => d,
                    _ => {
                        if let Some(s) = self.sync.as_mut() {
                            let n = s.runs.remove(&chunk).unwrap_or(1);
                            for c in chunk..chunk + n {
                                s.inflight.remove(&c);
                            }
                        }
                        return self.abort_sync(now, "reading the local replica failed");
                    }
                };
                if !connected || self.sync.is_none() {
                    return;
                }
                let msg = match mode {
                    ReadMode::Data => {
                        if let Some(s) = self.sync.as_mut() {
                            s.transferred_bytes += data.len() as u64;
                        }
                        Message::SyncData { offset, data }
                    }
                    ReadMode::Crc | ReadMode::Verify => Message::SyncCrc {
                        offset,
                        len,
                        crc: crc32fast::hash(&data),
                        verify: mode == ReadMode::Verify,
                    },
                };
                self.send(now, msg);
            }
            ApplyKind::SyncCompare {
                offset,
                crc,
                verify,
                ..
            } => {
                let Some(chunk) = self.chunk_of(offset) else {
                    return;
                };
                let equal =
                    outcome.is_ok() && !suspect && data.is_some_and(|d| crc32fast::hash(&d) == crc);
                if !verify && equal {
                    self.clear_synced(chunk);
                }
                if verify && !equal && self.journal.mark(chunk) {
                    self.journal.touch();
                }
                if connected {
                    self.send(
                        now,
                        Message::SyncCrcReply {
                            offset,
                            equal,
                            verify,
                        },
                    );
                }
            }
            ApplyKind::Own(_) | ApplyKind::Peer(_) => {}
        }
    }

    /// When the sync wants a timer: the rate budget refilling, the next checkpoint,
    /// the application going quiet (dynamic rate).
    pub(super) fn sync_timeout(&self) -> Option<Instant> {
        let s = self.sync.as_ref()?;
        if s.role != SyncRole::Source || !s.got_peer_bitmap {
            return None;
        }
        let mut t = s.last_checkpoint + self.cfg.resync.checkpoint_interval;
        let cap = self.sync_cap();
        if cap > 0 {
            let need = (self.journal.layout().chunk_size() as f64 - s.budget).max(0.0);
            t = t.min(s.last_refill + Duration::from_secs_f64(need / cap as f64));
        }
        if matches!(self.cfg.resync.rate, ResyncRate::Dynamic { .. }) {
            t = t.min(self.last_app_io + APP_QUIET);
        }
        // A deadline the pump already ran at (or after) and could not act on (the window
        // is full, a checkpoint waits for its ack, the peer went silent) stays in the
        // past until something else happens: waking at once would spin. Look again a
        // little later instead.
        Some(t.max(s.pumped + SYNC_RETRY))
    }

    /// Chunk `c` was marked again (a write the peer does not hold) while this node is
    /// the source: a copy acknowledged before no longer makes it equal, so no checkpoint
    /// may clear its bit; a later pass copies it again.
    pub(super) fn sync_remarked(&mut self, c: u64) {
        let Some(s) = self.sync.as_mut().filter(|s| s.role == SyncRole::Source) else {
            return;
        };
        s.acked.retain(|x| *x != c);
        s.pending_clear.remove(&c);
        if let Some((_, chunks)) = s.checkpoint.as_mut() {
            chunks.retain(|x| *x != c);
        }
    }

    pub(super) fn sync_tick(&mut self, now: Instant) {
        self.sync_pump(now);
    }
}

#[cfg(test)]
mod remark_tests {
    use super::*;
    use crate::protocol::ranges::Range;
    use crate::protocol::tests::{Pair, fill};

    /// A chunk marked again (a write the peer does not hold) after the target
    /// acknowledged its copy, while the checkpoint that clears it is on the wire, must
    /// stay marked: the copy is stale. Found by the simulation (seed 38879 at 2e22484;
    /// `fixed-remarked-chunk-cleared.patch` reverts the fix).
    #[test]
    fn a_chunk_marked_again_during_a_resync_is_not_cleared_by_the_checkpoint() {
        let mut p = Pair::connected();
        p.cut();
        let w = p.write(0, 0, fill(0x5a, 512), false);
        p.run();
        assert_eq!(p.n[0].result_of(w), Some(&Ok(None)));
        p.connect();
        // Step until node 0, the source, has a checkpoint on the wire.
        let mut guard = 0;
        while !p.n[0]
            .ep
            .sync
            .as_ref()
            .is_some_and(|s| s.role == SyncRole::Source && s.checkpoint.is_some())
        {
            let next = p.steps();
            assert!(!next.is_empty() && guard < 10_000, "no checkpoint was sent");
            p.step(next[0]);
            guard += 1;
        }
        let chunk_len = p.n[0].ep.journal.layout().chunk_size();
        p.n[0]
            .ep
            .mark_unmirrored(Range::new(0, chunk_len.min(512)), false);
        // Let the checkpoint's ack arrive, and nothing else happen on node 0 after it.
        while p.n[0]
            .ep
            .sync
            .as_ref()
            .is_some_and(|s| s.checkpoint.is_some())
        {
            let next = p.steps();
            assert!(!next.is_empty(), "the checkpoint was never answered");
            p.step(next[0]);
        }
        assert!(
            p.n[0].ep.journal.bitmap().get(0),
            "the checkpoint cleared a chunk marked after its copy was acknowledged"
        );
        p.run();
        assert!(
            p.n[0].ep.sync.is_some() && p.n[0].ep.dirty_chunks() == 1,
            "the resync ended with the chunk marked again uncopied"
        );
    }
}
