//! Helpers shared by the integration tests of `vsan-core`: test deadlines, data patterns,
//! reading and filling device ranges, [`Held`] (a device that parks operations), an
//! in-process NBD server ([`serve`]), [`Raw`], a client that speaks raw NBD bytes so a
//! test can check the wire byte by byte or send what no real client would, and
//! [`PlugProbe`], a device that batches writes under a plug as a mirror does and counts
//! which writes a front door started under one.
// Every test binary compiles this module on its own and uses a different part of it, so
// what one of them leaves unused is not dead code.
#![allow(dead_code)]

use std::future::Future;
use std::io::ErrorKind as IoKind;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use vsan_core::export::nbd::proto::*;
use vsan_core::export::nbd::{Export, Server};
use vsan_core::{BlockDevice, Geometry, IoFlags, IoFuture, MemDevice};

pub const MIB: u64 = 1 << 20;
pub const BS: u64 = 512;
/// Size of the devices from [`geometry`].
pub const SIZE: u64 = 16 * MIB;
/// Largest request the devices from [`geometry`] take.
pub const MAX_IO: u32 = 1 << 20;
/// How long one exchange with the server may take before the test calls it a hang.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Run a test body with a deadline of `limit`, so a hung server fails the test instead
/// of CI.
pub async fn within<T>(limit: Duration, body: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, body).await {
        Ok(v) => v,
        Err(_) => panic!("test did not finish in {limit:?}: the server hung"),
    }
}

/// Bytes that differ per offset and per `tag`, so misplaced or stale data shows.
pub fn pattern(tag: u8, offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let pos = offset + i;
            ((pos / 7) ^ (pos >> 9)).wrapping_mul(31) as u8 ^ tag
        })
        .collect()
}

/// A fresh directory under the target's tmp dir, removed on drop.
pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// `SIZE` bytes in 512-byte blocks, requests of at most `MAX_IO`.
pub fn geometry() -> Geometry {
    Geometry::with_max_io(SIZE, BS as u32, MAX_IO).unwrap()
}

/// A zeroed MemDevice of [`geometry`].
pub fn mem() -> Arc<MemDevice> {
    Arc::new(MemDevice::new(geometry()))
}

/// `[offset, offset + len)` of `dev`, read in requests of at most `max_io`.
pub async fn read_range(dev: &dyn BlockDevice, offset: u64, len: u64) -> Vec<u8> {
    let max_io = u64::from(dev.geometry().max_io());
    let mut out = Vec::with_capacity(len as usize);
    let mut pos = offset;
    while pos < offset + len {
        let n = (offset + len - pos).min(max_io);
        out.extend_from_slice(&dev.read(pos, n as usize).await.unwrap());
        pos += n;
    }
    out
}

/// Write `pattern(tag, ..)` over `[offset, offset + len)` of `dev`, in requests of at
/// most `max_io`.
pub async fn fill_range(dev: &dyn BlockDevice, tag: u8, offset: u64, len: u64) {
    let max_io = u64::from(dev.geometry().max_io());
    let mut pos = offset;
    while pos < offset + len {
        let n = (offset + len - pos).min(max_io);
        dev.write(
            pos,
            Bytes::from(pattern(tag, pos, n as usize)),
            IoFlags::empty(),
        )
        .await
        .unwrap();
        pos += n;
    }
}

// ---------------------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------------------

/// A server listening on 127.0.0.1:0; shut down when dropped.
pub struct Served {
    pub server: Server,
    pub addr: String,
    pub serving: JoinHandle<vsan_core::Result<()>>,
}

pub async fn serve(exports: Vec<Export>) -> Served {
    let server = Server::new(exports).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let s = server.clone();
    let serving = tokio::spawn(async move { s.serve_tcp(listener).await });
    Served {
        server,
        addr,
        serving,
    }
}

impl Served {
    /// Wait until the server has no connection left.
    pub async fn settle(&self) {
        let deadline = tokio::time::Instant::now() + IO_TIMEOUT;
        while self.server.open_connections() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the server still holds {} connection(s) after every client left",
                self.server.open_connections()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.shutdown();
        self.serving.abort();
    }
}

/// A MemDevice whose operations at or above `hold_from` (a flush counts as offset 0) wait
/// until [`Held::release`]; every operation started is counted, so a test can wait until
/// the server has really put requests in flight.
pub struct Held {
    inner: MemDevice,
    hold_from: u64,
    started: watch::Sender<usize>,
    released: watch::Sender<bool>,
}

