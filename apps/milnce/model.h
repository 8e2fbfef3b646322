// The MIL-NCE model: a video encoder over feature sequences and the reference's text encoder, both
// mapping into a joint D-dimensional space; and the MIL-NCE loss.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "milnce/s3dg.h"

namespace milnce {

struct ModelOptions {
  int64_t feature_dim = 64;
  int64_t hidden = 256;
  int64_t embed = 128;
  // Raw video (a gen-video data set): the video encoder is S3D-G (s3dg.h) at this width multiplier
  // (1.0: the reference's), its fc giving the embed-dimensional embedding.
  bool raw_video = false;
  double s3d_width = 0.25;
  // The text encoder's max over the words includes the padding's row, as the reference's
  // Sentence_Embedding does (set when starting from its trained weights: pretrained.h); false excludes it.
  bool reference_text = false;
};

// Video: features [B, T, F] -> gated temporal convolution (Conv1d to 2H channels, GLU) -> max over
// time -> Linear(H, D). A small stand-in for the reference's S3D over frames.
// Raw video (o.raw_video): frames [B, 3, T, H, W] uint8 (or float in [0, 1]) -> S3D-G -> [B, D]; its
// parameters are named "s3d.<the reference's name>".
struct VideoEncoderImpl : torch::nn::Module {
  explicit VideoEncoderImpl(const ModelOptions& o);
  at::Tensor forward(const at::Tensor& video);
  torch::nn::Conv1d conv{nullptr};
  torch::nn::Linear proj{nullptr};
  S3D s3d{nullptr};
};
TORCH_MODULE(VideoEncoder);

// Text, as the reference's Sentence_Embedding: frozen word vectors -> Linear(E, H) + ReLU -> max
// over the words (padding excluded; included with padding_in_max, as the reference) -> Linear(H, D).
// Token ids [B, W] (0 = padding).
struct TextEncoderImpl : torch::nn::Module {
  TextEncoderImpl(const at::Tensor& word_vectors, int64_t hidden, int64_t embed, bool padding_in_max = false);
  at::Tensor forward(const at::Tensor& tokens);
  torch::nn::Embedding words{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool padding_in_max;
};
TORCH_MODULE(TextEncoder);

struct MilNceNetImpl : torch::nn::Module {
  MilNceNetImpl(const at::Tensor& word_vectors, const ModelOptions& o);
  // video [B, T, F] -> [B, D], on the model's device (inputs are moved there)
  at::Tensor encodeVideo(const at::Tensor& video) { return video_enc->forward(video.to(device())); }
  // tokens [N, W] -> [N, D]
  at::Tensor encodeText(const at::Tensor& tokens) { return text_enc->forward(tokens.to(device())); }
  // Where the model's parameters are (model->to(device) moves them).
  c10::Device device() const { return text_enc->fc1->weight.device(); }
  VideoEncoder video_enc{nullptr};
  TextEncoder text_enc{nullptr};
};
TORCH_MODULE(MilNceNet);

// MIL-NCE (Miech et al. 2020), exactly as the reference computes it. video [B, D], text [B*K, D]
// where rows i*K .. i*K+K-1 are the K candidate captions of clip i:
//   x[i,j,k] = v_i . t_(j,k);  numerator_i = logsumexp_k x[i,i,k];
//   denominator_i = logsumexp of {x[i,j,k] for all j,k} together with {x[j,i,k] for all j,k};
//   loss = mean_i (denominator_i - numerator_i).
at::Tensor milNceLoss(const at::Tensor& video, const at::Tensor& text);

}  // namespace milnce
