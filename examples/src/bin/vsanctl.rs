//! `vsanctl`: the operator's command line for a vsan node's management API
//! (`vsan.mgmt.v1`, gRPC; the node serves it on `node.mgmt`).
//!
//! ```text
//! vsanctl [--node ADDR] [--token T | --token-file F] [--tls-ca PEM] [--json] COMMAND
//!   status [DISK]            the node's disks (or one) as a table, with each disk's iSCSI
//!                            target and its sessions; --json for scripts
//!   list                     the node's disk names
//!   watch DISK               follow a resync or verify with a progress bar
//!   discard-my-data DISK     resolve a split brain: this node's changes go
//!   verify DISK [--wait]     start an online verify (and wait for its result)
//!   cancel-verify DISK       stop it
//!   set-rate DISK RATE       resync rate: "40MiB" (per second) or "dynamic"
//!   cache-mode DISK MODE     write-back | write-through | write-around | pass-through
//!   create DISK --size SIZE [--backing file|mem] [--peer ID] [--nbd ADDR]
//!          [--vhost-user PATH [--vhost-user-queues N] [--vhost-user-busy-poll-us US]]
//!   delete DISK [--force] [--remove-files]
//!   detach DISK / attach DISK   the local replica (I/O goes through the peer meanwhile)
//!   declare-current DISK     serve this node's unproven replica alone (a risk: only when
//!                            the peer is known to be behind)
//! ```
//!
//! The node is `--node`, else `$VSAN_MGMT`, else `127.0.0.1:7101`; the bearer token is
//! `--token`, else the first line of `--token-file`, else `$VSAN_MGMT_TOKEN`. With
//! `--tls-ca` the connection is TLS and the node's certificate must be signed by that CA
//! (and name the host of `--node`, or `--tls-domain`).
//!
//! `watch DISK` follows the resync or verify running on the disk; when none runs it waits
//! for the next one to start (after a peer comes back, say), follows that one, and exits
//! when it ends: 0 when it completed, 1 when it stopped short (the link broke, it was
//! cancelled) or the disk is not mirrored. `--no-wait` exits at once (0) when none runs;
//! `--timeout` gives up (1) after that long. It says when the link or the local state
//! changes meanwhile. On a terminal it draws a progress bar with a line for the node's
//! rate and ETA; otherwise (a pipe, a log) it prints a progress line per `--interval-ms`,
//! and with `--json` one status object per line. `verify DISK --wait` starts a verify and
//! follows it the same way, ending with the number of mismatches it found (and repaired
//! from this node).
//!
//! Exit codes: 0 done; 1 the node refused (`vsanctl: NOT_FOUND: node 1 has no disk
//! "nope"`: the gRPC code and the node's message), could not be reached, or the watched
//! pass did not complete; 2 bad usage (unknown command or option, a size that is not a
//! size, an unreadable token or CA file), found before anything is sent.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tonic::Status;
use vsan_examples::mgmt_client::{
    self as mc, Client, ConnectError, Target, describe_status, human_bytes, human_secs, kind_word,
    link_word, pass_name, role_word, summary_sentence, v1,
};

