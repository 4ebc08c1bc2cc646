//! I/O on a disk: blocking calls, and asynchronous submission with a completion callback.
//!
//! An asynchronous I/O is polled once on the submitting thread: when it completes at
//! once (a read the local replica serves from memory, say) its callback runs there,
//! before the submit call returns, which saves two thread hand-offs. Otherwise it
//! continues on the node's runtime and calls back from one of its threads. Inline
//! completion is limited to a few nested levels, so a callback that submits again cannot
//! grow the stack without bound.

use std::cell::Cell;
use std::ffi::c_void;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use vsan_core::{BlockDevice, IoFlags, Op};

use super::handles::{self, DiskObj, InFlight, vsan_disk};
use super::{
    Failure, VSAN_ERR_CLOSED, VSAN_ERR_INVALID_ARGUMENT, VSAN_ERR_IO, VSAN_ERR_NULL_POINTER,
    VSAN_ERR_OVERFLOW, VSAN_ERR_PANIC, call, core_failure, fail, not_in_callback, vsan_result,
};

/// Flag for writes, discards and zeroing: force unit access: the write is durable on
/// both replicas when it completes, as if a flush of it alone followed.
pub const VSAN_IO_FUA: u32 = 1;

/// A completion callback: `userdata` as given at submission, the I/O's result
/// (`VSAN_OK` or an error code; `vsan_last_error_message` on the calling thread gives
/// detail during the callback), and the caller's `tag`.
///
/// Runs exactly once per accepted submission: on the submitting thread before the
/// submit call returns when the I/O completes at once, otherwise on one of the node's
/// threads. It must not block, and must not call the blocking functions (they return
/// `VSAN_ERR_WRONG_THREAD`); it may submit more I/O, query status and close disk
/// handles.
pub type vsan_completion =
    Option<unsafe extern "C" fn(userdata: *mut c_void, result: vsan_result, tag: u64)>;

/// How deep inline completions may nest on one thread before submissions go to the
/// runtime instead.
const MAX_INLINE_DEPTH: u32 = 4;

thread_local! {
    /// Inline completions running on this thread, one inside another.
    static INLINE_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Whether this thread is inside a completion callback.
    pub(crate) static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// The callback of one accepted asynchronous I/O. It fires exactly once: with the
/// result, or with `VSAN_ERR_CLOSED` when the I/O is dropped unfinished (the node closed
/// while it was stuck).
struct Completion {
    callback: unsafe extern "C" fn(*mut c_void, vsan_result, u64),
    userdata: usize,
    tag: u64,
    fired: bool,
    // Dropped after the callback ran: closing the node waits for it.
    _in_flight: InFlight,
}

impl Completion {
    fn fire(mut self, result: Result<(), Failure>) {
        self.fired = true;
        self.invoke(result);
    }

    fn invoke(&self, result: Result<(), Failure>) {
        // The callback sees this I/O's message; the thread's own (its last failed call,
        // when the callback runs inline in a submit that succeeded) comes back after.
        let saved = super::LAST_ERROR.with(|m| std::mem::take(&mut *m.borrow_mut()));
        let code = match result {
            Ok(()) => super::VSAN_OK,
            Err((code, message)) => fail(code, message),
        };
        let was = IN_CALLBACK.replace(true);
        // SAFETY: the caller gave this function and userdata for this call (documented
        // contract); it is called exactly once.
        unsafe { (self.callback)(self.userdata as *mut c_void, code, self.tag) };
        IN_CALLBACK.set(was);
        super::LAST_ERROR.with(|m| *m.borrow_mut() = saved);
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.fired {
            self.fired = true;
            self.invoke(Err((
                VSAN_ERR_CLOSED,
                "the node closed before this I/O finished".into(),
            )));
        }
    }
}

/// Accept an asynchronous I/O: count it on the node, poll it once here, and run it on
/// the node's runtime when it does not complete at once.
fn submit(
    d: &DiskObj,
    callback: vsan_completion,
    userdata: *mut c_void,
    tag: u64,
    work: impl Future<Output = Result<(), Failure>> + Send + 'static,
) -> Result<(), Failure> {
    let callback =
        callback.ok_or_else(|| (VSAN_ERR_NULL_POINTER, "callback is NULL".to_string()))?;
    let in_flight = d.node.enter()?;
    let completion = Completion {
        callback,
        userdata: userdata as usize,
        tag,
        fired: false,
        _in_flight: in_flight,
    };
    let mut work = CatchPanic(Box::pin(work));
    let depth = INLINE_DEPTH.get();
    if depth < MAX_INLINE_DEPTH {
        let polled = {
            let _runtime = d.node.handle.enter();
            INLINE_DEPTH.set(depth + 1);
            let p = Pin::new(&mut work).poll(&mut Context::from_waker(Waker::noop()));
            INLINE_DEPTH.set(depth);
            p
        };
        if let Poll::Ready(result) = polled {
            INLINE_DEPTH.set(depth + 1);
            completion.fire(result);
            INLINE_DEPTH.set(depth);
            return Ok(());
        }
    }
    // Polled again on the runtime with a real waker, which replaces the no-op one.
    d.node.handle.spawn(async move {
        let result = work.await;
        completion.fire(result);
    });
    Ok(())
}

/// An I/O's future whose panic becomes a [`VSAN_ERR_PANIC`] result (its callback then
/// reports it) instead of unwinding through the submit call or the runtime.
struct CatchPanic(Pin<Box<dyn Future<Output = Result<(), Failure>> + Send>>);

impl Future for CatchPanic {
    type Output = Result<(), Failure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.as_mut().poll(cx))) {
            Ok(p) => p,
            Err(panic) => Poll::Ready(Err((
                VSAN_ERR_PANIC,
                format!("internal error: {}", super::panic_message(&*panic)),
            ))),
        }
    }
}

