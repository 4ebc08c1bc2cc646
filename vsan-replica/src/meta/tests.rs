//! Metadata on a device: create, reopen, and every refusal, on a `MemDevice` and in a
//! real file.

use bytes::Bytes;
use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};

use super::*;
use crate::protocol::{DiskId, GEN_JUST_CREATED};

const GIB: u64 = 1 << 30;

fn params() -> MetaParams {
    MetaParams {
        disk_id: DiskId::from_name("vol0"),
        disk_name: "vol0".into(),
        node_id: 1,
        peer_id: 2,
        size: GIB,
        block_size: 512,
        chunk_size: DEFAULT_CHUNK_SIZE,
    }
}

fn device(len: u64) -> MemDevice {
    MemDevice::new(Geometry::new(len, 512).unwrap())
}

/// A device holding freshly created metadata for `params()`.
async fn created() -> (MemDevice, Loaded) {
    let p = params();
    let dev = device(Layout::new(p.size, p.chunk_size).total_len());
    let loaded = create(&dev, &p).await.unwrap();
    (dev, loaded)
}

/// Applies `f` to the bytes at `offset..offset + len` of `dev`.
async fn patch(dev: &dyn BlockDevice, offset: u64, len: usize, f: impl FnOnce(&mut [u8])) {
    let mut b = dev.read(offset, len).await.unwrap().to_vec();
    f(&mut b);
    dev.write(offset, Bytes::from(b), IoFlags::empty())
        .await
        .unwrap();
}

/// Copies the first `len` bytes of `from` to a new device of `dev_len` bytes.
async fn copy_to(from: &MemDevice, len: u64, dev_len: u64) -> MemDevice {
    let to = device(dev_len);
    let b = from.read(0, len as usize).await.unwrap();
    to.write(0, b, IoFlags::empty()).await.unwrap();
    to
}

async fn open_err(dev: &dyn BlockDevice, p: &MetaParams) -> (ErrorKind, String) {
    let e = open(dev, p).await.unwrap_err();
    (e.kind(), e.to_string())
}

#[tokio::test]
async fn create_then_open() {
    let (dev, made) = created().await;
    let sb = &made.superblock;
    assert_eq!(sb.seq, 1);
    assert_eq!(sb.generations.current, GEN_JUST_CREATED);
    assert_eq!((sb.generations.bitmap, sb.generations.history), (0, [0, 0]));
    assert!(!sb.inconsistent && !sb.crashed && sb.clean_shutdown);
    assert_eq!((made.al_seq, made.al.len()), (1, 0));
    assert_eq!(made.bitmap.count(), 0);

    let got = open(&dev, &params()).await.unwrap();
    assert_eq!(got.superblock, made.superblock);
    assert_eq!(got.layout, made.layout);
    assert_eq!((got.al_seq, got.al), (1, vec![]));
    assert_eq!(got.bitmap, made.bitmap);
    assert_eq!(got.bitmap.chunks(), 16384);
}

#[tokio::test]
async fn writes_survive_reopen_and_the_newest_copy_wins() {
    let (dev, mut m) = created().await;
    let l = m.layout;
    m.bitmap.set(3);
    m.bitmap.set(16383);
    write_bitmap_block(&dev, &l, &m.bitmap, Bitmap::block_of(3))
        .await
        .unwrap();
    write_al(&dev, &l, 2, &[7, 9]).await.unwrap();
    write_al(&dev, &l, 3, &[9, 200]).await.unwrap();
    let mut sb = m.superblock.clone();
    sb.seq = 2;
    sb.clean_shutdown = false;
    sb.generations.current = 1234;
    write_superblock(&dev, &l, &sb).await.unwrap();
    assert!(write_bitmap_block(&dev, &l, &m.bitmap, 1).await.is_err());

    let got = open(&dev, &params()).await.unwrap();
    assert_eq!(got.superblock, sb);
    assert_eq!((got.al_seq, got.al), (3, vec![9, 200]));
    assert_eq!(got.bitmap.runs(), vec![(3, 1), (16383, 1)]);
}

