//! The `vsan-node` configuration file (TOML), as DESIGN.md "Node configuration" gives it.
//!
//! iSCSI keys (a disk's `iscsi` portal, `iscsi_target`, CHAP per disk or node) are
//! checked in `iscsi.rs`.
//!
//! Parsing is strict: an unknown key, a size that does not parse or does not fit the
//! block size, a duplicate disk name, or a reference to a peer that is not declared is an
//! error naming the key (`disk[0].size`) and the problem, so the operator gets one clear
//! line instead of a node that half-starts.

mod iscsi;
mod values;

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use vsan_cache::{CacheConfig, CacheMode};

pub use iscsi::DEFAULT_TARGET_PREFIX;
pub use values::{
    NbdAddr, Quorum, Rate, Secret, Size, SplitBrain, Startup, TransportKind, cache_mode_word,
    check_iscsi_name,
};

/// A configuration error: which key, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key, as a path (`disk[0].size`); empty when the error is not about one key.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "key `{}`: {}", self.key, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}

/// `[node]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// This node's id.
    pub id: u32,
    /// Where images and metadata live.
    pub data_dir: PathBuf,
    /// Replication listener. The node with the higher id of a pair accepts links here;
    /// the lower id dials its peer's address. `host:port`, or for peers with transport
    /// "loopback" the absolute path of a Unix socket.
    pub listen: Option<String>,
    /// Worker threads of the node's async runtime (default: one per disk the node
    /// starts with, at most one per core it may run on; see [`Config::worker_threads`]).
    pub threads: Option<usize>,
    /// How long a silent peer is waited for before writes go on without it (ms).
    #[serde(default = "default_peer_timeout_ms")]
    pub peer_timeout_ms: u64,
    /// gRPC management address (`vsan.mgmt.v1`; `host:port`, port 0 for any free one).
    /// Loopback unless TLS and a token are set: a node that serves it elsewhere without
    /// them logs a warning. No management service when not given.
    pub mgmt: Option<String>,
    /// Bearer token every management request must carry (`authorization: Bearer ..`).
    pub mgmt_token: Option<String>,
    /// File holding the bearer token (its first line), instead of `mgmt_token`.
    pub mgmt_token_file: Option<PathBuf>,
    /// TLS for the management service: certificate chain (PEM).
    pub mgmt_cert: Option<PathBuf>,
    /// TLS for the management service: private key (PEM).
    pub mgmt_key: Option<PathBuf>,
    /// Metrics address (`host:port`, port 0 for any free one): per-disk I/O counters and
    /// latency, mirror link and resync state, cache dirty bytes, served in the
    /// Prometheus text format at `GET /metrics`. No metrics endpoint when not given.
    pub metrics: Option<String>,
    /// Quorum witness address ("host:port", a `vsan-witness`). With it, a node that
    /// loses its peer serves a mirrored disk only while the witness grants it the disk.
    pub witness: Option<String>,
    /// What a node without its peer and without quorum does with I/O: "io-error" (the
    /// default: fail it) or "suspend" (hold it until the peer or quorum returns). Only
    /// with `witness`.
    pub quorum: Option<Quorum>,
    /// What a restarted node does when its peer does not connect within
    /// `peer_timeout_ms` and no witness is configured: "wait-for-peer" (the default:
    /// serve nothing from the replica, which may be stale, until the peer's handshake or
    /// an operator's declare-current) or "serve-alone-after-timeout" (take the replica
    /// as current and serve alone, logged as a risk). A node whose metadata says it went
    /// on alone before it stopped serves at once either way.
    #[serde(default)]
    pub startup: Startup,
    /// iSCSI CHAP for every disk's target that does not set its own: the name an
    /// initiator logs in with (CHAP_N). See [`DiskSection::iscsi_chap_user`].
    pub iscsi_chap_user: Option<String>,
    /// The initiator's CHAP secret (12 to 255 bytes), for every disk's target.
    pub iscsi_chap_secret: Option<Secret>,
    /// The initiator's CHAP secret read from this file (a trailing newline ignored),
    /// instead of `iscsi_chap_secret`.
    pub iscsi_chap_secret_file: Option<PathBuf>,
    /// Mutual CHAP for every disk's target: the name the target answers with.
    pub iscsi_chap_target_user: Option<String>,
    /// Mutual CHAP: the target's secret (12 to 255 bytes, not the initiator's).
    pub iscsi_chap_target_secret: Option<Secret>,
    /// Mutual CHAP: the target's secret read from this file.
    pub iscsi_chap_target_secret_file: Option<PathBuf>,
}

