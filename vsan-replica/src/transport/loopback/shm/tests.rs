//! Hostile peers: forged or undersized memory, wrong descriptors, and a peer that
//! scribbles on the shared memory of a live link. None may panic or hang; each is
//! refused (or fails the link) with `Protocol`, and the listener keeps working.

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use crate::wire::Message;

use super::doorbell::doorbell;
use super::handshake::{connect_with, hello, recv_handshake, send_handshake, u32_at};
use super::region::{Region, add_seals, memfd};
use super::ring::Ring;
use super::*;

const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {WAIT:?}"),
    }
}

/// A memfd with a header claiming rings of `ring` bytes, `len` bytes long, sealed
/// against shrinking or not.
fn forged(ring: u64, len: u64, seal: bool) -> File {
    let file = File::from(memfd().unwrap());
    file.set_len(len).unwrap();
    let mut header = [0u8; 32];
    header[0..8].copy_from_slice(&SHM_MAGIC);
    header[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
    header[12..16].copy_from_slice(&(SHM_HEADER_LEN as u32).to_ne_bytes());
    header[16..24].copy_from_slice(&ring.to_ne_bytes());
    header[24..32].copy_from_slice(&ring.to_ne_bytes());
    file.write_all_at(&header, 0).unwrap();
    if seal {
        add_seals(file.as_fd(), libc::F_SEAL_SHRINK).unwrap();
    }
    file
}

/// Sends a hello with `fds` over a fresh connection; returns the acceptor's verdict
/// (from `accept`) and the reason the connector was told.
async fn offer(listener: &dyn Listener, addr: &str, fds: &[BorrowedFd<'_>]) -> (Error, String) {
    let stream = UnixStream::connect(addr).await.unwrap();
    send_handshake(&stream, &hello(), fds).await.unwrap();
    let err = within("accept", listener.accept()).await.unwrap_err();
    let (answer, got, _) = within("reply", recv_handshake(&stream, REPLY_LEN))
        .await
        .unwrap()
        .expect("a refusal");
    assert!(got.is_empty());
    assert_eq!(u32_at(&answer, 12), REPLY_REFUSED);
    let len = u32_at(&answer, 16) as usize;
    let reason = String::from_utf8(answer[REPLY_REASON_AT..REPLY_REASON_AT + len].to_vec());
    (err, reason.unwrap())
}

async fn still_works(t: &ShmTransport, listener: &dyn Listener, addr: &str) {
    let (a, b) = within("connect", async {
        tokio::join!(t.connect(addr), listener.accept())
    })
    .await;
    let (a, mut b) = (a.unwrap(), b.unwrap());
    within("send", a.send(Message::Ping { id: 7 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 7 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_memory_and_descriptors_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let addr = dir.path().join("f.sock").to_str().unwrap().to_string();
    let t = ShmTransport::new();
    let listener = t.listen(&addr).await.unwrap();
    let (_, bell) = doorbell().unwrap();
    let (_, bell2) = doorbell().unwrap();
    let cases: Vec<(File, &str)> = vec![
        // Claims two 8 MiB rings, holds one page: mapping it would fault.
        (forged(8 << 20, 4096, true), "bytes, its header needs"),
        // Right size, but the peer could shrink it under our mapping.
        (
            forged(4096, 3 * 4096, false),
            "not sealed against shrinking",
        ),
        (forged(5000, 1 << 20, true), "not a power of two"),
        (forged(1 << 31, 1 << 20, true), "not a power of two between"),
        (forged(4096, 100, true), "bytes, its header needs"),
    ];
    for (file, expect) in cases {
        let (err, reason) = offer(
            &*listener,
            &addr,
            &[file.as_fd(), bell.as_fd(), bell2.as_fd()],
        )
        .await;
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(reason.contains(expect), "{reason:?} lacks {expect:?}");
        assert!(err.to_string().contains(expect), "{err}");
    }
    // Not a shared memory file at all, and the wrong count or kind of descriptors.
    let good = forged(4096, 3 * 4096, true);
    let plain = tempfile::tempfile().unwrap();
    let (err, reason) = offer(
        &*listener,
        &addr,
        &[plain.as_fd(), bell.as_fd(), bell2.as_fd()],
    )
    .await;
    assert_eq!(err.kind(), ErrorKind::Protocol);
    assert!(
        reason.contains("header") || reason.contains("memfd"),
        "{reason}"
    );
    let (_, reason) = offer(&*listener, &addr, &[good.as_fd(), bell.as_fd()]).await;
    assert!(reason.contains("descriptors"), "{reason}");
    let (_, reason) = offer(
        &*listener,
        &addr,
        &[good.as_fd(), good.as_fd(), good.as_fd()],
    )
    .await;
    assert!(reason.contains("not sockets"), "{reason}");
    // Sockets, but TCP ones: closing one may linger on a runtime thread (review).
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let c1 = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
    let c2 = std::net::TcpStream::connect(tcp.local_addr().unwrap()).unwrap();
    let (_, reason) = offer(&*listener, &addr, &[good.as_fd(), c1.as_fd(), c2.as_fd()]).await;
    assert!(reason.contains("Unix domain"), "{reason}");
    // A pipe handed over as the memory: refused by its seals before anything reads
    // it (a read of some descriptors blocks).
    let (pipe_r, _pipe_w) = std::io::pipe().unwrap();
    let (_, reason) = offer(
        &*listener,
        &addr,
        &[pipe_r.as_fd(), bell.as_fd(), bell2.as_fd()],
    )
    .await;
    assert!(reason.contains("not a sealable memfd"), "{reason}");
    still_works(&t, &*listener, &addr).await;
}

/// A connected pair whose connector's shared memory the test can scribble on.
async fn exposed_pair() -> (Link, Link, Arc<Region>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let addr = dir.path().join("s.sock").to_str().unwrap().to_string();
    let config = ShmConfig {
        ring_size: 4096,
        ..ShmConfig::default()
    };
    let t = ShmTransport::with_config(config.clone());
    let listener = t.listen(&addr).await.unwrap();
    let (region, file) = Region::create(4096).unwrap();
    let region = Arc::new(region);
    let stream = UnixStream::connect(&addr).await.unwrap();
    let (a, b) = within("handshake", async {
        tokio::join!(
            connect_with(stream, Arc::clone(&region), file, &config, "test".into()),
            listener.accept()
        )
    })
    .await;
    (a.unwrap(), b.unwrap(), region, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_out_of_range_fails_the_receiver_with_protocol() {
    // Behind the head, far ahead, just more than the ring ahead.
    for ahead in [u64::MAX, 1 << 40, 4097] {
        let (a, mut b, region, _dir) = exposed_pair().await;
        within("send", a.send(Message::Ping { id: 1 }))
            .await
            .unwrap();
        assert_eq!(
            within("recv", b.recv()).await.unwrap(),
            Message::Ping { id: 1 }
        );
        let ring = Ring::new(&region, 0);
        let head = ring.head().load(Ordering::Acquire);
        assert!(head > 0);
        ring.tail()
            .store(head.wrapping_add(ahead), Ordering::Release);
        let err = within("recv", b.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains("out of range"), "{err}");
        // Every later call fails too, and the other side sees the link end.
        let again = within("recv", b.recv()).await.unwrap_err();
        assert_eq!(again.kind(), ErrorKind::Protocol);
        let mut a = a;
        let end = within("peer recv", a.recv()).await.unwrap_err();
        assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_out_of_range_fails_the_sender_with_protocol() {
    let (a, mut b, region, _dir) = exposed_pair().await;
    // The acceptor's head on ring 0 is what the connector trusts for room.
    Ring::new(&region, 0)
        .head()
        .store(1 << 50, Ordering::Release);
    let err = within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    let again = within("send", a.send(Message::Ping { id: 2 }))
        .await
        .unwrap_err();
    assert_eq!(again.kind(), ErrorKind::Protocol);
    let end = within("peer recv", b.recv()).await.unwrap_err();
    assert_eq!(end.kind(), ErrorKind::Closed, "{end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_in_the_ring_fails_the_receiver_with_protocol() {
    let (a, mut b, region, _dir) = exposed_pair().await;
    let ring = Ring::new(&region, 0);
    let junk = [0x5au8; 300];
    ring.copy_in(0, &junk);
    ring.tail().store(junk.len() as u64, Ordering::Release);
    let err = within("recv", b.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("bad frame"), "{err}");
    drop(a);
}

/// A peer that does the handshake by hand, then writes to the control socket, fails
/// the link with `Protocol`; one that hangs up ends it with `Closed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_made_peer_that_misuses_the_socket_fails_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let addr = dir.path().join("m.sock").to_str().unwrap().to_string();
    let t = ShmTransport::new();
    let listener = t.listen(&addr).await.unwrap();
    for garbage in [true, false] {
        let (_region, file) = Region::create(4096).unwrap();
        let (_data_wait, data_give) = doorbell().unwrap();
        let (_room_wait, room_give) = doorbell().unwrap();
        let mut stream = UnixStream::connect(&addr).await.unwrap();
        send_handshake(
            &stream,
            &hello(),
            &[file.as_fd(), data_give.as_fd(), room_give.as_fd()],
        )
        .await
        .unwrap();
        let mut link = within("accept", listener.accept()).await.unwrap();
        let (answer, bells, _) = within("reply", recv_handshake(&stream, REPLY_LEN))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(u32_at(&answer, 12), REPLY_OK);
        assert_eq!(bells.len(), REPLY_FDS);
        let want = if garbage {
            tokio::io::AsyncWriteExt::write_all(&mut stream, b"hi")
                .await
                .unwrap();
            ErrorKind::Protocol
        } else {
            drop(stream);
            drop(bells);
            ErrorKind::Closed
        };
        let err = within("recv", link.recv()).await.unwrap_err();
        assert_eq!(err.kind(), want, "{err}");
        let err = within("send", link.send(Message::Ping { id: 1 }))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), want, "{err}");
    }
    still_works(&t, &*listener, &addr).await;
}

#[test]
fn ring_copies_wrap_and_never_leave_the_ring() {
    let (region, _file) = Region::create(4096).unwrap();
    let region = Arc::new(region);
    let ring = Ring::new(&region, 1);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    for pos in [0u64, 1, 4000, 4095, 4096, u64::MAX - 10] {
        ring.copy_in(pos, &data[..3000]);
        let mut out = vec![MaybeUninit::<u8>::uninit(); 3000];
        assert_eq!(ring.copy_out(pos, &mut out), 3000);
        // SAFETY: copy_out initialised all 3000 bytes.
        let out: Vec<u8> = out
            .into_iter()
            .map(|b| unsafe { b.assume_init() })
            .collect();
        assert_eq!(out, data[..3000]);
    }
    // Asked for more than the ring: clamped to the ring's size.
    let mut big = vec![MaybeUninit::<u8>::uninit(); 10_000];
    assert_eq!(ring.copy_out(5, &mut big), 4096);
    ring.copy_in(5, &[1u8; 10_000]);
    // Ring 0's bytes are untouched by ring 1's copies.
    let mut first = vec![MaybeUninit::<u8>::uninit(); 4096];
    Ring::new(&region, 0).copy_out(0, &mut first);
    // SAFETY: copy_out initialised all of it.
    assert!(first.iter().all(|b| unsafe { b.assume_init() } == 0));
}
