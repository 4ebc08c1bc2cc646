//! Protocols that export a [`BlockDevice`](crate::BlockDevice) to clients outside the
//! process.

pub mod iscsi;
pub mod nbd;
