#!/usr/bin/env bash
# last_bucket.sh: DDP's last-bucket rule (DDPOptions::last_bucket_bytes, off by default) against PyTorch's
# buckets (last_bucket_bytes = 0), on three models, interleaved in one run (issue 29, target 6).
#
# Usage: benches/last_bucket.sh [MODEL...]   (or: benches/run.sh last-bucket; default models: mlp conv
#        milnce; markdown on stdout, progress on stderr)
# Env: BUILD_DIR (default <repo>/build), REPS (interleaved repetitions, default 3), WORLD (ranks, default 2),
#      LAST (the last-bucket caps in MiB compared, default "0 1").
#
# mlp and conv run `dtrain-bench ddp` (as benches/tune.sh does) with DTRAIN_TIMELINE, and their timelines
# are split by benches/ddp_breakdown.py: the exposed column is the time from the last gradient to the
# optimizer, communication that backward did not hide. Every dtrain-bench run checks its parameters
# against a one-process reference (wrong=0 or the script fails). milnce runs `milnce train --hidden 2048
# --embed 512` for 2 epochs on generated data: the mean step time of epoch 2. One compute thread per rank.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
reps=${REPS:-3}
world=${WORLD:-2}
read -r -a lasts <<<"${LAST:-0 1}"
models=("$@")
((${#models[@]})) || models=(mlp conv milnce)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
for f in dtrain-run dtrain-bench dtrain-trace milnce; do
  [[ -x $build/bin/$f ]] || { echo "last_bucket.sh: $build/bin/$f not found; build with: cmake --build $build -j2 --target dtrain-run dtrain-bench dtrain-trace milnce" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
cp "$build/bin/dtrain-run" "$build/bin/dtrain-bench" "$build/bin/dtrain-trace" "$build/bin/milnce" "$tmp/bin/"
bin=$tmp/bin
run=("$bin/dtrain-run" --standalone --nproc-per-node "$world")

echo "# DDP's last-bucket rule against PyTorch's buckets, world $world, $reps repetitions; $(date -u +%F)," \
     "load $(cut -d' ' -f1-3 /proc/loadavg) at start"
[[ " ${models[*]} " == *" milnce "* ]] && "$bin/milnce" gen-data --out "$tmp/data" >/dev/null 2>&1
: >"$tmp/results"
traces=()
for rep in $(seq 1 "$reps"); do
  for model in "${models[@]}"; do
    for last in "${lasts[@]}"; do
      case $model in
        mlp | conv)
          extra=(--steps 30 --batch 64)
          [[ $model == conv ]] && extra=(--model conv --steps 20 --batch 16)
          tl=$tmp/tl-$model-$last-$rep
          out=$(DTRAIN_TUNE=off DTRAIN_TIMELINE=$tl "${run[@]}" "$bin/dtrain-bench" ddp --progress off "${extra[@]}" \
            --last-bucket-mb "$last" 2>&1) || { echo "$out" >&2; echo "last_bucket.sh: $model $last failed" >&2; exit 1; }
          line=$(grep -o 'dtrain-ddp .*' <<<"$out")
          [[ $line == *" wrong=0/"* ]] || { echo "$out" >&2; echo "last_bucket.sh: $model $last: wrong parameters" >&2; exit 1; }
          ms=$(sed -n 's/.* ms_per_step=\([0-9.]*\) .*/\1/p' <<<"$line")
          "$bin/dtrain-trace" merge "$tl" >/dev/null
          traces+=("$model-last$last-rep$rep=$tl/trace.json") ;;
        milnce)
          rm -rf "$tmp/run"
          out=$(DTRAIN_TUNE=off "${run[@]}" "$bin/milnce" train --data "$tmp/data" --out "$tmp/run" --epochs 2 --no-eval \
            --no-progress --hidden 2048 --embed 512 --last-bucket-mb "$last" 2>&1) ||
            { echo "$out" >&2; echo "last_bucket.sh: milnce $last failed" >&2; exit 1; }
          ms=$(/usr/bin/python3 -c "import json,sys; l=[r for r in map(json.loads, open(sys.argv[1])) if r['kind'] == 'step' and r['epoch'] >= 1]; print(f'{1e3 * sum(r[\"step_s\"] for r in l) / len(l):.2f}')" "$tmp/run/metrics.jsonl") ;;
        *) echo "last_bucket.sh: unknown model $model (mlp, conv or milnce)" >&2; exit 2 ;;
      esac
      echo "$model $last $rep $ms" >>"$tmp/results"
      echo "last_bucket.sh: $model rep $rep last_bucket_mb=$last: $ms ms/step" >&2
    done
  done
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg) at the end"
/usr/bin/python3 - "$tmp/results" <<'EOF'
import collections, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = collections.defaultdict(list)
for model, last, rep, ms in rows:
    by[(model, last)].append(float(ms))
lasts = list(dict.fromkeys(r[1] for r in rows))
print()
print("| model | " + " | ".join(f"last {l} MiB: ms/step (median)" for l in lasts) + " | first / second |")
print("|---" * (len(lasts) + 2) + "|")
for m in dict.fromkeys(r[0] for r in rows):
    med = [statistics.median(by[(m, l)]) for l in lasts]
    print(f"| {m} | " + " | ".join(f"{x:.1f} ({' '.join(f'{v:.1f}' for v in by[(m, l)])})" for x, l in zip(med, lasts))
          + f" | {med[0] / med[-1]:.3f} |")
EOF
if ((${#traces[@]})); then
  echo
  echo "Where each dtrain-bench step went (benches/ddp_breakdown.py; ms, medians over steps, mean of the ranks):"
  echo
  /usr/bin/python3 "$here/ddp_breakdown.py" --buckets "${traces[@]}" | grep -v ' - '
fi
