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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};
use vsan_core::{BlockDevice, Error, ErrorKind, Geometry, IoFlags, IoFuture, Op, Result};

use crate::protocol::{
    Config, Endpoint, Event, LinkState, LocalIo, LocalOpId, LocalResult, Message, RequestId,
    WritePayload,
};
use crate::transport::{Link, LinkRx, LinkTx};

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
}

/// What a mirrored disk reports about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorStatus {
    /// The link to the peer.
    pub link: LinkState,
    /// Whether a link is attached right now (handshaking or connected).
    pub link_attached: bool,
    /// The local replica failed and I/O goes through the peer.
    pub local_detached: bool,
    /// This replica has writes the peer lacks (a resync is needed before mirroring).
    pub diverged: bool,
    /// The last refusal or loss reason, if any.
    pub last_problem: Option<String>,
}

/// A two-way synchronously mirrored disk (protocol C). Cheap to clone.
#[derive(Clone)]
pub struct MirroredDisk {
    name: Arc<str>,
    geometry: Geometry,
    commands: mpsc::UnboundedSender<Command>,
    status: watch::Receiver<MirrorStatus>,
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
    /// Mirror `local` with the peer described by `cfg`; spawns the driver on the current
    /// tokio runtime. The disk serves I/O at once; writes wait for the first link (up to
    /// `cfg.connect_timeout`) and then go on alone.
    pub fn start(cfg: Config, local: Arc<dyn BlockDevice>) -> Result<MirroredDisk> {
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
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::new(
                ErrorKind::NotSupported,
                "MirroredDisk::start needs a tokio runtime",
            )
        })?;
        let name: Arc<str> = cfg.disk_name.as_str().into();
        let (commands, rx) = mpsc::unbounded_channel();
        let initial = MirrorStatus {
            link: LinkState::Waiting,
            link_attached: false,
            local_detached: false,
            diverged: false,
            last_problem: None,
        };
        let (status_tx, status) = watch::channel(initial);
        let endpoint = Endpoint::new(cfg, Instant::now());
        handle.spawn(Driver::new(endpoint, local, status_tx).run(rx));
        Ok(MirroredDisk {
            name,
            geometry,
            commands,
            status,
        })
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

struct Driver {
    ep: Endpoint,
    local: Arc<dyn BlockDevice>,
    status: watch::Sender<MirrorStatus>,
    waiters: HashMap<RequestId, Reply>,
    tx: Option<Arc<dyn LinkTx>>,
    rx: Option<Box<dyn LinkRx>>,
    /// The send the link could not take at once (its queue is full); later messages
    /// wait in `backlog`. The driver never blocks on the link: a peer that stops reading
    /// must not stop local I/O or the peer timeout.
    sending: Option<SendFuture>,
    backlog: VecDeque<Message>,
    running: FuturesUnordered<LocalFuture>,
    last_problem: Option<String>,
}

type SendFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

fn send_future(tx: &Arc<dyn LinkTx>, msgs: Vec<Message>) -> SendFuture {
    let tx = Arc::clone(tx);
    Box::pin(async move { tx.send_batch(msgs).await })
}

impl Driver {
    fn new(
        ep: Endpoint,
        local: Arc<dyn BlockDevice>,
        status: watch::Sender<MirrorStatus>,
    ) -> Driver {
        Driver {
            ep,
            local,
            status,
            waiters: HashMap::new(),
            tx: None,
            rx: None,
            sending: None,
            backlog: VecDeque::new(),
            running: FuturesUnordered::new(),
            last_problem: None,
        }
    }

    async fn run(mut self, mut commands: mpsc::UnboundedReceiver<Command>) {
        // Once every handle is gone, finish what is in flight, then stop.
        let mut handles_gone = false;
        loop {
            self.drain().await;
            if handles_gone && self.waiters.is_empty() && self.running.is_empty() {
                break;
            }
            let deadline = self.ep.poll_timeout().map(tokio::time::Instant::from_std);
            tokio::select! {
                cmd = commands.recv(), if !handles_gone => match cmd {
                    Some(cmd) => self.command(cmd),
                    None => handles_gone = true,
                },
                msg = recv(&mut self.rx) => match msg {
                    Ok(m) => self.ep.handle_message(Instant::now(), m),
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
                    self.ep.handle_local_done(Instant::now(), op, res);
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
                    Poll::Ready(Ok(m)) => self.ep.handle_message(Instant::now(), m),
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
                    Poll::Ready(Some((op, res))) => {
                        self.ep.handle_local_done(Instant::now(), op, res)
                    }
                    _ => break,
                }
            }
        }
        self.retire_link();
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
                info!(peer = link.peer(), "link to the peer attached");
                let (tx, rx) = link.into_split();
                self.tx = Some(Arc::from(tx));
                self.rx = Some(rx);
                self.ep.handle_connected(now);
                if let Some(m) = first {
                    self.ep.handle_message(now, m);
                }
            }
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
                self.running.push(run_local(Arc::clone(&self.local), io));
            }
            while let Some(ev) = self.ep.poll_event() {
                moved = true;
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
                        self.retire_link();
                    }
                    Event::LocalDetached { reason } => self.last_problem = Some(reason),
                }
            }
            if !moved {
                break;
            }
        }
        let now = MirrorStatus {
            link: self.ep.state(),
            link_attached: self.tx.is_some(),
            local_detached: self.ep.is_detached(),
            diverged: self.ep.is_diverged(),
            last_problem: self.last_problem.clone(),
        };
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

fn run_local(dev: Arc<dyn BlockDevice>, io: LocalIo) -> LocalFuture {
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
            LocalIo::Read { op, offset, len } => (
                op,
                dev.read(offset, len as usize).await.map(Some).map_err(kind),
            ),
        }
    })
}
