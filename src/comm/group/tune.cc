// DTRAIN_TUNE's setting and cache (shared with DDP's bucket tuning, src/torch/ddp_tune.cc) and the
// allreduce probe a group runs when it is made (tune.h). The probe times both algorithms of the group's
// open crossover at 1 KiB-1 MiB with the group's own calls (the algorithm forced per call), so it goes
// through the same queue, transport and checks as training will.
#include "comm/group/tune.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::comm::tune {

Mode modeFromEnv() {
  const auto env = rendezvous::Environment::read();  // get() points into it
  const char* v = env.get("DTRAIN_TUNE");
  if (!v) return Mode::off;
  const std::string s = v;
  if (s == "off" || s == "0") return Mode::off;
  if (s == "on" || s == "1") return Mode::on;
  if (s == "refresh") return Mode::refresh;
  throw InvalidArgument(fmt::format("DTRAIN_TUNE='{}' (expected on, off or refresh)", s));
}

std::string cachePath() {
  const auto env = rendezvous::Environment::read();
  if (const char* p = env.get("DTRAIN_TUNE_CACHE")) return p;
  if (const char* x = env.get("XDG_CACHE_HOME")) return std::string(x) + "/dtrain/tune.tsv";
  if (const char* h = env.get("HOME")) return std::string(h) + "/.cache/dtrain/tune.tsv";
  return "";
}

std::optional<std::vector<std::string>> readCache(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::optional<std::vector<std::string>> found;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string k;
    if (!std::getline(fields, k, '\t') || k != key) continue;
    std::vector<std::string> v;
    for (std::string f; std::getline(fields, f, '\t');) v.push_back(f);
    found = v;
  }
  return found;
}

std::string appendCache(const std::string& path, const std::string& key, const std::vector<std::string>& fields) {
  std::string line = key;
  for (const auto& f : fields) line += "\t" + f;
  line += "\n";
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return fmt::format("cannot open it: {}", std::strerror(errno));
  const ssize_t n = ::write(fd, line.data(), line.size());
  const int err = errno;
  ::close(fd);
  return n == static_cast<ssize_t>(line.size()) ? "" : fmt::format("cannot write it: {}", std::strerror(err));
}

std::string hostName() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return host;
}

std::optional<std::vector<int64_t>> cachedForAll(ProcessGroup& pg, Mode mode, const std::string& path,
                                                 const std::string& key, size_t n) {
  std::vector<int64_t> found(n + 1, 0);  // {found, fields...}
  if (pg.rank() == 0 && mode == Mode::on && !path.empty()) {
    auto f = readCache(path, key);
    bool ok = f && f->size() >= n;
    for (size_t i = 0; ok && i < n; ++i) {
      char* end = nullptr;
      const long long v = std::strtoll((*f)[i].c_str(), &end, 10);
      ok = end && end != (*f)[i].c_str() && *end == 0 && v >= 0;
      found[i + 1] = v;
    }
    found[0] = ok ? 1 : 0;
  }
  pg.broadcast(found.data(), found.size(), DType::i64, 0)->wait();
  if (!found[0]) return std::nullopt;
  return std::vector<int64_t>(found.begin() + 1, found.end());
}

