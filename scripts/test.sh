#!/usr/bin/env bash
# Installs the dependencies (scripts/setup.sh: Debian's packages and the torch wheel in .venv), then builds
# and tests dtrain against both libtorch generations:
#   1. libtorch 2.x, the pinned torch wheel (build-torch2): everything; the whole suite (CTest, its
#      parity tests against that wheel's PyTorch); the consumer project built against an installed
#      prefix (scripts/consumer_test.sh)
#   2. libtorch 1.13, Debian's libtorch-dev (build-torch1): the library, the tools, the apps and the tests
#      of the torch-layer code that differs between the generations (include/dtrain/compat.h: optimizer
#      state, the autograd hooks of DDP and FSDP), of the device layer's CPU side, and of the comparisons
#      with PyTorch (Debian's python3-torch 1.13); the consumer projects through the .deb, add_subdirectory and FetchContent
# then runs the fuzzing harnesses and the sanitizer builds of the comm layer (scripts/sanitize.sh), and ends
# with the structural checks (scripts/check_structure.sh: file and function sizes, environment, include
# paths, transports; clang-tidy reads the sanitizers' comm-only clang build). Each part prints how long it took.
# Usage: bash scripts/test.sh            (from the repository root or anywhere)
#        bash scripts/test.sh --quick [FILE ...]   the fast loop: see scripts/quick_test.py
# Env: BUILD_DIR (default build: the two builds are BUILD_DIR-torch2 and BUILD_DIR-torch1), JOBS (default
# 2), CTEST_ARGS (extra ctest arguments, both builds), TORCH_GENERATIONS ("2 1" by default; "2" or "1" for one),
# DTRAIN_TEST_TIME_SCALE (deadlines x this, default 1), DTRAIN_CCACHE (0: no ccache).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The contributor's fast loop (scripts/quick_test.py): rebuild what the changed files affect in an existing
# build and run only the tests that depend on them.   bash scripts/test.sh --quick [FILE ...]
if [[ ${1:-} == --quick ]]; then
  shift
  exec python3 "$root/scripts/quick_test.py" "$@"
fi
base=${BUILD_DIR:-$root/build}
jobs=${JOBS:-2}
generations=${TORCH_GENERATIONS:-2 1}
# DTRAIN_TEST_TIME_SCALE (a whole number, default 1): every test deadline, CTest's and the tests' own, times
# this, for a machine slower or busier than an idle 2-core one (tests/harness.h).
export DTRAIN_TEST_TIME_SCALE=${DTRAIN_TEST_TIME_SCALE:-1}
scale=$DTRAIN_TEST_TIME_SCALE

# The test executables whose tests run against 1.13 too (labels: one per executable, tests/CMakeLists.txt).
torch1_tests=(large_batch_test zero_test fsdp_test ddp_test checkpoint_test powersgd_test device_test milnce_test
              unused_grad_test)
# ctest_logged LOG ARGS...: ctest, its output also kept in LOG (for the count of tests in the summary).
ctest_logged() {
  local log=$1
  shift
  ctest "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
# counted LABEL LOG: the summary's line with how many tests LOG's ctest ran and passed.
counted() {
  local line
  line=$(grep -so '[0-9]*% tests passed, [0-9]* tests failed out of [0-9]*' "$2" | tail -1 || true)
  timings+=("$1: ${line:-no count in $2}")
}
timings=()
timed() {  # timed LABEL COMMAND...: runs it, remembers how long it took
  local label=$1 start=$SECONDS
  shift
  # CI shows only the tail of the output: a failing part says so last, with the times of those before it.
  "$@" || {
    local rc=$?
    echo; echo "test.sh: FAILED: $label (exit $rc, after $((SECONDS - start)) s); the parts before it:"
    printf '  %s\n' "${timings[@]}"
    exit "$rc"
  }
  timings+=("$label: $((SECONDS - start)) s")
  echo "test.sh: $label took $((SECONDS - start)) s"
}

timed "setup (Debian packages, the torch wheel)" bash "$root/scripts/setup.sh"

# ccache (Debian's package, from scripts/setup.sh) in front of every compiler this script starts: the two
# builds, the consumer projects and the clang builds of sanitize.sh (CMake reads CMAKE_<LANG>_COMPILER_LAUNCHER
# from the environment when it configures a new build; the builds configured below get it on the command
# line). Within one cold run it compiles once what several builds share: the comm layer and the tools,
# which the libtorch 1.13 build and the add_subdirectory consumer compile again with the same flags. The
# cache lives outside the clone (~/.cache/ccache; CCACHE_DIR moves it), and paths under the clone are
# hashed relative to it (CCACHE_BASEDIR), so a later run from another clone on this machine reuses it.
# The precompiled libtorch headers are cached too (the sloppiness ccache's manual asks for with them).
# DTRAIN_CCACHE=0 turns it off.
if [[ ${DTRAIN_CCACHE:-1} != 0 ]] && command -v ccache >/dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=1
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-20G}  # precompiled headers are ~0.7 GB each
  ccache --zero-stats >/dev/null
