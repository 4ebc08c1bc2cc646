//! The client side of a node's management API (`vsan.mgmt.v1`, gRPC) as `vsanctl` uses
//! it: reaching a node (plain or TLS, with a bearer token), reading sizes and rates the
//! way the node's config does, and showing what a node answers: a table for people, JSON
//! with stable field names for scripts.
//!
//! The JSON of a disk is the `DiskStatus` message with its enums as lowercase words
//! (`"link": "connected"`, `"kind": "bitmap"`, `"mode": "write-back"`), absent values as
//! `null` (no transport, no running sync, no cache, an unknown ETA), and generation ids
//! as 16-digit hex strings (they are 64-bit, more than a JSON number holds exactly).
//! Fields are only ever added.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use vsan_replica::mgmt::AddToken;
pub use vsan_replica::mgmt::v1;
use vsan_replica::mgmt::v1::mgmt_client::MgmtClient;

/// A management client with the bearer token (if any) on every request.
pub type Client = MgmtClient<InterceptedService<Channel, AddToken>>;

/// Where a node's management service is and how to talk to it.
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// `host:port`, or a URL (`http://host:port`, `https://host:port`).
    pub node: String,
    /// TLS: the CA (PEM) that signed the node's certificate. Without it the connection
    /// is plain HTTP/2.
    pub tls_ca: Option<PathBuf>,
    /// TLS: the name the node's certificate must carry (default: the host of `node`).
    pub tls_domain: Option<String>,
    /// The bearer token.
    pub token: Option<String>,
}

/// Why a node could not be reached.
#[derive(Debug)]
pub enum ConnectError {
    /// The target itself is wrong (bad address, unreadable CA file, bad token): the
    /// caller's mistake, found before any connection.
    Usage(String),
    /// The node did not answer (refused, timed out, TLS handshake failed).
    Unreachable(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Usage(m) | ConnectError::Unreachable(m) => f.write_str(m),
        }
    }
}

/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The URI for `node`: a bare `host:port` gets `http://`, or `https://` with TLS.
pub fn node_uri(node: &str, tls: bool) -> Result<String, String> {
    let node = node.trim();
    if node.is_empty() {
        return Err("the node address is empty".into());
    }
    let uri = match (node.split_once("://"), tls) {
        (None, false) => format!("http://{node}"),
        (None, true) => format!("https://{node}"),
        (Some(("http", _)), false) | (Some(("https", _)), true) => node.to_string(),
        (Some(("http", _)), true) => {
            return Err(format!("{node} is plain http, but --tls-ca asks for TLS"));
        }
        (Some(("https", _)), false) => {
            return Err(format!("{node} is https: give the node's CA with --tls-ca"));
        }
        (Some((scheme, _)), _) => {
            return Err(format!(
                "{node}: the scheme {scheme:?} is not http or https"
            ));
        }
    };
    uri.parse::<tonic::codegen::http::Uri>()
        .map_err(|e| format!("{node} is not an address such as 127.0.0.1:7101: {e}"))?;
    Ok(uri)
}

/// `e` and its sources, joined by `: ` (tonic's transport errors say little at the top).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// Connect to the node `target` names.
pub async fn connect(target: &Target) -> Result<Client, ConnectError> {
    let uri = node_uri(&target.node, target.tls_ca.is_some()).map_err(ConnectError::Usage)?;
    let token = AddToken::new(target.token.as_deref())
        .map_err(|e| ConnectError::Usage(format!("bad token: {}", e.context())))?;
    let mut endpoint = Endpoint::from_shared(uri.clone())
        .map_err(|e| ConnectError::Usage(format!("{uri}: {}", error_chain(&e))))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    if let Some(ca) = &target.tls_ca {
        let pem = std::fs::read(ca).map_err(|e| {
            ConnectError::Usage(format!("cannot read the CA file {}: {e}", ca.display()))
        })?;
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem));
        if let Some(d) = &target.tls_domain {
            tls = tls.domain_name(d.clone());
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| ConnectError::Usage(format!("TLS: {}", error_chain(&e))))?;
    }
    let channel = endpoint.connect().await.map_err(|e| {
        ConnectError::Unreachable(format!(
            "cannot reach the node at {uri}: {}",
            error_chain(&e)
        ))
    })?;
    Ok(MgmtClient::with_interceptor(channel, token))
}

