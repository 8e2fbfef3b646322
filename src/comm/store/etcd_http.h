// The etcd v3 JSON gateway over HTTP (libcurl): one POST per call, endpoints failed over in order.
// Internal to EtcdStore. Keys and values travel base64-encoded; int64 fields arrive as JSON strings.
#pragma once
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "dtrain/comm/fd.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::etcd {

using net::Clock;

using Json = nlohmann::json;

std::string base64(const std::string& bytes);
// ProtocolError naming `what` when the text is not base64.
std::string unbase64(const std::string& text, const std::string& what);
// An int64 field of an answer: absent means 0 (proto3 JSON leaves zeros out), strings are parsed.
int64_t integer(const Json& j, const char* field);
// The range_end that makes a range cover every key starting with prefix ("\0" for every key).
std::string prefixEnd(const std::string& prefix);
// "http://a:2379, b:2379" -> {"http://a:2379", "http://b:2379"}; InvalidArgument when none.
std::vector<std::string> splitEndpoints(const std::string& list);

// Whether a request may go to the next member after one received it and failed to answer.
enum class Retry { kAlways, kOnlyUnsent };

// An error etcd answered with (HTTP status and gRPC code), e.g. code 5 "requested lease not found".
class AnswerError : public RendezvousError {
 public:
  AnswerError(const std::string& msg, int code) : RendezvousError(msg), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};
inline constexpr int kCodeInvalidArgument = 3;
inline constexpr int kCodeNotFound = 5;
inline constexpr int kCodeResourceExhausted = 8;  // e.g. a request over the gRPC limit
inline constexpr int kCodeUnavailable = 14;

class Http {
 public:
  explicit Http(const std::string& endpoints);
  ~Http();
  Http(const Http&) = delete;
  Http& operator=(const Http&) = delete;

  // POSTs body to path ("/v3/kv/range") and returns the answer. Moves on to the next endpoint when
  // one cannot be reached, round after round until `deadline`; then RendezvousError naming each
  // endpoint's failure. `what` starts every message ("EtcdStore get('k') (prefix '/p/')").
  // etcd's error answers: InvalidArgument for its codes 3 and 8 (too large), AnswerError otherwise.
  // One attempt on one endpoint lasts at most attempt_limit.
  Json post(const std::string& path, const Json& body, net::Deadline deadline, const std::string& what,
            Retry retry, Duration attempt_limit = kEtcdRequestTimeout);
  const std::string& endpoints() const { return spec_; }

 private:
  struct Attempt;
  Attempt once(const std::string& url, const std::string& payload, net::Deadline deadline, Duration attempt_limit);
  Json answer(const Attempt& a, const std::string& what);

  const std::string spec_;
  const std::vector<std::string> urls_;
  std::mutex mu_;           // one request at a time on the handle
  void* curl_ = nullptr;    // CURL*, kept for its connection cache
  size_t current_ = 0;      // the endpoint that answered last
};

}  // namespace dtrain::comm::etcd
