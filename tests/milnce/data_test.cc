// MIL-NCE data: the generator's files, counts and planted structure, determinism, misalignment, that
// numpy and Python's csv read the files, the CSV and .npy readers and writers against Python, tokenize
// against Python's re, _find_nearest_candidates against a Python port of the reference, sample() /
// makeBatch() / eval windows on a hand-made dataset whose rows carry their own index, and errors that
// name the file.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dtrain/comm/error.h"
#include "harness.h"
#include "milnce/data.h"

namespace milnce {
namespace {
namespace fs = std::filesystem;
using dtrain::InvalidArgument;
using dtrain::test::runPython;
using dtrain::test::TempDir;

// ---- helpers ----

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void spit(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }


// A Python string literal for s.
std::string pyStr(const std::string& s) { return nlohmann::json(s).dump(); }

template <typename Fn>
std::string invalidMessage(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not InvalidArgument: ") + e.what();
  }
  return "no exception";
}

GenOptions smallOptions(const std::string& out) {
  GenOptions g;
  g.out = out;
  g.videos = 24;
  g.eval_videos = 6;
  g.concepts = 6;
  g.feature_dim = 32;
  g.word_dim = 8;
  g.seed = 7;
  return g;
}

// The ground truth the test reads back from the files: each concept's words and prototype.
struct Truth {
  std::map<std::string, int> concept_of;  // concept word -> concept
  std::set<std::string> fillers;
  at::Tensor prototypes;  // [C, F]
};
Truth readTruth(const std::string& dir) {
  Truth t;
  auto meta = nlohmann::json::parse(slurp(fs::path(dir) / "meta.json"));
  int c = 0;
  for (const auto& words : meta.at("concept_words")) {
    for (const auto& w : words) t.concept_of[w.get<std::string>()] = c;
    ++c;
  }
  for (const auto& w : meta.at("filler_words")) t.fillers.insert(w.get<std::string>());
  t.prototypes = readNpy((fs::path(dir) / "prototypes.npy").string());
  return t;
}

// The concept a caption's concept words belong to; -1 (with a failure) if they mix concepts or there are none.
int captionConcept(const Truth& truth, const std::string& text) {
  std::set<int> concepts;
  for (const auto& w : splitWords(text)) {
    auto it = truth.concept_of.find(w);
    if (it != truth.concept_of.end()) concepts.insert(it->second);
  }
  if (concepts.size() != 1) {
    ADD_FAILURE() << "caption '" << text << "' has words of " << concepts.size() << " concepts";
    return -1;
  }
  return *concepts.begin();
}

// The concept whose prototype is nearest the mean of the rows within 0.5 s of the caption's midpoint
// (captions are their segment +- 0.5 s and segments last >= 3 s, so these rows are the segment's).
int segmentConcept(const Truth& truth, const Video& v, const Caption& c, double rate) {
  const double mid = (c.start + c.end) / 2;
  const int64_t lo = std::max<int64_t>(0, std::llround((mid - 0.5) * rate));
  const int64_t hi = std::min<int64_t>(v.features.size(0) - 1, std::llround((mid + 0.5) * rate));
  const at::Tensor mean = v.features.slice(0, lo, hi + 1).mean(0);
  return static_cast<int>((truth.prototypes - mean).norm(2, 1).argmin().item<int64_t>());
}

// ---- a generated dataset shared by several tests ----

class Generated : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    generateData(smallOptions(dir_->path()));
    ds_ = std::make_unique<Dataset>(Dataset::load(dir_->path()));
  }
  static void TearDownTestSuite() {
    ds_.reset();
    dir_.reset();
  }
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<Dataset> ds_;
};
std::unique_ptr<TempDir> Generated::dir_;
std::unique_ptr<Dataset> Generated::ds_;

TEST_F(Generated, FilesCountsAndShapes) {
  const fs::path dir = dir_->path();
  for (const char* f : {"videos.csv", "eval_videos.csv", "eval.csv", "vocab.txt", "word2vec.npy", "prototypes.npy",
                        "meta.json"})
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  const Dataset& ds = *ds_;
  const GenOptions g = smallOptions(dir_->path());
  ASSERT_EQ(ds.videos.size(), 24u);
  ASSERT_EQ(ds.eval_videos.size(), 6u);
  EXPECT_EQ(ds.rate, 2.0);
  EXPECT_EQ(ds.feature_dim, 32);
  EXPECT_EQ(ds.wordDim(), 8);
  const int64_t V = g.concepts * g.words_per_concept + g.filler_words;
  EXPECT_EQ(static_cast<int64_t>(ds.vocab.size()), V);
  EXPECT_EQ(static_cast<int64_t>(ds.words.size()), V);
  for (size_t i = 0; i < ds.words.size(); ++i) EXPECT_EQ(ds.vocab.at(ds.words[i]), static_cast<int64_t>(i) + 1);
  ASSERT_EQ(ds.word_vectors.sizes(), (at::IntArrayRef{V + 1, 8}));
  EXPECT_EQ(ds.word_vectors[0].abs().sum().item<float>(), 0.0f);
  EXPECT_TRUE(at::allclose(ds.word_vectors.slice(0, 1).norm(2, 1), at::ones({V}), 1e-5, 1e-5));

  std::set<std::string> train_ids, eval_ids;
  int64_t captions = 0;
  for (const auto& v : ds.videos) {
    train_ids.insert(v.id);
    ASSERT_EQ(v.features.dim(), 2);
    EXPECT_EQ(v.features.size(1), 32);
    EXPECT_EQ(v.features.scalar_type(), at::kFloat);
    EXPECT_GE(v.captions.size(), 6u);
    EXPECT_LE(v.captions.size(), 12u);
    captions += static_cast<int64_t>(v.captions.size());
    // T = round(total * rate), and the last caption ends within 0.5 s of the end (clipped to it).
    const double total = static_cast<double>(v.features.size(0)) / ds.rate;
    EXPECT_LE(v.captions.back().end, total + 0.5 / ds.rate + 0.01) << v.id;
    EXPECT_GE(v.captions.back().end, total - 0.5 - 0.5 / ds.rate - 0.01) << v.id;
    EXPECT_GE(total, 6 * 3 - 0.5);
    EXPECT_LE(total, 12 * 8 + 0.5);
    for (size_t k = 0; k < v.captions.size(); ++k) {
      const auto& c = v.captions[k];
      EXPECT_GE(c.start, 0);
      EXPECT_GE(c.end, c.start + 1.98) << "segments last >= 3 s, jitter is <= 0.5 s each side";
      EXPECT_EQ(std::round(c.start * 100) / 100, c.start);
      if (k) {
        EXPECT_GT(c.start, v.captions[k - 1].start);
      }
    }
  }
  for (const auto& v : ds.eval_videos) eval_ids.insert(v.id);
  for (const auto& id : eval_ids) EXPECT_EQ(train_ids.count(id), 0u) << id << " is in both lists";

  int64_t eval_caps = 0;
  for (const auto& v : ds.eval_videos) eval_caps += static_cast<int64_t>(v.captions.size());
  ASSERT_EQ(static_cast<int64_t>(ds.eval_clips.size()), eval_caps) << "one eval clip per eval caption";
  for (const auto& c : ds.eval_clips) {
    ASSERT_GE(c.video_index, 0);
    EXPECT_EQ(ds.eval_videos[static_cast<size_t>(c.video_index)].id, c.video_id);
  }

  auto meta = nlohmann::json::parse(slurp(dir / "meta.json"));
  EXPECT_EQ(meta.at("counts").at("train_captions").get<int64_t>(), captions);
  EXPECT_EQ(meta.at("counts").at("eval_clips").get<int64_t>(), eval_caps);
  EXPECT_EQ(meta.at("counts").at("vocab").get<int64_t>(), V);
  EXPECT_EQ(meta.at("options").at("seed").get<uint64_t>(), 7u);
  EXPECT_EQ(meta.at("options").at("misalign").get<double>(), 0.3);
  EXPECT_FALSE(meta.at("options").contains("out")) << "a dataset can be moved";
}

