//! The QUIC transport on loopback: messages of every kind and size arrive intact and in
//! order, close and backpressure behave as the link traits say, peers are authenticated
//! by pinned fingerprints or a CA (and refused with a clear message on both sides when
//! they fail), identities persist across restarts, garbage datagrams and silent peers
//! are survived, and two mirrored disks stay identical over QUIC. Every wait is bounded.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{
    Config, DiskId, Generations, Hello, LinkState, Message, PROTOCOL_VERSION, Status, WritePayload,
};
use vsan_replica::transport::quic::{
    CaCertificates, Fingerprint, Identity, QuicConfig, QuicTransport,
};
use vsan_replica::transport::{Link, LinkTx, Listener, QueueDepth, Transport};
use vsan_replica::{MirrorStatus, MirroredDisk, Replica};

/// Bound on any single wait in these tests.
const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {WAIT:?}"),
    }
}

fn identity(name: &str) -> Identity {
    Identity::generate(name).unwrap()
}

/// (client, server) transports for two fresh identities that pin each other; `tune`
/// adjusts both configs.
fn pinned_transports(tune: impl Fn(&mut QuicConfig)) -> (QuicTransport, QuicTransport) {
    let (a, b) = (identity("node1"), identity("node2"));
    let mut ca = QuicConfig::pinned(a.clone(), [b.fingerprint()]);
    let mut cb = QuicConfig::pinned(b, [a.fingerprint()]);
    tune(&mut ca);
    tune(&mut cb);
    (
        QuicTransport::new(ca).unwrap(),
        QuicTransport::new(cb).unwrap(),
    )
}

async fn listen(transport: &QuicTransport) -> Box<dyn Listener> {
    within("listen", transport.listen("127.0.0.1:0"))
        .await
        .unwrap()
}

/// A connected pair: (dialler, acceptor).
async fn pair_with(client: &QuicTransport, server: &QuicTransport) -> (Link, Link) {
    let listener = listen(server).await;
    let addr = listener.local_addr();
    let (a, b) = within("connect", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    (a.unwrap(), b.unwrap())
}

async fn pair() -> (Link, Link) {
    let (client, server) = pinned_transports(|_| {});
    pair_with(&client, &server).await
}

/// Both sides' results of one connection attempt.
async fn attempt(
    client: &QuicTransport,
    listener: &dyn Listener,
) -> (vsan_core::Result<Link>, vsan_core::Result<Link>) {
    let addr = listener.local_addr();
    within("handshake", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await
}

/// 4 KiB whose every byte depends on `seed`.
fn block(seed: u64) -> Bytes {
    sized(seed, 4096)
}

/// `len` bytes that depend on `seed`.
fn sized(seed: u64, len: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while b.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.put_u64(x);
    }
    b.truncate(len);
    b.freeze()
}

fn one_of_each() -> Vec<Message> {
    vec![
        Message::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            node_id: 1,
            peer_id: 2,
            disk_id: DiskId([7; 16]),
            disk_name: "vol0".into(),
            size: 1 << 30,
            block_size: 4096,
            chunk_size: 64 * 1024,
            generations: Generations {
                current: 9,
                bitmap: 8,
                history: [7, 6],
            },
            dirty_chunks: 12,
            crashed: true,
            inconsistent: false,
            discard_my_data: true,
            split_brain_policy: 2,
        }),
        Message::Welcome,
        Message::Refuse {
            reason: "disk id differs".into(),
        },
        Message::Write {
            id: 1,
            offset: 4096,
            payload: WritePayload::Data(block(1)),
            fua: true,
        },
        Message::Write {
            id: 2,
            offset: 0,
            payload: WritePayload::Zeroes { len: 1 << 20 },
            fua: false,
        },
        Message::Write {
            id: 3,
            offset: 1 << 20,
            payload: WritePayload::Discard { len: 65536 },
            fua: false,
        },
        Message::WriteAck {
            id: 1,
            status: Status::Ok,
        },
        Message::Flush { id: 4 },
        Message::FlushAck {
            id: 4,
            status: Status::Failed(ErrorKind::Io as u32),
        },
        Message::Read {
            id: 5,
            offset: 8192,
            len: 4096,
        },
        Message::ReadReply {
            id: 5,
            status: Status::Ok,
            data: block(5),
        },
        Message::Ping { id: 6 },
        Message::Pong { id: 6 },
    ]
}

// ----- messages -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_kind_arrive_in_order_both_ways() {
    let (mut a, mut b) = pair().await;
    assert!(a.peer().starts_with("quic:127.0.0.1:"), "{}", a.peer());
    assert!(b.peer().starts_with("quic:127.0.0.1:"), "{}", b.peer());
    assert_eq!((a.transport(), b.transport()), ("quic", "quic"));
    for msg in one_of_each() {
        within("send", a.send(msg)).await.unwrap();
    }
    for msg in one_of_each() {
        assert_eq!(within("recv", b.recv()).await.unwrap(), msg);
    }
    for msg in one_of_each().into_iter().rev() {
        within("send", b.send(msg)).await.unwrap();
    }
    for msg in one_of_each().into_iter().rev() {
        assert_eq!(within("recv", a.recv()).await.unwrap(), msg);
    }
}

/// Sizes from one byte to more than a flow-control window, edges around powers of two
/// and packet sizes included, then random ones.
fn sizes(seed: u64) -> Vec<usize> {
    let mut sizes = vec![
        1,
        2,
        3,
        511,
        512,
        513,
        1199,
        1200,
        1500,
        4095,
        4096,
        4097,
        65535,
        65536,
        65537,
        (1 << 20) + 3,
        (9 << 20) + 1,
    ];
    let mut rng = SmallRng::seed_from_u64(seed);
    sizes.extend((0..300).map(|_| rng.random_range(1..200_000)));
    sizes
}

