// The parameter Server: one thread per worker connection serving its requests against the shared
// state (server_state.h), and ColocatedServer.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <thread>

#include "server_state.h"

namespace dtrain::ps {

namespace {
void sendAll(ProcessGroup& pg, const std::vector<std::pair<const void*, std::pair<size_t, DType>>>& parts) {
  std::vector<WorkPtr> ws;
  for (const auto& [p, cd] : parts)
    if (cd.first > 0) ws.push_back(pg.send(p, cd.first, cd.second, 0));
  for (auto& w : ws) w->wait();
}
void recvNow(ProcessGroup& pg, void* p, size_t count, DType t) {
  if (count > 0) pg.recv(p, count, t, 0)->wait();
}
void reply(ProcessGroup& pg, uint16_t op, uint32_t key, int64_t count, int64_t row_dim, const void* payload,
           size_t payload_count, DType t) {
  Header h;
  h.op = op;
  h.key = key;
  h.count = count;
  h.row_dim = row_dim;
  sendAll(pg, {{&h, {sizeof(Header), DType::u8}}, {payload, {payload_count, t}}});
}
}  // namespace

// Handles one request; returns false after the goodbye.
bool Server::State::handle(int w, ProcessGroup& pg, const Header& h) {
  const std::string who = fmt::format("{} worker {}", tag(), w);
  const int64_t limit = partLimit(opts);
  const size_t W = static_cast<size_t>(num_workers);
  switch (h.op) {
    case kDeclare: {
      if (h.count < 1 || h.count > limit) {
        throw ProtocolError(fmt::format("{}: declare of partition {} with {} elements (limit {})", who, h.key,
                                        h.count, limit));
      }
      bool init = h.flags & kFlagInit;
      if (init != (w == 0)) throw ProtocolError(fmt::format("{}: only worker 0 sends initial values", who));
      if (init) {
        auto value = at::empty({h.count}, at::kFloat);
        recvNow(pg, value.data_ptr<float>(), static_cast<size_t>(h.count), DType::f32);
        {
          std::lock_guard<std::mutex> lk(mu);
          if (dense.count(h.key)) throw ProtocolError(fmt::format("{}: partition {} declared twice", who, h.key));
          Dense d;
          d.n = h.count;
          d.value = value;
          d.version = std::max(0, h.clock);  // declared at step c: the first bsp step is c
          d.pending.resize(W);
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
                                          who, h.key, h.count, dense.at(h.key).n));
        }
      }
      reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kDeclareRows: {
      if (h.count < 1 || h.row_dim < 1 || h.row_dim > limit) {
        throw ProtocolError(fmt::format("{}: table {} of {} x {} (row limit {})", who, h.key, h.count, h.row_dim,
                                        limit));
      }
      std::unique_lock<std::mutex> lk(mu);
      if (w == 0) {
        if (tables.count(h.key)) throw ProtocolError(fmt::format("{}: table {} declared twice", who, h.key));
        tables[h.key].init(h.count, h.row_dim, stateSlots(opts), index, num_servers);
        cv.notify_all();
      } else {
        waitFor(lk, [&] { return tables.count(h.key) > 0; },
                [&] { return fmt::format("worker {} declared table {} but worker 0 never did", w, h.key); });
        const auto& t = tables.at(h.key);
        if (t.num_rows != h.count || t.dim != h.row_dim) {
          throw ProtocolError(fmt::format("{}: table {} is {} x {} here, {} x {} at worker 0", who, h.key, h.count,
                                          h.row_dim, t.num_rows, t.dim));
        }
      }
      lk.unlock();
      reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kPush:
    case kPull:
    case kPushPull: {
      int64_t n;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto it = dense.find(h.key);
        if (it == dense.end()) throw ProtocolError(fmt::format("{}: {} of unknown partition {}", who, opName(h.op), h.key));
        n = it->second.n;
      }
      if (h.count != n) {
        throw ProtocolError(fmt::format("{}: {} of partition {} with {} elements, declared {}", who, opName(h.op),
                                        h.key, h.count, n));
      }
      at::Tensor grad;
      if (h.op != kPull) {
        grad = at::empty({n}, at::kFloat);
        recvNow(pg, grad.data_ptr<float>(), static_cast<size_t>(n), DType::f32);
      }
      std::unique_lock<std::mutex> lk(mu);
      Dense& d = dense.at(h.key);
      if (grad.defined()) {
        if (opts.consistency == Consistency::bsp) {
          if (h.clock < d.version) {
            throw ProtocolError(fmt::format("{}: push of clock {} to partition {}, which is at step {}", who, h.clock,
                                            h.key, d.version));
          }
          // One step in flight: a push for the next step waits until this one is applied.
          waitFor(lk, [&] { return h.clock <= d.version; }, [&] {
            return fmt::format("BSP: worker {}'s push of clock {} waits for step {} of partition {}, which misses "
                               "pushes from workers {}",
                               w, h.clock, d.version, h.key, missingPushes(d));
          });
          if (d.pending[static_cast<size_t>(w)].defined()) {
            throw ProtocolError(fmt::format("{}: pushed partition {} twice in step {}", who, h.key, h.clock));
          }
          d.pending[static_cast<size_t>(w)] = grad;
          if (++d.npending == num_workers) {
            // Sum in worker order (deterministic), then one update with the mean.
            at::Tensor sum = d.pending[0].clone();
            for (size_t k = 1; k < W; ++k) sum.add_(d.pending[k]);
            if (opts.update != PSOptions::Update::sum_only) sum.div_(static_cast<double>(num_workers));
            apply(d, sum);
            for (auto& p : d.pending) p = at::Tensor();
            d.npending = 0;
            cv.notify_all();
          }
        } else {
          apply(d, grad);
          cv.notify_all();
        }
      }
      if (h.op == kPush) return true;
      // The pull's gate.
      if (opts.consistency == Consistency::bsp) {
        int64_t need = h.op == kPushPull ? int64_t{h.clock} + 1 : int64_t{h.clock};
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
      auto values = d.value.clone();
      lk.unlock();
      reply(pg, kValues, h.key, n, 0, values.data_ptr<float>(), static_cast<size_t>(n), DType::f32);
      return true;
    }
    case kPushRows:
    case kPullRows: {
      int64_t dim;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto it = tables.find(h.key);
        if (it == tables.end()) throw ProtocolError(fmt::format("{}: {} of unknown table {}", who, opName(h.op), h.key));
        dim = it->second.dim;
      }
      if (h.row_dim != dim || h.count < 1 || h.count > maxRowsPerMessage(opts, dim)) {
        throw ProtocolError(fmt::format("{}: {} of {} rows x {} on table {} (dim {}, at most {} rows per message)",
                                        who, opName(h.op), h.count, h.row_dim, h.key, dim,
                                        maxRowsPerMessage(opts, dim)));
      }
      const int64_t n = h.count;
      // Per connection thread, reused across requests: no fresh pages per request.
      thread_local std::vector<int64_t> ids;
      thread_local std::vector<float> vals;
      ids.resize(static_cast<size_t>(n));
      vals.resize(static_cast<size_t>(n * dim));
      recvNow(pg, ids.data(), static_cast<size_t>(n), DType::i64);
      if (h.op == kPushRows) recvNow(pg, vals.data(), static_cast<size_t>(n * dim), DType::f32);
      std::unique_lock<std::mutex> lk(mu);
      Rows& t = tables.at(h.key);  // std::map: the reference stays valid
      for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[static_cast<size_t>(i)];
        if (id < 0 || id >= t.num_rows || id % num_servers != index) {
          throw ProtocolError(fmt::format("{}: row {} of table {} is not served here ({} rows, {} servers)", who, id,
                                          h.key, t.num_rows, num_servers));
        }
      }
      // Rows are random accesses over a large table: look the positions up first (prefetching the index),
      // then touch the rows (prefetching a few ahead).
      thread_local std::vector<int64_t> pos;
      pos.resize(static_cast<size_t>(n));
      constexpr int64_t kAhead = 8;
      if (h.op == kPushRows) {
        lk.unlock();
        {
          std::unique_lock<std::shared_mutex> wl(t.rw);
          for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = t.touch(ids[static_cast<size_t>(i)]);
          for (int64_t i = 0; i < n; ++i) {
            if (i + kAhead < n) prefetchRow(t, pos[static_cast<size_t>(i + kAhead)]);
            applyRow(t, pos[static_cast<size_t>(i)], vals.data() + i * dim);
          }
        }
        cv.notify_all();
        return true;
      }
      if (opts.consistency == Consistency::bsp) {
        waitFor(lk, [&] { return minClock() >= h.clock; }, [&] {
          return fmt::format("BSP: worker {}'s pullRows at clock {} waits for workers {}", w, h.clock,
                             behind(h.clock));
        });
      } else if (opts.consistency == Consistency::ssp) {
        waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= opts.staleness; }, [&] {
          return fmt::format("SSP({}): worker {}'s pullRows at clock {} waits for workers {}", opts.staleness, w,
                             h.clock, behind(h.clock - opts.staleness));
        });
      }
      lk.unlock();
      {
        std::shared_lock<std::shared_mutex> rl(t.rw);
        for (int64_t i = 0; i < n; ++i) {
          if (i + 2 * kAhead < n) __builtin_prefetch(&t.where[static_cast<size_t>(ids[static_cast<size_t>(i + 2 * kAhead)] / num_servers)]);
          pos[static_cast<size_t>(i)] = t.find(ids[static_cast<size_t>(i)]);
        }
        for (int64_t i = 0; i < n; ++i) {
          if (i + kAhead < n) prefetchRow(t, pos[static_cast<size_t>(i + kAhead)]);
          const int64_t p = pos[static_cast<size_t>(i)];
          float* dst = vals.data() + i * dim;
          if (p < 0) {
            std::fill(dst, dst + dim, 0.0f);
          } else {
            std::memcpy(dst, t.at(p), static_cast<size_t>(dim) * sizeof(float));
          }
        }
      }
      reply(pg, kValues, h.key, n, dim, vals.data(), static_cast<size_t>(n * dim), DType::f32);
      return true;
    }
    case kGetState: {
      const int64_t slots = stateSlots(opts);
      std::unique_lock<std::mutex> lk(mu);
      // Gated like a pull at the requester's clock.
      if (opts.consistency == Consistency::bsp || opts.consistency == Consistency::ssp) {
        const int64_t lag = opts.consistency == Consistency::ssp ? opts.staleness : 0;
        waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= lag; }, [&] {
          return fmt::format("worker {}'s saveState at clock {} waits for workers {}", w, h.clock,
                             behind(static_cast<int>(h.clock - lag)));
        });
      }
      if (h.flags & kFlagRows) {
        auto it = tables.find(h.key);
        if (it == tables.end()) throw ProtocolError(fmt::format("{}: getState of unknown table {}", who, h.key));
        Rows& t = it->second;
        std::shared_lock<std::shared_mutex> rl(t.rw);
        const int64_t m = static_cast<int64_t>(t.ids.size());
        std::vector<float> data(static_cast<size_t>(m * t.stride));
        for (int64_t pos = 0; pos < m; ++pos)
          std::memcpy(data.data() + pos * t.stride, t.at(pos), static_cast<size_t>(t.stride) * sizeof(float));
        std::vector<int64_t> ids = t.ids, steps = t.steps;
        rl.unlock();
        lk.unlock();
        Header r;
        r.op = kValues;
        r.key = h.key;
        r.count = m;
        r.row_dim = t.stride;
        sendAll(pg, {{&r, {sizeof(Header), DType::u8}},
                     {ids.data(), {ids.size(), DType::i64}},
                     {steps.data(), {steps.size(), DType::i64}},
                     {data.data(), {data.size(), DType::f32}}});
        return true;
      }
      auto it = dense.find(h.key);
      if (it == dense.end()) throw ProtocolError(fmt::format("{}: getState of unknown partition {}", who, h.key));
      Dense& d = it->second;
      if (opts.consistency == Consistency::bsp) {
        waitFor(lk, [&] { return d.version >= h.clock; }, [&] {
          return fmt::format("BSP: worker {}'s saveState of partition {} at clock {} waits for step {}, which misses "
                             "pushes from workers {}",
                             w, h.key, h.clock, d.version, missingPushes(d));
        });
      }
      auto all = at::zeros({slots, d.n}, at::kFloat);
      all[0].copy_(d.value);
      if (slots == 2 && d.buf.defined()) all[1].copy_(d.buf);
      if (slots == 3 && d.m.defined()) {
        all[1].copy_(d.m);
        all[2].copy_(d.v);
      }
      Header r;
      r.op = kValues;
      r.key = h.key;
      r.count = d.n;
      r.row_dim = slots;
      r.aux = d.t;
      r.clock = static_cast<int32_t>(d.version);
      lk.unlock();
      sendAll(pg, {{&r, {sizeof(Header), DType::u8}}, {all.data_ptr<float>(), {static_cast<size_t>(all.numel()), DType::f32}}});
      return true;
    }
    case kSetState: {
      const int64_t slots = stateSlots(opts);
      if (w != 0) throw ProtocolError(fmt::format("{}: only worker 0 restores state", who));
      if (h.flags & kFlagRows) {
        int64_t limit_rows, stride;
        {
          std::lock_guard<std::mutex> lk(mu);
          auto it = tables.find(h.key);
          if (it == tables.end()) throw ProtocolError(fmt::format("{}: setState of unknown table {}", who, h.key));
          limit_rows = static_cast<int64_t>(it->second.where.size());
          stride = it->second.stride;
        }
        if (h.count < 0 || h.count > limit_rows || h.row_dim != stride) {
          throw ProtocolError(fmt::format("{}: setState of table {} with {} rows x {} (at most {} x {} here)", who,
                                          h.key, h.count, h.row_dim, limit_rows, stride));
        }
        std::vector<int64_t> ids(static_cast<size_t>(h.count)), steps(static_cast<size_t>(h.count));
        std::vector<float> data(static_cast<size_t>(h.count * stride));
        recvNow(pg, ids.data(), ids.size(), DType::i64);
        recvNow(pg, steps.data(), steps.size(), DType::i64);
        recvNow(pg, data.data(), data.size(), DType::f32);
        {
          std::lock_guard<std::mutex> lk(mu);
          Rows& t = tables.at(h.key);
          std::unique_lock<std::shared_mutex> wl(t.rw);
          t.clear();
          for (size_t i = 0; i < ids.size(); ++i) {
            if (ids[i] < 0 || ids[i] >= t.num_rows || ids[i] % num_servers != index || t.find(ids[i]) >= 0) {
              throw ProtocolError(fmt::format("{}: setState of table {}: row {} is not served here or repeated", who,
                                              h.key, ids[i]));
            }
            const int64_t pos = t.touch(ids[i]);
            t.steps[static_cast<size_t>(pos)] = steps[i];
            std::memcpy(t.at(pos), data.data() + static_cast<int64_t>(i) * stride,
                        static_cast<size_t>(stride) * sizeof(float));
          }
        }
        reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
        return true;
      }
      int64_t n;
      {
        std::lock_guard<std::mutex> lk(mu);
        auto it = dense.find(h.key);
        if (it == dense.end()) throw ProtocolError(fmt::format("{}: setState of unknown partition {}", who, h.key));
        n = it->second.n;
      }
      if (h.count != n || h.row_dim != slots || h.clock < 0 || h.aux < 0) {
        throw ProtocolError(fmt::format("{}: setState of partition {} as {} x {} (here {} x {})", who, h.key,
                                        h.row_dim, h.count, slots, n));
      }
      auto all = at::empty({slots, n}, at::kFloat);
      recvNow(pg, all.data_ptr<float>(), static_cast<size_t>(all.numel()), DType::f32);
      {
        std::lock_guard<std::mutex> lk(mu);
        Dense& d = dense.at(h.key);
        d.value.copy_(all[0]);
        if (slots == 2) d.buf = all[1].clone();
        if (slots == 3) {
          d.m = all[1].clone();
          d.v = all[2].clone();
        }
        d.t = h.aux;
        d.version = h.clock;
        for (auto& p : d.pending) p = at::Tensor();
        d.npending = 0;
      }
      cv.notify_all();
      reply(pg, kAck, h.key, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kClock: {
      const bool set = h.flags & kFlagSet;
      {
        std::unique_lock<std::mutex> lk(mu);
        int& c = clocks[static_cast<size_t>(w)];
        if (set) {
          // loadState: worker 0 restored this server's state before this message; the others wait for
          // that (their next pushes must not land before the restore), then everyone is acknowledged.
          if (h.clock < 0) throw ProtocolError(fmt::format("{}: clock set to {}", who, h.clock));
          c = h.clock;
          const int k = ++restores[static_cast<size_t>(w)];
          if (w == 0) {
            cv.notify_all();
          } else {
            waitFor(lk, [&] { return restores[0] >= k; },
                    [&] { return fmt::format("worker {}'s loadState waits for worker 0's", w); });
          }
        } else {
          if (h.clock != c + 1) throw ProtocolError(fmt::format("{}: clock {} after {}", who, h.clock, c));
          c = h.clock;
        }
      }
      cv.notify_all();
      if (set) reply(pg, kAck, 0, 0, 0, nullptr, 0, DType::u8);
      return true;
    }
    case kBye: {
      {
        std::lock_guard<std::mutex> lk(mu);
        done[static_cast<size_t>(w)] = true;
      }
      cv.notify_all();
      reply(pg, kAck, 0, 0, 0, nullptr, 0, DType::u8);
      return false;
    }
    default:
      throw ProtocolError(fmt::format("{}: unknown request op {}", who, h.op));
  }
}

