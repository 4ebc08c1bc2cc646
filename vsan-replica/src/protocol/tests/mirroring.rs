//! The write path between two connected endpoints: mirrored writes, flush and FUA,
//! overlapping writes in every interleaving, the handshake's refusals, pings and timeouts,
//! and a resync with writes on both nodes.

use std::time::{Duration, Instant};

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::*;

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

/// A SCSI call goes out only on a connected link, reaches the peer as an event in link
/// order after the writes sent before it, and its answer completes it; a call still
/// waiting when the link is lost fails, and so does one made while the peer is away.
#[test]
fn scsi_calls_travel_in_link_order_and_fail_with_the_link() {
    let mut p = Pair::connected();
    let w = p.write(0, 0, fill(0x11, 512), false);
    let now = p.now;
    let call = p.n[0].ep.submit_scsi(now, Bytes::from_static(b"ping"));
    p.pump();
    let order: Vec<bool> = p.n[1]
        .inbox
        .iter()
        .filter_map(|m| match m {
            Message::Write { .. } => Some(false),
            Message::Scsi { .. } => Some(true),
            _ => None,
        })
        .collect();
    assert_eq!(order, [false, true], "the call overtook the write");
    p.run();
    assert_eq!(p.n[0].result_of(w), Some(&Ok(None)));
    let (epoch, id, body) = p.n[1]
        .events
        .iter()
        .find_map(|e| match e {
            Event::ScsiRequest { epoch, id, body } => Some((*epoch, *id, body.clone())),
            _ => None,
        })
        .expect("no call reached the peer");
    assert_eq!(&body[..], b"ping");
    assert_eq!(
        p.n[0].result_of(call),
        None,
        "answered before the peer replied"
    );
    p.n[1]
        .ep
        .reply_scsi(now, epoch, id, Ok(Bytes::from_static(b"pong")));
    p.pump();
    p.run();
    assert_eq!(
        p.n[0].result_of(call),
        Some(&Ok(Some(Bytes::from_static(b"pong"))))
    );

    let lost = p.n[0].ep.submit_scsi(now, Bytes::from_static(b"lost"));
    p.pump();
    p.cut();
    p.run();
    assert_eq!(p.n[0].result_of(lost), Some(&Err(ErrorKind::WrongState)));
    let alone = p.n[0].ep.submit_scsi(now, Bytes::new());
    p.pump();
    assert_eq!(p.n[0].result_of(alone), Some(&Err(ErrorKind::WrongState)));
}
