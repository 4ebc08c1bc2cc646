//! The sending half every byte-stream link (tcp, shm, quic) shares.
//!
//! ```text
//!   send / send_batch ── encode ──▶ enqueue ──(nobody writing: the caller writes at once)──▶ write_now
//!                                     │ what did not fit, or someone else writes
//!                                     ▼
//!                                 FrameQueue ──▶ writer task ──(many frames per call)──▶ write
//!   close ── wait until the queue is drained ──▶ shut (once) ──▶ flushed
//! ```
//!
//! [`StreamTx`] is the [`LinkTx`] of all three: it encodes messages with the one codec,
//! keeps the frames [`send`](LinkTx::send) accepted and the stream has not taken, holds
//! senders back while more than the transport's limit is queued, drains and ends the
//! stream on [`close`](LinkTx::close), bounded by the close timeout, and remembers the
//! first error for every later call. A transport supplies only a [`StreamSink`]: how to
//! write slices of frames to its stream and how to end it.
//!
//! Exactly one writer touches the stream at a time, which keeps frames in order: a
//! `send` that finds nobody writing and a sink that [writes inline](StreamSink::WRITES_INLINE)
//! puts its frames on the stream itself, without waiting (a QD1 write costs no task
//! switch); whatever does not fit, and every frame sent while someone writes, joins the
//! queue, which the writer task drains with as few writes as the sink's
//! [limits](StreamSink::batch_limits) allow, so frames batch exactly when they pile up.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::{LinkTx, QueueDepth, encode_frames, remember};
use crate::wire::{Frame, Message};

/// What a byte-stream transport supplies to [`StreamTx`]: its end of the stream.
///
/// Errors a sink returns are final for the link; they carry the link's peer in their
/// text, as the transport words them.
pub(super) trait StreamSink: Send + Sync + Sized + std::fmt::Debug + 'static {
    /// The transport's name, for [`LinkTx::transport`] ("tcp").
    const TRANSPORT: &'static str;
    /// Whether [`write_now`](StreamSink::write_now) can put bytes on the stream without
    /// waiting; when not, every frame goes through the writer task.
    const WRITES_INLINE: bool;
    /// Whether a failure drops what is queued, so [`LinkTx::queue_depth`] then reports
    /// nothing (nothing more will be sent either way).
    const FAILURE_DROPS_QUEUE: bool;
    /// What a timed-out close did not manage for the bytes still queued ("sent").
    const CLOSE_UNDONE: &'static str;

    /// The most slices, and the bytes after which no more are added, for one
    /// [`write`](StreamSink::write).
    fn batch_limits(&self) -> (usize, usize);

    /// Fails when the link as a whole can no longer carry what is sent (the peer is
    /// gone); checked on every send.
    fn check_link(&self) -> Result<()> {
        Ok(())
    }

    /// Writes as much of `frames`, in order, as the stream takes without waiting;
    /// returns the bytes written (0 when it has no room). Called only when
    /// [`WRITES_INLINE`](StreamSink::WRITES_INLINE), by the one current writer.
    fn write_now(&self, frames: &[Frame]) -> Result<usize> {
        let _ = frames;
        Ok(0)
    }

    /// Writes a prefix of `batch` (never empty), waiting for room as long as it takes;
    /// returns the bytes written. Called by the writer task only.
    fn write(&self, batch: &mut [Bytes]) -> impl Future<Output = Result<usize>> + Send;

    /// Tells the peer no more bytes follow. Called once: by `close` after everything
    /// queued is written, or when the sending half is dropped.
    fn shut(&self) -> Result<()>;

    /// Completes when the peer has everything up to the end [`shut`](StreamSink::shut)
    /// marked (at once for a transport that has no such acknowledgement). Every `close`
    /// waits for it, within the close timeout.
    fn flushed(&self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    /// Gives up on the stream: `close` timed out, the peer is not taking what is queued.
    fn abandon(&self);
}

