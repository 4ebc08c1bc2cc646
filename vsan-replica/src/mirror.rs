//! `MirroredDisk`: the [`BlockDevice`] callers use, and the tokio task that drives the
//! protocol [`Endpoint`] for it.
//!
//! ```text
//!  callers ──(read/write/flush)──> MirroredDisk ──commands──> driver task
//!                                                               │ owns Endpoint
//!                 local replica (Arc<dyn BlockDevice>) <── LocalIo ┤
//!                 peer link (LinkTx / LinkRx)          <── Message ┘
//! ```
//!
//! The driver is the only place that awaits: it feeds the endpoint caller requests,
//! peer messages, local I/O completions and timer expiries, and carries out what the
//! endpoint asks (send, run local I/O, complete requests, drop the link).
//!
//! A local replica that loses acknowledged data (a write-back cache whose fast device
//! failed) says so through [`BlockDevice::data_loss_count`], which it bumps before it
//! completes anything that could show the loss. The driver looks at the count on every
//! turn and before it hands the endpoint any local completion, and tells the endpoint
//! first ([`Endpoint::local_data_lost`]): so no read of lost data reaches a caller.

use std::collections::VecDeque;

use crate::protocol::fastmap::FastMap;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};
use vsan_core::{BlockDevice, Error, ErrorKind, Geometry, IoFlags, IoFuture, Op, Result};

use crate::meta::{self, Loaded, MetaParams};
use crate::protocol::{
    Config, Endpoint, Event, Freshness, Generations, LinkState, LocalIo, LocalOpId, LocalResult,
    Message, RequestId, ResyncRate, SyncKind, SyncProgress, SyncRole, SyncSummary, WritePayload,
};
use crate::transport::{Link, LinkRx, LinkTx};
use crate::witness::WitnessClient;

type Reply = oneshot::Sender<std::result::Result<Option<Bytes>, ErrorKind>>;

enum Command {
    Write {
        offset: u64,
        payload: WritePayload,
        fua: bool,
        done: Reply,
    },
    Flush {
        done: Reply,
    },
    Read {
        offset: u64,
        len: u32,
        done: Reply,
    },
    /// A new link to the peer; `first` is a message already read from it (the acceptor
    /// reads the peer's Hello to learn which disk the link is for).
    Attach {
        link: Link,
        first: Option<Message>,
    },
    /// Start an online verify from this node.
    Verify {
        done: oneshot::Sender<Result<()>>,
    },
    /// Discard this node's data in a split brain (on the next handshake).
    DiscardMyData,
    /// An operator's action; answers what was done or why not.
    Operator {
        action: Operator,
        done: OperatorReply,
    },
    /// Finish in-flight I/O, mark the metadata clean, stop.
    Close {
        done: oneshot::Sender<Result<()>>,
    },
}

/// Where the answer to an operator's action goes: what was done, or why not.
type OperatorReply = oneshot::Sender<Result<String>>;

/// What an operator may ask of a running mirror (see the [`MirroredDisk`] methods).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operator {
    CancelVerify,
    SetRate(ResyncRate),
    DetachLocal,
    AttachLocal,
    DeclareCurrent,
}

/// What the driver asks of its witness worker, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WitnessRequest {
    /// Ask for the disk until it is granted (or a newer request comes).
    Claim,
    /// Give the disk back.
    Release,
}

/// A replica: its data device, its metadata device, and the metadata read from it.
pub struct Replica {
    /// The data.
    pub data: Arc<dyn BlockDevice>,
    /// The metadata area (`data_dir/<name>.meta` on a node).
    pub meta: Arc<dyn BlockDevice>,
    /// What `meta::open` / `meta::create` read or wrote.
    pub loaded: Loaded,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("superblock", &self.loaded.superblock)
            .finish_non_exhaustive()
    }
}

impl Replica {
    /// A replica over `data` with fresh metadata in memory (tests, demos): it forgets
    /// everything when the process ends.
    pub async fn with_memory_meta(cfg: &Config, data: Arc<dyn BlockDevice>) -> Result<Replica> {
        let params = meta_params(cfg, meta::DEFAULT_CHUNK_SIZE);
        let layout = meta::Layout::checked(cfg.size, params.chunk_size, cfg.block_size)?;
        let dev: Arc<dyn BlockDevice> = Arc::new(vsan_core::MemDevice::new(Geometry::new(
            layout.total_len(),
            512,
        )?));
        let loaded = meta::create(dev.as_ref(), &params).await?;
        Ok(Replica {
            data,
            meta: dev,
            loaded,
        })
    }
}

