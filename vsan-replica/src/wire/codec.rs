//! Messages to frames and back: [`encode`], [`decode`] and the rules both apply
//! ([`validate`]).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::header::{CRC_AT, Header, checksum};
use super::message::{DiskId, Generations, Hello, Message, Status, WritePayload};
use super::{HEADER_LEN, Kind, MAX_DATA_LEN, MAX_LANES, MAX_META_LEN, WireError, pb};

/// Bytes one `SyncBitmap` run takes in the data section: two little-endian u64.
const RUN_LEN: usize = 16;

/// One encoded frame: the header and meta in one small buffer, the data in another, so a
/// transport can hand both to one vectored write and a 4 KiB payload is never copied
/// into a frame buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    head: Bytes,
    data: Bytes,
}

impl Frame {
    /// Header and meta: the first bytes of the frame.
    pub fn head(&self) -> &Bytes {
        &self.head
    }

    /// The data section (empty for most kinds): the bytes after [`head`](Self::head).
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// Bytes in the whole frame.
    pub fn len(&self) -> usize {
        self.head.len() + self.data.len()
    }

    /// Always false: a frame has at least a header.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The head and the data, to write in that order.
    pub fn into_parts(self) -> (Bytes, Bytes) {
        (self.head, self.data)
    }
}

/// Checks `msg` against the rules every frame must follow, so nothing is sent that the
/// peer's decoder would refuse. [`decode`] applies the same check to what it receives.
///
/// The rules: writes, reads, resync data and resync crcs cover at least one byte and
/// their range does not pass `u64::MAX`; write data, read lengths and resync data are at
/// most [`MAX_DATA_LEN`]; a failed `ReadReply` carries no data; a `SyncBitmap`'s runs
/// are each non-empty, ascending and not overlapping (each starts at or after the
/// previous one's end), end at most at `u64::MAX`, and encode in at most
/// [`MAX_DATA_LEN`] bytes.
pub fn validate(msg: &Message) -> Result<(), WireError> {
    let kind = Kind::of(msg);
    let invalid = |reason| Err(WireError::Invalid { kind, reason });
    match msg {
        Message::Write {
            offset, payload, ..
        } => {
            if payload.is_empty() {
                return invalid("a write covers no bytes");
            }
            if matches!(payload, WritePayload::Data(data) if data.len() > MAX_DATA_LEN) {
                return invalid("write data exceeds MAX_DATA_LEN");
            }
            if offset.checked_add(payload.len()).is_none() {
                return invalid("write range passes u64::MAX");
            }
        }
        Message::Read { offset, len, .. } => {
            if *len == 0 {
                return invalid("a read covers no bytes");
            }
            if *len as usize > MAX_DATA_LEN {
                return invalid("read length exceeds MAX_DATA_LEN");
            }
            if offset.checked_add(u64::from(*len)).is_none() {
                return invalid("read range passes u64::MAX");
            }
        }
        Message::ReadReply { status, data, .. } => {
            if data.len() > MAX_DATA_LEN {
                return invalid("read data exceeds MAX_DATA_LEN");
            }
            if matches!(status, Status::Failed(_)) && !data.is_empty() {
                return invalid("a failed read carries data");
            }
        }
        Message::SyncBitmap { runs } => {
            if runs.len() > MAX_DATA_LEN / RUN_LEN {
                return invalid("bitmap runs exceed MAX_DATA_LEN");
            }
            let mut next = 0u64;
            for (i, &(first, count)) in runs.iter().enumerate() {
                if count == 0 {
                    return invalid("a bitmap run covers no chunks");
                }
                if i > 0 && first < next {
                    return invalid("bitmap runs are not ascending and disjoint");
                }
                let Some(end) = first.checked_add(count) else {
                    return invalid("bitmap run passes u64::MAX");
                };
                next = end;
            }
        }
        Message::SyncData { offset, data } => {
            if data.is_empty() {
                return invalid("resync data covers no bytes");
            }
            if data.len() > MAX_DATA_LEN {
                return invalid("resync data exceeds MAX_DATA_LEN");
            }
            if offset.checked_add(data.len() as u64).is_none() {
                return invalid("resync data range passes u64::MAX");
            }
        }
        Message::Scsi { body, .. } => {
            if body.len() > MAX_DATA_LEN {
                return invalid("a SCSI call exceeds MAX_DATA_LEN");
            }
        }
        Message::ScsiReply { status, body, .. } => {
            if body.len() > MAX_DATA_LEN {
                return invalid("a SCSI reply exceeds MAX_DATA_LEN");
            }
            if matches!(status, Status::Failed(_)) && !body.is_empty() {
                return invalid("a failed SCSI reply carries a body");
            }
        }
        Message::SyncCrc { offset, len, .. } => {
            if *len == 0 {
                return invalid("a resync crc covers no bytes");
            }
            if offset.checked_add(u64::from(*len)).is_none() {
                return invalid("resync crc range passes u64::MAX");
            }
        }
        Message::Hello(_)
        | Message::Welcome
        | Message::Refuse { .. }
        | Message::WriteAck { .. }
        | Message::Flush { .. }
        | Message::FlushAck { .. }
        | Message::Ping { .. }
        | Message::Pong { .. }
        | Message::SyncAck { .. }
        | Message::SyncCrcReply { .. }
        | Message::SyncCheckpoint { .. }
        | Message::SyncCheckpointAck { .. }
        | Message::SyncDone { .. }
        | Message::SyncRequest
        | Message::ReplicaDetached
        | Message::LaneSeq { .. } => {}
        Message::LaneJoin { index, count, .. } => {
            if *count == 0 || *count > MAX_LANES || index >= count {
                return Err(WireError::Invalid {
                    kind: Kind::LaneJoin,
                    reason: "lane index or count out of range",
                });
            }
        }
    }
    Ok(())
}

