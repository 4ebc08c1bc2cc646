//! The iSCSI server: targets, the accept loop, sessions.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::login::{Limits, LoginConfig, LoginTarget, Negotiated, SessionKind};
use super::session;
use crate::error::{Error, ErrorKind, Result};
use crate::scsi::LogicalUnit;

/// A CHAP user name and secret.
#[derive(Clone)]
pub struct ChapPair {
    /// The CHAP name (CHAP_N).
    pub user: String,
    /// The secret (12 to 255 bytes; never logged).
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for ChapPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChapPair")
            .field("user", &self.user)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// CHAP settings of a target.
#[derive(Clone, Debug)]
pub struct Chap {
    /// What the initiator must prove it knows.
    pub initiator: ChapPair,
    /// Mutual CHAP: what the target proves to an initiator that asks.
    pub target: Option<ChapPair>,
}

/// One iSCSI target: a name and its LUN 0.
#[derive(Clone, Debug)]
pub struct Target {
    name: String,
    alias: Option<String>,
    lun0: Arc<LogicalUnit>,
    chap: Option<Chap>,
    portal_group_tag: Option<u16>,
}

impl Target {
    /// A target named `name` (an `iqn.` or `eui.` name) whose LUN 0 is `lu`.
    pub fn new(name: impl Into<String>, lu: Arc<LogicalUnit>) -> Target {
        Target {
            name: name.into(),
            alias: None,
            lun0: lu,
            chap: None,
            portal_group_tag: None,
        }
    }

    /// A TargetAlias sent at login.
    pub fn with_alias(mut self, alias: impl Into<String>) -> Target {
        self.alias = Some(alias.into());
        self
    }

    /// Require CHAP to log in to this target.
    pub fn with_chap(mut self, chap: Chap) -> Target {
        self.chap = Some(chap);
        self
    }

    /// Report this portal group tag for the target (at login and in SendTargets)
    /// instead of the server's [`ServerOptions::portal_group_tag`]. A target served by
    /// both nodes of a mirror has one port per node; each node gives its port its own
    /// tag, so the initiator sees two distinct target ports (`<name>,t,0x<tag>`) of one
    /// target. Keep it equal to the number in the logical unit's
    /// [`TargetPort::name`](crate::scsi::TargetPort::name).
    pub fn with_portal_group_tag(mut self, tag: u16) -> Target {
        self.portal_group_tag = Some(tag);
        self
    }

    /// The target name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// LUN 0.
    pub fn lun0(&self) -> &Arc<LogicalUnit> {
        &self.lun0
    }
}

/// An open session, as management status shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// The target logged in to (empty for a discovery session).
    pub target: String,
    /// The initiator's name.
    pub initiator: String,
    /// The ISID, as 12 hex digits.
    pub isid: String,
    /// The target-assigned session handle.
    pub tsih: u16,
    /// The remote address of each connection.
    pub connections: Vec<String>,
}

/// Counters of a running server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// SCSI commands completed.
    pub commands: u64,
    /// Sessions that completed login (discovery and normal).
    pub sessions_total: u64,
    /// Sessions open now.
    pub sessions_open: u64,
    /// Logins refused (authentication, bad keys, unknown target).
    pub logins_refused: u64,
}

/// Tunables of a server; [`Default`] fits most uses.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// How long a connection may take to log in.
    pub login_timeout: Duration,
    /// After this long without a PDU from the initiator, the target sends a NOP-In ping.
    pub nop_interval: Duration,
    /// A ping unanswered this long ends the connection (a dead initiator).
    pub nop_timeout: Duration,
    /// The command window: MaxCmdSN is ExpCmdSN plus this, minus one.
    pub cmd_window: u32,
    /// Negotiation limits (data segment and burst sizes, outstanding R2Ts).
    pub limits: Limits,
    /// The portal group tag reported at login and by SendTargets.
    pub portal_group_tag: u16,
}

