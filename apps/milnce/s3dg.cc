// S3D-G (see s3dg.h). Layer by layer the reference's s3dg.py, so its state_dict loads by name.
#include "milnce/s3dg.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <cmath>

#include "dtrain/comm/error.h"

namespace milnce {

int64_t scaledChannels(int64_t channels, double width) {
  if (width == 1.0) return channels;
  return std::max<int64_t>(4, static_cast<int64_t>(std::floor(static_cast<double>(channels) * width + 0.5)));
}

namespace {

using K3 = std::array<int64_t, 3>;

torch::nn::Conv3d conv(int64_t in, int64_t out, std::array<int64_t, 3> k, std::array<int64_t, 3> s,
                       std::array<int64_t, 3> p) {
  return torch::nn::Conv3d(torch::nn::Conv3dOptions(in, out, {k[0], k[1], k[2]})
                               .stride({s[0], s[1], s[2]})
                               .padding({p[0], p[1], p[2]})
                               .bias(false));
}

}  // namespace

STConv3DImpl::STConv3DImpl(int64_t in, int64_t out, std::array<int64_t, 3> k, std::array<int64_t, 3> s,
                           std::array<int64_t, 3> p, bool separable_)
    : separable(separable_) {
  if (separable) {
    // The reference splits k x k x k into 1 x k x k (space) then k x 1 x 1 (time), strides and padding alike.
    conv1 = register_module("conv1", conv(in, out, {1, k[1], k[2]}, {1, s[1], s[2]}, {0, p[1], p[2]}));
    bn1 = register_module("bn1", torch::nn::BatchNorm3d(out));
    conv2 = register_module("conv2", conv(out, out, {k[0], 1, 1}, {s[0], 1, 1}, {p[0], 0, 0}));
    bn2 = register_module("bn2", torch::nn::BatchNorm3d(out));
  } else {
    conv1 = register_module("conv1", conv(in, out, k, s, p));
    bn1 = register_module("bn1", torch::nn::BatchNorm3d(out));
  }
}

at::Tensor STConv3DImpl::forward(const at::Tensor& x) {
  auto out = torch::relu(bn1->forward(conv1->forward(x)));
  if (separable) out = torch::relu(bn2->forward(conv2->forward(out)));
  return out;
}

SelfGatingImpl::SelfGatingImpl(int64_t dim) { fc = register_module("fc", torch::nn::Linear(dim, dim)); }

at::Tensor SelfGatingImpl::forward(const at::Tensor& x) {
  auto weights = torch::sigmoid(fc->forward(x.mean({2, 3, 4})));
  return weights.view({weights.size(0), weights.size(1), 1, 1, 1}) * x;
}

MaxPool3dTFPaddingImpl::MaxPool3dTFPaddingImpl(std::array<int64_t, 3> k, std::array<int64_t, 3> s)
    : kernel(k), stride(s) {
  // Per dimension (T, H, W): pad_along = max(k - s, 0), top = pad_along / 2, bottom = the rest; then, as
  // the reference orders them, the H and W pairs first and the T pair last.
  std::vector<int64_t> per_dim;
  for (int d = 0; d < 3; ++d) {
    const int64_t along = std::max<int64_t>(k[d] - s[d], 0);
    per_dim.push_back(along / 2);
    per_dim.push_back(along - along / 2);
  }
  pad = {per_dim[2], per_dim[3], per_dim[4], per_dim[5], per_dim[0], per_dim[1]};
}

at::Tensor MaxPool3dTFPaddingImpl::forward(const at::Tensor& x) {
  auto padded = torch::constant_pad_nd(x, pad, 0);
  return torch::max_pool3d(padded, {kernel[0], kernel[1], kernel[2]}, {stride[0], stride[1], stride[2]}, {0, 0, 0},
                           {1, 1, 1}, /*ceil_mode=*/true);
}

InceptionBlockImpl::InceptionBlockImpl(int64_t in, int64_t b0, int64_t b1a, int64_t b1b, int64_t b2a, int64_t b2b,
                                       int64_t b3b, bool gating_)
    : output_dim(b0 + b1b + b2b + b3b), gating(gating_) {
  conv_b0 = register_module("conv_b0", STConv3D(in, b0, K3{1, 1, 1}, K3{1, 1, 1}, K3{0, 0, 0}, false));
  conv_b1_a = register_module("conv_b1_a", STConv3D(in, b1a, K3{1, 1, 1}, K3{1, 1, 1}, K3{0, 0, 0}, false));
  conv_b1_b = register_module("conv_b1_b", STConv3D(b1a, b1b, K3{3, 3, 3}, K3{1, 1, 1}, K3{1, 1, 1}, true));
  conv_b2_a = register_module("conv_b2_a", STConv3D(in, b2a, K3{1, 1, 1}, K3{1, 1, 1}, K3{0, 0, 0}, false));
  conv_b2_b = register_module("conv_b2_b", STConv3D(b2a, b2b, K3{3, 3, 3}, K3{1, 1, 1}, K3{1, 1, 1}, true));
  conv_b3_b = register_module("conv_b3_b", STConv3D(in, b3b, K3{1, 1, 1}, K3{1, 1, 1}, K3{0, 0, 0}, false));
  if (gating) {
    gating_b0 = register_module("gating_b0", SelfGating(b0));
    gating_b1 = register_module("gating_b1", SelfGating(b1b));
    gating_b2 = register_module("gating_b2", SelfGating(b2b));
    gating_b3 = register_module("gating_b3", SelfGating(b3b));
  }
}

at::Tensor InceptionBlockImpl::forward(const at::Tensor& x) {
  auto b0 = conv_b0->forward(x);
  auto b1 = conv_b1_b->forward(conv_b1_a->forward(x));
  auto b2 = conv_b2_b->forward(conv_b2_a->forward(x));
  // maxpool_b3: MaxPool3d(3, stride 1, padding 1) (no parameters; -inf padding, as PyTorch pads it).
  auto b3 = conv_b3_b->forward(torch::max_pool3d(x, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}));
  if (gating) {
    b0 = gating_b0->forward(b0);
    b1 = gating_b1->forward(b1);
    b2 = gating_b2->forward(b2);
    b3 = gating_b3->forward(b3);
  }
  return torch::cat({b0, b1, b2, b3}, 1);
}

