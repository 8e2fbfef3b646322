#!/usr/bin/env bash
# sparse_ps.sh: the sparse parameter server against what a PyTorch user would do, and against the TCP
# transport's own bandwidth, in one run (issue 29, target 3).
#
# Usage: benches/sparse_ps.sh        (or: benches/run.sh sparse-ps; markdown on stdout, progress on stderr)
# Env: BUILD_DIR (default <repo>/build), REPS (interleaved repetitions, default 3), STEPS (timed steps of
#      each run, default 100), ROWS (rows touched per step and worker, default 10000), WORLD (workers,
#      default 2).
#
# Each repetition runs, back to back:
#   dtrain-shm    `dtrain-bench ps --mode sparse`: WORLD workers and 1 server (dtrain-run --servers 1) on a
#                 1M x 64 float table, ROWS random rows a step: pullRows, a stand-in for backward, pushRows
#                 (plain SGD applied by the server), BSP; the server and workers talk over shm
#   dtrain-tcp    the same over the tcp transport (DTRAIN_TRANSPORT=tcp)
#   pull-tcp      the same with 1 worker over tcp: a pull that waits for no other worker; its bytes (the rows
#                 and their ids) over its time. Two figures: the step's pull, which the server answers once
#                 it has applied the worker's previous push (BSP orders them), and a pull alone (after the
#                 steps, pulls with nothing before them: what moving the rows costs)
#   tcp-p2p       `dtrain-bench broadcast --transport tcp` at world 2 of the pull's reply size: what the TCP
#                 transport moves between two ranks in a message of that size
#   torch         benches/peers/torch_sparse_ddp.py: DDP over Gloo on nn.Embedding(1M, 64, sparse=True),
#                 WORLD ranks, the same rows per step, SGD (its median step)
# Every side checks its results (dtrain's #wrong, the peer's closed-form SGD table); a failure fails the
# script. One compute thread per rank everywhere (OMP/OPENBLAS/MKL_NUM_THREADS=1).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
reps=${REPS:-3}
steps=${STEPS:-100}
rows=${ROWS:-10000}
world=${WORLD:-2}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
for f in dtrain-run dtrain-bench; do
  [[ -x $build/bin/$f ]] || { echo "sparse_ps.sh: $build/bin/$f not found; build with: cmake --build $build -j2 --target dtrain-run dtrain-bench" >&2; exit 2; }
done
# shellcheck source=benches/peer_python.sh
source "$here/peer_python.sh"
run=("$build/bin/dtrain-run" --standalone)
reply_bytes=$((rows * 64 * 4))

echo "# Sparse parameter server: dtrain against PyTorch sparse DDP over Gloo and against TCP, $reps repetitions"
echo
echo "- date: $(date -u '+%F %T') UTC; commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'); peer: $PEER_TORCH"
echo "- machine: $(getconf _NPROCESSORS_ONLN) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "- table 1000000 x 64 floats, $rows rows a step and worker, $world workers, $steps timed steps"
echo

ps_line() {  # ps_line WORKERS [ENV...]: "ms pull_ms push_ms pull_alone_ms" of a sparse PS run
  local n=$1 out
  shift
  out=$(env "$@" "${run[@]}" --nproc-per-node "$n" --servers 1 "$build/bin/dtrain-bench" ps --mode sparse \
          --steps "$steps" --rows "$rows" --dense-steps 1 2>/dev/null | sed -E 's/^\[rank [0-9]+\]: //')
  grep -q '^  #wrong 0' <<<"$out" || { echo "sparse_ps.sh: dtrain-bench ps failed or was wrong:"; echo "$out"; } >&2
  grep -q '^  #wrong 0' <<<"$out" || return 1
  sed -nE 's/.*ms_per_step=([0-9.]+) \(pull ([0-9.]+), push ([0-9.]+)\) pull_alone_ms=([0-9.]+).*/\1 \2 \3 \4/p' <<<"$out" | head -1
}

results=$(mktemp)
trap 'rm -f "$results"' EXIT
for r in $(seq 1 "$reps"); do
  echo "sparse_ps.sh: repetition $r" >&2
  read -r shm_ms shm_pull shm_push _ < <(ps_line "$world")
  read -r tcp_ms tcp_pull tcp_push _ < <(ps_line "$world" DTRAIN_TRANSPORT=tcp)
  read -r one_ms one_pull one_push one_alone < <(ps_line 1 DTRAIN_TRANSPORT=tcp)
  out=$("${run[@]}" --nproc-per-node 2 "$build/bin/dtrain-bench" broadcast --transport tcp \
          --min-bytes "$reply_bytes" --max-bytes "$reply_bytes" 2>/dev/null | sed -E 's/^\[rank [0-9]+\]: //')
  grep -q '^# 0 wrong elements in all' <<<"$out" || { echo "sparse_ps.sh: broadcast failed: $out" >&2; exit 1; }
  p2p_us=$(awk '$1 ~ /^[0-9]+$/ {print $4}' <<<"$out")
  peer=$("$PEER_PYTHON" "$here/peers/torch_sparse_ddp.py" "$world" "$steps" --rows "$rows" 2>&1) ||
    { echo "sparse_ps.sh: the PyTorch peer failed: $peer" >&2; exit 1; }
  torch_ms=$(sed -nE 's/^torch-sparse-ddp .* ms_per_step=([0-9.]+) .*/\1/p' <<<"$peer")
  echo "$r $shm_ms $shm_pull $shm_push $tcp_ms $tcp_pull $tcp_push $one_ms $one_pull $p2p_us $torch_ms $one_alone" >>"$results"
done

echo "| rep | dtrain shm: step (pull, push) ms | dtrain tcp: step (pull, push) ms | PyTorch sparse DDP ms | PyTorch / dtrain shm, tcp | 1-worker pull over tcp, in a step: ms, GB/s | alone: ms, GB/s | tcp p2p of ${reply_bytes} B: us, GB/s | pull / tcp: in a step, alone |"
echo "| ---: | --- | --- | ---: | --- | --- | --- | --- | --- |"
# The pull moves the rows (reply) and their ids (request).
awk -v rb="$reply_bytes" -v rows="$rows" '{
  pull_bytes = rb + rows * 8
  pull_gbs = pull_bytes / ($9 * 1e6); alone_gbs = pull_bytes / ($12 * 1e6); p2p_gbs = rb / ($10 * 1e3)
  printf "| %d | %.2f (%.2f, %.2f) | %.2f (%.2f, %.2f) | %.2f | %.2fx, %.2fx | %.2f, %.2f | %.2f, %.2f | %.0f, %.2f | %.2f, %.2f |\n",
    $1, $2, $3, $4, $5, $6, $7, $11, $11 / $2, $11 / $5, $9, pull_gbs, $12, alone_gbs, $10, p2p_gbs,
    pull_gbs / p2p_gbs, alone_gbs / p2p_gbs
}' "$results"
echo
med() { sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
printf 'Medians: PyTorch sparse DDP / dtrain PS = %.2fx (shm), %.2fx (tcp); 1-worker pull / tcp p2p = %.2f in a step, %.2f alone\n' \
  "$(awk '{print $11 / $2}' "$results" | med)" "$(awk '{print $11 / $5}' "$results" | med)" \
  "$(awk -v rb="$reply_bytes" -v rows="$rows" '{print ((rb + rows * 8) / ($9 * 1e6)) / (rb / ($10 * 1e3))}' "$results" | med)" \
  "$(awk -v rb="$reply_bytes" -v rows="$rows" '{print ((rb + rows * 8) / ($12 * 1e6)) / (rb / ($10 * 1e3))}' "$results" | med)"
echo
echo "- load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
