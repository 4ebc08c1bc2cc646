//! A small pipelined NBD client: fixed newstyle with `NBD_OPT_GO`, simple replies.
//!
//! Used by the demo, the benchmark driver and tests to talk to any NBD server (ours or
//! others). Methods take `&self`; many requests can be in flight at once from many tasks:
//! a reader task routes each reply to its waiter by cookie.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::oneshot;

use super::proto::*;
use super::server::Stream;
use crate::error::{Error, ErrorKind, Result};

type Waiters = HashMap<u64, (usize, oneshot::Sender<Result<Bytes>>)>;

struct Shared {
    writer: tokio::sync::Mutex<WriteHalf<Box<dyn Stream>>>,
    waiters: Mutex<Option<Waiters>>,
    next_cookie: AtomicU64,
}

/// What the server told us about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    /// Size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
    /// Minimum block size (1 if the server sent none).
    pub min_block: u32,
    /// Preferred block size.
    pub preferred_block: u32,
    /// Maximum request size.
    pub max_block: u32,
}

/// A connected NBD client.
pub struct Client {
    shared: Arc<Shared>,
    info: ExportInfo,
    reader: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

fn proto_err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, msg)
}

impl Client {
    /// Connect over TCP and attach to `export` ("" for the server's default).
    pub async fn connect_tcp(addr: &str, export: &str) -> Result<Client> {
        let s = TcpStream::connect(addr)
            .await
            .map_err(|e| Error::io(format!("connect to {addr}"), e))?;
        let _ = s.set_nodelay(true);
        Client::handshake(Box::new(s), export).await
    }

    /// Connect over a Unix socket and attach to `export`.
    pub async fn connect_unix(path: impl AsRef<Path>, export: &str) -> Result<Client> {
        let path = path.as_ref();
        let s = UnixStream::connect(path)
            .await
            .map_err(|e| Error::io(format!("connect to {}", path.display()), e))?;
        Client::handshake(Box::new(s), export).await
    }

    /// Negotiate on an already-connected stream.
    pub async fn handshake(mut s: Box<dyn Stream>, export: &str) -> Result<Client> {
        let info = negotiate(&mut s, export).await?;
        let (rd, wr) = tokio::io::split(s);
        let shared = Arc::new(Shared {
            writer: tokio::sync::Mutex::new(wr),
            waiters: Mutex::new(Some(HashMap::new())),
            next_cookie: AtomicU64::new(1),
        });
        let reader = tokio::spawn(read_replies(rd, Arc::clone(&shared)));
        Ok(Client {
            shared,
            info,
            reader,
        })
    }

    /// What the server said about the export.
    pub fn info(&self) -> ExportInfo {
        self.info
    }

    /// Export size in bytes.
    pub fn size(&self) -> u64 {
        self.info.size
    }

    async fn request(
        &self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: Option<&[u8]>,
    ) -> Result<Bytes> {
        let cookie = self.shared.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let read_len = if kind == CMD_READ { length as usize } else { 0 };
        match self.shared.waiters.lock().as_mut() {
            Some(w) => w.insert(cookie, (read_len, tx)),
            None => return Err(Error::new(ErrorKind::Closed, "NBD connection is closed")),
        };
        let head = Request {
            flags,
            kind,
            cookie,
            offset,
            length,
        }
        .encode();
        // Header and payload in one write: one syscall, and no half-request for the
        // server to wait on.
        let mut req = BytesMut::with_capacity(head.len() + payload.map_or(0, <[u8]>::len));
        req.put_slice(&head);
        if let Some(p) = payload {
            req.put_slice(p);
        }
        {
            let mut w = self.shared.writer.lock().await;
            let sent = w.write_all(&req).await;
            if let Err(e) = sent {
                if let Some(w) = self.shared.waiters.lock().as_mut() {
                    w.remove(&cookie);
                }
                return Err(Error::io("send NBD request", e));
            }
        }
        rx.await
            .map_err(|_| Error::new(ErrorKind::Closed, "NBD connection closed before the reply"))?
    }

    /// Read `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes> {
        self.request(CMD_READ, 0, offset, len, None).await
    }

    /// Write `data` at `offset`, with FUA if `fua`.
    pub async fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.request(CMD_WRITE, flags, offset, data.len() as u32, Some(data))
            .await
            .map(drop)
    }

    /// Flush.
    pub async fn flush(&self) -> Result<()> {
        self.request(CMD_FLUSH, 0, 0, 0, None).await.map(drop)
    }

    /// Trim a range.
    pub async fn trim(&self, offset: u64, len: u32) -> Result<()> {
        self.request(CMD_TRIM, 0, offset, len, None).await.map(drop)
    }

    /// Write zeroes over a range.
    pub async fn write_zeroes(&self, offset: u64, len: u32) -> Result<()> {
        self.request(CMD_WRITE_ZEROES, 0, offset, len, None)
            .await
            .map(drop)
    }

    /// Send DISC and close the connection.
    pub async fn disconnect(self) -> Result<()> {
        let head = Request {
            flags: 0,
            kind: CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
        }
        .encode();
        let mut w = self.shared.writer.lock().await;
        w.write_all(&head)
            .await
            .map_err(|e| Error::io("send DISC", e))?;
        let _ = w.shutdown().await;
        Ok(())
    }
}

