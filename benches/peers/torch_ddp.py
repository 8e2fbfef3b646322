#!/usr/bin/python3
"""Peer driver: PyTorch DistributedDataParallel (gloo, CPU, one compute thread per rank) training the
reference MLP 784-2048-2048-1024-10 (7.9M parameters) with SGD momentum 0.9 on a fixed batch per
rank, the workload of `dtrain-bench ddp`. Prints rank 0's line:

    torch-ddp world=2 params=7912458 batch_per_rank=64 ms_per_step=... samples_per_s=...

after 3 untimed steps and STEPS timed ones. Then checks that every rank holds the same parameters
(DDP's invariant: each parameter's sum, compared by the parent process); exits 1 if they differ.

usage: torch_ddp.py WORLD [STEPS (20)] [BATCH_PER_RANK (64)]
"""
import sys
import time

import peer_env  # noqa: F401  (before torch: one compute thread per rank, BLAS included)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))


def run(rank, world, steps, bs, port, q):
    peer_env.check_threads(torch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    net = model()
    ddp = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(bs, 784, generator=g)
    y = torch.randint(0, 10, (bs,), generator=g)
    lossf = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        lossf(ddp(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    dt = (time.perf_counter() - t0) / steps
    # Checked by the parent, so the check needs no collective of the system under test.
    sums = [float(p.detach().double().sum()) for p in net.parameters()]
    q.put((rank, dt, sum(p.numel() for p in net.parameters()), sums))
    dist.destroy_process_group()


if __name__ == "__main__":
    if not 2 <= len(sys.argv) <= 4:
        sys.exit(__doc__)
    world = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    bs = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(world, steps, bs, peer_env.free_port(), q), nprocs=world)
    results = sorted(q.get() for _ in range(world))
    _, dt, params, sums0 = results[0]
    differ = sum(sums != sums0 for *_, sums in results)
    print(f"torch-ddp world={world} params={params} batch_per_rank={bs} ms_per_step={dt * 1e3:.1f} "
          f"samples_per_s={world * bs / dt:.1f}")
    if differ:
        sys.exit(f"torch_ddp: {differ} of {world} ranks hold parameters different from rank 0's")
