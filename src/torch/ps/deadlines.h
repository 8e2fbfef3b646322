// Every deadline of the parameter server, derived from PSOptions::timeout here and nowhere else
// (internal).
#pragma once
#include <algorithm>
#include <chrono>

#include "dtrain/ps.h"

namespace dtrain::ps {

struct Deadlines {
  // A server's wait for other workers: a BSP step's missing pushes, an SSP straggler, a declaration or a
  // restore that worker 0 has not sent yet. Past it the server fails, naming whom it waited for.
  std::chrono::milliseconds server_wait;
  // A worker's sends and receives to a server (the timeout of its 2-rank groups): server_wait plus a
  // grace of max(1 s, timeout / 4), so that the server's more informative timeout error arrives first.
  std::chrono::milliseconds worker_io;
  // A server's wait for a worker's next request: a week. A worker may compute for long between requests;
  // a dead worker is found by the transport at once.
  std::chrono::milliseconds server_idle;
  // A Worker operation's Work: wait() gives up this long after the operation was issued. An operation's
  // own waits are bounded by worker_io, so this fires only when several long ones are queued ahead.
  std::chrono::milliseconds operation;
  // ~ColocatedServer: how long it waits for the workers to say goodbye before it aborts its server.
  std::chrono::milliseconds colocated_shutdown;
  // A failing server's error message to a worker, sent on a best-effort basis.
  std::chrono::milliseconds error_reply;
};

inline Deadlines deadlines(const PSOptions& o) {
  using std::chrono::milliseconds;
  const milliseconds grace = std::max<milliseconds>(std::chrono::seconds(1), o.timeout / 4);
  Deadlines d;
  d.server_wait = o.timeout;
  d.worker_io = o.timeout + grace;
  d.server_idle = std::chrono::hours(24 * 7);
  d.operation = o.timeout * 4;
  d.colocated_shutdown = o.timeout;
  d.error_reply = std::chrono::seconds(2);
  return d;
}

}  // namespace dtrain::ps
