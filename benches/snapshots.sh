#!/usr/bin/env bash
# snapshots.sh: what peer-memory snapshots (milnce train --snapshot-every N, dtrain/snapshot.h) cost a
# training step, measured side by side in the same run.
#
# Usage: benches/snapshots.sh [--quick]   (markdown on stdout, progress on stderr)
#   MIL-NCE on WORLD ranks (env WORLD, default 2) under `dtrain-run --standalone` (whose agent serves the
#   snapshot store), EPOCHS epochs (default 12), no evaluation. REPS repetitions (default 3; --quick: 1),
#   each running, one after another: no checkpoints at all, --snapshot-every 5, --snapshot-every 1, and
#   for comparison disk checkpoints (--checkpoint-every 5, no snapshots). Per configuration: the median over repetitions of the mean step time (rank 0's
#   metrics.jsonl, the first epoch left out as warm-up), its ratio to no snapshots, and rank 0's own
#   account ("peer snapshots: ..." line: time on the training thread and in the background, bytes).
#   One compute thread per rank.
# The binaries are copied into a temporary directory first (a rebuild cannot swap them mid-run).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
reps=${REPS:-3}
world=${WORLD:-2}
epochs=${EPOCHS:-12}
[[ ${1:-} == --quick ]] && reps=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
log() { echo "snapshots.sh: $*" >&2; }
for b in milnce dtrain-run; do
  [[ -x $build/bin/$b ]] || { log "no $build/bin/$b (cmake --build $build --target milnce dtrain-run)"; exit 2; }
done
tmp=$(mktemp -d /tmp/dtrain-snapbench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cp "$build/bin/milnce" "$build/bin/dtrain-run" "$tmp/"
"$tmp/milnce" gen-data --out "$tmp/data" --videos 1200 --eval-videos 20 --seed 3 >/dev/null
declare -A extra=([none]="--no-checkpoints" [every5]="--no-checkpoints --snapshot-every 5"
                  [every1]="--no-checkpoints --snapshot-every 1" [disk5]="--checkpoint-every 5")
configs=(none every5 every1 disk5)
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= reps; r++)); do
  for c in "${configs[@]}"; do
    out=$tmp/$c.r$r
    "$tmp/dtrain-run" --standalone --nproc-per-node "$world" "$tmp/milnce" train --data "$tmp/data" --out "$out" \
      --epochs "$epochs" --batch 16 --no-eval --no-progress ${extra[$c]} \
      >"$out.log" 2>&1 || { tail -20 "$out.log" >&2; log "$c failed"; exit 1; }
    log "repetition $r $c done"
  done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)
/usr/bin/python3 - "$tmp" "$reps" "${configs[@]}" <<'EOF'
import json, re, statistics, sys
tmp, reps, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def step_ms(path):
    steps = [json.loads(l) for l in open(path) if '"kind":"step"' in l.replace(' ', '')]
    first_epoch = min(s["epoch"] for s in steps)
    times = [s["step_s"] for s in steps if s["epoch"] != first_epoch]
    return 1e3 * sum(times) / len(times)
med = {c: statistics.median(step_ms(f"{tmp}/{c}.r{r}/metrics.jsonl") for r in range(1, reps + 1)) for c in configs}
print("| snapshots | step (ms, median of means) | vs none | rank 0's account (last repetition) |")
print("| --- | ---: | ---: | --- |")
for c in configs:
    line = ""
    for l in open(f"{tmp}/{c}.r{reps}.log"):
        if "peer snapshots:" in l:
            line = re.sub(r"^.*peer snapshots: ", "", l.strip())
    print(f"| {c} | {med[c]:.2f} | {med[c] / med['none']:.3f} | {line or '-'} |")
EOF
echo
echo "world $world, $epochs epochs of 1200 clips, batch 16 per rank, $reps repetition(s); load average $load_start at the start, $load_end at the end"