/// Encodes `msg` into a [`Frame`]. The data of a write, read reply or resync data is
/// shared, not copied; a `SyncBitmap`'s runs are encoded into a new data section.
///
/// Fails when `msg` breaks a rule of [`validate`] or its meta exceeds
/// [`MAX_META_LEN`] (a `Refuse` reason or disk name of tens of KiB).
pub fn encode(msg: &Message) -> Result<Frame, WireError> {
    encode_into_heads(msg, &mut BytesMut::new())
}

/// Encodes `msgs` in order, as [`encode`] does each, with their heads sharing one
/// buffer (one allocation for the batch, not one per frame): the frames a link sends
/// in one write.
pub fn encode_batch(msgs: &[Message]) -> Result<Vec<Frame>, WireError> {
    // Room for typical heads (header and a small meta); a larger one grows the buffer.
    let mut heads = BytesMut::with_capacity(msgs.len() * (HEADER_LEN + 32));
    msgs.iter()
        .map(|m| encode_into_heads(m, &mut heads))
        .collect()
}

/// [`encode`], the head written at the end of `heads` and split off it.
fn encode_into_heads(msg: &Message, heads: &mut BytesMut) -> Result<Frame, WireError> {
    validate(msg)?;
    let kind = Kind::of(msg);
    match msg {
        Message::Hello(h) => build(
            heads,
            kind,
            &pb::Hello {
                protocol_version: h.protocol_version,
                node_id: h.node_id,
                peer_id: h.peer_id,
                disk_id: h.disk_id.0.to_vec(),
                disk_name: h.disk_name.clone(),
                size: h.size,
                block_size: h.block_size,
                chunk_size: h.chunk_size,
                generations: Some(generations(&h.generations)),
                dirty_chunks: h.dirty_chunks,
                crashed: h.crashed,
                inconsistent: h.inconsistent,
                discard_my_data: h.discard_my_data,
                split_brain_policy: h.split_brain_policy,
            },
            Bytes::new(),
        ),
        Message::Welcome => build(heads, kind, &(), Bytes::new()),
        Message::Refuse { reason } => build(
            heads,
            kind,
            &pb::Refuse {
                reason: reason.clone(),
            },
            Bytes::new(),
        ),
        Message::Write {
            id,
            offset,
            payload,
            fua,
        } => {
            let (op, len, data) = match payload {
                WritePayload::Data(data) => (pb::WriteOp::Data, 0, data.clone()),
                WritePayload::Zeroes { len } => (pb::WriteOp::Zeroes, *len, Bytes::new()),
                WritePayload::Discard { len } => (pb::WriteOp::Discard, *len, Bytes::new()),
            };
            let meta = pb::Write {
                id: *id,
                offset: *offset,
                op: op.into(),
                len,
                fua: *fua,
            };
            build(heads, kind, &meta, data)
        }
        Message::WriteAck { id, status }
        | Message::FlushAck { id, status }
        | Message::SyncCheckpointAck { id, status } => {
            build(heads, kind, &reply(*id, *status), Bytes::new())
        }
        Message::ReadReply { id, status, data } => {
            build(heads, kind, &reply(*id, *status), data.clone())
        }
        Message::ScsiReply { id, status, body } => {
            build(heads, kind, &reply(*id, *status), body.clone())
        }
        Message::Scsi { id, body } => build(heads, kind, &pb::Token { id: *id }, body.clone()),
        Message::Flush { id }
        | Message::Ping { id }
        | Message::Pong { id }
        | Message::SyncCheckpoint { id } => {
            build(heads, kind, &pb::Token { id: *id }, Bytes::new())
        }
        Message::Read { id, offset, len } => build(
            heads,
            kind,
            &pb::Read {
                id: *id,
                offset: *offset,
                len: *len,
            },
            Bytes::new(),
        ),
        Message::SyncBitmap { runs } => {
            let mut data = BytesMut::with_capacity(runs.len() * RUN_LEN);
            for &(first, count) in runs {
                data.put_u64_le(first);
                data.put_u64_le(count);
            }
            let meta = pb::SyncBitmap {
                runs: runs.len() as u64,
            };
            build(heads, kind, &meta, data.freeze())
        }
        Message::SyncData { offset, data } => {
            build(heads, kind, &pb::SyncData { offset: *offset }, data.clone())
        }
        Message::SyncAck { offset, status } => build(
            heads,
            kind,
            &pb::SyncAck {
                offset: *offset,
                error: error_of(*status),
            },
            Bytes::new(),
        ),
        Message::SyncCrc {
            offset,
            len,
            crc,
            verify,
        } => build(
            heads,
            kind,
            &pb::SyncCrc {
                offset: *offset,
                len: *len,
                crc: *crc,
                verify: *verify,
            },
            Bytes::new(),
        ),
        Message::SyncCrcReply {
            offset,
            equal,
            verify,
        } => build(
            heads,
            kind,
            &pb::SyncCrcReply {
                offset: *offset,
                equal: *equal,
                verify: *verify,
            },
            Bytes::new(),
        ),
        Message::SyncDone { generations: g } => build(
            heads,
            kind,
            &pb::SyncDone {
                generations: Some(generations(g)),
            },
            Bytes::new(),
        ),
        Message::SyncRequest => build(heads, kind, &pb::SyncRequest {}, Bytes::new()),
        Message::ReplicaDetached => build(heads, kind, &pb::ReplicaDetached {}, Bytes::new()),
        Message::LaneSeq { seq } => build(heads, kind, &pb::Token { id: *seq }, Bytes::new()),
        Message::LaneJoin {
            group,
            index,
            count,
        } => build(
            heads,
            kind,
            &pb::LaneJoin {
                group: *group,
                index: *index,
                count: *count,
            },
            Bytes::new(),
        ),
    }
}

