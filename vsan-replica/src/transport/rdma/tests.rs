//! The protocol core and the link driver over the fake verbs pair.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use vsan_core::{Error, ErrorKind, Result};

use super::engine::{CHUNK_HEADER_LEN, ChunkHeader, Engine, PeerParams};
use super::fake::{self, FakeNet, FakeVerbs, Pool};
use super::link::{self, LinkParams};
use super::{RdmaConfig, RdmaTransport};
use crate::transport::auth::Role;
use crate::transport::{Link, SharedSecret};
use crate::wire;
use crate::wire::{Message, WritePayload};

// ----- helpers -----

fn pool(recv_bufs: usize, send_bufs: usize, buf_len: usize) -> Pool {
    Pool {
        send_bufs,
        recv_bufs,
        buf_len,
    }
}

fn params_of(p: Pool) -> PeerParams {
    PeerParams {
        credits: p.recv_bufs as u32,
        buf_len: p.buf_len,
    }
}

/// Two engines over a fake connection (side 0 and side 1).
fn engines(a: Pool, b: Pool, immediate: bool) -> ([Engine<FakeVerbs>; 2], FakeNet) {
    let (va, vb, net) = fake::pair(a, b, immediate);
    let ea = Engine::new(va, params_of(b), "fake:1".into()).unwrap();
    let eb = Engine::new(vb, params_of(a), "fake:0".into()).unwrap();
    ([ea, eb], net)
}

/// A message of about `size` bytes (a ping for 0), its contents from `rng`.
fn message(id: u64, size: usize, rng: &mut SmallRng) -> Message {
    if size == 0 {
        return Message::Ping { id };
    }
    let mut data = vec![0u8; size];
    rng.fill_bytes(&mut data);
    Message::Write {
        id,
        offset: id * 4096,
        payload: WritePayload::Data(Bytes::from(data)),
        fua: id % 2 == 0,
    }
}

fn messages(sizes: &[usize], rng: &mut SmallRng) -> VecDeque<Message> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| message(i as u64, s, rng))
        .collect()
}

/// Takes every whole message side `s` has, checking each against what it expects.
fn take_all(eng: &mut Engine<FakeVerbs>, expect: &mut VecDeque<Message>) -> Result<usize> {
    let mut n = 0;
    while let Some(m) = eng.take_message()? {
        let want = expect
            .pop_front()
            .ok_or_else(|| broken(format!("an extra message arrived: {m:?}")))?;
        if m != want {
            return Err(broken(format!(
                "out of order or corrupt: got {m:?}, want {want:?}"
            )));
        }
        n += 1;
    }
    Ok(n)
}

fn check_net(net: &FakeNet, eng: &[Engine<FakeVerbs>; 2], pools: [Pool; 2]) -> Result<()> {
    let n = net.lock();
    if let Some(v) = n.violations.first() {
        return Err(broken(v.clone()));
    }
    for s in 0..2 {
        let peer_bufs = pools[1 - s].recv_bufs as u32;
        if eng[s].credits() > peer_bufs {
            return Err(broken(format!(
                "side {s} holds {} credits for {peer_bufs} buffers",
                eng[s].credits()
            )));
        }
    }
    Ok(())
}

