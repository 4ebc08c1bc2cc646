//! ALUA for the iSCSI targets of mirrored disks: one logical unit, one target port group
//! per node.
//!
//! Both nodes of a mirrored disk present the same logical unit (the identity comes from
//! the disk id) under the same target name. Each node's port is its own target port
//! group with its own relative target port and portal group tag ([`relative_port`]: 1 on
//! the lower node id, 2 on the higher), so an initiator that logs in through both sees
//! two paths to one device. REPORT TARGET PORT GROUPS on either node lists both groups;
//! their states come from the mirror's status ([`MirrorStatus::serving`] and
//! [`MirrorStatus::peer_serving`]), never from a separate guess:
//!
//! | [`Serving`] | ALUA state | commands that access the medium get |
//! |---|---|---|
//! | `Ready` | active/optimized | served |
//! | `Waiting` (not yet proven current, held for quorum) | transitioning | NOT READY, 04/0A |
//! | `Unable` (no complete copy reachable, quorum lost, shutting down) | unavailable | NOT READY, 04/0C |
//!
//! On each new link the node also settles the reservation state with the other node
//! ([`LogicalUnit::peer_connected`]); a node whose state may be the older one
//! ([`LogicalUnit::must_settle`]: just started, or the resync's target) keeps its group
//! transitioning until that exchange is done.
//!
//! Each change raises ASYMMETRIC ACCESS STATE CHANGED (2A/06) on every nexus of the node
//! that sees it and is logged. The NOT READY answers are what let a multipath initiator
//! move I/O to the other node instead of failing it; behind them the mirror still holds
//! any request that reaches an unproven replica, so a race between a state change and a
//! command can delay it but never serve stale data.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};
use vsan_core::scsi::{AluaState, LogicalUnit, PortGroup};
use vsan_replica::protocol::LinkState;
use vsan_replica::{MirrorStatus, Serving};

/// The relative target port (and target port group, and portal group tag) of node
/// `node_id`'s port to a disk: 1 for a local disk and for the lower node id of a mirrored
/// pair, 2 for the higher, so the two nodes that serve the same logical unit give it two
/// distinct ports, and each node knows the other's.
pub(super) fn relative_port(node_id: u32, peer: Option<u32>) -> u16 {
    match peer {
        Some(p) if p < node_id => 2,
        _ => 1,
    }
}

/// The ALUA state a node in `serving` reports for its group.
pub(super) fn alua_state(serving: Serving) -> AluaState {
    match serving {
        Serving::Ready => AluaState::ActiveOptimized,
        Serving::Waiting => AluaState::Transitioning,
        Serving::Unable => AluaState::Unavailable,
    }
}

/// Both nodes' target port groups (each with its one port), ordered by group id, with
/// their states as `status` implies.
pub(super) fn port_groups(own: u16, peer: u16, status: &MirrorStatus) -> Vec<PortGroup> {
    let mut groups = vec![
        PortGroup {
            id: own,
            state: alua_state(status.serving()),
            relative_ports: vec![own],
        },
        PortGroup {
            id: peer,
            state: alua_state(status.peer_serving()),
            relative_ports: vec![peer],
        },
    ];
    groups.sort_by_key(|g| g.id);
    groups
}

/// How long a failed reservation state exchange waits before it is tried again (the
/// link is still up; the node stays transitioning if it must not serve before it).
const SETTLE_RETRY: Duration = Duration::from_millis(250);

/// A reservation state exchange in flight.
type Settle = Pin<Box<dyn Future<Output = vsan_core::Result<()>> + Send>>;

/// [`LogicalUnit::peer_connected`] after `delay`.
fn settle_with_peer(lu: Arc<LogicalUnit>, delay: Duration) -> Settle {
    Box::pin(async move {
        tokio::time::sleep(delay).await;
        lu.peer_connected().await
    })
}

/// A mirrored disk's logical unit whose port groups follow its mirror's status.
pub(super) struct AluaFollower {
    disk: String,
    lu: Arc<LogicalUnit>,
    own: u16,
    peer: u16,
    /// The mirror's status, until [`AluaFollower::start`] hands it to the task.
    status: Option<watch::Receiver<MirrorStatus>>,
    task: Option<JoinHandle<()>>,
}

impl AluaFollower {
    /// `lu`'s groups set from `status` (the mirror's
    /// [`watch_status`](vsan_replica::MirroredDisk::watch_status)) now;
    /// [`AluaFollower::start`] keeps them in step.
    pub(super) fn new(
        disk: &str,
        lu: Arc<LogicalUnit>,
        own: u16,
        peer: u16,
        status: watch::Receiver<MirrorStatus>,
    ) -> AluaFollower {
        lu.set_port_groups(port_groups(own, peer, &status.borrow()));
        AluaFollower {
            disk: disk.to_string(),
            lu,
            own,
            peer,
            status: Some(status),
            task: None,
        }
    }