/// Encodes `msg` and appends the whole frame to `out` (copying the data once). For
/// tests and transports that write one contiguous buffer; [`encode`] avoids the copy.
pub fn encode_into(msg: &Message, out: &mut BytesMut) -> Result<(), WireError> {
    let frame = encode(msg)?;
    out.reserve(frame.len());
    out.extend_from_slice(&frame.head);
    out.extend_from_slice(&frame.data);
    Ok(())
}

/// Decodes the first frame in `buf` into a message.
///
/// Returns `Ok(None)` when `buf` does not hold a whole frame yet (nothing is consumed;
/// once the header is there, `buf` reserves room for the rest of the frame, at most
/// [`MAX_META_LEN`] + [`MAX_DATA_LEN`] bytes). Otherwise consumes exactly one frame and
/// returns its message, whose data is a zero-copy slice of `buf`. On error nothing
/// useful can follow: the stream is out of step and the link must be dropped.
pub fn decode(buf: &mut BytesMut) -> Result<Option<Message>, WireError> {
    let Some((kind, meta, data)) = decode_frame(buf)? else {
        return Ok(None);
    };
    let msg = match kind {
        Kind::Hello => {
            let m = meta_of::<pb::Hello>(kind, meta)?;
            let disk_id =
                <[u8; 16]>::try_from(m.disk_id.as_slice()).map_err(|_| WireError::Invalid {
                    kind,
                    reason: "disk id is not 16 bytes",
                })?;
            Message::Hello(Hello {
                protocol_version: m.protocol_version,
                node_id: m.node_id,
                peer_id: m.peer_id,
                disk_id: DiskId(disk_id),
                disk_name: m.disk_name,
                size: m.size,
                block_size: m.block_size,
                chunk_size: m.chunk_size,
                generations: generations_of(kind, m.generations)?,
                dirty_chunks: m.dirty_chunks,
                crashed: m.crashed,
                inconsistent: m.inconsistent,
                discard_my_data: m.discard_my_data,
                split_brain_policy: m.split_brain_policy,
            })
        }
        Kind::Welcome => Message::Welcome,
        Kind::Refuse => Message::Refuse {
            reason: meta_of::<pb::Refuse>(kind, meta)?.reason,
        },
        Kind::Write => {
            let m = meta_of::<pb::Write>(kind, meta)?;
            let op = pb::WriteOp::try_from(m.op).map_err(|_| WireError::Invalid {
                kind,
                reason: "unknown write op",
            })?;
            let payload = match op {
                pb::WriteOp::Data if m.len != 0 => {
                    return Err(WireError::Invalid {
                        kind,
                        reason: "a data write has a len field",
                    });
                }
                pb::WriteOp::Data => WritePayload::Data(data),
                _ if !data.is_empty() => {
                    return Err(WireError::Invalid {
                        kind,
                        reason: "a zeroes or discard write carries data",
                    });
                }
                pb::WriteOp::Zeroes => WritePayload::Zeroes { len: m.len },
                pb::WriteOp::Discard => WritePayload::Discard { len: m.len },
            };
            Message::Write {
                id: m.id,
                offset: m.offset,
                payload,
                fua: m.fua,
            }
        }
        Kind::WriteAck => {
            let (id, status) = reply_of(kind, meta)?;
            Message::WriteAck { id, status }
        }
        Kind::FlushAck => {
            let (id, status) = reply_of(kind, meta)?;
            Message::FlushAck { id, status }
        }
        Kind::ReadReply => {
            let (id, status) = reply_of(kind, meta)?;
            Message::ReadReply { id, status, data }
        }
        Kind::Flush => Message::Flush {
            id: meta_of::<pb::Token>(kind, meta)?.id,
        },
        Kind::Scsi => Message::Scsi {
            id: meta_of::<pb::Token>(kind, meta)?.id,
            body: data,
        },
        Kind::ScsiReply => {
            let (id, status) = reply_of(kind, meta)?;
            Message::ScsiReply {
                id,
                status,
                body: data,
            }
        }
        Kind::Ping => Message::Ping {
            id: meta_of::<pb::Token>(kind, meta)?.id,
        },
        Kind::Pong => Message::Pong {
            id: meta_of::<pb::Token>(kind, meta)?.id,
        },
        Kind::Read => {
            let m = meta_of::<pb::Read>(kind, meta)?;
            Message::Read {
                id: m.id,
                offset: m.offset,
                len: m.len,
            }
        }
        Kind::SyncBitmap => {
            let m = meta_of::<pb::SyncBitmap>(kind, meta)?;
            let expected = usize::try_from(m.runs)
                .ok()
                .and_then(|runs| runs.checked_mul(RUN_LEN));
            if expected != Some(data.len()) {
                return Err(WireError::Invalid {
                    kind,
                    reason: "bitmap data length is not 16 bytes per run",
                });
            }
            // The data section is at most MAX_DATA_LEN, so this allocation is bounded.
            let runs = data
                .chunks_exact(RUN_LEN)
                .map(|run| {
                    let (first, count) = run.split_at(8);
                    (le64(first), le64(count))
                })
                .collect();
            Message::SyncBitmap { runs }
        }
        Kind::SyncData => Message::SyncData {
            offset: meta_of::<pb::SyncData>(kind, meta)?.offset,
            data,
        },
        Kind::SyncAck => {
            let m = meta_of::<pb::SyncAck>(kind, meta)?;
            Message::SyncAck {
                offset: m.offset,
                status: status_of(m.error),
            }
        }
        Kind::SyncCrc => {
            let m = meta_of::<pb::SyncCrc>(kind, meta)?;
            Message::SyncCrc {
                offset: m.offset,
                len: m.len,
                crc: m.crc,
                verify: m.verify,
            }
        }
        Kind::SyncCrcReply => {
            let m = meta_of::<pb::SyncCrcReply>(kind, meta)?;
            Message::SyncCrcReply {
                offset: m.offset,
                equal: m.equal,
                verify: m.verify,
            }
        }
        Kind::SyncCheckpoint => Message::SyncCheckpoint {
            id: meta_of::<pb::Token>(kind, meta)?.id,
        },
        Kind::SyncCheckpointAck => {
            let (id, status) = reply_of(kind, meta)?;
            Message::SyncCheckpointAck { id, status }
        }
        Kind::SyncDone => Message::SyncDone {
            generations: generations_of(kind, meta_of::<pb::SyncDone>(kind, meta)?.generations)?,
        },
        Kind::SyncRequest => {
            meta_of::<pb::SyncRequest>(kind, meta)?;
            Message::SyncRequest
        }
        Kind::ReplicaDetached => {
            meta_of::<pb::ReplicaDetached>(kind, meta)?;
            Message::ReplicaDetached
        }
        Kind::LaneSeq => Message::LaneSeq {
            seq: meta_of::<pb::Token>(kind, meta)?.id,
        },
        Kind::LaneJoin => {
            let m = meta_of::<pb::LaneJoin>(kind, meta)?;
            Message::LaneJoin {
                group: m.group,
                index: m.index,
                count: m.count,
            }
        }
        Kind::AuthChallenge | Kind::AuthResponse => return Err(WireError::UnexpectedKind(kind)),
    };
    validate(&msg)?;
    Ok(Some(msg))
}

