// FileStore: a key-value store in one file on a filesystem every process sees (like c10d's
// FileStore and the file:// rendezvous of Slurm jobs).
//
// The file is an append-only log, little-endian:
//   header   8-byte magic "DTFSTOR1", u64 generation (random, chosen by whoever creates the file)
//   records  u8 op ('S' set, 'D' delete), u32 key length, key, u32 value length, value
// Every operation opens the file, takes flock(LOCK_EX), reads the records it has not seen yet into
// its cache and appends what it changes before unlocking. Why a log rather than rewriting the file:
// a process killed mid-write leaves at worst a torn last record, which the next locked operation
// cuts off; a rewrite in place could lose every key. Why reopen each time: a file deleted and
// recreated on the same path (a new job) is a new generation, noticed and read from the start.
// get() and wait() poll with a short sleep until their deadline. The file is never removed here:
// whoever chose the path owns it (use a fresh path, or a PrefixStore per restart).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "comm/net/socket.h"
#include "comm/store/quote.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {
namespace {

using Clock = net::Clock;
using Deadline = net::Deadline;

constexpr char kMagic[8] = {'D', 'T', 'F', 'S', 'T', 'O', 'R', '1'};
constexpr size_t kFileHeaderBytes = 16;
constexpr uint8_t kOpSet = 'S';
constexpr uint8_t kOpDelete = 'D';

uint8_t* putLE(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
  return p + bytes;
}
uint64_t getLE(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}


bool parseInt(const Bytes& v, int64_t* out) {
  auto* b = reinterpret_cast<const char*>(v.data());
  auto* e = b + v.size();
  auto r = std::from_chars(b, e, *out);
  return !v.empty() && r.ec == std::errc() && r.ptr == e;
}

uint64_t newGeneration() {
  std::random_device rd;
  uint64_t g = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return g ^ static_cast<uint64_t>(Clock::now().time_since_epoch().count()) ^ static_cast<uint64_t>(getpid());
}

// Sleeps between polls of the file: short at first (rendezvous is quick), longer when waiting long.
class Backoff {
 public:
  void sleepUntilAtMost(Deadline deadline) {
    auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return;
    std::this_thread::sleep_for(std::min<Clock::duration>(step_, left));
    step_ = std::min<Clock::duration>(step_ * 2, std::chrono::milliseconds(20));
  }

 private:
  Clock::duration step_ = std::chrono::microseconds(500);
};

}  // namespace

struct FileStore::Impl {
  explicit Impl(std::string p) : path(std::move(p)) {}

  // Runs fn() with the file open and exclusively locked and the cache up to date; fn may append().
  template <class Fn>
  auto locked(Deadline deadline, const std::string& what, Fn&& fn);
  void refresh(const std::string& what);
  void append(uint8_t op, const std::string& key, const Bytes& value, const std::string& what);
  std::string where(const std::string& what) const { return fmt::format("FileStore '{}' {}", path, what); }

  const std::string path;
  std::mutex mu;  // one operation at a time per instance: guards the cache and `fd`
  net::Fd fd;     // open (and locked) only during an operation
  std::unordered_map<std::string, Bytes> cache;
  uint64_t generation = 0;  // of the file the cache reflects
  uint64_t pos = 0;         // end of the last record read into the cache
};

