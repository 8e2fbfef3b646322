// Pipeline parallelism (see pipeline.h): stage splitting, the GPipe and 1F1B schedules, and the
// executor that runs a schedule over send/recv.
//
// The executor walks this stage's list of actions (F m / B m). Before each action it runs one batch
// of point-to-point ops: the sends the previous action produced together with the receive this
// action needs (activation header from the previous stage for F, gradient from the next stage for B).
// Running them concurrently is what keeps a pipeline with blocking sends from deadlocking: when
// stage s sends an activation to s+1 while s+1 sends a gradient to s (the steady state of 1F1B),
// each side's receive is posted with its send (Megatron's send_forward_recv_backward). An activation
// arrives as a header (shape, dtype, micro-batch) and then its data, because the receiver has to
// learn the shape before it can post a receive of the exact length.
#include "dtrain/pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <limits>
#include <numeric>

#include "comm/trace/trace_internal.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/tensor.h"
#include "errors.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kMagic = 0x5049504531LL;  // "PIPE1"
constexpr int kMaxDims = 8;
// magic, mode, step, micro, scalar type, ndim, dims[8]
constexpr int kHeaderLen = 6 + kMaxDims;
constexpr uint32_t kTagHeader = 0x5001, kTagActivation = 0x5002, kTagGradient = 0x5003;

double msSince(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::string shapeStr(c10::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) : 0;
}

using detail::errorText;
using detail::rethrowWithContext;

}  // namespace

const char* scheduleName(PipelineSchedule s) { return s == PipelineSchedule::gpipe ? "gpipe" : "1f1b"; }

