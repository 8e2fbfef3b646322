/// @file
/// Checkpoints kept in peers' memory (in-memory snapshots), beside the disk checkpoints of checkpoint.h.
/// Every N steps each rank captures its training state and hands it to a PeerSnapshots, which sends it,
/// in the background while training goes on, to the memory of dtrain-run agents: this node's and the
/// next node's. Agents outlive their workers' rounds (dtrain-run --nnodes MIN:MAX stops and restarts the
/// workers at every membership change), so after a failure the new round restores from memory when every
/// piece of the newest snapshot survived somewhere, and from the newest disk checkpoint otherwise.
///
/// \code
///   dtrain::PeerSnapshots snaps(dist);                           // replicated (DDP): every rank holds the same state
///   if (auto snap = snaps.loadLatest()) {                        // collective; nullopt when not under dtrain-run
///     snap->parts[0].restoreModel(*model);                       // replicated: the one state
///     snap->parts[0].restoreOptimizer(opt);
///     start = snap->step;
///   }
///   ...
///   if (step % every == 0) {
///     dtrain::CheckpointState s;  s.captureModel(*model);  ...   // a copy: training may change the model now
///     snaps.save(std::move(s));                                  // returns at once; sent in the background
///   }
/// \endcode
///
/// Two layouts:
///  - replicated (DDP, DataParallel): one state serves every rank. Local rank 0 of every node stores it in
///    its own node's agent, so every surviving node holds a copy; loading takes any copy (a broadcast).
///  - sharded (ZeRO, FSDP, pipeline stages): rank r's part differs from the others'. Every rank stores its
///    part in its own node's agent and the next node's (node + 1 mod nodes), so a part survives the loss
///    of any one node. Loading returns every old rank's part, for the caller to reshard at the new world
///    size (ZeroRedundancyOptimizer::restoreSharded, FullyShardedDataParallel::restoreSharded).
///
/// A snapshot is identified by the round that took it (DTRAIN_RESTART_COUNT) and its step; it is
/// complete when the parts of all its world size's ranks can be read from the stores reachable now. The
/// newest complete one wins (greatest step, then round). Each writer keeps its two newest snapshots per
/// store and deletes older ones, so a failure in the middle of a send leaves the previous one whole;
/// loadLatest() deletes every snapshot but the one it chose (the others cannot become complete). Memory
/// per agent: that one, plus two snapshots of each rank that writes to it (replicated: two states per node).
///
/// Where the stores are: DTRAIN_SNAPSHOT_STORES, "host:port,host:port,..." by node (dtrain-run sets it
/// for its workers; each agent serves one store, authenticated with the job secret when there is one);
/// this rank's node is Distributed::info().node. Without the variable, enabled() is false and save() and
/// loadLatest() do nothing. The stores' keys are documented in src/torch/snapshot.cc.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/checkpoint.h"

namespace dtrain {

class Distributed;

/// Options of PeerSnapshots.
struct SnapshotOptions {
  /// true: every rank's state is the same (DDP); false: each rank's part differs (sharded).
  bool replicated = true;
  /// "host:port,..." by node; empty: DTRAIN_SNAPSHOT_STORES.
  std::string stores;
  /// The round this run is (snapshots are told apart by round and step); -1: DTRAIN_RESTART_COUNT (0 unset).
  int64_t round = -1;
  /// Bounds every store request (connecting included): a store that does not answer is an Error naming it.
  std::chrono::milliseconds timeout{30000};
};

/// What loadLatest() found.
struct Snapshot {
  int64_t round = 0;        ///< the round (DTRAIN_RESTART_COUNT) whose workers took it
  int64_t step = 0;         ///< CheckpointState::step of its parts
  int world_size = 0;       ///< the world size that took it
  /// replicated: one state; sharded: old rank r's part at index r, r in [0, world_size).
  std::vector<CheckpointState> parts;
  std::vector<std::string> sources;  ///< per part: "host:port" of the store it was read from
};

/// Checkpoints sent in the background to the memory of dtrain-run agents (this node's and the next
/// node's), to restart from after a failure (see the file's description).
class PeerSnapshots {
 public:
  /// Connects to the stores (lazily, on first use). InvalidArgument naming the variable when the store
  /// list is malformed, or has fewer entries than the world has nodes.
  explicit PeerSnapshots(const Distributed& dist, SnapshotOptions o = {});
  ~PeerSnapshots();  ///< waits for the send in flight (bounded by the timeout)
  PeerSnapshots(const PeerSnapshots&) = delete;
  PeerSnapshots& operator=(const PeerSnapshots&) = delete;

  /// True when stores are configured (SnapshotOptions::stores or DTRAIN_SNAPSHOT_STORES).
  bool enabled() const;
  /// Whether this rank stores snapshots (replicated: local rank 0 of each node; sharded: every rank). Call
  /// save() on the other ranks too (it returns at once): the capture can then be skipped with writes().
  bool writes() const;

  /// Waits for the previous snapshot's sends to finish, then starts sending `state` (which it now owns)
  /// from a background thread and returns. An Error of the previous send (a store that failed) is thrown
  /// here, naming the store. Not collective.
  void save(CheckpointState state);
  /// Waits for the send in flight, if any; throws its Error.
  void flush();

  /// Collective over the world: the newest complete snapshot of the stores reachable now (every rank gets
  /// the same one: rank 0 chooses, and deletes the others), or nullopt when there is none. Parts of another world size are
  /// returned as they are. Error naming the store when one that holds a chosen part cannot be read.
  std::optional<Snapshot> loadLatest();

  /// Cost, for reports: snapshots sent; seconds the training thread spent in save() (waiting for the
  /// previous send included); seconds the background thread spent pickling and sending; bytes of the last
  /// snapshot (per copy).
  struct Stats {
    int64_t snapshots = 0;  ///< snapshots sent
    ///@{
    /// Seconds the training thread spent in save() (waiting for the previous send included), and seconds
    /// the background thread spent pickling and sending.
    double save_seconds = 0, send_seconds = 0;
    ///@}
    int64_t last_bytes = 0;  ///< bytes of the last snapshot (per copy)
  };
  /// The costs so far.
  Stats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
