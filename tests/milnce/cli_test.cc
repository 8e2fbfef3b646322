// The milnce command line end to end: gen-data, train on 2 workers under dtrain-run (retrieval before
// and after), resume, eval of the newest checkpoint; and bad input named clearly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>
#include <vector>

#include "harness.h"

namespace {

// Every command here is bounded by `timeout 240`.
std::pair<int, std::string> run(const std::string& cmd) { return dtrain::test::runCommand(cmd, 240); }

const std::string kMilnce = DTRAIN_BIN_DIR "/milnce";
const std::string kRun = DTRAIN_BIN_DIR "/dtrain-run";

// metrics.jsonl of the run below (docs/OBSERVABILITY.md): 200 videos over 2 ranks in batches of 16 are
// 6 steps an epoch, 4 epochs in two runs (2, then resumed for 2 more).
void checkMetrics(const std::string& path) {
  std::ifstream m(path);
  std::vector<nlohmann::json> runs, steps, evals;
  for (std::string l; std::getline(m, l);) {
    auto j = nlohmann::json::parse(l);
    (j["kind"] == "run" ? runs : j["kind"] == "step" ? steps : evals).push_back(j);
    if (j["kind"] != "run" && j["kind"] != "step") {
      EXPECT_EQ(j["kind"], "eval") << l;
    }
  }
  ASSERT_EQ(runs.size(), 2u);  // the first run and the resumed one, appended
  for (const auto& r : runs) {
    EXPECT_EQ(r["app"], "milnce");
    EXPECT_EQ(r["world_size"], 2);
    EXPECT_GT(r["start_unix"].get<double>(), 1.7e9);
    EXPECT_EQ(r["config"]["batch"], 16);
  }
  EXPECT_EQ(runs[1]["config"]["resume"], true);
  ASSERT_EQ(steps.size(), 24u);
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto& st = steps[i];
    EXPECT_EQ(st["step"], i + 1) << st;
    EXPECT_EQ(st["epoch"], i / 6) << st;
    for (const char* f : {"time_s", "loss", "lr", "samples_per_s", "step_s", "comm_s", "exposed_comm_s", "compute_s",
                          "hidden_fraction"})
      EXPECT_TRUE(st[f].is_number()) << f << " in " << st;
    EXPECT_GT(st["loss"].get<double>(), 0) << st;
    EXPECT_NEAR(st["compute_s"].get<double>(), st["step_s"].get<double>() - st["exposed_comm_s"].get<double>(), 1e-9);
    EXPECT_GT(st["bytes_sent"].get<uint64_t>(), 0u) << st;  // the embeddings' allgather at least
    EXPECT_GT(st["rss_bytes"].get<uint64_t>(), uint64_t{10} << 20) << st;
    EXPECT_FALSE(st.contains("bubble_fraction")) << st;
  }
  // Before training (epoch 0), after epochs 1 and 2; resumed: before (epoch 2 again), after 3 and 4.
  std::vector<int> eval_epochs;
  for (const auto& e : evals) {
    eval_epochs.push_back(e["epoch"]);
    EXPECT_EQ(e["step"], 6 * e["epoch"].get<int>()) << e;
    for (const char* f : {"R@1", "R@5", "R@10"}) EXPECT_TRUE(e[f].get<double>() >= 0 && e[f].get<double>() <= 100) << e;
    EXPECT_GE(e["median_rank"].get<double>(), 1) << e;
  }
  EXPECT_EQ(eval_epochs, (std::vector<int>{0, 1, 2, 2, 3, 4}));
}

