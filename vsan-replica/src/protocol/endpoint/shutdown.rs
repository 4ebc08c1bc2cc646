//! Clean shutdown: drop the link, let every request finish, then make the metadata
//! say "clean" durably.

use std::time::Instant;

use tracing::info;
use vsan_core::ErrorKind;

use super::{Endpoint, Event, LinkState, MetaWaiter, RequestId};

/// Where the endpoint stands in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lifecycle {
    /// Serving.
    Running,
    /// `begin_shutdown` was called: the link is dropped, new links are refused, new
    /// writes fail, and the clean state is written once every request is done.
    ShuttingDown,
    /// The clean-shutdown state is durable (or the metadata failed).
    ShutDown,
}

impl Endpoint {
    /// Whether a shutdown began (or ended).
    pub(super) fn shutting_down(&self) -> bool {
        self.lifecycle != Lifecycle::Running
    }

    /// Clean shutdown: once every request is done, flush the replica, empty the
    /// activity log and mark the metadata clean. [`is_shut_down`](Self::is_shut_down)
    /// turns true when that is durable.
    ///
    /// The link to the peer is dropped first (the peer goes on alone and marks what it
    /// writes), new links are refused, and new writes fail with [`ErrorKind::Closed`]:
    /// nothing may reach the replica once the metadata says it is clean.
    pub fn begin_shutdown(&mut self, now: Instant) {
        if self.shutting_down() {
            return;
        }
        self.lifecycle = Lifecycle::ShuttingDown;
        info!(disk = %self.cfg.disk_name, "shutting down: dropping the link to the peer");
        if !self.is_current() {
            // Nothing held for an unproven replica may now be served from it.
            self.fail_held(|_| true, ErrorKind::Closed);
        }
        match self.state {
            LinkState::Connected => self.lose_peer(now, "this node is shutting down".into()),
            LinkState::Waiting | LinkState::Handshaking => {
                if self.handshaking() {
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
                if self.handshaking() {
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

    /// The clean-shutdown state is durable (or the metadata failed).
    pub fn is_shut_down(&self) -> bool {
        self.lifecycle == Lifecycle::ShutDown
    }

    pub(super) fn try_shutdown(&mut self) {
        if self.lifecycle != Lifecycle::ShuttingDown {
            return;
        }
        let busy = !self.own_writes.is_empty()
            || !self.own_flushes.is_empty()
            || !self.apply.is_empty()
            || self.journal.is_waiting(|w| {
                matches!(w, MetaWaiter::OwnWrite(_) | MetaWaiter::CheckpointAck(_))
            });
        if busy
            || self
                .journal
                .is_waiting(|w| matches!(w, MetaWaiter::Shutdown))
        {
            return;
        }
        if self.journal.failed() || self.is_detached() {
            self.lifecycle = Lifecycle::ShutDown;
            return;
        }
        let mgen = self.journal.mark_clean();
        self.journal.wait(mgen, MetaWaiter::Shutdown);
    }
}
