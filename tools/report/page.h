// Fills the page template (template.html, with Chart.js inline) with a run's data: one self-contained
// HTML file, no network at view time.
//   std::string html = renderPage(data);   // data: {"run": ..., "steps": ..., "evals": ..., ...}
#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace dtrain::report {

// JSON safe inside <script type="application/json">: no '<' (so no "</script>"), ASCII only.
std::string scriptSafeJson(const nlohmann::json& data);

std::string renderPage(const nlohmann::json& data);

}  // namespace dtrain::report
