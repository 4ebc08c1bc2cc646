//! The messages two replicas exchange, as Rust values.
//!
//! The protocol state machine speaks only these, and links carry them; the codec beside
//! this file turns them into framed, checksummed bytes and back. They live here, below
//! both [`protocol`](crate::protocol) and [`transport`](crate::transport), so a link
//! carries messages without knowing the state machine, and the protocol can be tested
//! without any encoding. [`crate::protocol`] re-exports them under their old paths.

use bytes::Bytes;

/// Version of the replication protocol; both sides must speak the same one.
///
/// 2: generations, bitmap and checksum resync, online verify. 3: [`Message::SyncRequest`]
/// (a replica that lost data asks its peer for a full resync; a version-2 peer could not
/// decode it and would drop the link where it should become the sync source).
/// 4: [`Message::ReplicaDetached`] (a node whose replica failed tells its peer that the
/// peer's replica is the only complete copy).
/// 5: [`Message::Scsi`] and [`Message::ScsiReply`] (the SCSI layers of both nodes
/// keep one logical unit's state together: reservations, COMPARE AND WRITE, resets).
pub const PROTOCOL_VERSION: u32 = 5;

/// Identifies one replicated disk across both nodes (set when the disk is created).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DiskId(pub [u8; 16]);

impl DiskId {
    /// A disk id derived from the disk's name, the same on both nodes.
    ///
    /// Until per-replica metadata stores an id chosen when the disk is created, two
    /// nodes agree on a disk by its name; this makes that agreement checkable in the
    /// handshake like a stored id will be.
    pub fn from_name(name: &str) -> DiskId {
        let mut id = [0u8; 16];
        for (i, chunk) in id.chunks_exact_mut(4).enumerate() {
            let mut h = crc32fast::Hasher::new_with_initial(0x7673_616e ^ i as u32);
            h.update(name.as_bytes());
            chunk.copy_from_slice(&h.finalize().to_be_bytes());
        }
        DiskId(id)
    }
}

impl std::fmt::Display for DiskId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A replica's data generation ids (DRBD's data generation UUIDs).
///
/// `current` names the data as it is now; `bitmap` is the `current` of the moment this
/// replica went on without its peer (0 when it has not), so the bitmap holds every
/// chunk changed since; `history` keeps the two generations before that. A new
/// `current` is made lazily, on the first write after the peer is lost. Comparing two
/// replicas' ids decides, in one step, whether they are in sync, which one is the sync
/// source, or whether they split (see `protocol::generations`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Generations {
    /// The current generation.
    pub current: u64,
    /// The generation the bitmap counts changes from (0: none).
    pub bitmap: u64,
    /// Older generations, newest first (0: none).
    pub history: [u64; 2],
}

/// The `current` generation of a replica created and never synced with its peer.
pub const GEN_JUST_CREATED: u64 = 4;

/// What each side announces first on a new link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The sender's node id.
    pub node_id: u32,
    /// The node id the sender expects to be talking to.
    pub peer_id: u32,
    /// The disk this link replicates.
    pub disk_id: DiskId,
    /// The disk's name (for messages).
    pub disk_name: String,
    /// Disk size in bytes.
    pub size: u64,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Bytes per bitmap bit (resync granularity).
    pub chunk_size: u64,
    /// The sender's generation ids.
    pub generations: Generations,
    /// Chunks the sender's bitmap marks out of sync.
    pub dirty_chunks: u64,
    /// The sender restarted after a crash and its bitmap holds the extents of its
    /// activity log (they may differ from the peer's).
    pub crashed: bool,
    /// The sender is a sync target whose resync has not finished: its data is not
    /// usable on its own.
    pub inconsistent: bool,
    /// The operator asked the sender to discard its data in a split brain.
    pub discard_my_data: bool,
    /// The sender's split-brain policy ([`SplitBrainPolicy::code`]); both must agree.
    pub split_brain_policy: u64,
}

/// What to do when both replicas were written while apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitBrainPolicy {
    /// Refuse to connect and report it on both nodes (an operator resolves it).
    #[default]
    Refuse,
    /// Discard the data of a node that made no changes while apart.
    DiscardZeroChanges,
    /// Discard the data of the node that changed fewer chunks (a tie is refused).
    DiscardLeastChanges,
    /// Discard the data of the given node.
    DiscardNode(u32),
}

