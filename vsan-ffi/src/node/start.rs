//! Starting a node, in phases. [`Node::start`] runs them in this order:
//!
//! 1. `check_options`: the config asks only for services this build has (features
//!    `metrics`, `mgmt`), and the start options name mirrored disks of the config;
//! 2. bind every listener, so a busy address refuses the start before any image is
//!    created: the NBD exports (`bind_exports`), the iSCSI portals (`bind_portals`, which
//!    also reads the CHAP secret files), the metrics endpoint
//!    (`bind_metrics`), the management service (`bind_mgmt`), and, with the
//!    transports of the peers (`peer_transports`), the replication listener
//!    (`listen_for_peers`);
//! 3. `inspect_caches`: every cache file checked before anything is created;
//! 4. `Starting::open_disks`: each disk's image, cache, metadata and mirror, and the
//!    dialers of the peers this node dials;
//! 5. `targets_of_portals`: each disk's logical unit and iSCSI target, one server per
//!    portal; then `serve_exports`: the NBD servers over the bound listeners, and the
//!    iSCSI servers over theirs;
//! 6. the metrics and management services over the node's disks.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinHandle;
use tracing::{info, warn};
use vsan_core::export::iscsi::{Chap, Server as IscsiServer, Target};
use vsan_core::export::nbd::{Export, Server};
use vsan_core::scsi::{LogicalUnit, LuConfig, LuIdentity, TargetPort};
use vsan_core::{BlockDevice, ErrorKind, FileOptions, Geometry, MemDevice};
use vsan_replica::connect::{DiskRegistry, accept_loop_shared, dial_loop};
use vsan_replica::meta::{self, DEFAULT_CHUNK_SIZE};
use vsan_replica::protocol::{
    Config as MirrorConfig, DiskId, QuorumPolicy, ResyncRate, SplitBrainPolicy, StartupPolicy,
};
use vsan_replica::transport::tcp::TcpTransport;
use vsan_replica::transport::{Listener as PeerListener, Transport};
use vsan_replica::witness::WitnessClient;
use vsan_replica::{MirroredDisk, Replica, meta_params};

use super::alua::{self, AluaFollower};
use super::cache::{CacheFile, inspect_cache, open_cache};
use super::config::{
    self, Backing, Config, DiskSection, NbdAddr, PeerSection, Quorum, Rate, SplitBrain,
};
#[cfg(feature = "mgmt")]
use super::mgmt;
use super::transports::{self, Note, PeerTransport};
use super::{IscsiExport, Node, NodeDisk, Shared, StartError, StartOptions, listen_error, metrics};

