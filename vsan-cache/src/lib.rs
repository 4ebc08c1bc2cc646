//! # vsan-cache (on-media format only)
//!
//! This crate will hold `WriteBackCache`: a log-structured write-back cache on a fast
//! device (persistent memory or an NVMe file mapped with memmap2) in front of any backing
//! [`BlockDevice`](vsan_core::BlockDevice), with group commit, ordered destage and crash
//! recovery. See `DESIGN.md` ("vsan-cache") for the plan.
//!
//! **Status:** only the on-media format exists: [`format`](mod@format) encodes and
//! decodes the superblock and log records and scans a log after a crash, as pure functions
//! over byte slices. There is no `WriteBackCache` yet and no I/O.
#![deny(missing_docs)]

pub mod format;

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
