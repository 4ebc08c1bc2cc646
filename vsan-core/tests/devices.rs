//! Integration tests of the devices through the public API: validation of every bad-input
//! class on every device, FileDevice persistence and options, and FaultyDevice's errors,
//! latency and power cuts. Every check compares real bytes read back from the device.

mod common;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use common::{BS, fill_range, pattern, read_range, tempdir};
use vsan_core::{
    BlockDevice, ErrorKind, FaultConfig, FaultyDevice, FileDevice, FileOptions, Geometry, IoFlags,
    MemDevice, OpKind, PowerCut,
};

/// The whole device, read in requests of at most `max_io`.
async fn image(dev: &dyn BlockDevice) -> Vec<u8> {
    read_range(dev, 0, dev.geometry().size()).await
}

/// Fill the whole device with `pattern(tag, ..)`.
async fn fill(dev: &dyn BlockDevice, tag: u8) {
    fill_range(dev, tag, 0, dev.geometry().size()).await;
}

/// The bad-input classes, as (what, offset, len, expected kind), for one operation.
/// `payload` says whether the operation carries data (read, write), which adds the
/// maximum-request check.
fn bad_inputs(g: Geometry, payload: bool) -> Vec<(&'static str, u64, u64, ErrorKind)> {
    use ErrorKind::{InvalidArgument as Inval, OutOfRange as Range};
    let (size, bs, max) = (g.size(), u64::from(g.block_size()), u64::from(g.max_io()));
    let mut cases = vec![
        ("misaligned offset", 1, bs, Inval),
        ("misaligned offset near the end", size - bs + 1, bs, Inval),
        ("misaligned length", 0, bs + 1, Inval),
        ("length below a block", 0, bs - 1, Inval),
        ("zero length", 0, 0, Inval),
        ("zero length at the end", size, 0, Inval),
        ("offset at the end", size, bs, Range),
        ("offset far past the end", size * 4, bs, Range),
        ("range crossing the end", size - bs, 2 * bs, Range),
        ("offset + len overflows", u64::MAX - bs + 1, bs, Range),
        // Alignment is checked before the range (documented order).
        ("misaligned and past the end", size + 1, bs, Inval),
    ];
    if payload {
        assert!(max + bs <= size, "the device must be larger than max_io");
        cases.push(("larger than max_io", 0, max + bs, Inval));
        cases.push(("larger than max_io, huge", bs, u64::MAX - bs + 1, Inval));
    } else {
        cases.push(("whole device plus a block", 0, size + bs, Range));
        cases.push(("length overflows", bs, u64::MAX - bs + 1, Range));
    }
    cases
}

/// Every bad-input class on every operation gets the right kind and changes no byte.
async fn check_validation(dev: &dyn BlockDevice) {
    let g = dev.geometry();
    fill(dev, 0x5a).await;
    let before = image(dev).await;
    for (what, off, len, want) in bad_inputs(g, true) {
        let err = dev.read(off, len as usize).await.unwrap_err();
        assert_eq!(err.kind(), want, "read {what} ({off}, {len}): {err}");
        // A write of u64::MAX bytes cannot be built; its refusal is covered by the read
        // (same validation) and by the max_io case below.
        if len <= u64::from(g.max_io()) * 2 {
            let data = Bytes::from(vec![0xee; len as usize]);
            let err = dev
                .write(off, data.clone(), IoFlags::empty())
                .await
                .unwrap_err();
            assert_eq!(err.kind(), want, "write {what} ({off}, {len}): {err}");
            let err = dev.write(off, data, IoFlags::FUA).await.unwrap_err();
            assert_eq!(err.kind(), want, "FUA write {what} ({off}, {len}): {err}");
        }
    }
    for (what, off, len, want) in bad_inputs(g, false) {
        let err = dev.discard(off, len, IoFlags::empty()).await.unwrap_err();
        assert_eq!(err.kind(), want, "discard {what} ({off}, {len}): {err}");
        for flags in [IoFlags::empty(), IoFlags::FUA] {
            let err = dev.write_zeroes(off, len, flags).await.unwrap_err();
            assert_eq!(
                err.kind(),
                want,
                "write_zeroes {what} ({off}, {len}): {err}"
            );
        }
    }
    dev.flush().await.unwrap();
    assert!(
        image(dev).await == before,
        "a refused request changed the device"
    );
    // The edges are accepted: the last block, and a discard larger than max_io.
    let bs = g.block_size() as usize;
    let last = g.size() - bs as u64;
    dev.write(last, Bytes::from(vec![1; bs]), IoFlags::empty())
        .await
        .unwrap();
    assert_eq!(dev.read(last, bs).await.unwrap(), vec![1; bs]);
    let big = u64::from(g.max_io()) + bs as u64;
    dev.discard(0, big, IoFlags::empty()).await.unwrap();
    assert_eq!(dev.read(0, bs).await.unwrap(), vec![0; bs]);
}