/// `[[peer]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerSection {
    /// The peer's node id.
    pub id: u32,
    /// The peer's replication address: `host:port` for tcp, quic and rdma; for
    /// loopback a Unix socket path (peers on this host, over shared memory).
    pub address: String,
    /// tcp | loopback | quic | rdma.
    #[serde(default)]
    pub transport: TransportKind,
    /// Links per peer (1 to 64, default 1); frames go on the least busy one, in order.
    /// Only the dialing node's setting counts: a listener takes any number.
    pub lanes: Option<u32>,
    /// tcp (and rdma's fall-back to tcp): a shared secret both nodes prove they know.
    pub secret: Option<String>,
    /// tcp: the shared secret read from this file (trailing newline ignored).
    pub secret_file: Option<PathBuf>,
    /// quic: this node's certificate (PEM); made, self-signed, at first start when it
    /// and `key` do not exist (default `data_dir/node-<id>.crt`).
    pub cert: Option<PathBuf>,
    /// quic: this node's private key (PEM; default `data_dir/node-<id>.key`).
    pub key: Option<PathBuf>,
    /// quic: the peer certificate's pinned SHA-256 fingerprint ("sha256:<64 hex>");
    /// a peer presenting any other certificate is refused.
    pub peer_fingerprint: Option<String>,
    /// quic: instead of a fingerprint, a CA certificate (PEM) the peer's must chain to.
    pub peer_ca: Option<PathBuf>,
    /// loopback: spin this many microseconds for the next message before sleeping
    /// (busy-poll: a core for lower latency). Default 0.
    pub busy_poll_us: Option<u64>,
}

fn default_peer_timeout_ms() -> u64 {
    5000
}

/// Where a disk's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backing {
    /// A file (`data_dir/<name>.img` unless `path` says otherwise) or a block device.
    #[default]
    File,
    /// RAM; gone when the node stops.
    Mem,
}

/// `[disk.cache]`: a persistent write-back cache (vsan-cache) on a fast device in front
/// of the disk's backing store.
///
/// A cached disk is served in 4096-byte blocks, the cache's unit: its `block_size` is
/// 4096 unless given (and any other value is refused). A mirrored disk with a cache is
/// mirrored in 4096-byte blocks too, so its peer needs `block_size = 4096` (or a cache).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// The fast device or file (on persistent memory / DAX, an NVMe SSD, ...). A missing
    /// file is created with `size` and formatted; an existing one that was never written
    /// (all zeros) is formatted; a formatted one is opened and its log recovered.
    pub path: PathBuf,
    /// Its size: required when the file does not exist; for an existing file it must be
    /// the file's size, or be left out.
    pub size: Option<Size>,
    /// write-back (the default) | write-through | write-around | pass-through.
    #[serde(default, deserialize_with = "values::cache_mode")]
    pub mode: Option<CacheMode>,
    /// Sequential cutoff: a run of sequential writes this long (or one write this large)
    /// goes straight to the backing store. "0" turns it off; default 4 MiB.
    pub sequential_cutoff: Option<Size>,
    /// Percent of the log in use at which destaging runs at full speed (default 60).
    pub high_watermark: Option<i64>,
    /// Percent of the log destaging brings it down to once it went above the high
    /// watermark (default 30).
    pub low_watermark: Option<i64>,
}

