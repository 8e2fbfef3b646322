#!/usr/bin/env bash
# mpi.sh: the cost of dtrain's MPI transport against raw MPI_Allreduce, side by side in the same run.
#
# Usage: benches/mpi.sh [--quick]   (markdown on stdout, progress on stderr)
#   REPS repetitions (env REPS, default 3; --quick: 1) for each world of WORLDS (default "2 4"), each
#   on OpenMPI's shared-memory path (btl vader) and its TCP path over loopback (btl tcp). In every
#   repetition the two run one after another:
#     raw:    mpirun -np W mpi_allreduce FLOATS...                      (benches/peers/mpi_allreduce.c)
#     dtrain: mpirun -np W dtrain-bench allreduce --transport mpi ...   (DTRAIN_TRANSPORT=mpi: dtrain's
#             ring/recursive-doubling algorithms over MPI point-to-point, see docs/CLUSTER.md)
#   Both check their results (wrong != 0 fails the script). The table shows per-size medians of busbw
#   (GB/s, 2(n-1)/n x bytes / time) and dtrain/raw. One compute thread per rank on both sides.
# The binaries are copied into a temporary directory first (a rebuild cannot swap them mid-run).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
reps=${REPS:-3}
worlds=${WORLDS:-"2 4"}
[[ ${1:-} == --quick ]] && reps=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
log() { echo "mpi.sh: $*" >&2; }
[[ -x $build/bin/dtrain-bench ]] || { echo "mpi.sh: no $build/bin/dtrain-bench (cmake --build $build --target dtrain-bench)" >&2; exit 2; }
tmp=$(mktemp -d /tmp/dtrain-mpibench.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cp "$build/bin/dtrain-bench" "$tmp/"
mpicc -O2 "$here/peers/mpi_allreduce.c" -o "$tmp/mpi_allreduce"
floats=(1024 16384 262144 1048576 4194304 16777216)
flags=(--allow-run-as-root --oversubscribe --bind-to none -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS -x MKL_NUM_THREADS)
declare -A paths=([shm]="--mca btl vader,self" [tcp]="--mca btl tcp,self --mca btl_tcp_if_include lo")
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
for ((r = 1; r <= reps; r++)); do
  for w in $worlds; do
    for p in shm tcp; do
      # shellcheck disable=SC2086  # the btl flags are several words
      mpirun "${flags[@]}" ${paths[$p]} -np "$w" "$tmp/mpi_allreduce" "${floats[@]}" > "$tmp/raw.$p.w$w.r$r"
      # shellcheck disable=SC2086
      mpirun "${flags[@]}" ${paths[$p]} -np "$w" "$tmp/dtrain-bench" allreduce --transport mpi --min-bytes 4K \
        --max-bytes 64M --factor 4 > "$tmp/dtrain.$p.w$w.r$r"
      log "repetition $r world $w $p done"
    done
  done
done
echo "# dtrain's MPI transport against raw MPI_Allreduce ($(date '+%Y-%m-%d %H:%M'), $(env -u OMP_NUM_THREADS nproc) cores, load $load_start -> $(cut -d' ' -f1-3 /proc/loadavg), $reps repetitions, commit $(git -C "$root" rev-parse --short HEAD))"
/usr/bin/python3 - "$tmp" "$reps" "$worlds" <<'PY'
import glob, re, statistics, sys
tmp, reps, worlds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def raw(path):  # mpi world=2 bytes=4096 time_us=4.3 algbw=0.953 busbw=0.953 wrong=0
    out = {}
    for l in open(path):
        m = re.search(r"bytes=(\d+) .*busbw=([\d.]+) wrong=(\d+)", l)
        if m:
            if int(m[3]): sys.exit(f"{path}: wrong={m[3]}")
            out[int(m[1])] = float(m[2])
    return out
def dt(path):  # bytes count dtype time_us algbw busbw wrong p50 p90
    out = {}
    for l in open(path):
        f = l.split()
        if len(f) == 9 and f[0].isdigit():
            if int(f[6]): sys.exit(f"{path}: wrong={f[6]}")
            out[int(f[0])] = float(f[5])
    return out
for w in worlds:
    for p in ("shm", "tcp"):
        R = [raw(f"{tmp}/raw.{p}.w{w}.r{r}") for r in range(1, reps + 1)]
        D = [dt(f"{tmp}/dtrain.{p}.w{w}.r{r}") for r in range(1, reps + 1)]
        print(f"\n## world {w}, OpenMPI btl {p}\n\n| bytes | raw MPI_Allreduce busbw | dtrain over MPI busbw | dtrain / raw |\n| ---: | ---: | ---: | ---: |")
        for b in sorted(R[0]):
            if any(b not in d for d in D): continue
            rm, dm = statistics.median(x[b] for x in R), statistics.median(x[b] for x in D)
            print(f"| {b} | {rm:.3f} | {dm:.3f} | {dm / rm:.2f} |")
PY
