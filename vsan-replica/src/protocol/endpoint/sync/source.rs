//! The sync source's side: the pump that reads chunks (or their checksums) through
//! the apply list and sends them at the configured rate, the acks and checkpoints that
//! clear its bits, and the end of the pass (the bitmap generation retired; `SyncDone`
//! once that is durable).

use std::time::Instant;

use tracing::{info, warn};

use super::{
    APP_QUIET, ApplyKind, Endpoint, Event, LinkState, MAX_RUN, MetaWaiter, PeerCopy, ReadMode,
    Replica, ResyncRate, SyncKind, SyncRole, SyncRun,
};
use crate::protocol::message::{Message, Status};
use crate::protocol::ranges::Range;

impl Endpoint {
    /// Source: the target wrote (or failed) a run of chunks.
    pub(super) fn on_sync_ack(&mut self, now: Instant, offset: u64, status: Status) {
        let Some(chunk) = self.chunk_of(offset) else {
            return self.protocol_violation(now, format!("resync ack at {offset}"));
        };
        let layout = self.journal.layout();
        let Some(s) = self.sync.as_mut().filter(|s| s.role == SyncRole::Source) else {
            return;
        };
        let Some(n) = s.runs.remove(&chunk) else {
            return;
        };
        for c in chunk..chunk + n {
            s.inflight.remove(&c);
        }
        match status {
            Status::Ok => {
                for c in chunk..chunk + n {
                    s.acked.push(c);
                    s.pending_clear.insert(c);
                    if s.kind != SyncKind::Verify {
                        s.done_bytes += layout.chunk_range(c).1;
                    }
                }
            }
            Status::Failed(code) => {
                self.peer_copy = PeerCopy::Incomplete;
                // Only a detached replica fails resync data (a failed write
                // detaches it): no chunk would succeed on this link, and
                // retrying would spin.
                return self.abort_sync(
                    now,
                    &format!(
                        "the peer could not write resync chunk {chunk} (error {code}); its replica is detached"
                    ),
                );
            }
        }
        self.sync_pump(now);
    }

    /// Source: whether the target's chunk matched.
    pub(super) fn on_sync_crc_reply(
        &mut self,
        now: Instant,
        offset: u64,
        equal: bool,
        verify: bool,
    ) {
        let Some(chunk) = self.chunk_of(offset) else {
            return self.protocol_violation(now, format!("checksum reply at {offset}"));
        };
        let len = self.chunk_len(chunk);
        // A reply of an aborted verify must not count for a checksum resync.
        let Some(s) = self
            .sync
            .as_mut()
            .filter(|s| s.role == SyncRole::Source && (s.kind == SyncKind::Verify) == verify)
        else {
            return;
        };
        if !s.inflight.contains(&chunk) {
            return;
        }
        if equal {
            s.inflight.remove(&chunk);
            s.done_bytes += len;
            if !verify {
                s.acked.push(chunk);
                s.pending_clear.insert(chunk);
            }
        } else {
            s.mismatches += 1;
            if verify {
                s.done_bytes += len;
                warn!(disk = %self.cfg.disk_name, "verify: chunk {chunk} (offset {offset}) differs from the peer's; repairing from this node");
                if self.journal.mark(chunk) {
                    self.journal.touch();
                }
            }
            if let Some(s) = self.sync.as_mut() {
                s.runs.insert(chunk, 1);
            }
            let (offset, len) = self.journal.layout().chunk_range(chunk);
            self.push_apply(
                ApplyKind::SyncRead {
                    offset,
                    len: len as u32,
                    mode: ReadMode::Data,
                },
                smallvec::smallvec![Range::new(offset, len)],
                0,
            );
        }
        self.sync_pump(now);
    }

    /// Source: the target persisted a checkpoint; its chunks' bits clear here too.
    pub(super) fn on_sync_checkpoint_ack(&mut self, now: Instant, id: u64, status: Status) {
        let Some(s) = self.sync.as_mut() else { return };
        if id < s.first_checkpoint {
            // The ack of a checkpoint of the run this one replaced.
            return;
        }
        let Some((cp, chunks)) = s.checkpoint.take() else {
            return;
        };
        if cp != id {
            s.checkpoint = Some((cp, chunks));
            return self.protocol_violation(now, format!("ack for checkpoint {id}"));
        }
        for c in &chunks {
            s.pending_clear.remove(c);
        }
        if status == Status::Ok {
            for c in chunks {
                self.journal.clear(c);
            }
            self.journal.touch();
        } else {
            warn!(disk = %self.cfg.disk_name, "peer failed a resync checkpoint; those chunks are copied again");
        }
        self.sync_pump(now);
    }

