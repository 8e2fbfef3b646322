// The MPI transport's set-up: see setup.h.
#include "comm/transport/mpi/setup.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::transport {

std::mutex& mpiMutex() {
  static std::mutex m;
  return m;
}

std::string mpiError(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(msg, static_cast<size_t>(len));
}

void ensureMpi() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::lock_guard<std::mutex> g(mpiMutex());
    int inited = 0;
    MPI_Initialized(&inited);
    int provided = 0;
    if (!inited) {
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw IoError("mpi transport: MPI_Init_thread failed: " + mpiError(rc));
      std::atexit([] {
        std::lock_guard<std::mutex> g2(mpiMutex());
        int done = 0;
        MPI_Finalized(&done);
        if (!done) MPI_Finalize();
      });
    } else {
      MPI_Query_thread(&provided);
    }
    // Collectives run on each group's own thread: calls from several threads, one at a time.
    if (provided < MPI_THREAD_SERIALIZED) {
      throw InvalidArgument(fmt::format(
          "mpi transport: MPI provides thread level {} but dtrain calls MPI from its groups' threads: "
          "initialise MPI with MPI_Init_thread(..., MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE, ...)",
          provided));
    }
  });
}

void findMembers(Store& store, int rank, int size, int ws, std::vector<int>& world, std::vector<std::string>& names) {
  for (int p = 0; p < size; ++p) {
    std::string v = toString(store.get(fmt::format("mpi/world/{}", p)));
    int wr = -1, their_ws = -1;
    char host[MPI_MAX_PROCESSOR_NAME + 1] = {0};
    if (std::sscanf(v.c_str(), "%d %d %256s", &wr, &their_ws, host) < 2) {
      throw ProtocolError(fmt::format("[rank {}] mpi transport: rank {} published '{}'", rank, p, v));
    }
    world[p] = wr;
    names[p] = host;
    for (int q = 0; q < p; ++q) {
      if (world[q] == wr || their_ws != ws) {
        throw InvalidArgument(fmt::format(
            "[rank {}] mpi transport: ranks {} and {} are not distinct processes of one MPI job (MPI_COMM_WORLD "
            "rank {} of {} and rank {} of {}): DTRAIN_TRANSPORT=mpi needs every rank started by one mpirun "
            "(or srun --mpi=pmix), not by dtrain-run or by hand",
            rank, q, p, world[q], ws, wr, their_ws));
      }
    }
  }
}

}  // namespace dtrain::comm::transport
