#!/usr/bin/env bash
# gpu_check.sh: builds the CUDA variant of dtrain on a GPU machine and runs what only a GPU can check,
# writing logs and a summary to OUT_DIR (summary.txt: one PASS / FAIL / NOT RUN line per point, and INFO
# lines for the measurements, which pass or fail nothing). It cannot pass by accident: a machine that shows
# a GPU (nvidia-smi -L) where no GPU test ran is a FAIL, and so is any non-zero exit, one at process exit
# included.
#
#   bash scripts/gpu_check.sh OUT_DIR [DEBS_DIR]
#   bash scripts/gpu_check.sh --fetch-debs DEBS_DIR     # on a Debian machine with its archive: the .debs
#
# The machine it is made for (docs/GPU.md, "The GPU machine"): Ubuntu 24.04, GCC 13, CMake 4,
# 16 cores, one GPU, PyTorch 2.x with CUDA in a virtual environment (PYTHON, default: the first of
# /opt/torch/.venv/bin/python and python3 whose torch has CUDA), no network. The build dependencies it
# lacks (nlohmann-json, CLI11, GoogleTest, fmt) come as Debian .debs in DEBS_DIR (default
# <repo>/.gpu-debs, which git ignores; --fetch-debs fills it), unpacked with dpkg -x into BUILD_DIR/deps-prefix,
# never into /. Everything is bounded: about 2-3 minutes to build with every core, then the checks:
#   1. gpu_test (tests/gpu): DDP (SGD and Adam) on the MLP and on the MIL-NCE model with CUDA tensors equal
#      to one process (2 ranks sharing the GPU: staged; NCCL at world 1; NCCL on 2 GPUs where 2 exist; NCCL
#      with 2 ranks on one GPU where NCCL 2.30+ accepts it, with its timeout, mismatch and peer-death
#      paths), FSDP stage 3, PowerSGD and SyncBatchNorm on CUDA equal to the CPU, a peer killed
#      mid-collective on the staged path, CPU and CUDA ranks in one group refused, the staged path at
#      64 MiB and after a slow producer by value, a checkpoint saved from CUDA tensors loaded on the CPU
#      and restored onto CUDA. Skipped tests are listed as NOT RUN, with the reason.
#   2. device_test, local_step_test: the device layer's CPU-side tests in the CUDA build, on this machine.
#   3. dtrain-bench ddp --device cuda against PyTorch DDP on the same GPU in the same run (world 1: NCCL on
#      both sides; world 2: dtrain staged, PyTorch Gloo with CUDA tensors): the step-time ratio (INFO); and
#      NCCL at world 2 with and without DTRAIN_DEBUG=detail's fingerprint check, where NCCL can run 2 ranks.
#   Checks 3-5 are NOT RUN, with torch's reason, where torch sees no GPU (a FAIL if nvidia-smi shows one).
#   4. milnce train --device cuda against the same run on the CPU (one process each, the same batch and
#      generated data), MILNCE_EPOCHS epochs (default 8, to stay in the time budget): R@10 within 1 point,
#      and the wall time of each.
#   5. milnce train --raw-video --device cuda on generated videos (where the machine has FFmpeg's
#      development libraries; NOT RUN otherwise).
# Env: PYTHON, JOBS (default: every core), MILNCE_EPOCHS, DTRAIN_WITH_MPI (OFF: the GPU machine has no MPI),
# BUILD_DIR (default <repo>/build-gpu; the data and runs of check 4 go there too, and only their logs and
# eval.json to OUT_DIR).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
debs_list=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev googletest)

if [[ ${1:-} == --fetch-debs ]]; then
  dir=${2:?usage: gpu_check.sh --fetch-debs DEBS_DIR}
  mkdir -p "$dir" && cd "$dir" && apt-get download "${debs_list[@]}"
  exit $?
fi
out=${1:?usage: gpu_check.sh OUT_DIR [DEBS_DIR]}
mkdir -p "$out"
out=$(cd "$out" && pwd)
debs=${2:-$root/.gpu-debs}
build=${BUILD_DIR:-$root/build-gpu}  # not under OUT_DIR: only logs and results go there
jobs=${JOBS:-$(nproc)}
epochs=${MILNCE_EPOCHS:-8}
summary=$out/summary.txt
: >"$summary"
log() { echo "gpu_check: $*" | tee -a "$out/gpu_check.log"; }
result() { echo "$1  $2" | tee -a "$summary"; }   # result PASS|FAIL|NOT RUN  what
started=$SECONDS

