// MIL-NCE data: the HowTo100M-style sampling of clips and candidate captions for training, and the
// evaluation windows (data.h).
#include "milnce/data.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "dtrain/comm/error.h"
#include "milnce/data_util.h"
#include "milnce/video.h"

namespace milnce {
using namespace detail;  // NOLINT(google-build-using-namespace): the data files' shared helpers
using dtrain::InvalidArgument;

namespace {

// ---- sampling ----

void checkLoader(const LoaderOptions& o) {
  if (o.num_candidates < 1 || o.max_words < 1 || o.clip_steps < 1 || !(o.min_time >= 0))
    throw InvalidArgument(fmt::format(
        "milnce: loader options: need num_candidates >= 1, max_words >= 1, clip_steps >= 1, min_time >= 0 "
        "(got {}, {}, {}, {})",
        o.num_candidates, o.max_words, o.clip_steps, o.min_time));
  if (o.frames < 1 || !(o.fps > 0) || o.size < 1)
    throw InvalidArgument(fmt::format("milnce: loader options: need frames >= 1, fps > 0, size >= 1 (got {}, {}, {})",
                                      o.frames, o.fps, o.size));
}

// The shape of one clip: [clip_steps, F] of features, or [3, frames, size, size] of raw video.
std::vector<int64_t> clipShape(const Dataset& ds, const LoaderOptions& o) {
  if (ds.raw_video) return {3, o.frames, o.size, o.size};
  return {o.clip_steps, ds.feature_dim};
}

int64_t clipElements(const Dataset& ds, const LoaderOptions& o) {
  int64_t n = 1;
  for (int64_t d : clipShape(ds, o)) n *= d;
  return n;
}

std::vector<int64_t> withLeading(std::vector<int64_t> shape, int64_t n) {
  shape.insert(shape.begin(), n);
  return shape;
}

// Widens [start, end] to min_time as the reference does.
void widen(double& start, double& end, double min_time) {
  if (end - start < min_time) {
    const double diff = min_time - end + start;
    start = std::max(0.0, start - diff / 2);
    end = start + min_time;
  }
}

// The first row of a clip that starts at `seek` seconds, kept inside the video.
int64_t firstRow(double seek, double rate, int64_t rows, int clip_steps) {
  const double r = std::nearbyint(seek * rate);  // Python's round(): half to even
  const int64_t last_start = std::max<int64_t>(0, rows - clip_steps);
  if (!(r > 0)) return 0;
  return r >= static_cast<double>(last_start) ? last_start : static_cast<int64_t>(r);
}

// Copies clip_steps rows from `first` on into dst, repeating the last row past the end of the video.
void copyRows(const at::Tensor& features, int64_t first, int clip_steps, float* dst) {
  const int64_t rows = features.size(0), F = features.size(1);
  const float* src = features.data_ptr<float>();
  for (int i = 0; i < clip_steps; ++i) {
    const int64_t t = std::min(first + i, rows - 1);
    std::memcpy(dst + i * F, src + t * F, static_cast<size_t>(F) * sizeof(float));
  }
}

void fillTokens(const std::string& text, const std::unordered_map<std::string, int64_t>& vocab, int max_words,
                int64_t* dst) {
  const auto ids = tokenize(text, vocab, max_words);
  std::copy(ids.begin(), ids.end(), dst);
}

// Steps 1-3 of sample(): the caption, its candidates' tokens (into `text`), the span and the seek.
SampleTrace choose(const Dataset& ds, const Video& v, const LoaderOptions& o, double clip_sec, std::mt19937_64& rng,
                   int64_t* text) {
  const auto& caps = v.captions;
  const int64_t n = static_cast<int64_t>(caps.size());
  const int K = o.num_candidates;

  // _get_text: a random caption and its K nearest neighbours in time.
  const int64_t ind = uniformInt(rng, 0, n - 1);
  int64_t cap_start = ind;
  if (K > 1) {
    cap_start = findNearestCandidates(caps, ind, K);
    for (int i = 0; i < K; ++i) {
      const int64_t c = std::clamp<int64_t>(cap_start + i, 0, n - 1);
      fillTokens(caps[static_cast<size_t>(c)].text, ds.vocab, o.max_words, text + i * o.max_words);
    }
  } else {
    fillTokens(caps[static_cast<size_t>(ind)].text, ds.vocab, o.max_words, text);
  }
  double start = caps[static_cast<size_t>(ind)].start, end = caps[static_cast<size_t>(ind)].end;
  widen(start, end, o.min_time);

  // _get_video: a random seek inside the span.
  double seek;
  if (o.whole_seconds) {
    start = std::trunc(start);
    end = std::trunc(end);
    const double hi = std::trunc(std::max(start, end - clip_sec));
    seek = static_cast<double>(uniformInt(rng, static_cast<int64_t>(start), static_cast<int64_t>(hi)));
  } else {
    seek = start + (std::max(start, end - clip_sec) - start) * uniform01(rng);
  }
  return SampleTrace{ind, K > 1 ? cap_start : ind, start, end, seek, 0};
}

const Video& videoAt(const Dataset& ds, size_t video_index) {
  if (video_index >= ds.videos.size())
    throw InvalidArgument(
        fmt::format("milnce: sample: video index {} out of range ({} videos)", video_index, ds.videos.size()));
  return ds.videos[video_index];
}

void sampleInto(const Dataset& ds, size_t video_index, const LoaderOptions& o, std::mt19937_64& rng, float* video,
                int64_t* text, SampleTrace* trace) {
  const Video& v = videoAt(ds, video_index);
  SampleTrace t = choose(ds, v, o, o.clip_steps / ds.rate, rng, text);
  t.first_row = firstRow(t.seek, ds.rate, v.features.size(0), o.clip_steps);
  copyRows(v.features, t.first_row, o.clip_steps, video);
  if (trace) *trace = t;
}

ClipSpec clipSpec(const LoaderOptions& o, double start) {
  ClipSpec c;
  c.start = start;
  c.frames = o.frames;
  c.fps = o.fps;
  c.size = o.size;
  c.crop_only = o.crop_only;
  return c;
}

void readClipInto(const std::string& file, const ClipSpec& c, uint8_t* dst) {
  VideoReader reader(file);
  const auto clip = reader.readClip(c);
  std::memcpy(dst, clip.data(), clip.size());
}

// A raw video sample: the span as for features, then the crop place and flip, then the decode.
void sampleVideoInto(const Dataset& ds, size_t video_index, const LoaderOptions& o, std::mt19937_64& rng,
                     uint8_t* video, int64_t* text, SampleTrace* trace) {
  const Video& v = videoAt(ds, video_index);
  const SampleTrace t = choose(ds, v, o, o.frames / o.fps, rng, text);
  ClipSpec c = clipSpec(o, t.seek);
  c.x = uniform01(rng);
  c.y = uniform01(rng);
  c.flip = o.flip && uniform01(rng) > 0.5;
  readClipInto(v.file, c, video);
  if (trace) *trace = t;
}

}  // namespace

// ---- training samples ----

int64_t findNearestCandidates(const std::vector<Caption>& caps, int64_t ind, int num_candidates) {
  const int64_t len = static_cast<int64_t>(caps.size());
  if (ind < 0 || ind >= len)
    throw InvalidArgument(fmt::format("milnce: findNearestCandidates: index {} out of range ({} captions)", ind, len));
  int64_t start = ind, end = ind;
  for (int n = 1; n < num_candidates; ++n) {
    if (start == 0) return 0;
    if (end == len - 1) return start - (num_candidates - n);
    const auto& c = [&](int64_t i) -> const Caption& { return caps[static_cast<size_t>(i)]; };
    if (c(end).end - c(start - 1).start < c(end + 1).end - c(start).start)
      --start;
    else
      ++end;
  }
  return start;
}

Sample sample(const Dataset& ds, size_t video_index, const LoaderOptions& opts, std::mt19937_64& rng,
              SampleTrace* trace) {
  checkLoader(opts);
  Sample s;
  s.video = at::empty(clipShape(ds, opts), ds.raw_video ? at::kByte : at::kFloat);
  s.text = at::empty({opts.num_candidates, opts.max_words}, at::kLong);
  if (ds.raw_video)
    sampleVideoInto(ds, video_index, opts, rng, s.video.data_ptr<uint8_t>(), s.text.data_ptr<int64_t>(), trace);
  else
    sampleInto(ds, video_index, opts, rng, s.video.data_ptr<float>(), s.text.data_ptr<int64_t>(), trace);
  return s;
}

namespace {
// makeBatch's loop, sample i drawn from rngFor(i).
template <typename RngFor>
Batch makeBatchWith(const Dataset& ds, const std::vector<int64_t>& video_indices, const LoaderOptions& opts,
                    RngFor&& rngFor) {
  checkLoader(opts);
  const int64_t B = static_cast<int64_t>(video_indices.size()), n = clipElements(ds, opts);
  Batch b;
  b.video = at::empty(withLeading(clipShape(ds, opts), B), ds.raw_video ? at::kByte : at::kFloat);
  b.text = at::empty({B, opts.num_candidates, opts.max_words}, at::kLong);
  int64_t* tp = b.text.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t idx = video_indices[static_cast<size_t>(i)];
    if (idx < 0) throw InvalidArgument(fmt::format("milnce: makeBatch: negative video index {}", idx));
    int64_t* text = tp + i * opts.num_candidates * opts.max_words;
    std::mt19937_64& rng = rngFor(idx);
    if (ds.raw_video)
      sampleVideoInto(ds, static_cast<size_t>(idx), opts, rng, b.video.data_ptr<uint8_t>() + i * n, text, nullptr);
    else
      sampleInto(ds, static_cast<size_t>(idx), opts, rng, b.video.data_ptr<float>() + i * n, text, nullptr);
  }
  return b;
}
}  // namespace

