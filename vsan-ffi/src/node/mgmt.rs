//! The node's management service, `vsan.mgmt.v1` (gRPC over tonic; the API is
//! `vsan-replica/proto/mgmt.proto`): status of the node's disks, a status stream, and
//! the operator's actions on a disk. Served on `node.mgmt` when the config gives it.
//!
//! Security: a bearer token (`node.mgmt_token` / `mgmt_token_file`) is checked on every
//! request, TLS (`mgmt_cert` + `mgmt_key`) encrypts the connection; a service bound to a
//! non-loopback address without both logs a warning.

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use futures_util::Stream;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, ServerTlsConfig};
use tonic::{Request, Response, Status};
use tracing::{info, warn};
use vsan_cache::{CacheMode, CacheState};
use vsan_core::{Error, ErrorKind};
use vsan_replica::mgmt::RequireToken;
use vsan_replica::mgmt::v1;
use vsan_replica::mgmt::v1::mgmt_server::{Mgmt, MgmtServer};
use vsan_replica::protocol::{Freshness, LinkState, ResyncRate, SyncKind, SyncRole};

use std::sync::Arc;

use serde::Deserialize;
use vsan_core::BlockDevice;
use vsan_core::export::nbd::{Export, Server};
use vsan_replica::MirroredDisk;
use vsan_replica::connect::dial_loop;
use vsan_replica::meta::DEFAULT_CHUNK_SIZE;

use super::config::{Backing, DiskSection, NbdAddr, NodeSection};
use super::{Created, NodeDisk, Shared, StartError, transports};

/// The service: the node's id and its shared state (disks, and what creating one
/// needs).
#[derive(Clone)]
pub(crate) struct Service {
    node_id: u32,
    shared: Arc<Shared>,
}

/// A running management server: its address and how to stop it.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Running {
    /// Stop serving and wait for the server to end.
    pub(crate) async fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

/// The token the config gives (inline or from its file).
fn token(node: &NodeSection) -> vsan_core::Result<Option<String>> {
    if let Some(t) = &node.mgmt_token {
        return Ok(Some(t.clone()));
    }
    let Some(path) = &node.mgmt_token_file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::new(
            ErrorKind::from_io(&e),
            format!(
                "key `node.mgmt_token_file`: cannot read {}: {e}",
                path.display()
            ),
        )
    })?;
    let t = text.lines().next().unwrap_or("").trim().to_string();
    if t.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "key `node.mgmt_token_file`: {} holds no token",
                path.display()
            ),
        ));
    }
    Ok(Some(t))
}

/// Bind the management listener of `node` (already checked: `node.mgmt` is set).
pub(crate) async fn bind(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Serve the management API for `disks` on `listener`.
pub(crate) fn serve(
    node: &NodeSection,
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
) -> vsan_core::Result<Running> {
    let address = listener
        .local_addr()
        .map_err(|e| Error::new(ErrorKind::from_io(&e), format!("key `node.mgmt`: {e}")))?;
    let token = token(node)?;
    let mut builder = tonic::transport::Server::builder();
    let tls = match (&node.mgmt_cert, &node.mgmt_key) {
        (Some(cert), Some(key)) => {
            let read = |p: &std::path::Path, k: &str| {
                std::fs::read(p).map_err(|e| {
                    Error::new(
                        ErrorKind::from_io(&e),
                        format!("key `node.{k}`: cannot read {}: {e}", p.display()),
                    )
                })
            };
            let identity = Identity::from_pem(read(cert, "mgmt_cert")?, read(key, "mgmt_key")?);
            builder = builder
                .tls_config(ServerTlsConfig::new().identity(identity))
                .map_err(|e| {
                    Error::new(
                        ErrorKind::InvalidArgument,
                        format!("key `node.mgmt_cert`: {e}"),
                    )
                })?;
            true
        }
        _ => false,
    };
    let secured = tls && token.is_some();
    if !address.ip().is_loopback() && !secured {
        warn!(
            %address,
            tls,
            token = token.is_some(),
            "the management service listens beyond loopback without TLS and a bearer \
             token: anyone who reaches it can delete disks; set node.mgmt_cert, \
             node.mgmt_key and node.mgmt_token"
        );
    }
    let service = Service {
        node_id: node.id,
        shared,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = builder.add_service(MgmtServer::with_interceptor(
        service,
        RequireToken::new(token.as_deref()),
    ));
    let task = tokio::spawn(async move {
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        if let Err(e) = router
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stopped.await;
            })
            .await
        {
            warn!("management service ended: {e}");
        }
    });
    info!(%address, tls, token = token.is_some(), "management service up");
    Ok(Running {
        address,
        stop: Some(stop),
        task: Some(task),
    })
}

