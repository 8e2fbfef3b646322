// libFuzzer harness: the MIL-NCE data readers (apps/milnce: csv.cc, npy.cc, dataset.cc). Byte 0 picks
// what the rest is:
//   0  one CSV file (readCsv: quoting, line numbers, field counts);
//   1  one .npy file (readNpy: magic, version, header dict, shape, dtype, data size, Fortran order);
//   2+ a dataset directory as Dataset::load reads it: parts (torch_fuzz_util.h's separator) alternate a
//      file name and its bytes (meta.json, vocab.txt, word2vec.npy, videos.csv, eval_videos.csv,
//      eval.csv, features/<id>.npy, captions/<id>.csv, ...); names outside the directory are skipped.
// Every outcome must be a value or a dtrain::Error naming the file; anything else is a finding.
#include <string>

#include "dtrain/comm/error.h"
#include "milnce/data.h"
#include "../fuzz_util.h"
#include "torch_fuzz_util.h"

namespace fuzz = dtrain::fuzz;

namespace {
// A name that stays inside the directory: relative, no "..", not empty, at most one level down.
bool safeName(const std::string& name) {
  if (name.empty() || name.size() > 64 || name[0] == '/' || name.find("..") != std::string::npos) return false;
  if (name.find('\0') != std::string::npos || name.find('\n') != std::string::npos) return false;
  const size_t slash = name.find('/');
  return slash == std::string::npos || (slash > 0 && name.find('/', slash + 1) == std::string::npos && slash + 1 < name.size());
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto dir = fuzz::scratchDir();
  try {
    switch (data[0]) {
      case 0:
        fuzz::writeFile(dir / "file.csv", rest);
        milnce::readCsv((dir / "file.csv").string());
        break;
      case 1:
        fuzz::writeFile(dir / "file.npy", rest);
        milnce::readNpy((dir / "file.npy").string());
        break;
      default: {
        const auto parts = fuzz::splitParts(data + 1, size - 1);
        for (size_t i = 0; i + 1 < parts.size(); i += 2)
          if (safeName(parts[i])) fuzz::writeFile(dir / parts[i], parts[i + 1]);
        milnce::Dataset::load(dir.string());
      }
    }
  } catch (const dtrain::Error&) {
  } catch (const std::exception& e) {
    fuzz::die(std::string("not a dtrain::Error: ") + e.what());
  }
  return 0;
}
