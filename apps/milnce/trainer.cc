// milnce::Trainer (train.h): one optimizer step of MIL-NCE, replicated (DDP) or sharded (ZeRO 2/3
// through one FullyShardedDataParallel per encoder: FSDP runs a Sequential's units in order on one
// input, and the two encoders take different inputs).
#include <torch/torch.h>

#include <fmt/format.h>

#include "dtrain/autograd.h"
#include "dtrain/comm/error.h"
#include "dtrain/hook_spec.h"
#include "dtrain/optim.h"
#include "dtrain/trace.h"
#include "dtrain/zero.h"
#include "milnce/train.h"

namespace milnce {

namespace {

// The trainable parameters (the word vectors are frozen) in groups: one for Adam (the reference
// recipe); for LAMB / LARS weight decay off biases and norm weights (dtrain/optim.h's decayGroups).
std::vector<torch::optim::OptimizerParamGroup> trainableGroups(torch::nn::Module& model, const TrainOptions& o) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (o.optimizer == "adam") {
    std::vector<at::Tensor> trainable;
    for (auto& p : model.parameters())
      if (p.requires_grad()) trainable.push_back(p);
    groups.emplace_back(trainable, std::make_unique<torch::optim::AdamOptions>(
                                       torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay)));
    return groups;
  }
  std::vector<torch::optim::OptimizerParamGroup> all;
  if (o.optimizer == "lamb") all = dtrain::optim::decayGroups(model, dtrain::optim::LambOptions(o.lr).weight_decay(o.weight_decay));
  else if (o.optimizer == "lars") all = dtrain::optim::decayGroups(model, dtrain::optim::LarsOptions(o.lr).weight_decay(o.weight_decay));
  else throw dtrain::InvalidArgument(fmt::format("--optimizer '{}': expected adam, lamb or lars", o.optimizer));
  for (const auto& g : all) {
    std::vector<at::Tensor> ps;
    for (const auto& p : g.params())
      if (p.requires_grad()) ps.push_back(p);
    if (!ps.empty()) groups.emplace_back(ps, g.options().clone());
  }
  return groups;
}

// Builds o.optimizer over groups (what ZeroRedundancyOptimizer calls for its rank's part too).
dtrain::ZeroRedundancyOptimizer::MakeOptimizer optimizerMaker(const TrainOptions& o) {
  return [o](std::vector<torch::optim::OptimizerParamGroup> groups) -> std::unique_ptr<torch::optim::Optimizer> {
    if (o.optimizer == "lamb")
      return std::make_unique<dtrain::optim::Lamb>(std::move(groups), dtrain::optim::LambOptions(o.lr).weight_decay(o.weight_decay));
    if (o.optimizer == "lars")
      return std::make_unique<dtrain::optim::Lars>(std::move(groups), dtrain::optim::LarsOptions(o.lr).weight_decay(o.weight_decay));
    return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
  };
}

// --zero N with the options it cannot be combined with.
void checkZeroOptions(const TrainOptions& o) {
  if (o.zero == 0) return;
  if (o.zero < 0 || o.zero > 3)
    throw dtrain::InvalidArgument(fmt::format("--zero {}: expected 0 (DDP), 1 (DDP with sharded optimizer state), 2 "
                                              "or 3 (FSDP)", o.zero));
  if (o.local_sgd > 0)
    throw dtrain::InvalidArgument(fmt::format("--zero {} and --local-sgd {}: local SGD needs every rank's whole "
                                              "parameters and optimizer (use --zero 0)", o.zero, o.local_sgd));
  if (o.zero == 1) return;  // DDP as it is (hooks and every optimizer too), the optimizer state sharded
  if (o.comm_hook != "none")
    throw dtrain::InvalidArgument(fmt::format("--zero {} and --comm-hook {}: FSDP reduce-scatters the gradients "
                                              "itself and takes no DDP comm hook (use --comm-hook none)", o.zero, o.comm_hook));
  if (o.optimizer != "adam")
    throw dtrain::InvalidArgument(fmt::format("--zero {} and --optimizer {}: the shards cut through parameters, so "
                                              "FSDP needs an elementwise optimizer (use --optimizer adam)", o.zero, o.optimizer));
}

// An encoder as the one unit of an FSDP instance, named `name` in it: its parameters' names and its
// checkpoint entries start with `name`.
template <typename Encoder>
std::unique_ptr<dtrain::FullyShardedDataParallel> shardEncoder(const Encoder& encoder, const std::string& name,
                                                               const TrainOptions& o, const dtrain::Distributed& dist) {
  torch::nn::Sequential seq;
  seq->push_back(std::string(name), torch::nn::AnyModule(encoder));
  dtrain::FsdpOptions fo;
  fo.stage = o.zero;
  fo.units = {1};
  fo.checkpoint_prefix = name;
  return std::make_unique<dtrain::FullyShardedDataParallel>(seq, dist.world(), fo);
}

}  // namespace