fn kind(k: SyncKind) -> i32 {
    match k {
        SyncKind::Bitmap => v1::SyncKind::Bitmap as i32,
        SyncKind::Checksum => v1::SyncKind::Checksum as i32,
        SyncKind::Verify => v1::SyncKind::Verify as i32,
    }
}

fn role(r: SyncRole) -> i32 {
    match r {
        SyncRole::Source => v1::SyncRole::Source as i32,
        SyncRole::Target => v1::SyncRole::Target as i32,
    }
}

fn cache_mode(m: CacheMode) -> v1::CacheMode {
    match m {
        CacheMode::WriteBack => v1::CacheMode::WriteBack,
        CacheMode::WriteThrough => v1::CacheMode::WriteThrough,
        CacheMode::WriteAround => v1::CacheMode::WriteAround,
        CacheMode::PassThrough => v1::CacheMode::PassThrough,
    }
}

/// A disk's status as the API gives it.
pub(crate) fn status_of(d: &NodeDisk) -> v1::DiskStatus {
    let g = d.device.geometry();
    let mut s = v1::DiskStatus {
        name: d.name.clone(),
        size: g.size(),
        block_size: g.block_size(),
        mirrored: d.mirror.is_some(),
        peer_id: d.peer_id.unwrap_or(0),
        link: v1::LinkState::Local as i32,
        local_state: "up-to-date".into(),
        quorum: "none".into(),
        nbd: d.nbd.as_ref().map(|(a, _)| a.clone()).unwrap_or_default(),
        nbd_clients: d
            .nbd
            .as_ref()
            .map_or(0, |(_, server)| server.open_connections() as u32),
        ..Default::default()
    };
    if let Some(t) = &d.iscsi {
        s.iscsi_target = t.target.clone();
        s.iscsi_portal = t.portal.clone();
        s.iscsi_sessions = t
            .sessions()
            .into_iter()
            .map(|x| v1::IscsiSession {
                initiator: x.initiator,
                isid: x.isid,
                tsih: u32::from(x.tsih),
                connections: x.connections,
            })
            .collect();
    }
    #[cfg(target_os = "linux")]
    if let Some(e) = &d.vhost_user {
        let st = e.status();
        s.vhost_user = e.path().display().to_string();
        s.vhost_user_connected = st.connected;
        s.vhost_user_connections = st.connections;
        s.vhost_user_features = st.features;
        s.vhost_user_queues = st
            .queues
            .into_iter()
            .map(|q| v1::VhostUserQueue {
                requests: q.requests,
                reads: q.reads,
                writes: q.writes,
                flushes: q.flushes,
                discards: q.discards,
                write_zeroes: q.write_zeroes,
                errors: q.errors,
                bad_chains: q.bad_chains,
                read_bytes: q.read_bytes,
                written_bytes: q.written_bytes,
                in_flight: q.in_flight,
                unsupported: q.unsupported,
            })
            .collect();
    }
    if let Some(m) = &d.mirror {
        let st = m.status();
        s.link = match st.link {
            LinkState::Waiting => v1::LinkState::Waiting,
            LinkState::Handshaking => v1::LinkState::Handshaking,
            LinkState::Connected => v1::LinkState::Connected,
            LinkState::Degraded => v1::LinkState::Degraded,
        } as i32;
        if st.link_attached
            && let Some(t) = &st.link_transport
        {
            s.transport = t.to_string();
            if let Some(want) = &d.transport
                && t.split('*').next() != Some(want.as_str())
            {
                s.requested_transport = want.clone();
            }
        }
        s.local_state = if st.local_detached {
            "detached"
        } else if st.inconsistent {
            "inconsistent"
        } else if st.diverged {
            "diverged"
        } else {
            "up-to-date"
        }
        .into();
        s.syncing = st.syncing;
        s.dirty_chunks = st.dirty_chunks;
        s.generations = Some(v1::Generations {
            current: st.generations.current,
            bitmap: st.generations.bitmap,
            history: st.generations.history.to_vec(),
        });
        s.quorum = match st.quorum {
            None => "none",
            Some(true) => "held",
            Some(false) => "lost",
        }
        .into();
        s.suspended = st.suspended;
        s.link_role = match (st.link, st.link_role) {
            (LinkState::Connected, Some(SyncRole::Source)) => "source",
            (LinkState::Connected, Some(SyncRole::Target)) => "target",
            (LinkState::Connected, None) => "in-sync",
            _ => "",
        }
        .into();
        s.sync_number = st.last_sync_start.map_or(0, |x| x.number);
        s.last_problem = st.last_problem.clone().unwrap_or_default();
        s.local_data_lost = st.local_data_lost;
        match st.freshness {
            Freshness::Current(proof) => {
                s.freshness = "current".into();
                s.freshness_proof = proof.as_str().into();
            }
            Freshness::Unproven { awaiting } => {
                s.freshness = "unproven".into();
                s.awaiting = awaiting.as_str().into();
                s.unproven_since_unix_ms = st.unproven_since_unix_ms();
            }
        }
        if let Some(p) = m.sync_progress() {
            s.sync = Some(v1::SyncProgress {
                kind: kind(p.kind),
                role: role(p.role),
                total_bytes: p.total_bytes,
                done_bytes: p.done_bytes,
                transferred_bytes: p.transferred_bytes,
                rate: p.rate,
                // Whole seconds left, rounded up: "0" only when done.
                eta_s: p.eta.map_or(-1, |e| e.as_secs_f64().ceil() as i64),
                percent: p.percent(),
            });
        }
        if let Some(l) = st.last_sync {
            s.last_sync = Some(v1::SyncSummary {
                kind: kind(l.kind),
                role: role(l.role),
                completed: l.completed,
                total_bytes: l.total_bytes,
                done_bytes: l.done_bytes,
                transferred_bytes: l.transferred_bytes,
                mismatches: l.mismatches,
                elapsed_ms: l.elapsed.as_millis() as u64,
            });
        }
    }
    if let Some(c) = &d.cache {
        let cs = c.stats();
        let (state, lost) = match cs.state {
            CacheState::Running => ("running", 0),
            CacheState::Failed { lost_blocks } => ("failed", lost_blocks),
            CacheState::Closed => ("closed", 0),
        };
        s.cache = Some(v1::CacheStatus {
            mode: cache_mode(cs.mode) as i32,
            state: state.into(),
            lost_blocks: lost,
            read_hits: cs.read_hits,
            read_misses: cs.read_misses,
            dirty_bytes: cs.dirty_bytes,
            log_bytes: cs.log_bytes,
            destaged_bytes: cs.destaged_bytes,
            occupancy: cs.occupancy,
        });
    }
    s
}

