"""dtrain as a torch.distributed backend: every collective against Gloo on the same inputs (world 1-4),
PyTorch's DDP, ZeRO, FSDP 1 and 2 and a DeviceMesh trained on dtrain against the same run on Gloo, and the
faults: a rank killed, mismatched calls, a wrong job secret, an unsupported call."""
import pytest


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_gloo(ranks, world):
    ranks("collectives", world).ok()


TRAININGS = ["ddp:plain", "ddp:unused", "ddp:no_sync", "ddp:fp16", "ddp:powersgd", "zero", "fsdp2", "fsdp1"]


@pytest.fixture(scope="module")
def trainings():
    """Every training below in one run of 2 ranks (a process start costs seconds): each prints RESULT."""
    from conftest import run_ranks
    return run_ranks("training", 2, timeout=300, args=TRAININGS)


@pytest.mark.parametrize("name", TRAININGS)
def test_training_matches_gloo(trainings, name):
    """PyTorch's DDP (find_unused_parameters, no_sync, the fp16 and PowerSGD hooks), ZeroRedundancyOptimizer,
    FSDP2 (fully_shard) and FSDP1 on dtrain end equal to the same run on Gloo."""
    for rank, (rc, out) in enumerate(trainings.results):
        assert f"RESULT {name} ok" in out, f"rank {rank} exited {rc}:\n{out[-4000:]}"


def test_ddp_over_tcp_matches_gloo(ranks):
    ranks("ddp", 2, args=["plain"], env={"DTRAIN_TRANSPORT": "tcp"}).ok()


def test_device_mesh_2x2(ranks):
    ranks("mesh", 4).ok()


def test_a_killed_rank_is_named_by_the_others(ranks):
    r = ranks("kill", 3, timeout=90)
    assert r.results[1][0] != 0, "rank 1 was to die"
    for rank in (0, 2):
        rc, out = r.results[rank]
        assert rc == 0, f"rank {rank}: {out[-3000:]}"
        assert "raised after" in out, out[-3000:]


def test_mismatched_calls_raise_on_every_rank(ranks):
    r = ranks("mismatch", 2, timeout=60)
    r.ok()
    for rc, out in r.results:
        assert "raised:" in out, out[-2000:]


def test_a_wrong_job_secret_is_refused(ranks):
    # Over TCP (on one host dtrain would take shared memory, which the secret does not guard: docs/SECURITY.md).
    r = ranks("secret", 2, timeout=60, env={"DTRAIN_TRANSPORT": "tcp", "DTRAIN_SECRET": {0: "right", 1: "wrong"}})
    for rank, (rc, out) in enumerate(r.results):
        assert rc == 3, f"rank {rank} exited {rc}: {out[-2000:]}"
    assert any("secret" in out or "authentic" in out for _, out in r.results), r.results


def test_unsupported_calls_say_so(ranks):
    ranks("unsupported", 2).ok()


def test_the_entry_point_registers_it_without_an_import(ranks):
    import torch
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 15):
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.backends entry points (2.15 and later)")
    r = ranks("dtrain", 2, script="no_import.py")
    r.ok()
    assert all("entry point: ok" in out for _, out in r.results)


def test_torchrun_trains_the_readme_example(tmp_path):
    import os
    import subprocess
    import sys
    from conftest import free_port
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "python", "ddp_train.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), example, "--steps", "5"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "dtrain: world 2, 5 steps" in out.stdout, out.stdout
