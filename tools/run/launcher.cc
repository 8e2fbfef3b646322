// dtrain-run's engine. One thread, one poll() loop per attempt: it watches the launcher's signals
// (through a signalfd), every child's stdout/stderr pipe and the deadlines of a shutdown in progress.
// Children are reaped with waitpid(WNOHANG) whenever SIGCHLD arrives or the loop ticks.
#include "launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/fd.h"
#include "dtrain/comm/store.h"
#include "hang.h"
#include "output.h"

extern char** environ;

namespace dtrain::run {

using comm::net::Fd;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

// The loop wakes at least this often even if nothing happens, as a safety net for lost wakeups.
constexpr milliseconds kTick{250};
// After SIGKILL a process normally vanishes at once; one stuck in the kernel is given up on after this.
constexpr milliseconds kKillWait{10000};
// A child that has not exec'd by then is treated as failed to start.
constexpr milliseconds kExecWait{10000};
std::string signalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

std::string describeExit(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), signalName(WTERMSIG(status)));
  }
  return fmt::format("ended with wait status {:#x}", status);
}

// The shell's convention, which is also what the launcher's caller sees.
int exitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::pair<Fd, Fd> makePipe() {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) throw IoError(fmt::format("pipe2(): {}", strerror(errno)));
  return {Fd(p[0]), Fd(p[1])};
}

struct Spec {
  std::string name;    // "rank 3" or "server 0", used in messages
  std::string prefix;  // "[rank 3]: "
  bool is_worker = true;
  std::vector<std::string> env;  // NAME=value, complete
  // --redirects / --tee (Streams bits) and, when either is set, the directory of the log files.
  int redirect = kNoStreams;
  int tee = kNoStreams;
  std::string log_dir{};
};

// A child stream's OutputPipe: to the console unless redirected (and not teed), to
// <log_dir>/<file_name> when redirected or teed.
OutputPipe makeOutput(Fd read_end, const Spec& spec, int stream, int console, const char* file_name,
                      bool prefixed) {
  Fd file;
  if ((spec.redirect | spec.tee) & stream) file = openLogFile(spec.log_dir + "/" + file_name);
  bool to_console = !(spec.redirect & stream) || (spec.tee & stream);
  return OutputPipe(std::move(read_end), to_console ? console : -1, spec.prefix, prefixed, std::move(file));
}

// One child process, the leader of its own process group so that a signal reaches whatever it
// started too (bash defers its traps until its foreground child exits). Destroying a Child that is
// still running kills its group and reaps it.
class Child {
 public:
  Child(const Spec& spec, const std::vector<std::string>& command, const sigset_t& child_mask, bool prefixed)
      : name_(spec.name), is_worker_(spec.is_worker) {
    // Everything the child needs is built before fork(): the store's thread may hold malloc's lock,
    // so the child may only make async-signal-safe calls.
    std::vector<char*> argv, envp;
    for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);

    auto [out_r, out_w] = makePipe();
    auto [err_r, err_w] = makePipe();
    // Reports exec()'s errno; closed without a word (CLOEXEC) when exec succeeds.
    auto [status_r, status_w] = makePipe();
    const pid_t parent = ::getpid();
    // The log files are opened before there is a process to clean up if that fails.
    out_.emplace(makeOutput(std::move(out_r), spec, kOut, STDOUT_FILENO, "stdout.log", prefixed));
    err_.emplace(makeOutput(std::move(err_r), spec, kErr, STDERR_FILENO, "stderr.log", prefixed));

