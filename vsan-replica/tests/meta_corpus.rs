//! The metadata fuzz corpora as a test.
//!
//! The checks are the fuzz targets' own: `fuzz/src/meta.rs` is compiled in here (see
//! `fuzz/README.md` for the targets and their input formats). Every file committed under
//! `fuzz/corpus/meta_superblock/`, `meta_al/` and `meta_open/` is fed to its target's
//! check as is, and with a few of its bytes changed; the replay must not be vacuous
//! (some files decode, some areas open, some are refused).
//!
//! `write_meta_seeds` (ignored) writes the seed inputs into the corpus directories: valid
//! superblocks, activity log records, and whole areas as `meta::create` and the write
//! functions leave them, with copies sealed, torn and cut as the `meta_open` header says.

#[allow(dead_code)]
#[path = "../fuzz/src/meta.rs"]
mod meta_check;

use std::path::{Path, PathBuf};

use vsan_core::corpus::{mutations, replay};

use meta_check::{OpenChoices, Opened};
use vsan_core::{BlockDevice, ErrorKind, Geometry, MemDevice};
use vsan_replica::meta::{self, Bitmap, Layout, Superblock};
use vsan_replica::protocol::{DiskId, Generations};

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
fn superblock_corpus() {
    let mut decoded = [0usize; 3];
    for (path, bytes) in corpus("meta_superblock") {
        let got = replay(&path, &bytes, meta_check::check_superblock);
        for (d, g) in decoded.iter_mut().zip(got) {
            *d += usize::from(g);
        }
        for m in mutations(&bytes, 24, 7) {
            replay(&path, &m, meta_check::check_superblock);
        }
    }
    assert!(
        decoded.iter().all(|&d| d > 0),
        "a form of the superblock inputs never decodes (raw, sealed, fitted): {decoded:?} \
         (after `cargo fuzz cmin`, write the seeds again: `write_meta_seeds`)"
    );
}

#[test]
fn al_corpus() {
    let mut decoded = [0usize; 2];
    for (path, bytes) in corpus("meta_al") {
        let got = replay(&path, &bytes, meta_check::check_al);
        for (d, g) in decoded.iter_mut().zip(got) {
            *d += usize::from(g);
        }
        for m in mutations(&bytes, 24, 7) {
            replay(&path, &m, meta_check::check_al);
        }
    }
    assert!(
        decoded.iter().all(|&d| d > 0),
        "a form of the activity log inputs never decodes (raw, prepared): {decoded:?} \
         (after `cargo fuzz cmin`, write the seeds again: `write_meta_seeds`)"
    );
}

