#!/usr/bin/env bash
# Issue 22's scaling curve (IOPS and CPU per I/O of one node and of a mirrored pair at
# 1, 2, 4, 8 and 16 cores per node) on a machine with many cores and nothing installed:
# `vsan-bench scaling` needs no fio, nbdkit or perf, only its own two programs.
#
#   examples/profile/scaling-device.sh prepare
#       here: release build, stripped copies of vsan-bench and vsan-node in target/device
#       (about 30 MB, small enough to travel with the working tree)
#   examples/profile/scaling-device.sh run [SECONDS]
#       there (the device tool's `run`, carrying target/device): the curve, printed and
#       written to $OUT/scaling.txt when $OUT is set
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
prepare)
    cargo build --release -p vsan-examples
    mkdir -p target/device
    strip -o target/device/vsan-bench target/release/vsan-bench
    strip -o target/device/vsan-node target/release/vsan-node
    ls -la target/device
    ;;
run)
    secs=${2:-4}
    out=${OUT:-/tmp}/scaling.txt
    {
        echo "machine: $(nproc) cores, $(uname -r)"
        grep -m1 'model name' /proc/cpuinfo || true
        target/device/vsan-bench scaling --seconds "$secs" --work-dir /tmp/vsan-scaling
    } 2>&1 | grep -v ' WARN ' | tee "$out"
    ;;
*)
    echo "usage: $0 prepare | run [SECONDS]" >&2
    exit 2
    ;;
esac
