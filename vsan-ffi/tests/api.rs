//! The C ABI driven from Rust: nodes, disks, blocking and asynchronous I/O, status, and
//! the boundary rules (NULLs, overflow, closed handles, callbacks' threads).

use std::ffi::c_void;
use std::ptr;
use std::sync::mpsc;

use vsan::*;

use crate::common;
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

/// The C ABI at the edges of a node's and a disk's life, and of the callback rules: a
/// refused blocking call has no effect, closing a node with held or in-flight I/O runs each
/// callback once and lets nothing outlive it, a half-started node releases everything, and
/// oversized requests are refused before any copy.
mod lifecycle {
    use std::ffi::{CString, c_void};
    use std::ptr;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use vsan::*;

    use crate::common::{last_error, mem_node, node_from, open, to_channel, try_node};

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vsan-review-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Run `f` on a thread; fail the test if it takes longer than `limit` (the thread is
    /// left behind: the test process ends anyway).
    fn within<T: Send + 'static>(
        limit: Duration,
        what: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(limit) {
            Ok(v) => v,
            Err(_) => panic!("{what}: still running after {limit:?} (hang)"),
        }
    }

    unsafe extern "C" fn ignore(_: *mut c_void, _: vsan_result, _: u64) {}

    // Finding: a blocking write/zeroing/discard refused with VSAN_ERR_WRONG_THREAD (or
    // VSAN_ERR_CLOSED) had already been carried out: the device's future was made before
    // the checks, and devices act when the future is made.

    struct WriteCtx {
        disk: *mut vsan_disk,
        tx: mpsc::Sender<(vsan_result, vsan_result, vsan_result)>,
    }

    unsafe extern "C" fn write_from_callback(
        userdata: *mut c_void,
        _result: vsan_result,
        _tag: u64,
    ) {
        // SAFETY: the test passes a `*const WriteCtx` that outlives the I/O.
        let c = unsafe { &*(userdata as *const WriteCtx) };
        let data = [0xabu8; 512];
        // SAFETY: valid buffer; the handle is checked by the library.
        let w = unsafe { vsan_disk_write(c.disk, 0, data.as_ptr().cast(), 512, 0) };
        // SAFETY: as above.
        let z = unsafe { vsan_disk_write_zeroes(c.disk, 4096, 512, 0) };
        // SAFETY: as above.
        let d = unsafe { vsan_disk_discard(c.disk, 8192, 512, 0) };
        let _ = c.tx.send((w, z, d));
    }

    #[test]
    fn refused_blocking_write_from_a_callback_has_no_effect() {
        let node = mem_node("1MiB");
        let disk = open(node, "vol0");
        let (tx, rx) = mpsc::channel();
        let ctx = WriteCtx { disk, tx };
        // SAFETY: buffers and userdata outlive the I/Os (awaited below).
        unsafe {
            let cd = vec![0xcdu8; 12288];
            assert_eq!(
                vsan_disk_write(disk, 0, cd.as_ptr().cast(), cd.len(), 0),
                VSAN_OK
            );
            let mut buf = vec![0u8; 512];
            let r = vsan_disk_submit_read(
                disk,
                0,
                buf.as_mut_ptr().cast(),
                512,
                Some(write_from_callback),
                &ctx as *const _ as *mut c_void,
                1,
            );
            assert_eq!(r, VSAN_OK);
            let (w, z, d) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert_eq!(
                (w, z, d),
                (
                    VSAN_ERR_WRONG_THREAD,
                    VSAN_ERR_WRONG_THREAD,
                    VSAN_ERR_WRONG_THREAD
                )
            );
            let mut back = vec![0u8; 12288];
            assert_eq!(
                vsan_disk_read(disk, 0, back.as_mut_ptr().cast(), back.len()),
                VSAN_OK
            );
            assert!(
                back[..512].iter().all(|&b| b == 0xcd),
                "vsan_disk_write returned VSAN_ERR_WRONG_THREAD but wrote block 0 anyway"
            );
            assert!(
                back[4096..4608].iter().all(|&b| b == 0xcd),
                "vsan_disk_write_zeroes returned VSAN_ERR_WRONG_THREAD but zeroed anyway"
            );
            assert!(
                back[8192..8704].iter().all(|&b| b == 0xcd),
                "vsan_disk_discard returned VSAN_ERR_WRONG_THREAD but discarded anyway"
            );
            assert_eq!(vsan_disk_free(disk), VSAN_OK);
            assert_eq!(vsan_node_free(node), VSAN_OK);
        }
    }

