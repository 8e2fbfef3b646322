// MIL-NCE data (see data.h): CSV and .npy files, the generator with planted concepts, the in-memory
// dataset, and the HowTo100M-style sampling of clips and candidate captions.
#include "milnce/data.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <unordered_set>

#include "dtrain/comm/error.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the .npy code assumes a little-endian host");

namespace milnce {
namespace fs = std::filesystem;
using dtrain::InvalidArgument;

namespace {

// ---- errors ----

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
  throw InvalidArgument(fmt::format("milnce: {}: {}", path, msg));
}
[[noreturn]] void failAt(const std::string& path, int64_t line, const std::string& msg) {
  throw InvalidArgument(fmt::format("milnce: {}:{}: {}", path, line, msg));
}

// ---- random numbers: our own, so the data is the same with any standard library and any torch state ----

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// An independent stream per (seed, what, index): video i does not depend on how many videos come before.
enum Stream : uint64_t { kVocabStream = 1, kPrototypeStream = 2, kWordVectorStream = 3, kTrainVideo = 4, kEvalVideo = 5 };
std::mt19937_64 streamRng(uint64_t seed, Stream what, uint64_t index = 0) {
  return std::mt19937_64(splitmix64(splitmix64(splitmix64(seed) ^ what) ^ index));
}

// Uniform in [0, 1) with 53 random bits.
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// Uniform integer in [lo, hi] (inclusive), unbiased by rejection.
int64_t uniformInt(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
  if (range == 0) return static_cast<int64_t>(rng());  // the whole 64-bit range
  const uint64_t rem = (std::numeric_limits<uint64_t>::max() % range + 1) % range;  // 2^64 mod range
  uint64_t x;
  do x = rng();
  while (x > std::numeric_limits<uint64_t>::max() - rem);
  return lo + static_cast<int64_t>(x % range);
}

// Standard normal (Box-Muller, one value per call).
double normal(std::mt19937_64& rng) {
  const double u1 = 1.0 - uniform01(rng);  // (0, 1]: log is finite
  const double u2 = uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

template <typename T>
void shuffle(std::vector<T>& v, std::mt19937_64& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(uniformInt(rng, 0, i - 1))]);
}

// ---- small file helpers ----

std::string readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail(path, "read error");
  return ss.str();
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out) out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (out) out.close();
  if (!out) throw dtrain::IoError(fmt::format("milnce: cannot write {}: {}", path, std::strerror(errno)));
}

double parseNumber(const CsvTable& t, size_t row, size_t col) {
  const std::string& s = t.rows[row][col];
  const char* begin = s.c_str();
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(begin, &end);
  while (end && (*end == ' ' || *end == '\t')) ++end;
  if (s.empty() || end == begin || *end != '\0' || !std::isfinite(v))
    failAt(t.path, t.lines[row], fmt::format("column '{}': '{}' is not a number", t.header[col], s));
  return v;
}

std::string shapeStr(at::IntArrayRef sizes) { return fmt::format("[{}]", fmt::join(sizes, ", ")); }
std::string typeStr(at::ScalarType t) { return c10::toString(t); }

std::string fmtTime(double sec) { return fmt::format("{:.2f}", sec); }

// ---- .npy ----

struct NpyType {
  const char* descr;
  at::ScalarType type;
  size_t size;
};
constexpr NpyType kNpyTypes[] = {{"<f4", at::kFloat, 4}, {"<f8", at::kDouble, 8}, {"<i4", at::kInt, 4},
                                 {"<i8", at::kLong, 8},  {"|u1", at::kByte, 1},   {"<u1", at::kByte, 1}};

// The value after `'key':` in a .npy header dict, up to the end of the value (a quoted string, a
// parenthesised tuple or a bare word).
std::string npyHeaderValue(const std::string& path, const std::string& header, const std::string& key) {
  size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) k = header.find("\"" + key + "\"");
  if (k == std::string::npos) fail(path, fmt::format("bad .npy header (no '{}'): {}", key, header));
  size_t i = header.find(':', k + key.size() + 2);
  if (i == std::string::npos) fail(path, fmt::format("bad .npy header: {}", header));
  ++i;
  while (i < header.size() && header[i] == ' ') ++i;
  if (i >= header.size()) fail(path, fmt::format("bad .npy header: {}", header));
  size_t j;
  if (header[i] == '\'' || header[i] == '"') {
    j = header.find(header[i], i + 1);
    if (j == std::string::npos) fail(path, fmt::format("bad .npy header: {}", header));
    return header.substr(i + 1, j - i - 1);
  }
  if (header[i] == '(') {
    j = header.find(')', i);
    if (j == std::string::npos) fail(path, fmt::format("bad .npy header: {}", header));
    return header.substr(i + 1, j - i - 1);
  }
  j = i;
  while (j < header.size() && header[j] != ',' && header[j] != '}' && header[j] != ' ') ++j;
  return header.substr(i, j - i);
}

