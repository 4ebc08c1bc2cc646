//! The cache's fuzz corpora as a test.
//!
//! The checks are the fuzz targets' own: `fuzz/src/lib.rs` is compiled in here (see
//! `fuzz/README.md` for the targets and their input formats). Every file committed under
//! `fuzz/corpus/cache_record/`, `cache_superblock/` and `cache_recover/` is fed to its
//! target's check as is, and with a few of its bytes changed; the replay must not be
//! vacuous (some records decode and scan, some superblocks are picked, some crashed
//! devices recover with records replayed, some are refused).
//!
//! `write_cache_seeds` (ignored) writes the seed inputs into the corpus directories.

#[allow(dead_code)]
#[path = "../fuzz/src/lib.rs"]
mod checks;

use std::path::{Path, PathBuf};

use vsan_core::corpus::{mutations, replay};

use checks::{RecordInput, RecoverInput, Recovered};
use vsan_cache::format::{self, CacheMode, HEADER_LEN, RecordHeader, Superblock};
use vsan_core::ErrorKind;

/// Where the fuzz targets' corpora live.
fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

/// The files of one target's corpus, sorted by name.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = corpus_root().join(target);
    let files = vsan_core::corpus::files(&dir);
    assert!(!files.is_empty(), "no corpus in {}", dir.display());
    files
}

#[test]
fn record_corpus() {
    let (mut raw, mut prepared, mut scanned) = (0, 0, 0);
    for (path, bytes) in corpus("cache_record") {
        let got = replay(&path, &bytes, checks::check_record);
        raw += usize::from(got.raw);
        prepared += usize::from(got.prepared);
        scanned += usize::from(got.scanned > 0);
        for m in mutations(&bytes, 32, 5) {
            replay(&path, &m, checks::check_record);
        }
    }
    assert!(
        raw > 0 && prepared > 0 && scanned > 0,
        "raw {raw}, prepared {prepared}, scanned {scanned}: the corpus reaches too little"
    );
}

#[test]
fn superblock_corpus() {
    let mut picked = [0usize; 3];
    for (path, bytes) in corpus("cache_superblock") {
        let got = replay(&path, &bytes, checks::check_superblock);
        for (p, g) in picked.iter_mut().zip(got) {
            *p += usize::from(g);
        }
        for m in mutations(&bytes, 32, 5) {
            replay(&path, &m, checks::check_superblock);
        }
    }
    assert!(
        picked.iter().all(|&p| p > 0),
        "a form of the superblock inputs is never picked (raw, sealed, fitted): {picked:?}"
    );
}

