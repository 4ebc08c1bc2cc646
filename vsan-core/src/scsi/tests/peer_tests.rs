//! The unit's side of a peer: a COMPARE AND WRITE dropped while it waits for the other
//! node's stripe lock still releases that lock (found by the deterministic simulation,
//! `proptests/src/sim/scsi.rs`, where an aborted command's task was dropped; with no lease
//! on the other node's lock, a lost `Unlock` would block the blocks there for good).

use std::sync::Mutex;

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
