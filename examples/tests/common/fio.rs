//! fio over NBD (the nbd engine), and the check that a run was clean.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::{ToolOutput, run_command};

/// `fio --ioengine=nbd --uri=<uri> <args>` in `dir`, within `limit`.
pub fn fio(dir: &Path, uri: &str, args: &[String], limit: Duration) -> ToolOutput {
    let mut cmd = Command::new("fio");
    cmd.current_dir(dir)
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--output-format=normal")
        .args(args);
    run_command(cmd, limit)
}

/// fio exited 0, every job reported `err= 0`, and nothing failed verification.
pub fn assert_fio_clean(out: &ToolOutput) {
    out.assert_success();
    let text = out.text();
    for bad in [
        "verify failed",
        "bad magic",
        "bad header",
        "fio: io_u error",
    ] {
        assert!(!text.contains(bad), "fio reported `{bad}`:\n{out}");
    }
    assert!(text.contains("err= 0"), "no clean job summary:\n{out}");
}

/// Owned strings from `args`.
pub fn s(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}
