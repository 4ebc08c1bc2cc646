//! One iSCSI connection, from the first Login Request to the close: login, then the
//! full-feature phase.
//!
//! One task per connection runs one loop over four things at once: bytes arriving from
//! the initiator, SCSI commands running on the logical unit, replies going out, and the
//! connection's timers (the target's NOP-In pings). PDUs are decoded straight out of the
//! receive buffer (immediate data becomes a `Bytes` slice of it, no copy); every reply
//! produced while handling one read is encoded into one output buffer and written with
//! as few syscalls as the socket allows. Replies go out in completion order.
//!
//! Ordering (RFC 7143 section 4.2.2.1): non-immediate commands are delivered to the
//! logical unit in CmdSN order; one that arrives early waits in `pending` (its data-out
//! is collected meanwhile, so unsolicited data for it is not lost); one outside
//! [ExpCmdSN, MaxCmdSN] is dropped without an answer. Immediate commands run at once.
//!
//! Error recovery level 0: a digest error on a data segment gets a Reject and the PDU
//! is dropped; a broken data sequence (DataSN, offsets, more data than solicited) or a
//! header that cannot be trusted ends the connection, which the initiator recovers from
//! by logging in again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::login::{Login, LoginStep, SessionKind, SessionParams};
use super::pdu::{
    BHS_LEN, DataIn, DataOut, Decoder, Digests, LogoutReq, LogoutResp, NopIn, NopOut, PduError,
    R2t, Reject, Reply, Request, ScsiCommand, ScsiResponse, TaskMgmtReq, TaskMgmtResp, TextReq,
    TextResp,
};
use super::server::{SessionGuard, Shared};
use super::text;
use crate::error::{Error, ErrorKind, Result};
use crate::scsi::cdb::COMPARE_AND_WRITE;
use crate::scsi::sense::{INVALID_FIELD_IN_CDB, Sense, SenseKey};
use crate::scsi::{self, Command, Direction, LogicalUnit, Nexus, NexusHandle, Status};

/// The data segment limit during login (RFC 7143 section 13.12's default).
const LOGIN_MAX_DATA: u32 = 8192;
/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 256 << 10;
/// Reply bytes buffered before the connection stops reading requests (backpressure).
const OUT_HIGH_WATER: usize = 8 << 20;
/// Commands running on the logical unit before the connection stops reading more.
const MAX_RUNNING: usize = 256;
/// Data buffers a connection's tasks may hold at once (write data being collected,
/// read data being produced): a command beyond it is answered TASK SET FULL (unless it
/// is the only one), so an initiator that stops reading cannot make the node hold more.
const MAX_TASK_BYTES: u64 = 64 << 20;
/// A reserved ITT / TTT value.
const RESERVED_TAG: u32 = 0xffff_ffff;

/// Opcodes whose data-out is a number of whole blocks given by the CDB's transfer length:
/// when the initiator expects to send fewer bytes than the CDB asks, only what it sends
/// is written (SAM-5: the transfer is cut to the expected length).
fn block_write_len_field(op: u8) -> Option<(usize, usize)> {
    match op {
        0x0a => Some((4, 1)),         // WRITE(6)
        0x2a | 0x2e => Some((7, 2)),  // WRITE(10), WRITE AND VERIFY(10)
        0xaa | 0xae => Some((6, 4)),  // WRITE(12), WRITE AND VERIFY(12)
        0x8a | 0x8e => Some((10, 4)), // WRITE(16), WRITE AND VERIFY(16)
        _ => None,
    }
}

/// `a < b` in serial number arithmetic (RFC 1982), as CmdSN comparisons need.
fn sn_lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// The LUN number of a single-level LUN field (peripheral or flat addressing); `None`
/// for a structure this target does not use.
fn lun_number(raw: u64) -> Option<u16> {
    let top = (raw >> 48) as u16;
    if raw & 0x0000_ffff_ffff_ffff != 0 {
        return None;
    }
    match top >> 14 {
        0 | 1 => Some(top & 0x3fff),
        _ => None,
    }
}

/// The TransportID of an iSCSI initiator port (SPC-4 7.6.4.6, format 01b):
/// `<name>,i,0x<ISID>`, NUL terminated, padded to a multiple of four bytes.
fn transport_id(initiator_port: &str) -> Bytes {
    let mut name = initiator_port.as_bytes().to_vec();
    name.push(0);
    while name.len() % 4 != 0 || name.len() < 16 {
        name.push(0);
    }
    let mut id = Vec::with_capacity(4 + name.len());
    id.push(0x40 | 0x05);
    id.push(0);
    id.extend_from_slice(&(name.len() as u16).to_be_bytes());
    id.extend_from_slice(&name);
    Bytes::from(id)
}

fn isid_hex(isid: &[u8; 6]) -> String {
    isid.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where a command's data-out stands.
#[derive(Debug)]
enum Collect {
    /// All of it is here (possibly nothing).
    Done(Bytes),
    /// Receiving: `buf` fills up to the task's `target` bytes.
    Receiving {
        buf: BytesMut,
        /// Bytes received (the sequences are in order, so this is also the end of the
        /// contiguous prefix once every sequence has ended).
        received: u32,
        /// The unsolicited sequence is still open: (next DataSN, next offset).
        unsolicited: Option<(u32, u32)>,
        /// The first offset no R2T has asked for yet.
        next_r2t_offset: u32,
        /// Outstanding R2Ts.
        r2ts: Vec<R2tState>,
    },
}

/// One outstanding R2T: the data sequence it asked for.
#[derive(Debug, Clone, Copy)]
struct R2tState {
    ttt: u32,
    end: u32,
    next_sn: u32,
    next_offset: u32,
}

/// A SCSI task the connection knows of.
#[derive(Debug)]
struct Task {
    cmd_sn: u32,
    lun_raw: u64,
    cdb: Bytes,
    dir: Direction,
    /// The initiator's expected data transfer length.
    edtl: u32,
    /// Whether the command PDU's R bit was set (data-in wanted).
    read: bool,
    /// Bytes of data-out handed to the logical unit.
    target: u32,
    collect: Collect,
    /// Its CmdSN turn has come (or it is immediate).
    in_order: bool,
    /// Running on the logical unit.
    running: bool,
    /// Aborted while running: its response is not sent (or is TASK ABORTED).
    aborted: Option<bool>,
    /// R2Ts sent so far (the next R2TSN).
    r2t_sn: u32,
    /// Answer GOOD without running anything (a write cut to zero blocks by the
    /// initiator's expected length).
    skip: bool,
    /// Its share of [`MAX_TASK_BYTES`].
    cost: u64,
}

/// Something waiting for its CmdSN turn.
#[derive(Debug)]
enum Pending {
    /// A SCSI command (its ITT); its task was set up on arrival.
    Scsi(u32),
    /// Any other non-immediate request.
    Other(Request),
    /// A CmdSN whose request went away (an aborted command): its turn does nothing.
    Nothing,
}

/// A task management response waiting for aborted tasks to finish.
#[derive(Debug)]
struct PendingTmf {
    itt: u32,
    response: u8,
    waiting: Vec<u32>,
    /// Close the connection after sending (TARGET COLD RESET).
    then_close: bool,
}

/// Whether the connection still reads requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closing {
    Open,
    /// Stop reading; finish what runs, answer it, then close.
    Drain,
}

