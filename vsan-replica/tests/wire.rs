//! The wire format from the outside: every message round-trips, and the decoder is total
//! — truncated, corrupted, oversized and random input yields "need more" or an error,
//! never a panic, a huge allocation or a wrong message.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan_core::ErrorKind;
use vsan_replica::protocol::{
    DiskId, GEN_JUST_CREATED, Generations, Hello, Message, PROTOCOL_VERSION, SplitBrainPolicy,
    Status, WritePayload,
};
use vsan_replica::wire::{
    self, HEADER_LEN, Kind, MAGIC, MAX_DATA_LEN, MAX_META_LEN, WIRE_VERSION, WireError,
};

/// One or more messages of every kind, with edge values.
fn samples() -> Vec<Message> {
    let data = |len: usize, seed: u8| {
        Bytes::from(
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect::<Vec<u8>>(),
        )
    };
    vec![
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: 1,
            peer_id: 2,
            disk_id: DiskId([0xab; 16]),
            disk_name: "vol0".into(),
            size: 1 << 30,
            block_size: 4096,
            chunk_size: 1 << 20,
            generations: Generations {
                current: GEN_JUST_CREATED,
                bitmap: 0,
                history: [0, 0],
            },
            dirty_chunks: 0,
            crashed: false,
            inconsistent: false,
            discard_my_data: false,
            split_brain_policy: SplitBrainPolicy::Refuse.code(),
        }),
        Message::Hello(Hello {
            protocol_version: u32::MAX,
            node_id: 0,
            peer_id: u32::MAX,
            disk_id: DiskId::default(),
            disk_name: "disque-é-✓".into(),
            size: u64::MAX,
            block_size: 0,
            chunk_size: u64::MAX,
            generations: Generations {
                current: u64::MAX,
                bitmap: u64::MAX - 1,
                history: [u64::MAX, 1],
            },
            dirty_chunks: u64::MAX,
            crashed: true,
            inconsistent: true,
            discard_my_data: true,
            split_brain_policy: SplitBrainPolicy::DiscardNode(u32::MAX).code(),
        }),
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: 2,
            peer_id: 1,
            disk_id: DiskId::from_name("vol1"),
            disk_name: "vol1".into(),
            size: 1 << 40,
            block_size: 512,
            chunk_size: 64 << 10,
            generations: Generations::default(),
            dirty_chunks: 17,
            crashed: false,
            inconsistent: true,
            discard_my_data: false,
            // Not a policy: the wire carries any number, the protocol judges it.
            split_brain_policy: u64::MAX,
        }),
        Message::Welcome,
        Message::Refuse {
            reason: "disk size differs: 1 GiB here, 2 GiB there".into(),
        },
        Message::Refuse {
            reason: String::new(),
        },
        Message::Write {
            id: 0,
            offset: 0,
            payload: WritePayload::Data(data(4096, 1)),
            fua: false,
        },
        Message::Write {
            id: u64::MAX,
            offset: u64::MAX - 512,
            payload: WritePayload::Data(data(512, 2)),
            fua: true,
        },
        Message::Write {
            id: 7,
            offset: 1 << 20,
            payload: WritePayload::Zeroes { len: 1 << 20 },
            fua: true,
        },
        Message::Write {
            id: 8,
            offset: 4096,
            payload: WritePayload::Discard {
                len: u64::MAX - 4096,
            },
            fua: false,
        },
        Message::WriteAck {
            id: 9,
            status: Status::Ok,
        },
        Message::WriteAck {
            id: 10,
            status: Status::Failed(ErrorKind::Io as u32),
        },
        Message::WriteAck {
            id: 10,
            status: Status::Failed(0),
        },
        Message::Flush { id: 11 },
        Message::FlushAck {
            id: 12,
            status: Status::Ok,
        },
        Message::FlushAck {
            id: 13,
            status: Status::Failed(u32::MAX),
        },
        Message::Read {
            id: 14,
            offset: 123 * 4096,
            len: 65536,
        },
        Message::Read {
            id: 15,
            offset: 0,
            len: MAX_DATA_LEN as u32,
        },
        Message::ReadReply {
            id: 16,
            status: Status::Ok,
            data: data(65536, 3),
        },
        Message::ReadReply {
            id: 17,
            status: Status::Ok,
            data: Bytes::new(),
        },
        Message::ReadReply {
            id: 18,
            status: Status::Failed(ErrorKind::OutOfRange as u32),
            data: Bytes::new(),
        },
        Message::Ping { id: 19 },
        Message::Pong { id: u64::MAX },
        Message::SyncBitmap { runs: Vec::new() },
        Message::SyncBitmap { runs: vec![(0, 1)] },
        Message::SyncBitmap {
            // Touching runs, a gap, and a last run that ends exactly at u64::MAX.
            runs: vec![(0, 3), (3, 1), (100, 1 << 40), (u64::MAX - 5, 5)],
        },
        Message::SyncBitmap {
            runs: vec![(0, u64::MAX)],
        },
        Message::SyncData {
            offset: 0,
            data: data(4096, 4),
        },
        Message::SyncData {
            offset: u64::MAX - 1,
            data: data(1, 5),
        },
        Message::SyncAck {
            offset: 0,
            status: Status::Ok,
        },
        Message::SyncAck {
            offset: u64::MAX,
            status: Status::Failed(ErrorKind::Io as u32),
        },
        Message::SyncAck {
            offset: 1 << 20,
            status: Status::Failed(0),
        },
        Message::SyncCrc {
            offset: 0,
            len: 1,
            crc: 0,
            verify: false,
        },
        Message::SyncCrc {
            offset: u64::MAX - u64::from(u32::MAX),
            len: u32::MAX,
            crc: u32::MAX,
            verify: true,
        },
        Message::SyncCrcReply {
            offset: 0,
            equal: false,
            verify: false,
        },
        Message::SyncCrcReply {
            offset: u64::MAX,
            equal: true,
            verify: true,
        },
        Message::SyncCrcReply {
            offset: 4096,
            equal: false,
            verify: true,
        },
        Message::SyncCheckpoint { id: 0 },
        Message::SyncCheckpoint { id: u64::MAX },
        Message::SyncCheckpointAck {
            id: 20,
            status: Status::Ok,
        },
        Message::SyncCheckpointAck {
            id: u64::MAX,
            status: Status::Failed(u32::MAX),
        },
        Message::SyncDone {
            generations: Generations::default(),
        },
        Message::SyncDone {
            generations: Generations {
                current: u64::MAX,
                bitmap: 0,
                history: [u64::MAX - 1, u64::MAX - 2],
            },
        },
        Message::SyncRequest,
        Message::ReplicaDetached,
        Message::Scsi {
            id: 7,
            body: Bytes::from_static(b"a call"),
        },
        Message::Scsi {
            id: u64::MAX,
            body: Bytes::new(),
        },
        Message::ScsiReply {
            id: 7,
            status: Status::Ok,
            body: Bytes::from_static(b"an answer"),
        },
        Message::ScsiReply {
            id: 8,
            status: Status::Failed(4),
            body: Bytes::new(),
        },
    ]
}

