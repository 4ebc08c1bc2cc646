//! The quorum witness of a two-node mirror: a tiny TCP service that holds no data and
//! breaks the tie when the link between the two nodes of a mirrored disk is cut.
//!
//! ```text
//!   node 1 ──── replication link ──── node 2
//!      \           (cut)               /
//!       \  CLAIM 1 vol0               / CLAIM 2 vol0
//!        \   -> GRANTED              /   -> DENIED 1
//!         └──────── witness ────────┘
//!                 vol0 -> holder 1
//! ```
//!
//! A node that lost its peer may keep serving a disk only while it holds the witness's
//! grant for that disk; the other node, denied, stops serving it. So at most one side of
//! a split keeps writing, and the two replicas cannot diverge.
//!
//! # Rules
//!
//! Per disk name the witness records at most one *holder* node id.
//!
//! - `CLAIM` from node N: granted if the disk has no holder or N already holds it (N is
//!   then the holder); otherwise denied, naming the holder.
//! - `RELEASE` from node N: clears the holder if it is N. A node sends it once it is
//!   connected to its peer again and the two are in sync. It is idempotent: releasing a
//!   disk one does not hold answers `OK` and changes nothing.
//! - **A holder stays the holder even when it disconnects from the witness** (or dies):
//!   its replica may be the only up-to-date copy, and granting the other node would let
//!   it serve stale data. The grant only ends by `RELEASE` from the holder.
//!
//! **Operator escape:** if the holder is gone for good (its disk is lost), stop the
//! witness, edit or delete its `--state` file (or restart it without one), and start it
//! again; the surviving node's next `CLAIM` is then granted. Do this only when certain
//! the holder will not come back serving the old data.
//!
//! # Protocol
//!
//! Newline-terminated UTF-8 text over TCP, one request line and one reply line per round
//! trip; a connection may carry any number of round trips.
//!
//! | request                  | reply                         |
//! |--------------------------|-------------------------------|
//! | `CLAIM <node_id> <disk>` | `GRANTED` or `DENIED <holder_id>` |
//! | `RELEASE <node_id> <disk>` | `OK`                        |
//! | `PING`                   | `PONG`                        |
//! | anything else            | `ERR <why>`                   |
//!
//! `<node_id>` is a decimal `u32`; `<disk>` is a token of non-whitespace characters.
//! Tokens are separated by whitespace; a trailing `\r` is ignored. A malformed request
//! gets `ERR <why>` and the connection stays usable. A line longer than [`MAX_LINE`]
//! bytes gets `ERR` and the rest of it is skipped; if its end does not come within
//! 64 KiB the connection is closed. If the witness cannot persist a change it answers
//! `ERR` and keeps its previous decision. A connection idle for [`IDLE_TIMEOUT`] is
//! closed.
//!
//! # Persistence
//!
//! With a state file, every change of holders is written to it (temporary file, fsync,
//! rename, fsync of the directory) *before* the reply, and the file is loaded at start, so
//! a restarted witness keeps its decisions. The file is plain text, one `<disk>
//! <node_id>` line per held disk, so an operator can read and edit it (while the witness
//! is stopped). A missing file means no holders.
//!
//! [`serve`] runs the witness; [`WitnessClient`] is a node's handle on it.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};
use vsan_core::{Error, ErrorKind, Result};

/// The longest request or reply line, in bytes, without its newline.
pub const MAX_LINE: usize = 4096;

/// How long the witness keeps a connection that sends no complete request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How much of an overlong request line the witness skips, looking for its end, before
/// it gives up on the connection.
const MAX_SKIP: usize = 64 * 1024;

/// How long [`WitnessClient`] waits for connect plus reply, together.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

