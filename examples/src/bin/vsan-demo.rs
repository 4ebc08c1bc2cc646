//! `vsan-demo`: the README's main job — a two-node synchronous mirror under load.
//!
//! Starts two in-process nodes (node 1 and node 2), each on a runtime of its own with one
//! worker thread (what `vsan-node` gives a node with one disk) and a file-backed replica
//! in a work directory under `target/`, mirrored over TCP on loopback, and each exporting
//! the mirrored disk over NBD on a free loopback port and a Unix socket. A mixed 4 KiB
//! workload then runs against BOTH nodes at once for about ten seconds with a live
//! progress line: every worker writes its own blocks through its home node and reads
//! them back through either node, so a read on node 2 of a block just acknowledged on
//! node 1 proves the write was on both replicas before it completed.
//!
//! Then the headline: 4 KiB random writes with 32 in flight on one connection to node 1,
//! then 4 KiB random reads the same way from node 2 (each checked against what was
//! acknowledged), from a lean client ([`nbd_load`]) on a
//! runtime of its own, so the nodes and not the client set the pace: IOPS, p50/p99
//! latency and the nodes' CPU time per I/O (both nodes' threads, from
//! `/proc/self/task`). `vsan-bench nbd --mirror --demo` runs this beside fio.
//!
//! At the end it flushes, stops both nodes, compares the two replica files byte for byte
//! (printing each one's checksum), checks every written block against what was
//! acknowledged, and exits non-zero on any mismatch.
//!
//! Between the two it plays the failure act: node 2 goes down, node 1 keeps writing
//! alone (its bitmap marks every chunk it changes), node 2 comes back with its stale
//! replica and metadata, and a progress bar follows the resync that copies only the
//! chunks written meanwhile; the act ends with the bytes resynced against the disk size.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan_core::export::nbd::{Client, Export, Server};
use vsan_core::{BlockDevice, FileOptions};
use vsan_examples::pattern::{BLOCK, BlockLog, expected_block};
use vsan_examples::{nbd_load, target_work_dir};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::meta;
use vsan_replica::protocol::{Config as MirrorConfig, DiskId, LinkState};
use vsan_replica::transport::Transport;
use vsan_replica::transport::tcp::TcpTransport;
use vsan_replica::{MirroredDisk, Replica, meta_params};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "vsan demo: a two-node synchronous mirror under a verified 4K workload"
)]
struct Args {
    /// How long the workload runs, in seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Disk size in MiB.
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// NBD connections per node.
    #[arg(long, default_value_t = 2)]
    connections: usize,
    /// Workers (requests in flight) per connection.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Percentage of reads in the mix.
    #[arg(long, default_value_t = 50)]
    read_pct: u32,
    /// Work directory (default: target/vsan-demo next to the binary's target dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Seconds of each headline run (random writes, then random reads, 32 in flight).
    #[arg(long, default_value_t = 5.0)]
    headline_seconds: f64,
    /// Requests in flight in the headline runs.
    #[arg(long, default_value_t = 32)]
    headline_depth: usize,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One in-process node: its replica file, mirrored disk and NBD server (TCP and a Unix
/// socket), all on the node's own runtime.
struct DemoNode {
    image: PathBuf,
    disk: MirroredDisk,
    server: Server,
    addr: String,
    socket: PathBuf,
    serving: tokio::task::JoinHandle<vsan_core::Result<()>>,
    serving_unix: tokio::task::JoinHandle<vsan_core::Result<()>>,
}

#[derive(Default)]
struct NodeStats {
    reads: AtomicU64,
    writes: AtomicU64,
}

struct Shared {
    log: BlockLog,
    stop: AtomicBool,
    stats: [NodeStats; 2],
    hist: [Mutex<Histogram<u64>>; 2],
    bytes_written: AtomicU64,
    mismatches: AtomicU64,
    errors: AtomicU64,
}

fn histogram() -> Result<Histogram<u64>, BoxError> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

/// A node's runtime: one worker thread, named after the node (its CPU time is read by
/// that name), as `vsan-node` runs a node with one disk.
fn node_runtime(id: u32) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("{NODE_THREADS}{id}"))
        .enable_all()
        .build()
}

/// The name prefix of the nodes' threads.
const NODE_THREADS: &str = "vsan-node";

