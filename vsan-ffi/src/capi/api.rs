//! Nodes and disks: open, close, geometry, status, and the mirror's operator actions.

use std::ffi::{CStr, c_char};
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;
use vsan_cache::{CacheMode, CacheState};
use vsan_replica::protocol::{Freshness, LinkState, Proof, SyncKind, SyncRole};

use super::handles::{self, DiskObj, NodeObj, vsan_disk, vsan_node};
use super::{
    Failure, VSAN_ERR_INVALID_ARGUMENT, VSAN_ERR_IO, VSAN_ERR_NOT_FOUND, VSAN_ERR_NOT_SUPPORTED,
    VSAN_ERR_TIMEOUT, call, core_failure, not_in_callback, out_ptr,
};
use crate::node::config::Config;
use crate::node::{DRAIN_TIMEOUT, Node, StartError, StartOptions};

/// A disk's size and block sizes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct vsan_geometry {
    /// Size in bytes (a multiple of `block_size`).
    pub size: u64,
    /// Logical block size: offsets and lengths of I/O are multiples of it.
    pub block_size: u32,
    /// The largest length one read or write may have, in bytes.
    pub max_io: u32,
}

/// `vsan_disk_status.link`: the disk is not mirrored.
pub const VSAN_LINK_LOCAL: u32 = 0;
/// `vsan_disk_status.link`: the peer has not connected yet since the node started.
pub const VSAN_LINK_WAITING: u32 = 1;
/// `vsan_disk_status.link`: a link is up and the two nodes are agreeing on who has what.
pub const VSAN_LINK_HANDSHAKING: u32 = 2;
/// `vsan_disk_status.link`: mirroring: every write is acknowledged by both nodes.
pub const VSAN_LINK_CONNECTED: u32 = 3;
/// `vsan_disk_status.link`: the peer was lost; writes complete on this node alone and
/// are copied to the peer when it returns.
pub const VSAN_LINK_DEGRADED: u32 = 4;

/// `vsan_disk_status.sync_kind`: no resync or verify has started.
pub const VSAN_SYNC_NONE: u32 = 0;
/// `sync_kind`: a resync of the chunks the bitmap marks.
pub const VSAN_SYNC_BITMAP: u32 = 1;
/// `sync_kind`: a full resync comparing checksums.
pub const VSAN_SYNC_CHECKSUM: u32 = 2;
/// `sync_kind`: an online verify.
pub const VSAN_SYNC_VERIFY: u32 = 3;

/// `vsan_disk_status.sync_role`: none.
pub const VSAN_ROLE_NONE: u32 = 0;
/// `sync_role`: this node sends the data.
pub const VSAN_ROLE_SOURCE: u32 = 1;
/// `sync_role`: this node receives the data.
pub const VSAN_ROLE_TARGET: u32 = 2;

/// Cache mode (`vsan_disk_status.cache_mode`, `vsan_disk_set_cache_mode`): the disk has
/// no cache (status only).
pub const VSAN_CACHE_NONE: u32 = 0;
/// Cache mode: writes are acknowledged once in the persistent log, destaged later.
pub const VSAN_CACHE_WRITE_BACK: u32 = 1;
/// Cache mode: writes go to the backing store first, and are kept for reads.
pub const VSAN_CACHE_WRITE_THROUGH: u32 = 2;
/// Cache mode: writes go to the backing store only; reads may still hit.
pub const VSAN_CACHE_WRITE_AROUND: u32 = 3;
/// Cache mode: the cache is bypassed (after destaging what it holds).
pub const VSAN_CACHE_PASS_THROUGH: u32 = 4;

/// `vsan_disk_status.cache_state`: no cache.
pub const VSAN_CACHE_STATE_NONE: u32 = 0;
/// `cache_state`: the cache device works.
pub const VSAN_CACHE_STATE_RUNNING: u32 = 1;
/// `cache_state`: the cache device failed; I/O goes to the backing store.
pub const VSAN_CACHE_STATE_FAILED: u32 = 2;
/// `cache_state`: the cache was closed.
pub const VSAN_CACHE_STATE_CLOSED: u32 = 3;

