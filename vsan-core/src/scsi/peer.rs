//! One logical unit served by two nodes (issue 20): what a node's SCSI layer tells the
//! other's, so that reservations, COMPARE AND WRITE and resets hold across both.
//!
//! The node sets a [`ScsiPeer`] on the unit ([`LogicalUnit::set_peer`]); a mirror
//! carries the calls in its link order with the writes, and hands the peer's calls to
//! [`LogicalUnit::on_peer_message`]. One node, the *resolver* (the mirror's: the lower
//! node id), orders what both nodes do:
//!
//! - **PERSISTENT RESERVE OUT** runs on the resolver, under its PR lock: a command that
//!   came in on the other node is forwarded there (`Msg::PrOut`). The resolver applies
//!   it to its state, then has the other node apply the same command to its own
//!   (`Msg::PrApply`; [`PrState::apply`](super::PrState::apply) is deterministic, so
//!   both states stay equal) and waits for it, and only then answers. Each node raises
//!   the unit attentions and aborts the tasks of its own nexuses. With the peer away a
//!   node first flushes the mirror alone ([`ScsiPeer::changed_alone`]: with a witness it
//!   needs quorum, and it moves the data generation, so the next handshake makes this
//!   node the sync source) and only then applies the command; refused there, or with
//!   the link back meanwhile (the flush then moved nothing), the command fails and
//!   nothing changed. A resolver whose `PrApply` got no answer does the same after
//!   the fact; failing there, the command ends with an unknown outcome (HARDWARE
//!   ERROR). A forwarded command carries a token: when its `PrApply` arrived before
//!   the link went, the forwarder knows it was applied on both and does not apply it
//!   again.
//! - **The state after a (re)connect**: on every new link both nodes call
//!   [`LogicalUnit::peer_connected`]; the other node asks the resolver to settle
//!   (`Msg::Settle`) and waits. The resolver asks the other node for its state
//!   (`Msg::PrGet`) and decides which one both keep, the way the mirror decided for
//!   the data, by what the link's handshake decided
//!   (vsan-replica's `Endpoint::link_role` on a mirror, even when the resync it
//!   started is over): the sync source's; in
//!   sync, the state of a node that kept running over one that just started (a start
//!   is a power on for the node, not for the unit); otherwise the resolver's. The loser installs the winner's (`Msg::PrInstall`).
//!   A node whose state may be the older one ([`LogicalUnit::must_settle`]: it just
//!   started, or it is the resync's target) serves nothing until the exchange is
//!   done: the node reports its port group transitioning meanwhile, so no command is
//!   judged by a reservation state the pair has moved past (a key preempted while
//!   this node was away, say).
//! - **COMPARE AND WRITE** runs under its own node's stripe lock (exclusive) on
//!   regions its node *owns* across the pair (`owner.rs`): asked of the other
//!   node once (`Msg::Lock`: the other node's writes in flight there end first, and its
//!   later writes there take the regions back with `Msg::Revoke`, which waits for the
//!   CAW running here), then kept, so CAWs on the same blocks through one node cost no
//!   message of their own. Writes take their own node's stripes shared and complete on
//!   both replicas before they release them, so while a node owns a region and holds
//!   its stripe exclusive, nothing writes those blocks through either node. The other node asks
//!   holding its own stripes, the resolver with its own released, so two of them never
//!   wait on each other in a cycle. Ownership belongs to one link: both nodes forget it
//!   when the link goes (no lease, which could run out under a CAW still running).
//!   Without the other node (link down, or gone while asking) a CAW first flushes the
//!   mirror alone as a PR OUT does (so this node may write alone); a CAW whose link
//!   changed before it completed fails (HARDWARE ERROR): the other node forgot what it
//!   granted with the link, and this node's write may land after what the other did
//!   since (a write held across a reconnect).
//! - **Resets** (LOGICAL UNIT RESET, TARGET WARM and COLD RESET, CLEAR TASK SET): their
//!   unit attentions and aborts reach the other node's nexuses (`Msg::Reset`) before
//!   the task management response goes out.
//!
//! - **SCSI-2 RESERVE / RELEASE** are ordered the same way: run on the resolver, which
//!   tells the other node the holder after each change; the end of the holder's nexus
//!   on either node releases it on both; resets release it on both.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tracing::{info, warn};

use super::lock::StripeLock;
use super::owner::Regions;
use super::pr::{PrError, PrOut};
use super::sense::{Sense, SenseKey};
use super::{LogicalUnit, Nexus, PrState, TaskFunction, sense};
use crate::device::IoFuture;
use crate::error::{Error, ErrorKind, Result};

/// How a node's mirror link to the other node stands, as the unit needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerLink {
    /// Not connected: this node acts alone.
    Away,
    /// Connected, the replicas in sync.
    InSync,
    /// Connected, and this node is the source of a resync to the other.
    Source,
    /// Connected, and this node is the target of a resync from the other.
    Target,
}

