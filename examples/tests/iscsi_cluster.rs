//! The SCSI state a cluster on top relies on, held across both nodes of a mirrored
//! disk's iSCSI target (issue 20), driven by the tests' raw initiator:
//!
//! - persistent reservations through a `kill -9` of the node that carried the holder's
//!   session: registrations made through both nodes, a WRITE EXCLUSIVE – REGISTRANTS
//!   ONLY reservation, unregistered writers refused on both nodes; the node killed; the
//!   holder carries on through the other node with its reservation intact and fences
//!   another registrant (PREEMPT) while the killed node is away; the killed node
//!   restarts, resyncs, reports the same state and refuses the fenced initiator from
//!   its first served command on (the write is retried at once on every NOT READY, so
//!   a node that served before settling the reservation state with its peer would
//!   accept it by its pre-kill state); replicas byte-identical.
//! - a COMPARE AND WRITE race: initiators on both nodes race one-block CAWs on the same
//!   blocks, each replacing the value it read with its own next one, as VMFS
//!   heartbeats and ATS locks do; the successes must form one linear history per block
//!   (every success's expected value is the value the previous success wrote), checked
//!   against the final data read through both nodes.

use crate::common;

use std::time::{Duration, Instant};

use common::iscsi::{Answer, IscsiTarget, RawConn, iscsi_lines};
use common::mirror::{CONNECTED, Side, assert_replicas_identical, free_loopback_addr};
use common::{Node, Sig, TestDir, image, meta};

/// How long a state change may take to show.
const CHANGE: Duration = Duration::from_secs(30);
const GOOD: u8 = 0x00;
const CHECK: u8 = 0x02;
const CONFLICT: u8 = 0x18;
/// PERSISTENT RESERVE OUT service actions and the reservation type used.
const REGISTER: u8 = 0x00;
const RESERVE: u8 = 0x01;
const PREEMPT: u8 = 0x04;
const WERO: u8 = 0x05;

fn side(id: u32) -> Side {
    Side::new(id, "vol0", "\"64MiB\"").timeout(1000)
}

fn start_n2(dir: &TestDir, listen: &str) -> Node {
    let config = side(2).config(dir, Some(listen), "127.0.0.1:1") + &iscsi_lines();
    Node::start_listening(dir, &config, &["vol0"])
}

fn start_n1(dir: &TestDir, peer: &str) -> Node {
    let config = side(1).config(dir, None, peer) + &iscsi_lines();
    Node::start(dir, &config, &["vol0"])
}

/// A mirrored pair in sync; node 1 dials node 2 at `listen`.
struct Pair {
    dir1: TestDir,
    dir2: TestDir,
    listen: String,
    n1: Node,
    n2: Node,
}

impl Pair {
    fn start(tag: &str) -> Pair {
        let dir1 = TestDir::new(&format!("{tag}-n1"));
        let dir2 = TestDir::new(&format!("{tag}-n2"));
        let listen = free_loopback_addr();
        let n2 = start_n2(&dir2, &listen);
        let n1 = start_n1(&dir1, &listen);
        for n in [&n1, &n2] {
            n.wait_log(CONNECTED, CHANGE);
            n.wait_stdout(&["sync disk=vol0 done"], CHANGE);
        }
        Pair {
            dir1,
            dir2,
            listen,
            n1,
            n2,
        }
    }
}

fn target(node: &Node) -> IscsiTarget {
    IscsiTarget::of_node(node, "vol0")
}

