"""A rank that never imports dtrain: torch (2.15+) loads the backend from the package's entry point."""
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group(sys.argv[1], rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert dist.get_backend() == "dtrain", dist.get_backend()
assert t.tolist() == [3.0] * 4, t
print("entry point: ok")
dist.destroy_process_group()
