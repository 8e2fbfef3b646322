// dtrain-run: starts a distributed training job's processes on this node, like torchrun.
//   dtrain-run --nproc-per-node 4 --standalone ./train --epochs 3
// Parses the command line into run::Options; the work is in launcher.cc.
#include <CLI/CLI.hpp>
#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <optional>
#include <string>

#include "dtrain/build_info.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "launcher.h"

namespace {

constexpr int kUsageError = 2;

int usageError(const std::string& message) {
  std::fprintf(stderr, "dtrain-run: %s\nRun with --help for more information.\n", message.c_str());
  return kUsageError;
}

}  // namespace

namespace {
// 32 random bytes from the kernel, as hex: a job secret (docs/SECURITY.md).
std::string newSecret() {
  unsigned char raw[32];
  size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = ::getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error(std::string("--job-secret: getrandom: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  static const char* const kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : raw) {
    hex += kHex[c >> 4];
    hex += kHex[c & 15];
  }
  return hex;
}

// --version: dtrain's version and the libtorch its torch layer (and this build's programs) were built with.
std::string versionText() {
  namespace b = dtrain::build_info;
  std::string cuda = *b::kTorchCuda ? std::string(", CUDA ") + b::kTorchCuda : std::string(", CPU only");
  if (!*b::kTorchVersion) return std::string("dtrain-run ") + b::kVersion + "\nbuilt without libtorch (the comm layer alone)";
  return std::string("dtrain-run ") + b::kVersion + "\nbuilt with libtorch " + b::kTorchVersion + " (C++" +
         std::to_string(b::kTorchCxxStandard) + cuda + ") from " + b::kTorchDir;
}
}  // namespace

// The elastic options' values in seconds, converted by applyNnodes.
struct ElasticSeconds {
  double heartbeat = 5.0;
  double last_call = 2.0;
};

void addElasticOptions(CLI::App& app, dtrain::run::Options& opts, ElasticSeconds& seconds) {
  app.add_option("--rdzv-backend,--rdzv_backend", opts.rdzv_backend,
                 "Elastic rendezvous store: c10d (dtrain-run's own, hosted on the endpoint's host) or etcd")
      ->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", opts.rdzv_endpoint,
                 "Elastic: HOST:PORT of the rendezvous store (c10d), or etcd's client URLs");
  app.add_option("--rdzv-id,--rdzv_id", opts.rdzv_id, "Elastic: the job's id in the rendezvous store")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", seconds.heartbeat,
                 "Elastic: a node whose agent sends no heartbeat for this many seconds is lost")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--last-call", seconds.last_call,
                 "Elastic: once MIN nodes joined a round, wait this many seconds for more (up to MAX)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
}

// --nnodes N, or MIN:MAX (elastic), and the elastic options that go with it; an error message, or none.
std::optional<std::string> applyNnodes(const std::string& text, const ElasticSeconds& seconds,
                                       dtrain::run::Options& opts) {
  opts.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds.heartbeat * 1000.0 + 0.5));
  opts.last_call = std::chrono::milliseconds(static_cast<int64_t>(seconds.last_call * 1000.0 + 0.5));
  {
    // --nnodes N, or MIN:MAX (elastic)
    const auto colon = text.find(':');
    try {
      size_t used = 0;
      if (colon == std::string::npos) {
        opts.nnodes = std::stoi(text, &used);
        if (used != text.size()) throw std::invalid_argument("trailing text");
      } else {
        opts.min_nodes = std::stoi(text.substr(0, colon), &used);
        if (used != colon) throw std::invalid_argument("trailing text");
        const std::string max = text.substr(colon + 1);
        opts.max_nodes = std::stoi(max, &used);
        if (used != max.size()) throw std::invalid_argument("trailing text");
        if (opts.rdzv_backend.empty()) opts.rdzv_backend = "c10d";
      }
    } catch (const std::exception&) {
      return std::string("--nnodes '" + text + "': expected a number of nodes, or MIN:MAX");
    }
    if (colon == std::string::npos && !opts.rdzv_endpoint.empty())
      return std::string("--rdzv-endpoint is for elastic jobs: give --nnodes MIN:MAX");
  }
  return std::nullopt;
}

// The launcher's CUDA_VISIBLE_DEVICES, split at commas (empty when unset).
static std::vector<std::string> visibleGpus() {
  std::vector<std::string> ids;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::string id;
  for (const char* c = visible ? visible : "";; ++c) {
    if (*c != ',' && *c != '\0') {
      id += *c;
      continue;
    }
    if (!id.empty()) ids.push_back(id);
    id.clear();
    if (*c == '\0') return ids;
  }
}

