// The state of one parameter server (internal): dense partitions, sparse tables, the workers' clocks
// and the failure shared by the connections' threads, under one mutex and condition variable.
#pragma once
#include <ATen/core/Tensor.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "dtrain/comm/error.h"
#include "protocol.h"

namespace dtrain::ps {

struct Server::State {
  struct Dense {
    int64_t n = 0;
    at::Tensor value, buf, m, v;
    int64_t t = 0;        // adam steps
    int64_t version = 0;  // updates applied (bsp: steps)
    std::vector<at::Tensor> pending;  // bsp: this step's push of each worker
    int npending = 0;
  };
  // A sparse table's rows on this server (ids index, index + S, ...): one flat store, rows in chunks
  // allocated as rows are first touched, and an id -> position array. A row holds its value, then its
  // optimizer state (momentum buffer; or Adam's m and v): `slots` x dim floats.
  struct Rows {
    static constexpr int64_t kChunkRows = 1024;
    int64_t num_rows = 0, dim = 0, slots = 1, stride = 0;
    int num_servers = 1;
    std::vector<int32_t> where;                    // id / S -> position, -1 absent
    std::vector<int64_t> ids;                      // position -> id
    std::vector<int64_t> steps;                    // position -> updates applied (adam's t; momentum started)
    std::vector<std::unique_ptr<float[]>> chunks;  // zero-initialised
    // Guards the rows (not the table's existence, which `mu` guards): pulls copy rows under a shared
    // lock, so the connections' threads copy in parallel; pushes and restores take it exclusively.
    std::shared_mutex rw;

    void init(int64_t rows, int64_t d, int64_t sl, int index, int S) {
      num_rows = rows;
      dim = d;
      slots = sl;
      stride = d * sl;
      num_servers = S;
      where.assign(static_cast<size_t>(localRowCount(rows, index, S)), -1);
    }
    float* at(int64_t pos) { return chunks[static_cast<size_t>(pos / kChunkRows)].get() + (pos % kChunkRows) * stride; }
    // The row's position, or -1.
    int64_t find(int64_t id) const { return where[static_cast<size_t>(id / num_servers)]; }
    // The row's position, created as zeros if absent.
    int64_t touch(int64_t id) {
      int32_t& w = where[static_cast<size_t>(id / num_servers)];
      if (w >= 0) return w;
      const int64_t pos = static_cast<int64_t>(ids.size());
      if (pos % kChunkRows == 0) chunks.emplace_back(new float[static_cast<size_t>(kChunkRows * stride)]());
      ids.push_back(id);
      steps.push_back(0);
      w = static_cast<int32_t>(pos);
      return pos;
    }
    void clear() {
      std::fill(where.begin(), where.end(), -1);
      ids.clear();
      steps.clear();
      chunks.clear();
    }
  };

  std::shared_ptr<comm::Store> store;
  int index, num_servers, num_workers;
  PSOptions opts;

  std::mutex mu;
  std::condition_variable cv;
  std::map<uint32_t, Dense> dense;
  std::map<uint32_t, Rows> tables;
  std::vector<int> clocks;
  std::vector<int> restores;  // loadState clock-sets received, per worker
  std::vector<bool> done;
  std::vector<std::shared_ptr<ProcessGroup>> pgs;
  bool failed = false;
  std::string fail_msg;
  std::exception_ptr first_error;

  std::string tag() const { return fmt::format("[server {}]", index); }

  int minClock() const {
    int m = INT_MAX;
    for (int w = 0; w < num_workers; ++w)
      if (!done[static_cast<size_t>(w)]) m = std::min(m, clocks[static_cast<size_t>(w)]);
    return m;
  }

  // Waits (lock held) until pred() or failure; a wait past the timeout throws TimeoutError(why()).
  template <class Pred, class Why>
  void waitFor(std::unique_lock<std::mutex>& lk, Pred pred, Why why) {
    auto deadline = Clock::now() + opts.timeout;
    while (!failed && !pred()) {
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !failed && !pred()) {
        throw TimeoutError(fmt::format("{} {} after {} ms", tag(), why(), opts.timeout.count()));
      }
    }
    if (failed) throw Error(fail_msg);
  }

  std::string missingPushes(const Dense& d) const {
    std::vector<int> miss;
    for (int w = 0; w < num_workers; ++w)
      if (!d.pending[static_cast<size_t>(w)].defined()) miss.push_back(w);
    return fmt::format("[{}]", fmt::join(miss, ", "));
  }
  std::string behind(int needed) const {
    std::vector<std::string> miss;
    for (int w = 0; w < num_workers; ++w)
      if (!done[static_cast<size_t>(w)] && clocks[static_cast<size_t>(w)] < needed)
        miss.push_back(fmt::format("{} (clock {})", w, clocks[static_cast<size_t>(w)]));
    return fmt::format("[{}]", fmt::join(miss, ", "));
  }

  // The optimizer step on a dense partition (lock held); update_rule.cc.
  void apply(Dense& d, const at::Tensor& grad);
  static void prefetchRow(Rows& t, int64_t pos);
  // The update of one sparse row (its table's rw lock held exclusively). Each push is applied at once.
  void applyRow(Rows& t, int64_t pos, const float* g);

  void fail(const std::string& msg, std::exception_ptr err) {
    std::vector<std::shared_ptr<ProcessGroup>> others;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (failed) return;
      failed = true;
      fail_msg = msg;
      first_error = err;
      others = pgs;
    }
    cv.notify_all();
    for (auto& pg : others) {
      if (!pg) continue;
      try {
        pg->abort(msg);
      } catch (...) {
      }
    }
  }

  void serve(int w);
  bool handle(int w, ProcessGroup& pg, const Header& h);
};

}  // namespace dtrain::ps
