//! Shared pieces of the vsan example programs (`vsan-node`, `vsan-demo`, `vsan-bench`).
#![deny(missing_docs)]
pub mod config;
pub mod latency;
pub mod pattern;
