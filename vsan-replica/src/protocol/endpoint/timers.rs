//! Time: when the endpoint next needs `handle_timeout`, and what is due then (pings,
//! a silent peer, a stalled handshake, a first link that never came).

use std::time::Instant;

use super::{Endpoint, Event, LinkState, Remote};
use crate::protocol::message::Message;

impl Endpoint {
    /// When `handle_timeout` must be called next, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut t: Option<Instant> = None;
        let mut at = |x: Instant| t = Some(t.map_or(x, |y| y.min(x)));
        if self.handshaking() {
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

    pub(super) fn oldest_unacked(&self) -> Option<Instant> {
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
        if self.handshaking() && now >= self.last_rx + self.cfg.peer_timeout {
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
}