/// The gRPC name of a status code (`NOT_FOUND`), as `grpcurl` and the gRPC docs spell it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `CODE: message` for a status from the node (with the cause of a transport failure).
pub fn describe_status(s: &tonic::Status) -> String {
    let mut text = format!("{}: ", code_name(s.code()));
    match std::error::Error::source(s).map(error_chain) {
        // A failure on this side (the connection broke): the cause says more, and
        // usually starts with the message.
        Some(cause) if cause.starts_with(s.message()) => text += &cause,
        Some(cause) if !s.message().contains(&cause) => {
            text += &format!("{}: {cause}", s.message());
        }
        _ => text += s.message(),
    }
    text
}

// ----- sizes and rates, read as the node's config reads them -----

/// A size such as `64MiB`, `1G` (binary: 1 GiB) or `4096`; must be above 0.
pub fn parse_size(text: &str) -> Result<u64, String> {
    parse_size::Config::new()
        .with_binary()
        .parse_size(text.trim())
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{text:?} is not a size such as \"64MiB\""))
}

/// A resync rate: `dynamic` (0) or bytes per second such as `40MiB` or `40MiB/s`.
pub fn parse_rate(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("dynamic") {
        return Ok(0);
    }
    let per = t.strip_suffix("/s").unwrap_or(t);
    parse_size(per)
        .map_err(|_| format!("{text:?} is neither \"dynamic\" nor a rate such as \"40MiB\""))
}

/// Bytes for people: `512 B`, `16 MiB`, `1.5 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut v = n as f64;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else if (v - v.round()).abs() < 0.05 {
        format!("{:.0} {}", v.round(), UNITS[unit])
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A duration in seconds for people: `45s`, `3m20s`, `2h05m`.
pub fn human_secs(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

// ----- enum words -----

/// `connected`, `degraded`, ... (`unknown` for a value this client does not know).
pub fn link_word(v: i32) -> &'static str {
    match v1::LinkState::try_from(v) {
        Ok(v1::LinkState::Local) => "local",
        Ok(v1::LinkState::Waiting) => "waiting",
        Ok(v1::LinkState::Handshaking) => "handshaking",
        Ok(v1::LinkState::Connected) => "connected",
        Ok(v1::LinkState::Degraded) => "degraded",
        Ok(v1::LinkState::Unspecified) | Err(_) => "unknown",
    }
}

/// `bitmap`, `checksum`, `verify`.
pub fn kind_word(v: i32) -> &'static str {
    match v1::SyncKind::try_from(v) {
        Ok(v1::SyncKind::Bitmap) => "bitmap",
        Ok(v1::SyncKind::Checksum) => "checksum",
        Ok(v1::SyncKind::Verify) => "verify",
        Ok(v1::SyncKind::Unspecified) | Err(_) => "unknown",
    }
}

/// `source`, `target`.
pub fn role_word(v: i32) -> &'static str {
    match v1::SyncRole::try_from(v) {
        Ok(v1::SyncRole::Source) => "source",
        Ok(v1::SyncRole::Target) => "target",
        Ok(v1::SyncRole::Unspecified) | Err(_) => "unknown",
    }
}

/// `write-back`, ... (the config's words).
pub fn cache_mode_word(v: i32) -> &'static str {
    match v1::CacheMode::try_from(v) {
        Ok(v1::CacheMode::WriteBack) => "write-back",
        Ok(v1::CacheMode::WriteThrough) => "write-through",
        Ok(v1::CacheMode::WriteAround) => "write-around",
        Ok(v1::CacheMode::PassThrough) => "pass-through",
        Ok(v1::CacheMode::Unspecified) | Err(_) => "unknown",
    }
}

/// What a pass is called in sentences: `bitmap resync`, `checksum resync`, `verify`.
pub fn pass_name(kind: i32) -> String {
    match kind_word(kind) {
        "verify" => "verify".into(),
        k => format!("{k} resync"),
    }
}

// ----- JSON -----

fn text_or_null(s: &str) -> Value {
    if s.is_empty() {
        Value::Null
    } else {
        Value::String(s.to_string())
    }
}

