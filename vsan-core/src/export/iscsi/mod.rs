//! iSCSI export (RFC 7143): serve any [`BlockDevice`](crate::BlockDevice), through a
//! [`scsi::LogicalUnit`](crate::scsi::LogicalUnit), to iSCSI initiators (ESXi, Windows,
//! open-iscsi, libiscsi, QEMU).
//!
//! SKELETON: the API the node is written against; filled in by the iSCSI work.

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
    Chap, ChapPair, Server, ServerOptions, ServerStats, SessionInfo, Target, valid_iscsi_name,
};
