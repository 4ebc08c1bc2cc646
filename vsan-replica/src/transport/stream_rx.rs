//! The receiving half every byte-stream link (tcp, shm, quic) shares.
//!
//! ```text
//!   recv ──▶ decode the buffer ──(a whole frame)──▶ Message
//!              │ not all there yet          │ the codec refuses it
//!              ▼                            ▼
//!            fill (the source waits)      distrust (the link as a whole ends) ──▶ Protocol
//! ```
//!
//! [`StreamRx`] is the [`LinkRx`] of all three: it decodes frames with the one codec from
//! a buffer the transport's [`StreamSource`] fills, treats a frame the codec refuses as
//! the end of the peer's trust, and remembers the first error for every later call. Decoded
//! data are slices of that buffer, not copies.

use std::future::Future;
use std::time::Duration;

use bytes::BytesMut;
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::stream_tx::{StreamSink, StreamTx};
use super::{Link, LinkRx, remember};
use crate::wire::{self, Message};

/// A link over a byte stream: the shared sending half over `sink` (holding senders back
/// above `send_queue_limit` bytes, closing within `close_timeout`) and the shared
/// receiving half over `source`, `received` already read from it.
pub(super) fn stream_link(
    sink: impl StreamSink,
    source: impl StreamSource,
    received: BytesMut,
    send_queue_limit: usize,
    close_timeout: Duration,
) -> Link {
    let tx = StreamTx::new(
        sink,
        source.peer().to_string(),
        send_queue_limit,
        close_timeout,
    );
    let rx = StreamRx::new(source, received);
    Link::new(Box::new(tx), Box::new(rx))
}

/// What a byte-stream transport supplies to [`StreamRx`]: its end of the stream.
///
/// Errors a source returns are final for the link; they carry the link's peer in their
/// text, as the transport words them.
pub(super) trait StreamSource: Send + Sync + Sized + std::fmt::Debug + 'static {
    /// The peer, for errors and [`LinkRx::peer`] ("tcp:10.0.0.2:7002").
    fn peer(&self) -> &str;

    /// Appends to `buf` what the stream has, waiting until it has something. The end of
    /// the stream is an error ([`Closed`](ErrorKind::Closed) when the peer ended it;
    /// `buf` then holds the part of a frame that never finished, if any).
    fn fill(&mut self, buf: &mut BytesMut) -> impl Future<Output = Result<()>> + Send;

    /// The peer sent a frame the codec refuses (`err`): it is never trusted again, so the
    /// link as a whole ends (the sending half fails too, and the peer sees the end).
    fn distrust(&mut self, err: &Error);
}

/// The [`LinkRx`] of a byte-stream link: frames decoded from what its source reads.
#[derive(Debug)]
pub(super) struct StreamRx<S: StreamSource> {
    source: S,
    /// Received bytes not yet decoded; decoded data are slices of it.
    buf: BytesMut,
    /// The first error; every later `recv` reports it.
    failed: Option<(ErrorKind, String)>,
}

impl<S: StreamSource> StreamRx<S> {
    /// A receiving half over `source`, `received` already read from it (bytes the
    /// handshake read past its end).
    pub(super) fn new(source: S, received: BytesMut) -> Self {
        StreamRx {
            source,
            buf: received,
            failed: None,
        }
    }

    async fn next(&mut self) -> Result<Message> {
        loop {
            if let Some(m) = self.buffered() {
                return m;
            }
            if let Err(err) = self.source.fill(&mut self.buf).await {
                return Err(self.fail(err));
            }
        }
    }

    /// The next message from what was already read (the first error again once the
    /// link failed); `None` when the buffer holds no whole frame.
    fn buffered(&mut self) -> Option<Result<Message>> {
        if let Some((kind, context)) = &self.failed {
            return Some(Err(Error::new(*kind, context.clone())));
        }
        match wire::decode(&mut self.buf) {
            Ok(Some(msg)) => Some(Ok(msg)),
            Ok(None) => None,
            Err(e) => {
                let err = Error::with_source(
                    ErrorKind::Protocol,
                    format!("{}: received a bad frame", self.source.peer()),
                    e,
                );
                self.source.distrust(&err);
                Some(Err(self.fail(err)))
            }
        }
    }

    fn fail(&mut self, err: Error) -> Error {
        self.failed = Some(remember(&err));
        err
    }
}

impl<S: StreamSource> LinkRx for StreamRx<S> {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(self.next())
    }

    fn try_recv(&mut self) -> Option<Result<Message>> {
        self.buffered()
    }

    fn peer(&self) -> &str {
        self.source.peer()
    }
}

/// The peer ended a socket's stream (tcp, quic) with `buffered` bytes of a frame that
/// never finished.
pub(super) fn peer_closed(peer: &str, buffered: usize) -> Error {
    if buffered == 0 {
        return Error::new(ErrorKind::Closed, format!("{peer}: peer closed the link"));
    }
    Error::new(
        ErrorKind::Closed,
        format!(
            "{peer}: peer closed the link in the middle of a frame ({buffered} bytes of it received)"
        ),
    )
}
