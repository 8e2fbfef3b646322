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
# optimizer, communication that backward did not hide. The models run as benches/ddp_models.sh says; every
# dtrain-bench run checks its parameters against a one-process reference (wrong=0 or the script fails).
# One compute thread per rank.
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
source "$here/ddp_models.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stage_models last_bucket.sh dtrain-trace

echo "# DDP's last-bucket rule against PyTorch's buckets, world $world, $reps repetitions; $(date -u +%F)," \
     "load $(cut -d' ' -f1-3 /proc/loadavg) at start"
: >"$tmp/results"
traces=()
for rep in $(seq 1 "$reps"); do
  for model in "${models[@]}"; do
    for last in "${lasts[@]}"; do
      envs=(DTRAIN_TUNE=off)
      tl=$tmp/tl-$model-$last-$rep
      [[ $model == milnce ]] || envs+=(DTRAIN_TIMELINE="$tl")
      run_model last_bucket.sh "$model" "${envs[@]}" -- --last-bucket-mb "$last"
      if [[ $model != milnce ]]; then
        "$bin/dtrain-trace" merge "$tl" >/dev/null
        traces+=("$model-last$last-rep$rep=$tl/trace.json")
      fi
      echo "$model $last $rep $model_ms" >>"$tmp/results"
      echo "last_bucket.sh: $model rep $rep last_bucket_mb=$last: $model_ms ms/step" >&2
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
