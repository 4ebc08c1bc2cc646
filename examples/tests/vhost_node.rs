//! `vsan-node` with a vhost-user-blk socket (`vhost_user` in a `[[disk]]`), driven by
//! libblkio's own driver: the data reaches the NBD export and the mirror peer, status,
//! `vsanctl status` and the metrics show the front end and its queues, and flushed writes
//! survive `kill -9` of the peer and then of the serving node.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::mirror::{
    CONNECTED, Pair, Side, assert_replicas_identical, start_acceptor, start_dialer, start_pair,
};
use crate::common::vsanctl::{MGMT, code, mgmt_addr, vsanctl, vsanctl_ok};
use crate::common::{Node, Sig, TestDir, image, node_section, read_file_range, toml_str};
use vsan_core::export::nbd::Client;
use vsan_examples::pattern::{BLOCK, expected_block};
use vsan_examples::vhost_client::VhostClient;

const MIB: u64 = 1 << 20;
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);

fn socket(dir: &TestDir) -> PathBuf {
    dir.socket("vol0.vhost")
}

fn connect(path: &Path, queues: i32) -> VhostClient {
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        match VhostClient::connect(path, queues, 4 << 20) {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("connect to {}: {e}", path.display()),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Read `len` bytes at `offset` through the node's NBD export of vol0.
fn nbd_read(node: &Node, offset: u64, len: usize) -> Vec<u8> {
    rt().block_on(async {
        let c = Client::connect_tcp(node.addr("vol0"), "vol0")
            .await
            .expect("nbd connect");
        c.read(offset, len as u32).await.expect("nbd read").to_vec()
    })
}

#[test]
fn writes_through_vhost_user_read_back_through_nbd_and_show_in_status_and_metrics() {
    let dir = TestDir::new("vhost-node");
    let path = socket(&dir);
    let config = format!(
        "{}metrics = \"127.0.0.1:0\"\n{MGMT}\n[[disk]]\nname = \"vol0\"\nsize = \"64MiB\"\n\
         nbd = \"127.0.0.1:0\"\nvhost_user = {}\nvhost_user_queues = 2\n",
        node_section(&dir),
        toml_str(&path)
    );
    let node = Node::start(&dir, &config, &["vol0"]);
    let ready = node.wait_stdout(&["ready disk=vol0 vhost_user="], EVENT_TIMEOUT);
    assert!(ready.ends_with(&path.display().to_string()), "{ready}");

    let mut c = connect(&path, 2);
    assert_eq!(c.capacity(), 64 * MIB);
    for (i, len) in [4096usize, 65536, 1 << 20].into_iter().enumerate() {
        let off = i as u64 * 2 * MIB;
        let data = expected_block(i as u64, 1).repeat(len / BLOCK);
        c.write(off, &data).unwrap();
        c.flush().unwrap();
        assert_eq!(c.read(off, len).unwrap(), data);
        assert_eq!(
            nbd_read(&node, off, len),
            data,
            "NBD sees the write of {len}"
        );
    }
    // Many in flight on the second queue.
    for d in 0..32usize {
        let block = expected_block(100 + d as u64, 1);
        c.buf()[d * BLOCK..(d + 1) * BLOCK].copy_from_slice(&block);
        c.submit_write(1, 16 * MIB + (d * BLOCK) as u64, d * BLOCK, BLOCK, d);
    }
    let mut done = 0;
    while done < 32 {
        for (_, ret) in c.wait(1, 1).unwrap() {
            assert_eq!(ret, 0);
            done += 1;
        }
    }
    let want: Vec<u8> = (0..32u64)
        .flat_map(|d| expected_block(100 + d, 1))
        .collect();
    assert_eq!(nbd_read(&node, 16 * MIB, 32 * BLOCK), want);

    let mgmt = mgmt_addr(&node);
    let status = vsanctl_ok(&mgmt, &["status", "vol0"]).text();
    assert!(status.contains("front end connected"), "{status}");
    assert!(status.contains("queue 1:"), "{status}");
    let json = vsanctl_ok(&mgmt, &["--json", "status", "vol0"]).text();
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("json");
    let vu = &v["vhost_user"];
    assert_eq!(vu["connected"], true, "{v}");
    assert_eq!(vu["queues"][1]["writes"], 32, "{v}");
    assert_eq!(vu["queues"][0]["writes"], 3, "{v}");
    let line = node.wait_stdout(&["ready metrics="], EVENT_TIMEOUT);
    let addr = line.trim().trim_start_matches("ready metrics=");
    let metrics = ureq::get(&format!("http://{addr}/metrics"))
        .call()
        .expect("GET /metrics")
        .body_mut()
        .read_to_string()
        .expect("metrics body");
    assert!(
        metrics.contains("vsan_vhost_user_writes_total{disk=\"vol0\",queue=\"1\"} 32"),
        "{metrics}"
    );
    assert!(metrics.contains("vsan_vhost_user_connected{disk=\"vol0\"} 1"));

    // A front end that goes away and another that comes: served.
    drop(c);
    let mut c = connect(&path, 1);
    assert_eq!(c.read(0, 4096).unwrap(), expected_block(0, 1));
    drop(c);
    let stopped = node.stop_clean(Sig::TERM);
    assert!(!path.exists(), "the socket is removed at shutdown");
    let img = image(&dir, "vol0");
    assert_eq!(read_file_range(&img, 16 * MIB, 32 * BLOCK), want);
    drop(stopped);
}

/// `vsanctl create --vhost-user`: a path that is a file (here the other disk's image),
/// a socket another server answers on, or bad queue counts are refused with nothing
/// made; the disk created serves its socket, shows in status, and `delete` removes the
/// socket.
#[test]
fn a_disk_created_through_vsanctl_serves_vhost_user_and_delete_removes_its_socket() {
    let dir = TestDir::new("vhost-create");
    let path0 = socket(&dir);
    let config = format!(
        "{}{MGMT}\n[[disk]]\nname = \"vol0\"\nsize = \"4MiB\"\nvhost_user = {}\n",
        node_section(&dir),
        toml_str(&path0)
    );
    // (vol0 has no NBD address: the node's ready line for it is its socket's.)
    let node = Node::start(&dir, &config, &[]);
    node.wait_stdout(&["ready disk=vol0 vhost_user="], EVENT_TIMEOUT);
    let mgmt = mgmt_addr(&node);
    let img0 = image(&dir, "vol0");
    let before = std::fs::read(&img0).unwrap();
    let path1 = dir.socket("vol1.vhost");
    let (img0_s, path0_s, path1_s) = (
        img0.to_str().unwrap(),
        path0.to_str().unwrap(),
        path1.to_str().unwrap(),
    );
    let create = ["create", "vol1", "--size", "4MiB", "--backing", "mem"];
    for (extra, exit, needle) in [
        (vec!["--vhost-user", img0_s], 1, "not a socket"),
        (vec!["--vhost-user", path0_s], 1, "another server listens"),
        (
            vec!["--vhost-user", path1_s, "--vhost-user-queues", "0"],
            2,
            "not in 1..=64",
        ),
        (
            vec![
                "--vhost-user",
                path1_s,
                "--vhost-user-busy-poll-us",
                "5000000",
            ],
            1,
            "over 1000000",
        ),
        (vec!["--vhost-user-queues", "2"], 2, "--vhost-user"),
    ] {
        let args: Vec<&str> = create.iter().copied().chain(extra).collect();
        let out = vsanctl(&mgmt, &args);
        assert_eq!(code(&out), exit, "{args:?}: {out}");
        assert!(out.stderr.contains(needle), "{args:?}: {out}");
    }
    assert_eq!(
        std::fs::read(&img0).unwrap(),
        before,
        "vol0's image untouched"
    );
    assert!(!path1.exists(), "nothing bound for a refused creation");
    let list = vsanctl_ok(&mgmt, &["--json", "status"]).text();
    assert!(!list.contains("vol1"), "no vol1 after the refusals: {list}");

    let args: Vec<&str> = create
        .iter()
        .copied()
        .chain(["--vhost-user", path1_s, "--vhost-user-queues", "2"])
        .collect();
    vsanctl_ok(&mgmt, &args);
    let mut c = connect(&path1, 2);
    assert_eq!(c.capacity(), 4 * MIB);
    let data = expected_block(7, 1).repeat(16);
    c.write(MIB, &data).unwrap();
    c.flush().unwrap();
    drop(c);
    let mut c = connect(&path1, 2);
    assert_eq!(c.read(MIB, data.len()).unwrap(), data);
    drop(c);
    let json = vsanctl_ok(&mgmt, &["--json", "status", "vol1"]).text();
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("json");
    assert_eq!(v["vhost_user"]["socket"], path1_s, "{v}");
    assert_eq!(
        v["vhost_user"]["queues"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    assert!(
        v["vhost_user"]["queues"][0]["writes"].as_u64() > Some(0),
        "{v}"
    );

    vsanctl_ok(&mgmt, &["delete", "vol1"]);
    assert!(!path1.exists(), "delete removes the socket");
    assert!(path0.exists(), "vol0's socket stays");
    node.stop_clean(Sig::TERM);
}

/// A mirrored pair of `size` with vhost-user on node 1 (its socket in a directory of its
/// own), started and through its first sync.
struct VhostPair {
    _sock_dir: TestDir,
    path: PathBuf,
    s1: Side,
    s2: Side,
    pair: Pair,
}

fn vhost_pair(tag: &str, size: &'static str, timeout_ms: u64) -> VhostPair {
    let sock_dir = TestDir::new(&format!("{tag}-sock"));
    let path = socket(&sock_dir);
    let disk_lines = format!("vhost_user = {}\n", toml_str(&path));
    let s1 = Side::new(1, "vol0", size)
        .timeout(timeout_ms)
        .disk_lines(&disk_lines);
    let s2 = Side::new(2, "vol0", size).timeout(timeout_ms);
    let pair = start_pair(tag, &s1, &s2);
    pair.n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    pair.n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    pair.n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    VhostPair {
        _sock_dir: sock_dir,
        path,
        s1,
        s2,
        pair,
    }
}

#[test]
fn a_mirrored_disk_under_vhost_user_writes_keeps_every_flushed_write_through_kill_9_of_both() {
    let VhostPair {
        _sock_dir,
        path,
        s1,
        s2,
        pair:
            Pair {
                dir1,
                dir2,
                n1,
                n2,
                listen,
            },
    } = vhost_pair("vhost-mirror", "\"64MiB\"", 1000);
    let mut c = connect(&path, 1);

    // Round 1, mirrored: generation 1 of blocks 0..64, flushed; the peer's NBD export
    // reads them.
    let write_round = |c: &mut VhostClient, generation: u32, blocks: std::ops::Range<u64>| {
        for b in blocks {
            c.write(b * BLOCK as u64, &expected_block(b, generation))
                .unwrap_or_else(|e| panic!("write of block {b} gen {generation}: {e}"));
        }
        c.flush().expect("flush");
    };
    write_round(&mut c, 1, 0..64);
    for b in [0u64, 31, 63] {
        assert_eq!(
            nbd_read(&n2, b * BLOCK as u64, BLOCK),
            expected_block(b, 1),
            "the peer reads block {b}"
        );
    }
    // kill -9 of the peer; writes through vhost-user go on alone (after the peer
    // timeout), flushed.
    n2.stop(Sig::KILL);
    write_round(&mut c, 2, 32..96);
    // kill -9 of the serving node with the front end connected.
    n1.stop(Sig::KILL);
    drop(c);
    // Restart both: the survivor's newer data resyncs to the peer.
    let n2 = start_acceptor(&dir2, &s2, &listen);
    let n1 = start_dialer(&dir1, &s1, &listen);
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    let mut c = connect(&path, 1);
    for b in 0..96u64 {
        let want = expected_block(b, if b < 32 { 1 } else { 2 });
        assert_eq!(
            c.read(b * BLOCK as u64, BLOCK).unwrap(),
            want,
            "block {b} via vhost-user"
        );
    }
    drop(c);
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    let (i1, i2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    for b in 0..96u64 {
        let want = expected_block(b, if b < 32 { 1 } else { 2 });
        assert_eq!(
            read_file_range(&i2, b * BLOCK as u64, BLOCK),
            want,
            "node 2 block {b}"
        );
    }
    assert_replicas_identical(&i1, &i2);
}

#[test]
fn a_restarted_node_answers_nothing_over_vhost_user_until_its_replica_is_proven_current() {
    // A peer timeout long enough for the peer to come back while the read waits.
    let VhostPair {
        _sock_dir,
        path,
        s1,
        s2,
        pair:
            Pair {
                dir1,
                dir2,
                n1,
                n2,
                listen,
            },
    } = vhost_pair("vhost-fresh", "\"32MiB\"", 15_000);
    let mut c = connect(&path, 1);
    c.write(0, &expected_block(0, 1)).unwrap();
    c.flush().unwrap();
    drop(c);
    // Node 1 dies; node 2 goes on alone and writes generation 2, then stops.
    n1.stop(Sig::KILL);
    rt().block_on(async {
        let c = Client::connect_tcp(n2.addr("vol0"), "vol0")
            .await
            .expect("nbd");
        c.write(0, &expected_block(0, 2), true)
            .await
            .expect("write alone");
    });
    n2.stop_clean(Sig::TERM);
    // Node 1 restarts with a stale replica and no peer: a read through vhost-user waits
    // (its replica holds generation 1, which must never be answered).
    let n1 = start_dialer(&dir1, &s1, &listen);
    n1.wait_stdout(&["unproven disk=vol0"], EVENT_TIMEOUT);
    let reader_path = path.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut c = connect(&reader_path, 1);
        let _ = tx.send(c.read(0, BLOCK));
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(1500)).is_err(),
        "an unproven replica answered a vhost-user read"
    );
    // The peer returns: the handshake makes node 1 the resync target, and the waiting
    // read is answered with the newest data.
    let n2 = start_acceptor(&dir2, &s2, &listen);
    let got = rx
        .recv_timeout(EVENT_TIMEOUT)
        .expect("the read was answered once the peer came back")
        .expect("the read succeeded");
    assert_eq!(got, expected_block(0, 2), "the read saw the newest data");
    reader.join().unwrap();
    n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}