    pid_ = ::fork();
    if (pid_ < 0) throw IoError(fmt::format("fork() for {}: {}", name_, strerror(errno)));
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the launcher died before prctl took effect
      redirect(out_w.get(), STDOUT_FILENO);
      redirect(err_w.get(), STDERR_FILENO);
      // Like Python's subprocess (close_fds): the worker inherits nothing but stdio. Unavailable on
      // old kernels, where the launcher's own fds are CLOEXEC anyway.
      ::close_range(3, ~0u, CLOSE_RANGE_CLOEXEC);
      ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
      ::execvpe(argv[0], argv.data(), envp.data());
      int err = errno;
      (void)!::write(status_w.get(), &err, sizeof err);
      ::_exit(127);
    }
    // Also here, so the group exists before the parent signals it, whoever runs first.
    ::setpgid(pid_, pid_);
    out_w.reset();
    err_w.reset();
    status_w.reset();
    try {
      waitForExec(status_r, command[0]);
    } catch (...) {
      // No destructor runs for a half-built Child: reap it here.
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      throw;
    }
  }

  ~Child() {
    if (running()) {
      signalGroup(SIGKILL);
      auto deadline = Clock::now() + kKillWait;
      while (running() && !reap() && Clock::now() < deadline) {
        std::this_thread::sleep_for(milliseconds(10));
      }
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  const std::string& name() const { return name_; }
  pid_t pid() const { return pid_; }
  bool isWorker() const { return is_worker_; }
  bool running() const { return !status_.has_value(); }
  bool failed() const { return status_ && *status_ != 0; }
  int status() const { return *status_; }
  OutputPipe& out() { return *out_; }
  OutputPipe& err() { return *err_; }

  // True when the child has just exited; its remaining output is forwarded then.
  bool reap() {
    if (!running()) return false;
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == 0 || (r < 0 && errno == EINTR)) return false;
    status_ = r == pid_ ? st : (127 << 8);  // ECHILD: someone else reaped it; call it failed
    out_->finish();
    err_->finish();
    return true;
  }

  // The group outlives its leader while a grandchild lives, and its id cannot be reused until then,
  // so this is safe to call shortly after the leader exits too.
  void signalGroup(int sig) const {
    if (::kill(-pid_, sig) != 0 && running()) ::kill(pid_, sig);
  }

 private:
  static void redirect(int from, int to) {
    if (from == to) {
      ::fcntl(to, F_SETFD, 0);
    } else {
      ::dup2(from, to);
    }
  }

  void waitForExec(const Fd& status_r, const std::string& program) {
    pollfd pfd{status_r.get(), POLLIN, 0};
    auto deadline = comm::net::deadlineAfter(kExecWait);
    int n;
    while ((n = ::poll(&pfd, 1, comm::net::msUntil(deadline))) < 0 && errno == EINTR) {
    }
    if (n == 0) throw TimeoutError(fmt::format("{} did not start within {} ms", name_, kExecWait.count()));
    int err = 0;
    ssize_t r;
    while ((r = ::read(status_r.get(), &err, sizeof err)) < 0 && errno == EINTR) {
    }
    if (r == sizeof err) {
      throw Error(fmt::format("cannot execute '{}' for {}: {}", program, name_, strerror(err)));
    }
  }

  std::string name_;
  bool is_worker_;
  pid_t pid_ = -1;
  std::optional<int> status_;
  std::optional<OutputPipe> out_, err_;
};

// NAME=value strings: the launcher's environment with `vars` applied (nullopt removes a name).
std::vector<std::string> buildEnv(const std::map<std::string, std::optional<std::string>>& vars) {
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    std::string name = eq ? std::string(*e, static_cast<size_t>(eq - *e)) : std::string(*e);
    if (!vars.count(name)) env.emplace_back(*e);
  }
  for (const auto& [name, value] : vars) {
    if (value) env.push_back(name + "=" + *value);
  }
  return env;
}

}  // namespace

// Blocks the signals the launcher handles and turns them into readable bytes on a signalfd, so the
// poll loop sees them and no work happens in a signal handler. SIGPIPE is blocked too, so writing to
// a closed stdout returns EPIPE instead of killing the supervisor of the workers.
class SignalWatcher {
 public:
  SignalWatcher() {
    sigemptyset(&handled_);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE}) sigaddset(&handled_, s);
    if (::pthread_sigmask(SIG_BLOCK, &handled_, &original_) != 0) {
      throw Error("pthread_sigmask() failed");
    }
    fd_ = Fd(::signalfd(-1, &handled_, SFD_NONBLOCK | SFD_CLOEXEC));
    if (!fd_.valid()) {
      ::pthread_sigmask(SIG_SETMASK, &original_, nullptr);
      throw IoError(fmt::format("signalfd(): {}", strerror(errno)));
    }
  }
  ~SignalWatcher() {
    read();  // consume what is pending, or unblocking would deliver it with its default action
    fd_.reset();
    ::pthread_sigmask(SIG_SETMASK, &original_, nullptr);
  }
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

  int fd() const { return fd_.get(); }
  // What children start with: the mask the launcher itself started with.
  const sigset_t& originalMask() const { return original_; }

  std::vector<int> read() {
    std::vector<int> sigs;
    signalfd_siginfo info;
    while (::read(fd_.get(), &info, sizeof info) == sizeof info)
      sigs.push_back(static_cast<int>(info.ssi_signo));
    return sigs;
  }

 private:
  sigset_t handled_;
  sigset_t original_;
  Fd fd_;
};

