// DDP with a custom torch::data Dataset and DataLoader: the same binary runs alone or under dtrain-run.
//
//   build/bin/example-ddp-dataloader                                          # one process
//   build/bin/dtrain-run --standalone --nproc-per-node 2 build/bin/example-ddp-dataloader
//
// The dataset generates 2-D points on three interleaved spirals (the label is the spiral); the model
// has a BatchNorm layer, whose running statistics DDP keeps equal to rank 0's. Each rank reads its
// share of every epoch through dtrain::DistributedLoaderSampler, a torch::data sampler.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "dtrain/ddp.h"
#include "dtrain/distributed.h"
#include "dtrain/sampler.h"

// A map-style dataset: get(i) returns example i, size() how many there are.
class Spirals : public torch::data::datasets::Dataset<Spirals> {
 public:
  explicit Spirals(int64_t n) : labels_(torch::arange(n) % 3) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(1);  // the same data on every rank
    auto r = torch::rand({n}, g, torch::kFloat);
    auto theta = r * 4.0 + labels_.to(torch::kFloat) * (2 * M_PI / 3) + 0.2 * torch::randn({n}, g, torch::kFloat);
    points_ = torch::stack({r * torch::cos(theta), r * torch::sin(theta)}, 1);
  }
  torch::data::Example<> get(size_t i) override {
    auto k = static_cast<int64_t>(i);
    return {points_[k], labels_[k]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(labels_.size(0)); }
  const at::Tensor& points() const { return points_; }
  const at::Tensor& labels() const { return labels_; }

 private:
  at::Tensor labels_, points_;
};

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(2, 64))),
        bn(register_module("bn", torch::nn::BatchNorm1d(64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 64))),
        fc3(register_module("fc3", torch::nn::Linear(64, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn->forward(fc1->forward(x)));
    return fc3->forward(torch::relu(fc2->forward(x)));
  }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2, fc3;
};
TORCH_MODULE(Net);

int main() try {
  torch::set_num_threads(1);
  auto dist = dtrain::init();  // a world of one when not launched by dtrain-run / torchrun / mpirun

  Spirals spirals(6000);
  dtrain::DistributedLoaderSampler sampler(static_cast<int64_t>(spirals.size().value()), dist, /*shuffle=*/true,
                                           /*seed=*/0);
  // The loader holds a copy of the sampler; copies share the epoch, so setEpoch below reaches it.
  auto loader = torch::data::make_data_loader(Spirals(spirals).map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions().batch_size(64));

  torch::manual_seed(0);
  Net model;
  dtrain::DistributedDataParallel ddp(model.ptr(), dist.world());  // rank 0's weights and buffers everywhere
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));

  for (int epoch = 0; epoch < 8; ++epoch) {
    sampler.setEpoch(epoch);  // a new shuffle each epoch, the same on every rank
    double sum = 0;
    int steps = 0;
    for (auto& batch : *loader) {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model->forward(batch.data), batch.target);
      loss.backward();  // gradients averaged across ranks, then rank 0's BatchNorm statistics broadcast
      opt.step();
      sum += loss.item<double>();
      ++steps;
    }
    model->eval();  // BatchNorm uses the running statistics: rank 0's on every rank
    torch::NoGradGuard no_grad;
    double acc = (model->forward(spirals.points()).argmax(1) == spirals.labels()).to(torch::kDouble).mean().item<double>();
    model->train();
    std::printf("epoch %d  loss %.4f  accuracy %.3f  (%d steps, %d ranks)\n", epoch, sum / steps, acc, steps, dist.size());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
