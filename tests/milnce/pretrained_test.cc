// Starting from the HowTo100M reference's trained model (apps/milnce/pretrained.h): a full-width S3D-G
// state_dict and a '<U' word dictionary saved by the PyTorch port (tests/milnce/s3dg_reference.py), as
// the real s3d_howto100m.pth and s3d_dict.npy are. `milnce embed` gives PyTorch's embeddings on the same
// clips and sentences; `milnce train --init` starts from the very model `milnce eval --weights` evaluates;
// a file or dictionary that does not fit is refused by name.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <nlohmann/json.hpp>

#include "dtrain/comm/error.h"
#include "harness.h"
#include "milnce/data.h"
#include "milnce/pretrained.h"

namespace {

using dtrain::test::errorOf;
using dtrain::test::runCommand;
using dtrain::test::TempDir;

const std::string kMilnce = DTRAIN_BIN_DIR "/milnce";

// A small raw video data set, and the reference's model at full width (S3D-G width 1, 512-d, the text
// module 300 -> 2048 -> 512) over its vocabulary: dir/data, dir/ref/{state_dict.pt, dict.npy}.
void prepare(const std::string& dir) {
  milnce::GenOptions g;
  g.out = dir + "/data";
  g.video = true;
  g.video_size = 32;
  g.videos = 4;
  g.eval_videos = 2;
  g.concepts = 4;
  g.min_segments = 3;
  g.max_segments = 3;
  g.word_dim = 300;  // the reference's: its word_embd then has the data set's vocabulary's shape
  milnce::generateData(g);
  auto [rc, out] = runCommand(fmt::format("{} {}/tests/milnce/s3dg_reference.py {}/ref --width 1.0 --frames 8 "
                                          "--size 32 --dict-words {}/data/vocab.txt",
                                          dtrain::test::pythonPath(), DTRAIN_SOURCE_DIR, dir, dir),
                              240);
  ASSERT_EQ(rc, 0) << out;
}

double field(const std::string& line, const std::string& name) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(line, m, std::regex(name + "=([-0-9.e+]+)"))) << name << " in " << line;
  return m.empty() ? -1 : std::stod(m[1]);
}

TEST(Pretrained, EmbedEqualsPyTorchOnTheSameClipsAndSentences) {
  TempDir dir;
  prepare(dir.path());
  const std::string ref = dir.path() + "/ref";
  const std::string common = fmt::format("{} embed --weights {}/state_dict.pt --dict {}/dict.npy", kMilnce, ref, ref);
  auto [rc, out] = runCommand(fmt::format("env OMP_NUM_THREADS=1 {} --videos {}/data/videos --frames 8 --size 32 "
                                          "--batch 4 --out {}/v.npy --clips-out {}/clips.npy 2>&1",
                                          common, dir.path(), ref, ref),
                              240);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("wrote " + ref + "/v.npy ([6, 512] float32) and " + ref + "/v.txt"), std::string::npos) << out;
  // Words of the data set's vocabulary, an unknown word (dropped) and upper case (lowered), and a sentence
  // of more than 16 words (cut), some with an apostrophe ("don't": one word to [\w']+).
  std::string words;
  {
    std::ifstream vocab(dir.path() + "/data/vocab.txt");
    for (std::string w; std::getline(vocab, w) && words.size() < 200;) words += w + " ";
  }
  auto [rc2, out2] = runCommand(fmt::format("env OMP_NUM_THREADS=1 {} --text 'Zzunknown the RED circle' --text \"{}\" "
                                            "--text 'nothing known here' --out {}/t.npy 2>&1",
                                            common, words, ref),
                                240);
  ASSERT_EQ(rc2, 0) << out2;
  std::ifstream names(ref + "/t.txt");
  std::string first;
  std::getline(names, first);
  EXPECT_EQ(first, "Zzunknown the RED circle");

  auto [rc3, line] = runCommand(fmt::format("{} {}/tests/milnce/pretrained_check.py {}/state_dict.pt {}/dict.npy "
                                            "{}/clips.npy {}/v.npy {}/t.txt {}/t.npy",
                                            dtrain::test::pythonPath(), DTRAIN_SOURCE_DIR, ref, ref, ref, ref, ref, ref),
                                240);
  ASSERT_EQ(rc3, 0) << line;
  std::printf("%s", line.c_str());  // the distances, in the test's log
  EXPECT_NE(line.find("rows=6,3"), std::string::npos) << line;
  EXPECT_LE(field(line, "video_max_abs_diff"), 1e-5) << line;
  EXPECT_LE(field(line, "text_max_abs_diff"), 1e-5) << line;
  EXPECT_GT(field(line, "video_max_abs"), 1e-3) << line;  // not a comparison of zeros
  EXPECT_GT(field(line, "text_max_abs"), 1e-3) << line;
  // The clips differ, and so do their embeddings (a model that ignores its input would pass the above).
  const at::Tensor v = milnce::readNpy(ref + "/v.npy");
  EXPECT_GT((v[0] - v[1]).abs().max().item<double>(), 1e-4);
}

