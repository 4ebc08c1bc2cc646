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
//! A disk with an `iscsi` portal is also (or only) an iSCSI target there, LUN 0 of
//! `iqn.2026-12.io.vsan:<name>` unless `iscsi_target` names it, with CHAP when
//! `iscsi_chap_*` (on the disk, or in `[node]` for every disk) say so; disks sharing a
//! portal are targets of one server. A portal beyond loopback with a target without CHAP
//! logs a warning.
//!
//! Once all listeners are bound it prints one line per disk on stdout,
//! `ready disk=<name> nbd=<address>`, with the actual port when the config said port 0,
//! then one per iSCSI target, `ready disk=<name> iscsi=<portal> target=<iqn>`, then
//! one per vhost-user-blk socket, `ready disk=<name> vhost_user=<path>`.
//!
//! A disk with `vhost_user = "<socket path>"` (Linux) is also served to VMs on this host
//! through shared memory (QEMU's `vhost-user-blk-pci`, cloud-hypervisor, libblkio), with
//! `vhost_user_queues` queues (default 1) and an optional `vhost_user_busy_poll_us`
//! polling window; one front end at a time, a new one after it disconnects. Its
//! requests go to the same device as NBD and iSCSI (a mirrored replica not yet proven
//! current makes them wait), and GET_ID answers the disk's serial, the same on both
//! nodes.
//! With `node.metrics` it prints `ready metrics=<address>` before those: the node's
//! metrics (per-disk I/O counts, bytes and latency, mirror link and resync state, cache
//! dirty bytes) in the Prometheus text format at `GET /metrics` there. With `node.mgmt`
//! it prints `ready mgmt=<address>` after the disks' lines: the gRPC management service
//! (`vsan.mgmt.v1`, see `vsanctl`), with `node.mgmt_token` / `mgmt_token_file` for a
//! bearer token and `node.mgmt_cert` + `mgmt_key` for TLS.
//!
//! A disk with `[disk.cache]` is served through a write-back cache (vsan-cache) on the
//! cache file, in front of its image; under a mirror the cache is the local replica's
//! data device. A missing or all-zero cache file is formatted; a formatted one is opened
//! and its log replayed if the node did not stop cleanly. Before the ready lines the node
//! prints, per cached disk,
//! `cache disk=<name> mode=<mode> open=<formatted|clean|recovered> records=<replayed>
//! dirty_bytes=<bytes> log_bytes=<bytes>`. On shutdown the cache is closed last (every
//! cached write destaged to the image, the cache marked clean) and its counters logged.
//! A cache file formatted for a disk of another size, or of another size than `size`
//! says, is a configuration error (exit 2); a file with data but no cache superblock is
//! never formatted over, and a cache holding writes for an image that is gone is not
//! replayed onto a new one (exit 1).
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
//! - `unproven disk=<name> waiting for <what>` while the replica is not proven current
//!   (after every start with a peer: nothing is served from it, requests wait), and
//!   `serving disk=<name> proof=<handshake|witness|operator|only-writer|startup-timeout>`
//!   when it starts serving (see the README's failure section and `node.startup`).
//!
//! Operator actions without the management service: `--discard-my-data NAME` resolves
//! a split brain by making this node's replica of NAME the sync target on the next
//! connection; `--declare-current NAME` serves this node's replica of NAME alone at
//! once, without proof that it is current (a risk, logged as one); SIGUSR1 starts an online verify of every mirrored disk from this node.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Weak;
use std::time::Duration;

