#!/usr/bin/python3
"""The raw-video MIL-NCE job of apps/milnce (`milnce train --raw-video`) in PyTorch: the peer that dtrain's
raw-video path is measured against. DDP over gloo, one compute thread per rank (BLAS included), clips decoded
with PyAV in DataLoader worker processes (one thread each), S3D-G (benches/peers/s3dg_torch.py, width --width)
for the video, the text encoder of milnce_torch.py (frozen word vectors, Linear + ReLU, max over the words,
Linear), MIL-NCE on the all-gathered batch, Adam with warmup + cosine. Data: the directory `milnce gen-video`
writes (videos.csv and eval_videos.csv: video_id,video_file; captions/<id>.csv; vocab.txt; word2vec.npy;
meta.json).

usage: milnce_video_torch.py DATA_DIR WORLD [--batch 8] [--steps 20] [--warmup-steps 3] [--candidates 4]
                             [--frames 16] [--fps 10] [--size 64] [--width 0.25] [--embed 128] [--workers 2]

One sample follows the reference's HT100M_DataLoader (antoine77340/MIL-NCE_HowTo100M video_loader.py, crop_only
mode, random crop and flip) as milnce_torch.py implements its text side: caption index uniform, the K nearest
candidates, the span widened to 4 s, start and end truncated to whole seconds, start_seek = randint(start,
max(start, end - frames/fps)); then, decoding from start_seek, output frame k is the last decoded frame whose
time is <= start_seek + k/fps (exact rational comparison), zeros once that time is past the end of the video;
a size x size window at (floor((W - size) * aw), floor((H - size) * ah)), aw, ah ~ U[0, 1), flipped left-right
with probability 1/2; uint8 [3, T, S, S], fed to the model as float / 255. A file that fails to decode is
counted and another random video is used instead.

Prints on rank 0, over the timed steps (after the warmup steps):
  torch-milnce-video world=W batch=B size=S frames=T width=X clips_per_s=.. data_wait_share=.. step_ms=..
  decode_failures=N
clips_per_s = W * B / step time; data_wait_share = the share of the step time spent waiting for the batch
(mean over ranks); decode_failures = files that failed, over every batch consumed (warmup included), all ranks.
"""
import argparse, json, math, os, random, sys, time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peer_env, also when loaded by path (tests)
import peer_env  # noqa: F401  (before numpy and torch: one compute thread per rank, BLAS included)
import av
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from milnce_torch import AllGather, load_videos, load_words, milnce, nearest_candidates, tokenize
import s3dg_torch

MAX_WORDS = 12   # as milnce_torch.py
MIN_TIME = 4.0   # the reference's min_time
MAX_RETRIES = 100


def load(data_dir):
    vocab, wv = load_words(data_dir)
    videos = load_videos(data_dir, "video_file", lambda path: path)  # decoded by the workers
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    return vocab, wv, videos, meta


