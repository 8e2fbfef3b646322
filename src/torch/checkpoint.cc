// Checkpoints (see checkpoint.h): capture/restore helpers and the single-file layout (naming, pruning,
// loading). The per-rank layout is in checkpoint_manifest.cc, the file format in checkpoint_io.cc.
#include "dtrain/checkpoint.h"

#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <sstream>
#include <tuple>

#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"
#include "dtrain/trace.h"
#include "checkpoint_io.h"
#include "errors.h"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = detail::kCheckpointPrefix;
constexpr const char* kSuffix = ".pt";
constexpr const char* kTmpPrefix = detail::kCheckpointTmpPrefix;


// The parameters and buffers of a module by qualified name (the names PyTorch's state_dict uses).
std::map<std::string, at::Tensor> namedTensors(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    if (p.value().defined()) out.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    if (b.value().defined()) out.emplace(b.key(), b.value());
  return out;
}

}  // namespace

// ---- CheckpointState ----

void CheckpointState::captureModel(const torch::nn::Module& module) {
  model.clear();
  // Copies, so the snapshot does not move on when training does; on the CPU, so the file loads anywhere.
  for (const auto& [name, t] : namedTensors(module))
    model.emplace(name, t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
}

void CheckpointState::restoreModel(torch::nn::Module& module, bool strict) const {
  auto targets = namedTensors(module);
  // Check everything before copying anything, so a mismatch leaves the module as it was.
  std::vector<std::string> missing, unexpected;
  for (const auto& [name, dst] : targets) {
    auto it = model.find(name);
    if (it == model.end()) {
      missing.push_back(name);
      continue;
    }
    if (it->second.sizes() != dst.sizes())
      throw InvalidArgument(fmt::format("restoreModel: '{}' has shape {} in the checkpoint but {} in the module",
                                        name, detail::shapeText(it->second.sizes()), detail::shapeText(dst.sizes())));
  }
  for (const auto& [name, src] : model)
    if (!targets.count(name)) unexpected.push_back(name);
  if (strict && (!missing.empty() || !unexpected.empty()))
    throw InvalidArgument(fmt::format(
        "restoreModel: the checkpoint and the module disagree: missing from the checkpoint: [{}]; "
        "not in the module: [{}]",
        fmt::join(missing, ", "), fmt::join(unexpected, ", ")));
  torch::NoGradGuard no_grad;
  for (auto& [name, dst] : targets) {
    auto it = model.find(name);
    if (it != model.end()) dst.copy_(it->second);
  }
}

void CheckpointState::captureOptimizer(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream os;
  archive.save_to(os);
  optimizer = os.str();
}

void CheckpointState::restoreOptimizer(torch::optim::Optimizer& opt) const {
  DTRAIN_CHECK(!optimizer.empty(), InvalidArgument, "restoreOptimizer: the checkpoint holds no optimizer state");
  try {
    torch::serialize::InputArchive archive;
    std::istringstream is(optimizer);
    archive.load_from(is);
    // libtorch's load sets the state it finds and leaves the rest: a parameter without state in the
    // checkpoint (never stepped: its gradient was always undefined) must not keep this optimizer's.
    opt.state().clear();
    opt.load(archive);
  } catch (const c10::Error& e) {
    throw Error(fmt::format("restoreOptimizer: the optimizer rejected the saved state: {}",
                            e.what_without_backtrace()));
  }
}

void CheckpointState::captureRng() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());  // other threads may be drawing from it
  rng = gen.get_state();
}

void CheckpointState::restoreRng() const {
  DTRAIN_CHECK(rng.defined() && rng.numel() > 0, InvalidArgument,
               "restoreRng: the checkpoint holds no RNG state");
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  try {
    gen.set_state(rng);
  } catch (const c10::Error& e) {
    throw Error(fmt::format("restoreRng: invalid generator state: {}", e.what_without_backtrace()));
  }
}

// ---- Checkpointer ----

Checkpointer::Checkpointer(std::string dir, int keep_last, bool writer)
    : dir_(std::move(dir)), keep_last_(keep_last), writer_(writer) {
  DTRAIN_CHECK_GE(keep_last, 0, "Checkpointer: keep_last");
  detail::checkCheckpointDir(dir_, writer_);
}

Checkpointer::Checkpointer(std::string dir, const Distributed& dist, int keep_last)
    : Checkpointer(std::move(dir), keep_last, dist.isMain()) {}