/// The node when neither `--node` nor `$VSAN_MGMT` names one.
const DEFAULT_NODE: &str = "127.0.0.1:7101";
/// How long a single request may take (a delete drains its NBD clients first).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Parser)]
#[command(
    name = "vsanctl",
    version,
    about = "Manage a vsan node: disk status, resync and verify progress, operator actions",
    after_help = "Exit codes: 0 done, 1 the node refused / could not be reached / the \
                  watched pass did not complete, 2 bad usage."
)]
struct Cli {
    /// The node's management address: host:port or http(s)://host:port
    /// [default: $VSAN_MGMT, else 127.0.0.1:7101]
    #[arg(long, global = true, value_name = "ADDR")]
    node: Option<String>,
    /// Bearer token the node requires [default: $VSAN_MGMT_TOKEN]
    #[arg(
        long,
        global = true,
        value_name = "TOKEN",
        conflicts_with = "token_file"
    )]
    token: Option<String>,
    /// File holding the bearer token (its first line)
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Use TLS and trust the node's certificate when this CA (PEM) signed it
    #[arg(long, global = true, value_name = "PEM")]
    tls_ca: Option<PathBuf>,
    /// The name the node's certificate must carry [default: the host of --node]
    #[arg(long, global = true, value_name = "NAME")]
    tls_domain: Option<String>,
    /// Print JSON instead of text (status, list, create, actions; watch: one status per
    /// line)
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the node's disks, or one disk with details, as a table
    Status {
        /// Only this disk (with details)
        disk: Option<String>,
    },
    /// List the node's disk names, one per line
    List,
    /// Follow a resync or verify (waiting for one to start) until it ends
    Watch {
        /// The disk's name
        disk: String,
        #[command(flatten)]
        follow: FollowArgs,
        /// Exit at once when no resync or verify runs
        #[arg(long)]
        no_wait: bool,
    },
    /// Resolve a split brain: discard this node's changes and resync from the peer
    DiscardMyData {
        /// The disk's name
        disk: String,
    },
    /// Start an online verify from this node (connected and in sync)
    Verify {
        /// The disk's name
        disk: String,
        /// Wait for it to end and print what it found
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        follow: FollowArgs,
    },
    /// Stop the online verify this node runs
    CancelVerify {
        /// The disk's name
        disk: String,
    },
    /// Set the resync rate: bytes per second ("40MiB", "40MiB/s") or "dynamic"
    SetRate {
        /// The disk's name
        disk: String,
        /// "40MiB" (per second), "40MiB/s", or "dynamic"
        #[arg(value_parser = rate_arg, value_name = "RATE")]
        rate: u64,
    },
    /// Switch a cached disk's cache mode
    CacheMode {
        /// The disk's name
        disk: String,
        /// The new mode
        #[arg(value_enum)]
        mode: CacheModeArg,
    },
    /// Create a disk and export it over NBD
    Create {
        /// The disk's name
        disk: String,
        /// Its size ("64MiB", "1GiB", bytes)
        #[arg(long, value_parser = size_arg)]
        size: u64,
        /// Where its data lives
        #[arg(long, value_enum, default_value_t = Backing::File)]
        backing: Backing,
        /// The peer node's id, for a mirrored disk
        #[arg(long, value_name = "ID")]
        peer: Option<u32>,
        /// NBD address to export it on ("127.0.0.1:0", "unix:/path")
        #[arg(long, value_name = "ADDR")]
        nbd: Option<String>,
        /// vhost-user-blk socket to export it on, for a VM on the node's host (Linux)
        #[arg(long, value_name = "PATH")]
        vhost_user: Option<String>,
        /// Its virtqueues (1 to 64; default 1)
        #[arg(long, value_name = "N", requires = "vhost_user",
              value_parser = clap::value_parser!(u32).range(1..=64))]
        vhost_user_queues: Option<u32>,
        /// Its busy-poll window per queue in microseconds (default: none)
        #[arg(long, value_name = "US", requires = "vhost_user")]
        vhost_user_busy_poll_us: Option<u64>,
    },
    /// Delete a disk (refused while NBD clients are connected, unless --force)
    Delete {
        /// The disk's name
        disk: String,
        /// Disconnect its NBD clients
        #[arg(long)]
        force: bool,
        /// Also remove its image and metadata files
        #[arg(long)]
        remove_files: bool,
    },
    /// Detach the local replica (I/O goes through the peer)
    Detach {
        /// The disk's name
        disk: String,
    },
    /// Attach the local replica again (it is resynced from the peer)
    Attach {
        /// The disk's name
        disk: String,
    },
    /// Declare this node's unproven replica current: it serves alone until the peer
    /// connects. A risk: writes the peer acknowledged alone are not here; only when the
    /// peer is known to be behind (or gone for good)
    DeclareCurrent {
        /// The disk's name
        disk: String,
    },
}

