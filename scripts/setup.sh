#!/usr/bin/env bash
# Installs every Debian package dtrain needs to build, test, benchmark and run its anchors.
# Idempotent: packages already present are skipped. Needs root or sudo.
set -euo pipefail
pkgs=(
  build-essential cmake ninja-build pkg-config git libssl-dev libcurl4-openssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev libfmt-dev nlohmann-json3-dev
  libtorch-dev libopenblas0-pthread
  openmpi-bin libopenmpi-dev python3-torch
  iproute2 procps
  clang-tidy-14
  chromium
  munge slurmctld slurmd slurm-client
  etcd-server
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [[ $(id -u) -eq 0 ]] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi
