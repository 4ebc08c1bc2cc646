//! Destage: records to the backing store, oldest first, in epochs; and the background
//! destager with its rate controller.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use super::*;

/// What the newest record of an epoch left in one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Src {
    /// 4096 bytes at this log position.
    Data(u64),
    Zero,
    Discard,
    /// The backing store already has it (a write-through record).
    Skip,
}

impl Inner {
    /// Destage the oldest records (up to `epoch_bytes` of log, at least one record):
    /// coalesce, write to the backing store, flush it, move the superblock's tail, free
    /// the space. `false` when the log was empty.
    pub(crate) async fn destage_epoch(&self) -> Result<bool> {
        let _d = self.destage_lock.lock().await;
        if self.failed.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::Io, "the cache device failed"));
        }
        let started = Instant::now();
        let recs: Vec<Rec> = {
            let log = self.log.lock();
            let mut bytes = 0;
            let mut out = Vec::new();
            for r in &log.records {
                if !out.is_empty() && bytes + (r.next - r.pos) > self.cfg.epoch_bytes {
                    break;
                }
                bytes += r.next - r.pos;
                out.push(*r);
            }
            out
        };
        let Some(last) = recs.last().copied() else {
            return Ok(false);
        };
        let first = recs[0].pos;
        // The last record of the epoch to touch a block wins.
        let mut blocks: BTreeMap<u64, Src> = BTreeMap::new();
        for r in &recs {
            for i in 0..u64::from(r.nblocks) {
                let src = match (r.kind, r.clean) {
                    (RecKind::Marker, _) => continue,
                    (_, true) => Src::Skip,
                    (RecKind::Data, false) => Src::Data(r.pos + HEADER_LEN as u64 + i * BLOCK),
                    (RecKind::Zero, false) => Src::Zero,
                    (RecKind::Discard, false) => Src::Discard,
                };
                blocks.insert(r.lba + i, src);
            }
        }
        if let Err(e) = self.write_epoch(&blocks).await {
            *self.destage_error.lock() = Some(Error::new(e.kind(), e.context().to_string()));
            self.space.notify_waiters();
            return Err(e);
        }
        // Durable in the backing store before the tail may move past it.
        if let Err(e) = self.backing.flush().await {
            *self.destage_error.lock() = Some(Error::new(e.kind(), e.context().to_string()));
            self.space.notify_waiters();
            return Err(e);
        }
        // The backing store has the epoch now: if the cache device fails before the tail
        // moves, none of it counts as lost.
        {
            let mut log = self.log.lock();
            for r in log.records.iter_mut().take(recs.len()) {
                r.clean = true;
            }
        }
        let (tail, tail_seq) = (last.next, last.seq + 1);
        self.write_superblock(|sb| {
            sb.tail = tail;
            sb.tail_seq = tail_seq;
        })
        .await?;
        // Reads now go to the backing store for these blocks (unless newer records hold
        // them); only after that may the space be reused.
        for r in &recs {
            if r.kind != RecKind::Marker {
                self.index.remove_if(r.lba, r.nblocks.into(), r.pos);
            }
        }
        {
            let mut log = self.log.lock();
            for _ in 0..recs.len() {
                log.records.pop_front();
            }
            log.tail = tail;
            log.tail_seq = tail_seq;
        }
        *self.destage_error.lock() = None;
        self.space.notify_waiters();
        let bytes = tail - first;
        let s = &self.stats;
        s.destaged_bytes.fetch_add(bytes, Ordering::Relaxed);
        s.destage_epochs.fetch_add(1, Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64().max(1e-6);
        let old = f64::from_bits(s.destage_rate.load(Ordering::Relaxed));
        let rate = if old == 0.0 {
            bytes as f64 / secs
        } else {
            0.8 * old + 0.2 * bytes as f64 / secs
        };
        s.destage_rate.store(rate.to_bits(), Ordering::Relaxed);
        tracing::debug!(
            records = recs.len(),
            blocks = blocks.len(),
            bytes,
            tail,
            "destage epoch done"
        );
        Ok(true)
    }

    /// Write the coalesced blocks of an epoch: adjacent blocks of one kind in one request
    /// (data up to the backing store's largest request).
    async fn write_epoch(&self, blocks: &BTreeMap<u64, Src>) -> Result<()> {
        #[cfg(feature = "failpoints")]
        fail::fail_point!(crate::failpoints::CACHE_DESTAGE, |_| Err(Error::new(
            ErrorKind::Io,
            "fail point cache::destage"
        )));
        let max = u64::from(self.backing.geometry().max_io()).max(BLOCK) / BLOCK;
        let mut it = blocks.iter().peekable();
        while let Some((&start, &src)) = it.next() {
            let mut n = 1u64;
            while let Some(&(&b, &s)) = it.peek() {
                let same = match (src, s) {
                    (Src::Data(_), Src::Data(_)) => n < max,
                    (a, b) => a == b,
                };
                if b != start + n || !same {
                    break;
                }
                n += 1;
                it.next();
            }
            let (off, len) = (start * BLOCK, n * BLOCK);
            match src {
                Src::Skip => {}
                Src::Zero => {
                    self.backing
                        .write_zeroes(off, len, IoFlags::empty())
                        .await?
                }
                Src::Discard => self.backing.discard(off, len, IoFlags::empty()).await?,
                Src::Data(_) => {
                    let mut buf = BytesMut::with_capacity(len as usize);
                    for b in start..start + n {
                        let Some(Src::Data(pos)) = blocks.get(&b) else {
                            continue;
                        };
                        let dev = LOG_START + pos % self.log_len;
                        // SAFETY: the epoch's records are live until this destage frees
                        // them; nobody writes their space meanwhile.
                        match unsafe { self.fast.mapped_slice(dev, BLOCK as usize) } {
                            Some(s) => buf.extend_from_slice(s),
                            None => match self.fast.read(dev, BLOCK as usize).await {
                                Ok(d) => buf.extend_from_slice(&d),
                                Err(e) => {
                                    self.fail_and_mark(&e).await;
                                    return Err(e);
                                }
                            },
                        }
                    }
                    self.backing
                        .write(off, buf.freeze(), IoFlags::empty())
                        .await?;
                }
            }
        }
        Ok(())
    }

    /// [`destage_epoch`](Self::destage_epoch) on a task of its own, so that a caller who
    /// gives up waiting (a dropped future) never leaves a destage half done with backing
    /// writes still in flight.
    pub(crate) async fn destage_detached(self: &Arc<Self>) -> Result<bool> {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return self.destage_epoch().await;
        };
        let inner = Arc::clone(self);
        rt.spawn(async move { inner.destage_epoch().await })
            .await
            .map_err(|e| Error::new(ErrorKind::Io, format!("destage task failed: {e}")))?
    }

    /// Destage until every record committed before the call is gone.
    pub(crate) async fn drain(self: &Arc<Self>) -> Result<()> {
        let end = self.log.lock().head;
        let _urgent = Counted::new(&self.draining);
        while self.log.lock().tail < end {
            if !self.destage_detached().await? {
                break;
            }
        }
        Ok(())
    }

    /// Destage until no record covering any of blocks `lba .. lba + n` is left.
    pub(crate) async fn drain_overlapping(self: &Arc<Self>, lba: u64, n: u64) -> Result<()> {
        let newest = if n > 1 << 16 {
            // A huge range: looking up every block costs more than draining.
            self.log.lock().records.back().map(|r| r.pos)
        } else {
            self.index.newest_in(lba, n)
        };
        let Some(newest) = newest else {
            return Ok(());
        };
        let _urgent = Counted::new(&self.draining);
        while self.log.lock().tail <= newest {
            if !self.destage_detached().await? {
                break;
            }
        }
        Ok(())
    }
}

