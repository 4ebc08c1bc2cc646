//! The iSCSI side of the process tests: a node's iSCSI target from its ready line, the
//! URLs libiscsi and qemu take, `iscsi-test-cu`'s output read into tests, and a small
//! hand-written iSCSI initiator for the hostile-input tests.
//!
//! The raw initiator here encodes and decodes PDUs itself (a 48-byte BHS builder, RFC
//! 7143 §11) and never uses vsan-core's codec, so the tests check the target's codec
//! independently.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use super::{Node, TOOL_TIMEOUT, ToolOutput, field, run_tool, toml_str};

/// The initiator name the raw initiator logs in with.
pub const RAW_INITIATOR: &str = "iqn.2026-12.io.vsan.test:raw";

/// An iSCSI target as a client reaches it: portal, name, LUN.
#[derive(Debug, Clone)]
pub struct IscsiTarget {
    /// `127.0.0.1:<port>`.
    pub portal: String,
    /// The target's iSCSI name.
    pub iqn: String,
    /// The LUN of the disk (0 on vsan, 1 on tgtd).
    pub lun: u32,
}

impl IscsiTarget {
    /// The target a node serves `disk` on, from its `ready disk=<disk> iscsi=<addr>
    /// target=<iqn>` line (waited for).
    pub fn of_node(node: &Node, disk: &str) -> IscsiTarget {
        let line = node.wait_stdout(
            &[&format!("ready disk={disk} "), "iscsi=", "target="],
            super::READY_TIMEOUT,
        );
        IscsiTarget {
            portal: field(&line, "iscsi").unwrap_or_else(|| panic!("no iscsi= in {line:?}")),
            iqn: field(&line, "target").unwrap_or_else(|| panic!("no target= in {line:?}")),
            lun: 0,
        }
    }

    /// A target of tgtd (LUN 1).
    pub fn of_tgtd(tgtd: &vsan_examples::tgtd::Tgtd) -> IscsiTarget {
        IscsiTarget {
            portal: tgtd.portal().to_string(),
            iqn: tgtd.iqn().to_string(),
            lun: vsan_examples::tgtd::Tgtd::LUN,
        }
    }

    /// `iscsi://<portal>/<iqn>/<lun>`.
    pub fn url(&self) -> String {
        format!("iscsi://{}/{}/{}", self.portal, self.iqn, self.lun)
    }

    /// The URL with CHAP credentials (`user%secret@`, libiscsi's syntax).
    pub fn url_chap(&self, user: &str, secret: &str) -> String {
        format!(
            "iscsi://{user}%{secret}@{}/{}/{}",
            self.portal, self.iqn, self.lun
        )
    }

    /// The URL for mutual CHAP: the initiator's credentials, and the target's, which
    /// libiscsi checks the target's answer against (`?target_user=&target_password=`).
    pub fn url_mutual(&self, user: &str, secret: &str, t_user: &str, t_secret: &str) -> String {
        format!(
            "{}?target_user={t_user}&target_password={t_secret}",
            self.url_chap(user, secret)
        )
    }

    /// `iscsi://<portal>`, for discovery (`iscsi-ls`).
    pub fn portal_url(&self) -> String {
        format!("iscsi://{}", self.portal)
    }
}

/// The lines to append to a `[[disk]]` section that export it over iSCSI on a fresh
/// loopback port (the section must be the config's last table).
pub fn iscsi_lines() -> String {
    "iscsi = \"127.0.0.1:0\"\n".to_string()
}

/// CHAP lines for a `[[disk]]` section: the initiator's account, and the target's for
/// mutual CHAP.
pub fn chap_lines(user: &str, secret: &str, target: Option<(&str, &str)>) -> String {
    let mut s = format!(
        "iscsi_chap_user = {}\niscsi_chap_secret = {}\n",
        toml_str(user),
        toml_str(secret)
    );
    if let Some((u, p)) = target {
        s += &format!(
            "iscsi_chap_target_user = {}\niscsi_chap_target_secret = {}\n",
            toml_str(u),
            toml_str(p)
        );
    }
    s
}

/// Run a libiscsi tool (`iscsi-inq`, `iscsi-ls`, ...) with a time limit.
pub fn libiscsi(tool: &str, args: &[&str]) -> ToolOutput {
    run_tool(tool, args, TOOL_TIMEOUT)
}

/// The disk size `iscsi-readcapacity16 -s` reports.
pub fn readcapacity_size(url: &str) -> u64 {
    let out = libiscsi("iscsi-readcapacity16", &["-s", url]);
    out.assert_success();
    out.stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("iscsi-readcapacity16 -s printed no number:\n{out}"))
}

/// The value after `key:` on a line of `iscsi-inq`-style output (`Vendor:IET`).
pub fn colon_field(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
}

// ---------------------------------------------------------------------------------------
// iscsi-test-cu's output.

