// A consumer of dtrain::comm alone (no libtorch): allreduce and allgather on every rank, results checked.
//   dtrain-run --standalone --nproc-per-node 2 consumer-allreduce 2     (the argument: the expected world size)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "dtrain/comm/comm.h"

int main(int argc, char** argv) try {
  using namespace dtrain::comm;
  const int expected = argc > 1 ? std::atoi(argv[1]) : 1;
  auto world = initWorld();
  const int rank = world->rank(), size = world->size();
  if (size != expected) {
    std::fprintf(stderr, "[rank %d] world size %d, expected %d (run it under dtrain-run)\n", rank, size, expected);
    return 1;
  }

  // Sum of (rank + 1) * (i + 1) over the ranks: (i + 1) * size * (size + 1) / 2.
  std::vector<float> grad(1000);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>((rank + 1) * (i + 1));
  world->allreduce(grad.data(), grad.size(), DType::f32, ReduceOp::sum)->wait();
  for (size_t i = 0; i < grad.size(); ++i) {
    const float want = static_cast<float>((i + 1) * size * (size + 1) / 2);
    if (grad[i] != want) {
      std::fprintf(stderr, "[rank %d] allreduce: element %zu is %g, expected %g\n", rank, i, grad[i], want);
      return 1;
    }
  }

  std::vector<int64_t> mine{rank, 10 * rank}, all(2 * size);
  world->allgather(mine.data(), all.data(), mine.size(), DType::i64)->wait();
  for (int r = 0; r < size; ++r) {
    if (all[2 * r] != r || all[2 * r + 1] != 10 * r) {
      std::fprintf(stderr, "[rank %d] allgather: rank %d's part is {%lld, %lld}\n", rank, r,
                   static_cast<long long>(all[2 * r]), static_cast<long long>(all[2 * r + 1]));
      return 1;
    }
  }
  std::printf("[rank %d] consumer allreduce and allgather of %d ranks: ok (%s)\n", rank, size,
              world->transportName().c_str());
  return 0;
} catch (const dtrain::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
