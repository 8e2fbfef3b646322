// Checkpoint files (see checkpoint.h): capture/restore helpers, the pickled dict, atomic writes,
// naming, pruning and loading.
#include "dtrain/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"
#include "errors.h"

namespace dtrain {
namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "dtrain-checkpoint-v1";
constexpr const char* kPrefix = "ckpt-";
constexpr const char* kSuffix = ".pt";
constexpr const char* kTmpPrefix = ".tmp-";

std::string shapeString(const at::Tensor& t) { return fmt::format("[{}]", fmt::join(t.sizes(), ", ")); }

using detail::errorText;

// The parameters and buffers of a module by qualified name (the names PyTorch's state_dict uses).
std::map<std::string, at::Tensor> namedTensors(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    if (p.value().defined()) out.emplace(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    if (b.value().defined()) out.emplace(b.key(), b.value());
  return out;
}

at::Tensor bytesToTensor(const std::string& bytes) {
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, torch::kUInt8)
      .clone();
}

// ---- files ----

[[noreturn]] void throwErrno(const std::string& what, const std::string& path) {
  throw Error(fmt::format("checkpoint: {} {}: {}", what, path, std::strerror(errno)));
}

// An open file descriptor, closed on destruction. close() reports errors for the paths that care
// (a failed close of a written file can mean lost data on some filesystems).
class Fd {
 public:
  Fd(const std::string& path, int flags, mode_t mode = 0) : path_(path), fd_(::open(path.c_str(), flags, mode)) {
    if (fd_ < 0) throwErrno("cannot open", path);
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  void writeAll(const char* data, size_t n) {
    while (n > 0) {
      ssize_t w = ::write(fd_, data, n);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throwErrno("cannot write", path_);
      data += w;
      n -= static_cast<size_t>(w);
    }
  }
  void sync() {
    if (::fsync(fd_) != 0) throwErrno("cannot fsync", path_);
  }
  void close() {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throwErrno("cannot close", path_);
  }

 private:
  std::string path_;
  int fd_;
};

// Removes the temporary file unless it was renamed into place: no cleanup by hand on error paths.
class TmpFile {
 public:
  explicit TmpFile(std::string path) : path_(std::move(path)) {}
  ~TmpFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TmpFile(const TmpFile&) = delete;
  TmpFile& operator=(const TmpFile&) = delete;
  const std::string& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  std::string path_;
};

// "ckpt-<epoch>-<step>.pt" -> (epoch, step); nullopt for anything else (including .tmp- files).
std::optional<std::pair<int64_t, int64_t>> parseName(const std::string& name) {
  const size_t pl = std::strlen(kPrefix), sl = std::strlen(kSuffix);
  if (name.size() <= pl + sl || name.compare(0, pl, kPrefix) != 0 ||
      name.compare(name.size() - sl, sl, kSuffix) != 0)
    return std::nullopt;
  const char* p = name.data() + pl;
  const char* end = name.data() + name.size() - sl;
  int64_t epoch = 0, step = 0;
  auto r1 = std::from_chars(p, end, epoch);
  if (r1.ec != std::errc() || r1.ptr == p || r1.ptr == end || *r1.ptr != '-') return std::nullopt;
  auto r2 = std::from_chars(r1.ptr + 1, end, step);
  if (r2.ec != std::errc() || r2.ptr == r1.ptr + 1 || r2.ptr != end || epoch < 0 || step < 0) return std::nullopt;
  return std::make_pair(epoch, step);
}

// ---- reading the dict back, with errors that name the file and the key ----

class Reader {
 public:
  Reader(const std::string& path, c10::impl::GenericDict dict) : path_(path), dict_(std::move(dict)) {}

  bool has(const std::string& key) const { return dict_.find(key) != dict_.end(); }
  const c10::IValue& get(const std::string& key) const {
    auto it = dict_.find(key);
    if (it == dict_.end()) fail(key, "is missing");
    return it->value();
  }
  std::string str(const std::string& key) const {
    const auto& v = get(key);
    if (!v.isString()) fail(key, "is a " + v.tagKind() + ", expected a string");
    return v.toStringRef();
  }
  int64_t integer(const std::string& key) const {
    const auto& v = get(key);
    if (!v.isInt()) fail(key, "is a " + v.tagKind() + ", expected an int");
    return v.toInt();
  }
  at::Tensor tensor(const std::string& key) const {
    const auto& v = get(key);
    if (!v.isTensor()) fail(key, "is a " + v.tagKind() + ", expected a tensor");
    return v.toTensor();
  }
  std::string bytes(const std::string& key) const {
    auto t = tensor(key);
    if (t.scalar_type() != torch::kUInt8 || t.dim() != 1)
      fail(key, fmt::format("is a {} tensor of shape {}, expected 1-D uint8", c10::toString(t.scalar_type()),
                            shapeString(t)));
    t = t.contiguous();
    return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
  }
  c10::impl::GenericDict dict(const std::string& key) const {
    const auto& v = get(key);
    if (!v.isGenericDict()) fail(key, "is a " + v.tagKind() + ", expected a dict");
    return v.toGenericDict();
  }
  std::map<std::string, at::Tensor> tensors(const std::string& key) const {
    std::map<std::string, at::Tensor> out;
    for (const auto& e : dict(key)) {
      if (!e.key().isString() || !e.value().isTensor())
        fail(key, "holds an entry that is not a name -> tensor pair");
      out.emplace(e.key().toStringRef(), e.value().toTensor());
    }
    return out;
  }
  std::map<std::string, double> numbers(const std::string& key) const {
    std::map<std::string, double> out;
    for (const auto& e : dict(key)) {
      // Ints too: a file edited in Python may hold {"lr_step": 3}.
      if (!e.key().isString() || !(e.value().isDouble() || e.value().isInt()))
        fail(key, "holds an entry that is not a str -> number pair");
      out.emplace(e.key().toStringRef(), e.value().isDouble() ? e.value().toDouble()
                                                              : static_cast<double>(e.value().toInt()));
    }
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(fmt::format("checkpoint {}: key '{}' {}", path_, key, what));
  }
  std::string path_;
  c10::impl::GenericDict dict_;
};

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
                                        name, shapeString(it->second), shapeString(dst)));
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
  DTRAIN_CHECK(!dir_.empty(), InvalidArgument, "Checkpointer: empty directory");
  DTRAIN_CHECK_GE(keep_last, 0, "Checkpointer: keep_last");
}

