// HTTP to etcd's JSON gateway with libcurl: one easy handle per client (its connections are reused),
// endpoints failed over in order. A request that never reached a member (refused, unresolvable,
// connect timed out) is always safe to send to the next one; one that a member received and then
// failed to answer may have been applied, so only idempotent requests (Retry::kAlways) go on.
#include "comm/store/etcd_http.h"

#include <curl/curl.h>
#include <openssl/evp.h>

#include <algorithm>
#include <thread>

namespace dtrain::comm::etcd {

namespace {

// The largest answer read: a value at the store's limit, base64-encoded, with room for a listing.
constexpr size_t kMaxAnswerBytes = 4 * kMaxStoreValueBytes;

std::string msText(Clock::duration d) {
  return fmt::format("{}ms", std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

size_t appendAnswer(char* p, size_t size, size_t n, void* out) {
  auto* s = static_cast<std::string*>(out);
  if (s->size() + size * n > kMaxAnswerBytes) return 0;  // curl fails the transfer: CURLE_WRITE_ERROR
  s->append(p, size * n);
  return size * n;
}

void initCurlOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

}  // namespace

std::string base64(const std::string& bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string unbase64(const std::string& text, const std::string& what) {
  if (text.size() % 4 != 0) throw ProtocolError(fmt::format("{}: '{}' is not base64", what, text.substr(0, 64)));
  std::string out(text.size() / 4 * 3, '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) throw ProtocolError(fmt::format("{}: '{}' is not base64", what, text.substr(0, 64)));
  // EVP_DecodeBlock counts the padding's zero bytes.
  size_t pad = 0;
  if (!text.empty() && text.back() == '=') pad = text[text.size() - 2] == '=' ? 2 : 1;
  out.resize(static_cast<size_t>(n) - pad);
  return out;
}

int64_t integer(const Json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    const std::string& s = it->get_ref<const std::string&>();
    try {
      size_t used = 0;
      int64_t v = std::stoll(s, &used);
      if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
  }
  throw ProtocolError(fmt::format("field '{}' is not an integer: {}", field, it->dump()));
}

std::string prefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    auto& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // etcd: from key to the end of the keyspace
}

std::vector<std::string> splitEndpoints(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = std::min(list.find(',', start), list.size());
    std::string e = list.substr(start, comma - start);
    start = comma + 1;
    e.erase(0, e.find_first_not_of(" \t"));
    e.erase(e.find_last_not_of(" \t/") + 1);
    if (e.empty()) continue;
    if (e.find("://") == std::string::npos) e = "http://" + e;
    if (e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0) {
      throw InvalidArgument(fmt::format("etcd endpoint '{}' (of '{}'): expected http://host:port", e, list));
    }
    out.push_back(e);
  }
  if (out.empty()) throw InvalidArgument(fmt::format("etcd endpoints '{}': expected http://host:port[,...]", list));
  return out;
}

struct Http::Attempt {
  enum Outcome { kAnswered, kUnreached, kLost } outcome = kUnreached;
  long status = 0;
  std::string body;
  std::string error;  // curl's account of a failure
};

Http::Http(const std::string& endpoints) : spec_(endpoints), urls_(splitEndpoints(endpoints)) {
  initCurlOnce();
  curl_ = curl_easy_init();
  if (!curl_) throw IoError(fmt::format("etcd {}: curl_easy_init failed", spec_));
}

Http::~Http() { curl_easy_cleanup(static_cast<CURL*>(curl_)); }

Http::Attempt Http::once(const std::string& url, const std::string& payload, net::Deadline deadline,
                         Duration attempt_limit) {
  CURL* c = static_cast<CURL*>(curl_);
  curl_easy_reset(c);
  Attempt a;
  char err[CURL_ERROR_SIZE] = {0};
  const long left = std::max(1, net::msUntil(deadline));
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  headers = curl_slist_append(headers, "Expect:");  // no 100-continue round trip for large bodies
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, payload.data());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(payload.size()));
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_PROXY, "");  // never a proxy from the environment
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, std::min<long>(left, kEtcdConnectTimeout.count()));
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, std::min<long>(left, attempt_limit.count()));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, appendAnswer);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &a.body);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, err);
  CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(headers);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, nullptr);
  if (rc == CURLE_OK) {
    a.outcome = Attempt::kAnswered;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &a.status);
    return a;
  }
  a.error = err[0] ? err : curl_easy_strerror(rc);
  if (rc == CURLE_WRITE_ERROR) {
    throw ProtocolError(fmt::format("etcd {}: an answer larger than {} bytes", url, kMaxAnswerBytes));
  }
  if (rc == CURLE_URL_MALFORMAT || rc == CURLE_UNSUPPORTED_PROTOCOL) {
    throw InvalidArgument(fmt::format("etcd endpoint '{}': {}", url, a.error));
  }
  curl_off_t connected_us = 0;
  curl_easy_getinfo(c, CURLINFO_CONNECT_TIME_T, &connected_us);
  bool unsent = rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST ||
                rc == CURLE_COULDNT_RESOLVE_PROXY || (rc == CURLE_OPERATION_TIMEDOUT && connected_us == 0);
  a.outcome = unsent ? Attempt::kUnreached : Attempt::kLost;
  return a;
}

