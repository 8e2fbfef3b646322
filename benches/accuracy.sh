#!/usr/bin/env bash
# accuracy.sh: is accuracy kept by the remedies for slow links? (issue 12; docs/PERFORMANCE.md
# "Slow links: accuracy"). Runs dtrain-bench accuracy (a generated 10-class task whose held-out accuracy
# stays below about 91%, see benches/dtrain_bench/accuracy_bench.cc) for every configuration and seed,
# on 2 ranks of this machine, and prints per configuration the mean held-out accuracy over the seeds
# after the same number of samples, against its baseline:
#   hooks and local SGD   against fp32 DDP with SGD (momentum 0.9), batch 64 per rank
#   LARS at 4x and 8x     against that same SGD run (small batch)
#   LAMB at 4x and 8x     against Adam at the small batch
# Large batches use the linear scaling rule with a warm-up epoch (--scale-lr). The 16-bit hooks run with
# :always (on one host they would otherwise not compress; see docs/SLOW-LINKS.md).
# With --rig, each configuration then runs once more on the emulated cluster (2 hosts x 1 process, links
# at 1 Gbit/s; scripts/cluster.sh, needs root) and reports its training time to reach its baseline's
# mean accuracy minus 1 point.
#
#   benches/accuracy.sh [--seeds "1 2 3"] [--epochs 8] [--rig] [--out DIR] [--only NAME...]
#   benches/accuracy.sh --summarize DIR     (the tables of an earlier run's DIR, again)
# --only runs the named configurations alone (e.g. --only "sgd fp16 hook"; repeatable) into DIR, over
# what an earlier run left there.
# Needs a build (BUILD_DIR, default <repo>/build) and a quiet machine.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD_DIR:-$here/../build}
bin=$(cd "$build/bin" && pwd)
seeds="1 2 3" epochs=8 rig=0 out=/tmp/accuracy-$(date +%Y%m%d-%H%M%S) summarize=0 only=()
while (($#)); do
  case $1 in
    --seeds) seeds=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --rig) rig=1; shift ;;
    --out) out=$2; shift 2 ;;
    --only) only+=("$2"); shift 2 ;;
    --summarize) out=$2; summarize=1; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "accuracy.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
