//! The fixed 20-byte frame header: its fields, limits and checks.

use bytes::BufMut;

use super::WireError;
use super::message::Message;

/// First four bytes of every frame: "VSRP".
pub const MAGIC: u32 = 0x5653_5250;
/// Version of the frame layout this crate writes and reads.
pub const WIRE_VERSION: u8 = 1;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 20;
/// Largest meta section a decoder accepts (64 KiB).
pub const MAX_META_LEN: usize = 64 * 1024;
/// Largest data section a decoder accepts (64 MiB): the largest write, read or resync
/// data a frame carries, and the largest encoded resync bitmap (4 Mi runs).
pub const MAX_DATA_LEN: usize = 64 * 1024 * 1024;

/// Most links in one lane group ([`Message::LaneJoin`]'s `count`).
pub const MAX_LANES: u32 = 64;

/// Byte range of the crc field inside the header; the crc covers the bytes before it.
pub(super) const CRC_AT: usize = 16;

/// What a frame holds: the `kind` byte of the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum Kind {
    /// [`Message::Hello`].
    Hello = 1,
    /// [`Message::Welcome`].
    Welcome = 2,
    /// [`Message::Refuse`].
    Refuse = 3,
    /// [`Message::Write`].
    Write = 4,
    /// [`Message::WriteAck`].
    WriteAck = 5,
    /// [`Message::Flush`].
    Flush = 6,
    /// [`Message::FlushAck`].
    FlushAck = 7,
    /// [`Message::Read`].
    Read = 8,
    /// [`Message::ReadReply`].
    ReadReply = 9,
    /// [`Message::Ping`].
    Ping = 10,
    /// [`Message::Pong`].
    Pong = 11,
    /// [`Message::SyncBitmap`].
    SyncBitmap = 12,
    /// [`Message::SyncData`].
    SyncData = 13,
    /// [`Message::SyncAck`].
    SyncAck = 14,
    /// [`Message::SyncCrc`].
    SyncCrc = 15,
    /// [`Message::SyncCrcReply`].
    SyncCrcReply = 16,
    /// [`Message::SyncCheckpoint`].
    SyncCheckpoint = 17,
    /// [`Message::SyncCheckpointAck`].
    SyncCheckpointAck = 18,
    /// [`Message::SyncDone`].
    SyncDone = 19,
    /// [`Message::SyncRequest`].
    SyncRequest = 20,
    /// [`Message::ReplicaDetached`].
    ReplicaDetached = 21,
    /// [`Message::Scsi`].
    Scsi = 22,
    /// [`Message::ScsiReply`].
    ScsiReply = 23,
    /// Transport authentication: a challenge (never reaches the protocol).
    AuthChallenge = 64,
    /// Transport authentication: the answer to a challenge (never reaches the protocol).
    AuthResponse = 65,
    /// [`Message::LaneSeq`]: transport sequencing over lanes (never reaches the protocol).
    LaneSeq = 66,
    /// [`Message::LaneJoin`]: the first frame of each lane (never reaches the protocol).
    LaneJoin = 67,
}

impl Kind {
    /// The kind for a header byte, if it names one.
    pub fn from_u8(value: u8) -> Option<Kind> {
        Some(match value {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Refuse,
            4 => Kind::Write,
            5 => Kind::WriteAck,
            6 => Kind::Flush,
            7 => Kind::FlushAck,
            8 => Kind::Read,
            9 => Kind::ReadReply,
            10 => Kind::Ping,
            11 => Kind::Pong,
            12 => Kind::SyncBitmap,
            13 => Kind::SyncData,
            14 => Kind::SyncAck,
            15 => Kind::SyncCrc,
            16 => Kind::SyncCrcReply,
            17 => Kind::SyncCheckpoint,
            18 => Kind::SyncCheckpointAck,
            19 => Kind::SyncDone,
            20 => Kind::SyncRequest,
            21 => Kind::ReplicaDetached,
            22 => Kind::Scsi,
            23 => Kind::ScsiReply,
            64 => Kind::AuthChallenge,
            65 => Kind::AuthResponse,
            66 => Kind::LaneSeq,
            67 => Kind::LaneJoin,
            _ => return None,
        })
    }

