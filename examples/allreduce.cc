// The smallest dtrain::comm program: every rank contributes its rank, everyone gets the sum.
//
//   build/bin/example-allreduce                                   # alone: a world of one
//   build/bin/dtrain-run --standalone --nproc-per-node 4 build/bin/example-allreduce
#include <cstdio>
#include <vector>

#include "dtrain/comm/comm.h"

int main() try {
  using namespace dtrain::comm;
  auto world = initWorld();  // RANK/WORLD_SIZE/MASTER_ADDR/... from dtrain-run, torchrun, mpirun or srun

  std::vector<float> grad(1 << 20, static_cast<float>(world->rank()));
  auto work = world->allreduce(grad.data(), grad.size(), DType::f32, ReduceOp::sum);  // returns at once
  work->wait();  // rethrows the op's error, if any; every op has a deadline (DTRAIN_TIMEOUT)

  float want = world->size() * (world->size() - 1) / 2.0f;
  std::printf("rank %d of %d (%s): sum = %g (expected %g)\n", world->rank(), world->size(),
              world->transportName().c_str(), grad[0], want);
  return grad[0] == want && grad.back() == want ? 0 : 1;
} catch (const dtrain::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
