//! `vsan-bench`: whole-system benchmarks, always side by side with a baseline measured in
//! the same run.
//!
//! `vsan-bench nbd` runs fio's nbd engine (4 KiB random reads and writes, iodepth 32,
//! over a Unix socket) against `vsan-node`, nbdkit's file plugin and `qemu-nbd -f raw -t`,
//! each exporting the same kind of file (a filled one for reads, a fresh sparse one for
//! writes), alternating the servers within
//! each round so drift on a noisy machine hits all of them alike. It prints IOPS, p50/p99
//! completion latency, the CPU time (user + system, from `/proc/<pid>/stat`) of every
//! server process per completed I/O (both nodes summed for a mirror), and each server's
//! ratio to nbdkit. With `--mirror` it measures a mirrored pair beside a single
//! `vsan-node` and nbdkit, and with `--demo` also runs `vsan-demo` once per round and
//! sets its headline beside fio's mirrored figures of the same round. `--only` and
//! `--workloads` narrow a run (for profiling one server). A server whose program is not
//! installed is reported as missing, not silently dropped.
//!
//! `vsan-bench scaling` measures how a single node and a mirrored pair scale with cores:
//! each `vsan-node` pinned to a core set of its own, driven by the project's own NBD
//! client (no fio) on further cores, IOPS and CPU per I/O at each core count.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use vsan_examples::{
    cache_bench, ffi_bench, iscsi_bench, latency, median, resync_bench, transport_bench,
};

#[derive(Parser, Debug)]
#[command(version, about = "vsan benchmarks against the tools users run today")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Options of `vsan-bench nbd`.
#[derive(clap::Args, Debug)]
struct NbdArgs {
    /// Seconds per fio run.
    #[arg(long, default_value_t = 20)]
    seconds: u32,
    /// Rounds (each round runs every server once per workload, in rotating order).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Size of the exported file in MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// fio iodepth.
    #[arg(long, default_value_t = 32)]
    iodepth: u32,
    /// Work directory (default: target/vsan-bench).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Path of vsan-node (default: next to this binary).
    #[arg(long)]
    vsan_node: Option<PathBuf>,
    /// Measure a mirrored disk (two vsan-node processes on this machine, node 1
    /// exporting) beside a single vsan-node and nbdkit on one plain file, instead of
    /// the three servers.
    #[arg(long)]
    mirror: bool,
    /// `node.threads` for each vsan-node (default: the node's own default).
    #[arg(long)]
    node_threads: Option<usize>,
    /// Only these servers (mirror, single, nbdkit, qemu-nbd).
    #[arg(long)]
    only: Vec<String>,
    /// Only these workloads (randwrite, randread).
    #[arg(long)]
    workloads: Vec<String>,
    /// Also run `vsan-demo` once per round (its headline runs as long as fio's) and set
    /// its headline IOPS beside fio's through the mirrored pair of the same round.
    #[arg(long)]
    demo: bool,
}

/// Options of `vsan-bench scaling`.
#[derive(clap::Args, Debug)]
struct ScalingArgs {
    /// Cores per server process at each point (each vsan-node gets `node.threads` of
    /// that many workers, pinned to a set of that many cores; the client gets as many
    /// cores again where the machine has them, and shares the nodes' otherwise).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16])]
    cores: Vec<usize>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Requests in flight per client connection.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// Client connections per server core.
    #[arg(long, default_value_t = 2)]
    connections_per_core: usize,
    /// Size of the exported disk in MiB.
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    #[command(flatten)]
    paths: BenchPaths,
    /// Only these servers (single, mirror) and workloads (randwrite, randread).
    #[arg(long)]
    only: Vec<String>,
}

/// Where a benchmark works and which `vsan-node` it runs.
#[derive(clap::Args, Debug)]
struct BenchPaths {
    /// Work directory (default: target/vsan-bench).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Path of vsan-node (default: next to this binary).
    #[arg(long)]
    vsan_node: Option<PathBuf>,
}

/// Options of `vsan-bench vhost`.
#[derive(clap::Args, Debug)]
struct VhostArgs {
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Rounds (each round runs every case once per workload, in rotating order).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Disk size in MiB.
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// Queue depth of the deep runs.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// Work directory (default: target/vsan-bench).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Path of vsan-node (default: next to this binary).
    #[arg(long)]
    vsan_node: Option<PathBuf>,
    /// Only these cases (vsan, qsd, vsan-mem, qsd-null, vsan-poll, vsan-nbd).
    #[arg(long)]
    only: Vec<String>,
}

