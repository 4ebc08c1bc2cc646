//! A vsan node as a library: the configuration file (TOML, see [`config`]) becomes disks
//! (images, caches, mirrors), replication links and NBD exports, owned by one [`Node`].
//!
//! `vsan-node` is a thin program over this module (it adds signals and the stdout report
//! lines); the C ABI opens the same nodes, so a config behaves the same in both.
//!
//! [`Node::start`] binds every listener first (a busy address refuses the start before
//! any image is created), checks every cache file, then opens or creates each disk's
//! image, cache, metadata and mirror, starts the replication dialers and acceptor, and
//! serves the disks that have an `nbd` address. [`Node::shutdown`] stops accepting,
//! lets NBD requests in flight finish, flushes every disk, closes the mirrors (metadata
//! marked clean) and then the caches (everything destaged).

pub mod config;
pub mod metrics;
#[cfg(feature = "mgmt")]
mod mgmt;
pub mod transports;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};
use vsan_cache::format::{self as cache_format, Superblock as CacheSuperblock};
use vsan_cache::{DataLoss, FastDevice, WriteBackCache};
use vsan_core::export::nbd::{Export, Server};
use vsan_core::{BlockDevice, ErrorKind, FileOptions, Geometry, MemDevice};
use vsan_replica::connect::{DiskRegistry, accept_loop_shared, dial_loop};
use vsan_replica::meta::{self, DEFAULT_CHUNK_SIZE};
use vsan_replica::protocol::{
    Config as MirrorConfig, DiskId, LinkState, QuorumPolicy, ResyncRate, SplitBrainPolicy,
    StartupPolicy,
};
use vsan_replica::transport::Transport;
use vsan_replica::transport::tcp::TcpTransport;
use vsan_replica::witness::WitnessClient;
use vsan_replica::{MirroredDisk, Replica, meta_params};

use config::{
    Backing, CacheSection, Config, DiskSection, NbdAddr, PeerSection, Rate, SplitBrain,
    cache_mode_word,
};
use transports::Note;

/// How long shutdown waits for NBD clients to finish their requests, and for each mirror
/// and cache to close.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a node could not start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    /// The configuration is wrong (a key and the problem); nothing was created.
    Config(String),
    /// An address the configuration names is in use (a key and the address); nothing was
    /// created.
    AddressInUse(String),
    /// Something failed while opening (an image, a metadata file, a cache).
    Runtime(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(m) | StartError::AddressInUse(m) | StartError::Runtime(m) => {
                f.write_str(m)
            }
        }
    }
}

impl std::error::Error for StartError {}

/// Choices made when a node starts that are not part of its config file.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Mirrored disks whose split brain is resolved by discarding this node's changes:
    /// on the next connection this replica becomes the sync target.
    pub discard_my_data: Vec<String>,
    /// Mirrored disks whose unproven replica an operator declares current at start:
    /// each serves alone until its peer connects, logged as a risk (see
    /// [`MirroredDisk::declare_current`]).
    pub declare_current: Vec<String>,
}

/// One of a node's disks.
#[derive(Clone)]
pub struct NodeDisk {
    /// The disk's name (its NBD export name).
    pub name: String,
    /// What clients use: the mirror when the disk has a peer, else the cache or image.
    pub device: Arc<dyn BlockDevice>,
    /// The mirror, when the disk has a peer.
    pub mirror: Option<MirroredDisk>,
    /// The peer's node id, when the disk has a peer.
    pub peer_id: Option<u32>,
    /// The transport the config asks for the peer ("tcp", "quic", "rdma", ...), when
    /// the disk has a peer.
    pub transport: Option<String>,
    /// The NBD address the disk is exported on, and the server exporting it.
    pub nbd: Option<(String, Server)>,
    /// The write-back cache under the mirror (or under clients), when configured.
    pub cache: Option<Arc<WriteBackCache>>,
}

impl std::fmt::Debug for NodeDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeDisk")
            .field("name", &self.name)
            .field("geometry", &self.device.geometry())
            .field("mirrored", &self.mirror.is_some())
            .field("cached", &self.cache.is_some())
            .finish()
    }
}

