// The Worker's internals shared by its source files (internal): a connection to one server, the
// batch of sends and receives of one call, and the helpers of local aggregation.
#pragma once
#include <ATen/core/Tensor.h>
#include <fmt/format.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/ps.h"
#include "deadlines.h"
#include "protocol.h"

namespace dtrain::ps {

// A dense tensor's partition: elements [offset, offset + count) of the tensor, on `server`.
struct Part {
  uint32_t key;
  int server;
  int64_t offset;  // elements into the tensor
  int64_t count;
};
// A declared dense tensor (its partitions) or sparse table (rows r on server r % S).
struct Entry {
  bool sparse = false;
  int64_t numel = 0;             // dense
  std::vector<Part> parts;       // dense
  int64_t num_rows = 0, dim = 0; // sparse
  uint32_t key = 0;              // sparse: the table's key (same on every server)
};

// The sends and receives of one worker call, waited together; errors name the server.
class Batch {
 public:
  Batch(int rank, std::atomic<int64_t>& sent, std::atomic<int64_t>& received)
      : rank_(rank), sent_(sent), received_(received) {}

  void sendHeader(int s, ProcessGroup& pg, const Header& h) {
    headers_.push_back(std::make_unique<Header>(h));
    add(s, [&] { return pg.send(headers_.back().get(), sizeof(Header), DType::u8, 1); });
    sent_ += kHeaderBytes;
  }
  void send(int s, ProcessGroup& pg, const void* p, int64_t count, DType t) {
    if (count == 0) return;
    add(s, [&] { return pg.send(p, static_cast<size_t>(count), t, 1); });
    sent_ += count * static_cast<int64_t>(comm::dtypeSize(t));
  }
  void recv(int s, ProcessGroup& pg, void* p, int64_t count, DType t) {
    if (count == 0) return;
    auto w = named(s, [&] { return pg.recv(p, static_cast<size_t>(count), t, 1); });
    named(s, [&] { w->wait(); return 0; });
    received_ += count * static_cast<int64_t>(comm::dtypeSize(t));
  }
  // Receives a reply header; a kError reply is thrown (with the server's message), another op than
  // `expect` is a ProtocolError.
  Header recvReply(int s, ProcessGroup& pg, uint16_t expect) {
    Header h;
    recv(s, pg, &h, sizeof(Header), DType::u8);
    if (h.magic != kMagic) {
      throw ProtocolError(fmt::format("[worker {}] server {}: bad reply magic {:#x}", rank_, s, h.magic));
    }
    if (h.op == kError) {
      if (h.count < 0 || h.count > kMaxErrorBytes) {
        throw ProtocolError(fmt::format("[worker {}] server {}: error reply of {} bytes", rank_, s, h.count));
      }
      std::string msg(static_cast<size_t>(h.count), '\0');
      recv(s, pg, msg.data(), h.count, DType::u8);
      throw Error(fmt::format("[worker {}] server {} failed: {}", rank_, s, msg));
    }
    if (h.op != expect) {
      throw ProtocolError(fmt::format("[worker {}] server {}: expected a {} reply, got {}", rank_, s,
                                      opName(expect), opName(h.op)));
    }
    return h;
  }
  void waitAll() {
    // (Not a structured binding: C++17 lambdas cannot capture those, and clang rejects it.)
    for (auto& sw : works_) named(sw.first, [&] { sw.second->wait(); return 0; });
    works_.clear();
  }

  template <class F>
  auto named(int s, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (...) {
      rethrowWithContext(fmt::format("[worker {}] server {}: ", rank_, s));
    }
  }

 private:
  template <class F>
  void add(int s, F&& f) {
    works_.emplace_back(s, named(s, f));
  }
  int rank_;
  std::atomic<int64_t>& sent_;
  std::atomic<int64_t>& received_;
  std::vector<std::unique_ptr<Header>> headers_;
  std::vector<std::pair<int, WorkPtr>> works_;
};

// Sends a header-only request (clock, goodbye) to every server.
template <class Conns>
void sendToAllServers(Batch& b, const Conns& conns, uint16_t op, int32_t clock, uint16_t flags = 0) {
  for (size_t s = 0; s < conns.size(); ++s) {
    b.sendHeader(static_cast<int>(s), *conns[s]->pg, makeHeader(op, 0, clock, 0, 0, flags));
  }
}

// Everything behind a Worker. Its public methods are the calling thread's side of each operation
// (worker.cc: checks, then submit()); the net* methods are the network side, run on the Worker's own
// thread (worker_net.cc); saveState/loadState are in state_io.cc.
struct Worker::Impl {
  Impl(std::shared_ptr<comm::Store> store, int rank, int num_workers, int num_servers, PSOptions opts);
  Impl(std::shared_ptr<comm::Store> store, LocalAggregation agg, int num_servers, PSOptions opts);
  ~Impl();

