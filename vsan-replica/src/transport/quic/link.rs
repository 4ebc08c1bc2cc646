//! A QUIC link: one bidirectional stream; its sending half is the shared
//! [`StreamTx`] over a [`QuicSink`], its receiving half decodes frames from the stream.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use quinn::{Connection, ConnectionError, Endpoint, RecvStream, SendStream, StoppedError, VarInt};
use tokio::sync::Notify;
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::errors::{connection_error, read_error, write_error};
use super::{
    CODE_ABANDONED, CODE_BAD_FRAME, CODE_DONE, MAX_BATCH_BYTES, MAX_CHUNKS, QuicConfig,
    READ_CHUNKS, READ_RESERVE,
};
use crate::transport::stream_tx::{StreamSink, StreamTx};
use crate::transport::{Link, LinkRx, remember};
use crate::wire;
use crate::wire::Message;

/// What both halves of a link share: the connection, and the first fatal error.
#[derive(Debug)]
pub(super) struct LinkShared {
    conn: Connection,
    /// The dialer's own UDP endpoint, kept as long as the link.
    _endpoint: Option<Endpoint>,
    /// Set when the receive half found the peer untrustworthy; both halves report it.
    fatal: Mutex<Option<(ErrorKind, String)>>,
}

impl LinkShared {
    /// The error that ends the whole link, if it has ended.
    fn ended(&self, what: impl FnOnce() -> String) -> Option<(ErrorKind, String)> {
        if let Some(fatal) = &*self.fatal.lock() {
            return Some(fatal.clone());
        }
        self.conn
            .close_reason()
            .map(|e| remember(&connection_error(&e, &what())))
    }
}

pub(super) fn make_link(
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    endpoint: Option<Endpoint>,
    peer: String,
    config: &QuicConfig,
) -> Link {
    let link = Arc::new(LinkShared {
        conn,
        _endpoint: endpoint,
        fatal: Mutex::new(None),
    });
    let sink = QuicSink {
        link: Arc::clone(&link),
        send: Mutex::new(Some(send)),
        abandon: Notify::new(),
        peer: peer.clone(),
    };
    let tx = StreamTx::new(
        sink,
        peer.clone(),
        config.send_queue_limit,
        config.close_timeout,
    );
    let rx = QuicRx {
        link,
        recv,
        buf: BytesMut::new(),
        failed: None,
        peer,
    };
    Link::new(Box::new(tx), Box::new(rx))
}

/// The QUIC end of a link's sending half: the link's one stream.
#[derive(Debug)]
pub(super) struct QuicSink {
    link: Arc<LinkShared>,
    /// The stream; the writer task takes it out while it writes.
    send: Mutex<Option<SendStream>>,
    /// Tells a writer in the middle of a write to reset the stream (`close` timed out).
    abandon: Notify,
    peer: String,
}

impl StreamSink for QuicSink {
    const TRANSPORT: &'static str = "quic";
    /// quinn's writes are async only: every frame goes through the writer task.
    const WRITES_INLINE: bool = false;
    const FAILURE_DROPS_QUEUE: bool = true;
    const CLOSE_UNDONE: &'static str = "sent and acknowledged";

    fn batch_limits(&self) -> (usize, usize) {
        (MAX_CHUNKS, MAX_BATCH_BYTES)
    }

    fn check_link(&self) -> Result<()> {
        match self.link.ended(|| format!("{}: send", self.peer)) {
            Some((kind, text)) => Err(Error::new(kind, text)),
            None => Ok(()),
        }
    }

