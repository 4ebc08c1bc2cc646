//! The SCSI layer in the simulation (issue 20): each node's real [`LogicalUnit`] over its
//! simulated endpoint, the two units talking over the endpoints' SCSI channel, and
//! initiators logged in through both nodes that write, read, COMPARE AND WRITE and
//! change the persistent reservations.
//!
//! # How the units run
//!
//! A unit is async code; the simulation has no runtime. `Exec` is a tiny executor of
//! its own: the tasks woken at one simulated instant are polled in the order of their
//! ids, or (`run_scsi_shuffled`) in an order drawn from the seed, since a real runtime
//! may run a reply's waiter before or after a call that came in behind the reply; a
//! run stays a pure function of its seed. A unit reaches its node only
//! through the `Shared` queues: its [`BlockDevice`] (`SimDevice`) and its
//! [`ScsiPeer`] (`SimPeer`) push requests there, the simulation submits them to the
//! node's endpoint and completes them from the endpoint's events, and whatever the unit
//! spawns ([`ScsiPeer::spawn`]) becomes a task of the node. A crash drops the node's
//! unit and every task of it. The persistent reservation state goes to a `Store` per
//! node, which survives crashes (saved at once and atomically, as the state file's
//! rename is); a restarted node loads it as a power on does.
//!
//! What the simulation re-does from the node (`vsan-ffi`'s ALUA follower): on every new
//! link the unit settles the reservation state with the other node
//! ([`LogicalUnit::peer_connected`]), its port group transitioning meanwhile when
//! [`LogicalUnit::must_settle`]; a failed exchange is tried again 250 ms later; a link
//! that goes takes with it what the unit owned and granted for COMPARE AND WRITE
//! ([`LogicalUnit::peer_lost`]). The other NOT READY states the follower reports
//! (replica not proven, quorum lost) are left to the endpoint, which holds or fails the
//! requests itself. The initiators' transport is re-done too: a command whose nexus's
//! tasks are aborted (PREEMPT AND ABORT, a reset) is ended without an answer.
//!
//! # What is checked (besides the data rules of [`super::history`])
//!
//! - A COMPARE AND WRITE that succeeded read its expected value: the value must be one
//!   a read in the same window may return; and at most one CAW wins per expected value
//!   of a sector, unless a power cut in between may have undone the first one's write.
//! - Writes (and CAWs) refused with RESERVATION CONFLICT, MISCOMPARE or a unit attention
//!   are never applied on either replica (no read, and not the final image, may show
//!   them).
//! - Every write acknowledged GOOD was allowed by a reservation state that held at some
//!   instant between its submission and its acknowledgement (see `PrModel`).
//! - After the run both units hold the same reservation state, and it is one that the
//!   acknowledged PERSISTENT RESERVE OUT commands imply.
//! - A COMPARE AND WRITE that succeeded held its sector alone: no other write's or
//!   CAW's requests to the endpoint on that sector ran between the CAW's read and its
//!   end, on its own node, nor on the other node while both mirrored on one link
//!   (`Window`; the unit's stripe lock and the stripe's ownership across the pair).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::sync::oneshot;
use vsan_core::device::IoFuture;
use vsan_core::scsi::pr::{AccessClass, PrOut};
use vsan_core::scsi::{
    AluaState, BackgroundTask, Command, LogicalUnit, LuConfig, LuIdentity, Nexus, NexusHandle,
    PeerLink, PortGroup, PrState, PrStore, Response, ScsiPeer, SenseKey, Status, TargetPort,
};
use vsan_core::{BlockDevice, Error, ErrorKind, Geometry, IoFlags};
use vsan_replica::protocol::WritePayload;

use rand::Rng;

use super::history::SECTOR;
use super::{Ev, LinkState, Sim, SyncRole};

/// Initiators; each has a nexus through both nodes.
pub(crate) const INITIATORS: usize = 3;

/// A request a unit made of its node.
pub(crate) enum IoReq {
    /// Read from the mirror.
    Read { offset: u64, len: u32 },
    /// Write to the mirror.
    Write {
        offset: u64,
        payload: WritePayload,
        fua: bool,
    },
    /// Flush the mirror.
    Flush,
    /// A call to the other node's unit.
    Call(Bytes),
}

/// Where a request's outcome goes.
pub(crate) type Reply = oneshot::Sender<Result<Option<Bytes>, ErrorKind>>;

/// What a node's unit and the simulation exchange.
pub(crate) struct Shared {
    /// Requests for the node's endpoint, in the order the unit made them, with the
    /// executor's task that made each.
    pub io: VecDeque<(IoReq, Reply, u64)>,
    /// Tasks the unit spawned.
    pub spawned: Vec<BackgroundTask>,
    /// The mirror link as the unit sees it (set by the simulation after each step).
    pub link: PeerLink,
    /// The endpoint's link epoch (0 while none is up).
    pub link_id: u64,
}

type SharedRef = Arc<Mutex<Shared>>;

fn request(
    shared: &SharedRef,
    req: IoReq,
) -> impl Future<Output = vsan_core::Result<Option<Bytes>>> + use<> {
    let (tx, rx) = oneshot::channel();
    let task = POLLING.with(std::cell::Cell::get);
    shared.lock().unwrap().io.push_back((req, tx, task));
    async move {
        match rx.await {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(kind)) => Err(Error::new(kind, "simulated mirror")),
            Err(_) => Err(Error::new(ErrorKind::Closed, "the node went down")),
        }
    }
}

/// The mirror as a unit's block device.
struct SimDevice {
    geometry: Geometry,
    shared: SharedRef,
}

impl BlockDevice for SimDevice {
    fn geometry(&self) -> Geometry {
        self.geometry
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        let f = request(
            &self.shared,
            IoReq::Read {
                offset,
                len: len as u32,
            },
        );
        Box::pin(async move {
            f.await?
                .ok_or_else(|| Error::new(ErrorKind::Io, "a read returned no data"))
        })
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_req(offset, WritePayload::Data(data), flags)
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        let f = request(&self.shared, IoReq::Flush);
        Box::pin(async move { f.await.map(|_| ()) })
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_req(offset, WritePayload::Discard { len }, flags)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        self.write_req(offset, WritePayload::Zeroes { len }, flags)
    }
}

impl SimDevice {
    fn write_req(&self, offset: u64, payload: WritePayload, flags: IoFlags) -> IoFuture<'_, ()> {
        let f = request(
            &self.shared,
            IoReq::Write {
                offset,
                payload,
                fua: flags.contains(IoFlags::FUA),
            },
        );
        Box::pin(async move { f.await.map(|_| ()) })
    }
}

/// The other node, through the node's endpoint.
struct SimPeer {
    resolver: bool,
    shared: SharedRef,
}

impl ScsiPeer for SimPeer {
    fn is_resolver(&self) -> bool {
        self.resolver
    }

    fn link(&self) -> PeerLink {
        self.shared.lock().unwrap().link
    }

