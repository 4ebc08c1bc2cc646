//! QUIC links with mutual TLS (quinn, rustls): encrypted, authenticated replication
//! across networks that are not trusted.
//!
//! # Who is who
//!
//! Every node has an [`Identity`]: a certificate chain and its private key, loaded from
//! PEM files, or generated (self-signed) at first start with
//! [`Identity::load_or_generate`]. Both sides of a link present their certificate and
//! check the other's (mutual TLS; a client without a certificate is refused), with the
//! same rules on both sides, set in [`QuicConfig`]:
//!
//! - **Pinning** ([`QuicConfig::pinned_peers`]): the SHA-256 [`Fingerprint`] of the
//!   peer's leaf certificate (its DER bytes) must be one of the pinned ones. Operators
//!   exchange fingerprints (`sha256:` and 64 hex digits) instead of running a CA. The
//!   certificate's name and validity dates are not looked at.
//! - **A CA** ([`QuicConfig::peer_ca`]): the peer's chain must lead to one of the CA
//!   certificates (rustls' webpki verifiers: signatures, validity dates, key usage, and
//!   on the dialing side the server name, see [`QuicConfig::server_name`]).
//!
//! When both are set, the peer must pass both. In every case the TLS handshake's
//! signatures are verified against the presented certificate, so the peer proves it
//! holds the private key: a copied certificate is not enough.
//!
//! A peer that fails the check is refused on both sides with an error that says why: the
//! dialing side's [`connect`](Transport::connect) fails with
//! [`Protocol`](vsan_core::ErrorKind::Protocol) and a message like `peer certificate
//! sha256:… is not the pinned sha256:…`, and the accepting side's
//! [`accept`](Listener::accept) returns such an error for that one connection and keeps
//! listening. The side whose certificate was refused hears it from the peer: `the peer
//! refused this node's certificate: …`.
//!
//! # The link
//!
//! One link is one QUIC connection (TLS 1.3, ALPN [`ALPN`]) carrying one bidirectional
//! stream, opened by the dialing side. Before the link is handed out both sides exchange
//! an 8-byte preamble on the stream, so the acceptor learns of the stream at once and the
//! dialer knows the acceptor took its certificate. After that the stream carries frames
//! of the [`crate::wire`] codec, the same bytes a TCP link carries.
//!
//! `send` encodes the message and queues the frame (header and data, never copied); a
//! writer task hands queued frames to quinn many at a time. The queue counts toward
//! [`queue_depth`](crate::transport::LinkTx::queue_depth) until quinn has taken them, and `send` waits
//! while it is above [`QuicConfig::send_queue_limit`]. Frames of one
//! [`send_batch`](crate::transport::LinkTx::send_batch) are queued together, so nothing comes between them.
//!
//! `recv` reads what quinn has received, chunks as they arrive, into one buffer and
//! decodes frames from it; the data of a write or read reply is a slice of that buffer.
//! Anything the codec refuses fails `recv` with
//! [`Protocol`](vsan_core::ErrorKind::Protocol) and closes the connection: the peer is
//! not trusted again on it.
//!
//! `close` finishes the stream after the last queued frame and waits until the peer has
//! acknowledged all of it (bounded by [`QuicConfig::close_timeout`]; on timeout what is
//! queued is dropped and the stream reset), so the peer's `recv` sees
//! [`Closed`](vsan_core::ErrorKind::Closed) after the last message even when this side
//! drops the link right after `close`. Closing one direction leaves the other open.
//! Dropping both halves closes the connection at once: what was not yet acknowledged
//! may be lost, as the trait says of dropping.
//!
//! A peer that goes silent (crashed, unplugged) is noticed within
//! [`QuicConfig::idle_timeout`]: both sides send keep-alives every
//! [`QuicConfig::keep_alive_interval`], and a link that hears nothing for the idle
//! timeout fails with [`Timeout`](vsan_core::ErrorKind::Timeout).
//!
//! # Addresses
//!
//! `host:port`, as for TCP (`"127.0.0.1:7002"`, `"[::1]:7002"`, `"node2.example:7002"`);
//! [`listen`](Transport::listen) binds a UDP socket (port 0 picks a free one).
//! Each `connect` uses its own UDP socket. Peers show as `quic:` and the address
//! (`"quic:127.0.0.1:7002"`). Datagrams that are not QUIC are dropped by quinn and do
//! not disturb the listener; handshakes run beside each other, so a slow or hostile
//! client does not hold up the next one. A dead address makes `connect` fail with
//! [`Timeout`](vsan_core::ErrorKind::Timeout) after [`QuicConfig::connect_timeout`]
//! (UDP has no connection refused).
//!
//! # Files
//!
//! This file holds the settings, the transport and the listener; `identity.rs` the
//! certificates, keys and fingerprints; `verify.rs` the peer certificate checks and the
//! client's TLS settings; `errors.rs` what quinn's and rustls's errors mean for a link;
//! `link.rs` the link itself (its sending half is the shared byte-stream send side).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{Endpoint, Incoming, VarInt};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::server::NoServerSessionStorage;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::accept::AcceptQueue;
use super::{Link, Listener, Transport};
use crate::wire;
use crate::wire::Message;

