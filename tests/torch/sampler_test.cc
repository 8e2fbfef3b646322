// DistributedSampler: coverage and disjointness across ranks, padding and truncation counts, epoch
// seeding, edge cases, and equality of the permutation with Python's torch.randperm.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "dtrain/comm/error.h"
#include "dtrain/sampler.h"
#include "harness.h"

namespace dtrain::test {
namespace {

// How many times each index appears over all ranks.
std::map<int64_t, int> countOverRanks(int64_t n, int replicas, bool shuffle, bool drop_last, int64_t epoch = 0) {
  std::map<int64_t, int> counts;
  for (int r = 0; r < replicas; ++r) {
    DistributedSampler s(n, replicas, r, shuffle, 7, drop_last);
    s.setEpoch(epoch);
    auto idx = s.indices();
    EXPECT_EQ(static_cast<int64_t>(idx.size()), s.size()) << "rank " << r;
    for (int64_t i : idx) {
      EXPECT_GE(i, 0);
      EXPECT_LT(i, n);
      ++counts[i];
    }
  }
  return counts;
}

TEST(Sampler, CoverageWithPaddingOnlyWhenNeeded) {
  for (bool shuffle : {false, true})
    for (int64_t n : {1, 2, 5, 10, 11, 12, 97, 100})
      for (int replicas : {1, 2, 3, 4, 7}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " R=" << replicas << " shuffle=" << shuffle);
        auto counts = countOverRanks(n, replicas, shuffle, /*drop_last=*/false);
        // Every index is read; the total is ceil(n/R)*R, so exactly `pad` extra reads are duplicates.
        EXPECT_EQ(static_cast<int64_t>(counts.size()), n);
        const int64_t total = (n + replicas - 1) / replicas * replicas, pad = total - n;
        int64_t reads = 0, extra = 0;
        for (auto& [i, c] : counts) {
          reads += c;
          extra += c - 1;
        }
        EXPECT_EQ(reads, total);
        EXPECT_EQ(extra, pad);
        if (n % replicas == 0) {
          for (auto& [i, c] : counts) EXPECT_EQ(c, 1) << "index " << i;
        }
      }
}

TEST(Sampler, DropLastIsDisjointAndTruncates) {
  for (bool shuffle : {false, true})
    for (int64_t n : {0, 1, 5, 10, 11, 97})
      for (int replicas : {1, 2, 3, 4, 7}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " R=" << replicas << " shuffle=" << shuffle);
        auto counts = countOverRanks(n, replicas, shuffle, /*drop_last=*/true);
        EXPECT_EQ(static_cast<int64_t>(counts.size()), n / replicas * replicas);
        for (auto& [i, c] : counts) EXPECT_EQ(c, 1) << "index " << i;
        DistributedSampler s(n, replicas, 0, shuffle, 0, true);
        EXPECT_EQ(s.size(), n / replicas);
      }
}

TEST(Sampler, SizesAndStridedOrderWithoutShuffle) {
  // PyTorch: padded order [0..9, 0, 1], rank r takes [r::4].
  DistributedSampler r1(10, 4, 1, /*shuffle=*/false);
  EXPECT_EQ(r1.size(), 3);
  EXPECT_EQ(r1.totalSize(), 12);
  EXPECT_EQ(r1.indices(), (std::vector<int64_t>{1, 5, 9}));
  EXPECT_EQ(DistributedSampler(10, 4, 3, false).indices(), (std::vector<int64_t>{3, 7, 1}));
  // drop_last: [0..7], rank 3 takes 3 and 7.
  EXPECT_EQ(DistributedSampler(10, 4, 3, false, 0, true).indices(), (std::vector<int64_t>{3, 7}));
}

TEST(Sampler, EpochsChangeThePermutationDeterministically) {
  DistributedSampler a(1000, 3, 1, true, 5), b(1000, 3, 1, true, 5);
  a.setEpoch(0);
  auto e0 = a.indices();
  EXPECT_EQ(e0, a.indices()) << "the same epoch must give the same order";
  b.setEpoch(0);
  EXPECT_EQ(e0, b.indices()) << "another sampler with the same seed and epoch must agree";
  a.setEpoch(1);
  auto e1 = a.indices();
  EXPECT_NE(e0, e1);
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), e0.size());
  // A different seed changes the order too; seed + epoch is what counts (as in PyTorch).
  DistributedSampler c(1000, 3, 1, true, 6);
  EXPECT_EQ(c.indices(), e1);
  a.setEpoch(0);
  EXPECT_EQ(a.indices(), e0);
}

