// dtrain as a torch.distributed backend (backend.h).
#include "backend.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cstring>
#include <optional>

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"

namespace dtrain::python {

using c10d::OpType;
using RedOp = c10d::ReduceOp::RedOpType;

// ---- the store torch.distributed passes in, as dtrain's ----

namespace {

class StoreAdapter final : public comm::Store {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> s) : comm::Store(s->getTimeout()), s_(std::move(s)) {}
  void set(const std::string& key, const comm::Bytes& value) override { guard([&] { s_->set(key, value); }, key); }
  comm::Bytes get(const std::string& key) override {
    comm::Bytes out;
    guard([&] { out = s_->get(key); }, key);
    return out;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    int64_t v = 0;
    guard([&] { v = s_->add(key, delta); }, key);
    return v;
  }
  comm::Bytes compareSet(const std::string& key, const comm::Bytes& expected, const comm::Bytes& desired) override {
    comm::Bytes out;
    guard([&] { out = s_->compareSet(key, expected, desired); }, key);
    return out;
  }
  bool deleteKey(const std::string& key) override {
    bool out = false;
    guard([&] { out = s_->deleteKey(key); }, key);
    return out;
  }
  bool check(const std::vector<std::string>& keys) override {
    bool out = false;
    guard([&] { out = s_->check(keys); }, keys.empty() ? "" : keys[0]);
    return out;
  }
  void wait(const std::vector<std::string>& keys, comm::Duration timeout) override {
    guard([&] { s_->wait(keys, timeout); }, keys.empty() ? "" : keys[0]);
  }
  int64_t numKeys() override {
    int64_t n = 0;
    guard([&] { n = s_->getNumKeys(); }, "");
    return n;
  }
  std::shared_ptr<comm::Store> clone() const override {
    auto c = std::make_shared<StoreAdapter>(s_->clone());
    c->setTimeout(timeout());
    return c;
  }

 private:
  // c10d's errors as dtrain's: a store timeout is a TimeoutError naming the key.
  template <typename F>
  void guard(F&& f, const std::string& key) const {
    try {
      f();
    } catch (const c10::DistStoreError& e) {
      throw TimeoutError(fmt::format("torch.distributed store, key '{}': {}", key, e.what_without_backtrace()));
    } catch (const c10::Error& e) {
      throw Error(fmt::format("torch.distributed store, key '{}': {}", key, e.what_without_backtrace()));
    }
  }
  c10::intrusive_ptr<c10d::Store> s_;
};

// dtrain's errors as torch's: ValueError for bad arguments, DistBackendError for the rest (a timeout, a
// lost peer, a mismatch), with dtrain's message.
std::exception_ptr toTorch(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error&) {
    return std::current_exception();
  } catch (const InvalidArgument& x) {
    try {
      C10_THROW_ERROR(ValueError, x.what());
    } catch (...) {
      return std::current_exception();
    }
  } catch (const std::exception& x) {
    try {
      C10_THROW_ERROR(DistBackendError, x.what());
    } catch (...) {
      return std::current_exception();
    }
  }
  return e;
}

[[noreturn]] void refuse(const std::string& what) { C10_THROW_ERROR(ValueError, "dtrain: " + what); }

// ---- Work ----

class Work final : public c10d::Work {
 public:
  Work(int rank, OpType type, uint64_t seq, std::vector<at::Tensor> outputs, std::shared_ptr<Completer> completer)
      : c10d::Work(rank, type),
        seq_(seq),
        outputs_(std::move(outputs)),
        completer_(std::move(completer)),
        future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

