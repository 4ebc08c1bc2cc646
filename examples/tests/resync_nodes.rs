//! Resync, online verify and metadata checks with real `vsan-node` processes on
//! loopback: a checksum resync of replicas that already hold the same data moves only
//! the chunks that differ; SIGUSR1 runs an online verify that finds and repairs a block
//! corrupted behind the mirror's back; a fixed resync rate is held and reported; a
//! resync whose source is killed resumes from its last checkpoint; damaged or foreign
//! metadata is refused, not re-initialised.
//!
//! As in `mirror_nodes.rs`, node 1 (the lower id) dials and node 2 listens; the address
//! node 2 printed on its first start is reused when it restarts, so node 1 finds it again.
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use common::mirror::{
    CONNECTED, Pair, Side, assert_files_identical, start_acceptor, start_dialer, start_pair,
    start_pair_with, stop_both_clean,
};
use common::{
    Node, Region, Sig, TestDir, VSAN_NODE, assert_file_holds, assert_same_bytes, field, field_u64,
    image, meta, qemu_io_writes_within, read_file_range, require_tool, run_node_to_exit,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// The bitmap chunk (the default).
const CHUNK: u64 = 64 * KIB;
/// How long a log or report line that some event will print may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a full sync of an idle pair may take (dynamic rate, hundreds of MiB).
const SYNC_TIMEOUT: Duration = Duration::from_secs(90);
/// A limit for one qemu-io run of many writes.
const QEMU_IO_TIMEOUT: Duration = Duration::from_secs(120);

/// Node `id`'s side of `vol0` of `size` (`"32MiB"` with the quotes), with a 1 s peer
/// timeout.
fn side(id: u32, size: &'static str) -> Side {
    Side::new(id, "vol0", size).timeout(1000)
}

/// Start a new pair and wait until the first full (checksum) sync has finished on both
/// nodes and node 2's metadata says it is in sync.
fn start_synced(tag: &str, s1: &Side, s2: &Side) -> Pair {
    let pair = start_pair(tag, s1, s2);
    pair.n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    pair.n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    wait_sync(&pair.n1, "done", "checksum", "source", SYNC_TIMEOUT);
    wait_sync(&pair.n2, "done", "checksum", "target", SYNC_TIMEOUT);
    wait_meta_in_sync(&meta(&pair.dir2, "vol0"));
    pair
}

/// Stop both nodes cleanly (node 1 first) and require byte-identical replicas of vol0;
/// returns node 2's image.
fn stop_identical(n1: Node, n2: Node, dir1: &TestDir, dir2: &TestDir) -> PathBuf {
    stop_both_clean(n1, n2);
    let (img1, img2) = (image(dir1, "vol0"), image(dir2, "vol0"));
    assert_files_identical(&img1, &img2);
    img2
}

/// Wait until `node` reports `sync disk=vol0 <what> ` with `kind=<kind>` and
/// `role=<role>`; returns the line.
fn wait_sync(node: &Node, what: &str, kind: &str, role: &str, limit: Duration) -> String {
    node.wait_stdout(
        &[
            &format!("sync disk=vol0 {what} "),
            &format!("kind={kind}"),
            &format!("role={role}"),
        ],
        limit,
    )
}

/// Wait until the newest superblock copy of the metadata at `path` is consistent and
/// past "just created": what a finished sync target persists. (The `done` report and
/// that write race; a kill -9 must come after it.)
fn wait_meta_in_sync(path: &Path) {
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        let bytes = std::fs::read(path).unwrap_or_default();
        let newest = (0..2)
            .filter_map(|copy| bytes.get(copy * 4096..(copy + 1) * 4096))
            .filter(|b| &b[..8] == b"VSANMETA")
            .max_by_key(|b| u64::from_le_bytes(b[16..24].try_into().unwrap()));
        if let Some(sb) = newest {
            let flags = u32::from_le_bytes(sb[12..16].try_into().unwrap());
            let current = u64::from_le_bytes(sb[72..80].try_into().unwrap());
            // Bit 0: inconsistent; 4: the "just created" generation.
            if flags & 1 == 0 && current != 4 {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} did not record a finished sync within {EVENT_TIMEOUT:?}",
            path.display()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// Deterministic pseudo-random bytes (xorshift64*).
fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `count` distinct slots out of `0..slots`, in a scattered (shuffled) order.
fn scattered_slots(seed: u64, slots: u64, count: usize) -> Vec<u64> {
    let mut all: Vec<u64> = (0..slots).collect();
    let r = pseudo_random(seed, all.len() * 8);
    for i in (1..all.len()).rev() {
        let v = u64::from_le_bytes(r[i * 8..i * 8 + 8].try_into().unwrap());
        all.swap(i, (v % (i as u64 + 1)) as usize);
    }
    all.truncate(count);
    all
}

/// Write `regions` on one qemu-io connection (see [`QEMU_IO_TIMEOUT`]).
fn qemu_io_writes(uri: &str, regions: &[Region]) {
    qemu_io_writes_within(uri, regions, QEMU_IO_TIMEOUT);
}

/// The pid of the `vsan-node` process running on `config` (found in /proc by its exact
/// command line, which names the test's own config file).
fn pid_of(config: &Path) -> i32 {
    let want: Vec<&[u8]> = vec![
        VSAN_NODE.as_bytes(),
        b"--config",
        config.to_str().expect("UTF-8 path").as_bytes(),
    ];
    let found: Vec<i32> = std::fs::read_dir("/proc")
        .expect("read /proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.split(|&b| b == 0)
                    .filter(|a| !a.is_empty())
                    .collect::<Vec<_>>()
                    == want
            })
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "want exactly one vsan-node on {}, found {found:?}",
        config.display()
    );
    found[0]
}

/// Send `sig` to the node.
fn signal_node(node: &Node, sig: Sig) {
    let pid = rustix::process::Pid::from_raw(pid_of(node.config_path())).expect("a valid pid");
    rustix::process::kill_process(pid, sig).expect("signal the node");
}

/// The report lines of node `node` that start with `sync disk=vol0 <what>` and carry
/// `kind=<kind> role=<role>`.
fn sync_lines(node: &Node, what: &str, kind: &str, role: &str) -> Vec<(usize, String)> {
    let prefix = format!("sync disk=vol0 {what} ");
    node.stdout_lines()
        .into_iter()
        .enumerate()
        .filter(|(_, l)| {
            l.starts_with(&prefix)
                && field(l, "kind").as_deref() == Some(kind)
                && field(l, "role").as_deref() == Some(role)
        })
        .collect()
}

fn percent(line: &str) -> f64 {
    field(line, "percent")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no `percent=` in {line:?}"))
}

#[test]
fn checksum_resync_of_nearly_identical_replicas_transfers_only_the_differing_chunks() {
    let size = 64 * MIB;
    let content = pseudo_random(0x5eed_0001, size as usize);
    // Ten chunks spread over the disk, each different on node 2.
    let differing: [u64; 10] = [3, 97, 211, 350, 402, 555, 640, 777, 901, 1023];
    let side1 = side(1, "\"64MiB\"");
    let side2 = side(2, "\"64MiB\"");
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_pair_with("resync-csum", &side1, &side2, |d1, d2| {
        for d in [d1, d2] {
            std::fs::create_dir_all(d.data_dir()).expect("create data dir");
        }
        std::fs::write(image(d1, "vol0"), &content).expect("write node 1's image");
        let mut other = content.clone();
        for (i, &c) in differing.iter().enumerate() {
            let at = (c * CHUNK) as usize;
            other[at..at + CHUNK as usize]
                .copy_from_slice(&pseudo_random(0xbad0 + i as u64, CHUNK as usize));
        }
        std::fs::write(image(d2, "vol0"), &other).expect("write node 2's image");
    });

    let done1 = wait_sync(&n1, "done", "checksum", "source", SYNC_TIMEOUT);
    let done2 = wait_sync(&n2, "done", "checksum", "target", SYNC_TIMEOUT);
    let want = differing.len() as u64 * CHUNK;
    assert_eq!(field_u64(&done1, "total"), size, "{done1}");
    assert_eq!(field_u64(&done1, "done"), size, "{done1}");
    assert_eq!(
        field_u64(&done1, "transferred"),
        want,
        "node 1 sent more than the differing chunks: {done1}"
    );
    assert_eq!(field_u64(&done1, "mismatches"), 10, "{done1}");
    assert_eq!(
        field_u64(&done2, "transferred"),
        want,
        "node 2 received more than the differing chunks: {done2}"
    );
    assert!(
        sync_lines(&n1, "interrupted", "checksum", "source").is_empty(),
        "{:?}",
        n1.stdout_lines()
    );

    let img2 = stop_identical(n1, n2, &dir1, &dir2);
    let got = std::fs::read(&img2).expect("read node 2's replica");
    assert_same_bytes(&got, &content, "node 2's replica against the source data");
}

#[test]
fn sigusr1_online_verify_repairs_a_block_corrupted_on_the_peer() {
    if !require_tool("qemu-io") {
        return;
    }
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_synced(
        "resync-verify",
        &side(1, "\"16MiB\""),
        &side(2, "\"16MiB\""),
    );
    let written = Region::new(0x5a, 4 * MIB, MIB);
    qemu_io_writes(&n1.uri("vol0"), &[written]);
    let img2 = image(&dir2, "vol0");
    let want = vec![written.byte; written.len as usize];
    let deadline = Instant::now() + EVENT_TIMEOUT;
    while read_file_range(&img2, written.offset, written.len as usize) != want {
        assert!(
            Instant::now() < deadline,
            "node 1's write did not reach node 2's image within {EVENT_TIMEOUT:?}"
        );
        thread::sleep(Duration::from_millis(20));
    }

    // 4 KiB of garbage inside one chunk of node 2's image, behind the mirror's back.
    let bad_at = written.offset + 3 * CHUNK + 8 * KIB;
    {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&img2)
            .expect("open node 2's image");
        f.write_all_at(&pseudo_random(0xdead, 4096), bad_at)
            .expect("corrupt node 2's image");
        f.sync_all().expect("sync node 2's image");
    }
    assert_ne!(
        read_file_range(&img2, bad_at, 4096),
        vec![written.byte; 4096]
    );

    signal_node(&n1, Sig::USR1);
    let done = wait_sync(&n1, "done", "verify", "source", SYNC_TIMEOUT);
    assert_eq!(field_u64(&done, "mismatches"), 1, "{done}");
    assert_eq!(field_u64(&done, "total"), 16 * MIB, "{done}");
    assert_eq!(
        field_u64(&done, "transferred"),
        CHUNK,
        "the repair should send the one differing chunk: {done}"
    );

    stop_identical(n1, n2, &dir1, &dir2);
    let got = read_file_range(&img2, written.offset, written.len as usize);
    assert_same_bytes(&got, &want, "node 2's repaired data");
}