TEST(Sampler, EdgeCases) {
  // n = 0: nothing to read, with or without drop_last.
  for (bool drop : {false, true}) {
    DistributedSampler s(0, 3, 2, true, 0, drop);
    EXPECT_EQ(s.size(), 0);
    EXPECT_TRUE(s.indices().empty());
  }
  // n < R: every rank gets one index, wrapping around the order (PyTorch repeats it as needed).
  for (int r = 0; r < 5; ++r) {
    DistributedSampler s(2, 5, r, /*shuffle=*/false);
    EXPECT_EQ(s.indices(), (std::vector<int64_t>{r % 2})) << "rank " << r;
  }
  // n < R with drop_last: nobody reads anything.
  EXPECT_TRUE(DistributedSampler(2, 5, 4, true, 0, true).indices().empty());
  // Single replica with shuffle is a permutation of everything.
  auto all = DistributedSampler(50, 1, 0, true, 3).indices();
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(all[static_cast<size_t>(i)], i);
}

TEST(Sampler, InvalidArgumentsAreNamed) {
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no InvalidArgument");
  };
  EXPECT_NE(message([] { DistributedSampler(10, 2, 2); }).find("rank 2"), std::string::npos);
  EXPECT_NE(message([] { DistributedSampler(10, 2, -1); }).find("rank -1"), std::string::npos);
  EXPECT_NE(message([] { DistributedSampler(10, 0, 0); }).find("num_replicas"), std::string::npos);
  EXPECT_NE(message([] { DistributedSampler(-1, 2, 0); }).find("dataset_size"), std::string::npos);
}


// The whole padded order over ranks, reassembled: order[r + i*R] = indices of rank r at i.
std::vector<int64_t> fullOrder(int64_t n, int replicas, uint64_t seed, int64_t epoch, bool drop_last) {
  int64_t total = DistributedSampler(n, replicas, 0, true, seed, drop_last).totalSize();
  std::vector<int64_t> order(static_cast<size_t>(total));
  for (int r = 0; r < replicas; ++r) {
    DistributedSampler s(n, replicas, r, true, seed, drop_last);
    s.setEpoch(epoch);
    auto idx = s.indices();
    for (size_t i = 0; i < idx.size(); ++i) order[r + i * replicas] = idx[i];
  }
  return order;
}

TEST(Sampler, MatchesPythonDistributedSampler) {
  struct Case {
    int64_t n;
    int replicas;
    uint64_t seed;
    int64_t epoch;
    bool drop_last;
  };
  // Small and large n (randperm takes a different path above a size threshold), padding and truncation.
  const Case cases[] = {{10, 3, 0, 0, false}, {17, 4, 42, 3, true}, {5, 7, 1, 2, false}, {20000, 3, 123, 1, false}};
  std::ostringstream code;
  code << "import torch\n"
          "from torch.utils.data.distributed import DistributedSampler as S\n";
  for (const auto& c : cases) {
    // Python's own DistributedSampler, over every rank, on a dataset that is just range(n).
    code << "n,R,seed,ep,dl=" << c.n << "," << c.replicas << "," << c.seed << "," << c.epoch << ","
         << (c.drop_last ? "True" : "False") << "\n"
         << "out=[]\n"
            "for r in range(R):\n"
            "  s=S(range(n),num_replicas=R,rank=r,shuffle=True,seed=seed,drop_last=dl); s.set_epoch(ep)\n"
            "  out.append(list(s))\n"
            "order=[out[j%R][j//R] for j in range(len(out[0])*R)]\n"
            "g=torch.Generator().manual_seed(seed+ep)\n"
            "perm=torch.randperm(n,generator=g).tolist()\n"
            "print(' '.join(map(str,order)))\n"
            "print(' '.join(map(str,perm)))\n";
  }
  std::istringstream lines(runPython(code.str()));
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "n=" << c.n << " R=" << c.replicas << " seed=" << c.seed
                                      << " epoch=" << c.epoch << " drop_last=" << c.drop_last);
    auto parse = [&lines] {
      std::string line;
      std::getline(lines, line);
      std::istringstream is(line);
      std::vector<int64_t> v;
      for (int64_t x; is >> x;) v.push_back(x);
      return v;
    };
    auto py_order = parse(), py_perm = parse();
    ASSERT_EQ(py_perm.size(), static_cast<size_t>(c.n));
    EXPECT_EQ(fullOrder(c.n, c.replicas, c.seed, c.epoch, c.drop_last), py_order);
    // And the permutation itself, straight from torch.randperm with a seeded generator.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(c.seed + static_cast<uint64_t>(c.epoch));
    auto perm = torch::randperm(c.n, gen, torch::kLong);
    EXPECT_EQ(std::vector<int64_t>(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + c.n), py_perm);
  }
}

