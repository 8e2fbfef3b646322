/// @file
/// The process context of a dtrain training program: who am I, how many are we, and the groups.
///
/// \code
///   auto dist = dtrain::init();               // reads dtrain-run / torchrun / mpirun / srun variables
///   if (dist.isMain()) std::cout << "training on " << dist.size() << " processes\n";
///   dtrain::DistributedDataParallel ddp(model, dist.world());
/// \endcode
///
/// Without any of those variables it is a world of one that opens no socket: the same binary runs
/// unchanged as a single process ("distributed training disabled").
#pragma once
#include <functional>
#include <memory>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/rendezvous.h"

/// dtrain's torch layer: the process context, data, model and pipeline parallelism, ZeRO and FSDP,
/// checkpoints and training utilities, over the communication layer dtrain::comm.
namespace dtrain {

/// The process context init() returns: this process's ranks, the world group and the group of its node.
class Distributed {
 public:
  /// The world group, this node's group and what the rendezvous found (init() makes one).
  Distributed(std::shared_ptr<comm::ProcessGroup> world, std::shared_ptr<comm::ProcessGroup> local,
              comm::WorldInfo info)
      : world_(std::move(world)), local_(std::move(local)), info_(std::move(info)) {}

  /// This process's rank in the world.
  int rank() const { return world_->rank(); }
  /// The number of processes in the world.
  int size() const { return world_->size(); }
  /// This process's rank among the processes of its node.
  int localRank() const { return info_.local_rank; }
  /// The number of processes on this node.
  int localSize() const { return info_.local_size; }
  /// Global rank 0: the process that prints, logs and writes checkpoints.
  bool isMain() const { return rank() == 0; }
  /// True with more than one process: distributed training is on.
  bool enabled() const { return size() > 1; }
  /// All ranks.
  const std::shared_ptr<comm::ProcessGroup>& world() const { return world_; }
  /// The ranks on this node (local rank 0 .. localSize()-1).
  const std::shared_ptr<comm::ProcessGroup>& local() const { return local_; }
  /// What the rendezvous found: ranks, sizes, where they came from and the nodes.
  const comm::WorldInfo& info() const { return info_; }

 private:
  std::shared_ptr<comm::ProcessGroup> world_;
  std::shared_ptr<comm::ProcessGroup> local_;
  comm::WorldInfo info_;
};

/// The torch layer's entry point: comm::initWorld(opts) (the world group, from the environment read
/// once; see rendezvous.h) plus, on every rank, the group of its node (the ranks agree at rendezvous on
/// who is on which node: Slurm's node lists, torchrun's GROUP_RANK, or the host for mpirun). Call it
/// once per process, instead of initWorld(), not beside it.
Distributed init(comm::InitOptions opts = {});

/// Runs fn on rank 0 first (of the node's group when local, of the world otherwise) while the others
/// wait, then on the others: dataset download or preprocessing that one process should do first.
/// If rank 0's fn throws, the others are released with an error instead of waiting for ever.
void zeroFirst(const Distributed& dist, const std::function<void()>& fn, bool local = true);

}  // namespace dtrain