/// Sends writes of every size one way while read replies of every size go the other,
/// at the same time; each side checks what it gets, then sees `Closed` after the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_of_every_size_cross_both_ways_at_once() {
    let (a, b) = pair().await;
    let (a_tx, mut a_rx) = a.into_split();
    let (b_tx, mut b_rx) = b.into_split();
    let writes = tokio::spawn(async move {
        for (id, len) in sizes(1).into_iter().enumerate() {
            let id = id as u64;
            let msg = Message::Write {
                id,
                offset: id * 512,
                payload: WritePayload::Data(sized(id, len)),
                fua: id % 2 == 0,
            };
            a_tx.send(msg).await.unwrap();
        }
        a_tx.close().await.unwrap();
        a_tx
    });
    let replies = tokio::spawn(async move {
        for (id, len) in sizes(2).into_iter().enumerate() {
            let id = id as u64;
            let msg = Message::ReadReply {
                id,
                status: Status::Ok,
                data: sized(!id, len),
            };
            b_tx.send(msg).await.unwrap();
        }
        b_tx.close().await.unwrap();
        b_tx
    });
    let check_writes = async {
        for (id, len) in sizes(1).into_iter().enumerate() {
            let id = id as u64;
            match within("recv write", b_rx.recv()).await.unwrap() {
                Message::Write {
                    id: got,
                    offset,
                    payload: WritePayload::Data(data),
                    fua,
                } => {
                    assert_eq!((got, offset, fua), (id, id * 512, id % 2 == 0));
                    assert_eq!(data.len(), len, "write {id}");
                    assert!(data == sized(id, len), "write {id}: data differs");
                }
                other => panic!("write {id}: got {other:?}"),
            }
        }
        let end = within("recv after close", b_rx.recv()).await.unwrap_err();
        assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    };
    let check_replies = async {
        for (id, len) in sizes(2).into_iter().enumerate() {
            let id = id as u64;
            match within("recv reply", a_rx.recv()).await.unwrap() {
                Message::ReadReply {
                    id: got,
                    status: Status::Ok,
                    data,
                } => {
                    assert_eq!(got, id);
                    assert!(data == sized(!id, len), "reply {id}: data differs");
                }
                other => panic!("reply {id}: got {other:?}"),
            }
        }
        let end = within("recv after close", a_rx.recv()).await.unwrap_err();
        assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    };
    tokio::join!(check_writes, check_replies);
    let a_tx = within("writer", writes).await.unwrap();
    let b_tx = within("replier", replies).await.unwrap();
    assert_eq!(a_tx.queue_depth(), QueueDepth::default());
    assert_eq!(b_tx.queue_depth(), QueueDepth::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_pipelined_4k_writes_arrive_intact() {
    const N: u64 = 10_000;
    let (a, b) = pair().await;
    let (tx, _a_rx) = a.into_split();
    let (_b_tx, mut rx) = b.into_split();
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        for id in 0..N {
            let msg = Message::Write {
                id,
                offset: id * 4096,
                payload: WritePayload::Data(block(id)),
                fua: false,
            };
            tx.send(msg).await.unwrap();
        }
        tx.close().await.unwrap();
        tx
    });
    for id in 0..N {
        match within("recv", rx.recv()).await.unwrap() {
            Message::Write {
                id: got,
                offset,
                payload: WritePayload::Data(data),
                fua: false,
            } => {
                assert_eq!((got, offset), (id, id * 4096));
                assert!(data == block(id), "write {id}: data differs");
            }
            other => panic!("write {id}: got {other:?}"),
        }
    }
    let end = within("recv after close", rx.recv()).await.unwrap_err();
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    let tx = within("sender", sender).await.unwrap();
    assert_eq!(tx.queue_depth(), QueueDepth::default());
    let secs = started.elapsed().as_secs_f64();
    println!(
        "quic 10k x 4 KiB pipelined: {:.3} s, {:.0} MiB/s, {:.0} writes/s",
        secs,
        (N * 4096) as f64 / secs / (1 << 20) as f64,
        N as f64 / secs
    );
}

