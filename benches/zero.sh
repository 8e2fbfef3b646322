#!/usr/bin/env bash
# zero.sh: the sharded training state (ZeRO, issue 13; docs/PERFORMANCE.md "ZeRO") on this machine.
#   speed    the reference MLP (7.9M parameters, batch 64 per rank, Adam) on 2 ranks of one host:
#            dtrain DDP, ZeRO stage 1 (ZeroRedundancyOptimizer), stages 2 and 3 (FullyShardedDataParallel)
#            and PyTorch's ZeroRedundancyOptimizer over DDP (benches/peers/torch_ddp.py --opt zero-adam,
#            gloo), REPS interleaved runs each; medians of samples/s and the ratios the issue sets.
#   memory   a 100.7M-parameter model (--layers 6 x Linear(--width 4096), batch 8, Adam) at 2 and 4 ranks:
#            every rank's model-state bytes per mode as dtrain-bench zero counts them, against its peak
#            resident memory while training (VmHWM) minus that of the same program without a model
#            (--mode empty); for stage 3 (with prefetch, and without: zero3-lean) the issue's check, against
#            1/W of DDP's model state plus two units. glibc's mmap threshold is fixed at 1 MiB unless
#            --default-malloc.
#   limit    the same model at 4 ranks under `prlimit --data=LIMIT` per process: DDP, then stage 3.
#
#   benches/zero.sh [speed] [memory] [limit] [--reps 5] [--limit 1400M] [--layers 6 --width 4096]
#                   [--default-malloc]                                       (default: all three)
# Needs a build (BUILD_DIR, default <repo>/build), the peer's torch (benches/peer_python.sh), a quiet machine and about
# 8 GB of free memory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/peer_python.sh"
build=${BUILD_DIR:-$here/../build}
bin=$(cd "$build/bin" && pwd)
reps=5 limit=1400M layers=6 width=4096 parts=()
while (($#)); do
  case $1 in
    --reps) reps=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --width) width=$2; shift 2 ;;
    --default-malloc) export ZERO_MALLOC_TUNABLES=; shift ;;
    speed|memory|limit) parts+=("$1"); shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "zero.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
