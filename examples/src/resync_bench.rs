//! `vsan-bench resync`: how fast a resync copies, and what it costs the application.
//!
//! Two in-process nodes mirror a file-backed disk over TCP on loopback (the same code
//! `vsan-node` runs). Each round:
//! 1. **Throughput.** Node 2 stops; node 1 writes `dirty` MiB alone (1 MiB sequential
//!    writes, so every chunk of that range is marked). The baseline then copies the same
//!    byte ranges from node 1's image file to node 2's with plain `pread`/`pwrite` and one
//!    `fdatasync` (what `dd` would do); then node 2 restarts and the resync copies them
//!    for real. Both rates are in MiB/s of data copied; their ratio is the figure.
//! 2. **Application during a dynamic-rate resync.** With the pair in sync, 4 KiB random
//!    writes at a fixed queue depth run on node 1 for `seconds` (the baseline); then
//!    node 2 stops, node 1 dirties the whole disk, node 2 restarts, and the same workload
//!    runs while the resync does (measured only while it runs). The ratio of the two
//!    IOPS figures is the second figure.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan_core::{BlockDevice, FileOptions, IoFlags};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::meta::{self, DEFAULT_CHUNK_SIZE};
use vsan_replica::protocol::{Config, DiskId, LinkState, SyncSummary};
use vsan_replica::transport::Transport;
use vsan_replica::transport::tcp::TcpTransport;
use vsan_replica::{MirroredDisk, Replica, meta_params};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const MIB: u64 = 1 << 20;

/// Options of the run.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Disk size in MiB.
    pub size_mib: u64,
    /// MiB written while node 2 is away (the throughput part).
    pub dirty_mib: u64,
    /// Seconds of each IOPS measurement.
    pub seconds: f64,
    /// Queue depth of the application workload.
    pub depth: usize,
    /// Rounds.
    pub rounds: u32,
    /// Work directory.
    pub dir: PathBuf,
    /// Open the replicas (and the baseline's files) with O_DIRECT, so both copies go to
    /// the disk rather than the page cache.
    pub direct: bool,
}

struct Node {
    disk: MirroredDisk,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn config(id: u32, size: u64) -> Config {
    let mut cfg = Config::new(id, 3 - id, DiskId::from_name("bench"), "bench", size, 512);
    cfg.peer_timeout = Duration::from_secs(2);
    cfg.connect_timeout = Duration::from_secs(30);
    cfg.seed = rand::random();
    cfg
}

fn image(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("resync-n{id}.img"))
}

async fn open(dir: &Path, id: u32, size: u64, direct: bool) -> Result<MirroredDisk, BoxError> {
    let cfg = config(id, size);
    let data: Arc<dyn BlockDevice> = Arc::new(
        FileOptions::new()
            .direct(direct)
            .create(size)
            .open(image(dir, id))?,
    );
    let params = meta_params(&cfg, DEFAULT_CHUNK_SIZE);
    let path = dir.join(format!("resync-n{id}.meta"));
    let (meta_dev, loaded, _) = meta::open_or_create_file(&path, &params).await?;
    let replica = Replica {
        data,
        meta: meta_dev,
        loaded,
    };
    Ok(MirroredDisk::start(cfg, replica, None)?)
}

/// Node 2 (accepting) and, the first time, node 1 (dialing it).
async fn start_node2(dir: &Path, size: u64, direct: bool, n1: &mut Node) -> Result<Node, BoxError> {
    let disk = open(dir, 2, size, direct).await?;
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::new());
    let listener = transport.listen("127.0.0.1:0").await?;
    let addr = listener.local_addr();
    let acc = tokio::spawn(accept_loop(
        listener,
        HashMap::from([("bench".to_string(), disk.clone())]),
    ));
    for t in n1.tasks.drain(..) {
        t.abort();
    }
    n1.tasks
        .push(tokio::spawn(dial_loop(transport, addr, n1.disk.clone())));
    Ok(Node {
        disk,
        tasks: vec![acc],
    })
}

