//! Lanes: several links to one peer used as one, each message batch scheduled on the
//! lane with the fewest messages in flight (the MPIO least-queue-depth policy), and
//! everything delivered in the order it was sent.
//!
//! ```text
//!   LanesTransport(inner, N)
//!   connect ──▶ N inner links, each starting with LaneJoin{group, index, N}
//!
//!   send_batch([m1, m2])  on the lane with the fewest queued messages (ties rotate):
//!       lane k:  LaneSeq{s} m1 m2          (m1 is number s, m2 number s+1)
//!   receiver:   one reader per lane puts numbered messages in a reorder buffer;
//!               recv hands out s, s+1, s+2, ... in order
//! ```
//!
//! # Ordering
//!
//! The protocol above relies on one ordered stream per peer: a flush after the writes it
//! covers, a barrier after the requests before it, overlapping writes applied in the
//! order they were issued, resync checkpoints after the data they cover. Lanes keep all
//! of it by keeping the stream's order exactly: every batch carries the sequence number
//! of its first message ([`Message::LaneSeq`]), each lane's reader numbers the messages
//! that follow, and the receiving side releases message `s` only after `s - 1`. Lanes
//! spread the work of sending (sockets, kernel copies, writer tasks) over several
//! links; they do not reorder what the replicas see. A message that overtakes another
//! on a faster lane waits in the reorder buffer.
//!
//! "In flight" is what a lane's [`LinkTx::queue_depth`] reports: messages accepted and
//! not yet handed to the network. A lane whose socket is backed up gets no new work
//! until the others are as busy.
//!
//! # Joining
//!
//! [`LanesTransport::connect`] opens `N` links through the inner transport and sends
//! [`Message::LaneJoin`] first on each; the listener ([`LanesTransport::listen`]) groups
//! incoming links by the join's random group id and hands out the group once all `N`
//! are there (a group not complete within the join timeout is dropped and logged). A
//! link that starts with anything else is a plain, single link: it is handed out as it
//! is, so a lanes listener also serves peers configured without lanes.
//!
//! # Failure
//!
//! A lane that fails fails the whole link (the caller reconnects all lanes), and the
//! failure is final on both halves: a batch whose lane refused it leaves a hole in the
//! numbering no later message can skip. Messages are checked before they take numbers,
//! so a message the codec refuses leaves none. `recv` reports `Closed` once every lane
//! has ended, after every message any of them carried: a peer that goes silent with a
//! lane open is the caller's liveness check's to notice (the mirror's ping timeout).
//!
//! # Backpressure
//!
//! Each lane has a reader that moves its messages into the reorder buffer. While the
//! buffer holds 64 Ki messages or 64 MiB of data, a reader whose next message is not
//! the one `recv` hands out next stops reading, so the lanes' own send queues fill and
//! the sender waits, as on a single link. The next message in order is always taken
//! (each lane is in order, so the lane that carries it never waits behind it).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::{Link, LinkRx, LinkTx, Listener, QueueDepth, Transport};
use crate::wire::MAX_LANES;
use crate::wire::Message;

/// Groups waiting for their last lane, and plain links, not yet taken by `accept`.
const ACCEPT_BACKLOG: usize = 16;
/// How far ahead of the next message a lane may number one (a peer beyond it is broken).
const MAX_REORDER: u64 = 1 << 20;
/// Messages and data bytes the reorder buffer holds before lane readers stop reading
/// (and the lanes' own backpressure reaches the sender). The next message in order is
/// always taken, so a full buffer never waits for itself.
const REORDER_MESSAGES: usize = 1 << 16;
const REORDER_BYTES: usize = 64 << 20;

/// Several links to one peer used as one. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct LanesTransport {
    inner: Arc<dyn Transport>,
    lanes: u32,
    join_timeout: Duration,
}

