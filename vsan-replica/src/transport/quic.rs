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
//! [`queue_depth`](LinkTx::queue_depth) until quinn has taken them, and `send` waits
//! while it is above [`QuicConfig::send_queue_limit`]. Frames of one
//! [`send_batch`](LinkTx::send_batch) are queued together, so nothing comes between them.
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

use std::fmt;
use std::fs;
use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{
    Connection, ConnectionError, Endpoint, Incoming, ReadError, ReadExactError, RecvStream,
    SendStream, StoppedError, VarInt, WriteError,
};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{NoServerSessionStorage, WebPkiClientVerifier};
use rustls::{
    AlertDescription, CertificateError, DigitallySignedStruct, DistinguishedName, OtherError,
    RootCertStore, SignatureScheme,
};
use sha2::{Digest, Sha256};
use tokio::sync::{Notify, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::accept::AcceptQueue;
use super::stream_tx::{StreamSink, StreamTx};
use super::{Link, LinkRx, Listener, Transport, remember};
use crate::wire;
use crate::wire::Message;

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

// ----- fingerprints -----

/// The SHA-256 hash of a certificate's DER bytes, to pin a peer's certificate.
///
/// Prints as `sha256:` and 64 lowercase hex digits. Parses from that form, and also from
/// the hex digits alone or as 32 colon-separated pairs (`AB:CD:…`, as `openssl x509
/// -fingerprint -sha256` prints them), in any case, with or without the `sha256:`
/// prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a certificate given as DER bytes.
    pub fn of_certificate(der: &[u8]) -> Fingerprint {
        Fingerprint(Sha256::digest(der).into())
    }

    /// A fingerprint from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// Its 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl FromStr for Fingerprint {
    type Err = Error;

    /// Fails with [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument), saying
    /// what is wrong, for anything but the forms in the [type docs](Fingerprint).
    fn from_str(text: &str) -> Result<Fingerprint> {
        let bad = |why: String| {
            invalid(format!(
                "certificate fingerprint {text:?}: {why}; expected \"sha256:\" and 64 hex \
                 digits (the SHA-256 of the certificate's DER bytes), optionally as 32 \
                 colon-separated pairs"
            ))
        };
        let s = text.trim();
        let hex = match s.get(..7) {
            Some(prefix) if prefix.eq_ignore_ascii_case("sha256:") => &s[7..],
            _ => s,
        };
        let digits: Vec<u8> = if hex.contains(':') {
            let pairs: Vec<&str> = hex.split(':').collect();
            if pairs.len() != 32 || pairs.iter().any(|p| p.len() != 2) {
                return Err(bad(
                    "with colons, it must be 32 pairs of hex digits".to_string()
                ));
            }
            pairs.concat().into_bytes()
        } else {
            hex.as_bytes().to_vec()
        };
        if let Some(c) = hex.chars().find(|c| !c.is_ascii_hexdigit() && *c != ':') {
            return Err(bad(format!("{c:?} is not a hex digit")));
        }
        if digits.len() != 64 {
            return Err(bad(format!("{} hex digits", digits.len())));
        }
        let mut bytes = [0u8; 32];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (nibble(pair[0]) << 4) | nibble(pair[1]);
        }
        Ok(Fingerprint(bytes))
    }
}

/// The value of one ASCII hex digit (already checked to be one).
fn nibble(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => 0,
    }
}

// ----- identities -----

/// This node's certificate chain and private key. Cheap to clone; the key never
/// appears in `Debug` output.
#[derive(Clone)]
pub struct Identity(Arc<IdentityInner>);

struct IdentityInner {
    /// Leaf first.
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    fingerprint: Fingerprint,
}

impl Identity {
    /// An identity from a PEM certificate chain (leaf first, then any intermediates) and
    /// a PEM private key (PKCS#8, PKCS#1 or SEC1). Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) when either does not
    /// parse, or the key is not the certificate's.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Identity> {
        let chain = parse_certificates(cert_pem).map_err(|e| e.context_prefix("certificate"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| {
            Error::with_source(
                ErrorKind::InvalidArgument,
                "private key: no PEM private key (PKCS#8, PKCS#1 or SEC1) found",
                e,
            )
        })?;
        Identity::new(chain, key)
    }

    /// An identity from DER: the certificate chain (leaf first) and a private key
    /// (PKCS#8, PKCS#1 or SEC1). Fails like [`from_pem`](Identity::from_pem).
    pub fn from_der(chain: Vec<Vec<u8>>, key: Vec<u8>) -> Result<Identity> {
        let chain = chain.into_iter().map(CertificateDer::from).collect();
        let key = PrivateKeyDer::try_from(key)
            .map_err(|e| invalid(format!("private key: not a DER private key: {e}")))?;
        Identity::new(chain, key)
    }

