#!/usr/bin/python3
"""Peer driver: PyTorch DistributedDataParallel (gloo, CPU, one compute thread per rank) training the
reference MLP 784-2048-2048-1024-10 (7.9M parameters) with SGD momentum 0.9 on a fixed batch per
rank, the workload of `dtrain-bench ddp`. Prints rank 0's line:

    torch-ddp world=2 params=7912458 batch_per_rank=64 ms_per_step=... samples_per_s=... hook=none
    bytes_per_step=...

after WARMUP untimed steps (3) and STEPS timed ones. Then checks that every rank holds the same
parameters (DDP's invariant: each parameter's sum); exits 1 if they differ.

usage: torch_ddp.py WORLD [STEPS (20)] [BATCH_PER_RANK (64)] [--hook H] [--warmup N] [--opt O] [--device D] [--backend B]
       torchrun ... torch_ddp.py env [STEPS] [BATCH_PER_RANK] [--hook H] [--warmup N] [--opt O]

WORLD: spawns WORLD ranks on this host (rendezvous on 127.0.0.1); the parent compares the ranks'
parameters, so the check needs no collective of the system under test. `env`: one rank per process
as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g. on the emulated cluster
(`scripts/cluster.sh --launcher torchrun`); the check then gathers the sums with gloo.
--opt: sgd (the default, as above), adam (Adam lr 1e-3) or zero-adam (ZeroRedundancyOptimizer over Adam
lr 1e-3, PyTorch's ZeRO stage 1: the peer of `dtrain-bench zero --mode zero1`); the line then ends opt=O.
--device cuda: the model and batches on cuda:0 (every rank), the peer of `dtrain-bench ddp --device cuda`:
NCCL at world 1 (DDP wrapped even then), Gloo with CUDA tensors at world 2 and more (NCCL refuses two ranks on
one GPU); the line then ends device=cuda.
--backend dtrain: torch.distributed on dtrain's backend (python/; the package importable: pip install ./python,
or PYTHONPATH=<build>/python) instead of Gloo; the line then ends backend=dtrain.
--hook: none, fp16 (fp16_compress_hook) or powersgd:R (powerSGD_hook, matrix_approximation_rank R,
start_powerSGD_iter 2, the rest of PowerSGDState's defaults). bytes_per_step is what each rank hands
to allreduce per step once the hook is active, computed from the model's shapes and the hook's rules
(PowerSGD: (n+m)*R floats for a compressed (n, m) gradient, n*m for the others).
Note: PyTorch's powerSGD_hook over gloo with 2 or more ranks (1.13, and 2.15 too) crashes within the first compressed
steps on this machine (gloo::EnforceNotMet ... op.preamble.length <= op.nbytes); see docs/PERFORMANCE.md.
"""
import argparse
import os
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


def powersgd_rank(hook):
    return int(hook.split(":", 1)[1]) if hook.startswith("powersgd:") else 0


def bytes_per_step(net, hook):
    """Bytes each rank hands to allreduce per step with the hook active (PowerSGD: both of its
    allreduces; min_compression_rate 2, as PowerSGDState's default)."""
    r = powersgd_rank(hook)
    total = 0
    for p in net.parameters():
        if hook == "fp16":
            total += 2 * p.numel()
        elif r:
            n, m = p.shape[0], p.numel() // p.shape[0]
            total += 4 * ((n + m) * r if p.dim() > 1 and (n + m) * r * 2 < n * m else n * m)
        else:
            total += 4 * p.numel()
    return total


def register(ddp, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif powersgd_rank(hook):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank(hook),
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook != "none":
        raise SystemExit(f"torch_ddp: --hook must be none, fp16 or powersgd:R (got '{hook}')")


def train(rank, world, a):
    """Trains; returns (seconds per timed step, parameter count, per-parameter sums)."""
    peer_env.check_threads(torch)
    net = model()
    on_gpu = a.device == "cuda"
    if on_gpu:
        net = net.cuda()
    ddp = nn.parallel.DistributedDataParallel(net) if world > 1 or on_gpu else net
    if world > 1:
        register(ddp, a.hook)
    if a.opt == "zero-adam" and world > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    elif a.opt in ("adam", "zero-adam"):
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(a.batch, 784, generator=g)
    y = torch.randint(0, 10, (a.batch,), generator=g)
    if on_gpu:
        x, y = x.cuda(), y.cuda()
    settle = torch.cuda.synchronize if on_gpu else (lambda: None)
    lossf = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        lossf(ddp(x), y).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    settle()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    settle()
    dist.barrier()
    dt = (time.perf_counter() - t0) / a.steps
    sums = [float(p.detach().double().sum()) for p in net.parameters()]
    return dt, sum(p.numel() for p in net.parameters()), sums, bytes_per_step(net, a.hook)


def spawned(rank, world, a, port, q):
    backend = "nccl" if a.device == "cuda" and world == 1 else a.backend
    if backend == "dtrain":
        import dtrain  # noqa: F401  (python/: the torch.distributed backend)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    q.put((rank, *train(rank, world, a)))
    dist.destroy_process_group()


def report(world, a, results):
    _, dt, params, sums0, nbytes = results[0]
    differ = sum(r[3] != sums0 for r in results)
    print(f"torch-ddp world={world} params={params} batch_per_rank={a.batch} ms_per_step={dt * 1e3:.1f} "
          f"samples_per_s={world * a.batch / dt:.1f} hook={a.hook} bytes_per_step={nbytes if world > 1 else 0}"
          + (f" opt={a.opt}" if a.opt != "sgd" else "") + (f" device={a.device}" if a.device != "cpu" else "")
          + (f" backend={a.backend}" if a.backend != "gloo" else ""),
          flush=True)
    if differ:
        sys.exit(f"torch_ddp: {differ} of {world} ranks hold parameters different from rank 0's")


def main():
    p = argparse.ArgumentParser(usage=__doc__)
    p.add_argument("world")
    p.add_argument("steps", nargs="?", type=int, default=20)
    p.add_argument("batch", nargs="?", type=int, default=64)
    p.add_argument("--hook", default="none")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--opt", default="sgd", choices=["sgd", "adam", "zero-adam"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default="gloo", choices=["gloo", "dtrain"])
    a = p.parse_args()
    if a.hook not in ("none", "fp16") and not (a.hook.startswith("powersgd:") and a.hook[9:].isdigit()
                                               and int(a.hook[9:]) > 0):
        sys.exit(f"torch_ddp: --hook must be none, fp16 or powersgd:R with R >= 1 (got '{a.hook}')")
    if a.world == "env":
        if a.backend == "dtrain":
            import dtrain  # noqa: F401
        dist.init_process_group(a.backend, init_method="env://")
        rank, world = dist.get_rank(), dist.get_world_size()
        out = train(rank, world, a)
        gathered = [None] * world
        dist.all_gather_object(gathered, (rank, *out))
        if rank == 0:
            report(world, a, sorted(gathered))
        dist.destroy_process_group()
        return
    world = int(a.world)
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(spawned, args=(world, a, peer_env.free_port(), q), nprocs=world)
    report(world, a, sorted(q.get() for _ in range(world)))


if __name__ == "__main__":
    main()
