// The NCCL backend (dtrain/comm/nccl.h): a non-blocking communicator per process group, ops on the
// communicator's own stream ordered after the caller's stream by an event, and a watchdog thread that
// completes each op's Work when its end event fires, and aborts the communicator on a deadline or an
// asynchronous NCCL error, so that a stuck or dead peer is an error, never a hang (the reference,
// section 4: wait by polling cudaEventQuery and ncclCommGetAsyncError, never cudaStreamSynchronize).
// The collective algorithms are NCCL's; this file only sets up, orders, watches and names.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/comm/nccl.h"
#include "dtrain/comm/process_group.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "dtrain's NCCL backend needs NCCL 2.14 or later (non-blocking communicators, ncclCommInitRankConfig)"
#endif

namespace dtrain::comm {

using Clock = std::chrono::steady_clock;

namespace {

std::string cudaText(cudaError_t e) { return fmt::format("CUDA error {} ({}: {})", static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e)); }

void checkCuda(cudaError_t e, int rank, const std::string& what) {
  if (e != cudaSuccess) throw Error(fmt::format("[rank {}] {}: {}", rank, what, cudaText(e)));
}

ncclDataType_t ncclType(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u8: return ncclUint8;
  }
  return ncclFloat32;
}

ncclRedOp_t ncclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::min: return ncclMin;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::prod: return ncclProd;
  }
  return ncclSum;
}

// What the ranks compare before every op (see nccl.h): equal on every rank or the op fails everywhere.
struct Fingerprint {
  uint64_t seq = 0;
  uint64_t count = 0;
  int32_t root = -1;
  uint8_t op = 0, dtype = 0, rop = 0xFF, pad = 0;
  bool operator==(const Fingerprint& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};

const char* opName(uint8_t op) {
  static const char* kNames[] = {"allreduce", "broadcast", "allgather", "reduce_scatter"};
  return op < 4 ? kNames[op] : "?";
}

std::string describe(const Fingerprint& f) {
  std::string s = fmt::format("nccl {} seq={} {} x {}", opName(f.op), f.seq, dtypeName(static_cast<DType>(f.dtype)), f.count);
  if (f.rop != 0xFF) s += std::string(" ") + reduceOpName(static_cast<ReduceOp>(f.rop));
  if (f.root >= 0) s += fmt::format(" root {}", f.root);
  return s;
}

// An op on the GPU: its Work, its end event, its deadline.
struct Pending {
  std::shared_ptr<Work> work;
  cudaEvent_t end = nullptr;
  Clock::time_point deadline;
};

}  // namespace

bool ncclBuilt() { return true; }

std::string ncclVersionText() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  return fmt::format("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100);
}

struct NcclComm::Impl {
  ProcessGroup* pg = nullptr;  // outlives this (the communicator is one of its attachments)
  int rank = 0, size = 1, device = 0;
  Duration timeout{};
  std::string ranks_text;  // "the group's ranks 0-3" for errors
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  uint64_t seq = 0;
  std::mutex mu;  // guards what follows
  std::deque<Pending> pending;
  std::exception_ptr broken;  // the first failure: later ops fail with it
  bool aborted = false, stopping = false;
  std::thread watchdog;

  std::string where() const { return fmt::format("[rank {}] on cuda:{}", rank, device); }

