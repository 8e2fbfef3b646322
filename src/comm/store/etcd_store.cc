// EtcdStore: the Store interface on etcd's v3 KV API (JSON gateway, etcd_http.h), plus leases.
//
// set is a put; get and wait poll with ranges (backoff up to 100 ms) until the op's deadline; add and
// compareSet read the key, decide, then commit with a txn that holds only if the key's mod_revision is
// still the one read (the "compare-and-swap on revision" loop of etcd's own recipes), re-reading from
// the txn's failure branch when another client got there first.
#include <algorithm>
#include <charconv>
#include <optional>
#include <thread>

#include "comm/store/etcd_http.h"
#include "comm/store/quote.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"

namespace dtrain::comm {

using etcd::Json;
using etcd::Retry;
using net::Clock;

namespace {

std::string msText(Duration d) { return fmt::format("{}ms", d.count()); }

// etcd's limit on operations in one txn (--max-txn-ops, 128 by default).
constexpr size_t kMaxTxnOps = 128;

void checkKey(const std::string& key, const std::string& what) {
  if (key.size() > kMaxStoreKeyBytes) {
    throw InvalidArgument(fmt::format("{}: the key is {} bytes, over the limit of {}", what, key.size(),
                                      kMaxStoreKeyBytes));
  }
}

void checkValue(const Bytes& value, const std::string& what) {
  if (value.size() > kMaxStoreValueBytes) {
    throw InvalidArgument(fmt::format("{}: the value is {} bytes, over the limit of {}", what, value.size(),
                                      kMaxStoreValueBytes));
  }
}

bool parseInt(const std::string& s, int64_t* out) {
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && end == s.data() + s.size() && !s.empty();
}

// Sleeps between polls: short at first (rendezvous is quick), then up to 100 ms.
class Backoff {
 public:
  void sleepUntilAtMost(net::Deadline deadline) {
    auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return;
    std::this_thread::sleep_for(std::min<Clock::duration>(step_, left));
    step_ = std::min<Clock::duration>(step_ * 2, std::chrono::milliseconds(100));
  }

 private:
  Clock::duration step_ = std::chrono::milliseconds(2);
};

// A poll's own deadline: the op's, but long enough for the last poll to be answered.
net::Deadline pollDeadline(net::Deadline op) { return std::max(op, Clock::now() + std::chrono::milliseconds(500)); }

}  // namespace

struct EtcdStore::Impl {
  Impl(const std::string& endpoints, std::string p) : http(endpoints), prefix(std::move(p)) {}

  // "EtcdStore get('k') (prefix '/p/', etcd http://a:2379)": how every message starts.
  std::string where(const std::string& what) const {
    return fmt::format("EtcdStore {} (prefix '{}', etcd {})", what, prefix, http.endpoints());
  }
  std::string full(const std::string& key) const { return etcd::base64(prefix + key); }
  Json post(const char* path, const Json& body, net::Deadline deadline, const std::string& what, Retry retry,
            Duration attempt_limit = kEtcdRequestTimeout) {
    return http.post(path, body, deadline, where(what), retry, attempt_limit);
  }
  std::optional<EtcdKeyValue> range(const std::string& key, net::Deadline deadline, const std::string& what);
  EtcdKeyValue decode(const Json& kv, const std::string& what) const;
  std::vector<std::string> missing(const std::vector<std::string>& keys, net::Deadline deadline,
                                   const std::string& what);
  // Commits desired if key's mod_revision is still `seen` (0: absent); otherwise returns the key as
  // the txn's failure branch read it (nullopt when absent) in *now.
  bool commitIfUnchanged(const std::string& key, int64_t seen, const Bytes& desired, net::Deadline deadline,
                         const std::string& what, Retry retry, std::optional<EtcdKeyValue>* now);

