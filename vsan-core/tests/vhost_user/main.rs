//! The vhost-user-blk export against libblkio's own driver (a front end nobody here
//! wrote): data, flush, discard, write-zeroes, many requests in flight on several
//! queues, reconnects, and the device's content compared byte for byte.
#![cfg(target_os = "linux")]

mod client;
#[path = "../common/mod.rs"]
mod common;
mod hostile;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use blkio::ReqFlags;
use client::Client;
use vsan_core::export::vhost_user::{VhostUserExport, VhostUserOptions};
use vsan_core::{BlockDevice, Geometry, MemDevice};

const MIB: u64 = 1 << 20;

/// Dropped in field order: the export stops before its directory goes.
struct Fixture {
    export: Option<VhostUserExport>,
    path: PathBuf,
    disk: Arc<MemDevice>,
    rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Fixture {
    fn new(size: u64, block_size: u32, options: VhostUserOptions) -> Fixture {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.vhost");
        let disk = Arc::new(MemDevice::new(Geometry::new(size, block_size).unwrap()));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let export =
            VhostUserExport::start(&path, disk.clone(), options, rt.handle().clone()).unwrap();
        Fixture {
            _dir: dir,
            path,
            disk,
            rt,
            export: Some(export),
        }
    }

    fn export(&self) -> &VhostUserExport {
        self.export.as_ref().unwrap()
    }

    fn disk_bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        self.rt
            .block_on(self.disk.read(offset, len))
            .unwrap()
            .to_vec()
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn opts(queues: u16) -> VhostUserOptions {
    VhostUserOptions {
        queues,
        serial: "vsan-test-serial".into(),
        ..VhostUserOptions::default()
    }
}

#[test]
fn geometry_and_config_reach_the_front_end() {
    let f = Fixture::new(64 * MIB, 4096, opts(2));
    let c = Client::connect(&f.path, 2, 1 << 20).unwrap();
    assert_eq!(c.get_u64("capacity"), 64 * MIB);
    assert_eq!(c.get_i32("request-alignment"), 4096);
    assert_eq!(c.get_i32("max-queues"), 2);
    assert!(c.get_u64("max-discard-len") > 0);
    assert!(c.get_u64("max-write-zeroes-len") > 0);
    let st = f.export().status();
    assert!(st.connected);
    assert_eq!(st.connections, 1);
    assert_eq!(st.queues.len(), 2);
}

#[test]
fn patterns_at_many_sizes_read_back_and_land_on_the_disk() {
    let f = Fixture::new(64 * MIB, 512, opts(1));
    let mut c = Client::connect(&f.path, 1, 4 << 20).unwrap();
    let mut offset = 0u64;
    for (i, len) in [512usize, 4096, 8192, 65536, 131072, 1 << 20, 3 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(i as u64, len);
        assert_eq!(c.write(offset, &data), 0, "write of {len} at {offset}");
        assert_eq!(c.read(offset, len).unwrap(), data, "read of {len}");
        assert_eq!(f.disk_bytes(offset, len), data, "disk content of {len}");
        offset += len as u64 + 512;
    }
    // Flush completes.
    assert_eq!(c.one(|q, _| q.flush(0, ReqFlags::empty())), 0);
    let st = &f.export().status().queues[0];
    assert_eq!(st.writes, 7);
    assert_eq!(st.reads, 7);
    assert_eq!(st.flushes, 1);
    assert_eq!(st.errors + st.bad_chains, 0);
}

#[test]
fn discard_and_write_zeroes_read_back_as_zeros() {
    let f = Fixture::new(16 * MIB, 4096, opts(1));
    let mut c = Client::connect(&f.path, 1, 1 << 20).unwrap();
    let data = pattern(7, 1 << 20);
    for base in [0, MIB, 2 * MIB] {
        assert_eq!(c.write(base, &data), 0);
    }
    assert_eq!(c.one(|q, _| q.discard(0, MIB, 0, ReqFlags::empty())), 0);
    // Without NO_UNMAP: write-zeroes may deallocate; with it: plain zeroes.
    assert_eq!(
        c.one(|q, _| q.write_zeroes(MIB, 64 << 10, 0, ReqFlags::empty())),
        0
    );
    assert_eq!(
        c.one(|q, _| q.write_zeroes(2 * MIB + 4096, 8192, 0, ReqFlags::NO_UNMAP)),
        0
    );
    assert_eq!(f.disk_bytes(0, MIB as usize), vec![0; MIB as usize]);
    assert_eq!(f.disk_bytes(MIB, 64 << 10), vec![0; 64 << 10]);
    assert_eq!(
        f.disk_bytes(MIB + (64 << 10), 4096),
        data[64 << 10..(64 << 10) + 4096]
    );
    let mut want = data.clone();
    want[4096..4096 + 8192].fill(0);
    assert_eq!(f.disk_bytes(2 * MIB, MIB as usize), want);
    let st = &f.export().status().queues[0];
    assert_eq!((st.discards, st.write_zeroes), (1, 2));
}

#[test]
fn out_of_range_and_unaligned_requests_fail_and_change_nothing() {
    let f = Fixture::new(8 * MIB, 4096, opts(1));
    let mut c = Client::connect(&f.path, 1, 1 << 20).unwrap();
    let before = f.disk_bytes(0, 8 * MIB as usize);
    // libblkio checks alignment itself; beyond the end reaches the device.
    assert_ne!(c.write(8 * MIB, &[1; 4096]), 0);
    assert_ne!(c.write(8 * MIB - 4096, &[1; 8192]), 0);
    assert!(c.read(8 * MIB, 4096).is_err());
    assert_eq!(f.disk_bytes(0, 8 * MIB as usize), before);
    // The queue still serves.
    assert_eq!(c.write(0, &[9; 4096]), 0);
    assert_eq!(c.read(0, 4096).unwrap(), vec![9; 4096]);
}

#[test]
fn many_requests_in_flight_on_several_queues_at_once() {
    const QUEUES: usize = 4;
    const DEPTH: usize = 32;
    const BLOCK: usize = 4096;
    let f = Fixture::new(64 * MIB, 512, opts(QUEUES as u16));
    let mut c = Client::connect(&f.path, QUEUES as i32, QUEUES * DEPTH * BLOCK).unwrap();
    // Each queue owns its own 16 MiB of the disk; each slot writes then reads back.
    let mut expect: HashMap<u64, Vec<u8>> = HashMap::new();
    for round in 0..8u64 {
        for q in 0..QUEUES {
            for d in 0..DEPTH {
                let slot = q * DEPTH + d;
                let off = (q as u64) * 16 * MIB + (round * DEPTH as u64 + d as u64) * BLOCK as u64;
                let data = pattern(off, BLOCK);
                c.buf()[slot * BLOCK..(slot + 1) * BLOCK].copy_from_slice(&data);
                let p = c.ptr(slot * BLOCK);
                c.queues[q].write(off, p, BLOCK, slot, ReqFlags::empty());
                expect.insert(off, data);
            }
        }
        for q in 0..QUEUES {
            let mut got = 0;
            while got < DEPTH {
                for (_, ret) in c.wait(q, 1) {
                    assert_eq!(ret, 0);
                    got += 1;
                }
            }
        }
    }
    // Read everything back at depth, then compare with the disk too.
    for (&off, data) in &expect {
        assert_eq!(&f.disk_bytes(off, BLOCK), data);
    }
    let st = f.export().status();
    let writes: u64 = st.queues.iter().map(|q| q.writes).sum();
    assert_eq!(writes, (8 * QUEUES * DEPTH) as u64);
    assert!(st.queues.iter().all(|q| q.writes == 8 * DEPTH as u64));
}

#[test]
fn a_front_end_that_goes_away_mid_io_is_drained_and_a_new_one_is_served() {
    let f = Fixture::new(16 * MIB, 512, opts(1));
    for round in 0..3u64 {
        let mut c = Client::connect(&f.path, 1, 64 * 4096).unwrap();
        for d in 0..64usize {
            let data = pattern(round * 100 + d as u64, 4096);
            c.buf()[d * 4096..(d + 1) * 4096].copy_from_slice(&data);
            let p = c.ptr(d * 4096);
            c.queues[0].write(d as u64 * 4096, p, 4096, d, ReqFlags::empty());
        }
        // Reap a few, then drop the client with the rest in flight (or queued).
        let _ = c.wait(0, 1);
        drop(c);
    }
    // A new front end is served and sees a consistent disk.
    let mut c = Client::connect(&f.path, 1, 1 << 20).unwrap();
    assert_eq!(c.write(0, &[5; 4096]), 0);
    assert_eq!(c.read(0, 4096).unwrap(), vec![5; 4096]);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while f.export().status().connections < 4 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(f.export().status().connections, 4);
}

#[test]
fn a_read_only_export_refuses_writes() {
    let f = Fixture::new(
        8 * MIB,
        512,
        VhostUserOptions {
            read_only: true,
            ..opts(1)
        },
    );
    // libblkio refuses to open a read-only device for writing unless asked read-only.
    let mut b = blkio::Blkio::new("virtio-blk-vhost-user").unwrap();
    b.set_str("path", f.path.to_str().unwrap()).unwrap();
    b.connect().unwrap();
    assert!(b.start().is_err(), "a read-only device opened read-write");
}

#[test]
fn shutdown_removes_the_socket() {
    let mut f = Fixture::new(8 * MIB, 512, opts(1));
    let c = Client::connect(&f.path, 1, 1 << 20).unwrap();
    let path = f.path.clone();
    assert!(path.exists());
    drop(c);
    f.export.take().unwrap().shutdown();
    assert!(!path.exists());
}

mod hostile_cases {
    use super::hostile::{BUFS, D, F_INDIRECT, F_NEXT, F_WRITE, Guest, MEM};
    use super::*;

    const T_IN: u32 = 0;
    const T_OUT: u32 = 1;
    const HDR: u64 = BUFS;
    const DATA: u64 = BUFS + 0x1000;
    const STATUS: u64 = BUFS + 0x3000;
    const TABLE: u64 = BUFS + 0x8000;
    const WAIT: Duration = Duration::from_secs(5);

    /// What a case is, its request type and sector, its descriptors, and the used
    /// length and status byte it must end with.
    type Case = (&'static str, u32, u64, Vec<D>, (u32, u8));

    fn hdr(addr: u64, len: u32, next: u16) -> D {
        D {
            addr,
            len,
            flags: F_NEXT,
            next,
        }
    }

    fn status(next: Option<u16>) -> D {
        D {
            addr: STATUS,
            len: 1,
            flags: F_WRITE | if next.is_some() { F_NEXT } else { 0 },
            next: next.unwrap_or(0),
        }
    }

    /// Write `descs` at 0.., a header of `kind` at `sector`, offer head 0; the used
    /// length and the status byte after.
    fn run(g: &mut Guest, kind: u32, sector: u64, descs: &[D]) -> (u32, u8) {
        g.header(HDR, kind, sector);
        g.put(STATUS, &[0xff]);
        for (i, d) in descs.iter().enumerate() {
            g.desc(i as u16, *d);
        }
        g.submit(0);
        let (id, len) = g.wait_used(WAIT).expect("the backend completed the chain");
        assert_eq!(id, 0);
        (len, g.get(STATUS, 1)[0])
    }

    #[test]
    fn hostile_chains_get_ioerr_never_touch_the_disk_and_the_queue_keeps_serving() {
        let f = Fixture::new(8 * MIB, 512, opts(1));
        let mut g = Guest::connect(&f.path, 16);
        g.put(DATA, &[0xab; 4096]);
        let before = f.disk_bytes(0, 8 * MIB as usize);
        let data = |addr: u64, len: u32, flags: u16, next: u16| D {
            addr,
            len,
            flags: flags | F_NEXT,
            next,
        };
        let last_sector = 8 * MIB / 512 - 1;
        let ioerr = (1, 1);
        let nothing = (0, 0xff);
        let cases: Vec<Case> = vec![
            (
                "data outside guest memory",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(MEM + 4096, 4096, 0, 2), status(None)],
                ioerr,
            ),
            (
                "data straddling the end of guest memory",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(MEM - 100, 4096, 0, 2), status(None)],
                ioerr,
            ),
            (
                "a descriptor of 2 GiB",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(DATA, 1 << 31, 0, 2), status(None)],
                ioerr,
            ),
            // Longer than 4 GiB in all: the ring code stops the walk there, so no
            // status byte is seen.
            (
                "a chain longer than 4 GiB",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(DATA, u32::MAX, 0, 2), status(None)],
                nothing,
            ),
            (
                "a loop",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(DATA, 4096, 0, 2), status(Some(0))],
                ioerr,
            ),
            // The walk stops at the bad index, before the status descriptor.
            (
                "a next index beyond the queue",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(DATA, 4096, 0, 500), status(None)],
                nothing,
            ),
            (
                "the status byte in a read-only buffer",
                T_OUT,
                0,
                vec![
                    hdr(HDR, 16, 1),
                    data(DATA, 4096, 0, 2),
                    D {
                        addr: STATUS,
                        len: 1,
                        flags: 0,
                        next: 0,
                    },
                ],
                nothing,
            ),
            (
                "no status byte at all",
                T_OUT,
                0,
                vec![
                    hdr(HDR, 16, 1),
                    D {
                        addr: DATA,
                        len: 4096,
                        flags: 0,
                        next: 0,
                    },
                ],
                nothing,
            ),
            (
                "a short header",
                T_OUT,
                0,
                vec![hdr(HDR, 8, 1), status(None)],
                ioerr,
            ),
            (
                "a readable buffer after a writable one",
                T_OUT,
                0,
                vec![
                    hdr(HDR, 16, 1),
                    status(Some(2)),
                    D {
                        addr: DATA,
                        len: 4096,
                        flags: 0,
                        next: 0,
                    },
                ],
                ioerr,
            ),
            (
                "a sector count that overflows",
                T_OUT,
                u64::MAX - 3,
                vec![hdr(HDR, 16, 1), data(DATA, 4096, 0, 2), status(None)],
                ioerr,
            ),
            (
                "a write past the end of the disk",
                T_OUT,
                last_sector,
                vec![hdr(HDR, 16, 1), data(DATA, 4096, 0, 2), status(None)],
                ioerr,
            ),
            (
                "a length that is not whole sectors",
                T_OUT,
                0,
                vec![hdr(HDR, 16, 1), data(DATA, 100, 0, 2), status(None)],
                ioerr,
            ),
            (
                "a read into a read-only buffer",
                T_IN,
                0,
                vec![hdr(HDR, 16, 1), data(DATA, 4096, 0, 2), status(None)],
                ioerr,
            ),
            (
                "an indirect table outside guest memory",
                T_OUT,
                0,
                vec![D {
                    addr: MEM - 16,
                    len: 48,
                    flags: F_INDIRECT,
                    next: 0,
                }],
                nothing,
            ),
        ];
        let n = cases.len() as u64;
        for (what, kind, sector, descs, want) in cases {
            assert_eq!(run(&mut g, kind, sector, &descs), want, "{what}");
            assert_eq!(
                f.disk_bytes(0, 8 * MIB as usize),
                before,
                "{what}: the disk changed"
            );
        }
        // Too many segments, through an indirect table: header, 200 data, status.
        g.desc_at(TABLE, 0, hdr(HDR, 16, 1));
        for i in 1..=200u16 {
            g.desc_at(TABLE, i, data(DATA, 512, 0, i + 1));
        }
        g.desc_at(TABLE, 201, status(None));
        let indirect = [D {
            addr: TABLE,
            len: 202 * 16,
            flags: F_INDIRECT,
            next: 0,
        }];
        assert_eq!(run(&mut g, T_OUT, 0, &indirect), ioerr, "too many segments");
        assert_eq!(f.disk_bytes(0, 8 * MIB as usize), before);
        // The same queue still serves a well-formed write and read.
        let good = [hdr(HDR, 16, 1), data(DATA, 4096, 0, 2), status(None)];
        assert_eq!(run(&mut g, T_OUT, 8, &good), (1, 0));
        assert_eq!(f.disk_bytes(4096, 4096), vec![0xab; 4096]);
        g.put(DATA, &[0; 4096]);
        let read = [hdr(HDR, 16, 1), data(DATA, 4096, F_WRITE, 2), status(None)];
        assert_eq!(run(&mut g, T_IN, 8, &read), (4097, 0));
        assert_eq!(g.get(DATA, 4096), vec![0xab; 4096]);
        let st = &f.export().status().queues[0];
        assert_eq!(st.bad_chains, n + 1);
        assert_eq!((st.writes, st.reads), (1, 1));
    }

    #[test]
    fn an_avail_index_beyond_the_ring_stalls_only_that_queue() {
        let f = Fixture::new(8 * MIB, 512, opts(1));
        {
            let mut g = Guest::connect(&f.path, 16);
            g.submit_raw(0, 1000);
            assert_eq!(g.wait_used(Duration::from_millis(300)), None);
            // Kicked again: still nothing, counted once.
            g.submit_raw(0, 0);
            assert_eq!(g.wait_used(Duration::from_millis(100)), None);
            assert_eq!(f.export().status().queues[0].bad_chains, 1);
        }
        // The export serves the next front end.
        let mut c = Client::connect(&f.path, 1, 1 << 20).unwrap();
        assert_eq!(c.write(0, &[3; 4096]), 0);
        assert_eq!(f.disk_bytes(0, 4096), vec![3; 4096]);
    }
}