/// The metadata parameters that belong to a mirror config.
pub fn meta_params(cfg: &Config, chunk_size: u64) -> MetaParams {
    MetaParams {
        disk_id: cfg.disk_id,
        disk_name: cfg.disk_name.clone(),
        node_id: cfg.node_id,
        peer_id: cfg.peer_id,
        size: cfg.size,
        block_size: cfg.block_size,
        chunk_size,
    }
}

/// What a mirrored disk reports about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorStatus {
    /// The link to the peer.
    pub link: LinkState,
    /// Whether a link is attached right now (handshaking or connected).
    pub link_attached: bool,
    /// The transport carrying the attached link ("tcp", "quic", "loopback", "shm",
    /// "tcp*4" (four lanes), ...; see [`LinkTx::transport`](crate::transport::LinkTx::transport)):
    /// where a transport fell back to another (RDMA to TCP), the one in use.
    pub link_transport: Option<Arc<str>>,
    /// The local replica failed and I/O goes through the peer.
    pub local_detached: bool,
    /// This replica has writes the peer lacks (a resync is needed before mirroring).
    pub diverged: bool,
    /// The last refusal or loss reason, if any.
    pub last_problem: Option<String>,
    /// Chunks this replica's bitmap marks out of sync.
    pub dirty_chunks: u64,
    /// This replica's generation ids.
    pub generations: Generations,
    /// An unfinished sync target: not usable without the peer.
    pub inconsistent: bool,
    /// A resync or verify is running (see [`MirroredDisk::sync_progress`]).
    pub syncing: bool,
    /// The last resync or verify that started (it may have ended since).
    pub last_sync_start: Option<SyncStart>,
    /// How the last resync or verify ended.
    pub last_sync: Option<SyncSummary>,
    /// With a witness: whether this node may serve I/O without its peer.
    pub quorum: Option<bool>,
    /// Requests are held until quorum or the peer returns.
    pub suspended: bool,
    /// How many times the local replica reported losing data it had acknowledged
    /// (its [`BlockDevice::data_loss_count`] grew) since this disk started; each time it
    /// was resynced from the peer or detached (see `last_problem`).
    pub local_data_lost: u64,
    /// Whether the local replica is proven current since this disk started: while it is
    /// [`Freshness::Unproven`], nothing is served from it (requests wait for the proof,
    /// bounded by the connect timeout, and never get stale data).
    pub freshness: Freshness,
    /// While unproven: since when (the disk's start).
    pub unproven_since: Option<SystemTime>,
}

impl MirrorStatus {
    /// [`MirrorStatus::unproven_since`] in milliseconds since the Unix epoch; 0 when
    /// the replica is proven current.
    pub fn unproven_since_unix_ms(&self) -> u64 {
        self.unproven_since.map_or(0, |t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64)
        })
    }
}

/// A resync or verify that started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncStart {
    /// Counts the starts of this disk's driver (1 for the first).
    pub number: u64,
    /// This node's role.
    pub role: SyncRole,
    /// The kind of pass.
    pub kind: SyncKind,
    /// Bytes to go through.
    pub total_bytes: u64,
}

/// A two-way synchronously mirrored disk (protocol C). Cheap to clone.
#[derive(Clone)]
pub struct MirroredDisk {
    name: Arc<str>,
    geometry: Geometry,
    commands: mpsc::UnboundedSender<Command>,
    status: watch::Receiver<MirrorStatus>,
    progress: Arc<parking_lot::Mutex<Option<SyncProgress>>>,
}

impl std::fmt::Debug for MirroredDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirroredDisk")
            .field("name", &self.name)
            .field("geometry", &self.geometry)
            .field("status", &*self.status.borrow())
            .finish()
    }
}

