//! Where a caller's read, write or flush waits for its result: one slot per request in
//! flight, opened when the request is submitted and filled by whichever turn of the
//! mirror completes it (the caller's own, another caller's, or the driver task's).
//!
//! A slot replaces a channel per request: no allocation once the map has grown to the
//! number of requests in flight, and a completion is a map update and one wake-up.

use std::task::{Poll, Waker};

use vsan_core::ErrorKind;

use crate::protocol::fastmap::FastMap;
use crate::protocol::{LocalResult, RequestId};

/// The slots of one mirrored disk's requests in flight.
#[derive(Debug, Default)]
pub(super) struct Slots {
    open: FastMap<RequestId, Slot>,
}

#[derive(Debug)]
struct Slot {
    result: Option<LocalResult>,
    /// Whom to wake when the result comes.
    waker: Option<Waker>,
}

impl Slots {
    /// Open the slot of `req`, waking `waker` when it is filled.
    pub(super) fn open(&mut self, req: RequestId, waker: &Waker) {
        self.open.insert(
            req,
            Slot {
                result: None,
                waker: Some(waker.clone()),
            },
        );
    }

    /// Fill the slot of `req` with its result; the waker to wake (after the lock is
    /// released), or `None` when nobody waits (the caller gave up on the request) or
    /// the slot already holds a result (`Closed`, the mirror stopped first: the caller
    /// is told that, not a later outcome).
    pub(super) fn fill(&mut self, req: RequestId, result: LocalResult) -> Option<Waker> {
        let slot = self.open.get_mut(&req)?;
        if slot.result.is_some() {
            return None;
        }
        slot.result = Some(result);
        slot.waker.take()
    }

    /// The result of `req` if it came (the slot is closed then), or `Pending` with
    /// `waker` registered. `Ready(None)`: there is no such slot.
    pub(super) fn take(&mut self, req: RequestId, waker: &Waker) -> Poll<Option<LocalResult>> {
        let Some(slot) = self.open.get_mut(&req) else {
            return Poll::Ready(None);
        };
        if slot.result.is_some() {
            return Poll::Ready(self.open.remove(&req).and_then(|s| s.result));
        }
        match &mut slot.waker {
            Some(w) if w.will_wake(waker) => {}
            w => *w = Some(waker.clone()),
        }
        Poll::Pending
    }

    /// The caller gave up on `req`: its result, when it comes, is dropped.
    pub(super) fn abandon(&mut self, req: RequestId) {
        self.open.remove(&req);
    }

    /// Fill every open slot with `kind` (the mirror stopped); their wakers go to `wake`.
    pub(super) fn fail_all(&mut self, kind: ErrorKind, wake: &mut Vec<Waker>) {
        for slot in self.open.values_mut() {
            if slot.result.is_none() {
                slot.result = Some(Err(kind));
                wake.extend(slot.waker.take());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_filled_slot_wakes_its_caller_once_and_gives_the_result_once() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut slots = Slots::default();
        let req = RequestId(7);
        slots.open(req, &waker);
        assert!(slots.take(req, &waker).is_pending());
        let w = slots.fill(req, Ok(None));
        assert!(w.is_some());
        w.into_iter().for_each(Waker::wake);
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(slots.take(req, &waker), Poll::Ready(Some(Ok(None))));
        assert_eq!(slots.take(req, &waker), Poll::Ready(None), "taken once");
    }

    #[test]
    fn an_abandoned_request_drops_its_result() {
        let waker = Waker::from(Arc::new(Count::default()));
        let mut slots = Slots::default();
        slots.open(RequestId(1), &waker);
        slots.abandon(RequestId(1));
        assert!(slots.fill(RequestId(1), Ok(None)).is_none());
        assert_eq!(slots.take(RequestId(1), &waker), Poll::Ready(None));
    }

    #[test]
    fn a_stopped_mirror_fails_every_waiting_request() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut slots = Slots::default();
        slots.open(RequestId(1), &waker);
        slots.open(RequestId(2), &waker);
        let mut wake = Vec::new();
        slots.fail_all(ErrorKind::Closed, &mut wake);
        assert_eq!(wake.len(), 2);
        // A turn that was running when the mirror stopped finishes later: its outcome
        // does not replace what the caller was told.
        assert!(slots.fill(RequestId(1), Ok(None)).is_none());
        for r in [1, 2] {
            assert_eq!(
                slots.take(RequestId(r), &waker),
                Poll::Ready(Some(Err(ErrorKind::Closed)))
            );
        }
    }
}
