// EtcdLease: a lease renewed from a thread of its own, the heartbeat of an elastic node.
//
// Renewals go every third of the TTL. Each renewal may take until the lease would have run out since
// the last good one (the clone's timeout is set to that before each call, so endpoints are failed
// over within it); when it fails, the lease is over as far as this node can know, and it is reported
// lost rather than renewed late.
#include <algorithm>

#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "dtrain/comm/fd.h"

namespace dtrain::comm {

using net::Clock;

EtcdLease::EtcdLease(const std::shared_ptr<EtcdStore>& store, std::chrono::seconds ttl) {
  if (!store) throw InvalidArgument("EtcdLease: the store is null");
  store_ = store->cloneEtcd();
  grant_ = store_->grantLease(ttl);
  thread_ = std::thread([this] { run(); });
}

EtcdLease::~EtcdLease() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (lost_.load()) return;
  try {  // best effort: otherwise the lease and its keys live out their TTL
    store_->setTimeout(std::min<Duration>(store_->timeout(), kEtcdConnectTimeout));
    store_->revokeLease(grant_.id);
  } catch (const std::exception&) {
  }
}

void EtcdLease::check() const {
  if (!lost_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  throw RendezvousError(reason_);
}

void EtcdLease::run() {
  const Duration ttl = std::chrono::duration_cast<Duration>(grant_.ttl);
  const Duration period = std::max<Duration>(ttl / 3, std::chrono::milliseconds(100));
  auto last_ok = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period, [&] { return stop_; })) {
    lock.unlock();
    std::string failure;
    try {
      auto left = std::chrono::duration_cast<Duration>(last_ok + ttl - Clock::now());
      if (left <= Duration(0)) throw TimeoutError("no renewal succeeded for a whole TTL");
      store_->setTimeout(left);
      store_->keepAlive(grant_.id);
      last_ok = Clock::now();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    lock.lock();
    if (!failure.empty()) {
      reason_ = fmt::format("etcd lease {:x} (TTL {}s, etcd {}) was lost: {}", grant_.id, grant_.ttl.count(),
                            store_->endpoints(), failure);
      lost_.store(true);
      return;
    }
  }
}

}  // namespace dtrain::comm