#[test]
fn open_corpus() {
    let mut loaded = 0;
    let mut refused = std::collections::BTreeSet::new();
    for (path, bytes) in corpus("meta_open") {
        match replay(&path, &bytes, meta_check::check_open) {
            Opened::Loaded => loaded += 1,
            Opened::Refused(kind) => {
                refused.insert(format!("{kind:?}"));
            }
        }
        for m in mutations(&bytes, 8, 7) {
            replay(&path, &m, meta_check::check_open);
        }
    }
    assert!(loaded > 0, "no area of the corpus opens");
    for kind in [ErrorKind::Corrupt, ErrorKind::InvalidArgument] {
        assert!(
            refused.contains(&format!("{kind:?}")),
            "no area of the corpus is refused as {kind:?}: {refused:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Seeds

fn superblock(seq: u64, name: &str, flags: u8) -> Superblock {
    Superblock {
        seq,
        disk_id: DiskId::from_name(name),
        disk_name: name.into(),
        node_id: 1,
        peer_id: 2,
        size: 1 << 30,
        block_size: 512,
        chunk_size: meta::DEFAULT_CHUNK_SIZE,
        generations: Generations {
            current: 0x1234_5678_9abc_def1,
            bitmap: 77,
            history: [66, 55],
        },
        inconsistent: flags & 1 != 0,
        crashed: flags & 2 != 0,
        clean_shutdown: flags & 4 != 0,
    }
}

/// The choices of a `meta_open` seed for a disk of `size` bytes (`geometry` as in
/// [`OpenChoices`]) that seal nothing.
fn choices(geometry: u8, size: u32) -> OpenChoices {
    OpenChoices {
        geometry,
        size,
        seal: 0,
        length: 0,
        sb_seq: 6,
        al_seq: 10,
        flags: 4,
        generations: [9, 8, 7, 0],
        torn_sectors: 3,
        extent_count: 3,
        extents: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        chunk: 12345,
    }
}

/// The area `meta::create` writes for the disk `c` describes, then `writes` rounds of a
/// new superblock, activity log record and bitmap bits, as a running disk leaves it.
fn created_area(c: &OpenChoices, writes: u64) -> Vec<u8> {
    let p = meta_check::open_params(c.geometry, c.size);
    let layout = Layout::checked(p.size, p.chunk_size, p.block_size).expect("a layout");
    let dev = MemDevice::new(Geometry::new(layout.total_len(), 512).expect("a geometry"));
    let mut l = meta_check::now(meta::create(&dev, &p)).expect("create");
    for i in 0..writes {
        l.superblock.seq += 1;
        l.superblock.clean_shutdown = false;
        l.superblock.generations.current += 1;
        meta_check::now(meta::write_superblock(&dev, &layout, &l.superblock)).expect("write");
        l.al_seq += 1;
        let extents: Vec<u64> = (0..i.min(layout.extents())).collect();
        meta_check::now(meta::write_al(&dev, &layout, l.al_seq, &extents)).expect("write");
        let chunk = (i * 7919) % layout.chunks();
        l.bitmap.set(chunk);
        meta_check::now(meta::write_bitmap_block(
            &dev,
            &layout,
            &l.bitmap,
            Bitmap::block_of(chunk),
        ))
        .expect("write");
    }
    meta_check::now(dev.read(0, layout.total_len() as usize))
        .expect("read")
        .to_vec()
}

/// Writes the seed inputs of the metadata targets into their corpus directories.
#[test]
#[ignore = "writes the fuzz corpus seeds; run by hand"]
fn write_meta_seeds() {
    let root = corpus_root();
    // Without its trailing zeros: the target pads the area with zeros anyway.
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
        let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
        let keep = if target == "meta_open" {
            end
        } else {
            bytes.len()
        };
        std::fs::write(dir.join(name), &bytes[..keep]).expect("write a seed");
    };

    let long = "n".repeat(255);
    for (i, sb) in [
        superblock(0, "vol0", 4),
        superblock(1, "vol0-ünïcode", 1),
        superblock(u64::MAX, &long, 7),
        superblock(42, "", 2),
    ]
    .iter()
    .enumerate()
    {
        write(
            "meta_superblock",
            &format!("seed-{i}"),
            &meta_check::superblock_input(sb),
        );
    }

    let full: Vec<u64> = (0..meta::AL_SLOTS as u64).rev().collect();
    for (i, (size, shift, seq, extents)) in [
        (1u64 << 30, 4u8, 2u64, vec![]),
        (1 << 30, 0, 3, vec![0, 255, 17]),
        (4 << 30, 4, 9, full),
        (100 * 1024, 0, u64::MAX, vec![0]),
    ]
    .into_iter()
    .enumerate()
    {
        write(
            "meta_al",
            &format!("seed-{i}"),
            &meta_check::al_input(size, shift, seq, &extents),
        );
    }

    // Raw areas, as created and after some writes, on a few geometries.
    let geometries = [
        (0u8, 100 * 1024u32),
        (4, 1 << 30),
        (0, (1 << 28) - 1),
        (0b11_000, 5 << 20),
    ];
    for (i, &(geometry, size)) in geometries.iter().enumerate() {
        let c = choices(geometry, size);
        let writes = 3 * (i as u64 % 2);
        write(
            "meta_open",
            &format!("seed-area-{i}-{writes}"),
            &meta_check::open_input(&c, &created_area(&c, writes)),
        );
    }
    // Sealed copies over zeros or over a real area: every seal bit, torn records, a
    // wrong node, a wrong slot, a device too short and too long.
    let c = choices(0, 64 << 20);
    let area = created_area(&c, 2);
    // On a disk of one extent, the sealed records hold extents past its end.
    let one_extent = choices(0, 100 * 1024);
    write(
        "meta_open",
        "seed-sealed-bad-extent",
        &meta_check::open_input(
            &OpenChoices {
                seal: 0x0f,
                ..one_extent
            },
            &[],
        ),
    );
    for (name, seal, length) in [
        ("all", 0x0f, 0),
        ("sb-only", 0x03, 0),
        ("torn-sb", 0x1f, 0),
        ("torn-al", 0x2f, 0),
        ("other-node", 0x4f, 0),
        ("wrong-slot", 0x8f, 0),
        ("short", 0x0f, 128 + 3),
        ("long", 0x0f, 128 + 64 + 3),
        ("tiny", 0x0f, 128 + 63),
    ] {
        let c = OpenChoices {
            seal,
            length,
            ..c.clone()
        };
        write(
            "meta_open",
            &format!("seed-sealed-{name}"),
            &meta_check::open_input(&c, &[]),
        );
        if ["all", "torn-sb", "short"].contains(&name) {
            write(
                "meta_open",
                &format!("seed-sealed-{name}-over-area"),
                &meta_check::open_input(&c, &area),
            );
        }
    }
}

#[test]
fn the_seeds_reach_every_outcome() {
    // A created area opens; the same cut short or sealed with the wrong node does not.
    let c = choices(0, 64 << 20);
    let area = created_area(&c, 2);
    assert_eq!(
        meta_check::check_open(&meta_check::open_input(&c, &area)),
        Opened::Loaded
    );
    let short = OpenChoices {
        length: 128 + 3,
        ..c.clone()
    };
    assert_eq!(
        meta_check::check_open(&meta_check::open_input(&short, &area)),
        Opened::Refused(ErrorKind::Corrupt)
    );
    let other = OpenChoices {
        seal: 0x4f,
        ..c.clone()
    };
    assert_eq!(
        meta_check::check_open(&meta_check::open_input(&other, &[])),
        Opened::Refused(ErrorKind::InvalidArgument)
    );
    // A torn newer superblock leaves the older copy, which still opens.
    for sectors in 0..=8 {
        let torn = OpenChoices {
            seal: 0x1f,
            torn_sectors: sectors,
            ..c.clone()
        };
        assert_eq!(
            meta_check::check_open(&meta_check::open_input(&torn, &[])),
            Opened::Loaded,
            "{sectors} sectors"
        );
    }
    let sb = superblock(3, "vol0", 5);
    assert_eq!(
        meta_check::check_superblock(&meta_check::superblock_input(&sb)),
        [true; 3]
    );
    assert_eq!(
        meta_check::check_al(&meta_check::al_input(1 << 30, 4, 7, &[1, 2])),
        [true; 2]
    );
}
