#!/usr/bin/env bash
# MIL-NCE training throughput: dtrain's milnce against the same job in PyTorch
# (benches/peers/milnce_torch.py: DDP over gloo), side by side in one run, on the same generated data.
# Both sides run one compute thread per rank, BLAS included: the variables below reach dtrain's ranks
# through dtrain-run (which would set OMP_NUM_THREADS=1 anyway; OpenBLAS follows it) and the PyTorch
# ranks (benches/peers/peer_env.py sets and checks them too).
# Usage: benches/milnce.sh [WORLD...]   (default: 1 2; or: benches/run.sh milnce [WORLD...]).
# Env: BUILD_DIR, DATA_DIR, STEPS (PyTorch timed steps).
set -euo pipefail
cores=$(nproc)  # before the export: nproc reports OMP_NUM_THREADS when it is set
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
data=${DATA_DIR:-$root/data/milnce}
worlds=("$@")
((${#worlds[@]})) || worlds=(1 2)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[[ -f $data/meta.json ]] || "$build/bin/milnce" gen-data --out "$data" >/dev/null
source "$root/benches/peer_python.sh"
echo "# MIL-NCE training throughput (batch 32 per rank, K=4); $(date -u +%F) $cores cores; peer $PEER_TORCH"
for w in "${worlds[@]}"; do
  # dtrain: 3 epochs without evaluation; samples/s of the last two epochs (the first warms up), from
  # the step records of metrics.jsonl (docs/OBSERVABILITY.md): samples over the steps' wall time.
  "$build/bin/dtrain-run" --standalone --nproc-per-node "$w" "$build/bin/milnce" train --data "$data" \
    --out "$tmp/run$w" --epochs 3 --no-eval --no-progress >/dev/null
  ours=$(/usr/bin/python3 -c "import json,sys; l=[r for r in map(json.loads, open(sys.argv[1])) if r['kind'] == 'step' and r['epoch'] >= 1]; print(f'{sum(r[\"samples_per_s\"] * r[\"step_s\"] for r in l) / sum(r[\"step_s\"] for r in l):.1f}')" "$tmp/run$w/metrics.jsonl")
  theirs=$("$PEER_PYTHON" "$root/benches/peers/milnce_torch.py" "$data" "$w" --steps "${STEPS:-40}" | sed -n 's/.*samples_per_s=\([0-9.]*\).*/\1/p')
  ratio=$(/usr/bin/python3 -c "print(f'{$ours/$theirs:.2f}')")
  echo "world=$w dtrain_samples_per_s=$ours pytorch_samples_per_s=$theirs ratio=${ratio}x"
done
