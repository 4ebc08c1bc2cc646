//! Real iSCSI initiators nobody here wrote — QEMU's (qemu-io, qemu-img over `iscsi://`,
//! libiscsi inside qemu) and libiscsi's tools (iscsi-ls, iscsi-inq,
//! iscsi-readcapacity16) — against a running `vsan-node`, plus a hand-written initiator
//! for hostile input. What is checked is what a user cares about: the bytes another
//! client reads back through NBD and through the peer node, the identity and size an
//! initiator sees, who may log in, that acknowledged writes survive `kill -9`, and that
//! bad input ends one connection and nothing else.
//!
//! The ignored `tgtd_*` tests run the client side of the same checks against Debian's
//! tgtd (root needed): they show the checks themselves work, independently of vsan's
//! target. Run them with `cargo test --release -p vsan-examples --test nodes --
//! --ignored iscsi_interop::tgtd_`.
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::iscsi::{
    IscsiPair, IscsiTarget, OPERATIONAL_KEYS, RAW_INITIATOR, RawConn, Reply, chap_lines,
    colon_field, libiscsi, local_config, node_pid, op, read16, readcapacity_size, rss_kib,
};
use common::mirror::{CONNECTED, assert_replicas_identical};
use common::{
    Node, ProcessGuard, Region, Sig, TOOL_TIMEOUT, TestDir, assert_file_holds, image,
    qemu_io_checked, qemu_io_reads, qemu_io_writes, require_tool, run_tool,
};
use rand::{RngCore, SeedableRng};
use vsan_examples::tgtd::{Tgtd, TgtdChap};

const MIB: u64 = 1 << 20;
/// How long a hostile connection may take to be answered or closed.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the pair may take to notice a kill, reconnect and resync.
const EVENT_TIMEOUT: Duration = Duration::from_secs(60);

const USER: &str = "initiator-user";
const SECRET: &str = "initiator-secret-0123";
const T_USER: &str = "target-user";
const T_SECRET: &str = "target-secret-456789";

/// Every tool in `tools` is installed (or the test is skipped / failed per
/// `VSAN_REQUIRE_INTEROP`).
fn tools(tools: &[&str]) -> bool {
    tools.iter().all(|t| require_tool(t))
}

/// A local 64 MiB disk exported over NBD and iSCSI, with `extra` `[[disk]]` lines.
fn local_node(dir: &TestDir, extra: &str) -> (Node, IscsiTarget) {
    let node = Node::start(
        dir,
        &local_config(dir, "vol0", "\"64MiB\"", extra),
        &["vol0"],
    );
    let target = IscsiTarget::of_node(&node, "vol0");
    (node, target)
}

