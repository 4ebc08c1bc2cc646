//! The loopback fast path for peers on one host: in-process and shared memory.

pub mod shm;
