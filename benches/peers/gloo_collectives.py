#!/usr/bin/python3
"""Peer driver: PyTorch c10d Gloo collectives on CPU (float32), nccl-tests style busbw, one compute
thread per rank. One line per size from rank 0:

    gloo world=2 bytes=4096 time_us=2161.1 algbw=0.002 busbw=0.002 wrong=0

(the first word is gloo-allgather / gloo-broadcast for those ops). bytes is what nccl-tests counts:
the input of allreduce and broadcast, the output of allgather; busbw = algbw * 2(n-1)/n for
allreduce, * (n-1)/n for allgather, * 1 for broadcast. time_us is rank 0's mean over 2e8/bytes
iterations (3..200) after 2 warm-up calls. After the timed loop one more call, on fresh known inputs, is
checked on every rank (wrong = elements wrong on all ranks together); the program exits 1 if any was.

usage: gloo_collectives.py WORLD [FLOATS...] [--op allreduce|allgather|broadcast]
"""
import argparse
import sys
import time

import peer_env  # noqa: F401  (before torch: one compute thread per rank, BLAS included)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUS = {"allreduce": lambda n: 2 * (n - 1) / n, "allgather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def inputs(rank, count):
    return (torch.arange(count, dtype=torch.float32) % 4) + rank + 1  # exact sums in float32


def op_runner(op, rank, world, count):
    """(one timed call, one checked call -> #wrong on this rank) for `count` floats."""
    if op == "allreduce":
        # In place, as the timed calls are too (the sums grow; inf is as fast as any float): the
        # checked call starts from the inputs again.
        t = inputs(rank, count)
        expect = sum(inputs(r, count) for r in range(world))

        def checked():
            t.copy_(inputs(rank, count))
            dist.all_reduce(t)
            return int((t != expect).sum())
        return lambda: dist.all_reduce(t), checked
    if op == "allgather":
        block = count // world
        mine = inputs(rank, block)
        out = [torch.zeros(block) for _ in range(world)]

        def checked():
            for o in out:
                o.zero_()
            dist.all_gather(out, mine)
            return sum(int((o != inputs(r, block)).sum()) for r, o in enumerate(out))
        return lambda: dist.all_gather(out, mine), checked
    t = inputs(0, count) if rank == 0 else torch.zeros(count)

    def checked():
        if rank != 0:
            t.zero_()
        dist.broadcast(t, 0)
        return int((t != inputs(0, count)).sum())
    return lambda: dist.broadcast(t, 0), checked


def run(rank, world, sizes, op, port, q):
    peer_env.check_threads(torch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    for count in sizes:
        if op == "allgather":
            count = max(world, count // world * world)
        once, checked = op_runner(op, rank, world, count)
        iters = max(3, min(200, int(2e8 / max(count * 4, 1))))
        for _ in range(2):
            once()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        dt = (time.perf_counter() - t0) / iters
        mine = checked()
        if mine:
            print(f"gloo_collectives: rank {rank}: {op} of {count} floats: {mine} wrong elements", file=sys.stderr)
        out.append((count * 4, dt, mine))
    # Every rank reports to the parent, so counting the wrong elements needs no Gloo collective.
    q.put((rank, out))
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("world", type=int)
    ap.add_argument("floats", type=int, nargs="*", help="sizes in floats (default 2^10, 2^14 ... 2^24)")
    ap.add_argument("--op", choices=sorted(BUS), default="allreduce")
    a = ap.parse_args()
    sizes = a.floats or [1 << k for k in (10, 14, 18, 20, 22, 24)]
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(a.world, sizes, a.op, peer_env.free_port(), q), nprocs=a.world)  # raises if a rank failed
    name = "gloo" if a.op == "allreduce" else f"gloo-{a.op}"
    reports = dict(q.get() for _ in range(a.world))
    total = 0
    for i, (nbytes, dt, _) in enumerate(reports[0]):  # rank 0's times, everyone's wrong elements
        bad = sum(reports[r][i][2] for r in range(a.world))
        total += bad
        algbw = nbytes / dt / 1e9
        print(f"{name} world={a.world} bytes={nbytes} time_us={dt * 1e6:.1f} algbw={algbw:.3f} "
              f"busbw={algbw * BUS[a.op](a.world):.3f} wrong={bad}")
    sys.exit(1 if total else 0)