/// tgtd exporting a fresh file of `size` bytes (the `tgtd_*` tests).
fn start_tgtd(dir: &TestDir, size: u64, chap: &TgtdChap) -> (Tgtd, IscsiTarget) {
    let image = dir.join("lun.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(size))
        .expect("create the LUN file");
    let tgtd = Tgtd::start(
        &image,
        "iqn.2026-12.io.vsan.test:tgtd",
        chap,
        &dir.join("tgtd.log"),
    )
    .expect("start tgtd");
    let target = IscsiTarget::of_tgtd(&tgtd);
    (tgtd, target)
}

// ---------------------------------------------------------------------------------------
// The checks, each against any target.

/// Regions that cross 4 KiB boundaries, near the start, middle and end of a 64 MiB disk.
fn regions(size: u64) -> [Region; 4] {
    [
        Region::new(0xa5, 0, MIB),
        Region::new(0x3c, MIB + 4608, 7680),
        Region::new(0x96, 20 * MIB + 512, 128 * 1024 - 512),
        Region::new(0x42, size - 512, 512),
    ]
}

/// `iscsi-ls -s` lists the target and its LUN with a size.
fn check_discovery(target: &IscsiTarget) {
    let out = libiscsi("iscsi-ls", &["-s", &target.portal_url()]);
    out.assert_success();
    assert!(
        out.stdout.contains(&format!("Target:{} ", target.iqn))
            || out.stdout.contains(&format!("Target:{}\n", target.iqn)),
        "iscsi-ls does not list {}:\n{out}",
        target.iqn
    );
    assert!(
        out.stdout.lines().any(
            |l| l.trim_start().starts_with(&format!("Lun:{} ", target.lun))
                && l.contains("DIRECT_ACCESS")
                && l.contains("Size:")
        ),
        "iscsi-ls shows no disk at LUN {}:\n{out}",
        target.lun
    );
}

/// What `iscsi-inq` shows of a LUN.
#[derive(Debug)]
struct Identity {
    vendor: String,
    product: String,
    serial: String,
    /// `Designator Type:` values of VPD 0x83, in order.
    designators: Vec<String>,
}

/// `iscsi-inq`: a direct-access device with a vendor and product; VPD 0x80 a serial
/// number; VPD 0x83 designators. `iscsi-readcapacity16` reports `size` bytes.
fn check_identity(target: &IscsiTarget, size: u64) -> Identity {
    let url = target.url();
    let std = libiscsi("iscsi-inq", &[&url]);
    std.assert_success();
    assert_eq!(
        colon_field(&std.stdout, "Peripheral Device Type").as_deref(),
        Some("DIRECT_ACCESS"),
        "{std}"
    );
    let vendor = colon_field(&std.stdout, "Vendor").unwrap_or_default();
    let product = colon_field(&std.stdout, "Product").unwrap_or_default();
    assert!(!vendor.is_empty() && !product.is_empty(), "{std}");

    let vpd = libiscsi("iscsi-inq", &["-e", "1", "-c", "0", &url]);
    vpd.assert_success();
    for page in ["0x80", "0x83"] {
        assert!(
            vpd.stdout.contains(&format!("Page:{page} ")),
            "VPD {page} is not listed as supported:\n{vpd}"
        );
    }
    // (iscsi-inq reads -c as decimal: 128 is page 0x80, 131 is 0x83.)
    let p80 = libiscsi("iscsi-inq", &["-e", "1", "-c", "128", &url]);
    p80.assert_success();
    let serial = colon_field(&p80.stdout, "Unit Serial Number")
        .map(|s| s.trim_matches(['[', ']', ' ']).to_string())
        .unwrap_or_default();
    assert!(!serial.is_empty(), "no unit serial number:\n{p80}");
    let p83 = libiscsi("iscsi-inq", &["-e", "1", "-c", "131", &url]);
    p83.assert_success();
    let designators: Vec<String> = p83
        .stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Designator Type:"))
        .map(str::to_string)
        .collect();
    assert!(
        !designators.is_empty(),
        "no designators in VPD 0x83:\n{p83}"
    );

    assert_eq!(
        readcapacity_size(&url),
        size,
        "iscsi-readcapacity16 -s {url}"
    );
    let rc = libiscsi("iscsi-readcapacity16", &[&url]);
    rc.assert_success();
    let last_lba: u64 = colon_field(&rc.stdout, "RETURNED LOGICAL BLOCK ADDRESS")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no last LBA:\n{rc}"));
    let block: u64 = colon_field(&rc.stdout, "LOGICAL BLOCK LENGTH IN BYTES")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no block length:\n{rc}"));
    assert_eq!((last_lba + 1) * block, size, "{rc}");
    Identity {
        vendor,
        product,
        serial,
        designators,
    }
}

/// `qemu-img convert` of a 64 MiB random image into the LUN and back out: both copies
/// compare equal to the original (`qemu-img compare`), the LUN itself too.
fn check_convert_round_trip(dir: &Path, url: &str) {
    let src = dir.join("random.img");
    let back = dir.join("back.img");
    let mut data = vec![0u8; (64 * MIB) as usize];
    rand::rngs::StdRng::seed_from_u64(19).fill_bytes(&mut data);
    std::fs::write(&src, &data).expect("write the random image");
    let limit = Duration::from_secs(120);
    // -n: the LUN exists; write into it instead of creating it.
    run_tool(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            "-t",
            "none",
            src.to_str().expect("utf-8"),
            url,
        ],
        limit,
    )
    .assert_success();
    run_tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            url,
            back.to_str().expect("utf-8"),
        ],
        limit,
    )
    .assert_success();
    let cmp = run_tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().expect("utf-8"),
            back.to_str().expect("utf-8"),
        ],
        limit,
    );
    assert!(
        cmp.status.success() && cmp.stdout.contains("Images are identical"),
        "{cmp}"
    );
    let got = std::fs::read(&back).expect("read the copy back");
    common::assert_same_bytes(&got, &data, "the image copied out of the LUN");
    let cmp = run_tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().expect("utf-8"),
            url,
        ],
        limit,
    );
    assert!(cmp.status.success(), "{cmp}");
}

/// A login failure as libiscsi reports it: non-zero exit and the login status named.
fn assert_refused(out: &common::ToolOutput, statuses: &[&str], what: &str) {
    assert!(!out.status.success(), "{what}: logged in:\n{out}");
    let text = out.text();
    assert!(
        statuses.iter().any(|s| text.contains(s)),
        "{what}: refused, but not with {statuses:?}:\n{out}"
    );
}

