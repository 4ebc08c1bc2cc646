//! The fuzz corpus as a test, and a mutation proptest of the frame decoder.
//!
//! * Every file committed under `fuzz/corpus/<target>/` (see `fuzz/README.md`) is fed to
//!   [`wire::decode`] whole, split at every point (the first part, then the rest, as a
//!   socket might deliver it), and with each of its bytes changed; the `frame_sealed`
//!   files are also put behind a correct header and crc, as that target does. Whatever
//!   the outcome, splitting does not change it, and every message returned passes
//!   [`wire::validate`] and re-encodes to a frame that decodes to itself.
//! * A proptest takes valid messages of every kind, encodes them, and mutates the bytes:
//!   bit flips, truncation, inserted and removed bytes, a splice of two frames, and random
//!   header lengths or contents behind a recomputed crc, so the meta parser and the message
//!   rules are reached. Decoding never panics, never returns a message `validate` refuses,
//!   and an unmutated frame always decodes to its message.
//!
//! `write_fuzz_seeds` (ignored) writes the seed frames of every kind into the corpus
//! directories; the fuzzer grows and minimises the corpus from there.

use std::path::{Path, PathBuf};

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use vsan_replica::protocol::{
    DiskId, GEN_JUST_CREATED, Generations, Hello, Message, PROTOCOL_VERSION, SplitBrainPolicy,
    Status, WritePayload,
};
use vsan_replica::wire::{self, HEADER_LEN, MAGIC, MAX_DATA_LEN, WIRE_VERSION, WireError};

/// Where the fuzz targets' corpora live.
fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

/// The fuzz targets whose corpora are committed.
const TARGETS: [&str; 3] = ["frame_decode", "frame_sealed", "frame_roundtrip"];

/// How decoding a byte stream frame after frame ended.
#[derive(Debug, PartialEq)]
enum End {
    /// This many bytes wait for the rest of a frame.
    NeedMore(usize),
    /// A frame was refused.
    Refused(WireError),
}

/// A message from the decoder is one the encoder would send: it passes `validate`, and
/// its encoding decodes to itself, consuming exactly the frame.
fn check_decoded(msg: &Message) {
    if let Err(e) = wire::validate(msg) {
        panic!("decode returned a message validate refuses ({e}): {msg:?}");
    }
    let mut buf = BytesMut::new();
    wire::encode_into(msg, &mut buf)
        .unwrap_or_else(|e| panic!("decode returned a message encode refuses ({e}): {msg:?}"));
    assert_eq!(
        wire::decode(&mut buf).as_ref(),
        Ok(&Some(msg.clone())),
        "a decoded message does not survive encode and decode"
    );
    assert!(buf.is_empty());
}

/// Decodes `parts` as one stream delivered in those pieces: decodes as far as it can
/// after each piece arrives (checking that "need more" consumes nothing), until a frame
/// is refused or the pieces run out.
fn drain_parts(parts: &[&[u8]]) -> (Vec<Message>, End) {
    let mut buf = BytesMut::new();
    let mut messages = Vec::new();
    let mut parts = parts.iter();
    loop {
        let before = buf.len();
        match wire::decode(&mut buf) {
            Ok(Some(msg)) => {
                check_decoded(&msg);
                messages.push(msg);
                continue;
            }
            Ok(None) => assert_eq!(buf.len(), before, "\"need more\" consumed bytes"),
            Err(e) => return (messages, End::Refused(e)),
        }
        match parts.next() {
            Some(part) => buf.extend_from_slice(part),
            None => return (messages, End::NeedMore(buf.len())),
        }
    }
}

fn drain(bytes: &[u8]) -> (Vec<Message>, End) {
    drain_parts(&[bytes])
}

/// Every way of cutting `bytes` in two decodes as the whole does; with any one byte
/// changed (three ways each) it still decodes without a panic; and every message any
/// of these give passes [`check_decoded`].
fn check_file(bytes: &[u8]) {
    let whole = drain(bytes);
    for cut in 0..=bytes.len() {
        let (a, b) = bytes.split_at(cut);
        assert_eq!(
            drain_parts(&[a, b]),
            whole,
            "cut at {cut} differs from whole"
        );
    }
    for at in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut bad = bytes.to_vec();
            bad[at] ^= mask;
            drain(&bad);
        }
    }
}