fn main() -> ExitCode {
    let args = Args::parse();
    let runtimes = (|| {
        Ok::<_, std::io::Error>((
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("demo-client")
                .enable_all()
                .build()?,
            [node_runtime(1)?, node_runtime(2)?],
        ))
    })();
    let (client, nodes) = match runtimes {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vsan-demo: cannot start the runtimes: {e}");
            return ExitCode::from(1);
        }
    };
    let handles = [nodes[0].handle().clone(), nodes[1].handle().clone()];
    let result = client.block_on(run(args, handles));
    for rt in nodes {
        rt.shutdown_timeout(Duration::from_secs(5));
    }
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("vsan-demo: {e}");
            ExitCode::from(1)
        }
    }
}

/// Start node `id` on its runtime `rt`.
async fn start_node(
    rt: &tokio::runtime::Handle,
    id: u32,
    dir: &Path,
    size: u64,
    fresh: bool,
) -> Result<(DemoNode, Arc<dyn BlockDevice>), BoxError> {
    let dir = dir.to_path_buf();
    rt.spawn(async move { start_node_here(id, &dir, size, fresh).await })
        .await?
}

async fn start_node_here(
    id: u32,
    dir: &Path,
    size: u64,
    fresh: bool,
) -> Result<(DemoNode, Arc<dyn BlockDevice>), BoxError> {
    let image = dir.join(format!("node{id}.img"));
    let meta_path = dir.join(format!("node{id}.meta"));
    let socket = dir.join(format!("node{id}.sock"));
    if fresh {
        let _ = std::fs::remove_file(&image);
        let _ = std::fs::remove_file(&meta_path);
    }
    let local = FileOptions::new()
        .block_size(512)
        .create(size)
        .open(&image)?;
    let peer = 3 - id;
    let mut cfg = MirrorConfig::new(id, peer, DiskId::from_name("demo"), "demo", size, 512);
    cfg.connect_timeout = Duration::from_secs(10);
    cfg.peer_timeout = Duration::from_secs(2);
    cfg.seed = rand::random();
    let local: Arc<dyn BlockDevice> = Arc::new(local);
    let params = meta_params(&cfg, meta::DEFAULT_CHUNK_SIZE);
    let (meta_dev, loaded, _) = meta::open_or_create_file(&meta_path, &params).await?;
    let replica = Replica {
        data: Arc::clone(&local),
        meta: meta_dev,
        loaded,
    };
    let disk = MirroredDisk::start(cfg, replica, None)?;
    let server = Server::new(vec![Export::new(
        "demo",
        Arc::new(disk.clone()) as Arc<dyn BlockDevice>,
    )])?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let s = server.clone();
    let serving = tokio::spawn(async move { s.serve_tcp(listener).await });
    let _ = std::fs::remove_file(&socket);
    let unix = tokio::net::UnixListener::bind(&socket)?;
    let s = server.clone();
    let serving_unix = tokio::spawn(async move { s.serve_unix(unix).await });
    Ok((
        DemoNode {
            image,
            disk,
            server,
            addr,
            socket,
            serving,
            serving_unix,
        },
        local,
    ))
}

/// Node 2's replication listener on its runtime `rt`, routing links to its disk.
async fn accept_for(
    rt: &tokio::runtime::Handle,
    transport: &Arc<dyn Transport>,
    disk: &MirroredDisk,
) -> Result<(String, tokio::task::JoinHandle<()>), BoxError> {
    let (transport, disk) = (Arc::clone(transport), disk.clone());
    let listener = rt
        .spawn(async move { transport.listen("127.0.0.1:0").await })
        .await??;
    let addr = listener.local_addr();
    let task = rt.spawn(accept_loop(
        listener,
        HashMap::from([("demo".to_string(), disk)]),
    ));
    Ok((addr, task))
}

async fn wait_in_sync(disk: &MirroredDisk, limit: Duration) -> Result<(), BoxError> {
    let mut status = disk.watch_status();
    tokio::time::timeout(
        limit,
        status.wait_for(|s| s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0),
    )
    .await??;
    Ok(())
}

/// What a workload phase runs.
struct Mix<'a> {
    /// Nodes (0, 1) taking requests.
    homes: &'a [usize],
    depth: usize,
    read_pct: u32,
    blocks: u64,
    /// Writes go to blocks below this.
    write_limit: u64,
    duration: Duration,
}

