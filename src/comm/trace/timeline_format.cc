// The timeline's events as Chrome Trace Event Format JSON (one object per line), formatted by the
// writer thread from the raw fields the recording threads stored.
//
// Every op of a tight loop of small collectives becomes an event, so this is written for speed: each
// event is printed straight into the output string's tail (room reserved for its worst case, then
// trimmed), integers with std::to_chars; no format strings parsed per event.
#include <algorithm>
#include <charconv>
#include <cstring>
#include <string>
#include <vector>

#include "comm/trace/timeline_buffer.h"

namespace dtrain::comm::trace::timeline {

namespace {

// Prints into a reserved stretch of memory (the caller reserves the worst case).
struct Printer {
  char* p;

  void raw(const char* s, size_t n) {
    std::memcpy(p, s, n);
    p += n;
  }
  template <size_t N>
  void lit(const char (&s)[N]) {
    raw(s, N - 1);
  }
  template <typename T>
  void num(T v) {
    p = std::to_chars(p, p + 24, v).ptr;
  }
  // A JSON string (as detail::appendJsonQuoted, with every control character as \u00XX), straight into
  // reserved memory: this is the per-event path (worst case 6 bytes a byte).
  void str(const char* s) {
    *p++ = '"';
    static const char kHex[] = "0123456789abcdef";
    for (; *s; ++s) {
      const auto c = static_cast<unsigned char>(*s);
      if (c == '"' || c == '\\') {
        *p++ = '\\';
        *p++ = static_cast<char>(c);
      } else if (c < 0x20) {
        raw("\\u00", 4);
        *p++ = kHex[c >> 4];
        *p++ = kHex[c & 15];
      } else {
        *p++ = static_cast<char>(c);
      }
    }
    *p++ = '"';
  }
};

size_t escapedBound(const char* s) { return s ? 6 * std::strlen(s) + 2 : 2; }

// The most an event can print.
size_t bound(const Event& e) {
  size_t n = 512 + escapedBound(e.name) + escapedBound(e.cat);
  if (e.kind == Event::kOp) {
    const OpShape& s = *e.o.shape;
    n += escapedBound(s.group) + escapedBound(s.dtype) + escapedBound(s.algorithm) + escapedBound(e.o.text);
    return n + 24 * static_cast<size_t>(s.npeers) + escapedBound(e.name);
  }
  if (e.kind == Event::kFlowOut || e.kind == Event::kFlowIn) return n;  // (no args)
  for (const Arg& a : e.s.args) n += a.key ? escapedBound(a.key) + 24 : 0;
  return e.kind == Event::kAsync ? 2 * n : n;  // kAsync prints the common part twice
}

void name(Printer& o, const Event& e) {
  o.str(e.name);
  if (e.kind == Event::kOp || e.s.index < 0) return;
  --o.p;  // the closing quote: the index goes inside
  o.num(e.s.index);
  *o.p++ = '"';
}

// {"ph":P,"name":N,"cat":C,"ts":T,"pid":R,"tid":T  (no closing brace)
void common(Printer& o, char ph, const Event& e, int pid, uint64_t tid, int64_t ts) {
  o.lit("{\"ph\":\"");
  *o.p++ = ph;
  o.lit("\",\"name\":");
  name(o, e);
  o.lit(",\"cat\":");
  o.str(e.cat);
  o.lit(",\"ts\":");
  o.num(ts);
  o.lit(",\"pid\":");
  o.num(pid);
  o.lit(",\"tid\":");
  o.num(tid);
}

void args(Printer& o, const Event& e) {
  bool any = false;
  for (const Arg& a : e.s.args) {
    if (!a.key) continue;
    if (any) *o.p++ = ',';
    else o.lit(",\"args\":{");
    any = true;
    o.str(a.key);
    *o.p++ = ':';
    o.num(a.value);
  }
  if (any) *o.p++ = '}';
}

// An op's event in two parts: what stays the same from one op to the next in a loop (name, group, dtype,
// count, peers...), which ends inside "args", and what changes (sequence number, queue time, error,
// time and duration). The writer keeps the last op's first part as text (see OpPrefix).
void opPrefix(Printer& o, const Event& e, int pid, uint64_t tid) {
  const OpShape& s = *e.o.shape;
  o.lit("{\"ph\":\"X\",\"name\":");
  o.str(e.name);
  o.lit(",\"cat\":");
  o.str(e.cat);
  o.lit(",\"pid\":");
  o.num(pid);
  o.lit(",\"tid\":");
  o.num(tid);
  o.lit(",\"args\":{\"group\":");
  o.str(s.group);
  o.lit(",\"op\":");
  o.str(e.name);
  o.lit(",\"dtype\":");
  o.str(s.dtype);
  o.lit(",\"count\":");
  o.num(s.count);
  o.lit(",\"bytes\":");
  o.num(s.bytes);
  if (*s.algorithm) {
    o.lit(",\"algorithm\":");
    o.str(s.algorithm);
  }
  if (s.root >= 0) {
    o.lit(",\"root\":");
    o.num(s.root);
  }
  o.lit(",\"peers\":[");
  for (int i = 0; i < s.npeers; ++i) {
    if (i) *o.p++ = ',';
    o.num(s.peers[i]);
  }
  o.lit("],\"group_size\":");
  o.num(s.group_size);
}

void opRest(Printer& o, const Event& e, int64_t ts) {
  if (e.o.seq != OpRecord::kNoSeq) {
    o.lit(",\"seq\":");
    o.num(e.o.seq);
  }
  o.lit(",\"queued_us\":");
  o.num(e.o.queued_us);
  if (e.failed) {
    o.lit(",\"error\":");
    o.str(e.o.text ? e.o.text : "");
  }
  o.lit("},\"ts\":");
  o.num(ts);
  o.lit(",\"dur\":");
  o.num(e.dur);
  *o.p++ = '}';
}

// The last op's first part, and what it was printed from: a loop of one collective prints it once.
struct OpPrefix {
  bool valid = false;
  int pid = 0;
  uint64_t tid = 0;
  std::string name, cat, group, dtype, algorithm;
  uint64_t count = 0, bytes = 0;
  int64_t group_size = 0;
  int32_t root = -1;
  std::vector<int> peers;
  std::string text;