    /// The kind of frame that carries `msg`.
    pub fn of(msg: &Message) -> Kind {
        match msg {
            Message::Hello(_) => Kind::Hello,
            Message::Welcome => Kind::Welcome,
            Message::Refuse { .. } => Kind::Refuse,
            Message::Write { .. } => Kind::Write,
            Message::WriteAck { .. } => Kind::WriteAck,
            Message::Flush { .. } => Kind::Flush,
            Message::FlushAck { .. } => Kind::FlushAck,
            Message::Read { .. } => Kind::Read,
            Message::ReadReply { .. } => Kind::ReadReply,
            Message::Ping { .. } => Kind::Ping,
            Message::Pong { .. } => Kind::Pong,
            Message::SyncBitmap { .. } => Kind::SyncBitmap,
            Message::SyncData { .. } => Kind::SyncData,
            Message::SyncAck { .. } => Kind::SyncAck,
            Message::SyncCrc { .. } => Kind::SyncCrc,
            Message::SyncCrcReply { .. } => Kind::SyncCrcReply,
            Message::SyncCheckpoint { .. } => Kind::SyncCheckpoint,
            Message::SyncCheckpointAck { .. } => Kind::SyncCheckpointAck,
            Message::SyncDone { .. } => Kind::SyncDone,
            Message::SyncRequest => Kind::SyncRequest,
            Message::ReplicaDetached => Kind::ReplicaDetached,
            Message::Scsi { .. } => Kind::Scsi,
            Message::ScsiReply { .. } => Kind::ScsiReply,
            Message::LaneSeq { .. } => Kind::LaneSeq,
            Message::LaneJoin { .. } => Kind::LaneJoin,
        }
    }

    /// Whether frames of this kind may have a data section: write data, read data, a
    /// resync bitmap's runs, resync data and SCSI call bodies.
    pub fn carries_data(self) -> bool {
        matches!(
            self,
            Kind::Write
                | Kind::ReadReply
                | Kind::SyncBitmap
                | Kind::SyncData
                | Kind::Scsi
                | Kind::ScsiReply
        )
    }

    /// Whether frames of this kind may have a meta section.
    pub fn carries_meta(self) -> bool {
        !matches!(self, Kind::Welcome)
    }
}

/// A parsed header whose fixed fields (magic, version, flags) are already checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub kind: Kind,
    pub meta_len: usize,
    pub data_len: usize,
    pub crc: u32,
}

impl Header {
    /// Parses and checks a header: everything that can be judged before the rest of the
    /// frame has arrived, so a bad or oversized frame is refused before it is buffered.
    pub fn parse(bytes: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        let be32 = |at: usize| {
            u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let magic = be32(0);
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        if bytes[4] != WIRE_VERSION {
            return Err(WireError::UnsupportedVersion(bytes[4]));
        }
        let kind = Kind::from_u8(bytes[5]).ok_or(WireError::UnknownKind(bytes[5]))?;
        let flags = u16::from_be_bytes([bytes[6], bytes[7]]);
        if flags != 0 {
            return Err(WireError::ReservedFlags(flags));
        }
        let meta_len = be32(8) as usize;
        let data_len = be32(12) as usize;
        if meta_len > MAX_META_LEN {
            return Err(WireError::TooLarge {
                what: "meta",
                len: meta_len as u64,
                max: MAX_META_LEN as u64,
            });
        }
        if data_len > MAX_DATA_LEN {
            return Err(WireError::TooLarge {
                what: "data",
                len: data_len as u64,
                max: MAX_DATA_LEN as u64,
            });
        }
        if meta_len > 0 && !kind.carries_meta() {
            return Err(WireError::UnexpectedSection {
                kind,
                section: "meta",
                len: meta_len as u64,
            });
        }
        if data_len > 0 && !kind.carries_data() {
            return Err(WireError::UnexpectedSection {
                kind,
                section: "data",
                len: data_len as u64,
            });
        }
        Ok(Header {
            kind,
            meta_len,
            data_len,
            crc: be32(CRC_AT),
        })
    }

    /// Bytes of the whole frame this header starts.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.meta_len + self.data_len
    }

    /// Writes the header with a zero crc; the caller fills the crc in once the meta and
    /// data are known.
    pub fn put(kind: Kind, meta_len: u32, data_len: u32, out: &mut impl BufMut) {
        out.put_u32(MAGIC);
        out.put_u8(WIRE_VERSION);
        out.put_u8(kind as u8);
        out.put_u16(0);
        out.put_u32(meta_len);
        out.put_u32(data_len);
        out.put_u32(0);
    }
}

/// The frame checksum: header bytes before the crc field, then meta, then data.
pub(super) fn checksum(header_prefix: &[u8], meta: &[u8], data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(header_prefix);
    h.update(meta);
    h.update(data);
    h.finalize()
}
