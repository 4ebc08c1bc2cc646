//! The driver: what carries out a mirror [`Endpoint`]'s wishes, and the tokio task that
//! waits on its behalf.
//!
//! ```text
//!   caller (read / write / flush)          driver task (links, timers, commands)
//!        │ lock Core, submit, turn               │ waits: peer messages, timer, commands,
//!        │ (or queue under a Plug,               │ local I/O or a send that did not finish
//!        │  turned once at the unplug)           │ at once, a kick
//!        ▼                                       ▼
//!   Core (behind one mutex): Endpoint ── turn ──▶ messages ─▶ LinkTx (written inline)
//!                                        │    ──▶ local I/O ─▶ polled inline (page-cache
//!                                        │                    I/O completes there)
//!                                        └──▶ completions ─▶ Slots ─▶ the callers' wakers
//! ```
//!
//! A request is carried out by the caller that submits it: it takes the [`Core`] lock,
//! hands the request to the endpoint and runs a *turn* — the endpoint's messages go to
//! the link (one write for all of them), its local I/O is started and polled once, and
//! whatever completes feeds the endpoint again until nothing moves. A front door that
//! starts several requests together holds a [`Plug`](vsan_core::plug::Plug): requests
//! are then only queued, and one turn at the unplug carries them all out (one send
//! for the lot). So a request costs no hand-off to another task and no channel; its
//! caller waits in a [slot](super::slots).
//!
//! The driver task does what no caller can: it waits for the peer's messages, the
//! endpoint's timer, operator commands and a new link, and for local I/O or a link send
//! that did not complete at once (a turn polls those with a waker that *kicks* the task,
//! so it polls them again with its own). Everything it does, it does in the same turns
//! under the same lock; no lock is held across an `.await`.
//!
//! A local replica that loses acknowledged data (a write-back cache whose fast device
//! failed) says so through [`BlockDevice::data_loss_count`], which it bumps before it
//! completes anything that could show the loss. Every turn looks at the count first and
//! before it hands the endpoint any local completion, and tells the endpoint first
//! ([`Endpoint::local_data_lost`]): so no read of lost data reaches a caller.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Instant, SystemTime};

use futures_util::FutureExt;
use futures_util::stream::{FuturesUnordered, StreamExt};
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tracing::{error, info, warn};
use vsan_core::{BlockDevice, Error, ErrorKind, IoFlags, Result};

use super::slots::Slots;
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

/// A SCSI call of the peer's, answered: (link epoch, the peer's id, the answer).
type ScsiAnswer = (u64, u64, std::result::Result<bytes::Bytes, ErrorKind>);

type SendFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

/// A caller's request, as it reaches the endpoint.
#[derive(Debug)]
pub(super) enum Io {
    Write {
        offset: u64,
        payload: WritePayload,
        fua: bool,
    },
    Read {
        offset: u64,
        len: u32,
    },
    Flush,
}

/// Wakes the driver task: a turn left local I/O or a send pending (polled with this
/// waker, so its completion wakes the task), or moved the endpoint's next deadline
/// earlier than the one the task sleeps until.
#[derive(Debug, Default)]
pub(super) struct Kick {
    notify: Notify,
}

impl Wake for Kick {
    fn wake(self: Arc<Self>) {
        self.notify.notify_one();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.notify.notify_one();
    }
}

/// What the [`MirroredDisk`](super::MirroredDisk) handles, their requests and the
/// driver task share.
pub(super) struct Shared {
    pub(super) name: Arc<str>,
    pub(super) core: Mutex<Core>,
    /// The callers' requests in flight. Lock order: `core` before `slots`.
    pub(super) slots: Mutex<Slots>,
    pub(super) kick: Arc<Kick>,
    /// `kick` as a waker, for the turns callers run.
    kick_waker: Waker,
    /// The runtime the mirror was started on: a turn a caller runs outside it (a
    /// vhost-user queue thread, a C caller's thread) enters it, so links and devices
    /// find their runtime.
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(super) fn new(name: Arc<str>, core: Core, runtime: tokio::runtime::Handle) -> Shared {
        let kick = Arc::new(Kick::default());
        Shared {
            name,
            core: Mutex::new(core),
            slots: Mutex::new(Slots::default()),
            kick_waker: Waker::from(Arc::clone(&kick)),
            kick,
            runtime,
        }
    }

