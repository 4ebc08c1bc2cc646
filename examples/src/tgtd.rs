//! Debian's `tgt` (`tgtd`, the Linux SCSI target framework's user-space iSCSI target) on
//! loopback, exporting one file: the baseline the iSCSI benchmark and the conformance
//! figures in TESTING.md are measured against, and the target the interop tests' client
//! side is checked on.
//!
//! Each [`Tgtd`] runs its own daemon: its portal is `127.0.0.1:<port>` (a free port), and
//! its management socket is a private control port (`tgtd -C <n>`, the socket
//! `/var/run/tgtd/socket.<n>`), so several can run beside a system tgtd without
//! clashing. tgtd needs root (it creates `/var/run/tgtd`). The daemon is ended when the
//! value drops.
//!
//! tgt always has a controller at LUN 0; the file is LUN 1 ([`Tgtd::LUN`]).

use std::io;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long tgtd may take to listen and answer its management socket.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Where tgtd keeps its management sockets.
const SOCKET_DIR: &str = "/var/run/tgtd";

/// CHAP accounts a [`Tgtd`] target requires: the initiator's, and optionally the
/// target's own (mutual CHAP: the target proves itself with it).
#[derive(Debug, Clone, Default)]
pub struct TgtdChap {
    /// The account an initiator must log in with (`user`, `secret`).
    pub initiator: Option<(String, String)>,
    /// The account the target answers the initiator's challenge with.
    pub target: Option<(String, String)>,
}

/// A running `tgtd` exporting one file as LUN 1 of one target.
#[derive(Debug)]
pub struct Tgtd {
    child: Option<Child>,
    control_port: u16,
    portal: String,
    iqn: String,
    log: PathBuf,
}

impl Tgtd {
    /// The LUN the file is exported as (LUN 0 is tgt's controller).
    pub const LUN: u32 = 1;

    /// Start tgtd on a free loopback port, exporting `image` as LUN 1 of target `iqn`,
    /// open to every initiator (and requiring `chap`'s accounts). Its log goes to
    /// `log` (truncated).
    pub fn start(image: &Path, iqn: &str, chap: &TgtdChap, log: &Path) -> io::Result<Tgtd> {
        let control_port = free_control_port()?;
        let port = free_port()?;
        let portal = format!("127.0.0.1:{port}");
        let log_file = std::fs::File::create(log)?;
        let child = Command::new("tgtd")
            .arg("-f")
            .arg("-C")
            .arg(control_port.to_string())
            .arg("--iscsi")
            .arg(format!("portal={portal}"))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start tgtd: {e}")))?;
        let mut tgtd = Tgtd {
            child: Some(child),
            control_port,
            portal,
            iqn: iqn.to_string(),
            log: log.to_path_buf(),
        };
        tgtd.wait_ready()?;
        tgtd.configure(image, chap)?;
        Ok(tgtd)
    }

    /// The portal, `127.0.0.1:<port>`.
    pub fn portal(&self) -> &str {
        &self.portal
    }

    /// The target's name.
    pub fn iqn(&self) -> &str {
        &self.iqn
    }

    /// The daemon's pid (for its CPU time in `/proc/<pid>/stat`).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// `iscsi://127.0.0.1:<port>/<iqn>/1`, the URL libiscsi and qemu take.
    pub fn url(&self) -> String {
        format!("iscsi://{}/{}/{}", self.portal, self.iqn, Self::LUN)
    }

