//! Real NBD clients that nobody here wrote (qemu-io, nbdinfo, nbdcopy, fio) against a
//! running `vsan-node` process, checking what a user cares about: the bytes a client
//! reads back on another connection, the size it sees, and the image file on disk after
//! the node has stopped.
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::ffi::OsStr;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use common::{
    Node, ProcessGuard, Region, Sig, TOOL_TIMEOUT, TestDir, ToolOutput, assert_file_holds,
    assert_same_bytes, disk_section, image, line_channel, node_section, qemu_io, read_file_range,
    require_tool, run_command, run_tool,
};
use rand::{RngCore, SeedableRng};

const MIB: u64 = 1 << 20;

/// qemu-io exited 0 and reported no failed pattern and no error of any kind.
fn assert_qemu_io_clean(out: &ToolOutput) {
    let text = out.text();
    assert!(
        !text.contains("Pattern verification failed"),
        "pattern mismatch:\n{out}"
    );
    let lower = text.to_lowercase();
    assert!(
        !lower.contains("error") && !lower.contains("failed"),
        "qemu-io reported an error:\n{out}"
    );
    out.assert_success();
}

/// The number after `"export-size":` in `nbdinfo --json` output.
fn json_export_size(json: &str) -> Option<u64> {
    let at = json.find("\"export-size\"")? + "\"export-size\"".len();
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn nbdinfo_size(uri: &str) -> u64 {
    let out = run_tool("nbdinfo", &["--size", uri], TOOL_TIMEOUT);
    out.assert_success();
    out.stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("nbdinfo --size printed no number:\n{out}"))
}

#[test]
fn qemu_io_patterns_survive_across_connections() {
    if !require_tool("qemu-io") {
        return;
    }
    let dir = TestDir::new("qemu-io");
    let size = 64 * MIB;
    let config = node_section(&dir) + &disk_section("vol0", "\"64MiB\"", "127.0.0.1:0");
    let node = Node::start(&dir, &config, &["vol0"]);
    let uri = node.uri("vol0");

    let regions = [
        Region {
            byte: 0xa5,
            offset: 0,
            len: MIB,
        },
        // 512-aligned but not 4K-aligned, crossing several 4K boundaries.
        Region {
            byte: 0x3c,
            offset: MIB + 4608,
            len: 7680,
        },
        Region {
            byte: 0x96,
            offset: 20 * MIB + 512,
            len: 128 * 1024 - 512,
        },
        // Near the end, and the very last sector.
        Region {
            byte: 0xe1,
            offset: size - 64 * 1024 + 512,
            len: 64 * 1024 - 1024,
        },
        Region {
            byte: 0x42,
            offset: size - 512,
            len: 512,
        },
    ];
    // Untouched gaps between the regions must read back as zeroes.
    let gaps = [
        Region {
            byte: 0,
            offset: MIB,
            len: 4608,
        },
        Region {
            byte: 0,
            offset: MIB + 4608 + 7680,
            len: 4096 - 512,
        },
        Region {
            byte: 0,
            offset: size - 64 * 1024,
            len: 512,
        },
    ];

    let out = qemu_io(&uri, &regions.map(|r| r.write()));
    assert_qemu_io_clean(&out);
    for r in &regions {
        assert!(
            out.stdout.contains(&r.wrote_line()),
            "missing {r:?}:\n{out}"
        );
    }

    // A separate process, so the data crossed connections.
    let reads: Vec<String> = regions.iter().chain(&gaps).map(Region::read).collect();
    let out = qemu_io(&uri, &reads);
    assert_qemu_io_clean(&out);
    for r in regions.iter().chain(&gaps) {
        assert!(out.stdout.contains(&r.read_line()), "missing {r:?}:\n{out}");
    }

    // The check can fail: 0x5a where 0xa5 was written.
    let wrong = Region {
        byte: 0x5a,
        offset: 0,
        len: MIB,
    };
    let out = qemu_io(&uri, &[wrong.read()]);
    assert!(
        out.text().contains("Pattern verification failed"),
        "reading 0x5a over 0xa5 did not fail:\n{out}"
    );
    assert!(
        !out.status.success(),
        "qemu-io exited 0 on a failed pattern:\n{out}"
    );

    node.stop_clean(Sig::TERM);
    let image = image(&dir, "vol0");
    assert_eq!(std::fs::metadata(&image).map(|m| m.len()).ok(), Some(size));
    assert_file_holds(&image, regions.iter().chain(&gaps), "image");
}