/// One test as `iscsi-test-cu` ran it (a test runs once per family it is in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CuTest {
    /// `Suite.Test`, as the allowlist names it.
    pub name: String,
    /// CUnit reported it failed (an assertion failed).
    pub failed: bool,
    /// It printed at least one `[SKIPPED]` line: the reasons.
    pub skips: Vec<String>,
    /// Everything it printed.
    pub text: String,
}

/// `iscsi-test-cu`'s verbose CUnit output, read.
///
/// The format (CUnit 2.1 basic interface, verbose): `Suite: <name>` starts a suite;
/// `  Test: <name> ...` starts a test; whatever the test logs follows (`[SKIPPED] why`
/// for a part the target lacks, `[FAILED] why` for a failed check it reports, which CUnit
/// may still count as passed); CUnit then appends `passed` or `FAILED` (on the line the
/// test left open), a failure followed by numbered lines `    1. file.c:38  - expr`.
/// A skipped test counts as passed. The run ends with `Run Summary:` and a table whose
/// `tests` row is `Total Ran Passed Failed Inactive`. Suites appear once per family they
/// belong to (ALL, then SCSI, iSCSI, LINUX): 615 tests of 230 distinct names with `-d`.
#[derive(Debug, Clone, Default)]
pub struct CuReport {
    /// Every test run, in order.
    pub tests: Vec<CuTest>,
    /// The summary's `tests` row: total, ran, passed, failed (when found).
    pub summary: Option<[u64; 4]>,
    /// How many `[SKIPPED]` lines the run printed (what the "205 skips" of tgt
    /// counts).
    pub skip_lines: usize,
}

impl CuReport {
    /// Read `text` (stdout of `iscsi-test-cu`).
    pub fn parse(text: &str) -> CuReport {
        let mut report = CuReport {
            skip_lines: text.matches("[SKIPPED]").count(),
            ..CuReport::default()
        };
        let mut suite = String::new();
        let mut lines = text.lines();
        let mut current: Option<CuTest> = None;
        for line in lines.by_ref() {
            if line.starts_with("Run Summary:") {
                break;
            }
            if let Some(s) = line.strip_prefix("Suite: ") {
                report.tests.extend(current.take());
                suite = s.trim().to_string();
                continue;
            }
            if let Some(rest) = line.strip_prefix("  Test: ") {
                report.tests.extend(current.take());
                let (name, tail) = rest.split_once(" ...").unwrap_or((rest, ""));
                current = Some(CuTest {
                    name: format!("{suite}.{}", name.trim()),
                    failed: false,
                    skips: Vec::new(),
                    text: String::new(),
                });
                if let Some(t) = current.as_mut() {
                    t.absorb(tail);
                }
                continue;
            }
            if let Some(t) = current.as_mut() {
                t.absorb(line);
            }
        }
        report.tests.extend(current.take());
        for line in lines {
            let mut words = line.split_whitespace();
            if words.next() == Some("tests") {
                let nums: Vec<u64> = words.filter_map(|w| w.parse().ok()).collect();
                if let [total, ran, passed, failed, ..] = nums[..] {
                    report.summary = Some([total, ran, passed, failed]);
                }
            }
        }
        report
    }

    /// The tests that failed, by name (each name once).
    pub fn failed(&self) -> Vec<&str> {
        dedup(
            self.tests
                .iter()
                .filter(|t| t.failed)
                .map(|t| t.name.as_str()),
        )
    }

    /// The tests that skipped something, by name (each name once).
    pub fn skipped(&self) -> Vec<&str> {
        dedup(
            self.tests
                .iter()
                .filter(|t| !t.skips.is_empty())
                .map(|t| t.name.as_str()),
        )
    }

    /// Test runs that failed (a name counts once per family).
    pub fn failed_runs(&self) -> usize {
        self.tests.iter().filter(|t| t.failed).count()
    }

    /// Test runs that skipped something.
    pub fn skipped_runs(&self) -> usize {
        self.tests.iter().filter(|t| !t.skips.is_empty()).count()
    }

    /// The parse agrees with CUnit's own summary (a format change would show here).
    pub fn consistent(&self) -> Result<(), String> {
        let Some([total, _, _, failed]) = self.summary else {
            return Err("no `Run Summary` tests row".to_string());
        };
        if total != self.tests.len() as u64 {
            return Err(format!(
                "the summary counts {total} tests, the output shows {}",
                self.tests.len()
            ));
        }
        if failed != self.failed_runs() as u64 {
            return Err(format!(
                "the summary counts {failed} failed tests, the output shows {}",
                self.failed_runs()
            ));
        }
        Ok(())
    }
}

impl CuTest {
    fn absorb(&mut self, line: &str) {
        self.text.push_str(line);
        self.text.push('\n');
        let t = line.trim();
        if let Some(at) = t.find("[SKIPPED]") {
            self.skips
                .push(t[at + "[SKIPPED]".len()..].trim().to_string());
        }
        // CUnit's verdict: `FAILED` alone or at the end of the line the test left open,
        // then the numbered assertion lines.
        if t == "FAILED" || t.ends_with("...FAILED") || is_assertion_line(t) {
            self.failed = true;
        }
    }
}

