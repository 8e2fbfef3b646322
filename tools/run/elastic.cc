// Elastic rounds over a rendezvous store (see elastic.h).
#include "elastic.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <fmt/format.h>

#include "dtrain/comm/error.h"
#include "output.h"

namespace dtrain::run {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {
constexpr milliseconds kPollEvery{100};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

ElasticRendezvous::ElasticRendezvous(std::shared_ptr<comm::Store> store, ElasticOptions opts)
    : store_(std::move(store)), opts_(std::move(opts)) {
  if (opts_.min_nodes < 1 || opts_.max_nodes < opts_.min_nodes)
    throw InvalidArgument(fmt::format("--nnodes {}:{}: expected 1 <= MIN <= MAX", opts_.min_nodes, opts_.max_nodes));
}

int64_t ElasticRendezvous::current() {
  if (store_->check({"failed"})) {
    throw Error(fmt::format("elastic rendezvous: the job failed: {}", comm::toString(store_->get("failed"))));
  }
  return store_->add("round", 0);
}

Round ElasticRendezvous::join() {
  const auto deadline = Clock::now() + opts_.join_timeout;
  for (;;) {
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("elastic rendezvous: no round with this node formed within {:g} s (--nnodes {}:{})",
                                     seconds(opts_.join_timeout), opts_.min_nodes, opts_.max_nodes));
    }
    const int64_t k = current();
    const std::string r = fmt::format("r{}/", k);
    if (store_->check({r + "closed"})) {  // running without us: ask for the next round and wait for it
      store_->add(r + "count", 1);
      say("round {} is running without this node; waiting to join the next one", k);
      if (!waitForNextRound(k)) throw JobFinished{};
      continue;
    }
    const int64_t me = store_->add(r + "count", 1) - 1;
    store_->set(fmt::format("{}node/{}", r, me), comm::toBytes(opts_.node_id + " " + opts_.address + " " + opts_.snapshot_store));
    int64_t size = 0;
    if (!waitForClose(k, me, size)) continue;  // another round began meanwhile
    if (me >= size) {
      say("round {} closed with {} nodes before this node joined; waiting for the next one", k, size);
      if (!waitForNextRound(k)) throw JobFinished{};
      continue;
    }
    round_ = Round{k, static_cast<int>(me), static_cast<int>(size), {}, {}};
    for (int64_t i = 0; i < size; ++i) {
      const std::string rec = comm::toString(store_->get(fmt::format("{}node/{}", r, i)));
      const auto last = rec.rfind(' ');
      round_.nodes.push_back(rec.substr(0, last));
      round_.snapshot_stores.push_back(rec.substr(last + 1));
    }
    seen_.clear();
    const auto now = Clock::now();
    for (int i = 0; i < round_.nnodes; ++i)
      if (i != round_.node_rank) seen_[i] = {-1, now};
    last_beat_ = {};
    return round_;
  }
}

// Waits until round k closes (closing it when this agent sees MAX nodes, or MIN nodes for `last_call`);
// false if the round number moved on first.
bool ElasticRendezvous::waitForClose(int64_t k, int64_t me, int64_t& size) {
  const std::string r = fmt::format("r{}/", k);
  const auto deadline = Clock::now() + opts_.join_timeout;
  std::optional<Clock::time_point> min_since;
  for (;;) {
    if (store_->check({r + "closed"})) {
      size = std::stoll(comm::toString(store_->get(r + "closed")));
      return true;
    }
    if (current() != k) return false;
    store_->add(fmt::format("{}hb/{}", r, me), 1);  // joined and alive
    const int64_t count = store_->add(r + "count", 0);
    std::optional<int64_t> close;
    if (count >= opts_.max_nodes) close = opts_.max_nodes;
    if (count >= opts_.min_nodes) {
      if (!min_since) min_since = Clock::now();
      if (Clock::now() - *min_since >= opts_.last_call) close = std::min<int64_t>(count, opts_.max_nodes);
    }
    if (close) store_->compareSet(r + "closed", {}, comm::toBytes(std::to_string(*close)));
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("elastic rendezvous: round {} has {} of at least {} nodes after {:g} s", k, count,
                                     opts_.min_nodes, seconds(opts_.join_timeout)));
    }
    std::this_thread::sleep_for(kPollEvery);
  }
}

