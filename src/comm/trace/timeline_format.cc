// The timeline's events as Chrome Trace Event Format JSON (one object per line), formatted by the
// writer thread from the raw fields the recording threads stored.
#include <fmt/format.h>

#include <iterator>

#include "comm/trace/timeline_buffer.h"

namespace dtrain::comm::trace::timeline {

void appendJsonString(std::string& out, const char* s) {
  out += '"';
  for (const char* p = s; *p; ++p) {
    const auto c = static_cast<unsigned char>(*p);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      fmt::format_to(std::back_inserter(out), "\\u{:04x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

namespace {

void appendName(std::string& out, const Event& e) {
  if (e.index < 0) return appendJsonString(out, e.name);
  appendJsonString(out, e.name);
  out.pop_back();  // the closing quote: the index goes inside
  fmt::format_to(std::back_inserter(out), "{}\"", e.index);
}

// {"ph":P,"name":N,"cat":C,"ts":T,"pid":R,"tid":T  (no closing brace)
void appendCommon(std::string& out, const char* ph, const Event& e, int pid, uint64_t tid, int64_t ts) {
  fmt::format_to(std::back_inserter(out), "{{\"ph\":\"{}\",\"name\":", ph);
  appendName(out, e);
  out += ",\"cat\":";
  appendJsonString(out, e.cat);
  fmt::format_to(std::back_inserter(out), ",\"ts\":{},\"pid\":{},\"tid\":{}", ts, pid, tid);
}

void appendArgs(std::string& out, const Event& e) {
  bool any = false;
  for (const Arg& a : e.args) {
    if (!a.key) continue;
    out += any ? "," : ",\"args\":{";
    any = true;
    appendJsonString(out, a.key);
    fmt::format_to(std::back_inserter(out), ":{}", a.value);
  }
  if (any) out += '}';
}

void appendOpArgs(std::string& out, const Event& e) {
  out += ",\"args\":{\"group\":";
  appendJsonString(out, e.group);
  if (e.seq != OpRecord::kNoSeq) fmt::format_to(std::back_inserter(out), ",\"seq\":{}", e.seq);
  out += ",\"op\":";
  appendJsonString(out, e.name);
  out += ",\"dtype\":";
  appendJsonString(out, e.op_dtype);
  fmt::format_to(std::back_inserter(out), ",\"count\":{},\"bytes\":{}", e.count, e.bytes);
  if (*e.algorithm) {
    out += ",\"algorithm\":";
    appendJsonString(out, e.algorithm);
  }
  if (e.root >= 0) fmt::format_to(std::back_inserter(out), ",\"root\":{}", e.root);
  out += ",\"peers\":[";
  for (int i = 0; i < e.npeers; ++i) fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", e.peers[i]);
  fmt::format_to(std::back_inserter(out), "],\"{}\":{},\"queued_us\":{}", e.args[0].key, e.args[0].value, e.queued_us);
  if (e.failed) {
    out += ",\"error\":";
    appendJsonString(out, e.text ? e.text : "");
  }
  out += '}';
}

}  // namespace

void format(std::string& out, const Event& e, int pid, uint64_t tid, int64_t skew_us) {
  const int64_t ts = e.ts + skew_us;
  switch (e.kind) {
    case Event::kSpan:
    case Event::kOp:
      appendCommon(out, "X", e, pid, tid, ts);
      fmt::format_to(std::back_inserter(out), ",\"dur\":{}", e.dur);
      if (e.kind == Event::kOp) appendOpArgs(out, e);
      else appendArgs(out, e);
      out += '}';
      return;
    case Event::kAsync:  // a begin and an end, on one line
      appendCommon(out, "b", e, pid, tid, ts);
      fmt::format_to(std::back_inserter(out), ",\"id\":{}", e.id);
      appendArgs(out, e);
      out += "},";
      appendCommon(out, "e", e, pid, tid, ts + e.dur);
      fmt::format_to(std::back_inserter(out), ",\"id\":{}}}", e.id);
      return;
    case Event::kFlowOut:
    case Event::kFlowIn:
      appendCommon(out, e.kind == Event::kFlowOut ? "s" : "f", e, pid, tid, ts);
      fmt::format_to(std::back_inserter(out), ",\"id\":{}{}}}", e.id, e.kind == Event::kFlowIn ? ",\"bp\":\"e\"" : "");
      return;
  }
}

}  // namespace dtrain::comm::trace::timeline
