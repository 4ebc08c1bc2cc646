//! The loopback fast path for peers on one host, bypassing the TCP stack.
//!
//! Two forms behind one [`LoopbackTransport`], chosen by the address:
//! - `"inproc:NAME"`: both replicas in one process ([`inproc`]): messages are passed by
//!   value, data by reference, no encoding, no copy, no system call per message.
//! - an absolute path (`"/run/vsan/r0.sock"`): replicas in two processes
//!   ([`shm`]): shared-memory rings set up over a Unix socket at that path, with a
//!   doorbell only for a side that sleeps.
//!
//! Both can busy-poll ([`LoopbackConfig::busy_poll`]): a receiver that finds nothing
//! keeps looking for a while before it sleeps, so a message to it costs no wake-up.
//! On a machine where waking a sleeping thread costs tens of microseconds, that, more
//! than the copies saved, is what makes this path fast; the price is a core that spins
//! while the link is idle for up to that long after each message.

use std::time::Duration;

use vsan_core::IoFuture;

use super::{Link, Listener, Transport};

pub mod inproc;
pub mod shm;

use inproc::{InProcConfig, InProcTransport};
use shm::{ShmConfig, ShmTransport};

/// Settings of a [`LoopbackTransport`]. Start from `LoopbackConfig::default()`.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct LoopbackConfig {
    /// Busy-poll for this long before sleeping (both forms). Default: none.
    pub busy_poll: Option<Duration>,
    /// Settings of the in-process form (its `busy_poll` is replaced by the one above).
    pub inproc: InProcConfig,
    /// Settings of the shared-memory form (its `busy_poll` is replaced by the one above).
    pub shm: ShmConfig,
}

/// Links between replicas on one host: in one process or over shared memory. See the
/// [module docs](self).
#[derive(Debug, Clone)]
pub struct LoopbackTransport {
    inproc: InProcTransport,
    shm: ShmTransport,
}

impl Default for LoopbackTransport {
    fn default() -> LoopbackTransport {
        LoopbackTransport::with_config(LoopbackConfig::default())
    }
}

impl LoopbackTransport {
    /// A transport with the default settings (no busy-poll).
    pub fn new() -> LoopbackTransport {
        LoopbackTransport::default()
    }

    /// A transport with `config`.
    pub fn with_config(mut config: LoopbackConfig) -> LoopbackTransport {
        config.inproc.busy_poll = config.busy_poll;
        config.shm.busy_poll = config.busy_poll;
        LoopbackTransport {
            inproc: InProcTransport::with_config(config.inproc),
            shm: ShmTransport::with_config(config.shm),
        }
    }

    fn pick(&self, addr: &str) -> &dyn Transport {
        if addr.starts_with('/') {
            &self.shm
        } else {
            &self.inproc
        }
    }
}

impl Transport for LoopbackTransport {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        self.pick(addr).connect(addr)
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        self.pick(addr).listen(addr)
    }
}
