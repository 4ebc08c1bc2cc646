//! The mirror's acceptance run on every replication transport, with real `vsan-node`
//! processes and real NBD clients: loopback (two processes over shared memory), quic
//! (mutual TLS with pinned self-signed certificates), tcp with a shared secret, tcp with
//! four lanes, and rdma requested (no RDMA device here: it falls back to tcp and says
//! so). Each run: qemu-io writes on one node read back on the other, fio verify on both
//! exports at once, an overlap hammer from both nodes, replicas byte-identical, then a
//! restart and a `kill -9` of node 2 during verified writes that node 1 survives.
//!
//! Then the refusals: a wrong shared secret, a wrong pinned certificate, and plaintext
//! clients on the QUIC port are refused with a clear message on the nodes, which keep
//! serving their own clients.
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::thread;
use std::time::{Duration, Instant};

use common::fio::{assert_fio_clean, fio, s};
use common::mirror::{
    CONNECTED, Pair, Side, assert_replicas_identical, start_acceptor, start_dialer,
    start_pair_with, stop_both_clean,
};
use common::{
    Region, Sig, TestDir, image, qemu_io_flush, qemu_io_reads, qemu_io_writes, require_tool,
};
use vsan_replica::transport::quic::Identity;

const MIB: u64 = 1 << 20;
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
const FIO_TIMEOUT: Duration = Duration::from_secs(90);
const DISK: &str = "vol0";
/// How long the overlap hammer runs per transport.
const HAMMER_SECS: u64 = 4;

/// Certificates for both nodes made before they start (in their data dirs, where
/// `vsan-node` looks by default), and each side pinning the other's.
fn quic_sides(dir1: &TestDir, dir2: &TestDir) -> (Side, Side) {
    let mut fp = Vec::new();
    for (id, dir) in [(1, dir1), (2, dir2)] {
        let data = dir.data_dir();
        std::fs::create_dir_all(&data).expect("data dir");
        let identity = Identity::load_or_generate(
            data.join(format!("node-{id}.crt")),
            data.join(format!("node-{id}.key")),
            &format!("vsan-node-{id}"),
        )
        .expect("identity");
        fp.push(identity.fingerprint().to_string());
    }
    (
        side(1).transport("quic", &format!("peer_fingerprint = \"{}\"\n", fp[1])),
        side(2).transport("quic", &format!("peer_fingerprint = \"{}\"\n", fp[0])),
    )
}

fn side(id: u32) -> Side {
    Side::new(id, DISK, "\"32MiB\"").timeout(1000)
}

/// Starts the pair and waits until both mirror over `transport` and the first sync is
/// done.
fn start(tag: &str, s1: &Side, s2: &Side, transport: &str) -> Pair {
    let pair = start_pair_with(tag, s1, s2, |_, _| {});
    wait_mirroring(&pair.n1, &pair.n2, transport);
    pair
}

fn wait_mirroring(n1: &common::Node, n2: &common::Node, transport: &str) {
    let line = format!("link disk={DISK} connected transport={transport}");
    for n in [n1, n2] {
        n.wait_log(CONNECTED, EVENT_TIMEOUT);
        n.wait_stdout(&[&line], EVENT_TIMEOUT);
    }
}

