//! Crash-state enumeration for the write-back cache (testing layer 4 in DESIGN.md): a
//! power cut after every single write and flush the cache makes, on either device, with
//! the unflushed writes dropped, kept, or torn block by block.
//!
//! A seeded workload (overlapping writes of 1–64 blocks, some FUA, write_zeroes,
//! discards, flushes, explicit destages, a final close) runs once against a cache whose
//! fast device and backing store are `FaultyDevice<MemDevice>`s behind a [`Probe`] that
//! records every device operation on a tape (the dm-log-writes idea). Crash point `k` is
//! the state right after the `k`-th device write or flush. For each `k` both devices are
//! rebuilt from the tape — their images at their last flush, plus the writes pending
//! since, replayed into fresh `FaultyDevice`s — and cut with `DropUnflushed`,
//! `KeepUnflushed` and `Tear`; the cache is opened on them and its image checked:
//!
//! - (a) every 4 KiB block is whole: the block of one write (each block's bytes encode
//!   the write's id and the block's address), or zeroes;
//! - (b) every block holds what the acknowledged writes left there: the cache persists a
//!   write before it acknowledges it, so in write-back mode the image is the model after
//!   every acknowledged write, plus any blocks of the one write in flight at the cut
//!   (writes that bypass the cache without FUA may still be lost until a flush);
//! - (c) no block is older than it was at the last acknowledged flush.
//!
//! Every few crash points the recovered cache is also drained (the backing store must
//! then hold the same image), closed and opened again (clean, same image).
//!
//! Rebuilding from the tape is only as good as the tape, so a sample of crash points is
//! also reproduced literally: the workload runs again with a probe that fails every
//! operation after the `k`-th write ("the power is gone"), the devices are cut and the
//! cache reopened, and its image must equal the rebuilt one byte for byte.
//!
//! `CACHE_CRASH_SEED=<n>` runs another workload; every failure prints the seed and `k`.
//! Release builds try every cut at every crash point; debug builds one cut per point.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use vsan_cache::{CacheConfig, CacheMode, FastDevice, WriteBackCache};
use vsan_core::{
    BlockDevice, Error, ErrorKind, FaultyDevice, Geometry, IoFlags, IoFuture, MemDevice, PowerCut,
};

const BS: u64 = 4096;

/// One workload: its devices, its cache settings and its operations.
#[derive(Debug, Clone, Copy)]
struct Setup {
    /// Fast device bytes (its log is 8 KiB less).
    fast_len: u64,
    /// Block size of the fast device: FaultyDevice tears in these units.
    fast_block: u32,
    /// Backing store bytes.
    disk_len: u64,
    epoch_bytes: u64,
    ops: usize,
    max_write_blocks: u64,
    /// Mode switches, write-around, pass-through, drain and detach in the mix.
    modes: bool,
    /// Drain, close and reopen after recovery every this many crash points.
    deep_every: usize,
    /// Crash points reproduced literally.
    literal_samples: usize,
}

impl Setup {
    fn blocks(&self) -> u64 {
        self.disk_len / BS
    }

    fn config(&self) -> CacheConfig {
        CacheConfig {
            background: false,
            sequential_cutoff: 0,
            epoch_bytes: self.epoch_bytes,
            ..CacheConfig::default()
        }
    }
}

// ---------------------------------------------------------------------------------------
// Data: every block says which write produced it, and for which address.

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64: the workload generator (no dependency, same sequence everywhere).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The bytes write `id` (from 1) puts in block `lba`: the id and address, then words
/// derived from both and their place, so a block torn within itself (in any sector) or
/// written to the wrong place shows.
fn fill_block(id: u32, lba: u64, out: &mut [u8]) {
    out[..4].copy_from_slice(&id.to_le_bytes());
    out[4..8].copy_from_slice(&(lba as u32).to_le_bytes());
    let s = mix((u64::from(id) << 32) | lba);
    for (j, w) in out[8..].chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(s, j).to_le_bytes());
    }
}

fn word(s: u64, j: usize) -> u64 {
    (s ^ j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ s
}

fn write_data(id: u32, lba: u64, n: u64) -> Bytes {
    let mut out = vec![0u8; (n * BS) as usize];
    for (i, b) in out.chunks_mut(BS as usize).enumerate() {
        fill_block(id, lba + i as u64, b);
    }
    Bytes::from(out)
}

/// What a block read back holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Whole data of write `id`, for this address; 0 for zeroes.
    Value(u32),
    /// Whole data of write `id`, but for block `lba`.
    Misplaced { id: u32, lba: u64 },
    /// Not one write's block: torn within itself, or garbage.
    Mixed,
}