/// `vsan_disk_status.proof`: the replica is not proven current yet (nothing is served
/// from it; requests wait for the proof).
pub const VSAN_PROOF_NONE: u32 = 0;
/// `proof`: the handshake with the peer compared generations.
pub const VSAN_PROOF_HANDSHAKE: u32 = 1;
/// `proof`: the witness granted this node the disk.
pub const VSAN_PROOF_WITNESS: u32 = 2;
/// `proof`: an operator declared the replica current.
pub const VSAN_PROOF_OPERATOR: u32 = 3;
/// `proof`: its metadata says this node went on alone before it stopped.
pub const VSAN_PROOF_ONLY_WRITER: u32 = 4;
/// `proof`: the peer stayed away past the timeout and the startup policy is
/// serve-alone-after-timeout.
pub const VSAN_PROOF_STARTUP_TIMEOUT: u32 = 5;
/// `proof` of a disk that is not mirrored: it is its only copy.
pub const VSAN_PROOF_LOCAL: u32 = 6;

/// Length of `vsan_disk_status.transport`, NUL included.
pub const VSAN_TRANSPORT_LEN: usize = 32;

/// A snapshot of a disk's state (`vsan_disk_get_status`). Fields that do not apply
/// (mirror fields of a local disk, cache fields of a disk without cache) are 0, except
/// `quorum`, `sync_eta_s` and `last_sync_result`, which are -1 ("none").
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct vsan_disk_status {
    /// Size in bytes.
    pub size: u64,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Whether the disk is mirrored to a peer.
    pub mirrored: bool,
    /// Whether the disk has a write-back cache.
    pub cached: bool,
    /// The link to the peer: one of `VSAN_LINK_*`.
    pub link: u32,
    /// The peer's node id (0 when not mirrored).
    pub peer_id: u32,
    /// The transport carrying the link ("tcp", "quic", "shm", "tcp*4", ...), NUL-
    /// terminated; empty when there is no link.
    pub transport: [c_char; VSAN_TRANSPORT_LEN],
    /// The local replica failed; I/O is served through the peer.
    pub local_detached: bool,
    /// This replica has writes the peer lacks.
    pub diverged: bool,
    /// This replica is an unfinished sync target: it needs the peer to serve reads.
    pub inconsistent: bool,
    /// A resync or verify is running.
    pub syncing: bool,
    /// Requests are held until quorum or the peer returns.
    pub suspended: bool,
    /// With a witness: 1 when this node may serve without its peer, 0 when it may not;
    /// -1 without a witness.
    pub quorum: i32,
    /// Chunks this replica's bitmap marks out of sync with the peer.
    pub dirty_chunks: u64,
    /// This replica's current generation id.
    pub generation: u64,
    /// How many times the local replica lost acknowledged data (a failed cache device)
    /// and was resynced from the peer.
    pub local_data_lost: u64,
    /// The running (or last) resync or verify: one of `VSAN_SYNC_*`.
    pub sync_kind: u32,
    /// This node's role in it: one of `VSAN_ROLE_*`.
    pub sync_role: u32,
    /// Bytes the running pass goes through (0 when none runs).
    pub sync_total_bytes: u64,
    /// Bytes done so far.
    pub sync_done_bytes: u64,
    /// Bytes sent over the link so far.
    pub sync_transferred_bytes: u64,
    /// Current rate in bytes per second.
    pub sync_rate: u64,
    /// Seconds left, or -1 when unknown.
    pub sync_eta_s: i64,
    /// How the last pass ended: -1 none yet, 0 interrupted, 1 completed.
    pub last_sync_result: i32,
    /// Blocks the last verify found different (and repaired).
    pub last_sync_mismatches: u64,
    /// Cache mode: one of `VSAN_CACHE_*` (`VSAN_CACHE_NONE` without a cache).
    pub cache_mode: u32,
    /// Cache state: one of `VSAN_CACHE_STATE_*`.
    pub cache_state: u32,
    /// Blocks lost when the cache device failed.
    pub cache_lost_blocks: u64,
    /// Reads served from the cache.
    pub cache_read_hits: u64,
    /// Reads that went to the backing store.
    pub cache_read_misses: u64,
    /// Bytes in the cache not yet destaged.
    pub cache_dirty_bytes: u64,
    /// Size of the cache's log in bytes.
    pub cache_log_bytes: u64,
    /// Bytes destaged to the backing store so far.
    pub cache_destaged_bytes: u64,
    /// What proved the local replica current since the node started: one of
    /// `VSAN_PROOF_*`; `VSAN_PROOF_NONE` while it is unproven (nothing is served from
    /// it: requests wait, bounded by the peer timeout, and never get stale data).
    pub proof: u32,
    /// While unproven: since when, in milliseconds since the Unix epoch (0 otherwise).
    pub unproven_since_ms: u64,
}