/// A library error as a gRPC status: each kind has one code, so a malformed request
/// (`INVALID_ARGUMENT`) is told apart from one the disk's state refuses
/// (`FAILED_PRECONDITION`).
fn status_from(e: vsan_core::Error) -> Status {
    let m = e.to_string();
    match e.kind() {
        ErrorKind::InvalidArgument => Status::invalid_argument(m),
        ErrorKind::OutOfRange => Status::out_of_range(m),
        ErrorKind::NotFound => Status::not_found(m),
        ErrorKind::NotSupported
        | ErrorKind::ReadOnly
        | ErrorKind::InUse
        | ErrorKind::NoQuorum
        | ErrorKind::WrongState => Status::failed_precondition(m),
        ErrorKind::Closed => Status::unavailable(m),
        ErrorKind::Timeout => Status::deadline_exceeded(m),
        ErrorKind::NoSpace => Status::resource_exhausted(m),
        ErrorKind::Corrupt => Status::data_loss(m),
        // Io, Protocol, and kinds added later: the node's own failure.
        _ => Status::internal(m),
    }
}

impl Service {
    /// Run an action on mirrored disk `name`, log what it did and answer with it.
    async fn act<F, Fut>(
        &self,
        name: &str,
        action: F,
    ) -> Result<Response<v1::ActionResponse>, Status>
    where
        F: FnOnce(vsan_replica::MirroredDisk) -> Fut,
        Fut: std::future::Future<Output = vsan_core::Result<String>>,
    {
        let what = action(self.mirror(name)?).await.map_err(status_from)?;
        info!(disk = %name, "management: {what}");
        done(format!("disk {name}: {what}"))
    }

