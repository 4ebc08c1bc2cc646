//! A node's iSCSI targets: portals bound at start (port 0 gives a real port, disks
//! sharing a portal share one server), the `ready disk=.. iscsi=.. target=..` lines, the
//! logical unit's identity on both nodes of a mirrored disk, bind and secret-file
//! refusals, the management status and metrics, and the same config through the C ABI.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use vsan::node::config::Config;
use vsan::node::{Node, StartError, StartOptions};
use vsan_core::export::iscsi::{Server, Target};
use vsan_core::scsi::{LogicalUnit, LuConfig, LuIdentity, TargetPort};
use vsan_core::{Geometry, MemDevice};
use vsan_replica::protocol::DiskId;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn config(node_extra: &str, disks: &str) -> Config {
    let text = format!(
        "[node]\nid = 1\ndata_dir = \"/nonexistent-vsan-iscsi-test\"\n{node_extra}\n{disks}"
    );
    Config::parse(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"))
}

fn mem_disk(name: &str, extra: &str) -> String {
    format!("[[disk]]\nname = \"{name}\"\nsize = \"1MiB\"\nbacking = \"mem\"\n{extra}\n")
}

/// The portal and target of `disk`'s `ready disk=<disk> iscsi=<portal> target=<iqn>`
/// line.
fn ready_iscsi(node: &Node, disk: &str) -> (String, String) {
    let prefix = format!("ready disk={disk} iscsi=");
    let line = node
        .ready_lines()
        .iter()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} line in {:?}", node.ready_lines()));
    let rest = &line[prefix.len()..];
    let (portal, target) = rest
        .split_once(" target=")
        .unwrap_or_else(|| panic!("no target= in {line:?}"));
    (portal.to_string(), target.to_string())
}

/// Whether this build's iSCSI server keeps serving its listener (the API skeleton's
/// `serve_tcp` returns at once, dropping it; the real one serves until shutdown).
async fn iscsi_server_serves() -> bool {
    let device = Arc::new(MemDevice::new(Geometry::new(1 << 20, 512).unwrap()));
    let lu = LogicalUnit::new(
        device,
        LuConfig {
            identity: LuIdentity::from_disk_id("probe"),
            port: TargetPort {
                name: "iqn.2026-12.io.vsan:probe,t,0x0001".into(),
                relative_id: 1,
                group: 1,
            },
            read_only: false,
            state_file: None,
        },
    )
    .unwrap();
    let server = Server::new(vec![Target::new("iqn.2026-12.io.vsan:probe", lu)]).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let serving = tokio::time::timeout(Duration::from_millis(200), server.serve_tcp(listener))
        .await
        .is_err();
    server.shutdown();
    serving
}

#[test]
fn portals_bind_announce_and_share_one_server() {
    runtime().block_on(async {
        // a and b share a portal (port 0: one listener, one port), c has its own; a is
        // exported over NBD too, b and c only over iSCSI.
        let cfg = config(
            "",
            &(mem_disk("a", "nbd = \"127.0.0.1:0\"\niscsi = \"127.0.0.1:0\"")
                + &mem_disk("b", "iscsi = \"127.0.0.1:0\"")
                + &mem_disk(
                    "c",
                    "iscsi = \"127.0.0.2:0\"\niscsi_target = \"iqn.2001-04.com.example:c\"",
                )),
        );
        let node = Node::start(&cfg, StartOptions::default()).await.unwrap();
        let lines = node.ready_lines().to_vec();
        let (pa, ta) = ready_iscsi(&node, "a");
        let (pb, tb) = ready_iscsi(&node, "b");
        let (pc, tc) = ready_iscsi(&node, "c");
        assert_eq!(ta, "iqn.2026-12.io.vsan:a");
        assert_eq!(tb, "iqn.2026-12.io.vsan:b");
        assert_eq!(tc, "iqn.2001-04.com.example:c");
        assert!(pa.starts_with("127.0.0.1:") && !pa.ends_with(":0"), "{pa}");
        assert_eq!(pa, pb, "disks on one portal address share its listener");
        assert!(pc.starts_with("127.0.0.2:") && !pc.ends_with(":0"), "{pc}");
        // The NBD line keeps its format, and comes before the iSCSI lines.
        let nbd = lines
            .iter()
            .position(|l| l.starts_with("ready disk=a nbd=127.0.0.1:"))
            .unwrap_or_else(|| panic!("no NBD line: {lines:?}"));
        let first_iscsi = lines.iter().position(|l| l.contains(" iscsi=")).unwrap();
        assert!(nbd < first_iscsi, "{lines:?}");
        assert!(!lines.iter().any(|l| l.starts_with("ready disk=b nbd=")));

        let disks = node.disks();
        let a = disks[0].iscsi.as_ref().expect("a has a target");
        let b = disks[1].iscsi.as_ref().expect("b has a target");
        let c = disks[2].iscsi.as_ref().expect("c has a target");
        assert_eq!(
            (a.portal.as_str(), a.target.as_str()),
            (pa.as_str(), ta.as_str())
        );
        let names: Vec<&str> = a.server.targets().iter().map(|t| t.name()).collect();
        assert_eq!(
            names,
            [ta.as_str(), tb.as_str()],
            "one server for the portal"
        );
        assert_eq!(
            b.server.targets().len(),
            2,
            "b's server is the same portal's"
        );
        assert_eq!(c.server.targets().len(), 1);
        assert!(disks[1].nbd.is_none());
        // Each target's LUN 0 serves the disk's own client-facing device.
        assert!(Arc::ptr_eq(
            a.server.targets()[0].lun0().device(),
            &disks[0].device
        ));

        if iscsi_server_serves().await {
            TcpStream::connect(&pa)
                .await
                .expect("connect to the shared portal");
            TcpStream::connect(&pc)
                .await
                .expect("connect to c's portal");
        } else {
            eprintln!(
                "NOTE: this build's iSCSI server is the API skeleton (serve_tcp returns at \
                 once): the TCP connects are not checked"
            );
        }
        node.shutdown().await.unwrap();
    });
}

