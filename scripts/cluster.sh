#!/usr/bin/env bash
# An emulated cluster on one machine: H "hosts" as network namespaces joined through a Linux bridge
# (in a namespace of its own), each host's link limited to RATE Gbit/s by tc tbf on both ends of its
# veth pair. Runs one launcher (dtrain-run, or torchrun for the PyTorch peer) per host. Needs root.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage:
  cluster.sh [RIG OPTIONS] [RUN OPTIONS] -- PROGRAM [ARGS...]
      One shot: bring a rig up, run PROGRAM on every host through the launcher, print every host's
      output (lines prefixed "[host i] "), take the rig down (also on INT/TERM/HUP or an error) and
      exit with the worst (largest) exit code of the hosts; 124 when --timeout expired.

  cluster.sh up --name N [RIG OPTIONS] [--owner PID]   leave a rig up (state in $DTRAIN_CLUSTER_DIR/N)
  cluster.sh run N [RUN OPTIONS] -- PROGRAM [ARGS...]  run on every host of rig N, as the one shot does
  cluster.sh run-host N I [--bg] [RUN OPTIONS] -- PROGRAM [ARGS...]
                                     run host I's launcher; --bg: in the background, output to
                                     N/host-I.log and the exit code to N/host-I.rc when it ends
  cluster.sh wait-host N I [--timeout S]  wait for a --bg host; prints its log, exits with its code
  cluster.sh exec N I -- CMD [ARGS...]    run any command in host I's namespace (no launcher)
  cluster.sh kill-host N I           SIGKILL every process in host I's namespace
  cluster.sh cut N I                 cut host I's link (its bridge port down); restore N I: back up
  cluster.sh add-host N              one more host (index = the old host count), same rate; prints I
  cluster.sh addr N I                host I's address
  cluster.sh check-rate N [I J] [--shaped]
                                     one TCP stream from host I to host J (default 1 -> 0), >= 90% of RATE;
                                     --shaped: it gets through and the link caps it (<= 125% of RATE), however
                                     slow a loaded machine makes it (what a test can assert without timing)
  cluster.sh down N                  kill the rig's processes, remove its namespaces and state
  cluster.sh gc                      take down rigs whose --owner process is gone (up does this too)

Rig options:
  --hosts H (2)  --gbit RATE (1; Gbit/s per host link, each direction)  --nproc-per-host P (1)
  --launcher dtrain|torchrun (dtrain)  --bin-dir DIR (build/bin of this checkout: dtrain-run)
  --master-port PORT (29500)  --mtu BYTES (1500; 9000 for jumbo frames)  --no-rate-check (debugging only: skip the start-up stream check)
  --shaped-rate-check (the start-up stream must get through, capped by the link, however slow a loaded machine
  makes it: for tests, which must not time; without it the stream must reach 90% of RATE)
