//! Two `vsan-node` processes mirroring one disk over TCP on loopback: each node's config,
//! starting them, and comparing their replicas once they have stopped.
//!
//! Node 1 (the lower id) dials; node 2 listens, on `127.0.0.1:0` unless a test needs a
//! fixed address, and prints `ready replication=<addr>`, which goes into node 1's config.
//! Each node has its own directory (its config and `data/<disk>.img`).

use std::io::Read;
use std::path::Path;

use super::{Node, Sig, TOOL_TIMEOUT, TestDir, assert_same_bytes, find_tool, run_tool, toml_str};

/// What each node logs once the two have shaken hands and mirror.
pub const CONNECTED: &str = "peer connected: mirroring";

const MIB: u64 = 1 << 20;

/// One node's side of a mirrored disk. The optional keys are written only when set.
#[derive(Debug, Clone)]
pub struct Side {
    id: u32,
    disk: &'static str,
    /// Written into the config as given (`"32MiB"` with the quotes, or a number).
    size: &'static str,
    peer_timeout_ms: u64,
    /// `node.witness`.
    witness: Option<String>,
    /// `node.quorum`.
    quorum: Option<&'static str>,
    /// `node.startup`.
    startup: Option<&'static str>,
    /// The disk's `split_brain` policy.
    split_brain: Option<&'static str>,
    /// The disk's `resync_rate`.
    resync_rate: Option<&'static str>,
    /// The peer's `transport`.
    transport: &'static str,
    /// More `[[peer]]` lines (secret, lanes, certificates).
    peer_lines: String,
    /// More `[node]` lines (the management service, say).
    node_lines: String,
    /// More lines of the disk's `[[disk]]` section.
    disk_lines: String,
}

impl Side {
    /// Node `id`'s side of `disk` of `size`, with a 5 s peer timeout.
    pub fn new(id: u32, disk: &'static str, size: &'static str) -> Side {
        Side {
            id,
            disk,
            size,
            peer_timeout_ms: 5000,
            witness: None,
            quorum: None,
            startup: None,
            split_brain: None,
            resync_rate: None,
            transport: "tcp",
            peer_lines: String::new(),
            node_lines: String::new(),
            disk_lines: String::new(),
        }
    }

    /// The peer's `transport` and more `[[peer]]` lines (`key = value`, one per line).
    pub fn transport(mut self, transport: &'static str, peer_lines: &str) -> Side {
        self.transport = transport;
        self.peer_lines = peer_lines.to_string();
        self
    }

    /// More `[node]` lines (`key = value`, one per line).
    pub fn node_lines(mut self, lines: &str) -> Side {
        self.node_lines = lines.to_string();
        self
    }

    /// More lines of the `[[disk]]` section (`key = value`, one per line).
    pub fn disk_lines(mut self, lines: &str) -> Side {
        self.disk_lines = lines.to_string();
        self
    }

    /// `node.startup = "serve-alone-after-timeout"`: the node serves its replica alone
    /// once the peer timeout passes without the peer (for tests of a node whose peer
    /// never shakes hands, where serving alone is what they look at).
    pub fn serve_alone(mut self) -> Side {
        self.startup = Some("serve-alone-after-timeout");
        self
    }

    /// `peer_timeout_ms`.
    pub fn timeout(mut self, ms: u64) -> Side {
        self.peer_timeout_ms = ms;
        self
    }

    /// The disk's `resync_rate`.
    pub fn resync_rate(mut self, rate: &'static str) -> Side {
        self.resync_rate = Some(rate);
        self
    }

    /// The disk's `split_brain` policy.
    pub fn split_brain(mut self, policy: &'static str) -> Side {
        self.split_brain = Some(policy);
        self
    }

    /// Ask the witness at `addr`; `quorum` None leaves the policy to its default.
    pub fn witness(mut self, addr: impl ToString, quorum: Option<&'static str>) -> Side {
        self.witness = Some(addr.to_string());
        self.quorum = quorum;
        self
    }

    /// The disk's name.
    pub fn disk(&self) -> &'static str {
        self.disk
    }

    /// This side's config: `listen` for the acceptor (node 2), the peer's address for
    /// the dialer (node 1).
    pub fn config(&self, dir: &TestDir, listen: Option<&str>, peer_addr: &str) -> String {
        let peer = if self.id == 1 { 2 } else { 1 };
        let mut s = format!(
            "[node]\nid = {}\ndata_dir = {}\npeer_timeout_ms = {}\n",
            self.id,
            toml_str(dir.data_dir()),
            self.peer_timeout_ms
        );
        if let Some(l) = listen {
            s += &format!("listen = {}\n", toml_str(l));
        }
        if let Some(w) = &self.witness {
            s += &format!("witness = {}\n", toml_str(w));
        }
        if let Some(q) = self.quorum {
            s += &format!("quorum = {}\n", toml_str(q));
        }
        if let Some(p) = self.startup {
            s += &format!("startup = {}\n", toml_str(p));
        }
        s += &self.node_lines;
        s += &format!(
            "\n[[peer]]\nid = {peer}\naddress = {}\ntransport = {}\n{}\n\
             [[disk]]\nname = {}\nsize = {}\npeer = {peer}\nnbd = \"127.0.0.1:0\"\n",
            toml_str(peer_addr),
            toml_str(self.transport),
            self.peer_lines,
            toml_str(self.disk),
            self.size
        );
        if let Some(p) = self.split_brain {
            s += &format!("split_brain = {}\n", toml_str(p));
        }
        if let Some(r) = self.resync_rate {
            s += &format!("resync_rate = {}\n", toml_str(r));
        }
        s += &self.disk_lines;
        s
    }
}