    fn call(&self, msg: Bytes) -> IoFuture<'_, Bytes> {
        let f = request(&self.shared, IoReq::Call(msg));
        Box::pin(async move { f.await.map(Option::unwrap_or_default) })
    }

    fn changed_alone(&self) -> IoFuture<'_, ()> {
        let f = request(&self.shared, IoReq::Flush);
        Box::pin(async move { f.await.map(|_| ()) })
    }

    fn link_id(&self) -> u64 {
        self.shared.lock().unwrap().link_id
    }

    fn spawn(&self, task: BackgroundTask) {
        self.shared.lock().unwrap().spawned.push(task);
    }
}

/// A node's durable reservation state (survives its crashes).
#[derive(Default)]
pub(crate) struct Store {
    saved: Mutex<Option<Vec<u8>>>,
}

impl PrStore for Store {
    fn save<'a>(&'a self, state: &'a PrState) -> IoFuture<'a, ()> {
        *self.saved.lock().unwrap() = Some(state.encode());
        Box::pin(std::future::ready(Ok(())))
    }
}

impl Store {
    /// The saved state as a start reads it (a power on: only APTPL state is kept).
    fn load(&self) -> PrState {
        let mut s = match &*self.saved.lock().unwrap() {
            Some(b) => PrState::decode(b).expect("the simulation's saved PR state decodes"),
            None => PrState::new(),
        };
        s.power_on();
        s
    }
}

/// Initiator `i`'s nexus through the port of node `node_id`.
pub(crate) fn nexus(i: usize, node_id: u32) -> Nexus {
    let port = format!("iqn.2026-12.sim:init{i},i,0x00023d00000{i}");
    Nexus {
        transport_id: Bytes::from(port.clone().into_bytes()),
        initiator_port: port,
        relative_target_port: node_id as u16,
    }
}

/// One node's unit (one incarnation of it).
pub(crate) struct Unit {
    /// The unit.
    pub lu: Arc<LogicalUnit>,
    /// Its queues.
    pub shared: SharedRef,
    /// Each initiator's nexus here.
    pub nexuses: Vec<Arc<NexusHandle>>,
    /// The link whose reservation state is settled or being settled.
    pub epoch: Option<u64>,
    /// The port group is transitioning until the exchange ends.
    pub gated: bool,
    /// The exchange for `epoch` is done.
    pub settled: bool,
}

impl Unit {
    /// Node `node_id`'s unit over a disk of `size` bytes, its PR state loaded from
    /// `store`.
    pub fn start(node_id: u32, size: u64, store: &Arc<Store>) -> Unit {
        let shared = Arc::new(Mutex::new(Shared {
            io: VecDeque::new(),
            spawned: Vec::new(),
            link: PeerLink::Away,
            link_id: 0,
        }));
        let device = Arc::new(SimDevice {
            geometry: Geometry::new(size, SECTOR as u32).expect("geometry"),
            shared: shared.clone(),
        });
        let config = LuConfig {
            identity: LuIdentity::from_disk_id("sim0"),
            port: TargetPort {
                name: format!("iqn.2026-12.sim:sim0,t,0x000{node_id}"),
                relative_id: node_id as u16,
                group: node_id as u16,
            },
            read_only: false,
            state_file: None,
        };
        let lu = LogicalUnit::new(device, config).expect("a unit without a state file");
        lu.set_pr_store(store.clone());
        let loaded = store.load();
        if loaded != PrState::new() {
            // Installed before any nexus exists; saves the same state again.
            now_or_panic(lu.install_pr_state(loaded)).expect("install the saved state");
        }
        lu.set_peer(Arc::new(SimPeer {
            resolver: node_id == 1,
            shared: shared.clone(),
        }));
        let nexuses = (0..INITIATORS)
            .map(|i| Arc::new(lu.attach(nexus(i, node_id))))
            .collect();
        Unit {
            lu,
            shared,
            nexuses,
            epoch: None,
            gated: false,
            settled: false,
        }
    }

    /// The port groups the node reports now: its own as the node's follower reports it
    /// (`serving`: what `MirrorStatus::serving` says of the endpoint, then transitioning
    /// while gated), the peer's active while the link is up.
    pub fn groups(&self, node_id: u32, serving: AluaState, connected: bool) -> Vec<PortGroup> {
        let own = if self.gated && serving == AluaState::ActiveOptimized {
            AluaState::Transitioning
        } else {
            serving
        };
        let peer = if connected {
            AluaState::ActiveOptimized
        } else {
            AluaState::Unavailable
        };
        let mut g = vec![
            PortGroup {
                id: node_id as u16,
                state: own,
                relative_ports: vec![node_id as u16],
            },
            PortGroup {
                id: 3 - node_id as u16,
                state: peer,
                relative_ports: vec![3 - node_id as u16],
            },
        ];
        g.sort_by_key(|g| g.id);
        g
    }
}

fn now_or_panic<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("expected to complete at once"),
    }
}

// ----- the executor -----

/// What a finished task tells the simulation.
pub(crate) enum Out {
    /// Nothing (a background task of a unit).
    Nothing,
    /// The answer to the other node's call `id` on link `epoch`.
    Reply {
        node: usize,
        epoch: u64,
        id: u64,
        result: Result<Bytes, ErrorKind>,
    },
    /// An initiator's command ended: its response, or `None` when its nexus's tasks
    /// were aborted first.
    Cmd {
        node: usize,
        token: u64,
        response: Option<Response>,
    },
    /// The reservation state exchange of link `epoch` ended.
    Settled {
        node: usize,
        epoch: u64,
        result: Result<(), ErrorKind>,
    },
}

type Task = Pin<Box<dyn Future<Output = Out>>>;

thread_local! {
    /// The id of the task [`Exec::run_once`] polls now (0: none), for the requests it
    /// makes (a seed runs on one thread).
    static POLLING: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

struct Woken {
    id: u64,
    set: Arc<Mutex<BTreeSet<u64>>>,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.set.lock().unwrap().insert(self.id);
    }
}

/// See the module docs.
#[derive(Default)]
pub(crate) struct Exec {
    next: u64,
    tasks: BTreeMap<u64, (usize, Task)>,
    woken: Arc<Mutex<BTreeSet<u64>>>,
    /// Orders the tasks woken at one instant (from the seed).
    rng: Option<rand::rngs::SmallRng>,
}

impl Exec {
    /// An executor that polls the tasks woken at one instant in an order drawn from
    /// `seed` (a real runtime runs them in any order: a reply's waiter and a call that
    /// came in after it, say).
    pub fn seeded(seed: u64) -> Exec {
        use rand::SeedableRng;
        Exec {
            rng: Some(rand::rngs::SmallRng::seed_from_u64(seed)),
            ..Exec::default()
        }
    }

    /// Run `f` as a task of node `node`; returns its id.
    pub fn spawn(&mut self, node: usize, f: impl Future<Output = Out> + 'static) -> u64 {
        self.next += 1;
        self.tasks.insert(self.next, (node, Box::pin(f)));
        self.woken.lock().unwrap().insert(self.next);
        self.next
    }

