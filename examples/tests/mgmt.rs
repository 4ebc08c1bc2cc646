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
//! - bad input: an unknown disk, an empty name, a size that is not one, a wrong or
//!   missing token, garbage and HTTP/1 on the port, a malformed protobuf: each gets its
//!   gRPC code (or exit 2 before anything is sent) and the node keeps serving;
//! - TLS: `--tls-ca` with a CA that signed the node's certificate, and without.
//!
//! Node 1 (the lower id) dials, node 2 listens. A missing qemu-io (or openssl, for TLS)
//! skips a test with a `SKIP:` line, or fails it when `VSAN_REQUIRE_INTEROP=1`.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::mirror::{
    CONNECTED, Side, assert_replicas_identical, free_loopback_addr, start_acceptor, start_dialer,
    stop_both_clean,
};
use common::proxy::Proxy;
use common::{
    Node, ProcessGuard, Region, Sig, TOOL_TIMEOUT, TestDir, ToolOutput, assert_file_holds, image,
    line_channel, qemu_io_reads, qemu_io_writes, require_tool, run_command, toml_str,
};
use serde_json::Value;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
const DISK: &str = "vol0";
const VSANCTL: &str = env!("CARGO_BIN_EXE_vsanctl");
/// The `[node]` line that turns the management service on.
const MGMT: &str = "mgmt = \"127.0.0.1:0\"\n";
/// How long something the nodes will do may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// Short, so a killed or cut-off peer is given up quickly.
const PEER_TIMEOUT_MS: u64 = 1000;
const SYNC_DONE: &str = "sync disk=vol0 done";
const PEER_LOST: &str = "peer lost";

// ----- running vsanctl -----

/// `vsanctl --node <node> args...` with `env` set (and the caller's VSAN_MGMT* unset).
fn vsanctl_cmd(node: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(VSANCTL);
    if let Some(n) = node {
        cmd.arg("--node").arg(n);
    }
    cmd.args(args)
        .env_remove("VSAN_MGMT")
        .env_remove("VSAN_MGMT_TOKEN")
        .envs(env.iter().copied());
    cmd
}

/// Run vsanctl to its end.
fn vsanctl(node: &str, args: &[&str]) -> ToolOutput {
    run_command(vsanctl_cmd(Some(node), args, &[]), TOOL_TIMEOUT)
}

/// Run vsanctl and require exit 0.
fn vsanctl_ok(node: &str, args: &[&str]) -> ToolOutput {
    let out = vsanctl(node, args);
    out.assert_success();
    out
}

/// vsanctl's exit code (panics on a signal).
fn code(out: &ToolOutput) -> i32 {
    out.status
        .code()
        .unwrap_or_else(|| panic!("vsanctl died of a signal:\n{out}"))
}

/// Require exit 1 with `vsanctl: <CODE>: ...<message>` on stderr; returns that line.
fn assert_node_error(out: &ToolOutput, grpc_code: &str, message: &str) -> String {
    assert_eq!(code(out), 1, "expected exit 1 ({grpc_code}):\n{out}");
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("vsanctl: "))
        .unwrap_or_else(|| panic!("no `vsanctl: ` line on stderr:\n{out}"));
    assert!(
        line.starts_with(&format!("vsanctl: {grpc_code}: ")) && line.contains(message),
        "expected `vsanctl: {grpc_code}: ...{message}...`:\n{out}"
    );
    line.to_string()
}

/// Require exit 2 (bad usage) with `needle` on stderr.
fn assert_usage_error(out: &ToolOutput, needle: &str) {
    assert_eq!(code(out), 2, "expected exit 2 (usage):\n{out}");
    assert!(
        out.stderr.contains(needle),
        "no {needle:?} on stderr:\n{out}"
    );
}

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

/// The management address a node printed (`ready mgmt=<addr>`).
fn mgmt_addr(node: &Node) -> String {
    let line = node.wait_stdout(&["ready mgmt="], EVENT_TIMEOUT);
    common::field(&line, "mgmt").unwrap_or_else(|| panic!("no address in {line:?}"))
}

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