  // Follows w: once it completes, `after` runs (copies into the caller's tensors) on the completing thread,
  // the Work finishes, and the future completes on the completer's thread; or right there when nobody
  // can have added a callback yet (the op completed before start() returned, or the caller waits at once:
  // a synchronous call), which spares a thread hand-off per call.
  void start(const comm::WorkPtr& w, std::function<void()> after, bool waited_at_once) {
    dw_ = w;
    inline_ = true;
    c10::intrusive_ptr<Work> self = c10::intrusive_ptr<Work>::reclaim_copy(this);
    w->onComplete([self, w, after = std::move(after)] {
      std::exception_ptr err;
      try {
        w->wait();  // completed: rethrows its error, if any
        if (after) after();
      } catch (...) {
        err = toTorch(std::current_exception());
      }
      self->finish(err);
      auto complete = [self, err] {
        if (err) self->future_->setError(err);
        else self->future_->markCompleted(c10::IValue(self->outputs_));
      };
      auto c = self->inline_.load() ? nullptr : self->completer_.lock();
      if (c) c->post(std::move(complete));
      else complete();  // no callback yet, or the backend is gone: here
    });
    inline_ = waited_at_once;  // else returned to the caller from here on, who may add callbacks
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (dw_) {
      try {
        if (timeout == kNoTimeout) dw_->wait();
        else dw_->wait(timeout);  // this thread runs queued ops of the group meanwhile
      } catch (const TimeoutError& e) {
        if (!dw_->isCompleted()) C10_THROW_ERROR(DistBackendError, e.what());
      } catch (...) {
        // the op's own error: finish() has it, and the base class rethrows it
      }
    }
    return c10d::Work::wait(kNoTimeout);  // finish() runs right after the op completes
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  uint64_t getSequencenumber() const override { return seq_; }

 private:
  uint64_t seq_;
  std::vector<at::Tensor> outputs_;
  std::weak_ptr<Completer> completer_;  // the backend's: a Work may outlive it
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  comm::WorkPtr dw_;
  std::atomic<bool> inline_{true};
};

// ---- tensors ----

const at::Tensor& single(const std::vector<at::Tensor>& ts, const char* op) {
  if (ts.size() != 1) refuse(fmt::format("{} takes one tensor per rank (got {})", op, ts.size()));
  return ts[0];
}

void checkDefined(const at::Tensor& t, const char* op) {
  if (!t.defined()) refuse(fmt::format("{}: undefined tensor", op));
  if (!t.device().is_cpu() && !t.device().is_cuda())
    refuse(fmt::format("{}: a tensor on {} (dtrain communicates CPU and CUDA tensors)", op, t.device().str()));
  if (t.is_sparse()) refuse(fmt::format("{}: a sparse tensor (dtrain does not support sparse collectives)", op));
}

// The tensor to communicate: t itself when contiguous, else a contiguous copy that `after` copies back.
at::Tensor dense(const at::Tensor& t, std::vector<std::function<void()>>& after, bool copy_back, const char* op) {
  checkDefined(t, op);
  if (t.is_contiguous()) return t;
  at::Tensor c = t.contiguous();
  if (copy_back) after.push_back([t, c]() mutable { t.copy_(c); });
  return c;
}

// A contiguous tensor's bytes, as a flat uint8 tensor on its storage.
at::Tensor bytes(const at::Tensor& c) { return c.reshape({-1}).view(at::kByte); }

std::optional<comm::ReduceOp> nativeOp(RedOp op) {
  switch (op) {
    case RedOp::SUM: return comm::ReduceOp::sum;
    case RedOp::AVG: return comm::ReduceOp::avg;
    case RedOp::PRODUCT: return comm::ReduceOp::prod;
    case RedOp::MIN: return comm::ReduceOp::min;
    case RedOp::MAX: return comm::ReduceOp::max;
    default: return std::nullopt;
  }
}

const char* opName(RedOp op) {
  switch (op) {
    case RedOp::SUM: return "SUM";
    case RedOp::AVG: return "AVG";
    case RedOp::PRODUCT: return "PRODUCT";
    case RedOp::MIN: return "MIN";
    case RedOp::MAX: return "MAX";
    case RedOp::BAND: return "BAND";
    case RedOp::BOR: return "BOR";
    case RedOp::BXOR: return "BXOR";
    case RedOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "?";
  }
}

// The reduce op as the comm layer runs it, after PREMUL_SUM's factor has been applied to `t` (a tensor
// this op may change); refusals for what makes no sense.
RedOp prepareOp(const c10d::ReduceOp& rop, at::Tensor& t, const char* op) {
  RedOp r = rop.op_;
  const bool integral = at::isIntegralType(t.scalar_type(), /*includeBool=*/true);
  if (r == RedOp::PREMUL_SUM) {
    auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(rop.supplement_.get());
    if (!s) refuse(fmt::format("{}: PREMUL_SUM without its factor", op));
    if (s->tensor_factor.defined()) t.mul_(s->tensor_factor.to(t.device()));
    else t.mul_(s->double_factor);
    return RedOp::SUM;
  }
  if ((r == RedOp::BAND || r == RedOp::BOR || r == RedOp::BXOR) && !integral)
    refuse(fmt::format("{}: ReduceOp.{} on a {} tensor (bitwise reductions take integer or bool tensors)", op, opName(r),
                       c10::toString(t.scalar_type())));
  if (r == RedOp::AVG && t.scalar_type() == c10::kBool) refuse(fmt::format("{}: ReduceOp.AVG on a bool tensor", op));
  if (r > RedOp::PREMUL_SUM) refuse(fmt::format("{}: reduce op {}", op, static_cast<int>(r)));
  if (t.is_complex() && r != RedOp::SUM && r != RedOp::AVG)
    refuse(fmt::format("{}: ReduceOp.{} on a complex tensor", op, opName(r)));
  return r;
}

bool native(const at::Tensor& t, RedOp op) { return commDTypeOf(t.scalar_type()) && nativeOp(op); }

// Row r of g is rank r's contribution; the reduction over the rows, as t's dtype, by torch (the
// reductions the comm layer has no kernel for).
at::Tensor reduceRows(const at::Tensor& g, RedOp op, int size) {
  const auto dt = g.scalar_type();
  const bool boolean = dt == c10::kBool;
  switch (op) {
    case RedOp::SUM: return boolean ? g.any(0) : g.sum(0).to(dt);
    case RedOp::AVG: {
      at::Tensor s = g.sum(0);
      return (at::isIntegralType(dt, false) ? at::div(s, size, "trunc") : s / size).to(dt);
    }
    case RedOp::PRODUCT: return boolean ? g.all(0) : g.prod(0).to(dt);
    case RedOp::MIN: return boolean ? g.all(0) : std::get<0>(g.min(0));
    case RedOp::MAX: return boolean ? g.any(0) : std::get<0>(g.max(0));
    case RedOp::BAND:
    case RedOp::BOR:
    case RedOp::BXOR: {
      at::Tensor r = g[0].clone();
      for (int64_t i = 1; i < g.size(0); ++i) {
        if (op == RedOp::BAND) r.bitwise_and_(g[i]);
        else if (op == RedOp::BOR) r.bitwise_or_(g[i]);
        else r.bitwise_xor_(g[i]);
      }
      return r;
    }
    default: break;
  }
  refuse(fmt::format("reduce op {}", static_cast<int>(op)));
}

std::function<void()> sequence(std::vector<std::function<void()>> fs) {
  if (fs.empty()) return {};
  return [fs = std::move(fs)] {
    for (const auto& f : fs) f();
  };
}

}  // namespace

