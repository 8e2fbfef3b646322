// MIL-NCE model and loss (see model.h).
#include "milnce/model.h"

#include <torch/torch.h>

namespace milnce {

VideoEncoderImpl::VideoEncoderImpl(const ModelOptions& o) {
  if (o.raw_video) {
    S3DOptions so;
    so.num_classes = o.embed;
    so.width = o.s3d_width;
    s3d = register_module("s3d", S3D(so));
    return;
  }
  conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(o.feature_dim, 2 * o.hidden, 3).padding(1)));
  proj = register_module("proj", torch::nn::Linear(o.hidden, o.embed));
}

at::Tensor VideoEncoderImpl::forward(const at::Tensor& video) {
  if (s3d) {
    // The reference feeds video.float() / 255 (decoded frames stay uint8 until here: 4x less to move).
    const at::Tensor x = video.scalar_type() == at::kByte ? video.to(at::kFloat).div_(255.0) : video;
    return s3d->forward(x).video_embedding;
  }
  auto h = conv->forward(video.transpose(1, 2));        // [B, 2H, T]
  h = torch::glu(h, /*dim=*/1);                         // gating: a * sigmoid(b)
  h = std::get<0>(h.max(/*dim=*/2));                    // max over time
  return proj->forward(h);
}

TextEncoderImpl::TextEncoderImpl(const at::Tensor& word_vectors, int64_t hidden, int64_t embed, bool padding_in_max)
    : padding_in_max(padding_in_max) {
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
  // Linear + ReLU act on each word alone and the word vectors are frozen, so they are computed once
  // per distinct word of the batch and gathered: the same function as applying them to every token
  // (as the reference does), at a fraction of the cost (a batch of 128 captions x 12 words holds a
  // few hundred distinct words; this layer was half of a training step).
  auto [distinct, where] = at::_unique(tokens.reshape(-1), /*sorted=*/false, /*return_inverse=*/true);
  // Max over real words only: padding (id 0) contributes zeros, which never win a max of ReLU outputs
  // (>= 0) and make a caption with no known word embed as zeros. Zeroing the padding row among the
  // distinct words costs nothing, unlike masking every token. The reference keeps it (padding_in_max):
  // its padding row goes through fc1 like a word.
  auto per_word = torch::relu(fc1->forward(words->forward(distinct)));  // [U, H]
  if (!padding_in_max) per_word = per_word * (distinct != 0).unsqueeze(1);
  auto h = per_word.index_select(0, where).view({tokens.size(0), tokens.size(1), -1});  // [N, W, H]
  return fc2->forward(std::get<0>(h.max(/*dim=*/1)));
}

MilNceNetImpl::MilNceNetImpl(const at::Tensor& word_vectors, const ModelOptions& o) {
  video_enc = register_module("video", VideoEncoder(o));
  text_enc = register_module("text", TextEncoder(word_vectors, o.hidden, o.embed, o.reference_text));
}

at::Tensor milNceLoss(const at::Tensor& video, const at::Tensor& text) {
  const int64_t b = video.size(0);
  auto x = torch::matmul(video, text.t()).view({b, b, -1});          // [B, B, K]
  auto numerator = torch::logsumexp(x.diagonal(0, 0, 1).t(), 1);      // diagonal -> [K, B] -> [B, K]
  auto denominator = torch::logsumexp(torch::cat({x, x.permute({1, 0, 2})}, 1).view({b, -1}), 1);
  return (denominator - numerator).mean();
}

}  // namespace milnce
