// Collective benchmarks, printed as nccl-tests columns:
//   size (bytes), count (elements), type, time_us, algbw and busbw (GB/s), #wrong, then rank 0's p50,
//   p90, p99 and max us per call.
// size is the bytes each rank contributes to allreduce / broadcast / reduce_scatter (the input) and
// the output bytes of allgather, as nccl-tests counts them. time_us is the mean time of one op, the
// slowest rank's; the percentiles are rank 0's per-op times. busbw = algbw x 2(n-1)/n for allreduce,
// x (n-1)/n for allgather and reduce_scatter, x 1 for broadcast.
// The iteration count comes from a warm-up (about --seconds of timed work per size, agreed by all
// ranks). Results are verified after the timed loop: every rank checks every element of the last
// result against values it computes itself, and #wrong is the total over ranks. A rank that found
// wrong elements says so on stderr and exits 1 itself, since the total is summed by the very
// collectives being measured.
// Progress on stderr counts the sizes; --metrics FILE adds a bench record per size (observe.h).
// --timeline-blocks N (with DTRAIN_TIMELINE) also measures the timeline's cost (timelineBlocks()).
#include "collectives_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <utility>
#include <vector>

#include "dtrain/comm/element.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"
#include "dtrain/trace.h"
#include "observe.h"

namespace dtrain::bench {
namespace {

using comm::DType;
using comm::ProcessGroup;
using comm::ReduceOp;
using Clock = std::chrono::steady_clock;
using dtrain::Progress;
using dtrain::Record;

struct Options {
  std::string transport = "auto";
  std::string algo = "auto";
  std::string dtype = "f32";
  size_t min_bytes = 4;
  size_t max_bytes = 64u << 20;
  double factor = 2;
  int iters = 0;  // 0: from the warm-up
  double seconds = 0.3;
  int64_t timeline_blocks = 0;  // > 0 with DTRAIN_TIMELINE: alternate blocks of this many ops, paused / recording
  Observe observe;
};

enum class Coll { allreduce, allgather, reduce_scatter, broadcast };

const char* name(Coll c) {
  switch (c) {
    case Coll::allreduce: return "allreduce";
    case Coll::allgather: return "allgather";
    case Coll::reduce_scatter: return "reduce_scatter";
    case Coll::broadcast: return "broadcast";
  }
  return "?";
}

double busFactor(Coll c, int n) {
  switch (c) {
    case Coll::allreduce: return 2.0 * (n - 1) / n;
    case Coll::allgather:
    case Coll::reduce_scatter: return static_cast<double>(n - 1) / n;
    case Coll::broadcast: return 1.0;
  }
  return 1;
}

// Values small enough to be exact in every dtype after summing over the ranks.
double valueOf(int rank, size_t i) { return static_cast<double>((rank + 1 + i) % 4); }

void setElem(void* buf, DType t, size_t i, double v) { comm::storeElement(buf, t, i, v); }
double getElem(const void* buf, DType t, size_t i) { return comm::loadElement(buf, t, i); }

class Runner {
 public:
  Runner(ProcessGroup& pg, Coll c, DType t, size_t count, comm::AllreduceAlgorithm algo)
      : pg_(pg), c_(c), t_(t), count_(count), algo_(algo) {
    const int n = pg.size(), r = pg.rank();
    size_t es = comm::dtypeSize(t);
    // count_ is the element count of "size": per-rank blocks are count_ / n for allgather/reduce_scatter.
    block_ = (c == Coll::allgather || c == Coll::reduce_scatter) ? count_ / n : count_;
    size_t in_elems = c == Coll::allgather ? block_ : count_;
    size_t out_elems = c == Coll::reduce_scatter ? block_ : count_;
    in_.resize(std::max<size_t>(in_elems * es, 1));
    out_.resize(std::max<size_t>(out_elems * es, 1));
    for (size_t i = 0; i < in_elems; ++i) {
      size_t gi = c == Coll::allgather ? r * block_ + i : i;
      setElem(in_.data(), t, i, c == Coll::broadcast && r != 0 ? 0.0 : valueOf(r, gi));
    }
  }

