//! The NBD server against hostile and broken clients.
//!
//! Every case talks raw bytes over loopback TCP, then checks what a user of the server
//! cares about: the hostile client got the documented answer (an error reply, or its own
//! connection closed and nothing else), no byte on the disk changed that should not have,
//! a well-behaved client attached *before* the attack kept reading back what it wrote
//! during and after it, a client connecting afterwards can write, flush and read, and the
//! server let go of every connection in the end.
//!
//! Layout of the `vol0` export used by most cases:
//!
//! ```text
//!   0 ........ 4 MiB   hostile requests aim here; pre-filled, compared afterwards
//!   8 MiB .... 9 MiB   the bystander client's region
//!   12 MiB .. 13 MiB   the fresh client's region
//!   15 MiB .. 16 MiB   pre-filled; out-of-range requests must not touch it
//! ```
//!
//! `scratch` (a second MemDevice) takes the fuzzing, `slow` (a FaultyDevice with latency)
//! keeps requests in flight for the cases that need them there.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{
    BS, IO_TIMEOUT, MAX_IO, MIB, Raw, SIZE, Served, fill_range, geometry, go_data, is_disconnect,
    mem, option_frame, pattern, read_range, req, serve, simple_reply_fields,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use vsan_core::export::nbd::proto::*;
use vsan_core::export::nbd::{Client, Export};
use vsan_core::{BlockDevice, FaultyDevice, MemDevice};

const HOSTILE: u64 = 0;
const HOSTILE_LEN: u64 = 4 * MIB;
const BYSTANDER: u64 = 8 * MIB;
const FRESH: u64 = 12 * MIB;
const TAIL: u64 = SIZE - MIB;
/// The deadline of a whole test.
const TEST_TIMEOUT: Duration = Duration::from_secs(25);
/// Largest write the server buffers (mirrors the server's documented limit).
const MAX_WRITE_PAYLOAD: u32 = 64 << 20;

/// Run a test body within [`TEST_TIMEOUT`].
async fn within<T>(body: impl Future<Output = T>) -> T {
    common::within(TEST_TIMEOUT, body).await
}

/// A small deterministic generator (SplitMix64), so fuzz runs are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
    /// Fewer than `max` random bytes.
    fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max);
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The server of every case, with `vol0` at hand; derefs to the [`Served`] server.
struct Harness {
    srv: Served,
    vol0: Arc<MemDevice>,
}

impl Harness {
    /// A server on 127.0.0.1:0 with `vol0`, `scratch` and `slow`; `vol0` pre-filled
    /// where hostile requests aim.
    async fn start() -> Harness {
        let vol0 = mem();
        let slow = Arc::new(FaultyDevice::new(MemDevice::new(geometry())));
        slow.set_latency(Duration::from_millis(30));
        for (off, len) in [(HOSTILE, HOSTILE_LEN), (TAIL, MIB)] {
            fill_range(&*vol0, 0xa0, off, len).await;
        }
        let srv = serve(vec![
            Export::new("vol0", vol0.clone()),
            Export::new("scratch", mem()),
            Export::new("slow", slow),
        ])
        .await;
        Harness { srv, vol0 }
    }

    /// `[offset, offset + len)` of `vol0` still holds what `start` put there.
    async fn assert_untouched(&self, offset: u64, len: u64) {
        let got = read_range(&*self.vol0, offset, len).await;
        let want = pattern(0xa0, offset, len as usize);
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            panic!(
                "vol0 changed at byte {} (read {:#x}, expected {:#x})",
                offset + i as u64,
                got[i],
                want[i]
            );
        }
    }

    /// The end of a case whose requests were refused: `raw` is still in step, and the
    /// first 3 MiB of the hostile region are as they were once it is gone.
    async fn refused_cleanly(&self, mut raw: Raw) {
        raw.still_in_step(HOSTILE + 3 * MIB).await;
        drop(raw);
        self.assert_untouched(HOSTILE, 3 * MIB).await;
    }

    /// Attach a well-behaved client and start it writing and verifying its own region in
    /// a loop, before anything hostile happens.
    async fn bystander(&self) -> Bystander {
        let client = Client::connect_tcp(&self.addr, "vol0").await.unwrap();
        let (rounds_tx, rounds) = watch::channel(0u64);
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let task = tokio::spawn(async move {
            let mut round = 0u64;
            while !stop2.load(Ordering::Relaxed) {
                let off = BYSTANDER + (round % 16) * (64 << 10);
                let data = pattern(round as u8, off, 64 << 10);
                client.write(off, &data, round % 5 == 0).await.unwrap();
                let back = client.read(off, data.len() as u32).await.unwrap();
                assert!(back == data, "bystander read back wrong data");
                if round % 4 == 3 {
                    client.flush().await.unwrap();
                }
                round += 1;
                rounds_tx.send_replace(round);
            }
            client
        });
        // Attached and working before the hostile client shows up.
        let mut r = rounds.clone();
        r.wait_for(|&n| n >= 1).await.unwrap();
        Bystander { rounds, stop, task }
    }

    /// The end of every hostile case: the bystander kept working and still works, a new
    /// client can write, flush and read on `vol0` and `scratch`, the pre-filled tail is
    /// intact, and every connection (the hostile one included) is gone at the end.
    async fn survives(&self, bystander: Bystander) {
        bystander.finish().await;
        fresh_client_works(&self.addr, "vol0", FRESH).await;
        fresh_client_works(&self.addr, "scratch", FRESH).await;
        self.assert_untouched(TAIL, MIB).await;
        self.settle().await;
        assert!(!self.serving.is_finished(), "the accept loop ended");
    }
}