#[test]
fn both_nodes_of_a_mirrored_disk_present_one_logical_unit() {
    runtime().block_on(async {
        let peer = |id: u32| format!("[[peer]]\nid = {id}\naddress = \"127.0.0.1:9\"\n\n");
        let d = |peer: u32| mem_disk("vol0", &format!("peer = {peer}\niscsi = \"127.0.0.1:0\""));
        let one = Config::parse(&format!(
            "[node]\nid = 1\ndata_dir = \"/nonexistent-vsan-iscsi-test\"\n\n{}{}",
            peer(2),
            d(2)
        ))
        .unwrap();
        let two = Config::parse(&format!(
            "[node]\nid = 2\ndata_dir = \"/nonexistent-vsan-iscsi-test\"\n\
             listen = \"127.0.0.1:0\"\n\n{}{}",
            peer(1),
            d(1)
        ))
        .unwrap();
        let n1 = Node::start(&one, StartOptions::default()).await.unwrap();
        let n2 = Node::start(&two, StartOptions::default()).await.unwrap();
        let lu = |n: &Node| {
            let disk = n.disk("vol0").unwrap();
            let t = disk.iscsi.expect("a target");
            assert_eq!(t.target, "iqn.2026-12.io.vsan:vol0");
            let lu = Arc::clone(t.server.targets()[0].lun0());
            // The LU serves the mirror (which holds requests while the replica is not
            // proven current), the same device NBD would.
            assert!(Arc::ptr_eq(lu.device(), &disk.device));
            lu
        };
        let (l1, l2) = (lu(&n1), lu(&n2));
        assert_eq!(l1.identity(), l2.identity());
        assert_eq!(
            l1.identity(),
            &LuIdentity::from_disk_id(&DiskId::from_name("vol0").to_string())
        );
        // (Neither replica is proven current: dropping the nodes stops their tasks.)
        drop((n1, n2));
    });
}

#[test]
fn a_busy_portal_refuses_the_start() {
    runtime().block_on(async {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let cfg = config(
            "",
            &(mem_disk("a", "iscsi = \"127.0.0.1:0\"")
                + &mem_disk("b", &format!("iscsi = \"{addr}\""))),
        );
        match Node::start(&cfg, StartOptions::default()).await {
            Err(StartError::AddressInUse(m)) => {
                assert!(
                    m.contains("disk[1].iscsi") && m.contains(&addr.to_string()),
                    "{m}"
                )
            }
            other => panic!("expected AddressInUse, got {other:?}"),
        }
    });
}

