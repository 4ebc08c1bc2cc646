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

mod common;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use common::{
    Node, Region, Sig, TestDir, ToolOutput, VSAN_NODE, assert_same_bytes, field, field_u64,
    read_file_range, require_tool, run_node_to_exit, run_tool, toml_str,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// The bitmap chunk (the default).
const CHUNK: u64 = 64 * KIB;
/// How long a log or report line that some event will print may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a full sync of an idle pair may take (dynamic rate, hundreds of MiB).
const SYNC_TIMEOUT: Duration = Duration::from_secs(90);
/// What each node logs once the two have shaken hands and mirror.
const CONNECTED: &str = "peer connected: mirroring";
/// A limit for one qemu-io run of many writes.
const QEMU_IO_TIMEOUT: Duration = Duration::from_secs(120);

/// One node's side of a mirrored disk.
#[derive(Debug, Clone)]
struct Side {
    id: u32,
    disk: &'static str,
    /// Written into the config as given (`"32MiB"` with the quotes).
    size: &'static str,
    peer_timeout_ms: u64,
    /// `resync_rate`, written as a TOML string when set.
    rate: Option<&'static str>,
}

impl Side {
    fn new(id: u32, size: &'static str) -> Side {
        Side {
            id,
            disk: "vol0",
            size,
            peer_timeout_ms: 1000,
            rate: None,
        }
    }

    fn rate(mut self, rate: &'static str) -> Side {
        self.rate = Some(rate);
        self
    }

    /// This side's config: `listen` for the acceptor (node 2), the peer's address for
    /// the dialer (node 1).
    fn config(&self, dir: &TestDir, listen: Option<&str>, peer_addr: &str) -> String {
        let peer = if self.id == 1 { 2 } else { 1 };
        let mut s = format!(
            "[node]\nid = {}\ndata_dir = {}\npeer_timeout_ms = {}\n",
            self.id,
            toml_str(dir.data_dir()),
            self.peer_timeout_ms
        );
        if let Some(l) = listen {
            s += &format!("listen = {}\n", toml_str(l));
        }
        s += &format!(
            "\n[[peer]]\nid = {peer}\naddress = {}\ntransport = \"tcp\"\n\n\
             [[disk]]\nname = {}\nsize = {}\npeer = {peer}\nnbd = \"127.0.0.1:0\"\n",
            toml_str(peer_addr),
            toml_str(self.disk),
            self.size
        );
        if let Some(r) = self.rate {
            s += &format!("resync_rate = {}\n", toml_str(r));
        }
        s
    }
}

/// Start node 2 (the acceptor) listening on `listen`.
fn start_acceptor(dir: &TestDir, side: &Side, listen: &str) -> Node {
    // Node 2 never dials (the lower id does); the config requires an address anyway.
    let config = side.config(dir, Some(listen), "127.0.0.1:1");
    Node::start_listening(dir, &config, &[side.disk])
}

/// Start node 1 (the dialer) pointed at node 2's replication address.
fn start_dialer(dir: &TestDir, side: &Side, peer_addr: &str) -> Node {
    Node::start(dir, &side.config(dir, None, peer_addr), &[side.disk])
}

/// Two nodes, their directories, and where node 2 listens (for its restarts).
struct Pair {
    dir1: TestDir,
    dir2: TestDir,
    n1: Node,
    n2: Node,
    listen: String,
}

/// Start node 2, then node 1 dialing it (no wait for the handshake).
fn start_pair(tag: &str, s1: &Side, s2: &Side, prepare: impl FnOnce(&TestDir, &TestDir)) -> Pair {
    let dir1 = TestDir::new(&format!("{tag}-n1"));
    let dir2 = TestDir::new(&format!("{tag}-n2"));
    prepare(&dir1, &dir2);
    let n2 = start_acceptor(&dir2, s2, "127.0.0.1:0");
    let listen = n2.replication().to_string();
    let n1 = start_dialer(&dir1, s1, &listen);
    Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    }
}

/// Start a new pair and wait until the first full (checksum) sync has finished on both
/// nodes and node 2's metadata says it is in sync.
fn start_synced(tag: &str, s1: &Side, s2: &Side) -> Pair {
    let pair = start_pair(tag, s1, s2, |_, _| {});
    pair.n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    pair.n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    pair.n1.wait_stdout(
        &["sync disk=vol0 done ", "kind=checksum", "role=source"],
        SYNC_TIMEOUT,
    );
    pair.n2.wait_stdout(
        &["sync disk=vol0 done ", "kind=checksum", "role=target"],
        SYNC_TIMEOUT,
    );
    wait_meta_in_sync(&meta(&pair.dir2, "vol0"));
    pair
}

