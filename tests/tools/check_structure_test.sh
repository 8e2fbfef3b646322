#!/usr/bin/env bash
# Self-test of scripts/check_structure.sh on a small fake tree: every check must name its planted
# offender and fail, and the same tree without offenders must pass.
# Usage: tests/tools/check_structure_test.sh PATH/TO/check_structure.sh   (CTest: check_structure_test)
set -euo pipefail
script=${1:?usage: check_structure_test.sh PATH/TO/check_structure.sh}
# lizard from the repository's .venv (scripts/setup.sh), as the real tree's check uses it.
export LIZARD_PYTHON=${LIZARD_PYTHON:-$(cd "$(dirname "$script")/.." && pwd)/.venv/bin/python}
fake=$(mktemp -d); trap 'rm -rf "$fake"' EXIT
mkdir -p "$fake"/{scripts,src/comm/transport/x,tools/t,apps,benches,include,build}
cp "$script" "$fake/scripts/check_structure.sh"
# The api-docs check: its script and Doxyfile as they are, with a front page of its own.
repo=$(cd "$(dirname "$script")/.." && pwd)
cp "$repo/scripts/check_api_docs.sh" "$fake/scripts/"
mkdir -p "$fake/docs/api"
cp "$repo/docs/api/Doxyfile" "$fake/docs/api/"
printf '# Fake\n\nA tree for the structural checks.\n' >"$fake/docs/api/mainpage.md"
cd "$fake"

db() {  # db INCLUDE_DIR: compile_commands.json with the one tool source compiled with -I INCLUDE_DIR
  printf '[{"directory": "%s/build", "command": "/usr/bin/c++ -I%s -O2 -o t.o -c %s/tools/t/t.cc", "file": "%s/tools/t/t.cc"}]\n' \
    "$fake" "$1" "$fake" "$fake" >build/compile_commands.json
}

# ---- offenders ----
for i in $(seq 601); do echo "// line $i"; done >apps/big.h
{
  echo 'int f() {'; echo '  int x = 0;'
  for i in $(seq 130); do echo "  x += $i;"; done
  echo '  return x;'; echo '}'; echo 'int main() { return f(); }'
} >tools/t/t.cc
printf '#include <cstdlib>\nconst char* a() { return std::getenv("A"); }\n' >src/a.cc
printf '#include <cstdlib>\nconst char* b() { return std::getenv("B"); }\n' >src/b.cc
mkdir -p include/dtrain
printf '#if TORCH_VERSION_MAJOR >= 2\n#endif\n' >include/dtrain/compat.h      # the one place allowed
printf '/// @file\n/// A header.\n#pragma once\n/// The namespace.\nnamespace dtrain {\nint undocumented();\n}\n' \
  >include/dtrain/api.h
printf 'int v() {\n#if TORCH_VERSION_MAJOR >= 2\n  return 2;\n#endif\n}\n' >src/v.cc
cat >src/comm/transport/x/t.cc <<'EOF'
#include "comm/collectives/kernels.h"
// allreduce( in a comment is not code
void ok() { const char* s = "broadcast("; (void)s; }
bool allreduceRing(int n) { return n > 0; }
EOF
db "$fake/src"
rc=0
out=$(bash scripts/check_structure.sh 2>&1) || rc=$?
echo "$out"
fails=0
expect() {
  if grep -qF -- "$1" <<<"$out"; then echo "ok: $1"; else echo "MISSING: $1"; fails=1; fi
}
[[ $rc == 1 ]] || { echo "expected exit 1 with offenders, got $rc"; fails=1; }
expect "FAIL file-size: apps/big.h: 601 lines (limit 600)"
expect "FAIL function-size: tools/t/t.cc:1: 'f' is 133 lines (limit 120; lizard)"
expect "FAIL function-size: tools/t/t.cc:1: 'f' is 133 lines (limit 120; clang-tidy)"
expect "FAIL getenv: 2 files of src/ read the environment (limit one): src/a.cc src/b.cc"
expect "FAIL tool-includes: tools/t/t.cc is compiled with $fake/src on its include path"
expect "FAIL transport-algos: src/comm/transport/x/t.cc:1: includes comm/collectives/kernels.h"
expect "FAIL transport-algos: src/comm/transport/x/t.cc:4: collective 'allreduce'"
expect "FAIL torch-version: src/v.cc:2: only include/dtrain/compat.h tests libtorch's version"
expect "FAIL api-docs: include/dtrain/api.h:6: error: Member undocumented() (function) of namespace dtrain is not documented."
n=$(grep -c '^FAIL' <<<"$out" || true)
[[ $n == 9 ]] || { echo "expected 9 offenders (the comment and the string are not code), got $n"; fails=1; }

# ---- the same tree without offenders ----
rm apps/big.h src/b.cc src/comm/transport/x/t.cc src/v.cc
sed -i 's|^int undocumented();|/// Now documented.\nint undocumented();|' include/dtrain/api.h
printf 'int f() { return 1; }\nint main() { return f(); }\n' >tools/t/t.cc
db "$fake/include"
rc=0
out=$(bash scripts/check_structure.sh 2>&1) || rc=$?
echo "$out"
[[ $rc == 0 ]] || { echo "expected exit 0 without offenders, got $rc"; fails=1; }
exit $fails