#[test]
fn an_unreadable_secret_file_refuses_the_start_before_any_image_is_made() {
    runtime().block_on(async {
        let dir = std::env::temp_dir().join(format!("vsan-iscsi-node-{}", std::process::id()));
        let text = format!(
            "[node]\nid = 1\ndata_dir = {:?}\n\n[[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\n\
             iscsi = \"127.0.0.1:0\"\niscsi_chap_user = \"alice\"\n\
             iscsi_chap_secret_file = \"/nonexistent/vsan-chap-secret\"\n",
            dir.display().to_string()
        );
        let cfg = Config::parse(&text).unwrap();
        match Node::start(&cfg, StartOptions::default()).await {
            Err(StartError::Config(m)) => {
                assert!(m.contains("disk[0].iscsi_chap_secret_file"), "{m}")
            }
            other => panic!("expected a config error, got {other:?}"),
        }
        assert!(!dir.join("vol0.img").exists(), "nothing is created");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[cfg(feature = "mgmt")]
#[test]
fn management_status_lists_the_target() {
    use vsan_replica::mgmt::v1;
    use vsan_replica::mgmt::v1::mgmt_client::MgmtClient;
    runtime().block_on(async {
        let cfg = config(
            "mgmt = \"127.0.0.1:0\"",
            &(mem_disk(
                "vol0",
                "iscsi = \"127.0.0.1:0\"\niscsi_chap_user = \"alice\"\n\
                 iscsi_chap_secret = \"a-secret-of-16-b\"",
            ) + &mem_disk("plain", "")),
        );
        let node = Node::start(&cfg, StartOptions::default()).await.unwrap();
        let (portal, target) = ready_iscsi(&node, "vol0");
        let mut client = MgmtClient::connect(format!("http://{}", node.mgmt_address().unwrap()))
            .await
            .unwrap();
        let s = client
            .get_disk_status(v1::DiskRequest {
                name: "vol0".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!((s.iscsi_target, s.iscsi_portal), (target, portal));
        assert!(s.iscsi_sessions.is_empty(), "{:?}", s.iscsi_sessions);
        let all = client
            .list_disks(v1::ListDisksRequest {})
            .await
            .unwrap()
            .into_inner();
        let plain = all.disks.iter().find(|d| d.name == "plain").unwrap();
        assert!(plain.iscsi_target.is_empty() && plain.iscsi_portal.is_empty());
        assert!(!format!("{all:?}").contains("a-secret-of-16-b"));
        node.shutdown().await.unwrap();
    });
}

#[cfg(feature = "mgmt")]
#[test]
fn deleting_a_disk_stops_its_portal_unless_another_disk_shares_it() {
    use vsan_replica::mgmt::v1;
    use vsan_replica::mgmt::v1::mgmt_client::MgmtClient;
    runtime().block_on(async {
        let cfg = config(
            "mgmt = \"127.0.0.1:0\"",
            &(mem_disk("a", "iscsi = \"127.0.0.1:0\"")
                + &mem_disk("b", "iscsi = \"127.0.0.1:0\"")
                + &mem_disk("c", "iscsi = \"127.0.0.2:0\"")),
        );
        let node = Node::start(&cfg, StartOptions::default()).await.unwrap();
        let mut client = MgmtClient::connect(format!("http://{}", node.mgmt_address().unwrap()))
            .await
            .unwrap();
        let delete = |name: &str| v1::DeleteDiskRequest {
            name: name.into(),
            force: false,
            remove_files: false,
        };
        let refused = client.delete_disk(delete("a")).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
        assert!(
            refused.message().contains("shares its iSCSI portal")
                && refused.message().contains("iqn.2026-12.io.vsan:b"),
            "{refused}"
        );
        assert!(node.disk("a").is_some(), "a refused delete leaves the disk");
        client.delete_disk(delete("c")).await.unwrap();
        assert!(node.disk("c").is_none());
        let names: Vec<String> = client
            .list_disks(v1::ListDisksRequest {})
            .await
            .unwrap()
            .into_inner()
            .disks
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["a", "b"]);
        node.shutdown().await.unwrap();
    });
}

#[cfg(feature = "metrics")]
#[test]
fn metrics_count_iscsi_per_portal() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    runtime().block_on(async {
        let cfg = config(
            "metrics = \"127.0.0.1:0\"",
            &(mem_disk("a", "iscsi = \"127.0.0.1:0\"") + &mem_disk("b", "iscsi = \"127.0.0.1:0\"")),
        );
        let node = Node::start(&cfg, StartOptions::default()).await.unwrap();
        let (portal, _) = ready_iscsi(&node, "a");
        let mut s = TcpStream::connect(node.metrics_address().unwrap())
            .await
            .unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).await.unwrap();
        let portal_label = format!("{{portal=\"{portal}\"}}");
        for name in [
            "vsan_iscsi_commands_total",
            "vsan_iscsi_sessions_total",
            "vsan_iscsi_sessions_open",
            "vsan_iscsi_logins_refused_total",
        ] {
            let want = format!("{name}{portal_label} 0");
            let found: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
            assert_eq!(found, [want.as_str()], "one series per portal:\n{text}");
        }
        assert!(
            text.contains(
                "vsan_iscsi_target_sessions{disk=\"b\",target=\"iqn.2026-12.io.vsan:b\"} 0"
            ),
            "{text}"
        );
        node.shutdown().await.unwrap();
    });
}

#[test]
fn the_c_abi_opens_the_same_targets() {
    let ok = "[node]\nid = 1\ndata_dir = \"/nonexistent-vsan-iscsi-test\"\nthreads = 2\n\
              iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"a-secret-of-16-b\"\n\n\
              [[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"mem\"\n\
              iscsi = \"127.0.0.1:0\"\n";
    let node = common::node_from(ok);
    let disk = common::open(node, "vol0");
    // SAFETY: handles from the calls above, each closed once.
    unsafe {
        assert_eq!(vsan::vsan_disk_free(disk), vsan::VSAN_OK);
        assert_eq!(vsan::vsan_node_free(node), vsan::VSAN_OK);
    }
    let short = ok.replace("a-secret-of-16-b", "too-short");
    let (code, message) = common::try_node(&short).expect_err("a short secret is refused");
    assert_eq!(code, vsan::VSAN_ERR_INVALID_ARGUMENT, "{message}");
    assert!(
        message.contains("node.iscsi_chap_secret") && message.contains("12 to 255"),
        "{message}"
    );
    assert!(!message.contains("too-short"), "{message}");
}
