// dtrain-run's elastic membership (--nnodes MIN:MAX): the agents of a job agree, through a rendezvous
// store, on rounds. A round is a numbered set of nodes, between MIN and MAX of them; every agent of a
// round starts its workers with that round's world, heartbeats while they run, and ends the round (for
// everyone) when a node stops heartbeating, a new node waits to join, or a worker fails. Then the agents
// still alive form the next round, and the workers resume from their checkpoints at the new world size.
//
// Keys (under the job's prefix of the rendezvous store; integers are decimal text, as add() keeps them):
//   round             the current round number k (add); the next is agreed with compareSet(k -> k+1)
//   r<k>/count        agents that asked to join round k (add); the i-th to ask is participant i
//   r<k>/node/<i>     participant i's id, address and snapshot store ("id addr host:port")
//   r<k>/closed       the round's size N once it closed (compareSet from missing: one value wins).
//                     Participants i >= N came late and wait for round k+1 (which they cause when N < MAX)
//   r<k>/hb/<i>       participant i's heartbeat counter (add); a counter that stops moving for the
//                     heartbeat timeout (on the observer's clock, so no clocks need agree) is a lost node
//   r<k>/master       host:port of the store the round's workers use, hosted by participant 0's agent
//   r<k>/done         participants whose workers all succeeded; the job ends when it reaches N
//   failures          worker failures over the whole job (--max-restarts counts these, not rounds)
//   failed            set when the job gave up: every agent exits with an error
//
// The store is any dtrain::comm::Store: dtrain-run's own (--rdzv-backend c10d, hosted by the agent on
// the endpoint's host: that host's loss ends the job) or etcd (--rdzv-backend etcd: the store outlives
// any node).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::run {

struct ElasticOptions {
  int min_nodes = 1;
  int max_nodes = 1;
  std::string node_id;   // unique in the job (default: hostname and pid)
  std::string address;   // where this node's agent can be reached (its round store, if participant 0)
  std::string snapshot_store;  // host:port of this agent's store of in-memory snapshots
  std::chrono::milliseconds heartbeat{500};
  std::chrono::milliseconds heartbeat_timeout{5000};
  std::chrono::milliseconds last_call{2000};        // after MIN nodes joined, wait this long for more
  std::chrono::milliseconds join_timeout{600000};   // a round must form within this
};

struct Round {
  int64_t number = 0;
  int node_rank = 0;  // this node's place in the round
  int nnodes = 0;
  std::vector<std::string> nodes;  // "id addr" of each node, by node rank
  std::vector<std::string> snapshot_stores;  // each node's snapshot store (host:port), by node rank
};

class ElasticRendezvous {
 public:
  ElasticRendezvous(std::shared_ptr<comm::Store> store, ElasticOptions opts);

  // Thrown by join() when the job finished while this node waited for a round.
  struct JobFinished {};
  // Joins the next round that forms and returns it; waits (bounded by join_timeout) while a round runs
  // without this node. Throws Error when the job failed meanwhile, JobFinished when it ended, and
  // TimeoutError at the deadline.
  Round join();
  // While the round's workers run, every tick: heartbeats (at most every `heartbeat`) and returns why the
  // round must end ("node 2 (id) sent no heartbeat for 5.0 s", "round 4 was started by another node",
  // "1 node waits to join"), or "" while it may go on.
  std::string poll();
  // Ends the current round for every agent (k -> k+1, unless another agent did first).
  void endRound();
  // Counts a worker failure in this round (once per round, whichever node reports it first); returns the
  // job's failures so far.
  int64_t countFailure();
  // Marks the job failed (every agent's join() and poll() then report `why`).
  void fail(const std::string& why);
  // This node's workers all succeeded; waits (heartbeating, bounded) until every node's did, or until the
  // round ended otherwise. Returns true when the whole job succeeded.
  bool finish();
  // After finish(): the agent that hosts the rendezvous store keeps it up until every node saw the end.
  void waitForAllToLeave(std::chrono::milliseconds patience);
  // The store host:port the round's workers use (participant 0 publishes it: see publishMaster).
  std::string master();
  void publishMaster(const std::string& host_port);
  const Round& round() const { return round_; }
  const ElasticOptions& options() const { return opts_; }

 private:
  int64_t current();
  bool waitForClose(int64_t k, int64_t me, int64_t& size);
  bool waitForNextRound(int64_t k);  // false: the round finished the job
  std::string lostNode();

  std::shared_ptr<comm::Store> store_;
  ElasticOptions opts_;
  Round round_;
  std::chrono::steady_clock::time_point last_beat_{};
  std::map<int, std::pair<int64_t, std::chrono::steady_clock::time_point>> seen_;  // counter, when it moved
};

// The address of this host's interface that routes to `host` (a UDP socket's name after connect()).
std::string routeTo(const std::string& host);

}  // namespace dtrain::run