/// One-way CHAP: the right secret logs in (libiscsi and qemu), a wrong one and none are
/// refused with an authentication failure (login status 0x0201, which libiscsi prints
/// as 513; a missing secret may also be an authorization failure, 0x0202).
fn check_chap(target: &IscsiTarget) {
    let right = target.url_chap(USER, SECRET);
    libiscsi("iscsi-inq", &[&right]).assert_success();
    let info = run_tool("qemu-img", &["info", "-f", "raw", &right], TOOL_TIMEOUT);
    info.assert_success();
    qemu_io_checked(
        &right,
        &[Region::new(0x5e, 0, 4096).write(), "flush".to_string()],
    );

    let wrong = target.url_chap(USER, "not-the-secret-000");
    assert_refused(
        &libiscsi("iscsi-inq", &[&wrong]),
        &["Authentication failure(513)"],
        "wrong secret",
    );
    assert_refused(
        &run_tool("qemu-img", &["info", "-f", "raw", &wrong], TOOL_TIMEOUT),
        &["Authentication failure(513)"],
        "qemu, wrong secret",
    );
    let other_user = target.url_chap("someone-else", SECRET);
    assert_refused(
        &libiscsi("iscsi-inq", &[&other_user]),
        &["Authentication failure(513)", "Authorization failure(514)"],
        "unknown user",
    );
    let none = target.url();
    assert_refused(
        &libiscsi("iscsi-inq", &[&none]),
        &["Authentication failure(513)", "Authorization failure(514)"],
        "no secret",
    );
}

/// Mutual CHAP, both ways: the target proves itself with its own secret (an initiator
/// expecting another secret refuses it), and the initiator still has to prove itself.
fn check_mutual_chap(target: &IscsiTarget) {
    let both = target.url_mutual(USER, SECRET, T_USER, T_SECRET);
    libiscsi("iscsi-inq", &[&both]).assert_success();
    // One-way CHAP still works against a target that could prove itself.
    libiscsi("iscsi-inq", &[&target.url_chap(USER, SECRET)]).assert_success();
    // The initiator refuses a target that answers with another secret or name.
    let bad_target = target.url_mutual(USER, SECRET, T_USER, "not-the-target-secret");
    assert_refused(
        &libiscsi("iscsi-inq", &[&bad_target]),
        &["Invalid CHAP_R response from the target"],
        "target proved itself with the wrong secret",
    );
    let bad_name = target.url_mutual(USER, SECRET, "another-target", T_SECRET);
    assert_refused(
        &libiscsi("iscsi-inq", &[&bad_name]),
        &["Wrong CHAP targetname", "Invalid CHAP_R response"],
        "target answered under another name",
    );
    // The target refuses an initiator with the wrong secret, mutual or not.
    let bad_init = target.url_mutual(USER, "not-the-secret-000", T_USER, T_SECRET);
    assert_refused(
        &libiscsi("iscsi-inq", &[&bad_init]),
        &["Authentication failure(513)"],
        "initiator with the wrong secret asking for mutual CHAP",
    );
}

/// A WRITE whose data segment claims 16 MiB: refused (Reject, a CHECK CONDITION) or the
/// connection closed, from the header, without waiting for the data.
fn check_oversized_ffp_segment(target: &IscsiTarget) {
    let mut c = RawConn::login(target);
    let mut cdb = [0u8; 16];
    cdb[0] = 0x8a; // WRITE(16), LBA 0, 8 blocks
    cdb[13] = 8;
    let (_, pdu) = c.scsi_cmd(&cdb, false, 4096);
    let pdu = pdu.u8_at(1, 0x80 | 0x20 | 0x01).claim_len(0x00ff_ffff);
    let _ = c.send(&pdu);
    if let Some(p) = answered_or_closed(&mut c, "an oversized data segment") {
        assert!(
            matches!(p.opcode(), op::REJECT | op::ASYNC | op::SCSI_RSP),
            "an oversized data segment answered with {p:?}"
        );
        if p.opcode() == op::SCSI_RSP {
            assert_ne!(p.bhs[3], 0, "an oversized WRITE completed GOOD");
        }
    }
    drop(c);
}

/// What one hostile connection got.
fn answered_or_closed(c: &mut RawConn, what: &str) -> Option<common::iscsi::Pdu> {
    match c.recv(ANSWER_TIMEOUT) {
        Reply::Pdu(p) => {
            eprintln!(
                "{what}: answered, opcode {:#04x}, bytes 1-3 {:02x?}, login status {:?}",
                p.opcode(),
                &p.bhs[1..4],
                p.login_status()
            );
            Some(p)
        }
        Reply::Closed => {
            eprintln!("{what}: connection closed");
            None
        }
        Reply::Silent => panic!("{what}: neither an answer nor a close within {ANSWER_TIMEOUT:?}"),
    }
}

