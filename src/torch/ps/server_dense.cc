// The server's handlers for dense partitions: declare, push / pull / pushPull (with the BSP and SSP
// gates), and their checkpoint state.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>

#include "server_state.h"

namespace dtrain::ps {

Server::State::Dense& Server::State::denseOf(int w, const Header& h, const char* what) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = dense.find(h.key);
  if (it == dense.end()) throw ProtocolError(fmt::format("{}: {} of unknown partition {}", who(w), what, h.key));
  return it->second;  // std::map: the reference stays valid
}

void Server::State::onDeclare(int w, ProcessGroup& pg, const Header& h) {
  const int64_t limit = partLimit(opts);
  if (h.count < 1 || h.count > limit) {
    throw ProtocolError(fmt::format("{}: declare of partition {} with {} elements (limit {})", who(w), h.key,
                                    h.count, limit));
  }
  bool init = h.flags & kFlagInit;
  if (init != (w == 0)) throw ProtocolError(fmt::format("{}: only worker 0 sends initial values", who(w)));
  if (init) {
    auto data = at::zeros({dense_rule.slots(), h.count}, at::kFloat);
    recvNow(pg, data.data_ptr<float>(), static_cast<size_t>(h.count), DType::f32);  // slot 0: the value
    {
      std::lock_guard<std::mutex> lk(mu);
      if (dense.count(h.key)) throw ProtocolError(fmt::format("{}: partition {} declared twice", who(w), h.key));
      Dense d;
      d.n = h.count;
      d.data = data;
      d.version = std::max(0, h.clock);  // declared at step c: the first bsp step is c
      d.pending.resize(static_cast<size_t>(num_workers));
      d.pending_used.resize(static_cast<size_t>(num_workers));
      dense.emplace(h.key, std::move(d));
    }
    cv.notify_all();
  } else {
    std::unique_lock<std::mutex> lk(mu);
    waitFor(lk, [&] { return dense.count(h.key) > 0; },
            [&] { return fmt::format("worker {} declared partition {} but worker 0 never did", w, h.key); });
    if (dense.at(h.key).n != h.count) {
      throw ProtocolError(fmt::format("{}: partition {} has {} elements here, {} at worker 0 (declare the same "
                                      "tensors in the same order on every worker)",
                                      who(w), h.key, h.count, dense.at(h.key).n));
    }
  }
  reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
}

void Server::State::apply(Dense& d, const at::Tensor& grad, const at::Tensor& used) {
  float* state = d.data.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  ++d.version;
  if (!used.defined() && d.elem_steps.empty()) {
    dense_rule.apply(state, d.n, g, d.n, d.steps);
    return;
  }
  // Runs of elements with a gradient and the same update count, each stepped with its own count (Adam's
  // bias correction counts a parameter's own updates, as in one process).
  if (d.elem_steps.empty()) d.elem_steps.assign(static_cast<size_t>(d.n), d.steps);
  const uint8_t* u = used.defined() ? used.data_ptr<uint8_t>() : nullptr;
  auto& st = d.elem_steps;
  for (int64_t i = 0; i < d.n;) {
    if (u && !u[i]) {
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < d.n && (!u || u[j]) && st[static_cast<size_t>(j)] == st[static_cast<size_t>(i)]) ++j;
    int64_t step = st[static_cast<size_t>(i)];
    dense_rule.apply(state + i, d.n, g + i, j - i, step);
    std::fill(st.begin() + i, st.begin() + j, step);
    i = j;
  }
  d.steps = *std::max_element(st.begin(), st.end());
}

void Server::State::bspPush(std::unique_lock<std::mutex>& lk, int w, const Header& h, Dense& d, at::Tensor grad,
                            at::Tensor used) {
  if (h.clock < d.version) {
    throw ProtocolError(fmt::format("{}: push of clock {} to partition {}, which is at step {}", who(w), h.clock,
                                    h.key, d.version));
  }
  // One step in flight: a push for the next step waits until this one is applied.
  waitFor(lk, [&] { return h.clock <= d.version; }, [&] {
    return fmt::format("BSP: worker {}'s push of clock {} waits for step {} of partition {}, which misses "
                       "pushes from workers {}",
                       w, h.clock, d.version, h.key, missingPushes(d));
  });
  if (d.pending[static_cast<size_t>(w)].defined()) {
    throw ProtocolError(fmt::format("{}: pushed partition {} twice in step {}", who(w), h.key, h.clock));
  }
  d.pending[static_cast<size_t>(w)] = std::move(grad);
  d.pending_used[static_cast<size_t>(w)] = std::move(used);
  if (++d.npending < num_workers) return;
  // Sum in worker order (deterministic), then one update with the mean (the workers without a gradient
  // for an element add zeros), of the elements some worker's push carries.
  at::Tensor sum = d.pending[0].clone();
  for (size_t k = 1; k < d.pending.size(); ++k) sum.add_(d.pending[k]);
  if (opts.update != PSOptions::Update::sum_only) sum.div_(static_cast<double>(num_workers));
  at::Tensor any;
  for (const auto& u : d.pending_used) {
    if (!u.defined()) {  // a push with every element
      any = at::Tensor();
      break;
    }
    any = any.defined() ? any.bitwise_or_(u) : u.clone();
  }
  apply(d, sum, any);
  for (auto& p : d.pending) p = at::Tensor();
  for (auto& u : d.pending_used) u = at::Tensor();
  d.npending = 0;
  cv.notify_all();
}

