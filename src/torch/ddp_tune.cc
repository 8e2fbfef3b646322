// DDP's bucket-size tuning (DDPOptions::tune, ddp.h): after the first synced pass the buckets take each
// candidate cap in turn, in rounds (each a rotation of the last), for one pass each, timed from the
// pass's first gradient to the end of its synced backward: backward with the buckets' communication
// beside it, and the part backward did not hide. (Forward and the optimizer do not depend on the
// layout: timing them too, as a first version did, only adds their noise to every sample.) Then the
// cap with the lowest median keeps them.
// Every rank times its own passes; the slowest rank's time of each pass counts (one allreduce at the
// end), so every rank picks the same cap. Rank 0 reads and appends the tuning cache; its answer is
// broadcast, so the ranks agree on that too.
#include <algorithm>
#include <cstdio>
#include <ctime>

#include <fmt/format.h>

#include "comm/group/tune.h"
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

// This job as the cache knows it: rank 0's host, the world, the transport, the device type, and the
// parameters (count, bytes, and a hash of their sizes and dtypes in registration order).
std::string tuneJobKey(const std::vector<at::Tensor>& params, comm::ProcessGroup& pg) {
  std::vector<size_t> shape;  // (numel, dtype) per parameter, hashed as the collectives hash counts
  uint64_t bytes = 0;
  for (const auto& p : params) {
    shape.push_back(static_cast<size_t>(p.numel()));
    shape.push_back(static_cast<size_t>(p.scalar_type()));
    bytes += static_cast<uint64_t>(p.numel()) * p.element_size();
  }
  return fmt::format("ddp-buckets host={} world={} transport={} device={} params={} bytes={} sig={:016x}",
                     comm::tune::hostName(), pg.size(), pg.transportName(),
                     params.empty() ? "none" : params[0].device().str(), params.size(), bytes,
                     comm::transport::hashCounts(shape));
}

}  // namespace