    /// Follow the mirror's status until the mirror closes or
    /// [`AluaFollower::shutting_down`].
    pub(super) fn start(&mut self) {
        let Some(mut rx) = self.status.take() else {
            return;
        };
        let (disk, lu, own, peer) = (self.disk.clone(), self.lu.clone(), self.own, self.peer);
        self.task = Some(tokio::spawn(async move {
            // The link whose reservation state is (being) settled.
            let mut connected: Option<u64> = None;
            // The reservation state exchange of the current link, while it runs.
            let mut settle: Option<Settle> = None;
            // Whether this node's group stays transitioning until `settle` ends.
            let mut gated = false;
            loop {
                let now_connected = {
                    let st = rx.borrow();
                    (st.link == LinkState::Connected).then(|| st.link_epoch.unwrap_or(0))
                };
                if now_connected != connected {
                    if connected.is_some() {
                        // The link this node settled is gone (perhaps replaced by a new
                        // one between two looks): what the units owned and granted for
                        // COMPARE AND WRITE goes with it.
                        lu.peer_lost();
                    }
                    connected = now_connected;
                    if connected.is_some() {
                        gated = lu.must_settle();
                        settle = Some(settle_with_peer(lu.clone(), Duration::ZERO));
                        info!(
                            disk = %disk,
                            gated,
                            "a new link: settling the reservation state with the other node"
                        );
                    } else {
                        settle = None;
                        gated = false;
                    }
                }
                let mut groups = port_groups(own, peer, &rx.borrow_and_update());
                if gated {
                    for g in groups.iter_mut().filter(|g| g.id == own) {
                        if g.state == AluaState::ActiveOptimized {
                            g.state = AluaState::Transitioning;
                        }
                    }
                }
                if groups != lu.port_groups() {
                    info!(
                        disk = %disk,
                        states = %describe(&groups),
                        "ALUA: target port group states changed (ASYMMETRIC ACCESS STATE \
                         CHANGED raised on every nexus)"
                    );
                    lu.set_port_groups(groups);
                }
                tokio::select! {
                    changed = rx.changed() => {
                        if changed.is_err() {
                            return;
                        }
                    }
                    done = async { settle.as_mut().expect("guarded").await }, if settle.is_some() => {
                        settle = None;
                        match done {
                            Ok(()) => {
                                info!(disk = %disk, "reservation state settled with the other node");
                                gated = false;
                            }
                            Err(e) if e.kind() == vsan_core::ErrorKind::NotSupported => {
                                info!(disk = %disk, "the other node serves no SCSI unit for this disk: this node's reservation state stands alone");
                                gated = false;
                            }
                            Err(e) => {
                                warn!(disk = %disk, "reservation state not settled with the other node ({e}); trying again");
                                settle = Some(settle_with_peer(lu.clone(), SETTLE_RETRY));
                            }
                        }
                    }
                }
            }
        }));
    }

    /// The node is stopping: stop following, and report this node's group unavailable
    /// so that commands still arriving are sent down the other path.
    pub(super) fn shutting_down(&mut self) {
        self.stop();
        let groups: Vec<PortGroup> = self
            .lu
            .port_groups()
            .into_iter()
            .map(|mut g| {
                if g.id == self.own {
                    g.state = AluaState::Unavailable;
                }
                g
            })
            .collect();
        info!(disk = %self.disk, states = %describe(&groups), "ALUA: shutting down");
        self.lu.set_port_groups(groups);
    }