/// Each hostile input gets an answer or a clean close, and the target goes on serving
/// `bystander` (logged in before) and new sessions. With `lenient_ffp_limit` the
/// oversized full-feature data segment is left out (tgtd reads all 16 MiB of it
/// silently instead of refusing it from the header).
fn check_hostile_input(target: &IscsiTarget, lenient_ffp_limit: bool) {
    let mut bystander = RawConn::login(target);
    bystander.assert_serves("a session logged in before any hostile input");
    let still_serving = |bystander: &mut RawConn, after: &str| {
        bystander.assert_serves(&format!("the other session after {after}"));
        let size = readcapacity_size(&target.url());
        assert!(size > 0, "after {after}");
    };

    // Garbage: bytes no PDU starts with (opcode 0x3f is the target's Reject), then noise.
    let mut c = RawConn::connect(target);
    let mut junk = vec![0xffu8; 48];
    let mut noise = vec![0u8; 4096];
    rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut noise);
    junk.extend_from_slice(&noise);
    let _ = c.send_bytes(&junk);
    if let Some(p) = answered_or_closed(&mut c, "garbage") {
        assert!(
            matches!(p.opcode(), op::REJECT | op::LOGIN_RSP),
            "garbage answered with opcode {:#04x}",
            p.opcode()
        );
        if p.opcode() == op::LOGIN_RSP {
            assert_ne!(p.login_status().0, 0, "garbage logged in");
        }
    }
    drop(c);
    still_serving(&mut bystander, "garbage");

    // A truncated PDU: 30 bytes of a Login Request, then EOF.
    let mut c = RawConn::connect(target);
    let login = c
        .login_pdu(0x81, &[("InitiatorName", RAW_INITIATOR)])
        .encode();
    let _ = c.send_bytes(&login[..30]);
    c.shutdown_write();
    if let Some(p) = answered_or_closed(&mut c, "a truncated PDU") {
        assert_ne!(p.opcode(), op::SCSI_RSP, "a truncated PDU was executed");
    }
    drop(c);
    still_serving(&mut bystander, "a truncated PDU");

    // A Login Request claiming a 16 MiB data segment (the login phase allows 8 KiB).
    let mut c = RawConn::connect(target);
    let pdu = c
        .login_pdu(
            0x81,
            &[
                ("InitiatorName", RAW_INITIATOR),
                ("TargetName", target.iqn.as_str()),
            ],
        )
        .claim_len(0x00ff_ffff);
    let _ = c.send(&pdu);
    if let Some(p) = answered_or_closed(&mut c, "an oversized login data segment") {
        assert_eq!(p.opcode(), op::LOGIN_RSP, "{p:?}");
        assert_ne!(p.login_status().0, 0, "an oversized login PDU logged in");
    }
    drop(c);
    still_serving(&mut bystander, "an oversized login data segment");

    // In full feature phase: a WRITE whose data segment is over every limit (and
    // immediate data was negotiated off).
    if !lenient_ffp_limit {
        check_oversized_ffp_segment(target);
        still_serving(&mut bystander, "an oversized data segment");
    }

    // Login with keys nobody defined: answered NotUnderstood (or refused).
    let mut c = RawConn::connect(target);
    let pdu = c.login_pdu(
        0x81,
        &[
            ("InitiatorName", RAW_INITIATOR),
            ("SessionType", "Normal"),
            ("TargetName", target.iqn.as_str()),
            ("AuthMethod", "None"),
            ("VsanNoSuchKey", "42"),
        ],
    );
    let _ = c.send(&pdu);
    if let Some(p) = answered_or_closed(&mut c, "a login with an unknown key") {
        assert_eq!(p.opcode(), op::LOGIN_RSP, "{p:?}");
        if p.login_status().0 == 0 {
            let keys = p.keys();
            assert!(
                keys.iter()
                    .any(|(k, v)| k == "VsanNoSuchKey" && v == "NotUnderstood"),
                "an unknown key not answered NotUnderstood: {keys:?}"
            );
        }
    }
    drop(c);

    // Out-of-range values: MaxBurstLength and FirstBurstLength below 512, MaxConnections
    // 0. Refused, answered Reject, or answered with a value in range.
    let mut c = RawConn::connect(target);
    let security = [
        ("InitiatorName", RAW_INITIATOR),
        ("SessionType", "Normal"),
        ("TargetName", target.iqn.as_str()),
        ("AuthMethod", "None"),
    ];
    match c.login_step(0x81, &security) {
        Ok(_) => {
            let mut keys: Vec<(&str, &str)> = OPERATIONAL_KEYS
                .iter()
                .copied()
                .filter(|(k, _)| {
                    !matches!(*k, "MaxBurstLength" | "FirstBurstLength" | "MaxConnections")
                })
                .collect();
            keys.extend([
                ("MaxBurstLength", "100"),
                ("FirstBurstLength", "3"),
                ("MaxConnections", "0"),
            ]);
            let pdu = c.login_pdu(0x80 | (1 << 2) | 0x03, &keys);
            let _ = c.send(&pdu);
            if let Some(p) = answered_or_closed(&mut c, "out-of-range login values") {
                assert_eq!(p.opcode(), op::LOGIN_RSP, "{p:?}");
                if p.login_status().0 == 0 {
                    for (k, v) in p.keys() {
                        if matches!(k.as_str(), "MaxBurstLength" | "FirstBurstLength") {
                            assert!(
                                v == "Reject" || v.parse::<u32>().is_ok_and(|n| n >= 512),
                                "{k}={v} accepted out of range"
                            );
                        }
                        if k == "MaxConnections" {
                            assert!(
                                v == "Reject" || v.parse::<u32>().is_ok_and(|n| n >= 1),
                                "{k}={v} accepted out of range"
                            );
                        }
                    }
                }
            }
        }
        Err(e) => eprintln!("out-of-range values: security stage refused: {e}"),
    }
    drop(c);
    still_serving(
        &mut bystander,
        "logins with unknown keys and out-of-range values",
    );

    // A command before login: never executed.
    let mut c = RawConn::connect(target);
    let (_, pdu) = c.scsi_cmd(&[0; 6], false, 0);
    let _ = c.send(&pdu);
    if let Some(p) = answered_or_closed(&mut c, "a command before login") {
        assert!(
            matches!(p.opcode(), op::LOGIN_RSP | op::REJECT),
            "a command before login answered with {p:?}"
        );
        if p.opcode() == op::LOGIN_RSP {
            assert_ne!(p.login_status().0, 0, "{p:?}");
        }
    }
    drop(c);
    still_serving(&mut bystander, "a command before login");

    // A Login Request in full feature phase (the wrong phase): never another login.
    let mut c = RawConn::login(target);
    let pdu = c.login_pdu(
        0x80 | (1 << 2) | 0x03,
        &[("InitiatorName", RAW_INITIATOR), ("MaxBurstLength", "512")],
    );
    let _ = c.send(&pdu);
    if let Some(p) = answered_or_closed(&mut c, "a Login Request in full feature phase") {
        assert!(
            matches!(p.opcode(), op::REJECT | op::LOGIN_RSP | op::ASYNC),
            "a Login Request in full feature phase answered with {p:?}"
        );
        if p.opcode() == op::LOGIN_RSP {
            assert_ne!(
                p.login_status().0,
                0,
                "logged in again in full feature phase"
            );
        }
    }
    drop(c);
    still_serving(&mut bystander, "a Login Request in full feature phase");

    // CmdSN outside the window (far above MaxCmdSN, and far below ExpCmdSN): the
    // target must ignore those commands (RFC 7143 §4.2.2.1) and answer the next one in
    // the window.
    let mut c = RawConn::login(target);
    c.assert_serves("a fresh session");
    let mut ignored = Vec::new();
    for sn in [c.max_cmd_sn.wrapping_add(1000), c.cmd_sn.wrapping_sub(1000)] {
        let (itt, pdu) = c.scsi_cmd(&[0; 6], false, 0);
        c.cmd_sn = c.cmd_sn.wrapping_sub(1);
        let _ = c.send(&pdu.cmd_sn(sn));
        ignored.push(itt);
    }
    let (itt, pdu) = c.scsi_cmd(&[0; 6], false, 0);
    let _ = c.send(&pdu);
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    loop {
        match c.recv(deadline.saturating_duration_since(Instant::now())) {
            Reply::Pdu(p) if ignored.contains(&p.itt()) && p.opcode() == op::SCSI_RSP => {
                panic!("a command outside the CmdSN window was executed: {p:?}")
            }
            Reply::Pdu(p) if p.itt() == itt && p.opcode() == op::SCSI_RSP => break,
            Reply::Pdu(_) => {}
            Reply::Closed => break,
            Reply::Silent => {
                panic!("after commands outside the window the next one got no answer")
            }
        }
    }
    drop(c);
    still_serving(&mut bystander, "commands outside the CmdSN window");
}