// The JSON of an answer, or the error etcd answered with (HTTP status other than 200, or an "error"
// field: a plain message for unary calls, an object for the streaming ones like lease keepalive).
Json Http::answer(const Attempt& a, const std::string& what) {
  const std::string& url = urls_[current_];
  Json j;
  try {
    j = Json::parse(a.body);
  } catch (const std::exception& e) {
    throw ProtocolError(fmt::format("{}: etcd {} answered HTTP {} with what is not JSON ({}): {}", what, url,
                                    a.status, e.what(), a.body.substr(0, 200)));
  }
  const Json* err = nullptr;
  if (j.is_object() && j.contains("error")) err = &j["error"];
  if (a.status == 200 && !err) return j;
  int code = -1;
  std::string message = a.body.substr(0, 300);
  const Json& src = (err && err->is_object()) ? *err : j;
  if (src.is_object()) {
    if (src.contains("code")) code = static_cast<int>(integer(src, "code"));
    if (src.contains("grpc_code")) code = static_cast<int>(integer(src, "grpc_code"));
    if (src.contains("message") && src["message"].is_string()) message = src["message"].get<std::string>();
  }
  std::string msg = fmt::format("{}: etcd {} answered (HTTP {}, code {}): {}", what, url, a.status, code, message);
  if (code == kCodeResourceExhausted) {
    msg += " (the request is too large for this etcd: see its --max-request-bytes)";
  }
  if (code == kCodeInvalidArgument || code == kCodeResourceExhausted) throw InvalidArgument(msg);
  throw AnswerError(msg, code);
}

Json Http::post(const std::string& path, const Json& body, net::Deadline deadline, const std::string& what,
                Retry retry, Duration attempt_limit) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string payload = body.dump();
  const auto start = Clock::now();
  std::vector<std::string> failures(urls_.size());
  auto pause = std::chrono::milliseconds(50);
  for (size_t tried = 0;; ++tried) {
    if (tried > 0 && tried % urls_.size() == 0) {
      // Every endpoint failed this round: wait a little before the next, within the deadline.
      if (Clock::now() >= deadline) {
        std::string all;
        for (size_t i = 0; i < urls_.size(); ++i) all += fmt::format("{}{} ({})", i ? ", " : "", urls_[i], failures[i]);
        throw RendezvousError(fmt::format("{}: no etcd endpoint answered within {}: {}", what,
                                          msText(deadline - start), all));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(pause, std::max(deadline - Clock::now(), Clock::duration(0))));
      pause = std::min(pause * 2, std::chrono::milliseconds(1000));
    }
    const std::string& url = urls_[current_];
    Attempt a = once(url + path, payload, deadline, attempt_limit);
    if (a.outcome == Attempt::kAnswered) {
      try {
        return answer(a, what);
      } catch (const AnswerError& e) {
        // A member without a leader or shutting down: another may serve the request. "no leader"
        // means it was never proposed, so even a request that must not be applied twice may go on.
        bool unapplied = std::string(e.what()).find("etcdserver: no leader") != std::string::npos;
        if (e.code() != kCodeUnavailable || (retry != Retry::kAlways && !unapplied)) throw;
        std::string m = e.what();  // "<what>: etcd <url> answered ...": keep what follows <what>
        failures[current_] = m.compare(0, what.size(), what) == 0 ? m.substr(std::min(m.size(), what.size() + 2)) : m;
      }
    } else if (a.outcome == Attempt::kLost && retry == Retry::kOnlyUnsent) {
      throw IoError(fmt::format("{}: etcd {} received the request but failed to answer ({}); it may or may not "
                                "have been applied",
                                what, url, a.error));
    } else {
      failures[current_] = a.error;
    }
    current_ = (current_ + 1) % urls_.size();
  }
}

}  // namespace dtrain::comm::etcd
