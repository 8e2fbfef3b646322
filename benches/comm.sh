#!/usr/bin/env bash
# comm.sh: dtrain's allreduce measured side by side with its anchors in the same run.
#
# Usage: benches/comm.sh [--quick|--smoke] [-h|--help]   (or: benches/run.sh comm ...)
#          (markdown on stdout, progress on stderr)
#
#   default   REPS repetitions (env REPS, default 3) for world 2 and 4 (env WORLDS, default "2 4").
#   --quick   short run: REPS=1, world 2 only.
#   --smoke   functional check, no meaningful numbers: REPS=1, world 2, sizes 4 KiB and 64 KiB only.
#
# The anchors are the peer drivers in benches/peers/ (benches/README.md), compiled into a temporary
# directory and run from there: memcpy_bw.c (gcc), mpi_allreduce.c (mpicc; run as mpi-shm and
# mpi-tcp) and gloo_collectives.py (PEER_PYTHON: benches/peer_python.sh; one compute thread per rank). Each checks its
# results (wrong=N; N != 0 fails the script). dtrain is run as
#   $BUILD_DIR/bin/dtrain-run --standalone --nproc-per-node W $BUILD_DIR/bin/dtrain-bench allreduce \
#       --transport shm|tcp --min-bytes 4K --max-bytes 64M --factor 4
# (BUILD_DIR defaults to <repo>/build; build it with
#   cmake --build build --target dtrain-bench dtrain-run -j2).
# The two dtrain binaries are copied into the temporary directory first and run from there, so a
# concurrent rebuild of the build directory cannot swap them mid-run.
# The machine is assumed to be shared and noisy, so runs are interleaved: in each repetition and for
# each world, mpi-shm, dtrain-shm, mpi-tcp, dtrain-tcp run one after another (gloo only in the first
# repetition, it is slow); every system's per-size median over repetitions is reported, and ratios are
# taken between those medians. memcpy_bw runs once per repetition (median reported).
#
# Prints: header (date, nproc, load, memcpy GB/s, commands), per world a busbw table, 4 KiB latency,
# the shm path against the memcpy ceiling, and PASS/MISS for each performance target.
# Exit status: 1 if dtrain-bench fails or reports #wrong != 0 (or an anchor fails / output is
# incomplete); PASS/MISS results do not change the exit status. The report itself is comm_report.py.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
anchors=$here/peers
source "$here/peer_python.sh"
reps=${REPS:-3}
worlds=${WORLDS:-"2 4"}
mode=default
# Sizes in floats (4 KiB .. 64 MiB); dtrain-bench runs 4K..max by x4, which hits every one.
floats="1024 16384 262144 1048576 4194304 16777216"
max_bytes=64M
for a in "$@"; do
  case $a in
    --quick) reps=1; worlds=2; mode=quick ;;
    --smoke) reps=1; worlds=2; mode=smoke; floats="1024 16384"; max_bytes=64K ;;
    -h|--help) usage; exit 0 ;;
    *) echo "comm.sh: unknown argument '$a'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ $reps =~ ^[1-9][0-9]*$ ]] || { echo "comm.sh: REPS must be a positive integer" >&2; exit 2; }

run_bin=$build/bin/dtrain-run
bench_bin=$build/bin/dtrain-bench
for f in "$run_bin" "$bench_bin"; do
  [[ -x $f ]] || { echo "comm.sh: $f not found; build with: cmake --build $build --target dtrain-bench dtrain-run -j2" >&2; exit 2; }
done
for f in memcpy_bw.c mpi_allreduce.c gloo_collectives.py peer_env.py; do
  [[ -f $anchors/$f ]] || { echo "comm.sh: $anchors/$f not found" >&2; exit 2; }
done

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/raw"
t_start=$(date +%s)
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
loads=""

log() { echo "comm.sh: $*" >&2; }

# Run private copies of the dtrain binaries, so that a concurrent rebuild of $build cannot replace
# them in the middle of the run (both link only system libraries).
mkdir -p "$tmp/bin"
cp "$run_bin" "$bench_bin" "$tmp/bin/"
"$tmp/bin/dtrain-bench" --help >/dev/null || { echo "comm.sh: $bench_bin does not run (being rebuilt?)" >&2; exit 2; }
bench_sum=$(md5sum "$tmp/bin/dtrain-bench" | cut -c1-12)
bench_time=$(date -r "$bench_bin" '+%Y-%m-%d %H:%M:%S %Z')

