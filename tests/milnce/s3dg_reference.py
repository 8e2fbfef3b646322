#!/usr/bin/python3
"""Writes parity fixtures for the C++ S3D-G (apps/milnce/s3dg.h) from the PyTorch port of the HowTo100M
reference (benches/peers/s3dg_torch.py, same module and parameter names as antoine77340/S3D_HowTo100M s3dg.py).

usage: s3dg_reference.py OUT_DIR [--width 1.0] [--frames 8] [--size 32] [--seed 0] [--no-space-to-depth]
                         [--embed 512] [--vocab V | --dict-words FILE] [--word-dim 300 --text-hidden 2048]
                         [--literal-bn]

OUT_DIR gets:
  state_dict.pt         torch.save(model.state_dict()): the OrderedDict as is, like the reference's
                        s3d_howto100m.pth (BatchNorm num_batches_tracked included)
  clip.npy              float32 [1, 3, T, S, S], uniform in [0, 1)
  video_embedding.npy   float32 [1, embed]   (eval mode, float32, no grad)
  mixed_5c.npy          float32 [1, C]       mixed_5c averaged over T, H, W
  tokens.npy            int64 [4, 12], ids in 0..V, zero padding at the end   (with --vocab)
  text_embedding.npy    float32 [4, embed]                                    (with --vocab)
  dict.npy              the words of --dict-words FILE (one per line) as np.save(np.array(words)) writes them,
                        a '<U' array like the reference's s3d_dict.npy; the text module then has len(words) + 1
                        embeddings (word i is token i + 1)

Weights: S3D built after torch.manual_seed(seed); then every Conv3d weight is redrawn kaiming_normal (fan_in,
ReLU gain, the MIL-NCE reference's own 'kaiming_normal' init) and every BatchNorm gets weight U(0.5, 1.5),
bias N(0, 0.1), running_mean N(0, 0.1), running_var U(0.5, 1.5), so eval-mode BN is not the identity and the
output still depends on the clip. With torch's default conv init, or BN weights ~ N(0, 0.1) (--literal-bn),
the activations shrink layer by layer until the float32 output no longer depends on the clip at all (measured:
two different clips give bit-identical embeddings), and a parity test could not see a wrong space-to-depth
order, crop or flip. The printed `input_sensitivity` is |f(flip_W(clip)) - f(clip)| / |f(clip)| for the video
embedding: about 1e-3 with the default, versus about 2e-7 between float32 and float64 evaluation.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benches", "peers"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import s3dg_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-space-to-depth", action="store_true")
    ap.add_argument("--embed", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=None, help="V: build the text module with V + 1 embeddings")
    ap.add_argument("--dict-words", default=None, help="a word list (one per line): dict.npy, and --vocab its size")
    ap.add_argument("--word-dim", type=int, default=300)
    ap.add_argument("--text-hidden", type=int, default=2048)
    ap.add_argument("--literal-bn", action="store_true",
                    help="keep torch's conv init and draw BN weights from N(0, 0.1) (output ignores the clip)")
    args = ap.parse_args()
    if args.dict_words is not None:
        with open(args.dict_words, encoding="utf-8") as f:
            words = [w.rstrip("\r\n") for w in f]
        args.vocab = len(words)
        os.makedirs(args.out, exist_ok=True)
        np.save(os.path.join(args.out, "dict.npy"), np.array(words))
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)

    torch.manual_seed(args.seed)
    model = s3dg_torch.S3D(num_classes=args.embed, space_to_depth=not args.no_space_to_depth, width=args.width,
                           num_embeddings=None if args.vocab is None else args.vocab + 1, word_dim=args.word_dim,
                           text_hidden=args.text_hidden)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Conv3d) and not args.literal_bn:
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            elif isinstance(m, torch.nn.BatchNorm3d):
                if args.literal_bn:
                    m.weight.normal_(0.0, 0.1)
                else:
                    m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    model.eval()
    state = model.state_dict()
    torch.save(state, os.path.join(args.out, "state_dict.pt"))

    g = torch.Generator().manual_seed(args.seed)
    clip = torch.rand(1, 3, args.frames, args.size, args.size, generator=g, dtype=torch.float32)
    np.save(os.path.join(args.out, "clip.npy"), clip.numpy())
    with torch.no_grad():
        out = model(clip)
        flipped = model(clip.flip(-1))["video_embedding"]
    emb, mixed = out["video_embedding"], out["mixed_5c"]
    np.save(os.path.join(args.out, "video_embedding.npy"), emb.numpy().astype(np.float32))
    np.save(os.path.join(args.out, "mixed_5c.npy"), mixed.numpy().astype(np.float32))
    sensitivity = ((flipped - emb).norm() / emb.norm()).item()
    line = (f"s3dg_reference: keys={len(state)} width={args.width} frames={args.frames} size={args.size} "
            f"space_to_depth={int(not args.no_space_to_depth)} video_embedding_norm={emb.norm().item():.6g} "
            f"mixed_5c_norm={mixed.norm().item():.6g} input_sensitivity={sensitivity:.3g}")

    if args.vocab is not None:
        tokens = torch.randint(1, args.vocab + 1, (4, 12), generator=g, dtype=torch.int64)
        for i, n in enumerate((12, 9, 5, 1)):  # words per row; the rest is padding (id 0)
            tokens[i, n:] = 0
        np.save(os.path.join(args.out, "tokens.npy"), tokens.numpy())
        with torch.no_grad():
            text = model.text(tokens)
        np.save(os.path.join(args.out, "text_embedding.npy"), text.numpy().astype(np.float32))
        line += f" text_embedding_norm={text.norm().item():.6g}"
    print(line + f" seconds={time.perf_counter() - t_start:.2f}")


if __name__ == "__main__":
    main()