#[tokio::test]
async fn validation_mem_device() {
    let g = Geometry::with_max_io(1 << 20, BS as u32, 64 << 10).unwrap();
    check_validation(&MemDevice::new(g)).await;
    let g = Geometry::with_max_io(1 << 20, 4096, 64 << 10).unwrap();
    check_validation(&MemDevice::new(g)).await;
}

#[tokio::test]
async fn validation_file_device() {
    // FileDevice takes the default max_io (32 MiB), so the file must be larger than that.
    let dir = tempdir();
    let size = u64::from(vsan_core::device::DEFAULT_MAX_IO) + (1 << 20);
    let dev = FileOptions::new()
        .create(size)
        .open(dir.path().join("disk.img"))
        .unwrap();
    check_validation(&dev).await;
}

#[tokio::test]
async fn validation_faulty_device() {
    let g = Geometry::with_max_io(1 << 20, BS as u32, 64 << 10).unwrap();
    let dev = FaultyDevice::new(MemDevice::new(g));
    check_validation(&dev).await;

    // Again with unflushed writes in the overlay and faults armed: bad input is refused
    // with its own kind, not the injected one, and the overlay is untouched.
    let dev = FaultyDevice::new(MemDevice::new(g));
    fill(&dev, 0x33).await;
    let pending = dev.pending_writes();
    let before = image(&dev).await;
    dev.set_faults(FaultConfig::new().kind(ErrorKind::Corrupt));
    for (what, off, len, want) in bad_inputs(g, false) {
        let err = dev.write_zeroes(off, len, IoFlags::FUA).await.unwrap_err();
        assert_eq!(err.kind(), want, "write_zeroes {what}");
    }
    let err = dev
        .write(1, Bytes::from(vec![0; 512]), IoFlags::empty())
        .await;
    assert_eq!(err.unwrap_err().kind(), ErrorKind::InvalidArgument);
    dev.clear_faults();
    assert_eq!(dev.pending_writes(), pending);
    assert!(image(&dev).await == before);
}

#[tokio::test]
async fn file_device_flushed_data_survives_reopen() {
    let dir = tempdir();
    let path = dir.path().join("disk.img");
    let dev = FileOptions::new().create(1 << 20).open(&path).unwrap();
    assert_eq!(dev.geometry().size(), 1 << 20);
    fill(&dev, 1).await;
    dev.write(8192, Bytes::from(pattern(2, 8192, 16384)), IoFlags::empty())
        .await
        .unwrap();
    dev.flush().await.unwrap();
    let want = image(&dev).await;
    drop(dev);
    let dev = FileOptions::new().open(&path).unwrap();
    assert_eq!(dev.geometry().size(), 1 << 20);
    assert!(image(&dev).await == want);
    assert_eq!(
        dev.read(8192, 16384).await.unwrap(),
        pattern(2, 8192, 16384)
    );
    // And the bytes are really in the file, at the right place.
    let raw = std::fs::read(&path).unwrap();
    assert!(raw == want);
}

