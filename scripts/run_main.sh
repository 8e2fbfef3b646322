#!/usr/bin/env bash
# The main job: installs what it needs (scripts/setup.sh main: the compilers and Debian's libtorch 1.13,
# the quickest libtorch to get; the test tools and the torch wheel are for scripts/test.sh), builds, generates the MIL-NCE data if absent, and trains the
# MIL-NCE video-text model on 2 local workers with dtrain-run, printing text-to-video retrieval
# (R@1/5/10, median rank) before and after training, beside chance. Each rank writes a timeline
# (DTRAIN_TIMELINE=RUN_DIR/timeline), merged into RUN_DIR/timeline/trace.json; the script ends by writing
# the run's report, RUN_DIR/report.html (dtrain-report), and printing its path.
# Env: BUILD_DIR (build), DATA_DIR (data/milnce), RUN_DIR (runs/milnce), NPROC (2), JOBS (2);
# extra arguments go to `milnce train` (e.g. --epochs 60 --resume).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
data=${DATA_DIR:-$root/data/milnce}
run=${RUN_DIR:-$root/runs/milnce}
bash "$root/scripts/setup.sh" main
# The tests need GoogleTest and more (setup.sh without "main"): the main job builds without them.
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_BUILD_TESTS=OFF
# dtrain-trace and dtrain-report when this tree has them (CMake defines them with the tools).
targets=(milnce dtrain-run)
known=$(cmake --build "$build" --target help)
for t in dtrain-trace dtrain-report; do
  grep -q "^$t:" <<<"$known" && targets+=("$t")
done
cmake --build "$build" -j"${JOBS:-2}" --target "${targets[@]}"
if [[ ! -f $data/meta.json ]]; then
  "$build/bin/milnce" gen-data --out "$data"
fi
export DTRAIN_TIMELINE="$run/timeline"
"$build/bin/dtrain-run" --standalone --nproc-per-node "${NPROC:-2}" \
  "$build/bin/milnce" train --data "$data" --out "$run" "$@"
# A trace that cannot be merged costs the report its timeline (the report says so), not the run's report.
if [[ -x $build/bin/dtrain-trace ]]; then
  "$build/bin/dtrain-trace" merge "$run/timeline" || echo "run_main: dtrain-trace merge failed: no timeline in the report" >&2
fi
"$build/bin/dtrain-report" "$run" -o "$run/report.html"
echo "report: $run/report.html"
