//! Harness for the tests that run `vsan-node` as a real process.
//!
//! A test gets a fresh directory under the target's tmp dir, writes a config into it,
//! starts the daemon and learns each disk's NBD address from the `ready disk=<name>
//! nbd=<addr>` lines the daemon prints once it listens (ports are `127.0.0.1:0`, sockets
//! live in the directory, so tests never collide and never leave loopback). Outside tools
//! run with a time limit; every child process sits in a guard that ends it on drop, so a
//! failing assertion leaves nothing running.
// Each test module uses a different part of this module.
#![allow(dead_code)]

pub mod fio;
pub mod guest;
pub mod in_process;
pub mod iscsi;
pub mod mirror;
pub mod proxy;
pub mod vsanctl;
pub mod witness;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};

pub use rustix::process::Signal as Sig;

/// How long the daemon may take to print its ready lines.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long the daemon may take to drain, flush and exit after a signal.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// The default limit for one run of an outside tool.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(30);

/// The daemon under test, built by cargo for this test run.
pub const VSAN_NODE: &str = env!("CARGO_BIN_EXE_vsan-node");

/// Whether this tool is on PATH. When it is not: with `VSAN_REQUIRE_INTEROP=1` the test
/// fails (CI that promised the tools must not go green by skipping), otherwise it prints
/// a SKIP line and the caller returns early.
pub fn require_tool(name: &str) -> bool {
    if find_on_path(name).is_some() {
        return true;
    }
    if std::env::var("VSAN_REQUIRE_INTEROP").is_ok_and(|v| v == "1") {
        panic!("{name} is not installed, and VSAN_REQUIRE_INTEROP=1 requires it");
    }
    eprintln!("SKIP: {name} not installed");
    false
}

/// Whether this tool is on PATH (for optional extra checks; no SKIP line).
pub fn find_tool(name: &str) -> bool {
    find_on_path(name).is_some()
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// A fresh directory for one test, removed when dropped.
#[derive(Debug)]
pub struct TestDir {
    dir: tempfile::TempDir,
}

impl TestDir {
    /// A new directory under cargo's per-target tmp dir.
    pub fn new(tag: &str) -> TestDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{tag}-"))
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .expect("create a test directory under CARGO_TARGET_TMPDIR");
        TestDir { dir }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A path inside the directory.
    pub fn join(&self, p: impl AsRef<Path>) -> PathBuf {
        self.dir.path().join(p)
    }

    /// A Unix socket path inside the directory (checked against the sun_path limit).
    pub fn socket(&self, name: &str) -> PathBuf {
        let p = self.join(name);
        assert!(
            p.as_os_str().len() < 100,
            "socket path {} is too long for a Unix socket; use a shorter CARGO_TARGET_TMPDIR",
            p.display()
        );
        p
    }

    /// Where the daemon keeps its images in configs from [`node_section`].
    pub fn data_dir(&self) -> PathBuf {
        self.join("data")
    }

    /// Write `text` as this directory's `node.toml` and return its path.
    pub fn write_config(&self, text: &str) -> PathBuf {
        let path = self.join("node.toml");
        std::fs::write(&path, text).expect("write node.toml");
        path
    }
}

/// The image of `disk` in a node's data dir (see [`TestDir::data_dir`]).
pub fn image(dir: &TestDir, disk: &str) -> PathBuf {
    dir.data_dir().join(format!("{disk}.img"))
}

/// The metadata file of `disk` in a node's data dir.
pub fn meta(dir: &TestDir, disk: &str) -> PathBuf {
    dir.data_dir().join(format!("{disk}.meta"))
}

/// A TOML basic string holding `s`.
pub fn toml_str(s: impl AsRef<OsStr>) -> String {
    let s = s.as_ref().to_str().expect("test paths are UTF-8");
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A `[node]` section with id 1 and `data_dir` = `dir/data`.
pub fn node_section(dir: &TestDir) -> String {
    format!(
        "[node]\nid = 1\ndata_dir = {}\n\n",
        toml_str(dir.data_dir())
    )
}

/// A `[[disk]]` section; `size` is written as given (`"64MiB"` or `1000`).
pub fn disk_section(name: &str, size: &str, nbd: &str) -> String {
    format!(
        "[[disk]]\nname = {}\nsize = {size}\nnbd = {}\n\n",
        toml_str(name),
        toml_str(nbd)
    )
}

/// Send `sig` to `pid`, ignoring "no such process".
fn signal(pid: u32, sig: Signal) {
    let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) else {
        return;
    };
    let _ = kill_process(pid, sig);
}

/// Wait for `child` to exit; after `limit`, SIGKILL it and return `None`.
fn wait_timeout(child: Child, limit: Duration) -> Option<ExitStatus> {
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut child = child;
        let _ = tx.send(child.wait());
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(status)) => Some(status),
        Ok(Err(e)) => panic!("waiting for process {pid} failed: {e}"),
        Err(_) => {
            // The waiter has not reaped it, so the pid is still this child's.
            signal(pid, Signal::KILL);
            let _ = rx.recv_timeout(Duration::from_secs(10));
            None
        }
    }
}

