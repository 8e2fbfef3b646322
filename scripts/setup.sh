#!/usr/bin/env bash
# Installs what dtrain needs, by purpose. Idempotent: packages already present are skipped, and pip
# installs nothing when the pinned wheel is already in the environment. Needs root or sudo for apt.
#
#   bash scripts/setup.sh main    what the main job needs (scripts/run_main.sh): the compilers, the build's
#                                 libraries and Debian's libtorch-dev 1.13 (CPU), which installs in a minute
#   bash scripts/setup.sh         everything (scripts/test.sh): the above, the test and benchmark tools
#                                 (OpenMPI, Slurm, etcd, Chromium, clang-tidy, python3-torch 1.13) and the
#                                 torch wheel (libtorch 2.x, about 3 GB with its nvidia-* wheels) in the
#                                 virtual environment .venv (ignored by git)
#   bash scripts/setup.sh torch2  the virtual environment alone (needs python3-venv)
#
# Env: DTRAIN_VENV (default <repo>/.venv), DTRAIN_TORCH_VERSION (default the pin below).
# Build against the wheel's libtorch with
#   cmake -S . -B build-torch2 -DCMAKE_PREFIX_PATH="$(.venv/bin/python -c 'import torch; print(torch.__path__[0])')"
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:-all}
# The newest torch PyPI serves, tested here (2026-11-27). 2.14 and later need C++20 (CMake picks it).
torch_pin=${DTRAIN_TORCH_VERSION:-2.15.0}
venv=${DTRAIN_VENV:-$root/.venv}
lizard_pin=1.24.3  # scripts/check_structure.sh's function-size measure
pytest_pin=9.2.0  # the Python backend's tests (tests/python)
skbuild_pin=1.1.2  # scikit-build-core: pip install --no-build-isolation ./python

main_pkgs=(
  build-essential cmake ninja-build pkg-config git libssl-dev libcurl4-openssl-dev
  libcli11-dev libfmt-dev nlohmann-json3-dev zlib1g-dev
  libavformat-dev libavcodec-dev libswscale-dev libavutil-dev
  libtorch-dev libopenblas0-pthread python3-dev
)
test_pkgs=(
  libgtest-dev libgmock-dev libbenchmark-dev ccache
  openmpi-bin libopenmpi-dev python3-torch python3-numpy python3-venv python3-av
  iproute2 procps
  clang-tidy-14 clang-14 libclang-rt-14-dev
  chromium
  munge slurmctld slurmd slurm-client
  etcd-server
  doxygen  # scripts/check_api_docs.sh (check_structure.sh's api-docs)
)

apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "setup: Debian packages present"
    return
  fi
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The torch wheel in its own environment, made with Debian's python3 (python3-venv), so the version on
# PyPI and the interpreter are the same on every machine of this kind. numpy: the parity tests use it;
# lizard: scripts/check_structure.sh measures every function with it; pytest and scikit-build-core: the
# Python backend (python/) is built and tested with them.
torch2_venv() {
  [[ -x $venv/bin/python ]] || /usr/bin/python3 -m venv "$venv"
  local have
  have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"), m.version("numpy"), m.version("lizard"), m.version("pytest"), m.version("scikit-build-core"))' 2>/dev/null || true)
  if [[ $have == "$torch_pin "*" $pytest_pin $skbuild_pin" ]]; then
    echo "setup: torch $torch_pin and lizard present in $venv"
    return
  fi
  echo "setup: installing torch==$torch_pin (the CUDA wheel and its nvidia-* dependencies, ~3 GB) and lizard into $venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_pin" numpy "lizard==$lizard_pin" \
    "pytest==$pytest_pin" "scikit-build-core==$skbuild_pin"
}

case $what in
  main) apt_install "${main_pkgs[@]}" ;;
  torch2) torch2_venv ;;
  all)
    apt_install "${main_pkgs[@]}" "${test_pkgs[@]}"
    torch2_venv
    ;;
  *) echo "usage: bash scripts/setup.sh [main|torch2|all]" >&2; exit 2 ;;
esac