impl LanesTransport {
    /// `lanes` links per peer through `inner`. Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) for 0 or more than
    /// 64 lanes.
    pub fn new(inner: Arc<dyn Transport>, lanes: u32) -> Result<LanesTransport> {
        if lanes == 0 || lanes > MAX_LANES {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("lanes = {lanes}: must be 1 to {MAX_LANES}"),
            ));
        }
        Ok(LanesTransport {
            inner,
            lanes,
            join_timeout: Duration::from_secs(10),
        })
    }

    /// How long a listener waits for all lanes of a group (default 10 s).
    pub fn with_join_timeout(mut self, timeout: Duration) -> LanesTransport {
        self.join_timeout = timeout;
        self
    }

    /// Lanes per link.
    pub fn lanes(&self) -> u32 {
        self.lanes
    }
}

impl Transport for LanesTransport {
    fn name(&self) -> &'static str {
        "lanes"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        Box::pin(async move {
            let group: u64 = rand::random();
            let mut links = Vec::with_capacity(self.lanes as usize);
            for index in 0..self.lanes {
                let link = self.inner.connect(addr).await?;
                link.send(Message::LaneJoin {
                    group,
                    index,
                    count: self.lanes,
                })
                .await?;
                links.push(link);
            }
            Ok(group_link(links))
        })
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        Box::pin(async move {
            let inner = self.inner.listen(addr).await?;
            Ok(Box::new(LanesListener::new(inner, self.join_timeout)) as Box<dyn Listener>)
        })
    }
}

/// One link from a complete group, lanes in index order.
fn group_link(links: Vec<Link>) -> Link {
    let n = links.len();
    let transport = format!("{}*{n}", links[0].transport());
    let peer = format!("{} ({n} lanes)", links[0].peer());
    let mut txs = Vec::with_capacity(n);
    let shared = Arc::new(Reorder {
        state: Mutex::new(ReorderState {
            next: 0,
            pending: BTreeMap::new(),
            failed: None,
            ended: 0,
            bytes: 0,
        }),
        changed: Notify::new(),
        room: Notify::new(),
    });
    let mut readers = Vec::with_capacity(n);
    for (i, link) in links.into_iter().enumerate() {
        let (tx, rx) = link.into_split();
        txs.push(tx);
        readers.push(tokio::spawn(read_lane(i, rx, Arc::clone(&shared))));
    }
    Link::new(
        Box::new(LanesTx {
            lanes: txs,
            next_seq: AtomicU64::new(0),
            rotate: AtomicUsize::new(0),
            failed: Mutex::new(None),
            peer: peer.clone(),
            transport,
        }),
        Box::new(LanesRx {
            shared,
            readers,
            lanes: n,
            done: None,
            peer,
        }),
    )
}

struct LanesTx {
    lanes: Vec<Box<dyn LinkTx>>,
    next_seq: AtomicU64,
    rotate: AtomicUsize,
    /// A lane failed after the batch took its numbers: the receiver can never fill
    /// the hole, so every later send fails too (errors are final).
    failed: Mutex<Option<(ErrorKind, String)>>,
    peer: String,
    transport: String,
}

impl fmt::Debug for LanesTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LanesTx")
            .field("peer", &self.peer)
            .field("transport", &self.transport)
            .finish()
    }
}

impl LanesTx {
    /// The lane with the fewest queued messages; ties go round the lanes.
    fn pick(&self) -> &dyn LinkTx {
        let n = self.lanes.len();
        let start = self.rotate.fetch_add(1, Ordering::Relaxed) % n;
        let mut best = start;
        let mut best_depth = usize::MAX;
        for k in 0..n {
            let i = (start + k) % n;
            let d = self.lanes[i].queue_depth().messages;
            if d < best_depth {
                best = i;
                best_depth = d;
                if d == 0 {
                    break;
                }
            }
        }
        &*self.lanes[best]
    }
}

