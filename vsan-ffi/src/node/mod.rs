//! A vsan node as a library: the configuration file (TOML, see [`config`]) becomes disks
//! (images, caches, mirrors), replication links and NBD and iSCSI exports, owned by one
//! [`Node`].
//!
//! `vsan-node` is a thin program over this module (it adds signals and the stdout report
//! lines); the C ABI opens the same nodes, so a config behaves the same in both.
//!
//! [`Node::start`] binds every listener first (a busy address refuses the start before
//! any image is created), checks every cache file, then opens or creates each disk's
//! image, cache, metadata and mirror, starts the replication dialers and acceptor, and
//! serves the disks that have an `nbd` address over NBD and those with an `iscsi` portal
//! as iSCSI targets. [`Node::shutdown`] stops accepting,
//! lets NBD and iSCSI requests in flight finish, flushes every disk, closes the mirrors (metadata
//! marked clean) and then the caches (everything destaged).

//!
//! Files: `start.rs` (the phases of [`Node::start`]), `cache.rs` (a disk's cache at start
//! and shutdown), [`config`], [`transports`] (a peer's transport from its section),
//! `metrics.rs` (the metrics endpoint, feature `metrics`; `metrics_off.rs` stands in
//! without it), `mgmt.rs` (the management service, feature `mgmt`). A config that asks
//! for a service the build lacks is refused at start.

mod alua;
mod cache;
pub mod config;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
#[path = "metrics_off.rs"]
mod metrics;
#[cfg(feature = "mgmt")]
mod mgmt;
mod scsi_peer;
mod start;
pub mod transports;

use std::collections::HashMap;
use std::fmt::Display;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tracing::{error, info, warn};
use vsan_cache::WriteBackCache;
use vsan_core::BlockDevice;
use vsan_core::export::iscsi::Server as IscsiServer;
use vsan_core::export::nbd::Server;
use vsan_replica::MirroredDisk;
use vsan_replica::connect::DiskRegistry;
use vsan_replica::protocol::{LinkState, QuorumPolicy};
use vsan_replica::transport::Transport;
use vsan_replica::witness::WitnessClient;

use config::Config;

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

/// Why a listener could not bind `addr` (config key `key`, `disk[0].nbd`): the one
/// mapping of bind failures for every listener a node opens. An address in use is
/// [`StartError::AddressInUse`]; anything else wrong with it, [`StartError::Config`].
pub(crate) fn listen_error(
    key: &str,
    addr: impl Display,
    in_use: bool,
    error: impl Display,
) -> StartError {
    if in_use {
        StartError::AddressInUse(format!("key `{key}`: address {addr} is already in use"))
    } else {
        StartError::Config(format!("key `{key}`: cannot listen on {addr}: {error}"))
    }
}

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
    /// The iSCSI target the disk is LUN 0 of, when it has an `iscsi` portal.
    pub iscsi: Option<IscsiExport>,
    /// The vhost-user-blk export, when the disk has a `vhost_user` socket.
    #[cfg(target_os = "linux")]
    pub vhost_user: Option<Arc<vsan_core::export::vhost_user::VhostUserExport>>,
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
            .field(
                "iscsi",
                &self.iscsi.as_ref().map(|e| (&e.portal, &e.target)),
            )
            .field("vhost_user", &self.vhost_user_path())
            .finish()
    }
}

impl NodeDisk {
    /// The socket of the disk's vhost-user-blk export, if it has one.
    pub fn vhost_user_path(&self) -> Option<&std::path::Path> {
        #[cfg(target_os = "linux")]
        return self.vhost_user.as_ref().map(|e| e.path());
        #[cfg(not(target_os = "linux"))]
        None
    }
}

/// A disk's iSCSI target: where it is served and by which server (one per portal, shared
/// by the disks on that portal).
#[derive(Clone, Debug)]
pub struct IscsiExport {
    /// The portal (`host:port`, with the actual port when the config said port 0).
    pub portal: String,
    /// The target's iSCSI name.
    pub target: String,
    /// The portal's server (its `sessions()` include other disks' on the same portal).
    pub server: IscsiServer,
}

impl IscsiExport {
    /// The open sessions logged in to this disk's target.
    pub fn sessions(&self) -> Vec<vsan_core::export::iscsi::SessionInfo> {
        let mut sessions = self.server.sessions();
        sessions.retain(|s| s.target == self.target);
        sessions
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
    /// One iSCSI server per portal, and their accept tasks.
    iscsi_servers: Vec<IscsiServer>,
    iscsi_tasks: Vec<JoinHandle<vsan_core::Result<()>>>,
    /// The mirrored disks' logical units whose ALUA states follow their mirrors.
    alua: Vec<alua::AluaFollower>,
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
    /// `ready disk=<name> nbd=<address>` per disk exported over NBD, then
    /// `ready disk=<name> iscsi=<portal> target=<iqn>` per disk with an iSCSI target (with
    /// the actual port when the config said port 0), then `ready mgmt=<address>` when it
    /// serves the management API.
    pub fn ready_lines(&self) -> &[String] {
        &self.ready_lines
    }

    /// Stop the node: stop accepting NBD, iSCSI and vhost-user connections and requests, let requests
    /// in flight finish (up to [`DRAIN_TIMEOUT`]), flush every disk, stop the replication links,
    /// close every mirror (metadata marked clean) and then every cache (everything
    /// destaged, marked clean). Everything is closed even when a step fails; the error
    /// says what failed (the data may then not be durable); its kind is
    /// [`ErrorKind::Io`](vsan_core::ErrorKind::Io).
    pub async fn shutdown(mut self) -> vsan_core::Result<()> {
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
        // Initiators with a path through the peer move their I/O there.
        for f in &mut self.alua {
            f.shutting_down();
        }
        let iscsi_servers = std::mem::take(&mut self.iscsi_servers);
        for server in &iscsi_servers {
            server.shutdown();
        }
        // Scrapes read the disks' state: stop them before the disks close.
        if let Some(m) = self.metrics.take() {
            m.stop().await;
        }
        for t in std::mem::take(&mut self.server_tasks) {
            let _ = t.await;
        }
        for t in std::mem::take(&mut self.iscsi_tasks) {
            if let Ok(Err(e)) = t.await {
                warn!("an iSCSI portal stopped serving: {e}");
            }
        }
        // vhost-user front ends: each export completes its requests in flight, then
        // disconnects (off the runtime's threads: those requests may need them).
        #[cfg(target_os = "linux")]
        let vhost: Vec<_> = self
            .shared
            .disks
            .read()
            .iter()
            .filter_map(|d| d.vhost_user.clone())
            .collect();
        let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
            #[cfg(target_os = "linux")]
            for export in vhost {
                let _ = tokio::task::spawn_blocking(move || export.shutdown()).await;
            }
            for server in &servers {
                server.wait_idle().await;
            }
            for server in &iscsi_servers {
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
        drop(iscsi_servers);
        drop(disks);
        drop(mirrors);
        for (name, cache) in caches {
            if let Err(e) = cache::close_cache(&name, cache).await {
                failed.push(e.context().to_string());
            }
        }
        for path in std::mem::take(&mut self.sockets) {
            let _ = std::fs::remove_file(path);
        }
        if !failed.is_empty() {
            return Err(vsan_core::Error::new(
                vsan_core::ErrorKind::Io,
                format!("{}; data may not be durable", failed.join("; ")),
            ));
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
        for t in &self.iscsi_tasks {
            t.abort();
        }
        for server in &self.servers {
            server.shutdown();
        }
        for server in &self.iscsi_servers {
            server.shutdown();
        }
    }
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
