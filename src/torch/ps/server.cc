// The parameter Server: one thread per worker connection reads requests and hands each to its handler
// (server_state.h); the handlers of declarations' bookkeeping, clock and goodbye live here, those of
// dense partitions in server_dense.cc and of sparse tables in server_rows.cc. And ColocatedServer.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "server_state.h"

namespace dtrain::ps {

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
  const Header h = makeHeader(op, key, 0, count, row_dim);
  sendAll(pg, {{&h, {sizeof(Header), DType::u8}}, {payload, {payload_count, t}}});
}

Server::State::State(std::shared_ptr<comm::Store> store_, int index_, int num_servers_, int num_workers_,
                     PSOptions opts_)
    : store(std::move(store_)),
      index(index_),
      num_servers(num_servers_),
      num_workers(num_workers_),
      opts(opts_),
      deadlines(ps::deadlines(opts_)),
      dense_rule(opts_, /*assign_sums=*/opts_.consistency == Consistency::bsp),
      row_rule(opts_, /*assign_sums=*/false),
      clocks(static_cast<size_t>(num_workers_), 0),
      restores(static_cast<size_t>(num_workers_), 0),
      done(static_cast<size_t>(num_workers_), false),
      pgs(static_cast<size_t>(num_workers_)) {}

bool Server::State::handle(int w, ProcessGroup& pg, const Header& h) {
  switch (h.op) {
    case kDeclare: onDeclare(w, pg, h); return true;
    case kDeclareRows: onDeclareRows(w, pg, h); return true;
    case kPush:
    case kPull:
    case kPushPull: onPush(w, pg, h); return true;
    case kPushRows: onPushRows(w, pg, h); return true;
    case kPullRows: onPullRows(w, pg, h); return true;
    case kGetState: onGetState(w, pg, h); return true;
    case kSetState: onSetState(w, pg, h); return true;
    case kClock: onClock(w, pg, h); return true;
    case kBye: onBye(w, pg, h); return false;
    default: throw ProtocolError(fmt::format("{}: unknown request op {}", who(w), h.op));
  }
}

void Server::State::stateGate(std::unique_lock<std::mutex>& lk, int w, const Header& h) {
  if (opts.consistency != Consistency::bsp && opts.consistency != Consistency::ssp) return;
  const int64_t lag = opts.consistency == Consistency::ssp ? opts.staleness : 0;
  waitFor(lk, [&] { return int64_t{h.clock} - minClock() <= lag; }, [&] {
    return fmt::format("worker {}'s saveState at clock {} waits for workers {}", w, h.clock,
                       behind(static_cast<int>(h.clock - lag)));
  });
}

void Server::State::onClock(int w, ProcessGroup& pg, const Header& h) {
  const bool set = h.flags & kFlagSet;
  {
    std::unique_lock<std::mutex> lk(mu);
    int& c = clocks[static_cast<size_t>(w)];
    if (set) {
      // loadState: worker 0 restored this server's state before this message; the others wait for
      // that (their next pushes must not land before the restore), then everyone is acknowledged.
      if (h.clock < 0) throw ProtocolError(fmt::format("{}: clock set to {}", who(w), h.clock));
      c = h.clock;
      const int k = ++restores[static_cast<size_t>(w)];
      if (w == 0) {
        cv.notify_all();
      } else {
        waitFor(lk, [&] { return restores[0] >= k; },
                [&] { return fmt::format("worker {}'s loadState waits for worker 0's", w); });
      }
    } else {
      if (h.clock != c + 1) throw ProtocolError(fmt::format("{}: clock {} after {}", who(w), h.clock, c));
      c = h.clock;
    }
  }
  cv.notify_all();
  if (set) reply(pg, kAck, 0, 0, 0, nullptr, 0, DType::u8);
}

void Server::State::onBye(int w, ProcessGroup& pg, const Header& h) {
  {
    std::lock_guard<std::mutex> lk(mu);
    done[static_cast<size_t>(w)] = true;
  }
  cv.notify_all();
  reply(pg, kAck, 0, 0, 0, nullptr, 0, DType::u8);
}

void Server::State::serve(int w) {
  std::shared_ptr<ProcessGroup> pg;
  try {
    // The server waits for a worker's next request for deadlines.server_idle (a worker may compute for a
    // long time); dead workers are found by the transport at once. Its own waits (BSP/SSP) use
    // deadlines.server_wait.
    // A store connection per worker thread: the rendezvous waits of one do not hold up the others (nor,
    // for a colocated server, the worker in this process).
    pg = ProcessGroup::create(pairStore(store->clone(), w, index), 1, 2, groupOptions(deadlines.server_idle));
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
        const Header h = makeHeader(kError, 0, 0, static_cast<int64_t>(m.size()));
        auto w1 = pg->send(&h, sizeof(Header), DType::u8, 0);
        auto w2 = pg->send(m.data(), m.size(), DType::u8, 0);
        w1->wait(deadlines.error_reply);
        w2->wait(deadlines.error_reply);
      } catch (...) {
      }
    }
    if (mine) {
      fail(msg, sameType(e, msg));
    }
  }
}

Server::Server(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers, PSOptions opts) {
  DTRAIN_CHECK(num_servers >= 1 && index >= 0 && index < num_servers, InvalidArgument,
               "ps::Server: index {} of {} servers", index, num_servers);
  DTRAIN_CHECK(num_workers >= 1, InvalidArgument, "ps::Server: {} workers", num_workers);
  DTRAIN_CHECK(opts.staleness >= 0, InvalidArgument, "ps: staleness {} < 0", opts.staleness);
  DTRAIN_CHECK(store != nullptr, InvalidArgument, "ps::Server: no store");
  state_ = std::make_unique<State>(std::move(store), index, num_servers, num_workers, opts);
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

// ------------------------------------------------------------------------------------------------
// ColocatedServer
// ------------------------------------------------------------------------------------------------

struct ColocatedServer::Impl {
  std::unique_ptr<Server> server;
  std::chrono::milliseconds shutdown;  // deadlines.colocated_shutdown
  std::thread thread;
  std::exception_ptr error;
  std::mutex mu;
  std::condition_variable cv;
  bool ended = false;
};

ColocatedServer::ColocatedServer(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers,
                                 PSOptions opts)
    : impl_(std::make_unique<Impl>()) {
  impl_->server = std::make_unique<Server>(std::move(store), index, num_servers, num_workers, opts);
  impl_->shutdown = deadlines(opts).colocated_shutdown;
  impl_->thread = std::thread([m = impl_.get()] {
    try {
      m->server->run();
    } catch (...) {
      m->error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(m->mu);
      m->ended = true;
    }
    m->cv.notify_all();
  });
}

ColocatedServer::~ColocatedServer() {
  auto& m = *impl_;
  if (!m.thread.joinable()) return;
  std::unique_lock<std::mutex> lk(m.mu);
  if (!m.cv.wait_for(lk, m.shutdown, [&] { return m.ended; })) {
    lk.unlock();
    m.server->abort(fmt::format("colocated server stopped: its process is shutting down and the workers did not "
                                "finish within {} ms",
                                m.shutdown.count()));
  } else {
    lk.unlock();
  }
  m.thread.join();
}

void ColocatedServer::join() {
  if (impl_->thread.joinable()) impl_->thread.join();
  if (impl_->error) std::rethrow_exception(impl_->error);
}

}  // namespace dtrain::ps
