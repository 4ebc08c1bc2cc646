//! The mirror protocol as a sans-IO state machine: no sockets, no clock, no tokio.
//!
//! ```text
//!   caller ── submit_write / submit_flush / submit_read ──┐
//!   driver ── handle_connected / handle_message /         │      ┌── poll_transmit  → link
//!             handle_local_done / handle_timeout(now) ────┼─> Endpoint ── poll_local_io → local replica
//!                                                         │      ├── poll_event     → completions, state
//!                                                         │      └── poll_timeout   → driver's timer
//! ```
//!
//! [`Endpoint`] holds one node's half of one mirrored disk. The driver (a tokio task)
//! pumps it; tests drive two endpoints against each other in one thread with full control
//! over message delivery and local I/O completion (see the `tests` module).

mod endpoint;
pub(crate) mod fastmap;
pub mod generations;
mod ranges;

#[cfg(test)]
mod tests;

pub use endpoint::{
    Awaiting, Config, Endpoint, Event, Freshness, LinkState, LocalIo, LocalOpId, LocalResult,
    Proof, QuorumPolicy, RequestId, ResyncConfig, ResyncRate, StartupPolicy, SyncKind,
    SyncProgress, SyncRole, SyncSummary,
};
// The messages live beside the wire format, below the protocol and the transports;
// these are their paths from the protocol's side.
pub use crate::wire::message;
pub use message::{
    DiskId, GEN_JUST_CREATED, Generations, Hello, Message, PROTOCOL_VERSION, SplitBrainPolicy,
    Status, WritePayload,
};
