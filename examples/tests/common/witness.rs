//! `vsan-witness` as a real process: started on `127.0.0.1:0`, its address read from the
//! `ready witness=<addr>` line it prints once it listens.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use vsan_replica::witness::WitnessClient;

use super::{ProcessGuard, READY_TIMEOUT, STOP_TIMEOUT, Sig, TestDir, line_channel};

/// The witness, built by cargo for this test run.
pub const VSAN_WITNESS: &str = env!("CARGO_BIN_EXE_vsan-witness");

/// A running `vsan-witness`, ended (SIGTERM, then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Witness {
    process: ProcessGuard,
    addr: String,
    log: PathBuf,
}

impl Witness {
    /// Start it on `127.0.0.1:0` (with `--state state` if given) and wait for its ready
    /// line. Its log is appended to `witness.log` in `dir`.
    pub fn start(dir: &TestDir, state: Option<&Path>) -> Witness {
        let log = dir.join("witness.log");
        let log_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open witness.log");
        let mut cmd = Command::new(VSAN_WITNESS);
        cmd.args(["--listen", "127.0.0.1:0"])
            .current_dir(dir.path())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        if let Some(state) = state {
            cmd.arg("--state").arg(state);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {VSAN_WITNESS}: {e}"));
        let stdout = child.stdout.take().expect("stdout is piped");
        let process = ProcessGuard::new(child, Some(Sig::TERM));
        let rx = line_channel(stdout);
        let line = rx.recv_timeout(READY_TIMEOUT).unwrap_or_else(|e| {
            panic!(
                "vsan-witness printed no ready line ({e})\n--- log ---\n{}",
                read_log(&log)
            )
        });
        let addr = line
            .strip_prefix("ready witness=")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Witness { process, addr, log }
    }

    /// The address it listens on.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// A client speaking for node `node`.
    pub fn client(&self, node: u32) -> WitnessClient {
        WitnessClient::new(self.addr.clone(), node)
    }

    /// SIGTERM it and require a clean exit.
    pub fn stop(mut self) {
        self.process.signal(Sig::TERM);
        let status: Option<ExitStatus> = self.process.wait(STOP_TIMEOUT);
        let status = status.unwrap_or_else(|| {
            panic!(
                "vsan-witness ignored SIGTERM\n--- log ---\n{}",
                read_log(&self.log)
            )
        });
        assert!(
            status.success(),
            "vsan-witness exited with {status}\n--- log ---\n{}",
            read_log(&self.log)
        );
    }
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}