TEST(MilNceCli, GenerateTrainResumeEvaluate) {
  dtrain::test::TempDir dir;
  const std::string data = dir.path() + "/data", out = dir.path() + "/run";
  auto [rc, gen] = run(kMilnce + " gen-data --out " + data + " --videos 200 --eval-videos 20 --seed 5");
  ASSERT_EQ(rc, 0) << gen;
  auto [rc1, first] = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " +
                          out + " --epochs 4 --stop-after 2 --batch 16");
  ASSERT_EQ(rc1, 0) << first;
  EXPECT_NE(first.find("[rank 0]:   before training"), std::string::npos) << first;
  EXPECT_NE(first.find("epoch 2/4"), std::string::npos) << first;
  EXPECT_EQ(first.find("epoch 3/4"), std::string::npos) << first;
  auto [rc2, second] = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " +
                           out + " --epochs 4 --batch 16 --resume");
  ASSERT_EQ(rc2, 0) << second;
  EXPECT_NE(second.find("resumed from epoch 2"), std::string::npos) << second;
  EXPECT_NE(second.find("after training (4 epochs)"), std::string::npos) << second;
  EXPECT_NE(second.find("chance"), std::string::npos) << second;
  checkMetrics(out + "/metrics.jsonl");
  auto [rc3, ev] = run(kMilnce + " eval --data " + data + " --run " + out);
  ASSERT_EQ(rc3, 0) << ev;
  EXPECT_NE(ev.find("epoch 4"), std::string::npos) << ev;
  EXPECT_TRUE(std::ifstream(out + "/eval-epoch4.json").good());
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// Progress on a terminal and elsewhere (issue 11): gen-data under a pseudo-terminal (script) draws a bar
// redrawn in place and ends it with a newline; into a pipe it writes exactly one line per video and no
// carriage return. Then dtrain-bench's per-size progress into a pipe, one line per size.
TEST(MilNceCli, ProgressOnTerminalAndInPipe) {
  dtrain::test::TempDir dir;
  const std::string gen = kMilnce + " gen-data --videos 1500 --eval-videos 10 --seed 3 --out " + dir.path();
  auto [rc, tty] = run("script -qfec '" + gen + "/a' /dev/null");
  ASSERT_EQ(rc, 0) << tty;
  // The terminal turns each newline into \r\n; the redraws are the other carriage returns.
  const size_t redraws = count(tty, "\rgen-data [");
  EXPECT_GE(redraws, 2u) << tty;  // ~1 s of work, redrawn every 0.1 s
  EXPECT_EQ(count(tty, "gen-data: "), 0u) << tty;
  const size_t last = tty.rfind("\rgen-data [");
  ASSERT_NE(last, std::string::npos) << tty;
  const std::string final_bar = tty.substr(last, tty.find('\n', last) - last);
  EXPECT_NE(final_bar.find("video 1510/1510 (100%)"), std::string::npos) << final_bar;
  EXPECT_EQ(final_bar.substr(final_bar.size() - 1), "\r") << "the bar ends with a newline:" << final_bar;

  auto [rc2, piped] = run(gen + "/b 2>&1 | cat");
  ASSERT_EQ(rc2, 0) << piped;
  EXPECT_EQ(count(piped, "\r"), 0u);
  EXPECT_EQ(count(piped, "\ngen-data: video "), 1509u);  // 1510 lines, each after a newline but the first
  EXPECT_EQ(piped.rfind("gen-data: video 1/1510 (0%)", 0), 0u) << piped.substr(0, 200);
  EXPECT_NE(piped.find("\ngen-data: video 1510/1510 (100%) in "), std::string::npos);
  EXPECT_EQ(count(piped, "\n"), 1511u);  // and the final "wrote ..." line

  auto [rc3, bench] = run(DTRAIN_BIN_DIR "/dtrain-bench allreduce --min-bytes 1K --max-bytes 16K --iters 5 2>&1 | cat");
  ASSERT_EQ(rc3, 0) << bench;
  EXPECT_EQ(count(bench, "allreduce: size "), 5u) << bench;  // 1K 2K 4K 8K 16K
  EXPECT_NE(bench.find("allreduce: size 5/5 (100%)"), std::string::npos) << bench;
  EXPECT_EQ(count(bench, "\r"), 0u) << bench;
  auto [rc4, bench_tty] =
      run("script -qfec '" DTRAIN_BIN_DIR "/dtrain-bench allreduce --min-bytes 1K --max-bytes 16K --iters 5' /dev/null");
  ASSERT_EQ(rc4, 0) << bench_tty;
  EXPECT_GE(count(bench_tty, "\rallreduce ["), 1u) << bench_tty;
  EXPECT_EQ(count(bench_tty, "allreduce: size"), 0u) << bench_tty;
}