/// `1. test_foo.c:38  - CU_ASSERT_EQUAL(_r,0)`.
fn is_assertion_line(t: &str) -> bool {
    let Some((num, rest)) = t.split_once(". ") else {
        return false;
    };
    !num.is_empty()
        && num.bytes().all(|b| b.is_ascii_digit())
        && rest.contains(".c:")
        && rest.contains("  - ")
}

fn dedup<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

/// The committed allowlist of skipped tests: `Suite.Test reason...` per line, `#`
/// comments and blank lines ignored. Returns (name, reason) pairs; panics on a line
/// without a reason.
pub fn read_allowlist(path: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, reason) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        assert!(
            name.split('.').count() == 2 && !reason.trim().is_empty(),
            "{}:{}: want `Suite.Test reason`, got {line:?}",
            path.display(),
            i + 1
        );
        out.push((name.to_string(), reason.trim().to_string()));
    }
    out
}

// ---------------------------------------------------------------------------------------
// Processes.

/// The pid of the `vsan-node` running on `config` (found by its command line).
pub fn node_pid(config: &Path) -> u32 {
    let want = config.as_os_str().as_encoded_bytes();
    let procs = std::fs::read_dir("/proc").expect("read /proc");
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        if args.first().is_some_and(|a| a.ends_with(b"vsan-node")) && args.contains(&want) {
            return pid;
        }
    }
    panic!("no vsan-node process on {}", config.display());
}

/// The resident set size of `pid` in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

// ---------------------------------------------------------------------------------------
// A raw initiator.

/// Opcodes (RFC 7143 §11.1.1), initiator and target.
pub mod op {
    /// NOP-Out.
    pub const NOP_OUT: u8 = 0x00;
    /// SCSI Command.
    pub const SCSI_CMD: u8 = 0x01;
    /// Login Request.
    pub const LOGIN: u8 = 0x03;
    /// Text Request.
    pub const TEXT: u8 = 0x04;
    /// SCSI Data-Out.
    pub const DATA_OUT: u8 = 0x05;
    /// Logout Request.
    pub const LOGOUT: u8 = 0x06;
    /// NOP-In.
    pub const NOP_IN: u8 = 0x20;
    /// SCSI Response.
    pub const SCSI_RSP: u8 = 0x21;
    /// Login Response.
    pub const LOGIN_RSP: u8 = 0x23;
    /// SCSI Data-In.
    pub const DATA_IN: u8 = 0x25;
    /// Logout Response.
    pub const LOGOUT_RSP: u8 = 0x26;
    /// R2T.
    pub const R2T: u8 = 0x31;
    /// Asynchronous Message.
    pub const ASYNC: u8 = 0x32;
    /// Reject.
    pub const REJECT: u8 = 0x3f;
}

/// The immediate-delivery bit of byte 0.
pub const IMMEDIATE: u8 = 0x40;

/// A Basic Header Segment being built (48 bytes, big-endian fields), plus its data
/// segment and an optional lie about the data segment's length.
#[derive(Debug, Clone)]
pub struct Bhs {
    /// The 48 header bytes.
    pub bytes: [u8; 48],
    /// The data segment (padded to 4 bytes when encoded).
    pub data: Vec<u8>,
    /// DataSegmentLength to write instead of `data.len()`.
    pub claimed_len: Option<u32>,
}

impl Bhs {
    /// A header with `opcode` (and the immediate bit when `immediate`) and flags byte.
    pub fn new(opcode: u8, immediate: bool, flags: u8) -> Bhs {
        let mut bytes = [0u8; 48];
        bytes[0] = opcode | if immediate { IMMEDIATE } else { 0 };
        bytes[1] = flags;
        Bhs {
            bytes,
            data: Vec::new(),
            claimed_len: None,
        }
    }

    /// Set byte `at`.
    pub fn u8_at(mut self, at: usize, v: u8) -> Bhs {
        self.bytes[at] = v;
        self
    }

    /// Set the big-endian u16 at `at`.
    pub fn u16_at(mut self, at: usize, v: u16) -> Bhs {
        self.bytes[at..at + 2].copy_from_slice(&v.to_be_bytes());
        self
    }

    /// Set the big-endian u32 at `at`.
    pub fn u32_at(mut self, at: usize, v: u32) -> Bhs {
        self.bytes[at..at + 4].copy_from_slice(&v.to_be_bytes());
        self
    }

    /// Copy `v` to `at..`.
    pub fn bytes_at(mut self, at: usize, v: &[u8]) -> Bhs {
        self.bytes[at..at + v.len()].copy_from_slice(v);
        self
    }

    /// The Initiator Task Tag.
    pub fn itt(self, itt: u32) -> Bhs {
        self.u32_at(16, itt)
    }

    /// CmdSN.
    pub fn cmd_sn(self, sn: u32) -> Bhs {
        self.u32_at(24, sn)
    }

