// Join (see join.h): the handshake that opens every synced pass in a join scope, the shadow passes of
// a rank that has run out of inputs, and the final model sync.
#include "dtrain/join.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <algorithm>
#include <exception>
#include <numeric>

#include "ddp_impl.h"
#include "dtrain/comm/error.h"
#include "errors.h"

namespace dtrain {

void DistributedDataParallel::Impl::startHandshake(bool running) {
  join->flags.assign(static_cast<size_t>(pg->size()), 0);
  join->flags[static_cast<size_t>(pg->rank())] = running ? 1 : 0;
  join->handshake = pg->allreduce(join->flags.data(), join->flags.size(), comm::DType::i32, comm::ReduceOp::sum);
}

detail::Handshake DistributedDataParallel::Impl::readHandshake() {
  join->handshake->wait();
  detail::Handshake h;
  h.max_running = -1;
  for (int r = 0; r < pg->size(); ++r) {
    int32_t f = join->flags[static_cast<size_t>(r)];
    // Anything but 0/1 means another collective was paired with the handshake (a transport without
    // the fingerprint check would let that through): never act on it.
    DTRAIN_CHECK(f == 0 || f == 1, ProtocolError,
                 "[rank {}] dtrain::Join: the handshake of a synced pass read {} for rank {} (expected 0 or 1): the "
                 "ranks are not running the same collectives",
                 pg->rank(), f, r);
    if (f) {
      ++h.running;
      h.max_running = r;
    } else {
      h.joined.push_back(r);
    }
  }
  return h;
}

void DistributedDataParallel::Impl::shadowPass(const detail::Handshake& h) {
  torch::NoGradGuard no_grad;
  ++join->passes;
  for (auto& b : buckets) {
    b.gb.flat.zero_();
    launchBucket(b);
  }
  if (opts.find_unused_parameters) startUsedExchange(/*joined=*/true);  // (it used nothing)
  auto buffer_works = startBufferBroadcast(h.max_running);
  completeBuckets(1.0, nullptr);
  endBufferBroadcast(buffer_works, h.max_running);
  if (opts.find_unused_parameters) restoreUnusedEverywhere();
  afterSyncedPass();
}

std::string DistributedDataParallel::Impl::earlyTerminationMessage(const detail::Handshake& h) const {
  return fmt::format(
      "[rank {}] dtrain::Join: rank(s) {} ran out of inputs and joined, and JoinOptions::throw_on_early_termination "
      "is set: every rank stops after this synced pass",
      pg->rank(), fmt::join(h.joined, ", "));
}

Join::Join(DistributedDataParallel& ddp, JoinOptions options) : ddp_(ddp), uncaught_(std::uncaught_exceptions()) {
  auto& m = *ddp_.impl_;
  DTRAIN_CHECK(!m.join, InvalidArgument, "[rank {}] dtrain::Join: this DistributedDataParallel is already in a join scope",
               m.pg->rank());
  DTRAIN_CHECK(!m.in_backward, InvalidArgument, "[rank {}] dtrain::Join: constructed during a backward pass",
               m.pg->rank());
  m.join.emplace();
  m.join->opts = options;
}

Join::~Join() noexcept(false) {
  if (finished_) return;
  if (std::uncaught_exceptions() > uncaught_) {
    ddp_.impl_->join.reset();  // leaving on an error: no collective here, the peers fail on their own
    return;
  }
  finish();
}

void Join::finish() {
  if (finished_) return;
  finished_ = true;
  auto& m = *ddp_.impl_;
  struct Leave {
    DistributedDataParallel::Impl& m;
    ~Leave() { m.join.reset(); }
  } leave{m};
  auto& js = *m.join;
  js.joined = true;
  const int64_t trained = js.passes;
  bool last_joiner = true;
  detail::Handshake h;
  try {
    for (;;) {
      m.startHandshake(/*running=*/false);
      h = m.readHandshake();
      if (h.running == 0) break;  // every rank has joined
      last_joiner = false;
      m.shadowPass(h);
      if (js.opts.throw_on_early_termination) break;
    }
  } catch (const std::exception&) {
    detail::rethrowWithContext(fmt::format(
        "[rank {}] dtrain::Join: this rank had joined (out of inputs after {} synced passes in the join scope) and "
        "was shadowing the other ranks' DDP gradient allreduces and buffer broadcasts, the only collectives a "
        "joined rank matches, when this failed. A rank still training issued another collective (e.g. "
        "dtrain::allGather, a barrier or a metric allreduce; do those after the join scope), or its next synced "
        "backward did not come within the timeout. ",
        m.pg->rank(), trained));
  }
  if (js.opts.throw_on_early_termination && h.running > 0) throw Error(m.earlyTerminationMessage(h));
  // Everyone leaves with the model of the last rank to join (the highest of them, as PyTorch).
  torch::NoGradGuard no_grad;
  int32_t source = last_joiner ? m.pg->rank() : -1;
  m.pg->allreduce(&source, 1, comm::DType::i32, comm::ReduceOp::max)->wait();
  m.broadcastFrom(source, m.params, "DDP parameter");
  m.broadcastFrom(source, m.buffers, "DDP buffer");
}

}  // namespace dtrain
