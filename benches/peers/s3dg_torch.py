"""S3D-G (Xie et al. 2018: separable 3-D convolutions with self-gating) in PyTorch, written to compute what the
HowTo100M reference model computes (antoine77340/S3D_HowTo100M, s3dg.py) and to carry its module and parameter
names, so `S3D().state_dict()` has the reference's keys and the reference's s3d_howto100m.pth loads into it:

    conv1, maxpool_2a, conv_2b, conv_2c, gating, maxpool_3a, mixed_3b, mixed_3c, maxpool_4a, mixed_4b..mixed_4f,
    maxpool_5a, mixed_5b, mixed_5c, fc [, text_module: word_embd, fc1, fc2]

It is the PyTorch side of apps/milnce's S3D-G (apps/milnce/s3dg.h): tests/milnce/s3dg_reference.py writes parity
fixtures with it and benches/peers/milnce_video_torch.py trains it. Additions over the reference, off by default:
a width multiplier (every channel count c becomes max(4, floor(c * width + 0.5))), a text module built only
when `num_embeddings` is given, and a `gating` flag that is honoured (the reference's is not: it overwrites
self.gating with the SelfGating module and never passes the flag to its inception blocks, so it always gates).

Works with torch 1.13 and 2.x; needs only torch.

    net = S3D(num_classes=512)                     # the reference's architecture
    net.load_state_dict(torch.load("s3d_howto100m.pth"), strict=False)   # strict: S3D(num_embeddings=66250)
    out = net(video)                               # video [B, 3, T, H, W] float in [0, 1]
    out["video_embedding"], out["mixed_5c"]        # [B, 512], [B, 1024]
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def scaled_channels(c, width):
    """One channel count of the architecture under the width multiplier."""
    return c if width == 1.0 else max(4, int(math.floor(c * width + 0.5)))


class STConv3D(nn.Module):
    """Conv3d (no bias) + BatchNorm3d + ReLU; separable: a 1 x k x k spatial then a k x 1 x 1 temporal one."""

    def __init__(self, input_dim, output_dim, kernel_size, stride=1, padding=0, separable=False):
        super().__init__()
        assert len(kernel_size) == 3
        self.separable = separable
        if separable:
            # The reference only ever builds separable convs with kernel [3, 3, 3], stride 1, padding 1.
            assert kernel_size[0] != 1, "separable needs a temporal kernel > 1"
            st = list(stride) if isinstance(stride, (list, tuple)) else [stride] * 3
            pd = list(padding) if isinstance(padding, (list, tuple)) else [padding] * 3
            self.conv1 = nn.Conv3d(input_dim, output_dim, [1, kernel_size[1], kernel_size[2]],
                                   stride=[1, st[1], st[2]], padding=[0, pd[1], pd[2]], bias=False)
            self.bn1 = nn.BatchNorm3d(output_dim)
            self.conv2 = nn.Conv3d(output_dim, output_dim, [kernel_size[0], 1, 1],
                                   stride=[st[0], 1, 1], padding=[pd[0], 0, 0], bias=False)
            self.bn2 = nn.BatchNorm3d(output_dim)
        else:
            self.conv1 = nn.Conv3d(input_dim, output_dim, list(kernel_size), stride=stride, padding=padding,
                                   bias=False)
            self.bn1 = nn.BatchNorm3d(output_dim)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        if self.separable:
            x = F.relu(self.bn2(self.conv2(x)))
        return x


class SelfGating(nn.Module):
    """x * sigmoid(fc(mean of x over T, H, W)), per channel."""

    def __init__(self, input_dim):
        super().__init__()
        self.fc = nn.Linear(input_dim, input_dim)

    def forward(self, x):
        w = torch.sigmoid(self.fc(x.mean(dim=[2, 3, 4])))
        return w[:, :, None, None, None] * x


class MaxPool3dTFPadding(nn.Module):
    """TensorFlow 'SAME' max pooling the way the reference does it: pad with zeros (not -inf: the inputs are
    ReLU outputs), pad_along = max(k - s, 0) per dimension with the smaller half first, then MaxPool3d with
    ceil_mode=True and no padding of its own."""

    def __init__(self, kernel_size, stride):
        super().__init__()
        self.kernel_size, self.stride = tuple(kernel_size), tuple(stride)
        pads = []  # (T, H, W) -> [before, after]
        for k, s in zip(kernel_size, stride):
            along = max(k - s, 0)
            pads.append((along // 2, along - along // 2))
        # F.pad order (last dimension first): W before/after, H before/after, T before/after. The reference
        # lists H's pair where W's belongs and W's where H's belongs; every kernel here has kH == kW and
        # sH == sW, so that is the same padding.
        self.padding_shape = (pads[2][0], pads[2][1], pads[1][0], pads[1][1], pads[0][0], pads[0][1])

    def forward(self, x):
        x = F.pad(x, self.padding_shape, mode="constant", value=0.0)
        return F.max_pool3d(x, self.kernel_size, self.stride, ceil_mode=True)


class InceptionBlock(nn.Module):
    def __init__(self, input_dim, num_outputs_0_0a, num_outputs_1_0a, num_outputs_1_0b, num_outputs_2_0a,
                 num_outputs_2_0b, num_outputs_3_0b, gating=True):
        super().__init__()
        self.conv_b0 = STConv3D(input_dim, num_outputs_0_0a, [1, 1, 1])
        self.conv_b1_a = STConv3D(input_dim, num_outputs_1_0a, [1, 1, 1])
        self.conv_b1_b = STConv3D(num_outputs_1_0a, num_outputs_1_0b, [3, 3, 3], padding=1, separable=True)
        self.conv_b2_a = STConv3D(input_dim, num_outputs_2_0a, [1, 1, 1])
        self.conv_b2_b = STConv3D(num_outputs_2_0a, num_outputs_2_0b, [3, 3, 3], padding=1, separable=True)
        self.maxpool_b3 = nn.MaxPool3d((3, 3, 3), stride=1, padding=1)  # torch's own padding: -inf
        self.conv_b3_b = STConv3D(input_dim, num_outputs_3_0b, [1, 1, 1])
        self.use_gating = gating
        self.output_dim = num_outputs_0_0a + num_outputs_1_0b + num_outputs_2_0b + num_outputs_3_0b
        if gating:
            self.gating_b0 = SelfGating(num_outputs_0_0a)
            self.gating_b1 = SelfGating(num_outputs_1_0b)
            self.gating_b2 = SelfGating(num_outputs_2_0b)
            self.gating_b3 = SelfGating(num_outputs_3_0b)

    def forward(self, x):
        b0 = self.conv_b0(x)
        b1 = self.conv_b1_b(self.conv_b1_a(x))
        b2 = self.conv_b2_b(self.conv_b2_a(x))
        b3 = self.conv_b3_b(self.maxpool_b3(x))
        if self.use_gating:
            b0, b1, b2, b3 = self.gating_b0(b0), self.gating_b1(b1), self.gating_b2(b2), self.gating_b3(b3)
        return torch.cat((b0, b1, b2, b3), dim=1)


class Sentence_Embedding(nn.Module):
    """The reference's text module on token ids: word_embd, ReLU(fc1) per word, max over the words (padding
    id 0 included: no mask, as the reference), fc2. [N, W] int64 -> [N, embd_dim]."""

    def __init__(self, embd_dim, num_embeddings=66250, word_embedding_dim=300, output_dim=2048):
        super().__init__()
        self.word_embd = nn.Embedding(num_embeddings, word_embedding_dim)
        self.fc1 = nn.Linear(word_embedding_dim, output_dim)
        self.fc2 = nn.Linear(output_dim, embd_dim)

    def forward(self, tokens):
        x = F.relu(self.fc1(self.word_embd(tokens)))
        return self.fc2(x.max(dim=1)[0])


# (b0, b1a, b1b, b2a, b2b, b3b) of each inception block, in order.
_MIXED = [
    ("mixed_3b", (64, 96, 128, 16, 32, 32)),
    ("mixed_3c", (128, 128, 192, 32, 96, 64)),
    ("mixed_4b", (192, 96, 208, 16, 48, 64)),
    ("mixed_4c", (160, 112, 224, 24, 64, 64)),
    ("mixed_4d", (128, 128, 256, 24, 64, 64)),
    ("mixed_4e", (112, 144, 288, 32, 64, 64)),
    ("mixed_4f", (256, 160, 320, 32, 128, 128)),
    ("mixed_5b", (256, 160, 320, 32, 128, 128)),
    ("mixed_5c", (384, 192, 384, 48, 128, 128)),
]


class S3D(nn.Module):
    def __init__(self, num_classes=512, gating=True, space_to_depth=True, width=1.0, num_embeddings=None,
                 word_dim=300, text_hidden=2048):
        super().__init__()
        ch = lambda c: scaled_channels(c, width)  # noqa: E731
        self.num_classes = num_classes
        self.use_gating = gating
        self.space_to_depth = space_to_depth
        self.width = width
        # Registration order follows the reference (state_dict key order).
        if space_to_depth:
            self.conv1 = STConv3D(24, ch(64), [2, 4, 4], stride=1, padding=(1, 2, 2))
        else:
            self.conv1 = STConv3D(3, ch(64), [3, 7, 7], stride=2, padding=(1, 3, 3))
        self.conv_2b = STConv3D(ch(64), ch(64), [1, 1, 1])
        self.conv_2c = STConv3D(ch(64), ch(192), [3, 3, 3], padding=1, separable=True)
        if gating:
            self.gating = SelfGating(ch(192))
        self.maxpool_2a = MaxPool3dTFPadding((1, 3, 3), (1, 2, 2))
        self.maxpool_3a = MaxPool3dTFPadding((1, 3, 3), (1, 2, 2))
        dim = ch(192)
        for name, outs in _MIXED:
            if name == "mixed_4b":
                self.maxpool_4a = MaxPool3dTFPadding((3, 3, 3), (2, 2, 2))
            if name == "mixed_5b":
                self.maxpool_5a = MaxPool3dTFPadding((2, 2, 2), (2, 2, 2))
            block = InceptionBlock(dim, *[ch(c) for c in outs], gating=gating)
            setattr(self, name, block)
            dim = block.output_dim
        self.fc = nn.Linear(dim, num_classes)
        if num_embeddings is not None:
            self.text_module = Sentence_Embedding(num_classes, num_embeddings, word_dim, text_hidden)

    @staticmethod
    def _space_to_depth(x):
        """[B, C, T, H, W] -> [B, 8C, T/2, H/2, W/2]; output channel ((dt * 2 + dh) * 2 + dw) * C + c."""
        B, C, T, H, W = x.shape
        x = x.view(B, C, T // 2, 2, H // 2, 2, W // 2, 2)
        x = x.permute(0, 3, 5, 7, 1, 2, 4, 6)
        return x.contiguous().view(B, 8 * C, T // 2, H // 2, W // 2)

    def forward(self, video):
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"S3D: video must be [B, 3, T, H, W], got {list(video.shape)}")
        x = video
        if self.space_to_depth:
            if any(d % 2 for d in x.shape[2:]):
                raise ValueError(f"S3D: space to depth needs even T, H, W, got {list(x.shape)}")
            x = self._space_to_depth(x)
        x = self.conv1(x)
        if self.space_to_depth:
            x = x[:, :, 1:, 1:, 1:]  # the reference's stand-in for TF 'SAME' padding of the [2, 4, 4] conv
        x = self.maxpool_2a(x)
        x = self.conv_2b(x)
        x = self.conv_2c(x)
        if self.use_gating:
            x = self.gating(x)
        x = self.maxpool_3a(x)
        x = self.mixed_3c(self.mixed_3b(x))
        x = self.maxpool_4a(x)
        for name in ("mixed_4b", "mixed_4c", "mixed_4d", "mixed_4e", "mixed_4f"):
            x = getattr(self, name)(x)
        x = self.maxpool_5a(x)
        x = self.mixed_5c(self.mixed_5b(x))
        pooled = x.mean(dim=[2, 3, 4])
        return {"video_embedding": self.fc(pooled), "mixed_5c": pooled}

    def text(self, tokens):
        """[N, W] int64 token ids -> [N, num_classes] (needs num_embeddings)."""
        return self.text_module(tokens)


def milnce_loss(video, text):
    """The reference's MILNCELoss. video [B, D], text [B * K, D] (the K candidates of clip i are rows
    i*K .. i*K+K-1). x[i, j, k] = <video_i, text_{j,k}>; per clip: logsumexp over x[i, :, :] and x[:, i, :]
    together minus logsumexp over its own candidates x[i, i, :]; mean over clips."""
    B = video.shape[0]
    x = torch.matmul(video, text.t()).view(B, B, -1)
    numerator = torch.logsumexp(torch.diagonal(x, dim1=0, dim2=1).t(), dim=1)  # x[i, i, :] -> [B, K]
    denominator = torch.logsumexp(torch.cat((x, x.permute(1, 0, 2)), dim=1).reshape(B, -1), dim=1)
    return torch.mean(denominator - numerator)