template <class Fn>
auto FileStore::Impl::locked(Deadline deadline, const std::string& what, Fn&& fn) {
  std::lock_guard<std::mutex> guard(mu);
  fd = net::Fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));  // (the job's alone: docs/SECURITY.md)
  if (!fd.valid()) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      throw RendezvousError(fmt::format("{}: cannot open the store file: its directory does not exist ({})",
                                        where(what), strerror(err)));
    }
    throw RendezvousError(fmt::format("{}: cannot open the store file: {}", where(what), strerror(err)));
  }
  // Closing the descriptor would release the lock too, but an explicit unlock also covers a copy of
  // the descriptor that a concurrent fork() may have made.
  struct Unlock {
    net::Fd& fd;
    ~Unlock() {
      ::flock(fd.get(), LOCK_UN);
      fd.reset();
    }
  } unlock{fd};
  // Non-blocking attempts so that a lock holder that hangs (SIGSTOP, dead NFS client) costs a
  // TimeoutError at the deadline rather than a hang.
  Backoff backoff;
  while (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) throw IoError(fmt::format("{}: flock: {}", where(what), strerror(errno)));
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{}: timed out waiting for the lock on the store file", where(what)));
    }
    backoff.sleepUntilAtMost(deadline);
  }
  refresh(what);
  return fn();
}

