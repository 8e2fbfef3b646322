#!/usr/bin/env bash
# Consumer-project tests: dtrain used by CMake projects outside its tree, the ways the README's "Use dtrain
# in your CMake project" gives, each program run on 2 ranks and checking its results:
#   installed     cmake --install into a prefix; tests/consumer/installed finds it with find_package(dtrain)
#                 and links dtrain::comm (an allreduce) and dtrain::dtrain (a DDP step); dtrain-run from the prefix
#   subdirectory  tests/consumer/subdirectory: add_subdirectory(dtrain EXCLUDE_FROM_ALL), dtrain::comm
#   fetchcontent  the same project with FetchContent from this repository's git HEAD (a clean clone)
#   deb           cpack -G DEB; apt-get install ./libdtrain-dev_*.deb; tests/consumer/installed against /usr,
#                 run with /usr/bin/dtrain-run; the package is removed again at the end (needs root or sudo)
# Usage: bash scripts/consumer_test.sh [installed|subdirectory|fetchcontent|deb]...   (default: all four)
# Env: BUILD_DIR (dtrain's build, already built; default build), JOBS (default 2).
# Run by scripts/test.sh after ctest. About 7 minutes on 2 busy cores (installed 73 s, subdirectory 137 s,
# fetchcontent 102 s, deb 80 s), most of it compiling dtrain_comm twice and the DDP check twice.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${BUILD_DIR:-$root/build}" && pwd)
jobs=${JOBS:-2}
work=$build/consumer
consumer=$root/tests/consumer
ranks=2
deadline=300  # seconds for one 2-rank run (each op inside has its own deadline too)
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=Release)  # CMake reads CMAKE_CXX_COMPILER_LAUNCHER=ccache from the env
# The libtorch dtrain's build used (its CMAKE_PREFIX_PATH: a torch wheel's or a zip's root; empty for
# Debian's): the consumers find the same one.
torch_prefix=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt")
torch_version=$(sed -n 's/.*kTorchVersion = "\(.*\)";/\1/p' "$build/include/dtrain/build_info.h")
echo "consumer_test: dtrain's build $build uses libtorch $torch_version${torch_prefix:+ from $torch_prefix}"

step() { echo; echo "== consumer_test: $*"; }
fail() { echo "consumer_test: FAILED: $*" >&2; exit 1; }

# configure <source> <build dir> <expected "dtrain X from DIR" prefix or ""> [cmake args...]
configure() {
  local src=$1 dir=$2 expect=$3; shift 3
  rm -rf "$dir"
  cmake -S "$src" -B "$dir" "${cmake_args[@]}" "$@" >"$dir.configure.log" 2>&1 \
    || { cat "$dir.configure.log"; fail "configuring $src"; }
  if [[ -n $expect ]]; then
    grep -q -- "-- dtrain [0-9.]* from $expect" "$dir.configure.log" \
      || { cat "$dir.configure.log"; fail "$src did not find dtrain in $expect"; }
    grep -- "-- dtrain [0-9.]* from" "$dir.configure.log"
  fi
}

# run_ranks <dtrain-run> <program>: the program on $ranks local ranks; it checks its own results.
run_ranks() {
  timeout --kill-after=10 "$deadline" "$1" --standalone --nproc-per-node "$ranks" "$2" "$ranks" \
    || fail "$(basename "$2") on $ranks ranks (launcher $1)"
}

t_installed() {
  step "installed prefix: cmake --install, find_package(dtrain) with CMAKE_PREFIX_PATH"
  local prefix=$work/prefix
  rm -rf "$prefix"
  cmake --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "cmake --install"; }
  for f in include/dtrain/comm/comm.h include/dtrain/ddp.h lib/libdtrain_comm_base.a lib/libdtrain_comm.a \
           lib/libdtrain.a bin/dtrain-run bin/dtrain-bench lib/cmake/dtrain/dtrainConfig.cmake \
           lib/cmake/dtrain/dtrainConfigVersion.cmake; do
    [[ -e $prefix/$f ]] || fail "cmake --install put no $f into the prefix"
  done
  configure "$consumer/installed" "$work/installed" "$prefix/" -DCMAKE_PREFIX_PATH="$prefix${torch_prefix:+;$torch_prefix}"
  cmake --build "$work/installed" -j"$jobs" || fail "building tests/consumer/installed against $prefix"
  run_ranks "$prefix/bin/dtrain-run" "$work/installed/consumer-allreduce"
  run_ranks "$prefix/bin/dtrain-run" "$work/installed/consumer-ddp"
}

