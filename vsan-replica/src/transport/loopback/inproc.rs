//! In-process loopback links: both replicas in one process, messages passed by value.
//!
//! A link is two queues of [`Message`]s, one per direction. `send` checks the message
//! with [`wire::validate`] (every transport accepts and refuses the same messages) and
//! pushes it; the data of a write or read reply is a reference-counted [`Bytes`](bytes::Bytes) that
//! travels as it is: no frame is encoded, nothing is copied, no system call is made per
//! message.
//!
//! # Waking the receiver
//!
//! A receiver that finds its queue empty registers its waker and sleeps; the sender
//! wakes it only when it did (the flag is checked after the push, so a wake-up is never
//! lost). Waking a task that sleeps on another thread costs the runtime a futex call;
//! with [`InProcConfig::busy_poll`] the receiver first spins on the queue for that long,
//! so under steady traffic the sender finds it awake and wakes nothing: one core spins
//! for lower latency. Spinning holds a runtime worker thread, so it is skipped on a
//! current-thread runtime (the sender could never run meanwhile).
//!
//! # Addresses
//!
//! A listener registers a name in a table of this process (`"inproc:r0"`, or just
//! `"r0"`); `connect` to the same name reaches it. Names are unique per process:
//! listening on a name in use fails with
//! [`InUse`](vsan_core::ErrorKind::InUse); dropping the listener frees it.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use crate::transport::{Link, LinkRx, LinkTx, Listener, QueueDepth, Transport};
use crate::wire;
use crate::wire::Message;

/// Links waiting to be accepted, per listener.
const ACCEPT_BACKLOG: usize = 16;

/// Settings of an [`InProcTransport`]. Start from `InProcConfig::default()`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct InProcConfig {
    /// When set, a receiver that finds its queue empty spins on it for up to this long
    /// before it sleeps (see the [module docs](self)). Default: none.
    pub busy_poll: Option<Duration>,
    /// Bytes of message data one direction may queue before `send` waits for the
    /// receiver (default 16 MiB). A single larger message is still accepted.
    pub send_queue_limit: usize,
}

impl Default for InProcConfig {
    fn default() -> InProcConfig {
        InProcConfig {
            busy_poll: None,
            send_queue_limit: 16 << 20,
        }
    }
}

/// Links between replicas in one process. See the [module docs](self).
#[derive(Debug, Clone, Default)]
pub struct InProcTransport {
    config: Arc<InProcConfig>,
}

impl InProcTransport {
    /// A transport with the default settings.
    pub fn new() -> InProcTransport {
        InProcTransport::default()
    }

    /// A transport with `config`.
    pub fn with_config(config: InProcConfig) -> InProcTransport {
        InProcTransport {
            config: Arc::new(config),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &InProcConfig {
        &self.config
    }
}

/// The name an address registers: `"inproc:NAME"` or `"NAME"`.
fn name_of(addr: &str) -> Result<&str> {
    let name = addr.strip_prefix("inproc:").unwrap_or(addr);
    if name.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("in-process address {addr:?}: empty name"),
        ));
    }
    Ok(name)
}

/// Listeners of this process by name.
static LISTENERS: LazyLock<Mutex<HashMap<String, mpsc::Sender<Link>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

impl Transport for InProcTransport {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        Box::pin(async move {
            let name = name_of(addr)?;
            let accept = LISTENERS.lock().get(name).cloned().ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    format!("in-process connect {addr}: nothing listens on {name:?}"),
                )
            })?;
            let (ours, theirs) = pair(&self.config, name);
            accept.send(theirs).await.map_err(|_| {
                Error::new(
                    ErrorKind::Closed,
                    format!("in-process connect {addr}: the listener closed"),
                )
            })?;
            Ok(ours)
        })
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        Box::pin(async move {
            let name = name_of(addr)?.to_string();
            let (tx, rx) = mpsc::channel(ACCEPT_BACKLOG);
            let mut table = LISTENERS.lock();
            if table.get(&name).is_some_and(|t| !t.is_closed()) {
                return Err(Error::new(
                    ErrorKind::InUse,
                    format!("in-process listen {addr}: {name:?} is in use in this process"),
                ));
            }
            table.insert(name.clone(), tx.clone());
            Ok(Box::new(InProcListener {
                name,
                own: tx,
                incoming: tokio::sync::Mutex::new(rx),
            }) as Box<dyn Listener>)
        })
    }
}

