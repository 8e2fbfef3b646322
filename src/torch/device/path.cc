// The path choice of tensor collectives (path.h).
#include "torch/device/path.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstring>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"

namespace dtrain::device {

const char* pathName(Path p) {
  switch (p) {
    case Path::host: return "host";
    case Path::nccl: return "nccl";
    case Path::staged: return "staged";
  }
  return "?";
}

namespace {

std::string where(const Place& p) { return p.cuda() ? fmt::format("cuda:{}", p.device) : "cpu"; }

// "rank 0 on cpu, rank 1 on cuda:0, ..." (the first eight, then how many more).
std::string listPlaces(const std::vector<Place>& places) {
  constexpr size_t kShown = 8;
  std::string s;
  for (size_t r = 0; r < places.size() && r < kShown; ++r)
    s += fmt::format("{}rank {} on {}", r ? ", " : "", r, where(places[r]));
  if (places.size() > kShown) s += fmt::format(" and {} more", places.size() - kShown);
  return s;
}

}  // namespace

PathChoice choosePath(const std::vector<Place>& places, const std::string& mode, bool nccl_built) {
  if (mode != "auto" && mode != "nccl" && mode != "staged")
    return {Path::host, fmt::format("cuda_path '{}' (expected auto, nccl or staged)", mode)};
  if (places.empty()) return {Path::host, "a group of no ranks"};
  size_t on_gpu = 0;
  for (const Place& p : places) on_gpu += p.cuda() ? 1 : 0;
  if (on_gpu == 0) return {Path::host, ""};
  if (on_gpu != places.size())
    return {Path::host, fmt::format("the ranks pass tensors of different kinds ({}): every rank of a group must pass "
                                    "CPU tensors, or every rank CUDA tensors, to the same collective",
                                    listPlaces(places))};
  if (mode == "staged") return {Path::staged, ""};
  if (!nccl_built) {
    if (mode == "nccl") return {Path::staged, "cuda_path nccl (DTRAIN_CUDA_COMM=nccl), and this dtrain was built without NCCL"};
    return {Path::staged, ""};
  }
  bool all_share = true;
  for (const Place& p : places) all_share = all_share && p.nccl_shares_gpus;
  for (size_t r = 0; r < places.size(); ++r)
    for (size_t q = r + 1; q < places.size(); ++q)
      if (places[r].gpu == places[q].gpu) {
        if (mode == "auto") return {Path::staged, ""};
        if (all_share) return {Path::nccl, ""};
        return {Path::staged, fmt::format("cuda_path nccl (DTRAIN_CUDA_COMM=nccl): ranks {} and {} share one GPU, and NCCL "
                                          "refuses two ranks on one GPU unless every rank has NCCL 2.30 or later with "
                                          "NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental); DTRAIN_CUDA_COMM=auto stages "
                                          "such tensors through the host", r, q)};
      }
  return {Path::nccl, ""};
}

Path agreePath(comm::ProcessGroup& pg, const Place& mine) {
  std::vector<Place> places(static_cast<size_t>(pg.size()));
  if (pg.size() == 1) {
    places[0] = mine;
  } else {
    // Three words per rank: the device index (-1: the CPU), the GPU's identity, NCCL's sharing.
    constexpr size_t kWords = 3;
    int64_t word[kWords] = {mine.device, 0, mine.nccl_shares_gpus ? 1 : 0};
    std::memcpy(&word[1], &mine.gpu, sizeof(mine.gpu));
    std::vector<int64_t> all(kWords * places.size());
    pg.allgather(word, all.data(), kWords, comm::DType::i64)->wait();
    for (size_t r = 0; r < places.size(); ++r) {
      const int64_t* w = &all[kWords * r];
      places[r].device = static_cast<int>(w[0]);
      std::memcpy(&places[r].gpu, &w[1], sizeof(places[r].gpu));
      places[r].nccl_shares_gpus = w[2] != 0;
    }
  }
  PathChoice c = choosePath(places, pg.options().cuda_path, comm::ncclBuilt());
  const std::string& name = pg.options().name;
  DTRAIN_CHECK(c.error.empty(), InvalidArgument, "[rank {}] tensor collective{}: {}", pg.rank(),
               name.empty() ? "" : fmt::format(" on group '{}'", name), c.error);
  return c.path;
}

bool ncclSharesGpus() {
  if (!comm::ncclBuilt() || !comm::rendezvous::Environment::read().flag("NCCL_MULTI_RANK_GPU_ENABLE")) return false;
  int major = 0, minor = 0;
  if (std::sscanf(comm::ncclVersionText().c_str(), "%d.%d", &major, &minor) != 2) return false;
  return major > 2 || (major == 2 && minor >= 30);
}

}  // namespace dtrain::device