/// Negotiate (fixed newstyle, `NBD_OPT_GO` for `export`, "" for the server's default) on
/// an already-connected stream, leaving it in the transmission phase: for clients that
/// drive the transmission phase themselves (a load generator).
pub async fn negotiate<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    export: &str,
) -> Result<ExportInfo> {
    let io = |what: &'static str| move |e| Error::io(what, e);
    let magic = s.read_u64().await.map_err(io("read greeting"))?;
    let opt_magic = s.read_u64().await.map_err(io("read greeting"))?;
    let hflags = s.read_u16().await.map_err(io("read greeting"))?;
    if magic != NBDMAGIC || opt_magic != IHAVEOPT || hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(proto_err("server does not speak fixed newstyle NBD"));
    }
    let mut cflags = FLAG_C_FIXED_NEWSTYLE;
    if hflags & FLAG_NO_ZEROES != 0 {
        cflags |= FLAG_C_NO_ZEROES;
    }
    let mut b = BytesMut::new();
    b.put_u32(cflags);
    b.put_u64(IHAVEOPT);
    b.put_u32(OPT_GO);
    b.put_u32(4 + export.len() as u32 + 2 + 2);
    b.put_u32(export.len() as u32);
    b.put_slice(export.as_bytes());
    b.put_u16(1);
    b.put_u16(INFO_BLOCK_SIZE);
    s.write_all(&b).await.map_err(io("send GO"))?;

    let mut info = ExportInfo {
        size: 0,
        flags: 0,
        min_block: 1,
        preferred_block: 4096,
        max_block: 32 << 20,
    };
    let mut have_export = false;
    loop {
        let magic = s.read_u64().await.map_err(io("read option reply"))?;
        let _opt = s.read_u32().await.map_err(io("read option reply"))?;
        let kind = s.read_u32().await.map_err(io("read option reply"))?;
        let len = s.read_u32().await.map_err(io("read option reply"))?;
        if magic != REPLY_MAGIC_OPT || len > 1 << 20 {
            return Err(proto_err("bad option reply"));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)
            .await
            .map_err(io("read option reply"))?;
        match kind {
            REP_ACK if have_export => break,
            REP_INFO if data.len() >= 2 => {
                let be32 = |i: usize| {
                    data.get(i..i + 4)
                        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                };
                match u16::from_be_bytes([data[0], data[1]]) {
                    INFO_EXPORT if data.len() == 12 => {
                        let mut sz = [0u8; 8];
                        sz.copy_from_slice(&data[2..10]);
                        info.size = u64::from_be_bytes(sz);
                        info.flags = u16::from_be_bytes([data[10], data[11]]);
                        have_export = true;
                    }
                    INFO_BLOCK_SIZE if data.len() == 14 => {
                        info.min_block = be32(2).unwrap_or(1);
                        info.preferred_block = be32(6).unwrap_or(4096);
                        info.max_block = be32(10).unwrap_or(32 << 20);
                    }
                    _ => {}
                }
            }
            k if k & (1 << 31) != 0 => {
                let msg = String::from_utf8_lossy(&data);
                let ek = if k == REP_ERR_UNKNOWN {
                    ErrorKind::NotFound
                } else {
                    ErrorKind::Protocol
                };
                return Err(Error::new(
                    ek,
                    format!("server refused export {export:?}: {msg}"),
                ));
            }
            _ => return Err(proto_err(format!("unexpected option reply {kind}"))),
        }
    }

    Ok(info)
}

impl Drop for Client {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

async fn read_replies(rd: ReadHalf<Box<dyn Stream>>, shared: Arc<Shared>) {
    // Buffered: the replies of many requests in flight come in with one read.
    let mut rd = tokio::io::BufReader::with_capacity(256 << 10, rd);
    let err = loop {
        let mut head = [0u8; SIMPLE_REPLY_LEN];
        if let Err(e) = rd.read_exact(&mut head).await {
            // The server closing between replies is a closed connection, not an I/O
            // error, whichever of EOF or a reset the socket reports.
            break match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    Error::new(ErrorKind::Closed, "the NBD server closed the connection")
                }
                _ => Error::io("read NBD reply", e),
            };
        }
        let magic = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let errno = u32::from_be_bytes([head[4], head[5], head[6], head[7]]);
        let mut c = [0u8; 8];
        c.copy_from_slice(&head[8..16]);
        let cookie = u64::from_be_bytes(c);
        if magic != SIMPLE_REPLY_MAGIC {
            break proto_err(format!("bad reply magic {magic:#x}"));
        }
        let Some((read_len, tx)) = shared
            .waiters
            .lock()
            .as_mut()
            .and_then(|w| w.remove(&cookie))
        else {
            break proto_err(format!("reply for unknown cookie {cookie}"));
        };
        let result = if errno != 0 {
            Err(Error::new(
                kind_for_errno(errno),
                format!("server replied error {errno}"),
            ))
        } else if read_len > 0 {
            let mut buf = BytesMut::zeroed(read_len);
            if let Err(e) = rd.read_exact(&mut buf).await {
                let _ = tx.send(Err(Error::io("read NBD reply data", e)));
                break Error::new(ErrorKind::Closed, "connection lost");
            }
            Ok(buf.freeze())
        } else {
            Ok(Bytes::new())
        };
        let _ = tx.send(result);
    };
    let waiters = shared.waiters.lock().take();
    for (_, (_, tx)) in waiters.into_iter().flatten() {
        let _ = tx.send(Err(Error::new(err.kind(), err.to_string())));
    }
}