/// A transport-level authentication frame (kinds 64 and 65).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AuthFrame {
    /// A random nonce the peer must answer.
    Challenge(Vec<u8>),
    /// The answer: a MAC over the challenge.
    Response(Vec<u8>),
}

/// Encodes an authentication challenge.
pub(crate) fn encode_auth_challenge(nonce: &[u8]) -> Result<Frame, WireError> {
    let meta = pb::AuthChallenge {
        nonce: nonce.to_vec(),
    };
    build(
        &mut BytesMut::new(),
        Kind::AuthChallenge,
        &meta,
        Bytes::new(),
    )
}

/// Encodes an authentication response.
pub(crate) fn encode_auth_response(mac: &[u8]) -> Result<Frame, WireError> {
    let meta = pb::AuthResponse { mac: mac.to_vec() };
    build(
        &mut BytesMut::new(),
        Kind::AuthResponse,
        &meta,
        Bytes::new(),
    )
}

/// Decodes the first frame in `buf`, which must be an authentication frame; like
/// [`decode`] otherwise.
pub(crate) fn decode_auth(buf: &mut BytesMut) -> Result<Option<AuthFrame>, WireError> {
    let Some((kind, meta, _)) = decode_frame(buf)? else {
        return Ok(None);
    };
    Ok(Some(match kind {
        Kind::AuthChallenge => {
            AuthFrame::Challenge(meta_of::<pb::AuthChallenge>(kind, meta)?.nonce)
        }
        Kind::AuthResponse => AuthFrame::Response(meta_of::<pb::AuthResponse>(kind, meta)?.mac),
        other => return Err(WireError::UnexpectedKind(other)),
    }))
}

