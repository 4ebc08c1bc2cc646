//! Protocols that export a [`BlockDevice`](crate::BlockDevice) to clients outside the
//! process.

pub mod iscsi;
pub mod nbd;
#[cfg(target_os = "linux")]
pub mod vhost_user;
