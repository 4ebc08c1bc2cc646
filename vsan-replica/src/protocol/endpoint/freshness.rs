//! Freshness: a replica is served only once it is proven current.
//!
//! A node that starts with a peer configured does not know whether its replica is
//! current: the peer may have acknowledged writes alone while this node was down (a
//! crash, a clean stop, a long partition). Until one of the proofs below arrives, the
//! endpoint serves nothing from the replica: reads, writes and flushes wait (writes are
//! not even started, so nothing lands on the replica before the resync orders it).
//!
//! ```text
//!   start ──> Unproven ──handshake decided (in sync / source / target)──> Current(Handshake)
//!     │          ├──witness grants this node the disk────────────────> Current(Witness)
//!     │          ├──operator: declare-current─────────────────────────> Current(Operator)
//!     │          └──no peer within the connect timeout, no witness,
//!     │             policy serve-alone-after-timeout──────────────────> Current(StartupTimeout)
//!     └──metadata: degraded and the only writer before the stop───────> Current(OnlyWriter)
//! ```
//!
//! Without a witness and with the default [`StartupPolicy::WaitForPeer`], a node whose
//! peer stays away never serves its replica: each held request fails with
//! [`ErrorKind::Io`] once it has waited the connect timeout, with a log line saying why.
//! With a witness, a node whose peer does not connect within the connect timeout asks the
//! witness; a grant proves it current (the peer cannot have written alone: it would hold
//! the grant), a denial means the peer holds it and may have written, so this node serves
//! nothing until the peer is back (held or failed, as the quorum policy says).
//!
//! The exception that needs no proof: a replica whose metadata says it went on alone (a
//! bitmap generation, set durably before the first write or flush acknowledged without
//! the peer, and not an unfinished sync target) holds every write the pair acknowledged
//! since the peer left: the peer is behind, and this node serves at once (degraded).

use std::fmt;
use std::time::Instant;

use tracing::{info, warn};
use vsan_core::ErrorKind;

use super::{Endpoint, Event, LinkState, Remote, refused};

/// What a node does at start when its peer does not connect within the connect timeout
/// and no witness is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartupPolicy {
    /// Never serve an unproven replica: wait for the peer (or an operator's
    /// declare-current); requests held longer than the connect timeout fail. The
    /// default: it never returns stale data.
    #[default]
    WaitForPeer,
    /// After the connect timeout, take the replica as current and serve alone. A risk,
    /// logged as one: if the peer acknowledged writes alone while this node was down,
    /// this node serves older data and the two replicas split.
    ServeAloneAfterTimeout,
}

impl StartupPolicy {
    /// The config spelling: `wait-for-peer` or `serve-alone-after-timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            StartupPolicy::WaitForPeer => "wait-for-peer",
            StartupPolicy::ServeAloneAfterTimeout => "serve-alone-after-timeout",
        }
    }

    /// Parse the config spelling.
    pub fn parse(s: &str) -> Option<StartupPolicy> {
        match s {
            "wait-for-peer" => Some(StartupPolicy::WaitForPeer),
            "serve-alone-after-timeout" => Some(StartupPolicy::ServeAloneAfterTimeout),
            _ => None,
        }
    }
}

impl fmt::Display for StartupPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What proved a replica current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proof {
    /// The handshake with the peer compared generations (in sync, source or target; a
    /// target reads chunks it has not synced yet from the source).
    Handshake,
    /// The witness granted this node the disk.
    Witness,
    /// An operator declared the replica current.
    Operator,
    /// The metadata says this node went on alone before it stopped: the peer is behind.
    OnlyWriter,
    /// The peer did not connect within the connect timeout and the startup policy is
    /// [`StartupPolicy::ServeAloneAfterTimeout`].
    StartupTimeout,
}

impl Proof {
    /// A short name: `handshake`, `witness`, `operator`, `only-writer`, `startup-timeout`.
    pub fn as_str(self) -> &'static str {
        match self {
            Proof::Handshake => "handshake",
            Proof::Witness => "witness",
            Proof::Operator => "operator",
            Proof::OnlyWriter => "only-writer",
            Proof::StartupTimeout => "startup-timeout",
        }
    }
}

impl fmt::Display for Proof {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether the replica may be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    /// Not proven current since the start: nothing is served from it.
    Unproven {
        /// What can prove it.
        awaiting: Awaiting,
    },
    /// Proven current (requests may still wait for quorum or the link, as before).
    Current(Proof),
}