    /// Submit `io` and carry it out now (or, under a plug, at the unplug): the caller
    /// waits in the returned request's slot, woken through `waker`. Fails with `Closed`
    /// once the driver has stopped.
    pub(super) fn submit(
        self: &Arc<Self>,
        io: Io,
        waker: &Waker,
    ) -> std::result::Result<RequestId, ErrorKind> {
        let _runtime = self.runtime.try_current_or_enter();
        let mut wake = Vec::new();
        let req = {
            let mut core = self.core.lock();
            if core.stopped {
                return Err(ErrorKind::Closed);
            }
            let now = Instant::now();
            let req = match io {
                Io::Write {
                    offset,
                    payload,
                    fua,
                } => core.ep.submit_write(now, offset, payload, fua),
                Io::Read { offset, len } => core.ep.submit_read(now, offset, len),
                Io::Flush => core.ep.submit_flush(now),
            };
            // Before the turn: the turn may complete it.
            self.slots.lock().open(req, waker);
            if vsan_core::plug::defer(self) {
                return Ok(req);
            }
            drop(self.turn_inline(core, &mut wake));
            req
        };
        wake.into_iter().for_each(Waker::wake);
        Ok(req)
    }

    /// One turn: carry out everything the endpoint has queued (messages to the link,
    /// local I/O started, events), feed back what completed at once, until nothing
    /// moves; then publish progress and status. Local I/O a turn starts runs with the
    /// lock released, [`LOCAL_IO_PER_STEP`] operations at a time in the order the
    /// endpoint started them (page-cache I/O completes right there, and nobody else
    /// waits behind it), their results fed back and the messages they produced sent
    /// before the next ones start; what does not complete joins `running`, polled with
    /// `cx`'s waker. Completions wait in `completed` for [`Core::take_completions`].
    fn turn<'a>(
        &'a self,
        mut core: MutexGuard<'a, Core>,
        cx: &mut Context<'_>,
    ) -> MutexGuard<'a, Core> {
        loop {
            if core.stopped {
                // The driver stopped (its runtime shut down) while this caller's turn
                // ran local I/O with the lock released: nothing more is carried out.
                core.completed.clear();
                return core;
            }
            core.now = Instant::now();
            core.check_data_loss();
            let mut moved = core.drain(cx);
            moved |= core.poll_running(cx).is_ready();
            if core.fresh.is_empty() {
                if !moved {
                    break;
                }
                continue;
            }
            let mut fresh = std::mem::take(&mut core.fresh);
            let mut finished = std::mem::take(&mut core.finished);
            let mut pending = std::mem::take(&mut core.pending);
            let (local, meta) = (Arc::clone(&core.local), Arc::clone(&core.meta));
            let step = fresh.len().min(LOCAL_IO_PER_STEP);
            MutexGuard::unlocked(&mut core, || {
                for f in fresh.drain(..step) {
                    let mut fut = match f {
                        Fresh::Io(io) => match local_now(&self.name, &*local, &io) {
                            Some(done) => {
                                finished.push(done);
                                continue;
                            }
                            None => run_local(
                                Arc::clone(&self.name),
                                Arc::clone(&local),
                                Arc::clone(&meta),
                                io,
                            ),
                        },
                        Fresh::Started(fut) => fut,
                    };
                    match fut.poll_unpin(cx) {
                        Poll::Ready(done) => finished.push(done),
                        Poll::Pending => pending.push(fut),
                    }
                }
            });
            if !core.stopped {
                core.running.extend(pending.drain(..));
                for (op, res) in finished.drain(..) {
                    core.local_done(op, res);
                }
            }
            pending.clear();
            finished.clear();
            fresh.append(&mut core.fresh);
            core.fresh = fresh;
            core.finished = finished;
            core.pending = pending;
        }
        core.publish();
        core
    }

    /// A turn run by a caller (a submit, an unplug): pending work is polled with the
    /// kick waker, and the task is kicked when the endpoint's deadline moved earlier
    /// than the one it sleeps until.
    fn turn_inline<'a>(
        &'a self,
        core: MutexGuard<'a, Core>,
        wake: &mut Vec<Waker>,
    ) -> MutexGuard<'a, Core> {
        let mut cx = Context::from_waker(&self.kick_waker);
        let mut core = self.turn(core, &mut cx);
        if let Some(at) = core.ep.poll_timeout()
            && core.armed.is_none_or(|armed| at < armed)
        {
            core.armed = Some(at);
            self.kick.notify.notify_one();
        }
        core.take_completions(&self.slots, wake);
        core
    }
}

