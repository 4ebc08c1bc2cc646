//! Deterministic simulation of a mirrored disk: two nodes (and a witness) running the real
//! sans-IO protocol ([`Endpoint`]) over the real metadata code on [`FaultyDevice`]s, with a
//! simulated network and clock driven by one seeded generator.
//!
//! # Why a harness of our own, not turmoil
//!
//! The mirror's logic lives in [`Endpoint`], which has no sockets, no clock and no tasks:
//! every input is a method call with `now`, every output is polled. The tokio driver
//! around it (`MirroredDisk`) only pumps that loop, runs local I/O, and calls
//! `Instant::now()`. Driving the endpoints directly gives full control of every message,
//! every local I/O completion and every timer, at a few microseconds per event and with no
//! threads, so a run is a pure function of its seed and ten thousand runs take seconds.
//! turmoil would have to run the tokio driver and a transport, whose clock reads
//! (`std::time::Instant`) it does not virtualise and whose thread scheduling it does not
//! own. The price is that this harness re-does the driver's small part: it runs each
//! [`LocalIo`] the way `MirroredDisk` does (a metadata write flushes the data first when
//! asked, writes its blocks, then flushes the metadata device), delivers messages in
//! order per link, and forwards quorum requests to a witness with the witness's rules.
//!
//! # What is simulated
//!
//! - **Network**: one link at a time between the nodes, carrying messages in order (every
//!   transport vsan has — TCP, QUIC streams, the loopback forms, RDMA — delivers a
//!   link's messages in order, exactly once, so loss, duplication and reordering within a
//!   link cannot happen; a lost segment is a reset link). Faults: random delay per message
//!   (order kept), **resets** (the link drops at once; whatever was in flight is lost),
//!   **partitions** (messages wait, as TCP retransmits them; the endpoints notice only by
//!   their timeouts and drop the link themselves; healing delivers what waited), and
//!   dialing again after a random back-off.
//! - **Nodes**: the data replica and the metadata area are [`FaultyDevice`]s over
//!   [`MemDevice`]s. Local I/O completes after a random delay, so completions reorder.
//!   **Crashes** are power cuts: the node's endpoint and everything in flight are gone,
//!   part of its in-flight local I/O may have reached the device, and the device keeps
//!   its unflushed writes, drops them, or tears them sector by sector
//!   ([`PowerCut`]); the node restarts from what `meta::open` reads. Both nodes can lose
//!   power at once. **Disk errors**: for a while, a node's data device fails every
//!   operation (the endpoint detaches it; the operator attaches it again later).
//! - **Witness** (in the runs with one): the witness service's rules (a claim is granted
//!   when nobody or the claimer holds the disk; only the holder's release clears it; a
//!   holder that dies stays the holder), with delays, and a node that cannot reach it for
//!   a while. The driver's retry (a denied or failed claim again every second) is
//!   reproduced.
//! - **Clients** on both nodes (on node 1 only in runs without a witness, where a node cut
//!   off from its peer goes on alone and two writers would make a split brain that only an
//!   operator resolves) keep up to a few requests in flight: writes of 1–8 sectors
//!   clustered so they overlap, FUA writes, write_zeroes, discards, flushes and reads.
//!   Without a witness, node 2's client reads in the window between a restart and its
//!   first handshake (the restarted node may be behind: its replica must not be served
//!   before it is proven current); some crashes keep a node down for seconds, so the
//!   peer writes alone past every timeout first.
//!
//! # What is checked
//!
//! See [`history`] for the rules. On every run:
//!
//! 1. every read returns, sector by sector, a value some write put there and that no
//!    acknowledged, surviving write had superseded when the read was submitted (after a
//!    power cut, writes that were not durable yet may be gone);
//! 2. after the faults stop and everything heals, the pair converges (connected, no
//!    resync running, nothing out of sync, nothing detached or inconsistent) within a
//!    bounded simulated time, and every request has completed: no run hangs;
//! 3. the two replicas are then byte-identical, and every sector of the image satisfies
//!    rule 1 (so every acknowledged write that was made durable is there, unless a later
//!    write replaced it);
//! 4. with a witness, the two nodes never both acknowledge writes during the same
//!    separation.
//!
//! A run is a pure function of its seed: [`run`] returns the failure with the seed, and
//! `SIM_SEED=<seed>` replays one with a trace (see TESTING.md).
//!
//! [`run_scsi`] runs the same harness with each node's SCSI logical unit in front of
//! its endpoint and initiators on both nodes (persistent reservations, COMPARE AND
//! WRITE); [`scsi`] says what it adds and checks.

pub mod history;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan_core::{BlockDevice, FaultyDevice, Geometry, IoFlags, MemDevice, PowerCut};
use vsan_replica::meta::{self, Layout, MetaParams};
use vsan_replica::protocol::{
    Config, DiskId, Endpoint, Event, LinkState, LocalIo, LocalOpId, LocalResult, QuorumPolicy,
    RequestId, ResyncConfig, ResyncRate, SplitBrainPolicy, SyncRole, WritePayload,
};

/// Add a line to the trace, formatting it only when tracing.
macro_rules! tr {
    ($sim:expr, $line:expr) => {
        if $sim.tracing {
            let line = $line;
            $sim.log(line);
        }
    };
}

pub mod scsi;

use history::{History, SECTOR, decode_sector, sector_bytes};

/// Sectors of the simulated disk.
pub const SECTORS: u64 = 128;
/// Bytes of the simulated disk.
pub const SIZE: u64 = SECTORS * SECTOR;
/// Bytes per bitmap bit.
const CHUNK: u64 = 4096;
/// Simulated time allowed for the pair to converge once everything healed.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);
/// Events per run at most (a livelock guard).
const MAX_EVENTS: u64 = 3_000_000;

/// Run `f` to completion; the devices used here never wait, so it must be ready at once.
fn now_ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a simulated device operation did not complete at once"),
    }
}

/// A deliberate defect the simulation can be asked to suffer, to prove it can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// None: the real system.
    None,
    /// Node 1's data device acknowledges flushes without making anything durable (a
    /// lying disk): acknowledged, flushed writes are lost by its power cuts.
    LyingFlush,
}

/// How a run went, when it passed.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Writes submitted / acknowledged Ok.
    pub writes: usize,
    /// Writes acknowledged Ok.
    pub writes_ok: usize,
    /// Reads checked.
    pub reads: u64,
    /// Faults injected.
    pub faults: u32,
    /// Simulated time the run took.
    pub sim_time: Duration,
    /// Events processed.
    pub events: u64,
    /// What the SCSI initiators did (SCSI runs).
    pub scsi: scsi::Stats,
}

