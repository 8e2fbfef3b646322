// The timeline's spool (timeline_spool.h): the writer thread's encoder and the reader that turns a spool
// back into the JSON events format() prints.
#include "comm/trace/timeline_spool.h"

#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "comm/util/json_text.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::trace::timeline {

namespace {

constexpr uint32_t kInline = 0xffffffffu;  // text stored here, once
constexpr uint32_t kDefine = 0xfffffffeu;  // an id, then its text: later references give the id only

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void putStr(std::string& out, const char* s, size_t n) {
  put<uint32_t>(out, static_cast<uint32_t>(n));
  out.append(s, n);
}

bool inArena(const char* p, const Chunk& c) { return p >= c.arena && p < c.arena + Chunk::kArena; }
// Flow events leave their args unset (format() prints none).
bool hasArgs(Event::Kind k) { return k == Event::kSpan || k == Event::kAsync; }

// Reads fields off the front of a record; ok() turns false when the data ends first.
struct Cursor {
  const char* p;
  const char* end;
  bool good = true;

  template <typename T>
  T get() {
    T v{};
    if (static_cast<size_t>(end - p) < sizeof v) {
      good = false;
      return v;
    }
    std::memcpy(&v, p, sizeof v);
    p += sizeof v;
    return v;
  }
  bool str(std::string& s) {
    const auto n = get<uint32_t>();
    if (!good || static_cast<size_t>(end - p) < n) return good = false;
    s.assign(p, n);
    p += n;
    return true;
  }
};

}  // namespace

void appendThreadName(std::string& out, int pid, uint64_t tid, const std::string& name) {
  fmt::format_to(std::back_inserter(out), "\n,{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":",
                 pid, tid);
  dtrain::detail::appendJsonQuoted(out, name);
  fmt::format_to(std::back_inserter(out), "}}}}\n,{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{},"
                 "\"args\":{{\"sort_index\":{}}}}}", pid, tid, tid);
}

// ---- writing ----

void SpoolWriter::begin(std::string& out, int pid, int64_t skew_us) {
  strings_.clear();
  shapes_.clear();
  next_id_ = 1;
  tid_ = ~uint64_t{0};
  out.append(kSpoolMagic, sizeof kSpoolMagic);
  put<int32_t>(out, pid);
  put<int64_t>(out, skew_us);
}

void SpoolWriter::threadName(std::string& out, uint64_t tid, const std::string& name) {
  out.push_back('N');
  put<uint64_t>(out, tid);
  putStr(out, name.data(), name.size());
}

void SpoolWriter::ref(std::string& out, const char* s, const Chunk& c) {
  if (!s) {
    put<uint32_t>(out, 0);
    return;
  }
  if (inArena(s, c)) {
    put<uint32_t>(out, kInline);
    putStr(out, s, std::strlen(s));
    return;
  }
  auto it = strings_.find(s);
  if (it != strings_.end() && it->second.text == s) {
    put<uint32_t>(out, it->second.id);
    return;
  }
  // New, or the caller's buffer now holds another name: defined here, referred to by id from now on.
  const uint32_t id = next_id_++;
  const size_t n = std::strlen(s);
  put<uint32_t>(out, kDefine);
  put<uint32_t>(out, id);
  putStr(out, s, n);
  strings_[s] = Literal{id, std::string(s, n)};
}

uint32_t SpoolWriter::shape(std::string& out, const Event& e, const Chunk& c) {
  const OpShape* s = e.o.shape;
  auto it = shapes_.find(s);
  if (it != shapes_.end() && it->second.name == e.name && it->second.cat == e.cat) return it->second.id;
  const uint32_t id = next_id_++;
  out.push_back('H');
  put<uint32_t>(out, id);
  put<int32_t>(out, s->root);
  put<int64_t>(out, s->group_size);
  put<uint64_t>(out, s->count);
  put<uint64_t>(out, s->bytes);
  put<int32_t>(out, s->npeers);
  out.append(reinterpret_cast<const char*>(s->peers), sizeof(int) * static_cast<size_t>(s->npeers));
  ref(out, s->group, c);
  ref(out, s->dtype, c);
  ref(out, s->algorithm, c);
  ref(out, e.name, c);
  ref(out, e.cat, c);
  shapes_[s] = Shape{id, e.name, e.cat};
  return id;
}