/// Runs a random interleaving of sends, deliveries, completions, pumps and reads, then
/// drains; every message must arrive in order with no credit overrun and no deadlock.
fn random_run(
    seed: u64,
    pools: [Pool; 2],
    sizes: [&[usize]; 2],
    read_chance: f64,
    steps: usize,
) -> Result<()> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (mut eng, net) = engines(pools[0], pools[1], false);
    let mut to_send = [messages(sizes[0], &mut rng), messages(sizes[1], &mut rng)];
    // Side s expects what the other side sends.
    let mut expect = [to_send[1].clone(), to_send[0].clone()];

    for _ in 0..steps {
        let action = rng.random_range(0..10u32);
        let s = (action & 1) as usize;
        match action / 2 {
            0 => {
                // Sometimes a burst, as a driver answering many requests at once.
                let burst = rng.random_range(1..4);
                for _ in 0..burst {
                    if let Some(m) = to_send[s].pop_front() {
                        eng[s].queue_frame(wire::encode(&m).unwrap());
                    }
                }
                eng[s].flush()?;
            }
            1 => {
                net.lock().deliver(s);
            }
            2 => {
                let pick = rng.random_range(0..64);
                net.lock().complete_send(s, pick);
            }
            3 => eng[s].pump()?,
            _ => {
                if rng.random_bool(read_chance) {
                    take_all(&mut eng[s], &mut expect[s])?;
                }
            }
        }
        check_net(&net, &eng, pools)?;
    }

    // Drain: everything goes out, nothing is held back; progress must reach the end.
    for round in 0.. {
        for s in 0..2 {
            while let Some(m) = to_send[s].pop_front() {
                eng[s].queue_frame(wire::encode(&m).unwrap());
            }
            eng[s].flush()?;
        }
        let mut moved = false;
        for s in 0..2 {
            while net.lock().deliver(s) {
                moved = true;
            }
            while net.lock().complete_send(s, 0) {
                moved = true;
            }
        }
        for s in 0..2 {
            eng[s].pump()?;
            moved |= take_all(&mut eng[s], &mut expect[s])? > 0;
        }
        check_net(&net, &eng, pools)?;
        let queued = eng[0].queue_depth().bytes + eng[1].queue_depth().bytes;
        let in_flight = {
            let n = net.lock();
            n.in_flight(0) + n.in_flight(1) + n.pending_sends(0) + n.pending_sends(1)
        };
        if !moved && in_flight == 0 {
            if queued > 0 || !expect[0].is_empty() || !expect[1].is_empty() {
                return Err(broken(format!(
                    "deadlock after {round} drain rounds: {queued} bytes queued, \
                     {}/{} messages missing, credits {}/{}",
                    expect[0].len(),
                    expect[1].len(),
                    eng[0].credits(),
                    eng[1].credits()
                )));
            }
            break;
        }
        if round > 1_000_000 {
            return Err(broken("no quiescence"));
        }
    }

    // Every credit is accounted for: held by the sender or owed by the receiver.
    for s in 0..2 {
        let peer = 1 - s;
        let total = eng[s].credits() + eng[peer].owed();
        if total != pools[peer].recv_bufs as u32 {
            return Err(broken(format!(
                "credits leaked: side {s} holds {}, side {peer} owes {}, buffers {}",
                eng[s].credits(),
                eng[peer].owed(),
                pools[peer].recv_bufs
            )));
        }
        if net.lock().posted(peer) != pools[peer].recv_bufs {
            return Err(broken(format!(
                "side {peer} did not re-post every receive buffer"
            )));
        }
    }
    Ok(())
}

/// A run's check failed: the two engines broke the protocol they share.
fn broken(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, why)
}

// ----- the state machine -----

#[test]
fn small_and_large_messages_arrive_in_order_both_ways() {
    let sizes: Vec<usize> = (0..60).map(|i| (i * 997) % 9000).collect();
    let pools = [pool(4, 2, 128), pool(6, 3, 200)];
    random_run(1, pools, [&sizes, &sizes], 0.7, 5_000).unwrap();
}