/// Options of `vsan-bench iscsi`.
#[derive(clap::Args, Debug)]
struct IscsiArgs {
    /// Seconds per read run.
    #[arg(long, default_value_t = 20)]
    seconds: u32,
    /// Writes per write run (at most the disk's size in 4 KiB blocks).
    #[arg(long, default_value_t = 200_000)]
    write_count: u64,
    /// Rounds (each round runs every case once per workload, in rotating order).
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Size of the exported file in MiB.
    #[arg(long, default_value_t = 1024)]
    size_mib: u64,
    /// Commands in flight.
    #[arg(long, default_value_t = 32)]
    depth: u32,
    /// Work directory (default: target/vsan-bench).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Path of vsan-node (default: next to this binary).
    #[arg(long)]
    vsan_node: Option<PathBuf>,
    /// Also a mirrored disk (two vsan-node processes on this machine): through node 1, and
    /// through both nodes' targets at once (`vsan-mirror-2paths`).
    #[arg(long)]
    mirror: bool,
    /// Only the cases whose name contains one of these words (tgtd, vsan, nbd, mirror).
    #[arg(long)]
    only: Vec<String>,
    /// `node.threads` for each vsan-node (default: the node's own default).
    #[arg(long)]
    node_threads: Option<usize>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Replication transports through MirroredDisk (in-memory replicas): QD1 4 KiB
    /// write p50/p99, QD32 IOPS and CPU for tcp, tcp with 4 lanes, quic, loopback over
    /// shared memory (with and without busy-poll) and in-process loopback.
    Transport {
        /// QD1 writes per case per round.
        #[arg(long, default_value_t = 20000)]
        count: u32,
        /// Seconds at QD32 per case per round.
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Rounds (cases in rotating order).
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Busy-poll budget of the busy-poll cases, microseconds.
        #[arg(long, default_value_t = 50)]
        busy_poll_us: u64,
        /// Work directory (default: target/vsan-bench).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Only the cases whose name contains one of these words.
        #[arg(long)]
        only: Vec<String>,
        /// Runtime worker threads per node process (1: client and mirror share one
        /// thread, so only the link crosses threads).
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// Node 2 of `vsan-bench transport`, in its own process (started by it).
    #[command(hide = true)]
    TransportPeer {
        #[arg(long)]
        kind: String,
        #[arg(long)]
        listen: String,
        #[arg(long, default_value_t = 0)]
        busy_poll_us: u64,
        #[arg(long)]
        cert_dir: PathBuf,
        #[arg(long)]
        pin: Option<String>,
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// fio 4K randread/randwrite over NBD: vsan-node vs nbdkit vs qemu-nbd.
    Nbd(NbdArgs),
    /// How IOPS and CPU per I/O scale with cores: a single vsan-node and a mirrored pair,
    /// each node on a core set of its own, driven over NBD by this program's own client
    /// on cores of its own (needs no fio: for a machine with many cores and nothing
    /// installed).
    Scaling(ScalingArgs),
    /// 4 KiB random READ(16) (iscsi-perf) and 4 KiB writes (qemu-img bench) at depth 32
    /// over iSCSI: vsan-node vs tgtd on the same kind of file, and vsan-node's NBD export
    /// of the same disk (fio nbd engine).
    Iscsi(IscsiArgs),
    /// 4 KiB random read and write at QD1 and QD32 through libblkio's vhost-user-blk
    /// driver: vsan-node's vhost-user export vs qemu-storage-daemon's (a file; RAM), and
    /// vs vsan-node's NBD export of the same disk (fio nbd engine); busy-poll on and off.
    Vhost(VhostArgs),
    /// QD1 4 KiB write latency: a local file, the same kind of file mirrored over TCP
    /// loopback, and a bare TCP ping-pong of the same sizes, in one run.
    Latency {
        /// Writes (and ping-pongs) per measurement.
        #[arg(long, default_value_t = 20000)]
        count: u32,
        /// Rounds, alternating the three measurements.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Work directory (default: target/vsan-bench).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Both nodes, the writer and the ping-pong on one thread (CPU work only; the two
        /// replicas' writes cannot overlap), instead of a thread per node.
        #[arg(long)]
        one_runtime: bool,
    },
    /// Resync throughput against a plain copy of the same bytes between the same files,
    /// and application 4 KiB randwrite IOPS during a dynamic-rate resync against in sync.
    Resync {
        /// Disk size in MiB.
        #[arg(long, default_value_t = 1024)]
        size_mib: u64,
        /// MiB written while the partner is away (throughput part).
        #[arg(long, default_value_t = 512)]
        dirty_mib: u64,
        /// Seconds per IOPS measurement.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Application queue depth.
        #[arg(long, default_value_t = 16)]
        depth: usize,
        /// Rounds.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Work directory (default: target/vsan-bench).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// O_DIRECT replicas and baseline copy (disk-bound, not page-cache-bound).
        #[arg(long)]
        direct: bool,
    },
    /// The C ABI's cost per operation: 4 KiB reads of one RAM disk through the Rust API
    /// and through the C functions (blocking and asynchronous submit), QD1 and QD32.
    Ffi {
        /// Reads per case per round.
        #[arg(long, default_value_t = 200_000)]
        count: u32,
        /// Rounds (cases in rotating order).
        #[arg(long, default_value_t = 5)]
        rounds: u32,
        /// Disk size in MiB.
        #[arg(long, default_value_t = 256)]
        size_mib: u64,
        /// Worker threads of the node's runtime.
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// The write-back cache (fast device: a mapped file on tmpfs) against its backing
    /// file alone with durable writes: QD1 latency, the cache's software overhead, QD32
    /// IOPS, single-thread read IOPS, and QD1 latency while destaging (paced and not).
    Cache {
        /// Seconds of each throughput measurement (and the most a QD1 run on the backing
        /// file alone takes per round).
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
        /// Rounds of the QD1 and QD32 comparisons.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// QD1 writes per path per round.
        #[arg(long, default_value_t = 20000)]
        count: u32,
        /// Fast device size in MiB.
        #[arg(long, default_value_t = 1024)]
        cache_mib: u64,
        /// Fast device size in MiB of the steady-state (destage-limited) figures.
        #[arg(long, default_value_t = 64)]
        small_cache_mib: u64,
        /// Backing file size in MiB.
        #[arg(long, default_value_t = 1024)]
        backing_mib: u64,
        /// Queue depth of the throughput comparison.
        #[arg(long, default_value_t = 32)]
        depth: usize,
        /// Work directory of the backing file, on a real disk (default: target/vsan-bench).
        #[arg(long)]
        work_dir: Option<PathBuf>,
        /// Directory of the fast device files (tmpfs, standing in for persistent memory).
        #[arg(long, default_value = "/dev/shm")]
        shm_dir: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServerKind {
    Vsan,
    VsanMirror,
    Nbdkit,
    QemuNbd,
}

impl ServerKind {
    /// The word `--only` knows it by.
    fn key(self) -> &'static str {
        match self {
            ServerKind::Vsan => "single",
            ServerKind::VsanMirror => "mirror",
            ServerKind::Nbdkit => "nbdkit",
            ServerKind::QemuNbd => "qemu-nbd",
        }
    }

    fn name(self) -> &'static str {
        match self {
            ServerKind::Vsan => "vsan-node",
            ServerKind::VsanMirror => "vsan-node mirrored",
            ServerKind::Nbdkit => "nbdkit file",
            ServerKind::QemuNbd => "qemu-nbd",
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Sample {
    iops: Vec<f64>,
    p50_us: Vec<f64>,
    p99_us: Vec<f64>,
    /// Server CPU microseconds per completed I/O.
    cpu_us: Vec<f64>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.cmd {
        Cmd::Transport {
            count,
            seconds,
            rounds,
            busy_poll_us,
            work_dir,
            only,
            threads,
        } => transport_bench::run(transport_bench::Opts {
            threads,
            count,
            seconds,
            rounds,
            busy_poll: Duration::from_micros(busy_poll_us),
            dir: work_dir.unwrap_or_else(default_dir),
            only,
        })
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::TransportPeer {
            kind,
            listen,
            busy_poll_us,
            cert_dir,
            pin,
            threads,
        } => transport_bench::peer(
            &kind,
            &listen,
            busy_poll_us,
            &cert_dir,
            pin.as_deref(),
            threads,
        )
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::Nbd(args) => nbd_bench(args),
        Cmd::Scaling(args) => scaling_bench(args),
        Cmd::Vhost(a) => vsan_examples::vhost_bench::run(vsan_examples::vhost_bench::Opts {
            seconds: a.seconds,
            rounds: a.rounds,
            size_mib: a.size_mib,
            depth: a.depth,
            dir: a.work_dir.unwrap_or_else(default_dir),
            vsan_node: a.vsan_node.unwrap_or_else(|| exe_dir().join("vsan-node")),
            only: a.only,
        })
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::Iscsi(a) => iscsi_bench::run(iscsi_bench::Opts {
            seconds: a.seconds,
            write_count: a.write_count,
            rounds: a.rounds,
            size_mib: a.size_mib,
            depth: a.depth,
            dir: a.work_dir.unwrap_or_else(default_dir),
            vsan_node: a.vsan_node.unwrap_or_else(|| exe_dir().join("vsan-node")),
            mirror: a.mirror,
            only: a.only,
            node_threads: a.node_threads,
        })
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::Latency {
            count,
            rounds,
            work_dir,
            one_runtime,
        } => latency::run(
            count,
            rounds,
            work_dir.unwrap_or_else(default_dir),
            one_runtime,
        )
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::Resync {
            size_mib,
            dirty_mib,
            seconds,
            depth,
            rounds,
            work_dir,
            direct,
        } => resync_bench::run(resync_bench::Opts {
            direct,
            size_mib,
            dirty_mib,
            seconds,
            depth,
            rounds,
            dir: work_dir.unwrap_or_else(default_dir),
        })
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::Ffi {
            count,
            rounds,
            size_mib,
            threads,
        } => ffi_bench::run(ffi_bench::Opts {
            count,
            rounds,
            size_mib,
            threads,
        })
        .map_err(|e| -> BoxError { e.to_string().into() }),
        Cmd::Cache {
            seconds,
            rounds,
            count,
            cache_mib,
            small_cache_mib,
            backing_mib,
            depth,
            work_dir,
            shm_dir,
        } => cache_bench::run(cache_bench::Opts {
            seconds,
            rounds,
            count,
            cache_mib,
            small_cache_mib,
            backing_mib,
            depth,
            dir: work_dir.unwrap_or_else(default_dir),
            shm_dir,
        })
        .map_err(|e| -> BoxError { e.to_string().into() }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vsan-bench: {e}");
            ExitCode::from(1)
        }
    }
}

/// What the scaling bench's client runs at one point.
#[derive(Debug, Clone, Copy)]
struct ClientLoad {
    connections: usize,
    /// Requests in flight per connection.
    depth: usize,
    seconds: f64,
    writes: bool,
    /// Blocks of the disk.
    blocks: u64,
}

/// One point of the scaling curve.
#[derive(Debug, Clone, Copy)]
struct ScalePoint {
    iops: f64,
    /// The server processes' CPU (user + system) per completed I/O, microseconds.
    cpu_us: f64,
    p50_us: u64,
    p99_us: u64,
}

/// Drive `sock` with `load.connections` NBD clients ([`vsan_examples::nbd_load`]) of
/// `load.depth` requests in flight each for `load.seconds`, on a runtime of one worker
/// per core of `client_cpus`, pinned there; `server`'s CPU is read over the same window.
/// Reads are checked against what was written (nothing: a fresh disk reads as zeroes).
fn scale_load(
    sock: &Path,
    server: &Running,
    client_cpus: &[usize],
    load: ClientLoad,
) -> Result<ScalePoint, BoxError> {
    use vsan_examples::nbd_load;
    let ClientLoad {
        connections,
        depth,
        seconds,
        writes,
        blocks,
    } = load;
    let set = cpu_set(client_cpus);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_cpus.len().max(1))
        .on_thread_start(move || {
            // (Unpinned, the client still runs; the table says where it ran.)
            let _ = rustix::thread::sched_setaffinity(None, &set);
        })
        .enable_all()
        .build()?;
    let log = std::sync::Arc::new(vsan_examples::pattern::BlockLog::new(blocks));
    rt.block_on(async {
        let mut streams = Vec::with_capacity(connections);
        for _ in 0..connections {
            streams.push(tokio::net::UnixStream::connect(sock).await?);
        }
        let cpu0 = server.cpu()?;
        let t0 = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for (i, stream) in streams.into_iter().enumerate() {
            let log = std::sync::Arc::clone(&log);
            let load = nbd_load::Load {
                depth,
                duration: Duration::from_secs_f64(seconds),
                writes,
                blocks,
                seed: rand::random::<u64>() ^ i as u64,
            };
            tasks.spawn(async move { nbd_load::run(stream, "", load, &log).await });
        }
        let mut latency = hdrhistogram::Histogram::<u64>::new(3)?;
        let (mut ios, mut failed) = (0u64, 0u64);
        while let Some(r) = tasks.join_next().await {
            let r = r??;
            ios += r.ios;
            failed += r.errors + r.mismatches;
            latency.add(&r.latency)?;
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let cpu = server.cpu()? - cpu0;
        if failed > 0 {
            return Err(format!("{failed} requests failed or read wrong data").into());
        }
        if ios == 0 {
            return Err("no request completed".into());
        }
        Ok(ScalePoint {
            iops: ios as f64 / elapsed,
            cpu_us: cpu / ios as f64 * 1e6,
            p50_us: latency.value_at_quantile(0.5),
            p99_us: latency.value_at_quantile(0.99),
        })
    })
}

/// `vsan-bench scaling`: IOPS and CPU per I/O of one node and of a mirrored pair at
/// each core count, every process on cores of its own where the machine has them.
fn scaling_bench(args: ScalingArgs) -> Result<(), BoxError> {
    let ScalingArgs {
        cores,
        seconds,
        depth,
        connections_per_core,
        size_mib,
        paths,
        only,
    } = args;
    let dir = paths.work_dir.unwrap_or_else(default_dir);
    std::fs::create_dir_all(&dir)?;
    let vsan_node = paths
        .vsan_node
        .unwrap_or_else(|| exe_dir().join("vsan-node"));
    let size = size_mib << 20;
    let blocks = size / vsan_examples::pattern::BLOCK as u64;
    if let Some(w) = only
        .iter()
        .find(|w| !["single", "mirror", "randwrite", "randread"].contains(&w.as_str()))
    {
        return Err(format!(
            "--only {w:?}: not a server (single, mirror) or a workload (randwrite, randread)"
        )
        .into());
    }
    let cpus = allowed_cpus()?;
    let n = cpus.len();
    let kinds: Vec<(ServerKind, &str, usize)> = [
        (ServerKind::Vsan, "single", 1),
        (ServerKind::VsanMirror, "mirror", 2),
    ]
    .into_iter()
    .filter(|(_, key, _)| {
        !only.iter().any(|o| o == "single" || o == "mirror") || only.iter().any(|o| o == key)
    })
    .collect();
    let workloads: Vec<&str> = ["randwrite", "randread"]
        .into_iter()
        .filter(|w| !only.iter().any(|o| o.starts_with("rand")) || only.iter().any(|o| o == w))
        .collect();
    if kinds.is_empty() || workloads.is_empty() {
        return Err(format!("--only {only:?} leaves nothing to run").into());
    }
    println!(
        "{n} cores here; 4 KiB random I/O over NBD (Unix socket), {connections_per_core} connections x {depth} in flight per server core, {seconds} s per point, {size_mib} MiB disk"
    );
    let image = dir.join("bench-scaling.img");
    let mut rows = Vec::new();
    for &(kind, key, nodes) in &kinds {
        for &k in &cores {
            if k == 0 || k * nodes > n {
                println!(
                    "{key} at {k} cores per node: not run ({} cores needed for the node sets, {n} here)",
                    k * nodes
                );
                continue;
            }
            let node_cpus = NodeCpus {
                node1: cpus[..k].to_vec(),
                node2: if nodes == 2 {
                    cpus[k..2 * k].to_vec()
                } else {
                    Vec::new()
                },
            };
            let free = &cpus[k * nodes..];
            let (client, shared) = if free.is_empty() {
                (cpus.clone(), true)
            } else {
                (free[..k.min(free.len())].to_vec(), false)
            };
            let mut figures = Vec::new();
            for &w in &workloads {
                let _ = std::fs::remove_file(&image);
                std::fs::File::create(&image)?.set_len(size)?;
                let (server, sock) =
                    start(kind, &dir, &image, size, &vsan_node, Some(k), &node_cpus)?;
                let on = server.cpus_allowed().join(" and ");
                let load = ClientLoad {
                    connections: k * connections_per_core,
                    depth,
                    seconds,
                    writes: w == "randwrite",
                    blocks,
                };
                let p = scale_load(&sock, &server, &client, load)?;
                drop(server);
                println!(
                    "{key:<6} {k:>2} cores/node (on cpus {on})  client {:>2} cores{}  {w:<9} {:>9.0} IOPS  p50 {:>6} us  p99 {:>6} us  CPU {:>5.1} us/IO",
                    client.len(),
                    if shared { " (shared)" } else { "" },
                    p.iops,
                    p.p50_us,
                    p.p99_us,
                    p.cpu_us
                );
                figures.push((w, p));
            }
            rows.push((key, k, client.len(), shared, figures));
        }
    }
    println!();
    print!("| server | cores per node | client cores |");
    for w in &workloads {
        print!(" {w} IOPS | x first row | CPU us/IO |");
    }
    println!();
    print!("|---|---:|---:|");
    for _ in &workloads {
        print!("---:|---:|---:|");
    }
    println!();
    for (key, k, client, shared, figures) in &rows {
        print!(
            "| {key} | {k} | {client}{} |",
            if *shared { " (shared)" } else { "" }
        );
        for (w, p) in figures {
            let base = rows
                .iter()
                .find(|r| r.0 == *key)
                .and_then(|r| r.4.iter().find(|(bw, _)| bw == w))
                .map_or(f64::NAN, |(_, b)| p.iops / b.iops);
            print!(" {:.0} | {base:.2}x | {:.1} |", p.iops, p.cpu_us);
        }
        println!();
    }
    Ok(())
}

type BoxError = Box<dyn std::error::Error>;

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

fn exe_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default()
}

/// Fill `path` with `size` bytes of non-zero data so reads hit real extents, not holes.
fn fill(path: &Path, size: u64) -> Result<(), BoxError> {
    let mut f = std::fs::File::create(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in buf.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    for _ in 0..size >> 20 {
        f.write_all(&buf)?;
    }
    f.sync_all()?;
    Ok(())
}

struct Running {
    children: Vec<Child>,
}

impl Running {
    /// The cores each of the server's processes may run on, as the kernel lists them
    /// (`Cpus_allowed_list`), node 1 first.
    fn cpus_allowed(&self) -> Vec<String> {
        self.children
            .iter()
            .map(|c| {
                std::fs::read_to_string(format!("/proc/{}/status", c.id()))
                    .ok()
                    .and_then(|st| {
                        st.lines()
                            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                            .map(|v| v.trim().to_string())
                    })
                    .unwrap_or_else(|| "?".into())
            })
            .collect()
    }

    /// CPU seconds (user + system) the server's processes have used so far.
    fn cpu(&self) -> std::io::Result<f64> {
        self.children
            .iter()
            .map(|c| vsan_examples::cpu::process_seconds(c.id()))
            .sum()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        vsan_examples::terminate_children(&mut self.children);
    }
}

fn default_dir() -> PathBuf {
    vsan_examples::target_work_dir("vsan-bench")
}

/// A free loopback port (bound, read, released: a benchmark tool can live with the race).
fn free_port() -> Result<u16, BoxError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Read node 1's report lines until its first resync is done (then keep draining them
/// in the background so the node never blocks on a full pipe).
fn wait_for_sync(child: &mut Child) -> Result<(), BoxError> {
    use std::io::BufRead;
    let out = child.stdout.take().ok_or("node 1's stdout is not piped")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if line.starts_with("sync disk=bench done") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(300))
        .map_err(|_| "the mirrored disk's first resync did not finish within 300 s".into())
}

fn wait_for_socket(sock: &Path, child: &mut Child) -> Result<(), BoxError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        // The socket file appears once the server listens. (Probing with a connection
        // would make servers log a failed handshake.)
        if sock.exists() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            return Err(format!("server exited early: {status}").into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("server did not listen on {} in time", sock.display()).into())
}

/// The cores each node process may run on (empty: anywhere).
#[derive(Debug, Default)]
struct NodeCpus {
    /// The single node, or node 1 of a pair.
    node1: Vec<usize>,
    /// Node 2 of a pair.
    node2: Vec<usize>,
}

/// Make the process `cmd` starts (and every thread it creates) run only on `cpus`;
/// nothing where `cpus` is empty.
fn pin(cmd: &mut Command, cpus: &[usize]) {
    use std::os::unix::process::CommandExt;
    if cpus.is_empty() {
        return;
    }
    let set = cpu_set(cpus);
    // SAFETY: the closure runs in the child between fork and exec; it makes one system
    // call (sched_setaffinity) on a set built before the fork, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            rustix::thread::sched_setaffinity(None, &set).map_err(std::io::Error::from)
        });
    }
}

/// `cpus` as the kernel's CPU set.
fn cpu_set(cpus: &[usize]) -> rustix::thread::CpuSet {
    let mut set = rustix::thread::CpuSet::new();
    for &c in cpus {
        set.set(c);
    }
    set
}

/// The cores this process may run on, in order.
fn allowed_cpus() -> Result<Vec<usize>, BoxError> {
    let set = rustix::thread::sched_getaffinity(None)?;
    Ok((0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect())
}

fn start(
    kind: ServerKind,
    dir: &Path,
    image: &Path,
    size: u64,
    vsan_node: &Path,
    node_threads: Option<usize>,
    cpus: &NodeCpus,
) -> Result<(Running, PathBuf), BoxError> {
    let sock = dir.join(format!("{}.sock", kind.name().replace(' ', "-")));
    let _ = std::fs::remove_file(&sock);
    let mut extra = Vec::new();
    let mut cmd = match kind {
        ServerKind::Vsan => {
            let cfg = dir.join("node.toml");
            std::fs::write(
                &cfg,
                format!(
                    "[node]\nid = 1\ndata_dir = {:?}\n\n[[disk]]\nname = \"bench\"\nsize = {size}\npath = {:?}\nnbd = \"unix:{}\"\n",
                    dir.display().to_string(),
                    image.display().to_string(),
                    sock.display()
                ),
            )?;
            let mut c = Command::new(vsan_node);
            c.arg("--config").arg(cfg).env("RUST_LOG", "warn");
            c
        }
        ServerKind::VsanMirror => {
            // Node 2 holds the second replica (a copy of the same file) and accepts the
            // link; node 1 dials it and exports the disk.
            let peer_image = dir.join("bench-peer.img");
            let _ = std::fs::remove_file(&peer_image);
            if std::fs::metadata(image)?.blocks() == 0 {
                std::fs::File::create(&peer_image)?.set_len(size)?;
            } else {
                std::fs::copy(image, &peer_image)?;
            }
            let port = free_port()?;
            let threads = node_threads.map_or(String::new(), |n| format!("threads = {n}\n"));
            // Each node keeps its metadata in its own data_dir, fresh for every run.
            let (dir1, dir2) = (dir.join("node1"), dir.join("node2"));
            for d in [&dir1, &dir2] {
                let _ = std::fs::remove_dir_all(d);
                std::fs::create_dir_all(d)?;
            }
            let disk = |peer: u32, path: &Path, nbd: &str| {
                format!(
                    "[[peer]]\nid = {peer}\naddress = \"127.0.0.1:{port}\"\n\n[[disk]]\nname = \"bench\"\nsize = {size}\npath = {:?}\npeer = {peer}\n{nbd}",
                    path.display().to_string()
                )
            };
            let cfg2 = dir.join("node2.toml");
            std::fs::write(
                &cfg2,
                format!(
                    "[node]\nid = 2\ndata_dir = {:?}\nlisten = \"127.0.0.1:{port}\"\n{threads}\n{}",
                    dir2.display().to_string(),
                    disk(1, &peer_image, "")
                ),
            )?;
            let mut c2 = Command::new(vsan_node);
            pin(&mut c2, &cpus.node2);
            let node2 = c2
                .arg("--config")
                .arg(&cfg2)
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()?;
            let cfg1 = dir.join("node1.toml");
            std::fs::write(
                &cfg1,
                format!(
                    "[node]\nid = 1\ndata_dir = {:?}\n{threads}\n{}",
                    dir1.display().to_string(),
                    disk(2, image, &format!("nbd = \"unix:{}\"\n", sock.display()))
                ),
            )?;
            let mut c = Command::new(vsan_node);
            c.arg("--config").arg(cfg1).env("RUST_LOG", "warn");
            extra.push(node2);
            c
        }
        ServerKind::Nbdkit => {
            let mut c = Command::new("nbdkit");
            c.args(["-f", "-U"]).arg(&sock).arg("file").arg(image);
            c
        }
        ServerKind::QemuNbd => {
            let mut c = Command::new("qemu-nbd");
            c.args(["-f", "raw", "-t", "-k"]).arg(&sock).arg(image);
            c
        }
    };
    let mirrored = kind == ServerKind::VsanMirror;
    pin(&mut cmd, &cpus.node1);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(if mirrored {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(Stdio::inherit())
        .spawn()?;
    wait_for_socket(&sock, &mut child)?;
    if mirrored {
        // The two fresh replicas compare every chunk first: measure after that.
        wait_for_sync(&mut child)?;
    }
    let mut children = vec![child];
    children.extend(extra);
    Ok((Running { children }, sock))
}

/// Run `vsan-demo` (beside this binary) with headline runs of `seconds` at `depth` on a
/// disk of `size_mib`, and read its headline lines: (workload, figures).
fn run_demo(
    dir: &Path,
    seconds: u32,
    depth: u32,
    size_mib: u64,
) -> Result<Vec<(&'static str, FioRun)>, BoxError> {
    let out = Command::new(exe_dir().join("vsan-demo"))
        .args(["--seconds", "2", "--headline-seconds"])
        .arg(seconds.to_string())
        .arg("--headline-depth")
        .arg(depth.to_string())
        .arg("--size-mib")
        .arg(size_mib.to_string())
        .arg("--work-dir")
        .arg(dir.join("demo"))
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        return Err(format!("vsan-demo failed ({})", out.status).into());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut runs = Vec::new();
    for w in ["randwrite", "randread"] {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("headline {w} ")))
            .ok_or_else(|| format!("vsan-demo printed no headline {w} line"))?;
        let field = |k: &str| -> Result<f64, BoxError> {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("no {k} in vsan-demo's headline {w} line: {line}").into())
        };
        runs.push((
            w,
            FioRun {
                iops: field("iops")?,
                p50: field("p50_us")?,
                p99: field("p99_us")?,
                cpu_us: field("cpu_us_per_io")?,
            },
        ));
    }
    Ok(runs)
}

/// What one fio run measured: IOPS, p50 and p99 completion latency (us), and the
/// server's CPU microseconds per I/O over fio's measured window.
#[derive(Debug, Clone)]
struct FioRun {
    iops: f64,
    p50: f64,
    p99: f64,
    cpu_us: f64,
}

const RAMP_SECONDS: u64 = 2;

fn fio(
    sock: &Path,
    rw: &str,
    seconds: u32,
    iodepth: u32,
    size: u64,
    server: &Running,
) -> Result<FioRun, BoxError> {
    let child = Command::new("fio")
        .args([
            "--name=bench",
            "--ioengine=nbd",
            &format!("--uri=nbd+unix:///?socket={}", sock.display()),
            &format!("--rw={rw}"),
            "--bs=4k",
            &format!("--iodepth={iodepth}"),
            &format!("--size={size}"),
            "--time_based",
            &format!("--runtime={seconds}"),
            &format!("--ramp_time={RAMP_SECONDS}"),
            "--norandommap",
            "--randrepeat=0",
            "--output-format=json",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // fio counts the I/Os after its ramp; the server's CPU is read over the same window
    // (fio's start-up is well under the ramp, and it exits at the end of its runtime).
    std::thread::sleep(Duration::from_secs(RAMP_SECONDS));
    let cpu0 = server.cpu()?;
    let out = child.wait_with_output()?;
    let cpu = server.cpu()? - cpu0;
    let side = if rw.contains("read") { "read" } else { "write" };
    let f = iscsi_bench::parse_fio_output(&out, side)?;
    Ok(FioRun {
        iops: f.iops,
        p50: f.p50_us.unwrap_or(f64::NAN),
        p99: f.p99_us.unwrap_or(f64::NAN),
        cpu_us: if f.ios > 0.0 {
            cpu / f.ios * 1e6
        } else {
            f64::NAN
        },
    })
}

fn nbd_bench(args: NbdArgs) -> Result<(), BoxError> {
    let NbdArgs {
        seconds,
        rounds,
        size_mib,
        iodepth,
        work_dir,
        vsan_node,
        mirror,
        node_threads,
        only,
        workloads: wanted,
        demo,
    } = args;
    if !have("fio") {
        return Err("fio is not installed (apt-get install fio)".into());
    }
    let dir = work_dir.unwrap_or_else(default_dir);
    std::fs::create_dir_all(&dir)?;
    let vsan_node = vsan_node.unwrap_or_else(|| exe_dir().join("vsan-node"));
    let (mut kinds, others) = if mirror {
        (
            vec![ServerKind::VsanMirror, ServerKind::Vsan],
            vec![(ServerKind::Nbdkit, "nbdkit")],
        )
    } else {
        (
            vec![ServerKind::Vsan],
            vec![
                (ServerKind::Nbdkit, "nbdkit"),
                (ServerKind::QemuNbd, "qemu-nbd"),
            ],
        )
    };
    for (k, tool) in others {
        if have(tool) {
            kinds.push(k);
        } else {
            println!(
                "note: {tool} is not installed; {} is left out of this run",
                k.name()
            );
        }
    }
    kinds.retain(|k| only.is_empty() || only.iter().any(|w| k.key() == w));
    if kinds.is_empty() {
        return Err(format!("no server matches --only {only:?}").into());
    }
    let size = size_mib << 20;
    // Reads go to a file filled once with data (clean pages in the page cache). Writes go
    // to a fresh sparse file per run: rewriting clean, already-synced pages costs the
    // kernel several times more than the servers' own work, and how many of them a run
    // meets would depend on what ran before it.
    let read_image = dir.join("bench-read.img");
    let write_image = dir.join("bench-write.img");
    let workloads: Vec<&str> = ["randwrite", "randread"]
        .into_iter()
        .filter(|w| wanted.is_empty() || wanted.iter().any(|x| x == w))
        .collect();
    if workloads.is_empty() {
        return Err(format!("no workload matches --workloads {wanted:?}").into());
    }
    if workloads.contains(&"randread") {
        println!("filling {} ({size_mib} MiB)...", read_image.display());
        fill(&read_image, size)?;
    }
    let mut results: Vec<(ServerKind, &str, Sample)> = Vec::new();
    for &k in &kinds {
        for &w in &workloads {
            results.push((k, w, Sample::default()));
        }
    }
    let mut demos: Vec<(u32, &str, FioRun, FioRun)> = Vec::new();
    for round in 0..rounds {
        let mut mirrored_this_round: Vec<(&str, f64, f64)> = Vec::new();
        // Rotate the order each round so no server always runs first (or last).
        let mut order = kinds.clone();
        order.rotate_left(round as usize % kinds.len());
        for &w in &workloads {
            for &k in &order {
                let image = if w == "randread" {
                    &read_image
                } else {
                    let _ = std::fs::remove_file(&write_image);
                    std::fs::File::create(&write_image)?.set_len(size)?;
                    &write_image
                };
                let (server, sock) = start(
                    k,
                    &dir,
                    image,
                    size,
                    &vsan_node,
                    node_threads,
                    &NodeCpus::default(),
                )?;
                let r = fio(&sock, w, seconds, iodepth, size, &server)?;
                drop(server);
                println!(
                    "round {} {:<10} {:<18} {:>10.0} IOPS  p50 {:>7.1} us  p99 {:>7.1} us  CPU {:>5.1} us/IO",
                    round + 1,
                    w,
                    k.name(),
                    r.iops,
                    r.p50,
                    r.p99,
                    r.cpu_us
                );
                if k == ServerKind::VsanMirror {
                    mirrored_this_round.push((w, r.iops, r.cpu_us));
                }
                if let Some((_, _, s)) = results.iter_mut().find(|(kk, ww, _)| *kk == k && *ww == w)
                {
                    s.iops.push(r.iops);
                    s.p50_us.push(r.p50);
                    s.p99_us.push(r.p99);
                    s.cpu_us.push(r.cpu_us);
                }
            }
        }
        if demo {
            let runs = run_demo(&dir, seconds, iodepth, size_mib)?;
            for (w, iops, cpu_us) in mirrored_this_round {
                if let Some((_, d)) = runs.iter().find(|(dw, _)| *dw == w) {
                    println!(
                        "round {} {w:<10} {:<18} {:>10.0} IOPS  p50 {:>7.1} us  p99 {:>7.1} us  CPU {:>5.1} us/IO",
                        round + 1,
                        "vsan-demo",
                        d.iops,
                        d.p50,
                        d.p99,
                        d.cpu_us
                    );
                    let fio = FioRun {
                        iops,
                        p50: f64::NAN,
                        p99: f64::NAN,
                        cpu_us,
                    };
                    demos.push((round, w, d.clone(), fio));
                }
            }
        }
    }

    if !demos.is_empty() {
        println!();
        println!(
            "vsan-demo headline (one connection, {iodepth} in flight, {seconds} s) beside fio through the mirrored pair, round by round:"
        );
        println!(
            "| round | workload | vsan-demo IOPS | fio IOPS (vsan-node mirrored) | demo/fio | demo CPU us/IO | fio run's CPU us/IO |"
        );
        println!("|---:|---|---:|---:|---:|---:|---:|");
        for (round, w, d, f) in &demos {
            println!(
                "| {} | {w} | {:.0} | {:.0} | {:.2}x | {:.1} | {:.1} |",
                round + 1,
                d.iops,
                f.iops,
                d.iops / f.iops,
                d.cpu_us,
                f.cpu_us
            );
        }
    }

    println!();
    println!(
        "fio nbd engine, 4 KiB, iodepth {iodepth}, {seconds} s per run, {rounds} round(s), Unix socket, {size_mib} MiB file (medians):"
    );
    println!(
        "| workload | server | IOPS | p50 (us) | p99 (us) | CPU us/IO | IOPS vs nbdkit | CPU vs nbdkit | CPU vs vsan-node |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let ratio =
        |x: f64, base: Option<f64>| base.map_or("n/a".to_string(), |b| format!("{:.2}x", x / b));
    for &w in &workloads {
        let of = |kind: ServerKind| {
            results
                .iter()
                .find(|(k, ww, _)| *k == kind && *ww == w)
                .map(|(_, _, s)| s)
        };
        let base = of(ServerKind::Nbdkit);
        let single = of(ServerKind::Vsan).map(|s| median(&s.cpu_us));
        for (k, _, s) in results.iter().filter(|(_, ww, _)| *ww == w) {
            let (iops, cpu) = (median(&s.iops), median(&s.cpu_us));
            println!(
                "| {w} | {} | {:.0} | {:.1} | {:.1} | {cpu:.1} | {} | {} | {} |",
                k.name(),
                iops,
                median(&s.p50_us),
                median(&s.p99_us),
                ratio(iops, base.map(|b| median(&b.iops))),
                ratio(cpu, base.map(|b| median(&b.cpu_us))),
                ratio(cpu, single),
            );
        }
    }
    let _ = std::fs::remove_file(&read_image);
    let _ = std::fs::remove_file(&write_image);
    Ok(())
}
