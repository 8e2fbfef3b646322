// DistributedDataParallel's state, shared by ddp.cc (the synced backward pass) and join.cc (the
// shadow passes of a rank that has run out of inputs). Internal; not installed.
#pragma once
#include <torch/csrc/autograd/function.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "buckets.h"
#include "comm/group/tune.h"
#include "ddp_hooks.h"
#include "dtrain/compat.h"
#include "dtrain/ddp.h"
#include "dtrain/join.h"

namespace dtrain {

namespace detail {
using Clock = std::chrono::steady_clock;

struct Bucket {
  GradBucket gb;
  size_t pending = 0;  // parameters of this bucket without a gradient yet in this pass
  comm::WorkPtr work;  // the allreduce, or the Work the comm hook returned (perhaps a chain)
  // The timeline's (DTRAIN_TIMELINE): when the bucket's last gradient arrived and when it was launched
  // in this pass (trace clock; 0: not recorded).
  int64_t ready_us = 0, launched_us = 0;
};

// The model's buffers packed into one flat tensor per dtype, so a buffer broadcast is one collective
// per dtype (BatchNorm: f32 statistics and i64 counters) instead of one per buffer.
struct BufferPack {
  std::vector<at::Tensor> flats;
  std::vector<std::vector<size_t>> members;  // per flat: indices into Impl::buffers
};

// Parameters without a gradient in an accumulation window (find_unused_parameters), see Impl::unused.
struct UnusedState {
  std::vector<char> used;            // per parameter: a defined gradient arrived in this window, here
  std::vector<int32_t> flags;        // the exchange's buffer: 1 where used here, then where used anywhere
  std::vector<size_t> idle;          // parameters this rank did not use in the window
  std::vector<at::Tensor> before;    // per idle parameter: its gradient before the window (a copy), or undefined
  comm::WorkPtr exchange;            // the allreduce (max) of flags, issued after the pass's buckets
};

// What the ranks told each other at the start of a synced pass under dtrain::Join.
struct Handshake {
  int running = 0;      // ranks still training
  int max_running = 0;  // the highest of them: the buffers' source (PyTorch's authoritative rank)
  std::vector<int> joined;
};

// Present while a dtrain::Join is active.
struct JoinState {
  JoinOptions opts;
  bool joined = false;         // this rank has run out of inputs and shadows the others
  int64_t passes = 0;          // synced passes this rank ran in the join scope
  std::vector<int32_t> flags;  // the handshake buffer: flags[r] = 1 while rank r trains
  comm::WorkPtr handshake;
};
// DDPOptions::tune as the tuners' mode, from_env read from DTRAIN_TUNE; InvalidArgument naming a bad value.
comm::tune::Mode resolveTune(DDPOptions::Tune asked);

// Bucket-size tuning (DDPOptions::tune), from the first synced pass. The candidates (distinct layouts)
// are report.candidates. Visit v (one synced pass) is in round v / n (n candidates) and tries candidate
// (v + v / n) % n: each round a rotation of the last, so no candidate always follows the same one. Its
// time is samples[v].
struct TuneState {
  comm::tune::Mode mode = comm::tune::Mode::off;  // resolved (DTRAIN_TUNE read) by the constructor
  DDPTuning report;
  BucketSizes configured;
  size_t visit = 0;
  Clock::time_point pass_began;  // this visit's pass: its first gradient (startPass)
  std::vector<double> samples;
  size_t candidateOf(size_t v) const {
    const size_t n = report.candidates.size();
    return (v + v / n) % n;
  }
  BucketSizes sizesOf(size_t c) const {
    return {report.candidates[c].bucket_bytes, report.candidates[c].first_bucket_bytes};
  }
};
}  // namespace detail

struct DistributedDataParallel::Impl {
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<comm::ProcessGroup> pg;
  DDPOptions opts;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<at::Tensor> buffers;
  detail::BufferPack buffer_pack;
  std::vector<compat::GradAccumulatorPtr> accumulators;  // keeps our hooks' nodes alive
  std::vector<uintptr_t> hook_keys;
  std::vector<detail::Bucket> buckets;
  std::vector<size_t> bucket_of, offset_of;  // per parameter: its bucket and element offset there
  std::vector<size_t> layout_order;          // the order the buckets were built in (buildBuckets)
  detail::TuneState tune;                    // bucket-size tuning (ddp_tune.cc)
  std::shared_ptr<CommHook> hook;
  std::optional<detail::JoinState> join;