fn hex(id: u64) -> Value {
    Value::String(format!("{id:016x}"))
}

/// A running pass as JSON.
pub fn progress_json(p: &v1::SyncProgress) -> Value {
    json!({
        "kind": kind_word(p.kind),
        "role": role_word(p.role),
        "total_bytes": p.total_bytes,
        "done_bytes": p.done_bytes,
        "transferred_bytes": p.transferred_bytes,
        "rate": p.rate,
        "eta_s": if p.eta_s < 0 { Value::Null } else { json!(p.eta_s) },
        "percent": p.percent,
    })
}

/// How a pass ended, as JSON.
pub fn summary_json(s: &v1::SyncSummary) -> Value {
    json!({
        "kind": kind_word(s.kind),
        "role": role_word(s.role),
        "completed": s.completed,
        "total_bytes": s.total_bytes,
        "done_bytes": s.done_bytes,
        "transferred_bytes": s.transferred_bytes,
        "mismatches": s.mismatches,
        "elapsed_ms": s.elapsed_ms,
    })
}

/// A disk's status as JSON (see the module doc).
pub fn disk_json(s: &v1::DiskStatus) -> Value {
    json!({
        "name": s.name,
        "size": s.size,
        "block_size": s.block_size,
        "mirrored": s.mirrored,
        "peer_id": if s.mirrored { json!(s.peer_id) } else { Value::Null },
        "link": link_word(s.link),
        "transport": text_or_null(&s.transport),
        "requested_transport": text_or_null(&s.requested_transport),
        "local_state": s.local_state,
        "syncing": s.syncing,
        "sync": s.sync.as_ref().map_or(Value::Null, progress_json),
        "last_sync": s.last_sync.as_ref().map_or(Value::Null, summary_json),
        "dirty_chunks": s.dirty_chunks,
        "generations": s.generations.as_ref().map_or(Value::Null, |g| json!({
            "current": hex(g.current),
            "bitmap": hex(g.bitmap),
            "history": g.history.iter().map(|h| hex(*h)).collect::<Vec<_>>(),
        })),
        "quorum": s.quorum,
        "suspended": s.suspended,
        "last_problem": text_or_null(&s.last_problem),
        "local_data_lost": s.local_data_lost,
        "freshness": text_or_null(&s.freshness),
        "freshness_proof": text_or_null(&s.freshness_proof),
        "link_role": text_or_null(&s.link_role),
        "awaiting": text_or_null(&s.awaiting),
        "unproven_since_unix_ms": if s.unproven_since_unix_ms > 0 {
            json!(s.unproven_since_unix_ms)
        } else {
            Value::Null
        },
        "cache": s.cache.as_ref().map_or(Value::Null, |c| json!({
            "mode": cache_mode_word(c.mode),
            "state": c.state,
            "lost_blocks": c.lost_blocks,
            "read_hits": c.read_hits,
            "read_misses": c.read_misses,
            "dirty_bytes": c.dirty_bytes,
            "log_bytes": c.log_bytes,
            "destaged_bytes": c.destaged_bytes,
            "occupancy": c.occupancy,
        })),
        "nbd": text_or_null(&s.nbd),
        "nbd_clients": s.nbd_clients,
        "iscsi": iscsi_json(s),
        "vhost_user": vhost_user_json(s),
    })
}

/// A disk's vhost-user-blk export as JSON: `null` without one, else its socket, whether
/// a front end is connected, the front ends accepted, the negotiated features and
/// per-queue counters.
pub fn vhost_user_json(s: &v1::DiskStatus) -> Value {
    if s.vhost_user.is_empty() {
        return Value::Null;
    }
    json!({
        "socket": s.vhost_user,
        "connected": s.vhost_user_connected,
        "connections": s.vhost_user_connections,
        "features": s.vhost_user_features,
        "queues": s.vhost_user_queues.iter().map(|q| json!({
            "requests": q.requests,
            "reads": q.reads,
            "writes": q.writes,
            "flushes": q.flushes,
            "discards": q.discards,
            "write_zeroes": q.write_zeroes,
            "unsupported": q.unsupported,
            "errors": q.errors,
            "bad_chains": q.bad_chains,
            "read_bytes": q.read_bytes,
            "written_bytes": q.written_bytes,
            "in_flight": q.in_flight,
        })).collect::<Vec<_>>(),
    })
}