# ---- the Python with a CUDA torch ----
python=${PYTHON:-}
if [[ -z $python ]]; then
  for p in /opt/torch/.venv/bin/python "$root/.venv/bin/python" python3; do
    if "$p" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then python=$p; break; fi
  done
fi
if [[ -z $python ]]; then
  result "FAIL" "no Python with a CUDA build of torch (set PYTHON)"
  exit 1
fi
torch_root=$("$python" -c 'import torch; print(torch.__path__[0])')
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -srm), $(nproc) cores"
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))'
  nvidia-smi -L 2>/dev/null || true
  echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "nvcc: $( (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null) | grep -o 'release [0-9.]*' | head -1)"
  "$python" -c 'import torch; print("NCCL loaded by torch:", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")' 2>/dev/null
  echo "dtrain: $(git -C "$root" rev-parse --short HEAD 2>/dev/null)$(git -C "$root" diff --quiet 2>/dev/null || echo ' (with local changes)')"
} | tee "$out/machine.txt"
# A GPU the driver shows: then the GPU tests must run (a build or runtime that cannot see it is a FAIL).
gpu_here=0
nvidia-smi -L 2>/dev/null | grep -q "^GPU " && gpu_here=1
# What torch sees (checks 3-5 need a GPU it can use: NOT RUN, with this reason, where it has none).
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
no_gpu_why=""
if [[ $gpus == 0 ]]; then
  no_gpu_why=$("$python" -c '
import torch
try:
    torch.cuda.init(); print("torch sees no GPU")
except Exception as e:
    print(str(e).splitlines()[0][:160])' 2>&1 | tail -1)
  [[ $gpu_here == 1 ]] && result "FAIL" "nvidia-smi shows a GPU, but torch cannot use it: $no_gpu_why"
fi
nccl_ver=$("$python" -c 'import torch; print(".".join(map(str, torch.cuda.nccl.version())))' 2>/dev/null || echo "")

# ---- build dependencies from .debs, unpacked into a prefix ----
prefix=$build/deps-prefix
mkdir -p "$build" "$prefix"
shopt -s nullglob
for d in "$debs"/*.deb; do dpkg -x "$d" "$prefix" || log "could not unpack $d"; done
shopt -u nullglob
prefixes="$torch_root;$prefix/usr"

# ---- build the CUDA variant ----
log "configuring in $build (torch at $torch_root)"
if ! cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefixes" \
     -DDTRAIN_CUDA=ON -DDTRAIN_WITH_MPI="${DTRAIN_WITH_MPI:-OFF}" -DDTRAIN_BUILD_TESTS=ON -DDTRAIN_TEST_PYTHON="$python" \
     -DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" >"$out/configure.log" 2>&1; then
  result "FAIL" "configure (configure.log)"
  tail -30 "$out/configure.log"
  exit 1
fi
targets=(gpu_test device_test local_step_test dtrain-bench dtrain-run milnce example-ddp)
if ! cmake --build "$build" -j"$jobs" --target "${targets[@]}" >"$out/build.log" 2>&1; then
  result "FAIL" "build (build.log)"
  grep -m20 -B2 -A6 "error" "$out/build.log"
  exit 1
fi
result "PASS" "CUDA build with DTRAIN_CUDA=ON: ${targets[*]} ($((SECONDS - started)) s so far)"
bin=$build/bin

# ---- 1, 2: the tests (gtest's JSON says which ran, passed, failed or skipped) ----
run_tests() {  # run_tests NAME SECONDS
  local name=$1 limit=$2
  timeout "$limit" "$bin/$name" --gtest_output="json:$out/$name.json" >"$out/$name.log" 2>&1
  local rc=$?
  "$python" - "$out/$name.json" "$name" "$rc" "$out/$name.log" "$gpu_here" <<'PY' | tee -a "$summary"
import json, re, sys
path, name, rc, log, gpu_here = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
why, last = {}, ""  # a skipped test's reason, from the log (gtest's JSON does not keep it)
for line in open(log, errors="replace"):
    if "not run:" in line:
        last = line.strip()
    m = re.match(r"\[  SKIPPED \] (\S+) \(", line)
    if m:
        why[m.group(1)] = last
try:
    doc = json.load(open(path))
except Exception as e:
    print(f"FAIL  {name}: exit {rc}, no results ({e})"); sys.exit()
passed = failed = 0
for suite in doc["testsuites"]:
    for t in suite["testsuite"]:
        full = f"{suite['name']}.{t['name']}"
        if t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
            print(f"NOT RUN  {name} {full} {why.get(full, '')[:200]}")
        elif t.get("failures"):
            failed += 1
            print(f"FAIL  {name} {full}: {t['failures'][0]['failure'].splitlines()[0][:200]}")
        else:
            passed += 1
            print(f"PASS  {name} {full} ({t.get('time', '?')})")
if rc != 0 and not failed:  # every test passed or was skipped, yet the process failed (at exit, say)
    print(f"FAIL  {name}: exit {rc} after its tests ({name}.log)")
if name == "gpu_test" and gpu_here and not passed:
    print(f"FAIL  {name}: nvidia-smi shows a GPU, but no GPU test ran (each was skipped: see the NOT RUN lines)")
PY
}
run_tests gpu_test 300
run_tests device_test 120
run_tests local_step_test 120

# ---- 3: DDP step time against PyTorch on the same GPU ----
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
if [[ $gpus == 0 ]]; then
  for point in "ddp --device cuda against PyTorch (check 3)" "the NCCL fingerprint check's cost (check 3)" \
               "milnce train --device cuda against the CPU (check 4)" "milnce train --raw-video --device cuda (check 5)"; do
    result "NOT RUN" "$point: no GPU here ($no_gpu_why)"
  done
  log "done in $((SECONDS - started)) s"
  echo "---- summary ($summary)"
  cat "$summary"
  ! grep -q "^FAIL" "$summary"
  exit
fi
bench() {  # bench LABEL COMMAND...: the last line of the command's output, into bench.txt
  local label=$1
  shift
  local line
  line=$(timeout 180 "$@" 2>>"$out/bench.err" | tail -1)
  echo "$label: ${line:-(no output, see bench.err)}" | tee -a "$out/bench.txt"
}
: >"$out/bench.txt"
bench "dtrain world=1" "$bin/dtrain-bench" ddp --device cuda --steps 50
bench "torch world=1" "$python" "$root/benches/peers/torch_ddp.py" 1 50 --device cuda
bench "dtrain world=2" "$bin/dtrain-run" --standalone --nproc-per-node 2 "$bin/dtrain-bench" ddp --device cuda --steps 50
bench "torch world=2" "$python" "$root/benches/peers/torch_ddp.py" 2 50 --device cuda
# The NCCL fingerprint check (DTRAIN_DEBUG=detail: a host exchange before every op) against none, at
# world 2 on NCCL: two ranks on this one GPU, where NCCL accepts that (2.30+, NCCL_MULTI_RANK_GPU_ENABLE=1).
fp_why=""
if [[ $gpus -ge 2 ]]; then
  fp_env=(env DTRAIN_CUDA_COMM=nccl)
elif "$python" -c "import sys; v=tuple(map(int,'$nccl_ver'.split('.')[:2])); sys.exit(0 if v >= (2, 30) else 1)" 2>/dev/null; then
  fp_env=(env DTRAIN_CUDA_COMM=nccl NCCL_MULTI_RANK_GPU_ENABLE=1)
else
  fp_why="one GPU and NCCL ${nccl_ver:-?}: two ranks on one GPU need NCCL 2.30 or later (NCCL_MULTI_RANK_GPU_ENABLE=1)"
fi
if [[ -z $fp_why ]]; then
  bench "dtrain world=2 nccl" "${fp_env[@]}" "$bin/dtrain-run" --standalone --nproc-per-node 2 "$bin/dtrain-bench" ddp --device cuda --steps 50
  bench "dtrain world=2 nccl detail" "${fp_env[@]}" DTRAIN_DEBUG=detail "$bin/dtrain-run" --standalone --nproc-per-node 2 \
    "$bin/dtrain-bench" ddp --device cuda --steps 50
else
  result "NOT RUN" "the NCCL fingerprint check's cost: $fp_why"
fi
"$python" - "$out/bench.txt" <<'PY' | tee -a "$summary"
import re, sys
ms = {}
for line in open(sys.argv[1]):
    label, _, rest = line.partition(": ")
    m = re.search(r"ms_per_step=([0-9.]+)", rest)
    if m:
        ms[label] = float(m.group(1))
    if label.startswith("dtrain") and "wrong=" in rest and "wrong=0/" not in rest:
        print(f"FAIL  {label}: the benchmark's parameters differ from its one-process reference: {rest.strip()}")
for w in (1, 2):
    d, t = ms.get(f"dtrain world={w}"), ms.get(f"torch world={w}")
    if d and t:
        print(f"INFO  ddp --device cuda world={w}: dtrain {d:.2f} ms/step, PyTorch {t:.2f} ms/step, "
              f"PyTorch/dtrain = {t / d:.2f}x")
    else:
        print(f"FAIL  ddp --device cuda world={w}: no step time (dtrain {d}, torch {t}; bench.txt, bench.err)")
off, on = ms.get("dtrain world=2 nccl"), ms.get("dtrain world=2 nccl detail")
if off and on:
    print(f"INFO  NCCL fingerprint check (DTRAIN_DEBUG=detail) at world=2: {on:.2f} ms/step with it, {off:.2f} without, "
          f"{on / off:.2f}x")
PY

# ---- 4: MIL-NCE on the GPU against the README job on the CPU ----
data=$build/milnce-data
"$bin/milnce" gen-data --out "$data" >"$out/milnce-gen.log" 2>&1
t0=$SECONDS
timeout 240 "$bin/milnce" train --data "$data" --out "$build/milnce-gpu" --epochs "$epochs" --device cuda --no-progress \
  >"$out/milnce-gpu.log" 2>&1
gpu_rc=$? gpu_s=$((SECONDS - t0))
t0=$SECONDS
# Like with like: one process on the CPU too, with the same (default) batch.
timeout 300 "$bin/milnce" train --data "$data" --out "$build/milnce-cpu" --epochs "$epochs" --device cpu --no-progress \
  >"$out/milnce-cpu.log" 2>&1
cpu_rc=$? cpu_s=$((SECONDS - t0))
for r in milnce-gpu milnce-cpu; do cp "$build/$r/eval.json" "$out/$r-eval.json" 2>/dev/null; done
"$python" - "$out" "$gpu_rc" "$gpu_s" "$cpu_rc" "$cpu_s" "$epochs" <<'PY' | tee -a "$summary"
import json, os, sys
out, gpu_rc, gpu_s, cpu_rc, cpu_s, epochs = sys.argv[1], *map(int, sys.argv[2:])
def r10(run):  # the last epoch's evaluation in the run's eval.json (fractions)
    try:
        return json.load(open(os.path.join(out, run + "-eval.json")))["after"]["R@10"]
    except Exception:
        return None
g, c = r10("milnce-gpu"), r10("milnce-cpu")
if gpu_rc or cpu_rc or g is None or c is None:
    print(f"FAIL  milnce --device cuda: exit {gpu_rc} (gpu), {cpu_rc} (cpu); R@10 {g} / {c} (milnce-*.log)")
else:
    ok = abs(g - c) <= 0.01  # the times are measurements, not a criterion
    print(f"{'PASS' if ok else 'FAIL'}  milnce train {epochs} epochs: GPU R@10 {100 * g:.1f}%, CPU R@10 {100 * c:.1f}% "
          f"(one process each, the same batch: within 1 point: {ok})")
    print(f"INFO  milnce train {epochs} epochs: {gpu_s} s on the GPU, {cpu_s} s on the CPU")
PY

# ---- 5: raw video on the GPU: decoded clips (uint8) moved to the GPU, S3D-G there ----
if grep -q "built without raw video" "$out/configure.log"; then
  result "NOT RUN" "milnce train --raw-video --device cuda: no FFmpeg development libraries on this machine (configure.log)"
else
  vdata=$build/milnce-video
  "$bin/milnce" gen-video --out "$vdata" --videos 64 --eval-videos 4 --progress off >"$out/milnce-video-gen.log" 2>&1
  timeout 300 "$bin/milnce" train --raw-video --data "$vdata" --out "$build/milnce-video-gpu" --epochs 2 --batch 8 \
    --size 32 --frames 8 --crop-and-scale --device cuda --no-progress >"$out/milnce-video-gpu.log" 2>&1
  vrc=$?
  if [[ $vrc == 0 && -f $build/milnce-video-gpu/eval.json ]]; then
    result "PASS" "milnce train --raw-video --device cuda: 2 epochs, $(grep -m1 'after training' "$out/milnce-video-gpu.log" | tr -s ' ')"
  else
    result "FAIL" "milnce train --raw-video --device cuda: exit $vrc (milnce-video-gpu.log)"
  fi
fi

log "done in $((SECONDS - started)) s"
echo "---- summary ($summary)"
cat "$summary"
! grep -q "^FAIL" "$summary"
