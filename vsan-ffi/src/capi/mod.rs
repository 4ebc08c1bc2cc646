//! The C ABI over [`crate::node`]: result codes and the rules every entry point follows
//! (this file), node and disk handles (`handles.rs`), opening, closing and inquiring
//! (`api.rs`), and blocking and asynchronous I/O (`io.rs`).

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};

use vsan_core::ErrorKind;

mod api;
mod handles;
mod io;

pub use api::*;
pub use handles::{disk_for_rust, vsan_disk, vsan_node};
pub use io::*;

/// A result code: [`VSAN_OK`] (0) or an error. See `vsan_result_str`.
pub type vsan_result = i32;

/// Success.
pub const VSAN_OK: vsan_result = 0;
/// An argument is malformed (misaligned offset or length, zero length, a bad config).
pub const VSAN_ERR_INVALID_ARGUMENT: vsan_result = 1;
/// The request reaches past the end of the disk.
pub const VSAN_ERR_OUT_OF_RANGE: vsan_result = 2;
/// The storage failed the operation.
pub const VSAN_ERR_IO: vsan_result = 3;
/// Not supported by this disk or in this state.
pub const VSAN_ERR_NOT_SUPPORTED: vsan_result = 4;
/// The disk is read-only.
pub const VSAN_ERR_READ_ONLY: vsan_result = 5;
/// The disk or node has been shut down.
pub const VSAN_ERR_CLOSED: vsan_result = 6;
/// The operation did not complete in time.
pub const VSAN_ERR_TIMEOUT: vsan_result = 7;
/// Stored data or metadata failed a consistency check.
pub const VSAN_ERR_CORRUPT: vsan_result = 8;
/// A peer or client broke the protocol, or failed authentication.
pub const VSAN_ERR_PROTOCOL: vsan_result = 9;
/// The resource is already in use.
pub const VSAN_ERR_IN_USE: vsan_result = 10;
/// Something named does not exist.
pub const VSAN_ERR_NOT_FOUND: vsan_result = 11;
/// The backing store is out of space.
pub const VSAN_ERR_NO_SPACE: vsan_result = 12;
/// A mirrored disk without its peer and without quorum may not serve the request.
pub const VSAN_ERR_NO_QUORUM: vsan_result = 13;
/// The request is well-formed but refused in the disk's current state (a detach with the
/// peer away, a verify while a resync runs); the error detail says which state.
pub const VSAN_ERR_WRONG_STATE: vsan_result = 14;
/// A pointer argument that must not be NULL was NULL.
pub const VSAN_ERR_NULL_POINTER: vsan_result = 64;
/// A length or offset overflows (offset + length past 2^64, a length past `size_t`).
pub const VSAN_ERR_OVERFLOW: vsan_result = 65;
/// The handle was closed already, or is not a handle this library made.
pub const VSAN_ERR_BAD_HANDLE: vsan_result = 66;
/// The library panicked inside the call (a bug); the call had no effect it reports.
pub const VSAN_ERR_PANIC: vsan_result = 67;
/// An output buffer is too small; the call says how large it must be.
pub const VSAN_ERR_BUFFER_TOO_SMALL: vsan_result = 68;
/// An output pointer is not aligned for its type.
pub const VSAN_ERR_MISALIGNED: vsan_result = 69;
/// A blocking function was called from a completion callback (or a thread of the
/// library's runtime), where it could deadlock: submit asynchronously instead.
pub const VSAN_ERR_WRONG_THREAD: vsan_result = 70;

/// Major version of this library (the SONAME's number).
pub const VSAN_VERSION_MAJOR: u32 = 0;
/// Minor version.
pub const VSAN_VERSION_MINOR: u32 = 1;
/// Patch version.
pub const VSAN_VERSION_PATCH: u32 = 0;

/// The code for an error kind of the library.
pub fn result_of(kind: ErrorKind) -> vsan_result {
    kind as vsan_result
}