SentenceEmbeddingImpl::SentenceEmbeddingImpl(int64_t num_embeddings, int64_t word_dim, int64_t hidden, int64_t embed) {
  word_embd = register_module("word_embd", torch::nn::Embedding(num_embeddings, word_dim));
  fc1 = register_module("fc1", torch::nn::Linear(word_dim, hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, embed));
}

at::Tensor SentenceEmbeddingImpl::forward(const at::Tensor& tokens) {
  auto h = torch::relu(fc1->forward(word_embd->forward(tokens)));
  return fc2->forward(std::get<0>(h.max(1)));
}

S3DImpl::S3DImpl(const S3DOptions& o) : options(o) {
  DTRAIN_CHECK(o.width > 0 && o.width <= 4, dtrain::InvalidArgument,
               "S3D: width multiplier {} is not in (0, 4]", o.width);
  DTRAIN_CHECK(o.num_classes > 0, dtrain::InvalidArgument, "S3D: num_classes must be positive");
  auto ch = [&](int64_t c) { return scaledChannels(c, o.width); };
  if (o.space_to_depth)
    conv1 = register_module("conv1", STConv3D(24, ch(64), K3{2, 4, 4}, K3{1, 1, 1}, K3{1, 2, 2}, false));
  else
    conv1 = register_module("conv1", STConv3D(3, ch(64), K3{3, 7, 7}, K3{2, 2, 2}, K3{1, 3, 3}, false));
  conv_2b = register_module("conv_2b", STConv3D(ch(64), ch(64), K3{1, 1, 1}, K3{1, 1, 1}, K3{0, 0, 0}, false));
  conv_2c = register_module("conv_2c", STConv3D(ch(64), ch(192), K3{3, 3, 3}, K3{1, 1, 1}, K3{1, 1, 1}, true));
  if (o.gating) gating = register_module("gating", SelfGating(ch(192)));
  maxpool_2a = register_module("maxpool_2a", MaxPool3dTFPadding(K3{1, 3, 3}, K3{1, 2, 2}));
  maxpool_3a = register_module("maxpool_3a", MaxPool3dTFPadding(K3{1, 3, 3}, K3{1, 2, 2}));
  maxpool_4a = register_module("maxpool_4a", MaxPool3dTFPadding(K3{3, 3, 3}, K3{2, 2, 2}));
  maxpool_5a = register_module("maxpool_5a", MaxPool3dTFPadding(K3{2, 2, 2}, K3{2, 2, 2}));
  auto block = [&](const char* name, int64_t in, std::array<int64_t, 6> c) {
    return register_module(name, InceptionBlock(in, ch(c[0]), ch(c[1]), ch(c[2]), ch(c[3]), ch(c[4]), ch(c[5]), o.gating));
  };
  mixed_3b = block("mixed_3b", ch(192), {64, 96, 128, 16, 32, 32});
  mixed_3c = block("mixed_3c", mixed_3b->output_dim, {128, 128, 192, 32, 96, 64});
  mixed_4b = block("mixed_4b", mixed_3c->output_dim, {192, 96, 208, 16, 48, 64});
  mixed_4c = block("mixed_4c", mixed_4b->output_dim, {160, 112, 224, 24, 64, 64});
  mixed_4d = block("mixed_4d", mixed_4c->output_dim, {128, 128, 256, 24, 64, 64});
  mixed_4e = block("mixed_4e", mixed_4d->output_dim, {112, 144, 288, 32, 64, 64});
  mixed_4f = block("mixed_4f", mixed_4e->output_dim, {256, 160, 320, 32, 128, 128});
  mixed_5b = block("mixed_5b", mixed_4f->output_dim, {256, 160, 320, 32, 128, 128});
  mixed_5c = block("mixed_5c", mixed_5b->output_dim, {384, 192, 384, 48, 128, 128});
  fc = register_module("fc", torch::nn::Linear(mixed_5c->output_dim, o.num_classes));
  if (o.num_embeddings > 0)
    text_module = register_module(
        "text_module", SentenceEmbedding(o.num_embeddings, o.word_dim, o.text_hidden, o.num_classes));
}

