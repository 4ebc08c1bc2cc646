//! The unit's side of a peer: COMPARE AND WRITE's ownership of stripes across two units
//! (owner.rs: asked once, taken back by the other node's writes, which wait for a CAW
//! running; increments through both never lost); a write that waited while a new link
//! came up is refused (`LogicalUnit::same_link`).

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use futures_util::FutureExt;

use super::*;
use crate::BlockDevice;
use crate::device::IoFuture;

/// One of two units over one device (a mirror whose replicas are one), each the other's
/// peer; it records the tags of the calls it makes.
struct PairPeer {
    other: Mutex<std::sync::Weak<LogicalUnit>>,
    resolver: bool,
    calls: Mutex<Vec<u8>>,
}

impl ScsiPeer for PairPeer {
    fn is_resolver(&self) -> bool {
        self.resolver
    }
    fn link(&self) -> PeerLink {
        PeerLink::InSync
    }
    fn call(&self, msg: Bytes) -> IoFuture<'_, Bytes> {
        self.calls.lock().unwrap().push(msg[0]);
        let other = self.other.lock().unwrap().upgrade();
        Box::pin(async move {
            match other {
                Some(lu) => lu.on_peer_message(msg).await,
                None => Err(crate::error::Error::new(ErrorKind::Closed, "gone")),
            }
        })
    }
    fn changed_alone(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn link_id(&self) -> u64 {
        1
    }
    fn spawn(&self, task: BackgroundTask) {
        tokio::spawn(task);
    }
}

impl PairPeer {
    /// Tags of `Lock` (7) and `Revoke` (8) calls made so far.
    fn count(&self, tag: u8) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|&&t| t == tag)
            .count()
    }
}

const LOCK: u8 = 7;
const REVOKE: u8 = 8;

/// Units 1 (the resolver) and 2 over `dev`, with their peers.
fn pair(dev: Arc<dyn BlockDevice>) -> [(Arc<LogicalUnit>, Arc<PairPeer>); 2] {
    let units = [1u16, 2].map(|id| {
        let mut c = config(None);
        c.port.relative_id = id;
        c.port.group = id;
        let lu = LogicalUnit::new(dev.clone(), c).unwrap();
        let peer = Arc::new(PairPeer {
            other: Mutex::new(std::sync::Weak::new()),
            resolver: id == 1,
            calls: Mutex::new(Vec::new()),
        });
        lu.set_peer(peer.clone());
        (lu, peer)
    });
    *units[0].1.other.lock().unwrap() = Arc::downgrade(&units[1].0);
    *units[1].1.other.lock().unwrap() = Arc::downgrade(&units[0].0);
    units
}

/// A CAW of `lu` that adds one to the counter in the first 4 bytes of block `lba`;
/// whether it won.
async fn increment(lu: &Arc<LogicalUnit>, h: &NexusHandle, lba: u32) -> bool {
    let cur = run(lu, h, &rw10(READ_10, lba, 1), &[]).await.data;
    let n = u32::from_be_bytes([cur[0], cur[1], cur[2], cur[3]]);
    let mut d = cur.to_vec();
    d.extend_from_slice(&(n + 1).to_be_bytes());
    d.extend_from_slice(&cur[4..]);
    run(lu, h, &caw(u64::from(lba), 1), &d).await.status == Status::Good
}

