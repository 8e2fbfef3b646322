// The hierarchical collectives' equality checks, run on any group: by hierarchical_test.cc on ranks
// that fake their hosts (DTRAIN_HOST_ID), and by hierarchical_rig_worker.cc on the emulated cluster
// (scripts/cluster.sh), where the hosts are network namespaces. Results must equal the flat ring's
// (exactly for integers, within rounding for floats) and the locally computed value, for every dtype and
// reduce op, counts 0, 1, a prime and a multi-segment size; every rank must end bit-identical; broadcast
// allgather and reduce_scatter (hierarchical too where a host has several ranks).
#pragma once
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <random>

#include "comm_test_util.h"

namespace dtrain::test {

using comm::AllreduceAlgorithm;
using comm::ProcessGroup;

constexpr size_t kCounts[] = {0, 1, 13, 12007};

// Per-rank block sizes: all `count`, or uneven (odd ranks half, even ranks count + rank; empty ones
// included); and their prefix offsets.
inline std::vector<size_t> blockCounts(int n, size_t count, bool uneven) {
  std::vector<size_t> counts(static_cast<size_t>(n), count);
  if (uneven)
    for (int q = 0; q < n; ++q) counts[static_cast<size_t>(q)] = q % 2 ? count / 2 : count + q;
  return counts;
}
inline std::vector<size_t> offsetsOf(const std::vector<size_t>& counts) {
  std::vector<size_t> off(1, 0);
  for (size_t k : counts) off.push_back(off.back() + k);
  return off;
}

// Hierarchical against the flat ring and the expected value; in place and out of place.
inline void checkEqualsFlat(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (DType t : comm::kAllDTypes)
    for (size_t count : kCounts)
      for (ReduceOp op : comm::kAllReduceOps) {
        Buf in(t, count), hier(t, count), flat(t, count);
        for (size_t i = 0; i < count; ++i) in.set(i, inputValue(r, i, op));
        pg.allreduce(in.data(), hier.data(), count, t, op, AllreduceAlgorithm::hierarchical)->wait();
        pg.allreduce(in.data(), flat.data(), count, t, op, AllreduceAlgorithm::ring)->wait();
        Buf inplace = in;
        pg.allreduce(inplace.data(), inplace.data(), count, t, op, AllreduceAlgorithm::hierarchical)->wait();
        const std::string what = fmt::format("{} {} x {} world {} rank {}", comm::reduceOpName(op),
                                             comm::dtypeName(t), count, n, r);
        for (size_t i = 0; i < count; ++i) {
          const double want = expectedReduce(n, i, op, t);
          ASSERT_TRUE(close(hier.at(i), want, t)) << what << ": element " << i << " is " << hier.at(i)
                                                  << ", expected " << want;
          ASSERT_TRUE(close(hier.at(i), flat.at(i), t)) << what << ": element " << i << " is " << hier.at(i)
                                                        << ", the ring gave " << flat.at(i);
          if (!comm::isFloating(t)) {
            ASSERT_EQ(hier.at(i), flat.at(i)) << what << ": element " << i;
          }
          ASSERT_EQ(inplace.at(i), hier.at(i)) << what << ": in place differs at element " << i;
        }
        ASSERT_EQ(hier.bytes.back(), 0xEE) << what << ": wrote past the end";
        ASSERT_EQ(inplace.bytes.back(), 0xEE) << what << ": wrote past the end (in place)";
      }
}

// Broadcast goes hierarchical where some host has several ranks (to one rank per host over tcp, then
// within each host over shm): every root, every dtype, every count, including a root that is not its
// host's lowest rank.
inline void checkBroadcastFromEveryRoot(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (DType t : comm::kAllDTypes)
    for (size_t count : kCounts)
      for (int root = 0; root < n; ++root) {
        Buf buf(t, count);
        for (size_t i = 0; i < count; ++i) buf.set(i, r == root ? inputValue(root, i, ReduceOp::sum) : 0);
        pg.broadcast(buf.data(), count, t, root)->wait();
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(buf.at(i), inputValue(root, i, ReduceOp::sum))
              << comm::dtypeName(t) << " x " << count << " root " << root << " rank " << r << ": element " << i;
        ASSERT_EQ(buf.bytes.back(), 0xEE) << "wrote past the end";
      }
}

// Allgather goes hierarchical too (blocks to the host's lowest rank, bundles across hosts, broadcast
// within hosts): even and uneven blocks (empty ones included), every dtype, out of place and in place.
inline void checkAllgatherEqualsExpected(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (DType t : comm::kAllDTypes)
    for (size_t count : kCounts)
      for (bool uneven : {false, true}) {
        const std::vector<size_t> counts = blockCounts(n, count, uneven), off = offsetsOf(counts);
        const size_t mine = counts[static_cast<size_t>(r)];
        Buf in(t, mine), out(t, off.back()), inplace(t, off.back());
        for (size_t i = 0; i < mine; ++i) in.set(i, inputValue(r, i, ReduceOp::sum));
        for (size_t i = 0; i < mine; ++i) inplace.set(off[static_cast<size_t>(r)] + i, inputValue(r, i, ReduceOp::sum));
        pg.allgatherv(in.data(), out.data(), counts, t)->wait();
        void* at = static_cast<char*>(inplace.data()) + off[static_cast<size_t>(r)] * comm::dtypeSize(t);
        pg.allgatherv(at, inplace.data(), counts, t)->wait();
        for (int q = 0; q < n; ++q)
          for (size_t i = 0; i < counts[static_cast<size_t>(q)]; ++i) {
            const size_t j = off[static_cast<size_t>(q)] + i;
            ASSERT_EQ(out.at(j), inputValue(q, i, ReduceOp::sum))
                << comm::dtypeName(t) << " x " << count << (uneven ? " uneven" : "") << ": rank " << r
                << " has a wrong element " << i << " of rank " << q << "'s block";
            ASSERT_EQ(inplace.at(j), out.at(j)) << "in place differs at " << j;
          }
        ASSERT_EQ(out.bytes.back(), 0xEE) << "wrote past the end";
      }
}

// Irregular floats: every rank must end with the same bits (each shard is reduced by one set of owners
// and handed out as bytes), checked by allgathering every rank's result.
inline void checkEveryRankBitIdentical(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg})
      for (size_t count : {size_t(37), size_t(12007)}) {
        Buf buf(t, count);
        std::mt19937_64 rng(static_cast<uint64_t>(r) * 7919 + count);
        std::uniform_real_distribution<double> value(-1000.0, 1000.0);
        for (size_t i = 0; i < count; ++i) buf.set(i, value(rng));
        pg.allreduce(buf.data(), buf.data(), count, t, op, AllreduceAlgorithm::hierarchical)->wait();
        const size_t bytes = count * comm::dtypeSize(t);
        std::vector<uint8_t> all(bytes * static_cast<size_t>(n));
        pg.allgather(buf.data(), all.data(), bytes, DType::u8)->wait();
        for (int q = 0; q < n; ++q)
          ASSERT_EQ(0, std::memcmp(all.data() + bytes * static_cast<size_t>(q), all.data(), bytes))
              << comm::dtypeName(t) << " " << comm::reduceOpName(op) << " x " << count << ": rank " << q
              << " differs from rank 0";
      }
}