namespace {
// A usage problem is reported as the user's mistake, without the source location DTRAIN_CHECK adds.
template <typename... Args>
void require(bool ok, fmt::format_string<Args...> f, Args&&... args) {
  if (!ok) throw InvalidArgument(fmt::format(f, std::forward<Args>(args)...));
}
}  // namespace

void checkOptions(const Options& o) {
  require(!o.command.empty(), "missing PROGRAM to run");
  require(o.nproc_per_node >= 1, "--nproc-per-node must be at least 1, got {}", o.nproc_per_node);
  require(o.nnodes >= 1, "--nnodes must be at least 1, got {}", o.nnodes);
  require(int64_t{o.nnodes} * o.nproc_per_node <= (1 << 20),
          "--nnodes x --nproc-per-node is too large ({} x {})", o.nnodes, o.nproc_per_node);
  require(o.node_rank >= 0 && o.node_rank < o.nnodes,
          "--node-rank must be in [0, {}) for --nnodes {}, got {}", o.nnodes, o.nnodes, o.node_rank);
  require(o.master_port >= 0 && o.master_port <= 65535, "--master-port must be in [0, 65535], got {}",
          o.master_port);
  require(o.master_port != 0 || o.nnodes == 1,
          "--master-port 0 (a free port) needs --nnodes 1: other nodes could not learn the port");
  require(!o.master_addr.empty(), "--master-addr is empty");
  require(!o.standalone || (o.nnodes == 1 && o.node_rank == 0),
          "--standalone runs a single node; it cannot be combined with --nnodes {} --node-rank {}", o.nnodes,
          o.node_rank);
  require(o.max_restarts >= 0, "--max-restarts must be >= 0, got {}", o.max_restarts);
  if (o.elastic()) checkElasticOptions(o);
  require(o.num_servers >= 0, "--servers must be >= 0, got {}", o.num_servers);
  require(o.grace_period.count() >= 0, "--grace-period must be >= 0");
  require(o.hang_timeout.count() >= 0, "--hang-timeout must be >= 0");
  for (const auto& [flag, text] : {std::pair{"--redirects", o.redirects}, std::pair{"--tee", o.tee}}) {
    StreamSpec spec = parseStreamSpec(flag, text);
    require(spec.largestRank() < o.nproc_per_node, "{} '{}' names local rank {}, but --nproc-per-node is {}", flag,
            text, spec.largestRank(), o.nproc_per_node);
  }
}

Launcher::Launcher(Options opts) : opts_(std::move(opts)), signals_(std::make_unique<SignalWatcher>()) {
  checkOptions(opts_);
  if (opts_.elastic()) {
    setUpElastic();
  } else if (opts_.standalone) {
    opts_.master_addr = "127.0.0.1";
    store_ = std::make_unique<comm::TcpStoreServer>(opts_.master_addr, 0, opts_.secret);
  } else if (opts_.node_rank == 0) {
    // Across nodes, listen on every interface: MASTER_ADDR is what the other nodes dial, and a host
    // name can resolve to a loopback address on its own host (Debian's 127.0.1.1).
    std::string host = opts_.master_addr;
    if (opts_.nnodes > 1) host = host.find(':') != std::string::npos ? "::" : "0.0.0.0";
    store_ = std::make_unique<comm::TcpStoreServer>(host, static_cast<uint16_t>(opts_.master_port), opts_.secret);
  }
  master_port_ = store_ ? store_->port() : static_cast<uint16_t>(opts_.master_port);
  if (parseStreamSpec("--redirects", opts_.redirects).any() || parseStreamSpec("--tee", opts_.tee).any()) {
    run_log_dir_ = makeRunLogDir(opts_.log_dir, opts_.node_rank);
    say("log directory set to {}", run_log_dir_);
  } else if (!opts_.log_dir.empty()) {
    say("--log-dir {} is unused: nothing is redirected (see --redirects and --tee)", opts_.log_dir);
  }
  if (opts_.hang_timeout.count() > 0) {
    // The user's DTRAIN_FLIGHT_DIR (a shared file system gathers every node's dumps), else this run's.
    const char* user = std::getenv("DTRAIN_FLIGHT_DIR");
    const std::string run_dir = run_log_dir_.empty() ? makeRunLogDir("", opts_.node_rank) : run_log_dir_;
    flight_dir_ = user && *user ? user : run_dir + "/flight";
    makeDir(flight_dir_);
    say("flight-recorder dumps go to {}/attempt_<restart>", flight_dir_);
  }
}