Trainer::Trainer(const dtrain::Distributed& dist, const Dataset& data, const TrainOptions& o, const Pretrained* init)
    : dist_(dist), o_(o), device_(dtrain::selectDevice(o.device, dist.localRank())) {
  checkZeroOptions(o);
  if (data.raw_video != o.model.raw_video)
    throw dtrain::InvalidArgument(
        data.raw_video ? fmt::format("{} is a raw video data set (milnce gen-video): train it with --raw-video", data.dir)
                       : fmt::format("--raw-video: {} is a feature data set (milnce gen-data), not videos", data.dir));
  ModelOptions mo = o.model;
  mo.feature_dim = data.feature_dim;
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  model_ = MilNceNet(data.word_vectors, mo);
  if (init) loadPretrained(model_, *init);  // every rank reads the same file
  model_->to(device_);  // before DDP or FSDP takes the parameters
  if (o.zero >= 2) {
    eval_model_ = MilNceNet(data.word_vectors, mo);
    eval_model_->to(device_);
    video_fsdp_ = shardEncoder(model_->video_enc, "video", o, dist);
    text_fsdp_ = shardEncoder(model_->text_enc, "text", o, dist);
    std::vector<at::Tensor> shards = video_fsdp_->shards();
    for (auto& t : text_fsdp_->shards()) shards.push_back(t);
    opt_ = std::make_unique<torch::optim::Adam>(shards, torch::optim::AdamOptions(o.lr).weight_decay(o.weight_decay));
    return;
  }
  dtrain::DDPOptions ddp_options;
  ddp_options.bucket_bytes = static_cast<size_t>(o.bucket_mb * (1 << 20));
  ddp_options.first_bucket_bytes = static_cast<size_t>(o.first_bucket_mb * (1 << 20));
  ddp_options.last_bucket_bytes = static_cast<size_t>(o.last_bucket_mb * (1 << 20));
  ddp_ = std::make_unique<dtrain::DistributedDataParallel>(model_.ptr(), dist.world(), ddp_options);
  if (auto hook = dtrain::makeCommHook(dtrain::parseCommHookSpec(o.comm_hook))) ddp_->registerCommHook(hook);
  if (o.local_sgd > 0 && o.comm_hook != "none") {
    throw dtrain::InvalidArgument(fmt::format("--local-sgd {} and --comm-hook {}: choose one (local SGD averages "
                                              "gradients within each machine only)", o.local_sgd, o.comm_hook));
  }
  if (o.zero == 1) {
    zero_ = std::make_unique<dtrain::ZeroRedundancyOptimizer>(trainableGroups(*model_, o), optimizerMaker(o), dist.world());
    return;
  }
  opt_ = optimizerMaker(o)(trainableGroups(*model_, o));
}

Trainer::~Trainer() = default;

void Trainer::enableLocalSgd(int64_t start) {
  if (o_.local_sgd <= 0) return;
  ddp_->registerCommHook(dtrain::postLocalSGDHook(dist_.local(), start));
  averager_ = std::make_unique<dtrain::PeriodicModelAverager>(dist_.world(), o_.local_sgd, start);
}

void Trainer::resumeAt(int64_t step) {
  if (averager_) averager_->setStep(step);
}

double Trainer::lossAndBackward(const Batch& local, bool sync) {
  const int64_t b = local.video.size(0), k = local.text.size(1), w = local.text.size(2);
  const at::Tensor video = local.video.to(device_);
  at::Tensor loss;
  {
    DTRAIN_SPAN("forward", "compute");  // on the timeline (DTRAIN_TIMELINE) and in flight-recorder dumps
    const auto tokens = local.text.reshape({b * k, w}).to(device_);
    auto v = sharded() ? video_fsdp_->forward(video) : model_->encodeVideo(video);  // [b, D]
    auto t = sharded() ? text_fsdp_->forward(tokens) : model_->encodeText(tokens);            // [b*K, D]
    auto& pg = *dist_.world();
    // Every rank scores its clips against every rank's captions; the gradient of the gathered
    // embeddings is summed across ranks and each rank keeps its own slice (AllGatherGrad::sum), so
    // with DDP's (FSDP's) averaging the update equals one process on the global batch.
    auto all_v = dtrain::allGather(v, pg);
    auto all_t = dtrain::allGather(t, pg);
    loss = milNceLoss(all_v, all_t) / o_.accum;
  }
  if (sync) {
    loss.backward();
  } else if (sharded()) {
    auto video_guard = video_fsdp_->noSync();
    auto text_guard = text_fsdp_->noSync();
    loss.backward();
  } else {
    auto guard = ddp_->noSync();
    loss.backward();
  }
  return loss.item<double>() * o_.accum;
}

