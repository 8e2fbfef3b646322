// The names of groups and ops (naming.h).
#include "comm/group/naming.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/transport/transport.h"

namespace dtrain::comm {

std::shared_ptr<const trace::GroupInfo> groupInfo(const std::string& name, int rank, int size, std::vector<int> global) {
  static std::atomic<uint64_t> unnamed{0};
  auto info = std::make_shared<trace::GroupInfo>();
  info->name = name.empty() ? fmt::format("group{}", unnamed++) : name;
  info->rank = rank;
  info->size = size;
  if (global.empty())
    for (int r = 0; r < size; ++r) global.push_back(r);
  info->global_ranks = std::move(global);
  return info;
}

// Built by hand, once per op on the issuing thread: a general formatter costs several times more.
std::string opLabel(const char* op, uint64_t seq, const char* dtype, size_t count, const std::string& extra) {
  char num[2][24];
  const size_t seq_n = static_cast<size_t>(std::to_chars(num[0], num[0] + 24, seq).ptr - num[0]);
  const size_t count_n = static_cast<size_t>(std::to_chars(num[1], num[1] + 24, count).ptr - num[1]);
  const size_t op_n = std::strlen(op), dtype_n = std::strlen(dtype);
  std::string s;
  s.reserve(op_n + dtype_n + extra.size() + seq_n + count_n + 9);
  s.append(op, op_n).append(" seq=", 5).append(num[0], seq_n).append(" ", 1).append(dtype, dtype_n);
  s.append(" x ", 3).append(num[1], count_n).append(extra);
  return s;
}

uint64_t unevenHash(const std::vector<size_t>& counts) {
  const bool even = std::all_of(counts.begin(), counts.end(), [&](size_t c) { return c == counts[0]; });
  return even ? 0 : transport::hashCounts(counts);
}

std::string countsText(const std::vector<size_t>& counts, uint64_t hash) {
  return hash ? fmt::format(" counts [{}]", fmt::join(counts, ", ")) : "";
}

}  // namespace dtrain::comm
