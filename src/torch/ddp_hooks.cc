// DistributedDataParallel's comm hooks: the ordered continuation thread (see ddp_hooks.h),
// GradBucket::then, and the fp16 / bf16 compression hooks.
#include "ddp_hooks.h"

#include <torch/torch.h>

#include <cstdio>

#include "dtrain/comm/element.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/ddp.h"
#include "dtrain/trace.h"
#include "errors.h"
#include "torch/device/tensor_comm.h"

namespace dtrain {
namespace detail {

comm::Work::Post HookLane::reserve() {
  auto slot = std::make_shared<Slot>();
  {
    std::lock_guard<std::mutex> g(queue->mu);
    DTRAIN_CHECK(!done, InvalidArgument,
                 "[rank {}] DDP comm hook '{}', bucket {}: GradBucket::then() after the bucket's chain ended: call it "
                 "from run() or from the bucket's own continuations, and return the chain's last Work",
                 rank, hook, bucket);
    slots.push_back(slot);
  }
  return [q = queue, slot](std::function<void()> task) {
    {
      std::lock_guard<std::mutex> g(q->mu);
      slot->task = std::move(task);
      slot->filled = true;
    }
    q->cv.notify_all();
  };
}

void HookLane::seal() {
  {
    std::lock_guard<std::mutex> g(queue->mu);
    sealed = true;
  }
  queue->cv.notify_all();
}

HookRunner::HookRunner() : q_(std::make_shared<HookQueue>()) {
  thread_ = std::thread([this] { loop(); });
}

HookRunner::~HookRunner() {
  {
    std::lock_guard<std::mutex> g(q_->mu);
    q_->stopping = true;
    for (auto& lane : q_->lanes) lane->done = true;  // continuations still to come will not run
    q_->lanes.clear();
  }
  q_->cv.notify_all();
  thread_.join();
}

std::shared_ptr<HookLane> HookRunner::open(int bucket, int rank, std::string hook, comm::ProcessGroup* chain_group) {
  auto lane = std::make_shared<HookLane>();
  lane->queue = q_;
  lane->bucket = bucket;
  lane->rank = rank;
  lane->hook = std::move(hook);
  lane->chain_group = chain_group;
  {
    std::lock_guard<std::mutex> g(q_->mu);
    q_->lanes.push_back(lane);
  }
  q_->cv.notify_all();
  return lane;
}

void HookRunner::loop() {
  trace::setThreadName("ddp hooks");
  comm::IssueAndMoveOn move_on;  // continuations never wait for the collectives they issue
  auto& q = *q_;
  std::unique_lock<std::mutex> lk(q.mu);
  // The front lane can move on: its next slot is filled, or it is sealed with nothing left.
  auto runnable = [&] {
    if (q.lanes.empty()) return false;
    const auto& lane = *q.lanes.front();
    return lane.slots.empty() ? lane.sealed : lane.slots.front()->filled;
  };
  for (;;) {
    q.cv.wait(lk, [&] { return q.stopping || runnable(); });
    if (q.stopping) return;
    auto lane = q.lanes.front();
    if (lane->slots.empty()) {
      lane->done = true;
      q.lanes.pop_front();
      continue;
    }
    auto slot = lane->slots.front();
    lane->slots.pop_front();
    lk.unlock();
    {
      torch::NoGradGuard no_grad;
      slot->task();  // Work::then's step: it catches what the continuation throws
    }
    slot.reset();
    lk.lock();
  }
}

}  // namespace detail

comm::WorkPtr GradBucket::then(const comm::WorkPtr& after, std::function<comm::WorkPtr()> next) {
  DTRAIN_CHECK(lane_ != nullptr, InvalidArgument,
               "GradBucket::then() outside a DistributedDataParallel comm hook (call it from CommHook::run)");
  DTRAIN_CHECK(after != nullptr, InvalidArgument, "[rank {}] DDP comm hook '{}', bucket {}: then() after a null Work",
               lane_->rank, lane_->hook, index);
  auto post = lane_->reserve();
  // A continuation's own failure names the hook and the bucket (dtrain errors name their op already).
  auto step = [next = std::move(next), lane = lane_]() -> comm::WorkPtr {
    try {
      return next();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(fmt::format("[rank {}] DDP comm hook '{}', bucket {}: a continuation failed: {}", lane->rank,
                              lane->hook, lane->bucket, detail::errorText(e)));
    }
  };
  return after->then(std::move(step), std::move(post));
}

comm::ProcessGroup& GradBucket::chainGroup() const {
  DTRAIN_CHECK(lane_ != nullptr, InvalidArgument,
               "GradBucket::chainGroup() outside a DistributedDataParallel comm hook");
  DTRAIN_CHECK(lane_->chain_group != nullptr, InvalidArgument,
               "[rank {}] DDP comm hook '{}': chainGroup() needs a hook whose chainsCollectives() returns true (DDP "
               "creates the chain group when such a hook is registered)",
               lane_->rank, lane_->hook);
  return *lane_->chain_group;
}

namespace {
// Averages a bucket in a 16-bit float type: half the bytes on the wire. The copy back into the bucket
// is the chain's second step.
class CastHook : public CommHook {
 public:
  CastHook(c10::ScalarType t, comm::DType ct, const char* name, bool always)
      : t_(t), ct_(ct), name_(name), always_(always) {}
  std::string name() const override { return name_; }
  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    const auto n = static_cast<size_t>(b.flat.numel());
    // float32 buckets convert with dtrain's vectorised conversions (ATen's float -> half copy runs at
    // about 1.7 ns an element, which cost more than the halved transfer saves on one host).
    // (On a GPU, ATen's conversions, which run there.)
    const bool f32 = b.flat.scalar_type() == at::kFloat && b.flat.is_contiguous() && b.flat.is_cpu();
    // Over shared memory the conversions (two passes over the bucket, on the ranks' own cores) cost more
    // than the halved copies save: the reference MLP's step was 0.92x of no hook with them
    // (docs/PERFORMANCE.md). Such a bucket travels as float32; the choice is visible once.
    if (f32 && !always_ && pg.transportName() == "shm") {
      const char* kind = t_ == at::kHalf ? "fp16" : "bf16";
      if (!noted_ && pg.rank() == 0)
        std::fprintf(stderr, "dtrain: %s hook: every rank shares memory here, where converting costs more than the "
                     "halved bytes save, so float32 buckets are averaged as they are (to compress anyway: "
                     "%sCompressHook(true), or --comm-hook %s:always)\n", name_, kind, kind);
      noted_ = true;
      return device::allreduce(pg, b.flat, comm::ReduceOp::avg);
    }
    if (f32) {
      // Kept between steps: a fresh 16 MB tensor per step faults its pages in every step (about as
      // long as the conversion itself).
      if (!b.scratch.defined() || b.scratch.numel() != b.flat.numel() || b.scratch.scalar_type() != t_)
        b.scratch = at::empty({b.flat.numel()}, b.flat.options().dtype(t_));
      comm::floatsTo16(b.flat.data_ptr<float>(), b.scratch.data_ptr(), n, ct_);
    } else {
      b.scratch = b.flat.to(t_).contiguous();
    }
    auto avg = device::allreduce(pg, b.scratch, comm::ReduceOp::avg);
    return b.then(avg, [&b, f32, n, ct = ct_] {
      if (f32) comm::floatsFrom16(b.scratch.data_ptr(), b.flat.data_ptr<float>(), n, ct);
      else b.flat.copy_(b.scratch);
      return comm::WorkPtr();
    });
  }

 private:
  c10::ScalarType t_;
  comm::DType ct_;
  const char* name_;
  bool always_;
  bool noted_ = false;  // the shm note was printed (run() is called on autograd's thread only)
};
}  // namespace

std::shared_ptr<CommHook> fp16CompressHook(bool always) {
  return std::make_shared<CastHook>(at::kHalf, comm::DType::f16, "fp16_compress", always);
}
std::shared_ptr<CommHook> bf16CompressHook(bool always) {
  return std::make_shared<CastHook>(at::kBFloat16, comm::DType::bf16, "bf16_compress", always);
}

}  // namespace dtrain