#[test]
fn recover_corpus() {
    let (mut replayed, mut clean) = (0, 0);
    let mut refused = std::collections::BTreeSet::new();
    for (path, bytes) in corpus("cache_recover") {
        match replay(&path, &bytes, checks::check_recover) {
            Recovered::Opened { clean: true, .. } => clean += 1,
            Recovered::Opened { records, .. } => replayed += usize::from(records > 0),
            Recovered::Refused(kind) => {
                refused.insert(format!("{kind:?}"));
            }
        }
        for m in mutations(&bytes, 4, 5) {
            replay(&path, &m, checks::check_recover);
        }
    }
    assert!(
        replayed > 0 && clean > 0,
        "no recovery replays records ({replayed}) or opens clean ({clean})"
    );
    for kind in [ErrorKind::Corrupt, ErrorKind::InvalidArgument] {
        assert!(
            refused.contains(&format!("{kind:?}")),
            "no device of the corpus is refused as {kind:?}: {refused:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Seeds

/// A `cache_record` input: `h` with `data` behind it, at `slot` of lap `lap`.
fn record(h: &RecordHeader, data: &[u8], slot: u16, lap: u8) -> Vec<u8> {
    RecordInput {
        header: format::encode_header(h),
        choices: 0,
        slot,
        lap,
        data: data.to_vec(),
    }
    .to_bytes()
}

/// A clean, empty superblock like `format` writes.
fn superblock(seq: u64) -> Superblock {
    Superblock {
        seq,
        cache_id: [0x5a; 16],
        backing_size: 1 << 20,
        backing_block_size: 512,
        cache_block_size: 4096,
        log_len: 64 << 10,
        tail: 0,
        tail_seq: 1 << 40,
        head: 0,
        next_seq: 1 << 40,
        clean_shutdown: true,
        failed: false,
        mode: CacheMode::WriteBack,
    }
}

/// A synthetic `cache_recover` input: records `ops` from `tail`, nothing damaged.
fn built(setup: u8, tail: u64, sb_flags: u8, ops: &[(u8, u16, u8)]) -> RecoverInput {
    RecoverInput {
        setup,
        blocks: 24,
        seq: 5,
        tail,
        tail_seq: 1000,
        head: 0,
        next_seq: 0,
        sb_flags,
        ops: ops.to_vec(),
        edits: Vec::new(),
        raw_slot: 3,
        raw: Vec::new(),
    }
}

/// A mix of writes: data, zeroes, discards, flushes, one past the end.
const OPS: [(u8, u16, u8); 9] = [
    (0, 1, 2),
    (4, 3, 0),
    (1, 2, 1),
    (2, 10, 3),
    (3, 0, 0),
    (0, 20, 3),
    (5, 7, 1),
    (0, 1, 0),
    (1, 5, 2),
];

/// Writes the seed inputs of the cache targets into their corpus directories.
#[test]
#[ignore = "writes the fuzz corpus seeds; run by hand"]
fn write_cache_seeds() {
    let root = corpus_root();
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
        std::fs::write(dir.join(name), bytes).expect("write a seed");
    };

    let data = vec![0xabu8; 2 * 4096];
    let seeds = [
        (
            "data",
            record(
                &RecordHeader::data(7, 3, &data).expect("a header"),
                &data,
                5,
                1,
            ),
        ),
        (
            "data-at-the-end",
            record(
                &RecordHeader::data(7, 3, &data[..4096]).expect("a header"),
                &data[..4096],
                1024 - 65,
                0xff,
            ),
        ),
        ("wrap", record(&RecordHeader::wrap(9), &[], 700, 2)),
        ("flush", record(&RecordHeader::flush_mark(1), &[], 0, 0)),
        (
            "zero",
            record(
                &RecordHeader::range(2, 100, 4, false).expect("a header"),
                &[],
                9,
                3,
            ),
        ),
        (
            "discard",
            record(
                &RecordHeader::range(2, 100, 4, true).expect("a header"),
                &[],
                9,
                3,
            ),
        ),
    ];
    for (name, bytes) in &seeds {
        write("cache_record", &format!("seed-{name}"), bytes);
    }

    let a = superblock(4);
    let b = Superblock {
        seq: 5,
        clean_shutdown: false,
        tail: 64 * 100,
        ..superblock(5)
    };
    let mut both = a.encode().to_vec();
    both.extend_from_slice(&b.encode());
    write("cache_superblock", "seed-both", &both);
    write("cache_superblock", "seed-one", &a.encode());
    let mut second = vec![0u8; format::SUPERBLOCK_LEN];
    second.extend_from_slice(&b.encode());
    write("cache_superblock", "seed-second", &second);

    let recover = [
        ("empty-clean", built(0, 0, 1 | 16, &[])),
        ("records", built(0, 64 * 7, 0, &OPS)),
        ("records-clean-head", built(0, 64 * 7, 1 | 16, &OPS)),
        ("records-wrap", built(0b10_010, 60 << 10, 4, &OPS)),
        (
            "records-late-lap",
            built(0b110, 5 * (64 << 10) + 4096, 8, &OPS),
        ),
        ("failed", built(0, 0, 2, &OPS)),
        ("other-backing", built(0, 0, 64, &OPS)),
        ("real", built(1, 0, 0, &OPS)),
        ("real-4k", built(1 | 0b11_110, 0, 0, &OPS)),
        (
            "real-damaged",
            RecoverInput {
                edits: vec![(8192 + 64 * 3 + 20, 0x55), ((1 << 31) | 8192, 0)],
                ..built(1, 0, 0, &OPS)
            },
        ),
        (
            "real-long",
            built(
                1,
                0,
                0,
                &[OPS, OPS, OPS]
                    .concat()
                    .into_iter()
                    .take(32)
                    .collect::<Vec<_>>(),
            ),
        ),
    ];
    for (name, x) in &recover {
        write("cache_recover", &format!("seed-{name}"), &x.to_bytes());
    }
}

#[test]
fn the_seeds_reach_every_outcome() {
    let data = vec![0xabu8; 4096];
    let h = RecordHeader::data(7, 3, &data).expect("a header");
    let got = checks::check_record(&record(&h, &data, 5, 1));
    assert!(got.raw && got.prepared && got.scanned == 1, "{got:?}");
    // Cut short, the record's data fails its crc.
    let got = checks::check_record(&record(&h, &data[..100], 5, 1));
    assert!(got.raw && got.scanned == 0, "{got:?}");
    assert_eq!(checks::check_record(&[0; HEADER_LEN]).scanned, 0);

    assert_eq!(checks::check_superblock(&superblock(2).encode()), [true; 3]);

    let open = |x: &RecoverInput| checks::check_recover(&x.to_bytes());
    assert_eq!(
        open(&built(0, 0, 1 | 16, &[])),
        Recovered::Opened {
            clean: true,
            records: 0
        }
    );
    assert!(
        matches!(open(&built(0, 64 * 7, 0, &OPS)), Recovered::Opened { clean: false, records } if records >= 8)
    );
    assert!(
        matches!(open(&built(1, 0, 0, &OPS)), Recovered::Opened { clean: false, records } if records > 0)
    );
    assert_eq!(
        open(&built(0, 0, 2, &OPS)),
        Recovered::Refused(ErrorKind::Corrupt)
    );
    assert_eq!(
        open(&built(0, 0, 64, &OPS)),
        Recovered::Refused(ErrorKind::InvalidArgument)
    );
}

// ---------------------------------------------------------------------------------------
// Crashes the fuzzers found, kept as inputs (also in the corpus as `regression-*`).

/// The bytes of a hex string.
fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The `cache_recover` input `fuzz/corpus/cache_recover/regression-record-far-past-the-backing-store`, as the fuzzer found it.
const FAR_PAST_THE_END: &str = "0018050000000000000000000000000000005ce803000000000000000000000000000000000000000000000209ffffffffffffffffffff1efeffffffffffffffffffff000100020403000001020001020a00030300000000ffffffffffff00f8ffffffffffffffffffffffffffffffff000305f9ffff0501000201050002000300";

/// The `cache_recover` input `fuzz/corpus/cache_recover/regression-seq-at-the-end-of-its-range`, as the fuzzer found it.
const SEQ_AT_THE_END: &str = "e61805ffffffffffffffffffffffffffffffffffffffffffffffffffff000000000000000000007300000000e803000000004646464646464646464646464646464646464646462f4646ffc99a3b464646460000002910000000000000000000000000000009000100020403000001020001020a00030300000000140003050700010001000001050002000300";

/// The `cache_recover` input `fuzz/corpus/cache_recover/regression-stale-records-after-a-clean-open`, as the fuzzer found it.
const STALE_RECORDS: &str = "01180500000000000000000000000000e80000180500000000000000c00100000000000000030001000204030000000000001000000303002500000014000305070001000100000105000202d4200000550000000020008000010000010300050002000300";

/// `cache_record` crash: a sound WRAP record at one of the last positions a `u64` holds.
/// The scan saturated the position after it to `u64::MAX`, took that (not a multiple of
/// 64) for the next record's position, and read its header past the end of the log.
#[test]
fn regression_wrap_at_the_last_positions() {
    let mut input = vec![0u8; 72];
    input[..12].copy_from_slice(&[0x4c, 0x52, 0x43, 0x56, 1, 0, 0, 0, 9, 0, 0, 0]);
    input[29] = 0xa7;
    input[39] = 1;
    input[43] = 9;
    input[64..69].copy_from_slice(&[0xa7, 0xff, 0xff, 0xff, 0xff]);
    assert_eq!(
        checks::check_record(&input),
        checks::RecordOutcome {
            raw: false,
            prepared: true,
            scanned: 0
        }
    );
    // The same through `scan` alone: a WRAP at every one of the last positions.
    let log_len = format::MIN_LOG_LEN;
    for back in 1..=log_len / 64 {
        let tail = u64::MAX - back * 64 + 1;
        let off = (tail % log_len) as usize;
        let mut log = vec![0u8; log_len as usize];
        log[off..off + HEADER_LEN].copy_from_slice(&format::encode_header(&RecordHeader::wrap(9)));
        let end = format::scan(&log, log_len, tail, 9, |_, _, _| {});
        assert_eq!(end.head % 64, 0, "{end:?}");
        assert_eq!(end.stopped, format::StopReason::FullCircle);
    }
}

/// `cache_recover` crash: a sound ZERO record for blocks far past the backing store.
/// `open` checked `(lba + nblocks) * 4096` against the store's size, which overflowed: a
/// panic with overflow checks, and without them (release builds) a wrapped product
/// under the size let the record in, to be destaged at the wrapped offset.
#[test]
fn regression_record_far_past_the_backing_store() {
    // 64 backing blocks; a ZERO record (kind 0x47: bit 6, `% 5 == 1`) of one block at
    // lba 2^52 + 16, whose end in bytes wraps to block 17.
    let x = RecoverInput {
        blocks: 56,
        ..built(0, 0, 0, &[(0x47, 16, 0)])
    };
    assert_eq!(
        checks::check_recover(&x.to_bytes()),
        Recovered::Refused(ErrorKind::Corrupt)
    );
    let bytes = unhex(FAR_PAST_THE_END);
    assert_eq!(
        checks::check_recover(&bytes),
        Recovered::Refused(ErrorKind::Corrupt)
    );
}

/// `cache_recover` failure: a second open read another image. Three writes, then the
/// newer superblock copy (the one open wrote, "not clean") is damaged and the first
/// record too: open falls back to format's copy (clean, empty log) and replays nothing,
/// as it must. But the clean path left the log as it was, so after one new write at the
/// head (as long as the old first record) the old second and third records, whole and
/// carrying the next seqs, were replayed by the next open after a crash.
#[test]
fn regression_stale_records_after_a_clean_open() {
    let x = RecoverInput {
        blocks: 24,
        edits: vec![(8192, 0), (256, 1)],
        raw_slot: 5,
        ..built(1, 0, 0, &[(0, 0, 0), (0, 0, 0), (0, 3, 0)])
    };
    assert_eq!(
        checks::check_recover(&x.to_bytes()),
        Recovered::Opened {
            clean: true,
            records: 0
        }
    );
    let bytes = unhex(STALE_RECORDS);
    assert_eq!(
        checks::check_recover(&bytes),
        Recovered::Opened {
            clean: true,
            records: 0
        }
    );
}

/// `cache_recover` crash: a sound superblock whose tail seq is `u64::MAX` (and seq and
/// tail near it). Open accepted it and the first append after it overflowed the next
/// seq (a panic with overflow checks; elsewhere `seq += 1` on the superblock and
/// `tail + log_len` when zeroing the free log overflow the same way). Such values are
/// damage, never reached by counting: the superblock check now refuses them past
/// `u64::MAX / 2`, as the replica metadata does.
#[test]
fn regression_seq_at_the_end_of_its_range() {
    for x in [
        RecoverInput {
            tail_seq: u64::MAX,
            ..built(0, 0, 0, &OPS)
        },
        RecoverInput {
            seq: u64::MAX,
            ..built(0, 0, 0, &OPS)
        },
        RecoverInput {
            tail: u64::MAX,
            ..built(0, 0, 32, &OPS)
        },
    ] {
        assert_eq!(
            checks::check_recover(&x.to_bytes()),
            Recovered::Refused(ErrorKind::Corrupt),
            "{x:?}"
        );
    }
    let bytes = unhex(SEQ_AT_THE_END);
    assert_eq!(
        checks::check_recover(&bytes),
        Recovered::Refused(ErrorKind::Corrupt)
    );
    let sb = Superblock {
        tail_seq: u64::MAX / 2,
        clean_shutdown: false,
        ..superblock(2)
    };
    assert_eq!(format::Superblock::decode(&sb.encode()), Ok(sb.clone()));
    let sb = Superblock {
        tail_seq: u64::MAX / 2 + 1,
        ..sb
    };
    assert!(format::Superblock::decode(&sb.encode()).is_err());
}
