# The PyTorch side of tests/torch/powersgd_test.cc: trains the test's model for a few steps in a Gloo
# DDP run of WORLD processes (each on its slice of every step's batch) with PyTorch's powerSGD_hook (or,
# for the batched variant, the hand-written reference below: PyTorch 1.13's batched_powerSGD_hook fails
# on its first compressed step) and writes the gradients the hook produced at every step, as rank 0
# saw them (DDP gives every rank the same).
#
# usage: python3 powersgd_reference.py [--world W] DIR...   (one case per DIR; W 1 by default)
#   With W > 1 it starts W processes of itself (--rank R), which meet in a FileStore in the first DIR.
#   DIR/config.json  {"rank", "start", "warm_start", "error_feedback", "epsilon", "seed",
#                     "min_compression_rate", "steps", "batch", "first_bucket_bytes", "bucket_bytes",
#                     "lr", "batched"}
#   DIR/params.bin   float32, the model's parameters in registration order
#   DIR/x.bin        float32, steps * batch * 4 * 4 * 4;  DIR/y.bin int64, steps * batch
# writes
#   DIR/grads.bin    float32, per step the gradients after the hook, in registration order
#   DIR/layout.json  per compressed step, the buckets the hook saw: lists of parameter indices
import inspect
import json
import math
import os
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as psgd
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class Net(torch.nn.Module):
    """tests/torch/powersgd_test.cc's PsgdNet: a 4-D weight, matrices of shapes A B A in one bucket
    (PowerSGD groups them by shape), biases. The conv has no bias: DDP's rebuilt buckets would hold
    its weight and bias in gradient arrival order, dtrain's one-rank buckets in reverse order."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3, bias=False)
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.fc3 = torch.nn.Linear(32, 64)
        self.fc4 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        x = torch.tanh(self.fc3(x))
        return self.fc4(x)


def batched_reference_hook(state, bucket):
    """batched_powerSGD_hook's algorithm, by hand: the bucket zero-padded to side^2 and viewed as one
    side x side matrix, compressed at rank min(side, r) with the same seeding, memories and error
    feedback as powerSGD_hook (orthogonalised by Gram-Schmidt with the state's epsilon)."""
    world = state.process_group.size()
    buf = bucket.buffer()
    is_last = bucket.is_last()
    if state.iter < state.start_powerSGD_iter:
        if is_last:
            state.iter += 1
        buf.div_(world)
        return dist.all_reduce(buf, group=state.process_group, async_op=True).get_future().then(lambda f: f.value()[0])
    length = buf.shape[0]
    side = math.ceil(math.sqrt(length))
    rank = min(side, state.matrix_approximation_rank)
    padded = torch.zeros(side * side, dtype=buf.dtype)
    padded[:length] = buf
    b = bucket.index()
    if state.use_error_feedback:
        if b in state.error_dict:
            padded += state.error_dict[b]
        copy = padded.clone()
    m = padded.view(side, side)
    if not state.warm_start or b not in state.q_memory_dict:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            state.q_memory_dict[b] = torch.randn(side, rank, dtype=buf.dtype)
    q = state.q_memory_dict[b]
    eps = state.orthogonalization_epsilon
    psgd._orthogonalize_gram_schmidt(q.unsqueeze(0), eps)
    p = m @ q
    dist.all_reduce(p, group=state.process_group)
    psgd._orthogonalize_gram_schmidt(p.unsqueeze(0), eps)
    torch.matmul(m.t(), p, out=q)
    dist.all_reduce(q, group=state.process_group)
    q.div_(world)
    m.copy_(p @ q.t())
    if state.use_error_feedback:
        state.error_dict[b] = copy - padded
    if not state.warm_start:
        state.q_memory_dict.clear()
    buf.copy_(padded[:length])
    if is_last:
        state.iter += 1
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def main():
    args = sys.argv[1:]
    world, rank = 1, None
    while args and args[0] in ("--world", "--rank"):
        if args[0] == "--world":
            world = int(args[1])
        else:
            rank = int(args[1])
        args = args[2:]
    dirs = args
    if rank is None and world > 1:
        # One process per rank; every one must succeed (each bounded by the test's own timeout).
        procs = [subprocess.Popen([sys.executable, __file__, "--world", str(world), "--rank", str(r)] + dirs)
                 for r in range(world)]
        codes = [p.wait() for p in procs]
        sys.exit(0 if all(c == 0 for c in codes) else 1)
    rank = rank or 0
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(dirs[0], "store.w%d" % world), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    for d in dirs:
        run(d, rank, world)
    dist.destroy_process_group()
    # Tearing down a Gloo group whose last reference a completion callback of the hook's futures
    # dropped can abort ("Resource deadlock avoided": a worker thread joining itself), after every
    # result was written. Leave without the teardown.
    sys.stdout.flush()
    os._exit(0)


def run(d, rank, world):
    cfg = json.load(open(os.path.join(d, "config.json")))
    # A group of its own per case (every rank creates them in the same order). new_group, not a
    # ProcessGroupGloo built by hand: PyTorch 2.x's DDP takes only a ProcessGroup, whose backend that is.
    pg = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    model = Net()
    flat = torch.from_numpy(np.fromfile(os.path.join(d, "params.bin"), dtype=np.float32))
    params = list(model.parameters())
    with torch.no_grad():
        off = 0
        for p in params:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
    assert off == flat.numel(), "params.bin does not fit the model"
    steps, batch = cfg["steps"], cfg["batch"]
    assert batch % world == 0, "the batch does not split over the ranks"
    per = batch // world
    xs = torch.from_numpy(np.fromfile(os.path.join(d, "x.bin"), dtype=np.float32)).view(steps, batch, 4, 4, 4)
    ys = torch.from_numpy(np.fromfile(os.path.join(d, "y.bin"), dtype=np.int64)).view(steps, batch)

    # The bucket sizes DDP uses when it rebuilds its buckets after the first step (the layout of
    # every compressed step); the test picks sizes where PyTorch's and dtrain's rules agree.
    # PyTorch 1.13 caps the first bucket at dist._DEFAULT_FIRST_BUCKET_BYTES whatever bucket_cap_mb is;
    # later releases do so only when bucket_cap_mb is left at its default, and take per-bucket caps
    # (bucket_cap_mb_list, the last one repeating) instead.
    mb = float(1 << 20)
    if "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters:
        ddp = DDP(model, process_group=pg, bucket_cap_mb_list=[cfg["first_bucket_bytes"] / mb, cfg["bucket_bytes"] / mb])
    else:
        dist._DEFAULT_FIRST_BUCKET_BYTES = cfg["first_bucket_bytes"]
        ddp = DDP(model, process_group=pg, bucket_cap_mb=cfg["bucket_bytes"] / mb)
    state = psgd.PowerSGDState(
        process_group=pg, matrix_approximation_rank=cfg["rank"], start_powerSGD_iter=cfg["start"],
        min_compression_rate=cfg["min_compression_rate"], use_error_feedback=cfg["error_feedback"],
        warm_start=cfg["warm_start"], orthogonalization_epsilon=cfg["epsilon"], random_seed=cfg["seed"])
    index_of = {id(p): i for i, p in enumerate(params)}
    layouts = []
    hook = batched_reference_hook if cfg["batched"] else psgd.powerSGD_hook

    # One bucket at a time: powerSGD_hook without warm start clears every bucket's P / Q memory when
    # one bucket finishes (a KeyError in the others still in flight), and it waits for its second and
    # third allreduces inside Gloo's completion callbacks (with more buckets in flight than Gloo's
    # worker threads it deadlocks). The results are what overlapping buckets give: every rank runs the
    # buckets in the same order, and each bucket's arithmetic does not depend on the others'.
    def recording_hook(st, bucket):
        if st.iter >= st.start_powerSGD_iter:
            if bucket.index() == 0:
                layouts.append([])
            layouts[-1].append([index_of[id(p)] for p in bucket.parameters()])
        fut = hook(st, bucket)
        fut.wait()
        return fut

    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    grads = []
    for s in range(steps):
        opt.zero_grad()
        mine = slice(rank * per, (rank + 1) * per)
        F.cross_entropy(ddp(xs[s][mine]), ys[s][mine]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in params]).numpy().tobytes())
        opt.step()
    if rank == 0:
        with open(os.path.join(d, "grads.bin"), "wb") as out:
            out.write(b"".join(grads))
        json.dump(layouts, open(os.path.join(d, "layout.json"), "w"))
    # Kept alive until os._exit: destroying a Gloo group (with its DDP and hook state) whose futures'
    # callbacks still hold it can abort the process ("Resource deadlock avoided") under load.
    _KEEP.append((pg, ddp, state, model))


_KEEP = []


if __name__ == "__main__":
    main()
