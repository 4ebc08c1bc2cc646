//! The caller's writes and flushes: submitted, started (local write and send at the
//! same moment), and completed once both halves are settled.

use std::time::Instant;

use vsan_core::ErrorKind;

use super::{
    Alone, ApplyKind, Endpoint, Event, LinkState, LocalIo, MetaWaiter, OpPurpose, Replica,
    RequestId,
};
use crate::protocol::message::{Message, Status, WritePayload};
use crate::protocol::ranges::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Remote {
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
pub(super) enum Local {
    Pending,
    Running,
    Done(Result<(), ErrorKind>),
}

#[derive(Debug, Clone)]
pub(super) struct OwnWrite {
    pub(super) offset: u64,
    pub(super) payload: WritePayload,
    pub(super) fua: bool,
    pub(super) submitted: Instant,
    pub(super) started: bool,
    pub(super) local: Local,
    pub(super) remote: Remote,
    /// Waiting for its bitmap bits (and generation) to be durable before completing.
    pub(super) bits_pending: bool,
    /// Its local copy failed and left no complete copy anywhere (`detached_alone`):
    /// it fails, even if the peer takes it later.
    pub(super) failed_alone: bool,
    /// Held for the peer across a separation the peer went on from (it became the
    /// newer replica without this write): it fails with [`ErrorKind::NoQuorum`] and is
    /// never sent, its chunks already marked for the resync (`fail_fenced_writes`).
    pub(super) fenced: bool,
}

#[derive(Debug, Clone)]
pub(super) struct OwnFlush {
    pub(super) local: Local,
    /// `Unsent`: waiting for the link or for quorum.
    pub(super) remote: Remote,
    pub(super) submitted: Instant,
    /// Alone without quorum: fails with this.
    pub(super) refused: Option<ErrorKind>,
    /// Completed without the peer: waiting for the new generation to be durable.
    pub(super) gen_pending: bool,
}

/// Both halves of a request are settled: the local outcome, and the peer's status
/// (`None` when the request was not mirrored).
pub(super) fn settled(
    local: Local,
    remote: Remote,
) -> Option<(Result<(), ErrorKind>, Option<Status>)> {
    let Local::Done(local) = local else {
        return None;
    };
    match remote {
        Remote::Done(s) => Some((local, Some(s))),
        Remote::Skipped => Some((local, None)),
        Remote::Unsent | Remote::Sent(_) => None,
    }
}

impl Endpoint {
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
        if self.shutting_down() {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Closed),
            });
            return req;
        }
        if self.journal.failed() || (self.replica == Replica::DetachedAlone) {
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
                fenced: false,
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
        if self.replica == Replica::DetachedAlone {
            // No complete copy anywhere (see `detached_alone`): nothing to make durable.
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
            return req;
        }
        let local = if self.is_detached() {
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
                if self.shutting_down() {
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

    pub(super) fn start_own_write(&mut self, now: Instant, req: RequestId) {
        let (detached, alone) = (self.is_detached(), self.replica == Replica::DetachedAlone);
        let Some(w) = self.own_writes.get_mut(&req) else {
            return;
        };
        w.started = true;
        let range = Range::new(w.offset, w.payload.len());
        if detached {
            // No local copy: the write stands only if the peer takes it (and the peer
            // holds a complete copy).
            w.local = Local::Done(Err(ErrorKind::Io));
            w.failed_alone = alone;
        } else {
            self.push_apply(ApplyKind::Own(req), smallvec::smallvec![range], 0);
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

    pub(super) fn send_own_write(&mut self, now: Instant, req: RequestId) {
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

    pub(super) fn finish_own_write(&mut self, now: Instant, req: RequestId) {
        let Some((local, remote, range, bits_pending, failed_alone, fenced)) =
            self.own_writes.get(&req).and_then(|w| {
                settled(w.local, w.remote).map(|(l, r)| {
                    let range = Range::new(w.offset, w.payload.len());
                    (l, r, range, w.bits_pending, w.failed_alone, w.fenced)
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
            // Its chunks were marked when it was fenced (`fail_fenced_writes`).
            _ if fenced => Err(ErrorKind::NoQuorum),
            Ok(()) if mirrored => Ok(()),
            // Local replica detached; the peer holds the data. Acknowledged once the
            // metadata says, durably, that the replica is not to be trusted: a restart
            // must not serve this block from it. Failed metadata can never say so.
            Err(k) if mirrored && self.journal.failed() => Err(k),
            // The local copy failed with no complete copy on the peer: the peer's copy
            // of this write is not the data (mark the chunks so a resync evens them).
            Err(k) if mirrored && failed_alone => {
                self.mark_unmirrored(range, false);
                Err(k)
            }
            Err(_) if mirrored => {
                if !self.journal.is_durable(self.distrust_mgen) {
                    let mgen = self.distrust_mgen;
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.bits_pending = true;
                    }
                    self.journal.wait(mgen, MetaWaiter::OwnWrite(req));
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
                let incomplete = self.journal.is_inconsistent();
                let acknowledge = !incomplete
                    && (self.state != LinkState::Connected && verdict == Alone::Allowed
                        || self.state == LinkState::Connected);
                let mgen = self.mark_unmirrored(range, acknowledge);
                if self.journal.failed() {
                    Err(ErrorKind::Io)
                } else if !self.journal.is_durable(mgen) {
                    if let Some(w) = self.own_writes.get_mut(&req) {
                        w.bits_pending = true;
                    }
                    self.journal.wait(mgen, MetaWaiter::OwnWrite(req));
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
        self.maybe_send_hello(now);
        self.try_shutdown();
    }

    pub(super) fn finish_flush(&mut self, req: RequestId) {
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
        if remote != Some(Status::Ok)
            && local.is_ok()
            && !self.journal.is_inconsistent()
            && self.is_current()
        {
            // Durable here and not (known to be) on the peer: the peer is away, or its
            // replica failed the flush or is detached. This replica is now ahead of
            // it, as after a write acknowledged alone. Its generation moves on,
            // durably, before the flush is acknowledged, so a restart of both cannot
            // take the peer's copy over this one, and a restart of this node alone
            // finds itself current in its own metadata.
            let mgen = self.move_generation_alone();
            if !self.journal.is_durable(mgen) {
                if let Some(f) = self.own_flushes.get_mut(&req) {
                    f.gen_pending = true;
                }
                self.journal.wait(mgen, MetaWaiter::OwnFlush(req));
                return;
            }
        }
        // Durable on a complete copy: this replica if it is not an unfinished sync
        // target, or the peer's if it is not one (of this node) and took everything.
        let local_counts = local.is_ok() && !self.journal.is_inconsistent();
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
}