    /// ExpStatSN.
    pub fn exp_stat_sn(self, sn: u32) -> Bhs {
        self.u32_at(28, sn)
    }

    /// The data segment.
    pub fn data(mut self, data: Vec<u8>) -> Bhs {
        self.data = data;
        self
    }

    /// Claim a DataSegmentLength other than the data's.
    pub fn claim_len(mut self, len: u32) -> Bhs {
        self.claimed_len = Some(len);
        self
    }

    /// The wire bytes: header (DataSegmentLength filled in), data, padding.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.bytes.to_vec();
        let len = self
            .claimed_len
            .unwrap_or(u32::try_from(self.data.len()).expect("a test's data segment"));
        out[5..8].copy_from_slice(&len.to_be_bytes()[1..]);
        out.extend_from_slice(&self.data);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out
    }
}

/// A PDU as the target sent it.
#[derive(Debug, Clone)]
pub struct Pdu {
    /// The 48 header bytes.
    pub bhs: [u8; 48],
    /// The data segment (without padding).
    pub data: Vec<u8>,
}

impl Pdu {
    /// The opcode (without the immediate bit).
    pub fn opcode(&self) -> u8 {
        self.bhs[0] & 0x3f
    }

    /// The big-endian u32 at `at`.
    pub fn u32_at(&self, at: usize) -> u32 {
        u32::from_be_bytes([
            self.bhs[at],
            self.bhs[at + 1],
            self.bhs[at + 2],
            self.bhs[at + 3],
        ])
    }

    /// The Initiator Task Tag.
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }

    /// The text keys of the data segment (`key=value` NUL-separated).
    pub fn keys(&self) -> Vec<(String, String)> {
        self.data
            .split(|&b| b == 0)
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                match kv.split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (kv.to_string(), String::new()),
                }
            })
            .collect()
    }

    /// A Login Response's status class and detail.
    pub fn login_status(&self) -> (u8, u8) {
        (self.bhs[36], self.bhs[37])
    }
}