// Brings the cache up to the end of the file (the lock is held).
void FileStore::Impl::refresh(const std::string& what) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw IoError(fmt::format("{}: fstat: {}", where(what), strerror(errno)));
  auto size = static_cast<uint64_t>(st.st_size);
  if (size < kFileHeaderBytes) {
    // New, or its creator died while writing the header: (re)create it, unless it is someone else's.
    uint8_t head[sizeof kMagic] = {};
    size_t n = std::min<uint64_t>(size, sizeof kMagic);
    if (n > 0 && (::pread(fd.get(), head, n, 0) != static_cast<ssize_t>(n) || std::memcmp(head, kMagic, n) != 0)) {
      throw ProtocolError(fmt::format("{}: the file exists but is not a dtrain FileStore (bad magic)", where(what)));
    }
    Bytes header(kFileHeaderBytes);
    uint64_t gen = newGeneration();
    putLE(std::copy(kMagic, kMagic + sizeof kMagic, header.data()), gen, 8);
    if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), header.data(), header.size(), 0) !=
                                             static_cast<ssize_t>(header.size())) {
      throw IoError(fmt::format("{}: cannot initialise the store file: {}", where(what), strerror(errno)));
    }
    cache.clear();
    generation = gen;
    pos = kFileHeaderBytes;
    return;
  }
  uint8_t header[kFileHeaderBytes];
  if (::pread(fd.get(), header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    throw IoError(fmt::format("{}: cannot read the store file: {}", where(what), strerror(errno)));
  }
  if (std::memcmp(header, kMagic, sizeof kMagic) != 0) {
    throw ProtocolError(fmt::format("{}: the file exists but is not a dtrain FileStore (bad magic)", where(what)));
  }
  uint64_t gen = getLE(header + 8, 8);
  if (gen != generation || size < pos) {  // a different file than the cache reflects: start over
    cache.clear();
    generation = gen;
    pos = kFileHeaderBytes;
  }
  if (size == pos) return;

  Bytes buf(size - pos);
  size_t got = 0;
  while (got < buf.size()) {
    ssize_t r = ::pread(fd.get(), buf.data() + got, buf.size() - got, static_cast<off_t>(pos + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw IoError(fmt::format("{}: cannot read the store file: {}", where(what), strerror(errno)));
    got += static_cast<size_t>(r);
  }
  size_t at = 0;
  // Parses one record at buf[at]; false when the record is torn (extends past the end of the file).
  auto parseOne = [&]() -> bool {
    auto need = [&](size_t n) { return buf.size() - at >= n; };
    auto corrupt = [&](const std::string& why) {
      return ProtocolError(fmt::format("{}: the store file is corrupt at offset {}: {}", where(what), pos + at, why));
    };
    if (!need(5)) return false;
    uint8_t op = buf[at];
    auto klen = static_cast<size_t>(getLE(&buf[at + 1], 4));
    if (op != kOpSet && op != kOpDelete) throw corrupt(fmt::format("unknown record type {}", op));
    if (klen > kMaxStoreKeyBytes) throw corrupt(fmt::format("key of {} bytes", klen));
    if (!need(5 + klen + 4)) return false;
    auto vlen = static_cast<size_t>(getLE(&buf[at + 5 + klen], 4));
    if (vlen > kMaxStoreValueBytes) throw corrupt(fmt::format("value of {} bytes", vlen));
    if (!need(9 + klen + vlen)) return false;
    std::string key(buf.begin() + at + 5, buf.begin() + at + 5 + klen);
    const uint8_t* v = &buf[at + 9 + klen];
    if (op == kOpSet) cache[key] = Bytes(v, v + vlen);
    else cache.erase(key);
    at += 9 + klen + vlen;
    return true;
  };
  while (at < buf.size() && parseOne()) {
  }
  pos += at;
  if (pos < size) {
    // A writer died mid-append (writers hold the lock, so nobody is writing now): cut its torn record
    // off, or every later record would be appended after garbage.
    if (::ftruncate(fd.get(), static_cast<off_t>(pos)) != 0) {
      throw IoError(fmt::format("{}: cannot truncate a torn record: {}", where(what), strerror(errno)));
    }
  }
}

void FileStore::Impl::append(uint8_t op, const std::string& key, const Bytes& value, const std::string& what) {
  Bytes rec(9 + key.size() + value.size());
  uint8_t* p = rec.data();
  *p++ = op;
  p = std::copy(key.begin(), key.end(), putLE(p, key.size(), 4));
  std::copy(value.begin(), value.end(), putLE(p, value.size(), 4));
  size_t done = 0;
  while (done < rec.size()) {
    ssize_t w = ::pwrite(fd.get(), rec.data() + done, rec.size() - done, static_cast<off_t>(pos + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int err = errno;
      // Leave no torn record behind when we can help it (e.g. ENOSPC).
      if (::ftruncate(fd.get(), static_cast<off_t>(pos)) != 0) {
        // Then the next locked operation cuts the torn record off.
      }
      throw IoError(fmt::format("{}: cannot append to the store file: {}", where(what), strerror(err)));
    }
    done += static_cast<size_t>(w);
  }
  pos += rec.size();
  if (op == kOpSet) cache[key] = value;
  else cache.erase(key);
}

namespace {
void checkKey(const std::string& path, const std::string& key, const char* op) {
  if (key.size() > kMaxStoreKeyBytes) {
    throw InvalidArgument(fmt::format("FileStore '{}' {}({}): key of {} bytes exceeds the limit of {}", path, op,
                                      quoteKey(key), key.size(), kMaxStoreKeyBytes));
  }
}
void checkValue(const std::string& path, const std::string& key, const Bytes& value, const char* op) {
  if (value.size() > kMaxStoreValueBytes) {
    throw InvalidArgument(fmt::format("FileStore '{}' {}({}): value of {} bytes exceeds the limit of {}", path,
                                      op, quoteKey(key), value.size(), kMaxStoreValueBytes));
  }
}
void checkKeys(const std::string& path, const std::vector<std::string>& keys, const char* op) {
  for (const auto& k : keys) checkKey(path, k, op);
}
}  // namespace

FileStore::FileStore(const std::string& path, Duration timeout)
    : Store(timeout), impl_(std::make_unique<Impl>(path)) {
  // Create (or check) the file now, so a wrong path fails here rather than at first use.
  impl_->locked(net::deadlineAfter(timeout), "open", [] {});
}

FileStore::~FileStore() = default;

void FileStore::set(const std::string& key, const Bytes& value) {
  checkKey(impl_->path, key, "set");
  checkValue(impl_->path, key, value, "set");
  std::string what = fmt::format("set({})", quoteKey(key));
  impl_->locked(net::deadlineAfter(timeout()), what, [&] { impl_->append(kOpSet, key, value, what); });
}

Bytes FileStore::get(const std::string& key) {
  checkKey(impl_->path, key, "get");
  const std::string what = fmt::format("get({})", quoteKey(key));
  const Deadline deadline = net::deadlineAfter(timeout());
  Backoff backoff;
  for (;;) {
    Bytes value;
    bool found = impl_->locked(deadline, what, [&] {
      auto it = impl_->cache.find(key);
      if (it == impl_->cache.end()) return false;
      value = it->second;
      return true;
    });
    if (found) return value;
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{} timed out after {}ms waiting for key {}", impl_->where(what),
                                     timeout().count(), quoteKey(key)));
    }
    backoff.sleepUntilAtMost(deadline);
  }
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  checkKey(impl_->path, key, "add");
  std::string what = fmt::format("add({}, {})", quoteKey(key), delta);
  return impl_->locked(net::deadlineAfter(timeout()), what, [&] {
    int64_t cur = 0;
    auto it = impl_->cache.find(key);
    if (it != impl_->cache.end() && !parseInt(it->second, &cur)) {
      throw InvalidArgument(fmt::format("{}: the value of the key is not an integer: {}", impl_->where(what),
                                        quoteKey(toString(it->second))));
    }
    int64_t next = 0;
    if (__builtin_add_overflow(cur, delta, &next)) {
      throw InvalidArgument(fmt::format("{}: {} + {} overflows int64", impl_->where(what), cur, delta));
    }
    impl_->append(kOpSet, key, toBytes(std::to_string(next)), what);
    return next;
  });
}

