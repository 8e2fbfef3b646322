// N allreduces of 4 KiB (1024 x f32), each waited for: the loop whose instruction count
// benches/instr_cost.sh compares between two revisions under callgrind (the cost of the always-on
// collective fingerprint check, docs/PERFORMANCE.md). Comm layer only; builds with g++ alone.
#include <cstdlib>
#include <vector>
#include "dtrain/comm/comm.h"
// instr_cost.sh builds this file against older revisions too, where initWorld() was called init().
#ifndef DTRAIN_LOOP_INIT
#define DTRAIN_LOOP_INIT initWorld
#endif
int main(int argc, char** argv) {
  using namespace dtrain::comm;
  auto world = DTRAIN_LOOP_INIT();
  int n = argc > 1 ? std::atoi(argv[1]) : 1000;
  std::vector<float> buf(1024, 1.0f);
  for (int i = 0; i < n; ++i) world->allreduce(buf.data(), buf.size(), DType::f32, ReduceOp::sum)->wait();
  world->barrier()->wait();
}
