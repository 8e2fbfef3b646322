/// @file
/// DeviceMesh: the world's ranks arranged as data x pipeline x tensor, and the sub-group of each
/// dimension that this rank belongs to (hybrid parallelism, as Megatron-LM's parallel_state).
///
/// \code
///   auto dist = dtrain::init();                                     // 4 ranks
///   dtrain::DeviceMesh mesh(dist.world(), {/*data=*/2, /*pipeline=*/2, /*tensor=*/1});
///   auto stage = dtrain::pipelineStage(model, mesh.pipelineRank(), mesh.pipelineSize());
///   dtrain::DistributedDataParallel ddp(stage.ptr(), mesh.data());  // replicas of this stage
///   dtrain::Pipeline pipe(stage, mesh.pipeline());
///   pipe.attachDataParallel(&ddp);                                  // one allreduce per step
///   double loss = pipe.step(my_share_of_x, my_share_of_y, loss_fn); // this replica's loss
/// \endcode
///
/// Layout: tensor varies fastest, then data, then pipeline:
/// \verbatim
///   world rank = (pipeline_rank * data + data_rank) * tensor + tensor_rank
/// \endverbatim
/// so a tensor group (the chattiest: two allreduces per layer) is made of neighbouring ranks, which
/// dtrain-run places on the same host, and a pipeline group (point-to-point only) spans the most.
///
/// Construction is collective over the world group: every rank creates every sub-group of every
/// dimension in the same order (ProcessGroup::newGroup requires it), keeping its own.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain {

/// The size of each dimension of a DeviceMesh; their product is the world size.
struct MeshShape {
  int data = 1;  ///< data-parallel replicas
  int pipeline = 1;  ///< pipeline stages
  int tensor = 1;  ///< tensor-parallel ranks per layer
};

/// The world's ranks arranged as data x pipeline x tensor, with this rank's sub-group of each dimension
/// (see the file's description).
class DeviceMesh {
 public:
  /// world->size() must equal data * pipeline * tensor (else InvalidArgument on every rank).
  DeviceMesh(std::shared_ptr<comm::ProcessGroup> world, MeshShape shape);

  /// The shape given.
  const MeshShape& shape() const { return shape_; }
  /// This rank's coordinate along the data dimension (its rank in data()).
  int dataRank() const { return data_rank_; }
  /// This rank's coordinate along the pipeline dimension: its stage (its rank in pipeline()).
  int pipelineRank() const { return pipeline_rank_; }
  /// This rank's coordinate along the tensor dimension (its rank in tensor()).
  int tensorRank() const { return tensor_rank_; }
  /// The number of data-parallel replicas.
  int dataSize() const { return shape_.data; }
  /// The number of pipeline stages.
  int pipelineSize() const { return shape_.pipeline; }
  /// The number of tensor-parallel ranks.
  int tensorSize() const { return shape_.tensor; }

  /// The ranks that share this rank's pipeline and tensor coordinates: the replicas (DDP, sampler shards).
  const std::shared_ptr<comm::ProcessGroup>& data() const { return data_; }
  /// The ranks that share this rank's data and tensor coordinates: the stages of one pipeline.
  const std::shared_ptr<comm::ProcessGroup>& pipeline() const { return pipeline_; }
  /// The ranks that share this rank's data and pipeline coordinates: one tensor-parallel layer.
  const std::shared_ptr<comm::ProcessGroup>& tensor() const { return tensor_; }
  /// The world group the mesh was built on.
  const std::shared_ptr<comm::ProcessGroup>& world() const { return world_; }

  /// World rank of the given coordinates.
  int worldRank(int data_rank, int pipeline_rank, int tensor_rank) const;
  /// World ranks of this rank's data group, in group-rank order.
  std::vector<int> dataRanks() const;
  /// World ranks of this rank's pipeline group, in group-rank order.
  std::vector<int> pipelineRanks() const;
  /// World ranks of this rank's tensor group, in group-rank order.
  std::vector<int> tensorRanks() const;
  /// The shape and this rank's coordinates: "mesh data=2 pipeline=2 tensor=1: rank 3 = (d 1, p 1, t 0)".
  std::string describe() const;

 private:
  std::shared_ptr<comm::ProcessGroup> world_, data_, pipeline_, tensor_;
  MeshShape shape_;
  int data_rank_ = 0, pipeline_rank_ = 0, tensor_rank_ = 0;
};

}  // namespace dtrain
