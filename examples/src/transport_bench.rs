//! `vsan-bench transport`: the replication transports side by side, through
//! `MirroredDisk`, in one run.
//!
//! Both replicas are in memory (`MemDevice`), so what is measured is the link and the
//! mirror's own path: replicated 4 KiB writes at QD1 (p50, p99) and 4 KiB random writes
//! at QD32 (IOPS), plus the CPU both nodes burn meanwhile (busy-poll's price). Node 1
//! runs in this process; node 2 runs in a child process (`vsan-bench transport-peer`)
//! for every transport but the in-process loopback, whose point is one process (tcp is
//! also measured with both nodes in this process, its like-for-like baseline). Cases
//! run in rotating order each round, so drift on a noisy machine hits all alike; the
//! figures are medians over rounds.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use vsan_core::{BlockDevice, Geometry, IoFlags, MemDevice};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{Config, DiskId, LinkState};
use vsan_replica::transport::lanes::LanesTransport;
use vsan_replica::transport::loopback::{LoopbackConfig, LoopbackTransport};
use vsan_replica::transport::quic::{Fingerprint, Identity, QuicConfig, QuicTransport};
use vsan_replica::transport::{TcpTransport, Transport};
use vsan_replica::{MirroredDisk, Replica};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SIZE: u64 = 64 << 20;
const BLOCK: usize = 4096;
const NAME: &str = "tbench";
const QD: usize = 32;

/// Options of `vsan-bench transport`.
#[derive(Debug, Clone)]
pub struct Opts {
    /// QD1 writes per case per round.
    pub count: u32,
    /// Seconds of the QD32 measurement per case per round.
    pub seconds: f64,
    /// Rounds.
    pub rounds: u32,
    /// Busy-poll budget of the busy-poll cases.
    pub busy_poll: Duration,
    /// Work directory (sockets, certificates).
    pub dir: PathBuf,
    /// Only the cases whose name contains one of these (all when empty).
    pub only: Vec<String>,
    /// Runtime worker threads of each node's process.
    pub threads: usize,
}

/// How node 2 is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tcp,
    Lanes4,
    Quic,
    Shm,
    InProc,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    kind: Kind,
    busy_poll: bool,
    /// Node 2 in a child process.
    child: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "tcp (2 processes)",
        kind: Kind::Tcp,
        busy_poll: false,
        child: true,
    },
    Case {
        name: "tcp, 4 lanes (2 processes)",
        kind: Kind::Lanes4,
        busy_poll: false,
        child: true,
    },
    Case {
        name: "quic (2 processes)",
        kind: Kind::Quic,
        busy_poll: false,
        child: true,
    },
    Case {
        name: "loopback shm (2 processes)",
        kind: Kind::Shm,
        busy_poll: false,
        child: true,
    },
    Case {
        name: "loopback shm, busy-poll (2 processes)",
        kind: Kind::Shm,
        busy_poll: true,
        child: true,
    },
    Case {
        name: "tcp (1 process)",
        kind: Kind::Tcp,
        busy_poll: false,
        child: false,
    },
    Case {
        name: "loopback in-process",
        kind: Kind::InProc,
        busy_poll: false,
        child: false,
    },
    Case {
        name: "loopback in-process, busy-poll",
        kind: Kind::InProc,
        busy_poll: true,
        child: false,
    },
];

fn kind_word(k: Kind) -> &'static str {
    match k {
        Kind::Tcp => "tcp",
        Kind::Lanes4 => "lanes4",
        Kind::Quic => "quic",
        Kind::Shm => "shm",
        Kind::InProc => "inproc",
    }
}

fn kind_of(word: &str) -> Option<Kind> {
    Some(match word {
        "tcp" => Kind::Tcp,
        "lanes4" => Kind::Lanes4,
        "quic" => Kind::Quic,
        "shm" => Kind::Shm,
        "inproc" => Kind::InProc,
        _ => return None,
    })
}

/// Certificates of both nodes, made once per run.
struct Certs {
    dir: PathBuf,
    fp: [Fingerprint; 2],
}

impl Certs {
    fn make(dir: &Path) -> Result<Certs, BoxError> {
        let mut fp = Vec::new();
        for n in 1..=2 {
            let (c, k) = Certs::paths(dir, n);
            let _ = std::fs::remove_file(&c);
            let _ = std::fs::remove_file(&k);
            fp.push(Identity::load_or_generate(&c, &k, &format!("bench-{n}"))?.fingerprint());
        }
        Ok(Certs {
            dir: dir.to_path_buf(),
            fp: [fp[0], fp[1]],
        })
    }