/// A disk's vhost-user-blk export, one line for the socket and one per queue (empty
/// without one): `vhost-user:   /run/vsan/vol0.vhost, front end connected (1 so far)`,
/// then `  queue 0:    120 reads, 80 writes, 2 flushes, 0 errors, 0 refused chains, 3
/// in flight`.
pub fn vhost_user_lines(s: &v1::DiskStatus) -> String {
    if s.vhost_user.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "vhost-user:   {}, {} ({} so far)\n",
        s.vhost_user,
        if s.vhost_user_connected {
            "front end connected"
        } else {
            "no front end"
        },
        s.vhost_user_connections
    );
    for (i, q) in s.vhost_user_queues.iter().enumerate() {
        out += &format!(
            "  queue {i}:    {} reads, {} writes, {} flushes, {} errors, {} refused chains, {} in flight\n",
            q.reads, q.writes, q.flushes, q.errors, q.bad_chains, q.in_flight
        );
    }
    out
}

/// A disk's iSCSI target as JSON: `null` without one, else its name, portal and
/// sessions (`initiator`, `isid`, `tsih`, `connections`).
pub fn iscsi_json(s: &v1::DiskStatus) -> Value {
    if s.iscsi_target.is_empty() {
        return Value::Null;
    }
    json!({
        "target": s.iscsi_target,
        "portal": s.iscsi_portal,
        "sessions": s.iscsi_sessions.iter().map(|x| json!({
            "initiator": x.initiator,
            "isid": x.isid,
            "tsih": x.tsih,
            "connections": x.connections,
        })).collect::<Vec<_>>(),
    })
}

/// A disk's iSCSI target and its sessions, one line each (empty without a target):
/// `iscsi:        iqn.2026-12.io.vsan:vol0 on 127.0.0.1:3260, 1 session`, then per
/// session `  session:    iqn.1994-05.com.redhat:host isid 400001370000 tsih 1,
/// 1 connection (127.0.0.1:51234)`.
pub fn iscsi_lines(s: &v1::DiskStatus) -> String {
    if s.iscsi_target.is_empty() {
        return String::new();
    }
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    let mut out = format!(
        "iscsi:        {} on {}, {}\n",
        s.iscsi_target,
        s.iscsi_portal,
        plural(s.iscsi_sessions.len(), "session")
    );
    for x in &s.iscsi_sessions {
        out += &format!(
            "  session:    {} isid {} tsih {}, {} ({})\n",
            x.initiator,
            x.isid,
            x.tsih,
            plural(x.connections.len(), "connection"),
            x.connections.join(", ")
        );
    }
    out
}

/// A node's disks as JSON: `{"node_id": 1, "disks": [...]}`.
pub fn list_json(r: &v1::ListDisksResponse) -> Value {
    json!({
        "node_id": r.node_id,
        "disks": r.disks.iter().map(disk_json).collect::<Vec<_>>(),
    })
}

// ----- the table -----

/// A running pass in a few words: `bitmap source 42.0% 12 MiB/s eta 3s`.
pub fn progress_words(p: &v1::SyncProgress) -> String {
    let mut s = format!(
        "{} {} {:.1}%",
        kind_word(p.kind),
        role_word(p.role),
        p.percent
    );
    if p.rate > 0 {
        s += &format!(" {}/s", human_bytes(p.rate));
    }
    if p.eta_s >= 0 {
        s += &format!(" eta {}", human_secs(p.eta_s as u64));
    }
    s
}

/// The SYNC column.
fn sync_cell(s: &v1::DiskStatus) -> String {
    if let Some(p) = &s.sync {
        return progress_words(p);
    }
    if !s.mirrored {
        return "-".into();
    }
    if s.dirty_chunks > 0 {
        return format!("{} chunks dirty", s.dirty_chunks);
    }
    if link_word(s.link) == "connected" && s.local_state == "up-to-date" {
        "in sync".into()
    } else {
        "-".into()
    }
}

/// How long ago `unix_ms` was, in seconds (0 for a time not in the past).
fn seconds_since(unix_ms: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_sub(unix_ms) / 1000
}

