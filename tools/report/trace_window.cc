// A merged Chrome trace -> the few steps the report's timeline draws. The file is parsed once with a
// callback that turns each event into a small struct as it is read, so the whole trace is never held as
// a JSON tree.
#include "trace_window.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <tuple>
#include <vector>

#include "dtrain/comm/error.h"

namespace dtrain::report {
namespace {

using nlohmann::json;

struct Event {
  int64_t pid = 0, tid = 0;
  double ts = 0, dur = 0;  // microseconds
  std::string name, cat;
  json args;
};

// What marks a step, in order of preference: DDP's forward pass, else its backward pass (a loop that
// calls the model itself and marks no "forward" span).
const char* const kAnchors[] = {"forward", "backward"};
constexpr int64_t kAsyncTid = -1;  // the row of a rank's async (b/e) events, e.g. DDP buckets

struct Trace {
  std::vector<Event> events;                  // the X events, and the b/e pairs as if they were X events
  std::map<std::string, std::vector<double>> anchors;  // starts of kAnchors' events on pid 0, by name
  std::map<int64_t, std::string> process_names;
  std::map<int64_t, int64_t> process_order;
  std::map<std::pair<int64_t, int64_t>, std::string> thread_names;
  std::map<std::pair<int64_t, int64_t>, int64_t> thread_order;
  // Open async events by (pid, cat, name, id): their starts and args, the innermost last.
  std::map<std::tuple<int64_t, std::string, std::string, std::string>, std::vector<std::pair<double, json>>> open;
  json other_data;
  size_t skipped = 0;  // X, b and e events without numeric pid, tid, ts (or dur)
};

std::string argName(const json& e) {
  auto a = e.find("args");
  if (a == e.end() || !a->is_object()) return {};
  auto n = a->find("name");
  return n != a->end() && n->is_string() ? n->get<std::string>() : std::string{};
}

int64_t argSortIndex(const json& e) {
  auto a = e.find("args");
  if (a == e.end() || !a->is_object()) return 0;
  auto n = a->find("sort_index");
  return n != a->end() && n->is_number() ? n->get<int64_t>() : 0;
}

// A b/e pair (matched by pid, cat, name and id) becomes one event on the rank's async row; the args of
// both ends are merged. An end without a start is dropped; a start never ended is not drawn.
void takeAsync(Trace& t, json& e, int64_t pid, bool begin) {
  auto id = e.find("id");
  if (id == e.end()) id = e.find("id2");
  auto key = std::make_tuple(pid, e.value("cat", ""), e.value("name", ""), id == e.end() ? "" : id->dump());
  const double ts = e["ts"].get<double>();
  json args = e.contains("args") && e["args"].is_object() ? std::move(e["args"]) : json::object();
  if (begin) {
    t.open[key].emplace_back(ts, std::move(args));
    return;
  }
  auto it = t.open.find(key);
  if (it == t.open.end() || it->second.empty()) return;
  auto [start, start_args] = std::move(it->second.back());
  it->second.pop_back();
  start_args.update(args);
  t.events.push_back({pid, kAsyncTid, start, ts - start, std::get<2>(key), std::get<1>(key), std::move(start_args)});
}

// Returns false when `e` is not a trace event (no "ph"), so the parser keeps it (e.g. inside otherData).
bool take(Trace& t, json& e) {
  auto ph = e.find("ph");
  if (ph == e.end() || !ph->is_string()) return false;
  const auto& p = ph->get_ref<const std::string&>();
  auto num = [&](const char* key) { auto it = e.find(key); return it != e.end() && it->is_number(); };
  const bool timed = p == "X" || p == "b" || p == "e";
  if (!num("pid") || (p != "M" && !num("tid")) || (timed && !num("ts")) || (p == "X" && !num("dur"))) {
    if (timed) ++t.skipped;
    return true;
  }
  const int64_t pid = e["pid"].get<int64_t>();
  const int64_t tid = num("tid") ? e["tid"].get<int64_t>() : 0;
  if (p == "M") {
    const std::string what = e.value("name", "");
    if (what == "process_name") t.process_names[pid] = argName(e);
    if (what == "process_sort_index") t.process_order[pid] = argSortIndex(e);
    if (what == "thread_name") t.thread_names[{pid, tid}] = argName(e);
    if (what == "thread_sort_index") t.thread_order[{pid, tid}] = argSortIndex(e);
  } else if (p == "X") {
    Event ev{pid, tid, e["ts"].get<double>(), e["dur"].get<double>(), e.value("name", ""), e.value("cat", ""), {}};
    if (auto a = e.find("args"); a != e.end()) ev.args = std::move(*a);
    if (pid == 0 && (ev.name == kAnchors[0] || ev.name == kAnchors[1])) t.anchors[ev.name].push_back(ev.ts);
    t.events.push_back(std::move(ev));
  } else if (p == "b" || p == "e") {
    takeAsync(t, e, pid, p == "b");
  }
  return true;
}

Trace parseTrace(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open for reading", file.string()));
  Trace t;
  int event_depth = -1;  // 1 for the array form [ev, ...], 2 for {"traceEvents": [ev, ...], ...}
  json::parser_callback_t cb = [&](int depth, json::parse_event_t what, json& parsed) {
    if (depth == 0 && event_depth < 0) event_depth = what == json::parse_event_t::array_start ? 1 : 2;
    if (what == json::parse_event_t::object_end && depth == event_depth) return !take(t, parsed);
    return true;
  };
  json top;
  try {
    top = json::parse(in, cb);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: not a valid Chrome trace ({})", file.string(), e.what()));
  }
  if (top.is_object()) {
    if (!top.contains("traceEvents")) throw Error(fmt::format("{}: no \"traceEvents\" array", file.string()));
    if (top.contains("otherData")) t.other_data = top["otherData"];
  } else if (!top.is_array()) {
    throw Error(fmt::format("{}: neither {{\"traceEvents\": [...]}} nor an array of events", file.string()));
  }
  for (auto& [name, starts] : t.anchors) std::sort(starts.begin(), starts.end());
  return t;
}

struct Window {
  double start = 0, end = 0;  // [start, end) in microseconds
  std::string how;            // how it was chosen, for the page
};

Window chooseWindow(const Trace& t, const TraceWindowOptions& o) {
  const auto want = static_cast<size_t>(o.skip + o.steps);
  const std::vector<double> none;
  const std::vector<double>* f = &none;
  std::string anchor;
  for (const char* name : kAnchors) {  // the first with enough steps, else the first there is
    auto it = t.anchors.find(name);
    if (it == t.anchors.end()) continue;
    if (anchor.empty() || (f->size() <= want && it->second.size() > want)) {
      f = &it->second;
      anchor = name;
    }
  }
  if (f->size() > want) {
    return {(*f)[o.skip], (*f)[want],
            fmt::format("steps {} to {} of rank 0 (from the start of its {} {} to that of {} {})", o.skip + 1, want,
                        anchor, o.skip + 1, anchor, want + 1)};
  }
  double first = t.events.front().ts, last = first;
  for (const auto& e : t.events) {
    first = std::min(first, e.ts);
    last = std::max(last, e.ts + e.dur);
  }
  const size_t which = std::min(f->size(), static_cast<size_t>(o.skip) + 1);  // 1-based
  const double start = f->empty() ? first : (*f)[which - 1];
  // Not past the trace's end (a short trace's page shows no empty tail).
  const double end = std::max(std::min(start + o.window_ms * 1000, last), start + 1);
  if (f->empty()) {
    return {start, end, fmt::format("no forward or backward on rank 0 in the trace: its first {:g} ms at most",
                                    o.window_ms)};
  }
  return {start, end,
          fmt::format("too few {} events on rank 0 ({}) for {} step(s) after {}: {:g} ms at most from {} {}", anchor,
                      f->size(), o.steps, o.skip, o.window_ms, anchor, which)};
}

std::string rowLabel(const Trace& t, int64_t pid, int64_t tid) {
  auto p = t.process_names.find(pid);
  auto th = t.thread_names.find({pid, tid});
  std::string process = p != t.process_names.end() && !p->second.empty() ? p->second : fmt::format("rank {}", pid);
  std::string thread = tid == kAsyncTid ? "async"
                       : th != t.thread_names.end() && !th->second.empty() ? th->second
                                                                           : fmt::format("tid {}", tid);
  return process + " · " + thread;
}

}  // namespace

TraceWindow readTraceWindow(const std::filesystem::path& file, const TraceWindowOptions& opts) {
  Trace t = parseTrace(file);
  if (t.events.empty()) throw Error(fmt::format("{}: no complete (\"ph\": \"X\") events", file.string()));
  const Window window = chooseWindow(t, opts);
  const double start = window.start, end = window.end;

  std::vector<const Event*> in;
  for (const auto& e : t.events) {
    if (e.ts < end && e.ts + e.dur > start) in.push_back(&e);
  }
  std::sort(in.begin(), in.end(), [](const Event* a, const Event* b) { return a->ts < b->ts; });
  const size_t in_window = in.size();
  if (in.size() > opts.max_events) in.resize(opts.max_events);
  // Rows in the trace's own order (sort_index metadata, then pid and tid); depth = nesting within a row.
  auto rowKey = [&](const Event* e) {
    auto po = t.process_order.find(e->pid);
    auto to = t.thread_order.find({e->pid, e->tid});
    const int64_t thread_order = e->tid == kAsyncTid               ? std::numeric_limits<int64_t>::max()  // last
                                 : to == t.thread_order.end() ? 0
                                                              : to->second;
    return std::make_tuple(po == t.process_order.end() ? 0 : po->second, e->pid, thread_order, e->tid);
  };
  std::stable_sort(in.begin(), in.end(), [&](const Event* a, const Event* b) {
    auto ka = rowKey(a), kb = rowKey(b);
    if (ka != kb) return ka < kb;
    return a->ts != b->ts ? a->ts < b->ts : a->dur > b->dur;  // a parent before the children it starts with
  });
  json rows = json::array(), events = json::array();
  std::vector<double> lanes;  // per lane of the current row, when its last event ends
  for (size_t i = 0; i < in.size(); ++i) {
    const Event& e = *in[i];
    if (i == 0 || rowKey(in[i - 1]) != rowKey(in[i])) {
      rows.push_back({{"label", rowLabel(t, e.pid, e.tid)}, {"pid", e.pid}, {"tid", e.tid}});
      lanes.clear();
    }
    // The lowest free lane: an event's nesting depth when events nest (a parent comes before the
    // children it starts with), and a lane of their own for async events that overlap.
    size_t depth = 0;
    while (depth < lanes.size() && lanes[depth] > e.ts) ++depth;
    if (depth == lanes.size()) lanes.push_back(0);
    lanes[depth] = e.ts + e.dur;
    auto ms = [&](double us) { return std::round((std::clamp(us, start, end) - start)) / 1000.0; };
    std::string args = e.args.is_null() ? "" : e.args.dump(-1, ' ', false, json::error_handler_t::replace);
    if (args.size() > 400) args = args.substr(0, 397) + "...";
    // [row, start, end (both clipped to the window), depth, name, cat, duration, args, unclipped start] (ms)
    events.push_back({rows.size() - 1, ms(e.ts), ms(e.ts + e.dur), depth, e.name, e.cat, e.dur / 1000.0, args,
                      std::round(e.ts - start) / 1000.0});
  }
  TraceWindow w;
  w.total_events = t.events.size();
  w.shown_events = in.size();
  w.rows = rows.size();
  w.data = {{"window", {{"start_us", start}, {"end_us", end}, {"length_ms", (end - start) / 1000.0}, {"how", window.how}}},
            {"rows", rows},
            {"events", events},
            {"in_window", in_window},
            {"total_events", t.events.size()},
            {"skipped_events", t.skipped},
            {"other_data", t.other_data}};
  return w;
}

}  // namespace dtrain::report