/// `key=value\0...` for a text data segment.
pub fn text_keys(keys: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in keys {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

/// What came back when a PDU was awaited.
#[derive(Debug)]
pub enum Reply {
    /// A whole PDU.
    Pdu(Pdu),
    /// The target closed the connection (EOF or reset), cleanly between PDUs or not.
    Closed,
    /// Nothing within the time limit.
    Silent,
}

/// The operational keys the raw initiator offers: no digests, 256 KiB data segments,
/// no immediate data, ERL 0, one connection.
pub const OPERATIONAL_KEYS: &[(&str, &str)] = &[
    ("HeaderDigest", "None"),
    ("DataDigest", "None"),
    ("MaxRecvDataSegmentLength", "262144"),
    ("InitialR2T", "Yes"),
    ("ImmediateData", "No"),
    ("MaxBurstLength", "262144"),
    ("FirstBurstLength", "65536"),
    ("DefaultTime2Wait", "2"),
    ("DefaultTime2Retain", "0"),
    ("MaxOutstandingR2T", "1"),
    ("DataPDUInOrder", "Yes"),
    ("DataSequenceInOrder", "Yes"),
    ("ErrorRecoveryLevel", "0"),
    ("MaxConnections", "1"),
];

/// One TCP connection speaking iSCSI by hand.
#[derive(Debug)]
pub struct RawConn {
    /// The socket.
    pub stream: TcpStream,
    /// The next CmdSN to use.
    pub cmd_sn: u32,
    /// The next StatSN expected.
    pub exp_stat_sn: u32,
    /// The target's last MaxCmdSN.
    pub max_cmd_sn: u32,
    /// The next ITT to use.
    pub next_itt: u32,
    /// The LUN commands go to.
    pub lun: u32,
    /// The ISID this connection's session uses.
    pub isid: [u8; 6],
    /// The InitiatorName it logs in with.
    pub initiator: String,
}

impl RawConn {
    /// Connect to `target`'s portal.
    pub fn connect(target: &IscsiTarget) -> RawConn {
        let stream = TcpStream::connect(&target.portal)
            .unwrap_or_else(|e| panic!("connect to {}: {e}", target.portal));
        stream.set_nodelay(true).expect("TCP_NODELAY");
        // A distinct ISID per connection of this process: two sessions of one initiator
        // name with the same ISID are one session to the target, and the second login
        // reinstates it (closing the first). (The salt used to be `Instant::now().elapsed()`
        // nanoseconds, nearly always the same few values, so two connections of one test
        // could collide now and then.)
        static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let salt = (std::process::id() as u16).wrapping_mul(0x9e37) ^ n;
        RawConn {
            stream,
            cmd_sn: 1,
            exp_stat_sn: 0,
            max_cmd_sn: 1,
            next_itt: 1,
            lun: target.lun,
            isid: [0x80, 0x56, 0x53, 0x41, (salt >> 8) as u8, salt as u8],
            initiator: RAW_INITIATOR.to_string(),
        }
    }

    /// Connect and log in to a normal session (no authentication), to full feature
    /// phase; panics if the target refuses.
    pub fn login(target: &IscsiTarget) -> RawConn {
        let mut c = RawConn::connect(target);
        c.login_normal(target)
            .unwrap_or_else(|e| panic!("raw login: {e}"));
        c
    }

    /// Connect and log in as initiator port `initiator` + `isid` (the same name and
    /// ISID through both nodes of a pair is one initiator port with two I_T nexuses,
    /// as a multipath initiator's paths are); panics if the target refuses.
    pub fn login_as(target: &IscsiTarget, initiator: &str, isid: [u8; 6]) -> RawConn {
        let mut c = RawConn::connect(target);
        c.initiator = initiator.to_string();
        c.isid = isid;
        c.login_normal(target)
            .unwrap_or_else(|e| panic!("raw login as {initiator}: {e}"));
        c
    }

    /// Send raw bytes.
    pub fn send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Send a PDU.
    pub fn send(&mut self, pdu: &Bhs) -> std::io::Result<()> {
        self.send_bytes(&pdu.encode())
    }

    /// Close our sending side (the target reads EOF).
    pub fn shutdown_write(&self) {
        let _ = self.stream.shutdown(Shutdown::Write);
    }

    /// Wait up to `limit` for a whole PDU, EOF or a reset.
    pub fn recv(&mut self, limit: Duration) -> Reply {
        let deadline = Instant::now() + limit;
        let mut bhs = [0u8; 48];
        match self.read_full(&mut bhs, deadline) {
            Ok(true) => {}
            Ok(false) => return Reply::Closed,
            Err(ErrorKind::TimedOut) => return Reply::Silent,
            Err(_) => return Reply::Closed,
        }
        let ahs = usize::from(bhs[4]) * 4;
        let dlen = usize::from(bhs[5]) << 16 | usize::from(bhs[6]) << 8 | usize::from(bhs[7]);
        let mut rest = vec![0u8; ahs + dlen.div_ceil(4) * 4];
        match self.read_full(&mut rest, deadline) {
            Ok(true) => {}
            Ok(false) => return Reply::Closed,
            Err(ErrorKind::TimedOut) => return Reply::Silent,
            Err(_) => return Reply::Closed,
        }
        let data = rest[ahs..ahs + dlen].to_vec();
        let pdu = Pdu { bhs, data };
        if matches!(
            pdu.opcode(),
            op::SCSI_RSP | op::LOGIN_RSP | op::NOP_IN | op::LOGOUT_RSP | op::REJECT | op::ASYNC
        ) || (pdu.opcode() == op::DATA_IN && pdu.bhs[1] & 0x01 != 0)
        {
            // A PDU carrying a StatSN (Data-In only with the status).
            let stat_sn = pdu.u32_at(24);
            if pdu.opcode() != op::NOP_IN || pdu.itt() != 0xffff_ffff {
                self.exp_stat_sn = stat_sn.wrapping_add(1);
            }
        }
        if matches!(
            pdu.opcode(),
            op::SCSI_RSP
                | op::LOGIN_RSP
                | op::NOP_IN
                | op::LOGOUT_RSP
                | op::DATA_IN
                | op::R2T
                | op::ASYNC
                | op::REJECT
        ) {
            self.max_cmd_sn = pdu.u32_at(32);
        }
        Reply::Pdu(pdu)
    }

    /// Wait for a PDU; panic on a close or silence.
    pub fn expect_pdu(&mut self, limit: Duration, what: &str) -> Pdu {
        match self.recv(limit) {
            Reply::Pdu(p) => p,
            other => panic!("{what}: want a PDU, got {other:?}"),
        }
    }

    /// `Ok(true)` when `buf` filled, `Ok(false)` on EOF before any byte, `Err(kind)` on
    /// a timeout or error (a close in the middle of a PDU counts as `Ok(false)`).
    fn read_full(&mut self, buf: &mut [u8], deadline: Instant) -> Result<bool, ErrorKind> {
        let mut at = 0;
        while at < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ErrorKind::TimedOut);
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| e.kind())?;
            match self.stream.read(&mut buf[at..]) {
                Ok(0) => return Ok(false),
                Ok(n) => at += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(ErrorKind::TimedOut);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) =>
                {
                    return Ok(false);
                }
                Err(e) => return Err(e.kind()),
            }
        }
        Ok(true)
    }

    /// A Login Request PDU: `flags` holds T, C, CSG, NSG.
    pub fn login_pdu(&self, flags: u8, keys: &[(&str, &str)]) -> Bhs {
        Bhs::new(op::LOGIN, true, flags)
            .bytes_at(8, &self.isid)
            .itt(0)
            .cmd_sn(self.cmd_sn)
            .exp_stat_sn(self.exp_stat_sn)
            .data(text_keys(keys))
    }

    /// Log in to `target` as a normal session, security then operational stage, to
    /// full feature phase. Returns the operational stage's answer keys.
    pub fn login_normal(&mut self, target: &IscsiTarget) -> Result<Vec<(String, String)>, String> {
        let initiator = self.initiator.clone();
        let security = [
            ("InitiatorName", initiator.as_str()),
            ("SessionType", "Normal"),
            ("TargetName", target.iqn.as_str()),
            ("AuthMethod", "None"),
        ];
        // CSG 0 -> NSG 1, transit.
        let rsp = self.login_step(0x80 | 0x01, &security)?;
        let mut stage = (rsp.bhs[1] >> 2) & 0x03;
        let mut transit = rsp.bhs[1] & 0x80 != 0 && rsp.bhs[1] & 0x03 == 1;
        for _ in 0..4 {
            if transit {
                break;
            }
            // The target wants another round of the security stage.
            let rsp = self.login_step(0x80 | 0x01, &[])?;
            stage = (rsp.bhs[1] >> 2) & 0x03;
            transit = rsp.bhs[1] & 0x80 != 0 && rsp.bhs[1] & 0x03 == 1;
        }
        if !transit {
            return Err(format!(
                "the target never let the security stage end (CSG {stage})"
            ));
        }
        // CSG 1 -> NSG 3, transit.
        let mut rsp = self.login_step(0x80 | (1 << 2) | 0x03, OPERATIONAL_KEYS)?;
        let keys = rsp.keys();
        for _ in 0..4 {
            if rsp.bhs[1] & 0x80 != 0 && rsp.bhs[1] & 0x03 == 3 {
                return Ok(keys);
            }
            rsp = self.login_step(0x80 | (1 << 2) | 0x03, &[])?;
        }
        Err("the target never let the operational stage end".to_string())
    }

    /// One Login Request and its answer; an error for a non-zero status or no answer.
    pub fn login_step(&mut self, flags: u8, keys: &[(&str, &str)]) -> Result<Pdu, String> {
        let pdu = self.login_pdu(flags, keys);
        self.send(&pdu).map_err(|e| format!("send login: {e}"))?;
        match self.recv(TOOL_TIMEOUT) {
            Reply::Pdu(p) if p.opcode() == op::LOGIN_RSP => {
                let (class, detail) = p.login_status();
                if class != 0 {
                    return Err(format!(
                        "login refused: status {class:#04x}/{detail:#04x}, keys {:?}",
                        p.keys()
                    ));
                }
                Ok(p)
            }
            Reply::Pdu(p) => Err(format!(
                "want a Login Response, got opcode {:#04x}",
                p.opcode()
            )),
            other => Err(format!("no Login Response: {other:?}")),
        }
    }

    /// A SCSI Command PDU for `cdb` (up to 16 bytes) expecting `edtl` bytes of data in
    /// (`read`) or none; takes the next ITT and CmdSN.
    pub fn scsi_cmd(&mut self, cdb: &[u8], read: bool, edtl: u32) -> (u32, Bhs) {
        let itt = self.next_itt;
        self.next_itt = self.next_itt.wrapping_add(1);
        let sn = self.cmd_sn;
        self.cmd_sn = self.cmd_sn.wrapping_add(1);
        let mut flags = 0x80 | 0x01; // Final, SIMPLE task attribute.
        if read {
            flags |= 0x40;
        }
        let mut lun = [0u8; 8];
        // Peripheral device addressing: LUN in byte 1 (LUNs below 256).
        lun[1] = self.lun as u8;
        let pdu = Bhs::new(op::SCSI_CMD, false, flags)
            .bytes_at(8, &lun)
            .itt(itt)
            .u32_at(20, edtl)
            .cmd_sn(sn)
            .exp_stat_sn(self.exp_stat_sn)
            .bytes_at(32, cdb);
        (itt, pdu)
    }

    /// TEST UNIT READY: the status byte of its SCSI Response (a unit attention after
    /// login counts as an answer too).
    pub fn test_unit_ready(&mut self) -> Result<u8, String> {
        let (itt, pdu) = self.scsi_cmd(&[0; 6], false, 0);
        self.send(&pdu)
            .map_err(|e| format!("send TEST UNIT READY: {e}"))?;
        self.wait_status(itt)
    }

    /// Read PDUs until the SCSI Response (or Data-In with status) for `itt`.
    pub fn wait_status(&mut self, itt: u32) -> Result<u8, String> {
        self.wait_answer(itt).map(|a| a.status)
    }

    /// Run `cdb` expecting up to `edtl` bytes of data in: the status, the data and the
    /// sense bytes (empty unless CHECK CONDITION).
    pub fn command_in(&mut self, cdb: &[u8], edtl: u32) -> Result<Answer, String> {
        let (itt, pdu) = self.scsi_cmd(cdb, edtl > 0, edtl);
        self.send(&pdu)
            .map_err(|e| format!("send CDB {:#04x}: {e}", cdb[0]))?;
        self.wait_answer(itt)
    }

    /// Run `cdb` with `data` out: the raw initiator offers neither immediate nor
    /// unsolicited data, so the data goes in Data-Out PDUs (of at most 8 KiB, the
    /// default MaxRecvDataSegmentLength) as the target's R2Ts ask for it. The status
    /// and sense.
    pub fn command_out(&mut self, cdb: &[u8], data: &[u8]) -> Result<Answer, String> {
        let len = u32::try_from(data.len()).expect("a test's data-out");
        let (itt, mut pdu) = self.scsi_cmd(cdb, false, len);
        if !data.is_empty() {
            pdu.bytes[1] |= 0x20; // Write.
        }
        self.send(&pdu)
            .map_err(|e| format!("send CDB {:#04x}: {e}", cdb[0]))?;
        let deadline = Instant::now() + TOOL_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.recv(left) {
                Reply::Pdu(p) if p.itt() == itt && p.opcode() == op::R2T => {
                    let ttt = p.u32_at(20);
                    let offset = p.u32_at(40) as usize;
                    let want = p.u32_at(44) as usize;
                    let end = (offset + want).min(data.len());
                    let mut at = offset;
                    let mut sn = 0u32;
                    while at < end {
                        let n = (end - at).min(8192);
                        let last = at + n == end;
                        let out = Bhs::new(op::DATA_OUT, false, if last { 0x80 } else { 0 })
                            .bytes_at(8, &pdu.bytes[8..16])
                            .itt(itt)
                            .u32_at(20, ttt)
                            .exp_stat_sn(self.exp_stat_sn)
                            .u32_at(36, sn)
                            .u32_at(40, at as u32)
                            .data(data[at..at + n].to_vec());
                        self.send(&out).map_err(|e| format!("send Data-Out: {e}"))?;
                        at += n;
                        sn += 1;
                    }
                }
                Reply::Pdu(p) if p.itt() == itt && p.opcode() == op::SCSI_RSP => {
                    return Ok(Answer {
                        status: p.bhs[3],
                        data: Vec::new(),
                        sense: sense_of(&p),
                    });
                }
                Reply::Pdu(p) if p.opcode() == op::REJECT => {
                    return Err(format!("Reject, reason {:#04x}", p.bhs[2]));
                }
                Reply::Pdu(_) => {}
                other => return Err(format!("no SCSI status for ITT {itt}: {other:?}")),
            }
        }
    }

    /// Read PDUs until the SCSI Response (or Data-In with status) for `itt`, gathering
    /// its data in and its sense bytes.
    fn wait_answer(&mut self, itt: u32) -> Result<Answer, String> {
        let deadline = Instant::now() + TOOL_TIMEOUT;
        let mut data = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.recv(left) {
                Reply::Pdu(p) if p.itt() == itt && p.opcode() == op::DATA_IN => {
                    data.extend_from_slice(&p.data);
                    if p.bhs[1] & 0x01 != 0 {
                        return Ok(Answer {
                            status: p.bhs[3],
                            data,
                            sense: Vec::new(),
                        });
                    }
                }
                Reply::Pdu(p) if p.itt() == itt && p.opcode() == op::SCSI_RSP => {
                    return Ok(Answer {
                        status: p.bhs[3],
                        data,
                        sense: sense_of(&p),
                    });
                }
                Reply::Pdu(p) if p.opcode() == op::REJECT => {
                    return Err(format!("Reject, reason {:#04x}", p.bhs[2]));
                }
                Reply::Pdu(_) => {}
                other => return Err(format!("no SCSI status for ITT {itt}: {other:?}")),
            }
        }
    }

    /// REPORT TARGET PORT GROUPS: `(group id, ALUA state)` of every group, after
    /// retrying the unit attentions it may answer first (a new nexus's reset, a state
    /// change).
    pub fn report_target_port_groups(&mut self) -> Result<Vec<(u16, u8)>, String> {
        let mut cdb = [0u8; 12];
        cdb[0] = 0xA3;
        cdb[1] = 0x0A;
        cdb[6..10].copy_from_slice(&4096u32.to_be_bytes());
        for _ in 0..8 {
            let a = self.command_in(&cdb, 4096)?;
            if a.status == 0x02 && a.sense_key() == Some(0x06) {
                continue;
            }
            if a.status != 0 {
                return Err(format!(
                    "REPORT TARGET PORT GROUPS: status {:#04x}, sense {:02x?}",
                    a.status, a.sense
                ));
            }
            return Ok(parse_rtpg(&a.data));
        }
        Err("REPORT TARGET PORT GROUPS kept answering UNIT ATTENTION".into())
    }

    /// A working session: TEST UNIT READY answered (retried once for the unit attention
    /// a new nexus may get first).
    pub fn assert_serves(&mut self, what: &str) {
        for _ in 0..3 {
            match self.test_unit_ready() {
                Ok(0) => return,
                Ok(0x02) => continue,
                Ok(s) => panic!("{what}: TEST UNIT READY status {s:#04x}"),
                Err(e) => panic!("{what}: {e}"),
            }
        }
        panic!("{what}: TEST UNIT READY kept answering CHECK CONDITION");
    }
}

