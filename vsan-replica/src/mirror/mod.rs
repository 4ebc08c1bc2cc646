//! `MirroredDisk`: the [`BlockDevice`] callers use, and the tokio task that drives the
//! protocol [`Endpoint`] for it.
//!
//! ```text
//!  callers ──(read/write/flush: inline)──▶ Core (Endpoint + what carries it out) ◀── driver task
//!          ──(operator commands, links)──▶ driver task                              (links,
//!                 local replica (Arc<dyn BlockDevice>) ◀── LocalIo ┤                  timers)
//!                 peer link (LinkTx / LinkRx)          ◀── Message ┘
//! ```
//!
//! A caller's read, write or flush is carried out by the caller itself: it enters the
//! driver's core, hands the request to the endpoint and runs a turn (the messages go to
//! the link, the local I/O starts), then waits in a slot for the completion — under a
//! [`Plug`](vsan_core::plug::Plug), one turn at the unplug carries out every request
//! the caller started. The driver task waits for what no caller waits for (peer
//! messages, the endpoint's timer, operator commands, new links) and runs turns of its
//! own; see `driver.rs`.
//!
//! Files: this one holds the [`MirroredDisk`] handle, its requests and the commands it
//! sends; `driver.rs` the core and the task; `slots.rs` where requests wait;
//! `status.rs` what the handle reports ([`MirrorStatus`]); `witness_worker.rs` the task
//! that asks the quorum witness.

mod driver;
mod slots;
mod status;
mod witness_worker;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use tokio::sync::{mpsc, oneshot, watch};
use vsan_core::{BlockDevice, Error, ErrorKind, Geometry, IoFlags, IoFuture, Op, Result};

use crate::meta::{self, Loaded, MetaParams};
use crate::protocol::fastmap::FastMap;
use crate::protocol::{Config, Endpoint, Message, ResyncRate, SyncProgress, WritePayload};
use crate::transport::Link;
use crate::witness::WitnessClient;

use crate::protocol::RequestId;
use driver::{Core, Io, Shared};
pub use status::{MirrorStatus, Serving, SyncStart};
use status::{Observed, status_of};
use witness_worker::witness_worker;

type Reply = oneshot::Sender<std::result::Result<Option<Bytes>, ErrorKind>>;

