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

/// The cache's promises (durability, latest data, no resurrection, loss accounting, no
/// spinning) in the corners the basics above do not reach: crash consistency of records
/// beyond the recovered head, cancelled waits and commits, what a cache device failure
/// reports lost, and the log's edges (wraps, a full log, the largest write).
mod corners {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use bytes::Bytes;
    use vsan_cache::{CacheConfig, CacheMode, CacheState, DataLoss, FastDevice, WriteBackCache};
    use vsan_core::{
        BlockDevice, FaultConfig, FaultyDevice, Geometry, IoFlags, IoFuture, MemDevice, OpKind,
        PowerCut,
    };

    const BS: u64 = 4096;
    /// Where the log starts on the cache device (two 4 KiB superblock copies).
    const LOG_START: u64 = 8192;
    /// The smallest log.
    const MIN_LOG: u64 = 64 * 1024;

    fn mem(size: u64) -> Arc<MemDevice> {
        Arc::new(MemDevice::new(Geometry::new(size, 512).unwrap()))
    }

    fn faulty(size: u64, block: u32) -> Arc<FaultyDevice<MemDevice>> {
        Arc::new(FaultyDevice::new(MemDevice::new(
            Geometry::new(size, block).unwrap(),
        )))
    }

    fn fill(v: u8, blocks: u64) -> Bytes {
        Bytes::from(vec![v; (blocks * BS) as usize])
    }

    fn quiet() -> CacheConfig {
        CacheConfig {
            background: false,
            sequential_cutoff: 0,
            ..CacheConfig::default()
        }
    }

    async fn format(fast: Arc<dyn BlockDevice>, backing: &dyn BlockDevice) {
        WriteBackCache::format(&FastDevice::block(fast), backing, CacheMode::WriteBack)
            .await
            .unwrap();
    }

    async fn open(
        fast: Arc<dyn BlockDevice>,
        backing: Arc<dyn BlockDevice>,
        cfg: CacheConfig,
    ) -> WriteBackCache {
        WriteBackCache::open(FastDevice::block(fast), backing, cfg)
            .await
            .unwrap()
    }

