//! A fake verbs pair for tests: two in-memory queue pairs wired together, with the
//! rules of a reliable-connected queue pair checked instead of assumed.
//!
//! A SEND lands in the peer's oldest posted receive buffer; a SEND that finds none is
//! recorded as a violation (on hardware it would be a receiver-not-ready retry, which
//! credits exist to prevent). In stepped mode nothing moves until the test says so:
//! [`Net::deliver`] moves the oldest SEND in one direction, [`Net::complete_send`] makes
//! one delivered SEND's completion visible (in any order), so a test can try every
//! interleaving. In immediate mode a SEND is delivered and completed as it is posted
//! and the sides' notifiers are woken, for the async link tests.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;
use vsan_core::{Error, ErrorKind, Result};

use super::engine::{Completion, Verbs};
use super::link::{Notifier, Wake};

/// A completion as the net keeps it: a receive carries the bytes, copied into the
/// side's own buffer when it polls (the engine reads a buffer only after that).
#[derive(Debug)]
enum Event {
    Done(Completion),
    Landed { buf: usize, bytes: Vec<u8> },
}

#[derive(Debug)]
struct Side {
    buf_len: usize,
    send_busy: Vec<bool>,
    recv_posted: VecDeque<usize>,
    recv_is_posted: Vec<bool>,
    /// Completions the side can poll.
    cq: VecDeque<Event>,
    /// Delivered SENDs whose completion is not visible yet (stepped mode).
    pending_send_cq: Vec<usize>,
    /// Posted SENDs not yet delivered: (send buffer, bytes).
    in_flight: VecDeque<(usize, Vec<u8>)>,
    /// The side's verbs were dropped (its connection is torn down).
    gone: bool,
    notify: Arc<Notify>,
}

/// Both sides of a fake connection.
#[derive(Debug)]
pub(crate) struct Net {
    sides: [Side; 2],
    immediate: bool,
    /// Rule breaks seen (credit overruns, misuse of buffers), in words.
    pub violations: Vec<String>,
    /// SENDs delivered, per direction (0: side 0 to side 1).
    pub delivered: [u64; 2],
}

/// Shared handle to a fake connection.
pub(crate) type FakeNet = Arc<Mutex<Net>>;

/// Pool shape of one side.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pool {
    pub send_bufs: usize,
    pub recv_bufs: usize,
    pub buf_len: usize,
}

impl Side {
    fn new(pool: Pool) -> Side {
        Side {
            buf_len: pool.buf_len,
            send_busy: vec![false; pool.send_bufs],
            recv_posted: VecDeque::new(),
            recv_is_posted: vec![false; pool.recv_bufs],
            cq: VecDeque::new(),
            pending_send_cq: Vec::new(),
            in_flight: VecDeque::new(),
            gone: false,
            notify: Arc::new(Notify::new()),
        }
    }
}

/// A connected pair: side 0's verbs, side 1's verbs, and the connection.
pub(crate) fn pair(a: Pool, b: Pool, immediate: bool) -> (FakeVerbs, FakeVerbs, FakeNet) {
    let net = Arc::new(Mutex::new(Net {
        sides: [Side::new(a), Side::new(b)],
        immediate,
        violations: Vec::new(),
        delivered: [0, 0],
    }));
    (FakeVerbs::new(&net, 0, a), FakeVerbs::new(&net, 1, b), net)
}

impl Net {
    /// Delivers the oldest SEND from side `from` to the other side. Returns whether
    /// there was one.
    pub(crate) fn deliver(&mut self, from: usize) -> bool {
        let to = 1 - from;
        let Some((src, bytes)) = self.sides[from].in_flight.pop_front() else {
            return false;
        };
        self.delivered[from] += 1;
        if self.sides[to].gone {
            self.sides[from]
                .cq
                .push_back(Event::Done(Completion::Failed {
                    status: "remote side gone (flushed)".into(),
                }));
            self.sides[from].notify.notify_one();
            return true;
        }
        let Some(dst) = self.sides[to].recv_posted.pop_front() else {
            self.violations.push(format!(
                "side {from} sent a {}-byte SEND but side {to} had no receive posted (credit overrun)",
                bytes.len()
            ));
            return true;
        };
        if bytes.len() > self.sides[to].buf_len {
            self.violations.push(format!(
                "side {from} sent {} bytes into a {}-byte receive buffer",
                bytes.len(),
                self.sides[to].buf_len
            ));
            return true;
        }
        let side = &mut self.sides[to];
        side.recv_is_posted[dst] = false;
        side.cq.push_back(Event::Landed { buf: dst, bytes });
        side.notify.notify_one();
        if self.immediate {
            self.sides[from]
                .cq
                .push_back(Event::Done(Completion::Sent { buf: src }));
            self.sides[from].notify.notify_one();
        } else {
            self.sides[from].pending_send_cq.push(src);
        }
        true
    }

    /// Makes the `pick % n`-th pending send completion of `side` visible. Returns
    /// whether there was one.
    pub(crate) fn complete_send(&mut self, side: usize, pick: usize) -> bool {
        let s = &mut self.sides[side];
        if s.pending_send_cq.is_empty() {
            return false;
        }
        let i = pick % s.pending_send_cq.len();
        let buf = s.pending_send_cq.swap_remove(i);
        s.cq.push_back(Event::Done(Completion::Sent { buf }));
        true
    }

    /// Puts `bytes` into `side`'s oldest posted receive buffer as if the peer had sent
    /// them (for malformed-chunk tests).
    pub(crate) fn inject(&mut self, side: usize, bytes: &[u8]) {
        let s = &mut self.sides[side];
        let dst = s.recv_posted.pop_front().expect("a posted receive");
        s.recv_is_posted[dst] = false;
        s.cq.push_back(Event::Landed {
            buf: dst,
            bytes: bytes.to_vec(),
        });
        s.notify.notify_one();
    }