  // Polls a non-blocking communicator until the call that returned ncclInProgress has finished.
  ncclResult_t settle(ncclResult_t r, Clock::time_point deadline, const std::string& what) {
    while (r == ncclInProgress) {
      if (Clock::now() > deadline) {
        ncclCommAbort(comm);
        aborted = true;
        throw TimeoutError(fmt::format("{} {} timed out after {} s waiting for the ranks of the group ({}); the "
                                       "communicator was aborted", where(), what, seconds(), ranks_text));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
    }
    return r;
  }

  void checkNccl(ncclResult_t r, const std::string& what) {
    if (r == ncclSuccess) return;
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    throw Error(fmt::format("{} {}: NCCL error {} ({}){}{}", where(), what, static_cast<int>(r), ncclGetErrorString(r),
                            last && *last ? ": " : "", last ? last : ""));
  }

  double seconds() const { return std::chrono::duration<double>(timeout).count(); }

  // Every rank's fingerprint over the host group: a mismatch fails every rank, naming who called what.
  void compare(const Fingerprint& mine) {
    if (size == 1) return;
    std::vector<Fingerprint> all(static_cast<size_t>(size));
    pg->allgather(&mine, all.data(), sizeof(Fingerprint), DType::u8)->wait();
    for (int r = 0; r < size; ++r) {
      if (all[static_cast<size_t>(r)] == mine) continue;
      throw ProtocolError(fmt::format("[rank {}] collective mismatch on the NCCL communicator: rank {} called {}, "
                                      "rank {} called {}", rank, rank, describe(mine), r, describe(all[static_cast<size_t>(r)])));
    }
  }

  // Fingerprint, order after the caller's stream, launch, record the end event, hand it to the watchdog.
  WorkPtr launch(Fingerprint f, void* caller, const std::function<ncclResult_t()>& call) {
    f.seq = seq++;
    const std::string what = describe(f);
    const Clock::time_point deadline = Clock::now() + timeout;
    auto work = std::make_shared<Work>(what, deadline, rank);
    try {
      {
        std::lock_guard<std::mutex> g(mu);
        if (broken) std::rethrow_exception(broken);
      }
      compare(f);
      checkCuda(cudaSetDevice(device), rank, what + ": cudaSetDevice");
      cudaEvent_t ready = nullptr, end = nullptr;
      checkCuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), rank, what);
      checkCuda(cudaEventRecord(ready, static_cast<cudaStream_t>(caller)), rank, what + ": the caller's stream");
      checkCuda(cudaStreamWaitEvent(stream, ready, 0), rank, what);
      cudaEventDestroy(ready);  // released once the wait has been enqueued
      checkNccl(settle(call(), deadline, what), what);
      checkCuda(cudaEventCreateWithFlags(&end, cudaEventDisableTiming), rank, what);
      checkCuda(cudaEventRecord(end, stream), rank, what);
      std::lock_guard<std::mutex> g(mu);
      pending.push_back(Pending{work, end, deadline});
    } catch (...) {
      fail(std::current_exception());
      work->finish(std::current_exception());
    }
    return work;
  }

  // Breaks the communicator: the first error is kept, pending ops fail with it.
  void fail(std::exception_ptr e) {
    std::deque<Pending> left;
    {
      std::lock_guard<std::mutex> g(mu);
      if (!broken) broken = e;
      left.swap(pending);
    }
    for (auto& p : left) {
      if (p.end) cudaEventDestroy(p.end);
      p.work->finish(e);
    }
  }

  void abortNow() {
    if (!aborted) ncclCommAbort(comm);
    aborted = true;
  }

  // The watchdog: completes finished ops in order, and turns deadlines and NCCL's asynchronous errors
  // into failures (after aborting, which unblocks kernels waiting for a peer that will not come).
  void watch() {
    cudaSetDevice(device);
    for (;;) {
      std::unique_lock<std::mutex> lk(mu);
      if (stopping && pending.empty()) return;
      if (pending.empty()) {
        lk.unlock();
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      Pending p = pending.front();
      lk.unlock();
      cudaError_t q = cudaEventQuery(p.end);
      if (q == cudaSuccess) {
        lk.lock();
        pending.pop_front();
        lk.unlock();
        cudaEventDestroy(p.end);
        p.work->finish();
        continue;
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm, &async);
      std::string why;
      if (q != cudaErrorNotReady) why = fmt::format("{} failed on the GPU: {}", p.work->describe(), cudaText(q));
      else if (async != ncclSuccess && async != ncclInProgress)
        why = fmt::format("{}: NCCL's asynchronous error {} ({}): {}", p.work->describe(), static_cast<int>(async),
                          ncclGetErrorString(async), ncclGetLastError(comm));
      else if (Clock::now() > p.deadline)
        why = fmt::format("{} timed out after {} s: a rank of the group ({}) did not join it or died inside it",
                          p.work->describe(), seconds(), ranks_text);
      if (why.empty()) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
      abortNow();
      const std::string text = fmt::format("{} {}; the communicator was aborted", where(), why);
      fail(Clock::now() > p.deadline ? std::make_exception_ptr(TimeoutError(text)) : std::make_exception_ptr(Error(text)));
    }
  }
};