    /// An identity from a PEM certificate file and a PEM key file (see
    /// [`from_pem`](Identity::from_pem)).
    pub fn from_pem_files(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<Identity> {
        let (cert_path, key_path) = (cert_path.as_ref(), key_path.as_ref());
        let cert = fs::read(cert_path)
            .map_err(|e| Error::io(format!("read certificate {}", cert_path.display()), e))?;
        let key = fs::read(key_path)
            .map_err(|e| Error::io(format!("read private key {}", key_path.display()), e))?;
        Identity::from_pem(&cert, &key).map_err(|e| {
            e.context_prefix(format!(
                "identity from {} and {}",
                cert_path.display(),
                key_path.display()
            ))
        })
    }

    /// A fresh self-signed identity (ECDSA P-256) for `name`, which becomes the
    /// certificate's common name and subject alternative name (a DNS name, or an IP
    /// address when it parses as one). Peers pin its [`fingerprint`](Identity::fingerprint).
    pub fn generate(name: &str) -> Result<Identity> {
        let (cert, key) = generate_pem(name)?;
        Identity::from_pem(cert.as_bytes(), key.as_bytes())
    }

    /// Loads the identity from `cert_path` and `key_path` when both exist; when neither
    /// does, generates one (see [`generate`](Identity::generate)) and writes both files
    /// first (each through a temporary file and a rename, so a crash leaves no half
    /// file; the key file with mode 0600), creating their directories. So a node keeps
    /// one identity, and one fingerprint, across restarts. When only one of the files
    /// exists this fails with [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument)
    /// rather than replace half an identity.
    pub fn load_or_generate(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
        name: &str,
    ) -> Result<Identity> {
        let (cert_path, key_path) = (cert_path.as_ref(), key_path.as_ref());
        if cert_path == key_path {
            return Err(invalid(format!(
                "identity: certificate and private key must be two files, both are {}",
                cert_path.display()
            )));
        }
        let exists = |p: &Path| {
            p.try_exists()
                .map_err(|e| Error::io(format!("look for {}", p.display()), e))
        };
        match (exists(cert_path)?, exists(key_path)?) {
            (true, true) => Identity::from_pem_files(cert_path, key_path),
            (false, false) => {
                let (cert, key) = generate_pem(name)?;
                let identity = Identity::from_pem(cert.as_bytes(), key.as_bytes())?;
                write_atomically(key_path, key.as_bytes(), 0o600)?;
                if let Err(e) = write_atomically(cert_path, cert.as_bytes(), 0o644) {
                    // Leave no half identity behind: the next start generates afresh.
                    let _ = fs::remove_file(key_path);
                    return Err(e);
                }
                Ok(identity)
            }
            (true, false) => Err(invalid(format!(
                "identity: certificate {} exists but private key {} does not; restore the \
                 key, or remove the certificate to generate a new identity (its \
                 fingerprint changes, so peers must pin the new one)",
                cert_path.display(),
                key_path.display()
            ))),
            (false, true) => Err(invalid(format!(
                "identity: private key {} exists but certificate {} does not; restore the \
                 certificate, or remove the key to generate a new identity (its \
                 fingerprint changes, so peers must pin the new one)",
                key_path.display(),
                cert_path.display()
            ))),
        }
    }

    /// The fingerprint of this identity's leaf certificate, for peers to pin.
    pub fn fingerprint(&self) -> Fingerprint {
        self.0.fingerprint
    }

    /// The leaf certificate, DER.
    pub fn certificate_der(&self) -> &[u8] {
        &self.0.chain[0]
    }

    fn new(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<Identity> {
        let Some(leaf) = chain.first() else {
            return Err(invalid("certificate: no certificate"));
        };
        let fingerprint = Fingerprint::of_certificate(leaf);
        rustls::sign::CertifiedKey::from_der(chain.clone(), key.clone_key(), &crypto_provider())
            .map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidArgument,
                    format!("identity {fingerprint}: unusable certificate or private key"),
                    e,
                )
            })?;
        Ok(Identity(Arc::new(IdentityInner {
            chain,
            key,
            fingerprint,
        })))
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &format_args!("{}", self.0.fingerprint))
            .field("chain_len", &self.0.chain.len())
            .field("key", &format_args!("<redacted>"))
            .finish()
    }
}

/// Every certificate in `pem`; at least one.
fn parse_certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::with_source(ErrorKind::InvalidArgument, "bad PEM", e))?;
    if certs.is_empty() {
        return Err(invalid("no PEM CERTIFICATE section found"));
    }
    Ok(certs)
}

