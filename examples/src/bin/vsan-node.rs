//! `vsan-node --config node.toml`: the appliance daemon.
//!
//! Opens (or creates) every configured disk, exports each over NBD at its `nbd` address
//! (disks sharing an address are exports of one server; the empty export name selects
//! the only disk on an address), and on SIGINT/SIGTERM stops accepting, lets requests in
//! flight finish, flushes every disk and exits 0.
//!
//! Exit codes: 0 clean shutdown, 1 runtime failure, 2 bad configuration (one line on
//! stderr naming the key and the problem).
//!
//! Once all listeners are bound it prints one line per disk on stdout,
//! `ready disk=<name> nbd=<address>`, with the actual port when the config said port 0.
//!
//! Mirrored disks keep their metadata (superblock, activity log, resync bitmap) in
//! `data_dir/<name>.meta`, created with the disk's image and never re-initialised: a
//! corrupt, truncated or foreign metadata file stops the node with a message (exit 1).
//! On stdout the node also reports, one line each:
//! - `sync disk=<name> started kind=<bitmap|checksum|verify> role=<source|target> total=<bytes>`
//! - `sync disk=<name> progress kind=.. role=.. percent=<p> done=<bytes> total=<bytes> transferred=<bytes> rate=<bytes/s> eta_s=<s>`
//!   (every second while one runs)
//! - `sync disk=<name> done|interrupted kind=.. role=.. total=<bytes> done=<bytes> transferred=<bytes> mismatches=<n> elapsed_ms=<ms>`
//! - `problem disk=<name> <reason>` when a link is refused or lost (a split brain, say).
//!
//! Operator actions until the management plane lands: `--discard-my-data NAME` resolves
//! a split brain by making this node's replica of NAME the sync target on the next
//! connection; SIGUSR1 starts an online verify of every mirrored disk from this node.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio::net::{TcpListener, UnixListener};
use tracing::{error, info, warn};
use vsan_core::export::nbd::{Export, Server};
use vsan_core::{BlockDevice, ErrorKind, FileOptions, Geometry, MemDevice};
use vsan_examples::config::{Backing, Config, DiskSection, NbdAddr, Rate, SplitBrain};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::meta::{self, DEFAULT_CHUNK_SIZE};
use vsan_replica::protocol::{
    Config as MirrorConfig, DiskId, QuorumPolicy, ResyncRate, SplitBrainPolicy, SyncKind, SyncRole,
};
use vsan_replica::transport::Transport;
use vsan_replica::transport::tcp::TcpTransport;
use vsan_replica::witness::WitnessClient;
use vsan_replica::{MirroredDisk, Replica, meta_params};

/// How long shutdown waits for clients to finish their requests.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Parser, Debug)]
#[command(
    version,
    about = "vsan node daemon: serves the configured disks over NBD"
)]
struct Args {
    /// Path of the node configuration (TOML).
    #[arg(long, short)]
    config: PathBuf,
    /// Resolve a split brain on disk NAME by discarding this node's changes: on the next
    /// connection this replica becomes the sync target. May be given more than once.
    #[arg(long, value_name = "NAME")]
    discard_my_data: Vec<String>,
}

/// Why the node could not start.
enum StartError {
    Config(String),
    Runtime(String),
}

struct Disk {
    name: String,
    device: Arc<dyn BlockDevice>,
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();

    let config = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vsan-node: config error in {}: {e}", args.config.display());
            return ExitCode::from(2);
        }
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = config.node.threads {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vsan-node: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(config, args.discard_my_data)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(StartError::Config(msg)) => {
            eprintln!(
                "vsan-node: config error in {}: {msg}",
                args.config.display()
            );
            ExitCode::from(2)
        }
        Err(StartError::Runtime(msg)) => {
            error!("{msg}");
            eprintln!("vsan-node: {msg}");
            ExitCode::from(1)
        }
    }
}

