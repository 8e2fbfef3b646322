#!/usr/bin/python3
"""Embeds, with the PyTorch port of the HowTo100M reference (benches/peers/s3dg_torch.py), the clips and
sentences that `milnce embed` embedded, and prints how far milnce's embeddings are from PyTorch's.

usage: pretrained_check.py STATE_DICT DICT_NPY CLIPS_NPY VIDEO_EMB_NPY SENTENCES_TXT TEXT_EMB_NPY [MAX_WORDS]

The model is built from the state_dict's shapes (S3D-G at width conv1_channels / 64, space to depth, its
text module), loaded strictly, in eval mode. Clips are uint8 [N, 3, T, S, S] fed as float / 255, as the
reference does. Sentences are tokenized as the reference's Sentence_Embedding._words_to_ids does:
re.findall(r"[\\w']+", sentence.lower()), words outside the dictionary dropped, word i of dict.npy is
token i + 1, zero-padded or cut to MAX_WORDS (16). Prints one line:
  video_max_abs_diff=... video_max_abs=... text_max_abs_diff=... text_max_abs=... rows=N,M
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benches", "peers"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import s3dg_torch  # noqa: E402


def tokenize(sentence, word_to_token, max_words):
    ids = [word_to_token[w] for w in re.findall(r"[\w']+", sentence.lower()) if w in word_to_token][:max_words]
    return ids + [0] * (max_words - len(ids))


def main():
    state_path, dict_path, clips_path, video_path, sentences_path, text_path = sys.argv[1:7]
    max_words = int(sys.argv[7]) if len(sys.argv) > 7 else 16
    state = torch.load(state_path)
    conv1 = state["conv1.conv1.weight"]
    model = s3dg_torch.S3D(num_classes=state["fc.weight"].shape[0], space_to_depth=conv1.shape[1] == 24,
                           width=conv1.shape[0] / 64, num_embeddings=state["text_module.word_embd.weight"].shape[0],
                           word_dim=state["text_module.word_embd.weight"].shape[1],
                           text_hidden=state["text_module.fc1.weight"].shape[0])
    model.load_state_dict(state, strict=True)
    model.eval()
    words = np.load(dict_path)
    word_to_token = {str(w): i + 1 for i, w in enumerate(words)}
    with open(sentences_path, encoding="utf-8") as f:
        sentences = [line.rstrip("\n") for line in f]
    tokens = torch.tensor([tokenize(s, word_to_token, max_words) for s in sentences], dtype=torch.int64)
    with torch.no_grad():
        clips = torch.from_numpy(np.load(clips_path)).float() / 255.0
        video = model(clips)["video_embedding"]
        text = model.text(tokens)
    got_video = torch.from_numpy(np.load(video_path))
    got_text = torch.from_numpy(np.load(text_path))
    assert got_video.shape == video.shape, (got_video.shape, video.shape)
    assert got_text.shape == text.shape, (got_text.shape, text.shape)
    print(f"video_max_abs_diff={(got_video - video).abs().max().item():.3g} video_max_abs={video.abs().max().item():.4g} "
          f"text_max_abs_diff={(got_text - text).abs().max().item():.3g} text_max_abs={text.abs().max().item():.4g} "
          f"rows={video.shape[0]},{text.shape[0]}")


if __name__ == "__main__":
    main()
