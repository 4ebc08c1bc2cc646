//! The mirror as the SCSI layer's link to the other node (issue 20): one
//! [`MirrorPeer`] per mirrored disk's logical unit is both the unit's
//! [`ScsiPeer`] (its calls ride the mirror link, in order with the writes) and the
//! mirror's [`ScsiHandler`] (the other node's calls reach the unit here).

use std::sync::{Arc, Weak};

use bytes::Bytes;
use tokio::sync::watch;
use vsan_core::device::IoFuture;
use vsan_core::scsi::{BackgroundTask, LogicalUnit, PeerLink, ScsiPeer};
use vsan_core::{BlockDevice, ErrorKind};
use vsan_replica::protocol::{LinkState, SyncRole};
use vsan_replica::{MirrorStatus, MirroredDisk, ScsiFuture, ScsiHandler};

/// See the module docs.
pub(super) struct MirrorPeer {
    disk: MirroredDisk,
    resolver: bool,
    status: watch::Receiver<MirrorStatus>,
    lu: Weak<LogicalUnit>,
    /// The runtime the unit's background work runs on when it is started from outside
    /// one (a guard dropped on a foreign thread).
    runtime: Option<tokio::runtime::Handle>,
}

impl MirrorPeer {
    /// Link `lu` (over `disk`) with the other node's unit: sets the unit's peer and the
    /// mirror's SCSI handler. `resolver`: this node has the lower node id.
    pub(super) fn link(disk: &MirroredDisk, lu: &Arc<LogicalUnit>, resolver: bool) {
        let peer = Arc::new(MirrorPeer {
            disk: disk.clone(),
            resolver,
            status: disk.watch_status(),
            lu: Arc::downgrade(lu),
            runtime: tokio::runtime::Handle::try_current().ok(),
        });
        let handler: Arc<dyn ScsiHandler> = peer.clone();
        disk.set_scsi_handler(Arc::downgrade(&handler));
        lu.set_peer(peer);
    }
}

/// How the unit sees the mirror link in `status`: what the link's handshake decided
/// about this node's replica, for the life of the link (a resync it started may be over
/// by the time the units settle their reservation state: the decision still holds).
pub(super) fn peer_link(status: &MirrorStatus) -> PeerLink {
    if status.link != LinkState::Connected {
        return PeerLink::Away;
    }
    match status.link_role {
        Some(SyncRole::Source) => PeerLink::Source,
        Some(SyncRole::Target) => PeerLink::Target,
        None => PeerLink::InSync,
    }
}

impl ScsiPeer for MirrorPeer {
    fn is_resolver(&self) -> bool {
        self.resolver
    }

    fn link(&self) -> PeerLink {
        peer_link(&self.status.borrow())
    }

    fn call(&self, msg: Bytes) -> IoFuture<'_, Bytes> {
        Box::pin(self.disk.scsi_call(msg))
    }

    fn changed_alone(&self) -> IoFuture<'_, ()> {
        self.disk.flush()
    }

    fn link_id(&self) -> u64 {
        self.status.borrow().link_epoch.unwrap_or(0)
    }

    fn spawn(&self, task: BackgroundTask) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn(task)),
            Err(_) => match &self.runtime {
                Some(rt) => drop(rt.spawn(task)),
                None => tracing::warn!(
                    "a SCSI background task (a stripe lock for the other node, or its release) had no runtime to run on"
                ),
            },
        }
    }
}

impl ScsiHandler for MirrorPeer {
    fn call(&self, body: Bytes) -> ScsiFuture {
        let lu = self.lu.upgrade();
        Box::pin(async move {
            match lu {
                Some(lu) => lu.on_peer_message(body).await.map_err(|e| {
                    tracing::warn!("a SCSI call from the other node failed: {e}");
                    e.kind()
                }),
                None => Err(ErrorKind::Closed),
            }
        })
    }
}