/// Turn on the library's log (to stderr) when the environment variable `VSAN_LOG` is set
/// (a filter such as `info` or `vsan_replica=debug`). Once per process; a program that
/// installed its own `tracing` subscriber keeps it.
fn init_log() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(filter) = std::env::var("VSAN_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                .try_init();
        }
    });
}

/// A NUL-terminated UTF-8 argument.
fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err((super::VSAN_ERR_NULL_POINTER, format!("{what} is NULL")));
    }
    // SAFETY: the caller passes a NUL-terminated string (documented), not NULL (checked).
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|e| {
        (
            VSAN_ERR_INVALID_ARGUMENT,
            format!("{what} is not UTF-8: {e}"),
        )
    })
}

fn open_node(config: Config, out: *mut *mut vsan_node) -> Result<(), Failure> {
    init_log();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads())
        .thread_name("vsan-rt")
        .enable_all()
        .build()
        .map_err(|e| (VSAN_ERR_IO, format!("cannot start the runtime: {e}")))?;
    let node = runtime
        .block_on(Node::start(&config, StartOptions::default()))
        .map_err(|e| match e {
            StartError::Config(m) => (VSAN_ERR_INVALID_ARGUMENT, format!("config: {m}")),
            StartError::AddressInUse(m) => (super::VSAN_ERR_IN_USE, format!("config: {m}")),
            StartError::Runtime(m) => (VSAN_ERR_IO, m),
        });
    let node = match node {
        Ok(n) => n,
        Err(e) => {
            runtime.shutdown_timeout(Duration::from_secs(5));
            return Err(e);
        }
    };
    let h = handles::register_node(Arc::new(NodeObj::new(runtime, node)));
    // SAFETY: `out` was checked (not NULL, aligned) before anything was opened.
    unsafe { out.write(h) };
    Ok(())
}

/// Open a node from a configuration given as a NUL-terminated TOML string (the
/// `vsan-node` config format: `[node]`, `[[peer]]`, `[[disk]]`, see the README).
///
/// Creates or opens every disk's image, cache and metadata, starts mirroring (dialing or
/// waiting for the peers), serves over NBD the disks that have an `nbd` address and as
/// iSCSI targets those with an `iscsi` portal (with their CHAP settings).
/// The node runs on a runtime of its own (`node.threads` worker threads, default: one per
/// core), which also runs completion callbacks.
///
/// On success writes the new handle to `*out`; close it with `vsan_node_free`. On failure
/// nothing is left open or running, and `vsan_last_error_message` names the key and the
/// problem (`VSAN_ERR_INVALID_ARGUMENT` for a bad config, `VSAN_ERR_IN_USE` when an
/// address it names is taken, `VSAN_ERR_IO` when an image, metadata or cache file cannot
/// be opened or is refused).
///
/// Thread-safe. Blocking: must not be called from a completion callback
/// (`VSAN_ERR_WRONG_THREAD`). `toml` is only read during the call.
///
/// # Safety
/// `toml` must be a NUL-terminated string (or NULL); `out` valid for one write (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_node_new_from_toml(
    toml: *const c_char,
    out: *mut *mut vsan_node,
) -> super::vsan_result {
    call("vsan_node_new_from_toml", || {
        out_ptr(out, "out")?;
        not_in_callback()?;
        let text = c_str(toml, "toml")?;
        let config =
            Config::parse(text).map_err(|e| (VSAN_ERR_INVALID_ARGUMENT, format!("config: {e}")))?;
        open_node(config, out)
    })
}

