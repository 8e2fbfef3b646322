// MIL-NCE model and loss (see model.h).
#include "milnce/model.h"

#include <torch/torch.h>

namespace milnce {

VideoEncoderImpl::VideoEncoderImpl(int64_t feature_dim, int64_t hidden, int64_t embed) {
  conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(feature_dim, 2 * hidden, 3).padding(1)));
  proj = register_module("proj", torch::nn::Linear(hidden, embed));
}

at::Tensor VideoEncoderImpl::forward(const at::Tensor& video) {
  auto h = conv->forward(video.transpose(1, 2));        // [B, 2H, T]
  h = torch::glu(h, /*dim=*/1);                         // gating: a * sigmoid(b)
  h = std::get<0>(h.max(/*dim=*/2));                    // max over time
  return proj->forward(h);
}

TextEncoderImpl::TextEncoderImpl(const at::Tensor& word_vectors, int64_t hidden, int64_t embed) {
  words = register_module("words", torch::nn::Embedding(torch::nn::EmbeddingOptions(word_vectors.size(0),
                                                                                    word_vectors.size(1))
                                                            .padding_idx(0)));
  {
    torch::NoGradGuard g;
    words->weight.copy_(word_vectors);
  }
  words->weight.set_requires_grad(false);  // frozen, like the reference's word2vec
  fc1 = register_module("fc1", torch::nn::Linear(word_vectors.size(1), hidden));
  fc2 = register_module("fc2", torch::nn::Linear(hidden, embed));
}

at::Tensor TextEncoderImpl::forward(const at::Tensor& tokens) {
  auto h = torch::relu(fc1->forward(words->forward(tokens)));  // [N, W, H]
  // Max over real words only; a caption with no known word embeds as zeros (ReLU outputs are >= 0).
  auto mask = (tokens > 0).unsqueeze(-1);
  h = std::get<0>(h.masked_fill(~mask, 0).max(/*dim=*/1));
  return fc2->forward(h);
}

MilNceNetImpl::MilNceNetImpl(const at::Tensor& word_vectors, const ModelOptions& o) {
  video_enc = register_module("video", VideoEncoder(o.feature_dim, o.hidden, o.embed));
  text_enc = register_module("text", TextEncoder(word_vectors, o.hidden, o.embed));
}

at::Tensor milNceLoss(const at::Tensor& video, const at::Tensor& text) {
  const int64_t b = video.size(0);
  auto x = torch::matmul(video, text.t()).view({b, b, -1});          // [B, B, K]
  auto numerator = torch::logsumexp(x.diagonal(0, 0, 1).t(), 1);      // diagonal -> [K, B] -> [B, K]
  auto denominator = torch::logsumexp(torch::cat({x, x.permute({1, 0, 2})}, 1).view({b, -1}), 1);
  return (denominator - numerator).mean();
}

}  // namespace milnce