    /// Drop every task of node `node` (it crashed).
    pub fn drop_node(&mut self, node: usize) {
        let gone: Vec<u64> = self
            .tasks
            .iter()
            .filter(|(_, (n, _))| *n == node)
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.tasks.remove(&id);
        }
    }

    /// Poll the woken tasks once each, in id order; returns whether any was polled and
    /// the outputs of those that finished.
    pub fn run_once(&mut self) -> (bool, Vec<Out>) {
        let mut woken: Vec<u64> = std::mem::take(&mut *self.woken.lock().unwrap())
            .into_iter()
            .collect();
        if let Some(rng) = self.rng.as_mut() {
            use rand::seq::SliceRandom;
            woken.shuffle(rng);
        }
        let mut outs = Vec::new();
        let mut polled = false;
        for id in woken {
            let Some((_, task)) = self.tasks.get_mut(&id) else {
                continue;
            };
            polled = true;
            let waker = Waker::from(Arc::new(Woken {
                id,
                set: self.woken.clone(),
            }));
            POLLING.with(|p| p.set(id));
            let polled = task.as_mut().poll(&mut Context::from_waker(&waker));
            POLLING.with(|p| p.set(0));
            if let Poll::Ready(out) = polled {
                self.tasks.remove(&id);
                outs.push(out);
            }
        }
        (polled, outs)
    }

    /// Tasks of node `node` alive.
    pub fn count(&self, node: usize) -> usize {
        self.tasks.values().filter(|(n, _)| *n == node).count()
    }
}

/// Run `command` for `nexus` on `lu` as the iSCSI transport does: a task aborted while
/// it runs (PREEMPT AND ABORT, a reset from elsewhere) still runs to its end, and then
/// gets no answer (`None`).
pub(crate) async fn command_run(
    lu: Arc<LogicalUnit>,
    nexus: Arc<NexusHandle>,
    command: Command,
) -> Option<Response> {
    let aborts = nexus.aborts();
    let r = lu.execute(&nexus, command).await;
    if aborts.has_changed().unwrap_or(true) {
        None
    } else {
        Some(r)
    }
}

// ----- commands -----

/// A READ(10) or WRITE(10) CDB.
fn rw10(op: u8, flags: u8, lba: u64, blocks: u64) -> Bytes {
    let mut cdb = vec![op, flags];
    cdb.extend_from_slice(&(lba as u32).to_be_bytes());
    cdb.push(0);
    cdb.extend_from_slice(&(blocks as u16).to_be_bytes());
    cdb.push(0);
    cdb.into()
}

/// WRITE(10) of `blocks` blocks at `lba`.
pub(crate) fn write10(lba: u64, blocks: u64, fua: bool, data: Bytes) -> Command {
    Command {
        cdb: rw10(0x2a, if fua { 0x08 } else { 0 }, lba, blocks),
        data_out: data,
        expected_in: 0,
    }
}

/// READ(10).
pub(crate) fn read10(lba: u64, blocks: u64) -> Command {
    Command {
        cdb: rw10(0x28, 0, lba, blocks),
        data_out: Bytes::new(),
        expected_in: (blocks * SECTOR) as u32,
    }
}

/// COMPARE AND WRITE of one block: `expected` then `new`.
pub(crate) fn caw(lba: u64, expected: &[u8], new: &[u8]) -> Command {
    let mut cdb = vec![0x89, 0];
    cdb.extend_from_slice(&lba.to_be_bytes());
    cdb.extend_from_slice(&[0, 0, 0, 1, 0, 0]);
    let mut data = BytesMut::with_capacity(expected.len() + new.len());
    data.put_slice(expected);
    data.put_slice(new);
    Command {
        cdb: cdb.into(),
        data_out: data.freeze(),
        expected_in: 0,
    }
}

