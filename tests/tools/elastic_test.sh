#!/usr/bin/env bash
# Elastic membership on the emulated cluster (scripts/cluster.sh): MIL-NCE training with
# `dtrain-run --nnodes 2:4` on 3 hosts x 1 process, the rendezvous store hosted by host 0's agent
# (--rdzv-backend c10d), disk checkpoints and peer-memory snapshots (dtrain/snapshot.h) every 5 steps,
# each rank logging the samples it reads.
#   kill: host 2 (every process of it, agent included) is killed mid-run; the survivors form a new
#         round within 30 s, resume from the newest checkpoint at world size 2 (global batch kept) and
#         finish;
#   cut:  host 1's link is cut instead (no connection reset arrives); the same, within 30 s (the
#         heartbeat timeout, not the collective timeout);
#   join: a fourth host added mid-run joins at the next round, and training finishes on 4;
#   etcd: ZeRO stage 2 (milnce --zero 2: sharded gradients and optimizer state), the rendezvous store
#         is etcd (--rdzv-backend etcd), run on a host of its own, and host 0 (the first node, which also
#         hosts the round's worker store) is killed: the survivors go on from the peer-memory snapshot
#         (host 0's shard survives in host 1's agent), resharded to 2 ranks;
#   memory: no disk checkpoints at all (--no-checkpoints): host 2 is killed and the survivors resume
#         from the peer-memory snapshot.
# After each: every epoch's committed steps read each sample once, at most 5 steps were lost, and the
# held-out accuracy (mean of R@1/5/10) is within 1 point of the range of uninterrupted runs with the
# same settings at the world sizes the job trained at (tests/tools/elastic_check.py).
#
#   bash tests/tools/elastic_test.sh SOURCE_DIR BIN_DIR [kill|cut|etcd|memory|join ...]   (default: all)
#
# Needs root (network namespaces). Everything is bounded and the rig is always taken down (EXIT trap).
set -euo pipefail
ts=${DTRAIN_TEST_TIME_SCALE:-1}  # every deadline below x this (tests/harness.h)