/// Run a blocking call on the disk's node. `work` makes the operation's future only
/// once the call is allowed (not in a callback, node not closing): devices may act when
/// the future is made, and a refused call must have no effect.
fn blocking<T, F: Future<Output = vsan_core::Result<T>>>(
    d: &DiskObj,
    work: impl FnOnce() -> F,
) -> Result<T, Failure> {
    not_in_callback()?;
    let _in = d.node.enter()?;
    d.node.handle.block_on(work()).map_err(core_failure)
}

/// Check a caller's buffer and the request (see [`check_request`]); returns the
/// buffer's address.
fn check_buffer(
    d: &DiskObj,
    op: Op,
    ptr: *const c_void,
    len: usize,
    offset: u64,
) -> Result<usize, Failure> {
    if len == 0 {
        return Err((VSAN_ERR_INVALID_ARGUMENT, "len is 0".into()));
    }
    if ptr.is_null() {
        return Err((VSAN_ERR_NULL_POINTER, "buf is NULL".into()));
    }
    if len > isize::MAX as usize || (ptr as usize).checked_add(len).is_none() {
        return Err((
            VSAN_ERR_OVERFLOW,
            format!("buf {ptr:p} + len {len} runs past the end of the address space"),
        ));
    }
    check_request(d, op, offset, len as u64)?;
    Ok(ptr as usize)
}

/// Check a request before anything is copied or submitted: `offset + len` must not
/// overflow ([`VSAN_ERR_OVERFLOW`]); then the disk's own rules (length not 0 and within
/// `max_io`, offset and length aligned to the block size, inside the disk).
fn check_request(d: &DiskObj, op: Op, offset: u64, len: u64) -> Result<(), Failure> {
    if offset.checked_add(len).is_none() {
        return Err((
            VSAN_ERR_OVERFLOW,
            format!("offset {offset} + len {len} overflows 64 bits"),
        ));
    }
    d.geometry.validate(op, offset, len).map_err(core_failure)
}