#[derive(Debug, Clone, clap::Args)]
struct FollowArgs {
    /// How often the node reports progress, in milliseconds
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    interval_ms: u32,
    /// Give up after this long ("90", "90s", "2m", "500ms") [default: never]
    #[arg(long, value_parser = duration_arg, value_name = "DURATION")]
    timeout: Option<Duration>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum CacheModeArg {
    WriteBack,
    WriteThrough,
    WriteAround,
    PassThrough,
}

impl CacheModeArg {
    fn wire(self) -> v1::CacheMode {
        match self {
            CacheModeArg::WriteBack => v1::CacheMode::WriteBack,
            CacheModeArg::WriteThrough => v1::CacheMode::WriteThrough,
            CacheModeArg::WriteAround => v1::CacheMode::WriteAround,
            CacheModeArg::PassThrough => v1::CacheMode::PassThrough,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backing {
    File,
    Mem,
}

fn size_arg(s: &str) -> Result<u64, String> {
    mc::parse_size(s)
}

fn rate_arg(s: &str) -> Result<u64, String> {
    mc::parse_rate(s)
}

/// `90` / `90s` (seconds), `500ms`, `2m`.
fn duration_arg(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || format!("{s:?} is not a duration such as \"90s\", \"2m\" or \"500ms\"");
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 || v * scale > 1e9 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(v * scale))
}

/// Why a command failed, and so how `vsanctl` exits.
#[derive(Debug)]
enum Failure {
    /// Bad usage found before anything was sent: exit 2.
    Usage(String),
    /// The node answered with an error: exit 1.
    Node(Status),
    /// Anything else (unreachable, timed out, the pass stopped short): exit 1.
    Other(String),
}

impl Failure {
    fn exit_code(&self) -> ExitCode {
        match self {
            Failure::Usage(_) => ExitCode::from(2),
            Failure::Node(_) | Failure::Other(_) => ExitCode::from(1),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Usage(m) | Failure::Other(m) => f.write_str(m),
            Failure::Node(s) => f.write_str(&describe_status(s)),
        }
    }
}

impl From<ConnectError> for Failure {
    fn from(e: ConnectError) -> Failure {
        match e {
            ConnectError::Usage(m) => Failure::Usage(m),
            ConnectError::Unreachable(m) => Failure::Other(m),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vsanctl: cannot start the tokio runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let tls = cli.tls_ca.is_some();
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("vsanctl: {f}");
            // A connection that breaks at once is often plain HTTP/2 sent to a TLS port.
            if let Failure::Node(s) = &f
                && std::error::Error::source(s).is_some()
                && !tls
            {
                eprintln!("vsanctl: (if the node serves TLS, give its CA with --tls-ca)");
            }
            f.exit_code()
        }
    }
}

/// An environment variable, when set and not empty.
fn env_value(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The node and credentials the options (or the environment) name.
fn target(cli: &Cli) -> Result<Target, Failure> {
    let node = cli
        .node
        .clone()
        .or_else(|| env_value("VSAN_MGMT"))
        .unwrap_or_else(|| DEFAULT_NODE.to_string());
    let token = match (&cli.token, &cli.token_file) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Failure::Usage(format!(
                    "cannot read the token file {}: {e}",
                    path.display()
                ))
            })?;
            let t = text.lines().next().unwrap_or("").trim().to_string();
            if t.is_empty() {
                return Err(Failure::Usage(format!(
                    "the token file {} holds no token",
                    path.display()
                )));
            }
            Some(t)
        }
        (None, None) => env_value("VSAN_MGMT_TOKEN").map(|t| t.trim().to_string()),
    };
    if cli.tls_domain.is_some() && cli.tls_ca.is_none() {
        return Err(Failure::Usage("--tls-domain needs --tls-ca".into()));
    }
    Ok(Target {
        node,
        tls_ca: cli.tls_ca.clone(),
        tls_domain: cli.tls_domain.clone(),
        token,
    })
}