impl MirroredDisk {
    /// Mirror `replica` with the peer described by `cfg`; spawns the driver on the
    /// current tokio runtime. Requests are accepted at once, but nothing is served from
    /// the replica until it is proven current ([`MirrorStatus::freshness`]): by the
    /// handshake with the peer, the witness's grant (when `witness` is given and
    /// `cfg.quorum` is set), [`MirroredDisk::declare_current`], or `cfg.startup`'s
    /// policy once `cfg.connect_timeout` passes; a replica whose metadata says it went on
    /// alone before it stopped serves at once.
    pub fn start(
        cfg: Config,
        replica: Replica,
        witness: Option<WitnessClient>,
    ) -> Result<MirroredDisk> {
        let local = replica.data;
        let geometry = local.geometry();
        if geometry.size() != cfg.size || geometry.block_size() != cfg.block_size {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "disk {}: local replica is {} bytes in {}-byte blocks, the mirror config says {} in {}",
                    cfg.disk_name,
                    geometry.size(),
                    geometry.block_size(),
                    cfg.size,
                    cfg.block_size
                ),
            ));
        }
        let sb = &replica.loaded.superblock;
        if sb.size != cfg.size || sb.disk_id != cfg.disk_id || sb.node_id != cfg.node_id {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "disk {}: the metadata describes another replica (disk {:?}, node {}, {} bytes)",
                    cfg.disk_name, sb.disk_name, sb.node_id, sb.size
                ),
            ));
        }
        if cfg.quorum.is_some() && witness.is_none() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("disk {}: a quorum policy needs a witness", cfg.disk_name),
            ));
        }
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::new(
                ErrorKind::NotSupported,
                "MirroredDisk::start needs a tokio runtime",
            )
        })?;
        let name: Arc<str> = cfg.disk_name.as_str().into();
        #[cfg(feature = "failpoints")]
        let points = crate::failpoints::Site::new(cfg.node_id, &replica.loaded.layout);
        let (commands, rx) = mpsc::unbounded_channel();
        let endpoint = Endpoint::new(cfg, replica.loaded, Instant::now());
        // A replica that lost data before the mirror started is no more trusted than one
        // that loses it later: the first turn sees the count above 0 and resyncs it.
        let data_loss_base = 0;
        let started = SystemTime::now();
        let (status_tx, status) = watch::channel(status_of(
            &endpoint,
            Observed {
                started,
                ..Observed::default()
            },
        ));
        let progress = Arc::new(parking_lot::Mutex::new(None));
        let (quorum_tx, quorum_rx) = mpsc::unbounded_channel();
        let witness_tx = witness.map(|w| {
            let (tx, rx) = mpsc::unbounded_channel();
            handle.spawn(witness_worker(w, name.to_string(), rx, quorum_tx.clone()));
            tx
        });
        let driver = Driver {
            name: Arc::clone(&name),
            ep: endpoint,
            local,
            meta: replica.meta,
            status: status_tx,
            progress: Arc::clone(&progress),
            witness: witness_tx,
            quorum_tx,
            closing: Vec::new(),
            stale_events: VecDeque::new(),
            operator_replies: Vec::new(),
            last_progress_log: Instant::now(),
            last_sync_start: None,
            waiters: FastMap::default(),
            tx: None,
            rx: None,
            link_transport: Arc::from(""),
            sending: None,
            backlog: VecDeque::new(),
            running: FuturesUnordered::new(),
            last_problem: None,
            data_loss_base,
            data_loss_seen: data_loss_base,
            started,
            #[cfg(feature = "failpoints")]
            points,
        };
        handle.spawn(driver.run(rx, quorum_rx));
        Ok(MirroredDisk {
            name,
            geometry,
            commands,
            status,
            progress,
        })
    }

    /// Where a running resync or verify stands (percent, bytes left, rate, ETA).
    pub fn sync_progress(&self) -> Option<SyncProgress> {
        *self.progress.lock()
    }

    /// Start an online verify from this node (it must be connected and in sync); chunks
    /// that differ are repaired from this node. Watch [`MirrorStatus::last_sync`] for
    /// the result.
    pub async fn verify(&self) -> Result<()> {
        let (done, rx) = oneshot::channel();
        let _ = self.commands.send(Command::Verify { done });
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(why.context_prefix(format!("disk {}: cannot verify", self.name))),
            Err(_) => Err(self.stopped()),
        }
    }

    /// Resolve a split brain by discarding this node's changes: on the next connection
    /// this replica becomes the sync target. Drops the current link so the handshake
    /// runs again.
    pub fn discard_my_data(&self) {
        let _ = self.commands.send(Command::DiscardMyData);
    }

    async fn operate(&self, action: Operator) -> Result<String> {
        let (done, rx) = oneshot::channel();
        if self
            .commands
            .send(Command::Operator { action, done })
            .is_err()
        {
            return Err(self.stopped());
        }
        match rx.await {
            Ok(Ok(what)) => Ok(what),
            Ok(Err(why)) => Err(why.context_prefix(format!("disk {}", self.name))),
            Err(_) => Err(self.stopped()),
        }
    }

    /// Stop the online verify this node runs (chunks it found different stay marked
    /// and are copied at the next resync). Fails (`WrongState`, with the reason)
    /// when no verify from this node runs.
    pub async fn cancel_verify(&self) -> Result<String> {
        self.operate(Operator::CancelVerify).await
    }

    /// Change the resync rate of this node's resyncs, effective at once.
    pub async fn set_resync_rate(&self, rate: ResyncRate) -> Result<String> {
        self.operate(Operator::SetRate(rate)).await
    }

    /// Detach the local replica on purpose (to replace its disk, say): I/O is served
    /// through the peer. Needs the peer connected and no resync running.
    pub async fn detach_local(&self) -> Result<String> {
        self.operate(Operator::DetachLocal).await
    }

    /// Attach a detached local replica again: it is resynced in full from the peer by
    /// checksum (it missed every write since it was detached), serving reads of chunks
    /// not synced yet through the peer. Needs the peer connected.
    pub async fn attach_local(&self) -> Result<String> {
        self.operate(Operator::AttachLocal).await
    }

    /// The operator's word that this node's unproven replica is current: it serves
    /// alone (degraded) until the peer connects, logged as a risk. Only for a node whose
    /// peer is known to be behind (or gone for good): writes the peer acknowledged
    /// alone are not here, and the replicas split. Refused when the replica is proven
    /// already, is an unfinished sync target, or a handshake is deciding. With a witness
    /// the quorum policy still decides whether it may serve alone.
    pub async fn declare_current(&self) -> Result<String> {
        self.operate(Operator::DeclareCurrent).await
    }

    /// Finish in-flight requests, flush, mark the metadata clean (so a restart does not
    /// resync the activity log), and stop the driver.
    pub async fn close(&self) -> Result<()> {
        let (done, rx) = oneshot::channel();
        if self.commands.send(Command::Close { done }).is_err() {
            return Err(self.stopped());
        }
        rx.await.map_err(|_| self.stopped())?
    }

    fn stopped(&self) -> Error {
        Error::new(
            ErrorKind::Closed,
            format!("disk {}: mirror driver has stopped", self.name),
        )
    }

    /// The disk's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Hand the driver a link to the peer (replacing any link it has).
    pub fn attach(&self, link: Link, first: Option<Message>) {
        let _ = self.commands.send(Command::Attach { link, first });
    }

    /// The current status.
    pub fn status(&self) -> MirrorStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change.
    pub fn watch_status(&self) -> watch::Receiver<MirrorStatus> {
        self.status.clone()
    }

    fn request(&self, make: impl FnOnce(Reply) -> Command) -> IoFuture<'_, Option<Bytes>> {
        let (done, rx) = oneshot::channel();
        let sent = self.commands.send(make(done));
        let name = Arc::clone(&self.name);
        Box::pin(async move {
            if sent.is_err() {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("disk {name}: mirror driver has stopped"),
                ));
            }
            match rx.await {
                Ok(Ok(data)) => Ok(data),
                Ok(Err(kind)) => Err(Error::new(
                    kind,
                    format!("disk {name}: mirrored I/O failed"),
                )),
                Err(_) => Err(Error::new(
                    ErrorKind::Closed,
                    format!("disk {name}: mirror driver has stopped"),
                )),
            }
        })
    }

    fn write_payload(
        &self,
        op: Op,
        offset: u64,
        payload: WritePayload,
        flags: IoFlags,
    ) -> IoFuture<'_, ()> {
        if let Err(e) = self.geometry.validate(op, offset, payload.len()) {
            return Box::pin(std::future::ready(Err(e)));
        }
        let fua = flags.contains(IoFlags::FUA);
        let fut = self.request(|done| Command::Write {
            offset,
            payload,
            fua,
            done,
        });
        Box::pin(async move { fut.await.map(drop) })
    }
}