/// Local operations a turn carries out before it feeds their results back to the
/// endpoint and sends what that produced. A peer that received a batch of 32 writes acks
/// the first eight while it writes the rest, instead of all 32 after the last, so the
/// exporting node answers its clients and takes their next requests while its peer is
/// still busy: a pipeline instead of a lock-step of whole batches. Measured with fio
/// over NBD (4 KiB random writes at depth 32, both nodes on two cores): 9% more
/// mirrored writes per second (median of 13 alternating pairs, every pair ahead) at
/// slightly less CPU per write than carrying out the whole batch first (BENCHMARKS.md,
/// "The peer acks a batch in steps"); 4 did as well, 2 cost more CPU, 16 gained
/// nothing.
const LOCAL_IO_PER_STEP: usize = 8;

impl vsan_core::plug::Unplug for Shared {
    fn unplug(&self) {
        let _runtime = self.runtime.try_current_or_enter();
        let mut wake = Vec::new();
        {
            let core = self.core.lock();
            if !core.stopped {
                drop(self.turn_inline(core, &mut wake));
            }
        }
        wake.into_iter().for_each(Waker::wake);
    }
}

/// Enter a runtime only where the thread is in none.
trait EnterIfOutside {
    fn try_current_or_enter(&self) -> Option<tokio::runtime::EnterGuard<'_>>;
}

impl EnterIfOutside for tokio::runtime::Handle {
    fn try_current_or_enter(&self) -> Option<tokio::runtime::EnterGuard<'_>> {
        match tokio::runtime::Handle::try_current() {
            Ok(_) => None,
            Err(_) => Some(self.enter()),
        }
    }
}

/// The driver's state: the endpoint and everything that carries out its outputs.
/// Behind [`Shared::core`]; a turn runs with the lock held, never across an `.await`.
pub(super) struct Core {
    pub(super) name: Arc<str>,
    pub(super) ep: Endpoint,
    pub(super) local: Arc<dyn BlockDevice>,
    pub(super) meta: Arc<dyn BlockDevice>,
    /// Where the status goes; dropped when the driver stops, so watchers see the end.
    pub(super) status: Option<watch::Sender<MirrorStatus>>,
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
    /// Requests that came through the command channel (SCSI calls), answered there.
    pub(super) waiters: FastMap<RequestId, Reply>,
    /// Answers to those of this turn, sent after the status is published.
    pub(super) replies: Vec<(Reply, LocalResult)>,
    /// Completions of this turn, for the slots (after the status is published).
    pub(super) completed: Vec<(RequestId, LocalResult)>,
    pub(super) tx: Option<Arc<dyn LinkTx>>,
    /// The receiving half of a link attached in this turn, for the task to take.
    pub(super) new_rx: Option<Box<dyn LinkRx>>,
    /// Counts link changes: a receiving half the task holds from an older count is
    /// dropped, and what it received after the change is ignored.
    pub(super) link_gen: u64,
    /// The attached link's transport, for status.
    pub(super) link_transport: Arc<str>,
    /// The send the link could not take at once (its queue is full); later messages
    /// wait in `backlog`. Nobody blocks on the link: a peer that stops reading must not
    /// stop local I/O or the peer timeout.
    pub(super) sending: Option<SendFuture>,
    pub(super) backlog: VecDeque<Message>,
    pub(super) running: FuturesUnordered<LocalFuture>,
    /// Local I/O the endpoint started and no turn has carried out yet, in the order it
    /// started them; a turn runs it [`LOCAL_IO_PER_STEP`] at a time with the lock
    /// released (what a stopped driver left here never runs).
    pub(super) fresh: VecDeque<Fresh>,
    /// What of `fresh` completed at once.
    pub(super) finished: Vec<(LocalOpId, LocalResult)>,
    /// What of `fresh` did not, on its way to `running` (kept for its allocation).
    pub(super) pending: Vec<LocalFuture>,
    /// The SCSI handler (see [`super::MirroredDisk::set_scsi_handler`]).
    pub(super) scsi: super::ScsiSlot,
    /// The peer's SCSI calls being handled, each a task of its own on the mirror's
    /// runtime: a handler may do I/O on this very mirror (a flush after a reservation
    /// changed alone), which takes the lock a turn holds, so its future is never
    /// polled inside a turn. Dropping the set aborts them.
    pub(super) scsi_running: tokio::task::JoinSet<ScsiAnswer>,
    pub(super) last_problem: Option<String>,
    /// The local replica's `data_loss_count` when the driver started, and when it last
    /// looked.
    pub(super) data_loss_base: u64,
    pub(super) data_loss_seen: u64,
    /// When this disk started (an unproven replica is unproven since then).
    pub(super) started: SystemTime,
    /// The time of the current turn (read once per round of it: the clock is not free).
    pub(super) now: Instant,
    /// The deadline the driver task sleeps until (`None`: none).
    pub(super) armed: Option<Instant>,
    /// The driver task has ended: requests fail with `Closed`.
    pub(super) stopped: bool,
    /// The runtime the mirror was started on (a turn may run on a thread outside it).
    pub(super) runtime: tokio::runtime::Handle,
    /// Where this driver's fail points fire (see [`crate::failpoints`]).
    #[cfg(feature = "failpoints")]
    pub(super) points: crate::failpoints::Site,
}