// ---- DistributedLoaderSampler: the same order through torch::data::make_data_loader ----

// A dataset whose example i is the number i (data) and i % 3 (target): what a batch holds tells
// which indices the loader read.
struct Numbers : torch::data::datasets::Dataset<Numbers> {
  explicit Numbers(int64_t n) : n_(n) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::tensor(static_cast<int64_t>(i)), torch::tensor(static_cast<int64_t>(i % 3))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n_); }
  int64_t n_;
};

// Every index one rank's loader yields in one epoch, in order, and the batch sizes.
std::vector<int64_t> readEpoch(DistributedLoaderSampler& sampler, int64_t n, size_t batch,
                               std::vector<size_t>* sizes = nullptr) {
  auto loader = torch::data::make_data_loader(Numbers(n).map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions().batch_size(batch));
  std::vector<int64_t> out;
  for (auto& b : *loader) {
    EXPECT_TRUE(torch::equal(b.target, b.data % 3));
    if (sizes) sizes->push_back(static_cast<size_t>(b.data.size(0)));
    for (int64_t i = 0; i < b.data.size(0); ++i) out.push_back(b.data[i].item<int64_t>());
  }
  return out;
}

TEST(LoaderSampler, RanksPartitionTheDatasetInTheSamplersOrder) {
  for (bool shuffle : {false, true})
    for (bool drop_last : {false, true})
      for (int64_t n : {10, 11, 12})
        for (int replicas : {1, 2, 3, 4}) {
          SCOPED_TRACE(::testing::Message() << "n=" << n << " R=" << replicas << " shuffle=" << shuffle
                                            << " drop_last=" << drop_last);
          std::map<int64_t, int> counts;
          for (int r = 0; r < replicas; ++r) {
            DistributedLoaderSampler sampler(n, replicas, r, shuffle, 5, drop_last);
            sampler.setEpoch(2);
            std::vector<size_t> sizes;
            auto got = readEpoch(sampler, n, 3, &sizes);
            DistributedSampler plain(n, replicas, r, shuffle, 5, drop_last);
            plain.setEpoch(2);
            EXPECT_EQ(got, plain.indices()) << "rank " << r;
            EXPECT_EQ(static_cast<int64_t>(got.size()), sampler.size());
            // Batches of 3, the last one short.
            for (size_t k = 0; k + 1 < sizes.size(); ++k) EXPECT_EQ(sizes[k], 3u);
            for (int64_t i : got) ++counts[i];
          }
          const int64_t per = drop_last ? n / replicas : (n + replicas - 1) / replicas;
          int64_t reads = 0;
          for (auto& [i, c] : counts) reads += c;
          EXPECT_EQ(reads, per * replicas);
          // Padding repeats exactly per*R - n indices; drop_last reads each index at most once.
          EXPECT_EQ(static_cast<int64_t>(counts.size()), drop_last ? per * replicas : n);
          if (drop_last || n % replicas == 0) {
            for (auto& [i, c] : counts) EXPECT_EQ(c, 1) << "index " << i;
          }
        }
}

