//! The checks behind the NBD fuzz targets (`vsan-core/fuzz/`), shared with the test that
//! replays their committed corpora (`tests/nbd_corpus.rs`): one function per target.
//!
//! Each check runs one whole client session against the real [`Server`] — the same
//! [`Server::serve_connection`] a TCP or Unix client reaches, negotiation and
//! transmission — over an in-memory pipe, on a current-thread runtime whose clock is
//! paused: a session that stops making progress lets the clock jump to a deadline at
//! once, so a hang is a failure, not a stuck fuzzer. The input is everything the client
//! sends, in pieces whose sizes the input itself chooses (the server runs after each, so
//! it meets headers, options and payloads cut anywhere); the client then closes its side
//! and reads until the server closes.
//!
//! What the server sent is compared with what a model of the protocol, reading the same
//! input, says it must send: the greeting; for every option, its replies (exactly, except
//! the text of an error reply, which must only be UTF-8 of at most 4096 bytes); the
//! export information; for every request, its simple reply with the right error and, for
//! a read, the bytes the session's own earlier writes, trims and write-zeroes leave on a
//! model of the disk; and nothing more. How the session ends (an orderly close, or which
//! error kind) must match too. Only when the server drops a client mid-transmission for a
//! header it cannot trust may its replies stop early, at any byte.
//!
//! Not a stable API: compiled only with the `test-utils` feature, hidden from the docs.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::export::nbd::proto::*;
use crate::export::nbd::{Export, Server};
use crate::{ErrorKind, Geometry, MemDevice};

/// Size of every fuzzed export (four 64 KiB `MemDevice` segments).
pub const DISK_SIZE: u64 = 256 << 10;
/// Block size of every fuzzed export.
pub const BLOCK_SIZE: u32 = 512;
/// Largest read or write the fuzzed exports take in one request.
pub const MAX_IO: u32 = 64 << 10;
/// Largest write payload the server buffers (its documented limit); a longer write ends
/// the connection.
pub const MAX_WRITE_PAYLOAD: u32 = 64 << 20;
/// Options longer than this get `NBD_REP_ERR_TOO_BIG` (the server's limit).
pub const MAX_OPTION_LEN: u32 = 16 << 10;
/// Options longer than this end the connection unread (the server's limit).
pub const MAX_DISCARD_LEN: u32 = 1 << 20;
/// The longest error text an option reply may carry (the spec's limit on strings).
const MAX_ERROR_TEXT: usize = 4096;
/// Virtual time a session may take; reached only if the session stops making progress.
const DEADLINE: Duration = Duration::from_secs(3600);
/// Bytes the in-memory pipe buffers each way.
const PIPE: usize = 64 << 10;

/// One export of a fuzzed server (each is a fresh `MemDevice` of [`DISK_SIZE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportSpec {
    /// The export name.
    pub name: &'static str,
    /// Its description (empty: none, and `NBD_INFO_DESCRIPTION` is not sent).
    pub description: &'static str,
    /// Whether writes, trims and write-zeroes are refused with EPERM.
    pub read_only: bool,
}

/// The writable export every setup has.
pub const VOL0: ExportSpec = ExportSpec {
    name: "vol0",
    description: "fuzzed disk",
    read_only: false,
};

/// The read-only export of the second handshake setup, without a description.
pub const RO: ExportSpec = ExportSpec {
    name: "ro",
    description: "",
    read_only: true,
};

/// The servers `nbd_handshake` inputs are run against: one export (so an empty name
/// selects it), and two (so an empty name selects nothing, and one is read-only).
pub const HANDSHAKE_SETUPS: [&[ExportSpec]; 2] = [&[VOL0], &[VOL0, RO]];