fn decode(block: &[u8], lba: u64, max_id: u32) -> Seen {
    if block.iter().all(|&b| b == 0) {
        return Seen::Value(0);
    }
    let id = u32::from_le_bytes([block[0], block[1], block[2], block[3]]);
    let tag = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
    if id == 0 || id > max_id {
        return Seen::Mixed;
    }
    let s = mix((u64::from(id) << 32) | u64::from(tag));
    let whole = block[8..]
        .chunks_exact(8)
        .enumerate()
        .all(|(j, w)| w == word(s, j).to_le_bytes());
    if !whole {
        Seen::Mixed
    } else if u64::from(tag) != lba {
        Seen::Misplaced {
            id,
            lba: u64::from(tag),
        }
    } else {
        Seen::Value(id)
    }
}

// ---------------------------------------------------------------------------------------
// The workload.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Write { lba: u64, n: u64, fua: bool },
    Zeroes { lba: u64, n: u64, fua: bool },
    Discard { lba: u64, n: u64, fua: bool },
    Flush,
    Destage,
    Drain,
    SetMode(CacheMode),
    Detach,
    Close,
}

impl Op {
    /// Blocks the op writes, and the id its blocks then hold (0: zeroes).
    fn writes(&self, id: u32) -> Option<(u64, u64, u32, bool)> {
        match *self {
            Op::Write { lba, n, fua } => Some((lba, n, id, fua)),
            Op::Zeroes { lba, n, fua } | Op::Discard { lba, n, fua } => Some((lba, n, 0, fua)),
            _ => None,
        }
    }
}

/// Operation `i` writes data with id `i + 1`; `modes[i]` is the cache mode it runs in.
struct Plan {
    seed: u64,
    ops: Vec<Op>,
    modes: Vec<CacheMode>,
}

fn plan(setup: &Setup, seed: u64) -> Plan {
    let mut rng = Rng(seed);
    let blocks = setup.blocks();
    let mut ops = Vec::with_capacity(setup.ops);
    let mut modes = Vec::with_capacity(setup.ops);
    let mut mode = CacheMode::WriteBack;
    let range = |rng: &mut Rng, max: u64| {
        let n = 1 + rng.below(max);
        // A third of the requests go to a hot spot at the start of the disk.
        let span = if rng.chance(33) { blocks / 5 } else { blocks };
        let lba = rng.below(span.max(n) - n + 1);
        (lba, n)
    };
    for _ in 0..setup.ops - 1 {
        let r = rng.below(100);
        let fua = rng.chance(20);
        let op = match r {
            0..=69 => {
                let (lba, n) = range(&mut rng, setup.max_write_blocks);
                Op::Write { lba, n, fua }
            }
            70..=74 => {
                let (lba, n) = range(&mut rng, 16);
                Op::Zeroes { lba, n, fua }
            }
            75..=78 => {
                let (lba, n) = range(&mut rng, 16);
                Op::Discard { lba, n, fua }
            }
            79..=89 => Op::Flush,
            90..=94 => Op::Destage,
            _ if !setup.modes => Op::Flush,
            95..=97 => {
                const ALL: [CacheMode; 4] = [
                    CacheMode::WriteBack,
                    CacheMode::WriteThrough,
                    CacheMode::WriteAround,
                    CacheMode::PassThrough,
                ];
                Op::SetMode(ALL[rng.below(4) as usize])
            }
            98 => Op::Drain,
            _ => Op::Detach,
        };
        modes.push(mode);
        match op {
            Op::SetMode(m) => mode = m,
            Op::Detach => mode = CacheMode::PassThrough,
            _ => {}
        }
        ops.push(op);
    }
    ops.push(Op::Close);
    modes.push(mode);
    Plan { seed, ops, modes }
}

// ---------------------------------------------------------------------------------------
// The probe and its tape.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Fast,
    Backing,
}

#[derive(Debug, Clone)]
enum Ev {
    Write { off: u64, data: Bytes, fua: bool },
    Zeroes { off: u64, len: u64, fua: bool },
    Discard { off: u64, len: u64, fua: bool },
    Flush,
    Read,
}

impl Ev {
    fn changes(&self) -> bool {
        !matches!(self, Ev::Read)
    }

