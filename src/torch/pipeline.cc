// Pipeline parallelism (see pipeline.h): the executor that runs one stage's schedule
// (pipeline_schedule.cc), its messages going through pipeline_channels.h's channels.
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>

#include "comm/trace/trace_internal.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/pipeline.h"
#include "dtrain/tensor.h"
#include "errors.h"
#include "pipeline_channels.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

using Ch = detail::PipelineChannels;

double pipeMsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) : 0;
}

using detail::errorText;
using detail::shapeText;
using detail::rethrowWithContext;

}  // namespace

struct Pipeline::Impl {
  std::vector<std::vector<torch::nn::AnyModule>> mods;  // per chunk
  torch::nn::Sequential all;                            // every chunk's modules (module())
  std::shared_ptr<comm::ProcessGroup> pg;
  PipelineOptions opts;
  int stage = 0, stages = 1, V = 1;
  int64_t step_no = 0;
  c10::optional<c10::ScalarType> param_dtype;  // of the first floating parameter, to check inputs
  c10::optional<c10::Device> device;           // of that parameter: where received activations go
  DistributedDataParallel* ddp = nullptr;
  FullyShardedDataParallel* fsdp = nullptr;
  PipelineStats stats;               // of the last step(), or of the forward() under way
  std::vector<PipelineSpan> spans;
  PipelineStats forward_stats;       // of the last forward()
  std::vector<PipelineSpan> forward_spans;

  // What this stage keeps of one micro-batch of one chunk between its forward and its backward.
  struct Micro {
    at::Tensor input;   // requires grad past the first virtual stage (its gradient goes back)
    at::Tensor output;  // the chunk's output, or the weighted loss on the last virtual stage
    int64_t bytes = 0;
  };
  std::vector<Micro> micro;  // chunk * M + micro-batch
  int64_t stored_bytes = 0;
  Ch channels;

  int next() const { return (stage + 1) % stages; }
  int prev() const { return (stage + stages - 1) % stages; }
  bool firstVirtual(int c) const { return stage == 0 && c == 0; }
  bool lastVirtual(int c) const { return stage == stages - 1 && c == V - 1; }
  Micro& slot(int c, int m) { return micro[static_cast<size_t>(c * opts.micro_batches + m)]; }

  // The timeline's event for micro-batch m's forward or backward on this stage, from t0 to now.
  void traceMicro(const char* what, int m, int c, Clock::time_point t0) const {
    namespace timeline = comm::trace::timeline;
    if (timeline::on())
      timeline::span(what, m, "pipeline", comm::trace::usOf(t0), comm::trace::nowUs(), {"stage", stage},
                     {"step", step_no}, {"chunk", c});
  }

  // "pipeline stage 1/3 step 4: forward of micro-batch 2 (input Double [4, 16] from rank 0): "
  std::string where(const char* what, int m, int c, const std::string& detail = {}) const {
    std::string s = fmt::format("pipeline stage {}/{} step {}: {}", stage, stages, step_no, what);
    if (m >= 0) s += fmt::format(" of micro-batch {}", m);
    if (c >= 0 && V > 1) s += fmt::format(" on chunk {}", c);
    if (!detail.empty()) s += " (" + detail + ")";
    return s + ": ";
  }

  // Chunk c's modules one by one, so that the bytes of what they produce can be counted.
  at::Tensor runModules(int c, at::Tensor x, int64_t& bytes) {
    // A received activation arrives on the host: onto the stage's device, differentiably (its gradient
    // then comes back to the host tensor, which is sent on).
    if (device && x.device() != *device) x = x.to(*device);
    if (fsdp != nullptr) {  // the sharded stage gathers each unit's parameters as it runs it
      x = fsdp->forward(x);
      bytes += tensorBytes(x);
      return x;
    }
    for (auto& mod : mods[static_cast<size_t>(c)]) {
      x = mod.forward(x);
      bytes += tensorBytes(x);
    }
    return x;
  }

