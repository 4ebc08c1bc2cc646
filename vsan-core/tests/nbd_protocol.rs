//! The NBD server doing what the protocol says, checked from the wire and on the disk.
//!
//! Negotiation is checked byte by byte with a raw socket (OPT_INFO, OPT_GO, OPT_LIST,
//! OPT_EXPORT_NAME with and without the 124 zero bytes, the default export); transmission
//! with the crate's [`Client`] and raw requests (every command, FUA, read-only exports,
//! replies out of order, many requests and connections at once); durability with a
//! [`FaultyDevice`] whose power is cut; and shutdown with requests held in the device.
//!
//! Requests are held in flight with [`Held`], a device that parks operations until the
//! test releases them, so ordering is proven by events rather than by sleeping.

mod common;

use std::collections::HashSet;
use std::future::Future;
use std::io::ErrorKind as IoKind;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{
    BS, Held, IO_TIMEOUT, MAX_IO, MIB, Raw, SIZE, export_info, geometry, go_data, info_item, mem,
    option_frame, pattern, req, serve, simple_reply_fields, tempdir,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use vsan_core::export::nbd::proto::*;
use vsan_core::export::nbd::{Client, Export, Server};
use vsan_core::{BlockDevice, ErrorKind, FaultyDevice, Geometry, IoFlags, MemDevice, PowerCut};

/// The deadline of a whole test.
const TEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Run a test body within [`TEST_TIMEOUT`].
async fn within<T>(body: impl Future<Output = T>) -> T {
    common::within(TEST_TIMEOUT, body).await
}

const RW_FLAGS: u16 = TFLAG_HAS_FLAGS
    | TFLAG_SEND_FLUSH
    | TFLAG_SEND_FUA
    | TFLAG_SEND_TRIM
    | TFLAG_SEND_WRITE_ZEROES
    | TFLAG_CAN_MULTI_CONN;

// ---------------------------------------------------------------------------------------
// Commands
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_does_what_it_says() {
    within(async {
        let disk = mem();
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let c = Client::connect_tcp(&srv.addr, "vol0").await.unwrap();
        assert_eq!(c.size(), SIZE);
        assert_eq!(c.info().flags, RW_FLAGS);

        // WRITE then READ, at the start, the end, and a whole max_io request.
        let a = pattern(1, 0, 8192);
        c.write(0, &a, false).await.unwrap();
        assert!(c.read(0, 8192).await.unwrap() == a);
        let tail = pattern(2, SIZE - 4096, 4096);
        c.write(SIZE - 4096, &tail, false).await.unwrap();
        assert!(c.read(SIZE - 4096, 4096).await.unwrap() == tail);
        let big = pattern(3, MIB, MAX_IO as usize);
        c.write(MIB, &big, false).await.unwrap();
        assert!(c.read(MIB, MAX_IO).await.unwrap() == big);
        // WRITE with FUA, FLUSH.
        let f = pattern(4, 4 * MIB, 4096);
        c.write(4 * MIB, &f, true).await.unwrap();
        c.flush().await.unwrap();
        assert!(c.read(4 * MIB, 4096).await.unwrap() == f);
        // The device itself holds what the client wrote.
        assert!(disk.read(0, 8192).await.unwrap() == a);
        assert!(disk.read(MIB, MAX_IO as usize).await.unwrap() == big);

        // TRIM reads back as zeros (this device zeroes what it discards), and only there.
        c.trim(MIB + 4096, 8192).await.unwrap();
        let back = c.read(MIB, 16384).await.unwrap();
        assert!(back[..4096] == big[..4096]);
        assert!(back[4096..12288].iter().all(|&b| b == 0));
        assert!(back[12288..] == big[12288..16384]);
        // WRITE_ZEROES, larger than max_io (it carries no payload).
        c.write_zeroes(MIB, 2 * MAX_IO).await.unwrap();
        assert!(c.read(MIB, MAX_IO).await.unwrap().iter().all(|&b| b == 0));
        assert!(
            disk.read(2 * MIB, 4096)
                .await
                .unwrap()
                .iter()
                .all(|&b| b == 0)
        );
        assert!(c.read(0, 8192).await.unwrap() == a);

        // WRITE_ZEROES with FUA and NO_HOLE, TRIM with FUA (raw: the client has no flags).
        c.write(8 * MIB, &pattern(5, 8 * MIB, 8192), false)
            .await
            .unwrap();
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        raw.request(
            CMD_WRITE_ZEROES,
            CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
            1,
            8 * MIB,
            4096,
        )
        .await;
        assert_eq!(raw.reply().await, (0, 1));
        raw.request(CMD_TRIM, CMD_FLAG_FUA, 2, 8 * MIB + 4096, 4096)
            .await;
        assert_eq!(raw.reply().await, (0, 2));
        assert!(
            disk.read(8 * MIB, 8192)
                .await
                .unwrap()
                .iter()
                .all(|&b| b == 0)
        );

        c.disconnect().await.unwrap();
        drop(raw);
        srv.settle().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disc_answers_requests_in_flight_then_closes() {
    within(async {
        let disk = Held::new(0);
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        let mut b = Vec::new();
        for i in 0..16u64 {
            b.extend_from_slice(&req(CMD_WRITE, 0, i, i * 4096, 4096).encode());
            b.extend_from_slice(&pattern(i as u8, i * 4096, 4096));
        }
        b.extend_from_slice(&req(CMD_FLUSH, 0, 100, 0, 0).encode());
        b.extend_from_slice(&req(CMD_DISC, 0, 200, 0, 0).encode());
        raw.send(&b).await;
        raw.close_write().await;
        // All 17 sit in the device when the server reads DISC.
        disk.started(17).await;
        disk.release();
        let got = raw.expect_eof().await;
        assert_eq!(
            got.len(),
            17 * SIMPLE_REPLY_LEN,
            "one reply each, none for DISC"
        );
        let mut cookies = HashSet::new();
        for r in got.chunks(SIMPLE_REPLY_LEN) {
            assert_eq!(r[..8], simple_reply(0, 0)[..8], "a successful simple reply");
            assert!(cookies.insert(u64::from_be_bytes(r[8..16].try_into().unwrap())));
        }
        assert_eq!(cookies, (0..16).chain([100]).collect());
        for i in 0..16u64 {
            assert!(disk.read(i * 4096, 4096).await.unwrap() == pattern(i as u8, i * 4096, 4096));
        }
        srv.settle().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fua_flag_is_accepted_on_every_command() {
    // The spec: with NBD_FLAG_SEND_FUA negotiated the server MUST accept NBD_CMD_FLAG_FUA
    // on all commands, ignoring it where nothing is written (clients are known to set it
    // on reads and flushes).
    within(async {
        let disk = mem();
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        let data = pattern(9, 0, 4096);
        raw.write(CMD_FLAG_FUA, 1, 0, &data).await;
        assert_eq!(raw.reply().await, (0, 1), "WRITE + FUA");
        raw.request(CMD_FLUSH, CMD_FLAG_FUA, 2, 0, 0).await;
        let flush = raw.reply().await;
        raw.request(CMD_READ, CMD_FLAG_FUA, 3, 0, 4096).await;
        let read = raw.reply().await;
        if read.0 == 0 {
            assert!(raw.read_exact(4096).await == data);
        }
        raw.request(CMD_TRIM, CMD_FLAG_FUA, 4, 8192, 4096).await;
        let trim = raw.reply().await;
        assert_eq!(
            [flush, read, trim],
            [(0, 2), (0, 3), (0, 4)],
            "FLUSH, READ, TRIM with FUA: (errno, cookie)"
        );
        // DISC with FUA is still a DISC: no reply, the connection closes.
        raw.request(CMD_DISC, CMD_FLAG_FUA, 5, 0, 0).await;
        raw.close_write().await;
        assert_eq!(raw.expect_eof().await, b"", "DISC + FUA was answered");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_export_refuses_writes_with_eperm() {
    within(async {
        let disk = mem();
        disk.write(0, Bytes::from(pattern(7, 0, 8192)), IoFlags::empty())
            .await
            .unwrap();
        let srv = serve(vec![Export::new("ro", disk.clone()).read_only(true)]).await;
        let c = Client::connect_tcp(&srv.addr, "ro").await.unwrap();
        assert_eq!(c.info().flags, RW_FLAGS | TFLAG_READ_ONLY);
        let err = c.write(0, &[1; 4096], false).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ReadOnly);
        assert_eq!(
            c.write(0, &[1; 4096], true).await.unwrap_err().kind(),
            ErrorKind::ReadOnly
        );
        assert_eq!(
            c.trim(0, 4096).await.unwrap_err().kind(),
            ErrorKind::ReadOnly
        );
        assert_eq!(
            c.write_zeroes(0, 4096).await.unwrap_err().kind(),
            ErrorKind::ReadOnly
        );
        // Reads and flushes work; the connection stays usable.
        assert!(c.read(0, 8192).await.unwrap() == pattern(7, 0, 8192));
        c.flush().await.unwrap();
        // On the wire it is EPERM, and the refused write's payload was consumed.
        let mut raw = Raw::attach(&srv.addr, "ro").await;
        raw.write(0, 1, 0, &[2; 4096]).await;
        assert_eq!(raw.reply().await, (EPERM, 1));
        raw.request(CMD_WRITE_ZEROES, CMD_FLAG_FUA, 2, 0, 4096)
            .await;
        assert_eq!(raw.reply().await, (EPERM, 2));
        raw.request(CMD_READ, 0, 3, 0, 4096).await;
        assert_eq!(raw.reply().await, (0, 3));
        assert!(raw.read_exact(4096).await == pattern(7, 0, 4096));
        assert!(disk.read(0, 8192).await.unwrap() == pattern(7, 0, 8192));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_come_in_completion_order() {
    within(async {
        // Requests at 8 MiB and above wait in the device until released.
        let disk = Held::new(8 * MIB);
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        raw.request(CMD_READ, 0, 1, 8 * MIB, 4096).await;
        raw.write(0, 2, 0, &pattern(1, 0, 4096)).await;
        raw.request(CMD_READ, 0, 3, 0, 4096).await;
        // The two fast ones are answered while the slow read still waits.
        assert_eq!(raw.reply().await, (0, 2));
        assert_eq!(raw.reply().await, (0, 3));
        assert!(raw.read_exact(4096).await == pattern(1, 0, 4096));
        disk.release();
        assert_eq!(raw.reply().await, (0, 1));
        assert!(raw.read_exact(4096).await.iter().all(|&b| b == 0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_each_answered_once() {
    within(async {
        let disk = Held::new(8 * MIB);
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        // 256 requests, every fourth one held: writes, then reads of what they wrote.
        let place = |i: u64| if i % 4 == 0 { 8 * MIB } else { 0 } + i * 8192;
        let mut b = Vec::new();
        for i in 0..128u64 {
            b.extend_from_slice(&req(CMD_WRITE, 0, i, place(i), 4096).encode());
            b.extend_from_slice(&pattern(i as u8, place(i), 4096));
        }
        for i in 0..128u64 {
            b.extend_from_slice(&req(CMD_READ, 0, 1000 + i, place(i) + 4096, 4096).encode());
        }
        raw.send(&b).await;
        let mut answered = HashSet::new();
        // 192 are answered while 64 wait in the device.
        for _ in 0..192 {
            let (errno, cookie) = raw.reply().await;
            assert_eq!(errno, 0);
            let i = cookie % 1000;
            assert!(i % 4 != 0, "a held request ({cookie}) was answered");
            if cookie >= 1000 {
                raw.read_exact(4096).await;
            }
            assert!(answered.insert(cookie), "cookie {cookie} answered twice");
        }
        disk.started(256).await;
        disk.release();
        for _ in 0..64 {
            let (errno, cookie) = raw.reply().await;
            assert_eq!(errno, 0);
            assert_eq!(cookie % 4, 0);
            if cookie >= 1000 {
                raw.read_exact(4096).await;
            }
            assert!(answered.insert(cookie), "cookie {cookie} answered twice");
        }
        let all: HashSet<u64> = (0..128).chain(1000..1128).collect();
        assert_eq!(answered, all);
        for i in 0..128u64 {
            let got = disk.read(place(i), 4096).await.unwrap();
            assert!(got == pattern(i as u8, place(i), 4096), "write {i}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_connections_each_write_and_verify_their_region() {
    within(async {
        let disk = mem();
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let region = SIZE / 16;
        let mut tasks = Vec::new();
        for n in 0..16u64 {
            let addr = srv.addr.clone();
            tasks.push(tokio::spawn(async move {
                let c = Arc::new(Client::connect_tcp(&addr, "vol0").await.unwrap());
                let base = n * region;
                let chunk = 64 << 10;
                let writes = (0..region / chunk).map(|k| {
                    let c = c.clone();
                    async move {
                        let off = base + k * chunk;
                        let data = pattern(n as u8, off, chunk as usize);
                        c.write(off, &data, k % 7 == 0).await.unwrap();
                    }
                });
                futures_util::future::join_all(writes).await;
                c.flush().await.unwrap();
                for k in 0..region / chunk {
                    let off = base + k * chunk;
                    let got = c.read(off, chunk as u32).await.unwrap();
                    assert!(got == pattern(n as u8, off, chunk as usize), "conn {n}");
                }
                match Arc::try_unwrap(c) {
                    Ok(c) => c.disconnect().await.unwrap(),
                    Err(_) => panic!("client still shared"),
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for n in 0..16u64 {
            let off = n * region + region - 4096;
            assert!(disk.read(off, 4096).await.unwrap() == pattern(n as u8, off, 4096));
        }
        srv.settle().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_serves_too() {
    within(async {
        let dir = tempdir();
        let path = dir.path().join("vol0.sock");
        let server = Server::new(vec![Export::new("vol0", mem())]).unwrap();
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let s = server.clone();
        let serving = tokio::spawn(async move { s.serve_unix(listener).await });
        let c = Client::connect_unix(&path, "").await.unwrap();
        let data = pattern(6, 4096, 8192);
        c.write(4096, &data, true).await.unwrap();
        c.flush().await.unwrap();
        assert!(c.read(4096, 8192).await.unwrap() == data);
        c.disconnect().await.unwrap();
        server.shutdown();
        server.wait_idle().await;
        serving.await.unwrap().unwrap();
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Negotiation
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_then_go_on_one_connection() {
    within(async {
        let srv = serve(vec![
            Export::new("vol0", mem()).with_description("the first disk"),
            Export::new("ro", mem()).read_only(true),
        ])
        .await;
        let mut raw = Raw::negotiating(&srv.addr, FLAG_C_FIXED_NEWSTYLE).await;
        let infos = [INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE];
        let r = raw.info_replies(OPT_INFO, b"vol0", &infos).await;
        assert_eq!(r.last().unwrap().kind, REP_ACK);
        assert_eq!(export_info(&r), Some((SIZE, RW_FLAGS)));
        assert_eq!(info_item(&r, INFO_NAME), Some(&b"vol0"[..]));
        assert_eq!(
            info_item(&r, INFO_DESCRIPTION),
            Some(&b"the first disk"[..])
        );
        let mut bs = Vec::new();
        for v in [BS as u32, 4096, MAX_IO] {
            bs.extend_from_slice(&v.to_be_bytes());
        }
        assert_eq!(info_item(&r, INFO_BLOCK_SIZE), Some(&bs[..]));
        // INFO on another export, then INFO without requests: still only INFO + ACK.
        let r = raw.info_replies(OPT_INFO, b"ro", &[]).await;
        assert_eq!(r.last().unwrap().kind, REP_ACK);
        assert_eq!(export_info(&r), Some((SIZE, RW_FLAGS | TFLAG_READ_ONLY)));
        assert_eq!(info_item(&r, INFO_NAME), None, "not asked for");
        // INFO did not end negotiation: GO does, and transmission works.
        let (size, flags) = raw.go("vol0").await;
        assert_eq!((size, flags), (SIZE, RW_FLAGS));
        raw.write(0, 1, 0, &pattern(1, 0, 4096)).await;
        assert_eq!(raw.reply().await, (0, 1));
        raw.request(CMD_READ, 0, 2, 0, 4096).await;
        assert_eq!(raw.reply().await, (0, 2));
        assert!(raw.read_exact(4096).await == pattern(1, 0, 4096));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_list_lists_every_export() {
    within(async {
        let srv = serve(vec![
            Export::new("vol0", mem()).with_description("first"),
            Export::new("vol1", mem()),
            Export::new("archive", mem()).read_only(true),
        ])
        .await;
        let mut raw = Raw::negotiating(&srv.addr, FLAG_C_FIXED_NEWSTYLE).await;
        raw.option(OPT_LIST, &[]).await;
        let mut listed = Vec::new();
        loop {
            let r = raw.option_reply().await;
            assert_eq!(r.opt, OPT_LIST);
            if r.kind == REP_ACK {
                assert!(r.data.is_empty());
                break;
            }
            assert_eq!(r.kind, REP_SERVER);
            let n = u32::from_be_bytes(r.data[0..4].try_into().unwrap()) as usize;
            assert!(n + 4 <= r.data.len());
            let name = String::from_utf8(r.data[4..4 + n].to_vec()).unwrap();
            let desc = String::from_utf8(r.data[4 + n..].to_vec()).unwrap();
            listed.push((name, desc));
        }
        let want = [("vol0", "first"), ("vol1", ""), ("archive", "")];
        assert_eq!(
            listed,
            want.map(|(n, d)| (n.to_string(), d.to_string())).to_vec()
        );
        // LIST does not end negotiation.
        raw.go("vol1").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_export_name_selects_the_only_export() {
    within(async {
        let disk = mem();
        let one = serve(vec![Export::new("vol0", disk.clone())]).await;
        let c = Client::connect_tcp(&one.addr, "").await.unwrap();
        c.write(0, &pattern(3, 0, 4096), false).await.unwrap();
        assert!(disk.read(0, 4096).await.unwrap() == pattern(3, 0, 4096));
        c.disconnect().await.unwrap();
        // EXPORT_NAME "" works as well.
        let mut raw = Raw::negotiating(&one.addr, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
        raw.option(OPT_EXPORT_NAME, b"").await;
        let info = raw.read_exact(10).await;
        assert_eq!(u64::from_be_bytes(info[0..8].try_into().unwrap()), SIZE);

        let two = serve(vec![Export::new("vol0", mem()), Export::new("vol1", mem())]).await;
        let err = Client::connect_tcp(&two.addr, "").await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NotFound);
        let mut raw = Raw::negotiating(&two.addr, FLAG_C_FIXED_NEWSTYLE).await;
        let r = raw.info_replies(OPT_GO, b"", &[]).await;
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].kind, REP_ERR_UNKNOWN);
        raw.go("vol1").await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_sends_124_zeroes_unless_no_zeroes() {
    within(async {
        let disk = mem();
        disk.write(0, Bytes::from(pattern(8, 0, 4096)), IoFlags::empty())
            .await
            .unwrap();
        let srv = serve(vec![Export::new("vol0", disk)]).await;
        for (flags, zeroes) in [
            (FLAG_C_FIXED_NEWSTYLE, true),
            (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES, false),
            // Plain (not fixed) newstyle still knows EXPORT_NAME.
            (0, true),
            (FLAG_C_NO_ZEROES, false),
        ] {
            let mut raw = Raw::negotiating(&srv.addr, flags).await;
            raw.option(OPT_EXPORT_NAME, b"vol0").await;
            let info = raw.read_exact(10).await;
            assert_eq!(u64::from_be_bytes(info[0..8].try_into().unwrap()), SIZE);
            assert_eq!(u16::from_be_bytes([info[8], info[9]]), RW_FLAGS);
            if zeroes {
                assert_eq!(raw.read_exact(124).await, vec![0u8; 124]);
            }
            // The next bytes are the reply to this read: nothing else came in between.
            raw.request(CMD_READ, 0, 77, 0, 4096).await;
            assert_eq!(raw.reply().await, (0, 77), "client flags {flags:#x}");
            assert!(raw.read_exact(4096).await == pattern(8, 0, 4096));
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_sizes_are_reported() {
    within(async {
        let big_blocks = Arc::new(MemDevice::new(Geometry::new(SIZE, 4096).unwrap()));
        let srv = serve(vec![
            Export::new("small", mem()),
            Export::new("big", big_blocks),
        ])
        .await;
        let c = Client::connect_tcp(&srv.addr, "small").await.unwrap();
        let i = c.info();
        assert_eq!(
            (i.min_block, i.preferred_block, i.max_block),
            (512, 4096, MAX_IO)
        );
        let c = Client::connect_tcp(&srv.addr, "big").await.unwrap();
        let i = c.info();
        assert_eq!(
            (i.min_block, i.preferred_block, i.max_block),
            (4096, 4096, 32 << 20)
        );
        // Requests below the minimum block size are refused, at it accepted.
        assert_eq!(
            c.write(0, &[1; 512], false).await.unwrap_err().kind(),
            ErrorKind::InvalidArgument
        );
        c.write(0, &[1; 4096], false).await.unwrap();
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Durability across connections
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_on_one_connection_persists_writes_replied_on_another() {
    within(async {
        let disk = Arc::new(FaultyDevice::new(MemDevice::new(geometry())));
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let a = Client::connect_tcp(&srv.addr, "vol0").await.unwrap();
        let b = Client::connect_tcp(&srv.addr, "vol0").await.unwrap();
        assert_ne!(a.info().flags & TFLAG_CAN_MULTI_CONN, 0);

        // Written on A (reply received), flushed on B: durable.
        let flushed = pattern(1, 0, 64 << 10);
        a.write(0, &flushed, false).await.unwrap();
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        for (off, cookie) in [(3 * MIB, 1), (4 * MIB, 2)] {
            raw.write(0, cookie, off, &pattern(4, off, 4096)).await;
            assert_eq!(raw.reply().await, (0, cookie));
        }
        b.flush().await.unwrap();
        // Written after the last flush and never flushed: a power cut may (with
        // DropUnflushed: does) lose it.
        let lost = pattern(2, MIB, 64 << 10);
        a.write(MIB, &lost, false).await.unwrap();
        // FUA: durable on its own.
        let fua = pattern(3, 2 * MIB, 64 << 10);
        a.write(2 * MIB, &fua, true).await.unwrap();
        // WRITE_ZEROES with FUA over flushed data is durable; without FUA it is not.
        raw.request(CMD_WRITE_ZEROES, CMD_FLAG_FUA, 3, 3 * MIB, 4096)
            .await;
        assert_eq!(raw.reply().await, (0, 3));
        raw.request(CMD_WRITE_ZEROES, 0, 4, 4 * MIB, 4096).await;
        assert_eq!(raw.reply().await, (0, 4));
        // Before the cut every connection sees every write.
        assert!(b.read(MIB, 64 << 10).await.unwrap() == lost);

        disk.power_cut(PowerCut::DropUnflushed).await.unwrap();
        assert!(disk.read(0, 64 << 10).await.unwrap() == flushed);
        assert!(disk.read(2 * MIB, 64 << 10).await.unwrap() == fua);
        assert!(
            disk.read(MIB, 64 << 10)
                .await
                .unwrap()
                .iter()
                .all(|&x| x == 0),
            "an unflushed write survived the power cut: this test could not fail"
        );
        assert!(
            disk.read(3 * MIB, 4096)
                .await
                .unwrap()
                .iter()
                .all(|&x| x == 0)
        );
        assert!(disk.read(4 * MIB, 4096).await.unwrap() == pattern(4, 4 * MIB, 4096));
        // And the clients read the same after the "reboot".
        assert!(a.read(0, 64 << 10).await.unwrap() == flushed);
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_requests_in_flight_then_closes() {
    within(async {
        let disk = Held::new(0);
        let mut srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        let idle = Client::connect_tcp(&srv.addr, "vol0").await.unwrap();
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        let mut b = Vec::new();
        for i in 0..32u64 {
            b.extend_from_slice(&req(CMD_WRITE, 0, i, i * 4096, 4096).encode());
            b.extend_from_slice(&pattern(i as u8, i * 4096, 4096));
        }
        for i in 0..8u64 {
            b.extend_from_slice(&req(CMD_READ, 0, 100 + i, MIB + i * 4096, 4096).encode());
        }
        raw.send(&b).await;
        disk.started(40).await;
        srv.server.shutdown();
        // Nothing is answered until the device lets go; then everything is.
        disk.release();
        let mut answered = HashSet::new();
        for _ in 0..40 {
            let (errno, cookie) = raw.reply().await;
            assert_eq!(errno, 0, "request {cookie}");
            if cookie >= 100 {
                assert!(raw.read_exact(4096).await.iter().all(|&x| x == 0));
            }
            assert!(answered.insert(cookie));
        }
        assert_eq!(raw.expect_eof().await, b"", "then the connection closes");
        // The idle client was closed too.
        assert_eq!(
            idle.read(0, 4096).await.unwrap_err().kind(),
            ErrorKind::Closed
        );
        // Clients close their end on seeing the server's; then the server is idle.
        drop(raw);
        drop(idle);
        tokio::time::timeout(IO_TIMEOUT, srv.server.wait_idle())
            .await
            .expect("wait_idle did not return after shutdown");
        assert_eq!(srv.server.open_connections(), 0);
        for i in 0..32u64 {
            assert!(disk.read(i * 4096, 4096).await.unwrap() == pattern(i as u8, i * 4096, 4096));
        }
        // The listener is gone.
        let stopped = tokio::time::timeout(IO_TIMEOUT, &mut srv.serving)
            .await
            .expect("the accept loop did not stop");
        stopped.unwrap().unwrap();
        assert!(Client::connect_tcp(&srv.addr, "vol0").await.is_err());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_more_requests_queued_answers_those_it_took_cleanly() {
    // The server stops reading at shutdown, so requests the client already sent may be
    // left unread in the socket. The replies to the requests it did take must all arrive,
    // followed by an orderly close: closing a socket with unread input sends a reset,
    // which throws away replies not yet delivered and fails the client's next read.
    const READS: u64 = 16;
    const RCVBUF: u32 = 4096;
    within(async {
        let disk = Held::new(0);
        let srv = serve(vec![Export::new("vol0", disk.clone())]).await;
        // A small receive buffer: most replies wait in the server's send buffer.
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(RCVBUF).unwrap();
        let stream = sock.connect(srv.addr.parse().unwrap()).await.unwrap();
        let mut raw = Raw::greeted(stream).await;
        raw.flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
        raw.go("vol0").await;
        let mut b = Vec::new();
        for i in 0..512u64 {
            if i < READS {
                b.extend_from_slice(&req(CMD_READ, 0, i, i * 4096, 4096).encode());
            } else {
                b.extend_from_slice(&req(CMD_WRITE, 0, i, i * 4096, 512).encode());
                b.extend_from_slice(&pattern(i as u8, i * 4096, 512));
            }
        }
        raw.send(&b).await;
        // 512 in flight: the server reads no further, so these stay in the socket.
        disk.started(512).await;
        let mut more = Vec::new();
        for i in 512..640u64 {
            more.extend_from_slice(&req(CMD_READ, 0, i, 0, 4096).encode());
        }
        raw.send(&more).await;
        srv.server.shutdown();
        disk.release();
        // The replies fit in the socket buffers, so the server can finish without us
        // reading. Give it a moment to do so before reading: a server that
        // closes hard has then reset the connection; one that closes in order waits for
        // us (this bounded wait is not synchronisation, just room for the bad case).
        let deadline = tokio::time::Instant::now() + Duration::from_millis(500);
        while srv.server.open_connections() != 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let got = raw.expect_eof().await;
        let mut answered = HashSet::new();
        let mut pos = 0;
        while pos < got.len() {
            let r = got
                .get(pos..pos + SIMPLE_REPLY_LEN)
                .expect("a reply cut short");
            let (magic, errno, cookie) = simple_reply_fields(r);
            assert_eq!(magic, SIMPLE_REPLY_MAGIC);
            assert!(
                cookie < 512,
                "request {cookie} was never read, yet answered"
            );
            assert_eq!(errno, 0, "request {cookie}");
            assert!(answered.insert(cookie));
            pos += SIMPLE_REPLY_LEN;
            if cookie < READS {
                let data = got.get(pos..pos + 4096).expect("read data cut short");
                assert!(data.iter().all(|&x| x == 0));
                pos += 4096;
            }
        }
        assert_eq!(answered.len(), 512, "every request taken is answered");
        drop(raw);
        tokio::time::timeout(IO_TIMEOUT, srv.server.wait_idle())
            .await
            .expect("wait_idle did not return after shutdown");
        for i in READS..512u64 {
            let got = disk.read(i * 4096, 512).await.unwrap();
            assert!(got == pattern(i as u8, i * 4096, 512));
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_a_client_idle_in_negotiation() {
    within(async {
        let srv = serve(vec![Export::new("vol0", mem())]).await;
        // Greeted, then silent: a client that hung, or one that never meant to speak.
        let mut raw = Raw::connect(&srv.addr).await;
        srv.server.shutdown();
        assert!(
            tokio::time::timeout(IO_TIMEOUT, srv.server.wait_idle())
                .await
                .is_ok(),
            "wait_idle waited on a connection that never finished negotiating"
        );
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(IO_TIMEOUT, raw.s.read(&mut b)).await;
        assert!(
            matches!(r, Ok(Ok(0)) | Ok(Err(_))),
            "the connection was not closed"
        );
    })
    .await;
}

/// After shutdown a client may not attach: GO gets `NBD_REP_ERR_SHUTDOWN`, or the server
/// closes the connection (before or after the greeting). Never a successful GO.
async fn cannot_attach_after_shutdown<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    flags_sent: bool,
) {
    let mut greeting = [0u8; 18];
    if !flags_sent {
        match tokio::time::timeout(IO_TIMEOUT, s.read_exact(&mut greeting)).await {
            Err(_) => panic!("no greeting and no close after shutdown"),
            Ok(Err(_)) => return, // closed at once
            Ok(Ok(_)) => {}
        }
        if s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
    let data = go_data(b"vol0", &[]);
    let go = option_frame(IHAVEOPT, OPT_GO, data.len() as u32, &data);
    if s.write_all(&go).await.is_err() {
        return;
    }
    let mut b = [0u8; 20];
    match tokio::time::timeout(IO_TIMEOUT, s.read_exact(&mut b)).await {
        Err(_) => panic!("no answer to GO after shutdown"),
        Ok(Err(e)) if matches!(e.kind(), IoKind::UnexpectedEof | IoKind::ConnectionReset) => {}
        Ok(Err(e)) => panic!("socket error: {e}"),
        Ok(Ok(_)) => {
            let kind = u32::from_be_bytes(b[12..16].try_into().unwrap());
            assert_eq!(
                kind, REP_ERR_SHUTDOWN,
                "GO after shutdown got reply type {kind:#x}, not ERR_SHUTDOWN"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_after_shutdown_get_err_shutdown() {
    within(async {
        let srv = serve(vec![Export::new("vol0", mem())]).await;
        // A connection accepted before the shutdown, negotiating after it.
        let raw = Raw::negotiating(&srv.addr, FLAG_C_FIXED_NEWSTYLE).await;
        srv.server.shutdown();
        cannot_attach_after_shutdown(raw.s, true).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_served_after_shutdown_cannot_attach() {
    within(async {
        let srv = serve(vec![Export::new("vol0", mem())]).await;
        srv.server.shutdown();
        let (ours, theirs) = tokio::io::duplex(64 << 10);
        srv.server.spawn_connection(theirs, "duplex".into());
        cannot_attach_after_shutdown(ours, false).await;
        tokio::time::timeout(IO_TIMEOUT, srv.server.wait_idle())
            .await
            .expect("wait_idle did not return after shutdown");
    })
    .await;
}

/// Requests that arrive together start together: every one of 100 writes sent in one
/// burst reaches the device under the connection's plug (so a mirror sends them to its
/// peer in batches, not one by one), also those the server keeps in its in-flight set
/// beyond the 61 futures a `futures_buffered` set polls before it yields (the server
/// polls each request once, under the plug, before the set holds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_arrive_together_start_under_one_plug() {
    within(async {
        let probe = common::PlugProbe::new();
        let srv = serve(vec![Export::new("vol0", probe.clone())]).await;
        let mut raw = Raw::attach(&srv.addr, "vol0").await;
        const N: u64 = 100;
        let mut b = Vec::new();
        for i in 0..N {
            b.extend_from_slice(&req(CMD_WRITE, 0, i, i * 4096, 4096).encode());
            b.extend_from_slice(&pattern(i as u8, i * 4096, 4096));
        }
        raw.send(&b).await;
        for _ in 0..N {
            let (errno, _) = raw.reply().await;
            assert_eq!(errno, 0);
        }
        for i in 0..N {
            let got = probe.read(i * 4096, 4096).await.unwrap();
            assert!(got == pattern(i as u8, i * 4096, 4096), "write {i}");
        }
        let st = probe.state.lock().unwrap();
        assert_eq!(
            (st.plugged, st.unplugged),
            (N, 0),
            "every write of the burst started under a plug"
        );
        assert!(st.batches >= 1, "the burst went through an unplug");
    })
    .await;
}
