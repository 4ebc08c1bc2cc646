//! The TCP transport on loopback: messages arrive intact and in order, hostile or
//! vanishing peers give errors (never hangs or panics), close and authentication
//! behave as documented. Every wait is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::timeout;
use vsan_core::ErrorKind;
use vsan_replica::protocol::{DiskId, Hello, Message, PROTOCOL_VERSION, Status, WritePayload};
use vsan_replica::transport::{
    Link, LinkTx, Listener, QueueDepth, SharedSecret, TcpConfig, TcpTransport, Transport,
};
use vsan_replica::wire;

/// Bound on any single wait in these tests.
const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {WAIT:?}"),
    }
}

async fn listen(transport: &TcpTransport) -> Box<dyn Listener> {
    within("listen", transport.listen("127.0.0.1:0"))
        .await
        .unwrap()
}

/// A connected pair: (dialler, acceptor).
async fn pair_with(client: &TcpTransport, server: &TcpTransport) -> (Link, Link) {
    let listener = listen(server).await;
    let addr = listener.local_addr();
    let (a, b) = within("connect", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    (a.unwrap(), b.unwrap())
}

async fn pair() -> (Link, Link) {
    let t = TcpTransport::new();
    pair_with(&t, &t).await
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
            generations: vsan_replica::protocol::Generations {
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

/// 4 KiB whose every byte depends on `seed`.
fn block(seed: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(4096);
    for i in 0..512u64 {
        b.put_u64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i);
    }
    b.freeze()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_kind_arrive_in_order_both_ways() {
    let (mut a, mut b) = pair().await;
    assert!(a.peer().starts_with("tcp:127.0.0.1:"), "{}", a.peer());
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
        "10k x 4 KiB pipelined: {:.3} s, {:.0} MiB/s, {:.0} writes/s",
        secs,
        (N * 4096) as f64 / secs / (1 << 20) as f64,
        N as f64 / secs
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_senders_keep_each_senders_order() {
    const TASKS: u64 = 4;
    const EACH: u64 = 2_000;
    let (a, b) = pair().await;
    let (tx, _a_rx) = a.into_split();
    let tx: Arc<dyn LinkTx> = Arc::from(tx);
    let (_b_tx, mut rx) = b.into_split();
    let mut senders = Vec::new();
    for task in 0..TASKS {
        let tx = Arc::clone(&tx);
        senders.push(tokio::spawn(async move {
            for n in 0..EACH {
                let id = task << 32 | n;
                let msg = if n % 3 == 0 {
                    Message::Write {
                        id,
                        offset: n * 4096,
                        payload: WritePayload::Data(block(id)),
                        fua: false,
                    }
                } else {
                    Message::Ping { id }
                };
                tx.send(msg).await.unwrap();
            }
        }));
    }
    let mut next = [0u64; TASKS as usize];
    for _ in 0..TASKS * EACH {
        let msg = within("recv", rx.recv()).await.unwrap();
        let id = match &msg {
            Message::Ping { id } => *id,
            Message::Write {
                id,
                payload: WritePayload::Data(data),
                ..
            } => {
                assert!(*data == block(*id));
                *id
            }
            other => panic!("{other:?}"),
        };
        let (task, n) = ((id >> 32) as usize, id & 0xffff_ffff);
        assert_eq!(n, next[task], "task {task} out of order");
        next[task] += 1;
    }
    for s in senders {
        within("sender", s).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_depth_counts_what_the_socket_has_not_taken() {
    let mut config = TcpConfig::default();
    config.send_queue_limit = usize::MAX;
    let t = TcpTransport::with_config(config);
    let (a, mut b) = pair_with(&t, &t).await;
    assert_eq!(a.queue_depth(), QueueDepth::default());
    // The peer does not read: the socket buffers fill, then the queue grows. 64 MiB is
    // more than loopback socket buffers hold (at most 4 MiB sending + 32 MiB receiving
    // with Linux defaults).
    const N: u64 = 16_000;
    for id in 0..N {
        let msg = Message::Write {
            id,
            offset: 0,
            payload: WritePayload::Data(block(id)),
            fua: false,
        };
        within("send", a.send(msg)).await.unwrap();
    }
    let depth = a.queue_depth();
    assert!(
        depth.messages > 0 && depth.bytes > depth.messages * 4096,
        "{depth:?}"
    );
    assert!(depth.messages as u64 <= N);
    for id in 0..N {
        let Message::Write { id: got, .. } = within("recv", b.recv()).await.unwrap() else {
            panic!("not a write");
        };
        assert_eq!(got, id);
    }
    within("close", a.close()).await.unwrap();
    assert_eq!(a.queue_depth(), QueueDepth::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_waits_while_the_queue_is_over_its_limit() {
    const LIMIT: usize = 64 * 1024;
    let mut config = TcpConfig::default();
    config.send_queue_limit = LIMIT;
    let t = TcpTransport::with_config(config);
    let (a, b) = pair_with(&t, &t).await;
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
    // The link stays ended.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_peer_ends_the_link_for_both_halves() {
    let (a, mut b) = pair().await;
    within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    drop(a);
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    assert_eq!(
        within("recv", b.recv()).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    // Sends fail once the kernel learns the peer is gone: the first send after the
    // peer's socket closed draws a reset, the next fails. No event says when the reset
    // has come back, so poll, bounded.
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
async fn invalid_messages_are_refused_and_the_link_lives_on() {
    let (a, mut b) = pair().await;
    let bad = Message::Write {
        id: 1,
        offset: 0,
        payload: WritePayload::Data(Bytes::new()),
        fua: false,
    };
    let err = within("send", a.send(bad)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    within("send", a.send(Message::Ping { id: 2 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 2 }
    );
}

/// A listener link whose peer is a raw socket the test controls.
async fn raw_peer() -> (TcpStream, Link) {
    let t = TcpTransport::new();
    let listener = listen(&t).await;
    let addr = listener.local_addr();
    let (raw, link) = within("connect", async {
        tokio::join!(TcpStream::connect(&addr), listener.accept())
    })
    .await;
    (raw.unwrap(), link.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_garbage_from_the_peer_is_a_protocol_error() {
    let mut rng = SmallRng::seed_from_u64(1);
    for _ in 0..20 {
        let (mut raw, mut link) = raw_peer().await;
        let garbage: Vec<u8> = (0..rng.random_range(20..4096))
            .map(|_| rng.random())
            .collect();
        raw.write_all(&garbage).await.unwrap();
        let err = within("recv", link.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        // Never trusted again, and the send half fails too.
        assert_eq!(
            within("recv", link.recv()).await.unwrap_err().kind(),
            ErrorKind::Protocol
        );
        let mut sent = Ok(());
        for id in 0..100 {
            sent = within("send", link.send(Message::Ping { id })).await;
            if sent.is_err() {
                break;
            }
        }
        assert!(sent.is_err(), "the link still sends after a protocol error");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_with_a_bad_crc_is_a_protocol_error() {
    let (mut raw, mut link) = raw_peer().await;
    let mut good = BytesMut::new();
    wire::encode_into(&Message::Ping { id: 1 }, &mut good).unwrap();
    let mut bad = BytesMut::new();
    wire::encode_into(
        &Message::Write {
            id: 2,
            offset: 0,
            payload: WritePayload::Data(block(2)),
            fua: false,
        },
        &mut bad,
    )
    .unwrap();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    raw.write_all(&good).await.unwrap();
    raw.write_all(&bad).await.unwrap();
    assert_eq!(
        within("recv", link.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    let err = within("recv", link.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol);
    assert!(err.to_string().contains("crc mismatch"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_vanishes_mid_frame_is_an_error_not_a_hang() {
    let mut whole = BytesMut::new();
    wire::encode_into(
        &Message::ReadReply {
            id: 1,
            status: Status::Ok,
            data: block(1),
        },
        &mut whole,
    )
    .unwrap();
    for cut in [
        1,
        10,
        wire::HEADER_LEN,
        wire::HEADER_LEN + 3,
        whole.len() - 1,
    ] {
        let (mut raw, mut link) = raw_peer().await;
        raw.write_all(&whole[..cut]).await.unwrap();
        drop(raw);
        let err = within("recv", link.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Closed, "cut at {cut}: {err}");
        assert!(err.to_string().contains("middle of a frame"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_is_cancel_safe() {
    let (mut raw, mut link) = raw_peer().await;
    let msgs: Vec<Message> = one_of_each();
    let mut stream = BytesMut::new();
    for m in &msgs {
        wire::encode_into(m, &mut stream).unwrap();
    }
    let writer = tokio::spawn(async move {
        // Dribble the bytes so frames arrive in pieces across cancelled recvs.
        for chunk in stream.chunks(97) {
            raw.write_all(chunk).await.unwrap();
            raw.flush().await.unwrap();
            tokio::task::yield_now().await;
        }
        raw
    });
    let mut got = Vec::new();
    let deadline = Instant::now() + WAIT;
    while got.len() < msgs.len() {
        assert!(Instant::now() < deadline, "messages did not arrive");
        if let Ok(msg) = timeout(Duration::from_micros(50), link.recv()).await {
            got.push(msg.unwrap());
        }
    }
    assert_eq!(got, msgs);
    within("writer", writer).await.unwrap();
}

fn with_secret(secret: &[u8]) -> TcpTransport {
    with_secret_and_timeout(secret, Duration::from_secs(5))
}

fn with_secret_and_timeout(secret: &[u8], handshake_timeout: Duration) -> TcpTransport {
    let mut config = TcpConfig::default();
    config.secret = Some(SharedSecret::new(secret).unwrap());
    config.handshake_timeout = handshake_timeout;
    TcpTransport::with_config(config)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_with_the_same_secret_connect() {
    let t = with_secret(b"correct horse battery staple");
    let (mut a, mut b) = pair_with(&t, &t).await;
    // The first message may ride right behind the handshake.
    for msg in one_of_each() {
        within("send", a.send(msg.clone())).await.unwrap();
        assert_eq!(within("recv", b.recv()).await.unwrap(), msg);
        within("send", b.send(msg.clone())).await.unwrap();
        assert_eq!(within("recv", a.recv()).await.unwrap(), msg);
    }
}

async fn refused_on_both_sides(
    client: &TcpTransport,
    server: &TcpTransport,
) -> (vsan_core::Error, vsan_core::Error) {
    let listener = listen(server).await;
    let addr = listener.local_addr();
    let (a, b) = within("handshake", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    let (Err(a), Err(b)) = (a, b) else {
        panic!("a link opened despite the secrets");
    };
    // The listener keeps accepting after a refused peer.
    let again = with_secret(b"x");
    let (c, d) = within("second handshake", async {
        tokio::join!(again.connect(&addr), listener.accept())
    })
    .await;
    assert!(c.is_err() || d.is_err());
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_refused_on_both_sides() {
    let (client, server) = refused_on_both_sides(&with_secret(b"one"), &with_secret(b"two")).await;
    for err in [&client, &server] {
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains("authentication failed"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_on_one_side_only_is_refused_on_both_sides() {
    // The side without a secret sees the other's challenge as a bad first frame when it
    // reads; make it read by having it send a Hello first, as the protocol does.
    let plain = TcpTransport::new();
    let secret = with_secret(b"s3cret");
    let listener = listen(&secret).await;
    let addr = listener.local_addr();
    let (plain_side, secret_side) = within("handshake", async {
        tokio::join!(
            async {
                let mut link = plain.connect(&addr).await?;
                link.send(one_of_each().remove(0)).await?;
                link.recv().await
            },
            listener.accept()
        )
    })
    .await;
    let plain_err = plain_side.unwrap_err();
    let secret_err = secret_side.unwrap_err();
    assert!(
        matches!(plain_err.kind(), ErrorKind::Protocol | ErrorKind::Closed),
        "{plain_err}"
    );
    assert_eq!(secret_err.kind(), ErrorKind::Protocol, "{secret_err}");
    assert!(
        secret_err.to_string().contains("without authenticating"),
        "{secret_err}"
    );

    let listener = listen(&plain).await;
    let addr = listener.local_addr();
    let (secret_side, plain_side) = within("handshake", async {
        tokio::join!(secret.connect(&addr), async {
            let mut link = listener.accept().await?;
            link.send(one_of_each().remove(0)).await?;
            link.recv().await
        })
    })
    .await;
    assert_eq!(secret_side.unwrap_err().kind(), ErrorKind::Protocol);
    assert!(plain_side.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_times_out_the_handshake() {
    let t = with_secret_and_timeout(b"s3cret", Duration::from_millis(200));
    let listener = listen(&t).await;
    let addr = listener.local_addr();
    let _silent = TcpStream::connect(&addr).await.unwrap();
    let err = within("accept", listener.accept()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
}

#[tokio::test]
async fn connecting_to_nothing_fails() {
    // Bind then drop, so the port is (almost surely) closed.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = within(
        "connect",
        TcpTransport::new().connect(&format!("127.0.0.1:{port}")),
    )
    .await
    .unwrap_err();
    assert_ne!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(SharedSecret::new(b"").is_err());
    assert!(!format!("{:?}", SharedSecret::new(b"hunter2").unwrap()).contains("hunter2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_gives_up_on_a_peer_that_stopped_reading() {
    let mut config = TcpConfig::default();
    config.send_queue_limit = usize::MAX;
    config.close_timeout = Duration::from_millis(200);
    let t = TcpTransport::with_config(config);
    let (a, _b) = pair_with(&t, &t).await;
    // Far more than the socket buffers hold; `_b` never reads.
    for id in 0..16_000 {
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
    let late = within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap_err();
    assert_eq!(late.kind(), ErrorKind::Timeout, "{late}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_arrive_in_order_and_interleave_correctly_with_single_sends() {
    // Batches of varied sizes (1..200 messages, up to 800 KiB: more than one vectored
    // write, and more than a socket buffer) mixed with single sends, in one order.
    const BATCHES: u64 = 60;
    let (a, b) = pair().await;
    let (tx, _a_rx) = a.into_split();
    let (_b_tx, mut rx) = b.into_split();
    let sender = tokio::spawn(async move {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut id = 0u64;
        for _ in 0..BATCHES {
            let n = rng.random_range(1..200u64);
            let batch: Vec<Message> = (id..id + n)
                .map(|i| Message::Write {
                    id: i,
                    offset: i * 4096,
                    payload: WritePayload::Data(block(i)),
                    fua: false,
                })
                .collect();
            id += n;
            tx.send_batch(batch).await.unwrap();
            tx.send(Message::Ping { id }).await.unwrap();
            id += 1;
        }
        tx.close().await.unwrap();
        id
    });
    let mut expect = 0u64;
    loop {
        match within("recv", rx.recv()).await {
            Ok(Message::Write {
                id,
                offset,
                payload: WritePayload::Data(data),
                ..
            }) => {
                assert_eq!((id, offset), (expect, expect * 4096));
                assert!(data == block(id), "write {id}: data differs");
            }
            Ok(Message::Ping { id }) => assert_eq!(id, expect),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                break;
            }
        }
        expect += 1;
    }
    let sent = within("sender", sender).await.unwrap();
    assert_eq!(expect, sent, "every message arrived exactly once");
}
