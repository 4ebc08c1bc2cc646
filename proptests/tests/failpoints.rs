//! The error paths at the I/O edges, driven by fail points (the `failpoints` features of
//! vsan-replica and vsan-cache; the points are listed in `vsan_replica::failpoints` and
//! `vsan_cache::failpoints`).
//!
//! Two `MirroredDisk`s in one process, linked over TCP on loopback (node 1 dials node
//! 2), over in-memory replicas and in-memory metadata; or a `WriteBackCache` as node 1's
//! replica, or alone. Each test sets a point, and checks what a user cares about: which
//! writes were acknowledged, that each of them reads back through both nodes (after the
//! point is cleared, a restart and a resync where the failure calls for one), that the
//! replicas end byte-identical, and that the failure shows in the status.
//!
//! # One test at a time
//!
//! Fail points are process-global, and the two nodes of a test share them (a point meant
//! for one node is set as `return(N)`). So every test runs inside [`scenario`]: it holds
//! a `fail::FailScenario`, whose lock runs this binary's tests one at a time and whose
//! end clears every point, and it builds its own tokio runtime and drops it (every
//! driver task with it) before the scenario ends, so nothing of one test evaluates the
//! points of the next. Every wait is bounded, and so is each scenario: a hang fails the
//! test instead of blocking CI.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout};
use vsan_cache::failpoints::{CACHE_DESTAGE, CACHE_PERSIST};
use vsan_cache::{CacheConfig, CacheMode, CacheState, DataLoss, FastDevice, WriteBackCache};
use vsan_core::{BlockDevice, Geometry, IoFlags, MemDevice, Result};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::failpoints::{LOCAL_FLUSH, META_BITMAP_PERSIST, META_WRITE, MIRROR_RECV_ACK};
use vsan_replica::meta::{self, DEFAULT_CHUNK_SIZE};
use vsan_replica::protocol::{Config, DiskId, LinkState};
use vsan_replica::transport::{TcpTransport, Transport};
use vsan_replica::{MirrorStatus, MirroredDisk, Replica, meta_params};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const BS: u32 = 4096;
/// Four activity-log extents (4 MiB each), so a write can land in a cold one.
const SIZE: u64 = 16 * MIB;
const NAME: &str = "vol0";
const DISK_ID: DiskId = DiskId([0xfa; 16]);
const PEER_TIMEOUT: Duration = Duration::from_millis(500);
const PING: Duration = Duration::from_millis(100);
/// Bound on any single wait.
const WAIT: Duration = Duration::from_secs(10);
/// Bound on a whole scenario.
const SCENARIO: Duration = Duration::from_secs(25);
/// How much later than the peer timeout a write may complete once acks are lost.
const LOSS_MARGIN: Duration = Duration::from_millis(2500);

// ----- harness -----

/// Runs `body` as one fail-point scenario (see the module docs): alone, on a runtime of
/// its own, within [`SCENARIO`].
fn scenario<F: Future<Output = ()>>(body: impl FnOnce() -> F) {
    let points = fail::FailScenario::setup();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        if timeout(SCENARIO, body()).await.is_err() {
            panic!("the scenario did not finish within {SCENARIO:?}");
        }
    });
    // Every driver of the scenario stops here, before its points are cleared.
    drop(rt);
    points.teardown();
}

fn set_point(name: &str, actions: &str) {
    fail::cfg(name, actions).unwrap_or_else(|e| panic!("fail point {name}={actions}: {e}"));
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {WAIT:?}"),
    }
}

fn mem(size: u64) -> Arc<MemDevice> {
    Arc::new(MemDevice::new(Geometry::new(size, BS).unwrap()))
}

fn config(node: u32) -> Config {
    let mut cfg = Config::new(node, 3 - node, DISK_ID, NAME, SIZE, BS);
    cfg.peer_timeout = PEER_TIMEOUT;
    cfg.ping_interval = PING;
    cfg.connect_timeout = Duration::from_secs(2);
    cfg
}

/// Random bytes, the same for the same seed.
fn pattern(seed: u64, len: u64) -> Bytes {
    let mut v = vec![0u8; len as usize];
    SmallRng::seed_from_u64(seed).fill(&mut v[..]);
    Bytes::from(v)
}

async fn write_res(dev: &dyn BlockDevice, offset: u64, data: Bytes) -> Result<()> {
    let len = data.len();
    within(
        &format!("write {len}@{offset}"),
        dev.write(offset, data, IoFlags::empty()),
    )
    .await
}

