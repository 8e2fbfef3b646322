// --comm-hook texts (dtrain/hook_spec.h): what parses, what is refused with the option named, and the
// hook each makes.
#include <gtest/gtest.h>

#include "dtrain/comm/error.h"
#include "dtrain/hook_spec.h"

namespace dtrain {
namespace {

TEST(HookSpec, ParsesEveryKind) {
  EXPECT_EQ(parseCommHookSpec("none").kind, "none");
  EXPECT_EQ(parseCommHookSpec("fp16").kind, "fp16");
  EXPECT_EQ(parseCommHookSpec("bf16").kind, "bf16");
  EXPECT_FALSE(parseCommHookSpec("fp16").always);
  EXPECT_TRUE(parseCommHookSpec("fp16:always").always);
  EXPECT_EQ(parseCommHookSpec("bf16:always").kind, "bf16");
  auto t = parseCommHookSpec("topk:0.01");
  EXPECT_EQ(t.kind, "topk");
  EXPECT_DOUBLE_EQ(t.ratio, 0.01);
  EXPECT_EQ(t.text, "topk:0.01");
  EXPECT_DOUBLE_EQ(parseCommHookSpec("topk:1").ratio, 1.0);
  auto p = parseCommHookSpec("powersgd:4");
  EXPECT_EQ(p.kind, "powersgd");
  EXPECT_EQ(p.rank, 4);
  EXPECT_EQ(p.start, 1000);
  auto q = parseCommHookSpec("powersgd:2:10");
  EXPECT_EQ(q.rank, 2);
  EXPECT_EQ(q.start, 10);
}

TEST(HookSpec, RefusesBadValuesNamingTheOption) {
  for (const char* v : {"foo", "", "topk", "topk:", "topk:0", "topk:2", "topk:-0.1", "topk:abc", "topk:0.1x",
                        "topk:nan", "powersgd", "powersgd:0", "powersgd:-1", "powersgd:1.5", "powersgd:2:", "powersgd:2:1", "powersgd:2:x", "powersgd::5", "fp16:2", "bf16:", "fp16:alway", "none:"}) {
    try {
      parseCommHookSpec(v, "--hook");
      ADD_FAILURE() << "'" << v << "' accepted";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::string("--hook '") + v + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("expected none, fp16[:always], bf16[:always], topk:RATIO"), std::string::npos) << msg;
    }
  }
}

TEST(HookSpec, MakesTheHooks) {
  EXPECT_EQ(makeCommHook(parseCommHookSpec("none")), nullptr);
  EXPECT_NE(makeCommHook(parseCommHookSpec("fp16")), nullptr);
  EXPECT_NE(makeCommHook(parseCommHookSpec("bf16")), nullptr);
  EXPECT_NE(makeCommHook(parseCommHookSpec("topk:0.5")), nullptr);
  auto p = makeCommHook(parseCommHookSpec("powersgd:3:7"));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->name(), "powerSGD");
}

}  // namespace
}  // namespace dtrain
