#!/usr/bin/python3
"""The fault soak's scoring (CTest: soak_score_test): scripts/soak.py's rules on made-up trials, without
running one. Whether the launcher's output names the faulty rank and the cause (named), whether a trial
met the bars (ok: no hang, stopped within 2x the timeout plus the grace period, a non-zero exit naming the
rank, a restart ending equal to the uninterrupted run, a loadable newest checkpoint), and which trials the
soak draws (choose: the faults in turn, restarts only where a checkpoint lets the job resume).

  soak_score_test.py        (exits 1 naming each rule that failed)
"""
import importlib.util
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOAK = os.path.join(HERE, "..", "..", "scripts", "soak.py")
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
spec = importlib.util.spec_from_file_location("soak", SOAK)
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def trial(**kw):
    """A finished trial with no restart that met every bar; `kw` changes it."""
    t = {"id": 0, "workload": "ddp", "fault": "sigkill", "rank": 1, "moment": 1.0, "restarts": 0, "seed": 1,
         "rc": 1, "hung": False, "timeout_s": 10.0, "launcher_stop_s": 3.0, "named": True}
    t.update(kw)
    return t


def test_named():
    killed = "dtrain-run: rank 1 (pid 4242) was killed by signal 9 (SIGKILL); stopping the others"
    check(soak.named(killed, 1, "sigkill"), "named: a SIGKILL of rank 1, said so")
    check(not soak.named(killed, 0, "sigkill"), "named: rank 0 is not the rank the output blames")
    check(not soak.named(killed.replace("rank 1 ", "rank 10 "), 1, "sigkill"), "named: rank 10 is not rank 1")
    check(not soak.named("dtrain-run: rank 1 exited with code 1", 1, "sigkill"), "named: the rank without the cause")
    stuck = "[rank 0]: allreduce seq=41 f32 x 1000 timed out after 10s waiting for rank 1 (10.0.0.2:41233)"
    check(soak.named(stuck, 1, "sigstop"), "named: a stopped rank 1, as the timeout names it")
    check(not soak.named(stuck, 1, "sigkill"), "named: a timeout is not the cause of a SIGKILL")
    check(not soak.named("[rank 1]: allreduce timed out after 10s", 1, "sigstop"),
          "named: the launcher's '[rank 1]: ' prefix says who printed the line, not whom it blames")
    check(soak.named("[rank 0]: allreduce timed out after 10s waiting for rank 1", 1, "sigstop"),
          "named: rank 1 named in a line rank 0 printed")
    check(soak.named("cut: connection reset by peer rank 1", 1, "cut-link"), "named: a cut link")
    ps = "ps: worker timed out: workers [1] did not push step 5"
    check(soak.named(ps, 1, "sigstop"), "named: the parameter server's 'workers [1]'")
    full = "milnce: checkpoint step 8: write failed: No space left on device"
    check(soak.named(full, 0, "disk-full"), "named: a full disk names no rank")
    check(not soak.named(full, 0, "corrupt-checkpoint"), "named: a full disk is not a corrupt checkpoint")
    check(soak.named("checkpoint .../rank1.pt: checksum mismatch", 1, "corrupt-checkpoint"),
          "named: a corrupt checkpoint's checksum")


def test_ok():
    check(soak.ok(trial()), "ok: a prompt, non-zero, named stop")
    check(not soak.ok(trial(hung=True)), "ok: a hang is never ok")
    check(soak.ok(trial(launcher_stop_s=22.0)), "ok: a stop at 2x the timeout plus the grace period")
    check(not soak.ok(trial(launcher_stop_s=22.1)), "ok: a stop later than 2x the timeout plus the grace period")
    check(not soak.ok(trial(launcher_stop_s=62.1, timeout_s=30.0, workload="ps")) and
          soak.ok(trial(launcher_stop_s=61.9, timeout_s=30.0, workload="ps")), "ok: the limit follows the trial's timeout")
    check(not soak.ok(trial(rc=0)), "ok: a job that exited 0 after a fault without restarts")
    check(not soak.ok(trial(rc=None)), "ok: a job without an exit code")
    check(not soak.ok(trial(named=False)), "ok: an error that does not name the rank and cause")
    check(not soak.ok(trial(loadable=False)), "ok: a newest checkpoint that does not load")
    check(soak.ok(trial(loadable=None)), "ok: no checkpoint at all is not a failure")
    restart = dict(workload="milnce", restarts=1, rc=0, equal=True, named=False, loadable=True)
    check(soak.ok(trial(**restart)), "ok: a restart that ended equal to the uninterrupted run")
    check(soak.ok(trial(**dict(restart, launcher_stop_s=500.0))), "ok: a restart trial's stop time is not bounded")
    check(not soak.ok(trial(**dict(restart, equal=False))), "ok: a restart that ended with another result")
    check(not soak.ok(trial(**dict(restart, rc=1, named=True))), "ok: a restart trial that failed")
    corrupt = dict(workload="zero2", fault="corrupt-checkpoint", rc=0, named=True)
    check(soak.ok(trial(**corrupt)), "ok: a resume from an older checkpoint, naming the damaged one")
    check(not soak.ok(trial(**dict(corrupt, named=False))), "ok: a resume that said nothing of the damage")


def test_choose():
    rng = random.Random(5)
    trials = [soak.choose(rng, i) for i in range(200)]
    check(all(t["fault"] == soak.FAULTS[t["id"] % len(soak.FAULTS)] for t in trials), "choose: the faults in turn")
    check(all(t["workload"] in soak.CHECKPOINTING for t in trials if t["fault"] in ("disk-full", "corrupt-checkpoint")),
          "choose: disk and checkpoint faults on checkpointing workloads")
    restarts = [t for t in trials if t["restarts"]]
    check(restarts and all(t["fault"] == "sigkill" and t["workload"] in soak.CHECKPOINTING for t in restarts),
          "choose: restarts only after a SIGKILL of a checkpointing workload")
    check(all(t["rank"] in (0, 1) and 0.5 <= t["moment"] <= 4.0 for t in trials), "choose: a rank of 2, a moment in 0.5-4 s")
    only = [soak.choose(random.Random(1), i, "sigstop") for i in range(10)]
    check(all(t["fault"] == "sigstop" for t in only), "choose: --only-fault")


test_named()
test_ok()
test_choose()
if failures:
    print(f"{len(failures)} failed: " + "; ".join(failures))
    sys.exit(1)
print("all passed")