((${#parts[@]})) || parts=(speed memory limit)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
run() {  # run NPROC ARGS...: dtrain-bench zero under dtrain-run
  local n=$1
  shift
  "$bin/dtrain-run" --standalone --nproc-per-node "$n" "$bin/dtrain-bench" zero --progress off "$@"
}
field() { grep -o "$1=[0-9.]*" | head -1 | cut -d= -f2; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

speed() {
  local tmp
  tmp=$(mktemp -d)
  echo "== speed: reference MLP, 2 ranks, Adam, $reps interleaved runs (samples/s, rank 0)"
  for ((i = 1; i <= reps; i++)); do
    for m in ddp zero1 zero2 zero3; do
      run 2 --mode "$m" --steps 20 | grep "rank 0\]" | field samples_per_s >>"$tmp/$m"
    done
    "$PEER_PYTHON" "$here/peers/torch_ddp.py" 2 20 --opt zero-adam | field samples_per_s >>"$tmp/torch-zero1"
  done
  for m in ddp zero1 zero2 zero3 torch-zero1; do printf '%-12s %s   (runs: %s)\n' "$m" "$(median <"$tmp/$m")" "$(tr '\n' ' ' <"$tmp/$m")"; done
  local d z1 z2 z3 tz
  d=$(median <"$tmp/ddp") z1=$(median <"$tmp/zero1") z2=$(median <"$tmp/zero2") z3=$(median <"$tmp/zero3")
  tz=$(median <"$tmp/torch-zero1")
  awk -v d="$d" -v a="$z1" -v b="$z2" -v c="$z3" -v t="$tz" 'BEGIN {
    printf "stage 1 / DDP %.2f (target >= 0.90)\nstage 2 / DDP %.2f (target >= 0.90)\n", a / d, b / d
    printf "stage 3 / DDP %.2f (target >= 0.75)\nstage 1 / PyTorch ZeroRedundancyOptimizer %.2f (target >= 1.3)\n", c / d, a / t }'
  rm -rf "$tmp"
}

memory() {
  # glibc's malloc keeps freed blocks below its (self-raising) mmap threshold resident, and on these
  # models 100-170 MB of them are free at the peak; a fixed threshold returns every freed block of 1 MiB
  # or more at once (docs/ZERO.md "Memory"). --default-malloc measures without it.
  local tun=${ZERO_MALLOC_TUNABLES-glibc.malloc.mmap_threshold=1048576}
  echo "== memory: $layers x Linear($width, $width), Adam, batch 8 per rank (bytes per rank; GLIBC_TUNABLES=$tun)"
  local unit=$((width * (width + 1) * 4))
  for n in 2 4; do
    local base ddp_state=0
    base=$(GLIBC_TUNABLES=$tun run "$n" --mode empty | grep -o "vmhwm_bytes=[0-9]*" | cut -d= -f2 | median)
    echo "-- $n ranks; the program without a model peaks at $base bytes resident"
    printf '%-11s %4s %11s %11s %11s %11s %12s %12s %6s %12s %12s\n' mode rank params grads optim transient model_state \
      vmhwm-empty ratio build-peak bound
    for m in ddp zero1 zero2 zero3 zero3-lean; do
      local args=(--mode "${m%-lean}")
      [[ $m == *-lean ]] && args+=(--no-prefetch)
      while read -r line; do
        local st hwm bound=- check=
        st=$(field model_state_bytes <<<"$line") hwm=$(field vmhwm_bytes <<<"$line")
        [[ $m == ddp ]] && ddp_state=$st
        if [[ $m == zero3* ]]; then  # the issue's bound: 1/W of DDP's model state plus two units
          bound=$((ddp_state / n + 2 * unit))
          check=$(awk -v a="$((hwm - base))" -v b="$bound" 'BEGIN {printf "  (vmhwm-empty / bound %.2f: %s)", a / b, a <= 1.15 * b ? "within 15%" : "NOT within 15%"}')
        fi
        printf '%-11s %4s %11s %11s %11s %11s %12s %12s %6.2f %12s %12s%s\n' "$m" "$(field rank <<<"$line")" \
          "$(field param_bytes <<<"$line")" "$(field grad_bytes <<<"$line")" "$(field optim_bytes <<<"$line")" \
          "$(field transient_bytes <<<"$line")" "$st" "$((hwm - base))" "$(awk -v a="$((hwm - base))" -v b="$st" 'BEGIN {print a / b}')" \
          "$(($(field build_vmhwm_bytes <<<"$line") - base))" "$bound" "$check"
      done < <(GLIBC_TUNABLES=$tun run "$n" "${args[@]}" --model wide --layers "$layers" --width "$width" --batch 8 --steps 3 --warmup 1 |
        grep -o "dtrain-zero .*" | sort -t= -k4 -n)
    done
  done
}

limit() {
  echo "== limit: 4 ranks, the 100.7M-parameter model, prlimit --data=$limit per process"
  for m in ddp zero3; do
    # (prlimit wants bytes: with a suffix, util-linux 2.38's prlimit crashes)
    if out=$(prlimit --data="$(numfmt --from=iec "$limit")" "$bin/dtrain-run" --standalone --nproc-per-node 4 "$bin/dtrain-bench" zero --progress off \
        --mode "$m" --model wide --batch 8 --steps 2 --warmup 1 2>&1); then
      echo "$m: trained ($(grep -o 'rank 0\]: .*' <<<"$out" | grep -o 'model_state_bytes=[0-9]*'))"
    else
      echo "$m: failed: $(grep -m1 -o 'dtrain-bench zero: .*' <<<"$out" | cut -c1-200)"
    fi
  done
}

for p in "${parts[@]}"; do "$p"; done
