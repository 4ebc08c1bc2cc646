//! The properties the fuzz targets check on the replication wire codec
//! (`vsan_replica::wire`), one function per target, so each target is a one-line
//! wrapper and a crash input can be replayed from a plain test too.
//!
//! * [`check_stream`] (`frame_decode`): the input is a byte stream from a peer.
//! * [`check_sealed`] (`frame_sealed`): the input is one frame's kind, meta and data,
//!   put behind a correct header and crc ([`seal`]), so the meta parser and the
//!   message rules are reached, which a random crc almost never allows.
//! * [`check_roundtrip`] (`frame_roundtrip`): the input chooses a message
//!   ([`message`]), which is encoded and decoded.
//!
//! The metadata targets (`meta_superblock`, `meta_al`, `meta_open`) check
//! `vsan_replica::meta`; their checks are in [`meta`], a file the main workspace's
//! `tests/meta_corpus.rs` compiles in too.

pub mod meta;

use arbitrary::Unstructured;
use bytes::{Bytes, BytesMut};
use vsan_replica::protocol::{DiskId, Generations, Hello, Message, Status, WritePayload};
use vsan_replica::wire::{
    self, HEADER_LEN, MAGIC, MAX_DATA_LEN, MAX_META_LEN, WIRE_VERSION, WireError,
};

/// The largest frame a decoder may have to buffer.
const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_META_LEN + MAX_DATA_LEN;

/// How decoding a byte stream, frame after frame, ended.
#[derive(Debug, PartialEq)]
pub enum End {
    /// Every whole frame decoded; this many bytes wait for the rest of a frame.
    NeedMore(usize),
    /// A frame was refused (the link would be dropped here).
    Refused(WireError),
}

/// Everything decoding a byte stream gave.
#[derive(Debug, PartialEq)]
pub struct Outcome {
    /// The messages, in order.
    pub messages: Vec<Message>,
    /// How it ended.
    pub end: End,
}

/// A message the decoder returned is one the encoder would send: it passes `validate`,
/// encodes, and its encoding decodes to the same message, consuming exactly the frame.
pub fn check_decoded(msg: &Message) {
    if let Err(e) = wire::validate(msg) {
        panic!("decode returned a message validate refuses ({e}): {msg:?}");
    }
    let frame = match wire::encode(msg) {
        Ok(f) => f,
        Err(e) => panic!("decode returned a message encode refuses ({e}): {msg:?}"),
    };
    let mut buf = BytesMut::new();
    buf.extend_from_slice(frame.head());
    buf.extend_from_slice(frame.data());
    match wire::decode(&mut buf) {
        Ok(Some(again)) => assert_eq!(&again, msg, "a re-encoded message decodes differently"),
        other => panic!("a re-encoded message does not decode: {other:?} for {msg:?}"),
    }
    assert!(
        buf.is_empty(),
        "decode left {} bytes of one frame",
        buf.len()
    );
}

/// The length the header at the start of `buf` declares (header, meta and data),
/// computed here independently of the codec.
fn declared_len(buf: &[u8]) -> Option<usize> {
    let h = buf.get(..HEADER_LEN)?;
    let be32 = |at: usize| u32::from_be_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]) as usize;
    Some(HEADER_LEN + be32(8) + be32(12))
}

/// Decodes `input` fed to the decoder in pieces whose sizes `next_piece` picks (it is
/// given how many bytes are left and returns 1 to that many), checking on the way that
/// "need more" consumes nothing and reserves no more than the declared frame, and that
/// every message returned passes [`check_decoded`].
pub fn decode_in_pieces(input: &[u8], mut next_piece: impl FnMut(usize) -> usize) -> Outcome {
    let mut buf = BytesMut::new();
    let mut fed = 0usize;
    let mut consumed = 0usize;
    let mut messages = Vec::new();
    loop {
        let (len_before, cap_before) = (buf.len(), buf.capacity());
        match wire::decode(&mut buf) {
            Ok(Some(msg)) => {
                check_decoded(&msg);
                consumed += len_before - buf.len();
                messages.push(msg);
                continue;
            }
            Ok(None) => {
                assert_eq!(buf.len(), len_before, "\"need more\" consumed bytes");
                if let Some(declared) = declared_len(&buf) {
                    assert!(
                        declared <= MAX_FRAME_LEN,
                        "\"need more\" for a frame of {declared} bytes, over the limits"
                    );
                    assert!(
                        declared > buf.len(),
                        "\"need more\" with a whole frame there"
                    );
                    if cap_before >= declared {
                        assert_eq!(buf.capacity(), cap_before, "reallocated with room left");
                    } else {
                        // The buffer may grow to the frame (plus the space of frames
                        // already split off it), or double, as `BytesMut` grows.
                        let most = (declared + consumed).max(2 * (cap_before + consumed));
                        assert!(
                            buf.capacity() <= most,
                            "reserved {} bytes for a frame of {declared}",
                            buf.capacity()
                        );
                    }
                } else {
                    assert_eq!(buf.capacity(), cap_before, "reserved before a header");
                }
            }
            Err(e) => {
                return Outcome {
                    messages,
                    end: End::Refused(e),
                };
            }
        }
        let left = input.len() - fed;
        if left == 0 {
            return Outcome {
                messages,
                end: End::NeedMore(buf.len()),
            };
        }
        let n = next_piece(left).clamp(1, left);
        buf.extend_from_slice(&input[fed..fed + n]);
        fed += n;
    }
}

