// Self-tuning (DTRAIN_TUNE): the setting, the cache both tuners share (the allreduce thresholds here,
// DDP's bucket sizes in src/torch/ddp_tune.cc), and the allreduce probe a group runs when it is made.
// Internal; not installed.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/collectives/collectives.h"

namespace dtrain::comm {
class ProcessGroup;
}

namespace dtrain::comm::tune {

enum class Mode { off, on, refresh };
// DTRAIN_TUNE: on (or 1), off (or 0; unset: off), refresh; InvalidArgument naming the variable otherwise.
Mode modeFromEnv();

// The cache file: DTRAIN_TUNE_CACHE, else $XDG_CACHE_HOME/dtrain/tune.tsv, else ~/.cache/dtrain/tune.tsv;
// "" when none of them is set. One line per choice: the key, then tab-separated fields.
std::string cachePath();
// The fields after the key on the last line with this key; nullopt when there is none.
std::optional<std::vector<std::string>> readCache(const std::string& path, const std::string& key);
// Appends the line in one write (lines of concurrent jobs do not interleave); "" or why it could not.
std::string appendCache(const std::string& path, const std::string& key, const std::vector<std::string>& fields);
// This machine's host name (part of every key).
std::string hostName();

// Collective over pg: rank 0 reads `key` from the cache at `path` (mode on only; refresh ignores the
// cache) and broadcasts the first n fields when all are integers >= 0; every rank returns them, or
// nullopt when rank 0 found none. The tuners' one way to agree on a cached choice.
std::optional<std::vector<int64_t>> cachedForAll(ProcessGroup& pg, Mode mode, const std::string& path,
                                                 const std::string& key, size_t n);
// Appends the choice to the cache at `path` ("" : none) and says where it went, for the tuners' line:
// "cached in PATH", "not cached: PATH <why>" or "not cached (no DTRAIN_TUNE_CACHE, XDG_CACHE_HOME or HOME)".
std::string storeChoice(const std::string& path, const std::string& key, const std::vector<std::string>& fields);

// The median of the values (the mean of the middle two when their count is even); 0 when empty.
double median(std::vector<double> v);

// Which size threshold of the automatic allreduce choice (select.cc) a group's transport leaves open:
// recursive doubling against the ring (messages, tcp), against the direct algorithm (shm with more
// ranks than cores), or none (shm with a core per rank: direct at every size; hierarchical).
enum class Crossover { none, rd_vs_ring, rd_vs_direct };
// A group's: none when its algorithm is forced, hierarchical (hosts shared), or direct at every size.
Crossover openCrossover(AllreduceAlgorithm forced, const algo::Hierarchy* hier, transport::Transport& tx);

// The largest size up to which the small-message algorithm was at least as fast at every size probed
// (0 when it lost at the smallest): times[i] of sizes[i] ascending, small vs large algorithm.
size_t crossoverBytes(const std::vector<size_t>& sizes, const std::vector<double>& small_us,
                      const std::vector<double>& large_us);

// Collective over pg, right after it is made, with DTRAIN_TUNE on or refresh: the cached threshold for
// this host, world, transport and layout (rank 0 reads, broadcasts), or a probe of both algorithms at
// 1 KiB-1 MiB (every rank's time of each size counted at the slowest rank's, so all choose alike),
// cached by rank 0. Returns the thresholds to use (the defaults when there is nothing to choose).
algo::Thresholds tuneAllreduce(ProcessGroup& pg, Crossover which, Mode mode);
// ProcessGroup::create's call: DTRAIN_TUNE read (InvalidArgument naming a bad value), then
// tuneAllreduce for the group's open crossover; the defaults when off.
algo::Thresholds forNewGroup(ProcessGroup& pg, AllreduceAlgorithm forced, const algo::Hierarchy* hier,
                             transport::Transport& tx);

}  // namespace dtrain::comm::tune