/// A session sends many 256 KiB READs and never reads an answer, while the target's
/// resident memory (`pid`) is watched; other sessions must be served meanwhile and
/// after. A target with backpressure stops reading the connection instead of queueing
/// replies without end ([`assert_bounded`]).
/// Returns (RSS before, peak RSS, READs sent), RSS in KiB.
fn unread_reads(target: &IscsiTarget, pid: u32, disk_blocks: u64) -> (u64, u64, u64) {
    let before = rss_kib(pid);
    let mut c = RawConn::login(target);
    c.assert_serves("the reader before it stops reading");
    c.stream
        .set_write_timeout(Some(Duration::from_secs(2)))
        .expect("set a write timeout");
    let blocks = 512u32; // 256 KiB of 512-byte blocks
    let mut sent = 0u64;
    let started = Instant::now();
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    // 8192 READs ask for 2 GiB of replies; a target that queued them would show it.
    while sent < 8192 && started.elapsed() < Duration::from_secs(20) {
        let lba = rng.next_u64() % (disk_blocks - u64::from(blocks));
        let (_, pdu) = c.scsi_cmd(&read16(lba, blocks), true, blocks * 512);
        if c.send(&pdu).is_err() {
            break; // the target stopped reading: the backpressure we want
        }
        sent += 1;
    }
    let mut peak = rss_kib(pid);
    let mut other = RawConn::login(target);
    for _ in 0..10 {
        other.assert_serves("another session while one stops reading");
        peak = peak.max(rss_kib(pid));
        thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "backpressure: sent {sent} READs of 256 KiB unread; RSS {before} KiB -> peak {peak} KiB"
    );
    drop(c);
    other.assert_serves("another session after the reader left");
    assert!(readcapacity_size(&target.url()) > 0);
    (before, peak, sent)
}

