//! The cache's policies, each checked by its effect: sequential cutoff (bytes bypassed,
//! data right), watermarks (dirty level held between them), and run-time mode switches
//! (data right across every switch, writes landing where the mode says).

use std::time::{Duration, Instant};

use bytes::Bytes;
use vsan_cache::{CacheConfig, CacheMode, FastDevice, WriteBackCache};
use vsan_core::{BlockDevice, IoFlags};

mod common;

use common::{cache_over, mem};

const BS: u64 = 4096;

/// Block `b` as written by write number `w`.
fn pattern(w: u64, b: u64, n: u64) -> Bytes {
    let mut v = Vec::with_capacity((n * BS) as usize);
    for i in 0..n {
        let tag = ((w << 32) | (b + i)).to_le_bytes();
        for _ in 0..BS / 8 {
            v.extend_from_slice(&tag);
        }
    }
    Bytes::from(v)
}

/// A model of the disk: block -> contents.
struct Model(Vec<u8>);

impl Model {
    fn new(size: u64) -> Model {
        Model(vec![0; size as usize])
    }
    fn write(&mut self, off: u64, data: &[u8]) {
        self.0[off as usize..off as usize + data.len()].copy_from_slice(data);
    }
    async fn check(&self, dev: &dyn BlockDevice, what: &str) {
        let max = 1 << 20;
        let mut off = 0;
        while off < self.0.len() {
            let n = max.min(self.0.len() - off);
            let got = dev.read(off as u64, n).await.unwrap();
            if got[..] != self.0[off..off + n] {
                let first = (0..n).find(|&i| got[i] != self.0[off + i]).unwrap();
                panic!("{what}: first difference at byte {}", off + first);
            }
            off += n;
        }
    }
}

#[tokio::test]
async fn sequential_cutoff_bypasses_long_runs_and_keeps_data_right() {
    let size = 32 << 20;
    let backing = mem(size);
    let cfg = CacheConfig {
        background: false,
        sequential_cutoff: 1 << 20,
        ..CacheConfig::default()
    };
    let (_fast, c) = cache_over(8 << 20, &backing, cfg).await;
    let mut model = Model::new(size);
    // A cached block in the middle of the coming run: the run must win over it.
    let d = pattern(1, 100, 1);
    c.write(100 * BS, d.clone(), IoFlags::empty())
        .await
        .unwrap();
    model.write(100 * BS, &d);
    // 8 MiB sequential in 64 KiB writes.
    let chunk = 16u64;
    for (i, b) in (0..2048).step_by(chunk as usize).enumerate() {
        let d = pattern(2 + i as u64, b, chunk);
        c.write(b * BS, d.clone(), IoFlags::empty()).await.unwrap();
        model.write(b * BS, &d);
    }
    let s = c.stats();
    let run = 8u64 << 20;
    assert!(
        s.bypassed_bytes >= run - (1 << 20) - chunk * BS,
        "bypassed only {} of {run}",
        s.bypassed_bytes
    );
    assert!(
        s.cached_bytes <= (1 << 20) + chunk * BS + BS,
        "cached {}",
        s.cached_bytes
    );
    model.check(&c, "after the run").await;
    // Random small writes are not a run: nothing more bypasses.
    let before = c.stats().bypassed_bytes;
    for i in 0..200u64 {
        let b = (i * 7919) % 8000;
        let d = pattern(1000 + i, b, 1);
        c.write(b * BS, d.clone(), IoFlags::empty()).await.unwrap();
        model.write(b * BS, &d);
    }
    assert_eq!(c.stats().bypassed_bytes, before);
    // One write at least as large as the cutoff bypasses on its own.
    let d = pattern(5000, 6000, 256);
    c.write(6000 * BS, d.clone(), IoFlags::empty())
        .await
        .unwrap();
    model.write(6000 * BS, &d);
    assert_eq!(c.stats().bypassed_bytes, before + (1 << 20));
    model.check(&c, "after random writes").await;
    c.drain().await.unwrap();
    model
        .check(backing.as_ref(), "backing store after drain")
        .await;
}