fi

for gen in $generations; do
  build=$base-torch$gen
  # The MPI transport and its tests too; tests, examples and benchmarks on again after an earlier run's
  # .deb step turned them off in build-torch1. A compiler warning in dtrain's own code fails the build
  # (DTRAIN_WERROR: -Werror for the project's targets only).
  args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DDTRAIN_WITH_MPI=ON -DDTRAIN_BUILD_TESTS=ON -DDTRAIN_BUILD_EXAMPLES=ON
        -DMILNCE_REQUIRE_VIDEO=ON -DDTRAIN_WERROR=ON
        -DDTRAIN_BUILD_BENCHMARKS=ON -DCMAKE_C_COMPILER_LAUNCHER="${CMAKE_C_COMPILER_LAUNCHER:-}"
        -DCMAKE_CXX_COMPILER_LAUNCHER="${CMAKE_CXX_COMPILER_LAUNCHER:-}"
        -DCMAKE_CUDA_COMPILER_LAUNCHER="${CMAKE_CUDA_COMPILER_LAUNCHER:-}" -DDTRAIN_TEST_TIME_SCALE="$scale")
  if [[ $gen == 2 ]]; then
    # The libtorch root inside the wheel (lib/, include/, share/cmake/Torch), as pytorch.org's zip has it.
    args+=(-DCMAKE_PREFIX_PATH="$("$root/.venv/bin/python" -c 'import torch; print(torch.__path__[0])')")
    # The torch.distributed backend (python/) too, against the same wheel.
    args+=(-DDTRAIN_BUILD_PYTHON=ON -DPython_EXECUTABLE="$root/.venv/bin/python")
  fi
  echo; echo "== test.sh: libtorch $gen.x in $build"
  cmake -S "$root" -B "$build" "${args[@]}"
  grep "^DTRAIN_TEST_PYTHON:" "$build/CMakeCache.txt" || true
  if [[ $gen == 2 ]]; then
    timed "libtorch 2.x: build" cmake --build "$build" -j"$jobs"
    # Every test has its own deadline (CTest TIMEOUT); --timeout bounds anything that slips through.
    timed "libtorch 2.x: ctest" ctest_logged "$build/ctest.log" --test-dir "$build" --output-on-failure -j"$jobs" \
      --timeout $((600 * scale)) -LE '^gpu_test$' ${CTEST_ARGS:-}
    counted "libtorch 2.x: tests" "$build/ctest.log"
    # The GPU tests (tests/gpu) on their own, so that what did not run is seen: each is skipped with the
    # reason where no GPU is (CTest: "Not Run", listed under "did not run"), never counted as passed.
    echo; echo "== test.sh: GPU tests (tests/gpu) in the CUDA build"
    ctest --test-dir "$build" --output-on-failure -L '^gpu_test$' ${CTEST_ARGS:-} | tee "$build/gpu_tests.txt"
    gpu_total=$(grep -c "Test *#" "$build/gpu_tests.txt" || true)
    gpu_skipped=$(grep -c "Test *#.*Skipped" "$build/gpu_tests.txt" || true)
    gpu_why=$("$build/bin/gpu_test" --gtest_filter='GpuDdp.NcclAtWorldOne*' 2>&1 | grep -m1 -o "not run: .*" || true)
    timings+=("GPU tests: ${gpu_total} built, $((gpu_total - gpu_skipped)) run, ${gpu_skipped} not run (${gpu_why:-a GPU is here})")
    echo "test.sh: GPU tests: ${gpu_total} built, $((gpu_total - gpu_skipped)) run, ${gpu_skipped} not run (${gpu_why:-a GPU is here})"
    # The torch.distributed backend (python/, built above) under pytest: every collective against Gloo,
    # PyTorch's DDP, ZeRO, FSDP and a DeviceMesh on dtrain against Gloo, the faults, torchrun on the example.
    timed "Python backend: pytest (tests/python)" bash -c 'PYTHONPATH="$1/python" "$2/.venv/bin/python" -m pytest -q \
      -p no:cacheprovider "$2/tests/python" 2>&1 | tee "$1/pytest.log"; exit "${PIPESTATUS[0]}"' _ "$build" "$root"
    timings+=("Python backend: $(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$build/pytest.log" | tail -1)")
    # find_package(dtrain) against an install made with libtorch 2.x: a DDP step on 2 ranks.
    timed "libtorch 2.x: consumer project (installed)" env BUILD_DIR="$build" JOBS="$jobs" \
      bash "$root/scripts/consumer_test.sh" installed
  else
    timed "libtorch 1.13: build" cmake --build "$build" -j"$jobs" --target dtrain dtrain-run dtrain-trace dtrain-report \
      milnce "${torch1_tests[@]}"
    label_re=$(IFS='|'; echo "^(${torch1_tests[*]})\$")
    timed "libtorch 1.13: ctest (${#torch1_tests[@]} executables)" ctest_logged "$build/ctest.log" --test-dir "$build" \
      --output-on-failure -j"$jobs" --timeout $((600 * scale)) -L "$label_re" ${CTEST_ARGS:-}
    counted "libtorch 1.13: tests" "$build/ctest.log"
    # cpack builds the `all` target first: without the tests, examples and dtrain-bench that is what is
    # built already (the library, the tools and milnce), so the .deb costs no second build; CI's .deb lacks
    # dtrain-bench (a release build makes it from a full build: cmake --build build && cpack -G DEB).
    cmake -S "$root" -B "$build" -DDTRAIN_BUILD_TESTS=OFF -DDTRAIN_BUILD_EXAMPLES=OFF -DDTRAIN_BUILD_BENCHMARKS=OFF >/dev/null
    # The .deb (on Debian's libtorch-dev) and add_subdirectory (dtrain::comm). FetchContent builds the same
    # CMake tree from a clone: `bash scripts/consumer_test.sh fetchcontent` (left out of CI for time).
    timed "libtorch 1.13: consumer projects (deb, subdirectory)" env BUILD_DIR="$build" JOBS="$jobs" \
      bash "$root/scripts/consumer_test.sh" deb subdirectory
  fi
