//! `vsan-bench cache`: what the write-back cache buys over the disk behind it.
//!
//! One process, everything side by side. The cache's fast device is a file on `/dev/shm`
//! mapped with [`FastDevice::map_file`] (standing in for persistent memory); its backing
//! store is a [`FileDevice`] on a real disk file whose flush is `fdatasync`. The cache
//! persists every write before acknowledging it, so each baseline is a *durable* write on
//! the backing file (FUA, or a write and a flush) — the same durability per
//! acknowledged write.
//!
//! 1. **QD1 4 KiB random write latency**, in alternating rounds: through the cache;
//!    the fast device's own cost for the same work (copy a 64-byte header and 4 KiB into
//!    a mapping of another `/dev/shm` file, at the positions the cache's log would use,
//!    and `msync` that range — what [`FastDevice`] does under the cache, with no cache
//!    around it); and the backing file alone with FUA writes (`pwrite` + `fdatasync`).
//!    The cache minus the fast device is the cache's software overhead.
//! 2. **QD32 4 KiB random write IOPS**: the backing file alone, with FUA writes (32 in
//!    flight) and with batches of 32 writes followed by one flush (each write
//!    acknowledged after it); the cache with a working set inside its log, from an empty
//!    log up to just below the high watermark (so no destage runs: its write path); and,
//!    for context, the cache in steady state on a small log with a working set inside it
//!    and one far larger than it, where destage throughput limits it.
//! 3. **4 KiB random reads on one thread** (a current-thread runtime): cache hits,
//!    cache misses (served by the backing file's page cache), and the backing file alone.
//! 4. **QD1 4 KiB write latency while destaging** (e), on two small logs over the same
//!    backing file: a write due every 400 us (slower than the paced destager drains),
//!    measured with the log below the low watermark (no destage), while the paced
//!    destager takes it from just under the high watermark towards the low one, and the
//!    same with pacing off (`min_destage_rate` huge: full speed), alternating in rounds.

use crate::median;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinSet;
use vsan_cache::format::{HEADER_LEN, LOG_START, place, record_len};
use vsan_cache::{CacheConfig, CacheMode, FastDevice, WriteBackCache};
use vsan_core::{BlockDevice, FileDevice, FileOptions, IoFlags};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;

/// Options of the run.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Seconds of each throughput measurement (QD32 and reads).
    pub seconds: f64,
    /// Rounds of the QD1 and QD32 comparisons (the paths alternate within each).
    pub rounds: u32,
    /// QD1 writes per path per round (the backing file alone stops earlier when it has
    /// run for `seconds`).
    pub count: u32,
    /// Size of the cache's fast device in MiB (its log is that minus 8 KiB).
    pub cache_mib: u64,
    /// Size of the small cache (steady-state figures) in MiB.
    pub small_cache_mib: u64,
    /// Size of the backing file in MiB.
    pub backing_mib: u64,
    /// Queue depth of the throughput comparison.
    pub depth: usize,
    /// Directory of the backing file (a real disk, not tmpfs).
    pub dir: PathBuf,
    /// Directory of the fast device files (tmpfs).
    pub shm_dir: PathBuf,
}

/// Removes the benchmark's files however the run ends.
struct Files(Vec<PathBuf>);

impl Drop for Files {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Write `len` bytes of non-zero data to a new file at `path` and sync it, so every
/// block is allocated (on tmpfs: every page exists before anything maps it).
fn fill(path: &Path, len: u64) -> Result<(), BoxError> {
    let mut f = File::create(path)?;
    let mut buf = vec![0u8; MIB as usize];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in buf.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    for _ in 0..len.div_ceil(MIB) {
        f.write_all(&buf)?;
    }
    f.set_len(len)?;
    f.sync_all()?;
    Ok(())
}

/// 4 KiB of data that differs per write (the cache checksums every write's data).
fn block_data(seed: u64) -> Bytes {
    let mut v = vec![0u8; BLOCK as usize];
    for (i, c) in v.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64).to_le_bytes());
    }
    Bytes::from(v)
}