    /// CPU time (user + system, in clock ticks) this thread has used so far. A
    /// `#[tokio::test]` runs every task of its runtime, the background destager included, on
    /// the test's own thread.
    fn thread_cpu_ticks() -> u64 {
        let s = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        // Fields after the command name, which is in parentheses.
        let rest = &s[s.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of the whole line: 11 and 12 here.
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }

    // ---------------------------------------------------------------------------------------
    // Crash consistency: records beyond the recovered head
    // ---------------------------------------------------------------------------------------

    /// One attempt of the torn-batch scenario: a write of 8 blocks is split into two 4-block
    /// records R1, R2 committed in one batch; the persist fails (nothing is acknowledged; the
    /// fallback to the backing store fails too), and the power cut tears the log write so that
    /// R1 is damaged and R2 survives whole. Returns the devices, the cache device image and
    /// whether the tear came out that way.
    async fn torn_batch(
        seed: u64,
    ) -> Option<(Arc<FaultyDevice<MemDevice>>, Arc<FaultyDevice<MemDevice>>)> {
        // 4 KiB device blocks, a 64 KiB log: records of at most 4 blocks (16448 bytes).
        let fast = faulty(LOG_START + MIN_LOG, 4096);
        let backing = faulty(1 << 20, 512);
        format(fast.clone(), backing.as_ref()).await;
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        fast.set_faults(FaultConfig::new().ops(&[OpKind::Flush]));
        backing.set_faults(FaultConfig::new().ops(&[OpKind::Write]));
        let mut data = vec![0x11u8; 4 * BS as usize];
        data.extend_from_slice(&[0x22u8; 4 * BS as usize]);
        assert!(
            c.write(0, Bytes::from(data), IoFlags::empty())
                .await
                .is_err(),
            "the write was not acknowledged"
        );
        drop(c);
        fast.clear_faults();
        backing.clear_faults();
        // What the log write meant to put there (the overlay view).
        let r1 = 16448usize;
        let intended = fast.read(LOG_START, 40 * 1024).await.unwrap();
        fast.power_cut(PowerCut::Tear { seed }).await.unwrap();
        let got = fast.inner().read(LOG_START, 40 * 1024).await.unwrap();
        let r1_damaged = got[..r1 - 64] != intended[..r1 - 64];
        let r2_whole =
            got[r1..2 * r1] == intended[r1..2 * r1] && got[r1 - 64..r1] == intended[r1 - 64..r1];
        (r1_damaged && r2_whole).then_some((fast, backing))
    }

    /// Was a bug (found in review): After a crash, recovery stops at the first damaged record, at `head`,
    /// and the cache then numbers its next record with the very sequence number the damaged
    /// one had. Records of the torn batch that lie *behind* the damaged one survive on the
    /// media with seq `head_seq + 1, ...`; as soon as a new record of the same length is
    /// written at `head`, the next recovery accepts the new record and then walks straight on
    /// into the stale, never-acknowledged R2 and replays it — over data that was acknowledged
    /// in between (here a write-around write of the same blocks).
    #[tokio::test]
    async fn recovery_never_resurrects_unacknowledged_records_behind_the_head() {
        let mut found = None;
        for seed in 0..2000 {
            if let Some(x) = torn_batch(seed).await {
                found = Some(x);
                break;
            }
        }
        let (fast, backing) = found.expect("no seed tears R1 and keeps R2");
        // The failed persist failed the cache, which marks its superblock failed, best effort;
        // the mark may not survive the cut either. Take the case where it did not.
        let sb = WriteBackCache::inspect(&FastDevice::block(fast.clone()))
            .await
            .unwrap();
        if sb.failed {
            let sb = vsan_cache::format::Superblock {
                failed: false,
                seq: sb.seq + 1,
                ..sb
            };
            let off = vsan_cache::format::superblock_offset(sb.seq);
            fast.write(off, Bytes::copy_from_slice(&sb.encode()), IoFlags::FUA)
                .await
                .unwrap();
        }
        // First recovery: nothing of the failed write is there.
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        assert_eq!(c.recovery().records, 0, "{:?}", c.recovery());
        assert_eq!(c.read(0, 8 * BS as usize).await.unwrap(), fill(0, 8));
        // Blocks 4..8 written (acknowledged, flushed) around the cache...
        c.set_mode(CacheMode::WriteAround).await.unwrap();
        c.write(4 * BS, fill(0x33, 4), IoFlags::empty())
            .await
            .unwrap();
        c.flush().await.unwrap();
        c.set_mode(CacheMode::WriteBack).await.unwrap();
        // ...then a cached write of 4 blocks: one record of R1's length, at R1's position.
        c.write(0, fill(0x44, 4), IoFlags::empty()).await.unwrap();
        assert_eq!(
            c.read(4 * BS, 4 * BS as usize).await.unwrap(),
            fill(0x33, 4)
        );
        drop(c);
        fast.power_cut(PowerCut::DropUnflushed).await.unwrap();
        backing.power_cut(PowerCut::DropUnflushed).await.unwrap();
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        assert_eq!(c.read(0, 4 * BS as usize).await.unwrap(), fill(0x44, 4));
        assert_eq!(
            c.recovery().records,
            1,
            "recovery replayed records nobody wrote since the last crash: {:?}",
            c.recovery()
        );
        assert_eq!(
            c.read(4 * BS, 4 * BS as usize).await.unwrap(),
            fill(0x33, 4),
            "acknowledged data of blocks 4..8 replaced by a stale record"
        );
    }

    /// Was a bug (found in review): A transient error of the cache device fails the cache: from then on
    /// writes go to the backing store and are acknowledged. Nothing on the cache device says
    /// so, though: after a restart, `open` replays the old log on top of them, silently (the
    /// loss counter starts at 0 again, so a mirror above has no reason to resync).
    #[tokio::test]
    async fn reopen_after_a_cache_failure_does_not_roll_back_writes_made_since() {
        let fast = faulty(1 << 20, 512);
        let backing = mem(1 << 20);
        format(fast.clone(), backing.as_ref()).await;
        let cfg = CacheConfig {
            data_loss: DataLoss::ServeBacking,
            ..quiet()
        };
        let c = open(fast.clone(), backing.clone(), cfg.clone()).await;
        c.write(0, fill(1, 1), IoFlags::empty()).await.unwrap();
        // One read error of the cache device.
        fast.set_faults(FaultConfig::new().ops(&[OpKind::Read]).limit(1));
        let _ = c.read(0, BS as usize).await;
        assert!(matches!(c.state(), CacheState::Failed { .. }));
        fast.clear_faults();
        // Acknowledged and flushed, on the backing store.
        c.write(0, fill(2, 1), IoFlags::empty()).await.unwrap();
        c.flush().await.unwrap();
        assert_eq!(c.read(0, BS as usize).await.unwrap(), fill(2, 1));
        c.close().await.unwrap();
        drop(c);
        // Restart.
        match WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), cfg).await {
            Err(_) => {} // refusing the device is fine
            Ok(c) => {
                let got = c.read(0, BS as usize).await.unwrap();
                assert!(
                    got == fill(2, 1) || c.data_loss_count() > 0,
                    "block 0 rolled back to the data of the failed cache (first byte {}), \
                 and nothing reports it",
                    got[0]
                );
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // Cancellation
    // ---------------------------------------------------------------------------------------

    /// Was a bug (found in review): `drain` (and `drain_overlapping`, `wait_space`) count themselves in
    /// `draining` / `want_space` and count themselves out only when they finish: a caller
    /// that drops the future (a timeout) leaves the counter up for good. The background
    /// destager then thinks destaging is urgent forever: it destages everything at once,
    /// never pacing between the watermarks, and once the log is empty it spins at full CPU
    /// (`destage_epoch` returns `Ok(false)` and the loop goes round again at once).
    #[tokio::test]
    async fn a_cancelled_drain_leaves_the_destager_neither_spinning_nor_urgent() {
        let fast = mem(1 << 20);
        let backing = faulty(1 << 20, 512);
        format(fast.clone(), backing.as_ref()).await;
        let cfg = CacheConfig {
            sequential_cutoff: 0,
            ..CacheConfig::default()
        };
        let c = open(fast.clone(), backing.clone(), cfg).await;
        backing.set_latency(Duration::from_millis(100));
        c.write(0, fill(1, 1), IoFlags::empty()).await.unwrap();
        // A drain given up by its caller while its destage waits for the backing store.
        assert!(
            tokio::time::timeout(Duration::from_millis(20), c.drain())
                .await
                .is_err()
        );
        backing.set_latency(Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Idle, log empty: the destager should sleep.
        let before = thread_cpu_ticks();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let used = thread_cpu_ticks() - before;
        // One block is far below the low watermark: it stays cached.
        c.write(8 * BS, fill(2, 1), IoFlags::empty()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dirty = c.stats().dirty_blocks;
        assert!(
            used < 10,
            "the idle cache used {used} clock ticks of CPU in 0.5 s: the destager spins"
        );
        assert_eq!(
            dirty, 1,
            "a block under the low watermark was destaged at once: the destager is stuck urgent"
        );
    }

    /// Was a bug (found in review): Same leak through `wait_space`: a write that waits for room in a full
    /// log and is given up by its caller leaves `want_space` up.
    #[tokio::test]
    async fn a_cancelled_write_waiting_for_room_leaves_the_destager_idle() {
        let fast = mem(LOG_START + MIN_LOG);
        let backing = faulty(1 << 20, 512);
        format(fast.clone(), backing.as_ref()).await;
        let cfg = CacheConfig {
            sequential_cutoff: 0,
            // Never destage on the watermarks: only a writer waiting for room makes it run.
            high_watermark: 100,
            low_watermark: 99,
            ..CacheConfig::default()
        };
        let c = open(fast.clone(), backing.clone(), cfg).await;
        backing.set_latency(Duration::from_millis(200));
        for b in 0..15 {
            c.write(b * BS, fill(b as u8, 1), IoFlags::empty())
                .await
                .unwrap();
        }
        // The 16th record does not fit: the writer waits for the destager, and gives up.
        assert!(
            tokio::time::timeout(
                Duration::from_millis(50),
                c.write(15 * BS, fill(15, 1), IoFlags::empty())
            )
            .await
            .is_err()
        );
        backing.set_latency(Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = thread_cpu_ticks();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let used = thread_cpu_ticks() - before;
        c.write(20 * BS, fill(20, 1), IoFlags::empty())
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dirty = c.stats().dirty_blocks;
        assert!(
            used < 10,
            "the idle cache used {used} clock ticks of CPU in 0.5 s: the destager spins"
        );
        assert!(
            dirty >= 1,
            "below the high watermark nothing should be destaged"
        );
    }

    /// A block device whose writes, once started, finish even when the caller drops the
    /// future (as `FileDevice` on tokio's blocking pool does). The next write armed with
    /// `slow` takes that long.
    struct Detached {
        inner: Arc<MemDevice>,
        slow_ms: AtomicU64,
    }

    impl BlockDevice for Detached {
        fn geometry(&self) -> Geometry {
            self.inner.geometry()
        }
        fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
            self.inner.read(offset, len)
        }
        fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
            let ms = self.slow_ms.swap(0, Ordering::AcqRel);
            let inner = self.inner.clone();
            let task = tokio::spawn(async move {
                if ms > 0 {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                inner.write(offset, data, flags).await
            });
            Box::pin(async move { task.await.unwrap() })
        }
        fn flush(&self) -> IoFuture<'_, ()> {
            self.inner.flush()
        }
        fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
            self.inner.discard(offset, len, flags)
        }
        fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
            self.inner.write_zeroes(offset, len, flags)
        }
    }

    /// Was a bug (found in review): A writer that is the committer and is cancelled while its log write is
    /// in flight: the `Committer` guard hands the committing over at once, the next committer
    /// places its record at the same (unpublished) head, and the abandoned write — still
    /// running in the device — lands on top of an acknowledged record.
    #[tokio::test]
    async fn a_cancelled_committer_cannot_overwrite_an_acknowledged_record() {
        let fast = Arc::new(Detached {
            inner: mem(1 << 20),
            slow_ms: AtomicU64::new(0),
        });
        let backing = mem(1 << 20);
        format(fast.clone(), backing.as_ref()).await;
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        fast.slow_ms.store(100, Ordering::Release);
        // Cancelled mid-commit: the caller gets no answer, so either outcome for block 0 is
        // fine.
        assert!(
            tokio::time::timeout(
                Duration::from_millis(10),
                c.write(0, fill(0xaa, 1), IoFlags::empty())
            )
            .await
            .is_err()
        );
        // Acknowledged.
        c.write(BS, fill(0xbb, 1), IoFlags::empty()).await.unwrap();
        assert_eq!(c.read(BS, BS as usize).await.unwrap(), fill(0xbb, 1));
        // The abandoned write finishes.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let got = c.read(BS, BS as usize).await.unwrap();
        assert!(
            got == fill(0xbb, 1),
            "acknowledged block 1 now reads {:#x}..",
            got[0]
        );
        // And after a crash.
        drop(c);
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        assert_eq!(c.read(BS, BS as usize).await.unwrap(), fill(0xbb, 1));
    }

    // ---------------------------------------------------------------------------------------
    // Cache device failure: what is reported lost
    // ---------------------------------------------------------------------------------------

    /// Was a bug (found in review): When the superblock write at the end of a destage epoch fails, the
    /// epoch's data is already in the backing store and flushed, but `fail` still counts the
    /// epoch's records (not yet popped) as dirty: it reports data loss, and with
    /// `DataLoss::FailReads` reads of blocks the backing store holds fail.
    #[tokio::test]
    async fn a_failure_after_the_backing_flush_loses_nothing() {
        let fast = faulty(1 << 20, 512);
        let backing = mem(1 << 20);
        format(fast.clone(), backing.as_ref()).await;
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        c.write(0, fill(7, 1), IoFlags::empty()).await.unwrap();
        // Only the superblock copies fail.
        fast.set_faults(FaultConfig::new().ops(&[OpKind::Write]).range(0..LOG_START));
        assert!(c.destage().await.is_err());
        assert_eq!(backing.read(0, BS as usize).await.unwrap(), fill(7, 1));
        let state = c.state();
        let read = c.read(0, BS as usize).await;
        assert_eq!(state, CacheState::Failed { lost_blocks: 0 });
        assert_eq!(c.data_loss_count(), 0, "nothing was lost");
        assert_eq!(read.unwrap(), fill(7, 1));
    }

    /// Was a bug (found in review): Blocks whose newest record is a write-through one are in the backing
    /// store; when the cache device fails while some *other* record is dirty, they are still
    /// counted lost (`lost_blocks = index.len()`) and, with `DataLoss::FailReads`, their reads
    /// fail.
    #[tokio::test]
    async fn a_failure_does_not_count_write_through_blocks_as_lost() {
        let fast = faulty(1 << 20, 512);
        let backing = mem(1 << 20);
        format(fast.clone(), backing.as_ref()).await;
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        c.write(0, fill(1, 1), IoFlags::empty()).await.unwrap(); // dirty
        c.set_mode(CacheMode::WriteThrough).await.unwrap();
        c.write(BS, fill(2, 1), IoFlags::empty()).await.unwrap(); // clean
        assert_eq!(backing.read(BS, BS as usize).await.unwrap(), fill(2, 1));
        fast.set_faults(FaultConfig::new().ops(&[OpKind::Write, OpKind::Flush, OpKind::Read]));
        c.write(2 * BS, fill(3, 1), IoFlags::empty()).await.unwrap();
        let state = c.state();
        let read = c.read(BS, BS as usize).await;
        assert_eq!(c.data_loss_count(), 1);
        assert_eq!(
            state,
            CacheState::Failed { lost_blocks: 1 },
            "only block 0 was lost"
        );
        assert_eq!(read.unwrap(), fill(2, 1), "block 1 is in the backing store");
    }

    /// Regression (passes since 8b8ba97, which writes the backing store before the clean
    /// record): a write-through write whose backing write fails must not leave a `clean`
    /// record in the log — reads would return the new data until destage skipped the record,
    /// and the old data after, the block changing with no write in between.
    #[tokio::test]
    async fn a_failed_write_through_does_not_flip_flop() {
        let fast = mem(1 << 20);
        let backing = faulty(1 << 20, 512);
        format(fast.clone(), backing.as_ref()).await;
        let c = open(
            fast.clone(),
            backing.clone(),
            CacheConfig {
                mode: Some(CacheMode::WriteThrough),
                ..quiet()
            },
        )
        .await;
        c.write(0, fill(1, 1), IoFlags::empty()).await.unwrap();
        backing.set_faults(FaultConfig::new().ops(&[OpKind::Write]).limit(1));
        assert!(c.write(0, fill(2, 1), IoFlags::empty()).await.is_err());
        let before = c.read(0, BS as usize).await.unwrap();
        c.drain().await.unwrap();
        let after = c.read(0, BS as usize).await.unwrap();
        assert_eq!(
            before[0], after[0],
            "block 0 read {} and then, with no write in between, {}",
            before[0], after[0]
        );
    }

    /// Was a bug (found in review): a block cache device with blocks over 4 KiB puts the
    /// superblock copies and the start of the log in one device block, written by
    /// read-modify-write from two writers that do not order against each other (a superblock
    /// write could land with the bytes it read and erase a record committed meanwhile). Such
    /// devices are refused.
    #[tokio::test]
    async fn a_cache_device_with_blocks_over_4k_is_refused() {
        let fast: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(
            Geometry::new(LOG_START + 73728, 16384).unwrap(),
        ));
        let backing = mem(1 << 20);
        let e = WriteBackCache::format(
            &FastDevice::block(fast.clone()),
            backing.as_ref(),
            CacheMode::WriteBack,
        )
        .await
        .unwrap_err();
        assert_eq!(e.kind(), vsan_core::ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("16384-byte blocks"), "{e}");
        let e = WriteBackCache::open(FastDevice::block(fast), backing, quiet())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), vsan_core::ErrorKind::InvalidArgument, "{e}");
    }

    // ---------------------------------------------------------------------------------------
    // Regression tests (pass): log edges
    // ---------------------------------------------------------------------------------------

    /// The superblock's tail lands on a WRAP record (destaged one record at a time up to it),
    /// and recovery starts from there.
    #[tokio::test]
    async fn recovery_starts_at_a_wrap_record() {
        let fast = faulty(LOG_START + MIN_LOG, 512);
        let backing = mem(1 << 20);
        format(fast.clone(), backing.as_ref()).await;
        // One record per epoch.
        let cfg = CacheConfig {
            epoch_bytes: 4096,
            ..quiet()
        };
        let c = open(fast.clone(), backing.clone(), cfg.clone()).await;
        // 15 one-block records (4160 bytes each) fill 62400 bytes; the 16th wraps.
        for b in 0..16u64 {
            c.write(b * BS, fill(b as u8 + 1, 1), IoFlags::empty())
                .await
                .unwrap();
        }
        // The 16th write made room inline: record 0 is destaged already.
        assert_eq!(c.stats().destage_epochs, 1);
        for _ in 0..14 {
            assert!(c.destage().await.unwrap());
        }
        // Tail on the WRAP at 62400, head after the record at 65536.
        assert_eq!(c.stats().dirty_bytes, MIN_LOG + 4160 - 62400);
        drop(c);
        fast.power_cut(PowerCut::DropUnflushed).await.unwrap();
        let c = open(fast.clone(), backing.clone(), cfg).await;
        assert!(!c.recovery().clean);
        assert_eq!(c.recovery().records, 2, "WRAP + record: {:?}", c.recovery());
        for b in 0..16u64 {
            assert_eq!(
                c.read(b * BS, BS as usize).await.unwrap(),
                fill(b as u8 + 1, 1),
                "block {b}"
            );
        }
        // And it keeps appending after the recovered head.
        c.write(0, fill(0x77, 1), IoFlags::empty()).await.unwrap();
        c.drain().await.unwrap();
        assert_eq!(backing.read(0, BS as usize).await.unwrap(), fill(0x77, 1));
        assert_eq!(
            backing.read(15 * BS, BS as usize).await.unwrap(),
            fill(16, 1)
        );
    }

    /// A log filled to exactly `log_len` bytes (data records, then 64-byte ZERO records): the
    /// scan stops on the full circle, and every record is replayed.
    #[tokio::test]
    async fn an_exactly_full_log_recovers_whole() {
        let fast = faulty(LOG_START + MIN_LOG, 512);
        let backing = mem(1 << 20);
        format(fast.clone(), backing.as_ref()).await;
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        for b in 0..15u64 {
            c.write(b * BS, fill(b as u8 + 1, 1), IoFlags::empty())
                .await
                .unwrap();
        }
        // (65536 - 15 * 4160) / 64 = 49 ZERO records.
        for i in 0..49u64 {
            c.write_zeroes((100 + i) * BS, BS, IoFlags::empty())
                .await
                .unwrap();
        }
        assert_eq!(c.stats().dirty_bytes, MIN_LOG);
        assert_eq!(c.stats().destage_epochs, 0);
        drop(c);
        fast.power_cut(PowerCut::DropUnflushed).await.unwrap();
        backing
            .write(100 * BS, fill(9, 49), IoFlags::empty())
            .await
            .unwrap();
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        assert_eq!(c.recovery().records, 15 + 49, "{:?}", c.recovery());
        assert!(
            c.recovery().stopped.contains("FullCircle"),
            "{:?}",
            c.recovery()
        );
        for b in 0..15u64 {
            assert_eq!(
                c.read(b * BS, BS as usize).await.unwrap(),
                fill(b as u8 + 1, 1)
            );
        }
        assert_eq!(
            c.read(100 * BS, 49 * BS as usize).await.unwrap(),
            fill(0, 49)
        );
        // One more write must make room first.
        c.write(200 * BS, fill(0x55, 1), IoFlags::empty())
            .await
            .unwrap();
        c.drain().await.unwrap();
        assert_eq!(
            backing.read(100 * BS, 49 * BS as usize).await.unwrap(),
            fill(0, 49)
        );
        assert_eq!(
            backing.read(200 * BS, BS as usize).await.unwrap(),
            fill(0x55, 1)
        );
    }

    /// The largest write the cache accepts, ending at the device's last block, split into
    /// many records in one batch on a log far smaller than the write (so the committer
    /// destages inline mid-batch), then a crash: the blocks read back right before and after.
    #[tokio::test]
    async fn a_max_size_write_at_the_end_splits_wraps_and_recovers() {
        let fast = faulty(LOG_START + MIN_LOG, 512);
        let size = 4u64 << 20;
        let backing = Arc::new(MemDevice::new(
            Geometry::with_max_io(size, 512, 256 << 10).unwrap(),
        ));
        format(fast.clone(), backing.as_ref()).await;
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        let max = c.geometry().max_io() as u64;
        assert_eq!(max, 256 << 10);
        let n = max / BS;
        let mut data = Vec::with_capacity(max as usize);
        for b in 0..n {
            data.extend(std::iter::repeat_n(b as u8 + 1, BS as usize));
        }
        let data = Bytes::from(data);
        let off = size - max;
        c.write(off, data.clone(), IoFlags::empty()).await.unwrap();
        assert_eq!(c.read(off, max as usize).await.unwrap(), data);
        // Past the end: refused.
        assert!(c.write(size, fill(1, 1), IoFlags::empty()).await.is_err());
        drop(c);
        fast.power_cut(PowerCut::DropUnflushed).await.unwrap();
        let c = open(fast.clone(), backing.clone(), quiet()).await;
        assert_eq!(c.read(off, max as usize).await.unwrap(), data);
        c.close().await.unwrap();
        assert_eq!(backing.read(off, max as usize).await.unwrap(), data);
    }

    /// Readers of a block (not mapped) cache device read log space outside any lock and
    /// check `reserved_head` afterwards; with a small log reused all the time under them,
    /// every read still returns a whole block of one write, and each writer's own last write.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn block_device_reads_never_see_reused_log_space() {
        let fast = faulty(LOG_START + 128 * 1024, 512);
        fast.set_latency(Duration::from_micros(200));
        let backing = mem(4 << 20);
        format(fast.clone(), backing.as_ref()).await;
        let cfg = CacheConfig {
            sequential_cutoff: 0,
            epoch_bytes: 16 << 10,
            ..CacheConfig::default()
        };
        let c = Arc::new(open(fast.clone(), backing.clone(), cfg).await);
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let mut mine = std::collections::HashMap::new();
                for i in 0..150u64 {
                    let b = t + 8 * (i % 32);
                    let v = (i % 250) as u8 + 1;
                    let mut d = vec![v; BS as usize];
                    d[..8].copy_from_slice(&b.to_le_bytes());
                    c.write(b * BS, Bytes::from(d), IoFlags::empty())
                        .await
                        .unwrap();
                    mine.insert(b, v);
                    let other = (i * 31 + t) % 256;
                    let r = c.read(other * BS, BS as usize).await.unwrap();
                    if r[8..] != [0u8; BS as usize - 8][..] {
                        assert_eq!(&r[..8], &other.to_le_bytes(), "block {other}: foreign data");
                        assert!(r[8..].iter().all(|&x| x == r[8]), "block {other} torn");
                    }
                }
                for (b, v) in mine {
                    let r = c.read(b * BS, BS as usize).await.unwrap();
                    assert!(r[8..].iter().all(|&x| x == v), "block {b}: wrong data");
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(c.stats().destage_epochs > 0);
    }
}