/// A small deterministic generator (xorshift64*), so piece sizes depend on the input
/// alone and a crash replays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded from `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Rng {
        let mut h = crc32fast::Hasher::new();
        h.update(bytes);
        Rng((u64::from(h.finalize()) << 32 | bytes.len() as u64) | 1)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A piece size for [`decode_in_pieces`]: mostly small, now and then large.
    pub fn piece(&mut self, left: usize) -> usize {
        let r = self.next_u64();
        let n = match r % 8 {
            0 => 1,
            1 => HEADER_LEN,
            2 => left,
            _ => 1 + (r >> 8) as usize % 97,
        };
        n.clamp(1, left)
    }
}

/// `frame_decode`: `input` as a byte stream from a peer. Decoding it whole, byte by
/// byte, and in random pieces gives the same messages and the same end; each message
/// passes [`check_decoded`]; nothing panics.
pub fn check_stream(input: &[u8]) {
    let whole = decode_in_pieces(input, |left| left);
    let mut rng = Rng::from_bytes(input);
    let pieces = decode_in_pieces(input, |left| rng.piece(left));
    assert_eq!(
        whole, pieces,
        "decoding in pieces differs from decoding whole"
    );
    if input.len() <= 4096 {
        let bytewise = decode_in_pieces(input, |_| 1);
        assert_eq!(
            whole, bytewise,
            "decoding byte by byte differs from decoding whole"
        );
    }
}

/// The frame `frame_sealed` builds from its input: byte 0 is the kind byte, bytes 1..3
/// a big-endian meta length (cut to what follows), then the meta, then the data; the
/// header has the right magic, version, zero flags, the actual lengths and the right
/// crc. An input shorter than 3 bytes is a Welcome-sized frame of kind `input[0]` (or 0).
pub fn seal(input: &[u8]) -> BytesMut {
    let kind = input.first().copied().unwrap_or(0);
    let rest = input.get(3..).unwrap_or(&[]);
    let want = match input {
        [_, a, b, ..] => usize::from(u16::from_be_bytes([*a, *b])),
        _ => 0,
    };
    let (meta, data) = rest.split_at(want.min(rest.len()));
    frame_of(kind, meta, data)
}