mod errors;
mod identity;
mod link;
#[cfg(test)]
mod tests;
mod verify;

pub use identity::{CaCertificates, Fingerprint, Identity};

use errors::{connection_error, read_exact_error, write_error};
use link::make_link;
use verify::{PeerVerifier, client_tls, tls_error};

/// The ALPN protocol both sides offer; a peer offering another is refused.
pub const ALPN: &[u8] = b"vsan-replica/1";

/// The server name a dialer asks for when peers are only pinned (no CA): the pinned
/// fingerprint is what is checked, not the name.
pub const PINNED_SERVER_NAME: &str = "vsan-peer";

/// What the dialer writes first on the link's stream.
const PREAMBLE_DIAL: [u8; 8] = *b"vsanQ1d\n";
/// What the acceptor answers.
const PREAMBLE_ACCEPT: [u8; 8] = *b"vsanQ1a\n";

/// Most chunks handed to quinn in one write.
const MAX_CHUNKS: usize = 64;
/// Most bytes handed to quinn in one write.
const MAX_BATCH_BYTES: usize = 1 << 20;
/// Most chunks taken from quinn in one read.
const READ_CHUNKS: usize = 32;
/// The receive buffer grows by at least this much when it runs out of room.
const READ_RESERVE: usize = 64 * 1024;
/// Incoming links handshaken but not yet taken by `accept`.
const ACCEPT_BACKLOG: usize = 16;
/// Handshakes a listener runs at once; more incoming connections are refused.
const MAX_HANDSHAKES: usize = 64;
/// How much one link's stream may have in flight, each way (flow-control window).
const STREAM_WINDOW: u32 = 8 << 20;

/// Application close code: the link was dropped (or the listener stopped).
const CODE_DONE: u32 = 0;
/// Application close code: this side received a frame the codec refuses.
const CODE_BAD_FRAME: u32 = 1;
/// Stream reset code: `close` timed out and dropped what was queued.
const CODE_ABANDONED: u32 = 2;

fn invalid(context: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, context)
}

fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

// ----- configuration -----

