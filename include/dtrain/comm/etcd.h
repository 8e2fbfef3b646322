/// @file
/// A Store on etcd (v3 API, through its JSON gateway over HTTP: no gRPC), and the leases that elastic
/// rendezvous builds heartbeats from: a key put with a lease disappears when the lease is not renewed.
///
/// \code
///   // Every key of the job lives under "/dtrain/<job>/" on the etcd cluster.
///   auto store = makeEtcdStore("http://10.0.0.1:2379,http://10.0.0.2:2379", "/dtrain/job42/", 30s);
///   store->set("addr/0", bytes);                     // a Store like the others
///
///   EtcdLease heartbeat(store, std::chrono::seconds(10));   // renewed from its own thread
///   store->setWithLease("nodes/" + host, info, heartbeat.id());
///   for (const auto& kv : store->list("nodes/")) ...        // the nodes whose lease is alive
///   heartbeat.check();                                      // RendezvousError once the lease was lost
/// \endcode
///
/// Endpoints are tried in order; one that cannot be reached (refused, unresolvable, connect timed out,
/// etcd answering "unavailable") is skipped for the next, so a 3-member cluster survives losing one.
/// Requests whose repetition would be wrong (add's commit, putIfAbsent) are not sent again once a
/// member received them and failed to answer: IoError saying it may or may not have been applied.
/// Failures are dtrain errors naming the operation, the key, the prefix and the endpoints: TimeoutError
/// (get/wait), InvalidArgument (too large, not an integer, rejected by etcd), RendezvousError (no
/// endpoint answered by the deadline, etcd refused, lease expired), ProtocolError (unreadable answer).
/// Values beyond etcd's --max-request-bytes (1.5 MiB by default) are refused by etcd: InvalidArgument.
/// Plain http:// talks to etcd without authentication: dtrain's job secret does not cover etcd
/// (docs/SECURITY.md). No proxy is used, whatever the environment says.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::comm {

/// The time one etcd member gets to accept a connection before the next endpoint is tried.
inline constexpr Duration kEtcdConnectTimeout = std::chrono::seconds(2);
/// The time one etcd member gets to answer one request (a get or wait polls with many short requests
/// until its own deadline).
inline constexpr Duration kEtcdRequestTimeout = std::chrono::seconds(10);
/// One attempt to renew a lease (cheap, idempotent): one member stuck waiting out a leader election
/// must not eat the lease's TTL, the next is asked instead.
inline constexpr Duration kEtcdRenewTimeout = std::chrono::seconds(1);

/// One key of a listing: its name relative to the store's prefix, its value, and etcd's bookkeeping.
struct EtcdKeyValue {
  std::string key;  ///< relative to the store's prefix
  Bytes value;  ///< its value
  int64_t create_revision = 0;  ///< revision of the put that created it (changes when re-created)
  int64_t mod_revision = 0;     ///< revision of its last put
  int64_t lease = 0;            ///< the lease it is attached to, 0 for none
};

/// A granted lease: its id and the TTL etcd granted (etcd may raise a short one to its minimum).
struct EtcdLeaseGrant {
  int64_t id = 0;  ///< the lease's id, for setWithLease() and keepAlive()
  std::chrono::seconds ttl{0};  ///< the TTL etcd granted
};

/// A Store on an etcd cluster, every key under a prefix, with leases (see the file's description).
class EtcdStore : public Store {
 public:
  /// endpoints: "http://host:port" separated by commas ("host:port" alone means http://). Every key is
  /// stored as prefix + key (e.g. prefix "/dtrain/job42/"). InvalidArgument for an empty prefix or an
  /// endpoint that is not http:// or https://. Nothing is sent until the first operation.
  EtcdStore(const std::string& endpoints, std::string prefix, Duration timeout);
  ~EtcdStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Duration timeout) override;
  using Store::wait;
  /// The keys under this store's prefix (not the whole etcd keyspace).
  int64_t numKeys() override;
  std::shared_ptr<Store> clone() const override;
  /// The same, typed: a client of its own (own connection) for another thread.
  std::shared_ptr<EtcdStore> cloneEtcd() const;

  // ---- leases: what heartbeats are made of ----
  /// Grants a lease of `ttl` (whole seconds, at least 1).
  EtcdLeaseGrant grantLease(std::chrono::seconds ttl);
  /// Renews the lease and returns its TTL from now; RendezvousError "... lease ... expired" when etcd
  /// no longer has it (keys attached to it are gone).
  std::chrono::seconds keepAlive(int64_t lease);
  /// Ends the lease now, deleting its keys. A lease already gone is not an error.
  void revokeLease(int64_t lease);
  /// set() with the key attached to `lease`: it is deleted when the lease ends.
  void setWithLease(const std::string& key, const Bytes& value, int64_t lease);
  /// Creates key (attached to `lease` unless 0) only if it does not exist; true when this call created it.
  bool putIfAbsent(const std::string& key, const Bytes& value, int64_t lease = 0);
  /// Every key under prefix + key_prefix ("" for all of the store's keys), in key order.
  std::vector<EtcdKeyValue> list(const std::string& key_prefix);

  /// The prefix of every key, as given.
  const std::string& prefix() const;
  /// The endpoints as given, for messages.
  const std::string& endpoints() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// A store for a job on etcd: EtcdStore(endpoints, prefix, timeout).
std::shared_ptr<EtcdStore> makeEtcdStore(const std::string& endpoints, const std::string& prefix,
                                         Duration timeout);

/// A heartbeat: grants a lease on construction and renews it from a thread of its own (on a clone of
/// the store, so a get blocked on the store does not delay it) every third of the TTL; revokes it on
/// destruction. When renewals fail for a whole TTL, or etcd says the lease expired, the lease is lost:
/// alive() turns false and check() throws RendezvousError with the reason. It is never re-granted
/// behind the caller's back (its keys are gone; the caller decides what that means).
/// Choose a TTL well above etcd's leader election time (its --election-timeout, 1 s by default, plus
/// the election): a TTL of a few seconds can be reported lost when the etcd leader fails.
class EtcdLease {
 public:
  /// Grants a lease of `ttl` on a clone of store and starts renewing it. InvalidArgument for a null store.
  EtcdLease(const std::shared_ptr<EtcdStore>& store, std::chrono::seconds ttl);
  /// Stops renewing and revokes the lease (best effort; a lost lease is left alone).
  ~EtcdLease();
  EtcdLease(const EtcdLease&) = delete;
  EtcdLease& operator=(const EtcdLease&) = delete;

  /// The lease's id: attach keys to it with EtcdStore::setWithLease().
  int64_t id() const { return grant_.id; }
  /// The TTL etcd granted.
  std::chrono::seconds ttl() const { return grant_.ttl; }
  /// False once the lease was lost.
  bool alive() const { return !lost_.load(); }
  /// Throws RendezvousError with the reason once the lease was lost; returns otherwise.
  void check() const;

 private:
  void run();

  std::shared_ptr<EtcdStore> store_;  // this lease's own client
  EtcdLeaseGrant grant_;
  std::atomic<bool> lost_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string reason_;
  std::thread thread_;
};

}  // namespace dtrain::comm