#[tokio::test]
async fn file_device_fua_write() {
    let dir = tempdir();
    let path = dir.path().join("disk.img");
    let dev = FileOptions::new().create(1 << 20).open(&path).unwrap();
    let data = pattern(3, 4096, 8192);
    dev.write(4096, Bytes::from(data.clone()), IoFlags::FUA)
        .await
        .unwrap();
    assert_eq!(dev.read(4096, 8192).await.unwrap(), data);
    dev.write_zeroes(4096, 512, IoFlags::FUA).await.unwrap();
    drop(dev);
    let dev = FileDevice::open(&path).unwrap();
    let got = dev.read(4096, 8192).await.unwrap();
    assert_eq!(&got[..512], &[0; 512][..]);
    assert_eq!(&got[512..], &data[512..]);
}

/// `try_write_now` carries out a buffered write on the spot (the file holds it at once),
/// refuses bad input as `write` does without touching the file, and leaves FUA and
/// O_DIRECT writes, which wait for the disk, to `write`: returning `None` and writing
/// nothing.
#[tokio::test]
async fn file_device_writes_now_only_what_the_page_cache_takes() {
    let dir = tempdir();
    let path = dir.path().join("disk.img");
    // (Larger than the largest request, for the bad-input cases; sparse.)
    let dev = FileOptions::new().create(64 << 20).open(&path).unwrap();
    let data = Bytes::from(pattern(5, 8192, 4096));
    dev.try_write_now(8192, &data, IoFlags::empty())
        .expect("a buffered write is carried out at once")
        .unwrap();
    assert!(std::fs::read(&path).unwrap()[8192..12288] == data[..]);
    let before = std::fs::read(&path).unwrap();
    let g = dev.geometry();
    // (A write of u64::MAX bytes cannot be built, as in `check_validation`.)
    let buildable = bad_inputs(g, true)
        .into_iter()
        .filter(|c| c.2 <= u64::from(g.max_io()) * 2);
    for (what, offset, len, kind) in buildable {
        let bad = Bytes::from(vec![9u8; len as usize]);
        let err = dev
            .try_write_now(offset, &bad, IoFlags::empty())
            .unwrap_or_else(|| panic!("{what}: refused at once"))
            .unwrap_err();
        assert_eq!(err.kind(), kind, "{what}");
    }
    let other = Bytes::from(pattern(6, 0, 4096));
    assert!(dev.try_write_now(0, &other, IoFlags::FUA).is_none());
    assert!(
        std::fs::read(&path).unwrap() == before,
        "nothing else written"
    );
    drop(dev);
    let direct = FileOptions::new().block_size(4096).direct(true).open(&path);
    if let Ok(direct) = direct {
        // (A file system without O_DIRECT, tmpfs say, cannot open it: nothing to check.)
        assert!(direct.try_write_now(0, &other, IoFlags::empty()).is_none());
        assert!(std::fs::read(&path).unwrap() == before, "nothing written");
    }
}

#[tokio::test]
async fn file_device_create_with_other_size_fails_and_changes_nothing() {
    let dir = tempdir();
    let path = dir.path().join("disk.img");
    let dev = FileOptions::new().create(1 << 20).open(&path).unwrap();
    fill(&dev, 4).await;
    dev.flush().await.unwrap();
    drop(dev);
    let before = std::fs::read(&path).unwrap();
    for size in [2 << 20, 512 << 10, (1 << 20) + 512] {
        let err = FileOptions::new().create(size).open(&path).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "size {size}: {err}");
    }
    assert!(std::fs::read(&path).unwrap() == before);
    // The same size opens fine.
    let dev = FileOptions::new().create(1 << 20).open(&path).unwrap();
    assert!(image(&dev).await == before);
}