fn frame_bytes(msg: &Message) -> BytesMut {
    let mut buf = BytesMut::new();
    wire::encode_into(msg, &mut buf).unwrap();
    buf
}

/// A frame with a correct crc around any kind, flags, meta and data.
fn raw_frame(kind: u8, meta: &[u8], data: &[u8]) -> BytesMut {
    let mut buf = BytesMut::new();
    buf.put_u32(MAGIC);
    buf.put_u8(WIRE_VERSION);
    buf.put_u8(kind);
    buf.put_u16(0);
    buf.put_u32(meta.len() as u32);
    buf.put_u32(data.len() as u32);
    let mut h = crc32fast::Hasher::new();
    h.update(&buf[..16]);
    h.update(meta);
    h.update(data);
    buf.put_u32(h.finalize());
    buf.extend_from_slice(meta);
    buf.extend_from_slice(data);
    buf
}

/// A protobuf varint field.
fn pb_varint(field: u32, mut value: u64, out: &mut Vec<u8>) {
    out.push((field << 3) as u8);
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// A protobuf length-delimited field (short values only).
fn pb_bytes(field: u32, value: &[u8], out: &mut Vec<u8>) {
    out.push(((field << 3) | 2) as u8);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

#[test]
fn every_sample_round_trips() {
    let samples = samples();
    let kinds: std::collections::HashSet<Kind> = samples.iter().map(Kind::of).collect();
    assert_eq!(kinds.len(), 23, "every message kind is sampled");
    for msg in samples {
        let mut buf = frame_bytes(&msg);
        let len = buf.len();
        assert_eq!(
            wire::decode(&mut buf).unwrap(),
            Some(msg.clone()),
            "{msg:?}"
        );
        assert!(buf.is_empty(), "exactly one frame consumed");
        let frame = wire::encode(&msg).unwrap();
        assert_eq!(frame.len(), len);
        assert_eq!(frame.head()[5], Kind::of(&msg) as u8);
    }
}

/// A batch's frames, whose heads share one buffer, are byte for byte the frames each
/// message encodes to alone; a message that cannot be encoded fails the batch.
#[test]
fn a_batch_encodes_each_message_as_alone() {
    let samples = samples();
    let frames = wire::encode_batch(&samples).unwrap();
    assert_eq!(frames.len(), samples.len());
    for (msg, frame) in samples.iter().zip(frames) {
        let alone = wire::encode(msg).unwrap();
        assert_eq!(frame.head(), alone.head(), "{msg:?}");
        assert_eq!(frame.data(), alone.data(), "{msg:?}");
    }
    let mut bad = samples.clone();
    bad.insert(
        1,
        Message::Refuse {
            reason: "x".repeat(MAX_META_LEN + 1),
        },
    );
    assert!(matches!(
        wire::encode_batch(&bad),
        Err(WireError::TooLarge { what: "meta", .. })
    ));
}

#[test]
fn frames_back_to_back_decode_in_order_even_byte_by_byte() {
    let samples = samples();
    let mut stream = BytesMut::new();
    for msg in &samples {
        wire::encode_into(msg, &mut stream).unwrap();
    }

    let mut whole = stream.clone();
    for msg in &samples {
        assert_eq!(wire::decode(&mut whole).unwrap().as_ref(), Some(msg));
    }
    assert_eq!(wire::decode(&mut whole).unwrap(), None);
    assert!(whole.is_empty());

    let mut fed = BytesMut::new();
    let mut got = Vec::new();
    for byte in stream.iter() {
        fed.put_u8(*byte);
        while let Some(msg) = wire::decode(&mut fed).unwrap() {
            got.push(msg);
        }
    }
    assert_eq!(got, samples);
    assert!(fed.is_empty());
}

#[test]
fn every_truncation_needs_more_and_consumes_nothing() {
    for msg in samples() {
        let whole = frame_bytes(&msg);
        for cut in 0..whole.len() {
            let mut buf = BytesMut::from(&whole[..cut]);
            assert_eq!(wire::decode(&mut buf), Ok(None), "{msg:?} cut at {cut}");
            assert_eq!(buf.len(), cut);
            assert_eq!(&buf[..], &whole[..cut]);
        }
    }
}

#[test]
fn a_corrupted_byte_anywhere_never_yields_a_message() {
    for msg in samples() {
        let whole = frame_bytes(&msg);
        // Every header and meta byte, and data bytes at the edges and in between.
        let positions: Vec<usize> = (0..whole.len())
            .filter(|&i| i < 200 || i >= whole.len() - 8 || i % 97 == 0)
            .collect();
        for &at in &positions {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut buf = whole.clone();
                buf[at] ^= flip;
                let got = wire::decode(&mut buf);
                assert!(
                    matches!(got, Err(_) | Ok(None)),
                    "{msg:?}: byte {at} ^ {flip:#x} decoded as {got:?}"
                );
                // Past the header, only the crc can catch it.
                if at >= HEADER_LEN {
                    assert!(
                        matches!(got, Err(WireError::BadCrc { .. })),
                        "{msg:?}: byte {at}: {got:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn oversized_lengths_fail_from_the_header_alone_without_allocating() {
    for (meta_len, data_len, what) in [
        (MAX_META_LEN as u32 + 1, 0, "meta"),
        (u32::MAX, 0, "meta"),
        (0, MAX_DATA_LEN as u32 + 1, "data"),
        (0, u32::MAX, "data"),
    ] {
        let mut buf = BytesMut::with_capacity(HEADER_LEN);
        buf.put_u32(MAGIC);
        buf.put_u8(WIRE_VERSION);
        buf.put_u8(Kind::Write as u8);
        buf.put_u16(0);
        buf.put_u32(meta_len);
        buf.put_u32(data_len);
        buf.put_u32(0);
        let capacity = buf.capacity();
        match wire::decode(&mut buf) {
            Err(WireError::TooLarge { what: w, len, .. }) => {
                assert_eq!(w, what);
                assert_eq!(len, u64::from(meta_len.max(data_len)));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(buf.capacity(), capacity, "the decoder allocated");
    }
}

#[test]
fn the_largest_frames_are_accepted() {
    let msg = Message::Write {
        id: 1,
        offset: 0,
        payload: WritePayload::Data(Bytes::from(vec![0x5a; MAX_DATA_LEN])),
        fua: false,
    };
    let mut buf = frame_bytes(&msg);
    assert_eq!(wire::decode(&mut buf).unwrap(), Some(msg));
    let reason = "r".repeat(MAX_META_LEN - 4);
    let msg = Message::Refuse { reason };
    let mut buf = frame_bytes(&msg);
    assert_eq!(wire::decode(&mut buf).unwrap(), Some(msg));
    let msg = Message::SyncData {
        offset: u64::MAX - MAX_DATA_LEN as u64,
        data: Bytes::from(vec![0xa5; MAX_DATA_LEN]),
    };
    let mut buf = frame_bytes(&msg);
    assert_eq!(wire::decode(&mut buf).unwrap(), Some(msg));
    let runs: Vec<(u64, u64)> = (0..MAX_DATA_LEN as u64 / 16).map(|i| (2 * i, 1)).collect();
    let msg = Message::SyncBitmap { runs };
    let frame = wire::encode(&msg).unwrap();
    assert_eq!(frame.data().len(), MAX_DATA_LEN);
    let mut buf = frame_bytes(&msg);
    assert_eq!(wire::decode(&mut buf).unwrap(), Some(msg));
}

#[test]
fn bad_header_fields_fail_from_the_header_alone() {
    let good = frame_bytes(&Message::Ping { id: 1 });
    let header = |edit: &dyn Fn(&mut BytesMut)| {
        let mut buf = BytesMut::from(&good[..HEADER_LEN]);
        edit(&mut buf);
        wire::decode(&mut buf)
    };
    assert_eq!(
        header(&|b| b[0] = b'X'),
        Err(WireError::BadMagic {
            found: u32::from_be_bytes(*b"XSRP")
        })
    );
    assert_eq!(header(&|b| b[4] = 2), Err(WireError::UnsupportedVersion(2)));
    assert_eq!(header(&|b| b[5] = 0), Err(WireError::UnknownKind(0)));
    assert_eq!(header(&|b| b[5] = 200), Err(WireError::UnknownKind(200)));
    assert_eq!(header(&|b| b[7] = 1), Err(WireError::ReservedFlags(1)));
    assert_eq!(
        header(&|b| b[15] = 1),
        Err(WireError::UnexpectedSection {
            kind: Kind::Ping,
            section: "data",
            len: 1
        })
    );
    let mut welcome = raw_frame(Kind::Welcome as u8, &[0x08, 1], &[]);
    assert!(matches!(
        wire::decode(&mut welcome),
        Err(WireError::UnexpectedSection {
            kind: Kind::Welcome,
            section: "meta",
            ..
        })
    ));
}

#[test]
fn semantically_invalid_messages_are_refused_by_encode_and_decode() {
    let invalid = [
        Message::Write {
            id: 1,
            offset: 0,
            payload: WritePayload::Data(Bytes::new()),
            fua: false,
        },
        Message::Write {
            id: 1,
            offset: 0,
            payload: WritePayload::Zeroes { len: 0 },
            fua: false,
        },
        Message::Write {
            id: 1,
            offset: 0,
            payload: WritePayload::Discard { len: 0 },
            fua: false,
        },
        Message::Write {
            id: 1,
            offset: u64::MAX,
            payload: WritePayload::Data(Bytes::from_static(b"x")),
            fua: false,
        },
        Message::Write {
            id: 1,
            offset: 2,
            payload: WritePayload::Zeroes { len: u64::MAX - 1 },
            fua: false,
        },
        Message::Read {
            id: 1,
            offset: 0,
            len: 0,
        },
        Message::Read {
            id: 1,
            offset: 0,
            len: MAX_DATA_LEN as u32 + 1,
        },
        Message::Read {
            id: 1,
            offset: u64::MAX,
            len: 1,
        },
        Message::ReadReply {
            id: 1,
            status: Status::Failed(3),
            data: Bytes::from_static(b"stale"),
        },
        Message::SyncData {
            offset: 0,
            data: Bytes::new(),
        },
        Message::SyncData {
            offset: u64::MAX,
            data: Bytes::from_static(b"x"),
        },
        Message::SyncData {
            offset: u64::MAX - 2,
            data: Bytes::from_static(b"xyz"),
        },
        Message::SyncCrc {
            offset: 0,
            len: 0,
            crc: 0,
            verify: false,
        },
        Message::SyncCrc {
            offset: u64::MAX - 1,
            len: 2,
            crc: 0,
            verify: true,
        },
        // An empty run, alone and after a good one.
        Message::SyncBitmap { runs: vec![(0, 0)] },
        Message::SyncBitmap {
            runs: vec![(0, 1), (5, 0)],
        },
        // Descending, repeated, overlapping.
        Message::SyncBitmap {
            runs: vec![(10, 1), (5, 1)],
        },
        Message::SyncBitmap {
            runs: vec![(5, 1), (5, 1)],
        },
        Message::SyncBitmap {
            runs: vec![(0, 10), (9, 5)],
        },
        // Ends past u64::MAX.
        Message::SyncBitmap {
            runs: vec![(u64::MAX, 1)],
        },
        Message::SyncBitmap {
            runs: vec![(0, 1), (2, u64::MAX - 1)],
        },
    ];
    for msg in &invalid {
        assert!(
            matches!(wire::validate(msg), Err(WireError::Invalid { .. })),
            "{msg:?}"
        );
        assert!(
            matches!(wire::encode(msg), Err(WireError::Invalid { .. })),
            "{msg:?}"
        );
    }

    // The same messages crafted by a peer that skips the checks.
    let mut meta = Vec::new();
    pb_varint(1, 1, &mut meta); // id; op DATA; no len
    let mut empty_write = raw_frame(Kind::Write as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut empty_write),
        Err(WireError::Invalid {
            kind: Kind::Write,
            ..
        })
    ));
    let mut meta = Vec::new();
    pb_varint(2, u64::MAX, &mut meta); // offset
    let mut overflow = raw_frame(Kind::Write as u8, &meta, b"abc");
    assert!(matches!(
        wire::decode(&mut overflow),
        Err(WireError::Invalid { .. })
    ));
    let mut meta = Vec::new();
    pb_varint(1, 1, &mut meta);
    let mut zero_read = raw_frame(Kind::Read as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut zero_read),
        Err(WireError::Invalid { .. })
    ));
    let mut meta = Vec::new();
    pb_varint(2, 5, &mut meta); // error = 5
    let mut failed_with_data = raw_frame(Kind::ReadReply as u8, &meta, b"data");
    assert!(matches!(
        wire::decode(&mut failed_with_data),
        Err(WireError::Invalid { .. })
    ));
    let mut meta = Vec::new();
    pb_varint(1, 4096, &mut meta); // offset; no data
    let mut empty_sync = raw_frame(Kind::SyncData as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut empty_sync),
        Err(WireError::Invalid {
            kind: Kind::SyncData,
            ..
        })
    ));
    let mut meta = Vec::new();
    pb_varint(1, u64::MAX, &mut meta);
    let mut sync_overflow = raw_frame(Kind::SyncData as u8, &meta, b"ab");
    assert!(matches!(
        wire::decode(&mut sync_overflow),
        Err(WireError::Invalid {
            kind: Kind::SyncData,
            ..
        })
    ));
    let mut meta = Vec::new();
    pb_varint(1, 0, &mut meta);
    pb_varint(3, 0xdead, &mut meta); // crc; len 0
    let mut zero_crc = raw_frame(Kind::SyncCrc as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut zero_crc),
        Err(WireError::Invalid {
            kind: Kind::SyncCrc,
            ..
        })
    ));
    let mut meta = Vec::new();
    pb_varint(1, u64::MAX, &mut meta);
    pb_varint(2, 1, &mut meta);
    let mut crc_overflow = raw_frame(Kind::SyncCrc as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut crc_overflow),
        Err(WireError::Invalid {
            kind: Kind::SyncCrc,
            ..
        })
    ));
    for runs in [
        &[(0u64, 0u64)][..],
        &[(10, 1), (5, 1)],
        &[(0, 10), (9, 5)],
        &[(u64::MAX, 1)],
    ] {
        let mut bitmap = raw_frame(
            Kind::SyncBitmap as u8,
            &bitmap_meta(runs.len() as u64),
            &bitmap_data(runs),
        );
        assert!(
            matches!(
                wire::decode(&mut bitmap),
                Err(WireError::Invalid {
                    kind: Kind::SyncBitmap,
                    ..
                })
            ),
            "{runs:?}"
        );
    }
}

