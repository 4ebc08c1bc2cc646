//! The management API end to end: `vsanctl` (the binary) against real `vsan-node`
//! processes serving `vsan.mgmt.v1` on `node.mgmt = "127.0.0.1:0"` (each node prints
//! `ready mgmt=<addr>`).
//!
//! - two nodes mirroring `vol0`: `status` (JSON and table) says connected and in sync;
//!   the peer killed, the survivor says degraded; writes while it is away, the peer
//!   restarted, and `vsanctl watch` on both nodes follows the resync to 100% and exits 0;
//! - a split brain made through a fault proxy, resolved with `vsanctl discard-my-data`,
//!   then `vsanctl verify --wait`: no mismatches, and after a block of one replica is
//!   changed behind the node's back, one, repaired;
//! - the cache mode set through the API (a node in process).
//!
//! What the API refuses (bad input, tokens) and TLS are in `mgmt_refusals.rs`; disks
//! created and deleted at run time in `mgmt_disks.rs`.
//!
//! Node 1 (the lower id) dials, node 2 listens. A missing qemu-io
//! skips a test with a `SKIP:` line, or fails it when `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::in_process::{client, node};
use common::mirror::{
    CONNECTED, Side, assert_replicas_identical, free_loopback_addr, start_acceptor, start_dialer,
    stop_both_clean,
};
use common::proxy::Proxy;
use common::vsanctl::{
    MGMT, VSANCTL, assert_node_error, mgmt_addr, vsanctl, vsanctl_cmd, vsanctl_ok,
};
use common::{
    Node, ProcessGuard, Region, Sig, TOOL_TIMEOUT, TestDir, assert_file_holds, image, line_channel,
    qemu_io_reads, qemu_io_writes, require_tool, run_command,
};
use serde_json::Value;
use vsan_replica::mgmt::v1;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
const DISK: &str = "vol0";
/// How long something the nodes will do may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// Short, so a killed or cut-off peer is given up quickly.
const PEER_TIMEOUT_MS: u64 = 1000;
const SYNC_DONE: &str = "sync disk=vol0 done";
const PEER_LOST: &str = "peer lost";

/// A vsanctl still running (a `watch`): its stdout line by line.
struct Running {
    process: ProcessGuard,
    lines: mpsc::Receiver<String>,
    stderr: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn spawn(node: &str, args: &[&str]) -> Running {
        let mut cmd = vsanctl_cmd(Some(node), args, &[]);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {VSANCTL}: {e}"));
        let lines = line_channel(child.stdout.take().expect("stdout is piped"));
        let stderr = line_channel(child.stderr.take().expect("stderr is piped"));
        Running {
            process: ProcessGuard::new(child, None),
            lines,
            stderr,
            seen: Vec::new(),
        }
    }

