// Writes the seed corpora of the torch layer's fuzzing harnesses (tests/fuzz/corpus/<harness>/), made
// with dtrain's own writers: Checkpointer::save (single file and per rank), milnce::generateData, and the parameter
// server's request headers as ps::Worker sends them.
// Usage (a DTRAIN_FUZZ_TORCH build): torch_fuzz_seeds tests/fuzz/corpus
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "milnce/data.h"
#include "milnce/data_util.h"
#include "torch/ps/protocol.h"
#include "torch_fuzz_util.h"

namespace fs = std::filesystem;
namespace fuzz = dtrain::fuzz;
namespace ps = dtrain::ps;

namespace {
std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}
void put(const fs::path& dir, const std::string& name, const std::string& bytes) { fuzz::writeFile(dir / name, bytes); }

void checkpointSeeds(const fs::path& out) {
  dtrain::CheckpointState s;
  s.model = {{"fc.weight", torch::randn({3, 2})}, {"fc.bias", torch::zeros({3})}};
  s.optimizer = "optimizer bytes";
  s.scheduler = {{"lr", 0.1}};
  s.epoch = 1;
  s.step = 7;
  s.samples = 64;
  s.captureRng();
  s.user_rng = "12345";
  s.metrics = {{"loss", 0.5}};
  const fs::path tmp = fs::temp_directory_path() / "dtrain-fuzz-seeds";
  fs::remove_all(tmp);
  const std::string file = dtrain::Checkpointer((tmp / "single").string()).save(s);
  put(out, "file", std::string(1, '\0') + slurp(file));
  s.parameter_server = {{"ps/w", torch::ones({4})}};
  s.sharded = {{"zero/0", torch::ones({2})}};
  put(out, "file_ps_sharded", std::string(1, '\0') + slurp(dtrain::Checkpointer((tmp / "ps").string()).save(s)));

  dtrain::comm::TcpStoreServer server("127.0.0.1", 0);
  auto store = std::make_shared<dtrain::comm::TcpStore>("127.0.0.1", server.port(), std::chrono::seconds(5));
  auto pg = dtrain::comm::ProcessGroup::create(store, 0, 1);
  dtrain::Checkpointer((tmp / "per_rank").string(), pg).save(s);
  const fs::path cdir = tmp / "per_rank" / dtrain::Checkpointer::dirName(s.epoch, s.step);
  put(out, "per_rank", std::string(1, '\1') + fuzz::joinParts({slurp(fs::path(cdir) / dtrain::Checkpointer::kManifestName),
                                                                slurp(fs::path(cdir) / dtrain::Checkpointer::rankFileName(0, 1))}));
  fs::remove_all(tmp);
}

void milnceSeeds(const fs::path& out) {
  milnce::GenOptions g;
  g.out = (fs::temp_directory_path() / "dtrain-fuzz-milnce").string();
  g.videos = 2;
  g.eval_videos = 1;
  g.concepts = 2;
  g.feature_dim = 3;
  g.word_dim = 2;
  g.words_per_concept = 2;
  g.filler_words = 3;
  g.min_segments = g.max_segments = 2;
  g.min_seg_sec = g.max_seg_sec = 2;
  fs::remove_all(g.out);
  milnce::generateData(g);
  std::vector<std::string> parts;
  for (const auto& e : fs::recursive_directory_iterator(g.out)) {
    if (!e.is_regular_file()) continue;
    parts.push_back(fs::relative(e.path(), g.out).string());
    parts.push_back(slurp(e.path()));
  }
  put(out, "dataset", std::string(1, '\2') + fuzz::joinParts(parts));
  put(out, "csv", std::string(1, '\0') + slurp(fs::path(g.out) / "eval.csv"));
  put(out, "csv_quoted", std::string(1, '\0') + "a,b\n\"x,\"\"y\"\"\",2\r\n\"multi\nline\",3\n");
  put(out, "npy", std::string(1, '\1') + slurp(fs::path(g.out) / "word2vec.npy"));
  fs::remove_all(g.out);
}