fn send_future(tx: &Arc<dyn LinkTx>, msgs: Vec<Message>) -> SendFuture {
    let tx = Arc::clone(tx);
    Box::pin(async move { tx.send_batch(msgs).await })
}

/// The driver task: waits for what only it can wait for, and runs a turn after each.
///
/// One poll looks at every source (commands, quorum answers, the link's messages, a
/// kick, the timer), takes all that is ready, runs one turn, and only then wakes the
/// callers whose requests completed: so a caller woken by this task runs as soon as the
/// task returns, with nothing of the task's between.
pub(super) async fn run(
    shared: Arc<Shared>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    mut quorum: mpsc::UnboundedReceiver<bool>,
) {
    let _stopping = Stopping(Arc::clone(&shared));
    // Once every handle is gone, finish what is in flight, then stop.
    let mut handles_gone = false;
    let mut rx: Option<Receiving> = None;
    let kick = Arc::clone(&shared.kick);
    let mut kicked = std::pin::pin!(kick.notify.notified());
    let mut sleep = std::pin::pin!(tokio::time::sleep_until(tokio::time::Instant::now()));
    let mut sleeping_until: Option<Instant> = None;
    let mut wake = Vec::new();
    poll_fn(|cx| {
        loop {
            let mut moved = false;
            if !handles_gone {
                loop {
                    match commands.poll_recv(cx) {
                        Poll::Ready(Some(cmd)) => shared.core.lock().command(cmd),
                        Poll::Ready(None) => {
                            handles_gone = true;
                            shared.core.lock().ep.begin_shutdown(Instant::now());
                        }
                        Poll::Pending => break,
                    }
                    moved = true;
                    if handles_gone {
                        break;
                    }
                }
            }
            while let Poll::Ready(Some(granted)) = quorum.poll_recv(cx) {
                shared.core.lock().ep.handle_quorum(Instant::now(), granted);
                moved = true;
            }
            // Every message already here, so one turn (and one batch of frames)
            // serves them all.
            while let Some(r) = rx.as_mut() {
                let Poll::Ready(Some((first, more))) = r.messages.as_mut().poll_next(cx) else {
                    break;
                };
                let mut core = shared.core.lock();
                let now = Instant::now();
                let current = std::iter::once(first)
                    .chain(more)
                    .all(|msg| core.link_message(r.link, msg, now));
                drop(core);
                if !current {
                    rx = None;
                }
                moved = true;
            }
            if kicked.as_mut().poll(cx).is_ready() {
                // (The new one registers when polled, in the next round.)
                kicked.set(kick.notify.notified());
                moved = true;
            }
            if sleeping_until.is_some() && sleep.as_mut().poll(cx).is_ready() {
                sleeping_until = None;
                let mut core = shared.core.lock();
                let now = Instant::now();
                if core.ep.poll_timeout().is_some_and(|d| d <= now) {
                    core.ep.handle_timeout(now);
                }
                moved = true;
            }
            let mut core = shared.core.lock();
            // A link a command attached: its receiving half is polled in the next round.
            moved |= core.take_rx(&mut rx);
            let mut core = shared.turn(core, cx);
            core.take_completions(&shared.slots, &mut wake);
            let finished = (handles_gone || !core.closing.is_empty())
                && core.ep.is_shut_down()
                && core.running.is_empty();
            // Sleep until the endpoint's deadline, or an earlier one already armed
            // (waking early only costs a look; moving the timer every turn would cost
            // more).
            let due = core.ep.poll_timeout();
            let at = match (due, sleeping_until) {
                (Some(d), Some(s)) if s <= d && s > core.now => Some(s),
                (d, _) => d,
            };
            core.armed = at;
            drop(core);
            if at != sleeping_until {
                sleeping_until = at;
                if let Some(at) = at {
                    sleep.as_mut().reset(tokio::time::Instant::from_std(at));
                    // Registers when polled, in the next round.
                    moved = true;
                }
            }
            // Last: a caller woken here runs as soon as this poll returns.
            wake.drain(..).for_each(Waker::wake);
            if finished {
                return Poll::Ready(());
            }
            if !moved {
                return Poll::Pending;
            }
        }
    })
    .await;
    let mut core = shared.core.lock();
    core.retire_link();
    let failed = core.ep.meta_failed();
    let name = Arc::clone(&core.name);
    for done in core.closing.drain(..) {
        let result = if failed {
            Err(Error::new(
                ErrorKind::Io,
                format!("disk {name}: the metadata could not be written; it is not marked clean"),
            ))
        } else {
            Ok(())
        };
        let _ = done.send(result);
    }
    drop(core);
    // `_stopping` does the rest as it drops.
}

