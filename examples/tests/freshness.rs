//! A restarted node proves its replica current before it serves a single block, with
//! real `vsan-node` processes, a real `vsan-witness` and real clients (qemu-io, nbdinfo):
//!
//! - node 2 killed (-9) or stopped cleanly while node 1 writes alone for longer than the
//!   dialer's back-off cap: reads through node 2 issued right after its `ready` line
//!   return node 1's newest data, and a write through node 2 in that window lands after
//!   the resync, not under it;
//! - both nodes stopped cleanly and restarted: they serve once they have shaken hands,
//!   and no resync runs;
//! - the peer stays away and there is no witness: the default policy never answers from
//!   the replica (requests fail after the peer timeout); `node.startup =
//!   "serve-alone-after-timeout"` serves after the timeout and says so; `--declare-current`
//!   serves at once;
//! - with a witness: the restarted node whose peer holds the grant serves nothing until
//!   the peer is back; the holder restarts and serves at once.
//!
//! Every test ends with both nodes stopped cleanly and byte-identical replicas.
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::thread;
use std::time::{Duration, Instant};

use common::mirror::{
    CONNECTED, Pair, Side, assert_replicas_identical, start_acceptor, start_dialer, start_pair,
    stop_both_clean,
};
use common::witness::Witness;
use common::{
    Node, Region, Sig, TestDir, image, qemu_io, qemu_io_reads, qemu_io_writes, require_tool,
    run_tool,
};

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
const DISK: &str = "vol0";
/// How long a log or report line that some event will print may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// Longer than the dialer's back-off cap (3 s): the link comes back late.
const OUTAGE: Duration = Duration::from_millis(4500);
/// The peer timeout of these nodes.
const PEER_TIMEOUT_MS: u64 = 1000;

fn side(id: u32) -> Side {
    Side::new(id, DISK, "\"32MiB\"").timeout(PEER_TIMEOUT_MS)
}

/// A side with the default peer timeout (5 s): a restarted node's requests wait that
/// long for the handshake, longer than the dialer's back-off cap (3 s), so after a long
/// outage they wait the link out instead of failing.
fn patient_side(id: u32) -> Side {
    Side::new(id, DISK, "\"32MiB\"")
}

fn tools() -> bool {
    require_tool("qemu-io") && require_tool("nbdinfo")
}

/// A new pair, connected and done with its first (full) sync.
fn synced_pair(tag: &str, s1: &Side, s2: &Side) -> Pair {
    let pair = start_pair(tag, s1, s2);
    for n in [&pair.n1, &pair.n2] {
        n.wait_log(CONNECTED, EVENT_TIMEOUT);
        n.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
        n.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
    }
    pair
}

/// A synced pair that took `data` through node 1 and was stopped cleanly: the two
/// directories and node 2's replication address, for restarts.
fn written_and_stopped(tag: &str, data: Region) -> (TestDir, TestDir, String) {
    let Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    } = synced_pair(tag, &side(1), &side(2));
    qemu_io_writes(&n1.uri(DISK), &[data]);
    stop_both_clean(n1, n2);
    (dir1, dir2, listen)
}

/// Stop both nodes cleanly and require byte-identical replicas.
fn stop_and_compare(dir1: &TestDir, dir2: &TestDir, n1: Node, n2: Node) {
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(dir1, DISK), &image(dir2, DISK));
}

/// The export answers the NBD handshake (it listens) with the disk's size.
fn export_listens(n: &Node) {
    let out = run_tool(
        "nbdinfo",
        &["--size", &n.uri(DISK)],
        Duration::from_secs(10),
    );
    out.assert_success();
    assert_eq!(out.stdout.trim(), (32 * MIB).to_string(), "{out}");
}

/// qemu-io `cmds` on `n` must fail (an I/O error), and change nothing.
fn refused(n: &Node, cmds: &[String], what: &str) {
    let out = qemu_io(&n.uri(DISK), cmds);
    let text = out.text().to_lowercase();
    assert!(
        !out.status.success() || text.contains("error") || text.contains("failed"),
        "{what} was served:\n{out}"
    );
    assert!(
        !text.contains("read 65536/65536") && !text.contains("wrote "),
        "{what}:\n{out}"
    );
}