#[tokio::test]
async fn file_device_rejects_bad_shapes() {
    let dir = tempdir();
    let err = FileOptions::new()
        .create(1000)
        .open(dir.path().join("odd.img"))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    let err = FileOptions::new()
        .block_size(1000)
        .create(1 << 20)
        .open(dir.path().join("bs.img"))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    let err = FileDevice::open(dir.path().join("missing.img")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    // An existing file whose size is not a multiple of the block size.
    let path = dir.path().join("short.img");
    std::fs::write(&path, vec![1u8; 1000]).unwrap();
    let err = FileDevice::open(&path).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert_eq!(std::fs::read(&path).unwrap(), vec![1u8; 1000]);
}

#[tokio::test]
async fn file_device_discard_and_write_zeroes_read_back_as_zeros() {
    let dir = tempdir();
    let path = dir.path().join("disk.img");
    let dev = FileOptions::new().create(1 << 20).open(&path).unwrap();
    fill(&dev, 5).await;
    let mut want = image(&dev).await;
    // Block-sized, page-sized and large, unaligned to pages, ranges.
    for (off, len) in [(512, 512), (8192, 4096), (65536 + 1536, 200 * 1024)] {
        dev.discard(off, len, IoFlags::empty()).await.unwrap();
        want[off as usize..(off + len) as usize].fill(0);
    }
    for (off, len, flags) in [
        (3 * 512, 512, IoFlags::empty()),
        (16384, 8192, IoFlags::FUA),
        (512 * 1024 + 512, 300 * 1024, IoFlags::empty()),
    ] {
        dev.write_zeroes(off, len, flags).await.unwrap();
        want[off as usize..(off + len) as usize].fill(0);
    }
    assert!(image(&dev).await == want);
    dev.flush().await.unwrap();
    drop(dev);
    let dev = FileDevice::open(&path).unwrap();
    assert!(image(&dev).await == want);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
}

fn open_direct(path: &Path, size: u64) -> Option<FileDevice> {
    match FileOptions::new()
        .direct(true)
        .block_size(4096)
        .create(size)
        .open(path)
    {
        Ok(dev) => Some(dev),
        Err(e) if e.kind() == ErrorKind::InvalidArgument => {
            println!("note: O_DIRECT is not supported here ({e}); skipping");
            None
        }
        Err(e) => panic!("open with O_DIRECT: {e}"),
    }
}

#[tokio::test]
async fn file_device_direct_io_round_trip() {
    let dir = tempdir();
    let path = dir.path().join("direct.img");
    let Some(dev) = open_direct(&path, 4 << 20) else {
        return;
    };
    let cases = [
        (0u64, 4096usize),
        (8192, 12288),
        (1 << 20, 1 << 20),
        ((4 << 20) - 4096, 4096),
    ];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let flags = if i % 2 == 0 {
            IoFlags::empty()
        } else {
            IoFlags::FUA
        };
        dev.write(off, Bytes::from(pattern(i as u8, off, len)), flags)
            .await
            .unwrap();
    }
    for (i, &(off, len)) in cases.iter().enumerate() {
        assert_eq!(
            dev.read(off, len).await.unwrap(),
            pattern(i as u8, off, len)
        );
    }
    dev.write_zeroes(8192, 4096, IoFlags::empty())
        .await
        .unwrap();
    dev.discard(1 << 20, 8192, IoFlags::empty()).await.unwrap();
    dev.flush().await.unwrap();
    assert_eq!(dev.read(8192, 4096).await.unwrap(), vec![0u8; 4096]);
    assert_eq!(dev.read(1 << 20, 8192).await.unwrap(), vec![0u8; 8192]);
    drop(dev);
    // The data is on disk: a buffered open sees the same bytes.
    let dev = FileOptions::new().block_size(4096).open(&path).unwrap();
    assert_eq!(
        dev.read(12288, 8192).await.unwrap(),
        pattern(1, 8192, 12288)[4096..]
    );
    assert_eq!(
        dev.read((1 << 20) + 8192, 8192).await.unwrap(),
        pattern(2, 1 << 20, 1 << 20)[8192..16384]
    );
    // Validation holds with O_DIRECT too.
    drop(dev);
    let dev = open_direct(&path, 4 << 20).unwrap();
    let err = dev.read(512, 4096).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
}