/// With a busy-poll window the worker keeps polling between kicks; libblkio maps its
/// buffers after the queues start, so a poll must use the memory map as it is now (it
/// once kept the map of its first kick and refused every buffer).
#[test]
fn busy_polling_queues_serve_buffers_mapped_after_the_queues_started() {
    let f = Fixture::new(
        16 * MIB,
        512,
        VhostUserOptions {
            busy_poll: Duration::from_millis(20),
            ..opts(2)
        },
    );
    for round in 0..3u64 {
        let mut c = Client::connect(&f.path, 2, 1 << 20).unwrap();
        let data = pattern(round, 64 << 10);
        assert_eq!(c.write(round * MIB, &data), 0, "round {round}");
        assert_eq!(c.read(round * MIB, data.len()).unwrap(), data);
    }
    assert_eq!(f.export().status().queues[0].bad_chains, 0);
}

/// A stop must not depend on the socket's path: an accept waiting for a front end is
/// woken even when the path was removed (it once waited for ever).
#[test]
fn shutdown_returns_when_the_socket_path_is_gone() {
    let mut f = Fixture::new(8 * MIB, 512, opts(1));
    std::fs::remove_file(&f.path).unwrap();
    let export = f.export.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        export.shutdown();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("shutdown returned");
}

/// The socket path: a stale socket is replaced; a file that is not a socket, or a
/// socket another server listens on, is refused and left as it was (a path that named
/// a disk image by mistake must not cost the image).
#[test]
fn only_a_stale_socket_is_replaced_at_the_path() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk =
        || -> Arc<dyn BlockDevice> { Arc::new(MemDevice::new(Geometry::new(MIB, 512).unwrap())) };
    let start =
        |path: &std::path::Path| VhostUserExport::start(path, disk(), opts(1), rt.handle().clone());

    let image = dir.path().join("image.img");
    std::fs::write(&image, b"precious data").unwrap();
    let e = start(&image).unwrap_err();
    assert_eq!(e.kind(), vsan_core::ErrorKind::InUse, "{e}");
    assert!(e.to_string().contains("not a socket"), "{e}");
    assert_eq!(std::fs::read(&image).unwrap(), b"precious data");

    let live = dir.path().join("live.sock");
    let listener = std::os::unix::net::UnixListener::bind(&live).unwrap();
    let e = start(&live).unwrap_err();
    assert!(e.to_string().contains("another server listens"), "{e}");
    assert!(live.exists());
    drop(listener);

    // The listener is gone: its socket file is stale now and is replaced.
    let export = start(&live).unwrap();
    let c = Client::connect(&live, 1, 1 << 20).unwrap();
    drop(c);
    export.shutdown();
    assert!(!live.exists());
}