/// The other node serving the same logical unit (see the module docs).
pub trait ScsiPeer: Send + Sync {
    /// Whether this node orders the pair's SCSI state (the mirror's resolver).
    fn is_resolver(&self) -> bool;
    /// The mirror link now.
    fn link(&self) -> PeerLink;
    /// Send `msg` to the other node's [`LogicalUnit::on_peer_message`] and return its
    /// answer; fails when the other node cannot be reached (this node then acts alone).
    fn call(&self, msg: Bytes) -> IoFuture<'_, Bytes>;
    /// A reservation change was made without the other node: make it count as a
    /// write made alone (a mirror flushes, which moves its data generation).
    fn changed_alone(&self) -> IoFuture<'_, ()>;
    /// Names the mirror link now (any value that changes with every new link; its
    /// value while no link is up does not matter). A COMPARE AND WRITE whose link
    /// changed before it completed fails: its write may land after what the other node
    /// did meanwhile.
    fn link_id(&self) -> u64;
    /// Run `task` in the background on this node's runtime (a reset's or a SCSI-2
    /// release's message to the other node): the unit spawns nothing itself,
    /// so it runs on whatever executor its node gives it (tokio in a node; the
    /// deterministic simulation's own).
    fn spawn(&self, task: BackgroundTask);
}

/// Work a unit hands to [`ScsiPeer::spawn`].
pub type BackgroundTask = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>;

/// What one node's unit tells the other's.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Msg {
    /// Raise the effects of a task management function from the other node.
    Reset(TaskFunction),
    /// Run this PERSISTENT RESERVE OUT (from a nexus on the sender) on the resolver;
    /// `token` names it in the `PrApply` that comes back.
    PrOut {
        from: Nexus,
        cdb: Bytes,
        data: Bytes,
        token: u64,
    },
    /// Apply this PERSISTENT RESERVE OUT, which the resolver applied; `token`: the
    /// receiver's own forwarded command's (0 for one that came in on the resolver).
    PrApply {
        from: Nexus,
        cdb: Bytes,
        data: Bytes,
        token: u64,
    },
    /// The receiver's PR state and whether it was taken from a peer since it started.
    PrGet,
    /// Take this PR state (the resolver's decision after a connect).
    PrInstall(Bytes),
    /// The state exchange after a connect is done (the receiver keeps its own).
    PrKept,
    /// Grant the sender regions `first..=last` for COMPARE AND WRITE; `counter`: the
    /// sender's grants up to this number are void (owner.rs). The answer is the grant's
    /// number.
    Lock { first: u64, last: u64, counter: u64 },
    /// Give up regions `first..=last` (the sender writes there); the sender's grants
    /// up to `upto` are void.
    Revoke { first: u64, last: u64, upto: u64 },
    /// Run this SCSI-2 RESERVE (`reserve`) or RELEASE from `from` on the resolver.
    Scsi2 { reserve: bool, from: Nexus },
    /// The SCSI-2 reservation holder now (the resolver's state, after a change).
    Scsi2Holder(Option<Nexus>),
    /// Settle the reservation state now (the other node saw a new link); the answer
    /// comes once the exchange is done.
    Settle,
}

const T_RESET: u8 = 1;
const T_PR_OUT: u8 = 2;
const T_PR_APPLY: u8 = 3;
const T_PR_GET: u8 = 4;
const T_PR_INSTALL: u8 = 5;
const T_PR_KEPT: u8 = 6;
const T_LOCK: u8 = 7;
const T_REVOKE: u8 = 8;
const T_SCSI2: u8 = 9;
const T_SCSI2_HOLDER: u8 = 10;
const T_SETTLE: u8 = 11;

fn put_bytes(b: &mut BytesMut, v: &[u8]) {
    b.put_u32(v.len() as u32);
    b.put_slice(v);
}

fn take_bytes(b: &mut Bytes) -> Result<Bytes> {
    if b.remaining() < 4 {
        return Err(bad("short length"));
    }
    let n = b.get_u32() as usize;
    if b.remaining() < n {
        return Err(bad("short field"));
    }
    Ok(b.split_to(n))
}

fn take_u64(b: &mut Bytes) -> Result<u64> {
    if b.remaining() < 8 {
        return Err(bad("short integer"));
    }
    Ok(b.get_u64())
}

fn bad(what: &str) -> Error {
    Error::new(ErrorKind::Protocol, format!("SCSI peer message: {what}"))
}

fn function_code(f: TaskFunction) -> u8 {
    match f {
        TaskFunction::AbortTaskSet => 1,
        TaskFunction::ClearTaskSet => 2,
        TaskFunction::LunReset => 3,
        TaskFunction::TargetWarmReset => 4,
        TaskFunction::TargetColdReset => 5,
        TaskFunction::ClearAca => 6,
    }
}

fn function_of(code: u8) -> Option<TaskFunction> {
    Some(match code {
        1 => TaskFunction::AbortTaskSet,
        2 => TaskFunction::ClearTaskSet,
        3 => TaskFunction::LunReset,
        4 => TaskFunction::TargetWarmReset,
        5 => TaskFunction::TargetColdReset,
        6 => TaskFunction::ClearAca,
        _ => return None,
    })
}