void Server::State::serve(int w) {
  std::shared_ptr<ProcessGroup> pg;
  try {
    // The server waits for a worker's next request as long as it takes (a worker may compute for a long
    // time); dead workers are found by the transport at once. Its own waits (BSP/SSP) use opts.timeout.
    // A store connection per worker thread: the rendezvous waits of one do not hold up the others (nor,
    // for a colocated server, the worker in this process).
    pg = ProcessGroup::create(pairStore(store->clone(), w, index), 1, 2, groupOptions(std::chrono::hours(24 * 7)));
    {
      std::lock_guard<std::mutex> lk(mu);
      pgs[static_cast<size_t>(w)] = pg;
      if (failed) pg->abort(fail_msg);
    }
    for (;;) {
      Header h;
      recvNow(*pg, &h, sizeof(Header), DType::u8);
      if (h.magic != kMagic) {
        throw ProtocolError(fmt::format("{} worker {}: bad request magic {:#x}", tag(), w, h.magic));
      }
      if (!handle(w, *pg, h)) break;
    }
  } catch (const std::exception& e) {
    bool mine = false;
    std::string msg;
    {
      std::lock_guard<std::mutex> lk(mu);
      mine = !failed;
      msg = failed ? fail_msg : std::string(e.what());
    }
    if (mine && msg.find(tag()) == std::string::npos) msg = fmt::format("{} worker {}: {}", tag(), w, msg);
    // Tell this worker why (it reads the error at its next reply), then everyone else.
    if (pg) {
      try {
        std::string m = msg.substr(0, static_cast<size_t>(kMaxErrorBytes));
        Header h;
        h.op = kError;
        h.count = static_cast<int64_t>(m.size());
        auto w1 = pg->send(&h, sizeof(Header), DType::u8, 0);
        auto w2 = pg->send(m.data(), m.size(), DType::u8, 0);
        w1->wait(std::chrono::seconds(2));
        w2->wait(std::chrono::seconds(2));
      } catch (...) {
      }
    }
    if (mine) {
      fail(msg, sameType(e, msg));
    }
  }
}