/// Several tasks send single messages and batches through one sending half: each task's
/// messages arrive in its order, and every batch arrives in one piece.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_senders_keep_order_and_batches_stay_together() {
    const TASKS: u64 = 4;
    const ROUNDS: u64 = 300;
    let (a, b) = pair().await;
    let (tx, _a_rx) = a.into_split();
    let tx: Arc<dyn LinkTx> = Arc::from(tx);
    let (_b_tx, mut rx) = b.into_split();
    let mut senders = Vec::new();
    for task in 0..TASKS {
        let tx = Arc::clone(&tx);
        senders.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(task);
            let mut n = 0u64;
            for _ in 0..ROUNDS {
                let id = |n: u64| task << 32 | n;
                if rng.random_bool(0.5) {
                    tx.send(Message::Ping { id: id(n) }).await.unwrap();
                    n += 1;
                } else {
                    // A batch: Writes whose offset says how many follow in the batch.
                    let len = rng.random_range(1..20u64);
                    let batch = (0..len)
                        .map(|i| Message::Write {
                            id: id(n + i),
                            offset: (len - 1 - i) * 512,
                            payload: WritePayload::Data(sized(id(n + i), 700)),
                            fua: false,
                        })
                        .collect();
                    tx.send_batch(batch).await.unwrap();
                    n += len;
                }
            }
            n
        }));
    }
    let mut sent = [0u64; TASKS as usize];
    for (task, s) in senders.into_iter().enumerate() {
        sent[task] = within("sender", s).await.unwrap();
    }
    let total: u64 = sent.iter().sum();
    let mut next = [0u64; TASKS as usize];
    // (task, messages still to come) of the batch being received.
    let mut in_batch: Option<(usize, u64)> = None;
    for _ in 0..total {
        let msg = within("recv", rx.recv()).await.unwrap();
        let (id, left) = match &msg {
            Message::Ping { id } => (*id, None),
            Message::Write {
                id,
                offset,
                payload: WritePayload::Data(data),
                ..
            } => {
                assert!(*data == sized(*id, 700));
                (*id, Some(offset / 512))
            }
            other => panic!("{other:?}"),
        };
        let (task, n) = ((id >> 32) as usize, id & 0xffff_ffff);
        assert_eq!(n, next[task], "task {task} out of order");
        next[task] += 1;
        if let Some((batch_task, _)) = in_batch {
            assert_eq!(
                task, batch_task,
                "a message came between a batch's messages"
            );
        }
        in_batch = match left {
            Some(0) | None => None,
            Some(left) => Some((task, left)),
        };
    }
    assert_eq!(next, sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_waits_while_the_queue_is_over_its_limit() {
    const LIMIT: usize = 64 * 1024;
    let (client, server) = pinned_transports(|c| c.send_queue_limit = LIMIT);
    let (a, b) = pair_with(&client, &server).await;
    let (_b_tx, mut rx) = b.into_split();
    let reader = tokio::spawn(async move {
        for id in 0..4_000u64 {
            let msg = within("recv", rx.recv()).await.unwrap();
            assert!(matches!(msg, Message::Write { id: got, .. } if got == id));
        }
    });
    for id in 0..4_000u64 {
        let msg = Message::Write {
            id,
            offset: 0,
            payload: WritePayload::Data(block(id)),
            fua: false,
        };
        within("send", a.send(msg)).await.unwrap();
        let depth = a.queue_depth();
        assert!(depth.bytes <= LIMIT, "send returned with {depth:?} queued");
    }
    within("reader", reader).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_depth_counts_what_quinn_has_not_taken() {
    let (client, server) = pinned_transports(|c| c.send_queue_limit = usize::MAX);
    let (a, mut b) = pair_with(&client, &server).await;
    assert_eq!(a.queue_depth(), QueueDepth::default());
    // The peer does not read: its flow-control window fills, then the queue grows.
    const N: u64 = 8_000;
    for id in 0..N {
        let msg = Message::Write {
            id,
            offset: 0,
            payload: WritePayload::Data(block(id)),
            fua: false,
        };
        within("send", a.send(msg)).await.unwrap();
    }
    let deadline = Instant::now() + WAIT;
    let depth = loop {
        // The writer may still be handing frames over; wait until it is stuck.
        let before = a.queue_depth();
        tokio::time::sleep(Duration::from_millis(50)).await;
        if a.queue_depth() == before || Instant::now() > deadline {
            break before;
        }
    };
    assert!(
        depth.messages > 0 && depth.bytes > depth.messages * 4096,
        "{depth:?}"
    );
    for id in 0..N {
        let Message::Write { id: got, .. } = within("recv", b.recv()).await.unwrap() else {
            panic!("not a write");
        };
        assert_eq!(got, id);
    }
    within("close", a.close()).await.unwrap();
    assert_eq!(a.queue_depth(), QueueDepth::default());
}

// ----- close and errors -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delivers_what_was_sent_then_ends_the_link() {
    let (a, mut b) = pair().await;
    within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    within("send", a.send(Message::Flush { id: 2 }))
        .await
        .unwrap();
    within("close", a.close()).await.unwrap();
    within("close again", a.close()).await.unwrap();
    let late = within("send after close", a.send(Message::Ping { id: 3 }))
        .await
        .unwrap_err();
    assert_eq!(late.kind(), ErrorKind::Closed);
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Flush { id: 2 }
    );
    let end = within("recv", b.recv()).await.unwrap_err();
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    assert_eq!(
        within("recv", b.recv()).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    // Closing one direction leaves the other open.
    within("send back", b.send(Message::Pong { id: 1 }))
        .await
        .unwrap();
    let mut a = a;
    assert_eq!(
        within("recv", a.recv()).await.unwrap(),
        Message::Pong { id: 1 }
    );
}

/// `close` returns once the peer has everything, so dropping the link right after loses
/// nothing, even megabytes the peer has not read yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_link_right_after_close_loses_nothing() {
    let (a, mut b) = pair().await;
    for id in 0..500u64 {
        within(
            "send",
            a.send(Message::ReadReply {
                id,
                status: Status::Ok,
                data: block(id),
            }),
        )
        .await
        .unwrap();
    }
    within("close", a.close()).await.unwrap();
    drop(a);
    for id in 0..500u64 {
        match within("recv", b.recv()).await.unwrap() {
            Message::ReadReply { id: got, data, .. } => {
                assert_eq!(got, id);
                assert!(data == block(id));
            }
            other => panic!("{other:?}"),
        }
    }
    let end = within("recv", b.recv()).await.unwrap_err();
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_peer_ends_the_link_for_both_halves() {
    let (a, mut b) = pair().await;
    drop(a);
    let err = within("recv", b.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    let deadline = Instant::now() + WAIT;
    let err = loop {
        if let Err(e) = within("send", b.send(Message::Ping { id: 0 })).await {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "sends to a closed peer keep succeeding"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_send_half_ends_the_peers_receiving() {
    let (a, mut b) = pair().await;
    let (a_tx, mut a_rx) = a.into_split();
    within("send", a_tx.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    within("close", a_tx.close()).await.unwrap();
    drop(a_tx);
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    assert_eq!(
        within("recv", b.recv()).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    // The other direction lives on.
    within("send", b.send(Message::Pong { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", a_rx.recv()).await.unwrap(),
        Message::Pong { id: 1 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_messages_are_refused_and_the_link_lives_on() {
    let (a, mut b) = pair().await;
    let bad = Message::Write {
        id: 1,
        offset: 0,
        payload: WritePayload::Data(Bytes::new()),
        fua: false,
    };
    let err = within("send", a.send(bad.clone())).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = within(
        "send_batch",
        a.send_batch(vec![Message::Ping { id: 1 }, bad]),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    within("send", a.send(Message::Ping { id: 2 }))
        .await
        .unwrap();
    // Nothing of the refused batch went out.
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 2 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_gives_up_on_a_peer_that_stopped_reading() {
    let (client, server) = pinned_transports(|c| {
        c.send_queue_limit = usize::MAX;
        c.close_timeout = Duration::from_millis(200);
    });
    let (a, _b) = pair_with(&client, &server).await;
    // Far more than the flow-control windows hold; `_b` never reads.
    for id in 0..8_000 {
        let msg = Message::Write {
            id,
            offset: 0,
            payload: WritePayload::Data(block(id)),
            fua: false,
        };
        within("send", a.send(msg)).await.unwrap();
    }
    assert!(a.queue_depth().messages > 0);
    let err = within("close", a.close()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert_eq!(a.queue_depth(), QueueDepth::default());
    let late = within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap_err();
    assert_eq!(late.kind(), ErrorKind::Timeout, "{late}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_nothing_times_out() {
    let port = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap().port()
    };
    let (client, _) = pinned_transports(|c| c.connect_timeout = Duration::from_millis(300));
    let started = Instant::now();
    let err = within("connect", client.connect(&format!("127.0.0.1:{port}")))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

// ----- authentication -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_with_an_unpinned_certificate_is_refused_on_both_sides() {
    let (a, b, c) = (identity("node1"), identity("node2"), identity("intruder"));
    // The client expects `c`; the server is `b`.
    let client = QuicTransport::new(QuicConfig::pinned(a.clone(), [c.fingerprint()])).unwrap();
    let server = QuicTransport::new(QuicConfig::pinned(b.clone(), [a.fingerprint()])).unwrap();
    let listener = listen(&server).await;
    let (dialed, accepted) = attempt(&client, &*listener).await;
    let dial_err = dialed.unwrap_err();
    println!("dialer: {dial_err}");
    assert_eq!(dial_err.kind(), ErrorKind::Protocol, "{dial_err}");
    let expect = format!(
        "peer certificate {} is not the pinned {}",
        b.fingerprint(),
        c.fingerprint()
    );
    assert!(dial_err.to_string().contains(&expect), "{dial_err}");
    let accept_err = accepted.unwrap_err();
    println!("acceptor: {accept_err}");
    assert_eq!(accept_err.kind(), ErrorKind::Protocol, "{accept_err}");
    assert!(
        accept_err
            .to_string()
            .contains("the peer refused this node's certificate"),
        "{accept_err}"
    );
    // The listener keeps accepting.
    let good = QuicTransport::new(QuicConfig::pinned(a, [b.fingerprint()])).unwrap();
    let (x, y) = attempt(&good, &*listener).await;
    let (x, mut y) = (x.unwrap(), y.unwrap());
    within("send", x.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", y.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_another_certificate_is_refused_and_the_listener_keeps_accepting() {
    let (a, b, c) = (identity("node1"), identity("node2"), identity("intruder"));
    let server = QuicTransport::new(QuicConfig::pinned(
        b.clone(),
        [a.fingerprint(), identity("spare").fingerprint()],
    ))
    .unwrap();
    let listener = listen(&server).await;
    // `c` pins the server correctly, but the server does not know `c`.
    let intruder = QuicTransport::new(QuicConfig::pinned(c.clone(), [b.fingerprint()])).unwrap();
    let (dialed, accepted) = attempt(&intruder, &*listener).await;
    let accept_err = accepted.unwrap_err();
    println!("acceptor: {accept_err}");
    assert_eq!(accept_err.kind(), ErrorKind::Protocol, "{accept_err}");
    let expect = format!(
        "peer certificate {} is not one of the pinned {}, ",
        c.fingerprint(),
        a.fingerprint()
    );
    assert!(accept_err.to_string().contains(&expect), "{accept_err}");
    let dial_err = dialed.unwrap_err();
    println!("dialer: {dial_err}");
    assert_eq!(dial_err.kind(), ErrorKind::Protocol, "{dial_err}");
    assert!(
        dial_err
            .to_string()
            .contains("the peer refused this node's certificate"),
        "{dial_err}"
    );
    // Several refused in a row, then the right client.
    for _ in 0..3 {
        let (d, acc) = attempt(&intruder, &*listener).await;
        assert!(d.is_err() && acc.is_err());
    }
    let good = QuicTransport::new(QuicConfig::pinned(a, [b.fingerprint()])).unwrap();
    let (x, y) = attempt(&good, &*listener).await;
    let (mut x, y) = (x.unwrap(), y.unwrap());
    within("send", y.send(Message::Pong { id: 9 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", x.recv()).await.unwrap(),
        Message::Pong { id: 9 }
    );
}

/// A CA and leaf certificates it signs, as PEM.
struct TestCa {
    pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    fn certificates(&self) -> CaCertificates {
        CaCertificates::from_pem(self.pem.as_bytes()).unwrap()
    }

    /// A leaf for `names` (DNS names or IP addresses), signed by this CA.
    fn leaf(&self, names: &[&str]) -> Identity {
        let key = rcgen::KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names.clone()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, names[0].as_str());
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Identity::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes()).unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_certificates_from_the_ca_connect() {
    let ca = TestCa::new("vsan test CA");
    let n1 = ca.leaf(&["node1", "127.0.0.1"]);
    let n2 = ca.leaf(&["node2", "127.0.0.1"]);
    let server = QuicTransport::new(QuicConfig::with_ca(n2.clone(), ca.certificates())).unwrap();
    // The name checked is the dialed host, an IP address here.
    let client = QuicTransport::new(QuicConfig::with_ca(n1.clone(), ca.certificates())).unwrap();
    let (mut a, mut b) = pair_with(&client, &server).await;
    for msg in one_of_each() {
        within("send", a.send(msg.clone())).await.unwrap();
        assert_eq!(within("recv", b.recv()).await.unwrap(), msg);
        within("send", b.send(msg.clone())).await.unwrap();
        assert_eq!(within("recv", a.recv()).await.unwrap(), msg);
    }
    // Or a name set in the config.
    let listener = listen(&server).await;
    let mut config = QuicConfig::with_ca(n1.clone(), ca.certificates());
    config.server_name = Some("node2".into());
    let named = QuicTransport::new(config).unwrap();
    let (x, y) = attempt(&named, &*listener).await;
    x.unwrap();
    y.unwrap();
    // A name the certificate lacks is refused.
    let mut config = QuicConfig::with_ca(n1.clone(), ca.certificates());
    config.server_name = Some("node3".into());
    let misnamed = QuicTransport::new(config).unwrap();
    let (x, y) = attempt(&misnamed, &*listener).await;
    let err = x.unwrap_err();
    println!("wrong name: {err}");
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("node3"), "{err}");
    assert!(y.is_err());
    // CA and pinning together: both must pass.
    let mut config = QuicConfig::with_ca(n1.clone(), ca.certificates());
    config.pinned_peers = vec![ca.leaf(&["node2"]).fingerprint()];
    let both = QuicTransport::new(config).unwrap();
    let (x, y) = attempt(&both, &*listener).await;
    let err = x.unwrap_err();
    assert!(err.to_string().contains("is not the pinned"), "{err}");
    assert!(y.is_err());
    let mut config = QuicConfig::with_ca(n1, ca.certificates());
    config.pinned_peers = vec![n2.fingerprint()];
    let both = QuicTransport::new(config).unwrap();
    let (x, y) = attempt(&both, &*listener).await;
    x.unwrap();
    y.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_from_another_ca_or_self_signed_are_refused_on_both_sides() {
    let ca = TestCa::new("vsan test CA");
    let other = TestCa::new("another CA");
    let server = QuicTransport::new(QuicConfig::with_ca(
        ca.leaf(&["node2", "127.0.0.1"]),
        ca.certificates(),
    ))
    .unwrap();
    let listener = listen(&server).await;
    let strangers = [other.leaf(&["node1", "127.0.0.1"]), identity("127.0.0.1")];
    for stranger in strangers {
        // The stranger trusts the right CA, but its own certificate is not from it.
        let client = QuicTransport::new(QuicConfig::with_ca(stranger, ca.certificates())).unwrap();
        let (x, y) = attempt(&client, &*listener).await;
        let (dial_err, accept_err) = (x.unwrap_err(), y.unwrap_err());
        println!("dialer: {dial_err}\nacceptor: {accept_err}");
        assert_eq!(accept_err.kind(), ErrorKind::Protocol, "{accept_err}");
        assert!(
            accept_err.to_string().contains("UnknownIssuer"),
            "{accept_err}"
        );
        assert_eq!(dial_err.kind(), ErrorKind::Protocol, "{dial_err}");
        assert!(
            dial_err
                .to_string()
                .contains("the peer refused this node's certificate"),
            "{dial_err}"
        );
    }
    // And a client from the right CA dialing a server from another.
    let rogue = QuicTransport::new(QuicConfig::with_ca(
        other.leaf(&["node2", "127.0.0.1"]),
        other.certificates(),
    ))
    .unwrap();
    let rogue_listener = listen(&rogue).await;
    let client = QuicTransport::new(QuicConfig::with_ca(
        ca.leaf(&["node1", "127.0.0.1"]),
        ca.certificates(),
    ))
    .unwrap();
    let (x, y) = attempt(&client, &*rogue_listener).await;
    let err = x.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    assert!(y.is_err());
}

#[test]
fn a_config_needs_a_way_to_verify_peers_and_sane_timeouts() {
    let id = identity("node1");
    let err = QuicTransport::new(QuicConfig::new(id.clone())).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(err.to_string().contains("pinned_peers"), "{err}");
    let mut config = QuicConfig::pinned(id.clone(), [id.fingerprint()]);
    config.keep_alive_interval = config.idle_timeout;
    let err = QuicTransport::new(config).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let mut config = QuicConfig::pinned(id.clone(), [id.fingerprint()]);
    config.close_timeout = Duration::ZERO;
    assert!(QuicTransport::new(config).is_err());
    let err = CaCertificates::from_pem(b"not a certificate").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let t = QuicTransport::new(QuicConfig::pinned(id.clone(), [id.fingerprint()])).unwrap();
    assert_eq!(t.name(), "quic");
}

// ----- identities and fingerprints -----

#[test]
fn fingerprints_print_and_parse() {
    let id = identity("node1");
    let fp = id.fingerprint();
    let text = fp.to_string();
    assert!(text.starts_with("sha256:"));
    assert_eq!(text.len(), 7 + 64);
    assert!(
        text[7..]
            .chars()
            .all(|c| matches!(c, '0'..='9' | 'a'..='f'))
    );
    assert_eq!(text.parse::<Fingerprint>().unwrap(), fp);
    assert_eq!(fp, Fingerprint::of_certificate(id.certificate_der()));
    // Upper case, colon pairs, no prefix, spaces around.
    let hex = &text[7..];
    let colons: Vec<String> = hex
        .as_bytes()
        .chunks(2)
        .map(|p| String::from_utf8(p.to_vec()).unwrap().to_uppercase())
        .collect();
    let colons = colons.join(":");
    for form in [
        hex.to_string(),
        hex.to_uppercase(),
        colons.clone(),
        format!("SHA256:{colons}"),
        format!("  sha256:{hex}\n"),
    ] {
        assert_eq!(form.parse::<Fingerprint>().unwrap(), fp, "{form:?}");
    }
    for bad in [
        "",
        "sha256:",
        "sha1:abcd",
        &text[..text.len() - 1],
        &format!("{text}0"),
        &format!("sha256:{}x", &hex[1..]),
        &colons[1..],
        &format!("{}:", colons),
        "sha256:é",
    ] {
        let err = bad.parse::<Fingerprint>().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{bad:?}");
        assert!(err.to_string().contains("64 hex digits"), "{err}");
    }
    let err = format!("sha256:{}g", &hex[1..])
        .parse::<Fingerprint>()
        .unwrap_err();
    assert!(err.to_string().contains("'g' is not a hex digit"), "{err}");
    assert_eq!(Fingerprint::from_bytes(*fp.as_bytes()), fp);
}

#[test]
fn identities_load_from_pem_and_never_show_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("node.crt"), dir.path().join("node.key"));
    let id = Identity::load_or_generate(&cert, &key, "node1").unwrap();
    let key_pem = std::fs::read_to_string(&key).unwrap();
    let again = Identity::from_pem_files(&cert, &key).unwrap();
    assert_eq!(again.fingerprint(), id.fingerprint());
    let debug = format!("{id:?}");
    assert!(debug.contains(&id.fingerprint().to_string()), "{debug}");
    for line in key_pem.lines().filter(|l| !l.starts_with("-----")) {
        assert!(!debug.contains(line), "{debug}");
    }
    // A key that is not the certificate's, or garbage, is refused.
    let other = dir.path().join("other.key");
    Identity::load_or_generate(dir.path().join("other.crt"), &other, "node2").unwrap();
    let err = Identity::from_pem_files(&cert, &other).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let err = Identity::from_pem(b"garbage", key_pem.as_bytes()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    let cert_pem = std::fs::read(&cert).unwrap();
    let err = Identity::from_pem(&cert_pem, b"garbage").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(Identity::generate("").is_err());
}

#[test]
fn load_or_generate_writes_the_files_once_and_reloads_the_same_identity() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("keys");
    let (cert, key) = (sub.join("node.crt"), sub.join("node.key"));
    let first = Identity::load_or_generate(&cert, &key, "node1").unwrap();
    let mode = std::fs::metadata(&key).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "key file mode {mode:o}");
    let cert_bytes = std::fs::read(&cert).unwrap();
    let key_bytes = std::fs::read(&key).unwrap();
    // Only the two files, no temporary left behind.
    let mut names: Vec<String> = std::fs::read_dir(&sub)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["node.crt", "node.key"]);
    for _ in 0..2 {
        let again = Identity::load_or_generate(&cert, &key, "node1").unwrap();
        assert_eq!(again.fingerprint(), first.fingerprint());
    }
    assert_eq!(std::fs::read(&cert).unwrap(), cert_bytes);
    assert_eq!(std::fs::read(&key).unwrap(), key_bytes);
    // Half an identity is not replaced.
    std::fs::remove_file(&cert).unwrap();
    let err = Identity::load_or_generate(&cert, &key, "node1").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    assert!(err.to_string().contains("exists but certificate"), "{err}");
    assert_eq!(std::fs::read(&key).unwrap(), key_bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_kept_on_disk_connect_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n);
    let a = Identity::load_or_generate(path("a.crt"), path("a.key"), "node1").unwrap();
    let b = Identity::load_or_generate(path("b.crt"), path("b.key"), "node2").unwrap();
    let (fa, fb) = (a.fingerprint(), b.fingerprint());
    drop((a, b));
    // "Restart": load again, pin what was printed before.
    let a = Identity::load_or_generate(path("a.crt"), path("a.key"), "node1").unwrap();
    let b = Identity::load_or_generate(path("b.crt"), path("b.key"), "node2").unwrap();
    let client = QuicTransport::new(QuicConfig::pinned(a, [fb])).unwrap();
    let server = QuicTransport::new(QuicConfig::pinned(b, [fa])).unwrap();
    let (a, mut b) = pair_with(&client, &server).await;
    within("send", a.send(Message::Ping { id: 3 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 3 }
    );
}

// ----- hostile or vanishing networks -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_datagrams_do_not_disturb_the_listener() {
    let (client, server) = pinned_transports(|_| {});
    let listener = listen(&server).await;
    let addr: SocketAddr = listener.local_addr().parse().unwrap();
    let noise = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut rng = SmallRng::seed_from_u64(3);
    for i in 0..2_000 {
        let len = rng.random_range(1..1500);
        let mut datagram: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        if i % 2 == 0 && len > 6 {
            // Looks like a QUIC v1 long-header packet (an Initial, say).
            datagram[0] = 0xc0 | (datagram[0] & 0x3f);
            datagram[1..5].copy_from_slice(&1u32.to_be_bytes());
            datagram[5] = 8;
        }
        noise.send_to(&datagram, addr).await.unwrap();
    }
    let (a, b) = attempt(&client, &*listener).await;
    let (a, mut b) = (a.unwrap(), b.unwrap());
    within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    // And garbage while a link is up does not hurt it either.
    for _ in 0..500 {
        let len = rng.random_range(1..1500);
        let datagram: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        noise.send_to(&datagram, addr).await.unwrap();
    }
    within("send", a.send(Message::Ping { id: 2 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 2 }
    );
}

/// A UDP relay between one client and `upstream`, which can stop forwarding in both
/// directions (the peer goes silent, as when it loses power or its cable).
struct Relay {
    addr: String,
    frozen: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Relay {
        let front = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let back = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = front.local_addr().unwrap().to_string();
        let frozen = Arc::new(AtomicBool::new(false));
        let stop = Arc::clone(&frozen);
        let task = tokio::spawn(async move {
            let (mut up, mut down) = (vec![0u8; 65536], vec![0u8; 65536]);
            let mut client = None;
            loop {
                tokio::select! {
                    r = front.recv_from(&mut up) => {
                        let Ok((n, from)) = r else { continue };
                        client = Some(from);
                        if !stop.load(Ordering::SeqCst) {
                            let _ = back.send_to(&up[..n], upstream).await;
                        }
                    }
                    r = back.recv_from(&mut down) => {
                        let Ok((n, _)) = r else { continue };
                        if let Some(c) = client
                            && !stop.load(Ordering::SeqCst)
                        {
                            let _ = front.send_to(&down[..n], c).await;
                        }
                    }
                }
            }
        });
        Relay { addr, frozen, task }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_noticed_within_the_idle_timeout_and_a_quiet_one_is_not() {
    let (client, server) = pinned_transports(|c| {
        c.idle_timeout = Duration::from_millis(1500);
        c.keep_alive_interval = Duration::from_millis(300);
    });
    let listener = listen(&server).await;
    let relay = Relay::start(listener.local_addr().parse().unwrap()).await;
    let (a, b) = within("connect through the relay", async {
        tokio::join!(client.connect(&relay.addr), listener.accept())
    })
    .await;
    let (mut a, mut b) = (a.unwrap(), b.unwrap());
    // Quiet for longer than the idle timeout: keep-alives keep the link up.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    // Silent: both sides notice within the idle timeout (and some slack).
    relay.frozen.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let (ea, eb) = within("notice", async { tokio::join!(a.recv(), b.recv()) }).await;
    let elapsed = started.elapsed();
    for err in [ea.unwrap_err(), eb.unwrap_err()] {
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    }
    assert!(
        elapsed < Duration::from_secs(5),
        "noticed after {elapsed:?}"
    );
    let late = within("send", a.send(Message::Ping { id: 2 }))
        .await
        .unwrap_err();
    assert_eq!(late.kind(), ErrorKind::Timeout, "{late}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_outlive_their_listener() {
    let (client, server) = pinned_transports(|_| {});
    let listener = listen(&server).await;
    let addr = listener.local_addr();
    let (a, b) = attempt(&client, &*listener).await;
    let (a, mut b) = (a.unwrap(), b.unwrap());
    drop(listener);
    within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    // No new links, though.
    let (client2, _) = pinned_transports(|c| c.connect_timeout = Duration::from_millis(500));
    assert!(within("connect", client2.connect(&addr)).await.is_err());
}

/// Links dropped in any order (closed or not), refused attempts and a dropped listener
/// leave no task running once their connections have drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_and_listeners_leave_no_tasks_behind() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let baseline = metrics.num_alive_tasks();
    {
        let (client, server) = pinned_transports(|_| {});
        let listener = listen(&server).await;
        for i in 0..12 {
            let (a, b) = attempt(&client, &*listener).await;
            let (a, mut b) = (a.unwrap(), b.unwrap());
            within("send", a.send(Message::Ping { id: i }))
                .await
                .unwrap();
            assert_eq!(
                within("recv", b.recv()).await.unwrap(),
                Message::Ping { id: i }
            );
            match i % 3 {
                0 => {
                    within("close", a.close()).await.unwrap();
                    drop((a, b));
                }
                1 => {
                    let (a_tx, a_rx) = a.into_split();
                    drop(a_rx);
                    drop(b);
                    drop(a_tx);
                }
                _ => {
                    let (b_tx, b_rx) = b.into_split();
                    drop(b_tx);
                    drop(a);
                    drop(b_rx);
                }
            }
        }
        let intruder = QuicTransport::new(QuicConfig::pinned(
            identity("intruder"),
            [identity("x").fingerprint()],
        ))
        .unwrap();
        let (x, y) = attempt(&intruder, &*listener).await;
        assert!(x.is_err() && y.is_err());
        drop(listener);
    }
    let deadline = Instant::now() + WAIT;
    loop {
        let alive = metrics.num_alive_tasks();
        if alive <= baseline {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{alive} tasks alive, {baseline} before the links"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ----- mirrored disks over QUIC -----

const MIB: u64 = 1 << 20;
const BS: u32 = 512;
const NAME: &str = "vol0";

fn mirror_config(node: u32, size: u64) -> Config {
    let mut cfg = Config::new(node, 3 - node, DiskId([0x5a; 16]), NAME, size, BS);
    cfg.ping_interval = Duration::from_millis(100);
    cfg.connect_timeout = Duration::from_secs(2);
    cfg
}

async fn start_disk(cfg: Config, local: Arc<dyn BlockDevice>) -> MirroredDisk {
    let replica = Replica::with_memory_meta(&cfg, local).await.unwrap();
    MirroredDisk::start(cfg, replica, None).unwrap()
}

fn in_sync(s: &MirrorStatus) -> bool {
    s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0 && !s.inconsistent
}

async fn wait_in_sync(disk: &MirroredDisk, what: &str) {
    let mut rx = disk.watch_status();
    let reached = timeout(WAIT, async {
        loop {
            if in_sync(&rx.borrow_and_update()) {
                return;
            }
            if rx.changed().await.is_err() {
                panic!("{what}: the mirror driver stopped");
            }
        }
    })
    .await;
    if reached.is_err() {
        panic!("{what}: not in sync within {WAIT:?}: {:?}", disk.status());
    }
}

async fn read(dev: &dyn BlockDevice, offset: u64, len: u64) -> Bytes {
    within("read", dev.read(offset, len as usize))
        .await
        .unwrap_or_else(|e| panic!("read {len}@{offset}: {e}"))
}

/// Two mirrored disks linked over QUIC (node 1 dials node 2, each pinning the other)
/// take writes of many sizes on both nodes at once; every write reads back through the
/// other node, and the two replicas end byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mirrored_disks_over_quic_keep_identical_replicas() {
    let size = 4 * MIB;
    let (i1, i2) = (identity("node1"), identity("node2"));
    let t1 =
        Arc::new(QuicTransport::new(QuicConfig::pinned(i1.clone(), [i2.fingerprint()])).unwrap());
    let t2 = QuicTransport::new(QuicConfig::pinned(i2, [i1.fingerprint()])).unwrap();
    let geometry = Geometry::new(size, BS).unwrap();
    let (m1, m2) = (
        Arc::new(MemDevice::new(geometry)),
        Arc::new(MemDevice::new(geometry)),
    );
    let d2 = start_disk(mirror_config(2, size), m2.clone()).await;
    let listener = listen(&t2).await;
    let addr = listener.local_addr();
    let disks = HashMap::from([(NAME.to_string(), d2.clone())]);
    let accepting = tokio::spawn(accept_loop(listener, disks));
    let d1 = start_disk(mirror_config(1, size), m1.clone()).await;
    let dialing = tokio::spawn(dial_loop(t1, addr, d1.clone()));
    wait_in_sync(&d1, "node 1").await;
    wait_in_sync(&d2, "node 2").await;

    // Each node writes its own half of the disk, at the same time.
    let writer = |disk: MirroredDisk, base: u64, seed: u64| async move {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut written = Vec::new();
        for i in 0..200u64 {
            let blocks = rng.random_range(1..=128u64);
            let len = blocks * u64::from(BS);
            let offset =
                base + rng.random_range(0..(size / 2 - len) / u64::from(BS)) * u64::from(BS);
            let data = sized(seed << 32 | i, len as usize);
            let flags = if i % 10 == 0 {
                IoFlags::FUA
            } else {
                IoFlags::empty()
            };
            within("write", disk.write(offset, data.clone(), flags))
                .await
                .unwrap_or_else(|e| panic!("write {len}@{offset}: {e}"));
            written.push((offset, data));
        }
        within("flush", disk.flush()).await.unwrap();
        written
    };
    let (w1, w2) = tokio::join!(writer(d1.clone(), 0, 1), writer(d2.clone(), size / 2, 2));
    // The last write to each place reads back through the other node.
    for (disk, written) in [(&d2, &w1), (&d1, &w2)] {
        let mut last = HashMap::new();
        for (offset, data) in written {
            last.insert(*offset, data.clone());
        }
        let mut rng = SmallRng::seed_from_u64(9);
        for _ in 0..20 {
            let i = rng.random_range(0..written.len());
            let (offset, data) = &written[i];
            // Later writes may overlap it; check only those that were not overlapped.
            let overlapped = written[i + 1..]
                .iter()
                .any(|(o, d)| *o < offset + data.len() as u64 && offset < &(o + d.len() as u64));
            if !overlapped {
                let got = read(disk, *offset, data.len() as u64).await;
                assert!(got == *data, "write at {offset} reads back differently");
            }
        }
    }
    let (img1, img2) = (read(&*m1, 0, size).await, read(&*m2, 0, size).await);
    if let Some(i) = img1.iter().zip(img2.iter()).position(|(x, y)| x != y) {
        panic!("replicas differ first at byte {i}");
    }
    assert!(img1.iter().any(|&b| b != 0), "nothing was written");
    for (who, d) in [("node 1", &d1), ("node 2", &d2)] {
        let s = d.status();
        assert_eq!(s.link, LinkState::Connected, "{who}: {s:?}");
        assert!(!s.diverged && s.last_problem.is_none(), "{who}: {s:?}");
    }
    dialing.abort();
    accepting.abort();
}

/// A send racing close is delivered or refused, never silently dropped; a peer with the
/// pinned certificate but not its key, without ALPN, or with an expired certificate from
/// the CA is refused, as client and as server (driven by a hand-made peer).
mod races_and_authentication {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::timeout;
    use vsan_core::ErrorKind;
    use vsan_replica::protocol::Message;
    use vsan_replica::transport::quic::{Identity, QuicConfig, QuicTransport};
    use vsan_replica::transport::{Link, Listener, Transport};

    const WAIT: Duration = Duration::from_secs(10);

    async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
        match timeout(WAIT, fut).await {
            Ok(v) => v,
            Err(_) => panic!("{what}: no result within {WAIT:?}"),
        }
    }

    fn pinned_transports() -> (QuicTransport, QuicTransport) {
        let (a, b) = (
            Identity::generate("node1").unwrap(),
            Identity::generate("node2").unwrap(),
        );
        (
            QuicTransport::new(QuicConfig::pinned(a.clone(), [b.fingerprint()])).unwrap(),
            QuicTransport::new(QuicConfig::pinned(b, [a.fingerprint()])).unwrap(),
        )
    }

    async fn pair_on(client: &QuicTransport, listener: &dyn Listener) -> (Link, Link) {
        let addr = listener.local_addr();
        let (a, b) = within("connect", async {
            tokio::join!(client.connect(&addr), listener.accept())
        })
        .await;
        (a.unwrap(), b.unwrap())
    }

    /// A `send` that races `close` on another task must either fail (`Closed`) or be
    /// delivered before the peer's `Closed`: `Ok` means "accepted and will be sent in order
    /// unless the link fails", and `close` returning `Ok` says the link did not fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn quic_a_send_racing_close_is_delivered_or_refused_never_silently_dropped() {
        let (client, server) = pinned_transports();
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        for trial in 0..300u64 {
            let (a, mut b) = pair_on(&client, &*listener).await;
            let a = Arc::new(a);
            let sender = tokio::spawn({
                let a = Arc::clone(&a);
                async move {
                    let mut accepted = Vec::new();
                    for id in 0u64.. {
                        match a.send(Message::Ping { id }).await {
                            Ok(()) => accepted.push(id),
                            Err(e) => {
                                assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                                break;
                            }
                        }
                        if id % 16 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                    accepted
                }
            });
            // Let the sender get going, then close under it.
            let spin = std::time::Instant::now();
            while spin.elapsed() < Duration::from_micros(50 + (trial * 37) % 400) {
                std::hint::spin_loop();
            }
            within("close", a.close()).await.unwrap();
            let accepted = within("sender", sender).await.unwrap();
            let mut got = Vec::new();
            loop {
                match within("recv", b.recv()).await {
                    Ok(Message::Ping { id }) => got.push(id),
                    Ok(other) => panic!("{other:?}"),
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                        break;
                    }
                }
            }
            assert_eq!(
                got.len(),
                accepted.len(),
                "trial {trial}: send returned Ok for {} messages but the peer got {} before \
             Closed (last accepted {:?}, last received {:?}); queue_depth after close: {:?}",
                accepted.len(),
                got.len(),
                accepted.last(),
                got.last(),
                a.queue_depth()
            );
            assert_eq!(got, accepted);
        }
    }

    // ----- QUIC authentication, driven by a hand-made peer -----

    mod raw {
        use std::net::SocketAddr;
        use std::sync::Arc;

        use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
        use rustls::client::danger::{
            HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
        };
        use rustls::pki_types::{
            CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime,
        };
        use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
        use rustls::sign::CertifiedKey;
        use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

        pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
            Arc::new(rustls::crypto::ring::default_provider())
        }

        /// A certified key that pairs `cert` with an unrelated private key (what someone
        /// who copied a pinned certificate, but not its key, can present).
        pub fn stolen_cert_own_key(cert: &[u8]) -> Arc<CertifiedKey> {
            let key = rcgen::KeyPair::generate().unwrap();
            let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
            let signer = provider().key_provider.load_private_key(der).unwrap();
            Arc::new(CertifiedKey::new(
                vec![CertificateDer::from(cert.to_vec())],
                signer,
            ))
        }

        /// Believes everything: the hand-made side checks nothing.
        #[derive(Debug)]
        pub struct Gullible;

        impl ServerCertVerifier for Gullible {
            fn verify_server_cert(
                &self,
                _: &CertificateDer<'_>,
                _: &[CertificateDer<'_>],
                _: &ServerName<'_>,
                _: &[u8],
                _: UnixTime,
            ) -> Result<ServerCertVerified, rustls::Error> {
                Ok(ServerCertVerified::assertion())
            }
            fn verify_tls12_signature(
                &self,
                _: &[u8],
                _: &CertificateDer<'_>,
                _: &DigitallySignedStruct,
            ) -> Result<HandshakeSignatureValid, rustls::Error> {
                Ok(HandshakeSignatureValid::assertion())
            }
            fn verify_tls13_signature(
                &self,
                _: &[u8],
                _: &CertificateDer<'_>,
                _: &DigitallySignedStruct,
            ) -> Result<HandshakeSignatureValid, rustls::Error> {
                Ok(HandshakeSignatureValid::assertion())
            }
            fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
                provider()
                    .signature_verification_algorithms
                    .supported_schemes()
            }
        }

        impl ClientCertVerifier for Gullible {
            fn offer_client_auth(&self) -> bool {
                true
            }
            fn root_hint_subjects(&self) -> &[DistinguishedName] {
                &[]
            }
            fn verify_client_cert(
                &self,
                _: &CertificateDer<'_>,
                _: &[CertificateDer<'_>],
                _: UnixTime,
            ) -> Result<ClientCertVerified, rustls::Error> {
                Ok(ClientCertVerified::assertion())
            }
            fn verify_tls12_signature(
                &self,
                _: &[u8],
                _: &CertificateDer<'_>,
                _: &DigitallySignedStruct,
            ) -> Result<HandshakeSignatureValid, rustls::Error> {
                Ok(HandshakeSignatureValid::assertion())
            }
            fn verify_tls13_signature(
                &self,
                _: &[u8],
                _: &CertificateDer<'_>,
                _: &DigitallySignedStruct,
            ) -> Result<HandshakeSignatureValid, rustls::Error> {
                Ok(HandshakeSignatureValid::assertion())
            }
            fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
                provider()
                    .signature_verification_algorithms
                    .supported_schemes()
            }
        }

        #[derive(Debug)]
        pub struct Fixed(pub Arc<CertifiedKey>);

        impl rustls::client::ResolvesClientCert for Fixed {
            fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
                Some(Arc::clone(&self.0))
            }
            fn has_certs(&self) -> bool {
                true
            }
        }

        impl rustls::server::ResolvesServerCert for Fixed {
            fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
                Some(Arc::clone(&self.0))
            }
        }

        /// A client presenting `key` (or nothing), offering `alpn`, that then does the link
        /// preamble; Ok when it got the acceptor's preamble back.
        pub async fn client(
            addr: &str,
            key: Option<Arc<CertifiedKey>>,
            alpn: Vec<Vec<u8>>,
        ) -> Result<(), String> {
            let builder = rustls::ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Gullible));
            let mut tls = match key {
                Some(k) => builder.with_client_cert_resolver(Arc::new(Fixed(k))),
                None => builder.with_no_client_auth(),
            };
            tls.alpn_protocols = alpn;
            let cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
            let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            let remote: SocketAddr = addr.parse().unwrap();
            let conn = endpoint
                .connect_with(cfg, remote, "vsan-peer")
                .unwrap()
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(b"vsanQ1d\n")
                .await
                .map_err(|e| e.to_string())?;
            let mut got = [0u8; 8];
            recv.read_exact(&mut got).await.map_err(|e| e.to_string())?;
            if &got == b"vsanQ1a\n" {
                Ok(())
            } else {
                Err(format!("preamble {got:?}"))
            }
        }

        /// A server presenting `key`, requiring any client certificate, with `alpn`;
        /// returns its address and the endpoint (keep it alive).
        pub fn server(key: Arc<CertifiedKey>, alpn: Vec<Vec<u8>>) -> (String, quinn::Endpoint) {
            let mut tls = rustls::ServerConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_client_cert_verifier(Arc::new(Gullible))
                .with_cert_resolver(Arc::new(Fixed(key)));
            tls.alpn_protocols = alpn;
            let cfg = quinn::ServerConfig::with_crypto(Arc::new(
                QuicServerConfig::try_from(tls).unwrap(),
            ));
            let endpoint = quinn::Endpoint::server(cfg, "127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = endpoint.local_addr().unwrap().to_string();
            let ep = endpoint.clone();
            tokio::spawn(async move {
                while let Some(incoming) = ep.accept().await {
                    tokio::spawn(async move {
                        let Ok(conn) = incoming.await else { return };
                        let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                            return;
                        };
                        let mut got = [0u8; 8];
                        if recv.read_exact(&mut got).await.is_ok() {
                            let _ = send.write_all(b"vsanQ1a\n").await;
                            conn.closed().await;
                        }
                    });
                }
            });
            (addr, endpoint)
        }

        pub fn certified(identity_cert: &[u8], key: &rcgen::KeyPair) -> Arc<CertifiedKey> {
            let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
            Arc::new(CertifiedKey::new(
                vec![CertificateDer::from(identity_cert.to_vec())],
                provider().key_provider.load_private_key(der).unwrap(),
            ))
        }
    }

    const ALPN: &[u8] = b"vsan-replica/1";

    /// A client that copied the pinned certificate but signs with another key is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_a_client_with_the_pinned_certificate_but_not_its_key_is_refused() {
        let (client, server) = pinned_transports();
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        let stolen = raw::stolen_cert_own_key(client.config().identity.certificate_der());
        let (raw, accepted) = within("handshake", async {
            tokio::join!(
                raw::client(&addr, Some(stolen), vec![ALPN.to_vec()]),
                listener.accept()
            )
        })
        .await;
        let err = accepted.unwrap_err();
        eprintln!("acceptor: {err}\nraw client: {raw:?}");
        assert_eq!(err.kind(), ErrorKind::Protocol);
        assert!(raw.is_err());
    }

    /// A client with the right certificate and key but no ALPN (or another) is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_a_client_without_alpn_is_refused() {
        // A client identity whose key the test holds, pinned by the server.
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["node1".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let fp = vsan_replica::transport::quic::Fingerprint::of_certificate(cert.der());
        let server = QuicTransport::new(QuicConfig::pinned(
            Identity::generate("node2").unwrap(),
            [fp],
        ))
        .unwrap();
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        for alpn in [vec![], vec![b"h3".to_vec()]] {
            let (raw, accepted) = within("handshake", async {
                tokio::join!(
                    raw::client(&addr, Some(raw::certified(cert.der(), &key)), alpn.clone()),
                    listener.accept()
                )
            })
            .await;
            let err = accepted.unwrap_err();
            eprintln!("alpn {alpn:?}: acceptor: {err}\nraw client: {raw:?}");
            assert_eq!(err.kind(), ErrorKind::Protocol);
            assert!(raw.is_err());
        }
        // The same certificate and key with the right ALPN get in (the control).
        let (raw, accepted) = within("handshake", async {
            tokio::join!(
                raw::client(
                    &addr,
                    Some(raw::certified(cert.der(), &key)),
                    vec![ALPN.to_vec()]
                ),
                listener.accept()
            )
        })
        .await;
        raw.unwrap();
        accepted.unwrap();
    }

    /// A server that copied the pinned certificate but not its key is refused by the
    /// dialer; one that selects no ALPN too.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_a_server_with_the_pinned_certificate_but_not_its_key_or_no_alpn_is_refused() {
        let (client, server) = pinned_transports();
        let stolen = raw::stolen_cert_own_key(server.config().identity.certificate_der());
        let (addr, _ep) = raw::server(stolen, vec![ALPN.to_vec()]);
        let err = within("connect", client.connect(&addr)).await.unwrap_err();
        eprintln!("stolen cert: {err}");
        assert_eq!(err.kind(), ErrorKind::Protocol);
        // Right cert and key, no ALPN selected.
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["node2".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let fp = vsan_replica::transport::quic::Fingerprint::of_certificate(cert.der());
        let client =
            QuicTransport::new(QuicConfig::pinned(client.config().identity.clone(), [fp])).unwrap();
        let (addr, _ep2) = raw::server(raw::certified(cert.der(), &key), vec![]);
        let err = within("connect", client.connect(&addr)).await.unwrap_err();
        eprintln!("no alpn: {err}");
        assert_eq!(err.kind(), ErrorKind::Protocol);
        let (addr, _ep3) = raw::server(raw::certified(cert.der(), &key), vec![ALPN.to_vec()]);
        within("connect", client.connect(&addr)).await.unwrap();
    }

    /// With a CA, an expired client or server certificate from that CA is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quic_expired_certificates_from_the_ca_are_refused_both_ways() {
        use vsan_replica::transport::quic::CaCertificates;
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "review CA");
        let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let leaf = |expired: bool| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut p = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
            if expired {
                p.not_before = rcgen::date_time_ymd(2001, 1, 1);
                p.not_after = rcgen::date_time_ymd(2002, 1, 1);
            }
            let cert = p.signed_by(&key, &issuer).unwrap();
            Identity::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes()).unwrap()
        };
        let ca = CaCertificates::from_pem(ca_pem.as_bytes()).unwrap();
        let t = |id| QuicTransport::new(QuicConfig::with_ca(id, ca.clone())).unwrap();
        for (client_expired, server_expired) in [(true, false), (false, true), (false, false)] {
            let server = t(leaf(server_expired));
            let client = t(leaf(client_expired));
            let listener = server.listen("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr();
            let (x, y) = within("handshake", async {
                tokio::join!(client.connect(&addr), listener.accept())
            })
            .await;
            if client_expired || server_expired {
                let (x, y) = (x.unwrap_err(), y.unwrap_err());
                eprintln!("client expired {client_expired}: dialer: {x}\nacceptor: {y}");
                assert_eq!(x.kind(), ErrorKind::Protocol);
                assert_eq!(y.kind(), ErrorKind::Protocol);
            } else {
                x.unwrap();
                y.unwrap();
            }
        }
    }
}