/// Open a node from a configuration file (TOML), as `vsan_node_new_from_toml` does.
/// `VSAN_ERR_NOT_FOUND` when the file does not exist.
///
/// Thread-safe; blocking (not from a completion callback). `path` is only read during
/// the call.
///
/// # Safety
/// `path` must be a NUL-terminated string (or NULL); `out` valid for one write (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_node_new_from_file(
    path: *const c_char,
    out: *mut *mut vsan_node,
) -> super::vsan_result {
    call("vsan_node_new_from_file", || {
        out_ptr(out, "out")?;
        not_in_callback()?;
        let path = c_str(path, "path")?;
        let p = std::path::Path::new(path);
        if !p.exists() {
            return Err((
                VSAN_ERR_NOT_FOUND,
                format!("config file {path} does not exist"),
            ));
        }
        let config = Config::load(p)
            .map_err(|e| (VSAN_ERR_INVALID_ARGUMENT, format!("config {path}: {e}")))?;
        open_node(config, out)
    })
}

/// Close a node: refuse new calls on it and its disks, wait for calls and asynchronous
/// I/Os in flight to finish (up to 30 s; I/Os still running then are cancelled and
/// their callbacks get `VSAN_ERR_CLOSED`), stop NBD and iSCSI service, flush every disk,
/// close the mirrors (metadata marked clean) and caches (everything destaged), and stop
/// the node's threads.
///
/// The handle and the handles of the node's disks are invalid afterwards, whatever the
/// result: using or closing them again gets `VSAN_ERR_BAD_HANDLE`. Returns an error
/// (`VSAN_ERR_IO`) when a final flush or cache close failed: the data may then not be
/// durable.
///
/// Thread-safe. Blocking: must not be called from a completion callback
/// (`VSAN_ERR_WRONG_THREAD`, and nothing is closed).
///
/// # Safety
/// `node` must be a handle from `vsan_node_new_*` (any other value is refused, but is
/// read as a number).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_node_free(node: *mut vsan_node) -> super::vsan_result {
    call("vsan_node_free", || {
        handles::node(node)?;
        not_in_callback()?;
        let n = handles::unregister_node(node)?;
        let left = n.close_and_wait(DRAIN_TIMEOUT);
        if left > 0 {
            warn!("closing the node with {left} calls or I/Os still in flight: cancelling them");
        }
        let inner = n.node.lock().take();
        let runtime = n.runtime.lock().take();
        let result = match (runtime, inner) {
            (Some(rt), Some(inner)) => {
                let r = rt.block_on(inner.shutdown());
                rt.shutdown_timeout(Duration::from_secs(10));
                r
            }
            _ => Ok(()),
        };
        result.map_err(|e| (VSAN_ERR_IO, e.context().to_string()))
    })
}

/// The address the node listens on for its peers (`node.listen` of its config, with the
/// actual port when the config said port 0: "127.0.0.1:40123", or a socket path), copied
/// NUL-terminated into `buf` (`len` bytes); its length without the NUL goes to
/// `*out_len` when `out_len` is not NULL. `VSAN_ERR_BUFFER_TOO_SMALL` when it does not
/// fit (nothing written to `buf`, `*out_len` says how long it is); `VSAN_ERR_NOT_FOUND`
/// when the node does not listen.
///
/// Thread-safe; does not block.
///
/// # Safety
/// `node` must be a handle (checked); `buf` valid for writes of `len` bytes (or NULL
/// with `len` 0); `out_len` valid for one write or NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_node_replication_address(
    node: *mut vsan_node,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> super::vsan_result {
    call("vsan_node_replication_address", || {
        let n = handles::node(node)?;
        let _in = n.enter()?;
        let addr = n
            .node
            .lock()
            .as_ref()
            .and_then(|inner| inner.replication_address().map(str::to_string))
            .ok_or_else(|| {
                (
                    VSAN_ERR_NOT_FOUND,
                    "the node does not listen for peers".into(),
                )
            })?;
        // SAFETY: the caller's contract is `copy_string`'s.
        match unsafe { super::copy_string(&addr, buf, len, out_len) } {
            super::VSAN_OK => Ok(()),
            super::VSAN_ERR_BUFFER_TOO_SMALL => Err((
                super::VSAN_ERR_BUFFER_TOO_SMALL,
                format!("the address needs {} bytes with its NUL", addr.len() + 1),
            )),
            code => Err((code, "bad buffer arguments".into())),
        }
    })
}

