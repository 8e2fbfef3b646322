// MIL-NCE data: the in-memory dataset (Dataset::load) and the text tokenizer (data.h).
#include "milnce/data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "dtrain/comm/error.h"
#include "milnce/data_util.h"

namespace milnce {
namespace fs = std::filesystem;
using namespace detail;  // NOLINT(google-build-using-namespace): the data files' shared helpers
using dtrain::InvalidArgument;

namespace {

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

// ---- loading ----

std::vector<Video> loadVideos(const fs::path& dir, const std::string& list, int64_t feature_dim, bool raw_video) {
  const CsvTable t = readCsv((dir / list).string());
  const size_t id_col = t.column("video_id"), file_col = t.column(raw_video ? "video_file" : "feature_file");
  std::vector<Video> out;
  std::unordered_set<std::string> seen;
  for (size_t r = 0; r < t.rows.size(); ++r) {
    Video v;
    v.id = t.rows[r][id_col];
    if (v.id.empty() || v.id == "." || v.id == ".." || v.id.find('/') != std::string::npos)
      failAt(t.path, t.lines[r], fmt::format("bad video_id '{}'", v.id));
    if (!seen.insert(v.id).second) failAt(t.path, t.lines[r], fmt::format("duplicate video_id '{}'", v.id));

    fs::path file = t.rows[r][file_col];
    if (file.empty()) failAt(t.path, t.lines[r], "empty file name");
    if (file.is_relative()) file = dir / file;
    const std::string fpath = file.string();
    if (raw_video) {
      v.file = fpath;  // opened when a clip is read: a missing or broken video is skipped then, not here
    } else {
      at::Tensor feats = readNpy(fpath);
      if (feats.dim() != 2 || feats.size(0) < 1 || feats.size(1) != feature_dim)
        fail(fpath, fmt::format("features must be [T >= 1, {}] (feature_dim of meta.json), got {}", feature_dim,
                                shapeStr(feats.sizes())));
      if (!feats.is_floating_point())
        fail(fpath, fmt::format("features must be float, got {}", typeStr(feats.scalar_type())));
      v.features = feats.to(at::kFloat).contiguous();
    }

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

}  // namespace

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
    ds.raw_video = meta.is_object() && meta.value("kind", std::string()) == "video";
    try {
      ds.rate = meta.at(ds.raw_video ? "fps" : "rate").get<double>();
      ds.feature_dim = ds.raw_video ? 0 : meta.at("feature_dim").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(meta_path, fmt::format("needs numbers {}: {}", ds.raw_video ? "'fps'" : "'rate' and 'feature_dim'", e.what()));
    }
    if (!(ds.rate > 0) || !std::isfinite(ds.rate) || (!ds.raw_video && ds.feature_dim < 1))
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

  ds.videos = loadVideos(dir, "videos.csv", ds.feature_dim, ds.raw_video);
  ds.eval_videos = loadVideos(dir, "eval_videos.csv", ds.feature_dim, ds.raw_video);
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

}  // namespace milnce