// --- FaultyDevice -------------------------------------------------------------------

const FSIZE: u64 = 256 * BS;

/// A FaultyDevice over a MemDevice filled with pattern 0 and flushed: a known durable state.
async fn faulty() -> (FaultyDevice<MemDevice>, Vec<u8>) {
    let g = Geometry::with_max_io(FSIZE, BS as u32, 64 << 10).unwrap();
    let dev = FaultyDevice::new(MemDevice::new(g));
    fill(&dev, 0).await;
    dev.flush().await.unwrap();
    let base = image(&dev).await;
    (dev, base)
}

fn put(image: &mut [u8], off: u64, data: &[u8]) {
    image[off as usize..off as usize + data.len()].copy_from_slice(data);
}

#[tokio::test]
async fn faulty_power_cut_drops_exactly_the_unflushed_writes() {
    let (dev, mut want) = faulty().await;
    let a = pattern(0xa0, 0, 4 * BS as usize);
    let b = pattern(0xb0, 0, 3 * BS as usize);
    dev.write(10 * BS, Bytes::from(a.clone()), IoFlags::empty())
        .await
        .unwrap();
    dev.flush().await.unwrap();
    put(&mut want, 10 * BS, &a);
    dev.write(100 * BS, Bytes::from(b.clone()), IoFlags::empty())
        .await
        .unwrap();
    // B overlapping A's flushed data, then discards and zeroes: all unflushed.
    dev.write(12 * BS, Bytes::from(b.clone()), IoFlags::empty())
        .await
        .unwrap();
    dev.discard(200 * BS, 8 * BS, IoFlags::empty())
        .await
        .unwrap();
    dev.write_zeroes(0, BS, IoFlags::empty()).await.unwrap();
    assert_eq!(dev.pending_writes(), 4);
    // Before the cut every write is visible.
    let mut volatile = want.clone();
    put(&mut volatile, 100 * BS, &b);
    put(&mut volatile, 12 * BS, &b);
    volatile[200 * BS as usize..208 * BS as usize].fill(0);
    volatile[..BS as usize].fill(0);
    assert!(image(&dev).await == volatile);

    dev.power_cut(PowerCut::DropUnflushed).await.unwrap();
    assert_eq!(dev.pending_writes(), 0);
    assert!(
        image(&dev).await == want,
        "device after the cut is not the flushed image"
    );
    assert!(image(dev.inner()).await == want);
    // The device carries on from the crashed state.
    dev.write(100 * BS, Bytes::from(b.clone()), IoFlags::empty())
        .await
        .unwrap();
    dev.flush().await.unwrap();
    dev.power_cut(PowerCut::DropUnflushed).await.unwrap();
    put(&mut want, 100 * BS, &b);
    assert!(image(&dev).await == want);
}

