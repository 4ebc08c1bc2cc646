//! `vsan-demo`: the README's main job.
//!
//! Creates a file-backed disk in a work directory under `target/`, serves it over NBD on a
//! free loopback port, and drives a mixed 4 KiB workload through the library's NBD client
//! (several connections, several requests in flight on each) for about ten seconds with a
//! live progress line. Every write carries a self-describing pattern; every read is
//! checked against the last write to that block. At the end it flushes, prints a summary
//! (IOPS, p50/p99 latency, bytes written), stops the server, reopens the image file
//! directly and verifies every block the workload wrote. Exit status 0 only if all of it
//! checks out.

use std::path::PathBuf;
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

#[derive(Parser, Debug)]
#[command(
    version,
    about = "vsan demo: a file-backed disk served over NBD under a verified 4K workload"
)]
struct Args {
    /// How long the workload runs, in seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Disk size in MiB.
    #[arg(long, default_value_t = 256)]
    size_mib: u64,
    /// NBD connections.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 8)]
    depth: usize,
    /// Percentage of reads in the mix.
    #[arg(long, default_value_t = 50)]
    read_pct: u32,
    /// Work directory (default: target/vsan-demo next to the binary's target dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
}

#[derive(Default)]
struct Totals {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_written: AtomicU64,
    mismatches: AtomicU64,
    errors: AtomicU64,
}

fn work_dir(arg: Option<PathBuf>) -> PathBuf {
    if let Some(d) = arg {
        return d;
    }
    // target/<profile>/vsan-demo -> target/vsan-demo
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent()?.parent().map(|t| t.join("vsan-demo")))
        .unwrap_or_else(|| PathBuf::from("target/vsan-demo"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vsan-demo: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("vsan-demo: {e}");
            ExitCode::from(1)
        }
    }
}