/// Set up a resync of `written` MiB (scattered whole MiB, so distinct chunks) with node 1
/// as its source at `rate`: a synced pair (dynamic rate, so the first full sync of the
/// whole disk is quick), node 2 killed, the writes made on node 1 alone, node 1 restarted
/// cleanly with the fixed rate (only the source's rate paces a resync; the clean restart
/// also leaves its activity log empty, so a later crash of node 1 marks nothing more),
/// then node 2 restarted on its old address with the same rate.
fn degraded_writes_then_resync(
    tag: &str,
    size: &'static str,
    slots: u64,
    written: usize,
    rate: &'static str,
) -> (Pair, Side, Vec<Region>) {
    let mut pair = start_synced(tag, &side(1, size), &side(2, size));
    let killed = pair.n2.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    pair.n1.wait_log("peer lost", EVENT_TIMEOUT);

    let regions: Vec<Region> = scattered_slots(0x51075, slots, written)
        .into_iter()
        .enumerate()
        .map(|(i, slot)| Region::new(0x10 + (i % 200) as u8, slot * MIB, MIB))
        .collect();
    qemu_io_writes(&pair.n1.uri("vol0"), &regions);
    pair.n1.stop_clean(Sig::TERM);

    let side1 = side(1, size).resync_rate(rate);
    let side2 = side(2, size).resync_rate(rate);
    pair.n1 = start_dialer(&pair.dir1, &side1, &pair.listen);
    pair.n2 = start_acceptor(&pair.dir2, &side2, &pair.listen);
    (pair, side1, regions)
}