    /// The peer's replica lost data and asks for a full resync from this node.
    pub(super) fn sync_requested(&mut self, now: Instant) {
        let (me, peer) = (self.cfg.node_id, self.cfg.peer_id);
        let cannot = if self.is_detached() {
            Some("its own replica is detached")
        } else if self.journal.is_inconsistent()
            || matches!(&self.sync, Some(s) if s.role == SyncRole::Target)
        {
            Some("it is an unfinished sync target itself")
        } else {
            None
        };
        if let Some(why) = cannot {
            let reason = format!(
                "node {peer}'s replica lost data and it asked for a full resync, but node {me} \
                 cannot be the source: {why}; neither node holds all the data"
            );
            self.lose_peer(now, reason.clone());
            // After lose_peer (which empties the queue): the driver sends it, then closes.
            return self.send(now, Message::Refuse { reason });
        }
        warn!(
            disk = %self.cfg.disk_name,
            "node {peer}'s replica lost data it had acknowledged: resyncing it from this node by checksum"
        );
        let next_checkpoint = self.sync.as_ref().map(|s| s.next_checkpoint);
        self.abort_sync(
            now,
            &format!("node {peer} lost data and asked for a full resync"),
        );
        self.start_sync(now, SyncRole::Source, true);
        if let (Some(id), Some(s)) = (next_checkpoint, self.sync.as_mut()) {
            // Acks for checkpoints of the aborted run may still come: they are told
            // apart by id.
            s.next_checkpoint = id;
            s.first_checkpoint = id;
        }
    }

    pub(super) fn app_busy(&self, now: Instant) -> bool {
        !self.own_writes.is_empty()
            || !self.peer_writes.is_empty()
            || !self.local_reads.is_empty()
            || now.saturating_duration_since(self.last_app_io) < APP_QUIET
    }

    pub(super) fn sync_cap(&self) -> u64 {
        match self.cfg.resync.rate {
            ResyncRate::Fixed(r) => r.max(1),
            ResyncRate::Dynamic { max } => max,
        }
    }

    /// Source: start chunk reads while the window and the rate allow, checkpoint, and
    /// finish when nothing is left.
    pub(super) fn sync_pump(&mut self, now: Instant) {
        if let Some(s) = self.sync.as_mut() {
            s.pumped = now;
        }
        if self.state != LinkState::Connected {
            return;
        }
        let chunks = self.journal.layout().chunks();
        let cap = self.sync_cap();
        let busy = matches!(self.cfg.resync.rate, ResyncRate::Dynamic { .. }) && self.app_busy(now);
        let (window, max_run) = if busy {
            (1, 1)
        } else {
            (self.cfg.resync.window.max(1), MAX_RUN)
        };
        loop {
            let Some(s) = self.sync.as_mut() else { return };
            if s.role != SyncRole::Source || !s.got_peer_bitmap || s.inflight.len() >= window {
                break;
            }
            let chunk_bytes = self.journal.layout().chunk_size() as f64;
            if cap > 0 {
                let dt = now.saturating_duration_since(s.last_refill).as_secs_f64();
                s.last_refill = now;
                let burst = (cap as f64 / 10.0).max(chunk_bytes);
                s.budget = (s.budget + dt * cap as f64).min(burst);
                if s.budget < chunk_bytes {
                    break;
                }
            }
            let next = if s.kind == SyncKind::Verify {
                (s.cursor < chunks).then_some(s.cursor)
            } else {
                let mut from = s.cursor;
                loop {
                    match self.journal.bitmap().next_set(from) {
                        Some(c) if s.inflight.contains(&c) || s.pending_clear.contains(&c) => {
                            from = c + 1;
                        }
                        other => break other,
                    }
                }
            };
            let Some(chunk) = next else { break };
            // Adjacent dirty chunks travel together (data only: checksums are per chunk).
            let mut n = 1;
            if s.kind == SyncKind::Bitmap {
                while n < max_run
                    && chunk + n < chunks
                    && self.journal.bitmap().get(chunk + n)
                    && !s.inflight.contains(&(chunk + n))
                    && !s.pending_clear.contains(&(chunk + n))
                {
                    n += 1;
                }
                s.runs.insert(chunk, n);
            }
            s.cursor = chunk + n;
            if cap > 0 {
                s.budget -= chunk_bytes * n as f64;
            }
            for c in chunk..chunk + n {
                s.inflight.insert(c);
            }
            let mode = match s.kind {
                SyncKind::Verify => ReadMode::Verify,
                SyncKind::Checksum => ReadMode::Crc,
                SyncKind::Bitmap => ReadMode::Data,
            };
            let (offset, _) = self.journal.layout().chunk_range(chunk);
            let (last, last_len) = self.journal.layout().chunk_range(chunk + n - 1);
            let len = last + last_len - offset;
            self.push_apply(
                ApplyKind::SyncRead {
                    offset,
                    len: len as u32,
                    mode,
                },
                smallvec::smallvec![Range::new(offset, len)],
                0,
            );
        }
        self.sync_checkpoint(now);
    }

