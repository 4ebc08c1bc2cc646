//! A restarted node proves its replica current before it serves a block (the
//! `freshness` module): the `Pair` harness restarts one node over the metadata it had,
//! while the other went on alone.

use std::time::Instant;

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::*;

fn cfg(id: u32, peer: u32) -> Config {
    Config::new(id, peer, DiskId([7; 16]), "vol0", SIZE, BS)
}

/// Node 1 went on alone from generation 77 (now 99) and wrote 0xaa over the first
/// chunk; node 2 restarts over its old metadata (in sync at 77) and old data (0x11).
fn peer_went_on_alone(cfg2: Config) -> Pair {
    let mut p = Pair::new();
    let now = p.now;
    let cfg1 = cfg(1, 2);
    let mut meta1 = synced_meta(&cfg1, 64 * 1024, 99);
    meta1.superblock.generations.bitmap = 77;
    meta1.superblock.generations.history = [0, 0];
    meta1.bitmap.set(0);
    p.n[0].ep = Endpoint::new(cfg1, meta1, now);
    p.n[0].disk[..4096].fill(0xaa);
    p.n[0].durable[..4096].fill(0xaa);
    p.n[1] = Node::with(cfg2, 64 * 1024, 77, now);
    p.n[1].disk[..4096].fill(0x11);
    p.n[1].durable[..4096].fill(0x11);
    p.pump();
    p
}

fn read(p: &mut Pair, node: usize, offset: u64, len: u32) -> RequestId {
    let now = p.now;
    let r = p.n[node].ep.submit_read(now, offset, len);
    p.pump();
    r
}

fn local_reads(n: &Node) -> usize {
    n.io.iter()
        .filter(|io| matches!(io, LocalIo::Read { .. }))
        .count()
}

fn local_writes(n: &Node) -> usize {
    n.io.iter()
        .filter(|io| matches!(io, LocalIo::Write { .. }))
        .count()
}

#[test]
fn a_node_whose_metadata_says_it_went_on_alone_serves_at_once() {
    let p = peer_went_on_alone(cfg(2, 1));
    assert_eq!(p.n[0].ep.freshness(), Freshness::Current(Proof::OnlyWriter));
    assert_eq!(p.n[0].ep.state(), LinkState::Degraded);
    let mut p = p;
    let r = read(&mut p, 0, 0, 512);
    assert_eq!(
        local_reads(&p.n[0]),
        1,
        "served from its own replica at once"
    );
    p.complete_io(0, 0);
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0xaa, 512)))))
    );
}

#[test]
fn a_restarted_node_reads_nothing_from_its_replica_before_the_handshake() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    assert!(matches!(
        p.n[1].ep.freshness(),
        Freshness::Unproven {
            awaiting: Awaiting::PeerOrOperator
        }
    ));
    let r = read(&mut p, 1, 0, 512);
    assert_eq!(
        local_reads(&p.n[1]),
        0,
        "never read from the unproven replica"
    );
    assert_eq!(p.n[1].result_of(r), None, "held");
    p.connect();
    p.run();
    assert_eq!(p.n[1].ep.freshness(), Freshness::Current(Proof::Handshake));
    assert_eq!(
        p.n[1].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0xaa, 512))))),
        "the peer's newest data, not the stale local copy"
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

#[test]
fn a_write_to_a_restarted_node_waits_for_the_handshake_and_the_resync_order() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    let w = p.write(1, 512, fill(0x55, 512), false);
    assert_eq!(local_writes(&p.n[1]), 0, "not applied before the handshake");
    p.connect();
    p.run();
    assert_eq!(p.n[1].result_of(w), Some(&Ok(None)));
    assert_eq!(p.n[0].disk, p.n[1].disk, "replicas identical");
    assert_eq!(&p.n[1].disk[..512], &fill(0xaa, 512)[..]);
    assert_eq!(&p.n[1].disk[512..1024], &fill(0x55, 512)[..]);
    assert_eq!(&p.n[1].disk[1024..4096], &fill(0xaa, 3072)[..]);
}