type Running<'a> = Pin<Box<dyn Future<Output = (u32, scsi::Response)> + Send + 'a>>;
/// Serve one connection to the end.
pub(super) async fn run<R, W>(
    shared: &Arc<Shared>,
    mut rd: R,
    mut wr: W,
    peer: &str,
    portal: &str,
) -> Result<()>
where
    R: tokio::io::AsyncRead + Unpin + Send,
    W: tokio::io::AsyncWrite + Unpin + Send,
{
    let mut inbuf = BytesMut::with_capacity(READ_CHUNK);
    let mut out = BytesMut::new();
    let mut dec = Decoder::new(LOGIN_MAX_DATA);
    let tsih = shared.alloc_tsih();
    let mut login = Login::new(shared.login.clone(), tsih);
    let mut stat_sn: u32 = 1;
    let deadline = Instant::now() + shared.options.login_timeout;
    let negotiated = loop {
        let req = match tokio::time::timeout_at(deadline, read_pdu(&mut rd, &mut dec, &mut inbuf))
            .await
        {
            Err(_) => {
                return Err(Error::new(ErrorKind::Timeout, "login took too long"));
            }
            Ok(r) => r?,
        };
        let Some(req) = req else { return Ok(()) };
        let Request::Login(req) = req else {
            shared
                .counters
                .logins_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::Protocol,
                "a PDU other than Login Request before login completed",
            ));
        };
        let window = shared.options.cmd_window;
        let (mut resp, done) = match login.step(&req) {
            LoginStep::Continue(resp) => (resp, None),
            LoginStep::Done(resp, negotiated) => (resp, Some(Ok(negotiated))),
            LoginStep::Refuse(resp) => (resp, Some(Err(()))),
        };
        resp.stat_sn = stat_sn;
        stat_sn = stat_sn.wrapping_add(1);
        resp.exp_cmd_sn = req.cmd_sn;
        resp.max_cmd_sn = req.cmd_sn.wrapping_add(window - 1);
        let status = (resp.status_class, resp.status_detail);
        Reply::LoginResp(resp).encode(Digests::default(), &mut out);
        wr.write_all_buf(&mut out).await?;
        match done {
            None => continue,
            Some(Err(())) => {
                shared
                    .counters
                    .logins_refused
                    .fetch_add(1, Ordering::Relaxed);
                info!(%peer, class = status.0, detail = status.1, "login refused");
                let _ = wr.shutdown().await;
                return Ok(());
            }
            Some(Ok(negotiated)) => break (negotiated, req.cmd_sn),
        }
    };
    let (negotiated, first_cmd_sn) = negotiated;
    dec.set_digests(Digests {
        header: negotiated.params.header_digest,
        data: negotiated.params.data_digest,
    });
    dec.set_max_data_segment(negotiated.params.max_recv_data_segment_length);

    let guard = shared.register_session(&negotiated, peer).await;
    let target = match negotiated.kind {
        SessionKind::Normal { target } => shared.targets.get(target),
        SessionKind::Discovery => None,
    };
    let initiator_port = format!(
        "{},i,0x{}",
        negotiated.initiator_name,
        isid_hex(&negotiated.isid)
    );
    let nexus = target.map(|t| {
        let lu = t.lun0().clone();
        let relative_target_port = lu.port().relative_id;
        lu.attach(Nexus {
            transport_id: transport_id(&initiator_port),
            initiator_port: initiator_port.clone(),
            relative_target_port,
        })
    });
    info!(
        %peer,
        initiator = %negotiated.initiator_name,
        isid = %isid_hex(&negotiated.isid),
        tsih = negotiated.tsih,
        target = target.map_or("(discovery)", |t| t.name()),
        header_digest = negotiated.params.header_digest,
        data_digest = negotiated.params.data_digest,
        "iSCSI login complete"
    );
    let mut conn = Conn {
        shared,
        lu: nexus.as_ref().map(|n| (n.lu().as_ref(), n)),
        kind: negotiated.kind,
        params: negotiated.params,
        portal,
        peer,
        cid: negotiated.cid,
        stat_sn,
        exp_cmd_sn: first_cmd_sn,
        tasks: HashMap::new(),
        pending: HashMap::new(),
        running: FuturesUnordered::new(),
        tmfs: Vec::new(),
        tmf_peer: FuturesUnordered::new(),
        next_ttt: 1,
        text_more: None,
        text_in: None,
        out,
        digests: Digests {
            header: negotiated.params.header_digest,
            data: negotiated.params.data_digest,
        },
        closing: Closing::Open,
        close_after_flush: false,
        last_rx: Instant::now(),
        ping: None,
        commands: 0,
        task_bytes: 0,
    };
    let result = conn
        .serve(&mut rd, &mut wr, &mut dec, &mut inbuf, &guard)
        .await;
    let commands = conn.commands;
    drop(conn);
    drop(nexus);
    drop(guard);
    info!(%peer, initiator = %negotiated.initiator_name, commands, "iSCSI session closed");
    result
}