    // Held: with `quorum = "suspend"` and the peer away, vsan_node_free returns, and a held
    // write's callback runs once, with VSAN_ERR_CLOSED, after the drain limit (30 s), as the
    // header says.

    fn suspended_node(dir: &std::path::Path) -> *mut vsan_node {
        node_from(&format!(
            "[node]\nid = 1\ndata_dir = {:?}\nthreads = 2\npeer_timeout_ms = 300\n\
         witness = \"127.0.0.1:1\"\nquorum = \"suspend\"\n\n\
         [[peer]]\nid = 2\naddress = \"127.0.0.1:1\"\n\n\
         [[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"mem\"\npeer = 2\n",
            dir.display().to_string()
        ))
    }

    #[test]
    fn node_free_returns_with_a_suspended_mirror() {
        let dir = scratch("suspend");
        let node = suspended_node(&dir) as usize;
        // Let the link time out (Waiting -> Degraded, suspended).
        std::thread::sleep(Duration::from_secs(2));
        let r = within(Duration::from_secs(90), "vsan_node_free", move || {
            // SAFETY: a handle from vsan_node_new_from_toml.
            unsafe { vsan_node_free(node as *mut vsan_node) }
        });
        assert_eq!(r, VSAN_OK, "{}", last_error());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn callback_runs_once_when_the_node_closes_with_a_held_write() {
        let dir = scratch("suspend-io");
        let node = suspended_node(&dir);
        let disk = open(node, "vol0");
        std::thread::sleep(Duration::from_secs(2));
        let (tx, rx) = mpsc::channel::<(vsan_result, u64)>();
        let tx: &'static mpsc::Sender<_> = Box::leak(Box::new(tx));
        let data = vec![1u8; 4096];
        // SAFETY: valid buffer (copied during the call), leaked userdata.
        let r = unsafe {
            vsan_disk_submit_write(
                disk,
                0,
                data.as_ptr().cast(),
                4096,
                0,
                Some(to_channel),
                tx as *const _ as *mut c_void,
                5,
            )
        };
        assert_eq!(r, VSAN_OK);
        assert!(
            rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "the write is held (suspended): precondition"
        );
        let node = node as usize;
        let closer = std::thread::spawn(move || {
            // SAFETY: a handle from vsan_node_new_from_toml.
            unsafe { vsan_node_free(node as *mut vsan_node) }
        });
        match rx.recv_timeout(Duration::from_secs(90)) {
            Ok((code, tag)) => assert_eq!((code, tag), (VSAN_ERR_CLOSED, 5)),
            Err(_) => panic!("the held write's callback never ran after vsan_node_free"),
        }
        closer.join().unwrap();
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "a second callback"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Open the node's disk over and over on another thread while the node closes; returns
    /// the handles that thread got.
    fn open_while_closing(node: *mut vsan_node) -> Vec<usize> {
        let node = node as usize;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = std::sync::Arc::clone(&stop);
        let opener = std::thread::spawn(move || {
            let name = CString::new("vol0").unwrap();
            let mut got = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let mut disk = ptr::null_mut();
                // SAFETY: valid arguments; the node handle is checked.
                let r = unsafe { vsan_disk_open(node as *mut vsan_node, name.as_ptr(), &mut disk) };
                if r != VSAN_OK {
                    break;
                }
                got.push(disk as usize);
            }
            got
        });
        std::thread::sleep(Duration::from_millis(5));
        // SAFETY: a handle from vsan_node_new_from_toml.
        assert_eq!(unsafe { vsan_node_free(node as *mut vsan_node) }, VSAN_OK);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        opener.join().unwrap()
    }

    // Finding: vsan_disk_open racing vsan_node_free registered a disk handle after the
    // node's disk handles were dropped: it outlived the node.

    #[test]
    fn disk_opened_during_node_free_does_not_outlive_the_node() {
        let mut survivors = 0;
        for _ in 0..40 {
            let node = mem_node("1MiB");
            for d in open_while_closing(node) {
                let mut g = vsan_geometry::default();
                // SAFETY: the handle is checked by the library.
                if unsafe { vsan_disk_geometry(d as *mut vsan_disk, &mut g) } == VSAN_OK {
                    survivors += 1;
                    // SAFETY: as above.
                    unsafe { vsan_disk_free(d as *mut vsan_disk) };
                }
            }
        }
        assert_eq!(
            survivors, 0,
            "disk handles still valid after vsan_node_free returned VSAN_OK"
        );
    }

    // The two findings above together: a handle that outlived its node still wrote into the
    // image after vsan_node_free flushed and closed it.

    #[test]
    fn no_write_reaches_the_image_after_node_free() {
        let dir = scratch("after-free");
        let toml = format!(
            "[node]\nid = 1\ndata_dir = {:?}\nthreads = 2\n\n\
         [[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"file\"\n",
            dir.display().to_string()
        );
        for _ in 0..40 {
            let handles = open_while_closing(node_from(&toml));
            let Some(&last) = handles.last() else {
                continue;
            };
            let data = [0x5au8; 512];
            // SAFETY: valid buffer; handle checked by the library.
            let r =
                unsafe { vsan_disk_write(last as *mut vsan_disk, 0, data.as_ptr().cast(), 512, 0) };
            assert_eq!(r, VSAN_ERR_BAD_HANDLE);
            for d in handles {
                // SAFETY: handles checked by the library.
                unsafe { vsan_disk_free(d as *mut vsan_disk) };
            }
            let image = std::fs::read(dir.join("vol0.img")).unwrap();
            assert!(
                image[..512] != data[..],
                "vsan_disk_write returned {r} after vsan_node_free, and the image holds its data"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    // A callback running inline in a submit that returns VSAN_OK must not change the
    // submitting thread's last-error message ("a successful call leaves it alone").

    #[test]
    fn successful_submit_leaves_the_last_error_alone() {
        let node = mem_node("1MiB");
        let disk = open(node, "vol0");
        // SAFETY: valid arguments, except the deliberately NULL buffer.
        unsafe {
            assert_eq!(
                vsan_disk_read(disk, 0, ptr::null_mut(), 512),
                VSAN_ERR_NULL_POINTER
            );
            let before = last_error();
            let mut buf = vec![0u8; 512];
            let r = vsan_disk_submit_read(
                disk,
                0,
                buf.as_mut_ptr().cast(),
                512,
                Some(ignore),
                ptr::null_mut(),
                0,
            );
            assert_eq!(r, VSAN_OK);
            assert_eq!(
                last_error(),
                before,
                "a call that returned VSAN_OK changed the message"
            );
            vsan_disk_free(disk);
            vsan_node_free(node);
        }
    }

    // Held: a node whose second disk fails to open leaves nothing behind: the same
    // replication and NBD ports and the first disk's files can be used at once.

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn half_started_node_releases_everything() {
        let dir = scratch("half");
        let (rep, nbd) = (free_port(), free_port());
        // disk b: metadata without image: refused after disk a (file, mirrored, dialing)
        // was opened.
        std::fs::write(dir.join("b.meta"), b"x").unwrap();
        let toml = |with_b: bool| {
            let mut t = format!(
                "[node]\nid = 1\ndata_dir = {:?}\nlisten = \"127.0.0.1:{rep}\"\nthreads = 2\n\n\
             [[peer]]\nid = 2\naddress = \"127.0.0.1:1\"\n\n\
             [[disk]]\nname = \"a\"\nsize = \"1MiB\"\nbacking = \"file\"\npeer = 2\n\
             nbd = \"127.0.0.1:{nbd}\"\n\n",
                dir.display().to_string()
            );
            if with_b {
                t.push_str(
                    "[[disk]]\nname = \"b\"\nsize = \"1MiB\"\nbacking = \"file\"\npeer = 2\n",
                );
            }
            t
        };
        let t0 = Instant::now();
        let (code, _) = try_node(&toml(true)).unwrap_err();
        assert_eq!(code, VSAN_ERR_IO);
        assert!(
            t0.elapsed() < Duration::from_secs(4),
            "failed start took {:?}",
            t0.elapsed()
        );
        let node = node_from(&toml(false));
        std::net::TcpStream::connect(("127.0.0.1", nbd)).expect("NBD served");
        // A second node on the same addresses: the address is in use.
        let (code, msg) = try_node(&toml(false)).unwrap_err();
        assert_eq!(code, VSAN_ERR_IN_USE, "{msg}");
        // SAFETY: a handle from vsan_node_new_from_toml.
        assert_eq!(unsafe { vsan_node_free(node) }, VSAN_OK, "{}", last_error());
        let _ = std::fs::remove_dir_all(&dir);
    }

    // Held: callbacks that submit again (inline completions nested past the inline limit,
    // then continued on the runtime): each callback once, in order.

    struct Chain {
        disk: *mut vsan_disk,
        tx: mpsc::Sender<(vsan_result, u64)>,
        buf: Vec<u8>,
    }

    unsafe extern "C" fn chain(userdata: *mut c_void, result: vsan_result, tag: u64) {
        // SAFETY: the test passes a leaked `*mut Chain`.
        let c = unsafe { &mut *(userdata as *mut Chain) };
        let _ = c.tx.send((result, tag));
        if tag < 100 {
            // SAFETY: valid buffer (owned by the leaked chain); handle checked.
            let r = unsafe {
                vsan_disk_submit_read(
                    c.disk,
                    0,
                    c.buf.as_mut_ptr().cast(),
                    512,
                    Some(chain),
                    userdata,
                    tag + 1,
                )
            };
            if r != VSAN_OK {
                let _ = c.tx.send((r, 1000 + tag));
            }
        }
    }

    #[test]
    fn deep_resubmission_from_callbacks_each_fires_once() {
        let node = mem_node("1MiB");
        let disk = open(node, "vol0");
        let (tx, rx) = mpsc::channel();
        let c: &'static mut Chain = Box::leak(Box::new(Chain {
            disk,
            tx,
            buf: vec![0; 512],
        }));
        let buf = c.buf.as_mut_ptr();
        let ud = c as *mut Chain as *mut c_void;
        // SAFETY: leaked userdata and buffer.
        let r = unsafe { vsan_disk_submit_read(disk, 0, buf.cast(), 512, Some(chain), ud, 0) };
        assert_eq!(r, VSAN_OK);
        let mut seen = Vec::new();
        while let Ok((r, t)) = rx.recv_timeout(Duration::from_secs(5)) {
            assert_eq!(r, VSAN_OK, "tag {t}");
            seen.push(t);
            if t == 100 {
                break;
            }
        }
        assert_eq!(seen, (0..=100).collect::<Vec<_>>());
        // SAFETY: handles from this test.
        unsafe {
            assert_eq!(vsan_disk_free(disk), VSAN_OK);
            assert_eq!(vsan_node_free(node), VSAN_OK);
        }
    }

    // Finding: vsan_disk_write / vsan_disk_submit_write copied `len` bytes of the caller's
    // buffer before checking the length against the disk: a length far past max_io, from a
    // buffer valid for it (a large mapping), aborted the process ("memory allocation of N
    // bytes failed"). Run in a child process: an abort kills only it.

    unsafe extern "C" {
        fn mmap(
            addr: *mut c_void,
            len: usize,
            prot: i32,
            flags: i32,
            fd: i32,
            off: i64,
        ) -> *mut c_void;
        fn munmap(addr: *mut c_void, len: usize) -> i32;
    }

    #[test]
    fn huge_write_length_is_refused_before_copying() {
        const NAME: &str = "huge_write_length_is_refused_before_copying";
        if std::env::var_os("VSAN_REVIEW_CHILD").is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
                .env("VSAN_REVIEW_CHILD", "1")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "child: {:?}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        let len: usize = 1 << 40;
        // PROT_READ; MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE.
        // SAFETY: a fresh private read-only anonymous mapping, not reserved: reading it
        // gives zeros.
        let p = unsafe { mmap(ptr::null_mut(), len, 1, 0x02 | 0x20 | 0x4000, -1, 0) };
        assert!(p as isize != -1, "mmap");
        let node = mem_node("1MiB");
        let disk = open(node, "vol0");
        // SAFETY: `p` is valid for reads of `len` bytes.
        unsafe {
            let r = vsan_disk_write(disk, 0, p, len, 0);
            assert_eq!(r, VSAN_ERR_INVALID_ARGUMENT, "{}", last_error());
            let r = vsan_disk_submit_write(disk, 0, p, len, 0, Some(ignore), ptr::null_mut(), 0);
            assert_eq!(r, VSAN_ERR_INVALID_ARGUMENT, "{}", last_error());
            vsan_disk_free(disk);
            vsan_node_free(node);
            munmap(p, len);
        }
    }
}