#[test]
fn held_requests_of_an_unproven_node_fail_after_the_connect_timeout_and_touch_nothing() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    let now = p.now;
    let w = p.write(1, 0, fill(0x55, 512), false);
    let r = read(&mut p, 1, 0, 512);
    let f = p.n[1].ep.submit_flush(now);
    p.pump();
    let before = p.n[1].ep.generations();
    let t = p.n[1].ep.poll_timeout().expect("startup timer");
    p.n[1].ep.handle_timeout(t);
    p.pump();
    // The local flush may still run: complete it.
    p.run_where(|i, _| i == 1);
    for req in [w, r, f] {
        assert_eq!(p.n[1].result_of(req), Some(&Err(ErrorKind::Io)), "{req:?}");
    }
    assert_eq!(&p.n[1].disk[..512], &fill(0x11, 512)[..], "nothing written");
    assert_eq!(
        p.n[1].ep.generations(),
        before,
        "the generation did not move"
    );
    assert!(!p.n[1].ep.freshness().is_current());
    assert_eq!(p.n[1].ep.state(), LinkState::Waiting);
    // The peer comes later: the node is proven and serves the newest data.
    p.connect();
    p.run();
    let r = read(&mut p, 1, 0, 512);
    p.run();
    assert_eq!(
        p.n[1].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0xaa, 512)))))
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

#[test]
fn serve_alone_after_timeout_takes_the_replica_as_current_once_the_timeout_passes() {
    let mut c = cfg(2, 1);
    c.startup = StartupPolicy::ServeAloneAfterTimeout;
    let mut p = peer_went_on_alone(c);
    let r = read(&mut p, 1, 0, 512);
    let t = p.n[1].ep.poll_timeout().expect("startup timer");
    assert_eq!(t, p.now + std::time::Duration::from_secs(5));
    p.n[1].ep.handle_timeout(t);
    p.pump();
    assert_eq!(
        p.n[1].ep.freshness(),
        Freshness::Current(Proof::StartupTimeout)
    );
    assert_eq!(p.n[1].ep.state(), LinkState::Degraded);
    p.run_where(|i, _| i == 1);
    assert_eq!(
        p.n[1].result_of(r),
        Some(&Ok(Some(Bytes::from(fill(0x11, 512))))),
        "the opt-in serves the local (here stale) copy: the documented risk"
    );
}

#[test]
fn an_operator_can_declare_an_unproven_replica_current() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    let now = p.now;
    let r = read(&mut p, 1, 0, 512);
    p.n[1].ep.declare_current(now).unwrap();
    p.pump();
    assert_eq!(p.n[1].ep.freshness(), Freshness::Current(Proof::Operator));
    assert_eq!(p.n[1].ep.state(), LinkState::Degraded);
    p.run_where(|i, _| i == 1);
    assert!(p.n[1].result_of(r).is_some_and(|x| x.is_ok()));
    assert!(p.n[1].ep.declare_current(now).is_err(), "once");
}

#[test]
fn an_unfinished_sync_target_cannot_be_declared_current() {
    let now = Instant::now();
    let c = cfg(2, 1);
    let mut meta = synced_meta(&c, 64 * 1024, 77);
    meta.superblock.inconsistent = true;
    let mut ep = Endpoint::new(c, meta, now);
    assert!(!ep.freshness().is_current());
    let err = ep.declare_current(now).unwrap_err();
    assert!(err.to_string().contains("unfinished sync target"), "{err}");
}

#[test]
fn shutting_down_an_unproven_node_fails_what_it_held_and_writes_nothing() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    let now = p.now;
    let w = p.write(1, 0, fill(0x55, 512), false);
    let r = read(&mut p, 1, 0, 512);
    p.n[1].ep.begin_shutdown(now);
    p.pump();
    p.run_where(|i, _| i == 1);
    assert_eq!(p.n[1].result_of(w), Some(&Err(ErrorKind::Closed)));
    assert_eq!(p.n[1].result_of(r), Some(&Err(ErrorKind::Closed)));
    assert_eq!(&p.n[1].disk[..512], &fill(0x11, 512)[..]);
    assert!(p.n[1].ep.is_shut_down());
}

fn with_witness(policy: QuorumPolicy) -> Pair {
    let mut c = cfg(2, 1);
    c.quorum = Some(policy);
    peer_went_on_alone(c)
}