/// A self-signed certificate and its key, PEM.
fn generate_pem(name: &str) -> Result<(String, String)> {
    if name.is_empty() {
        return Err(invalid("generate identity: empty name"));
    }
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()])
        .map_err(|e| invalid(format!("generate identity: name {name:?}: {e}")))?;
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, name);
    params.distinguished_name = dn;
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = rcgen::KeyPair::generate().map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("generate identity {name:?}: key generation failed: {e}"),
        )
    })?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| invalid(format!("generate identity {name:?}: {e}")))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes `contents` to `path` through a temporary file in the same directory (created
/// with `mode` on Unix) and a rename, so `path` never holds part of it.
fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let ctx = || format!("write {}", path.display());
    let Some(file_name) = path.file_name() else {
        return Err(invalid(format!("{}: not a file name", ctx())));
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).map_err(|e| Error::io(ctx(), e))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    // A stale temporary file from a crashed start would keep its old mode.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(Error::io(ctx(), e)),
        _ => {}
    }
    let written = (|| -> io::Result<()> {
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, mode);
        #[cfg(not(unix))]
        let _ = mode;
        let mut file = opts.open(&tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        // The rename is durable once the directory is.
        #[cfg(unix)]
        fs::File::open(dir)?.sync_all()?;
        Ok(())
    })();
    written.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io(ctx(), e)
    })
}

// ----- CA certificates -----

/// One or more CA certificates a peer's certificate chain must lead to (see
/// [`QuicConfig::peer_ca`]).
#[derive(Clone)]
pub struct CaCertificates {
    certs: Vec<CertificateDer<'static>>,
}

impl CaCertificates {
    /// The CA certificates in `pem` (one or more `CERTIFICATE` sections). Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) when there is none,
    /// or one is not a usable trust anchor.
    pub fn from_pem(pem: &[u8]) -> Result<CaCertificates> {
        let certs = parse_certificates(pem).map_err(|e| e.context_prefix("CA certificate"))?;
        let ca = CaCertificates { certs };
        ca.root_store()?;
        Ok(ca)
    }

    /// The CA certificates in the PEM file at `path` (see
    /// [`from_pem`](CaCertificates::from_pem)).
    pub fn from_pem_file(path: impl AsRef<Path>) -> Result<CaCertificates> {
        let path = path.as_ref();
        let pem = fs::read(path)
            .map_err(|e| Error::io(format!("read CA certificate {}", path.display()), e))?;
        CaCertificates::from_pem(&pem).map_err(|e| e.context_prefix(path.display()))
    }

    /// The fingerprints of the CA certificates, for logs.
    pub fn fingerprints(&self) -> Vec<Fingerprint> {
        self.certs
            .iter()
            .map(|c| Fingerprint::of_certificate(c))
            .collect()
    }

    fn root_store(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        for cert in &self.certs {
            roots.add(cert.clone()).map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidArgument,
                    format!(
                        "CA certificate {}: not a usable trust anchor",
                        Fingerprint::of_certificate(cert)
                    ),
                    e,
                )
            })?;
        }
        Ok(Arc::new(roots))
    }
}

impl fmt::Debug for CaCertificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fps: Vec<String> = self.fingerprints().iter().map(|f| f.to_string()).collect();
        f.debug_tuple("CaCertificates").field(&fps).finish()
    }
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

// ----- verification -----

/// Checks a peer's certificate, as server or as client: the CA chain when configured,
/// then the pinned fingerprints when configured; and the handshake signatures.
#[derive(Debug)]
struct PeerVerifier {
    pinned: Vec<Fingerprint>,
    server_ca: Option<Arc<WebPkiServerVerifier>>,
    client_ca: Option<Arc<dyn ClientCertVerifier>>,
    algorithms: WebPkiSupportedAlgorithms,
}

/// A certificate whose fingerprint is not pinned.
struct NotPinned {
    got: Fingerprint,
    pinned: Vec<Fingerprint>,
}

