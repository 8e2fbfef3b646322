// A flight-recorder dump: the JSON text (formatted only here, at dump time) and its file, written
// through a temporary file and a rename so that a reader never sees half a dump. The format is
// described in docs/OBSERVABILITY.md; tools/trace/flight_analysis.cc reads it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <map>

#include "comm/net/socket.h"
#include "comm/trace/flight_recorder.h"
#include "comm/util/json_text.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::trace::flight {

namespace {

using dtrain::detail::jsonQuoted;

std::string orNull(int64_t us) { return us == 0 ? "null" : std::to_string(us); }


std::string formatEntry(const Entry& e) {
  const GroupInfo* g = e.group;
  std::string peers;
  const size_t kept = std::min<size_t>(e.npeers, Entry::kInlinePeers);
  for (size_t i = 0; i < kept; ++i) {
    peers += fmt::format("{}{}", i ? ", " : "", g ? g->globalRank(e.peers[i]) : e.peers[i]);
  }
  std::string out = fmt::format(
      "{{\"id\": {}, \"group\": {}, \"seq\": {}, \"op\": {}, \"dtype\": {}, \"count\": {}, \"bytes\": {}, "
      "\"root\": {}, \"peers\": [{}], \"peers_total\": {}, \"algorithm\": {}, \"state\": \"{}\", "
      "\"issued_us\": {}, \"started_us\": {}, \"finished_us\": {}",
      e.id, jsonQuoted(g ? g->name : ""), e.seq == OpRecord::kNoSeq ? "null" : std::to_string(e.seq), jsonQuoted(e.op),
      jsonQuoted(e.dtype), e.count, e.bytes, e.root >= 0 && g ? g->globalRank(e.root) : e.root, peers, e.npeers,
      jsonQuoted(e.algorithm), stateName(e.state), e.issued_us, orNull(e.started_us), orNull(e.finished_us));
  if (e.state == State::failed) out += ", \"error\": " + jsonQuoted(e.error);
  return out + "}";
}

// Every group the entries name, once: this process's rank in it and its members' world ranks.
std::string formatGroups(const std::vector<Entry>& entries) {
  std::map<std::string, const GroupInfo*> groups;
  for (const auto& e : entries)
    if (e.group) groups.emplace(e.group->name, e.group);
  std::string out;
  for (const auto& [name, g] : groups) {
    out += fmt::format("{}\n    {}: {{\"rank\": {}, \"size\": {}, \"ranks\": [{}]}}", out.empty() ? "" : ",",
                       jsonQuoted(name), g->rank, g->size, fmt::join(g->global_ranks, ", "));
  }
  return out;
}

std::string formatSpans(const std::vector<::dtrain::trace::OpenSpans>& threads, int64_t now) {
  std::string out;
  for (const auto& t : threads) {
    std::string spans;
    for (size_t i = 0; i < t.names.size(); ++i) {
      spans += fmt::format("{}{{\"name\": {}, \"since_us\": {}, \"open_us\": {}}}", i ? ", " : "",
                           jsonQuoted(t.names[i]), t.since_us[i], now - t.since_us[i]);
    }
    out += fmt::format("{}\n    {{\"thread\": {}, \"name\": {}, \"spans\": [{}]}}", out.empty() ? "" : ",", t.thread,
                       jsonQuoted(t.thread_name), spans);
  }
  return out;
}

void makeDirs(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    std::string part = dir.substr(0, pos);
    if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) {
      throw IoError(fmt::format("cannot create the dump directory {}: {}", part, std::strerror(errno)));
    }
  }
}

}  // namespace

std::string formatDump(const Snapshot& s, const std::string& reason,
                       const std::vector<::dtrain::trace::OpenSpans>& spans) {
  const int64_t steady = nowUs();
  const int64_t wall = std::chrono::duration_cast<std::chrono::microseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  std::string out = fmt::format(
      "{{\n  \"format\": \"dtrain-flight-recorder\", \"version\": 1,\n  \"rank\": {}, \"world_size\": {}, "
      "\"host\": {}, \"pid\": {}, \"job\": {},\n  \"reason\": {},\n  \"wall_us\": {}, \"steady_us\": {},\n"
      "  \"capacity\": {}, \"recorded\": {}, \"dropped\": {},\n  \"groups\": {{{}\n  }},\n  \"entries\": [",
      s.rank, s.world_size, jsonQuoted(net::hostName()), ::getpid(), jsonQuoted(s.job), jsonQuoted(reason), wall, steady, s.capacity,
      s.recorded, s.recorded - s.entries.size(), formatGroups(s.entries));
  for (size_t i = 0; i < s.entries.size(); ++i) out += (i ? ",\n    " : "\n    ") + formatEntry(s.entries[i]);
  out += "\n  ],\n  \"threads\": [" + formatSpans(spans, steady) + "\n  ]\n}\n";
  return out;
}

std::string writeDumpFile(const std::string& dir, const std::string& stem, const std::string& text) {
  makeDirs(dir);
  const std::string path = dir + "/" + stem + ".json";
  const std::string tmp = fmt::format("{}/.{}.json.{}.tmp", dir, stem, ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("cannot create {}: {}", tmp, std::strerror(errno)));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError(fmt::format("cannot write {}: {}", tmp, std::strerror(err)));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("cannot rename {} to {}: {}", tmp, path, std::strerror(err)));
  }
  return path;
}

}  // namespace dtrain::comm::trace::flight