/// Serve the witness on `listener` until the task is dropped/aborted. `state`: optional
/// persistence file.
///
/// The state file is loaded (a missing one means no holders) and written back before
/// the first connection is accepted, so an unreadable, corrupt or unwritable state file
/// is reported here rather than at the first claim. Otherwise it only returns on error;
/// dropping the future closes every connection it serves.
pub async fn serve(listener: TcpListener, state: Option<PathBuf>) -> Result<()> {
    let holders = match &state {
        Some(path) => {
            let p = path.clone();
            let holders = blocking(move || load_state(&p)).await?;
            let (p, h) = (path.clone(), holders.clone());
            blocking(move || persist(&p, &h)).await?;
            info!(path = %path.display(), held = holders.len(), "witness state loaded");
            holders
        }
        None => BTreeMap::new(),
    };
    let registry = Arc::new(Mutex::new(Registry { holders, state }));
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "witness listening");
    }

    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let registry = Arc::clone(&registry);
                    conns.spawn(async move {
                        if let Err(e) = serve_connection(stream, &registry).await {
                            debug!(%peer, "witness connection ended: {e}");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: the condition may pass, and
                    // the witness must outlive it rather than spin.
                    warn!("witness accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// The holders and where they are persisted.
struct Registry {
    holders: BTreeMap<String, u32>,
    state: Option<PathBuf>,
}

impl Registry {
    /// Persist `next` (if there is a state file) and only then adopt it.
    async fn commit(&mut self, next: BTreeMap<String, u32>) -> Result<()> {
        if let Some(path) = &self.state {
            let (p, h) = (path.clone(), next.clone());
            blocking(move || persist(&p, &h)).await?;
        }
        self.holders = next;
        Ok(())
    }

    async fn claim(&mut self, node: u32, disk: &str) -> Result<Reply> {
        match self.holders.get(disk) {
            Some(&holder) if holder == node => {
                debug!(disk, node, "claim: already the holder");
                Ok(Reply::Granted)
            }
            Some(&holder) => {
                info!(
                    disk,
                    node, holder, "claim denied: another node holds the disk"
                );
                Ok(Reply::Denied(holder))
            }
            None => {
                let mut next = self.holders.clone();
                next.insert(disk.to_string(), node);
                self.commit(next).await?;
                info!(disk, node, "claim granted: node is now the holder");
                Ok(Reply::Granted)
            }
        }
    }

    async fn release(&mut self, node: u32, disk: &str) -> Result<Reply> {
        match self.holders.get(disk) {
            Some(&holder) if holder == node => {
                let mut next = self.holders.clone();
                next.remove(disk);
                self.commit(next).await?;
                info!(disk, node, "released: the disk has no holder");
            }
            Some(&holder) => debug!(disk, node, holder, "release by a non-holder: ignored"),
            None => debug!(disk, node, "release of a disk without holder: ignored"),
        }
        Ok(Reply::Ok)
    }
}

/// A parsed request line.
#[derive(Debug, PartialEq, Eq)]
enum Request<'a> {
    Claim { node: u32, disk: &'a str },
    Release { node: u32, disk: &'a str },
    Ping,
}

/// A reply line.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    Granted,
    Denied(u32),
    Ok,
    Pong,
    Err(String),
}

impl Reply {
    fn line(&self) -> String {
        match self {
            Reply::Granted => "GRANTED\n".to_string(),
            Reply::Denied(holder) => format!("DENIED {holder}\n"),
            Reply::Ok => "OK\n".to_string(),
            Reply::Pong => "PONG\n".to_string(),
            Reply::Err(why) => {
                // One line of at most MAX_LINE bytes, whatever the message holds.
                let mut line = String::from("ERR ");
                for c in why.chars().map(|c| if c.is_control() { ' ' } else { c }) {
                    if line.len() + c.len_utf8() > MAX_LINE {
                        break;
                    }
                    line.push(c);
                }
                line.push('\n');
                line
            }
        }
    }
}

/// A request line as the witness protocol has it; a line that breaks the protocol is
/// [`ErrorKind::Protocol`], saying how (its text is what the client is answered).
fn parse_request(line: &str) -> Result<Request<'_>> {
    let refused = |why: String| Error::new(ErrorKind::Protocol, why);
    let mut tokens = line.split_whitespace();
    let Some(verb) = tokens.next() else {
        return Err(refused("empty request".into()));
    };
    let request = match verb {
        "PING" => Request::Ping,
        "CLAIM" | "RELEASE" => {
            let node = tokens
                .next()
                .ok_or_else(|| refused(format!("{verb} needs <node_id> <disk>")))?;
            let node: u32 = node
                .parse()
                .map_err(|_| refused(format!("bad node id {:?}", clip(node))))?;
            let disk = tokens
                .next()
                .ok_or_else(|| refused(format!("{verb} needs <node_id> <disk>")))?;
            if verb == "CLAIM" {
                Request::Claim { node, disk }
            } else {
                Request::Release { node, disk }
            }
        }
        other => return Err(refused(format!("unknown request {:?}", clip(other)))),
    };
    if tokens.next().is_some() {
        return Err(refused(format!("too many arguments for {verb}")));
    }
    Ok(request)
}

/// At most 64 characters of `s`, for echoing client input in an error.
fn clip(s: &str) -> &str {
    match s.char_indices().nth(64) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// How reading one request line ended.
enum Line {
    /// A complete line, newline and `\r` removed.
    Complete(Vec<u8>),
    /// More than [`MAX_LINE`] bytes without a newline.
    TooLong,
    /// The peer closed the connection (a partial last line is dropped).
    Eof,
}

/// Read one line of at most [`MAX_LINE`] bytes.
async fn read_line(reader: &mut (impl AsyncBufRead + Unpin)) -> Result<Line> {
    let mut buf = Vec::new();
    let limit = (MAX_LINE + 1) as u64;
    reader
        .take(limit)
        .read_until(b'\n', &mut buf)
        .await
        .map_err(|e| Error::io("witness: read a line", e))?;
    if buf.last() == Some(&b'\n') {
        buf.pop();
        if buf.last() == Some(&b'\r') {
            buf.pop();
        }
        if buf.len() > MAX_LINE {
            return Ok(Line::TooLong);
        }
        return Ok(Line::Complete(buf));
    }
    if buf.len() > MAX_LINE {
        Ok(Line::TooLong)
    } else {
        Ok(Line::Eof)
    }
}

async fn serve_connection(stream: TcpStream, registry: &Mutex<Registry>) -> Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let line = match tokio::time::timeout(IDLE_TIMEOUT, read_line(&mut reader)).await {
            Ok(line) => line?,
            Err(_) => return Err(Error::new(ErrorKind::Timeout, "witness: idle connection")),
        };
        let too_long = matches!(line, Line::TooLong);
        let reply = match line {
            Line::Eof => return Ok(()),
            Line::TooLong => Reply::Err(format!("line longer than {MAX_LINE} bytes")),
            Line::Complete(bytes) => answer(&bytes, registry).await,
        };
        write
            .write_all(reply.line().as_bytes())
            .await
            .map_err(|e| Error::io("witness: write a reply", e))?;
        if too_long {
            let skipped = tokio::time::timeout(IDLE_TIMEOUT, skip_line(&mut reader)).await;
            if !matches!(skipped, Ok(Ok(true))) {
                return Ok(());
            }
        }
    }
}

/// Discard the rest of an overlong line. `Ok(true)`: its end was found and the next
/// request can be read; `Ok(false)`: end of stream, or no end within [`MAX_SKIP`] bytes.
async fn skip_line(reader: &mut (impl AsyncBufRead + Unpin)) -> Result<bool> {
    let mut skipped = 0;
    loop {
        let buf = reader
            .fill_buf()
            .await
            .map_err(|e| Error::io("witness: skip a long line", e))?;
        if buf.is_empty() {
            return Ok(false);
        }
        if let Some(end) = buf.iter().position(|&b| b == b'\n') {
            reader.consume(end + 1);
            return Ok(true);
        }
        let n = buf.len();
        reader.consume(n);
        skipped += n;
        if skipped > MAX_SKIP {
            return Ok(false);
        }
    }
}

async fn answer(bytes: &[u8], registry: &Mutex<Registry>) -> Reply {
    let Ok(line) = std::str::from_utf8(bytes) else {
        return Reply::Err("request is not UTF-8".into());
    };
    let request = match parse_request(line) {
        Ok(r) => r,
        Err(why) => return Reply::Err(why.context().to_string()),
    };
    let result = match request {
        Request::Ping => return Reply::Pong,
        Request::Claim { node, disk } => registry.lock().await.claim(node, disk).await,
        Request::Release { node, disk } => registry.lock().await.release(node, disk).await,
    };
    result.unwrap_or_else(|e| {
        warn!("witness: {e}");
        Reply::Err(e.to_string())
    })
}

/// Run blocking file I/O off the runtime's workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::with_source(ErrorKind::Io, "witness: state file task failed", e))?
}

/// Read the holders from `path`; a missing file means none.
fn load_state(path: &Path) -> Result<BTreeMap<String, u32>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => {
            return Err(Error::io(
                format!("witness: read state file {}", path.display()),
                e,
            ));
        }
    };
    let mut holders = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let corrupt = |why: &str| {
            Error::new(
                ErrorKind::Corrupt,
                format!(
                    "witness: state file {} line {}: {why} (want `<disk> <node_id>`)",
                    path.display(),
                    i + 1
                ),
            )
        };
        let mut tokens = line.split_whitespace();
        let Some(disk) = tokens.next() else { continue };
        let node = tokens.next().ok_or_else(|| corrupt("no node id"))?;
        let node: u32 = node.parse().map_err(|_| corrupt("bad node id"))?;
        if tokens.next().is_some() {
            return Err(corrupt("too many fields"));
        }
        if holders.insert(disk.to_string(), node).is_some() {
            return Err(corrupt("disk listed twice"));
        }
    }
    Ok(holders)
}

