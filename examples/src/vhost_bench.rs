//! `vsan-bench vhost`: vsan's vhost-user-blk export side by side, in one run, with
//! `qemu-storage-daemon --export type=vhost-user-blk` of the same kind of disk, and with
//! vsan's own NBD export of the same disk.
//!
//! Workloads: 4 KiB random read and random write at depth 1 and at `--depth`, each for
//! `--seconds`, over the first `--size-mib` of the disk. The client over vhost-user is
//! libblkio's own `virtio-blk-vhost-user` driver (one queue, completions waited on its
//! eventfd), the same for vsan and qsd; over NBD it is fio's nbd engine (libnbd).
//!
//! Cases, each a fresh server per workload run, in rotating order per round:
//! - `vsan` / `qsd`: a file (filled with data once, so reads hit real extents in the
//!   page cache): vsan-node `backing = "file"`, qsd's `file` driver (`aio=threads`,
//!   page cache on);
//! - `vsan-mem` / `qsd-null`: RAM: vsan-node `backing = "mem"`, qsd's `null-co`
//!   (`read-zeroes=on`);
//! - `vsan-tmpfs` / `qsd-tmpfs`: the same file on `/dev/shm` (RAM through each one's
//!   file path: the like-for-like RAM comparison, as `null-co` stores nothing);
//! - `vsan-poll`: `vsan` with `vhost_user_busy_poll_us = 50`;
//! - `vsan-nbd`: the `vsan` node's NBD export of the same file disk, fio nbd engine.
//!
//! Reported: IOPS, p50/p99 latency, and the server process's CPU seconds (utime +
//! stime from `/proc/<pid>/stat` around the run) per million I/Os; then the ratios the
//! issue sets goals for: vsan / qsd IOPS at depth, vsan / vsan-nbd IOPS at depth, and
//! vsan QD1 p50 / vsan-nbd QD1 p50.

use std::io::{self, BufRead};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cpu::process_seconds as cpu_seconds;
use crate::iscsi_bench::have;
use crate::median;
use crate::vhost_client::VhostClient;

/// Options of `vsan-bench vhost`.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Seconds of each run.
    pub seconds: f64,
    /// Rounds.
    pub rounds: u32,
    /// Disk size in MiB.
    pub size_mib: u64,
    /// Queue depth of the deep runs.
    pub depth: usize,
    /// Work directory.
    pub dir: PathBuf,
    /// The `vsan-node` binary.
    pub vsan_node: PathBuf,
    /// Only the cases whose name is one of these (all when empty).
    pub only: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Vsan,
    VsanMem,
    VsanPoll,
    VsanNbd,
    Qsd,
    QsdNull,
    VsanTmpfs,
    QsdTmpfs,
}

const CASES: [Case; 8] = [
    Case::Vsan,
    Case::Qsd,
    Case::VsanMem,
    Case::QsdNull,
    Case::VsanTmpfs,
    Case::QsdTmpfs,
    Case::VsanPoll,
    Case::VsanNbd,
];

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Vsan => "vsan",
            Case::VsanMem => "vsan-mem",
            Case::VsanPoll => "vsan-poll",
            Case::VsanNbd => "vsan-nbd",
            Case::Qsd => "qsd",
            Case::QsdNull => "qsd-null",
            Case::VsanTmpfs => "vsan-tmpfs",
            Case::QsdTmpfs => "qsd-tmpfs",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rw {
    Read,
    Write,
}

/// One run's figures.
#[derive(Debug, Clone, Copy)]
struct Run {
    iops: f64,
    p50_us: f64,
    p99_us: f64,
    cpu_s_per_m: f64,
}

/// A server under test: its process and where it is reached.
struct Server {
    child: Child,
    socket: PathBuf,
    nbd: Option<String>,
}