use clap::Parser;
use tracing::{error, info, warn};
use vsan::node::config::Config;
use vsan::node::{Node, StartError, StartOptions};
use vsan_cache::{CacheState, WriteBackCache};
use vsan_replica::MirroredDisk;
use vsan_replica::protocol::{Awaiting, Freshness, LinkState, SyncKind, SyncRole};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "vsan node daemon: serves the configured disks over NBD, iSCSI and vhost-user-blk"
)]
struct Args {
    /// Path of the node configuration (TOML).
    #[arg(long, short)]
    config: PathBuf,
    /// Resolve a split brain on disk NAME by discarding this node's changes: on the next
    /// connection this replica becomes the sync target. May be given more than once.
    #[arg(long, value_name = "NAME")]
    discard_my_data: Vec<String>,
    /// Declare this node's replica of disk NAME current at start: it serves alone until
    /// the peer connects, without waiting for proof. A risk, logged as one: only when
    /// the peer is known to be behind (or gone for good), since writes it acknowledged
    /// alone are not here. May be given more than once.
    #[arg(long, value_name = "NAME")]
    declare_current: Vec<String>,
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
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads())
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vsan-node: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let options = StartOptions {
        discard_my_data: args.discard_my_data,
        declare_current: args.declare_current,
    };
    match rt.block_on(run(config, options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(StartError::Config(msg) | StartError::AddressInUse(msg)) => {
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

async fn run(config: Config, options: StartOptions) -> Result<(), StartError> {
    let node = Node::start(&config, options).await?;
    let mut reporters = Vec::new();
    for disk in node.disks() {
        if let Some(cache) = &disk.cache {
            reporters.push(tokio::spawn(watch_cache(
                disk.name.clone(),
                std::sync::Arc::downgrade(cache),
            )));
        }
    }
    let mirrors: Vec<MirroredDisk> = node
        .disks()
        .iter()
        .filter_map(|d| d.mirror.clone())
        .collect();
    // Signal handlers before the ready lines: a signal sent as soon as the node says it
    // is ready must find them.
    let signals = Signals::new().map_err(StartError::Runtime)?;
    for line in node.ready_lines() {
        say(line);
    }
    info!(
        worker_threads = config.worker_threads(),
        "vsan-node ready ({})",
        if config.node.threads.is_some() {
            "worker threads from node.threads"
        } else {
            "worker threads: one per disk, at most one per core"
        }
    );
    // The mirrors' reports after the ready lines (a replica proven at once says
    // `serving` after `ready`); each compares with "nothing happened yet", so nothing
    // that came before is missed.
    for mirror in &mirrors {
        reporters.push(tokio::spawn(report(mirror.clone())));
    }
    signals.wait(&mirrors).await;
    drop(mirrors);
    for task in &reporters {
        task.abort();
    }
    for task in reporters {
        let _ = task.await;
    }
    node.shutdown()
        .await
        .map_err(|e| StartError::Runtime(e.context().to_string()))?;
    info!("vsan-node stopped cleanly");
    Ok(())
}

/// Say once on stdout (`problem disk=<name> ...`) when a disk's cache device fails: the
/// cache goes on in pass-through, and the log says what was lost.
async fn watch_cache(name: String, cache: Weak<WriteBackCache>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(state) = cache.upgrade().map(|c| c.state()) else {
            return;
        };
        match state {
            CacheState::Running => {}
            CacheState::Failed { lost_blocks } => {
                say(&format!(
                    "problem disk={name} cache device failed: now pass-through, \
                     lost_blocks={lost_blocks}"
                ));
                return;
            }
            CacheState::Closed => return,
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

/// Print a disk's resync progress and problems on stdout (see the module docs).
async fn report(disk: MirroredDisk) {
    let name = disk.name().to_string();
    let mut status = disk.watch_status();
    let mut last = status.borrow().clone();
    // The node started the disk before this task: compare the first status with one
    // where nothing has happened yet, so what already happened is said too.
    last.link = LinkState::Waiting;
    last.syncing = false;
    last.last_sync = None;
    last.last_problem = None;
    last.freshness = Freshness::Unproven {
        awaiting: Awaiting::Peer,
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
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
        match (now.freshness, last.freshness) {
            (Freshness::Current(proof), Freshness::Unproven { .. }) => {
                say(&format!("serving disk={name} proof={proof}"));
            }
            (Freshness::Unproven { awaiting }, _) if now.freshness != last.freshness => {
                say(&format!("unproven disk={name} waiting for {awaiting}"));
            }
            _ => {}
        }
        if now.link == LinkState::Connected && last.link != LinkState::Connected {
            say(&format!(
                "link disk={name} connected transport={}",
                now.link_transport.as_deref().unwrap_or("none")
            ));
        }
        last = now;
    }
}
