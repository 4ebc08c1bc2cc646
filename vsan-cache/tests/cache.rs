//! WriteBackCache over in-memory and faulty devices: the basics.

use std::sync::Arc;

use bytes::Bytes;
use vsan_cache::{CacheConfig, CacheMode, CacheState, DataLoss, FastDevice, WriteBackCache};
use vsan_core::{
    BlockDevice, ErrorKind, FaultConfig, FaultyDevice, Geometry, IoFlags, MemDevice, OpKind,
    PowerCut,
};

mod common;

use common::{cache_over, mem, quiet};

const BS: usize = 4096;

fn block(v: u8) -> Bytes {
    Bytes::from(vec![v; BS])
}

async fn fresh(
    fast_len: u64,
    backing_len: u64,
    cfg: CacheConfig,
) -> (Arc<MemDevice>, Arc<MemDevice>, WriteBackCache) {
    let backing = mem(backing_len);
    let (fast, c) = cache_over(fast_len, &backing, cfg).await;
    (fast, backing, c)
}

#[tokio::test]
async fn writes_hit_the_log_and_reach_the_backing_store_on_destage() {
    let (_fast, backing, c) = fresh(1 << 20, 4 << 20, quiet()).await;
    assert_eq!(c.geometry().block_size(), 4096);
    c.write(8192, block(7), IoFlags::empty()).await.unwrap();
    c.write(
        0,
        Bytes::from([vec![1u8; BS], vec![2u8; BS]].concat()),
        IoFlags::empty(),
    )
    .await
    .unwrap();
    // Mixed range: two hits, a hit, a miss.
    let r = c.read(0, 4 * BS).await.unwrap();
    assert_eq!(&r[..BS], &[1; BS][..]);
    assert_eq!(&r[BS..2 * BS], &[2; BS][..]);
    assert_eq!(&r[2 * BS..3 * BS], &[7; BS][..]);
    assert_eq!(&r[3 * BS..], &[0; BS][..]);
    // Nothing reached the backing store yet.
    assert_eq!(backing.read(0, BS).await.unwrap(), &[0; BS][..]);
    let s = c.stats();
    assert_eq!((s.read_hits, s.read_misses, s.dirty_blocks), (3, 1, 3));
    c.drain().await.unwrap();
    assert_eq!(backing.read(0, 3 * BS).await.unwrap(), r.slice(..3 * BS));
    assert_eq!(c.stats().dirty_blocks, 0);
    assert_eq!(c.read(0, 4 * BS).await.unwrap(), r);
}

#[tokio::test]
async fn reopen_after_crash_replays_and_after_close_scans_nothing() {
    let fast = Arc::new(FaultyDevice::new(MemDevice::new(
        Geometry::new(1 << 20, 512).unwrap(),
    )));
    let backing = mem(4 << 20);
    WriteBackCache::format(
        &FastDevice::block(fast.clone()),
        backing.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .unwrap();
    let c = WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), quiet())
        .await
        .unwrap();
    for i in 0..40u64 {
        c.write((i % 13) * BS as u64, block(i as u8), IoFlags::empty())
            .await
            .unwrap();
    }
    drop(c);
    fast.power_cut(PowerCut::DropUnflushed).await.unwrap();
    let c = WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), quiet())
        .await
        .unwrap();
    assert!(!c.recovery().clean);
    assert!(c.recovery().records >= 40, "{:?}", c.recovery());
    for b in 0..13u64 {
        let last = (0..40u64).filter(|i| i % 13 == b).max().unwrap();
        assert_eq!(
            c.read(b * BS as u64, BS).await.unwrap(),
            block(last as u8),
            "block {b}"
        );
    }
    c.close().await.unwrap();
    assert_eq!(c.read(0, BS).await.unwrap_err().kind(), ErrorKind::Closed);
    let c = WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), quiet())
        .await
        .unwrap();
    assert!(c.recovery().clean);
    assert_eq!(c.read(12 * BS as u64, BS).await.unwrap(), block(38));
}

