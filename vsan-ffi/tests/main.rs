//! The node and C ABI tests of vsan-ffi: one test binary, a module per subject, so the
//! shared harness and the dependencies are compiled and linked once.

mod common;

mod api;
mod header;
mod iscsi_node;
mod iscsi_node_config;
