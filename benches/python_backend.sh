#!/usr/bin/env bash
# dtrain's torch.distributed backend (python/) against Gloo, from Python, on this machine (docs/PERFORMANCE.md,
# "Python: dtrain as a torch.distributed backend"):
#   1. dist.all_reduce (f32 SUM, in place) at 4 KiB-64 MiB, world 2 and 4: dtrain against Gloo, and dtrain's
#      own C++ figure (dtrain-bench allreduce, the same sizes) for the binding's cost;
#   2. PyTorch's DDP, world 2: the reference MLP (peers/torch_ddp.py) and the MIL-NCE model
#      (peers/milnce_torch.py on `milnce gen-data` data), backend gloo against dtrain, interleaved REPS times.
# One compute thread per rank on every side (peers/peer_env.py; dtrain-run sets OMP_NUM_THREADS=1).
#   BUILD_DIR=build-torch2 bash benches/python_backend.sh      # a quiet machine; ~5 minutes
# Env: BUILD_DIR (with bin/dtrain-bench, bin/dtrain-run, bin/milnce and python/, DTRAIN_BUILD_PYTHON=ON),
#      PYTHON (default <repo>/.venv/bin/python), REPS (default 3), WORLDS (default "2 4").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build-torch2}
python=${PYTHON:-$root/.venv/bin/python}
reps=${REPS:-3}
worlds=${WORLDS:-"2 4"}
export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
sizes=4096,65536,1048576,4194304,16777216,67108864

echo "== python_backend: dist.all_reduce from Python, dtrain against Gloo, and dtrain-bench (C++)"
for w in $worlds; do
  for backend in gloo dtrain; do
    "$python" "$here/peers/torch_allreduce.py" "$w" --backend "$backend" --sizes "$sizes"
  done
  "$build/bin/dtrain-run" --standalone --nproc-per-node "$w" "$build/bin/dtrain-bench" allreduce \
    --min-bytes 4K --max-bytes 64M --factor 4 --progress off | sed "s/^/dtrain-bench world=$w: /"
done

echo "== python_backend: PyTorch DDP, world 2, gloo against dtrain (REPS=$reps, interleaved)"
data=$build/python-bench-milnce
[[ -d $data ]] || "$build/bin/milnce" gen-data --out "$data" >/dev/null 2>&1
for ((i = 1; i <= reps; i++)); do
  for backend in gloo dtrain; do
    "$python" "$here/peers/torch_ddp.py" 2 20 64 --backend "$backend"
    "$python" "$here/peers/milnce_torch.py" "$data" 2 --steps 20 --warmup-steps 3 --backend "$backend"
  done
done
