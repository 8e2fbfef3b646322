// Inputs the fuzzing harnesses (tests/fuzz) found crashing, each fed to its decoder again: every one must
// now end in a clean dtrain::Error or a normal result. The sanitizer build (scripts/sanitize.sh) runs these
// too, where the undefined behaviour they once hit would be reported.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "comm/trace/timeline_spool.h"
#include "dtrain/comm/error.h"

namespace dtrain::test {
namespace {

using comm::trace::timeline::SpoolReader;

template <class T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

std::string spoolHeader(int64_t skew_us) {
  std::string s(comm::trace::timeline::kSpoolMagic, 8);
  put<int32_t>(s, 1234);
  put<int64_t>(s, skew_us);
  return s;
}

// A span event ('E', kind 0) at `ts` lasting `dur`, with no name, category or args.
std::string spanEvent(int64_t ts, int64_t dur) {
  std::string s = "E";
  put<uint8_t>(s, 0);  // kSpan
  put<uint8_t>(s, 0);  // not failed
  put<int64_t>(s, ts);
  put<int64_t>(s, dur);
  put<int64_t>(s, -1);  // index
  put<uint64_t>(s, 0);  // id
  for (int i = 0; i < 4; ++i) put<int64_t>(s, 0);  // args' values
  for (int i = 0; i < 6; ++i) put<uint32_t>(s, 0);  // name, category, 4 arg keys: none
  return s;
}

std::string readAll(const std::string& spool) {
  SpoolReader r;
  size_t at = r.header(spool.data(), spool.size());
  std::string out;
  at += r.read(spool.data() + at, spool.size() - at, out);
  return out;
}

// timeline_spool_fuzz: an op shape with no peers memcpy'd from a null vector (UBSan: null pointer passed
// as argument 1 of memcpy).
TEST(DecoderRegression, SpoolShapeWithoutPeers) {
  std::string s = spoolHeader(0);
  s += "H";
  put<uint32_t>(s, 1);   // id
  put<int32_t>(s, -1);   // root
  put<int64_t>(s, 2);    // group size
  put<uint64_t>(s, 64);  // count
  put<uint64_t>(s, 256); // bytes
  put<int32_t>(s, 0);    // no peers
  for (int i = 0; i < 5; ++i) put<uint32_t>(s, 0);  // group, dtype, algorithm, name, category: none
  EXPECT_NO_THROW(readAll(s));
}

// timeline_spool_fuzz: times near INT64_MAX overflowed when formatted (ts + skew): now "corrupt".
TEST(DecoderRegression, SpoolTimesThatWouldOverflow) {
  EXPECT_NO_THROW(readAll(spoolHeader(56) + spanEvent(1000, 50)));
  for (const auto& [skew, ts, dur] : {std::tuple<int64_t, int64_t, int64_t>{int64_t{1} << 62, 1000, 5},
                                      {0, int64_t{1} << 62, 5},
                                      {0, 1000, INT64_MIN},
                                      {9222663139821048660, 1440870405781848120, 0}}) {
    try {
      readAll(spoolHeader(skew) + spanEvent(ts, dur));
      ADD_FAILURE() << "skew " << skew << ", ts " << ts << ", dur " << dur << ": accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("corrupt"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace dtrain::test