// ---- Completer ----

Completer::~Completer() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.get_id() == std::this_thread::get_id()) t.detach();  // the last owner let go inside a task
    else t.join();
  }
}

void Completer::post(std::function<void()> task) {
  std::lock_guard<std::mutex> g(mu_);
  tasks_.push_back(std::move(task));
  if (idle_ == 0 && static_cast<int>(threads_.size()) < kMaxThreads) threads_.emplace_back([this] { loop(); });
  else cv_.notify_one();
}

void Completer::loop() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(l, [&] { return stop_ || !tasks_.empty(); });
    --idle_;
    if (tasks_.empty()) return;
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    l.unlock();
    try {
      task();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dtrain: a future's callback threw: %s\n", e.what());
    }
    l.lock();
  }
}

// ---- the backend ----

struct DtrainBackend::Op {
  DtrainBackend& b;
  OpType type;
  const char* name;
  bool async;
  std::vector<at::Tensor> outputs;
  std::vector<std::function<void()>> after;  // once the op is done: results into place
  std::vector<std::function<void()>> back;   // then: copies back into non-contiguous caller tensors

  // Issues what `issue` returns and wraps it in the c10d Work; an error while issuing raises at the call.
  c10::intrusive_ptr<c10d::Work> run(const std::function<comm::WorkPtr()>& issue) {
    comm::WorkPtr w;
    try {
      if (async) {
        comm::IssueAndMoveOn g;
        w = issue();
      } else {
        w = issue();
      }
    } catch (...) {
      std::rethrow_exception(toTorch(std::current_exception()));
    }
    for (auto& f : back) after.push_back(std::move(f));
    auto work = c10::make_intrusive<Work>(b.rank_, type, ++b.seq_, std::move(outputs), b.completer_);
    work->start(w, sequence(std::move(after)), !async);
    return work;
  }
};

DtrainBackend::DtrainBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             std::chrono::milliseconds timeout, std::string name)
    : c10d::Backend(rank, size), completer_(std::make_shared<Completer>()) {
  comm::GroupOptions o;
  try {
    o = comm::GroupOptions::fromEnv();
    o.timeout = timeout;
    o.name = std::move(name);
    auto s = std::make_shared<StoreAdapter>(store);
    s->setTimeout(timeout);
    pg_ = comm::ProcessGroup::create(s, rank, size, o);
  } catch (...) {
    std::rethrow_exception(toTorch(std::current_exception()));
  }
}