impl Drop for Server {
    fn drop(&mut self) {
        crate::terminate_children(std::slice::from_mut(&mut self.child));
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Run the comparison and print the table.
pub fn run(o: Opts) -> io::Result<()> {
    std::fs::create_dir_all(&o.dir)?;
    let size = o.size_mib << 20;
    let image = o.dir.join("vhost-bench.img");
    crate::iscsi_bench::fill(&image, size)?;
    let shm_image =
        Path::new("/dev/shm").join(format!("vsan-vhost-bench-{}.img", std::process::id()));
    crate::iscsi_bench::fill(&shm_image, size)?;
    let result = run_cases(&o, &image, &shm_image, size);
    let _ = std::fs::remove_file(&shm_image);
    result
}

fn run_cases(o: &Opts, image: &Path, shm_image: &Path, size: u64) -> io::Result<()> {
    let cases: Vec<Case> = CASES
        .into_iter()
        .filter(|c| o.only.is_empty() || o.only.iter().any(|w| w == c.name()))
        .filter(|c| match c {
            Case::Qsd | Case::QsdNull => {
                have("qemu-storage-daemon") || {
                    eprintln!("qemu-storage-daemon not installed: skipping {}", c.name());
                    false
                }
            }
            Case::VsanNbd => {
                have("fio") || {
                    eprintln!("fio not installed: skipping vsan-nbd");
                    false
                }
            }
            _ => true,
        })
        .collect();
    let workloads = [
        (Rw::Read, 1),
        (Rw::Read, o.depth),
        (Rw::Write, 1),
        (Rw::Write, o.depth),
    ];
    let mut results: Vec<(Case, Rw, usize, Vec<Run>)> = Vec::new();
    for round in 0..o.rounds {
        for (wi, &(rw, depth)) in workloads.iter().enumerate() {
            let n = cases.len();
            for k in 0..n {
                let c = cases[(k + round as usize + wi) % n];
                let img = match c {
                    Case::VsanTmpfs | Case::QsdTmpfs => shm_image,
                    _ => image,
                };
                let server = start(c, o, img, size)?;
                let pid = server.child.id();
                let run = measure(c, &server, rw, depth, o.seconds, size, pid)?;
                eprintln!(
                    "round {round} {:<9} {:<5} QD{depth:<3} {:>9.0} IOPS p50 {:>7.1} us p99 {:>7.1} us cpu {:>6.2} s/M",
                    c.name(),
                    if rw == Rw::Read { "read" } else { "write" },
                    run.iops,
                    run.p50_us,
                    run.p99_us,
                    run.cpu_s_per_m
                );
                match results
                    .iter_mut()
                    .find(|(rc, rr, rd, _)| *rc == c && *rr == rw && *rd == depth)
                {
                    Some((.., v)) => v.push(run),
                    None => results.push((c, rw, depth, vec![run])),
                }
                drop(server);
            }
        }
    }
    println!(
        "\nvhost-user-blk, 4 KiB random, {} s runs, {} round(s), medians (libblkio for vhost-user, fio nbd engine for NBD)",
        o.seconds, o.rounds
    );
    println!(
        "{:<10} {:<6} {:>5} {:>10} {:>9} {:>9} {:>12}",
        "case", "rw", "QD", "IOPS", "p50 us", "p99 us", "cpu s/M I/O"
    );
    let med = |c: Case, rw: Rw, d: usize, f: fn(&Run) -> f64| {
        results
            .iter()
            .find(|(rc, rr, rd, _)| *rc == c && *rr == rw && *rd == d)
            .map(|(.., v)| median(&v.iter().map(f).collect::<Vec<_>>()))
    };
    for &(rw, depth) in &workloads {
        for &c in &cases {
            let m = |f| med(c, rw, depth, f).unwrap_or(f64::NAN);
            println!(
                "{:<10} {:<6} {:>5} {:>10.0} {:>9.1} {:>9.1} {:>12.2}",
                c.name(),
                if rw == Rw::Read { "read" } else { "write" },
                depth,
                m(|r| r.iops),
                m(|r| r.p50_us),
                m(|r| r.p99_us),
                m(|r| r.cpu_s_per_m)
            );
        }
    }
    println!();
    for rw in [Rw::Read, Rw::Write] {
        let name = if rw == Rw::Read { "read" } else { "write" };
        let ratio = |a: Case, b: Case, d: usize, f: fn(&Run) -> f64| {
            Some(med(a, rw, d, f)? / med(b, rw, d, f)?)
        };
        let show = |v: Option<f64>| v.map_or("n/a".into(), |v| format!("{v:.2}x"));
        println!(
            "{name}: QD{}: vsan/qsd IOPS {} (goal >= 1.5x), vsan-tmpfs/qsd-tmpfs {}, vsan-mem/qsd-null {}, vsan/vsan-nbd {} (goal >= 3x); QD1 p50 vsan/vsan-nbd {} (goal <= 0.33x); vsan-poll/vsan QD1 p50 {}",
            o.depth,
            show(ratio(Case::Vsan, Case::Qsd, o.depth, |r| r.iops)),
            show(ratio(Case::VsanTmpfs, Case::QsdTmpfs, o.depth, |r| r.iops)),
            show(ratio(Case::VsanMem, Case::QsdNull, o.depth, |r| r.iops)),
            show(ratio(Case::Vsan, Case::VsanNbd, o.depth, |r| r.iops)),
            show(ratio(Case::Vsan, Case::VsanNbd, 1, |r| r.p50_us)),
            show(ratio(Case::VsanPoll, Case::Vsan, 1, |r| r.p50_us)),
        );
    }
    Ok(())
}

fn start(c: Case, o: &Opts, image: &Path, size: u64) -> io::Result<Server> {
    let socket = o.dir.join(format!("{}.vhost", c.name()));
    let _ = std::fs::remove_file(&socket);
    match c {
        Case::Qsd | Case::QsdNull | Case::QsdTmpfs => {
            let blockdev = match c {
                Case::Qsd | Case::QsdTmpfs => format!(
                    "driver=file,node-name=disk0,filename={},aio=threads,cache.direct=off",
                    image.display()
                ),
                _ => format!("driver=null-co,node-name=disk0,size={size},read-zeroes=on"),
            };
            let child = Command::new("qemu-storage-daemon")
                .args(["--blockdev", &blockdev, "--export"])
                .arg(format!(
                    "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={},writable=on,num-queues=1",
                    socket.display()
                ))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()?;
            let server = Server {
                child,
                socket,
                nbd: None,
            };
            wait_socket(&server.socket)?;
            Ok(server)
        }
        _ => {
            let backing = match c {
                Case::VsanMem => "backing = \"mem\"\n".to_string(),
                _ => format!("path = {:?}\n", image.display().to_string()),
            };
            let poll = if c == Case::VsanPoll {
                "vhost_user_busy_poll_us = 50\n"
            } else {
                ""
            };
            let cfg = format!(
                "[node]\nid = 1\ndata_dir = {:?}\n\n[[disk]]\nname = \"bench\"\nsize = {size}\n{backing}nbd = \"127.0.0.1:0\"\nvhost_user = {:?}\n{poll}",
                o.dir.display().to_string(),
                socket.display().to_string()
            );
            let cfg_path = o.dir.join("vhost-bench.toml");
            std::fs::write(&cfg_path, cfg)?;
            let mut child = Command::new(&o.vsan_node)
                .arg("--config")
                .arg(&cfg_path)
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()?;
            let out = child
                .stdout
                .take()
                .ok_or_else(|| io::Error::other("no stdout"))?;
            let mut lines = io::BufReader::new(out).lines();
            let mut nbd = None;
            let mut vhost = false;
            let deadline = Instant::now() + Duration::from_secs(30);
            while !(vhost && nbd.is_some()) && Instant::now() < deadline {
                let Some(Ok(l)) = lines.next() else { break };
                if let Some(a) = l.strip_prefix("ready disk=bench nbd=") {
                    nbd = Some(a.to_string());
                }
                vhost |= l.starts_with("ready disk=bench vhost_user=");
            }
            // Keep draining its stdout so it never blocks.
            std::thread::spawn(move || for _ in lines {});
            let server = Server { child, socket, nbd };
            if !vhost || server.nbd.is_none() {
                return Err(io::Error::other("vsan-node printed no ready lines in 30 s"));
            }
            Ok(server)
        }
    }
}

fn wait_socket(p: &Path) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !p.exists() {
        if Instant::now() > deadline {
            return Err(io::Error::other(format!("{} did not appear", p.display())));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn measure(
    c: Case,
    server: &Server,
    rw: Rw,
    depth: usize,
    seconds: f64,
    size: u64,
    pid: u32,
) -> io::Result<Run> {
    if c == Case::VsanNbd {
        let addr = server.nbd.as_deref().unwrap_or_default();
        let cpu0 = cpu_seconds(pid)?;
        let (iops, p50, p99, ios) = fio_nbd(&format!("nbd://{addr}"), rw, depth, seconds, size)?;
        let cpu = cpu_seconds(pid)? - cpu0;
        return Ok(Run {
            iops,
            p50_us: p50,
            p99_us: p99,
            cpu_s_per_m: cpu / ios * 1e6,
        });
    }
    let mut client =
        VhostClient::connect(&server.socket, 1, depth * 4096).map_err(io::Error::other)?;
    let blocks = size / 4096;
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ depth as u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % blocks) * 4096
    };
    let mut started = vec![Instant::now(); depth];
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).map_err(io::Error::other)?;
    for (slot, t) in started.iter_mut().enumerate() {
        let off = next();
        *t = Instant::now();
        submit(&mut client, rw, off, slot);
    }
    let cpu0 = cpu_seconds(pid)?;
    let t0 = Instant::now();
    let limit = Duration::from_secs_f64(seconds);
    let mut ios = 0u64;
    while t0.elapsed() < limit {
        for (slot, ret) in client.wait(0, 1).map_err(io::Error::other)? {
            if ret != 0 {
                return Err(io::Error::other(format!(
                    "{} I/O failed: errno {}",
                    c.name(),
                    -ret
                )));
            }
            let _ = hist.record(started[slot].elapsed().as_nanos() as u64);
            ios += 1;
            let off = next();
            started[slot] = Instant::now();
            submit(&mut client, rw, off, slot);
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid)? - cpu0;
    // Let the last requests complete before the client goes.
    let mut left = depth;
    while left > 0 {
        left = left.saturating_sub(client.wait(0, 1).map_err(io::Error::other)?.len());
    }
    Ok(Run {
        iops: ios as f64 / elapsed,
        p50_us: hist.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: hist.value_at_quantile(0.99) as f64 / 1000.0,
        cpu_s_per_m: cpu / ios.max(1) as f64 * 1e6,
    })
}

fn submit(c: &mut VhostClient, rw: Rw, off: u64, slot: usize) {
    match rw {
        Rw::Read => c.submit_read(0, off, slot * 4096, 4096, slot),
        Rw::Write => c.submit_write(0, off, slot * 4096, 4096, slot),
    }
}

/// fio's nbd engine, 4 KiB random, time based: (IOPS, p50 us, p99 us, I/Os).
fn fio_nbd(
    url: &str,
    rw: Rw,
    depth: usize,
    seconds: f64,
    size: u64,
) -> io::Result<(f64, f64, f64, f64)> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=bench",
        "--ioengine=nbd",
        &format!("--uri={url}"),
        "--bs=4k",
        &format!("--iodepth={depth}"),
        &format!("--size={size}"),
        if rw == Rw::Read {
            "--rw=randread"
        } else {
            "--rw=randwrite"
        },
        "--time_based",
        &format!("--runtime={}", seconds.ceil() as u64),
        "--norandommap",
        "--randrepeat=0",
        "--output-format=json",
    ]);
    let f = crate::iscsi_bench::run_fio_json(cmd, if rw == Rw::Read { "read" } else { "write" })?;
    Ok((
        f.iops,
        f.p50_us.unwrap_or(f64::NAN),
        f.p99_us.unwrap_or(f64::NAN),
        f.ios,
    ))
}
