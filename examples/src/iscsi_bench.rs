//! `vsan-bench iscsi`: vsan's iSCSI target side by side, in one run, with Debian's
//! `tgtd` exporting the same kind of file, and with vsan's own NBD export of the same
//! disk.
//!
//! Two workloads, each with the client the issue names:
//!
//! - **randread**: 4 KiB random READ(16), 32 in flight, for `--seconds`:
//!   `iscsi-perf -r -m 32 -b <blocks> -t <seconds> <url>` over iSCSI; fio's nbd engine
//!   (`--rw=randread --bs=4k --iodepth=32`) over NBD. Reads go to a file filled with
//!   data once (real extents in the page cache, not holes).
//! - **write**: 4 KiB writes at depth 32: `qemu-img bench -f raw -w -d 32 -s 4k -t none
//!   -c <count> <url>` over iSCSI (it writes sequentially, 4 KiB steps); fio's nbd engine
//!   with `--rw=write --bs=4k --iodepth=32` and the same number of writes over NBD.
//!   Writes go to a fresh sparse file per run.
//!
//! The cases: `tgtd` (iSCSI, LUN 1 of a private tgtd), `vsan` (one `vsan-node`, a file
//! disk, iSCSI), `vsan-nbd` (the same node and disk through NBD over TCP), and with
//! `--mirror` also `vsan-mirror` / `vsan-mirror-nbd` (two nodes on this machine, node 1
//! exporting) and `vsan-mirror-2paths` (the same mirrored disk through both nodes' iSCSI
//! targets at once, as a multipath initiator uses it: half the depth on each path; reads
//! on both for `--seconds`, IOPS summed; half the writes on each, node 1's from offset 0
//! and node 2's from the middle of the disk). Each case runs once per workload per round, in rotating order. Reported:
//! IOPS, p50/p99 where the client measures them (fio does; iscsi-perf and qemu-img bench
//! do not), the target process(es)' CPU seconds per million commands (utime + stime from
//! `/proc/<pid>/stat` around the run: tgtd's one process, or both nodes of a mirror),
//! and the ratio to tgtd.

use std::io::{self, BufRead};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::cpu::process_seconds as cpu_seconds;
use crate::median;
use crate::tgtd::{Tgtd, TgtdChap, free_port};

/// Options of `vsan-bench iscsi`.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Seconds of each read run (iscsi-perf -t, fio --runtime).
    pub seconds: u32,
    /// Writes per write run (qemu-img bench -c; fio the same number); capped at the
    /// disk's size in 4 KiB blocks.
    pub write_count: u64,
    /// Rounds.
    pub rounds: u32,
    /// Size of the exported file in MiB.
    pub size_mib: u64,
    /// Commands in flight.
    pub depth: u32,
    /// Work directory.
    pub dir: PathBuf,
    /// The `vsan-node` binary.
    pub vsan_node: PathBuf,
    /// Also measure a mirrored disk (two nodes on this machine).
    pub mirror: bool,
    /// Only the cases whose name contains one of these words (`tgtd`, `vsan`, `nbd`).
    pub only: Vec<String>,
    /// `node.threads` for each vsan-node (default: the node's own default).
    pub node_threads: Option<usize>,
}

/// What is measured, and how it is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    Tgtd,
    Vsan,
    VsanNbd,
    VsanMirror,
    VsanMirrorNbd,
    /// The mirrored disk through both nodes' iSCSI targets at once (half the depth and
    /// half the writes on each path).
    VsanMirrorBoth,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Tgtd => "tgtd",
            Case::Vsan => "vsan",
            Case::VsanNbd => "vsan-nbd",
            Case::VsanMirror => "vsan-mirror",
            Case::VsanMirrorNbd => "vsan-mirror-nbd",
            Case::VsanMirrorBoth => "vsan-mirror-2paths",
        }
    }

    fn is_nbd(self) -> bool {
        matches!(self, Case::VsanNbd | Case::VsanMirrorNbd)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Workload {
    RandRead,
    Write,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::RandRead => "randread",
            Workload::Write => "write",
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    iops: f64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    commands: f64,
}

#[derive(Debug, Default, Clone)]
struct Samples {
    iops: Vec<f64>,
    p50_us: Vec<f64>,
    p99_us: Vec<f64>,
    cpu_per_m: Vec<f64>,
}

/// A running target: its processes (ended on drop) and how a client reaches it.
#[derive(Debug)]
struct Running {
    tgtd: Option<Tgtd>,
    nodes: Vec<Child>,
    /// `iscsi://...` or `nbd://...`.
    url: String,
    /// The second path (node 2's target), for [`Case::VsanMirrorBoth`].
    url2: Option<String>,
}

impl Running {
    fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.nodes.iter().map(Child::id).collect();
        pids.extend(self.tgtd.as_ref().map(Tgtd::pid));
        pids
    }

    fn cpu(&self) -> io::Result<f64> {
        self.pids().into_iter().map(cpu_seconds).sum()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        crate::terminate_children(&mut self.nodes);
        self.tgtd = None;
    }
}