#[test]
fn both_sides_at_full_pressure_with_the_fewest_credits_do_not_deadlock() {
    let sizes = vec![3000usize; 200];
    for seed in 0..20 {
        let pools = [pool(4, 1, 64), pool(4, 1, 64)];
        random_run(seed, pools, [&sizes, &sizes], 1.0, 20_000)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
}

#[test]
fn a_one_way_stream_gets_credits_back_by_credit_chunks() {
    let sizes = vec![1000usize; 300];
    let pools = [pool(8, 4, 256), pool(8, 4, 256)];
    random_run(7, pools, [&sizes, &[]], 0.5, 30_000).unwrap();
}

#[test]
fn a_slow_reader_holds_the_sender_back_within_its_buffers() {
    // Side 1 never reads during the random phase: side 0 can post at most as many
    // chunks as side 1 has buffers, and the fake flags any more.
    let sizes = vec![500usize; 100];
    let pools = [pool(4, 4, 128), pool(5, 4, 128)];
    random_run(3, pools, [&sizes, &[]], 0.0, 10_000).unwrap();
}

#[test]
fn an_idle_link_sends_nothing() {
    let (mut eng, net) = engines(pool(4, 2, 128), pool(4, 2, 128), false);
    for _ in 0..10 {
        for e in &mut eng {
            e.pump().unwrap();
            assert!(e.take_message().unwrap().is_none());
        }
    }
    let n = net.lock();
    assert_eq!((n.in_flight(0), n.in_flight(1)), (0, 0));
}

#[test]
fn credit_chunks_do_not_ping_pong() {
    // One message each way, then idle: a bounded number of SENDs, not an endless
    // exchange of credit updates.
    let (mut eng, net) = engines(pool(4, 4, 4096), pool(4, 4, 4096), true);
    let mut rng = SmallRng::seed_from_u64(5);
    for e in &mut eng {
        e.queue_frame(wire::encode(&message(1, 100, &mut rng)).unwrap());
        e.flush().unwrap();
    }
    for _ in 0..100 {
        for e in &mut eng {
            e.pump().unwrap();
            while e.take_message().unwrap().is_some() {}
        }
    }
    let delivered = net.lock().delivered;
    assert!(delivered[0] + delivered[1] <= 6, "{delivered:?}");
}

#[test]
fn close_ends_the_stream_after_the_last_message_and_credits_still_flow() {
    let (mut eng, net) = engines(pool(4, 2, 128), pool(4, 2, 128), true);
    let mut rng = SmallRng::seed_from_u64(9);
    let sent: Vec<Message> = (0..5).map(|i| message(i, 300, &mut rng)).collect();
    for m in &sent {
        eng[0].queue_frame(wire::encode(m).unwrap());
    }
    eng[0].request_close();
    let mut got = Vec::new();
    let end = loop {
        eng[0].pump().unwrap();
        eng[1].pump().unwrap();
        match eng[1].take_message() {
            Ok(Some(m)) => got.push(m),
            Ok(None) => {}
            Err(e) => break e,
        }
    };
    assert_eq!(got, sent);
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    assert!(end.to_string().contains("peer closed the link"), "{end}");
    // Side 0 closed its sending side only: it still receives, and returns credits.
    assert_eq!(
        eng[0].check_tx().unwrap_err().kind(),
        ErrorKind::Closed,
        "no sends after close"
    );
    let back: Vec<Message> = (0..20).map(|i| message(i, 200, &mut rng)).collect();
    let mut expect: VecDeque<Message> = back.iter().cloned().collect();
    for m in &back {
        eng[1].queue_frame(wire::encode(m).unwrap());
    }
    for _ in 0..1000 {
        eng[1].flush().unwrap();
        eng[0].pump().unwrap();
        eng[1].pump().unwrap();
        take_all(&mut eng[0], &mut expect).unwrap();
        if expect.is_empty() {
            break;
        }
    }
    assert!(expect.is_empty());
    assert!(net.lock().violations.is_empty());
}

// ----- malformed input -----

fn chunk(kind: u8, flags: u8, grant: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; CHUNK_HEADER_LEN];
    ChunkHeader {
        kind,
        flags,
        grant,
        seq,
        len: payload.len() as u32,
    }
    .put(&mut out);
    out.extend_from_slice(payload);
    out
}

/// Injects `chunks` into side 0 and returns the error the engine reports, checking it
/// is reported again by every later call.
fn refused(chunks: &[Vec<u8>]) -> vsan_core::Error {
    let (mut eng, net) = engines(pool(4, 2, 256), pool(4, 2, 256), false);
    for c in chunks {
        net.lock().inject(0, c);
    }
    let err = match eng[0].pump() {
        Err(e) => e,
        Ok(()) => eng[0].take_message().expect_err("a bad chunk is refused"),
    };
    assert_eq!(eng[0].take_message().unwrap_err().kind(), err.kind());
    assert_eq!(eng[0].pump().unwrap_err().kind(), err.kind());
    assert_eq!(eng[0].check_tx().unwrap_err().kind(), err.kind());
    err
}