fn put_nexus(b: &mut BytesMut, n: &Nexus) {
    put_bytes(b, n.initiator_port.as_bytes());
    put_bytes(b, &n.transport_id);
    b.put_u16(n.relative_target_port);
}

fn take_nexus(b: &mut Bytes) -> Result<Nexus> {
    let port = take_bytes(b)?;
    let initiator_port =
        String::from_utf8(port.to_vec()).map_err(|_| bad("initiator port name not UTF-8"))?;
    let transport_id = take_bytes(b)?;
    if b.remaining() < 2 {
        return Err(bad("short nexus"));
    }
    Ok(Nexus {
        initiator_port,
        transport_id,
        relative_target_port: b.get_u16(),
    })
}

impl Msg {
    fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        match self {
            Msg::Reset(f) => {
                b.put_u8(T_RESET);
                b.put_u8(function_code(*f));
            }
            Msg::PrOut {
                from,
                cdb,
                data,
                token,
            }
            | Msg::PrApply {
                from,
                cdb,
                data,
                token,
            } => {
                b.put_u8(if matches!(self, Msg::PrOut { .. }) {
                    T_PR_OUT
                } else {
                    T_PR_APPLY
                });
                put_nexus(&mut b, from);
                put_bytes(&mut b, cdb);
                put_bytes(&mut b, data);
                b.put_u64(*token);
            }
            Msg::PrGet => b.put_u8(T_PR_GET),
            Msg::PrInstall(state) => {
                b.put_u8(T_PR_INSTALL);
                put_bytes(&mut b, state);
            }
            Msg::PrKept => b.put_u8(T_PR_KEPT),
            Msg::Lock {
                first,
                last,
                counter: n,
            }
            | Msg::Revoke {
                first,
                last,
                upto: n,
            } => {
                b.put_u8(if matches!(self, Msg::Lock { .. }) {
                    T_LOCK
                } else {
                    T_REVOKE
                });
                b.put_u64(*first);
                b.put_u64(*last);
                b.put_u64(*n);
            }
            Msg::Scsi2 { reserve, from } => {
                b.put_u8(T_SCSI2);
                b.put_u8(u8::from(*reserve));
                put_nexus(&mut b, from);
            }
            Msg::Settle => b.put_u8(T_SETTLE),
            Msg::Scsi2Holder(holder) => {
                b.put_u8(T_SCSI2_HOLDER);
                match holder {
                    Some(n) => {
                        b.put_u8(1);
                        put_nexus(&mut b, n);
                    }
                    None => b.put_u8(0),
                }
            }
        }
        b.freeze()
    }

    fn decode(mut b: Bytes) -> Result<Msg> {
        if b.is_empty() {
            return Err(bad("empty"));
        }
        let tag = b.get_u8();
        let m = match tag {
            T_RESET => {
                let code = if b.has_remaining() { b.get_u8() } else { 0 };
                Msg::Reset(function_of(code).ok_or_else(|| bad("unknown task function"))?)
            }
            T_PR_OUT | T_PR_APPLY => {
                let from = take_nexus(&mut b)?;
                let cdb = take_bytes(&mut b)?;
                let data = take_bytes(&mut b)?;
                let token = take_u64(&mut b)?;
                if tag == T_PR_OUT {
                    Msg::PrOut {
                        from,
                        cdb,
                        data,
                        token,
                    }
                } else {
                    Msg::PrApply {
                        from,
                        cdb,
                        data,
                        token,
                    }
                }
            }
            T_PR_GET => Msg::PrGet,
            T_PR_INSTALL => Msg::PrInstall(take_bytes(&mut b)?),
            T_PR_KEPT => Msg::PrKept,
            T_SETTLE => Msg::Settle,
            T_LOCK | T_REVOKE => {
                let (first, last, n) = (take_u64(&mut b)?, take_u64(&mut b)?, take_u64(&mut b)?);
                if last < first {
                    return Err(bad("an empty region range"));
                }
                if tag == T_LOCK {
                    Msg::Lock {
                        first,
                        last,
                        counter: n,
                    }
                } else {
                    Msg::Revoke {
                        first,
                        last,
                        upto: n,
                    }
                }
            }
            T_SCSI2 if b.has_remaining() => {
                let reserve = b.get_u8() != 0;
                Msg::Scsi2 {
                    reserve,
                    from: take_nexus(&mut b)?,
                }
            }
            T_SCSI2_HOLDER if b.has_remaining() => match b.get_u8() {
                0 => Msg::Scsi2Holder(None),
                _ => Msg::Scsi2Holder(Some(take_nexus(&mut b)?)),
            },
            _ => return Err(bad("unknown message")),
        };
        if b.has_remaining() {
            return Err(bad("trailing bytes"));
        }
        Ok(m)
    }
}

/// A PERSISTENT RESERVE OUT's outcome on the wire: 0 good, 1 conflict, 2 check (key,
/// ASC, ASCQ, then the INFORMATION field when the flag byte is 1).
fn encode_pr_result(r: &std::result::Result<(), PrError>) -> Bytes {
    let mut b = BytesMut::new();
    match r {
        Ok(()) => b.put_u8(0),
        Err(PrError::Conflict) => b.put_u8(1),
        Err(PrError::Check(s)) => {
            b.put_u8(2);
            b.put_u8(s.key as u8);
            b.put_u8(s.asc);
            b.put_u8(s.ascq);
            match s.information {
                Some(i) => {
                    b.put_u8(1);
                    b.put_u64(i);
                }
                None => b.put_u8(0),
            }
        }
    }
    b.freeze()
}

