// The Worker's internals shared by its source files (internal): a connection to one server, the
// batch of sends and receives of one call, and the helpers of local aggregation.
#pragma once
#include <ATen/core/Tensor.h>
#include <fmt/format.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/ps.h"
#include "protocol.h"

namespace dtrain::ps {

struct Worker::Conn {
  int server = 0;
  std::shared_ptr<ProcessGroup> pg;
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
    for (auto& [s, w] : works_) named(s, [&] { w->wait(); return 0; });
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
    Header h;
    h.op = op;
    h.flags = flags;
    h.clock = clock;
    b.sendHeader(static_cast<int>(s), *conns[s]->pg, h);
  }
}

// Local aggregation (local_aggregation.cc).
// The sum (on local rank 0) of the local workers' g; the mean unless the update is sum_only.
at::Tensor localSum(comm::ProcessGroup& local, const at::Tensor& g, const PSOptions& o);
// Every local worker's rows (and, with grads, their rows' gradients), concatenated in local-rank order.
// Returns the offset of this worker's rows.
int64_t localRows(comm::ProcessGroup& local, const at::Tensor& ids, const at::Tensor* grads, int64_t dim,
                  at::Tensor& all_ids, at::Tensor* all_grads);

// InvalidArgument unless rows is a 1-d int64 CPU tensor of ids in the table's range.
void checkRows(const at::Tensor& rows, const Worker::Entry& e, const std::string& name);

}  // namespace dtrain::ps