/// The SERVING column: whether the local replica is proven current and served.
fn serving_cell(s: &v1::DiskStatus) -> String {
    match s.freshness.as_str() {
        "unproven" => format!(
            "no: unproven {}",
            human_secs(seconds_since(s.unproven_since_unix_ms))
        ),
        "current" => format!("yes ({})", s.freshness_proof),
        _ => "yes".into(),
    }
}

/// The table's header and one row per disk.
pub fn status_rows(disks: &[v1::DiskStatus]) -> Vec<[String; 11]> {
    let mut rows = vec![
        [
            "DISK",
            "SIZE",
            "LINK",
            "TRANSPORT",
            "LOCAL",
            "SERVING",
            "SYNC",
            "CACHE",
            "QUORUM",
            "NBD",
            "ISCSI",
        ]
        .map(String::from),
    ];
    for s in disks {
        let link = if s.mirrored {
            format!("{} (peer {})", link_word(s.link), s.peer_id)
        } else {
            link_word(s.link).to_string()
        };
        let transport = match (s.transport.is_empty(), s.requested_transport.is_empty()) {
            (true, _) => "-".to_string(),
            (false, true) => s.transport.clone(),
            (false, false) => format!("{} ({} asked)", s.transport, s.requested_transport),
        };
        let cache = match &s.cache {
            None => "-".to_string(),
            Some(c) if c.state != "running" => {
                format!(
                    "{} {} ({} blocks lost)",
                    cache_mode_word(c.mode),
                    c.state,
                    c.lost_blocks
                )
            }
            Some(c) => format!(
                "{}, {} dirty",
                cache_mode_word(c.mode),
                human_bytes(c.dirty_bytes)
            ),
        };
        let quorum = if s.suspended {
            format!("{} (suspended)", s.quorum)
        } else {
            s.quorum.clone()
        };
        let nbd = if s.nbd.is_empty() {
            "-".to_string()
        } else {
            format!(
                "{} ({} client{})",
                s.nbd,
                s.nbd_clients,
                if s.nbd_clients == 1 { "" } else { "s" }
            )
        };
        let iscsi = if s.iscsi_target.is_empty() {
            "-".to_string()
        } else {
            let n = s.iscsi_sessions.len();
            format!(
                "{} ({} session{})",
                s.iscsi_portal,
                n,
                if n == 1 { "" } else { "s" }
            )
        };
        rows.push([
            s.name.clone(),
            human_bytes(s.size),
            link,
            transport,
            s.local_state.clone(),
            serving_cell(s),
            sync_cell(s),
            cache,
            quorum,
            nbd,
            iscsi,
        ]);
    }
    rows
}

/// `rows` as left-aligned columns, two spaces apart, one line each.
pub fn format_table<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for r in rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (i, (cell, w)) in r.iter().zip(widths).enumerate() {
            if i + 1 == N {
                line += cell;
            } else {
                line += &format!("{cell:<w$}  ");
            }
        }
        out += line.trim_end();
        out.push('\n');
    }
    out
}

/// How a pass ended, in a sentence (without the disk's name).
pub fn summary_sentence(l: &v1::SyncSummary) -> String {
    let mut s = format!(
        "{} ({}) {} after {:.1}s: {} of {} gone through, {} transferred",
        pass_name(l.kind),
        role_word(l.role),
        if l.completed { "completed" } else { "stopped" },
        l.elapsed_ms as f64 / 1000.0,
        human_bytes(l.done_bytes),
        human_bytes(l.total_bytes),
        human_bytes(l.transferred_bytes),
    );
    if kind_word(l.kind) == "verify" {
        s += &format!(
            ", {} mismatch{}",
            l.mismatches,
            if l.mismatches == 1 { "" } else { "es" }
        );
    }
    s
}