/// A static, NUL-terminated description of `code`.
fn describe(code: vsan_result) -> &'static std::ffi::CStr {
    match code {
        VSAN_OK => c"ok",
        VSAN_ERR_INVALID_ARGUMENT => c"invalid argument",
        VSAN_ERR_OUT_OF_RANGE => c"out of range",
        VSAN_ERR_IO => c"I/O error",
        VSAN_ERR_NOT_SUPPORTED => c"not supported",
        VSAN_ERR_READ_ONLY => c"read-only",
        VSAN_ERR_CLOSED => c"closed",
        VSAN_ERR_TIMEOUT => c"timed out",
        VSAN_ERR_CORRUPT => c"corrupt",
        VSAN_ERR_PROTOCOL => c"protocol error",
        VSAN_ERR_IN_USE => c"in use",
        VSAN_ERR_NOT_FOUND => c"not found",
        VSAN_ERR_NO_SPACE => c"no space",
        VSAN_ERR_NO_QUORUM => c"no quorum",
        VSAN_ERR_WRONG_STATE => c"refused in the current state",
        VSAN_ERR_NULL_POINTER => c"NULL pointer",
        VSAN_ERR_OVERFLOW => c"length or offset overflows",
        VSAN_ERR_BAD_HANDLE => c"closed or unknown handle",
        VSAN_ERR_PANIC => c"internal error (panic)",
        VSAN_ERR_BUFFER_TOO_SMALL => c"buffer too small",
        VSAN_ERR_MISALIGNED => c"misaligned pointer",
        VSAN_ERR_WRONG_THREAD => c"blocking call from a callback thread",
        _ => c"unknown result code",
    }
}

thread_local! {
    /// The message of the last failed call on this thread.
    pub(crate) static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// An error code and its message, as entry points return them.
pub(crate) type Failure = (vsan_result, String);

/// A library error as a code and message.
pub(crate) fn core_failure(e: vsan_core::Error) -> Failure {
    (result_of(e.kind()), e.to_string())
}

/// Refuse a blocking call from a completion callback or a runtime thread: waiting there
/// could wait for the very thread that waits.
pub(crate) fn not_in_callback() -> Result<(), Failure> {
    if io::IN_CALLBACK.get() || tokio::runtime::Handle::try_current().is_ok() {
        return Err((
            VSAN_ERR_WRONG_THREAD,
            "blocking call from a completion callback or a runtime thread; use the \
             vsan_disk_submit_* functions there"
                .into(),
        ));
    }
    Ok(())
}

/// Check an output pointer: not NULL, aligned for its type.
pub(crate) fn out_ptr<T>(p: *mut T, what: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err((VSAN_ERR_NULL_POINTER, format!("{what} is NULL")));
    }
    if (p as usize) % std::mem::align_of::<T>() != 0 {
        return Err((
            VSAN_ERR_MISALIGNED,
            format!(
                "{what} {p:p} is not aligned to {} bytes",
                std::mem::align_of::<T>()
            ),
        ));
    }
    Ok(())
}

/// Records `message` as this thread's last error and returns `code`.
fn fail(code: vsan_result, message: impl Into<String>) -> vsan_result {
    let message = message.into();
    LAST_ERROR.with(|m| *m.borrow_mut() = message);
    code
}

/// Runs an entry point's body: its error becomes a code plus this thread's message, and
/// a panic becomes [`VSAN_ERR_PANIC`] instead of unwinding into C.
fn call(name: &str, body: impl FnOnce() -> Result<(), Failure>) -> vsan_result {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => VSAN_OK,
        Ok(Err((code, message))) => fail(code, format!("{name}: {message}")),
        Err(panic) => fail(
            VSAN_ERR_PANIC,
            format!("{name}: internal error: {}", panic_message(&*panic)),
        ),
    }
}

