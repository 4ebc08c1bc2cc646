//! The README's main job, `vsan-demo`, runs to the end, prints its summary and verifies
//! its data (shortened to a few seconds; the workload and checks are the same).

use std::process::Command;

#[test]
fn vsan_demo_exits_zero_and_prints_its_summary() {
    let out = Command::new(env!("CARGO_BIN_EXE_vsan-demo"))
        .args(["--seconds", "3", "--size-mib", "64"])
        .output()
        .expect("run vsan-demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "vsan-demo failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    for needle in [
        "op",
        "IOPS",
        "p50 (us)",
        "p99 (us)",
        "bytes written:",
        "verify:",
        "vsan-demo: OK",
    ] {
        assert!(
            stdout.contains(needle),
            "summary lacks {needle:?}:\n{stdout}"
        );
    }
    // The work happened: a non-trivial number of writes and reads, and no mismatches.
    let total: u64 = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("total"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .expect("a total line with an op count");
    assert!(total > 1000, "only {total} ops in 3 s:\n{stdout}");
    assert!(stdout.contains("(0 mismatches)"), "{stdout}");
}