// rustls shows a `CertificateError::Other` with `Debug`: make that the message.
impl fmt::Debug for NotPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for NotPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer certificate {} is not ", self.got)?;
        match self.pinned.as_slice() {
            [one] => write!(f, "the pinned {one}"),
            many => {
                f.write_str("one of the pinned ")?;
                for (i, fp) in many.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{fp}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for NotPinned {}

impl PeerVerifier {
    fn new(config: &QuicConfig, provider: &Arc<CryptoProvider>) -> Result<PeerVerifier> {
        let (server_ca, client_ca) = match &config.peer_ca {
            None => (None, None),
            Some(ca) => {
                let roots = ca.root_store()?;
                let server = WebPkiServerVerifier::builder_with_provider(
                    Arc::clone(&roots),
                    Arc::clone(provider),
                )
                .build()
                .map_err(|e| Error::with_source(ErrorKind::InvalidArgument, "quic: peer CA", e))?;
                let client =
                    WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(provider))
                        .build()
                        .map_err(|e| {
                            Error::with_source(ErrorKind::InvalidArgument, "quic: peer CA", e)
                        })?;
                (Some(server), Some(client))
            }
        };
        Ok(PeerVerifier {
            pinned: config.pinned_peers.clone(),
            server_ca,
            client_ca,
            algorithms: provider.signature_verification_algorithms,
        })
    }

    fn check_pin(&self, end_entity: &CertificateDer<'_>) -> std::result::Result<(), rustls::Error> {
        if self.pinned.is_empty() {
            return Ok(());
        }
        let got = Fingerprint::of_certificate(end_entity);
        if self.pinned.contains(&got) {
            return Ok(());
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            OtherError(Arc::new(NotPinned {
                got,
                pinned: self.pinned.clone(),
            })),
        )))
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if let Some(ca) = &self.server_ca {
            ca.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        }
        self.check_pin(end_entity)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

impl ClientCertVerifier for PeerVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        match &self.client_ca {
            Some(ca) => ca.root_hint_subjects(),
            None => &[],
        }
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        if let Some(ca) = &self.client_ca {
            ca.verify_client_cert(end_entity, intermediates, now)?;
        }
        self.check_pin(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

fn tls_error(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::with_source(ErrorKind::InvalidArgument, format!("quic: {what}"), e)
}

/// The rustls client settings (TLS 1.3, ALPN, client certificate, no resumption).
fn client_tls(
    config: &QuicConfig,
    provider: &Arc<CryptoProvider>,
    verifier: Arc<PeerVerifier>,
) -> Result<rustls::ClientConfig> {
    let id = &config.identity.0;
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::clone(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error("TLS client settings", e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| tls_error("TLS client certificate", e))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // Every link proves its certificates afresh.
    tls.resumption = rustls::client::Resumption::disabled();
    Ok(tls)
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
        let id = &config.identity.0;
        let mut server_tls = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| tls_error("TLS server settings", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(id.chain.clone(), id.key.clone_key())
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

// ----- errors -----

/// Text the peer sent (a close reason), safe to put in a message.
fn peer_text(reason: &[u8]) -> String {
    const MAX: usize = 400;
    let text = String::from_utf8_lossy(reason);
    let mut out: String = text
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().count() > MAX {
        out.push('…');
    }
    out
}

/// A TLS failure as rustls words it (this side's, or the peer's in its close reason),
/// without the wrapping rustls puts around a verifier's own message, and with a hint
/// for the common CA failure.
fn tidy_tls_reason(reason: &str) -> String {
    const WRAP: &str = "Other(OtherError(";
    let mut text = match reason.find(WRAP) {
        Some(at) if reason.ends_with("))") => {
            format!(
                "{}{}",
                &reason[..at],
                &reason[at + WRAP.len()..reason.len() - 2]
            )
        }
        _ => reason.to_string(),
    };
    if text.ends_with("UnknownIssuer") {
        text.push_str(" (the certificate is not signed by a CA the checking side trusts)");
    }
    text
}

/// The TLS alert in a QUIC crypto error code (0x100..0x1ff).
fn tls_alert(code: u64) -> Option<u8> {
    (0x100..0x200)
        .contains(&code)
        .then_some((code & 0xff) as u8)
}

/// Whether a TLS alert says the sender did not accept the certificate it was shown.
fn refuses_certificate(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::CertificateRequired
            | AlertDescription::DecryptError
    )
}

/// A connection's end, as the link's error; `what` says what was being done.
fn connection_error(e: &ConnectionError, what: &str) -> Error {
    match e {
        ConnectionError::VersionMismatch => Error::new(
            ErrorKind::Protocol,
            format!("{what}: the peer speaks no QUIC version this node does"),
        ),
        ConnectionError::TransportError(te) => match tls_alert(u64::from(te.code)) {
            Some(_) => Error::new(
                ErrorKind::Protocol,
                format!(
                    "{what}: TLS handshake failed: {}",
                    tidy_tls_reason(&te.reason)
                ),
            ),
            None => Error::new(
                ErrorKind::Protocol,
                format!("{what}: the peer broke the QUIC protocol: {te}"),
            ),
        },
        ConnectionError::ConnectionClosed(close) => {
            let said = if close.reason.is_empty() {
                String::new()
            } else {
                format!(
                    "; the peer says: {}",
                    tidy_tls_reason(&peer_text(&close.reason))
                )
            };
            match tls_alert(u64::from(close.error_code)) {
                Some(alert) => {
                    let alert = AlertDescription::from(alert);
                    let text = if refuses_certificate(alert) {
                        "the peer refused this node's certificate"
                    } else {
                        "the peer refused the TLS handshake"
                    };
                    Error::new(
                        ErrorKind::Protocol,
                        format!("{what}: {text} (TLS alert {alert:?}){said}"),
                    )
                }
                None => Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "{what}: the peer's QUIC stack closed the connection: {}{said}",
                        close.error_code
                    ),
                ),
            }
        }
        ConnectionError::ApplicationClosed(close) => {
            let code = close.error_code.into_inner();
            if code == u64::from(CODE_BAD_FRAME) {
                Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "{what}: the peer closed the link: it received bytes it refuses ({})",
                        peer_text(&close.reason)
                    ),
                )
            } else if code == u64::from(CODE_DONE) {
                Error::new(ErrorKind::Closed, format!("{what}: peer closed the link"))
            } else {
                Error::new(
                    ErrorKind::Closed,
                    format!(
                        "{what}: peer closed the link (code {code}: {})",
                        peer_text(&close.reason)
                    ),
                )
            }
        }
        ConnectionError::Reset => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer reset the connection (it restarted or dropped it)"),
        ),
        ConnectionError::TimedOut => Error::new(
            ErrorKind::Timeout,
            format!("{what}: nothing heard from the peer within the idle timeout"),
        ),
        ConnectionError::LocallyClosed => Error::new(
            ErrorKind::Closed,
            format!("{what}: link closed by this side"),
        ),
        ConnectionError::CidsExhausted => Error::new(
            ErrorKind::Io,
            format!("{what}: no QUIC connection ids left"),
        ),
    }
}

