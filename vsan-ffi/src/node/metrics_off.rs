//! The metrics endpoint in a build without it (cargo feature `metrics` off): the types
//! the node names, none of which can exist, so a node of this build never serves
//! metrics. A config with `node.metrics` is refused before anything starts.

use std::sync::Arc;

use vsan_core::BlockDevice;

use super::{NodeDisk, StartError};

/// Never made: see the module doc.
#[derive(Debug)]
pub enum NodeMetrics {}

impl NodeMetrics {
    /// Refuses: this build serves no metrics.
    pub async fn bind(addr: &str) -> Result<NodeMetrics, StartError> {
        let _ = addr;
        Err(super::start::feature_off(
            "node.metrics",
            "metrics endpoint",
            "metrics",
        ))
    }

    /// (Never called: no value exists.)
    pub fn address(&self) -> &str {
        match *self {}
    }

    /// (Never called: no value exists.)
    pub fn wrap(&self, _disk: &str, _device: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
        match *self {}
    }

    /// (Never called: no value exists.)
    pub fn meters(&self) -> &DiskMeters {
        match *self {}
    }

    /// (Never called: no value exists.)
    pub fn serve(
        self,
        _disks: impl Fn() -> Vec<NodeDisk> + Send + Sync + 'static,
    ) -> MetricsEndpoint {
        match self {}
    }
}

/// Never made: see the module doc.
#[derive(Debug, Clone)]
pub enum DiskMeters {}

// Only the management service reads the meters.
#[cfg_attr(not(feature = "mgmt"), allow(dead_code))]
impl DiskMeters {
    /// (Never called: no value exists.)
    pub fn wrap(&self, _disk: &str, _device: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
        match *self {}
    }

    /// (Never called: no value exists.)
    pub fn forget(&self, _disk: &str) {
        match *self {}
    }
}

/// Never made: see the module doc.
#[derive(Debug)]
pub enum MetricsEndpoint {}

impl MetricsEndpoint {
    /// (Never called: no value exists.)
    pub fn address(&self) -> &str {
        match *self {}
    }

    /// (Never called: no value exists.)
    pub async fn stop(self) {
        match self {}
    }
}