/// The cache's unit: a cached disk has blocks of this size.
pub const CACHE_BLOCK_SIZE: u32 = vsan_cache::format::CACHE_BLOCK;

/// The smallest cache device: both superblocks and the smallest log.
pub const MIN_CACHE_SIZE: u64 = vsan_cache::format::LOG_START + vsan_cache::format::MIN_LOG_LEN;

impl CacheSection {
    /// The mode (`mode`; write-back when not given).
    pub fn cache_mode(&self) -> CacheMode {
        self.mode.unwrap_or(CacheMode::WriteBack)
    }

    /// The cache's settings from this section, with the defaults of
    /// [`CacheConfig::default`] for keys not given. On error: the key inside
    /// `[disk.cache]` that is wrong, and why. `data_loss` is left at its default: it
    /// depends on whether the disk is mirrored, which the caller knows.
    pub fn settings(&self) -> Result<CacheConfig, (&'static str, String)> {
        let mut cfg = CacheConfig {
            mode: Some(self.cache_mode()),
            ..CacheConfig::default()
        };
        if let Some(Size(n)) = self.sequential_cutoff {
            if n != 0 && n < u64::from(CACHE_BLOCK_SIZE) {
                return Err((
                    "sequential_cutoff",
                    format!("{n} bytes is neither 0 (off) nor at least {CACHE_BLOCK_SIZE}"),
                ));
            }
            cfg.sequential_cutoff = n;
        }
        let percent = |key: &'static str, v: i64| {
            u8::try_from(v)
                .ok()
                .filter(|p| (1..=100).contains(p))
                .ok_or_else(|| (key, format!("{v} is not a percentage from 1 to 100")))
        };
        if let Some(v) = self.high_watermark {
            cfg.high_watermark = percent("high_watermark", v)?;
        }
        if let Some(v) = self.low_watermark {
            cfg.low_watermark = percent("low_watermark", v)?;
        }
        if cfg.low_watermark >= cfg.high_watermark {
            return Err((
                "low_watermark",
                format!(
                    "{}% is not below high_watermark ({}%)",
                    cfg.low_watermark, cfg.high_watermark
                ),
            ));
        }
        cfg.check().map_err(|e| ("", e.context().to_string()))?;
        Ok(cfg)
    }
}