async fn run(args: Args) -> Result<bool, Box<dyn std::error::Error>> {
    let dir = work_dir(args.work_dir.clone());
    std::fs::create_dir_all(&dir)?;
    let image = dir.join("demo.img");
    let _ = std::fs::remove_file(&image);
    let size = args.size_mib << 20;
    let disk = FileOptions::new()
        .block_size(512)
        .create(size)
        .open(&image)?;
    println!(
        "vsan-demo: disk {} ({} MiB, file-backed)",
        image.display(),
        args.size_mib
    );

    let server = Server::new(vec![Export::new(
        "demo",
        Arc::new(disk.clone()) as Arc<dyn BlockDevice>,
    )])?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let serving = {
        let s = server.clone();
        tokio::spawn(async move { s.serve_tcp(listener).await })
    };
    println!("vsan-demo: serving NBD export \"demo\" on nbd://{addr}/demo");

    let blocks = size / BLOCK as u64;
    let log = Arc::new(BlockLog::new(blocks));
    let totals = Arc::new(Totals::default());
    let read_hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let write_hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let stop = Arc::new(AtomicBool::new(false));
    let workers = args.connections * args.depth;

    let mut clients = Vec::new();
    for _ in 0..args.connections {
        clients.push(Arc::new(Client::connect_tcp(&addr, "demo").await?));
    }
    let progress = ProgressBar::new_spinner();
    progress.set_style(ProgressStyle::with_template(
        "{spinner} {elapsed:>3} {msg}",
    )?);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let client = Arc::clone(&clients[w % args.connections]);
        let (log, totals, stop) = (Arc::clone(&log), Arc::clone(&totals), Arc::clone(&stop));
        let (rh, wh) = (Arc::clone(&read_hist), Arc::clone(&write_hist));
        let read_pct = args.read_pct;
        tasks.push(tokio::spawn(async move {
            // Worker w owns the blocks b with b % workers == w, so it alone writes them and
            // knows exactly what each must contain.
            let mut rng = SmallRng::seed_from_u64(0x5eed ^ w as u64);
            let owned = (blocks - w as u64).div_ceil(workers as u64);
            let mut local_r = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).ok();
            let mut local_w = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).ok();
            while !stop.load(Ordering::Relaxed) {
                let block = w as u64 + rng.random_range(0..owned) * workers as u64;
                let offset = block * BLOCK as u64;
                let t0 = Instant::now();
                if rng.random_range(0..100) < read_pct {
                    match client.read(offset, BLOCK as u32).await {
                        Ok(data) => {
                            if data[..] != expected_block(block, log.generation(block))[..] {
                                totals.mismatches.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(_) => {
                            totals.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if let Some(h) = local_r.as_mut() {
                        let _ = h.record(t0.elapsed().as_micros() as u64);
                    }
                    totals.reads.fetch_add(1, Ordering::Relaxed);
                } else {
                    let generation = log.generation(block) + 1;
                    match client
                        .write(offset, &expected_block(block, generation), false)
                        .await
                    {
                        Ok(()) => {
                            log.set_generation(block, generation);
                            totals
                                .bytes_written
                                .fetch_add(BLOCK as u64, Ordering::Relaxed);
                        }
                        Err(_) => {
                            totals.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if let Some(h) = local_w.as_mut() {
                        let _ = h.record(t0.elapsed().as_micros() as u64);
                    }
                    totals.writes.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let Some(h) = local_r {
                let _ = rh.lock().add(h);
            }
            if let Some(h) = local_w {
                let _ = wh.lock().add(h);
            }
        }));
    }

    let duration = Duration::from_secs_f64(args.seconds.max(0.1));
    let mut last = (Instant::now(), 0u64);
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let ops = totals.reads.load(Ordering::Relaxed) + totals.writes.load(Ordering::Relaxed);
        let rate = (ops - last.1) as f64 / last.0.elapsed().as_secs_f64();
        last = (Instant::now(), ops);
        progress.set_message(format!(
            "{:>9.0} IOPS  {:>8} ops  {:>7.1} MiB written  mismatches {}",
            rate,
            ops,
            totals.bytes_written.load(Ordering::Relaxed) as f64 / (1 << 20) as f64,
            totals.mismatches.load(Ordering::Relaxed)
        ));
        progress.tick();
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    progress.finish_and_clear();
    clients[0].flush().await?;

    // Summary.
    let (r, w) = (
        totals.reads.load(Ordering::Relaxed),
        totals.writes.load(Ordering::Relaxed),
    );
    let (rh, wh) = (read_hist.lock().clone(), write_hist.lock().clone());
    let mut all = rh.clone();
    all.add(&wh)?;
    println!();
    println!(
        "workload: 4 KiB random, {}% reads, {} connections x {} in flight, {:.1} s",
        args.read_pct, args.connections, args.depth, elapsed
    );
    println!(
        "  {:<6} {:>10} {:>10} {:>10} {:>10}",
        "op", "count", "IOPS", "p50 (us)", "p99 (us)"
    );
    for (name, n, h) in [("read", r, &rh), ("write", w, &wh), ("total", r + w, &all)] {
        println!(
            "  {:<6} {:>10} {:>10.0} {:>10} {:>10}",
            name,
            n,
            n as f64 / elapsed,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99)
        );
    }
    let written = totals.bytes_written.load(Ordering::Relaxed);
    println!(
        "  bytes written: {} ({:.1} MiB)",
        written,
        written as f64 / (1 << 20) as f64
    );

    // Stop serving, then check every block straight from the image file.
    for c in clients {
        if let Ok(c) = Arc::try_unwrap(c) {
            let _ = c.disconnect().await;
        }
    }
    server.shutdown();
    server.wait_idle().await;
    serving.await??;
    disk.flush().await?;
    let reopened = FileOptions::new().open(&image)?;
    let mut bad = 0u64;
    let mut checked = 0u64;
    const SPAN: u64 = 1 << 20;
    for start in (0..size).step_by(SPAN as usize) {
        let data = reopened.read(start, SPAN as usize).await?;
        for (i, chunk) in data.chunks(BLOCK).enumerate() {
            let block = start / BLOCK as u64 + i as u64;
            let generation = log.generation(block);
            if generation > 0 {
                checked += 1;
            }
            if chunk != &expected_block(block, generation)[..] {
                bad += 1;
            }
        }
    }
    let live = totals.mismatches.load(Ordering::Relaxed);
    let errors = totals.errors.load(Ordering::Relaxed);
    println!(
        "verify: {} reads checked live ({} mismatches), {} written blocks re-read from the image ({} mismatches), {} I/O errors",
        r, live, checked, bad, errors
    );
    let ok = live == 0 && bad == 0 && errors == 0 && w > 0;
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