/// The disk and flags of a discard or zeroing (`op`) of `len` bytes at `offset`, once
/// the request is checked.
fn range_request(
    disk: *mut vsan_disk,
    op: Op,
    offset: u64,
    len: u64,
    flags: u32,
) -> Result<(Arc<DiskObj>, IoFlags), Failure> {
    let d = handles::disk(disk)?;
    check_request(&d, op, offset, len)?;
    Ok((d, self::flags(flags)?))
}

/// The device call of a discard or zeroing.
fn range_io(
    dev: &dyn BlockDevice,
    op: Op,
    offset: u64,
    len: u64,
    flags: IoFlags,
) -> vsan_core::IoFuture<'_, ()> {
    match op {
        Op::Discard => dev.discard(offset, len, flags),
        _ => dev.write_zeroes(offset, len, flags),
    }
}

/// A submitted discard or zeroing.
fn range_work(
    d: &DiskObj,
    op: Op,
    offset: u64,
    len: u64,
    flags: IoFlags,
) -> impl Future<Output = Result<(), Failure>> + Send + 'static {
    let dev: Arc<dyn BlockDevice> = Arc::clone(&d.disk.device);
    async move {
        range_io(&*dev, op, offset, len, flags)
            .await
            .map_err(core_failure)
    }
}

fn flags(bits: u32) -> Result<IoFlags, Failure> {
    IoFlags::from_bits(bits).map_err(core_failure)
}

/// Copy the bytes of a completed read into the caller's buffer.
fn copy_out(data: Bytes, buf: usize, len: usize) -> Result<(), Failure> {
    if data.len() != len {
        return Err((
            VSAN_ERR_IO,
            format!("the disk returned {} bytes for a read of {len}", data.len()),
        ));
    }
    // SAFETY: the caller keeps `buf` valid for `len` bytes of writes until the call
    // returns (blocking) or its callback runs (asynchronous), and does not read or write
    // it meanwhile (documented); `data` is the library's own memory.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf as *mut u8, len) };
    Ok(())
}

/// Copy the caller's write buffer into library memory.
///
/// # Safety
/// `buf` was checked by `check_buffer` and is valid for `len` bytes of reads.
unsafe fn copy_in(buf: usize, len: usize) -> Bytes {
    // SAFETY: as the function's contract says.
    Bytes::copy_from_slice(unsafe { std::slice::from_raw_parts(buf as *const u8, len) })
}

fn read_work(
    d: &DiskObj,
    offset: u64,
    buf: usize,
    len: usize,
) -> impl Future<Output = Result<(), Failure>> + Send + 'static {
    let dev: Arc<dyn BlockDevice> = Arc::clone(&d.disk.device);
    async move {
        let data = dev.read(offset, len).await.map_err(core_failure)?;
        copy_out(data, buf, len)
    }
}

fn write_work(
    d: &DiskObj,
    offset: u64,
    data: Bytes,
    flags: IoFlags,
) -> impl Future<Output = Result<(), Failure>> + Send + 'static {
    let dev: Arc<dyn BlockDevice> = Arc::clone(&d.disk.device);
    async move { dev.write(offset, data, flags).await.map_err(core_failure) }
}

/// Read `len` bytes at `offset` into `buf`, waiting for the data. `offset` and `len`
/// must be multiples of the block size, inside the disk, `len` at most `max_io`.
/// On a mirrored disk the read is served by the local replica when it is up to date,
/// else by the peer. A request that breaks these rules is refused before anything
/// happens (`VSAN_ERR_INVALID_ARGUMENT`, `VSAN_ERR_OUT_OF_RANGE`, `VSAN_ERR_OVERFLOW`)
/// and `buf` is left alone; `buf` is filled only when the read succeeded. `buf` needs no
/// particular alignment.
///
/// Thread-safe: any number of threads may do I/O on one disk at once. Blocking: not from
/// a completion callback (`VSAN_ERR_WRONG_THREAD`). `buf` must stay valid for the call.
///
/// # Safety
/// `disk` must be a handle (checked); `buf` valid for writes of `len` bytes (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_read(
    disk: *mut vsan_disk,
    offset: u64,
    buf: *mut c_void,
    len: usize,
) -> vsan_result {
    call("vsan_disk_read", || {
        let d = handles::disk(disk)?;
        let buf = check_buffer(&d, Op::Read, buf, len, offset)?;
        let data = blocking(&d, || d.disk.device.read(offset, len))?;
        copy_out(data, buf, len)
    })
}