void Server::State::pullGate(std::unique_lock<std::mutex>& lk, int w, const Header& h, Dense& d, int64_t need) {
  if (opts.consistency == Consistency::bsp) {
    waitFor(lk, [&] { return d.version >= need; }, [&] {
      return fmt::format("BSP: worker {}'s pull of partition {} at clock {} waits for step {}, which misses "
                         "pushes from workers {}",
                         w, h.key, need, d.version, missingPushes(d));
    });
  } else if (opts.consistency == Consistency::ssp) {
    waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= opts.staleness; }, [&] {
      return fmt::format("SSP({}): worker {}'s pull at clock {} waits for workers {}", opts.staleness, w, h.clock,
                         behind(h.clock - opts.staleness));
    });
  }
}

void Server::State::onPush(int w, ProcessGroup& pg, const Header& h) {
  Dense& d = denseOf(w, h, opName(h.op));
  const int64_t n = d.n;  // fixed at declaration
  if (h.count != n) {
    throw ProtocolError(fmt::format("{}: {} of partition {} with {} elements, declared {}", who(w), opName(h.op),
                                    h.key, h.count, n));
  }
  at::Tensor grad, used;
  if (h.op != kPull) {
    grad = at::empty({n}, at::kFloat);
    recvNow(pg, grad.data_ptr<float>(), static_cast<size_t>(n), DType::f32);
    if (h.flags & kFlagUsed) {
      used = at::empty({n}, at::kByte);
      recvNow(pg, used.data_ptr<uint8_t>(), static_cast<size_t>(n), DType::u8);
      used.ne_(0);  // (any nonzero byte: used)
    }
  }
  std::unique_lock<std::mutex> lk(mu);
  if (grad.defined()) {
    if (opts.consistency == Consistency::bsp) {
      bspPush(lk, w, h, d, grad, used);
    } else {
      apply(d, grad, used);
      cv.notify_all();
    }
  }
  if (h.op == kPush) return;
  pullGate(lk, w, h, d, h.op == kPushPull ? int64_t{h.clock} + 1 : int64_t{h.clock});
  auto values = d.value().clone();
  lk.unlock();
  reply(pg, kValues, h.key, n, 0, values.data_ptr<float>(), static_cast<size_t>(n), DType::f32);
}

void Server::State::onGetState(int w, ProcessGroup& pg, const Header& h) {
  if (h.flags & kFlagRows) return onGetRowsState(w, pg, h);
  std::unique_lock<std::mutex> lk(mu);
  stateGate(lk, w, h);
  auto it = dense.find(h.key);
  if (it == dense.end()) throw ProtocolError(fmt::format("{}: getState of unknown partition {}", who(w), h.key));
  Dense& d = it->second;
  if (opts.consistency == Consistency::bsp) {
    waitFor(lk, [&] { return d.version >= h.clock; }, [&] {
      return fmt::format("BSP: worker {}'s saveState of partition {} at clock {} waits for step {}, which misses "
                         "pushes from workers {}",
                         w, h.key, h.clock, d.version, missingPushes(d));
    });
  }
  auto all = d.data.clone();
  const std::vector<int64_t> elem_steps = d.elem_steps;
  const Header r = makeHeader(kValues, h.key, static_cast<int32_t>(d.version), d.n, all.size(0),
                              elem_steps.empty() ? 0 : kFlagUsed, d.steps);
  lk.unlock();
  std::vector<std::pair<const void*, std::pair<size_t, DType>>> parts = {
      {&r, {sizeof(Header), DType::u8}}, {all.data_ptr<float>(), {static_cast<size_t>(all.numel()), DType::f32}}};
  if (!elem_steps.empty()) parts.push_back({elem_steps.data(), {elem_steps.size(), DType::i64}});
  sendAll(pg, parts);
}

void Server::State::onSetState(int w, ProcessGroup& pg, const Header& h) {
  if (w != 0) throw ProtocolError(fmt::format("{}: only worker 0 restores state", who(w)));
  if (h.flags & kFlagRows) return onSetRowsState(w, pg, h);
  const int64_t slots = dense_rule.slots();
  Dense& d = denseOf(w, h, "setState");
  const int64_t n = d.n;
  if (h.count != n || h.row_dim != slots || h.clock < 0 || h.aux < 0) {
    throw ProtocolError(fmt::format("{}: setState of partition {} as {} x {} (here {} x {})", who(w), h.key,
                                    h.row_dim, h.count, slots, n));
  }
  auto all = at::empty({slots, n}, at::kFloat);
  recvNow(pg, all.data_ptr<float>(), static_cast<size_t>(all.numel()), DType::f32);
  std::vector<int64_t> elem_steps;
  if (h.flags & kFlagUsed) {
    elem_steps.resize(static_cast<size_t>(n));
    recvNow(pg, elem_steps.data(), elem_steps.size(), DType::i64);
    for (int64_t s : elem_steps)
      if (s < 0) throw ProtocolError(fmt::format("{}: setState of partition {} with an update count of {}", who(w), h.key, s));
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    d.data.copy_(all);
    d.steps = h.aux;
    d.elem_steps = std::move(elem_steps);
    // A restored momentum buffer is used from the next update on (checkpoints of before the one update
    // rule counted only Adam's steps; a zero buffer continued gives the same values as a fresh one).
    if (dense_rule.kind() == UpdateRule::Kind::sgd_momentum) d.steps = std::max<int64_t>(d.steps, 1);
    if (dense_rule.kind() == UpdateRule::Kind::sgd_momentum)
      for (auto& s : d.elem_steps) s = std::max<int64_t>(s, 1);
    d.version = h.clock;
    for (auto& p : d.pending) p = at::Tensor();
    for (auto& u : d.pending_used) u = at::Tensor();
    d.npending = 0;
  }
  cv.notify_all();
  reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
}

}  // namespace dtrain::ps
