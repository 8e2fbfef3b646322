#!/usr/bin/env bash
# Instructions per 4 KiB allreduce (2 ranks, callgrind), this checkout against another revision.
# Usage: bash scripts/instr_cost.sh [BASE_REV] [ITERS]      (default: 2d60e14, the commit before the
#        always-on fingerprint check; 2000 iterations). Needs valgrind; builds the base's comm library in
#        a temporary git worktree. Prints, per configuration, each rank's instructions per allreduce
#        ((Ir(ITERS) - Ir(0)) / ITERS, so start-up is not counted).
# Configurations: shm on 2 cores (direct path; waits spin briefly, so counts vary with timing: run it
# a few times), shm with both ranks on one core (no spinning: repeatable), tcp.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base_rev=${1:-2d60e14}
iters=${2:-2000}
work=$(mktemp -d /tmp/dtrain-instr.XXXXXX)
cleanup() { git -C "$root" worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT
command -v valgrind >/dev/null || { echo "instr_cost: valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
cmake --build "$root/build" --target dtrain_comm dtrain-run >/dev/null
git -C "$root" worktree add --detach "$work/base" "$base_rev" >/dev/null 2>&1
cmake -S "$work/base" -B "$work/base/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF >/dev/null
cmake --build "$work/base/build" --target dtrain_comm >/dev/null
for v in base head; do
  d=$root; [[ $v == base ]] && d=$work/base
  g++ -O2 -std=c++17 -I"$d/include" "$root/benches/allreduce_loop.cc" "$d/build/libdtrain_comm.a" \
    "$d/build/libdtrain_comm_base.a" -lfmt -lpthread -lrt -o "$work/loop_$v"
done
# total Ir of each rank's process for a run of n iterations
irs() {
  local v=$1 n=$2 pre=$3
  rm -f "$work"/cg.*
  env $pre "$root/build/bin/dtrain-run" --standalone --nproc-per-node 2 valgrind --tool=callgrind \
    --callgrind-out-file="$work/cg.%p" "$work/loop_$v" "$n" >/dev/null 2>&1
  for f in "$work"/cg.*; do grep -h '^summary:\|^totals:' "$f" | head -1 | awk '{print $2}'; done | sort -n
}
run() {
  local name=$1 pre=$2
  for v in base head; do
    mapfile -t z < <(irs $v 0 "$pre")
    mapfile -t n < <(irs $v "$iters" "$pre")
    printf '%-28s %-5s instructions per allreduce: rank a %6d  rank b %6d\n' "$name" $v \
      $(( (n[0] - z[0]) / iters )) $(( (n[1] - z[1]) / iters ))
  done
}
run "shm, 2 cores" ""
run "shm, 1 core (no spinning)" "taskset -c 0"
run "tcp, 2 cores" "DTRAIN_TRANSPORT=tcp"
