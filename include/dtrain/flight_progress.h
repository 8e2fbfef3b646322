/// @file
/// The progress file through which a worker tells its launcher that it is still getting somewhere, and
/// through which the launcher asks it for a flight-recorder dump (docs/OBSERVABILITY.md, "Flight
/// recorder and hang diagnosis"). dtrain-run --hang-timeout S creates one per worker (zero-filled,
/// sizeof(FlightProgress) bytes) and names it in the worker's DTRAIN_FLIGHT_PROGRESS; the worker's
/// flight recorder maps it and counts every op it completes; the launcher reads it every tick:
///
/// \code
///   dtrain::trace::FlightProgress p{};
///   ::pread(fd, &p, sizeof p, 0);
///   if (p.magic == dtrain::trace::FlightProgress::kMagic && p.completed != last_seen) { /* progress */ }
///   // a dump: write the reason into `request` (pwrite at offsetof(FlightProgress, request)), then
///   // kill(p.pid, SIGUSR1) and wait for p.dumps to grow
/// \endcode
///
/// Only what a launcher and a worker of the same dtrain version agree on; not an API for programs.
#pragma once
#include <cstdint>

namespace dtrain::trace {

/// The layout of a worker's progress file, as the launcher and the worker's flight recorder share it.
struct FlightProgress {
  static constexpr uint64_t kMagic = 0x31474f5250544c46;  ///< "FLTPROG1", written once the rest is valid
  uint64_t magic;  ///< kMagic once the worker's recorder has mapped the file; 0 before
  int64_t pid;         ///< the process whose recorder runs: the one to send SIGUSR1
  uint64_t completed;  ///< ops this process has completed (successfully), relaxed atomic increments
  uint64_t dumps;      ///< dumps this process has written
  char request[256];   ///< the launcher's reason for the SIGUSR1 it is about to send, NUL-terminated
};

}  // namespace dtrain::trace
