//! # vsan-core
//!
//! The foundation of vsan: the [`BlockDevice`] trait every layer implements, the devices
//! that sit at the bottom of a stack, and the exports that serve any of them: NBD, and
//! iSCSI over the SCSI command layer in [`scsi`].
//!
//! ```text
//!  NBD clients (qemu, fio, nbdcopy, kernel)   iSCSI initiators (ESXi, Windows, libiscsi)
//!            |                                      |
//!   export::nbd::Server          export::iscsi::Server -> scsi::LogicalUnit
//!            |                                      |            Rust callers, vsan-ffi
//!            +------------- Arc<dyn BlockDevice> ---+----------------------+
//!                                  |
//!        MemDevice | FileDevice | FaultyDevice<D> (feature "test-utils")
//!        (later layers: vsan-cache's WriteBackCache, vsan-replica's MirroredDisk)
//! ```
//!
//! Main types: [`BlockDevice`], [`Geometry`], [`IoFlags`], [`Error`] / [`ErrorKind`],
//! [`MemDevice`], [`FileDevice`], [`export::nbd::Server`], [`export::iscsi::Server`] and
//! [`scsi::LogicalUnit`].
//!
//! ```
//! use bytes::Bytes;
//! use vsan_core::{BlockDevice, ErrorKind, Geometry, IoFlags, MemDevice};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let disk = MemDevice::new(Geometry::new(1 << 20, 512)?);
//! disk.write(4096, Bytes::from(vec![0xa5; 4096]), IoFlags::FUA).await?;
//! assert_eq!(disk.read(4096, 4096).await?, vec![0xa5; 4096]);
//! // Bad input is refused with a kind the caller can match, and changes nothing.
//! let err = disk.write(100, Bytes::from(vec![1; 512]), IoFlags::empty()).await.unwrap_err();
//! assert_eq!(err.kind(), ErrorKind::InvalidArgument);
//! # Ok::<(), vsan_core::Error>(()) }).unwrap();
//! ```
#![deny(missing_docs)]

#[cfg(feature = "test-utils")]
pub mod corpus;
pub mod device;
pub mod error;
pub mod export;
#[cfg(feature = "test-utils")]
#[doc(hidden)]
pub mod fuzzing;
pub mod le;
pub mod plug;
pub mod scsi;

pub use device::{
    BlockDevice, FileDevice, FileOptions, Geometry, IoFlags, IoFuture, MemDevice, Op,
};
#[cfg(feature = "test-utils")]
pub use device::{FaultConfig, FaultyDevice, OpKind, PowerCut};
pub use error::{Error, ErrorKind, Result};