/// What a command returned.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The SCSI status.
    pub status: u8,
    /// The data in.
    pub data: Vec<u8>,
    /// The sense bytes (fixed or descriptor format).
    pub sense: Vec<u8>,
}

impl Answer {
    /// The sense key, if there is sense data.
    pub fn sense_key(&self) -> Option<u8> {
        match self.sense.first()? & 0x7f {
            0x70 | 0x71 => Some(self.sense.get(2)? & 0x0f),
            0x72 | 0x73 => Some(self.sense.get(1)? & 0x0f),
            _ => None,
        }
    }

    /// The additional sense code and qualifier, if there is sense data.
    pub fn asc_ascq(&self) -> Option<(u8, u8)> {
        match self.sense.first()? & 0x7f {
            0x70 | 0x71 => Some((*self.sense.get(12)?, *self.sense.get(13)?)),
            0x72 | 0x73 => Some((*self.sense.get(2)?, *self.sense.get(3)?)),
            _ => None,
        }
    }
}

/// The sense bytes of a SCSI Response (its data segment: SenseLength, then sense).
fn sense_of(p: &Pdu) -> Vec<u8> {
    match p.data.get(..2) {
        Some(l) => {
            let n = usize::from(u16::from_be_bytes([l[0], l[1]]));
            p.data.get(2..2 + n).unwrap_or(&[]).to_vec()
        }
        None => Vec::new(),
    }
}

