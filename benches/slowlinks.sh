#!/usr/bin/env bash
# slowlinks.sh: the remedies for slow links on the emulated cluster (scripts/cluster.sh), side by side
# in one run with PyTorch DDP on the same rig (issue 12; docs/PERFORMANCE.md "Slow links").
#
#   benches/slowlinks.sh [--gbit G (1)] [--layouts "2x1 2x2"] [--steps N (20)] [--warmup W (10)]
#                        [--batch B (64)] [--hooks "none fp16 powersgd:4:2 topk:0.01"] [--reps R (1)]
#                        [--skip-torch] [--skip-collectives] [--out DIR]
#
# For each layout HxP (H hosts, P processes each, links at G Gbit/s), alternating sides per rep:
#   - dtrain-bench ddp (reference MLP, 7.9M parameters) with each hook; with --local-sgd when the
#     build's dtrain-bench has it: local SGD of period 8 (ddp --local-sgd 8);
#   - benches/peers/torch_ddp.py under torchrun: fp32, the fp16 hook and powerSGD_hook (rank 4, start
#     step 2) on PEER_PYTHON's torch (benches/peer_python.sh) — PowerSGD over gloo with 2+ ranks
#     crashes in PyTorch 1.13 and in 2.15 alike (gloo::EnforceNotMet); the crash is recorded;
#   - at 2x1: dtrain-bench allreduce 16-64 MiB (busbw against the link rate); at HxP with P > 1: the
#     hierarchical allreduce against the flat ring (DTRAIN_ALGO=ring) on the same sizes.
# Plus T_nocomm: dtrain-bench ddp alone (one process, no communication), and on one host the fp16 hook
# against no hook (2 ranks, shm). Timing starts after W warm-up steps on both sides; every line names
# its bytes per step. Raw outputs go to DIR (default /tmp/slowlinks-<date>), a markdown summary to stdout.
# Needs root (the rig), a quiet machine, and a build (BUILD_DIR, default <repo>/build).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD_DIR:-$here/../build}
bin=$(cd "$build/bin" && pwd)
gbit=1 layouts="2x1 2x2" steps=20 warmup=10 batch=64 reps=1 torch=1 colls=1
hooks="none fp16 powersgd:4:2 topk:0.01"
out=/tmp/slowlinks-$(date +%Y%m%d-%H%M%S)
while (($#)); do
  case $1 in
    --gbit) gbit=$2; shift 2 ;;
    --layouts) layouts=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --batch) batch=$2; shift 2 ;;
    --hooks) hooks=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --skip-torch) torch=0; shift ;;
    --skip-collectives) colls=0; shift ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "slowlinks.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
rig() {  # rig LOG H P LAUNCHER [run options...] -- PROGRAM...: one shot on the rig; the log keeps everything
  local log=$1 h=$2 p=$3 launcher=$4; shift 4
  timeout -k 10 900 bash "$here/../scripts/cluster.sh" --hosts "$h" --nproc-per-host "$p" --gbit "$gbit" \
    --bin-dir "$bin" --launcher "$launcher" --timeout 850 "$@" >"$log" 2>&1
}
field() { grep -o "$2=[^ ]*" "$1" | head -1 | cut -d= -f2; }  # field LOG NAME
line() { grep -h -m1 -o "$1.*" "$2" || true; }

has_local_sgd=0
"$bin/dtrain-bench" ddp --help 2>/dev/null | grep -q -- --local-sgd && has_local_sgd=1

echo "# slow links: gbit=$gbit steps=$steps warmup=$warmup batch=$batch reps=$reps ($(date -u +%FT%TZ), $(nproc) cores)"
echo "raw outputs: $out"
# T_nocomm: one process alone.
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 "$bin/dtrain-bench" ddp --steps "$steps" \
  --warmup "$warmup" --batch "$batch" --progress off >"$out/nocomm.txt" 2>&1
echo "T_nocomm: $(field "$out/nocomm.txt" ms_per_step) ms/step ($(line dtrain-ddp "$out/nocomm.txt"))"