impl BlockDevice for MirroredDisk {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        if let Err(e) = self.geometry.validate(Op::Read, offset, len as u64) {
            return Box::pin(std::future::ready(Err(e)));
        }
        let fut = self.request(|done| Command::Read {
            offset,
            len: len as u32,
            done,
        });
        Box::pin(async move { fut.await.map(Option::unwrap_or_default) })
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_payload(Op::Write, offset, WritePayload::Data(data), flags)
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        let fut = self.request(|done| Command::Flush { done });
        Box::pin(async move { fut.await.map(drop) })
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_payload(Op::Discard, offset, WritePayload::Discard { len }, flags)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_payload(Op::WriteZeroes, offset, WritePayload::Zeroes { len }, flags)
    }
}

type LocalFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = (LocalOpId, LocalResult)> + Send>>;

/// What the driver knows beside the endpoint, for the status.
struct Observed {
    syncing: bool,
    link_transport: Option<Arc<str>>,
    last_problem: Option<String>,
    last_sync_start: Option<SyncStart>,
    local_data_lost: u64,
    started: SystemTime,
}

impl Default for Observed {
    fn default() -> Observed {
        Observed {
            syncing: false,
            link_transport: None,
            last_problem: None,
            last_sync_start: None,
            local_data_lost: 0,
            started: SystemTime::UNIX_EPOCH,
        }
    }
}