// setEpoch on the sampler the user kept reaches the loader's copy; every begin() starts the epoch's
// order from the start; reset(new_size) re-partitions a resized dataset.
TEST(LoaderSampler, EpochsAndResets) {
  DistributedLoaderSampler sampler(40, 2, 1, /*shuffle=*/true, /*seed=*/9);
  auto loader = torch::data::make_data_loader(Numbers(40).map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions().batch_size(4));
  auto epochOf = [&] {
    std::vector<int64_t> out;
    for (auto& b : *loader)
      for (int64_t i = 0; i < b.data.size(0); ++i) out.push_back(b.data[i].item<int64_t>());
    return out;
  };
  auto expected = [](int64_t epoch) {
    DistributedSampler s(40, 2, 1, true, 9);
    s.setEpoch(epoch);
    return s.indices();
  };
  sampler.setEpoch(0);
  EXPECT_EQ(epochOf(), expected(0));
  sampler.setEpoch(1);
  auto e1 = epochOf();
  EXPECT_EQ(e1, expected(1));
  EXPECT_NE(e1, expected(0));
  // An epoch abandoned after one batch: the next begin() starts over.
  sampler.setEpoch(2);
  { auto it = loader->begin(); }
  EXPECT_EQ(epochOf(), expected(2));

  DistributedLoaderSampler direct(40, 2, 1, true, 9);
  direct.reset(10);
  std::vector<int64_t> small;
  while (auto b = direct.next(100)) small.insert(small.end(), b->begin(), b->end());
  EXPECT_EQ(small, DistributedSampler(10, 2, 1, true, 9).indices());
  EXPECT_EQ(direct.size(), 5);

  // save/load keep the epoch and the position.
  DistributedLoaderSampler a(40, 2, 0, true, 9), b(40, 2, 0, true, 9);
  a.setEpoch(4);
  a.reset();
  a.next(7);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  std::istringstream is(bytes.str());
  in.load_from(is);
  b.load(in);
  EXPECT_EQ(b.epoch(), 4);
  EXPECT_EQ(b.next(100), a.next(100));
}

// An epoch read for k steps of b samples per rank at world R, then resumed from the global position at
// world R2: the union reads every sample of the order exactly once, plus only the padding of the rest.
TEST(Sampler, ResumesMidEpochAtAnotherWorldSize) {
  struct Case {
    int64_t n;
    int world, steps, batch, world2;
    bool drop_last;
  };
  for (const Case c : {Case{100, 4, 3, 5, 5, false}, Case{100, 4, 3, 5, 3, false}, Case{103, 2, 7, 3, 4, false},
                       Case{103, 4, 2, 4, 3, true}, Case{50, 3, 1, 2, 1, false}}) {
    const std::string what = fmt::format("n {} world {} -> {} after {} steps of {}{}", c.n, c.world, c.world2, c.steps,
                                         c.batch, c.drop_last ? " drop_last" : "");
    std::map<int64_t, int> counts;
    for (int r = 0; r < c.world; ++r) {
      DistributedSampler s(c.n, c.world, r, true, 11, c.drop_last);
      s.setEpoch(5);
      auto idx = s.indices();
      for (int i = 0; i < c.steps * c.batch; ++i) ++counts[idx[static_cast<size_t>(i)]];
    }
    const int64_t start = int64_t{c.steps} * c.batch * c.world;
    int64_t read = 0;
    for (int r = 0; r < c.world2; ++r) {
      DistributedSampler s(c.n, c.world2, r, true, 11, c.drop_last);
      s.setEpoch(5, start);
      EXPECT_EQ(s.start(), start);
      auto idx = s.indices();
      EXPECT_EQ(static_cast<int64_t>(idx.size()), s.size()) << what;
      for (int64_t i : idx) ++counts[i];
      read += static_cast<int64_t>(idx.size());
    }
    const int64_t left = c.n - start;
    const int64_t expect_read = c.drop_last ? left / c.world2 * c.world2 : (left + c.world2 - 1) / c.world2 * c.world2;
    EXPECT_EQ(read, expect_read) << what;
    // Before the padding or truncation of the rest, each sample once: the order's first n - (truncated).
    int64_t once = 0, twice = 0, missing = 0;
    for (int64_t i = 0; i < c.n; ++i) {
      const int k = counts.count(i) ? counts[i] : 0;
      once += k == 1;
      twice += k == 2;
      missing += k == 0;
      EXPECT_LE(k, 2) << what << ": sample " << i;
    }
    EXPECT_EQ(twice, c.drop_last ? 0 : expect_read - left) << what << ": only the rest's padding repeats";
    EXPECT_EQ(missing, c.drop_last ? left - expect_read : 0) << what << ": only drop_last's truncation skips";
    EXPECT_EQ(once + twice + missing, c.n);
  }
  // The same sampler resumed at the same world size reads exactly what the uninterrupted one still would.
  DistributedSampler whole(97, 3, 2, true, 4), rest(97, 3, 2, true, 4);
  whole.setEpoch(1);
  rest.setEpoch(1, 3 * 10);
  auto all = whole.indices();
  EXPECT_EQ(rest.indices(), std::vector<int64_t>(all.begin() + 10, all.end()));
  DistributedSampler bad(10, 2, 0);
  EXPECT_THROW(bad.setEpoch(0, 11), InvalidArgument);
  EXPECT_THROW(bad.setEpoch(0, -1), InvalidArgument);
  bad.setEpoch(0, 10);
  EXPECT_EQ(bad.size(), 0);
  EXPECT_TRUE(bad.indices().empty());
}