/// Wait for node 1's `done` line of the bitmap resync it is the source of, which must
/// have gone through all of `total`; returns the line.
fn wait_bitmap_done(n1: &Node, total: u64) -> String {
    let done = wait_sync(n1, "done", "bitmap", "source", Duration::from_secs(60));
    assert_eq!(field_u64(&done, "total"), total, "{done}");
    assert_eq!(field_u64(&done, "done"), total, "{done}");
    done
}

#[test]
fn a_fixed_resync_rate_is_held_and_progress_is_reported() {
    if !require_tool("qemu-io") {
        return;
    }
    let rate = 8 * MIB;
    let written = 160;
    let (pair, _, regions) =
        degraded_writes_then_resync("resync-rate", "\"512MiB\"", 512, written, "8MiB");
    let Pair {
        dir1, dir2, n1, n2, ..
    } = pair;
    let total = written as u64 * MIB;

    let started = wait_sync(&n1, "started", "bitmap", "source", EVENT_TIMEOUT);
    assert_eq!(
        field_u64(&started, "total"),
        total,
        "the resync should cover exactly the chunks written while node 2 was away: {started}"
    );
    wait_sync(&n2, "started", "bitmap", "target", EVENT_TIMEOUT);
    // 160 MiB at 8 MiB/s: about 20 s; allow for a slow machine.
    let done = wait_bitmap_done(&n1, total);
    assert_eq!(field_u64(&done, "transferred"), total, "{done}");
    let elapsed_ms = field_u64(&done, "elapsed_ms");
    let measured = total as f64 * 1000.0 / elapsed_ms.max(1) as f64;
    assert!(
        (0.8..=1.2).contains(&(measured / rate as f64)),
        "resync ran at {measured:.0} B/s ({elapsed_ms} ms for {total} bytes), not within 20% \
         of {rate} B/s: {done}"
    );

    // Progress was reported while it ran, with `done` growing.
    let lines = n1.stdout_lines();
    let done_at = lines
        .iter()
        .position(|l| *l == done)
        .expect("the done line");
    let progress = sync_lines(&n1, "progress", "bitmap", "source");
    assert!(
        progress.len() >= 2,
        "fewer than 2 progress lines during a ~20 s resync:\n{}",
        lines.join("\n")
    );
    assert!(
        progress.iter().all(|(i, _)| *i < done_at),
        "progress after the end:\n{}",
        lines.join("\n")
    );
    let dones: Vec<u64> = progress.iter().map(|(_, l)| field_u64(l, "done")).collect();
    assert!(
        dones.windows(2).all(|w| w[0] <= w[1]) && dones.first() < dones.last(),
        "progress `done` does not grow: {dones:?}"
    );
    for (_, l) in &progress {
        assert_eq!(field_u64(l, "total"), total, "{l}");
        assert!(field_u64(l, "done") <= total, "{l}");
        // Once a few seconds in, the reported average rate is the configured one too.
        let p = percent(l);
        if (20.0..100.0).contains(&p) {
            let r = field_u64(l, "rate") as f64;
            assert!(
                (0.8..=1.2).contains(&(r / rate as f64)),
                "progress reports {r} B/s, not within 20% of {rate}: {l}"
            );
        }
    }
    assert!(
        progress
            .iter()
            .any(|(_, l)| (20.0..100.0).contains(&percent(l))),
        "no progress line between 20% and 100%:\n{}",
        lines.join("\n")
    );

    let img2 = stop_identical(n1, n2, &dir1, &dir2);
    assert_file_holds(&img2, regions.iter().step_by(16), "node 2's replica");
}