void SpoolWriter::event(std::string& out, const Event& e, const Chunk& c, uint64_t tid) {
  if (tid != tid_) {
    out.push_back('T');
    put<uint64_t>(out, tid);
    tid_ = tid;
  }
  const uint32_t shape_id = e.kind == Event::kOp ? shape(out, e, c) : 0;
  out.push_back('E');
  out.push_back(static_cast<char>(e.kind));
  out.push_back(static_cast<char>(e.failed));
  put<int64_t>(out, e.ts);
  put<int64_t>(out, e.dur);
  if (e.kind == Event::kOp) {
    put<uint32_t>(out, shape_id);
    put<uint64_t>(out, e.o.seq);
    put<int64_t>(out, e.o.queued_us);
  } else {
    put<int64_t>(out, e.s.index);
    put<uint64_t>(out, e.s.id);
    if (hasArgs(e.kind))
      for (const Arg& a : e.s.args) put<int64_t>(out, a.value);
  }
  if (e.kind == Event::kOp) {  // (its name and category are its shape's)
    if (e.failed) ref(out, e.o.text ? e.o.text : "", c);
    return;
  }
  ref(out, e.name, c);
  ref(out, e.cat, c);
  if (hasArgs(e.kind))
    for (const Arg& a : e.s.args) ref(out, a.key, c);
}

// ---- reading ----

namespace {
bool plausibleUs(int64_t us) { return us > -(int64_t{1} << 52) && us < (int64_t{1} << 52); }
}  // namespace

size_t SpoolReader::header(const char* data, size_t n) {
  if (n < kSpoolHeader || std::memcmp(data, kSpoolMagic, sizeof kSpoolMagic) != 0)
    throw InvalidArgument("not a timeline spool (no DTSPOOL1 header)");
  std::memcpy(&pid_, data + 8, sizeof pid_);
  std::memcpy(&skew_us_, data + 12, sizeof skew_us_);
  if (!plausibleUs(skew_us_)) throw InvalidArgument(fmt::format("timeline spool: clock skew {} us: corrupt", skew_us_));
  return kSpoolHeader;
}

namespace {

// A string reference (see ref()); false when the data ends first.
bool readRef(Cursor& in, std::deque<std::string>& text, std::unordered_map<uint32_t, const char*>& ids,
             const char*& out) {
  const auto code = in.get<uint32_t>();
  if (!in.good) return false;
  if (code == 0) {
    out = nullptr;
    return true;
  }
  uint32_t id = 0;
  if (code == kDefine) id = in.get<uint32_t>();
  if (code == kInline || code == kDefine) {
    std::string s;
    if (!in.str(s)) return false;
    text.push_back(std::move(s));
    out = text.back().c_str();
    if (code == kDefine) ids[id] = out;
    return true;
  }
  auto it = ids.find(code);
  if (it == ids.end()) throw InvalidArgument(fmt::format("timeline spool refers to string {} before defining it", code));
  out = it->second;
  return true;
}

}  // namespace

