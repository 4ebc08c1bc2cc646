//! `FaultyDevice`: a [`BlockDevice`] wrapper that injects I/O errors, latency and power
//! cuts, so the layers above can be tested against a disk that misbehaves on cue.
//!
//! The model (a volatile write cache, as dm-log-writes records it) is described on
//! [`FaultyDevice`]; these notes are about how it is kept.
//!
//! Replaying surviving entries *in their original order* (durable ones included, although
//! the inner device already has them) is what keeps FUA honest: a FUA write always wins
//! over an older unflushed write to the same bytes, whichever parts of that older write
//! survive, and an older write never appears on top of newer FUA data.
//!
//! Locking: the bookkeeping sits behind `parking_lot` locks that are never held across an
//! `.await`. The operations that change the inner device (flush, FUA writes, power cuts)
//! are additionally ordered by an async gate, because their inner writes must not
//! interleave; plain writes and reads never wait for it.
//!
//! Dropping an in-flight flush or FUA write before it completes is allowed (part of its
//! data may then survive a later power cut, as on real hardware), but the inner device may
//! keep running a write it already started (a [`FileDevice`](super::FileDevice) on the
//! blocking pool does), so tests that crash a device should let its operations finish.

use std::collections::VecDeque;
use std::fmt;
use std::ops::Range;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{BlockDevice, Geometry, IoFlags, IoFuture, Op};
use crate::error::{Error, ErrorKind, Result};

/// The kinds of operation a [`FaultConfig`] can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`BlockDevice::read`].
    Read,
    /// [`BlockDevice::write`], with or without FUA.
    Write,
    /// [`BlockDevice::flush`].
    Flush,
    /// [`BlockDevice::discard`].
    Discard,
    /// [`BlockDevice::write_zeroes`].
    WriteZeroes,
}

impl OpKind {
    fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Discard => "discard",
            OpKind::WriteZeroes => "write_zeroes",
        }
    }
}

/// Which operations fail, when, and how; install with [`FaultyDevice::set_faults`].
///
/// An operation *matches* when its kind is in [`ops`](Self::ops) and its byte range
/// overlaps [`range`](Self::range). The first [`after`](Self::after) matching operations
/// succeed; after that each matching operation fails with
/// [`probability`](Self::probability) (drawn from a `SmallRng` seeded with
/// [`seed`](Self::seed), so a run is reproducible), at most [`limit`](Self::limit) times.
/// Requests that fail validation are refused before fault injection and never match.
///
/// An injected failure changes nothing: a failed write, discard or write_zeroes leaves the
/// device as it was, and a failed flush makes nothing durable (the writes stay pending).
///
/// The default fails every operation, always, with [`ErrorKind::Io`]:
///
/// ```
/// use vsan_core::{ErrorKind, FaultConfig, OpKind};
///
/// // The third and later writes touching the first MiB fail with ENOSPC, half of the time.
/// let faults = FaultConfig::new()
///     .ops(&[OpKind::Write])
///     .range(0..1 << 20)
///     .after(2)
///     .probability(0.5, 7)
///     .kind(ErrorKind::NoSpace);
/// assert_eq!(faults.ops, vec![OpKind::Write]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FaultConfig {
    /// The kinds that can fail; empty means every kind.
    pub ops: Vec<OpKind>,
    /// Only operations overlapping this byte range can fail; `None` means anywhere. A
    /// flush counts as covering the whole device.
    pub range: Option<Range<u64>>,
    /// How many matching operations succeed before failures start.
    pub after: u64,
    /// Chance that a matching operation (past `after`) fails: 1.0 or more always, 0.0 or
    /// less (or NaN) never.
    pub probability: f64,
    /// Seed of the random draws behind `probability`.
    pub seed: u64,
    /// At most this many failures are injected; `None` means no limit.
    pub limit: Option<u64>,
    /// The kind of the injected errors.
    pub kind: ErrorKind,
}

impl Default for FaultConfig {
    fn default() -> FaultConfig {
        FaultConfig {
            ops: Vec::new(),
            range: None,
            after: 0,
            probability: 1.0,
            seed: 0,
            limit: None,
            kind: ErrorKind::Io,
        }
    }
}