impl Node {
    /// Start a node from its configuration. Must be called within a tokio runtime (with
    /// I/O and time enabled); the node's tasks run on it.
    pub async fn start(config: &Config, options: StartOptions) -> Result<Node, StartError> {
        let node = &config.node;
        info!(id = node.id, data_dir = %node.data_dir.display(), "node starting");
        check_options(config, &options)?;
        let witness = node
            .witness
            .as_ref()
            .map(|w| WitnessClient::new(w.clone(), node.id));
        let quorum = quorum_policy(&config.node);

        let exports = bind_exports(config).await?;
        let portals = bind_portals(config).await?;
        let mut ready_lines_pre = Vec::new();
        let node_metrics = bind_metrics(node).await?;
        if let Some(m) = &node_metrics {
            ready_lines_pre.push(format!("ready metrics={}", m.address()));
        }
        #[cfg(feature = "mgmt")]
        let mgmt_listener = bind_mgmt(node).await?;
        let peers = peer_transports(config)?;
        let replication = listen_for_peers(config, &peers).await?;
        let replication_address = replication.as_ref().map(|l| l.local_addr());
        if let Some(a) = &replication_address {
            ready_lines_pre.push(format!("ready replication={a}"));
        }

        let cache_files = inspect_caches(config)?;
        let starting = Starting {
            config,
            options: &options,
            witness,
            quorum,
            peers,
            listening: replication.is_some(),
            metrics: node_metrics.as_ref(),
        };
        let mirrored: DiskRegistry = Arc::default();
        let mut background = Tasks::default();
        let (mut disks, mut ready_lines) = starting
            .open_disks(cache_files, &mirrored, &mut background)
            .await?;
        if let Some(l) = replication {
            background.push(tokio::spawn(accept_loop_shared(l, Arc::clone(&mirrored))));
        }

        ready_lines.extend(ready_lines_pre);
        // Every fallible step before any server task starts.
        let portals = targets_of_portals(config, portals, &mut disks).await?;
        #[cfg(target_os = "linux")]
        let vhost_lines = start_vhost_user(config, &mut disks)?;
        let served = serve_exports(exports, &mut disks, &mut ready_lines)?;
        let portals = portals.serve(&mut ready_lines);
        #[cfg(target_os = "linux")]
        ready_lines.extend(vhost_lines);
        info!(
            id = node.id,
            disks = disks.len(),
            exports = ready_lines
                .iter()
                .filter(|l| l.starts_with("ready disk="))
                .count(),
            "node ready"
        );
        let Starting {
            witness,
            quorum,
            peers,
            ..
        } = starting;
        let shared = Arc::new(Shared {
            config: config.clone(),
            witness,
            quorum,
            dialers: parking_lot::Mutex::new(
                peers
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
                let running = mgmt::serve(node, l, Arc::clone(&shared))
                    .map_err(|e| StartError::Config(e.context().to_string()))?;
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
            servers: served.servers,
            server_tasks: served.tasks,
            iscsi_servers: portals.servers,
            iscsi_tasks: portals.tasks,
            alua: portals.alua,
            background: background.into_inner(),
            sockets: served.sockets,
            ready_lines,
            replication_address,
            metrics,
        })
    }
}

/// The refusal of a config key (`node.metrics`) that asks for a service (`what`) this
/// build was made without (cargo feature `feature` of vsan-ffi).
pub(super) fn feature_off(key: &str, what: &str, feature: &str) -> StartError {
    StartError::Config(format!(
        "key `{key}`: this build has no {what} (vsan-ffi's cargo feature `{feature}` is off): \
         remove {key} or use a build with the feature"
    ))
}

/// The config asks only for services this build has, and the start options name
/// mirrored disks of the config.
fn check_options(config: &Config, options: &StartOptions) -> Result<(), StartError> {
    if cfg!(not(feature = "mgmt")) && config.node.mgmt.is_some() {
        return Err(feature_off("node.mgmt", "management service", "mgmt"));
    }
    if cfg!(not(feature = "metrics")) && config.node.metrics.is_some() {
        return Err(feature_off("node.metrics", "metrics endpoint", "metrics"));
    }
    for (flag, names) in [
        ("--discard-my-data", &options.discard_my_data),
        ("--declare-current", &options.declare_current),
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
    Ok(())
}

/// What a mirrored disk without its peer and without quorum does, when the node has a
/// witness.
fn quorum_policy(node: &config::NodeSection) -> Option<QuorumPolicy> {
    match (node.witness.is_some(), node.quorum) {
        (false, _) => None,
        (true, Some(Quorum::Suspend)) => Some(QuorumPolicy::Suspend),
        (true, Some(Quorum::IoError) | None) => Some(QuorumPolicy::IoError),
    }
}

/// An NBD address bound at start, and the disks (indices into the config) it exports.
struct BoundExport {
    addr: NbdAddr,
    members: Vec<usize>,
    listener: Listener,
}

/// Bind the NBD address of every exported disk; disks sharing an address become
/// exports of one server.
async fn bind_exports(config: &Config) -> Result<Vec<BoundExport>, StartError> {
    let mut by_addr: BTreeMap<String, (NbdAddr, Vec<usize>)> = BTreeMap::new();
    for (i, d) in config.disk.iter().enumerate() {
        let Some(nbd) = &d.nbd else {
            if d.iscsi.is_none() {
                warn!(disk = %d.name, "no `nbd` or `iscsi` address: the disk is not exported");
            }
            continue;
        };
        let addr = NbdAddr::parse(nbd)
            .map_err(|e| StartError::Config(format!("key `disk[{i}].nbd`: {}", e.context())))?;
        by_addr
            .entry(addr.to_string())
            .or_insert_with(|| (addr, Vec::new()))
            .1
            .push(i);
    }
    let mut bound = Vec::new();
    for (addr, members) in by_addr.into_values() {
        let key = format!("disk[{}].nbd", members[0]);
        let listener = bind(&addr).await.map_err(|e| {
            listen_error(&key, &addr, e.kind() == std::io::ErrorKind::AddrInUse, &e)
        })?;
        bound.push(BoundExport {
            addr,
            members,
            listener,
        });
    }
    Ok(bound)
}

/// Bind the metrics endpoint (`node.metrics`), when the node serves one.
async fn bind_metrics(
    node: &config::NodeSection,
) -> Result<Option<metrics::NodeMetrics>, StartError> {
    match &node.metrics {
        Some(addr) => Ok(Some(metrics::NodeMetrics::bind(addr).await?)),
        None => Ok(None),
    }
}

/// Bind the management service's address (`node.mgmt`), when the node serves it.
#[cfg(feature = "mgmt")]
async fn bind_mgmt(node: &config::NodeSection) -> Result<Option<TcpListener>, StartError> {
    match &node.mgmt {
        Some(addr) => mgmt::bind(addr).await.map(Some).map_err(|e| {
            listen_error(
                "node.mgmt",
                addr,
                e.kind() == std::io::ErrorKind::AddrInUse,
                &e,
            )
        }),
        None => Ok(None),
    }
}

/// One transport per peer that a disk mirrors with. The peers that dial this node
/// (those with a lower id) share its one listener, so their transport settings must
/// agree.
fn peer_transports(config: &Config) -> Result<HashMap<u32, PeerTransport>, StartError> {
    let node = &config.node;
    let mut peers = HashMap::new();
    for (i, p) in config.peer.iter().enumerate() {
        if !config.disk.iter().any(|d| d.peer == Some(p.id)) {
            continue;
        }
        let t = transports::build(p, i, node.id, &node.data_dir)
            .map_err(|e| StartError::Config(e.context().to_string()))?;
        for n in &t.notes {
            match n {
                Note::Warn(m) => warn!("{m}"),
                Note::Info(m) => info!("{m}"),
            }
        }
        peers.insert(p.id, t);
    }
    let dialing_us: Vec<(usize, &PeerSection)> = config
        .peer
        .iter()
        .enumerate()
        .filter(|(_, p)| p.id < node.id && peers.contains_key(&p.id))
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
    Ok(peers)
}

/// Listen for peers on `node.listen`, when given, with the transport of the peers that
/// dial this node (tcp when none does).
async fn listen_for_peers(
    config: &Config,
    peers: &HashMap<u32, PeerTransport>,
) -> Result<Option<Box<dyn PeerListener>>, StartError> {
    let node = &config.node;
    let Some(addr) = &node.listen else {
        return Ok(None);
    };
    let dialing_us = config
        .peer
        .iter()
        .find(|p| p.id < node.id && peers.contains_key(&p.id));
    let transport: Arc<dyn Transport> = match dialing_us {
        Some(p) => Arc::clone(&peers[&p.id].listen),
        None => Arc::new(TcpTransport::new()),
    };
    transport
        .listen(addr)
        .await
        .map(Some)
        .map_err(|e| listen_error("node.listen", addr, e.kind() == ErrorKind::InUse, &e))
}

/// Look at every disk's cache file before any image is created or opened: a refused
/// cache leaves nothing behind.
fn inspect_caches(config: &Config) -> Result<Vec<Option<CacheFile>>, StartError> {
    config
        .disk
        .iter()
        .enumerate()
        .map(|(i, d)| {
            d.cache
                .as_ref()
                .map(|c| inspect_cache(i, d, c, &config.node.data_dir))
                .transpose()
        })
        .collect()
}

/// What opening the disks needs from the phases before.
struct Starting<'a> {
    config: &'a Config,
    options: &'a StartOptions,
    witness: Option<WitnessClient>,
    quorum: Option<QuorumPolicy>,
    /// The transports of the peers disks mirror with.
    peers: HashMap<u32, PeerTransport>,
    /// Whether the node listens for peers (`node.listen`).
    listening: bool,
    /// The metrics that count clients' I/O, when the node serves metrics.
    metrics: Option<&'a metrics::NodeMetrics>,
}

impl Starting<'_> {
    /// Open every disk of the config, in order, with its cache file as
    /// [`inspect_caches`] found it; mirrored disks go into `mirrored` (the acceptor's
    /// registry), and their dial loops into `background`. Returns the disks and the
    /// `cache disk=...` report lines.
    async fn open_disks(
        &self,
        cache_files: Vec<Option<CacheFile>>,
        mirrored: &DiskRegistry,
        background: &mut Tasks,
    ) -> Result<(Vec<NodeDisk>, Vec<String>), StartError> {
        let mut disks = Vec::new();
        let mut cache_lines = Vec::new();
        for ((i, d), cache_file) in self.config.disk.iter().enumerate().zip(cache_files) {
            let (disk, line) = self
                .open_disk_stack(i, d, cache_file, mirrored, background)
                .await?;
            cache_lines.extend(line);
            disks.push(disk);
        }
        Ok((disks, cache_lines))
    }

