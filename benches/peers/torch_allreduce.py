#!/usr/bin/python3
"""Peer driver: torch.distributed.all_reduce (SUM, float32, in place) from Python at each size, on Gloo or on
dtrain's backend (python/), one compute thread per rank. Prints one line per size from rank 0:

    torch-allreduce backend=dtrain world=2 bytes=4096 us=... busbw_GBps=... wrong=0

after 3 untimed calls; the time is the median of REPS timed loops of ITERS calls each (a barrier before
each loop; the buffer is not refilled inside it, as dtrain-bench does not). After each loop one more call
on fresh values (each rank adds rank + 1: the sum is known) is checked: wrong= counts the elements that differ.

usage: torch_allreduce.py WORLD [--backend gloo|dtrain] [--sizes 4096,65536,...] [--iters N] [--reps R]
"""
import argparse
import statistics
import time

import peer_env  # noqa: F401  (before torch: one compute thread per rank, BLAS included)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def run(rank, world, a, port, q):
    if a.backend == "dtrain":
        import dtrain  # noqa: F401
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    want = world * (world + 1) / 2
    for nbytes in a.sizes:
        n = nbytes // 4
        t = torch.empty(n)
        iters = max(2, min(a.iters, (256 << 20) // max(nbytes, 1)))
        for _ in range(3):
            t.fill_(rank + 1)
            dist.all_reduce(t)
        times, wrong = [], 0
        for _ in range(a.reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)  # the values grow (to inf): the time does not depend on them
            times.append((time.perf_counter() - t0) / iters)
            t.fill_(rank + 1)  # one checked call after each timed loop
            dist.all_reduce(t)
            wrong += int((t != want).sum())
        if rank == 0:
            us = statistics.median(times) * 1e6
            busbw = 2 * (world - 1) / world * nbytes / (us * 1e-6) / 1e9
            q.put(f"torch-allreduce backend={a.backend} world={world} bytes={nbytes} us={us:.1f} "
                  f"busbw_GBps={busbw:.2f} wrong={wrong}")
    if rank == 0:
        q.put(None)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(usage=__doc__)
    p.add_argument("world", type=int)
    p.add_argument("--backend", default="gloo", choices=["gloo", "dtrain"])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    a.sizes = [int(x) for x in a.sizes.split(",")]
    q = mp.get_context("spawn").SimpleQueue()
    ctx = mp.spawn(run, args=(a.world, a, peer_env.free_port(), q), nprocs=a.world, join=False)
    while (line := q.get()) is not None:
        print(line, flush=True)
    ctx.join()


if __name__ == "__main__":
    main()
