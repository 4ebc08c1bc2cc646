//! Adversarial review of "a replica that loses acknowledged data is resynced from its
//! peer" (commit 210b51d). Each test states what the promise requires and fails while
//! the bug it names is present. Four are fixed; the ignored one is a known limitation
//! (the data stays right; see its ignore reason).
//!
//! Uses the harness of `tests.rs`, whose nodes can hold or fail metadata writes.

use std::time::{Duration, Instant};

use super::tests::{Node, Pair, chunk_bytes, fill};
use super::*;

const DISK: u64 = 64 * 1024;
const CHUNK: u64 = 4096;
const CHUNKS: u64 = DISK / CHUNK;
const BS: u32 = 512;

/// Two nodes over 16 chunks of 4 KiB, in sync at generation 77, not connected.
fn pair_with(tweak: impl Fn(&mut Config)) -> Pair {
    let now = Instant::now();
    let mk = |id: u32, peer: u32| {
        let mut cfg = Config::new(id, peer, DiskId([7; 16]), "vol0", DISK, BS);
        cfg.seed = u64::from(id);
        cfg.peer_timeout = Duration::from_secs(5);
        tweak(&mut cfg);
        Node::with(cfg, CHUNK, 77, now)
    };
    Pair {
        now,
        n: [mk(1, 2), mk(2, 1)],
    }
}

/// Connected, every block written with data of its own, identical.
fn loaded(tweak: impl Fn(&mut Config)) -> Pair {
    let mut p = pair_with(tweak);
    p.connect();
    p.run();
    assert_eq!(p.n[0].ep.state(), LinkState::Connected);
    for b in 0..DISK / u64::from(BS) {
        p.write(
            (b % 2) as usize,
            b * u64::from(BS),
            fill(b as u8 ^ 0x5a, BS as usize),
            false,
        );
    }
    p.run();
    assert_eq!(p.n[0].disk, p.n[1].disk);
    p
}

// ---------------------------------------------------------------------------------------