void Trainer::optimizerStep(int64_t step, int64_t total, int64_t warmup_steps) {
  double lr = learningRate(o_.lr, step, total, warmup_steps);
  DTRAIN_SPAN("optimizer.step", "optim");
  if (zero_) {
    for (auto& g : zero_->paramGroups()) g.options().set_lr(lr);
    zero_->step();  // collective: each rank steps what it owns, then the owners' values reach everyone
    zero_->zeroGrad();
    return;
  }
  for (auto& g : opt_->param_groups()) g.options().set_lr(lr);
  opt_->step();
  if (averager_) averager_->averageParameters(model_->parameters());
  opt_->zero_grad();
}

torch::optim::Optimizer& Trainer::optimizer() { return zero_ ? zero_->local() : *opt_; }

dtrain::DistributedDataParallel::Stats Trainer::commStats() const {
  return ddp_ ? ddp_->lastStats() : dtrain::DistributedDataParallel::Stats{};
}

std::map<std::string, at::Tensor> Trainer::fullState() {
  std::map<std::string, at::Tensor> out;
  if (!sharded()) {
    for (const auto& item : model_->named_parameters())
      if (item.value().requires_grad()) out[item.key()] = item.value().detach().clone();
    return out;
  }
  // FSDP names a parameter by its place in its Sequential, whose one child is named as the encoder is
  // in MilNceNet ("video", "text"): the model's names.
  for (auto* f : {video_fsdp_.get(), text_fsdp_.get()})
    for (auto& [name, t] : f->fullState()) out[name] = t;
  return out;
}

namespace {
// A module's buffers by name, CPU copies.
std::map<std::string, at::Tensor> buffersOf(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().detach().to(torch::kCPU).clone();
  return out;
}
}  // namespace

MilNceNet& Trainer::evalModel() {
  if (!sharded()) return model_;
  const auto full = fullState();
  torch::NoGradGuard no_grad;
  auto params = eval_model_->named_parameters();
  for (const auto& [name, t] : full) {
    auto* p = params.find(name);
    DTRAIN_CHECK(p != nullptr, dtrain::InvalidArgument, "FSDP parameter '{}' is not one of MilNceNet's", name);
    p->copy_(t);
  }
  dtrain::CheckpointState buffers;  // S3D-G's BatchNorm statistics: this rank's
  buffers.model = buffersOf(*model_);
  buffers.restoreModel(*eval_model_, /*strict=*/false);
  return eval_model_;
}

void Trainer::captureTraining(dtrain::CheckpointState& s) const {
  if (!sharded()) {
    s.captureModel(*model_);
    if (zero_) zero_->captureSharded(s);
    else s.captureOptimizer(*opt_);
    return;
  }
  video_fsdp_->captureSharded(s, *opt_);
  text_fsdp_->captureSharded(s, *opt_);
  // Buffers (S3D-G's BatchNorm statistics) are not FSDP's: each rank's own, in its file.
  for (auto& [name, t] : buffersOf(*model_)) s.model[name] = t;
}

void Trainer::restoreTraining(const std::vector<dtrain::CheckpointState>& parts, const std::string& what) {
  DTRAIN_CHECK(!parts.empty(), dtrain::InvalidArgument, "{}: no saved state to resume from", what);
  // (The state says which --zero saved it: stage 1 writes "zero.param_groups", FSDP "video.param_groups".)
  const int saved = parts[0].sharded.count("zero.param_groups") ? 1 : parts[0].sharded.empty() ? 0 : 2;
  const int mine = o_.zero >= 2 ? 2 : o_.zero;
  DTRAIN_CHECK(saved == mine, dtrain::InvalidArgument, "{} was saved with --zero {}, this run has --zero {}: resume "
               "with the --zero it was saved with", what, saved == 2 ? "2 or 3" : std::to_string(saved), o_.zero);
  if (!sharded()) {
    parts[0].restoreModel(*model_);
    if (zero_) zero_->restoreSharded(parts, what);
    else parts[0].restoreOptimizer(*opt_);
    return;
  }
  video_fsdp_->restoreSharded(parts, *opt_, what);
  text_fsdp_->restoreSharded(parts, *opt_, what);
  // This rank's buffers (the only entries of an FSDP file's model), by name.
  const auto mine_part = static_cast<size_t>(dist_.rank());
  parts[mine_part < parts.size() ? mine_part : 0].restoreModel(*model_, /*strict=*/false);
}

}  // namespace milnce