/// The parts of `frames` after their first `skip` bytes, in order, none empty.
pub(super) fn frame_parts<'f>(
    frames: impl IntoIterator<Item = &'f Frame>,
    mut skip: usize,
) -> impl Iterator<Item = &'f [u8]> {
    frames
        .into_iter()
        .flat_map(|f| [&f.head()[..], &f.data()[..]])
        .filter_map(move |part| {
            if skip >= part.len() {
                skip -= part.len();
                None
            } else {
                let rest = &part[skip..];
                skip = 0;
                Some(rest)
            }
        })
}

/// Frames accepted and not yet completely written, oldest first.
#[derive(Debug, Default)]
struct FrameQueue {
    /// The frames.
    frames: VecDeque<Frame>,
    /// Bytes of the front frame already written.
    front_written: usize,
    /// Bytes in `frames` not yet written.
    bytes: usize,
    /// The first error; every later operation reports it.
    failed: Option<(ErrorKind, String)>,
}

impl FrameQueue {
    /// The first error, again, if there was one.
    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            Some((kind, context)) => Err(Error::new(*kind, context.clone())),
            None => Ok(()),
        }
    }

    /// Queues `frame` behind the others.
    fn push(&mut self, frame: Frame) {
        self.bytes += frame.len();
        if self.frames.is_empty() {
            self.front_written = 0;
        }
        self.frames.push_back(frame);
    }

    /// Puts what an inline write of `written` bytes left of `frames` at the front, ahead
    /// of anything queued meanwhile.
    fn requeue_front(&mut self, frames: Vec<Frame>, mut written: usize) {
        let mut rest = Vec::new();
        for f in frames {
            if written >= f.len() {
                written -= f.len();
            } else {
                rest.push((f, written));
                written = 0;
            }
        }
        for (f, partial) in rest.into_iter().rev() {
            self.bytes += f.len() - partial;
            self.frames.push_front(f);
            self.front_written = partial;
        }
    }

    /// Drops what a write of `n` bytes took from the front of the queue.
    fn advance(&mut self, mut n: usize) {
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

    /// The unwritten parts of the front frames, into `batch`: whole frames until it
    /// holds more than `max_parts - 2` slices or `max_bytes` bytes.
    fn unwritten(&self, batch: &mut Vec<Bytes>, max_parts: usize, max_bytes: usize) {
        let mut skip = self.front_written;
        let mut bytes = 0;
        for frame in &self.frames {
            for part in [frame.head(), frame.data()] {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                bytes += part.len() - skip;
                batch.push(part.slice(skip..));
                skip = 0;
            }
            if batch.len() + 2 > max_parts || bytes >= max_bytes {
                break;
            }
        }
    }

    /// Forgets every frame (the error stays).
    fn drop_frames(&mut self) {
        self.frames.clear();
        self.front_written = 0;
        self.bytes = 0;
    }
}

/// Who may write to the stream right now; exactly one writer keeps frames in order.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Writer {
    /// Nobody: the queue is empty and the next `send` writes directly.
    #[default]
    Idle,
    /// A `send` is writing its frames directly.
    Inline,
    /// The writer task is draining the queue.
    Task,
}

#[derive(Debug, Default)]
struct SendState {
    /// Frames not yet written, and the first error.
    q: FrameQueue,
    writer: Writer,
    /// `close` was called (or the half dropped): no more sends.
    closing: bool,
    /// [`StreamSink::shut`] has been called.
    shut: bool,
    /// A `close` completed: the peer has everything.
    finished: bool,
}

/// What the sending half and its writer task share.
#[derive(Debug)]
struct SendSide<S> {
    sink: S,
    state: Mutex<SendState>,
    /// Wakes the writer task when it owns a non-empty queue.
    work: Notify,
    /// Wakes senders waiting for room and `close` waiting for the queue to drain.
    progress: Notify,
    limit: usize,
    close_timeout: Duration,
    peer: String,
}

