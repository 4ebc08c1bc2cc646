//! A real Linux guest (the host distribution's kernel under qemu, see `common::guest`)
//! on a vhost-user-blk disk: raw O_DIRECT writes from two vCPUs on two queues, a flush,
//! a discard, a write at the last block and one past it, then an ext2 filesystem made,
//! filled, remounted and read back. What the guest read back (CRC-32s it prints) must
//! match what the host expects, and so must the disk's bytes seen from outside: over
//! the node's NBD export while it runs, in its image file after it stops, and through
//! `e2fsck -fn` and `debugfs` for the filesystem.
//!
//! The same workload first runs against `qemu-storage-daemon`'s vhost-user-blk export,
//! which proves the guest harness and the workload on a backend nobody here wrote; the
//! second boot is the one against `vsan-node`.
//!
//! Layout of the 64 MiB disk, in 4 KiB blocks:
//!
//! ```text
//!      0 .. 10240   ext2 (40 MiB): /busybox, /random (1.5 MiB), /many/f1..f64
//!  10240 ..         A: busybox blocks [0, n), written from vCPU 0
//!  11264 ..         B: busybox blocks [64, n), written from vCPU 1 at the same time
//!  12288 .. 12544   R: 1 MiB from /dev/urandom in 64 KiB writes
//!  13312 .. 13568   D: busybox blocks [0, 256), then blocks 64..192 of it discarded
//!  16383            L: busybox block 7 (the last block, written with conv=fsync)
//!  16384            past the end: the write must be refused
//! ```
//! (`n` is busybox's size in whole blocks, at most 1024.) The guest's busybox is the
//! host's, so the host knows every byte but R's, which it checks by CRC.

use crate::common;

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::guest::{Guest, GuestKit, GuestRun};
use common::{
    ProcessGuard, Sig, TOOL_TIMEOUT, TestDir, assert_same_bytes, field, image, node_section,
    read_file_range, require_tool, run_tool, toml_str,
};

const BLOCK: u64 = 4096;
const DISK_BLOCKS: u64 = 16384;
const DISK_SIZE: u64 = DISK_BLOCKS * BLOCK;
const QUEUES: u16 = 2;

const FS_BLOCKS: u64 = 10240;
const A_AT: u64 = 10240;
const B_AT: u64 = 11264;
const B_SKIP: u64 = 64;
const R_AT: u64 = 12288;
const R_BLOCKS: u64 = 256;
const D_AT: u64 = 13312;
const D_BLOCKS: u64 = 256;
const D_HOLE: (u64, u64) = (64, 128);
const L_AT: u64 = DISK_BLOCKS - 1;
const L_SOURCE: u64 = 7;
const SMALL_FILES: usize = 64;
// Region R is written in 64 KiB units.
const _: () = assert!(R_AT % 16 == 0);

/// The guest's side; the layout's numbers are prepended as shell variables by
/// [`workload`]. Block numbers are in 4 KiB units.
const WORKLOAD: &str = r#"
B=/dev/vda
echo "SIZE_SECTORS=$(cat /sys/block/vda/size)"
echo "QUEUES=$(ls /sys/block/vda/mq | wc -l)"
echo "WRITE_CACHE=$(cat /sys/block/vda/queue/write_cache)"
echo "DISCARD_MAX=$(cat /sys/block/vda/queue/discard_max_bytes)"
echo "LOGICAL_BLOCK=$(cat /sys/block/vda/queue/logical_block_size)"

# Two writers at once, one per vCPU and so one per queue.
taskset -c 0 dd if=/bin/busybox of=$B bs=4k count=$BB_BLOCKS seek=$A_AT \
    oflag=direct conv=notrunc 2>/dev/null &
a=$!
taskset -c 1 dd if=/bin/busybox of=$B bs=4k skip=$B_SKIP count=$((BB_BLOCKS - B_SKIP)) \
    seek=$B_AT oflag=direct conv=notrunc 2>/dev/null &
b=$!
wait $a
wait $b

dd if=/dev/urandom of=/tmp/random bs=4k count=$R_BLOCKS 2>/dev/null
echo "RANDOM_CRC=$(crc32 < /tmp/random)"
dd if=/tmp/random of=$B bs=64k seek=$((R_AT / 16)) oflag=direct conv=notrunc 2>/dev/null

dd if=/bin/busybox of=$B bs=4k count=$D_BLOCKS seek=$D_AT oflag=direct conv=notrunc 2>/dev/null
blkdiscard -o $(((D_AT + HOLE_AT) * 4096)) -l $((HOLE_BLOCKS * 4096)) $B
echo "DISCARD=done"