#[tokio::test]
async fn create_refuses_a_device_of_the_wrong_size() {
    let dev = device(8192);
    let e = create(&dev, &params()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("the layout needs 36864"), "{e}");
}

#[tokio::test]
async fn bad_params_are_refused_before_any_io() {
    let dev = device(36864);
    let mut p = params();
    p.chunk_size = 1000;
    let (kind, msg) = open_err(&dev, &p).await;
    assert_eq!(kind, ErrorKind::InvalidArgument);
    assert!(
        msg.contains("\"vol0\"") && msg.contains("chunk size 1000"),
        "{msg}"
    );
    let mut p = params();
    p.disk_name = "x".repeat(256);
    assert_eq!(
        create(&dev, &p).await.unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    // Nothing was written.
    assert_eq!(dev.allocated_bytes(), 0);
}

#[tokio::test]
async fn truncated_and_longer_metadata_is_corrupt() {
    let (dev, _) = created().await;
    let short = copy_to(&dev, 8192, 8192).await;
    let (kind, msg) = open_err(&short, &params()).await;
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(
        msg.contains("metadata for disk \"vol0\" is truncated: 8192 bytes, the layout needs 36864"),
        "{msg}"
    );
    let tiny = copy_to(&dev, 4096, 4096).await;
    let (kind, msg) = open_err(&tiny, &params()).await;
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(msg.contains("truncated: 4096 bytes"), "{msg}");
    let long = copy_to(&dev, 36864, 40960).await;
    let (kind, msg) = open_err(&long, &params()).await;
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(
        msg.contains(&format!(
            "is 40960 bytes: its layout needs 36864, or {} with the SCSI state area",
            36864 + 2 * SCSI_COPY_LEN
        )),
        "{msg}"
    );
}

#[tokio::test]
async fn both_superblocks_corrupt_is_refused_with_each_reason() {
    let (dev, m) = created().await;
    let l = m.layout;
    patch(&dev, l.superblock_offset(0), META_BLOCK, |b| b.fill(0)).await;
    patch(&dev, l.superblock_offset(1), META_BLOCK, |b| b[50] ^= 0x40).await;
    let (kind, msg) = open_err(&dev, &params()).await;
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(msg.contains("both superblock copies are corrupt"), "{msg}");
    assert!(msg.contains("copy 0: bad magic"), "{msg}");
    assert!(msg.contains("copy 1: crc mismatch"), "{msg}");
    assert!(msg.contains("\"vol0\""), "{msg}");
}

#[tokio::test]
async fn one_bad_superblock_copy_opens_with_the_other() {
    let (dev, m) = created().await;
    let l = m.layout;
    // A torn write of the newer copy (seq 1): the older one is used.
    patch(&dev, l.superblock_offset(1), 512, |b| b[20] ^= 1).await;
    let got = open(&dev, &params()).await.unwrap();
    assert_eq!(got.superblock.seq, 0);
    assert_eq!(
        got.superblock,
        Superblock {
            seq: 0,
            ..m.superblock.clone()
        }
    );
    // The older copy bad instead: the newer one is used.
    let (dev, m) = created().await;
    patch(&dev, l.superblock_offset(0), 512, |b| b[0] = b'X').await;
    assert_eq!(
        open(&dev, &params()).await.unwrap().superblock,
        m.superblock
    );
}

#[tokio::test]
async fn a_copy_in_the_wrong_slot_is_not_trusted() {
    let (dev, m) = created().await;
    let l = m.layout;
    // Copy 0 holding an odd seq newer than copy 1: not written by this code.
    let stray = Superblock {
        seq: 5,
        ..m.superblock.clone()
    };
    dev.write(l.superblock_offset(0), stray.encode(), IoFlags::empty())
        .await
        .unwrap();
    assert_eq!(open(&dev, &params()).await.unwrap().superblock.seq, 1);
}

#[tokio::test]
async fn metadata_of_another_disk_is_refused() {
    let (dev, _) = created().await;
    let mut p = params();
    p.disk_name = "vol1".into();
    p.disk_id = DiskId::from_name("vol1");
    let (kind, msg) = open_err(&dev, &p).await;
    assert_eq!(kind, ErrorKind::InvalidArgument);
    assert!(msg.contains("belongs to disk \"vol0\""), "{msg}");
    assert!(msg.contains("\"vol1\""), "{msg}");
    // Same name, another id.
    let mut p = params();
    p.disk_id = DiskId([1; 16]);
    let (kind, msg) = open_err(&dev, &p).await;
    assert_eq!(kind, ErrorKind::InvalidArgument);
    assert!(msg.contains("belongs to disk"), "{msg}");
}

#[tokio::test]
async fn each_field_mismatch_names_the_field_and_both_values() {
    let (dev, _) = created().await;
    type Tweak = fn(&mut MetaParams);
    let cases: [(Tweak, &str); 5] = [
        (
            |p| p.node_id = 3,
            "node id 1 in the metadata, 3 in the config",
        ),
        (
            |p| p.peer_id = 7,
            "peer id 2 in the metadata, 7 in the config",
        ),
        (
            |p| p.size = 2 * GIB,
            "size 1073741824 in the metadata, 2147483648 in the config",
        ),
        (
            |p| p.block_size = 4096,
            "block size 512 in the metadata, 4096 in the config",
        ),
        (
            |p| p.chunk_size = 131072,
            "chunk size 65536 in the metadata, 131072 in the config",
        ),
    ];
    for (tweak, want) in cases {
        let mut p = params();
        tweak(&mut p);
        let (kind, msg) = open_err(&dev, &p).await;
        assert_eq!(kind, ErrorKind::InvalidArgument, "{msg}");
        assert!(msg.contains(want), "{msg}");
        assert!(msg.contains("\"vol0\""), "{msg}");
    }
}

#[tokio::test]
async fn a_config_change_that_moves_the_layout_names_the_field() {
    // 4 TiB at 64 KiB needs 2048 bitmap blocks, at 128 KiB 1024: the file length differs
    // too, but the error names the chunk size rather than calling the file truncated.
    let mut p = params();
    p.size = 4 << 40;
    let len = Layout::new(p.size, p.chunk_size).total_len();
    let dev = device(len);
    create(&dev, &p).await.unwrap();
    p.chunk_size = 131072;
    let (kind, msg) = open_err(&dev, &p).await;
    assert_eq!(kind, ErrorKind::InvalidArgument);
    assert!(msg.contains("chunk size 65536 in the metadata"), "{msg}");
}

#[tokio::test]
async fn activity_log_copies() {
    let (dev, m) = created().await;
    let l = m.layout;
    write_al(&dev, &l, 2, &[5]).await.unwrap();
    // Newest copy (seq 2, copy 0) torn: the older (seq 1, empty) is used.
    patch(&dev, l.al_offset(2), 512, |b| b[24] ^= 1).await;
    let got = open(&dev, &params()).await.unwrap();
    assert_eq!((got.al_seq, got.al), (1, vec![]));
    // Both bad: refused.
    patch(&dev, l.al_offset(1), 512, |b| b[0] ^= 1).await;
    let (kind, msg) = open_err(&dev, &params()).await;
    assert_eq!(kind, ErrorKind::Corrupt);
    assert!(
        msg.contains("both activity log copies are corrupt"),
        "{msg}"
    );
    assert!(
        msg.contains("copy 0: crc mismatch") && msg.contains("copy 1: bad magic"),
        "{msg}"
    );
}

mod file {
    use super::*;

    async fn file_err(path: &std::path::Path, p: &MetaParams) -> vsan_core::Error {
        match open_or_create_file(path, p).await {
            Ok(_) => panic!("{} opened", path.display()),
            Err(e) => e,
        }
    }

    #[tokio::test]
    async fn create_then_reopen_in_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol0.meta");
        let p = params();
        let (dev, made, created) = open_or_create_file(&path, &p).await.unwrap();
        assert!(created);
        // The core area and the SCSI state area's two copies.
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            36864 + 2 * SCSI_COPY_LEN as u64
        );
        assert_eq!(dev.geometry().block_size(), 512);
        assert_eq!(made.superblock.seq, 1);
        // Nothing left under the temporary name.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

        let mut bm = made.bitmap.clone();
        bm.set(100);
        write_bitmap_block(dev.as_ref(), &made.layout, &bm, 0)
            .await
            .unwrap();
        drop(dev);

        let (_dev, got, created) = open_or_create_file(&path, &p).await.unwrap();
        assert!(!created);
        assert_eq!(got.superblock, made.superblock);
        assert_eq!(got.bitmap.runs(), vec![(100, 1)]);
    }

    #[tokio::test]
    async fn a_damaged_file_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol0.meta");
        let p = params();
        drop(open_or_create_file(&path, &p).await.unwrap());

        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(8192).unwrap();
        let e = file_err(&path, &p).await;
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        let msg = e.to_string();
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(
            msg.contains("is truncated: 8192 bytes, the layout needs 36864"),
            "{msg}"
        );

        // Too short to hold the superblocks, or not a whole number of blocks.
        for len in [100, 5000, 36864 + 7] {
            f.set_len(len).unwrap();
            let e = file_err(&path, &p).await;
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        }
        // Never re-initialised: the file is as the failed opens found it.
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 36864 + 7);
    }

    #[tokio::test]
    async fn both_superblocks_zeroed_in_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol0.meta");
        let p = params();
        drop(open_or_create_file(&path, &p).await.unwrap());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[..2 * META_BLOCK].fill(0);
        std::fs::write(&path, &bytes).unwrap();
        let e = file_err(&path, &p).await;
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        assert!(
            e.to_string().contains("both superblock copies are corrupt"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    #[tokio::test]
    async fn a_stale_half_made_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol0.meta");
        std::fs::write(dir.path().join("vol0.meta.creating"), b"half").unwrap();
        let (_dev, _, created) = open_or_create_file(&path, &params()).await.unwrap();
        assert!(created);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[tokio::test]
    async fn a_file_made_before_the_scsi_state_area_is_grown_and_keeps_its_contents() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vol0.meta");
        let p = params();
        let (dev, made, _) = open_or_create_file(&path, &p).await.unwrap();
        let mut bm = made.bitmap.clone();
        bm.set(7);
        write_bitmap_block(dev.as_ref(), &made.layout, &bm, 0)
            .await
            .unwrap();
        drop(dev);
        // As an older version left it: the core area only.
        let core = made.layout.total_len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(core)
            .unwrap();
        let (dev, got, created) = open_or_create_file(&path, &p).await.unwrap();
        assert!(!created);
        assert_eq!(
            got.bitmap.runs(),
            vec![(7, 1)],
            "the bitmap is where it was"
        );
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            made.layout.total_len_with_scsi()
        );
        let mut area = read_scsi_area(dev.as_ref(), &got.layout).await.unwrap();
        assert_eq!(area, ScsiArea::default(), "grown empty");
        write_scsi_area(
            dev.as_ref(),
            &got.layout,
            &mut area,
            Bytes::from_static(b"state"),
        )
        .await
        .unwrap();
        drop(dev);
        let (dev, got, _) = open_or_create_file(&path, &p).await.unwrap();
        let area = read_scsi_area(dev.as_ref(), &got.layout).await.unwrap();
        assert_eq!(area.state.as_deref(), Some(&b"state"[..]));
    }
}