    /// Stop following (the groups stay as they are).
    pub(super) fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Drop for AluaFollower {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `1=active/optimized 2=unavailable`, for the logs.
fn describe(groups: &[PortGroup]) -> String {
    groups
        .iter()
        .map(|g| {
            let s = match g.state {
                AluaState::ActiveOptimized => "active/optimized",
                AluaState::ActiveNonOptimized => "active/non-optimized",
                AluaState::Standby => "standby",
                AluaState::Unavailable => "unavailable",
                AluaState::Transitioning => "transitioning",
            };
            format!("{}={s}", g.id)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_nodes_of_a_pair_get_distinct_ports_and_agree_on_them() {
        assert_eq!(relative_port(1, None), 1);
        assert_eq!(relative_port(1, Some(2)), 1);
        assert_eq!(relative_port(2, Some(1)), 2);
        assert_eq!(relative_port(7, Some(3)), 2);
        assert_eq!(relative_port(3, Some(7)), 1);
        for (a, b) in [(1, 2), (3, 7), (100, 5)] {
            let (pa, pb) = (relative_port(a, Some(b)), relative_port(b, Some(a)));
            assert_ne!(pa, pb, "nodes {a} and {b}");
        }
    }

    /// A resolver's view of a peer that answers every exchange and counts the state
    /// requests (`PrGet`, tag 4 of `vsan_core::scsi::peer`'s messages).
    struct CountingPeer {
        state_requests: std::sync::atomic::AtomicUsize,
    }

    impl vsan_core::scsi::ScsiPeer for CountingPeer {
        fn is_resolver(&self) -> bool {
            true
        }
        fn link(&self) -> vsan_core::scsi::PeerLink {
            vsan_core::scsi::PeerLink::InSync
        }
        fn call(&self, msg: bytes::Bytes) -> vsan_core::device::IoFuture<'_, bytes::Bytes> {
            Box::pin(async move {
                if msg.first() == Some(&4) {
                    self.state_requests
                        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let mut answer = vec![0u8];
                    answer.extend_from_slice(&vsan_core::scsi::PrState::new().encode());
                    return Ok(answer.into());
                }
                Ok(bytes::Bytes::new())
            })
        }
        fn changed_alone(&self) -> vsan_core::device::IoFuture<'_, ()> {
            Box::pin(async { Ok(()) })
        }
        fn link_id(&self) -> u64 {
            1
        }
        fn spawn(&self, task: vsan_core::scsi::BackgroundTask) {
            tokio::spawn(task);
        }
    }

    fn status(epoch: Option<u64>) -> MirrorStatus {
        use vsan_replica::protocol::{Freshness, Generations, Proof};
        MirrorStatus {
            link: if epoch.is_some() {
                LinkState::Connected
            } else {
                LinkState::Degraded
            },
            link_attached: epoch.is_some(),
            link_transport: None,
            local_detached: false,
            diverged: false,
            last_problem: None,
            dirty_chunks: 0,
            generations: Generations::default(),
            inconsistent: false,
            syncing: false,
            last_sync_start: None,
            last_sync: None,
            quorum: None,
            suspended: false,
            local_data_lost: 0,
            freshness: Freshness::Current(Proof::Handshake),
            unproven_since: None,
            link_epoch: epoch,
            link_role: None,
        }
    }

    /// A link replaced between two looks of the follower (connected, then connected
    /// again on a new link, with no status in between that shows the drop) is settled
    /// again: the reservation state is exchanged once per link.
    #[tokio::test]
    async fn every_new_link_is_settled_even_when_the_drop_was_not_seen() {
        use vsan_core::device::{Geometry, MemDevice};
        use vsan_core::scsi::{LuConfig, LuIdentity, TargetPort};
        let device = Arc::new(MemDevice::new(
            Geometry::with_max_io(1 << 20, 512, 64 << 10).unwrap(),
        ));
        let lu = LogicalUnit::new(
            device,
            LuConfig {
                identity: LuIdentity::from_disk_id("vol0"),
                port: TargetPort {
                    name: "iqn.2026-12.io.vsan:vol0,t,0x0001".into(),
                    relative_id: 1,
                    group: 1,
                },
                read_only: false,
                state_file: None,
            },
        )
        .unwrap();
        let peer = Arc::new(CountingPeer {
            state_requests: Default::default(),
        });
        lu.set_peer(peer.clone());
        let (tx, rx) = watch::channel(status(Some(1)));
        let mut follower = AluaFollower::new("vol0", lu.clone(), 1, 2, rx);
        follower.start();
        let settled = |n: usize| {
            let peer = peer.clone();
            async move {
                for _ in 0..200 {
                    if peer
                        .state_requests
                        .load(std::sync::atomic::Ordering::SeqCst)
                        >= n
                    {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                panic!("the link was not settled {n} times");
            }
        };
        settled(1).await;
        tx.send_replace(status(Some(2)));
        settled(2).await;
        // The same link looked at again: nothing to settle.
        tx.send_replace(status(Some(2)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            peer.state_requests
                .load(std::sync::atomic::Ordering::SeqCst),
            2
        );
        follower.stop();
    }

    #[test]
    fn states_map_to_alua() {
        assert_eq!(alua_state(Serving::Ready), AluaState::ActiveOptimized);
        assert_eq!(alua_state(Serving::Waiting), AluaState::Transitioning);
        assert_eq!(alua_state(Serving::Unable), AluaState::Unavailable);
    }
}