/// Write the holders to `path` atomically and durably: a temporary file next to it,
/// fsync, rename over it, fsync of the directory.
fn persist(path: &Path, holders: &BTreeMap<String, u32>) -> Result<()> {
    let ctx = |what: &str| format!("witness: {what} state file {}", path.display());
    let name = path
        .file_name()
        .ok_or_else(|| Error::new(ErrorKind::InvalidArgument, ctx("no file name in")))?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let mut text = String::new();
    for (disk, node) in holders {
        text.push_str(&format!("{disk} {node}\n"));
    }
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| Error::io(ctx("write"), e))
}

/// A node's handle on the witness.
///
/// Each call opens a fresh TCP connection and must finish (connect plus reply) within
/// [`CLIENT_TIMEOUT`].
#[derive(Debug, Clone)]
pub struct WitnessClient {
    addr: String,
    node_id: u32,
}

impl WitnessClient {
    /// A client for the witness at `addr` (`host:port`), speaking for node `node_id`.
    pub fn new(addr: impl Into<String>, node_id: u32) -> WitnessClient {
        WitnessClient {
            addr: addr.into(),
            node_id,
        }
    }

    /// The witness's address as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Ok(true): granted; Ok(false): denied (another node holds it); Err: witness
    /// unreachable or broken reply. Each call opens a fresh TCP connection with a 1 s
    /// connect+reply timeout (simple and robust; no connection pooling needed).
    pub async fn claim(&self, disk: &str) -> Result<bool> {
        check_disk_name(disk)?;
        let reply = self
            .round_trip(&format!("CLAIM {} {disk}", self.node_id))
            .await?;
        if reply == "GRANTED" {
            return Ok(true);
        }
        let holder = reply
            .strip_prefix("DENIED ")
            .and_then(|h| h.parse::<u32>().ok());
        if let Some(holder) = holder {
            debug!(disk, holder, witness = %self.addr, "witness denied the claim");
            return Ok(false);
        }
        Err(self.unexpected("CLAIM", &reply))
    }