async fn run(config: Config, discard: Vec<String>) -> Result<(), StartError> {
    let node = &config.node;
    info!(id = node.id, data_dir = %node.data_dir.display(), "vsan-node starting");
    if let Some(v) = &node.mgmt {
        warn!("node.mgmt = {v:?} is accepted but not used yet in this build");
    }
    for name in &discard {
        if !config
            .disk
            .iter()
            .any(|d| &d.name == name && d.peer.is_some())
        {
            return Err(StartError::Config(format!(
                "--discard-my-data {name:?}: no mirrored disk of that name"
            )));
        }
    }
    let witness = node
        .witness
        .as_ref()
        .map(|w| WitnessClient::new(w.clone(), node.id));
    let quorum = match (node.witness.is_some(), node.quorum.as_deref()) {
        (false, _) => None,
        (true, Some("suspend")) => Some(QuorumPolicy::Suspend),
        (true, _) => Some(QuorumPolicy::IoError),
    };

    let mut ready_lines_pre = Vec::new();
    // Bind every listener first: a busy address must refuse the start before any image
    // is created. Disks sharing an address become exports of one server.
    let mut by_addr: BTreeMap<String, (NbdAddr, Vec<usize>)> = BTreeMap::new();
    for (i, d) in config.disk.iter().enumerate() {
        let Some(nbd) = &d.nbd else {
            warn!(disk = %d.name, "no `nbd` address: the disk is not exported");
            continue;
        };
        let addr = NbdAddr::parse(nbd)
            .map_err(|m| StartError::Config(format!("key `disk[{i}].nbd`: {m}")))?;
        by_addr
            .entry(addr.to_string())
            .or_insert_with(|| (addr, Vec::new()))
            .1
            .push(i);
    }
    let mut bound = Vec::new();
    for (addr, members) in by_addr.into_values() {
        let key = format!("key `disk[{}].nbd`", members[0]);
        let listener = bind(&addr).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                StartError::Config(format!("{key}: address {addr} is already in use"))
            } else {
                StartError::Config(format!("{key}: cannot listen on {addr}: {e}"))
            }
        })?;
        bound.push((addr, members, listener));
    }

    let replication = match &node.listen {
        Some(addr) => {
            let transport = TcpTransport::new();
            let l = transport.listen(addr).await.map_err(|e| {
                StartError::Config(format!("key `node.listen`: cannot listen on {addr}: {e}"))
            })?;
            ready_lines_pre.push(format!("ready replication={}", l.local_addr()));
            Some(l)
        }
        None => None,
    };

    let transport: Arc<dyn Transport> = Arc::new(TcpTransport::new());
    let mut disks = Vec::new();
    let mut mirrored = HashMap::new();
    let mut mirrors: Vec<MirroredDisk> = Vec::new();
    let mut background = Vec::new();
    for (i, d) in config.disk.iter().enumerate() {
        if d.peer.is_some() && d.backing == Backing::File {
            // A replica whose image is gone but whose metadata is not would claim data it
            // no longer has; it must come back as a new replica.
            let meta_path = node.data_dir.join(format!("{}.meta", d.name));
            let image = d.image_path(&node.data_dir);
            if meta_path.exists() && !image.exists() {
                return Err(StartError::Runtime(format!(
                    "disk {}: refusing to attach: the metadata {} exists but the image {} does \
                     not; a replaced replica is a new one: remove its metadata too and it is \
                     synced in full from its peer",
                    d.name,
                    meta_path.display(),
                    image.display()
                )));
            }
        }
        let local = open_disk(i, d, &node.data_dir)?;
        let device: Arc<dyn BlockDevice> = match d.peer {
            None => local,
            Some(peer_id) => {
                let Some(peer) = config.peer.iter().find(|p| p.id == peer_id) else {
                    return Err(StartError::Config(format!(
                        "key `disk[{i}].peer`: no [[peer]] with id {peer_id}"
                    )));
                };
                let g = local.geometry();
                let mut cfg = MirrorConfig::new(
                    node.id,
                    peer_id,
                    DiskId::from_name(&d.name),
                    &d.name,
                    g.size(),
                    g.block_size(),
                );
                cfg.peer_timeout = Duration::from_millis(node.peer_timeout_ms);
                // Several pings per timeout, so one late ping never loses the peer.
                cfg.ping_interval = cfg.ping_interval.min(cfg.peer_timeout / 4);
                cfg.connect_timeout = Duration::from_millis(node.peer_timeout_ms);
                cfg.quorum = quorum;
                cfg.seed = rand::random();
                let key = |k: &str| format!("key `disk[{i}].{k}`");
                cfg.split_brain = match d
                    .split_brain_policy()
                    .map_err(|m| StartError::Config(format!("{}: {m}", key("split_brain"))))?
                {
                    SplitBrain::Refuse => SplitBrainPolicy::Refuse,
                    SplitBrain::DiscardZeroChanges => SplitBrainPolicy::DiscardZeroChanges,
                    SplitBrain::DiscardLeastChanges => SplitBrainPolicy::DiscardLeastChanges,
                    SplitBrain::DiscardNode(id) => SplitBrainPolicy::DiscardNode(id),
                };
                cfg.resync.rate = match d
                    .rate()
                    .map_err(|m| StartError::Config(format!("{}: {m}", key("resync_rate"))))?
                {
                    Rate::Dynamic => ResyncRate::Dynamic { max: 0 },
                    Rate::Fixed(r) => ResyncRate::Fixed(r),
                };
                let chunk = d.bitmap_chunk.map_or(DEFAULT_CHUNK_SIZE, |c| c.0);
                let replica = open_replica(d, &node.data_dir, &cfg, chunk, local).await?;
                let disk = MirroredDisk::start(cfg, replica, witness.clone())
                    .map_err(|e| StartError::Runtime(e.to_string()))?;
                if discard.contains(&d.name) {
                    disk.discard_my_data();
                }
                background.push(tokio::spawn(report(disk.clone())));
                if node.id < peer_id {
                    info!(disk = %d.name, peer = peer_id, address = %peer.address,
                        "mirroring: dialing the peer");
                    background.push(tokio::spawn(dial_loop(
                        Arc::clone(&transport),
                        peer.address.clone(),
                        disk.clone(),
                    )));
                } else if replication.is_none() {
                    return Err(StartError::Config(format!(
                        "key `node.listen`: disk {:?} mirrors with node {peer_id}, which dials \
                         this node; set node.listen",
                        d.name
                    )));
                } else {
                    info!(disk = %d.name, peer = peer_id, "mirroring: waiting for the peer to connect");
                }
                mirrored.insert(d.name.clone(), disk.clone());
                mirrors.push(disk.clone());
                Arc::new(disk)
            }
        };
        disks.push(Disk {
            name: d.name.clone(),
            device,
        });
    }
    if let Some(l) = replication {
        background.push(tokio::spawn(accept_loop(l, mirrored)));
    }

    let mut servers = Vec::new();
    let mut ready_lines = ready_lines_pre;
    for (addr, members, listener) in bound {
        let shown = match &listener {
            Listener::Tcp(l) => l
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| addr.to_string()),
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
        };
        let mut exports = Vec::new();
        for &i in &members {
            let disk = &disks[i];
            ready_lines.push(format!("ready disk={} nbd={shown}", disk.name));
            exports.push(
                Export::new(&disk.name, Arc::clone(&disk.device))
                    .with_description(format!("vsan disk {}", disk.name)),
            );
        }
        let server = Server::new(exports).map_err(|e| StartError::Config(e.to_string()))?;
        servers.push((server, listener));
    }

    let mut tasks = Vec::new();
    let mut sockets = Vec::new();
    let mut running = Vec::new();
    for (server, listener) in servers {
        let s = server.clone();
        tasks.push(match listener {
            Listener::Tcp(l) => tokio::spawn(async move { s.serve_tcp(l).await }),
            Listener::Unix(l, path) => {
                sockets.push(path);
                tokio::spawn(async move { s.serve_unix(l).await })
            }
        });
        running.push(server);
    }
    let servers = running;
    // Signal handlers before the ready lines: a signal sent as soon as the node says it
    // is ready must find them.
    let signals = Signals::new().map_err(StartError::Runtime)?;
    for line in &ready_lines {
        println!("{line}");
    }
    info!(
        disks = disks.len(),
        exports = ready_lines.len(),
        "vsan-node ready"
    );

    signals.wait(&mirrors).await;
    info!("shutting down: no new connections or requests; finishing requests in flight");
    for server in &servers {
        server.shutdown();
    }
    for t in tasks {
        let _ = t.await;
    }
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        for server in &servers {
            server.wait_idle().await;
        }
    })
    .await;
    if drained.is_err() {
        warn!("some clients did not finish within {DRAIN_TIMEOUT:?}; closing them");
    }
    let mut failed = false;
    for disk in &disks {
        match disk.device.flush().await {
            Ok(()) => info!(disk = %disk.name, "flushed"),
            Err(e) => {
                error!(disk = %disk.name, "final flush failed: {e}");
                failed = true;
            }
        }
    }
    for task in background {
        task.abort();
    }
    for disk in &mirrors {
        match tokio::time::timeout(DRAIN_TIMEOUT, disk.close()).await {
            Ok(Ok(())) => info!(disk = disk.name(), "metadata marked clean"),
            Ok(Err(e)) => warn!(disk = disk.name(), "closing the mirror failed: {e}"),
            Err(_) => warn!(disk = disk.name(), "closing the mirror timed out"),
        }
    }
    for path in &sockets {
        let _ = std::fs::remove_file(path);
    }
    if failed {
        return Err(StartError::Runtime(
            "final flush failed; data may not be durable".into(),
        ));
    }
    info!("vsan-node stopped cleanly");
    Ok(())
}

