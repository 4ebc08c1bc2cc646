//! Two real `vsan-node` processes mirroring one disk over TCP on loopback, driven by real
//! NBD clients (qemu-io, fio) on both exports, checking what a user of a mirror cares
//! about: what one node's client writes, the other node's client reads; both replicas end
//! byte-identical; a lost peer does not stop the survivor; a mismatched or diverged peer
//! is refused, not trusted.
//!
//! Node 1 (the lower id) dials; node 2 listens on `127.0.0.1:0`, so every test starts
//! node 2 first, reads its `ready replication=<addr>` line and writes that address into
//! node 1's config. Each node has its own directory (its config and `data/<disk>.img`).
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use common::fio::{assert_fio_clean, fio, s};
use common::mirror::{
    CONNECTED, Pair, Side, assert_replicas_identical, free_loopback_addr, start_acceptor,
    start_dialer, start_pair, stop_both_clean,
};
use common::{
    Region, Sig, TestDir, assert_file_holds, field, field_u64, image, qemu_io_flush, qemu_io_reads,
    qemu_io_writes, read_file_range, require_tool,
};

const MIB: u64 = 1 << 20;
/// How long a log line that some event will print may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// A limit for one fio run.
const FIO_TIMEOUT: Duration = Duration::from_secs(60);

/// Start a pair mirroring `disk` of `size` and wait until both say they mirror.
fn start_mirrored(tag: &str, disk: &'static str, size: &'static str, timeout_ms: u64) -> Pair {
    let pair = start_pair(
        tag,
        &Side::new(1, disk, size).timeout(timeout_ms),
        &Side::new(2, disk, size).timeout(timeout_ms),
    );
    pair.n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    pair.n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    // Fresh replicas compare every chunk by checksum first.
    let done = format!("sync disk={disk} done");
    pair.n1.wait_stdout(&[&done], EVENT_TIMEOUT);
    pair.n2.wait_stdout(&[&done], EVENT_TIMEOUT);
    pair
}