/// Splits the first whole, checksum-verified frame off `buf`: its kind, meta and data.
fn decode_frame(buf: &mut BytesMut) -> Result<Option<(Kind, Bytes, Bytes)>, WireError> {
    let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
        return Ok(None);
    };
    let header = Header::parse(head)?;
    let frame_len = header.frame_len();
    if buf.len() < frame_len {
        // Bounded by the limits Header::parse enforced.
        buf.reserve(frame_len - buf.len());
        return Ok(None);
    }
    let actual = checksum(&buf[..CRC_AT], &buf[HEADER_LEN..frame_len], &[]);
    if actual != header.crc {
        return Err(WireError::BadCrc {
            expected: header.crc,
            actual,
        });
    }
    let mut frame = buf.split_to(frame_len);
    frame.advance(HEADER_LEN);
    let meta = frame.split_to(header.meta_len).freeze();
    Ok(Some((header.kind, meta, frame.freeze())))
}

/// Builds a frame from its kind, meta and data.
fn build(
    heads: &mut BytesMut,
    kind: Kind,
    meta: &impl prost::Message,
    data: Bytes,
) -> Result<Frame, WireError> {
    let meta_len = meta.encoded_len();
    if meta_len > MAX_META_LEN {
        return Err(WireError::TooLarge {
            what: "meta",
            len: meta_len as u64,
            max: MAX_META_LEN as u64,
        });
    }
    if data.len() > MAX_DATA_LEN {
        return Err(WireError::TooLarge {
            what: "data",
            len: data.len() as u64,
            max: MAX_DATA_LEN as u64,
        });
    }
    heads.reserve(HEADER_LEN + meta_len);
    // Both lengths are within their limits, far below u32::MAX.
    Header::put(kind, meta_len as u32, data.len() as u32, heads);
    meta.encode(heads).map_err(|_| WireError::Invalid {
        kind,
        reason: "meta does not fit its buffer",
    })?;
    let mut head = heads.split();
    let crc = checksum(&head[..CRC_AT], &head[HEADER_LEN..], &data);
    head[CRC_AT..HEADER_LEN].copy_from_slice(&crc.to_be_bytes());
    Ok(Frame {
        head: head.freeze(),
        data,
    })
}

