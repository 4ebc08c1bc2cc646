//! Replication transports from a `[[peer]]` section: tcp (with an optional shared
//! secret), loopback (in-process or shared memory), quic (mutual TLS) and rdma (falling
//! back to tcp), each with optional lanes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use vsan_replica::transport::lanes::LanesTransport;
use vsan_replica::transport::loopback::{LoopbackConfig, LoopbackTransport};
use vsan_replica::transport::quic::{
    CaCertificates, Fingerprint, Identity, QuicConfig, QuicTransport,
};
use vsan_replica::transport::rdma::{RdmaConfig, RdmaTransport};
use vsan_replica::transport::{SharedSecret, TcpConfig, TcpTransport, Transport};

use vsan_core::{Error, ErrorKind, Result};

use super::config::{PeerSection, TransportKind};

/// The transports for one peer.
#[derive(Debug, Clone)]
pub struct PeerTransport {
    /// For dialing the peer: with its lanes.
    pub dial: Arc<dyn Transport>,
    /// For listening for the peer: accepts a single link or a lane group of any size.
    pub listen: Arc<dyn Transport>,
    /// Lines for the log when the node starts (security warnings, identities).
    pub notes: Vec<Note>,
}

/// Something the node should log about a peer's transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    /// A loud warning (an unauthenticated link).
    Warn(String),
    /// Information (this node's certificate fingerprint).
    Info(String),
}

/// Builds the transports of `[[peer]]` number `index` for node `node_id`; an error's
/// context names the key (``key `peer[0].peer_fingerprint`: ...``), its kind is the
/// cause's ([`ErrorKind::InvalidArgument`] for a setting that cannot work).
pub fn build(
    peer: &PeerSection,
    index: usize,
    node_id: u32,
    data_dir: &Path,
) -> Result<PeerTransport> {
    let key = |k: &str| format!("key `peer[{index}].{k}`");
    let mut notes = Vec::new();
    let inner: Arc<dyn Transport> = match peer.transport {
        TransportKind::Tcp | TransportKind::Rdma => {
            let secret = secret_of(peer)
                .map_err(|e| Error::new(e.kind(), format!("{}: {}", key("secret"), e.context())))?;
            if secret.is_none() {
                notes.push(Note::Warn(format!(
                    "the replication link with peer {} is UNAUTHENTICATED ({} without a \
                     secret): anything that reaches {} can pose as a node; set \
                     peer[{index}].secret or secret_file on both nodes",
                    peer.id, peer.transport, peer.address
                )));
            }
            let mut tcp = TcpConfig::default();
            tcp.secret = secret;
            if peer.transport == TransportKind::Tcp {
                Arc::new(TcpTransport::with_config(tcp))
            } else {
                let mut cfg = RdmaConfig::default();
                cfg.tcp = tcp;
                Arc::new(RdmaTransport::with_config(cfg))
            }
        }
        TransportKind::Loopback => {
            let mut cfg = LoopbackConfig::default();
            cfg.busy_poll = peer
                .busy_poll_us
                .filter(|&us| us > 0)
                .map(Duration::from_micros);
            Arc::new(LoopbackTransport::with_config(cfg))
        }
        TransportKind::Quic => {
            let cert = peer
                .cert
                .clone()
                .unwrap_or_else(|| data_dir.join(format!("node-{node_id}.crt")));
            let private = peer
                .key
                .clone()
                .unwrap_or_else(|| data_dir.join(format!("node-{node_id}.key")));
            let identity =
                Identity::load_or_generate(&cert, &private, &format!("vsan-node-{node_id}"))
                    .map_err(|e| Error::new(e.kind(), format!("{}: {e}", key("cert"))))?;
            let me = identity.fingerprint();
            notes.push(Note::Info(format!(
                "quic identity for peer {}: {} (certificate {}); pin it on the peer as \
                 peer_fingerprint",
                peer.id,
                me,
                cert.display()
            )));
            let mut cfg = match (&peer.peer_fingerprint, &peer.peer_ca) {
                (Some(f), _) => {
                    let f: Fingerprint = f.parse().map_err(|e: Error| {
                        Error::new(e.kind(), format!("{}: {e}", key("peer_fingerprint")))
                    })?;
                    QuicConfig::pinned(identity, [f])
                }
                (None, Some(ca)) => {
                    let ca = CaCertificates::from_pem_file(ca)
                        .map_err(|e| Error::new(e.kind(), format!("{}: {e}", key("peer_ca"))))?;
                    QuicConfig::with_ca(identity, ca)
                }
                (None, None) => {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "{}: quic needs the peer's certificate pinned (peer_fingerprint) or a \
                         CA (peer_ca); this node's certificate {} is {me}: pin it on the peer",
                            key("peer_fingerprint"),
                            cert.display()
                        ),
                    ));
                }
            };
            if let Some(ca) = &peer.peer_ca
                && peer.peer_fingerprint.is_some()
            {
                cfg.peer_ca = Some(
                    CaCertificates::from_pem_file(ca)
                        .map_err(|e| Error::new(e.kind(), format!("{}: {e}", key("peer_ca"))))?,
                );
            }
            Arc::new(
                QuicTransport::new(cfg)
                    .map_err(|e| Error::new(e.kind(), format!("{}: {e}", key("transport"))))?,
            )
        }
    };
    let lanes = peer.lanes.unwrap_or(1);
    let dial: Arc<dyn Transport> = if lanes > 1 {
        Arc::new(
            LanesTransport::new(Arc::clone(&inner), lanes)
                .map_err(|e| Error::new(e.kind(), format!("{}: {e}", key("lanes"))))?,
        )
    } else {
        Arc::clone(&inner)
    };
    let listen: Arc<dyn Transport> = Arc::new(
        LanesTransport::new(inner, 1)
            .map_err(|e| Error::new(e.kind(), format!("{}: {e}", key("lanes"))))?,
    );
    Ok(PeerTransport {
        dial,
        listen,
        notes,
    })
}

fn secret_of(peer: &PeerSection) -> Result<Option<SharedSecret>> {
    let bytes = match (&peer.secret, &peer.secret_file) {
        (Some(s), _) => s.as_bytes().to_vec(),
        (None, Some(path)) => {
            let mut b = std::fs::read(path).map_err(|e| {
                Error::new(
                    ErrorKind::from_io(&e),
                    format!("cannot read secret_file {}: {e}", path.display()),
                )
            })?;
            while b.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
                b.pop();
            }
            b
        }
        (None, None) => return Ok(None),
    };
    SharedSecret::new(bytes)
        .map(Some)
        .map_err(|e| Error::new(e.kind(), e.to_string()))
}

/// Whether two peers' transports can share one listener (same kind and settings).
pub fn same_listener(a: &PeerSection, b: &PeerSection) -> bool {
    a.transport == b.transport
        && a.secret == b.secret
        && a.secret_file == b.secret_file
        && a.cert == b.cert
        && a.key == b.key
        && a.peer_fingerprint == b.peer_fingerprint
        && a.peer_ca == b.peer_ca
        && a.busy_poll_us == b.busy_poll_us
}