std::vector<int64_t> parseShape(const std::string& path, const std::string& tuple) {
  std::vector<int64_t> shape;
  size_t i = 0;
  while (i < tuple.size()) {
    while (i < tuple.size() && (tuple[i] == ' ' || tuple[i] == ',')) ++i;
    if (i >= tuple.size()) break;
    size_t j = i;
    while (j < tuple.size() && std::isdigit(static_cast<unsigned char>(tuple[j]))) ++j;
    if (j == i || j - i > 15) fail(path, fmt::format("bad .npy shape ({})", tuple));
    shape.push_back(std::stoll(tuple.substr(i, j - i)));
    i = j;
    while (i < tuple.size() && tuple[i] == ' ') ++i;
    if (i < tuple.size() && tuple[i] != ',') fail(path, fmt::format("bad .npy shape ({})", tuple));
  }
  return shape;
}

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
};

GenVideo makeVideo(const GenOptions& o, const World& w, std::mt19937_64& rng, double misalign) {
  GenVideo v;
  const int nseg = static_cast<int>(uniformInt(rng, o.min_segments, o.max_segments));
  std::vector<double> bounds{0.0};  // nseg + 1 segment boundaries
  std::vector<int> concept;
  for (int s = 0; s < nseg; ++s) {
    bounds.push_back(bounds.back() + o.min_seg_sec + (o.max_seg_sec - o.min_seg_sec) * uniform01(rng));
    const bool next_step = uniform01(rng) < o.procedure;
    const int random_concept = static_cast<int>(uniformInt(rng, 0, o.concepts - 1));
    concept.push_back(s > 0 && next_step ? (concept.back() + 1) % o.concepts : random_concept);
  }
  const double total = bounds.back();

  // Row t (time t/rate) belongs to the segment containing that time.
  const int64_t F = o.feature_dim;
  v.rows = std::max<int64_t>(1, std::llround(total * o.rate));
  v.features.resize(static_cast<size_t>(v.rows * F));
  size_t seg = 0;
  for (int64_t t = 0; t < v.rows; ++t) {
    const double time = static_cast<double>(t) / o.rate;
    while (seg + 1 < concept.size() && time >= bounds[seg + 1]) ++seg;
    const float* proto = &w.prototypes[static_cast<size_t>(concept[seg] * F)];
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
      if (concept[n] != concept[s]) other.push_back(n);
    }
    const auto& pool = other.empty() ? neighbours : other;
    // Lead (next segment) or lag (previous), when both are possible.
    const bool to_next = uniform01(rng) < o.lead;
    int pick = pool.empty() ? -1 : pool[0];
    if (pool.size() == 2) pick = to_next ? pool[1] : pool[0];
    const int described = (shift && pick >= 0) ? concept[pick] : concept[s];

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
}

// ---- loading ----