done
# The fuzzing harnesses (each over its seed corpus, then 20 s) and the comm layer's tests under ASan + UBSan
# and under TSan, in clang builds of their own (scripts/sanitize.sh says which tests and why).
timed "fuzzing and sanitizers (clang: ASan + UBSan, TSan)" env BUILD_DIR="$base" JOBS="$jobs" \
  bash "$root/scripts/sanitize.sh"
counted "ASan + UBSan: tests" "$base-asan/ctest.log"
counted "ThreadSanitizer: tests" "$base-tsan/ctest.log"
# The structural checks: tool-includes reads the 1.13 build's compile commands (the 2.x one without it);
# clang-tidy's function-size reads the comm layer's and the tools' translation units of the comm-only clang
# build that sanitize.sh made (build-asan: no libtorch headers to parse, ~1 min where a libtorch build takes
# ~9; its fuzzing harnesses' torch-layer units are left out, 2 min more), and lizard measures every
# function of the tree, the torch layer's included.
check_build=$base-torch1
[[ " $generations " == *" 1 "* ]] || check_build=$base-torch2
timed "structural checks" env BUILD_DIR="$check_build" TIDY_BUILD="$base-asan" TIDY_DIRS="src/comm tools" \
  JOBS="$jobs" bash "$root/scripts/check_structure.sh"
# Where the time went: each build's slowest translation units and link steps, each test executable's
# seconds (scripts/profile_tests.py; CONTRIBUTING.md keeps a dated copy). Informative: it fails nothing.
builds=()
for gen in $generations; do builds+=("$base-torch$gen"); done
echo; python3 "$root/scripts/profile_tests.py" "${builds[@]}" --top 8 || true
if [[ -n ${CMAKE_CXX_COMPILER_LAUNCHER:-} ]]; then
  echo; echo "== test.sh: ccache (hits: compiled earlier, here or by another clone; misses: compiled now)"
  ccache --show-stats | grep -E "^(Cacheable|  Hits|  Misses|Cache size)" || true
  timings+=("ccache: $(ccache --print-stats | awk -F'\t' '/^(direct|preprocessed)_cache_hit\t/{h+=$2} /^cache_miss\t/{m=$2} END{printf "%d hits, %d misses", h, m}')")
fi
echo; echo "test.sh: all passed"; printf '  %s\n' "${timings[@]}"