def decode_clip(path, start_seek, frames, fps, size, aw, ah, flip):
    """uint8 [3, frames, size, size]: frame k is the last frame with time <= start_seek + k / fps; zeros past the
    end of the video (the last frame lasts its duration, else 1 / the stream's average rate)."""
    targets = [Fraction(start_seek) + Fraction(k) / Fraction(fps) for k in range(frames)]
    chosen = [None] * frames  # av.VideoFrame per output frame, None: zeros
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1  # one thread per worker, as dtrain's decoder
        tb = stream.time_base
        if start_seek > 0:
            container.seek(int(Fraction(start_seek) / tb), stream=stream)  # the keyframe at or before start_seek
        prev, prev_t, j = None, None, 0
        for frame in container.decode(stream):
            if frame.pts is None:
                continue
            t = Fraction(frame.pts) * tb
            while j < frames and targets[j] < t:
                chosen[j] = prev if prev is not None else frame  # before the first frame: the first frame
                j += 1
            if j == frames:
                break
            prev, prev_t = frame, t
            dur = getattr(frame, "duration", None)  # PyAV >= 11 only
            prev_dur = (Fraction(dur) * tb if dur
                        else (1 / Fraction(stream.average_rate) if stream.average_rate else Fraction(0)))
        else:  # end of the stream: the last frame covers [prev_t, prev_t + its duration)
            if prev is None:
                raise ValueError(f"{path}: no frames decoded")
            while j < frames and targets[j] < prev_t + prev_dur:
                chosen[j] = prev
                j += 1
    clip = np.zeros((frames, size, size, 3), np.uint8)
    cache = {}
    for k, fr in enumerate(chosen):
        if fr is None:
            continue
        if id(fr) not in cache:
            img = fr.to_ndarray(format="rgb24")  # [H, W, 3]
            h, w = img.shape[:2]
            if w < size or h < size:
                raise ValueError(f"{path}: {w}x{h} frames are smaller than the {size}x{size} crop")
            x, y = int(math.floor((w - size) * aw)), int(math.floor((h - size) * ah))
            img = img[y:y + size, x:x + size]
            cache[id(fr)] = img[:, ::-1] if flip else img
        clip[k] = cache[id(fr)]
    return torch.from_numpy(np.ascontiguousarray(clip.transpose(3, 0, 1, 2)))


class ClipDataset(torch.utils.data.Dataset):
    def __init__(self, videos, vocab, args):
        self.videos, self.vocab, self.args = videos, vocab, args
        self.rng = random.Random(0)  # replaced per worker by worker_init

    def __len__(self):
        return len(self.videos)

    def sample(self, idx):
        a, rng = self.args, self.rng
        path, caps = self.videos[idx]
        ind = rng.randrange(len(caps))
        first = nearest_candidates(caps, ind, a.candidates) if a.candidates > 1 else ind
        text = [tokenize(caps[max(0, min(len(caps) - 1, first + i))][2], self.vocab, MAX_WORDS)
                for i in range(a.candidates)]
        start, end = caps[ind][0], caps[ind][1]
        if end - start < MIN_TIME:
            diff = MIN_TIME - end + start
            start = max(0.0, start - diff / 2)
            end = start + MIN_TIME
        start, end = int(start), int(end)
        start_seek = rng.randint(start, int(max(start, end - a.frames / a.fps)))
        aw, ah = rng.uniform(0, 1), rng.uniform(0, 1)
        flip = rng.uniform(0, 1) > 0.5
        clip = decode_clip(path, start_seek, a.frames, a.fps, a.size, aw, ah, flip)
        return clip, torch.tensor(text, dtype=torch.int64)

    def __getitem__(self, idx):
        failures = 0
        while True:
            try:
                clip, text = self.sample(idx)
                return clip, text, failures
            except Exception as e:  # a file that does not decode: count it, use another random video
                failures += 1
                if failures >= MAX_RETRIES:
                    raise RuntimeError(f"{failures} videos in a row failed to decode") from e
                idx = self.rng.randrange(len(self.videos))


def worker_init(worker_id):
    # The workers are spawned, not forked (mp.spawn's ranks default to spawn), so set everything here.
    torch.set_num_threads(1)
    av.logging.set_level(av.logging.FATAL)  # failures are counted, not logged
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = random.Random(info.seed)  # loader generator (seeded by rank) + worker id


class EndlessSampler(torch.utils.data.Sampler):
    """This rank's share of the videos (DistributedSampler, shuffled), epoch after epoch."""

    def __init__(self, n, world, rank):  # no super().__init__: its signature differs between torch 1.13 and 2.x
        self.inner = torch.utils.data.distributed.DistributedSampler(range(n), world, rank, shuffle=True,
                                                                     drop_last=n >= world)

    def __iter__(self):
        epoch = 0
        while True:
            self.inner.set_epoch(epoch)
            yield from iter(self.inner)
            epoch += 1


