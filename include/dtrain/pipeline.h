/// @file
/// Pipeline parallelism: a torch::nn::Sequential cut into P stages, one per rank of a group; each
/// batch is split into M micro-batches whose activations flow forward (rank s -> s+1) and whose
/// gradients flow backward (s+1 -> s) over send/recv, under the GPipe or the 1F1B schedule.
///
/// \code
///   auto dist = dtrain::init();                          // P ranks
///   torch::nn::Sequential model = makeModel();           // the same model (and seed) on every rank
///   auto stage = dtrain::pipelineStage(model, dist.rank(), dist.size());   // balanced by parameters
///   dtrain::PipelineOptions o;
///   o.micro_batches = 8;
///   o.schedule = dtrain::PipelineSchedule::one_f_one_b;
///   dtrain::Pipeline pipe(stage, dist.world(), o);
///   torch::optim::SGD opt(stage->parameters(), 0.1);     // each rank updates its own stage
///   for (auto& [x, y] : loader) {
///     opt.zero_grad();
///     // x is read on the first stage, y on the last (the other ranks may pass undefined tensors);
///     // the loss function runs on the last stage, on each micro-batch's output and target rows.
///     double loss = pipe.step(x, y, [](const at::Tensor& out, const at::Tensor& t) {
///       return torch::nn::functional::cross_entropy(out, t);
///     });                                                // the batch loss, on every rank
///     opt.step();                                        // gradients accumulated over micro-batches
///   }
/// \endcode
///
/// Semantics: the loss function must return the mean over its micro-batch's rows (as the defaults of
/// torch's losses do); micro-batch m (n_m of N rows) enters the batch loss with weight n_m / N, so the
/// loss and the gradients equal one process running the whole model on the whole batch. Micro-batch
/// sizes come from at::tensor_split (they differ by at most one row); the batch needs >= M rows.
///
/// Schedules (per stage s of P, micro-batches 0..M-1):
///  - gpipe: F0 F1 ... F(M-1), then B0 ... B(M-1). Every stage holds the activations of all M
///    micro-batches at the turn; bubble (P-1)/(M+P-1) of the step when F and B take the same time
///    on every stage.
///  - one_f_one_b (PipeDream-Flush): min(P-s-1, M) warm-up forwards, then alternate one forward and
///    one backward, then the remaining backwards. Same bubble, but stage s never holds more than P-s
///    micro-batches of activations (stats().peak_stored_activations proves it).
///  - interleaved (Megatron-LM's interleaved 1F1B): the model is cut into P x V parts and rank s holds
///    V of them, parts s, s+P, s+2P, ... (pipelineChunks), so a micro-batch goes round the ranks V
///    times. The bubble shrinks to (P-1)/(V*M + P-1) of the step, for V times the messages. M must be
///    a multiple of P. Rank s runs 2(P-s-1) + (V-1)P warm-up forwards (all of them when M = P), then
///    one forward and one backward in turn, then drains; forwards go through the chunks in groups of P
///    micro-batches.
///
/// \code
///   auto chunks = dtrain::pipelineChunks(model, dist.rank(), dist.size(), /*chunks=*/2);
///   dtrain::Pipeline pipe(chunks, dist.world(), {8, dtrain::PipelineSchedule::interleaved});
///   torch::optim::SGD opt(pipe.module()->parameters(), 0.1);   // every chunk of this rank
/// \endcode
///
/// Activations and gradients travel with a small header (magic, step, micro-batch, chunk, dtype and
/// shape), so a stage learns its input's shape from the sender, and a rank running another schedule,
/// another micro-batch count or expecting another dtype fails with an error naming both ranks instead
/// of hanging. Sends do not wait for the receiver: each direction between two neighbouring ranks is a
/// two-rank group of its own (made from pg by the constructor), sends are issued to it and the stage
/// computes on while they go; a receive takes the messages of its sender in order and keeps those a
/// later action needs. A rank whose forward or backward throws aborts the group and those channels:
/// its pipeline peers fail promptly with its message. Every wait is bounded by the group's timeout.
///
/// Hybrid with data parallelism: build a DistributedDataParallel on the stage over the data group
/// (see mesh.h) and attach it: gradients are averaged across replicas during the last micro-batch's
/// backward only (the others run under noSync()). Not with the interleaved schedule (a rank's chunks
/// finish their backwards at different times): attaching one is an InvalidArgument.
#pragma once
#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

