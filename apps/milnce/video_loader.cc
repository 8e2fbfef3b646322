// Raw video batches on loader threads (video_loader.h).
#include "milnce/video_loader.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/trace.h"
#include "milnce/data_util.h"
#include "milnce/video.h"

namespace milnce {

namespace {
constexpr size_t kMaxNamedFailures = 20;
using Clock = std::chrono::steady_clock;
}  // namespace

struct VideoLoader::Impl {
  const Dataset& data;
  LoaderOptions lo;
  VideoLoaderOptions vo;
  std::mutex mu;
  std::condition_variable work_cv, ready_cv;
  bool stop = false;
  uint64_t generation = 0;  // start() count: results of an older epoch are dropped
  std::vector<std::vector<int64_t>> batches;
  uint64_t seed = 0;
  size_t claimed = 0, returned = 0;
  std::map<size_t, Batch> ready;
  std::exception_ptr error;
  VideoLoaderStats stats;
  std::set<std::string> failed_files;
  std::vector<std::thread> threads;

  Impl(const Dataset& d, const LoaderOptions& l, const VideoLoaderOptions& v) : data(d), lo(l), vo(v) {}

  // Batch n of `rows`, with its own statistics (merged by the caller).
  Batch decode(const std::vector<int64_t>& rows, uint64_t s, size_t n, VideoLoaderStats& local,
               std::vector<std::pair<std::string, std::string>>& failures) {
    const auto B = static_cast<int64_t>(rows.size());
    Batch b;
    b.video = at::empty({B, 3, lo.frames, lo.size, lo.size}, at::kByte);
    b.text = at::empty({B, lo.num_candidates, lo.max_words}, at::kLong);
    const int64_t clip_bytes = b.video[0].numel(), text_len = b.text[0].numel();
    for (int64_t i = 0; i < B; ++i) {
      int64_t video = rows[static_cast<size_t>(i)];
      std::mt19937_64 rng = clipRng(s, video);
      for (int attempt = 0;; ++attempt) {
        try {
          const Sample smp = sample(data, static_cast<size_t>(video), lo, rng);
          std::memcpy(b.video.data_ptr<uint8_t>() + i * clip_bytes, smp.video.data_ptr<uint8_t>(),
                      static_cast<size_t>(clip_bytes));
          std::memcpy(b.text.data_ptr<int64_t>() + i * text_len, smp.text.data_ptr<int64_t>(),
                      static_cast<size_t>(text_len) * sizeof(int64_t));
          ++local.clips;
          break;
        } catch (const VideoError& e) {
          ++local.failures;
          failures.emplace_back(data.videos[static_cast<size_t>(video)].file, e.what());
          if (attempt >= vo.max_retries)
            throw VideoError(fmt::format("milnce loader: batch {} sample {}: {} videos in a row failed to decode, the "
                                         "last: {}",
                                         n, i, attempt + 1, e.what()));
          video = detail::uniformInt(rng, 0, static_cast<int64_t>(data.videos.size()) - 1);  // another video
        }
      }
    }
    return b;
  }

  void work() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      work_cv.wait(lk, [&] {
        return stop || (!error && claimed < batches.size() && claimed < returned + static_cast<size_t>(vo.prefetch));
      });
      if (stop) return;
      const size_t n = claimed++;
      const uint64_t gen = generation, s = seed;
      const std::vector<int64_t> rows = batches[n];
      lk.unlock();
      VideoLoaderStats local;
      std::vector<std::pair<std::string, std::string>> failures;
      Batch b;
      std::exception_ptr err;
      const auto t0 = Clock::now();
      try {
        DTRAIN_SPAN("data.decode", "data");
        b = decode(rows, s, n, local, failures);
      } catch (...) {
        err = std::current_exception();
      }
      const double took = std::chrono::duration<double>(Clock::now() - t0).count();
      lk.lock();
      if (gen != generation) continue;  // a later start() dropped this epoch
      stats.clips += local.clips;
      stats.failures += local.failures;
      stats.decode_seconds += took;
      for (auto& [file, what] : failures)
        if (failed_files.insert(file).second && stats.failed.size() < kMaxNamedFailures) stats.failed.push_back(what);
      if (err) {
        if (!error) error = err;
      } else {
        ready.emplace(n, std::move(b));
      }
      ready_cv.notify_all();
    }
  }
};

VideoLoader::VideoLoader(const Dataset& data, const LoaderOptions& lo, const VideoLoaderOptions& vo)
    : impl_(std::make_unique<Impl>(data, lo, vo)) {
  DTRAIN_CHECK(data.raw_video, dtrain::InvalidArgument, "milnce: VideoLoader needs a raw video data set ({} is not one)",
               data.dir);
  DTRAIN_CHECK(vo.threads >= 1 && vo.prefetch >= 1 && vo.max_retries >= 0, dtrain::InvalidArgument,
               "milnce: VideoLoader: need threads >= 1, prefetch >= 1, max_retries >= 0 (got {}, {}, {})", vo.threads,
               vo.prefetch, vo.max_retries);
  for (int t = 0; t < vo.threads; ++t) impl_->threads.emplace_back([this] { impl_->work(); });
}

VideoLoader::~VideoLoader() {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->stop = true;
  }
  impl_->work_cv.notify_all();
  for (auto& t : impl_->threads) t.join();
}

void VideoLoader::start(std::vector<std::vector<int64_t>> batches, uint64_t seed) {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    ++impl_->generation;
    impl_->batches = std::move(batches);
    impl_->seed = seed;
    impl_->claimed = impl_->returned = 0;
    impl_->ready.clear();
    impl_->error = nullptr;
  }
  impl_->work_cv.notify_all();
}

Batch VideoLoader::next(double* waited) {
  auto& d = *impl_;
  const auto t0 = Clock::now();
  std::unique_lock<std::mutex> lk(d.mu);
  DTRAIN_CHECK(d.returned < d.batches.size(), dtrain::InvalidArgument,
               "milnce: VideoLoader::next: all {} batches of the epoch were handed out", d.batches.size());
  const size_t n = d.returned;
  const bool got = d.ready_cv.wait_for(lk, d.vo.timeout, [&] { return d.error || d.ready.count(n) > 0; });
  if (d.ready.count(n) == 0) {
    if (d.error) std::rethrow_exception(d.error);
    if (!got)
      throw dtrain::TimeoutError(fmt::format("milnce loader: batch {} of {} not decoded within {} ms ({} loader threads)",
                                             n, d.batches.size(), d.vo.timeout.count(), d.vo.threads));
  }
  Batch b = std::move(d.ready.at(n));
  d.ready.erase(n);
  ++d.returned;
  const double w = std::chrono::duration<double>(Clock::now() - t0).count();
  d.stats.wait_seconds += w;
  ++d.stats.batches;
  lk.unlock();
  d.work_cv.notify_all();
  if (waited) *waited = w;
  return b;
}

VideoLoaderStats VideoLoader::takeStats() {
  std::lock_guard<std::mutex> g(impl_->mu);
  VideoLoaderStats s = std::move(impl_->stats);
  impl_->stats = VideoLoaderStats{};
  return s;
}

}  // namespace milnce