impl Freshness {
    /// Proven current.
    pub fn is_current(self) -> bool {
        matches!(self, Freshness::Current(_))
    }
}

/// What an unproven replica waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Awaiting {
    /// The peer's handshake, or an operator's declare-current (no witness, policy
    /// wait-for-peer).
    PeerOrOperator,
    /// The peer's handshake, or the connect timeout (policy serve-alone-after-timeout).
    PeerOrTimeout,
    /// The peer's handshake, or the witness's grant.
    PeerOrWitness,
    /// The peer's handshake: the witness did not grant this node the disk (the peer
    /// holds it and may have written alone, or the witness is out of reach), or the
    /// replica can only be completed by the peer (an unfinished sync target, or data the
    /// operator asked to discard).
    Peer,
}

impl Awaiting {
    /// In words, for status lines and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Awaiting::PeerOrOperator => "the peer's handshake or an operator's declare-current",
            Awaiting::PeerOrTimeout => {
                "the peer's handshake, the startup timeout or an operator's declare-current"
            }
            Awaiting::PeerOrWitness => {
                "the peer's handshake, the witness's grant or an operator's declare-current"
            }
            Awaiting::Peer => {
                "the peer's handshake (the witness did not grant this node the disk: the peer \
                 may hold it, or the witness is out of reach)"
            }
        }
    }
}

impl fmt::Display for Awaiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The endpoint's freshness state: proven, or since when it waits and whether the
/// startup step (the connect timeout's policy) has run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FreshnessState {
    Unproven {
        /// The connect timeout passed and its policy step ran (witness asked, or the
        /// wait-for-peer warning logged).
        timed_out: bool,
    },
    Current(Proof),
}

impl Endpoint {
    /// Whether this node's replica is proven current (see the `freshness` module).
    pub fn freshness(&self) -> Freshness {
        match self.fresh {
            FreshnessState::Current(p) => Freshness::Current(p),
            FreshnessState::Unproven { .. } => Freshness::Unproven {
                awaiting: self.awaiting(),
            },
        }
    }

    pub(super) fn is_current(&self) -> bool {
        matches!(self.fresh, FreshnessState::Current(_))
    }

    fn awaiting(&self) -> Awaiting {
        if self.journal.is_inconsistent() || self.discards_own_data() {
            return Awaiting::Peer;
        }
        match self.cfg.quorum {
            Some(_) if self.quorum == super::Quorum::Denied => Awaiting::Peer,
            Some(_) => Awaiting::PeerOrWitness,
            None => match self.cfg.startup {
                StartupPolicy::WaitForPeer => Awaiting::PeerOrOperator,
                StartupPolicy::ServeAloneAfterTimeout => Awaiting::PeerOrTimeout,
            },
        }
    }

    /// The freshness a new endpoint starts in: current at once only when the metadata
    /// says this replica went on alone (and is no unfinished sync target).
    pub(super) fn initial_freshness(&mut self) {
        let g = self.journal.generations();
        if self.journal.went_on_alone() && !self.journal.is_inconsistent() {
            info!(
                disk = %self.cfg.disk_name,
                "this replica went on without node {} before it stopped (generation {:016x}, \
                 bitmap generation {:016x}): the peer is behind; serving at once, degraded",
                self.cfg.peer_id, g.current, g.bitmap
            );
            self.fresh = FreshnessState::Current(Proof::OnlyWriter);
            self.state = LinkState::Degraded;
            if self.cfg.quorum.is_some() {
                self.quorum = super::Quorum::Pending;
                self.events.push_back(Event::NeedQuorum);
            }
        } else {
            info!(
                disk = %self.cfg.disk_name,
                "replica not proven current yet: serving nothing until {}",
                self.awaiting()
            );
            self.fresh = FreshnessState::Unproven { timed_out: false };
        }
    }

    /// An operator asked to discard this node's data while it serves at once as the
    /// only writer (a restart with `--discard-my-data`, before anything ran): it goes back
    /// to unproven, serving nothing until the peer's handshake replaces its data.
    pub(super) fn undo_only_writer_start(&mut self) {
        let idle = self.own_writes.is_empty()
            && self.own_flushes.is_empty()
            && self.local_reads.is_empty()
            && self.held_reads.is_empty();
        if self.fresh == FreshnessState::Current(Proof::OnlyWriter)
            && self.state == LinkState::Degraded
            && !self.handshaking()
            && idle
        {
            info!(disk = %self.cfg.disk_name, "this node's data is to be discarded: not serving it; waiting for the peer");
            self.fresh = FreshnessState::Unproven { timed_out: false };
            self.state = LinkState::Waiting;
            self.quorum = super::Quorum::Idle;
        }
    }