/// Node 2 goes away (`sig`) while node 1 writes alone for longer than the dialer's
/// back-off cap; node 2 restarts, and its client reads and writes at once.
fn restarted_node_serves_the_newest_data(tag: &str, sig: Sig) {
    if !tools() {
        return;
    }
    let Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    } = synced_pair(tag, &patient_side(1), &patient_side(2));
    let old = [
        Region::new(0x11, 0, 256 * KIB),
        Region::new(0x12, 8 * MIB, 256 * KIB),
    ];
    qemu_io_writes(&n1.uri(DISK), &old);
    qemu_io_reads(&n2.uri(DISK), &old);

    let stopped = n2.stop(sig);
    if sig == Sig::TERM {
        assert!(stopped.status.success(), "{}", stopped.log);
    }
    // Node 1 goes on alone: new data over the old, early and late in the outage.
    let began = Instant::now();
    let first = Region::new(0x21, 0, 256 * KIB);
    qemu_io_writes(&n1.uri(DISK), &[first]);
    n1.wait_log("continuing degraded", EVENT_TIMEOUT);
    thread::sleep(OUTAGE.saturating_sub(began.elapsed()));
    let late = Region::new(0x22, 8 * MIB, 256 * KIB);
    qemu_io_writes(&n1.uri(DISK), &[late]);

    let n2 = start_acceptor(&dir2, &patient_side(2), &listen);
    // Right after `ready`: a read of both regions, and a write into the chunk node 1
    // wrote last (it must land after the resync's copy of that chunk, not under it).
    let mine = Region::new(0x33, 8 * MIB + 64 * KIB, 4 * KIB);
    // (The read leaves out the block the write goes to: they race.)
    let late_around_mine = [
        Region::new(0x22, 8 * MIB, 64 * KIB),
        Region::new(0x22, 8 * MIB + 68 * KIB, 188 * KIB),
    ];
    let (uri, uri_w) = (n2.uri(DISK), n2.uri(DISK));
    let reader = thread::spawn(move || {
        qemu_io_reads(&uri, &[first, late_around_mine[0], late_around_mine[1]])
    });
    let writer = thread::spawn(move || qemu_io_writes(&uri_w, &[mine]));
    reader
        .join()
        .expect("the read through node 2 returns node 1's newest data");
    writer.join().expect("the write through node 2 succeeds");
    let log2 = n2.log();
    assert!(
        log2.contains("replica not proven current yet"),
        "node 2 did not start unproven:\n{log2}"
    );
    n2.wait_stdout(&["unproven disk=vol0 waiting for"], EVENT_TIMEOUT);
    n2.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
    n2.wait_stdout(&["sync disk=vol0 done", "role=target"], EVENT_TIMEOUT);

    // Both nodes serve node 1's data with node 2's write on top.
    let chunk_rest = [late_around_mine[0], mine, late_around_mine[1]];
    for n in [&n1, &n2] {
        qemu_io_reads(&n.uri(DISK), &[first]);
        qemu_io_reads(&n.uri(DISK), &chunk_rest);
    }
    stop_and_compare(&dir1, &dir2, n1, n2);
}

#[test]
fn a_node_killed_while_its_peer_wrote_alone_reads_the_peers_data_after_its_restart() {
    restarted_node_serves_the_newest_data("fresh-kill", Sig::KILL);
}

#[test]
fn a_node_stopped_while_its_peer_wrote_alone_reads_the_peers_data_after_its_restart() {
    restarted_node_serves_the_newest_data("fresh-term", Sig::TERM);
}

#[test]
fn both_nodes_stopped_cleanly_serve_after_the_handshake_without_a_resync() {
    if !tools() {
        return;
    }
    let data = [Region::new(0x5a, 3 * MIB, 512 * KIB)];
    let (dir1, dir2, listen) = written_and_stopped("fresh-both", data[0]);

    let n2 = start_acceptor(&dir2, &side(2), &listen);
    let n1 = start_dialer(&dir1, &side(1), &listen);
    for n in [&n1, &n2] {
        n.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
        qemu_io_reads(&n.uri(DISK), &data);
    }
    for n in [&n1, &n2] {
        let lines = n.stdout_lines();
        assert!(
            !lines
                .iter()
                .any(|l| l.starts_with("sync disk=vol0 started")),
            "a resync ran after a clean stop of both:\n{}",
            lines.join("\n")
        );
    }
    stop_and_compare(&dir1, &dir2, n1, n2);
}