TEST_F(Generated, CaptionWordsBelongToOneConcept) {
  const Truth truth = readTruth(dir_->path());
  EXPECT_EQ(truth.concept_of.size(), 6u * 4);
  EXPECT_EQ(truth.fillers.size(), 40u);
  for (const auto* list : {&ds_->videos, &ds_->eval_videos})
    for (const auto& v : *list)
      for (const auto& c : v.captions) {
        int concept_words = 0, filler = 0;
        for (const auto& w : splitWords(c.text)) {
          concept_words += truth.concept_of.count(w) ? 1 : 0;
          filler += truth.fillers.count(w) ? 1 : 0;
          EXPECT_TRUE(ds_->vocab.count(w)) << w;
        }
        EXPECT_GE(concept_words, 2) << c.text;
        EXPECT_LE(concept_words, 3) << c.text;
        EXPECT_GE(filler, 2) << c.text;
        EXPECT_LE(filler, 4) << c.text;
        EXPECT_EQ(c.text, [&] {  // lower-case words separated by single spaces
          std::string s;
          for (const auto& w : splitWords(c.text)) s += (s.empty() ? "" : " ") + w;
          return s;
        }());
        captionConcept(truth, c.text);
      }
}

TEST(GenerateData, FeatureRowsSitNearTheirConceptPrototype) {
  TempDir dir;
  GenOptions g = smallOptions(dir.path());
  g.feature_dim = 64;  // the defaults: F = 64, noise = 1
  g.misalign = 0;
  generateData(g);
  const Dataset ds = Dataset::load(dir.path());
  const Truth truth = readTruth(dir.path());
  int64_t rows = 0, nearest_own = 0;
  for (const auto& v : ds.videos)
    for (const auto& c : v.captions) {
      const int concept_id = captionConcept(truth, c.text);  // misalign = 0: the segment's own concept
      EXPECT_EQ(segmentConcept(truth, v, c, ds.rate), concept_id) << v.id << " " << c.text;
      const double mid = (c.start + c.end) / 2;
      const int64_t lo = std::max<int64_t>(0, std::llround((mid - 1) * ds.rate));
      const int64_t hi = std::min<int64_t>(v.features.size(0) - 1, std::llround((mid + 1) * ds.rate));
      for (int64_t t = lo; t <= hi; ++t) {
        const int64_t nearest = (truth.prototypes - v.features[t]).norm(2, 1).argmin().item<int64_t>();
        ++rows;
        nearest_own += nearest == concept_id;
      }
    }
  EXPECT_GT(rows, 500);
  EXPECT_GE(nearest_own, rows * 99 / 100) << "rows nearest their own prototype: " << nearest_own << "/" << rows;
}

std::map<std::string, std::string> allFiles(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = slurp(e.path());
  return files;
}

TEST(GenerateData, DeterministicFromTheSeed) {
  TempDir a, b, c, d;
  generateData(smallOptions(a.path()));
  generateData(smallOptions(b.path()));
  const auto fa = allFiles(a.path()), fb = allFiles(b.path());
  EXPECT_EQ(fa.size(), 7u + 2u * (24 + 6));
  ASSERT_EQ(fa.size(), fb.size());
  for (const auto& [name, bytes] : fa) {
    ASSERT_TRUE(fb.count(name)) << name;
    EXPECT_TRUE(bytes == fb.at(name)) << name << " differs between two runs with the same seed";
  }

  GenOptions other = smallOptions(c.path());
  other.seed = 8;
  generateData(other);
  const auto fc = allFiles(c.path());
  for (const char* name : {"vocab.txt", "word2vec.npy", "prototypes.npy", "features/vid_00000.npy",
                           "captions/vid_00000.csv", "eval.csv"})
    EXPECT_NE(fa.at(name), fc.at(name)) << name << " is the same with another seed";

  // Video i depends only on (seed, i): fewer videos leave the first ones unchanged.
  GenOptions fewer = smallOptions(d.path());
  fewer.videos = 3;
  generateData(fewer);
  const auto fd = allFiles(d.path());
  for (const char* name : {"features/vid_00002.npy", "captions/vid_00002.csv", "eval.csv", "vocab.txt"})
    EXPECT_EQ(fa.at(name), fd.at(name)) << name;
  EXPECT_FALSE(fd.count("features/vid_00003.npy"));
}

// For each training caption: its own segment's concept, its words' concept, and its neighbours' concepts.
struct CaptionTruth {
  int own, described;
  std::set<int> neighbours;
};
std::vector<CaptionTruth> captionTruths(const std::string& dir, bool eval = false) {
  const Dataset ds = Dataset::load(dir);
  const Truth truth = readTruth(dir);
  std::vector<CaptionTruth> out;
  for (const auto& v : eval ? ds.eval_videos : ds.videos) {
    std::vector<int> own;
    for (const auto& c : v.captions) own.push_back(segmentConcept(truth, v, c, ds.rate));
    for (size_t k = 0; k < v.captions.size(); ++k) {
      CaptionTruth t{own[k], captionConcept(truth, v.captions[k].text), {}};
      if (k > 0) t.neighbours.insert(own[k - 1]);
      if (k + 1 < own.size()) t.neighbours.insert(own[k + 1]);
      out.push_back(t);
    }
  }
  return out;
}