    fn disk(&self, name: &str) -> Result<NodeDisk, Status> {
        if name.is_empty() {
            return Err(Status::invalid_argument("a disk name is required"));
        }
        self.shared
            .disk(name)
            .ok_or_else(|| Status::not_found(format!("node {} has no disk {name:?}", self.node_id)))
    }

    fn mirror(&self, name: &str) -> Result<vsan_replica::MirroredDisk, Status> {
        self.disk(name)?
            .mirror
            .ok_or_else(|| Status::failed_precondition(format!("disk {name:?} is not mirrored")))
    }
}

fn done(message: impl Into<String>) -> Result<Response<v1::ActionResponse>, Status> {
    Ok(Response::new(v1::ActionResponse {
        message: message.into(),
    }))
}

type StatusStream = Pin<Box<dyn Stream<Item = Result<v1::DiskStatus, Status>> + Send>>;

#[tonic::async_trait]
impl Mgmt for Service {
    async fn list_disks(
        &self,
        _req: Request<v1::ListDisksRequest>,
    ) -> Result<Response<v1::ListDisksResponse>, Status> {
        Ok(Response::new(v1::ListDisksResponse {
            node_id: self.node_id,
            disks: self.shared.disks.read().iter().map(status_of).collect(),
        }))
    }

    async fn get_disk_status(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::DiskStatus>, Status> {
        Ok(Response::new(status_of(
            &self.disk(&req.into_inner().name)?,
        )))
    }

    type WatchDiskStatusStream = StatusStream;

    async fn watch_disk_status(
        &self,
        req: Request<v1::WatchRequest>,
    ) -> Result<Response<StatusStream>, Status> {
        let req = req.into_inner();
        let disk = self.disk(&req.name)?;
        let interval = Duration::from_millis(if req.interval_ms == 0 {
            1000
        } else {
            u64::from(req.interval_ms).clamp(50, 60_000)
        });
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut watch = disk.mirror.as_ref().map(|m| m.watch_status());
            loop {
                if tx.send(Ok(status_of(&disk))).await.is_err() {
                    return;
                }
                let syncing = disk.mirror.as_ref().is_some_and(|m| m.status().syncing);
                // While a pass runs: at least every `interval`; otherwise on a change
                // (or every 10 intervals, which also notices a client that left).
                let wait = if syncing { interval } else { interval * 10 };
                match &mut watch {
                    Some(w) => {
                        tokio::select! {
                            r = w.changed() => if r.is_err() { return },
                            _ = tokio::time::sleep(wait) => {}
                            _ = tx.closed() => return,
                        }
                    }
                    None => {
                        tokio::select! {
                            _ = tokio::time::sleep(wait) => {}
                            _ = tx.closed() => return,
                        }
                    }
                }
            }
        });
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn discard_my_data(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let name = req.into_inner().name;
        self.mirror(&name)?.discard_my_data();
        info!(disk = %name, "management: discard my data (this replica becomes the sync target)");
        done(format!(
            "disk {name}: this node's changes will be discarded; it resyncs from its peer on the next connection"
        ))
    }

    async fn start_verify(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let name = req.into_inner().name;
        self.act(&name, |m| async move {
            m.verify()
                .await
                .map(|()| "online verify started".to_string())
        })
        .await
    }