  void noteStored(int delta, int64_t bytes) {
    stats.stored_activations += delta;
    stored_bytes += bytes;
    if (stats.stored_activations > stats.peak_stored_activations)
      stats.peak_stored_activations = stats.stored_activations;
    stats.peak_activation_bytes = std::max(stats.peak_activation_bytes, stored_bytes);
  }

  void beginStep() {
    ++step_no;
    stats.forward_ms = stats.backward_ms = stats.comm_ms = stats.step_ms = 0;
    stats.peak_stored_activations = stats.stored_activations = 0;
    stats.peak_activation_bytes = stored_bytes = 0;
    spans.clear();
    micro.assign(static_cast<size_t>(opts.micro_batches * V), Micro{});
    channels.beginStep(step_no);
  }

  // Tells the pipeline peers why this rank stops (they fail promptly with the message instead of
  // timing out), then rethrows with where it happened.
  [[noreturn]] void fail(const std::string& context) {
    std::string msg;  // the abort prefixes "[rank r] " itself
    try {
      throw;
    } catch (const std::exception& e) {
      msg = context + errorText(e);
    }
    micro.clear();
    channels.dropKept();
    stats.stored_activations = 0;
    // Every abort is issued before any is waited for: one behind a send that its receiver has not
    // taken yet runs once that receiver learns of this failure through another.
    std::vector<comm::WorkPtr> aborts{pg->abort(msg)};
    channels.abortAll(msg, aborts);
    for (auto& w : aborts) {
      try {
        w->wait();
      } catch (const std::exception&) {
        // Expected: the abort op fails with msg by design (or the group had failed already).
      }
    }
    rethrowWithContext(fmt::format("[rank {}] {}", pg->rank(), context));
  }

  std::vector<at::Tensor> splitRows(const at::Tensor& t, const char* what) {
    DTRAIN_CHECK(t.defined() && t.dim() >= 1, InvalidArgument, "the {} must be a tensor with a batch dimension",
                 what);
    DTRAIN_CHECK(t.size(0) >= opts.micro_batches, InvalidArgument, "the {} has {} rows, fewer than the {} micro-batches",
                 what, t.size(0), opts.micro_batches);
    return at::tensor_split(t, opts.micro_batches, 0);
  }

  // The input of chunk c's forward of micro-batch m: the batch's rows, or the activation of the virtual
  // stage before (rank prev's chunk c, or for rank 0 the last rank's chunk c - 1).
  at::Tensor forwardInput(int c, int m, Ch::Mode mode, const std::vector<at::Tensor>& inputs) {
    if (firstVirtual(c)) return inputs[static_cast<size_t>(m)];
    return channels.receive(prev(), Ch::kActivation, c, m, mode, stats.comm_ms);
  }
  // Where chunk c's output goes: rank next's chunk c, or from the last rank rank 0's chunk c + 1.
  int outputChunk(int c) const { return stage == stages - 1 ? c + 1 : c; }
  int inputChunk(int c) const { return stage == 0 ? c - 1 : c; }

  struct Batch {
    const std::vector<at::Tensor>& inputs;
    const std::vector<at::Tensor>& targets;
    const LossFn& loss_fn;
    double rows;
    double loss_sum = 0;
  };