// The slow-links options (issue 12): each run's config names them, fp16 sends fewer bytes per step than
// no hook, LAMB and local SGD train; bad values are refused naming the option.
std::vector<nlohmann::json> records(const std::string& path, const std::string& kind) {
  std::ifstream m(path);
  std::vector<nlohmann::json> out;
  for (std::string l; std::getline(m, l);) {
    auto j = nlohmann::json::parse(l);
    if (j["kind"] == kind) out.push_back(j);
  }
  return out;
}

double meanBytes(const std::string& path) {
  double sum = 0;
  auto steps = records(path, "step");
  for (const auto& st : steps) sum += st["bytes_sent"].get<double>();
  return steps.empty() ? 0 : sum / static_cast<double>(steps.size());
}

TEST(MilNceCli, SlowLinkOptions) {
  dtrain::test::TempDir dir;
  const std::string data = dir.path() + "/data";
  auto [rc, gen] = run(kMilnce + " gen-data --out " + data + " --videos 200 --eval-videos 20 --seed 5");
  ASSERT_EQ(rc, 0) << gen;
  auto train = [&](const std::string& name, const std::string& args) {
    auto r = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " + dir.path() +
                 "/" + name + " --epochs 2 --batch 16 --no-eval --no-progress " + args);
    EXPECT_EQ(r.first, 0) << args << ": " << r.second;
    return dir.path() + "/" + name + "/metrics.jsonl";
  };
  const std::string none = train("none", ""), fp16 = train("fp16", "--comm-hook fp16:always"),
                    lamb = train("lamb", "--optimizer lamb --weight-decay 0.01 --lr 0.002"),
                    local = train("local", "--local-sgd 2"), psgd = train("psgd", "--comm-hook powersgd:2:3");
  EXPECT_EQ(records(fp16, "run").at(0)["config"]["comm_hook"], "fp16:always");
  EXPECT_EQ(records(lamb, "run").at(0)["config"]["optimizer"], "lamb");
  EXPECT_EQ(records(local, "run").at(0)["config"]["local_sgd"], 2);
  // The gradients are most of the bytes (the embeddings' allgather the rest): fp16 halves them.
  EXPECT_LT(meanBytes(fp16), 0.7 * meanBytes(none)) << meanBytes(fp16) << " vs " << meanBytes(none);
  // PowerSGD from step 3: its later steps send less than the plain ones.
  auto ps = records(psgd, "step");
  ASSERT_EQ(ps.size(), 12u);
  EXPECT_LT(ps.back()["bytes_sent"].get<double>(), 0.5 * ps.front()["bytes_sent"].get<double>());
  for (const auto& path : {lamb, local}) {
    auto st = records(path, "step");
    ASSERT_EQ(st.size(), 12u) << path;
    for (const auto& s : st) EXPECT_TRUE(std::isfinite(s["loss"].get<double>())) << s;
  }
  for (const auto& [args, what] : std::vector<std::pair<std::string, std::string>>{
           {"--comm-hook topk:2", "--comm-hook 'topk:2'"},
           {"--comm-hook foo", "--comm-hook 'foo'"},
           {"--optimizer sgd", "--optimizer"},
           {"--local-sgd 2 --comm-hook fp16", "choose one"}}) {
    auto [rc2, out] = run(kMilnce + " train --data " + data + " --out " + dir.path() + "/bad --epochs 1 --no-eval " + args);
    EXPECT_NE(rc2, 0) << args << ": " << out;
    EXPECT_NE(out.find(what), std::string::npos) << args << ": " << out;
  }
}