    pub(super) fn scan_done(&self, s: &SyncRun) -> bool {
        if !s.inflight.is_empty() {
            return false;
        }
        if s.kind == SyncKind::Verify {
            return s.cursor >= self.journal.layout().chunks();
        }
        let mut from = s.cursor;
        loop {
            match self.journal.bitmap().next_set(from) {
                Some(c) if s.pending_clear.contains(&c) => from = c + 1,
                Some(_) => return false,
                None => return true,
            }
        }
    }

    pub(super) fn sync_checkpoint(&mut self, now: Instant) {
        let Some(s) = self.sync.as_ref() else { return };
        if s.role != SyncRole::Source || !s.got_peer_bitmap {
            return;
        }
        let scan_done = self.scan_done(s);
        let interval = self.cfg.resync.checkpoint_interval;
        let Some(s) = self.sync.as_mut() else { return };
        if s.checkpoint.is_none()
            && !s.acked.is_empty()
            && (scan_done || now >= s.last_checkpoint + interval)
        {
            let id = s.next_checkpoint;
            s.next_checkpoint += 1;
            s.last_checkpoint = now;
            s.checkpoint = Some((id, std::mem::take(&mut s.acked)));
            self.send(now, Message::SyncCheckpoint { id });
            return;
        }
        if !(scan_done && s.acked.is_empty() && s.checkpoint.is_none()) {
            return;
        }
        if s.kind != SyncKind::Verify && self.journal.bitmap().count() > 0 {
            // Chunks that failed (or were marked meanwhile): another pass, from the
            // next timer tick (never recursively).
            s.cursor = 0;
            return;
        }
        self.finish_sync(now);
    }

    pub(super) fn finish_sync(&mut self, now: Instant) {
        let Some(s) = self.sync.take() else { return };
        let summary = s.summary(now, true);
        if s.kind == SyncKind::Verify {
            info!(
                disk = %self.cfg.disk_name,
                "online verify done: {} chunks differed and were repaired from this node, in {:?}",
                s.mismatches, summary.elapsed
            );
        } else {
            self.journal.finish_as_source();
            let mgen = self.journal.touch();
            let generations = self.journal.generations();
            // The target hears "done" only once this replica's metadata no longer says it
            // went on alone: a crash before that must not leave a consistent target that
            // may go on alone beside a source whose metadata (bitmap generation still
            // set) makes it serve at once as the only writer after its restart.
            self.journal.wait(
                mgen,
                MetaWaiter::SyncDone {
                    epoch: self.link_epoch,
                    generations,
                },
            );
            // The peer holds everything again.
            self.peer_copy = PeerCopy::Complete;
            if self.replica == Replica::DetachedAlone {
                // This replica failed as the run ended: the peer, complete now, takes
                // the I/O, and this replica is distrusted as after any other failure.
                self.replica = Replica::Detached;
                self.distrust_replica();
                self.journal.wait(
                    mgen,
                    MetaWaiter::ReplicaDetached {
                        epoch: self.link_epoch,
                    },
                );
            }
            info!(
                disk = %self.cfg.disk_name,
                "{} done as source: {} bytes sent of {} in {:?}; in sync",
                s.kind, s.transferred_bytes, s.total_bytes, summary.elapsed
            );
            // (The witness's grant goes back once the target heard it is done.)
        }
        self.last_sync = Some(summary);
        self.events.push_back(Event::SyncEnded(summary));
    }
}