namespace detail {
comm::tune::Mode resolveTune(DDPOptions::Tune asked) {
  switch (asked) {
    case DDPOptions::Tune::off: return comm::tune::Mode::off;
    case DDPOptions::Tune::on: return comm::tune::Mode::on;
    case DDPOptions::Tune::refresh: return comm::tune::Mode::refresh;
    default: return comm::tune::modeFromEnv();
  }
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
  if (t.mode == comm::tune::Mode::off) return off("tuning is off (DDPOptions::tune, DTRAIN_TUNE)");
  if (pg->size() == 1) return off("a world of one rank");
  if (hook) return off("a comm hook is registered");
  if (join) return off("a dtrain::Join scope is active");
  t.report.key = tuneJobKey(params, *pg);
  t.report.cache_path = comm::tune::cachePath();
  // Rank 0's cached {bucket_bytes, first_bucket_bytes} for everyone (zero caps are no answer).
  const auto cached = comm::tune::cachedForAll(*pg, t.mode, t.report.cache_path, t.report.key, 2);
  if (cached && (*cached)[0] > 0 && (*cached)[1] > 0) {
    applyBucketSizes({static_cast<size_t>((*cached)[0]), static_cast<size_t>((*cached)[1])});
    t.report.state = TuneKind::cached;
    if (pg->rank() == 0)
      std::fprintf(stderr, "[rank 0] DDP: bucket sizes from the tuning cache %s: %s (first %s); DTRAIN_TUNE=refresh "
                   "tunes again\n", t.report.cache_path.c_str(), tuneMib(opts.bucket_bytes).c_str(),
                   tuneMib(opts.first_bucket_bytes).c_str());
    return;
  }
  // The candidates, each a distinct layout (caps past the model's size all make one bucket).
  std::vector<std::vector<std::vector<size_t>>> layouts;
  auto add = [&](BucketSizes s, bool configured) {
    s.last_bucket_bytes = opts.last_bucket_bytes;  // not tuned: every candidate keeps it
    auto layout = detail::assignBuckets(params, layout_order, s);
    auto same = std::find(layouts.begin(), layouts.end(), layout);
    if (same != layouts.end()) {  // the configured sizes name their layout: kept as they are if it wins
      const auto k = static_cast<size_t>(same - layouts.begin());
      if (configured) {
        t.report.candidates[k].bucket_bytes = s.bucket_bytes;
        t.report.candidates[k].first_bucket_bytes = s.first_bucket_bytes;
        t.report.candidates[k].configured = true;
      }
      return;
    }
    layouts.push_back(layout);
    DDPTuning::Candidate c;
    c.bucket_bytes = s.bucket_bytes;
    c.first_bucket_bytes = s.first_bucket_bytes;
    c.buckets = layout.size();
    c.configured = configured;
    t.report.candidates.push_back(c);
  };
  for (size_t m : kTuneCandidateMiB) add({m * kTuneMiB, std::min(m * kTuneMiB, kTuneMiB)}, false);
  add(t.configured, true);
  if (t.report.candidates.size() == 1) {  // every cap gives the same buckets: nothing to choose
    t.report.state = TuneKind::tuned;
    applyBucketSizes(t.sizesOf(0));
    if (pg->rank() == 0)
      std::fprintf(stderr, "[rank 0] DDP: bucket tuning: every candidate cap gives the same %zu bucket(s) for these "
                   "%zu parameters: nothing to tune\n", t.report.candidates[0].buckets, params.size());
    return;
  }
  t.report.state = TuneKind::probing;
  t.visit = 0;
  t.samples.assign(t.report.candidates.size() * static_cast<size_t>(opts.tune_rounds), 0.0);
  applyBucketSizes(t.sizesOf(0));
}

void DistributedDataParallel::Impl::tuneAfterPass() {
  auto& t = tune;
  if (join) return stopTuning("a dtrain::Join scope became active");
  const size_t n = t.report.candidates.size();
  t.samples[t.visit] = std::chrono::duration<double, std::milli>(detail::Clock::now() - t.pass_began).count();
  if (++t.visit < t.samples.size()) return applyBucketSizes(t.sizesOf(t.candidateOf(t.visit)));
  // Every pass counts at the slowest rank's time: all ranks then choose alike.
  pg->allreduce(t.samples.data(), t.samples.size(), comm::DType::f64, comm::ReduceOp::max)->wait();
  size_t best = 0;
  for (size_t c = 0; c < n; ++c) {
    auto& cand = t.report.candidates[c];
    for (size_t v = 0; v < t.samples.size(); ++v)
      if (t.candidateOf(v) == c) cand.ms.push_back(t.samples[v]);
    cand.median_ms = comm::tune::median(cand.ms);
    if (cand.median_ms < t.report.candidates[best].median_ms) best = c;
  }
  applyBucketSizes(t.sizesOf(best));
  t.report.state = TuneKind::tuned;
  if (pg->rank() != 0) return;
  double configured_ms = 0;
  for (const auto& c : t.report.candidates)
    if (c.configured) configured_ms = c.median_ms;
  const auto& b = t.report.candidates[best];
  const std::string cached = comm::tune::storeChoice(
      t.report.cache_path, t.report.key,
      {std::to_string(b.bucket_bytes), std::to_string(b.first_bucket_bytes), fmt::format("{:.3f}", b.median_ms),
       std::to_string(std::time(nullptr))});
  const std::string against = b.configured
      ? std::string("the configured sizes")
      : fmt::format("the configured {}: {:.1f} ms", tuneMib(t.configured.bucket_bytes), configured_ms);
  std::fprintf(stderr,
               "[rank 0] DDP: tuned bucket sizes: %s (first %s, %zu buckets), median backward + exposed allreduce "
               "%.1f ms; %s (%zu layouts x %d timed passes); %s\n",
               tuneMib(b.bucket_bytes).c_str(), tuneMib(b.first_bucket_bytes).c_str(), b.buckets, b.median_ms,
               against.c_str(), n, opts.tune_rounds, cached.c_str());
}

void DistributedDataParallel::Impl::stopTuning(const std::string& why) {
  applyBucketSizes(tune.configured);
  tune.report.state = TuneKind::off;
  tune.report.why_off = why + " while tuning: back to the configured bucket sizes";
}

}  // namespace dtrain