/// An initiator port: its name and ISID.
struct Port(&'static str, [u8; 6]);

const HOST_A: Port = Port("iqn.2026-12.io.vsan.test:host-a", [0x80, 0, 0, 0, 0, 0xa]);
const HOST_B: Port = Port("iqn.2026-12.io.vsan.test:host-b", [0x80, 0, 0, 0, 0, 0xb]);
const HOST_C: Port = Port("iqn.2026-12.io.vsan.test:host-c", [0x80, 0, 0, 0, 0, 0xc]);

fn login(node: &Node, port: &Port) -> RawConn {
    RawConn::login_as(&target(node), port.0, port.1)
}

/// `run` until it answers something other than a unit attention or NOT READY (a new
/// nexus's power-on, a state change, a node still transitioning), within [`CHANGE`].
fn settled(what: &str, mut run: impl FnMut() -> Result<Answer, String>) -> Answer {
    let deadline = Instant::now() + CHANGE;
    loop {
        let a = run().unwrap_or_else(|e| panic!("{what}: {e}"));
        let passing = a.status == CHECK && matches!(a.sense_key(), Some(0x06) | Some(0x02));
        if !passing {
            return a;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {a:x?} after {CHANGE:?}"
        );
        if a.sense_key() == Some(0x02) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn pr_out(c: &mut RawConn, action: u8, kind: u8, key: u64, sa_key: u64) -> Answer {
    let cdb = [0x5F, action, kind, 0, 0, 0, 0, 0, 24, 0];
    let mut data = [0u8; 24];
    data[..8].copy_from_slice(&key.to_be_bytes());
    data[8..16].copy_from_slice(&sa_key.to_be_bytes());
    settled("PERSISTENT RESERVE OUT", || c.command_out(&cdb, &data))
}

fn assert_good(a: &Answer, what: &str) {
    assert_eq!(a.status, GOOD, "{what}: {a:x?}");
}

/// READ KEYS: the PR generation and the registered keys (one per registered I_T
/// nexus), sorted.
fn read_keys(c: &mut RawConn) -> (u32, Vec<u64>) {
    let cdb = [0x5E, 0x00, 0, 0, 0, 0, 0, 0x10, 0x00, 0];
    let a = settled("READ KEYS", || c.command_in(&cdb, 4096));
    assert_good(&a, "READ KEYS");
    let generation = u32::from_be_bytes(a.data[0..4].try_into().unwrap());
    let len = u32::from_be_bytes(a.data[4..8].try_into().unwrap()) as usize;
    let mut keys: Vec<u64> = a.data[8..8 + len]
        .chunks(8)
        .map(|k| u64::from_be_bytes(k.try_into().unwrap()))
        .collect();
    keys.sort_unstable();
    (generation, keys)
}

/// READ RESERVATION: `(generation, Some((key, type)))`, or `None` without one.
fn read_reservation(c: &mut RawConn) -> (u32, Option<(u64, u8)>) {
    let cdb = [0x5E, 0x01, 0, 0, 0, 0, 0, 0x10, 0x00, 0];
    let a = settled("READ RESERVATION", || c.command_in(&cdb, 4096));
    assert_good(&a, "READ RESERVATION");
    let generation = u32::from_be_bytes(a.data[0..4].try_into().unwrap());
    let len = u32::from_be_bytes(a.data[4..8].try_into().unwrap());
    if len == 0 {
        return (generation, None);
    }
    let key = u64::from_be_bytes(a.data[8..16].try_into().unwrap());
    (generation, Some((key, a.data[21] & 0x0f)))
}

/// The LU's logical block size (READ CAPACITY(10)).
fn block_size(c: &mut RawConn) -> usize {
    let a = settled("READ CAPACITY", || {
        c.command_in(&[0x25, 0, 0, 0, 0, 0, 0, 0, 0, 0], 8)
    });
    assert_good(&a, "READ CAPACITY");
    u32::from_be_bytes(a.data[4..8].try_into().unwrap()) as usize
}

fn write_block(c: &mut RawConn, lba: u32, data: &[u8]) -> Answer {
    let mut cdb = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    settled("WRITE(10)", || c.command_out(&cdb, data))
}

fn read_block(c: &mut RawConn, lba: u32, bs: usize) -> Vec<u8> {
    let mut cdb = [0x28, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    cdb[2..6].copy_from_slice(&lba.to_be_bytes());
    let a = settled("READ(10)", || c.command_in(&cdb, bs as u32));
    assert_good(&a, "READ(10)");
    a.data
}

fn pattern(byte: u8, bs: usize) -> Vec<u8> {
    vec![byte; bs]
}

#[test]
fn persistent_reservations_hold_through_a_kill_9_of_the_holders_node_and_its_restart() {
    let Pair {
        dir1,
        dir2,
        listen,
        n1,
        n2,
    } = Pair::start("iscsi-pr-kill");
    const KA: u64 = 0xAAAA_0000_0000_0001;
    const KB: u64 = 0xBBBB_0000_0000_0002;

    // Host A has a path through each node, host B one through node 2; host C, through
    // both, never registers.
    let mut a1 = login(&n1, &HOST_A);
    let mut a2 = login(&n2, &HOST_A);
    let mut b2 = login(&n2, &HOST_B);
    let mut c1 = login(&n1, &HOST_C);
    let mut c2 = login(&n2, &HOST_C);
    let bs = block_size(&mut a1);
    assert_good(
        &pr_out(&mut a1, REGISTER, 0, 0, KA),
        "A registers through node 1",
    );
    assert_good(
        &pr_out(&mut a2, REGISTER, 0, 0, KA),
        "A registers through node 2",
    );
    assert_good(
        &pr_out(&mut b2, REGISTER, 0, 0, KB),
        "B registers through node 2",
    );
    assert_good(
        &pr_out(&mut a1, RESERVE, WERO, KA, 0),
        "A reserves WRITE EXCLUSIVE - REGISTRANTS ONLY through node 1",
    );
    let before = read_keys(&mut c2);
    assert_eq!(before.1, vec![KA, KA, KB], "the keys through node 2");
    assert_eq!(
        read_keys(&mut c1),
        before,
        "node 1 reports what node 2 does"
    );
    assert_eq!(read_reservation(&mut b2).1, Some((KA, WERO)));
    assert_eq!(read_reservation(&mut c1).1, Some((KA, WERO)));

    // Registrants write through either node; the unregistered host is refused on both.
    assert_good(
        &write_block(&mut a1, 0, &pattern(0xA1, bs)),
        "A writes via node 1",
    );
    assert_good(
        &write_block(&mut b2, 1, &pattern(0xB2, bs)),
        "B writes via node 2",
    );
    for (c, node) in [(&mut c1, 1), (&mut c2, 2)] {
        let a = write_block(c, 2, &pattern(0xCC, bs));
        assert_eq!(a.status, CONFLICT, "C's write through node {node}: {a:x?}");
    }
    assert_eq!(
        read_block(&mut c2, 0, bs),
        pattern(0xA1, bs),
        "C reads (WE allows it)"
    );
    assert_eq!(
        read_block(&mut c2, 2, bs),
        pattern(0, bs),
        "the refused write left nothing"
    );

    // Node 1, which carried the reservation holder's session, is killed. Host A carries
    // on through node 2: its reservation and registrations are intact.
    drop((a1, c1));
    let killed = n1.stop(Sig::KILL);
    assert!(!killed.status.success());
    n2.wait_log("peer lost", CHANGE);
    let (generation, keys) = read_keys(&mut a2);
    assert_eq!(
        (generation, keys),
        before,
        "the registrations, through node 2 alone"
    );
    assert_eq!(read_reservation(&mut a2).1, Some((KA, WERO)));
    assert_good(
        &write_block(&mut a2, 3, &pattern(0xA2, bs)),
        "A writes via node 2",
    );
    let a = write_block(&mut c2, 3, &pattern(0xCC, bs));
    assert_eq!(
        a.status, CONFLICT,
        "C is still refused on node 2 alone: {a:x?}"
    );

    // While node 1 is away, A fences B (PREEMPT its key), as a cluster does to a host it
    // lost: B's writes are refused from now on.
    assert_good(&pr_out(&mut a2, PREEMPT, WERO, KA, KB), "A preempts B");
    let a = write_block(&mut b2, 4, &pattern(0xBB, bs));
    assert_eq!(a.status, CONFLICT, "fenced B through node 2: {a:x?}");
    let fenced = read_keys(&mut c2);
    assert_eq!(fenced.1, vec![KA, KA], "B's registration is gone");
    assert!(fenced.0 > before.0, "the generation moved: {fenced:?}");

    // Node 1 restarts and resyncs from node 2. Host B tries to write through it from the
    // moment it logs in: node 1 must refuse it (its own state before the kill had B
    // registered) from its first answer that is not NOT READY.
    let n1 = start_n1(&dir1, &listen);
    let mut b1 = login(&n1, &HOST_B);
    // Retried at once on every NOT READY, so the first command node 1 serves is this one.
    let mut cdb = [0x2A, 0, 0, 0, 0, 0, 0, 0, 1, 0];
    cdb[2..6].copy_from_slice(&5u32.to_be_bytes());
    let deadline = Instant::now() + CHANGE;
    let a = loop {
        let a = b1
            .command_out(&cdb, &pattern(0xBB, bs))
            .expect("B's WRITE through the restarted node 1");
        let waiting = a.status == CHECK && matches!(a.sense_key(), Some(0x06) | Some(0x02));
        if !waiting || Instant::now() > deadline {
            break a;
        }
    };
    assert_eq!(
        a.status, CONFLICT,
        "fenced B through the restarted node 1: {a:x?}"
    );
    n1.wait_log(CONNECTED, CHANGE);
    n1.wait_stdout(&["sync disk=vol0 done"], CHANGE);
    let mut c1 = login(&n1, &HOST_C);
    assert_eq!(read_keys(&mut c1), fenced, "node 1 after its restart");
    assert_eq!(read_reservation(&mut c1), read_reservation(&mut c2));
    assert_eq!(read_reservation(&mut c1).1, Some((KA, WERO)));
    let a = write_block(&mut c1, 6, &pattern(0xCC, bs));
    assert_eq!(a.status, CONFLICT, "C through the restarted node 1: {a:x?}");
    // Host A's path through node 1 is back (its registration there survived).
    let mut a1 = login(&n1, &HOST_A);
    assert_good(
        &write_block(&mut a1, 7, &pattern(0xA7, bs)),
        "A via node 1 again",
    );
    assert_eq!(
        read_block(&mut a1, 3, bs),
        pattern(0xA2, bs),
        "resynced data"
    );
    assert_eq!(
        read_block(&mut a1, 4, bs),
        pattern(0, bs),
        "B's refused write"
    );
    assert_eq!(
        read_block(&mut a1, 5, bs),
        pattern(0, bs),
        "B's refused write"
    );
    drop((a1, a2, b1, b2, c1, c2));

    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
    // The reservation state is in each replica's metadata, no file of its own: A's key
    // (as the state encodes it, big-endian) in the SCSI state area of both.
    for (dir, node) in [(&dir1, 1), (&dir2, 2)] {
        assert!(
            !dir.data_dir().join("vol0.scsi-state").exists(),
            "node {node} kept a state file"
        );
        let m = std::fs::read(meta(dir, "vol0")).expect("the metadata file");
        let area = m
            .windows(8)
            .position(|w| w == b"VSANSCSI")
            .unwrap_or_else(|| panic!("node {node}: no SCSI state in the metadata"));
        assert!(
            m[area..].windows(8).any(|w| w == KA.to_be_bytes()),
            "node {node}: A's registration is not in the metadata's SCSI state"
        );
    }
}

/// One COMPARE AND WRITE that won: on `block`, `old` replaced by `new`.
struct Win {
    block: u32,
    old: Vec<u8>,
    new: Vec<u8>,
}

/// COMPARE AND WRITE (16) of one block: `old` expected, `new` written.
fn compare_and_write(c: &mut RawConn, lba: u32, old: &[u8], new: &[u8]) -> Answer {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x89;
    cdb[2..10].copy_from_slice(&u64::from(lba).to_be_bytes());
    cdb[13] = 1;
    let data = [old, new].concat();
    settled("COMPARE AND WRITE", || c.command_out(&cdb, &data))
}

/// A block's value written by `worker` as its `n`th: unique over the whole race.
fn stamp(worker: u32, n: u32, bs: usize) -> Vec<u8> {
    let mut v = vec![0u8; bs];
    for (i, b) in v.iter_mut().enumerate() {
        *b = (worker as usize * 131 + n as usize * 7 + i) as u8;
    }
    v[..4].copy_from_slice(&worker.to_be_bytes());
    v[4..8].copy_from_slice(&(n + 1).to_be_bytes());
    v
}

#[test]
fn compare_and_write_races_through_both_nodes_form_one_history_per_block() {
    let Pair {
        dir1,
        dir2,
        listen: _,
        n1,
        n2,
    } = Pair::start("iscsi-caw-race");
    // Two initiators per node, each racing CAWs over the same few blocks.
    const BLOCKS: u32 = 3;
    const FIRST: u32 = 64;
    const ROUNDS: u32 = 120;
    let targets = [target(&n1), target(&n2)];
    let outcomes: Vec<(Vec<Win>, u32)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4u32)
            .map(|w| {
                let t = &targets[w as usize % 2];
                s.spawn(move || {
                    let port = Port("iqn.2026-12.io.vsan.test:caw", [0x80, 1, 0, 0, 0, w as u8]);
                    let mut c = RawConn::login_as(t, port.0, port.1);
                    let bs = block_size(&mut c);
                    let mut wins = Vec::new();
                    let mut lost = 0;
                    for n in 0..ROUNDS {
                        let block = FIRST + (n + w) % BLOCKS;
                        let old = read_block(&mut c, block, bs);
                        let new = stamp(w, n, bs);
                        let a = compare_and_write(&mut c, block, &old, &new);
                        match (a.status, a.sense_key(), a.asc_ascq()) {
                            (GOOD, _, _) => wins.push(Win { block, old, new }),
                            (CHECK, Some(0x0E), Some((0x1D, 0x00))) => lost += 1,
                            _ => panic!("worker {w}: COMPARE AND WRITE answered {a:x?}"),
                        }
                    }
                    (wins, lost)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("a CAW worker"))
            .collect()
    });
    let mut c1 = login(&n1, &HOST_C);
    let mut c2 = login(&n2, &HOST_C);
    let bs = block_size(&mut c1);
    let (won, lost): (usize, u32) = outcomes
        .iter()
        .fold((0, 0), |(w, l), (wins, lost)| (w + wins.len(), l + lost));
    eprintln!("CAW race: {won} won, {lost} miscompared, over {BLOCKS} blocks through both nodes");
    assert!(lost > 0, "no CAW ever lost: the race did not race");
    for block in FIRST..FIRST + BLOCKS {
        let wins: Vec<&Win> = outcomes
            .iter()
            .flat_map(|(w, _)| w)
            .filter(|w| w.block == block)
            .collect();
        // One linear history: from the initial zeros, each value is replaced by exactly
        // one winner (two winners expecting the same value break atomicity), and the walk
        // visits every winner and ends at the block's final content.
        let mut value = vec![0u8; bs];
        let mut seen = 0;
        loop {
            let next: Vec<&&Win> = wins.iter().filter(|w| w.old == value).collect();
            match next.len() {
                0 => break,
                1 => {
                    value = next[0].new.clone();
                    seen += 1;
                }
                n => panic!("block {block}: {n} COMPARE AND WRITEs won over the same value"),
            }
            assert!(seen <= wins.len(), "block {block}: the history loops");
        }
        assert_eq!(
            seen,
            wins.len(),
            "block {block}: {} winners are not on the one history",
            wins.len() - seen
        );
        assert_eq!(
            read_block(&mut c1, block, bs),
            value,
            "block {block} through node 1"
        );
        assert_eq!(
            read_block(&mut c2, block, bs),
            value,
            "block {block} through node 2"
        );
    }
    drop((c1, c2));
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}

/// The median and 99th percentile of `v` (sorted in place), in microseconds.
fn p50_p99(v: &mut [Duration]) -> (f64, f64) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (at(0.5), at(0.99))
}

/// `ops` one-block commands, each timed, on `c`: WRITE(10) when `caw` is false, else
/// COMPARE AND WRITE chained on the block's last value (uncontended: every one wins).
fn timed_ops(
    c: &mut RawConn,
    lba: u32,
    bs: usize,
    ops: u32,
    caw: bool,
    salt: u32,
) -> Vec<Duration> {
    let mut last = read_block(c, lba, bs);
    let mut times = Vec::with_capacity(ops as usize);
    for n in 0..ops {
        let new = stamp(salt, n, bs);
        let started = Instant::now();
        let a = if caw {
            compare_and_write(c, lba, &last, &new)
        } else {
            write_block(c, lba, &new)
        };
        times.push(started.elapsed());
        assert_good(
            &a,
            if caw {
                "an uncontended COMPARE AND WRITE"
            } else {
                "WRITE"
            },
        );
        last = new;
    }
    times
}

/// Benchmark (BENCHMARKS.md, issue 20): uncontended one-block COMPARE AND WRITE against
/// a one-block WRITE through the same mirrored disk, at QD1 (one session) and QD32 (32
/// sessions, one command each in flight, each on its own block, half through each
/// node), and PERSISTENT RESERVE OUT latency through each node. Prints the figures;
/// asserts only that every command succeeded.
/// `cargo test --release -p vsan-examples --test nodes -- --ignored iscsi_cluster::bench --nocapture`
#[test]
#[ignore = "a benchmark: prints figures, takes about 10 s"]
fn bench_compare_and_write_and_pr_out_against_write() {
    let Pair {
        dir1,
        dir2,
        listen: _,
        n1,
        n2,
    } = Pair::start("iscsi-caw-bench");
    let ops: u32 = std::env::var("VSAN_CAW_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let cpu = || n1.cpu() + n2.cpu();
    let targets = [target(&n1), target(&n2)];
    println!("| what | depth | IOPS | p50 us | p99 us | CPU us / op (both nodes) |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut qd1 = [0.0f64; 2];
    for (i, caw) in [false, true].into_iter().enumerate() {
        let name = if caw {
            "COMPARE AND WRITE"
        } else {
            "WRITE(10)"
        };
        // QD1 through node 2 (the non-resolver: a CAW's lock there is the first of two).
        let mut c = RawConn::login_as(&targets[1], HOST_A.0, HOST_A.1);
        let bs = block_size(&mut c);
        let cpu0 = cpu();
        let started = Instant::now();
        let mut t = timed_ops(&mut c, 10, bs, ops, caw, 1);
        let took = started.elapsed();
        let used = cpu() - cpu0;
        let (p50, p99) = p50_p99(&mut t);
        qd1[i] = p50;
        println!(
            "| {name} | 1 | {:.0} | {p50:.0} | {p99:.0} | {:.1} |",
            f64::from(ops) / took.as_secs_f64(),
            used.as_secs_f64() * 1e6 / f64::from(ops)
        );
        // QD32: 32 sessions, 16 through each node, each on its own block: 32 adjacent
        // blocks (in one 1 MiB lock region, as VMFS's heartbeat slots are), and 32
        // blocks 1 MiB apart (each in its own region).
        for (spacing, layout) in [(1u32, "adjacent blocks"), (2048, "blocks 1 MiB apart")] {
            let per = (ops / 32).max(50);
            let cpu0 = cpu();
            let started = Instant::now();
            let mut all: Vec<Duration> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..32u32)
                    .map(|w| {
                        let t = &targets[w as usize % 2];
                        s.spawn(move || {
                            let isid = [0x80, 2, 0, spacing as u8, i as u8, w as u8];
                            let mut c =
                                RawConn::login_as(t, "iqn.2026-12.io.vsan.test:bench", isid);
                            let bs = block_size(&mut c);
                            timed_ops(&mut c, 100 + w * spacing, bs, per, caw, 100 + w)
                        })
                    })
                    .collect();
                hs.into_iter()
                    .flat_map(|h| h.join().expect("a bench session"))
                    .collect()
            });
            let took = started.elapsed();
            let used = cpu() - cpu0;
            let total = all.len() as f64;
            let (p50, p99) = p50_p99(&mut all);
            println!(
                "| {name}, {layout} | 32 | {:.0} | {p50:.0} | {p99:.0} | {:.1} |",
                total / took.as_secs_f64(),
                used.as_secs_f64() * 1e6 / total
            );
        }
    }
    println!("QD1 p50 COMPARE AND WRITE / WRITE: {:.2}x", qd1[1] / qd1[0]);
    // PERSISTENT RESERVE OUT: REGISTER then unregister (REGISTER to key 0), through each
    // node (node 1 orders them; node 2 forwards to it).
    for (n, t) in targets.iter().enumerate() {
        let mut c = RawConn::login_as(t, HOST_B.0, HOST_B.1);
        let mut times = Vec::new();
        for i in 0..200u64 {
            let key = 0x1000 + i;
            let started = Instant::now();
            assert_good(&pr_out(&mut c, REGISTER, 0, 0, key), "REGISTER");
            assert_good(&pr_out(&mut c, REGISTER, 0, key, 0), "unregister");
            times.push(started.elapsed() / 2);
        }
        let (p50, p99) = p50_p99(&mut times);
        println!(
            "PERSISTENT RESERVE OUT (REGISTER) through node {}: p50 {p50:.0} us, p99 {p99:.0} us",
            n + 1
        );
    }
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}
