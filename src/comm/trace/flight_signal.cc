// SIGUSR1 -> a flight-recorder dump. The handler only writes to an eventfd (async-signal-safe); a
// thread of its own, started with every signal blocked, waits on it and writes the dump.
//
// A user's handler is kept working: the recorder installs its handler when it starts (at the process's
// first op) and calls the handler that was installed before it, if any (a program that set SIGUSR1 to
// SIG_IGN gets dumps instead of nothing). A handler the program installs later replaces the recorder's;
// that program gets no dumps on SIGUSR1, but failures and dtrain-run's hang detection still dump
// (dtrain-run signals only processes whose recorder runs). A child forked after the first op ignores
// the signal in the recorder's handler (the eventfd belongs to its parent's watcher).
#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include "comm/trace/flight_recorder.h"

namespace dtrain::comm::trace::flight {

namespace {

// Written once, before the handler is installed; read by the handler.
int g_event_fd = -1;
pid_t g_owner = 0;
struct sigaction g_previous {};

void onSignal(int sig, siginfo_t* info, void* context) {
  const int saved = errno;
  if (::getpid() == g_owner) {
    const uint64_t one = 1;
    (void)!::write(g_event_fd, &one, sizeof one);
  }
  errno = saved;
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
  }
}

void watch(std::string (*request)()) {
  ::dtrain::trace::setThreadName("flight recorder");
  for (;;) {
    uint64_t n = 0;
    if (::read(g_event_fd, &n, sizeof n) != sizeof n) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "dtrain flight recorder: SIGUSR1 watcher stopped: read(): %s\n", std::strerror(errno));
      return;
    }
    std::string why = request();
    dump(why.empty() ? "SIGUSR1" : why);
  }
}

}  // namespace

void watchSignal(std::string (*request)()) {
  g_event_fd = ::eventfd(0, EFD_CLOEXEC);
  if (g_event_fd < 0) {
    std::fprintf(stderr, "dtrain flight recorder: no dumps on SIGUSR1: eventfd(): %s\n", std::strerror(errno));
    return;
  }
  g_owner = ::getpid();
  // The watcher takes no signal meant for the program's threads.
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &old);
  try {
    std::thread(watch, request).detach();
  } catch (const std::exception& e) {
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    std::fprintf(stderr, "dtrain flight recorder: no dumps on SIGUSR1: %s\n", e.what());
    return;
  }
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  struct sigaction sa {};
  sa.sa_sigaction = onSignal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR1, &sa, &g_previous);
}

}  // namespace dtrain::comm::trace::flight