    /// Reports a failed work request to `side`.
    pub(crate) fn fail(&mut self, side: usize, status: &str) {
        self.sides[side]
            .cq
            .push_back(Event::Done(Completion::Failed {
                status: status.into(),
            }));
        self.sides[side].notify.notify_one();
    }

    /// SENDs posted by `side` and not delivered yet.
    pub(crate) fn in_flight(&self, side: usize) -> usize {
        self.sides[side].in_flight.len()
    }

    /// Send completions of `side` not visible yet.
    pub(crate) fn pending_sends(&self, side: usize) -> usize {
        self.sides[side].pending_send_cq.len()
    }

    /// Receive buffers `side` has posted.
    pub(crate) fn posted(&self, side: usize) -> usize {
        self.sides[side].recv_posted.len()
    }
}

/// One side's verbs.
#[derive(Debug)]
pub(crate) struct FakeVerbs {
    net: FakeNet,
    me: usize,
    buf_len: usize,
    send: Vec<Vec<u8>>,
    recv: Vec<Vec<u8>>,
}

impl FakeVerbs {
    fn new(net: &FakeNet, me: usize, pool: Pool) -> FakeVerbs {
        FakeVerbs {
            net: Arc::clone(net),
            me,
            buf_len: pool.buf_len,
            send: vec![vec![0; pool.buf_len]; pool.send_bufs],
            recv: vec![vec![0; pool.buf_len]; pool.recv_bufs],
        }
    }

    /// The notifier for this side's link driver.
    pub(crate) fn notifier(&self) -> FakeNotifier {
        let notify = Arc::clone(&self.net.lock().sides[self.me].notify);
        FakeNotifier {
            net: Arc::clone(&self.net),
            me: self.me,
            notify,
            told_gone: AtomicBool::new(false),
        }
    }
}

impl Verbs for FakeVerbs {
    fn buf_len(&self) -> usize {
        self.buf_len
    }

    fn send_bufs(&self) -> usize {
        self.send.len()
    }

    fn recv_bufs(&self) -> usize {
        self.recv.len()
    }

    fn send_buf(&mut self, id: usize) -> &mut [u8] {
        let mut net = self.net.lock();
        if net.sides[self.me].send_busy[id] {
            net.violations
                .push(format!("side {} wrote send buffer {id} in flight", self.me));
        }
        drop(net);
        &mut self.send[id]
    }

    fn recv_buf(&self, id: usize) -> &[u8] {
        &self.recv[id]
    }

    fn post_send(&mut self, id: usize, len: usize) -> Result<()> {
        let mut net = self.net.lock();
        let me = self.me;
        if id >= self.send.len() || net.sides[me].send_busy[id] {
            net.violations
                .push(format!("side {me} posted send buffer {id} twice"));
            return Err(misuse("send buffer already posted"));
        }
        if len > self.buf_len {
            net.violations
                .push(format!("side {me} posted a SEND longer than its buffer"));
            return Err(misuse("too long"));
        }
        net.sides[me].send_busy[id] = true;
        let bytes = self.send[id][..len].to_vec();
        net.sides[me].in_flight.push_back((id, bytes));
        if net.immediate {
            net.deliver(me);
        }
        Ok(())
    }

    fn post_recv(&mut self, id: usize) -> Result<()> {
        let mut net = self.net.lock();
        let me = self.me;
        if id >= self.recv.len() || net.sides[me].recv_is_posted[id] {
            net.violations
                .push(format!("side {me} posted receive buffer {id} twice"));
            return Err(misuse("receive buffer already posted"));
        }
        net.sides[me].recv_is_posted[id] = true;
        net.sides[me].recv_posted.push_back(id);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let mut net = self.net.lock();
        let me = self.me;
        while let Some(event) = net.sides[me].cq.pop_front() {
            match event {
                Event::Done(c) => {
                    if let Completion::Sent { buf } = c {
                        net.sides[me].send_busy[buf] = false;
                    }
                    out.push(c);
                }
                Event::Landed { buf, bytes } => {
                    self.recv[buf][..bytes.len()].copy_from_slice(&bytes);
                    out.push(Completion::Received {
                        buf,
                        len: bytes.len(),
                    });
                }
            }
        }
        Ok(())
    }
}

impl Drop for FakeVerbs {
    fn drop(&mut self) {
        let mut net = self.net.lock();
        let me = self.me;
        net.sides[me].gone = true;
        net.sides[1 - me].notify.notify_one();
    }
}

/// Wakes a fake side's link driver.
#[derive(Debug)]
pub(crate) struct FakeNotifier {
    net: FakeNet,
    me: usize,
    notify: Arc<Notify>,
    told_gone: AtomicBool,
}

impl Notifier for FakeNotifier {
    fn wait(&self) -> Pin<Box<dyn Future<Output = Wake> + Send + '_>> {
        Box::pin(async move {
            loop {
                {
                    let net = self.net.lock();
                    if net.sides[1 - self.me].gone
                        && net.sides[self.me].cq.is_empty()
                        && !self.told_gone.swap(true, Ordering::SeqCst)
                    {
                        return Wake::Disconnected("peer disconnected".into());
                    }
                    if !net.sides[self.me].cq.is_empty() {
                        drop(net);
                        // Let the permit of this wake-up go; the cq is polled now.
                        return Wake::Completions;
                    }
                }
                self.notify.notified().await;
            }
        })
    }
}

/// A work request the real verbs would refuse (the engine broke a rule of its own).
fn misuse(why: &str) -> Error {
    Error::new(ErrorKind::InvalidArgument, why)
}
