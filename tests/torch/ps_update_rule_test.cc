// The parameter server's one update rule (src/torch/ps/update_rule.h) serves dense partitions and sparse
// rows: for SGD, SGD with momentum, Adam and sum_only it gives bit-identical values and optimizer state
// for a dense partition and for sparse rows holding the same values, over several steps, both when
// called directly and through real servers (a dense tensor and a sparse table pushed the same
// gradients). The dense layout also matches torch::optim (SGD to the bit, Adam within 1e-6).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "dtrain/ps.h"
#include "harness.h"
#include "ps_test_util.h"
#include "torch/ps/update_rule.h"

namespace dtrain::test {
namespace {

using ps::PSOptions;
using ps::UpdateRule;

struct Case {
  std::string name;
  PSOptions::Update update;
  double momentum;
};

// gtest names the parameterised tests by Case::name (below); this prints it in their descriptions.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

PSOptions optionsOf(const Case& c) {
  PSOptions o;
  o.consistency = ps::Consistency::asp;
  o.update = c.update;
  o.momentum = c.momentum;
  o.lr = c.update == PSOptions::Update::adam ? 0.01 : 0.1;
  return o;
}

torch::Tensor gradOf(int step, int64_t rows, int64_t dim) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  return at::randn({rows, dim}, g, torch::kFloat);
}

class PSUpdateRule : public ::testing::TestWithParam<Case> {};

// The same values as one dense [slots, rows * dim] partition and as `rows` sparse rows of slots x dim
// floats each; every step applies the same gradient to both.
TEST_P(PSUpdateRule, DenseAndRowsBitIdentical) {
  constexpr int64_t kRows = 6, kDim = 5, kSteps = 7;
  const PSOptions o = optionsOf(GetParam());
  const UpdateRule rule(o, /*assign_sums=*/false);
  const int64_t slots = rule.slots();
  ASSERT_EQ(slots, ps::stateSlots(o));
  const int64_t n = kRows * kDim;
  auto init = at::randn({kRows, kDim}, at::make_generator<at::CPUGeneratorImpl>(3), torch::kFloat);
  auto dense = torch::zeros({slots, n});
  dense[0].copy_(init.flatten());
  auto rows = torch::zeros({kRows, slots, kDim});  // row r: value, then its state
  rows.select(1, 0).copy_(init);
  int64_t dense_step = 0;
  std::vector<int64_t> row_steps(kRows, 0);
  for (int step = 0; step < kSteps; ++step) {
    auto g = gradOf(step, kRows, kDim);
    rule.apply(dense.data_ptr<float>(), n, g.data_ptr<float>(), n, dense_step);
    for (int64_t r = 0; r < kRows; ++r)
      rule.apply(rows[r].data_ptr<float>(), kDim, g[r].data_ptr<float>(), kDim, row_steps[static_cast<size_t>(r)]);
    for (int64_t s = 0; s < slots; ++s) {
      auto as_rows = rows.select(1, s).contiguous();
      ASSERT_EQ(std::memcmp(dense[s].data_ptr<float>(), as_rows.data_ptr<float>(), n * sizeof(float)), 0)
          << GetParam().name << ": slot " << s << " differs after step " << step << "\ndense " << dense[s]
          << "\nrows  " << as_rows.flatten();
    }
    for (int64_t r = 0; r < kRows; ++r) EXPECT_EQ(row_steps[static_cast<size_t>(r)], dense_step);
  }
}

// The dense layout against torch on the same tensor: its optimizer, or for sum_only `value += grad`.
TEST_P(PSUpdateRule, DenseMatchesTorchOptim) {
  const PSOptions o = optionsOf(GetParam());
  const UpdateRule rule(o, false);
  constexpr int64_t n = 37;  // vector body and scalar tail of ATen's kernels
  auto ref = torch::linspace(-1, 1, n).requires_grad_(true);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (o.update != PSOptions::Update::sum_only) opt = makeOpt(o.update, o, {ref});
  auto dense = torch::zeros({rule.slots(), n});
  dense[0].copy_(ref.detach());
  int64_t step = 0;
  for (int k = 0; k < 6; ++k) {
    auto g = gradOf(k, 1, n).flatten();
    if (opt) {
      ref.mutable_grad() = g.clone();
      opt->step();
    } else {
      torch::NoGradGuard no_grad;
      ref.add_(g);
    }
    rule.apply(dense.data_ptr<float>(), n, g.data_ptr<float>(), n, step);
    if (o.update != PSOptions::Update::adam) {
      EXPECT_TRUE(torch::equal(dense[0], ref.detach())) << "step " << k << "\ngot  " << dense[0] << "\nwant "
                                                        << ref.detach();
    } else {
      expectClose(dense[0], ref.detach(), 1e-6, "adam step " + std::to_string(k));
    }
  }
}

// Through real servers: a dense tensor of rows x dim zeros and a sparse table of the same shape (rows
// start as zeros), pushed the same gradients each step by one worker (asp: each push is one step).
TEST_P(PSUpdateRule, ServerDenseTensorAndSparseTableAgree) {
  constexpr int64_t kRows = 6, kDim = 5, kSteps = 5;
  PSOptions o = optionsOf(GetParam());
  o.partition_bytes = 32;  // partitions of 8 floats: they do not line up with the rows
  o.timeout = std::chrono::seconds(20);
  runJob(1, 2, 1, o, [&](const std::shared_ptr<comm::Store>& store, int p) {
    ps::Worker wk(store, p, 1, 2, o);
    wk.declare("dense", torch::zeros({kRows * kDim}));
    wk.declareRows("table", kRows, kDim);
    auto all_rows = torch::arange(kRows, torch::kLong);
    auto out = torch::empty({kRows * kDim});
    for (int step = 0; step < kSteps; ++step) {
      auto g = gradOf(step, kRows, kDim);
      wk.push("dense", g.flatten());
      wk.pushRows("table", all_rows, g);
      wk.clock();
      wk.pull("dense", out);
      auto rows = wk.pullRows("table", all_rows);
      EXPECT_TRUE(torch::equal(out.view({kRows, kDim}), rows))
          << GetParam().name << " step " << step << "\ndense " << out.view({kRows, kDim}) << "\nrows  " << rows;
    }
    auto state = wk.saveState();
    EXPECT_TRUE(torch::equal(state.at("dense").view({-1, kRows, kDim}).transpose(0, 1).contiguous(),
                             [&] {
                               // #data rows come per server; order them by id.
                               auto ids = state.at("table#rows");
                               auto order = std::get<1>(ids.sort());
                               return state.at("table#data").index_select(0, order).view({kRows, -1, kDim});
                             }()))
        << GetParam().name << ": optimizer state differs";
    EXPECT_TRUE(torch::equal(state.at("table#steps"), torch::full({kRows}, state.at("dense#step")[0].item<int64_t>(),
                                                                  torch::kLong)))
        << state.at("table#steps") << " vs " << state.at("dense#step");
    wk.finish();
  });
}

INSTANTIATE_TEST_SUITE_P(Rules, PSUpdateRule,
                         ::testing::Values(Case{"sgd", PSOptions::Update::sgd, 0.0},
                                           Case{"sgd_momentum", PSOptions::Update::sgd, 0.9},
                                           Case{"adam", PSOptions::Update::adam, 0.0},
                                           Case{"sum_only", PSOptions::Update::sum_only, 0.0}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace dtrain::test