/// Stops the mirror when the driver task ends, and also when its future is dropped
/// without ending (its runtime shut down: the process "died"): no turn runs after it,
/// so nothing more is written or sent; requests waiting and submitted later fail with
/// `Closed`; the status sender is dropped, so watchers see the end.
struct Stopping(Arc<Shared>);

impl Drop for Stopping {
    fn drop(&mut self) {
        let mut core = self.0.core.lock();
        core.stopped = true;
        // A link still here was not retired (the task did not end): drop it as it is.
        core.tx = None;
        core.new_rx = None;
        core.sending = None;
        core.backlog.clear();
        // Dropping the sender stops the witness worker once it is idle.
        core.witness = None;
        core.status = None;
        core.closing.clear();
        drop(core);
        let mut wake = Vec::new();
        self.0.slots.lock().fail_all(ErrorKind::Closed, &mut wake);
        wake.into_iter().for_each(Waker::wake);
    }
}

impl Core {
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

    /// The task's receiving half: the one attached since the last look (then `true`),
    /// or none once the link it came from is gone.
    fn take_rx(&mut self, rx: &mut Option<Receiving>) -> bool {
        if let Some(new) = self.new_rx.take() {
            *rx = Some(Receiving::new(self.link_gen, new));
            return true;
        }
        if rx.as_ref().is_some_and(|r| r.link != self.link_gen) {
            *rx = None;
        }
        false
    }

    /// What the task received on the link of count `link`; whether that link is still
    /// the current one afterwards (else its receiving half is dropped).
    fn link_message(&mut self, link: u64, msg: Result<Message>, now: Instant) -> bool {
        // A link dropped or replaced since counts for nothing.
        if link == self.link_gen {
            match msg {
                Ok(m) => self.peer_message(m, now),
                Err(e) => {
                    let reason = e.to_string();
                    self.drop_link();
                    self.ep.handle_disconnected(now, &reason);
                }
            }
        }
        // (A link attached meanwhile is taken at the next turn.)
        link == self.link_gen
    }

    /// A message from the peer (fail point `mirror::recv_ack` may drop an ack).
    fn peer_message(&mut self, m: Message, now: Instant) {
        #[cfg(feature = "failpoints")]
        if self.points.ack_lost(&m) {
            return;
        }
        self.ep.handle_message(now, m);
    }

    /// A local operation finished. The replica bumps its loss count before it completes
    /// anything that could show lost data, so looking first means the endpoint never
    /// takes such a result for good.
    fn local_done(&mut self, op: LocalOpId, res: LocalResult) {
        self.check_data_loss();
        self.ep.handle_local_done(self.now, op, res);
    }

    fn command(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
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
                self.link_gen += 1;
                self.tx = Some(Arc::from(tx));
                self.new_rx = Some(rx);
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
        self.new_rx = None;
        self.link_gen += 1;
        self.sending = None;
        self.backlog.clear();
    }

