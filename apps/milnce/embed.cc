// `milnce embed`: the reference model's video or sentence embeddings (see pretrained.h).
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "dtrain/comm/error.h"
#include "dtrain/device.h"
#include "milnce/pretrained.h"

namespace milnce {
using dtrain::InvalidArgument;
namespace fs = std::filesystem;

namespace {

// The video files of `dir` (by extension), sorted by name.
std::vector<fs::path> videoFiles(const std::string& dir) {
  static const char* const kExtensions[] = {".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v", ".mpg", ".mpeg", ".ogv"};
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw InvalidArgument(fmt::format("--videos {}: not a directory", dir));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::string ext = e.path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
    if (std::find(std::begin(kExtensions), std::end(kExtensions), ext) != std::end(kExtensions))
      files.push_back(e.path());
  }
  if (files.empty())
    throw InvalidArgument(fmt::format("--videos {}: no video file in it (.mp4 .webm .mkv .avi .mov .m4v .mpg .mpeg .ogv)", dir));
  std::sort(files.begin(), files.end());
  return files;
}

std::string namesPath(const std::string& out) {
  const fs::path p(out);
  return (p.extension() == ".npy" ? p.parent_path() / p.stem() : p).string() + ".txt";
}

}  // namespace

at::Tensor embed(const EmbedOptions& o) {
  if (o.videos.empty() == o.texts.empty())
    throw InvalidArgument("milnce embed: give either --videos DIR or --text SENTENCE (one or more), not both");
  if (o.out.empty()) throw InvalidArgument("milnce embed: --out FILE.npy is required");
  if (o.batch < 1 || o.max_words < 1) throw InvalidArgument("milnce embed: --batch and --max-words must be >= 1");
  const Pretrained p = readPretrained(o.weights, o.dict);
  S3D net(s3dOptionsOf(p));
  loadPretrained(net, p);
  const c10::Device device = dtrain::selectDevice(o.device);
  net->to(device);
  net->eval();
  torch::NoGradGuard no_grad;

  std::vector<std::string> names;
  at::Tensor out;
  if (!o.texts.empty()) {
    if (p.words.empty())
      throw InvalidArgument("milnce embed --text: the sentences are tokenized with the weights' word dictionary: "
                            "give it with --dict");
    if (!net->text_module) throw InvalidArgument(fmt::format("{}: the weights have no text module", p.path));
    std::unordered_map<std::string, int64_t> vocab;
    for (size_t i = 0; i < p.words.size(); ++i) vocab.emplace(p.words[i], static_cast<int64_t>(i) + 1);
    std::vector<int64_t> ids;
    for (const auto& t : o.texts) {
      const auto row = tokenize(t, vocab, o.max_words);
      ids.insert(ids.end(), row.begin(), row.end());
      names.push_back(t);
    }
    const auto tokens = torch::tensor(ids, torch::kLong).view({static_cast<int64_t>(o.texts.size()), o.max_words});
    out = net->text_module->forward(tokens.to(device)).cpu();
  } else {
    const auto files = videoFiles(o.videos);
    const int64_t n = static_cast<int64_t>(files.size()), s = o.clip.size, t = o.clip.frames;
    at::Tensor clips = torch::empty({n, 3, t, s, s}, torch::kByte);
    std::vector<at::Tensor> parts;
    for (int64_t first = 0; first < n; first += o.batch) {
      const int64_t end = std::min(n, first + o.batch);
      for (int64_t i = first; i < end; ++i) {
        const auto& file = files[static_cast<size_t>(i)];
        const auto bytes = VideoReader(file.string()).readClip(o.clip);
        std::memcpy(clips[i].data_ptr(), bytes.data(), bytes.size());
        names.push_back(file.filename().string());
      }
      const at::Tensor x = clips.slice(0, first, end).to(device).to(torch::kFloat).div_(255.0);
      parts.push_back(net->forward(x).video_embedding.cpu());
      std::printf("embedded %lld of %lld videos\n", static_cast<long long>(end), static_cast<long long>(n));
      std::fflush(stdout);
    }
    out = torch::cat(parts);
    if (!o.clips_out.empty()) writeNpy(o.clips_out, clips);
  }
  writeNpy(o.out, out.to(torch::kFloat).contiguous());
  std::ofstream names_file(namesPath(o.out));
  for (const auto& n : names) names_file << n << "\n";
  if (!names_file.flush()) throw dtrain::Error(fmt::format("milnce embed: cannot write {}", namesPath(o.out)));
  std::printf("wrote %s ([%lld, %lld] float32) and %s\n", o.out.c_str(), static_cast<long long>(out.size(0)),
              static_cast<long long>(out.size(1)), namesPath(o.out).c_str());
  return out;
}

}  // namespace milnce