/// A `SyncBitmap` meta announcing `runs` runs.
fn bitmap_meta(runs: u64) -> Vec<u8> {
    let mut meta = Vec::new();
    pb_varint(1, runs, &mut meta);
    meta
}

/// Runs as a `SyncBitmap` data section: little-endian (first, count) pairs.
fn bitmap_data(runs: &[(u64, u64)]) -> Vec<u8> {
    runs.iter()
        .flat_map(|&(first, count)| first.to_le_bytes().into_iter().chain(count.to_le_bytes()))
        .collect()
}

#[test]
fn sync_bitmap_data_is_little_endian_run_pairs() {
    let runs = vec![(0x0102_0304_0506_0708, 9), (u64::MAX - 1, 1)];
    let frame = wire::encode(&Message::SyncBitmap { runs: runs.clone() }).unwrap();
    assert_eq!(&frame.data()[..], &bitmap_data(&runs)[..]);
    assert_eq!(&frame.data()[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
    assert_eq!(&frame.head()[HEADER_LEN..], &bitmap_meta(2)[..]);
    // A peer's hand-made frame decodes to the same runs.
    let mut buf = raw_frame(Kind::SyncBitmap as u8, &bitmap_meta(2), &bitmap_data(&runs));
    assert_eq!(
        wire::decode(&mut buf),
        Ok(Some(Message::SyncBitmap { runs }))
    );
}

#[test]
fn a_sync_bitmap_whose_data_disagrees_with_its_run_count_is_refused() {
    let two = bitmap_data(&[(0, 1), (4, 2)]);
    for (count, data) in [
        (1, &two[..]),        // more data than runs
        (3, &two[..]),        // fewer
        (2, &two[..31]),      // a partial run
        (1, &two[..17]),      // one byte over
        (0, &two[..16]),      // data with no runs
        (1, &[][..]),         // runs with no data
        (u64::MAX, &two[..]), // a count whose byte length overflows
        (u64::MAX / 16 + 1, &[][..]),
        (1 << 61, &two[..]),
    ] {
        let mut buf = raw_frame(Kind::SyncBitmap as u8, &bitmap_meta(count), data);
        assert!(
            matches!(
                wire::decode(&mut buf),
                Err(WireError::Invalid {
                    kind: Kind::SyncBitmap,
                    ..
                })
            ),
            "{count} runs, {} bytes",
            data.len()
        );
        assert!(buf.is_empty(), "the bad frame was consumed");
    }
    // No meta at all is zero runs, so no data.
    let mut empty = raw_frame(Kind::SyncBitmap as u8, &[], &[]);
    assert_eq!(
        wire::decode(&mut empty),
        Ok(Some(Message::SyncBitmap { runs: Vec::new() }))
    );
}

#[test]
fn sync_bitmap_runs_over_the_data_limit_are_refused() {
    let runs: Vec<(u64, u64)> = (0..MAX_DATA_LEN as u64 / 16 + 1)
        .map(|i| (2 * i, 1))
        .collect();
    let msg = Message::SyncBitmap { runs };
    assert!(matches!(
        wire::validate(&msg),
        Err(WireError::Invalid {
            kind: Kind::SyncBitmap,
            ..
        })
    ));
    assert!(matches!(wire::encode(&msg), Err(WireError::Invalid { .. })));
}

#[test]
fn frames_without_data_sections_refuse_data() {
    for kind in [
        Kind::SyncAck,
        Kind::SyncCrc,
        Kind::SyncCrcReply,
        Kind::SyncCheckpoint,
        Kind::SyncCheckpointAck,
        Kind::SyncDone,
        Kind::SyncRequest,
        Kind::ReplicaDetached,
    ] {
        assert!(!kind.carries_data(), "{kind:?}");
        let mut buf = raw_frame(kind as u8, &[0x08, 1], b"x");
        assert_eq!(
            wire::decode(&mut buf),
            Err(WireError::UnexpectedSection {
                kind,
                section: "data",
                len: 1
            })
        );
    }
    assert!(Kind::SyncBitmap.carries_data());
    assert!(Kind::SyncData.carries_data());
}

/// Kind 20 (protocol version 3): no meta fields and no data yet; fields a later
/// version adds are skipped.
#[test]
fn sync_request_is_kind_20_with_an_empty_meta() {
    let frame = wire::encode(&Message::SyncRequest).unwrap();
    assert_eq!(frame.head()[5], 20);
    assert_eq!(frame.head().len(), wire::HEADER_LEN, "no meta bytes");
    assert!(frame.data().is_empty());
    let mut later = Vec::new();
    pb_varint(7, 1, &mut later);
    let mut buf = raw_frame(20, &later, &[]);
    assert_eq!(wire::decode(&mut buf), Ok(Some(Message::SyncRequest)));
}

/// Generations as protobuf, with `history` entries given one by one (unpacked).
fn pb_generations(current: u64, history: &[u64]) -> Vec<u8> {
    let mut g = Vec::new();
    pb_varint(1, current, &mut g);
    for &h in history {
        pb_varint(3, h, &mut g);
    }
    g
}

#[test]
fn generations_must_be_present_with_two_history_entries() {
    let hello = |generations: Option<&[u8]>| {
        let mut meta = Vec::new();
        pb_bytes(4, &[1; 16], &mut meta);
        if let Some(g) = generations {
            pb_bytes(10, g, &mut meta);
        }
        raw_frame(Kind::Hello as u8, &meta, &[])
    };
    let done = |generations: Option<&[u8]>| {
        let mut meta = Vec::new();
        if let Some(g) = generations {
            pb_bytes(1, g, &mut meta);
        }
        raw_frame(Kind::SyncDone as u8, &meta, &[])
    };
    for (frame, kind) in [
        (&hello as &dyn Fn(Option<&[u8]>) -> BytesMut, Kind::Hello),
        (&done, Kind::SyncDone),
    ] {
        // Unpacked history entries decode like packed ones.
        let good = pb_generations(9, &[8, 7]);
        let got = wire::decode(&mut frame(Some(&good))).unwrap().unwrap();
        let expected = Generations {
            current: 9,
            bitmap: 0,
            history: [8, 7],
        };
        match got {
            Message::Hello(h) => assert_eq!(h.generations, expected),
            Message::SyncDone { generations } => assert_eq!(generations, expected),
            other => panic!("{other:?}"),
        }
        for bad in [
            None,
            Some(pb_generations(9, &[])),
            Some(pb_generations(9, &[8])),
            Some(pb_generations(9, &[8, 7, 6])),
        ] {
            assert_eq!(
                wire::decode(&mut frame(bad.as_deref())).map_err(|e| match e {
                    WireError::Invalid { kind, .. } => Some(kind),
                    _ => None,
                }),
                Err(Some(kind)),
                "{kind:?} with generations {bad:?}"
            );
        }
    }
}

#[test]
fn malformed_meta_is_refused() {
    // A Hello whose disk id is not 16 bytes.
    let mut meta = Vec::new();
    pb_bytes(4, &[1; 15], &mut meta);
    let mut short_id = raw_frame(Kind::Hello as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut short_id),
        Err(WireError::Invalid {
            kind: Kind::Hello,
            ..
        })
    ));
    // A disk name that is not UTF-8.
    let mut meta = Vec::new();
    pb_bytes(4, &[1; 16], &mut meta);
    pb_bytes(5, &[0xff, 0xfe], &mut meta);
    let mut bad_name = raw_frame(Kind::Hello as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut bad_name),
        Err(WireError::MalformedMeta {
            kind: Kind::Hello,
            ..
        })
    ));
    // Truncated protobuf.
    let mut cut = raw_frame(Kind::Ping as u8, &[0x08, 0x80], &[]);
    assert!(matches!(
        wire::decode(&mut cut),
        Err(WireError::MalformedMeta { .. })
    ));
    // An unknown write op, a data write with a len, a zeroes write with data.
    let mut meta = Vec::new();
    pb_varint(3, 9, &mut meta);
    pb_varint(4, 512, &mut meta);
    let mut unknown_op = raw_frame(Kind::Write as u8, &meta, &[]);
    assert!(matches!(
        wire::decode(&mut unknown_op),
        Err(WireError::Invalid { .. })
    ));
    let mut meta = Vec::new();
    pb_varint(4, 512, &mut meta);
    let mut data_with_len = raw_frame(Kind::Write as u8, &meta, &[1; 512]);
    assert!(matches!(
        wire::decode(&mut data_with_len),
        Err(WireError::Invalid { .. })
    ));
    let mut meta = Vec::new();
    pb_varint(3, 1, &mut meta);
    pb_varint(4, 512, &mut meta);
    let mut zeroes_with_data = raw_frame(Kind::Write as u8, &meta, &[1; 512]);
    assert!(matches!(
        wire::decode(&mut zeroes_with_data),
        Err(WireError::Invalid { .. })
    ));
    // Unknown fields are skipped (forward compatibility inside a version).
    let mut meta = Vec::new();
    pb_varint(1, 42, &mut meta);
    pb_varint(15, 7, &mut meta);
    let mut extended = raw_frame(Kind::Pong as u8, &meta, &[]);
    assert_eq!(
        wire::decode(&mut extended),
        Ok(Some(Message::Pong { id: 42 }))
    );
}