/// What one session did, as the model predicted it and the server confirmed it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Session {
    /// The error kind `Server::serve_connection` ended with (`None`: it returned `Ok`).
    pub error: Option<ErrorKind>,
    /// Every option reply, as (option, reply type), in order.
    pub option_replies: Vec<(u32, u32)>,
    /// The option that started transmission (`OPT_GO` or `OPT_EXPORT_NAME`), if any.
    pub attached_by: Option<u32>,
    /// Transmission requests the server parsed (answered, or a DISC).
    pub requests: u64,
    /// Every transmission reply, as (command, error), in order.
    pub replies: Vec<(u16, u32)>,
    /// Non-zero bytes in the data of successful reads (written earlier in the session).
    pub nonzero_read_bytes: u64,
    /// The server dropped the client mid-transmission, so its replies may stop early.
    pub cut: bool,
}

/// `nbd_handshake`: `input` is what a client sends after the greeting (client flags,
/// then options, then — if an option starts transmission — requests), run against each
/// of [`HANDSHAKE_SETUPS`]. Panics if the server's output or end differ from the model's.
pub fn check_handshake(input: &[u8]) -> Vec<Session> {
    HANDSHAKE_SETUPS
        .iter()
        .map(|exports| check_session(exports, input))
        .collect()
}

/// `nbd_request`: byte 0 of `input` picks how the client attaches to the one export
/// `vol0` (bit 0: the export is read-only; bit 1: by `NBD_OPT_EXPORT_NAME` instead of
/// `NBD_OPT_GO`; bit 2: without `NBD_FLAG_C_NO_ZEROES`), see [`attach_prefix`]; the rest
/// is the transmission phase: request headers and write payloads. Panics if the server's
/// output or end differ from the model's.
pub fn check_request(input: &[u8]) -> Session {
    let mode = input.first().copied().unwrap_or(0);
    let export = ExportSpec {
        read_only: mode & 1 != 0,
        ..VOL0
    };
    let mut stream = attach_prefix(mode);
    stream.extend_from_slice(input.get(1..).unwrap_or_default());
    let session = check_session(&[export], &stream);
    assert!(
        session.attached_by.is_some(),
        "the attach prefix did not attach: {session:?}"
    );
    session
}

/// The bytes a client attaching to `vol0` sends after the greeting, for `mode` as in
/// [`check_request`]: client flags, then `NBD_OPT_GO` (asking for the block sizes) or
/// `NBD_OPT_EXPORT_NAME`.
pub fn attach_prefix(mode: u8) -> Vec<u8> {
    let mut flags = FLAG_C_FIXED_NEWSTYLE;
    if mode & 4 == 0 {
        flags |= FLAG_C_NO_ZEROES;
    }
    let mut out = flags.to_be_bytes().to_vec();
    if mode & 2 != 0 {
        out.extend_from_slice(&option_frame(OPT_EXPORT_NAME, VOL0.name.as_bytes()));
    } else {
        let data = info_data(VOL0.name.as_bytes(), &[INFO_BLOCK_SIZE]);
        out.extend_from_slice(&option_frame(OPT_GO, &data));
    }
    out
}

/// A client option: `IHAVEOPT`, the option, the length of `data`, `data`.
pub fn option_frame(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + data.len());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// The data of `NBD_OPT_INFO` / `NBD_OPT_GO`: name length, name, count, info types.
pub fn info_data(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut out = (name.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(name);
    out.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        out.extend_from_slice(&info.to_be_bytes());
    }
    out
}

/// Runs `input` as one client session against a server of `exports`, and checks the
/// server's output and end against the model. Panics on any difference.
pub fn check_session(exports: &[ExportSpec], input: &[u8]) -> Session {
    let mut model = Model::new(exports);
    model.run(input);
    let (output, result, served) = serve(exports, input);
    compare(&output, &model.expected, model.session.cut);
    assert_eq!(
        result.as_ref().err().map(|e| e.kind()),
        model.session.error,
        "the session ended differently from the model: {result:?}"
    );
    assert_eq!(
        served, model.session.requests,
        "the server counted a different number of requests"
    );
    model.session
}

thread_local! {
    /// One runtime per thread, reused by every session: a current-thread runtime with the
    /// clock paused, so timers fire as soon as nothing else can run.
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("build a current-thread runtime");
}