#[test]
fn a_node_whose_peer_stays_away_serves_nothing_by_default_and_alone_only_when_opted_in() {
    if !tools() {
        return;
    }
    let data = [Region::new(0x6b, MIB, 64 * KIB)];
    let (dir1, dir2, listen) = written_and_stopped("fresh-away", data[0]);
    let before = std::fs::read(image(&dir2, DISK)).expect("node 2's image");

    // Default policy (wait-for-peer): the export listens, but nothing is answered from
    // the replica, before the timeout or after it.
    let n2 = start_acceptor(&dir2, &side(2), &listen);
    export_listens(&n2);
    let start = Instant::now();
    refused(&n2, &[data[0].read()], "a read of an unproven replica");
    assert!(
        start.elapsed() >= Duration::from_millis(PEER_TIMEOUT_MS - 100),
        "the read failed before the peer timeout: {:?}",
        start.elapsed()
    );
    n2.wait_log("startup policy wait-for-peer serves nothing", EVENT_TIMEOUT);
    refused(
        &n2,
        &[Region::new(0x77, MIB, 64 * KIB).write()],
        "a write to an unproven replica",
    );
    refused(
        &n2,
        &[data[0].read()],
        "a later read of an unproven replica",
    );
    n2.wait_log("requests failed (EIO)", EVENT_TIMEOUT);
    assert!(
        !n2.stdout_lines().iter().any(|l| l.starts_with("serving ")),
        "node 2 said it serves"
    );
    n2.stop_clean(Sig::TERM);
    let after = std::fs::read(image(&dir2, DISK)).expect("node 2's image");
    assert!(after == before, "an unproven replica was written");

    // Opted in: it serves alone once the timeout passed, and says so.
    let n2 = start_acceptor(&dir2, &side(2).serve_alone(), &listen);
    n2.wait_stdout(&["serving disk=vol0 proof=startup-timeout"], EVENT_TIMEOUT);
    n2.wait_log("startup policy serve-alone-after-timeout", EVENT_TIMEOUT);
    n2.wait_log("RISK", EVENT_TIMEOUT);
    qemu_io_reads(&n2.uri(DISK), &data);
    let alone = [Region::new(0x7c, 2 * MIB, 64 * KIB)];
    qemu_io_writes(&n2.uri(DISK), &alone);
    n2.stop_clean(Sig::TERM);

    // Restarted after writing alone, with the default policy: its metadata says the
    // peer is behind, so it serves at once.
    let n2 = start_acceptor(&dir2, &side(2), &listen);
    n2.wait_stdout(&["serving disk=vol0 proof=only-writer"], EVENT_TIMEOUT);
    qemu_io_reads(&n2.uri(DISK), &alone);

    // The peer comes back: node 2 went on alone, so it is the source.
    let n1 = start_dialer(&dir1, &side(1), &listen);
    n1.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
    n1.wait_stdout(&["sync disk=vol0 done", "role=target"], EVENT_TIMEOUT);
    qemu_io_reads(&n1.uri(DISK), &alone);
    stop_and_compare(&dir1, &dir2, n1, n2);
}

#[test]
fn an_operator_flag_serves_an_unproven_replica_at_once() {
    if !tools() {
        return;
    }
    let data = [Region::new(0x4e, 5 * MIB, 64 * KIB)];
    let (dir1, dir2, listen) = written_and_stopped("fresh-declare", data[0]);
    let n2 = Node::start_listening_with_args(
        &dir2,
        &side(2).config(&dir2, Some(&listen), "127.0.0.1:1"),
        &[DISK],
        &["--declare-current", DISK],
    );
    n2.wait_stdout(&["serving disk=vol0 proof=operator"], EVENT_TIMEOUT);
    n2.wait_log("OPERATOR DECLARED THIS REPLICA CURRENT", EVENT_TIMEOUT);
    qemu_io_reads(&n2.uri(DISK), &data);
    let n1 = start_dialer(&dir1, &side(1), &listen);
    n1.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
    stop_and_compare(&dir1, &dir2, n1, n2);
}

#[test]
fn with_a_witness_a_node_whose_peer_holds_the_grant_serves_nothing_and_the_holder_serves_at_once() {
    if !tools() {
        return;
    }
    let wdir = TestDir::new("fresh-wit-w");
    let witness = Witness::start(&wdir, None);
    let (s1, s2) = (
        side(1).witness(witness.addr(), None),
        side(2).witness(witness.addr(), None),
    );
    let Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    } = synced_pair("fresh-wit", &s1, &s2);
    qemu_io_writes(&n1.uri(DISK), &[Region::new(0x10, 0, 64 * KIB)]);

    // Node 2 dies; node 1 gets the grant and writes alone; then node 1 dies too.
    n2.stop(Sig::KILL);
    n1.wait_log("quorum granted", EVENT_TIMEOUT);
    let newest = [Region::new(0x2f, 0, 64 * KIB)];
    qemu_io_writes(&n1.uri(DISK), &newest);
    n1.stop(Sig::KILL);

    // Node 2 restarts: the witness says node 1 holds the disk; node 2 serves nothing.
    let n2 = start_acceptor(&dir2, &s2, &listen);
    refused(&n2, &[newest[0].read()], "a read without the grant");
    n2.wait_log("no quorum", EVENT_TIMEOUT);
    refused(
        &n2,
        &[newest[0].read()],
        "a read after the witness's denial",
    );
    assert!(
        !n2.stdout_lines().iter().any(|l| l.starts_with("serving ")),
        "node 2 said it serves"
    );

    // The holder restarts: it went on alone, so it serves at once.
    let n1 = start_dialer(&dir1, &s1, &listen);
    n1.wait_stdout(&["serving disk=vol0 proof=only-writer"], EVENT_TIMEOUT);
    qemu_io_reads(&n1.uri(DISK), &newest);
    // And node 2, once it has shaken hands, serves node 1's data.
    n2.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
    qemu_io_reads(&n2.uri(DISK), &newest);
    n2.wait_stdout(&["sync disk=vol0 done", "role=target"], EVENT_TIMEOUT);
    stop_and_compare(&dir1, &dir2, n1, n2);
    witness.stop();
}