fn decode_pr_result(mut b: Bytes) -> Result<std::result::Result<(), PrError>> {
    if b.is_empty() {
        return Err(bad("empty PR result"));
    }
    Ok(match b.get_u8() {
        0 => Ok(()),
        1 => Err(PrError::Conflict),
        2 if b.remaining() >= 4 => {
            let key = SenseKey::from_u8(b.get_u8()).ok_or_else(|| bad("unknown sense key"))?;
            let (asc, ascq) = (b.get_u8(), b.get_u8());
            let information = match b.get_u8() {
                1 => Some(take_u64(&mut b)?),
                _ => None,
            };
            Err(PrError::Check(Sense {
                key,
                asc,
                ascq,
                information,
            }))
        }
        _ => return Err(bad("unknown PR result")),
    })
}

/// What became of a PERSISTENT RESERVE OUT offered to the resolver.
pub(super) enum Forwarded {
    /// The resolver ran it: its outcome.
    Done(std::result::Result<(), PrError>),
    /// Run it here (this node is the resolver, or alone); `lost`: it went to the
    /// resolver, which did not answer (it may have applied it).
    Here { lost: bool },
}

impl LogicalUnit {
    /// Serve this unit together with another node (see the module docs of
    /// [`crate::scsi::peer`]).
    pub fn set_peer(&self, peer: Arc<dyn ScsiPeer>) {
        *self.peer.write() = Some(peer);
    }

    pub(super) fn peer(&self) -> Option<Arc<dyn ScsiPeer>> {
        self.peer.read().clone()
    }

    /// A call from the other node's unit (what its [`ScsiPeer::call`] sent); the answer
    /// goes back to it.
    pub async fn on_peer_message(self: &Arc<Self>, body: Bytes) -> Result<Bytes> {
        match Msg::decode(body)? {
            Msg::Reset(f) => {
                self.reset_effects(None, f);
                info!(function = ?f, "task management function from the other node");
                Ok(Bytes::new())
            }
            Msg::PrOut {
                from,
                cdb,
                data,
                token,
            } => {
                let link = self.peer_link_id();
                let r = async {
                    let op = PrOut::decode(&cdb, &data).map_err(PrError::Check)?;
                    self.apply_pr_out(&from, None, &op, Some((&cdb, &data, token, Some(link))))
                        .await
                }
                .await;
                Ok(encode_pr_result(&r))
            }
            Msg::PrApply {
                from,
                cdb,
                data,
                token,
            } => {
                let r = async {
                    let op = PrOut::decode(&cdb, &data).map_err(PrError::Check)?;
                    self.apply_pr_out(&from, None, &op, None).await
                }
                .await;
                if r.is_ok() && token != 0 {
                    self.applied_forwards.lock().insert(token);
                }
                Ok(encode_pr_result(&r))
            }
            Msg::PrGet => {
                let mut b = BytesMut::new();
                b.put_u8(u8::from(self.pr_fresh.load(Ordering::Acquire)));
                b.put_slice(&self.pr_state().encode());
                Ok(b.freeze())
            }
            Msg::PrInstall(state) => {
                let state = PrState::decode(&state).map_err(|e| {
                    Error::with_source(ErrorKind::Protocol, "SCSI peer: PR state", e)
                })?;
                self.install_pr_state(state).await?;
                self.pr_fresh.store(false, Ordering::Release);
                info!("persistent reservation state taken from the other node");
                Ok(Bytes::new())
            }
            Msg::PrKept => {
                self.pr_fresh.store(false, Ordering::Release);
                Ok(Bytes::new())
            }
            Msg::Lock {
                first,
                last,
                counter,
            } => {
                // Under the stripes' exclusive lock: this node's writes in flight there
                // end first (on both replicas), and none of its CAWs runs there.
                let regions = (first, last);
                let _held = self
                    .locks
                    .exclusive_mask(StripeLock::mask_of(regions))
                    .await;
                let grant = self.owner.grant(regions, counter, self.peer_link_id());
                Ok(Bytes::copy_from_slice(&grant.to_be_bytes()))
            }
            Msg::Revoke { first, last, upto } => {
                // Under the lock: a CAW of this node running there ends first.
                let regions = (first, last);
                let _held = self
                    .locks
                    .exclusive_mask(StripeLock::mask_of(regions))
                    .await;
                self.owner.give_up(regions, upto, self.peer_link_id());
                Ok(Bytes::new())
            }
            Msg::Scsi2 { reserve, from } => {
                let ok = self.scsi2_resolve(&from, reserve).await.is_ok();
                Ok(Bytes::from_static(if ok { &[0] } else { &[1] }))
            }
            Msg::Scsi2Holder(holder) => {
                *self.scsi2.lock() = holder;
                self.update_reserved();
                Ok(Bytes::new())
            }
            Msg::Settle => {
                let peer = self.peer().ok_or_else(|| bad("no peer set"))?;
                if !peer.is_resolver() {
                    return Err(bad("both nodes think the other orders the SCSI state"));
                }
                self.settle(peer.as_ref()).await?;
                Ok(Bytes::new())
            }
        }
    }

