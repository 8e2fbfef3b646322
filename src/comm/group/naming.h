// The names of a group and of its ops, as Work::describe(), errors, traces and dumps print them.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/trace/trace_internal.h"

namespace dtrain::comm {

// The group as traces name it; `global` empty: its ranks are the world's. An empty name becomes
// "group<k>" (k counts this process's unnamed groups).
std::shared_ptr<const trace::GroupInfo> groupInfo(const std::string& name, int rank, int size, std::vector<int> global);

// "allreduce seq=41 f32 x 1024 sum": every op's label (its Work's describe() and every error about it).
std::string opLabel(const char* op, uint64_t seq, const char* dtype, size_t count, const std::string& extra);

// The v-ops' counts enter the fingerprint when they are uneven (an even split is the plain op): their
// hash, or 0 when even.
uint64_t unevenHash(const std::vector<size_t>& counts);
// The counts in the op's label, where they enter its fingerprint (hash = unevenHash(counts)).
std::string countsText(const std::vector<size_t>& counts, uint64_t hash);

}  // namespace dtrain::comm
