#!/usr/bin/env bash
# tune.sh: DDP's bucket-size tuning (DTRAIN_TUNE, DDPOptions::tune) against a sweep of hand settings, on
# three models, in one run (issue 29, target 7).
#
# Usage: benches/tune.sh [MODEL...]   (or: benches/run.sh tune; default models: mlp conv milnce; markdown on
#        stdout, progress on stderr)
# Env: BUILD_DIR (default <repo>/build), REPS (interleaved repetitions, default 3), WORLD (ranks, default 2),
#      CAPS (the hand settings' bucket caps in MiB, default "1 2 4 8 16 25 64"; first bucket 1 MiB).
#
# Models: mlp, conv and milnce, as benches/ddp_models.sh runs them.
# Each repetition runs every hand setting (DTRAIN_TUNE=off, --bucket-mb CAP) and the tuned run
# (DTRAIN_TUNE=refresh with an empty cache: it tunes during its first steps, dtrain-bench keeps warming up
# until tuning is done, milnce tunes within epoch 1), back to back, in this order. The tuned run's step
# time is measured after tuning, with the caps it chose. Every dtrain-bench run checks its parameters
# against a one-process reference (wrong=0 or the script fails). One compute thread per rank.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
reps=${REPS:-3}
world=${WORLD:-2}
read -r -a caps <<<"${CAPS:-1 2 4 8 16 25 64}"
models=("$@")
((${#models[@]})) || models=(mlp conv milnce)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
source "$here/ddp_models.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stage_models tune.sh

# one MODEL SETTING REP: runs one and appends "model setting rep ms chosen_mb" to $tmp/results.
one() {
  local model=$1 setting=$2 rep=$3 env=(DTRAIN_TUNE=off) args=() chosen
  if [[ $setting == tuned ]]; then
    env=(DTRAIN_TUNE=refresh DTRAIN_TUNE_CACHE="$tmp/cache-$model-$rep.tsv")
  else
    args=(--bucket-mb "$setting" --first-bucket-mb 1)
  fi
  run_model tune.sh "$model" "${env[@]}" -- "${args[@]}"
  if [[ $model != milnce ]]; then
    chosen=$(sed -n 's/.* bucket_mb=\([0-9.]*\) .*/\1/p' <<<"$model_line")
  elif [[ $setting == tuned ]]; then
    chosen=$(cut -f2 "$tmp/cache-$model-$rep.tsv" 2>/dev/null | tail -1)
    chosen=$(/usr/bin/python3 -c "import sys; print(f'{int(sys.argv[1]) / 2**20:g}' if sys.argv[1] else 'none')" "$chosen")
  else
    chosen=$setting
  fi
  echo "$model $setting $rep $model_ms $chosen" >>"$tmp/results"
  echo "tune.sh: $model rep $rep $setting: $model_ms ms/step (caps $chosen MiB)" >&2
}

echo "# DDP bucket-size tuning against hand settings, world $world, $reps repetitions; $(date -u +%F)," \
     "load $(cut -d' ' -f1-3 /proc/loadavg) at start"
: >"$tmp/results"
for rep in $(seq 1 "$reps"); do
  for model in "${models[@]}"; do
    for setting in "${caps[@]}" tuned; do one "$model" "$setting" "$rep"; done
  done
done
echo "load $(cut -d' ' -f1-3 /proc/loadavg) at the end"
/usr/bin/python3 - "$tmp/results" "${caps[@]}" <<'EOF'
import collections, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
caps = sys.argv[2:]
by = collections.defaultdict(list)
chosen = collections.defaultdict(list)
for model, setting, rep, ms, pick in rows:
    by[(model, setting)].append(float(ms))
    if setting == "tuned":
        chosen[model].append(pick)
models = list(dict.fromkeys(r[0] for r in rows))
print()
print("| model | " + " | ".join(f"{c} MiB" for c in caps) + " | tuned | tuned chose (MiB) | tuned / best | default (25) / tuned |")
print("|---" * (len(caps) + 5) + "|")
for m in models:
    med = {s: statistics.median(by[(m, s)]) for s in caps + ["tuned"] if by[(m, s)]}
    best = min((med[c], c) for c in caps if c in med)
    cells = [f"**{med[c]:.1f}**" if c == best[1] else f"{med[c]:.1f}" for c in caps]
    default = med.get("25")
    print(f"| {m} | " + " | ".join(cells) + f" | {med['tuned']:.1f} | {', '.join(chosen[m])} | "
          f"{med['tuned'] / best[0]:.3f} | " + (f"{default / med['tuned']:.3f}" if default else "-") + " |")
print()
print("Median ms per step of each setting over the repetitions (bold: the best hand setting). tuned / best > 1:")
print("the tuned run is slower than the best hand setting by that factor; default / tuned > 1: tuning beats")
print("PyTorch's default 25 MiB by that factor. Per repetition:")
for m in models:
    for s in caps + ["tuned"]:
        print(f"  {m} {s}: " + " ".join(f"{x:.1f}" for x in by[(m, s)]))
EOF