std::vector<Video> loadVideos(const fs::path& dir, const std::string& list, int64_t feature_dim) {
  const CsvTable t = readCsv((dir / list).string());
  const size_t id_col = t.column("video_id"), file_col = t.column("feature_file");
  std::vector<Video> out;
  std::unordered_set<std::string> seen;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    Video v;
    v.id = t.rows[r][id_col];
    if (v.id.empty() || v.id == "." || v.id == ".." || v.id.find('/') != std::string::npos)
      failAt(t.path, t.lines[r], fmt::format("bad video_id '{}'", v.id));
    if (!seen.insert(v.id).second) failAt(t.path, t.lines[r], fmt::format("duplicate video_id '{}'", v.id));

    fs::path feature_file = t.rows[r][file_col];
    if (feature_file.is_relative()) feature_file = dir / feature_file;
    const std::string fpath = feature_file.string();
    at::Tensor feats = readNpy(fpath);
    if (feats.dim() != 2 || feats.size(0) < 1 || feats.size(1) != feature_dim)
      fail(fpath, fmt::format("features must be [T >= 1, {}] (feature_dim of meta.json), got {}", feature_dim,
                              shapeStr(feats.sizes())));
    if (!feats.is_floating_point()) fail(fpath, fmt::format("features must be float, got {}", typeStr(feats.scalar_type())));
    v.features = feats.to(at::kFloat).contiguous();

    const CsvTable c = readCsv((dir / "captions" / (v.id + ".csv")).string());
    const size_t s_col = c.column("start"), e_col = c.column("end"), x_col = c.column("text");
    for (size_t k = 0; k < c.rows.size(); ++k) {
      Caption cap{parseNumber(c, k, s_col), parseNumber(c, k, e_col), c.rows[k][x_col]};
      if (cap.start < 0 || cap.end < cap.start)
        failAt(c.path, c.lines[k], fmt::format("need 0 <= start <= end (got {}, {})", cap.start, cap.end));
      v.captions.push_back(std::move(cap));
    }
    if (v.captions.empty()) fail(c.path, "no captions");
    out.push_back(std::move(v));
  }
  return out;
}

// ---- sampling ----

void checkLoader(const LoaderOptions& o) {
  if (o.num_candidates < 1 || o.max_words < 1 || o.clip_steps < 1 || !(o.min_time >= 0))
    throw InvalidArgument(fmt::format(
        "milnce: loader options: need num_candidates >= 1, max_words >= 1, clip_steps >= 1, min_time >= 0 "
        "(got {}, {}, {}, {})",
        o.num_candidates, o.max_words, o.clip_steps, o.min_time));
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

void sampleInto(const Dataset& ds, size_t video_index, const LoaderOptions& o, std::mt19937_64& rng, float* video,
                int64_t* text, SampleTrace* trace) {
  if (video_index >= ds.videos.size())
    throw InvalidArgument(
        fmt::format("milnce: sample: video index {} out of range ({} videos)", video_index, ds.videos.size()));
  const Video& v = ds.videos[video_index];
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

  // _get_video: a random seek inside the span, then clip_steps rows.
  const double clip_sec = o.clip_steps / ds.rate;
  double seek;
  if (o.whole_seconds) {
    start = std::trunc(start);
    end = std::trunc(end);
    const double hi = std::trunc(std::max(start, end - clip_sec));
    seek = static_cast<double>(uniformInt(rng, static_cast<int64_t>(start), static_cast<int64_t>(hi)));
  } else {
    seek = start + (std::max(start, end - clip_sec) - start) * uniform01(rng);
  }
  const int64_t first = firstRow(seek, ds.rate, v.features.size(0), o.clip_steps);
  copyRows(v.features, first, o.clip_steps, video);

  if (trace) *trace = SampleTrace{ind, K > 1 ? cap_start : ind, start, end, seek, first};
}

}  // namespace

// ---- CSV ----

size_t CsvTable::column(const std::string& name) const {
  for (size_t i = 0; i < header.size(); ++i)
    if (header[i] == name) return i;
  fail(path, fmt::format("no column '{}' in header ({})", name, fmt::join(header, ",")));
}