int main(int argc, char** argv) {
  dtrain::run::Options opts;
  double grace_seconds = 5.0;

  CLI::App app{
      "dtrain-run --nproc-per-node N [--nnodes M --node-rank R --master-addr HOST --master-port PORT\n"
      "           | --nnodes MIN:MAX --rdzv-endpoint ENDPOINT | --standalone] [OPTIONS] PROGRAM [ARGS...]\n\n"
      "Runs PROGRAM in --nproc-per-node processes on this node with torchrun's environment (RANK,\n"
      "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...). Node 0 hosts the rendezvous store.\n"
      "When a process fails, the others are stopped and the group is restarted (--max-restarts)\n"
      "or the launcher exits with the failing process's code.",
      "dtrain-run"};
  // Underscore spellings too, so torchrun command lines work unchanged.
  app.add_option("--nproc-per-node,--nproc_per_node", opts.nproc_per_node, "Processes on this node")
      ->required();
  std::string nnodes_text = "1";
  auto* nnodes = app.add_option("--nnodes", nnodes_text,
                                "Number of nodes, or MIN:MAX for elastic membership (with --rdzv-endpoint;\n"
                                "docs/CLUSTER.md): rounds of MIN to MAX nodes, re-formed when a node is lost\n"
                                "or joins")
                     ->capture_default_str();
  ElasticSeconds elastic;
  addElasticOptions(app, opts, elastic);
  auto* node_rank =
      app.add_option("--node-rank,--node_rank", opts.node_rank, "This node's rank")->capture_default_str();
  auto* addr =
      app.add_option("--master-addr,--master_addr", opts.master_addr, "Host of node 0, where the store runs")
          ->capture_default_str();
  auto* port = app.add_option("--master-port,--master_port", opts.master_port, "Port of the store")
                   ->capture_default_str();
  app.add_flag("--standalone", opts.standalone, "One node; host the store on a free local port")
      ->excludes(nnodes, node_rank, addr, port);
  app.add_flag("--job-secret", opts.job_secret,
               "Make a secret for this job (one node) that every connection must prove (docs/SECURITY.md); the "
               "workers get it in DTRAIN_SECRET. Without it the user's DTRAIN_SECRET or DTRAIN_SECRET_FILE applies");
  app.add_option("--max-restarts,--max_restarts", opts.max_restarts,
                 "Restart the whole group up to this many times after a failure")
      ->capture_default_str();
  app.add_flag("--gpu-per-worker", opts.gpu_per_worker,
               "Each worker sees one GPU: CUDA_VISIBLE_DEVICES is the LOCAL_RANK-th of this launcher's "
               "CUDA_VISIBLE_DEVICES (or LOCAL_RANK when unset); --device cuda then means that GPU");
  app.add_option("--servers", opts.num_servers, "Parameter-server processes to start on node 0")
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", opts.log_dir,
                 "Base directory for the log files of --redirects and --tee (default: a new directory\n"
                 "under $TMPDIR); each run writes below a new node<R>_XXXXXX/ in it");
  app.add_option("-r,--redirects", opts.redirects,
                 "Send workers' streams to log files instead of the console: 0 none, 1 stdout,\n"
                 "2 stderr, 3 both, for every local rank (-r 3), or per local rank (-r 0:3,1:2).\n"
                 "Files: <log-dir>/node<R>_XXXXXX/attempt_<restart>/<local_rank>/stdout.log, stderr.log")
      ->capture_default_str();
  app.add_option("-t,--tee", opts.tee, "Like --redirects, but to the log files and the console")->capture_default_str();
  bool no_prefix = false;
  app.add_flag("--no-prefix", no_prefix, "Pass output through without the [rank R]: prefix");
  app.add_option("--grace-period", grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
  double hang_seconds = 0;
  app.add_option("--hang-timeout", hang_seconds,
                 "Declare the job hung when no worker of this node completes a collective for this many\n"
                 "seconds: collect the workers' flight-recorder dumps, stop them, print the diagnosis\n"
                 "(dtrain-trace analyze) and exit with 124. 0: never")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 864000.0));
  app.set_version_flag("--version", versionText(), "Print dtrain's version and the libtorch it was built with");
  // PROGRAM and everything after it (or after "--") is left untouched.
  app.prefix_command();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);  // prints help, or the error
    return code == 0 ? 0 : kUsageError;
  }

  opts.command = app.remaining();
  if (!opts.command.empty() && opts.command.front() == "--") {
    opts.command.erase(opts.command.begin());
  } else if (!opts.command.empty() && opts.command.front().size() > 1 && opts.command.front()[0] == '-') {
    // prefix_command() hands over an unknown option as if it were the program.
    return usageError("unknown option " + opts.command.front());
  }
  opts.prefix_output = !no_prefix;
  if (auto error = applyNnodes(nnodes_text, elastic, opts)) return usageError(*error);
  opts.grace_period = std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000.0 + 0.5));
  opts.hang_timeout = std::chrono::milliseconds(static_cast<int64_t>(hang_seconds * 1000.0 + 0.5));

  try {
    dtrain::run::checkOptions(opts);
  } catch (const dtrain::InvalidArgument& e) {
    return usageError(e.what());
  }

  try {
    opts.gpu_ids = visibleGpus();  // --gpu-per-worker picks from these
    // The job secret: the user's (workers inherit the variable), or with --job-secret one made here and
    // handed to the workers in their environment (never on a command line).
    opts.secret = dtrain::comm::jobSecretFrom(std::getenv("DTRAIN_SECRET"), std::getenv("DTRAIN_SECRET_FILE"));
    if (opts.job_secret) {
      if (!opts.secret.empty()) return usageError("--job-secret: DTRAIN_SECRET or DTRAIN_SECRET_FILE is already set");
      if (opts.nnodes > 1 || opts.elastic())
        return usageError("--job-secret makes a secret on this node only: across nodes give every node the same "
                          "DTRAIN_SECRET_FILE");
      opts.secret = newSecret();
    }
    return dtrain::run::Launcher(opts).run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-run: error: %s\n", e.what());
    return 1;
  }
}
