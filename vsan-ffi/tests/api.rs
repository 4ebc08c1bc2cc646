//! The C ABI driven from Rust: nodes, disks, blocking and asynchronous I/O, status, and
//! the boundary rules (NULLs, overflow, closed handles, callbacks' threads).

use std::ffi::c_void;
use std::ptr;
use std::sync::mpsc;

use vsan::*;

mod common;
use common::{last_error, mem_node, node_from, open, to_channel};

#[test]
fn blocking_and_async_io_on_a_memory_disk() {
    let node = mem_node("4MiB");
    let disk = open(node, "vol0");
    // SAFETY: every pointer passed is valid for its call; buffers outlive their I/Os
    // (each async batch is awaited before its buffers are touched).
    unsafe {
        let mut g = vsan_geometry::default();
        assert_eq!(vsan_disk_geometry(disk, &mut g), VSAN_OK);
        assert_eq!((g.size, g.block_size), (4 << 20, 512));

        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        assert_eq!(
            vsan_disk_write(disk, 4096, data.as_ptr().cast(), data.len(), VSAN_IO_FUA),
            VSAN_OK
        );
        let mut back = vec![0u8; 8192];
        assert_eq!(
            vsan_disk_read(disk, 4096, back.as_mut_ptr().cast(), back.len()),
            VSAN_OK
        );
        assert_eq!(back, data);
        assert_eq!(vsan_disk_flush(disk), VSAN_OK);
        assert_eq!(vsan_disk_write_zeroes(disk, 4096, 4096, 0), VSAN_OK);
        assert_eq!(vsan_disk_discard(disk, 8192, 4096, 0), VSAN_OK);
        assert_eq!(
            vsan_disk_read(disk, 4096, back.as_mut_ptr().cast(), 4096),
            VSAN_OK
        );
        assert!(back[..4096].iter().all(|&b| b == 0));

        // 64 asynchronous writes then reads, each with its own buffer and tag.
        let (tx, rx) = mpsc::channel::<(vsan_result, u64)>();
        let ud = &tx as *const _ as *mut c_void;
        let bufs: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i; 4096]).collect();
        for (i, b) in bufs.iter().enumerate() {
            let r = vsan_disk_submit_write(
                disk,
                i as u64 * 4096,
                b.as_ptr().cast(),
                4096,
                0,
                Some(to_channel),
                ud,
                i as u64,
            );
            assert_eq!(r, VSAN_OK);
        }
        let mut tags: Vec<u64> = (0..64)
            .map(|_| rx.recv().unwrap())
            .map(|(r, t)| {
                assert_eq!(r, VSAN_OK);
                t
            })
            .collect();
        tags.sort();
        assert_eq!(tags, (0..64).collect::<Vec<_>>());
        let mut reads: Vec<Vec<u8>> = (0..64).map(|_| vec![0xffu8; 4096]).collect();
        for (i, b) in reads.iter_mut().enumerate() {
            let r = vsan_disk_submit_read(
                disk,
                i as u64 * 4096,
                b.as_mut_ptr().cast(),
                4096,
                Some(to_channel),
                ud,
                100 + i as u64,
            );
            assert_eq!(r, VSAN_OK);
        }
        for _ in 0..64 {
            assert_eq!(rx.recv().unwrap().0, VSAN_OK);
        }
        assert_eq!(reads, bufs);
        // A bad request is refused at submission; its callback never runs.
        assert_eq!(
            vsan_disk_submit_read(
                disk,
                4 << 20,
                reads[0].as_mut_ptr().cast(),
                4096,
                Some(to_channel),
                ud,
                7
            ),
            VSAN_ERR_OUT_OF_RANGE
        );
        assert!(rx.try_recv().is_err());

        let mut st: vsan_disk_status = std::mem::zeroed();
        assert_eq!(vsan_disk_get_status(disk, &mut st), VSAN_OK);
        assert!(!st.mirrored && !st.cached);
        assert_eq!(st.link, VSAN_LINK_LOCAL);
        assert_eq!((st.proof, st.unproven_since_ms), (VSAN_PROOF_LOCAL, 0));
        assert_eq!(vsan_disk_verify(disk), VSAN_ERR_NOT_SUPPORTED);
        assert_eq!(vsan_disk_declare_current(disk), VSAN_ERR_NOT_SUPPORTED);

        assert_eq!(vsan_disk_free(disk), VSAN_OK);
        assert_eq!(vsan_disk_free(disk), VSAN_ERR_BAD_HANDLE);
        assert_eq!(vsan_disk_flush(disk), VSAN_ERR_BAD_HANDLE);
        assert_eq!(vsan_node_free(node), VSAN_OK);
        assert_eq!(vsan_node_free(node), VSAN_ERR_BAD_HANDLE);
    }
}

