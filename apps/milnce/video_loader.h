// Raw video batches decoded ahead of training: loader threads fill a bounded queue of batches in order
// while the training thread computes, so decoding runs beside training (the reference's DataLoader
// workers, in threads). A video that cannot be decoded (missing, corrupt, truncated) is skipped: the
// sample is drawn again from another video, and the failure is counted and named.
//
// \code
//   milnce::VideoLoader loader(data, lo, {/*threads=*/2, /*prefetch=*/4});
//   loader.start(batches, seed);          // this epoch's micro-batches (training video indices), in order
//   for (...) {
//     double waited = 0;
//     milnce::Batch b = loader.next(&waited);   // [B, 3, frames, size, size] uint8, [B, K, W] int64
//   }
//   auto s = loader.takeStats();          // skipped clips and decode time since the last call
// \endcode
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "milnce/data.h"

namespace milnce {

struct VideoLoaderOptions {
  int threads = 2;   // loader threads (each decodes with one thread)
  int prefetch = 4;  // batches decoded ahead of the one training asks for
  // next() waits at most this long for a batch (each clip's decode has its own 30 s deadline).
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  int max_retries = 8;  // other videos tried for a sample whose video fails, before the batch fails
};

struct VideoLoaderStats {
  int64_t clips = 0;                // clips decoded
  int64_t failures = 0;             // clips skipped because their video failed
  std::vector<std::string> failed;  // the first distinct failures: "file: what"
  double decode_seconds = 0;        // loader threads' time spent producing batches
  double wait_seconds = 0;          // training thread's time spent waiting in next()
  int64_t batches = 0;              // batches handed out
};

class VideoLoader {
 public:
  // `data` must be a raw video data set and outlive the loader. InvalidArgument on bad options.
  VideoLoader(const Dataset& data, const LoaderOptions& lo, const VideoLoaderOptions& vo = {});
  ~VideoLoader();  // stops the threads (a batch being decoded finishes first: at most one clip's deadline)
  VideoLoader(const VideoLoader&) = delete;
  VideoLoader& operator=(const VideoLoader&) = delete;

  // Starts an epoch: `batches` (lists of indices into data.videos) are decoded in order; video v's sample
  // draws from clipRng(seed, v) (data.h), so a batch depends neither on the threads nor on where the epoch
  // started, and equals makeBatch(data, rows, lo, seed).
  // Batches of an unfinished earlier epoch are dropped.
  void start(std::vector<std::vector<int64_t>> batches, uint64_t seed);
  // The next batch, in order. `waited` gets the seconds spent waiting for it. TimeoutError after
  // options' timeout; the loader's error (e.g. every retry failed) rethrown; InvalidArgument past the end.
  Batch next(double* waited = nullptr);
  // Counts since the last call (or construction), then reset.
  VideoLoaderStats takeStats();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace milnce
