//! Fail points at the cache's I/O edges, for tests that drive the error paths (the
//! model is tikv/raft-engine's): `fail::fail_point!`s compiled in only with the
//! `failpoints` feature. Without it nothing of them is compiled in; with it, a point
//! nobody configured costs one lookup in the fail crate's registry.
//!
//! | name             | where                                                      | action `return` |
//! |------------------|------------------------------------------------------------|-----------------|
//! | `cache::persist` | a group commit, before its log records are written to the fast device and persisted (what a write-back write waits for before it is acknowledged) | the write and persist fail with `Io`, nothing written: as any cache device failure, the cache fails over to pass-through for good (dirty blocks only it held are lost, counted in [`CacheState::Failed`](crate::CacheState::Failed) and `data_loss_count`) and the batch's writes go to the backing store instead |
//! | `cache::destage` | a destage epoch, before its blocks are written to the backing store | the epoch fails with `Io`, the backing store untouched: the records stay in the log, a writer waiting for log space sees the error |
//!
//! The points are process-global (every cache in the process evaluates them): configure
//! them with `fail::cfg` inside a `fail::FailScenario` (which serializes the tests that
//! hold one), or through the `FAILPOINTS` environment variable.
//! `proptests/tests/failpoints.rs` drives them.

/// A group commit's write and persist of log records.
pub const CACHE_PERSIST: &str = "cache::persist";
/// A destage epoch's writes to the backing store.
pub const CACHE_DESTAGE: &str = "cache::destage";
