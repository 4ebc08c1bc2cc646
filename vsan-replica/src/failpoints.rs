//! Fail points at the mirror driver's I/O edges, for tests that drive the error paths
//! (the model is tikv/raft-engine's): `fail::fail_point!`s compiled in only with the
//! `failpoints` feature. Without it nothing of them is compiled in; with it, a point
//! nobody configured costs one lookup in the fail crate's registry.
//!
//! The mirror driver evaluates a point when it issues the operation, before anything
//! reaches a device, or when it takes a message off the link:
//!
//! | name                   | where                                                   | action `return` |
//! |------------------------|---------------------------------------------------------|-----------------|
//! | `meta::write`          | a metadata write ([`LocalIo::Meta`]) holding a superblock or an activity-log record | the whole metadata write fails with `Io`, nothing of it written: the endpoint marks the metadata failed and detaches the local replica |
//! | `meta::bitmap_persist` | a metadata write holding bitmap blocks (degraded writes' bits, a resync's cleared bits, a distrusted replica's full bitmap); evaluated before `meta::write` | as `meta::write` |
//! | `local::write`         | a write, write-zeroes or discard to the local data replica (own writes, the peer's writes applied here, resync copies) | it fails with `Io`, the device untouched: the replica is detached and I/O goes through the peer |
//! | `local::flush`         | a flush of the local data replica (own flushes, the peer's flushes) | it fails with `Io`: as `local::write` |
//! | `mirror::recv_ack`     | a `WriteAck` or `FlushAck` the driver received from the peer | the ack is dropped before the endpoint sees it: the request waits for it until the peer timeout declares the peer lost |
//!
//! `return` fires in every node's driver in the process; `return(N)` only in node `N`'s
//! (two mirrored disks in one test process share the points). An argument that is not a
//! node id counts as none. A count (`2*return(1)`) counts the evaluations of every node.
//! The points are synchronous: `sleep` and `pause` block the runtime worker thread that
//! evaluates them.
//!
//! The points are process-global: configure them with `fail::cfg` inside a
//! `fail::FailScenario` (which serializes the tests that hold one), or through the
//! `FAILPOINTS` environment variable. `proptests/tests/failpoints.rs` drives each one.
//!
//! [`LocalIo::Meta`]: crate::protocol::LocalIo::Meta

/// A metadata write holding a superblock or activity-log record.
pub const META_WRITE: &str = "meta::write";
/// A metadata write holding bitmap blocks.
pub const META_BITMAP_PERSIST: &str = "meta::bitmap_persist";
/// A write (or write-zeroes, discard) to the local data replica.
pub const LOCAL_WRITE: &str = "local::write";
/// A flush of the local data replica.
pub const LOCAL_FLUSH: &str = "local::flush";
/// A write or flush acknowledgement from the peer.
pub const MIRROR_RECV_ACK: &str = "mirror::recv_ack";

#[cfg(feature = "failpoints")]
pub(crate) use points::Site;

#[cfg(feature = "failpoints")]
mod points {
    use vsan_core::ErrorKind;

    use super::*;
    use crate::meta::Layout;
    use crate::protocol::{LocalIo, LocalOpId, Message};

    /// One node's driver, as its points see it: the node, and where the bitmap starts in
    /// its metadata area (what tells a bitmap block from a superblock or log record).
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Site {
        node: u32,
        bitmap_offset: u64,
    }

    impl Site {
        pub(crate) fn new(node: u32, layout: &Layout) -> Site {
            Site {
                node,
                bitmap_offset: layout.bitmap_offset(),
            }
        }

        /// The failure a point injects into `io` instead of running it, if one fires.
        pub(crate) fn local_io(&self, io: &LocalIo) -> Option<(LocalOpId, ErrorKind)> {
            let (op, fired) = match io {
                LocalIo::Write { op, .. } => (op, self.fires(LOCAL_WRITE)),
                LocalIo::Flush { op } => (op, self.fires(LOCAL_FLUSH)),
                LocalIo::Read { .. } => return None,
                LocalIo::Meta { op, writes, .. } => {
                    let at = |bitmap: bool| {
                        writes
                            .iter()
                            .any(|(o, _)| (*o >= self.bitmap_offset) == bitmap)
                    };
                    let fired = at(true) && self.fires(META_BITMAP_PERSIST)
                        || at(false) && self.fires(META_WRITE);
                    (op, fired)
                }
            };
            fired.then_some((*op, ErrorKind::Io))
        }

        /// Whether `mirror::recv_ack` drops `m`, a message from the peer.
        pub(crate) fn ack_lost(&self, m: &Message) -> bool {
            matches!(m, Message::WriteAck { .. } | Message::FlushAck { .. })
                && self.fires(MIRROR_RECV_ACK)
        }

        /// Whether point `name` is set to `return` for this node.
        fn fires(&self, name: &str) -> bool {
            let node = self.node;
            fail::fail_point!(name, |arg: Option<String>| {
                match arg.as_deref().map(str::trim) {
                    Some(a) if !a.is_empty() => a.parse::<u32>().map_or(true, |n| n == node),
                    _ => true,
                }
            });
            false
        }
    }
}