/// The acceptance run (see the module docs) on a started pair.
fn acceptance(pair: Pair, s1: &Side, s2: &Side, transport: &str) {
    if !require_tool("fio") || !require_tool("qemu-io") {
        return;
    }
    let Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    } = pair;
    let done = format!("sync disk={DISK} done");
    n1.wait_stdout(&[&done], EVENT_TIMEOUT);
    n2.wait_stdout(&[&done], EVENT_TIMEOUT);

    // qemu-io across the nodes, both ways.
    let (uri1, uri2) = (n1.uri(DISK), n2.uri(DISK));
    let from1 = [
        Region::new(0xa5, 0, MIB),
        Region::new(0x3c, MIB + 4608, 7680),
    ];
    qemu_io_writes(&uri1, &from1);
    qemu_io_reads(&uri2, &from1);
    let from2 = [Region::new(0x5b, 3 * MIB, MIB)];
    qemu_io_writes(&uri2, &from2);
    qemu_io_reads(&uri1, &from2);

    // fio verify on both exports at once, on disjoint halves.
    let half = 16 * MIB;
    let jobs: Vec<_> = [(&n1, &dir1, 0), (&n2, &dir2, half)]
        .into_iter()
        .map(|(node, dir, offset)| {
            let (uri, dir) = (node.uri(DISK), dir.path().to_path_buf());
            let args = vec![
                format!("--name=half{offset}"),
                "--rw=randwrite".into(),
                "--bs=4k".into(),
                "--iodepth=16".into(),
                format!("--offset={offset}"),
                "--size=8M".into(),
                "--verify=crc32c".into(),
                "--do_verify=1".into(),
                "--verify_fatal=1".into(),
            ];
            thread::spawn(move || fio(&dir, &uri, &args, FIO_TIMEOUT))
        })
        .collect();
    for job in jobs {
        let out = job.join().expect("fio thread");
        assert_fio_clean(&out);
        assert!(
            out.text().contains("issued rwts: total=2048,2048,"),
            "fio did not verify every block it wrote:\n{out}"
        );
    }

    // The overlap hammer: both nodes write the same 8 MiB at once.
    let jobs: Vec<_> = [(&n1, &dir1, 1), (&n2, &dir2, 2)]
        .into_iter()
        .map(|(node, dir, seed)| {
            let (uri, dir) = (node.uri(DISK), dir.path().to_path_buf());
            let args = vec![
                format!("--name=hammer{seed}"),
                "--rw=randwrite".into(),
                "--bssplit=4k/60:16k/30:64k/10".into(),
                "--iodepth=16".into(),
                "--offset=0".into(),
                "--size=8M".into(),
                "--norandommap".into(),
                format!("--randseed={seed}"),
                "--refill_buffers".into(),
                "--fsync=256".into(),
                "--time_based".into(),
                format!("--runtime={HAMMER_SECS}"),
            ];
            thread::spawn(move || fio(&dir, &uri, &args, FIO_TIMEOUT))
        })
        .collect();
    for job in jobs {
        assert_fio_clean(&job.join().expect("fio thread"));
    }
    qemu_io_flush(&n1.uri(DISK));
    qemu_io_flush(&n2.uri(DISK));
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(&dir1, DISK), &image(&dir2, DISK));

    // Restart both; kill -9 node 2 while node 1's client writes and verifies.
    let listen = if listen.starts_with('/') {
        listen
    } else {
        "127.0.0.1:0".to_string()
    };
    let n2 = start_acceptor(&dir2, s2, &listen);
    let n1 = start_dialer(&dir1, s1, n2.replication());
    wait_mirroring(&n1, &n2, transport);
    let args = s(&[
        "--name=survivor",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--offset=16M",
        "--size=8M",
        "--rate_iops=,1500",
        "--randseed=7",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ]);
    let job = {
        let (uri, dir, args) = (n1.uri(DISK), dir1.path().to_path_buf(), args.clone());
        thread::spawn(move || fio(&dir, &uri, &args, FIO_TIMEOUT))
    };
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(400) && !job.is_finished() {
        thread::sleep(Duration::from_millis(10));
    }
    let killed = n2.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    n1.wait_log("peer lost", EVENT_TIMEOUT);
    let out = job.join().expect("fio thread");
    assert_fio_clean(&out);
    assert!(
        out.text().contains("issued rwts: total=2048,2048,"),
        "fio did not verify every block it wrote:\n{out}"
    );
    let mut again = args;
    again.push("--verify_only".into());
    assert_fio_clean(&fio(dir1.path(), &n1.uri(DISK), &again, FIO_TIMEOUT));
    n1.stop_clean(Sig::TERM);
}

#[test]
fn mirror_over_loopback_shared_memory() {
    let (s1, s2) = (
        side(1).transport("loopback", "busy_poll_us = 20\n"),
        side(2).transport("loopback", "busy_poll_us = 20\n"),
    );
    let pair = start("tr-loopback", &s1, &s2, "shm");
    acceptance(pair, &s1, &s2, "shm");
}

#[test]
fn mirror_over_quic_with_pinned_certificates() {
    let dir1 = TestDir::new("tr-quic-n1");
    let dir2 = TestDir::new("tr-quic-n2");
    let (s1, s2) = quic_sides(&dir1, &dir2);
    let n2 = start_acceptor(&dir2, &s2, "127.0.0.1:0");
    let listen = n2.replication().to_string();
    let n1 = start_dialer(&dir1, &s1, &listen);
    wait_mirroring(&n1, &n2, "quic");
    let pair = Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    };
    acceptance(pair, &s1, &s2, "quic");
}

#[test]
fn mirror_over_tcp_with_a_shared_secret() {
    let lines = "secret = \"correct horse battery staple\"\n";
    let (s1, s2) = (
        side(1).transport("tcp", lines),
        side(2).transport("tcp", lines),
    );
    let pair = start("tr-secret", &s1, &s2, "tcp");
    assert!(
        !pair.n1.log().contains("UNAUTHENTICATED"),
        "a link with a secret is not reported as unauthenticated"
    );
    acceptance(pair, &s1, &s2, "tcp");
}