// The training model (MilNceNet: "video.s3d.*", "text.*") filled from the weights computes what the
// reference's own model does (milnce::S3D with its text module, which the test above holds to PyTorch):
// uint8 frames / 255 into S3D-G, and the text encoder's max over the words with the padding's row in it.
TEST(Pretrained, TheTrainingModelFromTheWeightsIsTheReferenceModel) {
  TempDir dir;
  prepare(dir.path());
  const std::string ref = dir.path() + "/ref";
  const auto p = milnce::readPretrained(ref + "/state_dict.pt", ref + "/dict.npy");
  milnce::Dataset data = milnce::Dataset::load(dir.path() + "/data");
  milnce::ModelOptions mo;
  milnce::adoptPretrained(p, mo, data);
  milnce::MilNceNet net(data.word_vectors, mo);
  milnce::loadPretrained(net, p);
  milnce::S3D s3d(milnce::s3dOptionsOf(p));
  milnce::loadPretrained(s3d, p);
  net->eval();
  s3d->eval();
  torch::NoGradGuard no_grad;
  auto tokens = torch::zeros({3, 16}, torch::kLong);
  tokens[0].slice(0, 0, 5) = torch::arange(1, 6);
  tokens[1][0] = 7;
  tokens[2] = torch::arange(1, 17) % static_cast<int64_t>(data.words.size()) + 1;  // no padding
  const at::Tensor want_text = s3d->text_module->forward(tokens);
  EXPECT_LT((net->encodeText(tokens) - want_text).abs().max().item<double>(), 1e-6);
  auto g = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor clip = at::randint(0, 256, {2, 3, 8, 32, 32}, g, torch::kByte);
  const at::Tensor want_video = s3d->forward(clip.to(torch::kFloat) / 255.0).video_embedding;
  EXPECT_LT((net->encodeVideo(clip) - want_video).abs().max().item<double>(), 1e-6);
}

// `train --init` starts from the model `eval --weights` evaluates: the retrieval before training equals
// the weights' own, and training goes on from there.
TEST(Pretrained, TrainFromInitStartsAtTheWeightsThatEvalMeasures) {
  TempDir dir;
  prepare(dir.path());
  const std::string ref = dir.path() + "/ref", run = dir.path() + "/run";
  const std::string files = fmt::format("--weights {0}/state_dict.pt --dict {0}/dict.npy", ref);
  auto [rc, eval] = runCommand(fmt::format("env OMP_NUM_THREADS=1 {} eval --data {}/data {} --frames 8 --size 32 "
                                           "--windows 1 --progress off 2>&1", kMilnce, dir.path(), files),
                               240);
  ASSERT_EQ(rc, 0) << eval;
  auto [rc2, train] = runCommand(
      fmt::format("env OMP_NUM_THREADS=1 {} train --data {}/data --out {} --init {}/state_dict.pt --dict {}/dict.npy "
                  "--epochs 1 --batch 2 --frames 8 --size 32 --eval-windows 1 --progress off 2>&1",
                  kMilnce, dir.path(), run, ref, ref),
      280);
  ASSERT_EQ(rc2, 0) << train;
  const std::regex row(R"((weights|before training)\s+([0-9. %]+)\n)");
  std::smatch a, b;
  ASSERT_TRUE(std::regex_search(eval, a, row)) << eval;
  ASSERT_TRUE(std::regex_search(train, b, row)) << train;
  EXPECT_EQ(a[1], "weights");
  EXPECT_EQ(b[1], "before training");
  EXPECT_EQ(a[2], b[2]) << eval << "\n" << train;
  EXPECT_NE(train.find("after training (1 epochs)"), std::string::npos) << train;
  std::ifstream m(run + "/metrics.jsonl");
  std::string first;
  std::getline(m, first);
  const auto config = nlohmann::json::parse(first)["config"];
  EXPECT_EQ(config["init"], ref + "/state_dict.pt");
  EXPECT_EQ(config["embed"], 512);
  EXPECT_EQ(config["hidden"], 2048);
  EXPECT_EQ(config["s3d_width"], 1.0);
}

