#!/usr/bin/env bash
# check_structure.sh: the structural acceptance checks of the code base (issue 10), runnable by anyone
# and run by scripts/test.sh (so by CI). Each check prints every offender on its own line, starting
# with "FAIL <check>:"; the exit status is 1 when any check fails, 0 when all pass.
#
#   file-size        no source file in src/, apps/, tools/, benches/ over 600 lines
#   function-size    no function in src/, apps/, tools/, benches/ over 120 lines, measured twice:
#                    - lizard (PyPI; scripts/setup.sh puts it in .venv) over every source file, no build
#                      needed: a function's lines from its name to its closing brace, less one (for a
#                      signature on one line, the count of clang-tidy's check below);
#                    - clang-tidy-14 readability-function-size (LineThreshold 120, "lines including
#                      whitespace and comments") over the translation units of TIDY_BUILD's
#                      compile_commands.json (JOBS in parallel). CI gives it the comm-only clang build of
#                      scripts/sanitize.sh (no libtorch headers to parse: ~1 min); over a gcc build with
#                      libtorch it takes ~9 min on 2 cores: gcc's precompiled-header flags are replaced by
#                      the header they stand for, since clang cannot read gcc's .gch (a private copy of
#                      compile_commands.json reads that header from a clang PCH built here, or as text
#                      where none fits)
#   getenv           the environment is read in one file of src/: `grep -rl getenv src` names at most one
#   tool-includes    the tools (tools/, benches/dtrain_bench/) compile without src/ on their include path:
#                    they use the public headers of include/ only
#   transport-algos  nothing under src/comm/transport/ implements a collective algorithm: no function
#                    named after a collective (allreduce, allgather, reduceScatter, broadcast, alltoall,
#                    alone or with an algorithm's suffix: allreduceRing, ...) is declared, defined or
#                    called there (comments and strings aside), and no header of src/comm/collectives/
#                    (the algorithms and their reduction kernels) is included
#   torch-version    libtorch's version is tested in one file: no TORCH_VERSION_* outside
#                    include/dtrain/compat.h (in src/, include/, apps/, tools/, benches/, tests/, examples/)
#   api-docs         every public declaration of include/dtrain has a Doxygen summary and no comment there
#                    is malformed: scripts/check_api_docs.sh (needs doxygen: scripts/setup.sh installs it)
#
# Usage: scripts/check_structure.sh [--no-tidy] [--report FILE]
#   --no-tidy      skip clang-tidy's half of function-size (lizard's runs)
#   --report FILE  also write the offenders (the FAIL lines) to FILE
# Env: BUILD_DIR (default <repo>/build, configured: it needs compile_commands.json; tool-includes reads
#      it), TIDY_BUILD (default BUILD_DIR: the build clang-tidy reads), TIDY_DIRS (default "src apps tools
#      benches": the translation units of TIDY_BUILD under them are read), JOBS (default 2), LIZARD_PYTHON (a
#      python with lizard: default <repo>/.venv/bin/python, else python3), CLANG_TIDY (default
#      clang-tidy-14), CLANGXX (the clang++ of the same version, which builds the PCH: default
#      CLANG_TIDY's name with clang-tidy replaced by clang++, so clang++-14).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
jobs=${JOBS:-2}
tidy_bin=${CLANG_TIDY:-clang-tidy-14}
clangxx=${CLANGXX:-${tidy_bin/clang-tidy/clang++}}
run_tidy=1
report=""
while (($#)); do
  case $1 in
    --no-tidy) run_tidy=0; shift ;;
    --report) report=${2:?check_structure.sh: --report needs a file}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "check_structure.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
ccdb=$build/compile_commands.json
[[ -f $ccdb ]] || { echo "check_structure.sh: $ccdb not found: configure first (cmake -S $root -B $build)" >&2; exit 2; }
tidy_db=${TIDY_BUILD:-$build}/compile_commands.json
[[ -f $tidy_db ]] || { echo "check_structure.sh: $tidy_db (TIDY_BUILD) not found: configure it first" >&2; exit 2; }
lizard_py=${LIZARD_PYTHON:-$root/.venv/bin/python}
[[ -x $lizard_py ]] || lizard_py=python3

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fails=$tmp/fails
: >"$fails"
fail() { echo "FAIL $*" | tee -a "$fails"; }
cd "$root"
dirs=(src apps tools benches)

