//! The values of the config that are words or small grammars (`"1GiB"`, `"io-error"`,
//! `"discard-node(2)"`, `"40MiB"`, `"unix:/path"`), parsed into types when the file is
//! loaded. A value that does not parse is an error of the key it belongs to, saying the
//! value and what is accepted.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
use vsan_cache::CacheMode;
use vsan_core::{Error, ErrorKind};

/// A size in bytes, written as an integer or a string with a unit ("1GiB", "256MiB").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Text(String),
        }
        match Raw::deserialize(d) {
            Ok(Raw::Int(n)) => Ok(Size(n)),
            Ok(Raw::Text(s)) => parse_size::Config::new()
                .with_binary()
                .parse_size(s.trim())
                .map(Size)
                .map_err(|e| {
                    serde::de::Error::custom(format!(
                        "{s:?} is not a size ({e}); write e.g. \"1GiB\""
                    ))
                }),
            Err(_) => Err(serde::de::Error::custom(
                "expected a size such as \"1GiB\" or a number of bytes",
            )),
        }
    }
}

/// `node.startup`: see [`NodeSection::startup`](super::NodeSection::startup).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Startup {
    /// Serve nothing until the replica is proven current.
    #[default]
    WaitForPeer,
    /// Serve alone once the peer timeout passes without the peer.
    ServeAloneAfterTimeout,
}

/// `node.quorum`: what a node without its peer and without quorum does with I/O (see
/// [`NodeSection::quorum`](super::NodeSection::quorum)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quorum {
    /// Fail it (the default).
    IoError,
    /// Hold it until the peer or quorum returns.
    Suspend,
}

impl<'de> Deserialize<'de> for Quorum {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Quorum, D::Error> {
        let text = String::deserialize(d)?;
        match text.as_str() {
            "io-error" => Ok(Quorum::IoError),
            "suspend" => Ok(Quorum::Suspend),
            _ => Err(D::Error::custom(format!(
                "{text:?} is not one of io-error, suspend"
            ))),
        }
    }
}

/// `peer.transport`: the kind of link to a peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// TCP (the default).
    #[default]
    Tcp,
    /// Shared memory with a peer on this host (a Unix socket to meet).
    Loopback,
    /// QUIC with mutual TLS.
    Quic,
    /// RDMA, falling back to TCP.
    Rdma,
}

impl TransportKind {
    /// The config word (`tcp`, `loopback`, `quic`, `rdma`).
    pub fn word(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Loopback => "loopback",
            TransportKind::Quic => "quic",
            TransportKind::Rdma => "rdma",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.word())
    }
}

impl<'de> Deserialize<'de> for TransportKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<TransportKind, D::Error> {
        let text = String::deserialize(d)?;
        [
            TransportKind::Tcp,
            TransportKind::Loopback,
            TransportKind::Quic,
            TransportKind::Rdma,
        ]
        .into_iter()
        .find(|t| t.word() == text)
        .ok_or_else(|| {
            D::Error::custom(format!("{text:?} is not one of tcp, loopback, quic, rdma"))
        })
    }
}

/// The config word of a cache mode (`write-back`, ...).
pub fn cache_mode_word(mode: CacheMode) -> &'static str {
    match mode {
        CacheMode::WriteBack => "write-back",
        CacheMode::WriteThrough => "write-through",
        CacheMode::WriteAround => "write-around",
        CacheMode::PassThrough => "pass-through",
    }
}

/// Parse a cache mode's config word (spaces around it ignored).
pub(super) fn cache_mode<'de, D: Deserializer<'de>>(d: D) -> Result<Option<CacheMode>, D::Error> {
    let text = String::deserialize(d)?;
    let text = text.trim();
    [
        CacheMode::WriteBack,
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::PassThrough,
    ]
    .into_iter()
    .find(|m| cache_mode_word(*m) == text)
    .map(Some)
    .ok_or_else(|| {
        D::Error::custom(format!(
            "{text:?} is not one of write-back, write-through, write-around, pass-through"
        ))
    })
}

/// `disk.resync_rate` as the config gives it: "dynamic" or a rate per second
/// ("40MiB", "40MiB/s").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    /// Yield to the application.
    Dynamic,
    /// Bytes per second.
    Fixed(u64),
}

