//! # vsan-cache (not yet implemented)
//!
//! This crate will hold `WriteBackCache`: a log-structured write-back cache on a fast
//! device (persistent memory or an NVMe file mapped with memmap2) in front of any backing
//! [`BlockDevice`](vsan_core::BlockDevice), with group commit, ordered destage and crash
//! recovery. See `DESIGN.md` ("vsan-cache") for the plan.
//!
//! **Status:** nothing here works yet. The crate exists so the workspace has its final
//! shape; it exports no types, and nothing pretends otherwise.
#![deny(missing_docs)]

#[cfg(test)]
mod tests {
    /// The cache sits in front of any `BlockDevice`; this checks the dependency is wired.
    #[test]
    fn core_trait_is_reachable() {
        fn takes_device(_: &dyn vsan_core::BlockDevice) {}
        let g = vsan_core::Geometry::new(4096, 512).unwrap();
        takes_device(&vsan_core::MemDevice::new(g));
    }
}
