//! Two endpoints driven against each other in one thread (quinn's `Pair` style): every
//! message delivery and every local I/O completion is an explicit step, so tests can
//! enumerate the orders in which they happen.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::*;

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

#[test]
fn handshake_then_mirrored_write_lands_on_both() {
    let mut p = Pair::connected();
    let r = p.write(0, 4096, fill(0xa5, 4096), false);
    p.run();
    assert_eq!(p.n[0].result_of(r), Some(&Ok(None)));
    assert_eq!(&p.n[0].disk[4096..8192], &fill(0xa5, 4096)[..]);
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

#[test]
fn a_write_completes_only_after_both_sides_have_it() {
    let mut p = Pair::connected();
    let r = p.write(0, 0, fill(1, 512), false);
    // Local write done, peer has not even received it.
    p.complete_io(0, 0);
    assert_eq!(p.n[0].result_of(r), None);
    // Peer receives and applies, but the ack is still on the wire.
    p.deliver(1);
    p.complete_io(1, 0);
    assert_eq!(p.n[0].result_of(r), None);
    p.deliver(0);
    assert_eq!(p.n[0].result_of(r), Some(&Ok(None)));
}

#[test]
fn local_write_and_send_start_together() {
    let mut p = Pair::connected();
    p.write(1, 0, fill(1, 512), false);
    assert_eq!(p.n[1].io.len(), 1, "local write issued");
    assert_eq!(
        p.n[0].inbox.len(),
        1,
        "write sent to the peer at the same time"
    );
}

#[test]
fn flush_covers_writes_completed_before_it_on_both_nodes() {
    let mut p = Pair::connected();
    let w = p.write(0, 0, fill(3, 1024), false);
    p.run();
    assert!(p.n[0].result_of(w).is_some());
    let now = p.now;
    let f = p.n[0].ep.submit_flush(now);
    p.pump();
    // The flush must not complete before the peer has flushed.
    p.complete_io(0, 0);
    assert_eq!(p.n[0].result_of(f), None);
    p.run();
    assert_eq!(p.n[0].result_of(f), Some(&Ok(None)));
    assert_eq!(&p.n[0].durable[..1024], &fill(3, 1024)[..]);
    assert_eq!(&p.n[1].durable[..1024], &fill(3, 1024)[..]);
}

#[test]
fn fua_is_honoured_on_both_nodes() {
    let mut p = Pair::connected();
    p.write(1, 2048, fill(9, 512), true);
    p.run();
    for n in &p.n {
        assert_eq!(&n.durable[2048..2560], &fill(9, 512)[..]);
    }
}

#[test]
fn mismatched_peers_are_refused_with_a_reason_on_both_sides() {
    type Tweak = fn(&mut Config);
    let cases: [(Tweak, &str); 4] = [
        (|c| c.size = SIZE * 2, "disk size mismatch"),
        (|c| c.disk_id = DiskId([9; 16]), "disk id mismatch"),
        (|c| c.block_size = 4096, "block size mismatch"),
        (|c| c.peer_id = 3, "node id mismatch"),
    ];
    for (tweak, needle) in cases {
        let now = Instant::now();
        let mut p = Pair::new();
        let mut cfg = Config::new(2, 1, DiskId([7; 16]), "vol0", SIZE, BS);
        tweak(&mut cfg);
        let meta = synced_meta(&cfg, 64 * 1024, 77);
        p.n[1].ep = Endpoint::new(cfg, meta, now);
        p.connect();
        p.run();
        for n in &p.n {
            let reason = n
                .events
                .iter()
                .find_map(|e| match e {
                    Event::Refused { reason } => Some(reason.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            assert!(reason.contains(needle), "{needle}: got {reason:?}");
            assert_ne!(n.ep.state(), LinkState::Connected);
        }
    }
}

#[test]
fn overlapping_writes_from_both_sides_in_every_interleaving_end_identical() {
    // Same range, partial overlap, and containment.
    let shapes: [((u64, usize), (u64, usize)); 3] = [
        ((0, 1024), (0, 1024)),
        ((0, 1024), (512, 1024)),
        ((0, 2048), (512, 512)),
    ];
    for ((oa, la), (ob, lb)) in shapes {
        let mut p = Pair::connected();
        let ra = p.write(0, oa, fill(0xaa, la), false);
        let rb = p.write(1, ob, fill(0xbb, lb), false);
        let mut leaves = 0;
        explore(&p, &mut leaves, &mut |q| {
            assert_eq!(q.n[0].disk, q.n[1].disk, "replicas differ");
            assert_eq!(q.n[0].result_of(ra), Some(&Ok(None)));
            assert_eq!(q.n[1].result_of(rb), Some(&Ok(None)));
            // Concurrent overlapping writes: the resolver's (node 1's) wins.
            assert_eq!(
                &q.n[0].disk[oa as usize..oa as usize + la],
                &fill(0xaa, la)[..]
            );
        });
        assert!(leaves > 100, "only {leaves} interleavings explored");
    }
}

#[test]
fn three_overlapping_writes_in_every_interleaving_end_identical() {
    let mut p = Pair::connected();
    let r1 = p.write(0, 0, fill(0x11, 1024), false);
    let r2 = p.write(1, 512, fill(0x22, 1024), false);
    let r3 = p.write(1, 0, fill(0x33, 512), false);
    let mut leaves = 0;
    explore(&p, &mut leaves, &mut |q| {
        assert_eq!(q.n[0].disk, q.n[1].disk, "replicas differ");
        assert_eq!(q.n[0].result_of(r1), Some(&Ok(None)));
        assert_eq!(q.n[1].result_of(r2), Some(&Ok(None)));
        assert_eq!(q.n[1].result_of(r3), Some(&Ok(None)));
    });
    assert!(leaves > 1000, "only {leaves} interleavings explored");
}

#[test]
fn a_write_submitted_after_seeing_the_peers_write_wins_on_both() {
    // Node 2 writes; node 1 receives it, and only then writes the same range: node 1's
    // write is later in every sense and must be what both replicas hold.
    let mut p = Pair::connected();
    p.write(1, 0, fill(0x22, 512), false);
    p.deliver(0);
    let mut leaves = 0;
    let r = p.write(0, 0, fill(0x11, 512), false);
    explore(&p, &mut leaves, &mut |q| {
        assert_eq!(q.n[0].disk, q.n[1].disk);
        assert_eq!(&q.n[0].disk[..512], &fill(0x11, 512)[..]);
        assert_eq!(q.n[0].result_of(r), Some(&Ok(None)));
    });
    // And the same with the roles swapped (the non-resolver writes second).
    let mut p = Pair::connected();
    p.write(0, 0, fill(0x11, 512), false);
    p.deliver(1);
    let r = p.write(1, 0, fill(0x22, 512), false);
    explore(&p, &mut leaves, &mut |q| {
        assert_eq!(q.n[0].disk, q.n[1].disk);
        assert_eq!(&q.n[1].disk[..512], &fill(0x22, 512)[..]);
        assert_eq!(q.n[1].result_of(r), Some(&Ok(None)));
    });
}

#[test]
fn peer_timeout_completes_writes_degraded_and_resyncs_on_reconnect() {
    let mut p = Pair::connected();
    let gen_before = p.n[0].ep.generations();
    let r = p.write(0, 0, fill(5, 512), false);
    p.complete_io(0, 0);
    // The peer never answers.
    let deadline = p.n[0].ep.poll_timeout().expect("a timer is armed");
    assert!(deadline <= p.now + Duration::from_secs(5));
    let later = p.now + Duration::from_secs(6);
    p.n[0].ep.handle_timeout(later);
    p.pump();
    assert_eq!(p.n[0].ep.state(), LinkState::Degraded);
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(None)),
        "completed on the survivor alone"
    );
    assert!(
        p.n[0]
            .events
            .iter()
            .any(|e| matches!(e, Event::PeerLost { .. }))
    );
    assert!(p.n[0].ep.is_diverged());
    // The write without the peer moved node 1 to a new generation.
    let g = p.n[0].ep.generations();
    assert_eq!(g.bitmap, gen_before.current);
    assert_ne!(g.current, gen_before.current);

    // A new link: node 1 is the sync source, the one dirty chunk travels, both end
    // identical and in sync on node 1's generation.
    p.n[0].inbox.clear();
    p.n[1].inbox.clear();
    p.n[1].ep.handle_disconnected(later, "reset");
    p.now = later;
    p.connect();
    p.run();
    assert_eq!(p.n[0].disk, p.n[1].disk);
    let done: Vec<SyncSummary> = p.n[0]
        .events
        .iter()
        .filter_map(|e| match e {
            Event::SyncEnded(s) => Some(*s),
            _ => None,
        })
        .collect();
    assert_eq!(done.len(), 1, "{:?}", p.n[0].events);
    assert!(done[0].completed);
    assert_eq!(done[0].role, SyncRole::Source);
    assert_eq!(done[0].transferred_bytes, SIZE);
    for n in &p.n {
        assert!(!n.ep.is_diverged());
        assert_eq!(n.ep.generations().current, g.current);
        assert_eq!(n.ep.generations().bitmap, 0);
        assert!(!n.ep.is_inconsistent());
    }
}

#[test]
fn idle_link_is_pinged_and_a_silent_peer_is_lost() {
    let mut p = Pair::connected();
    let t = p.now + Duration::from_millis(1100);
    p.n[0].ep.handle_timeout(t);
    p.pump();
    assert!(matches!(p.n[1].inbox.back(), Some(Message::Ping { .. })));
    p.now = t;
    p.run();
    assert_eq!(
        p.n[0].ep.state(),
        LinkState::Connected,
        "pong keeps it alive"
    );
    p.n[0].ep.handle_timeout(t + Duration::from_secs(6));
    p.pump();
    assert_eq!(p.n[0].ep.state(), LinkState::Degraded);
}

#[test]
fn local_disk_error_detaches_and_io_goes_through_the_peer() {
    let mut p = Pair::connected();
    p.n[0].fail_local = true;
    let w = p.write(0, 0, fill(0x77, 1024), false);
    p.run();
    assert_eq!(
        p.n[0].result_of(w),
        Some(&Ok(None)),
        "the caller sees no error"
    );
    assert!(p.n[0].ep.is_detached());
    assert_eq!(&p.n[1].disk[..1024], &fill(0x77, 1024)[..]);
    // Reads and further writes are served by the peer.
    let now = p.now;
    let r = p.n[0].ep.submit_read(now, 0, 1024);
    p.pump();
    p.run();
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0x77, 1024)))))
    );
    let w2 = p.write(0, 1024, fill(0x78, 512), false);
    p.run();
    assert_eq!(p.n[0].result_of(w2), Some(&Ok(None)));
    assert_eq!(&p.n[1].disk[1024..1536], &fill(0x78, 512)[..]);
}