DtrainBackend::~DtrainBackend() = default;

namespace {
// All of `parts`, as one Work: done when the last is, with the first error.
comm::WorkPtr all(const std::vector<comm::WorkPtr>& parts) {
  comm::WorkPtr w = parts.at(0);
  for (size_t i = 1; i < parts.size(); ++i) w = w->then([p = parts[i]] { return p; });
  return w;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> DtrainBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                        const c10d::BroadcastOptions& opts) {
  Op op{*this, OpType::BROADCAST, "broadcast", opts.asyncOp, tensors, {}, {}};
  const at::Tensor& t = single(tensors, op.name);
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor c = dense(t, op.back, rank_ != root, op.name);
  return op.run([&] { return device::broadcast(*pg_, bytes(c), root); });
}

comm::WorkPtr DtrainBackend::issueAllreduce(Op& op, at::Tensor c, const c10d::ReduceOp& rop) {
  const RedOp r = prepareOp(rop, c, op.name);
  if (native(c, r)) return device::allreduce(*pg_, c, *nativeOp(r));
  // All-gather every rank's tensor and reduce here.
  at::Tensor g = at::empty({size_, c.numel()}, c.options());
  const int n = size_;
  op.after.push_back([c, g, r, n]() mutable { c.copy_(reduceRows(g, r, n).view_as(c)); });
  return device::allgather(*pg_, bytes(c), bytes(g));
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::AllreduceOptions& opts) {
  Op op{*this, OpType::ALLREDUCE, "all_reduce", opts.asyncOp, tensors, {}, {}};
  at::Tensor c = dense(single(tensors, op.name), op.back, true, op.name);
  return op.run([&] { return issueAllreduce(op, c, opts.reduceOp); });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceCoalescedOptions& opts) {
  Op op{*this, OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", opts.asyncOp, tensors, {}, {}};
  if (tensors.empty()) refuse("all_reduce_coalesced: no tensors");
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) {
    checkDefined(t, op.name);
    if (t.scalar_type() != tensors[0].scalar_type() || t.device() != tensors[0].device())
      refuse("all_reduce_coalesced: the tensors must have one dtype and one device");
    flat.push_back(t.reshape({-1}));
  }
  // One flat buffer, reduced as one tensor, copied back.
  at::Tensor buf = at::cat(flat);
  op.back.push_back([tensors, buf]() mutable {
    int64_t off = 0;
    for (auto& t : tensors) {
      t.copy_(buf.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
  });
  return op.run([&] { return issueAllreduce(op, buf, opts.reduceOp); });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  Op op{*this, OpType::REDUCE, "reduce", opts.asyncOp, tensors, {}, {}};
  const at::Tensor& t = single(tensors, op.name);
  checkDefined(t, op.name);
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor c = t.contiguous().clone();  // PREMUL_SUM scales it; t changes on the root only
  return op.run([&]() -> comm::WorkPtr {
    const RedOp r = prepareOp(opts.reduceOp, c, op.name);
    if (native(c, r)) {
      at::Tensor out = at::empty_like(c);
      const auto dt = *commDTypeOf(c.scalar_type());
      const auto rop = *nativeOp(r);
      const size_t n = static_cast<size_t>(c.numel());
      if (rank_ == root) op.after.push_back([t, out]() mutable { t.copy_(out.view_as(t)); });
      return device::onHost(*pg_, c, out, [this, n, dt, rop, root](const void* in, void* o) {
        return pg_->reduce(in, o, n, dt, rop, root);
      });
    }
    at::Tensor g = at::empty({size_, c.numel()}, c.options());
    const int n = size_;
    if (rank_ == root) op.after.push_back([t, g, r, n]() mutable { t.copy_(reduceRows(g, r, n).view_as(t)); });
    return device::allgather(*pg_, bytes(c), bytes(g));
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, "all_gather");
  if (outputs.size() != 1 || outputs[0].size() != static_cast<size_t>(size_))
    refuse(fmt::format("all_gather: the output list must hold {} tensors (the group's size)", size_));
  std::vector<at::Tensor> outs = outputs[0];
  Op op{*this, OpType::ALLGATHER, "all_gather", opts.asyncOp, outs, {}, {}};
  at::Tensor c = dense(in, op.back, false, op.name);
  std::vector<size_t> counts;
  bool even = true;
  for (const auto& o : outs) {
    checkDefined(o, op.name);
    if (o.scalar_type() != in.scalar_type()) refuse("all_gather: the outputs must have the input's dtype");
    counts.push_back(static_cast<size_t>(o.numel()) * o.element_size());
    even = even && o.numel() == in.numel();
  }
  if (static_cast<int64_t>(counts[static_cast<size_t>(rank_)]) != c.numel() * c.element_size())
    refuse(fmt::format("all_gather: output {} has {} elements, the input {}", rank_, outs[rank_].numel(), c.numel()));
  int64_t total = 0;
  for (size_t k : counts) total += static_cast<int64_t>(k);
  at::Tensor flat = at::empty({total}, c.options().dtype(at::kByte));
  op.after.push_back([outs, flat, counts]() mutable {
    int64_t off = 0;
    for (size_t r = 0; r < outs.size(); ++r) {
      const auto k = static_cast<int64_t>(counts[r]);
      if (outs[r].is_contiguous()) bytes(outs[r]).copy_(flat.narrow(0, off, k));
      else outs[r].copy_(flat.narrow(0, off, k).view(outs[r].scalar_type()).view(outs[r].sizes()));
      off += k;
    }
  });
  if (even) return op.run([&] { return device::allgather(*pg_, bytes(c), flat); });
  return op.run([&] {
    return device::onHost(*pg_, bytes(c), flat, [this, counts](const void* i, void* o) {
      return pg_->allgatherv(i, o, counts, comm::DType::u8);
    });
  });
}

comm::WorkPtr DtrainBackend::issueAllgatherBase(Op& op, const at::Tensor& output, const at::Tensor& input) {
  checkDefined(output, op.name);
  checkDefined(input, op.name);
  if (output.numel() != input.numel() * size_)
    refuse(fmt::format("{}: the output has {} elements, {} x the input's {} expected", op.name, output.numel(), size_,
                       input.numel()));
  if (output.scalar_type() != input.scalar_type()) refuse(fmt::format("{}: the output must have the input's dtype", op.name));
  at::Tensor c = dense(input, op.back, false, op.name);
  at::Tensor o = dense(output, op.back, true, op.name);
  return device::allgather(*pg_, bytes(c), bytes(o));
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                              const c10d::AllgatherOptions& opts) {
  Op op{*this, OpType::_ALLGATHER_BASE, "all_gather_into_tensor", opts.asyncOp, {output}, {}, {}};
  return op.run([&] { return issueAllgatherBase(op, output, input); });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                              std::vector<at::Tensor>& inputs,
                                                                              const c10d::AllgatherOptions& opts) {
  Op op{*this, OpType::ALLGATHER_INTO_TENSOR_COALESCED, "all_gather_into_tensor_coalesced", opts.asyncOp, outputs, {}, {}};
  if (outputs.size() != inputs.size() || inputs.empty()) refuse(fmt::format("{}: as many outputs as inputs, at least one", op.name));
  return op.run([&] {
    std::vector<comm::WorkPtr> parts;
    for (size_t i = 0; i < inputs.size(); ++i) parts.push_back(issueAllgatherBase(op, outputs[i], inputs[i]));
    return all(parts);
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs, "gather");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs = rank_ == root && !outputs.empty() ? outputs[0] : std::vector<at::Tensor>{};
  if (rank_ == root && (outputs.size() != 1 || outs.size() != static_cast<size_t>(size_)))
    refuse(fmt::format("gather: the root's output list must hold {} tensors", size_));
  Op op{*this, OpType::GATHER, "gather", opts.asyncOp, outs, {}, {}};
  at::Tensor c = dense(in, op.back, false, op.name);
  const int64_t nb = c.numel() * c.element_size();
  for (const auto& o : outs)
    if (o.numel() * o.element_size() != nb) refuse("gather: every output must have the input's size and dtype");
  at::Tensor flat = rank_ == root ? at::empty({nb * size_}, c.options().dtype(at::kByte)) : bytes(c);
  if (rank_ == root)
    op.after.push_back([outs, flat, nb]() mutable {
      for (size_t r = 0; r < outs.size(); ++r)
        outs[r].copy_(flat.narrow(0, static_cast<int64_t>(r) * nb, nb).view(outs[r].scalar_type()).view(outs[r].sizes()));
    });
  return op.run([&] {
    return device::onHost(*pg_, bytes(c), flat, [this, nb, root](const void* i, void* o) {
      return pg_->gather(i, o, static_cast<size_t>(nb), comm::DType::u8, root);
    });
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::scatter(std::vector<at::Tensor>& outputs,
                                                      std::vector<std::vector<at::Tensor>>& inputs,
                                                      const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  Op op{*this, OpType::SCATTER, "scatter", opts.asyncOp, outputs, {}, {}};
  at::Tensor c = dense(out, op.back, true, op.name);
  const int64_t nb = c.numel() * c.element_size();
  at::Tensor flat = bytes(c);
  if (rank_ == root) {
    if (inputs.size() != 1 || inputs[0].size() != static_cast<size_t>(size_))
      refuse(fmt::format("scatter: the root's input list must hold {} tensors", size_));
    std::vector<at::Tensor> parts;
    for (const auto& t : inputs[0]) {
      checkDefined(t, op.name);
      if (t.numel() * t.element_size() != nb) refuse("scatter: every input must have the output's size and dtype");
      parts.push_back(bytes(t.contiguous()));
    }
    flat = at::cat(parts);
  }
  return op.run([&] {
    return device::onHost(*pg_, flat, bytes(c), [this, nb, root](const void* i, void* o) {
      return pg_->scatter(i, o, static_cast<size_t>(nb), comm::DType::u8, root);
    });
  });
}

comm::WorkPtr DtrainBackend::issueReduceScatter(Op& op, const at::Tensor& out, const std::vector<at::Tensor>& ins,
                                                const c10d::ReduceOp& rop) {
  checkDefined(out, op.name);
  if (ins.size() != static_cast<size_t>(size_)) refuse(fmt::format("{}: the input list must hold {} tensors", op.name, size_));
  std::vector<at::Tensor> parts;
  std::vector<size_t> counts;
  bool even = true;
  for (const auto& t : ins) {
    checkDefined(t, op.name);
    if (t.scalar_type() != out.scalar_type()) refuse(fmt::format("{}: the inputs must have the output's dtype", op.name));
    parts.push_back(t.reshape({-1}));
    counts.push_back(static_cast<size_t>(t.numel()));
    even = even && t.numel() == out.numel();
  }
  if (static_cast<int64_t>(counts[static_cast<size_t>(rank_)]) != out.numel())
    refuse(fmt::format("{}: input {} has {} elements, the output {}", op.name, rank_, counts[static_cast<size_t>(rank_)],
                       out.numel()));
  at::Tensor flat = at::cat(parts);  // a copy: PREMUL_SUM may scale it
  at::Tensor c = dense(out, op.back, true, op.name);
  const RedOp r = prepareOp(rop, flat, op.name);
  if (native(flat, r)) {
    const auto dt = *commDTypeOf(flat.scalar_type());
    const auto cop = *nativeOp(r);
    if (even) return device::reduceScatter(*pg_, flat, c, cop);
    return device::onHost(*pg_, flat, c, [this, counts, dt, cop](const void* i, void* o) {
      return pg_->reduceScatterv(i, o, counts, dt, cop);
    });
  }
  at::Tensor g = at::empty({size_, flat.numel()}, flat.options());
  int64_t off = 0;
  for (int q = 0; q < rank_; ++q) off += static_cast<int64_t>(counts[static_cast<size_t>(q)]);
  const int n = size_;
  op.after.push_back([c, g, r, n, off]() mutable { c.copy_(reduceRows(g, r, n).narrow(0, off, c.numel()).view_as(c)); });
  return device::allgather(*pg_, bytes(flat), bytes(g));
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                             std::vector<std::vector<at::Tensor>>& inputs,
                                                             const c10d::ReduceScatterOptions& opts) {
  Op op{*this, OpType::REDUCE_SCATTER, "reduce_scatter", opts.asyncOp, outputs, {}, {}};
  const at::Tensor& out = single(outputs, op.name);
  if (inputs.size() != 1) refuse("reduce_scatter: one input list per rank");
  return op.run([&] { return issueReduceScatter(op, out, inputs[0], opts.reduceOp); });
}

namespace {
// in's blocks of out's size, as reduce_scatter's input list.
std::vector<at::Tensor> blocks(const at::Tensor& in, const at::Tensor& out, int size, const char* what) {
  if (!in.defined() || !out.defined()) refuse(fmt::format("{}: undefined tensor", what));
  if (in.numel() != out.numel() * size)
    refuse(fmt::format("{}: the input has {} elements, {} x the output's {} expected", what, in.numel(), size, out.numel()));
  at::Tensor flat = in.reshape({-1});
  std::vector<at::Tensor> b;
  for (int r = 0; r < size; ++r) b.push_back(flat.narrow(0, r * out.numel(), out.numel()));
  return b;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> DtrainBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::ReduceScatterOptions& opts) {
  Op op{*this, OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor", opts.asyncOp, {output}, {}, {}};
  return op.run([&] { return issueReduceScatter(op, output, blocks(input, output, size_, op.name), opts.reduceOp); });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                              std::vector<at::Tensor>& inputs,
                                                                              const c10d::ReduceScatterOptions& opts) {
  Op op{*this, OpType::REDUCE_SCATTER_TENSOR_COALESCED, "reduce_scatter_tensor_coalesced", opts.asyncOp, outputs, {}, {}};
  if (outputs.size() != inputs.size() || inputs.empty()) refuse(fmt::format("{}: as many outputs as inputs, at least one", op.name));
  return op.run([&] {
    std::vector<comm::WorkPtr> parts;
    for (size_t i = 0; i < inputs.size(); ++i)
      parts.push_back(issueReduceScatter(op, outputs[i], blocks(inputs[i], outputs[i], size_, op.name), opts.reduceOp));
    return all(parts);
  });
}

namespace {
// Byte counts per peer from split sizes in rows (empty: even).
std::vector<size_t> splitBytes(const at::Tensor& t, const std::vector<int64_t>& splits, int size, const char* which) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : t.numel() * t.element_size() / rows;
  std::vector<size_t> out;
  if (splits.empty()) {
    if (rows % size != 0)
      refuse(fmt::format("all_to_all_single: the {} has {} rows, not a multiple of the group's size {}", which, rows, size));
    out.assign(static_cast<size_t>(size), static_cast<size_t>(rows / size * row_bytes));
    return out;
  }
  if (splits.size() != static_cast<size_t>(size))
    refuse(fmt::format("all_to_all_single: {} {} splits for a group of {}", splits.size(), which, size));
  int64_t sum = 0;
  for (int64_t s : splits) {
    if (s < 0) refuse(fmt::format("all_to_all_single: a negative {} split", which));
    sum += s;
    out.push_back(static_cast<size_t>(s * row_bytes));
  }
  if (sum != rows) refuse(fmt::format("all_to_all_single: the {} splits add up to {}, the tensor has {} rows", which, sum, rows));
  return out;
}
}  // namespace

// Every rank sends send[r] bytes to rank r and receives recv[r] from it (in and out: host byte buffers).
static comm::WorkPtr exchange(comm::ProcessGroup& pg, const void* in, void* out, const std::vector<size_t>& send,
                              const std::vector<size_t>& recv) {
  const int size = pg.size(), rank = pg.rank();
  std::vector<comm::P2POp> ops;
  size_t si = 0, ri = 0;
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(out);
  size_t self_in = 0, self_out = 0;
  for (int r = 0; r < size; ++r) {
    const auto ur = static_cast<size_t>(r);
    if (r == rank) {
      self_in = si;
      self_out = ri;
    } else {
      if (send[ur]) ops.push_back({comm::P2POp::kSend, const_cast<uint8_t*>(src + si), send[ur], comm::DType::u8, r, 0x7A7A});
      if (recv[ur]) ops.push_back({comm::P2POp::kRecv, dst + ri, recv[ur], comm::DType::u8, r, 0x7A7A});
    }
    si += send[ur];
    ri += recv[ur];
  }
  const size_t mine = send[static_cast<size_t>(rank)];
  if (mine != recv[static_cast<size_t>(rank)])
    throw InvalidArgument(fmt::format("all_to_all: rank {} sends itself {} bytes but expects {}", rank, mine,
                                      recv[static_cast<size_t>(rank)]));
  if (mine) std::memmove(dst + self_out, src + self_in, mine);
  if (ops.empty()) return pg.localStep("all_to_all: nothing to exchange", [] {});
  return pg.sendRecv(std::move(ops));
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& output_splits,
                                                            std::vector<int64_t>& input_splits,
                                                            const c10d::AllToAllOptions& opts) {
  Op op{*this, OpType::ALLTOALL_BASE, "all_to_all_single", opts.asyncOp, {output}, {}, {}};
  checkDefined(input, op.name);
  checkDefined(output, op.name);
  if (input.scalar_type() != output.scalar_type()) refuse("all_to_all_single: the output must have the input's dtype");
  const auto send = splitBytes(input, input_splits, size_, "input");
  const auto recv = splitBytes(output, output_splits, size_, "output");
  at::Tensor c = dense(input, op.back, false, op.name);
  at::Tensor o = dense(output, op.back, true, op.name);
  if (input_splits.empty() && output_splits.empty() && send == recv)
    return op.run([&] {
      const size_t per = send[0];
      return device::onHost(*pg_, bytes(c), bytes(o), [this, per](const void* i, void* out) {
        return pg_->alltoall(i, out, per, comm::DType::u8);
      });
    });
  return op.run([&] {
    return device::onHost(*pg_, bytes(c), bytes(o), [this, send, recv](const void* i, void* out) {
      return exchange(*pg_, i, out, send, recv);
    });
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                       const c10d::AllToAllOptions& opts) {
  if (outputs.size() != static_cast<size_t>(size_) || inputs.size() != static_cast<size_t>(size_))
    refuse(fmt::format("all_to_all: {} inputs and {} outputs for a group of {}", inputs.size(), outputs.size(), size_));
  Op op{*this, OpType::ALLTOALL, "all_to_all", opts.asyncOp, outputs, {}, {}};
  std::vector<at::Tensor> ins;
  std::vector<size_t> send, recv;
  size_t total_out = 0;
  for (size_t r = 0; r < inputs.size(); ++r) {
    checkDefined(inputs[r], op.name);
    checkDefined(outputs[r], op.name);
    if (inputs[r].scalar_type() != outputs[r].scalar_type()) refuse("all_to_all: every output must have its input's dtype");
    ins.push_back(bytes(inputs[r].contiguous()));
    send.push_back(static_cast<size_t>(inputs[r].numel() * inputs[r].element_size()));
    recv.push_back(static_cast<size_t>(outputs[r].numel() * outputs[r].element_size()));
    total_out += recv.back();
  }
  at::Tensor in = at::cat(ins);
  at::Tensor out = at::empty({static_cast<int64_t>(total_out)}, in.options());
  op.after.push_back([outputs, out, recv]() mutable {
    int64_t off = 0;
    for (size_t r = 0; r < outputs.size(); ++r) {
      const auto k = static_cast<int64_t>(recv[r]);
      outputs[r].copy_(out.narrow(0, off, k).view(outputs[r].scalar_type()).view(outputs[r].sizes()));
      off += k;
    }
  });
  return op.run([&] {
    return device::onHost(*pg_, in, out, [this, send, recv](const void* i, void* o) {
      return exchange(*pg_, i, o, send, recv);
    });
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  Op op{*this, OpType::SEND, "send", true, tensors, {}, {}};
  at::Tensor c = dense(single(tensors, op.name), op.back, false, op.name);
  if (dst < 0 || dst >= size_ || dst == rank_) refuse(fmt::format("send: destination rank {} (group of {}, this is rank {})", dst, size_, rank_));
  const auto nb = static_cast<size_t>(c.numel() * c.element_size());
  return op.run([&] {
    return device::onHost(*pg_, bytes(c), bytes(c), [this, nb, dst, tag](const void* i, void*) {
      return pg_->send(i, nb, comm::DType::u8, dst, static_cast<uint32_t>(tag));
    });
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  Op op{*this, OpType::RECV, "recv", true, tensors, {}, {}};
  at::Tensor c = dense(single(tensors, op.name), op.back, true, op.name);
  if (src < 0 || src >= size_ || src == rank_) refuse(fmt::format("recv: source rank {} (group of {}, this is rank {})", src, size_, rank_));
  const auto nb = static_cast<size_t>(c.numel() * c.element_size());
  return op.run([&] {
    return device::onHost(*pg_, bytes(c), bytes(c), [this, nb, src, tag](const void*, void* o) {
      return pg_->recv(o, nb, comm::DType::u8, src, static_cast<uint32_t>(tag));
    });
  });
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  refuse("dtrain does not support recv from any source (recv without src): name the sender");
}

c10::intrusive_ptr<c10d::Work> DtrainBackend::barrier(const c10d::BarrierOptions& opts) {
  Op op{*this, OpType::BARRIER, "barrier", opts.asyncOp, {}, {}, {}};
  return op.run([&] { return pg_->barrier(); });
}

c10::intrusive_ptr<c10d::Backend> createBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                std::chrono::milliseconds timeout, const std::string& name) {
  return c10::make_intrusive<DtrainBackend>(store, rank, size, timeout, name);
}

}  // namespace dtrain::python