  // The shape it was last printed or matched from: the same pointer is the same shape (an op event's
  // name is its shape's op, its category always "comm"), until a chunk is handed back for reuse
  // (forgetShapes()).
  const OpShape* seen = nullptr;

  bool matches(const Event& e, int p, uint64_t t) {
    if (e.o.shape == seen && valid && p == pid && t == tid) return true;
    const OpShape& s = *e.o.shape;
    const bool same = valid && p == pid && t == tid && s.count == count && s.bytes == bytes && s.root == root &&
           s.group_size == group_size && static_cast<size_t>(s.npeers) == peers.size() &&
           std::equal(peers.begin(), peers.end(), s.peers) && name == e.name && cat == e.cat && group == s.group &&
           dtype == s.dtype && algorithm == s.algorithm;
    if (same) seen = e.o.shape;
    return same;
  }
  void keep(const Event& e, int p, uint64_t t, const char* from, const char* to) {
    const OpShape& s = *e.o.shape;
    valid = true;
    seen = e.o.shape;
    pid = p;
    tid = t;
    name = e.name;
    cat = e.cat;
    group = s.group;
    dtype = s.dtype;
    algorithm = s.algorithm;
    count = s.count;
    bytes = s.bytes;
    group_size = s.group_size;
    root = s.root;
    peers.assign(s.peers, s.peers + s.npeers);
    text.assign(from, to);
  }
};
thread_local OpPrefix t_last_op;  // the writer's (format() runs on the writer thread, or at exit)

void print(Printer& o, const Event& e, int pid, uint64_t tid, int64_t ts) {
  switch (e.kind) {
    case Event::kOp: {
      char* from = o.p;
      opPrefix(o, e, pid, tid);
      t_last_op.keep(e, pid, tid, from, o.p);
      opRest(o, e, ts);
      return;
    }
    case Event::kSpan:
      common(o, 'X', e, pid, tid, ts);
      o.lit(",\"dur\":");
      o.num(e.dur);
      args(o, e);
      *o.p++ = '}';
      return;
    case Event::kAsync:  // a begin and an end, on one line
      common(o, 'b', e, pid, tid, ts);
      o.lit(",\"id\":");
      o.num(e.s.id);
      args(o, e);
      o.lit("},");
      common(o, 'e', e, pid, tid, ts + e.dur);
      o.lit(",\"id\":");
      o.num(e.s.id);
      *o.p++ = '}';
      return;
    case Event::kFlowOut:
    case Event::kFlowIn:
      common(o, e.kind == Event::kFlowOut ? 's' : 'f', e, pid, tid, ts);
      o.lit(",\"id\":");
      o.num(e.s.id);
      if (e.kind == Event::kFlowIn) o.lit(",\"bp\":\"e\"");
      *o.p++ = '}';
      return;
  }
}

// A writer-thread buffer that only grows, so printing an event never clears memory first; the event
// is then appended to the output at its actual length.
char* scratch(size_t n) {
  static thread_local std::vector<char> buf;
  if (buf.size() < n) buf.resize(std::max(n, 2 * buf.size()));
  return buf.data();
}

}  // namespace

void forgetShapes() { t_last_op.seen = nullptr; }

void format(std::string& out, const Event& e, int pid, uint64_t tid, int64_t skew_us) {
  if (e.kind == Event::kOp && t_last_op.matches(e, pid, tid)) {  // a loop's next op: its first part is known
    const std::string& prefix = t_last_op.text;
    char* start = scratch(prefix.size() + 160 + (e.failed ? escapedBound(e.o.text) : 0));
    Printer o{start};
    o.lit("\n,");
    o.raw(prefix.data(), prefix.size());
    opRest(o, e, e.ts + skew_us);
    out.append(start, static_cast<size_t>(o.p - start));
    return;
  }
  char* start = scratch(bound(e) + 2);
  Printer o{start};
  o.lit("\n,");  // events follow the header's first entry, one a line
  print(o, e, pid, tid, e.ts + skew_us);
  out.append(start, static_cast<size_t>(o.p - start));
}

}  // namespace dtrain::comm::trace::timeline