/// Settings of a [`QuicTransport`]. Make one with [`QuicConfig::pinned`],
/// [`QuicConfig::with_ca`] or [`QuicConfig::new`], then set fields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct QuicConfig {
    /// This node's certificate and key, presented to every peer.
    pub identity: Identity,
    /// The fingerprints of peer certificates to accept; when not empty, a peer whose
    /// leaf certificate has another fingerprint is refused. Usually the one peer's.
    pub pinned_peers: Vec<Fingerprint>,
    /// When set, a peer's certificate chain must lead to one of these CAs.
    pub peer_ca: Option<CaCertificates>,
    /// The name the dialing side checks the peer's certificate against when
    /// [`peer_ca`](Self::peer_ca) is set. `None`: the host part of the address dialed
    /// (an IP address must then be in the certificate). Without a CA the name is not
    /// checked.
    pub server_name: Option<String>,
    /// How long `connect` waits for the QUIC and TLS handshake (default 5 s).
    pub connect_timeout: Duration,
    /// How long the accepting side waits for a new connection's QUIC and TLS handshake
    /// and link setup, and the dialing side for link setup after the TLS handshake
    /// (default 5 s).
    pub handshake_timeout: Duration,
    /// A link on which nothing is heard from the peer for this long fails with
    /// [`Timeout`](vsan_core::ErrorKind::Timeout) (default 10 s). The two sides use the
    /// shorter of their idle timeouts.
    pub idle_timeout: Duration,
    /// How often a link with nothing else to send sends a keep-alive, so a live but
    /// quiet peer is not taken for dead (default 2 s; must be shorter than
    /// [`idle_timeout`](Self::idle_timeout)).
    pub keep_alive_interval: Duration,
    /// Bytes a link may queue before `send` waits for quinn to take some (default
    /// 16 MiB). A single larger message is still accepted.
    pub send_queue_limit: usize,
    /// How long `close` waits for queued messages to be sent and acknowledged before it
    /// drops them and fails with [`Timeout`](vsan_core::ErrorKind::Timeout) (default
    /// 5 s).
    pub close_timeout: Duration,
}

impl QuicConfig {
    /// Default settings with `identity` and no way yet to verify peers: set
    /// [`pinned_peers`](Self::pinned_peers) or [`peer_ca`](Self::peer_ca) (or
    /// [`QuicTransport::new`] refuses it).
    pub fn new(identity: Identity) -> QuicConfig {
        QuicConfig {
            identity,
            pinned_peers: Vec::new(),
            peer_ca: None,
            server_name: None,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            keep_alive_interval: Duration::from_secs(2),
            send_queue_limit: 16 << 20,
            close_timeout: Duration::from_secs(5),
        }
    }

    /// Default settings: present `identity`, accept peers whose certificate has one of
    /// the `peers` fingerprints.
    pub fn pinned(identity: Identity, peers: impl IntoIterator<Item = Fingerprint>) -> QuicConfig {
        let mut config = QuicConfig::new(identity);
        config.pinned_peers = peers.into_iter().collect();
        config
    }

    /// Default settings: present `identity`, accept peers whose certificate chain leads
    /// to `ca`.
    pub fn with_ca(identity: Identity, ca: CaCertificates) -> QuicConfig {
        let mut config = QuicConfig::new(identity);
        config.peer_ca = Some(ca);
        config
    }
}

/// The quinn settings of one side (`server`: the side that accepts the stream).
fn transport_config(config: &QuicConfig, server: bool) -> Result<quinn::TransportConfig> {
    let idle = quinn::IdleTimeout::try_from(config.idle_timeout).map_err(|_| {
        invalid(format!(
            "quic: idle timeout {:?} too large",
            config.idle_timeout
        ))
    })?;
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(config.keep_alive_interval))
        .max_concurrent_bidi_streams(VarInt::from_u32(u32::from(server)))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .stream_receive_window(VarInt::from_u32(STREAM_WINDOW))
        .receive_window(VarInt::from_u32(STREAM_WINDOW))
        .send_window(u64::from(STREAM_WINDOW))
        .datagram_receive_buffer_size(None);
    Ok(t)
}

// ----- the transport -----

/// Replication links over QUIC with mutual TLS (see the [module docs](self)).
/// Addresses are `host:port` (`"127.0.0.1:7002"`).
#[derive(Clone)]
pub struct QuicTransport {
    inner: Arc<TransportInner>,
}

struct TransportInner {
    config: QuicConfig,
    client: quinn::ClientConfig,
    server: quinn::ServerConfig,
}