/// A node with a token, a local disk and a cached one (nothing mirrored).
fn start_token_node(dir: &TestDir, token_lines: &str) -> (Node, String) {
    let config = format!(
        "[node]\nid = 1\ndata_dir = {}\n{MGMT}{token_lines}\n\
         [[disk]]\nname = \"vol0\"\nsize = \"4MiB\"\nnbd = \"127.0.0.1:0\"\n\n\
         [[disk]]\nname = \"fast\"\nsize = \"4MiB\"\nnbd = \"127.0.0.1:0\"\n\
         [disk.cache]\npath = {}\nsize = \"1MiB\"\n",
        toml_str(dir.data_dir()),
        toml_str(dir.join("fast.cache")),
    );
    let node = Node::start(dir, &config, &[DISK, "fast"]);
    let m = mgmt_addr(&node);
    (node, m)
}

/// Raw gRPC: a request body sent as given, the answer's bytes returned as they come.
mod raw {
    use bytes::{Buf, BufMut, Bytes};
    use tonic::Status;
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    #[derive(Debug, Clone, Copy, Default)]
    pub struct RawCodec;

    impl Codec for RawCodec {
        type Encode = Bytes;
        type Decode = Bytes;
        type Encoder = RawCodec;
        type Decoder = RawCodec;
        fn encoder(&mut self) -> RawCodec {
            RawCodec
        }
        fn decoder(&mut self) -> RawCodec {
            RawCodec
        }
    }

    impl Encoder for RawCodec {
        type Item = Bytes;
        type Error = Status;
        fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
            dst.put(item);
            Ok(())
        }
    }

    impl Decoder for RawCodec {
        type Item = Bytes;
        type Error = Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
            Ok(Some(src.copy_to_bytes(src.remaining())))
        }
    }
}

/// Send `body` (not necessarily a valid message) to `method` of the node's service.
async fn raw_call(
    addr: &str,
    token: &str,
    method: &'static str,
    body: Vec<u8>,
) -> Result<bytes::Bytes, tonic::Status> {
    use tonic::codegen::http::uri::PathAndQuery;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("an address")
        .connect()
        .await
        .expect("connect to the management service");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("the channel is ready");
    let mut req = tonic::Request::new(bytes::Bytes::from(body));
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("an ASCII token"),
    );
    grpc.unary(req, PathAndQuery::from_static(method), raw::RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// Write `bytes` on a fresh connection to `addr` and read until the node closes it;
/// what it answered. Panics if it neither answers nor closes within 10 s.
fn send_raw(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connect to the management port");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    // The node may close before it has read everything: a reset is an answer too.
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the node neither answered nor closed the connection: {e}"),
    }
    got
}