Run options:
  --nnodes N (override the launcher's --nnodes, e.g. for a host added later)  --env K=V (repeatable)
  --timeout S (one shot / run: kill every host after S seconds; 0 = none, the default)

RATE counts whole frames (tbf), so at MTU 1500 one TCP stream carries at most ~95% of it as payload.
Every rank gets OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1. Host i has address
10.212.0.(i+1) on eth0 (GLOO_SOCKET_IFNAME=eth0 for torchrun); each rig has its own namespaces
(dtc-N-br, dtc-N-h<i>), so rigs never see each other.
The launchers: dtrain: dtrain-run --nnodes H --node-rank i --nproc-per-node P --master-addr 10.212.0.1
  --master-port PORT PROGRAM...;  torchrun: PEER_PYTHON -m torch.distributed.run --nnodes H
  --node_rank i --nproc_per_node P --master_addr 10.212.0.1 --master_port PORT PROGRAM... (with
  --redirects 1 --tee 1: torchrun 1.13 on Python 3.11 fails on its defaults; worker lines get [defaultN]:).
  PEER_PYTHON: benches/peer_python.sh (the repository's .venv with the pinned torch wheel, else
  /usr/bin/python3 with Debian's torch 1.13)
Example: scripts/cluster.sh --hosts 2 --nproc-per-host 2 --gbit 1 -- build/bin/dtrain-bench allreduce
EOF
}

die() { echo "cluster.sh: $*" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
state_root=${DTRAIN_CLUSTER_DIR:-/tmp/dtrain-cluster}
subnet=10.212.0

# ---- state -------------------------------------------------------------------------------------
rig_dir() { echo "$state_root/$1"; }
ns_br() { echo "dtc-$1-br"; }
ns_host() { echo "dtc-$1-h$2"; }
host_addr() { echo "$subnet.$(($2 + 1))"; }

load() {  # load NAME: reads the rig's settings into globals
  name=$1
  local f; f="$(rig_dir "$name")/config"
  [[ -f $f ]] || die "no rig named '$name' (no $f)"
  # shellcheck disable=SC1090
  source "$f"
}

save() {
  mkdir -p "$(rig_dir "$name")"
  {
    printf 'hosts=%q\ngbit=%q\nnproc=%q\nlauncher=%q\n' "$hosts" "$gbit" "$nproc" "$launcher"
    printf 'bin_dir=%q\nmaster_port=%q\nmtu=%q\nowner=%q\n' "$bin_dir" "$master_port" "$mtu" "$owner"
  } >"$(rig_dir "$name")/config"
}

check_host_index() {
  if ! [[ $1 =~ ^[0-9]+$ ]] || (($1 >= hosts)); then die "rig '$name' has hosts 0..$((hosts - 1)), not '$1'"; fi
}

# ---- links -------------------------------------------------------------------------------------
shape() {  # shape NS DEV: tbf at RATE on DEV's egress; burst >= 1 ms at the rate and >= 2 GSO packets
  local burst
  burst=$(awk -v g="$gbit" 'BEGIN { b = g * 1e9 / 8 / 1000; if (b < 131072) b = 131072; printf "%d", b }')
  tc -n "$1" qdisc replace dev "$2" root tbf rate "${gbit}gbit" burst "$burst" latency 20ms
}

make_host() {  # make_host I: namespace, veth (eth0 in the host, h<I> on the bridge), shaped both ways
  local i=$1 ns br
  ns=$(ns_host "$name" "$i"); br=$(ns_br "$name")
  # (&& throughout: callers test the result, which turns set -e off in here)
  ip netns add "$ns" &&
    ip link add eth0 netns "$ns" type veth peer name "h$i" netns "$br" &&
    ip -n "$ns" addr add "$(host_addr "$name" "$i")/24" dev eth0 &&
    ip -n "$ns" link set lo up &&
    ip -n "$ns" link set eth0 mtu "$mtu" up &&
    ip -n "$br" link set "h$i" mtu "$mtu" &&
    ip -n "$br" link set "h$i" master br0 &&
    ip -n "$br" link set "h$i" up &&
    shape "$ns" eth0 &&
    shape "$br" "h$i"
}

make_rig() {
  local i br; br=$(ns_br "$name")
  ip netns add "$br" && ip -n "$br" link add br0 type bridge && ip -n "$br" link set br0 up || return 1
  for ((i = 0; i < hosts; i++)); do make_host "$i" || return 1; done
}

destroy() {  # destroy NAME: everything the rig made, whatever state it is in
  local n=$1 ns pids
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^dtc-$n-(br|h[0-9]+)$" || true); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    # shellcheck disable=SC2086
    [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  # Files a user of the rig gave a host (ip netns exec mounts /etc/netns/NS/F over /etc/F: scripts/slurm.sh
  # writes hosts files there so that node names resolve).
  rm -rf /etc/netns/dtc-"$n"-br /etc/netns/dtc-"$n"-h[0-9]*
  rm -rf "$(rig_dir "$n")"
}

gc() {  # rigs whose owner process is gone (a one shot that was SIGKILLed, a crashed test)
  local d o
  for d in "$state_root"/*/; do
    [[ -f $d/config ]] || continue
    o=$(sed -n 's/^owner=//p' "$d/config")
    if [[ -n $o && $o != "''" ]] && ! kill -0 "$o" 2>/dev/null; then
      destroy "$(basename "$d")"
    fi
  done
}

# ---- rate check --------------------------------------------------------------------------------
read -r -d '' stream_py <<'EOF' || true
import socket, sys, time
role, addr, port, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port)); s.listen(1); s.settimeout(10)
    c, _ = s.accept(); c.settimeout(10)
    n, t0, t1 = 0, None, None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        if t0 is None: t0 = time.monotonic()
        else: n += len(b)
        t1 = time.monotonic()
    print("%.4f" % (n * 8 / (t1 - t0) / 1e9 if n else 0.0))
else:
    end = time.monotonic() + 5
    while True:
        try:
            c = socket.create_connection((addr, port), timeout=2); break
        except OSError:
            if time.monotonic() > end: raise
            time.sleep(0.05)
    buf = b"\0" * (1 << 20); stop = time.monotonic() + secs
    while time.monotonic() < stop: c.sendall(buf)
    c.close()
EOF

check_rate() {  # check_rate FROM TO [--shaped]: one TCP stream, receiver-side rate, >= 90% of RATE (or <= 125%)
  local from=$1 to=$2 shaped=${3:-} out rc=0 port=29499
  out=$(mktemp)
  timeout 20 ip netns exec "$(ns_host "$name" "$to")" /usr/bin/python3 -c "$stream_py" server \
    "$(host_addr "$name" "$to")" "$port" 1.5 >"$out" 2>&1 &
  local server=$!
  timeout 20 ip netns exec "$(ns_host "$name" "$from")" /usr/bin/python3 -c "$stream_py" client \
    "$(host_addr "$name" "$to")" "$port" 1.5 || rc=$?
  wait "$server" || rc=$?
  local got; got=$(tail -n1 "$out"); rm -f "$out"
  if ((rc != 0)) || ! [[ $got =~ ^[0-9.]+$ ]]; then
    die "rate check: the TCP stream from host $from to host $to failed (exit $rc): $got"
  fi
  echo "cluster.sh: rate check: one TCP stream host $from -> host $to: $got Gbit/s (link ${gbit} Gbit/s)" >&2
  if [[ $shaped == --shaped ]]; then
    awk -v g="$got" -v r="$gbit" 'BEGIN { exit !(g <= 1.25 * r) }' ||
      die "rate check: one TCP stream reached $got Gbit/s, over the ${gbit} Gbit/s set: the link is not shaped"
    return
  fi
  awk -v g="$got" -v r="$gbit" 'BEGIN { exit !(g >= 0.9 * r) }' ||
    die "rate check: one TCP stream reached $got Gbit/s, under 90% of the ${gbit} Gbit/s set (machine too loaded, or RATE beyond what it can carry)"
}

# ---- up ----------------------------------------------------------------------------------------
parse_rig_opt() {  # sets a rig option; returns 1 when $1 is not one
  case $1 in
    --hosts) hosts=$2 ;;
    --gbit) gbit=$2 ;;
    --nproc-per-host) nproc=$2 ;;
    --launcher) launcher=$2 ;;
    --bin-dir) bin_dir=$2 ;;
    --master-port) master_port=$2 ;;
    --mtu) mtu=$2 ;;
    --owner) owner=$2 ;;
    *) return 1 ;;
  esac
}

rig_defaults() {
  hosts=2 gbit=1 nproc=1 launcher=dtrain bin_dir=$here/../build/bin master_port=29500 mtu=1500 owner='' rate_check=1
}

validate() {
  [[ $name =~ ^[A-Za-z0-9_]{1,24}$ ]] || die "--name must be 1-24 letters, digits or _ (got '$name')"
  if ! [[ $hosts =~ ^[1-9][0-9]*$ ]] || ((hosts > 200)); then die "--hosts must be 1..200 (got '$hosts')"; fi
  [[ $nproc =~ ^[1-9][0-9]*$ ]] || die "--nproc-per-host must be a positive integer (got '$nproc')"
  if ! [[ $gbit =~ ^[0-9]*\.?[0-9]+$ ]] || ! awk -v g="$gbit" 'BEGIN { exit !(g > 0) }'; then
    die "--gbit must be a positive number (got '$gbit')"
  fi
  if ! [[ $mtu =~ ^[0-9]+$ ]] || ((mtu < 576 || mtu > 65535)); then die "--mtu must be 576..65535 (got '$mtu')"; fi
  [[ $launcher == dtrain || $launcher == torchrun ]] || die "--launcher must be dtrain or torchrun (got '$launcher')"
  ((EUID == 0)) || die "needs root (ip netns, tc)"
}

up() {
  validate
  gc
  [[ ! -e $(rig_dir "$name") ]] || die "a rig named '$name' is already up (cluster.sh down $name)"
  bin_dir=$(cd "$bin_dir" 2>/dev/null && pwd || echo "$bin_dir")
  save
  if ! make_rig; then
    destroy "$name"
    die "could not create the rig '$name' (ip netns/link/tc failed; see above)"
  fi
  echo "cluster.sh: rig '$name' up: $hosts hosts x $nproc ($launcher), ${gbit} Gbit/s links, MTU $mtu, state in $(rig_dir "$name")" >&2
  if ((hosts >= 2 && rate_check)); then
    local mode=""
    ((rate_check == 2)) && mode=--shaped
    (check_rate 1 0 $mode) || { destroy "$name"; exit 2; }
  elif ((hosts < 2)); then
    echo "cluster.sh: one host: no link to check the rate of" >&2
  fi
}

# ---- running -----------------------------------------------------------------------------------
need_launcher() {  # (a rig only used through exec needs no launcher)
  [[ $launcher == torchrun || -x $bin_dir/dtrain-run ]] || die "no dtrain-run in $bin_dir (build it, or --bin-dir)"
}

launch_cmd() {  # launch_cmd I PROGRAM...: fills the array cmd
  local i=$1; shift
  need_launcher
  local nn=${nnodes:-$hosts} m; m=$(host_addr "$name" 0)
  cmd=(env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 "${envs[@]}")
  if [[ $launcher == dtrain ]]; then
    cmd+=("$bin_dir/dtrain-run" --nnodes "$nn" --node-rank "$i" --nproc-per-node "$nproc"
      --master-addr "$m" --master-port "$master_port" "$@")
  else
    # --redirects 1 --tee 1: torchrun 1.13 under Python 3.11 cannot parse its own default "0" for these
    # (IntFlag no longer lists NONE, so Std.from_str returns None and the agent dies in to_map); 1 makes
    # it copy the workers' stdout to a log and to the console, stderr going straight to the console.
    source "$here/../benches/peer_python.sh"
    cmd+=("$PEER_PYTHON" -m torch.distributed.run --redirects 1 --tee 1 --nnodes "$nn" --node_rank "$i"
      --nproc_per_node "$nproc" --master_addr "$m" --master_port "$master_port" "$@")
  fi
}

parse_run_opts() {  # RUN OPTIONS up to "--"; the program is left in prog
  nnodes='' timeout_s=0 bg=0 envs=() prog=()
  while (($#)); do
    case $1 in
      --nnodes) nnodes=$2; shift 2 ;;
      --env) [[ $2 == *=* ]] || die "--env wants K=V (got '$2')"; envs+=("$2"); shift 2 ;;
      --timeout) timeout_s=$2; shift 2 ;;
      --bg) bg=1; shift ;;
      --) shift; prog=("$@"); break ;;
      *) die "unknown option '$1' (see --help)" ;;
    esac
  done
  ((${#prog[@]})) || die "no program given (after --)"
}

start_host() {  # start_host I: in the background; output to host-I.log (and prefixed to stdout unless bg)
  local i=$1 d ns; d=$(rig_dir "$name"); ns=$(ns_host "$name" "$i")
  launch_cmd "$i" "${prog[@]}"
  rm -f "$d/host-$i.rc"
  if ((bg)); then
    (
      set +e
      ip netns exec "$ns" "${cmd[@]}" >"$d/host-$i.log" 2>&1 </dev/null
      echo $? >"$d/host-$i.rc"
    ) &
  else
    (
      set +e
      ip netns exec "$ns" "${cmd[@]}" 2>&1 </dev/null | tee "$d/host-$i.log" | sed -u "s/^/[host $i] /"
      echo "${PIPESTATUS[0]}" >"$d/host-$i.rc"
    ) &
  fi
}

run_all() {  # every host; the worst exit code; 124 after --timeout
  local i pids=() worst=0 rc d; d=$(rig_dir "$name")
  for ((i = 0; i < hosts; i++)); do start_host "$i"; pids+=($!); done
  if [[ $timeout_s != 0 ]]; then
    # Its output goes nowhere: a sleep left holding our stdout would keep a reader of this script's
    # output (a pipe) waiting after we exit.
    # `&&`: a sleep killed because the hosts finished (below) must not count as a timeout.
    (sleep "$timeout_s" && { touch "$d/timed-out"; for ((i = 0; i < hosts; i++)); do kill_host "$i"; done; }) >/dev/null 2>&1 &
    local watchdog=$!
  fi
  for ((i = 0; i < hosts; i++)); do
    wait "${pids[$i]}" || true
    rc=$(cat "$d/host-$i.rc" 2>/dev/null || echo 255)
    echo "cluster.sh: host $i exited with $rc" >&2
    ((rc > worst)) && worst=$rc
  done
  if [[ -n ${watchdog:-} ]]; then
    pkill -P "$watchdog" sleep 2>/dev/null || true
    kill "$watchdog" 2>/dev/null || true
    wait "$watchdog" 2>/dev/null || true
  fi
  if [[ -e $d/timed-out ]]; then echo "cluster.sh: timed out after ${timeout_s}s: hosts killed" >&2; worst=124; fi
  return "$worst"
}

kill_host() {
  local pids; pids=$(ip netns pids "$(ns_host "$name" "$1")" 2>/dev/null || true)
  # shellcheck disable=SC2086
  [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

wait_host() {  # wait_host I [--timeout S]
  local i=$1 t=600 d; d=$(rig_dir "$name")
  [[ ${2:-} == --timeout ]] && t=$3
  local end=$((SECONDS + t))
  while [[ ! -s $d/host-$i.rc ]]; do
    ((SECONDS < end)) || { cat "$d/host-$i.log" 2>/dev/null; die "host $i still running after ${t}s"; }
    sleep 0.1
  done
  cat "$d/host-$i.log"
  return "$(cat "$d/host-$i.rc")"
}

add_host() {
  local i=$hosts
  make_host "$i" || { ip netns del "$(ns_host "$name" "$i")" 2>/dev/null || true; die "could not add host $i"; }
  hosts=$((hosts + 1))
  save
  echo "$i"
}

# ---- commands ----------------------------------------------------------------------------------
one_shot() {
  rig_defaults
  name="r$$" owner=$$
  while (($#)) && [[ $1 != -- ]]; do
    if [[ $1 == --no-rate-check ]]; then rate_check=0; shift
    elif [[ $1 == --shaped-rate-check ]]; then rate_check=2; shift
    elif parse_rig_opt "$1" "${2:-}"; then shift 2
    else break
    fi
  done
  parse_run_opts "$@"
  need_launcher
  trap 'destroy "$name"' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP
  up
  local rc=0
  run_all || rc=$?
  exit "$rc"
}

main() {
  (($#)) || { usage; exit 2; }
  case $1 in
    -h | --help) usage ;;
    up)
      shift; rig_defaults; name=''
      while (($#)); do
        if [[ $1 == --name ]]; then name=$2; shift 2
        elif [[ $1 == --no-rate-check ]]; then rate_check=0; shift
        elif [[ $1 == --shaped-rate-check ]]; then rate_check=2; shift
        elif parse_rig_opt "$1" "${2:-}"; then shift 2
        else die "unknown option '$1' for up"
        fi
      done
      up ;;
    run) load "$2"; shift 2; parse_run_opts "$@"; run_all ;;
    run-host)
      load "$2"; check_host_index "$3"; local i=$3; shift 3; parse_run_opts "$@"
      start_host "$i"
      ((bg)) || { wait $! || true; return "$(cat "$(rig_dir "$name")/host-$i.rc")"; } ;;
    wait-host) load "$2"; check_host_index "$3"; wait_host "$3" "${4:-}" "${5:-}" ;;
    exec)
      load "$2"; check_host_index "$3"; [[ ${4:-} == -- ]] || die "exec N I -- CMD"
      local ns; ns=$(ns_host "$name" "$3"); shift 4; ip netns exec "$ns" "$@" ;;
    kill-host) load "$2"; check_host_index "$3"; kill_host "$3" ;;
    cut) load "$2"; check_host_index "$3"; ip -n "$(ns_br "$name")" link set "h$3" down ;;
    restore) load "$2"; check_host_index "$3"; ip -n "$(ns_br "$name")" link set "h$3" up ;;
    add-host) load "$2"; add_host ;;
    addr) load "$2"; check_host_index "$3"; host_addr "$name" "$3" ;;
    check-rate)
      load "$2"; local a=${3:-1} b=${4:-0} shaped=${5:-}; check_host_index "$a"; check_host_index "$b"
      [[ -z $shaped || $shaped == --shaped ]] || die "check-rate N [I J] [--shaped], not '$shaped'"
      check_rate "$a" "$b" "$shaped" ;;
    down) [[ -n ${2:-} ]] || die "down NAME"; destroy "$2" ;;
    gc) gc ;;
    -*) one_shot "$@" ;;
    *) die "unknown command '$1' (see --help)" ;;
  esac
}

main "$@"