#[tokio::test]
async fn a_full_log_wraps_and_destages_inline() {
    // 64 KiB log: 15 one-block records fit.
    let (_fast, backing, c) = fresh(64 * 1024 + 8192, 1 << 20, quiet()).await;
    for i in 0..300u64 {
        c.write((i % 50) * BS as u64, block(i as u8), IoFlags::empty())
            .await
            .unwrap();
    }
    for b in 0..50u64 {
        let last = (0..300u64).filter(|i| i % 50 == b).max().unwrap();
        assert_eq!(c.read(b * BS as u64, BS).await.unwrap(), block(last as u8));
    }
    assert!(c.stats().destage_epochs > 0);
    c.drain().await.unwrap();
    for b in 0..50u64 {
        let last = (0..300u64).filter(|i| i % 50 == b).max().unwrap();
        assert_eq!(
            backing.read(b * BS as u64, BS).await.unwrap(),
            block(last as u8)
        );
    }
}

#[tokio::test]
async fn open_refuses_another_backing_store_and_garbage() {
    let (fast, _backing, c) = fresh(1 << 20, 4 << 20, quiet()).await;
    drop(c);
    let other = mem(8 << 20);
    let e = WriteBackCache::open(FastDevice::block(fast.clone()), other, quiet())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.to_string()
            .contains("formatted for a backing store of 4194304"),
        "{e}"
    );
    // Same size, another block size.
    let other = Arc::new(MemDevice::new(Geometry::new(4 << 20, 4096).unwrap()));
    let e = WriteBackCache::open(FastDevice::block(fast.clone()), other, quiet())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.to_string()
            .contains("in 512-byte blocks; this one has 4194304 bytes in 4096-byte"),
        "{e}"
    );
    let blank = mem(1 << 20);
    let e = WriteBackCache::open(FastDevice::block(blank), mem(4 << 20), quiet())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    // Backing stores the cache cannot serve in 4 KiB blocks.
    let odd = Arc::new(MemDevice::new(Geometry::new(4096 * 10 + 512, 512).unwrap()));
    let e = WriteBackCache::format(
        &FastDevice::block(mem(1 << 20)),
        odd.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[tokio::test]
async fn zeroes_and_discards_are_cached_and_destaged() {
    let (_fast, backing, c) = fresh(1 << 20, 1 << 20, quiet()).await;
    backing
        .write(0, Bytes::from(vec![9u8; 8 * BS]), IoFlags::empty())
        .await
        .unwrap();
    c.write_zeroes(BS as u64, 2 * BS as u64, IoFlags::empty())
        .await
        .unwrap();
    c.discard(4 * BS as u64, BS as u64, IoFlags::empty())
        .await
        .unwrap();
    let r = c.read(0, 8 * BS).await.unwrap();
    let mut want = vec![9u8; 8 * BS];
    want[BS..3 * BS].fill(0);
    want[4 * BS..5 * BS].fill(0);
    assert_eq!(&r[..], &want[..]);
    c.drain().await.unwrap();
    assert_eq!(&backing.read(0, 8 * BS).await.unwrap()[..], &want[..]);
}

#[tokio::test]
async fn cache_device_failure_goes_pass_through_and_reports_the_loss() {
    for policy in [DataLoss::FailReads, DataLoss::ServeBacking] {
        let fast = Arc::new(FaultyDevice::new(MemDevice::new(
            Geometry::new(1 << 20, 512).unwrap(),
        )));
        let backing = mem(1 << 20);
        WriteBackCache::format(
            &FastDevice::block(fast.clone()),
            backing.as_ref(),
            CacheMode::WriteBack,
        )
        .await
        .unwrap();
        let cfg = CacheConfig {
            data_loss: policy,
            ..quiet()
        };
        let c = WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), cfg)
            .await
            .unwrap();
        c.write(0, block(1), IoFlags::empty()).await.unwrap();
        c.write(BS as u64, block(2), IoFlags::empty())
            .await
            .unwrap();
        fast.set_faults(FaultConfig::new().ops(&[OpKind::Write, OpKind::Flush, OpKind::Read]));
        // The write that meets the failure still succeeds, on the backing store.
        c.write(2 * BS as u64, block(3), IoFlags::empty())
            .await
            .unwrap();
        assert_eq!(c.state(), CacheState::Failed { lost_blocks: 2 });
        assert_eq!(c.data_loss_count(), 1);
        assert_eq!(c.mode(), CacheMode::PassThrough);
        assert_eq!(c.read(2 * BS as u64, BS).await.unwrap(), block(3));
        match policy {
            DataLoss::FailReads => {
                assert_eq!(c.read(0, BS).await.unwrap_err().kind(), ErrorKind::Io);
                // Written again: readable again.
                c.write(0, block(4), IoFlags::empty()).await.unwrap();
                assert_eq!(c.read(0, BS).await.unwrap(), block(4));
                assert!(c.read(BS as u64, BS).await.is_err());
            }
            DataLoss::ServeBacking => {
                assert_eq!(
                    c.read(0, 2 * BS).await.unwrap(),
                    Bytes::from(vec![0u8; 2 * BS])
                );
            }
        }
        c.flush().await.unwrap();
    }
}