    /// [`Tgtd::url`] with CHAP credentials in it (`user%secret@`).
    pub fn url_with_chap(&self, user: &str, secret: &str) -> String {
        format!(
            "iscsi://{user}%{secret}@{}/{}/{}",
            self.portal,
            self.iqn,
            Self::LUN
        )
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `tgtadm -C <port> --lld iscsi <args>`, required to succeed.
    pub fn tgtadm(&self, args: &[&str]) -> io::Result<String> {
        let out = Command::new("tgtadm")
            .arg("-C")
            .arg(self.control_port.to_string())
            .args(["--lld", "iscsi"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot run tgtadm: {e}")))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(io::Error::other(format!(
                "tgtadm {} failed ({}): {}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    fn wait_ready(&mut self) -> io::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let exited = match self.child.as_mut() {
                Some(child) => child.try_wait()?,
                None => None,
            };
            if let Some(status) = exited {
                return Err(io::Error::other(format!(
                    "tgtd exited early ({status}); its log:\n{}",
                    self.log()
                )));
            }
            let listening = TcpStream::connect_timeout(
                &self
                    .portal
                    .parse()
                    .map_err(|e| io::Error::other(format!("portal {}: {e}", self.portal)))?,
                Duration::from_secs(1),
            )
            .is_ok();
            if listening && self.tgtadm(&["--op", "show", "--mode", "sys"]).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "tgtd did not listen on {} within {START_TIMEOUT:?}; its log:\n{}",
                    self.portal,
                    self.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn configure(&self, image: &Path, chap: &TgtdChap) -> io::Result<()> {
        let image = image
            .to_str()
            .ok_or_else(|| io::Error::other(format!("{} is not UTF-8", image.display())))?;
        self.tgtadm(&[
            "--op", "new", "--mode", "target", "--tid", "1", "-T", &self.iqn,
        ])?;
        self.tgtadm(&[
            "--op",
            "new",
            "--mode",
            "logicalunit",
            "--tid",
            "1",
            "--lun",
            &Self::LUN.to_string(),
            "-b",
            image,
        ])?;
        self.tgtadm(&[
            "--op", "bind", "--mode", "target", "--tid", "1", "-I", "ALL",
        ])?;
        if let Some((user, secret)) = &chap.initiator {
            self.tgtadm(&[
                "--op",
                "new",
                "--mode",
                "account",
                "--user",
                user,
                "--password",
                secret,
            ])?;
            self.tgtadm(&[
                "--op", "bind", "--mode", "account", "--tid", "1", "--user", user,
            ])?;
        }
        if let Some((user, secret)) = &chap.target {
            self.tgtadm(&[
                "--op",
                "new",
                "--mode",
                "account",
                "--user",
                user,
                "--password",
                secret,
            ])?;
            self.tgtadm(&[
                "--op",
                "bind",
                "--mode",
                "account",
                "--tid",
                "1",
                "--user",
                user,
                "--outgoing",
            ])?;
        }
        Ok(())
    }
}

impl Drop for Tgtd {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // tgtd ignores SIGTERM while it serves; the file is all it holds.
        let _ = child.kill();
        let _ = child.wait();
        for suffix in ["", ".lock"] {
            let _ =
                std::fs::remove_file(format!("{SOCKET_DIR}/socket.{}{suffix}", self.control_port));
        }
    }
}

/// A control port whose socket nobody holds (tgtd's own default is 0).
fn free_control_port() -> io::Result<u16> {
    let seed = std::process::id()
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
    for i in 0..1000u32 {
        // tgtd takes control ports up to 32767.
        let port = 1000 + (seed.wrapping_mul(2_654_435_761).wrapping_add(i) % 31_000) as u16;
        let sock = PathBuf::from(format!("{SOCKET_DIR}/socket.{port}"));
        let lock = PathBuf::from(format!("{SOCKET_DIR}/socket.{port}.lock"));
        if !sock.exists() && !lock.exists() {
            return Ok(port);
        }
    }
    Err(io::Error::other("no free tgtd control port"))
}

/// A free loopback port, taken from below the kernel's ephemeral range so no outgoing
/// connection is given it as its source port before tgtd binds it.
pub fn free_port() -> io::Result<u16> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let span = u32::from(low.saturating_sub(10_000)).max(1);
    let seed = std::process::id()
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
    for i in 0..span {
        let port = 10_000 + (seed.wrapping_mul(2_654_435_761).wrapping_add(i) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(io::Error::other(format!(
        "no free loopback port below {low}"
    )))
}
