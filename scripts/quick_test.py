#!/usr/bin/env python3
"""The contributor's fast loop: rebuild what the changed files affect and run only the tests that depend
on them, in an existing build (scripts/test.sh made it: build-torch2 by default).

  python3 scripts/quick_test.py [FILE ...]      (or: bash scripts/test.sh --quick [FILE ...])

FILE: source or header paths in the tree; none: what `git status` shows changed or new. The tests picked for
a file:
  - a test source (tests/<area>/<name>_test.cc): that executable;
  - a header: the test executables whose sources include it, directly or through a test helper header
    (tests/*/*.h) that does;
  - any other source (src/torch/ddp.cc): the same for its own header, the one it includes first (by the
    project's convention, dtrain/ddp.h), and for the internal headers of the same name beside it
    (ddp_impl.h, ddp_hooks.h); without either, the public header named like the part of its name before an
    underscore (fsdp_state.cc: dtrain/fsdp.h);
  - nothing found that way (a .cc behind a public header of another name): every test executable whose
    name holds the file's stem, else those named after its directory (src/torch/ps/: ps_*_test), else the
    area's (comm or torch) executables.
It builds those executables (with what they link: the library), runs their tests with ctest -L (one
label per executable; gpu_test only where nvidia-smi is), and prints the time taken.
Env: BUILD_DIR (default <repo>/build-torch2), JOBS (default 2), CTEST_ARGS (extra ctest arguments).
"""
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def includes(path):
    try:
        with open(path, errors="replace") as f:
            return INCLUDE.findall(f.read())
    except OSError:
        return []


def test_sources():
    out = {}
    for area in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        d = os.path.join(ROOT, "tests", area)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.endswith("_test.cc"):
                out[name[: -len(".cc")]] = os.path.join(d, name)
    return out


def helper_headers():
    """tests/*/*.h and tests/*.h -> the headers they include."""
    out = {}
    for dirpath, _, names in os.walk(os.path.join(ROOT, "tests")):
        for n in names:
            if n.endswith(".h"):
                out[n] = includes(os.path.join(dirpath, n))
    return out


def header_names(path):
    """The include spellings that may name this header: "dtrain/ddp.h", "ddp_impl.h", "torch/ddp_impl.h", ..."""
    rel = os.path.relpath(path, ROOT)
    names = {os.path.basename(rel)}
    if rel.startswith("include/"):
        names.add(rel[len("include/"):])
    if rel.startswith("src/"):
        parts = rel[len("src/"):].split("/")
        for k in range(len(parts)):
            names.add("/".join(parts[k:]))
    return names


def headers_of(path):
    """The headers whose users a change to `path` affects."""
    if path.endswith((".h", ".hpp")):
        return [path]
    found = []
    own = includes(path)
    if own and own[0].endswith(".h"):  # its own header comes first
        for base in (os.path.join(ROOT, "include"), os.path.dirname(path), os.path.join(ROOT, "src")):
            cand = os.path.join(base, own[0])
            if os.path.exists(cand):
                found.append(cand)
                break
    stem = os.path.basename(path).rsplit(".", 1)[0]
    d = os.path.dirname(path)
    for n in sorted(os.listdir(d)):
        if n.endswith(".h") and (n == stem + ".h" or n.startswith(stem + "_")):
            found.append(os.path.join(d, n))
    # fsdp_state.cc, ddp_hooks.cc, checkpoint_io.cc: the public header of the name before the underscore
    public = os.path.join(ROOT, "include", "dtrain", stem.split("_")[0] + ".h")
    if not found and os.path.exists(public):
        found.append(public)
    return found


def tests_for(path, tests, helpers):
    rel = os.path.relpath(path, ROOT)
    base = os.path.basename(rel)
    if base.endswith("_test.cc"):
        return {base[: -len(".cc")]}
    names = set()
    for h in headers_of(path):
        names |= header_names(h)
    picked = set()
    if names:
        via = {hh for hh, inc in helpers.items() if names & set(inc)}
        for t, src in tests.items():
            inc = set(includes(src))
            if names & inc or via & inc:
                picked.add(t)
    if picked:
        return picked
    stem = base.rsplit(".", 1)[0]
    picked = {t for t in tests if stem in t}
    if picked:
        return picked
    # a directory of its own (src/torch/ps/...): the tests named after it (ps_test, ps_features_test, ...)
    for part in reversed(os.path.dirname(rel).split("/")[2:]):
        picked = {t for t in tests if t.startswith(part + "_")}
        if picked:
            return picked
    area = "comm" if "/comm/" in "/" + rel else "torch"
    return {t for t, src in tests.items() if f"/tests/{area}/" in src}


def changed_files():
    out = subprocess.run(["git", "-C", ROOT, "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    files = []
    for line in out.splitlines():
        p = line[3:].split(" -> ")[-1]
        if p.endswith((".cc", ".h", ".cpp", ".hpp")) and os.path.exists(os.path.join(ROOT, p)):
            files.append(os.path.join(ROOT, p))
    return files


def main():
    t0 = time.monotonic()
    build = os.environ.get("BUILD_DIR", os.path.join(ROOT, "build-torch2"))
    jobs = os.environ.get("JOBS", "2")
    if not os.path.exists(os.path.join(build, "build.ninja")) and not os.path.exists(os.path.join(build, "Makefile")):
        sys.exit(f"quick_test: {build} is not a configured build (run scripts/test.sh once, or set BUILD_DIR)")
    files = [os.path.abspath(f) for f in sys.argv[1:]] or changed_files()
    if not files:
        sys.exit("quick_test: nothing changed (git status) and no FILE given")
    for f in files:
        if not os.path.exists(f):
            sys.exit(f"quick_test: {f}: no such file")
    tests, helpers = test_sources(), helper_headers()
    picked = set()
    for f in files:
        these = tests_for(f, tests, helpers)
        print(f"quick_test: {os.path.relpath(f, ROOT)}: {len(these)} test executable(s)")
        picked |= these
    if "gpu_test" in picked and shutil.which("nvidia-smi") is None:
        picked.discard("gpu_test")
        print("quick_test: gpu_test left out: no GPU here (nvidia-smi not found)")
    if not picked:
        sys.exit("quick_test: no test executable depends on these files")
    picked = sorted(picked)
    print("quick_test: " + " ".join(picked))
    r = subprocess.run(["cmake", "--build", build, "-j", jobs, "--target", *picked])
    if r.returncode:
        sys.exit(f"quick_test: the build failed (exit {r.returncode})")
    built = time.monotonic() - t0
    labels = "^(" + "|".join(picked) + ")$"
    args = ["ctest", "--test-dir", build, "--output-on-failure", "-j", jobs, "--timeout", "600", "-L", labels]
    args += os.environ.get("CTEST_ARGS", "").split()
    r = subprocess.run(args)
    total = time.monotonic() - t0
    print(f"quick_test: built in {built:.0f} s, tested in {total - built:.0f} s, {total:.0f} s in all "
          f"({len(picked)} executables)")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