    /// Hand the link every message it takes without waiting.
    fn pump_sends(&mut self, cx: &mut Context<'_>) {
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
            match fut.poll_unpin(cx) {
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
        self.new_rx = None;
        self.link_gen += 1;
        let (Some(tx), sending, backlog) = (
            self.tx.take(),
            self.sending.take(),
            std::mem::take(&mut self.backlog),
        ) else {
            return;
        };
        self.runtime.spawn(async move {
            if let Some(f) = sending {
                let _ = f.await;
            }
            let _ = tx.send_batch(backlog.into()).await;
            let _ = tx.close().await;
        });
    }

    /// Act on one endpoint event; `stale` events belong to a link already replaced and
    /// must not retire the current one.
    fn on_event(&mut self, ev: Event, stale: bool) {
        match ev {
            Event::Completed { request, result } => match self.waiters.remove(&request) {
                Some(w) => self.replies.push((w, result)),
                None => self.completed.push((request, result)),
            },
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
                let Some(h) = handler else {
                    self.ep
                        .reply_scsi(self.now, epoch, id, Err(ErrorKind::NotSupported));
                    return;
                };
                // Started here, in link order; run as a task of its own.
                let call = std::panic::AssertUnwindSafe(h.call(body));
                let name = Arc::clone(&self.name);
                self.scsi_running.spawn_on(
                    async move {
                        let answer = call.catch_unwind().await.unwrap_or_else(|_| {
                            error!(disk = %name, "the SCSI handler panicked on a call of the peer's");
                            Err(ErrorKind::Io)
                        });
                        (epoch, id, answer)
                    },
                    &self.runtime,
                );
            }
        }
    }