    async fn cancel_verify(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let name = req.into_inner().name;
        self.act(&name, |m| async move { m.cancel_verify().await })
            .await
    }

    async fn set_resync_rate(
        &self,
        req: Request<v1::SetResyncRateRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let req = req.into_inner();
        let rate = match req.bytes_per_second {
            0 => ResyncRate::Dynamic { max: 0 },
            r => ResyncRate::Fixed(r),
        };
        self.act(&req.name, |m| async move { m.set_resync_rate(rate).await })
            .await
    }

    async fn set_cache_mode(
        &self,
        req: Request<v1::SetCacheModeRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let req = req.into_inner();
        let disk = self.disk(&req.name)?;
        let cache = disk.cache.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!("disk {:?} has no cache", req.name))
        })?;
        let mode = match v1::CacheMode::try_from(req.mode) {
            Ok(v1::CacheMode::WriteBack) => CacheMode::WriteBack,
            Ok(v1::CacheMode::WriteThrough) => CacheMode::WriteThrough,
            Ok(v1::CacheMode::WriteAround) => CacheMode::WriteAround,
            Ok(v1::CacheMode::PassThrough) => CacheMode::PassThrough,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "{} is not a cache mode (write-back, write-through, write-around, \
                     pass-through)",
                    req.mode
                )));
            }
        };
        cache.set_mode(mode).await.map_err(status_from)?;
        info!(disk = %req.name, mode = ?mode, "management: cache mode set");
        done(format!("disk {}: cache mode set to {mode:?}", req.name))
    }

    async fn create_disk(
        &self,
        req: Request<v1::CreateDiskRequest>,
    ) -> Result<Response<v1::DiskStatus>, Status> {
        let req = req.into_inner();
        let d = disk_section(&req)?;
        let _admin = self.shared.admin.lock().await;
        if self.shared.disks.read().iter().any(|x| x.name == d.name) {
            return Err(Status::already_exists(format!("disk {:?} exists", d.name)));
        }
        let disk = create(&self.shared, &d).await?;
        info!(disk = %d.name, size = d.size.0, peer = ?d.peer, nbd = ?disk.nbd.as_ref().map(|n| &n.0),
            "management: disk created");
        Ok(Response::new(status_of(&disk)))
    }

    async fn delete_disk(
        &self,
        req: Request<v1::DeleteDiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let req = req.into_inner();
        let _admin = self.shared.admin.lock().await;
        let disk = self.disk(&req.name)?;
        let what = delete(&self.shared, &disk, req.force, req.remove_files).await?;
        info!(disk = %req.name, force = req.force, "management: disk deleted ({what})");
        done(format!("disk {}: deleted ({what})", req.name))
    }

    async fn detach_local(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let name = req.into_inner().name;
        self.act(&name, |m| async move { m.detach_local().await })
            .await
    }

    async fn attach_local(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let name = req.into_inner().name;
        self.act(&name, |m| async move { m.attach_local().await })
            .await
    }

    async fn declare_current(
        &self,
        req: Request<v1::DiskRequest>,
    ) -> Result<Response<v1::ActionResponse>, Status> {
        let name = req.into_inner().name;
        warn!(disk = %name, "management: an operator declares this replica current");
        self.act(&name, |m| async move { m.declare_current().await })
            .await
    }
}

