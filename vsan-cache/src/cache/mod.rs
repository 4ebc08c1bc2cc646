//! `WriteBackCache`: the cache itself.
//!
//! Pieces: [`commit`] appends records (group commit), [`destage`] writes them to the
//! backing store in epochs and runs the background destager; this file opens and formats
//! a cache, serves reads, routes writes by mode, and handles a failing cache device.

mod commit;
mod destage;

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::{error, info, warn};
use vsan_core::{BlockDevice, Error, ErrorKind, Geometry, IoFlags, IoFuture, Op, Result};

use crate::config::{CacheConfig, CacheState, CacheStats, DataLoss, Recovery};
use crate::format::{
    self, CACHE_BLOCK, CacheMode, HEADER_LEN, LOG_START, SUPERBLOCK_LEN, Superblock,
};
use crate::index::{Content, Index};
use crate::media::{FastDevice, read_chunked};

pub(crate) const BLOCK: u64 = CACHE_BLOCK as u64;

/// A record in the live log (between the tail and the head), as the destager needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rec {
    pos: u64,
    seq: u64,
    lba: u64,
    nblocks: u32,
    kind: RecKind,
    /// Where the next record starts.
    next: u64,
    /// The backing store already holds this record's data (write-through): destaging it
    /// writes nothing, and losing it loses nothing.
    clean: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecKind {
    Data,
    Zero,
    Discard,
    /// WRAP records and FLUSH marks: nothing to destage.
    Marker,
}

/// The log's moving parts, behind one short lock.
#[derive(Debug)]
pub(crate) struct LogState {
    /// Oldest live record (what the superblock on the device says, or will say once the
    /// destage that moved it has written it).
    tail: u64,
    tail_seq: u64,
    /// After the last committed record.
    head: u64,
    next_seq: u64,
    records: VecDeque<Rec>,
}

#[derive(Default)]
struct Stats {
    read_hits: AtomicU64,
    read_misses: AtomicU64,
    cached_bytes: AtomicU64,
    bypassed_bytes: AtomicU64,
    destaged_bytes: AtomicU64,
    destage_epochs: AtomicU64,
    /// f64 bits.
    destage_rate: AtomicU64,
    commits: AtomicU64,
    appends: AtomicU64,
}

/// Recent sequential streams, for the sequential cutoff.
#[derive(Debug, Default, Clone, Copy)]
struct Stream {
    end: u64,
    bytes: u64,
    last_use: u64,
}

const STREAMS: usize = 16;

pub(crate) struct Inner {
    fast: FastDevice,
    backing: Arc<dyn BlockDevice>,
    geometry: Geometry,
    log_len: u64,
    cfg: CacheConfig,
    /// The superblock as last written; its writer holds `sb_write`.
    sb: Mutex<Superblock>,
    sb_write: tokio::sync::Mutex<()>,
    index: Index,
    log: Mutex<LogState>,
    commit: Mutex<commit::Queue>,
    /// Highest log position a commit has started to write (for reads from a block fast
    /// device, which check it after reading to know the space was not reused under them).
    reserved_head: AtomicU64,
    /// Tail moved (space freed), or the destager gave up: appenders waiting for room
    /// look again.
    space: Notify,
    /// Wakes the background destager.
    wake: Notify,
    /// Appenders waiting for room.
    want_space: AtomicU64,
    /// Callers of `drain` or of a write that must destage overlapping records first.
    draining: AtomicU64,
    destage_lock: tokio::sync::Mutex<()>,
    /// The last destage error, cleared by a destage that works.
    destage_error: Mutex<Option<Error>>,
    mode: AtomicU32,
    failed: AtomicBool,
    /// Makes `fail` run once, start to end.
    fail_lock: Mutex<()>,
    /// The superblock was (or is being) marked failed.
    marked: AtomicBool,
    lost_blocks: AtomicU64,
    loss_count: AtomicU64,
    closed: AtomicBool,
    shutdown: AtomicBool,
    /// A write went straight to the backing store without FUA since the last flush.
    backing_unflushed: AtomicBool,
    streams: Mutex<([Stream; STREAMS], u64)>,
    max_record_blocks: u32,
    stats: Stats,
    recovery: Recovery,
}