impl Default for ServerOptions {
    fn default() -> ServerOptions {
        ServerOptions {
            login_timeout: Duration::from_secs(30),
            nop_interval: Duration::from_secs(15),
            nop_timeout: Duration::from_secs(30),
            cmd_window: 128,
            limits: Limits::default(),
            portal_group_tag: 1,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) commands: AtomicU64,
    pub(super) sessions_total: AtomicU64,
    pub(super) logins_refused: AtomicU64,
}

/// An open session in the registry.
#[derive(Debug)]
struct Entry {
    info: SessionInfo,
    /// (initiator name, ISID, target index): a second login with the same key
    /// reinstates the session (RFC 7143 section 6.3.5), closing this one.
    key: (String, [u8; 6], Option<usize>),
    cancel: CancellationToken,
    reason: Arc<Mutex<&'static str>>,
    /// Completed when the session's connection has ended.
    done: Arc<tokio::sync::Notify>,
}

pub(super) struct Shared {
    pub(super) targets: Vec<Target>,
    pub(super) login: Arc<LoginConfig>,
    pub(super) options: ServerOptions,
    pub(super) counters: Counters,
    cancel: CancellationToken,
    tracker: TaskTracker,
    sessions: Mutex<HashMap<u64, Entry>>,
    next_session: AtomicU64,
    next_tsih: Mutex<u16>,
}

/// A session's place in the registry; dropping it removes the session.
pub(super) struct SessionGuard {
    shared: Arc<Shared>,
    id: u64,
    cancel: CancellationToken,
    reason: Arc<Mutex<&'static str>>,
    done: Arc<tokio::sync::Notify>,
}

impl SessionGuard {
    /// Cancelled when the session must end (server shutdown, reinstatement).
    pub(super) fn cancel(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Why the session was told to end.
    pub(super) fn reason(&self) -> &'static str {
        *self.reason.lock()
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.shared.sessions.lock().remove(&self.id);
        self.done.notify_waiters();
        self.done.notify_one();
    }
}

impl Shared {
    /// A TSIH for a new session: never 0, not one in use.
    pub(super) fn alloc_tsih(&self) -> u16 {
        let sessions = self.sessions.lock();
        let mut next = self.next_tsih.lock();
        loop {
            let t = *next;
            *next = match t.wrapping_add(1) {
                0 => 1,
                n => n,
            };
            if t != 0 && !sessions.values().any(|e| e.info.tsih == t) {
                return t;
            }
        }
    }

    /// Enter a logged-in session; an older session of the same initiator port to the
    /// same target is closed first (session reinstatement).
    pub(super) async fn register_session(
        self: &Arc<Self>,
        negotiated: &Negotiated,
        peer: &str,
    ) -> SessionGuard {
        let target = match negotiated.kind {
            SessionKind::Normal { target } => Some(target),
            SessionKind::Discovery => None,
        };
        let key = (negotiated.initiator_name.clone(), negotiated.isid, target);
        let old: Vec<Arc<tokio::sync::Notify>> = {
            let sessions = self.sessions.lock();
            sessions
                .values()
                .filter(|e| target.is_some() && e.key == key)
                .map(|e| {
                    *e.reason.lock() = "reinstated by a new login of the same initiator port";
                    e.cancel.cancel();
                    e.done.clone()
                })
                .collect()
        };
        for done in old {
            info!(initiator = %key.0, "session reinstatement: waiting for the old session to end");
            let _ = tokio::time::timeout(Duration::from_secs(10), done.notified()).await;
        }
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let cancel = self.cancel.child_token();
        let reason = Arc::new(Mutex::new("the server is shutting down"));
        let done = Arc::new(tokio::sync::Notify::new());
        let info = SessionInfo {
            target: target
                .and_then(|t| self.targets.get(t))
                .map_or_else(String::new, |t| t.name.clone()),
            initiator: negotiated.initiator_name.clone(),
            isid: negotiated.isid.iter().map(|b| format!("{b:02x}")).collect(),
            tsih: negotiated.tsih,
            connections: vec![peer.to_string()],
        };
        self.sessions.lock().insert(
            id,
            Entry {
                info,
                key,
                cancel: cancel.clone(),
                reason: reason.clone(),
                done: done.clone(),
            },
        );
        self.counters.sessions_total.fetch_add(1, Ordering::Relaxed);
        SessionGuard {
            shared: self.clone(),
            id,
            cancel,
            reason,
            done,
        }
    }
}

/// An iSCSI server for a set of targets on one portal. Cheap to clone; clones share
/// state.
#[derive(Clone)]
pub struct Server {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("targets", &self.shared.targets)
            .field("open_connections", &self.shared.tracker.len())
            .finish()
    }
}