TEST(GenerateData, MisalignmentDescribesANeighbour) {
  TempDir clean, shifted, mixed;
  GenOptions g = smallOptions(clean.path());
  g.noise = 0.5;
  g.misalign = 0;
  generateData(g);
  g.out = shifted.path();
  g.misalign = 1;
  generateData(g);
  g.out = mixed.path();
  g.misalign = 0.3;
  generateData(g);

  // The features are the same whatever misalign is: only the captions' concepts move.
  EXPECT_EQ(slurp(fs::path(clean.path()) / "features/vid_00005.npy"),
            slurp(fs::path(shifted.path()) / "features/vid_00005.npy"));

  for (const auto& t : captionTruths(clean.path())) EXPECT_EQ(t.described, t.own);
  int64_t eligible = 0;
  for (const auto& t : captionTruths(shifted.path())) {
    std::set<int> others = t.neighbours;
    others.erase(t.own);
    if (others.empty()) {
      EXPECT_EQ(t.described, t.own) << "no neighbour with another concept";
    } else {
      ++eligible;
      EXPECT_NE(t.described, t.own);
      EXPECT_TRUE(others.count(t.described)) << "describes a neighbour's concept";
    }
  }
  EXPECT_GT(eligible, 100);

  int64_t moved = 0, can_move = 0;
  for (const auto& t : captionTruths(mixed.path())) {
    std::set<int> others = t.neighbours;
    others.erase(t.own);
    if (others.empty()) continue;
    ++can_move;
    moved += t.described != t.own;
  }
  const double rate = static_cast<double>(moved) / static_cast<double>(can_move);
  EXPECT_GT(rate, 0.15) << moved << "/" << can_move;
  EXPECT_LT(rate, 0.45) << moved << "/" << can_move;

  // Eval captions are clean even with misalign = 1, and eval.csv holds exactly them.
  for (const auto& t : captionTruths(shifted.path(), /*eval=*/true)) EXPECT_EQ(t.described, t.own);
  const Dataset ds = Dataset::load(shifted.path());
  size_t i = 0;
  for (const auto& v : ds.eval_videos)
    for (const auto& c : v.captions) {
      ASSERT_LT(i, ds.eval_clips.size());
      const auto& clip = ds.eval_clips[i++];
      EXPECT_EQ(clip.video_id, v.id);
      EXPECT_EQ(clip.sentence, c.text);
      EXPECT_EQ(clip.start, c.start);
      EXPECT_EQ(clip.end, c.end);
    }
  EXPECT_EQ(i, ds.eval_clips.size());
}

TEST(GenerateData, DefaultOptionsLoad) {
  TempDir dir;
  GenOptions g;
  g.out = dir.path();
  generateData(g);
  const Dataset ds = Dataset::load(dir.path());
  EXPECT_EQ(ds.videos.size(), static_cast<size_t>(GenOptions().videos));
  EXPECT_EQ(ds.eval_videos.size(), 60u);
  EXPECT_EQ(ds.feature_dim, 64);
  EXPECT_EQ(ds.wordDim(), 48);
  EXPECT_EQ(ds.vocab.size(), 24u * 4 + 40);
  EXPECT_GT(ds.eval_clips.size(), 60u * 6 - 1);
}

TEST(GenerateData, BadOptionsAreNamed) {
  TempDir dir;
  auto with = [&](auto change) {
    GenOptions g = smallOptions(dir.path());
    change(g);
    return invalidMessage([&] { generateData(g); });
  };
  EXPECT_NE(with([](GenOptions& g) { g.out = ""; }).find("out"), std::string::npos);
  EXPECT_NE(with([](GenOptions& g) { g.videos = 0; }).find("videos"), std::string::npos);
  EXPECT_NE(with([](GenOptions& g) { g.misalign = 1.5; }).find("misalign"), std::string::npos);
  EXPECT_NE(with([](GenOptions& g) { g.rate = 0; }).find("rate"), std::string::npos);
  EXPECT_NE(with([](GenOptions& g) { g.min_segments = 5, g.max_segments = 4; }).find("min_segments"),
            std::string::npos);
  EXPECT_NE(with([](GenOptions& g) { g.min_seg_sec = 0; }).find("min_seg_sec"), std::string::npos);
}

// ---- Python reads what we write ----

TEST_F(Generated, NumpyAndPythonCsvReadTheFiles) {
  const fs::path dir = dir_->path();
  const Dataset& ds = *ds_;
  std::ostringstream code;
  code << "import numpy as np, csv, os\n"
          "d = " << pyStr(dir.string()) << "\n"
          "def show(path):\n"
          "    a = np.load(os.path.join(d, path), allow_pickle=False)\n"
          "    assert a.dtype == np.float32 and a.flags['C_CONTIGUOUS'], (path, a.dtype)\n"
          "    print(path, ' '.join(map(str, a.shape)), repr(float(a.astype(np.float64).sum())), repr(float(a.flat[-1])))\n"
          "for p in ['word2vec.npy', 'prototypes.npy', 'features/vid_00000.npy', 'features/vid_00023.npy',"
          " 'features/eval_00005.npy']:\n"
          "    show(p)\n"
          "def rows(path):\n"
          "    with open(os.path.join(d, path), newline='') as f:\n"
          "        return list(csv.DictReader(f))\n"
          "v = rows('videos.csv'); e = rows('eval_videos.csv'); c = rows('eval.csv'); k = rows('captions/vid_00003.csv')\n"
          "print('videos', len(v), v[0]['video_id'], v[0]['feature_file'])\n"
          "print('eval_videos', len(e), e[-1]['video_id'])\n"
          "print('eval', len(c), c[0]['video_id'], float(c[0]['start']), float(c[0]['end']))\n"
          "print('eval_sentence', c[0]['sentence'])\n"
          "print('captions', len(k), float(k[1]['start']), float(k[1]['end']))\n"
          "print('caption_text', k[1]['text'])\n";
  std::istringstream out(runPython(code.str()));
  auto check = [&](const std::string& name, const at::Tensor& t) {
    std::string path, line;
    std::getline(out, line);
    std::istringstream ls(line);
    ls >> path;
    ASSERT_EQ(path, name) << line;
    std::vector<int64_t> shape(static_cast<size_t>(t.dim()));
    for (auto& s : shape) ls >> s;
    EXPECT_EQ(at::IntArrayRef(shape), t.sizes()) << name;
    double sum, last;
    ls >> sum >> last;
    EXPECT_NEAR(sum, t.to(at::kDouble).sum().item<double>(), 1e-6 * (1 + std::abs(sum))) << name;
    EXPECT_EQ(static_cast<float>(last), t.reshape(-1)[-1].item<float>()) << name;
  };
  check("word2vec.npy", ds.word_vectors);
  check("prototypes.npy", readNpy((dir / "prototypes.npy").string()));
  check("features/vid_00000.npy", ds.videos[0].features);
  check("features/vid_00023.npy", ds.videos[23].features);
  check("features/eval_00005.npy", ds.eval_videos[5].features);

  std::string line;
  std::getline(out, line);
  EXPECT_EQ(line, "videos 24 vid_00000 features/vid_00000.npy");
  std::getline(out, line);
  EXPECT_EQ(line, "eval_videos 6 eval_00005");
  std::getline(out, line);
  {
    std::istringstream ls(line);
    std::string tag, id;
    size_t n = 0;
    double s = -1, e = -1;
    ls >> tag >> n >> id >> s >> e;
    EXPECT_EQ(tag, "eval");
    EXPECT_EQ(n, ds.eval_clips.size());
    EXPECT_EQ(id, ds.eval_clips[0].video_id);
    EXPECT_EQ(s, ds.eval_clips[0].start);
    EXPECT_EQ(e, ds.eval_clips[0].end);
  }
  std::getline(out, line);
  EXPECT_EQ(line, "eval_sentence " + ds.eval_clips[0].sentence);
  std::getline(out, line);
  std::istringstream ls(line);
  std::string tag;
  size_t n;
  double s, e;
  ls >> tag >> n >> s >> e;
  EXPECT_EQ(n, ds.videos[3].captions.size());
  EXPECT_EQ(s, ds.videos[3].captions[1].start);
  EXPECT_EQ(e, ds.videos[3].captions[1].end);
  std::getline(out, line);
  EXPECT_EQ(line, "caption_text " + ds.videos[3].captions[1].text);
}

