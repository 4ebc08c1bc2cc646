//! One logical unit, two paths: a mirrored disk's iSCSI target on both nodes.
//!
//! - libiscsi's multipath mode (`iscsi-test-cu` given one URL per node) accepts the two
//!   nodes' ports as paths to one device (the same LU designators and serial), and its
//!   MultipathIO.Simple test writes through each node and reads back through the other.
//! - The suites whose second nexus logs in through the other node (MultipathIO,
//!   Prin*/Prout*, Reserve6) run, pass and skip nothing: reservations, resets and
//!   COMPARE AND WRITE hold across the pair.
//! - The ALUA states REPORT TARGET PORT GROUPS reports on each node follow the mirror:
//!   both groups active/optimized in sync; the survivor reports its peer's group
//!   unavailable when the peer is killed (and raises ASYMMETRIC ACCESS STATE CHANGED); a
//!   restarted node whose replica is not yet proven current reports its own group
//!   transitioning and answers NOT READY, 04/0A; both active/optimized again while the
//!   resync runs and after it; the replicas end byte-identical.

use crate::common;

use std::time::{Duration, Instant};

use common::iscsi::{CuReport, IscsiPair, IscsiTarget, RawConn, iscsi_lines};
use common::mirror::{CONNECTED, Side, assert_replicas_identical, free_loopback_addr};
use common::{Node, Region, Sig, TestDir, image, qemu_io_writes, require_tool, run_tool};

/// How long a state change may take to show.
const CHANGE: Duration = Duration::from_secs(30);
const AO: u8 = 0x0;
const UNAVAILABLE: u8 = 0x3;
const TRANSITIONING: u8 = 0xF;
const MIB: u64 = 1 << 20;

#[test]
fn iscsi_test_cu_multipath_io_through_both_nodes() {
    if !require_tool("iscsi-test-cu") {
        return;
    }
    let pair = IscsiPair::start("iscsi-mpath-cu", "vol0", "\"64MiB\"");
    let t1 = IscsiTarget::of_node(&pair.n1, "vol0");
    let t2 = IscsiTarget::of_node(&pair.n2, "vol0");
    assert_eq!(t1.iqn, t2.iqn, "both nodes serve the same target name");
    assert_ne!(t1.portal, t2.portal);
    let out = run_tool(
        "iscsi-test-cu",
        &["-d", "-t", "ALL.MultipathIO.Simple", &t1.url(), &t2.url()],
        Duration::from_secs(300),
    );
    assert!(
        out.stdout
            .contains("found matching LU device identifier for all (2) paths"),
        "libiscsi did not take the two nodes' ports as one device:\n{out}"
    );
    let report = CuReport::parse(&out.stdout);
    let simple: Vec<_> = report
        .tests
        .iter()
        .filter(|t| t.name == "MultipathIO.Simple")
        .collect();
    assert!(
        !simple.is_empty() && simple.iter().all(|t| !t.failed && t.skips.is_empty()),
        "MultipathIO.Simple did not run and pass through both nodes:\n{out}"
    );
    pair.n1.stop_clean(Sig::TERM);
    pair.n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&pair.dir1, "vol0"), &image(&pair.dir2, "vol0"));
}

/// libiscsi's suites whose second nexus, in multipath mode, logs in through the other
/// node: reservations, resets and COMPARE AND WRITE must hold across the pair.
const ACROSS_THE_PAIR: &[&str] = &[
    "ALL.MultipathIO",
    "ALL.PrinReadKeys",
    "ALL.PrinServiceactionRange",
    "ALL.PrinReportCapabilities",
    "ALL.ProutRegister",
    "ALL.ProutReserve",
    "ALL.ProutClear",
    "ALL.ProutPreempt",
    "ALL.Reserve6",
];

