//! Two endpoints driven against each other in one thread (quinn's `Pair` style): every
//! message delivery and every local I/O completion is an explicit step, so tests can
//! enumerate the orders in which they happen.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::*;

mod data_loss;
mod failures;
mod freshness;
mod mirroring;

const SIZE: u64 = 64 * 1024;

const BS: u32 = 512;

#[derive(Clone)]
pub(super) struct Node {
    pub(super) ep: Endpoint,
    pub(super) disk: Vec<u8>,
    /// Durable image: what survives a crash (updated by flush and FUA).
    pub(super) durable: Vec<u8>,
    /// Local I/O issued but not completed, in issue order.
    pub(super) io: Vec<LocalIo>,
    /// Messages on the wire towards this node.
    pub(super) inbox: VecDeque<Message>,
    pub(super) completed: Vec<(RequestId, Result<Option<Bytes>, ErrorKind>)>,
    pub(super) events: Vec<Event>,
    pub(super) fail_local: bool,
    /// Metadata writes wait in `io` instead of completing at once.
    pub(super) hold_meta: bool,
    /// Metadata writes fail.
    pub(super) fail_meta: bool,
}

/// Metadata of a replica in sync at generation 77 (as if the pair had synced before).
pub(super) fn synced_meta(cfg: &Config, chunk_size: u64, current: u64) -> crate::meta::Loaded {
    let layout = crate::meta::Layout::new(cfg.size, chunk_size);
    crate::meta::Loaded {
        layout,
        superblock: crate::meta::Superblock {
            seq: 1,
            disk_id: cfg.disk_id,
            disk_name: cfg.disk_name.clone(),
            node_id: cfg.node_id,
            peer_id: cfg.peer_id,
            size: cfg.size,
            block_size: cfg.block_size,
            chunk_size,
            generations: Generations {
                current,
                bitmap: 0,
                history: [0, 0],
            },
            inconsistent: false,
            crashed: false,
            clean_shutdown: true,
        },
        al_seq: 1,
        al: Vec::new(),
        bitmap: crate::meta::Bitmap::new(layout.chunks()),
    }
}

impl Node {
    fn new(id: u32, peer: u32, now: Instant) -> Node {
        let mut cfg = Config::new(id, peer, DiskId([7; 16]), "vol0", SIZE, BS);
        cfg.peer_timeout = Duration::from_secs(5);
        Node::with(cfg, 64 * 1024, 77, now)
    }

    pub(super) fn with(cfg: Config, chunk_size: u64, current: u64, now: Instant) -> Node {
        let size = cfg.size as usize;
        let meta = synced_meta(&cfg, chunk_size, current);
        Node {
            ep: Endpoint::new(cfg, meta, now),
            disk: vec![0; size],
            durable: vec![0; size],
            io: Vec::new(),
            inbox: VecDeque::new(),
            completed: Vec::new(),
            events: Vec::new(),
            fail_local: false,
            hold_meta: false,
            fail_meta: false,
        }
    }

    pub(super) fn result_of(&self, req: RequestId) -> Option<&Result<Option<Bytes>, ErrorKind>> {
        self.completed
            .iter()
            .find(|(r, _)| *r == req)
            .map(|(_, res)| res)
    }

    pub(super) fn sync_starts(&self) -> Vec<(SyncRole, SyncKind)> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::SyncStarted { role, kind, .. } => Some((*role, *kind)),
                _ => None,
            })
            .collect()
    }

    pub(super) fn lost_peer(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::PeerLost { reason } => Some(reason.clone()),
                _ => None,
            })
            .collect()
    }
}

#[derive(Clone)]
pub(super) struct Pair {
    pub(super) now: Instant,
    /// Node 1 (the resolver) and node 2.
    pub(super) n: [Node; 2],
}

impl Pair {
    pub(super) fn new() -> Pair {
        let now = Instant::now();
        Pair {
            now,
            n: [Node::new(1, 2, now), Node::new(2, 1, now)],
        }
    }