/// The frame the `frame_sealed` fuzz target builds from an input (see its README):
/// kind byte, big-endian u16 meta length (cut to what follows), meta, data, behind a
/// correct header and crc.
fn seal(input: &[u8]) -> BytesMut {
    let kind = input.first().copied().unwrap_or(0);
    let rest = input.get(3..).unwrap_or(&[]);
    let want = match input {
        [_, a, b, ..] => usize::from(u16::from_be_bytes([*a, *b])),
        _ => 0,
    };
    let (meta, data) = rest.split_at(want.min(rest.len()));
    raw_frame(kind, meta, data)
}

/// A frame with a correct header and crc around any kind, meta and data.
fn raw_frame(kind: u8, meta: &[u8], data: &[u8]) -> BytesMut {
    let mut out = BytesMut::new();
    out.extend_from_slice(&MAGIC.to_be_bytes());
    out.extend_from_slice(&[WIRE_VERSION, kind, 0, 0]);
    out.extend_from_slice(&(meta.len() as u32).to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(meta);
    out.extend_from_slice(data);
    fix_crc(&mut out);
    out
}

/// Recomputes the crc of the frame at the start of `buf` over what its header declares
/// (or over what there is, when the frame is cut short), so the decoder looks past it.
fn fix_crc(buf: &mut [u8]) {
    if buf.len() < HEADER_LEN {
        return;
    }
    let be32 = |b: &[u8], at: usize| u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let declared = HEADER_LEN as u64 + u64::from(be32(buf, 8)) + u64::from(be32(buf, 12));
    let end = usize::try_from(declared).map_or(buf.len(), |d| d.min(buf.len()));
    let mut h = crc32fast::Hasher::new();
    h.update(&buf[..16]);
    h.update(&buf[HEADER_LEN..end]);
    let crc = h.finalize();
    buf[16..20].copy_from_slice(&crc.to_be_bytes());
}

/// The files of one target's corpus, sorted by name.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    vsan_core::corpus::files(&corpus_root().join(target))
}

#[test]
fn every_committed_corpus_file_decodes_totally() {
    let mut files = 0;
    let mut messages = 0;
    for target in TARGETS {
        let corpus = corpus(target);
        assert!(
            !corpus.is_empty(),
            "no corpus for {target} under {}",
            corpus_root().display()
        );
        for (path, bytes) in &corpus {
            files += 1;
            let run = std::panic::catch_unwind(|| {
                check_file(bytes);
                if target == "frame_sealed" {
                    let frame = seal(bytes);
                    let (got, end) = drain(&frame);
                    assert_ne!(end, End::NeedMore(frame.len()), "a sealed frame needs more");
                    assert!(
                        !matches!(end, End::Refused(WireError::BadCrc { .. })),
                        "a sealed frame fails its crc"
                    );
                    check_file(&frame);
                    got.len()
                } else {
                    drain(bytes).0.len()
                }
            });
            match run {
                Ok(n) => messages += n,
                Err(_) => panic!("corpus file {} failed (see above)", path.display()),
            }
        }
    }
    // The seeds alone hold a message of every kind.
    assert!(
        messages >= 20,
        "only {messages} messages in {files} corpus files"
    );
}

