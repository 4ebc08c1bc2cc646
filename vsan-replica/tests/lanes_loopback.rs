//! The in-process loopback transport and lanes: links on their own (order, close,
//! backpressure, refusals), and two `MirroredDisk`s over each, written on both nodes at
//! once with overlapping writes, compared byte for byte.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;
use tokio::time::timeout;
use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{Config, DiskId, LinkState, Message, WritePayload};
use vsan_replica::transport::lanes::LanesTransport;
use vsan_replica::transport::loopback::inproc::{InProcConfig, InProcTransport};
use vsan_replica::transport::{Link, TcpTransport, Transport};
use vsan_replica::{MirroredDisk, Replica};

const WAIT: Duration = Duration::from_secs(10);
const BS: u32 = 4096;
const SIZE: u64 = 8 << 20;

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {WAIT:?}"))
}

fn write_msg(id: u64, len: usize) -> Message {
    Message::Write {
        id,
        offset: id * 4096,
        payload: WritePayload::Data(Bytes::from(vec![(id % 251) as u8; len])),
        fua: id % 3 == 0,
    }
}

/// Opens a link pair through `t` listening on `addr`.
async fn link_pair(t: &dyn Transport, addr: &str) -> (Link, Link) {
    let listener = t.listen(addr).await.unwrap();
    let at = listener.local_addr();
    let (a, b) = tokio::join!(t.connect(&at), listener.accept());
    (a.unwrap(), b.unwrap())
}

/// Message `i`: a ping for every fifth, else a write of one of several sizes.
fn nth(i: u64) -> Message {
    match i % 5 {
        0 => Message::Ping { id: i },
        k => write_msg(i, [512, 4096, 65536, 1 << 20][(k - 1) as usize]),
    }
}