#[tokio::test]
async fn a_mapped_file_works_like_a_block_device() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cache");
    let backing = mem(4 << 20);
    let fast = FastDevice::map_file(&path, Some(1 << 20)).unwrap();
    assert!(fast.is_mapped());
    WriteBackCache::format(&fast, backing.as_ref(), CacheMode::WriteBack)
        .await
        .unwrap();
    let c = WriteBackCache::open(fast, backing.clone(), quiet())
        .await
        .unwrap();
    for i in 0..600u64 {
        c.write((i % 97) * BS as u64, block(i as u8), IoFlags::empty())
            .await
            .unwrap();
    }
    drop(c);
    // Reopen without a clean close: everything since the last destage is replayed.
    let c = WriteBackCache::open(
        FastDevice::map_file(&path, None).unwrap(),
        backing.clone(),
        quiet(),
    )
    .await
    .unwrap();
    assert!(!c.recovery().clean);
    for b in 0..97u64 {
        let last = (0..600u64).filter(|i| i % 97 == b).max().unwrap();
        assert_eq!(
            c.read(b * BS as u64, BS).await.unwrap(),
            block(last as u8),
            "block {b}"
        );
    }
}

/// Many writers and readers at once on a mapped log that wraps while the background
/// destager runs: every read sees a whole block of one write, each writer's own blocks
/// read back as written, and concurrent writers shared persists (group commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_share_commits_and_reads_stay_whole() {
    let dir = tempfile::tempdir().unwrap();
    let backing = mem(16 << 20);
    let fast = FastDevice::map_file(&dir.path().join("c"), Some(512 << 10)).unwrap();
    WriteBackCache::format(&fast, backing.as_ref(), CacheMode::WriteBack)
        .await
        .unwrap();
    let cfg = CacheConfig {
        sequential_cutoff: 0,
        epoch_bytes: 64 << 10,
        ..CacheConfig::default()
    };
    let c = Arc::new(
        WriteBackCache::open(fast, backing.clone(), cfg)
            .await
            .unwrap(),
    );
    let mut tasks = Vec::new();
    for t in 0..16u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            // Each task owns blocks t, t+16, t+32, ... and also reads everybody's.
            let mut mine = std::collections::HashMap::new();
            for i in 0..400u64 {
                let b = t + 16 * (i % 64);
                let v = (i % 250) as u8 + 1;
                let mut d = vec![v; BS];
                d[..8].copy_from_slice(&b.to_le_bytes());
                c.write(b * BS as u64, Bytes::from(d), IoFlags::empty())
                    .await
                    .unwrap();
                mine.insert(b, v);
                let other = (i * 31 + t) % 1024;
                let r = c.read(other * BS as u64, BS).await.unwrap();
                if r[8..] != [0u8; BS - 8][..] {
                    assert_eq!(
                        &r[..8],
                        &other.to_le_bytes(),
                        "block {other} holds another block's data"
                    );
                    assert!(
                        r[8..].iter().all(|&x| x == r[8]),
                        "block {other} is not whole"
                    );
                }
            }
            for (b, v) in mine {
                let r = c.read(b * BS as u64, BS).await.unwrap();
                assert!(r[8..].iter().all(|&x| x == v), "block {b}: wrong data");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let s = c.stats();
    assert_eq!(s.appends, 16 * 400);
    assert!(s.commits < s.appends, "no write shared a commit: {s:?}");
    assert!(s.destage_epochs > 0, "{s:?}");
}