#[test]
fn a_read_that_fails_locally_is_retried_on_the_peer() {
    let mut p = Pair::connected();
    p.write(1, 0, fill(0x42, 512), false);
    p.run();
    p.n[0].fail_local = true;
    let now = p.now;
    let r = p.n[0].ep.submit_read(now, 0, 512);
    p.pump();
    p.run();
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0x42, 512)))))
    );
}

#[test]
fn writes_before_the_first_connection_wait_for_it() {
    let mut p = Pair::new();
    let r = p.write(0, 0, fill(0x31, 512), false);
    assert!(
        !p.n[0]
            .io
            .iter()
            .any(|io| matches!(io, LocalIo::Write { .. })),
        "an unproven replica is not written before the handshake"
    );
    assert_eq!(p.n[0].result_of(r), None, "waits for the peer");
    p.connect();
    p.run();
    assert_eq!(p.n[0].result_of(r), Some(&Ok(None)));
    assert_eq!(p.n[0].disk, p.n[1].disk);
    assert_eq!(p.n[0].disk[0], 0x31);
}

#[test]
fn a_peer_that_never_comes_fails_held_writes_after_the_connect_timeout() {
    let mut p = Pair::new();
    let r = p.write(0, 0, fill(0x31, 512), false);
    let t = p.n[0].ep.poll_timeout().expect("connect timer");
    p.n[0].ep.handle_timeout(t);
    p.pump();
    assert_eq!(p.n[0].result_of(r), Some(&Err(ErrorKind::Io)));
    assert_eq!(p.n[0].ep.state(), LinkState::Waiting);
    assert_eq!(p.n[0].disk[0], 0, "nothing reached the replica");
}

#[test]
fn a_peer_that_never_comes_lets_writes_complete_after_the_connect_timeout_when_serving_alone_is_opted_in()
 {
    let now = Instant::now();
    let mut cfg = Config::new(1, 2, DiskId([7; 16]), "vol0", SIZE, BS);
    cfg.startup = StartupPolicy::ServeAloneAfterTimeout;
    let mut p = Pair::new();
    p.n[0] = Node::with(cfg, 64 * 1024, 77, now);
    p.now = now;
    let r = p.write(0, 0, fill(0x31, 512), false);
    let t = p.n[0].ep.poll_timeout().expect("connect timer");
    p.n[0].ep.handle_timeout(t);
    p.pump();
    p.complete_io(0, 0);
    assert_eq!(p.n[0].result_of(r), Some(&Ok(None)));
    assert_eq!(p.n[0].ep.state(), LinkState::Degraded);
    assert_eq!(
        p.n[0].ep.freshness(),
        Freshness::Current(Proof::StartupTimeout)
    );
}

