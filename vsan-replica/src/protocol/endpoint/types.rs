//! The endpoint's public vocabulary: its settings, the ids of requests and local
//! operations, the local I/O it asks for, the link state and the events it reports.

use std::time::Duration;

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::{StartupPolicy, SyncKind, SyncRole, SyncSummary};
use crate::protocol::message::{DiskId, SplitBrainPolicy, WritePayload};

/// Static settings of an endpoint.
#[derive(Debug, Clone)]
pub struct Config {
    /// This node's id.
    pub node_id: u32,
    /// The mirror partner's id.
    pub peer_id: u32,
    /// The replicated disk.
    pub disk_id: DiskId,
    /// The disk's name, for messages.
    pub disk_name: String,
    /// Disk size in bytes.
    pub size: u64,
    /// Logical block size.
    pub block_size: u32,
    /// No message from the peer (or no ack for a request) for this long means it is lost.
    pub peer_timeout: Duration,
    /// How often to ping an idle link.
    pub ping_interval: Duration,
    /// How long requests wait at start for the peer's first connection; then the
    /// startup policy (or, with a witness, the witness) decides.
    pub connect_timeout: Duration,
    /// What an unproven node does when its peer does not connect within
    /// `connect_timeout` and no witness is configured (see [`StartupPolicy`]).
    pub startup: StartupPolicy,
    /// What to do in a split brain.
    pub split_brain: SplitBrainPolicy,
    /// Resync speed and pacing.
    pub resync: ResyncConfig,
    /// Quorum policy when a witness is configured (`None`: no witness, a node that lost
    /// its peer goes on alone).
    pub quorum: Option<QuorumPolicy>,
    /// Seed for the generation ids this node makes: random from [`Config::new`] (two
    /// nodes, or two starts of one node, with the same seed would make the same "new"
    /// generations, and two sides written apart could look like one history); a
    /// simulation sets a fixed one.
    pub seed: u64,
}

/// How fast a resync (or online verify) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncRate {
    /// At most this many bytes per second, whatever the application does.
    Fixed(u64),
    /// As fast as possible (at most `max` bytes per second; 0: no cap) while the
    /// application is idle; one chunk at a time while it has I/O in flight.
    Dynamic {
        /// Cap in bytes per second (0: none).
        max: u64,
    },
}

/// Resync settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResyncConfig {
    /// Pacing.
    pub rate: ResyncRate,
    /// Chunks in flight at most.
    pub window: usize,
    /// How often progress is made durable on both nodes (a checkpoint); an interrupted
    /// resync resumes from the last one.
    pub checkpoint_interval: Duration,
}

impl Default for ResyncConfig {
    fn default() -> ResyncConfig {
        ResyncConfig {
            rate: ResyncRate::Dynamic { max: 0 },
            window: 64,
            checkpoint_interval: Duration::from_secs(1),
        }
    }
}

/// What a node without its peer and without quorum does with I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuorumPolicy {
    /// Fail it with [`ErrorKind::NoQuorum`].
    IoError,
    /// Hold it until the peer is back or quorum is granted.
    Suspend,
}

impl Config {
    /// A config with the default timeouts (peer 5 s, ping 1 s, first connection 5 s), no
    /// witness, startup policy wait-for-peer, split brains refused, dynamic resync rate, a random generation seed.
    pub fn new(
        node_id: u32,
        peer_id: u32,
        disk_id: DiskId,
        disk_name: &str,
        size: u64,
        block_size: u32,
    ) -> Config {
        Config {
            node_id,
            peer_id,
            disk_id,
            disk_name: disk_name.to_string(),
            size,
            block_size,
            peer_timeout: Duration::from_secs(5),
            ping_interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            startup: StartupPolicy::WaitForPeer,
            split_brain: SplitBrainPolicy::Refuse,
            resync: ResyncConfig::default(),
            quorum: None,
            seed: rand::random(),
        }
    }
}

/// A caller's request (write, flush, read), echoed in its completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A local replica operation the driver runs and reports back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalOpId(pub u64);