#[tokio::test]
async fn faulty_fua_writes_survive_and_win_over_older_writes() {
    for cut in [
        PowerCut::DropUnflushed,
        PowerCut::KeepUnflushed,
        PowerCut::Tear { seed: 1 },
        PowerCut::Tear { seed: 99 },
    ] {
        let (dev, base) = faulty().await;
        let old = pattern(1, 0, 8 * BS as usize);
        let fua = pattern(2, 0, 2 * BS as usize);
        let newer = pattern(3, 0, BS as usize);
        // Unflushed 8 blocks at 20..28, FUA over 22..24, then an unflushed write at 23.
        dev.write(20 * BS, Bytes::from(old.clone()), IoFlags::empty())
            .await
            .unwrap();
        dev.write(22 * BS, Bytes::from(fua.clone()), IoFlags::FUA)
            .await
            .unwrap();
        dev.write(23 * BS, Bytes::from(newer.clone()), IoFlags::empty())
            .await
            .unwrap();
        // A FUA write_zeroes on its own.
        dev.write_zeroes(50 * BS, 2 * BS, IoFlags::FUA)
            .await
            .unwrap();
        assert_eq!(dev.pending_writes(), 2);
        dev.power_cut(cut).await.unwrap();
        let img = image(&dev).await;
        let blk = |b: u64| &img[(b * BS) as usize..((b + 1) * BS) as usize];
        let base_blk = |b: u64| &base[(b * BS) as usize..((b + 1) * BS) as usize];
        assert_eq!(
            blk(22),
            &fua[..BS as usize],
            "{cut:?}: FUA block lost or overwritten"
        );
        let b23 = blk(23);
        assert!(
            b23 == &fua[BS as usize..] || b23 == &newer[..],
            "{cut:?}: block 23"
        );
        for b in (20..22).chain(24..28) {
            let o = &old[((b - 20) * BS) as usize..((b - 19) * BS) as usize];
            match cut {
                PowerCut::DropUnflushed => assert_eq!(blk(b), base_blk(b), "{cut:?} {b}"),
                PowerCut::KeepUnflushed => assert_eq!(blk(b), o, "{cut:?} {b}"),
                PowerCut::Tear { .. } => assert!(blk(b) == base_blk(b) || blk(b) == o),
            }
        }
        match cut {
            PowerCut::DropUnflushed => assert_eq!(b23, &fua[BS as usize..]),
            PowerCut::KeepUnflushed => assert_eq!(b23, &newer[..]),
            PowerCut::Tear { .. } => {}
        }
        assert_eq!(blk(50), &[0; BS as usize][..]);
        assert_eq!(blk(51), &[0; BS as usize][..]);
        // Everything else is untouched.
        for b in (0..20).chain(28..50).chain(52..FSIZE / BS) {
            assert_eq!(blk(b), base_blk(b), "{cut:?}: block {b} changed");
        }
    }
}

/// A fresh [`faulty`] device after two unflushed writes of 32 blocks (blocks 64 to 127)
/// and a power cut that tears them with `seed`: (device, image before, data written).
async fn torn_writes(seed: u64) -> (FaultyDevice<MemDevice>, Vec<u8>, Vec<u8>) {
    let (dev, base) = faulty().await;
    let new = pattern(0x77, 0, 64 * BS as usize);
    dev.write(
        64 * BS,
        Bytes::from(new[..32 * BS as usize].to_vec()),
        IoFlags::empty(),
    )
    .await
    .unwrap();
    dev.write(
        96 * BS,
        Bytes::from(new[32 * BS as usize..].to_vec()),
        IoFlags::empty(),
    )
    .await
    .unwrap();
    dev.power_cut(PowerCut::Tear { seed }).await.unwrap();
    (dev, base, new)
}

#[tokio::test]
async fn faulty_tear_keeps_whole_blocks_of_old_or_new_data() {
    let mut saw_mixed = false;
    let mut first = None;
    for seed in 0..16 {
        let (dev, base, new) = torn_writes(seed).await;
        let img = image(&dev).await;
        let (mut olds, mut news) = (0, 0);
        for b in 0..FSIZE / BS {
            let r = (b * BS) as usize..((b + 1) * BS) as usize;
            if (64..128).contains(&b) {
                let n = &new[((b - 64) * BS) as usize..((b - 63) * BS) as usize];
                if img[r.clone()] == base[r.clone()] {
                    olds += 1;
                } else if &img[r] == n {
                    news += 1;
                } else {
                    panic!("seed {seed}: block {b} is neither old nor new data");
                }
            } else {
                assert!(img[r.clone()] == base[r], "seed {seed}: block {b} changed");
            }
        }
        saw_mixed |= olds > 0 && news > 0;
        if seed == 3 {
            first = Some(img);
        }
    }
    assert!(saw_mixed, "no seed tore the writes");
    // The same seed gives the same crash.
    let (dev, _, _) = torn_writes(3).await;
    assert!(Some(image(&dev).await) == first);
}