#[test]
fn iscsi_test_cu_reservations_resets_and_caw_across_both_nodes() {
    if !require_tool("iscsi-test-cu") {
        return;
    }
    let pair = IscsiPair::start("iscsi-mpath-pr", "vol0", "\"64MiB\"");
    let t1 = IscsiTarget::of_node(&pair.n1, "vol0");
    let t2 = IscsiTarget::of_node(&pair.n2, "vol0");
    for suite in ACROSS_THE_PAIR {
        let out = run_tool(
            "iscsi-test-cu",
            &["-d", "-t", suite, &t1.url(), &t2.url()],
            Duration::from_secs(300),
        );
        let report = CuReport::parse(&out.stdout);
        assert!(!report.tests.is_empty(), "{suite}: nothing ran:\n{out}");
        let failed: Vec<&str> = report
            .tests
            .iter()
            .filter(|t| t.failed)
            .map(|t| t.name.as_str())
            .collect();
        assert!(
            failed.is_empty(),
            "{suite}: {failed:?} failed through both nodes:\n{out}"
        );
        let skipped: Vec<(&str, &Vec<String>)> = report
            .tests
            .iter()
            .filter(|t| !t.skips.is_empty())
            .map(|t| (t.name.as_str(), &t.skips))
            .collect();
        assert!(
            skipped.is_empty(),
            "{suite}: skipped through both nodes: {skipped:?}\n{out}"
        );
        eprintln!(
            "{suite}: {} tests passed through both nodes",
            report.tests.len()
        );
    }
    pair.n1.stop_clean(Sig::TERM);
    pair.n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&pair.dir1, "vol0"), &image(&pair.dir2, "vol0"));
}

/// A logged-in session to `node`'s target of vol0.
fn session(node: &Node) -> RawConn {
    let mut c = RawConn::login(&IscsiTarget::of_node(node, "vol0"));
    c.assert_serves("a new session");
    c
}