/// I/O the driver must perform on the local replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalIo {
    /// Write (data, zeroes or discard) at `offset`.
    Write {
        /// Report back with this id.
        op: LocalOpId,
        /// Byte offset.
        offset: u64,
        /// What to write.
        payload: WritePayload,
        /// With FUA.
        fua: bool,
    },
    /// Flush the local replica.
    Flush {
        /// Report back with this id.
        op: LocalOpId,
    },
    /// Read from the local replica.
    Read {
        /// Report back with this id.
        op: LocalOpId,
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u32,
        /// A resync or verify read: run it with `BlockDevice::read_once`.
        once: bool,
    },
    /// Write these blocks of the metadata area, then make them durable. With
    /// `flush_data`, flush the local replica first (the metadata is about to forget
    /// writes that must be durable by then).
    Meta {
        /// Report back with this id.
        op: LocalOpId,
        /// `(offset in the metadata area, bytes)`, block aligned.
        writes: Vec<(u64, Bytes)>,
        /// Flush the replica before writing.
        flush_data: bool,
    },
}

impl LocalIo {
    /// The id to report it back with.
    pub fn op(&self) -> LocalOpId {
        match self {
            LocalIo::Write { op, .. }
            | LocalIo::Flush { op }
            | LocalIo::Read { op, .. }
            | LocalIo::Meta { op, .. } => *op,
        }
    }
}

/// The outcome of a local operation, reported by the driver.
pub type LocalResult = Result<Option<Bytes>, ErrorKind>;

/// Where the link to the peer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkState {
    /// No link yet, never connected.
    Waiting,
    /// Link up, Hellos being exchanged.
    Handshaking,
    /// Mirroring.
    Connected,
    /// The peer was lost (or never came); writes complete on this node alone.
    Degraded,
}

/// Something the caller or operator should know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request finished. Reads carry their data.
    Completed {
        /// Which request.
        request: RequestId,
        /// Outcome.
        result: Result<Option<Bytes>, ErrorKind>,
    },
    /// The handshake succeeded; writes are mirrored from now on.
    Connected,
    /// The handshake failed; the driver must close the link. `reason` is shown on both
    /// nodes.
    Refused {
        /// Why.
        reason: String,
    },
    /// The peer is gone; the driver must close the link. I/O continues on this node.
    PeerLost {
        /// Why.
        reason: String,
    },
    /// The local replica failed and is detached; I/O is served through the peer.
    LocalDetached {
        /// The failure.
        reason: String,
    },
    /// The local replica lost data it had acknowledged (see
    /// [`Endpoint::local_data_lost`](super::Endpoint::local_data_lost)); `action` says, in words for the operator, what
    /// the endpoint did about it (a checksum resync from the peer, a detach, or I/O
    /// failing until the peer is back).
    LocalDataLost {
        /// What happens now.
        action: String,
    },
    /// The peer is gone and a witness is configured: the driver must ask it for the
    /// disk's grant and report with [`Endpoint::handle_quorum`](super::Endpoint::handle_quorum).
    NeedQuorum,
    /// The replicas are in sync again: the driver releases the witness's grant.
    ReleaseQuorum,
    /// A resync or verify started.
    SyncStarted {
        /// This node's role.
        role: SyncRole,
        /// Bitmap, checksum or verify.
        kind: SyncKind,
        /// Bytes to go through.
        total_bytes: u64,
    },
    /// A resync or verify ended (finished or interrupted).
    SyncEnded(SyncSummary),
    /// The peer's SCSI layer called this node's ([`Message::Scsi`](super::super::message::Message::Scsi)):
    /// the driver hands `body` to the SCSI handler and answers with
    /// [`Endpoint::reply_scsi`](super::Endpoint::reply_scsi)`(epoch, id, ...)`.
    ScsiRequest {
        /// The link the call came on.
        epoch: u64,
        /// The peer's call id.
        id: u64,
        /// What the peer's SCSI layer sent.
        body: Bytes,
    },
}
