//! The unit's side of a peer: a COMPARE AND WRITE dropped while it waits for the other
//! node's stripe lock still releases that lock (found by the deterministic simulation,
//! `proptests/src/sim/scsi.rs`, where an aborted command's task was dropped; with no lease
//! on the other node's lock, a lost `Unlock` would block the blocks there for good); a
//! write that waited while a new link came up is refused (`LogicalUnit::same_link`).

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use futures_util::FutureExt;

use super::*;
use crate::device::IoFuture;

/// A resolver's peer whose `Lock` answers wait for the test; it records the calls.
#[derive(Default)]
struct SlowPeer {
    calls: Mutex<Vec<u8>>,
    spawned: Mutex<Vec<BackgroundTask>>,
}

impl ScsiPeer for SlowPeer {
    fn is_resolver(&self) -> bool {
        true
    }
    fn link(&self) -> PeerLink {
        PeerLink::InSync
    }
    fn call(&self, msg: Bytes) -> IoFuture<'_, Bytes> {
        let tag = msg.first().copied().unwrap_or(0);
        self.calls.lock().unwrap().push(tag);
        if tag == 7 {
            // `Lock`: never answered while the test looks.
            return Box::pin(std::future::pending());
        }
        Box::pin(async { Ok(Bytes::new()) })
    }
    fn changed_alone(&self) -> IoFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    fn link_id(&self) -> u64 {
        1
    }
    fn spawn(&self, task: BackgroundTask) {
        self.spawned.lock().unwrap().push(task);
    }
}

#[test]
fn a_caw_dropped_while_locking_the_other_node_releases_its_lock() {
    let lu = lu();
    let peer = Arc::new(SlowPeer::default());
    lu.set_peer(peer.clone());
    let h = lu.attach(nexus("a"));
    // The power-on unit attention first.
    let _ = run(&lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).now_or_never();
    let mut data = pattern(1, 0);
    data.extend(pattern(1, 7));
    let cdb = caw(5, 1);
    let mut caw_cmd = Box::pin(run(&lu, &h, &cdb, &data));
    assert!(
        caw_cmd.as_mut().now_or_never().is_none(),
        "waits for the lock"
    );
    assert_eq!(*peer.calls.lock().unwrap(), vec![7], "asked for the lock");
    // The transport drops the command (its connection went, say).
    drop(caw_cmd);
    let spawned: Vec<_> = std::mem::take(&mut *peer.spawned.lock().unwrap());
    assert_eq!(
        spawned.len(),
        1,
        "an Unlock goes out for the lock asked for"
    );
    for t in spawned {
        assert!(t.now_or_never().is_some());
    }
    assert_eq!(*peer.calls.lock().unwrap(), vec![7, 8], "Lock, then Unlock");
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