    /// SCSI-2 RESERVE (`reserve`) or RELEASE from `from`: on the resolver (forwarded
    /// there from the other node while the link is up), which then tells the other node
    /// the holder; alone without the peer.
    pub(super) async fn scsi2_op(
        &self,
        from: &Nexus,
        reserve: bool,
    ) -> std::result::Result<(), super::exec::Fail> {
        if let Some(peer) = self.peer() {
            if !peer.is_resolver() && peer.link() != PeerLink::Away {
                let msg = Msg::Scsi2 {
                    reserve,
                    from: from.clone(),
                };
                match peer.call(msg.encode()).await {
                    Ok(r) if r.first() == Some(&0) => return Ok(()),
                    Ok(_) => return Err(super::exec::Fail::Conflict),
                    Err(e) => warn!(
                        "SCSI-2 reservation: the other node did not answer ({e}); acting alone"
                    ),
                }
            }
        }
        self.scsi2_resolve(from, reserve).await
    }

    /// [`Self::scsi2_op`] on this node's state, then (on the resolver, with the link
    /// up) the new holder to the other node, in the PR lock's order.
    async fn scsi2_resolve(
        &self,
        from: &Nexus,
        reserve: bool,
    ) -> std::result::Result<(), super::exec::Fail> {
        let _serial = self.pr_out.lock().await;
        self.scsi2_local(from, reserve)?;
        if let Some(peer) = self.peer() {
            if peer.is_resolver() && peer.link() != PeerLink::Away {
                let holder = self.scsi2.lock().clone();
                if let Err(e) = peer.call(Msg::Scsi2Holder(holder).encode()).await {
                    warn!("SCSI-2 reservation: the other node did not take the holder ({e})");
                }
            }
        }
        Ok(())
    }

    /// A nexus attached here that held the SCSI-2 reservation ended: the other node's
    /// copy is released too (in the background).
    pub(super) fn scsi2_released_here(&self, gone: Nexus) {
        let Some(peer) = self.peer() else {
            return;
        };
        if peer.link() == PeerLink::Away {
            return;
        }
        let msg = if peer.is_resolver() {
            Msg::Scsi2Holder(None)
        } else {
            Msg::Scsi2 {
                reserve: false,
                from: gone,
            }
        };
        let caller = Arc::clone(&peer);
        peer.spawn(Box::pin(async move {
            if let Err(e) = caller.call(msg.encode()).await {
                warn!("SCSI-2 reservation: the other node did not hear of its holder's end ({e})");
            }
        }));
    }

    /// The other node is gone: what it owned here for COMPARE AND WRITE is free (its
    /// CAW failed or completed alone there), and what this node owned is gone with the
    /// link.
    pub fn peer_lost(&self) {
        self.owner.forget();
    }

    /// Whether this node must not serve until [`Self::peer_connected`] returned on a new
    /// link: its reservation state may be older than the other node's, because it has
    /// just started (the other node kept running, or both start) or it is the target
    /// of a resync (the other node acted alone meanwhile). A node that kept running and
    /// is in sync or the resync's source keeps its own state and serves on.
    pub fn must_settle(&self) -> bool {
        match self.peer() {
            Some(peer) => self.pr_fresh.load(Ordering::Acquire) || peer.link() == PeerLink::Target,
            None => false,
        }
    }

    /// The mirror link to the other node was (re)established: settle which node's
    /// reservation state both keep (see the module docs). Call it on every new link, on
    /// both nodes; the resolver runs the exchange, the other node asks it to and waits.
    /// An error of kind [`ErrorKind::NotSupported`] means the other node serves no
    /// SCSI unit for this disk (this node's state is the only one).
    pub async fn peer_connected(&self) -> Result<()> {
        let Some(peer) = self.peer() else {
            return Ok(());
        };
        if peer.is_resolver() {
            self.settle(peer.as_ref()).await
        } else {
            peer.call(Msg::Settle.encode()).await.map(|_| ())
        }
    }

    /// The resolver's exchange: ask the other node for its state, decide, install.
    async fn settle(&self, peer: &dyn ScsiPeer) -> Result<()> {
        let _serial = self.pr_out.lock().await;
        let mut got = peer.call(Msg::PrGet.encode()).await?;
        if got.is_empty() {
            return Err(bad("empty PR state"));
        }
        let peer_fresh = got.get_u8() != 0;
        let theirs = PrState::decode(&got)
            .map_err(|e| Error::with_source(ErrorKind::Protocol, "SCSI peer: PR state", e))?;
        let fresh = self.pr_fresh.load(Ordering::Acquire);
        let take_theirs = match peer.link() {
            PeerLink::Target => true,
            PeerLink::Source => false,
            PeerLink::InSync | PeerLink::Away => fresh && !peer_fresh,
        };
        if take_theirs {
            if theirs != *self.pr.read() {
                self.persist(&theirs)
                    .await
                    .map_err(|e| Error::io("save persistent reservation state", e))?;
                *self.pr.write() = theirs;
                self.update_reserved();
                info!("persistent reservation state taken from the other node");
            }
            peer.call(Msg::PrKept.encode()).await?;
        } else {
            let mine = self.pr_state();
            if mine != theirs {
                info!("persistent reservation state sent to the other node");
                peer.call(Msg::PrInstall(mine.encode().into()).encode())
                    .await?;
            } else {
                peer.call(Msg::PrKept.encode()).await?;
            }
        }
        self.pr_fresh.store(false, Ordering::Release);
        Ok(())
    }