#[test]
fn bad_chunks_fail_the_link_with_a_protocol_error() {
    let cases: Vec<(&str, Vec<Vec<u8>>)> = vec![
        ("shorter than a chunk header", vec![vec![1, 0, 0]]),
        ("out of sequence", vec![chunk(2, 0, 0, 5, &[])]),
        ("unknown type", vec![chunk(9, 0, 0, 0, &[])]),
        ("unknown flags", vec![chunk(1, 1, 0, 0, b"x")]),
        ("returns 1 credits", vec![chunk(2, 0, 1, 0, &[])]),
        ("with a payload", vec![chunk(2, 0, 0, 0, b"abc")]),
        ("does not match", {
            let mut c = chunk(1, 0, 0, 0, b"abcdef");
            c[11] = 99;
            vec![c]
        }),
        (
            "data after the peer closed",
            vec![chunk(3, 0, 0, 0, &[]), chunk(1, 0, 0, 1, b"x")],
        ),
        (
            "a second close",
            vec![chunk(3, 0, 0, 0, &[]), chunk(3, 0, 0, 1, &[])],
        ),
        ("bad frame", vec![chunk(1, 0, 0, 0, &[0xab; 40])]),
    ];
    for (why, chunks) in cases {
        let err = refused(&chunks);
        assert_eq!(err.kind(), ErrorKind::Protocol, "{why}: {err}");
        assert!(err.to_string().contains(why), "{why}: {err}");
    }
}

#[test]
fn a_failed_work_request_fails_the_link() {
    let (mut eng, net) = engines(pool(4, 2, 256), pool(4, 2, 256), false);
    net.lock().fail(0, "retry exceeded");
    let err = eng[0].pump().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io);
    assert!(err.to_string().contains("retry exceeded"), "{err}");
}

#[test]
fn a_stream_cut_mid_frame_says_so() {
    let (mut eng, _net) = engines(pool(4, 2, 256), pool(4, 2, 256), true);
    let mut rng = SmallRng::seed_from_u64(2);
    let frame = wire::encode(&message(1, 1000, &mut rng)).unwrap();
    let (head, _) = frame.into_parts();
    eng[1].queue_bytes(head, true);
    eng[1].flush().unwrap();
    eng[1].on_disconnect("peer disconnected");
    eng[0].pump().unwrap();
    eng[0].on_disconnect("peer disconnected");
    let err = eng[0].take_message().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed);
    assert!(
        err.to_string().contains("in the middle of a frame"),
        "{err}"
    );
}