fn write_error(e: &WriteError, what: &str) -> Error {
    match e {
        WriteError::ConnectionLost(e) => connection_error(e, what),
        WriteError::Stopped(code) => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer stopped reading the link (code {code})"),
        ),
        WriteError::ClosedStream => Error::new(
            ErrorKind::Closed,
            format!("{what}: the link's stream is closed"),
        ),
        WriteError::ZeroRttRejected => {
            Error::new(ErrorKind::Protocol, format!("{what}: early data rejected"))
        }
    }
}

fn read_error(e: &ReadError, what: &str) -> Error {
    match e {
        ReadError::ConnectionLost(e) => connection_error(e, what),
        ReadError::Reset(code) if code.into_inner() == u64::from(CODE_ABANDONED) => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer gave up sending (its close timed out)"),
        ),
        ReadError::Reset(code) => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer abandoned the link (stream reset, code {code})"),
        ),
        ReadError::ClosedStream => Error::new(
            ErrorKind::Closed,
            format!("{what}: the link's stream is closed"),
        ),
        ReadError::IllegalOrderedRead | ReadError::ZeroRttRejected => {
            Error::new(ErrorKind::Protocol, format!("{what}: {e}"))
        }
    }
}

fn read_exact_error(e: &ReadExactError, what: &str) -> Error {
    match e {
        ReadExactError::ReadError(e) => read_error(e, what),
        ReadExactError::FinishedEarly(_) => Error::new(
            ErrorKind::Protocol,
            format!("{what}: the peer ended the stream during link setup"),
        ),
    }
}

// ----- links -----

/// What both halves of a link share: the connection, and the first fatal error.
#[derive(Debug)]
struct LinkShared {
    conn: Connection,
    /// The dialer's own UDP endpoint, kept as long as the link.
    _endpoint: Option<Endpoint>,
    /// Set when the receive half found the peer untrustworthy; both halves report it.
    fatal: Mutex<Option<(ErrorKind, String)>>,
}

impl LinkShared {
    /// The error that ends the whole link, if it has ended.
    fn ended(&self, what: impl FnOnce() -> String) -> Option<(ErrorKind, String)> {
        if let Some(fatal) = &*self.fatal.lock() {
            return Some(fatal.clone());
        }
        self.conn
            .close_reason()
            .map(|e| remember(&connection_error(&e, &what())))
    }
}

fn make_link(
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    endpoint: Option<Endpoint>,
    peer: String,
    config: &QuicConfig,
) -> Link {
    let link = Arc::new(LinkShared {
        conn,
        _endpoint: endpoint,
        fatal: Mutex::new(None),
    });
    let sink = QuicSink {
        link: Arc::clone(&link),
        send: Mutex::new(Some(send)),
        abandon: Notify::new(),
        peer: peer.clone(),
    };
    let tx = StreamTx::new(
        sink,
        peer.clone(),
        config.send_queue_limit,
        config.close_timeout,
    );
    let rx = QuicRx {
        link,
        recv,
        buf: BytesMut::new(),
        failed: None,
        peer,
    };
    Link::new(Box::new(tx), Box::new(rx))
}

/// The QUIC end of a link's sending half: the link's one stream.
#[derive(Debug)]
struct QuicSink {
    link: Arc<LinkShared>,
    /// The stream; the writer task takes it out while it writes.
    send: Mutex<Option<SendStream>>,
    /// Tells a writer in the middle of a write to reset the stream (`close` timed out).
    abandon: Notify,
    peer: String,
}

impl StreamSink for QuicSink {
    const TRANSPORT: &'static str = "quic";
    /// quinn's writes are async only: every frame goes through the writer task.
    const WRITES_INLINE: bool = false;
    const FAILURE_DROPS_QUEUE: bool = true;
    const CLOSE_UNDONE: &'static str = "sent and acknowledged";

    fn batch_limits(&self) -> (usize, usize) {
        (MAX_CHUNKS, MAX_BATCH_BYTES)
    }

    fn check_link(&self) -> Result<()> {
        match self.link.ended(|| format!("{}: send", self.peer)) {
            Some((kind, text)) => Err(Error::new(kind, text)),
            None => Ok(()),
        }
    }

