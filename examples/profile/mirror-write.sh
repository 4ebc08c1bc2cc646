#!/usr/bin/env bash
# Where the CPU of a mirrored 4 KiB write goes, node by node (issue 22's breakdown).
#
# Runs `vsan-bench nbd --mirror --only mirror --workloads randwrite` (fio, QD32, default
# configuration), samples both vsan-node processes with `perf record --call-graph dwarf`
# while fio runs (perf's cpu-clock: this VM has no hardware counters), and splits the
# samples by what the stack shows (the system call a kernel sample is in; the module of
# the first vsan function above a user sample), scaled to the run's CPU us per write.
#
# `single` as the first argument profiles vsan's single-node export the same way, for
# the comparison.
#
# Needs: a release build (`cargo build --release -p vsan-examples`), fio, perf, python3,
# and root (or perf_event_paranoid <= 1).
# Usage: examples/profile/mirror-write.sh [single] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=mirror
if [ "${1:-}" = single ]; then mode=single; shift; fi
secs=${1:-3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
target/release/vsan-bench nbd --mirror --only "$mode" --workloads randwrite \
    --seconds $((secs + 6)) --size-mib 256 >"$out/bench.txt" 2>&1 &
bench=$!
# fio starts once the fresh pair's first sync is done.
for _ in $(seq 600); do pgrep -x fio >/dev/null && break; sleep 0.5; done
sleep 2
if [ $mode = mirror ]; then
    n1=$(pgrep -f 'vsan-node --config .*/node1.toml')
    n2=$(pgrep -f 'vsan-node --config .*/node2.toml')
    pids="$n1,$n2"
    names=("$n1=node 1 (exports the disk)" "$n2=node 2 (peer)")
else
    n1=$(pgrep -f 'vsan-node --config .*/node.toml')
    pids=$n1
    names=("$n1=single node")
fi
perf record -q -F 999 --call-graph dwarf,16384 -p "$pids" -o "$out/perf.data" -- sleep "$secs" 2>/dev/null
wait "$bench"
line=$(grep '^round 1 randwrite' "$out/bench.txt")
echo "$line"
cpu=$(awk '{for (i=1;i<=NF;i++) if ($i=="CPU") print $(i+1)}' <<<"$line")
perf script -i "$out/perf.data" -F pid,ip,sym --no-inline 2>/dev/null >"$out/stacks.txt"
python3 examples/profile/breakdown.py "$out/stacks.txt" "$cpu" "${names[@]}"
