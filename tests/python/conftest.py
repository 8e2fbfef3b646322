"""Runs a scenario of ranks.py on N ranks, each a process of its own (as torchrun would start them)."""
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    def __init__(self, results):
        self.results = results  # [(returncode, output)] by rank

    def ok(self):
        bad = [f"rank {r} exited {rc}:\n{out[-4000:]}" for r, (rc, out) in enumerate(self.results) if rc != 0]
        assert not bad, "\n".join(bad)


def run_ranks(scenario, world, timeout=120, env=None, args=(), script="ranks.py"):
    """Starts `world` processes of `script scenario`, waits for all (bounded), returns their results."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
                  "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        e.update({k: v for k, v in (env or {}).items() if not isinstance(v, dict)})
        for k, v in (env or {}).items():  # per-rank values: {"VAR": {rank: value}}
            if isinstance(v, dict) and rank in v:
                e[k] = v[rank]
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, script), scenario, *map(str, args)],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n(killed: still running after {timeout} s)"
            p.returncode = p.returncode if p.returncode is not None else -9
        results.append((p.returncode, out))
    return Ranks(results)


@pytest.fixture
def ranks():
    return run_ranks