impl QuicTransport {
    /// A transport with `config`. Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) when the config gives
    /// no way to verify peers (neither pinned fingerprints nor a CA), or a timeout is
    /// zero or out of range.
    pub fn new(config: QuicConfig) -> Result<QuicTransport> {
        if config.pinned_peers.is_empty() && config.peer_ca.is_none() {
            return Err(invalid(
                "quic: no way to verify peers: set pinned_peers (the fingerprints of the \
                 peers' certificates) or peer_ca (the CA that signs them)",
            ));
        }
        for (what, value) in [
            ("connect_timeout", config.connect_timeout),
            ("handshake_timeout", config.handshake_timeout),
            ("idle_timeout", config.idle_timeout),
            ("keep_alive_interval", config.keep_alive_interval),
            ("close_timeout", config.close_timeout),
        ] {
            if value.is_zero() {
                return Err(invalid(format!("quic: {what} is zero")));
            }
        }
        if config.keep_alive_interval >= config.idle_timeout {
            return Err(invalid(format!(
                "quic: keep_alive_interval {:?} is not shorter than idle_timeout {:?}",
                config.keep_alive_interval, config.idle_timeout
            )));
        }
        if let Some(name) = &config.server_name {
            ServerName::try_from(name.as_str())
                .map_err(|_| invalid(format!("quic: server_name {name:?} is not a valid name")))?;
        }
        let provider = crypto_provider();
        let verifier = Arc::new(PeerVerifier::new(&config, &provider)?);
        let client_tls = client_tls(&config, &provider, Arc::clone(&verifier))?;
        let (chain, key) = config.identity.chain_and_key();
        let mut server_tls = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_error("TLS server settings", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| tls_error("TLS server certificate", e))?;
        server_tls.alpn_protocols = vec![ALPN.to_vec()];
        server_tls.session_storage = Arc::new(NoServerSessionStorage {});
        server_tls.send_tls13_tickets = 0;
        let quic_client = QuicClientConfig::try_from(client_tls)
            .map_err(|e| tls_error("QUIC client settings", e))?;
        let quic_server = QuicServerConfig::try_from(server_tls)
            .map_err(|e| tls_error("QUIC server settings", e))?;
        let mut client = quinn::ClientConfig::new(Arc::new(quic_client));
        client.transport_config(Arc::new(transport_config(&config, false)?));
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(quic_server));
        server
            .transport_config(Arc::new(transport_config(&config, true)?))
            .max_incoming(4 * MAX_HANDSHAKES);
        Ok(QuicTransport {
            inner: Arc::new(TransportInner {
                config,
                client,
                server,
            }),
        })
    }

    /// Its settings.
    pub fn config(&self) -> &QuicConfig {
        &self.inner.config
    }

    /// The name to ask the peer's certificate for when dialing `addr`.
    fn server_name(&self, addr: &str) -> String {
        let config = &self.inner.config;
        if config.peer_ca.is_none() {
            return PINNED_SERVER_NAME.to_string();
        }
        if let Some(name) = &config.server_name {
            return name.clone();
        }
        let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string()
    }

    async fn dial(&self, addr: &str) -> Result<Link> {
        let config = &self.inner.config;
        let what = format!("quic connect {addr}");
        let limit = config.connect_timeout;
        let deadline = tokio::time::Instant::now() + limit;
        let timed_out = || {
            Error::new(
                ErrorKind::Timeout,
                format!("{what}: no QUIC handshake with the peer within {limit:?}"),
            )
        };
        let remote = match tokio::time::timeout_at(deadline, tokio::net::lookup_host(addr)).await {
            Ok(Ok(mut addrs)) => addrs.next().ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    format!("{what}: resolves to no address"),
                )
            })?,
            Ok(Err(e)) => return Err(Error::io(format!("{what}: resolve"), e)),
            Err(_) => return Err(timed_out()),
        };
        let bind: SocketAddr = if remote.is_ipv6() {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        } else {
            (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
        };
        let endpoint = Endpoint::client(bind)
            .map_err(|e| Error::io(format!("{what}: bind a UDP socket"), e))?;
        let server_name = self.server_name(addr);
        let connecting = endpoint
            .connect_with(self.inner.client.clone(), remote, &server_name)
            .map_err(|e| invalid(format!("{what}: {e}")))?;
        let conn = match tokio::time::timeout_at(deadline, connecting).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(connection_error(&e, &what)),
            Err(_) => return Err(timed_out()),
        };
        let peer = format!("quic:{remote}");
        let limit = config.handshake_timeout;
        let setup = async {
            let (mut send, mut recv) = conn
                .open_bi()
                .await
                .map_err(|e| connection_error(&e, &what))?;
            send.write_all(&PREAMBLE_DIAL)
                .await
                .map_err(|e| write_error(&e, &what))?;
            let mut got = [0u8; PREAMBLE_ACCEPT.len()];
            recv.read_exact(&mut got)
                .await
                .map_err(|e| read_exact_error(&e, &what))?;
            if got != PREAMBLE_ACCEPT {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("{what}: the peer does not speak the vsan QUIC link protocol"),
                ));
            }
            Ok((send, recv))
        };
        match tokio::time::timeout(limit, setup).await {
            Ok(Ok((send, recv))) => Ok(make_link(conn, send, recv, Some(endpoint), peer, config)),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                format!("{what}: the peer did not set up the link within {limit:?}"),
            )),
        }
    }
}

