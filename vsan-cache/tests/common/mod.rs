//! Set-ups shared by the cache's integration tests.
#![allow(dead_code)]

use std::sync::Arc;

use vsan_cache::{CacheConfig, CacheMode, FastDevice, WriteBackCache};
use vsan_core::{Geometry, MemDevice};

/// A RAM device of `size` bytes in 512-byte blocks.
pub fn mem(size: u64) -> Arc<MemDevice> {
    Arc::new(MemDevice::new(Geometry::new(size, 512).unwrap()))
}

/// No background destager (destage only when the log is full or when asked) and no
/// sequential cutoff: deterministic.
pub fn quiet() -> CacheConfig {
    CacheConfig {
        background: false,
        sequential_cutoff: 0,
        ..CacheConfig::default()
    }
}

/// A cache on a fresh RAM fast device of `fast_len` bytes, formatted (write-back) and
/// opened over `backing` with `cfg`.
pub async fn cache_over(
    fast_len: u64,
    backing: &Arc<MemDevice>,
    cfg: CacheConfig,
) -> (Arc<MemDevice>, WriteBackCache) {
    let fast = mem(fast_len);
    WriteBackCache::format(
        &FastDevice::block(fast.clone()),
        backing.as_ref(),
        CacheMode::WriteBack,
    )
    .await
    .unwrap();
    let c = WriteBackCache::open(FastDevice::block(fast.clone()), backing.clone(), cfg)
        .await
        .unwrap();
    (fast, c)
}