/// Run the verified workload `mix` describes. Shows a live line; returns the seconds it
/// ran.
async fn workload(
    shared: &Arc<Shared>,
    clients: &[Vec<Arc<Client>>; 2],
    mix: Mix<'_>,
) -> Result<f64, BoxError> {
    let Mix {
        homes,
        depth,
        read_pct,
        blocks,
        write_limit,
        duration,
    } = mix;
    shared.stop.store(false, Ordering::Relaxed);
    let connections = clients[0].len();
    let workers = 2 * connections * depth;
    let progress = ProgressBar::new_spinner();
    progress.set_style(ProgressStyle::with_template(
        "{spinner} {elapsed:>3} {msg}",
    )?);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let home = homes[w % homes.len()];
        let conn = (w / 2) % connections;
        let pair: Vec<Arc<Client>> = homes
            .iter()
            .map(|&h| Arc::clone(&clients[h][conn]))
            .collect();
        let readers: Vec<usize> = homes.to_vec();
        let shared = Arc::clone(shared);
        tasks.push(tokio::spawn(async move {
            // Worker w alone writes the blocks b with b % workers == w, so it knows what
            // each must hold; it writes through its home node and reads through any.
            let mut rng =
                SmallRng::seed_from_u64(0x5eed ^ w as u64 ^ started.elapsed().as_nanos() as u64);
            let owned = (write_limit.min(blocks).saturating_sub(w as u64))
                .div_ceil(workers as u64)
                .max(1);
            let mut hist = [histogram().ok(), histogram().ok()];
            while !shared.stop.load(Ordering::Relaxed) {
                let block = (w as u64 + rng.random_range(0..owned) * workers as u64) % blocks;
                let offset = block * BLOCK as u64;
                let t0 = Instant::now();
                let node = if rng.random_range(0..100) < read_pct {
                    let k = rng.random_range(0..readers.len());
                    let node = readers[k];
                    match pair[k].read(offset, BLOCK as u32).await {
                        Ok(data) => {
                            if data[..] != expected_block(block, shared.log.generation(block))[..] {
                                shared.mismatches.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(_) => {
                            shared.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    shared.stats[node].reads.fetch_add(1, Ordering::Relaxed);
                    node
                } else {
                    let k = readers.iter().position(|&h| h == home).unwrap_or(0);
                    let generation = shared.log.generation(block) + 1;
                    match pair[k]
                        .write(offset, &expected_block(block, generation), false)
                        .await
                    {
                        Ok(()) => {
                            shared.log.set_generation(block, generation);
                            shared
                                .bytes_written
                                .fetch_add(BLOCK as u64, Ordering::Relaxed);
                        }
                        Err(_) => {
                            shared.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    shared.stats[home].writes.fetch_add(1, Ordering::Relaxed);
                    home
                };
                if let Some(h) = hist[node].as_mut() {
                    let _ = h.record(t0.elapsed().as_micros() as u64);
                }
            }
            for (i, h) in hist.into_iter().enumerate() {
                if let Some(h) = h {
                    let _ = shared.hist[i].lock().add(h);
                }
            }
        }));
    }
    let ops = |s: &Shared| -> [u64; 2] {
        [0, 1].map(|i| {
            s.stats[i].reads.load(Ordering::Relaxed) + s.stats[i].writes.load(Ordering::Relaxed)
        })
    };
    let mut last = (Instant::now(), ops(shared));
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = ops(shared);
        let dt = last.0.elapsed().as_secs_f64();
        let rate = [0, 1].map(|i| (now[i] - last.1[i]) as f64 / dt);
        last = (Instant::now(), now);
        progress.set_message(format!(
            "node 1 {:>7.0} IOPS | node 2 {:>7.0} IOPS | {:>7.1} MiB written | mismatches {}",
            rate[0],
            rate[1],
            shared.bytes_written.load(Ordering::Relaxed) as f64 / (1 << 20) as f64,
            shared.mismatches.load(Ordering::Relaxed)
        ));
        progress.tick();
    }
    shared.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    progress.finish_and_clear();
    Ok(started.elapsed().as_secs_f64())
}

async fn run(args: Args, rt: [tokio::runtime::Handle; 2]) -> Result<bool, BoxError> {
    let dir = args
        .work_dir
        .clone()
        .unwrap_or_else(|| target_work_dir("vsan-demo"));
    std::fs::create_dir_all(&dir)?;
    let size = args.size_mib << 20;

    // Two nodes, mirrored over TCP on loopback: node 2 accepts, node 1 dials.
    let (n1, local1) = start_node(&rt[0], 1, &dir, size, true).await?;
    let (n2, _) = start_node(&rt[1], 2, &dir, size, true).await?;
    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::new());
    let (replication, accepting) = accept_for(&rt[1], &transport, &n2.disk).await?;
    let dialing = rt[0].spawn(dial_loop(
        Arc::clone(&transport),
        replication.clone(),
        n1.disk.clone(),
    ));
    // New replicas compare every chunk by checksum first (nothing differs here).
    wait_in_sync(&n1.disk, Duration::from_secs(30)).await?;
    println!(
        "vsan-demo: two nodes mirroring disk \"demo\" ({} MiB) over tcp:{replication}",
        args.size_mib
    );
    for (n, node) in [(1, &n1), (2, &n2)] {
        println!(
            "  node {n}: replica {}  NBD nbd://{}/demo  nbd+unix:///demo?socket={}",
            node.image.display(),
            node.addr,
            node.socket.display()
        );
    }

    let blocks = size / BLOCK as u64;
    let shared = Arc::new(Shared {
        log: BlockLog::new(blocks),
        stop: AtomicBool::new(false),
        stats: Default::default(),
        hist: [Mutex::new(histogram()?), Mutex::new(histogram()?)],
        bytes_written: AtomicU64::new(0),
        mismatches: AtomicU64::new(0),
        errors: AtomicU64::new(0),
    });
    let mut clients: [Vec<Arc<Client>>; 2] = [Vec::new(), Vec::new()];
    for (i, node) in [&n1, &n2].into_iter().enumerate() {
        for _ in 0..args.connections {
            clients[i].push(Arc::new(Client::connect_tcp(&node.addr, "demo").await?));
        }
    }

    let duration = Duration::from_secs_f64(args.seconds.max(0.1));
    let mix = Mix {
        homes: &[0, 1],
        depth: args.depth,
        read_pct: args.read_pct,
        blocks,
        write_limit: blocks,
        duration,
    };
    let elapsed = workload(&shared, &clients, mix).await?;
    // A flush on either node covers both replicas.
    clients[0][0].flush().await?;
    clients[1][0].flush().await?;
    println!();
    println!(
        "workload: 4 KiB random, {}% reads, both nodes at once, {} connections x {} in flight per node, {:.1} s",
        args.read_pct, args.connections, args.depth, elapsed
    );
    println!(
        "  {:<7} {:>9} {:>9} {:>10} {:>9} {:>9}",
        "node", "reads", "writes", "IOPS", "p50 (us)", "p99 (us)"
    );
    for i in 0..2 {
        let (r, w) = (
            shared.stats[i].reads.load(Ordering::Relaxed),
            shared.stats[i].writes.load(Ordering::Relaxed),
        );
        let h = shared.hist[i].lock();
        println!(
            "  node {:<2} {:>9} {:>9} {:>10.0} {:>9} {:>9}",
            i + 1,
            r,
            w,
            (r + w) as f64 / elapsed,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99)
        );
    }
    let written = shared.bytes_written.load(Ordering::Relaxed);
    println!(
        "  bytes written: {} ({:.1} MiB), each on both replicas",
        written,
        written as f64 / (1 << 20) as f64
    );

    // The headline: the mirror's own speed, from a client that keeps up with it.
    println!();
    let headline = Duration::from_secs_f64(args.headline_seconds.max(0.1));
    let mut headline_ok = true;
    for (writes, node) in [(true, &n1), (false, &n2)] {
        let load = nbd_load::Load {
            depth: args.headline_depth.max(1),
            duration: headline,
            writes,
            blocks,
            seed: rand::random(),
        };
        let cpu0 = vsan_examples::cpu::threads_seconds(NODE_THREADS)?;
        let stream = tokio::net::UnixStream::connect(&node.socket).await?;
        let r = nbd_load::run(stream, "demo", load, &shared.log).await?;
        let cpu = vsan_examples::cpu::threads_seconds(NODE_THREADS)? - cpu0;
        let (what, via) = if writes {
            ("randwrite", "writes through node 1")
        } else {
            ("randread", "reads through node 2")
        };
        let iops = r.ios as f64 / r.elapsed.as_secs_f64();
        let cpu_us = if r.ios > 0 {
            cpu * 1e6 / r.ios as f64
        } else {
            f64::NAN
        };
        println!(
            "headline: 4 KiB random {via}, {} in flight on one connection: {iops:>8.0} IOPS  p50 {} us  p99 {} us  CPU {cpu_us:.1} us per I/O (both nodes)",
            load.depth,
            r.latency.value_at_quantile(0.5),
            r.latency.value_at_quantile(0.99),
        );
        // One line for `vsan-bench nbd --mirror --demo` to read.
        println!(
            "headline {what} iops={iops:.0} p50_us={} p99_us={} cpu_us_per_io={cpu_us:.2} errors={} mismatches={}",
            r.latency.value_at_quantile(0.5),
            r.latency.value_at_quantile(0.99),
            r.errors,
            r.mismatches
        );
        shared.errors.fetch_add(r.errors, Ordering::Relaxed);
        shared.mismatches.fetch_add(r.mismatches, Ordering::Relaxed);
        if writes {
            shared
                .bytes_written
                .fetch_add((r.ios - r.errors) * BLOCK as u64, Ordering::Relaxed);
            shared.stats[0].writes.fetch_add(r.ios, Ordering::Relaxed);
        }
        headline_ok &= r.ios > 0;
    }

    // The failure act: node 2 goes down, node 1 writes alone, node 2 comes back and
    // catches up.
    println!();
    println!("failure act: node 2 goes down; node 1 keeps writing alone");
    for c in std::mem::take(&mut clients[1]) {
        if let Ok(c) = Arc::try_unwrap(c) {
            let _ = c.disconnect().await;
        }
    }
    accepting.abort();
    n2.server.shutdown();
    n2.server.wait_idle().await;
    n2.disk.close().await?;
    let DemoNode {
        disk: disk2,
        serving: serving2,
        serving_unix: serving_unix2,
        ..
    } = n2;
    serving2.await??;
    serving_unix2.await??;
    drop(disk2);
    let mut status = n1.disk.watch_status();
    tokio::time::timeout(
        Duration::from_secs(10),
        status.wait_for(|s| s.link == LinkState::Degraded),
    )
    .await??;
    let alone_before = shared.bytes_written.load(Ordering::Relaxed);
    // Node 1 alone: writes into the first sixteenth of the disk.
    let mix = Mix {
        homes: &[0],
        depth: args.depth,
        read_pct: args.read_pct,
        blocks,
        write_limit: (blocks / 16).max(1),
        duration: duration / 2,
    };
    workload(&shared, &clients, mix).await?;
    clients[0][0].flush().await?;
    let alone = shared.bytes_written.load(Ordering::Relaxed) - alone_before;
    let dirty = n1.disk.status().dirty_chunks;
    println!(
        "  node 1 wrote {:.1} MiB alone; its bitmap marks {dirty} chunks ({:.1} MiB) for node 2",
        alone as f64 / (1 << 20) as f64,
        (dirty * meta::DEFAULT_CHUNK_SIZE) as f64 / (1 << 20) as f64
    );

    println!("  node 2 comes back with its stale replica; resync:");
    let (n2, local2) = start_node(&rt[1], 2, &dir, size, false).await?;
    let (replication, accepting) = accept_for(&rt[1], &transport, &n2.disk).await?;
    dialing.abort();
    let dialing = rt[0].spawn(dial_loop(
        Arc::clone(&transport),
        replication.clone(),
        n1.disk.clone(),
    ));
    let bar = ProgressBar::new(1);
    bar.set_style(ProgressStyle::with_template(
        "  [{bar:40}] {percent:>3}% {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
    )?);
    let resync_started = Instant::now();
    let summary = loop {
        if let Some(p) = n1.disk.sync_progress() {
            bar.set_length(p.total_bytes.max(1));
            bar.set_position(p.done_bytes);
        }
        let s = n1.disk.status();
        if s.link == LinkState::Connected
            && !s.syncing
            && let Some(summary) = s.last_sync.filter(|x| x.completed)
        {
            bar.set_length(summary.total_bytes.max(1));
            bar.set_position(summary.done_bytes);
            break summary;
        }
        if resync_started.elapsed() > Duration::from_secs(120) {
            bar.abandon();
            return Err("the resync did not finish within 120 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    bar.finish();
    println!(
        "  resynced {} bytes ({:.1} MiB) of a {} MiB disk ({:.1}%) in {:.2} s; {} chunks were dirty",
        summary.transferred_bytes,
        summary.transferred_bytes as f64 / (1 << 20) as f64,
        args.size_mib,
        summary.transferred_bytes as f64 * 100.0 / size as f64,
        summary.elapsed.as_secs_f64(),
        dirty
    );
    // Node 2 serves the data node 1 wrote alone.
    let mut served = 0u64;
    let c2 = Client::connect_tcp(&n2.addr, "demo").await?;
    for block in (0..(blocks / 16).max(1)).step_by(97) {
        let got = c2.read(block * BLOCK as u64, BLOCK as u32).await?;
        if got[..] != expected_block(block, shared.log.generation(block))[..] {
            shared.mismatches.fetch_add(1, Ordering::Relaxed);
        }
        served += 1;
    }
    let _ = c2.disconnect().await;
    println!("  node 2 read back {served} blocks node 1 wrote while it was away");

    // Stop both nodes: clients off, NBD servers drained, replicas flushed.
    for c in clients.into_iter().flatten() {
        if let Ok(c) = Arc::try_unwrap(c) {
            let _ = c.disconnect().await;
        }
    }
    for node in [&n1, &n2] {
        node.server.shutdown();
        node.server.wait_idle().await;
    }
    dialing.abort();
    accepting.abort();
    for (node, local) in [(n1, local1), (n2, local2)] {
        node.serving.await??;
        node.serving_unix.await??;
        let _ = std::fs::remove_file(&node.socket);
        local.flush().await?;
        node.disk.close().await?;
        drop(node.disk);
    }

    // Compare the replicas and check every block against what was acknowledged.
    let img = [dir.join("node1.img"), dir.join("node2.img")];
    let mut crc = [crc32fast::Hasher::new(), crc32fast::Hasher::new()];
    let files = [
        FileOptions::new().open(&img[0])?,
        FileOptions::new().open(&img[1])?,
    ];
    let (mut differ, mut bad, mut checked) = (0u64, 0u64, 0u64);
    const SPAN: u64 = 1 << 20;
    for start in (0..size).step_by(SPAN as usize) {
        let a = files[0].read(start, SPAN as usize).await?;
        let b = files[1].read(start, SPAN as usize).await?;
        crc[0].update(&a);
        crc[1].update(&b);
        for (i, (ca, cb)) in a.chunks(BLOCK).zip(b.chunks(BLOCK)).enumerate() {
            let block = start / BLOCK as u64 + i as u64;
            let generation = shared.log.generation(block);
            if ca != cb {
                differ += 1;
            }
            if generation > 0 {
                checked += 1;
            }
            if ca != &expected_block(block, generation)[..] {
                bad += 1;
            }
        }
    }
    let [c1, c2] = crc.map(|h| h.finalize());
    println!("replica node 1: {}  crc32 {c1:08x}", img[0].display());
    println!("replica node 2: {}  crc32 {c2:08x}", img[1].display());
    let live = shared.mismatches.load(Ordering::Relaxed);
    let errors = shared.errors.load(Ordering::Relaxed);
    println!(
        "verify: replicas {} ({differ} blocks differ); {checked} written blocks checked ({bad} wrong); \
         {live} read mismatches; {errors} I/O errors",
        if differ == 0 { "identical" } else { "DIFFER" }
    );
    let total_writes: u64 = (0..2)
        .map(|i| shared.stats[i].writes.load(Ordering::Relaxed))
        .sum();
    let ok = differ == 0
        && c1 == c2
        && bad == 0
        && live == 0
        && errors == 0
        && total_writes > 0
        && headline_ok;
    println!(
        "{}",
        if ok {
            "vsan-demo: OK"
        } else {
            "vsan-demo: FAILED"
        }
    );
    Ok(ok)
}