/// Write `len` bytes from `buf` at `offset`, waiting until the write is acknowledged:
/// on a mirrored disk, by both replicas while they are connected. `flags` is 0 or
/// `VSAN_IO_FUA` (durable on stable storage when it returns). All or nothing: a failed
/// write has no effect a later read can see partly. `buf` is only read during the call.
///
/// Thread-safe; blocking (not from a completion callback).
///
/// # Safety
/// `disk` must be a handle (checked); `buf` valid for reads of `len` bytes (or NULL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_write(
    disk: *mut vsan_disk,
    offset: u64,
    buf: *const c_void,
    len: usize,
    flags: u32,
) -> vsan_result {
    call("vsan_disk_write", || {
        let d = handles::disk(disk)?;
        let buf = check_buffer(&d, Op::Write, buf, len, offset)?;
        let flags = self::flags(flags)?;
        blocking(&d, || {
            // SAFETY: checked above; the caller keeps it valid for the call.
            let data = unsafe { copy_in(buf, len) };
            d.disk.device.write(offset, data, flags)
        })
    })
}

/// Make every write acknowledged before this call durable (on both replicas of a
/// mirrored disk), waiting for it.
///
/// Thread-safe; blocking (not from a completion callback).
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_flush(disk: *mut vsan_disk) -> vsan_result {
    call("vsan_disk_flush", || {
        let d = handles::disk(disk)?;
        blocking(&d, || d.disk.device.flush())
    })
}

/// Discard (trim) `len` bytes at `offset`: the range may read back as zeros or as its
/// old data. `flags` is 0 or `VSAN_IO_FUA`. Blocking; thread-safe.
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_discard(
    disk: *mut vsan_disk,
    offset: u64,
    len: u64,
    flags: u32,
) -> vsan_result {
    call("vsan_disk_discard", || {
        let (d, flags) = range_request(disk, Op::Discard, offset, len, flags)?;
        blocking(&d, || {
            range_io(&*d.disk.device, Op::Discard, offset, len, flags)
        })
    })
}

/// Write zeros over `len` bytes at `offset` (the range reads back as zeros). `flags` is
/// 0 or `VSAN_IO_FUA`. Blocking; thread-safe.
///
/// # Safety
/// `disk` must be a handle (checked).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_write_zeroes(
    disk: *mut vsan_disk,
    offset: u64,
    len: u64,
    flags: u32,
) -> vsan_result {
    call("vsan_disk_write_zeroes", || {
        let (d, flags) = range_request(disk, Op::WriteZeroes, offset, len, flags)?;
        blocking(&d, || {
            range_io(&*d.disk.device, Op::WriteZeroes, offset, len, flags)
        })
    })
}

/// Submit a read of `len` bytes at `offset` into `buf`; `callback(userdata, result, tag)`
/// runs once it completes (see `vsan_completion` for which thread runs it: possibly
/// this one, before this call returns).
///
/// Returns `VSAN_OK` when the read was accepted: the callback then runs exactly once,
/// with the result. Any other result means it was refused, and the callback never runs:
/// bad arguments (the same checks as `vsan_disk_read`: alignment, range, overflow,
/// NULLs), a closed handle, a closing node. Many I/Os may be in flight at once, from any
/// number of threads; they may complete in any order.
///
/// `buf` must stay valid, and must not be read or written by the caller, until the
/// callback runs: it is filled just before.
///
/// Thread-safe; does not block (may be called from a callback).
///
/// # Safety
/// `disk` must be a handle (checked); `buf` valid for writes of `len` bytes until the
/// callback (or NULL); `callback` a function that may be called from another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_submit_read(
    disk: *mut vsan_disk,
    offset: u64,
    buf: *mut c_void,
    len: usize,
    callback: vsan_completion,
    userdata: *mut c_void,
    tag: u64,
) -> vsan_result {
    call("vsan_disk_submit_read", || {
        let d = handles::disk(disk)?;
        let buf = check_buffer(&d, Op::Read, buf, len, offset)?;
        submit(&d, callback, userdata, tag, read_work(&d, offset, buf, len))
    })
}