CsvTable readCsv(const std::string& path) {
  std::string s = readFile(path);
  if (s.compare(0, 3, "\xEF\xBB\xBF") == 0) s.erase(0, 3);  // UTF-8 byte order mark
  CsvTable t;
  t.path = path;

  enum State { kFieldStart, kUnquoted, kQuoted, kAfterQuote } state = kFieldStart;
  std::vector<std::string> fields;
  std::string field;
  int64_t line = 1, row_line = 1;
  bool row_content = false;  // anything but an empty line so far
  bool have_header = false;

  auto endRow = [&] {
    if (row_content) {
      fields.push_back(std::move(field));
      if (!have_header) {
        t.header = std::move(fields);
        have_header = true;
      } else {
        if (fields.size() != t.header.size())
          failAt(path, row_line,
                 fmt::format("{} fields, expected {} (header: {})", fields.size(), t.header.size(),
                             fmt::join(t.header, ",")));
        t.rows.push_back(std::move(fields));
        t.lines.push_back(row_line);
      }
    }
    fields.clear();
    field.clear();
    row_content = false;
    state = kFieldStart;
  };

  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (!row_content && state == kFieldStart && fields.empty()) row_line = line;
    const bool eol = c == '\n' || c == '\r';
    switch (state) {
      case kQuoted:
        if (c == '"') {
          if (i + 1 < s.size() && s[i + 1] == '"') {
            field += '"';
            ++i;
          } else {
            state = kAfterQuote;
          }
        } else {
          field += c;
          if (c == '\n' || (c == '\r' && !(i + 1 < s.size() && s[i + 1] == '\n'))) ++line;
        }
        continue;
      case kAfterQuote:
        if (c != ',' && !eol)
          failAt(path, line, fmt::format("unexpected '{}' after a closing quote", c));
        break;
      default:
        break;
    }
    if (eol) {
      if (c == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
      endRow();
      ++line;
    } else if (c == ',') {
      fields.push_back(std::move(field));
      field.clear();
      row_content = true;
      state = kFieldStart;
    } else if (c == '"' && state == kFieldStart) {
      row_content = true;
      state = kQuoted;
    } else {
      field += c;  // a quote inside an unquoted field is literal, as in Python's csv
      row_content = true;
      state = kUnquoted;
    }
  }
  if (state == kQuoted) failAt(path, row_line, "unterminated quoted field");
  endRow();
  if (t.header.empty()) fail(path, "empty file (no header)");
  return t;
}

void writeCsv(const std::string& path, const std::vector<std::string>& header,
              const std::vector<std::vector<std::string>>& rows) {
  std::string out;
  auto put = [&out](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size(); ++i) {
      const std::string& f = row[i];
      if (i) out += ',';
      if (f.find_first_of(",\"\r\n") != std::string::npos || (row.size() == 1 && f.empty())) {
        out += '"';
        for (char c : f) out += c == '"' ? std::string("\"\"") : std::string(1, c);
        out += '"';
      } else {
        out += f;
      }
    }
    out += '\n';
  };
  put(header);
  for (const auto& r : rows) {
    if (r.size() != header.size())
      throw InvalidArgument(fmt::format("milnce: writeCsv {}: a row has {} fields, the header {}", path, r.size(),
                                        header.size()));
    put(r);
  }
  writeFile(path, out);
}

// ---- .npy ----

at::Tensor readNpy(const std::string& path) {
  const std::string s = readFile(path);
  if (s.size() < 10 || s.compare(0, 6, "\x93NUMPY") != 0) fail(path, "not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(s[6]);
  size_t header_len, offset;
  if (major == 1) {
    header_len = static_cast<unsigned char>(s[8]) | static_cast<size_t>(static_cast<unsigned char>(s[9])) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (s.size() < 12) fail(path, "truncated .npy header");
    header_len = 0;
    for (int i = 3; i >= 0; --i) header_len = header_len << 8 | static_cast<unsigned char>(s[8 + i]);
    offset = 12;
  } else {
    fail(path, fmt::format("unsupported .npy format version {}.{}", major, static_cast<int>(s[7])));
  }
  if (s.size() < offset + header_len) fail(path, "truncated .npy header");
  const std::string header = s.substr(offset, header_len);
  offset += header_len;

  const std::string descr = npyHeaderValue(path, header, "descr");
  const std::string order = npyHeaderValue(path, header, "fortran_order");
  const std::vector<int64_t> shape = parseShape(path, npyHeaderValue(path, header, "shape"));
  if (order != "True" && order != "False") fail(path, fmt::format("bad .npy fortran_order '{}'", order));
  const NpyType* type = nullptr;
  for (const auto& t : kNpyTypes)
    if (descr == t.descr) type = &t;
  if (!type) fail(path, fmt::format("unsupported .npy dtype '{}' (want <f4 <f8 <i4 <i8 |u1)", descr));

  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d != 0 && numel > std::numeric_limits<int64_t>::max() / d / 8) fail(path, "bad .npy shape (too large)");
    numel *= d;
  }
  const size_t bytes = static_cast<size_t>(numel) * type->size;
  if (s.size() - offset != bytes)
    fail(path, fmt::format(".npy data is {} bytes, shape ({}) of {} needs {}", s.size() - offset,
                           fmt::join(shape, ", "), descr, bytes));

  const bool fortran = order == "True";
  std::vector<int64_t> stored = shape;  // Fortran order: the transpose is C-ordered
  if (fortran) std::reverse(stored.begin(), stored.end());
  at::Tensor t = at::empty(stored, at::TensorOptions().dtype(type->type));
  if (bytes) std::memcpy(t.data_ptr(), s.data() + offset, bytes);
  if (fortran && t.dim() > 1) {
    std::vector<int64_t> perm(static_cast<size_t>(t.dim()));
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int64_t>(perm.size() - 1 - i);
    t = t.permute(perm).contiguous();
  }
  return t;
}

