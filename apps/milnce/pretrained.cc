// Starting from the reference's trained model (see pretrained.h).
#include "milnce/pretrained.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <cstring>
#include <fstream>
#include <unordered_map>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"

namespace milnce {
using dtrain::InvalidArgument;

namespace {

constexpr const char* kWordEmbd = "text_module.word_embd.weight";

const at::Tensor& entry(const Pretrained& p, const std::string& key, int64_t dim) {
  auto it = p.state.find(key);
  if (it == p.state.end())
    throw InvalidArgument(fmt::format("{}: no '{}': not the weights of the HowTo100M reference's S3D-G "
                                      "(s3d_howto100m.pth)", p.path, key));
  if (it->second.dim() != dim)
    throw InvalidArgument(fmt::format("{}: '{}' is [{}], want a {}-d tensor", p.path, key,
                                      fmt::join(it->second.sizes(), ", "), dim));
  return it->second;
}

// A dictionary that is not a .npy: one word per line (a data set's vocab.txt).
std::vector<std::string> readWordLines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument(fmt::format("{}: cannot read the dictionary", path));
  std::vector<std::string> words;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    words.push_back(line);
  }
  return words;
}

// The model's name for the file's `key` (the reference's names; see loadPretrained).
std::string milnceName(const std::string& key) {
  static const std::pair<const char*, const char*> kText[] = {{"text_module.word_embd.", "text.words."},
                                                              {"text_module.fc1.", "text.fc1."},
                                                              {"text_module.fc2.", "text.fc2."}};
  for (const auto& [from, to] : kText)
    if (key.rfind(from, 0) == 0) return to + key.substr(std::strlen(from));
  return "video.s3d." + key;
}

// Strict copy of the file's tensors into `module`'s parameters and buffers, the file's key k going to the
// module's name(k): every check first, then the copies.
void copyByName(torch::nn::Module& module, const Pretrained& p, std::string (*name)(const std::string&)) {
  std::map<std::string, at::Tensor> targets;
  for (const auto& it : module.named_parameters(/*recurse=*/true)) targets.emplace(it.key(), it.value());
  for (const auto& it : module.named_buffers(/*recurse=*/true)) targets.emplace(it.key(), it.value());
  std::map<std::string, std::string> file_key;  // module name -> the file's key
  for (const auto& [key, t] : p.state) {
    const std::string n = name(key);
    auto it = targets.find(n);
    if (it == targets.end())
      throw InvalidArgument(fmt::format("{}: '{}' is not in the model (it would be '{}'): a state_dict of "
                                        "another model or another architecture", p.path, key, n));
    if (!it->second.sizes().equals(t.sizes()))
      throw InvalidArgument(fmt::format("{}: '{}' is [{}], the model's '{}' is [{}]", p.path, key,
                                        fmt::join(t.sizes(), ", "), n, fmt::join(it->second.sizes(), ", ")));
    file_key.emplace(n, key);
  }
  for (const auto& [n, t] : targets)
    if (!file_key.count(n))
      throw InvalidArgument(fmt::format("{}: the model's '{}' ([{}]) is not in the file", p.path, n,
                                        fmt::join(t.sizes(), ", ")));
  torch::NoGradGuard g;
  for (const auto& [n, t] : targets) t.copy_(p.state.at(file_key.at(n)));
}

std::string sameName(const std::string& key) { return key; }

}  // namespace

