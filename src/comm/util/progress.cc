// Progress reporting (dtrain/progress.h): a bar redrawn in place on a terminal, a line per unit of work
// elsewhere.
#include "dtrain/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "dtrain/comm/error.h"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;

// 0:07, 12:34, 1:02:03.
std::string clockTime(double s) {
  const auto t = static_cast<int64_t>(std::max(0.0, s) + 0.5);
  if (t >= 3600) return fmt::format("{}:{:02d}:{:02d}", t / 3600, t / 60 % 60, t % 60);
  return fmt::format("{}:{:02d}", t / 60, t % 60);
}

std::string rateText(double per_s) {
  return per_s >= 100 ? fmt::format("{:.0f}/s", per_s) : fmt::format("{:.3g}/s", per_s);
}

// Columns of the terminal behind `stream`, or 0 when unknown.
int terminalWidth(std::FILE* stream) {
  winsize ws{};
  if (::ioctl(::fileno(stream), TIOCGWINSZ, &ws) == 0) return ws.ws_col;
  return 0;
}

}  // namespace

ProgressOptions::Mode parseProgressMode(std::string_view s) {
  using Mode = ProgressOptions::Mode;
  if (s == "auto") return Mode::automatic;
  if (s == "bar") return Mode::bar;
  if (s == "lines") return Mode::lines;
  if (s == "off") return Mode::off;
  throw InvalidArgument(fmt::format("progress mode '{}' is not one of auto, bar, lines, off", s));
}

Progress::Progress(std::string label, int64_t total, ProgressOptions o, int64_t start)
    : label_(std::move(label)), total_(total), start_(start), done_(start), o_(std::move(o)), mode_(o_.mode),
      t0_(Clock::now()), last_draw_(t0_) {
  DTRAIN_CHECK(total >= 0 && start >= 0 && start <= total, InvalidArgument,
               "progress '{}': start {} and total {} must satisfy 0 <= start <= total", label_, start, total);
  DTRAIN_CHECK(o_.line_every >= 1, InvalidArgument, "progress '{}': line_every {} < 1", label_, o_.line_every);
  if (!o_.stream) mode_ = ProgressOptions::Mode::off;
  if (mode_ == ProgressOptions::Mode::automatic)
    mode_ = ::isatty(::fileno(o_.stream)) ? ProgressOptions::Mode::bar : ProgressOptions::Mode::lines;
}

Progress::~Progress() {
  try {
    finish();
  } catch (...) {  // a destructor reports nothing more
  }
}

// "video 37/100 (37%) 41.2/s ETA 0:02 | detail"; at the end "... in 0:12" instead of the ETA.
std::string Progress::status(std::string_view detail) const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
  // Floored: 100% only when done.
  const double pct = total_ > 0 ? std::floor(100.0 * static_cast<double>(done_) / static_cast<double>(total_)) : 100.0;
  std::string s = fmt::format("{}{}{}/{} ({:.0f}%)", o_.unit, o_.unit.empty() ? "" : " ", done_, total_, pct);
  const int64_t progressed = done_ - start_;
  if (done_ == total_) {
    s += " in " + clockTime(elapsed);
  } else if (progressed > 0 && elapsed > 0) {
    const double rate = static_cast<double>(progressed) / elapsed;
    s += fmt::format(" {} ETA {}", rateText(rate), clockTime(static_cast<double>(total_ - done_) / rate));
  }
  if (!detail.empty()) s += fmt::format(" | {}", detail);
  return s;
}

void Progress::drawBar(std::string_view detail) {
  constexpr int kWidth = 24;
  const int fill = total_ > 0 ? static_cast<int>(kWidth * done_ / total_) : kWidth;
  std::string line = fmt::format("{} [{}{}] {}", label_, std::string(fill, '#'), std::string(kWidth - fill, '.'),
                                 status(detail));
  // A line longer than the terminal would wrap, and '\r' would then redraw only its last row.
  const int cols = terminalWidth(o_.stream);
  if (cols > 1 && line.size() >= static_cast<size_t>(cols)) line.resize(static_cast<size_t>(cols) - 1);
  std::fprintf(o_.stream, "\r%s\x1b[K", line.c_str());  // ESC[K: erase what a longer previous line left
  std::fflush(o_.stream);
  last_draw_ = Clock::now();
  drawn_ = true;
  drawn_done_ = done_;
  drawn_detail_ = std::string(detail);
}

void Progress::update(int64_t done, std::string_view detail) {
  if (finished_) return;
  DTRAIN_CHECK(done >= done_ && done <= total_, InvalidArgument, "progress '{}': done {} after {} (total {})", label_,
               done, done_, total_);
  const int64_t before = done_;
  done_ = done;
  if (mode_ == ProgressOptions::Mode::off) return;
  last_detail_ = std::string(detail);
  if (mode_ == ProgressOptions::Mode::lines) {
    const bool new_unit = done / o_.line_every > before / o_.line_every || (done == total_ && before != total_);
    if (!new_unit) return;
    std::fprintf(o_.stream, "%s: %s\n", label_.c_str(), status(detail).c_str());
    std::fflush(o_.stream);
    return;
  }
  const double since = std::chrono::duration<double>(Clock::now() - last_draw_).count();
  if (!drawn_ || since >= o_.redraw_s || done == total_) drawBar(detail);
}

void Progress::clear() {
  if (mode_ != ProgressOptions::Mode::bar || !drawn_ || finished_) return;
  std::fputs("\r\x1b[K", o_.stream);
  std::fflush(o_.stream);
  drawn_ = false;
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (mode_ != ProgressOptions::Mode::bar) return;
  if (!drawn_ || drawn_done_ != done_ || drawn_detail_ != last_detail_) drawBar(last_detail_);
  std::fputc('\n', o_.stream);
  std::fflush(o_.stream);
}

}  // namespace dtrain
