//! The queue between a listener's background task and [`Listener::accept`](super::Listener::accept),
//! which the tcp, shm and quic listeners share.

use vsan_core::{Error, ErrorKind, Result};

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