fn status_of(ep: &Endpoint, o: Observed) -> MirrorStatus {
    let Observed {
        syncing,
        link_transport,
        last_problem,
        last_sync_start,
        local_data_lost,
        started,
    } = o;
    let freshness = ep.freshness();
    MirrorStatus {
        link: ep.state(),
        link_attached: link_transport.is_some(),
        link_transport,
        local_detached: ep.is_detached(),
        diverged: ep.is_diverged(),
        last_problem,
        dirty_chunks: ep.dirty_chunks(),
        generations: ep.generations(),
        inconsistent: ep.is_inconsistent(),
        syncing,
        last_sync_start,
        last_sync: ep.last_sync(),
        quorum: ep.has_quorum(),
        suspended: ep.quorum_suspended(),
        local_data_lost,
        freshness,
        unproven_since: (!freshness.is_current()).then_some(started),
    }
}

struct Driver {
    name: Arc<str>,
    ep: Endpoint,
    local: Arc<dyn BlockDevice>,
    meta: Arc<dyn BlockDevice>,
    status: watch::Sender<MirrorStatus>,
    progress: Arc<parking_lot::Mutex<Option<SyncProgress>>>,
    /// Requests to the witness worker (none without a witness).
    witness: Option<mpsc::UnboundedSender<WitnessRequest>>,
    /// Quorum answers come back here (the worker's own sender, or none).
    quorum_tx: mpsc::UnboundedSender<bool>,
    closing: Vec<oneshot::Sender<Result<()>>>,
    /// Events the endpoint raised for a link already replaced: handled without retiring
    /// the link that replaced it.
    stale_events: VecDeque<Event>,
    /// Answers to operator actions, sent once the status shows their effect.
    operator_replies: Vec<(OperatorReply, Result<String>)>,
    last_progress_log: Instant,
    last_sync_start: Option<SyncStart>,
    waiters: FastMap<RequestId, Reply>,
    tx: Option<Arc<dyn LinkTx>>,
    rx: Option<Box<dyn LinkRx>>,
    /// The attached link's transport, for status.
    link_transport: Arc<str>,
    /// The send the link could not take at once (its queue is full); later messages
    /// wait in `backlog`. The driver never blocks on the link: a peer that stops reading
    /// must not stop local I/O or the peer timeout.
    sending: Option<SendFuture>,
    backlog: VecDeque<Message>,
    running: FuturesUnordered<LocalFuture>,
    last_problem: Option<String>,
    /// The local replica's `data_loss_count` when the driver started, and when it last
    /// looked.
    data_loss_base: u64,
    data_loss_seen: u64,
    /// When this disk started (an unproven replica is unproven since then).
    started: SystemTime,
    /// Where this driver's fail points fire (see [`crate::failpoints`]).
    #[cfg(feature = "failpoints")]
    points: crate::failpoints::Site,
}

type SendFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

fn send_future(tx: &Arc<dyn LinkTx>, msgs: Vec<Message>) -> SendFuture {
    let tx = Arc::clone(tx);
    Box::pin(async move { tx.send_batch(msgs).await })
}