# ---- file-size ----
while IFS= read -r f; do
  n=$(wc -l <"$f")
  ((n <= 600)) || fail "file-size: $f: $n lines (limit 600)"
done < <(find "${dirs[@]}" -type f \( -name '*.cc' -o -name '*.h' -o -name '*.c' -o -name '*.cpp' -o -name '*.hpp' \
  -o -name '*.py' -o -name '*.sh' \) | sort)

# ---- getenv ----
mapfile -t readers < <(grep -rl getenv src | sort || true)
((${#readers[@]} <= 1)) || fail "getenv: ${#readers[@]} files of src/ read the environment (limit one): ${readers[*]}"

# ---- torch-version ----
while IFS= read -r hit; do
  fail "torch-version: $hit: only include/dtrain/compat.h tests libtorch's version"
done < <(grep -rn --include='*.h' --include='*.cc' --include='*.cpp' --include='*.hpp' 'TORCH_VERSION_' \
           src include apps tools benches tests examples 2>/dev/null | grep -v '^include/dtrain/compat\.h:' | cut -d: -f1,2 || true)

# ---- api-docs ----
if ! bash "$root/scripts/check_api_docs.sh" "$tmp/api" >"$tmp/api-docs" 2>&1; then
  grep -v '^api docs: ' "$tmp/api-docs" >"$tmp/api-docs.fails" || tail -n 1 "$tmp/api-docs" >"$tmp/api-docs.fails"
  while IFS= read -r line; do fail "api-docs: $line"; done <"$tmp/api-docs.fails"
fi

# ---- tool-includes ----
/usr/bin/python3 - "$ccdb" "$root" >>"$tmp/includes" <<'PY'
import json, re, shlex, sys
ccdb, root = sys.argv[1], sys.argv[2]
for e in json.load(open(ccdb)):
    f = e["file"]
    if not (f.startswith(root + "/tools/") or f.startswith(root + "/benches/")):
        continue
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    for i, a in enumerate(args):
        d = None
        for flag in ("-I", "-isystem", "-iquote", "-idirafter"):
            if a == flag and i + 1 < len(args):
                d = args[i + 1]
            elif a.startswith(flag) and len(a) > len(flag):
                d = a[len(flag):]
        if d is not None and re.match(re.escape(root) + r"/src(/|$)", d.rstrip("/") + "/"):
            print(f"tool-includes: {f[len(root) + 1:]} is compiled with {d} on its include path")
            break
PY
while IFS= read -r line; do fail "$line"; done <"$tmp/includes"

# ---- transport-algos ----
/usr/bin/python3 - "$root" >"$tmp/transport" <<'PY'
import os, re, sys
root = sys.argv[1]
# (Not a bare "reduce": a receive may reduce into its destination with the kernel it was handed,
# op.reduce(...), which moves bytes; the collective reduce is caught by its own name elsewhere.)
names = r"(allreduce|allReduce|allgather|allGather|reduceScatter|reduce_scatter|broadcast|alltoall|allToAll)"
# The op's name, alone or with an algorithm's suffix (allreduceRing, broadcastTree, ...).
variant = r"(?:Ring|Direct|Tree|Star|Pairwise|Recursive\w*|Halving\w*|Doubling\w*|Impl)?\s*\("
call = re.compile(r"(?<![\w.])" + names + variant)
call_member = re.compile(r"(?:->|\.|::)" + names + variant)
include = re.compile(r'#\s*include\s*"comm/collectives/')
def strip(line, in_block):
    # Drops comments and string/char literals, keeps code.
    out, i = [], 0
    while i < len(line):
        if in_block:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out), True
            i, in_block = j + 2, False
        elif line.startswith("//", i):
            break
        elif line.startswith("/*", i):
            in_block, i = True, i + 2
        elif line[i] in "\"'":
            q, i = line[i], i + 1
            while i < len(line) and line[i] != q:
                i += 2 if line[i] == "\\" else 1
            i += 1
        else:
            out.append(line[i]); i += 1
    return "".join(out), in_block
base = os.path.join(root, "src/comm/transport")
for d, _, files in sorted(os.walk(base)):
    for fn in sorted(files):
        p = os.path.join(d, fn)
        rel = p[len(root) + 1:]
        in_block = False
        for no, line in enumerate(open(p, errors="replace"), 1):
            if include.search(line):
                header = line.split('"')[1]
                print(f"transport-algos: {rel}:{no}: includes {header} (collective algorithms and "
                      "their kernels live in src/comm/collectives/)")
                continue
            code, in_block = strip(line, in_block)
            m = call.search(code) or call_member.search(code)
            if m:
                print(f"transport-algos: {rel}:{no}: collective '{m.group(1)}' in a transport: {code.strip()[:100]}")
PY
while IFS= read -r line; do fail "$line"; done <"$tmp/transport"

# ---- function-size: lizard ----
if "$lizard_py" -c 'import lizard' 2>/dev/null; then
  "$lizard_py" - "${dirs[@]}" >"$tmp/lizard" <<'PY'
import os, sys, lizard
for d in sys.argv[1:]:
    for base, _, files in sorted(os.walk(d)):
        for fn in sorted(files):
            if not fn.endswith((".cc", ".h", ".c", ".cpp", ".hpp")):
                continue
            path = os.path.join(base, fn)
            for f in lizard.analyze_file(path).function_list:
                n = f.end_line - f.start_line  # lines after the first: clang-tidy's count for a one-line signature
                if n > 120:
                    print(f"function-size: {path}:{f.start_line}: '{f.name}' is {n} lines (limit 120; lizard)")
PY
  while IFS= read -r line; do fail "$line"; done <"$tmp/lizard"
else
  fail "function-size: lizard not found ($lizard_py; scripts/setup.sh installs it in .venv, or set LIZARD_PYTHON)"
fi

# ---- function-size: clang-tidy ----
if ((run_tidy)); then
  command -v "$tidy_bin" >/dev/null || { fail "function-size: $tidy_bin not installed (scripts/setup.sh installs it)"; }
fi
if ((run_tidy)) && command -v "$tidy_bin" >/dev/null; then
  t0=$SECONDS
  # clang cannot read gcc's precompiled headers. $tmp/db, a private copy of compile_commands.json,
  # points each `-include .../cmake_pch.hxx` at a copy of that header (the text it was built from) in a
  # directory without the .gch, and drops -Winvalid-pch: a TU run on it parses libtorch's headers, most
  # of its time. $tmp/dbpch, what is run, gives those TUs `-include-pch` of a clang PCH of that text
  # instead, built once per header and set of flags: a TU takes half the time (src/torch/autograd.cc:
  # 23 s, 13 s; -fpch-instantiate-templates makes the instantiations that the headers' inline code asks
  # for once, in the PCH, where each TU would redo them at its end). clang checks only some flags against
  # a PCH (a -D that the TU lacks passes unnoticed), so a PCH serves only TUs with the flags it was built
  # with, include paths aside where the header preprocesses (-E -dD) to the same text under theirs: the
  # TUs get the declarations the text would give them, and their own code is parsed as before. A PCH
  # that does not build leaves its TUs on the text; a TU whose PCH clang rejects is rerun on $tmp/db.
  /usr/bin/python3 - "$tidy_db" "$root" "$tmp" "$clangxx" "$jobs" >"$tmp/files" <<'PY'
import concurrent.futures, hashlib, json, os, re, shlex, shutil, subprocess, sys
ccdb, root, tmp, clangxx, jobs = sys.argv[1:]
out = tmp + "/db"
os.makedirs(out + "/pch")
os.makedirs(tmp + "/pch")
entries, files = [], []
def copy(src):
    dst = os.path.join(out, "pch", src.strip("/").replace("/", "_"))
    if not os.path.exists(dst):
        shutil.copy(src, dst)
    return dst

# (header, flags) when a TU's first -include is a cmake_pch.hxx, else None. flags: the TU's arguments
# but the compiler, the source, the output, the dependency file, that -include and -Winvalid-pch.
# (-include-pch is read before every -include: not used where another -include comes first.)
def pch_flags(e, args):
    src = os.path.normpath(os.path.join(e["directory"], e["file"]))
    header, flags, i = None, [], 1
    while i < len(args):
        a = args[i]
        if a == "-include" and header is None and i + 1 < len(args) and args[i + 1].endswith("cmake_pch.hxx"):
            header, i = args[i + 1], i + 2
            continue
        if a.startswith(("-include", "-imacros")) and header is None:
            return None
        if a in ("-o", "-MF", "-MT", "-MQ"):
            i += 2
            continue
        if a in ("-c", "-M", "-MM", "-MD", "-MMD", "-MP", "-MG", "-Winvalid-pch") or a.startswith(("-MF", "-MT", "-MQ")) \
                or (not a.startswith("-") and os.path.normpath(os.path.join(e["directory"], a)) == src):
            i += 1
            continue
        flags.append(a)
        i += 1
    return (header, flags) if header else None

# The flags but the include paths: TUs that differ only there may share a PCH.
def without_paths(flags):
    kept, i = [], 0
    while i < len(flags):
        a = flags[i]
        for p in ("-I", "-isystem", "-iquote", "-idirafter"):
            if a.startswith(p):
                i += 2 if a == p else 1
                break
        else:
            kept.append(a)
            i += 1
    return tuple(kept)

uses = []  # (index in entries, directory, header, flags)
for e in json.load(open(ccdb)):
    f = e["file"]
    if not any(f.startswith(f"{root}/{d}/") for d in os.environ.get("TIDY_DIRS", "src apps tools benches").split()):
        continue
    hf = pch_flags(e, list(e["arguments"]) if "arguments" in e else shlex.split(e["command"]))
    if hf:
        uses.append((len(entries), e["directory"], hf[0], hf[1]))
    if "command" in e:
        e["command"] = re.sub(r"-include (\S+/cmake_pch\.hxx)(?=\s)", lambda m: "-include " + copy(m[1]), e["command"]).replace(" -Winvalid-pch", "")
    else:
        a = e["arguments"]
        for i in range(len(a) - 1):
            if a[i] == "-include" and a[i + 1].endswith("cmake_pch.hxx"):
                a[i + 1] = copy(a[i + 1])
        e["arguments"] = [x for x in a if x != "-Winvalid-pch"]
    entries.append(e)
    if f not in files:
        files.append(f)
json.dump(entries, open(out + "/compile_commands.json", "w"))
print("\n".join(files))

# The PCH is built from a header that includes the copy, so that its `#pragma GCC system_header` acts
# as in the TUs (clang ignores it in the main file).
wrappers = {}
def wrapper(header):
    if header not in wrappers:
        wrappers[header] = f"{tmp}/pch/{len(wrappers)}.hxx"
        with open(wrappers[header], "w") as w:
            w.write(f'#include "{copy(header)}"\n')
    return wrappers[header]
exact = {}  # (directory, header, flags) -> indexes of the TUs
for idx, d, h, flags in uses:
    exact.setdefault((d, h, tuple(flags)), []).append(idx)
loose = {}
for k in exact:
    loose.setdefault((k[0], k[1], without_paths(k[2])), []).append(k)
def preprocessed(k):
    r = subprocess.run([clangxx, *k[2], "-E", "-dD", "-x", "c++-header", wrapper(k[1])], cwd=k[0],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return hashlib.sha256(r.stdout).hexdigest() if r.returncode == 0 else k
pool = concurrent.futures.ThreadPoolExecutor(max(1, int(jobs)))
groups = []  # [flags of one member, directory, header, indexes]: one PCH each
if loose and not shutil.which(clangxx):
    print(f"check_structure: note: {clangxx} not found, libtorch headers are parsed in every translation "
          "unit (slower)", file=sys.stderr)
    loose = {}
for ks in loose.values():
    text = dict(zip(ks, pool.map(preprocessed, ks))) if len(ks) > 1 else {ks[0]: None}
    shared = {}
    for k in ks:
        if text[k] in shared:
            shared[text[k]][3].extend(exact[k])
        else:
            shared[text[k]] = [list(k[2]), k[0], k[1], list(exact[k])]
    groups.extend(shared.values())
def build(n):
    flags, d, h, _ = groups[n]
    pch = f"{tmp}/pch/{n}.pch"
    r = subprocess.run([clangxx, *flags, "-fpch-instantiate-templates", "-x", "c++-header", wrapper(h), "-o", pch],
                       cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if r.returncode == 0:
        return pch
    why = [l for l in r.stdout.splitlines() if "error" in l][:2] or r.stdout.splitlines()[-1:]
    print(f"check_structure: note: no clang PCH of {h} for {len(groups[n][3])} translation unit(s), their "
          f"libtorch headers are parsed as text: {' '.join(why)}", file=sys.stderr)
    return None
built = list(pool.map(build, range(len(groups))))
n_pch = n_tus = 0
for (flags, d, h, idxs), pch in zip(groups, built):
    if not pch:
        continue
    n_pch, n_tus = n_pch + 1, n_tus + len(idxs)
    for idx in idxs:
        e = dict(entries[idx])
        if "command" in e:
            e["command"] = e["command"].replace(f"-include {copy(h)}", f"-include-pch {pch}", 1)
        else:
            a = list(e["arguments"])
            a[a.index(copy(h)) - 1:a.index(copy(h)) + 1] = ["-include-pch", pch]
            e["arguments"] = a
        entries[idx] = e
os.makedirs(tmp + "/dbpch")
json.dump(entries, open(tmp + "/dbpch/compile_commands.json", "w"))
open(tmp + "/pch/summary", "w").write(f"{n_tus} of them through {n_pch} clang PCH" if n_pch else "")
PY
  mkdir -p "$tmp/tidy"
  config='{CheckOptions: [{key: readability-function-size.LineThreshold, value: 120}]}'
  export tidy_bin config tmp root
  # One clang-tidy per translation unit, JOBS at a time; each writes its own output file. A TU that
  # fails with its PCH named in the errors (clang rejected it) is rerun reading the header's text.
  # shellcheck disable=SC2016  # expanded by the inner shell
  xargs -a "$tmp/files" -P "$jobs" -I{} sh -c \
    'out="$tmp/tidy/$(echo "$1" | tr / _)"
     tidy() { "$tidy_bin" -p "$1" --quiet --checks="-*,readability-function-size" --config="$config" \
                --header-filter="^$root/(src|apps|tools|benches)/" "$2" >"$out" 2>"$out.err"; }
     tidy "$tmp/dbpch" "$1" && exit 0
     grep -qE "PCH file|precompiled header|AST file|$tmp/pch/" "$out" "$out.err" && tidy "$tmp/db" "$1" && exit 0
     echo "$1" >"$out.failed"' \
    _ {}
  # clang-tidy exits non-zero on any compile error. A fatal one (a header not found, ...) means the
  # file was not looked at: that fails. Others still leave an AST with every function (clang recovers;
  # e.g. clang 14 rejects lambdas capturing structured bindings, which gcc accepts): noted, not failed.
  for f in "$tmp"/tidy/*.failed; do
    [[ -e $f ]] || continue
    tu=$(cat "$f")
    out=${f%.failed}
    if grep -q 'fatal error' "$out" "$out.err"; then
      fail "function-size: clang-tidy could not process ${tu#"$root"/}: $(grep -m3 'error' "$out" "$out.err" | tr '\n' ' ')"
    else
      echo "check_structure: note: clang reported errors in ${tu#"$root"/} (sizes from its error recovery):" \
        "$(grep -m2 'error:' "$out" | sed 's/^[^ ]* //' | tr '\n' ' ')" >&2
    fi
  done
  # "<file>:<line>:<col>: warning: function 'name' exceeds ..." then "note: N lines including ...".
  /usr/bin/python3 - "$root" "$tmp"/tidy/* <<'PY' | sort -u >"$tmp/functions"
import re, sys
root = sys.argv[1]
for p in sys.argv[2:]:
    if p.endswith((".err", ".failed")):
        continue
    last = None
    for line in open(p, errors="replace"):
        m = re.match(r"(\S+):(\d+):\d+: warning: function '([^']*)' exceeds recommended size", line)
        if m:
            last = (m[1], m[2], m[3])
            continue
        m = re.match(r"\S+: note: (\d+) lines including whitespace and comments \(threshold (\d+)\)", line)
        if m and last:
            f = last[0][len(root) + 1:] if last[0].startswith(root + "/") else last[0]
            print(f"function-size: {f}:{last[1]}: '{last[2]}' is {m[1]} lines (limit {m[2]}; clang-tidy)")
            last = None
PY
  while IFS= read -r line; do fail "$line"; done <"$tmp/functions"
  pch=$(cat "$tmp/pch/summary")
  echo "check_structure: clang-tidy over $(wc -l <"$tmp/files") translation units of $tidy_db${pch:+ ($pch)} took $((SECONDS - t0)) s" >&2
fi

[[ -z $report ]] || cp "$fails" "$report"
n=$(wc -l <"$fails")
if ((n)); then
  echo "check_structure: $n offender(s)" >&2
  exit 1
fi
echo "check_structure: all checks pass" >&2
