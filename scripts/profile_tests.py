#!/usr/bin/env python3
"""Where the test time goes, read from a build directory after a build and a ctest run:

  - compilation (.ninja_log): CPU seconds by area (src/comm, src/torch, tests/..., benches, apps, tools),
    the slowest translation units, and the link steps (executables and libraries);
  - the tests (CTest's Testing/Temporary/CTestCostData.txt, the last time of each test, and its
    LABELS: one per test executable): seconds per executable, slowest first.

Usage: python3 scripts/profile_tests.py BUILD_DIR [BUILD_DIR ...] [--top N]
The times are each step's own (a step's wall time while the build ran -jJOBS beside it), summed: the CPU
the build or the suite asks for, not the wall time it took (scripts/test.sh prints that per part). Only
the last build's entry of each output counts (ninja keeps the newest), so after an incremental build the
figures mix that build's steps with the full build's. Python's standard library only.
"""
import argparse
import collections
import json
import os
import subprocess
import sys


def ninja_steps(build):
    """{output: seconds} of the newest entry of each output in BUILD/.ninja_log."""
    path = os.path.join(build, ".ninja_log")
    if not os.path.exists(path):
        sys.exit(f"profile_tests: {path} not found (build first)")
    steps = {}
    with open(path) as f:
        header = f.readline()
        if not header.startswith("# ninja log v"):
            sys.exit(f"profile_tests: {path}: not a ninja log ({header.strip()!r})")
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 5:
                continue
            start, end, _, out, _ = parts
            steps[out] = (int(end) - int(start)) / 1000.0
    return steps


def source_of(build, out):
    """The source path (relative to the source tree) a .o came from: CMake names an object
    <dir of its CMakeLists>/CMakeFiles/<target>.dir/<source path relative to that dir>.o; a unity source is
    <target> (unity N)."""
    rel = os.path.relpath(out, build) if os.path.isabs(out) else out
    if "CMakeFiles/" not in rel or ".dir/" not in rel:
        return rel
    where, rest = rel.split("CMakeFiles/", 1)
    target, path = rest.split(".dir/", 1)
    path = path[: -len(".o")] if path.endswith(".o") else path
    if path.startswith("Unity/"):
        return f"{target} ({path[len('Unity/'):]})"
    return where + path


def area_of(src):
    if " (unity_" in src:
        return src.split(" ")[0] + " (unity)"
    parts = src.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def kind_of(out):
    if out.endswith(".o"):
        return "compile"
    if out.endswith((".gch", ".pch")):
        return "pch"
    if out.endswith(".a") or "/bin/" in out or out.startswith("bin/") or os.path.basename(out) == out and "." not in out:
        return "link"
    return "other"


def compile_report(build, top):
    steps = ninja_steps(build)
    by_kind = collections.defaultdict(float)
    by_area = collections.defaultdict(lambda: [0.0, 0])
    units, links = [], []
    for out, secs in steps.items():
        kind = kind_of(out)
        by_kind[kind] += secs
        if kind == "compile":
            src = source_of(build, out)
            by_area[area_of(src)][0] += secs
            by_area[area_of(src)][1] += 1
            units.append((secs, src))
        elif kind == "link":
            links.append((secs, out))
    total = sum(by_kind.values())
    print(f"== {build}: {len(steps)} build steps, {total:.0f} s of steps ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])) + ")")
    print("  compile seconds by area:")
    for area, (secs, n) in sorted(by_area.items(), key=lambda kv: -kv[1][0]):
        print(f"    {secs:7.0f} s  {n:4d} units  {area}")
    print(f"  slowest {top} translation units:")
    for secs, src in sorted(units, reverse=True)[:top]:
        print(f"    {secs:7.1f} s  {src}")
    links.sort(reverse=True)
    print(f"  link steps: {len(links)}, {sum(s for s, _ in links):.0f} s; slowest {min(top, len(links))}:")
    for secs, out in links[:top]:
        print(f"    {secs:7.1f} s  {os.path.relpath(out, build) if os.path.isabs(out) else out}")


def test_report(build, top):
    cost = os.path.join(build, "Testing", "Temporary", "CTestCostData.txt")
    if not os.path.exists(cost):
        print(f"  (no ctest run recorded in {build})")
        return
    last = {}
    with open(cost) as f:
        for line in f:
            if line.startswith("---"):
                break  # the failed tests' list follows
            parts = line.rstrip("\n").rsplit(" ", 2)  # (a test's name may hold spaces)
            if len(parts) == 3:
                try:
                    cost_s = float(parts[2])
                except ValueError:
                    continue
                # gtest_discover_tests names a parameterised test "X/world2  # GetParam() = 2"; CTest's cost
                # file has entries with and without the comment: the name before it, the larger cost
                key = parts[0].split("  #")[0]
                last[key] = max(last.get(key, 0.0), cost_s)
    try:
        shown = subprocess.run(["ctest", "--test-dir", build, "-N", "--show-only=json-v1"], capture_output=True,
                               text=True, check=True).stdout
        tests = json.loads(shown)["tests"]
    except (subprocess.CalledProcessError, ValueError, KeyError) as e:
        print(f"  (ctest -N failed: {e})")
        return
    by_label = collections.defaultdict(lambda: [0.0, 0])
    for t in tests:
        labels = [p["value"] for p in t.get("properties", []) if p["name"] == "LABELS"]
        label = labels[0][0] if labels and labels[0] else t["name"]
        key = t["name"].split("  #")[0]
        if key in last:
            by_label[label][0] += last[key]
            by_label[label][1] += 1
    total = sum(s for s, _ in by_label.values())
    print(f"  tests: {sum(n for _, n in by_label.values())} with a recorded time, {total:.0f} s in all "
          f"(summed; ctest -j runs them side by side); slowest {top} executables:")
    for label, (secs, n) in sorted(by_label.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {secs:7.1f} s  {n:4d} tests  {label}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    for b in a.builds:
        compile_report(b, a.top)
        test_report(b, a.top)


if __name__ == "__main__":
    main()
