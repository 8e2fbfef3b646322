#!/usr/bin/env bash
# Raw-video MIL-NCE throughput: `milnce train --raw-video` against the same job in PyTorch
# (benches/peers/milnce_video_torch.py: DDP over gloo, PyAV decoding in DataLoader workers), side by side in
# one run, on the same generated videos (milnce gen-video). Both sides decode with Debian's FFmpeg 5.1
# (dtrain links libavcodec; python3-av wraps the same library), run one compute thread per rank (BLAS
# included) and decode on 2 threads (dtrain's loader threads) or 2 worker processes (PyTorch's) per rank.
# The PyTorch side runs on /usr/bin/python3 (python3-torch 1.13 and python3-av): build dtrain against the
# same libtorch (Debian's 1.13: BUILD_DIR=build-torch1) for a like-for-like comparison.
# Usage: benches/milnce_video.sh [WORLD...]   (default: 2)
# Env: BUILD_DIR, DATA_DIR, BATCH (per rank, default 8), SIZE (64), FRAMES (16), WIDTH (S3D-G's, 0.25),
#      STEPS (timed steps, 20; 3 more warm up), VIDEO_PEER_PYTHON (default /usr/bin/python3).
set -euo pipefail
cores=$(nproc)  # before the export: nproc reports OMP_NUM_THREADS when it is set
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
data=${DATA_DIR:-$root/data/milnce-video}
batch=${BATCH:-8} size=${SIZE:-64} frames=${FRAMES:-16} width=${WIDTH:-0.25} steps=${STEPS:-20}
peer=${VIDEO_PEER_PYTHON:-/usr/bin/python3}
worlds=("$@")
((${#worlds[@]})) || worlds=(2)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[[ -f $data/meta.json ]] || "$build/bin/milnce" gen-video --out "$data" --progress off >/dev/null
echo "# raw-video MIL-NCE throughput (batch $batch per rank, ${frames}x${size}x${size} clips, S3D-G width $width," \
     "2 decoding threads/workers per rank); $(date -u +%F) $cores cores; load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# dtrain: $("$build/bin/dtrain-run" --version | grep -m1 libtorch); peer: torch $("$peer" -c 'import torch, av; print(torch.__version__, "+ PyAV", av.__version__)')"
for w in "${worlds[@]}"; do
  # dtrain: enough steps of one epoch; the first 3 warm up. From metrics.jsonl's step records: clips over
  # the steps' wall time, and the share of it spent waiting for decoded clips (data_wait_s).
  "$build/bin/dtrain-run" --standalone --nproc-per-node "$w" "$build/bin/milnce" train --raw-video --data "$data" \
    --out "$tmp/run$w" --epochs 1 --batch "$batch" --frames "$frames" --size "$size" --s3d-width "$width" \
    --stop-after-steps $((steps + 3)) --no-eval --no-progress --no-checkpoints >/dev/null
  read -r ours ours_wait < <(/usr/bin/python3 -c "
import json, sys
l = [r for r in map(json.loads, open(sys.argv[1])) if r['kind'] == 'step' and r['step'] > 3]
t = sum(r['step_s'] for r in l)
print(f'{sum(r[\"samples_per_s\"] * r[\"step_s\"] for r in l) / t:.2f}', f'{sum(r[\"data_wait_s\"] for r in l) / t:.3f}')" \
    "$tmp/run$w/metrics.jsonl")
  line=$("$peer" "$root/benches/peers/milnce_video_torch.py" "$data" "$w" --batch "$batch" --steps "$steps" \
    --warmup-steps 3 --frames "$frames" --size "$size" --width "$width" | grep torch-milnce-video)
  theirs=$(sed -n 's/.*clips_per_s=\([0-9.]*\).*/\1/p' <<<"$line")
  theirs_wait=$(sed -n 's/.*data_wait_share=\([0-9.]*\).*/\1/p' <<<"$line")
  ratio=$(/usr/bin/python3 -c "print(f'{$ours/$theirs:.2f}')")
  echo "world=$w dtrain_clips_per_s=$ours dtrain_data_wait_share=$ours_wait pytorch_clips_per_s=$theirs" \
       "pytorch_data_wait_share=$theirs_wait ratio=${ratio}x"
done
echo "# load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