/// One request, with a limit on how long the node may take to answer it.
async fn call<T>(
    request: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(CALL_TIMEOUT, request).await {
        Err(_) => Err(Failure::Other(format!(
            "the node did not answer within {}s",
            CALL_TIMEOUT.as_secs()
        ))),
        Ok(Err(s)) => Err(Failure::Node(s)),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}

fn print_json(v: &serde_json::Value) {
    match serde_json::to_string_pretty(v) {
        Ok(s) => println!("{s}"),
        // A Value always serializes; keep the output a line of JSON anyway.
        Err(_) => println!("{v}"),
    }
}

fn print_action(json: bool, r: v1::ActionResponse) {
    if json {
        print_json(&serde_json::json!({ "message": r.message }));
    } else {
        println!("{}", r.message);
    }
}

fn print_disk(json: bool, s: &v1::DiskStatus) {
    if json {
        print_json(&mc::disk_json(s));
    } else {
        print!(
            "{}",
            mc::format_table(&mc::status_rows(std::slice::from_ref(s)))
        );
        let details = mc::status_details(s);
        if !details.is_empty() {
            print!("\n{details}");
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let target = target(&cli)?;
    let json = cli.json;
    let mut client = mc::connect(&target).await?;
    let req = |name: &String| v1::DiskRequest { name: name.clone() };
    match &cli.command {
        Command::Status { disk: Some(d) } => {
            let s = call(client.get_disk_status(req(d))).await?;
            print_disk(json, &s);
        }
        Command::Status { disk: None } => {
            let r = call(client.list_disks(v1::ListDisksRequest {})).await?;
            if json {
                print_json(&mc::list_json(&r));
            } else if r.disks.is_empty() {
                println!("node {} has no disks", r.node_id);
            } else {
                println!("node {}", r.node_id);
                print!("{}", mc::format_table(&mc::status_rows(&r.disks)));
                for s in &r.disks {
                    if !s.last_problem.is_empty() {
                        println!("{}: last problem: {}", s.name, s.last_problem);
                    }
                }
                for s in &r.disks {
                    for line in mc::iscsi_lines(s).lines() {
                        println!("{}: {}", s.name, line.trim_start());
                    }
                    for line in mc::vhost_user_lines(s).lines() {
                        println!("{}: {}", s.name, line.trim_start());
                    }
                }
            }
        }
        Command::List => {
            let r = call(client.list_disks(v1::ListDisksRequest {})).await?;
            if json {
                print_json(&serde_json::json!({
                    "node_id": r.node_id,
                    "disks": r.disks.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
                }));
            } else {
                for d in &r.disks {
                    println!("{}", d.name);
                }
            }
        }
        Command::Watch {
            disk,
            follow,
            no_wait,
        } => watch(&mut client, disk, follow, *no_wait, json).await?,
        Command::DiscardMyData { disk } => {
            print_action(json, call(client.discard_my_data(req(disk))).await?);
        }
        Command::Verify {
            disk, wait: false, ..
        } => {
            print_action(json, call(client.start_verify(req(disk))).await?);
        }
        Command::Verify {
            disk,
            wait: true,
            follow,
        } => verify_and_wait(&mut client, disk, follow, json).await?,
        Command::CancelVerify { disk } => {
            print_action(json, call(client.cancel_verify(req(disk))).await?);
        }
        Command::SetRate { disk, rate } => {
            let r = v1::SetResyncRateRequest {
                name: disk.clone(),
                bytes_per_second: *rate,
            };
            print_action(json, call(client.set_resync_rate(r)).await?);
        }
        Command::CacheMode { disk, mode } => {
            let r = v1::SetCacheModeRequest {
                name: disk.clone(),
                mode: mode.wire() as i32,
            };
            print_action(json, call(client.set_cache_mode(r)).await?);
        }
        Command::Create {
            disk,
            size,
            backing,
            peer,
            nbd,
            vhost_user,
            vhost_user_queues,
            vhost_user_busy_poll_us,
        } => {
            let r = v1::CreateDiskRequest {
                name: disk.clone(),
                size: *size,
                backing: match backing {
                    Backing::File => "file",
                    Backing::Mem => "mem",
                }
                .into(),
                peer: peer.unwrap_or(0),
                nbd: nbd.clone().unwrap_or_default(),
                vhost_user: vhost_user.clone().unwrap_or_default(),
                vhost_user_queues: vhost_user_queues.unwrap_or(0),
                vhost_user_busy_poll_us: vhost_user_busy_poll_us.unwrap_or(0),
            };
            let s = call(client.create_disk(r)).await?;
            print_disk(json, &s);
        }
        Command::Delete {
            disk,
            force,
            remove_files,
        } => {
            let r = v1::DeleteDiskRequest {
                name: disk.clone(),
                force: *force,
                remove_files: *remove_files,
            };
            print_action(json, call(client.delete_disk(r)).await?);
        }
        Command::Detach { disk } => print_action(json, call(client.detach_local(req(disk))).await?),
        Command::Attach { disk } => print_action(json, call(client.attach_local(req(disk))).await?),
        Command::DeclareCurrent { disk } => {
            print_action(json, call(client.declare_current(req(disk))).await?)
        }
    }
    Ok(())
}

// ----- following a pass -----

/// The status stream of one disk.
struct Watch {
    stream: tonic::Streaming<v1::DiskStatus>,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
}

impl Watch {
    /// Open the stream and read the disk's status now.
    async fn open(
        client: &mut Client,
        disk: &str,
        follow: &FollowArgs,
    ) -> Result<(Watch, v1::DiskStatus), Failure> {
        let stream = call(client.watch_disk_status(v1::WatchRequest {
            name: disk.to_string(),
            interval_ms: follow.interval_ms,
        }))
        .await?;
        let mut w = Watch {
            stream,
            deadline: follow.timeout.map(|t| Instant::now() + t),
            timeout: follow.timeout,
        };
        let first = w.next().await?;
        Ok((w, first))
    }

    /// The next status; an error when the stream ends or the time is up.
    async fn next(&mut self) -> Result<v1::DiskStatus, Failure> {
        let next = self.stream.message();
        let r = match self.deadline {
            Some(d) => tokio::time::timeout_at(d.into(), next).await.map_err(|_| {
                Failure::Other(format!(
                    "gave up after {:?} (--timeout)",
                    self.timeout.unwrap_or_default()
                ))
            })?,
            None => next.await,
        };
        match r {
            Ok(Some(s)) => Ok(s),
            Ok(None) => Err(Failure::Other("the node ended the status stream".into())),
            Err(s) => Err(Failure::Node(s)),
        }
    }
}

/// Which passes to follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Any resync or verify.
    Any,
    /// Only a verify.
    Verify,
}

impl Want {
    fn matches(self, kind: i32) -> bool {
        self == Want::Any || kind_word(kind) == "verify"
    }
}

/// How a followed pass is shown.
trait View {
    /// Every status as it arrives.
    fn status(&mut self, _s: &v1::DiskStatus) {}
    /// Waiting for a pass to start.
    fn waiting(&mut self, s: &v1::DiskStatus, want: Want);
    /// Something changed that a person watching wants to know (the link, a problem).
    fn note(&mut self, line: String);
    fn started(&mut self, disk: &str, p: &v1::SyncProgress);
    fn progress(&mut self, disk: &str, p: &v1::SyncProgress);
    fn ended(&mut self, disk: &str, l: &v1::SyncSummary);
}

fn what_is_awaited(s: &v1::DiskStatus, want: Want) -> String {
    let what = match want {
        Want::Any => "a resync or verify",
        Want::Verify => "the verify",
    };
    format!(
        "{}: waiting for {what} to start (link {}, local {})",
        s.name,
        link_word(s.link),
        s.local_state
    )
}

fn started_line(disk: &str, p: &v1::SyncProgress) -> String {
    format!(
        "{disk}: {} started: this node is the {}, {} to go through",
        pass_name(p.kind),
        role_word(p.role),
        human_bytes(p.total_bytes)
    )
}

/// `37.5%  3 MiB of 8 MiB  4 MiB/s  eta 1s`
fn progress_figures(p: &v1::SyncProgress) -> String {
    let mut s = format!(
        "{:5.1}%  {} of {}",
        p.percent,
        human_bytes(p.done_bytes),
        human_bytes(p.total_bytes)
    );
    s += &format!("  {}/s", human_bytes(p.rate));
    if p.eta_s >= 0 {
        s += &format!("  eta {}", human_secs(p.eta_s as u64));
    }
    s
}

/// The last progress of a pass that ended: 100% when it completed.
fn final_progress(l: &v1::SyncSummary) -> v1::SyncProgress {
    let total = l.total_bytes;
    let done = if l.completed { total } else { l.done_bytes };
    let secs = (l.elapsed_ms as f64 / 1000.0).max(0.001);
    v1::SyncProgress {
        kind: l.kind,
        role: l.role,
        total_bytes: total,
        done_bytes: done,
        transferred_bytes: l.transferred_bytes,
        rate: (done as f64 / secs) as u64,
        eta_s: if l.completed { 0 } else { -1 },
        percent: if total == 0 || l.completed {
            100.0
        } else {
            done as f64 * 100.0 / total as f64
        },
    }
}

fn ended_line(disk: &str, l: &v1::SyncSummary) -> String {
    let mut s = format!("{disk}: {}", summary_sentence(l));
    if kind_word(l.kind) == "verify" && l.mismatches > 0 {
        s += " (repaired from the source)";
    }
    s
}

/// Plain lines, for pipes and logs: progress at most once per interval.
struct Lines {
    every: Duration,
    last: Option<Instant>,
}

impl View for Lines {
    fn waiting(&mut self, s: &v1::DiskStatus, want: Want) {
        println!("{}", what_is_awaited(s, want));
    }
    fn note(&mut self, line: String) {
        println!("{line}");
    }
    fn started(&mut self, disk: &str, p: &v1::SyncProgress) {
        println!("{}", started_line(disk, p));
        self.last = None;
    }
    fn progress(&mut self, disk: &str, p: &v1::SyncProgress) {
        if self.last.is_some_and(|t| t.elapsed() < self.every) {
            return;
        }
        self.last = Some(Instant::now());
        println!(
            "{disk}: {} ({}) {}",
            pass_name(p.kind),
            role_word(p.role),
            progress_figures(p)
        );
    }
    fn ended(&mut self, disk: &str, l: &v1::SyncSummary) {
        let p = final_progress(l);
        println!(
            "{disk}: {} ({}) {}",
            pass_name(p.kind),
            role_word(p.role),
            progress_figures(&p)
        );
        println!("{}", ended_line(disk, l));
    }
}

/// A progress bar with a rate line, on a terminal.
#[derive(Default)]
struct Bars {
    spinner: Option<ProgressBar>,
    bar: Option<ProgressBar>,
}

impl Bars {
    fn println(&self, line: &str) {
        match self.bar.as_ref().or(self.spinner.as_ref()) {
            Some(b) => b.println(line),
            None => println!("{line}"),
        }
    }

    fn rate_line(p: &v1::SyncProgress) -> String {
        let eta = if p.eta_s >= 0 {
            human_secs(p.eta_s as u64)
        } else {
            "?".into()
        };
        format!(
            "rate {}/s, {} transferred, eta {eta}",
            human_bytes(p.rate),
            human_bytes(p.transferred_bytes)
        )
    }
}

impl View for Bars {
    fn waiting(&mut self, s: &v1::DiskStatus, want: Want) {
        let sp = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout());
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} [{elapsed}]") {
            sp.set_style(style);
        }
        sp.set_message(what_is_awaited(s, want));
        sp.enable_steady_tick(Duration::from_millis(120));
        self.spinner = Some(sp);
    }
    fn note(&mut self, line: String) {
        self.println(&line);
    }
    fn started(&mut self, disk: &str, p: &v1::SyncProgress) {
        if let Some(sp) = self.spinner.take() {
            sp.finish_and_clear();
        }
        println!("{}", started_line(disk, p));
        let bar = ProgressBar::with_draw_target(Some(p.total_bytes), ProgressDrawTarget::stdout());
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix} [{bar:40.cyan/blue}] {percent:>3}%  {binary_bytes}/{binary_total_bytes}\n  {msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(format!(
            "{disk} {} ({})",
            pass_name(p.kind),
            role_word(p.role)
        ));
        self.bar = Some(bar);
    }
    fn progress(&mut self, _disk: &str, p: &v1::SyncProgress) {
        if let Some(b) = &self.bar {
            b.set_length(p.total_bytes);
            b.set_position(p.done_bytes);
            b.set_message(Bars::rate_line(p));
        }
    }
    fn ended(&mut self, disk: &str, l: &v1::SyncSummary) {
        if let Some(sp) = self.spinner.take() {
            sp.finish_and_clear();
        }
        let p = final_progress(l);
        match self.bar.take() {
            Some(b) => {
                b.set_length(p.total_bytes);
                b.set_position(p.done_bytes);
                b.set_message(Bars::rate_line(&p));
                if l.completed {
                    b.finish();
                } else {
                    b.abandon();
                }
            }
            None => println!(
                "{disk}: {} ({}) {}",
                pass_name(p.kind),
                role_word(p.role),
                progress_figures(&p)
            ),
        }
        println!("{}", ended_line(disk, l));
    }
}

