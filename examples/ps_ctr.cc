// Click-through-rate style training with the parameter server: a large embedding table (sparse rows,
// only the rows a batch touches travel) feeding a small MLP (dense parameters), BSP.
//
//   build/bin/dtrain-run --standalone --servers 1 --nproc-per-node 2 build/bin/example-ps-ctr
//   build/bin/example-ps-ctr 2          # alone: one worker and a server thread; 2 epochs (default 5)
//
// The same binary is a server or a worker by its role. Data: 4 categorical fields of 10k ids each
// (skewed: a few ids are frequent), all hashed into one 40k x 16 table; the click probability follows
// a planted logistic model (a hidden weight per id), so the model can learn it. Rank 0 prints the
// held-out loss, AUC and accuracy after every epoch.
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "dtrain/ps.h"

constexpr int64_t kFields = 4, kIds = 10000, kRows = kFields * kIds, kDim = 16;

// Ids per field (skewed), hashed into the shared table as field * kIds + id; labels from the planted model.
std::pair<torch::Tensor, torch::Tensor> makeData(int64_t n, const torch::Tensor& truth, uint64_t seed) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto u = at::rand({n, kFields}, g);
  auto ids = (u * u * kIds).to(torch::kLong).clamp_max(kIds - 1) + torch::arange(kFields, torch::kLong) * kIds;
  auto logit = truth.index_select(0, ids.flatten()).view({n, kFields}).sum(1);
  auto clicks = (at::rand({n}, g) < torch::sigmoid(logit)).to(torch::kFloat);
  return {ids, clicks};
}

// Area under the ROC curve (Mann-Whitney: the chance a random click scores above a random non-click).
double auc(const torch::Tensor& score, const torch::Tensor& label) {
  auto ranks = score.argsort().argsort().to(torch::kDouble) + 1;
  auto pos = label > 0.5;
  double P = pos.sum().item<double>(), N = label.size(0) - P;
  return (ranks.masked_select(pos).sum().item<double>() - P * (P + 1) / 2) / (P * N);
}

int main(int argc, char** argv) try {
  torch::set_num_threads(1);
  const int epochs = argc > 1 ? std::stoi(argv[1]) : 5;
  dtrain::ps::PSOptions opts;  // servers and workers must agree
  opts.update = dtrain::ps::PSOptions::Update::adam;
  opts.lr = 0.001;
  auto job = dtrain::ps::init(opts);  // a server process serves here until the workers finish
  if (job.isServer()) return 0;
  const int rank = job.rank(), world = job.numWorkers();
  dtrain::ps::Worker ps(job, opts);

  // The same data on every worker (seeded); each trains on its own share.
  torch::manual_seed(0);
  auto truth = 1.2 * torch::randn({kRows});
  auto [train_x, train_y] = makeData(262144, truth, 1);
  auto [test_x, test_y] = makeData(8192, truth, 2);

  if (rank == 0) {
    auto best = truth.index_select(0, test_x.flatten()).view({-1, kFields}).sum(1);
    std::printf("planted model (the best possible): test_loss %.4f  auc %.4f\n",
                torch::binary_cross_entropy_with_logits(best, test_y).item<double>(), auc(best, test_y));
  }

  torch::nn::Sequential mlp(torch::nn::Linear(kFields * kDim, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  auto params = mlp->parameters();
  for (size_t i = 0; i < params.size(); ++i) ps.declare("mlp" + std::to_string(i), params[i].detach());
  ps.declareRows("emb", kRows, kDim);

  // Embeddings of a batch: pull its distinct rows (the server creates them as zeros on first touch).
  auto forward = [&](const torch::Tensor& ids, torch::Tensor& uniq, torch::Tensor& rows) {
    torch::Tensor inverse;
    std::tie(uniq, inverse) = at::_unique(ids.flatten(), /*sorted=*/true, /*return_inverse=*/true);
    rows = ps.pullRows("emb", uniq).requires_grad_();
    return mlp->forward(rows.index_select(0, inverse).view({ids.size(0), kFields * kDim})).squeeze(1);
  };

  const int64_t batch = 512;  // per worker
  for (int epoch = 0; epoch < epochs; ++epoch) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(100 + epoch);
    auto order = at::randperm(train_x.size(0), g, torch::kLong);
    auto mine = order.slice(0, rank, order.size(0), world);  // this worker's share of the epoch
    double sum = 0;
    int steps = 0;
    for (int64_t b = 0; b + batch <= mine.size(0); b += batch) {
      auto idx = mine.narrow(0, b, batch);
      for (size_t i = 0; i < params.size(); ++i) {  // BSP: waits until the previous step's update is applied
        torch::NoGradGuard no_grad;
        auto p = params[i].detach();
        ps.pull("mlp" + std::to_string(i), p);
      }
      mlp->zero_grad();
      torch::Tensor uniq, rows;
      auto logits = forward(train_x.index_select(0, idx), uniq, rows);
      auto loss = torch::binary_cross_entropy_with_logits(logits, train_y.index_select(0, idx));
      loss.backward();
      for (size_t i = 0; i < params.size(); ++i) ps.push("mlp" + std::to_string(i), params[i].grad());
      ps.pushRows("emb", uniq, rows.grad());  // only the touched rows travel
      ps.clock();
      sum += loss.item<double>();
      ++steps;
    }
    if (rank == 0) {  // held-out metrics with the current parameters
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        auto p = params[i].detach();
        ps.pull("mlp" + std::to_string(i), p);
      }
      torch::Tensor uniq, rows;
      auto logits = forward(test_x, uniq, rows);
      double test_loss = torch::binary_cross_entropy_with_logits(logits, test_y).item<double>();
      double acc = ((logits > 0).to(torch::kFloat) == test_y).to(torch::kDouble).mean().item<double>();
      std::printf("epoch %d  train_loss %.4f  test_loss %.4f  auc %.4f  accuracy %.3f  (%d workers, %.1f KB sent)\n",
                  epoch, sum / steps, test_loss, auc(logits, test_y), acc, world, ps.bytesSent() / 1024.0);
      std::fflush(stdout);
    }
  }
  ps.finish();
  job.join();  // alone: the server thread ends once the worker said goodbye
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
