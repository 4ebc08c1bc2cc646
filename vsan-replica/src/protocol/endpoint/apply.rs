//! The apply list: every local replica write (own, peer, resync) and resync read,
//! ordered against the overlapping ones before it (the write-ordering rules of the
//! module doc), and the local completions that move it on.

use std::time::Instant;

use bytes::Bytes;
use vsan_core::{ErrorKind, Op};

use super::journal::Extents;
use super::{
    Endpoint, Event, LinkState, Local, LocalIo, LocalOpId, LocalResult, Remote, Replica, RequestId,
    status_of,
};
use crate::meta::{AL_SLOTS, Layout};
use crate::protocol::message::{Message, Status, WritePayload};
use crate::protocol::ranges::{Range, Ranges, any_overlap, span, subtract};

/// An entry in the apply list: local replica I/O that must be ordered against
/// overlapping writes (application writes, resync copies, resync reads).
#[derive(Debug, Clone)]
pub(super) struct Apply {
    pub(super) id: u64,
    /// The link it belongs to (`Endpoint::link_epoch` when it was made): results for the
    /// peer from an earlier link are dropped, never sent on a later one.
    pub(super) epoch: u64,
    pub(super) kind: ApplyKind,
    pub(super) ranges: Ranges,
    /// The span of `ranges`: the overlap checks look at it first, without following
    /// anything.
    pub(super) span: Range,
    pub(super) started: bool,
    pub(super) running_ops: usize,
    pub(super) failed: Option<ErrorKind>,
    /// Metadata generation that must be durable before it starts.
    pub(super) gate: u64,
    /// Activity-log extents it holds (writes only); `None` while it waits for a slot.
    pub(super) extents: Option<Extents>,
    /// Read result (resync reads and compares).
    pub(super) data: Option<Bytes>,
    /// One of its operations was issued before the local replica lost data and
    /// completed after: what it read or wrote may be gone.
    pub(super) suspect: bool,
    /// A peer write that lost parts to own writes awaiting their acks (rule 3): only
    /// these parts are written. It still waits, over its whole range, for the own
    /// writes before it, and then flushes (see `peer_write`).
    pub(super) keep: Option<Vec<Range>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ApplyKind {
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
        mode: super::sync::ReadMode,
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
pub(super) struct PeerWrite {
    pub(super) offset: u64,
    pub(super) payload: WritePayload,
    pub(super) fua: bool,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum OpPurpose {
    Apply(u64),
    Meta,
    OwnFlush(RequestId),
    PeerFlush(u64, u64),
    OwnRead(RequestId),
    PeerRead(u64, u64),
}

/// The part of a write's payload that covers `piece`.
pub(super) fn slice_payload(payload: &WritePayload, offset: u64, piece: Range) -> WritePayload {
    match payload {
        WritePayload::Data(d) => {
            let from = (piece.start - offset) as usize;
            WritePayload::Data(d.slice(from..from + piece.len() as usize))
        }
        WritePayload::Zeroes { .. } => WritePayload::Zeroes { len: piece.len() },
        WritePayload::Discard { .. } => WritePayload::Discard { len: piece.len() },
    }
}

impl Endpoint {
    pub(super) fn overlaps_apply(&self, ranges: &[Range], before: usize) -> bool {
        let s = span(ranges);
        self.apply
            .range(..before)
            .any(|a| a.span.overlaps(&s) && any_overlap(&a.ranges, ranges))
    }

    pub(super) fn push_apply(&mut self, kind: ApplyKind, ranges: Ranges, gate: u64) -> usize {
        self.push_apply_keeping(kind, ranges, gate, None)
    }

    /// As [`Self::push_apply`], writing only `keep` of `ranges` (a trimmed peer write).
    pub(super) fn push_apply_keeping(
        &mut self,
        kind: ApplyKind,
        ranges: Ranges,
        gate: u64,
        keep: Option<Vec<Range>>,
    ) -> usize {
        let id = self.next_apply;
        self.next_apply += 1;
        let extents = if kind.is_write() && !matches!(kind, ApplyKind::SyncWrite { .. }) {
            None
        } else {
            Some(Extents::new())
        };
        self.apply.push_back(Apply {
            id,
            epoch: self.link_epoch,
            kind,
            span: span(&ranges),
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
    pub(super) fn try_start_apply(&mut self, i: usize) {
        let me = &self.apply[i];
        if me.started || self.overlaps_apply(&me.ranges, i) {
            return;
        }
        if self.apply[i].extents.is_none() {
            let span: u64 = self.apply[i]
                .ranges
                .iter()
                .map(|r| {
                    Layout::extent_of(r.end.saturating_sub(1)) - Layout::extent_of(r.start) + 1
                })
                .sum();
            if span > (AL_SLOTS / 2) as u64 {
                // Too big for the activity log (a discard of many GiB, say): its chunks
                // are marked in the bitmap instead, durably before it starts, and stay
                // marked until the next resync copies them.
                let ranges = self.apply[i].ranges.clone();
                let mut gate = 0;
                for r in &ranges {
                    gate = gate.max(self.mark_unmirrored(*r, false));
                }
                let a = &mut self.apply[i];
                a.extents = Some(Extents::new());
                a.gate = a.gate.max(gate);
            }
        }
        if self.apply[i].extents.is_none() {
            match self.journal.al_acquire(&self.apply[i].ranges) {
                Some((extents, gate)) => {
                    let a = &mut self.apply[i];
                    a.extents = Some(extents);
                    a.gate = a.gate.max(gate);
                }
                None => return,
            }
        }
        if !self.journal.is_durable(self.apply[i].gate) {
            return;
        }
        self.start_apply(i);
    }

    /// Start every waiting apply entry and own write that no earlier write blocks.
    pub(super) fn start_ready(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.apply.len() {
            if !self.apply[i].started {
                self.try_start_apply(i);
            }
            i += 1;
        }
        if self.holds_writes() || !self.is_current() {
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

    /// Issue the local I/O of apply entry `i`.
    pub(super) fn start_apply(&mut self, i: usize) {
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
        let pieces: Ranges = match &self.apply[i].keep {
            Some(keep) => Ranges::from_slice(keep),
            None => self.apply[i].ranges.clone(),
        };
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
    pub(super) fn unacked_own_ranges(&self) -> Vec<Range> {
        self.own_writes
            .values()
            .filter(|w| matches!(w.remote, Remote::Sent(_)))
            .map(|w| Range::new(w.offset, w.payload.len()))
            .collect()
    }

    pub(super) fn peer_write(
        &mut self,
        now: Instant,
        id: u64,
        offset: u64,
        payload: WritePayload,
        fua: bool,
    ) {
        let range = Range::new(offset, payload.len());
        let op = match payload {
            WritePayload::Data(_) => Op::Write,
            WritePayload::Zeroes { .. } => Op::WriteZeroes,
            WritePayload::Discard { .. } => Op::Discard,
        };
        if let Err(e) = self.check_peer_request(op, offset, payload.len()) {
            return self.protocol_violation(now, format!("write {id} is invalid: {e}"));
        }
        self.last_app_io = now;
        if self.is_detached() {
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
        self.push_apply_keeping(ApplyKind::Peer(id), smallvec::smallvec![range], 0, keep);
    }

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
                // Entries are pushed with growing ids and only ever removed, so the
                // list stays sorted by id.
                let Ok(i) = self.apply.binary_search_by_key(&id, |a| a.id) else {
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
                // (Local writes usually finish in order: `i` is mostly 0, which a
                // VecDeque removes without moving the others.)
                let Some(entry) = self.apply.remove(i) else {
                    return;
                };
                if let Some(extents) = &entry.extents {
                    self.journal.al_release(extents);
                }
                let outcome = entry.failed.map_or(Ok(()), Err);
                match entry.kind {
                    ApplyKind::Own(req) => {
                        let alone = outcome.is_err() && (self.replica == Replica::DetachedAlone);
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
                self.maybe_send_hello(now);
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
}