/// The config section of a disk to create, checked: a name of letters, digits, `.`,
/// `_`, `-`; a size that is a positive multiple of the block size; a backing of "file"
/// or "mem"; a declared peer; an NBD address that parses.
fn disk_section(req: &v1::CreateDiskRequest) -> Result<DiskSection, Status> {
    let name = &req.name;
    if name.is_empty()
        || name.len() > 64
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        || name.starts_with('.')
    {
        return Err(Status::invalid_argument(format!(
            "{name:?} is not a disk name (1 to 64 letters, digits, '.', '_', '-'; not \
             starting with '.')"
        )));
    }
    let mut table = toml::Table::new();
    table.insert("name".into(), name.clone().into());
    let size = i64::try_from(req.size)
        .map_err(|_| Status::invalid_argument(format!("size {} is too large", req.size)))?;
    table.insert("size".into(), size.into());
    let backing = if req.backing.is_empty() {
        "file"
    } else {
        req.backing.as_str()
    };
    table.insert("backing".into(), backing.into());
    if req.peer != 0 {
        table.insert("peer".into(), i64::from(req.peer).into());
    }
    if !req.nbd.is_empty() {
        NbdAddr::parse(&req.nbd)
            .map_err(|e| Status::invalid_argument(format!("nbd: {}", e.context())))?;
        table.insert("nbd".into(), req.nbd.clone().into());
    }
    if !req.vhost_user.is_empty() {
        table.insert("vhost_user".into(), req.vhost_user.clone().into());
    }
    if req.vhost_user_queues != 0 {
        table.insert(
            "vhost_user_queues".into(),
            i64::from(req.vhost_user_queues).into(),
        );
    }
    if req.vhost_user_busy_poll_us != 0 {
        let us = i64::try_from(req.vhost_user_busy_poll_us).unwrap_or(i64::MAX);
        table.insert("vhost_user_busy_poll_us".into(), us.into());
    }
    let d = DiskSection::deserialize(toml::Value::Table(table))
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    d.check_vhost_user()
        .map_err(|(key, why)| Status::invalid_argument(format!("{key}: {why}")))?;
    let bs = u64::from(d.block_size());
    if d.size.0 == 0 || d.size.0 % bs != 0 {
        return Err(Status::invalid_argument(format!(
            "size {} is not a positive multiple of the block size ({bs})",
            d.size.0
        )));
    }
    Ok(d)
}

fn start_error(e: StartError) -> Status {
    match e {
        StartError::Config(m) => Status::invalid_argument(m),
        StartError::AddressInUse(m) => Status::failed_precondition(m),
        StartError::Runtime(m) => Status::failed_precondition(m),
    }
}