#[test]
fn nbdinfo_sees_the_configured_size_over_tcp_and_unix() {
    if !require_tool("nbdinfo") {
        return;
    }
    let dir = TestDir::new("nbdinfo");
    let sock = dir.socket("vol1.sock");
    let config = node_section(&dir)
        + &disk_section("vol0", "\"48MiB\"", "127.0.0.1:0")
        + &disk_section("vol1", "25165824", &format!("unix:{}", sock.display()))
        + "backing = \"mem\"\n";
    let node = Node::start(&dir, &config, &["vol0", "vol1"]);
    assert_eq!(node.addr("vol1"), format!("unix:{}", sock.display()));

    assert_eq!(nbdinfo_size(&node.uri("vol0")), 48 * MIB);
    assert_eq!(nbdinfo_size(&node.uri_named("vol0")), 48 * MIB);
    let json = run_tool("nbdinfo", &["--json", &node.uri("vol0")], TOOL_TIMEOUT);
    json.assert_success();
    assert_eq!(
        json_export_size(&json.stdout),
        Some(48 * MIB),
        "export-size in\n{json}"
    );
    assert!(
        json.stdout.contains("\"export-name\": \"vol0\""),
        "export name in\n{json}"
    );

    // By name and by the empty name (the only disk on that socket).
    assert_eq!(nbdinfo_size(&node.uri("vol1")), 24 * MIB);
    let unnamed = format!("nbd+unix:///?socket={}", sock.display());
    assert_eq!(nbdinfo_size(&unnamed), 24 * MIB);

    node.stop_clean(Sig::TERM);
    assert!(
        !sock.exists(),
        "the socket {} is left after a clean stop",
        sock.display()
    );
}

#[test]
fn nbdcopy_round_trip_is_byte_identical() {
    if !require_tool("nbdcopy") {
        return;
    }
    let dir = TestDir::new("nbdcopy");
    let size = 64 * MIB as usize;
    let mut data = vec![0u8; size];
    rand::rngs::StdRng::seed_from_u64(0x7673_616e).fill_bytes(&mut data);
    let src = dir.join("src.raw");
    std::fs::write(&src, &data).expect("write the source file");

    let config = node_section(&dir) + &disk_section("vol0", "\"64MiB\"", "127.0.0.1:0");
    let node = Node::start(&dir, &config, &["vol0"]);
    let uri = node.uri("vol0");
    let limit = Duration::from_secs(60);

    run_tool("nbdcopy", &[src.as_os_str(), OsStr::new(&uri)], limit).assert_success();
    let back = dir.join("back.raw");
    run_tool("nbdcopy", &[OsStr::new(&uri), back.as_os_str()], limit).assert_success();
    let got = std::fs::read(&back).expect("read the copy");
    assert_same_bytes(&got, &data, "nbdcopy out of the export");

    node.stop_clean(Sig::TERM);
    let image = std::fs::read(image(&dir, "vol0")).expect("read the image");
    assert_same_bytes(&image, &data, "image file after stop");
}

#[test]
fn fio_random_writes_verify() {
    if !require_tool("fio") {
        return;
    }
    let dir = TestDir::new("fio");
    let config = node_section(&dir) + &disk_section("vol0", "\"64MiB\"", "127.0.0.1:0");
    let node = Node::start(&dir, &config, &["vol0"]);

    let mut cmd = Command::new("fio");
    cmd.current_dir(dir.path()).args([
        "--name=v",
        "--ioengine=nbd",
        &format!("--uri={}", node.uri("vol0")),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=32",
        "--size=64M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--output-format=normal",
    ]);
    let out = run_command(cmd, Duration::from_secs(60));
    out.assert_success();
    let text = out.text();
    for bad in ["verify failed", "bad magic", "bad header"] {
        assert!(!text.contains(bad), "fio reported `{bad}`:\n{out}");
    }
    assert!(text.contains("err= 0"), "no clean job summary:\n{out}");
    // Every block written was read back and verified: 64 MiB / 4 KiB each way.
    assert!(
        text.contains("issued rwts: total=16384,16384,"),
        "fio did not verify every block it wrote:\n{out}"
    );

    node.stop_clean(Sig::TERM);
}