    async fn write(&self, batch: &mut [Bytes]) -> Result<usize> {
        let taken = self.send.lock().take();
        let Some(mut send) = taken else {
            return Err(Error::new(
                ErrorKind::Closed,
                format!("{}: send: the stream is gone", self.peer),
            ));
        };
        let written = tokio::select! {
            biased;
            () = self.abandon.notified() => {
                let _ = send.reset(VarInt::from_u32(CODE_ABANDONED));
                *self.send.lock() = Some(send);
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: send: abandoned", self.peer),
                ));
            }
            written = send.write_chunks(batch) => written,
        };
        *self.send.lock() = Some(send);
        match written {
            Ok(w) => Ok(w.bytes),
            Err(e) => Err(write_error(&e, &format!("{}: send", self.peer))),
        }
    }

    fn shut(&self) -> Result<()> {
        if let Some(send) = &mut *self.send.lock() {
            // Harmless when already finished.
            let _ = send.finish();
        }
        Ok(())
    }

    /// Waits until the peer has acknowledged the whole stream.
    async fn flushed(&self) -> Result<()> {
        let stopped = match &*self.send.lock() {
            Some(send) => send.stopped(),
            None => {
                return Err(Error::new(
                    ErrorKind::Closed,
                    format!("{}: close: the stream is gone", self.peer),
                ));
            }
        };
        match stopped.await {
            Ok(None) => Ok(()),
            Ok(Some(code)) => Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "{}: close: the peer stopped reading the link before it \
                     had everything (code {code})",
                    self.peer
                ),
            )),
            // The peer dropped the link normally after this side finished; what it did
            // not read, it did not want.
            Err(StoppedError::ConnectionLost(ConnectionError::ApplicationClosed(close)))
                if close.error_code.into_inner() == u64::from(CODE_DONE) =>
            {
                Ok(())
            }
            Err(StoppedError::ConnectionLost(e)) => {
                Err(connection_error(&e, &format!("{}: close", self.peer)))
            }
            Err(e @ StoppedError::ZeroRttRejected) => Err(Error::new(
                ErrorKind::Protocol,
                format!("{}: close: {e}", self.peer),
            )),
        }
    }

    fn abandon(&self) {
        // A writer in the middle of a write holds the stream; it resets it itself.
        self.abandon.notify_one();
        if let Some(send) = &mut *self.send.lock() {
            let _ = send.reset(VarInt::from_u32(CODE_ABANDONED));
        }
    }
}

/// The receiving half of a QUIC link.
#[derive(Debug)]
struct QuicRx {
    link: Arc<LinkShared>,
    recv: RecvStream,
    /// Received bytes not yet decoded; decoded data are slices of it.
    buf: BytesMut,
    /// The first error; every later `recv` reports it.
    failed: Option<(ErrorKind, String)>,
    peer: String,
}

impl QuicRx {
    async fn next(&mut self) -> Result<Message> {
        if let Some((kind, context)) = &self.failed {
            return Err(Error::new(*kind, context.clone()));
        }
        loop {
            match wire::decode(&mut self.buf) {
                Ok(Some(msg)) => return Ok(msg),
                Ok(None) => {}
                Err(e) => {
                    let err = Error::with_source(
                        ErrorKind::Protocol,
                        format!("{}: received a bad frame", self.peer),
                        e,
                    );
                    // Never trusted again: the send half fails too, and the peer sees
                    // the connection end.
                    *self.link.fatal.lock() = Some(remember(&err));
                    self.link
                        .conn
                        .close(VarInt::from_u32(CODE_BAD_FRAME), b"received a bad frame");
                    return Err(self.fail(err));
                }
            }
            let mut chunks: [Bytes; READ_CHUNKS] = std::array::from_fn(|_| Bytes::new());
            let read = self.recv.read_chunks(&mut chunks).await;
            let err = match read {
                Ok(Some(n)) => {
                    let chunks = &chunks[..n];
                    let total: usize = chunks.iter().map(Bytes::len).sum();
                    if self.buf.capacity() - self.buf.len() < total {
                        self.buf.reserve(total.max(READ_RESERVE));
                    }
                    for c in chunks {
                        self.buf.extend_from_slice(c);
                    }
                    continue;
                }
                Ok(None) if self.buf.is_empty() => Error::new(
                    ErrorKind::Closed,
                    format!("{}: peer closed the link", self.peer),
                ),
                Ok(None) => Error::new(
                    ErrorKind::Closed,
                    format!(
                        "{}: peer closed the link in the middle of a frame ({} bytes of it received)",
                        self.peer,
                        self.buf.len()
                    ),
                ),
                Err(e) => read_error(&e, &format!("{}: receive", self.peer)),
            };
            return Err(self.fail(err));
        }
    }

    fn fail(&mut self, err: Error) -> Error {
        self.failed = Some(remember(&err));
        err
    }
}

impl LinkRx for QuicRx {
    fn recv(&mut self) -> IoFuture<'_, Message> {
        Box::pin(self.next())
    }

    fn peer(&self) -> &str {
        &self.peer
    }
}

#[cfg(test)]
mod tests {
    //! What needs a hand-driven peer: garbage and bad frames on an authenticated
    //! stream, a client without a certificate, a client that never opens the stream.