  void runForward(const PipelineAction& a, Batch& b, std::string& detail, Clock::time_point t_step) {
    const int c = a.chunk, m = a.micro;
    Micro& mb = slot(c, m);
    mb.input = forwardInput(c, m, Ch::kStepMode, b.inputs);
    if (!firstVirtual(c)) {
      if (at::isFloatingType(mb.input.scalar_type())) mb.input.requires_grad_(true);
      detail = fmt::format("input {} {} from rank {}", c10::toString(mb.input.scalar_type()),
                           shapeText(mb.input.sizes()), prev());
    }
    const auto t0 = Clock::now();
    mb.bytes = tensorBytes(mb.input);
    at::Tensor out = runModules(c, mb.input, mb.bytes);
    if (lastVirtual(c)) {
      const at::Tensor& t = b.targets[static_cast<size_t>(m)];
      DTRAIN_CHECK(out.dim() >= 1 && out.size(0) == t.size(0), InvalidArgument,
                   "output of shape {} does not match its {} target rows (the batch has {} rows)",
                   shapeText(out.sizes()), t.size(0), static_cast<int64_t>(b.rows));
      at::Tensor l = b.loss_fn(out, t);
      DTRAIN_CHECK(l.defined() && l.numel() == 1, InvalidArgument, "the loss function must return a scalar, got shape {}",
                   l.defined() ? shapeText(l.sizes()) : "undefined");
      // Mean over the micro-batch's rows, weighted by its share of the batch: the batch mean.
      mb.output = l.reshape({}) * (static_cast<double>(t.size(0)) / b.rows);
      b.loss_sum += mb.output.item<double>();
    } else {
      mb.output = out;
      channels.send(next(), Ch::kActivation, outputChunk(c), m, Ch::kStepMode, out);
    }
    noteStored(1, mb.bytes);
    traceMicro("pipeline fwd mb=", m, c, t0);
    stats.forward_ms += pipeMsSince(t0);
    spans.push_back({'F', m, std::chrono::duration<double, std::milli>(t0 - t_step).count(), pipeMsSince(t_step), c});
  }

  void runBackward(const PipelineAction& a, bool last_action, Clock::time_point t_step) {
    const int c = a.chunk, m = a.micro;
    Micro& mb = slot(c, m);
    at::Tensor grad;
    if (!lastVirtual(c)) grad = channels.receive(next(), Ch::kGradient, c, m, Ch::kStepMode, stats.comm_ms);
    const auto t0 = Clock::now();
    if (mb.output.requires_grad()) {
      auto run = [&] {
        if (lastVirtual(c)) mb.output.backward();
        else mb.output.backward(grad.to(mb.output.device()));
      };
      if (ddp != nullptr && !last_action) {
        auto guard = ddp->noSync();
        run();
      } else if (fsdp != nullptr && !last_action) {
        auto guard = fsdp->noSync();
        run();
      } else {
        run();
      }
    }
    if (!firstVirtual(c)) {
      at::Tensor gx = mb.input.grad();
      channels.send(prev(), Ch::kGradient, inputChunk(c), m, Ch::kStepMode, gx.defined() ? gx : at::zeros_like(mb.input));
    }
    noteStored(-1, -mb.bytes);
    mb = Micro{};
    traceMicro("pipeline bwd mb=", m, c, t0);
    stats.backward_ms += pipeMsSince(t0);
    spans.push_back({'B', m, std::chrono::duration<double, std::milli>(t0 - t_step).count(), pipeMsSince(t_step), c});
  }