#[test]
fn messages_before_the_handshake_are_a_protocol_violation() {
    let mut p = Pair::new();
    let now = p.now;
    p.n[0].ep.handle_connected(now);
    p.n[0].ep.handle_message(
        now,
        Message::WriteAck {
            id: 99,
            status: Status::Ok,
        },
    );
    p.pump();
    assert!(
        p.n[0].events.iter().any(
            |e| matches!(e, Event::Refused { reason } if reason.contains("protocol violation"))
        )
    );
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

/// One node writes alone while the other is away; then they reconnect and, while the resync
/// runs, both nodes write (overlapping the dirty chunks too), with message delivery and
/// local I/O completion in a random order per seed. The resync must finish and leave
/// both replicas identical, on one generation, with nothing marked.
#[test]
fn resync_with_writes_on_both_nodes_ends_identical() {
    const DISK: u64 = 256 * 1024;
    const CHUNK: u64 = 4096;
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let now = Instant::now();
        let mk = |id: u32, peer: u32| {
            let mut cfg = Config::new(id, peer, DiskId([7; 16]), "vol0", DISK, BS);
            cfg.seed = u64::from(id);
            Node::with(cfg, CHUNK, 77, now)
        };
        let mut p = Pair {
            now,
            n: [mk(1, 2), mk(2, 1)],
        };
        p.connect();
        p.run();
        for i in 0..2 {
            p.n[i].ep.handle_disconnected(now, "cut");
            p.n[i].inbox.clear();
        }
        p.pump();
        let blocks = DISK / u64::from(BS);
        // The resolver or the other node goes on alone (and becomes the sync source).
        let alone = (seed % 2) as usize;
        for k in 0..(4 + rng.below(12)) {
            let b = rng.below(blocks);
            let len = (1 + rng.below(24)).min(blocks - b) * u64::from(BS);
            p.write(
                alone,
                b * u64::from(BS),
                fill(0x40 + k as u8, len as usize),
                false,
            );
        }
        p.run();
        assert!(p.n[alone].ep.is_diverged(), "seed {seed}: nothing marked");
        p.now += Duration::from_millis(10);
        p.connect();
        let mut writes = 6 + rng.below(10);
        let mut byte = 0x80u8;
        for _ in 0..5000 {
            if writes > 0 && rng.below(6) == 0 {
                writes -= 1;
                byte = byte.wrapping_add(1);
                let node = rng.below(2) as usize;
                let b = rng.below(blocks);
                let len = (1 + rng.below(40)).min(blocks - b) * u64::from(BS);
                p.write(
                    node,
                    b * u64::from(BS),
                    fill(byte, len as usize),
                    rng.below(4) == 0,
                );
            }
            if rng.below(10) == 0 {
                p.now += Duration::from_millis(3);
            }
            let steps = p.steps();
            if steps.is_empty() {
                if writes == 0 {
                    break;
                }
                continue;
            }
            let s = steps[rng.below(steps.len() as u64) as usize];
            p.step(s);
        }
        p.run();
        for _ in 0..4 {
            p.now += Duration::from_millis(1500);
            for i in 0..2 {
                p.n[i].ep.handle_timeout(p.now);
            }
            p.pump();
            p.run();
        }
        for (i, n) in p.n.iter().enumerate() {
            assert_eq!(
                n.ep.state(),
                LinkState::Connected,
                "seed {seed} node {}",
                i + 1
            );
            assert!(
                !n.ep.is_diverged(),
                "seed {seed} node {}: chunks still marked",
                i + 1
            );
            assert!(!n.ep.is_inconsistent(), "seed {seed} node {}", i + 1);
        }
        assert_eq!(
            p.n[0].ep.generations(),
            p.n[1].ep.generations(),
            "seed {seed}"
        );
        let synced = p.n[alone].events.iter().any(|e| {
            matches!(e, Event::SyncEnded(s) if s.completed && s.role == SyncRole::Source && s.transferred_bytes > 0)
        });
        assert!(
            synced,
            "seed {seed}: no resync from the node that went on alone"
        );
        if p.n[0].disk != p.n[1].disk {
            let at = p.n[0]
                .disk
                .iter()
                .zip(&p.n[1].disk)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            panic!(
                "seed {seed}: replicas differ first at byte {at} (node 1 {:#x}, node 2 {:#x})",
                p.n[0].disk[at], p.n[1].disk[at]
            );
        }
        // Every acknowledged write is in place unless a later write covered it; at the
        // least, nothing failed.
        for n in &p.n {
            assert!(
                n.completed.iter().all(|(_, r)| r.is_ok()),
                "seed {seed}: a request failed"
            );
        }
    }
}

// ----- regressions from review (each reproduced a bug before its fix) -----

fn local_op(io: &LocalIo) -> LocalOpId {
    match io {
        LocalIo::Write { op, .. }
        | LocalIo::Flush { op }
        | LocalIo::Read { op, .. }
        | LocalIo::Meta { op, .. } => *op,
    }
}