# The last block, with an fsync (a FLUSH request); then one past the end.
dd if=/bin/busybox of=$B bs=4k skip=$L_SOURCE count=1 seek=$L_AT oflag=direct \
    conv=notrunc,fsync 2>/dev/null
if dd if=/bin/busybox of=$B bs=4k count=1 seek=$((L_AT + 1)) oflag=direct conv=notrunc \
    2>/dev/null
then echo "PAST_END=written"
else echo "PAST_END=refused"
fi
blockdev --flushbufs $B
sync

crc() { dd if=$B bs=4k skip=$1 count=$2 iflag=direct 2>/dev/null | crc32; }
echo "READ_A_CRC=$(crc $A_AT $BB_BLOCKS)"
echo "READ_B_CRC=$(crc $B_AT $((BB_BLOCKS - B_SKIP)))"
echo "READ_R_CRC=$(crc $R_AT $R_BLOCKS)"
echo "READ_D_CRC=$(crc $D_AT $D_BLOCKS)"
echo "READ_L_CRC=$(crc $L_AT 1)"

mke2fs -F -b 4096 -L vsan-guest $B $((FS_BLOCKS * 4)) >/dev/null
mount -t ext2 $B /mnt
cp /bin/busybox /mnt/busybox
dd if=/dev/urandom of=/mnt/random bs=4k count=384 2>/dev/null
mkdir /mnt/many
i=1
while [ $i -le $SMALL_FILES ]; do echo "small file $i" > /mnt/many/f$i; i=$((i + 1)); done
echo "FILE_RANDOM_CRC=$(crc32 < /mnt/random)"
umount /mnt
echo 3 > /proc/sys/vm/drop_caches
mount -t ext2 -o ro $B /mnt
echo "REREAD_RANDOM_CRC=$(crc32 < /mnt/random)"
echo "REREAD_BUSYBOX_CRC=$(crc32 < /mnt/busybox)"
echo "REREAD_FILES=$(ls /mnt/many | wc -l)"
umount /mnt
"#;

/// `n`: busybox's size in whole 4 KiB blocks, capped so region A fits before B.
fn busybox_blocks(busybox: &[u8]) -> u64 {
    let n = (busybox.len() as u64 / BLOCK).min(B_AT - A_AT);
    assert!(
        n >= D_BLOCKS.max(B_SKIP + 1),
        "busybox ({} bytes) is too small for this workload",
        busybox.len()
    );
    n
}

/// [`WORKLOAD`] with the layout's numbers set.
fn workload(busybox: &[u8]) -> String {
    let vars = [
        ("BB_BLOCKS", busybox_blocks(busybox)),
        ("FS_BLOCKS", FS_BLOCKS),
        ("A_AT", A_AT),
        ("B_AT", B_AT),
        ("B_SKIP", B_SKIP),
        ("R_AT", R_AT),
        ("R_BLOCKS", R_BLOCKS),
        ("D_AT", D_AT),
        ("D_BLOCKS", D_BLOCKS),
        ("HOLE_AT", D_HOLE.0),
        ("HOLE_BLOCKS", D_HOLE.1),
        ("L_AT", L_AT),
        ("L_SOURCE", L_SOURCE),
        ("SMALL_FILES", SMALL_FILES as u64),
    ];
    let mut script: String = vars.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    script.push_str(WORKLOAD);
    script
}

fn blocks(bytes: &[u8], from: u64, count: u64) -> &[u8] {
    &bytes[(from * BLOCK) as usize..((from + count) * BLOCK) as usize]
}