async fn stop(node: Node) -> Result<(), BoxError> {
    for t in &node.tasks {
        t.abort();
    }
    node.disk.close().await?;
    Ok(())
}

/// Wait until `disk` is connected with nothing left to copy; returns the last sync.
async fn in_sync(disk: &MirroredDisk, limit: Duration) -> Result<Option<SyncSummary>, BoxError> {
    let mut st = disk.watch_status();
    let s = tokio::time::timeout(
        limit,
        st.wait_for(|s| s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0),
    )
    .await??
    .clone();
    Ok(s.last_sync)
}

async fn degraded(disk: &MirroredDisk) -> Result<(), BoxError> {
    let mut st = disk.watch_status();
    tokio::time::timeout(
        Duration::from_secs(10),
        st.wait_for(|s| s.link == LinkState::Degraded),
    )
    .await??;
    Ok(())
}

/// 1 MiB sequential writes over `[0, len)`, 8 in flight.
async fn fill(disk: &MirroredDisk, len: u64, round: u32) -> Result<(), BoxError> {
    let mut set = tokio::task::JoinSet::new();
    for w in 0..8u64 {
        let disk = disk.clone();
        set.spawn(async move {
            let mut off = w * MIB;
            while off < len {
                let data = Bytes::from(vec![(off / MIB) as u8 ^ round as u8 ^ 0x5a; MIB as usize]);
                disk.write(off, data, IoFlags::empty()).await?;
                off += 8 * MIB;
            }
            Ok::<(), vsan_core::Error>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    disk.flush().await?;
    Ok(())
}

/// The baseline: copy `[0, len)` from node 1's image to node 2's, 1 MiB at a time, then
/// fdatasync. Returns MiB/s.
fn plain_copy(dir: &Path, len: u64, direct: bool) -> Result<f64, BoxError> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = if direct { libc::O_DIRECT } else { 0 };
    let from = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(image(dir, 1))?;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(flags)
        .open(image(dir, 2))?;
    // O_DIRECT wants an aligned buffer: take a 4 KiB-aligned window of a larger one.
    let mut backing = vec![0u8; (MIB + 4096) as usize];
    let skew = backing.as_ptr().align_offset(4096);
    let buf = &mut backing[skew..skew + MIB as usize];
    let t0 = Instant::now();
    let mut off = 0;
    while off < len {
        let n = MIB.min(len - off) as usize;
        from.read_exact_at(&mut buf[..n], off)?;
        to.write_all_at(&buf[..n], off)?;
        off += n as u64;
    }
    to.sync_data()?;
    Ok(len as f64 / MIB as f64 / t0.elapsed().as_secs_f64())
}

/// 4 KiB random writes at queue depth `depth` on `disk` until `until` says stop (or
/// `max` passes). Returns (ops, seconds).
async fn randwrite(
    disk: &MirroredDisk,
    size: u64,
    depth: usize,
    max: Duration,
    until: impl Fn() -> bool,
) -> (u64, f64) {
    let ops = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    let blocks = size / 4096;
    for w in 0..depth {
        let (disk, ops, stop) = (disk.clone(), ops.clone(), stop.clone());
        set.spawn(async move {
            let mut rng = SmallRng::seed_from_u64(w as u64 ^ 0xbe5c);
            let data = Bytes::from(vec![w as u8; 4096]);
            while !stop.load(Ordering::Relaxed) {
                let off = rng.random_range(0..blocks) * 4096;
                if disk
                    .write(off, data.clone(), IoFlags::empty())
                    .await
                    .is_err()
                {
                    break;
                }
                ops.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let t0 = Instant::now();
    while t0.elapsed() < max && !until() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let n = ops.load(Ordering::Relaxed);
    while set.join_next().await.is_some() {}
    (n, secs)
}

/// Run the benchmark and print its table.
pub fn run(opts: Opts) -> Result<(), BoxError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(run_async(opts))
}

async fn run_async(o: Opts) -> Result<(), BoxError> {
    std::fs::create_dir_all(&o.dir)?;
    for id in [1, 2] {
        let _ = std::fs::remove_file(image(&o.dir, id));
        let _ = std::fs::remove_file(o.dir.join(format!("resync-n{id}.meta")));
    }
    let size = o.size_mib * MIB;
    let dirty = o.dirty_mib.min(o.size_mib) * MIB;
    let mut n1 = Node {
        disk: open(&o.dir, 1, size, o.direct).await?,
        tasks: Vec::new(),
    };
    let mut n2 = start_node2(&o.dir, size, o.direct, &mut n1).await?;
    in_sync(&n1.disk, Duration::from_secs(120)).await?;

    println!(
        "resync throughput: {} MiB written on node 1 while node 2 was away",
        dirty / MIB
    );
    println!("| round | plain copy (MiB/s) | resync (MiB/s) | ratio | bytes resynced |");
    println!("|---:|---:|---:|---:|---:|");
    let mut ratios = Vec::new();
    // Untimed, once: allocate node 2's blocks of the range, so that no round's copy
    // (plain or resync) pays for the file system's first allocation and the other not.
    plain_copy(&o.dir, dirty, o.direct)?;
    for round in 0..o.rounds {
        stop(n2).await?;
        degraded(&n1.disk).await?;
        fill(&n1.disk, dirty, round).await?;
        let copy = plain_copy(&o.dir, dirty, o.direct)?;
        n2 = start_node2(&o.dir, size, o.direct, &mut n1).await?;
        let summary = in_sync(&n1.disk, Duration::from_secs(600))
            .await?
            .ok_or("no resync ran")?;
        let rate = summary.transferred_bytes as f64 / MIB as f64 / summary.elapsed.as_secs_f64();
        ratios.push(rate / copy);
        println!(
            "| {} | {copy:.0} | {rate:.0} | {:.2} | {} |",
            round + 1,
            rate / copy,
            summary.transferred_bytes
        );
    }

    println!();
    println!(
        "application 4 KiB randwrite, QD {}, on node 1: in sync vs during a dynamic-rate resync of the whole disk",
        o.depth
    );
    println!(
        "| round | in sync (IOPS) | during resync (IOPS) | ratio | resync rate meanwhile (MiB/s) |"
    );
    println!("|---:|---:|---:|---:|---:|");
    let max = Duration::from_secs_f64(o.seconds);
    let mut app_ratios = Vec::new();
    for round in 0..o.rounds {
        let (n, secs) = randwrite(&n1.disk, size, o.depth, max, || false).await;
        let base = n as f64 / secs;
        stop(n2).await?;
        degraded(&n1.disk).await?;
        fill(&n1.disk, size, round + 7).await?;
        n2 = start_node2(&o.dir, size, o.direct, &mut n1).await?;
        let mut st = n1.disk.watch_status();
        tokio::time::timeout(Duration::from_secs(30), st.wait_for(|s| s.syncing)).await??;
        let watch = n1.disk.clone();
        let (n, secs) = randwrite(&n1.disk, size, o.depth, max, move || {
            !watch.status().syncing
        })
        .await;
        let during = n as f64 / secs;
        let progress = n1.disk.sync_progress();
        let summary = in_sync(&n1.disk, Duration::from_secs(600)).await?;
        let moved = progress.map_or_else(|| summary.map_or(0, |s| s.done_bytes), |p| p.done_bytes);
        app_ratios.push(during / base);
        println!(
            "| {} | {base:.0} | {during:.0} | {:.2} | {:.0} |",
            round + 1,
            during / base,
            moved as f64 / MIB as f64 / secs
        );
    }
    stop(n2).await?;
    for t in n1.tasks.drain(..) {
        t.abort();
    }
    n1.disk.close().await?;
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!();
    println!(
        "median: resync/plain copy {:.2} (target >= 0.70); app IOPS during resync / in sync {:.2} (target >= 0.60)",
        med(&mut ratios),
        med(&mut app_ratios)
    );
    for id in [1, 2] {
        let _ = std::fs::remove_file(image(&o.dir, id));
        let _ = std::fs::remove_file(o.dir.join(format!("resync-n{id}.meta")));
    }
    Ok(())
}
