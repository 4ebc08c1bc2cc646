//! Plugging: batching the requests a caller starts together, the block layer's
//! `blk_start_plug` / `blk_finish_plug` for [`BlockDevice`](crate::BlockDevice)s.
//!
//! ```text
//!   front door (one poll of a connection)          a device that batches (a mirror)
//!   let plug = Plug::new();
//!   write(a) ──────────────────────────────────▶ queued; plug::defer(self) ──▶ [self]
//!   write(b) ──────────────────────────────────▶ queued; already deferred
//!   read(c)  ──────────────────────────────────▶ queued
//!   drop(plug) ─── unplug() once per device ───▶ one batch: one send for a, b and c's
//!                                                 messages, then the local I/O
//! ```
//!
//! A caller that has several requests at hand (a front door that parsed a buffer full
//! of them) holds a [`Plug`] while it starts them. A device that gains from seeing them
//! together — a mirror that would otherwise pay one network send per request — calls
//! [`defer`] when a request arrives: while a plug is held on this thread, the device
//! only queues the request and is [unplugged](Unplug::unplug) once, when the outermost
//! plug is dropped, and then carries out everything queued in one batch. Without a plug
//! the device carries each request out at once.
//!
//! A plug belongs to the thread that made it (it is not `Send`), is never held across an
//! `.await`, and nests: only the outermost one unplugs. A request that was deferred
//! completes after the unplug, so a caller must not wait for a request it started while
//! its own plug is held (the front doors poll their requests once, inline, and pick the
//! rest up when they are woken).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::Arc;

/// A device that batches requests made under a [`Plug`].
pub trait Unplug: Send + Sync {
    /// Carry out everything queued since the device called [`defer`]. Runs on the
    /// thread that dropped the outermost plug, while it drops it: no blocking waits.
    fn unplug(&self);
}

#[derive(Default)]
struct PlugState {
    /// Plugs held on this thread (nesting depth).
    depth: usize,
    /// Devices to unplug, each once, in the order they first deferred.
    deferred: Vec<Arc<dyn Unplug>>,
}

thread_local! {
    static STATE: RefCell<PlugState> = RefCell::new(PlugState::default());
}

/// Holds requests started on this thread until it is dropped (see the module doc).
#[derive(Debug)]
#[must_use = "a plug batches only while it is held"]
pub struct Plug {
    /// A plug is tied to its thread's state.
    _not_send: PhantomData<*const ()>,
}

impl Plug {
    /// Start batching the requests this thread starts, until the plug is dropped.
    pub fn new() -> Plug {
        STATE.with(|s| s.borrow_mut().depth += 1);
        Plug {
            _not_send: PhantomData,
        }
    }
}

impl Default for Plug {
    fn default() -> Plug {
        Plug::new()
    }
}

impl Drop for Plug {
    fn drop(&mut self) {
        let deferred = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth -= 1;
            if s.depth == 0 {
                std::mem::take(&mut s.deferred)
            } else {
                Vec::new()
            }
        });
        // Outside the borrow: an unplug may start requests (and defer) itself, which
        // then run at once because no plug is held any more.
        for device in deferred {
            device.unplug();
        }
    }
}

/// Whether a plug is held on this thread; if so, `device` is unplugged when the outermost
/// one is dropped (once, however often it defers). A device calls this for each request
/// and, when it returns `true`, only queues the request.
pub fn defer<D: Unplug + 'static>(device: &Arc<D>) -> bool {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.depth == 0 {
            return false;
        }
        let ptr = Arc::as_ptr(device).cast::<()>();
        if !s
            .deferred
            .iter()
            .any(|d| std::ptr::eq(Arc::as_ptr(d).cast::<()>(), ptr))
        {
            s.deferred.push(Arc::clone(device) as Arc<dyn Unplug>);
        }
        true
    })
}

/// Whether a plug is held on this thread.
pub fn plugged() -> bool {
    STATE.with(|s| s.borrow().depth > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Counter {
        unplugs: AtomicUsize,
    }

    impl Unplug for Counter {
        fn unplug(&self) {
            self.unplugs.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn without_a_plug_nothing_is_deferred() {
        let dev = Arc::new(Counter::default());
        assert!(!plugged());
        assert!(!defer(&dev));
        assert_eq!(dev.unplugs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_outermost_plug_unplugs_each_device_once() {
        let (a, b) = (Arc::new(Counter::default()), Arc::new(Counter::default()));
        {
            let _outer = Plug::new();
            {
                let _inner = Plug::new();
                assert!(defer(&a));
                assert!(defer(&a));
            }
            assert_eq!(
                a.unplugs.load(Ordering::SeqCst),
                0,
                "an inner plug unplugs nothing"
            );
            assert!(defer(&b));
            assert!(defer(&a));
        }
        assert_eq!(a.unplugs.load(Ordering::SeqCst), 1);
        assert_eq!(b.unplugs.load(Ordering::SeqCst), 1);
        assert!(!plugged());
        assert!(!defer(&a), "after the unplug requests run at once again");
    }

    #[test]
    fn a_plug_on_one_thread_does_not_defer_another_threads_requests() {
        let dev = Arc::new(Counter::default());
        let _plug = Plug::new();
        let other = Arc::clone(&dev);
        let deferred_there = std::thread::spawn(move || defer(&other)).join();
        assert!(matches!(deferred_there, Ok(false)));
    }
}
