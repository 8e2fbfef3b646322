// Store keys in error messages (see quote.h).
#include "comm/store/quote.h"

#include <fmt/format.h>

namespace dtrain::comm {

std::string quoteKey(const std::string& s) {
  constexpr size_t kShown = 200;
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kShown; ++i) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') out += static_cast<char>(c);
    else out += fmt::format("\\x{:02x}", c);
  }
  out += "'";
  if (s.size() > kShown) out += fmt::format("...({} bytes)", s.size());
  return out;
}

std::string quoteKeys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 16;
  std::string out;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) out += (i ? ", " : "") + quoteKey(keys[i]);
  if (keys.size() > kShown) out += fmt::format(" and {} more", keys.size() - kShown);
  return out;
}

}  // namespace dtrain::comm
