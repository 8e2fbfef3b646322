// libFuzzer harness: dtrain's checkpoint decoders (src/torch/checkpoint_io.cc, checkpoint_manifest.cc).
// Byte 0 picks what the rest is:
//   even  a checkpoint file as Checkpointer::load reads it: the zip checks, torch's unpickler, the content
//         digest, then the state's keys and types (the per-rank files and the peer snapshots' parts, which
//         are the same pickled dict, go through the same code);
//   2     a PyTorch state_dict as dtrain::readStateDict reads it (Python's torch.save of an OrderedDict:
//         the pickle rewritten to plain dicts, pickle_load.cc's plainDicts, then libtorch's unpickler);
//   other even values: as 0;
//   odd   a per-rank checkpoint directory, parts manifest | rank file (torch_fuzz_util.h's separator),
//         as Checkpointer::loadLatest reads it on a group of one: the manifest's keys, its file
//         list and sizes, then the rank file.
// Every outcome must be a state, nothing, or a dtrain::Error; anything else (another exception, a crash, a
// sanitizer report) is a finding.
#include <cstdio>
#include <memory>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "../fuzz_util.h"
#include "torch_fuzz_util.h"

namespace fuzz = dtrain::fuzz;

namespace {
// A group of one on a store of its own (loadLatest: its broadcast and allgather are local).
std::shared_ptr<dtrain::comm::ProcessGroup> groupOfOne() {
  static auto pg = [] {
    static dtrain::comm::TcpStoreServer server("127.0.0.1", 0);
    auto store = std::make_shared<dtrain::comm::TcpStore>("127.0.0.1", server.port(), std::chrono::seconds(5));
    return dtrain::comm::ProcessGroup::create(store, 0, 1);
  }();
  return pg;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool directory = data[0] & 1;
  try {
    if (data[0] == 2) {
      const auto dir = fuzz::scratchDir();
      fuzz::writeFile(dir / "state_dict.pt", std::string(reinterpret_cast<const char*>(data + 1), size - 1));
      dtrain::readStateDict((dir / "state_dict.pt").string());
    } else if (!directory) {
      const auto dir = fuzz::scratchDir();
      fuzz::writeFile(dir / "ckpt-0-1.pt", std::string(reinterpret_cast<const char*>(data + 1), size - 1));
      dtrain::Checkpointer::load((dir / "ckpt-0-1.pt").string());
    } else {
      auto pg = groupOfOne();
      const auto parts = fuzz::splitParts(data + 1, size - 1);
      const auto dir = fuzz::scratchDir();
      const auto cdir = dir / dtrain::Checkpointer::dirName(0, 1);
      fuzz::writeFile(cdir / dtrain::Checkpointer::kManifestName, parts[0]);
      if (parts.size() > 1) fuzz::writeFile(cdir / dtrain::Checkpointer::rankFileName(0, 1), parts[1]);
      dtrain::Checkpointer(dir.string(), pg).loadLatest();
    }
  } catch (const dtrain::Error&) {
  } catch (const std::exception& e) {
    fuzz::die(std::string("not a dtrain::Error: ") + e.what());
  }
  return 0;
}