/// A failed run: the seed that reproduces it, what broke, and the end of the trace (when
/// tracing was on).
#[derive(Debug, Clone)]
pub struct Failure {
    /// The run's seed.
    pub seed: u64,
    /// What broke.
    pub what: String,
    /// The last lines of the trace (empty unless traced).
    pub trace: Vec<String>,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "simulation seed {} failed: {}", self.seed, self.what)?;
        writeln!(
            f,
            "replay: SIM_SEED={} cargo test --release -p vsan-proptests --test simulation -- --nocapture replay",
            self.seed
        )?;
        for l in &self.trace {
            writeln!(f, "  {l}")?;
        }
        Ok(())
    }
}

/// Run the simulation for `seed`.
pub fn run(seed: u64) -> Result<Outcome, Failure> {
    run_with(seed, Sabotage::None, false)
}

/// Run the simulation for `seed` with a deliberate defect, optionally tracing (the trace
/// is returned with a failure, and printed as it goes when `trace` is on).
pub fn run_with(seed: u64, sabotage: Sabotage, trace: bool) -> Result<Outcome, Failure> {
    run_sim(Sim::new(seed, sabotage, trace, false), seed)
}

/// Run the SCSI simulation for `seed` (see [`scsi`]): initiators on both nodes through
/// each node's logical unit, with persistent reservations and COMPARE AND WRITE, and a
/// witness in every run (both nodes serve writes). Seeds here are other scenarios than
/// [`run`]'s.
pub fn run_scsi(seed: u64, trace: bool) -> Result<Outcome, Failure> {
    run_sim(Sim::new(seed, Sabotage::None, trace, true), seed)
}

/// [`run_scsi`] with the units' tasks woken at one instant polled in an order drawn
/// from the seed instead of in task order (see [`scsi`]'s executor): a real runtime may
/// run a reply's waiter after a call that came in behind the reply.
pub fn run_scsi_shuffled(seed: u64, trace: bool) -> Result<Outcome, Failure> {
    let mut sim = Sim::new(seed, Sabotage::None, trace, true);
    sim.exec = scsi::Exec::seeded(seed ^ 0x5c51_0000_0000_0e8c);
    run_sim(sim, seed)
}

fn run_sim(mut sim: Sim, seed: u64) -> Result<Outcome, Failure> {
    match sim.run() {
        Ok(()) => Ok(Outcome {
            writes: sim.hist.writes(),
            writes_ok: sim.hist.writes_ok(),
            reads: sim.hist.reads_checked,
            faults: sim.faults,
            sim_time: sim.t,
            events: sim.events,
            scsi: sim.world.as_ref().map(|w| w.stats).unwrap_or_default(),
        }),
        Err(what) => Err(Failure {
            seed,
            what: format!("{what} (at {:?})", sim.t),
            trace: sim.trace.into_iter().collect(),
        }),
    }
}

/// The settings a seed draws.
#[derive(Debug, Clone)]
struct Plan {
    witness: Option<QuorumPolicy>,
    /// How long the clients run.
    workload: Duration,
    /// Requests in flight per client at most.
    depth: usize,
    /// Largest one-way message delay.
    net_delay: Duration,
    /// Largest local I/O delay.
    io_delay: Duration,
    /// Sectors writes cluster in (overlaps are frequent when small).
    hot: u64,
    faults: Vec<(Duration, Fault)>,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    Reset,
    Partition(Duration),
    Crash(usize, Duration),
    CrashBoth(Duration, Duration),
    DiskErrors(usize, Duration),
    WitnessCut(usize, Duration),
}

#[derive(Debug)]
enum Ev {
    /// Deliver the messages towards side `to` that are due (in order).
    Deliver {
        to: usize,
    },
    /// The side `to` of link `epoch` learns the other side closed it.
    Closed {
        to: usize,
        epoch: u64,
    },
    Dial,
    LocalDone {
        node: usize,
        inc: u64,
        op: LocalOpId,
    },
    Timer {
        node: usize,
        inc: u64,
        /// The deadline it was armed for.
        at: Instant,
    },
    Client {
        node: usize,
    },
    Claim {
        node: usize,
        inc: u64,
        wgen: u64,
    },
    Quorum {
        node: usize,
        inc: u64,
        wgen: u64,
        granted: bool,
    },
    Release {
        node: usize,
    },
    Fault(Fault),
    Restart {
        node: usize,
    },
    EndDiskErrors {
        node: usize,
    },
    EndWitnessCut {
        node: usize,
    },
    EndPartition,
    Heal,
    /// Try node `node`'s reservation state exchange of link `epoch` again.
    ScsiSettle {
        node: usize,
        inc: u64,
        epoch: u64,
    },
}

/// What a client request was.
#[derive(Debug, Clone, Copy)]
enum Req {
    Write(usize),
    Flush(usize),
    Read {
        offset: u64,
        len: u64,
        submit: Duration,
    },
}

struct Node {
    id: u32,
    inc: u64,
    ep: Option<Endpoint>,
    data: FaultyDevice<MemDevice>,
    meta: FaultyDevice<MemDevice>,
    requests: HashMap<RequestId, Req>,
    local: HashMap<LocalOpId, LocalIo>,
    disk_errors: bool,
    witness_cut: bool,
    /// The newest witness request (claims older than it stop retrying).
    witness_gen: u64,
    /// When this node's last witness request arrives there (they arrive in order).
    witness_at: Duration,
    timer: Option<Instant>,
    /// Restarted, and not connected to the peer since: the window in which its replica
    /// is not yet proven current (the sim's own knowledge, not the endpoint's claim).
    restarted_unlinked: bool,
    /// The logical unit (SCSI runs).
    unit: Option<scsi::Unit>,
    /// Requests the unit made, by the endpoint's id.
    lu_requests: HashMap<RequestId, scsi::Reply>,
}

struct Link {
    /// Counts connections.
    epoch: u64,
    /// Each side still has the link open.
    open: [bool; 2],
    partitioned: bool,
    /// Messages on the way, per receiving side, in order, with the time each can
    /// arrive (never before the one ahead of it); a partition holds them all.
    wire: [VecDeque<(Duration, vsan_replica::protocol::Message)>; 2],
    dialing: bool,
}

impl Link {
    fn up(&self) -> bool {
        self.open[0] || self.open[1]
    }
}

