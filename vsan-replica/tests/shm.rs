//! The shared-memory loopback transport: messages of every size arrive intact and in
//! order both ways (wrapping the ring, larger than the ring, with and without busy-poll),
//! close and peer loss behave as documented, hostile clients are refused while the
//! listener keeps working, it works across processes (the test binary re-runs itself as
//! the child), and two `MirroredDisk`s mirror over it. Every wait is bounded.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tempfile::TempDir;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout};
use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{
    Config, DiskId, Hello, LinkState, Message, PROTOCOL_VERSION, Status, WritePayload,
};
use vsan_replica::transport::loopback::shm::{ShmConfig, ShmTransport};
use vsan_replica::transport::{Link, LinkTx, Listener, QueueDepth, TcpTransport, Transport};
use vsan_replica::{MirrorStatus, MirroredDisk, Replica, wire};

/// Bound on any single wait in these tests.
const WAIT: Duration = Duration::from_secs(20);
/// Environment variable that turns `shm_child_echo` into the child process's role.
const CHILD_ADDR: &str = "VSAN_SHM_TEST_CHILD_ADDR";

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {WAIT:?}"),
    }
}

fn sock(dir: &TempDir, name: &str) -> String {
    dir.path().join(name).to_str().unwrap().to_string()
}

fn config(ring_size: usize, busy_poll: Option<Duration>) -> ShmConfig {
    let mut c = ShmConfig::default();
    c.ring_size = ring_size;
    c.busy_poll = busy_poll;
    c
}

/// A connected pair: (dialler, acceptor), and the listener (keep it to keep the path).
async fn pair_at(
    client: &ShmTransport,
    server: &ShmTransport,
    addr: &str,
) -> (Link, Link, Box<dyn Listener>) {
    let listener = within("listen", server.listen(addr)).await.unwrap();
    assert_eq!(listener.local_addr(), addr);
    let (a, b) = within("connect", async {
        tokio::join!(client.connect(addr), listener.accept())
    })
    .await;
    (a.unwrap(), b.unwrap(), listener)
}

async fn pair(cfg: ShmConfig) -> (Link, Link, TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let t = ShmTransport::with_config(cfg);
    let (a, b, _listener) = pair_at(&t, &t, &sock(&dir, "r.sock")).await;
    (a, b, dir)
}

/// `len` bytes whose every byte depends on `seed`.
fn pattern(seed: u64, len: usize) -> Bytes {
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

fn write(id: u64, len: usize) -> Message {
    Message::Write {
        id,
        offset: id * 512,
        payload: WritePayload::Data(pattern(id, len)),
        fua: id % 2 == 0,
    }
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
        write(1, 4096),
        Message::Write {
            id: 2,
            offset: 0,
            payload: WritePayload::Zeroes { len: 1 << 20 },
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
            data: pattern(5, 4096),
        },
        Message::Ping { id: 6 },
        Message::Pong { id: 6 },
    ]
}

/// Data sizes that straddle a small ring and the default one: tiny, odd, exactly the
/// ring, one more, several rings.
fn sizes(ring: usize) -> Vec<usize> {
    let mut v = vec![1, 7, 100, 511, 512, 4000, 4096, 4097, 65_536, 100_003];
    v.extend([ring - 21, ring - 20, ring, ring + 1, 3 * ring + 5]);
    v
}