/// A child process that is ended when the guard drops: first `graceful` (if any), then,
/// if it lingers, SIGKILL.
#[derive(Debug)]
pub struct ProcessGuard {
    child: Option<Child>,
    graceful: Option<Signal>,
}

impl ProcessGuard {
    /// Guard `child`; on drop send `graceful` first, if given.
    pub fn new(child: Child, graceful: Option<Signal>) -> ProcessGuard {
        ProcessGuard {
            child: Some(child),
            graceful,
        }
    }

    /// The child, while it is still guarded.
    pub fn child_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("process already reaped")
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("process already reaped").id()
    }

    /// Send a signal.
    pub fn signal(&self, sig: Signal) {
        signal(self.pid(), sig);
    }

    /// Wait up to `limit` for it to exit; `None` if it had to be killed.
    pub fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.take().expect("process already reaped");
        wait_timeout(child, limit)
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        let Some(child) = self.child.take() else {
            return;
        };
        let limit = match self.graceful {
            Some(sig) => {
                signal(child.id(), sig);
                Duration::from_secs(5)
            }
            None => {
                signal(child.id(), Signal::KILL);
                Duration::from_secs(10)
            }
        };
        let _ = wait_timeout(child, limit);
    }
}

/// Collects a pipe into a string on a thread, so a chatty child never blocks on it.
#[derive(Debug)]
struct Drain {
    text: Arc<Mutex<Vec<u8>>>,
    /// Disconnects when the pipe has been read to its end.
    done: mpsc::Receiver<()>,
}

impl Drain {
    fn new(mut pipe: impl Read + Send + 'static) -> Drain {
        let text = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&text);
        let (tx, done) = mpsc::channel::<()>();
        thread::spawn(move || {
            let _done = tx;
            let mut buf = [0u8; 8192];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => sink
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .extend_from_slice(&buf[..n]),
                }
            }
        });
        Drain { text, done }
    }

    /// What has arrived so far.
    fn snapshot(&self) -> String {
        let bytes = self.text.lock().unwrap_or_else(|e| e.into_inner());
        strip_ansi(&String::from_utf8_lossy(&bytes))
    }

    /// Everything, once every writer has closed the pipe (or `limit` passed: a stray
    /// grandchild may still hold it).
    fn finish(&mut self, limit: Duration) -> String {
        let _ = self.done.recv_timeout(limit);
        self.snapshot()
    }
}