    /// Forward a PERSISTENT RESERVE OUT to the resolver when this node is not it and
    /// the link is up (see [`Forwarded`]).
    pub(super) async fn forward_pr_out(&self, from: &Nexus, cdb: &[u8], data: &[u8]) -> Forwarded {
        let Some(peer) = self.peer() else {
            return Forwarded::Here { lost: false };
        };
        if peer.is_resolver() || peer.link() == PeerLink::Away {
            return Forwarded::Here { lost: false };
        }
        let token = self.next_forward.fetch_add(1, Ordering::Relaxed);
        let msg = Msg::PrOut {
            from: from.clone(),
            cdb: Bytes::copy_from_slice(cdb),
            data: Bytes::copy_from_slice(data),
            token,
        };
        let reply = peer.call(msg.encode()).await;
        // The resolver's `PrApply` of this command came before its answer, if it did.
        let applied_here = self.applied_forwards.lock().remove(&token);
        match reply {
            Err(e) if applied_here => {
                // Applied on the resolver (it sends `PrApply` only after it applied it)
                // and here: applying it again would change the state twice.
                warn!("PERSISTENT RESERVE OUT: the other node applied it and then went away ({e})");
                Forwarded::Done(Ok(()))
            }
            Ok(reply) => match decode_pr_result(reply) {
                Ok(r) => Forwarded::Done(r),
                Err(e) => {
                    warn!("PERSISTENT RESERVE OUT through the other node: {e}");
                    Forwarded::Done(Err(PrError::Check(sense::INTERNAL_FAILURE)))
                }
            },
            Err(e) => {
                warn!(
                    "PERSISTENT RESERVE OUT: the other node did not answer ({e}); applying it here alone"
                );
                Forwarded::Here { lost: true }
            }
        }
    }

    /// After this node applied a PERSISTENT RESERVE OUT (holding the PR lock): the
    /// resolver has the other node apply it too; a node without the other one makes
    /// the change count as a write made alone.
    pub(super) async fn replicate_pr_out(
        &self,
        from: &Nexus,
        (cdb, data, token, came_on): super::exec::RawPrOut<'_>,
        changed: bool,
    ) -> std::result::Result<(), PrError> {
        let Some(peer) = self.peer() else {
            return Ok(());
        };
        let mut alone = true;
        // Applied here on a link that is gone since: not sent over the new one. A
        // forwarded command's node has told its initiator the outcome is unknown and
        // gone on; applied there now, it would take effect after commands that came
        // later. The other node's state may have moved on alone meanwhile (or powered
        // on): the exchange on the new link settles which state stands, so the outcome
        // is unknown here too.
        let link_gone = came_on.is_some_and(|l| l != peer.link_id());
        if link_gone {
            warn!(
                "PERSISTENT RESERVE OUT: the link it was applied on is gone; not sent over the new one"
            );
        }
        if peer.is_resolver() && peer.link() != PeerLink::Away && !link_gone {
            let msg = Msg::PrApply {
                from: from.clone(),
                cdb: Bytes::copy_from_slice(cdb),
                data: Bytes::copy_from_slice(data),
                token,
            };
            match peer.call(msg.encode()).await {
                Ok(reply) => {
                    alone = false;
                    match decode_pr_result(reply) {
                        Ok(Ok(())) => {}
                        theirs => {
                            // The two states differ (the exchange has not settled them
                            // yet): which one stands is the exchange's to say.
                            warn!(
                                "PERSISTENT RESERVE OUT ended differently on the other node ({theirs:?}; it succeeded here): its outcome is left to the reservation state exchange"
                            );
                            return Err(PrError::Check(sense::INTERNAL_FAILURE));
                        }
                    }
                }
                Err(e) => warn!(
                    "PERSISTENT RESERVE OUT: the other node did not take it ({e}); kept here alone"
                ),
            }
        }
        if alone && changed {
            // The other node did not take it: it counts only if this node may go on
            // alone (the mirror's flush: quorum, and the generation moves); if not, the
            // initiator hears that it failed (the state here may keep it: the pair
            // settles which state stands when they meet), as an internal failure: the
            // outcome is not known (a refusal before any change is NOT READY).
            self.go_alone(peer.as_ref()).await.map_err(|e| {
                warn!(
                    "PERSISTENT RESERVE OUT: the change made here is not committed alone ({e}); its outcome is left to the reservation state exchange"
                );
                PrError::Check(sense::INTERNAL_FAILURE)
            })?;
        }
        Ok(())
    }

