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
    pair_on(Arc::clone(m1) as _, Arc::clone(m2) as _).await
}

/// As [`pair`], over any two data devices.
async fn pair_on(
    m1: Arc<dyn BlockDevice>,
    m2: Arc<dyn BlockDevice>,
) -> (MirroredDisk, MirroredDisk) {
    let cfg = |me| Config::new(me, 3 - me, DiskId([0x3c; 16]), "vol0", SIZE, BS);
    let start = |me, data: Arc<dyn BlockDevice>| async move {
        let replica = Replica::with_memory_meta(&cfg(me), data).await.unwrap();
        MirroredDisk::start(cfg(me), replica, None).unwrap()
    };
    let d1 = start(1, m1).await;
    let d2 = start(2, m2).await;
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

/// Aborts the test process (failing it) unless the guard is dropped, not by a panic,
/// within twice `WAIT`: a test that failed on a deadlocked runtime would otherwise hang
/// in the runtime's shutdown instead of failing.
struct Watchdog(std::sync::mpsc::Sender<()>);

fn watchdog(what: &'static str) -> Watchdog {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let start = std::time::Instant::now();
    std::thread::spawn(move || {
        if rx.recv_timeout(WAIT * 2).is_ok() {
            return;
        }
        // Timed out, or the test panicked (the guard went without a word): give its
        // runtime the rest of the time to shut down, then end the process.
        std::thread::sleep((WAIT * 2).saturating_sub(start.elapsed()));
        eprintln!("{what}: still not done after {:?}: deadlock", WAIT * 2);
        // Not `exit`: its at-exit work can wait on what the deadlock holds.
        std::process::abort();
    });
    Watchdog(tx)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = self.0.send(());
        }
    }
}

/// A SCSI handler that writes and flushes its own mirror while it answers the peer's
/// call, as vsan-ffi's handler does when a reservation changes while the link is away.
struct WritingHandler(MirroredDisk);

impl vsan_replica::ScsiHandler for WritingHandler {
    fn call(&self, body: Bytes) -> vsan_replica::ScsiFuture {
        let disk = self.0.clone();
        Box::pin(async move {
            disk.write(0, block(9), IoFlags::FUA)
                .await
                .map_err(|e| e.kind())?;
            disk.flush().await.map_err(|e| e.kind())?;
            Ok(body)
        })
    }
}

/// The handler's future is not polled inside a turn (which holds the lock its own
/// requests take): the call is answered and the handler's write is on both replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scsi_handler_may_do_io_on_its_own_mirror() {
    let _dog = watchdog("a SCSI call whose handler writes and flushes its own mirror");
    let (m1, m2) = (mem(), mem());
    let (d1, d2) = pair(&m1, &m2).await;
    let handler: Arc<dyn vsan_replica::ScsiHandler> = Arc::new(WritingHandler(d2.clone()));
    d2.set_scsi_handler(Arc::downgrade(&handler));
    let answer = within(
        "a SCSI call whose handler does I/O",
        d1.scsi_call(Bytes::from_static(b"call")),
    )
    .await
    .unwrap();
    assert_eq!(&answer[..], b"call");
    assert_eq!(
        peek(&m1, 0),
        block(9),
        "the handler's write is not on node 1"
    );
    assert_eq!(
        peek(&m2, 0),
        block(9),
        "the handler's write is not on node 2"
    );
    within("close node 2", d2.close()).await.unwrap();
    within("close node 1", d1.close()).await.unwrap();
}

/// The `BlockDevice` methods a test device passes to its `inner` device unchanged (all
/// but `write` and `try_write_now`, which the devices below intercept).
macro_rules! delegate_to_inner {
    () => {
        fn geometry(&self) -> Geometry {
            self.inner.geometry()
        }
        fn read(&self, offset: u64, len: usize) -> vsan_core::IoFuture<'_, Bytes> {
            self.inner.read(offset, len)
        }
        fn flush(&self) -> vsan_core::IoFuture<'_, ()> {
            self.inner.flush()
        }
        fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> vsan_core::IoFuture<'_, ()> {
            self.inner.discard(offset, len, flags)
        }
        fn write_zeroes(
            &self,
            offset: u64,
            len: u64,
            flags: IoFlags,
        ) -> vsan_core::IoFuture<'_, ()> {
            self.inner.write_zeroes(offset, len, flags)
        }
    };
}

/// A data device whose first write at `PANIC_AT` panics (a device bug): in its
/// future, or, with `inline`, in `try_write_now` (the driver's path for writes a device
/// carries out at once).
struct PanickingDevice {
    inner: Arc<MemDevice>,
    armed: std::sync::atomic::AtomicBool,
    inline: bool,
}

const PANIC_AT: u64 = 5 * BLOCK as u64;

impl BlockDevice for PanickingDevice {
    delegate_to_inner!();
    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> vsan_core::IoFuture<'_, ()> {
        if !self.inline
            && offset == PANIC_AT
            && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return Box::pin(async { panic!("a device bug") });
        }
        self.inner.write(offset, data, flags)
    }
    fn try_write_now(
        &self,
        offset: u64,
        data: &Bytes,
        flags: IoFlags,
    ) -> Option<vsan_core::Result<()>> {
        if !self.inline {
            return None;
        }
        if offset == PANIC_AT && self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            panic!("a device bug");
        }
        self.inner.try_write_now(offset, data, flags)
    }
}

/// A local I/O that panics in the device, polled in whichever caller's turn, fails as
/// an I/O error (the replica is detached and I/O goes through the peer) and strands no
/// other request: the write completes on the peer, later writes to the same block and
/// reads see the newest data, and the mirror closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_panics_fails_its_io_and_strands_no_request() {
    device_panics(false).await;
}

