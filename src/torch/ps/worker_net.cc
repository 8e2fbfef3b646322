// The network side of the Worker's operations (run on the Worker's thread): requests to the servers
// and their replies, per partition or per message of rows.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "worker_impl.h"

namespace dtrain::ps {

// ------------------------------------------------------------------------------------------------
// Worker: the network side (on the Worker's thread)
// ------------------------------------------------------------------------------------------------

void Worker::Impl::netDeclare(const Entry& e, const at::Tensor& t) {
  Batch b(rank_, sent_, received_);
  const float* data = t.data_ptr<float>();
  for (const auto& p : e.parts) {
    auto& pg = pgOf(p.server);
    // A tensor declared at step c starts at version c (bsp).
    b.sendHeader(p.server, pg, makeHeader(kDeclare, p.key, clock_, p.count, 0, rank_ == 0 ? kFlagInit : 0));
    if (rank_ == 0) b.send(p.server, pg, data + p.offset, p.count, DType::f32);
  }
  b.waitAll();
  for (const auto& p : e.parts) b.recvReply(p.server, pgOf(p.server), kAck);
}

void Worker::Impl::netDeclareRows(const Entry& e) {
  Batch b(rank_, sent_, received_);
  for (int s = 0; s < num_servers_; ++s) {
    b.sendHeader(s, pgOf(s), makeHeader(kDeclareRows, e.key, 0, e.num_rows, e.dim, rank_ == 0 ? kFlagInit : 0));
  }
  b.waitAll();
  for (int s = 0; s < num_servers_; ++s) b.recvReply(s, pgOf(s), kAck);
}

void Worker::Impl::netPush(const Entry& e, const at::Tensor& g, int clock, const at::Tensor& used) {
  Batch b(rank_, sent_, received_);
  const float* data = g.data_ptr<float>();
  const uint8_t* mask = used.defined() ? used.data_ptr<uint8_t>() : nullptr;
  for (const auto& p : e.parts) {
    auto& pg = pgOf(p.server);
    // The mask travels only for a partition with an element left out.
    const bool partial = mask && std::any_of(mask + p.offset, mask + p.offset + p.count, [](uint8_t x) { return x == 0; });
    b.sendHeader(p.server, pg, makeHeader(kPush, p.key, clock, p.count, 0, partial ? kFlagUsed : 0));
    b.send(p.server, pg, data + p.offset, p.count, DType::f32);
    if (partial) b.send(p.server, pg, mask + p.offset, p.count, DType::u8);
  }
  b.waitAll();
}

void Worker::Impl::netPull(const Entry& e, const at::Tensor* grad, const at::Tensor& out, int clock) {
  float* dst = out.data_ptr<float>();
  // Sends a partition's request (and, for pushPull, its gradient) to its server.
  auto request = [&](Batch& b, const Part& p) {
    auto& pg = pgOf(p.server);
    b.sendHeader(p.server, pg, makeHeader(grad ? kPushPull : kPull, p.key, clock, p.count));
    if (grad) b.send(p.server, pg, grad->data_ptr<float>() + p.offset, p.count, DType::f32);
  };
  auto reply = [&](Batch& b, const Part& p) {
    auto& pg = pgOf(p.server);
    Header h = b.recvReply(p.server, pg, kValues);
    if (h.key != p.key || h.count != p.count) {
      throw ProtocolError(fmt::format("[worker {}] server {}: reply for partition {} x {}, expected {} x {}",
                                      rank_, p.server, h.key, h.count, p.key, p.count));
    }
    b.recv(p.server, pg, dst + p.offset, p.count, DType::f32);
  };
  if (grad) {
    // One partition at a time: while a server sends a large reply it reads nothing, so a second large
    // gradient queued behind the first on the same connection would deadlock both sides.
    for (const auto& p : e.parts) {
      Batch b(rank_, sent_, received_);
      request(b, p);
      b.waitAll();
      reply(b, p);
    }
    return;
  }
  // Pull requests are headers only: post them all, then collect the replies.
  Batch b(rank_, sent_, received_);
  for (const auto& p : e.parts) request(b, p);
  b.waitAll();
  for (const auto& p : e.parts) reply(b, p);
}

void Worker::Impl::netClock(uint16_t flags, int clock) {
  Batch b(rank_, sent_, received_);
  sendToAllServers(b, conns_, kClock, clock, flags);
  b.waitAll();
}

namespace {
// One message of a pushRows / pullRows to server `server`: rows [start, start + n) of the caller's ids
// when one server owns every row (idx undefined), else the rows at positions idx.
struct RowMessage {
  int server = 0;
  int64_t start = 0, n = 0;
  at::Tensor idx;
};

// The messages that carry ids: grouped by owning server (row % S), at most `chunk` rows each.
std::vector<RowMessage> rowMessages(const at::Tensor& ids, int num_servers, int64_t chunk) {
  std::vector<RowMessage> out;
  const int64_t total = ids.numel();
  if (num_servers == 1) {
    for (int64_t start = 0; start < total; start += chunk) out.push_back({0, start, std::min(total - start, chunk), {}});
    return out;
  }
  const int64_t* p = ids.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> by(static_cast<size_t>(num_servers));
  for (int64_t i = 0; i < total; ++i) by[static_cast<size_t>(p[i] % num_servers)].push_back(i);
  for (int s = 0; s < num_servers; ++s) {
    auto& pos = by[static_cast<size_t>(s)];
    const int64_t count = static_cast<int64_t>(pos.size());
    for (int64_t start = 0; start < count; start += chunk) {
      const int64_t n = std::min(count - start, chunk);
      out.push_back({s, start, n, at::from_blob(pos.data() + start, {n}, at::kLong).clone()});
    }
  }
  return out;
}

// The message's rows of t (ids or per-row values): a view when they are contiguous in t.
at::Tensor rowsOf(const at::Tensor& t, const RowMessage& m) {
  return m.idx.defined() ? t.index_select(0, m.idx) : t.narrow(0, m.start, m.n);
}

}  // namespace

void Worker::Impl::netPushRows(const Entry& e, const at::Tensor& ids, const at::Tensor& g, int clock) {
  std::vector<at::Tensor> keep;  // the selected rows stay alive until every send completed
  Batch b(rank_, sent_, received_);
  for (const auto& m : rowMessages(ids, num_servers_, maxRowsPerMessage(opts_, e.dim))) {
    auto sid = rowsOf(ids, m), sg = rowsOf(g, m);
    keep.push_back(sid);
    keep.push_back(sg);
    auto& pg = pgOf(m.server);
    b.sendHeader(m.server, pg, makeHeader(kPushRows, e.key, clock, m.n, e.dim));
    b.send(m.server, pg, sid.data_ptr<int64_t>(), sid.numel(), DType::i64);
    b.send(m.server, pg, sg.data_ptr<float>(), sg.numel(), DType::f32);
  }
  b.waitAll();
}

void Worker::Impl::netPullRows(const Entry& e, const at::Tensor& ids, const at::Tensor& out, int clock) {
  struct Req {
    RowMessage m;
    at::Tensor sid, values;  // values: a slice of out when the message's rows are contiguous in it
  };
  std::vector<Req> reqs;
  Batch b(rank_, sent_, received_);
  for (auto& m : rowMessages(ids, num_servers_, maxRowsPerMessage(opts_, e.dim))) {
    Req r;
    r.sid = rowsOf(ids, m);
    r.values = m.idx.defined() ? at::empty({m.n, e.dim}, at::kFloat) : rowsOf(out, m);
    auto& pg = pgOf(m.server);
    b.sendHeader(m.server, pg, makeHeader(kPullRows, e.key, clock, m.n, e.dim));
    b.send(m.server, pg, r.sid.data_ptr<int64_t>(), r.sid.numel(), DType::i64);
    r.m = std::move(m);
    reqs.push_back(std::move(r));
  }
  b.waitAll();
  for (auto& r : reqs) {
    const int s = r.m.server;
    auto& pg = pgOf(s);
    Header h = b.recvReply(s, pg, kValues);
    if (h.key != e.key || h.count != r.m.n || h.row_dim != e.dim) {
      throw ProtocolError(fmt::format("[worker {}] server {}: pullRows reply {} x {} for table {}, expected {} x {}",
                                      rank_, s, h.count, h.row_dim, h.key, r.m.n, e.dim));
    }
    b.recv(s, pg, r.values.data_ptr<float>(), r.values.numel(), DType::f32);
    if (r.m.idx.defined()) out.index_copy_(0, r.m.idx, r.values);
  }
}

void Worker::Impl::netFinish() {
  Batch b(rank_, sent_, received_);
  sendToAllServers(b, conns_, kBye, clock_);
  b.waitAll();
  for (int s = 0; s < num_servers_; ++s) b.recvReply(s, pgOf(s), kAck);
}

}  // namespace dtrain::ps