/// A log-structured write-back cache on a fast persistent device in front of a backing
/// [`BlockDevice`]; itself a `BlockDevice` of the backing store's size, in 4096-byte
/// blocks.
///
/// # Writes
/// In write-back mode a write is appended to the log as one record (header with seq, lba,
/// length, crc of header and data), persisted, entered in the index, and only then
/// acknowledged: **every acknowledged write is durable**, so FLUSH has nothing to do for
/// cached writes and FUA is implied. Concurrent writers share one persist (group commit:
/// the first writer to find nobody committing commits everybody queued behind it).
///
/// # Reads
/// Each block is looked up in the sharded index: hits are copied from the log, misses
/// read from the backing store (adjacent misses in one request).
///
/// # Destage
/// In epochs, oldest records first: the records of an epoch are coalesced (the last write
/// of a block wins), written to the backing store, the backing store is flushed, and only
/// then does the superblock's tail move past them and their space become free. So the
/// backing store always holds the cached writes up to some point in log order —
/// together with the writes that bypassed the cache, which only ever land on blocks no
/// live record covers.
///
/// # Modes (switch with [`set_mode`](Self::set_mode); kept on the device)
/// - **write-back**: writes go to the log (subject to the sequential cutoff).
/// - **write-through**: records overlapping the write are destaged first, then the write
///   goes to the backing store and, once it is there, to the log; it completes when both
///   have it. The backing store always has every acknowledged write (durable after a
///   flush or with FUA, as on the backing store alone); the log serves reads, and losing
///   the cache device loses nothing.
/// - **write-around**: records overlapping the write are destaged first, then it goes to
///   the backing store only.
/// - **pass-through**: like write-around, and the destager empties the log at full speed.
///
/// Cached data stays readable in every mode until it is destaged.
/// [`detach`](Self::detach) switches to pass-through and waits until the log is empty.
///
/// # Shutdown and recovery
/// [`close`](Self::close) destages everything and writes a clean superblock, so the next
/// open scans nothing. After a crash, open scans from the tail and stops at the first
/// record whose header crc, seq or data crc does not fit; every record before it is
/// replayed into the index, and the rest of the log is zeroed before anything is appended
/// (a whole but never acknowledged record behind a torn one could otherwise be taken for a
/// new one later). Format, and an open after a clean shutdown, start the sequence numbers
/// at a random value, so the records of an earlier format of the same device (or whole
/// records the clean superblock does not know of) are never mistaken for new ones.
///
/// # Cache device failure
/// An error from the fast device switches the cache to pass-through for good (until it
/// is formatted again). If records not yet destaged held data the backing store lacks,
/// that data is lost: [`state`](Self::state) says how many blocks, and reads of them
/// fail or return the backing store's older data as [`CacheConfig::data_loss`] says (the
/// latter counted in [`data_loss_count`](Self::data_loss_count), which a mirror watches).
/// The write that hit the error is written to the backing store instead and succeeds.
/// The cache also marks its superblock failed (if the device still takes that write), and
/// [`open`](Self::open) refuses such a device: its log is stale, and replaying it would
/// roll back writes the backing store took since. Format it again to use it.
pub struct WriteBackCache {
    inner: Arc<Inner>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for WriteBackCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBackCache")
            .field("fast", &self.inner.fast)
            .field("log_len", &self.inner.log_len)
            .field("mode", &self.inner.mode())
            .finish()
    }
}

fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// The superblock copies and the log must not share a block of the fast device (their
/// writers do not order against each other), so its blocks may be at most 4096 bytes.
fn check_fast_block(fast: &FastDevice) -> Result<()> {
    if fast.block_size() > CACHE_BLOCK {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "a cache device with {}-byte blocks is not supported (at most {CACHE_BLOCK})",
                fast.block_size()
            ),
        ));
    }
    Ok(())
}

fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Corrupt, what.to_string())
}

