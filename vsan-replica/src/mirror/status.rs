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
}

impl MirrorStatus {
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
    }
}
