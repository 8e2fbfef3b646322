// Checkpoint files (see checkpoint_io.h): atomic durable writes, names, the pickled dict and reading
// it back with errors that say what a file is when it is not a dtrain checkpoint.
#include "checkpoint_io.h"

#include <fcntl.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <sys/stat.h>
#include <unistd.h>
#include <caffe2/serialize/versions.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "comm/util/digest.h"
#include "dtrain/comm/error.h"
#include "errors.h"
#include "pickle_load.h"
#include "pickle_save.h"
#include "zip_layout.h"

namespace dtrain::detail {
namespace fs = std::filesystem;

namespace {

// The key of a checkpoint dict's content digest (comm/util/digest.h): every other value, in order.
constexpr const char* kDigestKey = "checksum";

// Feeds a value to the digest with its kind, so that equal bytes of different shapes differ.
void digestValue(Digest& d, const c10::IValue& v) {
  const std::string kind = v.tagKind();
  d.update(kind.data(), kind.size());
  if (v.isTensor()) {
    const at::Tensor t = v.toTensor().cpu().contiguous();
    const auto dtype = std::string(c10::toString(t.scalar_type()));
    d.update(dtype.data(), dtype.size());
    for (int64_t s : t.sizes()) d.update(&s, sizeof s);
    d.update(t.data_ptr(), t.numel() * t.element_size());
  } else if (v.isString()) {
    const auto& s = v.toStringRef();
    const uint64_t n = s.size();
    d.update(&n, sizeof n);
    d.update(s.data(), s.size());
  } else if (v.isInt()) {
    const int64_t x = v.toInt();
    d.update(&x, sizeof x);
  } else if (v.isDouble()) {
    const double x = v.toDouble();
    d.update(&x, sizeof x);
  } else if (v.isBool()) {
    const char x = v.toBool() ? 1 : 0;
    d.update(&x, 1);
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      if (e.key().isString() && e.key().toStringRef() == kDigestKey) continue;
      digestValue(d, e.key());
      digestValue(d, e.value());
    }
  } else if (v.isList()) {
    for (const auto& x : v.toListRef()) digestValue(d, x);
  } else if (v.isTuple()) {
    for (const auto& x : v.toTupleRef().elements()) digestValue(d, x);
  } else if (!v.isNone()) {
    throw Error(fmt::format("checkpoint digest: a value of kind {} in a checkpoint dict", v.tagKind()));
  }
}

std::string digestOf(const c10::impl::GenericDict& dict) {
  Digest d;
  digestValue(d, c10::IValue(dict));
  return d.text();
}


constexpr const char* kFormat = kCheckpointFormat;


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

at::Tensor bytesToTensor(const std::string& bytes) {
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, torch::kUInt8)
      .clone();
}

// The first bytes of a file, printable: "'<?xml ve'" or "bytes 00 01 fe ...".
std::string leadingBytes(const std::vector<char>& bytes) {
  const size_t n = std::min<size_t>(bytes.size(), 8);
  bool printable = true;
  for (size_t i = 0; i < n; ++i) printable &= std::isprint(static_cast<unsigned char>(bytes[i])) != 0;
  if (printable) return fmt::format("'{}'", std::string(bytes.data(), n));
  std::string hex;
  for (size_t i = 0; i < n; ++i) hex += fmt::format("{}{:02x}", i ? " " : "", static_cast<unsigned char>(bytes[i]));
  return "bytes " + hex;
}