t_subdirectory() {
  step "add_subdirectory(dtrain EXCLUDE_FROM_ALL), dtrain::comm"
  configure "$consumer/subdirectory" "$work/subdirectory" "" -DDTRAIN_VIA=subdirectory -DDTRAIN_SOURCE_DIR="$root" \
    ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix"}
  cmake --build "$work/subdirectory" -j"$jobs" || fail "building tests/consumer/subdirectory"
  run_ranks "$work/subdirectory/dtrain/bin/dtrain-run" "$work/subdirectory/consumer-allreduce"
}

t_fetchcontent() {
  step "FetchContent from git HEAD, dtrain::comm"
  local head
  head=$(git -C "$root" rev-parse HEAD 2>/dev/null) || fail "fetchcontent needs $root to be a git checkout"
  [[ -z $(git -C "$root" status --porcelain -- CMakeLists.txt cmake src include tools) ]] \
    || echo "consumer_test: note: FetchContent builds the committed HEAD $head, not your uncommitted changes"
  configure "$consumer/subdirectory" "$work/fetchcontent" "" -DDTRAIN_VIA=fetchcontent \
    -DDTRAIN_GIT="file://$root" -DDTRAIN_GIT_TAG="$head" ${torch_prefix:+-DCMAKE_PREFIX_PATH="$torch_prefix"}
  cmake --build "$work/fetchcontent" --target consumer-allreduce -j"$jobs" || fail "building with FetchContent"
  run_ranks "$work/fetchcontent/_deps/dtrain-build/bin/dtrain-run" "$work/fetchcontent/consumer-allreduce"
}

# The .deb test installs into /usr and removes the package again; this file marks an install of its own, so
# a run that was killed before removing it is cleaned up by the next run, while a libdtrain-dev that
# someone installed is never replaced.
deb_marker=/var/tmp/dtrain-consumer-test.deb-installed

t_deb() {
  step "cpack -G DEB, apt-get install ./libdtrain-dev_*.deb, find_package(dtrain) from /usr"
  local deb
  [[ -z $torch_prefix ]] || fail "the .deb is built against Debian's libtorch-dev: $build uses $torch_prefix (test the .deb with a Debian-libtorch build)"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  if dpkg-query -W -f='${Status}' libdtrain-dev 2>/dev/null | grep -q "install ok installed"; then
    [[ -e $deb_marker ]] || fail "libdtrain-dev is installed on this machine and not by this test; it installs \
and removes its own: remove yours first (dpkg -r libdtrain-dev) or run the other tests only"
    echo "consumer_test: removing the libdtrain-dev an interrupted earlier run left installed"
    remove_deb
  fi
  rm -rf "$work/deb"
  (cd "$build" && cpack -G DEB -B "$work/deb" >"$work/cpack.log" 2>&1) || { cat "$work/cpack.log"; fail "cpack -G DEB"; }
  deb=$(ls "$work"/deb/libdtrain-dev_*.deb)
  echo "$(basename "$deb"): Depends: $(dpkg-deb -f "$deb" Depends)"
  for dep in libtorch-dev libfmt-dev; do
    dpkg-deb -f "$deb" Depends | grep -qw "$dep" || fail "$deb does not depend on $dep"
  done
  $sudo touch "$deb_marker"
  trap remove_deb EXIT
  trap 'exit 143' TERM INT
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$deb" \
    || fail "apt-get install $deb"
  configure "$consumer/installed" "$work/deb-consumer" "/usr/"
  cmake --build "$work/deb-consumer" -j"$jobs" || fail "building tests/consumer/installed against /usr"
  run_ranks /usr/bin/dtrain-run "$work/deb-consumer/consumer-allreduce"
  run_ranks /usr/bin/dtrain-run "$work/deb-consumer/consumer-ddp"
  trap - EXIT TERM INT
  remove_deb
  [[ ! -e /usr/include/dtrain ]] || fail "/usr/include/dtrain is still there after dpkg --purge"
}

remove_deb() {
  $sudo dpkg --purge libdtrain-dev >/dev/null && $sudo rm -f "$deb_marker"
}

mkdir -p "$work"
tests=("$@")
((${#tests[@]})) || tests=(installed subdirectory fetchcontent deb)
for t in "${tests[@]}"; do
  case $t in
    installed | subdirectory | fetchcontent | deb) start=$SECONDS; "t_$t"; echo "== consumer_test: $t passed ($((SECONDS - start)) s)" ;;
    *) fail "unknown test '$t' (installed, subdirectory, fetchcontent, deb)" ;;
  esac
done
echo "consumer_test: all passed (${tests[*]})"
