//! Running `vsanctl` (the binary) against a node's management service, and reading
//! what it says.

use std::process::Command;
use std::time::Duration;

use super::{Node, TOOL_TIMEOUT, ToolOutput, run_command};

/// The `vsanctl` binary of this build.
pub const VSANCTL: &str = env!("CARGO_BIN_EXE_vsanctl");
/// The `[node]` line that turns the management service on.
pub const MGMT: &str = "mgmt = \"127.0.0.1:0\"\n";
/// How long a node may take to print its management address.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// `vsanctl --node <node> args...` with `env` set (and the caller's VSAN_MGMT* unset).
pub fn vsanctl_cmd(node: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(VSANCTL);
    if let Some(n) = node {
        cmd.arg("--node").arg(n);
    }
    cmd.args(args)
        .env_remove("VSAN_MGMT")
        .env_remove("VSAN_MGMT_TOKEN")
        .envs(env.iter().copied());
    cmd
}

/// Run vsanctl to its end.
pub fn vsanctl(node: &str, args: &[&str]) -> ToolOutput {
    run_command(vsanctl_cmd(Some(node), args, &[]), TOOL_TIMEOUT)
}

/// Run vsanctl and require exit 0.
pub fn vsanctl_ok(node: &str, args: &[&str]) -> ToolOutput {
    let out = vsanctl(node, args);
    out.assert_success();
    out
}

/// vsanctl's exit code (panics on a signal).
pub fn code(out: &ToolOutput) -> i32 {
    out.status
        .code()
        .unwrap_or_else(|| panic!("vsanctl died of a signal:\n{out}"))
}

/// Require exit 1 with `vsanctl: <CODE>: ...<message>` on stderr; returns that line.
pub fn assert_node_error(out: &ToolOutput, grpc_code: &str, message: &str) -> String {
    assert_eq!(code(out), 1, "expected exit 1 ({grpc_code}):\n{out}");
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("vsanctl: "))
        .unwrap_or_else(|| panic!("no `vsanctl: ` line on stderr:\n{out}"));
    assert!(
        line.starts_with(&format!("vsanctl: {grpc_code}: ")) && line.contains(message),
        "expected `vsanctl: {grpc_code}: ...{message}...`:\n{out}"
    );
    line.to_string()
}

/// Require exit 2 (bad usage) with `needle` on stderr.
pub fn assert_usage_error(out: &ToolOutput, needle: &str) {
    assert_eq!(code(out), 2, "expected exit 2 (usage):\n{out}");
    assert!(
        out.stderr.contains(needle),
        "no {needle:?} on stderr:\n{out}"
    );
}

/// The management address a node printed (`ready mgmt=<addr>`).
pub fn mgmt_addr(node: &Node) -> String {
    let line = node.wait_stdout(&["ready mgmt="], READY_TIMEOUT);
    super::field(&line, "mgmt").unwrap_or_else(|| panic!("no address in {line:?}"))
}
