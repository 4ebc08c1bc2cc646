//! Helpers of the C ABI's Rust tests: opening nodes and disks, reading the last error,
//! a completion callback that reports on a channel.
// Each test module uses a different part of this module.
#![allow(dead_code)]

use std::ffi::{CString, c_void};
use std::ptr;
use std::sync::mpsc;

use vsan::*;

/// The calling thread's last error message.
pub fn last_error() -> String {
    let mut buf = vec![0 as std::ffi::c_char; 1024];
    // SAFETY: a valid buffer of its length.
    let r = unsafe { vsan_last_error_message(buf.as_mut_ptr(), buf.len(), ptr::null_mut()) };
    assert_eq!(r, VSAN_OK);
    // SAFETY: NUL-terminated by the call.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Open a node from a TOML string: its handle, or the code and message.
pub fn try_node(toml: &str) -> Result<*mut vsan_node, (vsan_result, String)> {
    let toml = CString::new(toml).unwrap();
    let mut node = ptr::null_mut();
    // SAFETY: valid string and out pointer.
    let r = unsafe { vsan_node_new_from_toml(toml.as_ptr(), &mut node) };
    if r == VSAN_OK {
        Ok(node)
    } else {
        Err((r, last_error()))
    }
}

/// Open a node from a TOML string; panics when it fails.
pub fn node_from(toml: &str) -> *mut vsan_node {
    try_node(toml).unwrap_or_else(|(r, m)| panic!("open failed: {r}: {m}"))
}

/// A node with one RAM disk `vol0` of `size` ("1MiB").
pub fn mem_node(size: &str) -> *mut vsan_node {
    node_from(&format!(
        "[node]\nid = 1\ndata_dir = \"/nonexistent-vsan-test\"\nthreads = 2\n\n\
         [[disk]]\nname = \"vol0\"\nsize = \"{size}\"\nbacking = \"mem\"\n"
    ))
}

/// Open disk `name` of `node`; panics when it fails.
pub fn open(node: *mut vsan_node, name: &str) -> *mut vsan_disk {
    let name = CString::new(name).unwrap();
    let mut disk = ptr::null_mut();
    // SAFETY: valid arguments.
    let r = unsafe { vsan_disk_open(node, name.as_ptr(), &mut disk) };
    assert_eq!(r, VSAN_OK, "{}", last_error());
    disk
}

/// A completion callback whose userdata is a `*const mpsc::Sender<(vsan_result, u64)>`
/// that outlives the I/O: it sends the result and the tag.
///
/// # Safety
/// As a completion callback, with such a userdata.
pub unsafe extern "C" fn to_channel(userdata: *mut c_void, result: vsan_result, tag: u64) {
    // SAFETY: the caller passes a sender that outlives every I/O.
    let tx = unsafe { &*(userdata as *const mpsc::Sender<(vsan_result, u64)>) };
    let _ = tx.send((result, tag));
}