mod scsi_area {
    use super::*;

    async fn with_area() -> (MemDevice, Layout) {
        let p = params();
        let l = Layout::new(p.size, p.chunk_size);
        let dev = device(l.total_len_with_scsi());
        create(&dev, &p).await.unwrap();
        (dev, l)
    }

    #[test]
    fn records_round_trip_and_damage_is_told_from_an_empty_slot() {
        let c = encode_scsi(5, b"hello").unwrap();
        assert_eq!(c.len(), SCSI_COPY_LEN);
        assert_eq!(
            decode_scsi(&c).unwrap(),
            Some((5, Bytes::from_static(b"hello")))
        );
        assert_eq!(decode_scsi(&vec![0u8; SCSI_COPY_LEN]).unwrap(), None);
        for at in [0, 8, 16, 30, SCSI_COPY_LEN - 1] {
            let mut b = c.to_vec();
            b[at] ^= 0x40;
            assert_eq!(
                decode_scsi(&b).unwrap_err().kind(),
                ErrorKind::Corrupt,
                "byte {at}"
            );
        }
        assert!(decode_scsi(&c[..100]).is_err());
        let big = vec![1u8; SCSI_STATE_MAX + 1];
        assert_eq!(encode_scsi(1, &big).unwrap_err().kind(), ErrorKind::NoSpace);
        assert!(encode_scsi(1, &big[..SCSI_STATE_MAX]).is_ok());
    }