impl Held {
    pub fn new(hold_from: u64) -> Arc<Held> {
        Arc::new(Held {
            inner: MemDevice::new(geometry()),
            hold_from,
            started: watch::Sender::new(0),
            released: watch::Sender::new(false),
        })
    }

    async fn enter(&self, offset: u64) {
        self.started.send_modify(|n| *n += 1);
        if offset >= self.hold_from {
            let mut rx = self.released.subscribe();
            let _ = rx.wait_for(|&r| r).await;
        }
    }

    /// Wait until `n` operations have started.
    pub async fn started(&self, n: usize) {
        let mut rx = self.started.subscribe();
        let _ = rx.wait_for(|&s| s >= n).await;
    }

    pub fn release(&self) {
        self.released.send_replace(true);
    }
}

impl BlockDevice for Held {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn data_loss_count(&self) -> u64 {
        self.inner.data_loss_count()
    }
    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        Box::pin(async move {
            self.enter(offset).await;
            self.inner.read(offset, len).await
        })
    }
    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.enter(offset).await;
            self.inner.write(offset, data, flags).await
        })
    }
    fn flush(&self) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.enter(0).await;
            self.inner.flush().await
        })
    }
    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.enter(offset).await;
            self.inner.discard(offset, len, flags).await
        })
    }
    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        Box::pin(async move {
            self.enter(offset).await;
            self.inner.write_zeroes(offset, len, flags).await
        })
    }
}

// ---------------------------------------------------------------------------------------
// Raw NBD client
// ---------------------------------------------------------------------------------------

/// An option reply as it came off the wire.
#[derive(Debug)]
pub struct OptReply {
    pub opt: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

/// A client speaking raw bytes, over any stream (TCP unless said otherwise).
pub struct Raw<S = TcpStream> {
    pub s: S,
}

impl Raw<TcpStream> {
    /// Connect and read the greeting.
    pub async fn connect(addr: &str) -> Raw<TcpStream> {
        let s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        Raw::greeted(s).await
    }

    /// Connect, read the greeting and send the client flags `flags`.
    pub async fn negotiating(addr: &str, flags: u32) -> Raw<TcpStream> {
        let mut raw = Raw::connect(addr).await;
        raw.flags(flags).await;
        raw
    }