struct Sim {
    seed: u64,
    rng: SmallRng,
    plan: Plan,
    sabotage: Sabotage,
    base: Instant,
    t: Duration,
    seq: u64,
    queue: BinaryHeap<Reverse<(Duration, u64)>>,
    pending: HashMap<u64, Ev>,
    nodes: [Node; 2],
    link: Link,
    holder: Option<u32>,
    /// Since when the nodes are separated (the link down or cut), as of the last event.
    apart_since: Option<Duration>,
    hist: History,
    next_write: u64,
    clients_on: bool,
    healing: bool,
    /// The operator discarded one node's data (see `pick_a_side`).
    discarded: bool,
    faults: u32,
    events: u64,
    tracing: bool,
    print: bool,
    trace: VecDeque<String>,
    /// The SCSI side (SCSI runs).
    world: Option<scsi::World>,
    exec: scsi::Exec,
}

fn disk_id() -> DiskId {
    DiskId([0x51; 16])
}

fn config(node: u32, peer: u32, seed: u64, plan: &Plan, rng: &mut SmallRng) -> Config {
    let mut cfg = Config::new(node, peer, disk_id(), "sim0", SIZE, SECTOR as u32);
    cfg.peer_timeout = Duration::from_millis(rng.random_range(400..=1500));
    cfg.ping_interval = cfg.peer_timeout / 4;
    cfg.connect_timeout = Duration::from_millis(rng.random_range(200..=1000));
    cfg.split_brain = SplitBrainPolicy::Refuse;
    cfg.resync = ResyncConfig {
        rate: ResyncRate::Dynamic { max: 0 },
        window: rng.random_range(1..=16),
        checkpoint_interval: Duration::from_millis(rng.random_range(20..=500)),
    };
    cfg.quorum = plan.witness;
    // A new seed on every start, as the driver does (a random one).
    cfg.seed = seed ^ u64::from(node) ^ rng.random::<u64>();
    cfg
}

fn params(node: u32, peer: u32) -> MetaParams {
    MetaParams {
        disk_id: disk_id(),
        disk_name: "sim0".into(),
        node_id: node,
        peer_id: peer,
        size: SIZE,
        block_size: SECTOR as u32,
        chunk_size: CHUNK,
    }
}

fn new_node(id: u32) -> Node {
    let layout = Layout::new(SIZE, CHUNK);
    let data = FaultyDevice::new(MemDevice::new(Geometry::new(SIZE, SECTOR as u32).unwrap()));
    let meta = FaultyDevice::new(MemDevice::new(
        Geometry::new(layout.total_len(), 512).unwrap(),
    ));
    Node {
        id,
        inc: 0,
        ep: None,
        data,
        meta,
        requests: HashMap::new(),
        local: HashMap::new(),
        disk_errors: false,
        witness_cut: false,
        witness_gen: 0,
        witness_at: Duration::ZERO,
        timer: None,
        restarted_unlinked: false,
        unit: None,
        lu_requests: HashMap::new(),
    }
}

fn ms(rng: &mut SmallRng, lo: u64, hi: u64) -> Duration {
    Duration::from_micros(rng.random_range(lo * 1000..=hi * 1000))
}

impl Sim {
    fn new(seed: u64, sabotage: Sabotage, print: bool, scsi: bool) -> Sim {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut witness = match rng.random_range(0..4) {
            0 | 1 => None,
            2 => Some(QuorumPolicy::IoError),
            _ => Some(QuorumPolicy::Suspend),
        };
        // SCSI runs serve writes through both nodes: a witness decides who goes on alone.
        let world = scsi.then(|| {
            let mut own = SmallRng::seed_from_u64(seed ^ 0x5c51_0000_0000_0020);
            if witness.is_none() {
                witness = Some(if own.random_bool(0.5) {
                    QuorumPolicy::IoError
                } else {
                    QuorumPolicy::Suspend
                });
            }
            scsi::World {
                aptpl: own.random_bool(0.5),
                known: vec![history::ZERO; SECTORS as usize],
                ..scsi::World::default()
            }
        });
        let workload = ms(&mut rng, 500, 5000);
        let mut faults = Vec::new();
        let n = rng.random_range(0..=5);
        for _ in 0..n {
            let at = Duration::from_micros(rng.random_range(0..=workload.as_micros() as u64));
            let f = match rng.random_range(0..12) {
                0 | 1 => Fault::Reset,
                2..=4 => Fault::Partition(ms(&mut rng, 50, 4000)),
                5..=7 => Fault::Crash(rng.random_range(0..2), ms(&mut rng, 1, 3000)),
                // A long outage: the peer writes alone for longer than any timeout, and
                // the node restarts behind it.
                11 => Fault::Crash(rng.random_range(0..2), ms(&mut rng, 2000, 6000)),
                8 => Fault::CrashBoth(ms(&mut rng, 1, 2000), ms(&mut rng, 1, 2000)),
                9 => Fault::DiskErrors(rng.random_range(0..2), ms(&mut rng, 1, 2000)),
                _ => Fault::WitnessCut(rng.random_range(0..2), ms(&mut rng, 100, 4000)),
            };
            faults.push((at, f));
        }
        let plan = Plan {
            witness,
            workload,
            depth: rng.random_range(1..=6),
            net_delay: Duration::from_micros(rng.random_range(20..=3000)),
            io_delay: Duration::from_micros(rng.random_range(5..=2000)),
            hot: rng.random_range(16..=SECTORS),
            faults,
        };
        let nodes = [new_node(1), new_node(2)];
        for n in &nodes {
            now_ready(meta::create(&n.meta, &params(n.id, 3 - n.id)))
                .expect("creating the metadata");
        }
        Sim {
            seed,
            rng,
            plan,
            sabotage,
            base: Instant::now(),
            t: Duration::ZERO,
            seq: 0,
            queue: BinaryHeap::new(),
            pending: HashMap::new(),
            nodes,
            link: Link {
                epoch: 0,
                open: [false; 2],
                partitioned: false,
                wire: [VecDeque::new(), VecDeque::new()],
                dialing: false,
            },
            holder: None,
            apart_since: Some(Duration::ZERO),
            hist: History::new(SECTORS),
            next_write: 1,
            clients_on: true,
            healing: false,
            discarded: false,
            faults: 0,
            events: 0,
            tracing: print,
            print,
            trace: VecDeque::new(),
            world,
            exec: scsi::Exec::default(),
        }
    }

    fn now(&self) -> Instant {
        self.base + self.t
    }

    fn log(&mut self, line: String) {
        let line = format!("{:>12?} {line}", self.t);
        if self.print {
            println!("{line}");
        }
        self.trace.push_back(line);
        if self.trace.len() > 400 {
            self.trace.pop_front();
        }
    }