/// `s` without terminal colour sequences (ESC [ ... letter).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The lines of `pipe`, sent on the returned channel by a thread until the pipe ends or
/// the receiver is dropped.
pub fn line_channel(pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// What an outside program did.
#[derive(Debug)]
pub struct ToolOutput {
    /// The command line, for messages.
    pub command: String,
    /// How it exited.
    pub status: ExitStatus,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl ToolOutput {
    /// stdout and stderr together.
    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// Panic (showing everything) unless it exited 0.
    pub fn assert_success(&self) -> &ToolOutput {
        assert!(self.status.success(), "command failed:\n{self}");
        self
    }
}

impl fmt::Display for ToolOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "$ {}", self.command)?;
        writeln!(f, "exit: {}", self.status)?;
        writeln!(f, "--- stdout ---\n{}", self.stdout.trim_end())?;
        write!(f, "--- stderr ---\n{}", self.stderr.trim_end())
    }
}

/// Run `program args...` to completion within `limit`; panics if it cannot start or
/// runs too long (it is killed first).
pub fn run_tool<S: AsRef<OsStr>>(program: &str, args: &[S], limit: Duration) -> ToolOutput {
    let mut cmd = Command::new(program);
    cmd.args(args);
    run_command(cmd, limit)
}

/// Run a prepared command to completion within `limit` (stdin is /dev/null).
pub fn run_command(mut cmd: Command, limit: Duration) -> ToolOutput {
    let command = describe(&cmd);
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{command}`: {e}"));
    let mut out = Drain::new(child.stdout.take().expect("stdout is piped"));
    let mut err = Drain::new(child.stderr.take().expect("stderr is piped"));
    let status = wait_timeout(child, limit);
    let stdout = out.finish(Duration::from_secs(5));
    let stderr = err.finish(Duration::from_secs(5));
    match status {
        Some(status) => ToolOutput {
            command,
            status,
            stdout,
            stderr,
        },
        None => panic!(
            "`{command}` ran longer than {limit:?} and was killed\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
        ),
    }
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A running `vsan-node`.
#[derive(Debug)]
pub struct Node {
    process: ProcessGuard,
    stderr: Drain,
    /// Every stdout line so far (the ready lines, then `sync ...` / `problem ...` reports).
    stdout: Arc<Mutex<Vec<String>>>,
    addrs: HashMap<String, String>,
    /// The replication listener from `ready replication=<addr>`, when it printed one.
    replication: Option<String>,
    config: PathBuf,
}

/// How a node ended.
#[derive(Debug)]
pub struct Stopped {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its whole stderr (the log), colours removed.
    pub log: String,
}

impl Node {
    /// Write `config` into `dir`, start `vsan-node` on it and wait until it has printed a
    /// ready line for each of `disks`.
    pub fn start(dir: &TestDir, config: &str, disks: &[&str]) -> Node {
        Node::start_inner(dir, config, disks, false, &[])
    }

    /// [`Node::start`] for a config with `node.listen`: also waits for the
    /// `ready replication=<addr>` line (see [`Node::replication`]).
    pub fn start_listening(dir: &TestDir, config: &str, disks: &[&str]) -> Node {
        Node::start_inner(dir, config, disks, true, &[])
    }

    /// [`Node::start`] with `args` on the command line after `--config <path>`.
    pub fn start_with_args(dir: &TestDir, config: &str, disks: &[&str], args: &[&str]) -> Node {
        Node::start_inner(dir, config, disks, false, args)
    }

    /// [`Node::start_listening`] with `args` on the command line after `--config <path>`.
    pub fn start_listening_with_args(
        dir: &TestDir,
        config: &str,
        disks: &[&str],
        args: &[&str],
    ) -> Node {
        Node::start_inner(dir, config, disks, true, args)
    }

    fn start_inner(
        dir: &TestDir,
        config: &str,
        disks: &[&str],
        replication: bool,
        args: &[&str],
    ) -> Node {
        let config = dir.write_config(config);
        let mut cmd = Command::new(VSAN_NODE);
        cmd.arg("--config")
            .arg(&config)
            .args(args)
            .current_dir(dir.path())
            // The assertions read the info-level log; do not let the caller's env hide it.
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {VSAN_NODE}: {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = Drain::new(child.stderr.take().expect("stderr is piped"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut node = Node {
            process: ProcessGuard::new(child, Some(Signal::TERM)),
            stderr,
            stdout: Arc::clone(&lines),
            addrs: HashMap::new(),
            replication: None,
            config,
        };

        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line.clone());
                // The receiver is gone once the node is ready; keep collecting.
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + READY_TIMEOUT;
        while disks.iter().any(|d| !node.addrs.contains_key(*d))
            || (replication && node.replication.is_none())
        {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some((disk, addr)) = parse_ready(&line) {
                        node.addrs.insert(disk, addr);
                    } else if let Some(addr) = parse_ready_replication(&line) {
                        node.replication = Some(addr);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "vsan-node printed no ready line for all of {disks:?}{} within \
                     {READY_TIMEOUT:?} (got {:?}, replication {:?})\n--- log ---\n{}",
                    if replication { " and replication" } else { "" },
                    node.addrs,
                    node.replication,
                    node.stderr.snapshot()
                ),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = node.process.wait(STOP_TIMEOUT);
                    panic!(
                        "vsan-node closed stdout before it was ready for {disks:?}{} (got {:?}, \
                         replication {:?}); exit {status:?}\n--- log ---\n{}",
                        if replication { " and replication" } else { "" },
                        node.addrs,
                        node.replication,
                        node.stderr.finish(Duration::from_secs(5))
                    )
                }
            }
        }
        node
    }

    /// The replication listener's address from `ready replication=<addr>`; panics if the
    /// node printed none (start it with [`Node::start_listening`] to be sure it has).
    pub fn replication(&self) -> &str {
        self.replication
            .as_deref()
            .expect("no `ready replication=` line (is node.listen set?)")
    }

    /// The address the daemon printed for `disk`: `127.0.0.1:PORT` or `unix:/path`.
    pub fn addr(&self, disk: &str) -> &str {
        self.addrs
            .get(disk)
            .unwrap_or_else(|| panic!("no ready line for disk {disk}"))
    }

    /// A URI selecting `disk` by the empty export name (the only disk on its address):
    /// `nbd://127.0.0.1:PORT`, or `nbd+unix:///<disk>?socket=<path>` for a Unix socket.
    pub fn uri(&self, disk: &str) -> String {
        let addr = self.addr(disk);
        match addr.strip_prefix("unix:") {
            Some(path) => format!("nbd+unix:///{disk}?socket={path}"),
            None => format!("nbd://{addr}"),
        }
    }

    /// A URI naming `disk` as the export.
    pub fn uri_named(&self, disk: &str) -> String {
        let addr = self.addr(disk);
        match addr.strip_prefix("unix:") {
            Some(path) => format!("nbd+unix:///{disk}?socket={path}"),
            None => format!("nbd://{addr}/{disk}"),
        }
    }

    /// The config file it runs on.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        self.stderr.snapshot()
    }

    /// Its stdout lines so far.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// Wait until a stdout line contains every one of `needles`; returns it. Panics
    /// (showing stdout and the log) after `limit`.
    pub fn wait_stdout(&self, needles: &[&str], limit: Duration) -> String {
        self.wait_stdout_after(0, needles, limit)
    }

    /// Like [`Node::wait_stdout`], looking only at lines after the first `skip`.
    pub fn wait_stdout_after(&self, skip: usize, needles: &[&str], limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let lines = self.stdout_lines();
            if let Some(l) = lines
                .iter()
                .skip(skip)
                .find(|l| needles.iter().all(|n| l.contains(n)))
            {
                return l.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no stdout line with {needles:?} within {limit:?}\n--- stdout ---\n{}\n--- log ---\n{}",
                lines.join("\n"),
                self.log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many lines of the log so far contain `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.log().lines().filter(|l| l.contains(needle)).count()
    }

    /// Wait until at least `n` lines of the log contain `needle`; panics (showing the log)
    /// after `limit`.
    pub fn wait_log_count(&self, needle: &str, n: usize, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.log_count(needle) < n {
            assert!(
                Instant::now() < deadline,
                "no {n} lines with `{needle}` in the log within {limit:?}:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until the log contains `needle`; see [`Node::wait_log_count`].
    pub fn wait_log(&self, needle: &str, limit: Duration) {
        self.wait_log_count(needle, 1, limit);
    }

    /// The node's pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The CPU time (user + system) the node's process has used so far.
    pub fn cpu(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .expect("read /proc/<pid>/stat");
        // The fields after the command name (which may hold spaces) in parentheses.
        let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        // USER_HZ is 100 on Linux.
        Duration::from_millis(ticks * 10)
    }

    /// Send `sig` and wait for the daemon to exit; panics if it takes longer than
    /// [`STOP_TIMEOUT`] (it is killed first).
    pub fn stop(mut self, sig: Signal) -> Stopped {
        self.process.signal(sig);
        let status = self.process.wait(STOP_TIMEOUT);
        let log = self.stderr.finish(Duration::from_secs(5));
        match status {
            Some(status) => Stopped { status, log },
            None => panic!(
                "vsan-node did not exit within {STOP_TIMEOUT:?} of {sig:?}\n--- log ---\n{log}"
            ),
        }
    }

    /// Stop with `sig` and require a clean exit (status 0).
    pub fn stop_clean(self, sig: Signal) -> Stopped {
        let stopped = self.stop(sig);
        assert!(
            stopped.status.success(),
            "exit {}\n{}",
            stopped.status,
            stopped.log
        );
        stopped
    }
}

/// `ready disk=<name> nbd=<addr>` → (name, addr).
fn parse_ready(line: &str) -> Option<(String, String)> {
    let rest = line.trim().strip_prefix("ready ")?;
    let mut disk = None;
    let mut nbd = None;
    for field in rest.split_whitespace() {
        if let Some(v) = field.strip_prefix("disk=") {
            disk = Some(v.to_string());
        } else if let Some(v) = field.strip_prefix("nbd=") {
            nbd = Some(v.to_string());
        }
    }
    Some((disk?, nbd?))
}

/// `ready replication=<addr>` → addr.
fn parse_ready_replication(line: &str) -> Option<String> {
    let rest = line.trim().strip_prefix("ready ")?;
    rest.split_whitespace()
        .find_map(|f| f.strip_prefix("replication="))
        .map(str::to_string)
}

/// Run `vsan-node` on `config` expecting it to exit by itself (a refused config).
pub fn run_node_to_exit(dir: &TestDir, config: &str) -> ToolOutput {
    let path = dir.write_config(config);
    let mut cmd = Command::new(VSAN_NODE);
    cmd.arg("--config")
        .arg(&path)
        .current_dir(dir.path())
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1");
    run_command(cmd, READY_TIMEOUT)
}

/// Panic at the first byte where `got` differs from `want`, naming the offset.
pub fn assert_same_bytes(got: &[u8], want: &[u8], what: &str) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} (got {:#04x}, want {:#04x})",
            got[i], want[i]
        );
    }
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: lengths differ (got {}, want {})",
        got.len(),
        want.len()
    );
}

/// Read `len` bytes at `offset` of a file.
pub fn read_file_range(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("cannot open {}: {e}", path.display()));
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).unwrap_or_else(|e| {
        panic!(
            "cannot read {len} bytes at {offset} of {}: {e}",
            path.display()
        )
    });
    buf
}

/// The file at `path` holds every one of `regions` (`what` names it in a failure, which
/// also names the region).
pub fn assert_file_holds<'a>(
    path: &Path,
    regions: impl IntoIterator<Item = &'a Region>,
    what: &str,
) {
    for r in regions {
        let got = read_file_range(path, r.offset, r.len as usize);
        assert_same_bytes(
            &got,
            &vec![r.byte; r.len as usize],
            &format!("{what} at {r:?}"),
        );
    }
}

/// A pattern write or read: `len` bytes of `byte` at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// The pattern byte.
    pub byte: u8,
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Region {
    /// A region of `len` bytes of `byte` at `offset`.
    pub const fn new(byte: u8, offset: u64, len: u64) -> Region {
        Region { byte, offset, len }
    }

    /// The qemu-io command that writes it.
    pub fn write(&self) -> String {
        format!("write -P {:#04x} {} {}", self.byte, self.offset, self.len)
    }

    /// The qemu-io command that reads and checks it.
    pub fn read(&self) -> String {
        format!("read -P {:#04x} {} {}", self.byte, self.offset, self.len)
    }

    /// What qemu-io prints for a completed write / read of this region.
    pub fn wrote_line(&self) -> String {
        format!("wrote {0}/{0} bytes at offset {1}", self.len, self.offset)
    }

    pub fn read_line(&self) -> String {
        format!("read {0}/{0} bytes at offset {1}", self.len, self.offset)
    }
}

/// `qemu-io -f raw <uri> -c <cmd>...`, one connection for all commands.
pub fn qemu_io(uri: &str, cmds: &[String]) -> ToolOutput {
    qemu_io_within(uri, cmds, TOOL_TIMEOUT)
}

/// [`qemu_io`] within `limit`.
pub fn qemu_io_within(uri: &str, cmds: &[String], limit: Duration) -> ToolOutput {
    let mut args = vec!["-f".to_string(), "raw".to_string(), uri.to_string()];
    for c in cmds {
        args.push("-c".to_string());
        args.push(c.clone());
    }
    run_tool("qemu-io", &args, limit)
}

/// [`qemu_io`] required to exit 0 without a failed pattern or any error.
pub fn qemu_io_checked(uri: &str, cmds: &[String]) -> ToolOutput {
    qemu_io_checked_within(uri, cmds, TOOL_TIMEOUT)
}

/// [`qemu_io_checked`] within `limit`.
pub fn qemu_io_checked_within(uri: &str, cmds: &[String], limit: Duration) -> ToolOutput {
    let out = qemu_io_within(uri, cmds, limit);
    let lower = out.text().to_lowercase();
    assert!(
        !lower.contains("pattern verification failed")
            && !lower.contains("error")
            && !lower.contains("failed"),
        "qemu-io reported a problem:\n{out}"
    );
    out.assert_success();
    out
}

/// Write `regions` with one checked qemu-io run; each write must be reported done.
pub fn qemu_io_writes(uri: &str, regions: &[Region]) {
    qemu_io_writes_within(uri, regions, TOOL_TIMEOUT);
}

/// [`qemu_io_writes`] within `limit`.
pub fn qemu_io_writes_within(uri: &str, regions: &[Region], limit: Duration) {
    let out = qemu_io_checked_within(
        uri,
        &regions.iter().map(Region::write).collect::<Vec<_>>(),
        limit,
    );
    for r in regions {
        assert!(
            out.stdout.contains(&r.wrote_line()),
            "missing {r:?}:\n{out}"
        );
    }
}

/// Read and check `regions` with one checked qemu-io run; each read must be reported done.
pub fn qemu_io_reads(uri: &str, regions: &[Region]) {
    let out = qemu_io_checked(uri, &regions.iter().map(Region::read).collect::<Vec<_>>());
    for r in regions {
        assert!(out.stdout.contains(&r.read_line()), "missing {r:?}:\n{out}");
    }
}

/// A checked qemu-io `flush`.
pub fn qemu_io_flush(uri: &str) {
    qemu_io_checked(uri, &["flush".to_string()]);
}

/// The value of `key=<value>` in a report line (`sync disk=vol0 done transferred=123`).
pub fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_string))
}

/// A numeric field of a report line; panics naming the line when it is missing.
pub fn field_u64(line: &str, key: &str) -> u64 {
    field(line, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric `{key}=` in {line:?}"))
}

/// `target/<profile>`, where cargo put this test's binary (`.../deps/<test>-<hash>`):
/// the built libraries are in its `deps/`, the pkg-config files beside it.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("{} is not in target/<profile>/deps", exe.display()))
}
