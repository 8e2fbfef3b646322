#!/usr/bin/python3
"""The MIL-NCE job of apps/milnce in PyTorch (DDP, gloo, one compute thread per rank, BLAS included):
the peer that dtrain's milnce is measured against. Same data files (milnce gen-data), same loader rules, same model, same
loss, Adam with warmup + cosine; prints samples/s over the timed steps.

usage: milnce_torch.py DATA_DIR WORLD [--batch 32] [--steps 40] [--warmup-steps 5] [--candidates 4]
"""
import argparse, csv, math, os, random, re, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peer_env, also when loaded by path (tests)
import peer_env  # noqa: F401  (before numpy and torch: one compute thread per rank, BLAS included)
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

TOKEN = re.compile(r"[\w']+")


def load_words(data_dir):
    """The vocabulary (word -> id from 1) and the word vectors [V + 1, E] of a milnce data set."""
    vocab = {}
    with open(os.path.join(data_dir, "vocab.txt")) as f:
        for i, w in enumerate(f.read().split("\n")):
            if w:
                vocab[w] = i + 1
    return vocab, torch.from_numpy(np.load(os.path.join(data_dir, "word2vec.npy")))


def load_videos(data_dir, file_column, read):
    """[(read(path of the video's file), [(start, end, text)])] for each row of videos.csv."""
    videos = []
    with open(os.path.join(data_dir, "videos.csv")) as f:
        for row in csv.DictReader(f):
            with open(os.path.join(data_dir, "captions", row["video_id"] + ".csv")) as cf:
                caps = [(float(r["start"]), float(r["end"]), r["text"]) for r in csv.DictReader(cf)]
            videos.append((read(os.path.join(data_dir, row[file_column])), caps))
    return videos


def load(data_dir):
    vocab, wv = load_words(data_dir)
    videos = load_videos(data_dir, "feature_file", lambda path: torch.from_numpy(np.load(path)))
    with open(os.path.join(data_dir, "meta.json")) as f:
        import json
        meta = json.load(f)
    return vocab, wv, videos, float(meta.get("rate", 2.0))


def tokenize(text, vocab, max_words):
    ids = [vocab[w] for w in TOKEN.findall(text.lower()) if w in vocab][:max_words]
    return ids + [0] * (max_words - len(ids))


def nearest_candidates(caps, ind, k):
    # The reference loader's _find_nearest_candidates.
    start, end, n = ind, ind, 1
    while n < k:
        if start == 0:
            return 0
        elif end == len(caps) - 1:
            return start - (k - n)
        elif caps[end][1] - caps[start - 1][0] < caps[end + 1][1] - caps[start][0]:
            start -= 1
        else:
            end += 1
        n += 1
    return start


def sample(video, vocab, rate, k, max_words, clip_steps, min_time, rng):
    feats, caps = video
    ind = rng.randrange(len(caps))
    first = nearest_candidates(caps, ind, k) if k > 1 else ind
    text = [tokenize(caps[max(0, min(len(caps) - 1, first + i))][2], vocab, max_words) for i in range(k)]
    start, end = caps[ind][0], caps[ind][1]
    if end - start < min_time:
        diff = min_time - end + start
        start = max(0.0, start - diff / 2)
        end = start + min_time
    seek = rng.uniform(start, max(start, end - clip_steps / rate))
    t0 = min(int(round(seek * rate)), max(0, feats.shape[0] - 1))
    clip = feats[t0:t0 + clip_steps]
    if clip.shape[0] < clip_steps:
        clip = torch.cat([clip, clip[-1:].expand(clip_steps - clip.shape[0], -1)])
    return clip, torch.tensor(text)


class Net(nn.Module):
    def __init__(self, wv, feature_dim, hidden=256, embed=128):
        super().__init__()
        self.conv = nn.Conv1d(feature_dim, 2 * hidden, 3, padding=1)
        self.proj = nn.Linear(hidden, embed)
        self.words = nn.Embedding.from_pretrained(wv, freeze=True, padding_idx=0)
        self.fc1 = nn.Linear(wv.shape[1], hidden)
        self.fc2 = nn.Linear(hidden, embed)

    def video(self, x):
        return self.proj(F.glu(self.conv(x.transpose(1, 2)), dim=1).max(dim=2)[0])

    def text(self, tok):
        h = F.relu(self.fc1(self.words(tok)))
        h = h.masked_fill(~(tok > 0).unsqueeze(-1), 0).max(dim=1)[0]
        return self.fc2(h)

    def forward(self, clips, tok):  # as the reference: one forward returns both embeddings, so DDP's hooks arm
        return self.video(clips), self.text(tok.view(-1, tok.shape[-1]))


class AllGather(torch.autograd.Function):
    # Backward: sum the gradients across ranks, keep this rank's slice (torch.distributed.nn semantics).
    @staticmethod
    def forward(ctx, x):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g)
        return g[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def milnce(v, t):
    x = torch.matmul(v, t.t()).view(v.shape[0], v.shape[0], -1)
    nominator = torch.logsumexp((x * torch.eye(x.shape[0])[:, :, None]).sum(dim=1), dim=1)
    denominator = torch.logsumexp(torch.cat((x, x.permute(1, 0, 2)), dim=1).view(x.shape[0], -1), dim=1)
    return torch.mean(denominator - nominator)


def run(rank, world, args, port, q):
    peer_env.check_threads(torch)
    if args.backend == "dtrain":
        import dtrain  # noqa: F401  (python/: the torch.distributed backend)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    vocab, wv, videos, rate = load(args.data)
    torch.manual_seed(0)
    net = Net(wv, videos[0][0].shape[1])
    ddp = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.Adam([p for p in ddp.parameters() if p.requires_grad], lr=1e-3)
    total = args.steps + args.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, total // 10) if s < total // 10 else 0.5 * (1 + math.cos(math.pi * s / total)))
    rng = random.Random(rank)
    sampler = torch.utils.data.distributed.DistributedSampler(range(len(videos)), world, rank, drop_last=True)
    order = list(iter(sampler))

    def step(s):
        rows = [order[(s * args.batch + i) % len(order)] for i in range(args.batch)]
        clips, texts = zip(*(sample(videos[i], vocab, rate, args.candidates, 12, 8, 4.0, rng) for i in rows))
        v, t = ddp(torch.stack(clips), torch.stack(texts))
        if world > 1:
            v, t = AllGather.apply(v), AllGather.apply(t)
        loss = milnce(v, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    for s in range(args.warmup_steps):
        step(s)
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(args.steps):
        step(args.warmup_steps + s)
    dist.barrier()
    dt = (time.perf_counter() - t0) / args.steps
    if rank == 0:
        q.put(dt)
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("world", type=int)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--candidates", type=int, default=4)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "dtrain"])
    args = ap.parse_args()
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(args.world, args, peer_env.free_port(), q), nprocs=args.world)
    dt = q.get()
    print(f"torch-milnce world={args.world} batch_per_rank={args.batch} candidates={args.candidates} "
          f"ms_per_step={dt * 1e3:.1f} samples_per_s={args.world * args.batch / dt:.1f}"
          + (f" backend={args.backend}" if args.backend != "gloo" else ""))