    async fn write(&self, batch: &mut [Bytes]) -> Result<usize> {
        let taken = self.send.lock().take();
        let Some(mut send) = taken else {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{}: send: the stream is gone", self.peer),
            ));
        };
        let written = tokio::select! {
            biased;
            () = self.abandon.notified() => {
                let _ = send.reset(VarInt::from_u32(CODE_ABANDONED));
                *self.send.lock() = Some(send);
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: send: abandoned", self.peer),
                ));
            }
            written = send.write_chunks(batch) => written,
        };
        *self.send.lock() = Some(send);
        match written {
            Ok(w) => Ok(w.bytes),
            Err(e) => Err(write_error(&e, &format!("{}: send", self.peer))),
        }
    }

    fn shut(&self) -> Result<()> {
        if let Some(send) = &mut *self.send.lock() {
            // Harmless when already finished.
            let _ = send.finish();
        }
        Ok(())
    }

    /// Waits until the peer has acknowledged the whole stream.
    async fn flushed(&self) -> Result<()> {
        let stopped = match &*self.send.lock() {
            Some(send) => send.stopped(),
            None => {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: close: the stream is gone", self.peer),
                ));
            }
        };
        match stopped.await {
            Ok(None) => Ok(()),
            Ok(Some(code)) => Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "{}: close: the peer stopped reading the link before it \
                     had everything (code {code})",
                    self.peer
                ),
            )),
            // The peer dropped the link normally after this side finished; what it did
            // not read, it did not want.
            Err(StoppedError::ConnectionLost(ConnectionError::ApplicationClosed(close)))
                if close.error_code.into_inner() == u64::from(CODE_DONE) =>
            {
                Ok(())
            }
            Err(StoppedError::ConnectionLost(e)) => {
                Err(connection_error(&e, &format!("{}: close", self.peer)))
            }
            Err(e @ StoppedError::ZeroRttRejected) => Err(Error::new(
                ErrorKind::Protocol,
                format!("{}: close: {e}", self.peer),
            )),
        }
    }

    fn abandon(&self) {
        // A writer in the middle of a write holds the stream; it resets it itself.
        self.abandon.notify_one();
        if let Some(send) = &mut *self.send.lock() {
            let _ = send.reset(VarInt::from_u32(CODE_ABANDONED));
        }
    }
}

/// The receiving half of a QUIC link.
#[derive(Debug)]
pub(super) struct QuicRx {
    link: Arc<LinkShared>,
    recv: RecvStream,
    /// Received bytes not yet decoded; decoded data are slices of it.
    buf: BytesMut,
    /// The first error; every later `recv` reports it.
    failed: Option<(ErrorKind, String)>,
    peer: String,
}

impl QuicRx {
    async fn next(&mut self) -> Result<Message> {
        if let Some((kind, context)) = &self.failed {
            return Err(Error::new(*kind, context.clone()));
        }
        loop {
            match wire::decode(&mut self.buf) {
                Ok(Some(msg)) => return Ok(msg),
                Ok(None) => {}
                Err(e) => {
                    let err = Error::with_source(
                        ErrorKind::Protocol,
                        format!("{}: received a bad frame", self.peer),
                        e,
                    );
                    // Never trusted again: the send half fails too, and the peer sees
                    // the connection end.
                    *self.link.fatal.lock() = Some(remember(&err));
                    self.link
                        .conn
                        .close(VarInt::from_u32(CODE_BAD_FRAME), b"received a bad frame");
                    return Err(self.fail(err));
                }
            }
            let mut chunks: [Bytes; READ_CHUNKS] = std::array::from_fn(|_| Bytes::new());
            let read = self.recv.read_chunks(&mut chunks).await;
            let err = match read {
                Ok(Some(n)) => {
                    let chunks = &chunks[..n];
                    let total: usize = chunks.iter().map(Bytes::len).sum();
                    if self.buf.capacity() - self.buf.len() < total {
                        self.buf.reserve(total.max(READ_RESERVE));
                    }
                    for c in chunks {
                        self.buf.extend_from_slice(c);
                    }
                    continue;
                }
                Ok(None) if self.buf.is_empty() => Error::new(
                    ErrorKind::Closed,
                    format!("{}: peer closed the link", self.peer),
                ),
                Ok(None) => Error::new(
                    ErrorKind::Closed,
                    format!(
                        "{}: peer closed the link in the middle of a frame ({} bytes of it received)",
                        self.peer,
                        self.buf.len()
                    ),
                ),
                Err(e) => read_error(&e, &format!("{}: receive", self.peer)),
            };
            return Err(self.fail(err));
        }
    }

    fn fail(&mut self, err: Error) -> Error {
        self.failed = Some(remember(&err));
        err
    }
}

impl LinkRx for QuicRx {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(self.next())
    }

    fn peer(&self) -> &str {
        &self.peer
    }
}
