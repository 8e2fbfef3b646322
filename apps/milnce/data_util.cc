// Helpers shared by the MIL-NCE data files (data_util.h).
#include "milnce/data_util.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "dtrain/comm/error.h"

namespace milnce::detail {

using dtrain::InvalidArgument;

[[noreturn]] void fail(const std::string& path, const std::string& msg) {
  throw InvalidArgument(fmt::format("milnce: {}: {}", path, msg));
}
[[noreturn]] void failAt(const std::string& path, int64_t line, const std::string& msg) {
  throw InvalidArgument(fmt::format("milnce: {}:{}: {}", path, line, msg));
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

std::mt19937_64 streamRng(uint64_t seed, Stream what, uint64_t index) {
  return std::mt19937_64(splitmix64(splitmix64(splitmix64(seed) ^ what) ^ index));
}

// Uniform in [0, 1) with 53 random bits.
double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// Uniform integer in [lo, hi] (inclusive), unbiased by rejection.
int64_t uniformInt(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
  if (range == 0) return static_cast<int64_t>(rng());  // the whole 64-bit range
  const uint64_t rem = (std::numeric_limits<uint64_t>::max() % range + 1) % range;  // 2^64 mod range
  uint64_t x;
  do x = rng();
  while (x > std::numeric_limits<uint64_t>::max() - rem);
  return lo + static_cast<int64_t>(x % range);
}

// Standard normal (Box-Muller, one value per call).
double normal(std::mt19937_64& rng) {
  const double u1 = 1.0 - uniform01(rng);  // (0, 1]: log is finite
  const double u2 = uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

std::string readFile(const std::string& path) {
  // A directory, a device (/dev/zero never ends) or a pipe (opening it waits for a writer) is refused before
  // it is opened: a data file may name any path (videos.csv's feature_file).
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    fail(path, "not a regular file (a directory, device or pipe)");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail(path, "read error");
  return ss.str();
}

void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out) out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (out) out.close();
  if (!out) throw dtrain::IoError(fmt::format("milnce: cannot write {}: {}", path, std::strerror(errno)));
}

std::string typeStr(at::ScalarType t) { return c10::toString(t); }

}  // namespace milnce::detail