#[test]
fn encode_refuses_meta_over_the_limit() {
    let msg = Message::Refuse {
        reason: "x".repeat(MAX_META_LEN),
    };
    assert!(matches!(
        wire::encode(&msg),
        Err(WireError::TooLarge { what: "meta", .. })
    ));
}

#[test]
fn wire_errors_are_protocol_errors() {
    let err: vsan_core::Error = WireError::BadCrc {
        expected: 1,
        actual: 2,
    }
    .into();
    assert_eq!(err.kind(), ErrorKind::Protocol);
    assert!(err.to_string().contains("crc mismatch"), "{err}");
}

/// Feeds a byte string to the decoder until it needs more or fails; returns the
/// messages decoded. Whatever the input, this returns.
fn drain(bytes: &[u8]) -> Vec<Message> {
    let mut buf = BytesMut::from(bytes);
    let mut got = Vec::new();
    while let Ok(Some(msg)) = wire::decode(&mut buf) {
        got.push(msg);
    }
    got
}

#[test]
fn seeded_random_garbage_never_panics() {
    let mut rng = SmallRng::seed_from_u64(0x5653_5250);
    let template = frame_bytes(&Message::Write {
        id: 3,
        offset: 4096,
        payload: WritePayload::Data(Bytes::from_static(&[9; 64])),
        fua: true,
    });
    for case in 0..20_000 {
        let len = rng.random_range(0..300);
        let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if case % 2 == 0 && bytes.len() >= 6 {
            // Most random bytes die at the magic; give half a plausible start.
            bytes[..4].copy_from_slice(&MAGIC.to_be_bytes());
            bytes[4] = WIRE_VERSION;
        }
        if case % 5 == 0 {
            // A valid frame with random damage.
            bytes = template.to_vec();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..bytes.len());
                bytes[at] = rng.random();
            }
        }
        assert!(drain(&bytes).len() <= 1, "case {case}");
    }
}