Checkpointer::Checkpointer(std::string dir, const Distributed& dist, int keep_last)
    : Checkpointer(std::move(dir), keep_last, dist.isMain()) {}

std::string Checkpointer::fileName(int64_t epoch, int64_t step) {
  return fmt::format("{}{:06}-{:09}{}", kPrefix, epoch, step, kSuffix);
}

std::string Checkpointer::save(const CheckpointState& s) const {
  if (!writer_) return "";
  DTRAIN_CHECK_GE(s.epoch, 0, "Checkpointer::save: epoch");
  DTRAIN_CHECK_GE(s.step, 0, "Checkpointer::save: step");

  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  c10::Dict<std::string, at::Tensor> model;
  for (const auto& [name, t] : s.model) model.insert(name, t);
  c10::Dict<std::string, double> scheduler, metrics;
  for (const auto& [k, v] : s.scheduler) scheduler.insert(k, v);
  for (const auto& [k, v] : s.metrics) metrics.insert(k, v);
  dict.insert("format", std::string(kFormat));
  dict.insert("model", model);
  dict.insert("optimizer", bytesToTensor(s.optimizer));
  dict.insert("scheduler", scheduler);
  dict.insert("epoch", s.epoch);
  dict.insert("step", s.step);
  dict.insert("rng", s.rng.defined() ? s.rng.contiguous() : torch::empty({0}, torch::kUInt8));
  dict.insert("user_rng", s.user_rng);
  dict.insert("metrics", metrics);
  c10::Dict<std::string, at::Tensor> ps_state;
  for (const auto& [name, t] : s.parameter_server) ps_state.insert(name, t);
  dict.insert("parameter_server", ps_state);
  const std::vector<char> bytes = torch::pickle_save(dict);

  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error(fmt::format("checkpoint: cannot create directory {}: {}", dir_, ec.message()));
  const std::string name = fileName(s.epoch, s.step);
  const std::string final_path = (fs::path(dir_) / name).string();
  {
    TmpFile tmp((fs::path(dir_) / (kTmpPrefix + name)).string());
    Fd f(tmp.path(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    f.writeAll(bytes.data(), bytes.size());
    f.sync();  // the data must be on disk before the rename makes it the checkpoint
    f.close();
    if (::rename(tmp.path().c_str(), final_path.c_str()) != 0) throwErrno("cannot rename into", final_path);
    tmp.release();
  }
  // The rename itself is durable only once the directory is synced.
  Fd(dir_, O_RDONLY | O_DIRECTORY | O_CLOEXEC).sync();

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
  std::vector<CheckpointFile> out;
  std::error_code ec;
  // A directory that does not exist (yet) has no checkpoints; files may vanish while we list (pruning).
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    auto parsed = parseName(it->path().filename().string());
    if (!parsed || !it->is_regular_file(ec)) continue;
    out.push_back({it->path().string(), parsed->first, parsed->second});
  }
  std::sort(out.begin(), out.end(), [](const CheckpointFile& a, const CheckpointFile& b) {
    return std::tie(a.epoch, a.step, a.path) < std::tie(b.epoch, b.step, b.path);
  });
  return out;
}

std::optional<CheckpointState> Checkpointer::loadLatest() const {
  auto files = list();
  if (files.empty()) return std::nullopt;
  return load(files.back().path);
}

CheckpointState Checkpointer::load(const std::string& path) {
  std::vector<char> bytes;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throwErrno("cannot open", path);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    if (in.bad()) throwErrno("cannot read", path);
  }
  if (bytes.empty()) throw Error(fmt::format("checkpoint {} is empty (truncated?)", path));
  c10::IValue root;
  try {
    root = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw Error(fmt::format("checkpoint {} is corrupt or truncated: {}", path, errorText(e)));
  }
  if (!root.isGenericDict())
    throw Error(fmt::format("checkpoint {} is not a dtrain checkpoint (its root is a {}, not a dict)", path,
                            root.tagKind()));
  Reader r(path, root.toGenericDict());
  const auto format = r.str("format");
  if (format != kFormat)
    throw Error(fmt::format("checkpoint {} has format '{}'; this build reads '{}'", path, format, kFormat));
  CheckpointState s;
  s.model = r.tensors("model");
  s.optimizer = r.bytes("optimizer");
  s.scheduler = r.numbers("scheduler");
  s.epoch = r.integer("epoch");
  s.step = r.integer("step");
  s.rng = r.tensor("rng");
  if (s.rng.numel() == 0) s.rng = at::Tensor();
  s.user_rng = r.str("user_rng");
  s.metrics = r.numbers("metrics");
  if (r.has("parameter_server")) s.parameter_server = r.tensors("parameter_server");  // absent before PS state
  return s;
}

}  // namespace dtrain
