//! Appending records: group commit.
//!
//! A writer queues its record and, if nobody is committing, becomes the committer: it
//! takes everything queued, places the records one after another in the log, writes them
//! (a memory copy on a mapped device), persists the whole range once, enters the records
//! in the index and acknowledges every writer of the batch; then it looks at the queue
//! again. At queue depth 1 a writer commits its own record with no hand-off to another
//! thread; under load one persist covers many writes.

use tokio::sync::oneshot;

use super::*;
use crate::format::{RecordHeader, encode_header, place};

pub(crate) struct Append {
    lba: u64,
    nblocks: u32,
    payload: Payload,
    clean: bool,
    done: oneshot::Sender<Result<()>>,
}

#[derive(Default)]
pub(crate) struct Queue {
    pending: Vec<Append>,
    committing: bool,
}

impl Queue {
    /// Appends are queued or being committed.
    pub(crate) fn busy(&self) -> bool {
        self.committing || !self.pending.is_empty()
    }
}

fn copy_err(e: &Error) -> Error {
    Error::new(e.kind(), e.context().to_string())
}

/// Resets the committing flag if the committer's future is dropped mid-way; writers still
/// queued then get an error (their records were never written).
struct Committer<'a> {
    inner: &'a Inner,
    armed: bool,
}

impl Drop for Committer<'_> {
    fn drop(&mut self) {
        if self.armed {
            let orphans = {
                let mut q = self.inner.commit.lock();
                q.committing = false;
                std::mem::take(&mut q.pending)
            };
            for a in orphans {
                let _ = a.done.send(Err(Error::new(
                    ErrorKind::Io,
                    "cache commit abandoned (the committing request was cancelled)",
                )));
            }
        }
    }
}

/// Records placed and (for a block device) buffered, not yet persisted.
struct Segment {
    start: u64,
    end: u64,
    next_seq: u64,
    /// Block fast device only: (device offset, bytes) to write.
    bufs: Vec<(u64, Vec<u8>)>,
    recs: Vec<Rec>,
    waiters: Vec<oneshot::Sender<Result<()>>>,
    data_bytes: u64,
}

impl Inner {
    /// Append a record for blocks from `lba` and wait until it is persisted and indexed.
    /// Data larger than the largest record is split into several records, queued
    /// together.
    pub(crate) async fn append(
        self: &Arc<Self>,
        lba: u64,
        n: u64,
        payload: Payload,
        clean: bool,
    ) -> Result<()> {
        let max = u64::from(self.max_record_blocks);
        let mut rxs = Vec::with_capacity(1);
        let mut pieces = Vec::with_capacity(1);
        match &payload {
            Payload::Data(d) if d.len() as u64 / BLOCK > max => {
                let step = (max * BLOCK) as usize;
                for (i, at) in (0..d.len()).step_by(step).enumerate() {
                    let end = (at + step).min(d.len());
                    let piece = d.slice(at..end);
                    let blocks = piece.len() as u64 / BLOCK;
                    pieces.push((lba + i as u64 * max, blocks, Payload::Data(piece)));
                }
            }
            _ => pieces.push((lba, n, payload)),
        }
        let commit = {
            let mut q = self.commit.lock();
            // Checked under the lock `close` sets it under: no append is queued after a
            // close has seen the queue idle.
            self.check_open()?;
            for (lba, n, payload) in pieces {
                let (tx, rx) = oneshot::channel();
                rxs.push(rx);
                q.pending.push(Append {
                    lba,
                    nblocks: u32::try_from(n).unwrap_or(u32::MAX),
                    payload,
                    clean,
                    done: tx,
                });
            }
            !std::mem::replace(&mut q.committing, true)
        };
        if commit {
            match tokio::runtime::Handle::try_current() {
                // Where an append leaves I/O in flight (device writes on a block device,
                // an fdatasync on the blocking pool), a dropped future must not abandon a
                // commit half done: records it wrote could surface behind the records of
                // the next commit, which reuses their positions and sequence numbers. So
                // such commits run on a task of their own. On tmpfs an append is a memory
                // copy and an inline msync, with nothing left behind, and committing here
                // saves a hand-off to another thread.
                Ok(rt) if !self.fast.appends_inline() => {
                    let inner = Arc::clone(self);
                    rt.spawn(async move { inner.run_commits_on().await });
                }
                _ => self.run_commits().await,
            }
        }
        let mut result = Ok(());
        for rx in rxs {
            let r = rx
                .await
                .unwrap_or_else(|_| Err(Error::new(ErrorKind::Io, "cache commit abandoned")));
            if result.is_ok() {
                result = r;
            }
        }
        result
    }