void writeNpy(const std::string& path, const at::Tensor& tensor) {
  const NpyType* type = nullptr;
  for (const auto& t : kNpyTypes)
    if (tensor.scalar_type() == t.type) {
      type = &t;
      break;
    }
  if (!type) throw InvalidArgument(fmt::format("milnce: writeNpy {}: unsupported dtype {}", path, typeStr(tensor.scalar_type())));
  const at::Tensor t = tensor.cpu().contiguous();
  std::string shape;
  for (int64_t d : t.sizes()) shape += fmt::format("{}, ", d);
  if (t.dim() > 1) shape.resize(shape.size() - 2);  // (3, 4); a 1-d shape keeps its comma: (3,)
  else if (t.dim() == 1) shape.resize(shape.size() - 1);
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", type->descr, shape);
  // Pad with spaces and a newline so that the data starts at a multiple of 64 bytes, as numpy does.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  out += header;
  out.append(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * type->size);
  writeFile(path, out);
}

// ---- generation ----

void generateData(const GenOptions& o) {
  validate(o);
  const fs::path dir = o.out;
  std::error_code ec;
  for (const fs::path& d : {dir, dir / "features", dir / "captions"}) {
    fs::create_directories(d, ec);
    if (ec) throw dtrain::IoError(fmt::format("milnce: cannot create {}: {}", d.string(), ec.message()));
  }
  const World w = makeWorld(o);

  // vocab.txt and word2vec.npy: concept words (concept by concept), then fillers.
  std::string vocab;
  int64_t V = 0;
  for (const auto& words : w.concept_words)
    for (const auto& word : words) vocab += word + "\n", ++V;
  for (const auto& word : w.fillers) vocab += word + "\n", ++V;
  writeFile((dir / "vocab.txt").string(), vocab);
  {
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
  }
  writeNpy((dir / "prototypes.npy").string(),
           at::from_blob(const_cast<float*>(w.prototypes.data()), {o.concepts, o.feature_dim}, at::kFloat));

  // Videos: features, captions, and the lists.
  int64_t train_captions = 0, eval_clips = 0, train_rows = 0;
  std::vector<std::vector<std::string>> train_list, eval_list, eval_rows;
  auto writeVideo = [&](const std::string& id, const GenVideo& v) {
    at::Tensor f = at::from_blob(const_cast<float*>(v.features.data()), {v.rows, o.feature_dim}, at::kFloat);
    writeNpy((dir / "features" / (id + ".npy")).string(), f);
    std::vector<std::vector<std::string>> rows;
    for (const auto& c : v.captions) rows.push_back({fmtTime(c.start), fmtTime(c.end), c.text});
    writeCsv((dir / "captions" / (id + ".csv")).string(), {"start", "end", "text"}, rows);
  };
  for (int i = 0; i < o.videos; ++i) {
    const std::string id = fmt::format("vid_{:05d}", i);
    auto rng = streamRng(o.seed, kTrainVideo, static_cast<uint64_t>(i));
    const GenVideo v = makeVideo(o, w, rng, o.misalign);
    writeVideo(id, v);
    train_list.push_back({id, "features/" + id + ".npy"});
    train_captions += static_cast<int64_t>(v.captions.size());
    train_rows += v.rows;
  }
  for (int i = 0; i < o.eval_videos; ++i) {
    const std::string id = fmt::format("eval_{:05d}", i);
    auto rng = streamRng(o.seed, kEvalVideo, static_cast<uint64_t>(i));
    const GenVideo v = makeVideo(o, w, rng, /*misalign=*/0.0);  // clean, like human-annotated YouCook2
    writeVideo(id, v);
    eval_list.push_back({id, "features/" + id + ".npy"});
    for (const auto& c : v.captions) eval_rows.push_back({id, fmtTime(c.start), fmtTime(c.end), c.text});
    eval_clips += static_cast<int64_t>(v.captions.size());
  }
  writeCsv((dir / "videos.csv").string(), {"video_id", "feature_file"}, train_list);
  writeCsv((dir / "eval_videos.csv").string(), {"video_id", "feature_file"}, eval_list);
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

// ---- the dataset ----

Dataset Dataset::load(const std::string& dir_name) {
  const fs::path dir = dir_name;
  Dataset ds;
  ds.dir = dir_name;

  const std::string meta_path = (dir / "meta.json").string();
  {
    nlohmann::json meta;
    try {
      meta = nlohmann::json::parse(readFile(meta_path));
    } catch (const nlohmann::json::exception& e) {
      fail(meta_path, fmt::format("bad JSON: {}", e.what()));
    }
    try {
      ds.rate = meta.at("rate").get<double>();
      ds.feature_dim = meta.at("feature_dim").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(meta_path, fmt::format("needs numbers 'rate' and 'feature_dim': {}", e.what()));
    }
    if (!(ds.rate > 0) || !std::isfinite(ds.rate) || ds.feature_dim < 1)
      fail(meta_path, fmt::format("need rate > 0 and feature_dim >= 1 (got {}, {})", ds.rate, ds.feature_dim));
  }

  {
    const std::string path = (dir / "vocab.txt").string();
    std::istringstream in(readFile(path));
    std::string word;
    for (int64_t line = 1; std::getline(in, word); ++line) {
      if (!word.empty() && word.back() == '\r') word.pop_back();
      if (word.empty()) failAt(path, line, "empty word");
      if (!ds.vocab.emplace(word, line).second) failAt(path, line, fmt::format("duplicate word '{}'", word));
      ds.words.push_back(word);
    }
  }
  {
    const std::string path = (dir / "word2vec.npy").string();
    at::Tensor wv = readNpy(path);
    const int64_t V = static_cast<int64_t>(ds.words.size());
    if (wv.dim() != 2 || wv.size(0) != V + 1 || wv.size(1) < 1 || !wv.is_floating_point())
      fail(path, fmt::format("word vectors must be float [{} (vocab.txt words + 1), E], got {} {}", V + 1,
                             typeStr(wv.scalar_type()), shapeStr(wv.sizes())));
    ds.word_vectors = wv.to(at::kFloat).contiguous();
  }

  ds.videos = loadVideos(dir, "videos.csv", ds.feature_dim);
  ds.eval_videos = loadVideos(dir, "eval_videos.csv", ds.feature_dim);
  if (ds.videos.empty()) fail((dir / "videos.csv").string(), "no videos");

  std::unordered_map<std::string, int> eval_index;
  for (size_t i = 0; i < ds.eval_videos.size(); ++i) eval_index.emplace(ds.eval_videos[i].id, static_cast<int>(i));
  for (const auto& v : ds.videos)
    if (eval_index.count(v.id)) fail((dir / "videos.csv").string(), fmt::format("'{}' is also an eval video", v.id));
  const CsvTable t = readCsv((dir / "eval.csv").string());
  const size_t id_col = t.column("video_id"), s_col = t.column("start"), e_col = t.column("end"),
               x_col = t.column("sentence");
  for (size_t r = 0; r < t.rows.size(); ++r) {
    EvalClip c;
    c.video_id = t.rows[r][id_col];
    c.start = parseNumber(t, r, s_col);
    c.end = parseNumber(t, r, e_col);
    c.sentence = t.rows[r][x_col];
    auto it = eval_index.find(c.video_id);
    if (it == eval_index.end())
      failAt(t.path, t.lines[r], fmt::format("video '{}' is not in eval_videos.csv", c.video_id));
    if (c.start < 0 || c.end < c.start)
      failAt(t.path, t.lines[r], fmt::format("need 0 <= start <= end (got {}, {})", c.start, c.end));
    c.video_index = it->second;
    ds.eval_clips.push_back(std::move(c));
  }
  return ds;
}

// ---- text ----

std::vector<std::string> splitWords(const std::string& text) {
  std::vector<std::string> words;
  std::string cur;
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '_' || c == '\'' || c >= 0x80) {
      cur += static_cast<char>(c < 0x80 ? std::tolower(c) : c);
    } else if (!cur.empty()) {
      words.push_back(std::move(cur));
      cur.clear();
    }
  }
  if (!cur.empty()) words.push_back(std::move(cur));
  return words;
}

