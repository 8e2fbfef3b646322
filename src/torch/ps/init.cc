// ps::init (see ps.h): a parameter-server job's roles and sizes from the environment, with a world
// of one (a colocated server) when no launcher variables are set, like dtrain::init().
#include <algorithm>
#include <string>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"
#include "dtrain/distributed.h"
#include "dtrain/ps.h"
#include "env.h"

namespace dtrain::ps {

Job::~Job() = default;

void Job::join() {
  if (colocated_) colocated_->join();
}

LocalAggregation Job::localAggregation() const {
  DTRAIN_CHECK(!server_, InvalidArgument, "ps::Job::localAggregation: this process is a server");
  return LocalAggregation{local_, rank_ / local_size_, num_nodes_};
}

namespace {
// The store of the job's worker, after checking that the Job can have a plain Worker.
const std::shared_ptr<comm::Store>& workerStore(const Job& job, const PSOptions& opts) {
  DTRAIN_CHECK(!job.isServer(), InvalidArgument,
               "ps::Worker: this process is a server (return from main when job.isServer())");
  DTRAIN_CHECK(!opts.local_aggregation, InvalidArgument,
               "ps::Worker: with local aggregation, construct Worker(job.store(), job.localAggregation(), "
               "job.numServers(), opts)");
  return job.store();
}
}  // namespace

Worker::Worker(const Job& job, PSOptions opts)
    : Worker(workerStore(job, opts), job.rank(), job.numWorkers(), job.numServers(), opts) {}

Job init(PSOptions opts) {
  // The environment is read here, once, for the roles, the world's size and the store (dtrain::init()
  // reads it again for the workers' groups).
  const comm::rendezvous::Environment env = comm::rendezvous::Environment::read();
  Job job;
  if (runServerIfRole(env, opts)) {
    job.server_ = true;
    return job;
  }
  const LaunchRoles roles = launchRoles(env);
  if (roles.num_servers < 0) {
    // No servers were started for us: alone, we host one; in a world of several, that is a mistake.
    const comm::WorldInfo info = comm::rendezvous::detectWorld(env, comm::InitOptions{});
    if (info.size > 1)
      throw RendezvousError(fmt::format(
          "[rank {}] ps::init: a world of {} processes but no parameter servers (DTRAIN_NUM_SERVERS is not set): "
          "start them with dtrain-run --servers S",
          info.rank, info.size));
    const std::string secret = comm::rendezvous::jobSecret(env);
    job.store_server_ = std::make_shared<comm::TcpStoreServer>("127.0.0.1", 0, secret);
    job.store_ = std::make_shared<comm::PrefixStore>(
        "ps", std::make_shared<comm::TcpStore>("127.0.0.1", job.store_server_->port(), opts.timeout, secret));
    job.num_servers_ = 1;
    job.workers_ = job.local_ = comm::ProcessGroup::create(nullptr, 0, 1, comm::rendezvous::groupOptions(env));
    job.colocated_ = std::make_unique<ColocatedServer>(job.store_, 0, 1, 1, opts);
    return job;
  }
  Distributed dist = dtrain::init();
  if (roles.num_workers >= 0 && roles.num_workers != dist.size())
    throw RendezvousError(fmt::format("[rank {}] ps::init: DTRAIN_NUM_WORKERS={} but the world has {} workers "
                                      "(WORLD_SIZE)",
                                      dist.rank(), roles.num_workers, dist.size()));
  job.rank_ = dist.rank();
  job.num_workers_ = dist.size();
  job.num_servers_ = roles.num_servers;
  job.local_rank_ = dist.localRank();
  job.local_size_ = std::max(1, dist.localSize());
  job.num_nodes_ = std::max(1, roles.num_nodes);
  job.workers_ = dist.world();
  job.local_ = dist.local();
  job.store_ = storeFrom(env, opts.timeout);
  return job;
}

}  // namespace dtrain::ps