    /// Wait for a stdout line containing `needle`.
    fn wait_line(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        if let Some(l) = self.seen.iter().find(|l| l.contains(needle)) {
            return l.clone();
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(needle) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "vsanctl printed no line with {needle:?} within {limit:?}:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Wait for it to exit; its status, every stdout line and its stderr.
    fn finish(mut self, limit: Duration) -> (ExitStatus, Vec<String>, String) {
        let status = self.process.wait(limit);
        // The pipes close with the process: everything it printed is in the channels.
        self.seen.extend(self.lines.iter());
        let stderr = self.stderr.iter().collect::<Vec<_>>().join("\n");
        let status = status.unwrap_or_else(|| {
            panic!(
                "vsanctl ran longer than {limit:?}:\n{}\n--- stderr ---\n{stderr}",
                self.seen.join("\n")
            )
        });
        (status, self.seen, stderr)
    }
}

// ----- nodes and their status -----

/// `vsanctl status DISK --json`, parsed.
fn status_json(node: &str, disk: &str) -> Value {
    let out = vsanctl_ok(node, &["status", disk, "--json"]);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"))
}

/// Poll `status --json` until `ok` holds; returns that status (panics with the last one
/// after `EVENT_TIMEOUT`).
fn wait_status(node: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        let s = status_json(node, DISK);
        if ok(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "node at {node} never reported {what}; last status:\n{s:#}"
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// Connected to the peer, up to date, nothing running, nothing dirty.
fn in_sync(s: &Value) -> bool {
    s["link"] == "connected"
        && s["local_state"] == "up-to-date"
        && s["syncing"] == false
        && s["sync"].is_null()
        && s["dirty_chunks"] == 0
}

/// Node `id`'s side of `vol0` of `size`, with the management service on.
fn side(id: u32, size: &'static str) -> Side {
    Side::new(id, DISK, size)
        .timeout(PEER_TIMEOUT_MS)
        .node_lines(MGMT)
}

/// Wait until a fresh pair's first (full checksum) sync is done and both mirror.
fn wait_first_sync(n1: &Node, n2: &Node) {
    n1.wait_stdout(&[SYNC_DONE, "kind=checksum", "role=source"], EVENT_TIMEOUT);
    n2.wait_stdout(&[SYNC_DONE, "kind=checksum", "role=target"], EVENT_TIMEOUT);
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n2.wait_log(CONNECTED, EVENT_TIMEOUT);
}

/// What a `watch` that followed a pass to its completed end printed: a start line, a
/// progress line before 100%, a 100% line and the completed line (each checked here).
fn assert_watched_to_the_end(lines: &[String], role: &str) {
    let text = lines.join("\n");
    let started = lines
        .iter()
        .position(|l| l.contains("resync started") && l.contains(&format!("the {role}")))
        .unwrap_or_else(|| panic!("no `resync started` line as the {role}:\n{text}"));
    let full = lines
        .iter()
        .position(|l| l.contains("100.0%"))
        .unwrap_or_else(|| panic!("no 100% line:\n{text}"));
    assert!(
        lines[started + 1..full].iter().any(|l| l.contains('%')),
        "no progress line between the start and 100%:\n{text}"
    );
    let done = lines
        .iter()
        .position(|l| l.contains("completed after"))
        .unwrap_or_else(|| panic!("no `completed` line:\n{text}"));
    assert!(full < done, "100% after the end:\n{text}");
    assert!(lines[done].contains(&format!("({role})")), "{text}");
}

// ----- the tests -----

#[test]
fn status_degraded_and_watch_of_the_resync_after_the_peer_comes_back() {
    if !require_tool("qemu-io") {
        return;
    }
    let s1 = side(1, "\"8MiB\"");
    let s2 = side(2, "\"8MiB\"");
    let (dir1, dir2) = (TestDir::new("mgmt-watch-n1"), TestDir::new("mgmt-watch-n2"));
    // Node 2 comes back on the same address.
    let listen = free_loopback_addr();
    let n2 = start_acceptor(&dir2, &s2, &listen);
    let n1 = start_dialer(&dir1, &s1, n2.replication());
    wait_first_sync(&n1, &n2);
    let (m1, m2) = (mgmt_addr(&n1), mgmt_addr(&n2));
    // Node 1's resyncs from now on slow enough (2 s for the whole disk) for a watch to
    // see one run.
    let out = vsanctl_ok(&m1, &["set-rate", DISK, "4MiB"]);
    assert!(
        out.stdout.contains("resync rate set to 4194304 bytes/s"),
        "{out}"
    );

    // Both connected and in sync, in JSON ...
    for (m, peer, role) in [(&m1, 2, "source"), (&m2, 1, "target")] {
        let s = wait_status(m, "connected and in sync", in_sync);
        assert_eq!(s["name"], DISK);
        assert_eq!(s["size"], 8 * MIB);
        assert_eq!(s["mirrored"], true);
        assert_eq!(s["peer_id"], peer);
        assert_eq!(s["transport"], "tcp");
        assert_eq!(s["quorum"], "none");
        assert_eq!(s["last_sync"]["kind"], "checksum", "{s:#}");
        assert_eq!(s["last_sync"]["role"], role, "{s:#}");
        assert_eq!(s["last_sync"]["completed"], true, "{s:#}");
        // The link's handshake decision holds for the life of the link (the first
        // full sync came from node 1).
        assert_eq!(s["link_role"], role, "{s:#}");
        assert!(
            s["nbd"]
                .as_str()
                .is_some_and(|a| a.starts_with("127.0.0.1:")),
            "{s:#}"
        );
    }
    let all: Value = serde_json::from_str(&vsanctl_ok(&m1, &["status", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(all["node_id"], 1);
    assert_eq!(all["disks"][0]["name"], DISK);
    // ... and as a table.
    let table = vsanctl_ok(&m1, &["status"]).stdout;
    let row = table
        .lines()
        .find(|l| l.starts_with(DISK))
        .unwrap_or_else(|| panic!("no {DISK} row:\n{table}"));
    for word in [
        "connected (peer 2)",
        "tcp",
        "up-to-date",
        "in sync",
        "127.0.0.1:",
    ] {
        assert!(row.contains(word), "no {word:?} in the row:\n{table}");
    }
    assert!(
        table.lines().next().unwrap_or("").contains("node 1"),
        "{table}"
    );
    let one = vsanctl_ok(&m2, &["status", DISK]).stdout;
    assert!(
        one.contains("connected (peer 1)") && one.contains("last sync:"),
        "{one}"
    );
    assert_eq!(vsanctl_ok(&m1, &["list"]).stdout, format!("{DISK}\n"));

    // The peer dies: the survivor goes on alone and says so.
    n2.stop(Sig::KILL);
    let s = wait_status(&m1, "degraded", |s| s["link"] == "degraded");
    assert_eq!(s["transport"], Value::Null, "{s:#}");
    assert_eq!(s["link_role"], Value::Null, "no link, no role: {s:#}");
    let table = vsanctl_ok(&m1, &["status"]).stdout;
    assert!(table.contains("degraded (peer 2)"), "{table}");
    // Writes while it is away: the whole disk, so the resync has 8 MiB to copy.
    let w = Region::new(0x5a, 0, 8 * MIB);
    qemu_io_writes(&n1.uri(DISK), &[w]);
    let s = status_json(&m1, DISK);
    assert_eq!(s["dirty_chunks"], 128, "8 MiB in 64 KiB chunks:\n{s:#}");
    let table = vsanctl_ok(&m1, &["status"]).stdout;
    assert!(table.contains("128 chunks dirty"), "{table}");

    // A watch on node 1 from before the peer is back ...
    let mut watch1 = Running::spawn(
        &m1,
        &["watch", DISK, "--interval-ms", "200", "--timeout", "60s"],
    );
    watch1.wait_line("waiting for a resync or verify to start", EVENT_TIMEOUT);
    let n2 = start_acceptor(&dir2, &s2, &listen);
    let m2 = mgmt_addr(&n2);
    // ... and one on node 2 as soon as it is up.
    let watch2 = run_command(
        vsanctl_cmd(
            Some(&m2),
            &["watch", DISK, "--interval-ms", "200", "--timeout", "60s"],
            &[],
        ),
        Duration::from_secs(90),
    );
    eprintln!("{watch2}");
    watch2.assert_success();
    let lines2: Vec<String> = watch2.stdout.lines().map(str::to_string).collect();
    assert_watched_to_the_end(&lines2, "target");
    let (status1, lines1, err1) = watch1.finish(Duration::from_secs(60));
    eprintln!("node 1's watch:\n{}\n{err1}", lines1.join("\n"));
    assert!(status1.success(), "node 1's watch: {status1}\n{err1}");
    assert_watched_to_the_end(&lines1, "source");
    assert!(
        lines1.iter().any(|l| l.contains("link degraded -> ")),
        "node 1's watch did not report the link coming back:\n{}",
        lines1.join("\n")
    );

    // Connected and in sync again, the resync on record on both.
    for (m, role) in [(&m1, "source"), (&m2, "target")] {
        let s = wait_status(m, "connected and in sync", in_sync);
        assert_eq!(s["last_sync"]["role"], role, "{s:#}");
        assert_eq!(s["last_sync"]["completed"], true, "{s:#}");
        assert_eq!(s["last_sync"]["total_bytes"], 8 * MIB, "{s:#}");
    }
    let table = vsanctl_ok(&m2, &["status"]).stdout;
    assert!(
        table.contains("connected (peer 1)") && table.contains("in sync"),
        "{table}"
    );
    // With nothing running, `--no-wait` returns at once.
    let idle = vsanctl_ok(&m1, &["watch", DISK, "--no-wait"]);
    assert!(
        idle.stdout.contains("no resync or verify running"),
        "{idle}"
    );
    let idle = vsanctl_ok(&m1, &["watch", DISK, "--no-wait", "--json"]);
    let s: Value = serde_json::from_str(idle.stdout.trim()).expect("one JSON status");
    assert!(in_sync(&s), "{s:#}");

    qemu_io_reads(&n2.uri(DISK), &[w]);
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(&dir1, DISK), &image(&dir2, DISK));
}

/// A node restarted while its peer stays away: `status` (JSON, table, details) says its
/// replica is unproven and what it waits for, the metrics say so too, nothing is
/// served; `vsanctl declare-current` serves it (once; a second call is refused); the
/// peer's return needs no resync.
#[test]
fn an_unproven_replica_shows_in_status_and_declare_current_serves_it() {
    if !require_tool("qemu-io") {
        return;
    }
    let s1 = side(1, "\"8MiB\"");
    let s2 = side(2, "\"8MiB\"").node_lines(&format!("{MGMT}metrics = \"127.0.0.1:0\"\n"));
    let (dir1, dir2) = (TestDir::new("mgmt-fresh-n1"), TestDir::new("mgmt-fresh-n2"));
    let listen = free_loopback_addr();
    let n2 = start_acceptor(&dir2, &s2, &listen);
    let n1 = start_dialer(&dir1, &s1, n2.replication());
    wait_first_sync(&n1, &n2);
    let data = Region::new(0x3e, MIB, 64 * KIB);
    qemu_io_writes(&n1.uri(DISK), &[data]);
    stop_both_clean(n1, n2);

    let n2 = start_acceptor(&dir2, &s2, &listen);
    let m2 = mgmt_addr(&n2);
    let s = status_json(&m2, DISK);
    assert_eq!(s["freshness"], "unproven", "{s:#}");
    assert_eq!(s["freshness_proof"], Value::Null, "{s:#}");
    assert!(
        s["awaiting"]
            .as_str()
            .is_some_and(|a| a.contains("declare-current")),
        "{s:#}"
    );
    assert!(
        s["unproven_since_unix_ms"].as_u64().is_some_and(|t| t > 0),
        "{s:#}"
    );
    let table = vsanctl_ok(&m2, &["status"]).stdout;
    assert!(
        table.contains("SERVING") && table.contains("no: unproven"),
        "{table}"
    );
    let one = vsanctl_ok(&m2, &["status", DISK]).stdout;
    assert!(
        one.contains("UNPROVEN") && one.contains("declare-current"),
        "{one}"
    );
    let metrics = n2.wait_stdout(&["ready metrics="], EVENT_TIMEOUT);
    let maddr = common::field(&metrics, "metrics").expect("the metrics address");
    let body = http_get(&maddr, "/metrics");
    assert!(
        body.contains("vsan_mirror_replica_current{disk=\"vol0\",proof=\"none\"} 0"),
        "{body}"
    );
    let out = common::qemu_io(&n2.uri(DISK), &[data.read()]);
    assert!(
        !out.status.success() || out.text().to_lowercase().contains("error"),
        "an unproven replica was served:\n{out}"
    );

    let out = vsanctl_ok(&m2, &["declare-current", DISK]);
    assert!(out.stdout.contains("declared current"), "{out}");
    n2.wait_stdout(&["serving disk=vol0 proof=operator"], EVENT_TIMEOUT);
    let s = status_json(&m2, DISK);
    assert_eq!(s["freshness"], "current", "{s:#}");
    assert_eq!(s["freshness_proof"], "operator", "{s:#}");
    assert!(
        vsanctl_ok(&m2, &["status"])
            .stdout
            .contains("yes (operator)")
    );
    assert_node_error(
        &vsanctl(&m2, &["declare-current", DISK]),
        "FAILED_PRECONDITION",
        "proven current already",
    );
    qemu_io_reads(&n2.uri(DISK), &[data]);
    let body = http_get(&maddr, "/metrics");
    assert!(
        body.contains("vsan_mirror_replica_current{disk=\"vol0\",proof=\"operator\"} 1"),
        "{body}"
    );

    // The peer returns: in sync at once (node 2 served alone but wrote nothing).
    let n1 = start_dialer(&dir1, &s1, &listen);
    n1.wait_stdout(&["serving disk=vol0 proof=handshake"], EVENT_TIMEOUT);
    wait_status(&m2, "connected and in sync", in_sync);
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(&dir1, DISK), &image(&dir2, DISK));
}

/// `GET path` over plain HTTP/1.0; the body.
fn http_get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(TOOL_TIMEOUT)).expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("send");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read the answer");
    text.split_once("\r\n\r\n")
        .map_or(text.clone(), |(_, b)| b.to_string())
}

#[test]
fn split_brain_resolved_and_verified_through_vsanctl() {
    if !require_tool("qemu-io") {
        return;
    }
    let (dir1, dir2) = (TestDir::new("mgmt-sb-n1"), TestDir::new("mgmt-sb-n2"));
    let n2 = start_acceptor(&dir2, &side(2, "\"16MiB\""), "127.0.0.1:0");
    let target: SocketAddr = n2.replication().parse().expect("node 2's address");
    let link = Proxy::start(target);
    let n1 = start_dialer(&dir1, &side(1, "\"16MiB\""), &link.addr().to_string());
    wait_first_sync(&n1, &n2);
    let (m1, m2) = (mgmt_addr(&n1), mgmt_addr(&n2));

    // Apart, both write.
    link.cut();
    n1.wait_log(PEER_LOST, EVENT_TIMEOUT);
    n2.wait_log(PEER_LOST, EVENT_TIMEOUT);
    let x = Region::new(0x3c, 4 * MIB, 256 * KIB);
    let y = Region::new(0x4d, 6 * MIB, 256 * KIB);
    qemu_io_writes(&n1.uri(DISK), &[x]);
    qemu_io_writes(&n2.uri(DISK), &[y]);
    let skip2 = n2.stdout_lines().len();
    link.heal();
    n2.wait_stdout_after(skip2, &["problem disk=vol0", "split brain"], EVENT_TIMEOUT);
    for m in [&m1, &m2] {
        let s = wait_status(m, "the split brain", |s| {
            s["last_problem"]
                .as_str()
                .is_some_and(|p| p.contains("split brain"))
        });
        assert_ne!(s["link"], "connected", "{s:#}");
    }

    // Resolved through the API: node 2's changes go. A watch on node 2 is waiting
    // before, so it sees the resync however fast it is.
    let mut watch2 = Running::spawn(
        &m2,
        &["watch", DISK, "--interval-ms", "200", "--timeout", "60s"],
    );
    watch2.wait_line("waiting for a resync or verify to start", EVENT_TIMEOUT);
    let out = vsanctl_ok(&m2, &["discard-my-data", DISK]);
    assert!(out.stdout.contains("discarded"), "{out}");
    let (status, lines, err) = watch2.finish(Duration::from_secs(60));
    eprintln!("node 2's watch:\n{}\n{err}", lines.join("\n"));
    assert!(status.success(), "node 2's watch: {status}\n{err}");
    let done = lines
        .iter()
        .find(|l| l.contains("completed after"))
        .unwrap_or_else(|| panic!("no completed resync:\n{}", lines.join("\n")));
    assert!(done.contains("(target)"), "{done}");
    n1.wait_stdout(&[SYNC_DONE, "role=source", "kind=bitmap"], EVENT_TIMEOUT);
    for (m, role) in [(&m1, "source"), (&m2, "target")] {
        let s = wait_status(m, "connected and in sync", in_sync);
        assert_eq!(s["last_sync"]["role"], role, "{s:#}");
        assert!(
            s["last_sync"]["transferred_bytes"].as_u64() > Some(0),
            "{s:#}"
        );
    }
    // Node 1's X on both; node 2's Y gone (node 1 never wrote there: zeroes).
    let expect = [x, Region::new(0, y.offset, y.len)];
    qemu_io_reads(&n1.uri(DISK), &expect);
    qemu_io_reads(&n2.uri(DISK), &expect);

    // Verify from node 1: identical replicas, nothing found.
    let verify = [
        "verify",
        DISK,
        "--wait",
        "--interval-ms",
        "200",
        "--timeout",
        "60s",
    ];
    let out = vsanctl_ok(&m1, &verify);
    eprintln!("{out}");
    assert!(out.stdout.contains("online verify started"), "{out}");
    assert!(out.stdout.contains("verify (source) completed"), "{out}");
    assert!(out.stdout.contains(", 0 mismatches"), "{out}");
    let s = status_json(&m1, DISK);
    assert_eq!(s["last_sync"]["kind"], "verify", "{s:#}");
    assert_eq!(s["last_sync"]["mismatches"], 0, "{s:#}");

    // A slow verify (4 s at 4 MiB/s), watched and cancelled: the watch says it stopped
    // short and exits 1.
    vsanctl_ok(&m1, &["set-rate", DISK, "4MiB/s"]);
    let out = vsanctl_ok(&m1, &["verify", DISK]);
    assert!(out.stdout.contains("online verify started"), "{out}");
    let mut watch1 = Running::spawn(&m1, &["watch", DISK, "--interval-ms", "200"]);
    watch1.wait_line("verify started: this node is the source", EVENT_TIMEOUT);
    let out = vsanctl_ok(&m1, &["cancel-verify", DISK]);
    assert!(out.stdout.contains("online verify cancelled"), "{out}");
    let (status, lines, err) = watch1.finish(EVENT_TIMEOUT);
    eprintln!("the cancelled verify's watch:\n{}\n{err}", lines.join("\n"));
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("the verify stopped before it completed"),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("verify (source) stopped after"))
    );
    let s = status_json(&m1, DISK);
    assert_eq!(s["last_sync"]["kind"], "verify", "{s:#}");
    assert_eq!(s["last_sync"]["completed"], false, "{s:#}");
    assert_node_error(
        &vsanctl(&m1, &["cancel-verify", DISK]),
        "FAILED_PRECONDITION",
        "no verify from this node runs",
    );
    let out = vsanctl_ok(&m1, &["set-rate", DISK, "dynamic"]);
    assert!(out.stdout.contains("resync rate set to dynamic"), "{out}");
    wait_status(&m1, "connected and in sync", in_sync);

    // A block of node 2's replica changed behind its back: the verify finds that one
    // chunk and repairs it from node 1.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(image(&dir2, DISK))
            .expect("open node 2's image");
        f.write_all_at(&[0xee; 4096], 12 * MIB)
            .expect("change a block of node 2's image");
        f.sync_all().expect("sync node 2's image");
    }
    let out = vsanctl_ok(&m1, &verify);
    eprintln!("{out}");
    assert!(out.stdout.contains(", 1 mismatch (repaired"), "{out}");
    let out = vsanctl_ok(&m1, &verify);
    assert!(out.stdout.contains(", 0 mismatches"), "{out}");

