#!/usr/bin/python3
"""Where a DDP step's time goes, from timelines (DTRAIN_TIMELINE; issue 29 target 5).

usage: ddp_breakdown.py LABEL=TRACE [LABEL=TRACE ...] [--skip N (3)] [--buckets]

Each TRACE is a merged Chrome trace (`dtrain-trace merge DIR`, DIR/trace.json) of a run of
`dtrain-bench ddp` (or any loop that marks `forward` and `optimizer.step` spans, as reference_mlp.cc
does). For every rank and DDP step (a step runs from one `forward` span's start to the next one's; only
steps with DDP's `backward` span count), it splits the step into:
  forward     the forward span (loss included)
  backward    from the forward's end to the last gradient: the last DDP bucket's ready time (the start
              of its `bucket N` async event), or the optimizer's start when there are no buckets (a
              world of one)
  exposed     from the last gradient to the optimizer's start: communication backward did not hide
  optimizer   the optimizer.step span
  other       the rest of the step (zero_grad, the loop, the timed step's bookkeeping)
and prints the median of each over the steps after the first --skip, averaged over the ranks, in ms,
one row per LABEL, then each component's difference from the first LABEL (the ceiling: run it as the
independent one-rank copies, one trace each, and give them as one LABEL=TRACE,TRACE).

--buckets: then, per LABEL and DDP bucket, where its allreduce's time went (medians over the steps after
the first --skip and over the ranks, in ms): launch (from the bucket's ready time to its allreduce's
start on this rank: queueing behind earlier buckets, and waking the communication thread), peers (from
this rank's ready time to the last rank's: the allreduce cannot finish before every rank has the
bucket), after all ready (from the later of its start and the last rank's ready time to its end: the
transfer itself) and the allreduce's whole duration.
"""
import functools
import json
import statistics
import sys


@functools.lru_cache(maxsize=None)  # --buckets reads each trace again: parsed once
def events(path):
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def steps_of(evs, pid, skip):
    mine = [e for e in evs if e.get("pid") == pid]
    fwd = sorted((e for e in mine if e.get("ph") == "X" and e.get("name") == "forward"), key=lambda e: e["ts"])
    opt = sorted((e for e in mine if e.get("ph") == "X" and e.get("name") == "optimizer.step"), key=lambda e: e["ts"])
    ready = sorted(e["ts"] for e in mine if e.get("ph") == "b" and str(e.get("name", "")).startswith("bucket"))
    ddp = sorted(e["ts"] for e in mine if e.get("ph") == "X" and e.get("name") == "backward")
    rows = []
    for k in range(len(fwd) - 1):
        f, nxt = fwd[k], fwd[k + 1]
        start, end, f_end = f["ts"], nxt["ts"], f["ts"] + f["dur"]
        o = next((e for e in opt if start <= e["ts"] < end), None)
        # DDP's steps only (a `backward` span): not the one-process reference the benchmark checks with.
        if o is None or not any(start <= t < end for t in ddp):
            continue
        buckets = [t for t in ready if f_end <= t <= o["ts"]]
        last_grad = max(buckets) if buckets else o["ts"]
        row = {
            "forward": f["dur"],
            "backward": last_grad - f_end,
            "exposed": o["ts"] - last_grad,
            "optimizer": o["dur"],
        }
        row["other"] = (end - start) - sum(row.values())
        row["step"] = end - start
        rows.append(row)
    return rows[skip:]


KEYS = ["step", "forward", "backward", "exposed", "optimizer", "other"]


def breakdown(paths, skip):
    per_rank = []
    for path in paths:
        evs = events(path)
        for pid in sorted({e["pid"] for e in evs if "pid" in e and e.get("ph") == "X"}):
            rows = steps_of(evs, pid, skip)
            if rows:
                per_rank.append({k: statistics.median(r[k] for r in rows) / 1e3 for k in KEYS} | {"n": len(rows)})
    if not per_rank:
        raise SystemExit(f"ddp_breakdown.py: no steps with forward and optimizer.step spans in {paths}")
    out = {k: statistics.mean(r[k] for r in per_rank) for k in KEYS}
    out["ranks"], out["steps"] = len(per_rank), min(r["n"] for r in per_rank)
    return out


def bucket_rows(paths, skip):
    """{bucket name: [(bytes, launch, peers, after, total) in us, one per rank and step]}."""
    out = {}
    for path in paths:
        evs = events(path)
        ready, red = {}, {}
        for e in evs:
            if e.get("ph") == "b" and str(e.get("name", "")).startswith("bucket") and "seq" in e.get("args", {}):
                ready.setdefault(e["args"]["seq"], {})[e["pid"]] = (e["ts"], e["name"], e["args"].get("bytes", 0))
            elif e.get("ph") == "X" and e.get("name") == "allreduce" and "seq" in e.get("args", {}):
                red.setdefault(e["args"]["seq"], {})[e["pid"]] = (e["ts"], e["ts"] + e["dur"])
        names = {v[1] for r in ready.values() for v in r.values()}
        for s in sorted(ready)[skip * len(names):]:
            r = ready[s]
            last = max(v[0] for v in r.values())
            for pid, (t, name, nbytes) in r.items():
                if pid not in red.get(s, {}):
                    continue
                a0, a1 = red[s][pid]
                out.setdefault(name, []).append((nbytes, a0 - t, last - t, a1 - max(a0, last), a1 - a0))
    return out


def print_buckets(label, paths, skip):
    rows = bucket_rows(paths, skip)
    print()
    print(f"{label}, per bucket:")
    print()
    print("| bucket | MB | ranks x steps | launch ms | peers ms | after all ready ms | allreduce ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in sorted(rows, key=lambda n: int(n.split()[-1]) if n.split()[-1].isdigit() else 0):
        r = rows[name]
        med = [statistics.median(x[i] for x in r) / 1e3 for i in range(1, 5)]
        print(f"| {name} | {r[0][0] / 1e6:.1f} | {len(r)} | " + " | ".join(f"{m:.2f}" for m in med) + " |")


def main():
    args = sys.argv[1:]
    per_bucket = "--buckets" in args
    if per_bucket:
        args.remove("--buckets")
    skip = 3
    if "--skip" in args:
        i = args.index("--skip")
        skip = int(args[i + 1])
        del args[i:i + 2]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    rows = []
    for a in args:
        label, _, paths = a.partition("=")
        rows.append((label, breakdown(paths.split(","), skip)))
    print("| run | ranks x steps | " + " | ".join(f"{k} ms" for k in KEYS) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in KEYS) + " |")
    for label, b in rows:
        print(f"| {label} | {b['ranks']} x {b['steps']} | " + " | ".join(f"{b[k]:.2f}" for k in KEYS) + " |")
    base = rows[0][1]
    for label, b in rows[1:]:
        print(f"| {label} - {rows[0][0]} | | " + " | ".join(f"{b[k] - base[k]:+.2f}" for k in KEYS) + " |")
    if per_bucket:
        for a in args:
            label, _, paths = a.partition("=")
            print_buckets(label, paths.split(","), skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
