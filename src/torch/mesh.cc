// DeviceMesh (see mesh.h): coordinates of each rank and one newGroup per group of each dimension.
#include "dtrain/mesh.h"

#include <fmt/format.h>

#include "dtrain/comm/error.h"

namespace dtrain {

DeviceMesh::DeviceMesh(std::shared_ptr<comm::ProcessGroup> world, MeshShape shape)
    : world_(std::move(world)), shape_(shape) {
  DTRAIN_CHECK(world_ != nullptr, InvalidArgument, "DeviceMesh: null world group");
  const int D = shape.data, P = shape.pipeline, T = shape.tensor;
  DTRAIN_CHECK(D >= 1 && P >= 1 && T >= 1 && static_cast<int64_t>(D) * P * T == world_->size(), InvalidArgument,
               "[rank {}] DeviceMesh: data {} x pipeline {} x tensor {} does not make the world of {} ranks",
               world_->rank(), D, P, T, world_->size());
  const int r = world_->rank();
  tensor_rank_ = r % T;
  data_rank_ = (r / T) % D;
  pipeline_rank_ = r / (T * D);

  // Every rank walks every group in the same order; newGroup hands back nullptr for the groups this
  // rank is not in, and each group only waits for its own members, so no rank waits on another's
  // unrelated group.
  for (int p = 0; p < P; ++p) {
    for (int t = 0; t < T; ++t) {
      std::vector<int> ranks;
      for (int d = 0; d < D; ++d) ranks.push_back(worldRank(d, p, t));
      if (auto g = world_->newGroup(ranks)) data_ = std::move(g);
    }
  }
  for (int d = 0; d < D; ++d) {
    for (int t = 0; t < T; ++t) {
      std::vector<int> ranks;
      for (int p = 0; p < P; ++p) ranks.push_back(worldRank(d, p, t));
      if (auto g = world_->newGroup(ranks)) pipeline_ = std::move(g);
    }
  }
  for (int p = 0; p < P; ++p) {
    for (int d = 0; d < D; ++d) {
      std::vector<int> ranks;
      for (int t = 0; t < T; ++t) ranks.push_back(worldRank(d, p, t));
      if (auto g = world_->newGroup(ranks)) tensor_ = std::move(g);
    }
  }
  DTRAIN_CHECK(data_ && pipeline_ && tensor_, Error, "[rank {}] DeviceMesh: a sub-group is missing", r);
  DTRAIN_CHECK(data_->rank() == data_rank_ && pipeline_->rank() == pipeline_rank_ && tensor_->rank() == tensor_rank_,
               Error, "[rank {}] DeviceMesh: sub-group ranks disagree with the coordinates", r);
}

int DeviceMesh::worldRank(int d, int p, int t) const {
  DTRAIN_CHECK(d >= 0 && d < shape_.data && p >= 0 && p < shape_.pipeline && t >= 0 && t < shape_.tensor,
               InvalidArgument, "DeviceMesh: coordinates (d {}, p {}, t {}) outside data {} x pipeline {} x tensor {}",
               d, p, t, shape_.data, shape_.pipeline, shape_.tensor);
  return (p * shape_.data + d) * shape_.tensor + t;
}

std::vector<int> DeviceMesh::dataRanks() const {
  std::vector<int> r;
  for (int d = 0; d < shape_.data; ++d) r.push_back(worldRank(d, pipeline_rank_, tensor_rank_));
  return r;
}

std::vector<int> DeviceMesh::pipelineRanks() const {
  std::vector<int> r;
  for (int p = 0; p < shape_.pipeline; ++p) r.push_back(worldRank(data_rank_, p, tensor_rank_));
  return r;
}

std::vector<int> DeviceMesh::tensorRanks() const {
  std::vector<int> r;
  for (int t = 0; t < shape_.tensor; ++t) r.push_back(worldRank(data_rank_, pipeline_rank_, t));
  return r;
}

std::string DeviceMesh::describe() const {
  return fmt::format("mesh data={} pipeline={} tensor={}: rank {} = (d {}, p {}, t {})", shape_.data,
                     shape_.pipeline, shape_.tensor, world_->rank(), data_rank_, pipeline_rank_, tensor_rank_);
}

}  // namespace dtrain
