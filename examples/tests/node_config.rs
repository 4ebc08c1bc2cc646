//! `vsan-node` against its configuration file, as a process: a bad config exits 2 with
//! one `config error` line naming the key and the problem (and touches no existing
//! image); a good one serves its disks and stops cleanly on SIGINT. No outside tools.

mod common;

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