  void once() {
    switch (c_) {
      case Coll::allreduce:
        pg_.allreduce(in_.data(), out_.data(), count_, t_, ReduceOp::sum, algo_)->wait();
        break;
      case Coll::allgather: pg_.allgather(in_.data(), out_.data(), block_, t_)->wait(); break;
      case Coll::reduce_scatter: pg_.reduceScatter(in_.data(), out_.data(), block_, t_)->wait(); break;
      case Coll::broadcast: pg_.broadcast(in_.data(), count_, t_, 0)->wait(); break;
    }
  }

  // Elements of the last result that are wrong on this rank.
  int64_t wrong() const {
    const int n = pg_.size(), r = pg_.rank();
    int64_t bad = 0;
    auto sumAt = [&](size_t gi) {
      double s = 0;
      for (int q = 0; q < n; ++q) s += valueOf(q, gi);
      return s;
    };
    switch (c_) {
      case Coll::allreduce:
        for (size_t i = 0; i < count_; ++i) bad += getElem(out_.data(), t_, i) != sumAt(i);
        break;
      case Coll::allgather:
        for (size_t i = 0; i < block_ * n; ++i) bad += getElem(out_.data(), t_, i) != valueOf(static_cast<int>(i / block_), i);
        break;
      case Coll::reduce_scatter:
        for (size_t i = 0; i < block_; ++i) bad += getElem(out_.data(), t_, i) != sumAt(r * block_ + i);
        break;
      case Coll::broadcast:
        for (size_t i = 0; i < count_; ++i) bad += getElem(in_.data(), t_, i) != valueOf(0, i);
        break;
    }
    return bad;
  }

 private:
  ProcessGroup& pg_;
  Coll c_;
  DType t_;
  size_t count_, block_ = 0;
  comm::AllreduceAlgorithm algo_;
  std::vector<uint8_t> in_, out_;
};


double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t k = static_cast<size_t>(std::min<double>(v.size() - 1, std::floor(p * (v.size() - 1) + 0.5)));
  return v[k];
}

// The timeline's cost in one process, so that the machine's drifts cancel: blocks of `block` ops
// alternately with recording paused and on, each recording block ending with trace::flushSpool() (so its
// time includes the writer's work for every event it made; the JSON is made at exit, as in a run). The machine switches now and then between a fast
// and a slow mode (where the threads land), so the cost is the median over the pairs of each pair's
// ratio; the op times are the medians of each kind's blocks (rank 0's).
struct TimelineCost {
  double paused_us = 0, recording_us = 0, ratio = 0;
};
TimelineCost timelineBlocks(ProcessGroup& pg, const std::function<void()>& once, int64_t block, int64_t pairs) {
  std::vector<double> off, on, ratio;
  for (int64_t p = 0; p < pairs; ++p) {
    for (bool record : {false, true}) {
      trace::setTimelineRecording(record);
      pg.barrier()->wait();
      auto t0 = Clock::now();
      for (int64_t i = 0; i < block; ++i) once();
      if (record) trace::flushSpool();
      (record ? on : off).push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / block);
    }
    ratio.push_back(on.back() / off.back());
  }
  trace::setTimelineRecording(true);
  return {percentile(off, 0.5), percentile(on, 0.5), percentile(ratio, 0.5)};
}