fn reply(id: u64, status: Status) -> pb::Reply {
    pb::Reply {
        id,
        error: error_of(status),
    }
}

fn reply_of(kind: Kind, meta: Bytes) -> Result<(u64, Status), WireError> {
    let m = meta_of::<pb::Reply>(kind, meta)?;
    Ok((m.id, status_of(m.error)))
}

/// A status as a reply's optional error field.
fn error_of(status: Status) -> Option<u32> {
    match status {
        Status::Ok => None,
        Status::Failed(code) => Some(code),
    }
}

/// A reply's optional error field as a status.
fn status_of(error: Option<u32>) -> Status {
    match error {
        None => Status::Ok,
        Some(code) => Status::Failed(code),
    }
}

fn generations(g: &Generations) -> pb::Generations {
    pb::Generations {
        current: g.current,
        bitmap: g.bitmap,
        history: g.history.to_vec(),
    }
}

/// Generations from a message field that must be present and hold two history entries.
fn generations_of(kind: Kind, g: Option<pb::Generations>) -> Result<Generations, WireError> {
    let invalid = |reason| WireError::Invalid { kind, reason };
    let g = g.ok_or(invalid("generations missing"))?;
    let history = <[u64; 2]>::try_from(g.history.as_slice())
        .map_err(|_| invalid("generations history is not 2 entries"))?;
    Ok(Generations {
        current: g.current,
        bitmap: g.bitmap,
        history,
    })
}

/// A little-endian u64 from the first 8 bytes (callers pass exactly 8; shorter input,
/// which cannot happen, reads as 0 rather than panicking).
fn le64(bytes: &[u8]) -> u64 {
    bytes
        .first_chunk::<8>()
        .map_or(0, |b| u64::from_le_bytes(*b))
}