impl Deref for Harness {
    type Target = Served;

    fn deref(&self) -> &Served {
        &self.srv
    }
}

/// One hostile case: a fresh [`Harness`] with a bystander at work before `attack` runs,
/// then everything [`Harness::survives`] checks.
async fn hostile_case(attack: impl AsyncFnOnce(&Harness)) {
    within(async {
        let h = Harness::start().await;
        let by = h.bystander().await;
        attack(&h).await;
        h.survives(by).await;
    })
    .await;
}

struct Bystander {
    rounds: watch::Receiver<u64>,
    stop: Arc<AtomicBool>,
    task: JoinHandle<Client>,
}

impl Bystander {
    /// Let it do two more full rounds (it works *after* the attack), stop it, check it
    /// never failed, and disconnect it cleanly.
    async fn finish(mut self) {
        let now = *self.rounds.borrow();
        if self.rounds.wait_for(|&n| n >= now + 2).await.is_err() {
            // The task ended early: it panicked; the join below reports why.
        }
        self.stop.store(true, Ordering::Relaxed);
        let client = match self.task.await {
            Ok(c) => c,
            Err(e) => panic!("the bystander client failed: {e}"),
        };
        client.flush().await.unwrap();
        client.disconnect().await.unwrap();
    }
}

async fn fresh_client_works(addr: &str, export: &str, offset: u64) {
    let c = Client::connect_tcp(addr, export).await.unwrap();
    let data = pattern(0x5a, offset, 128 << 10);
    c.write(offset, &data, false).await.unwrap();
    c.write(offset + MIB / 2, &data, true).await.unwrap();
    c.flush().await.unwrap();
    assert!(c.read(offset, data.len() as u32).await.unwrap() == data);
    assert!(c.read(offset + MIB / 2, data.len() as u32).await.unwrap() == data);
    c.disconnect().await.unwrap();
}

/// After the refusals negotiation goes on: `raw` attaches to `vol0` and works.
async fn attaches_after_all(mut raw: Raw) {
    raw.go("vol0").await;
    raw.still_in_step(HOSTILE).await;
}

/// Send each of `cases` (a request, and how many bytes of payload follow it) and expect
/// EINVAL for every one.
async fn expect_einval_each(raw: &mut Raw, cases: &[(Request, usize)]) {
    let junk = vec![0xee; 4096];
    for &(r, payload) in cases {
        raw.expect_errno(r, &junk[..payload], EINVAL).await;
    }
}

/// `n` reads of `MAX_IO` bytes in one buffer, cookie `i` reading at `(i % 16)` MiB.
fn max_io_reads(n: u64) -> Vec<u8> {
    (0..n)
        .flat_map(|i| req(CMD_READ, 0, i, (i % 16) * MIB, MAX_IO).encode())
        .collect()
}

