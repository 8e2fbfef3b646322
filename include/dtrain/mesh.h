// DeviceMesh: the world's ranks arranged as data x pipeline x tensor, and the sub-group of each
// dimension that this rank belongs to (hybrid parallelism, as Megatron-LM's parallel_state).
//
// \code
//   auto dist = dtrain::init();                                     // 4 ranks
//   dtrain::DeviceMesh mesh(dist.world(), {/*data=*/2, /*pipeline=*/2, /*tensor=*/1});
//   auto stage = dtrain::pipelineStage(model, mesh.pipelineRank(), mesh.pipelineSize());
//   dtrain::DistributedDataParallel ddp(stage.ptr(), mesh.data());  // replicas of this stage
//   dtrain::Pipeline pipe(stage, mesh.pipeline());
//   pipe.attachDataParallel(&ddp);                                  // one allreduce per step
//   double loss = pipe.step(my_share_of_x, my_share_of_y, loss_fn); // this replica's loss
// \endcode
//
// Layout: tensor varies fastest, then data, then pipeline:
//   world rank = (pipeline_rank * data + data_rank) * tensor + tensor_rank
// so a tensor group (the chattiest: two allreduces per layer) is made of neighbouring ranks, which
// dtrain-run places on the same host, and a pipeline group (point-to-point only) spans the most.
//
// Construction is collective over the world group: every rank creates every sub-group of every
// dimension in the same order (ProcessGroup::newGroup requires it), keeping its own.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

struct MeshShape {
  int data = 1;
  int pipeline = 1;
  int tensor = 1;
};

class DeviceMesh {
 public:
  // world->size() must equal data * pipeline * tensor (else InvalidArgument on every rank).
  DeviceMesh(std::shared_ptr<comm::ProcessGroup> world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  int dataRank() const { return data_rank_; }
  int pipelineRank() const { return pipeline_rank_; }
  int tensorRank() const { return tensor_rank_; }
  int dataSize() const { return shape_.data; }
  int pipelineSize() const { return shape_.pipeline; }
  int tensorSize() const { return shape_.tensor; }

  // The ranks that share this rank's pipeline and tensor coordinates (replicas: DDP, sampler shards),
  // its data and tensor coordinates (the stages of one pipeline), its data and pipeline coordinates
  // (one tensor-parallel layer).
  const std::shared_ptr<comm::ProcessGroup>& data() const { return data_; }
  const std::shared_ptr<comm::ProcessGroup>& pipeline() const { return pipeline_; }
  const std::shared_ptr<comm::ProcessGroup>& tensor() const { return tensor_; }
  const std::shared_ptr<comm::ProcessGroup>& world() const { return world_; }

  // World rank of the given coordinates.
  int worldRank(int data_rank, int pipeline_rank, int tensor_rank) const;
  // World ranks of this rank's groups, in group-rank order.
  std::vector<int> dataRanks() const;
  std::vector<int> pipelineRanks() const;
  std::vector<int> tensorRanks() const;
  // "mesh data=2 pipeline=2 tensor=1: rank 3 = (d 1, p 1, t 0)"
  std::string describe() const;

 private:
  std::shared_ptr<comm::ProcessGroup> world_, data_, pipeline_, tensor_;
  MeshShape shape_;
  int data_rank_ = 0, pipeline_rank_ = 0, tensor_rank_ = 0;
};

}  // namespace dtrain
