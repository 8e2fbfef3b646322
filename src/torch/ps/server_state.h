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
#include "deadlines.h"
#include "protocol.h"
#include "update_rule.h"

namespace dtrain::ps {

// Handlers: one member function per request kind (server.cc: declarations, clock, goodbye, dispatch;
// server_dense.cc: dense partitions; server_rows.cc: sparse tables). Each gets the request's header
// and its connection; it receives the payload, acts, and replies.
struct Server::State {
  // A dense partition: `slots` x n floats, the value and then the optimizer state (update_rule.h).
  struct Dense {
    int64_t n = 0;
    at::Tensor data;      // [slots, n], optimizer state zero until the first update
    int64_t steps = 0;    // updates applied to the state (Adam's t; momentum started)
    int64_t version = 0;  // updates applied (bsp: steps)
    std::vector<at::Tensor> pending;  // bsp: this step's push of each worker
    std::vector<at::Tensor> pending_used;  // bsp: its elements with a gradient (kFlagUsed; undefined: all)
    int npending = 0;
    // Each element's updates, once a push left some element out (empty until then: `steps` for all).
    std::vector<int64_t> elem_steps;
    at::Tensor value() const { return data[0]; }
  };
  // A sparse table's rows on this server (ids index, index + S, ...): one flat store, rows in chunks
  // allocated as rows are first touched, and an id -> position index in pages of kPageRows, also allocated
  // when first touched (a declaration's row count, a peer's claim, costs 8 bytes per page up front: 256 KB
  // at most, the 2^31 - 1 rows a server can hold). A row holds its value, then its optimizer state
  // (momentum buffer; or Adam's m and v): `slots` x dim floats.
  struct Rows {
    static constexpr int64_t kChunkRows = 1024;
    int64_t num_rows = 0, dim = 0, slots = 1, stride = 0;
    int num_servers = 1;
    static constexpr int kPageShift = 16;
    static constexpr int64_t kPageRows = int64_t{1} << kPageShift;
    std::vector<std::unique_ptr<int32_t[]>> pages;  // (id / S) / kPageRows -> positions, -1 absent; null: none
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
      pages.clear();
      pages.resize(static_cast<size_t>((localRowCount(rows, index, S) + kPageRows - 1) / kPageRows));
    }
    float* at(int64_t pos) { return chunks[static_cast<size_t>(pos / kChunkRows)].get() + (pos % kChunkRows) * stride; }
    // Starts loading the row at pos (if any) into the cache.
    void prefetch(int64_t pos) {
      if (pos < 0) return;
      const char* p = reinterpret_cast<const char*>(at(pos));
      for (int64_t b = 0; b < stride * 4; b += 64) __builtin_prefetch(p + b);
    }
    // The row's position, or -1.
    int64_t find(int64_t id) const {
      const int64_t local = id / num_servers;
      const auto& page = pages[static_cast<size_t>(local >> kPageShift)];
      return page ? page[local & (kPageRows - 1)] : -1;
    }
    // Starts loading the index entry of id (if its page exists) into the cache.
    void prefetchIndex(int64_t id) const {
      const int64_t local = id / num_servers;
      const auto& page = pages[static_cast<size_t>(local >> kPageShift)];
      if (page) __builtin_prefetch(&page[local & (kPageRows - 1)]);
    }
    // The row's position, created as zeros if absent.
    int64_t touch(int64_t id) {
      const int64_t local = id / num_servers;
      auto& page = pages[static_cast<size_t>(local >> kPageShift)];
      if (!page) {
        page.reset(new int32_t[kPageRows]);
        std::fill(page.get(), page.get() + kPageRows, -1);
      }
      int32_t& w = page[local & (kPageRows - 1)];
      if (w >= 0) return w;
      const int64_t pos = static_cast<int64_t>(ids.size());
      if (pos % kChunkRows == 0) chunks.emplace_back(new float[static_cast<size_t>(kChunkRows * stride)]());
      ids.push_back(id);
      steps.push_back(0);
      w = static_cast<int32_t>(pos);
      return pos;
    }
    void clear() {
      for (auto& page : pages) page.reset();
      ids.clear();
      steps.clear();
      chunks.clear();
    }
  };