impl WriteBackCache {
    /// Format `fast` as a cache for `backing`, starting in `mode`. Everything on `fast` is
    /// forgotten. The log is the device minus 8 KiB of superblocks, rounded down to 4 KiB.
    ///
    /// Refuses a backing store whose block size is over 4096 or whose size is not a
    /// multiple of 4096, and a fast device too small for a 64 KiB log.
    pub async fn format(
        fast: &FastDevice,
        backing: &dyn BlockDevice,
        mode: CacheMode,
    ) -> Result<()> {
        let g = backing.geometry();
        if g.block_size() > CACHE_BLOCK || g.size() % BLOCK != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "the cache works in {CACHE_BLOCK}-byte blocks: a backing store of {} bytes \
                     in {}-byte blocks does not fit",
                    g.size(),
                    g.block_size()
                ),
            ));
        }
        check_fast_block(fast)?;
        let log_len = fast.len().saturating_sub(LOG_START) / format::LOG_ALIGN * format::LOG_ALIGN;
        format::check_log_len(log_len).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("cache device of {} bytes: {e}", fast.len()),
            )
        })?;
        let mut cache_id = [0u8; 16];
        cache_id[..8].copy_from_slice(&random_u64().to_le_bytes());
        cache_id[8..].copy_from_slice(&random_u64().to_le_bytes());
        // Far from 0 and from any earlier format's numbers, with room to grow.
        let tail_seq = (random_u64() >> 4) | (1 << 40);
        let sb = Superblock {
            seq: 1,
            cache_id,
            backing_size: g.size(),
            backing_block_size: g.block_size(),
            cache_block_size: CACHE_BLOCK,
            log_len,
            tail: 0,
            tail_seq,
            head: 0,
            next_seq: tail_seq,
            clean_shutdown: true,
            failed: false,
            mode,
        };
        sb.check()
            .map_err(|e| Error::new(ErrorKind::InvalidArgument, e.to_string()))?;
        // Both superblock copies and the first log block are zeroed and persisted before
        // the new superblock is written: a cut in between leaves no valid superblock, never
        // the old one.
        fast.write(0, &vec![0u8; LOG_START as usize + 4096]).await?;
        fast.persist(0, LOG_START + 4096).await?;
        let off = format::superblock_offset(sb.seq);
        fast.write(off, &sb.encode()).await?;
        fast.persist(off, SUPERBLOCK_LEN as u64).await?;
        info!(
            log_len,
            backing = g.size(),
            ?mode,
            "cache device formatted ({} bytes)",
            fast.len()
        );
        Ok(())
    }

    /// Open a formatted cache device over `backing`, recovering its log (see the type's
    /// docs), and start the background destager if `cfg.background`.
    ///
    /// Refuses a device that holds no valid superblock, one formatted for a backing
    /// store of another size or block size, and a device shorter than its log.
    pub async fn open(
        fast: FastDevice,
        backing: Arc<dyn BlockDevice>,
        cfg: CacheConfig,
    ) -> Result<WriteBackCache> {
        cfg.check()
            .map_err(|e| e.context_prefix("cache settings"))?;
        check_fast_block(&fast)?;
        let mut sb = Self::inspect(&fast).await?;
        if sb.failed {
            return Err(corrupt(
                "the cache device failed while in use: its log is stale (newer writes went to \
                 the backing store since) and is not replayed; format it again to use it",
            ));
        }
        let g = backing.geometry();
        if g.max_io() < CACHE_BLOCK {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "a backing store whose largest request ({} bytes) is under {CACHE_BLOCK} \
                     cannot be cached",
                    g.max_io()
                ),
            ));
        }
        if sb.backing_size != g.size() || sb.backing_block_size != g.block_size() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "cache device was formatted for a backing store of {} bytes in {}-byte \
                     blocks; this one has {} bytes in {}-byte blocks",
                    sb.backing_size,
                    sb.backing_block_size,
                    g.size(),
                    g.block_size()
                ),
            ));
        }
        if fast.len() < LOG_START + sb.log_len {
            return Err(corrupt(format!(
                "cache device of {} bytes is shorter than its log of {} bytes",
                fast.len(),
                sb.log_len
            )));
        }
        if cfg.background && tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "background destage needs a tokio runtime",
            ));
        }
        let log_len = sb.log_len;
        // Every block the log can hold dirty at once, at most.
        let index = Index::with_capacity(sb.log_len / BLOCK);
        let mut records = VecDeque::new();
        let (head, next_seq, recovery) = if sb.clean_shutdown && sb.head == sb.tail {
            let r = Recovery {
                clean: true,
                records: 0,
                bytes: 0,
                stopped: String::new(),
            };
            // The log is empty, but its space may hold whole records the clean superblock
            // does not know of (left after a newer superblock copy that was lost): the next
            // crash's scan would take any of them that carries the next seq. Start the seqs
            // afresh, as format does, so none can.
            sb.tail_seq = (random_u64() >> 4) | (1 << 40);
            sb.next_seq = sb.tail_seq;
            (sb.head, sb.next_seq, r)
        } else {
            let log = if let Some(s) =
                // SAFETY: nothing writes the device while it is being opened.
                unsafe { fast.mapped_slice(LOG_START, log_len as usize) }
            {
                s.to_vec()
            } else {
                fast.read(LOG_START, log_len as usize).await?.to_vec()
            };
            let mut count = 0;
            let end = format::scan(&log, log_len, sb.tail, sb.tail_seq, |pos, h, _| {
                count += 1;
                let (kind, next) = if h.is_wrap() {
                    (RecKind::Marker, pos - pos % log_len + log_len)
                } else if h.is_flush_mark() {
                    (RecKind::Marker, pos + h.stored_len())
                } else if h.is_discard() {
                    (RecKind::Discard, pos + h.stored_len())
                } else if h.is_range() {
                    (RecKind::Zero, pos + h.stored_len())
                } else {
                    (RecKind::Data, pos + h.stored_len())
                };
                if kind == RecKind::Data {
                    index.insert(h.lba, h.nblocks.into(), pos, Some(pos + HEADER_LEN as u64));
                } else if matches!(kind, RecKind::Zero | RecKind::Discard) {
                    index.insert(h.lba, h.nblocks.into(), pos, None);
                }
                records.push_back(Rec {
                    pos,
                    seq: h.seq,
                    lba: h.lba,
                    nblocks: h.nblocks,
                    kind,
                    next,
                    clean: false,
                });
            });
            if let format::StopReason::BadLog(e) = &end.stopped {
                return Err(corrupt(format!("cache log: {e}")));
            }
            let r = Recovery {
                clean: false,
                records: count,
                bytes: end.head - sb.tail,
                stopped: format!("{:?}", end.stopped),
            };
            (end.head, end.next_seq, r)
        };
        // A record that ends past the backing store would be refused on every destage.
        if let Some(bad) = records.iter().find(|r| {
            // `lba + nblocks` fits (the header decoder checks); in bytes it may not.
            let end = (r.lba + u64::from(r.nblocks)).checked_mul(BLOCK);
            r.kind != RecKind::Marker && end.is_none_or(|end| end > g.size())
        }) {
            return Err(corrupt(format!(
                "cache log record at {} covers blocks {}.. past the backing store's end",
                bad.pos, bad.lba
            )));
        }
        let mode = cfg.mode.unwrap_or(sb.mode);
        let max_record_blocks = {
            let by_log = (log_len / 4 / BLOCK).max(1);
            by_log.min(1024) as u32
        };
        let max_io = g.max_io() / CACHE_BLOCK * CACHE_BLOCK;
        let geometry = Geometry::with_max_io(g.size(), CACHE_BLOCK, max_io.max(CACHE_BLOCK))?;
        let inner = Arc::new(Inner {
            fast,
            backing,
            geometry,
            log_len,
            cfg,
            sb: Mutex::new(sb.clone()),
            sb_write: tokio::sync::Mutex::new(()),
            index,
            log: Mutex::new(LogState {
                tail: sb.tail,
                tail_seq: sb.tail_seq,
                head,
                next_seq,
                records,
            }),
            commit: Mutex::new(commit::Queue::default()),
            reserved_head: AtomicU64::new(head),
            space: Notify::new(),
            wake: Notify::new(),
            want_space: AtomicU64::new(0),
            draining: AtomicU64::new(0),
            destage_lock: tokio::sync::Mutex::new(()),
            destage_error: Mutex::new(None),
            mode: AtomicU32::new(mode.to_u32()),
            failed: AtomicBool::new(false),
            fail_lock: Mutex::new(()),
            marked: AtomicBool::new(false),
            lost_blocks: AtomicU64::new(0),
            loss_count: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            backing_unflushed: AtomicBool::new(false),
            streams: Mutex::new(([Stream::default(); STREAMS], 0)),
            max_record_blocks,
            stats: Stats::default(),
            recovery: recovery.clone(),
        });
        if !recovery.clean {
            // Records past the head were never acknowledged, but some may be whole (a
            // batch persists as a unit, and a torn first record hides the rest). New
            // records will reuse their positions and sequence numbers, so one left whole
            // behind a new record of the same length would pass the next scan. Zero the
            // free part of the log before anything is appended.
            inner.zero_free_log().await?;
        }
        // From here a crash must scan: the superblock says "not clean" before any write.
        inner
            .write_superblock(|sb| {
                sb.clean_shutdown = false;
                sb.mode = mode;
            })
            .await?;
        if recovery.clean {
            info!(log_len, ?mode, "cache opened after a clean shutdown");
        } else {
            info!(
                log_len,
                ?mode,
                records = recovery.records,
                bytes = recovery.bytes,
                dirty_blocks = inner.index.len(),
                stopped = %recovery.stopped,
                "cache opened after a crash: log replayed"
            );
        }
        let task = inner
            .cfg
            .background
            .then(|| tokio::spawn(destage::background(inner.clone())));
        Ok(WriteBackCache {
            inner,
            task: Mutex::new(task),
        })
    }

    /// The superblock on `fast`, if it holds a valid one: whether it is formatted, for
    /// which backing store, in which mode. Reads only.
    pub async fn inspect(fast: &FastDevice) -> Result<Superblock> {
        if fast.len() < LOG_START {
            return Err(corrupt(format!(
                "cache device of {} bytes is too small to hold superblocks",
                fast.len()
            )));
        }
        let sbs = fast.read(0, LOG_START as usize).await?;
        format::pick(&sbs[..SUPERBLOCK_LEN], &sbs[SUPERBLOCK_LEN..])
            .map_err(|e| corrupt(format!("cache device holds no usable superblock: {e}")))
    }

    /// The mode now.
    pub fn mode(&self) -> CacheMode {
        self.inner.mode()
    }

    /// Switch to `mode` (stored on the device). Data already cached stays readable and is
    /// destaged as usual; pass-through destages it at full speed.
    pub async fn set_mode(&self, mode: CacheMode) -> Result<()> {
        self.inner.check_open()?;
        if self.inner.failed.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::Io,
                "the cache device failed: the cache stays in pass-through",
            ));
        }
        let old = self.inner.mode();
        self.inner.mode.store(mode.to_u32(), Ordering::Release);
        if self.inner.failed.load(Ordering::Acquire) {
            // A failure raced the switch: pass-through stays.
            self.inner
                .mode
                .store(CacheMode::PassThrough.to_u32(), Ordering::Release);
            return Err(Error::new(ErrorKind::Io, "the cache device failed"));
        }
        self.inner.write_superblock(|sb| sb.mode = mode).await?;
        if old != mode {
            info!(from = ?old, to = ?mode, "cache mode changed");
        }
        self.inner.wake.notify_one();
        Ok(())
    }

    /// Switch to pass-through and wait until every cached record is destaged: afterwards
    /// the backing store holds everything and the cache device can be removed.
    pub async fn detach(&self) -> Result<()> {
        self.set_mode(CacheMode::PassThrough).await?;
        self.drain().await?;
        info!("cache detached: log empty, pass-through");
        Ok(())
    }

    /// Destage one epoch now; `false` when there was nothing to destage.
    pub async fn destage(&self) -> Result<bool> {
        self.inner.check_open()?;
        self.inner.destage_detached().await
    }

    /// Destage until the log is empty (records appended meanwhile included).
    pub async fn drain(&self) -> Result<()> {
        self.inner.check_open()?;
        self.inner.drain().await
    }

    /// Stop the background destager, destage everything, flush the backing store and
    /// mark the superblock clean. Every later operation fails with `ErrorKind::Closed`.
    /// A failed cache just stops.
    pub async fn close(&self) -> Result<()> {
        // New operations fail from here; appends already queued are let finish, so none
        // lands after the clean superblock (the next open would not look for it). Set under
        // the commit lock, which `append` checks it under.
        {
            let _q = self.inner.commit.lock();
            self.inner.check_open()?;
            self.inner.closed.store(true, Ordering::Release);
        }
        self.inner.shutdown.store(true, Ordering::Release);
        self.inner.wake.notify_one();
        let task = self.task.lock().take();
        if let Some(t) = task {
            let _ = t.await;
        }
        while {
            let q = self.inner.commit.lock();
            q.busy()
        } {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        if self.inner.failed.load(Ordering::Acquire) {
            Ok(())
        } else {
            self.inner.close().await
        }
    }

    /// Counters and levels.
    pub fn stats(&self) -> CacheStats {
        self.inner.stats()
    }

    /// Whether the cache works.
    pub fn state(&self) -> CacheState {
        self.inner.state()
    }

    /// What opening found.
    pub fn recovery(&self) -> &Recovery {
        &self.inner.recovery
    }

    /// Times acknowledged data was lost with the cache device (0 or 1: a failed cache
    /// stays failed).
    pub fn data_loss_count(&self) -> u64 {
        self.inner.loss_count.load(Ordering::Acquire)
    }

    /// The log's size in bytes.
    pub fn log_len(&self) -> u64 {
        self.inner.log_len
    }
}