  etcd::Http http;
  const std::string prefix;
};

EtcdKeyValue EtcdStore::Impl::decode(const Json& kv, const std::string& what) const {
  EtcdKeyValue out;
  std::string key = etcd::unbase64(kv.value("key", ""), where(what));
  out.key = key.compare(0, prefix.size(), prefix) == 0 ? key.substr(prefix.size()) : key;
  out.value = toBytes(etcd::unbase64(kv.value("value", ""), where(what)));
  out.create_revision = etcd::integer(kv, "create_revision");
  out.mod_revision = etcd::integer(kv, "mod_revision");
  out.lease = etcd::integer(kv, "lease");
  return out;
}

std::optional<EtcdKeyValue> EtcdStore::Impl::range(const std::string& key, net::Deadline deadline,
                                                   const std::string& what) {
  Json ans = post("/v3/kv/range", {{"key", full(key)}}, deadline, what, Retry::kAlways);
  if (!ans.contains("kvs") || ans["kvs"].empty()) return std::nullopt;
  return decode(ans["kvs"][0], what);
}

std::vector<std::string> EtcdStore::Impl::missing(const std::vector<std::string>& keys, net::Deadline deadline,
                                                  const std::string& what) {
  std::vector<std::string> out;
  for (size_t first = 0; first < keys.size(); first += kMaxTxnOps) {
    size_t last = std::min(keys.size(), first + kMaxTxnOps);
    Json ops = Json::array();
    for (size_t i = first; i < last; ++i) {
      ops.push_back({{"request_range", {{"key", full(keys[i])}, {"count_only", true}}}});
    }
    Json ans = post("/v3/kv/txn", {{"success", ops}}, deadline, what, Retry::kAlways);
    const Json& responses = ans.contains("responses") ? ans["responses"] : Json::array();
    if (responses.size() != last - first) {
      throw ProtocolError(where(what) + fmt::format(": a txn of {} ranges answered {}", last - first,
                                                    responses.size()));
    }
    for (size_t i = first; i < last; ++i) {
      if (etcd::integer(responses[i - first].value("response_range", Json::object()), "count") == 0) {
        out.push_back(keys[i]);
      }
    }
  }
  return out;
}

bool EtcdStore::Impl::commitIfUnchanged(const std::string& key, int64_t seen, const Bytes& desired,
                                        net::Deadline deadline, const std::string& what, Retry retry,
                                        std::optional<EtcdKeyValue>* now) {
  Json body = {
      {"compare", {{{"key", full(key)}, {"target", "MOD"}, {"result", "EQUAL"}, {"mod_revision", seen}}}},
      {"success", {{{"request_put", {{"key", full(key)}, {"value", etcd::base64(toString(desired))}}}}}},
      {"failure", {{{"request_range", {{"key", full(key)}}}}}}};
  Json ans = post("/v3/kv/txn", body, deadline, what, retry);
  if (ans.value("succeeded", false)) return true;
  now->reset();
  const Json& responses = ans.contains("responses") ? ans["responses"] : Json::array();
  if (!responses.empty()) {
    const Json& r = responses[0].value("response_range", Json::object());
    if (r.contains("kvs") && !r["kvs"].empty()) *now = decode(r["kvs"][0], what);
  }
  return false;
}

EtcdStore::EtcdStore(const std::string& endpoints, std::string prefix, Duration timeout)
    : Store(timeout), impl_(std::make_unique<Impl>(endpoints, std::move(prefix))) {
  // An empty prefix would make the empty key an empty etcd key, which etcd refuses.
  if (impl_->prefix.empty()) {
    throw InvalidArgument(fmt::format("EtcdStore (etcd {}): the key prefix is empty; give one such as "
                                      "'/dtrain/<job>/'", endpoints));
  }
}

EtcdStore::~EtcdStore() = default;

const std::string& EtcdStore::prefix() const { return impl_->prefix; }
const std::string& EtcdStore::endpoints() const { return impl_->http.endpoints(); }

void EtcdStore::set(const std::string& key, const Bytes& value) { setWithLease(key, value, 0); }

Bytes EtcdStore::get(const std::string& key) {
  std::string what = fmt::format("get({})", quoteKey(key));
  checkKey(key, impl_->where(what));
  const Duration t = timeout();
  const net::Deadline deadline = net::deadlineAfter(t);
  Backoff backoff;
  for (;;) {
    if (auto kv = impl_->range(key, pollDeadline(deadline), what)) return kv->value;
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("EtcdStore {} timed out after {} waiting for key {} (prefix '{}', etcd {})", what,
                                     msText(t), quoteKey(key), impl_->prefix, endpoints()));
    }
    backoff.sleepUntilAtMost(deadline);
  }
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  std::string what = fmt::format("add({}, {})", quoteKey(key), delta);
  checkKey(key, impl_->where(what));
  const net::Deadline deadline = net::deadlineAfter(timeout());
  std::optional<EtcdKeyValue> kv = impl_->range(key, deadline, what);
  for (;;) {
    int64_t cur = 0;
    if (kv && !parseInt(toString(kv->value), &cur)) {
      throw InvalidArgument(fmt::format("{}: the value of the key is not an integer: {}", impl_->where(what),
                                        quoteKey(toString(kv->value))));
    }
    int64_t next = 0;
    if (__builtin_add_overflow(cur, delta, &next)) {
      throw InvalidArgument(fmt::format("{}: {} + {} overflows int64", impl_->where(what), cur, delta));
    }
    // Not resent once received: a commit whose answer was lost would be added twice.
    if (impl_->commitIfUnchanged(key, kv ? kv->mod_revision : 0, toBytes(std::to_string(next)), deadline, what,
                                 Retry::kOnlyUnsent, &kv)) {
      return next;
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{}: other clients kept changing the key for {}", impl_->where(what),
                                     msText(timeout())));
    }
  }
}

