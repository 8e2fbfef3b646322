#!/usr/bin/env bash
# soak.sh: the fault soak (issue 27). Runs TRIALS trials (200 by default); each picks a workload (allreduce
# sweeps on tcp and on shm, DDP, ZeRO-2 and MIL-NCE training with checkpoints, parameter-server training,
# pipeline training), a rank, a fault (SIGKILL, SIGSTOP, a cut link between two emulated hosts, a full disk
# while checkpoints are written, a truncated or bit-flipped newest checkpoint on resume) and a moment, and
# records how long the launcher and the survivors took to stop, whether the error named the rank and the
# cause, whether a restart (--max-restarts 1) ended equal to an uninterrupted run, and whether the newest
# checkpoint still loads. Prints one line a trial, a table, and writes JSON (scripts/soak.py has the rules).
#
# Usage: scripts/soak.sh [--trials N] [--seed S] [--timeout SECONDS] [--json FILE] [--only-fault F]
#        [--bin-dir DIR] [--work-dir DIR]
# Needs root (tmpfs mounts, network namespaces) and a build with the tools, examples, dtrain-bench and milnce
# (default build-torch2/bin). Bounded: every trial is killed past 2x the timeout plus its allowance.
set -euo pipefail
exec /usr/bin/python3 "$(dirname "$0")/soak.py" "$@"