    /// Local I/O, sends and SCSI calls that finished since they were last polled (each
    /// registers `cx`'s waker while it runs): `Ready` when something finished.
    fn poll_running(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut moved = false;
        // (An empty set is not polled: a poll registers the waker, which costs, and a
        // future joins the set only in a turn that polls it.)
        while !self.running.is_empty()
            && let Poll::Ready(Some((op, res))) = self.running.poll_next_unpin(cx)
        {
            self.local_done(op, res);
            moved = true;
        }
        if let Some(f) = self.sending.as_mut()
            && let Poll::Ready(r) = f.poll_unpin(cx)
        {
            self.sending = None;
            self.sent(r);
            moved = true;
        }
        while !self.scsi_running.is_empty()
            && let Poll::Ready(Some(done)) = self.scsi_running.poll_join_next(cx)
        {
            // A task of the set ends only by answering (a panic is caught inside it) or
            // by being aborted, which only dropping the set does.
            if let Ok((epoch, id, res)) = done {
                self.ep.reply_scsi(self.now, epoch, id, res);
            }
            moved = true;
        }
        if moved {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Carry out the endpoint's outputs: messages first (the peer starts its half while
    /// this node does its own), then local I/O, then events. Whether anything moved.
    fn drain(&mut self, cx: &mut Context<'_>) -> bool {
        let mut any = false;
        loop {
            let mut moved = false;
            while let Some(m) = self.ep.poll_transmit() {
                moved = true;
                if self.tx.is_some() {
                    self.backlog.push_back(m);
                }
            }
            self.pump_sends(cx);
            while let Some(io) = self.ep.poll_local_io() {
                moved = true;
                #[cfg(feature = "failpoints")]
                if let Some((op, kind)) = self.points.local_io(&io) {
                    self.fresh
                        .push_back(Fresh::Started(Box::pin(std::future::ready((
                            op,
                            Err(kind),
                        )))));
                    continue;
                }
                self.fresh.push_back(Fresh::Io(io));
            }
            while let Some(ev) = self.stale_events.pop_front() {
                moved = true;
                self.on_event(ev, true);
            }
            while let Some(ev) = self.ep.poll_event() {
                moved = true;
                self.on_event(ev, false);
            }
            if !moved {
                return any;
            }
            any = true;
        }
    }

    /// Progress and status after a turn. Operator answers go out here, after the status
    /// shows their effect.
    fn publish(&mut self) {
        let now_t = self.now;
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
        if let Some(status) = &self.status {
            status.send_if_modified(|s| {
                if *s != now {
                    *s = now;
                    true
                } else {
                    false
                }
            });
        }
        // Completions last, so a caller that looks at the status after its request
        // completed sees the state the completion came from.
        for (w, result) in self.replies.drain(..) {
            let _ = w.send(result);
        }
        for (done, result) in self.operator_replies.drain(..) {
            let _ = done.send(result);
        }
    }

    /// Fill the slots of this turn's completions (after the status was published, so a
    /// caller that looks at it after its request completed sees the state the
    /// completion came from); their wakers go to `wake`, to be woken once the lock is
    /// released.
    fn take_completions(&mut self, slots: &Mutex<Slots>, wake: &mut Vec<Waker>) {
        if self.completed.is_empty() {
            return;
        }
        let mut slots = slots.lock();
        for (req, result) in self.completed.drain(..) {
            wake.extend(slots.fill(req, result));
        }
    }
}

/// The receiving half of the task's link as a stream of its messages: it owns the half
/// and lives across polls (a transport's wake-up may belong to the wait for the next
/// message, so a wait dropped between polls could lose it).
struct Receiving {
    /// The link's count (`Core::link_gen` when it was attached).
    link: u64,
    messages: Messages,
}

/// A link's messages, read one after another from its receiving half: each item the
/// message one wait brought, with the ones that arrived with it.
type Messages = std::pin::Pin<Box<dyn futures_util::Stream<Item = Batch> + Send>>;

/// A message received, and those already there behind it (in order).
type Batch = (Result<Message>, Vec<Result<Message>>);

impl Receiving {
    fn new(link: u64, half: Box<dyn LinkRx>) -> Receiving {
        Receiving {
            link,
            messages: Box::pin(futures_util::stream::unfold(half, |mut half| async move {
                let first = half.recv().await;
                // What the same read brought in besides, without a future each.
                let mut more = Vec::new();
                if first.is_ok() {
                    while let Some(m) = half.try_recv() {
                        if more.is_empty() {
                            // (Room for a typical batch at once, not a growth per push.)
                            more.reserve(16);
                        }
                        let failed = m.is_err();
                        more.push(m);
                        if failed {
                            break;
                        }
                    }
                }
                Some(((first, more), half))
            })),
        }
    }
}

/// Local I/O a turn started, carried out once the lock is released.
pub(super) enum Fresh {
    /// Not started yet: tried at once ([`local_now`]), else as a future.
    Io(LocalIo),
    /// Already a future (a fail point's answer).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    Started(LocalFuture),
}

/// `io` carried out on the spot, where the device can ([`BlockDevice::try_write_now`]:
/// a write into the page cache), with no future; `None` where it cannot (nothing was
/// done). A panic in the device fails the I/O, as in [`run_local`].
fn local_now(disk: &str, dev: &dyn BlockDevice, io: &LocalIo) -> Option<(LocalOpId, LocalResult)> {
    let LocalIo::Write {
        op,
        offset,
        payload: WritePayload::Data(data),
        fua,
    } = io
    else {
        return None;
    };
    let flags = if *fua { IoFlags::FUA } else { IoFlags::empty() };
    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        dev.try_write_now(*offset, data, flags)
    }));
    match tried {
        Ok(r) => r.map(|r| (*op, r.map(|()| None).map_err(|e| e.kind()))),
        Err(_) => {
            error!(disk = %disk, "a local I/O panicked in the device: failed as an I/O error");
            Some((*op, Err(ErrorKind::Io)))
        }
    }
}

/// The local I/O `io` as a future. A device that panics fails that I/O with
/// `ErrorKind::Io` (the endpoint detaches the replica, as for any I/O error) instead of
/// unwinding through whichever caller's turn polled it, which would lose the turn's
/// other I/O and leave their requests waiting.
fn run_local(
    disk: Arc<str>,
    dev: Arc<dyn BlockDevice>,
    meta: Arc<dyn BlockDevice>,
    io: LocalIo,
) -> LocalFuture {
    let op = io.op();
    let fut = std::panic::AssertUnwindSafe(local_io(dev, meta, io));
    Box::pin(async move {
        fut.catch_unwind().await.unwrap_or_else(|_| {
            error!(disk = %disk, "a local I/O panicked in the device: failed as an I/O error");
            (op, Err(ErrorKind::Io))
        })
    })
}

async fn local_io(
    dev: Arc<dyn BlockDevice>,
    meta: Arc<dyn BlockDevice>,
    io: LocalIo,
) -> (LocalOpId, LocalResult) {
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
}