/// Serves `input` from a client that then closes its side, and returns everything the
/// server sent until it closed, how `serve_connection` ended, and the requests it served.
fn serve(exports: &[ExportSpec], input: &[u8]) -> (Vec<u8>, crate::Result<()>, u64) {
    let server = Server::new(
        exports
            .iter()
            .map(|e| {
                let geometry = Geometry::with_max_io(DISK_SIZE, BLOCK_SIZE, MAX_IO)
                    .expect("the fuzzed geometry is valid");
                Export::new(e.name, Arc::new(MemDevice::new(geometry)))
                    .with_description(e.description)
                    .read_only(e.read_only)
            })
            .collect(),
    )
    .expect("the fuzzed exports are valid");
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let (client, conn) = tokio::io::duplex(PIPE);
            let (mut rx, mut tx) = tokio::io::split(client);
            let send = async {
                // In pieces, letting the server run after each, so it also parses
                // headers and payloads that arrive split. The server may close before
                // reading everything: that is its right.
                let mut pieces = Pieces::new(input);
                let mut rest = input;
                while !rest.is_empty() {
                    let (piece, more) = rest.split_at(pieces.next(rest.len()));
                    if tx.write_all(piece).await.is_err() {
                        break;
                    }
                    tokio::task::yield_now().await;
                    rest = more;
                }
                let _ = tx.shutdown().await;
            };
            let receive = async {
                let mut out = Vec::new();
                rx.read_to_end(&mut out)
                    .await
                    .expect("reading an in-memory pipe cannot fail");
                out
            };
            let session =
                async { tokio::join!(server.serve_connection(conn, "fuzz"), send, receive) };
            match tokio::time::timeout(DEADLINE, session).await {
                Ok((result, (), output)) => (output, result, server.requests_served()),
                Err(_) => panic!("the session did not end: the server hangs"),
            }
        })
    })
}

/// Sizes of the pieces a client sends its input in: a small deterministic generator
/// (xorshift64*) seeded from the input, so a failure replays.
struct Pieces(u64);

