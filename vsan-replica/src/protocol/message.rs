//! The messages two replicas exchange, as Rust values.
//!
//! The protocol state machine speaks only these; `crate::wire` turns them into framed,
//! checksummed bytes and back. Keeping the two apart lets the protocol be tested without
//! any encoding, and lets every transport share one codec.

use bytes::Bytes;

/// Version of the replication protocol; both sides must speak the same one.
pub const PROTOCOL_VERSION: u32 = 1;

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
    /// True when the sender knows its replica diverged from the peer's since they last
    /// talked (it wrote while degraded), so the link needs a resync before mirroring.
    pub needs_resync: bool,
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
}