    /// Disk `i`'s stack: its image, its cache over the image, and its mirror over both
    /// (started, and dialing its peer when this node dials), counted by the metrics
    /// where clients enter it. Returns the disk and its cache's report line.
    async fn open_disk_stack(
        &self,
        i: usize,
        d: &DiskSection,
        cache_file: Option<CacheFile>,
        mirrored: &DiskRegistry,
        background: &mut Tasks,
    ) -> Result<(NodeDisk, Option<String>), StartError> {
        let config = self.config;
        let node = &config.node;
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
        let mut disk_cache = None;
        let mut cache_line = None;
        let backing = open_disk(i, d, &node.data_dir)?;
        let local = match (&d.cache, cache_file) {
            (Some(c), Some(file)) => {
                let (cache, line) = open_cache(i, d, c, file, backing, d.peer.is_some()).await?;
                cache_line = Some(line);
                disk_cache = Some(Arc::clone(&cache));
                cache as Arc<dyn BlockDevice>
            }
            _ => backing,
        };
        let (device, mirror): (Arc<dyn BlockDevice>, Option<MirroredDisk>) = match d.peer {
            None => (local, None),
            Some(peer_id) => {
                let disk = self.start_mirror(i, d, peer_id, local, background).await?;
                mirrored.write().insert(d.name.clone(), disk.clone());
                (Arc::new(disk.clone()), Some(disk))
            }
        };
        // Counted where clients (NBD, the C ABI) enter the disk.
        let device = match self.metrics {
            Some(m) => m.wrap(&d.name, device),
            None => device,
        };
        let disk = NodeDisk {
            name: d.name.clone(),
            device,
            mirror,
            peer_id: d.peer,
            transport: d.peer.and_then(|id| {
                config
                    .peer
                    .iter()
                    .find(|p| p.id == id)
                    .map(|p| p.transport.word().to_string())
            }),
            nbd: None,
            iscsi: None,
            #[cfg(target_os = "linux")]
            vhost_user: None,
            cache: disk_cache,
        };
        Ok((disk, cache_line))
    }