  State(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers, PSOptions opts);

  std::shared_ptr<comm::Store> store;
  int index, num_servers, num_workers;
  PSOptions opts;
  Deadlines deadlines;
  UpdateRule dense_rule;  // bsp + sum_only: a partition's value becomes the step's sum
  UpdateRule row_rule;    // sparse rows: every push is applied at once

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

  // Waits (lock held) until pred() or failure; a wait past deadlines.server_wait throws
  // TimeoutError(why()).
  template <class Pred, class Why>
  void waitFor(std::unique_lock<std::mutex>& lk, Pred pred, Why why) {
    auto deadline = Clock::now() + deadlines.server_wait;
    while (!failed && !pred()) {
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && !failed && !pred()) {
        throw TimeoutError(fmt::format("{} {} after {} ms", tag(), why(), deadlines.server_wait.count()));
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

  // The optimizer step on a dense partition (lock held), on the elements of `used` (u8; undefined: all):
  // the others keep their value and optimizer state, as one process's optimizer skips a parameter
  // without a gradient (server_dense.cc).
  void apply(Dense& d, const at::Tensor& grad, const at::Tensor& used = {});

  // A pull's gate at the puller's clock (lock held): bsp waits for the partition's version `need`,
  // ssp for the slowest worker.
  void pullGate(std::unique_lock<std::mutex>& lk, int w, const Header& h, Dense& d, int64_t need);
  // A bsp push (lock held): kept until every worker's push of the step is in, then one update.
  void bspPush(std::unique_lock<std::mutex>& lk, int w, const Header& h, Dense& d, at::Tensor grad, at::Tensor used);

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
  // Handles one request; returns false after the goodbye.
  bool handle(int w, ProcessGroup& pg, const Header& h);
  void onDeclare(int w, ProcessGroup& pg, const Header& h);
  void onDeclareRows(int w, ProcessGroup& pg, const Header& h);
  void onPush(int w, ProcessGroup& pg, const Header& h);  // kPush, kPull and kPushPull
  void onPushRows(int w, ProcessGroup& pg, const Header& h);
  void onPullRows(int w, ProcessGroup& pg, const Header& h);
  void onGetState(int w, ProcessGroup& pg, const Header& h);
  void onGetRowsState(int w, ProcessGroup& pg, const Header& h);
  void onSetState(int w, ProcessGroup& pg, const Header& h);
  void onSetRowsState(int w, ProcessGroup& pg, const Header& h);
  void onClock(int w, ProcessGroup& pg, const Header& h);
  void onBye(int w, ProcessGroup& pg, const Header& h);
  std::string who(int w) const { return fmt::format("{} worker {}", tag(), w); }
  // The partition / table of a request, ProtocolError if unknown (takes mu).
  Dense& denseOf(int w, const Header& h, const char* what);
  Rows& tableOf(int w, const Header& h, const char* what);
  // A pushRows / pullRows request's table, its ids (and pushed values) received and checked into this
  // connection thread's buffers (server_rows.cc).
  Rows& recvRowsRequest(int w, ProcessGroup& pg, const Header& h);
  // saveState's gate (lock held): like a pull at the requester's clock.
  void stateGate(std::unique_lock<std::mutex>& lk, int w, const Header& h);
};

// Sends the parts (pointer, count, type) to a worker and waits (the server side of a reply).
void sendAll(ProcessGroup& pg, const std::vector<std::pair<const void*, std::pair<size_t, DType>>>& parts);
// Receives count elements from the worker now.
void recvNow(ProcessGroup& pg, void* p, size_t count, DType t);
// A reply header (op, key, count, row_dim) and its payload.
void reply(ProcessGroup& pg, uint16_t op, uint32_t key, int64_t count, int64_t row_dim, const void* payload,
           size_t payload_count, DType t);

}  // namespace dtrain::ps