/// One JSON status per line, nothing else.
struct JsonLines;

impl View for JsonLines {
    fn status(&mut self, s: &v1::DiskStatus) {
        println!("{}", mc::disk_json(s));
    }
    fn waiting(&mut self, _s: &v1::DiskStatus, _want: Want) {}
    fn note(&mut self, _line: String) {}
    fn started(&mut self, _disk: &str, _p: &v1::SyncProgress) {}
    fn progress(&mut self, _disk: &str, _p: &v1::SyncProgress) {}
    fn ended(&mut self, _disk: &str, _l: &v1::SyncSummary) {}
}

fn view(json: bool, follow: &FollowArgs) -> Box<dyn View> {
    if json {
        Box::new(JsonLines)
    } else if std::io::stdout().is_terminal() {
        Box::new(Bars::default())
    } else {
        Box::new(Lines {
            every: Duration::from_millis(u64::from(follow.interval_ms.max(1))),
            last: None,
        })
    }
}

/// Lines for what changed between two statuses that a person watching wants to know.
fn changes(prev: &v1::DiskStatus, s: &v1::DiskStatus) -> Vec<String> {
    let mut out = Vec::new();
    if prev.link != s.link {
        out.push(format!(
            "{}: link {} -> {}",
            s.name,
            link_word(prev.link),
            link_word(s.link)
        ));
    }
    if prev.local_state != s.local_state {
        out.push(format!(
            "{}: local replica {} -> {}",
            s.name, prev.local_state, s.local_state
        ));
    }
    if prev.freshness != s.freshness && !s.freshness.is_empty() {
        out.push(match s.freshness.as_str() {
            "current" => format!("{}: serving (proved by: {})", s.name, s.freshness_proof),
            _ => format!("{}: unproven, waiting for {}", s.name, s.awaiting),
        });
    }
    if prev.last_problem != s.last_problem && !s.last_problem.is_empty() {
        out.push(format!("{}: problem: {}", s.name, s.last_problem));
    }
    out
}

