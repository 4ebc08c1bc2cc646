//! `vsan-node` with a write-back cache (`[disk.cache]`) as a real process: what a client
//! wrote and had acknowledged is there after the node is killed with SIGKILL and started
//! again on the same files (the cache replays its log), after a clean stop the cache is
//! empty and the image alone holds every write, and a mirror of two cached nodes survives
//! the loss of one.
//!
//! fio (nbd engine) writes blocks carrying crc32c verification headers and checks them
//! in a separate verify-only run, against the export and against the image file. A
//! missing fio skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use common::mirror::{CONNECTED, Side, assert_replicas_identical};
use common::{
    Node, Sig, TestDir, ToolOutput, disk_section, field, field_u64, image, node_section,
    read_file_range, require_tool, run_command, toml_str,
};
use vsan_core::export::nbd::Client;
use vsan_examples::pattern::{BLOCK, BlockLog, expected_block};

const MIB: u64 = 1 << 20;
/// How long a line that some event will print may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// A limit for one fio run.
const FIO_TIMEOUT: Duration = Duration::from_secs(120);
/// The disk: 16 MiB, written whole by the fio job.
const DISK: &str = "\"16MiB\"";
/// The cache file: a 4 MiB log, a quarter of the disk, so the job's writes wrap the log
/// several times and the destager runs while it writes.
const CACHE: &str = "\"4MiB\"";

/// A `[disk.cache]` section (it belongs to the `[[disk]]` written just before it).
fn cache_section(path: &Path, size: &str) -> String {
    format!("\n[disk.cache]\npath = {}\nsize = {size}\n", toml_str(path))
}

/// Where a test keeps a node's cache file: a directory the node has to create.
fn cache_path(dir: &TestDir) -> PathBuf {
    dir.join("fast").join("vol0.cache")
}

/// The `cache disk=vol0 ...` line the node printed before its ready line.
fn cache_line(node: &Node) -> String {
    node.wait_stdout(&["cache disk=vol0 "], EVENT_TIMEOUT)
}

