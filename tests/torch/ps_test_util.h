// What the parameter-server tests share: a job of real worker and server processes, the optimizer a
// one-process reference runs, and a relative comparison.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>

#include "dtrain/ps.h"
#include "harness.h"

namespace dtrain::test {

// W worker processes and S server processes (counting server_workers workers: W, or the hosts under
// local aggregation) around a TcpStore in the parent; fn(store, p) runs in worker p.
inline void runJob(int W, int S, int server_workers, const ps::PSOptions& o,
                   const std::function<void(const std::shared_ptr<comm::Store>&, int)>& fn,
                   std::chrono::seconds deadline = std::chrono::seconds(90)) {
  StoreServer server;
  auto results = runRanks(
      W + S,
      [&](int p) {
        auto store = server.client();
        if (p < W) {
          fn(store, p);
        } else {
          ps::Server srv(store, p - W, S, server_workers, o);
          srv.run();
        }
      },
      deadline);
  expectAllOk(results);
}

// The torch optimizer that matches the servers' update u.
inline std::unique_ptr<torch::optim::Optimizer> makeOpt(ps::PSOptions::Update u, const ps::PSOptions& o,
                                                        std::vector<torch::Tensor> params) {
  if (u == ps::PSOptions::Update::adam) {
    return std::make_unique<torch::optim::Adam>(params,
                                                torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr).momentum(o.momentum));
}

// max |got - want| within rel of max(1, max |want|).
// Worker p of two pushes p + 1 into a 3-element tensor of servers that only sum, and pulls the sum, 3.
inline void expectTwoWorkersSum(ps::Worker& wk, int p) {
  auto v = torch::zeros({3});
  wk.declare("v", v);
  wk.push("v", torch::full({3}, static_cast<float>(p + 1)));
  wk.clock();
  wk.pull("v", v);
  EXPECT_TRUE(v.equal(torch::full({3}, 3.0f))) << v;  // sum_only: 1 + 2
}

inline void expectClose(const torch::Tensor& got, const torch::Tensor& want, double rel, const std::string& what) {
  double diff = (got - want).abs().max().item<double>();
  double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LE(diff / scale, rel) << what << " differs by " << diff << "\ngot " << got << "\nwant " << want;
}

}  // namespace dtrain::test