impl LinkTx for LanesTx {
    fn send(&self, msg: Message) -> IoFuture<'_, ()> {
        self.send_batch(vec![msg])
    }

    fn send_batch(&self, msgs: Vec<Message>) -> IoFuture<'_, ()> {
        Box::pin(async move {
            if msgs.is_empty() {
                return Ok(());
            }
            if let Some(bad) = msgs
                .iter()
                .find(|m| matches!(m, Message::LaneSeq { .. } | Message::LaneJoin { .. }))
            {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{}: lane frames are the transport's own: {bad:?}",
                        self.peer
                    ),
                ));
            }
            // Refused before it takes numbers, so a refusal leaves no hole.
            for m in &msgs {
                crate::wire::validate(m).map_err(|e| {
                    Error::with_source(
                        ErrorKind::InvalidArgument,
                        format!("{}: send", self.peer),
                        e,
                    )
                })?;
            }
            if let Some((kind, what)) = &*self.failed.lock() {
                return Err(Error::new(*kind, what.clone()));
            }
            let seq = self
                .next_seq
                .fetch_add(msgs.len() as u64, Ordering::Relaxed);
            let mut batch = Vec::with_capacity(msgs.len() + 1);
            batch.push(Message::LaneSeq { seq });
            batch.extend(msgs);
            // The lane takes the batch on this first poll (the `LinkTx` contract), so
            // the numbers it carries are never skipped.
            let r = self.pick().send_batch(batch).await;
            if let Err(e) = &r {
                self.failed
                    .lock()
                    .get_or_insert_with(|| (e.kind(), e.to_string()));
            }
            r
        })
    }

    fn queue_depth(&self) -> QueueDepth {
        self.lanes.iter().fold(QueueDepth::default(), |acc, l| {
            let d = l.queue_depth();
            QueueDepth {
                messages: acc.messages + d.messages,
                bytes: acc.bytes + d.bytes,
            }
        })
    }

    fn close(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let results =
                futures_util::future::join_all(self.lanes.iter().map(|l| l.close())).await;
            results.into_iter().collect::<Result<Vec<()>>>().map(drop)
        })
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn transport(&self) -> &str {
        &self.transport
    }
}

struct Reorder {
    state: Mutex<ReorderState>,
    changed: Notify,
    /// `recv` took a message: readers waiting for room look again.
    room: Notify,
}

struct ReorderState {
    /// The number of the message `recv` hands out next.
    next: u64,
    pending: BTreeMap<u64, Message>,
    /// A lane failed: (kind, message), handed to every later `recv`.
    failed: Option<(ErrorKind, String)>,
    /// Lanes that ended because the peer closed them.
    ended: usize,
    /// Data bytes in `pending`.
    bytes: usize,
}

impl ReorderState {
    fn fail(&mut self, kind: ErrorKind, what: String) {
        if self.failed.is_none() {
            self.failed = Some((kind, what));
        }
    }
}

/// Reads one lane until it ends, numbering its messages into the reorder buffer.
async fn read_lane(index: usize, mut rx: Box<dyn LinkRx>, shared: Arc<Reorder>) {
    let mut number: Option<u64> = None;
    loop {
        let mut ended = false;
        let r = rx.recv().await;
        // Hold a message that is not the next one while the buffer is full.
        if let (Ok(m), Some(n)) = (&r, number)
            && !matches!(m, Message::LaneSeq { .. } | Message::LaneJoin { .. })
        {
            loop {
                let room = shared.room.notified();
                {
                    let st = shared.state.lock();
                    if st.failed.is_some()
                        || n <= st.next
                        || (st.pending.len() < REORDER_MESSAGES && st.bytes < REORDER_BYTES)
                    {
                        break;
                    }
                }
                room.await;
            }
        }
        let mut st = shared.state.lock();
        if st.failed.is_some() {
            // Nothing more is delivered after a failure.
            return;
        }
        match r {
            Ok(Message::LaneSeq { seq }) => {
                if seq < st.next {
                    st.fail(
                        ErrorKind::Protocol,
                        format!("{}: lane {index} reused sequence number {seq}", rx.peer()),
                    );
                } else {
                    number = Some(seq);
                    continue;
                }
            }
            Ok(Message::LaneJoin { .. }) => st.fail(
                ErrorKind::Protocol,
                format!("{}: lane {index} joined twice", rx.peer()),
            ),
            Ok(m) => match number {
                Some(n) if n >= st.next && n - st.next < MAX_REORDER => {
                    st.bytes += m.data_len();
                    if st.pending.insert(n, m).is_some() {
                        st.fail(
                            ErrorKind::Protocol,
                            format!("{}: two lanes sent message {n}", rx.peer()),
                        );
                    }
                    number = n.checked_add(1);
                }
                Some(_) => st.fail(
                    ErrorKind::Protocol,
                    format!(
                        "{}: lane {index}: message out of the reorder window",
                        rx.peer()
                    ),
                ),
                None => st.fail(
                    ErrorKind::Protocol,
                    format!("{}: lane {index}: message without a number", rx.peer()),
                ),
            },
            Err(e) if e.kind() == ErrorKind::Closed => {
                debug!(peer = rx.peer(), lane = index, "lane closed by the peer");
                st.ended += 1;
                ended = true;
            }
            Err(e) => st.fail(e.kind(), format!("lane {index}: {e}")),
        }
        let stop = ended || st.failed.is_some();
        drop(st);
        shared.changed.notify_waiters();
        if stop {
            return;
        }
    }
}

