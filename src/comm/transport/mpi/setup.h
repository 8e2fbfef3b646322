// The MPI transport's set-up (transport.cc): MPI initialised once per process, and each rank's MPI
// identity checked through the group's store. The C API only (OMPI_SKIP_MPICXX).
#pragma once
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <mutex>
#include <string>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::comm::transport {

// Every MPI call of dtrain is made under this process-wide mutex.
std::mutex& mpiMutex();
// MPI's text for an error code.
std::string mpiError(int rc);
// Initialises MPI once per process unless the program did (MPI_THREAD_MULTIPLE asked, SERIALIZED
// needed), and finalises it at exit if dtrain did.
void ensureMpi();
// Reads every member's "world-rank world-size host" (published under mpi/world/<rank>) into `world` and
// `names`, and checks the ranks are distinct processes of one MPI job of `ws` processes.
void findMembers(Store& store, int rank, int size, int ws, std::vector<int>& world, std::vector<std::string>& names);

}  // namespace dtrain::comm::transport