/// The longest iSCSI name (RFC 7143 section 4.2.7.1).
pub const MAX_ISCSI_NAME: usize = 223;

/// Check an iSCSI name (RFC 7143 section 4.2.7, the ASCII subset): `iqn.` + a date
/// `yyyy-mm` + `.` + a reversed domain name, optionally `:` and an identifier; or
/// `eui.` + 16 hex digits. Names are compared after RFC 3722's stringprep, which maps
/// upper case to lower case, so only the lower-case (normalised) form is accepted: a-z,
/// 0-9, `-`, `.`, `:`. On error: what is wrong, in words.
pub fn check_iscsi_name(name: &str) -> Result<(), String> {
    const FORMS: &str = "write iqn.yyyy-mm.reversed.domain[:identifier] (such as \
                         iqn.2026-12.io.vsan:vol0) or eui. and 16 hex digits";
    if name.len() > MAX_ISCSI_NAME {
        return Err(format!(
            "is {} bytes; an iSCSI name has at most {MAX_ISCSI_NAME}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || "-.:".contains(*c)))
    {
        return Err(if c.is_ascii_uppercase() {
            format!(
                "{name:?} has upper case: iSCSI names are compared in lower case (RFC \
                 3722), so write it in lower case"
            )
        } else {
            format!("{name:?}: {c:?} is not allowed in an iSCSI name (a-z, 0-9, '-', '.', ':')")
        });
    }
    if let Some(hex) = name.strip_prefix("eui.") {
        return if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            Ok(())
        } else {
            Err(format!(
                "{name:?}: an eui. name is \"eui.\" and 16 hex digits (an EUI-64)"
            ))
        };
    }
    let Some(rest) = name.strip_prefix("iqn.") else {
        return Err(format!("{name:?} is not an iSCSI name: {FORMS}"));
    };
    let date = rest.get(..7).unwrap_or("");
    let (year, month) = date.split_once('-').unwrap_or(("", ""));
    let month_ok = month.len() == 2 && matches!(month.parse::<u8>(), Ok(1..=12));
    if year.len() != 4 || !year.bytes().all(|b| b.is_ascii_digit()) || !month_ok {
        return Err(format!(
            "{name:?}: an iqn. name starts with the year and month its naming authority \
             took the domain, as iqn.yyyy-mm.: {FORMS}"
        ));
    }
    let (authority, identifier) = match rest.get(7..).and_then(|r| r.strip_prefix('.')) {
        Some(r) => match r.split_once(':') {
            Some((a, id)) => (a, Some(id)),
            None => (r, None),
        },
        None => ("", None),
    };
    let label_ok = |l: &str| !l.is_empty() && !l.contains(':');
    if authority.is_empty() || !authority.split('.').all(label_ok) {
        return Err(format!(
            "{name:?}: an iqn. name has a reversed domain name after the date \
             (iqn.2026-12.com.example): {FORMS}"
        ));
    }
    if identifier == Some("") {
        return Err(format!("{name:?}: nothing follows the ':'"));
    }
    Ok(())
}

impl Server {
    /// A server for `targets`, with [`ServerOptions::default`]; names must be unique and
    /// valid iSCSI names.
    pub fn new(targets: Vec<Target>) -> Result<Server> {
        Server::with_options(targets, ServerOptions::default())
    }

    /// A server for `targets` with `options`.
    pub fn with_options(targets: Vec<Target>, options: ServerOptions) -> Result<Server> {
        if targets.is_empty() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "an iSCSI server needs at least one target",
            ));
        }
        for (i, t) in targets.iter().enumerate() {
            if let Err(why) = check_iscsi_name(&t.name) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("iSCSI target name {why}"),
                ));
            }
            if targets[..i].iter().any(|o| o.name == t.name) {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("iSCSI target {:?} given twice", t.name),
                ));
            }
        }
        if options.cmd_window == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                "the iSCSI command window must be at least 1",
            ));
        }
        let login = Arc::new(LoginConfig {
            targets: targets
                .iter()
                .map(|t| LoginTarget {
                    name: t.name.clone(),
                    alias: t.alias.clone(),
                    chap: t.chap.clone(),
                    portal_group_tag: t.portal_group_tag,
                })
                .collect(),
            portal_group_tag: options.portal_group_tag,
            limits: options.limits,
        });
        Ok(Server {
            shared: Arc::new(Shared {
                targets,
                login,
                options,
                counters: Counters::default(),
                cancel: CancellationToken::new(),
                tracker: TaskTracker::new(),
                sessions: Mutex::new(HashMap::new()),
                next_session: AtomicU64::new(1),
                next_tsih: Mutex::new(1),
            }),
        })
    }

    /// Accept initiators until [`Server::shutdown`]; each connection runs in its own
    /// task.
    pub async fn serve_tcp(&self, listener: TcpListener) -> Result<()> {
        info!(addr = ?listener.local_addr().ok(), "iSCSI target listening");
        loop {
            tokio::select! {
                _ = self.shared.cancel.cancelled() => return Ok(()),
                r = listener.accept() => match r {
                    Ok((stream, peer)) => {
                        // Responses are latency-bound: never let Nagle hold them.
                        let _ = stream.set_nodelay(true);
                        let portal = stream
                            .local_addr()
                            .map_or_else(|_| String::new(), |a| a.to_string());
                        self.spawn_connection(stream, peer_name(Some(peer)), portal);
                    }
                    Err(e) => {
                        warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                },
            }
        }
    }

    /// Serve one already-accepted connection in a new task tracked by this server;
    /// `portal` is the local address SendTargets reports (`host:port`).
    pub fn spawn_connection<S>(&self, stream: S, peer: String, portal: String)
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let shared = self.shared.clone();
        self.shared.tracker.spawn(async move {
            let (rd, wr) = tokio::io::split(stream);
            if let Err(e) = session::run(&shared, rd, wr, &peer, &portal).await {
                match e.kind() {
                    ErrorKind::Closed => debug!(%peer, "initiator went away: {e}"),
                    _ => warn!(%peer, "iSCSI connection closed: {e}"),
                }
            }
        });
    }

    /// Stop accepting and reading; commands already received finish and are answered
    /// before each connection closes. Pair with [`Server::wait_idle`].
    pub fn shutdown(&self) {
        self.shared.cancel.cancel();
        self.shared.tracker.close();
    }

    /// Wait until every connection has ended after [`Server::shutdown`].
    pub async fn wait_idle(&self) {
        self.shared.tracker.wait().await;
    }

    /// The targets.
    pub fn targets(&self) -> &[Target] {
        &self.shared.targets
    }

    /// The open sessions (normal and discovery).
    pub fn sessions(&self) -> Vec<SessionInfo> {
        let mut v: Vec<SessionInfo> = self
            .shared
            .sessions
            .lock()
            .values()
            .map(|e| e.info.clone())
            .collect();
        v.sort_by(|a, b| {
            (&a.target, &a.initiator, &a.isid).cmp(&(&b.target, &b.initiator, &b.isid))
        });
        v
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.counters;
        ServerStats {
            commands: c.commands.load(Ordering::Relaxed),
            sessions_total: c.sessions_total.load(Ordering::Relaxed),
            sessions_open: self.shared.sessions.lock().len() as u64,
            logins_refused: c.logins_refused.load(Ordering::Relaxed),
        }
    }
}

fn peer_name(addr: Option<SocketAddr>) -> String {
    addr.map_or_else(|| "unknown".to_string(), |a| a.to_string())
}
