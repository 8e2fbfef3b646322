// A dtrain-run worker for flight_test (not a test itself): a 4-rank job that hangs in one of two ways
// after two warm-up allreduces of the world (seq 0 and 1) that every rank completes.
//   skip: ranks 0, 1, 3 issue allreduce seq=2 of the world; rank 2 skips it and instead waits in a
//         barrier of the sub-group {1, 2} ("world/sub0"), which rank 1 never joins.
//   span: ranks 0, 1, 3 issue allreduce seq=2 of the world; rank 2 sleeps inside the span
//         "load shard" without issuing anything.
// Every wait is bounded (60 s): the launcher's --hang-timeout is expected to stop the job long before.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/comm/rendezvous.h"
#include "dtrain/trace.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: flight_worker skip|span\n");
    return 2;
  }
  const std::string mode = argv[1];
  auto world = dtrain::comm::initWorld();
  const int rank = world->rank();
  auto sub = world->newGroup({1, 2});  // every rank calls newGroup
  std::vector<float> x(1024, 1.0f);
  for (int i = 0; i < 2; ++i) {
    world->allreduce(x.data(), x.data(), x.size(), dtrain::comm::DType::f32)->wait();
  }
  std::printf("rank %d warmed up\n", rank);
  if (rank != 2) {
    world->allreduce(x.data(), x.data(), x.size(), dtrain::comm::DType::f32)->wait();
    return 0;
  }
  if (mode == "skip") {
    // Later than the others' allreduce, so that the allreduce is the earliest stuck op.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    sub->barrier()->wait();
  } else {
    DTRAIN_SPAN("load shard");
    std::this_thread::sleep_for(std::chrono::seconds(60));
  }
  return 0;
}