  void declare(const std::string& name, const at::Tensor& init);
  void declareRows(const std::string& name, int64_t num_rows, int64_t dim);
  comm::WorkPtr pushAsync(const std::string& name, const at::Tensor& grad, const at::Tensor& used = {});
  comm::WorkPtr pullAsync(const std::string& name, at::Tensor out);
  comm::WorkPtr pushPullAsync(const std::string& name, const at::Tensor& grad, at::Tensor out);
  comm::WorkPtr clockAsync();
  comm::WorkPtr pushRowsAsync(const std::string& name, const at::Tensor& rows, const at::Tensor& grads);
  at::Tensor pullRows(const std::string& name, const at::Tensor& rows);
  comm::WorkPtr pullRowsAsync(const std::string& name, const at::Tensor& rows, at::Tensor out);
  std::map<std::string, at::Tensor> saveState();
  void loadState(const std::map<std::string, at::Tensor>& state);
  void finish();
  bool connected() const { return !conns_.empty(); }

  const Entry& entry(const std::string& name, bool sparse) const;
  void connect(const std::shared_ptr<comm::Store>& store);
  void startThread();
  comm::WorkPtr submit(std::string what, std::function<void()> fn);
  // The network side of each operation (on the Worker's thread).
  void netDeclare(const Entry& e, const at::Tensor& init);
  void netDeclareRows(const Entry& e);
  // used: u8 per element (1: this push carries its gradient), or undefined (every element).
  void netPush(const Entry& e, const at::Tensor& g, int clock, const at::Tensor& used = {});
  void netPull(const Entry& e, const at::Tensor* grad, const at::Tensor& out, int clock);
  void netClock(uint16_t flags, int clock);
  void netPushRows(const Entry& e, const at::Tensor& ids, const at::Tensor& grads, int clock);
  void netPullRows(const Entry& e, const at::Tensor& ids, const at::Tensor& out, int clock);
  void netFinish();
  // saveState's and loadState's exchanges for one tensor (on the Worker's thread).
  void netGetDenseState(const std::string& name, const Entry& e, int64_t slots, int clock,
                        std::map<std::string, at::Tensor>& state);
  void netGetRowsState(const std::string& name, const Entry& e, int64_t slots, int clock,
                       std::map<std::string, at::Tensor>& state);
  // elem_steps: each element's update count (undefined: the partitions' steps for all).
  void netSetDenseState(const Entry& e, int64_t slots, const at::Tensor& values, const at::Tensor& steps,
                        const at::Tensor& versions, const at::Tensor& elem_steps);
  void netSetRowsState(const Entry& e, int64_t slots, const at::Tensor& ids, const at::Tensor& steps,
                       const at::Tensor& data);

  // The connection to one server: a 2-rank group, this worker rank 0.
  struct Conn {
    int server = 0;
    std::shared_ptr<ProcessGroup> pg;
  };
  ProcessGroup& pgOf(int server) const { return *conns_[static_cast<size_t>(server)]->pg; }
  struct Thread;

  int rank_, num_workers_, num_servers_;
  PSOptions opts_;
  Deadlines deadlines_;
  std::shared_ptr<comm::ProcessGroup> local_;  // local aggregation: this host's workers (own group)
  std::vector<std::unique_ptr<Conn>> conns_;
  std::unique_ptr<Thread> thread_;
  std::map<std::string, Entry> entries_;
  std::vector<int64_t> load_;  // bytes per server
  uint32_t next_key_ = 0;
  int clock_ = 0;
  bool finished_ = false;
  std::atomic<int64_t> sent_{0}, received_{0};
};

// Local aggregation (local_aggregation.cc).
// The sum (on local rank 0) of the local workers' g; the mean unless the update is sum_only.
at::Tensor localSum(comm::ProcessGroup& local, const at::Tensor& g, const PSOptions& o);
// On local rank 0: the elements some local worker's `used` (u8) marks.
at::Tensor localUsed(comm::ProcessGroup& local, const at::Tensor& used);
// Every local worker's rows (and, with grads, their rows' gradients), concatenated in local-rank order.
// Returns the offset of this worker's rows.
int64_t localRows(comm::ProcessGroup& local, const at::Tensor& ids, const at::Tensor* grads, int64_t dim,
                  at::Tensor& all_ids, at::Tensor* all_grads);

// The ids on the host (contiguous); InvalidArgument unless rows is a 1-d int64 CPU or CUDA tensor of ids in
// the table's range.
at::Tensor checkRows(const at::Tensor& rows, const Entry& e, const std::string& name);

}  // namespace dtrain::ps
