#!/usr/bin/env bash
# The main job: installs the dependencies, builds, generates the MIL-NCE data if absent, and trains the
# MIL-NCE video-text model on 2 local workers with dtrain-run, printing text-to-video retrieval
# (R@1/5/10, median rank) before and after training, beside chance.
# Env: BUILD_DIR (build), DATA_DIR (data/milnce), RUN_DIR (runs/milnce), NPROC (2), JOBS (2);
# extra arguments go to `milnce train` (e.g. --epochs 60 --resume).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
data=${DATA_DIR:-$root/data/milnce}
run=${RUN_DIR:-$root/runs/milnce}
bash "$root/scripts/setup.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j"${JOBS:-2}" --target milnce dtrain-run
if [[ ! -f $data/meta.json ]]; then
  "$build/bin/milnce" gen-data --out "$data"
fi
"$build/bin/dtrain-run" --standalone --nproc-per-node "${NPROC:-2}" \
  "$build/bin/milnce" train --data "$data" --out "$run" "$@"