std::shared_ptr<NcclComm> NcclComm::create(ProcessGroup& pg, int device) {
  auto m = std::make_unique<Impl>();
  m->pg = &pg;
  m->rank = pg.rank();
  m->size = pg.size();
  m->device = device;
  m->timeout = pg.options().timeout;
  m->ranks_text = fmt::format("group '{}' of {} ranks", pg.options().name, pg.size());
  const std::string what = fmt::format("NCCL communicator of {} ranks", m->size);
  // Every rank says first whether it can take part (a GPU, the device, an id for rank 0): one that cannot
  // must not leave the others waiting for it in the id's broadcast or in NCCL's initialisation.
  std::string problem;
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  try {
    int count = 0;
    checkCuda(cudaGetDeviceCount(&count), m->rank, what + ": no usable CUDA device");
    DTRAIN_CHECK(device >= 0 && device < count, InvalidArgument, "[rank {}] {}: cuda:{} does not exist ({} visible)",
                 m->rank, what, device, count);
    checkCuda(cudaSetDevice(device), m->rank, what + ": cudaSetDevice");
    if (m->rank == 0) m->checkNccl(ncclGetUniqueId(&id), what + ": ncclGetUniqueId");
  } catch (const Error& e) {
    problem = e.what();
  }
  if (m->size > 1) {
    std::vector<uint8_t> bad(static_cast<size_t>(m->size));
    const uint8_t mine = problem.empty() ? 0 : 1;
    pg.allgather(&mine, bad.data(), 1, DType::u8)->wait();
    std::string who;
    for (int r = 0; r < m->size; ++r)
      if (bad[static_cast<size_t>(r)]) who += (who.empty() ? "" : ", ") + std::to_string(r);
    if (!who.empty() && problem.empty())
      problem = fmt::format("[rank {}] {}: rank(s) {} could not set up CUDA or NCCL (their errors say why)", m->rank, what, who);
  }
  if (!problem.empty()) throw Error(problem);
  // Rank 0 drew the id; every rank gets it over the host group before anyone initialises.
  if (m->size > 1) pg.broadcast(&id, sizeof(id), DType::u8, 0)->wait();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const Clock::time_point deadline = Clock::now() + m->timeout;
  ncclResult_t r = ncclCommInitRankConfig(&m->comm, m->size, id, m->rank, &config);
  if (m->comm) r = m->settle(r, deadline, what + " init");
  if (r != ncclSuccess && m->comm) {
    ncclCommAbort(m->comm);
    m->aborted = true;
  }
  m->checkNccl(r, what + " init");
  int lo = 0, hi = 0;
  cudaDeviceGetStreamPriorityRange(&lo, &hi);
  checkCuda(cudaStreamCreateWithPriority(&m->stream, cudaStreamNonBlocking, hi), m->rank, what + ": its stream");
  Impl* raw = m.get();
  m->watchdog = std::thread([raw] { raw->watch(); });
  return std::shared_ptr<NcclComm>(new NcclComm(std::move(m)));
}

NcclComm::NcclComm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

NcclComm::~NcclComm() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> g(m.mu);
    m.stopping = true;  // the watchdog leaves once every op has completed or failed (each has a deadline)
  }
  if (m.watchdog.joinable()) m.watchdog.join();
  if (m.aborted) return;
  if (m.stream) cudaStreamDestroy(m.stream);
  ncclCommDestroy(m.comm);
}

WorkPtr NcclComm::allreduce(const void* in, void* out, size_t count, DType t, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  Fingerprint f;
  f.op = 0, f.count = count, f.dtype = static_cast<uint8_t>(t), f.rop = static_cast<uint8_t>(op);
  return m.launch(f, stream, [&] { return ncclAllReduce(in, out, count, ncclType(t), ncclOp(op), m.comm, m.stream); });
}

WorkPtr NcclComm::broadcast(void* buf, size_t count, DType t, int root, void* stream) {
  Impl& m = *impl_;
  DTRAIN_CHECK(root >= 0 && root < m.size, InvalidArgument, "[rank {}] nccl broadcast: root {} outside the group of {}",
               m.rank, root, m.size);
  Fingerprint f;
  f.op = 1, f.count = count, f.dtype = static_cast<uint8_t>(t), f.root = root;
  return m.launch(f, stream, [&] { return ncclBroadcast(buf, buf, count, ncclType(t), root, m.comm, m.stream); });
}

WorkPtr NcclComm::allgather(const void* in, void* out, size_t count, DType t, void* stream) {
  Impl& m = *impl_;
  Fingerprint f;
  f.op = 2, f.count = count, f.dtype = static_cast<uint8_t>(t);
  return m.launch(f, stream, [&] { return ncclAllGather(in, out, count, ncclType(t), m.comm, m.stream); });
}

WorkPtr NcclComm::reduceScatter(const void* in, void* out, size_t count, DType t, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  Fingerprint f;
  f.op = 3, f.count = count, f.dtype = static_cast<uint8_t>(t), f.rop = static_cast<uint8_t>(op);
  return m.launch(f, stream, [&] { return ncclReduceScatter(in, out, count, ncclType(t), ncclOp(op), m.comm, m.stream); });
}

int NcclComm::device() const { return impl_->device; }
int NcclComm::rank() const { return impl_->rank; }
int NcclComm::size() const { return impl_->size; }

}  // namespace dtrain::comm