/// Messages of every kind, with small data sections (for seeds and the proptest).
fn samples() -> Vec<Message> {
    let data = |len: usize, seed: u8| {
        Bytes::from(
            (0..len)
                .map(|i| (i as u8).wrapping_mul(37) ^ seed)
                .collect::<Vec<u8>>(),
        )
    };
    let generations = Generations {
        current: 0x1234_5678_9abc_def1,
        bitmap: 77,
        history: [5, GEN_JUST_CREATED],
    };
    vec![
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: 1,
            peer_id: 2,
            disk_id: DiskId::from_name("vol0"),
            disk_name: "vol0".into(),
            size: 32 << 20,
            block_size: 4096,
            chunk_size: 1 << 20,
            generations,
            dirty_chunks: 3,
            crashed: true,
            inconsistent: false,
            discard_my_data: true,
            split_brain_policy: SplitBrainPolicy::DiscardNode(2).code(),
        }),
        Message::Welcome,
        Message::Refuse {
            reason: "disk size differs".into(),
        },
        Message::Write {
            id: 1,
            offset: 4096,
            payload: WritePayload::Data(data(48, 1)),
            fua: true,
        },
        Message::Write {
            id: 2,
            offset: 1 << 20,
            payload: WritePayload::Zeroes { len: 8192 },
            fua: false,
        },
        Message::Write {
            id: 3,
            offset: u64::MAX - 512,
            payload: WritePayload::Discard { len: 512 },
            fua: false,
        },
        Message::WriteAck {
            id: 1,
            status: Status::Ok,
        },
        Message::WriteAck {
            id: 2,
            status: Status::Failed(5),
        },
        Message::Flush { id: 4 },
        Message::FlushAck {
            id: 4,
            status: Status::Ok,
        },
        Message::Read {
            id: 5,
            offset: 8192,
            len: 4096,
        },
        Message::ReadReply {
            id: 5,
            status: Status::Ok,
            data: data(32, 2),
        },
        Message::ReadReply {
            id: 6,
            status: Status::Failed(u32::MAX),
            data: Bytes::new(),
        },
        Message::Ping { id: 7 },
        Message::Pong { id: u64::MAX },
        Message::SyncBitmap {
            runs: vec![(0, 2), (2, 1), (10, 1 << 30), (u64::MAX - 3, 3)],
        },
        Message::SyncData {
            offset: 1 << 20,
            data: data(40, 3),
        },
        Message::SyncAck {
            offset: 1 << 20,
            status: Status::Ok,
        },
        Message::SyncCrc {
            offset: 2 << 20,
            len: 1 << 20,
            crc: 0xdead_beef,
            verify: true,
        },
        Message::SyncCrcReply {
            offset: 2 << 20,
            equal: true,
            verify: false,
        },
        Message::SyncCheckpoint { id: 8 },
        Message::SyncCheckpointAck {
            id: 8,
            status: Status::Failed(1),
        },
        Message::SyncDone { generations },
        Message::SyncRequest,
        Message::ReplicaDetached,
        Message::Scsi {
            id: 9,
            body: data(12, 5),
        },
        Message::ScsiReply {
            id: 9,
            status: Status::Ok,
            body: data(6, 6),
        },
        Message::LaneSeq { seq: 42 },
        Message::LaneJoin {
            group: 0x0123_4567_89ab_cdef,
            index: 3,
            count: 4,
        },
    ]
}

/// Frames of the transport's own kinds, which `decode` refuses in the message stream:
/// an auth challenge and response (protobuf field 1, 32 bytes).
fn transport_frames() -> Vec<BytesMut> {
    [(64u8, 0x11u8), (65, 0x22)]
        .into_iter()
        .map(|(kind, fill)| {
            let mut meta = vec![0x0a, 32];
            meta.extend_from_slice(&[fill; 32]);
            raw_frame(kind, &meta, &[])
        })
        .collect()
}

fn encoded(msg: &Message) -> BytesMut {
    let mut buf = BytesMut::new();
    wire::encode_into(msg, &mut buf).expect("a sample encodes");
    buf
}

/// The `frame_sealed` input that seals to `frame`.
fn unseal(frame: &[u8]) -> Vec<u8> {
    let meta_len = u16::from_be_bytes([frame[10], frame[11]]);
    assert_eq!(&frame[8..10], &[0, 0], "seeds have short metas");
    let mut out = vec![frame[5]];
    out.extend_from_slice(&meta_len.to_be_bytes());
    out.extend_from_slice(&frame[HEADER_LEN..]);
    out
}

/// Writes the seed corpus: each sample frame (and the transport frames) for
/// `frame_decode`, all of them back to back, and each in `frame_sealed`'s input form.
/// Run it once before fuzzing a fresh corpus:
/// `cargo test -p vsan-replica --test wire_corpus -- --ignored write_fuzz_seeds`.
#[test]
#[ignore = "writes into the source tree; run by hand to seed the fuzz corpus"]
fn write_fuzz_seeds() {
    let root = corpus_root();
    let mut frames: Vec<(String, BytesMut)> = samples()
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let kind = wire::Kind::of(m);
            (format!("seed-{i:02}-{kind:?}"), encoded(m))
        })
        .collect();
    for (i, f) in transport_frames().into_iter().enumerate() {
        frames.push((format!("seed-t{i}-kind{}", f[5]), f));
    }
    let decode_dir = root.join("frame_decode");
    let sealed_dir = root.join("frame_sealed");
    for dir in [&decode_dir, &sealed_dir] {
        std::fs::create_dir_all(dir).expect("create the corpus directory");
    }
    let mut all = Vec::new();
    for (name, frame) in &frames {
        std::fs::write(decode_dir.join(name), frame).expect("write a seed");
        std::fs::write(sealed_dir.join(name), unseal(frame)).expect("write a seed");
        all.extend_from_slice(frame);
    }
    std::fs::write(decode_dir.join("seed-all-back-to-back"), &all).expect("write a seed");
}

