#!/usr/bin/python3
"""Writes a fake run directory for dtrain-report's test, in the formats rank 0's metrics logger and
`dtrain-trace merge` write, and prints what the report must show (points per chart) as JSON.

  report_fixture.py full DIR      metrics.jsonl (run, 40 steps with a few nulls, 3 evals, a bench record,
                                   a record of an unknown kind) and timeline/trace.json (2 ranks x 2 threads,
                                   10 steps, nested events, async b/e buckets, metadata, flow events)
  report_fixture.py minimal DIR   metrics.jsonl with steps holding only a loss: no run record, no evals,
                                   no trace
"""
import json
import os
import sys

STEPS = 40


def step_record(i):
    r = {"kind": "step", "step": i, "epoch": (i - 1) // 20, "time_s": 0.05 * i,
         "loss": 2.0 / (1 + 0.1 * i), "lr": 1e-4 * min(1.0, i / 10), "samples_per_s": 400.0 + 3 * i,
         "step_s": 0.05, "comm_s": 0.02, "exposed_comm_s": 0.004 + 0.0001 * i, "compute_s": 0.04,
         "hidden_fraction": 0.8, "bytes_sent": 120000 + 10 * i, "rss_bytes": 100e6 + 1e5 * i,
         "bubble_fraction": 0.25 - 0.001 * i}
    if i == 1:
        del r["samples_per_s"]     # missing: no throughput for the first step
        r["exposed_comm_s"] = None
    if i == 5:
        r["loss"] = None           # null: the logger had no loss for that step
    return r


