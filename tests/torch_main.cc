// main() of every test that uses libtorch: one intra-op thread, set before any test runs. The tests
// fork real ranks, and a child forked after libtorch started its OpenMP pool can hang in it.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