Batch makeBatch(const Dataset& ds, const std::vector<int64_t>& video_indices, const LoaderOptions& opts,
                std::mt19937_64& rng) {
  return makeBatchWith(ds, video_indices, opts, [&](int64_t) -> std::mt19937_64& { return rng; });
}

std::mt19937_64 clipRng(uint64_t epoch_seed, int64_t video_index) {
  return streamRng(epoch_seed, kTrainClip, static_cast<uint64_t>(video_index));
}

Batch makeBatch(const Dataset& ds, const std::vector<int64_t>& video_indices, const LoaderOptions& opts,
                uint64_t epoch_seed) {
  std::mt19937_64 rng;
  return makeBatchWith(ds, video_indices, opts, [&](int64_t idx) -> std::mt19937_64& {
    rng = clipRng(epoch_seed, idx);
    return rng;
  });
}

// ---- evaluation ----

namespace {
// The window starts of an eval clip: np.linspace(start, stop, windows) over its widened span, where a
// window lasts clip_sec (the last point is exactly stop).
std::vector<double> windowStarts(const EvalClip& clip, int windows, double min_time, double clip_sec) {
  double start = clip.start, end = clip.end;
  widen(start, end, min_time);
  const double stop = std::max(start, end - clip_sec);
  std::vector<double> out;
  for (int w = 0; w < windows; ++w)
    out.push_back(windows == 1 ? start : (w == windows - 1 ? stop : start + (stop - start) / (windows - 1) * w));
  return out;
}

const Video& evalVideoOf(const Dataset& ds, const EvalClip& clip) {
  if (clip.video_index < 0 || static_cast<size_t>(clip.video_index) >= ds.eval_videos.size())
    throw InvalidArgument(fmt::format("milnce: eval clip of '{}': video_index {} out of range ({} eval videos)",
                                      clip.video_id, clip.video_index, ds.eval_videos.size()));
  return ds.eval_videos[static_cast<size_t>(clip.video_index)];
}

void evalWindowsInto(const Dataset& ds, const EvalClip& clip, int windows, const LoaderOptions& o, float* dst) {
  const at::Tensor& feats = evalVideoOf(ds, clip).features;
  const int64_t F = ds.feature_dim;
  int w = 0;
  for (double s : windowStarts(clip, windows, o.min_time, o.clip_steps / ds.rate))
    copyRows(feats, firstRow(s, ds.rate, feats.size(0), o.clip_steps), o.clip_steps, dst + (w++) * o.clip_steps * F);
}

// Raw video: centre crops, no flip; a window that does not decode stays zeros and is counted.
void evalVideoWindowsInto(const Dataset& ds, const EvalClip& clip, int windows, const LoaderOptions& o, uint8_t* dst,
                          int64_t* failures) {
  const Video& v = evalVideoOf(ds, clip);
  const size_t n = static_cast<size_t>(3) * o.frames * o.size * o.size;
  std::unique_ptr<VideoReader> reader;
  size_t w = 0;
  for (double s : windowStarts(clip, windows, o.min_time, o.frames / o.fps)) {
    try {
      if (!reader) reader = std::make_unique<VideoReader>(v.file);
      const auto got = reader->readClip(clipSpec(o, s));
      std::memcpy(dst + w * n, got.data(), n);
    } catch (const VideoError&) {
      std::memset(dst + w * n, 0, n);
      if (failures) ++*failures;
    }
    ++w;
  }
}
void checkWindows(int windows) {
  if (windows < 1) throw InvalidArgument(fmt::format("milnce: eval: windows must be >= 1 (got {})", windows));
}
}  // namespace