async fn write(dev: &dyn BlockDevice, offset: u64, data: Bytes) {
    let len = data.len();
    write_res(dev, offset, data)
        .await
        .unwrap_or_else(|e| panic!("write {len}@{offset}: {e}"));
}

async fn read(dev: &dyn BlockDevice, offset: u64, len: u64) -> Bytes {
    within(
        &format!("read {len}@{offset}"),
        dev.read(offset, len as usize),
    )
    .await
    .unwrap_or_else(|e| panic!("read {len}@{offset}: {e}"))
}

/// Every write in `acked` (offset -> data) reads back through `dev`.
async fn check_acked(dev: &dyn BlockDevice, acked: &HashMap<u64, Bytes>, through: &str) {
    for (&offset, data) in acked {
        let got = read(dev, offset, data.len() as u64).await;
        assert!(
            got == *data,
            "the acknowledged write at {offset} reads back wrong through {through}"
        );
    }
}

async fn image(dev: &dyn BlockDevice) -> Bytes {
    let mut out = Vec::with_capacity(SIZE as usize);
    for at in (0..SIZE).step_by(MIB as usize) {
        out.extend_from_slice(&read(dev, at, MIB).await);
    }
    Bytes::from(out)
}

/// Panics with the first differing block (not megabytes of bytes) when they differ.
async fn assert_same_replicas(a: &dyn BlockDevice, b: &dyn BlockDevice) {
    let (a, b) = (image(a).await, image(b).await);
    if let Some(i) = a.iter().zip(b.iter()).position(|(x, y)| x != y) {
        let blocks = a
            .chunks(BS as usize)
            .zip(b.chunks(BS as usize))
            .filter(|(x, y)| x != y)
            .count();
        panic!(
            "the replicas differ, first at byte {i} (block {}); {blocks} blocks differ",
            i / BS as usize
        );
    }
}

