//! The `vsan-node` configuration file (TOML), as DESIGN.md "Node configuration" gives it.
//!
//! Parsing is strict: an unknown key, a size that does not parse or does not fit the
//! block size, a duplicate disk name, or a reference to a peer that is not declared is an
//! error naming the key (`disk[0].size`) and the problem, so the operator gets one clear
//! line instead of a node that half-starts.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A configuration error: which key, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The key, as a path (`disk[0].size`); empty when the error is not about one key.
    pub key: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "key `{}`: {}", self.key, self.message)
        }
    }
}

impl std::error::Error for ConfigError {}

fn err(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}

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

/// `[node]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// This node's id.
    pub id: u32,
    /// Where images and metadata live.
    pub data_dir: PathBuf,
    /// Replication listener. The node with the higher id of a pair accepts links here;
    /// the lower id dials its peer's address.
    pub listen: Option<String>,
    /// Worker threads of the node's async runtime (default: one per core). Nodes that
    /// share a machine's cores with each other or with their clients do better with
    /// fewer.
    pub threads: Option<usize>,
    /// How long a silent peer is waited for before writes go on without it (ms).
    #[serde(default = "default_peer_timeout_ms")]
    pub peer_timeout_ms: u64,
    /// gRPC management address (used once the management plane lands).
    pub mgmt: Option<String>,
    /// Quorum witness address ("host:port", a `vsan-witness`). With it, a node that
    /// loses its peer serves a mirrored disk only while the witness grants it the disk.
    pub witness: Option<String>,
    /// What a node without its peer and without quorum does with I/O: "io-error" (the
    /// default: fail it) or "suspend" (hold it until the peer or quorum returns). Only
    /// with `witness`.
    pub quorum: Option<String>,
}

/// `[[peer]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerSection {
    /// The peer's node id.
    pub id: u32,
    /// The peer's replication address.
    pub address: String,
    /// tcp | loopback | quic | rdma.
    #[serde(default = "default_transport")]
    pub transport: String,
}

fn default_peer_timeout_ms() -> u64 {
    5000
}

fn default_transport() -> String {
    "tcp".to_string()
}

/// Where a disk's data lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backing {
    /// A file (`data_dir/<name>.img` unless `path` says otherwise) or a block device.
    #[default]
    File,
    /// RAM; gone when the node stops.
    Mem,
}

/// `[disk.cache]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// The fast device or file.
    pub path: PathBuf,
    /// Its size.
    pub size: Size,
    /// write-back | write-through | write-around | pass-through.
    #[serde(default)]
    pub mode: Option<String>,
}

/// `[[disk]]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSection {
    /// Disk name; also its NBD export name.
    pub name: String,
    /// Size of the disk.
    pub size: Size,
    /// file | mem.
    #[serde(default)]
    pub backing: Backing,
    /// Image path for `backing = "file"`; default `data_dir/<name>.img`.
    pub path: Option<PathBuf>,
    /// Logical block size (512 by default).
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Open the image with O_DIRECT.
    #[serde(default)]
    pub direct: bool,
    /// Mirror partner's node id.
    pub peer: Option<u32>,
    /// NBD address: "host:port" or "unix:/path".
    pub nbd: Option<String>,
    /// Optional write-back cache.
    pub cache: Option<CacheSection>,
    /// Bytes per bit of the resync bitmap (a power of two, at least 4 KiB; default
    /// 64 KiB). Fixed when the disk's metadata is created.
    pub bitmap_chunk: Option<Size>,
    /// Resync speed: "dynamic" (the default: full speed while the application is idle,
    /// one chunk at a time while it has I/O in flight) or a fixed rate per second
    /// ("40MiB").
    pub resync_rate: Option<String>,
    /// Split-brain policy, the same on both nodes: "refuse" (the default),
    /// "discard-zero-changes", "discard-least-changes" or "discard-node(ID)".
    pub split_brain: Option<String>,
}

/// A resync rate as the config gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    /// Yield to the application.
    Dynamic,
    /// Bytes per second.
    Fixed(u64),
}

/// A split-brain policy as the config gives it.
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