/// What the management service changes while the node runs: the disks (those of the
/// config and those an operator created), and what creating one needs.
// Without the management service, only the disks and metrics are read.
#[cfg_attr(not(feature = "mgmt"), allow(dead_code))]
pub(crate) struct Shared {
    /// The node's configuration.
    pub(crate) config: Config,
    pub(crate) witness: Option<WitnessClient>,
    pub(crate) quorum: Option<QuorumPolicy>,
    /// The transport that dials each peer, built on first use.
    pub(crate) dialers: parking_lot::Mutex<HashMap<u32, Arc<dyn Transport>>>,
    /// The acceptor's disks by name, when the node listens for peers.
    pub(crate) accepting: Option<DiskRegistry>,
    /// Every disk, in order.
    pub(crate) disks: parking_lot::RwLock<Vec<NodeDisk>>,
    /// What disks created at run time own besides their `NodeDisk`.
    pub(crate) created: parking_lot::Mutex<HashMap<String, Created>>,
    /// Creations and deletions run one at a time.
    pub(crate) admin: tokio::sync::Mutex<()>,
    /// The metrics of disks' I/O, when the node serves metrics: disks created at run
    /// time are counted too.
    pub(crate) meters: Option<metrics::DiskMeters>,
}

impl Shared {
    /// The disk called `name`.
    pub(crate) fn disk(&self, name: &str) -> Option<NodeDisk> {
        self.disks.read().iter().find(|d| d.name == name).cloned()
    }
}

/// The tasks and NBD server of a disk created at run time.
#[derive(Default)]
#[cfg_attr(not(feature = "mgmt"), allow(dead_code))]
pub(crate) struct Created {
    /// Its dial loop, when this node dials its peer.
    pub(crate) dial: Option<JoinHandle<()>>,
    /// Its NBD server, the server's task and its Unix socket.
    pub(crate) nbd: Option<(JoinHandle<vsan_core::Result<()>>, Server)>,
    pub(crate) socket: Option<PathBuf>,
}

impl Created {
    /// Stop its dial loop and NBD service (without waiting).
    pub(crate) fn abort(&self) {
        if let Some(d) = &self.dial {
            d.abort();
        }
        if let Some((t, server)) = &self.nbd {
            server.shutdown();
            t.abort();
        }
    }
}