/// Start node 2 (the acceptor) listening on `listen`.
pub fn start_acceptor(dir: &TestDir, side: &Side, listen: &str) -> Node {
    start_acceptor_with_args(dir, side, listen, &[])
}

/// [`start_acceptor`] with extra command-line arguments.
pub fn start_acceptor_with_args(dir: &TestDir, side: &Side, listen: &str, args: &[&str]) -> Node {
    // Node 2 never dials (the lower id does), so the address it is given for node 1 is
    // not used; the config requires one.
    let unused = if side.transport == "loopback" {
        "/nonexistent/vsan.sock"
    } else {
        "127.0.0.1:1"
    };
    let config = side.config(dir, Some(listen), unused);
    Node::start_listening_with_args(dir, &config, &[side.disk], args)
}

/// Start node 1 (the dialer) pointed at node 2's replication address.
pub fn start_dialer(dir: &TestDir, side: &Side, peer_addr: &str) -> Node {
    Node::start(dir, &side.config(dir, None, peer_addr), &[side.disk])
}

/// Two started nodes, their directories, and where node 2 listens (for its restarts).
pub struct Pair {
    pub dir1: TestDir,
    pub dir2: TestDir,
    pub n1: Node,
    pub n2: Node,
    pub listen: String,
}

/// Start node 2, then node 1 dialing it (no wait for the handshake).
pub fn start_pair(tag: &str, s1: &Side, s2: &Side) -> Pair {
    start_pair_with(tag, s1, s2, |_, _| {})
}

/// [`start_pair`], calling `prepare` on both directories (node 1's first) before either
/// node starts.
pub fn start_pair_with(
    tag: &str,
    s1: &Side,
    s2: &Side,
    prepare: impl FnOnce(&TestDir, &TestDir),
) -> Pair {
    let dir1 = TestDir::new(&format!("{tag}-n1"));
    let dir2 = TestDir::new(&format!("{tag}-n2"));
    prepare(&dir1, &dir2);
    let listen = if s2.transport == "loopback" {
        dir2.join("replication.sock").display().to_string()
    } else {
        "127.0.0.1:0".to_string()
    };
    let n2 = start_acceptor(&dir2, s2, &listen);
    let listen = n2.replication().to_string();
    let n1 = start_dialer(&dir1, s1, &listen);
    Pair {
        dir1,
        dir2,
        n1,
        n2,
        listen,
    }
}

/// A free loopback address, for a listener whose address must be known before it starts
/// or kept across a restart.
///
/// The port comes from below the kernel's ephemeral range, so no outgoing connection can
/// be given it as its source port meanwhile (a node dialing a port nobody listens on yet
/// can otherwise connect to itself, and the listener later finds the port taken).
pub fn free_loopback_addr() -> String {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000)).max(1);
    // A different start per process and call, then a walk over the range.
    let seed = std::process::id()
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
    for i in 0..span {
        let port = 10_000 + ((seed.wrapping_mul(2_654_435_761).wrapping_add(i)) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return format!("127.0.0.1:{port}");
        }
    }
    panic!("no free loopback port below {low}");
}

/// Stop both nodes with SIGTERM, each required to exit 0; node 1 first.
pub fn stop_both_clean(n1: Node, n2: Node) {
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
}

/// Both replicas byte-identical: compared here, and by `cmp` where it is installed.
pub fn assert_replicas_identical(a: &Path, b: &Path) {
    let da = std::fs::read(a).unwrap_or_else(|e| panic!("read {}: {e}", a.display()));
    let db = std::fs::read(b).unwrap_or_else(|e| panic!("read {}: {e}", b.display()));
    assert_same_bytes(&db, &da, "node 2's replica against node 1's");
    if find_tool("cmp") {
        run_tool("cmp", &[a, b], TOOL_TIMEOUT).assert_success();
    }
}

/// Both files byte-identical, compared a MiB at a time (for images too large to read
/// whole).
pub fn assert_files_identical(a: &Path, b: &Path) {
    let open =
        |p: &Path| std::fs::File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let (fa, fb) = (open(a), open(b));
    let (la, lb) = (
        fa.metadata().expect("stat").len(),
        fb.metadata().expect("stat").len(),
    );
    assert_eq!(
        la,
        lb,
        "{} and {} differ in length",
        a.display(),
        b.display()
    );
    let (mut ra, mut rb) = (std::io::BufReader::new(fa), std::io::BufReader::new(fb));
    let mut ba = vec![0u8; MIB as usize];
    let mut bb = vec![0u8; MIB as usize];
    let mut at = 0u64;
    while at < la {
        let n = (la - at).min(MIB) as usize;
        ra.read_exact(&mut ba[..n]).expect("read the first file");
        rb.read_exact(&mut bb[..n]).expect("read the second file");
        if let Some(i) = ba[..n].iter().zip(&bb[..n]).position(|(x, y)| x != y) {
            panic!(
                "{} and {} differ at byte {} ({:#04x} vs {:#04x})",
                a.display(),
                b.display(),
                at + i as u64,
                ba[i],
                bb[i]
            );
        }
        at += n as u64;
    }
}