    /// The replica is proven current: log it; held requests go on as the caller's
    /// state change says (the caller settles them).
    pub(super) fn become_current(&mut self, proof: Proof) {
        if self.is_current() {
            return;
        }
        if self.discards_own_data() && proof != Proof::Handshake {
            // The operator gave this replica's data up: only the peer's replaces it.
            info!(disk = %self.cfg.disk_name, "not serving on the {proof}'s word: this node's data is to be discarded; waiting for the peer");
            return;
        }
        self.fresh = FreshnessState::Current(proof);
        match proof {
            Proof::Operator => warn!(
                disk = %self.cfg.disk_name,
                "OPERATOR DECLARED THIS REPLICA CURRENT: serving it without proof from node {}; \
                 if node {} acknowledged writes alone, they are not here and the replicas \
                 split",
                self.cfg.peer_id, self.cfg.peer_id
            ),
            Proof::StartupTimeout => warn!(
                disk = %self.cfg.disk_name,
                "node {} did not connect within {:?}: startup policy serve-alone-after-timeout \
                 takes this replica as current and serves it alone; RISK: writes node {} \
                 acknowledged alone while this node was away are not here",
                self.cfg.peer_id, self.cfg.connect_timeout, self.cfg.peer_id
            ),
            _ => info!(disk = %self.cfg.disk_name, "replica proven current ({proof}): serving I/O"),
        }
    }

    /// An operator declares this replica current: it serves alone (degraded) until the
    /// peer connects. With a witness the quorum policy still decides whether it may.
    pub fn declare_current(&mut self, now: Instant) -> vsan_core::Result<String> {
        if self.is_current() {
            return Err(refused("the replica is proven current already"));
        }
        if self.shutting_down() {
            return Err(refused("this node is shutting down"));
        }
        if self.journal.is_inconsistent() {
            return Err(refused(
                "the replica is an unfinished sync target: it holds no complete copy; \
                 only the peer can complete it",
            ));
        }
        if self.discards_own_data() {
            return Err(refused(
                "discard-my-data is pending: this node's data is to be replaced by \
                        the peer's",
            ));
        }
        if self.handshaking() {
            return Err(refused("a handshake with the peer is running: it decides"));
        }
        self.become_current(Proof::Operator);
        if self.state == LinkState::Waiting {
            self.lose_peer(
                now,
                "an operator declared this replica current; serving alone".into(),
            );
        }
        self.settle_held(now);
        Ok(match self.cfg.quorum {
            Some(_) => "replica declared current; the witness's grant decides whether it \
                        serves alone"
                .into(),
            None => {
                "replica declared current: serving alone (degraded) until the peer connects".into()
            }
        })
    }

    /// The connect timeout's policy step for an unproven node without a link, and the
    /// bound on requests held for it.
    pub(super) fn unproven_tick(&mut self, now: Instant) {
        let t = self.cfg.connect_timeout;
        let FreshnessState::Unproven { timed_out } = self.fresh else {
            return;
        };
        if self.state != LinkState::Waiting {
            return;
        }
        let start_due = now >= self.created + t;
        let held_due = self
            .oldest_held()
            .is_some_and(|first| now >= first.max(self.created) + t);
        // An unfinished sync target, or data the operator gave up, is never taken as
        // current without the peer: such a node waits for it whatever the policy.
        let only_the_peer = self.journal.is_inconsistent() || self.discards_own_data();
        let policy = match self.cfg.startup {
            _ if only_the_peer => StartupPolicy::WaitForPeer,
            p => p,
        };
        let quorum = self.cfg.quorum.filter(|_| !only_the_peer);
        match (quorum, policy) {
            (Some(_), _) => {
                if start_due || held_due {
                    // The witness decides: a grant proves this replica current, a denial
                    // says the peer holds the disk.
                    self.lose_peer(now, format!("the peer did not connect within {t:?}"));
                    self.run_held_reads(now);
                }
            }
            (None, StartupPolicy::ServeAloneAfterTimeout) => {
                if start_due {
                    self.become_current(Proof::StartupTimeout);
                    self.lose_peer(now, format!("the peer did not connect within {t:?}"));
                    self.settle_held(now);
                }
            }
            (None, StartupPolicy::WaitForPeer) => {
                if start_due && !timed_out {
                    warn!(
                        disk = %self.cfg.disk_name,
                        "node {} did not connect within {t:?}: this replica is not proven \
                         current and startup policy wait-for-peer serves nothing from it; \
                         requests fail after {t:?}; declare it current (vsanctl declare-current) \
                         only if node {} is known to be behind",
                        self.cfg.peer_id, self.cfg.peer_id
                    );
                    self.fresh = FreshnessState::Unproven { timed_out: true };
                }
                if held_due {
                    let created = self.created;
                    let failed =
                        self.fail_held(|since| now >= since.max(created) + t, ErrorKind::Io);
                    warn!(
                        disk = %self.cfg.disk_name,
                        "{failed} requests failed (EIO) after waiting {t:?}: this replica is not \
                         proven current (waiting for {})",
                        self.awaiting()
                    );
                }
            }
        }
    }