cores=$(getconf _NPROCESSORS_ONLN)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# name|baseline|arguments
configs=(
  "sgd fp32|-|--optimizer sgd"
  "sgd fp16 hook|sgd fp32|--optimizer sgd --hook fp16:always"
  "sgd bf16 hook|sgd fp32|--optimizer sgd --hook bf16:always"
  "sgd PowerSGD r4|sgd fp32|--optimizer sgd --hook powersgd:4:128"
  "sgd top-k 1%|sgd fp32|--optimizer sgd --hook topk:0.01"
  "sgd local SGD 8|sgd fp32|--optimizer sgd --local-sgd 8"
  "sgd 8x batch (no LARS)|sgd fp32|--optimizer sgd --batch 512 --scale-lr"
  "LARS 4x batch|sgd fp32|--optimizer lars --batch 256 --scale-lr"
  "LARS 8x batch|sgd fp32|--optimizer lars --batch 512 --scale-lr"
  "adam|-|--optimizer adam"
  "LAMB 4x batch|adam|--optimizer lamb --batch 256 --scale-lr"
  "LAMB 8x batch|adam|--optimizer lamb --batch 512 --scale-lr"
)
selected() {  # selected NAME: whether --only (if given) names it
  ((${#only[@]} == 0)) && return 0
  local n
  for n in "${only[@]}"; do [[ $n == "$1" ]] && return 0; done
  return 1
}
echo "# accuracy: seeds=($seeds) epochs=$epochs 2 ranks ($(date -u +%FT%TZ), $cores cores); raw outputs: $out"
for seed in $seeds; do
  ((summarize)) && break
  for c in "${configs[@]}"; do
    IFS='|' read -r name base args <<<"$c"
    selected "$name" || continue
    log="$out/${name// /_}_$seed.txt"
    # shellcheck disable=SC2086
    "$bin/dtrain-run" --standalone --nproc-per-node 2 "$bin/dtrain-bench" accuracy $args --epochs "$epochs" --seed "$seed" \
      --progress off >"$log" 2>&1 || echo "  $name seed $seed: failed, see $log" >&2
  done
done
summary() {  # summary [rig-times-dir | --targets]; --targets prints NAME|TARGET per baseline (its mean - 1 point)
  /usr/bin/python3 - "$out" "$epochs" "${1:-}" "${configs[@]}" <<'PY'
import glob, re, statistics, sys
out, epochs, rigdir, configs = sys.argv[1], sys.argv[2], sys.argv[3], [c.split("|") for c in sys.argv[4:]]
def acc(name):
    vals = []
    for f in sorted(glob.glob(f"{out}/{name.replace(' ', '_')}_*.txt")):
        m = re.search(r"final_acc=([\d.]+)", open(f).read())
        if m: vals.append(float(m.group(1)))
    return vals
accs = {n: acc(n) for n, _, _ in configs}
means = {n: (statistics.mean(v) if v else None) for n, v in accs.items()}
if rigdir == "--targets":
    for n, base, _ in configs:
        if base == "-" and means[n] is not None: print(f"{n}|{means[n] - 0.01}")
    sys.exit(0)
for f in sorted(glob.glob(f"{out}/*.txt")):  # the epochs the runs in DIR had (--summarize)
    m = re.search(r"dtrain-accuracy .*epochs=(\d+)", open(f).read())
    if m:
        epochs = m.group(1)
        break
print(f"\n| configuration | held-out accuracy after {epochs} epochs, mean (min-max) over seeds | baseline | difference | within 1 point |")
print("| --- | --- | --- | --- | --- |")
for n, base, _ in configs:
    v = accs[n]
    if not v:
        ran = glob.glob(f"{out}/{n.replace(' ', '_')}_*.txt")
        if ran: print(f"| {n} | failed (see {ran[0]}) | {base} | - | no |")
        continue
    row = f"| {n} | {100*means[n]:.2f}% ({100*min(v):.2f}-{100*max(v):.2f}, n={len(v)}) |"
    if base == "-":
        print(row + " (baseline) | - | - |"); continue
    d = 100 * (means[n] - means[base])
    print(row + f" {base} | {d:+.2f} | {'yes' if d >= -1 else 'no'} |")
if rigdir:
    print("\nOn the rig (2 hosts x 1, 1 Gbit/s), one run per configuration, seed 1: training time to reach the baseline's mean accuracy minus 1 point")
    print("\n| configuration | target | time to target | final accuracy | training time | bytes/step/rank |\n| --- | --- | --- | --- | --- | --- |")
    for n, base, _ in configs:
        f = f"{rigdir}/{n.replace(' ', '_')}.txt"
        try: t = open(f).read()
        except OSError: continue
        last = [l for l in t.splitlines() if "dtrain-accuracy" in l]
        t = last[-1] if last else ""
        g = lambda k: (re.search(k + r"=(\S+)", t) or [None, "-"])[1]
        target = means[n if base == "-" else base]
        print(f"| {n} | {100*target - 1:.2f}% | {g('time_to_target_s')} s | {g('final_acc')} | {g('train_s')} s | {g('bytes_per_step')} |")
PY
}
if ((summarize)); then
  if [[ -d $out/rig ]]; then summary "$out/rig"; else summary; fi
elif ((rig)); then
  mkdir -p "$out/rig"
  # Targets: each baseline's mean accuracy over the seeds, minus 1 point.
  declare -A target
  while IFS='|' read -r name t; do target[$name]=$t; done < <(summary --targets)
  for c in "${configs[@]}"; do
    IFS='|' read -r name base args <<<"$c"
    selected "$name" || continue
    t=${target[${base/#-/$name}]}
    # shellcheck disable=SC2086
    timeout -k 10 900 bash "$here/../scripts/cluster.sh" --hosts 2 --nproc-per-host 1 --gbit 1 --bin-dir "$bin" --timeout 850 \
      -- "$bin/dtrain-bench" accuracy $args --epochs "$epochs" --seed 1 --target "$t" --progress off \
      >"$out/rig/${name// /_}.txt" 2>&1 || echo "  rig: $name failed, see $out/rig/${name// /_}.txt" >&2
  done
  summary "$out/rig"
else
  summary
fi
