#!/usr/bin/env bash
# A one-host Slurm for tests and trials: Debian's munged, slurmctld and slurmd, run as root with their
# own config, key, state, pid and log files under one directory, and their own ports, so several can run
# at once beside a real installation without touching /etc/slurm or /etc/munge.
#
#   eval "$(bash scripts/slurm.sh start /tmp/myslurm)"   # prints: export SLURM_CONF=/tmp/myslurm/slurm.conf
#   srun -n 3 build/bin/example-allreduce
#   bash scripts/slurm.sh status /tmp/myslurm
#   bash scripts/slurm.sh stop /tmp/myslurm              # stops the daemons, then removes the directory
#
# The directory defaults to $DTRAIN_SLURM_DIR or /tmp/dtrain-slurm. The node advertises CPUS (default
# 8) CPUs whatever the machine has (SlurmdParameters=config_overrides), so `srun -n 3` and two 2-task
# jobs at once fit on a 2-core box. Container-friendly: ProctrackType=proctrack/linuxproc and
# TaskPlugin=task/none (no cgroups). Every wait is bounded (START_TIMEOUT, default 60 s); a start that
# fails stops whatever it started, prints the daemons' logs and exits non-zero.
# Needs: root, and the packages munge slurmctld slurmd slurm-client (scripts/setup.sh installs them).
set -euo pipefail

cmd=${1:-}
dir=${2:-${DTRAIN_SLURM_DIR:-/tmp/dtrain-slurm}}
cpus=${CPUS:-8}
start_timeout=${START_TIMEOUT:-60}

die() { echo "slurm.sh: $*" >&2; exit 1; }

usage() {
  echo "usage: $0 start|stop|status [DIR]   (DIR defaults to \$DTRAIN_SLURM_DIR or /tmp/dtrain-slurm)" >&2
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

stop_all() {
  [[ -d $dir ]] || return 0
  # Jobs first (their tasks are slurmd's children), then the daemons.
  if alive slurmctld && [[ -f $dir/slurm.conf ]]; then
    SLURM_CONF=$dir/slurm.conf timeout 10 scancel --full --quiet --user=root >/dev/null 2>&1 || true
  fi
  stop_daemons slurmd slurmctld munged
}

show_logs() {
  local f
  for f in "$dir"/log/*.log; do
    [[ -f $f ]] || continue
    echo "---- $f (last 40 lines)" >&2
    tail -n 40 "$f" >&2
  done
}

start() {
  need_tools
  if [[ -f $dir/slurm.conf ]] && alive slurmctld; then die "a Slurm already runs from $dir (stop it first)"; fi
  mkdir -p "$dir"
  chmod 700 "$dir"
  mkdir -p "$dir/munge" "$dir/log" "$dir/state" "$dir/spool"
  chmod 700 "$dir/munge"
  trap 'echo "slurm.sh: start failed; stopping what was started" >&2; show_logs; stop_all; exit 1' ERR

  # munge: its own key and socket (auth/munge and cred/munge reach it through AuthInfo=socket=...).
  mungekey --create --keyfile="$dir/munge/munge.key" --force >/dev/null
  chmod 600 "$dir/munge/munge.key"
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  wait_for test -S "$dir/munge/munge.socket" || die "munged did not create its socket within ${start_timeout}s"

  local host ctld_port slurmd_port
  host=$(hostname -s)
  # 48 controller ports, each with its own window of 16 job ids modulo 768: jobs of Slurms running at
  # once never share an id modulo 768, so the store ports dtrain derives from job ids (20000 + 16 *
  # (job % 768) + step) differ, as they do on a real cluster where job ids are unique.
  ctld_port=$(free_port 6900 6948)
  slurmd_port=$(free_port 6948 7400)
  first_job=$((1 + 16 * (ctld_port - 6900)))
  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm.sh: a one-host test cluster.
ClusterName=dtrain$$
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
FirstJobId=$first_job
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
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
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" -i
  wait_for scontrol ping || die "slurmctld did not answer within ${start_timeout}s"
  slurmd -f "$SLURM_CONF" -N "$host"
  # Idle (or mixed, if a job got there first) means the node registered and can run jobs.
  wait_for bash -c "sinfo -h -N -n '$host' -o %t | grep -Eq '^(idle|mix)'" ||
    die "node $host did not become idle within ${start_timeout}s: $(sinfo -h -N -o '%N %t %E' 2>&1)"
  trap - ERR
  echo "export SLURM_CONF=$SLURM_CONF"
}

status() {
  [[ -f $dir/slurm.conf ]] || { echo "no Slurm configured in $dir"; return 1; }
  local d ok=0
  for d in munged slurmctld slurmd; do
    if alive "$d"; then echo "$d: running (pid $(pid_of "$d"))"; else echo "$d: not running"; ok=1; fi
  done
  SLURM_CONF=$dir/slurm.conf timeout 10 sinfo -N -o '%N %C %t' || ok=1
  return $ok
}

case "$cmd" in
  start) start ;;
  stop) stop_all; rm -rf "$dir" ;;
  status) status ;;
  *) usage ;;
esac