impl Pieces {
    fn new(input: &[u8]) -> Pieces {
        // FNV-1a of the input and its length.
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ input.len() as u64;
        for &b in input {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        Pieces(h | 1)
    }

    /// The next piece size, 1 to `left`: a byte, a request header, everything left, or
    /// mostly up to 96 bytes.
    fn next(&mut self, left: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        let n = match r % 8 {
            0 => 1,
            1 => REQUEST_LEN,
            2 => left,
            _ => 1 + (r >> 8) as usize % 96,
        };
        n.clamp(1, left)
    }
}

/// A piece of the output the model expects.
#[derive(Debug)]
enum Expect {
    /// These exact bytes.
    Bytes(&'static str, Vec<u8>),
    /// An option error reply of this type to this option, with any short UTF-8 text.
    OptionError { opt: u32, kind: u32 },
}

/// The bytes of `input` not yet consumed.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    /// The next `n` bytes, or `None` (and nothing left) if fewer remain.
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            self.0 = &[];
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// What negotiation ended with, in the model.
enum Negotiated {
    /// Transmission on `exports[.0]`.
    Transmit(usize),
    /// The connection ends, with this error (`None`: an orderly end).
    End(Option<ErrorKind>),
}

/// The protocol as the spec and the server's documentation describe it, run on the
/// client's bytes alone.
struct Model<'a> {
    exports: &'a [ExportSpec],
    expected: Vec<Expect>,
    session: Session,
}

impl<'a> Model<'a> {
    fn new(exports: &'a [ExportSpec]) -> Model<'a> {
        Model {
            exports,
            expected: Vec::new(),
            session: Session::default(),
        }
    }

    fn run(&mut self, input: &[u8]) {
        let mut input = Input(input);
        self.session.error = match self.negotiate(&mut input) {
            Negotiated::End(error) => error,
            Negotiated::Transmit(i) => self.transmit(self.exports[i], &mut input),
        };
    }

    fn expect(&mut self, what: &'static str, bytes: Vec<u8>) {
        self.expected.push(Expect::Bytes(what, bytes));
    }

    fn reply(&mut self, opt: u32, kind: u32, data: &[u8]) {
        let mut b = Vec::with_capacity(20 + data.len());
        b.extend_from_slice(&REPLY_MAGIC_OPT.to_be_bytes());
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.expect("option reply", b);
        self.session.option_replies.push((opt, kind));
    }

    fn info(&mut self, opt: u32, info: u16, data: &[u8]) {
        let mut b = info.to_be_bytes().to_vec();
        b.extend_from_slice(data);
        self.reply(opt, REP_INFO, &b);
    }

    fn error(&mut self, opt: u32, kind: u32) {
        self.expected.push(Expect::OptionError { opt, kind });
        self.session.option_replies.push((opt, kind));
    }

    /// The export a name selects: by name, or the only one for an empty name.
    fn find(&self, name: &str) -> Option<usize> {
        if name.is_empty() && self.exports.len() == 1 {
            return Some(0);
        }
        self.exports.iter().position(|e| e.name == name)
    }

    fn negotiate(&mut self, input: &mut Input<'_>) -> Negotiated {
        use Negotiated::End;
        let mut greeting = NBDMAGIC.to_be_bytes().to_vec();
        greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
        greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        self.expect("greeting", greeting);

        // A client that hangs up mid-negotiation has gone away (Closed); one that breaks
        // the framing is dropped (Protocol).
        let Some(flags) = input.take(4) else {
            return End(Some(ErrorKind::Closed));
        };
        let flags = be32(flags);
        if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
            return End(Some(ErrorKind::Protocol));
        }
        let no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
        loop {
            let Some(head) = input.take(16) else {
                return End(Some(ErrorKind::Closed));
            };
            let (magic, opt, len) = (be64(&head[0..8]), be32(&head[8..12]), be32(&head[12..]));
            if magic != IHAVEOPT || len > MAX_DISCARD_LEN {
                return End(Some(ErrorKind::Protocol));
            }
            let Some(data) = input.take(len as usize) else {
                return End(Some(ErrorKind::Closed));
            };
            if opt == OPT_EXPORT_NAME {
                // No option reply can answer EXPORT_NAME (the client waits for the export
                // information): an export, or a closed connection.
                if len > MAX_OPTION_LEN {
                    return End(Some(ErrorKind::Protocol));
                }
                let Ok(name) = std::str::from_utf8(data) else {
                    return End(Some(ErrorKind::Protocol));
                };
                let Some(i) = self.find(name) else {
                    return End(Some(ErrorKind::NotFound));
                };
                let e = self.exports[i];
                let mut b = DISK_SIZE.to_be_bytes().to_vec();
                b.extend_from_slice(&transmission_flags(&e).to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0; 124]);
                }
                self.expect("EXPORT_NAME reply", b);
                self.session.attached_by = Some(OPT_EXPORT_NAME);
                return Negotiated::Transmit(i);
            }
            if len > MAX_OPTION_LEN {
                self.error(opt, REP_ERR_TOO_BIG);
                continue;
            }
            match opt {
                OPT_ABORT => {
                    self.reply(opt, REP_ACK, &[]);
                    return End(None);
                }
                OPT_LIST if !data.is_empty() => self.error(opt, REP_ERR_INVALID),
                OPT_LIST => {
                    for e in self.exports {
                        let mut b = (e.name.len() as u32).to_be_bytes().to_vec();
                        b.extend_from_slice(e.name.as_bytes());
                        b.extend_from_slice(e.description.as_bytes());
                        self.reply(opt, REP_SERVER, &b);
                    }
                    self.reply(opt, REP_ACK, &[]);
                }
                OPT_INFO | OPT_GO => {
                    let Some((name, infos)) = info_request(data) else {
                        self.error(opt, REP_ERR_INVALID);
                        continue;
                    };
                    let Some(i) = self.find(name) else {
                        self.error(opt, REP_ERR_UNKNOWN);
                        continue;
                    };
                    let e = self.exports[i];
                    let mut b = DISK_SIZE.to_be_bytes().to_vec();
                    b.extend_from_slice(&transmission_flags(&e).to_be_bytes());
                    self.info(opt, INFO_EXPORT, &b);
                    if infos.contains(&INFO_NAME) {
                        self.info(opt, INFO_NAME, e.name.as_bytes());
                    }
                    if infos.contains(&INFO_DESCRIPTION) && !e.description.is_empty() {
                        self.info(opt, INFO_DESCRIPTION, e.description.as_bytes());
                    }
                    // Sent whether asked for or not.
                    let mut b = BLOCK_SIZE.to_be_bytes().to_vec();
                    b.extend_from_slice(&BLOCK_SIZE.max(4096).to_be_bytes());
                    b.extend_from_slice(&MAX_IO.to_be_bytes());
                    self.info(opt, INFO_BLOCK_SIZE, &b);
                    self.reply(opt, REP_ACK, &[]);
                    if opt == OPT_GO {
                        self.session.attached_by = Some(OPT_GO);
                        return Negotiated::Transmit(i);
                    }
                }
                _ => self.error(opt, REP_ERR_UNSUP),
            }
        }
    }

    /// The transmission phase on `export`, a fresh zeroed disk; returns the error the
    /// connection ends with (`None`: an orderly end).
    fn transmit(&mut self, export: ExportSpec, input: &mut Input<'_>) -> Option<ErrorKind> {
        let mut disk = vec![0u8; DISK_SIZE as usize];
        loop {
            // End of input, even mid-request: what was received is answered, the rest is
            // never started, and the connection closes in order.
            let head = input.take(REQUEST_LEN)?;
            if be32(&head[0..4]) != REQUEST_MAGIC {
                self.session.cut = true;
                return Some(ErrorKind::Protocol);
            }
            let (flags, cmd, cookie) = (be16(&head[4..6]), be16(&head[6..8]), be64(&head[8..16]));
            let (offset, length) = (be64(&head[16..24]), be32(&head[24..28]));
            let mut payload: &[u8] = &[];
            if cmd == CMD_WRITE {
                if length > MAX_WRITE_PAYLOAD {
                    self.session.cut = true;
                    return Some(ErrorKind::Protocol);
                }
                payload = input.take(length as usize)?;
            }
            self.session.requests += 1;
            let allowed = if cmd == CMD_WRITE_ZEROES {
                CMD_FLAG_FUA | CMD_FLAG_NO_HOLE
            } else {
                CMD_FLAG_FUA
            };
            let writes = matches!(cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
            let len = u64::from(length);
            let mut data = None;
            let errno = if flags & !allowed != 0 {
                EINVAL
            } else if writes && export.read_only {
                EPERM
            } else {
                match cmd {
                    CMD_READ => range_errno(cmd, offset, len).unwrap_or_else(|| {
                        let at = offset as usize;
                        data = Some(disk[at..at + length as usize].to_vec());
                        0
                    }),
                    CMD_WRITE => range_errno(cmd, offset, len).unwrap_or_else(|| {
                        let at = offset as usize;
                        disk[at..at + payload.len()].copy_from_slice(payload);
                        0
                    }),
                    CMD_FLUSH => 0,
                    CMD_TRIM | CMD_WRITE_ZEROES => {
                        range_errno(cmd, offset, len).unwrap_or_else(|| {
                            let at = offset as usize;
                            disk[at..at + length as usize].fill(0);
                            0
                        })
                    }
                    CMD_DISC => return None,
                    _ => EINVAL,
                }
            };
            let mut reply = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
            reply.extend_from_slice(&errno.to_be_bytes());
            reply.extend_from_slice(&cookie.to_be_bytes());
            self.expect("simple reply", reply);
            self.session.replies.push((cmd, errno));
            if let Some(data) = data {
                self.session.nonzero_read_bytes += data.iter().filter(|&&b| b != 0).count() as u64;
                self.expect("read data", data);
            }
        }
    }
}