impl fmt::Debug for QuicTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuicTransport")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Transport for QuicTransport {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn connect<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Link> {
        Box::pin(self.dial(addr))
    }

    fn listen<'a>(&'a self, addr: &'a str) -> IoFuture<'a, Box<dyn Listener>> {
        Box::pin(async move {
            let what = format!("quic listen {addr}");
            let bind = tokio::net::lookup_host(addr)
                .await
                .map_err(|e| Error::io(format!("{what}: resolve"), e))?
                .next()
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::NotFound,
                        format!("{what}: resolves to no address"),
                    )
                })?;
            let endpoint = Endpoint::server(self.inner.server.clone(), bind)
                .map_err(|e| Error::io(what.clone(), e))?;
            let local = endpoint
                .local_addr()
                .map_err(|e| Error::io(what.clone(), e))?;
            // Plain TCP on the same port number gets a clear refusal instead of a bare
            // "connection refused" (a peer configured for tcp dialing a quic node).
            let plaintext = match tokio::net::TcpListener::bind(local).await {
                Ok(l) => Some(tokio::spawn(refuse_plaintext(l, local))),
                Err(e) => {
                    tracing::debug!(%local, "no plaintext refusal listener: {e}");
                    None
                }
            };
            let (incoming_tx, incoming) =
                AcceptQueue::new(format!("quic listener {local}"), ACCEPT_BACKLOG);
            let task = tokio::spawn(accept_loop(
                endpoint.clone(),
                Arc::clone(&self.inner),
                incoming_tx,
            ));
            Ok(Box::new(QuicListener {
                local: local.to_string(),
                endpoint,
                incoming,
                task,
                plaintext,
            }) as Box<dyn Listener>)
        })
    }
}

// ----- accepting -----

async fn accept_loop(
    endpoint: Endpoint,
    transport: Arc<TransportInner>,
    incoming: mpsc::Sender<Result<Link>>,
) {
    // Handshakes run beside the loop, so a slow or silent client cannot hold up the
    // next; they end with the loop when the listener is dropped.
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            accepted = endpoint.accept() => match accepted {
                Some(connection) => {
                    if handshakes.len() >= MAX_HANDSHAKES {
                        connection.refuse();
                        continue;
                    }
                    let incoming = incoming.clone();
                    let transport = Arc::clone(&transport);
                    handshakes.spawn(async move {
                        let link = accept_one(connection, &transport.config).await;
                        // The listener may be gone; the link then just closes.
                        let _ = incoming.send(link).await;
                    });
                }
                None => return,
            },
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            () = incoming.closed() => return,
        }
    }
}