/// The bound [`unread_reads`] must stay within: 256 MiB over the RSS before.
fn assert_bounded((before, peak, sent): (u64, u64, u64)) {
    assert!(
        peak.saturating_sub(before) < 256 * 1024,
        "the target's RSS grew from {before} KiB to {peak} KiB while {sent} READs of 256 KiB \
         went unread"
    );
}

// ---------------------------------------------------------------------------------------
// Against vsan-node.

#[test]
fn qemu_writes_through_iscsi_read_back_through_nbd_and_the_peer() {
    if !tools(&["qemu-io"]) {
        return;
    }
    let size = 64 * MIB;
    let pair = IscsiPair::start("iscsi-qemu", "vol0", "\"64MiB\"");
    let t1 = IscsiTarget::of_node(&pair.n1, "vol0");
    let t2 = IscsiTarget::of_node(&pair.n2, "vol0");
    let rs = regions(size);
    qemu_io_writes(&t1.url(), &rs);
    // Another connection, through iSCSI, the same node's NBD export and the peer's.
    qemu_io_reads(&t1.url(), &rs);
    qemu_io_reads(&pair.n1.uri("vol0"), &rs);
    qemu_io_reads(&pair.n2.uri("vol0"), &rs);
    // And the other way: written through node 2's iSCSI target, read through node 1.
    let more = [Region::new(0x77, 30 * MIB, 64 * 1024)];
    qemu_io_writes(&t2.url(), &more);
    qemu_io_reads(&t1.url(), &more);
    qemu_io_reads(&pair.n1.uri("vol0"), &more);

    // The check can fail: 0x5a where 0xa5 was written.
    let out = common::qemu_io(&t1.url(), &[Region::new(0x5a, 0, MIB).read()]);
    assert!(
        out.text().contains("Pattern verification failed"),
        "reading 0x5a over 0xa5 through iSCSI did not fail:\n{out}"
    );
    pair.n1.stop_clean(Sig::TERM);
    pair.n2.stop_clean(Sig::TERM);
    for dir in [&pair.dir1, &pair.dir2] {
        assert_file_holds(&image(dir, "vol0"), rs.iter().chain(&more), "replica");
    }
    assert_replicas_identical(&image(&pair.dir1, "vol0"), &image(&pair.dir2, "vol0"));
}

#[test]
fn qemu_img_convert_into_the_lun_and_back_is_identical() {
    if !tools(&["qemu-img"]) {
        return;
    }
    let dir = TestDir::new("iscsi-convert");
    let (node, target) = local_node(&dir, "");
    check_convert_round_trip(dir.path(), &target.url());
    node.stop_clean(Sig::TERM);
}

#[test]
fn libiscsi_tools_show_the_target_identity_and_size() {
    if !tools(&["iscsi-ls", "iscsi-inq", "iscsi-readcapacity16"]) {
        return;
    }
    let pair = IscsiPair::start("iscsi-identity", "vol0", "\"64MiB\"");
    let t1 = IscsiTarget::of_node(&pair.n1, "vol0");
    let t2 = IscsiTarget::of_node(&pair.n2, "vol0");
    assert_eq!(
        t1.iqn, "iqn.2026-12.io.vsan:vol0",
        "the default target name"
    );
    check_discovery(&t1);
    let id1 = check_identity(&t1, 64 * MIB);
    let id2 = check_identity(&t2, 64 * MIB);
    // The designators issue 19 asks for: a NAA and a T10 vendor id for the unit.
    for d in ["NAA", "T10"] {
        assert!(
            id1.designators.iter().any(|x| x.contains(d)),
            "no {d} designator in VPD 0x83: {id1:?}"
        );
    }
    // One disk, one identity, whichever node is asked.
    assert_eq!(id1.serial, id2.serial, "{id1:?} vs {id2:?}");
    assert_eq!(
        (&id1.vendor, &id1.product),
        (&id2.vendor, &id2.product),
        "{id1:?} vs {id2:?}"
    );
    pair.n1.stop_clean(Sig::TERM);
    pair.n2.stop_clean(Sig::TERM);
}