    /// Connect, negotiate fixed newstyle and attach to `export` with OPT_GO.
    pub async fn attach(addr: &str, export: &str) -> Raw<TcpStream> {
        let mut raw = Raw::negotiating(addr, FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).await;
        raw.go(export).await;
        raw
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Raw<S> {
    /// Read and check the greeting on a fresh connection.
    pub async fn greeted(s: S) -> Raw<S> {
        let mut raw = Raw { s };
        let g = raw.read_exact(18).await;
        assert_eq!(u64::from_be_bytes(g[0..8].try_into().unwrap()), NBDMAGIC);
        assert_eq!(u64::from_be_bytes(g[8..16].try_into().unwrap()), IHAVEOPT);
        assert_eq!(
            u16::from_be_bytes([g[16], g[17]]),
            FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES
        );
        raw
    }

    pub async fn send(&mut self, b: &[u8]) {
        tokio::time::timeout(IO_TIMEOUT, self.s.write_all(b))
            .await
            .expect("send timed out")
            .unwrap();
    }

    pub async fn read_exact(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        tokio::time::timeout(IO_TIMEOUT, self.s.read_exact(&mut b))
            .await
            .expect("timed out waiting for the server")
            .unwrap();
        b
    }

    pub async fn flags(&mut self, f: u32) {
        self.send(&f.to_be_bytes()).await;
    }

    pub async fn option(&mut self, opt: u32, data: &[u8]) {
        self.send(&option_frame(IHAVEOPT, opt, data.len() as u32, data))
            .await;
    }

    pub async fn option_reply(&mut self) -> OptReply {
        let h = self.read_exact(20).await;
        assert_eq!(
            u64::from_be_bytes(h[0..8].try_into().unwrap()),
            REPLY_MAGIC_OPT,
            "bad option reply magic"
        );
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        assert!(len <= 64 << 10, "option reply of {len} bytes");
        let data = self.read_exact(len as usize).await;
        OptReply { opt, kind, data }
    }

    /// Send `opt` and expect exactly one reply: an error of `kind` (or an ACK).
    pub async fn option_expect(&mut self, opt: u32, data: &[u8], kind: u32) {
        self.option(opt, data).await;
        let r = self.option_reply().await;
        assert_eq!(r.opt, opt, "reply names another option: {r:?}");
        assert_eq!(r.kind, kind, "option {opt}: {r:?}");
    }

    /// All replies to one INFO or GO, up to and including the final one.
    pub async fn info_replies(&mut self, opt: u32, export: &[u8], infos: &[u16]) -> Vec<OptReply> {
        self.option(opt, &go_data(export, infos)).await;
        let mut replies = Vec::new();
        loop {
            let r = self.option_reply().await;
            assert_eq!(r.opt, opt);
            let last = r.kind != REP_INFO;
            replies.push(r);
            if last {
                return replies;
            }
        }
    }

    /// OPT_GO to `export`; returns (size, transmission flags).
    pub async fn go(&mut self, export: &str) -> (u64, u16) {
        let replies = self
            .info_replies(OPT_GO, export.as_bytes(), &[INFO_BLOCK_SIZE])
            .await;
        let last = replies.last().unwrap();
        assert_eq!(last.kind, REP_ACK, "GO {export:?} refused: {last:?}");
        export_info(&replies).expect("GO acknowledged without INFO_EXPORT")
    }

    /// Send the request `r` followed by `payload` (which need not be `r.length` long).
    pub async fn request_with(&mut self, r: Request, payload: &[u8]) {
        let mut b = r.encode().to_vec();
        b.extend_from_slice(payload);
        self.send(&b).await;
    }

    pub async fn request(&mut self, kind: u16, flags: u16, cookie: u64, offset: u64, length: u32) {
        self.request_with(req(kind, flags, cookie, offset, length), &[])
            .await;
    }

    pub async fn write(&mut self, flags: u16, cookie: u64, offset: u64, data: &[u8]) {
        self.request_with(
            req(CMD_WRITE, flags, cookie, offset, data.len() as u32),
            data,
        )
        .await;
    }

    /// Read one simple reply: (errno, cookie).
    pub async fn reply(&mut self) -> (u32, u64) {
        let h = self.read_exact(SIMPLE_REPLY_LEN).await;
        let (magic, errno, cookie) = simple_reply_fields(&h);
        assert_eq!(magic, SIMPLE_REPLY_MAGIC, "bad reply magic");
        (errno, cookie)
    }

    /// Send one request and expect an error reply with `errno` and no payload.
    pub async fn expect_errno(&mut self, r: Request, payload: &[u8], errno: u32) {
        self.request_with(r, payload).await;
        let (got, cookie) = self.reply().await;
        assert_eq!(cookie, r.cookie);
        assert_eq!(got, errno, "{r:?}: errno {got}, expected {errno}");
    }

    /// A valid write and read on this connection: it is still in step with the server.
    pub async fn still_in_step(&mut self, offset: u64) {
        let data = pattern(0x3c, offset, 4096);
        self.write(0, 9001, offset, &data).await;
        assert_eq!(self.reply().await, (0, 9001));
        self.request(CMD_READ, 0, 9002, offset, 4096).await;
        assert_eq!(self.reply().await, (0, 9002));
        assert!(self.read_exact(4096).await == data);
    }

    /// Half-close our side: the server sees end of input.
    pub async fn close_write(&mut self) {
        self.s.shutdown().await.unwrap();
    }

    /// Read until the server closes the connection, by an orderly close or a reset;
    /// returns what it sent before that.
    pub async fn expect_closed(&mut self) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match tokio::time::timeout(IO_TIMEOUT, self.s.read(&mut buf)).await {
                Err(_) => panic!(
                    "the server kept the connection open (after {} bytes)",
                    got.len()
                ),
                Ok(Ok(0)) => return got,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Ok(Err(e)) if is_disconnect(&e) => return got,
                Ok(Err(e)) => panic!("unexpected socket error: {e}"),
            }
        }
    }

    /// Read until the server closes; returns what it sent before that. A reset counts as
    /// a failure here: every case using this expects an orderly close.
    pub async fn expect_eof(&mut self) -> Vec<u8> {
        let mut got = Vec::new();
        match tokio::time::timeout(IO_TIMEOUT, self.s.read_to_end(&mut got)).await {
            Err(_) => panic!("the server kept the connection open"),
            Ok(Ok(_)) => got,
            Ok(Err(e)) => panic!(
                "the connection was reset instead of closed ({e}) after {} bytes",
                got.len()
            ),
        }
    }
}

/// Whether `e` says the peer closed the connection hard.
pub fn is_disconnect(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        IoKind::ConnectionReset | IoKind::BrokenPipe | IoKind::ConnectionAborted
    )
}