/// Whether `tool` can be started (it answers `--help`).
pub(crate) fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--help")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// Run the benchmark and print its table.
pub fn run(o: Opts) -> io::Result<()> {
    for (tool, pkg) in [
        ("iscsi-perf", "libiscsi-bin"),
        ("qemu-img", "qemu-utils and qemu-block-extra"),
        ("fio", "fio"),
        ("tgtd", "tgt"),
    ] {
        if !have(tool) {
            return Err(io::Error::other(format!(
                "{tool} is not installed (apt-get install {pkg})"
            )));
        }
    }
    std::fs::create_dir_all(&o.dir)?;
    let mut cases = vec![Case::Tgtd, Case::Vsan, Case::VsanNbd];
    if o.mirror {
        cases.extend([Case::VsanMirror, Case::VsanMirrorNbd, Case::VsanMirrorBoth]);
    }
    if !o.only.is_empty() {
        cases.retain(|c| o.only.iter().any(|w| c.name().contains(w.as_str())));
    }
    if cases.is_empty() {
        return Err(io::Error::other("--only left no case to run"));
    }
    let size = o.size_mib << 20;
    let write_count = o.write_count.min(size / 4096).max(1);
    let read_image = o.dir.join("iscsi-read.img");
    let write_image = o.dir.join("iscsi-write.img");
    println!("filling {} ({} MiB)...", read_image.display(), o.size_mib);
    fill(&read_image, size)?;

    let workloads = [Workload::RandRead, Workload::Write];
    let mut results: Vec<(Case, Workload, Samples)> = Vec::new();
    for &c in &cases {
        for w in workloads {
            results.push((c, w, Samples::default()));
        }
    }
    for round in 0..o.rounds {
        let mut order = cases.clone();
        order.rotate_left(round as usize % cases.len());
        for w in workloads {
            for &c in &order {
                let image = match w {
                    Workload::RandRead => &read_image,
                    Workload::Write => {
                        let _ = std::fs::remove_file(&write_image);
                        std::fs::File::create(&write_image)?.set_len(size)?;
                        &write_image
                    }
                };
                let target = start(c, &o, image, size)?;
                let cpu0 = target.cpu()?;
                let f = match (w, c.is_nbd(), &target.url2) {
                    (w, false, Some(url2)) => {
                        two_paths(w, [&target.url, url2], &o, write_count, size)?
                    }
                    (Workload::RandRead, false, None) => {
                        iscsi_perf(&target.url, o.seconds, o.depth)?
                    }
                    (Workload::Write, false, None) => {
                        qemu_img_bench(&target.url, write_count, o.depth, 0)?
                    }
                    (w, true, _) => fio_nbd(&target.url, w, o.seconds, write_count, o.depth, size)?,
                };
                let cpu = target.cpu()? - cpu0;
                drop(target);
                let cpu_per_m = if f.commands > 0.0 {
                    cpu / f.commands * 1e6
                } else {
                    f64::NAN
                };
                println!(
                    "round {} {:<8} {:<16} {:>9.0} IOPS  p50 {:>7} us  p99 {:>7} us  {:>6.1} CPU s/M cmds",
                    round + 1,
                    w.name(),
                    c.name(),
                    f.iops,
                    opt(f.p50_us),
                    opt(f.p99_us),
                    cpu_per_m
                );
                if let Some((_, _, s)) = results.iter_mut().find(|(cc, ww, _)| *cc == c && *ww == w)
                {
                    s.iops.push(f.iops);
                    s.p50_us.extend(f.p50_us);
                    s.p99_us.extend(f.p99_us);
                    s.cpu_per_m.push(cpu_per_m);
                }
            }
        }
    }

    println!();
    println!(
        "4 KiB, {} in flight; randread: iscsi-perf -r ({} s) / fio nbd randread; write: \
         qemu-img bench -w ({write_count} sequential writes) / fio nbd write (same count); \
         {} MiB file, {} round(s) (medians):",
        o.depth, o.seconds, o.size_mib, o.rounds
    );
    println!(
        "| workload | target | client | IOPS | p50 (us) | p99 (us) | CPU s / M cmds | vs tgtd |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    for w in workloads {
        let base = results
            .iter()
            .find(|(c, ww, _)| *c == Case::Tgtd && *ww == w)
            .map(|(_, _, s)| median(&s.iops));
        for (c, _, s) in results.iter().filter(|(_, ww, _)| *ww == w) {
            let iops = median(&s.iops);
            let ratio = base.map_or("n/a".to_string(), |b| format!("{:.2}x", iops / b));
            let client = match (w, c.is_nbd(), *c == Case::VsanMirrorBoth) {
                (_, true, _) => "fio nbd",
                (Workload::RandRead, false, false) => "iscsi-perf",
                (Workload::Write, false, false) => "qemu-img bench",
                (Workload::RandRead, false, true) => "2 x iscsi-perf",
                (Workload::Write, false, true) => "2 x qemu-img bench",
            };
            println!(
                "| {} | {} | {client} | {iops:.0} | {} | {} | {:.1} | {ratio} |",
                w.name(),
                c.name(),
                opt(non_empty_median(&s.p50_us)),
                opt(non_empty_median(&s.p99_us)),
                median(&s.cpu_per_m)
            );
        }
    }
    let _ = std::fs::remove_file(&read_image);
    let _ = std::fs::remove_file(&write_image);
    Ok(())
}