/// Open the node's disk called `name` (NUL-terminated). On success writes a new handle to
/// `*out`; close it with `vsan_disk_free`. A disk may be opened more than once; each
/// handle is closed on its own. `VSAN_ERR_NOT_FOUND` when the node has no such disk.
///
/// Thread-safe; does not block (may be called from a callback).
///
/// # Safety
/// `node` must be a handle (checked); `name` a NUL-terminated string (or NULL); `out`
/// valid for one write (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_open(
    node: *mut vsan_node,
    name: *const c_char,
    out: *mut *mut vsan_disk,
) -> super::vsan_result {
    call("vsan_disk_open", || {
        out_ptr(out, "out")?;
        let n = handles::node(node)?;
        let _in = n.enter()?;
        let name = c_str(name, "name")?;
        let disk = n
            .node
            .lock()
            .as_ref()
            .and_then(|inner| inner.disk(name))
            .ok_or_else(|| (VSAN_ERR_NOT_FOUND, format!("the node has no disk {name:?}")))?;
        let geometry = disk.device.geometry();
        let h = handles::register_disk(Arc::new(DiskObj {
            node: Arc::clone(&n),
            disk,
            geometry,
        }))?;
        // SAFETY: checked by `out_ptr`.
        unsafe { out.write(h) };
        Ok(())
    })
}

/// Close a disk handle. Asynchronous I/Os already submitted on it still complete and
/// call back; no new call on this handle is accepted (`VSAN_ERR_BAD_HANDLE`, also for a
/// second close). The disk itself stays open in its node until `vsan_node_free`.
///
/// Thread-safe; does not block (may be called from a callback).
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_free(disk: *mut vsan_disk) -> super::vsan_result {
    call("vsan_disk_free", || {
        handles::unregister_disk(disk).map(drop)
    })
}

/// The disk's size and block sizes, written to `*out`.
///
/// Thread-safe; does not block.
///
/// # Safety
/// `disk` must be a handle (checked); `out` valid for one write (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_geometry(
    disk: *mut vsan_disk,
    out: *mut vsan_geometry,
) -> super::vsan_result {
    call("vsan_disk_geometry", || {
        out_ptr(out, "out")?;
        let d = handles::disk(disk)?;
        let g = d.geometry;
        // SAFETY: checked by `out_ptr`.
        unsafe {
            out.write(vsan_geometry {
                size: g.size(),
                block_size: g.block_size(),
                max_io: g.max_io(),
            })
        };
        Ok(())
    })
}

/// The `VSAN_LINK_*` code of a mirror's link state: the one numbering of link states,
/// which the metrics endpoint's `vsan_mirror_link_state` gauge uses too.
pub(crate) fn link_code(s: LinkState) -> u32 {
    match s {
        LinkState::Waiting => VSAN_LINK_WAITING,
        LinkState::Handshaking => VSAN_LINK_HANDSHAKING,
        LinkState::Connected => VSAN_LINK_CONNECTED,
        LinkState::Degraded => VSAN_LINK_DEGRADED,
    }
}

fn sync_kind_code(k: SyncKind) -> u32 {
    match k {
        SyncKind::Bitmap => VSAN_SYNC_BITMAP,
        SyncKind::Checksum => VSAN_SYNC_CHECKSUM,
        SyncKind::Verify => VSAN_SYNC_VERIFY,
    }
}