Bytes EtcdStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::string what = fmt::format("compareSet({})", quoteKey(key));
  checkKey(key, impl_->where(what));
  checkValue(desired, impl_->where(what));
  const net::Deadline deadline = net::deadlineAfter(timeout());
  std::optional<EtcdKeyValue> kv = impl_->range(key, deadline, what);
  for (;;) {
    bool matches = kv ? kv->value == expected : expected.empty();
    if (!matches) return kv ? kv->value : Bytes();
    // Safe to resend: a lost commit leaves the key at `desired`, which the re-read then returns.
    if (impl_->commitIfUnchanged(key, kv ? kv->mod_revision : 0, desired, deadline, what, Retry::kAlways, &kv)) {
      return desired;
    }
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{}: other clients kept changing the key for {}", impl_->where(what),
                                     msText(timeout())));
    }
  }
}

bool EtcdStore::deleteKey(const std::string& key) {
  std::string what = fmt::format("deleteKey({})", quoteKey(key));
  checkKey(key, impl_->where(what));
  // Resent after a lost answer, the delete finds nothing and reports false: the key is gone either way.
  Json ans = impl_->post("/v3/kv/deleterange", {{"key", impl_->full(key)}}, net::deadlineAfter(timeout()), what,
                         Retry::kAlways);
  return etcd::integer(ans, "deleted") > 0;
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  std::string what = fmt::format("check({})", quoteKeys(keys));
  for (const auto& k : keys) checkKey(k, impl_->where(what));
  return impl_->missing(keys, net::deadlineAfter(timeout()), what).empty();
}

void EtcdStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  std::string what = fmt::format("wait({})", quoteKeys(keys));
  for (const auto& k : keys) checkKey(k, impl_->where(what));
  const net::Deadline deadline = net::deadlineAfter(timeout);
  Backoff backoff;
  for (;;) {
    std::vector<std::string> missing = impl_->missing(keys, pollDeadline(deadline), what);
    if (missing.empty()) return;
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("EtcdStore {} timed out after {} waiting for key{} {} (prefix '{}', etcd {})",
                                     what, msText(timeout), missing.size() == 1 ? "" : "s", quoteKeys(missing),
                                     impl_->prefix, endpoints()));
    }
    backoff.sleepUntilAtMost(deadline);
  }
}

int64_t EtcdStore::numKeys() {
  Json body = {{"key", impl_->full("")},
               {"range_end", etcd::base64(etcd::prefixEnd(impl_->prefix))},
               {"count_only", true}};
  Json ans = impl_->post("/v3/kv/range", body, net::deadlineAfter(timeout()), "numKeys()", Retry::kAlways);
  return etcd::integer(ans, "count");
}

std::shared_ptr<Store> EtcdStore::clone() const { return cloneEtcd(); }

std::shared_ptr<EtcdStore> EtcdStore::cloneEtcd() const {
  return std::make_shared<EtcdStore>(endpoints(), impl_->prefix, timeout());
}

// ---- leases ----

EtcdLeaseGrant EtcdStore::grantLease(std::chrono::seconds ttl) {
  std::string what = fmt::format("grantLease({}s)", ttl.count());
  if (ttl.count() < 1) throw InvalidArgument(impl_->where(what) + ": the TTL must be at least 1s");
  // A lease granted but unanswered is never renewed and expires by itself: safe to ask again.
  Json ans = impl_->post("/v3/lease/grant", {{"TTL", ttl.count()}}, net::deadlineAfter(timeout()), what,
                         Retry::kAlways);
  EtcdLeaseGrant g{etcd::integer(ans, "ID"), std::chrono::seconds(etcd::integer(ans, "TTL"))};
  if (g.id == 0) throw ProtocolError(impl_->where(what) + ": the answer has no lease ID: " + ans.dump());
  return g;
}

