#!/bin/sh
# Prove the simulation can fail: build vsan with a deliberate defect (a patch in this
# directory) and run the simulation's seeds; each patch must be caught, with a seed.
#
#   proptests/sabotage/run.sh                      # every *.patch here
#   proptests/sabotage/run.sh no-peer-ack-wait.patch
#   SIM_SEEDS=2000 proptests/sabotage/run.sh ...   # fewer seeds (default 10000)
#   SIM_PARTS=scsi_seeds proptests/sabotage/run.sh scsi-pr-one-node.patch
#                                                  # only the SCSI runs (SIM_SCSI_SEEDS, default 2000)
#
# Each patch is applied to a clean checkout of HEAD in a temporary git worktree (the
# working tree is not touched), built in target/sabotage, and run; the script exits 1 if
# a patch is not caught. See TESTING.md.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(git -C "$here" rev-parse --show-toplevel)
seeds=${SIM_SEEDS:-10000}
tmp=$(mktemp -d)
git -C "$root" worktree add --quiet --detach "$tmp" HEAD
trap 'git -C "$root" worktree remove --force "$tmp"' EXIT INT TERM

if [ $# -eq 0 ]; then
    set -- $(cd "$here" && ls ./*.patch)
fi
status=0
for p in "$@"; do
    name=$(basename "$p")
    git -C "$tmp" checkout --quiet -- .
    git -C "$tmp" apply "$here/$name"
    echo "== $name: ${SIM_PARTS:-seeds} ($seeds plain seeds, ${SIM_SCSI_SEEDS:-2000} SCSI seeds)"
    out=$(cd "$tmp" && CARGO_TARGET_DIR="$root/target/sabotage" SIM_SEEDS="$seeds" \
        cargo test --quiet --release -p vsan-proptests --test simulation -- ${SIM_PARTS:-seeds} --nocapture 2>&1) && {
        echo "$out" | grep '^simulation:' || true
        echo "NOT CAUGHT: $name"
        status=1
        continue
    }
    echo "$out" | grep -m1 'failed:' || { echo "$out" | tail -20; status=1; continue; }
    echo "caught: $name"
done
exit $status