TEST(Npy, ReadsWhatNumpyWritesAndNumpyReadsWhatWeWrite) {
  TempDir dir;
  const fs::path d = dir.path();
  runPython("import numpy as np\n"
            "d = " + pyStr(d.string()) + "\n"
            "np.save(d + '/c_f4.npy', np.arange(12, dtype='<f4').reshape(3, 4) / 8)\n"
            "np.save(d + '/f_f8.npy', np.asfortranarray(np.arange(6, dtype='<f8').reshape(2, 3) - 2.5))\n"
            "np.save(d + '/i8.npy', np.array([-3, 0, 1 << 40], dtype='<i8'))\n"
            "np.save(d + '/u1.npy', np.arange(24, dtype='u1').reshape(2, 3, 4))\n"
            "np.save(d + '/scalar.npy', np.float32(1.5))\n"
            "np.save(d + '/empty.npy', np.zeros((0, 5), dtype='<f4'))\n"
            "with open(d + '/v2.npy', 'wb') as f:\n"
            "    np.lib.format.write_array(f, np.arange(4, dtype='<i4'), version=(2, 0))\n"
            "np.save(d + '/big_endian.npy', np.arange(3, dtype='>f4'))\n");
  EXPECT_TRUE(at::equal(readNpy((d / "c_f4.npy").string()), at::arange(12, at::kFloat).reshape({3, 4}) / 8));
  const at::Tensor f = readNpy((d / "f_f8.npy").string());
  EXPECT_EQ(f.scalar_type(), at::kDouble);
  EXPECT_TRUE(f.is_contiguous());
  EXPECT_TRUE(at::equal(f, at::arange(6, at::kDouble).reshape({2, 3}) - 2.5)) << f;
  EXPECT_TRUE(at::equal(readNpy((d / "i8.npy").string()), at::tensor({-3L, 0L, 1L << 40}, at::kLong)));
  EXPECT_TRUE(at::equal(readNpy((d / "u1.npy").string()), at::arange(24, at::kByte).reshape({2, 3, 4})));
  const at::Tensor sc = readNpy((d / "scalar.npy").string());
  EXPECT_EQ(sc.dim(), 0);
  EXPECT_EQ(sc.item<float>(), 1.5f);
  EXPECT_EQ(readNpy((d / "empty.npy").string()).sizes(), (at::IntArrayRef{0, 5}));
  EXPECT_TRUE(at::equal(readNpy((d / "v2.npy").string()), at::arange(4, at::kInt)));
  EXPECT_NE(invalidMessage([&] { readNpy((d / "big_endian.npy").string()); }).find("big_endian.npy"),
            std::string::npos);

  writeNpy((d / "w_f4.npy").string(), at::arange(6, at::kFloat).reshape({2, 3}) * 0.25);
  writeNpy((d / "w_i8.npy").string(), at::tensor({5L, -7L}, at::kLong));
  writeNpy((d / "w_f8_1d.npy").string(), at::tensor({0.1, 0.2, 0.3}, at::kDouble));
  writeNpy((d / "w_u1_3d.npy").string(), at::arange(8, at::kByte).reshape({2, 2, 2}));
  writeNpy((d / "w_noncontig.npy").string(), at::arange(6, at::kFloat).reshape({2, 3}).t());
  const std::string out = runPython(
      "import numpy as np\n"
      "d = " + pyStr(d.string()) + "\n"
      "for n in ['w_f4', 'w_i8', 'w_f8_1d', 'w_u1_3d', 'w_noncontig']:\n"
      "    with open(d + '/' + n + '.npy', 'rb') as f:\n"
      "        raw = f.read()\n"
      "    hl = raw[8] | raw[9] << 8\n"
      "    assert raw[6:8] == b'\\x01\\x00' and (10 + hl) % 64 == 0, n\n"
      "    a = np.load(d + '/' + n + '.npy')\n"
      "    print(n, a.dtype.str, a.shape, a.ravel().tolist())\n");
  EXPECT_EQ(out,
            "w_f4 <f4 (2, 3) [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]\n"
            "w_i8 <i8 (2,) [5, -7]\n"
            "w_f8_1d <f8 (3,) [0.1, 0.2, 0.3]\n"
            "w_u1_3d |u1 (2, 2, 2) [0, 1, 2, 3, 4, 5, 6, 7]\n"
            "w_noncontig <f4 (3, 2) [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]\n");
  // Round trip in C++ too.
  EXPECT_TRUE(at::equal(readNpy((d / "w_noncontig.npy").string()), at::arange(6, at::kFloat).reshape({2, 3}).t()));
}

TEST(Npy, BadFilesNameTheFile) {
  TempDir dir;
  const fs::path d = dir.path();
  writeNpy((d / "good.npy").string(), at::ones({4, 3}));
  const std::string good = slurp(d / "good.npy");
  spit(d / "magic.npy", "XNUMPY" + good.substr(6));
  spit(d / "truncated.npy", good.substr(0, good.size() - 4));
  spit(d / "short.npy", good.substr(0, 9));
  std::string bad_dtype = good;
  bad_dtype.replace(bad_dtype.find("<f4"), 3, "<c8");
  spit(d / "dtype.npy", bad_dtype);
  std::string bad_shape = good;
  bad_shape.replace(bad_shape.find("(4, 3)"), 6, "(4, x)");
  spit(d / "shape.npy", bad_shape);
  for (const char* name : {"magic.npy", "truncated.npy", "short.npy", "dtype.npy", "shape.npy", "missing.npy"}) {
    const std::string msg = invalidMessage([&] { readNpy((d / name).string()); });
    EXPECT_NE(msg.find((d / name).string()), std::string::npos) << msg;
  }
  EXPECT_NE(invalidMessage([&] { readNpy((d / "dtype.npy").string()); }).find("<c8"), std::string::npos);
}

// ---- CSV ----