Launcher::~Launcher() = default;

int Launcher::run() {
  if (opts_.elastic()) return runElastic();
  if (opts_.nnodes == 1) {  // restarted workers can resume from the snapshots this agent keeps
    snapshot_store_ = std::make_unique<comm::TcpStoreServer>("127.0.0.1", 0, opts_.secret);
    opts_.snapshot_stores = fmt::format("127.0.0.1:{}", snapshot_store_->port());
  }
  for (int restart = 0;; ++restart) {
    Outcome o = runOnce(restart);
    if (!o.restartable) return o.exit_code;
    if (restart >= opts_.max_restarts) {
      if (opts_.max_restarts > 0) {
        say("no restarts left (--max-restarts {}); exiting with code {}", opts_.max_restarts, o.exit_code);
      }
      return o.exit_code;
    }
    say("restarting workers (restart {} of {})", restart + 1, opts_.max_restarts);
  }
}

namespace {

// What every child of one attempt runs with: its name, environment and where its output goes.
std::vector<Spec> childSpecs(const Options& o, uint16_t master_port, const std::string& run_log_dir, int restart,
                             const HangWatch* hang) {
  const int world = o.nnodes * o.nproc_per_node;
  const int servers = o.node_rank == 0 ? o.num_servers : 0;

  std::map<std::string, std::optional<std::string>> common = {
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"GROUP_RANK", std::to_string(o.node_rank)},
      {"DTRAIN_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"DTRAIN_USE_AGENT_STORE", "1"},
  };
  // One compute thread per process when several share the host, unless the user chose otherwise.
  if (!std::getenv("OMP_NUM_THREADS")) common["OMP_NUM_THREADS"] = "1";
  // A pipe makes stdout block-buffered: what a worker printed would be lost when it is stopped.
  // dtrain's library makes stdout line-buffered when this is 1 (src/comm/rendezvous/init.cc).
  if (!std::getenv("DTRAIN_LINE_BUFFERED")) common["DTRAIN_LINE_BUFFERED"] = "1";
  if (o.job_secret) common["DTRAIN_SECRET"] = o.secret;  // (made by --job-secret)
  if (!o.snapshot_stores.empty()) common["DTRAIN_SNAPSHOT_STORES"] = o.snapshot_stores;

  const StreamSpec redirects = parseStreamSpec("--redirects", o.redirects);
  const StreamSpec tee = parseStreamSpec("--tee", o.tee);
  std::string attempt_dir;
  if (!run_log_dir.empty()) {
    attempt_dir = fmt::format("{}/attempt_{}", run_log_dir, restart);
    makeDir(attempt_dir);
  }
  // Sets where a child's streams go, creating its log directory when it has files.
  auto routeOutput = [&](Spec& spec, int redirect, int teed, const std::string& subdir) {
    spec.redirect = redirect;
    spec.tee = teed;
    if ((redirect | teed) == kNoStreams) return;
    spec.log_dir = attempt_dir + "/" + subdir;
    makeDir(spec.log_dir);
  };

  std::vector<Spec> specs;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    int rank = o.node_rank * o.nproc_per_node + local;
    auto vars = common;
    vars["RANK"] = std::to_string(rank);
    vars["LOCAL_RANK"] = std::to_string(local);
    vars["WORLD_SIZE"] = std::to_string(world);
    vars["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc_per_node);
    vars["DTRAIN_ROLE"] = "worker";
    if (o.gpu_per_worker)
      vars["CUDA_VISIBLE_DEVICES"] = o.gpu_ids.empty() ? std::to_string(local) : o.gpu_ids[local % o.gpu_ids.size()];
    if (hang)
      for (const auto& [name, value] : hang->envFor(rank)) vars[name] = value;
    if (o.num_servers > 0) {
      vars["DTRAIN_NUM_SERVERS"] = std::to_string(o.num_servers);
      vars["DTRAIN_NUM_WORKERS"] = std::to_string(world);
      vars["DTRAIN_NUM_NODES"] = std::to_string(o.nnodes);
    }
    specs.push_back({fmt::format("rank {}", rank), fmt::format("[rank {}]: ", rank), true, buildEnv(vars)});
    routeOutput(specs.back(), redirects.forLocalRank(local), tee.forLocalRank(local), std::to_string(local));
  }
  for (int i = 0; i < servers; ++i) {
    auto vars = common;
    // A server is not a rank of the workers' world; an inherited RANK would only mislead it.
    for (const char* v : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}) vars[v] = std::nullopt;
    vars["DTRAIN_ROLE"] = "server";
    vars["DTRAIN_SERVER_INDEX"] = std::to_string(i);
    vars["DTRAIN_NUM_SERVERS"] = std::to_string(o.num_servers);
    vars["DTRAIN_NUM_WORKERS"] = std::to_string(world);
    vars["DTRAIN_NUM_NODES"] = std::to_string(o.nnodes);
    specs.push_back({fmt::format("server {}", i), fmt::format("[server {}]: ", i), false, buildEnv(vars)});
    routeOutput(specs.back(), redirects.forServer(), tee.forServer(), fmt::format("server{}", i));
  }
  return specs;
}

