//! Garbage on the replication port: a raw socket connects to node 2's replication
//! listener (the one node 1 dials) while the two mirror, and sends what no peer would:
//! random bytes, a frame cut short, a frame with a bad crc, a Hello for a disk the node
//! does not have, a header declaring a huge frame. Each time the node drops that
//! connection and says why in its log, and nothing else changes: the node keeps running
//! and serving NBD, the mirror link stays up (writes on either node still reach the
//! other), and at the end both replicas are byte-identical and hold what was written.
//!
//! A missing qemu-io skips the test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan_replica::protocol::{
    DiskId, GEN_JUST_CREATED, Generations, Hello, Message, PROTOCOL_VERSION, WritePayload,
};
use vsan_replica::wire::{self, HEADER_LEN, MAGIC, WIRE_VERSION};

use common::mirror::{
    CONNECTED, Pair, Side, assert_replicas_identical, start_pair, stop_both_clean,
};
use common::{Node, Region, assert_file_holds, image, qemu_io_reads, qemu_io_writes, require_tool};

const MIB: u64 = 1 << 20;
const DISK: &str = "vol0";
/// How long a log line or a sync that is due may take to show up.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the node may take to drop a connection that sent a bad frame.
const DROP_TIMEOUT: Duration = Duration::from_secs(5);

/// One thing sent to the replication port, and what the node must log about it.
struct Case {
    what: &'static str,
    bytes: Vec<u8>,
    /// Close our sending side after the bytes (the peer went away mid-frame).
    close_after: bool,
    /// The node answers with a Refuse whose reason holds this (else it sends nothing).
    refused: Option<&'static str>,
    /// Each must appear in one log line that also names our connection.
    log: &'static [&'static str],
}

/// A frame's bytes, whole.
fn frame(msg: &Message) -> Vec<u8> {
    let mut buf = BytesMut::new();
    wire::encode_into(msg, &mut buf).expect("the message encodes");
    buf.to_vec()
}

/// A header with a correct crc (over the header alone) declaring `meta_len` and
/// `data_len` bytes that never follow.
fn header(kind: u8, meta_len: u32, data_len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_LEN);
    h.extend_from_slice(&MAGIC.to_be_bytes());
    h.extend_from_slice(&[WIRE_VERSION, kind, 0, 0]);
    h.extend_from_slice(&meta_len.to_be_bytes());
    h.extend_from_slice(&data_len.to_be_bytes());
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_be_bytes());
    h
}

fn hello(disk_name: &str) -> Message {
    Message::Hello(Hello {
        protocol_version: PROTOCOL_VERSION,
        node_id: 1,
        peer_id: 2,
        disk_id: DiskId::from_name(disk_name),
        disk_name: disk_name.into(),
        size: 16 * MIB,
        block_size: 512,
        chunk_size: MIB,
        generations: Generations {
            current: GEN_JUST_CREATED,
            bitmap: 0,
            history: [0, 0],
        },
        dirty_chunks: 0,
        crashed: false,
        inconsistent: false,
        discard_my_data: false,
        split_brain_policy: 0,
    })
}

fn cases() -> Vec<Case> {
    let mut rng = SmallRng::seed_from_u64(0x7673_616e);
    let mut garbage = vec![0u8; 4096];
    rng.fill(&mut garbage[..]);
    // Not the magic, whatever the generator gave.
    garbage[0] = b'G';

    let write = frame(&Message::Write {
        id: 1,
        offset: 0,
        payload: WritePayload::Data(vec![0xee; 4096].into()),
        fua: false,
    });
    let truncated = write[..HEADER_LEN + 100].to_vec();
    let mut bad_crc = frame(&Message::Write {
        id: 2,
        offset: 4096,
        payload: WritePayload::Data(vec![0xdd; 4096].into()),
        fua: false,
    });
    let last = bad_crc.len() - 1;
    bad_crc[last] ^= 0x01;

    let mut bad_version = frame(&Message::Ping { id: 3 });
    bad_version[4] = WIRE_VERSION.wrapping_add(1);

    vec![
        Case {
            what: "random garbage",
            bytes: garbage,
            close_after: false,
            refused: None,
            log: &["bad magic"],
        },
        Case {
            what: "a valid frame cut short, then the connection closed",
            bytes: truncated,
            close_after: true,
            refused: None,
            log: &["in the middle of a frame"],
        },
        Case {
            what: "a whole frame with a bad crc",
            bytes: bad_crc,
            close_after: false,
            refused: None,
            log: &["crc mismatch"],
        },
        Case {
            what: "a valid Hello for a disk the node does not have",
            bytes: frame(&hello("nosuchdisk")),
            close_after: false,
            refused: Some("nosuchdisk"),
            log: &["no mirrored disk named \"nosuchdisk\""],
        },
        Case {
            what: "a header declaring a 4 GiB data section",
            bytes: header(4, 0, u32::MAX),
            close_after: false,
            refused: None,
            log: &["data section of 4294967295 bytes exceeds the limit"],
        },
        Case {
            what: "a header declaring a 4 GiB meta section",
            bytes: header(1, u32::MAX, 0),
            close_after: false,
            refused: None,
            log: &["meta section of 4294967295 bytes exceeds the limit"],
        },
        Case {
            what: "a frame of an unknown wire version",
            bytes: bad_version,
            close_after: false,
            refused: None,
            log: &["unsupported wire version"],
        },
    ]
}