/// What goes to the driver task through its channel: everything but the callers' I/O,
/// which they carry out themselves.
enum Command {
    /// A new link to the peer; `first` is a message already read from it (the acceptor
    /// reads the peer's Hello to learn which disk the link is for).
    Attach { link: Link, first: Option<Message> },
    /// Start an online verify from this node.
    Verify { done: oneshot::Sender<Result<()>> },
    /// Discard this node's data in a split brain (on the next handshake).
    DiscardMyData,
    /// An operator's action; answers what was done or why not.
    Operator {
        action: Operator,
        done: OperatorReply,
    },
    /// A call to the peer's SCSI layer.
    Scsi { body: Bytes, done: Reply },
    /// Finish in-flight I/O, mark the metadata clean, stop.
    Close { done: oneshot::Sender<Result<()>> },
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

/// The future a [`ScsiHandler`] answers with.
pub type ScsiFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = std::result::Result<Bytes, ErrorKind>> + Send>,
>;

/// What handles the peer's SCSI calls on this node ([`MirroredDisk::set_scsi_handler`]):
/// the SCSI layer of the logical unit over this mirror. The mirror carries the calls
/// and their answers and knows nothing of what they say.
pub trait ScsiHandler: Send + Sync {
    /// Handle the peer's call `body`; the answer (or the failure) goes back to the
    /// peer's [`MirroredDisk::scsi_call`]. Calls run concurrently, started in link
    /// order, each after the peer's writes sent before it were received.
    fn call(&self, body: Bytes) -> ScsiFuture;
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

/// A two-way synchronously mirrored disk (protocol C). Cheap to clone.
#[derive(Clone)]
pub struct MirroredDisk {
    name: Arc<str>,
    geometry: Geometry,
    shared: Arc<Shared>,
    commands: mpsc::UnboundedSender<Command>,
    status: watch::Receiver<MirrorStatus>,
    progress: Arc<parking_lot::Mutex<Option<SyncProgress>>>,
    scsi: ScsiSlot,
    scsi_area: Arc<ScsiAreaStore>,
}

/// The SCSI state area of this replica's metadata ([`MirroredDisk::save_scsi_state`]):
/// written beside the driver's metadata writes, at offsets of its own.
struct ScsiAreaStore {
    meta: Arc<dyn BlockDevice>,
    layout: meta::Layout,
    /// What the area holds, read on first use; writes are serialised here.
    area: tokio::sync::Mutex<Option<meta::ScsiArea>>,
}

impl ScsiAreaStore {
    /// The area, read on the first call.
    async fn loaded(&self) -> Result<tokio::sync::MappedMutexGuard<'_, meta::ScsiArea>> {
        let mut area = self.area.lock().await;
        if area.is_none() {
            *area = Some(meta::read_scsi_area(self.meta.as_ref(), &self.layout).await?);
        }
        Ok(tokio::sync::MutexGuard::map(area, |a| {
            a.get_or_insert_with(meta::ScsiArea::default)
        }))
    }
}

/// Where the driver finds the SCSI handler: held weakly, so that a handler that holds
/// the disk does not keep the driver alive.
type ScsiSlot = Arc<parking_lot::RwLock<Option<std::sync::Weak<dyn ScsiHandler>>>>;

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
        let layout = replica.loaded.layout;
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
        let scsi: ScsiSlot = Arc::default();
        let (quorum_tx, quorum_rx) = mpsc::unbounded_channel();
        let witness_tx = witness.map(|w| {
            let (tx, rx) = mpsc::unbounded_channel();
            handle.spawn(witness_worker(w, name.to_string(), rx, quorum_tx.clone()));
            tx
        });
        let scsi_area = Arc::new(ScsiAreaStore {
            meta: Arc::clone(&replica.meta),
            layout,
            area: tokio::sync::Mutex::new(None),
        });
        let core = Core {
            name: Arc::clone(&name),
            ep: endpoint,
            local,
            meta: replica.meta,
            status: Some(status_tx),
            progress: Arc::clone(&progress),
            witness: witness_tx,
            quorum_tx,
            closing: Vec::new(),
            stale_events: VecDeque::new(),
            operator_replies: Vec::new(),
            last_progress_log: Instant::now(),
            last_sync_start: None,
            waiters: FastMap::default(),
            replies: Vec::new(),
            completed: Vec::new(),
            tx: None,
            new_rx: None,
            link_gen: 0,
            link_transport: Arc::from(""),
            sending: None,
            backlog: VecDeque::new(),
            running: FuturesUnordered::new(),
            fresh: VecDeque::new(),
            finished: Vec::new(),
            pending: Vec::new(),
            scsi: Arc::clone(&scsi),
            scsi_running: tokio::task::JoinSet::new(),
            last_problem: None,
            data_loss_base,
            data_loss_seen: data_loss_base,
            started,
            now: Instant::now(),
            armed: None,
            stopped: false,
            runtime: handle.clone(),
            #[cfg(feature = "failpoints")]
            points,
        };
        let shared = Arc::new(Shared::new(Arc::clone(&name), core, handle.clone()));
        handle.spawn(driver::run(Arc::clone(&shared), rx, quorum_rx));
        Ok(MirroredDisk {
            name,
            geometry,
            shared,
            commands,
            status,
            progress,
            scsi,
            scsi_area,
        })
    }

    /// The SCSI state saved in this replica's metadata ([`Self::save_scsi_state`]):
    /// `None` when none was saved (or the metadata has no room for it). Bytes as the
    /// SCSI layer encoded them; the mirror does not read them.
    pub async fn scsi_state(&self) -> Result<Option<Bytes>> {
        Ok(self.scsi_area.loaded().await?.state.clone())
    }

    /// Keep `state` (the SCSI layer's reservation state of the unit over this disk) in
    /// this replica's metadata, durably: two copies written alternately, so a crash
    /// during the write leaves the previous state. The state travels with the
    /// replica; which node's state stands after a separation follows the handshake's
    /// decision about the data ([`MirrorStatus::link_role`]), settled by the SCSI layer.
    /// Fails with [`ErrorKind::NoSpace`] when the metadata has no room for it (a
    /// metadata device made before the area existed that cannot grow) or the state is
    /// larger than [`meta::SCSI_STATE_MAX`].
    pub async fn save_scsi_state(&self, state: Bytes) -> Result<()> {
        let store = &self.scsi_area;
        let mut area = store.loaded().await?;
        meta::write_scsi_area(store.meta.as_ref(), &store.layout, &mut area, state)
            .await
            .map_err(|e| e.context_prefix(format!("disk {}: SCSI state", self.name)))
    }

    /// Whether this replica's metadata has room for the SCSI state.
    pub fn has_scsi_area(&self) -> bool {
        meta::has_scsi_area(self.scsi_area.meta.as_ref(), &self.scsi_area.layout)
    }

    /// Set the handler of the peer's SCSI calls (held weakly: the caller keeps it
    /// alive). Without one, or once it is dropped, calls fail with `NotSupported`.
    pub fn set_scsi_handler(&self, handler: std::sync::Weak<dyn ScsiHandler>) {
        *self.scsi.write() = Some(handler);
    }

    /// Call the peer's SCSI layer with `body`, in link order with the writes submitted
    /// before; the peer's handler's answer. Fails with [`ErrorKind::WrongState`] when
    /// the link is not connected or is lost before the answer (the peer may or may not
    /// have handled the call), or with the handler's error.
    pub async fn scsi_call(&self, body: Bytes) -> Result<Bytes> {
        let fut = self.request(|done| Command::Scsi { body, done });
        fut.await.map(Option::unwrap_or_default)
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

    /// A request through the driver task's channel (a SCSI call).
    fn request(&self, make: impl FnOnce(Reply) -> Command) -> IoFuture<'_, Option<Bytes>> {
        let (done, rx) = oneshot::channel();
        let sent = self.commands.send(make(done));
        Box::pin(async move {
            if sent.is_err() {
                return Err(failed(&self.name, ErrorKind::Closed));
            }
            match rx.await {
                Ok(Ok(data)) => Ok(data),
                Ok(Err(kind)) => Err(failed(&self.name, kind)),
                Err(_) => Err(failed(&self.name, ErrorKind::Closed)),
            }
        })
    }

    /// Submit `io` (already checked against the geometry) and wait for its result,
    /// handed to the caller through `finish`.
    fn io<T: Send + 'static>(&self, io: Io, finish: fn(Option<Bytes>) -> T) -> IoFuture<'_, T> {
        Box::pin(Request {
            shared: &self.shared,
            io: Some(io),
            req: None,
            finish,
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
        self.io(
            Io::Write {
                offset,
                payload,
                fua,
            },
            drop,
        )
    }
}

/// A caller's read, write or flush: submitted (and carried out, or queued under a plug)
/// on its first poll, then waiting in its slot.
struct Request<'a, T> {
    shared: &'a Arc<Shared>,
    /// Not yet submitted.
    io: Option<Io>,
    /// Submitted: waiting in this slot.
    req: Option<RequestId>,
    /// What the caller gets of a result.
    finish: fn(Option<Bytes>) -> T,
}

