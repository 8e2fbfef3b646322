// Checkpointer: bit-exact resume of model, optimizer (SGD momentum, Adam moments) and RNG; naming,
// keep_last pruning and the newest-file choice; stray temporary and corrupt files; rank-aware
// writing; shape mismatches; and that Python's torch.load reads the file.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "dtrain/checkpoint.h"
#include "dtrain/compat.h"
#include "dtrain/comm/error.h"
#include "dtrain/distributed.h"
#include "harness.h"
#include "torch/zip_layout.h"

namespace dtrain::test {
namespace {
namespace fs = std::filesystem;

// Parameters at two depths plus buffers (batch norm running stats and its step counter).
struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t in = 4) {
    fc = register_module("fc", torch::nn::Linear(in, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(bn(fc(x)))); }
  torch::nn::Linear fc{nullptr}, head{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor x, y;
};

std::vector<Batch> makeBatches(int n, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) out.push_back({torch::randn({16, 4}), torch::randn({16, 2})});
  return out;
}

void trainStep(Net& net, torch::optim::Optimizer& opt, const Batch& b) {
  opt.zero_grad();
  auto loss = torch::mse_loss(net->forward(b.x), b.y);
  loss.backward();
  opt.step();
}

// Every parameter and buffer, bit for bit.
void expectSameTensors(const torch::nn::Module& a, const torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& p : ba) EXPECT_TRUE(torch::equal(p.value(), bb[p.key()])) << p.key();
}

// Trains a few steps, checkpoints, trains on; then resumes a fresh model and optimizer from the file
// and takes the same steps: both must end bit-identical (optimizer state included, or momentum differs).
template <typename MakeOptimizer>
void checkResumeIsBitExact(MakeOptimizer make) {
  TempDir dir;
  auto batches = makeBatches(6, 1);
  torch::manual_seed(2);
  Net net;
  auto opt = make(net->parameters());
  for (int i = 0; i < 3; ++i) trainStep(net, *opt, batches[i]);

  Checkpointer ckpt(dir.path(), 2);
  CheckpointState s;
  s.captureModel(*net);
  s.captureOptimizer(*opt);
  s.epoch = 0;
  s.step = 3;
  s.samples = 96;
  ckpt.save(s);
  for (int i = 3; i < 6; ++i) trainStep(net, *opt, batches[i]);

  torch::manual_seed(99);  // a different initialisation, which the restore must overwrite
  Net fresh;
  auto fresh_opt = make(fresh->parameters());
  auto loaded = ckpt.loadLatest();
  ASSERT_TRUE(loaded.has_value());
  EXPECT_EQ(loaded->step, 3);
  EXPECT_EQ(loaded->samples, 96);
  loaded->restoreModel(*fresh);
  loaded->restoreOptimizer(*fresh_opt);
  for (int i = 3; i < 6; ++i) trainStep(fresh, *fresh_opt, batches[i]);
  expectSameTensors(*net, *fresh);
}

TEST(Checkpoint, ResumeSgdMomentumIsBitExact) {
  checkResumeIsBitExact([](std::vector<torch::Tensor> params) {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
  });
}

TEST(Checkpoint, ResumeAdamIsBitExact) {
  checkResumeIsBitExact([](std::vector<torch::Tensor> params) {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).amsgrad(true));
  });
}

TEST(Checkpoint, ResumeWithoutOptimizerStateDiffers) {
  // The control for the two tests above: skipping the optimizer restore must show.
  TempDir dir;
  auto batches = makeBatches(4, 1);
  torch::manual_seed(2);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int i = 0; i < 2; ++i) trainStep(net, opt, batches[i]);
  CheckpointState s;
  s.captureModel(*net);
  Net fresh;
  s.restoreModel(*fresh);
  torch::optim::SGD fresh_opt(fresh->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int i = 2; i < 4; ++i) {
    trainStep(net, opt, batches[i]);
    trainStep(fresh, fresh_opt, batches[i]);
  }
  EXPECT_FALSE(torch::equal(net->fc->weight, fresh->fc->weight));
}