fn image(dir: &TestDir, disk: &str) -> PathBuf {
    dir.data_dir().join(format!("{disk}.img"))
}

fn meta(dir: &TestDir, disk: &str) -> PathBuf {
    dir.data_dir().join(format!("{disk}.meta"))
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

/// Both files byte-identical, compared a MiB at a time.
fn assert_files_identical(a: &Path, b: &Path) {
    let open =
        |p: &Path| std::fs::File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let (fa, fb) = (open(a), open(b));
    let (la, lb) = (
        fa.metadata().expect("stat").len(),
        fb.metadata().expect("stat").len(),
    );
    assert_eq!(
        la,
        lb,
        "{} and {} differ in length",
        a.display(),
        b.display()
    );
    let (mut ra, mut rb) = (std::io::BufReader::new(fa), std::io::BufReader::new(fb));
    let mut ba = vec![0u8; MIB as usize];
    let mut bb = vec![0u8; MIB as usize];
    let mut at = 0u64;
    while at < la {
        let n = (la - at).min(MIB) as usize;
        ra.read_exact(&mut ba[..n]).expect("read the first file");
        rb.read_exact(&mut bb[..n]).expect("read the second file");
        if let Some(i) = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y) {
            panic!(
                "{} and {} differ at byte {} ({:#04x} vs {:#04x})",
                a.display(),
                b.display(),
                at + i as u64,
                ba[i],
                bb[i]
            );
        }
        at += n as u64;
    }
}

