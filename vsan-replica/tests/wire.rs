//! The wire format from the outside: every message round-trips, and the decoder is total
//! — truncated, corrupted, oversized and random input yields "need more" or an error,
//! never a panic, a huge allocation or a wrong message.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan_core::ErrorKind;
use vsan_replica::protocol::{DiskId, Hello, Message, PROTOCOL_VERSION, Status, WritePayload};
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
            needs_resync: false,
        }),
        Message::Hello(Hello {
            protocol_version: u32::MAX,
            node_id: 0,
            peer_id: u32::MAX,
            disk_id: DiskId::default(),
            disk_name: "disque-é-✓".into(),
            size: u64::MAX,
            block_size: 0,
            needs_resync: true,
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
    assert_eq!(kinds.len(), 11, "every message kind is sampled");
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
    let kinds: Vec<u8> = (1..=11).chain([64, 65]).collect();
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
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<[u8; 16]>(),
        ".{0,40}",
        any::<u64>(),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(
            |(
                protocol_version,
                node_id,
                peer_id,
                id,
                disk_name,
                size,
                block_size,
                needs_resync,
            )| {
                Message::Hello(Hello {
                    protocol_version,
                    node_id,
                    peer_id,
                    disk_id: DiskId(id),
                    disk_name,
                    size,
                    block_size,
                    needs_resync,
                })
            },
        );
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
    ]
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