size_t SpoolReader::read(const char* data, size_t n, std::string& out) {
  Cursor in{data, data + n};
  auto ref = [&](const char*& s) { return readRef(in, text_, strings_, s); };
  size_t done = 0;
  while (in.p < in.end) {
    const char type = *in.p++;
    if (type == 'T') {
      tid_ = in.get<uint64_t>();
    } else if (type == 'N') {
      const auto tid = in.get<uint64_t>();
      std::string name;
      if (in.str(name)) appendThreadName(out, pid_, tid, name);
    } else if (type == 'H') {
      OpShape s;
      const auto id = in.get<uint32_t>();
      s.root = in.get<int32_t>();
      s.group_size = in.get<int64_t>();
      s.count = in.get<uint64_t>();
      s.bytes = in.get<uint64_t>();
      s.npeers = in.get<int32_t>();
      if (!in.good || s.npeers < 0) break;
      const size_t pb = sizeof(int) * static_cast<size_t>(s.npeers);
      if (static_cast<size_t>(in.end - in.p) < pb) break;
      std::vector<int> peers(static_cast<size_t>(s.npeers));
      if (pb) std::memcpy(peers.data(), in.p, pb);  // no peers: data() may be null, which memcpy may not get
      in.p += pb;
      const char *group = nullptr, *dtype = nullptr, *algorithm = nullptr, *name = nullptr, *cat = nullptr;
      if (!ref(group) || !ref(dtype) || !ref(algorithm) || !ref(name) || !ref(cat)) break;
      s.op = name ? name : "";
      peers_.push_back(std::move(peers));
      s.peers = peers_.back().data();
      s.group = group ? group : "";
      s.dtype = dtype ? dtype : "";
      s.algorithm = algorithm ? algorithm : "";
      shapes_.push_back(Shape{s, s.op, cat ? cat : ""});
      shape_ids_[id] = &shapes_.back();
    } else if (type == 'E') {
      Event e;
      e.kind = static_cast<Event::Kind>(in.get<uint8_t>());
      e.failed = in.get<uint8_t>() != 0;
      e.ts = in.get<int64_t>();
      e.dur = in.get<int64_t>();
      // Times are microseconds on the trace clock: beyond 2^52 (~140 years) the spool is corrupt (and the
      // sums made when formatting, ts + skew, ts + dur, could overflow).
      if (in.good && (!plausibleUs(e.ts) || !plausibleUs(e.dur))) {
        throw InvalidArgument(fmt::format("timeline spool: event time {} us, duration {} us at byte {}: corrupt",
                                          e.ts, e.dur, done));
      }
      if (e.kind == Event::kOp) {
        const auto id = in.get<uint32_t>();
        e.o.seq = in.get<uint64_t>();
        e.o.queued_us = in.get<int64_t>();
        if (!in.good) break;
        auto it = shape_ids_.find(id);
        if (it == shape_ids_.end()) throw InvalidArgument(fmt::format("timeline spool: op of undefined shape {}", id));
        e.o.shape = &it->second->shape;
        e.name = it->second->name;
        e.cat = it->second->cat;
        e.o.text = nullptr;
        if (e.failed && !ref(e.o.text)) break;
        format(out, e, pid_, tid_, skew_us_);
      } else if (e.kind <= Event::kFlowIn) {
        e.s.index = in.get<int64_t>();
        e.s.id = in.get<uint64_t>();
        for (Arg& a : e.s.args) a = Arg{nullptr, hasArgs(e.kind) ? in.get<int64_t>() : 0};
      } else {
        throw InvalidArgument(fmt::format("timeline spool: event of unknown kind {}", static_cast<int>(e.kind)));
      }
      if (e.kind != Event::kOp) {
        const char *name = nullptr, *cat = nullptr;
        if (!ref(name) || !ref(cat)) break;
        e.name = name ? name : "";
        e.cat = cat ? cat : "";
        bool whole = true;
        if (hasArgs(e.kind))
          for (Arg& a : e.s.args) whole = whole && ref(a.key);
        if (!whole) break;
        format(out, e, pid_, tid_, skew_us_);
      }
    } else {
      throw InvalidArgument(fmt::format("timeline spool: unknown record type {} at byte {}", static_cast<int>(type), done));
    }
    if (!in.good) break;
    done = static_cast<size_t>(in.p - data);
  }
  return done;
}

std::string spoolFileToJson(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw IoError(fmt::format("cannot read {}", path));
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string bytes = ss.str();
  std::string out;
  if (bytes.empty()) return out;  // emptied after its events went into the JSON
  SpoolReader r;
  try {
    const size_t h = r.header(bytes.data(), bytes.size());
    r.read(bytes.data() + h, bytes.size() - h, out);
  } catch (const Error& e) {
    throw InvalidArgument(fmt::format("{}: {}", path, e.what()));
  }
  return out;
}

}  // namespace dtrain::comm::trace::timeline