/// Stop both nodes with SIGTERM, each required to exit 0; node 1 first.
fn stop_both_clean(n1: Node, n2: Node) {
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
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

/// `qemu-io -f raw <uri> -c <cmd>...` within `limit`, required to exit 0 without errors.
fn qemu_io(uri: &str, cmds: &[String], limit: Duration) -> ToolOutput {
    let mut args = vec!["-f".to_string(), "raw".to_string(), uri.to_string()];
    for c in cmds {
        args.push("-c".to_string());
        args.push(c.clone());
    }
    let out = run_tool("qemu-io", &args, limit);
    let lower = out.text().to_lowercase();
    assert!(
        !lower.contains("pattern verification failed")
            && !lower.contains("error")
            && !lower.contains("failed"),
        "qemu-io reported a problem:\n{out}"
    );
    out.assert_success();
    out
}

fn qemu_io_writes(uri: &str, regions: &[Region]) {
    let out = qemu_io(
        uri,
        &regions.iter().map(Region::write).collect::<Vec<_>>(),
        QEMU_IO_TIMEOUT,
    );
    for r in regions {
        assert!(
            out.stdout.contains(&r.wrote_line()),
            "missing {r:?}:\n{out}"
        );
    }
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
    let side1 = Side::new(1, "\"64MiB\"");
    let side2 = Side::new(2, "\"64MiB\"");
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_pair("resync-csum", &side1, &side2, |d1, d2| {
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

    let done1 = n1.wait_stdout(
        &["sync disk=vol0 done ", "kind=checksum", "role=source"],
        SYNC_TIMEOUT,
    );
    let done2 = n2.wait_stdout(
        &["sync disk=vol0 done ", "kind=checksum", "role=target"],
        SYNC_TIMEOUT,
    );
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

    stop_both_clean(n1, n2);
    let (img1, img2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    assert_files_identical(&img1, &img2);
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
        &Side::new(1, "\"16MiB\""),
        &Side::new(2, "\"16MiB\""),
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
    let done = n1.wait_stdout(
        &["sync disk=vol0 done ", "kind=verify", "role=source"],
        SYNC_TIMEOUT,
    );
    assert_eq!(field_u64(&done, "mismatches"), 1, "{done}");
    assert_eq!(field_u64(&done, "total"), 16 * MIB, "{done}");
    assert_eq!(
        field_u64(&done, "transferred"),
        CHUNK,
        "the repair should send the one differing chunk: {done}"
    );

    stop_both_clean(n1, n2);
    assert_files_identical(&image(&dir1, "vol0"), &img2);
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
    let Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    } = start_synced(tag, &Side::new(1, size), &Side::new(2, size));
    let killed = n2.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    n1.wait_log("peer lost", EVENT_TIMEOUT);

    let regions: Vec<Region> = scattered_slots(0x51075, slots, written)
        .into_iter()
        .enumerate()
        .map(|(i, slot)| Region::new(0x10 + (i % 200) as u8, slot * MIB, MIB))
        .collect();
    qemu_io_writes(&n1.uri("vol0"), &regions);
    n1.stop_clean(Sig::TERM);

    let side1 = Side::new(1, size).rate(rate);
    let side2 = Side::new(2, size).rate(rate);
    let n1 = start_dialer(&dir1, &side1, &listen);
    let n2 = start_acceptor(&dir2, &side2, &listen);
    (
        Pair {
            dir1,
            dir2,
            n1,
            n2,
            listen,
        },
        side1,
        regions,
    )
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

    let started = n1.wait_stdout(
        &["sync disk=vol0 started ", "kind=bitmap", "role=source"],
        EVENT_TIMEOUT,
    );
    assert_eq!(
        field_u64(&started, "total"),
        total,
        "the resync should cover exactly the chunks written while node 2 was away: {started}"
    );
    n2.wait_stdout(
        &["sync disk=vol0 started ", "kind=bitmap", "role=target"],
        EVENT_TIMEOUT,
    );
    // 160 MiB at 8 MiB/s: about 20 s; allow for a slow machine.
    let done = n1.wait_stdout(
        &["sync disk=vol0 done ", "kind=bitmap", "role=source"],
        Duration::from_secs(60),
    );
    assert_eq!(field_u64(&done, "total"), total, "{done}");
    assert_eq!(field_u64(&done, "done"), total, "{done}");
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

    stop_both_clean(n1, n2);
    let (img1, img2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    assert_files_identical(&img1, &img2);
    for r in regions.iter().step_by(16) {
        let got = read_file_range(&img2, r.offset, r.len as usize);
        assert_same_bytes(
            &got,
            &vec![r.byte; r.len as usize],
            &format!("node 2's replica at {r:?}"),
        );
    }
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

    let started = n1.wait_stdout(
        &["sync disk=vol0 started ", "kind=bitmap", "role=source"],
        EVENT_TIMEOUT,
    );
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
    n2.wait_stdout(
        &["sync disk=vol0 interrupted ", "kind=bitmap", "role=target"],
        EVENT_TIMEOUT,
    );

    let n1 = start_dialer(&dir1, &side1, &listen);
    let again = n1.wait_stdout(
        &["sync disk=vol0 started ", "kind=bitmap", "role=source"],
        EVENT_TIMEOUT,
    );
    let second_total = field_u64(&again, "total");
    // Up to two checkpoint intervals (1 s each) of progress may not have been durable.
    let margin = 2 * rate + MIB;
    assert!(
        second_total + done_at_kill <= first_total + margin,
        "the resync did not resume from its checkpoint: first total {first_total}, \
         {done_at_kill} bytes done at the kill, second total {second_total} (margin {margin})"
    );
    assert!(second_total > 0, "{again}");

    let done = n1.wait_stdout(
        &["sync disk=vol0 done ", "kind=bitmap", "role=source"],
        Duration::from_secs(60),
    );
    assert_eq!(field_u64(&done, "total"), second_total, "{done}");
    assert_eq!(field_u64(&done, "done"), second_total, "{done}");
    n2.wait_stdout(
        &["sync disk=vol0 done ", "kind=bitmap", "role=target"],
        EVENT_TIMEOUT,
    );

    stop_both_clean(n1, n2);
    let (img1, img2) = (image(&dir1, "vol0"), image(&dir2, "vol0"));
    assert_files_identical(&img1, &img2);
    for r in &regions {
        let got = read_file_range(&img2, r.offset, r.len as usize);
        assert_same_bytes(
            &got,
            &vec![r.byte; r.len as usize],
            &format!("node 2's replica at {r:?}"),
        );
    }
}

/// A node with one mirrored disk whose peer is never there (node 2 at a closed port):
/// the node starts and serves alone, with metadata for the disk.
fn lone_config(dir: &TestDir, disk: &str) -> String {
    format!(
        "[node]\nid = 1\ndata_dir = {}\npeer_timeout_ms = 1000\n\n\
         [[peer]]\nid = 2\naddress = \"127.0.0.1:1\"\ntransport = \"tcp\"\n\n\
         [[disk]]\nname = {}\nsize = \"16MiB\"\npeer = 2\nnbd = \"127.0.0.1:0\"\n",
        toml_str(dir.data_dir()),
        toml_str(disk)
    )
}

/// Start a lone node for `disk` once and stop it cleanly; its metadata must exist then.
fn run_lone_once(dir: &TestDir, disk: &str) -> PathBuf {
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