Bytes FileStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  checkKey(impl_->path, key, "compareSet");
  checkValue(impl_->path, key, desired, "compareSet");
  std::string what = fmt::format("compareSet({})", quoteKey(key));
  return impl_->locked(net::deadlineAfter(timeout()), what, [&]() -> Bytes {
    auto it = impl_->cache.find(key);
    // A missing key matches an empty expected value; otherwise it stays missing (answer: empty).
    bool matches = it == impl_->cache.end() ? expected.empty() : it->second == expected;
    if (matches) {
      impl_->append(kOpSet, key, desired, what);
      return desired;
    }
    return it == impl_->cache.end() ? Bytes() : it->second;
  });
}

bool FileStore::deleteKey(const std::string& key) {
  checkKey(impl_->path, key, "deleteKey");
  std::string what = fmt::format("deleteKey({})", quoteKey(key));
  return impl_->locked(net::deadlineAfter(timeout()), what, [&] {
    if (!impl_->cache.count(key)) return false;
    impl_->append(kOpDelete, key, Bytes(), what);
    return true;
  });
}

bool FileStore::check(const std::vector<std::string>& keys) {
  checkKeys(impl_->path, keys, "check");
  std::string what = fmt::format("check([{}])", quoteKeys(keys));
  return impl_->locked(net::deadlineAfter(timeout()), what, [&] {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return impl_->cache.count(k) > 0; });
  });
}

void FileStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  checkKeys(impl_->path, keys, "wait");
  const std::string what = fmt::format("wait([{}])", quoteKeys(keys));
  const Deadline deadline = net::deadlineAfter(timeout);
  Backoff backoff;
  for (;;) {
    std::vector<std::string> missing = impl_->locked(deadline, what, [&] {
      std::vector<std::string> m;
      for (const auto& k : keys)
        if (!impl_->cache.count(k)) m.push_back(k);
      return m;
    });
    if (missing.empty()) return;
    if (Clock::now() >= deadline) {
      throw TimeoutError(fmt::format("{} timed out after {}ms waiting for key{} {}", impl_->where(what),
                                     timeout.count(), missing.size() == 1 ? "" : "s", quoteKeys(missing)));
    }
    backoff.sleepUntilAtMost(deadline);
  }
}

int64_t FileStore::numKeys() {
  return impl_->locked(net::deadlineAfter(timeout()), "numKeys()",
                       [&] { return static_cast<int64_t>(impl_->cache.size()); });
}

}  // namespace dtrain::comm

namespace dtrain::comm {
std::shared_ptr<Store> FileStore::clone() const { return std::make_shared<FileStore>(impl_->path, timeout()); }
}  // namespace dtrain::comm
