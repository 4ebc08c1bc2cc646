//! A QUIC link: one bidirectional stream; its sending half is the shared
//! [`StreamTx`](crate::transport::stream_tx::StreamTx) over a [`QuicSink`], its receiving
//! half the shared [`StreamRx`](crate::transport::stream_rx::StreamRx) over a
//! [`QuicSource`].

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use quinn::{Connection, ConnectionError, Endpoint, RecvStream, SendStream, StoppedError, VarInt};
use tokio::sync::Notify;
use vsan_core::{Error, ErrorKind, Result};

use super::errors::{connection_error, read_error, write_error};
use super::{
    CODE_ABANDONED, CODE_BAD_FRAME, CODE_DONE, MAX_BATCH_BYTES, MAX_CHUNKS, QuicConfig,
    READ_CHUNKS, READ_RESERVE,
};
use crate::transport::stream_rx::{StreamSource, peer_closed, stream_link};
use crate::transport::stream_tx::StreamSink;
use crate::transport::{Link, remember};

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
    stream_link(
        sink,
        QuicSource { link, recv, peer },
        BytesMut::new(),
        config.send_queue_limit,
        config.close_timeout,
    )
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

/// The QUIC end of a link's receiving half: the link's one stream.
#[derive(Debug)]
pub(super) struct QuicSource {
    link: Arc<LinkShared>,
    recv: RecvStream,
    peer: String,
}

impl StreamSource for QuicSource {
    fn peer(&self) -> &str {
        &self.peer
    }

    async fn fill(&mut self, buf: &mut BytesMut) -> Result<()> {
        let mut chunks: [Bytes; READ_CHUNKS] = std::array::from_fn(|_| Bytes::new());
        match self.recv.read_chunks(&mut chunks).await {
            Ok(Some(n)) => {
                let chunks = &chunks[..n];
                let total: usize = chunks.iter().map(Bytes::len).sum();
                if buf.capacity() - buf.len() < total {
                    buf.reserve(total.max(READ_RESERVE));
                }
                for c in chunks {
                    buf.extend_from_slice(c);
                }
                Ok(())
            }
            Ok(None) => Err(peer_closed(&self.peer, buf.len())),
            Err(e) => Err(read_error(&e, &format!("{}: receive", self.peer))),
        }
    }

    fn distrust(&mut self, err: &Error) {
        *self.link.fatal.lock() = Some(remember(err));
        self.link
            .conn
            .close(VarInt::from_u32(CODE_BAD_FRAME), b"received a bad frame");
    }
}
