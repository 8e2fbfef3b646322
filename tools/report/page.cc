// The template has two markers, each replaced once: the Chart.js source, then the report's data.
#include "page.h"

#include <fmt/format.h>

#include "assets.h"
#include "dtrain/comm/error.h"

namespace dtrain::report {
namespace {

size_t findOnce(const std::string& text, const std::string& marker) {
  const auto at = text.find(marker);
  if (at == std::string::npos || text.find(marker, at + marker.size()) != std::string::npos) {
    throw Error(fmt::format("dtrain-report's page template must hold {} exactly once (a build problem)", marker));
  }
  return at;
}

}  // namespace

std::string scriptSafeJson(const nlohmann::json& data) {
  std::string text = data.dump(-1, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    // '<' occurs only inside JSON strings, where \u003c means the same: no "</script>", no "<!--".
    if (c == '<') {
      out += "\\u003c";
    } else {
      out += c;
    }
  }
  return out;
}

std::string renderPage(const nlohmann::json& data) {
  // Markers are looked up in the template alone, never in what replaces them.
  const std::string page = kTemplate;
  const std::string js_marker = "/*@DTRAIN_CHARTJS@*/", data_marker = "@DTRAIN_REPORT_DATA@";
  const size_t js = findOnce(page, js_marker), at = findOnce(page, data_marker);
  if (js > at) throw Error("dtrain-report's page template must load Chart.js before the data (a build problem)");
  return page.substr(0, js) + kChartJs + page.substr(js + js_marker.size(), at - js - js_marker.size()) +
         scriptSafeJson(data) + page.substr(at + data_marker.size());
}

}  // namespace dtrain::report