#[test]
fn a_resync_whose_source_is_killed_resumes_from_its_last_checkpoint() {
    if !require_tool("qemu-io") {
        return;
    }
    let rate = 4 * MIB;
    let written = 64;
    let (pair, side1, regions) =
        degraded_writes_then_resync("resync-resume", "\"256MiB\"", 256, written, "4MiB");
    let Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    } = pair;

    let started = wait_sync(&n1, "started", "bitmap", "source", EVENT_TIMEOUT);
    let first_total = field_u64(&started, "total");
    assert_eq!(first_total, written as u64 * MIB, "{started}");

    // Well past a quarter (64 MiB at 4 MiB/s: about 7 s in), kill -9 the source.
    let deadline = Instant::now() + Duration::from_secs(60);
    let at_kill = loop {
        let last = sync_lines(&n1, "progress", "bitmap", "source").pop();
        if let Some((_, l)) = last.filter(|(_, l)| percent(l) > 40.0) {
            break l;
        }
        assert!(
            sync_lines(&n1, "done", "bitmap", "source").is_empty(),
            "the resync finished before it could be interrupted:\n{}",
            n1.stdout_lines().join("\n")
        );
        assert!(
            Instant::now() < deadline,
            "no progress past 40% within 60 s:\n{}",
            n1.stdout_lines().join("\n")
        );
        thread::sleep(Duration::from_millis(20));
    };
    let done_at_kill = field_u64(&at_kill, "done");
    let killed = n1.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    wait_sync(&n2, "interrupted", "bitmap", "target", EVENT_TIMEOUT);

    let n1 = start_dialer(&dir1, &side1, &listen);
    let again = wait_sync(&n1, "started", "bitmap", "source", EVENT_TIMEOUT);
    let second_total = field_u64(&again, "total");
    // Up to two checkpoint intervals (1 s each) of progress may not have been durable.
    let margin = 2 * rate + MIB;
    assert!(
        second_total + done_at_kill <= first_total + margin,
        "the resync did not resume from its checkpoint: first total {first_total}, \
         {done_at_kill} bytes done at the kill, second total {second_total} (margin {margin})"
    );
    assert!(second_total > 0, "{again}");

    wait_bitmap_done(&n1, second_total);
    wait_sync(&n2, "done", "bitmap", "target", EVENT_TIMEOUT);

    let img2 = stop_identical(n1, n2, &dir1, &dir2);
    assert_file_holds(&img2, &regions, "node 2's replica");
}