#[test]
fn peer_announcements_out_of_range_are_refused() {
    let (va, _vb, _net) = fake::pair(pool(4, 2, 256), pool(4, 2, 256), false);
    let err = Engine::new(
        va,
        PeerParams {
            credits: 2,
            buf_len: 256,
        },
        "fake".into(),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol);
    let bad_len = PeerParams {
        credits: 8,
        buf_len: 10,
    };
    assert!(bad_len.check().is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Random message sizes, pool shapes and interleavings: in order, within credits,
    /// no deadlock, no credit leak.
    #[test]
    fn random_interleavings_deliver_everything_in_order(
        seed in any::<u64>(),
        recv in [4usize..10, 4usize..10],
        send in [1usize..6, 1usize..6],
        len in [64usize..700, 64usize..700],
        sizes_a in proptest::collection::vec(0usize..5000, 0..30),
        sizes_b in proptest::collection::vec(0usize..5000, 0..30),
        read_chance in 0.05f64..1.0,
    ) {
        let pools = [pool(recv[0], send[0], len[0]), pool(recv[1], send[1], len[1])];
        let r = random_run(seed, pools, [&sizes_a, &sizes_b], read_chance, 3_000);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// Whatever the peer's SEND holds, the engine refuses it or accepts it; it never
    /// panics, and a refusal is a protocol error.
    #[test]
    fn arbitrary_chunks_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
        valid_header in any::<bool>(),
    ) {
        let (mut eng, net) = engines(pool(4, 2, 256), pool(4, 2, 256), false);
        let mut c = bytes.clone();
        if valid_header && c.len() >= CHUNK_HEADER_LEN {
            c = chunk(1, 0, 0, 0, &bytes[CHUNK_HEADER_LEN..]);
        }
        net.lock().inject(0, &c);
        let r = eng[0].pump().and_then(|()| eng[0].take_message().map(|_| ()));
        if let Err(e) = r {
            prop_assert_eq!(e.kind(), ErrorKind::Protocol, "{}", e);
        }
    }
}

// ----- the async link over the fake -----

fn link_params(secret: Option<&[u8]>, role: Role, limit: usize) -> LinkParams {
    LinkParams {
        transport: "rdma",
        send_queue_limit: limit,
        close_timeout: Duration::from_secs(2),
        secret: secret.map(|s| SharedSecret::new(s).unwrap()),
        handshake_timeout: Duration::from_secs(2),
        role,
    }
}

async fn link_pair_with(
    a: Pool,
    b: Pool,
    secrets: [Option<&[u8]>; 2],
    limit: usize,
) -> (vsan_core::Result<Link>, vsan_core::Result<Link>, FakeNet) {
    let (va, vb, net) = fake::pair(a, b, true);
    let (na, nb) = (va.notifier(), vb.notifier());
    let ea = Engine::new(va, params_of(b), "rdma:fake-b".into()).unwrap();
    let eb = Engine::new(vb, params_of(a), "rdma:fake-a".into()).unwrap();
    let (la, lb) = tokio::join!(
        link::establish(ea, na, link_params(secrets[0], Role::Connector, limit)),
        link::establish(eb, nb, link_params(secrets[1], Role::Acceptor, limit)),
    );
    (la, lb, net)
}

async fn link_pair(a: Pool, b: Pool) -> (Link, Link, FakeNet) {
    let (la, lb, net) = link_pair_with(a, b, [None, None], 1 << 20).await;
    (la.unwrap(), lb.unwrap(), net)
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(Duration::from_secs(20), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within 20 s"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_carry_messages_both_ways_at_once() {
    let (a, b, net) = link_pair(pool(4, 2, 128), pool(5, 1, 300)).await;
    assert_eq!(a.transport(), "rdma");
    let mut rng = SmallRng::seed_from_u64(11);
    let sizes: Vec<usize> = (0..400).map(|_| rng.random_range(0..12_000)).collect();
    let from_a: Vec<Message> = messages(&sizes, &mut rng).into();
    let from_b: Vec<Message> = messages(&sizes, &mut rng).into();
    let (a_tx, mut a_rx) = a.into_split();
    let (b_tx, mut b_rx) = b.into_split();
    let (fa, fb) = (from_a.clone(), from_b.clone());
    let send_a = tokio::spawn(async move {
        for m in fa {
            a_tx.send(m).await.unwrap();
        }
        a_tx
    });
    let send_b = tokio::spawn(async move {
        for m in fb {
            b_tx.send(m).await.unwrap();
        }
        b_tx
    });
    let recv_a = tokio::spawn(async move {
        let mut got = Vec::new();
        for _ in 0..from_b.len() {
            got.push(a_rx.recv().await.unwrap());
        }
        assert_eq!(got, from_b);
    });
    let recv_b = tokio::spawn(async move {
        let mut got = Vec::new();
        for _ in 0..from_a.len() {
            got.push(b_rx.recv().await.unwrap());
        }
        assert_eq!(got, from_a);
    });
    within("both directions", async {
        let _keep = (send_a.await.unwrap(), send_b.await.unwrap());
        recv_a.await.unwrap();
        recv_b.await.unwrap();
    })
    .await;
    assert!(
        net.lock().violations.is_empty(),
        "{:?}",
        net.lock().violations
    );
}

#[tokio::test]
async fn the_same_secret_authenticates_and_different_ones_are_refused_on_both_sides() {
    let p = pool(4, 2, 256);
    let (a, b, _net) = link_pair_with(p, p, [Some(b"k1"), Some(b"k1")], 1 << 20).await;
    let (a, mut b) = (a.unwrap(), b.unwrap());
    a.send(Message::Ping { id: 3 }).await.unwrap();
    assert_eq!(
        within("ping", b.recv()).await.unwrap(),
        Message::Ping { id: 3 }
    );

    let (a, b, _net) = link_pair_with(p, p, [Some(b"k1"), Some(b"k2")], 1 << 20).await;
    for r in [a, b] {
        let err = r.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains("secrets differ"), "{err}");
    }
}

#[tokio::test]
async fn close_delivers_what_was_sent_then_the_peer_sees_closed() {
    let (a, mut b, _net) = link_pair(pool(4, 2, 128), pool(4, 2, 128)).await;
    let mut rng = SmallRng::seed_from_u64(4);
    let sent: Vec<Message> = (0..30).map(|i| message(i, 700, &mut rng)).collect();
    for m in &sent {
        a.send(m.clone()).await.unwrap();
    }
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let end = loop {
            match b.recv().await {
                Ok(m) => got.push(m),
                Err(e) => break e,
            }
        };
        (got, end, b)
    });
    within("close", a.close()).await.unwrap();
    a.close().await.unwrap(); // a second close is a no-op
    assert_eq!(
        a.send(Message::Ping { id: 1 }).await.unwrap_err().kind(),
        ErrorKind::Closed
    );
    let (got, end, b) = within("reader", reader).await.unwrap();
    assert_eq!(got, sent);
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    // The other direction still works.
    let mut a = a;
    b.send(Message::Pong { id: 2 }).await.unwrap();
    assert_eq!(
        within("pong", a.recv()).await.unwrap(),
        Message::Pong { id: 2 }
    );
}