impl FaultConfig {
    /// Fail every operation, always, with [`ErrorKind::Io`]; narrow it with the other
    /// methods.
    pub fn new() -> FaultConfig {
        FaultConfig::default()
    }

    /// Only these kinds of operation fail (an empty slice means every kind).
    pub fn ops(mut self, ops: &[OpKind]) -> FaultConfig {
        self.ops = ops.to_vec();
        self
    }

    /// Only operations overlapping `range` (in bytes) fail.
    pub fn range(mut self, range: Range<u64>) -> FaultConfig {
        self.range = Some(range);
        self
    }

    /// The first `n` matching operations succeed.
    pub fn after(mut self, n: u64) -> FaultConfig {
        self.after = n;
        self
    }

    /// Each matching operation fails with chance `probability`, drawn from a generator
    /// seeded with `seed`.
    pub fn probability(mut self, probability: f64, seed: u64) -> FaultConfig {
        self.probability = probability;
        self.seed = seed;
        self
    }

    /// Inject at most `n` failures, then let everything through.
    pub fn limit(mut self, n: u64) -> FaultConfig {
        self.limit = Some(n);
        self
    }

    /// The injected errors have this kind.
    pub fn kind(mut self, kind: ErrorKind) -> FaultConfig {
        self.kind = kind;
        self
    }

    fn matches(&self, op: OpKind, offset: u64, len: u64) -> bool {
        if !self.ops.is_empty() && !self.ops.contains(&op) {
            return false;
        }
        match &self.range {
            None => true,
            Some(_) if op == OpKind::Flush => true,
            Some(r) => offset < r.end && r.start < offset.saturating_add(len),
        }
    }
}

/// What survives a [`FaultyDevice::power_cut`] of the writes that were not yet durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PowerCut {
    /// Every write not yet flushed (and not FUA) is lost.
    DropUnflushed,
    /// Every write survives, as if the cache had just been written out.
    KeepUnflushed,
    /// Each logical block of each unflushed write survives or not, chosen by a generator
    /// seeded with `seed` (the same seed and history give the same result). A block ends up
    /// holding whole data of one write or its durable contents, never a mix within a block.
    Tear {
        /// Seed of the keep-or-lose draws.
        seed: u64,
    },
}

/// What a pending entry does to its range.
#[derive(Clone)]
enum Payload {
    Data(Bytes),
    Zeroes { len: u64, discard: bool },
}

/// One write (or discard, or write_zeroes) in the overlay, oldest first.
#[derive(Clone)]
struct Pending {
    id: u64,
    offset: u64,
    payload: Payload,
    /// Already written to the inner device: a FUA write, or an entry a flush that did not
    /// finish had already applied. Such an entry survives every power cut.
    in_inner: bool,
}

impl Pending {
    fn len(&self) -> u64 {
        match &self.payload {
            Payload::Data(d) => d.len() as u64,
            Payload::Zeroes { len, .. } => *len,
        }
    }

    fn overlaps(&self, offset: u64, len: u64) -> bool {
        self.offset < offset + len && offset < self.offset + self.len()
    }

    /// Apply this entry's effect on `[offset, offset + buf.len())` to `buf`.
    fn apply_to(&self, offset: u64, buf: &mut [u8]) {
        let start = self.offset.max(offset);
        let end = (self.offset + self.len()).min(offset + buf.len() as u64);
        if start >= end {
            return;
        }
        let dst = &mut buf[(start - offset) as usize..(end - offset) as usize];
        match &self.payload {
            Payload::Data(d) => dst
                .copy_from_slice(&d[(start - self.offset) as usize..(end - self.offset) as usize]),
            Payload::Zeroes { .. } => dst.fill(0),
        }
    }
}

struct FaultState {
    config: FaultConfig,
    rng: SmallRng,
    matched: u64,
    injected: u64,
}

#[derive(Default)]
struct Overlay {
    next_id: u64,
    entries: VecDeque<Pending>,
}

impl Overlay {
    fn push(&mut self, offset: u64, payload: Payload, in_inner: bool) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.entries.push_back(Pending {
            id,
            offset,
            payload,
            in_inner,
        });
        id
    }

    /// Drop the entries up to and including `last` (they are in the inner device now).
    fn retire_through(&mut self, last: u64) {
        while self.entries.front().is_some_and(|e| e.id <= last) {
            self.entries.pop_front();
        }
    }
}