  double step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn) {
    beginStep();
    // Bad arguments abort the group too: the other stages would wait for this one otherwise.
    std::vector<at::Tensor> inputs, targets;
    try {
      if (stage == 0) inputs = splitRows(input, "input");
      if (stage == stages - 1) {
        DTRAIN_CHECK(static_cast<bool>(loss_fn), InvalidArgument, "no loss function");
        targets = splitRows(target, "target");
      }
    } catch (...) {
      fail(where("arguments", -1, -1));
    }
    Batch b{inputs, targets, loss_fn, stage == stages - 1 ? static_cast<double>(target.size(0)) : 1.0};
    const auto order = pipelineActions(opts.schedule, stage, stages, opts.micro_batches, V);
    const auto t_step = Clock::now();
    const char* what = "forward";
    std::string detail;
    int m = -1, c = -1;
    try {
      for (size_t k = 0; k < order.size(); ++k) {
        m = order[k].micro;
        c = order[k].chunk;
        detail.clear();
        if (order[k].kind == 'F') {
          what = "forward";
          runForward(order[k], b, detail, t_step);
        } else {
          what = "backward";
          runBackward(order[k], k + 1 == order.size(), t_step);
        }
      }
      what = "final sends";
      m = c = -1;
      channels.reapSends(true, stats.comm_ms);
      stats.step_ms = pipeMsSince(t_step);
      what = "loss broadcast";
      pg->broadcast(&b.loss_sum, 1, comm::DType::f64, stages - 1)->wait();
    } catch (...) {
      fail(where(what, m, c, detail));
    }
    return b.loss_sum;
  }

  at::Tensor forward(const at::Tensor& input) {
    // forward() keeps its own figures: stats() and timeline() stay those of the last step(). The step's
    // are parked in forward_stats while the forward runs, and swapped back however it ends.
    std::swap(stats, forward_stats);
    std::swap(spans, forward_spans);
    struct SwapBack {
      Impl& m;
      ~SwapBack() {
        std::swap(m.stats, m.forward_stats);
        std::swap(m.spans, m.forward_spans);
      }
    } swap_back{*this};
    beginStep();
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> inputs, outputs(static_cast<size_t>(opts.micro_batches));
    const auto t_step = Clock::now();
    int m = -1, c = -1;
    try {
      if (stage == 0) inputs = splitRows(input, "input");
      for (const auto& a : pipelineActions(opts.schedule, stage, stages, opts.micro_batches, V)) {
        if (a.kind != 'F') continue;
        m = a.micro;
        c = a.chunk;
        at::Tensor x = forwardInput(c, m, Ch::kForwardMode, inputs);
        const auto t0 = Clock::now();
        int64_t bytes = 0;
        at::Tensor y = runModules(c, x, bytes);
        traceMicro("pipeline fwd mb=", m, c, t0);
        stats.forward_ms += pipeMsSince(t0);
        if (lastVirtual(c)) outputs[static_cast<size_t>(m)] = y;
        else channels.send(next(), Ch::kActivation, outputChunk(c), m, Ch::kForwardMode, y);
      }
      m = c = -1;
      channels.reapSends(true, stats.comm_ms);
      stats.step_ms = pipeMsSince(t_step);
    } catch (...) {
      fail(where("forward", m, c));
    }
    return stage == stages - 1 ? at::cat(outputs, 0) : at::Tensor();
  }

  // Takes the rank's chunks: their modules, module() and the dtype and device of the parameters.
  void setUpChunks(const std::vector<torch::nn::Sequential>& chunks) {
    all = V == 1 ? chunks[0] : torch::nn::Sequential();
    for (int c = 0; c < V; ++c) {
      const auto& seq = chunks[static_cast<size_t>(c)];
      DTRAIN_CHECK(seq->size() > 0, InvalidArgument, "stage {} chunk {} has no modules", stage, c);
      mods.emplace_back();
      auto named = seq->named_children();
      for (size_t i = 0; i < seq->size(); ++i) {
        mods.back().push_back(*(seq->begin() + static_cast<std::ptrdiff_t>(i)));
        if (V == 1) continue;
        // pipelineChunks keeps the model's names, unique across chunks; chunks built by hand may each
        // start at "0": those get their chunk's index in front ("chunk1_0"; names cannot hold dots).
        std::string name = named[i].key();
        if (all->named_children().contains(name)) name = fmt::format("chunk{}_{}", c, name);
        all->push_back(name, mods.back().back());
      }
    }
    for (const auto& p : all->parameters()) {
      if (at::isFloatingType(p.scalar_type())) {
        param_dtype = p.scalar_type();
        device = p.device();
        break;
      }
    }
  }

};

Pipeline::Pipeline(torch::nn::Sequential stage, std::shared_ptr<comm::ProcessGroup> pg, PipelineOptions options)
    : Pipeline(std::vector<torch::nn::Sequential>{std::move(stage)}, std::move(pg), options) {}

