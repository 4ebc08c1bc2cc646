//! The driver: the tokio task that owns a mirror's [`Endpoint`] and is the only place
//! that awaits. It feeds the endpoint caller requests, peer messages, local I/O
//! completions and timer expiries, and carries out what the endpoint asks.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Instant, SystemTime};

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};
use vsan_core::{BlockDevice, Error, ErrorKind, IoFlags, Result};

use super::status::{Observed, status_of};
use super::witness_worker::WitnessRequest;
use super::{Command, MirrorStatus, Operator, OperatorReply, Reply, SyncStart};
use crate::protocol::fastmap::FastMap;
use crate::protocol::{
    Endpoint, Event, LocalIo, LocalOpId, LocalResult, Message, RequestId, SyncProgress,
    WritePayload,
};
use crate::transport::{LinkRx, LinkTx};

type LocalFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = (LocalOpId, LocalResult)> + Send>>;

pub(super) struct Driver {
    pub(super) name: Arc<str>,
    pub(super) ep: Endpoint,
    pub(super) local: Arc<dyn BlockDevice>,
    pub(super) meta: Arc<dyn BlockDevice>,
    pub(super) status: watch::Sender<MirrorStatus>,
    pub(super) progress: Arc<parking_lot::Mutex<Option<SyncProgress>>>,
    /// Requests to the witness worker (none without a witness).
    pub(super) witness: Option<mpsc::UnboundedSender<WitnessRequest>>,
    /// Quorum answers come back here (the worker's own sender, or none).
    pub(super) quorum_tx: mpsc::UnboundedSender<bool>,
    pub(super) closing: Vec<oneshot::Sender<Result<()>>>,
    /// Events the endpoint raised for a link already replaced: handled without retiring
    /// the link that replaced it.
    pub(super) stale_events: VecDeque<Event>,
    /// Answers to operator actions, sent once the status shows their effect.
    pub(super) operator_replies: Vec<(OperatorReply, Result<String>)>,
    pub(super) last_progress_log: Instant,
    pub(super) last_sync_start: Option<SyncStart>,
    pub(super) waiters: FastMap<RequestId, Reply>,
    pub(super) tx: Option<Arc<dyn LinkTx>>,
    pub(super) rx: Option<Box<dyn LinkRx>>,
    /// The attached link's transport, for status.
    pub(super) link_transport: Arc<str>,
    /// The send the link could not take at once (its queue is full); later messages
    /// wait in `backlog`. The driver never blocks on the link: a peer that stops reading
    /// must not stop local I/O or the peer timeout.
    pub(super) sending: Option<SendFuture>,
    pub(super) backlog: VecDeque<Message>,
    pub(super) running: FuturesUnordered<LocalFuture>,
    /// The SCSI handler (see [`super::MirroredDisk::set_scsi_handler`]).
    pub(super) scsi: super::ScsiSlot,
    /// The peer's SCSI calls being handled.
    pub(super) scsi_running: FuturesUnordered<ScsiRunning>,
    pub(super) last_problem: Option<String>,
    /// The local replica's `data_loss_count` when the driver started, and when it last
    /// looked.
    pub(super) data_loss_base: u64,
    pub(super) data_loss_seen: u64,
    /// When this disk started (an unproven replica is unproven since then).
    pub(super) started: SystemTime,
    /// Where this driver's fail points fire (see [`crate::failpoints`]).
    #[cfg(feature = "failpoints")]
    pub(super) points: crate::failpoints::Site,
}

/// A SCSI call of the peer's being handled: (link epoch, the peer's id, the answer).
type ScsiRunning = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = (u64, u64, std::result::Result<bytes::Bytes, ErrorKind>)>
            + Send,
    >,
>;

type SendFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

fn send_future(tx: &Arc<dyn LinkTx>, msgs: Vec<Message>) -> SendFuture {
    let tx = Arc::clone(tx);
    Box::pin(async move { tx.send_batch(msgs).await })
}

impl Driver {
    pub(super) async fn run(
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
                Some((epoch, id, res)) = self.scsi_running.next(), if !self.scsi_running.is_empty() => {
                    self.ep.reply_scsi(Instant::now(), epoch, id, res);
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
            Command::Scsi { body, done } => {
                let r = self.ep.submit_scsi(now, body);
                self.waiters.insert(r, done);
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
            Event::ScsiRequest { epoch, id, body } => {
                let handler = self.scsi.read().as_ref().and_then(std::sync::Weak::upgrade);
                let fut: ScsiRunning = match handler {
                    Some(h) => {
                        let call = h.call(body);
                        Box::pin(async move { (epoch, id, call.await) })
                    }
                    None => Box::pin(std::future::ready((
                        epoch,
                        id,
                        Err(ErrorKind::NotSupported),
                    ))),
                };
                self.scsi_running.push(fut);
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
