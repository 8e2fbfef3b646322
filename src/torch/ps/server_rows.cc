// The server's handlers for sparse tables: declareRows, pushRows, pullRows and their checkpoint state.
// Rows are random accesses over a large table, so the hot loops prefetch ahead.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "server_state.h"

namespace dtrain::ps {

namespace {
// A request's row ids, values and positions: per connection thread, reused across requests (no fresh
// pages per request).
thread_local std::vector<int64_t> t_ids;
thread_local std::vector<float> t_vals;
thread_local std::vector<int64_t> t_pos;
constexpr int64_t kAhead = 8;  // rows prefetched ahead
}  // namespace

Server::State::Rows& Server::State::tableOf(int w, const Header& h, const char* what) {
  std::lock_guard<std::mutex> lk(mu);
  auto it = tables.find(h.key);
  if (it == tables.end()) throw ProtocolError(fmt::format("{}: {} of unknown table {}", who(w), what, h.key));
  return it->second;  // std::map: the reference stays valid
}

void Server::State::onDeclareRows(int w, ProcessGroup& pg, const Header& h) {
  const int64_t limit = partLimit(opts);
  if (h.count < 1 || h.row_dim < 1 || h.row_dim > limit) {
    throw ProtocolError(fmt::format("{}: table {} of {} x {} (row limit {})", who(w), h.key, h.count, h.row_dim,
                                    limit));
  }
  if (localRowCount(h.count, index, num_servers) > std::numeric_limits<int32_t>::max()) {
    throw ProtocolError(fmt::format("{}: table {} of {} rows puts more than 2^31 - 1 rows on a server of {}; use "
                                    "more servers",
                                    who(w), h.key, h.count, num_servers));
  }
  std::unique_lock<std::mutex> lk(mu);
  if (w == 0) {
    if (tables.count(h.key)) throw ProtocolError(fmt::format("{}: table {} declared twice", who(w), h.key));
    tables[h.key].init(h.count, h.row_dim, row_rule.slots(), index, num_servers);
    cv.notify_all();
  } else {
    waitFor(lk, [&] { return tables.count(h.key) > 0; },
            [&] { return fmt::format("worker {} declared table {} but worker 0 never did", w, h.key); });
    const auto& t = tables.at(h.key);
    if (t.num_rows != h.count || t.dim != h.row_dim) {
      throw ProtocolError(fmt::format("{}: table {} is {} x {} here, {} x {} at worker 0", who(w), h.key, h.count,
                                      h.row_dim, t.num_rows, t.dim));
    }
  }
  lk.unlock();
  reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
}

Server::State::Rows& Server::State::recvRowsRequest(int w, ProcessGroup& pg, const Header& h) {
  Rows& t = tableOf(w, h, opName(h.op));
  const int64_t dim = t.dim;  // fixed at declaration
  if (h.row_dim != dim || h.count < 1 || h.count > maxRowsPerMessage(opts, dim)) {
    throw ProtocolError(fmt::format("{}: {} of {} rows x {} on table {} (dim {}, at most {} rows per message)",
                                    who(w), opName(h.op), h.count, h.row_dim, h.key, dim,
                                    maxRowsPerMessage(opts, dim)));
  }
  const int64_t n = h.count;
  t_ids.resize(static_cast<size_t>(n));
  t_vals.resize(static_cast<size_t>(n * dim));
  t_pos.resize(static_cast<size_t>(n));
  recvNow(pg, t_ids.data(), static_cast<size_t>(n), DType::i64);
  if (h.op == kPushRows) recvNow(pg, t_vals.data(), static_cast<size_t>(n * dim), DType::f32);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = t_ids[static_cast<size_t>(i)];
    if (id < 0 || id >= t.num_rows || id % num_servers != index) {
      throw ProtocolError(fmt::format("{}: row {} of table {} is not served here ({} rows, {} servers)", who(w), id,
                                      h.key, t.num_rows, num_servers));
    }
  }
  return t;
}

void Server::State::onPushRows(int w, ProcessGroup& pg, const Header& h) {
  Rows& t = recvRowsRequest(w, pg, h);
  const int64_t n = h.count, dim = t.dim;
  {
    std::unique_lock<std::shared_mutex> wl(t.rw);
    for (int64_t i = 0; i < n; ++i) t_pos[static_cast<size_t>(i)] = t.touch(t_ids[static_cast<size_t>(i)]);
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) t.prefetch(t_pos[static_cast<size_t>(i + kAhead)]);
      const int64_t pos = t_pos[static_cast<size_t>(i)];
      // Each push is applied at once, duplicates in turn.
      row_rule.apply(t.at(pos), dim, t_vals.data() + i * dim, dim, t.steps[static_cast<size_t>(pos)]);
    }
  }
  cv.notify_all();
}

