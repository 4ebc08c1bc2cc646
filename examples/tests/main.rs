//! The tests that run `vsan-node` and the other programs as real processes, with the
//! outside tools they drive (qemu, nbdkit's tools, fio, libiscsi, gcc, go, ...): one
//! test binary, a module per subject, so the harness in `common` and the dependencies
//! are compiled and linked once rather than once per file. Run one subject with
//! `cargo test --release -p vsan-examples --test nodes <module>::`.

mod common;

mod c_api;
mod cache_node;
mod demo;
mod freshness;
mod go_api;
mod interop;
mod iscsi_cluster;
mod iscsi_conformance;
mod iscsi_interop;
mod iscsi_multipath;
mod iscsi_node;
mod metrics;
mod mgmt;
mod mgmt_disks;
mod mgmt_refusals;
mod mirror_nodes;
mod node_config;
mod replication_garbage;
mod resync_nodes;
mod scaling;
mod split_brain;
mod transports;
mod vhost_guest;
mod vhost_node;
mod witness;