/// `[[disk]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSection {
    /// Disk name; also its NBD export name.
    pub name: String,
    /// Size of the disk.
    pub size: Size,
    /// file | mem.
    #[serde(default)]
    pub backing: Backing,
    /// Image path for `backing = "file"`; default `data_dir/<name>.img`.
    pub path: Option<PathBuf>,
    /// Logical block size (512 by default, 4096 with a cache); read it through
    /// [`DiskSection::block_size`].
    #[serde(rename = "block_size")]
    pub block_size_given: Option<u32>,
    /// Open the image with O_DIRECT.
    #[serde(default)]
    pub direct: bool,
    /// Mirror partner's node id.
    pub peer: Option<u32>,
    /// NBD address: "host:port" or "unix:/path".
    pub nbd: Option<String>,
    /// iSCSI portal ("host:port", port 0 for any free one): the disk is LUN 0 of a
    /// target there. Disks sharing a portal are targets of one server.
    pub iscsi: Option<String>,
    /// The target's iSCSI name (default `iqn.2026-12.io.vsan:<disk name>`, lower-cased,
    /// `_` as `-`); read it through [`DiskSection::iscsi_target_name`].
    pub iscsi_target: Option<String>,
    /// CHAP for this disk's target: the name an initiator must log in with. With
    /// `iscsi_chap_secret` or `iscsi_chap_secret_file` (exactly one), an initiator must
    /// prove it knows the secret. Any of these keys on the disk replaces the node's
    /// (`node.iscsi_chap_*`) for this disk; without them the node's apply.
    pub iscsi_chap_user: Option<String>,
    /// The initiator's CHAP secret (12 to 255 bytes).
    pub iscsi_chap_secret: Option<Secret>,
    /// The initiator's CHAP secret read from this file (a trailing newline ignored).
    pub iscsi_chap_secret_file: Option<PathBuf>,
    /// Mutual CHAP (needs the initiator's pair too): the name this target answers an
    /// initiator that asks it to prove itself.
    pub iscsi_chap_target_user: Option<String>,
    /// Mutual CHAP: the target's secret (12 to 255 bytes, not the initiator's).
    pub iscsi_chap_target_secret: Option<Secret>,
    /// Mutual CHAP: the target's secret read from this file.
    pub iscsi_chap_target_secret_file: Option<PathBuf>,
    /// vhost-user-blk socket path (Linux): a VM on this host (QEMU's
    /// `vhost-user-blk-pci`, cloud-hypervisor, libblkio) reaches the disk through shared
    /// memory there. See `vsan_core::export::vhost_user`.
    pub vhost_user: Option<PathBuf>,
    /// Queues the vhost-user-blk export offers (1 to 64, default 1), each served by its
    /// own thread.
    pub vhost_user_queues: Option<u16>,
    /// How long (microseconds, up to 1,000,000) each vhost-user queue keeps polling
    /// after its last request before it sleeps: lower latency for CPU. Default 0 (never
    /// polls).
    pub vhost_user_busy_poll_us: Option<u64>,
    /// Optional write-back cache.
    pub cache: Option<CacheSection>,
    /// Bytes per bit of the resync bitmap (a power of two, at least 4 KiB; default
    /// 64 KiB). Fixed when the disk's metadata is created.
    pub bitmap_chunk: Option<Size>,
    /// Resync speed: "dynamic" (the default: full speed while the application is idle,
    /// one chunk at a time while it has I/O in flight) or a fixed rate per second
    /// ("40MiB").
    pub resync_rate: Option<Rate>,
    /// Split-brain policy, the same on both nodes: "refuse" (the default),
    /// "discard-zero-changes", "discard-least-changes" or "discard-node(ID)".
    pub split_brain: Option<SplitBrain>,
}

impl DiskSection {
    /// This disk's own vhost-user keys (what needs no other disk to check): the queue
    /// and busy-poll keys only with a socket, and in range. `Err((key, why))`.
    pub(crate) fn check_vhost_user(&self) -> Result<(), (&'static str, String)> {
        let Some(path) = &self.vhost_user else {
            for (k, given) in [
                ("vhost_user_queues", self.vhost_user_queues.is_some()),
                (
                    "vhost_user_busy_poll_us",
                    self.vhost_user_busy_poll_us.is_some(),
                ),
            ] {
                if given {
                    return Err((
                        k,
                        "only with `vhost_user` (the disk's socket path); the disk has none".into(),
                    ));
                }
            }
            return Ok(());
        };
        if cfg!(not(target_os = "linux")) {
            return Err(("vhost_user", "vhost-user needs Linux".into()));
        }
        if path.as_os_str().is_empty() {
            return Err(("vhost_user", "is empty".into()));
        }
        if let Some(q) = self.vhost_user_queues
            && !(1..=64).contains(&q)
        {
            return Err(("vhost_user_queues", format!("{q} is not 1 to 64")));
        }
        if let Some(us) = self.vhost_user_busy_poll_us
            && us > 1_000_000
        {
            return Err((
                "vhost_user_busy_poll_us",
                format!("{us} is over 1000000 (one second)"),
            ));
        }
        Ok(())
    }

    /// The resync rate (`resync_rate`; dynamic when not given).
    pub fn rate(&self) -> Rate {
        self.resync_rate.unwrap_or(Rate::Dynamic)
    }