#[tokio::test]
async fn a_dropped_peer_ends_the_link_after_what_it_sent() {
    let (a, mut b, _net) = link_pair(pool(4, 2, 128), pool(4, 2, 128)).await;
    a.send(Message::Ping { id: 1 }).await.unwrap();
    drop(a);
    assert_eq!(
        within("ping", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    let err = within("end", b.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
    let err = within("again", b.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");
}

#[tokio::test]
async fn send_waits_while_the_peer_does_not_read_then_goes_on() {
    let limit = 2000;
    let (la, lb, _net) =
        link_pair_with(pool(4, 2, 128), pool(4, 2, 128), [None, None], limit).await;
    let (a, mut b) = (la.unwrap(), lb.unwrap());
    let mut rng = SmallRng::seed_from_u64(8);
    // The peer holds at most 4 chunks; the rest queues here until over the limit.
    let mut sent = Vec::new();
    let blocked = loop {
        let m = message(sent.len() as u64, 500, &mut rng);
        sent.push(m.clone());
        if tokio::time::timeout(Duration::from_millis(50), a.send(m))
            .await
            .is_err()
        {
            break true;
        }
        if sent.len() > 100 {
            break false;
        }
    };
    assert!(blocked, "send never waited");
    assert!(a.queue_depth().bytes > limit);
    // The timed-out send was accepted at its first poll: it is still delivered.
    for want in &sent {
        assert_eq!(&within("drain", b.recv()).await.unwrap(), want);
    }
    assert_eq!(a.queue_depth().messages, 0);
}

#[tokio::test]
async fn garbage_from_the_peer_fails_the_link() {
    let (_a, mut b, net) = link_pair(pool(4, 2, 128), pool(4, 2, 128)).await;
    net.lock().inject(1, &chunk(1, 0, 0, 0, &[0xee; 50]));
    let err = within("garbage", b.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert_eq!(b.recv().await.unwrap_err().kind(), ErrorKind::Protocol);
    assert_eq!(
        b.send(Message::Ping { id: 1 }).await.unwrap_err().kind(),
        ErrorKind::Protocol
    );
}

// ----- the transport -----

#[test]
fn each_fallback_reason_is_logged_at_warn_once() {
    let t = RdmaTransport::new();
    assert_eq!(t.fallback_reason(), None);
    assert!(t.note_fallback("no RDMA device"));
    assert!(!t.note_fallback("no RDMA device"));
    assert!(t.note_fallback("route resolution failed"));
    assert_eq!(
        t.fallback_reason().as_deref(),
        Some("route resolution failed")
    );
    // Clones share the record.
    let clone = t.clone();
    assert!(!clone.note_fallback("no RDMA device"));
    t.note_rdma_used();
    assert_eq!(clone.fallback_reason(), None);
}

#[test]
fn config_out_of_range_is_refused() {
    let mut c = RdmaConfig {
        credits: 2,
        ..RdmaConfig::default()
    };
    assert_eq!(c.check().unwrap_err().kind(), ErrorKind::InvalidArgument);
    c.credits = 16;
    c.buffer_size = 8;
    assert!(c.check().is_err());
    c.buffer_size = 4096;
    c.send_buffers = 0;
    assert!(c.check().is_err());
    c.send_buffers = 2;
    c.check().unwrap();
}