/// A [`BlockDevice`] that wraps another and injects errors, latency and power cuts.
///
/// Power cuts follow the dm-log-writes model: the wrapper plays a volatile write cache in
/// front of the inner device.
///
/// ```text
///   write / discard / write_zeroes ──> pending writes (ordered, volatile)
///   write or write_zeroes with FUA ──> pending writes (durable) + inner device, FUA
///   read      = inner device + pending writes applied oldest first
///   flush     = pending writes applied to the inner device in order, then inner flush
///   power_cut = inner device + durable pending writes + what survives of the
///               volatile ones (none, all, or a seeded choice of blocks), in order
/// ```
///
/// So after a power cut every flushed or FUA write is there, a FUA write always wins over
/// an older unflushed write to the same bytes, and each block holds whole data of one
/// write or its previous contents. Errors ([`set_faults`](Self::set_faults)) and latency
/// ([`set_latency`](Self::set_latency)) apply to the calls made through this wrapper, never
/// to its own writes to the inner device. Every request is validated with
/// [`Geometry::validate`] first; bad input is refused before faults or latency and changes
/// nothing.
///
/// All methods take `&self`, so a test can keep an `Arc<FaultyDevice<D>>`, hand it to the
/// layer under test as an `Arc<dyn BlockDevice>`, and cut the power or change the faults
/// while that layer runs. Operations need a tokio runtime with its timer enabled when a
/// latency is set.
///
/// ```
/// use bytes::Bytes;
/// use vsan_core::{BlockDevice, FaultyDevice, Geometry, IoFlags, MemDevice, PowerCut};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let disk = FaultyDevice::new(MemDevice::new(Geometry::new(1 << 20, 512)?));
/// disk.write(0, Bytes::from(vec![1; 512]), IoFlags::empty()).await?;
/// disk.flush().await?;
/// disk.write(0, Bytes::from(vec![2; 512]), IoFlags::empty()).await?; // never flushed
/// disk.write(512, Bytes::from(vec![3; 512]), IoFlags::FUA).await?;
/// disk.power_cut(PowerCut::DropUnflushed).await?;
/// assert_eq!(disk.read(0, 1024).await?, [[1; 512], [3; 512]].concat());
/// # Ok::<(), vsan_core::Error>(()) }).unwrap();
/// ```
pub struct FaultyDevice<D> {
    inner: D,
    overlay: Mutex<Overlay>,
    faults: Mutex<Option<FaultState>>,
    latency: Mutex<Duration>,
    /// Orders the operations that write to `inner` (flush, FUA, power cut).
    gate: tokio::sync::Mutex<()>,
}

impl<D: fmt::Debug> fmt::Debug for FaultyDevice<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyDevice")
            .field("inner", &self.inner)
            .field("pending", &self.overlay.lock().entries.len())
            .field("faults", &self.faults.lock().as_ref().map(|s| &s.config))
            .field("latency", &*self.latency.lock())
            .finish()
    }
}

impl<D: BlockDevice> FaultyDevice<D> {
    /// Wrap `inner`; no faults, no latency, an empty write cache.
    pub fn new(inner: D) -> FaultyDevice<D> {
        FaultyDevice {
            inner,
            overlay: Mutex::new(Overlay::default()),
            faults: Mutex::new(None),
            latency: Mutex::new(Duration::ZERO),
            gate: tokio::sync::Mutex::new(()),
        }
    }

    /// The wrapped device. It holds only what has been flushed (or written with FUA);
    /// reading it directly shows the image a power cut with
    /// [`PowerCut::DropUnflushed`] would leave, once no flush or FUA write is in flight.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Install a fault configuration, replacing any earlier one (and restarting its
    /// `after` count, `limit` count and random generator).
    pub fn set_faults(&self, config: FaultConfig) {
        let rng = SmallRng::seed_from_u64(config.seed);
        *self.faults.lock() = Some(FaultState {
            config,
            rng,
            matched: 0,
            injected: 0,
        });
    }