std::vector<int64_t> tokenize(const std::string& text, const std::unordered_map<std::string, int64_t>& vocab,
                              int max_words) {
  if (max_words < 1) throw InvalidArgument(fmt::format("milnce: tokenize: max_words must be >= 1 (got {})", max_words));
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(max_words));
  for (const auto& w : splitWords(text)) {
    if (ids.size() == static_cast<size_t>(max_words)) break;
    auto it = vocab.find(w);
    if (it != vocab.end()) ids.push_back(it->second);
  }
  ids.resize(static_cast<size_t>(max_words), 0);
  return ids;
}

std::vector<int64_t> tokenize(const std::string& text, const Dataset& ds, int max_words) {
  return tokenize(text, ds.vocab, max_words);
}

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
  s.video = at::empty({opts.clip_steps, ds.feature_dim}, at::kFloat);
  s.text = at::empty({opts.num_candidates, opts.max_words}, at::kLong);
  sampleInto(ds, video_index, opts, rng, s.video.data_ptr<float>(), s.text.data_ptr<int64_t>(), trace);
  return s;
}

Batch makeBatch(const Dataset& ds, const std::vector<int64_t>& video_indices, const LoaderOptions& opts,
                std::mt19937_64& rng) {
  checkLoader(opts);
  const int64_t B = static_cast<int64_t>(video_indices.size()), F = ds.feature_dim;
  Batch b;
  b.video = at::empty({B, opts.clip_steps, F}, at::kFloat);
  b.text = at::empty({B, opts.num_candidates, opts.max_words}, at::kLong);
  float* vp = b.video.data_ptr<float>();
  int64_t* tp = b.text.data_ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    const int64_t idx = video_indices[static_cast<size_t>(i)];
    if (idx < 0) throw InvalidArgument(fmt::format("milnce: makeBatch: negative video index {}", idx));
    sampleInto(ds, static_cast<size_t>(idx), opts, rng, vp + i * opts.clip_steps * F,
               tp + i * opts.num_candidates * opts.max_words, nullptr);
  }
  return b;
}

