//! `vsan-node` against its configuration file, as a process: a bad config exits 2 with
//! one `config error` line naming the key and the problem (and touches no existing
//! image); a good one serves its disks and stops cleanly on SIGINT. No outside tools.

use crate::common;

use std::time::Duration;

use common::{
    Node, Sig, TestDir, ToolOutput, assert_same_bytes, disk_section, node_section, read_file_range,
    run_node_to_exit,
};
use vsan_core::export::nbd::Client;

const MIB: u64 = 1 << 20;

/// Await one client step, failing the test if it errs or hangs.
async fn within<T>(what: &str, step: impl Future<Output = vsan_core::Result<T>>) -> T {
    match tokio::time::timeout(Duration::from_secs(10), step).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{what}: {e}"),
        Err(_) => panic!("{what} took longer than 10 s"),
    }
}

/// Run the node on `config` and check it refused it: exit code 2, nothing served, and
/// exactly one `config error` line, the last on stderr, that names `key` (when not
/// empty) and contains every one of `problem`.
fn expect_config_error(dir: &TestDir, config: &str, key: &str, problem: &[&str]) -> ToolOutput {
    let out = run_node_to_exit(dir, config);
    assert_eq!(out.status.code(), Some(2), "wrong exit code:\n{out}");
    assert!(
        !out.stdout.contains("ready"),
        "it reported ready on a bad config:\n{out}"
    );
    let errors: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("config error"))
        .collect();
    assert_eq!(errors.len(), 1, "want one config error line:\n{out}");
    let line = errors[0];
    assert_eq!(
        out.stderr.lines().last(),
        Some(line),
        "the config error is not the last line:\n{out}"
    );
    if !key.is_empty() {
        assert!(
            line.contains(&format!("`{key}`")),
            "the error does not name the key `{key}`:\n{out}"
        );
    }
    for p in problem {
        assert!(
            line.contains(p),
            "the error does not say what is wrong (want {p:?}):\n{out}"
        );
    }
    out
}

/// A refused config that is caught while parsing must not create anything.
fn assert_nothing_created(dir: &TestDir) {
    assert!(
        !dir.data_dir().exists(),
        "the data dir was created for a config that was refused"
    );
}

#[test]
fn unknown_key_is_refused() {
    let dir = TestDir::new("cfg-unknown");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + "sizee = \"8MiB\"\n";
    expect_config_error(&dir, &config, "disk[0].sizee", &["unknown field"]);
    assert_nothing_created(&dir);
}

#[test]
fn unparsable_size_is_refused() {
    let dir = TestDir::new("cfg-parsecs");
    let config = node_section(&dir) + &disk_section("vol0", "\"12 parsecs\"", "127.0.0.1:0");
    expect_config_error(&dir, &config, "disk[0].size", &["12 parsecs", "not a size"]);
    assert_nothing_created(&dir);
}

#[test]
fn size_not_a_multiple_of_the_block_size_is_refused() {
    let dir = TestDir::new("cfg-1000");
    let config = node_section(&dir) + &disk_section("vol0", "1000", "127.0.0.1:0");
    expect_config_error(
        &dir,
        &config,
        "disk[0].size",
        &["1000", "multiple of the block size"],
    );
    assert_nothing_created(&dir);
}

#[test]
fn missing_node_section_is_refused() {
    let dir = TestDir::new("cfg-nonode");
    let config = disk_section("vol0", "\"8MiB\"", "127.0.0.1:0");
    expect_config_error(&dir, &config, "", &["missing", "`node`"]);
}

#[test]
fn duplicate_disk_name_is_refused() {
    let dir = TestDir::new("cfg-dup");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0");
    expect_config_error(&dir, &config, "disk[1].name", &["vol0", "declared twice"]);
    assert_nothing_created(&dir);
}

#[test]
fn invalid_nbd_address_is_refused() {
    let dir = TestDir::new("cfg-addr");
    let config = node_section(&dir) + &disk_section("vol0", "\"8MiB\"", "localhost:99999");
    expect_config_error(
        &dir,
        &config,
        "disk[0].nbd",
        &["localhost:99999", "not an address"],
    );
    assert_nothing_created(&dir);
}

#[test]
fn missing_config_file_is_refused() {
    let dir = TestDir::new("cfg-nofile");
    let path = dir.join("absent.toml");
    let mut cmd = std::process::Command::new(common::VSAN_NODE);
    cmd.arg("--config").arg(&path);
    let out = common::run_command(cmd, common::READY_TIMEOUT);
    assert_eq!(out.status.code(), Some(2), "wrong exit code:\n{out}");
    assert!(
        out.stderr.contains("cannot read") && out.stderr.contains("absent.toml"),
        "the error does not say which file could not be read:\n{out}"
    );
}