std::chrono::seconds EtcdStore::keepAlive(int64_t lease) {
  std::string what = fmt::format("keepAlive(lease {:x})", lease);
  // Short attempts: a member waiting out a leader election is left for the next one.
  Json ans = impl_->post("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}, net::deadlineAfter(timeout()),
                         what, Retry::kAlways, kEtcdRenewTimeout);
  // A streaming call: the answer is {"result": {...}}; an expired lease comes back without a TTL.
  int64_t ttl = etcd::integer(ans.value("result", Json::object()), "TTL");
  if (ttl <= 0) throw RendezvousError(impl_->where(what) + ": the lease has expired (its keys are gone)");
  return std::chrono::seconds(ttl);
}

void EtcdStore::revokeLease(int64_t lease) {
  std::string what = fmt::format("revokeLease(lease {:x})", lease);
  try {
    impl_->post("/v3/lease/revoke", {{"ID", std::to_string(lease)}}, net::deadlineAfter(timeout()), what,
                Retry::kAlways);
  } catch (const etcd::AnswerError& e) {
    if (e.code() != etcd::kCodeNotFound) throw;
  }
}

namespace {
// etcd's "requested lease not found" on a put, in words a caller can act on.
[[noreturn]] void leaseGone(const etcd::AnswerError& e, int64_t lease) {
  if (e.code() == etcd::kCodeNotFound) {
    throw RendezvousError(fmt::format("{} (lease {:x} has expired or was revoked)", e.what(), lease));
  }
  throw;
}
}  // namespace

void EtcdStore::setWithLease(const std::string& key, const Bytes& value, int64_t lease) {
  std::string what = lease ? fmt::format("setWithLease({}, lease {:x})", quoteKey(key), lease)
                           : fmt::format("set({})", quoteKey(key));
  checkKey(key, impl_->where(what));
  checkValue(value, impl_->where(what));
  Json body = {{"key", impl_->full(key)}, {"value", etcd::base64(toString(value))}};
  if (lease) body["lease"] = std::to_string(lease);
  try {
    impl_->post("/v3/kv/put", body, net::deadlineAfter(timeout()), what, Retry::kAlways);
  } catch (const etcd::AnswerError& e) {
    leaseGone(e, lease);
  }
}

bool EtcdStore::putIfAbsent(const std::string& key, const Bytes& value, int64_t lease) {
  std::string what = fmt::format("putIfAbsent({}, lease {:x})", quoteKey(key), lease);
  checkKey(key, impl_->where(what));
  checkValue(value, impl_->where(what));
  Json put = {{"key", impl_->full(key)}, {"value", etcd::base64(toString(value))}};
  if (lease) put["lease"] = std::to_string(lease);
  Json body = {{"compare", {{{"key", impl_->full(key)}, {"target", "CREATE"}, {"result", "EQUAL"}, {"create_revision", 0}}}},
               {"success", {{{"request_put", put}}}}};
  try {
    // Not resent once received: a lost success would come back as "someone else created it".
    Json ans = impl_->post("/v3/kv/txn", body, net::deadlineAfter(timeout()), what, Retry::kOnlyUnsent);
    return ans.value("succeeded", false);
  } catch (const etcd::AnswerError& e) {
    leaseGone(e, lease);
  }
}

std::vector<EtcdKeyValue> EtcdStore::list(const std::string& key_prefix) {
  std::string what = fmt::format("list({})", quoteKey(key_prefix));
  checkKey(key_prefix, impl_->where(what));
  std::string from = impl_->prefix + key_prefix;
  Json body = {{"key", etcd::base64(from)}, {"range_end", etcd::base64(etcd::prefixEnd(from))}};
  Json ans = impl_->post("/v3/kv/range", body, net::deadlineAfter(timeout()), what, Retry::kAlways);
  std::vector<EtcdKeyValue> out;
  if (ans.contains("kvs")) {
    for (const auto& kv : ans["kvs"]) out.push_back(impl_->decode(kv, what));
  }
  return out;
}

std::shared_ptr<EtcdStore> makeEtcdStore(const std::string& endpoints, const std::string& prefix, Duration timeout) {
  return std::make_shared<EtcdStore>(endpoints, prefix, timeout);
}

}  // namespace dtrain::comm