log "compiling anchors in $tmp"
gcc -O2 "$anchors/memcpy_bw.c" -o "$tmp/memcpy_bw"
mpicc -O2 "$anchors/mpi_allreduce.c" -o "$tmp/mpi_allreduce"

mpirun_flags=(--allow-run-as-root --oversubscribe --bind-to none)
# shellcheck disable=SC2054  # "tcp,self" is one mpirun argument
mpi_tcp_flags=(--mca btl tcp,self --mca btl_tcp_if_include lo)
dtrain_args=(allreduce --min-bytes 4K --max-bytes "$max_bytes" --factor 4)
# shellcheck disable=SC2206  # word splitting intended
sizes=($floats)

# run NAME OUTFILE CMD...: runs CMD with stdout to OUTFILE; on failure shows its output and exits 1.
run() {
  local name=$1 out=$2; shift 2
  local t0=$SECONDS rc=0
  "$@" >"$out" 2>"$out.err" || rc=$?
  if ((rc != 0)); then
    log "$name FAILED (exit $rc): $*"
    cat "$out" "$out.err" >&2
    exit 1
  fi
  log "  $name: $((SECONDS - t0)) s"
}

for ((r = 1; r <= reps; r++)); do
  log "repetition $r/$reps"
  loads+="r$r: $(cut -d' ' -f1 /proc/loadavg); "
  run memcpy "$tmp/raw/memcpy.r$r" "$tmp/memcpy_bw"
  for w in $worlds; do
    run "mpi-shm w=$w" "$tmp/raw/mpi-shm.w$w.r$r" mpirun "${mpirun_flags[@]}" -np "$w" "$tmp/mpi_allreduce" "${sizes[@]}"
    run "dtrain-shm w=$w" "$tmp/raw/dtrain-shm.w$w.r$r" \
      "$tmp/bin/dtrain-run" --standalone --nproc-per-node "$w" "$tmp/bin/dtrain-bench" "${dtrain_args[@]}" --transport shm
    run "mpi-tcp w=$w" "$tmp/raw/mpi-tcp.w$w.r$r" \
      mpirun "${mpirun_flags[@]}" "${mpi_tcp_flags[@]}" -np "$w" "$tmp/mpi_allreduce" "${sizes[@]}"
    run "dtrain-tcp w=$w" "$tmp/raw/dtrain-tcp.w$w.r$r" \
      "$tmp/bin/dtrain-run" --standalone --nproc-per-node "$w" "$tmp/bin/dtrain-bench" "${dtrain_args[@]}" --transport tcp
    if ((r == 1)); then
      run "gloo w=$w" "$tmp/raw/gloo.w$w.r$r" "$PEER_PYTHON" "$anchors/gloo_collectives.py" "$w" "${sizes[@]}"
    fi
  done
done

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
elapsed=$(($(date +%s) - t_start))
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null) ]]; then commit+=" (+ uncommitted changes)"; fi

cmds=$(cat <<EOF
gcc -O2 benches/peers/memcpy_bw.c -o <tmp>/memcpy_bw && <tmp>/memcpy_bw
mpicc -O2 benches/peers/mpi_allreduce.c -o <tmp>/mpi_allreduce
mpirun ${mpirun_flags[*]} -np W <tmp>/mpi_allreduce ${sizes[*]}   # mpi-shm
$run_bin --standalone --nproc-per-node W $bench_bin ${dtrain_args[*]} --transport shm   # dtrain-shm
mpirun ${mpirun_flags[*]} ${mpi_tcp_flags[*]} -np W <tmp>/mpi_allreduce ${sizes[*]}   # mpi-tcp
$run_bin --standalone --nproc-per-node W $bench_bin ${dtrain_args[*]} --transport tcp   # dtrain-tcp
$PEER_PYTHON benches/peers/gloo_collectives.py W ${sizes[*]}   # gloo (first repetition only; $PEER_TORCH)
EOF
)

RAW=$tmp/raw FLOATS="$floats" REPS_N=$reps WORLDS_L=$worlds MODE=$mode NPROC=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) DATE=$(date '+%Y-%m-%d %H:%M:%S %Z') \
  LOAD_START=$load_start LOAD_END=$load_end LOADS=$loads ELAPSED=$elapsed COMMIT=$commit BENCH_INFO="$bench_bin built $bench_time, md5 $bench_sum..." CMDS=$cmds HOST_CPU="$(
    grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || true)" \
  /usr/bin/python3 "$here/comm_report.py"
