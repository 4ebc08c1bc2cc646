//! The send queue the byte-stream transports (tcp, shm, quic) share: frames `send`
//! accepted and the writer has not finished, how far the front one got, and the first
//! error, which every later call reports (errors are final).

use std::collections::VecDeque;

use vsan_core::{Error, ErrorKind, Result};

use crate::wire::Frame;

/// Frames accepted and not yet completely written, oldest first.
#[derive(Debug, Default)]
pub(super) struct FrameQueue {
    /// The frames.
    pub(super) frames: VecDeque<Frame>,
    /// Bytes of the front frame already written.
    pub(super) front_written: usize,
    /// Bytes in `frames` not yet written.
    pub(super) bytes: usize,
    /// The first error; every later operation reports it.
    pub(super) failed: Option<(ErrorKind, String)>,
}

impl FrameQueue {
    /// The first error, again, if there was one.
    pub(super) fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some((kind, context)) => Err(Error::new(*kind, context.clone())),
            None => Ok(()),
        }
    }

    /// Queues `frame` behind the others.
    pub(super) fn push(&mut self, frame: Frame) {
        self.bytes += frame.len();
        if self.frames.is_empty() {
            self.front_written = 0;
        }
        self.frames.push_back(frame);
    }

    /// Drops what a write of `n` bytes took from the front of the queue.
    pub(super) fn advance(&mut self, mut n: usize) {
        self.bytes = self.bytes.saturating_sub(n);
        while n > 0 {
            let Some(front) = self.frames.front() else {
                break;
            };
            let left = front.len() - self.front_written;
            if n < left {
                self.front_written += n;
                break;
            }
            n -= left;
            self.frames.pop_front();
            self.front_written = 0;
        }
    }

    /// Records `err` as the queue's failure unless it already has one; returns it.
    pub(super) fn fail(&mut self, err: Error) -> Error {
        if self.failed.is_none() {
            self.failed = Some(remember(&err));
        }
        err
    }
}

/// What a link keeps of its first error, to report it again on every later call.
pub(super) fn remember(err: &Error) -> (ErrorKind, String) {
    let mut text = err.context().to_string();
    if let Some(source) = std::error::Error::source(err) {
        text = format!("{text}: {source}");
    }
    (err.kind(), text)
}

/// Links a listener's background task accepted and authenticated, waiting for
/// [`Listener::accept`](super::Listener::accept) (or an error about one connection).
#[derive(Debug)]
pub(super) struct AcceptQueue {
    /// The listener, for the error once its task is gone ("tcp listener 127.0.0.1:7002").
    what: String,
    rx: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Result<super::Link>>>,
}

impl AcceptQueue {
    /// A queue of `backlog` entries for the listener `what`, and the sender its task uses.
    pub(super) fn new(
        what: String,
        backlog: usize,
    ) -> (tokio::sync::mpsc::Sender<Result<super::Link>>, AcceptQueue) {
        let (tx, rx) = tokio::sync::mpsc::channel(backlog);
        (
            tx,
            AcceptQueue {
                what,
                rx: tokio::sync::Mutex::new(rx),
            },
        )
    }

    /// The next accepted link; [`Closed`](ErrorKind::Closed) once the task has stopped.
    pub(super) async fn next(&self) -> Result<super::Link> {
        match self.rx.lock().await.recv().await {
            Some(link) => link,
            None => Err(Error::new(
                ErrorKind::Closed,
                format!("{}: stopped", self.what),
            )),
        }
    }
}
