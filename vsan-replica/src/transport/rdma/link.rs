//! An RDMA link's halves over the protocol core: a driver task turns completion events
//! into [`Engine::pump`] calls; `send` and `recv` call the engine directly under its
//! lock, so a SEND is posted from the sending task without a task switch.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::engine::{Engine, Verbs};
use crate::transport::auth::{self, Role};
use crate::transport::{Link, LinkRx, LinkTx, QueueDepth, SharedSecret, encode_frames};
use crate::wire;
use crate::wire::Message;

/// Why the driver woke up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Wake {
    /// Completions may be ready.
    Completions,
    /// The connection went away (why, in words).
    Disconnected(String),
    /// The event source failed (why, in words).
    Failed(String),
}

/// Waits for the verbs layer's events (a completion channel and a connection manager
/// channel for real hardware, a [`Notify`] for the fake).
pub(crate) trait Notifier: Send + Sync + 'static {
    /// The next event. Completions signalled before the call are not lost.
    fn wait(&self) -> Pin<Box<dyn Future<Output = Wake> + Send + '_>>;
}

/// How an established connection becomes a link.
#[derive(Debug, Clone)]
pub(crate) struct LinkParams {
    /// The transport carrying the link, for status ("rdma").
    pub transport: &'static str,
    /// Bytes a link may queue before `send` waits.
    pub send_queue_limit: usize,
    /// How long `close` waits for what is queued.
    pub close_timeout: Duration,
    /// Authenticate with this secret before the first message.
    pub secret: Option<SharedSecret>,
    /// How long the authentication exchange may take.
    pub handshake_timeout: Duration,
    /// This side's role in the exchange.
    pub role: Role,
}

struct Shared<V: Verbs> {
    core: Mutex<Engine<V>>,
    /// Wakes `recv` when something arrived or the link ended.
    rx_ready: Notify,
    /// Wakes senders waiting for room and `close` waiting for the queue to drain.
    tx_progress: Notify,
    /// The authentication reader's waker.
    auth_waker: Mutex<Option<Waker>>,
    send_queue_limit: usize,
    close_timeout: Duration,
    peer: String,
    transport: &'static str,
}

impl<V: Verbs> Shared<V> {
    fn wake_all(&self) {
        self.rx_ready.notify_waiters();
        self.tx_progress.notify_waiters();
        if let Some(w) = self.auth_waker.lock().take() {
            w.wake();
        }
    }
}

impl<V: Verbs> fmt::Debug for Shared<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("peer", &self.peer)
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

/// Stops the driver when both halves are gone, which drops the engine and with it the
/// connection.
#[derive(Debug)]
struct DriverGuard(JoinHandle<()>);

impl Drop for DriverGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Builds a link over an engine whose receive buffers are posted, running the
/// authentication exchange first when a secret is set. Must run inside a tokio runtime.
pub(crate) async fn establish<V: Verbs, N: Notifier>(
    engine: Engine<V>,
    notifier: N,
    params: LinkParams,
) -> Result<Link> {
    let peer = engine.peer().to_string();
    let shared = Arc::new(Shared {
        core: Mutex::new(engine),
        rx_ready: Notify::new(),
        tx_progress: Notify::new(),
        auth_waker: Mutex::new(None),
        send_queue_limit: params.send_queue_limit,
        close_timeout: params.close_timeout,
        peer: peer.clone(),
        transport: params.transport,
    });
    let guard = Arc::new(DriverGuard(tokio::spawn(drive(
        Arc::clone(&shared),
        notifier,
    ))));
    if let Some(secret) = &params.secret {
        let mut stream = AuthStream {
            shared: Arc::clone(&shared),
        };
        let limit = params.handshake_timeout;
        let exchange = auth::authenticate(&mut stream, secret, params.role, &peer);
        let read_ahead = match tokio::time::timeout(limit, exchange).await {
            Ok(result) => result?,
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{peer}: peer authentication not done within {limit:?}"),
                ));
            }
        };
        shared.core.lock().unread(read_ahead);
    }
    let tx = RdmaTx {
        shared: Arc::clone(&shared),
        _guard: Arc::clone(&guard),
    };
    let rx = RdmaRx {
        shared,
        _guard: guard,
    };
    Ok(Link::new(Box::new(tx), Box::new(rx)))
}

/// Applies completion events to the engine until the connection ends.
async fn drive<V: Verbs, N: Notifier>(shared: Arc<Shared<V>>, notifier: N) {
    loop {
        let wake = notifier.wait().await;
        let done = {
            let mut core = shared.core.lock();
            match &wake {
                Wake::Completions => {
                    let _ = core.pump();
                    core.has_failed()
                }
                Wake::Disconnected(why) => {
                    let _ = core.pump();
                    core.on_disconnect(why);
                    true
                }
                Wake::Failed(why) => {
                    core.fail_with(ErrorKind::Io, why);
                    true
                }
            }
        };
        shared.wake_all();
        if done {
            return;
        }
    }
}

/// The sending half of an RDMA link.
struct RdmaTx<V: Verbs> {
    shared: Arc<Shared<V>>,
    _guard: Arc<DriverGuard>,
}

impl<V: Verbs> fmt::Debug for RdmaTx<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaTx")
            .field("peer", &self.shared.peer)
            .finish_non_exhaustive()
    }
}