/// The fio job: every 4 KiB block of the 16 MiB disk written once, in random order, with
/// crc32c headers; the verify-only run reads each back in the same order and checks it.
fn job(name: &str, verify_only: bool) -> Vec<String> {
    let mut a: Vec<String> = [
        "--rw=randwrite",
        "--bs=4k",
        "--size=16m",
        "--iodepth=16",
        "--randrepeat=1",
        "--randseed=1717",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--output-format=normal",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(format!("--name={name}"));
    a.push(if verify_only {
        "--verify_only=1".into()
    } else {
        "--do_verify=0".into()
    });
    a
}

/// fio over NBD at `uri`.
fn fio_nbd(dir: &Path, uri: &str, args: &[String]) -> ToolOutput {
    let mut cmd = Command::new("fio");
    cmd.current_dir(dir)
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .args(args);
    run_command(cmd, FIO_TIMEOUT)
}

/// fio on a file (the image, once the node has stopped).
fn fio_file(dir: &Path, file: &Path, args: &[String]) -> ToolOutput {
    let mut cmd = Command::new("fio");
    cmd.current_dir(dir)
        .arg("--ioengine=psync")
        .arg(format!("--filename={}", file.display()))
        .args(args);
    run_command(cmd, FIO_TIMEOUT)
}

/// fio exited 0, its job reported `err= 0`, and nothing failed verification.
fn assert_fio_clean(out: &ToolOutput) {
    out.assert_success();
    let text = out.text();
    for bad in [
        "verify failed",
        "bad magic",
        "bad header",
        "fio: io_u error",
        "crc32c: verify",
    ] {
        assert!(!text.contains(bad), "fio reported `{bad}`:\n{out}");
    }
    assert!(text.contains("err= 0"), "no clean job summary:\n{out}");
}

/// A verify-only run that checked every block of the job (4096 reads of 4 KiB).
fn assert_verified_all(out: &ToolOutput, what: &str) {
    assert_fio_clean(out);
    assert!(
        out.text().contains("issued rwts: total=4096,"),
        "{what}: fio did not read back every block it wrote:\n{out}"
    );
}

/// A local disk with a cache: fio writes the whole disk, the node is killed (SIGKILL)
/// the moment fio is done, with cached writes not yet destaged; restarted on the same
/// files it replays the cache's log and fio verifies every block through it. A SIGTERM
/// then closes the cache (everything destaged); the next start opens it clean with
/// nothing to replay, fio verifies again, and after a last clean stop the image file
/// alone passes the verify.
#[test]
fn fio_writes_survive_kill_9_and_a_clean_stop_leaves_them_in_the_image() {
    if !require_tool("fio") {
        return;
    }
    let dir = TestDir::new("cache-fio");
    let fast = cache_path(&dir);
    let config = node_section(&dir)
        + &disk_section("vol0", DISK, "127.0.0.1:0")
        + &cache_section(&fast, CACHE);

    let node = Node::start(&dir, &config, &["vol0"]);
    let line = cache_line(&node);
    assert_eq!(field(&line, "open").as_deref(), Some("formatted"), "{line}");
    assert_eq!(
        field(&line, "mode").as_deref(),
        Some("write-back"),
        "{line}"
    );
    assert_eq!(
        std::fs::metadata(&fast).map(|m| m.len()).ok(),
        Some(4 * MIB),
        "the cache file was not made at its size"
    );
    assert_fio_clean(&fio_nbd(dir.path(), &node.uri("vol0"), &job("w", false)));
    let killed = node.stop(Sig::KILL);
    assert!(!killed.status.success(), "{}", killed.status);

    // Restarted: the log is replayed, and every block reads back as written.
    let node = Node::start(&dir, &config, &["vol0"]);
    let line = cache_line(&node);
    assert_eq!(field(&line, "open").as_deref(), Some("recovered"), "{line}");
    assert!(
        field_u64(&line, "records") > 0 && field_u64(&line, "dirty_bytes") > 0,
        "a cache killed right after 16 MiB of writes replayed nothing: {line}"
    );
    // The log is read on its own thread: the line may come a little after `ready`.
    node.wait_log("cache crash recovery", Duration::from_secs(10));
    let out = fio_nbd(dir.path(), &node.uri("vol0"), &job("v1", true));
    assert_verified_all(&out, "after the kill");

    let stopped = node.stop_clean(Sig::TERM);
    for want in [
        "cache stats",
        "cache closed: everything destaged, marked clean",
    ] {
        assert!(
            stopped.log.contains(want),
            "no `{want}` in the log:\n{}",
            stopped.log
        );
    }

    // After a clean stop: nothing to replay, and the data is all there.
    let node = Node::start(&dir, &config, &["vol0"]);
    let line = cache_line(&node);
    assert_eq!(field(&line, "open").as_deref(), Some("clean"), "{line}");
    assert_eq!(field_u64(&line, "records"), 0, "{line}");
    assert_eq!(field_u64(&line, "dirty_bytes"), 0, "{line}");
    let out = fio_nbd(dir.path(), &node.uri("vol0"), &job("v2", true));
    assert_verified_all(&out, "after a clean restart");
    node.stop_clean(Sig::TERM);

    // The cache was drained into the image: the image alone holds every block.
    let out = fio_file(dir.path(), &image(&dir, "vol0"), &job("v3", true));
    assert_verified_all(&out, "the image file");
}

/// Writers on eight connections rewrite blocks of a 4 MiB region over and over (each
/// write a new generation of its block) when the node is killed (SIGKILL). After a
/// restart every block reads back as the last generation acknowledged to its writer, or
/// the one that was in flight at the kill, never older; after a clean stop the image
/// holds exactly what the cache served.
#[test]
fn acknowledged_writes_survive_kill_9_in_the_middle_of_writing() {
    const REGION: u64 = 4 * MIB;
    const WRITERS: u64 = 8;
    let dir = TestDir::new("cache-kill");
    let config = node_section(&dir)
        + &disk_section("vol0", DISK, "127.0.0.1:0")
        + &cache_section(&cache_path(&dir), CACHE);
    let node = Node::start(&dir, &config, &["vol0"]);
    let addr = node.addr("vol0").to_string();
    let blocks = REGION / BLOCK as u64;
    let log = Arc::new(BlockLog::new(blocks));
    let stop = Arc::new(AtomicBool::new(false));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (log, stop, addr) = (log.clone(), stop.clone(), addr.clone());
            rt.spawn(async move {
                let client = Client::connect_tcp(&addr, "vol0").await.expect("connect");
                let mut x = 0x2545_f491_4f6c_dd1du64 ^ w;
                let mut acked = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Each writer owns the blocks b with b % WRITERS == w.
                    let block = (x % (blocks / WRITERS)) * WRITERS + w;
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
            })
        })
        .collect();
    thread::sleep(Duration::from_secs(3));
    node.stop(Sig::KILL);
    stop.store(true, Ordering::Relaxed);
    let acked: u64 = rt.block_on(async {
        let mut n = 0;
        for w in writers {
            n += w.await.unwrap_or(0);
        }
        n
    });
    assert!(
        acked > blocks / 2,
        "only {acked} writes were acknowledged before the kill"
    );

    let node = Node::start(&dir, &config, &["vol0"]);
    let line = cache_line(&node);
    eprintln!("{acked} writes acknowledged before the kill; after it: {line}");
    assert_eq!(field(&line, "open").as_deref(), Some("recovered"), "{line}");
    assert!(field_u64(&line, "records") > 0, "{line}");
    let addr = node.addr("vol0").to_string();
    let served = rt.block_on(async {
        let client = Client::connect_tcp(&addr, "vol0").await.expect("connect");
        let mut all = Vec::with_capacity(REGION as usize);
        for at in (0..REGION).step_by(MIB as usize) {
            let got = client.read(at, MIB as u32).await.expect("read");
            all.extend_from_slice(&got);
        }
        client.disconnect().await.expect("disconnect");
        all
    });
    let mut rewritten = 0;
    for block in 0..blocks {
        let g = log.generation(block);
        let got = &served[block as usize * BLOCK..(block as usize + 1) * BLOCK];
        if got == expected_block(block, g + 1).as_slice() {
            rewritten += 1;
        } else {
            assert!(
                got == expected_block(block, g).as_slice(),
                "block {block}: neither its acknowledged generation {g} nor the next"
            );
        }
    }
    assert!(
        rewritten <= WRITERS,
        "{rewritten} blocks hold a write that was never acknowledged, more than the \
         {WRITERS} that can have been in flight"
    );
    node.stop_clean(Sig::TERM);
    let img = read_file_range(&image(&dir, "vol0"), 0, REGION as usize);
    if let Some(i) = img.iter().zip(&served).position(|(a, b)| a != b) {
        panic!(
            "after a clean stop the image differs from what the cache served, at byte {i} \
             (block {})",
            i / BLOCK
        );
    }
}

