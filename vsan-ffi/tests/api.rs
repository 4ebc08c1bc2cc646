//! The C ABI driven from Rust: nodes, disks, blocking and asynchronous I/O, status, and
//! the boundary rules (NULLs, overflow, closed handles, callbacks' threads).

use std::ffi::{CString, c_void};
use std::ptr;
use std::sync::mpsc;

use vsan::*;

fn last_error() -> String {
    let mut buf = vec![0 as std::ffi::c_char; 1024];
    // SAFETY: a valid buffer of its length.
    let r = unsafe { vsan_last_error_message(buf.as_mut_ptr(), buf.len(), ptr::null_mut()) };
    assert_eq!(r, VSAN_OK);
    // SAFETY: NUL-terminated by the call.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn mem_node(size: &str) -> *mut vsan_node {
    let toml = CString::new(format!(
        "[node]\nid = 1\ndata_dir = \"/nonexistent-vsan-test\"\nthreads = 2\n\n\
         [[disk]]\nname = \"vol0\"\nsize = \"{size}\"\nbacking = \"mem\"\n"
    ))
    .unwrap();
    let mut node = ptr::null_mut();
    // SAFETY: valid string and out pointer.
    let r = unsafe { vsan_node_new_from_toml(toml.as_ptr(), &mut node) };
    assert_eq!(r, VSAN_OK, "{}", last_error());
    node
}

fn open(node: *mut vsan_node, name: &str) -> *mut vsan_disk {
    let name = CString::new(name).unwrap();
    let mut disk = ptr::null_mut();
    // SAFETY: valid arguments.
    let r = unsafe { vsan_disk_open(node, name.as_ptr(), &mut disk) };
    assert_eq!(r, VSAN_OK, "{}", last_error());
    disk
}

unsafe extern "C" fn to_channel(userdata: *mut c_void, result: vsan_result, tag: u64) {
    // SAFETY: the tests pass a `*const mpsc::Sender` that outlives every I/O.
    let tx = unsafe { &*(userdata as *const mpsc::Sender<(vsan_result, u64)>) };
    let _ = tx.send((result, tag));
}

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
        // Errors of the request itself come through the callback.
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
            VSAN_OK
        );
        assert_eq!(rx.recv().unwrap(), (VSAN_ERR_OUT_OF_RANGE, 7));

        let mut st: vsan_disk_status = std::mem::zeroed();
        assert_eq!(vsan_disk_status(disk, &mut st), VSAN_OK);
        assert!(!st.mirrored && !st.cached);
        assert_eq!(st.link, VSAN_LINK_LOCAL);
        assert_eq!(vsan_disk_verify(disk), VSAN_ERR_NOT_SUPPORTED);

        assert_eq!(vsan_disk_free(disk), VSAN_OK);
        assert_eq!(vsan_disk_free(disk), VSAN_ERR_BAD_HANDLE);
        assert_eq!(vsan_disk_flush(disk), VSAN_ERR_BAD_HANDLE);
        assert_eq!(vsan_node_free(node), VSAN_OK);
        assert_eq!(vsan_node_free(node), VSAN_ERR_BAD_HANDLE);
    }
}