/// How [`follow_pass`] treats a disk with no pass running at first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Idle {
    /// Return at once.
    Return,
    /// Say so, and wait for one to start.
    Wait,
    /// Wait without saying so (a pass was just started).
    WaitQuietly,
}

/// Follow the stream from `first`: the pass running then, else the next one `want`
/// asks for; returns how it ended, or `None` when none runs and `idle` says return.
async fn follow_pass(
    w: &mut Watch,
    first: v1::DiskStatus,
    want: Want,
    idle: Idle,
    view: &mut dyn View,
) -> Result<Option<v1::SyncSummary>, Failure> {
    let baseline = first.last_sync;
    let disk = first.name.clone();
    view.status(&first);
    let mut running = match &first.sync {
        Some(p) if want.matches(p.kind) => {
            view.started(&disk, p);
            view.progress(&disk, p);
            true
        }
        _ if idle == Idle::Return => return Ok(None),
        _ => {
            if idle == Idle::Wait {
                view.waiting(&first, want);
            }
            false
        }
    };
    let mut prev = first;
    loop {
        let s = w.next().await?;
        view.status(&s);
        for line in changes(&prev, &s) {
            view.note(line);
        }
        let summary = s
            .last_sync
            .filter(|l| Some(l) != baseline.as_ref() && want.matches(l.kind));
        match &s.sync {
            Some(p) if running => view.progress(&disk, p),
            Some(p) if want.matches(p.kind) => {
                running = true;
                view.started(&disk, p);
                view.progress(&disk, p);
            }
            // A pass this watch does not follow (a resync while waiting for a verify).
            Some(_) => {}
            // The status says a pass runs but its progress is not there yet.
            None if s.syncing => {}
            None => {
                // Ended since the last update; or started and ended between two.
                if let Some(l) = summary {
                    view.ended(&disk, &l);
                    return Ok(Some(l));
                }
                if running {
                    return Err(Failure::Other(format!(
                        "{disk}: the pass ended and the node reports no result"
                    )));
                }
            }
        }
        prev = s;
    }
}

