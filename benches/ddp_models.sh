# ddp_models.sh: what benches/tune.sh and benches/last_bucket.sh share (sourced, not run): the three models
# they train with DDP and how one run's step time is read.
#
#   mlp     `dtrain-bench ddp` on the reference MLP (7.9M parameters, 31.6 MB of gradients), batch 64 per
#           rank, 30 timed steps; its ms_per_step
#   conv    `dtrain-bench ddp --model conv` (a conv net on 3x32x32 images, 2.8M parameters), batch 16 per
#           rank, 20 timed steps
#   milnce  `milnce train --hidden 2048 --embed 512` (12 MB of gradients) on generated data, 2 epochs of 31
#           steps; the mean step time of epoch 2 from metrics.jsonl
#
# stage_models SCRIPT TOOL...: checks that $build/bin has dtrain-run, dtrain-bench, milnce and each TOOL,
#   copies them into $tmp/bin (a rebuild of $build during the run cannot swap a binary mid-run), sets bin
#   (that directory) and run (the launcher at $world ranks), and generates milnce's data in $tmp/data when
#   $models holds milnce. Needs build, tmp, world and models.
# run_model SCRIPT MODEL [VAR=VALUE...] -- [ARG...]: one run of MODEL with those environment variables and
#   extra arguments. A failure, or a dtrain-bench run whose parameters are off its one-process reference,
#   ends the script. Sets model_ms (ms per step) and model_line (dtrain-bench's result line; empty for
#   milnce, whose run directory is $tmp/run).

stage_models() {
  local script=$1 f
  shift
  local tools=(dtrain-run dtrain-bench milnce "$@")
  for f in "${tools[@]}"; do
    [[ -x $build/bin/$f ]] || { echo "$script: $build/bin/$f not found; build with: cmake --build $build -j2 --target ${tools[*]}" >&2; exit 2; }
  done
  mkdir -p "$tmp/bin"
  for f in "${tools[@]}"; do cp "$build/bin/$f" "$tmp/bin/"; done
  bin=$tmp/bin
  run=("$bin/dtrain-run" --standalone --nproc-per-node "$world")
  if [[ " ${models[*]} " == *" milnce "* ]]; then "$bin/milnce" gen-data --out "$tmp/data" >/dev/null 2>&1; fi
}

run_model() {
  local script=$1 model=$2 envs=() out
  shift 2
  while (($#)) && [[ $1 != -- ]]; do envs+=("$1"); shift; done
  (($#)) && shift
  model_line=
  case $model in
    mlp | conv)
      local extra=(--steps 30 --batch 64)
      [[ $model == conv ]] && extra=(--model conv --steps 20 --batch 16)
      out=$(env "${envs[@]}" "${run[@]}" "$bin/dtrain-bench" ddp --progress off "${extra[@]}" "$@" 2>&1) ||
        { echo "$out" >&2; echo "$script: $model $* failed" >&2; exit 1; }
      model_line=$(grep -o 'dtrain-ddp .*' <<<"$out")
      [[ $model_line == *" wrong=0/"* ]] || { echo "$out" >&2; echo "$script: $model $*: wrong parameters" >&2; exit 1; }
      model_ms=$(sed -n 's/.* ms_per_step=\([0-9.]*\) .*/\1/p' <<<"$model_line") ;;
    milnce)
      rm -rf "$tmp/run"
      out=$(env "${envs[@]}" "${run[@]}" "$bin/milnce" train --data "$tmp/data" --out "$tmp/run" --epochs 2 --no-eval \
        --no-progress --hidden 2048 --embed 512 "$@" 2>&1) || { echo "$out" >&2; echo "$script: milnce $* failed" >&2; exit 1; }
      model_ms=$(/usr/bin/python3 -c "import json,sys; l=[r for r in map(json.loads, open(sys.argv[1])) if r['kind'] == 'step' and r['epoch'] >= 1]; print(f'{1e3 * sum(r[\"step_s\"] for r in l) / len(l):.2f}')" "$tmp/run/metrics.jsonl") ;;
    *) echo "$script: unknown model $model (mlp, conv or milnce)" >&2; exit 2 ;;
  esac
}