impl Pair {
    /// Like `run`, but never completes local op `hold` on node `node`.
    fn run_except(&mut self, node: usize, hold: LocalOpId) {
        self.run_where(|i, io| !(i == node && local_op(io) == hold));
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

#[test]
fn a_detached_node_without_its_peer_fails_writes_and_flushes() {
    let mut p = Pair::connected();
    p.n[0].fail_local = true;
    let w = p.write(0, 0, fill(0x77, 512), false);
    p.run();
    assert!(p.n[0].ep.is_detached());
    assert_eq!(p.n[0].result_of(w), Some(&Ok(None)), "the peer holds it");
    p.cut();
    let w2 = p.write(0, 1024, fill(0x99, 512), false);
    let f = p.n[0].ep.submit_flush(p.now);
    p.pump();
    p.run();
    assert_eq!(
        p.n[0].result_of(w2),
        Some(&Err(ErrorKind::Io)),
        "no replica holds it"
    );
    assert_eq!(p.n[0].result_of(f), Some(&Err(ErrorKind::Io)));
}

/// A flush that completes without the peer makes this replica the only one known to
/// hold those writes durably: its generation moves on, durably, before the flush is
/// acknowledged, so after a power cut of both nodes the resync takes this copy rather
/// than the peer's (found by the simulation; `fixed-flush-alone-keeps-generation.patch`).
#[test]
fn a_flush_completed_without_the_peer_moves_the_generation_first() {
    let mut p = Pair::connected();
    let w = p.write(1, 0, fill(0x42, 512), false);
    p.run();
    assert_eq!(p.n[1].result_of(w), Some(&Ok(None)));
    let before = p.n[1].ep.generations();
    p.cut();
    p.n[1].hold_meta = true;
    let f = p.n[1].ep.submit_flush(p.now);
    p.pump();
    p.run_where(|i, io| !(i == 1 && matches!(io, LocalIo::Meta { .. })));
    assert_eq!(
        p.n[1].result_of(f),
        None,
        "acknowledged before its new generation was durable"
    );
    let after = p.n[1].ep.generations();
    assert_ne!(after.current, before.current, "no new generation");
    assert_eq!(after.bitmap, before.current);
    p.run();
    assert_eq!(p.n[1].result_of(f), Some(&Ok(None)));
}

#[test]
fn shutdown_completes_when_the_last_completion_is_an_ack_or_a_flush() {
    let mut p = Pair::connected();
    let w = p.write(0, 0, fill(1, 512), false);
    p.complete_io(0, 0);
    let now = p.now;
    p.n[0].ep.begin_shutdown(now);
    p.pump();
    p.run();
    assert_eq!(p.n[0].result_of(w), Some(&Ok(None)));
    assert!(p.n[0].ep.is_shut_down());
    let mut p = Pair::connected();
    let f = p.n[0].ep.submit_flush(now);
    p.pump();
    p.n[0].ep.begin_shutdown(now);
    p.pump();
    p.run();
    assert!(p.n[0].result_of(f).is_some());
    assert!(p.n[0].ep.is_shut_down());
}

#[test]
fn a_discard_larger_than_the_activity_log_runs_with_its_chunks_marked() {
    let now = Instant::now();
    let size: u64 = 8 << 30;
    let cfg = Config::new(1, 2, DiskId([7; 16]), "vol0", size, BS);
    let meta = synced_meta(&cfg, 64 * 1024, 77);
    let mut ep = Endpoint::new(cfg, meta, now);
    ep.declare_current(now).unwrap();
    let r = ep.submit_write(now, 0, WritePayload::Discard { len: size }, false);
    let mut writes = 0;
    for _ in 0..10 {
        while let Some(io) = ep.poll_local_io() {
            match io {
                LocalIo::Meta { op, .. } => ep.handle_local_done(now, op, Ok(None)),
                LocalIo::Write { .. } => writes += 1,
                _ => {}
            }
        }
    }
    assert_eq!(writes, 1, "request {r:?} never started");
    assert_eq!(ep.dirty_chunks(), size / (64 * 1024));
}

#[test]
fn resync_io_of_an_earlier_link_is_not_sent_on_a_later_one() {
    // Node 1 (A) runs a verify, finds a mismatch, and its repair read is slow.
    let mut p = Pair::connected();
    p.n[0].disk[0] = 0xee;
    let now = p.now;
    p.n[0].ep.start_verify(now).unwrap();
    p.pump();
    let mut hold = None;
    for _ in 0..100 {
        if p.n[0]
            .inbox
            .iter()
            .any(|m| matches!(m, Message::SyncCrcReply { equal: false, .. }))
        {
            p.deliver(0);
            let io = p.n[0]
                .io
                .iter()
                .find(|io| matches!(io, LocalIo::Read { .. }))
                .expect("repair read");
            hold = Some(local_op(io));
            break;
        }
        if !p.deliver(0) && !p.deliver(1) {
            if !p.n[0].io.is_empty() {
                p.complete_io(0, 0);
            } else if !p.n[1].io.is_empty() {
                p.complete_io(1, 0);
            }
        }
    }
    let hold = hold.expect("repair read pending");
    p.cut();
    // B writes alone and is acknowledged; then they reconnect with B the source.
    let w = p.write(1, 0, fill(0x5b, 4096), false);
    p.run_except(0, hold);
    assert_eq!(p.n[1].result_of(w), Some(&Ok(None)));
    p.connect();
    p.run_except(0, hold);
    let k = p.n[0]
        .io
        .iter()
        .position(|io| local_op(io) == hold)
        .unwrap();
    p.complete_io(0, k);
    p.run();
    assert_eq!(&p.n[1].disk[..4096], &fill(0x5b, 4096)[..], "B lost W");
    assert_eq!(&p.n[0].disk[..4096], &fill(0x5b, 4096)[..], "A lacks W");
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

#[test]
fn a_write_resent_after_a_flap_does_not_block_later_writes() {
    let mut p = quorum_pair(QuorumPolicy::Suspend);
    let w = p.write(1, 0, fill(0x21, 512), false);
    p.complete_io(1, 0);
    p.deliver(0);
    let hold = local_op(
        p.n[0]
            .io
            .iter()
            .find(|io| matches!(io, LocalIo::Write { .. }))
            .unwrap(),
    );
    p.cut();
    p.connect();
    p.run_except(0, hold);
    let k = p.n[0]
        .io
        .iter()
        .position(|io| local_op(io) == hold)
        .unwrap();
    p.complete_io(0, k);
    p.run();
    assert_eq!(p.n[1].result_of(w), Some(&Ok(None)));
    let a = p.write(0, 0, fill(0x31, 512), false);
    p.run();
    assert_eq!(p.n[0].result_of(a), Some(&Ok(None)), "A's write hangs");
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

#[test]
fn a_quorum_answer_during_a_handshake_waits_for_it() {
    for granted in [false, true] {
        let mut p = quorum_pair(QuorumPolicy::IoError);
        p.cut();
        // A asks the witness; meanwhile a write is held (applied locally).
        let w = p.write(0, 0, fill(0x44, 512), false);
        p.complete_io(0, 0);
        assert_eq!(p.n[0].result_of(w), None);
        let now = p.now;
        for n in &mut p.n {
            n.ep.handle_connected(now);
        }
        p.pump();
        p.deliver(0);
        p.deliver(1);
        p.n[0].ep.handle_quorum(now, granted);
        p.pump();
        p.run();
        assert_eq!(p.n[0].ep.state(), LinkState::Connected, "granted {granted}");
        assert_eq!(p.n[1].ep.state(), LinkState::Connected, "granted {granted}");
        assert_eq!(p.n[0].result_of(w), Some(&Ok(None)), "granted {granted}");
        assert_eq!(p.n[0].disk, p.n[1].disk, "granted {granted}");
    }
}

#[test]
fn reads_of_chunks_not_yet_synced_go_to_the_source() {
    const DISK: u64 = 64 * 1024;
    const CHUNK: u64 = 4096;
    let now = Instant::now();
    let mk = |id: u32, peer: u32| {
        let cfg = Config::new(id, peer, DiskId([7; 16]), "vol0", DISK, BS);
        Node::with(cfg, CHUNK, 77, now)
    };
    let mut p = Pair {
        now,
        n: [mk(1, 2), mk(2, 1)],
    };
    p.connect();
    p.run();
    p.cut();
    // Node 1 writes chunk 3 alone.
    let w = p.write(0, 3 * CHUNK, fill(0x3c, CHUNK as usize), false);
    p.run();
    assert_eq!(p.n[0].result_of(w), Some(&Ok(None)));
    // Reconnect, and stop as soon as node 2 knows it is the target of chunk 3 (both
    // bitmaps exchanged) but before the chunk's data arrives.
    p.connect();
    for _ in 0..50 {
        if p.n[1].ep.is_inconsistent() && p.n[1].ep.dirty_chunks() > 0 {
            break;
        }
        let steps = p.steps();
        let Some(&s) = steps.iter().find(|s| {
            // Hold back node 1's resync read so the chunk cannot travel yet.
            !(s.0 == 0
                && s.1
                    .is_some_and(|k| matches!(p.n[0].io[k], LocalIo::Read { once: true, .. })))
        }) else {
            break;
        };
        p.step(s);
    }
    assert!(
        p.n[1].ep.is_inconsistent(),
        "node 2 is not the sync target yet"
    );
    assert_eq!(
        &p.n[1].disk[3 * CHUNK as usize..4 * CHUNK as usize],
        &fill(0, CHUNK as usize)[..]
    );
    let now = p.now;
    let r = p.n[1].ep.submit_read(now, 3 * CHUNK, 4096);
    p.pump();
    assert!(
        p.n[0]
            .inbox
            .iter()
            .any(|m| matches!(m, Message::Read { .. })),
        "the read of an unsynced chunk did not go to the source"
    );
    p.run();
    assert_eq!(
        p.n[1].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0x3c, 4096))))),
        "node 2 served stale data"
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

#[test]
fn without_quorum_reads_fail_or_wait_like_writes() {
    // io-error: a denied node fails reads with NoQuorum.
    let mut p = quorum_pair(QuorumPolicy::IoError);
    p.cut();
    let now = p.now;
    p.n[1].ep.handle_quorum(now, false);
    let r = p.n[1].ep.submit_read(now, 0, 512);
    p.pump();
    assert_eq!(p.n[1].result_of(r), Some(&Err(ErrorKind::NoQuorum)));
    // Granted: reads are served locally.
    p.n[1].ep.handle_quorum(now, true);
    let r = p.n[1].ep.submit_read(now, 0, 512);
    p.pump();
    p.run();
    assert!(matches!(p.n[1].result_of(r), Some(Ok(Some(_)))));

    // suspend: a read waits while quorum is unknown or denied, and completes once the
    // peer is back.
    let mut p = quorum_pair(QuorumPolicy::Suspend);
    p.cut();
    let now = p.now;
    p.n[1].ep.handle_quorum(now, false);
    let r = p.n[1].ep.submit_read(now, 0, 512);
    p.pump();
    p.run();
    assert_eq!(
        p.n[1].result_of(r),
        None,
        "a read was served without quorum"
    );
    p.connect();
    p.run();
    assert!(matches!(p.n[1].result_of(r), Some(Ok(Some(_)))));
}

#[test]
fn a_shutting_down_node_drops_the_link_and_takes_no_more_writes() {
    let mut p = Pair::connected();
    let now = p.now;
    p.n[0].ep.begin_shutdown(now);
    p.pump();
    assert_eq!(p.n[0].ep.state(), LinkState::Degraded);
    assert!(
        p.n[0]
            .events
            .iter()
            .any(|e| matches!(e, Event::PeerLost { .. })),
        "the link is not dropped"
    );
    p.run();
    assert!(p.n[0].ep.is_shut_down());
    // Its own new writes fail; a write the peer sent on the old link is not applied.
    let w = p.write(0, 0, fill(1, 512), false);
    assert_eq!(p.n[0].result_of(w), Some(&Err(ErrorKind::Closed)));
    let _ = p.n[1].ep.submit_write(
        now,
        8192,
        WritePayload::Data(Bytes::from(fill(7, 4096))),
        false,
    );
    p.pump();
    p.run();
    assert!(
        p.n[0].disk[8192..8192 + 4096].iter().all(|&b| b == 0),
        "a write reached a replica whose metadata says clean"
    );
    // A new link is refused.
    p.n[0].ep.handle_connected(now);
    p.pump();
    assert!(
        p.n[0]
            .events
            .iter()
            .any(|e| matches!(e, Event::Refused { reason } if reason.contains("shutting down")))
    );
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

/// Node 1's replica loses writes to chunks 2, 5 and 12 that both nodes acknowledged,
/// with a read of chunk 5 in flight on it. It becomes the target of a checksum resync
/// from node 2 on the same link: the read in flight and reads of lost chunks are served
/// by node 2 with the acknowledged data, only the three chunks travel, and the replicas
/// end identical with node 1 consistent again. Nothing is detached, no request fails.
#[test]
fn a_replica_that_lost_writes_is_resynced_by_checksum_from_the_peer() {
    let mut p = loss_pair();
    let before = p.n[0].disk.clone();
    for (node, chunk) in [(0, 2), (1, 5), (0, 12)] {
        p.write(
            node,
            chunk * LOSS_CHUNK,
            fill(0xc0 + chunk as u8, 4096),
            false,
        );
    }
    p.run();
    let acknowledged = p.n[1].disk.clone();
    let in_flight = p.read(0, 5 * LOSS_CHUNK, 4096);
    assert_eq!(p.n[0].io.len(), 1, "the read runs on node 1's replica");
    for chunk in [2, 5, 12] {
        p.lose_chunk(0, chunk, &before);
    }
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    assert!(p.n[0].ep.is_inconsistent());
    assert!(!p.n[0].ep.is_detached());
    assert!(
        p.n[0]
            .events
            .iter()
            .any(|e| matches!(e, Event::LocalDataLost { action } if action.contains("checksum")))
    );
    assert!(
        matches!(
            p.n[1].inbox.iter().collect::<Vec<_>>()[..],
            [Message::SyncRequest, Message::SyncBitmap { .. }]
        ),
        "{:?}",
        p.n[1].inbox
    );
    // A read issued now goes to node 2 at once.
    let r2 = p.read(0, 2 * LOSS_CHUNK, 4096);
    assert!(
        p.n[1]
            .inbox
            .iter()
            .any(|m| matches!(m, Message::Read { offset, .. } if *offset == 2 * LOSS_CHUNK)),
        "the read of a lost chunk did not go to the peer"
    );
    // The read that was in flight completes on the local replica with the old data;
    // the caller must get the acknowledged data all the same.
    p.complete_io(0, 0);
    p.settle();
    for (r, chunk) in [(in_flight, 5), (r2, 2)] {
        assert_eq!(
            p.n[0].result_of(r),
            Some(&Ok(Some(chunk_bytes(&acknowledged, chunk)))),
            "a read of lost chunk {chunk} returned stale data"
        );
    }
    assert_eq!(p.n[0].disk, acknowledged, "node 1 not repaired");
    assert_eq!(p.n[1].disk, acknowledged);
    let ends = p.sync_ends(0);
    assert_eq!(ends.len(), 1, "{ends:?}");
    let s = ends[0];
    assert!(s.completed && s.role == SyncRole::Target && s.kind == SyncKind::Checksum);
    assert_eq!(
        s.transferred_bytes,
        3 * LOSS_CHUNK,
        "only the lost chunks travel"
    );
    let source = p.sync_ends(1);
    assert!(
        matches!(source[..], [s] if s.completed && s.role == SyncRole::Source && s.mismatches == 3),
        "{source:?}"
    );
    for n in &p.n {
        assert!(!n.ep.is_inconsistent() && !n.ep.is_diverged() && !n.ep.is_detached());
        assert_eq!(n.ep.state(), LinkState::Connected);
        assert!(n.completed.iter().all(|(_, r)| r.is_ok()));
    }
    assert_eq!(p.n[0].ep.generations(), p.n[1].ep.generations());
}

/// Like the above with writes from both nodes in flight around the loss and during the
/// resync, and message delivery and I/O completion in a random order per seed. Reads on
/// node 1 of the half of the disk nobody writes any more (holding lost chunks) always
/// return the acknowledged data, no request fails, and the replicas end identical.
#[test]
fn lost_data_resync_with_writes_and_reads_on_both_nodes_ends_identical() {
    let blocks = LOSS_DISK / u64::from(BS);
    let half = blocks / 2;
    for seed in 1..=200u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut p = loss_pair();
        let before = p.n[0].disk.clone();
        // Acknowledged writes the loss will take back (and some it will not).
        for k in 0..8u64 {
            let b = rng.below(blocks);
            let len = (1 + rng.below(16)).min(blocks - b) * u64::from(BS);
            p.write(
                rng.below(2) as usize,
                b * u64::from(BS),
                fill(0x10 + k as u8, len as usize),
                false,
            );
        }
        p.run();
        let model = p.n[1].disk[..(half * u64::from(BS)) as usize].to_vec();
        let mut reads: Vec<(RequestId, u64, u32)> = Vec::new();
        let mut byte = 0x80u8;
        let mut lost = false;
        let lose_at = rng.below(40);
        let mut writes = 10 + rng.below(10);
        for step in 0..5000u64 {
            if step == lose_at {
                for c in 0..LOSS_DISK / LOSS_CHUNK {
                    if rng.below(2) == 0 {
                        p.lose_chunk(0, c, &before);
                    }
                }
                let now = p.now;
                p.n[0].ep.local_data_lost(now);
                p.pump();
                lost = true;
            }
            // Writes in the upper half, from both nodes, around the loss.
            if writes > 0 && rng.below(5) == 0 {
                writes -= 1;
                byte = byte.wrapping_add(1);
                let b = half + rng.below(half);
                let len = (1 + rng.below(12)).min(blocks - b) * u64::from(BS);
                p.write(
                    rng.below(2) as usize,
                    b * u64::from(BS),
                    fill(byte, len as usize),
                    rng.below(4) == 0,
                );
            }
            // Reads of the lower half on the node that loses data.
            if rng.below(4) == 0 {
                let b = rng.below(half);
                let len = ((1 + rng.below(16)).min(half - b) * u64::from(BS)) as u32;
                let r = p.read(0, b * u64::from(BS), len);
                reads.push((r, b * u64::from(BS), len));
            }
            if rng.below(10) == 0 {
                p.now += Duration::from_millis(3);
            }
            let steps = p.steps();
            if steps.is_empty() {
                if lost && writes == 0 {
                    break;
                }
                continue;
            }
            let s = steps[rng.below(steps.len() as u64) as usize];
            p.step(s);
        }
        p.settle();
        for (r, offset, len) in &reads {
            let want = &model[*offset as usize..(*offset + u64::from(*len)) as usize];
            match p.n[0].result_of(*r) {
                Some(Ok(Some(got))) if got[..] == *want => {}
                other => panic!(
                    "seed {seed}: read {len}@{offset} on node 1 returned {:?}",
                    other.map(|r| r.as_ref().map(|d| d.as_ref().map(|d| d[0])))
                ),
            }
        }
        for (i, n) in p.n.iter().enumerate() {
            let who = format!("seed {seed} node {}", i + 1);
            assert_eq!(n.ep.state(), LinkState::Connected, "{who}");
            assert!(!n.ep.is_inconsistent() && !n.ep.is_diverged(), "{who}");
            assert!(!n.ep.is_detached(), "{who}");
            assert!(
                n.completed.iter().all(|(_, r)| r.is_ok()),
                "{who}: a request failed"
            );
        }
        assert!(
            p.sync_ends(0)
                .iter()
                .any(|s| s.completed && s.role == SyncRole::Target && s.kind == SyncKind::Checksum),
            "seed {seed}: no checksum resync to node 1"
        );
        assert_eq!(p.n[0].ep.generations(), p.n[1].ep.generations());
        if let Some(at) = p.n[0]
            .disk
            .iter()
            .zip(&p.n[1].disk)
            .position(|(a, b)| a != b)
        {
            panic!("seed {seed}: replicas differ first at byte {at}");
        }
    }
}

/// Without its peer, a node whose replica lost data fails I/O (nothing it holds can be
/// trusted, and there is no other copy) instead of serving stale data; it is marked
/// inconsistent, and the next connection resyncs it by checksum from the peer, which
/// went on writing meanwhile.
#[test]
fn data_lost_while_disconnected_fails_io_until_the_peer_is_back_then_resyncs() {
    let mut p = loss_pair();
    let before = p.n[0].disk.clone();
    p.write(0, 3 * LOSS_CHUNK, fill(0x33, 4096), false);
    p.run();
    p.cut();
    let w = p.write(1, 7 * LOSS_CHUNK, fill(0x77, 4096), false);
    p.run();
    assert_eq!(p.n[1].result_of(w), Some(&Ok(None)), "node 2 goes on alone");
    p.lose_chunk(0, 3, &before);
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    assert!(p.n[0].ep.is_inconsistent());
    assert!(
        !p.n[0].ep.is_detached(),
        "detached: the next connection could not resync it"
    );
    assert_eq!(p.n[0].ep.dirty_chunks(), LOSS_DISK / LOSS_CHUNK);
    assert!(
        p.n[0].events.iter().any(
            |e| matches!(e, Event::LocalDataLost { action } if action.contains("not connected"))
        )
    );
    let r = p.read(0, 3 * LOSS_CHUNK, 4096);
    let w = p.write(0, 9 * LOSS_CHUNK, fill(0x99, 512), false);
    p.run();
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Err(ErrorKind::Io)),
        "stale data served"
    );
    assert_eq!(p.n[0].result_of(w), Some(&Err(ErrorKind::Io)));

    let expect = p.n[1].disk.clone();
    p.now += Duration::from_millis(10);
    p.connect();
    let r = p.read(0, 3 * LOSS_CHUNK, 4096);
    p.settle();
    assert!(p.n[0].events.iter().any(|e| matches!(
        e,
        Event::SyncStarted {
            role: SyncRole::Target,
            kind: SyncKind::Checksum,
            ..
        }
    )));
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(chunk_bytes(&expect, 3)))),
        "once connected, the read is served"
    );
    assert_eq!(p.n[0].disk, expect);
    assert_eq!(p.n[1].disk, expect);
    let s = *p.sync_ends(0).last().expect("a resync ran");
    assert!(s.completed && s.kind == SyncKind::Checksum);
    assert_eq!(
        s.transferred_bytes,
        2 * LOSS_CHUNK,
        "the lost chunk and node 2's write"
    );
    for n in &p.n {
        assert!(!n.ep.is_inconsistent() && !n.ep.is_diverged());
    }
    assert_eq!(p.n[0].ep.generations(), p.n[1].ep.generations());
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

