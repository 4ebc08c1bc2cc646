//! What a mirrored disk reports about itself: [`MirrorStatus`], built from the
//! endpoint's state and what the driver saw beside it.

use std::sync::Arc;
use std::time::SystemTime;

use crate::protocol::{
    Endpoint, Freshness, Generations, LinkState, SyncKind, SyncRole, SyncSummary,
};

/// What a mirrored disk reports about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorStatus {
    /// The link to the peer.
    pub link: LinkState,
    /// Whether a link is attached right now (handshaking or connected).
    pub link_attached: bool,
    /// The transport carrying the attached link ("tcp", "quic", "loopback", "shm",
    /// "tcp*4" (four lanes), ...; see [`LinkTx::transport`](crate::transport::LinkTx::transport)):
    /// where a transport fell back to another (RDMA to TCP), the one in use.
    pub link_transport: Option<Arc<str>>,
    /// The local replica failed and I/O goes through the peer.
    pub local_detached: bool,
    /// This replica has writes the peer lacks (a resync is needed before mirroring).
    pub diverged: bool,
    /// The last refusal or loss reason, if any.
    pub last_problem: Option<String>,
    /// Chunks this replica's bitmap marks out of sync.
    pub dirty_chunks: u64,
    /// This replica's generation ids.
    pub generations: Generations,
    /// An unfinished sync target: not usable without the peer.
    pub inconsistent: bool,
    /// A resync or verify is running (see [`MirroredDisk::sync_progress`](super::MirroredDisk::sync_progress)).
    pub syncing: bool,
    /// The last resync or verify that started (it may have ended since).
    pub last_sync_start: Option<SyncStart>,
    /// How the last resync or verify ended.
    pub last_sync: Option<SyncSummary>,
    /// With a witness: whether this node may serve I/O without its peer.
    pub quorum: Option<bool>,
    /// Requests are held until quorum or the peer returns.
    pub suspended: bool,
    /// How many times the local replica reported losing data it had acknowledged
    /// (its [`BlockDevice::data_loss_count`](vsan_core::BlockDevice::data_loss_count) grew) since this disk started; each time it
    /// was resynced from the peer or detached (see `last_problem`).
    pub local_data_lost: u64,
    /// Whether the local replica is proven current since this disk started: while it is
    /// [`Freshness::Unproven`], nothing is served from it (requests wait for the proof,
    /// bounded by the connect timeout, and never get stale data).
    pub freshness: Freshness,
    /// While unproven: since when (the disk's start).
    pub unproven_since: Option<SystemTime>,
    /// While connected: which link this is (a number that grows with every new link),
    /// so that a watcher that missed a drop and a reconnect between two looks still
    /// sees a new link.
    pub link_epoch: Option<u64>,
    /// While connected: what the link's handshake decided about this node's replica
    /// (see [`Endpoint::link_role`](crate::protocol::Endpoint::link_role)).
    pub link_role: Option<SyncRole>,
}

/// Whether a node can serve a mirrored disk's I/O now, as a front door reports it to
/// clients that can choose another path (iSCSI's ALUA states, see
/// [`MirrorStatus::serving`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serving {
    /// I/O is served (mirrored, degraded, or through the peer while a resync runs).
    Ready,
    /// I/O waits: the replica is not yet proven current, or requests are held until
    /// quorum or the peer returns. It may become ready by itself (ALUA: transitioning).
    Waiting,
    /// I/O cannot be served here (ALUA: unavailable): no complete copy is reachable
    /// from this node, or quorum is lost with the io-error policy, or the node is
    /// shutting down.
    Unable,
}

impl MirrorStatus {
    /// Whether this node serves the disk's I/O now.
    ///
    /// | state | serving |
    /// |---|---|
    /// | replica not yet proven current after a start | `Waiting` |
    /// | requests held for quorum (policy suspend) | `Waiting` |
    /// | quorum lost (policy io-error) | `Unable` |
    /// | local replica detached or an unfinished sync target, and the peer not connected | `Unable` |
    /// | otherwise: connected (in sync or resyncing), or degraded with a current replica | `Ready` |
    pub fn serving(&self) -> Serving {
        let connected = self.link == LinkState::Connected;
        if !self.freshness.is_current() || self.suspended {
            Serving::Waiting
        } else if !connected
            && (self.quorum == Some(false) || self.local_detached || self.inconsistent)
        {
            Serving::Unable
        } else {
            Serving::Ready
        }
    }

    /// Whether the peer serves the disk's I/O, as far as this node knows: `Ready` while
    /// the link is connected (the peer proved its replica in the handshake, and serves
    /// unsynced ranges through this node during a resync), `Unable` otherwise (the peer
    /// is away or not yet proven; it reports its own state on its own path).
    pub fn peer_serving(&self) -> Serving {
        if self.link == LinkState::Connected {
            Serving::Ready
        } else {
            Serving::Unable
        }
    }