    fn paths(dir: &Path, node: u32) -> (PathBuf, PathBuf) {
        (
            dir.join(format!("bench-{node}.crt")),
            dir.join(format!("bench-{node}.key")),
        )
    }
}

/// The transport node `node` uses for `kind` (certificates in `cert_dir`, pinning
/// `peer_fp`).
fn transport(
    kind: Kind,
    busy_poll: Option<Duration>,
    node: u32,
    cert_dir: &Path,
    peer_fp: Option<Fingerprint>,
) -> Result<Arc<dyn Transport>, BoxError> {
    Ok(match kind {
        Kind::Tcp => Arc::new(TcpTransport::new()),
        Kind::Lanes4 => Arc::new(LanesTransport::new(Arc::new(TcpTransport::new()), 4)?),
        Kind::Quic => {
            let (c, k) = Certs::paths(cert_dir, node);
            let id = Identity::load_or_generate(&c, &k, &format!("bench-{node}"))?;
            let fp = peer_fp.ok_or("quic needs the peer's fingerprint")?;
            Arc::new(QuicTransport::new(QuicConfig::pinned(id, [fp]))?)
        }
        Kind::Shm | Kind::InProc => {
            let mut cfg = LoopbackConfig::default();
            cfg.busy_poll = busy_poll;
            Arc::new(LoopbackTransport::with_config(cfg))
        }
    })
}

fn config(node: u32) -> Config {
    Config::new(node, 3 - node, DiskId::from_name(NAME), NAME, SIZE, 512)
}

async fn start_node(node: u32) -> Result<MirroredDisk, BoxError> {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(Geometry::new(SIZE, 512)?));
    // Touch every page first (the same bytes on both nodes, so the first sync moves
    // nothing): page faults of fresh memory are not the link's cost.
    let fill = Bytes::from(vec![0x11; 1 << 20]);
    for off in (0..SIZE).step_by(1 << 20) {
        dev.write(off, fill.clone(), IoFlags::empty()).await?;
    }
    let cfg = config(node);
    let replica = Replica::with_memory_meta(&cfg, dev).await?;
    Ok(MirroredDisk::start(cfg, replica, None)?)
}

async fn wait_in_sync(d: &MirroredDisk) -> Result<(), BoxError> {
    let mut st = d.watch_status();
    tokio::time::timeout(
        Duration::from_secs(30),
        st.wait_for(|s| s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0),
    )
    .await??;
    Ok(())
}

/// `vsan-bench transport-peer`: node 2 in its own process. Prints `ready <addr>` once
/// it listens and serves until its standard input closes.
pub fn peer(
    kind: &str,
    listen: &str,
    busy_poll_us: u64,
    cert_dir: &Path,
    pin: Option<&str>,
    threads: usize,
) -> Result<(), BoxError> {
    let kind = kind_of(kind).ok_or("unknown transport kind")?;
    let pin = pin.map(str::parse::<Fingerprint>).transpose()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let busy = (busy_poll_us > 0).then(|| Duration::from_micros(busy_poll_us));
        let t = transport(kind, busy, 2, cert_dir, pin)?;
        let listen_t: Arc<dyn Transport> = Arc::new(LanesTransport::new(t, 1)?);
        let d2 = start_node(2).await?;
        let listener = listen_t.listen(listen).await?;
        println!("ready {}", listener.local_addr());
        let acc = tokio::spawn(accept_loop(
            listener,
            HashMap::from([(NAME.to_string(), d2.clone())]),
        ));
        // Serve until the parent closes our stdin.
        tokio::task::spawn_blocking(|| {
            let mut s = String::new();
            while std::io::stdin().read_line(&mut s).is_ok_and(|n| n > 0) {}
        })
        .await?;
        acc.abort();
        drop(d2);
        Ok(())
    })
}