/// The exit of a followed pass: 0 when it completed.
fn pass_result(disk: &str, l: &v1::SyncSummary) -> Result<(), Failure> {
    if l.completed {
        Ok(())
    } else {
        Err(Failure::Other(format!(
            "{disk}: the {} stopped before it completed ({} of {})",
            pass_name(l.kind),
            human_bytes(l.done_bytes),
            human_bytes(l.total_bytes)
        )))
    }
}

async fn watch(
    client: &mut Client,
    disk: &str,
    follow: &FollowArgs,
    no_wait: bool,
    json: bool,
) -> Result<(), Failure> {
    let (mut w, first) = Watch::open(client, disk, follow).await?;
    if !first.mirrored {
        return Err(Failure::Other(format!(
            "{disk} is not mirrored: it has no resync or verify to watch"
        )));
    }
    let mut view = view(json, follow);
    let last = first.last_sync;
    let idle = if no_wait { Idle::Return } else { Idle::Wait };
    match follow_pass(&mut w, first, Want::Any, idle, view.as_mut()).await? {
        Some(l) => pass_result(disk, &l),
        None => {
            if !json {
                match &last {
                    Some(l) => println!(
                        "{disk}: no resync or verify running; the last one: {}",
                        summary_sentence(l)
                    ),
                    None => println!("{disk}: no resync or verify running"),
                }
            }
            Ok(())
        }
    }
}