fn hist() -> Result<Histogram<u64>, BoxError> {
    Ok(Histogram::new_with_bounds(1, 60_000_000_000, 3)?)
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

/// A file on tmpfs mapped shared and written the way the cache's mapped fast device
/// writes its log: the fast device's own cost, with no cache around it.
#[derive(Debug)]
struct MappedLog {
    ptr: *mut u8,
    len: usize,
    log_len: u64,
    page: usize,
    pos: u64,
    _file: File,
}

impl MappedLog {
    fn open(path: &Path) -> Result<MappedLog, BoxError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let len = usize::try_from(file.metadata()?.len())?;
        let log_len = (len as u64).saturating_sub(LOG_START) / BLOCK * BLOCK;
        // SAFETY: a fresh shared mapping of a file we opened read-write; the kernel picks
        // the address, so it overlaps nothing else.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: sysconf reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        Ok(MappedLog {
            ptr: ptr.cast(),
            len,
            log_len,
            page,
            pos: 0,
            _file: file,
        })
    }

    /// Append one record (header, then one block) where the cache's log would put it,
    /// and `msync` its range (page-aligned, as memmap2's `flush_range` does).
    fn append(&mut self, header: &[u8; HEADER_LEN], data: &[u8]) -> Result<(), BoxError> {
        let p = place(self.pos, (data.len() as u64 / BLOCK) as u32, self.log_len)?;
        let off = (LOG_START + p.start % self.log_len) as usize;
        let end = off + header.len() + data.len();
        if end > self.len {
            return Err("record past the end of the mapping".into());
        }
        // SAFETY: `off..end` lies inside the mapping (checked above), and only this
        // struct, borrowed mutably, writes or reads it.
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), self.ptr.add(off), header.len());
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.ptr.add(off + header.len()),
                data.len(),
            );
        }
        let start = off / self.page * self.page;
        // SAFETY: `start..end` is inside the mapping and `start` is page-aligned.
        let r = unsafe { libc::msync(self.ptr.add(start).cast(), end - start, libc::MS_SYNC) };
        if r != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        self.pos = p.next;
        Ok(())
    }
}