/// What the table leaves out, for one disk: its last pass, problem and generations.
pub fn status_details(s: &v1::DiskStatus) -> String {
    let mut out = String::new();
    if s.freshness == "unproven" {
        out += &format!(
            "freshness:    UNPROVEN for {}: nothing is served from this replica (requests \
             wait) until {}\n",
            human_secs(seconds_since(s.unproven_since_unix_ms)),
            s.awaiting
        );
    } else if s.freshness == "current" {
        out += &format!("freshness:    current (proved by: {})\n", s.freshness_proof);
    }
    match s.link_role.as_str() {
        "source" => {
            out += "link role:    resync source (this link's handshake found this replica newer)\n"
        }
        "target" => {
            out += "link role:    resync target (this link's handshake found the peer's replica newer)\n"
        }
        _ => {}
    }
    out += &iscsi_lines(s);
    out += &vhost_user_lines(s);
    if let Some(l) = &s.last_sync {
        out += &format!("last sync:    {}\n", summary_sentence(l));
    }
    if !s.last_problem.is_empty() {
        out += &format!("last problem: {}\n", s.last_problem);
    }
    if s.local_data_lost > 0 {
        out += &format!("local data lost: {} times\n", s.local_data_lost);
    }
    if let Some(g) = &s.generations {
        out += &format!(
            "generations:  current {:016x}, bitmap {:016x}, history [{}]\n",
            g.current,
            g.bitmap,
            g.history
                .iter()
                .map(|h| format!("{h:016x}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connected() -> v1::DiskStatus {
        v1::DiskStatus {
            name: "vol0".into(),
            size: 16 << 20,
            block_size: 4096,
            mirrored: true,
            peer_id: 2,
            link: v1::LinkState::Connected as i32,
            transport: "tcp".into(),
            local_state: "up-to-date".into(),
            quorum: "none".into(),
            nbd: "127.0.0.1:10809".into(),
            nbd_clients: 1,
            freshness: "current".into(),
            freshness_proof: "handshake".into(),
            generations: Some(v1::Generations {
                current: u64::MAX,
                bitmap: 0,
                history: vec![1],
            }),
            ..Default::default()
        }
    }

    #[test]
    fn sizes_and_rates_read_like_the_config() {
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size(" 4096 "), Ok(4096));
        assert!(parse_size("banana").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_rate("dynamic"), Ok(0));
        assert_eq!(parse_rate("40MiB"), Ok(40 << 20));
        assert_eq!(parse_rate("40MiB/s"), Ok(40 << 20));
        assert!(parse_rate("fast").is_err());
    }

    #[test]
    fn node_addresses() {
        assert_eq!(
            node_uri("127.0.0.1:7101", false).unwrap(),
            "http://127.0.0.1:7101"
        );
        assert_eq!(
            node_uri("localhost:7101", true).unwrap(),
            "https://localhost:7101"
        );
        assert_eq!(
            node_uri("http://[::1]:7101", false).unwrap(),
            "http://[::1]:7101"
        );
        assert!(node_uri("http://127.0.0.1:7101", true).is_err());
        assert!(node_uri("https://127.0.0.1:7101", false).is_err());
        assert!(node_uri("ftp://x:1", false).is_err());
        assert!(node_uri("", false).is_err());
        assert!(node_uri("not an address", false).is_err());
    }

    #[test]
    fn json_has_stable_names_and_words() {
        let mut s = connected();
        s.sync = Some(v1::SyncProgress {
            kind: v1::SyncKind::Bitmap as i32,
            role: v1::SyncRole::Source as i32,
            total_bytes: 100,
            done_bytes: 50,
            eta_s: -1,
            percent: 50.0,
            ..Default::default()
        });
        s.syncing = true;
        let j = disk_json(&s);
        assert_eq!(j["link"], "connected");
        assert_eq!(j["transport"], "tcp");
        assert_eq!(j["requested_transport"], Value::Null);
        assert_eq!(j["local_state"], "up-to-date");
        assert_eq!(j["peer_id"], 2);
        assert_eq!(j["sync"]["kind"], "bitmap");
        assert_eq!(j["sync"]["role"], "source");
        assert_eq!(j["sync"]["eta_s"], Value::Null);
        assert_eq!(j["last_sync"], Value::Null);
        assert_eq!(j["cache"], Value::Null);
        assert_eq!(j["generations"]["current"], "ffffffffffffffff");
        assert_eq!(j["generations"]["history"][0], "0000000000000001");
        assert_eq!(j["last_problem"], Value::Null);
        let l = list_json(&v1::ListDisksResponse {
            node_id: 1,
            disks: vec![connected()],
        });
        assert_eq!(l["node_id"], 1);
        assert_eq!(l["disks"][0]["name"], "vol0");
        // A value from a newer node is shown, not refused.
        assert_eq!(link_word(99), "unknown");
    }

    #[test]
    fn table_lines_up() {
        let mut other = connected();
        other.name = "a-longer-name".into();
        other.link = v1::LinkState::Degraded as i32;
        other.transport.clear();
        other.dirty_chunks = 3;
        other.cache = Some(v1::CacheStatus {
            mode: v1::CacheMode::WriteBack as i32,
            state: "running".into(),
            dirty_bytes: 1 << 20,
            ..Default::default()
        });
        other.freshness = "unproven".into();
        other.freshness_proof.clear();
        other.awaiting = "the peer's handshake or an operator's declare-current".into();
        other.unproven_since_unix_ms = 1;
        let t = format_table(&status_rows(&[connected(), other.clone()]));
        assert!(
            status_details(&other).contains("UNPROVEN")
                && status_details(&other).contains("declare-current"),
            "{}",
            status_details(&other)
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("DISK "), "{t}");
        assert!(
            lines[1].contains("connected (peer 2)") && lines[1].contains("in sync"),
            "{t}"
        );
        assert!(lines[1].contains("127.0.0.1:10809 (1 client)"), "{t}");
        assert!(
            lines[2].contains("degraded") && lines[2].contains("3 chunks dirty"),
            "{t}"
        );
        assert!(lines[2].contains("write-back, 1 MiB dirty"), "{t}");
        assert!(lines[1].contains("yes (handshake)"), "{t}");
        assert!(lines[2].contains("no: unproven"), "{t}");
        // Columns start at the same place on every line.
        let at = lines[0].find("LINK").unwrap();
        assert_eq!(&lines[1][at..at + 9], "connected");
        assert_eq!(&lines[2][at..at + 8], "degraded");
    }

    #[test]
    fn iscsi_targets_and_sessions_are_shown() {
        let mut s = connected();
        assert_eq!(iscsi_json(&s), Value::Null);
        assert_eq!(iscsi_lines(&s), "");
        s.iscsi_target = "iqn.2026-12.io.vsan:vol0".into();
        s.iscsi_portal = "127.0.0.1:3260".into();
        s.iscsi_sessions = vec![v1::IscsiSession {
            initiator: "iqn.1994-05.com.redhat:host".into(),
            isid: "400001370000".into(),
            tsih: 1,
            connections: vec!["127.0.0.1:51234".into()],
        }];
        let j = disk_json(&s);
        assert_eq!(j["iscsi"]["target"], "iqn.2026-12.io.vsan:vol0");
        assert_eq!(j["iscsi"]["sessions"][0]["isid"], "400001370000");
        assert_eq!(
            j["iscsi"]["sessions"][0]["connections"][0],
            "127.0.0.1:51234"
        );
        let lines = iscsi_lines(&s);
        assert!(
            lines.contains("iqn.2026-12.io.vsan:vol0 on 127.0.0.1:3260, 1 session\n"),
            "{lines}"
        );
        assert!(
            lines.contains(
                "iqn.1994-05.com.redhat:host isid 400001370000 tsih 1, 1 connection \
                 (127.0.0.1:51234)"
            ),
            "{lines}"
        );
        assert!(
            status_details(&s).contains("session:"),
            "{}",
            status_details(&s)
        );
        let t = format_table(&status_rows(&[s]));
        assert!(t.contains("127.0.0.1:3260 (1 session)"), "{t}");
    }

    #[test]
    fn people_numbers() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(16 << 20), "16 MiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_secs(45), "45s");
        assert_eq!(human_secs(200), "3m20s");
        assert_eq!(human_secs(7500), "2h05m");
        assert_eq!(code_name(tonic::Code::NotFound), "NOT_FOUND");
        let s = tonic::Status::not_found("node 1 has no disk \"nope\"");
        assert_eq!(
            describe_status(&s),
            "NOT_FOUND: node 1 has no disk \"nope\""
        );
        let io = std::io::Error::other("transport error: broken pipe");
        let s = tonic::Status::from_error(Box::new(io));
        assert_eq!(describe_status(&s), "UNKNOWN: transport error: broken pipe");
    }
}