/// What the proptest does to an encoded stream of frames.
#[derive(Debug, Clone)]
enum Mutation {
    /// Nothing: the frames must decode to their messages.
    None,
    /// Flip bit `bit` of the byte at `at`.
    FlipBit { at: prop::sample::Index, bit: u8 },
    /// Keep only the first `at` bytes.
    Truncate { at: prop::sample::Index },
    /// Insert `bytes` before `at`.
    Insert {
        at: prop::sample::Index,
        bytes: Vec<u8>,
    },
    /// Remove up to `len` bytes from `at`.
    Remove { at: prop::sample::Index, len: usize },
    /// The stream up to `a`, then the other stream from `b`.
    Splice {
        a: prop::sample::Index,
        b: prop::sample::Index,
    },
    /// Set the first frame's meta and data lengths, and recompute its crc.
    Lengths { meta: u32, data: u32 },
    /// Overwrite bytes of the first frame past its header (its meta and data), and
    /// recompute its crc.
    Sealed {
        writes: Vec<(prop::sample::Index, u8)>,
    },
    /// Change the first frame's kind byte, and recompute its crc.
    Kind { kind: u8 },
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    let index = any::<prop::sample::Index>;
    // Lengths around the real ones matter most; the limits and beyond, now and then.
    let len = prop_oneof![
        4 => 0u32..64,
        1 => 0u32..=70_000,
        1 => Just(MAX_DATA_LEN as u32),
        1 => Just(MAX_DATA_LEN as u32 + 1),
        1 => any::<u32>(),
    ];
    prop_oneof![
        1 => Just(Mutation::None),
        3 => (index(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        2 => index().prop_map(|at| Mutation::Truncate { at }),
        2 => (index(), prop::collection::vec(any::<u8>(), 1..24))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (index(), 1usize..24).prop_map(|(at, len)| Mutation::Remove { at, len }),
        2 => (index(), index()).prop_map(|(a, b)| Mutation::Splice { a, b }),
        3 => (len.clone(), len).prop_map(|(meta, data)| Mutation::Lengths { meta, data }),
        4 => prop::collection::vec((index(), any::<u8>()), 1..6)
            .prop_map(|writes| Mutation::Sealed { writes }),
        2 => prop_oneof![0u8..=70, any::<u8>()].prop_map(|kind| Mutation::Kind { kind }),
    ]
}

/// A message of any kind: one of the samples with its numbers and data replaced.
fn arb_message() -> impl Strategy<Value = Message> {
    let count = samples().len();
    (
        0..count,
        any::<[u64; 4]>(),
        prop::collection::vec(any::<u8>(), 1..300),
        "[a-z0-9 -]{0,24}",
    )
        .prop_map(|(i, [a, b, c, d], bytes, text)| {
            let data = Bytes::from(bytes);
            let small = (c % u64::from(u32::MAX)) as u32 + 1;
            match samples().swap_remove(i) {
                Message::Hello(mut h) => {
                    h.node_id = a as u32;
                    h.disk_name = text;
                    h.size = b;
                    h.generations.history = [c, d];
                    Message::Hello(h)
                }
                Message::Refuse { .. } => Message::Refuse { reason: text },
                Message::Write { payload, .. } => Message::Write {
                    id: a,
                    offset: b % (u64::MAX / 2),
                    payload: match payload {
                        WritePayload::Data(_) => WritePayload::Data(data),
                        WritePayload::Zeroes { .. } => WritePayload::Zeroes {
                            len: c % (1 << 40) + 1,
                        },
                        WritePayload::Discard { .. } => WritePayload::Discard {
                            len: c % (1 << 40) + 1,
                        },
                    },
                    fua: d % 2 == 0,
                },
                Message::Read { .. } => Message::Read {
                    id: a,
                    offset: b % (u64::MAX / 2),
                    len: small.min(MAX_DATA_LEN as u32),
                },
                Message::ReadReply {
                    status: Status::Ok, ..
                } => Message::ReadReply {
                    id: a,
                    status: Status::Ok,
                    data,
                },
                Message::SyncBitmap { .. } => {
                    let mut next = 0u64;
                    let runs = data
                        .chunks(2)
                        .map(|p| {
                            let first = next + u64::from(p[0]);
                            let count = u64::from(*p.get(1).unwrap_or(&1)) + 1;
                            next = first + count;
                            (first, count)
                        })
                        .collect();
                    Message::SyncBitmap { runs }
                }
                Message::SyncData { .. } => Message::SyncData {
                    offset: b % (u64::MAX / 2),
                    data,
                },
                Message::SyncCrc { verify, .. } => Message::SyncCrc {
                    offset: b % (u64::MAX / 2),
                    len: small,
                    crc: d as u32,
                    verify,
                },
                Message::Ping { .. } => Message::Ping { id: a },
                Message::LaneJoin { .. } => {
                    let count = (c % u64::from(wire::MAX_LANES)) as u32 + 1;
                    Message::LaneJoin {
                        group: a,
                        index: (d % u64::from(count)) as u32,
                        count,
                    }
                }
                Message::SyncDone { .. } => Message::SyncDone {
                    generations: Generations {
                        current: a,
                        bitmap: b,
                        history: [c, d],
                    },
                },
                other => other,
            }
        })
}

/// Applies `m` to `stream` (`other` is the second stream a splice takes its tail from).
fn mutate(stream: &[u8], other: &[u8], m: &Mutation) -> Vec<u8> {
    let mut s = stream.to_vec();
    match m {
        Mutation::None => {}
        Mutation::FlipBit { at, bit } => {
            let at = at.index(s.len());
            s[at] ^= 1 << bit;
        }
        Mutation::Truncate { at } => s.truncate(at.index(s.len())),
        Mutation::Insert { at, bytes } => {
            let at = at.index(s.len() + 1);
            s.splice(at..at, bytes.iter().copied());
        }
        Mutation::Remove { at, len } => {
            let at = at.index(s.len());
            let end = (at + len).min(s.len());
            s.drain(at..end);
        }
        Mutation::Splice { a, b } => {
            s.truncate(a.index(s.len() + 1));
            s.extend_from_slice(&other[b.index(other.len() + 1)..]);
        }
        Mutation::Lengths { meta, data } => {
            s[8..12].copy_from_slice(&meta.to_be_bytes());
            s[12..16].copy_from_slice(&data.to_be_bytes());
            fix_crc(&mut s);
        }
        Mutation::Sealed { writes } => {
            let first_len = HEADER_LEN
                + u32::from_be_bytes([s[8], s[9], s[10], s[11]]) as usize
                + u32::from_be_bytes([s[12], s[13], s[14], s[15]]) as usize;
            if first_len > HEADER_LEN {
                for (at, byte) in writes {
                    s[HEADER_LEN + at.index(first_len - HEADER_LEN)] = *byte;
                }
            }
            fix_crc(&mut s);
        }
        Mutation::Kind { kind } => {
            s[5] = *kind;
            fix_crc(&mut s);
        }
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn mutated_frames_never_panic_and_never_yield_an_invalid_message(
        msgs in prop::collection::vec(arb_message(), 1..4),
        others in prop::collection::vec(arb_message(), 1..3),
        mutation in arb_mutation(),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut stream = Vec::new();
        // Where each frame ends.
        let mut ends = Vec::new();
        for m in &msgs {
            stream.extend_from_slice(&encoded(m));
            ends.push(stream.len());
        }
        let mut other = Vec::new();
        for m in &others {
            other.extend_from_slice(&encoded(m));
        }
        let bytes = mutate(&stream, &other, &mutation);
        let (got, end) = drain(&bytes);
        // Delivered in two pieces, the stream decodes the same.
        let (a, b) = bytes.split_at(cut.index(bytes.len() + 1));
        let (got2, end2) = drain_parts(&[a, b]);
        prop_assert_eq!(&got2, &got);
        prop_assert_eq!(&end2, &end);

        match &mutation {
            Mutation::None => prop_assert_eq!(&got, &msgs),
            Mutation::FlipBit { at, .. } => {
                // The frames before the flipped one decode as sent; the flipped one never
                // does, unless the bit is in its length fields (which move what the crc
                // covers): crc32 catches every error burst of up to 32 bits, and the
                // fixed fields fail the header checks.
                let at = at.index(stream.len());
                let k = ends.partition_point(|&e| e <= at);
                let start = if k == 0 { 0 } else { ends[k - 1] };
                prop_assert!(got.len() >= k, "a flip in frame {} lost earlier frames", k);
                prop_assert_eq!(&got[..k], &msgs[..k]);
                if !(8..16).contains(&(at - start)) {
                    prop_assert_eq!(got.len(), k, "frame {} decoded with a bit flipped", k);
                }
            }
            Mutation::Truncate { at } => {
                // Whole frames decode, the cut one waits for more.
                let cut = at.index(stream.len());
                let k = ends.partition_point(|&e| e <= cut);
                let start = if k == 0 { 0 } else { ends[k - 1] };
                prop_assert_eq!(&got, &msgs[..k].to_vec());
                prop_assert_eq!(end, End::NeedMore(cut - start));
            }
            _ => {}
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    #[test]
    fn valid_frames_round_trip_in_any_pieces(
        msgs in prop::collection::vec(arb_message(), 1..6),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let mut stream = Vec::new();
        for m in &msgs {
            stream.extend_from_slice(&encoded(m));
        }
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(stream.len() + 1)).collect();
        at.push(0);
        at.push(stream.len());
        at.sort_unstable();
        let parts: Vec<&[u8]> = at.windows(2).map(|w| &stream[w[0]..w[1]]).collect();
        prop_assert_eq!(drain_parts(&parts), (msgs, End::NeedMore(0)));
    }
}

#[test]
fn the_seed_samples_cover_every_message_kind() {
    let kinds: std::collections::HashSet<_> = samples().iter().map(wire::Kind::of).collect();
    // Every kind a header may name but the transport's auth kinds, which are raw frames.
    for kind in (0..=u8::MAX).filter_map(wire::Kind::from_u8) {
        if !matches!(kind, wire::Kind::AuthChallenge | wire::Kind::AuthResponse) {
            assert!(kinds.contains(&kind), "no sample of {kind:?}");
        }
    }
    for msg in samples() {
        assert_eq!(drain(&encoded(&msg)), (vec![msg], End::NeedMore(0)));
    }
    for frame in transport_frames() {
        let (got, end) = drain(&frame);
        assert!(got.is_empty());
        assert!(
            matches!(end, End::Refused(WireError::UnexpectedKind(_))),
            "{end:?}"
        );
    }
}

/// The mutation strategy is strong enough to matter: over a fixed sample of its cases,
/// the decoder is driven to every outcome, from header refusals through the crc to
/// malformed metas, broken message rules, and messages decoded from changed frames.
#[test]
fn the_mutations_reach_every_layer_of_the_decoder() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    use std::collections::BTreeSet;

    let mut runner = TestRunner::deterministic();
    let strategy = (
        prop::collection::vec(arb_message(), 1..4),
        arb_message(),
        arb_mutation(),
    );
    let mut seen = BTreeSet::new();
    for _ in 0..4000 {
        let (msgs, other, mutation) = strategy.new_tree(&mut runner).expect("a case").current();
        let mut stream = Vec::new();
        for m in &msgs {
            stream.extend_from_slice(&encoded(m));
        }
        let bytes = mutate(&stream, &encoded(&other), &mutation);
        let (got, end) = drain(&bytes);
        let changed = got.iter().zip(&msgs).any(|(g, m)| g != m) || got.len() > msgs.len();
        if changed {
            seen.insert("a changed message");
        }
        seen.insert(match end {
            End::NeedMore(0) => "all decoded",
            End::NeedMore(_) => "need more",
            End::Refused(WireError::BadMagic { .. }) => "bad magic",
            End::Refused(WireError::UnsupportedVersion(_)) => "version",
            End::Refused(WireError::ReservedFlags(_)) => "flags",
            End::Refused(WireError::UnknownKind(_)) => "unknown kind",
            End::Refused(WireError::UnexpectedKind(_)) => "transport kind",
            End::Refused(WireError::TooLarge { .. }) => "too large",
            End::Refused(WireError::UnexpectedSection { .. }) => "unexpected section",
            End::Refused(WireError::BadCrc { .. }) => "bad crc",
            End::Refused(WireError::MalformedMeta { .. }) => "malformed meta",
            End::Refused(WireError::Invalid { .. }) => "invalid message",
            End::Refused(_) => "other",
        });
    }
    for want in [
        "a changed message",
        "all decoded",
        "need more",
        "bad magic",
        "version",
        "flags",
        "unknown kind",
        "transport kind",
        "too large",
        "unexpected section",
        "bad crc",
        "malformed meta",
        "invalid message",
    ] {
        assert!(seen.contains(want), "no case reached `{want}`: {seen:?}");
    }
}