/// The sending half of a byte-stream link: a [`LinkTx`] over a [`StreamSink`].
#[derive(Debug)]
pub(super) struct StreamTx<S: StreamSink> {
    side: Arc<SendSide<S>>,
    writer: JoinHandle<()>,
}

impl<S: StreamSink> StreamTx<S> {
    /// The sending half over `sink`, to `peer`: `send` waits while more than `limit`
    /// bytes are queued, `close` gives up after `close_timeout`. Spawns the writer task,
    /// so it must run inside a tokio runtime.
    pub(super) fn new(sink: S, peer: String, limit: usize, close_timeout: Duration) -> Self {
        let side = Arc::new(SendSide {
            sink,
            state: Mutex::new(SendState::default()),
            work: Notify::new(),
            progress: Notify::new(),
            limit,
            close_timeout,
            peer,
        });
        let writer = tokio::spawn(write_loop(Arc::clone(&side)));
        StreamTx { side, writer }
    }
}

impl<S: StreamSink> SendSide<S> {
    /// Records `err` as the link's failure unless it has one; returns it.
    fn fail(&self, st: &mut SendState, err: Error) -> Error {
        if st.q.failed.is_none() {
            st.q.failed = Some(remember(&err));
        }
        if S::FAILURE_DROPS_QUEUE {
            st.q.drop_frames();
        }
        err
    }

    /// Queues `frames` in order, writing as much as the stream takes at once when nobody
    /// else writes (one call for the lot). Returns whether the queue is now above the
    /// limit.
    fn enqueue(&self, frames: Vec<Frame>) -> Result<bool> {
        let mut st = self.state.lock();
        st.q.check_failed()?;
        if st.closing {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{}: send: link closed by this side", self.peer),
            ));
        }
        if let Err(e) = self.sink.check_link() {
            let err = self.fail(&mut st, e);
            drop(st);
            self.progress.notify_waiters();
            return Err(err);
        }
        if st.writer != Writer::Idle || !S::WRITES_INLINE {
            let hand_over = st.writer == Writer::Idle;
            for f in frames {
                st.q.push(f);
            }
            let over = st.q.bytes > self.limit;
            if hand_over {
                st.writer = Writer::Task;
                drop(st);
                self.work.notify_one();
            }
            return Ok(over);
        }
        // Idle means the queue is empty: these frames are next on the stream.
        st.writer = Writer::Inline;
        drop(st);
        let written = self.sink.write_now(&frames);
        let mut st = self.state.lock();
        match written {
            // Frames queued meanwhile go after these.
            Ok(n) => st.q.requeue_front(frames, n),
            Err(e) => {
                st.writer = Writer::Idle;
                let err = self.fail(&mut st, e);
                drop(st);
                self.progress.notify_waiters();
                return Err(err);
            }
        }
        if st.q.frames.is_empty() {
            st.writer = Writer::Idle;
            if st.closing {
                self.progress.notify_waiters();
            }
        } else {
            st.writer = Writer::Task;
            self.work.notify_one();
        }
        Ok(st.q.bytes > self.limit)
    }

    /// Waits until the queue is at most the limit.
    async fn wait_for_room(&self) -> Result<()> {
        loop {
            let progress = self.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            {
                let st = self.state.lock();
                st.q.check_failed()?;
                if st.q.bytes <= self.limit {
                    return Ok(());
                }
            }
            progress.await;
        }
    }

    async fn send(&self, frames: Vec<Frame>) -> Result<()> {
        if self.enqueue(frames)? {
            self.wait_for_room().await?;
        }
        Ok(())
    }

    /// Drains the queue, ends the stream (once), and waits until the peer has it all.
    async fn finish(&self) -> Result<()> {
        let first = loop {
            let progress = self.progress.notified();
            tokio::pin!(progress);
            progress.as_mut().enable();
            {
                let mut st = self.state.lock();
                st.q.check_failed()?;
                if st.finished {
                    return Ok(());
                }
                if st.writer == Writer::Idle && st.q.frames.is_empty() {
                    break !std::mem::replace(&mut st.shut, true);
                }
            }
            progress.await;
        };
        if first {
            self.sink.shut()?;
        }
        let flushed = self.sink.flushed().await;
        let mut st = self.state.lock();
        let result = match flushed {
            Ok(()) => {
                st.finished = true;
                Ok(())
            }
            Err(e) => Err(self.fail(&mut st, e)),
        };
        drop(st);
        self.progress.notify_waiters();
        result
    }

    async fn close(&self) -> Result<()> {
        {
            let mut st = self.state.lock();
            if st.finished {
                return Ok(());
            }
            st.q.check_failed()?;
            st.closing = true;
        }
        match tokio::time::timeout(self.close_timeout, self.finish()).await {
            Ok(result) => result,
            Err(_) => {
                // The peer is not reading: give up on what is queued.
                let err = {
                    let mut st = self.state.lock();
                    let err = Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "{}: close: {} queued bytes not {} within {:?}",
                            self.peer,
                            st.q.bytes,
                            S::CLOSE_UNDONE,
                            self.close_timeout
                        ),
                    );
                    self.fail(&mut st, err)
                };
                self.sink.abandon();
                self.progress.notify_waiters();
                Err(err)
            }
        }
    }
}