/// What a caught panic says.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// A static description of a result code ("ok", "invalid argument", ...; "unknown result
/// code" for a value this library does not define).
///
/// Thread-safe. Never returns NULL; the string is static: do not free it.
#[unsafe(no_mangle)]
pub extern "C" fn vsan_result_str(code: vsan_result) -> *const c_char {
    describe(code).as_ptr()
}

/// The library's version as a static string ("0.1.0"). Thread-safe; do not free it.
#[unsafe(no_mangle)]
pub extern "C" fn vsan_version() -> *const c_char {
    static VERSION: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(
        concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes(),
    ) {
        Ok(v) => v,
        Err(_) => c"unknown",
    };
    VERSION.as_ptr()
}

/// Copies the message of the calling thread's last failed call into `buf` (`len` bytes),
/// NUL-terminated, and stores the message's length (without the NUL) in `*out_len` when
/// `out_len` is not NULL. An empty message when no call failed on this thread.
///
/// Returns [`VSAN_ERR_BUFFER_TOO_SMALL`] when the message and its NUL do not fit (nothing
/// is written to `buf`; `*out_len` says how long the message is), and
/// [`VSAN_ERR_NULL_POINTER`] when `buf` is NULL and `len` is not 0. Reading the message
/// does not change it. Thread-safe: each thread has its own message.
///
/// # Safety
/// `buf` must be valid for writes of `len` bytes (or NULL with `len` 0), and `out_len`
/// valid for one write or NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_last_error_message(
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> vsan_result {
    let message = LAST_ERROR.with(|m| m.borrow().clone());
    // The call's own failure must not replace the message it is reading.
    // SAFETY: the caller's contract is `copy_string`'s.
    let result = catch_unwind(AssertUnwindSafe(|| unsafe {
        copy_string(&message, buf, len, out_len)
    }));
    result.unwrap_or(VSAN_ERR_PANIC)
}