    /// The split-brain policy (`split_brain`; refuse when not given).
    pub fn split_brain_policy(&self) -> SplitBrain {
        self.split_brain.unwrap_or(SplitBrain::Refuse)
    }
}

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[node]`.
    pub node: NodeSection,
    /// `[[peer]]`.
    #[serde(default)]
    pub peer: Vec<PeerSection>,
    /// `[[disk]]`.
    #[serde(default)]
    pub disk: Vec<DiskSection>,
}

impl DiskSection {
    /// The disk's logical block size: `block_size` when given, else 4096 for a disk with
    /// a cache (its unit) and 512 for one without.
    pub fn block_size(&self) -> u32 {
        self.block_size_given.unwrap_or(if self.cache.is_some() {
            CACHE_BLOCK_SIZE
        } else {
            512
        })
    }

    /// The image path of a file-backed disk.
    pub fn image_path(&self, data_dir: &Path) -> PathBuf {
        self.path
            .clone()
            .unwrap_or_else(|| data_dir.join(format!("{}.img", self.name)))
    }
}

impl Config {
    /// Parse and check a configuration text. Keys that belong to features not built yet
    /// (mirroring, the cache) are refused here with a message that says so, rather than
    /// accepted and ignored.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let de = toml::Deserializer::parse(text).map_err(|e| err("", e.message().to_string()))?;
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.inner().message().to_string();
            err(if key == "." { String::new() } else { key }, inner)
        })?;
        cfg.check()?;
        Ok(cfg)
    }

    /// The worker threads the node's runtime gets: `node.threads` when set, else one
    /// per disk, at most one per core the process may run on (its CPU affinity and
    /// cgroup quota), and at least one.
    ///
    /// Why per disk: a disk's I/O path is one pipeline. A mirrored disk's requests are
    /// carried out by the tasks that submit them (a front door's connection) under the
    /// disk's one lock, with the page-cache I/O inline; a worker beyond one per disk
    /// has nothing of its own to do and only pulls tasks of the same pipeline onto
    /// another thread, which then contend for that lock and wake each other. Measured
    /// on two shared cores (BENCHMARKS.md, issue 22): a mirrored pair with two workers
    /// per node spends more CPU per write and reaches fewer IOPS than with one. Set
    /// `node.threads` when the node serves many busy front-door connections to a
    /// local disk on a machine with cores to spare, or starts with few disks and gets
    /// more through `vsanctl create` (they share the workers started with).
    pub fn worker_threads(&self) -> usize {
        self.node.threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            self.disk.len().clamp(1, cores.max(1))
        })
    }

    /// Read and parse a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err("", format!("cannot read {}: {e}", path.display())))?;
        Config::parse(&text)
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.node.threads == Some(0) {
            return Err(err("node.threads", "must be at least 1"));
        }
        if let Some(listen) = &self.node.listen
            && !listen.starts_with('/')
        {
            listen.parse::<SocketAddr>().map_err(|_| {
                err(
                    "node.listen",
                    format!(
                        "{listen:?} is not an address such as \"127.0.0.1:7001\" (or, for \
                         loopback peers, the absolute path of a Unix socket)"
                    ),
                )
            })?;
        }
        if self.node.quorum.is_some() && self.node.witness.is_none() {
            return Err(err("node.quorum", "a quorum policy needs node.witness"));
        }
        if let Some(m) = &self.node.mgmt
            && m.parse::<SocketAddr>().is_err()
        {
            return Err(err(
                "node.mgmt",
                format!("{m:?} is not an address such as \"127.0.0.1:7101\""),
            ));
        }
        if let Some(t) = &self.node.mgmt_token
            && (t.trim().is_empty() || t.trim() != t)
        {
            return Err(err(
                "node.mgmt_token",
                "must not be empty or have spaces around it",
            ));
        }
        if self.node.mgmt_token.is_some() && self.node.mgmt_token_file.is_some() {
            return Err(err(
                "node.mgmt_token_file",
                "give the token or a file holding it, not both",
            ));
        }
        if self.node.mgmt_cert.is_some() != self.node.mgmt_key.is_some() {
            return Err(err(
                if self.node.mgmt_cert.is_some() {
                    "node.mgmt_key"
                } else {
                    "node.mgmt_cert"
                },
                "TLS for the management service needs both mgmt_cert and mgmt_key",
            ));
        }
        if let Some(w) = &self.node.witness
            && w.parse::<SocketAddr>().is_err()
        {
            return Err(err(
                "node.witness",
                format!("{w:?} is not an address such as \"127.0.0.1:7200\""),
            ));
        }
        let mut peer_ids = HashSet::new();
        for (i, p) in self.peer.iter().enumerate() {
            if p.id == self.node.id {
                return Err(err(
                    format!("peer[{i}].id"),
                    format!("{} is this node's own id", p.id),
                ));
            }
            if !peer_ids.insert(p.id) {
                return Err(err(
                    format!("peer[{i}].id"),
                    format!("peer {} is declared twice", p.id),
                ));
            }
            let key = |k: &str| format!("peer[{i}].{k}");
            let only = |k: &str, set: bool, transports: &[TransportKind]| {
                if set && !transports.contains(&p.transport) {
                    let words: Vec<&str> = transports.iter().map(|t| t.word()).collect();
                    Err(err(
                        key(k),
                        format!(
                            "not used by transport {:?} (only by {})",
                            p.transport.word(),
                            words.join(", ")
                        ),
                    ))
                } else {
                    Ok(())
                }
            };
            if let Some(n) = p.lanes
                && !(1..=64).contains(&n)
            {
                return Err(err(key("lanes"), format!("{n}: must be 1 to 64")));
            }
            if p.secret.is_some() && p.secret_file.is_some() {
                return Err(err(key("secret"), "give secret or secret_file, not both"));
            }
            if p.secret.as_deref() == Some("") {
                return Err(err(key("secret"), "empty"));
            }
            only(
                "secret",
                p.secret.is_some(),
                &[TransportKind::Tcp, TransportKind::Rdma],
            )?;
            only(
                "secret_file",
                p.secret_file.is_some(),
                &[TransportKind::Tcp, TransportKind::Rdma],
            )?;
            only("cert", p.cert.is_some(), &[TransportKind::Quic])?;
            only("key", p.key.is_some(), &[TransportKind::Quic])?;
            only(
                "peer_fingerprint",
                p.peer_fingerprint.is_some(),
                &[TransportKind::Quic],
            )?;
            only("peer_ca", p.peer_ca.is_some(), &[TransportKind::Quic])?;
            only(
                "busy_poll_us",
                p.busy_poll_us.is_some(),
                &[TransportKind::Loopback],
            )?;
            if p.cert.is_some() != p.key.is_some() {
                return Err(err(key("cert"), "give both cert and key, or neither"));
            }
            if p.transport == TransportKind::Loopback && !p.address.starts_with('/') {
                return Err(err(
                    key("address"),
                    format!(
                        "{:?}: a loopback address is the absolute path of a Unix socket",
                        p.address
                    ),
                ));
            }
        }
        let mut names = HashSet::new();
        let mut cache_paths: Vec<(usize, &Path)> = Vec::new();
        for (i, d) in self.disk.iter().enumerate() {
            let key = |k: &str| format!("disk[{i}].{k}");
            let name_ok = !d.name.is_empty()
                && d.name.len() <= 255
                && d.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
                && !d.name.starts_with('.');
            if !name_ok {
                return Err(err(
                    key("name"),
                    format!(
                        "{:?} must be 1-255 of A-Z a-z 0-9 . _ - (not starting with .)",
                        d.name
                    ),
                ));
            }
            if !names.insert(d.name.as_str()) {
                return Err(err(
                    key("name"),
                    format!("disk {:?} is declared twice", d.name),
                ));
            }
            let bs = d.block_size();
            if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
                return Err(err(
                    key("block_size"),
                    format!("{bs} is not a power of two from 512 to 65536"),
                ));
            }
            if d.size.0 == 0 || d.size.0 % u64::from(bs) != 0 {
                return Err(err(
                    key("size"),
                    format!(
                        "{} bytes is not a non-zero multiple of the block size {bs}",
                        d.size.0
                    ),
                ));
            }
            if let Some(nbd) = &d.nbd {
                NbdAddr::parse(nbd).map_err(|e| err(key("nbd"), e.context()))?;
            }
            if let Some(peer) = d.peer {
                if !peer_ids.contains(&peer) {
                    return Err(err(key("peer"), format!("no [[peer]] with id {peer}")));
                }
            }
            if let Some(c) = &d.cache {
                self.check_cache(i, d, c, &cache_paths)?;
                cache_paths.push((i, c.path.as_path()));
            }
            if let Some(c) = d.bitmap_chunk {
                let c = c.0;
                if !c.is_power_of_two() || c < 4096 || c % u64::from(bs) != 0 {
                    return Err(err(
                        key("bitmap_chunk"),
                        format!(
                            "{c} is not a power of two of at least 4096 and a multiple of the block size"
                        ),
                    ));
                }
            }
        }
        self.check_iscsi()?;
        self.check_vhost_user()
    }

    /// The vhost-user keys: the queue and busy-poll keys only with a socket, in range,
    /// and no socket path used twice (by two disks, or by a disk's NBD socket).
    fn check_vhost_user(&self) -> Result<(), ConfigError> {
        let mut paths: Vec<(PathBuf, String)> = Vec::new();
        for (i, d) in self.disk.iter().enumerate() {
            if let Some(NbdAddr::Unix(p)) = d.nbd.as_deref().and_then(|a| NbdAddr::parse(a).ok()) {
                paths.push((p, format!("disk[{i}].nbd")));
            }
        }
        for (i, d) in self.disk.iter().enumerate() {
            let key = |k: &str| format!("disk[{i}].{k}");
            d.check_vhost_user().map_err(|(k, m)| err(key(k), m))?;
            let Some(path) = &d.vhost_user else { continue };
            if let Some((_, other)) = paths.iter().find(|(p, _)| p == path) {
                return Err(err(
                    key("vhost_user"),
                    format!("{} is also {other}", path.display()),
                ));
            }
            paths.push((path.clone(), key("vhost_user")));
        }
        Ok(())
    }

    /// `disk[i].cache`: its settings, a block size the cache can serve, and a path that
    /// is no other disk's cache and no disk's image. (Whether the file exists, and what
    /// it holds, is the node's to check when it starts.)
    fn check_cache(
        &self,
        i: usize,
        d: &DiskSection,
        c: &CacheSection,
        earlier: &[(usize, &Path)],
    ) -> Result<(), ConfigError> {
        let key = |k: &str| format!("disk[{i}].cache.{k}");
        if d.block_size() != CACHE_BLOCK_SIZE {
            return Err(err(
                format!("disk[{i}].block_size"),
                format!(
                    "{} does not fit a disk with a cache, which works in {CACHE_BLOCK_SIZE}-byte \
                     blocks: leave block_size out or set it to {CACHE_BLOCK_SIZE}",
                    d.block_size()
                ),
            ));
        }
        c.settings().map_err(|(k, m)| {
            err(
                if k.is_empty() {
                    format!("disk[{i}].cache")
                } else {
                    key(k)
                },
                m,
            )
        })?;
        if c.path.as_os_str().is_empty() {
            return Err(err(key("path"), "is empty"));
        }
        if let Some(Size(n)) = c.size
            && n < MIN_CACHE_SIZE
        {
            return Err(err(
                key("size"),
                format!(
                    "{n} bytes is under the smallest cache device of {MIN_CACHE_SIZE} bytes \
                     (8 KiB of superblocks and a 64 KiB log)"
                ),
            ));
        }
        if let Some((j, _)) = earlier.iter().find(|(_, p)| *p == c.path) {
            return Err(err(
                key("path"),
                format!("{} is also disk[{j}]'s cache", c.path.display()),
            ));
        }
        for (j, other) in self.disk.iter().enumerate() {
            if other.backing == Backing::File && other.image_path(&self.node.data_dir) == c.path {
                return Err(err(
                    key("path"),
                    format!("{} is disk[{j}]'s image", c.path.display()),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