class DistributedDataParallel;
class FullyShardedDataParallel;

/// The order in which a stage runs its micro-batches' forwards and backwards (see the file's description).
enum class PipelineSchedule {
  gpipe,        ///< every forward, then every backward
  one_f_one_b,  ///< 1F1B (PipeDream-Flush): warm-up forwards, then one forward and one backward in turn
  interleaved   ///< Megatron-LM's interleaved 1F1B over several chunks per rank
};
/// The schedule's name: "gpipe", "1f1b" or "interleaved".
const char* scheduleName(PipelineSchedule s);

/// Options of a Pipeline: the same on every rank.
struct PipelineOptions {
  int micro_batches = 4;  ///< M: micro-batches per step (the batch needs at least M rows)
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;  ///< the schedule
};

/// Where stage s starts, for s = 0..stages: stage s holds modules [bounds[s], bounds[s+1]) of the
/// model. Contiguous, non-empty stages minimising the largest stage's cost, where a module costs its
/// parameter count plus one (so modules without parameters spread out too). Throws InvalidArgument
/// when the model has fewer modules than stages.
std::vector<size_t> balanceByParameters(const torch::nn::Sequential& model, int stages);

/// The modules of stage `stage` of `model` as a new Sequential that shares them (same parameters),
/// keeping their names ("3.weight" stays "3.weight"). split_points: the P-1 indices where stages
/// 1..P-1 start (strictly increasing, in (0, size)); empty: balanceByParameters.
torch::nn::Sequential pipelineStage(const torch::nn::Sequential& model, int stage, int stages,
                                    const std::vector<size_t>& split_points = {});

/// For the interleaved schedule: the model cut into stages x chunks parts (as pipelineStage cuts it
/// into stages x chunks stages; split_points: the stages*chunks - 1 indices where parts start, empty:
/// balanced by parameters); rank `stage` holds parts stage, stage + stages, ... (its chunk c is part
/// c * stages + stage). Names are kept as in pipelineStage.
std::vector<torch::nn::Sequential> pipelineChunks(const torch::nn::Sequential& model, int stage, int stages,
                                                  int chunks, const std::vector<size_t>& split_points = {});

/// What one rank did during the last step() (or, from forwardStats(), the last forward()), for tests
/// and for the bubble measurement.
struct PipelineStats {
  ///@{
  /// This rank's stage, the number of stages, and the micro-batches of the last step.
  int stage = 0, stages = 1, micro_batches = 0;
  ///@}
  /// Micro-batches whose activations this stage holds (forward done, backward not yet): now, and the
  /// peak during the last step. GPipe peaks at M, 1F1B at min(P - stage, M).
  int stored_activations = 0;
  int peak_stored_activations = 0;  ///< the most stored at once during the last step
  /// Bytes of the tensors this stage's modules produced for the stored micro-batches (the activations
  /// autograd keeps), at the peak of the last step.
  int64_t peak_activation_bytes = 0;
  double step_ms = 0;      ///< wall time of the last step (schedule only, without the loss broadcast)
  double forward_ms = 0;   ///< compute time of its forwards (loss included on the last stage)
  double backward_ms = 0;  ///< compute time of its backwards
  double comm_ms = 0;      ///< time blocked in send/recv
  /// Idle share of the step: 1 - (forward_ms + backward_ms) / step_ms.
  double bubble() const { return step_ms > 0 ? 1.0 - (forward_ms + backward_ms) / step_ms : 0.0; }
};