/// Read until one PDU decodes; `None` at a clean end of input.
async fn read_pdu<R: tokio::io::AsyncRead + Unpin>(
    rd: &mut R,
    dec: &mut Decoder,
    inbuf: &mut BytesMut,
) -> Result<Option<Request>> {
    loop {
        match dec.decode(inbuf) {
            Ok(Some(req)) => return Ok(Some(req)),
            Ok(None) => {}
            Err(PduError::Fatal(msg)) => {
                return Err(Error::new(ErrorKind::Protocol, format!("bad PDU: {msg}")));
            }
            Err(PduError::Reject { detail, .. }) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("bad PDU during login: {detail}"),
                ));
            }
        }
        inbuf.reserve(READ_CHUNK);
        if rd.read_buf(inbuf).await? == 0 {
            return if inbuf.is_empty() {
                Ok(None)
            } else {
                Err(Error::new(
                    ErrorKind::Closed,
                    "connection closed inside a PDU",
                ))
            };
        }
    }
}

struct Conn<'a> {
    shared: &'a Arc<Shared>,
    lu: Option<(&'a LogicalUnit, &'a NexusHandle)>,
    kind: SessionKind,
    params: SessionParams,
    portal: &'a str,
    peer: &'a str,
    cid: u16,
    stat_sn: u32,
    exp_cmd_sn: u32,
    tasks: HashMap<u32, Task>,
    pending: HashMap<u32, Pending>,
    running: FuturesUnordered<Running<'a>>,
    tmfs: Vec<PendingTmf>,
    /// The other node's part of task management functions (see
    /// `LogicalUnit::peer_task_management`), each ending with its TMF's tag.
    tmf_peer: FuturesUnordered<std::pin::Pin<Box<dyn std::future::Future<Output = u32> + Send>>>,
    next_ttt: u32,
    /// The rest of a Text response too long for one PDU: (TTT, the bytes left).
    text_more: Option<(u32, Bytes)>,
    /// A Text request continued over several PDUs (C bit): what came so far.
    text_in: Option<BytesMut>,
    out: BytesMut,
    digests: Digests,
    closing: Closing,
    close_after_flush: bool,
    last_rx: Instant,
    /// An unanswered NOP-In ping: (TTT, when it was sent).
    ping: Option<(u32, Instant)>,
    commands: u64,
    /// Bytes of [`MAX_TASK_BYTES`] in use.
    task_bytes: u64,
}

impl<'a> Conn<'a> {
    /// Forget a task, returning its budget.
    fn drop_task(&mut self, itt: u32) -> Option<Task> {
        let t = self.tasks.remove(&itt)?;
        self.task_bytes -= t.cost;
        Some(t)
    }

    fn max_cmd_sn(&self) -> u32 {
        self.exp_cmd_sn
            .wrapping_add(self.shared.options.cmd_window - 1)
    }

    fn send(&mut self, reply: Reply) {
        reply.encode(self.digests, &mut self.out);
    }

    fn next_stat_sn(&mut self) -> u32 {
        let sn = self.stat_sn;
        self.stat_sn = sn.wrapping_add(1);
        sn
    }

    fn alloc_ttt(&mut self) -> u32 {
        next_tag(&mut self.next_ttt)
    }