std::string Checkpointer::fileName(int64_t epoch, int64_t step) {
  return fmt::format("{}{:06}-{:09}{}", kPrefix, epoch, step, kSuffix);
}

std::string Checkpointer::save(const CheckpointState& s) const {
  DTRAIN_SPAN("checkpoint save", "checkpoint");
  if (group_) return savePerRank(s);
  if (!writer_) return "";
  DTRAIN_CHECK_GE(s.epoch, 0, "Checkpointer::save: epoch");
  DTRAIN_CHECK_GE(s.step, 0, "Checkpointer::save: step");
  const std::vector<char> bytes = detail::pickleState(s);

  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error(fmt::format("checkpoint: cannot create directory {}: {}", dir_, ec.message()));
  const std::string final_path = detail::writeFileAtomically(dir_, fileName(s.epoch, s.step), bytes);

  // Pruning failures are not errors: the new checkpoint is already safe, and the next save retries.
  auto files = list();
  if (keep_last_ > 0 && files.size() > static_cast<size_t>(keep_last_))
    for (size_t i = 0; i + keep_last_ < files.size(); ++i) fs::remove(files[i].path, ec);
  // Leftovers of a writer that crashed mid-save (this process is the directory's only writer).
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string fname = e.path().filename().string();
    if (fname.rfind(std::string(kTmpPrefix) + kPrefix, 0) == 0) fs::remove(e.path(), ec);
  }
  return final_path;
}

std::vector<CheckpointFile> Checkpointer::list() const {
  if (group_) return listPerRank();
  std::vector<CheckpointFile> out;
  std::error_code ec;
  // A directory that does not exist (yet) has no checkpoints; files may vanish while we list (pruning).
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    auto parsed = detail::parseCheckpointName(it->path().filename().string(), kSuffix);
    if (!parsed || !it->is_regular_file(ec)) continue;
    out.push_back({it->path().string(), parsed->first, parsed->second});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointFile& a, const CheckpointFile& b) {
    return std::tie(a.epoch, a.step, a.path) < std::tie(b.epoch, b.step, b.path);
  });
  return out;
}

std::optional<CheckpointState> Checkpointer::loadLatest() const {
  if (group_) return loadLatestPerRank();
  auto files = list();
  if (files.empty()) return std::nullopt;
  return load(files.back().path);
}

std::map<std::string, at::Tensor> readStateDict(const std::string& path) {
  const auto bytes = detail::readFile(path);
  const c10::IValue root = detail::loadTorchArchive(path, bytes, {"state dict", "a torch.save file", true});
  std::map<std::string, at::Tensor> out;
  for (const auto& e : root.toGenericDict()) {
    if (!e.key().isString())
      throw Error(fmt::format("state dict {}: a key that is a {}, not a parameter's name", path, e.key().tagKind()));
    const std::string& name = e.key().toStringRef();
    if (!e.value().isTensor())
      throw Error(fmt::format("state dict {}: '{}' is a {}, not a tensor", path, name, e.value().tagKind()));
    out.emplace(name, e.value().toTensor());
  }
  return out;
}

void loadStateDict(torch::nn::Module& module, const std::string& path, bool strict) {
  CheckpointState s;
  s.model = readStateDict(path);
  try {
    s.restoreModel(module, strict);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("loadStateDict({}): {}", path, e.what()));
  }
}

CheckpointState Checkpointer::load(const std::string& path) {
  const auto bytes = detail::readFile(path);
  return detail::unpickleState(path, detail::loadCheckpointDict(path, bytes, detail::kCheckpointFormat));
}

std::vector<CheckpointState> Checkpointer::loadRanks(const std::string& dir) {
  static const std::regex kName(R"(rank-(\d+)-of-(\d+)\.pt)");
  int world = -1;
  if (std::filesystem::is_directory(dir))
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      std::smatch m;
      const std::string name = e.path().filename().string();
      if (std::regex_match(name, m, kName)) world = std::stoi(m[2].str());
    }
  DTRAIN_CHECK(world > 0, InvalidArgument, "{} holds no per-rank checkpoint files (rank-<r>-of-<n>.pt)", dir);
  std::vector<CheckpointState> out;
  for (int r = 0; r < world; ++r) {
    const std::string path = dir + "/" + rankFileName(r, world);
    DTRAIN_CHECK(std::filesystem::exists(path), InvalidArgument, "{}: rank {}'s file {} is missing (a checkpoint of {} ranks)",
                 dir, r, rankFileName(r, world), world);
    out.push_back(load(path));
  }
  return out;
}

}  // namespace dtrain
