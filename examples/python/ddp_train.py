"""PyTorch's own DistributedDataParallel on dtrain's collectives: the only dtrain line is the backend's name.

    torchrun --nproc-per-node 2 examples/python/ddp_train.py            # after: pip install ./python
    torchrun --nproc-per-node 2 examples/python/ddp_train.py --backend gloo   # the same on Gloo
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--backend", default="dtrain")
p.add_argument("--steps", type=int, default=50)
args = p.parse_args()

if args.backend == "dtrain":
    import dtrain  # noqa: F401  registers the backend (on torch 2.15+ the entry point does it without this line)

dist.init_process_group(args.backend)
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
start = time.time()
for step in range(args.steps):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
if rank == 0:
    print(f"{args.backend}: world {world}, {args.steps} steps, loss {loss.item():.4f}, "
          f"{1000 * (time.time() - start) / args.steps:.2f} ms/step")
dist.destroy_process_group()