#[tokio::test]
async fn caws_through_one_node_ask_the_other_once_until_its_writes_take_the_blocks_back() {
    // Three regions, so that a write can miss the CAW's stripe.
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(
        Geometry::with_max_io(3 * 2048 * u64::from(BS), BS, 64 << 10).unwrap(),
    ));
    let [(u1, p1), (u2, p2)] = pair(dev.clone());
    let (h1, h2) = (attach(&u1, "a").await, attach(&u2, "b").await);
    for n in 0..5 {
        assert!(increment(&u2, &h2, 5).await, "CAW {n}");
    }
    assert_eq!(
        p2.count(LOCK),
        1,
        "the first CAW asks; the others own the stripe"
    );
    // Node 1 writes the other regions freely, then its write into the owned one takes
    // it back.
    good(&run(&u1, &h1, &rw10(WRITE_10, 2048, 1), &pattern(1, 1)).await);
    assert_eq!(p1.count(REVOKE), 0, "another stripe");
    good(&run(&u1, &h1, &rw10(WRITE_10, 6, 1), &pattern(1, 2)).await);
    good(&run(&u1, &h1, &rw10(WRITE_10, 7, 1), &pattern(1, 3)).await);
    assert_eq!(p1.count(REVOKE), 1, "once: the stripe is shared again");
    // Node 2's next CAW asks again, and so does node 1's (taking it from node 2).
    assert!(increment(&u2, &h2, 5).await);
    assert_eq!(p2.count(LOCK), 2);
    assert!(increment(&u1, &h1, 5).await);
    assert!(increment(&u1, &h1, 5).await);
    assert_eq!(p1.count(LOCK), 1);
    // Node 2's write takes it back from node 1 in turn; node 1's own writes ask nothing.
    good(&run(&u1, &h1, &rw10(WRITE_10, 8, 1), &pattern(1, 4)).await);
    good(&run(&u2, &h2, &rw10(WRITE_10, 9, 1), &pattern(1, 5)).await);
    assert_eq!((p1.count(REVOKE), p2.count(REVOKE)), (1, 1));
    let block = dev.read(5 * u64::from(BS), BS as usize).await.unwrap();
    assert_eq!(&block[..4], &8u32.to_be_bytes(), "eight increments");
}

/// A test device over a `MemDevice`: its writes wait while `held` is set, and with
/// `link_back` it brings the link to the other node back (link 2) when the unit reads
/// (`true`) or writes (`false`).
struct HookedDevice {
    inner: MemDevice,
    held: std::sync::atomic::AtomicBool,
    open: tokio::sync::Notify,
    link_back: Option<(Arc<FlappingPeer>, bool)>,
}

impl HookedDevice {
    fn new(link_back: Option<(Arc<FlappingPeer>, bool)>) -> Arc<HookedDevice> {
        Arc::new(HookedDevice {
            inner: MemDevice::new(
                Geometry::with_max_io(2048 * u64::from(BS), BS, 64 << 10).unwrap(),
            ),
            held: std::sync::atomic::AtomicBool::new(false),
            open: tokio::sync::Notify::new(),
            link_back,
        })
    }

    fn hook(&self, reading: bool) {
        if let Some((peer, on_read)) = &self.link_back {
            if *on_read == reading {
                peer.link.store(2, Ordering::Relaxed);
            }
        }
    }
}

impl BlockDevice for HookedDevice {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        self.hook(true);
        self.inner.read(offset, len)
    }
    fn write(&self, offset: u64, data: Bytes, flags: crate::IoFlags) -> IoFuture<'_, ()> {
        self.hook(false);
        Box::pin(async move {
            while self.held.load(Ordering::SeqCst) {
                self.open.notified().await;
            }
            self.inner.write(offset, data, flags).await
        })
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64, flags: crate::IoFlags) -> IoFuture<'_, ()> {
        self.inner.discard(offset, len, flags)
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: crate::IoFlags) -> IoFuture<'_, ()> {
        self.inner.write_zeroes(offset, len, flags)
    }
}