#[test]
fn with_a_witness_an_unproven_node_asks_it_after_the_connect_timeout_and_a_denial_serves_nothing() {
    for policy in [QuorumPolicy::IoError, QuorumPolicy::Suspend] {
        let mut p = with_witness(policy);
        let now = p.now;
        let r = read(&mut p, 1, 0, 512);
        let t = p.n[1].ep.poll_timeout().expect("startup timer");
        p.n[1].ep.handle_timeout(t);
        p.pump();
        assert!(
            p.n[1].events.contains(&Event::NeedQuorum),
            "asks the witness"
        );
        assert_eq!(p.n[1].result_of(r), None, "held while the witness answers");
        p.n[1].ep.handle_quorum(now, false);
        p.pump();
        assert!(matches!(
            p.n[1].ep.freshness(),
            Freshness::Unproven {
                awaiting: Awaiting::Peer
            }
        ));
        let w = p.write(1, 0, fill(0x55, 512), false);
        assert_eq!(local_reads(&p.n[1]) + local_writes(&p.n[1]), 0);
        match policy {
            QuorumPolicy::IoError => {
                assert_eq!(p.n[1].result_of(r), Some(&Err(ErrorKind::NoQuorum)));
                assert_eq!(p.n[1].result_of(w), Some(&Err(ErrorKind::NoQuorum)));
            }
            QuorumPolicy::Suspend => {
                assert_eq!(p.n[1].result_of(r), None);
                assert_eq!(p.n[1].result_of(w), None);
                // The peer comes back: both complete, in order, on current data.
                p.connect();
                p.run();
                assert_eq!(
                    p.n[1].result_of(r),
                    Some(&Ok(Some(Bytes::from(fill(0xaa, 512)))))
                );
                assert_eq!(p.n[1].result_of(w), Some(&Ok(None)));
                assert_eq!(p.n[0].disk, p.n[1].disk);
            }
        }
    }
}

#[test]
fn with_a_witness_a_grant_proves_an_unproven_node_current() {
    let mut p = with_witness(QuorumPolicy::IoError);
    let now = p.now;
    let r = read(&mut p, 1, 0, 512);
    let t = p.n[1].ep.poll_timeout().expect("startup timer");
    p.n[1].ep.handle_timeout(t);
    p.pump();
    p.n[1].ep.handle_quorum(now, true);
    p.pump();
    assert_eq!(p.n[1].ep.freshness(), Freshness::Current(Proof::Witness));
    p.run_where(|i, _| i == 1);
    assert!(p.n[1].result_of(r).is_some_and(|x| x.is_ok()));
}

#[test]
fn both_nodes_restarted_in_sync_serve_after_the_handshake_without_a_resync() {
    let mut p = Pair::new();
    let r = read(&mut p, 0, 0, 512);
    assert_eq!(local_reads(&p.n[0]), 0);
    p.connect();
    p.run();
    assert!(p.n[0].result_of(r).is_some_and(|x| x.is_ok()));
    assert!(p.n[0].sync_starts().is_empty() && p.n[1].sync_starts().is_empty());
    for n in &p.n {
        assert_eq!(n.ep.freshness(), Freshness::Current(Proof::Handshake));
    }
}

#[test]
fn a_resync_source_tells_the_target_it_is_done_only_once_its_own_metadata_says_so() {
    // Node 1 went on alone and is the source. Were the target told "done" before the
    // source's metadata dropped its bitmap generation, a crash of the source right then
    // would leave a consistent target that may go on alone, and a source that restarts
    // believing (from that stale metadata) that it was the only writer and serves at once.
    let mut p = peer_went_on_alone(cfg(2, 1));
    p.n[0].hold_meta = true;
    p.connect();
    p.run_where(|i, io| !(i == 0 && matches!(io, LocalIo::Meta { .. })));
    assert!(
        p.n[0].ep.sync_progress(p.now).is_none(),
        "the source finished its pass"
    );
    assert!(
        p.n[1].ep.is_inconsistent(),
        "the target was told the resync is done before the source's metadata said so"
    );
    // The source's metadata write lands: now the target hears of it.
    p.n[0].hold_meta = false;
    p.run();
    assert!(!p.n[1].ep.is_inconsistent());
    assert_eq!(p.n[0].disk, p.n[1].disk);
    assert_eq!(p.n[0].ep.generations(), p.n[1].ep.generations());
    assert_eq!(p.n[0].ep.generations().bitmap, 0);
}

