//! # vsan-replica (in progress)
//!
//! Two-way synchronous mirroring: `MirroredDisk`, a
//! [`BlockDevice`](vsan_core::BlockDevice) that writes every request to the local replica
//! and the peer's at once and completes it only when both have it (protocol C), serves
//! reads locally, and lets both nodes write the same disk at the same time.
//! See `DESIGN.md` ("vsan-replica") for the whole plan.
//!
//! **Status:** the sans-IO protocol ([`protocol`]) works and is tested by driving two
//! endpoints through every interleaving of message delivery and local I/O completion:
//! handshake checks, protocol C writes, flush and FUA on both nodes, active-active
//! ordering with a resolver, peer loss (degraded), local disk detach. The wire codec,
//! transports, the tokio driver and `MirroredDisk` itself are not here yet.
#![deny(missing_docs)]

pub mod connect;
pub mod meta;
mod mirror;
pub mod protocol;
pub mod transport;
pub mod wire;
pub mod witness;

pub use mirror::{MirrorStatus, MirroredDisk, Replica, SyncStart, meta_params};

#[cfg(test)]
mod tests {
    /// The mirror stacks on any `BlockDevice`; this checks the dependency is wired so the
    /// crate can name the trait it will implement.
    #[test]
    fn core_trait_is_reachable() {
        fn takes_device(_: &dyn vsan_core::BlockDevice) {}
        let g = vsan_core::Geometry::new(4096, 512).unwrap();
        takes_device(&vsan_core::MemDevice::new(g));
    }
}