/// A frame with a correct header and crc around `meta` and `data`.
pub fn frame_of(kind: u8, meta: &[u8], data: &[u8]) -> BytesMut {
    let mut out = BytesMut::with_capacity(HEADER_LEN + meta.len() + data.len());
    out.extend_from_slice(&MAGIC.to_be_bytes());
    out.extend_from_slice(&[WIRE_VERSION, kind, 0, 0]);
    out.extend_from_slice(&(meta.len() as u32).to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&out);
    h.update(meta);
    h.update(data);
    out.extend_from_slice(&h.finalize().to_be_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(data);
    out
}

/// The inverse of [`seal`] for a well-formed frame: the `frame_sealed` input that seals
/// to it (for seeding that target's corpus from encoded messages).
pub fn unseal(frame: &[u8]) -> Option<Vec<u8>> {
    let declared = declared_len(frame)?;
    if declared != frame.len() {
        return None;
    }
    let meta_len = u32::from_be_bytes(frame[8..12].try_into().ok()?) as usize;
    let meta_len = u16::try_from(meta_len).ok()?;
    let mut out = vec![frame[5]];
    out.extend_from_slice(&meta_len.to_be_bytes());
    out.extend_from_slice(&frame[HEADER_LEN..]);
    Some(out)
}

/// `frame_sealed`: a frame whose header and crc are right decodes to a message that
/// passes [`check_decoded`] and consumes exactly the frame, or is refused for what its
/// kind, meta or data say, never for its header's fixed fields or its crc, and never
/// with "need more".
pub fn check_sealed(input: &[u8]) {
    let frame = seal(input);
    let mut buf = frame.clone();
    match wire::decode(&mut buf) {
        Ok(Some(msg)) => {
            assert!(buf.is_empty(), "a whole frame left {} bytes", buf.len());
            check_decoded(&msg);
        }
        Ok(None) => panic!("\"need more\" for a whole frame of {} bytes", frame.len()),
        Err(
            e @ (WireError::BadCrc { .. }
            | WireError::BadMagic { .. }
            | WireError::UnsupportedVersion(_)
            | WireError::ReservedFlags(_)),
        ) => panic!("a correct header was refused: {e}"),
        Err(_) => {}
    }
    // The same frame in pieces and behind another frame ends the same way.
    let mut two = BytesMut::new();
    wire::encode_into(&Message::Ping { id: 1 }, &mut two).expect("a ping encodes");
    two.extend_from_slice(&frame);
    check_stream(&two);
}

fn arb_status(u: &mut Unstructured<'_>) -> arbitrary::Result<Status> {
    Ok(if u.arbitrary()? {
        Status::Ok
    } else {
        Status::Failed(u.arbitrary()?)
    })
}

fn arb_generations(u: &mut Unstructured<'_>) -> arbitrary::Result<Generations> {
    Ok(Generations {
        current: u.arbitrary()?,
        bitmap: u.arbitrary()?,
        history: u.arbitrary()?,
    })
}

fn arb_data(u: &mut Unstructured<'_>) -> arbitrary::Result<Bytes> {
    let len = u.int_in_range(0..=512usize)?;
    Ok(Bytes::copy_from_slice(u.bytes(len.min(u.len()))?))
}

/// A message of any kind chosen by `u`, valid or not (an empty write, a range past
/// `u64::MAX`, overlapping bitmap runs are all possible).
pub fn message(u: &mut Unstructured<'_>) -> arbitrary::Result<Message> {
    Ok(match u.int_in_range(0..=22u8)? {
        0 => Message::Hello(Hello {
            protocol_version: u.arbitrary()?,
            node_id: u.arbitrary()?,
            peer_id: u.arbitrary()?,
            disk_id: DiskId(u.arbitrary()?),
            disk_name: u.arbitrary()?,
            size: u.arbitrary()?,
            block_size: u.arbitrary()?,
            chunk_size: u.arbitrary()?,
            generations: arb_generations(u)?,
            dirty_chunks: u.arbitrary()?,
            crashed: u.arbitrary()?,
            inconsistent: u.arbitrary()?,
            discard_my_data: u.arbitrary()?,
            split_brain_policy: u.arbitrary()?,
        }),
        1 => Message::Welcome,
        2 => Message::Refuse {
            reason: u.arbitrary()?,
        },
        3 => Message::Write {
            id: u.arbitrary()?,
            offset: u.arbitrary()?,
            payload: match u.int_in_range(0..=2u8)? {
                0 => WritePayload::Data(arb_data(u)?),
                1 => WritePayload::Zeroes {
                    len: u.arbitrary()?,
                },
                _ => WritePayload::Discard {
                    len: u.arbitrary()?,
                },
            },
            fua: u.arbitrary()?,
        },
        4 => Message::WriteAck {
            id: u.arbitrary()?,
            status: arb_status(u)?,
        },
        5 => Message::Flush { id: u.arbitrary()? },
        6 => Message::FlushAck {
            id: u.arbitrary()?,
            status: arb_status(u)?,
        },
        7 => Message::Read {
            id: u.arbitrary()?,
            offset: u.arbitrary()?,
            len: u.arbitrary()?,
        },
        8 => Message::ReadReply {
            id: u.arbitrary()?,
            status: arb_status(u)?,
            data: arb_data(u)?,
        },
        9 => Message::Ping { id: u.arbitrary()? },
        10 => Message::Pong { id: u.arbitrary()? },
        11 => {
            let n = u.int_in_range(0..=32usize)?;
            let mut runs = Vec::with_capacity(n);
            for _ in 0..n {
                runs.push(u.arbitrary()?);
            }
            Message::SyncBitmap { runs }
        }
        12 => Message::SyncData {
            offset: u.arbitrary()?,
            data: arb_data(u)?,
        },
        13 => Message::SyncAck {
            offset: u.arbitrary()?,
            status: arb_status(u)?,
        },
        14 => Message::SyncCrc {
            offset: u.arbitrary()?,
            len: u.arbitrary()?,
            crc: u.arbitrary()?,
            verify: u.arbitrary()?,
        },
        15 => Message::SyncCrcReply {
            offset: u.arbitrary()?,
            equal: u.arbitrary()?,
            verify: u.arbitrary()?,
        },
        16 => Message::SyncCheckpoint { id: u.arbitrary()? },
        17 => Message::SyncCheckpointAck {
            id: u.arbitrary()?,
            status: arb_status(u)?,
        },
        18 => Message::SyncDone {
            generations: arb_generations(u)?,
        },
        19 => Message::SyncRequest,
        21 => Message::ReplicaDetached,
        20 => Message::LaneSeq {
            seq: u.arbitrary()?,
        },
        _ => Message::LaneJoin {
            group: u.arbitrary()?,
            index: u.arbitrary()?,
            count: u.arbitrary()?,
        },
    })
}

/// `frame_roundtrip`: a message chosen by the input either breaks a rule, and then
/// `encode` refuses it with the error `validate` gives, or it encodes to a frame that
/// decodes back to it whole, needs more when cut anywhere, decodes after another
/// frame in pieces, and is refused when one byte outside its length fields changes.
pub fn check_roundtrip(input: &[u8]) {
    let mut u = Unstructured::new(input);
    let Ok(msg) = message(&mut u) else {
        return;
    };
    let frame = match (wire::validate(&msg), wire::encode(&msg)) {
        (Err(v), Err(e)) => {
            assert_eq!(v, e, "encode and validate disagree on {msg:?}");
            return;
        }
        (Err(v), Ok(_)) => panic!("encode took a message validate refuses ({v}): {msg:?}"),
        (Ok(()), Err(WireError::TooLarge { what: "meta", .. })) => return,
        (Ok(()), Err(e)) => panic!("encode refused a valid message ({e}): {msg:?}"),
        (Ok(()), Ok(frame)) => frame,
    };
    let mut bytes = BytesMut::new();
    bytes.extend_from_slice(frame.head());
    bytes.extend_from_slice(frame.data());
    assert_eq!(
        declared_len(&bytes),
        Some(bytes.len()),
        "header length is wrong"
    );

    let mut buf = bytes.clone();
    assert_eq!(wire::decode(&mut buf).as_ref(), Ok(&Some(msg.clone())));
    assert!(buf.is_empty());
    check_decoded(&msg);

    let cut = u.int_in_range(0..=bytes.len() - 1).unwrap_or(0);
    let mut part = BytesMut::from(&bytes[..cut]);
    assert_eq!(
        wire::decode(&mut part),
        Ok(None),
        "a frame cut at {cut} decoded"
    );
    assert_eq!(part.len(), cut);

    let mut two = BytesMut::new();
    wire::encode_into(&Message::Pong { id: 7 }, &mut two).expect("a pong encodes");
    two.extend_from_slice(&bytes);
    let got = decode_in_pieces(&two, {
        let mut rng = Rng::from_bytes(input);
        move |left| rng.piece(left)
    });
    assert_eq!(got.messages, vec![Message::Pong { id: 7 }, msg.clone()]);
    assert_eq!(got.end, End::NeedMore(0));

    // One changed byte anywhere but the two length fields (whose change moves what the
    // crc covers) is caught, by the header checks or the crc (crc32 catches every error
    // burst of up to 32 bits): never a message.
    let mut at = u.int_in_range(0..=bytes.len() - 9).unwrap_or(0);
    if at >= 8 {
        at += 8;
    }
    let flip = u.int_in_range(1..=255u8).unwrap_or(1);
    let mut bad = bytes.clone();
    bad[at] ^= flip;
    let mut buf = bad.clone();
    match wire::decode(&mut buf) {
        Ok(Some(m)) => panic!("a frame with byte {at} changed decoded to {m:?}"),
        Ok(None) => panic!("a frame with byte {at} changed needs more"),
        Err(_) => {}
    }
}
