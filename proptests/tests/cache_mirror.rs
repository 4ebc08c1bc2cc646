//! A write-back cache as a mirror's local replica, whose cache device fails mid-run.
//!
//! Two `MirroredDisk`s in one process, linked over TCP on loopback, each over a
//! `WriteBackCache` (fast device in memory, backing store in memory). Clients write and
//! read through both nodes at once; part-way through, node 1's cache device starts failing
//! every operation while it holds dirty data. The acceptance: no client sees an error,
//! every read returns the last acknowledged write, node 1's replica is resynced from node
//! 2 by a checksum resync, and the two replicas end byte-identical.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::{sleep, timeout};
use vsan_cache::{CacheConfig, CacheMode, CacheState, DataLoss, FastDevice, WriteBackCache};
use vsan_core::{BlockDevice, FaultConfig, FaultyDevice, Geometry, IoFlags, MemDevice, OpKind};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{Config, DiskId, LinkState, SyncKind, SyncRole};
use vsan_replica::transport::{TcpTransport, Transport};
use vsan_replica::{MirrorStatus, MirroredDisk, Replica};

const BS: u64 = 4096;
const SIZE: u64 = 16 << 20;
const FAST: u64 = 2 << 20;
const NAME: &str = "vol0";
const WAIT: Duration = Duration::from_secs(30);
const TASKS: u64 = 8;

fn mem(size: u64) -> MemDevice {
    MemDevice::new(Geometry::new(size, 512).unwrap())
}

async fn cache(fast: Arc<dyn BlockDevice>) -> Arc<WriteBackCache> {
    let backing: Arc<dyn BlockDevice> = Arc::new(mem(SIZE));
    let fast_dev = FastDevice::block(fast.clone());
    WriteBackCache::format(&fast_dev, backing.as_ref(), CacheMode::WriteBack)
        .await
        .unwrap();
    let cfg = CacheConfig {
        sequential_cutoff: 0,
        data_loss: DataLoss::ServeBacking,
        ..CacheConfig::default()
    };
    Arc::new(
        WriteBackCache::open(FastDevice::block(fast), backing, cfg)
            .await
            .unwrap(),
    )
}

async fn node(id: u32, local: Arc<WriteBackCache>) -> MirroredDisk {
    let mut cfg = Config::new(id, 3 - id, DiskId([0x5c; 16]), NAME, SIZE, BS as u32);
    cfg.ping_interval = Duration::from_millis(100);
    let local: Arc<dyn BlockDevice> = local;
    let replica = Replica::with_memory_meta(&cfg, local).await.unwrap();
    MirroredDisk::start(cfg, replica, None).unwrap()
}

async fn wait_for(
    disk: &MirroredDisk,
    what: &str,
    pred: impl Fn(&MirrorStatus) -> bool,
) -> MirrorStatus {
    let mut rx = disk.watch_status();
    let r = timeout(WAIT, async {
        loop {
            {
                let s = rx.borrow_and_update();
                if pred(&s) {
                    return s.clone();
                }
            }
            if rx.changed().await.is_err() {
                panic!("{what}: the mirror driver stopped");
            }
        }
    })
    .await;
    r.unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}; status {:?}", disk.status()))
}

fn in_sync(s: &MirrorStatus) -> bool {
    s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0 && !s.inconsistent
}

/// Block `b`'s contents as write `n` of task `t` leaves them.
fn contents(t: u64, n: u64, b: u64) -> Bytes {
    let mut v = vec![0u8; BS as usize];
    for (i, w) in v.chunks_mut(8).enumerate() {
        w.copy_from_slice(&(t << 56 | n << 24 | b << 4 | (i as u64 & 0xf)).to_le_bytes());
    }
    Bytes::from(v)
}

