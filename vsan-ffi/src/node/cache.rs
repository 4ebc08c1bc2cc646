//! A disk's write-back cache at start and at shutdown: its file checked against the
//! config before anything is created, then mapped, formatted when blank and opened over
//! the disk's backing store; closed last at shutdown (everything destaged).

use std::path::Path;
use std::sync::Arc;

use tracing::{error, info};
use vsan_cache::format::{self as cache_format, Superblock as CacheSuperblock};
use vsan_cache::{DataLoss, FastDevice, WriteBackCache};
use vsan_core::{BlockDevice, Error, ErrorKind};

use super::config::{self, Backing, CacheSection, DiskSection, cache_mode_word};
use super::{DRAIN_TIMEOUT, StartError};

/// What a disk's cache file holds, learnt before anything is created or opened.
pub(super) enum CacheFile {
    /// Missing, or never written (all zeros where the superblocks go): format it, at
    /// `len` bytes.
    Blank { len: u64 },
    /// A formatted cache device.
    Formatted { sb: CacheSuperblock },
}

/// Look at disk `i`'s cache file and check it against the config: a missing file needs
/// `size`; an existing one must have the size `size` gives (when given), and, when
/// formatted, belong to a disk of this size and block size (exit 2 otherwise). A file
/// with data but no cache superblock is not formatted over, and a cache holding data for
/// an image that is gone is not replayed onto a new one (exit 1).
pub(super) fn inspect_cache(
    i: usize,
    d: &DiskSection,
    c: &CacheSection,
    data_dir: &Path,
) -> Result<CacheFile, StartError> {
    let key = |k: &str| format!("key `disk[{i}].cache.{k}`");
    let path = &c.path;
    let shown = path.display();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return match c.size {
                Some(size) => Ok(CacheFile::Blank { len: size.0 }),
                None => Err(StartError::Config(format!(
                    "{}: the cache file {shown} does not exist; give its size to create it",
                    key("size")
                ))),
            };
        }
        Err(e) => {
            return Err(StartError::Runtime(format!(
                "disk {}: cache file {shown}: {e}",
                d.name
            )));
        }
    };
    if !meta.is_file() {
        return Err(StartError::Config(format!(
            "{}: {shown} is not a regular file (the cache maps a file: one on a DAX file \
             system for persistent memory, or on an NVMe SSD)",
            key("path")
        )));
    }
    let len = meta.len();
    let head = {
        use std::io::Read;
        let mut buf = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(cache_format::LOG_START).read_to_end(&mut buf))
            .map_err(|e| {
                StartError::Runtime(format!("disk {}: cache file {shown}: {e}", d.name))
            })?;
        buf
    };
    let sb = if head.len() as u64 == cache_format::LOG_START {
        let (copy0, copy1) = head.split_at(cache_format::SUPERBLOCK_LEN);
        cache_format::pick(copy0, copy1)
    } else {
        Err(cache_format::FormatError::Short {
            what: "cache device",
            len: head.len(),
            need: cache_format::LOG_START as usize,
        })
    };
    let sb = match sb {
        Ok(sb) => sb,
        Err(_) if head.iter().all(|&b| b == 0) => {
            return match c.size {
                Some(size) if size.0 < len => Err(StartError::Config(format!(
                    "{}: the cache file {shown} is {len} bytes, more than the {} bytes given",
                    key("size"),
                    size.0
                ))),
                // A shorter file is extended.
                Some(size) => Ok(CacheFile::Blank { len: size.0 }),
                None if len < config::MIN_CACHE_SIZE => Err(StartError::Config(format!(
                    "{}: the cache file {shown} is only {len} bytes; give the size to \
                         make it (at least {} bytes)",
                    key("size"),
                    config::MIN_CACHE_SIZE
                ))),
                None => Ok(CacheFile::Blank { len }),
            };
        }
        Err(e) => {
            return Err(StartError::Runtime(format!(
                "disk {}: refusing to use {shown} as its cache: it holds data but no vsan \
                 cache superblock ({e}); it is not formatted over: remove the file (or zero \
                 its first 8 KiB) to have it formatted anew",
                d.name
            )));
        }
    };
    if let Some(size) = c.size
        && size.0 != len
    {
        return Err(StartError::Config(format!(
            "{}: the cache file {shown} is a formatted cache of {len} bytes, not {}: leave \
             size out or give the file's size",
            key("size"),
            size.0
        )));
    }
    if sb.backing_size != d.size.0 || sb.backing_block_size != d.block_size() {
        return Err(StartError::Config(format!(
            "{}: the cache file {shown} was formatted for a disk of {} bytes in {}-byte blocks; \
             disk {} has {} bytes in {}-byte blocks",
            key("path"),
            sb.backing_size,
            sb.backing_block_size,
            d.name,
            d.size.0,
            d.block_size()
        )));
    }
    let holds_data = !(sb.clean_shutdown && sb.head == sb.tail);
    if d.backing == Backing::File && holds_data && !d.image_path(data_dir).exists() {
        return Err(StartError::Runtime(format!(
            "disk {}: refusing to attach: the cache {shown} holds writes for the image {}, \
             which does not exist; replaying them onto a new image would make a disk that \
             never was: remove the cache file too",
            d.name,
            d.image_path(data_dir).display()
        )));
    }
    Ok(CacheFile::Formatted { sb })
}