async fn wait_for(
    disk: &MirroredDisk,
    what: &str,
    pred: impl Fn(&MirrorStatus) -> bool,
) -> MirrorStatus {
    let mut rx = disk.watch_status();
    let waited = timeout(WAIT, async {
        loop {
            {
                let s = rx.borrow_and_update();
                if pred(&s) {
                    return Some(s.clone());
                }
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    })
    .await;
    match waited {
        Ok(Some(s)) => s,
        Ok(None) => panic!("{what}: the mirror driver stopped"),
        Err(_) => panic!(
            "{what}: not reached within {WAIT:?}; status now {:?}",
            disk.status()
        ),
    }
}

/// Connected, no resync running, nothing out of sync.
fn in_sync(s: &MirrorStatus) -> bool {
    s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0 && !s.inconsistent
}

/// In sync after a resync that completed.
fn resynced(s: &MirrorStatus) -> bool {
    in_sync(s) && s.last_sync.is_some_and(|l| l.completed)
}

fn problem(s: &MirrorStatus) -> &str {
    s.last_problem.as_deref().unwrap_or("")
}

/// One node: its mirrored disk, and the devices to restart it with.
struct Node {
    id: u32,
    data: Arc<dyn BlockDevice>,
    meta: Arc<dyn BlockDevice>,
    disk: MirroredDisk,
}

impl Node {
    /// Node `id` over `data` with fresh metadata in memory.
    async fn start(id: u32, data: Arc<dyn BlockDevice>) -> Node {
        let cfg = config(id);
        let replica = Replica::with_memory_meta(&cfg, Arc::clone(&data))
            .await
            .unwrap();
        let meta = Arc::clone(&replica.meta);
        let disk = MirroredDisk::start(cfg, replica, None).unwrap();
        Node {
            id,
            data,
            meta,
            disk,
        }
    }

    /// The node starts again over the replica and metadata it had (after a close or a
    /// crash: the old disk handle must be gone).
    async fn restart(self) -> Node {
        let cfg = config(self.id);
        let params = meta_params(&cfg, DEFAULT_CHUNK_SIZE);
        let loaded = within("open the metadata", meta::open(self.meta.as_ref(), &params))
            .await
            .expect("the metadata opens after the failure");
        let replica = Replica {
            data: Arc::clone(&self.data),
            meta: Arc::clone(&self.meta),
            loaded,
        };
        let disk = MirroredDisk::start(cfg, replica, None).unwrap();
        Node { disk, ..self }
    }
}

/// Node 2 listens on `addr` (retrying while an old listener on the same port goes away)
/// and takes links for its disk. Returns the address to dial and the accept task.
async fn serve(n2: &Node, addr: &str) -> (String, JoinHandle<()>) {
    let transport = TcpTransport::new();
    let listener = within(&format!("listen on {addr}"), async {
        loop {
            match transport.listen(addr).await {
                Ok(l) => return l,
                Err(_) => sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    let local = listener.local_addr();
    let disks = HashMap::from([(NAME.to_string(), n2.disk.clone())]);
    (local, tokio::spawn(accept_loop(listener, disks)))
}

/// Node 1 keeps its disk linked to `addr`.
fn dial(n1: &Node, addr: &str) -> JoinHandle<()> {
    tokio::spawn(dial_loop(
        Arc::new(TcpTransport::new()),
        addr.to_string(),
        n1.disk.clone(),
    ))
}

/// Two connected nodes in sync: node 1 over `d1` dials node 2 over `d2`.
struct Pair {
    n1: Node,
    n2: Node,
    addr: String,
    accept: JoinHandle<()>,
    dialer: JoinHandle<()>,
}

impl Pair {
    async fn start(d1: Arc<dyn BlockDevice>, d2: Arc<dyn BlockDevice>) -> Pair {
        let n2 = Node::start(2, d2).await;
        let (addr, accept) = serve(&n2, "127.0.0.1:0").await;
        let n1 = Node::start(1, d1).await;
        let dialer = dial(&n1, &addr);
        wait_for(&n1.disk, "node 1 in sync", in_sync).await;
        wait_for(&n2.disk, "node 2 in sync", in_sync).await;
        Pair {
            n1,
            n2,
            addr,
            accept,
            dialer,
        }
    }

    /// Node 1 closes (the result of its close is returned), restarts over its replica
    /// and metadata and dials node 2 again.
    async fn restart_node1(mut self) -> (Pair, Result<()>) {
        let closed = within("node 1 to close", self.n1.disk.close()).await;
        self.dialer.abort();
        self.n1 = self.n1.restart().await;
        self.dialer = dial(&self.n1, &self.addr);
        (self, closed)
    }

    /// Node 2 stops (closes cleanly, stops listening); node 1 sees it gone.
    async fn stop_node2(&mut self) {
        self.accept.abort();
        within("node 2 to close", self.n2.disk.close())
            .await
            .expect("node 2 closes");
        wait_for(&self.n1.disk, "node 1 degraded", |s| {
            s.link == LinkState::Degraded
        })
        .await;
    }

    /// Node 2 starts again over its replica and metadata, on the same address.
    async fn restart_node2(mut self) -> Pair {
        self.n2 = self.n2.restart().await;
        let (_, accept) = serve(&self.n2, &self.addr).await;
        self.accept = accept;
        self
    }

    /// Both in sync after a completed resync; every write in `acked` reads back through
    /// both nodes, and the replicas are byte-identical.
    async fn check_resynced(&self, acked: &HashMap<u64, Bytes>) {
        wait_for(&self.n1.disk, "node 1 resynced", resynced).await;
        wait_for(&self.n2.disk, "node 2 in sync", in_sync).await;
        check_acked(&self.n1.disk, acked, "node 1").await;
        check_acked(&self.n2.disk, acked, "node 2").await;
        assert_same_replicas(self.n1.data.as_ref(), self.n2.data.as_ref()).await;
    }
}

// ----- metadata -----

/// `meta::write` fails on node 1 while connected: the activity-log record a write into
/// a cold extent needs cannot be written. Node 1 detaches its replica and says why in
/// its status; reads through it go to node 2. Its metadata can no longer record which
/// blocks the replica misses, so a write through node 1 is no longer acknowledged by
/// node 2 alone: it fails (before the fix it succeeded, and the restart below trusted
/// the replica and served zeros for it). Writes through node 2 go on, marked there.
/// Node 1's close reports its metadata is not marked clean. Once the metadata device
/// works again, node 1 restarts and is resynced: every acknowledged write reads back
/// through both nodes and the replicas end identical.
#[test]
fn metadata_write_fails_on_one_node() {
    scenario(|| async {
        let p = Pair::start(mem(SIZE), mem(SIZE)).await;
        let mut acked = HashMap::new();
        let a = pattern(1, 64 * KIB);
        write(&p.n1.disk, 0, a.clone()).await;
        acked.insert(0, a);

        set_point(META_WRITE, "return(1)");
        // Extent 2 is cold: the activity log must name it first. The write was in
        // flight when the metadata failed: either answer is allowed, but an
        // acknowledged one must survive.
        let b = pattern(2, 64 * KIB);
        if write_res(&p.n1.disk, 8 * MIB, b.clone()).await.is_ok() {
            acked.insert(8 * MIB, b);
        }
        let s1 = wait_for(&p.n1.disk, "node 1 detaches its replica", |s| {
            s.local_detached
        })
        .await;
        assert!(
            problem(&s1).contains("local replica failed"),
            "node 1 does not say why it detached: {s1:?}"
        );
        let s2 = p.n2.disk.status();
        assert!(
            s2.link == LinkState::Connected && !s2.local_detached,
            "node 2: {s2:?}"
        );
        let c = pattern(3, 64 * KIB);
        let r = write_res(&p.n1.disk, 12 * MIB, c.clone()).await;
        assert!(
            r.is_err(),
            "node 1 acknowledged a write its replica misses while its metadata cannot \
             record that: a restart would trust the replica and lose the write"
        );
        let d = pattern(4, 64 * KIB);
        write(&p.n2.disk, 4 * MIB, d.clone()).await;
        acked.insert(4 * MIB, d);
        check_acked(&p.n1.disk, &acked, "node 1, detached").await;
        check_acked(&p.n2.disk, &acked, "node 2").await;

        fail::remove(META_WRITE);
        let (p, closed) = p.restart_node1().await;
        let e = closed.expect_err("node 1 closed clean with failed metadata");
        assert!(e.to_string().contains("metadata"), "close: {e}");
        p.check_resynced(&acked).await;
    });
}

/// `meta::bitmap_persist` fails on node 1 while node 2 is away: a degraded write needs
/// its chunk's bit durable before it is acknowledged, so the write fails (it is never
/// acknowledged without its bit); node 1 detaches its replica and, with no peer, serves
/// nothing. Writes acknowledged before the failure keep their bits. Once the point is
/// cleared, node 1 restarts and node 2 returns: the resync covers every acknowledged
/// write and the replicas end identical.
#[test]
fn bitmap_persist_fails_while_the_peer_is_away() {
    scenario(|| async {
        let mut p = Pair::start(mem(SIZE), mem(SIZE)).await;
        let mut acked = HashMap::new();
        let a = pattern(11, 64 * KIB);
        write(&p.n1.disk, 0, a.clone()).await;
        acked.insert(0, a);
        p.stop_node2().await;

        // Degraded, the bit durable: acknowledged.
        let e = pattern(12, 64 * KIB);
        write(&p.n1.disk, 2 * MIB, e.clone()).await;
        acked.insert(2 * MIB, e.clone());
        assert!(p.n1.disk.status().dirty_chunks > 0, "no chunk marked");

        set_point(META_BITMAP_PERSIST, "return(1)");
        let bitless = pattern(13, 64 * KIB);
        let r = write_res(&p.n1.disk, 3 * MIB, bitless.clone()).await;
        assert!(
            r.is_err(),
            "a degraded write was acknowledged although its bit could not be persisted"
        );
        let s1 = wait_for(&p.n1.disk, "node 1 detaches its replica", |s| {
            s.local_detached
        })
        .await;
        assert!(problem(&s1).contains("local replica failed"), "{s1:?}");
        // Nothing here can serve a write now, and no read may return stale data.
        let r = write_res(&p.n1.disk, 5 * MIB, pattern(14, 4096)).await;
        assert!(r.is_err(), "a write with no replica to hold it succeeded");
        if let Ok(got) = within("read", p.n1.disk.read(2 * MIB, 64 * KIB as usize)).await {
            assert_eq!(got, e, "a read returned stale data");
        }

        fail::remove(META_BITMAP_PERSIST);
        let (p, closed) = p.restart_node1().await;
        assert!(closed.is_err(), "node 1 closed clean with failed metadata");
        let p = p.restart_node2().await;
        p.check_resynced(&acked).await;
    });
}

// ----- the peer -----

/// `mirror::recv_ack` drops node 1's acks from node 2: a write waits for its ack until
/// the peer timeout declares node 2 lost (never sooner), then completes degraded with
/// its chunk marked. Once acks flow again and node 1 dials again, it resyncs node 2;
/// every acknowledged write reads back through both nodes, the replicas end identical,
/// and a new write is mirrored at once.
#[test]
fn peer_ack_lost() {
    scenario(|| async {
        let mut p = Pair::start(mem(SIZE), mem(SIZE)).await;
        let mut acked = HashMap::new();
        // The link stays up; only a new one needs the dialer, and none may come until
        // the status after the loss is looked at.
        p.dialer.abort();

        set_point(MIRROR_RECV_ACK, "return(1)");
        let f = pattern(21, 64 * KIB);
        let t = Instant::now();
        write(&p.n1.disk, 5 * MIB, f.clone()).await;
        let waited = t.elapsed();
        acked.insert(5 * MIB, f);
        assert!(
            waited >= PEER_TIMEOUT,
            "the write completed after {waited:?}, without its ack and before the peer \
             timeout ({PEER_TIMEOUT:?})"
        );
        assert!(
            waited <= PEER_TIMEOUT + LOSS_MARGIN,
            "the write took {waited:?} with a peer timeout of {PEER_TIMEOUT:?}"
        );
        let s1 = p.n1.disk.status();
        assert!(
            s1.link == LinkState::Degraded && s1.dirty_chunks > 0,
            "node 1 completed the write without marking its chunk degraded: {s1:?}"
        );
        assert!(
            problem(&s1).contains("no answer from the peer"),
            "node 1 does not say why it lost node 2: {s1:?}"
        );

        fail::remove(MIRROR_RECV_ACK);
        p.dialer = dial(&p.n1, &p.addr);
        p.check_resynced(&acked).await;
        let g = pattern(22, 64 * KIB);
        let t = Instant::now();
        write(&p.n1.disk, 6 * MIB, g.clone()).await;
        assert!(
            t.elapsed() < PEER_TIMEOUT,
            "a mirrored write waited for the timeout"
        );
        assert_eq!(read(p.n2.data.as_ref(), 6 * MIB, 64 * KIB).await, g);
    });
}

// ----- the local replica -----

/// `local::flush` fails on node 1: the flush still completes (node 2 flushed), node 1
/// detaches its replica and serves I/O through node 2, durably marking its replica for
/// a full resync; after a restart the writes it missed come from node 2.
#[test]
fn local_flush_fails_on_one_node() {
    scenario(|| async {
        let p = Pair::start(mem(SIZE), mem(SIZE)).await;
        let mut acked = HashMap::new();
        let a = pattern(31, 64 * KIB);
        write(&p.n1.disk, MIB, a.clone()).await;
        acked.insert(MIB, a);

        set_point(LOCAL_FLUSH, "return(1)");
        within("flush", p.n1.disk.flush())
            .await
            .expect("a flush node 2 did fails on node 1");
        let s1 = wait_for(&p.n1.disk, "node 1 detaches its replica", |s| {
            s.local_detached
        })
        .await;
        assert!(problem(&s1).contains("local replica failed"), "{s1:?}");
        let b = pattern(32, 64 * KIB);
        write(&p.n1.disk, 9 * MIB, b.clone()).await;
        acked.insert(9 * MIB, b);
        check_acked(&p.n1.disk, &acked, "node 1, detached").await;

        fail::remove(LOCAL_FLUSH);
        let (p, closed) = p.restart_node1().await;
        closed.expect("node 1 closes (its metadata works)");
        p.check_resynced(&acked).await;
    });
}

// ----- the cache -----

/// A write-back cache over in-memory fast and backing devices; destaging only when
/// asked (so what is cached stays dirty).
async fn cache(data_loss: DataLoss) -> (Arc<WriteBackCache>, Arc<MemDevice>) {
    let fast: Arc<dyn BlockDevice> = mem(2 * MIB);
    let backing = mem(SIZE);
    WriteBackCache::format(
        &FastDevice::block(Arc::clone(&fast)),
        backing.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .unwrap();
    let cfg = CacheConfig {
        sequential_cutoff: 0,
        background: false,
        data_loss,
        ..CacheConfig::default()
    };
    let backing_dev: Arc<dyn BlockDevice> = backing.clone();
    let cache = WriteBackCache::open(FastDevice::block(fast), backing_dev, cfg)
        .await
        .unwrap();
    (Arc::new(cache), backing)
}

/// `cache::persist` fails under a cache alone: the write that hit it is written to the
/// backing store instead and acknowledged (it reads back, and the backing store has
/// it); the cache reports the failure and the dirty blocks it lost, and a read of those
/// fails instead of returning older data, until they are written again.
#[test]
fn cache_persist_fails_alone() {
    scenario(|| async {
        let (c, backing) = cache(DataLoss::FailReads).await;
        let g1 = pattern(41, 32 * KIB);
        write(c.as_ref(), 0, g1).await;
        assert_eq!(c.stats().dirty_blocks, 8, "the write is not cached dirty");

        set_point(CACHE_PERSIST, "return");
        let g2 = pattern(42, 32 * KIB);
        write(c.as_ref(), MIB, g2.clone()).await;
        assert_eq!(read(c.as_ref(), MIB, 32 * KIB).await, g2);
        assert_eq!(
            read(backing.as_ref(), MIB, 32 * KIB).await,
            g2,
            "the write the failure hit is not in the backing store"
        );
        assert_eq!(c.state(), CacheState::Failed { lost_blocks: 8 });
        assert_eq!(c.stats().mode, CacheMode::PassThrough);
        let r = within("read of a lost block", c.read(0, 4096)).await;
        assert!(r.is_err(), "a lost block read back without an error");

        fail::remove(CACHE_PERSIST);
        let g3 = pattern(43, 4096);
        write(c.as_ref(), 0, g3.clone()).await;
        assert_eq!(
            read(c.as_ref(), 0, 4096).await,
            g3,
            "a rewritten lost block"
        );
    });
}

/// `cache::destage` fails: the destage reports the error and the backing store is not
/// touched; the cached writes stay dirty and readable, and the next destage after the
/// point is cleared moves them to the backing store.
#[test]
fn cache_destage_fails() {
    scenario(|| async {
        let (c, backing) = cache(DataLoss::FailReads).await;
        let g = pattern(51, 32 * KIB);
        write(c.as_ref(), 2 * MIB, g.clone()).await;

        set_point(CACHE_DESTAGE, "return");
        let r = within("destage", c.destage()).await;
        assert!(r.is_err(), "a failing destage reported success");
        assert_eq!(
            c.stats().dirty_blocks,
            8,
            "the failed destage dropped records"
        );
        assert_eq!(c.state(), CacheState::Running);
        assert_eq!(read(c.as_ref(), 2 * MIB, 32 * KIB).await, g);
        assert!(
            read(backing.as_ref(), 2 * MIB, 32 * KIB)
                .await
                .iter()
                .all(|&x| x == 0)
        );

        fail::remove(CACHE_DESTAGE);
        within("drain", c.drain()).await.expect("drain");
        assert_eq!(c.stats().dirty_blocks, 0);
        assert_eq!(read(backing.as_ref(), 2 * MIB, 32 * KIB).await, g);
    });
}

/// `cache::persist` fails under node 1's write-back cache while mirrored: the write
/// that hit it is acknowledged (the backing store and node 2 have it); the cache lost
/// dirty blocks and says so, node 1's mirror resyncs its replica from node 2, and
/// every acknowledged write reads back through both nodes, with the replicas (node
/// 1's backing store, node 2's device) identical.
#[test]
fn cache_persist_fails_under_a_mirror() {
    scenario(|| async {
        let (c, backing) = cache(DataLoss::ServeBacking).await;
        let local: Arc<dyn BlockDevice> = c.clone();
        let p = Pair::start(local, mem(SIZE)).await;
        let mut acked = HashMap::new();
        let h1 = pattern(61, 64 * KIB);
        write(&p.n1.disk, 0, h1.clone()).await;
        acked.insert(0, h1);
        assert!(c.stats().dirty_blocks > 0, "nothing dirty to lose");

        set_point(CACHE_PERSIST, "return");
        let h2 = pattern(62, 64 * KIB);
        write(&p.n1.disk, MIB, h2.clone()).await;
        acked.insert(MIB, h2);
        match c.state() {
            CacheState::Failed { lost_blocks } => assert!(lost_blocks > 0),
            s => panic!("the cache did not fail: {s:?}"),
        }
        assert_eq!(c.data_loss_count(), 1);

        fail::remove(CACHE_PERSIST);
        let s1 = wait_for(&p.n1.disk, "node 1 resynced from node 2", |s| {
            resynced(s) && s.local_data_lost > 0
        })
        .await;
        assert!(!s1.local_detached, "{s1:?}");
        wait_for(&p.n2.disk, "node 2 in sync", in_sync).await;
        check_acked(&p.n1.disk, &acked, "node 1").await;
        check_acked(&p.n2.disk, &acked, "node 2").await;
        assert_same_replicas(backing.as_ref(), p.n2.data.as_ref()).await;
    });
}