Server::Server(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers, PSOptions opts)
    : state_(std::make_unique<State>()) {
  DTRAIN_CHECK(num_servers >= 1 && index >= 0 && index < num_servers, InvalidArgument,
               "ps::Server: index {} of {} servers", index, num_servers);
  DTRAIN_CHECK(num_workers >= 1, InvalidArgument, "ps::Server: {} workers", num_workers);
  DTRAIN_CHECK(opts.staleness >= 0, InvalidArgument, "ps: staleness {} < 0", opts.staleness);
  DTRAIN_CHECK(store != nullptr, InvalidArgument, "ps::Server: no store");
  auto& s = *state_;
  s.store = std::move(store);
  s.index = index;
  s.num_servers = num_servers;
  s.num_workers = num_workers;
  s.opts = opts;
  s.clocks.assign(static_cast<size_t>(num_workers), 0);
  s.restores.assign(static_cast<size_t>(num_workers), 0);
  s.done.assign(static_cast<size_t>(num_workers), false);
  s.pgs.resize(static_cast<size_t>(num_workers));
}

Server::~Server() = default;

void Server::abort(const std::string& reason) {
  const std::string msg = fmt::format("{} {}", state_->tag(), reason);
  state_->fail(msg, std::make_exception_ptr(Error(msg)));
}

void Server::run() {
  auto& s = *state_;
  std::vector<std::thread> threads;
  for (int w = 0; w < s.num_workers; ++w) threads.emplace_back([&s, w] { s.serve(w); });
  for (auto& t : threads) t.join();
  if (s.first_error) std::rethrow_exception(s.first_error);
}

ColocatedServer::ColocatedServer(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers,
                                 PSOptions opts)
    : server_(std::make_unique<Server>(std::move(store), index, num_servers, num_workers, opts)),
      timeout_(opts.timeout) {
  thread_ = std::thread([this] {
    try {
      server_->run();
    } catch (...) {
      error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      ended_ = true;
    }
    cv_.notify_all();
  });
}

ColocatedServer::~ColocatedServer() {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_for(lk, timeout_, [&] { return ended_; })) {
    lk.unlock();
    server_->abort(fmt::format("colocated server stopped: its process is shutting down and the workers did not "
                               "finish within {} ms",
                               timeout_.count()));
  } else {
    lk.unlock();
  }
  thread_.join();
}

void ColocatedServer::join() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(error_);
}

}  // namespace dtrain::ps