fn opt(v: Option<f64>) -> String {
    v.map_or("n/a".to_string(), |v| format!("{v:.1}"))
}

fn non_empty_median(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| median(v))
}

/// Fill `path` with `size` bytes of non-zero data so reads hit real extents.
pub(crate) fn fill(path: &Path, size: u64) -> io::Result<()> {
    use std::io::Write;
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
    f.sync_all()
}

fn start(c: Case, o: &Opts, image: &Path, size: u64) -> io::Result<Running> {
    match c {
        Case::Tgtd => {
            let tgtd = Tgtd::start(
                image,
                "iqn.2026-12.io.vsan.bench:tgtd",
                &TgtdChap::default(),
                &o.dir.join("tgtd.log"),
            )?;
            let url = tgtd.url();
            Ok(Running {
                tgtd: Some(tgtd),
                nodes: Vec::new(),
                url,
                url2: None,
            })
        }
        Case::Vsan | Case::VsanNbd => {
            let dir = o.dir.join("node");
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            let cfg = dir.join("node.toml");
            std::fs::write(
                &cfg,
                format!(
                    "[node]\nid = 1\ndata_dir = {}\n{}\n{}",
                    toml_path(&dir)?,
                    threads(o.node_threads),
                    disk_section(image, size, None)?
                ),
            )?;
            let (node, ready) = spawn_node(&o.vsan_node, &cfg, true)?;
            Ok(Running {
                tgtd: None,
                nodes: vec![node],
                url: ready.url(c.is_nbd()),
                url2: None,
            })
        }
        Case::VsanMirror | Case::VsanMirrorNbd | Case::VsanMirrorBoth => {
            // Node 2 holds the second replica (a copy of the same file) and accepts the
            // link; node 1 dials it and exports the disk.
            let peer_image = o.dir.join("iscsi-peer.img");
            let _ = std::fs::remove_file(&peer_image);
            if std::fs::metadata(image)?.blocks() == 0 {
                std::fs::File::create(&peer_image)?.set_len(size)?;
            } else {
                std::fs::copy(image, &peer_image)?;
            }
            let port = free_port()?;
            let (dir1, dir2) = (o.dir.join("node1"), o.dir.join("node2"));
            for d in [&dir1, &dir2] {
                let _ = std::fs::remove_dir_all(d);
                std::fs::create_dir_all(d)?;
            }
            let peer = |id: u32| format!("[[peer]]\nid = {id}\naddress = \"127.0.0.1:{port}\"\n\n");
            let cfg2 = dir2.join("node.toml");
            std::fs::write(
                &cfg2,
                format!(
                    "[node]\nid = 2\ndata_dir = {}\nlisten = \"127.0.0.1:{port}\"\n{}\n{}{}",
                    toml_path(&dir2)?,
                    threads(o.node_threads),
                    peer(1),
                    disk_section(&peer_image, size, Some(1))?
                ),
            )?;
            let both = c == Case::VsanMirrorBoth;
            let (node2, ready2) = spawn_node(&o.vsan_node, &cfg2, both)?;
            let cfg1 = dir1.join("node.toml");
            std::fs::write(
                &cfg1,
                format!(
                    "[node]\nid = 1\ndata_dir = {}\n{}\n{}{}",
                    toml_path(&dir1)?,
                    threads(o.node_threads),
                    peer(2),
                    disk_section(image, size, Some(2))?
                ),
            )?;
            let mut running = Running {
                tgtd: None,
                nodes: vec![node2],
                url: String::new(),
                url2: both.then(|| ready2.url(false)),
            };
            let (node1, ready) = spawn_node(&o.vsan_node, &cfg1, true)?;
            running.nodes.push(node1);
            // The two fresh replicas compare every chunk first: measure after that.
            ready.wait_sync()?;
            running.url = ready.url(c.is_nbd());
            Ok(running)
        }
    }
}