/// Sends `n` messages of mixed sizes, in batches, from `from` and checks `to` gets
/// them all, in order, then `Closed` after `from` closes.
async fn order_and_close(from: Link, mut to: Link, n: u64) {
    let sender = tokio::spawn(async move {
        let mut id = 0;
        while id < n {
            let batch = (id % 4 + 1).min(n - id);
            if batch == 1 {
                from.send(nth(id)).await.unwrap();
            } else {
                from.send_batch((id..id + batch).map(nth).collect())
                    .await
                    .unwrap();
            }
            id += batch;
        }
        from.close().await.unwrap();
        from
    });
    for i in 0..n {
        match within("recv", to.recv()).await.unwrap() {
            Message::Ping { id } => assert_eq!((id, i % 5), (i, 0), "message {i} in order"),
            Message::Write { id, payload, .. } => {
                assert_eq!(id, i, "message {i} arrives in order");
                let WritePayload::Data(d) = payload else {
                    panic!("message {i}: data")
                };
                assert!(d.iter().all(|&b| b == (i % 251) as u8), "message {i} data");
            }
            other => panic!("message {i}: unexpected {other:?}"),
        }
    }
    let end = within("recv after close", to.recv()).await;
    assert_eq!(end.unwrap_err().kind(), ErrorKind::Closed);
    sender.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inproc_links_keep_order_and_close() {
    for busy in [None, Some(Duration::from_micros(50))] {
        let mut cfg = InProcConfig::default();
        cfg.busy_poll = busy;
        let t = InProcTransport::with_config(cfg);
        let name = format!("order-{}", busy.is_some());
        let (a, b) = link_pair(&t, &name).await;
        assert_eq!(a.transport(), "loopback");
        order_and_close(a, b, 500).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inproc_refusals_and_names() {
    let t = InProcTransport::new();
    let e = t.connect("inproc:nobody").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.to_string().contains("nothing listens"), "{e}");
    let l = t.listen("inproc:taken").await.unwrap();
    assert_eq!(l.local_addr(), "inproc:taken");
    let e = t.listen("taken").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InUse, "{e}");
    drop(l);
    let again = t.listen("taken").await.unwrap();
    // A message the codec would refuse is refused here too.
    let (a, _b) = link_pair(&t, "refuse").await;
    let bad = Message::Write {
        id: 1,
        offset: 0,
        payload: WritePayload::Zeroes { len: 0 },
        fua: false,
    };
    let e = a.send(bad).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    // The peer's receiver gone: sends fail.
    let (a, b) = link_pair(&t, "gone").await;
    drop(b);
    let e = a.send(write_msg(1, 512)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
    drop(again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inproc_backpressure_waits_for_the_receiver() {
    let mut cfg = InProcConfig::default();
    cfg.send_queue_limit = 64 << 10;
    let t = InProcTransport::with_config(cfg);
    let (a, mut b) = link_pair(&t, "pressure").await;
    a.send(write_msg(0, 60 << 10)).await.unwrap();
    // Over the limit now: the next send is accepted but waits.
    let a = Arc::new(a);
    let a2 = Arc::clone(&a);
    let waiting = tokio::spawn(async move { a2.send(write_msg(1, 60 << 10)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "send waits while the queue is full");
    assert_eq!(a.queue_depth().messages, 2);
    within("recv", b.recv()).await.unwrap();
    within("send done", waiting).await.unwrap().unwrap();
    within("recv", b.recv()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_over_tcp_keep_order_and_close() {
    let t = LanesTransport::new(Arc::new(TcpTransport::new()), 4).unwrap();
    let (a, b) = link_pair(&t, "127.0.0.1:0").await;
    assert_eq!(a.transport(), "tcp*4");
    assert_eq!(b.transport(), "tcp*4");
    order_and_close(a, b, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_over_inproc_keep_order_from_many_senders() {
    let t = LanesTransport::new(Arc::new(InProcTransport::new()), 3).unwrap();
    let (a, mut b) = link_pair(&t, "lanes-many").await;
    let a = Arc::new(a);
    // Each sender's own messages keep their order; ids tell sender and position.
    let mut senders = Vec::new();
    for s in 0..4u64 {
        let a = Arc::clone(&a);
        senders.push(tokio::spawn(async move {
            for i in 0..300u64 {
                a.send(Message::Ping { id: s << 32 | i }).await.unwrap();
            }
        }));
    }
    let mut next = [0u64; 4];
    for _ in 0..1200 {
        match within("recv", b.recv()).await.unwrap() {
            Message::Ping { id } => {
                let (s, i) = ((id >> 32) as usize, id & 0xffff_ffff);
                assert_eq!(i, next[s], "sender {s} in order");
                next[s] += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    for s in senders {
        s.await.unwrap();
    }
    // Lane frames are the transport's own.
    let e = a.send(Message::LaneSeq { seq: 9 }).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lanes_listener_serves_plain_links_and_drops_incomplete_groups() {
    let inner: Arc<dyn Transport> = Arc::new(InProcTransport::new());
    let lanes = LanesTransport::new(Arc::clone(&inner), 2)
        .unwrap()
        .with_join_timeout(Duration::from_millis(200));
    let listener = lanes.listen("lanes-plain").await.unwrap();
    // A plain link: its first message comes through as it was.
    let plain = inner.connect("lanes-plain").await.unwrap();
    plain.send(Message::Ping { id: 7 }).await.unwrap();
    let mut got = within("accept", listener.accept()).await.unwrap();
    assert!(matches!(
        within("recv", got.recv()).await.unwrap(),
        Message::Ping { id: 7 }
    ));
    // Half a group is dropped after the join timeout; a whole one gets through.
    let half = inner.connect("lanes-plain").await.unwrap();
    half.send(Message::LaneJoin {
        group: 42,
        index: 0,
        count: 2,
    })
    .await
    .unwrap();
    let whole = tokio::spawn(async move { lanes.connect("lanes-plain").await });
    let mut g = within("accept group", listener.accept()).await.unwrap();
    assert_eq!(g.transport(), "loopback*2");
    let whole = whole.await.unwrap().unwrap();
    whole.send(Message::Ping { id: 8 }).await.unwrap();
    assert!(matches!(
        within("recv", g.recv()).await.unwrap(),
        Message::Ping { id: 8 }
    ));
    let mut half = half;
    let e = within("half dropped", half.recv()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
}

// ----- two mirrored disks over each -----

fn config(node: u32) -> Config {
    let mut cfg = Config::new(node, 3 - node, DiskId([0x4c; 16]), "lanes0", SIZE, BS);
    cfg.connect_timeout = Duration::from_secs(2);
    cfg
}

struct Pair {
    d1: MirroredDisk,
    d2: MirroredDisk,
    m1: Arc<MemDevice>,
    m2: Arc<MemDevice>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

async fn mirror_over(transport: Arc<dyn Transport>, addr: &str) -> Pair {
    let geometry = Geometry::new(SIZE, BS).unwrap();
    let (m1, m2) = (
        Arc::new(MemDevice::new(geometry)),
        Arc::new(MemDevice::new(geometry)),
    );
    let start = |node, m: &Arc<MemDevice>| {
        let m = Arc::clone(m);
        async move {
            let cfg = config(node);
            let replica = Replica::with_memory_meta(&cfg, m).await.unwrap();
            MirroredDisk::start(cfg, replica, None).unwrap()
        }
    };
    let (d1, d2) = (start(1, &m1).await, start(2, &m2).await);
    let listener = transport.listen(addr).await.unwrap();
    let at = listener.local_addr();
    let disks = HashMap::from([(d2.name().to_string(), d2.clone())]);
    let tasks = vec![
        tokio::spawn(accept_loop(listener, disks)),
        tokio::spawn(dial_loop(transport, at, d1.clone())),
    ];
    for d in [&d1, &d2] {
        let mut w = d.watch_status();
        within("connected", async {
            while w.borrow_and_update().link != LinkState::Connected || w.borrow().syncing {
                w.changed().await.unwrap();
            }
        })
        .await;
    }
    Pair {
        d1,
        d2,
        m1,
        m2,
        tasks,
    }
}

/// Both nodes write at once, overlapping, with FUA writes and flushes mixed in; then the
/// replicas must be identical and the disks read back what the last writes left.
async fn hammer_and_compare(p: &Pair, expect_transport: &str) {
    for d in [&p.d1, &p.d2] {
        assert_eq!(
            d.status().link_transport.as_deref(),
            Some(expect_transport),
            "status names the transport in use"
        );
    }
    let mut writers = Vec::new();
    for (w, disk) in [&p.d1, &p.d2, &p.d1, &p.d2].into_iter().enumerate() {
        let disk = disk.clone();
        writers.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(w as u64);
            for i in 0..300u32 {
                let blocks = rng.random_range(1..=16u64);
                let off = rng.random_range(0..256 - blocks) * BS as u64;
                let data = Bytes::from(vec![rng.random::<u8>(); (blocks * BS as u64) as usize]);
                let flags = if i % 7 == 0 {
                    IoFlags::FUA
                } else {
                    IoFlags::empty()
                };
                disk.write(off, data, flags).await.unwrap();
                if i % 50 == 0 {
                    disk.flush().await.unwrap();
                }
            }
        }));
    }
    for w in writers {
        within("writers", w).await.unwrap();
    }
    let a = p.m1.read(0, SIZE as usize).await.unwrap();
    let b = p.m2.read(0, SIZE as usize).await.unwrap();
    assert!(a == b, "replicas differ after the hammer");
    let via1 = p.d1.read(0, SIZE as usize).await.unwrap();
    let via2 = p.d2.read(0, SIZE as usize).await.unwrap();
    assert!(via1 == a && via2 == a, "both disks read the replicas' data");
    assert!(a.iter().any(|&b| b != 0), "the hammer wrote something");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_over_inproc_loopback() {
    let mut cfg = InProcConfig::default();
    cfg.busy_poll = Some(Duration::from_micros(20));
    let p = mirror_over(
        Arc::new(InProcTransport::with_config(cfg)),
        "inproc:mirror-a",
    )
    .await;
    hammer_and_compare(&p, "loopback").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_over_four_tcp_lanes() {
    let t = LanesTransport::new(Arc::new(TcpTransport::new()), 4).unwrap();
    let p = mirror_over(Arc::new(t), "127.0.0.1:0").await;
    hammer_and_compare(&p, "tcp*4").await;
}

/// Contracts of lanes and the in-process loopback, one per test: a refused message leaves no
/// hole, errors are final, a plain link's first message and cancel safety at the listener,
/// backpressure, ordering with a slow lane, the listener's address freed on drop, byte
/// counts, busy-poll on a current-thread runtime, and the mirror over inproc with busy-poll.
mod contracts {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use bytes::Bytes;
    use tokio::time::timeout;
    use vsan_core::{ErrorKind, IoFuture};
    use vsan_replica::protocol::{Message, WritePayload};
    use vsan_replica::transport::lanes::LanesTransport;
    use vsan_replica::transport::loopback::inproc::{InProcConfig, InProcTransport};
    use vsan_replica::transport::{Link, LinkRx, Listener, Transport};

    async fn link_pair(t: &dyn Transport, addr: &str) -> (Link, Link) {
        let listener = t.listen(addr).await.unwrap();
        let at = listener.local_addr();
        let (a, b) = tokio::join!(t.connect(&at), listener.accept());
        (a.unwrap(), b.unwrap())
    }

    fn ping_id(m: &Message) -> u64 {
        match m {
            Message::Ping { id } => *id,
            other => panic!("expected a ping, got {other:?}"),
        }
    }

    fn write_of(id: u64, data: Bytes) -> Message {
        Message::Write {
            id,
            offset: 0,
            payload: WritePayload::Data(data),
            fua: false,
        }
    }

    // ----- lanes: a refused message must not leave a hole in the sequence -----

    /// `LinkTx::send` refuses a message `wire::validate` refuses with InvalidArgument, and
    /// (as on every plain transport) the link goes on working. Over lanes the refused
    /// batch has already taken its sequence numbers, so the receiver waits for them
    /// forever: every later message sits in the reorder buffer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_a_refused_message_does_not_wedge_the_link() {
        let t = LanesTransport::new(Arc::new(InProcTransport::new()), 2).unwrap();
        let (a, mut b) = link_pair(&t, "rv-refused").await;
        a.send(Message::Ping { id: 1 }).await.unwrap();
        let bad = Message::Write {
            id: 9,
            offset: 0,
            payload: WritePayload::Zeroes { len: 0 },
            fua: false,
        };
        let e = a.send(bad).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        // The link itself is fine (a plain inproc or tcp link keeps working here).
        a.send(Message::Ping { id: 2 }).await.unwrap();
        let m = timeout(Duration::from_secs(2), b.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ping_id(&m), 1);
        let m = timeout(Duration::from_secs(2), b.recv())
            .await
            .expect("ping 2 never delivered: the refused message's sequence number left a hole")
            .unwrap();
        assert_eq!(ping_id(&m), 2);
    }

    // ----- lanes: errors are final -----

    /// "Errors from a link are final: after `send` fails every later call fails too."
    /// LanesTx fails a send when the lane it picked is gone, then succeeds on the next
    /// send that picks a healthy lane; the failed batch's sequence number is a hole the
    /// receiver never fills.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_a_send_error_is_final() {
        let inner = InProcTransport::new();
        // The acceptor side takes the raw lanes, so the test can kill one.
        let raw = inner.listen("rv-final").await.unwrap();
        let lanes = LanesTransport::new(Arc::new(inner.clone()), 2).unwrap();
        let (a, l0, l1) = {
            let (a, l0, l1) = tokio::join!(lanes.connect("rv-final"), raw.accept(), raw.accept());
            (a.unwrap(), l0.unwrap(), l1.unwrap())
        };
        // Raw lane 0 is drained by a task (so its depth stays 0); raw lane 1 is dropped.
        let (mut l0, mut l1) = (l0, l1);
        assert!(matches!(l0.recv().await.unwrap(), Message::LaneJoin { .. }));
        assert!(matches!(l1.recv().await.unwrap(), Message::LaneJoin { .. }));
        drop(l1);
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let seen2 = Arc::clone(&seen);
        let drain = tokio::spawn(async move {
            while let Ok(m) = l0.recv().await {
                seen2.lock().push(m);
            }
        });
        let mut results = Vec::new();
        for i in 0..6u64 {
            results.push(a.send(Message::Ping { id: i }).await.map_err(|e| e.kind()));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drain.abort();
        let first_err = results.iter().position(|r| r.is_err());
        println!("send results: {results:?}");
        println!("lane 0 got: {:?}", seen.lock());
        if let Some(i) = first_err {
            assert!(
                results[i..].iter().all(|r| r.is_err()),
                "a send succeeded after an earlier send failed: {results:?}"
            );
        }
    }

    /// The same for `recv`: once a lane failed and `recv` reported it, a message another
    /// lane delivers later must not come out of a later `recv`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_a_recv_error_is_final() {
        let inner: Arc<dyn Transport> = Arc::new(InProcTransport::new());
        let lanes = LanesTransport::new(Arc::clone(&inner), 2).unwrap();
        let listener = lanes.listen("rv-recv-final").await.unwrap();
        let l0 = inner.connect("rv-recv-final").await.unwrap();
        let l1 = inner.connect("rv-recv-final").await.unwrap();
        for (i, l) in [&l0, &l1].into_iter().enumerate() {
            l.send(Message::LaneJoin {
                group: 7,
                index: i as u32,
                count: 2,
            })
            .await
            .unwrap();
        }
        let mut g = timeout(Duration::from_secs(2), listener.accept())
            .await
            .unwrap()
            .unwrap();
        // Lane 1 breaks the protocol: the group link fails.
        l1.send(Message::LaneJoin {
            group: 7,
            index: 1,
            count: 2,
        })
        .await
        .unwrap();
        let e = timeout(Duration::from_secs(2), g.recv())
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        // Lane 0 then delivers message 0.
        l0.send_batch(vec![Message::LaneSeq { seq: 0 }, Message::Ping { id: 5 }])
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let again = timeout(Duration::from_secs(2), g.recv()).await.unwrap();
        assert!(
            again.is_err(),
            "recv returned {again:?} after it had failed with {e}"
        );
    }

    // ----- lanes listener: plain links' first message and cancel safety -----

    /// `LinkRx::recv` is cancel-safe: a future dropped before it completes loses no
    /// message. A plain link handed out by a lanes listener (Replay) takes its first
    /// message out when `recv` is called, not when the future is polled, so a `recv`
    /// future dropped unpolled (a `select!` whose other branch was ready) loses it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_listener_plain_link_recv_is_cancel_safe() {
        let inner: Arc<dyn Transport> = Arc::new(InProcTransport::new());
        let lanes = LanesTransport::new(Arc::clone(&inner), 1).unwrap();
        let listener = lanes.listen("rv-replay").await.unwrap();
        let plain = inner.connect("rv-replay").await.unwrap();
        plain.send(Message::Ping { id: 1 }).await.unwrap();
        plain.send(Message::Ping { id: 2 }).await.unwrap();
        let got = timeout(Duration::from_secs(2), listener.accept())
            .await
            .unwrap()
            .unwrap();
        // The receiving half, as a driver holds it.
        let (_tx, mut rx) = got.into_split();
        // A select! where the other branch wins before recv is ever polled.
        tokio::select! {
            biased;
            _ = std::future::ready(()) => {}
            _ = rx.recv() => unreachable!(),
        }
        let m = timeout(Duration::from_secs(2), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            ping_id(&m),
            1,
            "the first message was lost by a dropped recv future"
        );
    }

    // ----- lanes: backpressure -----

    /// "`send` waits while the link's send queue is above the transport's limit." Over
    /// lanes, each lane's reader task drains its lane into the reorder buffer whether or
    /// not anyone calls `recv`, so a sender never waits: here 256 MiB of writes are
    /// accepted at once by a link whose lanes allow 1 MiB each, and all of it is held in
    /// the receiver's memory (over TCP each of those would be a fresh allocation).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_keep_the_inner_transports_backpressure() {
        let mut cfg = InProcConfig::default();
        cfg.send_queue_limit = 1 << 20;
        // The plain link waits: the baseline.
        let plain = InProcTransport::with_config(cfg.clone());
        let (a, _b) = link_pair(&plain, "rv-bp-plain").await;
        let data = Bytes::from(vec![7u8; 1 << 20]);
        let mut blocked_plain = false;
        for i in 0..256 {
            if timeout(
                Duration::from_millis(200),
                a.send(write_of(i, data.clone())),
            )
            .await
            .is_err()
            {
                blocked_plain = true;
                break;
            }
        }
        assert!(blocked_plain, "a plain inproc link applies backpressure");
        // Lanes over the same transport: nobody receives, yet every send completes.
        let lanes = LanesTransport::new(Arc::new(InProcTransport::with_config(cfg)), 2).unwrap();
        let (a, _b) = link_pair(&lanes, "rv-bp-lanes").await;
        let mut sent = 0;
        for i in 0..256 {
            if timeout(
                Duration::from_millis(200),
                a.send(write_of(i, data.clone())),
            )
            .await
            .is_err()
            {
                break;
            }
            sent += 1;
            tokio::task::yield_now().await;
        }
        assert!(
            sent < 256,
            "lanes accepted all {sent} MiB with nobody receiving: no backpressure, the \
         receiver buffers it all"
        );
    }

    /// A slow consumer is not a protocol violation: the messages are all in order, the
    /// receiver just has not taken them yet. Lanes count in-order messages that wait for
    /// `recv` against the reorder window (2^20 messages) and fail the link with "message
    /// out of the reorder window".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_a_slow_consumer_is_not_out_of_the_reorder_window() {
        let t = LanesTransport::new(Arc::new(InProcTransport::new()), 2).unwrap();
        let (a, mut b) = link_pair(&t, "rv-window").await;
        let n: u64 = (1 << 20) + 16;
        let batch = 4096u64;
        let mut id = 0;
        while id < n {
            let k = batch.min(n - id);
            a.send_batch((id..id + k).map(|i| Message::Ping { id: i }).collect())
                .await
                .unwrap();
            id += k;
        }
        // Let the lane readers take it all.
        tokio::time::sleep(Duration::from_secs(2)).await;
        for i in 0..n {
            match timeout(Duration::from_secs(5), b.recv()).await.unwrap() {
                Ok(m) => assert_eq!(ping_id(&m), i),
                Err(e) => panic!("message {i} of {n}, all in order: {e}"),
            }
        }
    }

    // ----- lanes: orderly close -----

    /// A transport wrapper whose accepted links deliver slowly on the lane that joined as
    /// index 1 (a lossy path: a TCP retransmission timeout backs off 0.2, 0.4, 0.8, 1.6 s).
    #[derive(Debug)]
    struct SlowLane1(InProcTransport);

    #[derive(Debug)]
    struct SlowListener(Box<dyn Listener>);

    #[derive(Debug)]
    struct SlowRx {
        rx: Box<dyn LinkRx>,
        slow: bool,
    }

    impl LinkRx for SlowRx {
        fn recv(&mut self) -> IoFuture<'_, Message> {
            Box::pin(async move {
                let r = self.rx.recv().await;
                if let Ok(Message::LaneJoin { index: 1, .. }) = &r {
                    self.slow = true;
                } else if self.slow {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                }
                r
            })
        }
        fn peer(&self) -> &str {
            self.rx.peer()
        }
    }

    impl Listener for SlowListener {
        fn accept(&self) -> IoFuture<'_, Link> {
            Box::pin(async move {
                let (tx, rx) = self.0.accept().await?.into_split();
                Ok(Link::new(tx, Box::new(SlowRx { rx, slow: false })))
            })
        }
        fn local_addr(&self) -> String {
            self.0.local_addr()
        }
    }

    impl Transport for SlowLane1 {
        fn name(&self) -> &'static str {
            "slow"
        }
        fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
            self.0.connect(addr)
        }
        fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
            Box::pin(async move {
                Ok(Box::new(SlowListener(self.0.listen(addr).await?)) as Box<dyn Listener>)
            })
        }
    }

    /// "Sends everything already queued, then tells the peer no more will come (the
    /// peer's `recv` sees Closed after the last message)." Over lanes, the receiver gives
    /// the other lanes END_GRACE (1 s) after the first lane ends; a lane that is slower
    /// than that loses its messages and the receiver reports a clean Closed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lanes_orderly_close_loses_nothing_on_a_slow_lane() {
        let t = LanesTransport::new(Arc::new(SlowLane1(InProcTransport::new())), 2).unwrap();
        let (a, mut b) = link_pair(&t, "rv-grace").await;
        for i in 0..4u64 {
            a.send(Message::Ping { id: i }).await.unwrap();
        }
        a.close().await.unwrap();
        let mut got = Vec::new();
        let end = loop {
            match timeout(Duration::from_secs(20), b.recv()).await.unwrap() {
                Ok(m) => got.push(ping_id(&m)),
                Err(e) => break e,
            }
        };
        assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
        assert_eq!(got, vec![0, 1, 2, 3], "an orderly close lost messages");
    }

    // ----- lanes listener: drop semantics -----

    /// "Dropping the listener stops listening": once `drop` returns, the address is free.
    /// The lanes listener only aborts its task; the inner listener lives on until the
    /// runtime gets round to cancelling it.
    #[tokio::test(flavor = "current_thread")]
    async fn lanes_listener_drop_frees_the_address() {
        let lanes = LanesTransport::new(Arc::new(InProcTransport::new()), 2).unwrap();
        let l = lanes.listen("rv-drop").await.unwrap();
        drop(l);
        let again = lanes.listen("rv-drop").await;
        assert!(again.is_ok(), "listen after drop: {:?}", again.err());
    }

    // ----- inproc: byte accounting -----

    /// The byte count is added after the queue lock is released, so a receiver that takes
    /// the message first subtracts before the sender adds: the count wraps below zero
    /// (`queue_depth().bytes` near usize::MAX) and the sender's `before + added`
    /// overflows (a panic in debug builds). A busy-polling receiver on another worker
    /// makes the window easy to hit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inproc_byte_count_never_wraps() {
        let mut cfg = InProcConfig::default();
        cfg.busy_poll = Some(Duration::from_millis(50));
        let t = InProcTransport::with_config(cfg);
        let (a, mut b) = link_pair(&t, "rv-bytes").await;
        let a = Arc::new(a);
        let n = 300_000u64;
        let rx = tokio::spawn(async move {
            for _ in 0..n {
                b.recv().await.unwrap();
            }
        });
        let worst = Arc::new(AtomicUsize::new(0));
        let a2 = Arc::clone(&a);
        let worst2 = Arc::clone(&worst);
        let watch = std::thread::spawn(move || {
            for _ in 0..2_000_000 {
                let d = a2.queue_depth().bytes;
                worst2.fetch_max(d, Ordering::Relaxed);
            }
        });
        let data = Bytes::from(vec![1u8; 512]);
        let sender = tokio::spawn(async move {
            for i in 0..n {
                a.send(write_of(i, data.clone())).await.unwrap();
            }
        });
        let r = sender.await;
        watch.join().unwrap();
        rx.abort();
        assert!(r.is_ok(), "sender panicked: {r:?}");
        let w = worst.load(Ordering::Relaxed);
        assert!(
            w < 1 << 40,
            "queue_depth().bytes was {w:#x}: the count wrapped"
        );
    }

    // ----- inproc: busy-poll on a current-thread runtime -----

    fn thread_cpu() -> Duration {
        // SAFETY: rusage is plain old data; all zeroes is a valid value.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a valid, writable rusage for the call to fill.
        unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
        Duration::from_secs(ru.ru_utime.tv_sec as u64 + ru.ru_stime.tv_sec as u64)
            + Duration::from_micros(ru.ru_utime.tv_usec as u64 + ru.ru_stime.tv_usec as u64)
    }

    /// The module docs: "Spinning holds a runtime worker thread, so it is skipped on a
    /// current-thread runtime." It is not: an idle receiver on a current-thread runtime
    /// burns the thread for the whole budget.
    #[tokio::test(flavor = "current_thread")]
    async fn inproc_busy_poll_is_skipped_on_a_current_thread_runtime() {
        let mut cfg = InProcConfig::default();
        cfg.busy_poll = Some(Duration::from_secs(5));
        let t = InProcTransport::with_config(cfg);
        let (_a, mut b) = link_pair(&t, "rv-ct").await;
        let before = thread_cpu();
        let _ = timeout(Duration::from_millis(500), b.recv()).await;
        let spent = thread_cpu() - before;
        assert!(
            spent < Duration::from_millis(100),
            "an idle recv on a current-thread runtime spun for {spent:?} of CPU in 500 ms"
        );
    }

    // ----- the mirror over inproc with busy-poll -----

    mod mirror {
        use std::collections::HashMap;
        use std::sync::Arc;
        use std::time::Duration;

        use bytes::Bytes;
        use tokio::time::timeout;
        use vsan_core::{BlockDevice, Geometry, IoFlags, MemDevice};
        use vsan_replica::connect::{accept_loop, dial_loop};
        use vsan_replica::protocol::{Config, DiskId, LinkState};
        use vsan_replica::transport::Transport;
        use vsan_replica::transport::loopback::inproc::{InProcConfig, InProcTransport};
        use vsan_replica::{MirroredDisk, Replica};

        const BS: u32 = 4096;
        const SIZE: u64 = 8 << 20;

        /// The driver sends from its own task; the peer's driver busy-polls. The inproc
        /// byte-count race panics the sending driver in a debug build ("attempt to add
        /// with overflow" at inproc.rs:318), and the disk stops: "mirror driver has
        /// stopped".
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_mirror_over_busy_polled_inproc_survives_many_small_writes() {
            let mut cfg = InProcConfig::default();
            cfg.busy_poll = Some(Duration::from_millis(1));
            let transport: Arc<dyn Transport> = Arc::new(InProcTransport::with_config(cfg));
            let geometry = Geometry::new(SIZE, BS).unwrap();
            let mut disks = Vec::new();
            for node in [1u32, 2] {
                let mut c = Config::new(node, 3 - node, DiskId([0x5a; 16]), "rv0", SIZE, BS);
                c.connect_timeout = Duration::from_secs(2);
                let m: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(geometry));
                let replica = Replica::with_memory_meta(&c, m).await.unwrap();
                disks.push(MirroredDisk::start(c, replica, None).unwrap());
            }
            let (d1, d2) = (disks[0].clone(), disks[1].clone());
            let listener = transport.listen("inproc:rv-mirror").await.unwrap();
            let at = listener.local_addr();
            let tasks = [
                tokio::spawn(accept_loop(
                    listener,
                    HashMap::from([(d2.name().to_string(), d2.clone())]),
                )),
                tokio::spawn(dial_loop(Arc::clone(&transport), at, d1.clone())),
            ];
            for d in [&d1, &d2] {
                let mut w = d.watch_status();
                timeout(Duration::from_secs(10), async {
                    while w.borrow_and_update().link != LinkState::Connected || w.borrow().syncing {
                        w.changed().await.unwrap();
                    }
                })
                .await
                .unwrap();
            }
            let mut writers = Vec::new();
            for w in 0..4u64 {
                let d = if w % 2 == 0 { d1.clone() } else { d2.clone() };
                writers.push(tokio::spawn(async move {
                    let data = Bytes::from(vec![w as u8 + 1; BS as usize]);
                    // Eight seconds of small writes (the race is a few instructions wide).
                    let until = tokio::time::Instant::now() + Duration::from_secs(8);
                    for i in 0u64.. {
                        if tokio::time::Instant::now() > until {
                            break;
                        }
                        let off = ((w * 7 + i) % 256) * BS as u64;
                        if let Err(e) = d.write(off, data.clone(), IoFlags::empty()).await {
                            return Err(format!("writer {w}: write {i}: {e}"));
                        }
                    }
                    Ok(())
                }));
            }
            for w in writers {
                timeout(Duration::from_secs(120), w)
                    .await
                    .unwrap()
                    .unwrap()
                    .unwrap();
            }
            for t in tasks {
                t.abort();
            }
        }
    }
}
