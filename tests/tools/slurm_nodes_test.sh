#!/usr/bin/env bash
# Slurm across two nodes: scripts/slurm.sh start --nodes 2 brings up slurmctld and one slurmd in each of
# two network namespaces of the emulated cluster (nodes dtn0 and dtn1). Then, with the store found from
# Slurm's variables alone (no MASTER_ADDR):
#   1. srun -N 2 -n 4 example-allreduce: 2 ranks in each namespace, every rank gets the right sum;
#   2. sbatch --wait -N 2 examples/slurm/milnce_train.sbatch: 4 ranks of MIL-NCE training on both nodes.
# The cluster is always taken down (EXIT trap), and every step is bounded (265 s in all; CTest allows 360).
#
#   bash tests/tools/slurm_nodes_test.sh SOURCE_DIR BIN_DIR
#
# Needs root and the packages munge slurmctld slurmd slurm-client (scripts/setup.sh): without them it
# fails, saying so, like tests/tools/slurm_test.cc, rather than skip.
set -euo pipefail
ts=${DTRAIN_TEST_TIME_SCALE:-1}  # every deadline below x this (tests/harness.h)

src=${1:?usage: slurm_nodes_test.sh SOURCE_DIR BIN_DIR}
bin=${2:?usage: slurm_nodes_test.sh SOURCE_DIR BIN_DIR}
src=$(cd "$src" && pwd)
bin=$(cd "$bin" && pwd)

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || fail "needs root (network namespaces, and slurmd starts the tasks): run as root, as CI does"
for b in example-allreduce milnce; do [[ -x $bin/$b ]] || fail "no $bin/$b (build it first)"; done

work=$(mktemp -d /tmp/dtrain-slurm-nodes.XXXXXX)
slurm() { bash "$src/scripts/slurm.sh" "$@"; }
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  slurm stop "$work/slurm" || echo "slurm_nodes_test: slurm.sh stop failed" >&2
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
cd "$work"

# 2 CPUs a node (the machine's count): -N 2 -n 4 then puts 2 tasks on each node (with more CPUs Slurm
# fills the first node: 3 and 1).
t0=$SECONDS
CPUS=2 START_TIMEOUT=$((40 * ts)) timeout $((90 * ts)) bash "$src/scripts/slurm.sh" start "$work/slurm" --nodes 2 --owner $$ >/dev/null ||
  fail "could not start a two-node Slurm (scripts/slurm.sh start --nodes 2; needs munge slurmctld slurmd slurm-client)"
echo "slurm_nodes_test: two-node Slurm up in $((SECONDS - t0)) s"

# ---- 1. srun -N 2 -n 4 example-allreduce ---------------------------------------------------------
# Each task says where it runs (node name, network namespace), what the first node's name resolves
# to there, and that no MASTER_ADDR was given; then runs the example.
t0=$SECONDS
rc=0
# shellcheck disable=SC2016  # (expanded by each task's bash)
slurm run "$work/slurm" -- timeout $((45 * ts)) srun -N 2 -n 4 -l bash -c '
  first=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1)
  echo "where: node=$SLURMD_NODENAME netns=$(readlink /proc/self/ns/net) first=$first=$(getent hosts "$first" | cut -d" " -f1) master=${MASTER_ADDR:-unset}"
  exec "$0"' "$bin/example-allreduce" >srun.log 2>&1 || rc=$?
echo "slurm_nodes_test: srun -N 2 -n 4 example-allreduce: exit $rc in $((SECONDS - t0)) s"
sed 's/^/  /' srun.log
((rc == 0)) || fail "srun exited with $rc"
declare -A ns_of
for r in 0 1 2 3; do
  grep -Eq "^$r: rank $r of 4 \([a-z+]+\): sum = 6 \(expected 6\)$" srun.log || fail "rank $r: no correct sum"
  line=$(grep -E "^$r: where: " srun.log) || fail "rank $r: no where line"
  node=$(sed -E 's/.* node=([^ ]*) .*/\1/' <<<"$line")
  want=dtn$((r / 2))
  [[ $node == "$want" ]] || fail "rank $r ran on node '$node', expected $want (2 ranks a node, in order)"
  [[ $line == *" first=dtn0=10.212.0.1 "* ]] || fail "rank $r: the first node dtn0 does not resolve to 10.212.0.1: $line"
  [[ $line == *" master=unset" ]] || fail "rank $r: MASTER_ADDR was set: $line"
  ns_of[$node]+="$(sed -E 's/.* netns=([^ ]*) .*/\1/' <<<"$line") "
done
read -r a b <<<"${ns_of[dtn0]}"
read -r c d <<<"${ns_of[dtn1]}"
[[ $a == "$b" && $c == "$d" && $a != "$c" ]] ||
  fail "ranks are not in one network namespace per node: dtn0: ${ns_of[dtn0]}, dtn1: ${ns_of[dtn1]}"

# ---- 2. sbatch of the MIL-NCE example across both nodes -------------------------------------------
timeout $((30 * ts)) "$bin/milnce" gen-data --out data --videos 200 --eval-videos 20 --seed 5 >gen.log 2>&1 ||
  { cat gen.log; fail "milnce gen-data failed"; }
t0=$SECONDS
rc=0
slurm run "$work/slurm" -- env DTRAIN_BIN="$bin" DATA_DIR=data RUN_DIR=run timeout $((100 * ts)) sbatch --wait --parsable -N 2 \
  -o job.log "$src/examples/slurm/milnce_train.sbatch" --epochs 2 --batch 16 --no-progress >sbatch.out 2>&1 || rc=$?
echo "slurm_nodes_test: sbatch --wait -N 2 milnce_train.sbatch: exit $rc in $((SECONDS - t0)) s"
sed 's/^/  /' sbatch.out job.log 2>/dev/null || true
((rc == 0)) || fail "sbatch exited with $rc"
job=$(head -n 1 sbatch.out | cut -d';' -f1)
[[ $job =~ ^[0-9]+$ ]] || fail "no job id from sbatch --parsable: $(cat sbatch.out)"
grep -qF "milnce: 4 tasks on dtn[0-1] (tasks per node: 2(x2))" job.log || fail "the job did not have 2 tasks on each of dtn0, dtn1"
grep -q "after training (2 epochs)" job.log || fail "no 'after training (2 epochs)' in job.log"
grep -q '"kind":"run".*"world_size":4' run/metrics.jsonl || fail "rank 0's metrics do not say world_size 4"
# 200 videos over 4 ranks in batches of 16: 3 steps an epoch.
steps=$(grep -c '^{"kind":"step"' run/metrics.jsonl || true)
((steps == 6)) || fail "$steps optimizer steps in run/metrics.jsonl, expected 6 (2 epochs of 3)"
# The training step (step 0: the data existed, so no gen-data step) was launched by both slurmds.
for n in dtn0 dtn1; do
  grep -q "launch task StepId=$job.0 " "$work/slurm/log/slurmd-$n.log" ||
    fail "slurmd of $n did not launch the training step $job.0: $(tail -n 5 "$work/slurm/log/slurmd-$n.log")"
done
echo "slurm_nodes_test: PASS"