impl Driver {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut quorum: mpsc::UnboundedReceiver<bool>,
    ) {
        // Once every handle is gone, finish what is in flight, then stop.
        let mut handles_gone = false;
        loop {
            self.check_data_loss();
            self.drain().await;
            if (handles_gone || !self.closing.is_empty())
                && self.ep.is_shut_down()
                && self.running.is_empty()
            {
                break;
            }
            let deadline = self.ep.poll_timeout().map(tokio::time::Instant::from_std);
            tokio::select! {
                cmd = commands.recv(), if !handles_gone => match cmd {
                    Some(cmd) => self.command(cmd),
                    None => {
                        handles_gone = true;
                        self.ep.begin_shutdown(Instant::now());
                    }
                },
                Some(granted) = quorum.recv() => self.ep.handle_quorum(Instant::now(), granted),
                msg = recv(&mut self.rx) => match msg {
                    Ok(m) => self.peer_message(m),
                    Err(e) => {
                        let reason = e.to_string();
                        self.drop_link();
                        self.ep.handle_disconnected(Instant::now(), &reason);
                    }
                },
                r = poll_sending(&mut self.sending), if self.sending.is_some() => {
                    self.sending = None;
                    self.sent(r);
                }
                Some((op, res)) = self.running.next(), if !self.running.is_empty() => {
                    self.local_done(op, res);
                }
                _ = sleep_until(deadline) => self.ep.handle_timeout(Instant::now()),
            }
            // Take everything else that is ready too, so one turn (and one batch of
            // frames) serves many requests instead of one.
            if !handles_gone {
                while let Ok(cmd) = commands.try_recv() {
                    self.command(cmd);
                }
            }
            while self.rx.is_some() {
                let ready = {
                    let mut next = std::pin::pin!(recv(&mut self.rx));
                    poll_once(&mut next).await
                };
                match ready {
                    Poll::Pending => break,
                    Poll::Ready(Ok(m)) => self.peer_message(m),
                    Poll::Ready(Err(e)) => {
                        let reason = e.to_string();
                        self.drop_link();
                        self.ep.handle_disconnected(Instant::now(), &reason);
                    }
                }
            }
            while !self.running.is_empty() {
                let ready = {
                    let mut next = self.running.next();
                    poll_once(&mut next).await
                };
                match ready {
                    Poll::Ready(Some((op, res))) => self.local_done(op, res),
                    _ => break,
                }
            }
        }
        self.retire_link();
        // Dropping the sender stops the witness worker once it is idle.
        self.witness = None;
        let failed = self.ep.meta_failed();
        for done in self.closing.drain(..) {
            let result = if failed {
                Err(Error::new(
                    ErrorKind::Io,
                    format!(
                        "disk {}: the metadata could not be written; it is not marked clean",
                        self.name
                    ),
                ))
            } else {
                Ok(())
            };
            let _ = done.send(result);
        }
    }

    /// Tell the endpoint if the local replica lost data since the last look.
    fn check_data_loss(&mut self) {
        let count = self.local.data_loss_count();
        if count > self.data_loss_seen {
            info!(
                disk = %self.name,
                "the local replica reports lost data ({} time(s) since start)",
                count - self.data_loss_base
            );
            self.data_loss_seen = count;
            self.ep.local_data_lost(Instant::now());
        }
    }

    /// A message from the peer (fail point `mirror::recv_ack` may drop an ack).
    fn peer_message(&mut self, m: Message) {
        #[cfg(feature = "failpoints")]
        if self.points.ack_lost(&m) {
            return;
        }
        self.ep.handle_message(Instant::now(), m);
    }

    /// A local operation finished. The replica bumps its loss count before it completes
    /// anything that could show lost data, so looking first means the endpoint never
    /// takes such a result for good.
    fn local_done(&mut self, op: LocalOpId, res: LocalResult) {
        self.check_data_loss();
        self.ep.handle_local_done(Instant::now(), op, res);
    }

    fn command(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
            Command::Write {
                offset,
                payload,
                fua,
                done,
            } => {
                let r = self.ep.submit_write(now, offset, payload, fua);
                self.waiters.insert(r, done);
            }
            Command::Flush { done } => {
                let r = self.ep.submit_flush(now);
                self.waiters.insert(r, done);
            }
            Command::Read { offset, len, done } => {
                let r = self.ep.submit_read(now, offset, len);
                self.waiters.insert(r, done);
            }
            Command::Attach { link, first } => {
                if self.tx.is_some() {
                    self.drop_link();
                    self.ep.handle_disconnected(now, "replaced by a new link");
                }
                // What the endpoint raised so far belongs to the old link, also when
                // that link's loss was handled earlier in this same turn (its events are
                // not drained yet): do not let it retire the new one, and do not send
                // the old link's messages on it.
                while let Some(ev) = self.ep.poll_event() {
                    self.stale_events.push_back(ev);
                }
                while self.ep.poll_transmit().is_some() {}
                info!(
                    peer = link.peer(),
                    transport = link.transport(),
                    "link to the peer attached"
                );
                if *self.link_transport != *link.transport() {
                    self.link_transport = Arc::from(link.transport());
                }
                let (tx, rx) = link.into_split();
                self.tx = Some(Arc::from(tx));
                self.rx = Some(rx);
                self.ep.handle_connected(now);
                if let Some(m) = first {
                    self.ep.handle_message(now, m);
                }
            }
            Command::Verify { done } => {
                let _ = done.send(self.ep.start_verify(now));
            }
            Command::Operator { action, done } => {
                let r = match action {
                    Operator::CancelVerify => self.ep.cancel_verify(now),
                    Operator::SetRate(rate) => Ok(self.ep.set_resync_rate(now, rate)),
                    Operator::DetachLocal => self.ep.detach_local(now),
                    Operator::AttachLocal => self.ep.attach_local(now),
                    Operator::DeclareCurrent => self.ep.declare_current(now),
                };
                self.operator_replies.push((done, r));
            }
            Command::DiscardMyData => {
                self.ep.discard_my_data();
                if self.tx.is_some() {
                    self.drop_link();
                    self.ep
                        .handle_disconnected(now, "operator asked to discard this node's data");
                }
            }
            Command::Close { done } => {
                self.ep.begin_shutdown(now);
                self.closing.push(done);
            }
        }
    }

    /// Ask the witness for the disk until it grants it (or the peer is back).
    fn claim_quorum(&mut self) {
        match &self.witness {
            Some(w) => {
                let _ = w.send(WitnessRequest::Claim);
            }
            None => {
                let _ = self.quorum_tx.send(false);
            }
        }
    }

    fn release_quorum(&mut self) {
        if let Some(w) = &self.witness {
            let _ = w.send(WitnessRequest::Release);
        }
    }

    fn drop_link(&mut self) {
        self.tx = None;
        self.rx = None;
        self.sending = None;
        self.backlog.clear();
    }

    /// Hand the link every message it takes without waiting.
    async fn pump_sends(&mut self) {
        while let Some(tx) = &self.tx {
            if self.sending.is_none() {
                if self.backlog.is_empty() {
                    return;
                }
                // Everything queued goes to the link in one batch (one write).
                let batch: Vec<Message> = self.backlog.drain(..).collect();
                self.sending = Some(send_future(tx, batch));
            }
            let Some(fut) = self.sending.as_mut() else {
                return;
            };
            match poll_once(fut).await {
                Poll::Pending => return,
                Poll::Ready(r) => {
                    self.sending = None;
                    self.sent(r);
                }
            }
        }
    }

    fn sent(&mut self, r: Result<()>) {
        if let Err(e) = r {
            let reason = e.to_string();
            self.drop_link();
            self.ep.handle_disconnected(Instant::now(), &reason);
        }
    }

    /// Close the link in the background, after what is queued (a Refuse, say) is sent.
    fn retire_link(&mut self) {
        self.rx = None;
        let (Some(tx), sending, backlog) = (
            self.tx.take(),
            self.sending.take(),
            std::mem::take(&mut self.backlog),
        ) else {
            return;
        };
        tokio::spawn(async move {
            if let Some(f) = sending {
                let _ = f.await;
            }
            let _ = tx.send_batch(backlog.into()).await;
            let _ = tx.close().await;
        });
    }

    /// Act on one endpoint event; `stale` events belong to a link already replaced and
    /// must not retire the current one. Completions are collected into `completed`.
    fn on_event(&mut self, ev: Event, stale: bool, completed: &mut Vec<(Reply, LocalResult)>) {
        match ev {
            Event::Completed { request, result } => {
                if let Some(w) = self.waiters.remove(&request) {
                    completed.push((w, result));
                }
            }
            Event::Connected => self.last_problem = None,
            Event::Refused { reason } | Event::PeerLost { reason } => {
                warn!("mirror link dropped: {reason}");
                self.last_problem = Some(reason);
                if !stale {
                    self.retire_link();
                }
            }
            Event::LocalDetached { reason } => self.last_problem = Some(reason),
            Event::LocalDataLost { action } => {
                self.last_problem = Some(format!("local replica lost data: {action}"));
            }
            Event::NeedQuorum => self.claim_quorum(),
            Event::ReleaseQuorum => self.release_quorum(),
            Event::SyncStarted {
                role,
                kind,
                total_bytes,
            } => {
                info!(disk = %self.name, "{kind} started as {role:?}: {total_bytes} bytes to go through");
                self.last_sync_start = Some(SyncStart {
                    number: self.last_sync_start.map_or(1, |s| s.number + 1),
                    role,
                    kind,
                    total_bytes,
                });
            }
            Event::SyncEnded(summary) => {
                info!(disk = %self.name, "{} ended: {summary:?}", summary.kind);
            }
        }
    }

    /// Carry out everything the endpoint has queued.
    async fn drain(&mut self) {
        let mut completed = Vec::new();
        loop {
            let mut moved = false;
            while let Some(m) = self.ep.poll_transmit() {
                moved = true;
                if self.tx.is_some() {
                    self.backlog.push_back(m);
                }
            }
            self.pump_sends().await;
            while let Some(io) = self.ep.poll_local_io() {
                moved = true;
                #[cfg(feature = "failpoints")]
                if let Some((op, kind)) = self.points.local_io(&io) {
                    self.running
                        .push(Box::pin(std::future::ready((op, Err(kind)))));
                    continue;
                }
                self.running.push(run_local(
                    Arc::clone(&self.local),
                    Arc::clone(&self.meta),
                    io,
                ));
            }
            while let Some(ev) = self.stale_events.pop_front() {
                moved = true;
                self.on_event(ev, true, &mut completed);
            }
            while let Some(ev) = self.ep.poll_event() {
                moved = true;
                self.on_event(ev, false, &mut completed);
            }
            if !moved {
                break;
            }
        }
        let now_t = Instant::now();
        let progress = self.ep.sync_progress(now_t);
        if progress.is_some() || self.progress.lock().is_some() {
            *self.progress.lock() = progress;
        }
        if let Some(p) = progress
            && now_t.duration_since(self.last_progress_log) >= std::time::Duration::from_secs(1)
        {
            self.last_progress_log = now_t;
            info!(
                disk = %self.name,
                "{} {:?}: {:.1}% ({} of {} bytes), {} bytes transferred, {}/s, ETA {:?}",
                p.kind,
                p.role,
                p.percent(),
                p.done_bytes,
                p.total_bytes,
                p.transferred_bytes,
                p.rate,
                p.eta
            );
        }
        let now = status_of(
            &self.ep,
            Observed {
                syncing: progress.is_some(),
                link_transport: self.tx.as_ref().map(|_| Arc::clone(&self.link_transport)),
                last_problem: self.last_problem.clone(),
                last_sync_start: self.last_sync_start,
                local_data_lost: self.data_loss_seen - self.data_loss_base,
                started: self.started,
            },
        );
        self.status.send_if_modified(|s| {
            if *s != now {
                *s = now;
                true
            } else {
                false
            }
        });
        // Completions last, so a caller that looks at the status after its request
        // completed sees the state the completion came from.
        for (w, result) in completed {
            let _ = w.send(result);
        }
        for (done, result) in self.operator_replies.drain(..) {
            let _ = done.send(result);
        }
    }
}