// ---- evaluation ----

namespace {
void evalWindowsInto(const Dataset& ds, const EvalClip& clip, int windows, const LoaderOptions& o, float* dst) {
  if (clip.video_index < 0 || static_cast<size_t>(clip.video_index) >= ds.eval_videos.size())
    throw InvalidArgument(fmt::format("milnce: eval clip of '{}': video_index {} out of range ({} eval videos)",
                                      clip.video_id, clip.video_index, ds.eval_videos.size()));
  const at::Tensor& feats = ds.eval_videos[static_cast<size_t>(clip.video_index)].features;
  double start = clip.start, end = clip.end;
  widen(start, end, o.min_time);
  const double stop = std::max(start, end - o.clip_steps / ds.rate);
  const int64_t F = ds.feature_dim;
  for (int w = 0; w < windows; ++w) {
    // np.linspace(start, stop, windows): the last point is exactly stop.
    const double s = windows == 1 ? start : (w == windows - 1 ? stop : start + (stop - start) / (windows - 1) * w);
    copyRows(feats, firstRow(s, ds.rate, feats.size(0), o.clip_steps), o.clip_steps, dst + w * o.clip_steps * F);
  }
}
void checkWindows(int windows) {
  if (windows < 1) throw InvalidArgument(fmt::format("milnce: eval: windows must be >= 1 (got {})", windows));
}
}  // namespace

at::Tensor evalClipWindows(const Dataset& ds, const EvalClip& clip, int windows, const LoaderOptions& opts) {
  checkLoader(opts);
  checkWindows(windows);
  at::Tensor out = at::empty({windows, opts.clip_steps, ds.feature_dim}, at::kFloat);
  evalWindowsInto(ds, clip, windows, opts, out.data_ptr<float>());
  return out;
}

at::Tensor evalVideoWindows(const Dataset& ds, int windows, const LoaderOptions& opts) {
  checkLoader(opts);
  checkWindows(windows);
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
