#!/usr/bin/python3
"""Peer driver: what a PyTorch user does for the workload of `dtrain-bench ps --mode sparse`: an
nn.Embedding of TABLE_ROWS x DIM floats with sparse=True, wrapped in DistributedDataParallel over Gloo
(CPU, one compute thread per rank), plain SGD (lr 0.01, sparse updates); each step every rank looks up
ROWS random rows (its own draw), takes the loss sum(emb(rows) * 0.01 + rows-independent term) whose
gradient w.r.t. each looked-up row is known, backward (DDP allreduces the sparse gradient: Gloo gathers
every rank's indices and values), and steps the optimizer. Prints rank 0's line:

    torch-sparse-ddp world=2 table=1000000x64 rows_per_step=10000 ms_per_step=... (fwd+bwd ..., opt ...)

after WARMUP untimed steps (3) and STEPS timed ones (median step time: this VM stalls now and then).
Then checks the result: every rank holds the same table (DDP's invariant, the table's sum and a
checksum compared in the parent), and the table equals the initial one minus lr x the average of every
rank's row gradients (recomputed in the parent from the ranks' seeds); exits 1 if either fails.

usage: torch_sparse_ddp.py WORLD [STEPS (50)] [--table-rows N (1000000)] [--dim D (64)] [--rows R (10000)]
       [--warmup N (3)]
"""
import argparse
import statistics
import sys
import time

import peer_env  # noqa: F401  (before torch: one compute thread per rank, BLAS included)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

LR = 0.01


def rows_of(rank, step, args):
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return torch.randint(0, args.table_rows, (args.rows,), generator=g)


def initial_table(args):
    torch.manual_seed(0)
    return nn.Embedding(args.table_rows, args.dim, sparse=True)


def run(rank, args, port, out):
    peer_env.check_threads(torch)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    emb = initial_table(args)
    model = DDP(emb)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times, fb, op = [], [], []
    total = args.warmup + args.steps
    for step in range(total):
        idx = rows_of(rank, step, args)
        t0 = time.perf_counter()
        opt.zero_grad()
        out_rows = model(idx)
        # d loss / d row = 0.01 * (rank + 1): rank-dependent, so the average is checkable.
        loss = (out_rows * (0.01 * (rank + 1))).sum()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if step >= args.warmup:
            times.append((t2 - t0) * 1e3)
            fb.append((t1 - t0) * 1e3)
            op.append((t2 - t1) * 1e3)
    w = emb.weight.detach()
    out[rank] = (statistics.median(times), statistics.median(fb), statistics.median(op), w.sum().item(),
                 (w * torch.arange(1, args.dim + 1)).sum().item())
    if rank == 0:
        torch.save(w.clone(), args.table_file)
    dist.destroy_process_group()


def expected_table(args):
    """Initial table minus lr x the average over ranks of each rank's row gradients, step by step
    (plain SGD: the updates add up; a row drawn k times by a rank gets k times its gradient)."""
    w = initial_table(args).weight.detach().clone()
    for step in range(args.warmup + args.steps):
        for r in range(args.world):
            idx = rows_of(r, step, args)
            grad = torch.full((args.rows, args.dim), 0.01 * (r + 1))
            w.index_add_(0, idx, grad, alpha=-LR / args.world)
    return w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("world", type=int)
    ap.add_argument("steps", type=int, nargs="?", default=50)
    ap.add_argument("--table-rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        args.table_file = f"{tmp}/table.pt"
        out = mp.Manager().dict()
        mp.spawn(run, args=(args, peer_env.free_port(), out), nprocs=args.world, join=True)
        ms, fb, op, _, _ = out[0]
        print(f"torch-sparse-ddp world={args.world} table={args.table_rows}x{args.dim} rows_per_step={args.rows} "
              f"ms_per_step={ms:.2f} (fwd+bwd {fb:.2f}, opt {op:.2f}) torch={torch.__version__}", flush=True)
        sums = [out[r][3:] for r in range(args.world)]
        if any(s != sums[0] for s in sums):
            print(f"torch-sparse-ddp: the ranks' tables differ: {sums}", file=sys.stderr)
            return 1
        got = torch.load(args.table_file)
        want = expected_table(args)
        err = (got - want).abs().max().item()
        if not err <= 1e-5:
            print(f"torch-sparse-ddp: the table is off the expected SGD result by {err}", file=sys.stderr)
            return 1
        print(f"torch-sparse-ddp: checked (every rank's table equal; max error {err:.2e} against the closed form)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