/// The sync target loses data while its resync runs: it cannot start over on this
/// link, so it detaches and is served by the source; the source's run ends (it does not
/// retry forever) and nobody sees an error or stale data.
#[test]
fn data_lost_on_a_sync_target_detaches_it_and_io_goes_through_the_source() {
    let mut p = resync_under_way();
    let now = p.now;
    p.n[1].ep.local_data_lost(now);
    p.pump();
    assert!(p.n[1].ep.is_detached());
    assert!(p.n[1].ep.is_inconsistent());
    p.settle();
    let expect = p.n[0].disk.clone();
    let r = p.read(1, 0, LOSS_DISK as u32);
    let w = p.write(1, 4 * LOSS_CHUNK, fill(0x44, 4096), false);
    p.settle();
    let mut expect_after = expect.clone();
    expect_after[(4 * LOSS_CHUNK) as usize..(5 * LOSS_CHUNK) as usize].fill(0x44);
    assert_eq!(
        p.n[1].result_of(r),
        Some(&Ok(Some(Bytes::from(expect)))),
        "node 2 served what it holds"
    );
    assert_eq!(p.n[1].result_of(w), Some(&Ok(None)));
    assert_eq!(p.n[0].disk, expect_after);
    let ends = p.sync_ends(0);
    assert!(
        ends.iter().all(|s| !s.completed),
        "node 1 finished a resync into a detached replica: {ends:?}"
    );
    assert!(!ends.is_empty(), "node 1's resync never ended");
    assert!(p.n[0].ep.poll_timeout().is_some());
    assert!(
        p.n[1].ep.is_inconsistent(),
        "a detached replica became consistent"
    );
    for n in &p.n {
        assert_eq!(n.ep.state(), LinkState::Connected);
        assert!(n.completed.iter().all(|(_, r)| r.is_ok()));
    }
}