int run(Coll c, const Options& o) {
  comm::InitOptions io;
  io.group = comm::GroupOptions::fromEnv();
  io.group->transport = o.transport;
  auto pg = comm::initWorld(io);
  const int n = pg->size(), r = pg->rank();
  DType t = comm::parseDType(o.dtype);
  size_t es = comm::dtypeSize(t);
  auto algo = o.algo == "ring" ? comm::AllreduceAlgorithm::ring
              : o.algo == "rd" ? comm::AllreduceAlgorithm::recursive_doubling
              : o.algo == "direct" ? comm::AllreduceAlgorithm::direct
              : o.algo == "hierarchical" ? comm::AllreduceAlgorithm::hierarchical
                               : comm::AllreduceAlgorithm::automatic;
  if (r == 0) {
    fmt::print("# dtrain-bench {}: world={} transport={} dtype={} algo={}\n", name(c), n, pg->transportName(),
               comm::dtypeName(t), o.algo);
    fmt::print("# {:>10} {:>10} {:>6} {:>10} {:>8} {:>8} {:>7} {:>10} {:>10} {:>10} {:>10}\n", "size", "count", "type",
               "time_us", "algbw", "busbw", "#wrong", "p50_us", "p90_us", "p99_us", "max_us");
    std::fflush(stdout);  // the header says the group is formed; tests watch for it
  }
  // The sizes measured: the nominal bytes (which size the warm-up) and the element count.
  if (o.timeline_blocks > 0 && !trace::timelineOn())
    throw InvalidArgument("--timeline-blocks measures the timeline: set DTRAIN_TIMELINE=DIR");
  std::vector<std::pair<double, size_t>> points;
  for (double bytes = static_cast<double>(o.min_bytes); bytes <= static_cast<double>(o.max_bytes); bytes *= o.factor) {
    size_t count = static_cast<size_t>(bytes) / es;
    if ((c == Coll::allgather || c == Coll::reduce_scatter)) count = count / n * n;
    if (count > 0) points.emplace_back(bytes, count);
  }
  auto log = o.observe.open(r == 0, name(c), n, Record().set("transport", pg->transportName()).set("dtype", comm::dtypeName(t))
                                                   .set("algo", o.algo).set("iters", o.iters).set("seconds", o.seconds));
  Progress progress(name(c), static_cast<int64_t>(points.size()), o.observe.progress(r == 0, "size"));
  int64_t total_wrong = 0, my_wrong = 0, done = 0;
  for (const auto& [bytes, count] : points) {
    Runner run(*pg, c, t, count, algo);
    // Warm up, and size the timed loop from it (rank 0 decides for everyone).
    // Every rank must issue the same ops, so the warm-up count is fixed by size, not by time.
    const int warm = size_t(bytes) >= (4u << 20) ? 3 : size_t(bytes) >= (64u << 10) ? 10 : 50;
    run.once();  // first touch of the buffers, not timed
    auto w0 = Clock::now();
    for (int i = 0; i < warm; ++i) run.once();
    double per = std::chrono::duration<double>(Clock::now() - w0).count() / warm;
    int64_t iters = o.iters > 0 ? o.iters : std::clamp<int64_t>(static_cast<int64_t>(o.seconds / per), 5, 10000);
    pg->broadcast(&iters, 1, DType::i64, 0)->wait();
    std::vector<double> times(static_cast<size_t>(iters));
    pg->barrier()->wait();
    auto t0 = Clock::now();
    for (int64_t i = 0; i < iters; ++i) {
      auto a = Clock::now();
      run.once();
      times[static_cast<size_t>(i)] = std::chrono::duration<double, std::micro>(Clock::now() - a).count();
    }
    double mean_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / static_cast<double>(iters);
    pg->allreduce(&mean_us, 1, DType::f64, ReduceOp::max)->wait();
    TimelineCost tl;
    if (o.timeline_blocks > 0) {
      tl = timelineBlocks(*pg, [&] { run.once(); }, o.timeline_blocks, std::max<int64_t>(1, iters / (2 * o.timeline_blocks)));
      if (r == 0) fmt::print("# timeline at {} bytes: {:.3f} us paused, {:.3f} us recording (medians): {:+.1f}% (median of pairs)\n",
                             count * es, tl.paused_us, tl.recording_us, 100 * (tl.ratio - 1));
    }
    int64_t bad = run.wrong();
    if (bad != 0) {
      fmt::print(stderr, "dtrain-bench {}: rank {}: {} of {} elements wrong at {} bytes\n", name(c), r, bad,
                 c == Coll::reduce_scatter ? count / n : count, count * es);
    }
    my_wrong += bad;
    pg->allreduce(&bad, 1, DType::i64)->wait();
    total_wrong += bad;
    size_t size_bytes = count * es;
    double algbw = static_cast<double>(size_bytes) / (mean_us * 1e-6) / 1e9;
    if (r == 0) {
      progress.clear();
      fmt::print("  {:>10} {:>10} {:>6} {:>10.1f} {:>8.3f} {:>8.3f} {:>7} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f}\n",
                 size_bytes, count, comm::dtypeName(t), mean_us, algbw, algbw * busFactor(c, n), bad,
                 percentile(times, 0.5), percentile(times, 0.9), percentile(times, 0.99), percentile(times, 1.0));
      std::fflush(stdout);
    }
    if (log) {
      log->write(Record("bench").set("name", name(c)).set("transport", pg->transportName()).set("dtype", comm::dtypeName(t))
                     .set("algo", o.algo).set("size_bytes", size_bytes).set("count", count).set("iters", iters)
                     .set("time_us", mean_us).set("p50_us", percentile(times, 0.5)).set("p90_us", percentile(times, 0.9))
                     .set("p99_us", percentile(times, 0.99)).set("max_us", percentile(times, 1.0))
                     .set("algbw_GBps", algbw).set("busbw_GBps", algbw * busFactor(c, n)).set("wrong", bad));
      if (o.timeline_blocks > 0) log->write(Record("timeline_cost").set("size_bytes", size_bytes).set("paused_us", tl.paused_us)
                                                .set("recording_us", tl.recording_us).set("ratio", tl.ratio));
    }
    progress.update(++done, fmt::format("{} bytes {:.1f} us", size_bytes, mean_us));
  }
  progress.finish();
  if (r == 0) fmt::print("# {} wrong elements in all\n", total_wrong);
  return total_wrong == 0 && my_wrong == 0 ? 0 : 1;
}