at::Tensor evalClipWindows(const Dataset& ds, const EvalClip& clip, int windows, const LoaderOptions& opts,
                           int64_t* failures) {
  checkLoader(opts);
  checkWindows(windows);
  at::Tensor out = at::empty(withLeading(clipShape(ds, opts), windows), ds.raw_video ? at::kByte : at::kFloat);
  if (ds.raw_video)
    evalVideoWindowsInto(ds, clip, windows, opts, out.data_ptr<uint8_t>(), failures);
  else
    evalWindowsInto(ds, clip, windows, opts, out.data_ptr<float>());
  return out;
}

at::Tensor evalVideoWindows(const Dataset& ds, int windows, const LoaderOptions& opts) {
  checkLoader(opts);
  checkWindows(windows);
  DTRAIN_CHECK(!ds.raw_video, InvalidArgument, "milnce: evalVideoWindows: a raw video data set is read clip by clip "
               "(evalClipWindows)");
  const int64_t N = static_cast<int64_t>(ds.eval_clips.size());
  at::Tensor out = at::empty({N, windows, opts.clip_steps, ds.feature_dim}, at::kFloat);
  float* p = out.data_ptr<float>();
  for (int64_t i = 0; i < N; ++i)
    evalWindowsInto(ds, ds.eval_clips[static_cast<size_t>(i)], windows, opts,
                    p + i * windows * opts.clip_steps * ds.feature_dim);
  return out;
}

at::Tensor evalText(const Dataset& ds, const EvalClip& clip, int max_words) {
  const auto ids = tokenize(clip.sentence, ds.vocab, max_words);
  at::Tensor out = at::empty({max_words}, at::kLong);
  std::copy(ids.begin(), ids.end(), out.data_ptr<int64_t>());
  return out;
}

at::Tensor evalTexts(const Dataset& ds, int max_words) {
  if (max_words < 1) throw InvalidArgument(fmt::format("milnce: evalTexts: max_words must be >= 1 (got {})", max_words));
  const int64_t N = static_cast<int64_t>(ds.eval_clips.size());
  at::Tensor out = at::empty({N, max_words}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    fillTokens(ds.eval_clips[static_cast<size_t>(i)].sentence, ds.vocab, max_words, p + i * max_words);
  return out;
}

}  // namespace milnce