impl<V: Verbs> RdmaTx<V> {
    /// Queues frames and posts what credits allow; returns whether the queue is over
    /// its limit.
    fn enqueue(&self, frames: Vec<wire::Frame>) -> Result<bool> {
        let mut core = self.shared.core.lock();
        core.check_tx()?;
        for f in frames {
            core.queue_frame(f);
        }
        core.flush()?;
        Ok(core.queued_bytes() > self.shared.send_queue_limit)
    }

    async fn wait_for_room(&self) -> Result<()> {
        loop {
            let progress = self.shared.tx_progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            {
                let core = self.shared.core.lock();
                core.check_failed()?;
                if core.queued_bytes() <= self.shared.send_queue_limit {
                    return Ok(());
                }
            }
            progress.await;
        }
    }
}

impl<V: Verbs> LinkTx for RdmaTx<V> {
    fn send(&self, msg: Message) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let frames = encode_frames(&self.shared.peer, std::slice::from_ref(&msg))?;
            if self.enqueue(frames)? {
                self.wait_for_room().await?;
            }
            Ok(())
        })
    }

    fn send_batch(&self, msgs: Vec<Message>) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let frames = encode_frames(&self.shared.peer, &msgs)?;
            if self.enqueue(frames)? {
                self.wait_for_room().await?;
            }
            Ok(())
        })
    }

    fn queue_depth(&self) -> QueueDepth {
        self.shared.core.lock().queue_depth()
    }

    fn close(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let shared = &self.shared;
            {
                let mut core = shared.core.lock();
                if core.close_requested() && core.close_sent() {
                    return Ok(());
                }
                core.request_close();
            }
            let drained = async {
                loop {
                    let progress = shared.tx_progress.notified();
                    tokio::pin!(progress);
                    progress.as_mut().enable();
                    {
                        let core = shared.core.lock();
                        core.check_failed()?;
                        if core.close_sent() {
                            return Ok(());
                        }
                        if let Some(why) = core.gone() {
                            return Err(Error::new(
                                ErrorKind::Closed,
                                format!("{}: close: {why}", shared.peer),
                            ));
                        }
                    }
                    progress.await;
                }
            };
            match tokio::time::timeout(shared.close_timeout, drained).await {
                Ok(result) => result,
                Err(_) => {
                    let mut core = shared.core.lock();
                    let queued = core.queued_bytes();
                    core.drop_queue();
                    let err = core.fail_with(
                        ErrorKind::Timeout,
                        &format!(
                            "close: {queued} queued bytes not sent within {:?}",
                            shared.close_timeout
                        ),
                    );
                    drop(core);
                    shared.wake_all();
                    Err(err)
                }
            }
        })
    }

    fn peer(&self) -> &str {
        &self.shared.peer
    }

    fn transport(&self) -> &str {
        self.shared.transport
    }
}

impl<V: Verbs> Drop for RdmaTx<V> {
    fn drop(&mut self) {
        // The peer sees the end of the stream after what is already posted.
        self.shared.core.lock().abandon();
    }
}

/// The receiving half of an RDMA link.
struct RdmaRx<V: Verbs> {
    shared: Arc<Shared<V>>,
    _guard: Arc<DriverGuard>,
}

impl<V: Verbs> fmt::Debug for RdmaRx<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaRx")
            .field("peer", &self.shared.peer)
            .finish_non_exhaustive()
    }
}

impl<V: Verbs> RdmaRx<V> {
    async fn next(&mut self) -> Result<Message> {
        loop {
            let ready = self.shared.rx_ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            let taken = self.shared.core.lock().take_message();
            match taken {
                Ok(Some(msg)) => {
                    // Credits went out; senders on this side may have room too.
                    self.shared.tx_progress.notify_waiters();
                    return Ok(msg);
                }
                Ok(None) => {}
                Err(e) => {
                    self.shared.tx_progress.notify_waiters();
                    return Err(e);
                }
            }
            ready.await;
        }
    }
}

impl<V: Verbs> LinkRx for RdmaRx<V> {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(self.next())
    }

    fn peer(&self) -> &str {
        &self.shared.peer
    }
}

/// The link as a byte stream, for the authentication exchange only.
struct AuthStream<V: Verbs> {
    shared: Arc<Shared<V>>,
}

fn to_io(e: Error) -> io::Error {
    io::Error::other(e)
}

impl<V: Verbs> AsyncRead for AuthStream<V> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut core = self.shared.core.lock();
        match core.read_bytes(buf.initialize_unfilled()) {
            Ok(Some(n)) => {
                buf.advance(n);
                Poll::Ready(Ok(()))
            }
            Ok(None) => {
                // Registered under the engine lock: the driver wakes it after its next
                // pump, which takes the same lock.
                *self.shared.auth_waker.lock() = Some(cx.waker().clone());
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(to_io(e))),
        }
    }
}

impl<V: Verbs> AsyncWrite for AuthStream<V> {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let mut core = self.shared.core.lock();
        if let Err(e) = core.check_tx() {
            return Poll::Ready(Err(to_io(e)));
        }
        core.queue_bytes(Bytes::copy_from_slice(buf), true);
        match core.flush() {
            Ok(_) => Poll::Ready(Ok(buf.len())),
            Err(e) => Poll::Ready(Err(to_io(e))),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