    /// Whether this node may act without the other (change the reservation state, or
    /// run a COMPARE AND WRITE without the other's lock): the mirror's flush made alone
    /// succeeds (it needs quorum where a witness is set, and moves the data generation,
    /// so this node becomes the resync source and its state wins the next exchange),
    /// and the link is still down after it. `Err`: the flush's error, or WrongState
    /// when a new link came up meanwhile (the flush then reached both nodes and moved
    /// no generation).
    pub(super) async fn go_alone(&self, peer: &dyn ScsiPeer) -> Result<()> {
        peer.changed_alone().await?;
        if peer.link() != PeerLink::Away {
            return Err(Error::new(
                ErrorKind::WrongState,
                "the link to the other node came back while acting alone",
            ));
        }
        Ok(())
    }

    /// Whether a PERSISTENT RESERVE OUT that came in here (`raw` given) is made without
    /// the other node: it has one, and the link is down or this node is not the
    /// resolver (a command forwarded there comes back through `PrApply`, not here).
    pub(super) fn pr_out_alone(&self) -> Option<Arc<dyn ScsiPeer>> {
        self.peer()
            .filter(|p| p.link() == PeerLink::Away || !p.is_resolver())
    }

    /// The other node's part of a task management function (see
    /// [`LogicalUnit::task_management`]): `None` when there is none (no peer, or a
    /// function that acts on this node only), else a future that ends once the other
    /// node raised the function's unit attentions and aborts (or could not be reached).
    /// The transport sends the task management response after it.
    pub fn peer_task_management(
        &self,
        function: TaskFunction,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>> {
        if matches!(
            function,
            TaskFunction::AbortTaskSet | TaskFunction::ClearAca
        ) {
            return None;
        }
        let peer = self.peer()?;
        if peer.link() == PeerLink::Away {
            return None;
        }
        let msg = Msg::Reset(function).encode();
        Some(Box::pin(async move {
            if let Err(e) = peer.call(msg).await {
                warn!(function = ?function, "the other node did not take the task management function: {e}");
            }
        }))
    }

    /// The link to the other node now ([`ScsiPeer::link_id`]; 0 with no peer or none
    /// connected): what a command is admitted on when its reservation is checked.
    pub(super) fn peer_link_id(&self) -> u64 {
        self.peer.read().as_ref().map_or(0, |p| p.link_id())
    }

    /// A write admitted on link `admitted` is about to reach the device after a wait:
    /// refused (NOT READY, ASYMMETRIC ACCESS STATE TRANSITION: retry; nothing written)
    /// if a new link to the other node came up meanwhile. Its reservation was checked
    /// against this node's state of then, which the new link may replace with the
    /// other node's, moved on alone without this node: a PREEMPT AND ABORT made there
    /// fences the initiator, and what it sent before must not land after the fence.
    /// The retry is checked against the state the two settle on.
    pub(super) fn same_link(&self, admitted: u64) -> std::result::Result<(), super::exec::Fail> {
        let now = self.peer_link_id();
        if now != 0 && now != admitted {
            warn!(
                "a write admitted before the link to the other node came back is refused \
                 (retry): the reservation state may have moved on there"
            );
            return Err(super::exec::Fail::Check(sense::NOT_READY_TRANSITION));
        }
        Ok(())
    }

    /// The stripes of a write, shared (see [`super::lock`]), with none of its regions
    /// owned by the other node for COMPARE AND WRITE (owner.rs: revoked first). A write
    /// that waited is refused if a new link came up meanwhile ([`Self::same_link`]).
    pub(super) async fn write_stripes(
        &self,
        lba: u64,
        blocks: u64,
    ) -> std::result::Result<super::lock::Held<'_>, super::exec::Fail> {
        let Some(regions) = StripeLock::regions(lba, blocks) else {
            return Ok(super::lock::Held::None);
        };
        let mask = StripeLock::mask_of(regions);
        if let Some(held) = self.locks.try_shared_mask(mask) {
            if self.owner.granted(regions, mask).is_none() {
                return Ok(held);
            }
        }
        let admitted = self.peer_link_id();
        loop {
            let held = self.locks.shared_mask(mask).await;
            self.same_link(admitted)?;
            let Some(busy) = self.owner.granted(regions, mask) else {
                return Ok(held);
            };
            drop(held);
            self.revoke(busy).await.map_err(|e| {
                warn!(
                    "a write could not take its blocks back from the other node's COMPARE AND WRITE: {e}"
                );
                super::exec::Fail::Check(sense::from_error(e.kind(), sense::Access::Write))
            })?;
        }
    }