/// The transmission flags an export advertises.
fn transmission_flags(e: &ExportSpec) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_CAN_MULTI_CONN;
    if e.read_only {
        f |= TFLAG_READ_ONLY;
    }
    f
}

/// The error a request for `[offset, offset + len)` gets from the fuzzed geometry, or
/// `None` if it is served: EINVAL for a zero length, a read or write over [`MAX_IO`], or
/// misalignment; past the end, EINVAL for a read and ENOSPC for anything that writes.
fn range_errno(cmd: u16, offset: u64, len: u64) -> Option<u32> {
    let bs = u64::from(BLOCK_SIZE);
    let transfers = matches!(cmd, CMD_READ | CMD_WRITE);
    if len == 0 || (transfers && len > u64::from(MAX_IO)) || offset % bs != 0 || len % bs != 0 {
        return Some(EINVAL);
    }
    match offset.checked_add(len) {
        Some(end) if end <= DISK_SIZE => None,
        _ if cmd == CMD_READ => Some(EINVAL),
        _ => Some(ENOSPC),
    }
}

/// The data of `NBD_OPT_INFO` / `NBD_OPT_GO`, if well formed: a 32-bit name length, a
/// UTF-8 name, a 16-bit count, and exactly that many 16-bit info types.
fn info_request(data: &[u8]) -> Option<(&str, Vec<u16>)> {
    let (name_len, rest) = data.split_first_chunk::<4>()?;
    let name_len = u32::from_be_bytes(*name_len) as usize;
    if rest.len() < name_len {
        return None;
    }
    let (name, rest) = rest.split_at(name_len);
    let (count, infos) = rest.split_first_chunk::<2>()?;
    if infos.len() != 2 * usize::from(u16::from_be_bytes(*count)) {
        return None;
    }
    let name = std::str::from_utf8(name).ok()?;
    Some((name, infos.chunks_exact(2).map(be16).collect()))
}