/// Map disk `i`'s cache file, format it when it is blank (or when the backing store is
/// RAM, which holds nothing to recover), and open the cache over `backing`. Returns the
/// cache and its `cache disk=...` report line.
pub(super) async fn open_cache(
    i: usize,
    d: &DiskSection,
    c: &CacheSection,
    file: CacheFile,
    backing: Arc<dyn BlockDevice>,
    mirrored: bool,
) -> Result<(Arc<WriteBackCache>, String), StartError> {
    let shown = c.path.display();
    let key = |k: &str| format!("key `disk[{i}].cache.{k}`");
    let mut cfg = c
        .settings()
        .map_err(|(k, m)| StartError::Config(format!("{}: {m}", key(k))))?;
    let mode = c.cache_mode();
    // Under a mirror the peer holds what a failed cache device lost: serve the older
    // data and let the mirror resync this replica. Alone, nothing else holds it.
    cfg.data_loss = if mirrored {
        DataLoss::ServeBacking
    } else {
        DataLoss::FailReads
    };
    let runtime = |e: vsan_core::Error| {
        StartError::Runtime(format!("disk {}: cache file {shown}: {e}", d.name))
    };
    let (fast, format_why) = match file {
        CacheFile::Blank { len } => {
            if let Some(parent) = c.path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    StartError::Runtime(format!("cannot create {}: {e}", parent.display()))
                })?;
            }
            let fast = FastDevice::map_file(&c.path, Some(len)).map_err(runtime)?;
            (fast, Some("new"))
        }
        CacheFile::Formatted { sb } => {
            let fast = FastDevice::map_file(&c.path, None).map_err(runtime)?;
            let why =
                (d.backing == Backing::Mem).then_some(if sb.clean_shutdown && sb.head == sb.tail {
                    "the backing store is RAM"
                } else {
                    "the backing store is RAM: its cached writes belong to a disk that is gone"
                });
            (fast, why)
        }
    };
    let formatted = format_why.is_some();
    if let Some(why) = format_why {
        WriteBackCache::format(&fast, backing.as_ref(), mode)
            .await
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidArgument => StartError::Config(format!("{}: {e}", key("size"))),
                _ => runtime(e),
            })?;
        info!(disk = %d.name, path = %shown, size = fast.len(), mode = cache_mode_word(mode),
            "cache file formatted ({why})");
    }
    let cache = WriteBackCache::open(fast, backing, cfg)
        .await
        .map_err(|e| match e.kind() {
            ErrorKind::InvalidArgument => StartError::Config(format!("{}: {e}", key("path"))),
            _ => StartError::Runtime(format!(
                "disk {}: refusing to attach the cache {shown}: {e}",
                d.name
            )),
        })?;
    let r = cache.recovery().clone();
    let s = cache.stats();
    let open = if formatted {
        "formatted"
    } else if r.clean {
        "clean"
    } else {
        "recovered"
    };
    if r.clean {
        info!(disk = %d.name, path = %shown, mode = cache_mode_word(s.mode),
            log_bytes = s.log_bytes, "cache opened ({open})");
    } else {
        info!(disk = %d.name, path = %shown, mode = cache_mode_word(s.mode),
            records = r.records, bytes = r.bytes, dirty_blocks = s.dirty_blocks,
            stopped = %r.stopped,
            "cache crash recovery: {} records replayed", r.records);
    }
    let line = format!(
        "cache disk={} mode={} open={open} records={} dirty_bytes={} log_bytes={}",
        d.name,
        cache_mode_word(s.mode),
        r.records,
        s.dirty_bytes,
        s.log_bytes
    );
    Ok((Arc::new(cache), line))
}

/// Close a disk's cache: destage everything, flush the backing store, mark the cache
/// device clean (the next start scans nothing), and log its counters. Returns whether it
/// closed cleanly: an error has the close's kind, or [`ErrorKind::Timeout`].
pub(super) async fn close_cache(name: &str, cache: Arc<WriteBackCache>) -> vsan_core::Result<()> {
    let closed = tokio::time::timeout(DRAIN_TIMEOUT, cache.close()).await;
    log_cache_stats(name, &cache);
    match closed {
        Ok(Ok(())) => {
            info!(disk = %name, "cache closed: everything destaged, marked clean");
            Ok(())
        }
        Ok(Err(e)) => {
            error!(disk = %name, "closing the cache failed: {e}");
            Err(Error::new(
                e.kind(),
                format!("disk {name}: closing the cache failed: {e}"),
            ))
        }
        Err(_) => {
            error!(disk = %name, "closing the cache timed out after {DRAIN_TIMEOUT:?}");
            Err(Error::new(
                ErrorKind::Timeout,
                format!("disk {name}: closing the cache timed out after {DRAIN_TIMEOUT:?}"),
            ))
        }
    }
}

fn log_cache_stats(name: &str, cache: &WriteBackCache) {
    let s = cache.stats();
    info!(
        disk = %name,
        mode = cache_mode_word(s.mode),
        state = ?s.state,
        read_hits = s.read_hits,
        read_misses = s.read_misses,
        cached_bytes = s.cached_bytes,
        bypassed_bytes = s.bypassed_bytes,
        destaged_bytes = s.destaged_bytes,
        destage_epochs = s.destage_epochs,
        commits = s.commits,
        appends = s.appends,
        dirty_bytes = s.dirty_bytes,
        data_loss_count = s.data_loss_count,
        "cache stats"
    );
}