// A request: its header, then chunks (dtype code 0 u8, 1 f32, 2 i64; count; zero elements: the harness pads).
struct Request {
  ps::Header h;
  std::vector<std::pair<uint8_t, uint16_t>> chunks;
};
std::string encode(uint8_t mode, const std::vector<Request>& rs) {
  std::string s(1, static_cast<char>(mode));
  for (const auto& r : rs) {
    s.append(reinterpret_cast<const char*>(&r.h), sizeof r.h);
    if (r.chunks.empty()) s += '\x80', s += std::string(2, '\0');
    for (size_t i = 0; i < r.chunks.size(); ++i) {
      const auto [type, count] = r.chunks[i];
      s += static_cast<char>(type | (i + 1 < r.chunks.size() ? 0x40 : 0));
      s += static_cast<char>(count & 0xff);
      s += static_cast<char>(count >> 8);
      const size_t size = type == 0 ? 1 : type == 1 ? 4 : 8;
      std::string elems(count * size, '\0');
      if (type == 1)  // floats of value 0.5
        for (size_t k = 0; k < count; ++k) std::memcpy(&elems[k * 4], "\0\0\0\x3f", 4);
      if (type == 2)  // ids 0, 1, 2, ...
        for (size_t k = 0; k < count; ++k) elems[k * 8] = static_cast<char>(k);
      s += elems;
    }
  }
  return s;
}

void psSeeds(const fs::path& out) {
  using ps::makeHeader;
  const std::vector<Request> dense = {
      {makeHeader(ps::kDeclare, 0, 0, 8, 0, ps::kFlagInit), {{1, 8}}},
      {makeHeader(ps::kPush, 0, 0, 8), {{1, 8}}},
      {makeHeader(ps::kPush, 0, 1, 8, 0, ps::kFlagUsed), {{1, 8}, {0, 8}}},  // a push that leaves elements out
      {makeHeader(ps::kPull, 0, 1, 8), {}},
      {makeHeader(ps::kPushPull, 0, 1, 8), {{1, 8}}},
      {makeHeader(ps::kClock, 0, 1, 0), {}},
      {makeHeader(ps::kGetState, 0, 1, 0), {}},
      {makeHeader(ps::kBye, 0, 0, 0), {}},
  };
  const std::vector<Request> rows = {
      {makeHeader(ps::kDeclareRows, 1, 0, 16, 4, ps::kFlagInit), {{1, 64}}},
      {makeHeader(ps::kPushRows, 1, 0, 2, 4), {{2, 2}, {1, 8}}},
      {makeHeader(ps::kPullRows, 1, 1, 2, 4), {{2, 2}}},
      {makeHeader(ps::kGetState, 1, 1, 0, 0, ps::kFlagRows), {}},
      {makeHeader(ps::kBye, 0, 0, 0), {}},
  };
  for (uint8_t mode = 0; mode < 3; ++mode) {
    put(out, "dense" + std::to_string(mode), encode(mode, dense));
    put(out, "rows" + std::to_string(mode), encode(mode, rows));
  }
}
// video_fuzz: two short mp4s as gen-video writes them (24x24 at 10 fps, 1.5 s and 0.4 s), each behind a
// different clip byte.
void videoSeeds(const fs::path& dir) {
  fs::create_directories(dir);
  int n = 0;
  for (double seconds : {1.5, 0.4}) {
    const auto tmp = fs::temp_directory_path() / fmt::format("torch_fuzz_seeds_{}.mp4", n);
    std::mt19937_64 rng(static_cast<uint64_t>(n));
    milnce::detail::renderVideo(tmp.string(), {0.0, seconds / 2, seconds}, {n, n + 1}, 24, 10, rng);
    std::ifstream in(tmp, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), {});
    fs::remove(tmp);
    put(dir, fmt::format("video{}", n), std::string(1, static_cast<char>(n == 0 ? 0 : 0x3d)) + bytes);
    ++n;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: torch_fuzz_seeds DIR\n");
    return 2;
  }
  const fs::path dir = argv[1];
  checkpointSeeds(dir / "checkpoint_fuzz");
  milnceSeeds(dir / "milnce_data_fuzz");
  psSeeds(dir / "ps_server_fuzz");
  videoSeeds(dir / "video_fuzz");
  std::printf("torch_fuzz_seeds: wrote the corpora of checkpoint_fuzz, milnce_data_fuzz, ps_server_fuzz, video_fuzz in %s\n",
              argv[1]);
  return 0;
}