/// Start a verify and follow it to its end. The stream is opened first, so a verify
/// that ends before the answer to StartVerify arrives is still seen.
async fn verify_and_wait(
    client: &mut Client,
    disk: &str,
    follow: &FollowArgs,
    json: bool,
) -> Result<(), Failure> {
    let (mut w, first) = Watch::open(client, disk, follow).await?;
    let started = call(client.start_verify(v1::DiskRequest {
        name: disk.to_string(),
    }))
    .await?;
    if !json {
        println!("{}", started.message);
    }
    let mut view = view(json, follow);
    // The first status is from before the start: wait for the verify it started.
    let mut first = first;
    first.sync = None;
    match follow_pass(
        &mut w,
        first,
        Want::Verify,
        Idle::WaitQuietly,
        view.as_mut(),
    )
    .await?
    {
        Some(l) => pass_result(disk, &l),
        None => Err(Failure::Other(format!("{disk}: the verify was not seen"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(duration_arg("90"), Ok(Duration::from_secs(90)));
        assert_eq!(duration_arg("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration_arg("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(duration_arg("500ms"), Ok(Duration::from_millis(500)));
        assert!(duration_arg("soon").is_err());
        assert!(duration_arg("-1").is_err());
    }

    #[test]
    fn bad_sizes_and_rates_are_usage_errors() {
        for args in [
            &["vsanctl", "create", "x", "--size", "banana"][..],
            &["vsanctl", "create", "x", "--size", "0"],
            &["vsanctl", "set-rate", "x", "fast"],
            &["vsanctl", "cache-mode", "x", "write-sometimes"],
            &["vsanctl", "watch", "x", "--timeout", "soon"],
        ] {
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
        }
        let ok = Cli::try_parse_from(["vsanctl", "set-rate", "x", "dynamic"]).unwrap();
        assert!(matches!(ok.command, Command::SetRate { rate: 0, .. }));
    }
}