/// SYNCHRONIZE CACHE(10) of the whole disk.
pub(crate) fn sync_cache() -> Command {
    Command {
        cdb: Bytes::from_static(&[0x35, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
        data_out: Bytes::new(),
        expected_in: 0,
    }
}

/// PERSISTENT RESERVE OUT: service action, type, key, service action key, with
/// ALL_TG_PT (the registration holds through both nodes) and `aptpl`.
pub(crate) fn pr_out(action: u8, kind: u8, key: u64, sa_key: u64, aptpl: bool) -> Command {
    let mut cdb = vec![0x5f, action, kind, 0, 0];
    cdb.extend_from_slice(&24u32.to_be_bytes());
    cdb.push(0);
    let mut data = vec![0u8; 24];
    data[..8].copy_from_slice(&key.to_be_bytes());
    data[8..16].copy_from_slice(&sa_key.to_be_bytes());
    data[20] = 0x04 | u8::from(aptpl);
    Command {
        cdb: cdb.into(),
        data_out: data.into(),
        expected_in: 0,
    }
}

/// How a command was refused before it could change anything, if it was: RESERVATION
/// CONFLICT, a unit attention, or MISCOMPARE.
pub(crate) fn refused(r: &Response) -> Option<&'static str> {
    match r.status {
        Status::ReservationConflict => Some("reservation conflict"),
        Status::CheckCondition => match sense_key(r) {
            Some(SenseKey::UnitAttention) => Some("unit attention"),
            Some(SenseKey::Miscompare) => Some("miscompare"),
            _ => None,
        },
        _ => None,
    }
}

/// The sense key of a CHECK CONDITION (fixed or descriptor format).
pub(crate) fn sense_key(r: &Response) -> Option<SenseKey> {
    let s = &r.sense;
    let code = *s.first()? & 0x7f;
    let key = match code {
        0x70 | 0x71 => *s.get(2)? & 0x0f,
        0x72 | 0x73 => *s.get(1)? & 0x0f,
        _ => return None,
    };
    SenseKey::from_u8(key)
}

// ----- the reservation model -----

/// The reservation states the acknowledged PERSISTENT RESERVE OUT commands allow, over
/// time. Each command moves the model from one set of candidate states to the next: one
/// acknowledged GOOD is applied to every candidate that accepts it (at least one must);
/// one that failed or was never answered may or may not have been applied, so both
/// stay. A start of a node may be a power on of the unit (the other node was down):
/// the power-on forms join the candidates. The state a set stands for may hold from
/// the submission of the command that made it until the end of the next one.
#[derive(Debug)]
pub(crate) struct PrModel {
    /// (from, until, candidates), in order.
    epochs: Vec<(Duration, Option<Duration>, Vec<PrState>)>,
    /// When nodes started.
    starts: Vec<Duration>,
}

impl Default for PrModel {
    fn default() -> Self {
        PrModel {
            epochs: vec![(Duration::ZERO, None, vec![PrState::new()])],
            starts: Vec::new(),
        }
    }
}

/// A reservation state in one line: generation, APTPL, registrations (id:key@initiator),
/// reservation.
pub(crate) fn brief(s: &PrState) -> String {
    let regs: Vec<String> = s
        .registrations
        .iter()
        .map(|r| {
            let who = r
                .initiator_port
                .split(',')
                .next()
                .and_then(|n| n.rsplit(':').next())
                .unwrap_or("?");
            format!("{}:{:#x}@{who}", r.id, r.key)
        })
        .collect();
    format!(
        "gen {} aptpl {} regs [{}] res {:?}",
        s.generation,
        s.aptpl,
        regs.join(" "),
        s.reservation.map(|r| (r.kind, r.holder))
    )
}

/// What an initiator can learn of a state (PR IN): the generation, APTPL, the
/// registrations in order, the reservation with its holder by position.
#[allow(clippy::type_complexity)]
fn observable(
    s: &PrState,
) -> (
    u32,
    bool,
    Vec<(u64, String, u16, bool, bool)>,
    Option<(u8, Option<usize>)>,
) {
    let regs = s
        .registrations
        .iter()
        .map(|r| {
            (
                r.key,
                r.initiator_port.clone(),
                r.relative_target_port,
                r.all_tg_pt,
                r.name_only,
            )
        })
        .collect();
    let res = s.reservation.map(|r| {
        (
            r.kind as u8,
            s.registrations.iter().position(|g| g.id == r.holder),
        )
    });
    (s.generation, s.aptpl, regs, res)
}

fn briefs(v: &[PrState]) -> String {
    v.iter().map(brief).collect::<Vec<_>>().join(" | ")
}

fn dedup(v: Vec<PrState>) -> Vec<PrState> {
    let mut out: Vec<PrState> = Vec::new();
    for s in v {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

impl PrModel {
    fn current(&self) -> &[PrState] {
        &self.epochs.last().expect("an epoch").2
    }

    fn next(&mut self, from: Duration, until: Duration, states: Vec<PrState>) {
        if let Some(last) = self.epochs.last_mut() {
            last.1 = Some(until);
        }
        self.epochs.push((from, None, dedup(states)));
    }

    /// A PERSISTENT RESERVE OUT from `nexus`, submitted at `submit`, ended at `end`,
    /// `good` when acknowledged GOOD.
    pub fn pr_out(
        &mut self,
        nexus: &Nexus,
        command: &Command,
        good: bool,
        submit: Duration,
        end: Duration,
    ) -> Result<(), String> {
        let op = PrOut::decode(&command.cdb, &command.data_out)
            .map_err(|s| format!("the simulation sent a bad PR OUT: {s:?}"))?;
        let mut applied = Vec::new();
        for s in self.current() {
            let mut s = s.clone();
            if s.apply(nexus, &op, true).is_ok() {
                applied.push(s);
            }
        }
        // A node that started while it ran may have loaded it and powered on.
        if self.starts.iter().any(|t| *t >= submit && *t <= end) {
            let on: Vec<PrState> = applied
                .iter()
                .map(|s| {
                    let mut s = s.clone();
                    s.power_on();
                    s
                })
                .collect();
            applied.extend(on);
        }
        if good {
            if applied.is_empty() {
                return Err(format!(
                    "PERSISTENT RESERVE OUT {op:?} from {} was acknowledged GOOD, but no \
                     reservation state the acknowledged commands allow accepts it: {}",
                    nexus.initiator_port,
                    briefs(self.current())
                ));
            }
            self.next(submit, end, applied);
        } else {
            let mut all = self.current().to_vec();
            all.extend(applied);
            self.next(submit, end, all);
        }
        Ok(())
    }

    /// A node starts at `now`: perhaps a power on of the unit.
    pub fn node_start(&mut self, now: Duration) {
        self.starts.push(now);
        let mut all = self.current().to_vec();
        for s in self.current() {
            let mut s = s.clone();
            s.power_on();
            all.push(s);
        }
        if dedup(all.clone()).len() != self.current().len() {
            self.next(now, now, all);
        }
    }

    /// Whether a write from `nexus` in flight from `submit` to `end` was allowed by a
    /// state that may have held meanwhile.
    pub fn write_allowed(&self, nexus: &Nexus, submit: Duration, end: Duration) -> bool {
        self.epochs.iter().any(|(from, until, states)| {
            *from <= end
                && until.is_none_or(|u| u >= submit)
                && states.iter().any(|s| s.allows(nexus, AccessClass::Write))
        })
    }

    /// Whether `state` is one the acknowledged commands imply now, as initiators can
    /// see it (the registrations' internal ids, and the next one, aside).
    pub fn holds(&self, state: &PrState) -> bool {
        let seen = observable(state);
        self.current().iter().any(|s| observable(s) == seen)
    }

    /// The candidates now (for messages).
    pub fn candidates(&self) -> &[PrState] {
        self.current()
    }
}

/// What an initiator's command in flight was.
#[derive(Debug, Clone)]
pub(crate) enum Cmd {
    /// A WRITE: history index, first sector, sectors, write id.
    Write {
        hist: usize,
        start: u64,
        count: u64,
        id: u64,
    },
    /// A READ.
    Read { offset: u64, len: u64 },
    /// A COMPARE AND WRITE of `sector` expecting write `expected`'s data.
    Caw {
        hist: usize,
        sector: u64,
        expected: u64,
        id: u64,
    },
    /// A SYNCHRONIZE CACHE (history flush index).
    Sync(usize),
    /// A PERSISTENT RESERVE OUT.
    Pr(Command),
}

/// An initiator's command in flight.
#[derive(Debug, Clone)]
pub(crate) struct InFlight {
    /// The initiator.
    pub initiator: usize,
    /// When it was submitted.
    pub submit: Duration,
    /// The simulation's link when it was submitted, if the nodes were together (both
    /// mirroring on it).
    pub together: Option<u64>,
    /// What it is.
    pub cmd: Cmd,
}

/// The SCSI side of a run.
#[derive(Default)]
pub(crate) struct World {
    /// Each node's saved reservation state.
    pub stores: [Arc<Store>; 2],
    /// The reservation model.
    pub model: PrModel,
    /// APTPL in this run's registrations.
    pub aptpl: bool,
    /// Commands in flight, per node, by token.
    pub cmds: [BTreeMap<u64, InFlight>; 2],
    /// The next command token.
    pub next_token: u64,
    /// A PERSISTENT RESERVE OUT is in flight (the cluster manager sends one at a time).
    pub pr_busy: bool,
    /// The value (write id) each sector was last seen holding, for CAWs to expect.
    pub known: Vec<u64>,
    /// Successful CAWs by (sector, expected write id): (submitted, ended).
    pub caw_wins: HashMap<(u64, u64), (Duration, Duration)>,
    /// Writes and CAWs acknowledged GOOD: initiator, node id, submitted, ended.
    pub acked: Vec<(usize, u32, Duration, Duration)>,
    /// Each initiator command's executor task: its node and token.
    pub task_cmd: HashMap<u64, (usize, u64)>,
    /// The lock windows of writes and CAWs (check 11), by command token.
    pub windows: BTreeMap<u64, Window>,
    /// Orders the windows' starts and ends.
    pub seq: u64,
    /// Counters: CAWs that won, that miscompared; writes refused for a conflict; PR OUTs
    /// acknowledged.
    pub stats: Stats,
}

/// What a write or a CAW holds its stripes over, as the endpoint sees it: from its first
/// request (a write's WRITE, a CAW's READ) to the command's end. A CAW that succeeded
/// must not overlap any other command's window on its sector: on the same node the
/// stripe lock excludes it, across the nodes the ownership of the stripe does, while
/// both mirror on one link (check 11).
#[derive(Debug, Clone)]
pub(crate) struct Window {
    /// The node the command came in on.
    pub node: usize,
    /// Its sectors.
    pub sectors: (u64, u64),
    /// A COMPARE AND WRITE.
    pub caw: bool,
    /// Start and end (`World::seq`; `None` while it runs).
    pub span: (u64, Option<u64>),
    /// The simulation's link at the start and at the end, if both nodes mirrored on
    /// it.
    pub together: (Option<u64>, Option<u64>),
}

/// What the SCSI side did in a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    /// COMPARE AND WRITEs that succeeded.
    pub caw_won: u64,
    /// COMPARE AND WRITEs that miscompared.
    pub caw_miscompared: u64,
    /// Commands refused with RESERVATION CONFLICT.
    pub conflicts: u64,
    /// PERSISTENT RESERVE OUTs acknowledged GOOD.
    pub pr_good: u64,
}

/// Bytes of `len` sectors from `start` as write `id` writes them.
pub(crate) fn pattern(id: u64, start: u64, count: u64) -> Bytes {
    let mut buf = BytesMut::zeroed((count * SECTOR) as usize);
    for (i, s) in buf.chunks_mut(SECTOR as usize).enumerate() {
        super::history::sector_bytes(id, start + i as u64, s);
    }
    buf.freeze()
}

/// The bytes of `sector` holding write `id`'s data (zeroes for the initial contents).
pub(crate) fn expected_bytes(id: u64, sector: u64) -> Bytes {
    if id == super::history::ZERO {
        Bytes::from(vec![0u8; SECTOR as usize])
    } else {
        pattern(id, sector, 1)
    }
}

// ----- the simulation's side -----

/// PERSISTENT RESERVE OUT service actions the cluster manager sends.
const PR_REGISTER_AND_IGNORE: u8 = 6;
const PR_RESERVE: u8 = 1;
const PR_RELEASE: u8 = 2;
const PR_CLEAR: u8 = 3;
const PR_PREEMPT: u8 = 4;
const PR_PREEMPT_AND_ABORT: u8 = 5;
/// The reservation types (WE, EA, WE-RO, EA-RO, WE-AR, EA-AR).
const PR_TYPES: [u8; 6] = [1, 3, 5, 6, 7, 8];

/// Initiator `i`'s reservation key.
fn key(i: usize) -> u64 {
    0x1000 + i as u64
}

impl Sim {
    /// Run the units until nothing moves at this instant: the follower's look at each
    /// link, the tasks woken, the requests they made.
    pub(super) fn scsi_step(&mut self) -> Result<(), String> {
        for _ in 0..100_000 {
            let mut moved = false;
            for n in 0..2 {
                moved |= self.follow(n);
            }
            for n in 0..2 {
                let Some(u) = self.nodes[n].unit.as_ref() else {
                    continue;
                };
                let spawned = std::mem::take(&mut u.shared.lock().unwrap().spawned);
                for t in spawned {
                    moved = true;
                    self.exec.spawn(n, async move {
                        t.await;
                        Out::Nothing
                    });
                }
            }
            let (polled, outs) = self.exec.run_once();
            moved |= polled;
            for o in outs {
                self.on_out(o)?;
            }
            for n in 0..2 {
                moved |= self.submit_unit_io(n)?;
            }
            if !moved {
                return Ok(());
            }
        }
        Err("the SCSI tasks keep running at one instant (a livelock)".into())
    }

    /// The node's ALUA follower (see the module docs): the link as the unit sees it,
    /// the exchange on a new link, the port groups.
    fn follow(&mut self, n: usize) -> bool {
        let node = &mut self.nodes[n];
        let (Some(ep), Some(u)) = (node.ep.as_ref(), node.unit.as_mut()) else {
            return false;
        };
        let connected = ep.state() == LinkState::Connected;
        // As the node's `peer_link` does: the link's handshake decision.
        let link = match (connected, ep.link_role()) {
            (false, _) => PeerLink::Away,
            (true, Some(SyncRole::Source)) => PeerLink::Source,
            (true, Some(SyncRole::Target)) => PeerLink::Target,
            (true, None) => PeerLink::InSync,
        };
        let epoch = ep.scsi_link();
        {
            let mut sh = u.shared.lock().unwrap();
            sh.link = link;
            sh.link_id = epoch.unwrap_or(0);
        }
        let mut settle = None;
        if epoch != u.epoch {
            if u.epoch.is_some() {
                u.lu.peer_lost();
            }
            u.epoch = epoch;
            u.settled = false;
            match epoch {
                Some(e) => {
                    u.gated = u.lu.must_settle();
                    settle = Some(e);
                }
                None => u.gated = false,
            }
        }
        // `MirrorStatus::serving`, from the same endpoint state.
        let serving = if !ep.freshness().is_current() || ep.quorum_suspended() {
            AluaState::Transitioning
        } else if !connected
            && (ep.has_quorum() == Some(false) || ep.is_detached() || ep.is_inconsistent())
        {
            AluaState::Unavailable
        } else {
            AluaState::ActiveOptimized
        };
        let groups = u.groups(node.id, serving, connected);
        if groups != u.lu.port_groups() {
            u.lu.set_port_groups(groups);
        }
        let gated = u.gated;
        let id = node.id;
        match settle {
            Some(e) => {
                tr!(
                    self,
                    format!("node {id}: link {e}: settling the reservation state (gated {gated})")
                );
                self.spawn_settle(n, e);
                true
            }
            None => false,
        }
    }

    /// Start node `n`'s reservation state exchange for link `epoch`.
    pub(super) fn spawn_settle(&mut self, n: usize, epoch: u64) {
        let Some(u) = self.nodes[n].unit.as_ref() else {
            return;
        };
        let lu = u.lu.clone();
        self.exec.spawn(n, async move {
            Out::Settled {
                node: n,
                epoch,
                result: lu.peer_connected().await.map_err(|e| e.kind()),
            }
        });
    }

    /// Submit what node `n`'s unit asked of its endpoint.
    fn submit_unit_io(&mut self, n: usize) -> Result<bool, String> {
        let Some(u) = self.nodes[n].unit.as_ref() else {
            return Ok(false);
        };
        let reqs: Vec<(IoReq, Reply, u64)> = u.shared.lock().unwrap().io.drain(..).collect();
        if reqs.is_empty() {
            return Ok(false);
        }
        let now = self.now();
        let together = self.together();
        for (req, reply, task) in reqs {
            self.open_window(n, &req, task, together);
            let Some(ep) = self.nodes[n].ep.as_mut() else {
                let _ = reply.send(Err(ErrorKind::Closed));
                continue;
            };
            let r = match req {
                IoReq::Read { offset, len } => ep.submit_read(now, offset, len),
                IoReq::Write {
                    offset,
                    payload,
                    fua,
                } => ep.submit_write(now, offset, payload, fua),
                IoReq::Flush => ep.submit_flush(now),
                IoReq::Call(body) => ep.submit_scsi(now, body),
            };
            self.nodes[n].lu_requests.insert(r, reply);
        }
        self.pump(n)?;
        Ok(true)
    }

    fn on_out(&mut self, o: Out) -> Result<(), String> {
        match o {
            Out::Nothing => Ok(()),
            Out::Reply {
                node,
                epoch,
                id,
                result,
            } => {
                let now = self.now();
                if let Some(ep) = self.nodes[node].ep.as_mut() {
                    ep.reply_scsi(now, epoch, id, result);
                }
                self.pump(node)
            }
            Out::Settled {
                node,
                epoch,
                result,
            } => {
                let id = self.nodes[node].id;
                let inc = self.nodes[node].inc;
                let Some(u) = self.nodes[node].unit.as_mut() else {
                    return Ok(());
                };
                if u.epoch != Some(epoch) {
                    return Ok(());
                }
                match result {
                    Ok(()) | Err(ErrorKind::NotSupported) => {
                        u.settled = true;
                        u.gated = false;
                        let state = brief(&u.lu.pr_state());
                        tr!(
                            self,
                            format!("node {id}: reservation state settled (link {epoch}): {state}")
                        );
                    }
                    Err(k) => {
                        tr!(
                            self,
                            format!(
                                "node {id}: reservation state exchange failed ({k:?}); again in 250 ms"
                            )
                        );
                        self.at(
                            Duration::from_millis(250),
                            Ev::ScsiSettle { node, inc, epoch },
                        );
                    }
                }
                Ok(())
            }
            Out::Cmd {
                node,
                token,
                response,
            } => {
                let Some(c) = self
                    .world
                    .as_mut()
                    .and_then(|w| w.cmds[node].remove(&token))
                else {
                    return Err(format!("a command ended that was not in flight ({token})"));
                };
                let good = response.as_ref().is_some_and(|r| r.status == Status::Good);
                self.close_window(token, good)?;
                self.cmd_done(node, c, response)
            }
        }
    }

    /// Node `n` crashes: its unit and every task of it are gone; its initiators'
    /// commands in flight end without an answer.
    pub(super) fn scsi_crash(&mut self, n: usize) -> Result<(), String> {
        let Some(w) = self.world.as_mut() else {
            return Ok(());
        };
        self.exec.drop_node(n);
        self.nodes[n].unit = None;
        self.nodes[n].lu_requests.clear();
        let id = self.nodes[n].id;
        let lost = std::mem::take(&mut w.cmds[n]);
        for token in lost.keys() {
            self.close_window(*token, false)?;
        }
        let w = self.world.as_mut().expect("a SCSI run");
        for (_, c) in lost {
            match c.cmd {
                Cmd::Write { hist, .. } | Cmd::Caw { hist, .. } => {
                    self.hist.node_crashed(hist, self.t)
                }
                Cmd::Pr(cmd) => {
                    w.model
                        .pr_out(&nexus(c.initiator, id), &cmd, false, c.submit, self.t)?;
                    w.pr_busy = false;
                }
                Cmd::Read { .. } | Cmd::Sync(_) => {}
            }
        }
        Ok(())
    }

    /// Node `n`'s initiators send a command (if fewer than the run's depth are in
    /// flight there).
    pub(super) fn scsi_client(&mut self, n: usize) -> Result<(), String> {
        if !self.clients_on {
            return Ok(());
        }
        let Some(u) = self.nodes[n].unit.as_ref() else {
            return Ok(());
        };
        let (lu, nexuses) = (u.lu.clone(), u.nexuses.clone());
        let id = self.nodes[n].id;
        let t = self.t;
        let link = self.mirroring_link(n);
        let hot = self.plan.hot;
        let Some(w) = self.world.as_mut() else {
            return Ok(());
        };
        if w.cmds[n].len() >= self.plan.depth {
            return Ok(());
        }
        let rng = &mut self.rng;
        let i = rng.random_range(0..INITIATORS);
        let count = rng.random_range(1..=8u64);
        let start = rng.random_range(0..=hot.saturating_sub(count));
        let (command, cmd) = match rng.random_range(0..100) {
            0..=39 => {
                let wid = self.next_write;
                self.next_write += 1;
                let fua = rng.random_bool(0.2);
                let hist = self
                    .hist
                    .submit_write(wid, id, false, (start, count), fua, t);
                (
                    write10(start, count, fua, pattern(wid, start, count)),
                    Cmd::Write {
                        hist,
                        start,
                        count,
                        id: wid,
                    },
                )
            }
            40..=59 => (
                read10(start, count),
                Cmd::Read {
                    offset: start * SECTOR,
                    len: count * SECTOR,
                },
            ),
            60..=79 => {
                let sector = rng.random_range(0..hot);
                let expected = w.known[sector as usize];
                let wid = self.next_write;
                self.next_write += 1;
                let hist = self
                    .hist
                    .submit_write(wid, id, false, (sector, 1), false, t);
                (
                    caw(
                        sector,
                        &expected_bytes(expected, sector),
                        &pattern(wid, sector, 1),
                    ),
                    Cmd::Caw {
                        hist,
                        sector,
                        expected,
                        id: wid,
                    },
                )
            }
            80..=84 => {
                let f = self.hist.submit_flush(id, link, t);
                (sync_cache(), Cmd::Sync(f))
            }
            _ => {
                if w.pr_busy {
                    return Ok(());
                }
                w.pr_busy = true;
                let kind = PR_TYPES[rng.random_range(0..PR_TYPES.len())];
                let other = key(rng.random_range(0..INITIATORS));
                let command = match rng.random_range(0..100) {
                    0..=34 => pr_out(PR_REGISTER_AND_IGNORE, 0, 0, key(i), w.aptpl),
                    35..=54 => pr_out(PR_RESERVE, kind, key(i), 0, false),
                    55..=64 => pr_out(PR_RELEASE, kind, key(i), 0, false),
                    65..=76 => pr_out(PR_PREEMPT, kind, key(i), other, false),
                    77..=88 => pr_out(PR_PREEMPT_AND_ABORT, kind, key(i), other, false),
                    89..=93 => pr_out(PR_CLEAR, 0, key(i), 0, false),
                    _ => pr_out(PR_REGISTER_AND_IGNORE, 0, 0, 0, w.aptpl),
                };
                (command.clone(), Cmd::Pr(command))
            }
        };
        w.next_token += 1;
        let token = w.next_token;
        tr!(self, format!("node {id}: initiator {i} sends {cmd:?}"));
        let together = self.together();
        let w = self.world.as_mut().expect("a SCSI run");
        w.cmds[n].insert(
            token,
            InFlight {
                initiator: i,
                submit: t,
                together,
                cmd,
            },
        );
        let nx = nexuses[i].clone();
        let task = self.exec.spawn(n, async move {
            Out::Cmd {
                node: n,
                token,
                response: command_run(lu, nx, command).await,
            }
        });
        w.task_cmd.insert(task, (n, token));
        Ok(())
    }

    /// The simulation's link, if the nodes are together: it is up and both endpoints
    /// mirror on it (a handshake still running leaves a node acting alone).
    fn together(&self) -> Option<u64> {
        (self.link.open == [true, true]
            && !self.link.partitioned
            && (0..2).all(|k| self.mirroring_link(k).is_some()))
        .then_some(self.link.epoch)
    }

    /// Node `n`'s unit submits `req` for executor task `task`: the first WRITE of a
    /// write command, or the first READ of a CAW, opens its lock window (check 11).
    fn open_window(&mut self, n: usize, req: &IoReq, task: u64, together: Option<u64>) {
        let Some(w) = self.world.as_mut() else {
            return;
        };
        let Some(&(node, token)) = w.task_cmd.get(&task) else {
            return;
        };
        if w.windows.contains_key(&token) {
            return;
        }
        let Some(c) = w.cmds[node].get(&token) else {
            return;
        };
        let window = |sectors, caw| Window {
            node: n,
            sectors,
            caw,
            span: (w.seq + 1, None),
            together: (together, None),
        };
        let opened = match (&c.cmd, req) {
            (
                Cmd::Write { .. },
                IoReq::Write {
                    offset, payload, ..
                },
            ) => {
                let len = match payload {
                    WritePayload::Data(d) => d.len() as u64,
                    WritePayload::Discard { len } | WritePayload::Zeroes { len } => *len,
                };
                window((offset / SECTOR, len.div_ceil(SECTOR)), false)
            }
            (Cmd::Caw { sector, .. }, IoReq::Read { .. }) => window((*sector, 1), true),
            _ => return,
        };
        w.seq += 1;
        w.windows.insert(token, opened);
    }

    /// Command `token` ended (`good`: acknowledged GOOD): its window closes; a CAW that
    /// succeeded must have overlapped no other write's or CAW's window on its sector on
    /// its own node, nor on the other node while both mirrored on the same link.
    fn close_window(&mut self, token: u64, good: bool) -> Result<(), String> {
        let together = self.together();
        let Some(w) = self.world.as_mut() else {
            return Ok(());
        };
        w.task_cmd.retain(|_, (_, t)| *t != token);
        w.seq += 1;
        let end = w.seq;
        let Some(mine) = w.windows.get_mut(&token) else {
            return Ok(());
        };
        mine.span.1 = Some(end);
        mine.together.1 = together;
        let mine = mine.clone();
        // Together on a link at its start or at its end (a CAW that began alone and
        // ran on into a new link counts on that link).
        let on = |link: Option<u64>| {
            link.is_some() && (link == mine.together.0 || link == mine.together.1)
        };
        if good && mine.caw {
            let s = mine.sectors.0;
            let clash = w.windows.iter().find(|(t, o)| {
                **t != token
                    && o.sectors.0 <= s
                    && s < o.sectors.0 + o.sectors.1
                    && o.span.0 < end
                    && o.span.1.is_none_or(|e| e > mine.span.0)
                    && (o.node == mine.node || on(o.together.0))
            });
            if let Some((t, o)) = clash {
                return Err(format!(
                    "check 11: a COMPARE AND WRITE at sector {s} through node {} succeeded, but command {t} ({}, through node {}) held the sector at the same time: {o:?} against {mine:?}",
                    mine.node + 1,
                    if o.caw { "a CAW" } else { "a write" },
                    o.node + 1
                ));
            }
        }
        // Forget the windows that ended before every open one began.
        let oldest = w
            .windows
            .values()
            .filter(|o| o.span.1.is_none())
            .map(|o| o.span.0)
            .min()
            .unwrap_or(u64::MAX);
        w.windows.retain(|_, o| o.span.1.is_none_or(|e| e > oldest));
        Ok(())
    }

    /// A WRITE or CAW (history index `hist`) ended: acknowledged GOOD (`good`, on
    /// mirroring link `link`), refused before it changed anything (`why`), or with an
    /// unknown outcome. Returns `good`.
    fn end_write(
        &mut self,
        hist: usize,
        good: bool,
        why: Option<&str>,
        link: Option<u64>,
    ) -> Result<bool, String> {
        let t = self.t;
        if let Some(fence) = self.hist.fenced_at(hist).filter(|f| good && *f < t) {
            return Err(format!(
                "a write (history {hist}) completed GOOD at {t:?}, after a PREEMPT AND ABORT of its initiator had completed at {fence:?} while it was in flight"
            ));
        }
        if good {
            let apart = self
                .apart_since
                .filter(|since| self.hist.submitted(hist) >= *since)
                .map(|_| self.link.epoch);
            self.hist.write_done(hist, true, link, apart, t);
        } else if let Some(why) = why {
            self.hist.write_refused(hist, t);
            let w = self.world.as_mut().expect("a SCSI run");
            match why {
                "miscompare" => w.stats.caw_miscompared += 1,
                "reservation conflict" => w.stats.conflicts += 1,
                _ => {}
            }
        } else {
            self.hist.write_done(hist, false, None, None, t);
        }
        Ok(good)
    }

    /// An initiator's command ended on node `n`.
    fn cmd_done(
        &mut self,
        n: usize,
        c: InFlight,
        response: Option<Response>,
    ) -> Result<(), String> {
        let id = self.nodes[n].id;
        let t = self.t;
        let link = self.mirroring_link(n);
        let good = response.as_ref().is_some_and(|r| r.status == Status::Good);
        let why = response.as_ref().and_then(refused);
        tr!(
            self,
            format!(
                "node {id}: initiator {} {:?} ended: {}",
                c.initiator,
                c.cmd,
                match &response {
                    None => "aborted".to_string(),
                    Some(r) => format!("{:?} {:?}", r.status, sense_key(r)),
                }
            )
        );
        match c.cmd {
            Cmd::Write {
                hist,
                start,
                count,
                id: wid,
            } => {
                if self.end_write(hist, good, why, link)? {
                    let w = self.world.as_mut().expect("a SCSI run");
                    w.acked.push((c.initiator, id, c.submit, t));
                    for s in start..start + count {
                        w.known[s as usize] = wid;
                    }
                }
            }
            Cmd::Read { offset, len } => {
                if good {
                    let data = response.expect("good").data;
                    if data.len() as u64 != len {
                        return Err(format!(
                            "node {id}: a READ of {len} bytes returned {}",
                            data.len()
                        ));
                    }
                    self.check_read(offset, &data, c.submit, t)
                        .map_err(|e| format!("node {id}: READ at {offset}: {e}"))?;
                    let w = self.world.as_mut().expect("a SCSI run");
                    for (k, chunk) in data.chunks(SECTOR as usize).enumerate() {
                        let s = offset / SECTOR + k as u64;
                        if let Ok(v) = super::history::decode_sector(s, chunk) {
                            w.known[s as usize] = v;
                        }
                    }
                }
            }
            Cmd::Caw {
                hist,
                sector,
                expected,
                id: wid,
            } => {
                if self.end_write(hist, good, why, link)? {
                    self.hist.allowed(sector, expected, c.submit, t).map_err(|e| {
                        format!(
                            "node {id}: a COMPARE AND WRITE at sector {sector} succeeded, comparing a value no read could have returned: {e}"
                        )
                    })?;
                    // A second win on the same value is right only if the value could
                    // come back after the first one's write: its write was still in
                    // flight when the first began (a mirror may apply a write it resends
                    // after a reconnect again), or a power cut undid the first.
                    let cut = |from| self.hist.cut_between(from, t);
                    let value_end = self.hist.end_of(expected);
                    let w = self.world.as_mut().expect("a SCSI run");
                    if let Some(&(s0, e0)) = w.caw_wins.get(&(sector, expected)) {
                        if value_end.is_some_and(|e| e <= s0) && !cut(s0.min(c.submit)) {
                            return Err(format!(
                                "two COMPARE AND WRITEs at sector {sector} both won with write {expected}'s data as the expected value (one in flight {s0:?}..{e0:?}, the other, through node {id}, {:?}..{t:?}), though that value's write had ended before the first began and no power cut could have undone the first",
                                c.submit
                            ));
                        }
                    }
                    w.caw_wins.insert((sector, expected), (c.submit, t));
                    w.acked.push((c.initiator, id, c.submit, t));
                    w.known[sector as usize] = wid;
                    w.stats.caw_won += 1;
                }
            }
            Cmd::Sync(f) => {
                if good {
                    self.hist.flush_done(f, t);
                }
            }
            Cmd::Pr(cmd) => {
                // PREEMPT AND ABORT: the preempted initiator's tasks that were running
                // when it came in have ended (SPC-4 5.13.11.2.4): on this node, and on
                // the other too when the nodes stayed together all along (a node that
                // acts alone cannot wait for the other's; see TESTING.md).
                let together_since = c
                    .together
                    .filter(|e| {
                        *e == self.link.epoch
                            && self.link.open == [true, true]
                            && !self.link.partitioned
                    })
                    .is_some();
                if good && cmd.cdb[1] & 0x1f == PR_PREEMPT_AND_ABORT {
                    let sa_key =
                        u64::from_be_bytes(cmd.data_out[8..16].try_into().expect("24 bytes"));
                    let w = self.world.as_ref().expect("a SCSI run");
                    if let Some(j) = (0..INITIATORS).find(|&j| key(j) == sa_key && j != c.initiator)
                    {
                        // The fence: what of the preempted initiator ran when it came
                        // in and runs still, on either node (the other may not know of
                        // it yet: the two are apart), must not land from now on. (A
                        // command that came later is checked against the new state.)
                        for o in w.cmds.iter().flat_map(|m| m.values()) {
                            if let (true, Cmd::Write { hist, .. } | Cmd::Caw { hist, .. }) =
                                (o.initiator == j && o.submit < c.submit, &o.cmd)
                            {
                                self.hist.fence(*hist, t);
                            }
                        }
                        for (k, cmds) in w
                            .cmds
                            .iter()
                            .enumerate()
                            .filter(|(k, _)| *k == n || together_since)
                        {
                            if let Some(left) = cmds.values().find(|o| {
                                o.initiator == j
                                    && o.submit < c.submit
                                    && !matches!(o.cmd, Cmd::Pr(_))
                            }) {
                                return Err(format!(
                                    "PREEMPT AND ABORT of initiator {j} (through node {id}, {:?}..{t:?}) completed while its {:?} (submitted {:?} through node {}) still ran",
                                    c.submit,
                                    left.cmd,
                                    left.submit,
                                    k + 1
                                ));
                            }
                        }
                    }
                }
                // Refused before anything changed (the unit checks these first, and a
                // change made alone is committed before it is applied): a definite no.
                let definite_no = response.as_ref().is_some_and(|r| {
                    r.status == Status::ReservationConflict
                        || matches!(
                            sense_key(r),
                            Some(
                                SenseKey::UnitAttention
                                    | SenseKey::IllegalRequest
                                    | SenseKey::NotReady
                            )
                        )
                });
                tr!(self, {
                    let states: Vec<String> = self
                        .nodes
                        .iter()
                        .map(|n| {
                            n.unit
                                .as_ref()
                                .map_or("down".into(), |u| brief(&u.lu.pr_state()))
                        })
                        .collect();
                    format!("PR states now: node 1 {} / node 2 {}", states[0], states[1])
                });
                let good_now = good;
                let before = self.world.as_ref().map(|w| {
                    w.model
                        .candidates()
                        .iter()
                        .map(|s| s.generation)
                        .collect::<Vec<_>>()
                });
                tr!(
                    self,
                    format!("model before (good {good_now}): gens {before:?}")
                );
                if self.tracing {
                    let w = self.world.as_ref().expect("a SCSI run");
                    let mut after = PrModel {
                        epochs: vec![(Duration::ZERO, None, w.model.candidates().to_vec())],
                        starts: w.model.starts.clone(),
                    };
                    if !definite_no {
                        let _ = after.pr_out(&nexus(c.initiator, id), &cmd, good, c.submit, t);
                    }
                    let mut lines = Vec::new();
                    for (k, node) in self.nodes.iter().enumerate() {
                        if let Some(u) = node.unit.as_ref() {
                            let st = u.lu.pr_state();
                            if !after.holds(&st) {
                                lines.push(format!(
                                    "MODEL MISS node {}: {} not in {}",
                                    k + 1,
                                    brief(&st),
                                    briefs(after.candidates())
                                ));
                            }
                        }
                    }
                    for l in lines {
                        self.log(l);
                    }
                }
                let w = self.world.as_mut().expect("a SCSI run");
                if !definite_no {
                    w.model
                        .pr_out(&nexus(c.initiator, id), &cmd, good, c.submit, t)
                        .map_err(|e| format!("node {id}: {e}"))?;
                }
                w.pr_busy = false;
                if good {
                    w.stats.pr_good += 1;
                }
            }
        }
        Ok(())
    }

    /// After convergence: both units hold the same reservation state, saved as served,
    /// one the acknowledged commands imply; every acknowledged write was allowed.
    pub(super) fn scsi_final_checks(&mut self) -> Result<(), String> {
        let states: Vec<PrState> = self
            .nodes
            .iter()
            .map(|n| n.unit.as_ref().map(|u| u.lu.pr_state()))
            .collect::<Option<_>>()
            .ok_or("converged without both units")?;
        let w = self.world.as_ref().expect("a SCSI run");
        if states[0] != states[1] {
            return Err(format!(
                "converged, but the nodes' reservation states differ: node 1 {}, node 2 {}",
                brief(&states[0]),
                brief(&states[1])
            ));
        }
        for (n, s) in states.iter().enumerate() {
            let saved = w.stores[n].saved.lock().unwrap().clone();
            if saved.as_deref().is_some_and(|b| b != s.encode().as_slice()) {
                return Err(format!(
                    "node {}: the saved reservation state is not the one it serves",
                    n + 1
                ));
            }
        }
        if !w.model.holds(&states[0]) {
            return Err(format!(
                "the pair's reservation state {} is none that the acknowledged PERSISTENT RESERVE OUT commands imply: {}",
                brief(&states[0]),
                briefs(w.model.candidates())
            ));
        }
        for &(i, node, submit, end) in &w.acked {
            if !w.model.write_allowed(&nexus(i, node), submit, end) {
                return Err(format!(
                    "a write from initiator {i} through node {node}, in flight {submit:?}..{end:?}, was acknowledged, but no reservation state of that time allowed it"
                ));
            }
        }
        Ok(())
    }
}