    fn describe(&self) -> String {
        match self {
            Ev::Write { off, data, fua } => format!("write {} at {off} fua {fua}", data.len()),
            Ev::Zeroes { off, len, fua } => format!("write_zeroes {len} at {off} fua {fua}"),
            Ev::Discard { off, len, fua } => format!("discard {len} at {off} fua {fua}"),
            Ev::Flush => "flush".into(),
            Ev::Read => "read".into(),
        }
    }
}

/// Every device operation, in the order they completed; and where each workload op's
/// operations start and end on it.
#[derive(Default)]
struct Tape {
    events: Mutex<Vec<(Side, Ev)>>,
    ops: Mutex<Vec<(usize, usize)>>,
    writes: AtomicU64,
    /// The power goes after this many writes and flushes (`u64::MAX`: never).
    cut_after: u64,
    down: AtomicBool,
}

impl Tape {
    fn new(cut_after: u64) -> Arc<Tape> {
        Arc::new(Tape {
            cut_after,
            down: AtomicBool::new(cut_after == 0),
            ..Tape::default()
        })
    }

    fn len(&self) -> usize {
        self.events.lock().unwrap().len()
    }
}

/// Records every operation on the tape; once the power is gone, fails every operation.
struct Probe {
    dev: Arc<FaultyDevice<MemDevice>>,
    side: Side,
    tape: Arc<Tape>,
}

impl Probe {
    fn new(dev: &Arc<FaultyDevice<MemDevice>>, side: Side, tape: &Arc<Tape>) -> Arc<Probe> {
        Arc::new(Probe {
            dev: dev.clone(),
            side,
            tape: tape.clone(),
        })
    }

    fn run<'a, T: Send + 'a>(
        &'a self,
        ev: Ev,
        op: impl Future<Output = vsan_core::Result<T>> + Send + 'a,
    ) -> IoFuture<'a, T> {
        Box::pin(async move {
            if self.tape.down.load(Ordering::Acquire) {
                return Err(Error::new(ErrorKind::Io, "the power is off"));
            }
            let out = op.await?;
            let changes = ev.changes();
            self.tape.events.lock().unwrap().push((self.side, ev));
            if changes && self.tape.writes.fetch_add(1, Ordering::AcqRel) + 1 == self.tape.cut_after
            {
                self.tape.down.store(true, Ordering::Release);
            }
            Ok(out)
        })
    }
}

impl BlockDevice for Probe {
    fn geometry(&self) -> Geometry {
        self.dev.geometry()
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        self.run(Ev::Read, self.dev.read(offset, len))
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        let ev = Ev::Write {
            off: offset,
            data: data.clone(),
            fua: flags.contains(IoFlags::FUA),
        };
        self.run(ev, self.dev.write(offset, data, flags))
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        self.run(Ev::Flush, self.dev.flush())
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        let ev = Ev::Discard {
            off: offset,
            len,
            fua: flags.contains(IoFlags::FUA),
        };
        self.run(ev, self.dev.discard(offset, len, flags))
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        let ev = Ev::Zeroes {
            off: offset,
            len,
            fua: flags.contains(IoFlags::FUA),
        };
        self.run(ev, self.dev.write_zeroes(offset, len, flags))
    }
}

// ---------------------------------------------------------------------------------------
// Devices.

type Dev = Arc<FaultyDevice<MemDevice>>;

async fn device(len: u64, block: u32, image: Option<&[u8]>) -> Dev {
    let mem = MemDevice::new(Geometry::new(len, block).unwrap());
    if let Some(image) = image {
        // In small pieces, and none where the image is zero (MemDevice is sparse).
        for (i, piece) in image.chunks(64 << 10).enumerate() {
            if piece.iter().any(|&b| b != 0) {
                let off = (i as u64) << 16;
                mem.write(off, Bytes::copy_from_slice(piece), IoFlags::empty())
                    .await
                    .unwrap();
            }
        }
    }
    Arc::new(FaultyDevice::new(mem))
}