/// An option request as sent on the wire: `magic`, `opt`, the length field `len` (which
/// need not match), then `data`.
pub fn option_frame(magic: u64, opt: u32, len: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&magic.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// (magic, errno, cookie) of the simple reply at the start of `h`.
pub fn simple_reply_fields(h: &[u8]) -> (u32, u32, u64) {
    (
        u32::from_be_bytes(h[0..4].try_into().unwrap()),
        u32::from_be_bytes(h[4..8].try_into().unwrap()),
        u64::from_be_bytes(h[8..16].try_into().unwrap()),
    )
}

/// Data of an OPT_INFO / OPT_GO request.
pub fn go_data(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
    d.extend_from_slice(name);
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// (size, flags) from the INFO_EXPORT among `replies`.
pub fn export_info(replies: &[OptReply]) -> Option<(u64, u16)> {
    replies.iter().find_map(|r| {
        (r.kind == REP_INFO && r.data.get(0..2) == Some(&INFO_EXPORT.to_be_bytes()[..])).then(
            || {
                assert_eq!(r.data.len(), 12, "INFO_EXPORT is 12 bytes");
                (
                    u64::from_be_bytes(r.data[2..10].try_into().unwrap()),
                    u16::from_be_bytes([r.data[10], r.data[11]]),
                )
            },
        )
    })
}

/// The payload of the info item `info` among `replies`.
pub fn info_item(replies: &[OptReply], info: u16) -> Option<&[u8]> {
    replies.iter().find_map(|r| {
        (r.kind == REP_INFO && r.data.get(0..2) == Some(&info.to_be_bytes()[..]))
            .then(|| &r.data[2..])
    })
}

pub fn req(kind: u16, flags: u16, cookie: u64, offset: u64, length: u32) -> Request {
    Request {
        flags,
        kind,
        cookie,
        offset,
        length,
    }
}

/// A device that batches the way a mirror does: a write started while a
/// [`Plug`](vsan_core::plug::Plug) is held waits for the unplug; one started without a
/// plug is carried out at once. It counts which of the two each write was.
pub struct PlugProbe {
    me: std::sync::Weak<PlugProbe>,
    inner: MemDevice,
    pub state: std::sync::Mutex<ProbeState>,
}

#[derive(Default)]
pub struct ProbeState {
    /// Writes waiting for the unplug.
    pub queued: Vec<tokio::sync::oneshot::Sender<()>>,
    /// Writes started under a plug.
    pub plugged: u64,
    /// Writes started without one.
    pub unplugged: u64,
    /// Unplugs that released at least one write.
    pub batches: u64,
}

impl PlugProbe {
    /// A probe over a fresh [`SIZE`]-byte memory device of [`BS`]-byte blocks.
    pub fn new() -> Arc<PlugProbe> {
        Arc::new_cyclic(|me| PlugProbe {
            me: me.clone(),
            inner: MemDevice::new(Geometry::new(SIZE, BS as u32).unwrap()),
            state: Default::default(),
        })
    }
}

impl vsan_core::plug::Unplug for PlugProbe {
    fn unplug(&self) {
        let mut st = self.state.lock().unwrap();
        if !st.queued.is_empty() {
            st.batches += 1;
        }
        for tx in st.queued.drain(..) {
            let _ = tx.send(());
        }
    }
}

impl BlockDevice for PlugProbe {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn read(&self, offset: u64, len: usize) -> vsan_core::IoFuture<'_, Bytes> {
        self.inner.read(offset, len)
    }
    fn write(
        &self,
        offset: u64,
        data: Bytes,
        flags: vsan_core::IoFlags,
    ) -> vsan_core::IoFuture<'_, ()> {
        Box::pin(async move {
            // (On the first poll, as a mirror's request submits itself.)
            let me = self.me.upgrade().expect("the probe is alive");
            let wait = if vsan_core::plug::defer(&me) {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let mut st = self.state.lock().unwrap();
                st.queued.push(tx);
                st.plugged += 1;
                Some(rx)
            } else {
                self.state.lock().unwrap().unplugged += 1;
                None
            };
            if let Some(rx) = wait {
                rx.await.expect("the unplug releases every queued write");
            }
            self.inner.write(offset, data, flags).await
        })
    }
    fn flush(&self) -> vsan_core::IoFuture<'_, ()> {
        self.inner.flush()
    }
    fn discard(
        &self,
        offset: u64,
        len: u64,
        flags: vsan_core::IoFlags,
    ) -> vsan_core::IoFuture<'_, ()> {
        self.inner.discard(offset, len, flags)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: vsan_core::IoFlags,
    ) -> vsan_core::IoFuture<'_, ()> {
        self.inner.write_zeroes(offset, len, flags)
    }
}
