// What the MIL-NCE tests share: a world of one process, and the losses a run logged.
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtrain/comm/process_group.h"
#include "dtrain/distributed.h"

namespace milnce::test {

inline dtrain::Distributed worldOfOne() {
  auto pg = dtrain::comm::ProcessGroup::create(nullptr, 0, 1);
  return dtrain::Distributed(pg, pg, dtrain::comm::WorldInfo{});
}

// The loss of every step record of a metrics.jsonl, in order.
inline std::vector<double> lossesOf(const std::string& metrics) {
  std::ifstream f(metrics);
  std::vector<double> out;
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "step") out.push_back(j["loss"].get<double>());
  }
  return out;
}

}  // namespace milnce::test
