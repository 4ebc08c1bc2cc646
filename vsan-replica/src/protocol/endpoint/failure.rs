//! Failures: the peer lost (writes and flushes settled alone, held, or failed, as
//! quorum says), the local replica failed, detached, attached again, or lost data.

use std::time::Instant;

use tracing::{info, warn};
use vsan_core::ErrorKind;

use super::{
    Endpoint, Event, LinkState, QuorumPolicy, Remote, RequestId, SyncKind, SyncRole, refused,
};
use crate::protocol::message::Message;
use crate::protocol::ranges::Range;

/// The local replica's standing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Replica {
    /// Serving (as far as freshness and the resync allow).
    Attached,
    /// Failed or detached by the operator: I/O is served through the peer.
    Detached,
    /// Detached by a failure while no complete copy was on the peer (the peer away, or
    /// an unfinished sync target of this node): every request fails until it is back,
    /// so it misses nothing and is not distrusted; but it may hold writes the peer
    /// lacks, so no handshake is accepted until the operator attaches it again (or
    /// discards its data).
    DetachedAlone,
}

/// What this node knows of the peer's replica on the current link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PeerCopy {
    /// It reported no failure on this link.
    Complete,
    /// It failed a write or flush on this link (or said it is detached): it holds no
    /// complete copy. A new link's handshake, or a finished resync to it, makes it
    /// complete again.
    Incomplete,
}

/// Quorum as the endpoint knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Quorum {
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
pub(super) enum Alone {
    Allowed,
    Hold,
    Fail(ErrorKind),
}

impl Endpoint {
    pub(super) fn lose_peer(&mut self, now: Instant, reason: String) {
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
        self.fail_scsi_calls();
    }

    /// Flushes sent to the peer or waiting for it, while the peer is away: complete
    /// them alone, fail them, or keep them for the peer, as quorum says.
    pub(super) fn settle_waiting_flushes(&mut self) {
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
    pub(super) fn settle_waiting_writes(&mut self, now: Instant, waiting: Vec<RequestId>) {
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
    pub(super) fn alone(&self) -> Alone {
        if self.journal.is_inconsistent() {
            return Alone::Fail(ErrorKind::Io);
        }
        if self.shutting_down() {
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
            self.become_current(super::freshness::Proof::Witness);
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
        if self.state == LinkState::Degraded && !self.handshaking() {
            self.settle_held(now);
        }
    }

    pub(super) fn settle_held(&mut self, now: Instant) {
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

    /// Whether the peer's replica is a complete copy: it reported no failure on this
    /// link, and it is not the target of a resync from this node.
    pub(super) fn peer_holds_all(&self) -> bool {
        self.peer_copy == PeerCopy::Complete
            && !matches!(&self.sync, Some(s) if s.role == SyncRole::Source && s.kind != SyncKind::Verify)
    }

    pub(super) fn local_failed(&mut self, now: Instant, kind: ErrorKind) {
        let mut alone = false;
        if !self.is_detached() && !self.journal.failed() {
            if self.state == LinkState::Connected && self.peer_holds_all() {
                // Writes from now on reach the peer only: a restart must not trust the
                // replica (its disk may work again, with old data), so it is marked,
                // durably, for a full resync. The peer learns its copy is the only one.
                self.distrust_replica();
                self.send(now, Message::ReplicaDetached);
            } else if !self.journal.is_inconsistent() {
                // Alone, or with a peer that is an unfinished sync target of this node:
                // no complete copy is left, so nothing is served or written until this
                // replica is back; it misses nothing, and it may be the only copy of
                // the newest data. Keep it (see `Replica::DetachedAlone`). (A replica
                // that is not complete itself holds nothing the peer lacks: it is only
                // detached.)
                alone = true;
            }
        }
        if !self.is_detached() {
            self.detach(format!(
                "local replica failed ({kind}); serving I/O through the peer"
            ));
        }
        if alone {
            self.replica = Replica::DetachedAlone;
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
        if self.is_detached() {
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
        if !self.is_detached() {
            return Err(refused("the local replica is attached"));
        }
        if self.replica == Replica::DetachedAlone {
            // Nothing was written anywhere since it failed: it is taken back as it is.
            self.replica = Replica::Attached;
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
        if self.journal.failed() {
            return Err(refused(
                "the replica's metadata failed: restart the node to attach it",
            ));
        }
        let peer = self.cfg.peer_id;
        self.replica = Replica::Attached;
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
    pub(super) fn distrust_replica(&mut self) {
        self.loss_op_mark = self.next_op;
        self.journal.set_inconsistent(true);
        self.journal.mark_all();
        self.distrust_mgen = self.journal.touch();
    }

    pub(super) fn detach(&mut self, reason: String) {
        if self.is_detached() {
            return;
        }
        self.replica = Replica::Detached;
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
        if self.is_detached() {
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
                if self.state == LinkState::Degraded && !self.handshaking() {
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

    /// Whether requests wait for quorum right now (for status).
    pub fn quorum_suspended(&self) -> bool {
        self.state == LinkState::Degraded
            && self.cfg.quorum == Some(QuorumPolicy::Suspend)
            && self.alone() == Alone::Hold
    }
}
