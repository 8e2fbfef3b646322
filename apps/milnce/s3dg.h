// S3D-G (Xie et al. 2018: separable 3-D convolutions with self-gating), the video encoder that MIL-NCE
// trains end to end from raw video, with the module and parameter names of the HowTo100M reference
// (antoine77340/S3D_HowTo100M, s3dg.py), so a state_dict the reference's PyTorch model saved loads by
// name (dtrain::loadStateDict), the official pretrained s3d_howto100m.pth included:
//   conv1, maxpool_2a, conv_2b, conv_2c, gating, maxpool_3a, mixed_3b, mixed_3c, maxpool_4a,
//   mixed_4b..mixed_4f, maxpool_5a, mixed_5b, mixed_5c, fc [, text_module: word_embd, fc1, fc2]
// STConv3D: conv1 + bn1 (+ conv2 + bn2 when separable: a 1xkxk spatial then a kx1x1 temporal
// convolution), each followed by ReLU. InceptionBlock: conv_b0, conv_b1_a, conv_b1_b, conv_b2_a,
// conv_b2_b, maxpool_b3, conv_b3_b and gating_b0..gating_b3. SelfGating: fc.
//
// \code
//   milnce::S3DOptions o;                     // the reference: 512-d, gating, space to depth, full width
//   milnce::S3D net(o);
//   dtrain::loadStateDict(*net, "s3d_howto100m.pth");   // o.num_embeddings = 66250 for its text module
//   net->eval();
//   auto out = net->forward(clip);             // clip [B, 3, T, H, W] float in [0, 1]
//   at::Tensor emb = out.video_embedding;      // [B, 512]
// \endcode
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <vector>

namespace milnce {

struct S3DOptions {
  int64_t num_classes = 512;  // the video embedding's dimension (fc's outputs)
  bool gating = true;         // self-gating after conv_2c and on every inception branch (S3D-G)
  // The reference's TPU trick: [B,3,T,H,W] -> [B,24,T/2,H/2,W/2] before a [2,4,4] conv1 (T, H, W even).
  // Off: conv1 is the paper's [3,7,7] stride 2 on 3 channels.
  bool space_to_depth = true;
  // Width multiplier for small runs: every channel count c of the architecture becomes
  // max(4, floor(c * width + 0.5)) (c itself at 1.0, the only width the pretrained file fits).
  double width = 1.0;
  // A text module (the reference's Sentence_Embedding) when > 0: word_embd [num_embeddings, word_dim],
  // fc1 word_dim -> text_hidden, fc2 text_hidden -> num_classes. The reference: 66250, 300, 2048.
  int64_t num_embeddings = 0;
  int64_t word_dim = 300;
  int64_t text_hidden = 2048;
};

// One channel count scaled by the width multiplier (see S3DOptions::width).
int64_t scaledChannels(int64_t channels, double width);

struct STConv3DImpl : torch::nn::Module {
  STConv3DImpl(int64_t in, int64_t out, std::array<int64_t, 3> kernel, std::array<int64_t, 3> stride,
               std::array<int64_t, 3> padding, bool separable);
  at::Tensor forward(const at::Tensor& x);
  bool separable;
  torch::nn::Conv3d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm3d bn1{nullptr}, bn2{nullptr};
};
TORCH_MODULE(STConv3D);

struct SelfGatingImpl : torch::nn::Module {
  explicit SelfGatingImpl(int64_t dim);
  at::Tensor forward(const at::Tensor& x);  // x * sigmoid(fc(mean over T, H, W))
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SelfGating);

// TensorFlow's "SAME" max pooling as the reference does it: zero padding (pad_along = max(k - s, 0),
// the smaller half first), then MaxPool3d with ceil_mode. No parameters.
struct MaxPool3dTFPaddingImpl : torch::nn::Module {
  MaxPool3dTFPaddingImpl(std::array<int64_t, 3> kernel, std::array<int64_t, 3> stride);
  at::Tensor forward(const at::Tensor& x);
  std::array<int64_t, 3> kernel, stride;
  std::vector<int64_t> pad;  // F.pad order: W left, W right, H top, H bottom, T front, T back
};
TORCH_MODULE(MaxPool3dTFPadding);

struct InceptionBlockImpl : torch::nn::Module {
  // The six channel counts of the reference's constructor (after scaling).
  InceptionBlockImpl(int64_t in, int64_t b0, int64_t b1a, int64_t b1b, int64_t b2a, int64_t b2b, int64_t b3b,
                     bool gating);
  at::Tensor forward(const at::Tensor& x);
  int64_t output_dim;
  bool gating;
  STConv3D conv_b0{nullptr}, conv_b1_a{nullptr}, conv_b1_b{nullptr}, conv_b2_a{nullptr}, conv_b2_b{nullptr},
      conv_b3_b{nullptr};
  SelfGating gating_b0{nullptr}, gating_b1{nullptr}, gating_b2{nullptr}, gating_b3{nullptr};
};
TORCH_MODULE(InceptionBlock);

// The reference's Sentence_Embedding on token ids (its tokenizer is milnce::tokenize): word_embd, then
// ReLU(fc1) on every token, max over the words (padding included, as the reference), fc2.
struct SentenceEmbeddingImpl : torch::nn::Module {
  SentenceEmbeddingImpl(int64_t num_embeddings, int64_t word_dim, int64_t hidden, int64_t embed);
  at::Tensor forward(const at::Tensor& tokens);  // [N, W] int64 -> [N, embed]
  torch::nn::Embedding word_embd{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(SentenceEmbedding);

struct S3DOutput {
  at::Tensor video_embedding;  // [B, num_classes]
  at::Tensor mixed_5c;         // [B, C]: mixed_5c averaged over time and space
};

struct S3DImpl : torch::nn::Module {
  explicit S3DImpl(const S3DOptions& o = {});
  // video [B, 3, T, H, W] float (the reference feeds uint8 frames / 255). InvalidArgument on another rank,
  // channel count, or (space to depth) an odd T, H or W.
  S3DOutput forward(const at::Tensor& video);
  S3DOptions options;
  STConv3D conv1{nullptr}, conv_2b{nullptr}, conv_2c{nullptr};
  SelfGating gating{nullptr};
  MaxPool3dTFPadding maxpool_2a{nullptr}, maxpool_3a{nullptr}, maxpool_4a{nullptr}, maxpool_5a{nullptr};
  InceptionBlock mixed_3b{nullptr}, mixed_3c{nullptr}, mixed_4b{nullptr}, mixed_4c{nullptr}, mixed_4d{nullptr},
      mixed_4e{nullptr}, mixed_4f{nullptr}, mixed_5b{nullptr}, mixed_5c{nullptr};
  torch::nn::Linear fc{nullptr};
  SentenceEmbedding text_module{nullptr};  // when options.num_embeddings > 0
};
TORCH_MODULE(S3D);

}  // namespace milnce
