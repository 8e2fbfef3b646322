// The progress reporter (dtrain/progress.h) in each mode, written to a file: the bar redraws in place
// with '\r' and ends with a newline; lines mode writes exactly one line per unit (or per line_every
// units) and never '\r'; automatic picks lines for a file. (The terminal case, through a real
// pseudo-terminal, is tests/milnce/cli_test.cc's ProgressOnTerminalAndInPipe.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "dtrain/comm/error.h"
#include "dtrain/progress.h"
#include "harness.h"

namespace {

using dtrain::Progress;
using dtrain::ProgressOptions;
using Mode = ProgressOptions::Mode;

// Runs fn with a Progress writing into a temporary file and returns what it wrote.
template <typename Fn>
std::string written(ProgressOptions o, Fn fn) {
  std::FILE* f = std::tmpfile();
  o.stream = f;
  fn(o);
  std::fflush(f);
  std::rewind(f);
  std::string s;
  for (int c; (c = std::fgetc(f)) != EOF;) s += static_cast<char>(c);
  std::fclose(f);
  return s;
}

size_t count(const std::string& s, char c) { return static_cast<size_t>(std::count(s.begin(), s.end(), c)); }

TEST(Progress, LinesModeWritesOneLinePerUnitAndNoCarriageReturn) {
  ProgressOptions o;
  o.mode = Mode::lines;
  o.unit = "video";
  std::string out = written(o, [](ProgressOptions po) {
    Progress p("gen-data", 5, po);
    for (int i = 1; i <= 5; ++i) {
      p.update(i);
      p.update(i);  // the same count again adds no line
    }
  });
  EXPECT_EQ(count(out, '\n'), 5u) << out;
  EXPECT_EQ(count(out, '\r'), 0u) << out;
  EXPECT_EQ(out.rfind("gen-data: video 1/5 (20%)", 0), 0u) << out;
  EXPECT_NE(out.find("gen-data: video 5/5 (100%) in 0:00\n"), std::string::npos) << out;
}

TEST(Progress, LineEveryGroupsUnitsAndTheLastAlwaysPrints) {
  ProgressOptions o;
  o.mode = Mode::lines;
  o.unit = "step";
  o.line_every = 4;
  std::string out = written(o, [](ProgressOptions po) {
    Progress p("train", 10, po);
    for (int i = 1; i <= 10; ++i) p.update(i, "epoch " + std::to_string((i - 1) / 4 + 1) + "/3");
  });
  // Steps 4, 8 and 10.
  EXPECT_EQ(count(out, '\n'), 3u) << out;
  EXPECT_NE(out.find("train: step 4/10 (40%)"), std::string::npos) << out;
  EXPECT_NE(out.find("train: step 8/10 (80%)"), std::string::npos) << out;
  EXPECT_NE(out.find("train: step 10/10 (100%) in 0:00 | epoch 3/3\n"), std::string::npos) << out;
}

TEST(Progress, BarRedrawsInPlaceAndEndsWithANewline) {
  ProgressOptions o;
  o.mode = Mode::bar;
  o.redraw_s = 0;  // every update redraws
  std::string out = written(o, [](ProgressOptions po) {
    Progress p("bench", 3, po);
    for (int i = 1; i <= 3; ++i) p.update(i, "size " + std::to_string(i));
  });
  EXPECT_EQ(count(out, '\r'), 3u) << out;
  EXPECT_EQ(count(out, '\n'), 1u) << out;
  ASSERT_FALSE(out.empty());
  EXPECT_EQ(out.back(), '\n');
  EXPECT_NE(out.find("bench [################........] 2/3 (66%)"), std::string::npos) << out;
  EXPECT_NE(out.find("bench [########################] 3/3 (100%) in 0:00 | size 3"), std::string::npos) << out;
}

TEST(Progress, AResumedRunStartsPartWayAndFinishingTwiceIsHarmless) {
  ProgressOptions o;
  o.mode = Mode::bar;
  std::string out = written(o, [](ProgressOptions po) {
    Progress p("train", 10, po, /*start=*/6);
    p.finish();  // never updated: the bar at 6/10, then the newline
    p.finish();
    p.update(7);  // after finish: nothing
  });
  EXPECT_EQ(count(out, '\r'), 1u) << out;
  EXPECT_NE(out.find("6/10 (60%)"), std::string::npos) << out;
  EXPECT_EQ(count(out, '\n'), 1u) << out;
}

TEST(Progress, AutomaticOnAFileIsLinesAndOffWritesNothing) {
  ProgressOptions o;
  std::string out = written(o, [](ProgressOptions po) {
    Progress p("x", 2, po);
    EXPECT_EQ(p.mode(), Mode::lines);
    p.update(1);
    p.update(2);
  });
  EXPECT_EQ(out, "x: 1/2 (50%)" + out.substr(12, out.find('\n') - 12) + "\nx: 2/2 (100%) in 0:00\n");
  o.mode = Mode::off;
  EXPECT_EQ(written(o, [](ProgressOptions po) { Progress("x", 2, po).update(2); }), "");
}

TEST(Progress, BadArgumentsAreNamed) {
  EXPECT_EQ(dtrain::parseProgressMode("lines"), Mode::lines);
  EXPECT_NE(dtrain::test::errorOf([] { dtrain::parseProgressMode("fancy"); }).find("'fancy'"), std::string::npos);
  ProgressOptions o;
  o.mode = Mode::off;
  EXPECT_NE(dtrain::test::errorOf([&] { Progress("gen", -1, o); }).find("progress 'gen'"), std::string::npos);
  Progress p("gen", 5, o);
  p.update(3);
  EXPECT_NE(dtrain::test::errorOf([&] { p.update(2); }).find("done 2 after 3"), std::string::npos);
}

}  // namespace
