// Starting the timeline (internal): initWorld() reads the configuration with the rest of the
// environment and, once the world group exists, calls startWorld().
#pragma once
#include <cstdint>
#include <string>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::trace::timeline {

struct Config {
  std::string dir;      // DTRAIN_TIMELINE; empty: off
  int64_t skew_us = 0;  // DTRAIN_TIMELINE_SKEW_US, a test hook: added to every timestamp this rank writes
};
Config configFrom(const rendezvous::Environment& env);

// Every rank of the world calls it (store null in a world of one). The ranks say through the store
// whether their timeline is on; a rank whose timeline is on measures its clock's offset to rank 0's
// (NTP-style ping-pong over the world group's send/recv, the round with the shortest round trip) and
// opens DIR/trace-rank<R>.json. Errors name the rank and the file. A process whose timeline is already
// open (a second initWorld()) keeps writing it.
void startWorld(const Config& c, ProcessGroup& world, Store* store, const std::string& host);

}  // namespace dtrain::comm::trace::timeline
