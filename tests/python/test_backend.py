"""dtrain as a torch.distributed backend: every collective against Gloo on the same inputs (world 1-4),
PyTorch's DDP, ZeRO, FSDP 1 and 2 and a DeviceMesh trained on dtrain against the same run on Gloo, and the
faults: a rank killed, mismatched calls, a wrong job secret, an unsupported call."""
import pytest


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_gloo(ranks, world):
    ranks("collectives", world).ok()


@pytest.mark.parametrize("variant", ["plain", "unused", "no_sync", "fp16", "powersgd", "tcp"])
def test_ddp_matches_gloo(ranks, variant):
    env = {"DTRAIN_TRANSPORT": "tcp"} if variant == "tcp" else None
    ranks("ddp", 2, args=[variant], env=env).ok()


def test_zero_redundancy_optimizer_matches_gloo(ranks):
    ranks("zero", 2).ok()


def test_fsdp2_matches_gloo(ranks):
    ranks("fsdp2", 2).ok()


def test_fsdp1_matches_gloo(ranks):
    ranks("fsdp1", 2).ok()


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
