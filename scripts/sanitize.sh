#!/usr/bin/env bash
# sanitize.sh: the fuzzing harnesses and the sanitizer runs (issue 27), run by scripts/test.sh (so by CI).
# Both builds are of the comm layer (DTRAIN_TORCH=OFF) with clang-14: libtorch is not built with sanitizers,
# and a clang build of the whole torch layer would cost CI some 25 minutes more. The fuzzing build adds the
# 16 torch-layer and MIL-NCE translation units its torch harnesses reach (tests/fuzz/CMakeLists.txt; ~90 s).
#
#   fuzz   build-asan (ASan + UBSan + libFuzzer coverage): every harness of tests/fuzz (and tests/fuzz/torch,
#          the torch layer's decoders) runs over its seed corpus and the inputs it once failed on
#          (tests/fuzz/regressions/<harness>/), then FUZZ_SECONDS more; any crash, sanitizer report, leak, slow unit (FUZZ_TIMEOUT s)
#          or out-of-memory fails it, and the input is kept under BUILD_DIR-asan/fuzz/<harness>/ (crash-*).
#          Prints each harness's executions per second and the coverage it reached (edges, features).
#   asan   the tests of ASAN_TESTS (CTest labels: whole executables) in build-asan: ASan with UBSan, every
#          report fatal (-fno-sanitize-recover), leaks checked at exit.
#   tsan   the tests of TSAN_TESTS in build-tsan (ThreadSanitizer), with tests/sanitize/tsan.supp.
#
# Usage: scripts/sanitize.sh [fuzz] [asan] [tsan]     (all three by default)
# Env: BUILD_DIR (default <repo>/build: the builds are BUILD_DIR-asan and BUILD_DIR-tsan), JOBS (default 2),
#      FUZZ_SECONDS (default 20 a harness), FUZZ_TIMEOUT (default 10), ASAN_TESTS, TSAN_TESTS (below).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
base=$(realpath -m "${BUILD_DIR:-$root/build}")  # absolute: the fuzzers run in their own directories
jobs=${JOBS:-2}
fuzz_seconds=${FUZZ_SECONDS:-20}
fuzz_timeout=${FUZZ_TIMEOUT:-10}
# The comm layer's tests whose code is threads and bytes from peers: stores, the process group and its
# Work executor, the collectives over tcp and shm (the fault and mismatch paths included), rendezvous,
# the flight recorder and the timeline writer, and the fuzzers' regression inputs.
asan_tests=${ASAN_TESTS:-store_test auth_test work_test nccl_fake_test local_step_test collectives_test mismatch_test fault_test rendezvous_test flight_recorder_test timeline_test decoder_regression_test tune_test}
# ThreadSanitizer: the multi-threaded parts of the comm layer (the store server's thread and parked
# requests, the Work executor and its continuations, the group's thread with aborts from others, the
# timeline's writer thread, the flight recorder). The collectives' tests are left out for CI's time: their
# ranks are processes, and their threads are the group's, which work_test and local_step_test drive.
tsan_tests=${TSAN_TESTS:-store_test work_test nccl_fake_test local_step_test timeline_test flight_recorder_test tune_test}
parts=("$@")
fuzz_summary=()
((${#parts[@]})) || parts=(fuzz asan tsan)
supp=$root/tests/sanitize
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# Optimisation: compile time is most of these builds' cost in CI (the sanitizers' instrumentation, UBSan's
# above all, makes an optimised translation unit take ~2x longer), so both are built at -O0 (TSan's manual
# advises -O1 for speed; its tests here are light); -g1: line tables for the reports' stacks.
# The fuzzing build also has the torch layer's harnesses (DTRAIN_FUZZ_TORCH: the few translation units they
# reach, on Debian's libtorch 1.13).
configure() {  # configure DIR SANITIZER FUZZ OPT
  CC=clang-14 CXX=clang++-14 cmake -S "$root" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Sanitize \
    -DCMAKE_C_FLAGS_SANITIZE="$4 -g1" -DCMAKE_CXX_FLAGS_SANITIZE="$4 -g1" -DDTRAIN_TORCH=OFF \
    -DDTRAIN_SANITIZE="$2" -DDTRAIN_FUZZ="$3" -DDTRAIN_FUZZ_TORCH="$3" -DDTRAIN_WITH_MPI=OFF -DDTRAIN_BUILD_TESTS=ON \
    -DCMAKE_C_COMPILER_LAUNCHER="${CMAKE_C_COMPILER_LAUNCHER:-}" -DCMAKE_CXX_COMPILER_LAUNCHER="${CMAKE_CXX_COMPILER_LAUNCHER:-}" \
    -DDTRAIN_TEST_TIME_SCALE="${DTRAIN_TEST_TIME_SCALE:-1}" >/dev/null
}

# ctest over whole test executables (labels), each test under its CTest deadline. The sweeps' cases at 4
# and 5 ranks are left out (the same code as at 2 and 3, with more processes: most of the time under a
# sanitizer on 2 cores); the normal build runs them.
run_tests() {  # run_tests DIR TESTS...
  local dir=$1
  shift
  local re t n
  re=$(IFS='|'; echo "^($*)\$")
  # Tests are discovered from the built executables: one that did not build would have no tests, and ctest
  # would pass without it. Each label must list tests.
  for t in "$@"; do
    n=$(ctest --test-dir "$dir" -N -L "^$t\$" | sed -n 's/^Total Tests: //p')
    ((${n:-0} > 0)) || { echo "sanitize.sh: $t lists no tests in $dir (did it build?)" >&2; return 1; }
  done
  # The log keeps the failed tests' names for the summary at the end (CI shows only the output's tail).
  ctest --test-dir "$dir" --output-on-failure -j"$jobs" --timeout $((600 * ${DTRAIN_TEST_TIME_SCALE:-1})) -L "$re" -E "_world[45]( |\$)${EXCLUDE:+|$EXCLUDE}" \
    2>&1 | tee "$dir/ctest.log"
  return "${PIPESTATUS[0]}"
}

fuzz() {
  local dir=$base-asan
  configure "$dir" address ON -O0 || return 1
  local harnesses=()
  for src in "$root"/tests/fuzz/*_fuzz.cc "$root"/tests/fuzz/torch/*_fuzz.cc; do harnesses+=("$(basename "$src" .cc)"); done
  cmake --build "$dir" -j"$jobs" --target "${harnesses[@]}" || return 1
  local failed=0
  fuzz_summary=()  # global: the summary at the end names the failed harnesses
  # JOBS harnesses at a time, each on its own copy of its corpus; then their logs in order.
  echo "== sanitize.sh: fuzzing ${harnesses[*]}, ${fuzz_seconds}s each, $jobs at a time"
  for h in "${harnesses[@]}"; do
    local work=$dir/fuzz/$h
    rm -rf "$work" && mkdir -p "$work/corpus"
    cp "$root/tests/fuzz/corpus/$h"/* "$work/corpus/"
    # The inputs it once failed on (tests/fuzz/regressions/<harness>/) are run first, with the seeds.
    if [[ -d $root/tests/fuzz/regressions/$h ]]; then cp "$root/tests/fuzz/regressions/$h"/* "$work/corpus/"; fi
    # -timeout: a unit slower than that is a hang; -rss_limit_mb: a leak or a runaway allocation.
    # A harness's own libFuzzer options, if any: tests/fuzz[/torch]/<harness>.options, one a line, '#' comments.
    local options=()
    for f in "$root/tests/fuzz/$h.options" "$root/tests/fuzz/torch/$h.options"; do
      [[ -f $f ]] && mapfile -t options < <(grep -v '^\s*#' "$f" | grep .)
    done
    (cd "$work" && "$dir/bin/$h" -max_total_time="$fuzz_seconds" -timeout="$fuzz_timeout" -rss_limit_mb=2048 \
       -print_final_stats=1 "${options[@]}" corpus >log.txt 2>&1; echo $? >rc) &
    while (($(jobs -rp | wc -l) >= jobs)); do wait -n || true; done
  done
  wait
  for h in "${harnesses[@]}"; do
    local work=$dir/fuzz/$h
    if [[ $(cat "$work/rc") == 0 ]]; then
      local stat
      stat=$(grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE)' "$work/log.txt" | tail -1 || true)
      local execs cov ft
      execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$work/log.txt" | grep -o '[0-9]*$' || echo 0)
      cov=$(sed -n 's/.*cov: \([0-9]*\).*/\1/p' <<<"$stat")
      ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$stat")
      fuzz_summary+=("$(printf '%-22s %8s runs %6s/s  cov %5s edges  ft %5s' "$h" "$execs" "$((execs / fuzz_seconds))" "$cov" "$ft")")
    else
      failed=1
      fuzz_summary+=("$h: FAILED (input and log in $work): $(grep -m1 -E 'ERROR|runtime error|SUMMARY' "$work/log.txt" || true)")
      grep -E 'ERROR|runtime error|SUMMARY|Test unit written' "$work/log.txt" | head -8 || true
    fi
  done
  echo "== sanitize.sh: fuzzing, ${fuzz_seconds}s a harness (ASan + UBSan)"
  printf '  %s\n' "${fuzz_summary[@]}"
  return "$failed"
}

asan() {
  local dir=$base-asan
  configure "$dir" address ON -O0 || return 1
  # shellcheck disable=SC2086  # a list of targets
  cmake --build "$dir" -j"$jobs" --target $asan_tests || return 1
  echo "== sanitize.sh: ASan + UBSan: $asan_tests"
  # shellcheck disable=SC2086
  run_tests "$dir" $asan_tests
}

tsan() {
  local dir=$base-tsan
  configure "$dir" thread OFF -O0 || return 1
  # shellcheck disable=SC2086
  cmake --build "$dir" -j"$jobs" --target $tsan_tests || return 1
  echo "== sanitize.sh: ThreadSanitizer: $tsan_tests"
  # die_after_fork=0: the tests fork their ranks from a process that has threads (the store server's);
  # each child is single-threaded until it starts its own.
  # shellcheck disable=SC2086
  # The etcd store's cases too (a third of the time: they wait on an etcd server; libcurl's threads are
  # not dtrain's): the TcpStore and FileStore cases are the store server's threads.
  TSAN_OPTIONS="suppressions=$supp/tsan.supp:halt_on_error=1:second_deadlock_stack=1:die_after_fork=0" \
    EXCLUDE=Etcd run_tests "$dir" $tsan_tests
}

# Each part is called from `||`, where bash turns set -e off: every step above that can fail says `|| return 1`.
# A failed part is named again at the end, with its failed tests or harnesses: CI shows only the tail.
status=0
results=()
for part in "${parts[@]}"; do
  case $part in
    fuzz|asan|tsan)
      rm -f "$base-$part/ctest.log"  # asan and tsan write one (fuzz none)
      if "$part"; then
        results+=("$part: passed")
      else
        status=1
        results+=("$part: FAILED")
        if [[ $part == fuzz ]]; then
          mapfile -t -O "${#results[@]}" results < <(printf '%s\n' "${fuzz_summary[@]}" | grep FAILED | sed 's/^/    /')
        elif [[ -f $base-$part/ctest.log ]]; then
          mapfile -t -O "${#results[@]}" results < \
            <(sed -n '/tests FAILED:/,$p' "$base-$part/ctest.log" | grep -E '^\s+[0-9]+ - ' | sed 's/^\s*/    /')
        fi
      fi
      ;;
    *) echo "sanitize.sh: unknown part '$part' (fuzz, asan or tsan)" >&2; exit 2 ;;
  esac
done
echo "== sanitize.sh: summary"
printf '  %s\n' "${results[@]}"
exit "$status"
