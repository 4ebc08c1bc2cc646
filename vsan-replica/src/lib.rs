//! # vsan-replica (not yet implemented)
//!
//! This crate will hold `MirroredDisk`: a [`BlockDevice`](vsan_core::BlockDevice) that
//! mirrors every write synchronously to a peer node (protocol C), serves reads from the
//! local replica, tracks dirty chunks while the peer is away and resyncs only what
//! changed. See `DESIGN.md` ("vsan-replica") for the plan.
//!
//! **Status:** nothing here works yet. The crate exists so the workspace has its final
//! shape; it exports no types, and nothing pretends otherwise.
#![deny(missing_docs)]

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