/// Node 2 runs an online verify that repaired a chunk of node 1 and sent checkpoint 1;
/// node 1's metadata write for it is slow. Node 1 loses data and asks for a resync: node
/// 2 aborts the verify (keeping the checkpoint counter, "an ack for a checkpoint of the
/// aborted run may still come") and starts the checksum run, which finishes its scan and
/// sends checkpoint 2 before node 1's ack for checkpoint 1 arrives. That late ack is
/// taken as a protocol violation (`SyncCheckpointAck`: `cp != id`): the link drops,
/// node 1 (inconsistent, now alone) fails its I/O, although both nodes were healthy and
/// connected the whole time.
#[test]
fn a_late_checkpoint_ack_of_the_aborted_verify_does_not_drop_the_link() {
    let mut p = loaded(|_| {});
    // Node 1's chunk 9 differs: node 2's verify repairs it and checkpoints.
    p.n[0].disk[(9 * CHUNK) as usize] ^= 0xff;
    let now = p.now;
    p.n[1].ep.start_verify(now).unwrap();
    p.pump();
    let mut reached = false;
    for _ in 0..2000 {
        if matches!(p.n[0].inbox.front(), Some(Message::SyncCheckpoint { .. })) {
            reached = true;
            break;
        }
        let steps = p.steps();
        let Some(&s) = steps.first() else { break };
        p.step(s);
    }
    assert!(reached, "the verify never checkpointed");
    // Node 1 takes checkpoint 1; its metadata write is slow.
    p.n[0].hold_meta = true;
    assert!(p.deliver(0));
    assert!(
        p.n[0]
            .io
            .iter()
            .any(|io| matches!(io, LocalIo::Meta { .. })),
        "no checkpoint metadata write in flight"
    );
    // Node 1 loses data now.
    p.lose(0);
    // Everything else runs: node 2 aborts the verify, runs the checksum pass and
    // checkpoints it (node 1's compares do not wait for its metadata).
    p.run_where(|i, io| !(i == 0 && matches!(io, LocalIo::Meta { .. })));
    // The slow metadata write completes: node 1 acks checkpoint 1, then 2.
    p.n[0].hold_meta = false;
    while let Some(k) = p.n[0]
        .io
        .iter()
        .position(|io| matches!(io, LocalIo::Meta { .. }))
    {
        p.complete_io(0, k);
    }
    p.settle_rounds(6);
    for (i, n) in p.n.iter().enumerate() {
        assert!(
            n.lost_peer().is_empty(),
            "node {}: the link was dropped: {:?}",
            i + 1,
            n.lost_peer()
        );
    }
    let r = p.read(0, 0, 4096);
    p.settle_rounds(6);
    assert!(
        matches!(p.n[0].result_of(r), Some(Ok(_))),
        "a read on node 1 failed while both nodes are healthy: {:?}",
        p.n[0].result_of(r)
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
    assert!(!p.n[0].ep.is_inconsistent());
}

/// Node 1 lost one chunk (14) and its checksum resync from node 2 is under way: some
/// chunks compared equal and were checkpointed. The link blips. On reconnect node 1
/// (inconsistent, not every chunk marked any more) resumes as a *bitmap* target, and
/// node 2's bitmap (set in full when it became the checksum source, only partly
/// cleared) makes every remaining chunk travel in full instead of comparing them: the
/// promise is a resync by checksum, i.e. only the lost chunk travels. (On a real disk
/// of terabytes a short link blip turns a resync of a few MiB into a copy of nearly
/// the whole disk, with every read of those chunks going to the peer meanwhile.)
#[test]
#[ignore = "known limitation (issue 5 note): an interrupted lost-data resync resumes as a bitmap resync; the data ends right, more of it travels"]
fn an_interrupted_lost_data_resync_resumes_by_checksum() {
    let mut p = loaded(|cfg| {
        cfg.resync.window = 1;
        cfg.resync.checkpoint_interval = Duration::ZERO;
    });
    let before = p.n[0].disk.clone();
    p.write(1, 14 * CHUNK, fill(0xee, CHUNK as usize), false);
    p.run();
    let expect = p.n[1].disk.clone();
    p.lose_chunk(0, 14, &before);
    p.lose(0);
    let mut reached = false;
    for _ in 0..5000 {
        let d = p.n[1].ep.dirty_chunks();
        if d > 0 && d <= CHUNKS - 4 {
            reached = true;
            break;
        }
        let steps = p.steps();
        let Some(&s) = steps.first() else { break };
        p.step(s);
    }
    assert!(reached, "no checkpoint mid-run");
    assert!(p.n[0].ep.is_inconsistent());
    p.cut();
    p.now += Duration::from_millis(10);
    p.connect();
    p.settle_rounds(6);
    assert_eq!(p.n[0].disk, expect);
    assert_eq!(p.n[1].disk, expect);
    assert!(!p.n[0].ep.is_inconsistent());
    let starts = p.n[0].sync_starts();
    assert_eq!(
        starts.last(),
        Some(&(SyncRole::Target, SyncKind::Checksum)),
        "the resumed resync is not a checksum resync: {starts:?}"
    );
    let last = *p.sync_ends(0).last().unwrap();
    assert_eq!(
        last.transferred_bytes, CHUNK,
        "chunks equal on both nodes were copied again: {last:?}"
    );
}

/// Node 1 runs an online verify (node 2 runs nothing: a verify's peer only answers) when
/// its replica loses data. The peer is healthy and connected and could be the source
/// of a checksum resync exactly as when no verify runs (`sync_requested` already aborts
/// a verify on the receiving side), but node 1 detaches its replica instead and stays
/// detached and inconsistent for as long as it runs: the disk runs on one copy with no
/// resync ever, the replicas are never made identical again on this link.
#[test]
fn a_loss_on_the_node_running_a_verify_is_resynced_not_left_detached() {
    let mut p = loaded(|_| {});
    let before = p.n[0].disk.clone();
    p.write(1, 4 * CHUNK, fill(0x44, CHUNK as usize), false);
    p.run();
    let expect = p.n[1].disk.clone();
    let now = p.now;
    p.n[0].ep.start_verify(now).unwrap();
    p.pump();
    for _ in 0..3 {
        let steps = p.steps();
        let Some(&s) = steps.first() else { break };
        p.step(s);
    }
    p.lose_chunk(0, 4, &before);
    p.lose(0);
    p.settle_rounds(6);
    let r = p.read(0, 4 * CHUNK, CHUNK as u32);
    p.settle_rounds(6);
    assert_eq!(
        p.n[0].result_of(r),
        Some(&Ok(Some(chunk_bytes(&expect, 4))))
    );
    assert!(
        !p.n[0].ep.is_detached(),
        "node 1 detached its replica: it is never resynced while it runs"
    );
    assert!(!p.n[0].ep.is_inconsistent());
    assert_eq!(p.n[0].disk, expect, "node 1 never repaired");
}

/// Both nodes start (in sync at generation 77; node 2 holds chunk 0's acknowledged data,
/// node 1's replica has lost it) and the first link handshakes; node 1's Hello, saying
/// "consistent", is already out when node 1 notices the loss. A read of chunk 0 is held
/// for the handshake, as it should be; but the handshake then ends with "generations or
/// marked chunks changed during the handshake; reconnecting" and the held read is
/// failed at once (`end_handshake` -> `run_held_reads` -> `route_read` ->
/// `read_from_peer`, not connected), while a write submitted at the same moment waits
/// (state `Waiting`) and succeeds on the next link a moment later. The peer is up and
/// reachable all along.
#[test]
fn a_loss_during_the_handshake_does_not_fail_a_read_the_next_link_serves() {
    let mut p = pair_with(|_| {});
    p.n[1].disk[..CHUNK as usize].fill(0x11);
    p.connect();
    p.lose(0);
    let r = p.read(0, 0, CHUNK as u32);
    let w = p.write(0, 8 * CHUNK, fill(0x88, 512), false);
    p.run();
    assert!(
        p.n[0].events.iter().any(
            |e| matches!(e, Event::Refused { reason } if reason.contains("changed during the handshake"))
        ),
        "{:?}",
        p.n[0].events
    );
    // The driver drops the link and reconnects at once.
    p.cut();
    p.now += Duration::from_millis(10);
    p.connect();
    p.settle_rounds(6);
    assert_eq!(p.n[0].ep.state(), LinkState::Connected);
    assert_eq!(p.n[0].result_of(w), Some(&Ok(None)), "the write waited");
    let got = p.n[0]
        .result_of(r)
        .map(|res| res.as_ref().map(|d| d.clone().unwrap_or_default()));
    assert!(
        matches!(&got, Some(Ok(d)) if d[..] == fill(0x11, CHUNK as usize)[..]),
        "the read failed though the peer was there: {:?}",
        got.map(|g| g.map(|d| d.len()))
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
}

/// Node 1 went on alone (peer away) and wrote; then its replica loses data. Neither
/// node holds everything now, and refusing automatically is right; but the operator's
/// way out, "discard my data" on node 1, does nothing: an inconsistent replica is
/// decided by `resume` before `discard_my_data` is looked at, so node 1 is refused
/// forever and only recreating its metadata brings it back.
#[test]
fn discard_my_data_resolves_a_replica_that_lost_data_after_writing_alone() {
    let mut p = loaded(|_| {});
    p.cut();
    p.write(0, 3 * CHUNK, fill(0x33, CHUNK as usize), false);
    p.run();
    p.lose(0);
    assert!(p.n[0].ep.is_inconsistent());
    p.n[0].ep.discard_my_data();
    p.now += Duration::from_millis(10);
    p.connect();
    p.settle_rounds(6);
    assert_eq!(
        p.n[0].ep.state(),
        LinkState::Connected,
        "refused though node 1 was told to discard its data: {:?}",
        p.n[0].events.iter().rev().take(3).collect::<Vec<_>>()
    );
    assert_eq!(p.n[0].disk, p.n[1].disk);
}