fn replication_address(node: *mut vsan_node) -> String {
    let mut buf = vec![0 as std::ffi::c_char; 8];
    let mut n = 0usize;
    // SAFETY: valid buffer, length and out pointer.
    let r = unsafe { vsan_node_replication_address(node, buf.as_mut_ptr(), buf.len(), &mut n) };
    assert_eq!(r, VSAN_ERR_BUFFER_TOO_SMALL);
    assert!(
        buf.iter().all(|&c| c == 0),
        "nothing written when too small"
    );
    buf = vec![0; n + 1];
    // SAFETY: as above.
    let r = unsafe { vsan_node_replication_address(node, buf.as_mut_ptr(), buf.len(), &mut n) };
    assert_eq!(r, VSAN_OK);
    // SAFETY: NUL-terminated by the call.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Two nodes opened through the C ABI in one process, mirroring a disk over TCP on
/// loopback: what node 1 writes (blocking and asynchronous), node 2 reads.
#[test]
fn two_nodes_mirror_through_the_c_api() {
    let dir = std::env::temp_dir().join(format!("vsan-ffi-mirror-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let disk_section = |peer: u32| {
        format!("[[disk]]\nname = \"vol0\"\nsize = \"8MiB\"\nbacking = \"file\"\npeer = {peer}\n")
    };
    let n2 = node_from(&format!(
        "[node]\nid = 2\ndata_dir = {:?}\nlisten = \"127.0.0.1:0\"\nthreads = 2\n\n\
         [[peer]]\nid = 1\naddress = \"127.0.0.1:1\"\n\n{}",
        dir.join("n2").display().to_string(),
        disk_section(1)
    ));
    let addr = replication_address(n2);
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let n1 = node_from(&format!(
        "[node]\nid = 1\ndata_dir = {:?}\nthreads = 2\n\n[[peer]]\nid = 2\naddress = {addr:?}\n\n{}",
        dir.join("n1").display().to_string(),
        disk_section(2)
    ));
    let (d1, d2) = (open(n1, "vol0"), open(n2, "vol0"));
    // SAFETY: every pointer passed is valid for its call; buffers outlive their I/Os.
    unsafe {
        assert_eq!(
            vsan_disk_wait_synced(d1, 20_000),
            VSAN_OK,
            "{}",
            last_error()
        );
        assert_eq!(
            vsan_disk_wait_synced(d2, 20_000),
            VSAN_OK,
            "{}",
            last_error()
        );
        let mut st: vsan_disk_status = std::mem::zeroed();
        assert_eq!(vsan_disk_get_status(d1, &mut st), VSAN_OK);
        assert!(st.mirrored);
        assert_eq!((st.link, st.peer_id), (VSAN_LINK_CONNECTED, 2));
        assert_eq!((st.proof, st.unproven_since_ms), (VSAN_PROOF_HANDSHAKE, 0));
        let transport = std::ffi::CStr::from_ptr(st.transport.as_ptr());
        assert_eq!(transport.to_str().unwrap(), "tcp");

        let data: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(
            vsan_disk_write(d1, 1 << 20, data.as_ptr().cast(), data.len(), 0),
            VSAN_OK
        );
        let (tx, rx) = mpsc::channel::<(vsan_result, u64)>();
        let ud = &tx as *const _ as *mut c_void;
        let blocks: Vec<Vec<u8>> = (0..64u8).map(|i| vec![i ^ 0x5a; 4096]).collect();
        for (i, b) in blocks.iter().enumerate() {
            let r = vsan_disk_submit_write(
                d1,
                (2 << 20) + i as u64 * 4096,
                b.as_ptr().cast(),
                4096,
                if i % 8 == 0 { VSAN_IO_FUA } else { 0 },
                Some(to_channel),
                ud,
                i as u64,
            );
            assert_eq!(r, VSAN_OK);
        }
        for _ in 0..64 {
            assert_eq!(rx.recv().unwrap().0, VSAN_OK);
        }
        assert_eq!(
            vsan_disk_submit_flush(d1, Some(to_channel), ud, 99),
            VSAN_OK
        );
        assert_eq!(rx.recv().unwrap(), (VSAN_OK, 99));

        let mut back = vec![0u8; data.len()];
        assert_eq!(
            vsan_disk_read(d2, 1 << 20, back.as_mut_ptr().cast(), back.len()),
            VSAN_OK
        );
        assert!(back == data, "node 2 reads what node 1 wrote");
        let mut region = vec![0u8; 64 * 4096];
        assert_eq!(
            vsan_disk_read(d2, 2 << 20, region.as_mut_ptr().cast(), region.len()),
            VSAN_OK
        );
        for (i, b) in blocks.iter().enumerate() {
            assert!(region[i * 4096..][..4096] == b[..], "block {i} on node 2");
        }
        assert_eq!(vsan_disk_free(d1), VSAN_OK);
        assert_eq!(vsan_disk_free(d2), VSAN_OK);
        assert_eq!(vsan_node_free(n1), VSAN_OK, "{}", last_error());
        assert_eq!(vsan_node_free(n2), VSAN_OK, "{}", last_error());
    }
    let i1 = std::fs::read(dir.join("n1/vol0.img")).unwrap();
    let i2 = std::fs::read(dir.join("n2/vol0.img")).unwrap();
    assert!(i1 == i2, "replicas identical after close");
    let _ = std::fs::remove_dir_all(&dir);
}

struct Reentry {
    disk: *mut vsan_disk,
    inner: mpsc::Sender<(vsan_result, vsan_result)>,
}

unsafe extern "C" fn try_blocking(userdata: *mut c_void, result: vsan_result, _tag: u64) {
    // SAFETY: the test passes a `*const Reentry` that outlives the I/O.
    let r = unsafe { &*(userdata as *const Reentry) };
    let mut byte = [0u8; 512];
    // SAFETY: a valid buffer; the handle is checked by the library.
    let blocked = unsafe { vsan_disk_read(r.disk, 0, byte.as_mut_ptr().cast(), 512) };
    let _ = r.inner.send((result, blocked));
}

#[test]
fn blocking_calls_from_a_callback_and_closing_handles() {
    let node = mem_node("1MiB");
    let disk = open(node, "vol0");
    let (tx, rx) = mpsc::channel();
    let re = Reentry { disk, inner: tx };
    let mut buf = vec![0u8; 4096];
    // SAFETY: buffers and userdata outlive the I/O (awaited below).
    unsafe {
        let r = vsan_disk_submit_read(
            disk,
            0,
            buf.as_mut_ptr().cast(),
            4096,
            Some(try_blocking),
            &re as *const _ as *mut c_void,
            1,
        );
        assert_eq!(r, VSAN_OK);
        assert_eq!(rx.recv().unwrap(), (VSAN_OK, VSAN_ERR_WRONG_THREAD));
        // NULL callback, NULL buffer, overflowing ranges.
        assert_eq!(
            vsan_disk_submit_read(
                disk,
                0,
                buf.as_mut_ptr().cast(),
                4096,
                None,
                ptr::null_mut(),
                0
            ),
            VSAN_ERR_NULL_POINTER
        );
        assert_eq!(
            vsan_disk_read(disk, 0, ptr::null_mut(), 4096),
            VSAN_ERR_NULL_POINTER
        );
        assert_eq!(
            vsan_disk_read(disk, u64::MAX - 511, buf.as_mut_ptr().cast(), 4096),
            VSAN_ERR_OVERFLOW
        );
        assert_eq!(
            vsan_disk_discard(disk, u64::MAX, 4096, 0),
            VSAN_ERR_OVERFLOW
        );
        assert_eq!(
            vsan_disk_write(disk, 0, buf.as_ptr().cast(), 4096, 0x80),
            VSAN_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            vsan_disk_read(disk, 1, buf.as_mut_ptr().cast(), 4096),
            VSAN_ERR_INVALID_ARGUMENT
        );
        // A node handle is not a disk handle, and the other way round.
        assert_eq!(vsan_disk_flush(node.cast()), VSAN_ERR_BAD_HANDLE);
        assert_eq!(vsan_node_free(disk.cast()), VSAN_ERR_BAD_HANDLE);
        assert_eq!(
            vsan_disk_flush(0x1230 as *mut vsan_disk),
            VSAN_ERR_BAD_HANDLE
        );
        // Outputs untouched on failure.
        let mut g = vsan_geometry {
            size: 7,
            block_size: 7,
            max_io: 7,
        };
        assert_eq!(
            vsan_disk_geometry(0x10 as *mut vsan_disk, &mut g),
            VSAN_ERR_BAD_HANDLE
        );
        assert_eq!((g.size, g.block_size, g.max_io), (7, 7, 7));
        let mut raw = [0u64; 4];
        let odd = (raw.as_mut_ptr() as *mut u8).add(1) as *mut vsan_geometry;
        assert_eq!(vsan_disk_geometry(disk, odd), VSAN_ERR_MISALIGNED);
        assert_eq!(raw, [0; 4]);
        // Closing the node invalidates its disks' handles.
        assert_eq!(vsan_node_free(node), VSAN_OK);
        assert_eq!(vsan_disk_flush(disk), VSAN_ERR_BAD_HANDLE);
        assert_eq!(vsan_disk_free(disk), VSAN_ERR_BAD_HANDLE);
    }
}

/// A mirrored disk whose peer never comes: the status says its replica is unproven (and
/// since when), a read fails after the peer timeout instead of answering from it, and
/// `vsan_disk_declare_current` serves it (once).
#[test]
fn an_unproven_replica_is_reported_and_served_only_once_declared_current() {
    let dir = std::env::temp_dir().join(format!("vsan-ffi-unproven-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let node = node_from(&format!(
        "[node]\nid = 1\ndata_dir = {:?}\nthreads = 2\npeer_timeout_ms = 300\n\n\
         [[peer]]\nid = 2\naddress = \"127.0.0.1:1\"\n\n\
         [[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"file\"\npeer = 2\n",
        dir.display().to_string()
    ));
    let disk = open(node, "vol0");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    // SAFETY: every pointer passed is valid for its call.
    unsafe {
        let mut st: vsan_disk_status = std::mem::zeroed();
        assert_eq!(vsan_disk_get_status(disk, &mut st), VSAN_OK);
        assert_eq!(st.proof, VSAN_PROOF_NONE);
        assert!(
            st.unproven_since_ms > 0 && st.unproven_since_ms <= now_ms,
            "{}",
            st.unproven_since_ms
        );
        let mut buf = vec![0u8; 4096];
        assert_eq!(
            vsan_disk_read(disk, 0, buf.as_mut_ptr().cast(), buf.len()),
            VSAN_ERR_IO
        );
        assert_eq!(vsan_disk_declare_current(disk), VSAN_OK, "{}", last_error());
        assert_eq!(vsan_disk_get_status(disk, &mut st), VSAN_OK);
        assert_eq!((st.proof, st.unproven_since_ms), (VSAN_PROOF_OPERATOR, 0));
        assert_eq!(st.link, VSAN_LINK_DEGRADED);
        assert_eq!(
            vsan_disk_read(disk, 0, buf.as_mut_ptr().cast(), buf.len()),
            VSAN_OK
        );
        assert_eq!(vsan_disk_declare_current(disk), VSAN_ERR_WRONG_STATE);
        assert!(
            last_error().contains("proven current already"),
            "{}",
            last_error()
        );
        assert_eq!(vsan_disk_free(disk), VSAN_OK);
        assert_eq!(vsan_node_free(node), VSAN_OK, "{}", last_error());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
