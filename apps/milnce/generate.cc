// MIL-NCE data: the generator of HowTo100M-like data with planted concepts (data.h).
#include "milnce/data.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "dtrain/comm/error.h"
#include "milnce/data_util.h"

namespace milnce {
namespace fs = std::filesystem;
using namespace detail;  // NOLINT(google-build-using-namespace): the data files' shared helpers
using dtrain::InvalidArgument;

namespace {

std::string fmtTime(double sec) { return fmt::format("{:.2f}", sec); }

// ---- generation ----

constexpr const char* kFillers[] = {"the",   "and",    "a",     "to",   "then",  "now",    "we",    "you",
                                    "it",    "this",   "that",  "so",   "just",  "of",     "in",    "on",
                                    "with",  "is",     "going", "gonna", "okay", "right",  "here",  "there",
                                    "little", "bit",   "really", "let's", "it's", "don't", "we're", "you're",
                                    "i'm",   "that's", "all",   "some", "get",   "put",    "go",    "well"};

// A pronounceable word of 2-3 consonant-vowel syllables ("badoki"); lower-case, matches [\w']+.
std::string makeWord(std::mt19937_64& rng) {
  static const char kConsonants[] = "bdfghklmnprstvz";
  static const char kVowels[] = "aeiou";
  const int syllables = static_cast<int>(uniformInt(rng, 2, 3));
  std::string w;
  for (int s = 0; s < syllables; ++s) {
    w += kConsonants[uniformInt(rng, 0, sizeof(kConsonants) - 2)];
    w += kVowels[uniformInt(rng, 0, sizeof(kVowels) - 2)];
  }
  return w;
}

struct World {
  std::vector<std::vector<std::string>> concept_words;  // [C][words_per_concept]
  std::vector<std::string> fillers;
  std::vector<float> prototypes;  // [C * F]
};

World makeWorld(const GenOptions& o) {
  World w;
  auto rng = streamRng(o.seed, kVocabStream);
  std::unordered_set<std::string> used;
  const size_t fixed = std::min<size_t>(static_cast<size_t>(o.filler_words), std::size(kFillers));
  for (size_t i = 0; i < fixed; ++i) {
    w.fillers.emplace_back(kFillers[i]);
    used.insert(kFillers[i]);
  }
  auto fresh = [&] {
    for (int attempt = 0; attempt < 100000; ++attempt) {
      std::string word = makeWord(rng);
      if (used.insert(word).second) return word;
    }
    throw InvalidArgument("milnce: generateData: cannot make enough distinct words (too many concepts?)");
  };
  w.concept_words.resize(static_cast<size_t>(o.concepts));
  for (auto& words : w.concept_words)
    for (int i = 0; i < o.words_per_concept; ++i) words.push_back(fresh());
  while (w.fillers.size() < static_cast<size_t>(o.filler_words)) w.fillers.push_back(fresh());

  auto prng = streamRng(o.seed, kPrototypeStream);
  w.prototypes.resize(static_cast<size_t>(o.concepts) * o.feature_dim);
  for (auto& x : w.prototypes) x = static_cast<float>(normal(prng));
  return w;
}

struct GenVideo {
  std::vector<float> features;  // [T * F]
  int64_t rows = 0;
  std::vector<Caption> captions;
  std::vector<double> bounds;   // the segments: [bounds[s], bounds[s+1]) seconds
  std::vector<int> concept_of;  // each segment's concept
};

GenVideo makeVideo(const GenOptions& o, const World& w, std::mt19937_64& rng, double misalign) {
  GenVideo v;
  const int nseg = static_cast<int>(uniformInt(rng, o.min_segments, o.max_segments));
  std::vector<double> bounds{0.0};  // nseg + 1 segment boundaries
  std::vector<int> concept_of;
  for (int s = 0; s < nseg; ++s) {
    bounds.push_back(bounds.back() + o.min_seg_sec + (o.max_seg_sec - o.min_seg_sec) * uniform01(rng));
    const bool next_step = uniform01(rng) < o.procedure;
    const int random_concept = static_cast<int>(uniformInt(rng, 0, o.concepts - 1));
    concept_of.push_back(s > 0 && next_step ? (concept_of.back() + 1) % o.concepts : random_concept);
  }
  const double total = bounds.back();
  v.bounds = bounds;
  v.concept_of = concept_of;

  // Row t (time t/rate) belongs to the segment containing that time.
  const int64_t F = o.feature_dim;
  v.rows = std::max<int64_t>(1, std::llround(total * o.rate));
  v.features.resize(static_cast<size_t>(v.rows * F));
  size_t seg = 0;
  for (int64_t t = 0; t < v.rows; ++t) {
    const double time = static_cast<double>(t) / o.rate;
    while (seg + 1 < concept_of.size() && time >= bounds[seg + 1]) ++seg;
    const float* proto = &w.prototypes[static_cast<size_t>(concept_of[seg] * F)];
    float* row = &v.features[static_cast<size_t>(t * F)];
    for (int64_t f = 0; f < F; ++f) row[f] = proto[f] + static_cast<float>(o.noise * normal(rng));
  }

  // One caption per segment. The same random numbers are drawn whatever `misalign` is, so datasets that
  // differ only in misalign differ only in which concept some captions describe.
  for (int s = 0; s < nseg; ++s) {
    const bool shift = uniform01(rng) < misalign;
    std::vector<int> neighbours, other;
    for (int n : {s - 1, s + 1}) {
      if (n < 0 || n >= nseg) continue;
      neighbours.push_back(n);
      if (concept_of[n] != concept_of[s]) other.push_back(n);
    }
    const auto& pool = other.empty() ? neighbours : other;
    // Lead (next segment) or lag (previous), when both are possible.
    const bool to_next = uniform01(rng) < o.lead;
    int pick = pool.empty() ? -1 : pool[0];
    if (pool.size() == 2) pick = to_next ? pool[1] : pool[0];
    const int described = (shift && pick >= 0) ? concept_of[pick] : concept_of[s];

    Caption c;
    c.start = std::clamp(bounds[s] + uniform01(rng) - 0.5, 0.0, total);
    c.end = std::clamp(bounds[s + 1] + uniform01(rng) - 0.5, 0.0, total);
    c.start = std::round(c.start * 100) / 100;  // what the file holds
    c.end = std::max(c.start, std::round(c.end * 100) / 100);

    const auto& own = w.concept_words[static_cast<size_t>(described)];
    const int n_concept = static_cast<int>(uniformInt(rng, 2, 3));
    const int n_filler = static_cast<int>(uniformInt(rng, 2, 4));
    std::vector<std::string> words;
    std::vector<size_t> order(own.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    shuffle(order, rng);
    for (int i = 0; i < n_concept; ++i)  // distinct words while the concept has enough
      words.push_back(own[order.size() >= static_cast<size_t>(n_concept) ? order[static_cast<size_t>(i)]
                                                                          : order[static_cast<size_t>(i) % order.size()]]);
    for (int i = 0; i < n_filler && !w.fillers.empty(); ++i)
      words.push_back(w.fillers[static_cast<size_t>(uniformInt(rng, 0, w.fillers.size() - 1))]);
    shuffle(words, rng);
    std::string text;
    for (const auto& word : words) text += (text.empty() ? "" : " ") + word;
    c.text = std::move(text);
    v.captions.push_back(std::move(c));
  }
  return v;
}

void validate(const GenOptions& o) {
  auto check = [](bool ok, const std::string& what) {
    if (!ok) throw InvalidArgument("milnce: generateData: " + what);
  };
  check(!o.out.empty(), "out is empty");
  check(o.videos >= 1, fmt::format("videos must be >= 1 (got {})", o.videos));
  check(o.eval_videos >= 0, fmt::format("eval_videos must be >= 0 (got {})", o.eval_videos));
  check(o.concepts >= 1, fmt::format("concepts must be >= 1 (got {})", o.concepts));
  check(std::isfinite(o.noise) && o.noise >= 0, fmt::format("noise must be >= 0 (got {})", o.noise));
  check(o.misalign >= 0 && o.misalign <= 1, fmt::format("misalign must be in [0, 1] (got {})", o.misalign));
  check(o.procedure >= 0 && o.procedure <= 1, fmt::format("procedure must be in [0, 1] (got {})", o.procedure));
  check(o.lead >= 0 && o.lead <= 1, fmt::format("lead must be in [0, 1] (got {})", o.lead));
  check(o.feature_dim >= 1, fmt::format("feature_dim must be >= 1 (got {})", o.feature_dim));
  check(o.word_dim >= 1, fmt::format("word_dim must be >= 1 (got {})", o.word_dim));
  check(std::isfinite(o.rate) && o.rate > 0, fmt::format("rate must be > 0 (got {})", o.rate));
  check(o.words_per_concept >= 1, fmt::format("words_per_concept must be >= 1 (got {})", o.words_per_concept));
  check(o.filler_words >= 0, fmt::format("filler_words must be >= 0 (got {})", o.filler_words));
  check(o.min_segments >= 1 && o.min_segments <= o.max_segments,
        fmt::format("need 1 <= min_segments <= max_segments (got {}, {})", o.min_segments, o.max_segments));
  check(o.min_seg_sec > 0 && o.min_seg_sec <= o.max_seg_sec && std::isfinite(o.max_seg_sec),
        fmt::format("need 0 < min_seg_sec <= max_seg_sec (got {}, {})", o.min_seg_sec, o.max_seg_sec));
  if (o.video) {
    check(o.concepts <= kMaxVideoConcepts,
          fmt::format("a video data set has at most {} concepts (colour and shape pairs; got {})", kMaxVideoConcepts,
                      o.concepts));
    check(o.video_size >= 16 && o.video_size <= 1024 && o.video_size % 2 == 0,
          fmt::format("video_size must be even, in [16, 1024] (got {})", o.video_size));
    check(o.fps >= 1 && o.fps <= 120, fmt::format("fps must be in [1, 120] (got {})", o.fps));
  }
}

// vocab.txt and word2vec.npy: concept words (concept by concept), then fillers, each word once; returns
// the vocabulary's size.
int64_t writeVocabulary(const GenOptions& o, const World& w, const fs::path& dir) {
  std::string vocab;
  int64_t V = 0;
  std::set<std::string> listed;  // a video data set's colours and shapes recur across concepts
  for (const auto& words : w.concept_words)
    for (const auto& word : words)
      if (listed.insert(word).second) vocab += word + "\n", ++V;
  for (const auto& word : w.fillers)
    if (listed.insert(word).second) vocab += word + "\n", ++V;
  writeFile((dir / "vocab.txt").string(), vocab);
  auto rng = streamRng(o.seed, kWordVectorStream);
  at::Tensor wv = at::zeros({V + 1, o.word_dim}, at::kFloat);
  float* p = wv.data_ptr<float>();
  for (int64_t i = 1; i <= V; ++i) {
    float* row = p + i * o.word_dim;
    double norm = 0;
    for (int e = 0; e < o.word_dim; ++e) {
      row[e] = static_cast<float>(normal(rng));
      norm += static_cast<double>(row[e]) * row[e];
    }
    norm = std::sqrt(norm);
    for (int e = 0; e < o.word_dim; ++e) row[e] = static_cast<float>(row[e] / (norm > 0 ? norm : 1.0));
  }
  writeNpy((dir / "word2vec.npy").string(), wv);
  return V;
}

}  // namespace

// ---- generation ----

void generateData(const GenOptions& o) {
  validate(o);
  const fs::path dir = o.out;
  std::error_code ec;
  for (const fs::path& d : {dir, dir / (o.video ? "videos" : "features"), dir / "captions"}) {
    fs::create_directories(d, ec);
    if (ec) throw dtrain::IoError(fmt::format("milnce: cannot create {}: {}", d.string(), ec.message()));
  }
  World w = makeWorld(o);
  if (o.video)  // the captions name what is seen: colour and shape
    for (int c = 0; c < o.concepts; ++c) {
      auto [colour, shape] = videoConcept(c);
      w.concept_words[static_cast<size_t>(c)] = {colour, shape};
    }

  const int64_t V = writeVocabulary(o, w, dir);
  if (!o.video)
    writeNpy((dir / "prototypes.npy").string(),
             at::from_blob(const_cast<float*>(w.prototypes.data()), {o.concepts, o.feature_dim}, at::kFloat));

  // Videos: features, captions, and the lists.
  int64_t train_captions = 0, eval_clips = 0, train_rows = 0;
  std::vector<std::vector<std::string>> train_list, eval_list, eval_rows;
  // Returns the file's name relative to dir.
  auto writeVideo = [&](const std::string& id, const GenVideo& v, std::mt19937_64& frames_rng) {
    std::string file;
    if (o.video) {
      file = "videos/" + id + ".mp4";
      renderVideo((dir / file).string(), v.bounds, v.concept_of, o.video_size, o.fps, frames_rng);
    } else {
      file = "features/" + id + ".npy";
      at::Tensor f = at::from_blob(const_cast<float*>(v.features.data()), {v.rows, o.feature_dim}, at::kFloat);
      writeNpy((dir / file).string(), f);
    }
    std::vector<std::vector<std::string>> rows;
    for (const auto& c : v.captions) rows.push_back({fmtTime(c.start), fmtTime(c.end), c.text});
    writeCsv((dir / "captions" / (id + ".csv")).string(), {"start", "end", "text"}, rows);
    return file;
  };
  dtrain::ProgressOptions po;
  po.mode = o.progress;
  po.unit = "video";
  dtrain::Progress progress(o.video ? "gen-video" : "gen-data", int64_t{o.videos} + o.eval_videos, po);
  for (int i = 0; i < o.videos; ++i) {
    const std::string id = fmt::format("vid_{:05d}", i);
    auto rng = streamRng(o.seed, kTrainVideo, static_cast<uint64_t>(i));
    const GenVideo v = makeVideo(o, w, rng, o.misalign);
    auto frames_rng = streamRng(o.seed, kTrainFrames, static_cast<uint64_t>(i));
    train_list.push_back({id, writeVideo(id, v, frames_rng)});
    train_captions += static_cast<int64_t>(v.captions.size());
    train_rows += v.rows;
    progress.update(i + 1, "training videos");
  }
  for (int i = 0; i < o.eval_videos; ++i) {
    const std::string id = fmt::format("eval_{:05d}", i);
    auto rng = streamRng(o.seed, kEvalVideo, static_cast<uint64_t>(i));
    const GenVideo v = makeVideo(o, w, rng, /*misalign=*/0.0);  // clean, like human-annotated YouCook2
    auto frames_rng = streamRng(o.seed, kEvalFrames, static_cast<uint64_t>(i));
    eval_list.push_back({id, writeVideo(id, v, frames_rng)});
    for (const auto& c : v.captions) eval_rows.push_back({id, fmtTime(c.start), fmtTime(c.end), c.text});
    eval_clips += static_cast<int64_t>(v.captions.size());
    progress.update(int64_t{o.videos} + i + 1, "held-out videos");
  }
  const std::string file_column = o.video ? "video_file" : "feature_file";
  writeCsv((dir / "videos.csv").string(), {"video_id", file_column}, train_list);
  writeCsv((dir / "eval_videos.csv").string(), {"video_id", file_column}, eval_list);
  writeCsv((dir / "eval.csv").string(), {"video_id", "start", "end", "sentence"}, eval_rows);

  nlohmann::ordered_json meta;
  meta["format"] = "dtrain-milnce-data-v1";
  meta["options"] = {{"videos", o.videos},
                     {"eval_videos", o.eval_videos},
                     {"concepts", o.concepts},
                     {"procedure", o.procedure},
                     {"lead", o.lead},
                     {"noise", o.noise},
                     {"misalign", o.misalign},
                     {"seed", o.seed},
                     {"feature_dim", o.feature_dim},
                     {"word_dim", o.word_dim},
                     {"rate", o.rate},
                     {"words_per_concept", o.words_per_concept},
                     {"filler_words", o.filler_words},
                     {"min_segments", o.min_segments},
                     {"max_segments", o.max_segments},
                     {"min_seg_sec", o.min_seg_sec},
                     {"max_seg_sec", o.max_seg_sec}};
  if (o.video) {
    meta["kind"] = "video";
    meta["fps"] = o.fps;
    meta["video_size"] = o.video_size;
    meta["options"]["fps"] = o.fps;
    meta["options"]["video_size"] = o.video_size;
    nlohmann::ordered_json looks = nlohmann::ordered_json::array();
    for (int c = 0; c < o.concepts; ++c) {
      auto [colour, shape] = videoConcept(c);
      looks.push_back({{"colour", colour}, {"shape", shape}});
    }
    meta["concept_looks"] = looks;
  }
  meta["rate"] = o.rate;
  meta["feature_dim"] = o.feature_dim;
  meta["word_dim"] = o.word_dim;
  meta["counts"] = {{"videos", o.videos},           {"eval_videos", o.eval_videos},
                    {"train_captions", train_captions}, {"eval_clips", eval_clips},
                    {"train_rows", train_rows},      {"vocab", V},
                    {"concepts", o.concepts}};
  meta["concept_words"] = w.concept_words;
  meta["filler_words"] = w.fillers;
  writeFile((dir / "meta.json").string(), meta.dump(2) + "\n");
}

}  // namespace milnce