/// Submit a write of `len` bytes from `buf` at `offset` (`flags`: 0 or `VSAN_IO_FUA`);
/// the callback runs once both replicas acknowledged it (see `vsan_disk_submit_read` for
/// the rules). The data is copied before this call returns: `buf` may be reused at once.
/// Thread-safe; does not block.
///
/// # Safety
/// `disk` must be a handle (checked); `buf` valid for reads of `len` bytes during the
/// call (or NULL); `callback` a function that may be called from another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_submit_write(
    disk: *mut vsan_disk,
    offset: u64,
    buf: *const c_void,
    len: usize,
    flags: u32,
    callback: vsan_completion,
    userdata: *mut c_void,
    tag: u64,
) -> vsan_result {
    call("vsan_disk_submit_write", || {
        let d = handles::disk(disk)?;
        let buf = check_buffer(&d, Op::Write, buf, len, offset)?;
        let flags = self::flags(flags)?;
        if callback.is_none() {
            return Err((VSAN_ERR_NULL_POINTER, "callback is NULL".into()));
        }
        // SAFETY: checked above; valid for the call.
        let data = unsafe { copy_in(buf, len) };
        submit(
            &d,
            callback,
            userdata,
            tag,
            write_work(&d, offset, data, flags),
        )
    })
}

/// Submit a flush: the callback runs once every write acknowledged before this call is
/// durable. See `vsan_disk_submit_read` for the rules. Thread-safe; does not block.
///
/// # Safety
/// `disk` must be a handle (checked); `callback` a function that may be called from
/// another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_submit_flush(
    disk: *mut vsan_disk,
    callback: vsan_completion,
    userdata: *mut c_void,
    tag: u64,
) -> vsan_result {
    call("vsan_disk_submit_flush", || {
        let d = handles::disk(disk)?;
        let dev = Arc::clone(&d.disk.device);
        submit(&d, callback, userdata, tag, async move {
            dev.flush().await.map_err(core_failure)
        })
    })
}

/// Submit a discard of `len` bytes at `offset` (`flags`: 0 or `VSAN_IO_FUA`). See
/// `vsan_disk_submit_read` for the rules. Thread-safe; does not block.
///
/// # Safety
/// `disk` must be a handle (checked); `callback` a function that may be called from
/// another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_submit_discard(
    disk: *mut vsan_disk,
    offset: u64,
    len: u64,
    flags: u32,
    callback: vsan_completion,
    userdata: *mut c_void,
    tag: u64,
) -> vsan_result {
    call("vsan_disk_submit_discard", || {
        let (d, flags) = range_request(disk, Op::Discard, offset, len, flags)?;
        let work = range_work(&d, Op::Discard, offset, len, flags);
        submit(&d, callback, userdata, tag, work)
    })
}

/// Submit a zeroing of `len` bytes at `offset` (`flags`: 0 or `VSAN_IO_FUA`). See
/// `vsan_disk_submit_read` for the rules. Thread-safe; does not block.
///
/// # Safety
/// `disk` must be a handle (checked); `callback` a function that may be called from
/// another thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn vsan_disk_submit_write_zeroes(
    disk: *mut vsan_disk,
    offset: u64,
    len: u64,
    flags: u32,
    callback: vsan_completion,
    userdata: *mut c_void,
    tag: u64,
) -> vsan_result {
    call("vsan_disk_submit_write_zeroes", || {
        let (d, flags) = range_request(disk, Op::WriteZeroes, offset, len, flags)?;
        let work = range_work(&d, Op::WriteZeroes, offset, len, flags);
        submit(&d, callback, userdata, tag, work)
    })
}