// What libtorch's archive reader requires before it reads anything, checked first because it trusts the
// sizes the bytes claim and libtorch 1.13 leaks its zip reader when its constructor throws. After the zip
// layout (`entries`, zip_layout.h): the archive's name being the first entry's top directory, a "<archive>/version" or
// "<archive>/.data/version" record holding a format version this libtorch reads, and a
// "<archive>/data.pkl" whose opcodes' lengths fit in it (zip_layout.h). "" when all hold.
std::string torchArchiveProblem(const std::vector<char>& bytes, const std::vector<ZipEntry>& entries) {
  if (entries.empty() || entries[0].name.find('/') == std::string::npos)
    return "its zip archive has no entry inside a directory (torch archives put every record in one)";
  const std::string archive = entries[0].name.substr(0, entries[0].name.find('/'));
  const ZipEntry *version = nullptr, *pickle = nullptr;
  for (const auto& e : entries) {
    if (e.name == archive + "/version" || (!version && e.name == archive + "/.data/version")) version = &e;
    if (e.name == archive + "/data.pkl") pickle = &e;
  }
  if (!version) return fmt::format("its zip archive has no record '{}/version'", archive);
  const std::string text(bytes.data() + version->offset, std::min<uint64_t>(version->size, 32));
  uint64_t v = 0;
  const size_t skip = text.find_first_not_of(" \t\r\n");  // leading blanks, as std::stoull skips them
  const char* first = text.data() + (skip == std::string::npos ? text.size() : skip);
  const auto [end, ec] = std::from_chars(first, text.data() + text.size(), v);
  if (ec != std::errc() || end == first || v < caffe2::serialize::kMinSupportedFileFormatVersion ||
      v > caffe2::serialize::kMaxSupportedFileFormatVersion)
    return fmt::format("its torch archive's format version '{}' is not one this libtorch reads ({} to {})", text,
                       caffe2::serialize::kMinSupportedFileFormatVersion,
                       caffe2::serialize::kMaxSupportedFileFormatVersion);
  if (!pickle) return fmt::format("its zip archive has no record '{}/data.pkl'", archive);
  return pickleLengthProblem(bytes.data() + pickle->offset, pickle->size);
}

bool contains(const std::vector<char>& bytes, const char* needle) {
  const size_t n = std::strlen(needle);
  return std::search(bytes.begin(), bytes.end(), needle, needle + n) != bytes.end();
}

}  // namespace

