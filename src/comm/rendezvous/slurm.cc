// Slurm: the compressed node and task lists, the world of an srun task, and where its store is.
//
// srun gives each task SLURM_PROCID (its rank), SLURM_LOCALID (its rank on the node), and for the
// step SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST ("node[01-04,07]") and SLURM_STEP_TASKS_PER_NODE
// ("2(x3),1": the task count of each node of the node list, in order). The local size is the count of
// this task's node; the node is this host's place in the node list (SLURMD_NODENAME), else
// SLURM_NODEID. SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node and describes the job, not
// the step, so it is not used. Outside a step (a batch script: no SLURM_STEP_ID) the job's lists apply.
#include <cctype>
#include <cstdlib>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace {

constexpr size_t kMaxHosts = 1 << 20;

[[noreturn]] void bad(const std::string& what, const std::string& text, const std::string& why) {
  throw InvalidArgument(fmt::format("{}='{}': {}", what, text, why));
}

bool allDigits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

// A decimal number of at most 9 digits (no sign, no blanks).
uint64_t number(const std::string& s, const std::string& what, const std::string& text, const char* role) {
  if (!allDigits(s)) bad(what, text, fmt::format("{} '{}' is not a number", role, s));
  if (s.size() > 9) bad(what, text, fmt::format("{} '{}' is too large", role, s));
  return std::strtoull(s.c_str(), nullptr, 10);
}

// The names of one bracket group's body, "01-04,07" -> 01 02 03 04 07 (width of the lower bound kept).
std::vector<std::string> expandRanges(const std::string& body, const std::string& what, const std::string& text) {
  if (body.empty()) bad(what, text, "empty brackets '[]'");
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t comma = body.find(',', start);
    std::string range = body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (range.empty()) bad(what, text, fmt::format("empty range in '[{}]'", body));
    size_t dash = range.find('-');
    std::string lo = range.substr(0, dash);
    std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
    uint64_t a = number(lo, what, text, "range bound"), b = number(hi, what, text, "range bound");
    if (b < a) bad(what, text, fmt::format("descending range '{}'", range));
    if (out.size() + (b - a + 1) > kMaxHosts) bad(what, text, fmt::format("more than {} hosts", kMaxHosts));
    for (uint64_t v = a; v <= b; ++v) {
      std::string s = std::to_string(v);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');
      out.push_back(std::move(s));
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// One host expression without top-level commas: literal text and bracket groups, expanded as the
// cartesian product in order ("rack[1-2]-n[1-2]": rack1-n1 rack1-n2 rack2-n1 rack2-n2).
void expandEntry(const std::string& entry, const std::string& what, const std::string& text,
                 std::vector<std::string>& hosts) {
  if (entry.empty()) bad(what, text, "empty host name (two commas in a row, or one at an end)");
  std::vector<std::string> names = {""};
  size_t i = 0;
  while (i < entry.size()) {
    if (entry[i] == '[') {
      size_t close = entry.find(']', i);
      std::string body = entry.substr(i + 1, close - i - 1);
      std::vector<std::string> parts = expandRanges(body, what, text);
      if (names.size() * parts.size() > kMaxHosts) bad(what, text, fmt::format("more than {} hosts", kMaxHosts));
      std::vector<std::string> next;
      next.reserve(names.size() * parts.size());
      for (const auto& n : names)
        for (const auto& p : parts) next.push_back(n + p);
      names.swap(next);
      i = close + 1;
    } else {
      size_t j = entry.find('[', i);
      std::string lit = entry.substr(i, j == std::string::npos ? std::string::npos : j - i);
      for (auto& n : names) n += lit;
      i = j == std::string::npos ? entry.size() : j;
    }
  }
  if (hosts.size() + names.size() > kMaxHosts) bad(what, text, fmt::format("more than {} hosts", kMaxHosts));
  hosts.insert(hosts.end(), names.begin(), names.end());
}

}  // namespace

std::vector<std::string> expandSlurmNodeList(const std::string& list, const std::string& what) {
  if (list.empty()) bad(what, list, "empty node list");
  // Brackets must pair up without nesting; commas split hosts only outside brackets.
  std::vector<std::string> hosts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    char c = i < list.size() ? list[i] : ',';
    if (i < list.size() && (std::isspace(static_cast<unsigned char>(c)) || !std::isprint(static_cast<unsigned char>(c)))) {
      bad(what, list, fmt::format("unexpected character at offset {}", i));
    }
    if (c == '[') {
      if (depth++) bad(what, list, fmt::format("nested '[' at offset {}", i));
    } else if (c == ']') {
      if (!depth--) bad(what, list, fmt::format("']' without '[' at offset {}", i));
    } else if (c == ',' && depth == 0) {
      expandEntry(list.substr(start, i - start), what, list, hosts);
      start = i + 1;
    }
    if (i == list.size() && depth) bad(what, list, "'[' without ']'");
  }
  return hosts;
}