/// Open (or create) disk `i` of the config.
fn open_disk(
    i: usize,
    d: &DiskSection,
    data_dir: &Path,
) -> Result<Arc<dyn BlockDevice>, StartError> {
    let key = |k: &str| format!("key `disk[{i}].{k}`");
    match d.backing {
        Backing::Mem => {
            let g = Geometry::new(d.size.0, d.block_size)
                .map_err(|e| StartError::Config(format!("{}: {e}", key("size"))))?;
            info!(disk = %d.name, size = d.size.0, "RAM disk created");
            Ok(Arc::new(MemDevice::new(g)))
        }
        Backing::File => {
            let path = d.image_path(data_dir);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| {
                    StartError::Runtime(format!("cannot create {}: {e}", parent.display()))
                })?;
            }
            let existed = path.exists();
            let dev = FileOptions::new()
                .block_size(d.block_size)
                .direct(d.direct)
                .create(d.size.0)
                .open(&path)
                .map_err(|e| match e.kind() {
                    ErrorKind::InvalidArgument => {
                        StartError::Config(format!("{}: {e}", key("size")))
                    }
                    _ => StartError::Runtime(format!("disk {}: {e}", d.name)),
                })?;
            info!(disk = %d.name, path = %path.display(), size = d.size.0, direct = d.direct,
                "{}", if existed { "image opened" } else { "image created" });
            Ok(Arc::new(dev))
        }
    }
}

