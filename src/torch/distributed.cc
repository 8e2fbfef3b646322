// Process context and zeroFirst (see distributed.h).
#include "dtrain/distributed.h"

#include <cstdint>
#include <exception>
#include <string>

#include "dtrain/comm/error.h"

namespace dtrain {

Distributed init(comm::InitOptions opts) {
  comm::WorldInfo info;
  auto world = comm::initWorld(opts, &info);
  // The ranks agreed on who is on which node at rendezvous; every rank takes part in every node's group.
  auto local = comm::newNodeGroup(world, info);
  return Distributed(world, local, info);
}

void zeroFirst(const Distributed& dist, const std::function<void()>& fn, bool local) {
  auto& pg = local ? *dist.local() : *dist.world();
  if (pg.size() == 1) {
    fn();
    return;
  }
  // Rank 0 runs first and then tells the others whether it succeeded; they wait in a broadcast that
  // has the group's deadline, so a rank 0 that dies or hangs fails them instead of blocking them.
  // Anything rank 0 throws (not only std::exception) must reach the broadcast, or the others would
  // sit in it until the deadline; rank 0 then rethrows its own exception, type intact.
  std::exception_ptr failure;
  std::string error;
  if (pg.rank() == 0) {
    try {
      fn();
    } catch (const std::exception& e) {
      failure = std::current_exception();
      error = e.what();
    } catch (...) {
      failure = std::current_exception();
      error = "a non-std exception";
    }
  }
  // status: 0 when rank 0 succeeded, else 1 + the length of its (bounded) message, sent next so the
  // other ranks can say why they did not run.
  constexpr size_t kMaxMessage = 1024;
  if (error.size() > kMaxMessage) error.resize(kMaxMessage);
  int32_t status = failure ? static_cast<int32_t>(1 + error.size()) : 0;
  try {
    pg.broadcast(&status, 1, comm::DType::i32, 0)->wait();
    if (status != 0) {
      error.resize(static_cast<size_t>(status - 1));
      pg.broadcast(error.data(), error.size(), comm::DType::u8, 0)->wait();
    }
  } catch (...) {
    if (failure) std::rethrow_exception(failure);  // rank 0's own error says more than a peer's
    throw;
  }
  if (failure) std::rethrow_exception(failure);
  if (status != 0) {
    throw Error(fmt::format("[rank {}] zeroFirst: rank 0 of the {} group failed first ({}); not running here",
                            dist.rank(), local ? "node's" : "world", error));
  }
  if (pg.rank() != 0) fn();
}

}  // namespace dtrain