    /// Disk `i`'s mirror with `peer_id` over `local`: its metadata opened (or created),
    /// the start options applied, and its dial loop in `background` when this node
    /// dials the peer (the one with the lower id dials).
    async fn start_mirror(
        &self,
        i: usize,
        d: &DiskSection,
        peer_id: u32,
        local: Arc<dyn BlockDevice>,
        background: &mut Tasks,
    ) -> Result<MirroredDisk, StartError> {
        let config = self.config;
        let node = &config.node;
        let Some(peer) = config.peer.iter().find(|p| p.id == peer_id) else {
            return Err(StartError::Config(format!(
                "key `disk[{i}].peer`: no [[peer]] with id {peer_id}"
            )));
        };
        let cfg = mirror_config(node, d, peer_id, local.geometry(), self.quorum);
        let chunk = d.bitmap_chunk.map_or(DEFAULT_CHUNK_SIZE, |c| c.0);
        let replica = open_replica(d, &node.data_dir, &cfg, chunk, local).await?;
        let disk = MirroredDisk::start(cfg, replica, self.witness.clone())
            .map_err(|e| StartError::Runtime(e.to_string()))?;
        if self.options.discard_my_data.contains(&d.name) {
            disk.discard_my_data();
        }
        if self.options.declare_current.contains(&d.name) {
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
                Arc::clone(&self.peers[&peer_id].dial),
                peer.address.clone(),
                disk.clone(),
            )));
        } else if !self.listening {
            return Err(StartError::Config(format!(
                "key `node.listen`: disk {:?} mirrors with node {peer_id}, which dials \
                 this node; set node.listen",
                d.name
            )));
        } else {
            info!(disk = %d.name, peer = peer_id, "mirroring: waiting for the peer to connect");
        }
        Ok(disk)
    }
}

