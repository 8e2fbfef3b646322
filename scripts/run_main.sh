#!/usr/bin/env bash
# The main job: installs the dependencies, builds, and runs on local workers.
# Until the MIL-NCE flagship job lands (issue 4), this runs the comm layer's allreduce example on 4
# local workers and the allreduce benchmark on 2, both through the dtrain-run launcher.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
bash "$root/scripts/setup.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j"${JOBS:-2}"
"$build/bin/dtrain-run" --standalone --nproc-per-node 4 "$build/bin/example-allreduce"
"$build/bin/dtrain-run" --standalone --nproc-per-node 2 "$build/bin/dtrain-bench" allreduce --min-bytes 4K --max-bytes 16M --factor 4