    /// Give up this node's grant for `disk` (a no-op at the witness if it holds none).
    /// Err: witness unreachable or broken reply.
    pub async fn release(&self, disk: &str) -> Result<()> {
        check_disk_name(disk)?;
        let reply = self
            .round_trip(&format!("RELEASE {} {disk}", self.node_id))
            .await?;
        if reply == "OK" {
            Ok(())
        } else {
            Err(self.unexpected("RELEASE", &reply))
        }
    }

    fn unexpected(&self, what: &str, reply: &str) -> Error {
        let kind = if reply.starts_with("ERR") {
            ErrorKind::Io
        } else {
            ErrorKind::Protocol
        };
        Error::new(
            kind,
            format!("witness {}: {what} answered {:?}", self.addr, clip(reply)),
        )
    }

    /// Send one request line and read the reply line, all within [`CLIENT_TIMEOUT`].
    async fn round_trip(&self, request: &str) -> Result<String> {
        let exchange = async {
            let mut stream = TcpStream::connect(&self.addr)
                .await
                .map_err(|e| Error::io(format!("witness {}: connect", self.addr), e))?;
            let _ = stream.set_nodelay(true);
            stream
                .write_all(format!("{request}\n").as_bytes())
                .await
                .map_err(|e| Error::io(format!("witness {}: send", self.addr), e))?;
            let mut reader = BufReader::new(stream);
            match read_line(&mut reader)
                .await
                .map_err(|e| e.context_prefix(format!("witness {}", self.addr)))?
            {
                Line::Complete(bytes) => String::from_utf8(bytes).map_err(|_| {
                    Error::new(
                        ErrorKind::Protocol,
                        format!("witness {}: reply is not UTF-8", self.addr),
                    )
                }),
                Line::TooLong => Err(Error::new(
                    ErrorKind::Protocol,
                    format!("witness {}: reply longer than {MAX_LINE} bytes", self.addr),
                )),
                Line::Eof => Err(Error::new(
                    ErrorKind::Closed,
                    format!(
                        "witness {}: closed the connection without a reply",
                        self.addr
                    ),
                )),
            }
        };
        match tokio::time::timeout(CLIENT_TIMEOUT, exchange).await {
            Ok(reply) => reply,
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!("witness {}: no reply within {CLIENT_TIMEOUT:?}", self.addr),
            )),
        }
    }
}