#[test]
fn mirror_over_four_tcp_lanes() {
    let (s1, s2) = (
        side(1).transport("tcp", "lanes = 4\n"),
        side(2).transport("tcp", "lanes = 4\n"),
    );
    let pair = start("tr-lanes", &s1, &s2, "tcp*4");
    pair.n1.wait_log("UNAUTHENTICATED", EVENT_TIMEOUT);
    acceptance(pair, &s1, &s2, "tcp*4");
}

#[test]
fn mirror_with_rdma_requested_falls_back_to_tcp() {
    let (s1, s2) = (side(1).transport("rdma", ""), side(2).transport("rdma", ""));
    let pair = start("tr-rdma", &s1, &s2, "tcp");
    pair.n1.wait_log("rdma unavailable", EVENT_TIMEOUT);
    acceptance(pair, &s1, &s2, "tcp");
}

// ----- refusals -----

/// A refused node still serves its own client (alone, as its `serve_alone` startup
/// policy lets it once the peer timeout passes): a write and a read back through its
/// export.
fn still_serves(n: &common::Node) {
    if !require_tool("qemu-io") {
        return;
    }
    let r = [Region::new(0x6e, 5 * MIB, 64 * 1024)];
    qemu_io_writes(&n.uri(DISK), &r);
    qemu_io_reads(&n.uri(DISK), &r);
}

#[test]
fn a_wrong_shared_secret_is_refused_on_both_sides() {
    let s1 = side(1)
        .transport("tcp", "secret = \"one secret\"\n")
        .serve_alone();
    let s2 = side(2)
        .transport("tcp", "secret = \"another secret\"\n")
        .serve_alone();
    let pair = start_pair_with("tr-badsecret", &s1, &s2, |_, _| {});
    pair.n1
        .wait_log("peer authentication failed", EVENT_TIMEOUT);
    pair.n2
        .wait_log("peer authentication failed", EVENT_TIMEOUT);
    still_serves(&pair.n2);
    still_serves(&pair.n1);
    for n in [&pair.n1, &pair.n2] {
        assert!(!n.log().contains(CONNECTED), "mirrored with a wrong secret");
    }
}

#[test]
fn a_wrong_certificate_is_refused_on_both_sides() {
    let dir1 = TestDir::new("tr-badcert-n1");
    let dir2 = TestDir::new("tr-badcert-n2");
    let (_, s2) = quic_sides(&dir1, &dir2);
    let s2 = s2.serve_alone();
    // Node 1 pins a certificate node 2 does not have.
    let other = Identity::generate("someone-else").expect("identity");
    let s1 = side(1)
        .transport(
            "quic",
            &format!("peer_fingerprint = \"{}\"\n", other.fingerprint()),
        )
        .serve_alone();
    let n2 = start_acceptor(&dir2, &s2, "127.0.0.1:0");
    let n1 = start_dialer(&dir1, &s1, n2.replication());
    n1.wait_log("is not the pinned", EVENT_TIMEOUT);
    n2.wait_log("refused", EVENT_TIMEOUT);
    still_serves(&n2);
    still_serves(&n1);
    for n in [&n1, &n2] {
        assert!(
            !n.log().contains(CONNECTED),
            "mirrored with a wrong certificate"
        );
    }
}

#[test]
fn plaintext_clients_on_the_quic_port_are_refused() {
    let dir1 = TestDir::new("tr-plain-n1");
    let dir2 = TestDir::new("tr-plain-n2");
    let (_, s2) = quic_sides(&dir1, &dir2);
    let s2 = s2.serve_alone();
    let n2 = start_acceptor(&dir2, &s2, "127.0.0.1:0");
    let addr = n2.replication().to_string();
    // A node configured for plain tcp dials the QUIC port.
    let s1 = side(1).transport("tcp", "");
    let n1 = start_dialer(&dir1, &s1, &addr);
    n1.wait_log("QUIC", EVENT_TIMEOUT);
    n2.wait_log("plaintext", EVENT_TIMEOUT);
    // Raw plaintext datagrams: a replication frame and garbage.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("udp");
    for payload in [
        &b"VSRP\x01\x01\x00\x00hello"[..],
        &[0u8; 1200][..],
        b"GET / HTTP/1.0\r\n\r\n",
    ] {
        udp.send_to(payload, &addr).expect("send");
    }
    still_serves(&n2);
    assert!(
        !n2.log().contains(CONNECTED),
        "mirrored with a plaintext client"
    );
}