std::vector<int> expandSlurmTasksPerNode(const std::string& counts, const std::string& what) {
  if (counts.empty()) bad(what, counts, "empty task counts");
  std::vector<int> out;
  size_t start = 0;
  while (true) {
    size_t comma = counts.find(',', start);
    std::string item = counts.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (item.empty()) bad(what, counts, "empty item (two commas in a row, or one at an end)");
    std::string n = item, reps = "1";
    if (size_t paren = item.find('('); paren != std::string::npos) {
      n = item.substr(0, paren);
      if (item.compare(paren, 2, "(x") != 0 || item.back() != ')' || item.size() < paren + 4) {
        bad(what, counts, fmt::format("'{}' is not COUNT or COUNT(xREPEATS)", item));
      }
      reps = item.substr(paren + 2, item.size() - paren - 3);
    }
    uint64_t c = number(n, what, counts, "task count"), r = number(reps, what, counts, "repeat count");
    if (c < 1) bad(what, counts, fmt::format("a node with {} tasks", c));
    if (r < 1) bad(what, counts, fmt::format("'{}' repeats {} times", item, r));
    if (c > kMaxHosts || out.size() + r > kMaxHosts) bad(what, counts, fmt::format("more than {} nodes or tasks", kMaxHosts));
    out.insert(out.end(), r, static_cast<int>(c));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

int slurmStorePort(uint64_t job_id, uint64_t step_id) {
  // 768 job slots of 16 step slots: consecutive jobs are 16 ports apart, a job's steps 1 apart.
  return 20000 + static_cast<int>((job_id % 768) * 16 + step_id % 16);
}

namespace rendezvous {

namespace {

// The step's variable inside an srun step, else the job's.
const char* stepOrJob(bool in_step, const char* step_var, const char* job_var) {
  return in_step ? step_var : job_var;
}

uint64_t slurmId(const Environment& env, const char* name) {
  const char* v = env.get(name);
  std::string s = v ? v : "";
  if (!allDigits(s) || s.size() > 18) throw InvalidArgument(fmt::format("{}='{}' is not a Slurm id", name, s));
  return std::strtoull(s.c_str(), nullptr, 10);
}

bool inStep(const Environment& env) { return env.get("SLURM_STEP_ID") != nullptr || env.get("SLURM_STEPID") != nullptr; }
const char* stepIdVar(const Environment& env) { return env.get("SLURM_STEP_ID") ? "SLURM_STEP_ID" : "SLURM_STEPID"; }

}  // namespace

std::optional<WorldInfo> detectSlurm(const Environment& env) {
  const bool step = inStep(env);
  const char* ntasks_var = step && env.get("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  if (!env.get("SLURM_PROCID") || !env.get(ntasks_var)) return std::nullopt;
  WorldInfo w;
  w.source = "slurm";
  w.rank = env.integer("SLURM_PROCID", 0, 0);
  w.size = env.integer(ntasks_var, 1, 1);
  if (w.size == 1) return w;
  if (!step && env.get("SLURM_JOB_ID")) {
    throw RendezvousError(fmt::format(
        "[rank {}] SLURM_PROCID={} and SLURM_NTASKS={} belong to the batch script of Slurm job {}, not to a task "
        "that srun started: start the program with srun (or dtrain-run) inside the script, or run it with "
        "SLURM_NTASKS unset to train alone",
        w.rank, w.rank, w.size, env.get("SLURM_JOB_ID")));
  }
  w.local_rank = env.integer("SLURM_LOCALID", 0, 0);
  const char* counts_var = stepOrJob(step && env.get("SLURM_STEP_TASKS_PER_NODE"), "SLURM_STEP_TASKS_PER_NODE",
                                     "SLURM_TASKS_PER_NODE");
  const char* list_var = stepOrJob(step && env.get("SLURM_STEP_NODELIST"), "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST");
  if (!env.get(counts_var)) {
    throw RendezvousError(fmt::format("[rank {}] Slurm task without {}: cannot tell how many tasks share its node",
                                      w.rank, counts_var));
  }
  std::vector<int> counts = expandSlurmTasksPerNode(env.get(counts_var), counts_var);
  w.num_nodes = static_cast<int>(counts.size());
  int total = 0;
  for (int c : counts) total += c;
  if (total != w.size) {
    throw RendezvousError(fmt::format("[rank {}] {}='{}' adds up to {} tasks but {}={}", w.rank, counts_var,
                                      env.get(counts_var), total, ntasks_var, w.size));
  }
  // The node: this host's place in the node list when both are known, else SLURM_NODEID.
  w.node = -1;
  std::vector<std::string> hosts;
  if (env.get(list_var)) {
    hosts = expandSlurmNodeList(env.get(list_var), list_var);
    if (hosts.size() != counts.size()) {
      throw RendezvousError(fmt::format("[rank {}] {}='{}' names {} nodes but {}='{}' gives counts for {}", w.rank,
                                        list_var, env.get(list_var), hosts.size(), counts_var, env.get(counts_var),
                                        counts.size()));
    }
    if (const char* me = env.get("SLURMD_NODENAME")) {
      for (size_t i = 0; i < hosts.size(); ++i)
        if (hosts[i] == me) w.node = static_cast<int>(i);
    }
  }
  if (w.node < 0) w.node = env.integer("SLURM_NODEID", 0, 0);
  if (w.node >= w.num_nodes) {
    throw RendezvousError(fmt::format("[rank {}] SLURM_NODEID={} but {}='{}' has counts for {} nodes", w.rank, w.node,
                                      counts_var, env.get(counts_var), w.num_nodes));
  }
  w.local_size = counts[static_cast<size_t>(w.node)];
  std::string job = env.get("SLURM_JOB_ID") ? env.get("SLURM_JOB_ID") : "?";
  w.job = fmt::format("slurm job {} step {}", job, step ? env.get(stepIdVar(env)) : "none");
  return w;
}

std::optional<SlurmStore> slurmStore(const Environment& env) {
  if (!env.get("SLURM_PROCID") || !env.get("SLURM_JOB_ID")) return std::nullopt;
  SlurmStore s;
  const bool step = inStep(env);
  const char* list_var = step && env.get("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  if (env.get(list_var)) {
    s.host = expandSlurmNodeList(env.get(list_var), list_var).front();
    s.host_origin = fmt::format("the first node of {}", list_var);
  } else if (env.get("SLURM_LAUNCH_NODE_IPADDR")) {
    s.host = env.get("SLURM_LAUNCH_NODE_IPADDR");
    s.host_origin = "SLURM_LAUNCH_NODE_IPADDR";
  } else {
    return std::nullopt;
  }
  uint64_t job = slurmId(env, "SLURM_JOB_ID");
  uint64_t st = step ? slurmId(env, stepIdVar(env)) : 0;
  s.port = slurmStorePort(job, st);
  s.port_origin = step ? fmt::format("a port from SLURM_JOB_ID={} and {}={}", job, stepIdVar(env), st)
                       : fmt::format("a port from SLURM_JOB_ID={}", job);
  return s;
}

std::optional<std::string> slurmPeerNode(const Environment& env) {
  const char* list_var = inStep(env) && env.get("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
  if (!env.get(list_var)) return std::nullopt;
  std::vector<std::string> hosts = expandSlurmNodeList(env.get(list_var), list_var);
  if (hosts.size() < 2) return std::nullopt;
  size_t me = static_cast<size_t>(env.integer("SLURM_NODEID", 0, 0));
  if (const char* name = env.get("SLURMD_NODENAME")) {
    for (size_t i = 0; i < hosts.size(); ++i)
      if (hosts[i] == name) me = i;
  }
  return hosts[(me + 1) % hosts.size()];
}

}  // namespace rendezvous
}  // namespace dtrain::comm