/// Reads until the node closes the connection (end of stream or reset); returns what it
/// sent first. Panics if it is still open after [`DROP_TIMEOUT`].
fn read_until_closed(stream: &mut TcpStream, what: &str) -> Vec<u8> {
    let deadline = Instant::now() + DROP_TIMEOUT;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: the node kept the connection open for {DROP_TIMEOUT:?}"
        );
        stream
            .set_read_timeout(Some(left))
            .expect("set a read timeout");
        match stream.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
                return got;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!("{what}: the node kept the connection open for {DROP_TIMEOUT:?}")
            }
            Err(e) => panic!("{what}: reading from the replication port failed: {e}"),
        }
    }
}

/// Waits until one log line holds every one of `needles`; panics with the log after
/// `limit`.
fn wait_log_line(node: &Node, needles: &[&str], limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let log = node.log();
        if log.lines().any(|l| needles.iter().all(|n| l.contains(n))) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no log line with all of {needles:?} within {limit:?}\n--- log ---\n{log}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// The mirror is as it was: each node connected once, neither lost its peer.
fn assert_still_mirroring(n1: &Node, n2: &Node, after: &str) {
    for (node, who) in [(n1, "node 1"), (n2, "node 2")] {
        let log = node.log();
        assert_eq!(
            node.log_count(CONNECTED),
            1,
            "{who} (re)connected after {after}:\n{log}"
        );
        for bad in ["peer lost", "mirror link dropped", "panicked"] {
            assert!(
                !log.contains(bad),
                "`{bad}` in {who}'s log after {after}:\n{log}"
            );
        }
    }
}

#[test]
fn garbage_on_the_replication_port_drops_that_connection_and_nothing_else() {
    if !require_tool("qemu-io") {
        return;
    }
    let side = |id| Side::new(id, DISK, "\"16MiB\"");
    let Pair {
        dir1, dir2, n1, n2, ..
    } = start_pair("repl-garbage", &side(1), &side(2));
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    // Fresh replicas compare every chunk by checksum first.
    let done = format!("sync disk={DISK} done");
    n1.wait_stdout(&[&done], EVENT_TIMEOUT);
    n2.wait_stdout(&[&done], EVENT_TIMEOUT);
    let (uri1, uri2) = (n1.uri(DISK), n2.uri(DISK));
    let port = n2.replication().to_string();

    // A known pattern first, written on node 1 and read back on node 2.
    let mut expect = vec![Region::new(0x5a, 0, MIB), Region::new(0xa7, 15 * MIB, MIB)];
    qemu_io_writes(&uri1, &expect);
    qemu_io_reads(&uri2, &expect);

    for (i, case) in cases().into_iter().enumerate() {
        let what = case.what;
        let mut raw =
            TcpStream::connect(&port).unwrap_or_else(|e| panic!("{what}: connect to {port}: {e}"));
        let me = raw.local_addr().expect("our address").to_string();
        raw.write_all(&case.bytes)
            .unwrap_or_else(|e| panic!("{what}: send: {e}"));
        if case.close_after {
            raw.shutdown(Shutdown::Write)
                .expect("close our sending side");
        }
        let reply = read_until_closed(&mut raw, what);
        // Only a well-formed Hello earns an answer: a Refuse that says why.
        if let Some(want) = case.refused {
            let mut buf = BytesMut::from(&reply[..]);
            match wire::decode(&mut buf) {
                Ok(Some(Message::Refuse { reason })) => {
                    assert!(reason.contains(want), "{what}: refused for {reason:?}");
                }
                other => panic!("{what}: answered {other:?} ({} bytes)", reply.len()),
            }
        } else {
            assert!(
                reply.is_empty(),
                "{what}: the node answered {} bytes",
                reply.len()
            );
        }
        let mut needles = vec![me.as_str()];
        needles.extend_from_slice(case.log);
        wait_log_line(&n2, &needles, EVENT_TIMEOUT);

        // The node still listens, and both exports still serve I/O that replicates: a
        // region from each node, read back on the other.
        TcpStream::connect(&port)
            .unwrap_or_else(|e| panic!("after {what}: the replication port is gone: {e}"));
        let base = MIB + (i as u64) * 2 * 256 * 1024;
        let from1 = Region::new(0x10 + i as u8, base, 256 * 1024);
        let from2 = Region::new(0x90 + i as u8, base + 256 * 1024, 256 * 1024);
        qemu_io_writes(&uri1, &[from1]);
        qemu_io_writes(&uri2, &[from2]);
        qemu_io_reads(&uri2, &[from1]);
        qemu_io_reads(&uri1, &[from2]);
        expect.push(from1);
        expect.push(from2);
        assert_still_mirroring(&n1, &n2, what);
    }

    // Everything written reads back from both nodes.
    qemu_io_reads(&uri1, &expect);
    qemu_io_reads(&uri2, &expect);
    assert_still_mirroring(&n1, &n2, "all the cases");
    stop_both_clean(n1, n2);
    let (img1, img2) = (image(&dir1, DISK), image(&dir2, DISK));
    assert_replicas_identical(&img1, &img2);
    assert_file_holds(&img1, &expect, "node 1's replica");
    assert_file_holds(&img2, &expect, "node 2's replica");
}