/// A running node: its disks, links and NBD servers. Dropping it without
/// [`Node::shutdown`] stops its tasks but neither flushes nor closes anything.
pub struct Node {
    id: u32,
    shared: Arc<Shared>,
    servers: Vec<Server>,
    server_tasks: Vec<JoinHandle<vsan_core::Result<()>>>,
    background: Vec<JoinHandle<()>>,
    sockets: Vec<PathBuf>,
    ready_lines: Vec<String>,
    replication_address: Option<String>,
    #[cfg(feature = "mgmt")]
    mgmt: Option<mgmt::Running>,
    metrics: Option<metrics::MetricsEndpoint>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id)
            .field("disks", &*self.shared.disks.read())
            .finish_non_exhaustive()
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Node {
    /// This node's id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The node's disks, in config order.
    pub fn disks(&self) -> Vec<NodeDisk> {
        self.shared.disks.read().clone()
    }

    /// The disk called `name`.
    pub fn disk(&self, name: &str) -> Option<NodeDisk> {
        self.shared.disk(name)
    }

    /// The address the node listens on for its peers (`node.listen`, with the actual port
    /// when the config said port 0), if it listens.
    pub fn replication_address(&self) -> Option<&str> {
        self.replication_address.as_deref()
    }

    /// The address the node serves its management API on (`node.mgmt`, with the actual
    /// port when the config said port 0), if it does.
    pub fn mgmt_address(&self) -> Option<String> {
        #[cfg(feature = "mgmt")]
        return self.mgmt.as_ref().map(|m| m.address.to_string());
        #[cfg(not(feature = "mgmt"))]
        None
    }

    /// The address the node serves its metrics on (`node.metrics`, with the actual port
    /// when the config said port 0), if it does.
    pub fn metrics_address(&self) -> Option<&str> {
        self.metrics.as_ref().map(metrics::MetricsEndpoint::address)
    }

    /// What the node reports once started, one line each: per cached disk
    /// `cache disk=<name> mode=.. open=formatted|clean|recovered records=.. dirty_bytes=..
    /// log_bytes=..`, then `ready metrics=<address>` when it serves metrics (see
    /// [`metrics`]), then `ready replication=<address>` when it listens for peers, then
    /// `ready disk=<name> nbd=<address>` per exported disk (with the actual port when the
    /// config said port 0).
    pub fn ready_lines(&self) -> &[String] {
        &self.ready_lines
    }

    /// Start a node from its configuration. Must be called within a tokio runtime (with
    /// I/O and time enabled); the node's tasks run on it.
    pub async fn start(config: &Config, options: StartOptions) -> Result<Node, StartError> {
        let discard = &options.discard_my_data;
        let node = &config.node;
        info!(id = node.id, data_dir = %node.data_dir.display(), "node starting");
        #[cfg(not(feature = "mgmt"))]
        if let Some(v) = &node.mgmt {
            warn!("node.mgmt = {v:?}: this build has no management service (feature `mgmt`)");
        }
        let declare = &options.declare_current;
        for (flag, names) in [
            ("--discard-my-data", discard),
            ("--declare-current", declare),
        ] {
            for name in names {
                if !config
                    .disk
                    .iter()
                    .any(|d| &d.name == name && d.peer.is_some())
                {
                    return Err(StartError::Config(format!(
                        "{flag} {name:?}: no mirrored disk of that name"
                    )));
                }
            }
        }
        let witness = node
            .witness
            .as_ref()
            .map(|w| WitnessClient::new(w.clone(), node.id));
        let quorum = match (node.witness.is_some(), node.quorum.as_deref()) {
            (false, _) => None,
            (true, Some("suspend")) => Some(QuorumPolicy::Suspend),
            (true, _) => Some(QuorumPolicy::IoError),
        };

        let mut ready_lines_pre = Vec::new();
        // Bind every listener first: a busy address must refuse the start before any image
        // is created. Disks sharing an address become exports of one server.
        let mut by_addr: BTreeMap<String, (NbdAddr, Vec<usize>)> = BTreeMap::new();
        for (i, d) in config.disk.iter().enumerate() {
            let Some(nbd) = &d.nbd else {
                warn!(disk = %d.name, "no `nbd` address: the disk is not exported");
                continue;
            };
            let addr = NbdAddr::parse(nbd)
                .map_err(|m| StartError::Config(format!("key `disk[{i}].nbd`: {m}")))?;
            by_addr
                .entry(addr.to_string())
                .or_insert_with(|| (addr, Vec::new()))
                .1
                .push(i);
        }
        let mut bound = Vec::new();
        for (addr, members) in by_addr.into_values() {
            let key = format!("key `disk[{}].nbd`", members[0]);
            let listener = bind(&addr).await.map_err(|e| {
                if e.kind() == std::io::ErrorKind::AddrInUse {
                    StartError::AddressInUse(format!("{key}: address {addr} is already in use"))
                } else {
                    StartError::Config(format!("{key}: cannot listen on {addr}: {e}"))
                }
            })?;
            bound.push((addr, members, listener));
        }
        let node_metrics = match &node.metrics {
            Some(addr) => {
                let m = metrics::NodeMetrics::bind(addr).await?;
                ready_lines_pre.push(format!("ready metrics={}", m.address()));
                Some(m)
            }
            None => None,
        };

        #[cfg(feature = "mgmt")]
        let mgmt_listener = match &node.mgmt {
            Some(addr) => Some(mgmt::bind(addr).await.map_err(|e| {
                let m = format!("key `node.mgmt`: cannot listen on {addr}: {e}");
                if e.kind() == std::io::ErrorKind::AddrInUse {
                    StartError::AddressInUse(m)
                } else {
                    StartError::Config(m)
                }
            })?),
            None => None,
        };

        // One transport per peer; the listener speaks the transport of the peers that dial
        // this node (those with a lower id), which must agree.
        let mut peer_transports = HashMap::new();
        for (i, p) in config.peer.iter().enumerate() {
            if !config.disk.iter().any(|d| d.peer == Some(p.id)) {
                continue;
            }
            let t = transports::build(p, i, node.id, &node.data_dir).map_err(StartError::Config)?;
            for n in &t.notes {
                match n {
                    Note::Warn(m) => warn!("{m}"),
                    Note::Info(m) => info!("{m}"),
                }
            }
            peer_transports.insert(p.id, t);
        }
        let dialing_us: Vec<(usize, &PeerSection)> = config
            .peer
            .iter()
            .enumerate()
            .filter(|(_, p)| p.id < node.id && peer_transports.contains_key(&p.id))
            .collect();
        if let [(first_i, first), rest @ ..] = dialing_us.as_slice()
            && let Some((i, p)) = rest
                .iter()
                .find(|(_, p)| !transports::same_listener(first, p))
        {
            return Err(StartError::Config(format!(
                "key `peer[{i}].transport`: peers {} (peer[{first_i}]) and {} both dial this \
             node's node.listen but with different transport settings; one listener serves \
             one kind",
                first.id, p.id
            )));
        }
        let listen_transport: Arc<dyn Transport> = match dialing_us.first() {
            Some((_, p)) => Arc::clone(&peer_transports[&p.id].listen),
            None => Arc::new(TcpTransport::new()),
        };
        let mut replication_address = None;
        let replication = match &node.listen {
            Some(addr) => {
                let transport = &listen_transport;
                let l = transport.listen(addr).await.map_err(|e| {
                    let m = format!("key `node.listen`: cannot listen on {addr}: {e}");
                    if e.kind() == ErrorKind::InUse {
                        StartError::AddressInUse(m)
                    } else {
                        StartError::Config(m)
                    }
                })?;
                replication_address = Some(l.local_addr());
                ready_lines_pre.push(format!("ready replication={}", l.local_addr()));
                Some(l)
            }
            None => None,
        };

        // Every cache file is checked before any image is created or opened: a refused
        // cache leaves nothing behind.
        let mut cache_files = Vec::with_capacity(config.disk.len());
        for (i, d) in config.disk.iter().enumerate() {
            cache_files.push(match &d.cache {
                Some(c) => Some(inspect_cache(i, d, c, &node.data_dir)?),
                None => None,
            });
        }

        let mut disks = Vec::new();
        let mirrored: DiskRegistry = Arc::default();
        let mut background = Tasks::default();
        let mut cache_lines = Vec::new();
        for (i, d) in config.disk.iter().enumerate() {
            if d.peer.is_some() && d.backing == Backing::File {
                // A replica whose image is gone but whose metadata is not would claim data it
                // no longer has; it must come back as a new replica.
                let meta_path = node.data_dir.join(format!("{}.meta", d.name));
                let image = d.image_path(&node.data_dir);
                if meta_path.exists() && !image.exists() {
                    return Err(StartError::Runtime(format!(
                        "disk {}: refusing to attach: the metadata {} exists but the image {} does \
                     not; a replaced replica is a new one: remove its metadata too and it is \
                     synced in full from its peer",
                        d.name,
                        meta_path.display(),
                        image.display()
                    )));
                }
            }
            let cache_file = cache_files[i].take();
            let mut disk_cache = None;
            let backing = open_disk(i, d, &node.data_dir)?;
            let local = match (&d.cache, cache_file) {
                (Some(c), Some(file)) => {
                    let (cache, line) =
                        open_cache(i, d, c, file, backing, d.peer.is_some()).await?;
                    cache_lines.push(line);
                    disk_cache = Some(Arc::clone(&cache));
                    cache as Arc<dyn BlockDevice>
                }
                _ => backing,
            };
            let (device, mirror): (Arc<dyn BlockDevice>, Option<MirroredDisk>) = match d.peer {
                None => (local, None),
                Some(peer_id) => {
                    let Some(peer) = config.peer.iter().find(|p| p.id == peer_id) else {
                        return Err(StartError::Config(format!(
                            "key `disk[{i}].peer`: no [[peer]] with id {peer_id}"
                        )));
                    };
                    let cfg = mirror_config(
                        node,
                        &format!("disk[{i}]"),
                        d,
                        peer_id,
                        local.geometry(),
                        quorum,
                    )?;
                    let chunk = d.bitmap_chunk.map_or(DEFAULT_CHUNK_SIZE, |c| c.0);
                    let replica = open_replica(d, &node.data_dir, &cfg, chunk, local).await?;
                    let disk = MirroredDisk::start(cfg, replica, witness.clone())
                        .map_err(|e| StartError::Runtime(e.to_string()))?;
                    if discard.contains(&d.name) {
                        disk.discard_my_data();
                    }
                    if declare.contains(&d.name) {
                        warn!(disk = %d.name, "--declare-current: the operator declares this replica current");
                        match disk.declare_current().await {
                            Ok(what) => warn!(disk = %d.name, "{what}"),
                            // (Proven already, say by its own metadata: nothing to do.)
                            Err(e) => warn!(disk = %d.name, "--declare-current not applied: {e}"),
                        }
                    }
                    if node.id < peer_id {
                        info!(disk = %d.name, peer = peer_id, address = %peer.address,
                        "mirroring: dialing the peer");
                        background.push(tokio::spawn(dial_loop(
                            Arc::clone(&peer_transports[&peer_id].dial),
                            peer.address.clone(),
                            disk.clone(),
                        )));
                    } else if replication.is_none() {
                        return Err(StartError::Config(format!(
                            "key `node.listen`: disk {:?} mirrors with node {peer_id}, which dials \
                         this node; set node.listen",
                            d.name
                        )));
                    } else {
                        info!(disk = %d.name, peer = peer_id, "mirroring: waiting for the peer to connect");
                    }
                    mirrored.write().insert(d.name.clone(), disk.clone());
                    (Arc::new(disk.clone()), Some(disk))
                }
            };
            // Counted where clients (NBD, the C ABI) enter the disk.
            let device = match &node_metrics {
                Some(m) => m.wrap(&d.name, device),
                None => device,
            };
            disks.push(NodeDisk {
                name: d.name.clone(),
                device,
                mirror,
                peer_id: d.peer,
                transport: d.peer.and_then(|id| {
                    config
                        .peer
                        .iter()
                        .find(|p| p.id == id)
                        .map(|p| p.transport.clone())
                }),
                nbd: None,
                cache: disk_cache,
            });
        }
        if let Some(l) = replication {
            background.push(tokio::spawn(accept_loop_shared(l, Arc::clone(&mirrored))));
        }

        let mut servers = Vec::new();
        let mut ready_lines = cache_lines;
        ready_lines.extend(ready_lines_pre);
        for (addr, members, listener) in bound {
            let shown = match &listener {
                Listener::Tcp(l) => l
                    .local_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| addr.to_string()),
                Listener::Unix(_, p) => format!("unix:{}", p.display()),
            };
            let mut exports = Vec::new();
            for &i in &members {
                let disk = &disks[i];
                ready_lines.push(format!("ready disk={} nbd={shown}", disk.name));
                exports.push(
                    Export::new(&disk.name, Arc::clone(&disk.device))
                        .with_description(format!("vsan disk {}", disk.name)),
                );
            }
            let server = Server::new(exports).map_err(|e| StartError::Config(e.to_string()))?;
            for &i in &members {
                disks[i].nbd = Some((shown.clone(), server.clone()));
            }
            servers.push((server, listener));
        }

        let mut server_tasks = Vec::new();
        let mut sockets = Vec::new();
        let mut running = Vec::new();
        for (server, listener) in servers {
            let s = server.clone();
            server_tasks.push(match listener {
                Listener::Tcp(l) => tokio::spawn(async move { s.serve_tcp(l).await }),
                Listener::Unix(l, path) => {
                    sockets.push(path);
                    tokio::spawn(async move { s.serve_unix(l).await })
                }
            });
            running.push(server);
        }
        info!(
            id = node.id,
            disks = disks.len(),
            exports = ready_lines
                .iter()
                .filter(|l| l.starts_with("ready disk="))
                .count(),
            "node ready"
        );
        let shared = Arc::new(Shared {
            config: config.clone(),
            witness,
            quorum,
            dialers: parking_lot::Mutex::new(
                peer_transports
                    .iter()
                    .map(|(id, t)| (*id, Arc::clone(&t.dial)))
                    .collect(),
            ),
            accepting: node.listen.as_ref().map(|_| Arc::clone(&mirrored)),
            disks: parking_lot::RwLock::new(disks),
            created: parking_lot::Mutex::new(HashMap::new()),
            admin: tokio::sync::Mutex::new(()),
            meters: node_metrics.as_ref().map(|m| m.meters().clone()),
        });
        // Scrapes read the disks as they are then (an operator may add or remove some).
        let metrics = node_metrics.map(|m| {
            let shared = Arc::downgrade(&shared);
            m.serve(move || {
                shared
                    .upgrade()
                    .map(|s| s.disks.read().clone())
                    .unwrap_or_default()
            })
        });
        #[cfg(feature = "mgmt")]
        let mgmt = match mgmt_listener {
            Some(l) => {
                let running =
                    mgmt::serve(node, l, Arc::clone(&shared)).map_err(StartError::Config)?;
                ready_lines.push(format!("ready mgmt={}", running.address));
                Some(running)
            }
            None => None,
        };
        Ok(Node {
            #[cfg(feature = "mgmt")]
            mgmt,
            id: node.id,
            shared,
            servers: running,
            server_tasks,
            background: background.into_inner(),
            sockets,
            ready_lines,
            replication_address,
            metrics,
        })
    }

    /// Stop the node: stop accepting NBD connections and requests, let requests in flight
    /// finish (up to [`DRAIN_TIMEOUT`]), flush every disk, stop the replication links,
    /// close every mirror (metadata marked clean) and then every cache (everything
    /// destaged, marked clean). Everything is closed even when a step fails; the error
    /// says what failed (the data may then not be durable).
    pub async fn shutdown(mut self) -> Result<(), String> {
        info!(
            id = self.id,
            "shutting down: no new connections or requests; finishing requests in flight"
        );
        // Operators' requests act on the disks: they end first.
        #[cfg(feature = "mgmt")]
        if let Some(mut m) = self.mgmt.take() {
            m.stop().await;
        }
        let servers = std::mem::take(&mut self.servers);
        for server in &servers {
            server.shutdown();
        }
        // Scrapes read the disks' state: stop them before the disks close.
        if let Some(m) = self.metrics.take() {
            m.stop().await;
        }
        for t in std::mem::take(&mut self.server_tasks) {
            let _ = t.await;
        }
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            for server in &servers {
                server.wait_idle().await;
            }
        })
        .await;
        if drained.is_err() {
            warn!("some clients did not finish within {DRAIN_TIMEOUT:?}; closing them");
        }
        // Disks an operator created: their own NBD servers and dialers stop here too.
        let created: Vec<Created> = self.shared.created.lock().drain().map(|(_, c)| c).collect();
        for c in &created {
            if let Some((_, server)) = &c.nbd {
                server.shutdown();
            }
        }
        let disks = std::mem::take(&mut *self.shared.disks.write());
        let mut failed = Vec::new();
        // Disks whose only final flush is their mirror's close.
        let mut flushed_by_close = Vec::new();
        for disk in &disks {
            if let Some(why) = disk.mirror.as_ref().and_then(|m| unflushable(&m.status())) {
                // The close below makes this replica durable before marking it clean.
                warn!(disk = %disk.name, "not flushed through the mirror: {why}; closing it flushes this replica");
                flushed_by_close.push(disk.name.clone());
                continue;
            }
            match disk.device.flush().await {
                Ok(()) => info!(disk = %disk.name, "flushed"),
                Err(e) => {
                    error!(disk = %disk.name, "final flush failed: {e}");
                    failed.push(format!("disk {}: final flush failed: {e}", disk.name));
                }
            }
        }
        let mut background = std::mem::take(&mut self.background);
        for c in created {
            background.extend(c.dial);
            if let Some((t, server)) = c.nbd {
                let _ = t.await;
                // Its requests in flight end before the final flush, as the config's do.
                if tokio::time::timeout(DRAIN_TIMEOUT, server.wait_idle())
                    .await
                    .is_err()
                {
                    warn!("some clients did not finish within {DRAIN_TIMEOUT:?}; closing them");
                }
            }
            if let Some(path) = c.socket {
                let _ = std::fs::remove_file(path);
            }
        }
        for task in &background {
            task.abort();
        }
        for task in background {
            // An aborted task has dropped what it held once this returns.
            let _ = task.await;
        }
        // Every mirror the node has now (created ones too; deleted ones are closed).
        let mirrors: Vec<MirroredDisk> = disks.iter().filter_map(|d| d.mirror.clone()).collect();
        for disk in &mirrors {
            match tokio::time::timeout(DRAIN_TIMEOUT, disk.close()).await {
                Ok(Ok(())) => info!(disk = disk.name(), "metadata marked clean"),
                Ok(Err(e)) if flushed_by_close.iter().any(|n| n == disk.name()) => {
                    error!(
                        disk = disk.name(),
                        "closing the mirror (its final flush) failed: {e}"
                    );
                    failed.push(format!("disk {}: final flush failed: {e}", disk.name()));
                }
                Ok(Err(e)) => warn!(disk = disk.name(), "closing the mirror failed: {e}"),
                Err(_) if flushed_by_close.iter().any(|n| n == disk.name()) => {
                    error!(
                        disk = disk.name(),
                        "closing the mirror (its final flush) timed out"
                    );
                    failed.push(format!(
                        "disk {}: final flush timed out after {DRAIN_TIMEOUT:?}",
                        disk.name()
                    ));
                }
                Err(_) => warn!(disk = disk.name(), "closing the mirror timed out"),
            }
        }
        // Caches last: everything above them is closed; a cache refuses I/O once closed.
        let caches: Vec<(String, Arc<WriteBackCache>)> = disks
            .iter()
            .filter_map(|d| Some((d.name.clone(), Arc::clone(d.cache.as_ref()?))))
            .collect();
        drop(servers);
        drop(disks);
        drop(mirrors);
        for (name, cache) in caches {
            if let Err(e) = close_cache(&name, cache).await {
                failed.push(e);
            }
        }
        for path in std::mem::take(&mut self.sockets) {
            let _ = std::fs::remove_file(path);
        }
        if !failed.is_empty() {
            return Err(format!("{}; data may not be durable", failed.join("; ")));
        }
        info!(id = self.id, "node stopped cleanly");
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in self.shared.created.lock().values() {
            c.abort();
        }
        for t in &self.background {
            t.abort();
        }
        for t in &self.server_tasks {
            t.abort();
        }
        for server in &self.servers {
            server.shutdown();
        }
    }
}