TEST(Csv, RoundTripWithPythonCsv) {
  TempDir dir;
  const fs::path d = dir.path();
  const std::vector<std::vector<std::string>> rows = {
      {"plain", "a,b", "say \"hi\""}, {"two\nlines", "", " spaced "}, {"crlf\r\nhere", "'apos'", "\"\""}};
  writeCsv((d / "ours.csv").string(), {"x", "y", "z"}, rows);
  const std::string out = runPython("import csv, json\n"
                                    "with open(" + pyStr((d / "ours.csv").string()) + ", newline='') as f:\n"
                                    "    print(json.dumps(list(csv.reader(f))))\n"
                                    "with open(" + pyStr((d / "theirs.csv").string()) + ", 'w', newline='') as f:\n"
                                    "    w = csv.writer(f)\n"  // \r\n line ends, minimal quoting
                                    "    w.writerow(['start', 'end', 'text'])\n"
                                    "    w.writerow(['1.5', '2', 'a, \"quoted\" text'])\n"
                                    "    w.writerow(['3', '4', 'multi\\nline'])\n"
                                    "    w.writerow(['5', '6', ''])\n");
  auto expected = nlohmann::json::array();
  expected.push_back({"x", "y", "z"});
  for (const auto& r : rows) expected.push_back(r);
  EXPECT_EQ(nlohmann::json::parse(out), expected);

  const CsvTable t = readCsv((d / "theirs.csv").string());
  EXPECT_EQ(t.header, (std::vector<std::string>{"start", "end", "text"}));
  ASSERT_EQ(t.rows.size(), 3u);
  EXPECT_EQ(t.rows[0][2], "a, \"quoted\" text");
  EXPECT_EQ(t.rows[1][2], "multi\nline");
  EXPECT_EQ(t.rows[2][2], "");
  EXPECT_EQ(t.lines, (std::vector<int64_t>{2, 3, 5})) << "a row's line is where it starts";
  EXPECT_EQ(t.column("text"), 2u);

  const CsvTable back = readCsv((d / "ours.csv").string());
  EXPECT_EQ(back.rows, rows);
}

TEST(Csv, MalformedFilesNameFileAndLine) {
  TempDir dir;
  const fs::path d = dir.path();
  auto msg = [&](const std::string& name, const std::string& content) {
    spit(d / name, content);
    return invalidMessage([&] { readCsv((d / name).string()); });
  };
  std::string m = msg("unterminated.csv", "a,b\n1,2\n3,\"open\n4,5\n");
  EXPECT_NE(m.find("unterminated.csv:3"), std::string::npos) << m;
  EXPECT_NE(m.find("unterminated"), std::string::npos) << m;
  m = msg("count.csv", "a,b\n1,2\n\n1,2,3\n");
  EXPECT_NE(m.find("count.csv:4"), std::string::npos) << m;
  EXPECT_NE(m.find("3 fields, expected 2"), std::string::npos) << m;
  m = msg("after.csv", "a,b\n\"x\"y,2\n");
  EXPECT_NE(m.find("after.csv:2"), std::string::npos) << m;
  m = msg("empty.csv", "\n\n");
  EXPECT_NE(m.find("empty.csv"), std::string::npos) << m;
  m = invalidMessage([&] { readCsv((d / "nope.csv").string()); });
  EXPECT_NE(m.find("nope.csv"), std::string::npos) << m;
  spit(d / "ok.csv", "a,b\r\n1,2\r\n");
  m = invalidMessage([&] { readCsv((d / "ok.csv").string()).column("c"); });
  EXPECT_NE(m.find("ok.csv"), std::string::npos) << m;
  EXPECT_NE(m.find("'c'"), std::string::npos) << m;
}

// ---- text ----

TEST(Text, SplitWordsMatchesPythonRegex) {
  const std::vector<std::string> texts = {
      "Let's CUT the onion, don't we?", "  spaces\tand\ttabs  ", "under_score 42nd x2 ...", "'quoted' words''",
      "a-b c/d e.f(g)", "", "!!!", "it's  it''s 'tis", "CamelCase MIXED lower", "end'"};
  std::ostringstream code;
  code << "import re, json\n";
  for (const auto& t : texts) code << "print(json.dumps(re.findall(r\"[\\w']+\", " << pyStr(t) << ".lower())))\n";
  std::istringstream out(runPython(code.str()));
  for (const auto& t : texts) {
    std::string line;
    std::getline(out, line);
    EXPECT_EQ(nlohmann::json(splitWords(t)), nlohmann::json::parse(line)) << t;
  }
}

