//! Calls between the two nodes' SCSI layers ([`Message::Scsi`], [`Message::ScsiReply`]).
//!
//! The endpoint carries them and knows nothing of what they say: a call goes out only
//! on a connected link, in link order with the writes sent before it (the receiver
//! handles it after applying those writes' messages in order), and it fails with
//! [`ErrorKind::WrongState`] when the link is not up, or once the link it went out on
//! is lost. A caller whose call failed acts as the node that is left: the peer may or
//! may not have handled it.

use std::time::Instant;

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::super::message::{Message, Status};
use super::{Endpoint, Event, LinkState, RequestId, SyncRole};

impl Endpoint {
    /// Send a call to the peer's SCSI layer; it completes as a request
    /// ([`Event::Completed`] with the reply's body), or fails at once when the link is
    /// not connected.
    pub fn submit_scsi(&mut self, now: Instant, body: Bytes) -> RequestId {
        let req = self.request_id();
        if self.state != LinkState::Connected {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::WrongState),
            });
            return req;
        }
        self.scsi_calls.insert(req, ());
        self.send(now, Message::Scsi { id: req.0, body });
        req
    }

    /// Answer the peer's call `id` (from [`Event::ScsiRequest`] on link `epoch`); an
    /// answer for a link already gone is dropped (the caller saw its call fail).
    pub fn reply_scsi(
        &mut self,
        now: Instant,
        epoch: u64,
        id: u64,
        result: Result<Bytes, ErrorKind>,
    ) {
        if self.state != LinkState::Connected || epoch != self.link_epoch {
            return;
        }
        let (status, body) = match result {
            Ok(b) => (Status::Ok, b),
            Err(k) => (Status::Failed(k as u32), Bytes::new()),
        };
        self.send(now, Message::ScsiReply { id, status, body });
    }

    /// Whether the link is connected (a SCSI call can go out), and its epoch.
    pub fn scsi_link(&self) -> Option<u64> {
        (self.state == LinkState::Connected).then_some(self.link_epoch)
    }

    /// While connected: what this link's handshake decided about this node's replica,
    /// for the whole life of the link (the resync it started may have ended already):
    /// [`SyncRole::Source`] when this replica was the newer one, [`SyncRole::Target`]
    /// when the peer's was, `None` when they were in sync. The SCSI layers decide by it
    /// whose reservation state both keep, as the handshake decided whose data.
    pub fn link_role(&self) -> Option<SyncRole> {
        if self.state == LinkState::Connected {
            self.link_role
        } else {
            None
        }
    }

    pub(super) fn peer_scsi(&mut self, id: u64, body: Bytes) {
        self.events.push_back(Event::ScsiRequest {
            epoch: self.link_epoch,
            id,
            body,
        });
    }

    pub(super) fn peer_scsi_reply(&mut self, now: Instant, id: u64, status: Status, body: Bytes) {
        let req = RequestId(id);
        if self.scsi_calls.remove(&req).is_none() {
            return self.protocol_violation(now, format!("reply for unknown SCSI call {id}"));
        }
        let result = match status {
            Status::Ok => Ok(Some(body)),
            Status::Failed(code) => Err(ErrorKind::from_code(code)),
        };
        self.events.push_back(Event::Completed {
            request: req,
            result,
        });
    }

    /// The link is lost: every call sent on it fails.
    pub(super) fn fail_scsi_calls(&mut self) {
        for (req, ()) in self.scsi_calls.drain() {
            self.events.push_back(Event::Completed {
                request: req,
                result: Err(ErrorKind::WrongState),
            });
        }
    }
}