/// The sync source loses data while its resync runs: no node holds all the data any
/// more. Reads of chunks the target has not received fail on both nodes rather than
/// return the stale copy; everything else is served.
#[test]
fn data_lost_on_a_sync_source_fails_reads_of_unsynced_chunks_instead_of_serving_stale_data() {
    let mut p = resync_under_way();
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    assert!(p.n[0].ep.is_detached());
    p.settle();
    let unsynced = (0..8)
        .find(|&c| p.n[1].disk[(c * LOSS_CHUNK) as usize] != 0xa0 + c as u8)
        .expect("a chunk not synced yet");
    for node in 0..2 {
        let r = p.read(node, unsynced * LOSS_CHUNK, 512);
        let other = p.read(node, 12 * LOSS_CHUNK, 512);
        p.settle();
        assert_eq!(
            p.n[node].result_of(r),
            Some(&Err(ErrorKind::Io)),
            "node {}: an unsynced chunk was served",
            node + 1
        );
        assert_eq!(
            p.n[node].result_of(other),
            Some(&Ok(Some(Bytes::copy_from_slice(
                &p.n[1].disk[(12 * LOSS_CHUNK) as usize..(12 * LOSS_CHUNK + 512) as usize]
            ))))
        );
    }
}

/// A node whose peer cannot be the source (its replica is detached) asks anyway: the
/// peer refuses the link with a reason, and the node fails I/O rather than serve what
/// it holds.
#[test]
fn a_peer_that_cannot_be_the_source_refuses_the_resync_request() {
    let mut p = loss_pair();
    p.n[1].fail_local = true;
    p.write(1, 0, fill(1, 512), false);
    p.run();
    assert!(p.n[1].ep.is_detached());
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    p.run();
    for (i, n) in p.n.iter().enumerate() {
        assert_eq!(n.ep.state(), LinkState::Degraded, "node {}", i + 1);
        assert!(
            n.events.iter().any(|e| matches!(
                e,
                Event::PeerLost { reason } if reason.contains("cannot be the source")
            )),
            "node {}: {:?}",
            i + 1,
            n.events
        );
    }
    let r = p.read(0, 0, 512);
    p.run();
    assert_eq!(p.n[0].result_of(r), Some(&Err(ErrorKind::Io)));
}

