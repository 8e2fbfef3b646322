#!/usr/bin/env python3
# comm_report.py: the markdown report of benches/comm.sh (which runs it): reads the raw outputs of
# every system and repetition from $RAW, takes per-size medians and ratios, checks the performance
# targets and every #wrong count. Inputs are environment variables set by comm.sh (RAW, FLOATS,
# REPS_N, WORLDS_L, MODE, ...). Exit status 1 on wrong results or incomplete output.
import os, re, statistics, sys

raw, reps = os.environ["RAW"], int(os.environ["REPS_N"])
worlds = [int(w) for w in os.environ["WORLDS_L"].split()]
SIZES = [4 * int(f) for f in os.environ["FLOATS"].split()]
LABEL = {n: f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" for n in SIZES}
SYSTEMS = ["mpi-shm", "dtrain-shm", "mpi-tcp", "dtrain-tcp", "gloo"]
problems = []  # fatal: wrong results or incomplete output


def read(path):
    with open(path) as f:
        return f.read()


def bw(nbytes, time_us, world):
    # algbw/busbw recomputed from time_us (printed with 0.1 us resolution) rather than taken from the
    # printed 3-decimal GB/s columns, which round small sizes on a loaded machine to 0.000.
    alg = nbytes / (time_us * 1e3) if time_us > 0 else float("nan")
    return dict(time_us=time_us, algbw=alg, busbw=alg * 2 * (world - 1) / world)


def parse_anchor(text, where):
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\S+ world=(\d+) bytes=(\d+) time_us=([\d.]+) algbw=([\d.]+) busbw=([\d.]+) wrong=(\d+)", line)
        if m:
            out[int(m[2])] = bw(int(m[2]), float(m[3]), int(m[1]))
            if int(m[6]) != 0:
                problems.append(f"{where}: size {m[2]}: wrong = {m[6]}")
    return out


def parse_dtrain(text, where, world):
    out = {}
    for line in text.splitlines():
        line = re.sub(r"^\[rank \d+\]: ", "", line).strip()
        if not line or line.startswith("#"):
            m = re.match(r"# (\d+) wrong elements in all", line)
            if m and int(m[1]) != 0:
                problems.append(f"{where}: {m[1]} wrong elements")
            continue
        f = line.split()
        if len(f) < 9:
            continue
        size, wrong = int(f[0]), int(f[6])
        if wrong != 0:
            problems.append(f"{where}: size {size}: #wrong = {wrong}")
        out[size] = dict(bw(size, float(f[3]), world), p50_us=float(f[7]))
    return out


# data[system][world][size][field] = list over repetitions
data = {s: {w: {n: {} for n in SIZES} for w in worlds} for s in SYSTEMS}
for s in SYSTEMS:
    for w in worlds:
        for r in range(1, reps + 1):
            path = f"{raw}/{s}.w{w}.r{r}"
            if not os.path.exists(path):
                continue  # gloo after the first repetition
            rows = parse_dtrain(read(path), f"{s} world={w} rep={r}", w) if s.startswith("dtrain") else parse_anchor(read(path), f"{s} world={w} rep={r}")
            for n in SIZES:
                if n not in rows:
                    problems.append(f"{s} world={w} rep={r}: no result for {n} bytes")
                    continue
                for k, v in rows[n].items():
                    data[s][w][n].setdefault(k, []).append(v)

memcpy = []
for r in range(1, reps + 1):
    m = re.search(r"memcpy 64MiB: ([\d.]+) GB/s", read(f"{raw}/memcpy.r{r}"))
    if m:
        memcpy.append(float(m[1]))
mc = statistics.median(memcpy) if memcpy else float("nan")


def med(s, w, n, k="busbw"):
    v = data[s][w].get(n, {}).get(k)  # sizes a --smoke run skips have none
    return statistics.median(v) if v else float("nan")


def ratio(a, b):
    return a / b if b and b == b and a == a else float("nan")


def f2(x):
    return "n/a" if x != x else f"{x:.0f}" if x >= 100 else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def fr(x):
    return "n/a" if x != x else f"{x:.2f}x" if x < 100 else f"{x:.0f}x"


def pct(x):
    return f"{100 * x:.1f}%" if abs(x) < 0.1 else f"{100 * x:.0f}%"


def f1(x):
    return "n/a" if x != x else f"{x:.1f}"


E = os.environ
P = print
P(f"# dtrain allreduce vs anchors ({E['MODE']} run)\n")
P(f"- date: {E['DATE']}; dtrain commit {E['COMMIT']}")
P(f"- dtrain-bench: {E['BENCH_INFO']} (run from a private copy)")
P(f"- machine: `nproc` = {E['NPROC']}; CPU: {E['HOST_CPU'] or 'unknown'}")
P(f"- load average (1/5/15 min) at start {E['LOAD_START']}, at end {E['LOAD_END']}; "
  f"1-min load at each repetition's start: {E['LOADS'].strip().rstrip(';')}")
P(f"- memcpy 64 MiB, single core: **{f2(mc)} GB/s** (median of {len(memcpy)} runs: "
  + ", ".join(f"{x:.2f}" for x in memcpy) + ")")
P(f"- repetitions: {reps} (gloo: 1), interleaved per repetition and world as mpi-shm, dtrain-shm, mpi-tcp, "
  "dtrain-tcp[, gloo]; every value below is the per-size median over repetitions, ratios are ratios of medians")
P(f"- busbw in GB/s (nccl-tests definition, allreduce: algbw x 2(n-1)/n), f32 sum, computed for every system "
  f"from its printed time_us (mean time per allreduce); script runtime {E['ELAPSED']} s\n")
P("Commands (W = world size, <tmp> = a mktemp -d directory):\n")
P("```")
P(E["CMDS"])
P("```\n")

results = []  # (world, group, size label, ratio, need, kind, pass)


def target(w, group, n, r, need, kind):
    if n not in SIZES:
        return  # not run (--smoke)
    ok = r == r and (r >= need if kind == ">=" else r <= need)
    results.append((w, group, LABEL[n], r, need, kind, ok))


for w in worlds:
    P(f"## world = {w}\n")
    P("| size | mpi-shm | dtrain-shm | ratio shm | mpi-tcp | dtrain-tcp | ratio tcp | gloo | dtrain-shm / gloo | dtrain-tcp / gloo |")
    P("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in SIZES:
        ms, ds, mt, dt, g = (med(s, w, n) for s in SYSTEMS)
        P(f"| {LABEL[n]} | {f2(ms)} | {f2(ds)} | {fr(ratio(ds, ms))} | {f2(mt)} | {f2(dt)} | {fr(ratio(dt, mt))} "
          f"| {f2(g)} | {fr(ratio(ds, g))} | {fr(ratio(dt, g))} |")
    P("")
    n = 4096
    lat = {s: med(s, w, n, "time_us") for s in SYSTEMS}
    P("4 KiB latency, time_us per allreduce (mean over the timed loop; lower is better):\n")
    P("| 4K time_us | mpi-shm | dtrain-shm | dtrain-shm / mpi-shm | dtrain-shm p50 | mpi-tcp | dtrain-tcp | gloo |")
    P("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    P(f"| world {w} | {f1(lat['mpi-shm'])} | {f1(lat['dtrain-shm'])} | {fr(ratio(lat['dtrain-shm'], lat['mpi-shm']))} "
      f"| {f1(med('dtrain-shm', w, n, 'p50_us'))} | {f1(lat['mpi-tcp'])} | {f1(lat['dtrain-tcp'])} | {f1(lat['gloo'])} |")
    P("")
    parts = []
    for n in [n for n in (16 << 20, 64 << 20) if n in SIZES] or [None]:
        if n is None:
            parts.append("16M, 64M: not run")
            continue
        a = med("dtrain-shm", w, n, "algbw")
        parts.append(f"{LABEL[n]}: algbw {f2(a)} GB/s = {100 * ratio(a, mc):.0f}%")
    P(f"Shared-memory path vs the memcpy ceiling ({f2(mc)} GB/s): " + "; ".join(parts) + " of single-core memcpy. "
      "memcpy GB/s counts bytes copied by one core (each byte read once and written once). An allreduce must at "
      "least read its input and write its output, i.e. move as much memory per rank as one memcpy of the buffer, "
      "so 100% would mean every rank spends no more time than one single-core memcpy of its buffer. It is a "
      "reference point, not a hard bound: ranks run on several cores in parallel (but share memory bandwidth), "
      f"and the reduction also has to read the other ranks' data (dtrain's direct shm allreduce moves about "
      f"4(n-1)/n+1+2/n = {4 * (w - 1) / w + 1 + 2 / w:.1f} buffer sizes per rank against 2 for a memcpy).\n")

    if reps > 1:
        P(f"<details><summary>world {w}: per-repetition paired ratios (spread)</summary>\n")
        P("Busbw ratios within each repetition (runs seconds apart); gloo ran in repetition 1 only, so its "
          "paired ratios use dtrain's repetition-1 runs.\n")
        P("| size | dtrain-shm / mpi-shm per rep | dtrain-tcp / mpi-tcp per rep | dtrain-shm / gloo, rep 1 "
          "| dtrain-tcp / gloo, rep 1 |")
        P("| ---: | --- | --- | ---: | ---: |")
        for n in SIZES:
            cells = []
            for a, b in (("dtrain-shm", "mpi-shm"), ("dtrain-tcp", "mpi-tcp"), ("dtrain-shm", "gloo"),
                         ("dtrain-tcp", "gloo")):
                xs, ys = data[a][w][n].get("busbw", []), data[b][w][n].get("busbw", [])
                cells.append(", ".join(fr(x / y)
                                       for x, y in list(zip(xs, ys))[: 1 if b == "gloo" else None] if y))
            P(f"| {LABEL[n]} | " + " | ".join(cells) + " |")
        P("\n</details>\n")

    for n in (16 << 20, 64 << 20):
        target(w, "shm busbw >= 1.5x mpi-shm", n, ratio(med("dtrain-shm", w, n), med("mpi-shm", w, n)), 1.5, ">=")
    for n in (65536, 1 << 20, 4 << 20):
        target(w, "shm busbw >= 1.0x mpi-shm", n, ratio(med("dtrain-shm", w, n), med("mpi-shm", w, n)), 1.0, ">=")
    target(w, "shm 4K latency <= 2x mpi-shm", 4096,
           ratio(med("dtrain-shm", w, 4096, "time_us"), med("mpi-shm", w, 4096, "time_us")), 2.0, "<=")
    for n in (1 << 20, 4 << 20, 16 << 20, 64 << 20):
        target(w, "tcp busbw >= 1.2x mpi-tcp", n, ratio(med("dtrain-tcp", w, n), med("mpi-tcp", w, n)), 1.2, ">=")
    for d in ("dtrain-shm", "dtrain-tcp"):
        for n in SIZES:
            need = 10.0 if n <= (1 << 20) else 2.0 if n >= (16 << 20) else None
            if need:
                target(w, f"{d} busbw >= {need:g}x gloo", n, ratio(med(d, w, n), med("gloo", w, n)), need, ">=")

P("## Targets\n")
P("Cell = result and measured ratio (busbw ratio; for latency, dtrain time / mpi time). "
  "\"gloo\" rows compare dtrain-shm (what `--transport auto` picks on one host) and, separately, dtrain-tcp.\n")
groups = list(dict.fromkeys(g for _, g, *_ in results))
for w in worlds:
    P(f"### world = {w}\n")
    P("| target | " + " | ".join(LABEL[n] for n in SIZES) + " |")
    P("| --- |" + " ---: |" * len(SIZES))
    for g in groups:
        cells = {s: f"{'PASS' if ok else 'MISS'} {fr(r)}" for ww, gg, s, r, need, kind, ok in results if ww == w and gg == g}
        P(f"| {g} | " + " | ".join(cells.get(LABEL[n], "") for n in SIZES) + " |")
    P("")
npass = sum(1 for *_, ok in results if ok)
P(f"**{npass} PASS, {len(results) - npass} MISS** (of {len(results)} target checks)\n")
misses = [x for x in results if not x[6]]
if misses:
    P("Misses, and by how much:\n")
    for w, g, s, r, need, kind, _ in misses:
        if r != r:
            P(f"- world {w}, {g}, {s}: no measurement")
        elif kind == ">=":
            P(f"- world {w}, {g}, {s}: {r:.2f}x, needs {need:g}x: {pct(1 - r / need)} short "
              f"(busbw must rise {pct(need / r - 1)})")
        else:
            P(f"- world {w}, {g}, {s}: {r:.2f}x, must be <= {need:g}x: {pct(r / need - 1)} over "
              f"(latency must drop {pct(1 - need / r)})")
    P("")

if problems:
    P("## ERRORS\n")
    for p in problems:
        P(f"- {p}")
    for p in problems:
        print(f"comm.sh: ERROR: {p}", file=sys.stderr)
    sys.exit(1)