fn meta_of<M: prost::Message + Default>(kind: Kind, meta: Bytes) -> Result<M, WireError> {
    M::decode(meta).map_err(|e| WireError::MalformedMeta {
        kind,
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{MAGIC, WIRE_VERSION};

    /// The documented layout, byte for byte: a change here is a wire format change.
    #[test]
    fn ping_frame_bytes_match_the_documented_layout() {
        let frame = encode(&Message::Ping { id: 5 }).unwrap();
        let head = frame.head();
        assert!(frame.data().is_empty());
        assert_eq!(&head[0..4], &MAGIC.to_be_bytes());
        assert_eq!(&head[0..4], b"VSRP");
        assert_eq!(head[4], WIRE_VERSION);
        assert_eq!(head[5], Kind::Ping as u8);
        assert_eq!(&head[6..8], &[0, 0]);
        assert_eq!(&head[8..12], &2u32.to_be_bytes(), "meta: field 1 varint 5");
        assert_eq!(&head[12..16], &0u32.to_be_bytes());
        assert_eq!(&head[20..], &[0x08, 5]);
        let mut h = crc32fast::Hasher::new();
        h.update(&head[..16]);
        h.update(&head[20..]);
        assert_eq!(&head[16..20], &h.finalize().to_be_bytes());
    }

    #[test]
    fn write_data_is_shared_on_encode_and_sliced_on_decode() {
        let data = Bytes::from(vec![7u8; 4096]);
        let msg = Message::Write {
            id: 1,
            offset: 8192,
            payload: WritePayload::Data(data.clone()),
            fua: true,
        };
        let frame = encode(&msg).unwrap();
        assert_eq!(
            frame.data().as_ptr(),
            data.as_ptr(),
            "encode copied the data"
        );

        let mut buf = BytesMut::new();
        encode_into(&msg, &mut buf).unwrap();
        let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let Some(Message::Write {
            payload: WritePayload::Data(got),
            ..
        }) = decode(&mut buf).unwrap()
        else {
            panic!("not a data write");
        };
        assert_eq!(got, data);
        assert!(
            range.contains(&(got.as_ptr() as usize)),
            "decode copied the data"
        );
        assert!(buf.is_empty());
    }

    #[test]
    fn sync_data_is_shared_on_encode_and_sliced_on_decode() {
        let data = Bytes::from(vec![3u8; 8192]);
        let msg = Message::SyncData {
            offset: 1 << 20,
            data: data.clone(),
        };
        let frame = encode(&msg).unwrap();
        assert_eq!(
            frame.data().as_ptr(),
            data.as_ptr(),
            "encode copied the data"
        );

        let mut buf = BytesMut::new();
        encode_into(&msg, &mut buf).unwrap();
        let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let Some(Message::SyncData { data: got, .. }) = decode(&mut buf).unwrap() else {
            panic!("not sync data");
        };
        assert_eq!(got, data);
        assert!(
            range.contains(&(got.as_ptr() as usize)),
            "decode copied the data"
        );
    }

    #[test]
    fn decode_reserves_room_for_a_partial_frame() {
        let msg = Message::ReadReply {
            id: 1,
            status: Status::Ok,
            data: Bytes::from(vec![1u8; 100_000]),
        };
        let mut whole = BytesMut::new();
        encode_into(&msg, &mut whole).unwrap();
        let mut buf = BytesMut::from(&whole[..HEADER_LEN]);
        assert_eq!(decode(&mut buf).unwrap(), None);
        assert!(buf.capacity() >= whole.len());
        assert_eq!(buf.len(), HEADER_LEN, "a partial frame is not consumed");
    }

    #[test]
    fn auth_frames_round_trip_and_stay_out_of_the_message_stream() {
        let mut buf = BytesMut::new();
        for frame in [
            encode_auth_challenge(&[1; 32]).unwrap(),
            encode_auth_response(&[2; 32]).unwrap(),
        ] {
            buf.extend_from_slice(frame.head());
        }
        let mut copy = buf.clone();
        assert_eq!(
            decode_auth(&mut buf).unwrap(),
            Some(AuthFrame::Challenge(vec![1; 32]))
        );
        assert_eq!(
            decode_auth(&mut buf).unwrap(),
            Some(AuthFrame::Response(vec![2; 32]))
        );
        assert_eq!(
            decode(&mut copy),
            Err(WireError::UnexpectedKind(Kind::AuthChallenge))
        );

        let mut hello = BytesMut::new();
        encode_into(&Message::Welcome, &mut hello).unwrap();
        assert_eq!(
            decode_auth(&mut hello),
            Err(WireError::UnexpectedKind(Kind::Welcome))
        );
    }

    #[test]
    fn every_kind_byte_round_trips() {
        for byte in 0..=u8::MAX {
            if let Some(kind) = Kind::from_u8(byte) {
                assert_eq!(kind as u8, byte);
            }
        }
    }
}
