// The files dtrain-report embeds in every page, compiled in (tools/report/embed.cmake) so the installed
// binary needs no data files.
#pragma once

namespace dtrain::report {

extern const char* const kChartJs;   // third_party/chartjs/chart.umd.min.js (Chart.js, MIT)
extern const char* const kTemplate;  // tools/report/template.html: the page, its style and its script

}  // namespace dtrain::report