async fn fresh(setup: &Setup) -> (Dev, Dev) {
    let fast = device(setup.fast_len, setup.fast_block, None).await;
    let backing = device(setup.disk_len, BS as u32, None).await;
    WriteBackCache::format(
        &FastDevice::block(fast.clone()),
        backing.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .unwrap();
    (fast, backing)
}

async fn open(
    setup: &Setup,
    fast: Arc<dyn BlockDevice>,
    backing: Arc<dyn BlockDevice>,
) -> vsan_core::Result<WriteBackCache> {
    WriteBackCache::open(FastDevice::block(fast), backing, setup.config()).await
}

/// The whole device, read in 64 KiB requests.
async fn image(dev: &dyn BlockDevice) -> vsan_core::Result<Vec<u8>> {
    let size = dev.geometry().size();
    let mut out = Vec::with_capacity(size as usize);
    let mut at = 0;
    while at < size {
        let n = (size - at).min(64 << 10);
        out.extend_from_slice(&dev.read(at, n as usize).await?);
        at += n;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Running the workload.

fn flags(fua: bool) -> IoFlags {
    if fua { IoFlags::FUA } else { IoFlags::empty() }
}

/// Runs the plan, reading back every write's range (and checking it against `now`, the
/// blocks' newest ids). Stops at the first error, which is what the power going off looks
/// like to the workload.
async fn run_workload(
    plan: &Plan,
    cache: &WriteBackCache,
    tape: &Tape,
    now: &mut [u32],
) -> vsan_core::Result<()> {
    for (i, op) in plan.ops.iter().enumerate() {
        let id = i as u32 + 1;
        let start = tape.len();
        let r = match *op {
            Op::Write { lba, n, fua } => {
                cache
                    .write(lba * BS, write_data(id, lba, n), flags(fua))
                    .await
            }
            Op::Zeroes { lba, n, fua } => cache.write_zeroes(lba * BS, n * BS, flags(fua)).await,
            Op::Discard { lba, n, fua } => cache.discard(lba * BS, n * BS, flags(fua)).await,
            Op::Flush => cache.flush().await,
            Op::Destage => cache.destage().await.map(|_| ()),
            Op::Drain => cache.drain().await,
            Op::SetMode(m) => cache.set_mode(m).await,
            Op::Detach => cache.detach().await,
            Op::Close => cache.close().await,
        };
        tape.ops.lock().unwrap().push((start, tape.len()));
        r?;
        if let Some((lba, n, value, _)) = op.writes(id) {
            now[lba as usize..(lba + n) as usize].fill(value);
            let got = cache.read(lba * BS, (n * BS) as usize).await?;
            for (j, block) in got.chunks(BS as usize).enumerate() {
                let b = lba + j as u64;
                let seen = decode(block, b, plan.ops.len() as u32);
                assert_eq!(
                    seen,
                    Seen::Value(value),
                    "seed {}: op {i} {op:?}: block {b} read back wrong",
                    plan.seed
                );
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The model: per block, its durable value, the values since that a crash may or may not
// keep, and its value at the last flush.

#[derive(Debug, Clone, Default)]
struct Register {
    durable: u32,
    unflushed: Vec<u32>,
    at_flush: u32,
}

struct Model {
    blocks: Vec<Register>,
}

impl Model {
    fn new(blocks: u64) -> Model {
        Model {
            blocks: vec![Register::default(); blocks as usize],
        }
    }

    /// Op `i` was acknowledged.
    fn apply(&mut self, plan: &Plan, i: usize) {
        let op = plan.ops[i];
        if let Some((lba, n, value, fua)) = op.writes(i as u32 + 1) {
            // The cache persists the write before it acknowledges it; a write that
            // bypasses the cache is durable with FUA or after a flush.
            let cached = matches!(
                plan.modes[i],
                CacheMode::WriteBack | CacheMode::WriteThrough
            );
            for r in &mut self.blocks[lba as usize..(lba + n) as usize] {
                if fua || cached {
                    r.durable = value;
                    r.unflushed.clear();
                } else {
                    r.unflushed.push(value);
                }
            }
        } else if matches!(op, Op::Flush | Op::Close) {
            // Close flushes the backing store after it drained the log.
            for r in &mut self.blocks {
                if let Some(&v) = r.unflushed.last() {
                    r.durable = v;
                }
                r.unflushed.clear();
                r.at_flush = r.durable;
            }
        }
    }

    fn newest(&self, b: usize) -> u32 {
        let r = &self.blocks[b];
        r.unflushed.last().copied().unwrap_or(r.durable)
    }

    /// Checks a recovered image; `in_flight` is the op running at the cut, whose blocks
    /// may or may not have been written.
    fn check(&self, plan: &Plan, image: &[u8], in_flight: Option<usize>) -> Result<(), String> {
        let maybe = in_flight.and_then(|i| plan.ops[i].writes(i as u32 + 1));
        for (b, block) in image.chunks(BS as usize).enumerate() {
            let r = &self.blocks[b];
            let v = match decode(block, b as u64, plan.ops.len() as u32) {
                Seen::Value(v) => v,
                Seen::Mixed => {
                    return Err(format!(
                        "(a) block {b} is not whole: not one write's data (first bytes \
                         {:02x?}); the model has {}",
                        &block[..16],
                        self.newest(b)
                    ));
                }
                Seen::Misplaced { id, lba } => {
                    return Err(format!("block {b} holds write {id}'s data for block {lba}"));
                }
            };
            let in_flight_value = maybe.and_then(|(lba, n, value, _)| {
                (lba..lba + n).contains(&(b as u64)).then_some(value)
            });
            if v == r.durable || r.unflushed.contains(&v) || in_flight_value == Some(v) {
                continue;
            }
            // Ids grow with op order, so they tell what went wrong (zeroes are ambiguous).
            let what = if v != 0 && r.at_flush != 0 && v < r.at_flush {
                "(c) older than at the last flush"
            } else if v != 0 && v < r.durable {
                "(b) an acknowledged write is lost"
            } else if v > r.durable && r.unflushed.iter().all(|&u| v > u) {
                "a write that was never acknowledged (nor in flight) is there"
            } else {
                "(b) not what the acknowledged writes left"
            };
            let op = |id: u32| {
                if id == 0 {
                    "zeroes".to_string()
                } else {
                    format!("write {id} {:?}", plan.ops[id as usize - 1])
                }
            };
            return Err(format!(
                "{what}: block {b} holds {}; durable {}, unflushed {:?}, at last flush {}, in \
                 flight {in_flight_value:?}",
                op(v),
                op(r.durable),
                r.unflushed,
                op(r.at_flush)
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Enumeration.

/// A device rebuilt from the tape: its image at its last flush, and the events since.
struct Replica {
    base: Vec<u8>,
    pending: Vec<usize>,
}

impl Replica {
    fn flush(&mut self, events: &[(Side, Ev)]) {
        for &i in &self.pending {
            match &events[i].1 {
                Ev::Write { off, data, .. } => {
                    self.base[*off as usize..*off as usize + data.len()].copy_from_slice(data)
                }
                Ev::Zeroes { off, len, .. } | Ev::Discard { off, len, .. } => {
                    self.base[*off as usize..(*off + *len) as usize].fill(0)
                }
                Ev::Flush | Ev::Read => {}
            }
        }
        self.pending.clear();
    }

    /// The device as it was at the cut, with the power cut applied.
    async fn crash(&self, events: &[(Side, Ev)], len: u64, block: u32, cut: PowerCut) -> Dev {
        let dev = device(len, block, Some(&self.base)).await;
        for &i in &self.pending {
            match &events[i].1 {
                Ev::Write { off, data, fua } => dev.write(*off, data.clone(), flags(*fua)).await,
                Ev::Zeroes { off, len, fua } => dev.write_zeroes(*off, *len, flags(*fua)).await,
                Ev::Discard { off, len, fua } => dev.discard(*off, *len, flags(*fua)).await,
                Ev::Flush | Ev::Read => Ok(()),
            }
            .unwrap();
        }
        dev.power_cut(cut).await.unwrap();
        dev
    }
}

/// The cuts tried at crash point `k`: each device's unflushed writes dropped, kept or
/// torn (the devices lose power together, but their caches need not behave alike). A
/// device with nothing unflushed ends up the same whatever the cut, so those repeats go.
fn cuts(
    seed: u64,
    k: usize,
    fast_pending: bool,
    backing_pending: bool,
) -> Vec<(PowerCut, PowerCut)> {
    let s = mix(seed ^ (k as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let all = [
        (PowerCut::DropUnflushed, PowerCut::DropUnflushed),
        (PowerCut::KeepUnflushed, PowerCut::KeepUnflushed),
        (PowerCut::Tear { seed: s }, PowerCut::Tear { seed: mix(s) }),
        (PowerCut::KeepUnflushed, PowerCut::DropUnflushed),
        (PowerCut::DropUnflushed, PowerCut::KeepUnflushed),
    ];
    let mut out: Vec<(PowerCut, PowerCut)> = Vec::new();
    for (f, b) in all {
        let f = if fast_pending {
            f
        } else {
            PowerCut::DropUnflushed
        };
        let b = if backing_pending {
            b
        } else {
            PowerCut::DropUnflushed
        };
        if !out.contains(&(f, b)) {
            out.push((f, b));
        }
    }
    out
}

/// Recovers the cache after a crash and checks it; returns its image.
async fn recover_and_check(
    setup: &Setup,
    plan: &Plan,
    model: &Model,
    in_flight: Option<usize>,
    fast: Dev,
    backing: Dev,
    deep: bool,
) -> Result<Vec<u8>, String> {
    let cache = open(setup, fast.clone(), backing.clone())
        .await
        .map_err(|e| format!("open after the crash failed: {e}"))?;
    let img = image(&cache)
        .await
        .map_err(|e| format!("reading the recovered image: {e}"))?;
    model.check(plan, &img, in_flight)?;
    if deep {
        // Destaging what was recovered leaves the same image on the backing store, and a
        // clean close and open keep it.
        cache
            .drain()
            .await
            .map_err(|e| format!("drain after recovery: {e}"))?;
        let s = cache.stats();
        if s.dirty_blocks != 0 || s.dirty_bytes != 0 {
            return Err(format!("dirty after drain: {s:?}"));
        }
        let back = image(backing.as_ref()).await.map_err(|e| e.to_string())?;
        if back != img {
            return Err(
                "after recovery and drain the backing store differs from the image \
                        the cache served"
                    .into(),
            );
        }
        cache
            .close()
            .await
            .map_err(|e| format!("close after recovery: {e}"))?;
        backing
            .power_cut(PowerCut::DropUnflushed)
            .await
            .map_err(|e| e.to_string())?;
        let cache = open(setup, fast, backing)
            .await
            .map_err(|e| format!("open after close: {e}"))?;
        if !cache.recovery().clean {
            return Err(format!("not clean after close: {:?}", cache.recovery()));
        }
        let again = image(&cache).await.map_err(|e| e.to_string())?;
        if again != img {
            return Err("the image changed across a clean close and open".into());
        }
    }
    Ok(img)
}

/// The workload run literally up to crash point `k`: the probe fails everything after the
/// `k`-th write or flush; then the devices are cut and the cache opened.
async fn literal(setup: &Setup, plan: &Plan, k: usize, cut: (PowerCut, PowerCut)) -> Vec<u8> {
    let (fast, backing) = fresh(setup).await;
    let tape = Tape::new(k as u64);
    let probe_fast = Probe::new(&fast, Side::Fast, &tape);
    let probe_backing = Probe::new(&backing, Side::Backing, &tape);
    if let Ok(cache) = open(setup, probe_fast, probe_backing).await {
        let mut now = vec![0u32; setup.blocks() as usize];
        let _ = run_workload(plan, &cache, &tape, &mut now).await;
    }
    fast.power_cut(cut.0).await.unwrap();
    backing.power_cut(cut.1).await.unwrap();
    let cache = open(setup, fast, backing).await.unwrap_or_else(|e| {
        panic!(
            "seed {}: crash point {k} {cut:?} reproduced literally: open failed: {e}",
            plan.seed
        )
    });
    image(&cache).await.unwrap()
}

#[derive(Debug, Default)]
struct Tally {
    crash_points: usize,
    recoveries: usize,
    in_flight_all: usize,
    in_flight_none: usize,
    in_flight_part: usize,
    /// Partly there although the cache wrote it as one record.
    in_flight_part_one_record: usize,
}

async fn enumerate(setup: Setup, seed: u64) -> Tally {
    let plan = plan(&setup, seed);
    let started = Instant::now();

    // The run that writes the tape.
    let (fast, backing) = fresh(&setup).await;
    let fast_base = image(fast.as_ref()).await.unwrap();
    let backing_base = image(backing.as_ref()).await.unwrap();
    let tape = Tape::new(u64::MAX);
    let cache = open(
        &setup,
        Probe::new(&fast, Side::Fast, &tape),
        Probe::new(&backing, Side::Backing, &tape),
    )
    .await
    .unwrap();
    let mut now = vec![0u32; setup.blocks() as usize];
    run_workload(&plan, &cache, &tape, &mut now)
        .await
        .unwrap_or_else(|e| panic!("seed {seed}: the workload failed without a crash: {e}"));
    let s = cache.stats();
    drop(cache);
    assert!(
        s.destage_epochs > 0 && s.destaged_bytes > 2 * s.log_bytes,
        "seed {seed}: the log should have wrapped several times: {s:?}"
    );
    {
        // After close: clean, and the backing store alone holds the newest data.
        let cache = open(&setup, fast.clone(), backing.clone()).await.unwrap();
        assert!(cache.recovery().clean);
        let img = image(&cache).await.unwrap();
        let back = image(backing.inner()).await.unwrap();
        for (b, (got, durable)) in img
            .chunks(BS as usize)
            .zip(back.chunks(BS as usize))
            .enumerate()
        {
            let want = Seen::Value(now[b]);
            assert_eq!(
                decode(got, b as u64, u32::MAX),
                want,
                "seed {seed}: block {b}"
            );
            assert_eq!(
                decode(durable, b as u64, u32::MAX),
                want,
                "seed {seed}: block {b}"
            );
        }
    }
    let events = tape.events.lock().unwrap().clone();
    let ops = tape.ops.lock().unwrap().clone();
    assert_eq!(ops.len(), plan.ops.len());
    // ends[k]: events up to and including the k-th write or flush.
    let mut ends = vec![0usize];
    ends.extend(
        events
            .iter()
            .enumerate()
            .filter(|(_, (_, e))| e.changes())
            .map(|(i, _)| i + 1),
    );
    let recorded = started.elapsed();

    // Crash points reproduced literally, evenly spread, the last one included.
    let last = ends.len() - 1;
    let n = setup.literal_samples.max(2);
    let samples: Vec<usize> = (0..n).map(|j| j * last / (n - 1)).collect();
    let mut literal_checks = Vec::new();

    let mut tally = Tally::default();
    // What the cache splits a write into (see `WriteBackCache::open`).
    let max_record_blocks = ((setup.fast_len - 8192) / 4 / BS).clamp(1, 1024);
    let mut model = Model::new(setup.blocks());
    let mut acked = 0usize;
    let mut fast_rep = Replica {
        base: fast_base,
        pending: Vec::new(),
    };
    let mut backing_rep = Replica {
        base: backing_base,
        pending: Vec::new(),
    };
    let mut at = 0usize;
    for (k, &end) in ends.iter().enumerate() {
        while at < end {
            let (side, ev) = &events[at];
            let rep = match side {
                Side::Fast => &mut fast_rep,
                Side::Backing => &mut backing_rep,
            };
            match ev {
                Ev::Flush => {
                    rep.pending.push(at);
                    rep.flush(&events);
                }
                Ev::Read => {}
                _ => rep.pending.push(at),
            }
            at += 1;
        }
        while acked < ops.len() && ops[acked].1 <= end {
            model.apply(&plan, acked);
            acked += 1;
        }
        let in_flight = (acked < ops.len() && ops[acked].0 < end).then_some(acked);
        let context = |cut: &(PowerCut, PowerCut)| {
            format!(
                "seed {seed}, crash point k = {k} of {} (after event {}: {:?} {}), cut {cut:?}, \
                 {acked} ops acknowledged, in flight: {:?}",
                ends.len() - 1,
                end.wrapping_sub(1),
                events.get(end.wrapping_sub(1)).map(|e| e.0),
                events
                    .get(end.wrapping_sub(1))
                    .map_or(String::from("none"), |e| e.1.describe()),
                in_flight.map(|i| (i, plan.ops[i], plan.modes[i])),
            )
        };
        let cuts = cuts(
            seed,
            k,
            !fast_rep.pending.is_empty(),
            !backing_rep.pending.is_empty(),
        );
        let n_cuts = cuts.len();
        for (j, cut) in cuts.into_iter().enumerate() {
            // Debug builds are ~10 times slower: there each crash point gets one of its
            // cuts, in turn.
            if cfg!(debug_assertions) && j != k % n_cuts {
                continue;
            }
            let f = fast_rep
                .crash(&events, setup.fast_len, setup.fast_block, cut.0)
                .await;
            let b = backing_rep
                .crash(&events, setup.disk_len, BS as u32, cut.1)
                .await;
            let deep = (k + j) % setup.deep_every == 0;
            let img = match recover_and_check(&setup, &plan, &model, in_flight, f, b, deep).await {
                Ok(img) => img,
                Err(e) => panic!("{}: {e}", context(&cut)),
            };
            tally.recoveries += 1;
            // How much of a write in flight the cache kept (zeroes cannot be told from
            // what was there before, so only data writes count).
            if let Some(Op::Write { lba, n, .. }) = in_flight.map(|i| plan.ops[i]) {
                let value = in_flight.map_or(0, |i| i as u32 + 1);
                let now: Vec<bool> = (lba..lba + n)
                    .map(|b| {
                        let block = &img[(b * BS) as usize..((b + 1) * BS) as usize];
                        decode(block, b, u32::MAX) == Seen::Value(value)
                    })
                    .collect();
                if now.iter().all(|&x| x) {
                    tally.in_flight_all += 1;
                } else if now.iter().any(|&x| x) {
                    tally.in_flight_part += 1;
                    if n <= max_record_blocks {
                        tally.in_flight_part_one_record += 1;
                    }
                } else {
                    tally.in_flight_none += 1;
                }
            }
            if let Some(at) = samples.iter().position(|&s| s == k)
                && (at % n_cuts == j || cfg!(debug_assertions))
            {
                literal_checks.push((k, cut, img, context(&cut)));
            }
        }
        tally.crash_points += 1;
    }
    let enumerated = started.elapsed() - recorded;

    for (k, cut, img, context) in literal_checks {
        let got = literal(&setup, &plan, k, cut).await;
        assert!(
            got == img,
            "{context}: reproduced literally, the recovered image differs from the one \
             rebuilt from the tape"
        );
    }
    eprintln!(
        "seed {seed}: {} events on the tape, {tally:?}; record {recorded:?}, enumerate \
         {enumerated:?}, literal {:?}",
        events.len(),
        started.elapsed() - recorded - enumerated
    );
    tally
}

fn seeds(default: u64) -> u64 {
    std::env::var("CACHE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Runs `fut` on a one-thread runtime with tokio's cooperative budget off: the devices
/// never block, so without forced yields every run of the workload interleaves the two
/// halves of a write-through `join!` the same way, and a crash point reproduced literally
/// is the same crash point as on the tape.
fn block_on<T>(fut: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(tokio::task::unconstrained(fut))
}

/// 500 operations in write-back mode on a 512 KiB fast device (a 504 KiB log that wraps
/// dozens of times, destaged in 128 KiB epochs; writes over 31 blocks are split into
/// several records) in front of a 2 MiB disk, torn in 512-byte sectors on the fast device.
#[test]
fn write_back_survives_a_power_cut_after_every_device_write() {
    let setup = Setup {
        fast_len: 512 << 10,
        fast_block: 512,
        disk_len: 2 << 20,
        epoch_bytes: 128 << 10,
        ops: 500,
        max_write_blocks: 64,
        modes: false,
        deep_every: 4,
        literal_samples: 24,
    };
    let t = block_on(enumerate(setup, seeds(0x00c0_ffee)));
    assert!(t.crash_points > 1000, "{t:?}");
}

/// The same workload on a 2 MiB fast device with 4 KiB sectors in front of a 4 MiB disk,
/// destaged a whole log at a time (the default 4 MiB epoch).
#[test]
fn write_back_with_whole_log_destages_survives_every_power_cut() {
    let setup = Setup {
        fast_len: 2 << 20,
        fast_block: 4096,
        disk_len: 4 << 20,
        epoch_bytes: CacheConfig::default().epoch_bytes,
        ops: 500,
        max_write_blocks: 64,
        modes: false,
        deep_every: 4,
        literal_samples: 12,
    };
    let t = block_on(enumerate(setup, seeds(0x0bad_5eed)));
    assert!(t.crash_points > 500, "{t:?}");
}

/// Fewer operations, with mode switches (write-through, write-around, pass-through),
/// drains and detaches, on a 256 KiB fast device with 4 KiB sectors and a 1 MiB disk.
/// Writes over 15 blocks are split; write-through ones of 60 blocks or so need the
/// whole log, so they destage their own first records while they are being written
/// (which once lost acknowledged write-through data).
#[test]
fn mode_switches_survive_a_power_cut_after_every_device_write() {
    let setup = Setup {
        fast_len: 256 << 10,
        fast_block: 4096,
        disk_len: 1 << 20,
        epoch_bytes: 64 << 10,
        ops: 300,
        max_write_blocks: 64,
        modes: true,
        deep_every: 2,
        literal_samples: 16,
    };
    let t = block_on(enumerate(setup, seeds(0x0005_eed5)));
    assert!(t.crash_points > 100, "{t:?}");
}