/// Dropping the cache stops its background destager without waiting: a destage step
/// already running on another thread may still finish its current write. Call
/// [`close`](WriteBackCache::close) first to stop cleanly (and before opening the same
/// devices again in the same process).
impl Drop for WriteBackCache {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::Release);
        self.inner.wake.notify_one();
        if let Some(t) = self.task.lock().take() {
            t.abort();
        }
    }
}

/// What a write does to its blocks.
#[derive(Debug, Clone)]
pub(crate) enum Payload {
    Data(Bytes),
    Zero,
    Discard,
}

impl Inner {
    fn mode(&self) -> CacheMode {
        CacheMode::from_u32(self.mode.load(Ordering::Acquire)).unwrap_or(CacheMode::PassThrough)
    }

    fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::new(ErrorKind::Closed, "the cache is closed"))
        } else {
            Ok(())
        }
    }

    fn state(&self) -> CacheState {
        if self.closed.load(Ordering::Acquire) {
            CacheState::Closed
        } else if self.failed.load(Ordering::Acquire) {
            CacheState::Failed {
                lost_blocks: self.lost_blocks.load(Ordering::Acquire),
            }
        } else {
            CacheState::Running
        }
    }

    fn dirty_bytes(&self) -> u64 {
        let log = self.log.lock();
        log.head - log.tail
    }

    fn stats(&self) -> CacheStats {
        let s = &self.stats;
        let dirty_bytes = if self.failed.load(Ordering::Acquire) {
            0
        } else {
            self.dirty_bytes()
        };
        CacheStats {
            mode: self.mode(),
            state: self.state(),
            read_hits: s.read_hits.load(Ordering::Relaxed),
            read_misses: s.read_misses.load(Ordering::Relaxed),
            cached_bytes: s.cached_bytes.load(Ordering::Relaxed),
            bypassed_bytes: s.bypassed_bytes.load(Ordering::Relaxed),
            dirty_blocks: if self.failed.load(Ordering::Acquire) {
                0
            } else {
                self.index.len()
            },
            dirty_bytes,
            log_bytes: self.log_len,
            occupancy: dirty_bytes as f64 / self.log_len as f64,
            destaged_bytes: s.destaged_bytes.load(Ordering::Relaxed),
            destage_epochs: s.destage_epochs.load(Ordering::Relaxed),
            destage_rate: f64::from_bits(s.destage_rate.load(Ordering::Relaxed)),
            commits: s.commits.load(Ordering::Relaxed),
            appends: s.appends.load(Ordering::Relaxed),
            data_loss_count: self.loss_count.load(Ordering::Acquire),
        }
    }

    /// Write the superblock with `edit` applied (and the next seq), then persist it. A
    /// failure of the cache device fails the cache.
    async fn write_superblock(&self, edit: impl FnOnce(&mut Superblock)) -> Result<()> {
        let w = self.sb_write.lock().await;
        match self.store_superblock(edit).await {
            Ok(()) => Ok(()),
            Err(e) => {
                drop(w);
                self.fail_and_mark(&e).await;
                Err(e)
            }
        }
    }

    /// [`fail`](Self::fail), then [`mark_failed`](Self::mark_failed) (once).
    pub(crate) async fn fail_and_mark(&self, e: &Error) {
        let first = !self.failed.load(Ordering::Acquire);
        self.fail(e);
        if first && !self.marked.swap(true, Ordering::AcqRel) {
            self.mark_failed().await;
        }
    }

    /// Write the superblock with `edit` applied and the next seq, persist it, and keep it
    /// as the current one. The caller holds `sb_write`.
    async fn store_superblock(&self, edit: impl FnOnce(&mut Superblock)) -> Result<()> {
        let mut sb = self.sb.lock().clone();
        edit(&mut sb);
        sb.seq += 1;
        let off = format::superblock_offset(sb.seq);
        self.fast.write(off, &sb.encode()).await?;
        self.fast.persist(off, SUPERBLOCK_LEN as u64).await?;
        *self.sb.lock() = sb;
        Ok(())
    }

    /// The cache device failed: from now on everything goes to the backing store.
    ///
    /// What is lost is counted (and `loss_count` bumped) *before* `failed` is set, so a
    /// reader that sees `failed` can serve the backing store under `ServeBacking`.
    fn fail(&self, e: &Error) {
        let _once = self.fail_lock.lock();
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        // Records whose data the backing store lacks: not destaged (the destager marks
        // an epoch clean once the backing store is flushed) and not write-through.
        let dirty: std::collections::HashSet<u64> = {
            let mut log = self.log.lock();
            let dirty = log
                .records
                .iter()
                .filter(|r| !r.clean && r.kind != RecKind::Marker)
                .map(|r| r.pos)
                .collect();
            log.records.clear();
            dirty
        };
        // Only blocks whose newest record is dirty are lost.
        self.index.retain(|slot| dirty.contains(&slot.rec));
        let lost = self.index.len();
        self.lost_blocks.store(lost, Ordering::Release);
        if lost > 0 {
            self.loss_count.fetch_add(1, Ordering::AcqRel);
        }
        self.mode
            .store(CacheMode::PassThrough.to_u32(), Ordering::Release);
        self.failed.store(true, Ordering::Release);
        if lost == 0 || self.cfg.data_loss == DataLoss::ServeBacking {
            self.index.clear();
        }
        if lost > 0 {
            error!(
                lost_blocks = lost,
                "cache device failed ({e}): {lost} blocks of acknowledged data were only on it \
                 and are lost; now in pass-through"
            );
        } else {
            warn!("cache device failed ({e}): nothing dirty was lost; now in pass-through");
        }
        self.space.notify_waiters();
        self.wake.notify_one();
    }

    /// Best effort after a failure: mark the superblock failed, so the stale log is never
    /// replayed over the writes the backing store takes from now on.
    async fn mark_failed(&self) {
        let _w = self.sb_write.lock().await;
        let marked = self
            .store_superblock(|sb| {
                sb.failed = true;
                sb.clean_shutdown = false;
            })
            .await;
        match marked {
            Ok(()) => {
                info!("cache superblock marked failed: the device must be formatted again");
            }
            Err(e) => warn!(
                "could not mark the failed cache device's superblock ({e}): format it before \
                 using it again"
            ),
        }
    }

    /// Zero the log from the head to where the tail wraps round (`tail + log_len`), and
    /// persist it.
    async fn zero_free_log(&self) -> Result<()> {
        let (head, end) = {
            let log = self.log.lock();
            (log.head, log.tail + self.log_len)
        };
        const CHUNK: u64 = 1 << 20;
        let zeros = vec![0u8; CHUNK as usize];
        let mut pos = head;
        while pos < end {
            let off = pos % self.log_len;
            let n = (end - pos).min(self.log_len - off).min(CHUNK);
            self.fast
                .write(LOG_START + off, &zeros[..n as usize])
                .await?;
            pos += n;
        }
        if end > head {
            self.fast.persist(LOG_START, self.log_len).await?;
        }
        Ok(())
    }

    async fn read(&self, offset: u64, len: usize) -> Result<Bytes> {
        self.check_open()?;
        self.geometry.validate(Op::Read, offset, len as u64)?;
        let (lba, n) = (offset / BLOCK, len as u64 / BLOCK);
        if self.index.len() == 0 {
            self.stats.read_misses.fetch_add(n, Ordering::Relaxed);
            return self.backing.read(offset, len).await;
        }
        let failed = self.failed.load(Ordering::Acquire);
        let mut out = BytesMut::zeroed(len);
        // Runs of blocks to read from the backing store: (first block, count).
        let mut misses: Vec<(u64, u64)> = Vec::new();
        // For a block fast device: (block, data position) to read from it.
        let mut far_hits: Vec<(u64, u64, u64)> = Vec::new();
        let mut hits = 0u64;
        for (first, count) in Index::runs(lba, n) {
            let shard = self.index.lock(first);
            for b in first..first + count {
                match shard.get(&b) {
                    None => match misses.last_mut() {
                        Some((f, c)) if *f + *c == b => *c += 1,
                        _ => misses.push((b, 1)),
                    },
                    // The entry is a lost block: the loss is counted already (see `fail`).
                    Some(_) if failed && self.cfg.data_loss == DataLoss::ServeBacking => {
                        match misses.last_mut() {
                            Some((f, c)) if *f + *c == b => *c += 1,
                            _ => misses.push((b, 1)),
                        }
                    }
                    Some(_) if failed => {
                        return Err(Error::new(
                            ErrorKind::Io,
                            format!(
                                "block {b} (offset {}) was lost with the failed cache device",
                                b * BLOCK
                            ),
                        ));
                    }
                    Some(slot) => {
                        hits += 1;
                        let at = ((b - lba) * BLOCK) as usize;
                        match slot.content {
                            Content::Zero => {}
                            Content::Data(pos) => {
                                let dev = LOG_START + pos % self.log_len;
                                // SAFETY: the entry is in the index and its shard lock is
                                // held: the destager cannot free its space meanwhile.
                                match unsafe { self.fast.mapped_slice(dev, BLOCK as usize) } {
                                    Some(s) => out[at..at + BLOCK as usize].copy_from_slice(s),
                                    None => far_hits.push((b, pos, slot.rec)),
                                }
                            }
                        }
                    }
                }
            }
        }
        self.stats.read_hits.fetch_add(hits, Ordering::Relaxed);
        self.stats
            .read_misses
            .fetch_add(n - hits, Ordering::Relaxed);
        if !far_hits.is_empty() {
            for &(b, pos, _) in &far_hits {
                let data = match self
                    .fast
                    .read(LOG_START + pos % self.log_len, BLOCK as usize)
                    .await
                {
                    Ok(d) => d,
                    Err(e) => {
                        self.fail_and_mark(&e).await;
                        return Box::pin(self.read(offset, len)).await;
                    }
                };
                let at = ((b - lba) * BLOCK) as usize;
                out[at..at + BLOCK as usize].copy_from_slice(&data);
            }
            // The space read must not have been reused since: no append may have reached
            // a lap past it.
            let reserved = self.reserved_head.load(Ordering::Acquire);
            if far_hits
                .iter()
                .any(|&(_, pos, _)| reserved > pos + self.log_len)
            {
                return Box::pin(self.read(offset, len)).await;
            }
        }
        for (first, count) in misses {
            let data = read_chunked(
                self.backing.as_ref(),
                first * BLOCK,
                (count * BLOCK) as usize,
            )
            .await?;
            let at = ((first - lba) * BLOCK) as usize;
            out[at..at + data.len()].copy_from_slice(&data);
        }
        Ok(out.freeze())
    }

    /// Whether a write-back write continues a sequential run past the cutoff.
    fn sequential_bypass(&self, offset: u64, len: u64) -> bool {
        let cutoff = self.cfg.sequential_cutoff;
        if cutoff == 0 {
            return false;
        }
        if len >= cutoff {
            return true;
        }
        let mut g = self.streams.lock();
        let (streams, clock) = &mut *g;
        *clock += 1;
        let now = *clock;
        if let Some(s) = streams.iter_mut().find(|s| s.end == offset && s.bytes > 0) {
            s.end = offset + len;
            s.bytes += len;
            s.last_use = now;
            return s.bytes > cutoff;
        }
        if let Some(s) = streams.iter_mut().min_by_key(|s| s.last_use) {
            *s = Stream {
                end: offset + len,
                bytes: len,
                last_use: now,
            };
        }
        false
    }

    async fn write(
        self: &Arc<Self>,
        offset: u64,
        payload: Payload,
        len: u64,
        flags: IoFlags,
    ) -> Result<()> {
        self.check_open()?;
        let op = match payload {
            Payload::Data(_) => Op::Write,
            Payload::Zero => Op::WriteZeroes,
            Payload::Discard => Op::Discard,
        };
        self.geometry.validate(op, offset, len)?;
        if self.failed.load(Ordering::Acquire) {
            return self.write_direct(offset, payload, len, flags).await;
        }
        let lba = offset / BLOCK;
        let n = len / BLOCK;
        match self.mode() {
            CacheMode::WriteBack => {
                let bypass = matches!(payload, Payload::Data(_)) && self.sequential_bypass(offset, len)
                    // Huge zero/discard ranges would flood the index.
                    || !matches!(payload, Payload::Data(_)) && n > 1 << 16;
                if bypass {
                    return self.write_direct(offset, payload, len, flags).await;
                }
                match self.append(lba, n, payload.clone(), false).await {
                    Ok(()) => Ok(()),
                    Err(_) if self.failed.load(Ordering::Acquire) => {
                        self.write_direct(offset, payload, len, flags).await
                    }
                    Err(e) => Err(e),
                }
            }
            CacheMode::WriteThrough if n <= 1 << 16 => {
                self.drain_overlapping(lba, n).await?;
                // The backing store first: a record marked clean is skipped by destage,
                // whose backing flush covers only writes that completed before it. So the
                // record may exist only once its backing write has completed.
                self.backing_write(offset, payload.clone(), len, flags)
                    .await?;
                match self.append(lba, n, payload, true).await {
                    Ok(()) => Ok(()),
                    // The backing store has the data: a failed cache device loses nothing.
                    Err(_) if self.failed.load(Ordering::Acquire) => Ok(()),
                    Err(e) => Err(e),
                }
            }
            _ => self.write_direct(offset, payload, len, flags).await,
        }
    }

    async fn backing_write(
        &self,
        offset: u64,
        payload: Payload,
        len: u64,
        flags: IoFlags,
    ) -> Result<()> {
        match payload {
            Payload::Data(d) => self.backing.write(offset, d, flags).await?,
            Payload::Zero => self.backing.write_zeroes(offset, len, flags).await?,
            Payload::Discard => self.backing.discard(offset, len, flags).await?,
        }
        if !flags.contains(IoFlags::FUA) {
            self.backing_unflushed.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// A write to the backing store only, after destaging every record it overlaps (so no
    /// older cached data can later land on top of it).
    async fn write_direct(
        self: &Arc<Self>,
        offset: u64,
        payload: Payload,
        len: u64,
        flags: IoFlags,
    ) -> Result<()> {
        let (lba, n) = (offset / BLOCK, len / BLOCK);
        if !self.failed.load(Ordering::Acquire) {
            if let Err(e) = self.drain_overlapping(lba, n).await {
                if !self.failed.load(Ordering::Acquire) {
                    return Err(e);
                }
            }
        }
        self.backing_write(offset, payload, len, flags).await?;
        if self.failed.load(Ordering::Acquire) {
            // Rewritten blocks are no longer lost.
            self.index.remove_all_in(lba, n);
        }
        self.stats.bypassed_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    async fn flush(&self) -> Result<()> {
        self.check_open()?;
        // Cached writes are durable when acknowledged; only writes that went to the
        // backing store without FUA need its flush.
        if self.backing_unflushed.swap(false, Ordering::AcqRel) {
            if let Err(e) = self.backing.flush().await {
                self.backing_unflushed.store(true, Ordering::Release);
                return Err(e);
            }
        }
        Ok(())
    }

    async fn close(self: &Arc<Self>) -> Result<()> {
        self.drain().await?;
        self.backing.flush().await?;
        let (tail, seq) = {
            let log = self.log.lock();
            (log.tail, log.tail_seq)
        };
        self.write_superblock(|sb| {
            sb.clean_shutdown = true;
            sb.head = tail;
            sb.next_seq = seq;
        })
        .await?;
        let s = self.stats();
        info!(
            destaged = s.destaged_bytes,
            hits = s.read_hits,
            misses = s.read_misses,
            bypassed = s.bypassed_bytes,
            "cache closed cleanly (log empty)"
        );
        Ok(())
    }
}

impl BlockDevice for WriteBackCache {
    fn geometry(&self) -> Geometry {
        self.inner.geometry
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(self.inner.read(offset, len))
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        let len = data.len() as u64;
        Box::pin(self.inner.write(offset, Payload::Data(data), len, flags))
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(self.inner.flush())
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(self.inner.write(offset, Payload::Discard, len, flags))
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(self.inner.write(offset, Payload::Zero, len, flags))
    }

    /// Grows (once) when the cache device fails with data on it that the backing store
    /// lacks; bumped before any operation completes from the backing store afterwards.
    fn data_loss_count(&self) -> u64 {
        self.inner.loss_count.load(Ordering::Acquire)
    }
}
