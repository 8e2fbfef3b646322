// A test fixture that clears every variable the rendezvous reads (torchrun's, OpenMPI's, Slurm's,
// DTRAIN_*) for the test and restores them afterwards, so a test run under srun or dtrain-run sees
// only what it sets.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <map>
#include <string>

extern char** environ;

namespace dtrain::test {

class Env : public ::testing::Test {
 protected:
  static bool rendezvousVar(const std::string& name) {
    static const char* kPrefixes[] = {"SLURM_", "SLURMD_", "OMPI_", "DTRAIN_", "TORCHELASTIC_", "MASTER_", "GROUP_"};
    for (const char* p : kPrefixes)
      if (name.rfind(p, 0) == 0) return true;
    return name == "RANK" || name == "WORLD_SIZE" || name == "LOCAL_RANK" || name == "LOCAL_WORLD_SIZE";
  }
  void SetUp() override {
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      auto eq = kv.find('=');
      if (eq != std::string::npos && rendezvousVar(kv.substr(0, eq))) saved_[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (auto& [k, v] : saved_) unsetenv(k.c_str());
  }
  void TearDown() override {
    std::vector<std::string> set;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      auto eq = kv.find('=');
      if (eq != std::string::npos && rendezvousVar(kv.substr(0, eq))) set.push_back(kv.substr(0, eq));
    }
    for (const auto& k : set) unsetenv(k.c_str());
    for (auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  std::map<std::string, std::string> saved_;
};

// Runs fn, which must throw E; returns its message ("" with a test failure if it did not throw E).
template <typename E, typename F>
std::string messageOf(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

}  // namespace dtrain::test