/// The same, for a panic in `try_write_now`, which the driver calls on the spot
/// instead of polling a future.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_panics_on_the_spot_fails_its_io_and_strands_no_request() {
    device_panics(true).await;
}

async fn device_panics(inline: bool) {
    let _dog = watchdog("requests after a device panicked");
    let (m1, m2) = (mem(), mem());
    let dev1 = Arc::new(PanickingDevice {
        inner: Arc::clone(&m1),
        armed: true.into(),
        inline,
    });
    let (d1, d2) = pair_on(dev1, Arc::clone(&m2) as _).await;
    // Several writes started under one plug, so the panicking one shares its turn (run
    // by this task at the unplug) with others.
    let mut writes: Vec<_> = (3..8)
        .map(|i| d1.write(i * BLOCK as u64, block(i), IoFlags::empty()))
        .collect();
    {
        let _plug = Plug::new();
        let mut cx = Context::from_waker(Waker::noop());
        for w in &mut writes {
            let _ = w.as_mut().poll(&mut cx);
        }
    }
    for (i, w) in (3..8).zip(writes) {
        within("a write of the batch", w).await.unwrap();
        assert_eq!(peek(&m2, i), block(i), "block {i} is not on node 2");
    }
    within(
        "a write to the block whose write panicked",
        d1.write(PANIC_AT, block(20), IoFlags::FUA),
    )
    .await
    .unwrap();
    let read = within("a read of it", d1.read(PANIC_AT, BLOCK))
        .await
        .unwrap();
    assert_eq!(read, block(20));
    assert_eq!(peek(&m2, 5), block(20));
    within("a flush", d1.flush()).await.unwrap();
    within("close node 1", d1.close()).await.unwrap();
    within("close node 2", d2.close()).await.unwrap();
}

/// Node 2's data device: once armed, its ninth write waits (up to a few seconds) for
/// node 1 to have completed a write of the batch, and records whether one had.
struct AckProbe {
    inner: Arc<MemDevice>,
    armed: std::sync::atomic::AtomicBool,
    writes: std::sync::atomic::AtomicUsize,
    /// Node 1's writes completed so far (counted by the test).
    node1_done: Arc<std::sync::atomic::AtomicUsize>,
    /// Node 1's completed writes when node 2's ninth write began.
    seen_at_ninth: std::sync::Mutex<Option<usize>>,
}

impl AckProbe {
    fn on_write(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.armed.load(SeqCst) || self.writes.fetch_add(1, SeqCst) + 1 != 9 {
            return;
        }
        // Node 2's turn waits here with this worker handed over (so the runtime's I/O
        // goes on elsewhere): node 1 completes whatever node 2 has acked by now.
        tokio::task::block_in_place(|| {
            let until = std::time::Instant::now() + Duration::from_secs(3);
            while self.node1_done.load(SeqCst) == 0 && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        *self.seen_at_ninth.lock().unwrap() = Some(self.node1_done.load(SeqCst));
    }
}

impl BlockDevice for AckProbe {
    delegate_to_inner!();
    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> vsan_core::IoFuture<'_, ()> {
        self.on_write();
        self.inner.write(offset, data, flags)
    }
    fn try_write_now(
        &self,
        offset: u64,
        data: &Bytes,
        flags: IoFlags,
    ) -> Option<vsan_core::Result<()>> {
        self.on_write();
        self.inner.try_write_now(offset, data, flags)
    }
}

/// A peer that receives a batch of writes acks the first ones before it carries out the
/// rest (a turn's local I/O runs a few operations at a time, each step's acks sent
/// before the next step), so the exporting node completes the batch's first writes
/// while its peer still writes the others: 12 writes started under one plug on node 1
/// (about 49 KiB of frames: one read of the link, so node 2 has them all in one turn);
/// when node 2 starts its ninth, node 1 has completed some of the first eight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_acks_the_first_writes_of_a_batch_before_it_writes_the_rest() {
    use futures_util::StreamExt;
    use std::sync::atomic::Ordering::SeqCst;
    let _dog = watchdog("a batch of writes");
    let (m1, m2) = (mem(), mem());
    let node1_done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let probe = Arc::new(AckProbe {
        inner: Arc::clone(&m2),
        armed: false.into(),
        writes: 0.into(),
        node1_done: Arc::clone(&node1_done),
        seen_at_ninth: None.into(),
    });
    let (d1, d2) = pair_on(Arc::clone(&m1) as _, Arc::clone(&probe) as _).await;
    probe.armed.store(true, SeqCst);
    const BATCH: u64 = 12;
    let mut writes: Vec<_> = (0..BATCH)
        .map(|i| d1.write(i * BLOCK as u64, block(i), IoFlags::empty()))
        .collect();
    {
        let _plug = Plug::new();
        let mut cx = Context::from_waker(Waker::noop());
        for w in &mut writes {
            let _ = w.as_mut().poll(&mut cx);
        }
    }
    let mut writes: futures_util::stream::FuturesUnordered<_> = writes.into_iter().collect();
    while let Some(r) = within("a write of the batch", writes.next()).await {
        r.unwrap();
        node1_done.fetch_add(1, SeqCst);
    }
    for i in 0..BATCH {
        assert_eq!(peek(&m2, i), block(i), "block {i} on node 2");
    }
    let seen = probe.seen_at_ninth.lock().unwrap().take();
    assert!(
        seen.is_some_and(|n| n > 0),
        "node 1 had completed {seen:?} writes when node 2 started its ninth"
    );
    within("close node 1", d1.close()).await.unwrap();
    within("close node 2", d2.close()).await.unwrap();
}