#[test]
fn chap_admits_the_right_secret_and_refuses_wrong_and_missing_ones() {
    if !tools(&["iscsi-inq", "qemu-img", "qemu-io"]) {
        return;
    }
    let dir = TestDir::new("iscsi-chap");
    let (node, target) = local_node(&dir, &chap_lines(USER, SECRET, None));
    check_chap(&target);
    let log = node.stop_clean(Sig::TERM).log;
    for secret in [SECRET, "not-the-secret-000"] {
        assert!(!log.contains(secret), "the log holds a secret:\n{log}");
    }
}

#[test]
fn mutual_chap_works_both_ways() {
    if !tools(&["iscsi-inq"]) {
        return;
    }
    let dir = TestDir::new("iscsi-mutual");
    let (node, target) = local_node(&dir, &chap_lines(USER, SECRET, Some((T_USER, T_SECRET))));
    check_mutual_chap(&target);
    let log = node.stop_clean(Sig::TERM).log;
    for secret in [SECRET, T_SECRET] {
        assert!(!log.contains(secret), "the log holds a secret:\n{log}");
    }
}

/// A mirrored disk written through node 1's iSCSI target (writes then a flush, and FUA
/// writes); node 1 is killed with SIGKILL while more writes are in flight, started
/// again, and once the two have resynced every acknowledged block is on both replicas,
/// which are byte-identical.
#[test]
fn acknowledged_iscsi_writes_survive_kill_9_of_the_node_written_through() {
    if !tools(&["qemu-io"]) {
        return;
    }
    let pair = IscsiPair::start("iscsi-kill", "vol0", "\"64MiB\"");
    let IscsiPair {
        dir1,
        dir2,
        n1,
        n2,
        config1,
        ..
    } = pair;
    let t1 = IscsiTarget::of_node(&n1, "vol0");
    let flushed = [
        Region::new(0x11, 0, MIB),
        Region::new(0x22, 5 * MIB + 512, 3 * 4096),
        Region::new(0x33, 63 * MIB, MIB),
    ];
    let mut cmds: Vec<String> = flushed.iter().map(Region::write).collect();
    cmds.push("flush".to_string());
    // FUA writes: each acknowledged only once durable.
    let fua = [
        Region::new(0x44, 10 * MIB, 64 * 1024),
        Region::new(0x55, 12 * MIB + 4096, 4096),
    ];
    cmds.extend(
        fua.iter()
            .map(|r| format!("write -f -P {:#04x} {} {}", r.byte, r.offset, r.len)),
    );
    let out = qemu_io_checked(&t1.url(), &cmds);
    for r in flushed.iter().chain(&fua) {
        assert!(
            out.stdout.contains(&r.wrote_line()),
            "missing {r:?}:\n{out}"
        );
    }

    // Unacknowledged writes in flight at the kill (to another area; not checked, except
    // that both replicas agree after the resync).
    let mut busy: Vec<String> = Vec::new();
    for i in 0..64u64 {
        busy.push(format!(
            "aio_write -P 0x66 {} {}",
            32 * MIB + i * 256 * 1024,
            256 * 1024
        ));
    }
    busy.push("aio_flush".to_string());
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", &t1.url()]);
    for c in &busy {
        cmd.args(["-c", c]);
    }
    let writer = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start qemu-io");
    let writer = ProcessGuard::new(writer, None);
    thread::sleep(Duration::from_millis(150));

    let skip = n2.stdout_lines().len();
    let killed = n1.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    // The initiator would keep trying to reconnect to the dead node: end it.
    drop(writer);
    n2.wait_log("peer lost", EVENT_TIMEOUT);

    let n1 = Node::start(&dir1, &config1, &["vol0"]);
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout_after(skip, &["sync disk=vol0 done"], EVENT_TIMEOUT);
    // Read back through the restarted node's new iSCSI target too.
    let t1 = IscsiTarget::of_node(&n1, "vol0");
    qemu_io_reads(&t1.url(), &flushed);
    qemu_io_reads(&t1.url(), &fua);

    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
    for (who, dir) in [("node 1", &dir1), ("node 2", &dir2)] {
        assert_file_holds(
            &image(dir, "vol0"),
            flushed.iter().chain(&fua),
            &format!("{who}'s replica"),
        );
    }
    assert_replicas_identical(&image(&dir1, "vol0"), &image(&dir2, "vol0"));
}