// A loader sampler saved at 4 ranks mid-epoch and loaded at 3 goes on from the same global position.
TEST(LoaderSampler, LoadsAtAnotherWorldSizeFromTheGlobalPosition) {
  std::map<int64_t, int> counts;
  std::vector<std::string> saved;
  for (int r = 0; r < 4; ++r) {
    DistributedLoaderSampler a(60, 4, r, true, 3);
    a.setEpoch(2);
    a.reset();
    for (int b = 0; b < 2; ++b) {
      const auto batch = a.next(4);
      for (size_t i : *batch) ++counts[static_cast<int64_t>(i)];
    }
    EXPECT_EQ(a.globalPosition(), 32);
    torch::serialize::OutputArchive out;
    a.save(out);
    std::ostringstream bytes;
    out.save_to(bytes);
    saved.push_back(bytes.str());
  }
  for (int r = 0; r < 3; ++r) {
    DistributedLoaderSampler b(60, 3, r, true, 3);
    torch::serialize::InputArchive in;
    std::istringstream is(saved[0]);  // (every rank saved the same global position)
    in.load_from(is);
    b.load(in);
    EXPECT_EQ(b.epoch(), 2);
    EXPECT_EQ(b.globalPosition(), 32);
    while (auto batch = b.next(5))
      for (size_t i : *batch) ++counts[static_cast<int64_t>(i)];
    EXPECT_EQ(b.globalPosition(), 60);  // (28 left: 30 handed out with the padding, capped)
  }
  int64_t once = 0;
  for (int64_t i = 0; i < 60; ++i) once += counts[i] == 1;
  EXPECT_EQ(once, 58) << "60 samples, each once but the 2 the rest's padding repeats";
}

// stderr of fn(), and how many lines of it are the forgotten-setEpoch warning.
int sameOrderWarnings(const std::function<void()>& fn, std::string* text = nullptr) {
  ::testing::internal::CaptureStderr();
  fn();
  std::string err = ::testing::internal::GetCapturedStderr();
  if (text) *text = err;
  int count = 0;
  for (size_t at = 0; (at = err.find("every epoch reads the same order", at)) != std::string::npos; ++at) ++count;
  return count;
}

TEST(LoaderSampler, WarnsOnceWhenAnEpochStartsWithoutSetEpoch) {
  auto epochs = [](DistributedLoaderSampler& s, int count, bool set_epoch) {
    for (int e = 0; e < count; ++e) {
      if (set_epoch) s.setEpoch(e);
      readEpoch(s, 30, 8);
    }
  };
  std::string text;
  DistributedLoaderSampler forgot(30, 3, 2, /*shuffle=*/true);
  EXPECT_EQ(sameOrderWarnings([&] { epochs(forgot, 4, false); }, &text), 1) << text;
  EXPECT_NE(text.find("[rank 2] warning: DistributedLoaderSampler started epoch 0 again"), std::string::npos) << text;
  EXPECT_NE(text.find("setEpoch(epoch)"), std::string::npos) << text;

  DistributedLoaderSampler good(30, 3, 2, true);
  EXPECT_EQ(sameOrderWarnings([&] { epochs(good, 4, true); }), 0);
  DistributedLoaderSampler ordered(30, 3, 2, /*shuffle=*/false);  // the order never changes anyway
  EXPECT_EQ(sameOrderWarnings([&] { epochs(ordered, 3, false); }), 0);

  // The plain sampler: indices() again without any setEpoch().
  DistributedSampler plain(30, 3, 1);
  EXPECT_EQ(sameOrderWarnings([&] { for (int e = 0; e < 3; ++e) plain.indices(); }, &text), 1) << text;
  EXPECT_NE(text.find("[rank 1] warning: DistributedSampler indices() was called again"), std::string::npos) << text;
  DistributedSampler plain_good(30, 3, 1);
  EXPECT_EQ(sameOrderWarnings([&] { for (int e = 0; e < 3; ++e) { plain_good.setEpoch(e); plain_good.indices(); } }), 0);
}

}  // namespace
}  // namespace dtrain::test
