//! Read routing: the local replica where it is current, the peer where it is not,
//! held while neither can answer.

use std::time::Instant;

use vsan_core::ErrorKind;

use super::{
    Alone, Endpoint, Event, LinkState, LocalIo, OpPurpose, Quorum, QuorumPolicy, Replica,
    RequestId, SyncRole,
};
use crate::protocol::message::Message;

impl Endpoint {
    /// Read from the local replica; from the peer while the local one is detached or,
    /// on a sync target, not yet synced for that range.
    pub fn submit_read(&mut self, now: Instant, offset: u64, len: u32) -> RequestId {
        let req = self.request_id();
        self.last_app_io = now;
        self.route_read(now, req, offset, len, now);
        req
    }

    /// Send a read where it can be served; `since`: when it was submitted.
    pub(super) fn route_read(
        &mut self,
        now: Instant,
        req: RequestId,
        offset: u64,
        len: u32,
        since: Instant,
    ) {
        if self.replica == Replica::DetachedAlone {
            // No replica here, and none complete on the peer.
            return self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
        }
        if !self.is_current() {
            // Not proven current: never answered from this replica. It waits for the
            // proof (the connect timeout bounds it), or fails as quorum says.
            return match self.unproven_refusal() {
                Some(kind) => self.events.push_back(Event::Completed {
                    request: req,
                    result: Err(kind),
                }),
                None => self.held_reads.push_back((req, offset, len, since)),
            };
        }
        if self.state == LinkState::Degraded {
            match self.alone() {
                Alone::Hold => return self.held_reads.push_back((req, offset, len, since)),
                Alone::Fail(ErrorKind::NoQuorum) => {
                    return self.events.push_back(Event::Completed {
                        request: req,
                        result: Err(ErrorKind::NoQuorum),
                    });
                }
                Alone::Allowed => {}
                Alone::Fail(_) => {
                    // An inconsistent replica fails writes alone but may serve reads of
                    // the chunks it has synced: with a witness, only while it holds the
                    // grant (without it, the peer may be writing alone right now).
                    if self.cfg.quorum.is_some() && self.quorum != Quorum::Granted {
                        if self.quorum == Quorum::Pending
                            || (self.cfg.quorum == Some(QuorumPolicy::Suspend)
                                && !self.shutting_down())
                        {
                            return self.held_reads.push_back((req, offset, len, since));
                        }
                        let kind = if self.shutting_down() {
                            ErrorKind::Closed
                        } else {
                            ErrorKind::NoQuorum
                        };
                        return self.events.push_back(Event::Completed {
                            request: req,
                            result: Err(kind),
                        });
                    }
                }
            }
        }
        // (Waiting or handshaking without the grant is never reached here: a node is
        // proven current only connected or degraded; see the freshness gate above.)
        if self.is_detached() || self.stale(offset, u64::from(len)) {
            if self.state != LinkState::Connected
                && (self.handshaking() || self.state == LinkState::Waiting)
            {
                // Only the peer can serve it, and its link is coming up (or has not come
                // up yet): wait for it, as writes do, rather than fail; the connect
                // timeout bounds the wait.
                return self.held_reads.push_back((req, offset, len, since));
            }
            self.read_from_peer(now, req, offset, len);
        } else {
            let op = self.op_id(OpPurpose::OwnRead(req));
            self.local_reads.insert(req, (offset, len));
            self.local_io.push_back(LocalIo::Read {
                op,
                offset,
                len,
                once: false,
            });
        }
    }

    /// Whether this replica's data in `[offset, offset + len)` may be older than the
    /// peer's: it is a sync target (or lost data) and a chunk there is not synced yet.
    pub(super) fn stale(&self, offset: u64, len: u64) -> bool {
        if matches!(&self.sync, Some(s) if s.role == SyncRole::Target && !s.got_peer_bitmap()) {
            // The source's marks (what it wrote while apart) have not arrived: any chunk
            // may be older here.
            return true;
        }
        (self.journal.is_inconsistent()
            || matches!(&self.sync, Some(s) if s.role == SyncRole::Target))
            && self
                .journal
                .layout()
                .chunks_of(offset, len.max(1))
                .any(|c| self.journal.bitmap().get(c))
    }

    pub(super) fn run_held_reads(&mut self, now: Instant) {
        if self.state == LinkState::Degraded && self.alone() == Alone::Hold {
            return;
        }
        for (req, offset, len, since) in std::mem::take(&mut self.held_reads) {
            self.route_read(now, req, offset, len, since);
        }
    }

    pub(super) fn read_from_peer(&mut self, now: Instant, req: RequestId, offset: u64, len: u32) {
        if self.state == LinkState::Connected {
            self.remote_reads.insert(req, len);
            self.send(
                now,
                Message::Read {
                    id: req.0,
                    offset,
                    len,
                },
            );
        } else {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::Io),
            });
        }
    }
}