TEST(Checkpoint, RngAndSmallFieldsRoundTrip) {
  TempDir dir;
  Checkpointer ckpt(dir.path());
  torch::manual_seed(7);
  torch::randn({3});  // leave a cached normal sample behind: part of the state too
  std::mt19937 user(12345);
  user();
  CheckpointState s;
  s.captureRng();
  std::ostringstream os;
  os << user;
  s.user_rng = os.str();
  s.scheduler = {{"lr", 0.05}, {"last_epoch", 4}};
  s.metrics = {{"loss", 0.25}, {"accuracy", 0.875}};
  s.epoch = 4;
  s.step = 1234;
  ckpt.save(s);
  const auto want_rand = torch::rand({16}), want_randn = torch::randn({5});
  const auto want_user = user();

  torch::manual_seed(1);  // move the generator elsewhere
  auto loaded = ckpt.loadLatest();
  ASSERT_TRUE(loaded);
  loaded->restoreRng();
  EXPECT_TRUE(torch::equal(torch::rand({16}), want_rand));
  EXPECT_TRUE(torch::equal(torch::randn({5}), want_randn));
  std::mt19937 user2;
  std::istringstream(loaded->user_rng) >> user2;
  EXPECT_EQ(user2(), want_user);
  EXPECT_EQ(loaded->scheduler, s.scheduler);
  EXPECT_EQ(loaded->metrics, s.metrics);
  EXPECT_EQ(loaded->epoch, 4);
  EXPECT_EQ(loaded->step, 1234);
  EXPECT_TRUE(loaded->model.empty());
  EXPECT_TRUE(loaded->optimizer.empty());
  EXPECT_THROW(loaded->restoreOptimizer(*std::make_unique<torch::optim::SGD>(
                   std::vector<torch::Tensor>{torch::zeros({1}, torch::requires_grad())}, 0.1)),
               InvalidArgument);
}

CheckpointState stateAt(int64_t epoch, int64_t step) {
  CheckpointState s;
  s.epoch = epoch;
  s.step = step;
  s.model["w"] = torch::full({2}, static_cast<double>(epoch * 1000 + step));
  return s;
}

std::vector<std::string> names(const std::vector<CheckpointFile>& files) {
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(fs::path(f.path).filename().string());
  return out;
}

TEST(Checkpoint, FileNamesSortAndParse) {
  EXPECT_EQ(Checkpointer::fileName(3, 1200), "ckpt-000003-000001200.pt");
  TempDir dir;
  Checkpointer ckpt(dir.path(), 0);
  for (auto [e, s] : std::vector<std::pair<int64_t, int64_t>>{{1, 500}, {2, 10}, {1, 900}}) ckpt.save(stateAt(e, s));
  EXPECT_EQ(names(ckpt.list()), (std::vector<std::string>{"ckpt-000001-000000500.pt", "ckpt-000001-000000900.pt",
                                                          "ckpt-000002-000000010.pt"}));
  EXPECT_EQ(ckpt.loadLatest()->step, 10);
  // Past the padding width the names no longer sort as strings; the parsed numbers still do.
  ckpt.save(stateAt(999999, 5));
  ckpt.save(stateAt(1000000, 0));
  auto latest = ckpt.loadLatest();
  EXPECT_EQ(latest->epoch, 1000000);
  // Names that are not checkpoints are ignored, whatever they hold.
  for (const char* junk : {"ckpt-abc.pt", "ckpt-1-2.pt.bak", "ckpt--5.pt", "notes.txt", "ckpt-9999999-x.pt"})
    std::ofstream(dir.path() + "/" + junk) << "junk";
  EXPECT_EQ(ckpt.list().size(), 5u);
  EXPECT_EQ(ckpt.loadLatest()->epoch, 1000000);
}

TEST(Checkpoint, KeepLastPrunesOldest) {
  TempDir dir;
  Checkpointer ckpt(dir.path(), 2);
  std::string last;
  for (int64_t step = 1; step <= 5; ++step) last = ckpt.save(stateAt(0, step * 100));
  EXPECT_EQ(names(ckpt.list()), (std::vector<std::string>{"ckpt-000000-000000400.pt", "ckpt-000000-000000500.pt"}));
  EXPECT_EQ(last, (fs::path(dir.path()) / "ckpt-000000-000000500.pt").string());
  EXPECT_TRUE(torch::equal(ckpt.loadLatest()->model.at("w"), torch::full({2}, 500.0)));
  // Saving the same (epoch, step) again replaces it rather than adding a file.
  ckpt.save(stateAt(0, 500));
  EXPECT_EQ(ckpt.list().size(), 2u);
}

