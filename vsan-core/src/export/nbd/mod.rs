//! NBD export: serve any [`BlockDevice`](crate::BlockDevice) to NBD clients (qemu, fio's
//! nbd engine, nbdcopy, nbdinfo, the Linux kernel client), over TCP or Unix sockets.
//!
//! ```text
//!   client ──TCP/Unix──> Server::serve_tcp / serve_unix
//!                           │ one task per connection
//!                           ├─ handshake: fixed newstyle; OPT_GO, OPT_INFO, OPT_LIST,
//!                           │             OPT_EXPORT_NAME, OPT_ABORT (others: ERR_UNSUP)
//!                           └─ transmission: READ, WRITE (+FUA), FLUSH, TRIM,
//!                                            WRITE_ZEROES, DISC; many requests in
//!                                            flight, replies in completion order
//! ```
//!
//! Guarantees:
//! - A FLUSH completes after every write already replied to, on any connection to the
//!   same export, is durable (`NBD_FLAG_CAN_MULTI_CONN` is advertised).
//! - Malformed input never takes the server down: a malformed request with a trustworthy
//!   header gets an error reply (EINVAL, ENOSPC, EPERM); a header that cannot be trusted
//!   (bad magic, an absurd write length) or garbage during negotiation ends that one
//!   connection. Other clients carry on.
//! - [`Server::shutdown`] stops accepting and reading; requests already received finish
//!   and are answered before each connection closes ([`Server::wait_idle`]).
//!
//! ```no_run
//! # async fn demo() -> vsan_core::Result<()> {
//! use std::sync::Arc;
//! use vsan_core::export::nbd::{Export, Server};
//! use vsan_core::{Geometry, MemDevice};
//!
//! let disk = Arc::new(MemDevice::new(Geometry::new(64 << 20, 512)?));
//! let server = Server::new(vec![Export::new("vol0", disk)])?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:10809").await?;
//! server.serve_tcp(listener).await
//! # }
//! ```

mod client;
mod handshake;
pub mod proto;
mod server;

pub use client::{Client, ExportInfo, negotiate};
pub use server::{Export, Server, Stream};