    /// Commit the queued batch (which holds this writer's record). If more writers
    /// queued meanwhile, hand the committing over to a task of its own, so no writer
    /// stays behind to commit for others while its own write is done.
    async fn run_commits(self: &Arc<Self>) {
        let mut guard = Committer {
            inner: self,
            armed: true,
        };
        let mut first = true;
        loop {
            let batch = {
                let mut q = self.commit.lock();
                if q.pending.is_empty() {
                    q.committing = false;
                    guard.armed = false;
                    return;
                }
                if !first {
                    if let Ok(rt) = tokio::runtime::Handle::try_current() {
                        // Still committing: the task takes over the flag.
                        guard.armed = false;
                        let inner = self.clone();
                        rt.spawn(async move { inner.run_commits_on().await });
                        return;
                    }
                }
                std::mem::take(&mut q.pending)
            };
            first = false;
            self.commit_batch(batch).await;
        }
    }

    /// The committing task: commits until the queue is empty.
    async fn run_commits_on(self: Arc<Self>) {
        let mut guard = Committer {
            inner: &self,
            armed: true,
        };
        loop {
            let batch = {
                let mut q = self.commit.lock();
                if q.pending.is_empty() {
                    q.committing = false;
                    guard.armed = false;
                    return;
                }
                std::mem::take(&mut q.pending)
            };
            self.commit_batch(batch).await;
        }
    }