/// Task `t` owns the blocks `b % TASKS == t`: it writes them through `disk` and reads
/// them back, each read checked against its last acknowledged write; until `stop`.
async fn client(t: u64, disk: MirroredDisk, stop: Arc<AtomicBool>) -> HashMap<u64, Bytes> {
    let mut rng = SmallRng::seed_from_u64(t);
    let mut last: HashMap<u64, Bytes> = HashMap::new();
    let owned = SIZE / BS / TASKS;
    let mut n = 0;
    while !stop.load(Ordering::Acquire) {
        n += 1;
        // A hot set (so cached blocks are rewritten) and a cold spread.
        let k = if rng.random_bool(0.7) {
            rng.random_range(0..64)
        } else {
            rng.random_range(0..owned)
        };
        let b = k * TASKS + t;
        if rng.random_bool(0.6) {
            let d = contents(t, n, b);
            let fua = if rng.random_bool(0.1) {
                IoFlags::FUA
            } else {
                IoFlags::empty()
            };
            disk.write(b * BS, d.clone(), fua)
                .await
                .unwrap_or_else(|e| panic!("task {t}: write of block {b}: {e}"));
            last.insert(b, d);
        } else {
            let got = disk
                .read(b * BS, BS as usize)
                .await
                .unwrap_or_else(|e| panic!("task {t}: read of block {b}: {e}"));
            let want = last
                .get(&b)
                .cloned()
                .unwrap_or_else(|| Bytes::from(vec![0u8; BS as usize]));
            assert!(
                got == want,
                "task {t}: block {b} read back stale or wrong data"
            );
        }
        if n % 64 == 0 {
            disk.flush()
                .await
                .unwrap_or_else(|e| panic!("task {t}: flush: {e}"));
        }
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_cache_device_under_a_mirror_loses_nothing_and_is_resynced() {
    let fast1 = Arc::new(FaultyDevice::new(mem(FAST)));
    let cache1 = cache(fast1.clone()).await;
    let cache2 = cache(Arc::new(mem(FAST))).await;
    let n1 = node(1, cache1.clone()).await;
    let n2 = node(2, cache2.clone()).await;
    let transport = TcpTransport::new();
    let listener = transport.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let accept = tokio::spawn(accept_loop(
        listener,
        HashMap::from([(NAME.to_string(), n2.clone())]),
    ));
    let dial = tokio::spawn(dial_loop(Arc::new(TcpTransport::new()), addr, n1.clone()));
    wait_for(&n1, "node 1 in sync", in_sync).await;
    wait_for(&n2, "node 2 in sync", in_sync).await;

    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..TASKS)
        .map(|t| {
            let disk = if t % 2 == 0 { n1.clone() } else { n2.clone() };
            tokio::spawn(client(t, disk, stop.clone()))
        })
        .collect();
    sleep(Duration::from_millis(1500)).await;
    let dirty = cache1.stats().dirty_blocks;
    assert!(
        dirty > 0,
        "node 1's cache holds nothing dirty: the failure would lose nothing"
    );
    // The cache device dies: every read, write and flush fails from now on.
    fast1.set_faults(FaultConfig::new().ops(&[OpKind::Read, OpKind::Write, OpKind::Flush]));
    sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::Release);
    let mut model: HashMap<u64, Bytes> = HashMap::new();
    for c in clients {
        model.extend(c.await.expect("a client failed"));
    }
    let lost = match cache1.state() {
        CacheState::Failed { lost_blocks } => lost_blocks,
        s => panic!("node 1's cache did not fail: {s:?}"),
    };
    assert!(lost > 0, "the failure lost no dirty blocks");
    assert_eq!(cache1.data_loss_count(), 1);

    let s1 = wait_for(&n1, "node 1 resynced", |s| {
        in_sync(s) && s.local_data_lost > 0
    })
    .await;
    wait_for(&n2, "node 2 in sync", in_sync).await;
    let sync = s1.last_sync.expect("no resync recorded on node 1");
    assert_eq!(
        (sync.role, sync.kind, sync.completed),
        (SyncRole::Target, SyncKind::Checksum, true),
        "node 1's last resync: {sync:?}"
    );
    assert!(sync.transferred_bytes > 0, "{sync:?}");

    // Every acknowledged write is there, read through either node and on both replicas.
    let image1 = cache1.read(0, SIZE as usize).await.unwrap();
    let image2 = cache2.read(0, SIZE as usize).await.unwrap();
    for (b, want) in &model {
        let at = (b * BS) as usize..((b + 1) * BS) as usize;
        assert!(
            image1[at.clone()] == want[..],
            "node 1's replica: block {b} wrong"
        );
        assert!(image2[at] == want[..], "node 2's replica: block {b} wrong");
        for (who, disk) in [("node 1", &n1), ("node 2", &n2)] {
            let got = disk.read(b * BS, BS as usize).await.unwrap();
            assert!(got == *want, "{who}: block {b} read wrong");
        }
    }
    if let Some(i) = image1.iter().zip(image2.iter()).position(|(a, b)| a != b) {
        panic!(
            "replicas differ, first at byte {i} (block {})",
            i as u64 / BS
        );
    }
    accept.abort();
    dial.abort();
    n1.close().await.ok();
    n2.close().await.ok();
}