/// The peer runs an online verify when the request comes: it aborts the verify and
/// becomes the checksum source; replies of the verify still on the wire do not count
/// for the resync, and the replicas end identical.
#[test]
fn a_verify_running_on_the_peer_gives_way_to_the_requested_resync() {
    for cut_after in 0..40 {
        let mut p = loss_pair();
        let before = p.n[0].disk.clone();
        p.write(1, 6 * LOSS_CHUNK, fill(0x66, 4096), false);
        p.write(1, 11 * LOSS_CHUNK, fill(0x67, 4096), false);
        p.run();
        let expect = p.n[1].disk.clone();
        // Node 2's replica differs in chunk 9: the verify repairs it from node 2.
        p.n[0].disk[(9 * LOSS_CHUNK) as usize] ^= 0xff;
        let now = p.now;
        p.n[1].ep.start_verify(now).unwrap();
        p.pump();
        for _ in 0..cut_after {
            let steps = p.steps();
            let Some(&s) = steps.first() else { break };
            p.step(s);
        }
        p.lose_chunk(0, 6, &before);
        p.lose_chunk(0, 11, &before);
        let now = p.now;
        p.n[0].ep.local_data_lost(now);
        p.pump();
        p.settle();
        assert_eq!(p.n[0].disk, expect, "cut after {cut_after} steps");
        assert_eq!(p.n[1].disk, expect, "cut after {cut_after} steps");
        let ends = p.sync_ends(1);
        let last = ends.last().expect("a run ended");
        assert!(
            last.completed && last.kind == SyncKind::Checksum && last.role == SyncRole::Source,
            "cut after {cut_after} steps: {ends:?}"
        );
        for n in &p.n {
            assert!(!n.ep.is_inconsistent() && !n.ep.is_diverged() && !n.ep.is_detached());
            assert_eq!(n.ep.state(), LinkState::Connected);
        }
    }
}

/// An own read that completes fine after the loss but of a chunk the resync has already
/// repaired by then is still not trusted: it was issued before the loss.
#[test]
fn a_read_issued_before_the_loss_is_not_trusted_even_after_its_chunk_is_synced() {
    let mut p = loss_pair();
    let before = p.n[0].disk.clone();
    p.write(1, 2 * LOSS_CHUNK, fill(0x22, 4096), false);
    p.run();
    let expect = p.n[1].disk.clone();
    let r = p.read(0, 2 * LOSS_CHUNK, 4096);
    let hold = local_op(&p.n[0].io[0]);
    p.lose_chunk(0, 2, &before);
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    // The read's data is taken now (stale), but it completes only after the resync.
    let stale = chunk_bytes(&p.n[0].disk, 2);
    p.run_except(0, hold);
    assert_eq!(
        chunk_bytes(&p.n[0].disk, 2),
        chunk_bytes(&expect, 2),
        "chunk 2 repaired"
    );
    assert!(!p.n[0].ep.is_inconsistent(), "the resync is done");
    let k = p.n[0]
        .io
        .iter()
        .position(|io| local_op(io) == hold)
        .unwrap();
    let LocalIo::Read { op, .. } = p.n[0].io.remove(k) else {
        panic!("not the read");
    };
    let now = p.now;
    p.n[0].ep.handle_local_done(now, op, Ok(Some(stale)));
    p.pump();
    p.run();
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(chunk_bytes(&expect, 2))))
    );
}

