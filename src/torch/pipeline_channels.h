// The pipeline's messages (pipeline.cc runs the schedule; this moves its activations and gradients).
//
// Each direction between two neighbouring ranks is a two-rank group of its own, a channel, made from the
// pipeline's group when the Pipeline is built. A forward's output and a backward's input gradient are
// issued to the channel towards the rank that needs them and the stage computes on while the channel's
// thread sends them (IssueAndMoveOn): a send never waits for the receiver to reach its receive, so no
// pairing of sends with receives is needed to keep blocking transports from deadlocking (the schedules'
// dependencies have no cycle, and a receive waits only for its sender to get there). Every message is
// a header (what it is: activation or gradient, step, micro-batch, the receiver's chunk, dtype and
// shape) and then the data, because the receiver has to learn the shape before it can post a receive
// of the exact length. A channel delivers in the sender's order; a receive takes messages from it until
// the one it wants arrives and keeps the others for later actions (the interleaved schedule's sender
// and receiver walk their chunks in different orders).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::detail {

class PipelineChannels {
 public:
  enum Kind : int64_t { kActivation = 0, kGradient = 1 };
  enum Mode : int64_t { kStepMode = 0, kForwardMode = 1 };

  // Collective over pg: the channels between neighbours (both directions; round the ring too with
  // several chunks a rank). param_dtype: the stage's floating dtype, which received activations must have.
  void open(comm::ProcessGroup& pg, int chunks, int micro_batches, c10::optional<c10::ScalarType> param_dtype);
  // A new step (or forward): nothing kept from the last; buffers of sends a failed step left are kept
  // until the channels are gone.
  void beginStep(int64_t step);
  // Sends t (a chunk's output, or the gradient of a chunk's input) to stage dst, whose chunk `chunk`
  // takes it, without waiting for it to arrive. To this stage itself: kept, no message.
  void send(int dst, Kind kind, int chunk, int m, Mode mode, const at::Tensor& t);
  // The message `kind` for chunk c, micro-batch m, from stage src: kept from earlier, or taken from the
  // channel (with those before it). Adds the time blocked to comm_ms.
  at::Tensor receive(int src, Kind kind, int c, int m, Mode mode, double& comm_ms);
  // Completed sends are dropped from the front (an error of theirs surfaces here); all: waits for all.
  void reapSends(bool all, double& comm_ms);
  // Issues an abort with msg on every channel (the caller waits for them).
  void abortAll(const std::string& msg, std::vector<comm::WorkPtr>& aborts);
  // Forgets the messages kept for later actions.
  void dropKept() { early_.clear(); }

 private:
  using Key = std::tuple<int64_t, int64_t, int64_t>;  // kind, chunk, micro-batch
  struct Sent {
    comm::WorkPtr work;
    at::Tensor keep;  // the buffer, alive until the send completed
    int dst;
  };
  std::pair<Key, at::Tensor> takeMessage(int src, Mode mode);
  std::string channelNote(int peer, bool sending) const;

  int stage_ = 0, stages_ = 1, chunks_ = 1, micro_batches_ = 1;
  int64_t step_ = 0;
  c10::optional<c10::ScalarType> param_dtype_;
  // Declared before the channels, so destroyed after them: a send still in flight when a failed
  // Pipeline is destroyed keeps its buffer until its channel's thread has stopped. `orphans_` keeps the
  // buffers of ops that were given up on (a wait that failed or timed out) for as long.
  std::deque<Sent> sent_;
  std::vector<at::Tensor> orphans_;
  // out_[peer] carries this rank's messages to peer, in_[peer] peer's to this rank.
  std::map<int, std::shared_ptr<comm::ProcessGroup>> out_, in_;
  std::map<int, std::map<Key, at::Tensor>> early_;  // per sender: messages taken before they were needed
};

}  // namespace dtrain::detail