/// Checks `output` against `expected`, all of it, or — when `may_stop_early` — a prefix
/// of it ending at any byte.
fn compare(output: &[u8], expected: &[Expect], may_stop_early: bool) {
    let mut pos = 0;
    for (i, want) in expected.iter().enumerate() {
        let rest = &output[pos..];
        match want {
            Expect::Bytes(what, bytes) => {
                let n = bytes.len().min(rest.len());
                if rest[..n] != bytes[..n] {
                    let at = (0..n).find(|&j| rest[j] != bytes[j]).unwrap_or(n);
                    panic!(
                        "{what} (item {i}, output byte {pos}) differs at its byte {at}:\n  \
                         sent     {:02x?}\n  expected {:02x?}",
                        &rest[..n.min(at + 32)],
                        &bytes[..n.min(at + 32)],
                    );
                }
                if n < bytes.len() {
                    assert!(
                        may_stop_early,
                        "the output ends {} bytes into {what} (item {i}, output byte {pos}) \
                         of {}",
                        n,
                        bytes.len()
                    );
                    return;
                }
                pos += n;
            }
            &Expect::OptionError { opt, kind } => {
                let mut head = REPLY_MAGIC_OPT.to_be_bytes().to_vec();
                head.extend_from_slice(&opt.to_be_bytes());
                head.extend_from_slice(&kind.to_be_bytes());
                let n = head.len().min(rest.len());
                assert!(
                    rest[..n] == head[..n],
                    "option error reply (item {i}, output byte {pos}): sent {:02x?}, \
                     expected type {kind:#x} to option {opt}",
                    &rest[..n]
                );
                let len = rest.get(16..20).map(|b| be32(b) as usize);
                let text = len.and_then(|len| rest.get(20..20 + len));
                let (Some(len), Some(text)) = (len, text) else {
                    assert!(
                        may_stop_early,
                        "the output ends in option error reply {kind:#x} to option {opt} \
                         (item {i}, output byte {pos})"
                    );
                    return;
                };
                assert!(len <= MAX_ERROR_TEXT, "option error text of {len} bytes");
                assert!(
                    std::str::from_utf8(text).is_ok(),
                    "option error text is not UTF-8: {text:02x?}"
                );
                pos += 20 + len;
            }
        }
    }
    assert!(
        pos == output.len(),
        "the server sent {} bytes more than expected: {:02x?}",
        output.len() - pos,
        &output[pos..output.len().min(pos + 64)]
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected() -> Vec<Expect> {
        vec![
            Expect::Bytes("first", vec![1, 2, 3]),
            Expect::OptionError {
                opt: OPT_GO,
                kind: REP_ERR_UNKNOWN,
            },
            Expect::Bytes("last", vec![4, 5]),
        ]
    }

    fn output(opt: u32, kind: u32, text: &[u8]) -> Vec<u8> {
        let mut out = vec![1, 2, 3];
        out.extend_from_slice(&REPLY_MAGIC_OPT.to_be_bytes());
        out.extend_from_slice(&opt.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&(text.len() as u32).to_be_bytes());
        out.extend_from_slice(text);
        out.extend_from_slice(&[4, 5]);
        out
    }

    #[test]
    fn compare_takes_the_expected_output_with_any_error_text() {
        compare(&output(OPT_GO, REP_ERR_UNKNOWN, b""), &expected(), false);
        compare(
            &output(OPT_GO, REP_ERR_UNKNOWN, b"no such export"),
            &expected(),
            false,
        );
        let whole = output(OPT_GO, REP_ERR_UNKNOWN, b"x");
        for cut in [0, 2, 3, 10, 23, 24, whole.len() - 1] {
            compare(&whole[..cut], &expected(), true);
        }
    }

    #[test]
    #[should_panic(expected = "differs")]
    fn compare_refuses_a_changed_byte() {
        let mut out = output(OPT_GO, REP_ERR_UNKNOWN, b"");
        *out.last_mut().unwrap() ^= 1;
        compare(&out, &expected(), true);
    }

    #[test]
    #[should_panic(expected = "more than expected")]
    fn compare_refuses_extra_output() {
        let mut out = output(OPT_GO, REP_ERR_UNKNOWN, b"");
        out.push(0);
        compare(&out, &expected(), false);
    }

    #[test]
    #[should_panic(expected = "the output ends")]
    fn compare_refuses_output_cut_short_unless_allowed() {
        let out = output(OPT_GO, REP_ERR_UNKNOWN, b"");
        compare(&out[..out.len() - 1], &expected(), false);
    }

    #[test]
    #[should_panic(expected = "expected type")]
    fn compare_refuses_another_error() {
        compare(&output(OPT_GO, REP_ERR_INVALID, b""), &expected(), false);
    }

    #[test]
    #[should_panic(expected = "not UTF-8")]
    fn compare_refuses_error_text_that_is_not_utf8() {
        compare(
            &output(OPT_GO, REP_ERR_UNKNOWN, b"\xff"),
            &expected(),
            false,
        );
    }

    #[test]
    fn info_request_needs_every_length_to_add_up() {
        let ok = info_data(b"vol0", &[INFO_NAME, INFO_BLOCK_SIZE]);
        assert_eq!(
            info_request(&ok),
            Some(("vol0", vec![INFO_NAME, INFO_BLOCK_SIZE]))
        );
        for n in 0..ok.len() {
            assert_eq!(info_request(&ok[..n]), None, "cut to {n}");
        }
        let mut long = ok.clone();
        long.push(0);
        assert_eq!(info_request(&long), None);
        assert_eq!(info_request(&info_data(b"\xff", &[])), None);
    }

    #[test]
    fn range_errno_follows_the_geometry() {
        let bs = u64::from(BLOCK_SIZE);
        assert_eq!(range_errno(CMD_READ, 0, bs), None);
        assert_eq!(range_errno(CMD_READ, 0, 0), Some(EINVAL));
        assert_eq!(range_errno(CMD_READ, 1, bs), Some(EINVAL));
        assert_eq!(
            range_errno(CMD_WRITE, 0, u64::from(MAX_IO) + bs),
            Some(EINVAL)
        );
        assert_eq!(range_errno(CMD_TRIM, 0, DISK_SIZE), None);
        assert_eq!(range_errno(CMD_READ, DISK_SIZE, bs), Some(EINVAL));
        assert_eq!(range_errno(CMD_WRITE, DISK_SIZE, bs), Some(ENOSPC));
        assert_eq!(
            range_errno(CMD_WRITE_ZEROES, u64::MAX - bs + 1, bs),
            Some(ENOSPC)
        );
    }
}