    /// How a request held for an unproven replica fails now, if it does: at shutdown, or
    /// when the witness gave the disk to the peer and the quorum policy is io-error.
    pub(super) fn unproven_refusal(&self) -> Option<ErrorKind> {
        if self.shutting_down() {
            return Some(ErrorKind::Closed);
        }
        let denied = self.state == LinkState::Degraded && self.quorum == super::Quorum::Denied;
        (denied && self.cfg.quorum == Some(super::QuorumPolicy::IoError))
            .then_some(ErrorKind::NoQuorum)
    }

    /// When `unproven_tick` must run next.
    pub(super) fn unproven_deadline(&self) -> Option<Instant> {
        let FreshnessState::Unproven { timed_out } = self.fresh else {
            return None;
        };
        if self.state != LinkState::Waiting {
            return None;
        }
        let t = self.cfg.connect_timeout;
        let start = (!timed_out).then_some(self.created + t);
        let held = self.oldest_held().map(|first| first.max(self.created) + t);
        match (start, held) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// When the oldest request held while the replica is unproven was submitted (its
    /// writes are all in `pending_own`: none starts before the proof).
    fn oldest_held(&self) -> Option<Instant> {
        let writes = self
            .pending_own
            .iter()
            .filter_map(|r| self.own_writes.get(r))
            .map(|w| w.submitted);
        let reads = self.held_reads.iter().map(|r| r.3);
        let flushes = self
            .own_flushes
            .values()
            .filter(|f| f.remote == Remote::Unsent)
            .map(|f| f.submitted);
        writes.chain(reads).chain(flushes).min()
    }

    /// Fail the own writes not started yet that `due` (given when each was submitted)
    /// selects, with `kind`; returns how many. Nothing of them reached the replica.
    pub(super) fn fail_held_writes(
        &mut self,
        due: impl Fn(Instant) -> bool,
        kind: ErrorKind,
    ) -> usize {
        let writes: Vec<_> = self
            .pending_own
            .iter()
            .copied()
            .filter(|r| self.own_writes.get(r).is_some_and(|w| due(w.submitted)))
            .collect();
        for req in &writes {
            self.pending_own.retain(|r| r != req);
            self.own_writes.remove(req);
            self.events.push_back(Event::Completed {
                request: *req,
                result: Err(kind),
            });
        }
        writes.len()
    }

    /// Fail the requests held for an unproven replica that `due` (given when each was
    /// submitted) selects, with `kind`; returns how many. Writes held here never started:
    /// nothing of them reached the replica.
    pub(super) fn fail_held(&mut self, due: impl Fn(Instant) -> bool, kind: ErrorKind) -> usize {
        let mut failed = self.fail_held_writes(&due, kind);
        let (fail, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held_reads)
            .into_iter()
            .partition(|r| due(r.3));
        self.held_reads = keep.into();
        for (req, ..) in fail {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(kind),
            });
            failed += 1;
        }
        let mut flushes: Vec<_> = self
            .own_flushes
            .iter()
            .filter(|(_, f)| f.remote == Remote::Unsent && due(f.submitted))
            .map(|(r, _)| *r)
            .collect();
        flushes.sort_unstable();
        for req in flushes {
            if let Some(f) = self.own_flushes.get_mut(&req) {
                f.remote = Remote::Skipped;
                f.refused = Some(kind);
            }
            self.finish_flush(req);
            failed += 1;
        }
        failed
    }
}