#[test]
fn address_in_use_is_refused() {
    let dir = TestDir::new("cfg-inuse");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port to occupy");
    let addr = taken.local_addr().expect("local address").to_string();
    let config = node_section(&dir) + &disk_section("vol0", "\"8MiB\"", &addr);
    expect_config_error(&dir, &config, "disk[0].nbd", &[&addr, "already in use"]);
    drop(taken);
}

#[test]
fn existing_image_of_another_size_is_refused_and_left_alone() {
    let dir = TestDir::new("cfg-imgsize");
    std::fs::create_dir_all(dir.data_dir()).expect("create the data dir");
    let image = dir.data_dir().join("vol0.img");
    let before: Vec<u8> = (0..4 * MIB).map(|i| (i % 251) as u8).collect();
    std::fs::write(&image, &before).expect("write the old image");

    let config = node_section(&dir) + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0");
    expect_config_error(
        &dir,
        &config,
        "disk[0].size",
        &["existing image", "4194304", "8388608"],
    );
    let after = std::fs::read(&image).expect("read the image back");
    assert_same_bytes(&after, &before, "the existing image after a refused start");
}

#[test]
fn good_config_serves_and_stops_on_sigint() {
    let dir = TestDir::new("cfg-good");
    let sock = dir.socket("vol1.sock");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &disk_section("vol1", "\"4MiB\"", &format!("unix:{}", sock.display()))
        + "backing = \"mem\"\n";
    let node = Node::start(&dir, &config, &["vol0", "vol1"]);
    let tcp = node.addr("vol0").to_string();
    assert!(
        tcp.starts_with("127.0.0.1:") && !tcp.ends_with(":0"),
        "ready line does not show the real port: {tcp}"
    );

    let offset = 3 * 512;
    let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7 + 1) as u8).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        // The empty export name selects the only disk on each address.
        let c = within("connect over TCP", Client::connect_tcp(&tcp, "")).await;
        assert_eq!(c.size(), 8 * MIB);
        within("write", c.write(offset, &data, false)).await;
        within("flush", c.flush()).await;
        within("disconnect", c.disconnect()).await;

        // Another connection, naming the export, reads what the first wrote.
        let c = within("reconnect over TCP", Client::connect_tcp(&tcp, "vol0")).await;
        let got = within("read", c.read(offset, data.len() as u32)).await;
        assert_same_bytes(&got, &data, "read on a second connection");
        within("disconnect", c.disconnect()).await;

        let u = within(
            "connect over the Unix socket",
            Client::connect_unix(&sock, ""),
        )
        .await;
        assert_eq!(u.size(), 4 * MIB);
        let end = 4 * MIB - 4096;
        within("write with FUA", u.write(end, &data[..4096], true)).await;
        let got = within("read back", u.read(end, 4096)).await;
        assert_same_bytes(&got, &data[..4096], "vol1 read back");
        within("disconnect", u.disconnect()).await;
    });

    let stopped = node.stop(Sig::INT);
    assert!(
        stopped.status.success(),
        "SIGINT: exit {}\n{}",
        stopped.status,
        stopped.log
    );
    for line in ["SIGINT received", "stopped cleanly"] {
        assert!(
            stopped.log.contains(line),
            "no `{line}` in the log:\n{}",
            stopped.log
        );
    }
    let image = dir.data_dir().join("vol0.img");
    let got = read_file_range(&image, offset, data.len());
    assert_same_bytes(&got, &data, "vol0 image after SIGINT");
    assert!(
        !dir.data_dir().join("vol1.img").exists(),
        "a RAM disk left an image file"
    );
}

/// A mirrored replica whose image was removed but whose metadata was not would claim
/// data it no longer has: the node refuses to attach it (exit 1) and creates nothing.
#[test]
fn a_mirrored_disk_whose_image_is_gone_but_metadata_is_not_is_refused() {
    let dir = TestDir::new("cfg-image-gone");
    std::fs::create_dir_all(dir.data_dir()).expect("create the data dir");
    let config = node_section(&dir)
        + "\n[[peer]]\nid = 2\naddress = \"127.0.0.1:1\"\n"
        + &disk_section("vol0", "\"4MiB\"", "127.0.0.1:0")
        + "peer = 2\n";
    let node = Node::start(&dir, &config, &["vol0"]);
    node.stop_clean(Sig::TERM);
    let (image, meta) = (
        dir.data_dir().join("vol0.img"),
        dir.data_dir().join("vol0.meta"),
    );
    assert!(meta.exists(), "no metadata was made for the mirrored disk");
    std::fs::remove_file(&image).expect("remove the image");
    let meta_before = std::fs::read(&meta).expect("read the metadata");
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert!(
        out.text().contains("exists but the image") && out.text().contains("vol0"),
        "{out}"
    );
    assert!(!image.exists(), "the refused start created an image");
    let meta_after = std::fs::read(&meta).expect("read the metadata");
    assert_same_bytes(
        &meta_after,
        &meta_before,
        "the metadata after a refused start",
    );
}

