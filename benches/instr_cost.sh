#!/usr/bin/env bash
# Instructions per 4 KiB allreduce (2 ranks, callgrind): revision HEAD_REV against BASE_REV.
# Usage: benches/instr_cost.sh [BASE_REV] [HEAD_REV] [ITERS]   (or: benches/run.sh instr-cost ...)
#        (defaults: 2d60e14, the commit
#        before the always-on fingerprint check; HEAD; 2000 iterations). Needs valgrind. Builds each
#        revision's comm library in a temporary git worktree (committed code only) and prints, per
#        configuration, each rank's instructions per allreduce ((Ir(ITERS) - Ir(0)) / ITERS, so start-up
#        is not counted).
# The shm transport spins briefly before sleeping when ranks have a core each; how long it spins
# depends on timing, not on the code, so both builds are compiled with the spin phase off (kSpins = 0,
# the same one-line edit in each). Configurations: shm on 2 cores (the direct allreduce), shm with both
# ranks on one core (recursive doubling over the pair queues), tcp on 2 cores (how often a rank polls a
# socket that is not ready yet depends on timing: a few % either way between runs) and on one core
# (the ranks take turns: repeatable).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base_rev=${1:-2d60e14}
head_rev=${2:-HEAD}
iters=${3:-2000}
work=$(mktemp -d /tmp/dtrain-instr.XXXXXX)
cleanup() {
  for v in base head; do git -C "$root" worktree remove --force "$work/$v" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT
command -v valgrind >/dev/null || { echo "instr_cost: valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
cmake --build "$root/build" --target dtrain-run >/dev/null
for v in base head; do
  rev=$base_rev; [[ $v == head ]] && rev=$head_rev
  git -C "$root" worktree add --detach "$work/$v" "$rev" >/dev/null 2>&1
  # kSpins is defined in shm/transport.cc in older revisions, in shm/segment.h since issue 10.
  spins_file=$(grep -rl 'constexpr unsigned kSpins = ' "$work/$v/src/comm/transport/shm/" | head -1 || true)
  [[ -n $spins_file ]] || { echo "instr_cost: no kSpins in $rev" >&2; exit 1; }
  sed -i 's/constexpr unsigned kSpins = [0-9]*;/constexpr unsigned kSpins = 0;/' "$spins_file"
  grep -q 'kSpins = 0;' "$spins_file" || { echo "instr_cost: cannot turn the spin phase off in $rev" >&2; exit 1; }
  launcher=(); command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$work/$v" -B "$work/$v/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF "${launcher[@]}" >/dev/null
  cmake --build "$work/$v/build" --target dtrain_comm >/dev/null
  # The world's entry point is initWorld() since issue 10, init() before.
  init_fn=init; grep -rqs 'initWorld(' "$work/$v/include/dtrain/comm/" && init_fn=initWorld
  g++ -O2 -std=c++17 -DDTRAIN_LOOP_INIT="$init_fn" -I"$work/$v/include" "$root/benches/allreduce_loop.cc" "$work/$v/build/libdtrain_comm.a" \
    "$work/$v/build/libdtrain_comm_base.a" -lfmt -lpthread -lrt -o "$work/loop_$v"
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
run "shm, 2 cores (direct)" ""
run "shm, 1 core (pair queues)" "taskset -c 0"
run "tcp, 2 cores" "DTRAIN_TRANSPORT=tcp"
run "tcp, 1 core" "DTRAIN_TRANSPORT=tcp taskset -c 0"