#[tokio::test]
async fn sequential_cutoff_off_caches_everything() {
    let backing = mem(8 << 20);
    let cfg = CacheConfig {
        background: false,
        sequential_cutoff: 0,
        ..CacheConfig::default()
    };
    let (_fast, c) = cache_over(8 << 20, &backing, cfg).await;
    for b in (0..512).step_by(16) {
        c.write(b * BS, pattern(b, b, 16), IoFlags::empty())
            .await
            .unwrap();
    }
    assert_eq!(c.stats().bypassed_bytes, 0);
    assert_eq!(c.stats().cached_bytes, 512 * BS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermarks_hold_the_dirty_level() {
    let log = 4u64 << 20;
    let backing = mem(64 << 20);
    let cfg = CacheConfig {
        background: true,
        sequential_cutoff: 0,
        high_watermark: 50,
        low_watermark: 20,
        epoch_bytes: 128 << 10,
        min_destage_rate: 8 << 20,
        ..CacheConfig::default()
    };
    let (_fast, c) = cache_over(log + 8192, &backing, cfg).await;
    let log = c.log_len();
    let rec = BS + 64;
    let mut next = 0u64;
    async fn write_until(c: &WriteBackCache, next: &mut u64, target: u64) {
        let blocks = target / (BS + 64);
        for b in *next..*next + blocks {
            c.write(b * BS, pattern(b, b, 1), IoFlags::empty())
                .await
                .unwrap();
        }
        *next += blocks;
    }
    // Below the high watermark: nothing is destaged.
    write_until(&c, &mut next, log * 40 / 100).await;
    let dirty = c.stats().dirty_bytes;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s = c.stats();
    assert_eq!(s.destage_epochs, 0, "destaged below the high watermark");
    assert_eq!(s.dirty_bytes, dirty);
    // Past it: destaged, paced, down to the low watermark, and held there.
    write_until(&c, &mut next, log * 25 / 100).await;
    let lo = log * 20 / 100;
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.stats().dirty_bytes > lo {
        assert!(
            Instant::now() < deadline,
            "not down to the low watermark: {:?}",
            c.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = c.stats();
    assert!(s.destage_epochs > 0);
    assert!(
        s.dirty_bytes >= lo - (128 << 10) - rec,
        "went far below the low watermark: {s:?}"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let held = c.stats();
    assert_eq!(
        held.destage_epochs, s.destage_epochs,
        "kept destaging below the low watermark"
    );
    assert_eq!(held.dirty_bytes, s.dirty_bytes);
    // Sustained writes of three logs' worth: the writers never fail, and every block reads
    // back right.
    let first = next;
    write_until(&c, &mut next, 3 * log).await;
    for b in (first..next).step_by(97) {
        assert_eq!(c.read(b * BS, BS as usize).await.unwrap(), pattern(b, b, 1));
    }
    assert!(c.stats().dirty_bytes <= log);
}

#[tokio::test]
async fn mode_switches_keep_the_data_right_and_route_writes() {
    let size = 4u64 << 20;
    let backing = mem(size);
    let cfg = CacheConfig {
        background: false,
        sequential_cutoff: 0,
        ..CacheConfig::default()
    };
    let fast = mem(1 << 20);
    WriteBackCache::format(
        &FastDevice::block(fast.clone()),
        backing.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .unwrap();
    let c = WriteBackCache::open(
        FastDevice::block(fast.clone()),
        backing.clone(),
        cfg.clone(),
    )
    .await
    .unwrap();
    let mut model = Model::new(size);
    let mut w = 0u64;
    async fn step(
        c: &WriteBackCache,
        w: &mut u64,
        model: &mut Model,
        b: u64,
        n: u64,
    ) -> vsan_core::Result<()> {
        *w += 1;
        let d = pattern(*w, b, n);
        model.write(b * BS, &d);
        c.write(b * BS, d, IoFlags::empty()).await
    }
    // Write-back: dirty, the backing store untouched.
    for b in (0..64).step_by(4) {
        step(&c, &mut w, &mut model, b, 4).await.unwrap();
    }
    assert_eq!(c.stats().dirty_blocks, 64);
    assert_eq!(
        backing.read(0, BS as usize).await.unwrap(),
        Bytes::from(vec![0u8; BS as usize])
    );
    model.check(&c, "write-back").await;

    // Write-around: overlapping cached blocks are destaged first, then the write goes to
    // the backing store only.
    c.set_mode(CacheMode::WriteAround).await.unwrap();
    let bypassed = c.stats().bypassed_bytes;
    step(&c, &mut w, &mut model, 2, 4).await.unwrap();
    assert_eq!(c.stats().bypassed_bytes, bypassed + 4 * BS);
    assert_eq!(
        backing.read(2 * BS, 4 * BS as usize).await.unwrap(),
        Bytes::copy_from_slice(&model.0[2 * BS as usize..6 * BS as usize])
    );
    model.check(&c, "write-around").await;

    // Write-through: the backing store has each write when it completes; the log too.
    c.set_mode(CacheMode::WriteThrough).await.unwrap();
    let cached = c.stats().cached_bytes;
    step(&c, &mut w, &mut model, 100, 8).await.unwrap();
    assert_eq!(c.stats().cached_bytes, cached + 8 * BS);
    assert_eq!(
        backing.read(100 * BS, 8 * BS as usize).await.unwrap(),
        Bytes::copy_from_slice(&model.0[100 * BS as usize..108 * BS as usize])
    );
    model.check(&c, "write-through").await;

    // Pass-through: straight to the backing store; cached data still readable.
    c.set_mode(CacheMode::PassThrough).await.unwrap();
    step(&c, &mut w, &mut model, 200, 2).await.unwrap();
    assert_eq!(
        backing.read(200 * BS, 2 * BS as usize).await.unwrap(),
        Bytes::copy_from_slice(&model.0[200 * BS as usize..202 * BS as usize])
    );
    model.check(&c, "pass-through").await;

    // Back to write-back, then detach: drained, pass-through, the backing store complete.
    c.set_mode(CacheMode::WriteBack).await.unwrap();
    step(&c, &mut w, &mut model, 40, 30).await.unwrap();
    model.check(&c, "write-back again").await;
    c.detach().await.unwrap();
    assert_eq!(c.mode(), CacheMode::PassThrough);
    assert_eq!(c.stats().dirty_blocks, 0);
    assert_eq!(c.stats().dirty_bytes, 0);
    model
        .check(backing.as_ref(), "backing store after detach")
        .await;
    model.check(&c, "after detach").await;
    // The mode is kept on the device.
    c.close().await.unwrap();
    let c = WriteBackCache::open(FastDevice::block(fast), backing.clone(), cfg)
        .await
        .unwrap();
    assert_eq!(c.mode(), CacheMode::PassThrough);
    model.check(&c, "reopened").await;
}