S3DOutput S3DImpl::forward(const at::Tensor& video) {
  DTRAIN_CHECK(video.dim() == 5 && video.size(1) == 3, dtrain::InvalidArgument,
               "S3D: expected a video [B, 3, T, H, W], got {}", fmt::join(video.sizes(), "x"));
  at::Tensor net = video;
  if (options.space_to_depth) {
    const int64_t b = video.size(0), c = video.size(1), t = video.size(2), h = video.size(3), w = video.size(4);
    DTRAIN_CHECK(t % 2 == 0 && h % 2 == 0 && w % 2 == 0, dtrain::InvalidArgument,
                 "S3D: space to depth needs an even number of frames, height and width; got T={} H={} W={}", t, h, w);
    net = video.view({b, c, t / 2, 2, h / 2, 2, w / 2, 2})
              .permute({0, 3, 5, 7, 1, 2, 4, 6})
              .contiguous()
              .view({b, 8 * c, t / 2, h / 2, w / 2});
  }
  net = conv1->forward(net);
  if (options.space_to_depth) net = net.slice(2, 1).slice(3, 1).slice(4, 1);  // TensorFlow's "SAME" padding
  net = maxpool_2a->forward(net);
  net = conv_2b->forward(net);
  net = conv_2c->forward(net);
  if (options.gating) net = gating->forward(net);
  net = maxpool_3a->forward(net);
  net = mixed_3c->forward(mixed_3b->forward(net));
  net = maxpool_4a->forward(net);
  for (auto* m : {&mixed_4b, &mixed_4c, &mixed_4d, &mixed_4e, &mixed_4f}) net = (*m)->forward(net);
  net = maxpool_5a->forward(net);
  net = mixed_5c->forward(mixed_5b->forward(net));
  S3DOutput out;
  out.mixed_5c = net.mean({2, 3, 4});
  out.video_embedding = fc->forward(out.mixed_5c);
  return out;
}

}  // namespace milnce