TEST(Checkpoint, EmptyOrMissingDirectoryHasNoCheckpoint) {
  TempDir dir;
  EXPECT_FALSE(Checkpointer(dir.path()).loadLatest().has_value());
  EXPECT_FALSE(Checkpointer(dir.path() + "/not/yet").loadLatest().has_value());
  // save creates the directory.
  Checkpointer nested(dir.path() + "/a/b");
  nested.save(stateAt(1, 1));
  EXPECT_EQ(nested.loadLatest()->epoch, 1);
}

TEST(Checkpoint, StrayTemporaryFileIsIgnoredAndCleanedUp) {
  TempDir dir;
  Checkpointer ckpt(dir.path(), 3);
  // What a writer killed mid-save leaves behind: a partial .tmp- file with a newer name.
  const std::string stray = dir.path() + "/.tmp-" + Checkpointer::fileName(9, 0);
  std::ofstream(stray) << "PK\x03\x04 half a zip";
  EXPECT_FALSE(ckpt.loadLatest().has_value());
  ckpt.save(stateAt(1, 1));
  EXPECT_EQ(ckpt.loadLatest()->epoch, 1);
  EXPECT_FALSE(fs::exists(stray)) << "save should remove a crashed writer's leftovers";
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_EQ(e.path().filename().string().rfind(".tmp-", 0), std::string::npos) << e.path();
}

TEST(Checkpoint, CorruptOrTruncatedFileIsANamedError) {
  TempDir dir;
  Checkpointer ckpt(dir.path(), 0);
  const std::string good = ckpt.save(stateAt(1, 1));
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string newest = dir.path() + "/" + Checkpointer::fileName(2, 0);
  struct Damage {
    const char* what;
    std::string content;
  };
  // Damage to a real checkpoint is "corrupt or truncated"; a file that never was one says what it is.
  for (const auto& d : {Damage{"truncated", bytes.substr(0, bytes.size() / 2)},
                        Damage{"tail cut", bytes.substr(0, bytes.size() - 10)},
                        // (the soak's: cut before the pickle's name; it was called "a zip archive without a torch
                        // pickle", as if it had never been a checkpoint)
                        Damage{"cut before its pickle", bytes.substr(0, 30)}}) {
    SCOPED_TRACE(d.what);
    std::ofstream(newest, std::ios::binary | std::ios::trunc) << d.content;
    const std::string msg = errorOf([&] { ckpt.loadLatest(); });
    EXPECT_NE(msg.find("checkpoint " + newest + " is corrupt or truncated"), std::string::npos) << msg;
  }
  std::ofstream(newest, std::ios::binary | std::ios::trunc) << "";
  std::string msg = errorOf([&] { ckpt.loadLatest(); });
  EXPECT_NE(msg.find("checkpoint " + newest + " is empty"), std::string::npos) << msg;
  std::ofstream(newest, std::ios::binary | std::ios::trunc) << std::string(4096, 'x');
  msg = errorOf([&] { ckpt.loadLatest(); });
  EXPECT_NE(msg.find(newest + " is not a dtrain checkpoint: not a zip archive as torch.save writes (it starts "
                              "with 'xxxxxxxx')"),
            std::string::npos)
      << msg;
  std::ofstream(newest, std::ios::binary | std::ios::trunc) << std::string("\x01\x02\xff", 3);
  msg = errorOf([&] { ckpt.loadLatest(); });
  EXPECT_NE(msg.find("not a zip archive as torch.save writes (it starts with bytes 01 02 ff)"), std::string::npos)
      << msg;
  // The good file is still readable by name: the caller can fall back explicitly.
  EXPECT_EQ(Checkpointer::load(good).epoch, 1);
  // A valid pickle that is not a dtrain checkpoint is named too.
  {
    auto data = torch::pickle_save(c10::IValue(int64_t{5}));
    std::ofstream(newest, std::ios::binary | std::ios::trunc).write(data.data(), static_cast<std::streamsize>(data.size()));
  }
  msg = errorOf([&] { ckpt.loadLatest(); });
  EXPECT_NE(msg.find(newest + " is not a dtrain checkpoint: a torch file whose root is a Int, not a dict"),
            std::string::npos)
      << msg;
}

