#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs the whole test suite (CTest), then the
# consumer-project tests (scripts/consumer_test.sh) and the structural checks
# (scripts/check_structure.sh: file and function sizes, environment, include paths, transports).
# Usage: bash scripts/test.sh            (from the repository root or anywhere)
# Env: BUILD_DIR (default build), JOBS (default 2), CTEST_ARGS (extra ctest arguments).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
jobs=${JOBS:-2}
bash "$root/scripts/setup.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_MPI=ON  # the MPI transport and its tests too
cmake --build "$build" -j"$jobs"
# Every test has its own deadline (CTest TIMEOUT); --timeout bounds anything that slips through.
ctest --test-dir "$build" --output-on-failure -j"$jobs" --timeout 600 ${CTEST_ARGS:-}
# Projects outside the tree using dtrain: installed prefix, add_subdirectory, FetchContent, the .deb.
BUILD_DIR="$build" JOBS="$jobs" bash "$root/scripts/consumer_test.sh"
BUILD_DIR="$build" JOBS="$jobs" bash "$root/scripts/check_structure.sh"