// --zero 2 on 2 workers: the same evaluation before training as DDP (the same initial model, gathered
// for the main rank), per-rank checkpoints, resumed with --zero 2; the options ZeRO refuses, named.
TEST(MilNceCli, ZeroTwo) {
  dtrain::test::TempDir dir;
  const std::string data = dir.path() + "/data";
  auto [rc, gen] = run(kMilnce + " gen-data --out " + data + " --videos 120 --eval-videos 20 --seed 5");
  ASSERT_EQ(rc, 0) << gen;
  auto train = [&](const std::string& name, const std::string& args) {
    auto r = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " + dir.path() +
                 "/" + name + " --epochs 2 --batch 16 --hidden 64 --embed 32 --no-progress " + args);
    EXPECT_EQ(r.first, 0) << args << ": " << r.second;
    std::ifstream f(dir.path() + "/" + name + "/eval.json");
    return nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  };
  const auto ddp = train("ddp", ""), zero = train("zero", "--zero 2 --stop-after 1");
  auto resumed = run(kRun + " --standalone --nproc-per-node 2 " + kMilnce + " train --data " + data + " --out " +
                     dir.path() + "/zero --epochs 2 --batch 16 --hidden 64 --embed 32 --no-progress --zero 2 --resume");
  ASSERT_EQ(resumed.first, 0) << resumed.second;
  EXPECT_NE(resumed.second.find("resumed from epoch 1, step 3"), std::string::npos) << resumed.second;
  std::ifstream f(dir.path() + "/zero/eval.json");
  const auto z = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(ddp.is_object() && zero.is_object() && z.is_object()) << resumed.second;
  EXPECT_EQ(ddp["before"], zero["before"]);  // (the resumed run's "before" is after epoch 1)
  EXPECT_EQ(z["after"]["clips"], ddp["after"]["clips"]);
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/zero/checkpoints/ckpt-000002-000000006/rank-00001-of-00002.pt"));
  // `milnce eval` puts the shards of the newest per-rank checkpoint together: the run's last evaluation.
  auto ev = run(kMilnce + " eval --data " + data + " --run " + dir.path() + "/zero --hidden 64 --embed 32 --progress off"
                " --json " + dir.path() + "/zero-eval.json");
  ASSERT_EQ(ev.first, 0) << ev.second;
  std::ifstream ej(dir.path() + "/zero-eval.json");
  const auto e = nlohmann::json::parse(ej, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(e.is_object()) << ev.second;
  EXPECT_EQ(e["epoch"], 2);
  for (const char* k : {"R@1", "R@5", "R@10", "median_rank"}) EXPECT_EQ(e[k], z["after"][k]) << k;
  for (const auto& [args, what] : std::vector<std::pair<std::string, std::string>>{
           {"--zero 2 --comm-hook fp16", "--zero 2 and --comm-hook fp16"},
           {"--zero 3 --local-sgd 2", "--zero 3 and --local-sgd 2"},
           {"--zero 2 --optimizer lamb", "--zero 2 and --optimizer lamb"},
           {"--zero 1 --local-sgd 2", "--zero 1 and --local-sgd 2"},
           {"--zero 4", "--zero"}}) {
    auto [rc2, out] = run(kMilnce + " train --data " + data + " --out " + dir.path() + "/bad --epochs 1 --no-eval " + args);
    EXPECT_NE(rc2, 0) << args << ": " << out;
    EXPECT_NE(out.find(what), std::string::npos) << args << ": " << out;
  }
}

TEST(MilNceCli, BadInputIsNamed) {
  auto [rc, out] = run(kMilnce + " train --data /nonexistent/milnce-data --no-eval");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("/nonexistent/milnce-data"), std::string::npos) << out;
  auto [rc2, out2] = run(kMilnce + " gen-data --out /tmp/x --misalign 2");
  EXPECT_NE(rc2, 0) << out2;
  EXPECT_NE(out2.find("misalign"), std::string::npos) << out2;
}

}  // namespace