/// A node with one mirrored disk whose peer is never there (node 2 at a closed port):
/// the node starts and serves alone, with metadata for the disk.
fn lone_config(dir: &TestDir, disk: &'static str) -> String {
    Side::new(1, disk, "\"16MiB\"")
        .timeout(1000)
        .config(dir, None, "127.0.0.1:1")
}

/// Start a lone node for `disk` once and stop it cleanly; its metadata must exist then.
fn run_lone_once(dir: &TestDir, disk: &'static str) -> PathBuf {
    let node = Node::start(dir, &lone_config(dir, disk), &[disk]);
    node.wait_log("metadata created", EVENT_TIMEOUT);
    node.stop_clean(Sig::TERM);
    let path = meta(dir, disk);
    assert!(
        path.is_file(),
        "no {} after a clean start and stop",
        path.display()
    );
    path
}

/// Start the lone node for vol0 on tampered metadata: it must exit 1 naming the disk and
/// `why`, and leave the metadata file as it was.
fn assert_refused(dir: &TestDir, why: &str) {
    let path = meta(dir, "vol0");
    let before = std::fs::read(&path).expect("read the tampered metadata");
    let out = run_node_to_exit(dir, &lone_config(dir, "vol0"));
    assert_eq!(out.status.code(), Some(1), "want exit 1:\n{out}");
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("vsan-node: disk vol0: refusing to attach:"))
        .unwrap_or_else(|| panic!("no refusal line on stderr:\n{out}"));
    assert!(
        line.contains(why),
        "the refusal does not say `{why}`:\n{out}"
    );
    assert!(
        !out.stdout.contains("ready "),
        "it served before refusing:\n{out}"
    );
    let after = std::fs::read(&path).expect("read the metadata again");
    assert!(
        before == after,
        "the refused metadata was changed (re-initialised?)"
    );
}

#[test]
fn metadata_with_both_superblock_copies_corrupt_is_refused() {
    let dir = TestDir::new("resync-meta-sb");
    let path = run_lone_once(&dir, "vol0");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open vol0.meta");
    for block in [0u64, 4096] {
        // Flip bytes inside the fields (node id, peer id, size) of each copy.
        let at = block + 40;
        let mut b = [0u8; 16];
        f.read_exact_at(&mut b, at).expect("read a superblock");
        for x in &mut b {
            *x ^= 0xff;
        }
        f.write_all_at(&b, at).expect("corrupt a superblock");
    }
    f.sync_all().expect("sync vol0.meta");
    drop(f);
    assert_refused(&dir, "both superblock copies are corrupt");
}

#[test]
fn truncated_metadata_is_refused() {
    let dir = TestDir::new("resync-meta-trunc");
    let path = run_lone_once(&dir, "vol0");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open vol0.meta");
    assert!(f.metadata().expect("stat").len() > 6000);
    f.set_len(6000).expect("truncate vol0.meta");
    drop(f);
    assert_refused(&dir, "truncated");
}

#[test]
fn metadata_of_another_disk_is_refused() {
    let dir = TestDir::new("resync-meta-other");
    let vol1 = run_lone_once(&dir, "vol1");
    let vol0 = run_lone_once(&dir, "vol0");
    assert!(image(&dir, "vol0").is_file());
    std::fs::copy(&vol1, &vol0).expect("copy vol1.meta over vol0.meta");
    assert_refused(&dir, "belongs to disk");
}
