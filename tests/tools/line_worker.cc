// A dtrain-run worker for launcher_test (not a test itself): forms the group, prints three lines
// through printf and std::cout ("\n", no flush), marks itself ready with DIR/ready.<rank>, then
//   hold: sleeps until it is stopped (30 s at most);
//   fail: rank 1 exits with code 3 once rank 0 is ready, the others sleep until stopped.
// The lines must reach the launcher although stdout is a pipe and the sleeper dies by SIGTERM.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "dtrain/comm/rendezvous.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: line_worker DIR hold|fail\n");
    return 2;
  }
  const std::string dir = argv[1], mode = argv[2];
  auto world = dtrain::comm::initWorld();
  const int rank = world->rank();
  std::printf("line 1 of rank %d (printf)\n", rank);
  std::cout << "line 2 of rank " << rank << " (cout)\n";
  std::printf("line 3 of rank %d (printf)\n", rank);
  { std::ofstream(dir + "/tmp." + std::to_string(rank)) << ::getpid() << "\n"; }
  std::rename((dir + "/tmp." + std::to_string(rank)).c_str(), (dir + "/ready." + std::to_string(rank)).c_str());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  if (mode == "fail" && rank == 1) {
    while (!std::ifstream(dir + "/ready.0") && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return 3;
  }
  while (std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  return 0;
}