/// Both sides send `msgs` to each other at once; each checks what it gets, in order.
async fn exchange(a: Link, b: Link, msgs: Vec<Message>) -> (Link, Link) {
    async fn run(link: Link, msgs: Vec<Message>) -> Link {
        let (tx, mut rx) = link.into_split();
        let expect = msgs.clone();
        let sender = tokio::spawn(async move {
            for m in msgs {
                tx.send(m).await.unwrap();
            }
            tx
        });
        for (i, want) in expect.iter().enumerate() {
            let got = within("recv", rx.recv()).await.unwrap();
            assert!(&got == want, "message {i} differs");
        }
        let tx = within("sender", sender).await.unwrap();
        Link::new(tx, rx)
    }
    let (a, b) = tokio::join!(
        tokio::spawn(run(a, msgs.clone())),
        tokio::spawn(run(b, msgs))
    );
    (a.unwrap(), b.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_kind_arrive_in_order_both_ways() {
    let (mut a, mut b, _dir) = pair(ShmConfig::default()).await;
    assert!(a.peer().starts_with("shm:"), "{}", a.peer());
    assert!(b.peer().starts_with("shm:"), "{}", b.peer());
    assert_eq!(a.transport(), "shm");
    assert_eq!(ShmTransport::new().name(), "shm");
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

async fn all_sizes_both_ways(ring: usize, busy_poll: Option<Duration>) {
    let (a, b, _dir) = pair(config(ring, busy_poll)).await;
    let mut msgs = Vec::new();
    let mut id = 0;
    for round in 0..3 {
        for len in sizes(ring) {
            id += 1;
            msgs.push(write(id, len));
            if round == 1 {
                msgs.push(Message::Ping { id });
            }
        }
    }
    let (a, b) = exchange(a, b, msgs).await;
    drained(&a).await;
    drained(&b).await;
}

/// Waits until `link` has nothing queued. (The writer task publishes bytes before it
/// updates its count, so the peer may hold the last message a moment before the count
/// drops.)
async fn drained(link: &Link) {
    within("queue drained", async {
        while link.queue_depth() != QueueDepth::default() {
            sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_sizes_both_ways_through_a_4k_ring() {
    all_sizes_both_ways(4096, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_sizes_both_ways_through_a_4k_ring_busy_polling() {
    all_sizes_both_ways(4096, Some(Duration::from_micros(50))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_sizes_both_ways_through_a_64k_ring() {
    all_sizes_both_ways(65_536, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_sizes_both_ways_through_the_default_ring_busy_polling() {
    all_sizes_both_ways(8 << 20, Some(Duration::from_micros(50))).await;
}

/// The largest write the codec allows (64 MiB) through an 8 MiB ring, both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn largest_write_passes_through_a_smaller_ring() {
    let (a, b, _dir) = pair(ShmConfig::default()).await;
    let msgs = vec![
        Message::Ping { id: 1 },
        write(2, wire::MAX_DATA_LEN),
        Message::Ping { id: 3 },
    ];
    exchange(a, b, msgs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_pipelined_4k_writes_arrive_intact() {
    const N: u64 = 10_000;
    let (a, b, _dir) = pair(ShmConfig::default()).await;
    let (tx, _a_rx) = a.into_split();
    let (_b_tx, mut rx) = b.into_split();
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        for id in 0..N {
            tx.send(write(id, 4096)).await.unwrap();
        }
        tx.close().await.unwrap();
        tx
    });
    for id in 0..N {
        let got = within("recv", rx.recv()).await.unwrap();
        assert!(got == write(id, 4096), "write {id} differs");
    }
    let end = within("recv after close", rx.recv()).await.unwrap_err();
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    let tx = within("sender", sender).await.unwrap();
    assert_eq!(tx.queue_depth(), QueueDepth::default());
    let secs = started.elapsed().as_secs_f64();
    println!(
        "shm: 10k x 4 KiB pipelined: {:.3} s, {:.0} MiB/s",
        secs,
        (N * 4096) as f64 / secs / (1 << 20) as f64,
    );
}

/// Batches from one task stay adjacent while other tasks send single messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_stay_adjacent_and_senders_keep_their_order() {
    const EACH: u64 = 2_000;
    let (a, b, _dir) = pair(config(4096, None)).await;
    let (tx, _a_rx) = a.into_split();
    let tx: Arc<dyn LinkTx> = Arc::from(tx);
    let (_b_tx, mut rx) = b.into_split();
    let batcher = {
        let tx = Arc::clone(&tx);
        tokio::spawn(async move {
            for n in 0..EACH {
                let id = 1 << 32 | n;
                tx.send_batch(vec![
                    Message::Ping { id },
                    write(id, 1000),
                    Message::Flush { id },
                ])
                .await
                .unwrap();
            }
        })
    };
    let single = {
        let tx = Arc::clone(&tx);
        tokio::spawn(async move {
            for n in 0..EACH {
                tx.send(Message::Pong { id: n }).await.unwrap();
            }
        })
    };
    let (mut next_batch, mut next_single) = (0u64, 0u64);
    while next_batch < EACH || next_single < EACH {
        match within("recv", rx.recv()).await.unwrap() {
            Message::Pong { id } => {
                assert_eq!(id, next_single);
                next_single += 1;
            }
            Message::Ping { id } => {
                assert_eq!(id, 1 << 32 | next_batch);
                let w = within("recv", rx.recv()).await.unwrap();
                assert!(w == write(id, 1000), "batch {next_batch}: not adjacent");
                let f = within("recv", rx.recv()).await.unwrap();
                assert_eq!(f, Message::Flush { id }, "batch {next_batch}: not adjacent");
                next_batch += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    within("batcher", batcher).await.unwrap();
    within("single", single).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_waits_while_ring_and_queue_are_full_and_queue_depth_shows_it() {
    const LIMIT: usize = 64 * 1024;
    let mut cfg = config(4096, None);
    cfg.send_queue_limit = LIMIT;
    let (a, b, _dir) = pair(cfg).await;
    let (_b_tx, mut rx) = b.into_split();
    // Nobody reads: the ring fills, then the queue, then a send waits.
    let mut id = 0;
    loop {
        id += 1;
        match timeout(Duration::from_millis(200), a.send(write(id, 4096))).await {
            Ok(r) => r.unwrap(),
            Err(_) => break,
        }
        assert!(id < 1000, "send never waited");
    }
    let depth = a.queue_depth();
    assert!(depth.bytes > LIMIT && depth.messages > 1, "{depth:?}");
    // The message whose send was dropped while waiting is still sent, in order.
    for want in 1..=id {
        let got = within("recv", rx.recv()).await.unwrap();
        assert!(got == write(want, 4096), "write {want} differs");
    }
    drained(&a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delivers_what_was_sent_then_ends_one_direction() {
    let (a, mut b, _dir) = pair(config(4096, None)).await;
    for id in 0..50 {
        within("send", a.send(write(id, 3000))).await.unwrap();
    }
    // More than the ring holds is queued: close waits until the peer has read enough.
    let a = Arc::new(a);
    let closing = {
        let a = Arc::clone(&a);
        tokio::spawn(async move { a.close().await })
    };
    for id in 0..50 {
        assert!(within("recv", b.recv()).await.unwrap() == write(id, 3000));
    }
    within("close", closing).await.unwrap().unwrap();
    within("close again", a.close()).await.unwrap();
    let late = within("send after close", a.send(Message::Ping { id: 3 }))
        .await
        .unwrap_err();
    assert_eq!(late.kind(), ErrorKind::Closed);
    let end = within("recv after close", b.recv()).await.unwrap_err();
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    let again = within("recv again", b.recv()).await.unwrap_err();
    assert_eq!(again.kind(), ErrorKind::Closed);
    // The other direction still works.
    let a = Arc::into_inner(a).unwrap();
    let (a_tx, mut a_rx) = a.into_split();
    within("send back", b.send(Message::Pong { id: 9 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv back", a_rx.recv()).await.unwrap(),
        Message::Pong { id: 9 }
    );
    drop(a_tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_times_out_when_the_peer_does_not_read() {
    let mut cfg = config(4096, None);
    cfg.close_timeout = Duration::from_millis(200);
    let (a, _b, _dir) = pair(cfg).await;
    for id in 0..10 {
        within("send", a.send(write(id, 4096))).await.unwrap();
    }
    let started = Instant::now();
    let err = within("close", a.close()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));
    let late = within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap_err();
    assert_ne!(late.kind(), ErrorKind::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_peer_ends_recv_and_send_with_closed() {
    for busy in [None, Some(Duration::from_micros(20))] {
        let (mut a, b, _dir) = pair(config(65536, busy)).await;
        within("send", b.send(Message::Ping { id: 1 }))
            .await
            .unwrap();
        drop(b);
        assert_eq!(
            within("recv", a.recv()).await.unwrap(),
            Message::Ping { id: 1 },
            "what was sent before the drop still arrives"
        );
        let err = within("recv", a.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
        let err = within("send", a.send(Message::Ping { id: 2 }))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_half_ends_that_direction() {
    let (a, b, _dir) = pair(config(4096, None)).await;
    let (a_tx, a_rx) = a.into_split();
    let (b_tx, mut b_rx) = b.into_split();
    within("send", a_tx.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    drop(a_tx);
    assert_eq!(
        within("recv", b_rx.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    let err = within("recv", b_rx.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    // a stops receiving: b's sends fail instead of filling a ring nobody reads.
    drop(a_rx);
    let err = within("send to a gone receiver", async {
        loop {
            if let Err(e) = b_tx.send(Message::Ping { id: 2 }).await {
                return e;
            }
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_where_nothing_listens_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let t = ShmTransport::new();
    let missing = sock(&dir, "missing.sock");
    let err = within("connect", t.connect(&missing)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains("nothing listens"), "{err}");

    // A socket file left behind by a listener that is gone.
    let stale = sock(&dir, "stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(Path::new(&stale).exists());
    let err = within("connect", t.connect(&stale)).await.unwrap_err();
    assert!(err.to_string().contains("nothing listens"), "{err}");
    // listen replaces it...
    let listener = within("listen", t.listen(&stale)).await.unwrap();
    // ...but not a live one, nor a file that is not a socket.
    let err = within("listen twice", t.listen(&stale)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InUse, "{err}");
    let plain = sock(&dir, "plain");
    std::fs::write(&plain, b"x").unwrap();
    let err = within("listen on a file", t.listen(&plain))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InUse, "{err}");
    // The probe of `listen twice` reached the listener; it reports that connection.
    let _ = timeout(Duration::from_secs(2), listener.accept()).await;
    // Dropping the listener removes its socket file.
    drop(listener);
    assert!(!Path::new(&stale).exists());

    let mut bad = ShmConfig::default();
    bad.ring_size = 5000;
    let err = within("connect", ShmTransport::with_config(bad).connect(&stale))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
}

/// A raw client that sends garbage, or says nothing, is refused; the listener keeps
/// accepting real links meanwhile and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_are_refused_and_the_listener_keeps_working() {
    let dir = tempfile::tempdir().unwrap();
    let addr = sock(&dir, "h.sock");
    let mut cfg = ShmConfig::default();
    cfg.handshake_timeout = Duration::from_millis(300);
    let t = ShmTransport::with_config(cfg);
    let listener = within("listen", t.listen(&addr)).await.unwrap();

    // Garbage instead of a hello.
    let mut raw = UnixStream::connect(&addr).await.unwrap();
    raw.write_all(&[0xa5; 64]).await.unwrap();
    let err = within("accept garbage", listener.accept())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    drop(raw);

    // A real hello's bytes but no memory handed over.
    let mut raw = UnixStream::connect(&addr).await.unwrap();
    let mut hello = b"vsan-shm".to_vec();
    hello.extend_from_slice(&1u32.to_ne_bytes());
    hello.extend_from_slice(&0u32.to_ne_bytes());
    raw.write_all(&hello).await.unwrap();
    let err = within("accept no fds", listener.accept())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    drop(raw);

    // Silence: the handshake times out, and a real link set up meanwhile works.
    let silent = UnixStream::connect(&addr).await.unwrap();
    let (good, accepted) = within("connect", async {
        tokio::join!(t.connect(&addr), listener.accept())
    })
    .await;
    let (mut good, accepted) = match accepted {
        Ok(link) => (good.unwrap(), link),
        Err(e) => {
            // The silent one's timeout came first; the good one is next.
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
            (
                good.unwrap(),
                within("accept", listener.accept()).await.unwrap(),
            )
        }
    };
    let mut accepted = accepted;
    within("send", good.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", accepted.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    within("send", accepted.send(Message::Pong { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", good.recv()).await.unwrap(),
        Message::Pong { id: 1 }
    );
    drop(silent);
}

// ----- across processes -----

/// The child's role (only when `CHILD_ADDR` is set): connect, echo every message back,
/// and close when the parent closes. A `Ping` with id `u64::MAX` makes it exit at once
/// without closing (a process that dies).
#[test]
fn shm_child_echo() {
    let Ok(addr) = std::env::var(CHILD_ADDR) else {
        return;
    };
    let busy = std::env::var("VSAN_SHM_TEST_CHILD_BUSY").is_ok();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let cfg = config(1 << 20, busy.then_some(Duration::from_micros(50)));
        let mut link = ShmTransport::with_config(cfg).connect(&addr).await.unwrap();
        loop {
            match link.recv().await {
                Ok(Message::Ping { id: u64::MAX }) => std::process::exit(0),
                Ok(msg) => link.send(msg).await.unwrap(),
                Err(e) if e.kind() == ErrorKind::Closed => {
                    link.close().await.unwrap();
                    return;
                }
                Err(e) => panic!("child: {e}"),
            }
        }
    });
}

fn spawn_child(addr: &str, busy: bool) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "shm_child_echo",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ADDR, addr)
    .stdout(Stdio::null());
    if busy {
        cmd.env("VSAN_SHM_TEST_CHILD_BUSY", "1");
    }
    cmd.spawn().unwrap()
}

async fn wait_child(child: &mut Child) -> std::process::ExitStatus {
    within("child exit", async {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// Echo through a child process of messages of all sizes (one larger than the child's
/// 1 MiB rings), then a graceful close both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_echoes_everything_then_closes() {
    for busy in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let addr = sock(&dir, "x.sock");
        let t = ShmTransport::new();
        let listener = within("listen", t.listen(&addr)).await.unwrap();
        let mut child = spawn_child(&addr, busy);
        let link = within("accept the child", listener.accept()).await.unwrap();
        assert!(link.peer().contains("pid"), "{}", link.peer());
        let (tx, mut rx) = link.into_split();
        let mut msgs = one_of_each();
        for (i, len) in sizes(1 << 20).into_iter().enumerate() {
            msgs.push(write(100 + i as u64, len));
        }
        msgs.push(write(999, 5 << 20));
        let expect = msgs.clone();
        let sender = tokio::spawn(async move {
            for m in msgs {
                tx.send(m).await.unwrap();
            }
            tx
        });
        for (i, want) in expect.iter().enumerate() {
            let got = within("echo", rx.recv()).await.unwrap();
            assert!(&got == want, "echo {i} differs");
        }
        let tx = within("sender", sender).await.unwrap();
        within("close", tx.close()).await.unwrap();
        let end = within("child's close", rx.recv()).await.unwrap_err();
        assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
        assert!(wait_child(&mut child).await.success());
    }
}

/// A child that dies (exits without closing, or is killed) ends the parent's link with
/// `Closed`, after what it had sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_process_that_dies_ends_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let addr = sock(&dir, "d.sock");
    let t = ShmTransport::new();
    let listener = within("listen", t.listen(&addr)).await.unwrap();

    // Exits on its own, right after echoing.
    let mut child = spawn_child(&addr, false);
    let mut link = within("accept", listener.accept()).await.unwrap();
    within("send", link.send(Message::Pong { id: 1 }))
        .await
        .unwrap();
    within("send", link.send(Message::Ping { id: u64::MAX }))
        .await
        .unwrap();
    assert_eq!(
        within("echo", link.recv()).await.unwrap(),
        Message::Pong { id: 1 }
    );
    let err = within("recv after exit", link.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    let err = within("send after exit", link.send(Message::Ping { id: 2 }))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    wait_child(&mut child).await;

    // Killed while the link is idle.
    let mut child = spawn_child(&addr, true);
    let mut link = within("accept", listener.accept()).await.unwrap();
    within("send", link.send(Message::Pong { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("echo", link.recv()).await.unwrap(),
        Message::Pong { id: 1 }
    );
    child.kill().unwrap();
    let err = within("recv after kill", link.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    wait_child(&mut child).await;
}

// ----- mirrored disks over shm -----

const MIB: u64 = 1 << 20;
const BS: u32 = 512;

async fn start_disk(node: u32, size: u64, local: Arc<dyn BlockDevice>) -> MirroredDisk {
    let mut cfg = Config::new(node, 3 - node, DiskId([0x5a; 16]), "vol0", size, BS);
    cfg.ping_interval = Duration::from_millis(100);
    cfg.connect_timeout = Duration::from_secs(2);
    let replica = Replica::with_memory_meta(&cfg, local).await.unwrap();
    MirroredDisk::start(cfg, replica, None).unwrap()
}

async fn wait_for(disk: &MirroredDisk, what: &str, pred: impl Fn(&MirrorStatus) -> bool) {
    let mut rx = disk.watch_status();
    within(what, async {
        loop {
            if pred(&rx.borrow_and_update()) {
                return;
            }
            rx.changed().await.unwrap();
        }
    })
    .await;
}

fn in_sync(s: &MirrorStatus) -> bool {
    s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0 && !s.inconsistent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mirrored_disks_over_shm_hold_identical_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let addr = sock(&dir, "mirror.sock");
    let size = 4 * MIB;
    let geometry = Geometry::new(size, BS).unwrap();
    let (m1, m2) = (
        Arc::new(MemDevice::new(geometry)),
        Arc::new(MemDevice::new(geometry)),
    );
    let d2 = start_disk(2, size, m2.clone()).await;
    let listener = within("listen", ShmTransport::new().listen(&addr))
        .await
        .unwrap();
    let disks = HashMap::from([("vol0".to_string(), d2.clone())]);
    let accepting: JoinHandle<()> = tokio::spawn(accept_loop(listener, disks));
    let d1 = start_disk(1, size, m1.clone()).await;
    let transport: Arc<dyn Transport> = Arc::new(ShmTransport::with_config(config(
        1 << 20,
        Some(Duration::from_micros(20)),
    )));
    let dialling = tokio::spawn(dial_loop(transport, addr.clone(), d1.clone()));
    wait_for(&d1, "node 1 in sync", in_sync).await;
    wait_for(&d2, "node 2 in sync", in_sync).await;

    // Concurrent writes of mixed sizes on both nodes, each node in its own half.
    let mut tasks = Vec::new();
    for (node, disk) in [(0u64, d1.clone()), (1, d2.clone())] {
        for t in 0..4u64 {
            let disk = disk.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = SmallRng::seed_from_u64(node * 10 + t);
                let half = size / 2;
                for _ in 0..200 {
                    let blocks = rng.random_range(1..=256u64);
                    let len = blocks * BS as u64;
                    let off =
                        node * half + rng.random_range(0..(half - len) / BS as u64) * BS as u64;
                    let mut data = vec![0u8; len as usize];
                    rng.fill(&mut data[..]);
                    let flags = if rng.random_bool(0.1) {
                        IoFlags::FUA
                    } else {
                        IoFlags::empty()
                    };
                    disk.write(off, Bytes::from(data), flags).await.unwrap();
                }
            }));
        }
    }
    for t in tasks {
        within("writer", t).await.unwrap();
    }
    within("flush", d1.flush()).await.unwrap();
    let r1 = within("read 1", m1.read(0, size as usize)).await.unwrap();
    let r2 = within("read 2", m2.read(0, size as usize)).await.unwrap();
    assert!(r1.iter().any(|&b| b != 0));
    if let Some(i) = r1.iter().zip(r2.iter()).position(|(a, b)| a != b) {
        panic!("replicas differ first at byte {i}");
    }
    for d in [&d1, &d2] {
        let s = d.status();
        assert_eq!(s.link, LinkState::Connected, "{s:?}");
        assert!(s.last_problem.is_none(), "{s:?}");
    }
    dialling.abort();
    accepting.abort();
}

// ----- latency -----

/// QD1 ping-pong round trips; returns (p50, p99).
async fn ping_pong(mut a: Link, b: Link, rounds: usize) -> (Duration, Duration) {
    let echo = tokio::spawn(async move {
        let mut b = b;
        while let Ok(msg) = b.recv().await {
            if b.send(msg).await.is_err() {
                break;
            }
        }
    });
    let mut times = Vec::with_capacity(rounds);
    for id in 0..(rounds + rounds / 10) as u64 {
        let started = Instant::now();
        a.send(Message::Ping { id }).await.unwrap();
        let got = within("pong", a.recv()).await.unwrap();
        assert_eq!(got, Message::Ping { id });
        if id as usize >= rounds / 10 {
            times.push(started.elapsed());
        }
    }
    a.close().await.unwrap();
    drop(a);
    let _ = timeout(Duration::from_secs(5), echo).await;
    times.sort();
    (times[times.len() / 2], times[times.len() * 99 / 100])
}

/// Prints QD1 round-trip latency over shm (sleeping, busy-polling) and TCP. Not asserted:
/// it is there to see that shm is far below TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qd1_latency_shm_versus_tcp() {
    const ROUNDS: usize = 20_000;
    let mut lines = Vec::new();
    for (what, busy) in [
        ("shm, sleeping", None),
        ("shm, busy-poll 100us", Some(Duration::from_micros(100))),
    ] {
        let (a, b, _dir) = pair(config(1 << 20, busy)).await;
        let (p50, p99) = ping_pong(a, b, ROUNDS).await;
        lines.push(format!("{what:>22}: p50 {p50:>9.1?}  p99 {p99:>9.1?}"));
    }
    let tcp = TcpTransport::new();
    let listener = tcp.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let (a, b) = tokio::join!(tcp.connect(&addr), listener.accept());
    let (p50, p99) = ping_pong(a.unwrap(), b.unwrap(), ROUNDS).await;
    lines.push(format!("{:>22}: p50 {p50:>9.1?}  p99 {p99:>9.1?}", "tcp"));
    for l in lines {
        println!("QD1 round trip, {l}");
    }
}

/// A send racing close on shm, as on QUIC.
mod send_racing_close {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::timeout;
    use vsan_core::ErrorKind;
    use vsan_replica::protocol::Message;
    use vsan_replica::transport::Transport;

    const WAIT: Duration = Duration::from_secs(10);

    async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
        match timeout(WAIT, fut).await {
            Ok(v) => v,
            Err(_) => panic!("{what}: no result within {WAIT:?}"),
        }
    }

    /// A `send` that races `close` on another task is delivered or refused, never
    /// silently dropped, as on QUIC (`enqueue_many` checks `closing` and queues under one
    /// lock).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn shm_a_send_racing_close_is_delivered_or_refused_never_silently_dropped() {
        use vsan_replica::transport::loopback::shm::ShmTransport;
        let dir = tempfile::tempdir().unwrap();
        let addr = dir.path().join("race.sock").to_str().unwrap().to_string();
        let t = ShmTransport::new();
        let listener = t.listen(&addr).await.unwrap();
        for trial in 0..300u64 {
            let (a, b) = within("connect", async {
                tokio::join!(t.connect(&addr), listener.accept())
            })
            .await;
            let (a, mut b) = (Arc::new(a.unwrap()), b.unwrap());
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
            assert_eq!(got, accepted, "trial {trial}");
        }
    }
}