fn threads(n: Option<usize>) -> String {
    n.map_or(String::new(), |n| format!("threads = {n}\n"))
}

fn toml_path(p: &Path) -> io::Result<String> {
    let s = p
        .to_str()
        .ok_or_else(|| io::Error::other(format!("{} is not UTF-8", p.display())))?;
    Ok(format!("{s:?}"))
}

/// The bench disk: NBD and iSCSI on loopback TCP, both on `127.0.0.1:0`.
fn disk_section(image: &Path, size: u64, peer: Option<u32>) -> io::Result<String> {
    Ok(format!(
        "[[disk]]\nname = \"bench\"\nsize = {size}\npath = {}\n{}nbd = \"127.0.0.1:0\"\niscsi = \"127.0.0.1:0\"\n",
        toml_path(image)?,
        peer.map_or(String::new(), |p| format!("peer = {p}\n"))
    ))
}

/// What a node printed once it served the bench disk.
#[derive(Debug)]
struct Ready {
    nbd: String,
    iscsi: String,
    target: String,
    lines: mpsc::Receiver<String>,
}

impl Ready {
    fn url(&self, nbd: bool) -> String {
        if nbd {
            format!("nbd://{}", self.nbd)
        } else {
            format!("iscsi://{}/{}/0", self.iscsi, self.target)
        }
    }

    fn wait_sync(&self) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with("sync disk=bench done") => return Ok(()),
                Ok(_) => {}
                Err(_) => {
                    return Err(io::Error::other(
                        "the mirrored disk's first resync did not finish within 300 s",
                    ));
                }
            }
        }
    }
}

/// Start `vsan-node --config <cfg>`; with `exporting`, wait for its `ready disk=bench
/// nbd=...` and `ready disk=bench iscsi=... target=...` lines. Its stdout keeps being
/// read on a thread so it never blocks on a full pipe.
fn spawn_node(vsan_node: &Path, cfg: &Path, exporting: bool) -> io::Result<(Child, Ready)> {
    let mut child = Command::new(vsan_node)
        .arg("--config")
        .arg(cfg)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot start {}: {e}", vsan_node.display()),
            )
        })?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| io::Error::other("vsan-node's stdout is not piped"))?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let mut ready = Ready {
        nbd: String::new(),
        iscsi: String::new(),
        target: String::new(),
        lines: rx,
    };
    if !exporting {
        return Ok((child, ready));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready.nbd.is_empty() || ready.iscsi.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        match ready.lines.recv_timeout(left) {
            Ok(line) => {
                let Some(rest) = line.strip_prefix("ready ") else {
                    continue;
                };
                let field = |k: &str| {
                    rest.split_whitespace()
                        .find_map(|f| f.strip_prefix(k))
                        .map(str::to_string)
                };
                if field("disk=").as_deref() != Some("bench") {
                    continue;
                }
                if let Some(a) = field("nbd=") {
                    ready.nbd = a;
                }
                if let (Some(a), Some(t)) = (field("iscsi="), field("target=")) {
                    ready.iscsi = a;
                    ready.target = t;
                }
            }
            Err(_) => {
                let _ = child.kill();
                let status = child.wait()?;
                return Err(io::Error::other(format!(
                    "vsan-node ({}) printed no `ready disk=bench nbd=` and `ready disk=bench \
                     iscsi= target=` lines within 30 s (exit: {status}); a node without \
                     the iSCSI target cannot run the vsan cases (try --only tgtd)",
                    cfg.display()
                )));
            }
        }
    }
    Ok((child, ready))
}