// How supervising one attempt's children ended: the signal that stopped the launcher, or the exit
// code of the first child that failed (neither: every child succeeded).
struct Ending {
  int stop_signal = 0;
  std::optional<int> failure_code;
  std::string ended_by;  // what `poll` said
};

// Pumps the children's output and follows them until none runs: forwards signals, stops the others
// when one fails, stops servers left running after the workers finished, escalates to SIGKILL.
Ending superviseChildren(std::vector<std::unique_ptr<Child>>& kids, SignalWatcher& signals,
                         milliseconds grace_period, HangWatch* hang, const std::function<std::string()>& poll) {
  auto anyRunning = [&](auto pred) {
    return std::any_of(kids.begin(), kids.end(), [&](const auto& k) { return k->running() && pred(*k); });
  };
  auto all = [](const Child&) { return true; };
  auto signalRunning = [&](int sig) {
    for (auto& k : kids) {
      if (k->running()) k->signalGroup(sig);
    }
  };

  // The shutdown, once begun: SIGTERM sent (kill at term_deadline), then SIGKILL (give up at kill_deadline).
  std::optional<Clock::time_point> term_deadline, kill_deadline;
  // All workers succeeded; servers may finish on their own until then.
  std::optional<Clock::time_point> drain_deadline;
  std::optional<int> failure_code;
  int stop_signal = 0;
  std::string ended_by;
  auto stopping = [&] { return term_deadline.has_value(); };
  auto beginStop = [&](int sig) {
    signalRunning(sig);
    term_deadline = Clock::now() + grace_period;
  };

  std::vector<pollfd> pfds;
  std::vector<OutputPipe*> pipes;
  while (anyRunning(all)) {
    auto now = Clock::now();
    auto wake = now + kTick;
    for (const auto& d : {drain_deadline, term_deadline, kill_deadline}) {
      if (d) wake = std::min(wake, *d);
    }
    pfds.assign(1, pollfd{signals.fd(), POLLIN, 0});
    pipes.assign(1, nullptr);
    for (auto& k : kids) {
      for (OutputPipe* p : {&k->out(), &k->err()}) {
        if (!p->open()) continue;
        pfds.push_back(pollfd{p->fd(), POLLIN, 0});
        pipes.push_back(p);
      }
    }
    int timeout_ms = static_cast<int>(
        std::max<int64_t>(0, std::chrono::duration_cast<milliseconds>(wake - now).count() + 1));
    if (::poll(pfds.data(), pfds.size(), timeout_ms) < 0 && errno != EINTR) {
      throw IoError(fmt::format("poll(): {}", strerror(errno)));
    }
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (pfds[i].revents != 0) pipes[i]->pump();
    }

    for (int sig : signals.read()) {
      if (sig == SIGCHLD || sig == SIGPIPE) continue;
      if (stop_signal == 0) {
        stop_signal = sig;
        say("received {}; forwarding it to the workers", signalName(sig));
        signalRunning(sig);
        if (!stopping()) term_deadline = Clock::now() + grace_period;
      } else if (!kill_deadline) {
        say("received {} again; killing the workers", signalName(sig));
        signalRunning(SIGKILL);
        kill_deadline = Clock::now() + kKillWait;
      }
    }

    if (poll && !stopping()) {
      ended_by = poll();
      if (!ended_by.empty()) beginStop(SIGTERM);
    }
    if (hang && !stopping() && hang->poll(Clock::now())) {
      failure_code = HangWatch::kExitCode;
      say("stopping the workers of the hung job");
      beginStop(SIGTERM);
    }

    for (auto& k : kids) {
      if (!k->reap() || !k->failed() || stopping()) continue;
      failure_code = exitCodeOf(k->status());
      bool others = anyRunning(all);
      say("{} (pid {}) {}{}", k->name(), k->pid(), describeExit(k->status()),
          others ? "; stopping the other workers" : "");
      beginStop(SIGTERM);
    }

    now = Clock::now();
    if (!stopping() && !drain_deadline && !anyRunning([](const Child& k) { return k.isWorker(); }) &&
        anyRunning(all)) {
      drain_deadline = now + grace_period;
    }
    if (!stopping() && drain_deadline && now >= *drain_deadline) {
      say("all workers finished; stopping the servers still running");
      beginStop(SIGTERM);
    }
    if (stopping() && !kill_deadline && now >= *term_deadline) {
      for (auto& k : kids) {
        if (!k->running()) continue;
        say("{} (pid {}) still running {:g}s after SIGTERM; sending SIGKILL", k->name(), k->pid(),
            grace_period.count() / 1000.0);
      }
      signalRunning(SIGKILL);
      kill_deadline = now + kKillWait;
    }
    if (kill_deadline && now >= *kill_deadline) {
      say("some workers did not die {} ms after SIGKILL; giving up on them", kKillWait.count());
      break;
    }
  }
  if (stopping()) {
    // Whatever the workers left behind in their groups (background jobs, processes that ignore
    // SIGTERM and outlived their leader) goes too.
    for (auto& k : kids) k->signalGroup(SIGKILL);
  }
  return {stop_signal, failure_code, ended_by};
}

}  // namespace