/// Talks to the witness for one disk, one round trip at a time and in the order the
/// driver asked, so a release can never overtake a claim (or the reverse). A claim is
/// retried every second until granted, unless a newer request arrives.
async fn witness_worker(
    w: WitnessClient,
    disk: String,
    mut requests: mpsc::UnboundedReceiver<WitnessRequest>,
    answers: mpsc::UnboundedSender<bool>,
) {
    let mut next = requests.recv().await;
    while let Some(req) = next.take() {
        match req {
            WitnessRequest::Release => {
                if let Err(e) = w.release(&disk).await {
                    warn!(disk = %disk, "could not release the witness's grant: {e}");
                }
            }
            WitnessRequest::Claim => loop {
                let granted = match w.claim(&disk).await {
                    Ok(g) => g,
                    Err(e) => {
                        warn!(disk = %disk, "witness {} unreachable: {e}", w.addr());
                        false
                    }
                };
                if answers.send(granted).is_err() {
                    return;
                }
                if granted {
                    break;
                }
                tokio::select! {
                    r = requests.recv() => {
                        next = r;
                        if next.is_none() {
                            return;
                        }
                        break;
                    }
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                }
            },
        }
        if next.is_none() {
            next = requests.recv().await;
        }
    }
}

/// Poll `fut` once with the task's own waker.
async fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(std::pin::Pin::new(&mut *fut).poll(cx))).await
}

