//! The iSCSI keys of a node's config: portals, target names and their defaults, CHAP per
//! disk and per node, and the errors that name the key.

use vsan::node::config::{Config, ConfigError, check_iscsi_name};

const NODE: &str = "[node]\nid = 1\ndata_dir = \"/tmp/vsan-iscsi-config\"\n";

fn with(node_extra: &str, disks: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{NODE}{node_extra}\n{disks}"))
}

fn disk(name: &str, extra: &str) -> String {
    format!(
        "[[disk]]\nname = \"{name}\"\nsize = \"1MiB\"\nbacking = \"mem\"\n\
         iscsi = \"127.0.0.1:3260\"\n{extra}\n"
    )
}

fn refused(node_extra: &str, disks: &str, key: &str, says: &str) -> ConfigError {
    let e = with(node_extra, disks).expect_err("the config should be refused");
    assert_eq!(e.key, key, "{e}");
    assert!(e.message.contains(says), "{e}");
    e
}

#[test]
fn a_disk_gets_a_default_target_name_and_no_chap() {
    let c = with("", &disk("vol0", "")).unwrap();
    assert_eq!(c.disk[0].iscsi.as_deref(), Some("127.0.0.1:3260"));
    assert_eq!(c.disk[0].iscsi_target_name(), "iqn.2026-12.io.vsan:vol0");
    assert!(c.iscsi_chap(0).unwrap().is_none());
    // Upper case and `_` have no place in an iSCSI name: the default writes them so.
    let c = with("", &disk("Vol_0", "")).unwrap();
    assert_eq!(c.disk[0].iscsi_target_name(), "iqn.2026-12.io.vsan:vol-0");
    // ... so two disk names may give one target name: refused, naming the key to set.
    refused(
        "",
        &(disk("a_b", "") + &disk("a-b", "")),
        "disk[1].iscsi_target",
        "also disk[0]'s target",
    );
}

#[test]
fn iscsi_target_overrides_the_default_and_is_checked() {
    let c = with(
        "",
        &disk(
            "vol0",
            "iscsi_target = \"iqn.2001-04.com.example:storage.disk1\"",
        ),
    )
    .unwrap();
    assert_eq!(
        c.disk[0].iscsi_target_name(),
        "iqn.2001-04.com.example:storage.disk1"
    );
    with("", &disk("vol0", "iscsi_target = \"eui.02004567a425678d\"")).unwrap();
    for (bad, says) in [
        ("IQN.2001-04.com.example:x", "upper case"),
        ("iqn.2001-04.com.Example", "upper case"),
        ("iqn.2001-13.com.example", "year and month"),
        ("iqn.01-04.com.example", "year and month"),
        ("iqn.2001-04", "reversed domain name"),
        ("iqn.2001-04.:x", "reversed domain name"),
        ("iqn.2001-04.com..example", "reversed domain name"),
        ("iqn.2001-04.com.example:", "nothing follows"),
        ("iqn.2001-04.com.example:a_b", "'_' is not allowed"),
        ("iqn.2001-04.com.example:a b", "' ' is not allowed"),
        ("eui.0200", "16 hex digits"),
        ("eui.02004567A425678D", "upper case"),
        ("vol0", "not an iSCSI name"),
        ("naa.6001405", "not an iSCSI name"),
    ] {
        let e = refused(
            "",
            &disk("vol0", &format!("iscsi_target = \"{bad}\"")),
            "disk[0].iscsi_target",
            says,
        );
        assert!(check_iscsi_name(bad).is_err(), "{bad}: {e}");
    }
    let long = format!("iqn.2001-04.com.example:{}", "x".repeat(200));
    refused(
        "",
        &disk("vol0", &format!("iscsi_target = \"{long}\"")),
        "disk[0].iscsi_target",
        "at most 223",
    );
    // A disk name too long for the default says to set the key.
    let name = "d".repeat(220);
    refused("", &disk(&name, ""), "disk[0].name", "set iscsi_target");
    refused(
        "",
        &(disk("a", "iscsi_target = \"iqn.2026-12.io.vsan:same\"")
            + &disk("b", "iscsi_target = \"iqn.2026-12.io.vsan:same\"")),
        "disk[1].iscsi_target",
        "also disk[0]'s target",
    );
}

#[test]
fn portals_and_keys_without_a_portal() {
    refused(
        "",
        &disk("vol0", "").replace("127.0.0.1:3260", "nowhere"),
        "disk[0].iscsi",
        "not an address",
    );
    let no_portal = "[[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"mem\"\n";
    refused(
        "",
        &format!("{no_portal}iscsi_target = \"iqn.2026-12.io.vsan:x\"\n"),
        "disk[0].iscsi_target",
        "only with `iscsi`",
    );
    refused(
        "",
        &format!("{no_portal}iscsi_chap_user = \"u\"\n"),
        "disk[0].iscsi_chap_user",
        "only with `iscsi`",
    );
    // Unknown keys stay errors.
    refused(
        "",
        &disk("vol0", "iscsi_chap_pasword = \"x\""),
        "disk[0].iscsi_chap_pasword",
        "unknown field",
    );
    // A disk with only an iSCSI portal (no nbd) is a valid disk.
    let c = with("", &disk("vol0", "")).unwrap();
    assert!(c.disk[0].nbd.is_none());
}

