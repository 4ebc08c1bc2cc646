//! A local replica that lost acknowledged data (a failed write-back cache): it is
//! detached or resynced from the peer, and nothing it held before the loss is trusted.

use std::time::{Duration, Instant};

use bytes::Bytes;
use vsan_core::ErrorKind;

use super::*;

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
    let hold = p.n[0].io[0].op();
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
    let k = p.n[0].io.iter().position(|io| io.op() == hold).unwrap();
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

// ----- found by reviewing "a replica that loses acknowledged data is resynced from its
// peer": each test states what the promise requires -----

const DISK: u64 = 64 * 1024;
const CHUNK: u64 = 4096;
const CHUNKS: u64 = DISK / CHUNK;

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