/// The NBD servers of a started node: serving, with their tasks and Unix sockets.
struct Served {
    servers: Vec<Server>,
    tasks: Vec<JoinHandle<vsan_core::Result<()>>>,
    sockets: Vec<PathBuf>,
}

/// Serve the exported disks, one server per bound address, and add their `ready
/// disk=<name> nbd=<address>` lines.
fn serve_exports(
    bound: Vec<BoundExport>,
    disks: &mut [NodeDisk],
    ready_lines: &mut Vec<String>,
) -> Result<Served, StartError> {
    let mut servers = Vec::new();
    for BoundExport {
        addr,
        members,
        listener,
    } in bound
    {
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
    let mut served = Served {
        servers: Vec::new(),
        tasks: Vec::new(),
        sockets: Vec::new(),
    };
    for (server, listener) in servers {
        let s = server.clone();
        served.tasks.push(match listener {
            Listener::Tcp(l) => tokio::spawn(async move { s.serve_tcp(l).await }),
            Listener::Unix(l, path) => {
                served.sockets.push(path);
                tokio::spawn(async move { s.serve_unix(l).await })
            }
        });
        served.servers.push(server);
    }
    Ok(served)
}

/// The disk's SCSI identity (VPD 0x80 serial, 0x83 designators), the same on both nodes
/// of a mirrored disk; vhost-user's GET_ID answers its serial.
fn disk_identity(d: &DiskSection) -> LuIdentity {
    LuIdentity::from_disk_id(&DiskId::from_name(&d.name).to_string())
}

/// Start the vhost-user-blk export of every disk with a `vhost_user` socket; their
/// `ready disk=<name> vhost_user=<path>` lines. The export serves the same device as
/// NBD and iSCSI (the mirror, where the disk has a peer: a replica not yet proven
/// current makes its requests wait like theirs), with the serial iSCSI reports (VPD
/// 0x80), the same on both nodes.
#[cfg(target_os = "linux")]
fn start_vhost_user(config: &Config, disks: &mut [NodeDisk]) -> Result<Vec<String>, StartError> {
    let mut lines = Vec::new();
    for (i, d) in config.disk.iter().enumerate() {
        let (Some(path), Some(disk)) = (&d.vhost_user, disks.get_mut(i)) else {
            continue;
        };
        let export = vhost_user_export(d, path, Arc::clone(&disk.device)).map_err(|e| {
            StartError::Runtime(format!("key `disk[{i}].vhost_user`: {}", e.context()))
        })?;
        lines.push(format!(
            "ready disk={} vhost_user={}",
            d.name,
            path.display()
        ));
        disk.vhost_user = Some(Arc::new(export));
    }
    Ok(lines)
}

/// Serve `device` (disk `d`'s, as its clients enter it) on the vhost-user socket `path`
/// with `d`'s queue and busy-poll settings and its LU serial; at start and for a disk
/// created through the management service.
#[cfg(target_os = "linux")]
pub(super) fn vhost_user_export(
    d: &DiskSection,
    path: &Path,
    device: Arc<dyn BlockDevice>,
) -> vsan_core::Result<vsan_core::export::vhost_user::VhostUserExport> {
    use vsan_core::export::vhost_user::{VhostUserExport, VhostUserOptions};
    let options = VhostUserOptions {
        queues: d.vhost_user_queues.unwrap_or(1),
        serial: disk_identity(d).serial,
        busy_poll: Duration::from_micros(d.vhost_user_busy_poll_us.unwrap_or(0)),
        ..VhostUserOptions::default()
    };
    VhostUserExport::start(path, device, options, tokio::runtime::Handle::current())
}

/// An iSCSI portal bound at start, and the disks (indices into the config) that are
/// targets there, each with its CHAP settings.
struct BoundPortal {
    listener: TcpListener,
    members: Vec<(usize, Option<Chap>)>,
}

/// Read every iSCSI target's CHAP secrets and bind every portal; disks sharing a portal
/// become targets of one server.
async fn bind_portals(config: &Config) -> Result<Vec<BoundPortal>, StartError> {
    let mut by_addr: BTreeMap<SocketAddr, Vec<(usize, Option<Chap>)>> = BTreeMap::new();
    for (i, d) in config.disk.iter().enumerate() {
        let Some(portal) = &d.iscsi else { continue };
        let addr: SocketAddr = portal.parse().map_err(|_| {
            StartError::Config(format!(
                "key `disk[{i}].iscsi`: {portal:?} is not an address such as \"127.0.0.1:3260\""
            ))
        })?;
        let chap = config
            .iscsi_chap(i)
            .map_err(|e| StartError::Config(e.to_string()))?;
        by_addr.entry(addr).or_default().push((i, chap));
    }
    let mut bound = Vec::new();
    for (addr, members) in by_addr {
        let key = format!("disk[{}].iscsi", members[0].0);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| listen_error(&key, addr, e.kind() == std::io::ErrorKind::AddrInUse, &e))?;
        bound.push(BoundPortal { listener, members });
    }
    Ok(bound)
}