/// The handshake of one incoming connection, then the link's stream.
async fn accept_one(incoming: Incoming, config: &QuicConfig) -> Result<Link> {
    let remote = incoming.remote_address();
    let what = format!("quic accept from {remote}");
    let limit = config.handshake_timeout;
    let work = async {
        let connecting = incoming.accept().map_err(|e| connection_error(&e, &what))?;
        let conn = connecting.await.map_err(|e| connection_error(&e, &what))?;
        let (mut send, mut recv) = conn
            .accept_bi()
            .await
            .map_err(|e| connection_error(&e, &what))?;
        let mut got = [0u8; PREAMBLE_DIAL.len()];
        recv.read_exact(&mut got)
            .await
            .map_err(|e| read_exact_error(&e, &what))?;
        if got != PREAMBLE_DIAL {
            conn.close(VarInt::from_u32(CODE_BAD_FRAME), b"not a vsan link");
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("{what}: the peer does not speak the vsan QUIC link protocol"),
            ));
        }
        send.write_all(&PREAMBLE_ACCEPT)
            .await
            .map_err(|e| write_error(&e, &what))?;
        let peer = format!("quic:{}", conn.remote_address());
        Ok(make_link(conn, send, recv, None, peer, config))
    };
    match tokio::time::timeout(limit, work).await {
        Ok(result) => result,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!("{what}: handshake not done within {limit:?}"),
        )),
    }
}

/// The listening side of a [`QuicTransport`].
struct QuicListener {
    local: String,
    endpoint: Endpoint,
    incoming: AcceptQueue,
    task: JoinHandle<()>,
    /// Refuses plain TCP clients on the same port number.
    plaintext: Option<JoinHandle<()>>,
}

impl fmt::Debug for QuicListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuicListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Listener for QuicListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(self.incoming.next())
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

impl Drop for QuicListener {
    fn drop(&mut self) {
        // New connections are refused; links already accepted keep the socket (and
        // the endpoint's driver) until they end.
        self.endpoint.set_server_config(None);
        self.task.abort();
        if let Some(t) = &self.plaintext {
            t.abort();
        }
    }
}

/// Why a plain TCP client on a QUIC port is refused, as it is told.
const PLAINTEXT_REFUSAL: &str = "this replication port speaks QUIC with mutual TLS; a plain \
     TCP link is refused (set transport = \"quic\" and pin this node's certificate)";

/// Answers every TCP connection on the QUIC port's number with a `Refuse` frame (a
/// vsan TCP peer reports its reason) and closes it; each is logged.
async fn refuse_plaintext(listener: tokio::net::TcpListener, local: SocketAddr) {
    use tokio::io::AsyncWriteExt;
    let refusal = wire::encode(&Message::Refuse {
        reason: PLAINTEXT_REFUSAL.to_string(),
    })
    .map(|f| {
        let mut out = BytesMut::with_capacity(f.len());
        let (head, data) = f.into_parts();
        out.extend_from_slice(&head);
        out.extend_from_slice(&data);
        out.freeze()
    });
    // One line per 10 s at most, however fast clients knock.
    let mut last_log: Option<tokio::time::Instant> = None;
    let mut unlogged = 0u64;
    loop {
        let Ok((mut stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        if last_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(
                %peer,
                %local,
                more = unlogged,
                "plaintext TCP client on the QUIC replication port refused: {PLAINTEXT_REFUSAL}"
            );
            last_log = Some(tokio::time::Instant::now());
            unlogged = 0;
        } else {
            unlogged += 1;
        }
        if let Ok(bytes) = &refusal {
            let bytes = bytes.clone();
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(1), stream.write_all(&bytes)).await;
                let _ = stream.shutdown().await;
            });
        }
    }
}