/// Chains the front end offers together start together: the worker pops them all, then
/// polls their requests under one plug, so a device that batches (a mirror) carries
/// them out at the unplug with one send. 100 writes offered with one kick must all
/// start under the plug (a set that yields after so many polls, or a poll outside the
/// plug, would start the rest one by one).
#[test]
fn chains_offered_together_start_under_one_plug() {
    const N: usize = 100;
    const BLOCK: usize = 4096;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("probe.vhost");
    let probe = common::PlugProbe::new();
    // A ring with room for all of them at once (a write takes three descriptors).
    let options = VhostUserOptions {
        queue_size: 1024,
        ..opts(1)
    };
    let export =
        VhostUserExport::start(&path, probe.clone(), options, rt.handle().clone()).unwrap();
    let mut c = Client::connect_sized(&path, 1, N * BLOCK, Some(1024)).unwrap();
    for i in 0..N {
        let data = pattern(i as u64, BLOCK);
        c.buf()[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(&data);
        let p = c.ptr(i * BLOCK);
        c.queues[0].write((i * BLOCK) as u64, p, BLOCK, i, ReqFlags::empty());
    }
    // One do_io offers all of them, then waits for their completions.
    let mut done = 0;
    while done < N {
        for (slot, ret) in c.wait(0, 1) {
            assert_eq!(ret, 0, "write {slot}");
            done += 1;
        }
    }
    for i in 0..N {
        let back = rt.block_on(probe.read((i * BLOCK) as u64, BLOCK)).unwrap();
        assert_eq!(&back[..], &pattern(i as u64, BLOCK)[..], "block {i}");
    }
    let (plugged, unplugged, batches) = {
        let st = probe.state.lock().unwrap();
        (st.plugged, st.unplugged, st.batches)
    };
    assert_eq!(
        (plugged, unplugged),
        (N as u64, 0),
        "every write offered with the one kick started under a plug"
    );
    assert!(batches >= 1, "the writes went through an unplug");
    drop(c);
    export.shutdown();
}
