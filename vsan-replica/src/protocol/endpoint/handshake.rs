//! The handshake on a new link: Hellos exchanged, checked and compared (the decision
//! of `generations`), Welcomes, and the move to mirroring.
//!
//! Each side sends its Hello (deferred while writes it acknowledges alone are in
//! flight: its generations must not move after the peer saw them), checks and compares
//! the peer's, and answers Welcome; once both Welcomes crossed and nothing moved, the
//! link mirrors. A handshake from degraded mode holds new own writes meanwhile.

use std::time::Instant;

use tracing::{info, warn};

use vsan_core::ErrorKind;

use super::{
    Alone, Endpoint, Event, LinkState, PeerCopy, Quorum, Remote, Replica, RequestId, SyncRole,
};
use crate::protocol::generations::{Decision, Side, decide};
use crate::protocol::message::{Hello, Message, PROTOCOL_VERSION, SplitBrainPolicy};
use crate::protocol::ranges::Range;

/// The handshake on the current link.
#[derive(Debug, Clone)]
pub(super) enum Handshake {
    /// None runs: no link, or the link's handshake finished or failed.
    Idle,
    /// A link is up and its handshake runs.
    Running(Run),
}

/// A running handshake.
#[derive(Debug, Clone)]
pub(super) struct Run {
    /// Where this node's Hello stands.
    hello: OurHello,
    /// Whether the peer's Welcome arrived.
    peer: PeerWelcome,
}

/// This node's Hello on the current link.
#[derive(Debug, Clone)]
enum OurHello {
    /// Waiting for the unmirrored writes in flight to finish; the peer's Hello, if it
    /// came first, waits with it.
    Deferred { peer: Option<Hello> },
    /// Sent; the peer's not compared yet.
    Sent(Hello),
    /// Sent, the peer's compared and accepted, Welcome sent. `peer_went_on`: the
    /// peer's current generation is not this node's (it wrote, or moved its generation,
    /// without this node).
    Accepted {
        mine: Hello,
        decision: Decision,
        peer_went_on: bool,
    },
}

/// The peer's Welcome on the current link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerWelcome {
    Awaited,
    Received,
}

/// What this node's next Hello says of its own data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OwnData {
    /// Compared with the peer's as usual.
    Keep,
    /// The operator gave it up (`discard_my_data`): the peer's replaces it.
    Discard,
}

impl Endpoint {
    /// Whether a handshake runs on the current link.
    pub(super) fn handshaking(&self) -> bool {
        matches!(self.handshake, Handshake::Running(_))
    }

    /// Whether own writes wait (not started) for the running handshake: one from
    /// degraded mode, where generations must not move while the two sides compare them
    /// (a node stays degraded until the handshake connects it or fails).
    pub(super) fn holds_writes(&self) -> bool {
        self.handshaking() && self.state == LinkState::Degraded
    }

    /// Whether the operator gave this replica's data up (see [`Self::discard_my_data`]).
    pub(super) fn discards_own_data(&self) -> bool {
        self.own_data == OwnData::Discard
    }

    /// A link to the peer is up: start the handshake.
    pub fn handle_connected(&mut self, now: Instant) {
        if self.shutting_down() {
            self.link_epoch += 1;
            self.transmit.clear();
            return self.events.push_back(Event::Refused {
                reason: "this node is shutting down".into(),
            });
        }
        if self.state == LinkState::Connected {
            self.lose_peer(now, "the link was replaced".into());
        }
        if self.replica == Replica::DetachedAlone && self.discards_own_data() {
            // The operator gave up this replica's data: the peer's is taken in full.
            self.distrust_replica();
            self.replica = Replica::Detached;
        }
        self.link_epoch += 1;
        self.peer_copy = PeerCopy::Complete;
        self.last_rx = now;
        self.transmit.clear();
        self.fence_from =
            (self.state == LinkState::Degraded && self.is_current() && self.alone() == Alone::Hold)
                .then_some(now);
        // From degraded mode, generations must not move while the two sides compare
        // them: new writes wait, and the Hello waits for writes already going on alone.
        if self.state != LinkState::Degraded {
            self.state = LinkState::Handshaking;
        }
        self.handshake = Handshake::Running(Run {
            hello: OurHello::Deferred { peer: None },
            peer: PeerWelcome::Awaited,
        });
        self.maybe_send_hello(now);
    }

    /// Whether own writes or flushes completing alone are in flight: a flush's end moves
    /// the generation as a write's does (`finish_flush`), so the Hello waits for both.
    pub(super) fn unmirrored_in_flight(&self) -> bool {
        self.own_writes
            .values()
            .any(|w| w.started && matches!(w.remote, Remote::Skipped))
            || self
                .own_flushes
                .values()
                .any(|f| f.remote == Remote::Skipped && f.refused.is_none())
    }

