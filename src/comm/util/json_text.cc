// JSON string literals (see json_text.h).
#include "comm/util/json_text.h"

namespace dtrain::detail {

void appendJsonQuoted(std::string& out, std::string_view s) {
  static const char kHex[] = "0123456789abcdef";
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

std::string jsonQuoted(std::string_view s) {
  std::string out;
  appendJsonQuoted(out, s);
  return out;
}

}  // namespace dtrain::detail