/// The logical unit of disk `d` over `device` (the disk's client-facing device, the one
/// NBD serves), as this node presents it through target `iqn`.
///
/// Its identity comes from the mirror's disk id ([`DiskId::from_name`]: the disk's name,
/// which both nodes of a mirrored disk carry and check against each other in the
/// handshake), so both nodes report the same logical unit; its port, port group and
/// portal group tag are this node's own ([`alua::relative_port`]). The reservation state
/// of a mirrored disk is kept in its replica's metadata (`in_metadata`, see
/// [`super::scsi_peer::keep_in_metadata`]); that of a local file disk in
/// `data_dir/<name>.scsi-state`; a RAM disk keeps it in memory.
fn logical_unit(
    config: &Config,
    d: &DiskSection,
    iqn: &str,
    device: Arc<dyn BlockDevice>,
    in_metadata: bool,
) -> Result<Arc<LogicalUnit>, StartError> {
    let node = &config.node;
    let id = alua::relative_port(node.id, d.peer);
    let lu_config = LuConfig {
        identity: disk_identity(d),
        port: TargetPort {
            name: format!("{iqn},t,0x{id:04x}"),
            relative_id: id,
            group: id,
        },
        read_only: false,
        state_file: match d.backing {
            Backing::File if !in_metadata => Some(scsi_state_file(config, d)),
            Backing::File | Backing::Mem => None,
        },
    };
    LogicalUnit::new(device, lu_config)
        .map_err(|e| StartError::Runtime(format!("disk {}: iSCSI logical unit: {e}", d.name)))
}