TEST(Text, TokenizeDropsUnknownWordsThenPadsOrCuts) {
  const std::unordered_map<std::string, int64_t> vocab = {{"cut", 1}, {"the", 2}, {"onion", 3}, {"let's", 4}};
  EXPECT_EQ(tokenize("Let's cut THE onion!", vocab, 6), (std::vector<int64_t>{4, 1, 2, 3, 0, 0}));
  EXPECT_EQ(tokenize("cut a big onion", vocab, 4), (std::vector<int64_t>{1, 3, 0, 0})) << "unknown words dropped";
  EXPECT_EQ(tokenize("the the the the the", vocab, 3), (std::vector<int64_t>{2, 2, 2})) << "cut to max_words";
  EXPECT_EQ(tokenize("nothing known", vocab, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(tokenize("lets cut", vocab, 2), (std::vector<int64_t>{1, 0})) << "apostrophes matter";
  EXPECT_NE(invalidMessage([&] { tokenize("x", vocab, 0); }).find("max_words"), std::string::npos);
}

// ---- _find_nearest_candidates ----

std::vector<Caption> captionsFrom(const std::vector<std::pair<double, double>>& spans) {
  std::vector<Caption> caps;
  for (auto [s, e] : spans) caps.push_back({s, e, ""});
  return caps;
}

TEST(FindNearestCandidates, HandComputedWindows) {
  const auto even = captionsFrom({{0, 2}, {2, 4}, {4, 6}, {6, 8}, {8, 10}});
  EXPECT_EQ(findNearestCandidates(even, 2, 1), 2);
  EXPECT_EQ(findNearestCandidates(even, 2, 3), 2) << "ties grow to the right: 2,3,4";
  EXPECT_EQ(findNearestCandidates(even, 0, 3), 0);
  EXPECT_EQ(findNearestCandidates(even, 4, 3), 2) << "at the end: shift left";
  EXPECT_EQ(findNearestCandidates(even, 3, 5), 0);
  EXPECT_EQ(findNearestCandidates(even, 1, 4), 1) << "ties: 1,2,3,4";
  const auto gaps = captionsFrom({{0, 1}, {1, 2}, {10, 11}, {11, 12}});
  const auto cluster = captionsFrom({{0, 1}, {1, 2}, {2, 3}, {10, 11}, {11, 12}});
  EXPECT_EQ(findNearestCandidates(cluster, 2, 4), 0) << "grows left to caption 0, then returns 0: 0,1,2,3";
  EXPECT_EQ(findNearestCandidates(cluster, 2, 2), 1);
  EXPECT_EQ(findNearestCandidates(gaps, 1, 2), 0) << "the left neighbour is nearer";
  EXPECT_EQ(findNearestCandidates(gaps, 2, 2), 2) << "the right neighbour is nearer";
  const auto two = captionsFrom({{0, 1}, {1, 2}});
  EXPECT_EQ(findNearestCandidates(two, 1, 4), -2) << "fewer captions than K: negative, clamped by the caller";
  EXPECT_EQ(findNearestCandidates(captionsFrom({{3, 5}}), 0, 4), 0);
  EXPECT_NE(invalidMessage([&] { findNearestCandidates(two, 2, 2); }).find("out of range"), std::string::npos);
}

TEST(FindNearestCandidates, MatchesAPythonPortOfTheReference) {
  // The reference's function (video_loader.py, HT100M_DataLoader._find_nearest_candidates) over lists.
  std::ostringstream code;
  code << "def fnc(cap, ind, K):\n"
          "    start, end = ind, ind\n"
          "    n_candidate = 1\n"
          "    while n_candidate < K:\n"
          "        if start == 0:\n"
          "            return 0\n"
          "        elif end == len(cap['end']) - 1:\n"
          "            return start - (K - n_candidate)\n"
          "        elif cap['end'][end] - cap['start'][start - 1] < cap['end'][end + 1] - cap['start'][start]:\n"
          "            start -= 1\n"
          "        else:\n"
          "            end += 1\n"
          "        n_candidate += 1\n"
          "    return start\n"
          "cases = []\n";
  std::mt19937_64 rng(11);
  std::vector<std::vector<Caption>> cases;
  for (int c = 0; c < 60; ++c) {
    const int len = 1 + static_cast<int>(rng() % 9);
    std::vector<Caption> caps;
    int64_t t = static_cast<int64_t>(rng() % 3) * 100;  // hundredths of a second
    std::string starts, ends;
    for (int i = 0; i < len; ++i) {
      int64_t dur = 50 + static_cast<int64_t>(rng() % 900), gap = static_cast<int64_t>(rng() % 700) - 100;
      if (c % 2) dur = dur / 100 * 100 + 100, gap = gap / 100 * 100;  // whole seconds: ties happen
      caps.push_back({static_cast<double>(t) / 100, static_cast<double>(t + dur) / 100, ""});
      starts += fmt::format("{:.2f},", caps.back().start);
      ends += fmt::format("{:.2f},", caps.back().end);
      t = std::max<int64_t>(t + dur + gap, t + 1);
    }
    code << "cases.append({'start': [" << starts << "], 'end': [" << ends << "]})\n";
    cases.push_back(std::move(caps));
  }
  code << "for cap in cases:\n"
          "    print(' '.join(str(fnc(cap, i, K)) for K in range(1, 7) for i in range(len(cap['end']))))\n";
  std::istringstream out(runPython(code.str()));
  for (size_t c = 0; c < cases.size(); ++c) {
    std::string line;
    std::getline(out, line);
    std::istringstream ls(line);
    for (int K = 1; K <= 6; ++K)
      for (int64_t i = 0; i < static_cast<int64_t>(cases[c].size()); ++i) {
        int64_t want = -999;
        ls >> want;
        EXPECT_EQ(findNearestCandidates(cases[c], i, K), want) << "case " << c << " ind " << i << " K " << K;
      }
  }
}

// ---- sample(), makeBatch(), eval windows on a hand-made dataset ----

// Writes a dataset whose feature rows hold their own row index (every column) and whose captions are the
// single words "c<k>" (k = caption index in its video), so a sample says which rows and captions it took.
struct Tiny {
  std::vector<std::vector<std::pair<double, double>>> train, eval;
  std::vector<int64_t> train_rows, eval_rows;
};
void writeTiny(const fs::path& d, const Tiny& t, double rate = 2.0, int64_t F = 3) {
  fs::create_directories(d / "features");
  fs::create_directories(d / "captions");
  spit(d / "meta.json", fmt::format("{{\"rate\": {}, \"feature_dim\": {}}}", rate, F));
  size_t max_caps = 0;
  for (const auto& v : t.train) max_caps = std::max(max_caps, v.size());
  for (const auto& v : t.eval) max_caps = std::max(max_caps, v.size());
  std::string vocab;
  for (size_t k = 0; k < max_caps; ++k) vocab += fmt::format("c{}\n", k);
  spit(d / "vocab.txt", vocab);
  writeNpy((d / "word2vec.npy").string(), at::zeros({static_cast<int64_t>(max_caps) + 1, 2}));
  auto write = [&](const std::string& prefix, const auto& videos, const auto& rows, const std::string& list,
                   std::vector<std::vector<std::string>>* eval_rows) {
    std::vector<std::vector<std::string>> entries;
    for (size_t i = 0; i < videos.size(); ++i) {
      const std::string id = prefix + std::to_string(i);
      writeNpy((d / "features" / (id + ".npy")).string(),
               at::arange(rows[i], at::kFloat).unsqueeze(1).repeat({1, F}).contiguous());
      std::vector<std::vector<std::string>> caps;
      for (size_t k = 0; k < videos[i].size(); ++k) {
        caps.push_back({fmt::format("{}", videos[i][k].first), fmt::format("{}", videos[i][k].second),
                        fmt::format("C{} unknown", k)});
        if (eval_rows)
          eval_rows->push_back({id, caps.back()[0], caps.back()[1], fmt::format("and then c{}", k)});
      }
      writeCsv((d / "captions" / (id + ".csv")).string(), {"start", "end", "text"}, caps);
      entries.push_back({id, "features/" + id + ".npy"});
    }
    writeCsv((d / list).string(), {"video_id", "feature_file"}, entries);
  };
  std::vector<std::vector<std::string>> eval_rows;
  write("t", t.train, t.train_rows, "videos.csv", nullptr);
  write("e", t.eval, t.eval_rows, "eval_videos.csv", &eval_rows);
  writeCsv((d / "eval.csv").string(), {"video_id", "start", "end", "sentence"}, eval_rows);
}

Tiny tinySpec() {
  Tiny t;
  // 0: regular captions, some shorter than min_time; 1: fewer captions than K; 2: shorter than a clip;
  // 3: a caption at the very end (the widened span runs past the video).
  t.train = {{{0, 2}, {2.5, 9}, {9.2, 10}, {11, 13.5}, {14, 20}, {20.5, 21}, {22, 30}},
             {{1, 3}, {4, 6}},
             {{0, 1}},
             {{0, 5}, {5, 9.5}, {9.5, 10}}};
  t.train_rows = {62, 14, 5, 20};
  t.eval = {{{0, 2}, {3, 11}, {12, 12.5}}, {{0.5, 1.5}}};
  t.eval_rows = {30, 3};
  return t;
}

TEST(Sample, FollowsTheReferenceOnAHandMadeDataset) {
  TempDir dir;
  const Tiny spec = tinySpec();
  writeTiny(dir.path(), spec);
  const Dataset ds = Dataset::load(dir.path());
  ASSERT_EQ(ds.videos.size(), 4u);
  for (bool whole : {true, false})
    for (int K : {1, 3, 4}) {
      LoaderOptions lo;
      lo.num_candidates = K;
      lo.max_words = 3;
      lo.clip_steps = 6;
      lo.min_time = 4.0;
      lo.whole_seconds = whole;
      std::mt19937_64 rng(5);
      std::map<std::pair<size_t, int64_t>, int> seen;  // (video, caption index) draws
      for (int iter = 0; iter < 400; ++iter) {
        const size_t vi = static_cast<size_t>(iter % 4);
        SCOPED_TRACE(::testing::Message() << "whole=" << whole << " K=" << K << " video " << vi << " iter " << iter);
        SampleTrace tr;
        const Sample s = sample(ds, vi, lo, rng, &tr);
        const auto& caps = ds.videos[vi].captions;
        const int64_t n = static_cast<int64_t>(caps.size()), rows = ds.videos[vi].features.size(0);
        ASSERT_EQ(s.video.sizes(), (at::IntArrayRef{6, 3}));
        ASSERT_EQ(s.text.sizes(), (at::IntArrayRef{K, 3}));
        ASSERT_EQ(s.text.scalar_type(), at::kLong);
        ASSERT_GE(tr.caption_index, 0);
        ASSERT_LT(tr.caption_index, n);
        ++seen[{vi, tr.caption_index}];

        // Text: candidate i is caption clamp(start + i); its single known word is c<k> (id k + 1).
        EXPECT_EQ(tr.candidate_start, K > 1 ? findNearestCandidates(caps, tr.caption_index, K) : tr.caption_index);
        for (int i = 0; i < K; ++i) {
          const int64_t k = std::clamp<int64_t>(tr.candidate_start + i, 0, n - 1);
          EXPECT_EQ(s.text[i][0].item<int64_t>(), k + 1);
          EXPECT_EQ(s.text[i][1].item<int64_t>(), 0) << "unknown word dropped, then padding";
        }
        if (n >= K) {
          EXPECT_GE(tr.caption_index, tr.candidate_start);
          EXPECT_LT(tr.caption_index, tr.candidate_start + K) << "the caption is among its candidates";
        }

        // Span: the caption's, widened to min_time, truncated to whole seconds.
        double start = caps[static_cast<size_t>(tr.caption_index)].start;
        double end = caps[static_cast<size_t>(tr.caption_index)].end;
        if (end - start < 4.0) {
          const double diff = 4.0 - (end - start);
          start = std::max(0.0, start - diff / 2);
          end = start + 4.0;
        }
        EXPECT_GE(end - start, 4.0 - 1e-9);
        if (whole) {
          EXPECT_EQ(tr.start, std::trunc(start));
          EXPECT_EQ(tr.end, std::trunc(end));
          EXPECT_EQ(tr.seek, std::trunc(tr.seek)) << "randint seek";
          start = std::trunc(start), end = std::trunc(end);
        } else {
          EXPECT_DOUBLE_EQ(tr.start, start);
          EXPECT_DOUBLE_EQ(tr.end, end);
        }
        const double clip_sec = 6 / 2.0;
        EXPECT_GE(tr.seek, start);
        EXPECT_LE(tr.seek, std::max(start, end - clip_sec) + 1e-9);
        // Rows: from round(seek * rate), shifted back into the video if needed.
        const int64_t want_first =
            std::min<int64_t>(static_cast<int64_t>(std::nearbyint(tr.seek * 2)), std::max<int64_t>(0, rows - 6));
        EXPECT_EQ(tr.first_row, want_first);
        for (int i = 0; i < 6; ++i)
          EXPECT_EQ(s.video[i][0].item<float>(), static_cast<float>(std::min<int64_t>(want_first + i, rows - 1)));
        // Inside the widened span unless the video ends first.
        // (a continuous seek rounds to the nearest row: up to a quarter second either way at rate 2).
        if (want_first == static_cast<int64_t>(std::nearbyint(tr.seek * 2))) {
          const double slack = whole ? 1e-9 : 0.25 + 1e-9;
          EXPECT_GE(tr.first_row / 2.0, start - slack);
          if (end - start >= clip_sec) {
            EXPECT_LE((tr.first_row + 6) / 2.0, end + slack);
          }
        }
      }
      // Every caption gets drawn.
      for (size_t vi = 0; vi < 4; ++vi)
        for (int64_t k = 0; k < static_cast<int64_t>(ds.videos[vi].captions.size()); ++k)
          EXPECT_GT((seen[{vi, k}]), 0) << "video " << vi << " caption " << k;
    }
}

TEST(Sample, ShortVideoRepeatsItsLastRowAndFewCaptionsRepeatTheLast) {
  TempDir dir;
  writeTiny(dir.path(), tinySpec());
  const Dataset ds = Dataset::load(dir.path());
  LoaderOptions lo;
  lo.clip_steps = 8;
  lo.num_candidates = 4;
  std::mt19937_64 rng(1);
  const Sample s = sample(ds, 2, lo, rng);  // 5 rows, one caption
  EXPECT_TRUE(at::equal(s.video.select(1, 0), at::tensor({0.f, 1.f, 2.f, 3.f, 4.f, 4.f, 4.f, 4.f})));
  EXPECT_TRUE(at::equal(s.text.select(1, 0), at::tensor({1L, 1L, 1L, 1L})));
  const Sample s1 = sample(ds, 1, lo, rng);  // two captions, K = 4: 0, 0, 0, 1 or 0, 1, 1, 1
  const auto first = s1.text.select(1, 0);
  EXPECT_TRUE(at::equal(first, at::tensor({1L, 1L, 1L, 2L})) || at::equal(first, at::tensor({1L, 2L, 2L, 2L})))
      << first;
  EXPECT_NE(invalidMessage([&] { sample(ds, 4, lo, rng); }).find("out of range"), std::string::npos);
  lo.clip_steps = 0;
  EXPECT_NE(invalidMessage([&] { sample(ds, 0, lo, rng); }).find("clip_steps"), std::string::npos);
}

TEST_F(Generated, MakeBatchShapesAndDeterminism) {
  LoaderOptions lo;
  const std::vector<int64_t> idx = {0, 5, 5, 23, 7};
  std::mt19937_64 a(3), b(3), c(4);
  const Batch x = makeBatch(*ds_, idx, lo, a), y = makeBatch(*ds_, idx, lo, b), z = makeBatch(*ds_, idx, lo, c);
  EXPECT_EQ(x.video.sizes(), (at::IntArrayRef{5, 8, 32}));
  EXPECT_EQ(x.text.sizes(), (at::IntArrayRef{5, 4, 12}));
  EXPECT_EQ(x.video.scalar_type(), at::kFloat);
  EXPECT_EQ(x.text.scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(x.video, y.video));
  EXPECT_TRUE(at::equal(x.text, y.text));
  EXPECT_FALSE(at::equal(x.video, z.video) && at::equal(x.text, z.text));
  // Every candidate has words (generated captions have 4-7 known words, max_words = 12).
  EXPECT_TRUE((x.text.select(2, 0) > 0).all().item<bool>());
  // Batch rows are what sample() gives with the same stream.
  std::mt19937_64 d(3);
  for (size_t i = 0; i < idx.size(); ++i) {
    const Sample s = sample(*ds_, static_cast<size_t>(idx[i]), lo, d);
    EXPECT_TRUE(at::equal(s.video, x.video[static_cast<int64_t>(i)]));
    EXPECT_TRUE(at::equal(s.text, x.text[static_cast<int64_t>(i)]));
  }
  EXPECT_EQ(makeBatch(*ds_, {}, lo, a).video.sizes(), (at::IntArrayRef{0, 8, 32}));
  EXPECT_NE(invalidMessage([&] { makeBatch(*ds_, {24}, lo, a); }).find("out of range"), std::string::npos);
}

TEST(Eval, WindowsAreEvenlySpacedOverTheWidenedClip) {
  TempDir dir;
  writeTiny(dir.path(), tinySpec());
  const Dataset ds = Dataset::load(dir.path());
  ASSERT_EQ(ds.eval_clips.size(), 4u);
  LoaderOptions lo;
  lo.clip_steps = 4;  // 2 s
  lo.min_time = 4.0;
  // Clip 1 spans [3, 11]: starts linspace(3, 9, 4) = 3, 5, 7, 9 s -> rows 6, 10, 14, 18.
  at::Tensor w = evalClipWindows(ds, ds.eval_clips[1], 4, lo);
  ASSERT_EQ(w.sizes(), (at::IntArrayRef{4, 4, 3}));
  EXPECT_TRUE(at::equal(w.select(2, 0).select(1, 0), at::tensor({6.f, 10.f, 14.f, 18.f})));
  EXPECT_TRUE(at::equal(w[2].select(1, 0), at::tensor({14.f, 15.f, 16.f, 17.f})));
  // Clip 2 [12, 12.5] widens to [10.25, 14.25]: starts linspace(10.25, 12.25, 3) = 10.25, 11.25, 12.25 s
  // -> rows round(20.5)=20, round(22.5)=22, round(24.5)=24, the last clamped to 30 - 4 = 26 (no clamp here).
  w = evalClipWindows(ds, ds.eval_clips[2], 3, lo);
  EXPECT_TRUE(at::equal(w.select(2, 0).select(1, 0), at::tensor({20.f, 22.f, 24.f})));
  // One window: the start of the span. A 3-row video repeats its last row.
  w = evalClipWindows(ds, ds.eval_clips[3], 1, lo);
  EXPECT_TRUE(at::equal(w.select(2, 0)[0], at::tensor({0.f, 1.f, 2.f, 2.f})));

  const at::Tensor all = evalVideoWindows(ds, 2, lo);
  ASSERT_EQ(all.sizes(), (at::IntArrayRef{4, 2, 4, 3}));
  for (int64_t i = 0; i < 4; ++i)
    EXPECT_TRUE(at::equal(all[i], evalClipWindows(ds, ds.eval_clips[static_cast<size_t>(i)], 2, lo)));

  const at::Tensor texts = evalTexts(ds, 5);
  ASSERT_EQ(texts.sizes(), (at::IntArrayRef{4, 5}));
  EXPECT_TRUE(at::equal(texts[1], at::tensor({2L, 0L, 0L, 0L, 0L}))) << "\"and then c1\": only c1 is known";
  for (int64_t i = 0; i < 4; ++i)
    EXPECT_TRUE(at::equal(texts[i], evalText(ds, ds.eval_clips[static_cast<size_t>(i)], 5)));
  EXPECT_NE(invalidMessage([&] { evalClipWindows(ds, ds.eval_clips[0], 0, lo); }).find("windows"),
            std::string::npos);
}

// ---- malformed datasets ----

TEST(Load, MalformedDatasetsNameTheFile) {
  TempDir base;
  generateData(smallOptions(base.path()));
  // Each case: a fresh copy, one change, and what the message must contain.
  auto broken = [&](const std::function<void(const fs::path&)>& change) {
    TempDir copy;
    fs::copy(base.path(), copy.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    change(copy.path());
    std::string msg = invalidMessage([&] { Dataset::load(copy.path()); });
    const std::string prefix = copy.path() + "/";
    for (size_t at; (at = msg.find(prefix)) != std::string::npos;) msg.replace(at, prefix.size(), "DIR/");
    return msg;
  };
  auto expectHas = [](const std::string& msg, const std::string& what) {
    EXPECT_NE(msg.find(what), std::string::npos) << "want '" << what << "' in: " << msg;
  };
  expectHas(broken([](const fs::path& d) { fs::remove(d / "videos.csv"); }), "DIR/videos.csv");
  expectHas(broken([](const fs::path& d) { fs::remove(d / "meta.json"); }), "DIR/meta.json");
  expectHas(broken([](const fs::path& d) { spit(d / "meta.json", "{\"rate\": "); }), "DIR/meta.json");
  expectHas(broken([](const fs::path& d) { spit(d / "meta.json", "{\"rate\": 2}"); }), "feature_dim");
  expectHas(broken([](const fs::path& d) { fs::remove(d / "captions/vid_00004.csv"); }), "DIR/captions/vid_00004.csv");
  expectHas(broken([](const fs::path& d) { fs::remove(d / "features/eval_00001.npy"); }),
            "DIR/features/eval_00001.npy");
  expectHas(broken([](const fs::path& d) {
              std::string s = slurp(d / "features/vid_00002.npy");
              s[1] = 'X';
              spit(d / "features/vid_00002.npy", s);
            }),
            "DIR/features/vid_00002.npy: not a .npy file");
  expectHas(broken([](const fs::path& d) { writeNpy((d / "features/vid_00002.npy").string(), at::zeros({5, 7})); }),
            "DIR/features/vid_00002.npy: features must be [T >= 1, 32]");
  expectHas(broken([](const fs::path& d) {
              spit(d / "captions/vid_00003.csv", slurp(d / "captions/vid_00003.csv") + "1.0,2.0,\"open\n");
            }),
            "DIR/captions/vid_00003.csv:");
  expectHas(broken([](const fs::path& d) { spit(d / "captions/vid_00003.csv", "start,end,text\n1,x,a\n"); }),
            "DIR/captions/vid_00003.csv:2: column 'end': 'x' is not a number");
  expectHas(broken([](const fs::path& d) { spit(d / "captions/vid_00003.csv", "start,end,text\n3,2,a\n"); }),
            "DIR/captions/vid_00003.csv:2");
  expectHas(broken([](const fs::path& d) { spit(d / "captions/vid_00003.csv", "start,end,text\n"); }),
            "DIR/captions/vid_00003.csv: no captions");
  expectHas(broken([](const fs::path& d) { spit(d / "captions/vid_00003.csv", "start,finish,text\n1,2,a\n"); }),
            "no column 'end'");
  expectHas(broken([](const fs::path& d) { spit(d / "vocab.txt", slurp(d / "vocab.txt") + "extra\n"); }),
            "DIR/word2vec.npy");
  expectHas(broken([](const fs::path& d) { spit(d / "vocab.txt", "the\nthe\n"); }), "DIR/vocab.txt:2: duplicate");
  expectHas(broken([](const fs::path& d) {
              spit(d / "eval.csv", slurp(d / "eval.csv") + "vid_00000,1.0,2.0,a train video\n");
            }),
            "DIR/eval.csv:");
  expectHas(broken([](const fs::path& d) {
              spit(d / "videos.csv", slurp(d / "videos.csv") + "vid_00001,features/vid_00001.npy\n");
            }),
            "DIR/videos.csv:26: duplicate video_id");
  expectHas(broken([](const fs::path& d) {
              spit(d / "videos.csv", slurp(d / "videos.csv") + "../x,features/vid_00001.npy\n");
            }),
            "bad video_id");
}

}  // namespace
}  // namespace milnce
