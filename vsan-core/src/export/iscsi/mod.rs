//! iSCSI export (RFC 7143): serve any [`BlockDevice`](crate::BlockDevice), through a
//! [`scsi::LogicalUnit`](crate::scsi::LogicalUnit), to iSCSI initiators (ESXi, Windows,
//! open-iscsi, libiscsi, QEMU).
//!
//! ```text
//!   initiator ──TCP──> Server::serve_tcp          one task per connection (session.rs)
//!                        │ login (login.rs, keys.rs, chap.rs): security (None, CHAP
//!                        │   MD5/SHA-256, mutual), operational negotiation of every key
//!                        │ discovery session: SendTargets (text.rs), NOP, Logout
//!                        └ normal session: LUN 0 = the target's LogicalUnit
//!                            SCSI Command ─ CmdSN order ─> inspect ─ data-out (immediate,
//!                            unsolicited, R2T) ─> LogicalUnit::execute ─> Data-In (status
//!                            collapsed) / SCSI Response, in completion order
//!                            Task Management, NOP-In pings, Text, Logout, Reject
//! ```
//!
//! What it does and does not do:
//! - One connection per session (MaxConnections=1) and error recovery level 0: a broken
//!   data sequence fails its command (ABORTED COMMAND, 4B/xx); a header that cannot be
//!   trusted ends the connection; the initiator recovers by logging in again, and a new
//!   login from the same initiator port reinstates (closes) the old session.
//! - Header and data digests (CRC32C) when negotiated.
//! - Backpressure: a connection stops reading while 8 MiB of replies wait or its tasks
//!   hold 64 MiB of data buffers; beyond that a new command gets TASK SET FULL.
//! - [`Server::shutdown`] stops accepting and reading; commands already received finish
//!   and are answered ([`Server::wait_idle`]).
//! - The PDU codec (`pdu`) and the login (`login`) are sans-IO and total: any bytes give
//!   a PDU, a Reject or a clean close, never a panic (fuzzed: `vsan-core/fuzz`).
//!
//! ```no_run
//! # async fn demo() -> vsan_core::Result<()> {
//! use std::sync::Arc;
//! use vsan_core::export::iscsi::{Server, Target};
//! use vsan_core::scsi::{LogicalUnit, LuConfig, LuIdentity, TargetPort};
//! use vsan_core::{Geometry, MemDevice};
//!
//! let iqn = "iqn.2026-12.io.vsan:vol0";
//! let disk = Arc::new(MemDevice::new(Geometry::new(64 << 20, 512)?));
//! let lu = LogicalUnit::new(disk, LuConfig {
//!     identity: LuIdentity::from_disk_id("vol0"),
//!     port: TargetPort { name: format!("{iqn},t,0x0001"), relative_id: 1, group: 1 },
//!     read_only: false,
//!     state_file: None,
//! })?;
//! let server = Server::new(vec![Target::new(iqn, lu)])?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3260").await?;
//! server.serve_tcp(listener).await
//! # }
//! ```

pub mod chap;
#[cfg(feature = "test-utils")]
#[doc(hidden)]
pub mod fuzzing;
pub mod keys;
pub mod login;
pub mod pdu;
mod server;
mod session;
pub mod text;

pub use server::{
    Chap, ChapPair, MAX_ISCSI_NAME, Server, ServerOptions, ServerStats, SessionInfo, Target,
    check_iscsi_name,
};