/// Where a disk's SCSI state file is (a local disk's; a mirrored disk's before its
/// replica's metadata kept it).
fn scsi_state_file(config: &Config, d: &DiskSection) -> std::path::PathBuf {
    config.node.data_dir.join(format!("{}.scsi-state", d.name))
}

/// The iSCSI servers of a node, one per portal, before they serve: each with its
/// listener and its `ready` lines; and the logical units of mirrored disks, whose port
/// groups follow their mirrors once they serve.
struct PortalTargets {
    portals: Vec<(IscsiServer, TcpListener, Vec<String>)>,
    alua: Vec<AluaFollower>,
}

/// The iSCSI servers of a started node, one per portal, with their accept tasks, and the
/// ALUA followers of its mirrored disks' logical units.
struct ServedPortals {
    servers: Vec<IscsiServer>,
    tasks: Vec<JoinHandle<vsan_core::Result<()>>>,
    alua: Vec<AluaFollower>,
}

/// Each bound portal's targets: each disk LUN 0 of its own target, over the same device
/// NBD serves (so a mirrored replica not yet proven current answers nothing here either:
/// the mirror holds every request until it is). A portal beyond loopback with a target
/// without CHAP logs a warning.
async fn targets_of_portals(
    config: &Config,
    bound: Vec<BoundPortal>,
    disks: &mut [NodeDisk],
) -> Result<PortalTargets, StartError> {
    let mut portals = Vec::new();
    let mut alua = Vec::new();
    for BoundPortal { listener, members } in bound {
        let local = listener.local_addr().map_err(|e| {
            StartError::Runtime(format!("iSCSI portal of disk[{}]: {e}", members[0].0))
        })?;
        let portal = local.to_string();
        let mut targets = Vec::new();
        let mut names = Vec::new();
        for (i, chap) in members {
            let (Some(d), Some(disk)) = (config.disk.get(i), disks.get(i)) else {
                continue;
            };
            let iqn = d.iscsi_target_name();
            let keeps_state = disk.mirror.as_ref().filter(|m| m.has_scsi_area());
            let lu = logical_unit(
                config,
                d,
                &iqn,
                Arc::clone(&disk.device),
                keeps_state.is_some(),
            )?;
            if let Some(mirror) = keeps_state {
                let old = (d.backing == Backing::File).then(|| scsi_state_file(config, d));
                super::scsi_peer::keep_in_metadata(&lu, mirror, old.as_deref())
                    .await
                    .map_err(|e| {
                        StartError::Runtime(format!("disk {}: SCSI state: {e}", d.name))
                    })?;
            }
            let own = lu.port().relative_id;
            if let (Some(mirror), Some(peer)) = (&disk.mirror, disk.peer_id) {
                super::scsi_peer::MirrorPeer::link(mirror, &lu, config.node.id < peer);
                let peer = alua::relative_port(peer, Some(config.node.id));
                let status = mirror.watch_status();
                alua.push(AluaFollower::new(
                    &d.name,
                    Arc::clone(&lu),
                    own,
                    peer,
                    status,
                ));
            }
            let mut target = Target::new(iqn.clone(), lu)
                .with_alias(d.name.clone())
                .with_portal_group_tag(own);
            match chap {
                Some(chap) => {
                    info!(disk = %d.name, target = %iqn, user = %chap.initiator.user,
                        mutual = chap.target.is_some(), "iSCSI target requires CHAP");
                    target = target.with_chap(chap);
                }
                None if !local.ip().is_loopback() => warn!(
                    disk = %d.name,
                    %portal,
                    target = %iqn,
                    "the iSCSI portal listens beyond loopback without CHAP: anyone who \
                     reaches it can read and write the disk; set iscsi_chap_user and \
                     iscsi_chap_secret (or iscsi_chap_secret_file)"
                ),
                None => {}
            }
            targets.push(target);
            names.push((i, iqn));
        }
        let server = IscsiServer::new(targets)
            .map_err(|e| StartError::Config(format!("iSCSI portal {portal}: {e}")))?;
        let mut lines = Vec::new();
        for (i, iqn) in names {
            if let Some(disk) = disks.get_mut(i) {
                lines.push(format!(
                    "ready disk={} iscsi={portal} target={iqn}",
                    disk.name
                ));
                disk.iscsi = Some(IscsiExport {
                    portal: portal.clone(),
                    target: iqn,
                    server: server.clone(),
                });
            }
        }
        portals.push((server, listener, lines));
    }
    Ok(PortalTargets { portals, alua })
}

