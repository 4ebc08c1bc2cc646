//! The README's main job, `vsan-demo`, runs to the end: two mirrored nodes under load,
//! per-node figures, the failure act (node 2 down, node 1 alone, node 2 back and
//! resynced), replicas compared byte for byte (shortened to a few seconds; the workload
//! and checks are the same).

use std::process::Command;

#[test]
fn vsan_demo_mirrors_two_nodes_and_prints_its_summary() {
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
        "two nodes mirroring",
        "IOPS",
        "p50 (us)",
        "p99 (us)",
        "bytes written:",
        "replicas identical (0 blocks differ)",
        "(0 wrong); 0 read mismatches; 0 I/O errors",
        "failure act: node 2 goes down",
        "node 2 comes back with its stale replica",
        "of a 64 MiB disk",
        "read back",
        "vsan-demo: OK",
    ] {
        assert!(
            stdout.contains(needle),
            "summary lacks {needle:?}:\n{stdout}"
        );
    }
    // Both nodes did real work.
    for node in ["node 1 ", "node 2 "] {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(node) && !l.contains("replica"))
            .unwrap_or_else(|| panic!("no figures for {node}:\n{stdout}"));
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(2)
            .take(2)
            .filter_map(|n| n.parse().ok())
            .collect();
        assert!(
            fields.len() == 2 && fields[0] > 100 && fields[1] > 100,
            "{line}"
        );
    }
    // Each replica's checksum is printed, and they agree.
    let sums: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("replica node"))
        .filter_map(|l| l.split("crc32 ").nth(1))
        .collect();
    assert_eq!(sums.len(), 2, "{stdout}");
    assert_eq!(sums[0], sums[1]);
    // The resync copied what node 1 wrote alone (its first sixteenth), not the disk.
    let line = stdout
        .lines()
        .find(|l| l.contains("resynced "))
        .unwrap_or_else(|| panic!("no resync line:\n{stdout}"));
    let bytes: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(bytes > 0 && bytes <= 4 << 20, "{line}");
}
