#!/usr/bin/env bash
# tails.sh: small-message allreduce latency and its tail, dtrain against OpenMPI in the same run.
#
# Usage: benches/tails.sh        (or: benches/run.sh tails; markdown on stdout, progress on stderr)
# Env: BUILD_DIR (default <repo>/build), BYTES (default 4096), ITERS (timed calls per run, default
#      20000), REPS (interleaved repetitions, default 3), WORLDS (default "2 4"), PATHS (default
#      "shm tcp"), SPIN_US (DTRAIN_SPIN_US for dtrain's runs; default: unset, dtrain's default).
#
# For each repetition, world and path, OpenMPI (benches/peers/mpi_allreduce.c: mpi-shm is its default
# shared-memory path, mpi-tcp `--mca btl tcp,self`) and dtrain (`dtrain-bench allreduce --transport
# shm|tcp`) run back to back, each ITERS timed calls of BYTES (f32 sum) after a warm-up; both time every
# call on rank 0 and report the mean over the loop, p50, p99 and the maximum. The table gives, per world
# and path, each system's median over repetitions and dtrain / MPI (below 1: dtrain is faster). One
# compute thread per rank on both sides (OMP/OPENBLAS/MKL_NUM_THREADS=1). Both check their results:
# a wrong element or a failed run fails the script.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
build=${BUILD_DIR:-$root/build}
bytes=${BYTES:-4096}
iters=${ITERS:-20000}
reps=${REPS:-3}
worlds=${WORLDS:-"2 4"}
paths=${PATHS:-"shm tcp"}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
for f in dtrain-run dtrain-bench; do
  [[ -x $build/bin/$f ]] || { echo "tails.sh: $build/bin/$f not found; build with: cmake --build $build -j2 --target dtrain-run dtrain-bench" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp "$build/bin/dtrain-run" "$build/bin/dtrain-bench" "$tmp/"
mpicc -O2 "$here/peers/mpi_allreduce.c" -o "$tmp/mpi_allreduce"
mpirun=(mpirun --allow-run-as-root --oversubscribe --bind-to none)
((bytes % 4 == 0)) || { echo "tails.sh: BYTES must be a multiple of 4" >&2; exit 2; }

echo "# Small-message allreduce: dtrain against OpenMPI, $bytes bytes, $iters calls per run, $reps repetitions"
echo
echo "- date: $(date -u '+%F %T') UTC; commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "- machine: $(getconf _NPROCESSORS_ONLN) cores; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "- DTRAIN_SPIN_US: ${SPIN_US:-unset (default)}"
echo
results=$tmp/results.txt
: >"$results"
for r in $(seq 1 "$reps"); do
  for w in $worlds; do
    for p in $paths; do
      echo "tails.sh: repetition $r, world $w, $p" >&2
      mca=()
      [[ $p == tcp ]] && mca=(--mca btl tcp,self --mca btl_tcp_if_include lo)
      line=$(ITERS=$iters "${mpirun[@]}" "${mca[@]}" -np "$w" "$tmp/mpi_allreduce" $((bytes / 4)) | grep '^mpi ')
      [[ $line == *" wrong=0 "* ]] || { echo "tails.sh: MPI failed or was wrong: $line" >&2; exit 1; }
      sed -E "s/^mpi world=([0-9]+) bytes=[0-9]+ time_us=([0-9.]+) .* p50_us=([0-9.]+) p99_us=([0-9.]+) max_us=([0-9.]+)/mpi $p \1 $r \2 \3 \4 \5/" \
        <<<"$line" >>"$results"
      out=$(env ${SPIN_US:+DTRAIN_SPIN_US=$SPIN_US} "$tmp/dtrain-run" --standalone --nproc-per-node "$w" "$tmp/dtrain-bench" \
              allreduce --transport "$p" --min-bytes "$bytes" --max-bytes "$bytes" --iters "$iters" | sed -E 's/^\[rank [0-9]+\]: //')
      grep -q '^# 0 wrong elements in all' <<<"$out" || { echo "tails.sh: dtrain-bench failed or was wrong:"; echo "$out"; } >&2
      grep -q '^# 0 wrong elements in all' <<<"$out" || exit 1
      # size count type time_us algbw busbw #wrong p50 p90 p99 max
      awk -v p="$p" -v w="$w" -v r="$r" '$1 ~ /^[0-9]+$/ && NF >= 11 {print "dtrain", p, w, r, $4, $8, $10, $11}' \
        <<<"$out" >>"$results"
    done
  done
done
echo "- load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
med = {}
for sysname, path, w, r, *vals in rows:
    med.setdefault((sysname, path, int(w)), []).append([float(v) for v in vals])
print("| world | path | MPI mean / p50 / p99 / max (us) | dtrain mean / p50 / p99 / max (us) | dtrain / MPI: mean, p99 |")
print("| ---: | --- | --- | --- | --- |")
for (sysname, path, w) in sorted(k for k in med if k[0] == "mpi"):
    m = [statistics.median(c) for c in zip(*med[("mpi", path, w)])]
    d = [statistics.median(c) for c in zip(*med.get(("dtrain", path, w), [[float("nan")] * 4]))]
    print(f"| {w} | {path} | {' / '.join(f'{v:.1f}' for v in m)} | {' / '.join(f'{v:.1f}' for v in d)} | "
          f"{d[0] / m[0]:.2f}x, {d[2] / m[2]:.2f}x |")
print()
print("Per repetition (system path world rep mean p50 p99 max):")
print()
print("```")
for r in rows:
    print(" ".join(r))
print("```")
EOF