    /// [`MirrorStatus::unproven_since`] in milliseconds since the Unix epoch; 0 when
    /// the replica is proven current.
    pub fn unproven_since_unix_ms(&self) -> u64 {
        self.unproven_since.map_or(0, |t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        })
    }
}

/// A resync or verify that started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncStart {
    /// Counts the starts of this disk's driver (1 for the first).
    pub number: u64,
    /// This node's role.
    pub role: SyncRole,
    /// The kind of pass.
    pub kind: SyncKind,
    /// Bytes to go through.
    pub total_bytes: u64,
}

/// What the driver knows beside the endpoint, for the status.
pub(super) struct Observed {
    pub(super) syncing: bool,
    pub(super) link_transport: Option<Arc<str>>,
    pub(super) last_problem: Option<String>,
    pub(super) last_sync_start: Option<SyncStart>,
    pub(super) local_data_lost: u64,
    pub(super) started: SystemTime,
}

impl Default for Observed {
    fn default() -> Observed {
        Observed {
            syncing: false,
            link_transport: None,
            last_problem: None,
            last_sync_start: None,
            local_data_lost: 0,
            started: SystemTime::UNIX_EPOCH,
        }
    }
}

pub(super) fn status_of(ep: &Endpoint, o: Observed) -> MirrorStatus {
    let Observed {
        syncing,
        link_transport,
        last_problem,
        last_sync_start,
        local_data_lost,
        started,
    } = o;
    let freshness = ep.freshness();
    MirrorStatus {
        link: ep.state(),
        link_attached: link_transport.is_some(),
        link_transport,
        local_detached: ep.is_detached(),
        diverged: ep.is_diverged(),
        last_problem,
        dirty_chunks: ep.dirty_chunks(),
        generations: ep.generations(),
        inconsistent: ep.is_inconsistent(),
        syncing,
        last_sync_start,
        last_sync: ep.last_sync(),
        quorum: ep.has_quorum(),
        suspended: ep.quorum_suspended(),
        local_data_lost,
        freshness,
        unproven_since: (!freshness.is_current()).then_some(started),
        link_epoch: ep.scsi_link(),
        link_role: ep.link_role(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Awaiting, Proof};

    fn connected() -> MirrorStatus {
        MirrorStatus {
            link: LinkState::Connected,
            link_attached: true,
            link_transport: Some("tcp".into()),
            local_detached: false,
            diverged: false,
            last_problem: None,
            dirty_chunks: 0,
            generations: Generations::default(),
            inconsistent: false,
            syncing: false,
            last_sync_start: None,
            last_sync: None,
            quorum: None,
            suspended: false,
            local_data_lost: 0,
            freshness: Freshness::Current(Proof::Handshake),
            unproven_since: None,
            link_epoch: Some(1),
            link_role: None,
        }
    }

    #[test]
    fn serving_follows_the_mirror_state() {
        use Serving::*;
        let cases: Vec<(&str, MirrorStatus, Serving, Serving)> = vec![
            ("in sync", connected(), Ready, Ready),
            (
                "resync target (reads of unsynced chunks go to the source)",
                MirrorStatus {
                    inconsistent: true,
                    syncing: true,
                    ..connected()
                },
                Ready,
                Ready,
            ),
            (
                "local replica detached, served through the peer",
                MirrorStatus {
                    local_detached: true,
                    ..connected()
                },
                Ready,
                Ready,
            ),
            (
                "degraded, peer away",
                MirrorStatus {
                    link: LinkState::Degraded,
                    link_attached: false,
                    dirty_chunks: 7,
                    ..connected()
                },
                Ready,
                Unable,
            ),
            (
                "restarted, not yet proven current",
                MirrorStatus {
                    link: LinkState::Handshaking,
                    freshness: Freshness::Unproven {
                        awaiting: Awaiting::PeerOrOperator,
                    },
                    unproven_since: Some(SystemTime::UNIX_EPOCH),
                    ..connected()
                },
                Waiting,
                Unable,
            ),
            (
                "held for quorum",
                MirrorStatus {
                    link: LinkState::Degraded,
                    quorum: Some(false),
                    suspended: true,
                    ..connected()
                },
                Waiting,
                Unable,
            ),
            (
                "quorum lost, io-error policy",
                MirrorStatus {
                    link: LinkState::Degraded,
                    quorum: Some(false),
                    ..connected()
                },
                Unable,
                Unable,
            ),
            (
                "detached with the peer away",
                MirrorStatus {
                    link: LinkState::Degraded,
                    local_detached: true,
                    ..connected()
                },
                Unable,
                Unable,
            ),
            (
                "unfinished sync target with the source away",
                MirrorStatus {
                    link: LinkState::Degraded,
                    inconsistent: true,
                    ..connected()
                },
                Unable,
                Unable,
            ),
        ];
        for (what, status, own, peer) in cases {
            assert_eq!(status.serving(), own, "{what}: this node");
            assert_eq!(status.peer_serving(), peer, "{what}: the peer");
        }
    }
}