impl Pair {
    /// Take node `node`'s pending local I/O that `pick` selects out of the harness.
    fn take_io(&mut self, node: usize, pick: impl Fn(&LocalIo) -> bool) -> Option<LocalIo> {
        let k = self.n[node].io.iter().position(pick)?;
        Some(self.n[node].io.remove(k))
    }
}

/// Node 2 repairs node 1's chunk 9 by a verify; the repair write lands on node 1's
/// replica, which then loses it, and its completion comes after `local_data_lost`. The
/// chunk must stay marked: a read of it goes to node 2, not to the replica that lost it.
#[test]
fn resync_data_written_before_the_loss_does_not_count_as_synced() {
    let mut p = loss_pair();
    let nine = (9 * LOSS_CHUNK) as usize;
    p.n[0].disk[nine] ^= 0xff;
    let before = p.n[0].disk.clone();
    let now = p.now;
    p.n[1].ep.start_verify(now).unwrap();
    p.pump();
    let mut repair = None;
    for _ in 0..500 {
        repair = p.take_io(
            0,
            |io| matches!(io, LocalIo::Write { offset, .. } if *offset == nine as u64),
        );
        if repair.is_some() {
            break;
        }
        let steps = p.steps();
        let Some(&s) = steps.first() else { break };
        p.step(s);
    }
    let Some(LocalIo::Write { op, payload, .. }) = repair else {
        panic!("no repair write for chunk 9");
    };
    let WritePayload::Data(d) = payload else {
        panic!("repair without data");
    };
    // It lands, then the replica loses it.
    p.n[0].disk[nine..nine + d.len()].copy_from_slice(&d);
    p.lose_chunk(0, 9, &before);
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.n[0].ep.handle_local_done(now, op, Ok(None));
    p.pump();
    let r = p.read(0, 9 * LOSS_CHUNK, 512);
    p.settle();
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(Bytes::copy_from_slice(
            &p.n[1].disk[nine..nine + 512]
        )))),
        "the lost repair counted as synced"
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

/// Node 1 is a checksum target with every compare in flight when its replica loses
/// data again: it detaches, and those compares (read before the loss) must not tell the
/// source the chunks are equal. The source's run ends unfinished, never "in sync".
#[test]
fn compares_read_before_a_second_loss_never_report_equal() {
    let mut p = loss_pair();
    p.now += Duration::from_millis(50);
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    // Deliver and complete everything except node 1's compare reads.
    loop {
        let steps = p.steps();
        let Some(&s) = steps.iter().find(|s| {
            !(s.0 == 0
                && s.1
                    .is_some_and(|k| matches!(p.n[0].io[k], LocalIo::Read { once: true, .. })))
        }) else {
            break;
        };
        p.step(s);
    }
    let held = p.n[0]
        .io
        .iter()
        .filter(|io| matches!(io, LocalIo::Read { once: true, .. }))
        .count();
    assert!(held > 0, "no compare in flight");
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    assert!(p.n[0].ep.is_detached());
    p.settle();
    let ends = p.sync_ends(1);
    assert!(
        !ends.is_empty() && ends.iter().all(|s| !s.completed),
        "{ends:?}"
    );
    assert!(p.n[0].ep.is_inconsistent());
    assert_eq!(p.n[0].ep.state(), LinkState::Connected);
}

/// Node 2 finishes the resync and sends `SyncDone` just as node 1 loses data again and
/// detaches: node 1 ignores it (it stays inconsistent) instead of dropping the link,
/// and its I/O goes on through node 2.
#[test]
fn sync_done_reaching_a_node_that_detached_meanwhile_is_ignored() {
    let mut p = loss_pair();
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    for _ in 0..2000 {
        if matches!(p.n[0].inbox.front(), Some(Message::SyncDone { .. })) {
            break;
        }
        let steps = p.steps();
        let Some(&s) = steps.first() else {
            p.now += Duration::from_millis(1500);
            let now = p.now;
            p.n[1].ep.handle_timeout(now);
            p.pump();
            continue;
        };
        p.step(s);
    }
    assert!(
        matches!(p.n[0].inbox.front(), Some(Message::SyncDone { .. })),
        "node 2 never finished"
    );
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    p.settle();
    assert_eq!(p.n[0].ep.state(), LinkState::Connected);
    assert!(p.n[0].ep.is_detached() && p.n[0].ep.is_inconsistent());
    let r = p.read(0, 0, 4096);
    p.run();
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(chunk_bytes(&p.n[1].disk, 0))))
    );
}

/// Node 2's verify has compares in flight on node 1 when node 1 asks for a resync: their
/// replies come after node 2 started the checksum resync and asked about the same
/// chunks, and must not count for it (only the one lost chunk differs).
#[test]
fn replies_of_an_aborted_verify_do_not_count_for_the_resync() {
    let mut p = loss_pair();
    let before = p.n[0].disk.clone();
    p.write(1, 3 * LOSS_CHUNK, fill(0x33, 4096), false);
    p.run();
    p.now += Duration::from_millis(50);
    let now = p.now;
    p.n[1].ep.start_verify(now).unwrap();
    p.pump();
    // Node 2 reads and sends its crcs; node 1 starts its compares but none completes.
    while !p.n[1].io.is_empty() {
        p.complete_io(1, 0);
    }
    while p.deliver(0) {}
    let compares = p.n[0].io.len();
    assert!(compares > 1, "verify compares not in flight");
    p.lose_chunk(0, 3, &before);
    let now = p.now;
    p.n[0].ep.local_data_lost(now);
    p.pump();
    // Node 2 takes the request and asks for the resync's crcs.
    while p.deliver(1) {}
    while !p.n[1].io.is_empty() {
        p.complete_io(1, 0);
    }
    // The verify's compares finish now, after the request.
    for _ in 0..compares {
        p.complete_io(0, 0);
    }
    p.settle();
    assert_eq!(p.n[0].disk, p.n[1].disk);
    let ends = p.sync_ends(1);
    let last = ends.last().expect("runs ended");
    assert!(
        last.completed && last.kind == SyncKind::Checksum,
        "{ends:?}"
    );
    assert_eq!(last.mismatches, 1, "{ends:?}");
    assert_eq!(last.transferred_bytes, LOSS_CHUNK, "{ends:?}");
}