std::string storeChoice(const std::string& path, const std::string& key, const std::vector<std::string>& fields) {
  if (path.empty()) return "not cached (no DTRAIN_TUNE_CACHE, XDG_CACHE_HOME or HOME)";
  const std::string why = appendCache(path, key, fields);
  return why.empty() ? "cached in " + path : fmt::format("not cached: {} {}", path, why);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

size_t crossoverBytes(const std::vector<size_t>& sizes, const std::vector<double>& small_us,
                      const std::vector<double>& large_us) {
  size_t best = 0;
  for (size_t i = 0; i < sizes.size() && small_us[i] <= large_us[i]; ++i) best = sizes[i];
  return best;
}

Crossover openCrossover(AllreduceAlgorithm forced, const algo::Hierarchy* hier, transport::Transport& tx) {
  if (forced != AllreduceAlgorithm::automatic || (hier && hier->someHostShared())) return Crossover::none;
  if (!tx.staging()) return Crossover::rd_vs_ring;
  return tx.oversubscribed() ? Crossover::rd_vs_direct : Crossover::none;
}

namespace {

std::string kib(size_t bytes) { return fmt::format("{} KiB", bytes >> 10); }

// The median of `reps` timed calls (after two untimed) of an allreduce of `bytes` with `algo`, in us.
double timeAllreduce(ProcessGroup& pg, std::vector<float>& buf, size_t bytes, AllreduceAlgorithm algo, int reps) {
  const size_t count = bytes / sizeof(float);
  std::vector<double> us;
  for (int r = 0; r < reps + 2; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pg.allreduce(buf.data(), buf.data(), count, DType::f32, ReduceOp::avg, algo)->wait();
    const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (r >= 2) us.push_back(t);
  }
  return median(us);
}

}  // namespace

algo::Thresholds tuneAllreduce(ProcessGroup& pg, Crossover which, Mode mode) {
  algo::Thresholds t;
  if (which == Crossover::none || mode == Mode::off || pg.size() == 1) return t;
  const bool ring = which == Crossover::rd_vs_ring;
  const std::string key = fmt::format("allreduce host={} world={} transport={} crossover={}", hostName(), pg.size(),
                                      pg.transportName(), ring ? "rd-ring" : "rd-direct-oversubscribed");
  const std::string path = cachePath();
  const auto cached = cachedForAll(pg, mode, path, key, 1);
  size_t& chosen = ring ? t.rd_max_bytes : t.direct_oversubscribed_min_bytes;
  const size_t default_bytes = chosen;
  if (cached) {
    chosen = static_cast<size_t>((*cached)[0]);
    if (pg.rank() == 0)
      std::fprintf(stderr, "[rank 0] dtrain: allreduce threshold from the tuning cache %s: recursive doubling up to %s, "
                   "%s above\n", path.c_str(), kib(chosen).c_str(), ring ? "the ring" : "direct");
    return t;
  }
  // Both algorithms at each size; the slowest rank's time of each counts.
  std::vector<size_t> sizes;
  for (size_t b = 1u << 10; b <= (1u << 20); b <<= 1) sizes.push_back(b);
  std::vector<float> buf((1u << 20) / sizeof(float), 1.0f);
  const AllreduceAlgorithm large = ring ? AllreduceAlgorithm::ring : AllreduceAlgorithm::direct;
  std::vector<double> us;  // [small at each size..., large at each size...]
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::recursive_doubling, large})
    for (size_t b : sizes) us.push_back(timeAllreduce(pg, buf, b, a, /*reps=*/9));
  pg.allreduce(us.data(), us.data(), us.size(), DType::f64, ReduceOp::max)->wait();
  const std::vector<double> small_us(us.begin(), us.begin() + static_cast<long>(sizes.size())),
      large_us(us.begin() + static_cast<long>(sizes.size()), us.end());
  chosen = crossoverBytes(sizes, small_us, large_us);
  if (pg.rank() != 0) return t;
  const std::string where = storeChoice(path, key, {std::to_string(chosen), std::to_string(std::time(nullptr))});
  std::string table;
  for (size_t i = 0; i < sizes.size(); ++i)
    table += fmt::format("{}{} {:.0f}/{:.0f}", i ? ", " : "", kib(sizes[i]), small_us[i], large_us[i]);
  std::fprintf(stderr,
               "[rank 0] dtrain: allreduce tuned for world %d over %s: recursive doubling up to %s, %s above (default "
               "%s); us rd/%s: %s; %s\n",
               pg.size(), pg.transportName().c_str(), kib(chosen).c_str(), ring ? "the ring" : "direct",
               kib(default_bytes).c_str(), ring ? "ring" : "direct", table.c_str(), where.c_str());
  return t;
}

algo::Thresholds forNewGroup(ProcessGroup& pg, AllreduceAlgorithm forced, const algo::Hierarchy* hier,
                             transport::Transport& tx) {
  const Mode mode = modeFromEnv();
  return mode == Mode::off ? algo::Thresholds{} : tuneAllreduce(pg, openCrossover(forced, hier, tx), mode);
}

}  // namespace dtrain::comm::tune
