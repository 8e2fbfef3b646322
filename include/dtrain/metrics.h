/// @file
/// Metrics of a training run as JSON lines: one object per line, written and flushed line by line (a
/// crashed run keeps everything logged before the crash). `dtrain-report RUN_DIR` reads RUN_DIR/metrics.jsonl;
/// the record kinds and their fields are in docs/OBSERVABILITY.md ("Metrics").
///
/// \code
///   dtrain::MetricsLog log(out_dir + "/metrics.jsonl");       // rank 0 only; dtrain::Error naming the file
///   log.writeRun("milnce", dist.size(), dtrain::Record().set("lr", 1e-3).set("batch", 32));
///   dtrain::BytesSentMeter sent;                               // comm::bytesSent() since the last call
///   dtrain::Stopwatch step_time;
///   for (int64_t step = 0; step < steps; ++step) {
///     double loss = trainOneStep();                            // forward, backward through DDP, optimizer
///     auto st = ddp.lastStats();
///     double step_s = step_time.lap();
///     log.write(dtrain::Record("step").set("step", step).set("time_s", log.seconds()).set("loss", loss)
///                   .set("samples_per_s", global_batch / step_s)
///                   .stepTimes(step_s, st.comm_ms / 1e3, st.exposed_ms / 1e3)  // + compute_s, hidden_fraction
///                   .set("bytes_sent", sent.sinceLast()).set("rss_bytes", dtrain::residentBytes()));
///   }
///   // {"kind":"step","step":0,"time_s":0.051,"loss":2.31,"samples_per_s":1254.9,"step_s":0.051,...}
/// \endcode
///
/// A NaN or infinite number is written as null (JSON has neither). Record and the helpers are in
/// dtrain::comm_base; BytesSentMeter reads dtrain::comm's counter, so a program using it links dtrain::comm.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "dtrain/comm/fd.h"
#include "dtrain/comm/process_group.h"

namespace dtrain {

/// One JSON object under construction; fields appear in the order they were set. Setting a key twice
/// writes it twice (the last wins for most JSON readers): set each once.
class Record {
 public:
  /// An object without a "kind" (for nested values such as a run's config).
  Record() = default;
  /// An object whose first field is "kind": "run", "step", "eval", "bench", ...
  explicit Record(std::string_view kind) { set("kind", kind); }

  ///@{
  /// Adds the field `key` with the value v (a number, a string, a bool, a nested object or an integer)
  /// and returns *this, for chained calls.
  Record& set(std::string_view key, double v);
  Record& set(std::string_view key, std::string_view v);
  Record& set(std::string_view key, const char* v) { return set(key, std::string_view(v)); }
  Record& set(std::string_view key, const std::string& v) { return set(key, std::string_view(v)); }
  Record& set(std::string_view key, bool v);
  Record& set(std::string_view key, const Record& nested);
  template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>>>
  Record& set(std::string_view key, Int v) {
    return setRaw(key, std::to_string(v));
  }
  ///@}
  /// The fields of a step's time: step_s and, when comm_s > 0 (the step communicated), comm_s,
  /// exposed_comm_s, compute_s = step_s - exposed_comm_s and hidden_fraction = 1 - exposed/comm (clamped
  /// to [0, 1]). comm_s and exposed_comm_s are DDP's Stats::comm_ms and exposed_ms in seconds.
  Record& stepTimes(double step_s, double comm_s, double exposed_comm_s);

  /// The object as one line of JSON, without the newline.
  std::string json() const { return "{" + body_ + "}"; }
  /// True when no field was set.
  bool empty() const { return body_.empty(); }

 private:
  Record& setRaw(std::string_view key, const std::string& json_value);
  std::string body_;
};

/// A JSON-lines file. Every write is one line, appended and flushed at once (one write(2) call), so
/// readers and crashes see whole lines only. Thread-safe.
class MetricsLog {
 public:
  /// What happens to an existing file.
  enum class Open {
    truncate,  ///< emptied first
    append     ///< kept; lines are added at its end
  };
  /// Creates the file's directory if missing. dtrain::IoError naming the file when it cannot be opened.
  explicit MetricsLog(const std::string& path, Open mode = Open::truncate);

  /// Appends r as one line. dtrain::IoError naming the file when it cannot be written.
  void write(const Record& r);
  /// {"kind":"run","app":app,"world_size":n,"start_unix":startUnix(),"config":{...}}: once, first.
  void writeRun(std::string_view app, int world_size, const Record& config = Record());

  /// Seconds since the log was opened (steady clock): the "time_s" of step records.
  double seconds() const;
  /// The wall-clock time (Unix seconds) when the log was opened: the run record's "start_unix".
  double startUnix() const { return start_unix_; }
  /// The file's path, as given.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  comm::net::Fd fd_;
  std::mutex mu_;
  std::chrono::steady_clock::time_point start_;
  double start_unix_ = 0;
};

/// Seconds on the steady clock since construction (seconds()) or since the previous lap (lap()).
class Stopwatch {
 public:
  /// Starts the clock (and the first lap) now.
  Stopwatch() : last_(std::chrono::steady_clock::now()), start_(last_) {}
  /// Seconds since construction.
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  /// Seconds since the previous lap() (or construction); starts the next lap.
  double lap() {
    auto now = std::chrono::steady_clock::now();
    double s = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    return s;
  }

 private:
  std::chrono::steady_clock::time_point last_, start_;
};

/// Bytes this process sent in every process group's collectives and point-to-point ops
/// (dtrain::comm::bytesSent()) since the previous sinceLast() or the construction.
class BytesSentMeter {
 public:
  /// Counts from now.
  BytesSentMeter() : last_(comm::bytesSent()) {}
  /// Bytes sent since the previous call (or construction).
  uint64_t sinceLast() {
    uint64_t now = comm::bytesSent();
    uint64_t d = now - last_;
    last_ = now;
    return d;
  }

 private:
  uint64_t last_;
};

/// Resident memory of this process in bytes (/proc/self/statm); dtrain::IoError naming it if unreadable.
uint64_t residentBytes();
/// The most resident memory this process has had (VmHWM of /proc/self/status), in bytes; IoError likewise.
uint64_t peakResidentBytes();
/// Lowers the peak (VmHWM) to the resident memory now, so that a later peakResidentBytes() is the peak of
/// what ran since: e.g. of training, without the model's construction (writes 5 to /proc/self/clear_refs,
/// Linux 4.0+); IoError if that file cannot be written.
void resetPeakResidentBytes();
/// Now, as Unix seconds with sub-second resolution.
double unixTime();

}  // namespace dtrain
