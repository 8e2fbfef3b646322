// Local SGD, model averagers and the post-local-SGD hook (see dtrain/local_sgd.h).
#include "dtrain/local_sgd.h"

#include <ATen/ATen.h>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"

namespace dtrain {

namespace {

// The parameters with a gradient on some rank of the group (PyTorch's averagers take those with a
// gradient here). Every rank must average the same list: with libtorch 2.x's zero_grad() (set to none), a
// branch one rank skipped leaves its gradient undefined there and defined elsewhere, and lists that differ
// would pair different parameters in the allreduce. One allreduce (max) of a flag per parameter.
std::vector<at::Tensor> withGradients(const std::vector<at::Tensor>& params, comm::ProcessGroup& group) {
  std::vector<int32_t> has(params.size());
  for (size_t i = 0; i < params.size(); ++i) has[i] = params[i].grad().defined() ? 1 : 0;
  if (group.size() > 1 && !params.empty())
    group.allreduce(has.data(), has.size(), comm::DType::i32, comm::ReduceOp::max)->wait();
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (has[i]) out.push_back(params[i]);
  return out;
}

// Writes the parameters in place (no autograd record).
void averageInPlace(const std::vector<at::Tensor>& params, comm::ProcessGroup& group) {
  if (params.empty() || group.size() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  for (const auto& p : params) {
    DTRAIN_CHECK(p.scalar_type() == params[0].scalar_type(), InvalidArgument,
                 "[rank {}] averageParameters: parameters of different dtypes ({} and {}): average each dtype apart",
                 group.rank(), c10::toString(params[0].scalar_type()), c10::toString(p.scalar_type()));
    flat.push_back(p.detach().reshape({-1}));
  }
  at::Tensor all = at::cat(flat);
  all.div_(group.size());
  device::allreduce(group, all, comm::ReduceOp::sum)->wait();
  int64_t off = 0;
  for (const auto& p : params) {
    p.detach().copy_(all.narrow(0, off, p.numel()).view_as(p));
    off += p.numel();
  }
}

}  // namespace

void averageParameters(const std::vector<at::Tensor>& params, comm::ProcessGroup& group) { averageInPlace(params, group); }

PeriodicModelAverager::PeriodicModelAverager(std::shared_ptr<comm::ProcessGroup> group, int64_t period,
                                             int64_t warmup_steps)
    : group_(std::move(group)), period_(period), warmup_(warmup_steps) {
  DTRAIN_CHECK(group_ != nullptr, InvalidArgument, "PeriodicModelAverager: no process group");
  DTRAIN_CHECK(period >= 1, InvalidArgument, "PeriodicModelAverager: period must be at least 1 (got {})", period);
  DTRAIN_CHECK(warmup_steps >= 0, InvalidArgument, "PeriodicModelAverager: warmup_steps must be >= 0 (got {})",
               warmup_steps);
}

bool PeriodicModelAverager::averageParameters(const std::vector<at::Tensor>& params) {
  const bool now = step_ >= warmup_ && (step_ - warmup_) % period_ == 0;
  if (now) averageInPlace(withGradients(params, *group_), *group_);
  ++step_;
  return now;
}

HierarchicalModelAverager::HierarchicalModelAverager(
    std::vector<std::pair<int64_t, std::shared_ptr<comm::ProcessGroup>>> levels, int64_t warmup_steps)
    : levels_(std::move(levels)), warmup_(warmup_steps) {
  DTRAIN_CHECK(!levels_.empty(), InvalidArgument, "HierarchicalModelAverager: no levels");
  DTRAIN_CHECK(warmup_steps >= 0, InvalidArgument, "HierarchicalModelAverager: warmup_steps must be >= 0 (got {})",
               warmup_steps);
  for (size_t i = 0; i < levels_.size(); ++i) {
    const auto& [period, group] = levels_[i];
    DTRAIN_CHECK(group != nullptr, InvalidArgument, "HierarchicalModelAverager: level {} (period {}) has no group", i,
                 period);
    DTRAIN_CHECK(period >= 1, InvalidArgument, "HierarchicalModelAverager: level {} has period {} (must be >= 1)", i,
                 period);
    DTRAIN_CHECK(i == 0 || period > levels_[i - 1].first, InvalidArgument,
                 "HierarchicalModelAverager: periods must increase: level {} has {} after {}", i, period,
                 levels_[i - 1].first);
    DTRAIN_CHECK(group->size() <= levels_.back().second->size(), InvalidArgument,
                 "[rank {}] HierarchicalModelAverager: the last level's group must be the whole job's (the largest): "
                 "level {} has {} ranks, the last {}",
                 group->rank(), i, group->size(), levels_.back().second->size());
  }
}

int64_t HierarchicalModelAverager::averageParameters(const std::vector<at::Tensor>& params) {
  int64_t used = 0;
  if (step_ >= warmup_) {
    for (auto it = levels_.rbegin(); it != levels_.rend(); ++it) {
      if (step_ % it->first == 0) {
        averageInPlace(withGradients(params, *it->second), *it->second);
        used = it->first;
        break;
      }
    }
  }
  ++step_;
  return used;
}

namespace {

class PostLocalSGDHook : public CommHook {
 public:
  PostLocalSGDHook(std::shared_ptr<comm::ProcessGroup> sub, int64_t start, bool allreduce)
      : sub_(std::move(sub)), start_(start), allreduce_(allreduce) {
    DTRAIN_CHECK(sub_ != nullptr, InvalidArgument,
                 "postLocalSGDHook: no subgroup (pass dist.local(), the ranks of this machine, for PyTorch's default)");
    DTRAIN_CHECK(start >= 0, InvalidArgument, "postLocalSGDHook: start_localSGD_iter must be >= 0 (got {})", start);
  }
  std::string name() const override { return "post_localSGD"; }

  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    toCommDType(b.flat.scalar_type(), "post-local SGD bucket");  // refuses a dtype that cannot travel
    if (iter_ < start_) {
      if (b.last) ++iter_;
      return device::allreduce(pg, b.flat, comm::ReduceOp::avg);
    }
    if (!allreduce_) {
      auto done = std::make_shared<comm::Work>("post-local SGD: bucket kept local", std::chrono::steady_clock::now(),
                                               pg.rank());
      done->finish();
      return done;
    }
    return device::allreduce(*sub_, b.flat, comm::ReduceOp::avg);
  }

 private:
  std::shared_ptr<comm::ProcessGroup> sub_;
  int64_t start_, iter_ = 0;
  bool allreduce_;
};

}  // namespace

std::shared_ptr<CommHook> postLocalSGDHook(std::shared_ptr<comm::ProcessGroup> subgroup, int64_t start_localSGD_iter,
                                           bool post_local_gradient_allreduce) {
  return std::make_shared<PostLocalSGDHook>(std::move(subgroup), start_localSGD_iter, post_local_gradient_allreduce);
}

}  // namespace dtrain
