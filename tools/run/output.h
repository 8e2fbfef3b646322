// Where a worker's stdout and stderr go: the launcher's console (a "[rank R]: " prefix on every
// line), log files (torchrun's --redirects and --tee), or both.
//
// \code
//   auto redirects = parseStreamSpec("--redirects", "0:3,1:1");  // local rank 0: both, 1: stdout
//   int streams = redirects.forLocalRank(1);                      // kOut
//   std::string run_dir = makeRunLogDir("/var/log/job", 0);      // /var/log/job/node0_Ab12Cd
//   // attempt_<restart>/<local_rank>/stdout.log and stderr.log are created below it per attempt.
// \endcode
#pragma once
#include <fmt/format.h>

#include <map>
#include <optional>
#include <string>

#include "dtrain/comm/fd.h"

namespace dtrain::run {

// torchrun's Std values: which of a process's standard streams a setting covers.
enum Streams : int { kNoStreams = 0, kOut = 1, kErr = 2, kBoth = 3 };

// A --redirects or --tee value: one of 0..3 for every local rank ("3"), or a value per local rank
// ("0:3,1:2"; local ranks not named get 0).
struct StreamSpec {
  std::optional<int> all;
  std::map<int, int> per_rank;

  int forLocalRank(int local_rank) const;
  // Parameter servers have no local rank: a single value covers them too, a per-rank map does not.
  int forServer() const { return all.value_or(kNoStreams); }
  bool any() const;
  int largestRank() const { return per_rank.empty() ? -1 : per_rank.rbegin()->first; }
};

// Throws InvalidArgument naming `flag` and the text when it is neither form.
StreamSpec parseStreamSpec(const std::string& flag, const std::string& text);

// A new directory for one launcher run, like torchrun's job-level log directory:
// <base>/node<R>_XXXXXX, or below a fresh ${TMPDIR:-/tmp}/dtrain-run_XXXXXX when base is empty.
// `base` is created if it does not exist. Throws IoError naming the path on failure.
std::string makeRunLogDir(const std::string& base, int node_rank);

// mkdir that succeeds when the directory exists already; throws IoError naming the path otherwise.
void makeDir(const std::string& path);

// A new (truncated) log file; throws IoError naming the path.
comm::net::Fd openLogFile(const std::string& path);

// Writes everything unless the destination is gone (EPIPE and such): the launcher's own output
// failing must not stop it from supervising the workers.
void writeAll(int fd, const char* p, size_t n);
inline void writeAll(int fd, const std::string& s) { writeAll(fd, s.data(), s.size()); }

// The launcher's own messages: "dtrain-run: ..." on stderr.
template <typename... Args>
void say(fmt::format_string<Args...> f, Args&&... args) {
  writeAll(2, "dtrain-run: " + fmt::format(f, std::forward<Args>(args)...) + "\n");
}

// Forwards one child stream (the read end of its pipe) to a console stream, a log file, or both.
// The console gets complete lines with the prefix, so that lines of different ranks never
// interleave mid-line (or, unprefixed, the bytes as they come, so progress bars keep working); the
// file gets the bytes as they come, unprefixed.
class OutputPipe {
 public:
  // console: STDOUT_FILENO, STDERR_FILENO or -1 (file only); file may be invalid (console only).
  OutputPipe(comm::net::Fd fd, int console, std::string prefix, bool prefixed, comm::net::Fd file);
  int fd() const { return fd_.get(); }
  bool open() const { return fd_.valid(); }

  // Forwards what is readable now (a bounded amount, so one chatty child cannot starve the loop).
  void pump();
  // The child has exited: what it wrote is already in the pipe. Forwards it (up to a bound, since a
  // grandchild may keep the pipe open and keep writing), ends the last partial line and closes.
  void finish();

 private:
  void readUpTo(size_t budget);
  void emit(const char* data, size_t n);

  comm::net::Fd fd_;
  int console_;
  std::string prefix_;
  bool prefixed_;
  comm::net::Fd file_;
  std::string partial_;
};

}  // namespace dtrain::run