#[tokio::test]
async fn a_write_through_the_granting_node_waits_for_the_owners_caw_and_lands_after_it() {
    let dev = HookedDevice::new(None);
    for owner in [1, 0] {
        let units = pair(dev.clone());
        let ((uo, po), (uw, pw)) = (&units[owner], &units[1 - owner]);
        let (ho, hw) = (attach(uo, "a").await, attach(uw, "b").await);
        // The owner's CAW takes the stripe and stops at its write.
        dev.held.store(true, Ordering::SeqCst);
        let mut data = pattern(1, 0);
        data.extend(pattern(1, 0xca));
        if owner == 0 {
            data[..BS as usize].copy_from_slice(&pattern(1, 0x77));
        }
        let (uo2, ho) = (uo.clone(), Arc::new(ho));
        let ho2 = ho.clone();
        let caw_task = tokio::spawn(async move { run(&uo2, &ho2, &caw(3, 1), &data).await });
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            po.count(LOCK),
            1,
            "owner {owner}: the CAW asked for the stripe"
        );
        // The other node's write to the block takes the stripe back, which waits for
        // the CAW.
        let (uw2, hw) = (uw.clone(), Arc::new(hw));
        let write =
            tokio::spawn(
                async move { run(&uw2, &hw, &rw10(WRITE_10, 3, 1), &pattern(1, 0x77)).await },
            );
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert_eq!(pw.count(REVOKE), 1, "owner {owner}: the write revokes");
        assert!(!write.is_finished(), "owner {owner}: waits for the CAW");
        dev.held.store(false, Ordering::SeqCst);
        dev.open.notify_waiters();
        good(&caw_task.await.unwrap());
        good(&write.await.unwrap());
        let block = dev.read(3 * u64::from(BS), BS as usize).await.unwrap();
        assert!(
            block.iter().all(|&b| b == 0x77),
            "owner {owner}: the write landed after the CAW"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn caw_increments_through_both_nodes_are_never_lost() {
    // Tasks on both nodes increment one counter with CAW and write its neighbour (same
    // stripe) in between, so ownership moves back and forth: the final count equals the
    // number of wins, and each node won some.
    let dev: Arc<dyn BlockDevice> = device();
    let units = pair(dev.clone());
    let mut tasks = Vec::new();
    for t in 0..6u8 {
        let (lu, _) = &units[usize::from(t % 2)];
        let lu = lu.clone();
        let h = Arc::new(attach(&lu, &format!("i{t}")).await);
        tasks.push(tokio::spawn(async move {
            let mut wins = 0u32;
            for _ in 0..40 {
                if increment(&lu, &h, 0).await {
                    wins += 1;
                }
                good(&run(&lu, &h, &rw10(WRITE_10, 1, 1), &pattern(1, t)).await);
            }
            (t % 2, wins)
        }));
    }
    let mut per_node = [0u32; 2];
    for t in tasks {
        let (node, wins) = t.await.unwrap();
        per_node[usize::from(node)] += wins;
    }
    let cur = dev.read(0, BS as usize).await.unwrap();
    assert_eq!(
        u32::from_be_bytes([cur[0], cur[1], cur[2], cur[3]]),
        per_node[0] + per_node[1]
    );
    assert!(per_node.iter().all(|&w| w > 0), "{per_node:?}");
    assert!(units[0].1.count(LOCK) + units[1].1.count(LOCK) > 1);
}

/// A peer whose link the test changes; it answers every call at once.
struct FlappingPeer {
    link: AtomicU64,
}

impl ScsiPeer for FlappingPeer {
    fn is_resolver(&self) -> bool {
        false
    }
    fn link(&self) -> PeerLink {
        match self.link.load(Ordering::Relaxed) {
            0 => PeerLink::Away,
            _ => PeerLink::InSync,
        }
    }
    fn call(&self, _msg: Bytes) -> IoFuture<'_, Bytes> {
        Box::pin(async { Ok(Bytes::new()) })
    }
    fn changed_alone(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn link_id(&self) -> u64 {
        self.link.load(Ordering::Relaxed)
    }
    fn spawn(&self, task: BackgroundTask) {
        let _ = task.now_or_never();
    }
}

#[test]
fn a_write_that_waited_while_a_new_link_came_up_is_refused_and_writes_nothing() {
    // Admitted on link 1 (and with the link away: 0), the link comes back as 2 while
    // the write waits behind a CAW's stripes: refused, the block untouched. On the
    // same link, or with the link gone meanwhile (the mirror holds such a write and
    // fails it if the other node went on), it goes through.
    for (admitted, later, refused) in [(1, 2, true), (0, 2, true), (1, 1, false), (1, 0, false)] {
        let dev = device();
        let lu = LogicalUnit::new(dev.clone(), config(None)).unwrap();
        let peer = Arc::new(FlappingPeer {
            link: AtomicU64::new(admitted),
        });
        lu.set_peer(peer.clone());
        let h = attach(&lu, "a").now_or_never().unwrap();
        let caw_stripes = lu.locks.exclusive(0, 1).now_or_never().unwrap();
        let data = pattern(1, 0x5a);
        let cdb = rw10(WRITE_10, 0, 1);
        let mut write = Box::pin(run(&lu, &h, &cdb, &data));
        assert!(write.as_mut().now_or_never().is_none(), "waits for the CAW");
        peer.link.store(later, Ordering::Relaxed);
        drop(caw_stripes);
        let r = write
            .now_or_never()
            .expect("runs once the stripes are free");
        let block = dev.read(0, BS as usize).now_or_never().unwrap().unwrap();
        if refused {
            assert_eq!(sense_of(&r), (2, 0x04, 0x0A), "{admitted} -> {later}");
            assert!(
                block.iter().all(|&b| b == 0),
                "{admitted} -> {later}: written"
            );
        } else {
            good(&r);
            assert_eq!(&block[..], &data[..], "{admitted} -> {later}");
        }
        // Uncontended, a write on the new link goes through.
        good(
            &run(&lu, &h, &rw10(WRITE_10, 1, 1), &data)
                .now_or_never()
                .unwrap(),
        );
    }
}

#[test]
fn a_caw_alone_that_a_new_link_joins_is_refused_before_its_write_and_failed_during_it() {
    // With the peer away the CAW flushes alone and runs without the other node; the
    // link comes back while it reads (refused, retry: nothing written) or while it
    // writes (HARDWARE ERROR: it may have landed after what the other node wrote).
    // Nothing was granted alone, so the other node's writes on the new link do not
    // wait for it.
    for on_read in [true, false] {
        let peer = Arc::new(FlappingPeer {
            link: AtomicU64::new(0),
        });
        let dev = HookedDevice::new(Some((peer.clone(), on_read)));
        let lu = LogicalUnit::new(dev.clone(), config(None)).unwrap();
        lu.set_peer(peer.clone());
        let h = attach(&lu, "a").now_or_never().unwrap();
        peer.link.store(0, Ordering::Relaxed);
        let mut data = pattern(1, 0);
        data.extend(pattern(1, 0xca));
        let r = run(&lu, &h, &caw(4, 1), &data).now_or_never().unwrap();
        let block = dev
            .inner
            .read(4 * u64::from(BS), BS as usize)
            .now_or_never()
            .unwrap()
            .unwrap();
        if on_read {
            assert_eq!(sense_of(&r), (2, 0x04, 0x0A), "refused before the write");
            assert!(block.iter().all(|&b| b == 0), "nothing written");
        } else {
            assert_eq!(sense_of(&r), (4, 0x44, 0x00), "failed: may have landed");
        }
    }
}

/// A peer away whose mirror refuses to go on alone (no quorum).
struct NoQuorumPeer;

impl ScsiPeer for NoQuorumPeer {
    fn is_resolver(&self) -> bool {
        false
    }
    fn link(&self) -> PeerLink {
        PeerLink::Away
    }
    fn call(&self, _msg: Bytes) -> IoFuture<'_, Bytes> {
        Box::pin(async { Err(crate::error::Error::new(ErrorKind::Closed, "away")) })
    }
    fn changed_alone(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Err(crate::error::Error::new(ErrorKind::NoQuorum, "no quorum")) })
    }
    fn link_id(&self) -> u64 {
        0
    }
    fn spawn(&self, task: BackgroundTask) {
        let _ = task.now_or_never();
    }
}

#[test]
fn a_caw_with_the_peer_away_and_no_quorum_writes_nothing() {
    // Alone, a CAW first makes the mirror commit to going on without the other node
    // (a flush alone); refused (no quorum), the CAW fails before it compares: NOT READY,
    // use the other path, the block untouched.
    let dev = device();
    let lu = LogicalUnit::new(dev.clone(), config(None)).unwrap();
    lu.set_peer(Arc::new(NoQuorumPeer));
    let h = attach(&lu, "a").now_or_never().unwrap();
    let mut data = pattern(1, 0);
    data.extend(pattern(1, 0xca));
    let r = run(&lu, &h, &caw(4, 1), &data).now_or_never().unwrap();
    assert_eq!(sense_of(&r).0, 2, "NOT READY: {r:?}");
    let block = dev
        .read(4 * u64::from(BS), BS as usize)
        .now_or_never()
        .unwrap()
        .unwrap();
    assert!(block.iter().all(|&b| b == 0), "nothing written");
}