impl SplitBrainPolicy {
    /// A number that names the policy on the wire.
    pub fn code(self) -> u64 {
        match self {
            SplitBrainPolicy::Refuse => 0,
            SplitBrainPolicy::DiscardZeroChanges => 1,
            SplitBrainPolicy::DiscardLeastChanges => 2,
            SplitBrainPolicy::DiscardNode(id) => 3 | (u64::from(id) << 8),
        }
    }

    /// The policy [`code`](Self::code) names, if any.
    pub fn from_code(code: u64) -> Option<SplitBrainPolicy> {
        match code & 0xff {
            0 if code == 0 => Some(SplitBrainPolicy::Refuse),
            1 if code == 1 => Some(SplitBrainPolicy::DiscardZeroChanges),
            2 if code == 2 => Some(SplitBrainPolicy::DiscardLeastChanges),
            3 => u32::try_from(code >> 8)
                .ok()
                .map(SplitBrainPolicy::DiscardNode),
            _ => None,
        }
    }
}

impl std::fmt::Display for SplitBrainPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SplitBrainPolicy::Refuse => write!(f, "refuse"),
            SplitBrainPolicy::DiscardZeroChanges => write!(f, "discard-zero-changes"),
            SplitBrainPolicy::DiscardLeastChanges => write!(f, "discard-least-changes"),
            SplitBrainPolicy::DiscardNode(id) => write!(f, "discard-node({id})"),
        }
    }
}

/// Outcome of a remote operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Done.
    Ok,
    /// Failed; the value is a `vsan_core::ErrorKind` discriminant (`ErrorKind as u32`).
    Failed(u32),
}

/// What a replicated write carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WritePayload {
    /// Data to write.
    Data(Bytes),
    /// Zeroes over `len` bytes.
    Zeroes {
        /// Length in bytes.
        len: u64,
    },
    /// Discard `len` bytes (reads back as zeroes).
    Discard {
        /// Length in bytes.
        len: u64,
    },
}

impl WritePayload {
    /// Bytes covered.
    pub fn len(&self) -> u64 {
        match self {
            WritePayload::Data(d) => d.len() as u64,
            WritePayload::Zeroes { len } | WritePayload::Discard { len } => *len,
        }
    }