/// `disk.split_brain` as the config gives it: "refuse", "discard-zero-changes",
/// "discard-least-changes" or "discard-node(ID)".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitBrain {
    /// Refuse and report.
    Refuse,
    /// Discard a node without changes.
    DiscardZeroChanges,
    /// Discard the node with fewer changes.
    DiscardLeastChanges,
    /// Discard this node's data.
    DiscardNode(u32),
}

impl<'de> Deserialize<'de> for Rate {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Rate, D::Error> {
        let text = String::deserialize(d)?;
        let text = text.trim();
        if text == "dynamic" {
            return Ok(Rate::Dynamic);
        }
        let per = text.strip_suffix("/s").unwrap_or(text);
        parse_size::Config::new()
            .with_binary()
            .parse_size(per.trim())
            .ok()
            .filter(|n| *n > 0)
            .map(Rate::Fixed)
            .ok_or_else(|| {
                D::Error::custom(format!(
                    "{text:?} is neither \"dynamic\" nor a rate such as \"40MiB\""
                ))
            })
    }
}

impl<'de> Deserialize<'de> for SplitBrain {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<SplitBrain, D::Error> {
        let text = String::deserialize(d)?;
        let text = text.trim();
        match text {
            "refuse" => Ok(SplitBrain::Refuse),
            "discard-zero-changes" => Ok(SplitBrain::DiscardZeroChanges),
            "discard-least-changes" => Ok(SplitBrain::DiscardLeastChanges),
            _ => text
                .strip_prefix("discard-node(")
                .and_then(|r| r.strip_suffix(')'))
                .and_then(|n| n.trim().parse().ok())
                .map(SplitBrain::DiscardNode)
                .ok_or_else(|| {
                    D::Error::custom(format!(
                        "{text:?} is not one of refuse, discard-zero-changes, \
                         discard-least-changes, discard-node(ID)"
                    ))
                }),
        }
    }
}

/// An NBD listening address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum NbdAddr {
    /// TCP.
    Tcp(SocketAddr),
    /// Unix socket path.
    Unix(PathBuf),
}

impl fmt::Display for NbdAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NbdAddr::Tcp(a) => write!(f, "{a}"),
            NbdAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl NbdAddr {
    /// Parse "host:port" or "unix:/path"; anything else is
    /// [`ErrorKind::InvalidArgument`], saying what to write.
    pub fn parse(s: &str) -> vsan_core::Result<NbdAddr> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    "unix socket path is empty",
                ));
            }
            return Ok(NbdAddr::Unix(PathBuf::from(p)));
        }
        s.parse::<SocketAddr>().map(NbdAddr::Tcp).map_err(|_| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "{s:?} is not an address; write \"127.0.0.1:10809\" or \"unix:/path/to.sock\""
                ),
            )
        })
    }
}

/// A CHAP secret as the config gives it (`iscsi_chap_secret`): its bytes, never shown
/// (its `Debug` says `<redacted>`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        // The value is never echoed back in an error.
        String::deserialize(d)
            .map(|s| Secret(s.into_bytes()))
            .map_err(|_| D::Error::custom("expected a string"))
    }
}

/// The shortest CHAP secret a node accepts: RFC 7143 (section 12.1.3) has 12 bytes as
/// the least a secret should be, and shorter ones fall to an offline dictionary attack on
/// one captured exchange.
pub(crate) const MIN_CHAP_SECRET: usize = 12;
/// The longest CHAP secret (RFC 7143's limit on a CHAP secret's length, 255 bytes).
pub(crate) const MAX_CHAP_SECRET: usize = 255;

/// What is wrong with a CHAP secret of `len` bytes, if anything.
pub(super) fn chap_secret_problem(len: usize) -> Option<String> {
    (!(MIN_CHAP_SECRET..=MAX_CHAP_SECRET).contains(&len)).then(|| {
        format!(
            "the secret is {len} bytes; a CHAP secret is {MIN_CHAP_SECRET} to \
             {MAX_CHAP_SECRET} bytes (RFC 7143 recommends at least {MIN_CHAP_SECRET}: \
             shorter ones are guessed offline from one captured login)"
        )
    })
}

pub use vsan_core::export::iscsi::check_iscsi_name;