bool ElasticRendezvous::waitForNextRound(int64_t k) {
  const auto deadline = Clock::now() + opts_.join_timeout;
  const std::string r = fmt::format("r{}/", k);
  while (current() == k) {
    if (store_->check({r + "closed", r + "done"}) &&
        store_->add(r + "done", 0) >= std::stoll(comm::toString(store_->get(r + "closed")))) {
      return false;  // the round finished the job
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("elastic rendezvous: round {} did not end within {:g} s to let this node join", k,
                                     seconds(opts_.join_timeout)));
    }
    std::this_thread::sleep_for(kPollEvery * 2);
  }
  return true;
}

std::string ElasticRendezvous::lostNode() {
  const auto now = Clock::now();
  for (auto& [i, s] : seen_) {
    const int64_t v = store_->add(fmt::format("r{}/hb/{}", round_.number, i), 0);
    if (v != s.first) {
      s = {v, now};
    } else if (now - s.second >= opts_.heartbeat_timeout) {
      return fmt::format("node {} ({}) sent no heartbeat for {:.1f} s", i, round_.nodes[static_cast<size_t>(i)],
                         seconds(now - s.second));
    }
  }
  return "";
}

std::string ElasticRendezvous::poll() {
  const auto now = Clock::now();
  if (now - last_beat_ < opts_.heartbeat) return "";
  last_beat_ = now;
  const std::string r = fmt::format("r{}/", round_.number);
  store_->add(fmt::format("{}hb/{}", r, round_.node_rank), 1);
  if (store_->check({"failed"})) return "the job failed: " + comm::toString(store_->get("failed"));
  const int64_t k = store_->add("round", 0);
  if (k != round_.number) return fmt::format("round {} was started by another node", k);
  std::string lost = lostNode();
  if (!lost.empty()) return lost;
  const int64_t count = store_->add(r + "count", 0);
  if (count > round_.nnodes && round_.nnodes < opts_.max_nodes) {
    return fmt::format("{} node(s) wait to join", count - round_.nnodes);
  }
  return "";
}

void ElasticRendezvous::endRound() {
  const int64_t k = round_.number;
  store_->compareSet("round", comm::toBytes(std::to_string(k)), comm::toBytes(std::to_string(k + 1)));
}

int64_t ElasticRendezvous::countFailure() {
  // Once per round: the other nodes' workers usually fail too, as a consequence of the first failure.
  const std::string first = fmt::format("r{}/failure", round_.number);
  if (comm::toString(store_->compareSet(first, {}, comm::toBytes(opts_.node_id))) != opts_.node_id) {
    return store_->add("failures", 0);
  }
  return store_->add("failures", 1);
}

void ElasticRendezvous::fail(const std::string& why) {
  store_->compareSet("failed", {}, comm::toBytes(why));
  endRound();
}

bool ElasticRendezvous::finish() {
  const std::string r = fmt::format("r{}/", round_.number);
  store_->add(r + "done", 1);
  const auto deadline = Clock::now() + opts_.join_timeout;
  for (;;) {
    if (store_->add(r + "done", 0) >= round_.nnodes) {
      store_->add(r + "left", 1);
      return true;
    }
    last_beat_ = {};  // keep heartbeating: the others must not take this node for lost
    if (!poll().empty()) return false;
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("elastic rendezvous: the other nodes of round {} did not finish within {:g} s",
                                     round_.number, seconds(opts_.join_timeout)));
    }
    std::this_thread::sleep_for(kPollEvery);
  }
}

void ElasticRendezvous::waitForAllToLeave(std::chrono::milliseconds patience) {
  const auto until = Clock::now() + patience;
  const std::string left = fmt::format("r{}/left", round_.number);
  while (store_->add(left, 0) < round_.nnodes && Clock::now() < until) std::this_thread::sleep_for(kPollEvery);
}

void ElasticRendezvous::publishMaster(const std::string& host_port) {
  store_->set(fmt::format("r{}/master", round_.number), comm::toBytes(host_port));
}

std::string ElasticRendezvous::master() {
  return comm::toString(store_->get(fmt::format("r{}/master", round_.number)));
}

std::string routeTo(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || !res) {
    throw InvalidArgument(fmt::format("cannot resolve the rendezvous host '{}'", host));
  }
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  std::string out;
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in me{};
    socklen_t len = sizeof me;
    char buf[INET_ADDRSTRLEN] = {0};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
        inet_ntop(AF_INET, &me.sin_addr, buf, sizeof buf)) {
      out = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  freeaddrinfo(res);
  if (out.empty()) throw IoError(fmt::format("no route from this host to the rendezvous host '{}'", host));
  return out;
}

}  // namespace dtrain::run
