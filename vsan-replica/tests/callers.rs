//! How callers drive a `MirroredDisk`: a request is carried out by the task (or thread)
//! that submits it, under a plug by the unplug, and a request given up midway leaves
//! both replicas alike. Two mirrored disks in one process over `MemDevice`s, linked over
//! TCP on loopback; every wait is bounded.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::timeout;
use vsan_core::plug::Plug;
use vsan_core::{BlockDevice, Geometry, IoFlags, MemDevice};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{Config, DiskId, LinkState};
use vsan_replica::transport::{TcpTransport, Transport};
use vsan_replica::{MirroredDisk, Replica};

const WAIT: Duration = Duration::from_secs(10);
const SIZE: u64 = 1 << 20;
const BS: u32 = 512;
const BLOCK: usize = 4096;

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {WAIT:?}"),
    }
}

fn mem() -> Arc<MemDevice> {
    Arc::new(MemDevice::new(Geometry::new(SIZE, BS).unwrap()))
}

/// Nodes 1 and 2 over `m1` and `m2`, linked and in sync (both replicas zero).
async fn pair(m1: &Arc<MemDevice>, m2: &Arc<MemDevice>) -> (MirroredDisk, MirroredDisk) {
    let cfg = |me| Config::new(me, 3 - me, DiskId([0x3c; 16]), "vol0", SIZE, BS);
    let start = |me, data: Arc<MemDevice>| async move {
        let replica = Replica::with_memory_meta(&cfg(me), data).await.unwrap();
        MirroredDisk::start(cfg(me), replica, None).unwrap()
    };
    let d1 = start(1, Arc::clone(m1)).await;
    let d2 = start(2, Arc::clone(m2)).await;
    let transport = Arc::new(TcpTransport::new());
    let listener = transport.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    tokio::spawn(accept_loop(
        listener,
        HashMap::from([("vol0".to_string(), d2.clone())]),
    ));
    tokio::spawn(dial_loop(transport, addr, d1.clone()));
    for d in [&d1, &d2] {
        let mut status = d.watch_status();
        within(
            "in sync",
            status
                .wait_for(|s| s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0),
        )
        .await
        .unwrap();
    }
    (d1, d2)
}

fn block(i: u64) -> Bytes {
    Bytes::from(vec![(i as u8).wrapping_mul(37).wrapping_add(1); BLOCK])
}

/// What `dev` holds at block `i`, read at once (a `MemDevice` completes in the first
/// poll).
fn peek(dev: &MemDevice, i: u64) -> Bytes {
    let mut fut = dev.read(i * BLOCK as u64, BLOCK);
    match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(r) => r.unwrap(),
        Poll::Pending => panic!("a MemDevice read did not complete at once"),
    }
}

#[tokio::test]
async fn requests_started_under_a_plug_are_carried_out_at_the_unplug() {
    let (m1, m2) = (mem(), mem());
    let (d1, _d2) = pair(&m1, &m2).await;
    let mut writes: Vec<_> = (0..8)
        .map(|i| d1.write(i * BLOCK as u64, block(i), IoFlags::empty()))
        .collect();
    {
        let _plug = Plug::new();
        let mut cx = Context::from_waker(Waker::noop());
        for w in &mut writes {
            assert!(
                w.as_mut().poll(&mut cx).is_pending(),
                "a write completed under the plug"
            );
        }
        // (This test's runtime has one thread: nothing else runs a turn meanwhile.)
        for i in 0..8 {
            assert!(
                peek(&m1, i).iter().all(|&b| b == 0) && peek(&m2, i).iter().all(|&b| b == 0),
                "block {i} reached a replica before the unplug"
            );
        }
    }
    for w in writes {
        within("a write started under the plug", w).await.unwrap();
    }
    for i in 0..8 {
        assert_eq!(peek(&m1, i), block(i), "node 1's replica, block {i}");
        assert_eq!(peek(&m2, i), block(i), "node 2's replica, block {i}");
    }
}

/// Runs `fut` to the end on this thread, which no runtime drives.
fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_outside_the_runtime_carries_out_its_own_requests() {
    let (m1, m2) = (mem(), mem());
    let (d1, _d2) = pair(&m1, &m2).await;
    let disk = d1.clone();
    // A C caller's thread, or a vhost-user queue's: no runtime there.
    let outside = std::thread::spawn(move || {
        assert!(tokio::runtime::Handle::try_current().is_err());
        for i in 0..16 {
            block_on(disk.write(i * BLOCK as u64, block(i), IoFlags::FUA))?;
        }
        block_on(disk.flush())?;
        block_on(disk.read(3 * BLOCK as u64, BLOCK))
    });
    let read = within("the outside thread's requests", async {
        loop {
            if outside.is_finished() {
                return outside.join().expect("the outside thread panicked");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(read, block(3));
    for i in 0..16 {
        assert_eq!(peek(&m1, i), block(i), "node 1's replica, block {i}");
        assert_eq!(peek(&m2, i), block(i), "node 2's replica, block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_given_up_midway_still_lands_on_both_replicas_alike() {
    let (m1, m2) = (mem(), mem());
    let (d1, _d2) = pair(&m1, &m2).await;
    for round in 0..50u64 {
        let i = round % 8;
        {
            // Submitted on its first poll, then dropped before it completes.
            let mut w = d1.write(i * BLOCK as u64, block(round), IoFlags::empty());
            let _ = w.as_mut().poll(&mut Context::from_waker(Waker::noop()));
        }
        // Later requests are served as usual.
        within(
            "a write after one given up",
            d1.write(8 * BLOCK as u64, block(round), IoFlags::empty()),
        )
        .await
        .unwrap();
    }
    within("flush", d1.flush()).await.unwrap();
    for i in 0..=8 {
        assert_eq!(
            peek(&m1, i),
            peek(&m2, i),
            "the replicas differ at block {i}"
        );
    }
    assert_eq!(peek(&m1, 8), block(49));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_mirror_fails_new_requests_at_once() {
    let (m1, m2) = (mem(), mem());
    let (d1, d2) = pair(&m1, &m2).await;
    within("close node 2", d2.close()).await.unwrap();
    within("close node 1", d1.close()).await.unwrap();
    let err = within(
        "a write after close",
        d1.write(0, block(1), IoFlags::empty()),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), vsan_core::ErrorKind::Closed, "{err}");
    assert!(
        peek(&m1, 0).iter().all(|&b| b == 0),
        "a write after close landed"
    );
}