    // Node 2's replica detached: its I/O goes through node 1; attached again, it is
    // resynced in full (by checksum) from node 1.
    let out = vsanctl_ok(&m2, &["detach", DISK]);
    eprintln!("{out}");
    let s = wait_status(&m2, "detached", |s| s["local_state"] == "detached");
    assert_eq!(s["link"], "connected", "{s:#}");
    assert_node_error(
        &vsanctl(&m2, &["detach", DISK]),
        "FAILED_PRECONDITION",
        "detached already",
    );
    let z = Region::new(0x5e, 8 * MIB, 512 * KIB);
    qemu_io_writes(&n2.uri(DISK), &[z]);
    qemu_io_reads(&n2.uri(DISK), &[z, x]);
    let mut watch2 = Running::spawn(
        &m2,
        &["watch", DISK, "--interval-ms", "200", "--timeout", "60s"],
    );
    watch2.wait_line("waiting for a resync or verify to start", EVENT_TIMEOUT);
    let out = vsanctl_ok(&m2, &["attach", DISK]);
    eprintln!("{out}");
    let (status, lines, err) = watch2.finish(Duration::from_secs(60));
    eprintln!("node 2's watch of the attach:\n{}\n{err}", lines.join("\n"));
    assert!(status.success(), "{err}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("checksum resync (target) completed")),
        "{}",
        lines.join("\n")
    );
    wait_status(&m2, "connected and in sync", in_sync);
    wait_status(&m1, "connected and in sync", in_sync);
    assert_node_error(
        &vsanctl(&m2, &["attach", DISK]),
        "FAILED_PRECONDITION",
        "is attached",
    );
    let expect = [x, Region::new(0, y.offset, y.len), z];

