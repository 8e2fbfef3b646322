// Which path a group's tensor collectives take (tensor_comm.h), as a pure function of where every rank's
// tensors are, and the one exchange that tells each rank the others' places. No torch, no CUDA here: the
// choice is unit tested on any machine (tests/torch/device_test.cc).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::device {

enum class Path { host, nccl, staged };
const char* pathName(Path p);

// Where one rank's tensors of a collective are.
struct Place {
  int device = -1;   // -1: the CPU; else the CUDA device index on that rank
  uint64_t gpu = 0;  // which physical GPU (host name and PCI bus id, hashed); 0 on the CPU
  // This rank's NCCL accepts ranks that share a GPU: NCCL 2.30 or later with NCCL_MULTI_RANK_GPU_ENABLE=1
  // (experimental in NCCL: about two ranks per GPU, hangs possible).
  bool nccl_shares_gpus = false;
  bool cuda() const { return device >= 0; }
  static Place cpu() { return {}; }
};

// The result of choosePath: a path, or (error not empty) why the group cannot communicate these tensors,
// the same words on every rank.
struct PathChoice {
  Path path = Path::host;
  std::string error;
};

// places[r] is rank r's. Every rank on the CPU: host. Every rank on a GPU: staged when mode is "staged" or
// dtrain has no NCCL, or (mode "auto") when two ranks share one GPU, which NCCL refuses; else nccl. Mode
// "nccl" with a shared GPU is nccl only where every rank's NCCL accepts that (Place::nccl_shares_gpus).
// Mode "nccl" with a shared GPU otherwise or no NCCL, ranks of both kinds, or an unknown mode: an error
// naming the ranks.
PathChoice choosePath(const std::vector<Place>& places, const std::string& mode, bool nccl_built);

// Collective over pg: every rank gives its place, and all get choosePath(every rank's place,
// pg.options().cuda_path, ncclBuilt()). InvalidArgument with the error on every rank; no exchange in a
// world of one.
Path agreePath(comm::ProcessGroup& pg, const Place& mine);

// Whether the NCCL this process loaded accepts ranks sharing a GPU: NCCL_MULTI_RANK_GPU_ENABLE=1 in the
// environment and NCCL 2.30 or later (ncclVersionText). False without NCCL.
bool ncclSharesGpus();

}  // namespace dtrain::device