#[test]
fn chap_per_disk() {
    let c = with(
        "",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"twelve-bytes\"",
        ),
    )
    .unwrap();
    let chap = c.iscsi_chap(0).unwrap().expect("CHAP");
    assert_eq!(chap.initiator.user, "alice");
    assert_eq!(chap.initiator.secret, b"twelve-bytes");
    assert!(chap.target.is_none());
    let c = with(
        "",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"twelve-bytes\"\n\
             iscsi_chap_target_user = \"tgt\"\niscsi_chap_target_secret = \"another-secret\"",
        ),
    )
    .unwrap();
    let chap = c.iscsi_chap(0).unwrap().expect("CHAP");
    let mutual = chap.target.expect("mutual CHAP");
    assert_eq!(
        (mutual.user.as_str(), mutual.secret.as_slice()),
        ("tgt", &b"another-secret"[..])
    );
}

#[test]
fn chap_refusals_name_the_key() {
    let short = refused(
        "",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"short\"",
        ),
        "disk[0].iscsi_chap_secret",
        "12 to 255 bytes",
    );
    assert!(!short.to_string().contains("short\""), "{short}");
    refused(
        "",
        &disk(
            "vol0",
            &format!(
                "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"{}\"",
                "x".repeat(256)
            ),
        ),
        "disk[0].iscsi_chap_secret",
        "12 to 255 bytes",
    );
    refused(
        "",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"twelve-bytes\"\n\
             iscsi_chap_secret_file = \"/etc/secret\"",
        ),
        "disk[0].iscsi_chap_secret",
        "not both",
    );
    refused(
        "",
        &disk("vol0", "iscsi_chap_user = \"alice\""),
        "disk[0].iscsi_chap_secret",
        "needs a secret",
    );
    refused(
        "",
        &disk("vol0", "iscsi_chap_secret = \"twelve-bytes\""),
        "disk[0].iscsi_chap_user",
        "needs its user name",
    );
    refused(
        "",
        &disk(
            "vol0",
            "iscsi_chap_target_user = \"tgt\"\niscsi_chap_target_secret = \"another-secret\"",
        ),
        "disk[0].iscsi_chap_target_user",
        "mutual CHAP needs the initiator's pair",
    );
    refused(
        "",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"twelve-bytes\"\n\
             iscsi_chap_target_user = \"tgt\"\niscsi_chap_target_secret = \"twelve-bytes\"",
        ),
        "disk[0].iscsi_chap_target_secret",
        "must differ",
    );
    refused(
        "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"tiny\"\n",
        &disk("vol0", ""),
        "node.iscsi_chap_secret",
        "12 to 255 bytes",
    );
}

#[test]
fn node_chap_is_every_disks_default_and_a_disk_replaces_it() {
    let node = "iscsi_chap_user = \"node-user\"\niscsi_chap_secret = \"node-secret-1\"\n\
                iscsi_chap_target_user = \"node-tgt\"\n\
                iscsi_chap_target_secret = \"node-secret-2\"\n";
    let disks = disk("a", "")
        + &disk(
            "b",
            "iscsi_chap_user = \"b-user\"\niscsi_chap_secret = \"b-secret-123\"",
        );
    let c = with(node, &disks).unwrap();
    let a = c.iscsi_chap(0).unwrap().expect("the node's CHAP");
    assert_eq!(a.initiator.user, "node-user");
    assert_eq!(a.target.as_ref().map(|t| t.user.as_str()), Some("node-tgt"));
    // The disk's own initiator pair; the node's mutual pair still applies.
    let b = c.iscsi_chap(1).unwrap().expect("the disk's CHAP");
    assert_eq!(b.initiator.user, "b-user");
    assert_eq!(b.initiator.secret, b"b-secret-123");
    assert_eq!(b.target.as_ref().map(|t| t.user.as_str()), Some("node-tgt"));
    // Node keys alone (no disk with a portal) are fine.
    with(node, "").unwrap();
}

#[test]
fn secret_files_are_read_at_start_without_their_newline() {
    let dir = std::env::temp_dir().join(format!("vsan-iscsi-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    std::fs::write(&good, "from-a-file-secret\n").unwrap();
    let short = dir.join("short");
    std::fs::write(&short, "eleven-byte\n").unwrap();
    let c = with(
        "",
        &disk(
            "vol0",
            &format!(
                "iscsi_chap_user = \"alice\"\niscsi_chap_secret_file = {:?}",
                good.display().to_string()
            ),
        ),
    )
    .unwrap();
    let chap = c.iscsi_chap(0).unwrap().expect("CHAP");
    assert_eq!(chap.initiator.secret, b"from-a-file-secret");
    let c = with(
        "",
        &disk(
            "vol0",
            &format!(
                "iscsi_chap_user = \"alice\"\niscsi_chap_secret_file = {:?}",
                short.display().to_string()
            ),
        ),
    )
    .unwrap();
    let e = c.iscsi_chap(0).unwrap_err();
    assert_eq!(e.key, "disk[0].iscsi_chap_secret_file", "{e}");
    assert!(e.message.contains("12 to 255"), "{e}");
    assert!(!e.to_string().contains("eleven-byte"), "{e}");
    let c = with(
        "",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret_file = \"/nonexistent/vsan-secret\"",
        ),
    )
    .unwrap();
    let e = c.iscsi_chap(0).unwrap_err();
    assert_eq!(e.key, "disk[0].iscsi_chap_secret_file", "{e}");
    assert!(e.message.contains("cannot read"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn secrets_never_show_in_debug() {
    let c = with(
        "iscsi_chap_user = \"n\"\niscsi_chap_secret = \"node-level-secret\"\n",
        &disk(
            "vol0",
            "iscsi_chap_user = \"alice\"\niscsi_chap_secret = \"disk-level-secret\"",
        ),
    )
    .unwrap();
    let shown = format!("{c:?} {:?}", c.iscsi_chap(0).unwrap());
    assert!(!shown.contains("level-secret"), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
}
