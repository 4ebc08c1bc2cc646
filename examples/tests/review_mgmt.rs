//! Review findings on the management plane, each reproduced against a node started in
//! process: an NBD socket path never removes another file, a metrics endpoint cannot be
//! locked out by clients that never read, and an empty token is refused; and the cache
//! mode set through the API.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vsan::node::config::Config;
use vsan::node::{Node, StartOptions};
use vsan_replica::mgmt::v1;
use vsan_replica::mgmt::v1::mgmt_client::MgmtClient;

async fn node(dir: &std::path::Path, extra_node: &str, disks: &str) -> Node {
    let text = format!(
        "[node]\nid = 1\ndata_dir = {:?}\nmgmt = \"127.0.0.1:0\"\n{extra_node}\n{disks}",
        dir.display().to_string()
    );
    let cfg = Config::parse(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    Node::start(&cfg, StartOptions::default())
        .await
        .unwrap_or_else(|e| panic!("start: {e}"))
}

async fn client(n: &Node) -> MgmtClient<tonic::transport::Channel> {
    MgmtClient::connect(format!("http://{}", n.mgmt_address().unwrap()))
        .await
        .unwrap()
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

/// 64 clients that pipeline requests and never read the answers held every metrics
/// connection slot for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_clients_that_never_read_do_not_lock_out_scrapes() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(
        dir.path(),
        "metrics = \"127.0.0.1:0\"",
        "[[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"mem\"\n",
    )
    .await;
    let addr = n.metrics_address().unwrap().to_string();
    let req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(4000);
    let mut hogs = Vec::new();
    for _ in 0..64 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.write_all(&req)).await;
        hogs.push(s);
    }
    // Past the connection limit (10 s).
    tokio::time::sleep(Duration::from_secs(12)).await;
    let scrape = tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = tokio::net::TcpStream::connect(&addr).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    })
    .await;
    drop(hogs);
    n.shutdown().await.unwrap();
    let ok = matches!(&scrape, Ok(Ok(b)) if b.starts_with(b"HTTP/1.1 200"));
    assert!(
        ok,
        "a scrape after 64 stalled clients: {:?}",
        scrape.map(|r| r.map(|b| b.len()))
    );
}

/// An empty `mgmt_token` was accepted (and then any `Bearer ` passed).
#[test]
fn an_empty_or_padded_token_is_refused_by_the_config() {
    for token in ["\"\"", "\"  \"", "\" x\""] {
        let text = format!(
            "[node]\nid = 1\ndata_dir = \"/tmp/x\"\nmgmt = \"127.0.0.1:0\"\nmgmt_token = {token}\n"
        );
        let e = Config::parse(&text).expect_err(token);
        assert!(e.to_string().contains("mgmt_token"), "{e}");
    }
}

/// SetCacheMode on a cached disk: the status shows the new mode; an unspecified mode
/// is INVALID_ARGUMENT; a disk without a cache is FAILED_PRECONDITION.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_mode_set_through_the_api() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("vol0.cache");
    let n = node(
        dir.path(),
        "",
        &format!(
            "[[disk]]\nname = \"vol0\"\nsize = \"4MiB\"\n\n[disk.cache]\npath = {:?}\nsize = \"8MiB\"\n\n\
             [[disk]]\nname = \"plain\"\nsize = \"1MiB\"\nbacking = \"mem\"\n",
            cache.display().to_string()
        ),
    )
    .await;
    let mut c = client(&n).await;
    let mode = |s: &v1::DiskStatus| s.cache.as_ref().map(|c| c.mode);
    let s = c
        .get_disk_status(v1::DiskRequest {
            name: "vol0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&s), Some(v1::CacheMode::WriteBack as i32), "{s:?}");
    c.set_cache_mode(v1::SetCacheModeRequest {
        name: "vol0".into(),
        mode: v1::CacheMode::WriteThrough as i32,
    })
    .await
    .unwrap();
    let s = c
        .get_disk_status(v1::DiskRequest {
            name: "vol0".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(mode(&s), Some(v1::CacheMode::WriteThrough as i32), "{s:?}");
    let e = c
        .set_cache_mode(v1::SetCacheModeRequest {
            name: "vol0".into(),
            mode: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = c
        .set_cache_mode(v1::SetCacheModeRequest {
            name: "plain".into(),
            mode: v1::CacheMode::WriteBack as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    n.shutdown().await.unwrap();
}