/// One forward or backward of one micro-batch on this rank, relative to the step's start.
struct PipelineSpan {
  char kind;  ///< 'F' or 'B'
  int micro;  ///< the micro-batch
  ///@{
  /// When the action started and ended, in milliseconds since the step began.
  double start_ms, end_ms;
  ///@}
  int chunk = 0;  ///< of this rank's chunks (interleaved schedule)
};

/// One stage of a pipeline-parallel model: runs the schedule's forwards and backwards of each step with the
/// neighbouring stages (see the file's description).
class Pipeline {
 public:
  /// The loss of one micro-batch (run on the last stage): the mean over its rows.
  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

  /// Collective over pg (one stage per rank; stage = pg->rank()): checks that every rank runs the same
  /// schedule and micro-batch count. The group must outlive the Pipeline.
  Pipeline(torch::nn::Sequential stage, std::shared_ptr<comm::ProcessGroup> pg, PipelineOptions options = {});
  /// The interleaved schedule's form: this rank's chunks in order (pipelineChunks); the same number on
  /// every rank. With one chunk, the same as above (and the only form for gpipe and one_f_one_b).
  Pipeline(std::vector<torch::nn::Sequential> chunks, std::shared_ptr<comm::ProcessGroup> pg,
           PipelineOptions options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// One forward and backward pass over the batch (see the top of this file); gradients are added to
  /// the stage's parameter gradients. Returns the batch loss on every rank.
  double step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss);

  /// Forward only, without autograd (evaluation): the model's output for the whole batch on the last
  /// stage, an undefined tensor elsewhere.
  at::Tensor forward(const at::Tensor& input);

  /// Gradients are averaged over ddp's group in the last micro-batch's backward only. ddp must wrap
  /// this stage's module and outlive the Pipeline (or be detached with nullptr).
  void attachDataParallel(DistributedDataParallel* ddp);
  /// The same with ZeRO stage 2 or 3 over the data-parallel group (dtrain/fsdp.h): fsdp must wrap this
  /// stage's module (the Pipeline then runs fsdp->forward) and outlive the Pipeline.
  void attachSharded(FullyShardedDataParallel* fsdp);

  /// This rank's stage (its rank in the group).
  int stage() const;
  /// P: the number of stages.
  int stages() const;
  /// The stage's modules: the Sequential given, or with chunks, one Sequential of every chunk's modules
  /// in order (the same modules and names), for the optimizer and checkpoints.
  torch::nn::Sequential& module();
  /// This rank's chunks (1 but with the interleaved schedule).
  int chunks() const;
  /// The options given.
  const PipelineOptions& options() const;
  /// The last step()'s figures and spans; a forward() (evaluation) leaves them as they are.
  const PipelineStats& stats() const;
  /// The last step()'s actions on this stage, in the order they ran.
  const std::vector<PipelineSpan>& timeline() const;
  /// The last forward()'s figures (step_ms, forward_ms, comm_ms; no backward, nothing stored).
  const PipelineStats& forwardStats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

/// The order of forwards (F) and backwards (B) of stage `stage`: pairs (kind, micro-batch).
std::vector<std::pair<char, int>> pipelineOrder(PipelineSchedule schedule, int stage, int stages, int micro_batches);

/// One action of a schedule: the forward or backward of a micro-batch through one of the rank's chunks.
struct PipelineAction {
  char kind;  ///< 'F' or 'B'
  int micro;  ///< the micro-batch
  int chunk;  ///< the chunk of this rank (0 without chunks)
};
/// The same with the chunk of each action, for every schedule (chunks is 1 for gpipe and one_f_one_b).
/// InvalidArgument for an interleaved schedule whose micro-batch count is not a multiple of stages.
std::vector<PipelineAction> pipelineActions(PipelineSchedule schedule, int stage, int stages, int micro_batches,
                                            int chunks = 1);

}  // namespace dtrain
