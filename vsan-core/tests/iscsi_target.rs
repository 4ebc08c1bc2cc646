//! The iSCSI target end to end over loopback TCP, driven by a small initiator written
//! on the crate's own codec: login, the full-feature phase's data paths (immediate data,
//! unsolicited Data-Out, R2T, Data-In split and collapsed), CmdSN ordering and window,
//! NOP-In pings, task management and logout. The outside initiators (libiscsi's
//! conformance suite, QEMU) are in `examples/tests/iscsi_*.rs`.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use vsan_core::export::iscsi::pdu::{
    DataIn, DataOut, Digests, LoginReq, LogoutReq, NopOut, Reply, ReplyDecoder, Request,
    ScsiCommand, ScsiResponse, TaskMgmtReq, TextReq,
};
use vsan_core::export::iscsi::{Server, ServerOptions, Target};
use vsan_core::scsi::{LogicalUnit, LuConfig, LuIdentity, TargetPort};
use vsan_core::{BlockDevice, Geometry, MemDevice};

mod common;
use common::PlugProbe;

const IQN: &str = "iqn.2026-12.io.vsan:test";
const INITIATOR: &str = "iqn.2026-12.io.vsan:initiator";
const BLOCK: u32 = 512;

fn lu(dev: Arc<dyn BlockDevice>) -> Arc<LogicalUnit> {
    LogicalUnit::new(
        dev,
        LuConfig {
            identity: LuIdentity::from_disk_id("test-disk"),
            port: TargetPort {
                name: format!("{IQN},t,0x0001"),
                relative_id: 1,
                group: 1,
            },
            read_only: false,
            state_file: None,
        },
    )
    .unwrap()
}

async fn start(options: ServerOptions) -> (Server, std::net::SocketAddr, Arc<MemDevice>) {
    let dev = Arc::new(MemDevice::new(Geometry::new(16 << 20, BLOCK).unwrap()));
    let server = Server::with_options(vec![Target::new(IQN, lu(dev.clone()))], options).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let s = server.clone();
    tokio::spawn(async move { s.serve_tcp(listener).await });
    (server, addr, dev)
}

/// A minimal initiator.
struct Initiator {
    stream: TcpStream,
    dec: ReplyDecoder,
    inbuf: BytesMut,
    cmd_sn: u32,
    exp_stat_sn: u32,
    itt: u32,
    /// The target's MaxRecvDataSegmentLength.
    target_mrdsl: u32,
    isid: [u8; 6],
}

fn keys(pairs: &[(&str, &str)]) -> Bytes {
    let mut v = Vec::new();
    for (k, val) in pairs {
        v.extend_from_slice(k.as_bytes());
        v.push(b'=');
        v.extend_from_slice(val.as_bytes());
        v.push(0);
    }
    Bytes::from(v)
}

fn parse_keys(data: &[u8]) -> Vec<(String, String)> {
    data.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let s = String::from_utf8_lossy(s);
            let (k, v) = s.split_once('=').unwrap_or((&s, ""));
            (k.to_string(), v.to_string())
        })
        .collect()
}

impl Initiator {
    async fn connect(addr: std::net::SocketAddr) -> Initiator {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Initiator {
            stream,
            dec: ReplyDecoder::new(1 << 24),
            inbuf: BytesMut::new(),
            cmd_sn: 1,
            exp_stat_sn: 0,
            itt: 1,
            target_mrdsl: 8192,
            isid: [0x80, 0, 0, 0x12, 0x34, 0x56],
        }
    }

    async fn send(&mut self, req: Request) {
        let mut out = BytesMut::new();
        req.encode(Digests::default(), &mut out);
        self.stream.write_all(&out).await.unwrap();
    }

    async fn recv(&mut self) -> Option<Reply> {
        loop {
            if let Some(r) = self.dec.decode(&mut self.inbuf).unwrap() {
                return Some(r);
            }
            let n = tokio::time::timeout(
                Duration::from_secs(10),
                self.stream.read_buf(&mut self.inbuf),
            )
            .await
            .expect("the target answered within 10 s")
            .unwrap();
            if n == 0 {
                return None;
            }
        }
    }