struct InProcListener {
    name: String,
    /// The sender registered in the table, to recognise our own entry.
    own: mpsc::Sender<Link>,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Link>>,
}

impl fmt::Debug for InProcListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcListener")
            .field("name", &self.name)
            .finish()
    }
}

impl Listener for InProcListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(async move {
            self.incoming.lock().await.recv().await.ok_or_else(|| {
                Error::new(
                    ErrorKind::Closed,
                    format!("in-process listener {}", self.name),
                )
            })
        })
    }

    fn local_addr(&self) -> String {
        format!("inproc:{}", self.name)
    }
}

impl Drop for InProcListener {
    fn drop(&mut self) {
        let mut table = LISTENERS.lock();
        // Only our own entry.
        if table
            .get(&self.name)
            .is_some_and(|t| t.same_channel(&self.own))
        {
            table.remove(&self.name);
        }
    }
}

/// One direction of a link.
struct Queue {
    state: Mutex<QueueState>,
    /// The receiver's waker, registered only when it is about to sleep.
    waker: AtomicWaker,
    /// Set by the receiver right before it sleeps; the sender wakes only then.
    sleeping: AtomicBool,
    /// Signalled when the receiver takes messages (for senders waiting for room).
    room: Notify,
    /// Data bytes queued (for backpressure).
    bytes: AtomicUsize,
}

#[derive(Default)]
struct QueueState {
    messages: VecDeque<Message>,
    /// The sender closed this direction (or dropped it): the receiver sees `Closed`
    /// after the last message.
    closed: bool,
    /// The receiver is gone: sends fail.
    receiver_gone: bool,
}

impl Queue {
    fn new() -> Queue {
        Queue {
            state: Mutex::new(QueueState::default()),
            waker: AtomicWaker::new(),
            sleeping: AtomicBool::new(false),
            room: Notify::new(),
            bytes: AtomicUsize::new(0),
        }
    }

    fn wake_receiver(&self) {
        if self.sleeping.swap(false, Ordering::AcqRel) {
            self.waker.wake();
        }
    }
}

fn pair(config: &Arc<InProcConfig>, name: &str) -> (Link, Link) {
    let a_to_b = Arc::new(Queue::new());
    let b_to_a = Arc::new(Queue::new());
    let end = |out: &Arc<Queue>, inq: &Arc<Queue>, peer: String| {
        Link::new(
            Box::new(InProcTx {
                queue: Arc::clone(out),
                limit: config.send_queue_limit,
                peer: peer.clone(),
            }),
            Box::new(InProcRx {
                queue: Arc::clone(inq),
                busy_poll: config.busy_poll,
                spin_until: None,
                spin_ok: None,
                peer,
            }),
        )
    };
    let connector = end(&a_to_b, &b_to_a, format!("inproc:{name}"));
    let acceptor = end(&b_to_a, &a_to_b, format!("inproc:{name}(connector)"));
    (connector, acceptor)
}

struct InProcTx {
    queue: Arc<Queue>,
    limit: usize,
    peer: String,
}

impl fmt::Debug for InProcTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcTx")
            .field("peer", &self.peer)
            .finish()
    }
}

impl InProcTx {
    /// Pushes `msgs` in order, adjacent; returns whether the queue is over its limit.
    fn push(&self, msgs: Vec<Message>) -> Result<bool> {
        for m in &msgs {
            wire::validate(m).map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidArgument,
                    format!("{}: send", self.peer),
                    e,
                )
            })?;
        }
        let added: usize = msgs.iter().map(Message::data_len).sum();
        let before = {
            let mut st = self.queue.state.lock();
            if st.closed {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: send on a closed link", self.peer),
                ));
            }
            if st.receiver_gone {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: the peer closed the link", self.peer),
                ));
            }
            st.messages.extend(msgs);
            // Counted before the lock is released: the receiver subtracts only after it
            // took the message under the lock, so the count never goes below zero.
            self.queue.bytes.fetch_add(added, Ordering::AcqRel)
        };
        self.queue.wake_receiver();
        Ok(before > 0 && before.saturating_add(added) > self.limit)
    }

    async fn wait_for_room(&self) -> Result<()> {
        loop {
            let notified = self.queue.room.notified();
            if self.queue.bytes.load(Ordering::Acquire) <= self.limit {
                return Ok(());
            }
            if self.queue.state.lock().receiver_gone {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: the peer closed the link", self.peer),
                ));
            }
            notified.await;
        }
    }
}