async fn bind(addr: &NbdAddr) -> std::io::Result<Listener> {
    match addr {
        NbdAddr::Tcp(a) => Ok(Listener::Tcp(TcpListener::bind(a).await?)),
        NbdAddr::Unix(p) => {
            if p.exists() {
                // A socket someone still answers on is in use; a dead one is stale.
                if tokio::net::UnixStream::connect(p).await.is_ok() {
                    return Err(std::io::Error::from(std::io::ErrorKind::AddrInUse));
                }
                std::fs::remove_file(p)?;
            }
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            Ok(Listener::Unix(UnixListener::bind(p)?, p.clone()))
        }
    }
}

/// The signals the node answers.
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    usr1: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Signals, String> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            int: signal(SignalKind::interrupt())
                .map_err(|e| format!("cannot watch SIGINT: {e}"))?,
            term: signal(SignalKind::terminate())
                .map_err(|e| format!("cannot watch SIGTERM: {e}"))?,
            usr1: signal(SignalKind::user_defined1())
                .map_err(|e| format!("cannot watch SIGUSR1: {e}"))?,
        })
    }

    /// Wait for SIGINT or SIGTERM; on SIGUSR1, start an online verify of every mirrored
    /// disk.
    async fn wait(mut self, mirrors: &[MirroredDisk]) {
        loop {
            tokio::select! {
                _ = self.int.recv() => { info!("SIGINT received"); return }
                _ = self.term.recv() => { info!("SIGTERM received"); return }
                _ = self.usr1.recv() => {
                    info!("SIGUSR1 received: starting an online verify of every mirrored disk");
                    for disk in mirrors {
                        if let Err(e) = disk.verify().await {
                            warn!(disk = disk.name(), "{e}");
                            say(&format!("problem disk={} {e}", disk.name()));
                        }
                    }
                }
            }
        }
    }
}