    fn reject(&mut self, reason: u8, header: [u8; BHS_LEN]) {
        let stat_sn = self.next_stat_sn();
        let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::Reject(Reject {
            reason,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            data_sn: 0,
            header,
        }));
    }

    async fn serve<R, W>(
        &mut self,
        rd: &mut R,
        wr: &mut W,
        dec: &mut Decoder,
        inbuf: &mut BytesMut,
        guard: &SessionGuard,
    ) -> Result<()>
    where
        R: tokio::io::AsyncRead + Unpin + Send,
        W: tokio::io::AsyncWrite + Unpin + Send,
    {
        let mut aborts = self.lu.map(|(_, n)| n.aborts());
        let nop_interval = self.shared.options.nop_interval;
        let nop_timeout = self.shared.options.nop_timeout;
        let cancel = guard.cancel().clone();
        // Anything already buffered after the last Login Request.
        self.decode_all(dec, inbuf)?;
        loop {
            if self.closing == Closing::Drain && self.running.is_empty() && self.out.is_empty() {
                let _ = wr.shutdown().await;
                return Ok(());
            }
            if self.close_after_flush && self.out.is_empty() && self.running.is_empty() {
                let _ = wr.shutdown().await;
                return Ok(());
            }
            let can_read = self.closing == Closing::Open
                && !self.close_after_flush
                && self.out.len() < OUT_HIGH_WATER
                && self.running.len() < MAX_RUNNING;
            let ping_at = match self.ping {
                Some((_, sent)) => sent + nop_timeout,
                None => self.last_rx + nop_interval,
            };
            tokio::select! {
                biased;
                Some((itt, resp)) = self.running.next(), if !self.running.is_empty() => {
                    self.complete(itt, resp);
                }
                Some(itt) = self.tmf_peer.next(), if !self.tmf_peer.is_empty() => {
                    self.tmf_task_done(itt);
                }
                r = wr.write_buf(&mut self.out), if !self.out.is_empty() => {
                    if r? == 0 {
                        return Err(Error::new(ErrorKind::Closed, "the initiator stopped reading"));
                    }
                }
                r = rd.read_buf(inbuf), if can_read => {
                    if r? == 0 {
                        debug!(peer = %self.peer, "the initiator closed the connection");
                        self.closing = Closing::Drain;
                        self.abandon_all();
                        // Nobody will read the replies.
                        self.out.clear();
                        continue;
                    }
                    self.last_rx = Instant::now();
                    self.ping = None;
                    self.decode_all(dec, inbuf)?;
                    // Start the commands these PDUs carried together, under one plug: a
                    // device that batches (a mirror) carries them out with one send.
                    let done = std::future::poll_fn(|cx| {
                        let _plug = crate::plug::Plug::new();
                        let mut done = Vec::new();
                        while let std::task::Poll::Ready(Some(d)) = self.running.poll_next_unpin(cx) {
                            done.push(d);
                        }
                        std::task::Poll::Ready(done)
                    })
                    .await;
                    for (itt, resp) in done {
                        self.complete(itt, resp);
                    }
                    if inbuf.capacity() - inbuf.len() < 4096 {
                        inbuf.reserve(READ_CHUNK);
                    }
                }
                _ = tokio::time::sleep_until(ping_at), if self.closing == Closing::Open && !self.close_after_flush => {
                    if self.ping.is_some() {
                        warn!(peer = %self.peer, "the initiator did not answer a NOP-In ping: closing the connection");
                        self.closing = Closing::Drain;
                        self.abandon_all();
                        self.out.clear();
                    } else {
                        self.send_ping();
                    }
                }
                changed = async {
                    match aborts.as_mut() {
                        Some(rx) => rx.changed().await.map(|_| *rx.borrow_and_update()),
                        None => std::future::pending().await,
                    }
                } => {
                    match changed {
                        Ok(a) => self.aborted_from_outside(a),
                        Err(_) => aborts = None,
                    }
                }
                _ = cancel.cancelled(), if self.closing == Closing::Open => {
                    info!(peer = %self.peer, "closing the session: {}", guard.reason());
                    self.closing = Closing::Drain;
                }
            }
        }
    }

    /// Handle every whole PDU in `inbuf`.
    fn decode_all(&mut self, dec: &mut Decoder, inbuf: &mut BytesMut) -> Result<()> {
        while self.closing == Closing::Open && !self.close_after_flush {
            match dec.decode(inbuf) {
                Ok(Some(req)) => self.handle(req)?,
                Ok(None) => break,
                Err(PduError::Reject {
                    reason,
                    header,
                    detail,
                }) => {
                    warn!(peer = %self.peer, reason, "rejected a PDU: {detail}");
                    self.reject(reason, header);
                }
                Err(PduError::Fatal(msg)) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("bad PDU from the initiator: {msg}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// One request from the initiator.
    fn handle(&mut self, req: Request) -> Result<()> {
        match req {
            Request::DataOut(d) => return self.data_out(d),
            Request::Command(c) => {
                if c.immediate {
                    self.command(c, true);
                } else {
                    self.ordered(c.cmd_sn, Request::Command(c));
                }
            }
            Request::NopOut(n) => {
                if n.itt == RESERVED_TAG {
                    // The answer to our ping, or a ping that wants no answer; CmdSN
                    // does not advance.
                } else if n.immediate {
                    self.nop_out(n);
                } else {
                    self.ordered(n.cmd_sn, Request::NopOut(n));
                }
            }
            Request::TaskMgmt(t) => {
                if t.immediate {
                    self.task_mgmt(t);
                } else {
                    self.ordered(t.cmd_sn, Request::TaskMgmt(t));
                }
            }
            Request::Text(t) => {
                if t.immediate {
                    self.text(t);
                } else {
                    self.ordered(t.cmd_sn, Request::Text(t));
                }
            }
            Request::Logout(l) => {
                if l.immediate {
                    self.logout(l);
                } else {
                    self.ordered(l.cmd_sn, Request::Logout(l));
                }
            }
            Request::Login(l) => {
                warn!(peer = %self.peer, "a Login Request in the full-feature phase: closing");
                self.reject(0x04, l.header);
                self.close_after_flush = true;
            }
            Request::Snack(s) => {
                debug!(peer = %self.peer, "SNACK at error recovery level 0: rejected");
                self.reject(0x04, s.header);
            }
        }
        Ok(())
    }

    /// A non-immediate request: run it in CmdSN order.
    fn ordered(&mut self, cmd_sn: u32, req: Request) {
        let max = self.max_cmd_sn();
        if sn_lt(cmd_sn, self.exp_cmd_sn) || sn_lt(max, cmd_sn) {
            debug!(
                peer = %self.peer,
                cmd_sn,
                exp_cmd_sn = self.exp_cmd_sn,
                max_cmd_sn = max,
                "CmdSN outside the window: the request is ignored"
            );
            return;
        }
        if cmd_sn != self.exp_cmd_sn {
            if self.pending.contains_key(&cmd_sn) {
                debug!(peer = %self.peer, cmd_sn, "a second request with the same CmdSN is ignored");
                return;
            }
            // Too early. A SCSI command gets its task now, so that its unsolicited data
            // is collected while it waits.
            let p = match req {
                Request::Command(c) => {
                    let itt = c.itt;
                    self.command(c, false);
                    Pending::Scsi(itt)
                }
                other => Pending::Other(other),
            };
            self.pending.insert(cmd_sn, p);
            return;
        }
        self.exp_cmd_sn = self.exp_cmd_sn.wrapping_add(1);
        self.run_in_order(req);
        while let Some(p) = self.pending.remove(&self.exp_cmd_sn) {
            let sn = self.exp_cmd_sn;
            self.exp_cmd_sn = sn.wrapping_add(1);
            match p {
                Pending::Scsi(itt) => {
                    if let Some(t) = self.tasks.get_mut(&itt) {
                        if t.cmd_sn == sn {
                            t.in_order = true;
                            self.maybe_start(itt);
                        }
                    }
                }
                Pending::Other(req) => self.run_in_order(req),
                Pending::Nothing => {}
            }
        }
    }

    fn run_in_order(&mut self, req: Request) {
        match req {
            Request::Command(c) => self.command(c, true),
            Request::NopOut(n) => self.nop_out(n),
            Request::TaskMgmt(t) => self.task_mgmt(t),
            Request::Text(t) => self.text(t),
            Request::Logout(l) => self.logout(l),
            Request::DataOut(_) | Request::Login(_) | Request::Snack(_) => {}
        }
    }

    /// Set up a SCSI command's task; `in_order` when its CmdSN turn has come.
    fn command(&mut self, c: ScsiCommand, in_order: bool) {
        if self.tasks.contains_key(&c.itt) {
            warn!(peer = %self.peer, itt = c.itt, "a command reuses the ITT of a running task");
            self.reject(0x07, c.header);
            return;
        }
        let Some((lu, _)) = self.lu else {
            debug!(peer = %self.peer, "a SCSI command in a discovery session: rejected");
            self.reject(0x04, c.header);
            return;
        };
        let inspected = if lun_number(c.lun) == Some(0) {
            lu.inspect(&c.cdb)
        } else {
            Err(scsi::missing_lun(
                &Command {
                    cdb: c.cdb.clone(),
                    data_out: Bytes::new(),
                    expected_in: c.expected_len,
                },
                1,
            ))
        };
        let dir = match inspected {
            Ok(d) => d,
            Err(resp) => {
                // Answered without collecting any data: Data-Out PDUs that still come
                // for this ITT are dropped. (It has no effect, so answering before its
                // CmdSN turn changes nothing.)
                self.respond(
                    c.itt,
                    c.lun,
                    c.expected_len,
                    c.read,
                    Direction::None,
                    resp,
                    0,
                );
                return;
            }
        };
        let block = lu.device().geometry().block_size();
        let mut cdb = c.cdb.clone();
        let mut skip = false;
        let mut target = 0u32;
        if let Direction::Out(n) = dir {
            let edtl = if c.write { c.expected_len } else { 0 };
            target = n.min(edtl);
            let op = cdb.first().copied().unwrap_or(0);
            if op == COMPARE_AND_WRITE && edtl != n {
                // Its data-out is the verify and the write data together: a different
                // length is a malformed command, not a cut transfer (SBC-3 5.2).
                let resp = INVALID_FIELD_IN_CDB.response(lu.descriptor_sense());
                self.respond(c.itt, c.lun, c.expected_len, c.read, dir, resp, 0);
                return;
            }
            if edtl < n {
                if let Some((at, width)) = block_write_len_field(op) {
                    if edtl % block != 0 {
                        // The initiator means to stop inside a block: refuse (the data it
                        // sends is dropped).
                        self.respond(
                            c.itt,
                            c.lun,
                            c.expected_len,
                            c.read,
                            dir,
                            Sense::new(SenseKey::IllegalRequest, 0x0e, 0x03)
                                .response(lu.descriptor_sense()),
                            0,
                        );
                        return;
                    }
                    match set_transfer_len(&cdb, at, width, edtl / block) {
                        Some(new) if edtl > 0 => cdb = new,
                        _ => skip = true,
                    }
                }
            }
        }
        let collect = if target == 0 {
            Collect::Done(Bytes::new())
        } else if c.data.len() as u32 >= target {
            // Everything came as immediate data: no copy.
            Collect::Done(c.data.slice(..target as usize))
        } else {
            let have = c.data.len() as u32;
            let mut buf = BytesMut::zeroed(target as usize);
            buf[..have as usize].copy_from_slice(&c.data);
            let unsolicited_end = if c.final_ {
                have
            } else {
                self.params.first_burst_length.min(target).max(have)
            };
            Collect::Receiving {
                buf,
                received: have,
                unsolicited: (!c.final_).then_some((0, have)),
                next_r2t_offset: unsolicited_end,
                r2ts: Vec::new(),
            }
        };
        let cost = match dir {
            Direction::Out(_) => target as u64,
            Direction::In(n) => n.min(c.expected_len) as u64,
            Direction::None => 0,
        };
        if self.task_bytes + cost > MAX_TASK_BYTES && !self.tasks.is_empty() {
            debug!(peer = %self.peer, itt = c.itt, "task data budget spent: TASK SET FULL");
            let full = scsi::Response {
                status: Status::TaskSetFull,
                sense: Bytes::new(),
                data: Bytes::new(),
            };
            self.respond(
                c.itt,
                c.lun,
                c.expected_len,
                c.read,
                Direction::None,
                full,
                0,
            );
            return;
        }
        self.task_bytes += cost;
        let itt = c.itt;
        self.tasks.insert(
            itt,
            Task {
                cmd_sn: c.cmd_sn,
                lun_raw: c.lun,
                cdb,
                dir,
                edtl: c.expected_len,
                read: c.read,
                target,
                collect,
                in_order,
                running: false,
                aborted: None,
                r2t_sn: 0,
                skip,
                cost,
            },
        );
        self.issue_r2ts(itt);
        self.maybe_start(itt);
    }

    /// Send the R2Ts a task may have outstanding now.
    fn issue_r2ts(&mut self, itt: u32) {
        let max_outstanding = self.params.max_outstanding_r2t.max(1) as usize;
        let max_burst = self.params.max_burst_length.max(512);
        let mut sends = Vec::new();
        let Some(task) = self.tasks.get_mut(&itt) else {
            return;
        };
        let lun_raw = task.lun_raw;
        let target = task.target;
        if let Collect::Receiving {
            unsolicited,
            next_r2t_offset,
            r2ts,
            ..
        } = &mut task.collect
        {
            if unsolicited.is_some() {
                // R2Ts follow the unsolicited sequence.
                return;
            }
            while r2ts.len() < max_outstanding && *next_r2t_offset < target {
                let offset = *next_r2t_offset;
                let len = (target - offset).min(max_burst);
                let ttt = next_tag(&mut self.next_ttt);
                r2ts.push(R2tState {
                    ttt,
                    end: offset + len,
                    next_sn: 0,
                    next_offset: offset,
                });
                *next_r2t_offset = offset + len;
                sends.push((ttt, task.r2t_sn, offset, len));
                task.r2t_sn += 1;
            }
        }
        for (ttt, r2t_sn, offset, len) in sends {
            let (stat_sn, exp_cmd_sn, max_cmd_sn) =
                (self.stat_sn, self.exp_cmd_sn, self.max_cmd_sn());
            self.send(Reply::R2t(R2t {
                lun: lun_raw,
                itt,
                ttt,
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn,
                r2t_sn,
                offset,
                len,
            }));
        }
    }

    /// A Data-Out PDU.
    fn data_out(&mut self, d: DataOut) -> Result<()> {
        match self.take_data(&d) {
            Ok(()) => {}
            Err((ascq, what)) => {
                // A broken data sequence fails its command (ABORTED COMMAND, 4B/xx) and
                // the connection goes on; Data-Out that still comes for it is dropped.
                warn!(peer = %self.peer, itt = d.itt, "Data-Out: {what}: the command fails");
                if let Some(task) = self.drop_task(d.itt) {
                    let descriptor = self.lu.is_some_and(|(lu, _)| lu.descriptor_sense());
                    let resp =
                        Sense::new(SenseKey::AbortedCommand, 0x4b, ascq).response(descriptor);
                    self.respond(
                        d.itt,
                        task.lun_raw,
                        task.edtl,
                        task.read,
                        Direction::None,
                        resp,
                        task.r2t_sn,
                    );
                }
            }
        }
        Ok(())
    }

    /// File a Data-Out's data in its task; `Err` names the sequence error (the ASCQ
    /// under ASC 4B: 00 DATA PHASE ERROR, 01 INVALID TARGET PORT TRANSFER TAG, 02 TOO
    /// MUCH WRITE DATA, 05 DATA OFFSET ERROR).
    fn take_data(&mut self, d: &DataOut) -> std::result::Result<(), (u8, String)> {
        let Some(task) = self.tasks.get_mut(&d.itt) else {
            // For a task already answered (refused without its data, or aborted).
            debug!(peer = %self.peer, itt = d.itt, "Data-Out for no task: dropped");
            return Ok(());
        };
        let Collect::Receiving {
            buf,
            received,
            unsolicited,
            r2ts,
            ..
        } = &mut task.collect
        else {
            debug!(peer = %self.peer, itt = d.itt, "Data-Out for a task with all its data: dropped");
            return Ok(());
        };
        let len = d.data.len() as u32;
        // Which sequence it belongs to, and its DataSN and offset checks.
        let seq_end;
        if d.ttt == RESERVED_TAG {
            let Some((sn, offset)) = unsolicited.as_mut() else {
                return Err((
                    0x00,
                    "unsolicited data after the unsolicited sequence ended".into(),
                ));
            };
            if d.data_sn != *sn {
                return Err((0x00, format!("DataSN {} where {} was due", d.data_sn, sn)));
            }
            if self.params.data_pdu_in_order && d.offset != *offset {
                return Err((
                    0x05,
                    format!("offset {} where {} was due", d.offset, offset),
                ));
            }
            *sn += 1;
            *offset = d.offset.saturating_add(len);
            seq_end = self.params.first_burst_length;
        } else {
            let Some(r) = r2ts.iter_mut().find(|r| r.ttt == d.ttt) else {
                return Err((0x01, format!("unknown TTT {:#x}", d.ttt)));
            };
            if d.data_sn != r.next_sn {
                return Err((
                    0x00,
                    format!("DataSN {} where {} was due", d.data_sn, r.next_sn),
                ));
            }
            if self.params.data_pdu_in_order && d.offset != r.next_offset {
                return Err((
                    0x05,
                    format!("offset {} where {} was due", d.offset, r.next_offset),
                ));
            }
            r.next_sn += 1;
            r.next_offset = d.offset.saturating_add(len);
            seq_end = r.end;
        }
        let end = d.offset as u64 + len as u64;
        if end > seq_end as u64 && end > buf.len() as u64 {
            return Err((0x02, "more data than the sequence asked for".into()));
        }
        // Data past what the logical unit takes (the initiator sends more than the CDB
        // moves) is dropped.
        let start = (d.offset as usize).min(buf.len());
        let stop = (end as usize).min(buf.len());
        buf[start..stop].copy_from_slice(&d.data[..stop - start]);
        *received += (stop - start) as u32;
        if d.final_ {
            if d.ttt == RESERVED_TAG {
                *unsolicited = None;
            } else {
                r2ts.retain(|r| r.ttt != d.ttt);
            }
        }
        let sequences_open = unsolicited.is_some() || !r2ts.is_empty();
        if *received >= task.target && !sequences_open {
            let data = std::mem::take(buf).freeze();
            task.collect = Collect::Done(data);
            self.maybe_start(d.itt);
        } else if d.final_ {
            self.issue_r2ts(d.itt);
        }
        Ok(())
    }

    /// Start a task on the logical unit once it is in order and has its data.
    fn maybe_start(&mut self, itt: u32) {
        let Some((lu, nexus)) = self.lu else { return };
        let Some(task) = self.tasks.get_mut(&itt) else {
            return;
        };
        if task.running || !task.in_order {
            return;
        }
        let Collect::Done(data) = &task.collect else {
            return;
        };
        task.running = true;
        if task.skip {
            let done = scsi::Response {
                status: Status::Good,
                sense: Bytes::new(),
                data: Bytes::new(),
            };
            self.running.push(Box::pin(std::future::ready((itt, done))));
            return;
        }
        let command = Command {
            cdb: task.cdb.clone(),
            data_out: data.clone(),
            expected_in: if task.read { task.edtl } else { 0 },
        };
        self.running.push(Box::pin(async move {
            let resp = lu.execute(nexus, command).await;
            (itt, resp)
        }));
    }

    /// A task finished on the logical unit.
    fn complete(&mut self, itt: u32, resp: scsi::Response) {
        let Some(task) = self.drop_task(itt) else {
            return;
        };
        self.commands += 1;
        self.shared
            .counters
            .commands
            .fetch_add(1, Ordering::Relaxed);
        match task.aborted {
            None => {
                self.respond(
                    itt,
                    task.lun_raw,
                    task.edtl,
                    task.read,
                    task.dir,
                    resp,
                    task.r2t_sn,
                );
            }
            Some(tas) => {
                if tas {
                    let aborted = scsi::Response {
                        status: Status::TaskAborted,
                        sense: Bytes::new(),
                        data: Bytes::new(),
                    };
                    self.respond(
                        itt,
                        task.lun_raw,
                        task.edtl,
                        task.read,
                        Direction::None,
                        aborted,
                        task.r2t_sn,
                    );
                }
            }
        }
        self.tmf_task_done(itt);
    }

    /// Send a command's data-in and status.
    #[allow(clippy::too_many_arguments)]
    fn respond(
        &mut self,
        itt: u32,
        lun_raw: u64,
        edtl: u32,
        read: bool,
        dir: Direction,
        resp: scsi::Response,
        r2ts_sent: u32,
    ) {
        // Residuals: what the command moves against what the initiator expected.
        let (moved, expected) = match dir {
            Direction::Out(n) => (n as u64, edtl as u64),
            _ => (resp.data.len() as u64, if read { edtl as u64 } else { 0 }),
        };
        let (overflow, underflow, residual) = if moved > expected {
            (true, false, (moved - expected).min(u32::MAX as u64) as u32)
        } else if moved < expected {
            (false, true, (expected - moved) as u32)
        } else {
            (false, false, 0)
        };
        let status = resp.status as u8;
        let mut data = resp.data;
        if !matches!(dir, Direction::Out(_)) {
            data.truncate(expected as usize);
        } else {
            data = Bytes::new();
        }
        let max_seg = self.params.max_xmit_data_segment_length.max(512) as usize;
        let max_burst = self.params.max_burst_length.max(512) as usize;
        let collapse = resp.sense.is_empty()
            && matches!(resp.status, Status::Good | Status::ConditionMet)
            && !data.is_empty();
        let mut data_sn = 0u32;
        let mut offset = 0usize;
        let total = data.len();
        while offset < total {
            let burst_end = (offset / max_burst + 1) * max_burst;
            let len = max_seg.min(total - offset).min(burst_end - offset);
            let last = offset + len == total;
            let chunk = data.slice(offset..offset + len);
            let with_status = last && collapse;
            let stat_sn = if with_status { self.next_stat_sn() } else { 0 };
            let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
            self.send(Reply::DataIn(DataIn {
                final_: last || offset + len == burst_end,
                status: with_status.then_some(status),
                overflow: with_status && overflow,
                underflow: with_status && underflow,
                residual: if with_status { residual } else { 0 },
                lun: lun_raw,
                itt,
                ttt: RESERVED_TAG,
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn,
                data_sn,
                offset: offset as u32,
                data: chunk,
            }));
            data_sn += 1;
            offset += len;
        }
        if collapse {
            return;
        }
        let stat_sn = self.next_stat_sn();
        let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::ScsiResponse(ScsiResponse {
            itt,
            response: 0x00,
            status,
            overflow,
            underflow,
            residual,
            bidi_overflow: false,
            bidi_underflow: false,
            bidi_residual: 0,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            exp_data_sn: data_sn + r2ts_sent,
            sense: resp.sense,
        }));
    }

    /// The connection is going away: tasks still collecting data are dropped, running
    /// ones finish on the logical unit but are not answered.
    fn abandon_all(&mut self) {
        let idle: Vec<u32> = self
            .tasks
            .iter()
            .filter(|(_, t)| !t.running)
            .map(|(itt, _)| *itt)
            .collect();
        for itt in idle {
            self.drop_task(itt);
        }
        self.tmfs.clear();
        for t in self.tasks.values_mut() {
            t.aborted = Some(false);
        }
        self.pending.clear();
    }

    /// Another nexus (or a reset) aborted this nexus's tasks.
    fn aborted_from_outside(&mut self, a: scsi::Aborts) {
        let had = self.tasks.len();
        debug!(peer = %self.peer, tas = a.tas, tasks = had, "tasks aborted from outside this session");
        self.abort_tasks(|_| true, a.tas);
        if a.cleared && !a.tas && had > 0 {
            if let Some((_, nexus)) = self.lu {
                nexus.raise_unit_attention(scsi::sense::UA_COMMANDS_CLEARED);
            }
        }
    }

    /// Abort the tasks `which` picks: those not yet running go at once, running ones are
    /// marked. Returns the ITTs still running.
    fn abort_tasks(&mut self, which: impl Fn(&Task) -> bool, tas: bool) -> Vec<u32> {
        let mut still = Vec::new();
        let mut gone = Vec::new();
        for (itt, t) in self.tasks.iter_mut() {
            if !which(t) {
                continue;
            }
            if t.running {
                t.aborted = Some(tas);
                still.push(*itt);
            } else {
                gone.push(*itt);
            }
        }
        for itt in gone {
            self.drop_task(itt);
        }
        still
    }

    fn tmf_task_done(&mut self, itt: u32) {
        let mut ready = Vec::new();
        for (i, p) in self.tmfs.iter_mut().enumerate() {
            p.waiting.retain(|w| *w != itt);
            if p.waiting.is_empty() {
                ready.push(i);
            }
        }
        for i in ready.into_iter().rev() {
            let p = self.tmfs.remove(i);
            self.send_tmf(p.itt, p.response);
            if p.then_close {
                self.close_after_flush = true;
            }
        }
    }

    fn send_tmf(&mut self, itt: u32, response: u8) {
        let stat_sn = self.next_stat_sn();
        let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::TaskMgmtResp(TaskMgmtResp {
            response,
            itt,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
        }));
    }

    fn send_ping(&mut self) {
        let ttt = self.alloc_ttt();
        let (stat_sn, exp_cmd_sn, max_cmd_sn) = (self.stat_sn, self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::NopIn(NopIn {
            lun: 0,
            itt: RESERVED_TAG,
            ttt,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            data: Bytes::new(),
        }));
        self.ping = Some((ttt, Instant::now()));
    }

    fn nop_out(&mut self, n: NopOut) {
        let stat_sn = self.next_stat_sn();
        let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::NopIn(NopIn {
            lun: n.lun,
            itt: n.itt,
            ttt: RESERVED_TAG,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            data: n.data,
        }));
    }

    fn task_mgmt(&mut self, t: TaskMgmtReq) {
        const COMPLETE: u8 = 0x00;
        const NO_TASK: u8 = 0x01;
        const NO_LUN: u8 = 0x02;
        const NO_REASSIGN: u8 = 0x04;
        const NOT_SUPPORTED: u8 = 0x05;
        const REJECTED: u8 = 0xff;
        let function = t.function & 0x7f;
        let Some((lu, nexus)) = self.lu else {
            self.send_tmf(t.itt, REJECTED);
            return;
        };
        let lun_ok = lun_number(t.lun) == Some(0);
        let (lu_function, then_close) = match function {
            1 => {
                // ABORT TASK: one task of this nexus.
                let Some(task) = self.tasks.get_mut(&t.ref_itt) else {
                    self.send_tmf(t.itt, NO_TASK);
                    return;
                };
                let waiting = if task.running {
                    task.aborted = Some(false);
                    vec![t.ref_itt]
                } else {
                    let cmd_sn = task.cmd_sn;
                    self.drop_task(t.ref_itt);
                    if matches!(self.pending.get(&cmd_sn), Some(Pending::Scsi(i)) if *i == t.ref_itt)
                    {
                        // Its CmdSN turn still comes, with nothing to do.
                        self.pending.insert(cmd_sn, Pending::Nothing);
                    }
                    Vec::new()
                };
                self.finish_tmf(t.itt, COMPLETE, waiting, false);
                return;
            }
            2 => (scsi::TaskFunction::AbortTaskSet, false),
            3 => {
                self.send_tmf(t.itt, NOT_SUPPORTED);
                return;
            }
            4 => (scsi::TaskFunction::ClearTaskSet, false),
            5 => (scsi::TaskFunction::LunReset, false),
            6 => (scsi::TaskFunction::TargetWarmReset, false),
            7 => (scsi::TaskFunction::TargetColdReset, true),
            8 => {
                self.send_tmf(t.itt, NO_REASSIGN);
                return;
            }
            _ => {
                self.send_tmf(t.itt, REJECTED);
                return;
            }
        };
        if !lun_ok && function <= 5 {
            self.send_tmf(t.itt, NO_LUN);
            return;
        }
        let mut waiting = self.abort_tasks(|_| true, false);
        self.pending.retain(|_, p| !matches!(p, Pending::Scsi(_)));
        let response = match lu.task_management(nexus, lu_function) {
            Ok(()) => {
                // The other node serving the unit takes the same effects first: the
                // response waits for it (under the TMF's own tag, which no task has).
                if let Some(peer) = lu.peer_task_management(lu_function) {
                    let itt = t.itt;
                    self.tmf_peer.push(Box::pin(async move {
                        peer.await;
                        itt
                    }));
                    waiting.push(itt);
                }
                COMPLETE
            }
            Err(e) => {
                warn!(peer = %self.peer, function, "task management failed: {e}");
                REJECTED
            }
        };
        info!(peer = %self.peer, function = ?lu_function, "task management function");
        self.finish_tmf(t.itt, response, waiting, then_close);
    }

    fn finish_tmf(&mut self, itt: u32, response: u8, waiting: Vec<u32>, then_close: bool) {
        if waiting.is_empty() {
            self.send_tmf(itt, response);
            if then_close {
                self.close_after_flush = true;
            }
        } else {
            self.tmfs.push(PendingTmf {
                itt,
                response,
                waiting,
                then_close,
            });
        }
    }

    fn text(&mut self, t: TextReq) {
        // A continuation of our long answer.
        if t.ttt != RESERVED_TAG {
            let rest = match self.text_more.take() {
                Some((ttt, rest)) if ttt == t.ttt => rest,
                _ => {
                    self.reject(0x09, t.header);
                    return;
                }
            };
            self.send_text(t.itt, t.lun, rest);
            return;
        }
        self.text_more = None;
        // The initiator's own text split over several PDUs.
        let mut acc = self.text_in.take().unwrap_or_default();
        acc.extend_from_slice(&t.data);
        if acc.len() > 64 << 10 {
            self.reject(0x09, t.header);
            return;
        }
        if t.cont {
            self.text_in = Some(acc);
            let stat_sn = self.next_stat_sn();
            let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
            let ttt = self.alloc_ttt();
            self.send(Reply::TextResp(TextResp {
                final_: false,
                cont: false,
                lun: t.lun,
                itt: t.itt,
                ttt,
                stat_sn,
                exp_cmd_sn,
                max_cmd_sn,
                data: Bytes::new(),
            }));
            return;
        }
        match text::respond(&self.shared.login, &self.kind, self.portal, &acc) {
            Ok(answer) => self.send_text(t.itt, t.lun, answer),
            Err(e) => {
                warn!(peer = %self.peer, "bad Text request: {e}");
                self.reject(0x09, t.header);
            }
        }
    }

    fn send_text(&mut self, itt: u32, lun: u64, answer: Bytes) {
        let max = self.params.max_xmit_data_segment_length.max(512) as usize;
        let (now, rest) = if answer.len() > max {
            (answer.slice(..max), Some(answer.slice(max..)))
        } else {
            (answer, None)
        };
        let ttt = match rest {
            Some(rest) => {
                let ttt = self.alloc_ttt();
                self.text_more = Some((ttt, rest));
                ttt
            }
            None => RESERVED_TAG,
        };
        let stat_sn = self.next_stat_sn();
        let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::TextResp(TextResp {
            final_: ttt == RESERVED_TAG,
            cont: ttt != RESERVED_TAG,
            lun,
            itt,
            ttt,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            data: now,
        }));
    }

    fn logout(&mut self, l: LogoutReq) {
        let response = match l.reason & 0x7f {
            0 => 0x00,
            1 if l.cid == self.cid => 0x00,
            1 => 0x01,
            2 => 0x02,
            _ => {
                self.reject(0x09, l.header);
                return;
            }
        };
        let stat_sn = self.next_stat_sn();
        let (exp_cmd_sn, max_cmd_sn) = (self.exp_cmd_sn, self.max_cmd_sn());
        self.send(Reply::LogoutResp(LogoutResp {
            response,
            itt: l.itt,
            stat_sn,
            exp_cmd_sn,
            max_cmd_sn,
            time2wait: 0,
            time2retain: 0,
        }));
        if response == 0 {
            debug!(peer = %self.peer, "logout");
            self.abandon_all();
            self.close_after_flush = true;
        }
    }
}

/// Take the next target transfer tag from `next`: never the reserved tag, never 0.
fn next_tag(next: &mut u32) -> u32 {
    let t = *next;
    *next = match t.wrapping_add(1) {
        RESERVED_TAG | 0 => 1,
        n => n,
    };
    t
}

/// `cdb` with its transfer length field (at `at`, `width` bytes) set to `blocks`.
fn set_transfer_len(cdb: &Bytes, at: usize, width: usize, blocks: u32) -> Option<Bytes> {
    let mut v = cdb.to_vec();
    let field = v.get_mut(at..at + width)?;
    match width {
        1 => field[0] = u8::try_from(blocks).ok()?,
        2 => field.copy_from_slice(&u16::try_from(blocks).ok()?.to_be_bytes()),
        _ => field.copy_from_slice(&blocks.to_be_bytes()),
    }
    Some(Bytes::from(v))
}