/// The `(group id, ALUA state)` pairs of REPORT TARGET PORT GROUPS data (length format).
pub fn parse_rtpg(data: &[u8]) -> Vec<(u16, u8)> {
    let mut groups = Vec::new();
    let Some(len) = data.get(..4) else {
        return groups;
    };
    let end = (4 + u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize).min(data.len());
    let mut at = 4;
    while at + 8 <= end {
        let state = data[at] & 0x0f;
        let id = u16::from_be_bytes([data[at + 2], data[at + 3]]);
        let ports = usize::from(data[at + 7]);
        groups.push((id, state));
        at += 8 + 4 * ports;
    }
    groups
}

/// A READ(16) CDB.
pub fn read16(lba: u64, blocks: u32) -> [u8; 16] {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x88;
    cdb[2..10].copy_from_slice(&lba.to_be_bytes());
    cdb[10..14].copy_from_slice(&blocks.to_be_bytes());
    cdb
}

// ---------------------------------------------------------------------------------------
// Nodes.

/// A one-node config: `disk` of `size` (a TOML value: `"64MiB"`), file-backed in the
/// node's data dir, exported over NBD and iSCSI on fresh loopback ports, with `extra`
/// lines in its `[[disk]]` section (CHAP keys).
pub fn local_config(dir: &super::TestDir, disk: &str, size: &str, extra: &str) -> String {
    super::node_section(dir)
        + &super::disk_section(disk, size, "127.0.0.1:0")
        + &iscsi_lines()
        + extra
}