/// A disk name must be one protocol token.
fn check_disk_name(disk: &str) -> Result<()> {
    if disk.is_empty() || disk.chars().any(char::is_whitespace) || disk.len() > MAX_LINE / 2 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "witness: disk name {:?} must be 1 to {} bytes without whitespace",
                clip(disk),
                MAX_LINE / 2
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_or_explain() {
        assert_eq!(parse_request("PING").ok(), Some(Request::Ping));
        assert_eq!(
            parse_request("CLAIM 7 vol0").ok(),
            Some(Request::Claim {
                node: 7,
                disk: "vol0"
            })
        );
        assert_eq!(
            parse_request("  RELEASE\t2  vol-1 ").ok(),
            Some(Request::Release {
                node: 2,
                disk: "vol-1"
            })
        );
        for bad in [
            "",
            "   ",
            "ping",
            "CLAIM",
            "CLAIM 1",
            "CLAIM x vol0",
            "CLAIM -1 vol0",
            "CLAIM 4294967296 vol0",
            "CLAIM 1 vol0 extra",
            "PING PONG",
            "HELLO",
        ] {
            assert!(parse_request(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn error_replies_stay_on_one_line() {
        let line = Reply::Err("a\nb\r\nc".into()).line();
        assert_eq!(line, "ERR a b  c\n");
    }

    #[test]
    fn state_file_round_trips_and_rejects_garbage() {
        let dir = std::env::temp_dir().join(format!("vsan-witness-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("holders");
        assert!(load_state(&path).unwrap().is_empty());
        let mut h = BTreeMap::new();
        h.insert("vol0".to_string(), 1);
        h.insert("vol1".to_string(), 2);
        persist(&path, &h).unwrap();
        assert_eq!(load_state(&path).unwrap(), h);
        std::fs::write(&path, "vol0 one\n").unwrap();
        assert_eq!(load_state(&path).unwrap_err().kind(), ErrorKind::Corrupt);
        std::fs::write(&path, "vol0 1\nvol0 2\n").unwrap();
        assert_eq!(load_state(&path).unwrap_err().kind(), ErrorKind::Corrupt);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