struct LanesRx {
    shared: Arc<Reorder>,
    readers: Vec<JoinHandle<()>>,
    lanes: usize,
    /// The error `recv` returned: every later `recv` returns it too.
    done: Option<(ErrorKind, String)>,
    peer: String,
}

impl fmt::Debug for LanesRx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LanesRx").field("peer", &self.peer).finish()
    }
}

impl LinkRx for LanesRx {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(async move {
            loop {
                if let Some((kind, what)) = &self.done {
                    return Err(Error::new(*kind, what.clone()));
                }
                let changed = self.shared.changed.notified();
                {
                    let mut st = self.shared.state.lock();
                    let next = st.next;
                    if let Some(m) = st.pending.remove(&next) {
                        st.next += 1;
                        st.bytes -= m.data_len();
                        drop(st);
                        self.shared.room.notify_waiters();
                        return Ok(m);
                    }
                    if let Some(failed) = &st.failed {
                        self.done = Some(failed.clone());
                        continue;
                    }
                    // Closed once every lane has ended: a lane still open may still
                    // carry messages sent before the close (the caller's own liveness
                    // checks, not a timer here, decide when a silent peer is gone).
                    if st.ended == self.lanes {
                        self.done = Some((
                            ErrorKind::Closed,
                            format!("{}: the peer closed the link", self.peer),
                        ));
                        continue;
                    }
                }
                changed.await;
            }
        })
    }

    fn peer(&self) -> &str {
        &self.peer
    }
}

impl Drop for LanesRx {
    fn drop(&mut self) {
        for r in &self.readers {
            r.abort();
        }
    }
}

/// A link whose first message was already read (a plain link at a lanes listener).
#[derive(Debug)]
struct Replay {
    first: Option<Message>,
    rx: Box<dyn LinkRx>,
}

impl LinkRx for Replay {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        // Taken when polled, not when called: a future dropped unpolled loses nothing.
        Box::pin(async move {
            if let Some(m) = self.first.take() {
                return Ok(m);
            }
            self.rx.recv().await
        })
    }

    fn try_recv(&mut self) -> Option<Result<Message>> {
        match self.first.take() {
            Some(m) => Some(Ok(m)),
            None => self.rx.try_recv(),
        }
    }

    fn peer(&self) -> &str {
        self.rx.peer()
    }
}

/// Lanes waiting for the rest of their group.
struct Partial {
    lanes: Vec<Option<Link>>,
    arrived: usize,
}

struct LanesListener {
    local: String,
    /// Held here, not by a task, so dropping the listener stops listening at once.
    inner: Box<dyn Listener>,
    join_timeout: Duration,
    ready_tx: mpsc::Sender<Result<Link>>,
    groups: Arc<Mutex<HashMap<u64, Partial>>>,
    state: tokio::sync::Mutex<ListenState>,
}

struct ListenState {
    ready: mpsc::Receiver<Result<Link>>,
    /// First reads and group watchers; aborted when the listener is dropped.
    first_reads: tokio::task::JoinSet<()>,
}

impl fmt::Debug for LanesListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LanesListener")
            .field("local", &self.local)
            .finish()
    }
}