/// Two nodes mirroring one disk, each exporting it over NBD and iSCSI; node 1 dials.
#[derive(Debug)]
pub struct IscsiPair {
    /// Node 1's directory.
    pub dir1: super::TestDir,
    /// Node 2's directory.
    pub dir2: super::TestDir,
    /// Node 1.
    pub n1: Node,
    /// Node 2.
    pub n2: Node,
    /// Node 1's config (to restart it).
    pub config1: String,
    /// Node 2's config.
    pub config2: String,
}

/// How long a pair may take to connect and finish its first resync.
pub const PAIR_TIMEOUT: Duration = Duration::from_secs(60);

impl IscsiPair {
    /// Start node 2, then node 1 dialing it; wait until both mirror and the first
    /// resync is done.
    pub fn start(tag: &str, disk: &'static str, size: &'static str) -> IscsiPair {
        use super::mirror::{CONNECTED, Side};
        let dir1 = super::TestDir::new(&format!("{tag}-n1"));
        let dir2 = super::TestDir::new(&format!("{tag}-n2"));
        let s1 = Side::new(1, disk, size).timeout(1000);
        let s2 = Side::new(2, disk, size).timeout(1000);
        let config2 = s2.config(&dir2, Some("127.0.0.1:0"), "127.0.0.1:1") + &iscsi_lines();
        let n2 = Node::start_listening(&dir2, &config2, &[disk]);
        let config1 = s1.config(&dir1, None, n2.replication()) + &iscsi_lines();
        let n1 = Node::start(&dir1, &config1, &[disk]);
        n1.wait_log(CONNECTED, PAIR_TIMEOUT);
        n2.wait_log(CONNECTED, PAIR_TIMEOUT);
        n1.wait_stdout(&[&format!("sync disk={disk} done")], PAIR_TIMEOUT);
        n2.wait_stdout(&[&format!("sync disk={disk} done")], PAIR_TIMEOUT);
        IscsiPair {
            dir1,
            dir2,
            n1,
            n2,
            config1,
            config2,
        }
    }
}