void Server::State::onPullRows(int w, ProcessGroup& pg, const Header& h) {
  Rows& t = recvRowsRequest(w, pg, h);
  const int64_t n = h.count, dim = t.dim;
  {
    std::unique_lock<std::mutex> lk(mu);
    if (opts.consistency == Consistency::bsp) {
      waitFor(lk, [&] { return minClock() >= h.clock; }, [&] {
        return fmt::format("BSP: worker {}'s pullRows at clock {} waits for workers {}", w, h.clock, behind(h.clock));
      });
    } else if (opts.consistency == Consistency::ssp) {
      waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= opts.staleness; }, [&] {
        return fmt::format("SSP({}): worker {}'s pullRows at clock {} waits for workers {}", opts.staleness, w,
                           h.clock, behind(h.clock - opts.staleness));
      });
    }
  }
  {
    // Look the positions up first (prefetching the index), then copy the rows (prefetching a few ahead).
    std::shared_lock<std::shared_mutex> rl(t.rw);
    for (int64_t i = 0; i < n; ++i) {
      if (i + 2 * kAhead < n) t.prefetchIndex(t_ids[static_cast<size_t>(i + 2 * kAhead)]);
      t_pos[static_cast<size_t>(i)] = t.find(t_ids[static_cast<size_t>(i)]);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n) t.prefetch(t_pos[static_cast<size_t>(i + kAhead)]);
      const int64_t p = t_pos[static_cast<size_t>(i)];
      float* dst = t_vals.data() + i * dim;
      if (p < 0) {
        std::fill(dst, dst + dim, 0.0f);
      } else {
        std::memcpy(dst, t.at(p), static_cast<size_t>(dim) * sizeof(float));
      }
    }
  }
  reply(pg, kValues, h.key, n, dim, t_vals.data(), static_cast<size_t>(n * dim), DType::f32);
}

void Server::State::onGetRowsState(int w, ProcessGroup& pg, const Header& h) {
  std::unique_lock<std::mutex> lk(mu);
  stateGate(lk, w, h);
  auto it = tables.find(h.key);
  if (it == tables.end()) throw ProtocolError(fmt::format("{}: getState of unknown table {}", who(w), h.key));
  Rows& t = it->second;
  std::shared_lock<std::shared_mutex> rl(t.rw);
  const int64_t m = static_cast<int64_t>(t.ids.size());
  std::vector<float> data(static_cast<size_t>(m * t.stride));
  for (int64_t pos = 0; pos < m; ++pos)
    std::memcpy(data.data() + pos * t.stride, t.at(pos), static_cast<size_t>(t.stride) * sizeof(float));
  std::vector<int64_t> ids = t.ids, steps = t.steps;
  rl.unlock();
  lk.unlock();
  const Header r = makeHeader(kValues, h.key, 0, m, t.stride);
  sendAll(pg, {{&r, {sizeof(Header), DType::u8}},
               {ids.data(), {ids.size(), DType::i64}},
               {steps.data(), {steps.size(), DType::i64}},
               {data.data(), {data.size(), DType::f32}}});
}

void Server::State::onSetRowsState(int w, ProcessGroup& pg, const Header& h) {
  Rows& t = tableOf(w, h, "setState");
  // A table's state comes in messages of at most maxRowsPerMessage rows (Worker::netSetRowsState): aux 0
  // on the first, which clears the table.
  const int64_t stride = t.stride, limit_rows = maxRowsPerMessage(opts, stride);  // fixed at declaration
  if (h.count < 0 || h.count > limit_rows || h.row_dim != stride || h.aux < 0 || h.aux > 1) {
    throw ProtocolError(fmt::format("{}: setState of table {} with {} rows x {} (at most {} x {} a message), part "
                                    "flag {}",
                                    who(w), h.key, h.count, h.row_dim, limit_rows, stride, h.aux));
  }
  std::vector<int64_t> ids(static_cast<size_t>(h.count)), steps(static_cast<size_t>(h.count));
  std::vector<float> data(static_cast<size_t>(h.count * stride));
  recvNow(pg, ids.data(), ids.size(), DType::i64);
  recvNow(pg, steps.data(), steps.size(), DType::i64);
  recvNow(pg, data.data(), data.size(), DType::f32);
  {
    std::lock_guard<std::mutex> lk(mu);
    std::unique_lock<std::shared_mutex> wl(t.rw);
    if (h.aux == 0) t.clear();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= t.num_rows || ids[i] % num_servers != index || t.find(ids[i]) >= 0) {
        throw ProtocolError(fmt::format("{}: setState of table {}: row {} is not served here or repeated", who(w),
                                        h.key, ids[i]));
      }
      const int64_t pos = t.touch(ids[i]);
      t.steps[static_cast<size_t>(pos)] = steps[i];
      std::memcpy(t.at(pos), data.data() + static_cast<int64_t>(i) * stride,
                  static_cast<size_t>(stride) * sizeof(float));
    }
  }
  reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
}

}  // namespace dtrain::ps