impl LanesListener {
    fn new(inner: Box<dyn Listener>, join_timeout: Duration) -> LanesListener {
        let local = inner.local_addr();
        let (ready_tx, ready) = mpsc::channel(ACCEPT_BACKLOG);
        LanesListener {
            local,
            inner,
            join_timeout,
            ready_tx,
            groups: Arc::default(),
            state: tokio::sync::Mutex::new(ListenState {
                ready,
                first_reads: tokio::task::JoinSet::new(),
            }),
        }
    }
}

impl Listener for LanesListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(async move {
            let mut guard = self.state.lock().await;
            let st = &mut *guard;
            loop {
                tokio::select! {
                    r = st.ready.recv() => match r {
                        Some(r) => return r,
                        None => unreachable!("the listener holds a sender"),
                    },
                    accepted = self.inner.accept() => {
                        let link = accepted?;
                        st.first_reads.spawn(sort_one(
                            link,
                            self.ready_tx.clone(),
                            Arc::clone(&self.groups),
                            self.join_timeout,
                        ));
                    }
                    Some(_) = st.first_reads.join_next(), if !st.first_reads.is_empty() => {}
                }
            }
        })
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

async fn sort_one(
    mut link: Link,
    ready: mpsc::Sender<Result<Link>>,
    groups: Arc<Mutex<HashMap<u64, Partial>>>,
    join_timeout: Duration,
) {
    let first = match tokio::time::timeout(join_timeout, link.recv()).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) if e.kind() == ErrorKind::Protocol => {
            // Garbage, a bad crc, an oversized frame: worth an operator's look. (A
            // connection that just closes, like a port scan's, is not.)
            warn!(peer = link.peer(), "incoming link dropped: {e}");
            return;
        }
        Ok(Err(e)) => {
            info!(
                peer = link.peer(),
                "incoming link closed before its first message: {e}"
            );
            return;
        }
        Err(_) => {
            warn!(
                peer = link.peer(),
                "no first message within {join_timeout:?}"
            );
            return;
        }
    };
    let (group, index, count) = match first {
        Message::LaneJoin {
            group,
            index,
            count,
        } => (group, index as usize, count as usize),
        other => {
            let (tx, rx) = link.into_split();
            let plain = Link::new(
                tx,
                Box::new(Replay {
                    first: Some(other),
                    rx,
                }),
            );
            let _ = ready.send(Ok(plain)).await;
            return;
        }
    };
    enum Outcome {
        Inconsistent(String),
        Complete(Vec<Link>),
        /// Waiting for more lanes; the first lane of a group watches the clock.
        Waiting {
            watcher: bool,
        },
    }
    let outcome = {
        let mut g = groups.lock();
        let p = g.entry(group).or_insert_with(|| Partial {
            lanes: (0..count).map(|_| None).collect(),
            arrived: 0,
        });
        if p.lanes.len() != count || p.lanes[index].is_some() {
            g.remove(&group);
            Outcome::Inconsistent(link.peer().to_string())
        } else {
            p.lanes[index] = Some(link);
            p.arrived += 1;
            if p.arrived == count {
                let p = g.remove(&group).map(|p| p.lanes).unwrap_or_default();
                Outcome::Complete(p.into_iter().flatten().collect())
            } else {
                Outcome::Waiting {
                    watcher: p.arrived == 1,
                }
            }
        }
    };
    match outcome {
        Outcome::Inconsistent(peer) => {
            let _ = ready
                .send(Err(Error::new(
                    ErrorKind::Protocol,
                    format!("{peer}: lane group {group:#x}: inconsistent lane join"),
                )))
                .await;
        }
        Outcome::Complete(lanes) => {
            let _ = ready.send(Ok(group_link(lanes))).await;
        }
        Outcome::Waiting { watcher: true } => {
            tokio::time::sleep(join_timeout).await;
            if let Some(p) = groups.lock().remove(&group) {
                warn!(
                    "lane group {group:#x}: only {} of {} lanes arrived within {join_timeout:?}; dropped",
                    p.arrived,
                    p.lanes.len()
                );
            }
        }
        Outcome::Waiting { watcher: false } => {}
    }
}