std::vector<size_t> balanceByParameters(const torch::nn::Sequential& model, int stages) {
  const size_t n = model->size();
  DTRAIN_CHECK(stages >= 1, InvalidArgument, "balanceByParameters: {} stages", stages);
  DTRAIN_CHECK(n >= static_cast<size_t>(stages), InvalidArgument,
               "balanceByParameters: the model has {} modules, fewer than the {} stages", n, stages);
  std::vector<int64_t> prefix(n + 1, 0);  // prefix[i]: cost of modules [0, i)
  for (size_t i = 0; i < n; ++i) {
    int64_t c = 1;
    for (const auto& p : model->ptr(i)->parameters()) c += p.numel();
    prefix[i + 1] = prefix[i] + c;
  }
  // best[k][i]: the smallest possible largest-stage cost of modules [0, i) in k stages.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  const size_t P = static_cast<size_t>(stages);
  std::vector<std::vector<int64_t>> best(P + 1, std::vector<int64_t>(n + 1, kInf));
  std::vector<std::vector<size_t>> cut(P + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= P; ++k) {
    for (size_t i = k; i <= n; ++i) {
      for (size_t j = k - 1; j < i; ++j) {  // the last stage is [j, i)
        if (best[k - 1][j] == kInf) continue;
        int64_t v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<size_t> bounds(P + 1);
  bounds[P] = n;
  for (size_t k = P; k >= 1; --k) bounds[k - 1] = cut[k][bounds[k]];
  return bounds;
}

torch::nn::Sequential pipelineStage(const torch::nn::Sequential& model, int stage, int stages,
                                    const std::vector<size_t>& split_points) {
  DTRAIN_CHECK(stage >= 0 && stage < stages, InvalidArgument, "pipelineStage: stage {} of {}", stage, stages);
  std::vector<size_t> bounds;
  if (split_points.empty()) {
    bounds = balanceByParameters(model, stages);
  } else {
    DTRAIN_CHECK(split_points.size() + 1 == static_cast<size_t>(stages), InvalidArgument,
                 "pipelineStage: {} split points for {} stages (need {})", split_points.size(), stages, stages - 1);
    bounds.push_back(0);
    for (size_t p : split_points) {
      DTRAIN_CHECK(p > bounds.back() && p < model->size(), InvalidArgument,
                   "pipelineStage: split points must increase strictly within (0, {}); got {}", model->size(),
                   fmt::join(split_points, ", "));
      bounds.push_back(p);
    }
    bounds.push_back(model->size());
  }
  torch::nn::Sequential out;
  auto named = model->named_children();
  for (size_t i = bounds[stage]; i < bounds[stage + 1]; ++i) {
    out->push_back(named[i].key(), *(model->begin() + static_cast<std::ptrdiff_t>(i)));
  }
  return out;
}

std::vector<std::pair<char, int>> pipelineOrder(PipelineSchedule schedule, int stage, int stages, int micro_batches) {
  std::vector<std::pair<char, int>> order;
  const int M = micro_batches;
  if (schedule == PipelineSchedule::gpipe) {
    for (int m = 0; m < M; ++m) order.emplace_back('F', m);
    for (int m = 0; m < M; ++m) order.emplace_back('B', m);
    return order;
  }
  // 1F1B: enough warm-up forwards to fill the pipeline below this stage, then one forward and one
  // backward in turn, then drain. Stage s holds at most warmup + 1 = P - s micro-batches.
  const int warmup = std::min(stages - stage - 1, M);
  for (int m = 0; m < warmup; ++m) order.emplace_back('F', m);
  for (int i = 0; i < M - warmup; ++i) {
    order.emplace_back('F', warmup + i);
    order.emplace_back('B', i);
  }
  for (int m = M - warmup; m < M; ++m) order.emplace_back('B', m);
  return order;
}

struct Pipeline::Impl {
  torch::nn::Sequential seq;
  std::vector<torch::nn::AnyModule> mods;
  std::shared_ptr<comm::ProcessGroup> pg;
  PipelineOptions opts;
  int stage = 0, stages = 1;
  int64_t step_no = 0;
  c10::optional<c10::ScalarType> param_dtype;  // of the first floating parameter, to check inputs
  c10::optional<c10::Device> device;           // of that parameter: where received activations go
  DistributedDataParallel* ddp = nullptr;
  FullyShardedDataParallel* fsdp = nullptr;
  PipelineStats stats;               // of the last step(), or of the forward() under way
  std::vector<PipelineSpan> spans;
  PipelineStats forward_stats;       // of the last forward()
  std::vector<PipelineSpan> forward_spans;

  // What this stage keeps of one micro-batch between its forward and its backward.
  struct Micro {
    at::Tensor input;   // requires grad on stages > 0 (its gradient goes back)
    at::Tensor output;  // the stage's output, or the weighted loss on the last stage
    int64_t bytes = 0;
  };
  std::vector<Micro> micro;
  int64_t stored_bytes = 0;

  // Sends produced by the last action, run with the next action's receive. The tensors keep their
  // buffers alive until the batch completes.
  std::vector<comm::P2POp> pending;
  std::vector<at::Tensor> pending_keep;

  // The timeline's event for micro-batch m's forward or backward on this stage, from t0 to now.
  void traceMicro(const char* what, int m, Clock::time_point t0) const {
    namespace timeline = comm::trace::timeline;
    if (timeline::on())
      timeline::span(what, m, "pipeline", comm::trace::usOf(t0), comm::trace::nowUs(), {"stage", stage},
                     {"step", step_no});
  }

  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }

  // "pipeline stage 1/3 step 4: forward of micro-batch 2 (input Double [4, 16] from rank 0): "
  std::string where(const char* what, int m, const std::string& detail = {}) const {
    std::string s = fmt::format("pipeline stage {}/{} step {}: {}", stage, stages, step_no, what);
    if (m >= 0) s += fmt::format(" of micro-batch {}", m);
    if (!detail.empty()) s += " (" + detail + ")";
    return s + ": ";
  }

  // Runs the pending sends with `extra` receives as one concurrent batch and waits for it.
  void exchange(std::vector<comm::P2POp> extra) {
    std::vector<comm::P2POp> ops = std::move(pending);
    pending.clear();
    ops.insert(ops.end(), extra.begin(), extra.end());
    if (!ops.empty()) {
      auto t0 = Clock::now();
      pg->sendRecv(std::move(ops))->wait();
      stats.comm_ms += msSince(t0);
    }
    pending_keep.clear();
  }

  void queueSend(const at::Tensor& t, int dst, uint32_t tag) {
    pending.push_back({comm::P2POp::kSend, t.data_ptr(), static_cast<size_t>(t.numel()),
                       toCommDType(t.scalar_type()), dst, tag});
    pending_keep.push_back(t);
  }

  void queueActivation(const at::Tensor& out, int mode, int m) {
    DTRAIN_CHECK(out.dim() <= kMaxDims, InvalidArgument, "the output has {} dims, at most {} can be sent",
                 out.dim(), kMaxDims);
    at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
    auto* p = h.data_ptr<int64_t>();
    p[0] = kMagic;
    p[1] = mode;
    p[2] = step_no;
    p[3] = m;
    p[4] = static_cast<int64_t>(out.scalar_type());
    p[5] = out.dim();
    for (int64_t d = 0; d < out.dim(); ++d) p[6 + d] = out.size(d);
    at::Tensor data = out.detach().contiguous();
    if (data.device().is_cuda()) data = data.cpu();  // CUDA activations travel through the host
    checkCommTensor(data, "pipeline activation");
    queueSend(h, stage + 1, kTagHeader);
    queueSend(data, stage + 1, kTagActivation);
  }

  // Receives micro-batch m's activation from the previous stage (with the pending sends), checking
  // that the sender is where this rank is in the schedule.
  at::Tensor receiveActivation(int mode, int m) {
    at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
    exchange({{comm::P2POp::kRecv, h.data_ptr(), kHeaderLen, comm::DType::i64, stage - 1, kTagHeader}});
    const auto* p = h.data_ptr<int64_t>();
    const int src = stage - 1;
    DTRAIN_CHECK(p[0] == kMagic, ProtocolError, "rank {} (stage {}) sent something that is not a pipeline header", src, src);
    const char* modes[] = {"step", "forward"};
    DTRAIN_CHECK(p[1] == mode && p[2] == step_no && p[3] == m, ProtocolError,
                 "rank {} (stage {}) sent the activation of {} {} micro-batch {}, this rank expected {} {} "
                 "micro-batch {}: do all stages call the same sequence of step() / forward()?",
                 src, src, (p[1] == 0 || p[1] == 1) ? modes[p[1]] : "?", p[2], p[3],
                 modes[mode], step_no, m);
    const int64_t ndim = p[5];
    DTRAIN_CHECK(ndim >= 0 && ndim <= kMaxDims, ProtocolError, "rank {} sent a header with {} dims", src, ndim);
    std::vector<int64_t> shape(p + 6, p + 6 + ndim);
    for (int64_t d : shape)
      DTRAIN_CHECK(d >= 0, ProtocolError, "rank {} sent a negative dim", src);
    const auto type = static_cast<c10::ScalarType>(p[4]);
    toCommDType(type, "pipeline activation");
    if (param_dtype && at::isFloatingType(type) && type != *param_dtype) {
      throw InvalidArgument(fmt::format(
          "rank {} (stage {}) sends a {} activation of shape {}, but this stage's parameters are {}: "
          "every stage must use the same floating dtype",
          src, src, c10::toString(type), shapeStr(shape), c10::toString(*param_dtype)));
    }
    at::Tensor x = at::empty(shape, at::TensorOptions().dtype(type));
    exchange({{comm::P2POp::kRecv, x.data_ptr(), static_cast<size_t>(x.numel()), toCommDType(type), src,
               kTagActivation}});
    return x;
  }

  // The stage's modules one by one, so that the bytes of what they produce can be counted.
  at::Tensor runModules(at::Tensor x, int64_t& bytes) {
    // A received activation arrives on the host: onto the stage's device, differentiably (its gradient
    // then comes back to the host tensor, which is sent on).
    if (device && x.device() != *device) x = x.to(*device);
    if (fsdp != nullptr) {  // the sharded stage gathers each unit's parameters as it runs it
      x = fsdp->forward(x);
      bytes += tensorBytes(x);
      return x;
    }
    for (auto& mod : mods) {
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
    micro.assign(static_cast<size_t>(opts.micro_batches), Micro{});
    pending.clear();
    pending_keep.clear();
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
    pending.clear();
    pending_keep.clear();
    micro.clear();
    stats.stored_activations = 0;
    try {
      pg->abort(msg)->wait();
    } catch (const std::exception&) {
      // Expected: the abort op fails with msg by design (or the group had failed already).
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

  double step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn) {
    beginStep();
    // Bad arguments abort the group too: the other stages would wait for this one otherwise.
    std::vector<at::Tensor> inputs, targets;
    try {
      if (first()) inputs = splitRows(input, "input");
      if (last()) {
        DTRAIN_CHECK(static_cast<bool>(loss_fn), InvalidArgument, "no loss function");
        targets = splitRows(target, "target");
      }
    } catch (...) {
      fail(where("arguments", -1));
    }
    const double rows = last() ? static_cast<double>(target.size(0)) : 1.0;
    const auto order = pipelineOrder(opts.schedule, stage, stages, opts.micro_batches);
    const size_t last_backward = order.size() - 1;
    double loss_sum = 0;
    const auto t_step = Clock::now();
    const char* what = "forward";
    std::string detail;
    int m = -1;
    try {
      for (size_t k = 0; k < order.size(); ++k) {
        m = order[k].second;
        Micro& mb = micro[static_cast<size_t>(m)];
        detail.clear();
        if (order[k].first == 'F') {
          what = "forward";
          if (first()) {
            exchange({});
            mb.input = inputs[static_cast<size_t>(m)];
          } else {
            mb.input = receiveActivation(0, m);
            if (at::isFloatingType(mb.input.scalar_type())) mb.input.requires_grad_(true);
            detail = fmt::format("input {} {} from rank {}", c10::toString(mb.input.scalar_type()),
                                 shapeStr(mb.input.sizes()), stage - 1);
          }
          const auto t0 = Clock::now();
          mb.bytes = tensorBytes(mb.input);
          at::Tensor out = runModules(mb.input, mb.bytes);
          if (last()) {
            const at::Tensor& t = targets[static_cast<size_t>(m)];
            DTRAIN_CHECK(out.dim() >= 1 && out.size(0) == t.size(0), InvalidArgument,
                         "output of shape {} does not match its {} target rows (the batch has {} rows)",
                         shapeStr(out.sizes()), t.size(0), target.size(0));
            at::Tensor l = loss_fn(out, t);
            DTRAIN_CHECK(l.defined() && l.numel() == 1, InvalidArgument,
                         "the loss function must return a scalar, got shape {}",
                         l.defined() ? shapeStr(l.sizes()) : "undefined");
            // Mean over the micro-batch's rows, weighted by its share of the batch: the batch mean.
            mb.output = l.reshape({}) * (static_cast<double>(t.size(0)) / rows);
            loss_sum += mb.output.item<double>();
          } else {
            mb.output = out;
            queueActivation(out, 0, m);
          }
          noteStored(1, mb.bytes);
          traceMicro("pipeline fwd mb=", m, t0);
          stats.forward_ms += msSince(t0);
          spans.push_back({'F', m, std::chrono::duration<double, std::milli>(t0 - t_step).count(), msSince(t_step)});
        } else {
          what = "backward";
          at::Tensor grad;
          if (last()) {
            exchange({});
          } else {
            grad = at::empty(mb.output.sizes(), at::TensorOptions().dtype(mb.output.scalar_type()));
            exchange({{comm::P2POp::kRecv, grad.data_ptr(), static_cast<size_t>(grad.numel()),
                       toCommDType(grad.scalar_type()), stage + 1, kTagGradient}});
          }
          const auto t0 = Clock::now();
          if (mb.output.requires_grad()) {
            auto run = [&] {
              if (last()) mb.output.backward();
              else mb.output.backward(grad.to(mb.output.device()));
            };
            if (ddp != nullptr && k != last_backward) {
              auto guard = ddp->noSync();
              run();
            } else if (fsdp != nullptr && k != last_backward) {
              auto guard = fsdp->noSync();
              run();
            } else {
              run();
            }
          }
          if (!first()) {
            at::Tensor gx = mb.input.grad();
            gx = gx.defined() ? gx.contiguous() : at::zeros_like(mb.input);
            queueSend(gx, stage - 1, kTagGradient);
          }
          noteStored(-1, -mb.bytes);
          mb = Micro{};
          traceMicro("pipeline bwd mb=", m, t0);
          stats.backward_ms += msSince(t0);
          spans.push_back({'B', m, std::chrono::duration<double, std::milli>(t0 - t_step).count(), msSince(t_step)});
        }
      }
      what = "final sends";
      m = -1;
      exchange({});
      stats.step_ms = msSince(t_step);
      what = "loss broadcast";
      pg->broadcast(&loss_sum, 1, comm::DType::f64, stages - 1)->wait();
    } catch (...) {
      fail(where(what, m, detail));
    }
    return loss_sum;
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
    std::vector<at::Tensor> inputs, outputs;
    const auto t_step = Clock::now();
    int m = -1;
    try {
      if (first()) inputs = splitRows(input, "input");
      for (m = 0; m < opts.micro_batches; ++m) {
        at::Tensor x;
        if (first()) {
          exchange({});
          x = inputs[static_cast<size_t>(m)];
        } else {
          x = receiveActivation(1, m);
        }
        const auto t0 = Clock::now();
        int64_t bytes = 0;
        at::Tensor out = runModules(x, bytes);
        traceMicro("pipeline fwd mb=", m, t0);
        stats.forward_ms += msSince(t0);
        if (last()) outputs.push_back(out);
        else queueActivation(out, 1, m);
      }
      exchange({});
      stats.step_ms = msSince(t_step);
    } catch (...) {
      fail(where("forward", m));
    }
    return last() ? at::cat(outputs, 0) : at::Tensor();
  }
};

Pipeline::Pipeline(torch::nn::Sequential stage, std::shared_ptr<comm::ProcessGroup> pg, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  DTRAIN_CHECK(pg != nullptr, InvalidArgument, "Pipeline: null process group");
  m.seq = std::move(stage);
  m.pg = std::move(pg);
  m.opts = options;
  m.stage = m.pg->rank();
  m.stages = m.pg->size();
  DTRAIN_CHECK(m.seq->size() > 0, InvalidArgument, "[rank {}] Pipeline: stage {} has no modules", m.stage,
               m.stage);
  DTRAIN_CHECK(options.micro_batches >= 1, InvalidArgument, "[rank {}] Pipeline: {} micro-batches", m.stage,
               options.micro_batches);
  for (auto it = m.seq->begin(); it != m.seq->end(); ++it) m.mods.push_back(*it);
  for (const auto& p : m.seq->parameters()) {
    if (at::isFloatingType(p.scalar_type())) {
      m.param_dtype = p.scalar_type();
      m.device = p.device();
      break;
    }
  }
  m.stats.stage = m.stage;
  m.stats.stages = m.stages;
  m.stats.micro_batches = options.micro_batches;
  m.forward_stats = m.stats;

  // Every stage must run the same schedule with the same micro-batch count, or they would wait for
  // messages that never come. All ranks see all configurations, so all throw together.
  std::array<int64_t, 2> mine{options.micro_batches, static_cast<int64_t>(options.schedule)};
  std::vector<int64_t> all(2 * static_cast<size_t>(m.stages));
  m.pg->allgather(mine.data(), all.data(), 2, comm::DType::i64)->wait();
  bool same = true;
  std::string each;
  for (int r = 0; r < m.stages; ++r) {
    same &= all[2 * r] == mine[0] && all[2 * r + 1] == mine[1];
    each += fmt::format("{}rank {}: {} micro-batches, {}", r ? "; " : "", r, all[2 * r],
                        scheduleName(static_cast<PipelineSchedule>(all[2 * r + 1])));
  }
  DTRAIN_CHECK(same, InvalidArgument, "[rank {}] Pipeline: the stages disagree on the schedule: {}", m.stage, each);
}

Pipeline::~Pipeline() = default;

double Pipeline::step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss) {
  return impl_->step(input, target, loss);
}
at::Tensor Pipeline::forward(const at::Tensor& input) { return impl_->forward(input); }
void Pipeline::attachDataParallel(DistributedDataParallel* ddp) { impl_->ddp = ddp; }
void Pipeline::attachSharded(FullyShardedDataParallel* fsdp) { impl_->fsdp = fsdp; }
int Pipeline::stage() const { return impl_->stage; }
int Pipeline::stages() const { return impl_->stages; }
torch::nn::Sequential& Pipeline::module() { return impl_->seq; }
const PipelineOptions& Pipeline::options() const { return impl_->opts; }
const PipelineStats& Pipeline::stats() const { return impl_->stats; }
const PipelineStats& Pipeline::forwardStats() const { return impl_->forward_stats; }
const std::vector<PipelineSpan>& Pipeline::timeline() const { return impl_->spans; }

}  // namespace dtrain