/// Counts one waiter in `counter` while it lives (also when its future is dropped).
pub(crate) struct Counted<'a>(&'a AtomicU64);

impl<'a> Counted<'a> {
    pub(crate) fn new(counter: &'a AtomicU64) -> Counted<'a> {
        counter.fetch_add(1, Ordering::AcqRel);
        Counted(counter)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The background destager.
///
/// - Full speed (epoch after epoch) while writers wait for room, a drain runs, the mode
///   is pass-through, or the log is at or above the high watermark.
/// - Once above the high watermark, it keeps destaging until the log is down to the low
///   watermark, paced by a PI controller: the rate grows with how far the log is above
///   the low watermark (proportional) and how long it has been (integral), never below
///   `min_destage_rate`. Pacing in small epochs keeps foreground writes from queueing
///   behind long bursts of destage I/O.
/// - Below the low watermark it sleeps until woken.
pub(crate) async fn background(inner: Arc<Inner>) {
    let lo = inner.log_len * u64::from(inner.cfg.low_watermark) / 100;
    let hi = inner.log_len * u64::from(inner.cfg.high_watermark) / 100;
    let mut flushing = false;
    let mut integral = 0.0f64;
    let mut last = Instant::now();
    let mut backoff = Duration::from_millis(10);
    loop {
        if inner.shutdown.load(Ordering::Acquire) || inner.failed.load(Ordering::Acquire) {
            inner.space.notify_waiters();
            return;
        }
        let notified = inner.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let dirty = inner.dirty_bytes();
        let urgent = inner.urgent(hi);
        if dirty >= hi && !flushing {
            flushing = true;
            tracing::debug!(dirty, hi, "cache above its high watermark: destaging");
        }
        if flushing && dirty <= lo {
            flushing = false;
            integral = 0.0;
            tracing::debug!(dirty, lo, "cache down to its low watermark");
        }
        if !urgent && !flushing {
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            last = Instant::now();
            continue;
        }
        let before = inner.dirty_bytes();
        match inner.destage_epoch().await {
            Ok(true) => backoff = Duration::from_millis(10),
            Ok(false) => {
                // Nothing to destage (whoever asked for urgency has what it needs, or
                // will find out): wait to be woken rather than spin.
                flushing = false;
                tokio::select! {
                    _ = &mut notified => {}
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
                continue;
            }
            Err(e) => {
                if inner.failed.load(Ordering::Acquire) {
                    continue;
                }
                warn!("cache destage failed ({e}); retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        }
        if urgent {
            continue;
        }
        // Paced: sleep as long as the epoch's bytes take at the controller's rate.
        let now = Instant::now();
        let dt = now.duration_since(last).as_secs_f64().min(1.0);
        last = now;
        let error = inner.dirty_bytes().saturating_sub(lo) as f64;
        integral = (integral + error * dt).min(inner.log_len as f64 * 10.0);
        // Proportional: clear the excess in about a second; integral: in about 4 s more.
        let rate = (error + integral / 4.0).max(inner.cfg.min_destage_rate as f64);
        let done = before.saturating_sub(inner.dirty_bytes()).max(1) as f64;
        let pause = Duration::from_secs_f64((done / rate).min(1.0));
        let deadline = tokio::time::Instant::now() + pause;
        loop {
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => break,
            }
            if inner.urgent(hi) || inner.shutdown.load(Ordering::Acquire) {
                break;
            }
            notified.set(inner.wake.notified());
            notified.as_mut().enable();
        }
    }
}

impl Inner {
    /// Destaging must run at full speed now.
    fn urgent(&self, hi: u64) -> bool {
        let dirty = self.dirty_bytes();
        self.want_space.load(Ordering::Acquire) > 0
            || self.draining.load(Ordering::Acquire) > 0
            || self.mode() == CacheMode::PassThrough && dirty > 0
            || dirty >= hi
    }
}