TEST(Pretrained, WeightsOrADictionaryThatDoNotFitAreRefusedByName) {
  TempDir dir;
  prepare(dir.path());
  const std::string ref = dir.path() + "/ref";
  auto [rc, py] = runCommand(
      fmt::format("{0} -c \"import torch, numpy as np\n"
                  "s = torch.load('{1}/state_dict.pt')\n"
                  "m = dict(s); del m['fc.bias']; torch.save(m, '{1}/missing.pt')\n"
                  "w = dict(s); w['text_module.fc1.weight'] = torch.zeros(2048, 200); torch.save(w, '{1}/shape.pt')\n"
                  "x = dict(s); x['extra.weight'] = torch.zeros(1); torch.save(x, '{1}/extra.pt')\n"
                  "d = np.load('{1}/dict.npy'); np.save('{1}/short.npy', d[:-1])\n"
                  "np.save('{1}/objects.npy', np.array(list(d), dtype=object), allow_pickle=True)\n\"",
                  dtrain::test::pythonPath(), ref),
      120);
  ASSERT_EQ(rc, 0) << py;
  milnce::Dataset data = milnce::Dataset::load(dir.path() + "/data");
  auto load = [&](const std::string& weights, const std::string& dict) {
    milnce::ModelOptions mo;
    milnce::Dataset d = data;
    const auto p = milnce::readPretrained(weights, dict);
    milnce::adoptPretrained(p, mo, d);
    milnce::MilNceNet net(d.word_vectors, mo);
    milnce::loadPretrained(net, p);
  };
  EXPECT_EQ(errorOf([&] { load(ref + "/state_dict.pt", ref + "/dict.npy"); }), "no dtrain::Error");
  EXPECT_EQ(errorOf([&] { load(ref + "/missing.pt", ref + "/dict.npy"); }),
            ref + "/missing.pt: the model's 'video.s3d.fc.bias' ([512]) is not in the file");
  EXPECT_EQ(errorOf([&] { load(ref + "/shape.pt", ref + "/dict.npy"); }),
            ref + "/shape.pt: 'text_module.fc1.weight' is [2048, 200], the model's 'text.fc1.weight' is [2048, 300]");
  EXPECT_EQ(errorOf([&] { load(ref + "/extra.pt", ref + "/dict.npy"); }),
            ref + "/extra.pt: 'extra.weight' is not in the model (it would be 'video.s3d.extra.weight'): a state_dict "
                  "of another model or another architecture");
  const auto words = std::to_string(data.words.size() - 1);
  EXPECT_NE(errorOf([&] { load(ref + "/state_dict.pt", ref + "/short.npy"); })
                .find(ref + "/short.npy holds " + words + " words, but " + ref + "/state_dict.pt's "
                      "'text_module.word_embd.weight' is [" + std::to_string(data.words.size() + 1) + ", 300]"),
            std::string::npos);
  EXPECT_NE(errorOf([&] { load(ref + "/state_dict.pt", ref + "/objects.npy"); }).find("unsupported dtype '|O'"),
            std::string::npos);
  // Without a dictionary, the data set's vocabulary is the dictionary: here it is the one the weights
  // were made with, so they load; its word vectors are replaced by the file's.
  EXPECT_EQ(errorOf([&] { load(ref + "/state_dict.pt", ""); }), "no dtrain::Error");
  auto [rc2, cli] = runCommand(fmt::format("{} train --data {}/data --out {}/run --dict {}/dict.npy 2>&1", kMilnce,
                                           dir.path(), dir.path(), ref));
  EXPECT_EQ(rc2, 1);
  EXPECT_NE(cli.find("--dict " + ref + "/dict.npy: a dictionary goes with the weights it was trained with (--init FILE)"),
            std::string::npos) << cli;
  auto [rc3, cli3] = runCommand(fmt::format("{} embed --weights {}/state_dict.pt --text hello --out {}/t.npy 2>&1",
                                            kMilnce, ref, ref));
  EXPECT_EQ(rc3, 1);
  EXPECT_NE(cli3.find("give it with --dict"), std::string::npos) << cli3;
}

}  // namespace
