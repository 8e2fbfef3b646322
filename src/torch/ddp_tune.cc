// DDP's bucket-size tuning (DDPOptions::tune, ddp.h): after the first synced pass the buckets take each
// candidate cap in turn, in rounds, for one pass each, timed from the moment its buckets were rebuilt
// (at the end of the previous synced backward) to the end of its own synced backward: the whole step
// counts (the optimizer, whatever the loop does, forward, backward and the exposed allreduce), the
// rebuild's copy of the gradients does not. Then the cap with the lowest median keeps them.
// Every rank times its own passes; the slowest rank's time of each pass counts (one allreduce at the
// end), so every rank picks the same cap. Rank 0 reads and appends the tuning cache; its answer is
// broadcast, so the ranks agree on that too.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "comm/rendezvous/environment.h"
#include "ddp_impl.h"
#include "dtrain/comm/error.h"

namespace dtrain {

namespace {

using detail::BucketSizes;
using TuneKind = DDPTuning::State;

constexpr size_t kTuneMiB = size_t{1} << 20;
// The caps tried (MiB); the first bucket's cap is min(1 MiB, cap), PyTorch's first-bucket rule.
constexpr size_t kTuneCandidateMiB[] = {1, 2, 4, 8, 16, 25, 64};

std::string tuneMib(size_t bytes) { return fmt::format("{:g} MiB", static_cast<double>(bytes) / kTuneMiB); }

// The cache: DTRAIN_TUNE_CACHE, else $XDG_CACHE_HOME/dtrain/tune.tsv, else ~/.cache/dtrain/tune.tsv;
// "" when none of them is set.
std::string tuneCachePath() {
  const auto env = comm::rendezvous::Environment::read();
  if (const char* p = env.get("DTRAIN_TUNE_CACHE")) return p;
  if (const char* x = env.get("XDG_CACHE_HOME")) return std::string(x) + "/dtrain/tune.tsv";
  if (const char* h = env.get("HOME")) return std::string(h) + "/.cache/dtrain/tune.tsv";
  return "";
}

// This job as the cache knows it: rank 0's host, the world, the transport, the device type, and the
// parameters (count, bytes, and a hash of their sizes and dtypes in registration order).
std::string tuneJobKey(const std::vector<at::Tensor>& params, comm::ProcessGroup& pg) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  uint64_t h = 1469598103934665603ull, bytes = 0;  // FNV-1a
  auto mix = [&h](uint64_t v) {
    for (int b = 0; b < 8; ++b) h = (h ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ull;
  };
  for (const auto& p : params) {
    mix(static_cast<uint64_t>(p.numel()));
    mix(static_cast<uint64_t>(p.scalar_type()));
    bytes += static_cast<uint64_t>(p.numel()) * p.element_size();
  }
  return fmt::format("ddp-buckets host={} world={} transport={} device={} params={} bytes={} sig={:016x}", host,
                     pg.size(), pg.transportName(), params.empty() ? "none" : params[0].device().str(),
                     params.size(), bytes, h);
}

// The last line of the cache with this key: "key \t bucket_bytes \t first_bucket_bytes \t ...".
std::optional<BucketSizes> readTuneCache(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::optional<BucketSizes> found;
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    std::string k;
    unsigned long long bucket = 0, first = 0;
    if (!std::getline(fields, k, '\t') || k != key || !(fields >> bucket >> first) || !bucket || !first) continue;
    found = BucketSizes{static_cast<size_t>(bucket), static_cast<size_t>(first)};
  }
  return found;
}

// Appends one line (a single write: lines of concurrent jobs do not interleave). Returns "" or why not.
std::string appendTuneCache(const std::string& path, const std::string& line) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return fmt::format("cannot open it: {}", std::strerror(errno));
  const ssize_t n = ::write(fd, line.data(), line.size());
  const int err = errno;
  ::close(fd);
  return n == static_cast<ssize_t>(line.size()) ? "" : fmt::format("cannot write it: {}", std::strerror(err));
}