#[test]
fn a_target_whose_link_drops_before_the_sources_marks_serves_nothing_stale() {
    // Node 2 restarts behind node 1, becomes the target, and the link drops before node
    // 1's bitmap (the chunk it wrote alone) arrives: node 2 must not take its own
    // (stale) chunk 0 for synced.
    let mut p = peer_went_on_alone(cfg(2, 1));
    p.connect();
    // Deliver only what node 2 receives until it is connected, not node 1's bitmap.
    for _ in 0..20 {
        if p.n[1].ep.state() == LinkState::Connected {
            break;
        }
        let next_is_bitmap = matches!(p.n[1].inbox.front(), Some(Message::SyncBitmap { .. }));
        if next_is_bitmap || !(p.deliver(1) | p.deliver(0)) {
            break;
        }
    }
    assert_eq!(
        p.n[1].ep.state(),
        LinkState::Connected,
        "node 2 is connected"
    );
    assert!(p.n[1].ep.is_inconsistent(), "as the target");
    let now = p.now;
    p.n[1].inbox.clear();
    p.n[1].ep.handle_disconnected(now, "the link dropped");
    p.pump();
    let r = read(&mut p, 1, 0, 512);
    p.run_where(|i, _| i == 1);
    assert_eq!(
        p.n[1].result_of(r),
        Some(&Err(ErrorKind::Io)),
        "no stale read"
    );
    // Back together: node 2 ends with node 1's data.
    p.n[0].ep.handle_disconnected(now, "the link dropped");
    p.pump();
    p.connect();
    p.run();
    assert_eq!(p.n[0].disk, p.n[1].disk);
    assert!(!p.n[1].ep.is_inconsistent());
}

#[test]
fn an_unproven_node_shutting_down_refuses_flushes_and_keeps_its_generation() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    let now = p.now;
    let before = p.n[1].ep.generations();
    p.n[1].ep.begin_shutdown(now);
    let f = p.n[1].ep.submit_flush(now);
    p.pump();
    p.run_where(|i, _| i == 1);
    assert_eq!(p.n[1].result_of(f), Some(&Err(ErrorKind::Closed)));
    assert_eq!(p.n[1].ep.generations(), before);
    assert!(p.n[1].ep.is_shut_down());
}

#[test]
fn discarding_its_data_at_start_keeps_an_only_writer_from_serving_it() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    let now = p.now;
    p.n[0].ep.discard_my_data();
    assert!(!p.n[0].ep.freshness().is_current());
    assert_eq!(p.n[0].ep.state(), LinkState::Waiting);
    assert!(p.n[0].ep.declare_current(now).is_err());
    let r = read(&mut p, 0, 0, 512);
    assert_eq!(local_reads(&p.n[0]), 0, "the data to discard is not served");
    let t = p.n[0].ep.poll_timeout().expect("startup timer");
    p.n[0].ep.handle_timeout(t);
    p.pump();
    assert_eq!(p.n[0].result_of(r), Some(&Err(ErrorKind::Io)));
    // The peer connects: the handshake decides (discard-my-data counts in a split
    // brain; here node 2 did not write, so node 1 stays the source) and both serve.
    p.connect();
    p.run();
    assert_eq!(p.n[0].disk, p.n[1].disk);
    assert_eq!(p.n[0].ep.freshness(), Freshness::Current(Proof::Handshake));
}

#[test]
fn a_source_whose_metadata_failed_does_not_tell_the_target_the_resync_is_done() {
    let mut p = peer_went_on_alone(cfg(2, 1));
    p.connect();
    p.n[0].fail_meta = true;
    p.run();
    assert!(p.n[0].ep.meta_failed());
    assert!(
        p.n[1].ep.is_inconsistent(),
        "the target must not become consistent beside a source still named the only writer"
    );
}