impl<T> std::future::Future for Request<'_, T> {
    type Output = Result<T>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        // A request may complete in its first poll (degraded, or a read): a caller
        // that loops on such requests yields now and then, as it would on any tokio
        // resource, so the driver task and the caller's neighbours get to run.
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let this = &mut *self;
        if let Some(io) = this.io.take() {
            match this.shared.submit(io, cx.waker()) {
                Ok(req) => this.req = Some(req),
                Err(kind) => {
                    coop.made_progress();
                    return Poll::Ready(Err(failed(&this.shared.name, kind)));
                }
            }
        }
        let Some(req) = this.req else {
            return Poll::Ready(Err(failed(&this.shared.name, ErrorKind::Closed)));
        };
        match this.shared.slots.lock().take(req, cx.waker()) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(result) => {
                this.req = None;
                coop.made_progress();
                Poll::Ready(match result {
                    Some(Ok(data)) => Ok((this.finish)(data)),
                    Some(Err(kind)) => Err(failed(&this.shared.name, kind)),
                    None => Err(failed(&this.shared.name, ErrorKind::Closed)),
                })
            }
        }
    }
}

impl<T> Drop for Request<'_, T> {
    fn drop(&mut self) {
        if let Some(req) = self.req {
            self.shared.slots.lock().abandon(req);
        }
    }
}

/// The error a caller sees for a request of disk `name` that failed with `kind`.
fn failed(name: &str, kind: ErrorKind) -> Error {
    match kind {
        ErrorKind::Closed => Error::new(kind, format!("disk {name}: mirror driver has stopped")),
        _ => Error::new(kind, format!("disk {name}: mirrored I/O failed")),
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
        self.io(
            Io::Read {
                offset,
                len: len as u32,
            },
            Option::unwrap_or_default,
        )
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_payload(Op::Write, offset, WritePayload::Data(data), flags)
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        self.io(Io::Flush, drop)
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_payload(Op::Discard, offset, WritePayload::Discard { len }, flags)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_payload(Op::WriteZeroes, offset, WritePayload::Zeroes { len }, flags)
    }
}
