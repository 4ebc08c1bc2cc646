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
