// Pipeline parallelism (see pipeline.h): cutting a model into stages and chunks, and the schedules
// (the order of one stage's forwards and backwards); pipeline.cc runs them.
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)

#include <algorithm>
#include <limits>

#include "dtrain/comm/error.h"
#include "dtrain/pipeline.h"

namespace dtrain {

const char* scheduleName(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::gpipe: return "gpipe";
    case PipelineSchedule::one_f_one_b: return "1f1b";
    case PipelineSchedule::interleaved: return "interleaved";
  }
  return "?";
}

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

namespace {

// Where each of `parts` parts of the model starts (parts + 1 bounds): balanced, or at the split points.
std::vector<size_t> partBounds(const torch::nn::Sequential& model, int parts, const std::vector<size_t>& split_points,
                               const char* who) {
  if (split_points.empty()) return balanceByParameters(model, parts);
  DTRAIN_CHECK(split_points.size() + 1 == static_cast<size_t>(parts), InvalidArgument,
               "{}: {} split points for {} parts (need {})", who, split_points.size(), parts, parts - 1);
  std::vector<size_t> bounds{0};
  for (size_t p : split_points) {
    DTRAIN_CHECK(p > bounds.back() && p < model->size(), InvalidArgument,
                 "{}: split points must increase strictly within (0, {}); got {}", who, model->size(),
                 fmt::join(split_points, ", "));
    bounds.push_back(p);
  }
  bounds.push_back(model->size());
  return bounds;
}

// Modules [from, to) of the model as a Sequential sharing them, under their names.
torch::nn::Sequential modulesOf(const torch::nn::Sequential& model, size_t from, size_t to) {
  torch::nn::Sequential out;
  auto named = model->named_children();
  for (size_t i = from; i < to; ++i) out->push_back(named[i].key(), *(model->begin() + static_cast<std::ptrdiff_t>(i)));
  return out;
}

}  // namespace

torch::nn::Sequential pipelineStage(const torch::nn::Sequential& model, int stage, int stages,
                                    const std::vector<size_t>& split_points) {
  DTRAIN_CHECK(stage >= 0 && stage < stages, InvalidArgument, "pipelineStage: stage {} of {}", stage, stages);
  auto bounds = partBounds(model, stages, split_points, "pipelineStage");
  return modulesOf(model, bounds[stage], bounds[stage + 1]);
}

std::vector<torch::nn::Sequential> pipelineChunks(const torch::nn::Sequential& model, int stage, int stages,
                                                  int chunks, const std::vector<size_t>& split_points) {
  DTRAIN_CHECK(stage >= 0 && stage < stages, InvalidArgument, "pipelineChunks: stage {} of {}", stage, stages);
  DTRAIN_CHECK(chunks >= 1, InvalidArgument, "pipelineChunks: {} chunks", chunks);
  auto bounds = partBounds(model, stages * chunks, split_points, "pipelineChunks");
  std::vector<torch::nn::Sequential> out;
  for (int c = 0; c < chunks; ++c) {
    const auto part = static_cast<size_t>(c * stages + stage);
    out.push_back(modulesOf(model, bounds[part], bounds[part + 1]));
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

std::vector<PipelineAction> pipelineActions(PipelineSchedule schedule, int stage, int stages, int micro_batches,
                                            int chunks) {
  std::vector<PipelineAction> out;
  if (schedule != PipelineSchedule::interleaved) {
    DTRAIN_CHECK(chunks == 1, InvalidArgument, "the {} schedule runs one chunk per rank, not {}", scheduleName(schedule),
                 chunks);
    for (auto [kind, m] : pipelineOrder(schedule, stage, stages, micro_batches)) out.push_back({kind, m, 0});
    return out;
  }
  // Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving): the k-th forward
  // runs chunk (k mod PV) / P on micro-batch (k / PV) P + k mod P, so P micro-batches go through a
  // chunk before the next chunk starts; backwards go through the chunks the other way round.
  const int P = stages, V = chunks, M = micro_batches;
  DTRAIN_CHECK(P >= 1 && V >= 1 && M >= 1, InvalidArgument, "interleaved schedule: {} stages, {} chunks, {} micro-batches",
               P, V, M);
  DTRAIN_CHECK(M % P == 0, InvalidArgument,
               "the interleaved schedule needs a micro-batch count that is a multiple of the {} stages, not {}", P, M);
  const int total = M * V;
  auto action = [&](char kind, int k) {
    const int c = (k % (P * V)) / P;
    return PipelineAction{kind, (k / (P * V)) * P + k % P, kind == 'F' ? c : V - 1 - c};
  };
  const int warmup = M == P ? total : std::min((P - stage - 1) * 2 + (V - 1) * P, total);
  for (int k = 0; k < warmup; ++k) out.push_back(action('F', k));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(action('F', warmup + i));
    out.push_back(action('B', i));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(action('B', k));
  return out;
}

}  // namespace dtrain