class Net(nn.Module):
    def __init__(self, wv, width, embed, hidden=256):
        super().__init__()
        self.video = s3dg_torch.S3D(num_classes=embed, width=width)  # gating, space to depth
        self.words = nn.Embedding.from_pretrained(wv, freeze=True, padding_idx=0)
        self.fc1 = nn.Linear(wv.shape[1], hidden)
        self.fc2 = nn.Linear(hidden, embed)

    def text(self, tok):  # milnce_torch.Net.text
        h = F.relu(self.fc1(self.words(tok)))
        h = h.masked_fill(~(tok > 0).unsqueeze(-1), 0).max(dim=1)[0]
        return self.fc2(h)

    def forward(self, clips, tok):  # one forward returns both embeddings, so DDP's hooks arm
        return self.video(clips)["video_embedding"], self.text(tok.view(-1, tok.shape[-1]))


def run(rank, world, args, port, q):
    peer_env.check_threads(torch)
    av.logging.set_level(av.logging.FATAL)  # failures are counted, not logged
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    vocab, wv, videos, _ = load(args.data)
    torch.manual_seed(0)
    net = Net(wv, args.width, args.embed)
    ddp = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.Adam([p for p in ddp.parameters() if p.requires_grad], lr=1e-3)
    total = args.steps + args.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, total // 10) if s < total // 10 else 0.5 * (1 + math.cos(math.pi * s / total)))
    dataset = ClipDataset(videos, vocab, args)
    dataset.rng = random.Random(1000 + rank)  # used as is with --workers 0
    extra = {"prefetch_factor": 2, "worker_init_fn": worker_init} if args.workers > 0 else {}
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, drop_last=True,
                                         sampler=EndlessSampler(len(videos), world, rank), num_workers=args.workers,
                                         generator=torch.Generator().manual_seed(1000 + rank), **extra)
    batches = iter(loader)

    def step():
        t0 = time.perf_counter()
        clips, text, failures = next(batches)
        wait = time.perf_counter() - t0
        v, t = ddp(clips.float() / 255.0, text)
        if world > 1:
            v, t = AllGather.apply(v), AllGather.apply(t)
        loss = milnce(v, t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        return wait, int(failures.sum()), loss.item()

    failures = 0
    for _ in range(args.warmup_steps):
        failures += step()[1]
    dist.barrier()
    waited = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        wait, fails, loss = step()
        waited += wait
        failures += fails
    dist.barrier()
    elapsed = time.perf_counter() - t0
    stats = torch.tensor([waited / elapsed, float(failures)], dtype=torch.float64)
    dist.all_reduce(stats)
    if rank == 0:
        q.put((elapsed / args.steps, stats[0].item() / world, int(stats[1].item()), loss))
    del batches  # stops the workers
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("world", type=int)
    ap.add_argument("--batch", type=int, default=8, help="clips per rank and step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--candidates", type=int, default=4)
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--fps", type=float, default=10.0)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--embed", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader decode processes per rank")
    args = ap.parse_args()
    if args.steps < 1 or args.batch < 1 or args.world < 1:
        sys.exit("milnce_video_torch: WORLD, --batch and --steps must be >= 1")
    if args.frames % 2 or args.size % 2:
        sys.exit("milnce_video_torch: space to depth needs an even --frames and --size")
    with open(os.path.join(args.data, "meta.json")) as f:
        meta = json.load(f)
    if "width" in meta and "height" in meta and min(meta["width"], meta["height"]) < args.size:
        sys.exit(f"milnce_video_torch: --size {args.size} is larger than the {meta['width']}x{meta['height']} videos")
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(args.world, args, peer_env.free_port(), q), nprocs=args.world)
    dt, wait_share, failures, _ = q.get()
    print(f"torch-milnce-video world={args.world} batch={args.batch} size={args.size} frames={args.frames} "
          f"width={args.width:g} clips_per_s={args.world * args.batch / dt:.2f} data_wait_share={wait_share:.3f} "
          f"step_ms={dt * 1e3:.1f} decode_failures={failures}")