#[test]
fn sixteen_qemu_io_clients_at_once() {
    if !require_tool("qemu-io") {
        return;
    }
    const CLIENTS: usize = 16;
    let dir = TestDir::new("qemu-io-16");
    let config = node_section(&dir) + &disk_section("vol0", "\"32MiB\"", "127.0.0.1:0");
    let node = Node::start(&dir, &config, &["vol0"]);
    let uri = node.uri("vol0");

    let regions: Vec<Region> = (0..CLIENTS)
        .map(|i| Region {
            byte: 0x20 + i as u8,
            offset: i as u64 * MIB,
            len: MIB,
        })
        .collect();
    let start = Arc::new(Barrier::new(CLIENTS));
    let clients: Vec<_> = regions
        .iter()
        .map(|&r| {
            let uri = uri.clone();
            let start = Arc::clone(&start);
            thread::spawn(move || {
                start.wait();
                qemu_io(&uri, &[r.write(), "flush".to_string(), r.read()])
            })
        })
        .collect();
    for (client, r) in clients.into_iter().zip(&regions) {
        let out = client.join().expect("client thread");
        assert_qemu_io_clean(&out);
        assert!(out.stdout.contains(&r.read_line()), "missing {r:?}:\n{out}");
    }

    let mut reads: Vec<String> = regions.iter().map(Region::read).collect();
    // Nobody wrote past the 16 regions.
    reads.push(
        Region {
            byte: 0,
            offset: CLIENTS as u64 * MIB,
            len: 32 * MIB - CLIENTS as u64 * MIB,
        }
        .read(),
    );
    let out = qemu_io(&uri, &reads);
    assert_qemu_io_clean(&out);
    for r in &regions {
        assert!(out.stdout.contains(&r.read_line()), "missing {r:?}:\n{out}");
    }

    node.stop_clean(Sig::TERM);
}

#[test]
fn sigterm_with_a_client_connected_flushes_and_exits_zero() {
    if !require_tool("qemu-io") {
        return;
    }
    let dir = TestDir::new("sigterm");
    let config = node_section(&dir) + &disk_section("vol0", "\"16MiB\"", "127.0.0.1:0");
    let node = Node::start(&dir, &config, &["vol0"]);

    // An interactive qemu-io that stays connected after its write.
    let mut child = Command::new("qemu-io")
        .args(["-f", "raw", &node.uri("vol0")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start qemu-io");
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let mut client = ProcessGuard::new(child, None);
    let lines = line_channel(stdout);
    let written = Region {
        byte: 0xc3,
        offset: 4096,
        len: 256 * 1024,
    };
    writeln!(stdin, "{}", written.write()).expect("send a command to qemu-io");
    stdin.flush().expect("send a command to qemu-io");
    let mut seen = Vec::new();
    loop {
        match lines.recv_timeout(TOOL_TIMEOUT) {
            Ok(line) => {
                let done = line.contains(&written.wrote_line());
                seen.push(line);
                if done {
                    break;
                }
            }
            Err(e) => panic!("qemu-io did not report its write ({e}); it said {seen:?}"),
        }
    }
    assert!(
        node.log().contains("client attached"),
        "no client attached:\n{}",
        node.log()
    );

    // The client is still connected (stdin open, no quit) when the node is told to stop.
    let stopped = node.stop(Sig::TERM);
    assert!(
        stopped.status.success(),
        "SIGTERM with a client connected: exit {}\n{}",
        stopped.status,
        stopped.log
    );
    for line in ["SIGTERM received", "stopped cleanly"] {
        assert!(
            stopped.log.contains(line),
            "no `{line}` in the log:\n{}",
            stopped.log
        );
    }
    assert!(
        stopped
            .log
            .lines()
            .any(|l| l.contains("flushed") && l.contains("disk=vol0")),
        "no flush of vol0 in the log:\n{}",
        stopped.log
    );

    let image = image(&dir, "vol0");
    let got = read_file_range(&image, written.offset, written.len as usize);
    assert_same_bytes(
        &got,
        &vec![0xc3; written.len as usize],
        "image after SIGTERM",
    );

    drop(stdin);
    assert!(
        client.wait(TOOL_TIMEOUT).is_some(),
        "qemu-io did not exit after its stdin closed"
    );
}
