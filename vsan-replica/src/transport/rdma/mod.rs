//! RDMA links (rdma-core verbs), falling back to TCP.