    /// True if it covers nothing (never valid on the wire).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One protocol message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// First message on a link, sent by both sides.
    Hello(Hello),
    /// The peer's Hello was accepted; mirroring starts.
    Welcome,
    /// The peer's Hello was refused; the link will be closed.
    Refuse {
        /// Why, in words both operators will see.
        reason: String,
    },
    /// Apply a write to the receiver's replica.
    Write {
        /// Sender's request id, echoed in the ack.
        id: u64,
        /// Byte offset.
        offset: u64,
        /// What to write.
        payload: WritePayload,
        /// Durable on completion (FUA).
        fua: bool,
    },
    /// Write `id` has been applied to the receiver's replica (or failed).
    WriteAck {
        /// The write's id.
        id: u64,
        /// Outcome.
        status: Status,
    },
    /// Flush the receiver's replica.
    Flush {
        /// Request id.
        id: u64,
    },
    /// Flush `id` is done.
    FlushAck {
        /// The flush's id.
        id: u64,
        /// Outcome.
        status: Status,
    },
    /// Read from the receiver's replica (the sender's own replica cannot serve it).
    Read {
        /// Request id.
        id: u64,
        /// Byte offset.
        offset: u64,
        /// Length in bytes.
        len: u32,
    },
    /// Data for read `id` (empty when `status` is not Ok).
    ReadReply {
        /// The read's id.
        id: u64,
        /// Outcome.
        status: Status,
        /// The data.
        data: Bytes,
    },
    /// Liveness probe.
    Ping {
        /// Echoed in the Pong.
        id: u64,
    },
    /// Answer to a Ping.
    Pong {
        /// The Ping's id.
        id: u64,
    },
    /// Resync: the sender's out-of-sync chunks, as runs of chunk numbers, sent by both
    /// sides right after the handshake when a resync is due.
    SyncBitmap {
        /// `(first chunk, number of chunks)` runs, ascending and not overlapping.
        runs: Vec<(u64, u64)>,
    },
    /// Resync or verify: the sender's data for `[offset, offset + data.len())`; the
    /// receiver writes it (except where its own newer writes cover it) and answers
    /// `SyncAck`.
    SyncData {
        /// Byte offset (chunk aligned).
        offset: u64,
        /// The bytes.
        data: Bytes,
    },
    /// `SyncData` at `offset` was written (or failed), or a `SyncCrc` found equal data.
    SyncAck {
        /// The chunk's byte offset.
        offset: u64,
        /// Outcome.
        status: Status,
    },
    /// Checksum resync or online verify: the crc32 of the sender's chunk at `offset`.
    SyncCrc {
        /// Byte offset (chunk aligned).
        offset: u64,
        /// Bytes covered.
        len: u32,
        /// crc32 of those bytes.
        crc: u32,
        /// Online verify (true) or checksum resync (false).
        verify: bool,
    },
    /// Answer to `SyncCrc`: whether the receiver's chunk holds the same bytes.
    SyncCrcReply {
        /// The chunk's byte offset.
        offset: u64,
        /// Same crc on both sides.
        equal: bool,
        /// Echoes the `SyncCrc`'s flag.
        verify: bool,
    },
    /// Resync checkpoint: make everything synced so far durable and persist progress.
    SyncCheckpoint {
        /// Echoed in the ack.
        id: u64,
    },
    /// The checkpoint is durable on the receiver (or failed).
    SyncCheckpointAck {
        /// The checkpoint's id.
        id: u64,
        /// Outcome.
        status: Status,
    },
    /// The resync is complete: the target takes the source's generations.
    SyncDone {
        /// The source's generations.
        generations: Generations,
    },
    /// The sender's replica lost data it had acknowledged (a write-back cache whose
    /// fast device failed): the receiver becomes the source of a full checksum resync
    /// to it, aborting any resync or verify it runs. Sent while connected and in sync,
    /// right before the sender's `SyncBitmap`; a receiver that cannot be the source
    /// (its own replica is detached or inconsistent) refuses the link.
    SyncRequest,
    /// The sender's replica failed (or was detached by the operator) and is marked for
    /// a full resync: until a resync from the receiver completes, the receiver's
    /// replica is the only complete copy (so if it fails too, the receiver keeps it
    /// rather than distrusting it, and fails I/O until it is back).
    ReplicaDetached,
    /// A call from the sender's SCSI layer to the receiver's (opaque here: the mirror
    /// carries it in link order with the writes, and the receiver's handler answers it
    /// with [`Message::ScsiReply`]). Only on a connected link.
    Scsi {
        /// The sender's call id, echoed in the reply.
        id: u64,
        /// What the SCSI layer sends (at most [`MAX_DATA_LEN`](super::MAX_DATA_LEN) bytes).
        body: Bytes,
    },
    /// The answer to [`Message::Scsi`] `id`.
    ScsiReply {
        /// The call's id.
        id: u64,
        /// Outcome: a failure carries no body.
        status: Status,
        /// The handler's answer.
        body: Bytes,
    },
    /// Transport (lanes): the next message on this link is number `seq` of the lane
    /// group, so the receiver can put messages sent over several lanes back in order.
    /// Consumed by [`transport::lanes`](crate::transport::lanes); never reaches the
    /// protocol (an endpoint that receives one treats it as a protocol violation).
    LaneSeq {
        /// Position of the next message in the lane group's single order.
        seq: u64,
    },
    /// Transport (lanes): the first message on each link of a lane group, telling the
    /// acceptor which links belong together. Never reaches the protocol.
    LaneJoin {
        /// Random id shared by the group's links.
        group: u64,
        /// This link's position in the group, below `count`.
        index: u32,
        /// Links in the group (1 to 64).
        count: u32,
    },
}

impl Message {
    /// Bytes of write, read or resync data the message carries (0 for the others): what
    /// in-memory queues count against their limits.
    pub(crate) fn data_len(&self) -> usize {
        match self {
            Message::Write {
                payload: WritePayload::Data(d),
                ..
            } => d.len(),
            Message::ReadReply { data, .. } | Message::SyncData { data, .. } => data.len(),
            Message::Scsi { body, .. } | Message::ScsiReply { body, .. } => body.len(),
            _ => 0,
        }
    }
}