Pretrained readPretrained(const std::string& weights, const std::string& dict_path) {
  Pretrained p;
  p.path = weights;
  p.state = dtrain::readStateDict(weights);  // dtrain::Error naming the file
  entry(p, "conv1.conv1.weight", 5);
  entry(p, "fc.weight", 2);
  p.dict_path = dict_path;
  if (dict_path.empty()) return p;
  std::ifstream probe(dict_path, std::ios::binary);
  char magic[6] = {};
  probe.read(magic, 6);
  p.words = probe.gcount() == 6 && std::string(magic, 6) == "\x93NUMPY" ? readNpyStrings(dict_path)
                                                                         : readWordLines(dict_path);
  const auto it = p.state.find(kWordEmbd);
  if (it == p.state.end())
    throw InvalidArgument(fmt::format("{}: a dictionary was given ({}) but the weights have no text module ('{}')",
                                      weights, dict_path, kWordEmbd));
  if (it->second.dim() != 2 || it->second.size(0) != static_cast<int64_t>(p.words.size()) + 1)
    throw InvalidArgument(fmt::format("{} holds {} words, but {}'s '{}' is [{}]: its rows are the words + 1 "
                                      "(row 0 is the padding): not the dictionary these weights were trained with",
                                      dict_path, p.words.size(), weights, kWordEmbd, fmt::join(it->second.sizes(), ", ")));
  std::unordered_map<std::string, size_t> seen;
  for (size_t i = 0; i < p.words.size(); ++i)
    if (!seen.emplace(p.words[i], i).second)
      throw InvalidArgument(fmt::format("{}: word {} ('{}') repeats word {}", dict_path, i, p.words[i],
                                        seen.at(p.words[i])));
  return p;
}

S3DOptions s3dOptionsOf(const Pretrained& p) {
  S3DOptions o;
  const at::Tensor& conv1 = entry(p, "conv1.conv1.weight", 5);
  o.space_to_depth = conv1.size(1) == 24;  // [B,3,T,H,W] -> 24 channels (2x2x2 blocks) before conv1
  o.width = static_cast<double>(conv1.size(0)) / 64.0;
  if (conv1.size(0) < 4 || scaledChannels(64, o.width) != conv1.size(0))
    throw InvalidArgument(fmt::format("{}: conv1.conv1.weight is [{}]: not S3D-G's first convolution", p.path,
                                      fmt::join(conv1.sizes(), ", ")));
  o.gating = p.state.count("gating.fc.weight") > 0;
  o.num_classes = entry(p, "fc.weight", 2).size(0);
  if (p.state.count(kWordEmbd)) {
    const at::Tensor& we = entry(p, kWordEmbd, 2);
    o.num_embeddings = we.size(0);
    o.word_dim = we.size(1);
    o.text_hidden = entry(p, "text_module.fc1.weight", 2).size(0);
  }
  return o;
}

void adoptPretrained(const Pretrained& p, ModelOptions& mo, Dataset& data) {
  const S3DOptions so = s3dOptionsOf(p);
  if (!data.raw_video)
    throw InvalidArgument(fmt::format("{}: the weights are S3D-G's, over raw video; {} is a feature data set "
                                      "(milnce gen-data): use a raw video one (milnce gen-video)", p.path, data.dir));
  if (!so.space_to_depth || !so.gating)
    throw InvalidArgument(fmt::format("{}: S3D-G {} (milnce's S3D-G has both, as the reference)", p.path,
                                      !so.gating ? "without self-gating" : "without space to depth"));
  if (so.num_embeddings == 0)
    throw InvalidArgument(fmt::format("{}: the weights have no text module ('{}')", p.path, kWordEmbd));
  mo.raw_video = true;
  mo.s3d_width = so.width;
  mo.embed = so.num_classes;
  mo.hidden = so.text_hidden;
  mo.reference_text = true;
  const at::Tensor& we = p.state.at(kWordEmbd);
  if (!p.words.empty()) {
    data.words = p.words;
    data.vocab.clear();
    for (size_t i = 0; i < p.words.size(); ++i) data.vocab.emplace(p.words[i], static_cast<int64_t>(i) + 1);
    data.word_vectors = we.to(at::kFloat).contiguous();
    return;
  }
  if (!data.word_vectors.sizes().equals(we.sizes()))
    throw InvalidArgument(fmt::format("{}: '{}' is [{}], but {}'s vocabulary and word vectors are [{}]: pass the "
                                      "dictionary the weights were trained with (--dict)", p.path, kWordEmbd,
                                      fmt::join(we.sizes(), ", "), data.dir, fmt::join(data.word_vectors.sizes(), ", ")));
}

void loadPretrained(MilNceNet& model, const Pretrained& p) { copyByName(*model, p, milnceName); }

void loadPretrained(S3D& model, const Pretrained& p) { copyByName(*model, p, sameName); }

}  // namespace milnce