fn crc(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// A disk's region: where it is, what the guest said it read there, what it must hold.
struct Expected {
    name: &'static str,
    at: u64,
    bytes: Vec<u8>,
}

/// Every region the workload leaves, but R (random, known by CRC only).
fn expected_regions(busybox: &[u8]) -> Vec<Expected> {
    let n = busybox_blocks(busybox);
    let mut d = blocks(busybox, 0, D_BLOCKS).to_vec();
    d[(D_HOLE.0 * BLOCK) as usize..((D_HOLE.0 + D_HOLE.1) * BLOCK) as usize].fill(0);
    vec![
        Expected {
            name: "A",
            at: A_AT,
            bytes: blocks(busybox, 0, n).to_vec(),
        },
        Expected {
            name: "B",
            at: B_AT,
            bytes: blocks(busybox, B_SKIP, n - B_SKIP).to_vec(),
        },
        Expected {
            name: "D",
            at: D_AT,
            bytes: d,
        },
        Expected {
            name: "L",
            at: L_AT,
            bytes: blocks(busybox, L_SOURCE, 1).to_vec(),
        },
    ]
}

/// What the guest saw of its disk, and that every read back matched what it wrote.
fn check_guest(run: &GuestRun, busybox: &[u8]) {
    run.assert_ok();
    assert_eq!(run.value_u64("SIZE_SECTORS"), DISK_SIZE / 512, "{run}");
    assert_eq!(run.value_u64("QUEUES"), u64::from(QUEUES), "{run}");
    assert!(
        run.value_u64("DISCARD_MAX") > 0,
        "no discard offered\n{run}"
    );
    assert_eq!(run.value("DISCARD"), "done", "{run}");
    assert_eq!(run.value("PAST_END"), "refused", "{run}");
    for r in expected_regions(busybox) {
        assert_eq!(
            run.value(&format!("READ_{}_CRC", r.name)),
            crc(&r.bytes),
            "the guest read region {} back wrong\n{run}",
            r.name
        );
    }
    let random = run.value("RANDOM_CRC");
    assert_eq!(run.value("READ_R_CRC"), random, "region R read back\n{run}");
    let file = run.value("FILE_RANDOM_CRC");
    assert_eq!(
        run.value("REREAD_RANDOM_CRC"),
        file,
        "/random reread\n{run}"
    );
    assert_eq!(run.value("REREAD_BUSYBOX_CRC"), crc(busybox), "{run}");
    assert_eq!(run.value_u64("REREAD_FILES"), SMALL_FILES as u64, "{run}");
}

/// `disk` (a file holding the whole disk, not used by anything else) holds what the
/// guest wrote: the raw regions byte for byte, R by its CRC, and a clean ext2 with the
/// guest's files in its first 40 MiB.
fn check_disk(disk: &Path, run: &GuestRun, busybox: &[u8], scratch: &TestDir) {
    let len = std::fs::metadata(disk).map(|m| m.len()).unwrap_or(0);
    assert_eq!(len, DISK_SIZE, "{} has the wrong size", disk.display());
    for r in expected_regions(busybox) {
        let got = read_file_range(disk, r.at * BLOCK, r.bytes.len());
        assert_same_bytes(&got, &r.bytes, &format!("region {} on the disk", r.name));
    }
    let random = read_file_range(disk, R_AT * BLOCK, (R_BLOCKS * BLOCK) as usize);
    assert_eq!(
        crc(&random),
        run.value("RANDOM_CRC"),
        "region R on the disk"
    );

    // The filesystem ends where region A starts; e2fsck and debugfs see only it.
    let fsck = run_tool(
        "e2fsck",
        &[OsStr::new("-fn"), disk.as_os_str()],
        TOOL_TIMEOUT,
    );
    fsck.assert_success();
    let dump = |name: &str| {
        let out = scratch.join(format!("dumped-{}", name.replace('/', "_")));
        let cmd = format!("dump {name} {}", out.display());
        run_tool(
            "debugfs",
            &[OsStr::new("-R"), OsStr::new(&cmd), disk.as_os_str()],
            TOOL_TIMEOUT,
        )
        .assert_success();
        std::fs::read(&out).unwrap_or_else(|e| panic!("debugfs dumped no {name}: {e}"))
    };
    assert_same_bytes(&dump("/busybox"), busybox, "/busybox in the guest's ext2");
    assert_eq!(
        crc(&dump("/random")),
        run.value("FILE_RANDOM_CRC"),
        "/random in the guest's ext2"
    );
    for i in [1, 17, SMALL_FILES] {
        let got = dump(&format!("/many/f{i}"));
        assert_eq!(got, format!("small file {i}\n").as_bytes(), "/many/f{i}");
    }
    let ls = run_tool(
        "debugfs",
        &[
            OsStr::new("-R"),
            OsStr::new("ls -p /many"),
            disk.as_os_str(),
        ],
        TOOL_TIMEOUT,
    );
    ls.assert_success();
    // `ls -p` lines: /inode/mode/uid/gid/name/size/
    let files = ls
        .stdout
        .lines()
        .filter(|l| l.split('/').nth(5).is_some_and(|n| n.starts_with('f')))
        .count();
    assert_eq!(files, SMALL_FILES, "{ls}");
}

fn tools_for_checks() -> bool {
    require_tool("e2fsck") && require_tool("debugfs")
}

/// Wait until `path` exists (the daemon binds its socket before it serves).
fn wait_for_socket(path: &Path, process: &mut ProcessGuard, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !path.exists() {
        if let Ok(Some(status)) = process.child_mut().try_wait() {
            panic!(
                "the backend exited ({status}) before it made {}",
                path.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "no socket {} within {limit:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_guest_on_qemu_storage_daemon_reads_back_its_writes_and_filesystem() {
    let Some(kit) = GuestKit::find() else { return };
    if !require_tool("qemu-storage-daemon") || !tools_for_checks() {
        return;
    }
    let dir = TestDir::new("guest-qsd");
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(DISK_SIZE))
        .expect("create the image");
    let sock = dir.socket("vu.sock");
    let mut cmd = Command::new("qemu-storage-daemon");
    cmd.arg("--blockdev")
        .arg(format!(
            "driver=file,node-name=f,filename={},discard=unmap",
            img.display()
        ))
        .arg("--export")
        .arg(format!(
            "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path={},writable=on,\
             num-queues={QUEUES}",
            sock.display()
        ));
    let child = cmd
        .stdin(Stdio::null())
        .spawn()
        .expect("start qemu-storage-daemon");
    let mut qsd = ProcessGuard::new(child, Some(Sig::TERM));
    wait_for_socket(&sock, &mut qsd, Duration::from_secs(10));

    let busybox = kit.busybox();
    let run = Guest::new(&kit, &sock, &workload(busybox))
        .queues(QUEUES)
        .boot(&dir);
    eprintln!(
        "guest on qemu-storage-daemon: {:?}\n{}",
        run.elapsed,
        run.output()
    );
    check_guest(&run, busybox);

    qsd.signal(Sig::TERM);
    assert!(
        qsd.wait(Duration::from_secs(10)).is_some(),
        "qemu-storage-daemon did not exit"
    );
    check_disk(&img, &run, busybox, &dir);
}

#[test]
fn a_guest_on_a_vsan_node_sees_its_writes_and_the_node_serves_them_over_nbd() {
    let Some(kit) = GuestKit::find() else { return };
    if !require_tool("qemu-img") || !tools_for_checks() {
        return;
    }
    let dir = TestDir::new("guest-vsan");
    let sock = dir.socket("vu.sock");
    let config = format!(
        "{}{}\n[[disk]]\nname = \"vol0\"\nsize = {DISK_SIZE}\nnbd = \"127.0.0.1:0\"\n\
         vhost_user = {}\nvhost_user_queues = {QUEUES}\n",
        node_section(&dir),
        common::vsanctl::MGMT,
        toml_str(&sock),
    );
    let node = common::Node::start(&dir, &config, &["vol0"]);
    let ready = node.wait_stdout(
        &["ready ", "disk=vol0", "vhost_user="],
        common::READY_TIMEOUT,
    );
    assert_eq!(
        field(&ready, "vhost_user").as_deref(),
        sock.to_str(),
        "{ready}"
    );

    let busybox = kit.busybox();
    let run = Guest::new(&kit, &sock, &workload(busybox))
        .queues(QUEUES)
        .boot(&dir);
    eprintln!("guest on vsan-node: {:?}\n{}", run.elapsed, run.output());
    check_guest(&run, busybox);
    assert_eq!(run.value("WRITE_CACHE"), "write back", "{run}");

    // What a client of the node reads, while the node still runs.
    let copy = dir.join("over-nbd.img");
    run_tool(
        "qemu-img",
        &[
            OsStr::new("convert"),
            OsStr::new("-f"),
            OsStr::new("raw"),
            OsStr::new("-O"),
            OsStr::new("raw"),
            OsStr::new(&node.uri("vol0")),
            copy.as_os_str(),
        ],
        TOOL_TIMEOUT,
    )
    .assert_success();
    check_disk(&copy, &run, busybox, &dir);

    // A well-behaved guest: no chain refused, no used-ring error, no connection error
    // while it ran (the log up to here; the shutdown after is not the guest's doing).
    let log = node.log();
    let complaints: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("vhost-user") && (l.contains("WARN") || l.contains("ERROR")))
        .collect();
    assert!(complaints.is_empty(), "the node complained:\n{log}");

    // The two writers ran pinned to the two vCPUs, and Linux maps one queue per CPU:
    // both queues carried writes (the node's own per-queue counters, as vsanctl shows
    // them).
    let mgmt = common::vsanctl::mgmt_addr(&node);
    let json = common::vsanctl::vsanctl_ok(&mgmt, &["--json", "status", "vol0"]).text();
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("vsanctl --json");
    let queues = v["vhost_user"]["queues"]
        .as_array()
        .unwrap_or_else(|| panic!("no vhost_user.queues in {v}"));
    assert_eq!(queues.len(), usize::from(QUEUES), "{v}");
    for (i, q) in queues.iter().enumerate() {
        let writes = q["writes"].as_u64().unwrap_or(0);
        assert!(writes > 0, "queue {i} carried no write: {v}");
    }

    node.stop_clean(Sig::TERM);
    let on_disk = std::fs::read(image(&dir, "vol0")).expect("read the node's image");
    let served = std::fs::read(&copy).expect("read the NBD copy");
    assert_same_bytes(&on_disk, &served, "the image file against what NBD served");
}