    /// A pair that has completed its handshake.
    pub(super) fn connected() -> Pair {
        let mut p = Pair::new();
        p.connect();
        p.run();
        assert_eq!(p.n[0].ep.state(), LinkState::Connected);
        assert_eq!(p.n[1].ep.state(), LinkState::Connected);
        p
    }

    pub(super) fn connect(&mut self) {
        let now = self.now;
        for n in &mut self.n {
            n.ep.handle_connected(now);
        }
        self.pump();
    }

    /// Move every output of both endpoints to where it goes.
    pub(super) fn pump(&mut self) {
        // Completing a metadata write can queue messages: go round until quiet.
        for _ in 0..8 {
            self.pump_once();
        }
    }

    fn pump_once(&mut self) {
        for i in 0..2 {
            while let Some(m) = self.n[i].ep.poll_transmit() {
                self.n[1 - i].inbox.push_back(m);
            }
            let n = &mut self.n[i];
            // Metadata writes complete at once (these tests are about data ordering),
            // unless the node holds them.
            while let Some(io) = n.ep.poll_local_io() {
                match io {
                    LocalIo::Meta { op, .. } if !n.hold_meta => {
                        let r = if n.fail_meta {
                            Err(ErrorKind::Io)
                        } else {
                            Ok(None)
                        };
                        n.ep.handle_local_done(self.now, op, r)
                    }
                    io => n.io.push(io),
                }
            }
            while let Some(e) = n.ep.poll_event() {
                if let Event::Completed { request, result } = &e {
                    n.completed.push((*request, result.clone()));
                }
                n.events.push(e);
            }
        }
    }

    pub(super) fn deliver(&mut self, to: usize) -> bool {
        let Some(m) = self.n[to].inbox.pop_front() else {
            return false;
        };
        let now = self.now;
        self.n[to].ep.handle_message(now, m);
        self.pump();
        true
    }

    pub(super) fn complete_io(&mut self, node: usize, index: usize) {
        let now = self.now;
        let n = &mut self.n[node];
        let io = n.io.remove(index);
        let (op, result) = match io {
            LocalIo::Write {
                op,
                offset,
                payload,
                fua,
            } => {
                if n.fail_local {
                    (op, Err(ErrorKind::Io))
                } else {
                    let range = offset as usize..(offset + payload.len()) as usize;
                    match &payload {
                        WritePayload::Data(d) => n.disk[range.clone()].copy_from_slice(d),
                        WritePayload::Zeroes { .. } | WritePayload::Discard { .. } => {
                            n.disk[range.clone()].fill(0)
                        }
                    }
                    if fua {
                        n.durable[range.clone()].copy_from_slice(&n.disk[range]);
                    }
                    (op, Ok(None))
                }
            }
            LocalIo::Flush { op } => {
                if n.fail_local {
                    (op, Err(ErrorKind::Io))
                } else {
                    n.durable.copy_from_slice(&n.disk);
                    (op, Ok(None))
                }
            }
            LocalIo::Read {
                op, offset, len, ..
            } => {
                if n.fail_local {
                    (op, Err(ErrorKind::Io))
                } else {
                    let data = Bytes::copy_from_slice(
                        &n.disk[offset as usize..offset as usize + len as usize],
                    );
                    (op, Ok(Some(data)))
                }
            }
            LocalIo::Meta { op, .. } => {
                if n.fail_meta {
                    (op, Err(ErrorKind::Io))
                } else {
                    (op, Ok(None))
                }
            }
        };
        n.ep.handle_local_done(now, op, result);
        self.pump();
    }

    /// Deliver everything and complete all I/O in order until nothing moves.
    pub(super) fn run(&mut self) {
        self.run_where(|_, _| true);
    }