#[tokio::test]
async fn faulty_keep_unflushed_keeps_everything() {
    let (dev, _) = faulty().await;
    let data = pattern(9, 0, 16 * BS as usize);
    dev.write(0, Bytes::from(data.clone()), IoFlags::empty())
        .await
        .unwrap();
    dev.discard(4 * BS, 2 * BS, IoFlags::empty()).await.unwrap();
    let want = image(&dev).await;
    dev.power_cut(PowerCut::KeepUnflushed).await.unwrap();
    assert_eq!(dev.pending_writes(), 0);
    assert!(image(&dev).await == want);
    assert!(image(dev.inner()).await == want);
}

#[tokio::test]
async fn faulty_flush_makes_writes_durable_in_the_inner_device() {
    let (dev, base) = faulty().await;
    let data = pattern(4, 0, 2 * BS as usize);
    dev.write(BS, Bytes::from(data.clone()), IoFlags::empty())
        .await
        .unwrap();
    assert!(
        image(dev.inner()).await == base,
        "an unflushed write reached the inner device"
    );
    dev.flush().await.unwrap();
    assert_eq!(dev.pending_writes(), 0);
    assert_eq!(dev.inner().read(BS, 2 * BS as usize).await.unwrap(), data);
}

#[tokio::test]
async fn faulty_injected_errors_have_the_configured_kind_and_change_nothing() {
    let (dev, base) = faulty().await;
    let data = Bytes::from(pattern(6, 0, 4 * BS as usize));
    for kind in [ErrorKind::Io, ErrorKind::NoSpace, ErrorKind::Timeout] {
        dev.set_faults(FaultConfig::new().kind(kind));
        for flags in [IoFlags::empty(), IoFlags::FUA] {
            let err = dev.write(8 * BS, data.clone(), flags).await.unwrap_err();
            assert_eq!(err.kind(), kind);
            let err = dev.write_zeroes(8 * BS, 8 * BS, flags).await.unwrap_err();
            assert_eq!(err.kind(), kind);
        }
        assert_eq!(
            dev.discard(0, FSIZE, IoFlags::empty())
                .await
                .unwrap_err()
                .kind(),
            kind
        );
        assert_eq!(dev.read(0, BS as usize).await.unwrap_err().kind(), kind);
        assert_eq!(dev.flush().await.unwrap_err().kind(), kind);
    }
    dev.clear_faults();
    assert_eq!(dev.pending_writes(), 0);
    assert!(image(&dev).await == base);
    assert!(image(dev.inner()).await == base);

    // Only writes overlapping blocks 8..12 fail; reads there and writes elsewhere work.
    dev.set_faults(
        FaultConfig::new()
            .ops(&[OpKind::Write, OpKind::WriteZeroes])
            .range(8 * BS..12 * BS),
    );
    assert!(
        dev.write(7 * BS, data.clone(), IoFlags::empty())
            .await
            .is_err()
    );
    assert!(
        dev.write(12 * BS, data.clone(), IoFlags::empty())
            .await
            .is_ok()
    );
    assert!(dev.write(0, data.clone(), IoFlags::empty()).await.is_ok());
    assert!(dev.read(8 * BS, BS as usize).await.is_ok());
    assert!(dev.discard(8 * BS, BS, IoFlags::empty()).await.is_ok());

    // `after`: two writes pass, the third fails, and a write that failed left no trace
    // even after a flush and a power cut that keeps everything.
    let (dev, mut want) = faulty().await;
    dev.set_faults(FaultConfig::new().ops(&[OpKind::Write]).after(2));
    for i in 0..2u64 {
        let d = pattern(i as u8 + 1, 0, BS as usize);
        dev.write(i * BS, Bytes::from(d.clone()), IoFlags::empty())
            .await
            .unwrap();
        put(&mut want, i * BS, &d);
    }
    let err = dev
        .write(2 * BS, data.clone(), IoFlags::FUA)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io);
    dev.clear_faults();
    dev.flush().await.unwrap();
    dev.power_cut(PowerCut::KeepUnflushed).await.unwrap();
    assert!(image(&dev).await == want);
}