impl DiskSection {
    /// The resync rate (`resync_rate`).
    pub fn rate(&self) -> Result<Rate, String> {
        match self.resync_rate.as_deref().map(str::trim) {
            None | Some("dynamic") => Ok(Rate::Dynamic),
            Some(text) => {
                let per = text.strip_suffix("/s").unwrap_or(text);
                parse_size::Config::new()
                    .with_binary()
                    .parse_size(per.trim())
                    .ok()
                    .filter(|n| *n > 0)
                    .map(Rate::Fixed)
                    .ok_or_else(|| {
                        format!("{text:?} is neither \"dynamic\" nor a rate such as \"40MiB\"")
                    })
            }
        }
    }

    /// The split-brain policy (`split_brain`).
    pub fn split_brain_policy(&self) -> Result<SplitBrain, String> {
        let text = self.split_brain.as_deref().unwrap_or("refuse").trim();
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
                    format!(
                        "{text:?} is not one of refuse, discard-zero-changes, \
                         discard-least-changes, discard-node(ID)"
                    )
                }),
        }
    }
}

fn default_block_size() -> u32 {
    512
}

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[node]`.
    pub node: NodeSection,
    /// `[[peer]]`.
    #[serde(default)]
    pub peer: Vec<PeerSection>,
    /// `[[disk]]`.
    #[serde(default)]
    pub disk: Vec<DiskSection>,
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
    /// Parse "host:port" or "unix:/path".
    pub fn parse(s: &str) -> Result<NbdAddr, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("unix socket path is empty".into());
            }
            return Ok(NbdAddr::Unix(PathBuf::from(p)));
        }
        s.parse::<SocketAddr>().map(NbdAddr::Tcp).map_err(|_| {
            format!("{s:?} is not an address; write \"127.0.0.1:10809\" or \"unix:/path/to.sock\"")
        })
    }
}

impl DiskSection {
    /// The image path of a file-backed disk.
    pub fn image_path(&self, data_dir: &Path) -> PathBuf {
        self.path
            .clone()
            .unwrap_or_else(|| data_dir.join(format!("{}.img", self.name)))
    }
}

impl Config {
    /// Parse and check a configuration text. Keys that belong to features not built yet
    /// (mirroring, the cache) are refused here with a message that says so, rather than
    /// accepted and ignored.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let de = toml::Deserializer::parse(text).map_err(|e| err("", e.message().to_string()))?;
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.inner().message().to_string();
            err(if key == "." { String::new() } else { key }, inner)
        })?;
        cfg.check()?;
        Ok(cfg)
    }

    /// Read and parse a file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err("", format!("cannot read {}: {e}", path.display())))?;
        Config::parse(&text)
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.node.threads == Some(0) {
            return Err(err("node.threads", "must be at least 1"));
        }
        if let Some(listen) = &self.node.listen {
            listen.parse::<SocketAddr>().map_err(|_| {
                err(
                    "node.listen",
                    format!("{listen:?} is not an address such as \"127.0.0.1:7001\""),
                )
            })?;
        }
        match (self.node.quorum.as_deref(), &self.node.witness) {
            (None | Some("io-error") | Some("suspend"), _) if self.node.witness.is_some() => {}
            (None, None) => {}
            (Some(_), None) => {
                return Err(err("node.quorum", "a quorum policy needs node.witness"));
            }
            (Some(q), Some(_)) => {
                return Err(err(
                    "node.quorum",
                    format!("{q:?} is not one of io-error, suspend"),
                ));
            }
            (None, Some(_)) => {}
        }
        if let Some(w) = &self.node.witness
            && w.parse::<SocketAddr>().is_err()
        {
            return Err(err(
                "node.witness",
                format!("{w:?} is not an address such as \"127.0.0.1:7200\""),
            ));
        }
        let mut peer_ids = HashSet::new();
        for (i, p) in self.peer.iter().enumerate() {
            if p.id == self.node.id {
                return Err(err(
                    format!("peer[{i}].id"),
                    format!("{} is this node's own id", p.id),
                ));
            }
            if !peer_ids.insert(p.id) {
                return Err(err(
                    format!("peer[{i}].id"),
                    format!("peer {} is declared twice", p.id),
                ));
            }
            match p.transport.as_str() {
                "tcp" => {}
                "loopback" | "quic" | "rdma" => {
                    return Err(err(
                        format!("peer[{i}].transport"),
                        format!(
                            "{:?} is not implemented in this build yet; use \"tcp\"",
                            p.transport
                        ),
                    ));
                }
                other => {
                    return Err(err(
                        format!("peer[{i}].transport"),
                        format!("{other:?} is not one of tcp, loopback, quic, rdma"),
                    ));
                }
            }
        }
        let mut names = HashSet::new();
        for (i, d) in self.disk.iter().enumerate() {
            let key = |k: &str| format!("disk[{i}].{k}");
            let name_ok = !d.name.is_empty()
                && d.name.len() <= 255
                && d.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
                && !d.name.starts_with('.');
            if !name_ok {
                return Err(err(
                    key("name"),
                    format!(
                        "{:?} must be 1-255 of A-Z a-z 0-9 . _ - (not starting with .)",
                        d.name
                    ),
                ));
            }
            if !names.insert(d.name.as_str()) {
                return Err(err(
                    key("name"),
                    format!("disk {:?} is declared twice", d.name),
                ));
            }
            let bs = d.block_size;
            if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
                return Err(err(
                    key("block_size"),
                    format!("{bs} is not a power of two from 512 to 65536"),
                ));
            }
            if d.size.0 == 0 || d.size.0 % u64::from(bs) != 0 {
                return Err(err(
                    key("size"),
                    format!(
                        "{} bytes is not a non-zero multiple of the block size {bs}",
                        d.size.0
                    ),
                ));
            }
            if let Some(nbd) = &d.nbd {
                NbdAddr::parse(nbd).map_err(|m| err(key("nbd"), m))?;
            }
            if let Some(peer) = d.peer {
                if !peer_ids.contains(&peer) {
                    return Err(err(key("peer"), format!("no [[peer]] with id {peer}")));
                }
            }
            if d.cache.is_some() {
                return Err(err(
                    key("cache"),
                    "the write-back cache is not implemented in this build yet",
                ));
            }
            if let Some(c) = d.bitmap_chunk {
                let c = c.0;
                if !c.is_power_of_two() || c < 4096 || c % u64::from(bs) != 0 {
                    return Err(err(
                        key("bitmap_chunk"),
                        format!(
                            "{c} is not a power of two of at least 4096 and a multiple of the block size"
                        ),
                    ));
                }
            }
            d.rate().map_err(|m| err(key("resync_rate"), m))?;
            d.split_brain_policy()
                .map_err(|m| err(key("split_brain"), m))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[node]
id = 1
data_dir = "/tmp/n1"

[[disk]]
name = "vol0"
size = "1GiB"
nbd = "127.0.0.1:10809"
"#;

    #[test]
    fn parses_the_design_example_subset() {
        let c = Config::parse(GOOD).unwrap();
        assert_eq!(c.disk[0].size, Size(1 << 30));
        assert_eq!(c.disk[0].backing, Backing::File);
        assert_eq!(
            c.disk[0].image_path(Path::new("/d")),
            PathBuf::from("/d/vol0.img")
        );
    }

    #[test]
    fn errors_name_the_key() {
        let e = Config::parse(&GOOD.replace("nbd =", "sizee = 1\nnbd =")).unwrap_err();
        assert_eq!(e.key, "disk[0].sizee", "{e}");
        assert!(e.message.contains("unknown field `sizee`"), "{e}");
        let e = Config::parse(&GOOD.replace("\"1GiB\"", "\"12 parsecs\"")).unwrap_err();
        assert_eq!(e.key, "disk[0].size", "{e}");
        assert!(e.message.contains("\"12 parsecs\" is not a size"), "{e}");
        let e = Config::parse(&GOOD.replace("\"1GiB\"", "1000")).unwrap_err();
        assert_eq!(e.key, "disk[0].size", "{e}");
        assert!(e.message.contains("multiple of the block size"), "{e}");
        let e = Config::parse(&GOOD.replace("127.0.0.1:10809", "nowhere")).unwrap_err();
        assert_eq!(e.key, "disk[0].nbd", "{e}");
    }
}
