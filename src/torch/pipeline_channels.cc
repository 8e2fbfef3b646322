// The pipeline's messages (see pipeline_channels.h).
#include "pipeline_channels.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>

#include "dtrain/comm/error.h"
#include "dtrain/tensor.h"
#include "errors.h"

namespace dtrain::detail {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kMagic = 0x5049504532LL;  // "PIPE2"
constexpr int kMaxDims = 8;
// magic, mode, step, kind, chunk, micro, scalar type, ndim, dims[8]
constexpr int kHeaderFields = 8;
constexpr int kHeaderLen = kHeaderFields + kMaxDims;
constexpr uint32_t kTagHeader = 0x5001, kTagData = 0x5002;

double msSince(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

void PipelineChannels::open(comm::ProcessGroup& pg, int chunks, int micro_batches,
                            c10::optional<c10::ScalarType> param_dtype) {
  stage_ = pg.rank();
  stages_ = pg.size();
  chunks_ = chunks;
  micro_batches_ = micro_batches;
  param_dtype_ = param_dtype;
  if (stages_ == 1) return;
  // Every rank walks the same list; newGroup returns a group to its two members.
  std::vector<std::pair<int, int>> links;
  for (int r = 0; r + 1 < stages_; ++r) {
    links.emplace_back(r, r + 1);
    links.emplace_back(r + 1, r);
  }
  if (chunks > 1 && stages_ > 2) {
    links.emplace_back(stages_ - 1, 0);
    links.emplace_back(0, stages_ - 1);
  }
  for (auto [from, to] : links) {
    auto g = pg.newGroup({from, to});
    if (stage_ == from) out_[to] = g;
    if (stage_ == to) in_[from] = g;
  }
}

void PipelineChannels::beginStep(int64_t step) {
  step_ = step;
  early_.clear();
  for (auto& sd : sent_)  // left by a failed step: kept while an op may still read them
    if (!sd.work->isCompleted()) orphans_.push_back(sd.keep);
  sent_.clear();
}

void PipelineChannels::abortAll(const std::string& msg, std::vector<comm::WorkPtr>& aborts) {
  for (auto& [peer, ch] : in_) aborts.push_back(ch->abort(msg));
  for (auto& [peer, ch] : out_) aborts.push_back(ch->abort(msg));
}

void PipelineChannels::reapSends(bool all, double& comm_ms) {
  while (!sent_.empty() && (all || sent_.front().work->isCompleted())) {
    auto t0 = Clock::now();
    try {
      sent_.front().work->wait();
    } catch (...) {
      rethrowWithContext("sending to stage " + std::to_string(sent_.front().dst) + channelNote(sent_.front().dst, true));
    }
    comm_ms += msSince(t0);
    sent_.pop_front();
  }
}

// The channel errors come from two-rank groups, which number their ranks 0 (sender) and 1.
std::string PipelineChannels::channelNote(int peer, bool sending) const {
  const int from = sending ? stage_ : peer, to = sending ? peer : stage_;
  return fmt::format(" (on the channel stage {} -> stage {}, whose ranks 0 and 1 are stages {} and {}): ", from, to,
                     from, to);
}

void PipelineChannels::send(int dst, Kind kind, int chunk, int m, Mode mode, const at::Tensor& t) {
  DTRAIN_CHECK(t.dim() <= kMaxDims, InvalidArgument, "the {} has {} dims, at most {} can be sent",
               kind == kActivation ? "output" : "input gradient", t.dim(), kMaxDims);
  at::Tensor data = t.detach().contiguous();
  if (data.device().is_cuda()) data = data.cpu();  // CUDA tensors travel through the host
  const Key key{kind, chunk, m};
  if (dst == stage_) {  // one stage (interleaved chunks on one rank): no message
    early_[stage_][key] = data;
    return;
  }
  checkCommTensor(data, kind == kActivation ? "pipeline activation" : "pipeline gradient");
  at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
  auto* p = h.data_ptr<int64_t>();
  std::array<int64_t, kHeaderFields> fields{kMagic, mode, step_, kind, chunk, m,
                                            static_cast<int64_t>(data.scalar_type()), data.dim()};
  std::copy(fields.begin(), fields.end(), p);
  for (int64_t d = 0; d < data.dim(); ++d) p[kHeaderFields + d] = data.size(d);
  double ignored = 0;
  reapSends(false, ignored);
  comm::IssueAndMoveOn move_on;  // the channel's thread sends; this one computes on
  const auto& ch = out_.at(dst);
  // Header and data as one op of the channel (one hand-over to its thread); the receiver takes them
  // as two, learning the data's shape from the header.
  auto work = ch->sendRecv({{comm::P2POp::kSend, h.data_ptr(), kHeaderLen, comm::DType::i64, 1, kTagHeader},
                            {comm::P2POp::kSend, data.data_ptr(), static_cast<size_t>(data.numel()),
                             toCommDType(data.scalar_type()), 1, kTagData}});
  sent_.push_back({work, h, dst});
  sent_.push_back({work, data, dst});
}

// One message from src: its header, checked, then its data.
std::pair<PipelineChannels::Key, at::Tensor> PipelineChannels::takeMessage(int src, Mode mode) {
  const auto& ch = in_.at(src);
  at::Tensor h = at::zeros({kHeaderLen}, at::kLong);
  try {
    ch->recv(h.data_ptr(), kHeaderLen, comm::DType::i64, 0, kTagHeader)->wait();
  } catch (...) {
    orphans_.push_back(h);  // a receive that timed out may still be running
    throw;
  }
  const auto* p = h.data_ptr<int64_t>();
  DTRAIN_CHECK(p[0] == kMagic, ProtocolError, "rank {} (stage {}) sent something that is not a pipeline header", src,
               src);
  const char* modes[] = {"step", "forward"};
  DTRAIN_CHECK(p[1] == mode && p[2] == step_, ProtocolError,
               "rank {} (stage {}) sent a message of {} {}, this rank is in {} {}: do all stages call the same "
               "sequence of step() / forward()?",
               src, src, (p[1] == 0 || p[1] == 1) ? modes[p[1]] : "?", p[2], modes[mode], step_);
  DTRAIN_CHECK((p[3] == kActivation || p[3] == kGradient) && p[4] >= 0 && p[4] < chunks_ && p[5] >= 0 &&
                   p[5] < micro_batches_,
               ProtocolError, "rank {} sent a header for kind {}, chunk {}, micro-batch {}", src, p[3], p[4], p[5]);
  const int64_t ndim = p[7];
  DTRAIN_CHECK(ndim >= 0 && ndim <= kMaxDims, ProtocolError, "rank {} sent a header with {} dims", src, ndim);
  std::vector<int64_t> shape(p + kHeaderFields, p + kHeaderFields + ndim);
  for (int64_t d : shape) DTRAIN_CHECK(d >= 0, ProtocolError, "rank {} sent a negative dim", src);
  const auto type = static_cast<c10::ScalarType>(p[6]);
  toCommDType(type, "pipeline activation");
  if (p[3] == kActivation && param_dtype_ && at::isFloatingType(type) && type != *param_dtype_) {
    throw InvalidArgument(fmt::format(
        "rank {} (stage {}) sends a {} activation of shape {}, but this stage's parameters are {}: "
        "every stage must use the same floating dtype",
        src, src, c10::toString(type), shapeText(shape), c10::toString(*param_dtype_)));
  }
  at::Tensor x = at::empty(shape, at::TensorOptions().dtype(type));
  try {
    ch->recv(x.data_ptr(), static_cast<size_t>(x.numel()), toCommDType(type), 0, kTagData)->wait();
  } catch (...) {
    orphans_.push_back(x);
    throw;
  }
  return {Key{p[3], p[4], p[5]}, x};
}

at::Tensor PipelineChannels::receive(int src, Kind kind, int c, int m, Mode mode, double& comm_ms) {
  auto& kept = early_[src];
  const Key want{kind, c, m};
  const auto t0 = Clock::now();
  for (;;) {
    if (auto it = kept.find(want); it != kept.end()) {
      at::Tensor x = std::move(it->second);
      kept.erase(it);
      comm_ms += msSince(t0);
      return x;
    }
    DTRAIN_CHECK(src != stage_, ProtocolError, "chunk {} of this stage has no {} for micro-batch {}", c,
                 kind == kActivation ? "input" : "gradient", m);
    std::pair<Key, at::Tensor> msg;
    try {
      msg = takeMessage(src, mode);
    } catch (...) {
      rethrowWithContext(fmt::format("receiving the {} of micro-batch {}{} from stage {}{}",
                                     kind == kActivation ? "activation" : "gradient", m,
                                     chunks_ > 1 ? fmt::format(" (chunk {})", c) : "", src, channelNote(src, false)));
    }
    auto& [key, x] = msg;
    DTRAIN_CHECK(kept.emplace(key, std::move(x)).second, ProtocolError,
                 "rank {} sent the {} of chunk {} micro-batch {} twice", src,
                 std::get<0>(key) == kActivation ? "activation" : "gradient", std::get<1>(key), std::get<2>(key));
  }
}

}  // namespace dtrain::detail
