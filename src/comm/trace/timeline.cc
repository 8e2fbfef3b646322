// The timeline's recording side (DTRAIN_TIMELINE=DIR; docs/OBSERVABILITY.md): spans, ops and the flow
// events between ranks go into the calling thread's buffer (timeline_buffer.h) as raw fields; the
// writer thread (timeline_writer.cc) spools them and formats them when flushed. Nothing here takes a
// lock or formats text per event.
#include <algorithm>
#include <cstring>
#include <iterator>
#include <new>

#include "comm/trace/timeline_buffer.h"
#include "comm/transport/transport.h"

namespace dtrain::comm::trace::timeline {

std::atomic<bool> g_on{false};

namespace {

// Longest copied text (a run-time span name, an error message); the rest is cut.
constexpr size_t kMaxText = 2048;
// At most this many peers are listed in an op's args (group_size says how many it has).
constexpr size_t kMaxPeers = 512;

struct Registry {
  std::mutex mu;
  std::vector<ThreadBuffer*> buffers;
  std::vector<std::pair<uint64_t, std::string>> names;
};

// Never destroyed: threads may record during static destruction.
Registry& reg() {
  static Registry* r = new Registry;
  return *r;
}

// Chunks made when the timeline opens, their pages touched: the recording threads take their first
// chunks from here, so that a tight loop's first tens of thousands of events do not each fault fresh
// pages (measured: a 10,000-allreduce loop ran 10-20% slower on fresh chunks).
constexpr size_t kPrepared = 64;  // 5 MB: twice what a thread has in flight between the writer's nudges
struct Pool {
  std::mutex mu;
  std::vector<Chunk*> chunks;
};
Pool& pool() {
  static Pool* p = new Pool;  // never destroyed, as the registry
  return *p;
}
Chunk* takeChunk() {
  {
    std::lock_guard<std::mutex> g(pool().mu);
    if (!pool().chunks.empty()) {
      Chunk* c = pool().chunks.back();
      pool().chunks.pop_back();
      return c;
    }
  }
  return new Chunk;
}

thread_local ThreadBuffer* t_buffer = nullptr;

// Hands the thread's buffer to the writer when the thread ends.
struct Owner {
  bool armed = false;
  ~Owner() {
    if (ThreadBuffer* b = t_buffer) {
      t_buffer = nullptr;
      b->exited.store(true, std::memory_order_release);
    }
  }
};
thread_local Owner t_owner;

// The op this thread runs (a stack: a thread waiting for one op may run another), with the number
// of messages it sent to and received from each member so far.
struct Running {
  const OpRecord* rec = nullptr;
  uint64_t group_hash = 0;
  std::vector<uint64_t> sent, received;
};
thread_local std::vector<Running> t_running;
thread_local size_t t_depth = 0;

uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
constexpr uint64_t kFnvBasis = 14695981039346656037ull;

// The same on the sender and the receiver; 53 bits, so viewers that read JSON numbers as doubles agree.
uint64_t flowId(uint64_t group_hash, uint64_t seq, int src, int dst, uint64_t k) {
  uint64_t h = group_hash;
  h = fnv(h, &seq, sizeof seq);
  h = fnv(h, &src, sizeof src);
  h = fnv(h, &dst, sizeof dst);
  h = fnv(h, &k, sizeof k);
  return h & ((uint64_t{1} << 53) - 1);
}

// A span or async slice named prefix + index, with args.
void named(Event::Kind kind, const char* prefix, int64_t index, const char* category, int64_t start_us,
           int64_t end_us, const Arg (&args)[4]) {
  ThreadBuffer& buf = threadBuffer();
  Event& e = buf.next(0);
  e.kind = kind;
  e.name = prefix;
  e.s.index = index;
  e.cat = category;
  e.ts = start_us;
  e.dur = end_us - start_us;
  e.s.id = kind == Event::kAsync
               ? flowId(fnv(kFnvBasis, prefix, std::strlen(prefix)), 0, 0, 0, static_cast<uint64_t>(index))
               : 0;
  std::copy(std::begin(args), std::end(args), e.s.args);
  buf.publish();
}

// Whether `shape` (stored for an earlier op) describes the op of `r` too.
bool sameShape(const OpShape* shape, const OpRecord& r, const GroupInfo* g) {
  if (!shape || shape->key != g || shape->op != r.op || shape->dtype != r.dtype || shape->algorithm != r.algorithm ||
      shape->count != r.count || shape->bytes != r.bytes || shape->root != r.root)
    return false;
  if (!g) return true;
  if (shape->rank != g->rank || shape->group_size != g->size || g->name != shape->group) return false;
  if (r.peers.empty()) return shape->npeers == g->size - 1;  // every other member
  if (static_cast<size_t>(shape->npeers) != r.peers.size()) return false;
  for (size_t i = 0; i < r.peers.size(); ++i)
    if (shape->peers[i] != g->globalRank(r.peers[i])) return false;
  return true;
}

// Copies the shape of `r`'s op into the current chunk's arena (room reserved by next()).
const OpShape* storeShape(ThreadBuffer& b, const OpRecord& r, const GroupInfo* g, const int* peers, size_t np,
                          size_t group_n) {
  b.tail->arena_used = (b.tail->arena_used + 7u) & ~7u;
  auto* shape = new (b.tail->arena + b.tail->arena_used) OpShape;
  b.tail->arena_used += static_cast<uint32_t>(sizeof(OpShape));
  shape->key = g;
  shape->rank = g ? g->rank : 0;
  shape->root = r.root;
  shape->group_size = g ? g->size : 1;
  shape->group = g ? b.copy(g->name.data(), group_n) : "";
  shape->op = r.op;
  shape->dtype = r.dtype;
  shape->algorithm = r.algorithm;
  shape->count = r.count;
  shape->bytes = r.bytes;
  shape->peers = b.copy(peers, np);
  shape->npeers = static_cast<int32_t>(np);
  b.tail->shape = shape;
  return shape;
}

}  // namespace

Event& ThreadBuffer::next(uint32_t arena) {
  Chunk* c = tail;
  uint32_t n = c->published.load(std::memory_order_relaxed);
  if (n == Chunk::kEvents || c->arena_used + arena > Chunk::kArena) {
    Chunk* fresh = nullptr;
    {
      std::lock_guard<std::mutex> g(spare_mu);
      if (!spare.empty()) {
        fresh = spare.back();
        spare.pop_back();
      }
    }
    if (fresh) {
      fresh->published.store(0, std::memory_order_relaxed);
      fresh->next.store(nullptr, std::memory_order_relaxed);
      fresh->arena_used = 0;
      fresh->shape = nullptr;
    } else {
      fresh = takeChunk();
    }
    c->next.store(fresh, std::memory_order_release);
    tail = c = fresh;
    n = 0;
    if (++filled % kNudgeChunks == 0) nudgeWriter();
  }
  return c->events[n];
}

void ThreadBuffer::recycle(Chunk* c) {
  // A thread that records 500,000 events a second fills some 250 chunks between two of the writer's
  // rounds; keeping them (up to 34 MB, only for a thread that fast) saves a fresh page per 4 KiB each
  // round, which cost about 10 us each on the machine this was measured on.
  constexpr size_t kKeep = 256;
  {
    std::lock_guard<std::mutex> g(spare_mu);
    if (spare.size() < kKeep) {
      spare.push_back(c);
      return;
    }
  }
  delete c;
}

void ThreadBuffer::publish() {
  tail->published.store(tail->published.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

const char* ThreadBuffer::copy(const char* s, size_t n) {
  char* p = tail->arena + tail->arena_used;
  std::memcpy(p, s, n);
  p[n] = 0;
  tail->arena_used += static_cast<uint32_t>(n + 1);
  return p;
}

const int* ThreadBuffer::copy(const int* v, size_t n) {
  tail->arena_used = (tail->arena_used + 7u) & ~7u;
  auto* p = reinterpret_cast<int*>(tail->arena + tail->arena_used);
  std::copy(v, v + n, p);
  tail->arena_used += static_cast<uint32_t>(n * sizeof(int));
  return p;
}

ThreadBuffer& threadBuffer() {
  if (ThreadBuffer* b = t_buffer) return *b;
  auto* b = new ThreadBuffer;
  b->thread = threadNumber();
  b->head = b->tail = takeChunk();
  {
    std::lock_guard<std::mutex> g(reg().mu);
    reg().buffers.push_back(b);
  }
  t_buffer = b;
  t_owner.armed = true;  // constructs the thread's Owner, whose destructor hands the buffer over
  return *b;
}

void prepareChunks() {
  std::vector<Chunk*> made;
  for (size_t i = 0; i < kPrepared; ++i) {
    auto* c = new Chunk;
    std::memset(static_cast<void*>(c->events), 0, sizeof c->events);
    std::memset(c->arena, 0, sizeof c->arena);
    made.push_back(c);
  }
  std::lock_guard<std::mutex> g(pool().mu);
  pool().chunks.insert(pool().chunks.end(), made.begin(), made.end());
}

std::mutex& registryMutex() { return reg().mu; }
std::vector<ThreadBuffer*>& registry() { return reg().buffers; }
std::vector<std::pair<uint64_t, std::string>>& pendingNames() { return reg().names; }

void threadNamed(uint64_t thread, const std::string& name) {
  std::lock_guard<std::mutex> g(reg().mu);
  reg().names.emplace_back(thread, name);
}

void span(const char* name, const char* category, int64_t start_us, int64_t end_us, bool copy) {
  const size_t n = copy ? std::min(std::strlen(name), kMaxText) : 0;
  ThreadBuffer& b = threadBuffer();
  Event& e = b.next(copy ? static_cast<uint32_t>(n + 1) : 0);
  e.kind = Event::kSpan;
  e.name = copy ? b.copy(name, n) : name;
  e.cat = category;
  e.ts = start_us;
  e.dur = end_us - start_us;
  e.s.index = -1;
  e.s.id = 0;
  std::fill(std::begin(e.s.args), std::end(e.s.args), Arg{});
  b.publish();
}

void span(const char* prefix, int64_t index, const char* category, int64_t start_us, int64_t end_us, Arg a,
          Arg b, Arg c, Arg d) {
  named(Event::kSpan, prefix, index, category, start_us, end_us, {a, b, c, d});
}

void asyncSpan(const char* prefix, int64_t index, const char* category, int64_t start_us, int64_t end_us, Arg a,
               Arg b, Arg c, Arg d) {
  named(Event::kAsync, prefix, index, category, start_us, end_us, {a, b, c, d});
}

void op(const OpRecord& r, const std::exception_ptr& error) {
  const GroupInfo* g = r.group.get();
  std::string err;
  if (error) err = errorText(error);
  const size_t err_n = std::min(err.size(), kMaxText);
  ThreadBuffer& b = threadBuffer();
  // A loop of one collective stores its shape once per chunk (the common case: no copies, no peer list).
  const Chunk* before = b.tail;
  const bool same = sameShape(b.tail->shape, r, g);
  const size_t group_n = g ? std::min(g->name.size(), kMaxText) : 0;
  const size_t np_max = std::min(kMaxPeers, !g ? 0 : r.peers.empty() ? static_cast<size_t>(g->size - 1) : r.peers.size());
  const size_t shape_n = sizeof(OpShape) + 8 + group_n + 1 + 8 + np_max * sizeof(int);
  Event& e = b.next(static_cast<uint32_t>((same ? 0 : shape_n) + (error ? err_n + 1 : 0)));
  const OpShape* shape = b.tail->shape;
  if (!same || b.tail != before) {  // (a fresh chunk has its whole arena free)
    // Peers as world ranks: a point-to-point op's, or every other member of the group.
    int peers[kMaxPeers];
    size_t np = 0;
    if (g) {
      if (!r.peers.empty()) {
        for (size_t i = 0; i < r.peers.size() && np < kMaxPeers; ++i) peers[np++] = g->globalRank(r.peers[i]);
      } else {
        for (int p = 0; p < g->size && np < kMaxPeers; ++p)
          if (p != g->rank) peers[np++] = g->globalRank(p);
      }
    }
    shape = storeShape(b, r, g, peers, np, group_n);
  }
  e.kind = Event::kOp;
  e.name = r.op;
  e.cat = "comm";
  e.ts = r.started_us;
  e.dur = r.finished_us - r.started_us;
  e.o.shape = shape;
  e.o.queued_us = r.started_us - r.issued_us;
  e.o.seq = r.seq;
  e.failed = static_cast<bool>(error);
  e.o.text = error ? b.copy(err.data(), err_n) : nullptr;
  b.publish();
  // A failed op often ends the process (an uncaught exception): write what there is now.
  if (error) flush();
}

void opStarted(const OpRecord& r) {
  if (t_depth == t_running.size()) t_running.emplace_back();
  Running& run = t_running[t_depth++];
  run.rec = &r;
  const GroupInfo* g = r.group.get();
  const size_t size = g ? static_cast<size_t>(g->size) : 0;
  run.group_hash = g ? fnv(kFnvBasis, g->name.data(), g->name.size()) : kFnvBasis;
  run.sent.assign(size, 0);
  run.received.assign(size, 0);
  if (g && g->p2p_messages.size() != 2 * size) g->p2p_messages.assign(2 * size, 0);
}

void opEnded(const OpRecord& r) {
  if (t_depth > 0 && t_running[t_depth - 1].rec == &r) --t_depth;
}

namespace {
// One flow event per op of `kind` in `ops`: the k-th message between the pair within a collective,
// or within the group's lifetime for point-to-point ops (which have no sequence number).
void flows(const std::vector<transport::Op>& ops, transport::Op::Kind kind) {
  if (t_depth == 0) return;
  Running& run = t_running[t_depth - 1];
  const OpRecord& r = *run.rec;
  const GroupInfo* g = r.group.get();
  if (!g) return;
  const bool out = kind == transport::Op::kSend;
  const int64_t now = nowUs();
  const int me = g->global_ranks[g->rank];
  ThreadBuffer& b = threadBuffer();
  for (const auto& o : ops) {
    if (o.kind != kind || o.peer < 0 || o.peer >= g->size) continue;
    uint64_t& k = r.seq != OpRecord::kNoSeq ? (out ? run.sent : run.received)[o.peer]
                                            : g->p2p_messages[(out ? 0 : g->size) + o.peer];
    const int peer = g->global_ranks[o.peer];
    Event& e = b.next(0);
    e.kind = out ? Event::kFlowOut : Event::kFlowIn;
    e.name = "message";
    e.cat = "flow";
    e.ts = now;
    e.dur = 0;
    e.s.index = -1;
    e.s.id = flowId(run.group_hash, r.seq, out ? me : peer, out ? peer : me, k++);
    b.publish();
  }
}
}  // namespace

void sending(const std::vector<transport::Op>& ops) { flows(ops, transport::Op::kSend); }
void received(const std::vector<transport::Op>& ops) { flows(ops, transport::Op::kRecv); }

}  // namespace dtrain::comm::trace::timeline