#[test]
fn hostile_input_ends_one_connection_and_nothing_else() {
    if !tools(&["iscsi-readcapacity16", "iscsi-inq"]) {
        return;
    }
    let dir = TestDir::new("iscsi-hostile");
    let (node, target) = local_node(&dir, "");
    check_hostile_input(&target, false);
    // Still serving a real initiator, and it stops cleanly.
    let out = libiscsi("iscsi-inq", &[&target.url()]);
    out.assert_success();
    node.stop_clean(Sig::TERM);
}

#[test]
fn a_connection_that_stops_reading_does_not_grow_memory_without_bound() {
    if !tools(&["iscsi-readcapacity16"]) {
        return;
    }
    let dir = TestDir::new("iscsi-backpressure");
    let (node, target) = local_node(&dir, "");
    let pid = node_pid(node.config_path());
    assert_bounded(unread_reads(&target, pid, 64 * MIB / 512));
    node.stop_clean(Sig::TERM);
}

// ---------------------------------------------------------------------------------------
// The client side of the checks, against tgtd.

#[test]
#[ignore = "runs tgtd (root): checks the checks, not vsan"]
fn tgtd_discovery_identity_and_convert() {
    if !tools(&[
        "tgtd",
        "iscsi-ls",
        "iscsi-inq",
        "iscsi-readcapacity16",
        "qemu-img",
    ]) {
        return;
    }
    let dir = TestDir::new("iscsi-tgtd-id");
    let (_tgtd, target) = start_tgtd(&dir, 64 * MIB, &TgtdChap::default());
    check_discovery(&target);
    let id = check_identity(&target, 64 * MIB);
    eprintln!("tgtd identity: {id:?}");
    check_convert_round_trip(dir.path(), &target.url());
    // qemu-io patterns (plain, flushed, FUA) through tgtd, read back on another
    // connection.
    let rs = regions(64 * MIB);
    qemu_io_writes(&target.url(), &rs);
    qemu_io_checked(
        &target.url(),
        &[
            "flush".to_string(),
            "write -f -P 0x44 4096 4096".to_string(),
        ],
    );
    qemu_io_reads(&target.url(), &rs[1..]);
    qemu_io_reads(&target.url(), &[Region::new(0x44, 4096, 4096)]);
}

#[test]
#[ignore = "runs tgtd (root): checks the checks, not vsan"]
fn tgtd_chap_and_mutual_chap() {
    if !tools(&["tgtd", "iscsi-inq", "qemu-img", "qemu-io"]) {
        return;
    }
    let dir = TestDir::new("iscsi-tgtd-chap");
    let chap = TgtdChap {
        initiator: Some((USER.to_string(), SECRET.to_string())),
        target: None,
    };
    let (tgtd, target) = start_tgtd(&dir, 64 * MIB, &chap);
    check_chap(&target);
    drop(tgtd);
    let chap = TgtdChap {
        initiator: Some((USER.to_string(), SECRET.to_string())),
        target: Some((T_USER.to_string(), T_SECRET.to_string())),
    };
    let (_tgtd, target) = start_tgtd(&dir, 64 * MIB, &chap);
    check_mutual_chap(&target);
}

#[test]
#[ignore = "runs tgtd (root): checks the checks, not vsan"]
fn tgtd_hostile_input() {
    if !tools(&["tgtd", "iscsi-readcapacity16"]) {
        return;
    }
    let dir = TestDir::new("iscsi-tgtd-hostile");
    let (_tgtd, target) = start_tgtd(&dir, 64 * MIB, &TgtdChap::default());
    check_hostile_input(&target, true);
}

#[test]
#[ignore = "runs tgtd (root): checks the checks, not vsan"]
fn tgtd_backpressure() {
    if !tools(&["tgtd", "iscsi-readcapacity16"]) {
        return;
    }
    let dir = TestDir::new("iscsi-tgtd-bp");
    let (tgtd, target) = start_tgtd(&dir, 64 * MIB, &TgtdChap::default());
    // tgtd queues every reply (its RSS reached 1.7 GiB here): the check can fail.
    let (before, peak, sent) = unread_reads(&target, tgtd.pid(), 64 * MIB / 512);
    assert!(
        peak.saturating_sub(before) >= 256 * 1024,
        "tgtd stayed within the bound ({before} -> {peak} KiB, {sent} READs): the check \
         may not exercise what it should"
    );
}