/// Create and start disk `d` on the node: image (and metadata), mirror (dialing or
/// registered with the acceptor), NBD export on an address of its own.
async fn create(shared: &Shared, d: &DiskSection) -> Result<NodeDisk, Status> {
    let node = &shared.config.node;
    let peer = match d.peer {
        None => None,
        Some(id) => {
            let Some((i, p)) = shared
                .config
                .peer
                .iter()
                .enumerate()
                .find(|(_, p)| p.id == id)
            else {
                return Err(Status::invalid_argument(format!(
                    "peer {id} is not a [[peer]] of this node's config"
                )));
            };
            if node.id > id && shared.accepting.is_none() {
                return Err(Status::failed_precondition(format!(
                    "node {id} dials this node, which does not listen (node.listen)"
                )));
            }
            Some((i, p))
        }
    };
    // Bind the NBD address first: a busy one refuses the creation before any file is
    // made.
    let nbd = match &d.nbd {
        None => None,
        Some(a) => {
            let addr = NbdAddr::parse(a).map_err(|e| Status::invalid_argument(e.context()))?;
            let l = super::start::bind(&addr).await.map_err(|e| {
                Status::failed_precondition(format!("cannot listen on {addr}: {e}"))
            })?;
            Some((addr, l))
        }
    };
    // A vhost-user socket path that is taken (another disk's socket, any file that is
    // not a stale socket) refuses the creation before any file is made, too.
    #[cfg(target_os = "linux")]
    if let Some(path) = &d.vhost_user {
        vsan_core::export::check_socket_path(path).map_err(|e| {
            Status::failed_precondition(format!("cannot bind vhost-user socket: {e}"))
        })?;
    }
    if d.peer.is_some() && d.backing == Backing::File {
        let meta = node.data_dir.join(format!("{}.meta", d.name));
        if meta.exists() && !d.image_path(&node.data_dir).exists() {
            return Err(Status::failed_precondition(format!(
                "the metadata {} exists but the image does not: remove it to create the disk anew",
                meta.display()
            )));
        }
    }
    let local = super::start::open_disk(0, d, &node.data_dir).map_err(start_error)?;
    let mut created = Created::default();
    let mirror = match peer {
        None => None,
        Some((i, p)) => {
            let cfg = super::start::mirror_config(node, d, p.id, local.geometry(), shared.quorum);
            let chunk = d.bitmap_chunk.map_or(DEFAULT_CHUNK_SIZE, |c| c.0);
            let replica =
                super::start::open_replica(d, &node.data_dir, &cfg, chunk, Arc::clone(&local))
                    .await
                    .map_err(start_error)?;
            let disk = MirroredDisk::start(cfg, replica, shared.witness.clone())
                .map_err(|e| Status::internal(e.to_string()))?;
            if node.id < p.id {
                let dialer = {
                    let mut dialers = shared.dialers.lock();
                    match dialers.get(&p.id) {
                        Some(t) => Arc::clone(t),
                        None => {
                            let t = transports::build(p, i, node.id, &node.data_dir)
                                .map_err(|e| Status::failed_precondition(e.context()))?;
                            dialers.insert(p.id, Arc::clone(&t.dial));
                            t.dial
                        }
                    }
                };
                created.dial = Some(tokio::spawn(dial_loop(
                    dialer,
                    p.address.clone(),
                    disk.clone(),
                )));
            } else if let Some(reg) = &shared.accepting {
                reg.write().insert(d.name.clone(), disk.clone());
            }
            Some(disk)
        }
    };
    let device: Arc<dyn BlockDevice> = match &mirror {
        Some(m) => Arc::new(m.clone()),
        None => local,
    };
    // Counted where clients enter the disk, as the config's disks are.
    let device = match &shared.meters {
        Some(m) => m.wrap(&d.name, device),
        None => device,
    };
    let mut nd = NodeDisk {
        name: d.name.clone(),
        device: Arc::clone(&device),
        mirror,
        peer_id: d.peer,
        transport: peer.map(|(_, p)| p.transport.word().to_string()),
        nbd: None,
        iscsi: None,
        #[cfg(target_os = "linux")]
        vhost_user: None,
        cache: None,
    };
    #[cfg(target_os = "linux")]
    if let Some(path) = &d.vhost_user {
        match super::start::vhost_user_export(d, path, Arc::clone(&device)) {
            Ok(e) => nd.vhost_user = Some(Arc::new(e)),
            Err(e) => {
                // (Raced by another server since the check above.)
                created.abort();
                if let Some(reg) = &shared.accepting {
                    reg.write().remove(&d.name);
                }
                return Err(Status::failed_precondition(e.context()));
            }
        }
    }
    if let Some((addr, listener)) = nbd {
        let server = Server::new(vec![
            Export::new(&d.name, device).with_description(format!("vsan disk {}", d.name)),
        ])
        .map_err(|e| Status::internal(e.to_string()))?;
        let (shown, task) = match listener {
            super::start::Listener::Tcp(l) => {
                let shown = l
                    .local_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| addr.to_string());
                let s = server.clone();
                (shown, tokio::spawn(async move { s.serve_tcp(l).await }))
            }
            super::start::Listener::Unix(l, path) => {
                let s = server.clone();
                created.socket = Some(path.clone());
                (
                    format!("unix:{}", path.display()),
                    tokio::spawn(async move { s.serve_unix(l).await }),
                )
            }
        };
        nd.nbd = Some((shown, server.clone()));
        created.nbd = Some((task, server));
    }
    shared.disks.write().push(nd.clone());
    shared.created.lock().insert(d.name.clone(), created);
    Ok(nd)
}

