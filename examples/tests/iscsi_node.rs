//! `vsan-node` with iSCSI targets, as a real process: a disk exported only over iSCSI
//! on a port-0 portal prints `ready disk=<name> iscsi=<portal> target=<iqn>` with the
//! actual port; `vsanctl status` (table and JSON) lists the target and its portal; a
//! portal beyond loopback without CHAP is warned about, one with CHAP is not; a config
//! with a short CHAP secret exits 2 naming the key, without showing the secret.

use crate::common;

use std::time::Duration;

use common::vsanctl::{MGMT, mgmt_addr, vsanctl_ok};
use common::{Node, Sig, TestDir, field, node_section, run_node_to_exit};
use serde_json::Value;

const READY: Duration = Duration::from_secs(20);

fn iscsi_disk(name: &str, portal: &str, extra: &str) -> String {
    format!(
        "[[disk]]\nname = \"{name}\"\nsize = \"1MiB\"\nbacking = \"mem\"\niscsi = \"{portal}\"\n\
         {extra}\n"
    )
}

#[test]
fn an_iscsi_only_disk_is_announced_and_shown_by_vsanctl() {
    let dir = TestDir::new("iscsi-status");
    let config = format!(
        "{}{MGMT}\n{}{}",
        node_section(&dir),
        iscsi_disk("vol0", "127.0.0.1:0", ""),
        iscsi_disk("vol1", "127.0.0.1:0", "nbd = \"127.0.0.1:0\""),
    );
    let node = Node::start(&dir, &config, &["vol1"]);
    let line = node.wait_stdout(&["ready disk=vol0 iscsi="], READY);
    let portal = field(&line, "iscsi").unwrap();
    assert!(
        portal.starts_with("127.0.0.1:") && !portal.ends_with(":0"),
        "{line}"
    );
    assert_eq!(
        field(&line, "target").as_deref(),
        Some("iqn.2026-12.io.vsan:vol0")
    );
    // vol1 has both lines; its NBD line is the usual one; both disks share the portal.
    let vol1 = node.wait_stdout(&["ready disk=vol1 iscsi="], READY);
    assert_eq!(field(&vol1, "iscsi").as_deref(), Some(portal.as_str()));
    assert!(node.addr("vol1").starts_with("127.0.0.1:"));
    assert!(
        !node
            .stdout_lines()
            .iter()
            .any(|l| l.starts_with("ready disk=vol0 nbd=")),
        "vol0 has no NBD export"
    );

    let mgmt = mgmt_addr(&node);
    let table = vsanctl_ok(&mgmt, &["status"]).stdout;
    let header = table.lines().nth(1).unwrap_or_default();
    assert!(header.contains("ISCSI"), "{table}");
    assert!(table.contains(&format!("{portal} (0 sessions)")), "{table}");
    assert!(
        table.contains(&format!(
            "vol0: iscsi:        iqn.2026-12.io.vsan:vol0 on {portal}, 0 sessions"
        )),
        "{table}"
    );
    let one = vsanctl_ok(&mgmt, &["status", "vol0"]).stdout;
    assert!(one.contains("iqn.2026-12.io.vsan:vol0 on"), "{one}");
    let json: Value =
        serde_json::from_str(&vsanctl_ok(&mgmt, &["status", "vol0", "--json"]).stdout).unwrap();
    assert_eq!(json["iscsi"]["target"], "iqn.2026-12.io.vsan:vol0");
    assert_eq!(json["iscsi"]["portal"], portal.as_str());
    assert_eq!(json["iscsi"]["sessions"], Value::Array(Vec::new()));
    assert_eq!(json["nbd"], Value::Null);
    node.stop_clean(Sig::TERM);
}

#[test]
fn a_portal_beyond_loopback_without_chap_is_warned_about() {
    let dir = TestDir::new("iscsi-open");
    let config = format!(
        "{}{}{}",
        node_section(&dir),
        iscsi_disk("open", "0.0.0.0:0", ""),
        iscsi_disk(
            "guarded",
            "0.0.0.0:0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"a-secret-of-16-b\""
        ),
    );
    let node = Node::start(&dir, &config, &[]);
    node.wait_stdout(&["ready disk=guarded iscsi=0.0.0.0:"], READY);
    node.wait_log("listens beyond loopback without CHAP", READY);
    let stopped = node.stop_clean(Sig::TERM);
    let warned: Vec<&str> = stopped
        .log
        .lines()
        .filter(|l| l.contains("beyond loopback without CHAP"))
        .collect();
    assert_eq!(warned.len(), 1, "{}", stopped.log);
    assert!(warned[0].contains("disk=open"), "{}", warned[0]);
    assert!(!stopped.log.contains("a-secret-of-16-b"), "{}", stopped.log);
}

#[test]
fn a_short_chap_secret_exits_2_naming_the_key() {
    let dir = TestDir::new("iscsi-short");
    let config = format!(
        "{}{}",
        node_section(&dir),
        iscsi_disk(
            "vol0",
            "127.0.0.1:0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"hunter2\""
        ),
    );
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert!(
        out.stderr.contains("disk[0].iscsi_chap_secret") && out.stderr.contains("12 to 255"),
        "{out}"
    );
    assert!(!out.text().contains("hunter2"), "{out}");
}