/// A `[disk.cache]` section with `body` (its keys, one per line).
fn cache_section(body: &str) -> String {
    format!("\n[disk.cache]\n{body}\n")
}

/// The cache file used by the cache tests of `dir`.
fn cache_file(dir: &TestDir) -> std::path::PathBuf {
    dir.join("vol0.cache")
}

/// Cache settings that cannot work are refused while parsing, naming the key.
#[test]
fn bad_cache_settings_are_refused() {
    let cases: &[(&str, &str, &str, &[&str])] = &[
        (
            "no-path",
            "size = \"4MiB\"",
            "disk[0].cache",
            &["missing field `path`"],
        ),
        (
            "mode",
            "mode = \"write-sideways\"",
            "disk[0].cache.mode",
            &["write-sideways", "not one of", "write-back"],
        ),
        (
            "high",
            "high_watermark = 150",
            "disk[0].cache.high_watermark",
            &["150", "percentage"],
        ),
        (
            "low",
            "low_watermark = 70",
            "disk[0].cache.low_watermark",
            &["70%", "not below", "60%"],
        ),
        (
            "cutoff",
            "sequential_cutoff = \"12 parsecs\"",
            "disk[0].cache.sequential_cutoff",
            &["12 parsecs", "not a size"],
        ),
        (
            "small",
            "size = \"64KiB\"",
            "disk[0].cache.size",
            &["65536", "smallest cache device"],
        ),
        (
            "unknown",
            "flush_on_write = true",
            "disk[0].cache.flush_on_write",
            &["unknown field"],
        ),
    ];
    for (tag, body, key, problem) in cases {
        let dir = TestDir::new(&format!("cfg-cache-{tag}"));
        let path = format!("path = {}\n", common::toml_str(cache_file(&dir)));
        let body = if *tag == "no-path" {
            body.to_string()
        } else {
            path + body
        };
        let config = node_section(&dir)
            + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
            + &cache_section(&body);
        expect_config_error(&dir, &config, key, problem);
        assert_nothing_created(&dir);
        assert!(
            !cache_file(&dir).exists(),
            "{tag}: a cache file was created"
        );
    }
}

/// A cached disk works in the cache's 4096-byte blocks; a cache file cannot be a disk's
/// image.
#[test]
fn a_cache_needs_4096_byte_blocks_and_a_file_of_its_own() {
    let dir = TestDir::new("cfg-cache-bs");
    let cache = cache_section(&format!(
        "path = {}\nsize = \"4MiB\"",
        common::toml_str(cache_file(&dir))
    ));
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + "block_size = 512\n"
        + &cache;
    expect_config_error(&dir, &config, "disk[0].block_size", &["512", "4096"]);
    assert_nothing_created(&dir);

    let image = common::toml_str(dir.data_dir().join("vol0.img"));
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {image}\nsize = \"4MiB\""));
    expect_config_error(&dir, &config, "disk[0].cache.path", &["disk[0]'s image"]);
    assert_nothing_created(&dir);
}

/// A cache file that does not exist cannot be made without a size.
#[test]
fn a_new_cache_file_needs_a_size() {
    let dir = TestDir::new("cfg-cache-nosize");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {}", common::toml_str(cache_file(&dir))));
    expect_config_error(&dir, &config, "disk[0].cache.size", &["does not exist"]);
    assert!(!cache_file(&dir).exists(), "a cache file was created");
    assert!(
        !dir.data_dir().join("vol0.img").exists(),
        "an image was created"
    );
}