#[test]
fn qemu_io_writes_on_one_node_read_back_on_the_other() {
    if !require_tool("qemu-io") {
        return;
    }
    let size = 32 * MIB;
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_mirrored("mirror-qemu", "vol0", "\"32MiB\"", 5000);
    let (uri1, uri2) = (n1.uri("vol0"), n2.uri("vol0"));

    // Node 1 writes, node 2 reads.
    let from1 = [
        Region::new(0xa5, 0, MIB),
        // 512-aligned, not 4K-aligned, crossing 4K boundaries.
        Region::new(0x3c, MIB + 4608, 7680),
        Region::new(0xe1, size - 512, 512),
    ];
    qemu_io_writes(&uri1, &from1);
    qemu_io_reads(&uri2, &from1);

    // Node 2 writes (one of them over node 1's data), node 1 reads.
    let from2 = [
        Region::new(0x5b, 8 * MIB, MIB),
        Region::new(0x77, 2 * MIB + 512, 64 * 1024 - 512),
        Region::new(0xc9, 512 * 1024, 4096),
    ];
    qemu_io_writes(&uri2, &from2);
    let mut expect = vec![
        Region::new(0xa5, 0, 512 * 1024),
        Region::new(0xa5, 512 * 1024 + 4096, 512 * 1024 - 4096),
        Region::new(0x00, MIB, 4608),
        Region::new(0x00, 3 * MIB, 5 * MIB),
    ];
    expect.extend(&from1[1..]);
    expect.extend(&from2);
    qemu_io_reads(&uri1, &expect);
    // And node 2 sees the same whole picture.
    qemu_io_reads(&uri2, &expect);

    stop_both_clean(n1, n2);
    let (img1, img2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    assert_eq!(std::fs::metadata(&img1).map(|m| m.len()).ok(), Some(size));
    assert_replicas_identical(&img1, &img2);
    assert_file_holds(&img1, &expect, "replica");
}

#[test]
fn fio_verify_on_both_nodes_at_once_on_disjoint_halves() {
    if !require_tool("fio") || !require_tool("qemu-io") {
        return;
    }
    let half = 16 * MIB;
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_mirrored("mirror-fio", "vol0", "\"32MiB\"", 5000);
    let jobs: Vec<_> = [(&n1, &dir1, 0), (&n2, &dir2, half)]
        .into_iter()
        .map(|(node, dir, offset)| {
            let uri = node.uri("vol0");
            let dir = dir.path().to_path_buf();
            let args = vec![
                format!("--name=half{offset}"),
                "--rw=randwrite".into(),
                "--bs=4k".into(),
                "--iodepth=16".into(),
                format!("--offset={offset}"),
                format!("--size={half}"),
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
        // Every block of its half written once and read back verified.
        let blocks = half / 4096;
        assert!(
            out.text()
                .contains(&format!("issued rwts: total={blocks},{blocks},")),
            "fio did not verify every block it wrote:\n{out}"
        );
    }

    qemu_io_flush(&n1.uri("vol0"));
    qemu_io_flush(&n2.uri("vol0"));
    stop_both_clean(n1, n2);
    let (img1, img2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    assert_replicas_identical(&img1, &img2);
    // Both halves hold data (each came from a different node).
    for offset in [0, half] {
        let got = read_file_range(&img1, offset, half as usize);
        assert!(
            got.iter().any(|&b| b != 0),
            "the half at {offset} is all zeroes"
        );
    }
}

/// How long the overlap hammer runs: the 15 s by default; `VSAN_HAMMER_SECS`
/// shortens it for quick local runs.
fn hammer_secs() -> u64 {
    std::env::var("VSAN_HAMMER_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
}

#[test]
fn overlap_hammer_from_both_nodes_leaves_identical_replicas() {
    if !require_tool("fio") || !require_tool("qemu-io") {
        return;
    }
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_mirrored("mirror-hammer", "vol0", "\"16MiB\"", 5000);
    let jobs: Vec<_> = [(&n1, &dir1, 1), (&n2, &dir2, 2)]
        .into_iter()
        .map(|(node, dir, seed)| {
            let uri = node.uri("vol0");
            let dir = dir.path().to_path_buf();
            let limit = FIO_TIMEOUT + Duration::from_secs(hammer_secs());
            let args = vec![
                format!("--name=hammer{seed}"),
                "--rw=randwrite".into(),
                // Writes of several sizes, so overlaps are partial as well as exact.
                "--bssplit=4k/60:16k/30:64k/10".into(),
                "--iodepth=16".into(),
                "--offset=0".into(),
                "--size=8M".into(),
                "--norandommap".into(),
                format!("--randseed={seed}"),
                // Fresh random data in every write, different on each side.
                "--refill_buffers".into(),
                // A flush now and then, crossing the other side's writes.
                "--fsync=256".into(),
                "--time_based".into(),
                format!("--runtime={}", hammer_secs()),
            ];
            thread::spawn(move || fio(&dir, &uri, &args, limit))
        })
        .collect();
    for job in jobs {
        assert_fio_clean(&job.join().expect("fio thread"));
    }

    qemu_io_flush(&n1.uri("vol0"));
    qemu_io_flush(&n2.uri("vol0"));
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}

/// Bytes allocated to a (sparse) file.
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

#[test]
fn kill_9_of_the_peer_during_writes_the_survivor_goes_on() {
    if !require_tool("fio") {
        return;
    }
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_mirrored("mirror-kill", "vol0", "\"32MiB\"", 1000);
    // 4096 writes at 2000 a second: about 2 s of writing, with the kill early in it.
    let args = s(&[
        "--name=survivor",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--offset=0",
        "--size=16M",
        "--rate_iops=,2000",
        "--randseed=7",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ]);
    let job = {
        let (uri, dir, args) = (n1.uri("vol0"), dir1.path().to_path_buf(), args.clone());
        thread::spawn(move || fio(&dir, &uri, &args, FIO_TIMEOUT))
    };

    // Wait until writes are reaching node 2's replica, then kill it mid-run.
    let img2 = image(&dir2, "vol0");
    let deadline = Instant::now() + EVENT_TIMEOUT;
    while allocated(&img2) < MIB {
        assert!(
            Instant::now() < deadline && !job.is_finished(),
            "no mirrored writes reached node 2 within {EVENT_TIMEOUT:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }
    let killed = n2.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    n1.wait_log("peer lost", EVENT_TIMEOUT);

    let out = job.join().expect("fio thread");
    assert_fio_clean(&out);
    assert!(
        out.text().contains("issued rwts: total=4096,4096,"),
        "fio did not verify every block it wrote:\n{out}"
    );
    // Everything acknowledged, before and after the kill, reads back from the survivor
    // again on a fresh connection.
    let mut again = args.clone();
    again.push("--verify_only".into());
    assert_fio_clean(&fio(dir1.path(), &n1.uri("vol0"), &again, FIO_TIMEOUT));

    let log = n1.stop_clean(Sig::TERM).log;
    assert!(
        log.contains("peer lost"),
        "no `peer lost` in node 1's log:\n{log}"
    );
    // Writes after the kill exist only on the survivor (so the kill was mid-run).
    let (a, b) = (
        std::fs::read(image(&dir1, "vol0")).expect("read node 1's replica"),
        std::fs::read(&img2).expect("read node 2's replica"),
    );
    assert!(
        a != b,
        "node 2's replica got every write: the kill came too late"
    );
}

#[test]
fn a_peer_with_a_different_disk_size_is_refused_on_both_nodes() {
    let Pair { n1, n2, .. } = start_pair(
        "mirror-size",
        &Side::new(1, "vol0", "\"32MiB\""),
        &Side::new(2, "vol0", "\"16MiB\""),
    );
    n1.wait_log("disk size mismatch", EVENT_TIMEOUT);
    n2.wait_log("disk size mismatch", EVENT_TIMEOUT);
    let (l1, l2) = (n1.stop_clean(Sig::TERM).log, n2.stop_clean(Sig::TERM).log);
    for (log, who) in [(&l1, "node 1"), (&l2, "node 2")] {
        // The message names both sizes.
        assert!(
            log.lines().any(|l| l.contains("disk size mismatch")
                && l.contains(&(32 * MIB).to_string())
                && l.contains(&(16 * MIB).to_string())),
            "{who}'s log does not name both sizes:\n{log}"
        );
        assert!(!log.contains(CONNECTED), "{who} mirrored anyway:\n{log}");
    }
}

#[test]
fn a_peer_with_a_different_disk_is_refused() {
    // The disk id is derived from the name, and the acceptor routes a link by the name in
    // the peer's Hello: a different disk name is refused before any id check.
    let Pair { n1, n2, .. } = start_pair(
        "mirror-name",
        &Side::new(1, "vol0", "\"16MiB\""),
        &Side::new(2, "vol1", "\"16MiB\""),
    );
    let why = "this node has no mirrored disk named \"vol0\"";
    n2.wait_log(why, EVENT_TIMEOUT);
    n1.wait_log(&format!("refused by the peer: {why}"), EVENT_TIMEOUT);
    let (l1, l2) = (n1.stop_clean(Sig::TERM).log, n2.stop_clean(Sig::TERM).log);
    for (log, who) in [(&l1, "node 1"), (&l2, "node 2")] {
        assert!(!log.contains(CONNECTED), "{who} mirrored anyway:\n{log}");
    }
}

/// The fio job of the partner-down test: 64 MiB in 64 KiB blocks at random places of the
/// first GiB, each block written once, with crc32c verification headers.
fn scattered_job(name: &str, verify_only: bool) -> Vec<String> {
    let mut a = s(&[
        "--rw=randwrite",
        "--bs=64k",
        "--size=1g",
        "--io_size=64m",
        "--iodepth=8",
        "--randrepeat=1",
        "--randseed=4242",
        "--verify=crc32c",
        "--verify_fatal=1",
    ]);
    a.push(format!("--name={name}"));
    if verify_only {
        a.push("--verify_only=1".into());
    } else {
        a.push("--do_verify=0".into());
    }
    a
}

/// The partner goes down (kill -9) while its peer is being written; the survivor takes
/// 64 MiB more at scattered offsets; the partner comes back and catches up by copying
/// only the chunks written meanwhile (far below the disk size, as the resync reports
/// it), after which fio verifies every block on both exports and the replicas are
/// byte-identical.
#[test]
fn partner_down_during_writes_resyncs_only_the_dirty_chunks() {
    if !require_tool("fio") || !require_tool("qemu-io") {
        return;
    }
    const DISK: u64 = 2048 * MIB;
    let side2 = Side::new(2, "vol0", "\"2GiB\"").timeout(1000);
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_mirrored("mirror-partner-down", "vol0", "\"2GiB\"", 1000);
    let listen = n2.replication().to_string();

    // Writes are running on node 1 when node 2 dies.
    let busy = {
        let (dir, uri) = (dir1.path().to_path_buf(), n1.uri("vol0"));
        thread::spawn(move || {
            let args = s(&[
                "--name=busy",
                "--rw=randwrite",
                "--bs=4k",
                "--offset=1536m",
                "--size=16m",
                "--time_based=1",
                "--runtime=4",
                "--iodepth=4",
            ]);
            fio(&dir, &uri, &args, FIO_TIMEOUT)
        })
    };
    thread::sleep(Duration::from_millis(1500));
    n2.stop(Sig::KILL);
    n1.wait_log("peer lost", EVENT_TIMEOUT);
    assert_fio_clean(&busy.join().expect("fio thread"));

    // 64 MiB more at scattered offsets while node 2 is away.
    let out = fio(
        dir1.path(),
        &n1.uri("vol0"),
        &scattered_job("scatter", false),
        FIO_TIMEOUT,
    );
    assert_fio_clean(&out);

    // Node 2 returns and catches up from node 1.
    let skip = n1.stdout_lines().len();
    let n2 = start_acceptor(&dir2, &side2, &listen);
    let started = n1.wait_stdout_after(skip, &["sync disk=vol0 started"], EVENT_TIMEOUT);
    let done = n1.wait_stdout_after(skip, &["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout(&["sync disk=vol0 done", "role=target"], EVENT_TIMEOUT);
    eprintln!("node 1: {started}\nnode 1: {done}");
    assert_eq!(field(&done, "kind").as_deref(), Some("bitmap"), "{done}");
    assert_eq!(field(&done, "role").as_deref(), Some("source"), "{done}");
    let total = field_u64(&done, "total");
    let transferred = field_u64(&done, "transferred");
    // The dirty chunks: at most the 1024 scattered 64 KiB blocks, the 16 MiB the busy
    // job wrote, and node 2's activity log (it was killed: the extents it had hot).
    let bound = 64 * MIB + 16 * MIB + 16 * MIB;
    assert!(transferred <= total, "{done}");
    assert!(
        total <= bound,
        "resync went through {total} bytes, more than the chunks written meanwhile ({bound})"
    );
    assert!(transferred >= 64 * MIB, "{done}");
    assert!(transferred < DISK / 16, "{done}");

    // fio verifies every block of the scattered job on both nodes.
    for (who, dir, uri) in [
        ("node 1", &dir1, n1.uri("vol0")),
        ("node 2", &dir2, n2.uri("vol0")),
    ] {
        let out = fio(
            dir.path(),
            &uri,
            &scattered_job(&format!("check-{}", who.len()), true),
            FIO_TIMEOUT,
        );
        assert_fio_clean(&out);
        assert!(
            out.text().contains("READ:"),
            "{who}: fio read nothing back:\n{out}"
        );
    }
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}

/// Both nodes are killed (-9) while writes are in flight on both; after a restart the
/// resync covers only the extents of the activity logs (the region written, not the
/// disk), the replicas end identical, and every acknowledged write is there.
#[test]
fn kill_9_of_both_nodes_resync_is_bounded_by_the_activity_log() {
    use vsan_core::export::nbd::Client;
    use vsan_examples::pattern::{BLOCK, BlockLog, expected_block};

    const REGION: u64 = 64 * MIB;
    let side1 = Side::new(1, "vol0", "\"1GiB\"").timeout(1000);
    let side2 = Side::new(2, "vol0", "\"1GiB\"").timeout(1000);
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_mirrored("mirror-kill-both", "vol0", "\"1GiB\"", 1000);
    let listen = n2.replication().to_string();
    let blocks = REGION / BLOCK as u64;
    let log = std::sync::Arc::new(BlockLog::new(blocks));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // Writers on both nodes, on disjoint blocks (even blocks via node 1, odd via node 2),
    // each block rewritten with a new generation over and over.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for (node, addr) in [
        (0u64, n1.addr("vol0").to_string()),
        (1, n2.addr("vol0").to_string()),
    ] {
        for w in 0..4u64 {
            let (log, stop) = (log.clone(), stop.clone());
            let addr = addr.clone();
            writers.push(rt.spawn(async move {
                let client = Client::connect_tcp(&addr, "vol0").await.expect("connect");
                let mut x = 0x9e37_79b9u64 ^ (node * 31 + w);
                let mut acked = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let block = ((x % (blocks / 8)) * 8 + w * 2 + node) % blocks;
                    let generation = log.generation(block) + 1;
                    let data = expected_block(block, generation);
                    if client
                        .write(block * BLOCK as u64, &data, false)
                        .await
                        .is_err()
                    {
                        break;
                    }
                    log.set_generation(block, generation);
                    acked += 1;
                }
                acked
            }));
        }
    }
    thread::sleep(Duration::from_secs(2));
    // Both die with writes in flight.
    n1.stop(Sig::KILL);
    n2.stop(Sig::KILL);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let acked: u64 = rt.block_on(async {
        let mut n = 0;
        for w in writers {
            n += w.await.unwrap_or(0);
        }
        n
    });
    assert!(
        acked > 100,
        "only {acked} writes were acknowledged before the kill"
    );

    let n2 = start_acceptor(&dir2, &side2, &listen);
    let n1 = start_dialer(&dir1, &side1, &listen);
    let done = n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    eprintln!("after the restart: {done} ({acked} writes acknowledged before the kill)");
    let total = field_u64(&done, "total");
    assert_eq!(field(&done, "kind").as_deref(), Some("bitmap"), "{done}");
    assert!(
        total > 0,
        "nothing resynced after a crash with writes in flight: {done}"
    );
    assert!(
        total <= REGION,
        "the resync after the crash went through {total} bytes, more than the {REGION} bytes \
         of extents the activity logs can hold for this workload"
    );
    stop_both_clean(n1, n2);
    let (i1, i2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    assert_replicas_identical(&i1, &i2);
    let img = read_file_range(&i1, 0, REGION as usize);
    for block in 0..blocks {
        let g = log.generation(block);
        let got = &img[(block as usize) * BLOCK..(block as usize + 1) * BLOCK];
        // The acknowledged generation, or the one in flight at the kill.
        assert!(
            got == expected_block(block, g).as_slice()
                || got == expected_block(block, g + 1).as_slice(),
            "block {block}: neither its acknowledged generation {g} nor the next"
        );
    }
}

#[test]
fn the_dialing_node_may_start_first_and_retries_until_the_peer_listens() {
    if !require_tool("qemu-io") {
        return;
    }
    // Node 2's replication port must be known before node 2 starts: take a free one.
    let listen = free_loopback_addr();
    let dir1 = TestDir::new("mirror-dialer-first-n1");
    let dir2 = TestDir::new("mirror-dialer-first-n2");
    let s1 = Side::new(1, "vol0", "\"16MiB\"");
    let s2 = Side::new(2, "vol0", "\"16MiB\"");
    let n1 = start_dialer(&dir1, &s1, &listen);
    // Node 1 is up and serving while its peer is not there yet.
    assert_eq!(n1.log_count(CONNECTED), 0);
    let n2 = start_acceptor(&dir2, &s2, &listen);
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    let r = Region::new(0x6d, 4096, 64 * 1024);
    qemu_io_writes(&n1.uri("vol0"), &[r]);
    qemu_io_reads(&n2.uri("vol0"), &[r]);
    stop_both_clean(n1, n2);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}