fn role_code(r: SyncRole) -> u32 {
    match r {
        SyncRole::Source => VSAN_ROLE_SOURCE,
        SyncRole::Target => VSAN_ROLE_TARGET,
    }
}

fn cache_mode_code(m: CacheMode) -> u32 {
    match m {
        CacheMode::WriteBack => VSAN_CACHE_WRITE_BACK,
        CacheMode::WriteThrough => VSAN_CACHE_WRITE_THROUGH,
        CacheMode::WriteAround => VSAN_CACHE_WRITE_AROUND,
        CacheMode::PassThrough => VSAN_CACHE_PASS_THROUGH,
    }
}

/// Build a status snapshot of `d`.
pub(crate) fn status_of(d: &DiskObj) -> vsan_disk_status {
    let g = d.geometry;
    let mut s = vsan_disk_status {
        size: g.size(),
        block_size: g.block_size(),
        mirrored: d.disk.mirror.is_some(),
        cached: d.disk.cache.is_some(),
        link: VSAN_LINK_LOCAL,
        peer_id: 0,
        transport: [0; VSAN_TRANSPORT_LEN],
        local_detached: false,
        diverged: false,
        inconsistent: false,
        syncing: false,
        suspended: false,
        quorum: -1,
        dirty_chunks: 0,
        generation: 0,
        local_data_lost: 0,
        sync_kind: VSAN_SYNC_NONE,
        sync_role: VSAN_ROLE_NONE,
        sync_total_bytes: 0,
        sync_done_bytes: 0,
        sync_transferred_bytes: 0,
        sync_rate: 0,
        sync_eta_s: -1,
        last_sync_result: -1,
        last_sync_mismatches: 0,
        cache_mode: VSAN_CACHE_NONE,
        cache_state: VSAN_CACHE_STATE_NONE,
        cache_lost_blocks: 0,
        cache_read_hits: 0,
        cache_read_misses: 0,
        cache_dirty_bytes: 0,
        cache_log_bytes: 0,
        cache_destaged_bytes: 0,
        proof: VSAN_PROOF_LOCAL,
        unproven_since_ms: 0,
    };
    if let Some(m) = &d.disk.mirror {
        let st = m.status();
        s.link = link_code(st.link);
        s.peer_id = d.disk.peer_id.unwrap_or(0);
        if st.link_attached
            && let Some(t) = &st.link_transport
        {
            for (dst, &b) in s
                .transport
                .iter_mut()
                .zip(t.as_bytes().iter().take(VSAN_TRANSPORT_LEN - 1))
            {
                *dst = b as c_char;
            }
        }
        s.local_detached = st.local_detached;
        s.diverged = st.diverged;
        s.inconsistent = st.inconsistent;
        s.syncing = st.syncing;
        s.suspended = st.suspended;
        s.quorum = st.quorum.map_or(-1, i32::from);
        s.dirty_chunks = st.dirty_chunks;
        s.generation = st.generations.current;
        s.local_data_lost = st.local_data_lost;
        s.proof = match st.freshness {
            Freshness::Unproven { .. } => VSAN_PROOF_NONE,
            Freshness::Current(Proof::Handshake) => VSAN_PROOF_HANDSHAKE,
            Freshness::Current(Proof::Witness) => VSAN_PROOF_WITNESS,
            Freshness::Current(Proof::Operator) => VSAN_PROOF_OPERATOR,
            Freshness::Current(Proof::OnlyWriter) => VSAN_PROOF_ONLY_WRITER,
            Freshness::Current(Proof::StartupTimeout) => VSAN_PROOF_STARTUP_TIMEOUT,
        };
        s.unproven_since_ms = st.unproven_since_unix_ms();
        if let Some(start) = st.last_sync_start {
            s.sync_kind = sync_kind_code(start.kind);
            s.sync_role = role_code(start.role);
        }
        if let Some(p) = m.sync_progress() {
            s.sync_kind = sync_kind_code(p.kind);
            s.sync_role = role_code(p.role);
            s.sync_total_bytes = p.total_bytes;
            s.sync_done_bytes = p.done_bytes;
            s.sync_transferred_bytes = p.transferred_bytes;
            s.sync_rate = p.rate;
            s.sync_eta_s = p.eta.map_or(-1, |e| e.as_secs() as i64);
        }
        if let Some(last) = st.last_sync {
            s.last_sync_result = i32::from(last.completed);
            s.last_sync_mismatches = last.mismatches;
        }
    }
    if let Some(c) = &d.disk.cache {
        let cs = c.stats();
        s.cache_mode = cache_mode_code(cs.mode);
        (s.cache_state, s.cache_lost_blocks) = match cs.state {
            CacheState::Running => (VSAN_CACHE_STATE_RUNNING, 0),
            CacheState::Failed { lost_blocks } => (VSAN_CACHE_STATE_FAILED, lost_blocks),
            CacheState::Closed => (VSAN_CACHE_STATE_CLOSED, 0),
        };
        s.cache_read_hits = cs.read_hits;
        s.cache_read_misses = cs.read_misses;
        s.cache_dirty_bytes = cs.dirty_bytes;
        s.cache_log_bytes = cs.log_bytes;
        s.cache_destaged_bytes = cs.destaged_bytes;
    }
    s
}