    async fn commit_batch(self: &Arc<Self>, batch: Vec<Append>) {
        let (head, seq) = {
            let log = self.log.lock();
            (log.head, log.next_seq)
        };
        let mut seg = Segment {
            start: head,
            end: head,
            next_seq: seq,
            bufs: Vec::new(),
            recs: Vec::with_capacity(batch.len()),
            waiters: Vec::with_capacity(batch.len()),
            data_bytes: 0,
        };
        for a in batch {
            if self.failed.load(Ordering::Acquire) {
                let _ = a.done.send(Err(failed_err()));
                continue;
            }
            let (header, kind, data) = match &a.payload {
                Payload::Data(d) => (
                    RecordHeader::data(0, a.lba, d),
                    RecKind::Data,
                    Some(d.clone()),
                ),
                Payload::Zero => (
                    RecordHeader::range(0, a.lba, a.nblocks, false),
                    RecKind::Zero,
                    None,
                ),
                Payload::Discard => (
                    RecordHeader::range(0, a.lba, a.nblocks, true),
                    RecKind::Discard,
                    None,
                ),
            };
            let placed = header.and_then(|h| {
                let data_blocks = if data.is_some() { h.nblocks } else { 0 };
                place(seg.end, data_blocks, self.log_len).map(|p| (h, p))
            });
            let (mut header, mut p) = match placed {
                Ok(x) => x,
                Err(e) => {
                    let _ = a
                        .done
                        .send(Err(Error::new(ErrorKind::InvalidArgument, e.to_string())));
                    continue;
                }
            };
            let room = { self.log.lock().tail } + self.log_len;
            if p.next > room {
                self.write_segment(&mut seg).await;
                if let Err(e) = self.wait_space(p.next).await {
                    let _ = a.done.send(Err(e));
                    continue;
                }
                if self.failed.load(Ordering::Acquire) {
                    let _ = a.done.send(Err(failed_err()));
                    continue;
                }
                // The segment was published; the record goes where it was placed.
                p = match place(
                    seg.end,
                    if data.is_some() { header.nblocks } else { 0 },
                    self.log_len,
                ) {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = a
                            .done
                            .send(Err(Error::new(ErrorKind::InvalidArgument, e.to_string())));
                        continue;
                    }
                };
            }
            self.reserved_head.fetch_max(p.next, Ordering::AcqRel);
            if let Some(w) = p.wrap_at {
                let wrap = RecordHeader::wrap(seg.next_seq);
                if let Err(e) = self.put(&mut seg, w, &encode_header(&wrap), None) {
                    let _ = a.done.send(Err(e));
                    continue;
                }
                seg.recs.push(Rec {
                    pos: w,
                    seq: wrap.seq,
                    lba: 0,
                    nblocks: 0,
                    kind: RecKind::Marker,
                    next: p.start,
                    clean: true,
                });
                seg.next_seq += 1;
            }
            header.seq = seg.next_seq;
            if let Err(e) = self.put(&mut seg, p.start, &encode_header(&header), data.as_deref()) {
                let _ = a.done.send(Err(e));
                continue;
            }
            seg.recs.push(Rec {
                pos: p.start,
                seq: header.seq,
                lba: a.lba,
                nblocks: header.nblocks,
                kind,
                next: p.next,
                clean: a.clean,
            });
            seg.next_seq += 1;
            seg.end = p.next;
            seg.data_bytes += data.as_ref().map_or(0, |d| d.len() as u64);
            seg.waiters.push(a.done);
        }
        self.write_segment(&mut seg).await;
    }

    /// Put a record (header, then data) at log position `pos`: copied into the mapping,
    /// or buffered for one write per contiguous run on a block device.
    fn put(&self, seg: &mut Segment, pos: u64, header: &[u8], data: Option<&[u8]>) -> Result<()> {
        let off = LOG_START + pos % self.log_len;
        if self.fast.is_mapped() {
            // SAFETY: `pos` lies past the published head and within `tail + log_len`: no
            // index entry, reader or destage refers to it, and the committer is the only
            // writer of log space.
            unsafe {
                self.fast.mapped_write(off, header)?;
                if let Some(d) = data {
                    self.fast.mapped_write(off + header.len() as u64, d)?;
                }
            }
            return Ok(());
        }
        let contiguous = seg
            .bufs
            .last()
            .is_some_and(|(o, b)| o + b.len() as u64 == off);
        if !contiguous {
            seg.bufs.push((off, Vec::new()));
        }
        if let Some((_, buf)) = seg.bufs.last_mut() {
            buf.extend_from_slice(header);
            if let Some(d) = data {
                buf.extend_from_slice(d);
            }
        }
        Ok(())
    }

    /// Write and persist the segment's records, then publish them (log, index) and
    /// acknowledge their writers.
    async fn write_segment(&self, seg: &mut Segment) {
        if seg.recs.is_empty() {
            return;
        }
        let result = async {
            #[cfg(feature = "failpoints")]
            fail::fail_point!(crate::failpoints::CACHE_PERSIST, |_| Err(Error::new(
                ErrorKind::Io,
                "fail point cache::persist"
            )));
            for (off, buf) in std::mem::take(&mut seg.bufs) {
                self.fast.write(off, &buf).await?;
            }
            let (from, len) = (seg.start % self.log_len, seg.end - seg.start);
            if self.fast.is_mapped() && from + len > self.log_len {
                self.fast
                    .persist(LOG_START + from, self.log_len - from)
                    .await?;
                self.fast
                    .persist(LOG_START, from + len - self.log_len)
                    .await
            } else {
                self.fast
                    .persist(LOG_START + from, len.min(self.log_len - from))
                    .await
            }
        }
        .await;
        let recs = std::mem::take(&mut seg.recs);
        let waiters = std::mem::take(&mut seg.waiters);
        let published = match result {
            Err(e) => {
                self.fail_and_mark(&e).await;
                Err(e)
            }
            Ok(()) => {
                let mut log = self.log.lock();
                if self.failed.load(Ordering::Acquire) {
                    Err(failed_err())
                } else {
                    // Entered in the index under the log lock: a destage takes records
                    // from the log under it too, so it never sees a record whose index
                    // entries are still to come.
                    for r in &recs {
                        match r.kind {
                            RecKind::Data => self.index.insert(
                                r.lba,
                                r.nblocks.into(),
                                r.pos,
                                Some(r.pos + HEADER_LEN as u64),
                            ),
                            RecKind::Zero | RecKind::Discard => {
                                self.index.insert(r.lba, r.nblocks.into(), r.pos, None)
                            }
                            RecKind::Marker => {}
                        }
                        log.records.push_back(*r);
                    }
                    log.head = seg.end;
                    log.next_seq = seg.next_seq;
                    Ok(log.head - log.tail)
                }
            }
        };
        match published {
            Ok(dirty) => {
                self.stats.commits.fetch_add(1, Ordering::Relaxed);
                self.stats.appends.fetch_add(
                    recs.iter().filter(|r| r.kind != RecKind::Marker).count() as u64,
                    Ordering::Relaxed,
                );
                self.stats
                    .cached_bytes
                    .fetch_add(seg.data_bytes, Ordering::Relaxed);
                if self.cfg.background
                    && dirty * 100 >= self.log_len * u64::from(self.cfg.high_watermark)
                {
                    self.wake.notify_one();
                }
                for w in waiters {
                    let _ = w.send(Ok(()));
                }
            }
            Err(e) => {
                for w in waiters {
                    let _ = w.send(Err(copy_err(&e)));
                }
            }
        }
        seg.start = seg.end;
        seg.data_bytes = 0;
    }

    /// Wait until the log has room up to position `next`: destage inline without a
    /// background destager, otherwise wake it and wait for it.
    async fn wait_space(self: &Arc<Self>, next: u64) -> Result<()> {
        loop {
            if self.failed.load(Ordering::Acquire) {
                return Err(failed_err());
            }
            let notified = self.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if next <= self.log.lock().tail + self.log_len {
                return Ok(());
            }
            if let Some(e) = self.destage_error.lock().as_ref() {
                return Err(Error::new(
                    e.kind(),
                    format!("cache log full and destaging fails: {}", e.context()),
                ));
            }
            if self.cfg.background && !self.shutdown.load(Ordering::Acquire) {
                let _urgent = super::destage::Counted::new(&self.want_space);
                self.wake.notify_one();
                notified.await;
            } else if !self.destage_detached().await? {
                return Err(Error::new(
                    ErrorKind::NoSpace,
                    "cache log full with nothing to destage",
                ));
            }
        }
    }
}

fn failed_err() -> Error {
    Error::new(ErrorKind::Io, "the cache device failed")
}