    /// Remove the fault configuration: every operation succeeds again.
    pub fn clear_faults(&self) {
        *self.faults.lock() = None;
    }

    /// Delay every operation by `latency` before it takes effect and completes
    /// (`Duration::ZERO`, the default, for none). Uses tokio's timer, so it follows a
    /// paused test clock.
    pub fn set_latency(&self, latency: Duration) {
        *self.latency.lock() = latency;
    }

    /// How many writes (discards and write_zeroes included) are not yet durable: what a
    /// power cut may lose right now.
    pub fn pending_writes(&self) -> usize {
        self.overlay
            .lock()
            .entries
            .iter()
            .filter(|e| !e.in_inner)
            .count()
    }

    /// Cut the power: the writes that were not durable survive as `cut` says, the result
    /// is written to the inner device and flushed, and the device carries on from that
    /// state as if rebooted. Faults and latency stay as they are.
    ///
    /// Waits for a flush or FUA write in progress to finish first. Reads and plain writes
    /// running at the same time see either side of the cut. Fails only if the inner device
    /// fails; the pending writes then stay pending (cut again to retry), though the inner
    /// device may already hold part of the crash state.
    pub fn power_cut(&self, cut: PowerCut) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let _gate = self.gate.lock().await;
            let snapshot: Vec<Pending> = self.overlay.lock().entries.iter().cloned().collect();
            let Some(last) = snapshot.last().map(|e| e.id) else {
                return Ok(());
            };
            let bs = u64::from(self.geometry().block_size());
            let mut rng = match cut {
                PowerCut::Tear { seed } => Some(SmallRng::seed_from_u64(seed)),
                _ => None,
            };
            for entry in &snapshot {
                if entry.in_inner || cut == PowerCut::KeepUnflushed {
                    self.apply(entry, entry.offset, entry.len()).await?;
                    continue;
                }
                let Some(rng) = rng.as_mut() else {
                    continue; // DropUnflushed
                };
                // Decide block by block, then write each run of kept blocks at once.
                let blocks = entry.len() / bs;
                let mut run: Option<u64> = None;
                for b in 0..=blocks {
                    let keep = b < blocks && rng.random_bool(0.5);
                    match (keep, run) {
                        (true, None) => run = Some(b),
                        (false, Some(first)) => {
                            self.apply(entry, entry.offset + first * bs, (b - first) * bs)
                                .await?;
                            run = None;
                        }
                        _ => {}
                    }
                }
            }
            self.inner.flush().await?;
            self.overlay.lock().retire_through(last);
            Ok(())
        })
    }

    /// Write the part `[offset, offset + len)` of `entry` to the inner device.
    async fn apply(&self, entry: &Pending, offset: u64, len: u64) -> Result<()> {
        match &entry.payload {
            Payload::Data(d) => {
                let from = (offset - entry.offset) as usize;
                let part = d.slice(from..from + len as usize);
                self.inner.write(offset, part, IoFlags::empty()).await
            }
            Payload::Zeroes { discard: true, .. } => {
                self.inner.discard(offset, len, IoFlags::empty()).await
            }
            Payload::Zeroes { discard: false, .. } => {
                self.inner.write_zeroes(offset, len, IoFlags::empty()).await
            }
        }
    }

    /// Decide whether to inject a failure into this operation; called after validation.
    fn injected(&self, op: OpKind, offset: u64, len: u64) -> Result<()> {
        let mut guard = self.faults.lock();
        let Some(state) = guard.as_mut() else {
            return Ok(());
        };
        if !state.config.matches(op, offset, len) {
            return Ok(());
        }
        state.matched += 1;
        if state.matched <= state.config.after
            || state.config.limit.is_some_and(|l| state.injected >= l)
        {
            return Ok(());
        }
        // `random::<f64>()` is in [0, 1): probability 1.0 always fails, NaN never does.
        if state.rng.random::<f64>() < state.config.probability {
            state.injected += 1;
            return Err(Error::new(
                state.config.kind,
                format!(
                    "injected fault: {} of {len} bytes at offset {offset}",
                    op.name()
                ),
            ));
        }
        Ok(())
    }

    /// The common start of every operation: validate, maybe fail, then wait out the
    /// latency.
    async fn admit(&self, op: OpKind, offset: u64, len: u64) -> Result<()> {
        let geometry = self.geometry();
        match op {
            OpKind::Read => geometry.validate(Op::Read, offset, len)?,
            OpKind::Write => geometry.validate(Op::Write, offset, len)?,
            OpKind::Discard => geometry.validate(Op::Discard, offset, len)?,
            OpKind::WriteZeroes => geometry.validate(Op::WriteZeroes, offset, len)?,
            OpKind::Flush => {}
        }
        self.injected(op, offset, len)?;
        let latency = *self.latency.lock();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        Ok(())
    }

    /// Add a write to the overlay; with FUA also write it through to the inner device.
    async fn cache(&self, offset: u64, payload: Payload, fua: bool) -> Result<()> {
        if !fua {
            self.overlay.lock().push(offset, payload, false);
            return Ok(());
        }
        let _gate = self.gate.lock().await;
        // In the overlay first, so a read never sees an older pending write on top of it.
        let id = self.overlay.lock().push(offset, payload.clone(), true);
        let result = match payload {
            Payload::Data(d) => self.inner.write(offset, d, IoFlags::FUA).await,
            Payload::Zeroes { len, .. } => self.inner.write_zeroes(offset, len, IoFlags::FUA).await,
        };
        if result.is_err() {
            self.overlay.lock().entries.retain(|e| e.id != id);
        }
        result
    }
}