/// A snapshot of the disk's state (link, resync progress, cache counters), written to
/// `*out`.
///
/// Thread-safe; does not block (may be called from a callback).
///
/// # Safety
/// `disk` must be a handle (checked); `out` valid for one write (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_get_status(
    disk: *mut vsan_disk,
    out: *mut vsan_disk_status,
) -> super::vsan_result {
    call("vsan_disk_get_status", || {
        out_ptr(out, "out")?;
        let d = handles::disk(disk)?;
        let s = status_of(&d);
        // SAFETY: checked by `out_ptr`.
        unsafe { out.write(s) };
        Ok(())
    })
}

fn mirror_of(d: &DiskObj) -> Result<&vsan_replica::MirroredDisk, Failure> {
    d.disk.mirror.as_ref().ok_or_else(|| {
        (
            VSAN_ERR_NOT_SUPPORTED,
            format!("disk {} is not mirrored", d.disk.name),
        )
    })
}

/// Wait until a mirrored disk is connected to its peer and no resync is running (both
/// replicas hold the same data and every write goes to both), for up to `timeout_ms`
/// milliseconds. `VSAN_ERR_TIMEOUT` when that does not happen in time;
/// `VSAN_ERR_NOT_SUPPORTED` for a disk without a peer.
///
/// Thread-safe. Blocking: not from a completion callback (`VSAN_ERR_WRONG_THREAD`).
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_wait_synced(
    disk: *mut vsan_disk,
    timeout_ms: u32,
) -> super::vsan_result {
    call("vsan_disk_wait_synced", || {
        let d = handles::disk(disk)?;
        not_in_callback()?;
        let m = mirror_of(&d)?.clone();
        let _in = d.node.enter()?;
        let mut watch = m.watch_status();
        let ready = d.node.handle.block_on(async {
            tokio::time::timeout(Duration::from_millis(timeout_ms.into()), async {
                loop {
                    {
                        let s = watch.borrow_and_update();
                        if s.link == LinkState::Connected && !s.syncing && !s.inconsistent {
                            return true;
                        }
                    }
                    if watch.changed().await.is_err() {
                        return false;
                    }
                }
            })
            .await
        });
        match ready {
            Ok(true) => Ok(()),
            Ok(false) => Err((
                super::VSAN_ERR_CLOSED,
                format!("disk {}: the mirror stopped", d.disk.name),
            )),
            Err(_) => {
                let s = m.status();
                Err((
                    VSAN_ERR_TIMEOUT,
                    format!(
                        "disk {}: not connected and in sync after {timeout_ms} ms (link {:?}, \
                         syncing {}, last problem: {})",
                        d.disk.name,
                        s.link,
                        s.syncing,
                        s.last_problem.as_deref().unwrap_or("none")
                    ),
                ))
            }
        }
    })
}