async fn poll_sending(sending: &mut Option<SendFuture>) -> Result<()> {
    match sending {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn recv(rx: &mut Option<Box<dyn LinkRx>>) -> Result<Message> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn run_local(dev: Arc<dyn BlockDevice>, meta: Arc<dyn BlockDevice>, io: LocalIo) -> LocalFuture {
    Box::pin(async move {
        let kind = |e: Error| e.kind();
        match io {
            LocalIo::Write {
                op,
                offset,
                payload,
                fua,
            } => {
                let flags = if fua { IoFlags::FUA } else { IoFlags::empty() };
                let r = match payload {
                    WritePayload::Data(d) => dev.write(offset, d, flags).await,
                    WritePayload::Zeroes { len } => dev.write_zeroes(offset, len, flags).await,
                    WritePayload::Discard { len } => dev.discard(offset, len, flags).await,
                };
                (op, r.map(|()| None).map_err(kind))
            }
            LocalIo::Flush { op } => (op, dev.flush().await.map(|()| None).map_err(kind)),
            LocalIo::Read {
                op,
                offset,
                len,
                once,
            } => {
                let r = if once {
                    dev.read_once(offset, len as usize).await
                } else {
                    dev.read(offset, len as usize).await
                };
                (op, r.map(Some).map_err(kind))
            }
            LocalIo::Meta {
                op,
                writes,
                flush_data,
            } => {
                let r = async {
                    if flush_data {
                        dev.flush().await?;
                    }
                    for (offset, bytes) in writes {
                        meta.write(offset, bytes, IoFlags::empty()).await?;
                    }
                    meta.flush().await
                }
                .await;
                (op, r.map(|()| None).map_err(kind))
            }
        }
    })
}