    use std::future::Future;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::wire::WritePayload;

    const WAIT: Duration = Duration::from_secs(10);

    async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
        match tokio::time::timeout(WAIT, fut).await {
            Ok(v) => v,
            Err(_) => panic!("{what}: no result within {WAIT:?}"),
        }
    }

    /// (client, server) transports that pin each other.
    fn pinned_pair(server_config: impl FnOnce(&mut QuicConfig)) -> (QuicTransport, QuicTransport) {
        let a = Identity::generate("node1").unwrap();
        let b = Identity::generate("node2").unwrap();
        let client = QuicTransport::new(QuicConfig::pinned(a.clone(), [b.fingerprint()])).unwrap();
        let mut config = QuicConfig::pinned(b, [a.fingerprint()]);
        server_config(&mut config);
        (client, QuicTransport::new(config).unwrap())
    }

    /// A connection made with `client` settings and driven by hand, up to the TLS
    /// handshake.
    async fn raw_connection(
        client: quinn::ClientConfig,
        addr: &str,
    ) -> std::result::Result<(Endpoint, Connection), ConnectionError> {
        let remote: SocketAddr = addr.parse().unwrap();
        let endpoint = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let conn = endpoint
            .connect_with(client, remote, PINNED_SERVER_NAME)
            .unwrap()
            .await?;
        Ok((endpoint, conn))
    }

    /// A raw stream that the listener has taken as a link: (endpoint, connection,
    /// send, recv) of the raw side, and the link.
    async fn raw_peer() -> (Endpoint, Connection, SendStream, RecvStream, Link) {
        let (client, server) = pinned_pair(|_| {});
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        let raw = async {
            let (endpoint, conn) = raw_connection(client.inner.client.clone(), &addr)
                .await
                .unwrap();
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            send.write_all(&PREAMBLE_DIAL).await.unwrap();
            let mut got = [0u8; 8];
            recv.read_exact(&mut got).await.unwrap();
            assert_eq!(got, PREAMBLE_ACCEPT);
            (endpoint, conn, send, recv)
        };
        let ((endpoint, conn, send, recv), link) = within("raw connect", async {
            tokio::join!(raw, listener.accept())
        })
        .await;
        (endpoint, conn, send, recv, link.unwrap())
    }

    fn block(seed: u64) -> Bytes {
        let mut v = Vec::with_capacity(4096);
        for i in 0..512u64 {
            v.extend_from_slice(&(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).to_le_bytes());
        }
        Bytes::from(v)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn random_garbage_on_the_stream_is_a_protocol_error_and_ends_the_link() {
        let mut rng = SmallRng::seed_from_u64(1);
        for _ in 0..10 {
            let (_endpoint, conn, mut send, _recv, mut link) = raw_peer().await;
            let garbage: Vec<u8> = (0..rng.random_range(20..4096))
                .map(|_| rng.random())
                .collect();
            send.write_all(&garbage).await.unwrap();
            let err = within("recv", link.recv()).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
            assert!(err.to_string().contains("bad frame"), "{err}");
            assert_eq!(
                within("recv", link.recv()).await.unwrap_err().kind(),
                ErrorKind::Protocol
            );
            let sent = within("send", link.send(Message::Ping { id: 1 })).await;
            assert_eq!(sent.unwrap_err().kind(), ErrorKind::Protocol);
            // The peer hears why.
            let closed = within("peer sees the close", conn.closed()).await;
            let err = connection_error(&closed, "raw");
            assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frame_with_a_bad_crc_is_a_protocol_error() {
        let (_endpoint, _conn, mut send, _recv, mut link) = raw_peer().await;
        let mut good = BytesMut::new();
        wire::encode_into(&Message::Ping { id: 1 }, &mut good).unwrap();
        let mut bad = BytesMut::new();
        let write = Message::Write {
            id: 2,
            offset: 0,
            payload: WritePayload::Data(block(2)),
            fua: false,
        };
        wire::encode_into(&write, &mut bad).unwrap();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        send.write_all(&good).await.unwrap();
        send.write_all(&bad).await.unwrap();
        assert_eq!(
            within("recv", link.recv()).await.unwrap(),
            Message::Ping { id: 1 }
        );
        let err = within("recv", link.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol);
        assert!(err.to_string().contains("crc mismatch"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_ends_the_stream_mid_frame_is_an_error_not_a_hang() {
        let mut whole = BytesMut::new();
        let reply = Message::ReadReply {
            id: 1,
            status: crate::wire::Status::Ok,
            data: block(1),
        };
        wire::encode_into(&reply, &mut whole).unwrap();
        for cut in [1, wire::HEADER_LEN, wire::HEADER_LEN + 3, whole.len() - 1] {
            let (_endpoint, _conn, mut send, _recv, mut link) = raw_peer().await;
            send.write_all(&whole[..cut]).await.unwrap();
            send.finish().unwrap();
            let err = within("recv", link.recv()).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Closed, "cut at {cut}: {err}");
            assert!(err.to_string().contains("middle of a frame"), "{err}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recv_is_cancel_safe() {
        let (_endpoint, _conn, mut send, _recv, mut link) = raw_peer().await;
        let msgs: Vec<Message> = (0..40u64)
            .map(|id| match id % 3 {
                0 => Message::Ping { id },
                1 => Message::Write {
                    id,
                    offset: id * 4096,
                    payload: WritePayload::Data(block(id)),
                    fua: false,
                },
                _ => Message::Flush { id },
            })
            .collect();
        let mut stream = BytesMut::new();
        for m in &msgs {
            wire::encode_into(m, &mut stream).unwrap();
        }
        let writer = tokio::spawn(async move {
            for chunk in stream.chunks(97) {
                send.write_all(chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
            send
        });
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + WAIT;
        while got.len() < msgs.len() {
            assert!(
                std::time::Instant::now() < deadline,
                "messages did not arrive"
            );
            if let Ok(msg) = tokio::time::timeout(Duration::from_micros(50), link.recv()).await {
                got.push(msg.unwrap());
            }
        }
        assert_eq!(got, msgs);
        within("writer", writer).await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_without_a_certificate_is_refused_and_the_listener_keeps_accepting() {
        let (client, server) = pinned_pair(|_| {});
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        // The client's own checks, but no certificate to show.
        let verifier = Arc::new(PeerVerifier::new(client.config(), &crypto_provider()).unwrap());
        let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let anonymous =
            quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
        let raw = async {
            let (_endpoint, conn) = raw_connection(anonymous, &addr).await?;
            // The server's refusal comes after the client's side of the handshake.
            conn.closed().await;
            Err::<(), _>(conn.close_reason().unwrap())
        };
        let (raw, accepted) =
            within("handshake", async { tokio::join!(raw, listener.accept()) }).await;
        let client_err = connection_error(&raw.unwrap_err(), "raw client");
        assert_eq!(client_err.kind(), ErrorKind::Protocol, "{client_err}");
        assert!(
            client_err
                .to_string()
                .contains("the peer refused this node's certificate"),
            "{client_err}"
        );
        let server_err = accepted.unwrap_err();
        assert_eq!(server_err.kind(), ErrorKind::Protocol, "{server_err}");
        assert!(
            server_err.to_string().contains("no certificates"),
            "{server_err}"
        );
        // A good client still gets in.
        let (a, b) = within("good client", async {
            tokio::join!(client.connect(&addr), listener.accept())
        })
        .await;
        let (a, mut b) = (a.unwrap(), b.unwrap());
        within("send", a.send(Message::Ping { id: 7 }))
            .await
            .unwrap();
        assert_eq!(
            within("recv", b.recv()).await.unwrap(),
            Message::Ping { id: 7 }
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_offering_another_protocol_is_refused() {
        let (client, server) = pinned_pair(|_| {});
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        let verifier = Arc::new(PeerVerifier::new(client.config(), &crypto_provider()).unwrap());
        let mut tls = client_tls(client.config(), &crypto_provider(), verifier).unwrap();
        tls.alpn_protocols = vec![b"h3".to_vec()];
        let other = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
        let (raw, accepted) = within("handshake", async {
            tokio::join!(raw_connection(other, &addr), listener.accept())
        })
        .await;
        assert!(raw.is_err());
        let err = accepted.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_never_opens_the_stream_times_out_and_others_get_in() {
        let (client, server) = pinned_pair(|c| c.handshake_timeout = Duration::from_millis(300));
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        let (_endpoint, _silent) = within(
            "raw connect",
            raw_connection(client.inner.client.clone(), &addr),
        )
        .await
        .unwrap();
        // A good client is not held up by the silent one.
        let (a, b) = within("good client", async {
            tokio::join!(client.connect(&addr), listener.accept())
        })
        .await;
        let (a, mut b) = (a.unwrap(), b.unwrap());
        within("send", a.send(Message::Ping { id: 1 }))
            .await
            .unwrap();
        assert_eq!(
            within("recv", b.recv()).await.unwrap(),
            Message::Ping { id: 1 }
        );
        let err = within("accept", listener.accept()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_without_the_preamble_is_refused() {
        let (client, server) = pinned_pair(|_| {});
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        let raw = async {
            let (endpoint, conn) = raw_connection(client.inner.client.clone(), &addr)
                .await
                .unwrap();
            let (mut send, recv) = conn.open_bi().await.unwrap();
            send.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            (endpoint, conn, send, recv)
        };
        let (_raw, accepted) =
            within("handshake", async { tokio::join!(raw, listener.accept()) }).await;
        let err = accepted.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains("does not speak"), "{err}");
    }

    #[test]
    fn peer_text_is_bounded_and_escaped() {
        assert_eq!(peer_text(b"a\nb"), "a\\nb");
        assert!(peer_text(&[b'x'; 5000]).chars().count() <= 401);
        assert_eq!(peer_text(&[0xff]), "\u{fffd}");
    }
}