size_t parseBytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  std::string unit = end ? end : "";
  double mult = 1;
  if (unit == "K" || unit == "KiB" || unit == "k") mult = 1024;
  else if (unit == "M" || unit == "MiB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") mult = 1024.0 * 1024 * 1024;
  else if (!unit.empty() && unit != "B") throw InvalidArgument(fmt::format("bad size '{}' (e.g. 4, 64K, 16M)", s));
  if (!(v > 0)) throw InvalidArgument(fmt::format("bad size '{}'", s));
  return static_cast<size_t>(v * mult);
}

}  // namespace

void addCollectiveCommands(CLI::App& app) {
  for (Coll c : {Coll::allreduce, Coll::allgather, Coll::reduce_scatter, Coll::broadcast}) {
    auto* sub = app.add_subcommand(name(c), fmt::format("{} bandwidth and latency, nccl-tests columns", name(c)));
    auto o = std::make_shared<Options>();
    auto minb = std::make_shared<std::string>("4");
    auto maxb = std::make_shared<std::string>("64M");
    sub->add_option("--transport", o->transport, "auto, tcp, shm, or mpi (under mpirun, when built with MPI)")
        ->check(CLI::IsMember({"auto", "tcp", "shm", "mpi"}));
    sub->add_option("--min-bytes", *minb, "smallest size (e.g. 4, 64K)");
    sub->add_option("--max-bytes", *maxb, "largest size (e.g. 64M)");
    sub->add_option("--factor", o->factor, "size multiplier between rows")->check(CLI::Range(1.01, 1024.0));
    sub->add_option("--iters", o->iters, "timed iterations per size (0: from the warm-up)");
    sub->add_option("--seconds", o->seconds, "timed work per size when --iters is 0");
    sub->add_option("--dtype", o->dtype, "f32 f64 f16 bf16 i32 i64 u8");
    sub->add_option("--timeline-blocks", o->timeline_blocks,
                    "with DTRAIN_TIMELINE: after each timed loop, as many ops again in blocks of this many, alternately "
                    "paused and recording (spooling included), and print the timeline's cost")->check(CLI::PositiveNumber);
    o->observe.addOptions(sub);
    if (c == Coll::allreduce) sub->add_option("--algo", o->algo, "auto, ring, rd, direct (shm) or hierarchical (several hosts)")->check(CLI::IsMember({"auto", "ring", "rd", "direct", "hierarchical"}));
    sub->callback([c, o, minb, maxb] {
      runAndExit(name(c), [&] {
        o->min_bytes = parseBytes(*minb);
        o->max_bytes = parseBytes(*maxb);
        return run(c, *o);
      });
    });
  }
}

}  // namespace dtrain::bench