impl LinkTx for InProcTx {
    fn send(&self, msg: Message) -> IoFuture<'_, ()> {
        self.send_batch(vec![msg])
    }

    fn send_batch(&self, msgs: Vec<Message>) -> IoFuture<'_, ()> {
        Box::pin(async move {
            if self.push(msgs)? {
                self.wait_for_room().await?;
            }
            Ok(())
        })
    }

    fn queue_depth(&self) -> QueueDepth {
        QueueDepth {
            messages: self.queue.state.lock().messages.len(),
            bytes: self.queue.bytes.load(Ordering::Acquire),
        }
    }

    fn close(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.queue.state.lock().closed = true;
            self.queue.sleeping.store(true, Ordering::Release);
            self.queue.wake_receiver();
            Ok(())
        })
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn transport(&self) -> &str {
        "loopback"
    }
}

impl Drop for InProcTx {
    fn drop(&mut self) {
        self.queue.state.lock().closed = true;
        self.queue.sleeping.store(true, Ordering::Release);
        self.queue.wake_receiver();
    }
}

struct InProcRx {
    queue: Arc<Queue>,
    busy_poll: Option<Duration>,
    /// While busy-polling: when to give up and sleep.
    spin_until: Option<Instant>,
    /// Whether this runtime may spin (a multi-thread one), looked up once.
    spin_ok: Option<bool>,
    peer: String,
}

impl fmt::Debug for InProcRx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcRx")
            .field("peer", &self.peer)
            .finish()
    }
}

impl InProcRx {
    /// The next message if one is queued; `Closed` after the last one once closed.
    fn try_take(&self) -> Option<Result<Message>> {
        let mut st = self.queue.state.lock();
        match st.messages.pop_front() {
            Some(m) => {
                drop(st);
                let n = m.data_len();
                if n > 0 {
                    self.queue.bytes.fetch_sub(n, Ordering::AcqRel);
                    self.queue.room.notify_waiters();
                }
                Some(Ok(m))
            }
            None if st.closed => Some(Err(Error::new(
                ErrorKind::Closed,
                format!("{}: the peer closed the link", self.peer),
            ))),
            None => None,
        }
    }

    fn poll_take(&mut self, cx: &mut Context<'_>) -> Poll<Result<Message>> {
        if let Some(r) = self.try_take() {
            self.spin_until = None;
            return Poll::Ready(r);
        }
        let spin_ok = *self.spin_ok.get_or_insert_with(|| {
            tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
        });
        if let Some(budget) = self.busy_poll.filter(|_| spin_ok) {
            let now = Instant::now();
            let until = *self.spin_until.get_or_insert(now + budget);
            if now < until {
                // Stay runnable instead of sleeping: the worker keeps polling this task
                // (and runs the others between polls) and never parks, so the sender
                // has nobody to wake.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        self.queue.waker.register(cx.waker());
        self.queue.sleeping.store(true, Ordering::SeqCst);
        // A message pushed before the flag was set did not wake us: look again.
        if let Some(r) = self.try_take() {
            self.queue.sleeping.store(false, Ordering::Release);
            return Poll::Ready(r);
        }
        Poll::Pending
    }
}

impl LinkRx for InProcRx {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(std::future::poll_fn(|cx| self.poll_take(cx)))
    }

    fn peer(&self) -> &str {
        &self.peer
    }
}

impl Drop for InProcRx {
    fn drop(&mut self) {
        self.queue.state.lock().receiver_gone = true;
        self.queue.room.notify_waiters();
    }
}
