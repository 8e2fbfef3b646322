#!/usr/bin/env bash
# Before/after: the allreduce (shm and tcp, 2 ranks, 4 KiB to 64 MiB) and DDP (reference MLP, 2 ranks)
# benchmarks of two builds, interleaved run by run (base, head, base, head, ...) so that the machine's
# drift hits both alike; prints per size the median time of each and the ratio before/after
# (>= 1: head at least as fast). One compute thread per rank, BLAS included.
# Usage: benches/run.sh compare BASE_BIN_DIR HEAD_BIN_DIR [REPS=5]   (or benches/compare.sh ...)
#   each BIN_DIR holds dtrain-run and dtrain-bench (copy them: a rebuild must not replace them mid-run)
# Env: SECONDS_PER_SIZE: timed work per allreduce size (dtrain-bench --seconds; default: the bench's own,
#   a short run); 1 or more steadies the large sizes on a noisy machine.
#   BASE_ENV / HEAD_ENV: variables for one side's runs (space-separated NAME=VALUE), e.g. the same
#   build with and without the timeline: HEAD_ENV=DTRAIN_TIMELINE=/tmp/tl benches/compare.sh build/bin build/bin
#   MAX_BYTES: the largest allreduce (default 64M; 4K measures the small-message latency alone).
set -euo pipefail
base=$1 head=$2 reps=${3:-5}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for rep in $(seq "$reps"); do
  for v in base head; do
    dir=${!v}
    envs=BASE_ENV; [[ $v == head ]] && envs=HEAD_ENV
    read -r -a side_env <<<"${!envs:-}"
    for tr in shm tcp; do
      env "${side_env[@]}" "$dir/dtrain-run" --standalone --nproc-per-node 2 "$dir/dtrain-bench" allreduce --transport "$tr" \
        --min-bytes 4K --max-bytes "${MAX_BYTES:-64M}" --factor 4 ${SECONDS_PER_SIZE:+--seconds $SECONDS_PER_SIZE} >"$out/ar_${tr}_${v}_$rep.txt" 2>&1
    done
    env "${side_env[@]}" "$dir/dtrain-run" --standalone --nproc-per-node 2 "$dir/dtrain-bench" ddp --steps 20 >"$out/ddp_${v}_$rep.txt" 2>&1
  done
done
/usr/bin/python3 - "$out" "$reps" <<'PY'
import re, statistics, sys, glob
out, reps = sys.argv[1], int(sys.argv[2])
def rows(path):
    r = {}
    for line in open(path):
        m = re.match(r"\[rank 0\]:\s+(\d+)\s+\d+\s+\S+\s+([\d.]+)\s", line)
        if m: r[int(m.group(1))] = float(m.group(2))
        if "#wrong" not in line and re.search(r"[1-9]\d* wrong elements", line): sys.exit(f"{path}: wrong elements")
    return r
worst = 9.0
for tr in ("shm", "tcp"):
    print(f"\nallreduce {tr}, 2 ranks: median time_us over {reps} interleaved runs")
    print("| size | before | after | before/after |\n| ---: | ---: | ---: | ---: |")
    b = [rows(f"{out}/ar_{tr}_base_{i}.txt") for i in range(1, reps + 1)]
    h = [rows(f"{out}/ar_{tr}_head_{i}.txt") for i in range(1, reps + 1)]
    for size in sorted(b[0]):
        mb = statistics.median(x[size] for x in b); mh = statistics.median(x[size] for x in h)
        worst = min(worst, mb / mh)
        print(f"| {size} | {mb:.1f} | {mh:.1f} | {mb / mh:.2f} |")
def step(path):
    for line in open(path):
        m = re.search(r"ms_per_step=([\d.]+)", line)
        if m:
            if not re.search(r"wrong=0/", line): sys.exit(f"{path}: wrong gradients: {line}")
            return float(m.group(1))
    sys.exit(f"{path}: no ms_per_step:\n" + open(path).read()[-2000:])
mb = statistics.median(step(f"{out}/ddp_base_{i}.txt") for i in range(1, reps + 1))
mh = statistics.median(step(f"{out}/ddp_head_{i}.txt") for i in range(1, reps + 1))
worst = min(worst, mb / mh)
print(f"\nDDP reference MLP, 2 ranks: median ms_per_step {mb:.1f} before, {mh:.1f} after, before/after {mb / mh:.2f}")
print(f"\nworst before/after ratio: {worst:.2f}")
PY