impl PortalTargets {
    /// Start serving every portal; adds their `ready disk=<name> iscsi=<portal>
    /// target=<iqn>` lines.
    fn serve(self, ready_lines: &mut Vec<String>) -> ServedPortals {
        let mut served = ServedPortals {
            servers: Vec::new(),
            tasks: Vec::new(),
            alua: Vec::new(),
        };
        for mut follower in self.alua {
            follower.start();
            served.alua.push(follower);
        }
        for (server, listener, lines) in self.portals {
            ready_lines.extend(lines);
            let s = server.clone();
            served
                .tasks
                .push(tokio::spawn(async move { s.serve_tcp(listener).await }));
            served.servers.push(server);
        }
        served
    }
}

/// A bound NBD listener.
pub(super) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
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

/// The mirror configuration of disk `d` with peer `peer_id`.
pub(super) fn mirror_config(
    node: &config::NodeSection,
    d: &DiskSection,
    peer_id: u32,
    g: Geometry,
    quorum: Option<QuorumPolicy>,
) -> MirrorConfig {
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
    cfg.split_brain = match d.split_brain_policy() {
        SplitBrain::Refuse => SplitBrainPolicy::Refuse,
        SplitBrain::DiscardZeroChanges => SplitBrainPolicy::DiscardZeroChanges,
        SplitBrain::DiscardLeastChanges => SplitBrainPolicy::DiscardLeastChanges,
        SplitBrain::DiscardNode(id) => SplitBrainPolicy::DiscardNode(id),
    };
    cfg.resync.rate = match d.rate() {
        Rate::Dynamic => ResyncRate::Dynamic { max: 0 },
        Rate::Fixed(r) => ResyncRate::Fixed(r),
    };
    cfg
}

/// Open (or create) disk `i` of the config.
pub(super) fn open_disk(
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

/// Listen on an NBD address. A Unix socket path replaces only a stale socket.
pub(super) async fn bind(addr: &NbdAddr) -> std::io::Result<Listener> {
    match addr {
        NbdAddr::Tcp(a) => Ok(Listener::Tcp(TcpListener::bind(a).await?)),
        NbdAddr::Unix(p) => {
            // Only a stale socket is ever replaced: any other file at the path (an
            // image, say) is refused, never removed, and a live socket is in use.
            vsan_core::export::claim_socket_path(p)?;
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            Ok(Listener::Unix(UnixListener::bind(p)?, p.clone()))
        }
    }
}

/// Open (or create) the metadata of a mirrored disk: `data_dir/<name>.meta` for file
/// images, in memory for RAM disks.
pub(super) async fn open_replica(
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
