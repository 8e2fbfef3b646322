#!/usr/bin/env python3
"""The fault soak (issue 27; run it with scripts/soak.sh, which documents the options).

Each trial picks a workload, a rank, a fault and a moment at random, runs the workload under dtrain-run
(2 ranks on this host; the cut-link trials on a 2-host emulated cluster, scripts/cluster.sh), injects
the fault and records:
  * how long the launcher and each surviving worker took to stop after the fault (limit: 2x the group
    timeout DTRAIN_TIMEOUT, plus dtrain-run's grace period);
  * whether the launcher exited non-zero with output naming the faulty rank and the cause;
  * for restart trials (--max-restarts 1, MIL-NCE with checkpoints): whether the job finished with the
    same result as an uninterrupted run of the same configuration;
  * for checkpointing workloads: whether the run directory still has a loadable newest checkpoint
    (milnce eval loads it).
Prints a table and writes every trial as JSON.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTS = ["sigkill", "sigstop", "cut-link", "disk-full", "corrupt-checkpoint"]
CHECKPOINTING = {"milnce", "zero2"}


class Rig:
    """Paths and settings shared by the trials."""

    def __init__(self, args):
        self.bin = os.path.abspath(args.bin_dir)
        self.timeout = args.timeout
        self.grace = 2.0
        self.work = args.work_dir
        self.data = os.path.join(self.work, "milnce-data")
        self.reference = {}  # MIL-NCE configuration -> the uninterrupted run's final metrics


def workload(rig, name, out):
    """(program and arguments, extra dtrain-run arguments, environment) of a workload writing to `out`."""
    env = {"DTRAIN_TIMEOUT": f"{rig.timeout:g}", "OMP_NUM_THREADS": "1"}
    b = rig.bin
    if name in ("collectives-tcp", "collectives-shm"):
        env["DTRAIN_TRANSPORT"] = name.split("-")[1]
        return [f"{b}/dtrain-bench", "allreduce", "--min-bytes", "4", "--max-bytes", "4M", "--factor", "4",
                "--iters", "0", "--seconds", "8", "--progress", "off"], [], env  # some 10 s
    if name == "ddp":
        return [f"{b}/example-ddp", "--batch", "2", "--epochs", "40"], [], env  # small steps: some 15 s
    if name == "ps":
        return [f"{b}/example-ps-ctr", "6"], ["--servers", "1"], env
    if name == "pipeline":
        return [f"{b}/dtrain-bench", "pipeline", "--layers", "8", "--width", "256", "--batch", "64", "--steps", "600",
                "--warmup", "2", "--micro", "4", "--progress", "off"], [], env
    # 40 epochs of 16 steps (some 12 s), a checkpoint every 8 steps: the faults' moments (0.5-4 s) come while
    # it trains, and the corrupt-checkpoint trials' first 20 steps leave two checkpoints
    args = [f"{b}/milnce", "train", "--data", rig.data, "--out", out, "--epochs", "40", "--batch", "8",
            "--checkpoint-every", "8", "--keep", "3", "--progress", "lines", "--resume"]
    if name == "zero2":
        args += ["--zero", "2", "--optimizer", "adam", "--comm-hook", "none"]
    return args, [], env


def timeout_of(rig, workload):
    """The deadline that bounds a workload's waits: DTRAIN_TIMEOUT, but the parameter server's own
    (PSOptions::timeout, 60 s in example-ps-ctr; the PS takes no environment variable for it)."""
    return 60.0 if workload == "ps" else rig.timeout


def children(pid):
    """The processes whose parent is `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return out


def rank_of(pid):
    """A worker's RANK (None for a parameter server, DTRAIN_ROLE=server, or a process already gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    if env.get(b"DTRAIN_ROLE") != b"worker" or b"RANK" not in env:
        return None
    return int(env[b"RANK"])


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def named(output, rank, fault):
    """Whether the launcher's output names `rank` and the fault's cause."""
    causes = {
        "sigkill": r"SIGKILL|signal 9|killed",
        "sigstop": r"timed out|not respond|hang|has not joined|after \d+ ms",
        "cut-link": r"timed out|connection|reset|unreachable|peer .* failed",
        "disk-full": r"No space left|ENOSPC|space",
        "corrupt-checkpoint": r"checksum|corrupt|truncat|cannot (read|load)|invalid|not a checkpoint",
    }
    if not re.search(causes[fault], output, re.I):
        return False
    if fault in ("corrupt-checkpoint", "disk-full"):
        return True  # the cause is a file or the disk, named in the message; no rank is at fault
    # The launcher's prefix on each line a process printed ("[rank 1]: ", "[server 0]: ") says who printed
    # the line, not whom it blames: only the messages themselves count.
    said = re.sub(r"^\[(rank|server) \d+\]: ", "", output, flags=re.M)
    # (the parameter server names a stopped worker "workers [r]")
    return re.search(rf"rank {rank}\b|workers? \[?{rank}\b", said) is not None


def final_metrics(out):
    """The final evaluation a MIL-NCE run wrote (eval.json), or None."""
    # ("after" only: a restarted run evaluates its "before" on the state it resumed from)
    try:
        with open(os.path.join(out, "eval.json")) as f:
            return json.load(f).get("after")
    except (OSError, ValueError, AttributeError):
        return None


def loadable(rig, out):
    """Whether milnce eval loads the run's newest checkpoint (None when it has none)."""
    ck = os.path.join(out, "checkpoints")
    if not os.path.isdir(ck) or not os.listdir(ck):
        return None
    # (its JSON beside the run, not in it: the run may be on the full disk)
    r = subprocess.run([f"{rig.bin}/milnce", "eval", "--data", rig.data, "--run", out, "--json",
                        os.path.join(os.path.dirname(os.path.dirname(out)), "soak-eval.json"), "--progress", "off"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if "no checkpoint found" in r.stdout + r.stderr:
        return None  # none complete yet (a failed first save leaves its directory without a manifest)
    return r.returncode == 0


def launch(rig, prog, extra, env, restarts, log):
    cmd = [f"{rig.bin}/dtrain-run", "--standalone", "--nproc-per-node", "2", "--grace-period", str(rig.grace),
           "--max-restarts", str(restarts)] + extra + prog
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **env),
                            start_new_session=True)


def wait_workers(proc, want, limit=60.0):
    """The launcher's worker processes by rank, once `want` of them run (or {} after `limit` s)."""
    until = time.time() + limit
    while time.time() < until and proc.poll() is None:
        ranks = {}
        for c in children(proc.pid):
            r = rank_of(c)
            if r is not None:
                ranks[r] = c
        if len(ranks) >= want:
            return ranks
        time.sleep(0.05)
    return {}


def fill_disk(mount):
    """Takes every free byte of the tmpfs at `mount`."""
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    try:
        with open(os.path.join(mount, "filler"), "wb") as f:
            f.write(b"\0" * max(free - 4096, 0))
            f.write(b"\0" * 8192)
    except OSError:  # full: what was meant
        pass


def standalone_trial(rig, t, tdir):
    """A trial on this host: SIGKILL, SIGSTOP, a full disk or a corrupt checkpoint."""
    out = os.path.join(tdir, "run")
    mount = None
    if t["fault"] == "disk-full":
        mount = os.path.join(tdir, "disk")
        os.makedirs(mount)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mount], check=True)
        out = os.path.join(mount, "run")
    prog, extra, env = workload(rig, t["workload"], out)
    if t["fault"] == "corrupt-checkpoint":
        # An interrupted run leaves checkpoints; the newest is damaged; the resume is the trial.
        pre = subprocess.run([f"{rig.bin}/dtrain-run", "--standalone", "--nproc-per-node", "2"] + prog +
                             ["--stop-after-steps", "20"], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, **env))
        t["prepare_rc"] = pre.returncode
        t["damage"] = damage_newest(out, t["seed"])
    log_path = os.path.join(tdir, "launcher.log")
    try:
        with open(log_path, "w") as log:
            proc = launch(rig, prog, extra, env, t["restarts"], log)
            workers = wait_workers(proc, 2)
            fault_at = None
            survivors = {}
            if t["fault"] in ("sigkill", "sigstop", "disk-full") and workers:
                time.sleep(t["moment"])
                workers = wait_workers(proc, 2, 5.0) or workers
                if proc.poll() is None:
                    fault_at = time.time()
                    victim = workers.get(t["rank"])
                    survivors = {r: p for r, p in workers.items() if r != t["rank"]}
                    if t["fault"] == "disk-full":
                        survivors = dict(workers)
                        fill_disk(mount)
                    elif victim:
                        os.kill(victim, signal.SIGKILL if t["fault"] == "sigkill" else signal.SIGSTOP)
            elif t["fault"] == "corrupt-checkpoint":
                fault_at = time.time()
            if fault_at is None:
                t["error"] = "no fault came: the workload ended, or never started its workers, before it"
            t["timeout_s"] = timeout_of(rig, t["workload"])
            limit = 2 * t["timeout_s"] + rig.grace + (600 if t["restarts"] else 60)
            stopped = {}
            start_wait = time.time()
            while proc.poll() is None and time.time() - start_wait < limit:
                for r, p in survivors.items():
                    if r not in stopped and not alive(p):
                        stopped[r] = time.time()
                time.sleep(0.05)
            hung = proc.poll() is None
            if hung:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            end = time.time()
        output = open(log_path, errors="replace").read()
        t["rc"] = proc.returncode
        t["hung"] = hung
        if fault_at:
            t["launcher_stop_s"] = round(end - fault_at, 2)
            t["survivor_stop_s"] = {str(r): round(stopped.get(r, end) - fault_at, 2) for r in survivors}
        t["named"] = named(output, t["rank"], t["fault"])
        t["tail"] = output.strip().splitlines()[-3:]
        if t["workload"] in CHECKPOINTING and t["fault"] != "corrupt-checkpoint":  # (there: damaged on purpose)
            t["loadable"] = loadable(rig, out)
            if t["restarts"] and t["rc"] == 0:
                t["equal"] = final_metrics(out) == reference(rig, t["workload"])
    finally:
        if mount:
            subprocess.run(["umount", "-l", mount])


def damage_newest(out, seed):
    """Truncates the newest checkpoint file or flips one of its bits; says which and how."""
    ck = os.path.join(out, "checkpoints")
    files = []
    for d, _, fs in os.walk(ck):  # the data: a per-rank checkpoint's rank files, not its manifest
        files += [os.path.join(d, f) for f in fs if f != "manifest.pt"]
    if not files:
        return "no checkpoint to damage"
    newest = max(files, key=os.path.getmtime)
    rng = random.Random(seed)
    size = os.path.getsize(newest)
    with open(newest, "r+b") as f:
        if rng.random() < 0.5 and size > 1:
            f.truncate(rng.randrange(size))
            return f"truncated {os.path.relpath(newest, out)}"
        at = rng.randrange(size)
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        return f"flipped a bit at byte {at} of {os.path.relpath(newest, out)}"


def reference(rig, name):
    """The final metrics of an uninterrupted run of MIL-NCE workload `name` (run once, then kept)."""
    if name not in rig.reference:
        out = os.path.join(rig.work, f"reference-{name}")
        shutil.rmtree(out, ignore_errors=True)
        prog, extra, env = workload(rig, name, out)
        subprocess.run([f"{rig.bin}/dtrain-run", "--standalone", "--nproc-per-node", "2"] + extra + prog,
                       capture_output=True, timeout=1200, env=dict(os.environ, **env), check=True)
        rig.reference[name] = final_metrics(out)
    return rig.reference[name]


def cut_trial(rig, t, tdir):
    """A 2-host emulated cluster, one rank a host; host 1's link is cut at the chosen moment."""
    name = f"soak{os.getpid()}_{t['id']}"
    cluster = os.path.join(ROOT, "scripts", "cluster.sh")
    prog, extra, env = workload(rig, t["workload"], os.path.join(tdir, "run"))
    envs = sum((["--env", f"{k}={v}"] for k, v in env.items()), [])
    subprocess.run(["bash", cluster, "up", "--name", name, "--hosts", "2", "--no-rate-check", "--gbit", "10",
                    "--bin-dir", rig.bin, "--owner", str(os.getpid())], check=True, capture_output=True)
    try:
        for h in (0, 1):
            # (no pipes: the launcher left in the background would hold them open until it ends)
            subprocess.run(["bash", cluster, "run-host", name, str(h), "--bg"] + envs + ["--"] + prog, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Into the work: once host 0's launcher printed a worker's first line (MIL-NCE loads its data first).
        log = os.path.join(os.environ.get("DTRAIN_CLUSTER_DIR", "/tmp/dtrain-cluster"), name, "host-0.log")
        until = time.time() + 60
        while time.time() < until and not re.search(r"\[rank \d+\]", open(log, errors="replace").read()
                                                     if os.path.exists(log) else ""):
            time.sleep(0.1)
        time.sleep(t["moment"])
        fault_at = time.time()
        subprocess.run(["bash", cluster, "cut", name, "1"], check=True, capture_output=True)
        limit = 2 * rig.timeout + rig.grace + 30
        r0 = subprocess.run(["bash", cluster, "wait-host", name, "0", "--timeout", str(int(limit))],
                            capture_output=True, text=True)
        t["launcher_stop_s"] = round(time.time() - fault_at, 2)
        t["rc"] = r0.returncode
        t["hung"] = r0.returncode == 124
        output = r0.stdout + r0.stderr
        t["named"] = named(output, 1, "cut-link")
        t["tail"] = output.strip().splitlines()[-3:]
    finally:
        subprocess.run(["bash", cluster, "down", name], capture_output=True)


def choose(rng, i, only=None):
    """Trial i: faults in turn (so each gets its share), the rest at random."""
    fault = only or FAULTS[i % len(FAULTS)]
    if fault in ("disk-full", "corrupt-checkpoint"):
        wl = rng.choice(sorted(CHECKPOINTING))
    elif fault == "cut-link":
        wl = rng.choice(["collectives-tcp", "ddp", "milnce"])
    else:
        wl = rng.choice(["collectives-tcp", "collectives-shm", "ddp", "zero2", "ps", "pipeline", "milnce"])
    restarts = 1 if fault == "sigkill" and wl in CHECKPOINTING and rng.random() < 0.5 else 0
    return {"id": i, "workload": wl, "fault": fault, "rank": rng.randrange(2), "moment": round(rng.uniform(0.5, 4.0), 2),
            "restarts": restarts, "seed": rng.randrange(1 << 30)}


def ok(t):
    """Whether the trial met the bars: no hang, a non-zero exit naming the rank and cause (a restart trial:
    a zero exit with the uninterrupted result), a loadable newest checkpoint."""
    if t.get("hung"):
        return False
    if not t["restarts"] and t.get("launcher_stop_s", 0) > 2 * t.get("timeout_s", 10) + 2:
        return False  # later than 2x the timeout (plus dtrain-run's grace period)
    if t.get("loadable") is False:
        return False
    if t["restarts"]:
        return t.get("rc") == 0 and t.get("equal") is True
    if t["fault"] == "corrupt-checkpoint" and t.get("rc") == 0:
        return t.get("named", False)  # resumed from an older checkpoint, naming the damaged one
    return t.get("rc") not in (0, None) and t.get("named", False)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0, help="the group timeout (DTRAIN_TIMEOUT), seconds")
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "build-torch2", "bin"))
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", default="soak.json")
    p.add_argument("--only-fault", choices=FAULTS)
    p.add_argument("--rescore", action="store_true",
                   help="score the trials of --json again from the logs kept in --work-dir (after a rule changed)")
    args = p.parse_args()
    if args.rescore:
        return rescore(args)
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="dtrain-soak-")
    rig = Rig(args)
    if not os.path.exists(os.path.join(rig.data, "meta.json")):
        subprocess.run([f"{rig.bin}/milnce", "gen-data", "--out", rig.data, "--videos", "256", "--eval-videos", "64",
                        "--progress", "off"], check=True, capture_output=True)
    rng = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        t = choose(rng, i, args.only_fault)
        tdir = os.path.join(args.work_dir, f"trial{i:03d}")
        os.makedirs(tdir)
        start = time.time()
        try:
            (cut_trial if t["fault"] == "cut-link" else standalone_trial)(rig, t, tdir)
        except Exception as e:  # noqa: BLE001 - a trial that could not run is recorded, not fatal
            t["error"] = f"{type(e).__name__}: {e}"
        t["seconds"] = round(time.time() - start, 1)
        t["ok"] = ok(t) and "error" not in t
        trials.append(t)
        print(f"{i:3d} {t['workload']:16s} {t['fault']:18s} rank {t['rank']} at {t['moment']:4.1f}s "
              f"restarts {t['restarts']}: rc {t.get('rc')} stop {t.get('launcher_stop_s')}s named {t.get('named')} "
              f"loadable {t.get('loadable')} equal {t.get('equal')} -> {'ok' if t['ok'] else 'NOT OK'}"
              f"{' ' + t['error'] if 'error' in t else ''}", flush=True)
        with open(args.json, "w") as f:
            json.dump({"timeout_s": rig.timeout, "trials": trials}, f, indent=1)
        if t["ok"] and t.get("fault") != "disk-full":
            shutil.rmtree(tdir, ignore_errors=True)
    summarize(trials, rig)


def rescore(args):
    """Names and verdicts again, for the trials whose directory was kept (those not ok, the full-disk ones)."""
    with open(args.json) as f:
        doc = json.load(f)
    rig = Rig(args)
    rig.timeout = doc["timeout_s"]
    for t in doc["trials"]:
        log = os.path.join(args.work_dir, f"trial{t['id']:03d}", "launcher.log")
        if os.path.exists(log) and t["fault"] != "cut-link":
            t["named"] = named(open(log, errors="replace").read(), t["rank"], t["fault"])
            t["ok"] = ok(t) and "error" not in t
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    summarize(doc["trials"], rig)


def summarize(trials, rig):
    print(f"\n{'workload':16s} {'fault':18s} {'trials':>6s} {'ok':>4s} {'named':>6s} {'max stop s':>10s}")
    keys = sorted({(t["workload"], t["fault"]) for t in trials})
    for wl, fault in keys:
        ts = [t for t in trials if t["workload"] == wl and t["fault"] == fault]
        stops = [t["launcher_stop_s"] for t in ts if "launcher_stop_s" in t]
        print(f"{wl:16s} {fault:18s} {len(ts):6d} {sum(t['ok'] for t in ts):4d} {sum(bool(t.get('named')) for t in ts):6d} "
              f"{max(stops) if stops else '-':>10}")
    n = len(trials)
    hung = sum(bool(t.get("hung")) for t in trials)
    late = sum(t.get("launcher_stop_s", 0) > 2 * t.get("timeout_s", rig.timeout) + rig.grace
               for t in trials if not t["restarts"])
    named_n = sum(bool(t.get("named")) for t in trials if not t["restarts"])
    print(f"\n{n} trials: {sum(t['ok'] for t in trials)} ok, {hung} hung, {late} stopped later than 2x the timeout "
          f"(+{rig.grace:g}s grace), named {named_n}/{sum(not t['restarts'] for t in trials)}; restart trials equal: "
          f"{sum(t.get('equal') is True for t in trials)}/{sum(bool(t['restarts']) for t in trials)}; "
          f"checkpoint loadable: {sum(t.get('loadable') is True for t in trials)}/"
          f"{sum(t.get('loadable') is not None for t in trials)}")


if __name__ == "__main__":
    sys.exit(main())