/// Tasks aborted when this is dropped: a start that fails half way stops what it began.
#[derive(Default)]
struct Tasks(Vec<JoinHandle<()>>);

impl Tasks {
    fn push(&mut self, t: JoinHandle<()>) {
        self.0.push(t);
    }

    fn into_inner(mut self) -> Vec<JoinHandle<()>> {
        std::mem::take(&mut self.0)
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// The mirror configuration of disk `d` (config key `key`, "disk[0]") with peer
/// `peer_id`.
pub(crate) fn mirror_config(
    node: &config::NodeSection,
    key: &str,
    d: &DiskSection,
    peer_id: u32,
    g: Geometry,
    quorum: Option<QuorumPolicy>,
) -> Result<MirrorConfig, StartError> {
    let mut cfg = MirrorConfig::new(
        node.id,
        peer_id,
        DiskId::from_name(&d.name),
        &d.name,
        g.size(),
        g.block_size(),
    );
    cfg.peer_timeout = Duration::from_millis(node.peer_timeout_ms);
    // Several pings per timeout, so one late ping never loses the peer.
    cfg.ping_interval = cfg.ping_interval.min(cfg.peer_timeout / 4);
    cfg.connect_timeout = Duration::from_millis(node.peer_timeout_ms);
    cfg.startup = match node.startup {
        config::Startup::WaitForPeer => StartupPolicy::WaitForPeer,
        config::Startup::ServeAloneAfterTimeout => StartupPolicy::ServeAloneAfterTimeout,
    };
    cfg.quorum = quorum;
    cfg.seed = rand::random();
    let key = |k: &str| format!("key `{key}.{k}`");
    cfg.split_brain = match d
        .split_brain_policy()
        .map_err(|m| StartError::Config(format!("{}: {m}", key("split_brain"))))?
    {
        SplitBrain::Refuse => SplitBrainPolicy::Refuse,
        SplitBrain::DiscardZeroChanges => SplitBrainPolicy::DiscardZeroChanges,
        SplitBrain::DiscardLeastChanges => SplitBrainPolicy::DiscardLeastChanges,
        SplitBrain::DiscardNode(id) => SplitBrainPolicy::DiscardNode(id),
    };
    cfg.resync.rate = match d
        .rate()
        .map_err(|m| StartError::Config(format!("{}: {m}", key("resync_rate"))))?
    {
        Rate::Dynamic => ResyncRate::Dynamic { max: 0 },
        Rate::Fixed(r) => ResyncRate::Fixed(r),
    };
    Ok(cfg)
}

/// Open (or create) disk `i` of the config.
fn open_disk(
    i: usize,
    d: &DiskSection,
    data_dir: &Path,
) -> Result<Arc<dyn BlockDevice>, StartError> {
    let key = |k: &str| format!("key `disk[{i}].{k}`");
    match d.backing {
        Backing::Mem => {
            let g = Geometry::new(d.size.0, d.block_size())
                .map_err(|e| StartError::Config(format!("{}: {e}", key("size"))))?;
            info!(disk = %d.name, size = d.size.0, "RAM disk created");
            Ok(Arc::new(MemDevice::new(g)))
        }
        Backing::File => {
            let path = d.image_path(data_dir);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    StartError::Runtime(format!("cannot create {}: {e}", parent.display()))
                })?;
            }
            let existed = path.exists();
            let dev = FileOptions::new()
                .block_size(d.block_size())
                .direct(d.direct)
                .create(d.size.0)
                .open(&path)
                .map_err(|e| match e.kind() {
                    ErrorKind::InvalidArgument => {
                        StartError::Config(format!("{}: {e}", key("size")))
                    }
                    _ => StartError::Runtime(format!("disk {}: {e}", d.name)),
                })?;
            info!(disk = %d.name, path = %path.display(), size = d.size.0, direct = d.direct,
                "{}", if existed { "image opened" } else { "image created" });
            Ok(Arc::new(dev))
        }
    }
}

