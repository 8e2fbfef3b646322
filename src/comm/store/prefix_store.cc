// PrefixStore: one namespace ("prefix/") inside a shared store, for sub-groups and restarts.
#include <algorithm>

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : Store(base ? base->timeout() : Duration(0)), prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) throw InvalidArgument(fmt::format("PrefixStore '{}': the base store is null", prefix_));
}

void PrefixStore::set(const std::string& key, const Bytes& value) { base_->set(k(key), value); }

// Waits with this store's own timeout (setTimeout() on a PrefixStore must take effect), then reads
// the value, which exists by then.
Bytes PrefixStore::get(const std::string& key) {
  base_->wait({k(key)}, timeout());
  return base_->get(k(key));
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) { return base_->add(k(key), delta); }

Bytes PrefixStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return base_->compareSet(k(key), expected, desired);
}

bool PrefixStore::deleteKey(const std::string& key) { return base_->deleteKey(k(key)); }

namespace {
std::vector<std::string> prefixed(const std::vector<std::string>& keys, const std::string& prefix) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(prefix + "/" + key);
  return out;
}
}  // namespace

bool PrefixStore::check(const std::vector<std::string>& keys) { return base_->check(prefixed(keys, prefix_)); }

void PrefixStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  base_->wait(prefixed(keys, prefix_), timeout);
}

// Counts the keys of the whole underlying store, as c10d's PrefixStore does: the store protocols
// have no listing by prefix.
int64_t PrefixStore::numKeys() { return base_->numKeys(); }

}  // namespace dtrain::comm

namespace dtrain::comm {
std::shared_ptr<Store> PrefixStore::clone() const { return std::make_shared<PrefixStore>(prefix_, base_->clone()); }
}  // namespace dtrain::comm