src=$(cd "${1:?usage: elastic_test.sh SOURCE_DIR BIN_DIR [SCENARIO...]}" && pwd)
bin=$(cd "${2:?usage: elastic_test.sh SOURCE_DIR BIN_DIR [SCENARIO...]}" && pwd)
shift 2
scenarios=("$@")
((${#scenarios[@]})) || scenarios=(kill cut etcd memory join)

fail() { echo "FAIL: $*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || fail "needs root (network namespaces): run as root, as CI does"
for b in dtrain-run milnce; do [[ -x $bin/$b ]] || fail "no $bin/$b (build it first)"; done
[[ -x /usr/bin/etcd ]] || fail "no /usr/bin/etcd (Debian's etcd-server; scripts/setup.sh installs it)"

work=$(mktemp -d /tmp/dtrain-elastic.XXXXXX)
rig=el$$
cluster() { bash "$src/scripts/cluster.sh" "$@"; }
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  cluster down "$rig" >/dev/null 2>&1 || true
  if ((rc != 0)); then
    for f in "$work"/*/h*.log; do [[ -f $f ]] && { echo "---- $f"; tail -n 40 "$f"; }; done
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP
cd "$work"

export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
timeout $((60 * ts)) "$bin/milnce" gen-data --out data --videos 600 --eval-videos 60 --seed 5 >gen.log 2>&1 ||
  { cat gen.log; fail "milnce gen-data failed"; }
# Global batch 24 = 2 x 3 ranks x accum 4 = 2 x 2 x 6 = 2 x 4 x 3: the same at every size the job takes.
train=(train --data "$work/data" --epochs 30 --batch 2 --no-progress --log-samples --snapshot-every 5)
# What each scenario adds: disk checkpoints or none; ZeRO stage 2 or DDP.
declare -A extra=([kill]="--checkpoint-every 5" [cut]="--checkpoint-every 5" [join]="--checkpoint-every 5"
                  [etcd]="--checkpoint-every 5 --zero 2" [memory]="--no-checkpoints")
# The uninterrupted references, at the 3 ranks every scenario starts with and at the size it ends with
# (2, or 4 for join; the global batch kept by --accum): DDP, and ZeRO stage 2 for the etcd scenario.
reference() {
  local name=$1 n=$2
  shift 2
  timeout $((200 * ts)) "$bin/dtrain-run" --standalone --nproc-per-node "$n" "$bin/milnce" "${train[@]}" \
    --accum $((12 / n)) "$@" --out "$work/$name" >"$name.log" 2>&1 ||
    { tail -20 "$name.log"; fail "the uninterrupted reference run $name failed"; }
  echo "elastic_test: reference $name (uninterrupted, $n ranks): $(grep 'after training' "$name.log")"
}
has() { [[ " ${scenarios[*]} " == *" $1 "* ]]; }
reference ref3 3
if has kill || has cut || has memory; then reference ref2 2; fi
if has etcd; then reference ref3-zero2 3 --zero 2 && reference ref2-zero2 2 --zero 2; fi
if has join; then reference ref4 4; fi

# Hosts 0-2 train; host 3 runs etcd (outside the hosts that are killed); join adds host 4.
cluster up --name "$rig" --hosts 4 --gbit 10 --no-rate-check --owner $$ >/dev/null
port=$((29000 + $$ % 1000))
etcd_url=http://10.212.0.4:2379
cluster exec "$rig" 3 -- timeout $((600 * ts)) /usr/bin/etcd --name e0 --data-dir "$work/etcd" \
  --listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
  --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
  --initial-cluster e0=http://127.0.0.1:2380 >"$work/etcd.log" 2>&1 &
deadline=$((SECONDS + 30 * ts))
until cluster exec "$rig" 0 -- bash -c "exec 3<>/dev/tcp/10.212.0.4/2379" 2>/dev/null; do
  ((SECONDS < deadline)) || { cat "$work/etcd.log"; fail "etcd did not listen on $etcd_url within 30 s"; }
  sleep 0.2
done

# agent SCENARIO HOST: host HOST's dtrain-run in the background, output to SCENARIO/hHOST.log.
agent() {
  local s=$1 h=$2 rdzv=(--rdzv-endpoint "10.212.0.1:$port")
  [[ $s == etcd ]] && rdzv=(--rdzv-backend etcd --rdzv-endpoint "$etcd_url")
  cluster exec "$rig" "$h" -- timeout $((240 * ts)) "$bin/dtrain-run" --nnodes 2:4 "${rdzv[@]}" \
    --rdzv-id "$s" --nproc-per-node 1 --max-restarts 1 --heartbeat-timeout $((3 * ts)) --last-call 1 \
    "$bin/milnce" "${train[@]}" --accum 4 ${extra[$s]} --out "$work/$s/run" --resume >"$work/$s/h$h.log" 2>&1 &
  pids[$h]=$!
}
# Waits (bounded) until rank 0 has begun optimizer step N (its samples log says so).
wait_step() {
  local s=$1 n=$2 deadline=$((SECONDS + 120 * ts))
  until grep -q "^epoch [0-9]* step $n:" "$work/$s/run/samples-rank0.txt" 2>/dev/null; do
    ((SECONDS < deadline)) || fail "$s: rank 0 did not reach step $n within 120 s"
    sleep 0.2
  done
}
# Waits (bounded) for a line matching PATTERN in any of the scenario's agent logs; prints the seconds taken.
wait_line() {
  local s=$1 pattern=$2 limit=$3 t0=$SECONDS
  until grep -qE "$pattern" "$work/$s"/h*.log 2>/dev/null; do
    ((SECONDS - t0 < limit)) || fail "$s: no '$pattern' within $limit s"
    sleep 0.1
  done
  echo $((SECONDS - t0))
}
# Waits for the given hosts' agents; each must exit with 0.
expect_success() {
  local s=$1 h rc
  shift
  for h in "$@"; do
    rc=0
    wait "${pids[$h]}" || rc=$?
    ((rc == 0)) || fail "$s: host $h's dtrain-run exited with $rc"
  done
}

for s in "${scenarios[@]}"; do
  mkdir -p "$work/$s"
  declare -a pids=()
  hosts=(0 1 2)
  agent "$s" 0
  sleep 0.3
  agent "$s" 1
  agent "$s" 2
  wait_line "$s" "round 0: 3 node" 60 >/dev/null
  wait_step "$s" 23
  t0=$(date +%s.%N)
  case $s in
    kill)
      cluster kill-host "$rig" 2
      survivors=(0 1) ;;
    cut)
      cluster cut "$rig" 1
      survivors=(0 2) ;;
    etcd)
      cluster kill-host "$rig" 0
      survivors=(1 2) ;;
    memory)
      cluster kill-host "$rig" 2
      survivors=(0 1) ;;
    join)
      h=$(cluster add-host "$rig")
      agent "$s" "$h"
      survivors=(0 1 2 "$h") ;;
    *) fail "unknown scenario $s (kill, cut, etcd, memory or join)" ;;
  esac
  want="round 1: ${#survivors[@]} node"
  took=$(wait_line "$s" "$want" 30) || exit 1
  echo "elastic_test: $s: '$want' $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s after the event (limit 30)"
  expect_success "$s" "${survivors[@]}"
  if [[ $s == cut ]]; then  # the cut-off host's agent lost the store: it must stop, not hang
    rc=0
    wait "${pids[1]}" || rc=$?
    ((rc != 0)) || fail "cut: host 1's agent exited with 0 although its link was cut"
    cluster restore "$rig" 1
  fi
  grep -h "after training\|resumed from\|peer snapshots:" "$work/$s"/h*.log | sed "s/^/  $s: /"
  if [[ $s == etcd || $s == memory ]]; then  # the new round restored from the agents' memory
    grep -q "resumed from peer memory" "$work/$s"/h*.log || fail "$s: no 'resumed from peer memory' in the logs"
  fi
  if [[ $s == memory && -e $work/$s/run/checkpoints ]]; then
    fail "memory: $work/$s/run/checkpoints exists although the run wrote no disk checkpoints"
  fi
  case $s in
    etcd) references="$work/ref3-zero2,$work/ref2-zero2" ;;
    join) references="$work/ref3,$work/ref4" ;;
    *) references="$work/ref3,$work/ref2" ;;
  esac
  /usr/bin/python3 "$src/tests/tools/elastic_check.py" "$work/$s/run" "$references" 600 5 |
    sed "s/^/  $s: /"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || fail "$s: elastic_check failed"
  echo "elastic_test: $s: ok"
done
echo "elastic_test: all passed (${scenarios[*]})"
