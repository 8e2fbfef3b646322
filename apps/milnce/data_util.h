// Helpers shared by the MIL-NCE data files (csv.cc, npy.cc, generate.cc, dataset.cc, loader.cc):
// errors naming the file, whole-file reads and writes, and the data's own random numbers.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace milnce::detail {

// ---- errors ----

[[noreturn]] void fail(const std::string& path, const std::string& msg);
[[noreturn]] void failAt(const std::string& path, int64_t line, const std::string& msg);

// ---- random numbers: our own, so the data is the same with any standard library and any torch state ----

// An independent stream per (seed, what, index): video i does not depend on how many videos come before.
enum Stream : uint64_t {
  kVocabStream = 1, kPrototypeStream = 2, kWordVectorStream = 3, kTrainVideo = 4, kEvalVideo = 5,
  kTrainFrames = 6, kEvalFrames = 7,  // gen-video's pictures, apart from the segments and captions
  kTrainClip = 8                      // a training clip's draws in an epoch (loader.cc: clipRng)
};
std::mt19937_64 streamRng(uint64_t seed, Stream what, uint64_t index = 0);

// Uniform in [0, 1) with 53 random bits.
double uniform01(std::mt19937_64& rng);

// Uniform integer in [lo, hi] (inclusive), unbiased by rejection.
int64_t uniformInt(std::mt19937_64& rng, int64_t lo, int64_t hi);

// Standard normal (Box-Muller, one value per call).
double normal(std::mt19937_64& rng);

template <typename T>
void shuffle(std::vector<T>& v, std::mt19937_64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(uniformInt(rng, 0, i - 1))]);
}

// ---- small file helpers ----

std::string readFile(const std::string& path);
void writeFile(const std::string& path, const std::string& bytes);

std::string typeStr(at::ScalarType t);

// ---- gen-video's pictures (render.cc) ----

// Concept c's colour and shape names (its caption words in a video data set): the pairs are distinct
// for c < kMaxVideoConcepts.
inline constexpr int kMaxVideoConcepts = 32;
std::pair<std::string, std::string> videoConcept(int c);
// Writes an mp4 of `size` x `size` at `fps` lasting bounds.back() seconds: in segment s (bounds[s] ..
// bounds[s+1]) concept concepts[s]'s shape in its colour moves across a dark, slightly noisy background,
// bouncing off a margin that keeps it whole in any (size - 8)-pixel crop. VideoError on failure.
void renderVideo(const std::string& path, const std::vector<double>& bounds, const std::vector<int>& concepts,
                 int size, int fps, std::mt19937_64& rng);

}  // namespace milnce::detail