/// Start an online verify of a mirrored disk from this node: the two replicas are
/// compared by checksum and blocks that differ are repaired from this node. The disk
/// must be connected and in sync. Returns once the verify has started; watch
/// `vsan_disk_get_status` (`syncing`, `last_sync_result`, `last_sync_mismatches`).
/// `VSAN_ERR_NOT_SUPPORTED` for a disk without a peer, `VSAN_ERR_INVALID_ARGUMENT` when
/// it cannot start now (the message says why).
///
/// Thread-safe. Blocking (briefly): not from a completion callback.
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_verify(disk: *mut vsan_disk) -> super::vsan_result {
    call("vsan_disk_verify", || {
        let d = handles::disk(disk)?;
        not_in_callback()?;
        let m = mirror_of(&d)?.clone();
        let _in = d.node.enter()?;
        d.node.handle.block_on(m.verify()).map_err(core_failure)
    })
}

/// Resolve a split brain on a mirrored disk by discarding this node's changes: the link
/// is dropped and, on the next connection, this replica becomes the sync target and
/// takes the peer's data. `VSAN_ERR_NOT_SUPPORTED` for a disk without a peer.
///
/// Thread-safe; does not block.
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_discard_my_data(disk: *mut vsan_disk) -> super::vsan_result {
    call("vsan_disk_discard_my_data", || {
        let d = handles::disk(disk)?;
        let _in = d.node.enter()?;
        mirror_of(&d)?.discard_my_data();
        Ok(())
    })
}

/// Declare this node's unproven replica current (an operator's decision): it serves
/// alone, degraded, until the peer connects; logged as a risk. Only for a node whose
/// peer is known to be behind: writes the peer acknowledged alone are not here, and the
/// replicas split. `VSAN_ERR_NOT_SUPPORTED` for a disk without a peer,
/// `VSAN_ERR_INVALID_ARGUMENT` (with the reason in `vsan_last_error_message`) when the
/// replica is proven already, is an unfinished sync target, or a handshake is deciding.
///
/// Thread-safe. Blocking: not from a completion callback.
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_declare_current(disk: *mut vsan_disk) -> super::vsan_result {
    call("vsan_disk_declare_current", || {
        let d = handles::disk(disk)?;
        not_in_callback()?;
        let mirror = mirror_of(&d)?.clone();
        let _in = d.node.enter()?;
        d.node
            .handle
            .block_on(mirror.declare_current())
            .map(|_| ())
            .map_err(core_failure)
    })
}

/// Switch a cached disk's cache mode (`VSAN_CACHE_WRITE_BACK`, `_WRITE_THROUGH`,
/// `_WRITE_AROUND`, `_PASS_THROUGH`); leaving write-back destages what the cache holds
/// first. `VSAN_ERR_NOT_SUPPORTED` for a disk without a cache,
/// `VSAN_ERR_INVALID_ARGUMENT` for another value.
///
/// Thread-safe. Blocking: not from a completion callback.
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_set_cache_mode(
    disk: *mut vsan_disk,
    mode: u32,
) -> super::vsan_result {
    call("vsan_disk_set_cache_mode", || {
        let d = handles::disk(disk)?;
        not_in_callback()?;
        let cache = d.disk.cache.clone().ok_or_else(|| {
            (
                VSAN_ERR_NOT_SUPPORTED,
                format!("disk {} has no cache", d.disk.name),
            )
        })?;
        let mode = match mode {
            VSAN_CACHE_WRITE_BACK => CacheMode::WriteBack,
            VSAN_CACHE_WRITE_THROUGH => CacheMode::WriteThrough,
            VSAN_CACHE_WRITE_AROUND => CacheMode::WriteAround,
            VSAN_CACHE_PASS_THROUGH => CacheMode::PassThrough,
            other => {
                return Err((
                    VSAN_ERR_INVALID_ARGUMENT,
                    format!("{other} is not a cache mode (VSAN_CACHE_WRITE_BACK..PASS_THROUGH)"),
                ));
            }
        };
        let _in = d.node.enter()?;
        d.node
            .handle
            .block_on(cache.set_mode(mode))
            .map_err(core_failure)
    })
}