/// Copy `text` into the caller's `buf` (`len` bytes), NUL-terminated, storing its length
/// (without the NUL) in `*out_len` when `out_len` is not NULL, also when it does not fit
/// ([`VSAN_ERR_BUFFER_TOO_SMALL`], nothing written to `buf`).
///
/// # Safety
/// `buf` valid for writes of `len` bytes (or NULL with `len` 0); `out_len` valid for one
/// write or NULL.
pub(crate) unsafe fn copy_string(
    text: &str,
    buf: *mut c_char,
    len: usize,
    out_len: *mut usize,
) -> vsan_result {
    if buf.is_null() && len != 0 {
        return VSAN_ERR_NULL_POINTER;
    }
    if !out_len.is_null() && (out_len as usize) % std::mem::align_of::<usize>() != 0 {
        return VSAN_ERR_MISALIGNED;
    }
    let bytes = text.as_bytes();
    if !out_len.is_null() {
        // SAFETY: the caller gives a valid pointer or NULL (checked), aligned (checked).
        unsafe { out_len.write(bytes.len()) };
    }
    if bytes.len() >= len {
        return VSAN_ERR_BUFFER_TOO_SMALL;
    }
    // SAFETY: `buf` is valid for `len` bytes and `bytes.len() + 1 <= len`; the text is
    // the library's own string, so it cannot overlap the caller's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), bytes.len());
        buf.add(bytes.len()).write(0);
    }
    VSAN_OK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        let mut buf = vec![0 as c_char; 256];
        let mut n = 0usize;
        // SAFETY: a valid buffer of its length and a valid length pointer.
        let r = unsafe { vsan_last_error_message(buf.as_mut_ptr(), buf.len(), &mut n) };
        assert_eq!(r, VSAN_OK);
        // SAFETY: the call wrote a NUL-terminated string into `buf`.
        unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn codes_match_the_error_kinds_and_every_code_has_a_string() {
        // Literal values in the header (cbindgen cannot evaluate casts), one to one with
        // the library's error kinds.
        for (code, kind) in [
            (VSAN_ERR_INVALID_ARGUMENT, ErrorKind::InvalidArgument),
            (VSAN_ERR_OUT_OF_RANGE, ErrorKind::OutOfRange),
            (VSAN_ERR_IO, ErrorKind::Io),
            (VSAN_ERR_NOT_SUPPORTED, ErrorKind::NotSupported),
            (VSAN_ERR_READ_ONLY, ErrorKind::ReadOnly),
            (VSAN_ERR_CLOSED, ErrorKind::Closed),
            (VSAN_ERR_TIMEOUT, ErrorKind::Timeout),
            (VSAN_ERR_CORRUPT, ErrorKind::Corrupt),
            (VSAN_ERR_PROTOCOL, ErrorKind::Protocol),
            (VSAN_ERR_IN_USE, ErrorKind::InUse),
            (VSAN_ERR_NOT_FOUND, ErrorKind::NotFound),
            (VSAN_ERR_NO_SPACE, ErrorKind::NoSpace),
            (VSAN_ERR_NO_QUORUM, ErrorKind::NoQuorum),
            (VSAN_ERR_WRONG_STATE, ErrorKind::WrongState),
        ] {
            assert_eq!(code, result_of(kind), "{kind:?}");
            assert_eq!(
                // SAFETY: the returned pointer is a static C string.
                unsafe { std::ffi::CStr::from_ptr(vsan_result_str(code)) }
                    .to_str()
                    .unwrap(),
                kind.as_str(),
                "{kind:?}"
            );
        }
        for code in (0..=14).chain(64..=70) {
            // SAFETY: the returned pointer is a static C string.
            let s = unsafe { std::ffi::CStr::from_ptr(vsan_result_str(code)) };
            assert_ne!(s.to_str().unwrap(), "unknown result code", "code {code}");
        }
        // SAFETY: as above.
        let s = unsafe { std::ffi::CStr::from_ptr(vsan_result_str(-5)) };
        assert_eq!(s.to_str().unwrap(), "unknown result code");
        // SAFETY: as above.
        let v = unsafe { std::ffi::CStr::from_ptr(vsan_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn errors_and_panics_leave_a_message_for_the_thread() {
        let r = call("vsan_test", || {
            Err((VSAN_ERR_NULL_POINTER, "disk is NULL".into()))
        });
        assert_eq!(r, VSAN_ERR_NULL_POINTER);
        assert_eq!(last_error(), "vsan_test: disk is NULL");
        let r = call("vsan_boom", || panic!("kaboom"));
        assert_eq!(r, VSAN_ERR_PANIC);
        assert_eq!(last_error(), "vsan_boom: internal error: kaboom");
        // Success leaves the message alone; another thread has its own.
        assert_eq!(call("vsan_ok", || Ok(())), VSAN_OK);
        assert_eq!(last_error(), "vsan_boom: internal error: kaboom");
        std::thread::spawn(|| assert_eq!(last_error(), ""))
            .join()
            .unwrap();
    }

    #[test]
    fn last_error_buffer_rules() {
        fail(VSAN_ERR_IO, "0123456789");
        let mut small = [0 as c_char; 10];
        let mut n = 0usize;
        // SAFETY: valid buffer and length pointer.
        let r = unsafe { vsan_last_error_message(small.as_mut_ptr(), small.len(), &mut n) };
        assert_eq!((r, n), (VSAN_ERR_BUFFER_TOO_SMALL, 10));
        assert!(small.iter().all(|&c| c == 0), "nothing written on failure");
        // SAFETY: NULL with length 0 only asks for the length.
        let r = unsafe { vsan_last_error_message(std::ptr::null_mut(), 0, &mut n) };
        assert_eq!((r, n), (VSAN_ERR_BUFFER_TOO_SMALL, 10));
        // SAFETY: NULL with a length is refused before any write.
        let r = unsafe { vsan_last_error_message(std::ptr::null_mut(), 5, std::ptr::null_mut()) };
        assert_eq!(r, VSAN_ERR_NULL_POINTER);
        assert_eq!(last_error(), "0123456789");
    }
}