  bool sync = true;
  bool in_backward = false;
  std::vector<char> ready;
  // find_unused_parameters: which parameters got a gradient in this accumulation window (the synced pass
  // and the noSync passes before it), and what the others held before it; every rank's flags are
  // OR-ed (max) after the buckets, and a parameter no rank used gets back what it held (undefined stays
  // undefined), as in one process, where the optimizer skips a parameter with no gradient.
  detail::UnusedState unused;
  size_t next_launch = 0;
  std::vector<size_t> arrival;  // order gradients arrived in the first synced pass
  int synced_passes = 0;
  detail::Clock::time_point first_launch;
  int64_t pass_start_us = 0;  // the timeline's "backward": the first gradient of the pass
  uint64_t pass_start_bytes = 0;  // comm::bytesSent() then
  bool any_launched = false;
  Stats stats;
  // Comm hooks: the group their continuations issue collectives on (when the hook chainsCollectives())
  // and the thread that runs the continuations. Last: destroyed first, while the buckets still exist.
  std::shared_ptr<comm::ProcessGroup> chain_pg;
  std::unique_ptr<detail::HookRunner> hook_runner;

  // Lays parameters out in buckets in the given order and points every .grad() into its bucket.
  void buildBuckets(const std::vector<size_t>& order);
  // The slice of the bucket that holds parameter i's gradient (aliases the bucket's storage).
  at::Tensor gradView(size_t i);
  // Makes parameter i's .grad() the view into its bucket, moving in (or zeroing) what it held.
  void adoptGrad(size_t i);

  // The synced backward pass: started by the first gradient hook, finished by an engine callback.
  void startPass();
  // A parameter's gradient accumulator ran; `arrived`: a gradient flowed into it (autograd may run the
  // node with an undefined one, e.g. for an output that no loss used).
  void onGradReady(size_t i, bool arrived);
  void launchReady();
  void launchBucket(detail::Bucket& b);
  // A bucket's last gradient arrived.
  void bucketReady(detail::Bucket& b);
  void finishPass();
  // find_unused_parameters: before the last buckets launch, remember what the parameters this rank did not
  // use hold; after them, issue the exchange of who used what (every rank, in the same place: after the
  // pass's last bucket, a joined rank's shadow pass too); once it is done, give every parameter that no
  // rank used its gradient back. A world of one needs no exchange.
  void keepIdleGradients();
  void startUsedExchange(bool joined);
  void restoreUnusedEverywhere();
  // Waits for every launched bucket (the hook's whole chain), multiplies by scale.
  void completeBuckets(double scale, detail::Clock::time_point* last_done);
  // After every synced pass (shadowed ones too): the bucket rebuild of the first pass.
  void afterSyncedPass();
  void rebuildFromArrival();

  // Bucket-size tuning (ddp_tune.cc). After the first synced pass: off, the cached sizes, or probing.
  void startTuning();
  // After each later synced pass while probing: the next candidate, or the choice.
  void tuneAfterPass();
  // Back to the configured sizes (a hook or Join arrived while probing).
  void stopTuning(const std::string& why);
  // Rebuilds the buckets in layout_order with these caps.
  void applyBucketSizes(const detail::BucketSizes& sizes);

  // Buffers (broadcast_buffers): one broadcast per dtype from root, issued now, unpacked by end.
  std::vector<comm::WorkPtr> startBufferBroadcast(int root);
  void endBufferBroadcast(const std::vector<comm::WorkPtr>& works, int root);
  void broadcastFrom(int root, const std::vector<at::Tensor>& ts, const char* what);

  // Join: every synced pass in the join scope starts with an allreduce (sum) of who still trains.
  void startHandshake(bool running);
  detail::Handshake readHandshake();
  // A joined rank's stand-in for one synced pass: zeros into every bucket, the buffer broadcast.
  void shadowPass(const detail::Handshake& h);
  std::string earlyTerminationMessage(const detail::Handshake& h) const;
};

}  // namespace dtrain
