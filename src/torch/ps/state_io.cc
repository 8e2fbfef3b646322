// Checkpoint state I/O of the Worker: saveState() fetches the servers' state, loadState() restores it
// (see include/dtrain/ps.h for the keys).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <map>
#include <string>
#include <vector>

#include "update_rule.h"
#include "worker_impl.h"

namespace dtrain::ps {

// ------------------------------------------------------------------------------------------------
// Worker: server state for checkpoints
// ------------------------------------------------------------------------------------------------

std::map<std::string, at::Tensor> Worker::Impl::saveState() {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: saveState after finish()");
  DTRAIN_CHECK(connected(), InvalidArgument,
               "ps: saveState on a process that does not talk to the servers (local rank > 0 under local "
               "aggregation): call it on rank 0");
  std::map<std::string, at::Tensor> state;
  const int c = clock_;
  submit("saveState", [this, &state, c] {
    const int64_t slots = stateSlots(opts_);
    for (const auto& [name, e] : entries_) {
      if (e.sparse) {
        netGetRowsState(name, e, slots, c, state);
      } else {
        netGetDenseState(name, e, slots, c, state);
      }
    }
    state["#clock"] = at::full({1}, static_cast<int64_t>(c), at::kLong);
  })->wait();
  return state;
}

void Worker::Impl::netGetDenseState(const std::string& name, const Entry& e, int64_t slots, int c,
                                    std::map<std::string, at::Tensor>& state) {
  Batch b(rank_, sent_, received_);
  auto all = at::empty({slots, e.numel}, at::kFloat);
  auto steps = at::empty({static_cast<int64_t>(e.parts.size())}, at::kLong);
  auto versions = at::empty_like(steps);
  // Each element's update count, where a partition has them (pushes with `used` left elements out).
  auto elem_steps = at::empty({e.numel}, at::kLong);
  bool any_elem_steps = false;
  for (size_t i = 0; i < e.parts.size(); ++i) {
    const auto& p = e.parts[i];
    auto& pg = pgOf(p.server);
    b.sendHeader(p.server, pg, makeHeader(kGetState, p.key, c, 0));
    b.waitAll();
    Header r = b.recvReply(p.server, pg, kValues);
    if (r.key != p.key || r.count != p.count || r.row_dim != slots) {
      throw ProtocolError(fmt::format("[worker {}] server {}: state of partition {} is {} x {}, expected {} x {} "
                                      "(do the servers run the same update?)",
                                      rank_, p.server, p.key, r.row_dim, r.count, slots, p.count));
    }
    auto buf = at::empty({slots, p.count}, at::kFloat);
    b.recv(p.server, pg, buf.data_ptr<float>(), buf.numel(), DType::f32);
    all.narrow(1, p.offset, p.count).copy_(buf);
    if (r.flags & kFlagUsed) {
      b.recv(p.server, pg, elem_steps.data_ptr<int64_t>() + p.offset, p.count, DType::i64);
      any_elem_steps = true;
    } else {
      elem_steps.narrow(0, p.offset, p.count).fill_(r.aux);
    }
    steps[static_cast<int64_t>(i)] = r.aux;
    versions[static_cast<int64_t>(i)] = static_cast<int64_t>(r.clock);
  }
  state[name] = all;
  state[name + "#step"] = steps;
  state[name + "#version"] = versions;
  if (any_elem_steps) state[name + "#elem_steps"] = elem_steps;
}

void Worker::Impl::netGetRowsState(const std::string& name, const Entry& e, int64_t slots, int c,
                                   std::map<std::string, at::Tensor>& state) {
  Batch b(rank_, sent_, received_);
  std::vector<at::Tensor> ids, steps, data;
  for (int s = 0; s < num_servers_; ++s) {
    auto& pg = pgOf(s);
    b.sendHeader(s, pg, makeHeader(kGetState, e.key, c, 0, 0, kFlagRows));
    b.waitAll();
    Header r = b.recvReply(s, pg, kValues);
    if (r.key != e.key || r.count < 0 || r.count > localRowCount(e.num_rows, s, num_servers_) ||
        r.row_dim != slots * e.dim) {
      throw ProtocolError(fmt::format("[worker {}] server {}: state of table {}: {} rows x {}, expected at most "
                                      "{} x {}",
                                      rank_, s, e.key, r.count, r.row_dim,
                                      localRowCount(e.num_rows, s, num_servers_), slots * e.dim));
    }
    auto i = at::empty({r.count}, at::kLong), st = at::empty({r.count}, at::kLong);
    auto d = at::empty({r.count, slots * e.dim}, at::kFloat);
    b.recv(s, pg, i.data_ptr<int64_t>(), r.count, DType::i64);
    b.recv(s, pg, st.data_ptr<int64_t>(), r.count, DType::i64);
    b.recv(s, pg, d.data_ptr<float>(), d.numel(), DType::f32);
    ids.push_back(i);
    steps.push_back(st);
    data.push_back(d);
  }
  state[name + "#rows"] = at::cat(ids);
  state[name + "#steps"] = at::cat(steps);
  state[name + "#data"] = at::cat(data);
}

void Worker::Impl::loadState(const std::map<std::string, at::Tensor>& state) {
  DTRAIN_CHECK(!finished_, InvalidArgument, "ps: loadState after finish()");
  auto get = [&](const std::string& key, at::ScalarType t) {
    auto it = state.find(key);
    DTRAIN_CHECK(it != state.end(), InvalidArgument, "ps: loadState: the state has no '{}'", key);
    DTRAIN_CHECK(it->second.scalar_type() == t && it->second.device().is_cpu(), InvalidArgument,
                 "ps: loadState: '{}' is {}, expected {}", key, c10::toString(it->second.scalar_type()),
                 c10::toString(t));
    return it->second.contiguous();
  };
  const int64_t slots = stateSlots(opts_);
  auto clk = get("#clock", at::kLong);
  DTRAIN_CHECK(clk.numel() == 1 && clk.item<int64_t>() >= 0 && clk.item<int64_t>() < INT32_MAX, InvalidArgument,
               "ps: loadState: bad '#clock'");
  // Validate everything before anything is sent.
  for (const auto& [name, e] : entries_) {
    if (!e.sparse) {
      auto v = get(name, at::kFloat);
      DTRAIN_CHECK(v.dim() == 2 && v.size(0) == slots && v.size(1) == e.numel, InvalidArgument,
                   "ps: loadState: '{}' is {}, expected [{}, {}] (the same tensors and update mode)", name,
                   fmt::join(v.sizes(), ", "), slots, e.numel);
      for (const char* k : {"#step", "#version"})
        DTRAIN_CHECK(get(name + k, at::kLong).numel() == static_cast<int64_t>(e.parts.size()), InvalidArgument,
                     "ps: loadState: '{}{}' has the wrong length (another partition_bytes?)", name, k);
      if (state.count(name + "#elem_steps")) {
        auto es = get(name + "#elem_steps", at::kLong);
        DTRAIN_CHECK(es.numel() == e.numel && es.min().item<int64_t>() >= 0, InvalidArgument,
                     "ps: loadState: '{}#elem_steps' must hold {} update counts >= 0", name, e.numel);
      }
    } else {
      auto ids = get(name + "#rows", at::kLong);
      auto st = get(name + "#steps", at::kLong);
      auto d = get(name + "#data", at::kFloat);
      DTRAIN_CHECK(ids.dim() == 1 && st.numel() == ids.numel() && d.dim() == 2 && d.size(0) == ids.numel() &&
                       d.size(1) == slots * e.dim,
                   InvalidArgument, "ps: loadState: table '{}' state has inconsistent shapes", name);
      checkRows(ids, e, name);
    }
  }
  const int c = static_cast<int>(clk.item<int64_t>());
  clock_ = c;
  submit("loadState", [this, &get, &state, slots, c] {
    if (!connected()) return;
    if (rank_ == 0) {
      for (const auto& [name, e] : entries_) {
        if (e.sparse) {
          netSetRowsState(e, slots, get(name + "#rows", at::kLong), get(name + "#steps", at::kLong),
                          get(name + "#data", at::kFloat));
        } else {
          netSetDenseState(e, slots, get(name, at::kFloat), get(name + "#step", at::kLong),
                           get(name + "#version", at::kLong),
                           state.count(name + "#elem_steps") ? get(name + "#elem_steps", at::kLong) : at::Tensor());
        }
      }
    }
    Batch b(rank_, sent_, received_);
    netClock(kFlagSet, c);
    for (int s = 0; s < num_servers_; ++s) b.recvReply(s, pgOf(s), kAck);
  })->wait();
}

void Worker::Impl::netSetDenseState(const Entry& e, int64_t slots, const at::Tensor& v, const at::Tensor& steps,
                                    const at::Tensor& versions, const at::Tensor& elem_steps) {
  Batch b(rank_, sent_, received_);
  for (size_t i = 0; i < e.parts.size(); ++i) {
    const auto& p = e.parts[i];
    auto& pg = pgOf(p.server);
    auto buf = v.narrow(1, p.offset, p.count).contiguous();
    const auto version = static_cast<int32_t>(versions[static_cast<int64_t>(i)].item<int64_t>());
    b.sendHeader(p.server, pg,
                 makeHeader(kSetState, p.key, version, p.count, slots, elem_steps.defined() ? kFlagUsed : 0,
                            steps[static_cast<int64_t>(i)].item<int64_t>()));
    b.send(p.server, pg, buf.data_ptr<float>(), buf.numel(), DType::f32);
    at::Tensor es;
    if (elem_steps.defined()) {
      es = elem_steps.narrow(0, p.offset, p.count).contiguous();
      b.send(p.server, pg, es.data_ptr<int64_t>(), es.numel(), DType::i64);
    }
    b.waitAll();
    b.recvReply(p.server, pg, kAck);
  }
}

void Worker::Impl::netSetRowsState(const Entry& e, int64_t slots, const at::Tensor& ids, const at::Tensor& st,
                                   const at::Tensor& d) {
  Batch b(rank_, sent_, received_);
  auto owner = ids.remainder(num_servers_);
  for (int s = 0; s < num_servers_; ++s) {
    auto idx = (owner == s).nonzero().flatten();
    auto si = ids.index_select(0, idx).contiguous(), ss = st.index_select(0, idx).contiguous();
    auto sd = d.index_select(0, idx).contiguous();
    auto& pg = pgOf(s);
    // In messages of at most maxRowsPerMessage rows, as pushes are (the server allocates no more than one
    // message's worth from a claim): aux 0 on the first (the server clears the table), 1 on the others;
    // at least one message, so that an empty state clears it too.
    const int64_t most = maxRowsPerMessage(opts_, slots * e.dim), n = si.numel();
    for (int64_t start = 0; start == 0 || start < n; start += most) {
      const int64_t m = std::min(most, n - start);
      b.sendHeader(s, pg, makeHeader(kSetState, e.key, 0, m, slots * e.dim, kFlagRows, start == 0 ? 0 : 1));
      b.send(s, pg, si.data_ptr<int64_t>() + start, m, DType::i64);
      b.send(s, pg, ss.data_ptr<int64_t>() + start, m, DType::i64);
      b.send(s, pg, sd.data_ptr<float>() + start * slots * e.dim, m * slots * e.dim, DType::f32);
      b.waitAll();
      b.recvReply(s, pg, kAck);
    }
  }
}

}  // namespace dtrain::ps