    /// Skip NOP-In pings (answering them) until another reply comes.
    async fn recv_reply(&mut self) -> Reply {
        loop {
            let r = self.recv().await.expect("a reply, not a close");
            if let Reply::NopIn(n) = &r {
                if n.itt == 0xffff_ffff {
                    let ttt = n.ttt;
                    self.send(Request::NopOut(NopOut {
                        header: [0; 48],
                        immediate: true,
                        lun: 0,
                        itt: 0xffff_ffff,
                        ttt,
                        cmd_sn: self.cmd_sn,
                        exp_stat_sn: self.exp_stat_sn,
                        data: Bytes::new(),
                    }))
                    .await;
                    continue;
                }
            }
            return r;
        }
    }

    fn next_itt(&mut self) -> u32 {
        self.itt += 1;
        self.itt
    }

    /// Log in to `target` (None: a discovery session) with extra operational keys;
    /// returns the target's keys.
    async fn login(
        &mut self,
        target: Option<&str>,
        extra: &[(&str, &str)],
    ) -> Vec<(String, String)> {
        let mut pairs = vec![("InitiatorName", INITIATOR), ("AuthMethod", "None")];
        match target {
            Some(t) => {
                pairs.push(("TargetName", t));
                pairs.push(("SessionType", "Normal"));
            }
            None => pairs.push(("SessionType", "Discovery")),
        }
        let itt = self.next_itt();
        let r = self.login_step(itt, 0, 1, keys(&pairs)).await;
        assert_eq!((r.status_class, r.status_detail), (0, 0), "security stage");
        let mut got = parse_keys(&r.data);
        let mut op = vec![
            ("HeaderDigest", "None"),
            ("DataDigest", "None"),
            ("MaxRecvDataSegmentLength", "262144"),
        ];
        op.extend_from_slice(extra);
        let r = self.login_step(itt, 1, 3, keys(&op)).await;
        assert_eq!(
            (r.status_class, r.status_detail),
            (0, 0),
            "operational stage"
        );
        assert!(r.transit, "the target moves to the full-feature phase");
        got.extend(parse_keys(&r.data));
        if let Some((_, v)) = got.iter().find(|(k, _)| k == "MaxRecvDataSegmentLength") {
            self.target_mrdsl = v.parse().unwrap();
        }
        got
    }

    async fn login_step(
        &mut self,
        itt: u32,
        csg: u8,
        nsg: u8,
        data: Bytes,
    ) -> vsan_core::export::iscsi::pdu::LoginResp {
        self.send(Request::Login(LoginReq {
            header: [0; 48],
            transit: true,
            cont: false,
            csg,
            nsg,
            version_max: 0,
            version_min: 0,
            isid: self.isid,
            tsih: 0,
            itt,
            cid: 0,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            data,
        }))
        .await;
        match self.recv().await.expect("a login response") {
            Reply::LoginResp(r) => {
                self.exp_stat_sn = r.stat_sn.wrapping_add(1);
                r
            }
            other => panic!("expected a Login Response, got {other:?}"),
        }
    }

    fn command(
        &mut self,
        cdb: &[u8],
        read: bool,
        write: bool,
        edtl: u32,
        data: Bytes,
        final_: bool,
    ) -> ScsiCommand {
        let itt = self.next_itt();
        let c = ScsiCommand {
            header: [0; 48],
            immediate: false,
            final_,
            read,
            write,
            attr: 1,
            lun: 0,
            itt,
            expected_len: edtl,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            cdb: Bytes::copy_from_slice(cdb),
            bidi_read_len: None,
            data,
        };
        self.cmd_sn = self.cmd_sn.wrapping_add(1);
        c
    }