Pipeline::Pipeline(std::vector<torch::nn::Sequential> chunks, std::shared_ptr<comm::ProcessGroup> pg,
                   PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  DTRAIN_CHECK(pg != nullptr, InvalidArgument, "Pipeline: null process group");
  m.pg = std::move(pg);
  m.opts = options;
  m.stage = m.pg->rank();
  m.stages = m.pg->size();
  m.V = static_cast<int>(chunks.size());
  // This rank's own checks; a refusal is told to the other ranks (through the allgather below) before it
  // is thrown, so they fail at once instead of waiting for this rank until the timeout.
  std::string refused;
  try {
    DTRAIN_CHECK(m.V >= 1, InvalidArgument, "no chunks");
    DTRAIN_CHECK(options.micro_batches >= 1, InvalidArgument, "{} micro-batches", options.micro_batches);
    // The schedule's own checks (one chunk for gpipe and 1F1B, M a multiple of P when interleaved).
    pipelineActions(options.schedule, m.stage, m.stages, options.micro_batches, m.V);
    m.setUpChunks(chunks);
  } catch (const std::exception& e) {
    refused = e.what();
  }
  m.stats.stage = m.stage;
  m.stats.stages = m.stages;
  m.stats.micro_batches = options.micro_batches;
  m.forward_stats = m.stats;

  // Every stage must run the same schedule with the same micro-batch and chunk counts, or they would
  // wait for messages that never come. All ranks see all configurations, so all throw together.
  std::array<int64_t, 4> mine{options.micro_batches, static_cast<int64_t>(options.schedule), m.V, refused.empty() ? 0 : 1};
  std::vector<int64_t> all(4 * static_cast<size_t>(m.stages));
  m.pg->allgather(mine.data(), all.data(), 4, comm::DType::i64)->wait();
  if (!refused.empty()) throw InvalidArgument(fmt::format("[rank {}] Pipeline: {}", m.stage, refused));
  bool same = true;
  std::string each, who;
  for (int r = 0; r < m.stages; ++r) {
    const int64_t* a = &all[4 * static_cast<size_t>(r)];
    same &= a[0] == mine[0] && a[1] == mine[1] && a[2] == mine[2];
    each += fmt::format("{}rank {}: {} micro-batches, {}", r ? "; " : "", r, a[0],
                        scheduleName(static_cast<PipelineSchedule>(a[1])));
    if (a[2] != 1) each += fmt::format(" with {} chunks", a[2]);
    if (a[3] != 0) who += fmt::format("{}{}", who.empty() ? "" : ", ", r);
  }
  DTRAIN_CHECK(who.empty(), InvalidArgument, "[rank {}] Pipeline: rank(s) {} refused their configuration ({})", m.stage,
               who, each);
  DTRAIN_CHECK(same, InvalidArgument, "[rank {}] Pipeline: the stages disagree on the schedule: {}", m.stage, each);
  m.channels.open(*m.pg, m.V, options.micro_batches, m.param_dtype);
}

Pipeline::~Pipeline() = default;

double Pipeline::step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss) {
  return impl_->step(input, target, loss);
}
at::Tensor Pipeline::forward(const at::Tensor& input) { return impl_->forward(input); }
void Pipeline::attachDataParallel(DistributedDataParallel* ddp) {
  DTRAIN_CHECK(ddp == nullptr || impl_->V == 1, InvalidArgument,
               "[rank {}] Pipeline: data parallelism cannot be attached to the interleaved schedule's {} chunks",
               impl_->stage, impl_->V);
  impl_->ddp = ddp;
}
void Pipeline::attachSharded(FullyShardedDataParallel* fsdp) {
  DTRAIN_CHECK(fsdp == nullptr || impl_->V == 1, InvalidArgument,
               "[rank {}] Pipeline: sharding cannot be attached to the interleaved schedule's {} chunks", impl_->stage,
               impl_->V);
  impl_->fsdp = fsdp;
}
int Pipeline::stage() const { return impl_->stage; }
int Pipeline::stages() const { return impl_->stages; }
int Pipeline::chunks() const { return impl_->V; }
torch::nn::Sequential& Pipeline::module() { return impl_->all; }
const PipelineOptions& Pipeline::options() const { return impl_->opts; }
const PipelineStats& Pipeline::stats() const { return impl_->stats; }
const PipelineStats& Pipeline::forwardStats() const { return impl_->forward_stats; }
const std::vector<PipelineSpan>& Pipeline::timeline() const { return impl_->spans; }

}  // namespace dtrain