/// One line on stdout, written by a thread of its own: a reader that stops reading
/// (a full pipe) must never block the node's runtime. Lines that find the queue full
/// are dropped; a closed stdout is not an error.
fn say(line: &str) {
    static OUT: std::sync::OnceLock<std::sync::mpsc::SyncSender<String>> =
        std::sync::OnceLock::new();
    let tx = OUT.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<String>(1024);
        std::thread::spawn(move || {
            use std::io::Write;
            for line in rx {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        });
        tx
    });
    let _ = tx.try_send(line.to_string());
}

fn kind_word(k: SyncKind) -> &'static str {
    match k {
        SyncKind::Bitmap => "bitmap",
        SyncKind::Checksum => "checksum",
        SyncKind::Verify => "verify",
    }
}

fn role_word(r: SyncRole) -> &'static str {
    match r {
        SyncRole::Source => "source",
        SyncRole::Target => "target",
    }
}

/// Open (or create) the metadata of a mirrored disk: `data_dir/<name>.meta` for file
/// images, in memory for RAM disks.
async fn open_replica(
    d: &DiskSection,
    data_dir: &Path,
    cfg: &MirrorConfig,
    chunk: u64,
    local: Arc<dyn BlockDevice>,
) -> Result<Replica, StartError> {
    if d.backing == Backing::Mem {
        return Replica::with_memory_meta(cfg, local)
            .await
            .map_err(|e| StartError::Runtime(format!("disk {}: {e}", d.name)));
    }
    let path = data_dir.join(format!("{}.meta", d.name));
    let params = meta_params(cfg, chunk);
    let (dev, loaded, created) = meta::open_or_create_file(&path, &params)
        .await
        .map_err(|e| StartError::Runtime(format!("disk {}: refusing to attach: {e}", d.name)))?;
    let sb = &loaded.superblock;
    info!(
        disk = %d.name,
        path = %path.display(),
        current = format_args!("{:016x}", sb.generations.current),
        dirty_chunks = loaded.bitmap.count(),
        clean = sb.clean_shutdown,
        "{}",
        if created { "metadata created" } else { "metadata opened" }
    );
    Ok(Replica {
        data: local,
        meta: dev,
        loaded,
    })
}

/// Print a disk's resync progress and problems on stdout (see the module docs).
async fn report(disk: MirroredDisk) {
    let name = disk.name().to_string();
    let mut status = disk.watch_status();
    let mut last = status.borrow().clone();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            r = status.changed() => if r.is_err() { return },
            _ = tick.tick() => {
                if let Some(p) = disk.sync_progress() {
                    say(&format!(
                        "sync disk={name} progress kind={} role={} percent={:.1} done={} total={} transferred={} rate={} eta_s={}",
                        kind_word(p.kind), role_word(p.role), p.percent(), p.done_bytes, p.total_bytes,
                        p.transferred_bytes, p.rate, p.eta.map_or(-1, |e| e.as_secs() as i64)
                    ));
                }
                continue;
            }
        }
        let now = status.borrow_and_update().clone();
        if now.syncing
            && !last.syncing
            && let Some(p) = disk.sync_progress()
        {
            say(&format!(
                "sync disk={name} started kind={} role={} total={}",
                kind_word(p.kind),
                role_word(p.role),
                p.total_bytes
            ));
        }
        if now.last_sync != last.last_sync
            && let Some(s) = now.last_sync
        {
            say(&format!(
                "sync disk={name} {} kind={} role={} total={} done={} transferred={} mismatches={} elapsed_ms={}",
                if s.completed { "done" } else { "interrupted" },
                kind_word(s.kind),
                role_word(s.role),
                s.total_bytes,
                s.done_bytes,
                s.transferred_bytes,
                s.mismatches,
                s.elapsed.as_millis()
            ));
        }
        if now.last_problem != last.last_problem
            && let Some(p) = &now.last_problem
        {
            say(&format!("problem disk={name} {p}"));
        }
        last = now;
    }
}