/// Poll REPORT TARGET PORT GROUPS until it reports `want` (`(group, state)` by group).
fn wait_groups(conn: &mut RawConn, want: &[(u16, u8)], what: &str) {
    let deadline = Instant::now() + CHANGE;
    let mut last = Vec::new();
    while Instant::now() < deadline {
        match conn.report_target_port_groups() {
            Ok(g) if g == want => return,
            Ok(g) => last = g,
            Err(e) => panic!("{what}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}: REPORT TARGET PORT GROUPS says {last:x?}, not {want:x?}, after {CHANGE:?}");
}

/// The next command on `conn` gets UNIT ATTENTION, ASYMMETRIC ACCESS STATE CHANGED.
fn expect_alua_changed_ua(conn: &mut RawConn, what: &str) {
    let a = conn
        .command_in(&[0; 6], 0)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(
        (a.status, a.sense_key(), a.asc_ascq()),
        (0x02, Some(0x06), Some((0x2A, 0x06))),
        "{what}: TEST UNIT READY should report ASYMMETRIC ACCESS STATE CHANGED: {a:x?}"
    );
}

fn side(id: u32, rate: Option<&'static str>) -> Side {
    let s = Side::new(id, "vol0", "\"64MiB\"").timeout(1000);
    match rate {
        Some(r) => s.resync_rate(r),
        None => s,
    }
}

fn start_n2(dir: &TestDir, listen: &str, rate: Option<&'static str>) -> Node {
    let config = side(2, rate).config(dir, Some(listen), "127.0.0.1:1") + &iscsi_lines();
    Node::start_listening(dir, &config, &["vol0"])
}

fn start_n1(dir: &TestDir, peer: &str, rate: Option<&'static str>) -> Node {
    let config = side(1, rate).config(dir, None, peer) + &iscsi_lines();
    Node::start(dir, &config, &["vol0"])
}

#[test]
fn alua_states_follow_the_mirror_through_a_peer_loss_a_restart_and_a_resync() {
    if !require_tool("qemu-io") {
        return;
    }
    let dir1 = TestDir::new("iscsi-alua-n1");
    let dir2 = TestDir::new("iscsi-alua-n2");
    let listen = free_loopback_addr();
    let mut n2 = start_n2(&dir2, &listen, None);
    let mut n1 = start_n1(&dir1, &listen, None);
    for n in [&n1, &n2] {
        n.wait_log(CONNECTED, CHANGE);
        n.wait_stdout(&["sync disk=vol0 done"], CHANGE);
    }

    // In sync: both groups active/optimized, the same through both nodes; each node's
    // port is its own group (node 1: group and relative port 1, node 2: 2).
    let both = [(1, AO), (2, AO)];
    let mut s1 = session(&n1);
    let mut s2 = session(&n2);
    wait_groups(&mut s1, &both, "in sync, through node 1");
    wait_groups(&mut s2, &both, "in sync, through node 2");

    // Node 2 killed: node 1 reports node 2's group unavailable, and its session hears of
    // the change.
    drop(s2);
    let killed = n2.stop(Sig::KILL);
    assert!(!killed.status.success());
    n1.wait_log("peer lost", CHANGE);
    let mut probe = session(&n1);
    wait_groups(&mut probe, &[(1, AO), (2, UNAVAILABLE)], "peer killed");
    expect_alua_changed_ua(&mut s1, "node 1's old session after the peer was lost");
    s1.assert_serves("node 1 alone");
    drop((s1, probe));

    // Node 1 writes alone, so node 2 will need a resync.
    let regions: Vec<Region> = (0..24)
        .map(|i| Region::new(0x40 + i as u8, 2 * i * MIB, MIB))
        .collect();
    qemu_io_writes(&n1.uri("vol0"), &regions);

    // Node 2 restarts where node 1 cannot reach it: its replica stays unproven. Its own
    // group is transitioning (commands get NOT READY, 04/0A, so an initiator retries or
    // uses node 1), and it does not know node 1's.
    n2 = start_n2(&dir2, &free_loopback_addr(), None);
    let mut s2 = RawConn::login(&IscsiTarget::of_node(&n2, "vol0"));
    wait_groups(
        &mut s2,
        &[(1, UNAVAILABLE), (2, TRANSITIONING)],
        "node 2 restarted, not proven current",
    );
    let mut tur = s2.command_in(&[0; 6], 0).expect("TEST UNIT READY");
    for _ in 0..4 {
        if tur.sense_key() != Some(0x06) {
            break;
        }
        tur = s2.command_in(&[0; 6], 0).expect("TEST UNIT READY");
    }
    assert_eq!(
        (tur.status, tur.sense_key(), tur.asc_ascq()),
        (0x02, Some(0x02), Some((0x04, 0x0A))),
        "an unproven replica answers NOT READY, ASYMMETRIC ACCESS STATE TRANSITION: {tur:x?}"
    );
    let mut s1 = session(&n1);
    wait_groups(
        &mut s1,
        &[(1, AO), (2, UNAVAILABLE)],
        "node 2 unproven, node 1's view",
    );
    drop((s1, s2));

    // Both restart where they find each other, with a slow resync (24 MiB at 4 MiB/s):
    // node 1 (the only writer) serves at once; while the resync runs both groups are
    // active/optimized (node 2 reads unsynced chunks through node 1).
    let _ = n2.stop(Sig::KILL);
    n1.stop_clean(Sig::TERM);
    n1 = start_n1(&dir1, &listen, Some("4MiB"));
    n2 = start_n2(&dir2, &listen, Some("4MiB"));
    n2.wait_stdout(&["sync disk=vol0 started", "role=target"], CHANGE);
    let mut s1 = session(&n1);
    let mut s2 = session(&n2);
    wait_groups(&mut s1, &both, "resyncing, through node 1");
    wait_groups(&mut s2, &both, "resyncing, through node 2");
    assert!(
        !n2.stdout_lines()
            .iter()
            .any(|l| l.starts_with("sync disk=vol0 done")),
        "the resync ended before its states were seen; make it slower"
    );
    let done = n2.wait_stdout(&["sync disk=vol0 done"], Duration::from_secs(60));
    eprintln!("resync: {done}");
    wait_groups(&mut s1, &both, "back in sync, through node 1");
    wait_groups(&mut s2, &both, "back in sync, through node 2");
    drop((s1, s2));

    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}
