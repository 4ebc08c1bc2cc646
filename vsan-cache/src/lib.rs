//! # vsan-cache: a persistent write-back cache
//!
//! [`WriteBackCache`] is a log-structured write-back cache on a fast persistent device
//! ([`FastDevice`]: a memory-mapped file on persistent memory / DAX or an NVMe SSD, or any
//! [`BlockDevice`](vsan_core::BlockDevice)) in front of any backing `BlockDevice`, and is
//! itself a `BlockDevice`, so it slots in as a mirror's local replica or behind an NBD
//! export.
//!
//! - **Writes** are appended to the log, persisted and indexed before they are
//!   acknowledged; concurrent writers share one persist (group commit).
//! - **Reads** merge cache hits from the log with misses from the backing store; the
//!   index is sharded, with no lock over all of it.
//! - **Destage** runs in epochs in log order (coalesce, write, flush the backing store,
//!   then move the tail), paced between watermarks by a PI controller; large sequential
//!   writes bypass the cache (sequential cutoff).
//! - **Modes** write-back, write-through, write-around and pass-through switch at run
//!   time; detach drains and passes through.
//! - **Recovery** after a crash scans from the tail and stops at the first torn record;
//!   after a clean close nothing is scanned.
//! - **Cache device failure** switches to pass-through and reports the lost data
//!   ([`CacheState`], `data_loss_count`), so a mirror above resyncs the replica.
//!
//! Fail points at the I/O edges (feature `failpoints`) are listed in [`failpoints`].
//!
//! The on-media layout is documented in [`format`](mod@format), which encodes and decodes
//! it as pure functions.
#![deny(missing_docs)]

mod cache;
mod config;
pub mod failpoints;
pub mod format;
mod index;
mod media;

pub use cache::WriteBackCache;
pub use config::{CacheConfig, CacheState, CacheStats, DataLoss, Recovery};
pub use format::CacheMode;
pub use media::FastDevice;
