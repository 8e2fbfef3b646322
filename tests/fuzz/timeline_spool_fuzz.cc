// libFuzzer harness: the timeline spool reader (src/comm/trace/timeline_spool.cc), which dtrain-trace
// merge runs over the spool a rank that died left behind: the header, then records of threads, names,
// op shapes and events with their string references. The input is the spool file's bytes, read the way
// spoolFileToJson reads a file: in pieces, a record cut by a piece's end carried to the next. It must
// format what it can or throw a dtrain::Error, never crash.
#include <string>

#include "comm/trace/timeline_spool.h"
#include "dtrain/comm/error.h"

using namespace dtrain::comm;  // NOLINT(google-build-using-namespace)
namespace comm = dtrain::comm;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* p = reinterpret_cast<const char*>(data);
  try {
    comm::trace::timeline::SpoolReader reader;
    size_t at = reader.header(p, size);
    std::string out, carry;
    // Pieces of 7 bytes and then the rest, so records cut at every offset are met.
    while (at < size) {
      const size_t piece = std::min<size_t>(size - at, 7);
      carry.append(p + at, piece);
      at += piece;
      carry.erase(0, reader.read(carry.data(), carry.size(), out));
    }
  } catch (const dtrain::Error&) {
  }
  return 0;
}
