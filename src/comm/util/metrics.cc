// The JSON-lines metrics logger and its helpers (dtrain/metrics.h). Values are encoded here with fmt
// (numbers in their shortest round-trip form, so a logged double reads back bit for bit) rather than
// with a JSON library, which would become a build dependency of every program linking dtrain.
#include "dtrain/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "comm/util/json_text.h"
#include "dtrain/comm/error.h"

namespace dtrain {
namespace {

using detail::jsonQuoted;

}  // namespace

Record& Record::setRaw(std::string_view key, const std::string& json_value) {
  if (!body_.empty()) body_ += ',';
  body_ += jsonQuoted(key);
  body_ += ':';
  body_ += json_value;
  return *this;
}

Record& Record::set(std::string_view key, double v) { return setRaw(key, std::isfinite(v) ? fmt::format("{}", v) : "null"); }
Record& Record::set(std::string_view key, std::string_view v) { return setRaw(key, jsonQuoted(v)); }
Record& Record::set(std::string_view key, bool v) { return setRaw(key, v ? "true" : "false"); }
Record& Record::set(std::string_view key, const Record& nested) { return setRaw(key, nested.json()); }

Record& Record::stepTimes(double step_s, double comm_s, double exposed_comm_s) {
  set("step_s", step_s);
  if (comm_s > 0) {
    set("comm_s", comm_s);
    set("exposed_comm_s", exposed_comm_s);
    set("compute_s", step_s - exposed_comm_s);
    set("hidden_fraction", std::clamp(1.0 - exposed_comm_s / comm_s, 0.0, 1.0));
  }
  return *this;
}

MetricsLog::MetricsLog(const std::string& path, Open mode)
    : path_(path), start_(std::chrono::steady_clock::now()), start_unix_(unixTime()) {
  const std::filesystem::path dir = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);  // a failure shows in open() below
  const int flags = O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (mode == Open::truncate ? O_TRUNC : 0);
  fd_ = comm::net::Fd(::open(path.c_str(), flags, 0644));
  if (!fd_.valid()) throw IoError(fmt::format("cannot open metrics file {}: {}", path, std::strerror(errno)));
}

void MetricsLog::write(const Record& r) {
  const std::string line = r.json() + "\n";
  std::lock_guard<std::mutex> lock(mu_);
  // O_APPEND: each write lands at the end; a short write (a full disk) continues where it stopped.
  for (size_t off = 0; off < line.size();) {
    ssize_t n = ::write(fd_.get(), line.data() + off, line.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw IoError(fmt::format("cannot write metrics file {}: {}", path_, std::strerror(errno)));
    off += static_cast<size_t>(n);
  }
}

void MetricsLog::writeRun(std::string_view app, int world_size, const Record& config) {
  write(Record("run").set("app", app).set("world_size", world_size).set("start_unix", start_unix_).set("config", config));
}

double MetricsLog::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

uint64_t residentBytes() {
  // statm: size resident shared text lib data dt, in pages.
  std::ifstream f("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (!(f >> size >> resident)) throw IoError("cannot read the resident memory from /proc/self/statm");
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

uint64_t peakResidentBytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmHWM:", 0) != 0) continue;
    std::istringstream in(line.substr(6));
    uint64_t kb = 0;
    if (in >> kb) return kb * 1024;
  }
  throw IoError("cannot read the peak resident memory (VmHWM) from /proc/self/status");
}

void resetPeakResidentBytes() {
  std::ofstream f("/proc/self/clear_refs");
  if (!(f << "5" << std::flush)) throw IoError("cannot reset the peak resident memory: /proc/self/clear_refs is not writable");
}

double unixTime() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace dtrain
