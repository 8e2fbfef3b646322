// Allgather with equal or uneven block sizes: a ring (across hosts, see hierarchical.cc; the choice is in
// select.cc).
//
// Each rank copies its own block into place, then in step s (0 .. size-2) sends block (rank - s) to
// the right and receives block (rank - s - 1) from the left, straight into its final position.
// size-1 steps; every link carries (size-1)/size of the output.
#include <cstring>

#include "comm/collectives/collectives.h"

namespace dtrain::comm::algo {

void allgathervRing(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t) {
  const size_t es = dtypeSize(t);
  auto off = prefixOffsets(counts);
  char* mine = static_cast<char*>(out) + off[c.rank] * es;
  if (mine != in && counts[c.rank]) std::memmove(mine, in, counts[c.rank] * es);
  if (c.size > 1) ringAllgatherInPlace(c, out, counts, t, 0);
}

}  // namespace dtrain::comm::algo