/// `iscsi-perf -r -m <depth> -b 8 -t <seconds> <url>`: 4 KiB random READ(16).
fn iscsi_perf(url: &str, seconds: u32, depth: u32) -> io::Result<Figures> {
    // 8 blocks of 512 bytes; a 4096-byte-block LUN would make this 32 KiB, so ask the
    // capacity first.
    let blocks = 4096 / block_size(url)?.max(1);
    let out = Command::new("iscsi-perf")
        .args(["-r", "-m", &depth.to_string(), "-b", &blocks.to_string()])
        .args(["-t", &seconds.to_string(), url])
        .stdin(Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "iscsi-perf failed ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let iops = parse_iscsi_perf(&text).ok_or_else(|| {
        io::Error::other(format!("no `iops average` in iscsi-perf's output:\n{text}"))
    })?;
    Ok(Figures {
        iops,
        p50_us: None,
        p99_us: None,
        commands: iops * f64::from(seconds),
    })
}

/// The last `iops average N` figure of iscsi-perf's output (it prints one per second,
/// then the whole run's).
fn parse_iscsi_perf(text: &str) -> Option<f64> {
    text.rsplit("iops average ")
        .next()
        .filter(|_| text.contains("iops average "))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The LUN's logical block size from `iscsi-readcapacity16`.
fn block_size(url: &str) -> io::Result<u64> {
    let out = Command::new("iscsi-readcapacity16")
        .arg(url)
        .stdin(Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("LOGICAL BLOCK LENGTH IN BYTES:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            io::Error::other(format!(
                "iscsi-readcapacity16 {url} printed no block length ({}): {text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        })
}

/// Both paths at once, each with half the depth (so as many commands are in flight as
/// through one path): random reads for `o.seconds` on each, or half the writes on each,
/// node 1's path from offset 0 and node 2's from the middle of the disk (no overlap).
/// IOPS are the sum of the two clients' (reads) or all writes over the slower client's
/// time (writes).
fn two_paths(
    w: Workload,
    urls: [&str; 2],
    o: &Opts,
    write_count: u64,
    size: u64,
) -> io::Result<Figures> {
    let depth = (o.depth / 2).max(1);
    let half = (write_count / 2).max(1);
    let runs: Vec<io::Result<Figures>> = std::thread::scope(|s| {
        let handles: Vec<_> = urls
            .iter()
            .enumerate()
            .map(|(i, url)| {
                s.spawn(move || match w {
                    Workload::RandRead => iscsi_perf(url, o.seconds, depth),
                    Workload::Write => qemu_img_bench(url, half, depth, i as u64 * (size / 2)),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a client thread panicked")))
            })
            .collect()
    });
    let mut figs = Vec::new();
    for r in runs {
        figs.push(r?);
    }
    let commands: f64 = figs.iter().map(|f| f.commands).sum();
    let iops = match w {
        Workload::RandRead => figs.iter().map(|f| f.iops).sum(),
        Workload::Write => {
            // Each client's own rate gives its time; the pair took the longer one.
            let secs = figs.iter().map(|f| f.commands / f.iops).fold(0.0, f64::max);
            commands / secs
        }
    };
    Ok(Figures {
        iops,
        p50_us: None,
        p99_us: None,
        commands,
    })
}

/// `qemu-img bench -f raw -w -d <depth> -s 4k -t none -c <count> -o <offset> <url>`.
fn qemu_img_bench(url: &str, count: u64, depth: u32, offset: u64) -> io::Result<Figures> {
    let out = Command::new("qemu-img")
        .args([
            "bench",
            "-f",
            "raw",
            "-w",
            "-d",
            &depth.to_string(),
            "-s",
            "4k",
        ])
        .args(["-t", "none", "-c", &count.to_string()])
        .args(["-o", &offset.to_string(), url])
        .stdin(Stdio::null())
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "qemu-img bench failed ({}): {text}",
            out.status
        )));
    }
    let secs: f64 = text
        .split("Run completed in ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::other(format!("no `Run completed in` in:\n{text}")))?;
    Ok(Figures {
        iops: count as f64 / secs,
        p50_us: None,
        p99_us: None,
        commands: count as f64,
    })
}

/// fio's nbd engine, 4 KiB: `randread` for `seconds`, or `write` of `count` blocks.
fn fio_nbd(
    url: &str,
    w: Workload,
    seconds: u32,
    count: u64,
    depth: u32,
    size: u64,
) -> io::Result<Figures> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=bench",
        "--ioengine=nbd",
        &format!("--uri={url}"),
        "--bs=4k",
        &format!("--iodepth={depth}"),
        &format!("--size={size}"),
        "--output-format=json",
    ]);
    match w {
        Workload::RandRead => {
            cmd.args([
                "--rw=randread",
                "--time_based",
                &format!("--runtime={seconds}"),
                "--norandommap",
                "--randrepeat=0",
            ]);
        }
        Workload::Write => {
            cmd.args(["--rw=write", &format!("--io_size={}", count * 4096)]);
        }
    }
    let side = match w {
        Workload::RandRead => "read",
        Workload::Write => "write",
    };
    let f = run_fio_json(cmd, side)?;
    Ok(Figures {
        iops: f.iops,
        p50_us: f.p50_us,
        p99_us: f.p99_us,
        commands: f.ios,
    })
}

