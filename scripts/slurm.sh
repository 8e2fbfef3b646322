#!/usr/bin/env bash
# A test Slurm: Debian's munged, slurmctld and slurmd, run as root with their own config, key, state,
# pid and log files under one directory, and their own ports, so several can run at once beside a real
# installation without touching /etc/slurm or /etc/munge.
#
# One host (the default):
#   eval "$(bash scripts/slurm.sh start /tmp/myslurm)"   # prints: export SLURM_CONF=/tmp/myslurm/slurm.conf
#   srun -n 3 build/bin/example-allreduce
#   bash scripts/slurm.sh status /tmp/myslurm
#   bash scripts/slurm.sh stop /tmp/myslurm              # stops the daemons, then removes the directory
#
# Several nodes (--nodes N, N >= 2), on an emulated cluster (scripts/cluster.sh, rig "slurm<pid>"):
# node dtn<i> is host i's network namespace, address 10.212.0.(i+1), with its own slurmd (spool, pid
# and log files named after the node); slurmctld runs in host 0's namespace. Node names resolve in
# every host's namespace through /etc/netns/<namespace>/hosts (ip netns exec mounts it over
# /etc/hosts), as a cluster's DNS would resolve them. Commands that talk to Slurm (srun, sbatch, sinfo)
# must run in a host's namespace: `run` does that (host 0) and sets SLURM_CONF.
#   CPUS=2 bash scripts/slurm.sh start /tmp/s2 --nodes 2   # 2 CPUs a node: -N 2 -n 4 puts 2 tasks on each
#   bash scripts/slurm.sh run /tmp/s2 -- srun -N 2 -n 4 build/bin/example-allreduce
#   bash scripts/slurm.sh stop /tmp/s2                   # also takes the emulated cluster down
# --owner PID (a test's pid): if PID dies without stopping, the next cluster.sh up (or cluster.sh gc)
# takes the namespaces down, killing the slurmds and slurmctld in them (munged stays: stop DIR).
#
# The directory defaults to $DTRAIN_SLURM_DIR or /tmp/dtrain-slurm. Each node advertises CPUS (default
# 8) CPUs whatever the machine has (SlurmdParameters=config_overrides), so `srun -n 3` and two 2-task
# jobs at once fit on a 2-core box. Container-friendly: ProctrackType=proctrack/linuxproc and
# TaskPlugin=task/none (no cgroups). Every wait is bounded (START_TIMEOUT, default 60 s); a start that
# fails stops whatever it started, prints the daemons' logs and exits non-zero.
# Needs: root, and the packages munge slurmctld slurmd slurm-client (scripts/setup.sh installs them);
# with --nodes, iproute2 (cluster.sh).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cmd=${1:-}
(($#)) && shift
dir=${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}
if (($#)) && [[ $1 != -* ]]; then dir=$1; shift; fi
nodes=1
owner=''
cpus=${CPUS:-8}
start_timeout=${START_TIMEOUT:-60}

die() { echo "slurm.sh: $*" >&2; exit 1; }

usage() {
  echo "usage: $0 start [DIR] [--nodes N [--owner PID]] | stop [DIR] | status [DIR] | run [DIR] -- CMD...
       (DIR defaults to \$DTRAIN_SLURM_DIR or /tmp/dtrain-slurm)" >&2
  exit 2
}

need_tools() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (slurmd launches tasks as any user; munged and slurmctld run as root here)"
  local t missing=()
  for t in munged mungekey slurmctld slurmd srun sbatch sinfo scontrol squeue; do
    command -v "$t" >/dev/null 2>&1 || [[ -x /usr/sbin/$t ]] || missing+=("$t")
  done
  ((${#missing[@]} == 0)) || die "missing ${missing[*]}: install the Debian packages munge slurmctld slurmd slurm-client (bash scripts/setup.sh)"
}

# A TCP port nothing listens on, from [lo, hi).
free_port() {
  local lo=$1 hi=$2 p i
  for ((i = 0; i < 200; i++)); do
    p=$((lo + RANDOM % (hi - lo)))
    if ! ss -Htln "sport = :$p" | grep -q .; then echo "$p"; return 0; fi
  done
  die "no free port in [$lo, $hi)"
}

pid_of() { if [[ -s $dir/$1.pid ]]; then cat "$dir/$1.pid"; fi; }
alive() { local p; p=$(pid_of "$1"); [[ -n $p ]] && kill -0 "$p" 2>/dev/null; }

# Waits (bounded) until `$@` succeeds; returns 1 at the deadline.
wait_for() {
  local deadline=$((SECONDS + start_timeout))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

# Sends SIGTERM to the named daemons at once, waits up to 10 s for them, then SIGKILLs the rest.
stop_daemons() {
  local name p i pids=() left
  for name in "$@"; do
    p=$(pid_of "$name")
    if [[ -n $p ]] && kill -TERM "$p" 2>/dev/null; then pids+=("$p"); fi
  done
  for ((i = 0; i < 50; i++)); do
    left=()
    for p in "${pids[@]}"; do
      if kill -0 "$p" 2>/dev/null; then left+=("$p"); fi
    done
    ((${#left[@]})) || return 0
    sleep 0.2
  done
  for p in "${left[@]}"; do
    echo "slurm.sh: pid $p ignored SIGTERM for 10 s; killing it" >&2
    kill -KILL "$p" 2>/dev/null || true
  done
}

# ---- nodes -------------------------------------------------------------------------------------
# With --nodes N >= 2 the directory holds `rig` (the cluster.sh rig's name) and `nodes` (N).
rig() { if [[ -s $dir/rig ]]; then cat "$dir/rig"; fi; }
node_count() { if [[ -s $dir/nodes ]]; then cat "$dir/nodes"; else echo 1; fi; }
# Host i's network namespace (cluster.sh's naming).
node_ns() { echo "dtc-$(rig)-h$1"; }
# Runs a command where slurmctld listens: host 0's namespace, or here on one host.
in_ctl() { if [[ -n $(rig) ]]; then ip netns exec "$(node_ns 0)" "$@"; else "$@"; fi; }
# The names of the slurmd pid files (slurmd.pid, or slurmd-dtn<i>.pid: SlurmdPidFile's %n).
slurmd_names() {
  local i n; n=$(node_count)
  if [[ -z $(rig) ]]; then echo slurmd; return; fi
  for ((i = 0; i < n; i++)); do echo "slurmd-dtn$i"; done
}

stop_all() {
  [[ -d $dir ]] || return 0
  # Jobs first (their tasks are slurmd's children), then the daemons, then the emulated cluster.
  if alive slurmctld && [[ -f $dir/slurm.conf ]]; then
    SLURM_CONF=$dir/slurm.conf in_ctl timeout 10 scancel --full --quiet --user=root >/dev/null 2>&1 || true
  fi
  # shellcheck disable=SC2046
  stop_daemons $(slurmd_names) slurmctld munged
  local r; r=$(rig)
  if [[ -n $r ]]; then
    bash "$here/cluster.sh" down "$r" || echo "slurm.sh: cluster.sh down $r failed" >&2
    rm -rf /etc/netns/dtc-"$r"-h[0-9]*
  fi
}

show_logs() {
  local f
  for f in "$dir"/log/*.log; do
    [[ -f $f ]] || continue
    echo "---- $f (last 40 lines)" >&2
    tail -n 40 "$f" >&2
  done
}

# Idle (or mixed, if a job got there first) means the node registered and can run jobs.
node_ready() { in_ctl sinfo -h -N -n "$1" -o %t | grep -Eq '^(idle|mix)'; }

start() {
  need_tools
  if ! [[ $nodes =~ ^[1-9][0-9]*$ ]] || ((nodes > 64)); then die "--nodes must be 1..64 (got '$nodes')"; fi
  if [[ -f $dir/slurm.conf ]] && alive slurmctld; then die "a Slurm already runs from $dir (stop it first)"; fi
  mkdir -p "$dir"
  chmod 700 "$dir"
  # (What an earlier start that failed left: slurmctld refuses a state directory of another cluster.)
  rm -rf "$dir/state" "$dir/spool" "$dir/log"
  mkdir -p "$dir/munge" "$dir/log" "$dir/state" "$dir/spool"
  chmod 700 "$dir/munge"
  rm -f "$dir/rig" "$dir/nodes"
  # Any exit before the end (a failed command, or die at a deadline) stops what was started.
  start_ok=0
  trap 'if ((!start_ok)); then echo "slurm.sh: start failed; stopping what was started" >&2; show_logs; stop_all; fi' EXIT

  # munge: its own key and socket (auth/munge and cred/munge reach it through AuthInfo=socket=...). Its
  # socket is a file, so the daemons of every namespace reach the one munged.
  mungekey --create --keyfile="$dir/munge/munge.key" --force >/dev/null
  chmod 600 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  wait_for test -S "$dir/munge/munge.socket" || die "munged did not create its socket within ${start_timeout}s"

  local host ctld_port slurmd_port ctld_addr i j names=() addrs=() r=''
  host=$(hostname -s)
  if ((nodes == 1)); then
    names=("$host") addrs=(127.0.0.1) ctld_addr=127.0.0.1
  else
    # The emulated cluster, and a hosts file for each of its namespaces naming every node.
    r=slurm$$
    echo "$r" >"$dir/rig"
    echo "$nodes" >"$dir/nodes"
    bash "$here/cluster.sh" up --name "$r" --hosts "$nodes" --no-rate-check ${owner:+--owner "$owner"} >&2 ||
      die "could not bring up an emulated cluster of $nodes hosts (scripts/cluster.sh; see above)"
    for ((i = 0; i < nodes; i++)); do names+=("dtn$i"); addrs+=("$(bash "$here/cluster.sh" addr "$r" "$i")"); done
    for ((i = 0; i < nodes; i++)); do
      mkdir -p "/etc/netns/$(node_ns "$i")"
      {
        cat /etc/hosts
        echo "# scripts/slurm.sh $dir: the Slurm nodes"
        for ((j = 0; j < nodes; j++)); do echo "${addrs[$j]} ${names[$j]}"; done
      } >"/etc/netns/$(node_ns "$i")/hosts"
      mkdir -p "$dir/spool/${names[$i]}"
    done
    ctld_addr=${addrs[0]}
  fi
  # 48 controller ports, each with its own window of 16 job ids modulo 768: jobs of Slurms running at
  # once never share an id modulo 768, so the store ports dtrain derives from job ids (20000 + 16 *
  # (job % 768) + step) differ, as they do on a real cluster where job ids are unique.
  ctld_port=$(free_port 6900 6948)
  slurmd_port=$(free_port 6948 7400)
  first_job=$((1 + 16 * (ctld_port - 6900)))
  local node_lines='' all_nodes spool=$dir/spool slurmd_pid=$dir/slurmd.pid slurmd_log=$dir/log/slurmd.log
  for ((i = 0; i < nodes; i++)); do
    node_lines+="NodeName=${names[$i]} NodeAddr=${addrs[$i]} CPUs=$cpus RealMemory=1000 State=UNKNOWN"$'\n'
  done
  all_nodes=$(IFS=,; echo "${names[*]}")
  if ((nodes > 1)); then
    # Each slurmd its own spool, pid and log file (%n: the node's name).
    spool=$dir/spool/%n slurmd_pid=$dir/slurmd-%n.pid slurmd_log=$dir/log/slurmd-%n.log
  fi
  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm.sh: a test cluster of $nodes node(s).
ClusterName=dtrain$$
SlurmctldHost=$host($ctld_addr)
SlurmctldPort=$ctld_port
FirstJobId=$first_job
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$slurmd_log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=30
SlurmctldTimeout=30
SlurmdTimeout=30
${node_lines}PartitionName=debug Nodes=$all_nodes Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF=$dir/slurm.conf
  local rc=0
  in_ctl slurmctld -f "$SLURM_CONF" -i || rc=$?
  ((rc == 0)) || die "slurmctld exited with $rc at start-up"
  wait_for in_ctl scontrol ping || die "slurmctld did not answer within ${start_timeout}s"
  for ((i = 0; i < nodes; i++)); do
    if [[ -n $r ]]; then
      # ip netns exec mounts a fresh /sys, without the cgroup mounts under /sys/fs/cgroup, where slurmd
      # looks (and fails without them) even with task/none and proctrack/linuxproc: give it a tmpfs.
      ip netns exec "$(node_ns "$i")" sh -c 'mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd && exec "$@"' sh \
        slurmd -f "$SLURM_CONF" -N "${names[$i]}"
    else
      slurmd -f "$SLURM_CONF" -N "${names[$i]}"
    fi
  done
  for ((i = 0; i < nodes; i++)); do
    wait_for node_ready "${names[$i]}" ||
      die "node ${names[$i]} did not become idle within ${start_timeout}s: $(in_ctl sinfo -h -N -o '%N %t %E' 2>&1)"
  done
  # shellcheck disable=SC2034  # (read by the EXIT trap)
  start_ok=1
  trap - EXIT
  echo "export SLURM_CONF=$SLURM_CONF"
  if [[ -n $r ]]; then
    echo "slurm.sh: $nodes nodes ($all_nodes) up; run srun/sbatch in host 0's namespace: bash $0 run $dir -- srun ..." >&2
  fi
}

status() {
  [[ -f $dir/slurm.conf ]] || { echo "no Slurm configured in $dir"; return 1; }
  local d ok=0
  for d in munged slurmctld $(slurmd_names); do
    if alive "$d"; then echo "$d: running (pid $(pid_of "$d"))"; else echo "$d: not running"; ok=1; fi
  done
  [[ -z $(rig) ]] || echo "emulated cluster: rig $(rig) (scripts/cluster.sh), slurmctld in $(node_ns 0)"
  SLURM_CONF=$dir/slurm.conf in_ctl timeout 10 sinfo -N -o '%N %C %t' || ok=1
  return $ok
}

# run [DIR] -- CMD...: CMD with SLURM_CONF set, in host 0's namespace on an emulated cluster.
run() {
  [[ ${1:-} == -- ]] || usage
  shift
  (($#)) || usage
  [[ -f $dir/slurm.conf ]] || die "no Slurm configured in $dir (slurm.sh start $dir)"
  export SLURM_CONF=$dir/slurm.conf
  in_ctl "$@"
}

case "$cmd" in
  start)
    while (($#)); do
      case $1 in
        --nodes) [[ $# -ge 2 ]] || usage; nodes=$2; shift 2 ;;
        --owner) [[ $# -ge 2 ]] || usage; owner=$2; shift 2 ;;
        *) usage ;;
      esac
    done
    start ;;
  stop) (($# == 0)) || usage; stop_all; rm -rf "$dir" ;;
  status) (($# == 0)) || usage; status ;;
  run) run "$@" ;;
  *) usage ;;
esac