    /// Take `regions` back from the other node (owner.rs); with the link away or
    /// changed, what was granted on it is forgotten.
    async fn revoke(&self, (first, last): Regions) -> Result<()> {
        let Some(peer) = self.peer() else {
            self.owner.forget();
            return Ok(());
        };
        let link = peer.link_id();
        if peer.link() == PeerLink::Away {
            self.owner.forget();
            return Ok(());
        }
        let upto = self.owner.sending();
        match peer.call(Msg::Revoke { first, last, upto }.encode()).await {
            Err(_) if peer.link() == PeerLink::Away => self.owner.forget(),
            Err(e) if peer.link_id() == link => return Err(e),
            // Answered, or the link changed meanwhile (then nothing of it stays).
            _ => self
                .owner
                .revoked((first, last), upto, (link, peer.link_id())),
        }
        Ok(())
    }

    /// The stripes of a COMPARE AND WRITE: this node's exclusive, and the ownership of
    /// its regions across the pair (owner.rs: asked of the other node when this node
    /// does not own them yet). Returns the held stripes and the link the ownership
    /// belongs to, or, with the peer away, the link id after [`Self::go_alone`] (the
    /// CAW runs alone while it stays the same: a link that comes back changes it);
    /// `None` without a peer. `Err` when the other node failed the call (the command
    /// then fails: the other node may be writing there) or going alone failed.
    pub(super) async fn caw_stripes(
        &self,
        lba: u64,
        blocks: u64,
    ) -> Result<(super::lock::Held<'_>, Option<u64>)> {
        let Some(peer) = self.peer() else {
            return Ok((self.locks.exclusive(lba, blocks).await, None));
        };
        let regions = StripeLock::regions_of(lba, blocks.max(1));
        let (first, last) = regions;
        let mask = StripeLock::mask_of(regions);
        loop {
            let link = peer.link_id();
            let held = self.locks.exclusive_mask(mask).await;
            if peer.link() == PeerLink::Away {
                drop(held);
                self.go_alone(peer.as_ref()).await?;
                return Ok((self.locks.exclusive_mask(mask).await, Some(link)));
            }
            if self.owner.owns(regions, link) {
                return Ok((held, Some(link)));
            }
            // The other node's stripes first, the resolver's second: the other node
            // asks holding its own (the resolver's grant waits for nothing of it), the
            // resolver lets its own go while it asks (the other node's grant waits for
            // the other node's CAW, which may wait for this node's grant).
            let held = (!peer.is_resolver()).then_some(held);
            let sent = self.owner.sending();
            let msg = Msg::Lock {
                first,
                last,
                counter: sent,
            };
            match peer.call(msg.encode()).await {
                Ok(answer) => {
                    let grant = <[u8; 8]>::try_from(&answer[..])
                        .map(u64::from_be_bytes)
                        .map_err(|_| bad("a grant's number"))?;
                    let owned = self.owner.taken(
                        regions,
                        (sent, grant),
                        (link, peer.link_id()),
                        peer.is_resolver(),
                    );
                    if let (true, Some(held)) = (owned, held) {
                        return Ok((held, Some(link)));
                    }
                }
                Err(e) if peer.link() == PeerLink::Away => {
                    warn!("COMPARE AND WRITE: the other node went away while granting ({e})");
                }
                Err(e) if peer.link_id() != link => {
                    warn!("COMPARE AND WRITE: the link changed while asking the other node ({e})");
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_garbage_is_refused() {
        let nexus = Nexus {
            initiator_port: "iqn.x,i,0x1".into(),
            transport_id: Bytes::from_static(b"tid"),
            relative_target_port: 2,
        };
        for m in [
            Msg::Reset(TaskFunction::LunReset),
            Msg::PrOut {
                from: nexus.clone(),
                cdb: Bytes::from_static(&[0x5f, 0, 0, 0, 0, 0, 0, 0, 24, 0]),
                data: Bytes::from_static(&[1; 24]),
                token: 7,
            },
            Msg::PrApply {
                from: nexus,
                cdb: Bytes::new(),
                data: Bytes::new(),
                token: 0,
            },
            Msg::PrGet,
            Msg::PrInstall(Bytes::from_static(b"state")),
            Msg::PrKept,
            Msg::Lock {
                first: 1 << 40,
                last: (1 << 40) + 1,
                counter: 3,
            },
            Msg::Revoke {
                first: 9,
                last: 9,
                upto: 2,
            },
            Msg::Scsi2 {
                reserve: true,
                from: Nexus {
                    initiator_port: "i".into(),
                    transport_id: Bytes::new(),
                    relative_target_port: 1,
                },
            },
            Msg::Scsi2Holder(None),
            Msg::Settle,
        ] {
            let enc = m.encode();
            assert_eq!(Msg::decode(enc.clone()).unwrap(), m);
            for cut in 0..enc.len() {
                assert!(Msg::decode(enc.slice(..cut)).is_err(), "{m:?} cut at {cut}");
            }
            let mut long = enc.to_vec();
            long.push(0);
            assert!(Msg::decode(long.into()).is_err());
        }
        assert!(Msg::decode(Bytes::from_static(&[99])).is_err());
        for r in [
            Ok(()),
            Err(PrError::Conflict),
            Err(PrError::Check(sense::INTERNAL_FAILURE)),
            Err(PrError::Check(sense::MISCOMPARE_VERIFY.with_information(7))),
        ] {
            assert_eq!(decode_pr_result(encode_pr_result(&r)).unwrap(), r);
        }
    }
}