double tuneMedian(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

namespace detail {
DDPOptions::Tune resolveTune(DDPOptions::Tune asked) {
  if (asked != DDPOptions::Tune::from_env) return asked;
  const char* v = comm::rendezvous::Environment::read().get("DTRAIN_TUNE");
  if (!v) return DDPOptions::Tune::off;
  const std::string s = v;
  if (s == "off" || s == "0") return DDPOptions::Tune::off;
  if (s == "on" || s == "1") return DDPOptions::Tune::on;
  if (s == "refresh") return DDPOptions::Tune::refresh;
  throw InvalidArgument(fmt::format("DTRAIN_TUNE='{}' (expected on, off or refresh)", s));
}
}  // namespace detail

void DistributedDataParallel::Impl::applyBucketSizes(const BucketSizes& sizes) {
  opts.bucket_bytes = sizes.bucket_bytes;
  opts.first_bucket_bytes = sizes.first_bucket_bytes;
  buildBuckets(std::vector<size_t>(layout_order));
}

void DistributedDataParallel::Impl::startTuning() {
  auto& t = tune;
  t.configured = {opts.bucket_bytes, opts.first_bucket_bytes};
  auto off = [&](const char* why) {
    t.report.state = TuneKind::off;
    t.report.why_off = why;
  };
  if (t.mode == DDPOptions::Tune::off) return off("tuning is off (DDPOptions::tune, DTRAIN_TUNE)");
  if (pg->size() == 1) return off("a world of one rank");
  if (hook) return off("a comm hook is registered");
  if (join) return off("a dtrain::Join scope is active");
  t.report.key = tuneJobKey(params, *pg);
  t.report.cache_path = tuneCachePath();
  // Rank 0's cache answer for everyone: {found, bucket_bytes, first_bucket_bytes}.
  std::vector<int64_t> cached{0, 0, 0};
  if (pg->rank() == 0 && t.mode == DDPOptions::Tune::on && !t.report.cache_path.empty()) {
    if (auto c = readTuneCache(t.report.cache_path, t.report.key))
      cached = {1, static_cast<int64_t>(c->bucket_bytes), static_cast<int64_t>(c->first_bucket_bytes)};
  }
  pg->broadcast(cached.data(), cached.size(), comm::DType::i64, 0)->wait();
  if (cached[0]) {
    applyBucketSizes({static_cast<size_t>(cached[1]), static_cast<size_t>(cached[2])});
    t.report.state = TuneKind::cached;
    if (pg->rank() == 0)
      std::fprintf(stderr, "[rank 0] DDP: bucket sizes from the tuning cache %s: %s (first %s); DTRAIN_TUNE=refresh tunes again\n",
                   t.report.cache_path.c_str(), tuneMib(opts.bucket_bytes).c_str(), tuneMib(opts.first_bucket_bytes).c_str());
    return;
  }
  // The candidates, each a distinct layout (caps past the model's size all make one bucket).
  std::vector<std::vector<std::vector<size_t>>> layouts;
  auto add = [&](BucketSizes s, bool configured) {
    auto layout = detail::assignBuckets(params, layout_order, s);
    auto same = std::find(layouts.begin(), layouts.end(), layout);
    if (same != layouts.end()) {
      t.report.candidates[static_cast<size_t>(same - layouts.begin())].configured |= configured;
      return;
    }
    layouts.push_back(layout);
    t.sizes.push_back(s);
    DDPTuning::Candidate c;
    c.bucket_bytes = s.bucket_bytes;
    c.first_bucket_bytes = s.first_bucket_bytes;
    c.buckets = layout.size();
    c.configured = configured;
    t.report.candidates.push_back(c);
  };
  for (size_t m : kTuneCandidateMiB) add({m * kTuneMiB, std::min(m * kTuneMiB, kTuneMiB)}, false);
  add(t.configured, true);
  if (t.sizes.size() == 1) {  // every cap gives the same buckets: nothing to choose
    t.report.state = TuneKind::tuned;
    applyBucketSizes(t.sizes[0]);
    if (pg->rank() == 0)
      std::fprintf(stderr, "[rank 0] DDP: bucket tuning: every candidate cap gives the same %zu bucket(s) for these "
                   "%zu parameters: nothing to tune\n", t.report.candidates[0].buckets, params.size());
    return;
  }
  t.report.state = TuneKind::probing;
  t.visit = 0;
  t.samples.assign(t.sizes.size() * static_cast<size_t>(opts.tune_rounds), 0.0);
  applyBucketSizes(t.sizes[0]);
  t.since = detail::Clock::now();
}

void DistributedDataParallel::Impl::tuneAfterPass() {
  auto& t = tune;
  if (join) return stopTuning("a dtrain::Join scope became active");
  const size_t n = t.sizes.size();
  t.samples[t.visit] = std::chrono::duration<double, std::milli>(detail::Clock::now() - t.since).count();
  if (++t.visit < t.samples.size()) {
    applyBucketSizes(t.sizes[t.visit % n]);
    t.since = detail::Clock::now();  // the rebuild's copy is not the next layout's cost
    return;
  }
  // Every pass counts at the slowest rank's time: all ranks then choose alike.
  pg->allreduce(t.samples.data(), t.samples.size(), comm::DType::f64, comm::ReduceOp::max)->wait();
  size_t best = 0;
  for (size_t c = 0; c < n; ++c) {
    auto& cand = t.report.candidates[c];
    for (int r = 0; r < opts.tune_rounds; ++r) cand.ms.push_back(t.samples[static_cast<size_t>(r) * n + c]);
    cand.median_ms = tuneMedian(cand.ms);
    if (cand.median_ms < t.report.candidates[best].median_ms) best = c;
  }
  applyBucketSizes(t.sizes[best]);
  t.report.state = TuneKind::tuned;
  if (pg->rank() != 0) return;
  double configured_ms = 0;
  for (const auto& c : t.report.candidates)
    if (c.configured) configured_ms = c.median_ms;
  const auto& b = t.report.candidates[best];
  std::string cached = "not cached (no DTRAIN_TUNE_CACHE, XDG_CACHE_HOME or HOME)";
  if (!t.report.cache_path.empty()) {
    const std::string why =
        appendTuneCache(t.report.cache_path, fmt::format("{}\t{}\t{}\t{:.3f}\t{}\n", t.report.key, b.bucket_bytes,
                                                     b.first_bucket_bytes, b.median_ms, std::time(nullptr)));
    cached = why.empty() ? "cached in " + t.report.cache_path
                         : fmt::format("not cached: {} {}", t.report.cache_path, why);
  }
  const std::string against = b.configured
      ? fmt::format("the configured {} makes the same buckets", tuneMib(t.configured.bucket_bytes))
      : fmt::format("the configured {}: {:.1f} ms", tuneMib(t.configured.bucket_bytes), configured_ms);
  std::fprintf(stderr,
               "[rank 0] DDP: tuned bucket sizes: %s (first %s, %zu buckets), median step %.1f ms; %s (%zu layouts x %d "
               "timed steps); %s\n",
               tuneMib(b.bucket_bytes).c_str(), tuneMib(b.first_bucket_bytes).c_str(), b.buckets, b.median_ms,
               against.c_str(), n, opts.tune_rounds, cached.c_str());
}

void DistributedDataParallel::Impl::stopTuning(const std::string& why) {
  applyBucketSizes(tune.configured);
  tune.report.state = TuneKind::off;
  tune.report.why_off = why + " while tuning: back to the configured bucket sizes";
}

}  // namespace dtrain