    #[tokio::test]
    async fn copies_alternate_and_a_torn_newest_falls_back_to_the_older() {
        let (dev, l) = with_area().await;
        let mut area = read_scsi_area(&dev, &l).await.unwrap();
        assert_eq!(area, ScsiArea::default(), "created empty");
        for (i, s) in [&b"one"[..], b"two", b"three"].iter().enumerate() {
            write_scsi_area(&dev, &l, &mut area, Bytes::copy_from_slice(s))
                .await
                .unwrap();
            assert_eq!(area.seq, i as u64 + 1);
            assert_eq!(read_scsi_area(&dev, &l).await.unwrap(), area);
        }
        // Seq 3 went to copy 1; tear it: seq 2 ("two") in copy 0 holds.
        patch(&dev, l.scsi_offset(3), 512, |b| b[30] ^= 1).await;
        let got = read_scsi_area(&dev, &l).await.unwrap();
        assert_eq!((got.seq, got.state.as_deref()), (2, Some(&b"two"[..])));
        // Both damaged: refused, never read as empty.
        patch(&dev, l.scsi_offset(2), 512, |b| b[0] ^= 1).await;
        let e = read_scsi_area(&dev, &l).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        // The core metadata opens regardless.
        open(&dev, &params()).await.unwrap();
    }

    #[tokio::test]
    async fn the_only_written_copy_damaged_is_refused() {
        let (dev, l) = with_area().await;
        let mut area = ScsiArea::default();
        write_scsi_area(&dev, &l, &mut area, Bytes::from_static(b"x"))
            .await
            .unwrap();
        patch(&dev, l.scsi_offset(1), 512, |b| b[40] ^= 1).await;
        let e = read_scsi_area(&dev, &l).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("only written copy"), "{e}");
    }

    #[tokio::test]
    async fn metadata_without_the_area_reads_empty_and_refuses_a_save() {
        let (dev, loaded) = created().await;
        let l = loaded.layout;
        assert!(!has_scsi_area(&dev, &l));
        assert_eq!(read_scsi_area(&dev, &l).await.unwrap(), ScsiArea::default());
        let mut area = ScsiArea::default();
        let e = write_scsi_area(&dev, &l, &mut area, Bytes::from_static(b"x"))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert_eq!(area, ScsiArea::default(), "unchanged on error");
        // A length that is neither is refused by open, as before.
        let odd = copy_to(&dev, l.total_len(), l.total_len() + 4096).await;
        assert_eq!(open_err(&odd, &params()).await.0, ErrorKind::Corrupt);
    }
}