/// Two mirrored nodes, each with its own cache: fio writes the whole disk through node
/// 1, node 1 is killed (SIGKILL) and started again; once the two mirror again fio
/// verifies every block through each node, and after both stop cleanly (their caches
/// drained) the two images are byte-identical.
#[test]
fn a_mirror_of_two_cached_nodes_survives_kill_9_of_one() {
    if !require_tool("fio") {
        return;
    }
    let (dir1, dir2) = (
        TestDir::new("cache-mirror-n1"),
        TestDir::new("cache-mirror-n2"),
    );
    let s1 = Side::new(1, "vol0", DISK).timeout(1000);
    let s2 = Side::new(2, "vol0", DISK).timeout(1000);
    let config2 = s2.config(&dir2, Some("127.0.0.1:0"), "127.0.0.1:1")
        + &cache_section(&cache_path(&dir2), CACHE);
    let n2 = Node::start_listening(&dir2, &config2, &["vol0"]);
    let config1 =
        s1.config(&dir1, None, n2.replication()) + &cache_section(&cache_path(&dir1), CACHE);
    let n1 = Node::start(&dir1, &config1, &["vol0"]);
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);

    assert_fio_clean(&fio_nbd(dir1.path(), &n1.uri("vol0"), &job("w", false)));
    let skip = n2.stdout_lines().len();
    n1.stop(Sig::KILL);
    n2.wait_log("peer lost", EVENT_TIMEOUT);

    let n1 = Node::start(&dir1, &config1, &["vol0"]);
    let line = cache_line(&n1);
    assert_eq!(field(&line, "open").as_deref(), Some("recovered"), "{line}");
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    // The crash leaves the extents of node 1's activity log to resync.
    let done = n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout_after(skip, &["sync disk=vol0 done"], EVENT_TIMEOUT);
    eprintln!("node 1 after the kill: {line}\nnode 1: {done}");

    for (who, dir, node) in [("node 1", &dir1, &n1), ("node 2", &dir2, &n2)] {
        let out = fio_nbd(
            dir.path(),
            &node.uri("vol0"),
            &job(&format!("v{}", who.len()), true),
        );
        assert_verified_all(&out, who);
    }
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}
