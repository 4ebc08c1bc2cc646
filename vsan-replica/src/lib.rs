//! # vsan-replica
//!
//! Two-way synchronous mirroring: `MirroredDisk`, a
//! [`BlockDevice`](vsan_core::BlockDevice) that writes every request to the local replica
//! and the peer's at once and completes it only when both have it (protocol C), serves
//! reads locally, and lets both nodes write the same disk at the same time.
//!
//! - [`protocol`]: the sans-IO state machine (handshake, protocol C writes, resync,
//!   verify, split brain, quorum, and freshness: after a start a replica is served only
//!   once proven current, see [`protocol::Freshness`]), tested through every
//!   interleaving of message delivery and local I/O completion;
//! - `MirroredDisk`: the tokio driver around it; [`meta`]: the on-disk metadata;
//!   [`wire`] and [`transport`]: the replication frames and links; [`connect`]: dialing
//!   and accepting; [`witness`]: the quorum witness client;
//! - `mgmt` (feature `mgmt`): the gRPC management API, `vsan.mgmt.v1`.
//! - [`failpoints`] (feature `failpoints`): fail points at the driver's I/O edges, for
//!   tests that drive the error paths.
#![deny(missing_docs)]

pub mod connect;
pub mod failpoints;
pub mod meta;
#[cfg(feature = "mgmt")]
pub mod mgmt;
mod mirror;
pub mod protocol;
pub mod transport;
pub mod wire;
pub mod witness;

pub use mirror::{
    MirrorStatus, MirroredDisk, Replica, ScsiFuture, ScsiHandler, Serving, SyncStart, meta_params,
};