def trace(steps=10, ranks=2):
    ev = []
    for rank in range(ranks):
        ev.append({"ph": "M", "pid": rank, "name": "process_name", "args": {"name": f"rank {rank}"}})
        ev.append({"ph": "M", "pid": rank, "tid": 1, "name": "thread_name", "args": {"name": "main"}})
        ev.append({"ph": "M", "pid": rank, "tid": 2, "name": "thread_name", "args": {"name": "comm"}})
        for s in range(steps):
            t0 = 1_000_000 + s * 10_000 + rank * 150  # us: a step every 10 ms, rank 1 slightly late
            x = lambda name, cat, ts, dur, tid=1, **args: ev.append(
                {"ph": "X", "pid": rank, "tid": tid, "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args})
            x("step", "user", t0, 9_000, step=s)
            x("data wait", "data", t0, 500)
            x("forward", "compute", t0 + 500, 3_000)
            x("backward", "compute", t0 + 3_500, 4_000)
            for b in range(2):
                x("bucket ready", "ddp", t0 + 4_000 + 1_500 * b, 100, bucket=b)
                # DDP buckets as async slices (b/e pairs by id), overlapping each other.
                ev.append({"ph": "b", "pid": rank, "tid": 1, "cat": "ddp", "name": f"bucket {b}", "id": 2 * s + b,
                           "ts": t0 + 4_000 + 1_500 * b, "args": {"bytes": 1 << 20}})
                ev.append({"ph": "e", "pid": rank, "tid": 2, "cat": "ddp", "name": f"bucket {b}", "id": 2 * s + b,
                           "ts": t0 + 6_200 + 1_500 * b, "args": {"seq": 2 * s + b}})
                x("allreduce", "comm", t0 + 4_200 + 1_500 * b, 1_800, tid=2, op="allreduce", bytes=1 << 20,
                  seq=2 * s + b, algorithm="ring", peers=[1 - rank])
                if rank == 0:
                    ev.append({"ph": "s", "pid": 0, "tid": 2, "id": 2 * s + b, "ts": t0 + 4_300 + 1_500 * b,
                               "name": "send", "cat": "comm"})
                else:
                    ev.append({"ph": "f", "pid": 1, "tid": 2, "id": 2 * s + b, "ts": t0 + 4_400 + 1_500 * b,
                               "name": "send", "cat": "comm", "bp": "e"})
            x("optimizer step", "optim", t0 + 7_600, 1_000)
    return {"traceEvents": ev, "otherData": {"clock_offsets_us": [0, 12]}}


def expected_timeline(tr, skip=2, steps=3, window_ms=200):
    """What dtrain-report's timeline holds (tools/report/trace_window.h): rank 0's forward passes
    skip+1 to skip+steps+1 (else its backward passes), else window_ms from forward pass skip+1 (or the last), else from the start,
    but not past the trace's end."""
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    begins = {}
    for e in tr["traceEvents"]:  # b/e pairs: one event on the rank's async row (tid -1)
        key = (e["pid"], e.get("cat"), e.get("name"), e.get("id"))
        if e["ph"] == "b":
            begins[key] = e["ts"]
        elif e["ph"] == "e" and key in begins:
            start = begins.pop(key)
            xs.append({"pid": e["pid"], "tid": -1, "name": e["name"], "ts": start, "dur": e["ts"] - start})
    starts = {n: sorted(e["ts"] for e in xs if e["pid"] == 0 and e["name"] == n) for n in ("forward", "backward")}
    enough = [n for n in ("forward", "backward") if len(starts[n]) > skip + steps]
    present = [n for n in ("forward", "backward") if starts[n]]
    fw = starts[enough[0]] if enough else starts[present[0]] if present else []
    if len(fw) > skip + steps:
        start, end = fw[skip], fw[skip + steps]
    else:
        start = fw[min(skip, len(fw) - 1)] if fw else min(e["ts"] for e in xs)
        end = min(start + window_ms * 1000, max(e["ts"] + e["dur"] for e in xs))
    shown = [e for e in xs if e["ts"] < end and e["ts"] + e["dur"] > start]
    return {"points": len(shown), "rows": len({(e["pid"], e["tid"]) for e in shown}), "length_ms": (end - start) / 1000}


def count(records, key):
    """Records whose `key` is a number: the points a chart of it draws."""
    return sum(1 for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool))


def full(d):
    steps = [step_record(i) for i in range(1, STEPS + 1)]
    evals = [{"kind": "eval", "epoch": e, "step": 20 * e, "R@1": 5.0 + 10 * e, "R@5": 20.0 + 15 * e,
              "R@10": 30.0 + 15 * e, "median_rank": 40 - 12 * e} for e in range(3)]
    lines = [{"kind": "run", "app": "milnce", "world_size": 2, "start_unix": 1763900000.5,
              "config": {"epochs": 2, "batch_size": 64, "lr": 1e-4, "note": "</script><!-- a tricky string"}}]
    lines += steps[:20] + evals[:1] + [{"kind": "bench", "name": "allreduce", "bytes": 4096, "us": 12.5}]
    lines += steps[20:] + evals[1:] + [{"kind": "mystery", "x": 1}]
    os.makedirs(os.path.join(d, "timeline"), exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    tr = trace()
    with open(os.path.join(d, "timeline", "trace.json"), "w") as f:
        json.dump(tr, f)
    both = lambda k: count(steps, k)
    tl = expected_timeline(tr)
    return {
        "charts": {
            "loss": {"loss": both("loss"), "lr": both("lr")},
            "throughput": {"samples_per_s": both("samples_per_s")},
            "comm": {"compute_s": both("compute_s"), "exposed_comm_s": both("exposed_comm_s")},
            "bytes": {"bytes_sent": both("bytes_sent")},
            "memory": {"rss_bytes": both("rss_bytes")},
            "bubble": {"bubble_fraction": both("bubble_fraction")},
            "retrieval": {"R@1": 3, "R@5": 3, "R@10": 3, "median_rank": 3},
            "timeline": {"*": tl["points"]},
        },
        "timeline_rows": tl["rows"],
        "absent": [],
        "texts": ["milnce", "mystery"],
    }


def minimal(d):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i in range(1, 13):
            f.write(json.dumps({"kind": "step", "step": i, "loss": 1.0 / i}) + "\n")
    return {"charts": {"loss": {"loss": 12}}, "timeline_rows": 0,
            "absent": ["no eval records", "no timeline", "no run record", "no samples_per_s"], "texts": []}


if __name__ == "__main__":
    kind, d = sys.argv[1], sys.argv[2]
    print(json.dumps({"full": full, "minimal": minimal}[kind](d)))
