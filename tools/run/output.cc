// Workers' output: the console forwarding, torchrun's --redirects/--tee values and the log files.
#include "output.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dtrain/comm/error.h"

namespace dtrain::run {

using comm::net::Fd;

namespace {

// A line longer than this is forwarded in pieces rather than buffered without bound.
constexpr size_t kMaxLine = 64 * 1024;
// What is left in a pipe when its child exits is forwarded up to this much.
constexpr size_t kMaxDrain = 4 << 20;

bool parseInt(const std::string& s, int max, int& out) {
  if (s.empty() || s.size() > 7 || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  out = std::stoi(s);
  return out <= max;
}

std::string mkdtempIn(const std::string& dir, const std::string& prefix) {
  std::string templ = dir + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) {
    throw IoError(fmt::format("cannot create a log directory in {}: {}", dir, strerror(errno)));
  }
  return buf.data();
}

}  // namespace

int StreamSpec::forLocalRank(int local_rank) const {
  if (all) return *all;
  auto it = per_rank.find(local_rank);
  return it == per_rank.end() ? kNoStreams : it->second;
}

bool StreamSpec::any() const {
  return all.value_or(kNoStreams) != kNoStreams ||
         std::any_of(per_rank.begin(), per_rank.end(), [](const auto& kv) { return kv.second != kNoStreams; });
}

StreamSpec parseStreamSpec(const std::string& flag, const std::string& text) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument(fmt::format(
        "{} '{}': {}; expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for every local rank, or "
        "LOCAL_RANK:VALUE pairs like 0:3,1:2",
        flag, text, why));
  };
  StreamSpec spec;
  int v = 0;
  if (parseInt(text, kBoth, v)) {
    spec.all = v;
    return spec;
  }
  if (text.find(':') == std::string::npos) throw bad("not a value in 0..3");
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string pair = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t colon = pair.find(':');
    int rank = 0;
    if (colon == std::string::npos || !parseInt(pair.substr(0, colon), 1 << 20, rank) ||
        !parseInt(pair.substr(colon + 1), kBoth, v)) {
      throw bad(fmt::format("'{}' is not LOCAL_RANK:VALUE with VALUE in 0..3", pair));
    }
    if (!spec.per_rank.emplace(rank, v).second) throw bad(fmt::format("local rank {} is named twice", rank));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return spec;
}

void makeDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) == 0) return;
  struct stat st {};
  if (errno == EEXIST && ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return;
  throw IoError(fmt::format("cannot create the log directory {}: {}", path,
                            errno == EEXIST ? "a file of that name exists" : strerror(errno)));
}

std::string makeRunLogDir(const std::string& base, int node_rank) {
  std::string dir = base;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = mkdtempIn(tmp && *tmp ? tmp : "/tmp", "dtrain-run_");
  } else {
    // mkdir -p: every missing parent too.
    for (size_t slash = dir.find('/', 1); slash != std::string::npos; slash = dir.find('/', slash + 1)) {
      makeDir(dir.substr(0, slash));
    }
    makeDir(dir);
  }
  return mkdtempIn(dir, fmt::format("node{}_", node_rank));
}

Fd openLogFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) throw IoError(fmt::format("cannot create the log file {}: {}", path, strerror(errno)));
  return fd;
}

void writeAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else if (w < 0 && errno == EAGAIN) {
      // Someone made our stdout non-blocking; wait for room, but not forever.
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, 1000) <= 0) return;
    } else {
      return;
    }
  }
}

OutputPipe::OutputPipe(Fd fd, int console, std::string prefix, bool prefixed, Fd file)
    : fd_(std::move(fd)), console_(console), prefix_(std::move(prefix)), prefixed_(prefixed), file_(std::move(file)) {
  ::fcntl(fd_.get(), F_SETFL, ::fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
}

void OutputPipe::pump() { readUpTo(256 * 1024); }

void OutputPipe::finish() {
  readUpTo(kMaxDrain);
  if (!partial_.empty() && console_ >= 0) {
    writeAll(console_, prefix_ + partial_ + "\n");
    partial_.clear();
  }
  fd_.reset();
  file_.reset();
}

void OutputPipe::readUpTo(size_t budget) {
  char buf[64 * 1024];
  while (fd_.valid() && budget > 0) {
    ssize_t n = ::read(fd_.get(), buf, std::min(sizeof buf, budget));
    if (n > 0) {
      emit(buf, static_cast<size_t>(n));
      budget -= static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      return;
    } else {
      fd_.reset();  // EOF (or a broken pipe): nothing more will come
    }
  }
}

void OutputPipe::emit(const char* data, size_t n) {
  if (file_.valid()) writeAll(file_.get(), data, n);
  if (console_ < 0) return;
  if (!prefixed_) {
    writeAll(console_, data, n);
    return;
  }
  std::string out;
  size_t start = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != '\n') continue;
    out += prefix_;
    out += partial_;
    out.append(data + start, i + 1 - start);
    partial_.clear();
    start = i + 1;
  }
  partial_.append(data + start, n - start);
  if (partial_.size() > kMaxLine) {
    out += prefix_ + partial_ + "\n";
    partial_.clear();
  }
  if (!out.empty()) writeAll(console_, out);
}

}  // namespace dtrain::run
