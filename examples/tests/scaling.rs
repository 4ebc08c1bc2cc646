//! `vsan-bench scaling`, the core-count curve prepared for a machine with many cores and
//! nothing installed, runs here at one core per node: every process is pinned where the
//! table says, every request completes, and the reads check what they read.

use std::time::Duration;

use crate::common::{TestDir, run_tool};

/// The cpu lists a point's line names for its nodes: "(on cpus 0 and 1)" -> "0 and 1".
fn cpus_of(line: &str) -> &str {
    line.split("(on cpus ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no cpu list in {line}"))
}

#[test]
fn scaling_bench_pins_each_node_and_reports_every_point() {
    let dir = TestDir::new("scaling");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let work_dir = dir.path().display().to_string();
    let out = run_tool(
        env!("CARGO_BIN_EXE_vsan-bench"),
        &[
            "scaling",
            "--cores",
            "1",
            "--seconds",
            "0.5",
            "--size-mib",
            "16",
            "--work-dir",
            &work_dir,
        ],
        Duration::from_secs(120),
    );
    out.assert_success();
    let stdout = &out.stdout;
    // The single node ran on one core, both workloads, with I/O done.
    for w in ["randwrite", "randread"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with("single") && l.contains(w))
            .unwrap_or_else(|| panic!("no single-node {w} point:\n{stdout}"));
        assert!(
            cpus_of(line).parse::<usize>().is_ok(),
            "the single node is not pinned to one core: {line}"
        );
        let iops: f64 = line
            .split_whitespace()
            .zip(line.split_whitespace().skip(1))
            .find(|(_, unit)| *unit == "IOPS")
            .and_then(|(v, _)| v.parse().ok())
            .unwrap_or_else(|| panic!("no IOPS in {line}"));
        assert!(iops > 100.0, "{line}");
    }
    // The pair: each node on a core of its own where there are two.
    let mirror = stdout.lines().find(|l| l.starts_with("mirror"));
    if cores >= 2 {
        let line = mirror.unwrap_or_else(|| panic!("no mirrored point:\n{stdout}"));
        let sets: Vec<&str> = cpus_of(line).split(" and ").collect();
        assert!(
            sets.len() == 2
                && sets[0] != sets[1]
                && sets.iter().all(|c| c.parse::<usize>().is_ok()),
            "the nodes are not on one core each: {line}"
        );
    } else {
        assert!(
            stdout.contains("mirror at 1 cores per node: not run"),
            "{stdout}"
        );
    }
    assert!(stdout.contains("| server | cores per node |"), "{stdout}");
}