    pub(super) fn maybe_send_hello(&mut self, now: Instant) {
        let deferred = matches!(
            &self.handshake,
            Handshake::Running(Run {
                hello: OurHello::Deferred { .. },
                ..
            })
        );
        if !deferred || self.unmirrored_in_flight() {
            return;
        }
        let hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: self.cfg.node_id,
            peer_id: self.cfg.peer_id,
            disk_id: self.cfg.disk_id,
            disk_name: self.cfg.disk_name.clone(),
            size: self.cfg.size,
            block_size: self.cfg.block_size,
            chunk_size: self.journal.layout().chunk_size(),
            generations: self.journal.generations(),
            dirty_chunks: self.journal.bitmap().count(),
            crashed: self.journal.crashed(),
            inconsistent: self.journal.is_inconsistent(),
            discard_my_data: self.discards_own_data(),
            split_brain_policy: self.cfg.split_brain.code(),
        };
        let Handshake::Running(run) = &mut self.handshake else {
            return;
        };
        let OurHello::Deferred { peer } =
            std::mem::replace(&mut run.hello, OurHello::Sent(hello.clone()))
        else {
            return;
        };
        self.send(now, Message::Hello(hello));
        if let Some(peer) = peer {
            self.evaluate_hello(now, peer);
        }
    }

    /// The link is gone (reset, closed, or closed by the driver after an event).
    pub fn handle_disconnected(&mut self, now: Instant, reason: &str) {
        let held = self.holds_writes();
        self.handshake = Handshake::Idle;
        match self.state {
            LinkState::Connected => self.lose_peer(now, format!("link lost: {reason}")),
            LinkState::Handshaking => {
                self.state = LinkState::Waiting;
                // A link that never finished its handshake changes nothing else.
            }
            LinkState::Waiting | LinkState::Degraded => {}
        }
        if held {
            self.start_ready(now);
        }
        if self.state == LinkState::Degraded && self.alone() != Alone::Hold {
            self.settle_held(now);
        }
        // Reads that waited for the handshake to reach the peer.
        self.run_held_reads(now);
        self.transmit.clear();
    }

    pub(super) fn refuse(&mut self, now: Instant, reason: String) {
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
    pub(super) fn end_handshake(&mut self, now: Instant) {
        let held = self.holds_writes();
        self.handshake = Handshake::Idle;
        if self.state == LinkState::Handshaking {
            self.state = LinkState::Waiting;
        }
        if held {
            self.start_ready(now);
        }
        if self.state == LinkState::Degraded && self.alone() != Alone::Hold {
            // A quorum answer that came during the handshake.
            self.settle_held(now);
        }
        // Reads that waited for the handshake to reach the peer.
        self.run_held_reads(now);
    }

    pub(super) fn check_hello(&self, h: &Hello) -> Result<(), String> {
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
        if h.chunk_size != self.journal.layout().chunk_size() {
            return Err(format!(
                "bitmap chunk size mismatch for disk {:?}: {} here, {} on node {}",
                me.disk_name,
                self.journal.layout().chunk_size(),
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

    pub(super) fn side_of(h: &Hello) -> Side {
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

    pub(super) fn evaluate_hello(&mut self, now: Instant, h: Hello) {
        if !self.handshaking() {
            if self.state == LinkState::Connected {
                self.protocol_violation(now, "Hello after the handshake finished".into());
            }
            // (Otherwise the handshake on this link failed and the link is being dropped.)
            return;
        }
        if let Err(reason) = self.check_hello(&h) {
            return self.refuse(now, reason);
        }
        if self.replica == Replica::DetachedAlone {
            let (me, peer) = (self.cfg.node_id, self.cfg.peer_id);
            return self.refuse(
                now,
                format!(
                    "node {me}'s replica failed while node {peer} was away and is detached; it may \
                     hold writes node {peer} lacks: attach it again (or discard its data) first"
                ),
            );
        }
        let Handshake::Running(run) = &mut self.handshake else {
            return;
        };
        let mine = match &mut run.hello {
            OurHello::Deferred { peer } => {
                // Our Hello is not out yet: decide when it is.
                *peer = Some(h);
                return;
            }
            OurHello::Sent(mine) | OurHello::Accepted { mine, .. } => mine.clone(),
        };
        let decision = decide(
            &Self::side_of(&mine),
            &Self::side_of(&h),
            self.cfg.split_brain,
        );
        if let Decision::Refuse(reason) = decision {
            return self.refuse(now, reason);
        }
        let peer_went_on = h.generations.current != mine.generations.current;
        if let Handshake::Running(run) = &mut self.handshake {
            run.hello = OurHello::Accepted {
                mine,
                decision,
                peer_went_on,
            };
        }
        self.send(now, Message::Welcome);
        self.maybe_connected(now);
    }

    /// The peer's Welcome arrived.
    pub(super) fn handle_welcome(&mut self, now: Instant) {
        match &mut self.handshake {
            Handshake::Running(run) => {
                run.peer = PeerWelcome::Received;
                self.maybe_connected(now);
            }
            Handshake::Idle if self.state == LinkState::Connected => {
                self.protocol_violation(now, "Welcome after the handshake finished".into());
            }
            // (The handshake on this link failed and the link is being dropped.)
            Handshake::Idle => {}
        }
    }

    pub(super) fn maybe_connected(&mut self, now: Instant) {
        let Handshake::Running(Run {
            hello: OurHello::Accepted { mine, .. },
            peer: PeerWelcome::Received,
            ..
        }) = &self.handshake
        else {
            return;
        };
        let moved = mine.generations != self.journal.generations()
            || mine.dirty_chunks != self.journal.bitmap().count()
            || mine.inconsistent != self.journal.is_inconsistent();
        if moved {
            return self.refuse(
                now,
                "generations or marked chunks changed during the handshake; reconnecting".into(),
            );
        }
        let held = self.holds_writes();
        let Handshake::Running(Run {
            hello:
                OurHello::Accepted {
                    decision,
                    peer_went_on,
                    ..
                },
            ..
        }) = std::mem::replace(&mut self.handshake, Handshake::Idle)
        else {
            return;
        };
        self.state = LinkState::Connected;
        self.quorum = Quorum::Idle;
        self.link_role = match decision {
            Decision::Source { .. } => Some(SyncRole::Source),
            Decision::Target { .. } => Some(SyncRole::Target),
            Decision::InSync | Decision::Refuse(_) => None,
        };
        self.become_current(super::freshness::Proof::Handshake);
        info!(disk = %self.cfg.disk_name, peer = self.cfg.peer_id, "peer connected: mirroring ({decision:?})");
        self.events.push_back(Event::Connected);
        if let Some(from) = self.fence_from.take()
            && peer_went_on
            && matches!(decision, Decision::Target { .. })
        {
            // The peer's replica is the newer one and went on without this node: what
            // this node held for it comes from before (see `fail_fenced_writes`).
            self.fail_fenced_writes(now, from);
        }
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
                if self.journal.crashed() {
                    self.journal.clear_crashed();
                    self.journal.touch();
                }
                if self.cfg.quorum.is_some() {
                    self.events.push_back(Event::ReleaseQuorum);
                }
            }
            Decision::Source { full } => {
                if self.journal.is_inconsistent() {
                    // Both were inconsistent and the peer's operator discarded its data:
                    // this replica is taken as the data from now on.
                    warn!(disk = %self.cfg.disk_name, "the peer discards its data: this inconsistent replica becomes the resync source");
                    self.journal.set_inconsistent(false);
                    self.journal.touch();
                }
                self.start_sync(now, SyncRole::Source, full)
            }
            Decision::Target { full } => self.start_sync(now, SyncRole::Target, full),
            Decision::Refuse(_) => {}
        }
        self.own_data = OwnData::Keep;
        if held {
            self.start_ready(now);
        }
        // Writes held while the replica was unproven start now, in submission order.
        self.start_ready(now);
        self.run_held_reads(now);
    }

    /// The peer went on without this node (its replica wins this link's decision with a
    /// generation this node does not have) while this node, current, held its writes
    /// for quorum: the own writes held for the peer across the separation (started, or
    /// submitted before the link came up at `from`) fail with [`ErrorKind::NoQuorum`]
    /// (use the other path) instead of being sent. Sent now, they would land on the peer
    /// after whatever it did meanwhile, a fence among it: a PERSISTENT RESERVE OUT
    /// PREEMPT AND ABORT made alone there must never be followed by writes of the
    /// initiator it preempted, held here from before. None of them was acknowledged;
    /// the chunks of the started ones are marked, so the resync this link starts
    /// copies the peer's data over what they left on this replica.
    fn fail_fenced_writes(&mut self, now: Instant, from: Instant) {
        let started: Vec<RequestId> = self.unsent.drain(..).collect();
        let waiting = self.fail_held_writes(|submitted| submitted < from, ErrorKind::NoQuorum);
        for &req in &started {
            let Some(w) = self.own_writes.get_mut(&req) else {
                continue;
            };
            w.fenced = true;
            w.remote = Remote::Skipped;
            let range = Range::new(w.offset, w.payload.len());
            self.mark_unmirrored(range, false);
            self.finish_own_write(now, req);
        }
        if !started.is_empty() || waiting > 0 {
            warn!(
                disk = %self.cfg.disk_name,
                "node {} went on without this node: {} writes held for it fail (no quorum) \
                 instead of landing after what it did meanwhile; their chunks resync from it",
                self.cfg.peer_id,
                started.len() + waiting
            );
        }
    }

    /// The operator resolves a split brain on this node: on the next handshake this
    /// replica becomes the sync target and its changes are discarded.
    pub fn discard_my_data(&mut self) {
        warn!(disk = %self.cfg.disk_name, "operator: discard this node's data on the next connect");
        self.own_data = OwnData::Discard;
        self.undo_only_writer_start();
    }
}