Launcher::Outcome Launcher::runOnce(int restart, const std::function<std::string()>& poll) {
  std::optional<HangWatch> hang;
  if (opts_.hang_timeout.count() > 0) {
    std::vector<int> ranks;
    for (int local = 0; local < opts_.nproc_per_node; ++local)
      ranks.push_back(opts_.node_rank * opts_.nproc_per_node + local);
    hang.emplace(opts_.hang_timeout, fmt::format("{}/attempt_{}", flight_dir_, restart), ranks);
  }
  std::vector<std::unique_ptr<Child>> kids;
  for (const auto& spec : childSpecs(opts_, master_port_, run_log_dir_, restart, hang ? &*hang : nullptr)) {
    kids.push_back(
        std::make_unique<Child>(spec, opts_.command, signals_->originalMask(), opts_.prefix_output));
  }
  // Workers come first, in rank order.
  for (int local = 0; hang && local < opts_.nproc_per_node; ++local)
    hang->watch(opts_.node_rank * opts_.nproc_per_node + local, kids[static_cast<size_t>(local)]->pid());
  const Ending e = superviseChildren(kids, *signals_, opts_.grace_period, hang ? &*hang : nullptr, poll);
  if (hang && hang->declared()) hang->printDiagnosis();
  if (e.stop_signal != 0) return {128 + e.stop_signal, false, ""};
  if (!e.ended_by.empty()) return {0, true, e.ended_by};
  if (e.failure_code) return {*e.failure_code, true, ""};
  return {0, false, ""};
}

}  // namespace dtrain::run