std::string writeFileAtomically(const std::string& dir, const std::string& name, const std::vector<char>& bytes) {
  const std::string final_path = (fs::path(dir) / name).string();
  {
    TmpFile tmp((fs::path(dir) / (kCheckpointTmpPrefix + name)).string());
    Fd f(tmp.path(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    f.writeAll(bytes.data(), bytes.size());
    f.sync();  // the data must be on disk before the rename makes it the checkpoint
    f.close();
    if (::rename(tmp.path().c_str(), final_path.c_str()) != 0) throwErrno("cannot rename into", final_path);
    tmp.release();
  }
  // The rename itself is durable only once the directory is synced.
  Fd(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC).sync();
  return final_path;
}

void removeFileDurably(const std::string& dir, const std::string& name) {
  const std::string path = (fs::path(dir) / name).string();
  if (::unlink(path.c_str()) != 0) {
    if (errno == ENOENT) return;
    throwErrno("cannot remove", path);
  }
  Fd(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC).sync();
}

std::vector<char> readFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throwErrno("cannot open", path);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throwErrno("cannot read", path);
  return bytes;
}

std::optional<std::pair<int64_t, int64_t>> parseCheckpointName(const std::string& name, const std::string& suffix) {
  const size_t pl = std::strlen(kCheckpointPrefix), sl = suffix.size();
  if (name.size() <= pl + sl || name.compare(0, pl, kCheckpointPrefix) != 0 ||
      name.compare(name.size() - sl, sl, suffix) != 0)
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

void checkCheckpointDir(const std::string& dir, bool writer) {
  DTRAIN_CHECK(!dir.empty(), InvalidArgument, "Checkpointer: empty directory");
  std::error_code ec;
  const fs::path path(dir);
  if (fs::exists(path, ec)) {
    if (!fs::is_directory(path, ec))
      throw InvalidArgument(fmt::format("Checkpointer: {} exists and is not a directory: checkpoints go into a "
                                        "directory (a new one is created by the first save)",
                                        dir));
  } else {
    // The first save creates the missing directories: the nearest existing ancestor must be a directory.
    fs::path p = path.has_parent_path() ? path.parent_path() : fs::path(".");
    while (!p.empty() && !fs::exists(p, ec)) p = p.parent_path();
    if (p.empty()) p = ".";
    if (!fs::is_directory(p, ec))
      throw InvalidArgument(fmt::format("Checkpointer: cannot create the directory {}: {} is not a directory", dir,
                                        p.string()));
    if (writer && ::access(p.c_str(), W_OK | X_OK) != 0)
      throw InvalidArgument(
          fmt::format("Checkpointer: cannot create the directory {}: {} is not writable", dir, p.string()));
    return;
  }
  if (writer && ::access(dir.c_str(), W_OK | X_OK) != 0)
    throw InvalidArgument(fmt::format("Checkpointer: the directory {} is not writable", dir));
}

std::vector<char> pickleState(const CheckpointState& s, int rank, int world_size) {
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
  dict.insert("samples", s.samples);
  dict.insert("rng", s.rng.defined() ? s.rng.contiguous() : torch::empty({0}, torch::kUInt8));
  dict.insert("user_rng", s.user_rng);
  dict.insert("metrics", metrics);
  c10::Dict<std::string, at::Tensor> ps_state;
  for (const auto& [name, t] : s.parameter_server) ps_state.insert(name, t);
  dict.insert("parameter_server", ps_state);
  if (!s.sharded.empty()) {  // (only then: files without sharded state keep their layout)
    c10::Dict<std::string, at::Tensor> sharded;
    for (const auto& [name, t] : s.sharded) sharded.insert(name, t);
    dict.insert("sharded", sharded);
  }
  if (rank >= 0) {
    dict.insert("rank", int64_t{rank});
    dict.insert("world_size", int64_t{world_size});
  }
  return pickleWithDigest(dict);
}

std::vector<char> pickleWithDigest(c10::impl::GenericDict dict) {
  dict.insert(kDigestKey, digestOf(dict));  // last: what a load recomputes (loadCheckpointDict)
  return detail::torchSave(dict);
}

c10::IValue loadTorchArchive(const std::string& path, const std::vector<char>& bytes, const TorchFileKind& k) {
  if (bytes.empty()) throw Error(fmt::format("{} {} is empty (truncated?)", k.noun, path));
  // torch.save / torch::pickle_save write a zip archive whose pickle is "<archive>/data.pkl".
  static const char kZipMagic[] = {'P', 'K', '\x03', '\x04'};
  if (bytes.size() < 4 || !std::equal(kZipMagic, kZipMagic + 4, bytes.begin()))
    throw Error(fmt::format("{} is not {}: not a zip archive as torch.save writes (it starts with {})", path, k.kind,
                            leadingBytes(bytes)));
  // The archive's layout before libtorch's reader, which trusts the sizes it claims (torchArchiveProblem):
  // no end record means the file was cut short, whatever else it holds.
  std::vector<ZipEntry> entries;
  std::string layout = zipLayoutProblem(bytes.data(), bytes.size(), &entries);
  if (!layout.empty()) throw Error(fmt::format("{} {} is corrupt or truncated: {}", k.noun, path, layout));
  if (!contains(bytes, "data.pkl"))
    throw Error(fmt::format("{} is not {}: a zip archive without a torch pickle (no data.pkl entry)", path, k.kind));
  layout = torchArchiveProblem(bytes, entries);
  if (!layout.empty()) throw Error(fmt::format("{} {} is corrupt or truncated: {}", k.noun, path, layout));
  c10::IValue root;
  try {
    root = pickleLoadChecked(bytes, k.python_dicts);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{} {} is corrupt or truncated: {}", k.noun, path, errorText(e)));
  }
  if (!root.isGenericDict())
    throw Error(fmt::format("{} is not {}: a torch file whose root is a {}, not a dict", path, k.kind, root.tagKind()));
  return root;
}

c10::impl::GenericDict loadCheckpointDict(const std::string& path, const std::vector<char>& bytes,
                                          const std::string& format) {
  const c10::IValue root = loadTorchArchive(path, bytes, {"checkpoint", "a dtrain checkpoint", false});
  auto dict = root.toGenericDict();
  auto it = dict.find("format");
  if (it == dict.end()) {
    std::vector<std::string> keys;
    for (const auto& e : dict) {
      if (keys.size() == 8) {
        keys.push_back("...");
        break;
      }
      keys.push_back(e.key().isString() ? "'" + e.key().toStringRef() + "'" : e.key().tagKind());
    }
    throw Error(fmt::format("{} is not a dtrain checkpoint: a torch file holding a dict without dtrain's 'format' "
                            "key (its keys: {}); a PyTorch state_dict? dtrain reads what Checkpointer::save wrote",
                            path, fmt::join(keys, ", ")));
  }
  const std::string found = it->value().isString() ? it->value().toStringRef() : it->value().tagKind();
  if (found != format)
    throw Error(fmt::format("checkpoint {} has format '{}'; this build reads '{}'", path, found, format));
  // The content digest (files written before it existed have none): torch's archive reader does not check
  // its records' CRCs, so a flipped bit in a tensor would otherwise load as a different model.
  auto digest = dict.find(kDigestKey);
  if (digest != dict.end()) {
    const std::string stored = digest->value().isString() ? digest->value().toStringRef() : "(not a string)";
    const std::string computed = digestOf(dict);
    if (stored != computed)
      throw Error(fmt::format("checkpoint {} is corrupt: its content does not match the checksum written with it "
                              "(stored {}, computed {}): the file changed on disk or in transit; remove it to resume "
                              "from an older checkpoint",
                              path, stored, computed));
  }
  return dict;
}

CheckpointState unpickleState(const std::string& path, const c10::impl::GenericDict& dict) {
  DictReader r(path, dict);
  CheckpointState s;
  s.model = r.tensors("model");
  s.optimizer = r.bytes("optimizer");
  s.scheduler = r.numbers("scheduler");
  s.epoch = r.integer("epoch");
  s.step = r.integer("step");
  if (r.has("samples")) s.samples = r.integer("samples");  // absent before resuming at new world sizes
  s.rng = r.tensor("rng");
  if (s.rng.numel() == 0) s.rng = at::Tensor();
  s.user_rng = r.str("user_rng");
  s.metrics = r.numbers("metrics");
  if (r.has("parameter_server")) s.parameter_server = r.tensors("parameter_server");  // absent before PS state
  if (r.has("sharded")) s.sharded = r.tensors("sharded");                                  // absent before ZeRO
  return s;
}

// ---- DictReader ----

void DictReader::fail(const std::string& key, const std::string& what) const {
  throw Error(fmt::format("checkpoint {}: key '{}' {}", path_, key, what));
}

const c10::IValue& DictReader::get(const std::string& key) const {
  auto it = dict_.find(key);
  if (it == dict_.end()) fail(key, "is missing");
  return it->value();
}

std::string DictReader::str(const std::string& key) const {
  const auto& v = get(key);
  if (!v.isString()) fail(key, "is a " + v.tagKind() + ", expected a string");
  return v.toStringRef();
}

int64_t DictReader::integer(const std::string& key) const {
  const auto& v = get(key);
  if (!v.isInt()) fail(key, "is a " + v.tagKind() + ", expected an int");
  return v.toInt();
}

at::Tensor DictReader::tensor(const std::string& key) const {
  const auto& v = get(key);
  if (!v.isTensor()) fail(key, "is a " + v.tagKind() + ", expected a tensor");
  return v.toTensor();
}

std::string DictReader::bytes(const std::string& key) const {
  auto t = tensor(key);
  if (t.scalar_type() != torch::kUInt8 || t.dim() != 1)
    fail(key, fmt::format("is a {} tensor of shape {}, expected 1-D uint8", c10::toString(t.scalar_type()),
                          detail::shapeText(t.sizes())));
  t = t.contiguous();
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
}

c10::impl::GenericDict DictReader::dict(const std::string& key) const {
  const auto& v = get(key);
  if (!v.isGenericDict()) fail(key, "is a " + v.tagKind() + ", expected a dict");
  return v.toGenericDict();
}

std::map<std::string, at::Tensor> DictReader::tensors(const std::string& key) const {
  std::map<std::string, at::Tensor> out;
  for (const auto& e : dict(key)) {
    if (!e.key().isString() || !e.value().isTensor()) fail(key, "holds an entry that is not a name -> tensor pair");
    out.emplace(e.key().toStringRef(), e.value().toTensor());
  }
  return out;
}

std::map<std::string, double> DictReader::numbers(const std::string& key) const {
  std::map<std::string, double> out;
  for (const auto& e : dict(key)) {
    // Ints too: a file edited in Python may hold {"lr_step": 3}.
    if (!e.key().isString() || !(e.value().isDouble() || e.value().isInt()))
      fail(key, "holds an entry that is not a str -> number pair");
    out.emplace(e.key().toStringRef(),
                e.value().isDouble() ? e.value().toDouble() : static_cast<double>(e.value().toInt()));
  }
  return out;
}

std::vector<std::string> DictReader::strings(const std::string& key) const {
  const auto& v = get(key);
  if (!v.isList()) fail(key, "is a " + v.tagKind() + ", expected a list");
  std::vector<std::string> out;
  for (const auto& e : v.toListRef()) {
    if (!e.isString()) fail(key, "holds a " + e.tagKind() + ", expected strings");
    out.push_back(e.toStringRef());
  }
  return out;
}

std::vector<int64_t> DictReader::integers(const std::string& key) const {
  const auto& v = get(key);
  if (!v.isList()) fail(key, "is a " + v.tagKind() + ", expected a list");
  std::vector<int64_t> out;
  for (const auto& e : v.toListRef()) {
    if (!e.isInt()) fail(key, "holds a " + e.tagKind() + ", expected ints");
    out.push_back(e.toInt());
  }
  return out;
}

}  // namespace dtrain::detail