    // Verify needs the peer: from a cut-off node it is refused with the reason.
    link.cut();
    wait_status(&m1, "degraded", |s| s["link"] == "degraded");
    let out = vsanctl(&m1, &["verify", DISK]);
    assert_node_error(&out, "FAILED_PRECONDITION", "connected peer");
    link.heal();
    wait_status(&m1, "connected and in sync", in_sync);

    stop_both_clean(n1, n2);
    drop(link);
    let (img1, img2) = (image(&dir1, DISK), image(&dir2, DISK));
    assert_replicas_identical(&img1, &img2);
    assert_file_holds(&img2, &expect, "node 2's replica");
}

/// SetCacheMode on a cached disk: the status shows the new mode; an unspecified mode
/// is INVALID_ARGUMENT; a disk without a cache is FAILED_PRECONDITION.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_mode_set_through_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("vol0.cache");
    let n = node(
        dir.path(),
        "",
        &format!(
            "[[disk]]\nname = \"vol0\"\nsize = \"4MiB\"\n\n[disk.cache]\npath = {:?}\nsize = \"8MiB\"\n\n\
             [[disk]]\nname = \"plain\"\nsize = \"1MiB\"\nbacking = \"mem\"\n",
            cache.display().to_string()
        ),
    )
    .await;
    let mut c = client(&n).await;
    let mode = |s: &v1::DiskStatus| s.cache.as_ref().map(|c| c.mode);
    let s = c
        .get_disk_status(v1::DiskRequest {
            name: "vol0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&s), Some(v1::CacheMode::WriteBack as i32), "{s:?}");
    c.set_cache_mode(v1::SetCacheModeRequest {
        name: "vol0".into(),
        mode: v1::CacheMode::WriteThrough as i32,
    })
    .await
    .unwrap();
    let s = c
        .get_disk_status(v1::DiskRequest {
            name: "vol0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&s), Some(v1::CacheMode::WriteThrough as i32), "{s:?}");
    let e = c
        .set_cache_mode(v1::SetCacheModeRequest {
            name: "vol0".into(),
            mode: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = c
        .set_cache_mode(v1::SetCacheModeRequest {
            name: "plain".into(),
            mode: v1::CacheMode::WriteBack as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    n.shutdown().await.unwrap();
}