/// Drains the queue whenever `enqueue` hands it over, many frames per write.
async fn write_loop<S: StreamSink>(side: Arc<SendSide<S>>) {
    let (max_parts, max_bytes) = side.sink.batch_limits();
    let mut batch: Vec<Bytes> = Vec::with_capacity(max_parts);
    loop {
        side.work.notified().await;
        loop {
            batch.clear();
            {
                let mut st = side.state.lock();
                if st.writer != Writer::Task || st.q.failed.is_some() {
                    break;
                }
                st.q.unwritten(&mut batch, max_parts, max_bytes);
                if batch.is_empty() {
                    st.writer = Writer::Idle;
                    drop(st);
                    side.progress.notify_waiters();
                    break;
                }
            }
            let written = side.sink.write(&mut batch).await;
            let mut st = side.state.lock();
            match written {
                Ok(n) => st.q.advance(n),
                Err(e) => {
                    side.fail(&mut st, e);
                }
            }
            let idle = st.q.frames.is_empty() || st.q.failed.is_some();
            if idle {
                st.writer = Writer::Idle;
            }
            let room = st.q.bytes <= side.limit;
            drop(st);
            if idle || room {
                side.progress.notify_waiters();
            }
            if idle {
                break;
            }
        }
    }
}

impl<S: StreamSink> LinkTx for StreamTx<S> {
    fn send(&self, msg: Message) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let frames = encode_frames(&self.side.peer, std::slice::from_ref(&msg))?;
            self.side.send(frames).await
        })
    }

    fn send_batch(&self, msgs: Vec<Message>) -> IoFuture<'_, ()> {
        Box::pin(async move {
            let frames = encode_frames(&self.side.peer, &msgs)?;
            if frames.is_empty() {
                return Ok(());
            }
            self.side.send(frames).await
        })
    }

    fn queue_depth(&self) -> QueueDepth {
        let st = self.side.state.lock();
        QueueDepth {
            messages: st.q.frames.len(),
            bytes: st.q.bytes,
        }
    }

    fn close(&self) -> IoFuture<'_, ()> {
        Box::pin(self.side.close())
    }

    fn peer(&self) -> &str {
        &self.side.peer
    }

    fn transport(&self) -> &str {
        S::TRANSPORT
    }
}

impl<S: StreamSink> Drop for StreamTx<S> {
    fn drop(&mut self) {
        self.writer.abort();
        let mut st = self.side.state.lock();
        st.closing = true;
        // Nothing more will be written.
        st.q.drop_frames();
        if !std::mem::replace(&mut st.shut, true) {
            // Best effort: the peer sees this direction end even while our receiving
            // half lives.
            let _ = self.side.sink.shut();
        }
    }
}