    fn at(&mut self, after: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((self.t + after, self.seq)));
        self.pending.insert(self.seq, ev);
    }

    fn run(&mut self) -> Result<(), String> {
        tr!(self, format!("plan: {:?}", self.plan));
        for n in 0..2 {
            self.start_node(n)?;
            self.at(Duration::from_micros(1), Ev::Client { node: n });
        }
        if self.world.is_some() {
            self.scsi_step()?;
        }
        self.dial_later();
        for (at, f) in self.plan.faults.clone() {
            self.at(at, Ev::Fault(f));
        }
        self.at(self.plan.workload, Ev::Heal);
        let mut settle_deadline = None;
        loop {
            let Some(Reverse((t, seq))) = self.queue.pop() else {
                return Err("nothing left to happen, and the pair has not converged".into());
            };
            self.t = t;
            self.events += 1;
            if self.events > MAX_EVENTS {
                return Err(format!("more than {MAX_EVENTS} events: a livelock"));
            }
            let ev = self.pending.remove(&seq).expect("scheduled event");
            let together = self.link.open == [true, true] && !self.link.partitioned;
            if together {
                self.apart_since = None;
            } else if self.apart_since.is_none() {
                self.apart_since = Some(self.t);
            }
            if self.events + 10 > MAX_EVENTS {
                tr!(self, format!("event {ev:?}; {}", self.describe()));
            }
            self.handle(ev)?;
            if self.world.is_some() {
                self.scsi_step()?;
            }
            if self.healing {
                let deadline = *settle_deadline.get_or_insert(self.t + SETTLE_LIMIT);
                if self.converged() {
                    return self.final_checks();
                }
                if self.t > deadline {
                    return Err(format!(
                        "the pair did not converge within {SETTLE_LIMIT:?} of healing: {}",
                        self.describe()
                    ));
                }
            }
        }
    }

    fn describe(&self) -> String {
        let mut s = String::new();
        for n in &self.nodes {
            match &n.ep {
                None => {
                    let _ = write!(s, "[node {} down] ", n.id);
                }
                Some(ep) => {
                    let _ = write!(
                        s,
                        "[node {}: {:?}, syncing {}, dirty {}, inconsistent {}, detached {}, \
                         {} requests in flight, {} local ops] ",
                        n.id,
                        ep.state(),
                        ep.sync_progress(self.now()).is_some(),
                        ep.dirty_chunks(),
                        ep.is_inconsistent(),
                        ep.is_detached(),
                        n.requests.len(),
                        n.local.len()
                    );
                }
            }
        }
        let _ = write!(
            s,
            "link epoch {} open {:?} partitioned {}",
            self.link.epoch, self.link.open, self.link.partitioned
        );
        if let Some(w) = self.world.as_ref() {
            for (k, n) in self.nodes.iter().enumerate() {
                let _ = write!(
                    s,
                    "; node {} SCSI: {} commands, {} tasks, {} unit requests{}",
                    n.id,
                    w.cmds[k].len(),
                    self.exec.count(k),
                    n.lu_requests.len(),
                    n.unit
                        .as_ref()
                        .map_or(" (no unit)".to_string(), |u| format!(
                            ", link {:?} settled {} gated {}",
                            u.epoch, u.settled, u.gated
                        ))
                );
            }
        }
        s
    }

    /// The link epoch while node `n`'s endpoint is connected (it is mirroring).
    fn mirroring_link(&self, n: usize) -> Option<u64> {
        self.nodes[n]
            .ep
            .as_ref()
            .is_some_and(|ep| ep.state() == LinkState::Connected)
            .then_some(self.link.epoch)
    }

    fn converged(&self) -> bool {
        self.link.open == [true, true]
            && self
                .world
                .as_ref()
                .is_none_or(|w| w.cmds.iter().all(|c| c.is_empty()))
            && (0..2).all(|n| self.world.is_none() || self.exec.count(n) == 0)
            && self.nodes.iter().all(|n| {
                n.requests.is_empty()
                    && n.local.is_empty()
                    && n.lu_requests.is_empty()
                    && (self.world.is_none()
                        || n.unit.as_ref().is_some_and(|u| u.settled && !u.gated))
                    && n.ep.as_ref().is_some_and(|ep| {
                        ep.state() == LinkState::Connected
                            && ep.sync_progress(self.now()).is_none()
                            && ep.dirty_chunks() == 0
                            && !ep.is_inconsistent()
                            && !ep.is_detached()
                            && !ep.is_diverged()
                    })
            })
    }

    fn final_checks(&mut self) -> Result<(), String> {
        let a = now_ready(self.nodes[0].data.read(0, SIZE as usize)).map_err(|e| e.to_string())?;
        let b = now_ready(self.nodes[1].data.read(0, SIZE as usize)).map_err(|e| e.to_string())?;
        if a != b {
            let s = (0..SECTORS)
                .find(|s| {
                    let r = (s * SECTOR) as usize..((s + 1) * SECTOR) as usize;
                    a[r.clone()] != b[r]
                })
                .unwrap_or(0);
            let r = (s * SECTOR) as usize..((s + 1) * SECTOR) as usize;
            return Err(format!(
                "converged, but the replicas differ: first at sector {s} (node 1 {:?}, node 2 {:?})",
                decode_sector(s, &a[r.clone()]),
                decode_sector(s, &b[r])
            ));
        }
        self.check_read(0, &a, self.t, self.t)
            .map_err(|e| format!("final image: {e}"))?;
        if self.plan.witness.is_some() {
            self.hist.check_exclusive()?;
        }
        if self.world.is_some() {
            self.scsi_final_checks()?;
        }
        tr!(self, "converged; replicas identical; checks passed".into());
        Ok(())
    }

    fn check_read(
        &mut self,
        offset: u64,
        data: &[u8],
        rs: Duration,
        rc: Duration,
    ) -> Result<(), String> {
        self.hist.reads_checked += 1;
        for (i, chunk) in data.chunks(SECTOR as usize).enumerate() {
            let s = offset / SECTOR + i as u64;
            let v = decode_sector(s, chunk)?;
            self.hist.allowed(s, v, rs, rc)?;
        }
        Ok(())
    }

    // ----- nodes -----

    fn start_node(&mut self, n: usize) -> Result<(), String> {
        let (id, peer) = (self.nodes[n].id, 3 - self.nodes[n].id);
        let loaded = now_ready(meta::open(&self.nodes[n].meta, &params(id, peer)))
            .map_err(|e| format!("node {id}: the metadata does not open after a restart: {e}"))?;
        let cfg = config(id, peer, self.seed, &self.plan, &mut self.rng);
        let node = &mut self.nodes[n];
        // (`inc` is 0 before the first start; a crash bumps it too.)
        node.restarted_unlinked = node.inc > 0;
        node.inc += 1;
        node.ep = Some(Endpoint::new(cfg, loaded, self.base + self.t));
        node.timer = None;
        if let Some(w) = self.world.as_mut() {
            node.unit = Some(scsi::Unit::start(id, SIZE, &w.stores[n]));
            w.model.node_start(self.t);
        }
        tr!(
            self,
            format!(
                "node {id} starts: {:?}, dirty {}",
                self.nodes[n].ep.as_ref().map(|ep| ep.generations()),
                self.nodes[n].ep.as_ref().map_or(0, |ep| ep.dirty_chunks())
            )
        );
        self.pump(n)
    }

    /// Node `n` stops at once: a power cut (`cut` `None`: one drawn at random) or, with
    /// `KeepUnflushed`, a process crash or kill (the device keeps what it was given).
    fn crash(&mut self, n: usize, restart: Duration, cut: Option<PowerCut>) -> Result<(), String> {
        if self.nodes[n].ep.is_none() {
            return Ok(());
        }
        let id = self.nodes[n].id;
        self.faults += 1;
        // Part of the local I/O in flight reached the devices.
        let mut ops: Vec<(LocalOpId, LocalIo)> = self.nodes[n].local.drain().collect();
        ops.sort_by_key(|(op, _)| op.0);
        for (_, io) in ops {
            if self.rng.random_bool(0.5) {
                let _ = self.execute(n, io);
            }
        }
        let cut = cut.unwrap_or_else(|| match self.rng.random_range(0..3) {
            0 => PowerCut::DropUnflushed,
            1 => PowerCut::KeepUnflushed,
            _ => PowerCut::Tear {
                seed: self.rng.random(),
            },
        });
        tr!(
            self,
            format!("node {id} loses power ({cut:?}); restarts in {restart:?}")
        );
        self.scsi_crash(n)?;
        let node = &mut self.nodes[n];
        node.ep = None;
        node.inc += 1;
        now_ready(node.data.power_cut(cut)).map_err(|e| e.to_string())?;
        now_ready(node.meta.power_cut(cut)).map_err(|e| e.to_string())?;
        let lost: Vec<Req> = node.requests.drain().map(|(_, r)| r).collect();
        for r in lost {
            if let Req::Write(i) = r {
                self.hist.node_crashed(i, self.t);
            }
        }
        if cut != PowerCut::KeepUnflushed {
            self.hist.power_cut(self.t);
        }
        self.close_side(n, false);
        self.at(restart, Ev::Restart { node: n });
        Ok(())
    }

    /// Run one local operation on node `n`'s devices (as `MirroredDisk`'s driver does).
    fn execute(&mut self, n: usize, io: LocalIo) -> LocalResult {
        let node = &self.nodes[n];
        let failing = node.disk_errors;
        let err = |e: vsan_core::Error| e.kind();
        let lying = self.sabotage == Sabotage::LyingFlush && n == 0;
        match io {
            LocalIo::Write {
                offset,
                payload,
                fua,
                ..
            } => {
                if failing {
                    return Err(vsan_core::ErrorKind::Io);
                }
                let flags = if fua && !lying {
                    IoFlags::FUA
                } else {
                    IoFlags::empty()
                };
                let r = match payload {
                    WritePayload::Data(d) => now_ready(node.data.write(offset, d, flags)),
                    WritePayload::Zeroes { len } => {
                        now_ready(node.data.write_zeroes(offset, len, flags))
                    }
                    WritePayload::Discard { len } => {
                        now_ready(node.data.discard(offset, len, flags))
                    }
                };
                r.map(|()| None).map_err(err)
            }
            LocalIo::Flush { .. } => {
                if failing {
                    return Err(vsan_core::ErrorKind::Io);
                }
                if lying {
                    return Ok(None);
                }
                now_ready(node.data.flush()).map(|()| None).map_err(err)
            }
            LocalIo::Read { offset, len, .. } => {
                if failing {
                    return Err(vsan_core::ErrorKind::Io);
                }
                now_ready(node.data.read(offset, len as usize))
                    .map(Some)
                    .map_err(err)
            }
            LocalIo::Meta {
                writes, flush_data, ..
            } => {
                if flush_data && !lying {
                    if failing {
                        return Err(vsan_core::ErrorKind::Io);
                    }
                    now_ready(node.data.flush()).map_err(err)?;
                }
                for (offset, bytes) in writes {
                    now_ready(node.meta.write(offset, bytes, IoFlags::empty())).map_err(err)?;
                }
                now_ready(node.meta.flush()).map(|()| None).map_err(err)
            }
        }
    }

    /// Move everything node `n`'s endpoint has queued to where it goes.
    fn pump(&mut self, n: usize) -> Result<(), String> {
        loop {
            let mut moved = false;
            let Some(ep) = self.nodes[n].ep.as_mut() else {
                return Ok(());
            };
            let mut msgs = Vec::new();
            while let Some(m) = ep.poll_transmit() {
                msgs.push(m);
            }
            let mut ios = Vec::new();
            while let Some(io) = ep.poll_local_io() {
                ios.push(io);
            }
            let mut events = Vec::new();
            while let Some(e) = ep.poll_event() {
                events.push(e);
            }
            let state = ep.state();
            for m in msgs {
                moved = true;
                self.send(n, m, state);
            }
            for io in ios {
                moved = true;
                let op = io.op();
                let delay = Duration::from_micros(
                    self.rng
                        .random_range(0..=self.plan.io_delay.as_micros() as u64),
                );
                let inc = self.nodes[n].inc;
                self.nodes[n].local.insert(op, io);
                self.at(delay, Ev::LocalDone { node: n, inc, op });
            }
            for e in events {
                moved = true;
                self.on_event(n, e)?;
            }
            if !moved {
                break;
            }
        }
        self.arm_timer(n);
        Ok(())
    }

    fn arm_timer(&mut self, n: usize) {
        let Some(ep) = self.nodes[n].ep.as_ref() else {
            return;
        };
        let Some(deadline) = ep.poll_timeout() else {
            return;
        };
        if self.nodes[n].timer == Some(deadline) {
            return;
        }
        self.nodes[n].timer = Some(deadline);
        let after = deadline
            .saturating_duration_since(self.now())
            .max(Duration::from_micros(1));
        let inc = self.nodes[n].inc;
        self.at(
            after,
            Ev::Timer {
                node: n,
                inc,
                at: deadline,
            },
        );
    }

    fn on_event(&mut self, n: usize, e: Event) -> Result<(), String> {
        let id = self.nodes[n].id;
        match e {
            Event::Completed { request, result } => {
                if let Some(reply) = self.nodes[n].lu_requests.remove(&request) {
                    let _ = reply.send(result);
                    return Ok(());
                }
                let Some(req) = self.nodes[n].requests.remove(&request) else {
                    return Err(format!(
                        "node {id}: a completion for unknown request {request:?}"
                    ));
                };
                let link = self.mirroring_link(n);
                match req {
                    Req::Write(i) => {
                        // Submitted after the nodes were separated, and acknowledged
                        // before they met again: it can only be on this node.
                        let apart = self
                            .apart_since
                            .filter(|since| self.hist.submitted(i) >= *since)
                            .map(|_| self.link.epoch);
                        self.hist.write_done(i, result.is_ok(), link, apart, self.t);
                        tr!(
                            self,
                            format!(
                                "node {id}: write #{i} done: {:?}",
                                result.as_ref().map(|_| ())
                            )
                        );
                    }
                    Req::Flush(f) => {
                        if result.is_ok() {
                            self.hist.flush_done(f, self.t);
                        }
                        tr!(self, format!("node {id}: flush done: {result:?}"));
                    }
                    Req::Read {
                        offset,
                        len,
                        submit,
                    } => match result {
                        Ok(Some(data)) => {
                            if data.len() as u64 != len {
                                return Err(format!(
                                    "node {id}: a read of {len} bytes returned {}",
                                    data.len()
                                ));
                            }
                            self.check_read(offset, &data, submit, self.t)
                                .map_err(|e| format!("node {id}: read at {offset}: {e}"))?;
                        }
                        Ok(None) => return Err(format!("node {id}: a read returned no data")),
                        Err(k) => tr!(self, format!("node {id}: read failed: {k:?}")),
                    },
                }
            }
            Event::Connected => {
                self.nodes[n].restarted_unlinked = false;
                tr!(
                    self,
                    format!(
                        "node {id}: connected ({:?})",
                        self.nodes[n].ep.as_ref().map(|ep| ep.generations())
                    )
                )
            }
            Event::Refused { reason } | Event::PeerLost { reason } => {
                tr!(self, format!("node {id}: link dropped: {reason}"));
                self.close_side(n, true);
            }
            Event::NeedQuorum => {
                self.nodes[n].witness_gen += 1;
                let (inc, wgen) = (self.nodes[n].inc, self.nodes[n].witness_gen);
                let d = self.witness_delay(n);
                self.at(d, Ev::Claim { node: n, inc, wgen });
            }
            Event::ReleaseQuorum => {
                self.nodes[n].witness_gen += 1;
                let d = self.witness_delay(n);
                self.at(d, Ev::Release { node: n });
            }
            Event::ScsiRequest {
                epoch,
                id: call,
                body,
            } => {
                tr!(
                    self,
                    format!("node {id}: SCSI call {call} from the other node")
                );
                match self.nodes[n].unit.as_ref() {
                    Some(u) => {
                        let lu = u.lu.clone();
                        self.exec.spawn(n, async move {
                            scsi::Out::Reply {
                                node: n,
                                epoch,
                                id: call,
                                result: lu.on_peer_message(body).await.map_err(|e| e.kind()),
                            }
                        });
                    }
                    None => {
                        let now = self.now();
                        if let Some(ep) = self.nodes[n].ep.as_mut() {
                            ep.reply_scsi(
                                now,
                                epoch,
                                call,
                                Err(vsan_core::ErrorKind::NotSupported),
                            );
                        }
                    }
                }
            }
            other => tr!(self, format!("node {id}: {other:?}")),
        }
        Ok(())
    }

    /// When a request of node `n` reaches the witness, from now: the driver's witness
    /// worker sends one request at a time, in order, so requests never overtake.
    fn witness_delay(&mut self, n: usize) -> Duration {
        let at =
            (self.t + self.net_delay()).max(self.nodes[n].witness_at + Duration::from_micros(1));
        self.nodes[n].witness_at = at;
        at - self.t
    }

    fn net_delay(&mut self) -> Duration {
        Duration::from_micros(
            self.rng
                .random_range(1..=self.plan.net_delay.as_micros() as u64),
        )
    }

    // ----- the link -----

    fn send(&mut self, n: usize, msg: vsan_replica::protocol::Message, _state: LinkState) {
        if !self.link.open[n] {
            return; // no link attached: the driver drops what it would send
        }
        let to = 1 - n;
        let last = self.link.wire[to].back().map_or(Duration::ZERO, |m| m.0);
        let at = (self.t + self.net_delay()).max(last);
        self.link.wire[to].push_back((at, msg));
        self.at(at - self.t, Ev::Deliver { to });
    }

    /// Deliver, in order, the messages towards `to` that are due.
    fn deliver(&mut self, to: usize) -> Result<(), String> {
        while !self.link.partitioned && self.link.open[to] && self.link.open[1 - to] {
            match self.link.wire[to].front() {
                Some((at, _)) if *at <= self.t => {}
                _ => break,
            }
            let (_, msg) = self.link.wire[to].pop_front().expect("a message");
            tr!(self, {
                let mut m = format!("{msg:?}");
                m.truncate(100);
                format!("node {} receives {m}", to + 1)
            });
            let now = self.now();
            if let Some(ep) = self.nodes[to].ep.as_mut() {
                ep.handle_message(now, msg);
            }
            self.pump(to)?;
        }
        Ok(())
    }

    /// Node `n` closes its side of the link (or loses it in a crash); the other side
    /// learns of it after a delay unless a partition keeps it from hearing.
    fn close_side(&mut self, n: usize, _graceful: bool) {
        if !self.link.open[n] {
            return;
        }
        self.link.open[n] = false;
        // What was on the way in either direction is lost (the connection is reset).
        self.link.wire = [VecDeque::new(), VecDeque::new()];
        let to = 1 - n;
        if self.link.open[to] && !self.link.partitioned {
            let d = self.net_delay();
            let epoch = self.link.epoch;
            self.at(d, Ev::Closed { to, epoch });
        }
        self.dial_later();
    }

    fn dial_later(&mut self) {
        if self.link.dialing || self.link.up() {
            return;
        }
        self.link.dialing = true;
        let d = ms(&mut self.rng, 10, 500);
        self.at(d, Ev::Dial);
    }

    fn dial(&mut self) -> Result<(), String> {
        self.link.dialing = false;
        if self.link.up() {
            return Ok(());
        }
        if self.link.partitioned || self.nodes.iter().any(|n| n.ep.is_none()) {
            // Retry later (a restart or a heal dials again too).
            self.dial_later();
            return Ok(());
        }
        self.link.epoch += 1;
        self.link.open = [true, true];
        self.link.wire = [VecDeque::new(), VecDeque::new()];
        let epoch = self.link.epoch;
        tr!(self, format!("link {epoch} connects"));
        let now = self.now();
        let first = self.rng.random_range(0..2);
        for n in [first, 1 - first] {
            if let Some(ep) = self.nodes[n].ep.as_mut() {
                ep.handle_connected(now);
            }
        }
        self.pump(first)?;
        self.pump(1 - first)
    }

    // ----- events -----

    fn handle(&mut self, ev: Ev) -> Result<(), String> {
        let now = self.now();
        match ev {
            Ev::Deliver { to } => self.deliver(to)?,
            Ev::Closed { to, epoch } => {
                if epoch == self.link.epoch && self.link.open[to] {
                    self.link.open[to] = false;
                    self.link.wire = [VecDeque::new(), VecDeque::new()];
                    if let Some(ep) = self.nodes[to].ep.as_mut() {
                        ep.handle_disconnected(now, "the peer closed the link");
                    }
                    self.pump(to)?;
                    self.dial_later();
                }
            }
            Ev::Dial => self.dial()?,
            Ev::LocalDone { node, inc, op } => {
                if inc != self.nodes[node].inc {
                    return Ok(());
                }
                let Some(io) = self.nodes[node].local.remove(&op) else {
                    return Ok(());
                };
                tr!(self, {
                    let mut m = format!("{io:?}");
                    m.truncate(100);
                    format!("node {} local done {m}", node + 1)
                });
                let r = self.execute(node, io);
                if let Some(ep) = self.nodes[node].ep.as_mut() {
                    ep.handle_local_done(now, op, r);
                }
                self.pump(node)?;
            }
            Ev::Timer { node, inc, at } => {
                if inc != self.nodes[node].inc {
                    return Ok(());
                }
                // A timer armed for a deadline since replaced is stale. (Only SCSI runs
                // skip it: there the units pump the endpoints often, and each stale
                // timer would re-arm one more; the plain runs keep their old scenarios,
                // which the kept regression seeds depend on.)
                if self.world.is_some() && self.nodes[node].timer != Some(at) {
                    return Ok(());
                }
                self.nodes[node].timer = None;
                let due = self.nodes[node]
                    .ep
                    .as_ref()
                    .and_then(|ep| ep.poll_timeout())
                    .is_some_and(|d| d <= now);
                if due && let Some(ep) = self.nodes[node].ep.as_mut() {
                    ep.handle_timeout(now);
                }
                self.pump(node)?;
            }
            Ev::Client { node } => self.client(node)?,
            Ev::Claim { node, inc, wgen } => {
                if inc != self.nodes[node].inc || wgen != self.nodes[node].witness_gen {
                    return Ok(());
                }
                let id = self.nodes[node].id;
                let granted = if self.nodes[node].witness_cut {
                    None
                } else if self.holder.is_none_or(|h| h == id) {
                    self.holder = Some(id);
                    Some(true)
                } else {
                    Some(false)
                };
                let d = match granted {
                    None => ms(&mut self.rng, 100, 1000), // the connection attempt times out
                    Some(_) => self.net_delay(),
                };
                tr!(self, format!("witness: claim from node {id}: {granted:?}"));
                self.at(
                    d,
                    Ev::Quorum {
                        node,
                        inc,
                        wgen,
                        granted: granted == Some(true),
                    },
                );
            }
            Ev::Quorum {
                node,
                inc,
                wgen,
                granted,
            } => {
                if inc != self.nodes[node].inc {
                    return Ok(());
                }
                if let Some(ep) = self.nodes[node].ep.as_mut() {
                    ep.handle_quorum(now, granted);
                }
                self.pump(node)?;
                if !granted && wgen == self.nodes[node].witness_gen {
                    // The worker asks again a second later.
                    let at = (self.t + Duration::from_secs(1))
                        .max(self.nodes[node].witness_at + Duration::from_micros(1));
                    self.nodes[node].witness_at = at;
                    self.at(at - self.t, Ev::Claim { node, inc, wgen });
                }
            }
            Ev::Release { node } => {
                let id = self.nodes[node].id;
                if !self.nodes[node].witness_cut && self.holder == Some(id) {
                    self.holder = None;
                    tr!(self, format!("witness: node {id} released"));
                }
            }
            Ev::Fault(f) => self.fault(f)?,
            Ev::Restart { node } => {
                if self.nodes[node].ep.is_none() {
                    self.start_node(node)?;
                    self.dial_later();
                }
            }
            Ev::EndDiskErrors { node } => {
                self.nodes[node].disk_errors = false;
                tr!(
                    self,
                    format!("node {}: the data device works again", node + 1)
                );
                self.reattach(node)?;
            }
            Ev::EndWitnessCut { node } => self.nodes[node].witness_cut = false,
            Ev::EndPartition => self.heal_partition()?,
            Ev::Heal => self.heal()?,
            Ev::ScsiSettle { node, inc, epoch } => {
                if inc == self.nodes[node].inc
                    && let Some(u) = self.nodes[node].unit.as_ref()
                    && u.epoch == Some(epoch)
                    && !u.settled
                {
                    self.spawn_settle(node, epoch);
                }
            }
        }
        Ok(())
    }

    /// The operator attaches a replica that was detached (when the peer is there).
    fn reattach(&mut self, n: usize) -> Result<(), String> {
        let now = self.now();
        if self.nodes[n].disk_errors {
            return Ok(());
        }
        if self.nodes[n].ep.as_ref().is_some_and(|ep| ep.meta_failed()) {
            // "The replica's metadata failed: restart the node."
            let id = self.nodes[n].id;
            tr!(
                self,
                format!("node {id}: operator restarts the node (its metadata failed)")
            );
            let d = ms(&mut self.rng, 1, 200);
            return self.crash(n, d, Some(PowerCut::KeepUnflushed));
        }
        if let Some(ep) = self.nodes[n].ep.as_mut()
            && ep.is_detached()
        {
            let r = ep.attach_local(now);
            let id = self.nodes[n].id;
            tr!(
                self,
                format!("node {id}: operator attaches the replica: {r:?}")
            );
            self.pump(n)?;
        }
        Ok(())
    }

    /// Both replicas inconsistent (both failed, or both distrusted) and apart: only the
    /// operator can pick one; it discards the data of the one whose generation the
    /// other went on from (it missed what the other did since), else node 2's.
    fn pick_a_side(&mut self) -> Result<(), String> {
        let (Some(a), Some(b)) = (self.nodes[0].ep.as_ref(), self.nodes[1].ep.as_ref()) else {
            return Ok(());
        };
        if !(a.is_inconsistent() && b.is_inconsistent())
            || a.state() == LinkState::Connected
            || self.discarded
        {
            return Ok(());
        }
        let (ga, gb) = (a.generations(), b.generations());
        let older_a = ga.current == gb.bitmap || gb.history.contains(&ga.current);
        let n = if older_a { 0 } else { 1 };
        tr!(
            self,
            format!(
                "operator: both replicas inconsistent; node {} discards its data",
                n + 1
            )
        );
        self.discarded = true;
        if let Some(ep) = self.nodes[n].ep.as_mut() {
            ep.discard_my_data();
        }
        Ok(())
    }

    fn heal_partition(&mut self) -> Result<(), String> {
        if !self.link.partitioned {
            return Ok(());
        }
        self.link.partitioned = false;
        tr!(self, "partition heals".into());
        let epoch = self.link.epoch;
        for to in 0..2 {
            // What waited goes on, in order (retransmitted).
            if !self.link.wire[to].is_empty() {
                let d = self.net_delay();
                self.at(d, Ev::Deliver { to });
            }
            // A side closed during the partition is heard of now.
            if self.link.open[to] && !self.link.open[1 - to] {
                let d = self.net_delay();
                self.at(d, Ev::Closed { to, epoch });
            }
        }
        self.dial_later();
        Ok(())
    }

    fn fault(&mut self, f: Fault) -> Result<(), String> {
        if self.healing {
            return Ok(());
        }
        tr!(self, format!("fault: {f:?}"));
        match f {
            Fault::Reset => {
                if self.link.up() {
                    self.faults += 1;
                    let now = self.now();
                    let epoch = self.link.epoch;
                    self.link.open = [false, false];
                    self.link.wire = [VecDeque::new(), VecDeque::new()];
                    for n in 0..2 {
                        if let Some(ep) = self.nodes[n].ep.as_mut() {
                            ep.handle_disconnected(now, &format!("link {epoch} reset"));
                        }
                    }
                    self.pump(0)?;
                    self.pump(1)?;
                    self.dial_later();
                }
            }
            Fault::Partition(d) => {
                if !self.link.partitioned {
                    self.faults += 1;
                    self.link.partitioned = true;
                    self.at(d, Ev::EndPartition);
                }
            }
            Fault::Crash(n, after) => self.crash(n, after, None)?,
            Fault::CrashBoth(a, b) => {
                self.crash(0, a, None)?;
                self.crash(1, b, None)?;
            }
            Fault::DiskErrors(n, d) => {
                if !self.nodes[n].disk_errors {
                    self.faults += 1;
                    self.nodes[n].disk_errors = true;
                    self.at(d, Ev::EndDiskErrors { node: n });
                }
            }
            Fault::WitnessCut(n, d) => {
                if self.plan.witness.is_some() && !self.nodes[n].witness_cut {
                    self.faults += 1;
                    self.nodes[n].witness_cut = true;
                    self.at(d, Ev::EndWitnessCut { node: n });
                }
            }
        }
        Ok(())
    }

    /// The faults stop: clients stop submitting, partitions heal, disks and the witness
    /// work again, nodes that are down start, detached replicas are attached.
    fn heal(&mut self) -> Result<(), String> {
        tr!(self, "heal: faults stop, clients stop submitting".into());
        self.healing = true;
        self.clients_on = false;
        for n in 0..2 {
            self.nodes[n].disk_errors = false;
            self.nodes[n].witness_cut = false;
        }
        self.heal_partition()?;
        for n in 0..2 {
            if self.nodes[n].ep.is_none() {
                self.start_node(n)?;
            }
        }
        self.dial_later();
        Ok(())
    }

    // ----- clients -----

    fn client(&mut self, n: usize) -> Result<(), String> {
        if self.healing {
            // The operator's periodic look: attach detached replicas, and pick a side
            // when both replicas are inconsistent.
            self.reattach(n)?;
            self.pick_a_side()?;
            self.at(Duration::from_millis(100), Ev::Client { node: n });
            return Ok(());
        }
        let next = Duration::from_micros(self.rng.random_range(1..=3000));
        self.at(next, Ev::Client { node: n });
        if self.world.is_some() {
            return self.scsi_client(n);
        }
        // Without a witness, node 2's client only reads, and only in the window between
        // a restart and its first handshake: a second writer would make split brains
        // only an operator resolves, and a node that lost its peer while running serves
        // its replica as it was (no witness decides who goes on). In that window the
        // peer may have acknowledged writes alone: a read must not miss them.
        let probe_only = self.plan.witness.is_none() && n == 1;
        if !self.clients_on || (probe_only && !self.nodes[n].restarted_unlinked) {
            return Ok(());
        }
        let Some(_) = self.nodes[n].ep.as_ref() else {
            return Ok(());
        };
        if self.nodes[n].requests.len() >= self.plan.depth {
            return Ok(());
        }
        let now = self.now();
        let id = self.nodes[n].id;
        let link = self.mirroring_link(n);
        let roll = self.rng.random_range(0..100);
        let (start, count) = {
            let count = self.rng.random_range(1..=8u64);
            let start = self
                .rng
                .random_range(0..=self.plan.hot.saturating_sub(count));
            (start, count)
        };
        let offset = start * SECTOR;
        let len = count * SECTOR;
        let fua = self.rng.random_bool(0.2);
        let roll = if probe_only { 99 } else { roll };
        let ep = self.nodes[n].ep.as_mut().expect("checked");
        let (req, what) = match roll {
            0..=54 => {
                let wid = self.next_write;
                self.next_write += 1;
                let mut buf = BytesMut::zeroed(len as usize);
                for (i, s) in buf.chunks_mut(SECTOR as usize).enumerate() {
                    sector_bytes(wid, start + i as u64, s);
                }
                let i = self
                    .hist
                    .submit_write(wid, id, false, (start, count), fua, self.t);
                let r = ep.submit_write(now, offset, WritePayload::Data(Bytes::from(buf)), fua);
                (r, Req::Write(i))
            }
            55..=59 => {
                let wid = self.next_write;
                self.next_write += 1;
                let payload = if self.rng.random_bool(0.5) {
                    WritePayload::Zeroes { len }
                } else {
                    WritePayload::Discard { len }
                };
                let i = self
                    .hist
                    .submit_write(wid, id, true, (start, count), fua, self.t);
                let r = ep.submit_write(now, offset, payload, fua);
                (r, Req::Write(i))
            }
            60..=69 => {
                let f = self.hist.submit_flush(id, link, self.t);
                (ep.submit_flush(now), Req::Flush(f))
            }
            _ => {
                let r = ep.submit_read(now, offset, len as u32);
                (
                    r,
                    Req::Read {
                        offset,
                        len,
                        submit: self.t,
                    },
                )
            }
        };
        tr!(
            self,
            format!("node {id}: submit {what:?} at sector {start} (+{count})")
        );
        self.nodes[n].requests.insert(req, what);
        self.pump(n)
    }
}