/// An existing cache file all of zeros is formatted at its own size when `size` is left
/// out; once formatted, a `size` that differs from it is refused and the file is left
/// alone, and one formatted for a disk of another size is refused for another disk.
#[test]
fn an_existing_cache_file_keeps_its_size_and_its_disk() {
    let dir = TestDir::new("cfg-cache-existing");
    std::fs::write(cache_file(&dir), vec![0u8; MIB as usize]).expect("make a zeroed file");
    let path = common::toml_str(cache_file(&dir));
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {path}"));
    let node = Node::start(&dir, &config, &["vol0"]);
    let line = node.wait_stdout(&["cache disk=vol0"], Duration::from_secs(10));
    assert!(
        line.contains("open=formatted") && line.contains(&format!("log_bytes={}", MIB - 8192)),
        "{line}"
    );
    node.stop_clean(Sig::TERM);
    let before = std::fs::read(cache_file(&dir)).expect("read the cache file");

    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {path}\nsize = \"2MiB\""));
    expect_config_error(
        &dir,
        &config,
        "disk[0].cache.size",
        &["formatted cache of 1048576 bytes", "2097152"],
    );

    let config = node_section(&dir)
        + &disk_section("vol1", "\"16MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {path}"));
    expect_config_error(
        &dir,
        &config,
        "disk[0].cache.path",
        &["formatted for a disk of 8388608 bytes", "16777216"],
    );
    assert!(
        !dir.data_dir().join("vol1.img").exists(),
        "the refused disk got an image"
    );
    let after = std::fs::read(cache_file(&dir)).expect("read the cache file");
    assert_same_bytes(&after, &before, "the cache file after refused starts");

    // The same config as at first opens it clean.
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {path}"));
    let node = Node::start(&dir, &config, &["vol0"]);
    node.wait_stdout(&["cache disk=vol0", "open=clean"], Duration::from_secs(10));
    node.stop_clean(Sig::TERM);
}

/// A file that holds data but is no cache is never formatted over (exit 1).
#[test]
fn a_file_that_is_not_a_cache_is_refused_and_left_alone() {
    let dir = TestDir::new("cfg-cache-foreign");
    let before: Vec<u8> = (0..MIB).map(|i| (i % 253) as u8 | 1).collect();
    std::fs::write(cache_file(&dir), &before).expect("write the foreign file");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!("path = {}", common::toml_str(cache_file(&dir))));
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert!(
        out.stderr.contains("no vsan cache superblock")
            && out.stderr.contains("not formatted over"),
        "{out}"
    );
    let after = std::fs::read(cache_file(&dir)).expect("read the file");
    assert_same_bytes(&after, &before, "the foreign file after a refused start");
    assert!(
        !dir.data_dir().join("vol0.img").exists(),
        "an image was created"
    );
}

/// A cache that holds writes for an image that is gone is not replayed onto a new
/// image (exit 1), and nothing is created.
#[test]
fn a_cache_holding_writes_of_a_vanished_image_is_refused() {
    let dir = TestDir::new("cfg-cache-orphan");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!(
            "path = {}\nsize = \"1MiB\"",
            common::toml_str(cache_file(&dir))
        ));
    let node = Node::start(&dir, &config, &["vol0"]);
    let addr = node.addr("vol0").to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async {
        let c = within("connect", Client::connect_tcp(&addr, "")).await;
        within("write", c.write(8192, &[0x5a; 4096], false)).await;
    });
    // Killed: the cache is not closed, its write not destaged.
    node.stop(Sig::KILL);
    let image = dir.data_dir().join("vol0.img");
    std::fs::remove_file(&image).expect("remove the image");
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert!(
        out.stderr.contains("holds writes for the image") && out.stderr.contains("vol0.img"),
        "{out}"
    );
    assert!(!image.exists(), "the refused start created an image");
}

/// A cache whose device failed while in use is marked so on the device; the node then
/// refuses it (exit 1, file untouched) instead of replaying its stale log over the image.
#[test]
fn a_cache_marked_failed_is_refused_and_left_alone() {
    use std::os::unix::fs::FileExt;
    let dir = TestDir::new("cfg-cache-failed");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"8MiB\"", "127.0.0.1:0")
        + &cache_section(&format!(
            "path = {}\nsize = \"1MiB\"",
            common::toml_str(cache_file(&dir))
        ));
    let node = Node::start(&dir, &config, &["vol0"]);
    node.stop_clean(Sig::TERM);
    // What a failing cache writes, best effort: its superblock with the failed flag.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(cache_file(&dir))
        .expect("open the cache file");
    let mut head = vec![0u8; vsan_cache::format::LOG_START as usize];
    file.read_exact_at(&mut head, 0)
        .expect("read the superblocks");
    let (c0, c1) = head.split_at(vsan_cache::format::SUPERBLOCK_LEN);
    let sb = vsan_cache::format::pick(c0, c1).expect("a formatted cache");
    let sb = vsan_cache::format::Superblock {
        failed: true,
        clean_shutdown: false,
        seq: sb.seq + 1,
        ..sb
    };
    file.write_all_at(&sb.encode(), vsan_cache::format::superblock_offset(sb.seq))
        .expect("mark the cache failed");
    drop(file);
    let before = std::fs::read(cache_file(&dir)).expect("read the cache file");
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(1), "{out}");
    assert!(
        out.stderr.contains("failed while in use") && out.stderr.contains("format it again"),
        "{out}"
    );
    let after = std::fs::read(cache_file(&dir)).expect("read the cache file");
    assert_same_bytes(&after, &before, "the failed cache after a refused start");
}