/// One direction of the first job of a fio run.
#[derive(Debug, Clone, Copy)]
pub struct FioSide {
    /// I/Os per second.
    pub iops: f64,
    /// Median completion latency (us).
    pub p50_us: Option<f64>,
    /// 99th percentile completion latency (us).
    pub p99_us: Option<f64>,
    /// I/Os counted (after the ramp, if any).
    pub ios: f64,
}

/// Run `cmd` (fio with `--output-format=json`) and read `side` ("read" or "write") of
/// its first job.
pub(crate) fn run_fio_json(mut cmd: Command, side: &str) -> io::Result<FioSide> {
    parse_fio_output(&cmd.stdin(Stdio::null()).output()?, side)
}

/// `side` ("read" or "write") of the first job of a finished fio run's JSON output.
pub fn parse_fio_output(out: &std::process::Output, side: &str) -> io::Result<FioSide> {
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "fio failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON document.
    let json = text
        .find('{')
        .and_then(|i| text.get(i..))
        .ok_or_else(|| io::Error::other("fio printed no JSON"))?;
    let v: serde_json::Value = serde_json::from_str(json).map_err(io::Error::other)?;
    let job = &v["jobs"][0][side];
    let iops = job["iops"]
        .as_f64()
        .ok_or_else(|| io::Error::other("no iops in fio's output"))?;
    let pct = &job["clat_ns"]["percentile"];
    Ok(FioSide {
        iops,
        p50_us: pct["50.000000"].as_f64().map(|v| v / 1000.0),
        p99_us: pct["99.000000"].as_f64().map(|v| v / 1000.0),
        ios: job["total_ios"].as_f64().unwrap_or(f64::NAN),
    })
}

#[cfg(test)]
mod tests {
    use super::parse_iscsi_perf;

    #[test]
    fn iscsi_perf_figure_is_the_whole_runs_average() {
        let text = "performing RANDOM READ with 32 parallel requests\n\
                    00:00:01 - lba 81659, iops current 28873 (112 MB/s), iops average 24574 (95 MB/s), in_flight 32, busy 0\n\
                    iops average 24893 (97 MB/s)\n\nfinished.\n";
        assert_eq!(parse_iscsi_perf(text), Some(24893.0));
        assert_eq!(parse_iscsi_perf("connected\nfinished.\n"), None);
    }
}