impl Drop for MappedLog {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, unmapped once; no reference into it lives.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// CPU time the calling thread has used.
fn thread_cpu() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes `ts`, which outlives the call.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (r == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

/// Settings of every cache in the run: write-back, background destage, no sequential
/// cutoff (random 4 KiB writes would not trip it anyway).
fn cache_config() -> CacheConfig {
    CacheConfig {
        mode: Some(CacheMode::WriteBack),
        sequential_cutoff: 0,
        background: true,
        ..CacheConfig::default()
    }
}

/// Format the fast device file at `path` and open a cache on it over `backing`.
async fn open_cache(path: &Path, backing: &FileDevice) -> Result<Arc<WriteBackCache>, BoxError> {
    open_cache_with(path, backing, cache_config()).await
}

/// [`open_cache`] with settings of its own.
async fn open_cache_with(
    path: &Path,
    backing: &FileDevice,
    cfg: CacheConfig,
) -> Result<Arc<WriteBackCache>, BoxError> {
    let fast = FastDevice::map_file(path, None)?;
    WriteBackCache::format(&fast, backing, CacheMode::WriteBack).await?;
    let backing: Arc<dyn BlockDevice> = Arc::new(backing.clone());
    Ok(Arc::new(WriteBackCache::open(fast, backing, cfg).await?))
}

/// QD1 writes of 4 KiB at random blocks of `blocks`; latency in ns. Stops after `count`
/// writes or `max`, whichever comes first.
async fn qd1_writes(
    dev: &dyn BlockDevice,
    blocks: u64,
    flags: IoFlags,
    count: u32,
    max: Duration,
    seed: u64,
) -> Result<Histogram<u64>, BoxError> {
    let mut h = hist()?;
    let mut rng = SmallRng::seed_from_u64(seed);
    let data: Vec<Bytes> = (0..16).map(|i| block_data(seed ^ i)).collect();
    let t0 = Instant::now();
    for i in 0..count as usize {
        let off = rng.random_range(0..blocks) * BLOCK;
        let d = data[i % data.len()].clone();
        let t = Instant::now();
        dev.write(off, d, flags).await?;
        h.record(t.elapsed().as_nanos() as u64)?;
        if t0.elapsed() >= max {
            break;
        }
    }
    Ok(h)
}

/// The fast device alone: `count` records appended QD1; latency in ns.
fn qd1_mapped(log: &mut MappedLog, count: u32, seed: u64) -> Result<Histogram<u64>, BoxError> {
    let mut h = hist()?;
    let data: Vec<Bytes> = (0..16).map(|i| block_data(seed ^ i)).collect();
    let mut header = [0u8; HEADER_LEN];
    header[..8].copy_from_slice(&seed.to_le_bytes());
    for i in 0..count as usize {
        let d = &data[i % data.len()];
        let t = Instant::now();
        log.append(&header, d)?;
        h.record(t.elapsed().as_nanos() as u64)?;
    }
    Ok(h)
}

/// `depth` tasks writing 4 KiB at random blocks of `first..first + blocks`, each write
/// awaited before the task issues its next, until stopped or `limit` writes issued.
struct Writers {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    set: JoinSet<vsan_core::Result<()>>,
}

impl Writers {
    fn start(
        dev: &Arc<dyn BlockDevice>,
        depth: usize,
        (first, blocks): (u64, u64),
        flags: IoFlags,
        limit: u64,
    ) -> Writers {
        let done = Arc::new(AtomicU64::new(0));
        let issued = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let mut set = JoinSet::new();
        for w in 0..depth {
            let (dev, done, issued, stop) =
                (dev.clone(), done.clone(), issued.clone(), stop.clone());
            set.spawn(async move {
                let mut rng = SmallRng::seed_from_u64(w as u64 ^ 0xcace);
                let data: Vec<Bytes> = (0..4).map(|i| block_data(w as u64 * 4 + i)).collect();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed)
                    && issued.fetch_add(1, Ordering::Relaxed) < limit
                {
                    let off = (first + rng.random_range(0..blocks)) * BLOCK;
                    dev.write(off, data[i % data.len()].clone(), flags).await?;
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                Ok(())
            });
        }
        Writers { done, stop, set }
    }

    fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Wait until every task has finished (reached the limit), for at most `max`.
    async fn wait(&mut self, max: Duration) -> Result<(), BoxError> {
        let deadline = tokio::time::Instant::now() + max;
        while let Ok(Some(r)) = tokio::time::timeout_at(deadline, self.set.join_next()).await {
            r??;
        }
        Ok(())
    }

    async fn stop(mut self) -> Result<(), BoxError> {
        self.stop.store(true, Ordering::Relaxed);
        while let Some(r) = self.set.join_next().await {
            r??;
        }
        Ok(())
    }
}

/// IOPS of `writers` over `window`, counted from now.
async fn window_iops(writers: &Writers, window: Duration) -> f64 {
    let (d0, t0) = (writers.done(), Instant::now());
    tokio::time::sleep(window).await;
    (writers.done() - d0) as f64 / t0.elapsed().as_secs_f64()
}

/// The backing file alone at queue depth `depth`: batches of `depth` writes (each a
/// `pwrite` to the page cache), then one `fdatasync` that makes all of them durable; a
/// write counts once that flush is done. IOPS.
async fn batched_durable_writes(
    dev: &FileDevice,
    depth: usize,
    blocks: u64,
    window: Duration,
) -> Result<f64, BoxError> {
    let mut rng = SmallRng::seed_from_u64(0xba7c);
    let data: Vec<Bytes> = (0..4).map(block_data).collect();
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < window {
        let batch = (0..depth).map(|i| {
            let off = rng.random_range(0..blocks) * BLOCK;
            dev.write(off, data[i % data.len()].clone(), IoFlags::empty())
        });
        for r in futures_util::future::join_all(batch).await {
            r?;
        }
        dev.flush().await?;
        n += depth as u64;
    }
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}

/// Random 4 KiB reads of blocks `first..first + blocks`, one at a time, for `window`.
/// Returns (IOPS by the wall clock, IOPS per CPU-second of this thread).
async fn reads(
    dev: &dyn BlockDevice,
    (first, blocks): (u64, u64),
    window: Duration,
) -> Result<(f64, f64), BoxError> {
    let mut rng = SmallRng::seed_from_u64(0x4ead);
    let (t0, c0) = (Instant::now(), thread_cpu());
    let mut n = 0u64;
    while t0.elapsed() < window {
        for _ in 0..256 {
            let off = (first + rng.random_range(0..blocks)) * BLOCK;
            let b = dev.read(off, BLOCK as usize).await?;
            std::hint::black_box(&b);
        }
        n += 256;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = match (c0, thread_cpu()) {
        (Some(a), Some(b)) => (b - a).as_secs_f64(),
        _ => f64::NAN,
    };
    Ok((n as f64 / wall, n as f64 / cpu))
}

/// Run the benchmark and print its tables.
pub fn run(o: Opts) -> Result<(), BoxError> {
    if o.depth == 0 || o.rounds == 0 || o.count == 0 {
        return Err("depth, rounds and count must be at least 1".into());
    }
    if o.cache_mib == 0 || o.small_cache_mib == 0 || o.backing_mib < 2 {
        return Err("the caches need at least 1 MiB and the backing file 2 MiB".into());
    }
    if !(o.seconds > 0.0 && o.seconds.is_finite()) {
        return Err("seconds must be a positive number".into());
    }
    std::fs::create_dir_all(&o.dir)?;
    let pid = std::process::id();
    let backing_path = o.dir.join(format!("cache-backing-{pid}.img"));
    let fast_path = o.shm_dir.join(format!("vsan-bench-cache-{pid}.img"));
    let small_path = o.shm_dir.join(format!("vsan-bench-cache-small-{pid}.img"));
    let mapped_path = o.shm_dir.join(format!("vsan-bench-mapped-{pid}.img"));
    let full_path = o.shm_dir.join(format!("vsan-bench-cache-full-{pid}.img"));
    let _files = Files(vec![
        backing_path.clone(),
        fast_path.clone(),
        small_path.clone(),
        mapped_path.clone(),
        full_path.clone(),
    ]);
    let size = o.backing_mib * MIB;
    println!(
        "filling the backing file {} ({} MiB) and the fast device files in {}...",
        backing_path.display(),
        o.backing_mib,
        o.shm_dir.display()
    );
    fill(&backing_path, size)?;
    fill(&fast_path, o.cache_mib * MIB)?;
    fill(&small_path, o.small_cache_mib * MIB)?;
    fill(&mapped_path, o.cache_mib * MIB)?;
    fill(&full_path, o.small_cache_mib * MIB)?;
    let backing = FileOptions::new().open(&backing_path)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(write_side(
        &o,
        &backing,
        &fast_path,
        &small_path,
        &mapped_path,
    ))?;

    // Reads: a fresh cache holding a known set of blocks, read on one thread.
    let hot = (64 * MIB / BLOCK).min(size / BLOCK / 2);
    let cache = rt.block_on(async {
        let cache = open_cache(&fast_path, &backing).await?;
        for b in 0..hot {
            cache
                .write(b * BLOCK, block_data(b), IoFlags::empty())
                .await?;
        }
        Ok::<_, BoxError>(cache)
    })?;
    let one = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let window = Duration::from_secs_f64(o.seconds);
    let (hit, hit_cpu) = one.block_on(reads(cache.as_ref(), (0, hot), window))?;
    let (miss, miss_cpu) =
        one.block_on(reads(cache.as_ref(), (hot, size / BLOCK - hot), window))?;
    let (plain, plain_cpu) = one.block_on(reads(&backing, (0, size / BLOCK), window))?;
    let stats = cache.stats();
    println!();
    println!(
        "(d) 4 KiB random reads, one thread (current-thread runtime), {:.1} s each; the \
         backing file's pages are in the page cache:",
        o.seconds
    );
    println!("| reads | IOPS (wall clock) | IOPS per CPU-second |");
    println!("|---|---:|---:|");
    println!(
        "| cache hits ({} MiB cached) | {hit:.0} | {hit_cpu:.0} |",
        hot * BLOCK / MIB
    );
    println!("| cache misses (read from the backing file) | {miss:.0} | {miss_cpu:.0} |");
    println!("| backing file alone | {plain:.0} | {plain_cpu:.0} |");
    println!(
        "target: cache hits >= 1M IOPS per core: {:.2}M -> {}  (cache counted {} hits, {} \
         misses)",
        hit_cpu / 1e6,
        verdict(hit_cpu >= 1e6),
        stats.read_hits,
        stats.read_misses
    );
    drop(cache);

    rt.block_on(destage_latency(&o, &backing, &small_path, &full_path))?;
    drop(rt);
    Ok(())
}

async fn write_side(
    o: &Opts,
    backing: &FileDevice,
    fast_path: &Path,
    small_path: &Path,
    mapped_path: &Path,
) -> Result<(), BoxError> {
    let size = o.backing_mib * MIB;
    let blocks = size / BLOCK;
    let max = Duration::from_secs_f64(o.seconds);
    let backing_dyn: Arc<dyn BlockDevice> = Arc::new(backing.clone());

    // (a), (b): QD1 latency.
    let cache = open_cache(fast_path, backing).await?;
    let mut mapped = MappedLog::open(mapped_path)?;
    let (mut hc, mut hm, mut hb) = (hist()?, hist()?, hist()?);
    for round in 0..o.rounds {
        let seed = u64::from(round);
        hc.add(
            qd1_writes(
                cache.as_ref(),
                blocks,
                IoFlags::empty(),
                o.count,
                Duration::MAX,
                seed,
            )
            .await?,
        )?;
        hm.add(qd1_mapped(&mut mapped, o.count, seed)?)?;
        hb.add(qd1_writes(backing, blocks, IoFlags::FUA, o.count, max, seed).await?)?;
    }
    let s = cache.stats();
    drop(cache);
    drop(mapped);
    println!();
    println!(
        "(a, b) QD1 4 KiB random writes over {} MiB, {} rounds alternating, up to {} per \
         path per round (us):",
        o.backing_mib, o.rounds, o.count
    );
    println!("| path | writes | p50 | p99 | mean |");
    println!("|---|---:|---:|---:|---:|");
    for (name, h) in [
        ("cache, write-back (fast device: mapped file on tmpfs)", &hc),
        (
            "fast device alone: copy 64 B + 4 KiB into the mapping, msync",
            &hm,
        ),
        ("backing file alone: FUA write (pwrite + fdatasync)", &hb),
    ] {
        println!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} |",
            h.len(),
            us(h, 0.5),
            us(h, 0.99),
            h.mean() / 1000.0
        );
    }
    println!(
        "cache during (a): {} commits for {} appends, occupancy {:.0}% at the end, {} \
         destage epochs",
        s.commits,
        s.appends,
        s.occupancy * 100.0,
        s.destage_epochs
    );
    let (p50_ratio, mean_ratio) = (us(&hb, 0.5) / us(&hc, 0.5), hb.mean() / hc.mean());
    println!(
        "(a) target: backing / cache >= 10x: p50 {p50_ratio:.0}x, mean {mean_ratio:.0}x -> {}",
        verdict(p50_ratio >= 10.0 && mean_ratio >= 10.0)
    );
    let overhead = us(&hc, 0.5) - us(&hm, 0.5);
    println!(
        "(b) target: cache p50 - fast device p50 <= 2 us: {overhead:.2} us (means: {:.2} us) \
         -> {}",
        (hc.mean() - hm.mean()) / 1000.0,
        verdict(overhead <= 2.0)
    );

    // (c): QD32 throughput.
    let depth = o.depth;
    let log_len = o.cache_mib * MIB - LOG_START;
    // Inside the log, and room in it for the burst: up to just below the high watermark
    // (60%), where background destage would start.
    let ws_in = (log_len / 4 / BLOCK).min(blocks);
    let burst = log_len * 55 / 100 / record_len(1);
    let (mut fua, mut batch, mut burst_iops) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..o.rounds {
        let cache = open_cache(fast_path, backing).await?;
        let cache_dyn: Arc<dyn BlockDevice> = cache.clone();
        let t0 = Instant::now();
        let mut w = Writers::start(&cache_dyn, depth, (0, ws_in), IoFlags::empty(), burst);
        w.wait(max * 4).await?;
        let n = w.done();
        burst_iops.push(n as f64 / t0.elapsed().as_secs_f64());
        w.stop().await?;
        let epochs = cache.stats().destage_epochs;
        if epochs > 0 {
            println!("note: {epochs} destage epochs ran during a burst");
        }
        drop(cache_dyn);
        drop(cache);

        backing.flush().await?;
        let w = Writers::start(&backing_dyn, depth, (0, ws_in), IoFlags::FUA, u64::MAX);
        fua.push(window_iops(&w, max).await);
        w.stop().await?;

        batch.push(batched_durable_writes(backing, depth, ws_in, max).await?);
    }

    // Steady state on a small log: the destager runs, and limits the cache.
    let small_log = o.small_cache_mib * MIB - LOG_START;
    let mut steady = Vec::new();
    for (what, ws) in [
        ("inside the log", (small_log / 2 / BLOCK).min(blocks)),
        ("larger than the log", blocks),
    ] {
        let cache = open_cache(small_path, backing).await?;
        let cache_dyn: Arc<dyn BlockDevice> = cache.clone();
        let w = Writers::start(&cache_dyn, depth, (0, ws), IoFlags::empty(), u64::MAX);
        let t0 = Instant::now();
        // Fill the log to the high watermark first.
        let high = f64::from(cache_config().high_watermark) / 100.0;
        while cache.stats().occupancy < high && t0.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let s0 = cache.stats();
        let iops = window_iops(&w, max).await;
        let s1 = cache.stats();
        w.stop().await?;
        let destaged = (s1.destaged_bytes - s0.destaged_bytes) as f64 / MIB as f64 / o.seconds;
        steady.push((what, ws, iops, destaged, s1.occupancy));
        drop(cache_dyn);
        drop(cache);
    }

    let (fua_m, batch_m, burst_m) = (median(&fua), median(&batch), median(&burst_iops));
    let base = fua_m.max(batch_m);
    println!();
    println!(
        "(c) 4 KiB random writes, QD{depth}, every write durable when acknowledged; medians \
         of {} rounds ({:.1} s per backing run):",
        o.rounds, o.seconds
    );
    println!("| path | working set | IOPS | vs backing (best) |");
    println!("|---|---|---:|---:|");
    println!(
        "| backing file alone: FUA writes ({depth} in flight) | {} MiB | {fua_m:.0} | {:.2}x |",
        ws_in * BLOCK / MIB,
        fua_m / base
    );
    println!(
        "| backing file alone: {depth} writes, then one fdatasync | {} MiB | {batch_m:.0} | \
         {:.2}x |",
        ws_in * BLOCK / MIB,
        batch_m / base
    );
    println!(
        "| cache, {} MiB log filling from empty to 55% (write path, no destage) | {} MiB | \
         {burst_m:.0} | **{:.1}x** |",
        log_len / MIB,
        ws_in * BLOCK / MIB,
        burst_m / base
    );
    for (what, ws, iops, destaged, occ) in &steady {
        println!(
            "| cache, {} MiB log, steady state, working set {what} (destage {destaged:.0} \
             MiB/s, {:.0}% full) | {} MiB | {iops:.0} | {:.1}x |",
            small_log / MIB,
            occ * 100.0,
            ws * BLOCK / MIB,
            iops / base
        );
    }
    println!(
        "(c) target: cache write path >= 5x the backing file's best: {:.1}x -> {}  (burst \
         rounds: {})",
        burst_m / base,
        verdict(burst_m >= 5.0 * base),
        burst_iops
            .iter()
            .map(|v| format!("{v:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Gap between the starts of two measured QD1 writes in (e): 2500 writes a second, about
/// 10 MiB/s of log. The writes must come slower than the paced destager empties the
/// log, or the log climbs back to the high watermark, where destage runs at full speed
/// whatever the pacing.
const E_GAP: Duration = Duration::from_micros(400);

/// What one phase of (e) measured.
struct Phase {
    h: Histogram<u64>,
    /// Measured stretches, and their seconds together.
    stretches: u32,
    secs: f64,
    /// Destage epochs completed, and log bytes destaged, during the stretches.
    epochs: u64,
    destaged: u64,
    /// Lowest and highest occupancy seen before a measured write.
    occ: (f64, f64),
    /// Measured writes issued with the log at or above the high watermark.
    above_high: u64,
}

impl Phase {
    fn new() -> Result<Phase, BoxError> {
        Ok(Phase {
            h: hist()?,
            stretches: 0,
            secs: 0.0,
            epochs: 0,
            destaged: 0,
            occ: (f64::INFINITY, 0.0),
            above_high: 0,
        })
    }
}

/// QD1 4 KiB writes at random blocks of `first..first + blocks`.
struct Qd1 {
    rng: SmallRng,
    data: Vec<Bytes>,
    i: usize,
    first: u64,
    blocks: u64,
    /// When the next measured write is due.
    next: Instant,
}

impl Qd1 {
    fn new((first, blocks): (u64, u64), seed: u64) -> Qd1 {
        Qd1 {
            rng: SmallRng::seed_from_u64(seed),
            data: (0..16).map(|i| block_data(seed ^ i)).collect(),
            i: 0,
            first,
            blocks,
            next: Instant::now(),
        }
    }

    /// One write; its latency.
    async fn write(&mut self, cache: &WriteBackCache) -> Result<Duration, BoxError> {
        let off = (self.first + self.rng.random_range(0..self.blocks)) * BLOCK;
        let d = self.data[self.i % self.data.len()].clone();
        self.i += 1;
        let t = Instant::now();
        cache.write(off, d, IoFlags::empty()).await?;
        Ok(t.elapsed())
    }

    /// One measured write, then sleep until the next is due, [`E_GAP`] after this one
    /// was (a thread sleep: this runs on the thread of `block_on`, not on a runtime
    /// worker, and tokio's timer is too coarse for 400 us). A sleep that overran
    /// shortens the next; a write that starts late does not make the next one early.
    async fn measured(
        &mut self,
        cache: &WriteBackCache,
        p: &mut Phase,
        hi: f64,
    ) -> Result<(), BoxError> {
        let now = Instant::now();
        if self.next < now {
            self.next = now;
        }
        std::thread::sleep(self.next - now);
        self.next += E_GAP;
        let occ = cache.stats().occupancy;
        p.occ = (p.occ.0.min(occ), p.occ.1.max(occ));
        p.above_high += u64::from(occ >= hi);
        let t = self.write(cache).await?;
        p.h.record(t.as_nanos() as u64)?;
        Ok(())
    }
}

/// Write the whole log of a freshly opened cache once (not measured; draining before
/// the high watermark), so that no measured write pays the first touch of a page of the
/// new mapping.
async fn e_warm(cache: &WriteBackCache, w: &mut Qd1) -> Result<(), BoxError> {
    let mut written = 0;
    while written < cache.log_len() + record_len(1) {
        if cache.stats().occupancy >= 0.5 {
            cache.drain().await?;
        }
        for _ in 0..64 {
            w.write(cache).await?;
        }
        written += 64 * record_len(1);
    }
    cache.drain().await?;
    Ok(())
}

/// (e) idle: measured writes with the log below the low watermark `lo` (a fraction), so
/// no destage runs, until `p` holds `until` seconds; the log is drained (not measured)
/// whenever it gets within 3% of the watermark.
async fn e_idle(
    cache: &WriteBackCache,
    w: &mut Qd1,
    lo: f64,
    p: &mut Phase,
    until: f64,
) -> Result<(), BoxError> {
    while p.secs < until {
        if cache.stats().occupancy >= lo - 0.03 {
            cache.drain().await?;
        }
        p.stretches += 1;
        let (s0, t0) = (cache.stats(), Instant::now());
        while cache.stats().occupancy < lo - 0.03 && p.secs + t0.elapsed().as_secs_f64() < until {
            w.measured(cache, p, 1.0).await?;
        }
        p.secs += t0.elapsed().as_secs_f64();
        let s1 = cache.stats();
        p.epochs += s1.destage_epochs - s0.destage_epochs;
        p.destaged += s1.destaged_bytes - s0.destaged_bytes;
    }
    Ok(())
}

/// (e) destaging: push the log (not measured) just above the high watermark `hi`, wait
/// for the full-speed epoch that starts there to take it back under, then measure while
/// the destager takes it down to the low watermark `lo`; again until `p` holds `until`
/// seconds.
async fn e_destaging(
    cache: &WriteBackCache,
    w: &mut Qd1,
    (lo, hi): (f64, f64),
    p: &mut Phase,
    until: f64,
) -> Result<(), BoxError> {
    while p.secs < until && p.stretches < 1000 {
        let t = Instant::now();
        while cache.stats().occupancy < hi + 0.01 {
            for _ in 0..64 {
                w.write(cache).await?;
            }
            if t.elapsed() > Duration::from_secs(10) {
                return Err("(e): could not fill the log to its high watermark".into());
            }
        }
        while cache.stats().occupancy >= hi {
            if t.elapsed() > Duration::from_secs(10) {
                return Err(
                    "(e): the destager did not take the log under its high watermark".into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        p.stretches += 1;
        let (s0, t0) = (cache.stats(), Instant::now());
        while cache.stats().occupancy > lo + 0.01 && p.secs + t0.elapsed().as_secs_f64() < until {
            w.measured(cache, p, hi).await?;
        }
        p.secs += t0.elapsed().as_secs_f64();
        let s1 = cache.stats();
        p.epochs += s1.destage_epochs - s0.destage_epochs;
        p.destaged += s1.destaged_bytes - s0.destaged_bytes;
    }
    Ok(())
}

/// (e): QD1 write latency on a small log, idle, while a paced destage runs, and while a
/// destage at full speed runs. Two caches over the same backing file (disjoint working
/// sets), one with the default pacing and one without; the three phases alternate in
/// `o.rounds` rounds, so that load from outside lands on all of them alike.
async fn destage_latency(
    o: &Opts,
    backing: &FileDevice,
    paced_path: &Path,
    full_path: &Path,
) -> Result<(), BoxError> {
    let window = o.seconds;
    let small_log = o.small_cache_mib * MIB - LOG_START;
    let blocks = (small_log / 4 / BLOCK).min(o.backing_mib * MIB / BLOCK / 2);
    let cfg = cache_config();
    let (lo, hi) = (
        f64::from(cfg.low_watermark) / 100.0,
        f64::from(cfg.high_watermark) / 100.0,
    );
    let full_cfg = CacheConfig {
        min_destage_rate: u64::MAX / 2,
        ..cfg.clone()
    };

    let started = Instant::now();
    let (mut wp, mut wf) = (
        Qd1::new((0, blocks), 0xe0),
        Qd1::new((blocks, blocks), 0xe1),
    );
    let pc = open_cache_with(paced_path, backing, cfg.clone()).await?;
    let fc = open_cache_with(full_path, backing, full_cfg).await?;
    e_warm(&pc, &mut wp).await?;
    e_warm(&fc, &mut wf).await?;
    let (mut idle, mut paced, mut full) = (Phase::new()?, Phase::new()?, Phase::new()?);
    for r in 1..=o.rounds {
        let until = window * f64::from(r) / f64::from(o.rounds);
        e_idle(&pc, &mut wp, lo, &mut idle, until).await?;
        pc.drain().await?;
        e_destaging(&pc, &mut wp, (lo, hi), &mut paced, until).await?;
        pc.drain().await?;
        e_destaging(&fc, &mut wf, (lo, hi), &mut full, until).await?;
        fc.drain().await?;
    }
    drop(pc);
    drop(fc);
    let took = started.elapsed().as_secs_f64();

    println!();
    println!(
        "(e) QD1 4 KiB random writes while destaging: {} MiB log (high {}% / low {}%, {} \
         MiB epochs), working set {} MiB, a write due every {} us (~{:.0} MiB/s of log), \
         {:.1} s measured per phase in {} rounds, {took:.1} s in all (us):",
        small_log / MIB,
        cfg.high_watermark,
        cfg.low_watermark,
        cfg.epoch_bytes / MIB,
        blocks * BLOCK / MIB,
        E_GAP.as_micros(),
        record_len(1) as f64 / E_GAP.as_secs_f64() / MIB as f64,
        window,
        o.rounds
    );
    println!(
        "| phase | writes | measured (s, stretches) | destage epochs | destaged (MiB/s) | \
         occupancy | p50 | p99 | p99.9 | max |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|");
    for (name, p) in [
        ("idle: below the low watermark, no destage", &idle),
        ("paced destage (PI controller, default settings)", &paced),
        (
            "full-speed destage (min_destage_rate = u64::MAX / 2)",
            &full,
        ),
    ] {
        println!(
            "| {name} | {} | {:.2} ({}) | {} | {:.1} | {:.0}-{:.0}% | {:.2} | {:.2} | {:.2} | \
             {:.0} |",
            p.h.len(),
            p.secs,
            p.stretches,
            p.epochs,
            p.destaged as f64 / MIB as f64 / p.secs.max(1e-9),
            p.occ.0 * 100.0,
            p.occ.1 * 100.0,
            us(&p.h, 0.5),
            us(&p.h, 0.99),
            us(&p.h, 0.999),
            p.h.max() as f64 / 1000.0
        );
    }
    for (name, p) in [("paced", &paced), ("full-speed", &full)] {
        println!(
            "(e) {name} / idle: p50 {:.2}x, p99 {:.2}x, p99.9 {:.2}x  ({} measured writes \
             issued at or above the high watermark)",
            us(&p.h, 0.5) / us(&idle.h, 0.5),
            us(&p.h, 0.99) / us(&idle.h, 0.99),
            us(&p.h, 0.999) / us(&idle.h, 0.999),
            p.above_high
        );
    }
    Ok(())
}
