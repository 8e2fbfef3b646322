"""One rank of a test scenario (conftest.run_ranks starts them): dtrain's backend against Gloo in the same
process, on the same inputs. Exits non-zero on the first mismatch, printing it."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dtrain  # noqa: F401  registers "dtrain"

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)


def init(timeout=60):
    dist.init_process_group("dtrain", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=timeout))
    assert dist.get_backend() == "dtrain", dist.get_backend()
    return dist.new_group(backend="gloo")


def same(a, b, what, exact=True):
    if a.dtype in (torch.float16, torch.bfloat16) or (not exact and a.is_floating_point()):
        # 16-bit sums round after each addition, in an order that depends on the algorithm: within two
        # units in the last place of the largest partial sum (|inputs| < 20, world <= 4: < 80).
        atol = {torch.float16: 0.07, torch.bfloat16: 0.5}.get(a.dtype, 1e-6)
        ok = torch.allclose(a.double(), b.double(), rtol=1e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-6,
                            atol=atol)
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"rank {RANK} world {WORLD}: {what}: dtrain {a.flatten()[:8].tolist()} vs "
                             f"{b.flatten()[:8].tolist()}")


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
R = dist.ReduceOp


def data(dtype, n, salt=0):
    g = torch.Generator().manual_seed(1000 * RANK + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 4).to(dtype)
    lo, hi = (0, 4) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def ops_for(dtype):
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if not dtype.is_floating_point:
        ops += [R.BAND, R.BOR, R.BXOR]
    return ops


def scenario_collectives():
    gloo = init()
    n = 13
    for dtype in DTYPES:
        for op in ops_for(dtype):
            if dtype == torch.bool and op in (R.BAND, R.BOR, R.BXOR):
                continue  # Gloo has no bitwise ops on bool
            a, b = data(dtype, n), data(dtype, n)
            dist.all_reduce(a, op=op)
            dist.all_reduce(b, op=op, group=gloo)
            same(a, b, f"all_reduce {op} {dtype}", exact=op not in (R.SUM, R.PRODUCT))
        # Non-contiguous (every other element of a 2 x n tensor's transpose): the result lands in place.
        a = data(dtype, 2 * n).view(n, 2).t()
        b = a.clone()
        dist.all_reduce(a, op=R.MAX)
        dist.all_reduce(b, op=R.MAX, group=gloo)
        same(a, b, f"all_reduce MAX non-contiguous {dtype}")
        for root in range(WORLD):
            a, b = data(dtype, n, 1), data(dtype, n, 1)
            dist.broadcast(a, root)
            dist.broadcast(b, root, group=gloo)
            same(a, b, f"broadcast root {root} {dtype}")
            if dtype != torch.bool:
                a, b = data(dtype, n, 2), data(dtype, n, 2)
                dist.reduce(a, root, op=R.MAX)
                dist.reduce(b, root, op=R.MAX, group=gloo)
                if RANK == root:  # elsewhere the tensor's contents are unspecified (Gloo leaves partial results)
                    same(a, b, f"reduce MAX root {root} {dtype}")
        x = data(dtype, n, 3)
        outs, refs = [torch.empty_like(x) for _ in range(WORLD)], [torch.empty_like(x) for _ in range(WORLD)]
        dist.all_gather(outs, x)
        dist.all_gather(refs, x, group=gloo)
        for r in range(WORLD):
            same(outs[r], refs[r], f"all_gather {dtype} block {r}")
        o, ref = torch.empty(WORLD * n, dtype=dtype), torch.empty(WORLD * n, dtype=dtype)
        dist.all_gather_into_tensor(o, x)
        dist.all_gather_into_tensor(ref, x, group=gloo)
        same(o, ref, f"all_gather_into_tensor {dtype}")
    # Averages (Gloo has none): against the sum divided here.
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        a, s = data(dtype, n), data(dtype, n)
        dist.all_reduce(a, op=R.AVG)
        dist.all_reduce(s, op=R.SUM, group=gloo)
        same(a, s / WORLD, f"all_reduce AVG {dtype}", exact=False)
    a, s = data(torch.float32, n), data(torch.float32, n)
    dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.5) if hasattr(dist, "_make_nccl_premul_sum") else R.SUM)
    dist.all_reduce(s, group=gloo)
    if hasattr(dist, "_make_nccl_premul_sum"):
        same(a, s * 0.5, "all_reduce PREMUL_SUM(0.5)", exact=False)
    # Reduce-scatter, list and tensor, even and (list) uneven.
    for dtype in (torch.float32, torch.int64, torch.int8):
        ins = [data(dtype, n, 10 + r) for r in range(WORLD)]
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, ins, op=R.SUM)
        want = torch.stack([torch.stack([data_of(q, dtype, n, 10 + r) for q in range(WORLD)]).sum(0).to(dtype)
                            for r in range(WORLD)])
        same(out, want[RANK], f"reduce_scatter {dtype}", exact=dtype != torch.float32)
        big = torch.cat(ins)
        out2 = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out2, big, op=R.SUM)
        same(out2, want[RANK], f"reduce_scatter_tensor {dtype}", exact=dtype != torch.float32)
        ref = torch.empty(n, dtype=dtype)
        try:
            dist.reduce_scatter_tensor(ref, big, op=R.SUM, group=gloo)
            same(out2, ref, f"reduce_scatter_tensor {dtype} against Gloo", exact=dtype != torch.float32)
        except (RuntimeError, ValueError) as e:
            if "not support" not in str(e):
                raise
    sizes = [r + 1 for r in range(WORLD)]
    ins = [torch.full((sizes[r],), float(RANK + r)) for r in range(WORLD)]
    out = torch.empty(sizes[RANK])
    dist.reduce_scatter(out, ins)
    same(out, torch.full((sizes[RANK],), float(sum(q + RANK for q in range(WORLD)))), "reduce_scatter uneven")
    # Uneven all_gather.
    mine = torch.full((RANK + 1,), float(RANK))
    outs = [torch.empty(r + 1) for r in range(WORLD)]
    dist.all_gather(outs, mine)
    for r in range(WORLD):
        same(outs[r], torch.full((r + 1,), float(r)), f"all_gather uneven block {r}")
    # All-to-all: even, uneven splits, list.
    x = torch.arange(WORLD * 3, dtype=torch.float32) + 100 * RANK
    o, ref = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(o, x)
    dist.all_to_all_single(ref, x, group=gloo)
    same(o, ref, "all_to_all_single even")
    in_splits = [(RANK + r) % 3 + 1 for r in range(WORLD)]
    out_splits = [(q + RANK) % 3 + 1 for q in range(WORLD)]
    x = torch.arange(sum(in_splits) * 2, dtype=torch.int64).view(-1, 2) + 1000 * RANK
    o, ref = torch.empty(sum(out_splits), 2, dtype=torch.int64), torch.empty(sum(out_splits), 2, dtype=torch.int64)
    dist.all_to_all_single(o, x, out_splits, in_splits)
    dist.all_to_all_single(ref, x, out_splits, in_splits, group=gloo)
    same(o, ref, "all_to_all_single uneven")
    ins = [torch.full((r + 1,), float(RANK * 10 + r)) for r in range(WORLD)]
    outs = [torch.empty(RANK + 1) for _ in range(WORLD)]
    dist.all_to_all(outs, ins)
    for q in range(WORLD):
        same(outs[q], torch.full((RANK + 1,), float(q * 10 + RANK)), f"all_to_all list from {q}")
    # Gather, scatter.
    for root in range(WORLD):
        x = torch.full((4,), float(RANK))
        gl = [torch.empty(4) for _ in range(WORLD)] if RANK == root else None
        dist.gather(x, gl, dst=root)
        if RANK == root:
            for r in range(WORLD):
                same(gl[r], torch.full((4,), float(r)), f"gather root {root} block {r}")
        sl = [torch.full((3,), float(10 * root + r)) for r in range(WORLD)] if RANK == root else None
        o = torch.empty(3)
        dist.scatter(o, sl, src=root)
        same(o, torch.full((3,), float(10 * root + RANK)), f"scatter root {root}")
    # Point to point: a ring with tags, and isend/irecv.
    if WORLD > 1:
        nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        buf = torch.empty(5, dtype=torch.float64)
        if RANK % 2 == 0:
            dist.send(torch.full((5,), float(RANK), dtype=torch.float64), nxt, tag=7)
            dist.recv(buf, prv, tag=7)
        else:
            dist.recv(buf, prv, tag=7)
            dist.send(torch.full((5,), float(RANK), dtype=torch.float64), nxt, tag=7)
        same(buf, torch.full((5,), float(prv), dtype=torch.float64), "send/recv ring")
        reqs = [dist.isend(torch.tensor([RANK]), nxt), dist.irecv(b := torch.empty(1, dtype=torch.int64), prv)]
        for q in reqs:
            q.wait()
        same(b, torch.tensor([prv]), "isend/irecv")
        ops = [dist.P2POp(dist.isend, torch.tensor([RANK * 2]), nxt), dist.P2POp(dist.irecv, c := torch.empty(1, dtype=torch.int64), prv)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        same(c, torch.tensor([prv * 2]), "batch_isend_irecv")
    dist.barrier()
    # The object collectives.
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK, "s": "x" * RANK})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(WORLD)], objs
    lst = [RANK, "hello"] if RANK == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [0, "hello"], lst
    got = [None] * WORLD if RANK == 0 else None
    dist.gather_object(("g", RANK), got, dst=0)
    if RANK == 0:
        assert got == [("g", r) for r in range(WORLD)], got
    out = [None]
    dist.scatter_object_list(out, [("s", r) for r in range(WORLD)] if RANK == 0 else None, src=0)
    assert out == [("s", RANK)], out
    # Coalesced: PyTorch batches these into all_reduce_coalesced, all_gather_into_tensor_coalesced and
    # reduce_scatter_tensor_coalesced.
    a, b = torch.full((3,), float(RANK)), torch.full((5,), float(2 * RANK))
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    s = float(sum(range(WORLD)))
    same(a, torch.full((3,), s), "coalesced all_reduce (first)")
    same(b, torch.full((5,), 2 * s), "coalesced all_reduce (second)")
    ins = [torch.full((2,), float(RANK + k)) for k in range(2)]
    outs = [torch.empty(2 * WORLD) for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for k in range(2):
        same(outs[k], torch.tensor([float(r + k) for r in range(WORLD) for _ in range(2)]), f"coalesced all_gather {k}")
    rs_in = [torch.arange(2 * WORLD, dtype=torch.float32) + k for k in range(2)]
    rs_out = [torch.empty(2) for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(rs_out, rs_in):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    for k in range(2):
        want = (torch.arange(2 * WORLD, dtype=torch.float32) + k)[2 * RANK:2 * RANK + 2] * WORLD
        same(rs_out[k], want, f"coalesced reduce_scatter {k}")
    # Async: a future with the outputs.
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    same(fut.wait(), torch.full((3,), 2.0 * WORLD), "future.then")
    assert work.is_completed()
    dist.destroy_process_group()


def data_of(rank, dtype, n, salt):
    global RANK
    saved, RANK = RANK, rank
    try:
        return data(dtype, n, salt)
    finally:
        RANK = saved


# ---- training with PyTorch's own parallel wrappers: dtrain against Gloo, same seeds, same data ----

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        torch.manual_seed(1)
        self.unused = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.body(x)


def batch(step):
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def train_ddp(group, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = WithUnused() if variant == "unused" else mlp()
    # Small buckets (several per step), but one for PowerSGD: its hook issues collectives from its
    # future's callbacks, which would race with the next bucket's on autograd's thread (docs/PYTHON.md).
    ddp = DDP(model, process_group=group, find_unused_parameters=variant == "unused",
              bucket_cap_mb=25 if variant == "powersgd" else 0.001)
    if variant == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    if variant == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        torch.manual_seed(2)
        ddp.register_comm_hook(ps.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                                start_powerSGD_iter=2, random_seed=3), ps.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        opt.zero_grad()
        if variant == "no_sync":
            with ddp.no_sync():
                x, y = batch(step + 50)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        x, y = batch(step)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_ddp(gloo, variant):
    mine, ref = train_ddp(None, variant), train_ddp(gloo, variant)
    for i, (a, b) in enumerate(zip(mine, ref)):
        same(a, b, f"DDP {variant}: parameter {i}", exact=False)


def scenario_ddp(variant):
    check_ddp(init(), variant)
    dist.destroy_process_group()


def scenario_training(*names):
    """Several trainings in one group (one process start for all): prints RESULT <name> ok, or stops at the
    first that fails (the ranks may then disagree on what comes next)."""
    gloo = init()
    for name in names:
        kind, _, variant = name.partition(":")
        if kind == "ddp":
            check_ddp(gloo, variant)
        else:
            globals()["check_" + kind](gloo)
        print(f"RESULT {name} ok", flush=True)
    dist.destroy_process_group()


def check_zero(gloo):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    results = []
    for group in (None, gloo):
        model = mlp()
        ddp = DDP(model, process_group=group)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01, process_group=group)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        opt.consolidate_state_dict(to=0)
        results.append([p.detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        same(a, b, f"ZeroRedundancyOptimizer: parameter {i}", exact=False)


def check_fsdp2(gloo):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    results = []
    for backend in ("dtrain", "gloo"):
        mesh = init_device_mesh("cpu", (WORLD,)) if backend == "dtrain" else None
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh.from_group(gloo, "cpu")
        model = mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        results.append([p.full_tensor().detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        same(a, b, f"FSDP2: parameter {i}", exact=False)


def check_fsdp1(gloo):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    results = []
    for group in (None, gloo):
        model = FSDP(mlp(), process_group=group, use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(3):
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        with FSDP.summon_full_params(model):
            results.append([p.detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        same(a, b, f"FSDP1: parameter {i}", exact=False)


def scenario_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    init()
    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
    row, col = RANK // (WORLD // 2), RANK % (WORLD // 2)
    for dim, name in enumerate(("dp", "tp")):
        g = mesh.get_group(name)
        assert dist.get_backend(g) == "dtrain", dist.get_backend(g)
        t = torch.tensor([float(RANK)])
        dist.all_reduce(t, group=g)
        members = [r for r in range(WORLD) if (r // (WORLD // 2) == row if dim == 1 else r % (WORLD // 2) == col)]
        same(t, torch.tensor([float(sum(members))]), f"mesh {name} all_reduce")
    dist.destroy_process_group()


# ---- faults ----

def scenario_kill():
    """Rank 1 dies in the middle of a run; the others' next collective raises, naming it, within the timeout."""
    init(timeout=5)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if RANK == 1:
        os.kill(os.getpid(), 9)
    start = time.time()
    try:
        for _ in range(3):
            dist.all_reduce(t)
    except dist.DistBackendError as e:
        took = time.time() - start
        msg = str(e)
        assert "rank 1" in msg, msg
        assert took < 30, took
        print(f"raised after {took:.1f} s: {msg.splitlines()[0]}")
        os._exit(0)  # the group is broken: leave without the teardown's collectives
    raise AssertionError("no error after the peer died")


def scenario_mismatch():
    init(timeout=20)
    t = torch.ones(8 if RANK == 0 else 16)
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as e:
        assert "mismatch" in str(e), str(e)
        print("raised:", str(e).splitlines()[0])
        os._exit(0)
    raise AssertionError("mismatched all_reduce did not raise")


def scenario_secret():
    try:
        init(timeout=5)
        dist.barrier()
    except (dist.DistBackendError, RuntimeError) as e:
        print("raised:", str(e).splitlines()[0])
        sys.exit(3)
    sys.exit(0)


def scenario_unsupported():
    init()
    try:
        dist.recv(torch.empty(1))  # from any source
    except ValueError as e:
        assert "dtrain does not support recv from any source" in str(e), str(e)
    else:
        raise AssertionError("recv from any source did not raise")
    try:
        dist.all_reduce(torch.ones(2), op=R.BAND)
    except ValueError as e:
        assert "bitwise reductions take integer or bool tensors" in str(e), str(e)
    else:
        raise AssertionError("BAND on floats did not raise")
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]](*sys.argv[2:])