// A bit flipped inside a tensor's bytes: torch's archive reader does not check its records' CRCs, so the
// file loaded (the soak found a flipped checkpoint resuming silently). dtrain checks every zip entry's
// CRC-32 before libtorch reads the file, and the content checksum written with it stands behind that: an
// error naming the file. Every byte of the model's largest tensor is tried in turn.
TEST(Checkpoint, AFlippedBitIsANamedErrorNotADifferentModel) {
  TempDir dir;
  Checkpointer ckpt(dir.path(), 0);
  const CheckpointState st = stateAt(1, 1);
  const std::string path = ckpt.save(st);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The largest tensor's bytes are found in the file by content (torch stores them as they are).
  const at::Tensor* big = nullptr;
  for (const auto& [name, t] : st.model)
    if (!big || t.numel() > big->numel()) big = &t;
  const at::Tensor c = big->contiguous();
  const std::string needle(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.numel() * c.element_size()));
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos);
  int detected = 0, tried = 0;
  for (size_t i = at; i < at + needle.size(); i += std::max<size_t>(1, needle.size() / 64), ++tried) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    std::ofstream(path, std::ios::binary | std::ios::trunc) << flipped;
    const std::string msg = errorOf([&] { Checkpointer::load(path); });
    // The zip entries' CRC-32 finds it first (checked before libtorch reads the file); the content digest
    // stands behind it (a flip that keeps the CRC, or a file without CRCs).
    if (msg.find("checkpoint " + path + " is corrupt or truncated: its zip entry") != std::string::npos &&
        msg.find("fails its CRC-32 check") != std::string::npos)
      ++detected;
    else
      ADD_FAILURE() << "byte " << i << ": " << (msg.empty() ? "loaded without an error" : msg);
  }
  EXPECT_EQ(detected, tried);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_EQ(Checkpointer::load(path).epoch, 1);  // the intact file still loads
}