#[tokio::test]
async fn faulty_failed_flush_keeps_writes_pending_and_losable() {
    let (dev, base) = faulty().await;
    dev.write(0, Bytes::from(pattern(8, 0, BS as usize)), IoFlags::empty())
        .await
        .unwrap();
    dev.set_faults(FaultConfig::new().ops(&[OpKind::Flush]).limit(1));
    assert_eq!(dev.flush().await.unwrap_err().kind(), ErrorKind::Io);
    assert_eq!(dev.pending_writes(), 1);
    dev.power_cut(PowerCut::DropUnflushed).await.unwrap();
    assert!(image(&dev).await == base);
}

#[tokio::test(start_paused = true)]
async fn faulty_latency_is_applied() {
    use tokio::time::Instant;
    let (dev, _) = faulty().await;
    let data = Bytes::from(vec![1; BS as usize]);
    let t = Instant::now();
    dev.write(0, data.clone(), IoFlags::empty()).await.unwrap();
    assert_eq!(t.elapsed(), Duration::ZERO);

    dev.set_latency(Duration::from_millis(250));
    let t = Instant::now();
    dev.write(0, data.clone(), IoFlags::empty()).await.unwrap();
    dev.read(0, BS as usize).await.unwrap();
    dev.flush().await.unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(750),
        "{:?}",
        t.elapsed()
    );

    // A write does not take effect before its latency has passed.
    let t = Instant::now();
    let (written, pending_meanwhile) = tokio::join!(
        dev.write(BS, Bytes::from(vec![2; BS as usize]), IoFlags::empty()),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            dev.pending_writes()
        }
    );
    written.unwrap();
    assert_eq!(
        pending_meanwhile, 0,
        "the write took effect before its latency"
    );
    assert_eq!(dev.pending_writes(), 1);
    assert!(t.elapsed() >= Duration::from_millis(250));
    dev.set_latency(Duration::ZERO);
    let t = Instant::now();
    assert_eq!(dev.read(BS, BS as usize).await.unwrap()[0], 2);
    assert_eq!(t.elapsed(), Duration::ZERO);
}

/// `read_once` (a resync's read) returns exactly what `read` does: holes, data just
/// written and still only in the page cache, data written and synced, ranges mixing
/// them; and it leaves nothing of a sparse file's holes in the page cache.
#[tokio::test]
async fn file_device_read_once_matches_read() {
    let dir = tempdir();
    let path = dir.path().join("sparse.img");
    const SIZE: u64 = 16 << 20;
    let dev = FileOptions::new().create(SIZE).open(&path).unwrap();
    // Synced data in the first MiB, unsynced data at 5 MiB + 4 KiB, holes elsewhere.
    dev.write(0, Bytes::from(pattern(7, 0, 1 << 20)), IoFlags::empty())
        .await
        .unwrap();
    dev.flush().await.unwrap();
    let at = (5 << 20) + 4096;
    dev.write(at, Bytes::from(pattern(9, at, 8192)), IoFlags::empty())
        .await
        .unwrap();
    for (offset, len) in [
        (0u64, 65536usize),
        (1 << 20, 65536),
        (5 << 20, 65536),
        (at, 4096),
        ((1 << 20) - 4096, 8192),
        (8 << 20, 1 << 20),
        (SIZE - 65536, 65536),
    ] {
        // read_once first: nothing of the range is cached by a read before it.
        let got = dev.read_once(offset, len).await.unwrap();
        let want = dev.read(offset, len).await.unwrap();
        assert!(
            got == want,
            "read_once at {offset} ({len} bytes) differs from read"
        );
    }
    // Beyond the end or misaligned: the same refusals as read.
    assert!(dev.read_once(SIZE, 512).await.is_err());
    assert!(dev.read_once(100, 512).await.is_err());
}
