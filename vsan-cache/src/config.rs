//! Settings of a [`WriteBackCache`](crate::WriteBackCache), and what it reports.

use vsan_core::{Error, ErrorKind, Result};

use crate::format::CacheMode;

/// What reads of blocks whose dirty data was lost with a failed cache device return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DataLoss {
    /// Fail them with `ErrorKind::Io` until they are written again: the right choice
    /// when nothing else holds a copy (a local-only disk).
    #[default]
    FailReads,
    /// Serve the backing store's (older) contents, and count the loss in
    /// `BlockDevice::data_loss_count`, which a mirror watches so it resyncs this replica
    /// from its peer before it trusts it again. The right choice under a mirror.
    ServeBacking,
}

/// Settings of a [`WriteBackCache`](crate::WriteBackCache); [`Default`] gives the
/// documented defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Run in this mode, storing it on the device; `None` keeps the mode the device was
    /// formatted or last set to.
    pub mode: Option<CacheMode>,
    /// Sequential cutoff in bytes (0 = off; default 4 MiB): once a run of sequential
    /// writes reaches this many bytes, or one write is this large, further writes of the
    /// run go straight to the backing store (after destaging cached blocks they overlap).
    pub sequential_cutoff: u64,
    /// Percent of the log in use at which destaging runs at full speed (default 60).
    pub high_watermark: u8,
    /// Percent of the log destaging brings the cache down to, paced, once it went above
    /// the high watermark (default 30). Below it the cache does not destage.
    pub low_watermark: u8,
    /// Destage from a background task (needs a tokio runtime at open; default `true`).
    /// Without it, records are destaged only when the log is full, or when
    /// [`destage`](crate::WriteBackCache::destage) or
    /// [`drain`](crate::WriteBackCache::drain) is called: deterministic, for tests.
    pub background: bool,
    /// Largest number of log bytes one destage epoch takes (default 4 MiB).
    pub epoch_bytes: u64,
    /// Slowest paced destage rate in bytes per second (default 4 MiB/s).
    pub min_destage_rate: u64,
    /// What reads of lost blocks return after the cache device failed.
    pub data_loss: DataLoss,
}

impl Default for CacheConfig {
    fn default() -> CacheConfig {
        CacheConfig {
            mode: None,
            sequential_cutoff: 4 << 20,
            high_watermark: 60,
            low_watermark: 30,
            background: true,
            epoch_bytes: 4 << 20,
            min_destage_rate: 4 << 20,
            data_loss: DataLoss::FailReads,
        }
    }
}

impl CacheConfig {
    /// Checks the watermarks (`0 < low < high <= 100`), the epoch size and the minimum
    /// destage rate; a setting out of range is [`ErrorKind::InvalidArgument`].
    pub fn check(&self) -> Result<()> {
        let bad = |why: String| Error::new(ErrorKind::InvalidArgument, why);
        let (lo, hi) = (self.low_watermark, self.high_watermark);
        if !(lo > 0 && lo < hi && hi <= 100) {
            return Err(bad(format!(
                "watermarks must satisfy 0 < low < high <= 100 (low {lo}, high {hi})"
            )));
        }
        if self.epoch_bytes < 4096 {
            return Err(bad(format!(
                "epoch of {} bytes is under 4096",
                self.epoch_bytes
            )));
        }
        if self.min_destage_rate == 0 {
            return Err(bad("minimum destage rate must not be 0".into()));
        }
        Ok(())
    }
}

/// Whether the cache works.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheState {
    /// The cache device works.
    Running,
    /// The cache device failed: every operation goes to the backing store.
    Failed {
        /// Blocks whose newest data was only on the cache device (0 when nothing dirty
        /// was lost).
        lost_blocks: u64,
    },
    /// [`close`](crate::WriteBackCache::close) ran; every operation fails.
    Closed,
}

/// Counters and levels of a [`WriteBackCache`](crate::WriteBackCache).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheStats {
    /// The mode now.
    pub mode: CacheMode,
    /// Whether the cache works.
    pub state: CacheState,
    /// Blocks read from the cache.
    pub read_hits: u64,
    /// Blocks read from the backing store.
    pub read_misses: u64,
    /// Bytes written into the log.
    pub cached_bytes: u64,
    /// Bytes written straight to the backing store (sequential cutoff, write-around,
    /// pass-through, a failed cache).
    pub bypassed_bytes: u64,
    /// Blocks with newer contents in the cache than in the backing store.
    pub dirty_blocks: u64,
    /// Bytes of log in use (records not yet destaged, headers included).
    pub dirty_bytes: u64,
    /// Size of the log region in bytes.
    pub log_bytes: u64,
    /// `dirty_bytes / log_bytes`, from 0 to 1.
    pub occupancy: f64,
    /// Bytes of log destaged so far.
    pub destaged_bytes: u64,
    /// Destage epochs completed.
    pub destage_epochs: u64,
    /// Destage rate of the last epochs (an average), in log bytes per second.
    pub destage_rate: f64,
    /// Group commits: each persisted one or more appends at once.
    pub commits: u64,
    /// Appends persisted (records, WRAP records excluded).
    pub appends: u64,
    /// Times acknowledged data was lost with the cache device.
    pub data_loss_count: u64,
}

/// What opening the cache found on the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The superblock said the cache was shut down cleanly: no scan ran.
    pub clean: bool,
    /// Records found between the tail and where the log ends (WRAP records included).
    pub records: u64,
    /// Log bytes those records take.
    pub bytes: u64,
    /// Why the scan stopped (empty after a clean shutdown).
    pub stopped: String,
}
