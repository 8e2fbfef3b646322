#!/usr/bin/env bash
# run.sh: the one way to run dtrain's benchmarks (benches/README.md says what each prints).
#
#   benches/run.sh comm [--quick|--smoke]          dtrain's allreduce against MPI, Gloo and memcpy in one
#                                                   run, markdown report (comm.sh)
#   benches/run.sh tails                           small-message allreduce latency: mean, p50, p99, max
#                                                   against OpenMPI, shm and tcp (tails.sh)
#   benches/run.sh sparse-ps                       the sparse parameter server against PyTorch sparse DDP
#                                                   over Gloo and against the TCP transport (sparse_ps.sh)
#   benches/run.sh tune [MODEL...]                  DDP bucket-size tuning (DTRAIN_TUNE) against a sweep of
#                                                   hand settings on mlp, conv and milnce (tune.sh)
#   benches/run.sh last-bucket [MODEL...]           DDP's last-bucket rule against PyTorch's buckets on mlp,
#                                                   conv and milnce, with timelines (last_bucket.sh)
#   benches/run.sh milnce [WORLD...]                MIL-NCE training, dtrain against PyTorch DDP (milnce.sh)
#   benches/run.sh milnce-video [WORLD...]          raw-video MIL-NCE, dtrain against PyTorch + PyAV (milnce_video.sh)
#   benches/run.sh instr-cost [BASE [HEAD [ITERS]]] instructions per 4 KiB allreduce, two revisions,
#                                                   under callgrind (instr_cost.sh)
#   benches/run.sh compare BASE_DIR HEAD_DIR [REPS] two builds' allreduce (shm, tcp) and DDP benchmarks,
#                                                   interleaved, median ratio per size (compare.sh);
#                                                   each DIR holds a copy of dtrain-run and dtrain-bench
#   benches/run.sh peer NAME [ARGS...]              one PyTorch peer driver: NAME = torch_ddp,
#                                                   gloo_collectives or milnce_torch (peers/NAME.py)
#   benches/run.sh [-n N] [--servers S] FAMILY [ARGS...]
#                                                   one dtrain-bench family (allreduce, allgather, ...,
#                                                   ddp, ps, pipeline; `benches/run.sh --help-bench`
#                                                   lists them): one process, or with -n N ranks per node
#                                                   (and S parameter servers) under dtrain-run --standalone
#
# Examples:
#   benches/run.sh comm --smoke
#   benches/run.sh -n 2 allreduce --transport shm --min-bytes 16M --max-bytes 16M
#   benches/run.sh -n 2 --servers 1 ps --mode sparse --steps 100
#   benches/run.sh ddp --steps 20                   # world 1, no launcher
#   benches/run.sh peer torch_ddp 2 20 64
#
# Env: BUILD_DIR (default <repo>/build; build with
#   cmake --build build -j2 --target dtrain-run dtrain-bench milnce).
# The exit status is the benchmark's: every benchmark checks its results and fails when they are wrong.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD_DIR:-$here/../build}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
need() {
  [[ -x $1 ]] || { echo "run.sh: $1 not found; build with: cmake --build $build -j2 --target $(basename "$1")" >&2; exit 2; }
}

(($#)) || { usage >&2; exit 2; }
case $1 in
  -h|--help) usage; exit 0 ;;
  --help-bench) need "$build/bin/dtrain-bench"; exec "$build/bin/dtrain-bench" --help ;;
  comm) shift; exec bash "$here/comm.sh" "$@" ;;
  tails) shift; exec bash "$here/tails.sh" "$@" ;;
  sparse-ps) shift; exec bash "$here/sparse_ps.sh" "$@" ;;
  tune) shift; exec bash "$here/tune.sh" "$@" ;;
  last-bucket) shift; exec bash "$here/last_bucket.sh" "$@" ;;
  milnce) shift; exec bash "$here/milnce.sh" "$@" ;;
  milnce-video) shift; exec bash "$here/milnce_video.sh" "$@" ;;
  instr-cost) shift; exec bash "$here/instr_cost.sh" "$@" ;;
  compare) shift; exec bash "$here/compare.sh" "$@" ;;
  peer)
    shift
    name=${1:-}
    case $name in
      torch_ddp|gloo_collectives|milnce_torch)
        shift
        source "$here/peer_python.sh"
        echo "# peer: $PEER_TORCH" >&2
        exec "$PEER_PYTHON" "$here/peers/$name.py" "$@" ;;
      *) echo "run.sh peer: unknown peer '$name' (torch_ddp, gloo_collectives, milnce_torch)" >&2; exit 2 ;;
    esac ;;
esac

nproc_per_node="" servers=""
while (($#)); do
  case $1 in
    -n|--nproc-per-node) nproc_per_node=${2:?run.sh: $1 needs a number}; shift 2 ;;
    --servers) servers=${2:?run.sh: --servers needs a number}; shift 2 ;;
    -*) echo "run.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
(($#)) || { echo "run.sh: which benchmark? (benches/run.sh --help)" >&2; exit 2; }
need "$build/bin/dtrain-bench"
if [[ -z $nproc_per_node && -z $servers ]]; then
  exec "$build/bin/dtrain-bench" "$@"
fi
need "$build/bin/dtrain-run"
launch=("$build/bin/dtrain-run" --standalone --nproc-per-node "${nproc_per_node:-1}")
[[ -z $servers ]] || launch+=(--servers "$servers")
exec "${launch[@]}" "$build/bin/dtrain-bench" "$@"