// Lengths the bytes claim are checked before libtorch reads them (src/torch/zip_layout.h): the fuzzer's
// input (tests/fuzz/regressions/checkpoint_fuzz) made libtorch 1.13's unpickler reserve 1.6 GB for a string
// of a 7.5 KB file; a zip entry claiming more bytes than the file has is named too.
TEST(Checkpoint, ClaimedLengthsPastTheFileAreNamedBeforeLibtorchReadsThem) {
  const std::string found = std::string(DTRAIN_SOURCE_DIR) +
                            "/tests/fuzz/regressions/checkpoint_fuzz/huge-pickle-string.pt";
  std::string msg = errorOf([&] { Checkpointer::load(found); });
  EXPECT_NE(msg.find("is corrupt or truncated: its pickle claims 1660944393 bytes for opcode 0x58 at offset 421"), std::string::npos) << msg;

  TempDir dir;
  const std::string path = Checkpointer(dir.path(), 0).save(stateAt(1, 1));
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::vector<detail::ZipEntry> entries;
  ASSERT_EQ(detail::zipLayoutProblem(bytes.data(), bytes.size(), &entries), "");
  ASSERT_FALSE(entries.empty());
  // The first entry's size in its central directory header ("PK\1\2", +20 compressed, +24 uncompressed).
  const size_t central = bytes.find(std::string("PK\x01\x02", 4));
  ASSERT_NE(central, std::string::npos);
  std::string claimed = bytes;
  for (size_t k : {20, 24}) std::memcpy(&claimed[central + k], "\xff\xff\xff\x7f", 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << claimed;
  msg = errorOf([&] { Checkpointer::load(path); });
  EXPECT_NE(msg.find("claims 2147483647 bytes at offset"), std::string::npos) << msg;
  // An entry flagged as patched data (general-purpose bit 5, central header +8): libtorch's reader refuses
  // it in its constructor, where 1.13 leaked the reader (the fuzzer's state dict, regressions/ below).
  std::string patched = bytes;
  patched[central + 8] = static_cast<char>(patched[central + 8] | 0x20);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << patched;
  msg = errorOf([&] { Checkpointer::load(path); });
  EXPECT_NE(msg.find("uses zip features PyTorch does not write (flags 0x0828"), std::string::npos) << msg;
  msg = errorOf([&] {
    readStateDict(std::string(DTRAIN_SOURCE_DIR) + "/tests/fuzz/regressions/checkpoint_fuzz/leak-zip-patched-entry.pt");
  });
  EXPECT_NE(msg.find("its zip entry 'sd_seed/data/2' uses zip features PyTorch does not write (flags 0x082d"),
            std::string::npos) << msg;
  // A tensor that viewed bytes past its buffer: libtorch sized its storage from the pickle's claim, not
  // from the record it read (the digest then read past the buffer).
  msg = errorOf([&] {
    Checkpointer::load(std::string(DTRAIN_SOURCE_DIR) + "/tests/fuzz/regressions/checkpoint_fuzz/tensor-past-its-storage.pt");
  });
  EXPECT_NE(msg.find("is corrupt or truncated: its pickle holds a storage of"), std::string::npos) << msg;
  // Pickles: a string longer than what is left, a line argument without its newline, a fine one.
  EXPECT_NE(detail::pickleLengthProblem("\x80\x02X\x10\x00\x00\x00" "abc", 11).find("claims 16 bytes"), std::string::npos);
  EXPECT_NE(detail::pickleLengthProblem("\x80\x02" "ctorch\n", 9).find("no end of line"), std::string::npos);
  EXPECT_EQ(detail::pickleLengthProblem("\x80\x02X\x03\x00\x00\x00" "abc.", 12), "");
  // Memo indexes follow each other (libtorch reserved 30 GB for a LONG_BINPUT of index 950 million).
  EXPECT_EQ(detail::pickleLengthProblem("\x80\x02" "]q\x00" "]q\x01" ".", 9), "");
  EXPECT_NE(detail::pickleLengthProblem("\x80\x02" "]r\x00\x00\x00\x40" ".", 9).find("memoizes at index 1073741824 after 0"),
            std::string::npos);
}

// What users point a Checkpointer at by mistake: a PyTorch state_dict, some other zip file.
TEST(Checkpoint, ForeignFilesSayWhatTheyAre) {
  TempDir dir;
  const std::string sd = dir.path() + "/" + Checkpointer::fileName(1, 0);
  const std::string zip = dir.path() + "/other.zip";
  runPython("import torch, zipfile\n"
            "torch.save({'fc.weight': torch.zeros(2), 'fc.bias': torch.zeros(1)}, '" + sd + "')\n"
            "with zipfile.ZipFile('" + zip + "', 'w') as z: z.writestr('notes.txt', 'hello')\n");
  std::string msg = errorOf([&] { Checkpointer(dir.path()).loadLatest(); });
  EXPECT_NE(msg.find(sd + " is not a dtrain checkpoint: a torch file holding a dict without dtrain's 'format' key "
                          "(its keys: 'fc.weight', 'fc.bias')"),
            std::string::npos)
      << msg;
  msg = errorOf([&] { Checkpointer::load(zip); });
  EXPECT_NE(msg.find(zip + " is not a dtrain checkpoint: a zip archive without a torch pickle"), std::string::npos)
      << msg;
  msg = errorOf([&] { Checkpointer::load(dir.path() + "/absent.pt"); });
  EXPECT_NE(msg.find("cannot open " + dir.path() + "/absent.pt"), std::string::npos) << msg;
}

// A directory argument that is a file (or lies under one) is an error when the Checkpointer is built,
// not an epoch later at the first save; loadLatest would otherwise have started from scratch silently.
TEST(Checkpoint, DirectoryThatIsAFileFailsAtConstruction) {
  TempDir dir;
  const std::string file = dir.path() + "/ckpt";
  std::ofstream(file) << "not a directory";
  for (bool writer : {true, false}) {
    try {
      Checkpointer c(file, 3, writer);
      ADD_FAILURE() << "constructed over a file";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("Checkpointer: " + file + " exists and is not a directory"),
                std::string::npos)
          << e.what();
    }
  }
  try {
    Checkpointer c(file + "/run1/sub", 3);
    ADD_FAILURE() << "constructed under a file";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create the directory " + file + "/run1/sub: " + file +
                                         " is not a directory"),
              std::string::npos)
        << e.what();
  }
  // Missing directories are fine: the first save creates them.
  EXPECT_NO_THROW(Checkpointer(dir.path() + "/new/run", 3));
}