impl<D: BlockDevice> BlockDevice for FaultyDevice<D> {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn data_loss_count(&self) -> u64 {
        self.inner.data_loss_count()
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(async move {
            self.admit(OpKind::Read, offset, len as u64).await?;
            // Overlay before inner: a flush running meanwhile retires entries only after
            // the inner device has them, and reapplying an entry is harmless.
            let overlapping: Vec<Pending> = self
                .overlay
                .lock()
                .entries
                .iter()
                .filter(|e| e.overlaps(offset, len as u64))
                .cloned()
                .collect();
            let base = self.inner.read(offset, len).await?;
            if overlapping.is_empty() {
                return Ok(base);
            }
            let mut buf = BytesMut::from(&base[..]);
            for entry in &overlapping {
                entry.apply_to(offset, &mut buf);
            }
            Ok(buf.freeze())
        })
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.admit(OpKind::Write, offset, data.len() as u64).await?;
            self.cache(offset, Payload::Data(data), flags.contains(IoFlags::FUA))
                .await
        })
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.admit(OpKind::Flush, 0, self.geometry().size()).await?;
            let _gate = self.gate.lock().await;
            let snapshot: Vec<Pending> = self.overlay.lock().entries.iter().cloned().collect();
            // Entries already in the inner device need writing again only after an older
            // entry has been applied on top of them.
            let mut applied_any = false;
            for entry in &snapshot {
                if entry.in_inner && !applied_any {
                    continue;
                }
                self.apply(entry, entry.offset, entry.len()).await?;
                applied_any = true;
                if let Some(e) = self
                    .overlay
                    .lock()
                    .entries
                    .iter_mut()
                    .find(|e| e.id == entry.id)
                {
                    e.in_inner = true;
                }
            }
            self.inner.flush().await?;
            if let Some(last) = snapshot.last() {
                self.overlay.lock().retire_through(last.id);
            }
            Ok(())
        })
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.admit(OpKind::Discard, offset, len).await?;
            let payload = Payload::Zeroes { len, discard: true };
            self.cache(offset, payload, flags.contains(IoFlags::FUA))
                .await
        })
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.admit(OpKind::WriteZeroes, offset, len).await?;
            let payload = Payload::Zeroes {
                len,
                discard: false,
            };
            self.cache(offset, payload, flags.contains(IoFlags::FUA))
                .await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::MemDevice;

    const BS: usize = 512;

    fn device() -> FaultyDevice<MemDevice> {
        FaultyDevice::new(MemDevice::new(
            Geometry::new(64 * BS as u64, BS as u32).unwrap(),
        ))
    }

    fn block(v: u8) -> Bytes {
        Bytes::from(vec![v; BS])
    }

    async fn byte_at(dev: &impl BlockDevice, block: u64) -> u8 {
        dev.read(block * BS as u64, BS).await.unwrap()[0]
    }

    #[tokio::test]
    async fn reads_merge_overlay_in_order() {
        let dev = device();
        dev.write(0, Bytes::from(vec![1; 4 * BS]), IoFlags::empty())
            .await
            .unwrap();
        dev.write(BS as u64, block(2), IoFlags::empty())
            .await
            .unwrap();
        dev.discard(2 * BS as u64, BS as u64, IoFlags::empty())
            .await
            .unwrap();
        let got = dev.read(0, 4 * BS).await.unwrap();
        let want: Vec<u8> = [1u8, 2, 0, 1]
            .iter()
            .flat_map(|&v| std::iter::repeat_n(v, BS))
            .collect();
        assert_eq!(got, want);
        // Nothing reached the inner device yet.
        assert_eq!(dev.inner().read(0, 4 * BS).await.unwrap(), vec![0; 4 * BS]);
        assert_eq!(dev.pending_writes(), 3);
    }

    #[tokio::test]
    async fn flush_applies_in_order_and_empties_the_overlay() {
        let dev = device();
        dev.write(0, block(1), IoFlags::empty()).await.unwrap();
        dev.write(0, block(2), IoFlags::empty()).await.unwrap();
        dev.flush().await.unwrap();
        assert_eq!(dev.pending_writes(), 0);
        assert_eq!(byte_at(dev.inner(), 0).await, 2);
        dev.power_cut(PowerCut::DropUnflushed).await.unwrap();
        assert_eq!(byte_at(&dev, 0).await, 2);
    }

    #[tokio::test]
    async fn fua_wins_over_older_unflushed_write_in_every_crash() {
        for cut in [
            PowerCut::DropUnflushed,
            PowerCut::KeepUnflushed,
            PowerCut::Tear { seed: 1 },
            PowerCut::Tear { seed: 2 },
        ] {
            let dev = device();
            dev.write(0, Bytes::from(vec![1; 2 * BS]), IoFlags::empty())
                .await
                .unwrap();
            dev.write(0, block(9), IoFlags::FUA).await.unwrap();
            assert_eq!(dev.pending_writes(), 1);
            dev.power_cut(cut).await.unwrap();
            assert_eq!(byte_at(&dev, 0).await, 9, "{cut:?}");
            let second = byte_at(&dev, 1).await;
            match cut {
                PowerCut::DropUnflushed => assert_eq!(second, 0),
                PowerCut::KeepUnflushed => assert_eq!(second, 1),
                PowerCut::Tear { .. } => assert!(second == 0 || second == 1),
            }
        }
    }

    #[tokio::test]
    async fn flush_after_fua_keeps_the_fua_data_on_top() {
        let dev = device();
        dev.write(0, block(1), IoFlags::empty()).await.unwrap();
        dev.write(0, block(9), IoFlags::FUA).await.unwrap();
        dev.flush().await.unwrap();
        assert_eq!(byte_at(dev.inner(), 0).await, 9);
        assert_eq!(byte_at(&dev, 0).await, 9);
    }

    #[tokio::test]
    async fn tear_is_per_block_and_seeded() {
        let mut images = Vec::new();
        for seed in [5, 5, 6] {
            let dev = device();
            dev.write(0, Bytes::from(vec![7; 32 * BS]), IoFlags::empty())
                .await
                .unwrap();
            dev.power_cut(PowerCut::Tear { seed }).await.unwrap();
            let image = dev.read(0, 32 * BS).await.unwrap();
            for b in image.chunks(BS) {
                assert!(b.iter().all(|&x| x == b[0]) && (b[0] == 0 || b[0] == 7));
            }
            images.push(image);
        }
        assert_eq!(images[0], images[1], "same seed, same crash");
        assert_ne!(
            images[0], images[2],
            "different seeds should tear differently"
        );
    }

    #[tokio::test]
    async fn injected_faults_follow_the_config() {
        let dev = device();
        dev.set_faults(
            FaultConfig::new()
                .ops(&[OpKind::Write])
                .range(4 * BS as u64..5 * BS as u64)
                .after(1)
                .limit(1)
                .kind(ErrorKind::NoSpace),
        );
        // Outside the range: no match.
        dev.write(0, block(1), IoFlags::empty()).await.unwrap();
        // First match passes, second fails, third passes again (limit reached).
        dev.write(4 * BS as u64, block(2), IoFlags::empty())
            .await
            .unwrap();
        let err = dev
            .write(4 * BS as u64, block(3), IoFlags::FUA)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        assert_eq!(byte_at(&dev, 4).await, 2);
        assert_eq!(dev.pending_writes(), 2);
        dev.write(4 * BS as u64, block(4), IoFlags::empty())
            .await
            .unwrap();
        // Reads were never selected.
        assert_eq!(byte_at(&dev, 4).await, 4);
        dev.set_faults(FaultConfig::new().ops(&[OpKind::Flush]));
        assert_eq!(dev.flush().await.unwrap_err().kind(), ErrorKind::Io);
        assert_eq!(
            dev.pending_writes(),
            3,
            "a failed flush makes nothing durable"
        );
        dev.clear_faults();
        dev.flush().await.unwrap();
        assert_eq!(dev.pending_writes(), 0);
    }

    #[tokio::test]
    async fn probability_is_reproducible() {
        let run = |seed| async move {
            let dev = device();
            dev.set_faults(FaultConfig::new().probability(0.5, seed));
            let mut outcomes = Vec::new();
            for _ in 0..64 {
                outcomes.push(dev.write(0, block(1), IoFlags::empty()).await.is_ok());
            }
            outcomes
        };
        let a = run(11).await;
        assert_eq!(a, run(11).await);
        assert!(a.contains(&true) && a.contains(&false));
    }

    #[tokio::test]
    async fn inner_failures_change_nothing_and_keep_writes_pending() {
        // A FaultyDevice under a FaultyDevice: the outer one's inner device fails.
        let dev = FaultyDevice::new(device());
        dev.write(0, block(1), IoFlags::empty()).await.unwrap();
        dev.inner()
            .set_faults(FaultConfig::new().ops(&[OpKind::Write]));
        let err = dev
            .write(BS as u64, block(2), IoFlags::FUA)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        assert_eq!(
            byte_at(&dev, 1).await,
            0,
            "a failed FUA write left data behind"
        );
        assert_eq!(dev.flush().await.unwrap_err().kind(), ErrorKind::Io);
        assert_eq!(
            dev.pending_writes(),
            1,
            "a failed flush dropped a pending write"
        );
        assert_eq!(byte_at(&dev, 0).await, 1);
        dev.inner().clear_faults();
        dev.flush().await.unwrap();
        assert_eq!(dev.pending_writes(), 0);
        dev.power_cut(PowerCut::DropUnflushed).await.unwrap();
        assert_eq!(byte_at(&dev, 0).await, 1);
        assert_eq!(byte_at(&dev, 1).await, 0);
    }

    #[tokio::test]
    async fn bad_input_is_refused_before_faults_and_changes_nothing() {
        let dev = device();
        dev.set_faults(FaultConfig::new().kind(ErrorKind::Corrupt));
        let err = dev.write(1, block(1), IoFlags::empty()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        let err = dev
            .discard(64 * BS as u64, BS as u64, IoFlags::empty())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfRange);
        assert_eq!(dev.pending_writes(), 0);
    }

    /// A device that has lost data, as a write-back cache reports it.
    struct Lossy(MemDevice);

    impl BlockDevice for Lossy {
        fn geometry(&self) -> Geometry {
            self.0.geometry()
        }
        fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
            self.0.read(offset, len)
        }
        fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
            self.0.write(offset, data, flags)
        }
        fn flush(&self) -> IoFuture<'_, ()> {
            self.0.flush()
        }
        fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
            self.0.discard(offset, len, flags)
        }
        fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
            self.0.write_zeroes(offset, len, flags)
        }
        fn data_loss_count(&self) -> u64 {
            3
        }
    }

    #[test]
    fn data_loss_count_is_the_inner_devices() {
        assert_eq!(device().data_loss_count(), 0);
        let inner = Lossy(MemDevice::new(Geometry::new(4096, 512).unwrap()));
        assert_eq!(FaultyDevice::new(inner).data_loss_count(), 3);
    }
}