    /// Run one command to its status, answering R2Ts from `data`; returns the status,
    /// the data-in, and the SCSI Response (None when the status came in a Data-In).
    async fn run(
        &mut self,
        cdb: &[u8],
        edtl_in: u32,
        data: &[u8],
        immediate_max: usize,
    ) -> (u8, Bytes, Option<ScsiResponse>) {
        let write = !data.is_empty();
        let imm = data.len().min(immediate_max);
        let c = self.command(
            cdb,
            edtl_in > 0,
            write,
            if write { data.len() as u32 } else { edtl_in },
            Bytes::copy_from_slice(&data[..imm]),
            true,
        );
        let itt = c.itt;
        self.send(Request::Command(c)).await;
        let mut got = BytesMut::new();
        loop {
            match self.recv_reply().await {
                Reply::R2t(r) => {
                    assert_eq!(r.itt, itt);
                    let (off, len) = (r.offset as usize, r.len as usize);
                    let mut sn = 0;
                    let mut at = off;
                    while at < off + len {
                        let n = (off + len - at).min(self.target_mrdsl as usize);
                        self.send(Request::DataOut(DataOut {
                            header: [0; 48],
                            final_: at + n == off + len,
                            lun: 0,
                            itt,
                            ttt: r.ttt,
                            exp_stat_sn: self.exp_stat_sn,
                            data_sn: sn,
                            offset: at as u32,
                            data: Bytes::copy_from_slice(&data[at..at + n]),
                        }))
                        .await;
                        sn += 1;
                        at += n;
                    }
                }
                Reply::DataIn(d) => {
                    assert_eq!(d.itt, itt);
                    assert_eq!(d.offset as usize, got.len(), "Data-In in order");
                    got.extend_from_slice(&d.data);
                    if let Some(status) = d.status {
                        self.exp_stat_sn = d.stat_sn.wrapping_add(1);
                        return (status, got.freeze(), None);
                    }
                }
                Reply::ScsiResponse(r) => {
                    assert_eq!(r.itt, itt);
                    self.exp_stat_sn = r.stat_sn.wrapping_add(1);
                    return (r.status, got.freeze(), Some(r));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    /// Send an immediate Task Management Function Request for LUN 0 and return the
    /// response code of its answer.
    async fn task_mgmt(&mut self, function: u8, ref_itt: u32, ref_cmd_sn: u32) -> u8 {
        let itt = self.next_itt();
        self.send(Request::TaskMgmt(TaskMgmtReq {
            header: [0; 48],
            immediate: true,
            function,
            lun: 0,
            itt,
            ref_itt,
            cmd_sn: self.cmd_sn,
            exp_stat_sn: self.exp_stat_sn,
            ref_cmd_sn,
            exp_data_sn: 0,
        }))
        .await;
        match self.recv_reply().await {
            Reply::TaskMgmtResp(r) => r.response,
            other => panic!("expected a Task Management Function Response, got {other:?}"),
        }
    }

    /// Run a command until it is not answered by a unit attention.
    async fn run_clear_ua(
        &mut self,
        cdb: &[u8],
        edtl_in: u32,
        data: &[u8],
        imm: usize,
    ) -> (u8, Bytes, Option<ScsiResponse>) {
        for _ in 0..4 {
            let r = self.run(cdb, edtl_in, data, imm).await;
            let ua = r.0 == 2
                && r.2
                    .as_ref()
                    .is_some_and(|s| sense_key(&s.sense) == Some(0x06));
            if !ua {
                return r;
            }
        }
        panic!("unit attentions never cleared");
    }
}

fn sense_key(sense: &[u8]) -> Option<u8> {
    match sense.first()? & 0x7f {
        0x70 | 0x71 => Some(sense.get(2)? & 0x0f),
        0x72 | 0x73 => Some(sense.get(1)? & 0x0f),
        _ => None,
    }
}

fn write10(lba: u32, blocks: u16, fua: bool) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = 0x2a;
    c[1] = if fua { 0x08 } else { 0 };
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn read10(lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = write10(lba, blocks, false);
    c[0] = 0x28;
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn login_write_read_through_every_data_path() {
    let (server, addr, dev) = start(ServerOptions::default()).await;
    for (initial_r2t, immediate, imm_max) in [
        ("No", "Yes", 1 << 20),
        ("Yes", "No", 0),
        ("Yes", "Yes", 4096),
    ] {
        let mut ini = Initiator::connect(addr).await;
        let got = ini
            .login(
                Some(IQN),
                &[
                    ("InitialR2T", initial_r2t),
                    ("ImmediateData", immediate),
                    ("MaxBurstLength", "65536"),
                    ("FirstBurstLength", "65536"),
                ],
            )
            .await;
        assert!(
            got.iter()
                .any(|(k, v)| k == "InitialR2T" && v == initial_r2t),
            "{got:?}"
        );
        let imm_max = imm_max.min(ini.target_mrdsl as usize);
        // 1 block, 8 blocks, and 600 KiB (several bursts and R2Ts).
        for (i, blocks) in [1u16, 8, 1200].into_iter().enumerate() {
            let lba = 1000 * i as u32;
            let data = pattern(blocks as usize * BLOCK as usize, blocks as u8);
            let (status, _, _) = ini
                .run_clear_ua(&write10(lba, blocks, i == 1), 0, &data, imm_max)
                .await;
            assert_eq!(status, 0, "WRITE(10) of {blocks} blocks");
            let back = dev
                .read(lba as u64 * BLOCK as u64, data.len())
                .await
                .unwrap();
            assert_eq!(&back[..], &data[..], "the device holds what was written");
            let (status, got, _) = ini
                .run(&read10(lba, blocks), data.len() as u32, &[], 0)
                .await;
            assert_eq!(status, 0);
            assert_eq!(&got[..], &data[..], "READ(10) returns it");
        }
    }
    server.shutdown();
    server.wait_idle().await;
}

#[tokio::test]
async fn commands_run_in_cmdsn_order_and_outside_the_window_are_ignored() {
    let (server, addr, dev) = start(ServerOptions::default()).await;
    let mut ini = Initiator::connect(addr).await;
    ini.login(Some(IQN), &[("InitialR2T", "No"), ("ImmediateData", "Yes")])
        .await;
    ini.run_clear_ua(&[0u8; 6], 0, &[], 0).await; // TEST UNIT READY
    // Two writes to the same block sent with their CmdSNs swapped: the one with the
    // lower CmdSN must run first, so the second pattern wins.
    let a = pattern(512, 1);
    let b = pattern(512, 2);
    let first = ini.command(
        &write10(7, 1, false),
        false,
        true,
        512,
        Bytes::from(a.clone()),
        true,
    );
    let second = ini.command(
        &write10(7, 1, false),
        false,
        true,
        512,
        Bytes::from(b.clone()),
        true,
    );
    ini.send(Request::Command(second)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    ini.send(Request::Command(first)).await;
    for _ in 0..2 {
        match ini.recv_reply().await {
            Reply::ScsiResponse(r) => {
                assert_eq!(r.status, 0);
                ini.exp_stat_sn = r.stat_sn + 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(&dev.read(7 * 512, 512).await.unwrap()[..], &b[..]);
    // A TEST UNIT READY with CmdSN = MaxCmdSN + 1 is dropped; the next in-window one works.
    let mut c = ini.command(&[0u8; 6], false, false, 0, Bytes::new(), true);
    c.cmd_sn = c.cmd_sn.wrapping_add(10_000);
    ini.cmd_sn -= 1;
    ini.send(Request::Command(c)).await;
    let (status, _, _) = ini.run(&[0u8; 6], 0, &[], 0).await;
    assert_eq!(
        status, 0,
        "the in-window command after the ignored one is answered"
    );
    server.shutdown();
    server.wait_idle().await;
}

#[tokio::test]
async fn data_in_is_split_by_the_initiators_segment_size_and_residuals_are_reported() {
    let (server, addr, dev) = start(ServerOptions::default()).await;
    dev.write(
        0,
        Bytes::from(pattern(64 << 10, 9)),
        vsan_core::IoFlags::empty(),
    )
    .await
    .unwrap();
    let mut ini = Initiator::connect(addr).await;
    // The initiator accepts 4 KiB segments: a 64 KiB read comes in 16 Data-Ins.
    let mut pairs = vec![
        ("InitiatorName", INITIATOR),
        ("AuthMethod", "None"),
        ("TargetName", IQN),
        ("SessionType", "Normal"),
    ];
    let itt = ini.next_itt();
    ini.login_step(itt, 0, 1, keys(&pairs)).await;
    pairs.clear();
    let r = ini
        .login_step(itt, 1, 3, keys(&[("MaxRecvDataSegmentLength", "4096")]))
        .await;
    assert_eq!(r.status_class, 0);
    ini.run_clear_ua(&[0u8; 6], 0, &[], 0).await;
    let c = ini.command(&read10(0, 128), true, false, 64 << 10, Bytes::new(), true);
    ini.send(Request::Command(c)).await;
    let mut pdus = Vec::<DataIn>::new();
    loop {
        match ini.recv_reply().await {
            Reply::DataIn(d) => {
                assert!(d.data.len() <= 4096);
                let last = d.status.is_some();
                pdus.push(d);
                if last {
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(pdus.len(), 16);
    assert!(pdus.iter().enumerate().all(|(i, d)| d.data_sn == i as u32));
    let all: Vec<u8> = pdus.iter().flat_map(|d| d.data.to_vec()).collect();
    assert_eq!(all, pattern(64 << 10, 9));
    // INQUIRY asking for 255 bytes gets fewer: an underflow residual.
    let (status, data, resp) = ini.run(&[0x12, 0, 0, 0, 255, 0], 255, &[], 0).await;
    assert_eq!(status, 0);
    assert!(data.len() >= 36 && data.len() < 255);
    let _ = resp;
    server.shutdown();
    server.wait_idle().await;
}

#[tokio::test]
async fn the_target_pings_an_idle_initiator_and_drops_one_that_does_not_answer() {
    let options = ServerOptions {
        nop_interval: Duration::from_millis(200),
        nop_timeout: Duration::from_millis(400),
        ..ServerOptions::default()
    };
    let (server, addr, _) = start(options).await;
    let mut ini = Initiator::connect(addr).await;
    ini.login(Some(IQN), &[]).await;
    // Answered pings keep the connection up.
    let (status, _, _) = {
        tokio::time::sleep(Duration::from_millis(100)).await;
        ini.run_clear_ua(&[0u8; 6], 0, &[], 0).await
    };
    assert_eq!(status, 0);
    // A ping arrives; we do not answer: the target closes the connection.
    match ini.recv().await {
        Some(Reply::NopIn(n)) => assert_eq!(n.itt, 0xffff_ffff),
        other => panic!("expected a ping, got {other:?}"),
    }
    let start = std::time::Instant::now();
    loop {
        match ini.recv().await {
            None => break,
            Some(Reply::NopIn(_)) => {}
            Some(other) => panic!("unexpected {other:?}"),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    for _ in 0..100 {
        if server.stats().sessions_open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(server.stats().sessions_open, 0);
    server.shutdown();
    server.wait_idle().await;
}

#[tokio::test]
async fn discovery_lists_the_targets_and_logout_closes_cleanly() {
    let (server, addr, _) = start(ServerOptions::default()).await;
    let mut ini = Initiator::connect(addr).await;
    ini.login(None, &[]).await;
    let itt = ini.next_itt();
    ini.send(Request::Text(TextReq {
        header: [0; 48],
        immediate: false,
        final_: true,
        cont: false,
        lun: 0,
        itt,
        ttt: 0xffff_ffff,
        cmd_sn: ini.cmd_sn,
        exp_stat_sn: ini.exp_stat_sn,
        data: keys(&[("SendTargets", "All")]),
    }))
    .await;
    ini.cmd_sn += 1;
    match ini.recv_reply().await {
        Reply::TextResp(t) => {
            let got = parse_keys(&t.data);
            assert!(
                got.iter().any(|(k, v)| k == "TargetName" && v == IQN),
                "{got:?}"
            );
            assert!(
                got.iter()
                    .any(|(k, v)| k == "TargetAddress" && v.starts_with(&addr.to_string())),
                "{got:?}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(server.sessions().len(), 1);
    let itt = ini.next_itt();
    ini.send(Request::Logout(LogoutReq {
        header: [0; 48],
        immediate: true,
        reason: 0,
        itt,
        cid: 0,
        cmd_sn: ini.cmd_sn,
        exp_stat_sn: ini.exp_stat_sn,
    }))
    .await;
    match ini.recv_reply().await {
        Reply::LogoutResp(l) => assert_eq!(l.response, 0),
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        ini.recv().await.is_none(),
        "the target closes after the logout"
    );
    server.shutdown();
    server.wait_idle().await;
}

#[tokio::test]
async fn abort_task_of_a_finished_task_says_it_does_not_exist() {
    let (server, addr, _) = start(ServerOptions::default()).await;
    let mut ini = Initiator::connect(addr).await;
    ini.login(Some(IQN), &[]).await;
    ini.run_clear_ua(&[0u8; 6], 0, &[], 0).await;
    assert_eq!(ini.task_mgmt(1, 12345, 1).await, 0x01);
    // LUN RESET completes; the next command sees the reset unit attention.
    assert_eq!(ini.task_mgmt(5, 0xffff_ffff, 0).await, 0x00);
    server.shutdown();
    server.wait_idle().await;
}

/// CLEAR TASK SET from one session aborts another session's task (here a WRITE waiting
/// for its Data-Out, InitialR2T being the default), and that session's next command
/// sees COMMANDS CLEARED BY ANOTHER INITIATOR (the control page's TAS is off).
#[tokio::test]
async fn clear_task_set_tells_the_other_session_its_commands_were_cleared() {
    let (server, addr, _) = start(ServerOptions::default()).await;
    let mut a = Initiator::connect(addr).await;
    a.login(Some(IQN), &[]).await;
    a.run_clear_ua(&[0u8; 6], 0, &[], 0).await;
    let mut b = Initiator::connect(addr).await;
    b.isid = [0x80, 0, 0, 0x12, 0x34, 0x57];
    b.login(Some(IQN), &[("ImmediateData", "No")]).await;
    b.run_clear_ua(&[0u8; 6], 0, &[], 0).await;
    let w = b.command(
        &write10(0, 8, false),
        false,
        true,
        8 * BLOCK,
        Bytes::new(),
        true,
    );
    b.send(Request::Command(w)).await;
    match b.recv_reply().await {
        Reply::R2t(_) => {}
        other => panic!("expected an R2T, got {other:?}"),
    }
    assert_eq!(a.task_mgmt(4, 0xffff_ffff, 0).await, 0x00);
    // The issuer sees no unit attention; the other session does, once.
    let (status, _, _) = a.run(&[0u8; 6], 0, &[], 0).await;
    assert_eq!(status, 0, "no unit attention for the issuer");
    let (status, _, resp) = b.run(&[0u8; 6], 0, &[], 0).await;
    assert_eq!(status, 2, "CHECK CONDITION");
    let sense = resp.unwrap().sense;
    assert_eq!(sense_key(&sense), Some(0x06));
    let (asc, ascq) = if sense[0] & 0x7f >= 0x72 {
        (sense[2], sense[3])
    } else {
        (sense[12], sense[13])
    };
    assert_eq!(
        (asc, ascq),
        (0x2F, 0x00),
        "COMMANDS CLEARED BY ANOTHER INITIATOR"
    );
    let (status, _, _) = b.run(&[0u8; 6], 0, &[], 0).await;
    assert_eq!(status, 0, "the unit attention is reported once");
    server.shutdown();
    server.wait_idle().await;
}

#[tokio::test]
async fn garbage_ends_one_connection_and_the_server_goes_on() {
    let (server, addr, _) = start(ServerOptions::default()).await;
    let mut bad = TcpStream::connect(addr).await.unwrap();
    bad.write_all(&[0xffu8; 200]).await.unwrap();
    let mut sink = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), bad.read_to_end(&mut sink)).await;
    let mut ini = Initiator::connect(addr).await;
    ini.login(Some(IQN), &[]).await;
    let (status, _, _) = ini.run_clear_ua(&[0u8; 6], 0, &[], 0).await;
    assert_eq!(status, 0);
    server.shutdown();
    server.wait_idle().await;
}

/// Commands that arrive together start together: every one of 100 one-block WRITEs sent
/// in one burst reaches the device under the session's plug (so a mirror sends them to
/// its peer in one batch), none on its own after it — also beyond the 61 futures a
/// `futures_buffered` set polls before it yields, which is why the session keeps
/// `futures_util`'s set.
#[tokio::test]
async fn commands_that_arrive_together_start_under_one_plug() {
    let probe = PlugProbe::new();
    let server = Server::with_options(
        vec![Target::new(IQN, lu(probe.clone()))],
        ServerOptions::default(),
    )
    .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let s = server.clone();
    tokio::spawn(async move { s.serve_tcp(listener).await });
    let mut ini = Initiator::connect(addr).await;
    ini.login(Some(IQN), &[("InitialR2T", "No"), ("ImmediateData", "Yes")])
        .await;
    ini.run_clear_ua(&[0u8; 6], 0, &[], 0).await; // TEST UNIT READY
    const N: u32 = 100;
    let mut burst = BytesMut::new();
    for i in 0..N {
        let data = Bytes::from(pattern(BLOCK as usize, i as u8));
        let c = ini.command(&write10(i, 1, false), false, true, BLOCK, data, true);
        Request::Command(c).encode(Digests::default(), &mut burst);
    }
    ini.stream.write_all(&burst).await.unwrap();
    for _ in 0..N {
        match ini.recv_reply().await {
            Reply::ScsiResponse(r) => {
                assert_eq!(r.status, 0);
                ini.exp_stat_sn = r.stat_sn + 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    for i in 0..N {
        let back = probe
            .read(u64::from(i * BLOCK), BLOCK as usize)
            .await
            .unwrap();
        assert_eq!(
            &back[..],
            &pattern(BLOCK as usize, i as u8)[..],
            "block {i}"
        );
    }
    let (plugged, unplugged, batches) = {
        let st = probe.state.lock().unwrap();
        (st.plugged, st.unplugged, st.batches)
    };
    assert_eq!(
        (plugged, unplugged),
        (u64::from(N), 0),
        "every write of the burst started under a plug"
    );
    assert!(batches >= 1, "the burst went through an unplug");
    server.shutdown();
    server.wait_idle().await;
}