TEST(Checkpoint, ShapeMismatchNamesTheParameter) {
  torch::manual_seed(0);
  Net small(4), big(5);
  CheckpointState s;
  s.captureModel(*small);
  const auto before = big->fc->weight.clone();
  try {
    s.restoreModel(*big);
    FAIL() << "no InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'fc.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[8, 4]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[8, 5]"), std::string::npos) << msg;
  }
  EXPECT_TRUE(torch::equal(big->fc->weight, before)) << "a failed restore must leave the module untouched";

  // Names on one side only: strict restore names them; non-strict restores the rest.
  s.model.erase("head.bias");
  s.model["extra.weight"] = torch::zeros({1});
  Net other(4);
  try {
    s.restoreModel(*other);
    FAIL() << "no InvalidArgument";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("head.bias"), std::string::npos) << msg;
    EXPECT_NE(msg.find("extra.weight"), std::string::npos) << msg;
  }
  s.restoreModel(*other, /*strict=*/false);
  EXPECT_TRUE(torch::equal(other->fc->weight, small->fc->weight));
}

TEST(Checkpoint, OptimizerOfAnotherKindIsAnError) {
  Net net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  auto batches = makeBatches(1, 3);
  trainStep(net, adam, batches[0]);
  CheckpointState s;
  s.captureOptimizer(adam);
  Net other;
  torch::optim::SGD sgd(std::vector<torch::Tensor>{other->fc->weight}, torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_THROW(s.restoreOptimizer(sgd), Error);
}

TEST(Checkpoint, OnlyTheWriterWrites) {
  TempDir dir;
  Checkpointer reader(dir.path(), 3, /*writer=*/false);
  EXPECT_EQ(reader.save(stateAt(1, 1)), "");
  EXPECT_TRUE(fs::is_empty(dir.path()));
  Checkpointer(dir.path()).save(stateAt(2, 2));
  EXPECT_EQ(reader.loadLatest()->epoch, 2);
}

TEST(Checkpoint, RanksWriteOnceAndAllRead) {
  constexpr int kWorld = 3;
  StoreServer server;
  TempDir dir;
  auto results = runRanks(kWorld, [&](int rank) {
    comm::GroupOptions opts;
    opts.timeout = std::chrono::seconds(30);
    auto pg = comm::ProcessGroup::create(server.client(), rank, kWorld, opts);
    comm::WorldInfo info;
    info.rank = rank;
    info.size = info.local_size = kWorld;
    info.local_rank = rank;
    Distributed dist(pg, pg, info);
    Checkpointer ckpt(dir.path(), dist, 2);
    EXPECT_EQ(ckpt.writes(), rank == 0);
    for (int64_t step = 1; step <= 3; ++step) {
      // Every rank calls save with its own numbers; only rank 0's may land.
      auto s = stateAt(0, step);
      s.metrics["rank"] = rank;
      const std::string path = ckpt.save(s);
      EXPECT_EQ(path.empty(), rank != 0);
      pg->barrier()->wait();
      auto latest = ckpt.loadLatest();
      ASSERT_TRUE(latest);
      EXPECT_EQ(latest->step, step);
      EXPECT_EQ(latest->metrics.at("rank"), 0.0);
      pg->barrier()->wait();  // nobody prunes a file another rank is still reading
    }
  });
  expectAllOk(results);
  EXPECT_EQ(names(Checkpointer(dir.path()).list()),
            (std::vector<std::string>{"ckpt-000000-000000002.pt", "ckpt-000000-000000003.pt"}));
}


TEST(Checkpoint, PythonTorchLoadReadsIt) {
  TempDir dir;
  torch::manual_seed(0);
  Net net;
  {
    torch::NoGradGuard g;
    net->fc->weight.copy_(torch::arange(32, torch::kFloat).reshape({8, 4}) / 4);  // exact in decimal
  }
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  trainStep(net, opt, makeBatches(1, 5)[0]);
  {
    torch::NoGradGuard g;
    net->fc->weight.copy_(torch::arange(32, torch::kFloat).reshape({8, 4}) / 4);
  }
  CheckpointState s;
  s.captureModel(*net);
  s.captureOptimizer(opt);
  s.captureRng();
  s.scheduler["lr"] = 0.1;
  s.metrics["loss"] = 1.5;
  s.epoch = 3;
  s.step = 77;
  s.user_rng = "mt state";
  const std::string path = Checkpointer(dir.path()).save(s);
  const auto rand_after_restore = torch::rand({4});  // what Python should draw after set_rng_state

  const std::string out = runPython(
      std::string(kPythonDtrainLoad) +
      "d = dtrain_load('" + path + "')\n"
      "print(sorted(d.keys()))\n"
      "print(d['format'], d['epoch'], d['step'], d['user_rng'])\n"
      "print(sorted(d['model'].keys()))\n"
      "print(tuple(d['model']['fc.weight'].shape), d['model']['fc.weight'].flatten().tolist()[:6])\n"
      "print(d['scheduler'], d['metrics'])\n"
      "print(d['optimizer'].dtype, d['optimizer'].numel() > 0, d['rng'].dtype)\n"
      "torch.set_rng_state(d['rng'])\n"
      "print(' '.join(repr(v) for v in torch.rand(4).tolist()))\n"
      // weights_only=True: the default from PyTorch 2.6. 1.13's weights-only unpickler (opt-in) has no
      // BINFLOAT, so it refuses any pickled float, Python's own torch.save of one included.
      "if int(torch.__version__.split('.')[0]) < 2:\n"
      "    print('weights only: not on', torch.__version__[:4])\n"
      "else:\n"
      "    w = torch.load('" + path + "', weights_only=True)\n"
      "    print('weights only:', sorted(w.keys()) == sorted(d.keys()), torch.equal(w['model']['fc.weight'], "
      "d['model']['fc.weight']))\n");
  std::istringstream lines(out);
  std::string line;
  auto next = [&] {
    std::getline(lines, line);
    return line;
  };
  EXPECT_EQ(next(), "['checksum', 'epoch', 'format', 'metrics', 'model', 'optimizer', 'parameter_server', 'rng', 'samples', 'scheduler', 'step', 'user_rng']");
  EXPECT_EQ(next(), "dtrain-checkpoint-v1 3 77 mt state");
  EXPECT_EQ(next(), "['bn.bias', 'bn.num_batches_tracked', 'bn.running_mean', 'bn.running_var', 'bn.weight', "
                    "'fc.bias', 'fc.weight', 'head.bias', 'head.weight']");
  EXPECT_EQ(next(), "(8, 4) [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]");
  EXPECT_EQ(next(), "{'lr': 0.1} {'loss': 1.5}");
  EXPECT_EQ(next(), "torch.uint8 True torch.uint8");
  // The RNG state means the same thing in both: Python draws what C++ drew after the capture.
  std::istringstream nums(next());
  for (int i = 0; i < 4; ++i) {
    double v = -1;
    nums >> v;
    EXPECT_EQ(v, static_cast<double>(rand_after_restore[i].item<float>())) << "draw " << i << "\n" << out;
  }
  // The parity Python's PyTorch is the libtorch this build uses: the wheel's 2.x, or Debian's 1.13.
  EXPECT_EQ(next(), std::string(compat::kTorchVersion).rfind("1.", 0) == 0 ? "weights only: not on 1.13"
                                                                          : "weights only: True True");
  // Nothing for a weights-only load to allow-list: the pickle names no torch.jit._pickle builder (the
  // optimizer's entry, a tensor of torch::save's bytes, is data to torch.load and may name anything).
  std::ifstream f(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<detail::ZipEntry> entries;
  ASSERT_EQ(detail::zipLayoutProblem(bytes.data(), bytes.size(), &entries), "");
  std::string pickle;
  for (const auto& e : entries)
    if (e.name.size() >= 9 && e.name.compare(e.name.size() - 9, 9, "/data.pkl") == 0)
      pickle = bytes.substr(e.offset, e.size);
  ASSERT_FALSE(pickle.empty());
  EXPECT_EQ(pickle.find("torch.jit"), std::string::npos);
  EXPECT_NE(pickle.find("_rebuild_tensor_v2"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::test