#[test]
fn bad_input_gets_its_grpc_code_and_the_node_keeps_serving() {
    const TOKEN: &str = "s3cret-token";
    let dir = TestDir::new("mgmt-bad");
    let (node, m) = start_token_node(&dir, &format!("mgmt_token = \"{TOKEN}\"\n"));
    let with_token = |args: &[&str]| {
        let mut a = vec!["--token", TOKEN];
        a.extend_from_slice(args);
        vsanctl(&m, &a)
    };

    // Tokens: missing, wrong, right (as an option, a file, the environment).
    let out = vsanctl(&m, &["status"]);
    assert_node_error(&out, "UNAUTHENTICATED", "requires a bearer token");
    let out = vsanctl(&m, &["--token", "s3cret-tokem", "status"]);
    assert_node_error(&out, "UNAUTHENTICATED", "wrong bearer token");
    with_token(&["status"]).assert_success();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("write the token file");
    let tf = token_file.to_str().expect("a UTF-8 path");
    vsanctl_ok(&m, &["--token-file", tf, "list"]);
    let env = [("VSAN_MGMT", m.as_str()), ("VSAN_MGMT_TOKEN", TOKEN)];
    let out = run_command(vsanctl_cmd(None, &["list"], &env), TOOL_TIMEOUT);
    out.assert_success();
    assert_eq!(out.stdout, "vol0\nfast\n", "{out}");

    // Unknown disk, empty name: the node's code and message, exit 1.
    let line = assert_node_error(&with_token(&["status", "nope"]), "NOT_FOUND", "");
    assert_eq!(line, "vsanctl: NOT_FOUND: node 1 has no disk \"nope\"");
    assert_node_error(
        &with_token(&["status", ""]),
        "INVALID_ARGUMENT",
        "a disk name is required",
    );
    assert_node_error(&with_token(&["delete", "nope"]), "NOT_FOUND", "\"nope\"");
    assert_node_error(
        &with_token(&["create", DISK, "--size", "1MiB"]),
        "ALREADY_EXISTS",
        "\"vol0\"",
    );
    // Actions that need a mirror or a cache, on a disk without.
    for args in [
        &["discard-my-data", DISK][..],
        &["verify", DISK],
        &["cancel-verify", DISK],
        &["set-rate", DISK, "40MiB"],
        &["detach", DISK],
        &["attach", DISK],
    ] {
        assert_node_error(&with_token(args), "FAILED_PRECONDITION", "is not mirrored");
    }
    assert_node_error(
        &with_token(&["cache-mode", DISK, "write-through"]),
        "FAILED_PRECONDITION",
        "has no cache",
    );
    // The cached disk switches modes.
    let out = with_token(&["--json", "cache-mode", "fast", "write-through"]);
    out.assert_success();
    let said: Value = serde_json::from_str(&out.stdout).expect("a JSON answer");
    assert!(
        said["message"].as_str().is_some_and(|m| m.contains("fast")),
        "{out}"
    );
    // Nothing to watch on a disk without a mirror.
    let out = with_token(&["watch", DISK]);
    assert_eq!(code(&out), 1, "{out}");
    assert!(out.stderr.contains("vol0 is not mirrored"), "{out}");
    let s: Value = serde_json::from_str(&with_token(&["status", "fast", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(s["cache"]["mode"], "write-through", "{s:#}");
    assert_eq!(s["cache"]["state"], "running", "{s:#}");
    assert_eq!(s["link"], "local", "{s:#}");
    assert_eq!(s["mirrored"], false, "{s:#}");

    // A disk made and removed at run time; bad names and sizes refused.
    let out = with_token(&[
        "create",
        "x",
        "--size",
        "1MiB",
        "--backing",
        "mem",
        "--nbd",
        "127.0.0.1:0",
    ]);
    out.assert_success();
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("x ") && l.contains("local")),
        "{out}"
    );
    let s: Value = serde_json::from_str(&with_token(&["status", "x", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(s["size"], MIB, "{s:#}");
    assert_eq!(s["link"], "local", "{s:#}");
    let nbd = s["nbd"]
        .as_str()
        .unwrap_or_else(|| panic!("x is not exported: {s:#}"))
        .to_string();
    assert_eq!(with_token(&["list"]).stdout, "vol0\nfast\nx\n");
    if require_tool("qemu-io") {
        let r = Region::new(0x42, 0, 64 * KIB);
        qemu_io_writes(&format!("nbd://{nbd}/x"), &[r]);
        qemu_io_reads(&format!("nbd://{nbd}/x"), &[r]);
    }
    let out = with_token(&["delete", "x"]);
    out.assert_success();
    assert!(out.stdout.contains("deleted"), "{out}");
    assert_node_error(&with_token(&["status", "x"]), "NOT_FOUND", "\"x\"");
    assert_node_error(
        &with_token(&["create", "y", "--size", "1000"]),
        "INVALID_ARGUMENT",
        "not a positive multiple of the block size",
    );
    assert_node_error(
        &with_token(&["create", "bad name", "--size", "1MiB"]),
        "INVALID_ARGUMENT",
        "is not a disk name",
    );
    assert_node_error(
        &with_token(&["create", "y", "--size", "1MiB", "--nbd", "nowhere"]),
        "INVALID_ARGUMENT",
        "nbd",
    );

    // Bad usage: exit 2, nothing sent.
    assert_usage_error(&with_token(&["create", "x", "--size", "banana"]), "banana");
    assert_usage_error(&with_token(&["create", "x", "--size", "0"]), "--size");
    assert_usage_error(&with_token(&["set-rate", DISK, "fast"]), "dynamic");
    assert_usage_error(
        &with_token(&["cache-mode", DISK, "sometimes"]),
        "write-back",
    );
    assert_usage_error(&with_token(&["frobnicate"]), "frobnicate");
    assert_usage_error(&vsanctl(&m, &[]), "Usage");
    assert_usage_error(
        &vsanctl(&m, &["--token-file", "/nonexistent/token", "list"]),
        "/nonexistent/token",
    );
    assert_usage_error(
        &vsanctl(&m, &["--token", TOKEN, "--tls-domain", "x", "list"]),
        "--tls-ca",
    );
    // A node nobody serves: exit 1, said plainly.
    let out = vsanctl("127.0.0.1:1", &["status"]);
    assert_eq!(code(&out), 1, "{out}");
    assert!(
        out.stderr
            .contains("cannot reach the node at http://127.0.0.1:1"),
        "{out}"
    );

    // Not gRPC at all: garbage, HTTP/1. The node closes the connection.
    let garbage: Vec<u8> = (0..65536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    send_raw(&m, &garbage);
    let answer = send_raw(
        &m,
        b"GET /vsan.mgmt.v1.Mgmt/ListDisks HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    eprintln!("HTTP/1 answer: {:?}", String::from_utf8_lossy(&answer));
    // gRPC with a malformed message, an unknown method, a message over the limit, and
    // (typed) a CreateDisk of size 0.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        let get = "/vsan.mgmt.v1.Mgmt/GetDiskStatus";
        let e = raw_call(&m, TOKEN, get, vec![0xff, 0xff, 0xff, 0xff])
            .await
            .expect_err("a malformed message was accepted");
        eprintln!("malformed message: {e:?}");
        assert!(
            e.code() == tonic::Code::InvalidArgument && e.message().contains("malformed"),
            "{e:?}"
        );
        let e = raw_call(&m, TOKEN, "/vsan.mgmt.v1.Mgmt/Frobnicate", vec![])
            .await
            .expect_err("an unknown method answered");
        assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
        // Field 1 (name) as a 5 MiB string.
        let mut big = vec![0x0a, 0x80, 0x80, 0xc0, 0x02];
        big.resize(big.len() + 5 * MIB as usize, b'a');
        let e = raw_call(&m, TOKEN, get, big)
            .await
            .expect_err("a 5 MiB message was accepted");
        eprintln!("5 MiB message: {e:?}");
        assert!(
            matches!(
                e.code(),
                tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
            ),
            "{e:?}"
        );
        // The token is checked before the message is read.
        let e = raw_call(&m, "wrong", get, vec![0x0a, 0x04, b'v', b'o', b'l', b'0'])
            .await
            .expect_err("a wrong token was let in");
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
        let ok = raw_call(&m, TOKEN, get, vec![0x0a, 0x04, b'v', b'o', b'l', b'0'])
            .await
            .expect("a well-formed raw request");
        assert!(!ok.is_empty());

        use vsan_replica::mgmt::AddToken;
        use vsan_replica::mgmt::v1;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{m}"))
            .expect("an address")
            .connect()
            .await
            .expect("connect");
        let mut client = v1::mgmt_client::MgmtClient::with_interceptor(
            channel,
            AddToken::new(Some(TOKEN)).expect("an ASCII token"),
        );
        let e = client
            .create_disk(v1::CreateDiskRequest {
                name: "x".into(),
                size: 0,
                ..Default::default()
            })
            .await
            .expect_err("a disk of size 0 was created");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("size 0"), "{e:?}");
        let e = client
            .set_cache_mode(v1::SetCacheModeRequest {
                name: "fast".into(),
                mode: 77,
            })
            .await
            .expect_err("cache mode 77 was taken");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("not a cache mode"), "{e:?}");
        let e = client
            .watch_disk_status(v1::WatchRequest {
                name: "nope".into(),
                interval_ms: 0,
            })
            .await
            .expect_err("a watch of no disk");
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    });

    // After all of it the node still answers, over the API and over NBD.
    let s: Value = serde_json::from_str(&with_token(&["status", "--json"]).stdout)
        .expect("status --json is JSON");
    assert_eq!(s["disks"].as_array().map(Vec::len), Some(2), "{s:#}");
    if require_tool("qemu-io") {
        let r = Region::new(0x77, MIB, 64 * KIB);
        qemu_io_writes(&node.uri_named(DISK), &[r]);
        qemu_io_reads(&node.uri_named(DISK), &[r]);
    }
    let log = node.log();
    assert!(!log.contains("panicked"), "the node panicked:\n{log}");
    node.stop_clean(Sig::TERM);
}

/// `openssl args...`, required to succeed.
fn openssl(dir: &TestDir, args: &[&str]) {
    let mut cmd = Command::new("openssl");
    cmd.args(args).current_dir(dir.path());
    run_command(cmd, TOOL_TIMEOUT).assert_success();
}

#[test]
fn tls_with_the_nodes_ca_and_a_token() {
    if !require_tool("openssl") {
        return;
    }
    let dir = TestDir::new("mgmt-tls");
    // A CA, and a certificate for 127.0.0.1 it signs; another CA that signed nothing.
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    for ca in ["ca", "other"] {
        let (key, pem, subj) = (
            format!("{ca}.key"),
            format!("{ca}.pem"),
            format!("/CN=vsan test {ca}"),
        );
        let mut a = vec!["req", "-x509"];
        a.extend(ec);
        a.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subj]);
        openssl(&dir, &a);
    }
    let mut a = vec!["req"];
    a.extend(ec);
    a.extend([
        "-keyout",
        "node.key",
        "-out",
        "node.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    openssl(&dir, &a);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName = IP:127.0.0.1, DNS:localhost\nbasicConstraints = CA:FALSE\n",
    )
    .expect("write ext.cnf");
    openssl(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "node.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "node.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
    let lines = format!(
        "mgmt_token = \"tls-token\"\nmgmt_cert = {}\nmgmt_key = {}\n",
        toml_str(dir.join("node.pem")),
        toml_str(dir.join("node.key"))
    );
    let (node, m) = start_token_node(&dir, &lines);
    let ca = dir.join("ca.pem");
    let ca = ca.to_str().expect("a UTF-8 path");
    let other = dir.join("other.pem");
    let other = other.to_str().expect("a UTF-8 path");

    let out = vsanctl_ok(&m, &["--tls-ca", ca, "--token", "tls-token", "list"]);
    assert_eq!(out.stdout, "vol0\nfast\n", "{out}");
    let https = format!("https://{m}");
    vsanctl_ok(&https, &["--tls-ca", ca, "--token", "tls-token", "status"]);
    let localhost = m.replace("127.0.0.1", "localhost");
    vsanctl_ok(
        &localhost,
        &["--tls-ca", ca, "--token", "tls-token", "list"],
    );
    // The token is still required under TLS.
    let out = vsanctl(&m, &["--tls-ca", ca, "status"]);
    assert_node_error(&out, "UNAUTHENTICATED", "bearer token");
    // A CA that did not sign the node's certificate, or no TLS at all: refused, exit 1.
    let out = vsanctl(&m, &["--tls-ca", other, "--token", "tls-token", "status"]);
    assert_eq!(code(&out), 1, "{out}");
    eprintln!("wrong CA: {}", out.stderr.trim());
    let out = vsanctl(&m, &["--token", "tls-token", "status"]);
    assert_eq!(code(&out), 1, "{out}");
    assert!(out.stderr.contains("--tls-ca"), "no hint at TLS:\n{out}");
    eprintln!("no TLS: {}", out.stderr.trim());
    // https without a CA to check it with is a usage error.
    assert_usage_error(&vsanctl(&https, &["status"]), "--tls-ca");
    vsanctl_ok(
        &m,
        &["--tls-ca", ca, "--token", "tls-token", "status", DISK],
    );
    node.stop_clean(Sig::TERM);
}