#[test]
fn seeded_random_meta_behind_a_valid_crc_never_panics() {
    // Past the crc the meta parser and validation meet arbitrary bytes.
    let mut rng = SmallRng::seed_from_u64(7);
    let kinds: Vec<u8> = (1..=19).chain([64, 65]).collect();
    let mut decoded = 0;
    for _ in 0..20_000 {
        let kind = kinds[rng.random_range(0..kinds.len())];
        let meta: Vec<u8> = (0..rng.random_range(0..40)).map(|_| rng.random()).collect();
        let data: Vec<u8> = (0..rng.random_range(0..8)).map(|_| rng.random()).collect();
        let mut frame = raw_frame(kind, &meta, &data);
        if let Ok(Some(_)) = wire::decode(&mut frame) {
            decoded += 1;
            assert!(frame.is_empty());
        }
    }
    assert!(decoded > 0, "some random metas are valid messages");
}

fn arb_status() -> impl Strategy<Value = Status> {
    prop_oneof![Just(Status::Ok), any::<u32>().prop_map(Status::Failed)]
}

fn arb_message() -> impl Strategy<Value = Message> {
    let data = prop::collection::vec(any::<u8>(), 1..2048).prop_map(Bytes::from);
    let payload = prop_oneof![
        data.clone().prop_map(WritePayload::Data),
        (1..u64::MAX / 2).prop_map(|len| WritePayload::Zeroes { len }),
        (1..u64::MAX / 2).prop_map(|len| WritePayload::Discard { len }),
    ];
    let hello = (
        (
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
            any::<[u8; 16]>(),
            ".{0,40}",
            any::<u64>(),
            any::<u32>(),
        ),
        (
            any::<u64>(),
            arb_generations(),
            any::<u64>(),
            any::<[bool; 3]>(),
            any::<u64>(),
        ),
    )
        .prop_map(
            |(
                (protocol_version, node_id, peer_id, id, disk_name, size, block_size),
                (chunk_size, generations, dirty_chunks, [crashed, inconsistent, discard], sbp),
            )| {
                Message::Hello(Hello {
                    protocol_version,
                    node_id,
                    peer_id,
                    disk_id: DiskId(id),
                    disk_name,
                    size,
                    block_size,
                    chunk_size,
                    generations,
                    dirty_chunks,
                    crashed,
                    inconsistent,
                    discard_my_data: discard,
                    split_brain_policy: sbp,
                })
            },
        );
    // Valid runs: each starts past the previous one's end by a gap of 0 or more.
    let runs = prop::collection::vec((0..1000u64, 1..1000u64), 0..64).prop_map(|steps| {
        let mut next = 0u64;
        steps
            .into_iter()
            .map(|(gap, count)| {
                let first = next + gap;
                next = first + count;
                (first, count)
            })
            .collect::<Vec<_>>()
    });
    prop_oneof![
        hello,
        Just(Message::Welcome),
        ".{0,100}".prop_map(|reason| Message::Refuse { reason }),
        (any::<u64>(), 0..u64::MAX / 2, payload, any::<bool>()).prop_map(
            |(id, offset, payload, fua)| Message::Write {
                id,
                offset,
                payload,
                fua
            }
        ),
        (any::<u64>(), arb_status()).prop_map(|(id, status)| Message::WriteAck { id, status }),
        any::<u64>().prop_map(|id| Message::Flush { id }),
        (any::<u64>(), arb_status()).prop_map(|(id, status)| Message::FlushAck { id, status }),
        (any::<u64>(), 0..u64::MAX / 2, 1..=MAX_DATA_LEN as u32)
            .prop_map(|(id, offset, len)| Message::Read { id, offset, len }),
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..2048)).prop_map(|(id, d)| {
            Message::ReadReply {
                id,
                status: Status::Ok,
                data: Bytes::from(d),
            }
        }),
        (any::<u64>(), any::<u32>()).prop_map(|(id, code)| Message::ReadReply {
            id,
            status: Status::Failed(code),
            data: Bytes::new(),
        }),
        any::<u64>().prop_map(|id| Message::Ping { id }),
        any::<u64>().prop_map(|id| Message::Pong { id }),
        runs.prop_map(|runs| Message::SyncBitmap { runs }),
        (0..u64::MAX / 2, data.clone())
            .prop_map(|(offset, data)| Message::SyncData { offset, data }),
        (any::<u64>(), arb_status())
            .prop_map(|(offset, status)| Message::SyncAck { offset, status }),
        (0..u64::MAX / 2, 1..=u32::MAX, any::<u32>(), any::<bool>()).prop_map(
            |(offset, len, crc, verify)| Message::SyncCrc {
                offset,
                len,
                crc,
                verify
            }
        ),
        (any::<u64>(), any::<bool>(), any::<bool>()).prop_map(|(offset, equal, verify)| {
            Message::SyncCrcReply {
                offset,
                equal,
                verify,
            }
        }),
        any::<u64>().prop_map(|id| Message::SyncCheckpoint { id }),
        (any::<u64>(), arb_status())
            .prop_map(|(id, status)| Message::SyncCheckpointAck { id, status }),
        arb_generations().prop_map(|generations| Message::SyncDone { generations }),
        Just(Message::SyncRequest),
        Just(Message::ReplicaDetached),
        (any::<u64>(), data.clone()).prop_map(|(id, body)| Message::Scsi { id, body }),
        (any::<u64>(), data.clone()).prop_map(|(id, body)| Message::ScsiReply {
            id,
            status: Status::Ok,
            body
        }),
        (any::<u64>(), any::<u32>()).prop_map(|(id, code)| Message::ScsiReply {
            id,
            status: Status::Failed(code),
            body: Bytes::new(),
        }),
    ]
}

fn arb_generations() -> impl Strategy<Value = Generations> {
    (any::<u64>(), any::<u64>(), any::<[u64; 2]>()).prop_map(|(current, bitmap, history)| {
        Generations {
            current,
            bitmap,
            history,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn generated_messages_round_trip_back_to_back(msgs in prop::collection::vec(arb_message(), 1..6)) {
        let mut buf = BytesMut::new();
        for msg in &msgs {
            wire::encode_into(msg, &mut buf).unwrap();
        }
        for msg in &msgs {
            let got = wire::decode(&mut buf).unwrap();
            prop_assert_eq!(got.as_ref(), Some(msg));
        }
        prop_assert!(buf.is_empty());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        drain(&bytes);
    }

    #[test]
    fn a_generated_frame_cut_short_needs_more(msg in arb_message(), cut in any::<prop::sample::Index>()) {
        let whole = frame_bytes(&msg);
        let cut = cut.index(whole.len());
        let mut buf = BytesMut::from(&whole[..cut]);
        prop_assert_eq!(wire::decode(&mut buf), Ok(None));
    }
}