for layout in $layouts; do
  h=${layout%x*} p=${layout#*x}
  echo
  echo "## $layout ($h hosts x $p processes, $gbit Gbit/s)"
  echo
  echo "| side | config | ms/step | samples/s | bytes/step/rank | note |"
  echo "| --- | --- | --- | --- | --- | --- |"
  for ((rep = 0; rep < reps; ++rep)); do
    configs=()
    for hk in $hooks; do configs+=("dtrain:$hk"); done
    ((has_local_sgd)) && configs+=("dtrain:local-sgd:8")
    if ((torch)); then configs+=("torch:none" "torch:fp16" "torch:powersgd:4"); fi
    for cfg in "${configs[@]}"; do
      side=${cfg%%:*} what=${cfg#*:}
      log="$out/${layout}_${side}_${what//:/-}_$rep.txt"
      note=""
      if [[ $side == dtrain ]]; then
        if [[ $what == local-sgd:* ]]; then args=(--local-sgd "${what#local-sgd:}"); else args=(--hook "$what"); fi
        rig "$log" "$h" "$p" dtrain -- "$bin/dtrain-bench" ddp --steps "$steps" --warmup "$warmup" --batch "$batch" \
          --progress off "${args[@]}" || note="failed (exit $?)"
        l=$(line dtrain-ddp "$log")
      else
        rig "$log" "$h" "$p" torchrun -- "$here/peers/torch_ddp.py" env "$steps" "$batch" \
          --hook "$what" --warmup "$warmup" || note="failed (exit $?): $(grep -m1 -o 'EnforceNotMet.*\|Error: .*' "$log" | head -c 160 || true)"
        l=$(line torch-ddp "$log")
      fi
      if [[ -n $l ]]; then
        printf '| %s | %s | %s | %s | %s | %s |\n' "$side" "$what" "$(grep -o 'ms_per_step=[^ ]*' <<<"$l" | cut -d= -f2)" \
          "$(grep -o 'samples_per_s=[^ ]*' <<<"$l" | cut -d= -f2)" "$(grep -o 'bytes_per_step=[^ ]*' <<<"$l" | cut -d= -f2)" "$note"
      else
        printf '| %s | %s | - | - | - | %s |\n' "$side" "$what" "${note:-no result line}"
      fi
    done
  done
  ((colls)) || continue
  echo
  if ((p == 1)); then
    log="$out/${layout}_allreduce.txt"
    rig "$log" "$h" "$p" dtrain -- "$bin/dtrain-bench" allreduce --min-bytes 16M --max-bytes 64M --factor 2 --iters 5 --progress off || true
    echo "allreduce $layout (link $gbit Gbit/s = $(awk -v g="$gbit" 'BEGIN { printf "%.0f", g * 125 }') MB/s):"
    grep -h "^\[host 0\] \[rank 0\]: *[0-9]" "$log" | sed 's/^\[host 0\] \[rank 0\]: */    /' || true
  else
    for algo in hierarchical ring; do
      log="$out/${layout}_allreduce_$algo.txt"
      rig "$log" "$h" "$p" dtrain --env DTRAIN_ALGO="$algo" -- "$bin/dtrain-bench" allreduce --min-bytes 16M --max-bytes 64M \
        --factor 2 --iters 5 --progress off || true
      echo "allreduce $layout DTRAIN_ALGO=$algo:"
      grep -h "^\[host 0\] \[rank 0\]: *[0-9]" "$log" | sed 's/^\[host 0\] \[rank 0\]: */    /' || true
    done
  fi
done

echo
echo "## one host, 2 ranks (shm): fp16 hook against none"
for ((rep = 0; rep < 3; ++rep)); do
  for hk in none fp16; do
    "$bin/dtrain-run" --standalone --nproc-per-node 2 "$bin/dtrain-bench" ddp --steps "$steps" --warmup "$warmup" \
      --batch "$batch" --hook "$hk" --progress off >"$out/onehost_${hk}_$rep.txt" 2>&1 || true
    echo "    $hk rep $rep: $(line dtrain-ddp "$out/onehost_${hk}_$rep.txt")"
  done
done