/// What a disk's cache file holds, learnt before anything is created or opened.
enum CacheFile {
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
fn inspect_cache(
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
async fn open_cache(
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
    let mode = c
        .cache_mode()
        .map_err(|m| StartError::Config(format!("{}: {m}", key("mode"))))?;
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

/// Say once on stdout (`problem disk=<name> ...`) when a disk's cache device fails: the
/// cache goes on in pass-through, and the log says what was lost.
/// Close a disk's cache: destage everything, flush the backing store, mark the cache
/// device clean (the next start scans nothing), and log its counters. Returns whether it
/// closed cleanly.
async fn close_cache(name: &str, cache: Arc<WriteBackCache>) -> Result<(), String> {
    let closed = tokio::time::timeout(DRAIN_TIMEOUT, cache.close()).await;
    log_cache_stats(name, &cache);
    match closed {
        Ok(Ok(())) => {
            info!(disk = %name, "cache closed: everything destaged, marked clean");
            Ok(())
        }
        Ok(Err(e)) => {
            error!(disk = %name, "closing the cache failed: {e}");
            Err(format!("disk {name}: closing the cache failed: {e}"))
        }
        Err(_) => {
            error!(disk = %name, "closing the cache timed out after {DRAIN_TIMEOUT:?}");
            Err(format!(
                "disk {name}: closing the cache timed out after {DRAIN_TIMEOUT:?}"
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

async fn bind(addr: &NbdAddr) -> std::io::Result<Listener> {
    match addr {
        NbdAddr::Tcp(a) => Ok(Listener::Tcp(TcpListener::bind(a).await?)),
        NbdAddr::Unix(p) => {
            if let Ok(meta) = std::fs::symlink_metadata(p) {
                use std::os::unix::fs::FileTypeExt;
                // Only a socket is ever replaced: any other file at the path (an image,
                // say) is refused, never removed.
                if !meta.file_type().is_socket() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::AlreadyExists,
                        format!("{} exists and is not a socket", p.display()),
                    ));
                }
                // A socket someone still answers on is in use; a dead one is stale.
                if tokio::net::UnixStream::connect(p).await.is_ok() {
                    return Err(std::io::Error::from(std::io::ErrorKind::AddrInUse));
                }
                std::fs::remove_file(p)?;
            }
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            Ok(Listener::Unix(UnixListener::bind(p)?, p.clone()))
        }
    }
}

/// Open (or create) the metadata of a mirrored disk: `data_dir/<name>.meta` for file
/// images, in memory for RAM disks.
async fn open_replica(
    d: &DiskSection,
    data_dir: &Path,
    cfg: &MirrorConfig,
    chunk: u64,
    local: Arc<dyn BlockDevice>,
) -> Result<Replica, StartError> {
    if d.backing == Backing::Mem {
        return Replica::with_memory_meta(cfg, local)
            .await
            .map_err(|e| StartError::Runtime(format!("disk {}: {e}", d.name)));
    }
    let path = data_dir.join(format!("{}.meta", d.name));
    let params = meta_params(cfg, chunk);
    let (dev, loaded, created) = meta::open_or_create_file(&path, &params)
        .await
        .map_err(|e| StartError::Runtime(format!("disk {}: refusing to attach: {e}", d.name)))?;
    let sb = &loaded.superblock;
    info!(
        disk = %d.name,
        path = %path.display(),
        current = format_args!("{:016x}", sb.generations.current),
        dirty_chunks = loaded.bitmap.count(),
        clean = sb.clean_shutdown,
        "{}",
        if created { "metadata created" } else { "metadata opened" }
    );
    Ok(Replica {
        data: local,
        meta: dev,
        loaded,
    })
}

/// Why the final flush is not run through a mirror at shutdown, if it is not: not
/// proven current since the start (it served nothing), alone and an unfinished resync
/// target (no complete copy here), alone without the witness's grant (refused or held
/// by the quorum policy), or alone at all (the mirror's close flushes this replica
/// without moving its generation).
fn unflushable(s: &vsan_replica::MirrorStatus) -> Option<&'static str> {
    if s.link == LinkState::Connected {
        return None;
    }
    if !s.freshness.is_current() {
        // Nothing was served from it, so nothing of the callers' is waiting to be made
        // durable; a flush would wait for the proof and fail.
        Some("the replica is not proven current (the peer has not connected since the start)")
    } else if s.inconsistent {
        Some("the replica is an unfinished resync target and the peer is away")
    } else if s.quorum == Some(false) || s.suspended {
        Some("the peer is away and the witness has not granted this node the disk")
    } else {
        // A flush alone would move the replica to a new generation (what it makes
        // durable the peer may lack), so the next handshake would resync even when
        // nothing was written since the peer left. Closing the mirror makes everything
        // durable here and marks the metadata clean, which the generation rules read
        // the same way (a peer that crashed meanwhile takes this replica's data).
        Some("the peer is away")
    }
}