/// A running pair for one case.
struct Setup {
    d1: MirroredDisk,
    /// Node 2 when it runs in this process (kept alive for the measurement).
    _d2: Option<MirroredDisk>,
    child: Option<Child>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Setup {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Some(mut c) = self.child.take() {
            drop(c.stdin.take());
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn setup(case: &Case, opts: &Opts, certs: &Certs, n: usize) -> Result<Setup, BoxError> {
    let busy = case.busy_poll.then_some(opts.busy_poll);
    let addr = match case.kind {
        Kind::Shm => opts.dir.join(format!("tb-{n}.sock")).display().to_string(),
        Kind::InProc => format!("inproc:tbench-{n}"),
        _ => "127.0.0.1:0".to_string(),
    };
    let d1 = start_node(1).await?;
    let mut tasks = Vec::new();
    let (d2, child, at) = if case.child {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("transport-peer")
            .arg("--kind")
            .arg(kind_word(case.kind))
            .arg("--listen")
            .arg(&addr)
            .arg("--busy-poll-us")
            .arg(busy.map_or(0, |d| d.as_micros() as u64).to_string())
            .arg("--cert-dir")
            .arg(&certs.dir)
            .arg("--pin")
            .arg(certs.fp[0].to_string())
            .arg("--threads")
            .arg(opts.threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn()?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let line = tokio::task::spawn_blocking(move || {
            let mut l = String::new();
            BufReader::new(out).read_line(&mut l).map(|_| l)
        })
        .await??;
        let at = line
            .strip_prefix("ready ")
            .ok_or_else(|| format!("peer said {line:?}"))?
            .trim()
            .to_string();
        (None, Some(child), at)
    } else {
        let t = transport(case.kind, busy, 2, &certs.dir, Some(certs.fp[0]))?;
        let d2 = start_node(2).await?;
        let listener = t.listen(&addr).await?;
        let at = listener.local_addr();
        tasks.push(tokio::spawn(accept_loop(
            listener,
            HashMap::from([(NAME.to_string(), d2.clone())]),
        )));
        (Some(d2), None, at)
    };
    let t1 = transport(case.kind, busy, 1, &certs.dir, Some(certs.fp[1]))?;
    tasks.push(tokio::spawn(dial_loop(t1, at, d1.clone())));
    let s = Setup {
        d1,
        _d2: d2,
        child,
        tasks,
    };
    wait_in_sync(&s.d1).await?;
    Ok(s)
}

fn cpu_now(child: Option<&Child>) -> f64 {
    let cpu = |pid| crate::cpu::process_seconds(pid).unwrap_or(0.0);
    cpu(std::process::id()) + child.map_or(0.0, |c| cpu(c.id()))
}

struct Figures {
    p50: f64,
    p99: f64,
    /// Cores busy (both nodes) during the QD1 run.
    qd1_cores: f64,
    iops: f64,
}

async fn measure(s: &Setup, opts: &Opts, seed: u64) -> Result<Figures, BoxError> {
    let d1 = &s.d1;
    let data = Bytes::from(vec![0x5a; BLOCK]);
    let mut rng = SmallRng::seed_from_u64(seed);
    let blocks = SIZE / BLOCK as u64;
    for _ in 0..opts.count / 10 {
        let off = rng.random_range(0..blocks) * BLOCK as u64;
        d1.write(off, data.clone(), IoFlags::empty()).await?;
    }
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let (t0, c0) = (Instant::now(), cpu_now(s.child.as_ref()));
    for _ in 0..opts.count {
        let off = rng.random_range(0..blocks) * BLOCK as u64;
        let t = Instant::now();
        d1.write(off, data.clone(), IoFlags::empty()).await?;
        h.record(t.elapsed().as_nanos() as u64)?;
    }
    let qd1_cores = (cpu_now(s.child.as_ref()) - c0) / t0.elapsed().as_secs_f64();

    let stop = Instant::now() + Duration::from_secs_f64(opts.seconds);
    let mut workers = Vec::new();
    for w in 0..QD {
        let d1 = d1.clone();
        let data = data.clone();
        workers.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(seed * 1000 + w as u64);
            let mut n = 0u64;
            while Instant::now() < stop {
                let off = rng.random_range(0..blocks) * BLOCK as u64;
                d1.write(off, data.clone(), IoFlags::empty()).await?;
                n += 1;
            }
            Ok::<u64, vsan_core::Error>(n)
        }));
    }
    let t = Instant::now();
    let mut total = 0;
    for w in workers {
        total += w.await??;
    }
    let iops = total as f64 / t.elapsed().as_secs_f64();
    Ok(Figures {
        p50: h.value_at_quantile(0.5) as f64 / 1000.0,
        p99: h.value_at_quantile(0.99) as f64 / 1000.0,
        qd1_cores,
        iops,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Run every case and print the table and the targets.
pub fn run(opts: Opts) -> Result<(), BoxError> {
    std::fs::create_dir_all(&opts.dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.threads.max(1))
        .enable_all()
        .build()?;
    let cases: Vec<&Case> = CASES
        .iter()
        .filter(|c| opts.only.is_empty() || opts.only.iter().any(|o| c.name.contains(o.as_str())))
        .collect();
    rt.block_on(async {
        let certs = Certs::make(&opts.dir)?;
        let mut results: Vec<Vec<Figures>> = cases.iter().map(|_| Vec::new()).collect();
        let mut n = 0;
        for round in 0..opts.rounds {
            let k = cases.len();
            for i in 0..k {
                let idx = (i + round as usize) % k;
                let case = cases[idx];
                n += 1;
                let s = Arc::new(setup(case, &opts, &certs, n).await?);
                // On a runtime worker, as a client task would be: the thread that runs
                // `block_on` parks between writes, and waking it costs as much as a
                // link's round trip here.
                let f = {
                    let (s, opts) = (Arc::clone(&s), opts.clone());
                    let seed = u64::from(round) * 100 + idx as u64;
                    tokio::spawn(async move { measure(&s, &opts, seed).await }).await??
                };
                eprintln!(
                    "round {round} {}: p50 {:.1} us p99 {:.1} us, {:.0} IOPS, {:.2} cores at QD1",
                    case.name, f.p50, f.p99, f.iops, f.qd1_cores
                );
                results[idx].push(f);
                drop(s);
            }
        }
        println!(
            "Replicated 4 KiB writes through MirroredDisk (in-memory replicas), {} QD1 writes and {} s at QD{QD} per case per round, {} rounds, {} runtime worker thread(s) per node process, medians:",
            opts.count, opts.seconds, opts.rounds, opts.threads
        );
        println!("| transport | QD1 p50 us | QD1 p99 us | QD{QD} IOPS | cores busy at QD1 (both nodes) |");
        println!("|---|---:|---:|---:|---:|");
        let mut by_name = HashMap::new();
        for (case, figs) in cases.iter().zip(&results) {
            let p50 = median(figs.iter().map(|f| f.p50).collect());
            let p99 = median(figs.iter().map(|f| f.p99).collect());
            let iops = median(figs.iter().map(|f| f.iops).collect());
            let cores = median(figs.iter().map(|f| f.qd1_cores).collect());
            println!("| {} | {p50:.1} | {p99:.1} | {iops:.0} | {cores:.2} |", case.name);
            by_name.insert(case.name, (p50, iops));
        }
        let get = |n: &str| by_name.get(n).copied();
        let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
        if let (Some(tcp), Some(shm_bp)) = (get("tcp (2 processes)"), get("loopback shm, busy-poll (2 processes)")) {
            println!("target: cross-process loopback, busy-poll, QD1 p50 <= tcp/10: {:.1} vs {:.1} us ({:.1}x) -> {}", shm_bp.0, tcp.0, tcp.0 / shm_bp.0, verdict(shm_bp.0 * 10.0 <= tcp.0));
        }
        if let (Some(tcp), Some(inp)) = (get("tcp (2 processes)"), get("loopback in-process")) {
            println!("target: in-process loopback QD1 p50 <= tcp/10: {:.1} vs {:.1} us ({:.1}x) -> {}", inp.0, tcp.0, tcp.0 / inp.0, verdict(inp.0 * 10.0 <= tcp.0));
        }
        if let (Some(tcp), Some(shm)) = (get("tcp (2 processes)"), get("loopback shm (2 processes)")) {
            println!("target: loopback without busy-poll QD1 p50 below tcp: {:.1} vs {:.1} us -> {}", shm.0, tcp.0, verdict(shm.0 < tcp.0));
            println!("target: loopback QD{QD} IOPS >= 2x tcp: {:.0} vs {:.0} ({:.2}x) -> {}", shm.1, tcp.1, shm.1 / tcp.1, verdict(shm.1 >= 2.0 * tcp.1));
        }
        if let (Some(tcp), Some(q)) = (get("tcp (2 processes)"), get("quic (2 processes)")) {
            println!("target: quic IOPS >= 0.7x tcp: {:.0} vs {:.0} ({:.2}x) -> {}", q.1, tcp.1, q.1 / tcp.1, verdict(q.1 >= 0.7 * tcp.1));
        }
        Ok(())
    })
}