/// Delete `disk` from the node: its NBD service and iSCSI portal stop (refused while
/// clients or sessions are connected unless `force`, and when another disk shares them), its mirror link stops, it is flushed and closed, and with
/// `remove_files` its image and metadata are removed. Returns what was done.
async fn delete(
    shared: &Shared,
    disk: &NodeDisk,
    force: bool,
    remove_files: bool,
) -> Result<String, Status> {
    let name = &disk.name;
    if let Some(t) = &disk.iscsi {
        let others: Vec<&str> = t
            .server
            .targets()
            .iter()
            .map(|x| x.name())
            .filter(|n| *n != t.target)
            .collect();
        if !others.is_empty() {
            return Err(Status::failed_precondition(format!(
                "disk {name} shares its iSCSI portal {} with targets {}: delete them \
                 together by editing the config",
                t.portal,
                others.join(", ")
            )));
        }
        let sessions = t.sessions().len();
        if sessions > 0 && !force {
            return Err(Status::failed_precondition(format!(
                "disk {name} has {sessions} iSCSI session(s) on {}; log them out or delete \
                 with force",
                t.portal
            )));
        }
    }
    #[cfg(target_os = "linux")]
    if let Some(e) = &disk.vhost_user {
        if e.status().connected && !force {
            return Err(Status::failed_precondition(format!(
                "disk {name} has a vhost-user front end connected on {}; stop the VM or \
                 delete with force",
                e.path().display()
            )));
        }
    }
    if let Some((addr, server)) = &disk.nbd {
        let others: Vec<String> = server
            .exports()
            .map(|e| e.name().to_string())
            .filter(|n| n != name)
            .collect();
        if !others.is_empty() {
            return Err(Status::failed_precondition(format!(
                "disk {name} shares its NBD address {addr} with {}: delete them together by \
                 editing the config",
                others.join(", ")
            )));
        }
        let clients = server.open_connections();
        if clients > 0 && !force {
            return Err(Status::failed_precondition(format!(
                "disk {name} has {clients} NBD client(s) connected on {addr}; disconnect them \
                 or delete with force"
            )));
        }
        server.shutdown();
        if tokio::time::timeout(Duration::from_secs(10), server.wait_idle())
            .await
            .is_err()
        {
            warn!(disk = %name, "NBD clients did not finish within 10 s; closing them");
        }
    }
    #[cfg(target_os = "linux")]
    if let Some(e) = &disk.vhost_user {
        // Its requests in flight complete first (off the runtime's threads).
        let e = Arc::clone(e);
        let _ = tokio::task::spawn_blocking(move || e.shutdown()).await;
    }
    if let Some(t) = &disk.iscsi {
        t.server.shutdown();
        if tokio::time::timeout(Duration::from_secs(10), t.server.wait_idle())
            .await
            .is_err()
        {
            warn!(disk = %name, "iSCSI sessions did not finish within 10 s; closing them");
        }
    }
    let created = shared.created.lock().remove(name);
    if let Some(c) = &created {
        c.abort();
    }
    if let Some(reg) = &shared.accepting {
        reg.write().remove(name);
    }
    shared.disks.write().retain(|d| d.name != *name);
    if let Some(m) = &shared.meters {
        m.forget(name);
    }
    let mut problems = Vec::new();
    if let Err(e) = disk.device.flush().await {
        problems.push(format!("final flush failed: {e}"));
    }
    if let Some(m) = &disk.mirror
        && let Err(e) = m.close().await
    {
        problems.push(format!("closing the mirror failed: {e}"));
    }
    if let Some(c) = &disk.cache
        && let Err(e) = c.close().await
    {
        problems.push(format!("closing the cache failed: {e}"));
    }
    if let Some(path) = created.and_then(|c| c.socket) {
        let _ = std::fs::remove_file(path);
    }
    let mut what = vec!["stopped".to_string()];
    if remove_files {
        let node = &shared.config.node;
        let d = shared.config.disk.iter().find(|d| d.name == *name);
        let image = match d {
            Some(d) => d.image_path(&node.data_dir),
            None => node.data_dir.join(format!("{name}.img")),
        };
        for path in [image, node.data_dir.join(format!("{name}.meta"))] {
            match std::fs::remove_file(&path) {
                Ok(()) => what.push(format!("removed {}", path.display())),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => problems.push(format!("cannot remove {}: {e}", path.display())),
            }
        }
    }
    if !problems.is_empty() {
        return Err(Status::internal(format!(
            "disk {name} was removed from the node, but: {}",
            problems.join("; ")
        )));
    }
    Ok(what.join(", "))
}
