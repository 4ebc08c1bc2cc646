//! Disks created and deleted through the management API (`vsanctl create` / `delete`)
//! on two real `vsan-node` processes: a mirrored disk is created on both nodes, mirrors,
//! is used through NBD from both sides, and is deleted; each step shows in the status,
//! and deleting a disk with a connected NBD client is refused unless forced.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::in_process::{client, node};
use common::mirror::{Side, start_pair};
use common::{ProcessGuard, Region, qemu_io_reads, qemu_io_writes, require_tool};
use vsan_replica::mgmt::v1;
use vsan_replica::mgmt::v1::mgmt_client::MgmtClient;

const EVENT_TIMEOUT: Duration = Duration::from_secs(20);

/// The address a node prints in its `ready mgmt=<addr>` line.
fn mgmt_addr(node: &common::Node) -> String {
    let line = node.wait_stdout(&["ready mgmt="], EVENT_TIMEOUT);
    line.split("ready mgmt=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("an address after ready mgmt=")
        .to_string()
}

/// `vsanctl --node addr args...`: exit code, stdout, stderr.
fn vsanctl(addr: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vsanctl"))
        .arg("--node")
        .arg(addr)
        .args(args)
        .output()
        .expect("run vsanctl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// One disk's status over gRPC.
fn status(addr: &str, name: &str) -> Result<v1::DiskStatus, tonic::Status> {
    rt().block_on(async {
        let mut c = MgmtClient::connect(format!("http://{addr}"))
            .await
            .expect("connect to the management service");
        c.get_disk_status(v1::DiskRequest { name: name.into() })
            .await
            .map(|r| r.into_inner())
    })
}

/// Wait until `name`'s status on `addr` satisfies `pred`.
fn wait_status(
    addr: &str,
    name: &str,
    what: &str,
    pred: impl Fn(&v1::DiskStatus) -> bool,
) -> v1::DiskStatus {
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        let s = status(addr, name);
        if let Ok(s) = &s
            && pred(s)
        {
            return s.clone();
        }
        assert!(Instant::now() < deadline, "{what}: not reached; last {s:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn in_sync(s: &v1::DiskStatus) -> bool {
    s.link == v1::LinkState::Connected as i32 && !s.syncing && s.local_state == "up-to-date"
}

#[test]
fn a_mirrored_disk_created_used_and_deleted_through_the_api() {
    if !require_tool("qemu-io") {
        return;
    }
    let lines = "mgmt = \"127.0.0.1:0\"\n";
    let pair = start_pair(
        "mgmt-disks",
        &Side::new(1, "vol0", "\"8MiB\"").node_lines(lines),
        &Side::new(2, "vol0", "\"8MiB\"").node_lines(lines),
    );
    let (m1, m2) = (mgmt_addr(&pair.n1), mgmt_addr(&pair.n2));

    // Bad requests first: each refused with its code, nothing created.
    let (code, _, err) = vsanctl(&m1, &["create", "vol1", "--size", "banana"]);
    assert_eq!(
        code, 2,
        "a size that does not parse is a usage error: {err}"
    );
    let e = rt()
        .block_on(async {
            let mut c = MgmtClient::connect(format!("http://{m1}")).await.unwrap();
            c.create_disk(v1::CreateDiskRequest {
                name: "vol1".into(),
                size: 1000,
                ..Default::default()
            })
            .await
        })
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("block size"), "{e:?}");
    for (args, code_word) in [
        (
            vec!["create", "bad/name", "--size", "4MiB"],
            "INVALID_ARGUMENT",
        ),
        (
            vec!["create", "vol1", "--size", "4MiB", "--peer", "7"],
            "INVALID_ARGUMENT",
        ),
        (vec!["create", "vol0", "--size", "4MiB"], "ALREADY_EXISTS"),
        (vec!["delete", "nope"], "NOT_FOUND"),
    ] {
        let (code, _, err) = vsanctl(&m1, &args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains(code_word), "{args:?}: {err}");
    }
    assert_eq!(
        status(&m1, "vol1").unwrap_err().code(),
        tonic::Code::NotFound
    );

    // Create vol1 on both nodes (the acceptor first; the dialer retries meanwhile
    // anyway), mirrored, each exported on a port of its own.
    for (addr, peer) in [(&m2, "1"), (&m1, "2")] {
        let (code, out, err) = vsanctl(
            addr,
            &[
                "create",
                "vol1",
                "--size",
                "4MiB",
                "--peer",
                peer,
                "--nbd",
                "127.0.0.1:0",
            ],
        );
        assert_eq!(code, 0, "create on {addr}: {out}{err}");
    }
    let s1 = wait_status(&m1, "vol1", "node 1's vol1 in sync", in_sync);
    let s2 = wait_status(&m2, "vol1", "node 2's vol1 in sync", in_sync);
    assert_eq!((s1.size, s1.peer_id, s2.peer_id), (4 << 20, 2, 1));
    assert_eq!(s1.transport, "tcp");
    assert!(!s1.nbd.is_empty() && !s2.nbd.is_empty());
    let (code, out, _) = vsanctl(&m1, &["list"]);
    assert_eq!(code, 0);
    assert!(out.contains("vol0") && out.contains("vol1"), "{out}");

    // Used through NBD: written on node 1, read on node 2, and the other way round.
    let uri1 = format!("nbd://{}/vol1", s1.nbd);
    let uri2 = format!("nbd://{}/vol1", s2.nbd);
    let a = [Region {
        byte: 0x3c,
        offset: 1 << 20,
        len: 64 << 10,
    }];
    let b = [Region {
        byte: 0xc3,
        offset: 2 << 20,
        len: 64 << 10,
    }];
    qemu_io_writes(&uri1, &a);
    qemu_io_reads(&uri2, &a);
    qemu_io_writes(&uri2, &b);
    qemu_io_reads(&uri1, &b);

    // A client holds node 1's vol1 open: deleting is refused, then forced.
    let mut client = ProcessGuard::new(
        Command::new("qemu-io")
            .args(["-f", "raw", &uri1, "-c", "sleep 20000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start qemu-io"),
        None,
    );
    wait_status(&m1, "vol1", "the NBD client shows", |s| s.nbd_clients >= 1);
    let (code, _, err) = vsanctl(&m1, &["delete", "vol1"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("FAILED_PRECONDITION") && err.contains("client"),
        "{err}"
    );
    assert!(status(&m1, "vol1").is_ok(), "still there after the refusal");
    let (code, out, err) = vsanctl(&m1, &["delete", "vol1", "--force"]);
    assert_eq!(code, 0, "{out}{err}");
    let _ = client.child_mut().kill();
    assert_eq!(
        status(&m1, "vol1").unwrap_err().code(),
        tonic::Code::NotFound
    );
    // Node 2 sees its peer go; deleting there removes the files too.
    wait_status(&m2, "vol1", "node 2 degraded", |s| {
        s.link == v1::LinkState::Degraded as i32
    });
    let image2 = pair.dir2.data_dir().join("vol1.img");
    assert!(image2.exists());
    let (code, out, err) = vsanctl(&m2, &["delete", "vol1", "--remove-files"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!image2.exists(), "image removed");
    assert!(
        !pair.dir2.data_dir().join("vol1.meta").exists(),
        "metadata removed"
    );

    // The config's disk was never disturbed.
    let v0 = status(&m1, "vol0").unwrap();
    assert!(in_sync(&v0), "{v0:?}");
    let c = [Region {
        byte: 0x5a,
        offset: 0,
        len: 4096,
    }];
    qemu_io_writes(&pair.n1.uri("vol0"), &c);
    qemu_io_reads(&pair.n2.uri("vol0"), &c);
}

/// CreateDisk with `nbd = "unix:<path of another disk's image>"` unlinked the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_nbd_path_never_removes_another_file() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(
        dir.path(),
        "",
        "[[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\n",
    )
    .await;
    let image = dir.path().join("vol0.img");
    assert!(image.exists());
    let mut c = client(&n).await;
    let r = c
        .create_disk(v1::CreateDiskRequest {
            name: "vol1".into(),
            size: 1 << 20,
            backing: "mem".into(),
            nbd: format!("unix:{}", image.display()),
            ..Default::default()
        })
        .await;
    let is_file = std::fs::symlink_metadata(&image).is_ok_and(|m| m.file_type().is_file());
    n.shutdown().await.unwrap();
    let e = r.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("not a socket"), "{e:?}");
    assert!(is_file, "the image of disk vol0 is still a file");
}
