/// @file
/// Progress of a long-running command: a live bar on a terminal, one line per unit of work elsewhere
/// (a log file, a pipe, dtrain-run's output), never a carriage return there.
///
/// \code
///   dtrain::ProgressOptions po;
///   po.unit = "video";
///   dtrain::Progress bar("gen-data", videos, po);        // writes to stderr
///   for (int i = 0; i < videos; ++i) {
///     makeVideo(i);
///     bar.update(i + 1);
///   }
///   bar.finish();                                         // (the destructor finishes too)
///   // terminal:   gen-data [#########...............] video 37/100  37% 41.2/s ETA 0:02   (redrawn in place)
///   // otherwise:  gen-data: video 37/100 (37%) 41.2/s ETA 0:02                             (one line per video)
///
///   po.unit = "step";
///   po.line_every = steps_per_epoch;                      // not on a terminal: one line per epoch
///   dtrain::Progress train("train", total_steps, po);
///   train.update(step, fmt::format("epoch {}/{} loss {:.4f}", epoch + 1, epochs, loss));
/// \endcode
///
/// The bar is redrawn at most every ProgressOptions::redraw_s seconds (and always at the last unit),
/// cut to the terminal's width. A program that prints lines of its own while a bar is shown calls
/// clear() first (a table row per benchmark size, say). Not thread-safe: one thread updates a Progress.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace dtrain {

/// Options of a Progress.
struct ProgressOptions {
  /// What a Progress prints.
  enum class Mode {
    automatic,  ///< bar when `stream` is a terminal (isatty), lines otherwise
    bar,        ///< a bar redrawn in place with `\r`, finished with a newline
    lines,      ///< a line every `line_every` units and at the last one
    off         ///< nothing
  };
  Mode mode = Mode::automatic;  ///< what to print
  std::FILE* stream = stderr;  ///< where to print it
  /// The noun counted, printed before the count ("video 12/100"); empty: just the count.
  std::string unit;
  /// Lines mode: a line when done is a multiple of line_every, and at the last unit.
  int64_t line_every = 1;
  /// Bar mode: the shortest time between two redraws.
  double redraw_s = 0.1;
};

/// "auto", "bar", "lines" or "off" (e.g. a --progress option); dtrain::InvalidArgument naming the
/// value otherwise.
ProgressOptions::Mode parseProgressMode(std::string_view s);

/// The progress of one long-running command, as a bar or as lines (see the file's description).
class Progress {
 public:
  /// `total` units of work (>= 0); `start` of them are already done (e.g. a resumed run), which the
  /// rate and ETA leave out.
  Progress(std::string label, int64_t total, ProgressOptions o = {}, int64_t start = 0);
  /// Finishes (see finish()).
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// `done` units are done (0 <= done <= total, not decreasing); `detail` follows the count and rate.
  void update(int64_t done, std::string_view detail = {});
  /// The bar's last state and a newline (nothing in lines mode). Later calls do nothing.
  void finish();
  /// Erases the bar from its line (bar mode), for output of the caller's own to the same terminal; the
  /// next update() draws it again below. Nothing in the other modes.
  void clear();
  /// The mode in effect: bar or lines (automatic resolved), or off.
  ProgressOptions::Mode mode() const { return mode_; }

 private:
  std::string status(std::string_view detail) const;
  void drawBar(std::string_view detail);

  std::string label_;
  int64_t total_, start_, done_;
  ProgressOptions o_;
  ProgressOptions::Mode mode_;
  std::chrono::steady_clock::time_point t0_, last_draw_;
  std::string last_detail_, drawn_detail_;
  int64_t drawn_done_ = -1;
  bool drawn_ = false, finished_ = false;
};

}  // namespace dtrain