    /// Deliver everything and complete, in order, the I/O `allow` lets through (by node
    /// index and I/O), until nothing moves.
    pub(super) fn run_where(&mut self, allow: impl Fn(usize, &LocalIo) -> bool) {
        loop {
            let mut moved = false;
            for i in 0..2 {
                while self.deliver(i) {
                    moved = true;
                }
                while let Some(k) = self.n[i].io.iter().position(|io| allow(i, io)) {
                    self.complete_io(i, k);
                    moved = true;
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Node `node`'s replica reports that it lost acknowledged data.
    pub(super) fn lose(&mut self, node: usize) {
        let now = self.now;
        self.n[node].ep.local_data_lost(now);
        self.pump();
    }

    pub(super) fn write(
        &mut self,
        node: usize,
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    ) -> RequestId {
        let now = self.now;
        let r =
            self.n[node]
                .ep
                .submit_write(now, offset, WritePayload::Data(Bytes::from(data)), fua);
        self.pump();
        r
    }

    /// The possible next steps: deliver to a node, or complete one of its pending I/Os.
    pub(super) fn steps(&self) -> Vec<(usize, Option<usize>)> {
        let mut out = Vec::new();
        for i in 0..2 {
            if !self.n[i].inbox.is_empty() {
                out.push((i, None));
            }
            for k in 0..self.n[i].io.len() {
                out.push((i, Some(k)));
            }
        }
        out
    }

    pub(super) fn step(&mut self, s: (usize, Option<usize>)) {
        match s {
            (i, None) => {
                self.deliver(i);
            }
            (i, Some(k)) => self.complete_io(i, k),
        }
    }
}

pub(super) fn fill(byte: u8, len: usize) -> Vec<u8> {
    vec![byte; len]
}

/// Explore every order of steps from `p` (depth-first), calling `check` at each end.
fn explore(p: &Pair, leaves: &mut u64, check: &mut dyn FnMut(&Pair)) {
    let steps = p.steps();
    if steps.is_empty() {
        *leaves += 1;
        check(p);
        return;
    }
    for s in steps {
        let mut q = p.clone();
        q.step(s);
        explore(&q, leaves, check);
    }
}

/// A small deterministic generator for the randomized interleavings below.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

// ----- regressions from review (each reproduced a bug before its fix) -----

impl Pair {
    /// Like `run`, but never completes local op `hold` on node `node`.
    fn run_except(&mut self, node: usize, hold: LocalOpId) {
        self.run_where(|i, io| !(i == node && io.op() == hold));
    }

    /// Complete node `node`'s pending local op `op` (held back by [`Self::run_except`]).
    fn complete_op(&mut self, node: usize, op: LocalOpId) {
        let k = self.n[node]
            .io
            .iter()
            .position(|io| io.op() == op)
            .expect("the held op is pending");
        self.complete_io(node, k);
    }

    pub(super) fn cut(&mut self) {
        let now = self.now;
        for n in &mut self.n {
            n.ep.handle_disconnected(now, "reset");
        }
        self.pump();
        for n in &mut self.n {
            n.inbox.clear();
        }
    }
}

fn quorum_pair(policy: QuorumPolicy) -> Pair {
    let now = Instant::now();
    let mk = |id, peer| {
        let mut cfg = Config::new(id, peer, DiskId([7; 16]), "vol0", SIZE, BS);
        cfg.quorum = Some(policy);
        Node::with(cfg, 64 * 1024, 77, now)
    };
    let mut p = Pair {
        now,
        n: [mk(1, 2), mk(2, 1)],
    };
    p.connect();
    p.run();
    assert_eq!(p.n[0].ep.state(), LinkState::Connected);
    p
}

// ----- a local replica that lost acknowledged data (a failed write-back cache) -----

const LOSS_DISK: u64 = 64 * 1024;

const LOSS_CHUNK: u64 = 4096;

/// A connected pair over 16 chunks of 4 KiB, every block written with data of its own.
fn loss_pair() -> Pair {
    let now = Instant::now();
    let mk = |id: u32, peer: u32| {
        let mut cfg = Config::new(id, peer, DiskId([7; 16]), "vol0", LOSS_DISK, BS);
        cfg.seed = u64::from(id);
        Node::with(cfg, LOSS_CHUNK, 77, now)
    };
    let mut p = Pair {
        now,
        n: [mk(1, 2), mk(2, 1)],
    };
    p.connect();
    p.run();
    for b in 0..LOSS_DISK / u64::from(BS) {
        let data = fill(b as u8 ^ 0x5a, BS as usize);
        p.write((b % 2) as usize, b * u64::from(BS), data, false);
    }
    p.run();
    assert_eq!(p.n[0].disk, p.n[1].disk);
    p
}

impl Pair {
    /// Everything delivered and completed, with time passing for the resync's
    /// checkpoints.
    pub(super) fn settle(&mut self) {
        self.settle_rounds(4);
    }

    /// `settle` with `rounds` steps of 1.5 s.
    pub(super) fn settle_rounds(&mut self, rounds: usize) {
        self.run();
        for _ in 0..rounds {
            self.now += Duration::from_millis(1500);
            for i in 0..2 {
                let now = self.now;
                self.n[i].ep.handle_timeout(now);
            }
            self.pump();
            self.run();
        }
    }

    /// Node `node`'s replica silently loses what was written to `chunk` since `before`
    /// (a snapshot of its disk), as a write-back cache losing its dirty data would.
    pub(super) fn lose_chunk(&mut self, node: usize, chunk: u64, before: &[u8]) {
        let r = (chunk * LOSS_CHUNK) as usize..((chunk + 1) * LOSS_CHUNK) as usize;
        self.n[node].disk[r.clone()].copy_from_slice(&before[r.clone()]);
        self.n[node].durable[r.clone()].copy_from_slice(&before[r]);
    }

    pub(super) fn read(&mut self, node: usize, offset: u64, len: u32) -> RequestId {
        let now = self.now;
        let r = self.n[node].ep.submit_read(now, offset, len);
        self.pump();
        r
    }

    pub(super) fn sync_ends(&self, node: usize) -> Vec<SyncSummary> {
        self.n[node]
            .events
            .iter()
            .filter_map(|e| match e {
                Event::SyncEnded(s) => Some(*s),
                _ => None,
            })
            .collect()
    }
}

pub(super) fn chunk_bytes(disk: &[u8], chunk: u64) -> Bytes {
    Bytes::copy_from_slice(
        &disk[(chunk * LOSS_CHUNK) as usize..((chunk + 1) * LOSS_CHUNK) as usize],
    )
}

/// A pair with a bitmap resync from node 1 to node 2 under way: node 1 wrote chunks 0..8
/// alone; node 2 has received some of them.
fn resync_under_way() -> Pair {
    let mut p = loss_pair();
    p.cut();
    for c in 0..8 {
        p.write(0, c * LOSS_CHUNK, fill(0xa0 + c as u8, 4096), false);
    }
    p.run();
    p.connect();
    for _ in 0..200 {
        if p.n[1].ep.dirty_chunks() > 0 && p.n[1].ep.dirty_chunks() < 6 {
            break;
        }
        let steps = p.steps();
        let Some(&s) = steps.first() else { break };
        p.step(s);
    }
    assert!(p.n[1].ep.is_inconsistent(), "node 2 is not a sync target");
    assert!(p.n[1].ep.dirty_chunks() > 0);
    p
}

impl Pair {
    /// Take node `node`'s pending local I/O that `pick` selects out of the harness.
    fn take_io(&mut self, node: usize, pick: impl Fn(&LocalIo) -> bool) -> Option<LocalIo> {
        let k = self.n[node].io.iter().position(pick)?;
        Some(self.n[node].io.remove(k))
    }
}