// ---------------------------------------------------------------------------------------
// Negotiation
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_client_flags_closes_that_connection() {
    hostile_case(async |h| {
        let mut raw = Raw::connect(&h.addr).await;
        raw.send(b"GET / HTTP/1.1\r\nHost: vsan\r\n\r\n").await;
        assert_eq!(raw.expect_closed().await, b"");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_client_flags_close_that_connection() {
    hostile_case(async |h| {
        for flags in [FLAG_C_FIXED_NEWSTYLE | 1 << 2, 1 << 31, u32::MAX] {
            let mut raw = Raw::negotiating(&h.addr, flags).await;
            assert_eq!(raw.expect_closed().await, b"", "client flags {flags:#x}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_option_magic_closes_that_connection() {
    hostile_case(async |h| {
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        let bad_magic = u64::from_be_bytes(*b"IHAVEOPX");
        raw.send(&option_frame(bad_magic, OPT_LIST, 0, &[])).await;
        assert_eq!(raw.expect_closed().await, b"");
        // The same after a good option: the check is on every option, not just the first.
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        raw.option(OPT_LIST, &[]).await;
        let mut replies = 0;
        loop {
            let r = raw.option_reply().await;
            replies += 1;
            if r.kind == REP_ACK {
                break;
            }
        }
        assert_eq!(replies, 4, "three exports and an ACK");
        raw.send(&[0u8; 16]).await;
        assert_eq!(raw.expect_closed().await, b"");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn option_with_absurd_length_closes_without_reading_it() {
    hostile_case(async |h| {
        for len in [u32::MAX, (1 << 20) + 1] {
            let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
            // Only the header: a server that tried to read `len` bytes would hang here.
            raw.send(&option_frame(IHAVEOPT, OPT_GO, len, &[])).await;
            assert_eq!(raw.expect_closed().await, b"", "option length {len}");
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn option_over_16k_gets_too_big_and_negotiation_continues() {
    hostile_case(async |h| {
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
        // Just over the limit, and the largest the server still reads and skips.
        raw.option_expect(OPT_LIST, &vec![7u8; (16 << 10) + 1], REP_ERR_TOO_BIG)
            .await;
        raw.option_expect(OPT_GO, &vec![0u8; 1 << 20], REP_ERR_TOO_BIG)
            .await;
        // At the limit the option is parsed as usual (LIST takes no data: INVALID).
        raw.option_expect(OPT_LIST, &vec![7u8; 16 << 10], REP_ERR_INVALID)
            .await;
        let (size, _) = raw.go("vol0").await;
        assert_eq!(size, SIZE);
        raw.still_in_step(HOSTILE).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_list_with_data_is_invalid() {
    hostile_case(async |h| {
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        raw.option_expect(OPT_LIST, b"vol0", REP_ERR_INVALID).await;
        raw.option_expect(OPT_LIST, &[0], REP_ERR_INVALID).await;
        attaches_after_all(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_info_and_go_lengths_are_invalid() {
    hostile_case(async |h| {
        let good = go_data(b"vol0", &[INFO_BLOCK_SIZE]);
        let mut cases: Vec<(&str, Vec<u8>)> = vec![
            ("no data", vec![]),
            ("shorter than a name length", vec![0, 0, 4]),
            ("name length past the end", {
                let mut d = 5u32.to_be_bytes().to_vec();
                d.extend_from_slice(b"vol0");
                d
            }),
            ("name length u32::MAX", {
                let mut d = u32::MAX.to_be_bytes().to_vec();
                d.extend_from_slice(b"vol0\0\0");
                d
            }),
            ("no request count", good[..8].to_vec()),
            ("half a request count", good[..9].to_vec()),
            ("count says 2, one given", {
                let mut d = go_data(b"vol0", &[INFO_BLOCK_SIZE]);
                d[9] = 2;
                d
            }),
            ("count says 0, one given", {
                let mut d = go_data(b"vol0", &[INFO_BLOCK_SIZE]);
                d[9] = 0;
                d
            }),
            ("half an info request", good[..good.len() - 1].to_vec()),
            ("a trailing byte", {
                let mut d = good.clone();
                d.push(0);
                d
            }),
            ("name not UTF-8", go_data(&[0xff, 0xfe, 0x80], &[])),
        ];
        cases.push(("count 0xffff, nothing after", {
            let mut d = go_data(b"vol0", &[]);
            d[8] = 0xff;
            d[9] = 0xff;
            d
        }));
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        for opt in [OPT_INFO, OPT_GO] {
            for (what, data) in &cases {
                raw.option(opt, data).await;
                let r = raw.option_reply().await;
                assert_eq!(
                    (r.opt, r.kind),
                    (opt, REP_ERR_INVALID),
                    "option {opt}, {what}: {r:?}"
                );
            }
        }
        attaches_after_all(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_and_go_for_unknown_export_get_err_unknown() {
    hostile_case(async |h| {
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        for name in [&b"nope"[..], b"VOL0", b"vol0\0", b"vol", b""] {
            raw.option_expect(OPT_INFO, &go_data(name, &[]), REP_ERR_UNKNOWN)
                .await;
            raw.option_expect(OPT_GO, &go_data(name, &[]), REP_ERR_UNKNOWN)
                .await;
        }
        attaches_after_all(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_for_unknown_export_closes_that_connection() {
    hostile_case(async |h| {
        // "" is ambiguous with three exports; the others do not exist.
        for name in [&b"nope"[..], b"", &[0xff, 0xfe]] {
            for flags in [
                FLAG_C_FIXED_NEWSTYLE,
                FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES,
            ] {
                let mut raw = Raw::negotiating(&h.addr, flags).await;
                raw.option(OPT_EXPORT_NAME, name).await;
                assert_eq!(raw.expect_closed().await, b"", "EXPORT_NAME {name:?}");
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_options_get_unsup_and_go_still_works() {
    hostile_case(async |h| {
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        let mut meta = go_data(b"vol0", &[]);
        meta.truncate(8);
        meta.extend_from_slice(&1u32.to_be_bytes());
        meta.extend_from_slice(&15u32.to_be_bytes());
        meta.extend_from_slice(b"base:allocation");
        let cases: Vec<(u32, Vec<u8>)> = vec![
            (5, vec![]),        // STARTTLS
            (8, vec![]),        // STRUCTURED_REPLY
            (4, vec![]),        // PEEK_EXPORT
            (9, vec![1, 2, 3]), // BLOCK_SIZE
            (10, meta.clone()), // LIST_META_CONTEXT
            (11, meta),         // SET_META_CONTEXT
            (12, vec![]),       // EXTENDED_HEADERS
            (0, vec![]),
            (0xdead_beef, vec![0xaa; 300]),
        ];
        for (opt, data) in &cases {
            raw.option_expect(*opt, data, REP_ERR_UNSUP).await;
        }
        // The session is unchanged: simple replies, no TLS.
        attaches_after_all(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opt_abort_is_acked_then_closed() {
    hostile_case(async |h| {
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        raw.option_expect(OPT_ABORT, &[], REP_ACK).await;
        assert_eq!(raw.expect_closed().await, b"");
        // A client that sends ABORT and leaves at once does no harm either.
        let mut raw = Raw::negotiating(&h.addr, FLAG_C_FIXED_NEWSTYLE).await;
        raw.option(OPT_ABORT, &[]).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Transmission
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_magic_closes_that_connection() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        raw.still_in_step(HOSTILE).await;
        let mut head = req(CMD_WRITE, 0, 7, HOSTILE + 8192, 512).encode();
        head[3] ^= 1;
        let mut b = head.to_vec();
        b.extend_from_slice(&[0xee; 512]);
        raw.send(&b).await;
        assert_eq!(raw.expect_closed().await, b"");
        drop(raw);
        h.assert_untouched(HOSTILE + 8192, 512).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_header_then_close_gets_no_reply() {
    hostile_case(async |h| {
        for cut in [1, 10, REQUEST_LEN - 1] {
            let mut raw = Raw::attach(&h.addr, "vol0").await;
            let head = req(CMD_WRITE, 0, 1, HOSTILE, 0).encode();
            raw.send(&head[..cut]).await;
            raw.close_write().await;
            assert_eq!(raw.expect_closed().await, b"", "header cut at {cut}");
        }
        h.assert_untouched(HOSTILE, HOSTILE_LEN).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_write_payload_then_close_writes_nothing() {
    hostile_case(async |h| {
        for (len, sent) in [
            (4096u32, 100usize),
            (4096, 4095),
            (512, 0),
            (1 << 20, 65536),
        ] {
            let mut raw = Raw::attach(&h.addr, "vol0").await;
            // A complete write first, on other blocks: it must be answered and land.
            let done = pattern(0x11, HOSTILE + 2 * MIB, 4096);
            raw.write(0, 1, HOSTILE + 2 * MIB, &done).await;
            let short = req(CMD_WRITE, 0, 2, HOSTILE + 64 * 1024, len);
            raw.request_with(short, &vec![0xee; sent]).await;
            raw.close_write().await;
            let got = raw.expect_closed().await;
            assert_eq!(
                got,
                simple_reply(0, 1),
                "only the complete write is answered"
            );
            assert!(h.vol0.read(HOSTILE + 2 * MIB, 4096).await.unwrap() == done);
            // Put back what `start` wrote there.
            fill_range(&*h.vol0, 0xa0, HOSTILE + 2 * MIB, 4096).await;
            h.assert_untouched(HOSTILE, HOSTILE_LEN).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_over_64mib_closes_that_connection() {
    hostile_case(async |h| {
        for len in [MAX_WRITE_PAYLOAD + 512, u32::MAX] {
            let mut raw = Raw::attach(&h.addr, "vol0").await;
            raw.request_with(req(CMD_WRITE, 0, 1, HOSTILE, len), &[0xee; 4096])
                .await;
            assert_eq!(raw.expect_closed().await, b"", "write of {len} bytes");
        }
        h.assert_untouched(HOSTILE, HOSTILE_LEN).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_over_max_io_gets_einval_and_connection_stays_usable() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        let len = 2 * MAX_IO;
        raw.expect_errno(
            req(CMD_WRITE, 0, 3, HOSTILE, len),
            &vec![0xee; len as usize],
            EINVAL,
        )
        .await;
        h.refused_cleanly(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_over_max_io_gets_einval_and_connection_stays_usable() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        for len in [MAX_IO + 512, 64 << 20, u32::MAX] {
            raw.expect_errno(req(CMD_READ, 0, 4, HOSTILE, len), &[], EINVAL)
                .await;
        }
        // No payload followed the error replies: the next read is framed right.
        raw.request(CMD_READ, 0, 5, HOSTILE, MAX_IO).await;
        assert_eq!(raw.reply().await, (0, 5));
        let data = raw.read_exact(MAX_IO as usize).await;
        assert!(data == pattern(0xa0, HOSTILE, MAX_IO as usize));
        raw.still_in_step(HOSTILE + 3 * MIB).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misaligned_requests_get_einval_and_change_nothing() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        let cases = [
            (req(CMD_READ, 0, 1, HOSTILE + 1, 512), 0),
            (req(CMD_READ, 0, 2, HOSTILE, 100), 0),
            (req(CMD_READ, 0, 3, HOSTILE, 0), 0),
            (req(CMD_WRITE, 0, 4, HOSTILE + 100, 512), 512),
            (req(CMD_WRITE, 0, 5, HOSTILE, 100), 100),
            (req(CMD_WRITE, CMD_FLAG_FUA, 6, HOSTILE + 511, 1024), 1024),
            (req(CMD_WRITE, 0, 7, HOSTILE, 0), 0),
            (req(CMD_TRIM, 0, 8, HOSTILE + 1, 4096), 0),
            (req(CMD_TRIM, 0, 9, HOSTILE, 4095), 0),
            (req(CMD_WRITE_ZEROES, 0, 10, HOSTILE + 256, 4096), 0),
            (req(CMD_WRITE_ZEROES, CMD_FLAG_FUA, 11, HOSTILE, 1), 0),
        ];
        expect_einval_each(&mut raw, &cases).await;
        h.refused_cleanly(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_requests_get_einval_or_enospc_and_change_nothing() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        let junk = vec![0xee; 4096];
        let far = u64::MAX - BS + 1;
        // Reads past the end: EINVAL.
        for (off, len) in [
            (SIZE, 512),
            (SIZE - 512, 1024),
            (far, 512),
            (SIZE * 2, 4096),
        ] {
            raw.expect_errno(req(CMD_READ, 0, 1, off, len), &[], EINVAL)
                .await;
        }
        // Writes past the end: ENOSPC.
        for (off, len) in [
            (SIZE, 512),
            (SIZE - 512, 1024),
            (far, 512),
            (SIZE - 3584, 4096),
        ] {
            for flags in [0, CMD_FLAG_FUA] {
                raw.expect_errno(
                    req(CMD_WRITE, flags, 2, off, len),
                    &junk[..len as usize],
                    ENOSPC,
                )
                .await;
            }
        }
        // Trim and write_zeroes past the end: an error, and nothing zeroed.
        for kind in [CMD_TRIM, CMD_WRITE_ZEROES] {
            for (off, len) in [(SIZE - 512, 1024), (TAIL, u32::MAX - 511), (far, 512)] {
                raw.request(kind, 0, 3, off, len).await;
                let (errno, cookie) = raw.reply().await;
                assert_eq!(cookie, 3);
                assert!(
                    errno == ENOSPC || errno == EINVAL,
                    "command {kind} at {off}+{len}: errno {errno}"
                );
            }
        }
        raw.still_in_step(HOSTILE + 3 * MIB).await;
        drop(raw);
        h.assert_untouched(TAIL, MIB).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_command_types_get_einval_and_connection_continues() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        // CACHE (5) and BLOCK_STATUS (7) are not offered; 99 and 0xffff do not exist.
        for (i, kind) in [99u16, 5, 7, 8, 0xffff].into_iter().enumerate() {
            raw.expect_errno(req(kind, 0, 100 + i as u64, HOSTILE, 4096), &[], EINVAL)
                .await;
        }
        h.refused_cleanly(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_command_flags_get_einval_and_change_nothing() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        let cases = [
            // DF needs structured replies, which were not negotiated.
            (req(CMD_READ, 1 << 2, 1, HOSTILE, 4096), 0),
            (req(CMD_READ, 1 << 15, 2, HOSTILE, 4096), 0),
            // The payload of a refused write is still consumed (checked by the next one).
            (req(CMD_WRITE, 1 << 7, 3, HOSTILE, 4096), 4096),
            (req(CMD_WRITE, CMD_FLAG_NO_HOLE, 4, HOSTILE, 4096), 4096),
            (req(CMD_WRITE, 0xffff, 5, HOSTILE, 512), 512),
            (req(CMD_TRIM, CMD_FLAG_NO_HOLE, 6, HOSTILE, 4096), 0),
            // FAST_ZERO was not negotiated.
            (req(CMD_WRITE_ZEROES, 1 << 4, 7, HOSTILE, 4096), 0),
        ];
        expect_einval_each(&mut raw, &cases).await;
        h.refused_cleanly(raw).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_vanishing_with_many_requests_in_flight() {
    hostile_case(async |h| {
        // On the slow export the requests sit in the device when the client leaves.
        let mut raw = Raw::attach(&h.addr, "slow").await;
        let mut b = Vec::new();
        for i in 0..200u64 {
            b.extend_from_slice(&req(CMD_WRITE, 0, i, i * 4096, 4096).encode());
            b.extend_from_slice(&[i as u8; 4096]);
            b.extend_from_slice(&req(CMD_READ, 0, 1000 + i, i * 4096, 4096).encode());
        }
        b.extend_from_slice(&req(CMD_FLUSH, 0, 5000, 0, 0).encode());
        raw.send(&b).await;
        drop(raw);
        // On vol0 the replies (256 MiB of reads) cannot all be sent: the server is stuck
        // writing to a client that never reads, and then the client leaves.
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        raw.send(&max_io_reads(256)).await;
        // Some replies went out; then the client is gone without reading the rest.
        let _ = raw.read_exact(SIMPLE_REPLY_LEN).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_that_never_reads_replies_does_not_stall_others() {
    hostile_case(async |h| {
        let mut raw = Raw::attach(&h.addr, "vol0").await;
        raw.send(&max_io_reads(64)).await;
        // While it is still connected with its replies stuck, others carry on.
        fresh_client_works(&h.addr, "vol0", FRESH).await;
        fresh_client_works(&h.addr, "scratch", FRESH).await;
        // It then reads its replies after all: all 64 arrive, in whatever order, with data.
        let mut seen = [false; 64];
        for _ in 0..64 {
            let (errno, cookie) = raw.reply().await;
            assert_eq!(errno, 0);
            assert!(!std::mem::replace(&mut seen[cookie as usize], true));
            let data = raw.read_exact(MAX_IO as usize).await;
            let off = (cookie % 16) * MIB;
            if off < HOSTILE_LEN {
                assert!(data == pattern(0xa0, off, MAX_IO as usize));
            }
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Fuzzing
// ---------------------------------------------------------------------------------------

/// What a fuzzed transmission session sent, for checking the replies.
#[derive(Default)]
struct Sent {
    /// Requests the server will parse, by cookie: (kind, length, must succeed).
    parsed: HashMap<u64, (u16, u32, bool)>,
    /// Whether the server must answer every parsed request and close cleanly (the client
    /// kept to the protocol).
    all_answered: bool,
    /// Cookies sent after a DISC: never answered.
    after_disc: Vec<u64>,
}

/// Random bytes or random options right after the greeting.
fn fuzz_negotiation(rng: &mut Rng) -> Vec<u8> {
    let mut b = Vec::new();
    match rng.below(3) {
        0 => return rng.bytes(256),
        1 => b.extend_from_slice(&(rng.below(4) as u32).to_be_bytes()),
        _ => b.extend_from_slice(&(rng.next() as u32).to_be_bytes()),
    }
    for _ in 0..rng.below(6) + 1 {
        if rng.percent(5) {
            b.extend_from_slice(&rng.bytes(40));
            continue;
        }
        let magic = if rng.percent(95) {
            IHAVEOPT
        } else {
            rng.next()
        };
        let opts = [1u32, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        let opt = if rng.percent(90) {
            opts[rng.below(opts.len() as u64) as usize]
        } else {
            rng.next() as u32
        };
        // Never "vol0": random bytes must not reach the disk other tests verify.
        let names: [&[u8]; 4] = [b"scratch", b"nope", b"", b"\xff\xfe"];
        let name = names[rng.below(4) as usize];
        let mut data = match opt {
            OPT_INFO | OPT_GO if rng.percent(70) => {
                let infos: Vec<u16> = (0..rng.below(4)).map(|_| rng.below(5) as u16).collect();
                let mut d = go_data(name, &infos);
                if rng.percent(20) {
                    let i = rng.below(d.len() as u64) as usize;
                    d[i] = rng.next() as u8;
                }
                d
            }
            OPT_EXPORT_NAME => name.to_vec(),
            _ => rng.bytes(48),
        };
        if rng.percent(10) {
            data.truncate(rng.below(data.len() as u64 + 1) as usize);
        }
        let len = match rng.below(20) {
            0 => rng.next() as u32,
            1 => data.len() as u32 + rng.below(64) as u32,
            2 => (16 << 10) + rng.below(4096) as u32,
            _ => data.len() as u32,
        };
        b.extend_from_slice(&option_frame(magic, opt, len, &data));
    }
    b
}

/// A stream of mostly well-framed, randomly wrong requests for the `scratch` export.
fn fuzz_transmission(rng: &mut Rng, sent: &mut Sent) -> Vec<u8> {
    let mut b = Vec::new();
    sent.all_answered = true;
    let mut disc = false;
    for cookie in 0..rng.below(24) + 1 {
        if rng.percent(3) {
            // Bytes that do not start with the request magic: a hard disconnect.
            let mut junk = rng.bytes(40);
            junk.splice(0..0, [0u8; 4]);
            b.extend_from_slice(&junk);
            sent.all_answered = false;
            break;
        }
        let kind = match rng.below(100) {
            0..30 => CMD_READ,
            30..60 => CMD_WRITE,
            60..68 => CMD_FLUSH,
            68..76 => CMD_TRIM,
            76..84 => CMD_WRITE_ZEROES,
            84..86 => CMD_DISC,
            86..93 => [5u16, 7, 99][rng.below(3) as usize],
            _ => rng.next() as u16,
        };
        let flags = match rng.below(100) {
            0..70 => 0,
            70..80 => CMD_FLAG_FUA,
            80..85 => CMD_FLAG_NO_HOLE,
            _ => rng.next() as u16,
        };
        let offset = match rng.below(10) {
            0..7 => rng.below(SIZE / BS) * BS,
            7 => rng.below(SIZE),
            8 => SIZE - rng.below(8) * BS,
            _ => rng.next(),
        };
        let length = match rng.below(10) {
            0..6 => (rng.below(128) as u32 + 1) * BS as u32,
            6 => 0,
            7 => rng.below(5000) as u32,
            8 => MAX_IO + BS as u32,
            _ => rng.next() as u32,
        };
        b.extend_from_slice(&req(kind, flags, cookie, offset, length).encode());
        if kind == CMD_WRITE {
            if length > MAX_WRITE_PAYLOAD {
                sent.all_answered = false;
                break;
            }
            if length > 2 << 20 {
                // Part of the payload, then end of input: never parsed.
                b.extend_from_slice(&vec![0xcd; rng.below(65536) as usize]);
                break;
            }
            b.extend_from_slice(&vec![cookie as u8; length as usize]);
        }
        if disc {
            sent.after_disc.push(cookie);
            continue;
        }
        if kind == CMD_DISC && flags == 0 {
            if rng.percent(50) {
                // A proper DISC: every request before it is answered, then a clean close.
                break;
            }
            // Sending after DISC breaks the protocol: the server may close hard (unread
            // input makes the close a reset), so replies may be lost; none may be for a
            // request after the DISC.
            disc = true;
            sent.all_answered = false;
            continue;
        }
        if kind == CMD_DISC {
            // A DISC with flags: refused with EINVAL or taken as a DISC; either way
            // nothing after it is checked.
            sent.parsed.insert(cookie, (kind, length, false));
            sent.all_answered = false;
            break;
        }
        let aligned = offset % BS == 0 && length as u64 % BS == 0 && length > 0;
        let in_range = offset
            .checked_add(u64::from(length))
            .is_some_and(|e| e <= SIZE);
        let must_succeed = match kind {
            CMD_READ => flags == 0 && aligned && in_range && length <= MAX_IO,
            CMD_WRITE => flags & !CMD_FLAG_FUA == 0 && aligned && in_range && length <= MAX_IO,
            CMD_FLUSH => flags == 0,
            _ => false,
        };
        sent.parsed.insert(cookie, (kind, length, must_succeed));
    }
    b
}

/// Check a fuzzed session's replies: well framed, each for a request the server parsed,
/// at most once, successes where the request was valid, and all of them when the session
/// ended cleanly.
fn check_replies(seed: u64, got: &[u8], sent: &mut Sent) {
    let mut pos = 0;
    while pos < got.len() {
        let Some(h) = got.get(pos..pos + SIMPLE_REPLY_LEN) else {
            assert!(
                !sent.all_answered,
                "seed {seed}: a reply cut short on a clean session"
            );
            return;
        };
        let (magic, errno, cookie) = simple_reply_fields(h);
        assert_eq!(
            magic, SIMPLE_REPLY_MAGIC,
            "seed {seed}: bad reply magic at {pos}"
        );
        assert!(
            !sent.after_disc.contains(&cookie),
            "seed {seed}: request {cookie} after DISC was served"
        );
        let Some((kind, length, must_succeed)) = sent.parsed.remove(&cookie) else {
            panic!("seed {seed}: reply for cookie {cookie}, unknown or already answered");
        };
        assert!(
            [0, EPERM, EIO, EINVAL, ENOSPC, EOVERFLOW, ESHUTDOWN].contains(&errno),
            "seed {seed}: errno {errno} is not an NBD error value"
        );
        if must_succeed {
            assert_eq!(errno, 0, "seed {seed}: valid request {cookie} failed");
        }
        let known = [
            CMD_READ,
            CMD_WRITE,
            CMD_DISC,
            CMD_FLUSH,
            CMD_TRIM,
            CMD_WRITE_ZEROES,
        ];
        if !known.contains(&kind) {
            assert_eq!(errno, EINVAL, "seed {seed}: command {kind}");
        }
        pos += SIMPLE_REPLY_LEN;
        if kind == CMD_READ && errno == 0 {
            pos += length as usize;
            assert!(
                pos <= got.len() || !sent.all_answered,
                "seed {seed}: read data cut short"
            );
        }
    }
    if sent.all_answered {
        let mut left: Vec<_> = sent.parsed.keys().collect();
        left.sort();
        assert!(left.is_empty(), "seed {seed}: never answered: {left:?}");
    }
}

/// Send `bytes` (ignoring a connection the server already dropped) while collecting all
/// the server sends until it closes.
async fn exchange(raw: Raw, bytes: Vec<u8>) -> Vec<u8> {
    let (mut rd, mut wr) = raw.s.into_split();
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        match tokio::time::timeout(IO_TIMEOUT, rd.read_to_end(&mut got)).await {
            Err(_) => panic!("the server kept a fuzzed connection open"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if is_disconnect(&e) => {}
            Ok(Err(e)) => panic!("socket error: {e}"),
        }
        got
    });
    let sent = async {
        wr.write_all(&bytes).await?;
        wr.shutdown().await
    };
    match tokio::time::timeout(IO_TIMEOUT, sent).await {
        Err(_) => panic!("the server stopped reading a fuzzed connection"),
        Ok(Ok(())) => {}
        Ok(Err(e)) if is_disconnect(&e) => {}
        Ok(Err(e)) => panic!("socket error: {e}"),
    }
    let got = reader.await.unwrap();
    drop(wr);
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_fuzz_of_negotiation_and_transmission() {
    hostile_case(async |h| {
        for seed in 0..360u64 {
            let mut rng = Rng(0x7e57_0000 + seed);
            if seed % 2 == 0 {
                let raw = Raw::connect(&h.addr).await;
                let bytes = fuzz_negotiation(&mut rng);
                exchange(raw, bytes).await;
            } else {
                let raw = Raw::attach(&h.addr, "scratch").await;
                let mut sent = Sent::default();
                let bytes = fuzz_transmission(&mut rng, &mut sent);
                let got = exchange(raw, bytes).await;
                check_replies(seed, &got, &mut sent);
            }
        }
    })
    .await;
}