// Ops of different algorithms interleave on one group (shm stages, tcp mesh, flat ops on the mesh), and
// automatic (hierarchical where a host has several ranks) agrees with the expected value.
inline void checkInterleavedWithOtherOps(ProcessGroup& pg) {
  const int n = pg.size();
  for (int k = 0; k < 50; ++k) {
    std::vector<int64_t> a(1000 + k, pg.rank() + 1);
    pg.allreduce(a.data(), a.size(), DType::i64)->wait();
    ASSERT_EQ(a.back(), n * (n + 1) / 2) << "iteration " << k;
    std::vector<int32_t> b(7, k);
    pg.broadcast(b.data(), b.size(), DType::i32, k % n)->wait();
    pg.allreduce(b.data(), b.data(), b.size(), DType::i32, ReduceOp::max, AllreduceAlgorithm::recursive_doubling)
        ->wait();
    ASSERT_EQ(b[3], k);
  }
}

// Reduce-scatter goes hierarchical too where a host has several ranks: even and uneven blocks (empty
// ones included), every dtype and reduce op, out of place and in place (the output inside the input at
// this rank's block).
inline void checkReduceScatterEqualsExpected(ProcessGroup& pg) {
  const int n = pg.size(), r = pg.rank();
  for (DType t : comm::kAllDTypes)
    for (size_t count : kCounts)
      for (ReduceOp op : comm::kAllReduceOps)
        for (bool uneven : {false, true}) {
          const std::vector<size_t> counts = blockCounts(n, count, uneven), off = offsetsOf(counts);
          const size_t mine = counts[static_cast<size_t>(r)];
          Buf in(t, off.back()), out(t, mine);
          for (size_t i = 0; i < off.back(); ++i) in.set(i, inputValue(r, i, op));
          Buf inplace = in;
          pg.reduceScatterv(in.data(), out.data(), counts, t, op)->wait();
          void* at = static_cast<char*>(inplace.data()) + off[static_cast<size_t>(r)] * comm::dtypeSize(t);
          pg.reduceScatterv(inplace.data(), at, counts, t, op)->wait();
          const std::string what = fmt::format("reduce_scatter {} {} x {}{} world {} rank {}", comm::reduceOpName(op),
                                               comm::dtypeName(t), count, uneven ? " uneven" : "", n, r);
          for (size_t i = 0; i < mine; ++i) {
            const double want = expectedReduce(n, off[static_cast<size_t>(r)] + i, op, t);
            ASSERT_TRUE(close(out.at(i), want, t)) << what << ": element " << i << " is " << out.at(i)
                                                   << ", expected " << want;
            ASSERT_EQ(inplace.at(off[static_cast<size_t>(r)] + i), out.at(i)) << what << ": in place differs at " << i;
          }
          ASSERT_EQ(out.bytes.back(), 0xEE) << what << ": wrote past the end";
        }
}

}  // namespace dtrain::test
