#include "comm/net/auth.h"

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/hmac.h>

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/comm/fd.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::net {

namespace {
constexpr char kGreetingMagic[4] = {'D', 'T', 'A', 'U'};
}

// The kernel's CSPRNG (getrandom(2)), not OpenSSL's RAND_bytes: RAND_bytes takes a lock, and a process
// forked while a store server's thread held it (the tests' ranks are forked so) would deadlock in it.
Challenge freshChallenge() {
  Challenge c;
  size_t got = 0;
  while (got < c.size()) {
    const ssize_t n = ::getrandom(c.data() + got, c.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(fmt::format("authentication: getrandom: {}", std::strerror(errno)));
    got += static_cast<size_t>(n);
  }
  return c;
}

Greeting greeting(bool requires_secret, const Challenge& c) {
  Greeting g{};
  std::memcpy(g.data(), kGreetingMagic, 4);
  g[4] = requires_secret ? 1 : 0;
  std::memcpy(g.data() + 5, c.data(), c.size());
  return g;
}

Mac computeMac(const std::string& secret, const char* purpose, const Challenge& c, const void* extra, size_t n) {
  std::vector<uint8_t> msg;
  const size_t plen = std::strlen(purpose);
  msg.reserve(plen + 1 + c.size() + n);
  msg.insert(msg.end(), purpose, purpose + plen);
  msg.push_back(0);
  msg.insert(msg.end(), c.begin(), c.end());
  if (n) msg.insert(msg.end(), static_cast<const uint8_t*>(extra), static_cast<const uint8_t*>(extra) + n);
  Mac mac{};
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(), mac.data(), &len) ||
      len != mac.size())
    throw IoError("authentication: HMAC-SHA256 failed");
  return mac;
}

bool macMatches(const std::string& secret, const char* purpose, const Challenge& c, const void* extra, size_t n,
                const uint8_t* got) {
  const Mac want = computeMac(secret, purpose, c, extra, n);
  return CRYPTO_memcmp(want.data(), got, want.size()) == 0;
}

void authenticate(const Socket& s, const std::string& secret, const char* purpose, const void* extra, size_t n,
                  Deadline deadline, const std::string& who) {
  Greeting g{};
  try {
    s.recvAll(g.data(), g.size(), deadline, "greeting");
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("{}: no greeting from {}: {}", purpose, who, e.what()));
  }
  if (std::memcmp(g.data(), kGreetingMagic, 4) != 0)
    throw ProtocolError(fmt::format("{}: {} did not greet as a dtrain listener does", purpose, who));
  const bool required = g[4] != 0;
  if (required && secret.empty())
    throw RendezvousError(fmt::format("authentication failed: {} requires the job secret (DTRAIN_SECRET or "
                                      "DTRAIN_SECRET_FILE) and this process has none",
                                      who));
  if (!required && !secret.empty())
    throw RendezvousError(fmt::format("authentication failed: this process has a job secret and {} does not ask "
                                      "for one (it runs without DTRAIN_SECRET): refusing to talk to it",
                                      who));
  std::vector<uint8_t> out(static_cast<const uint8_t*>(extra), static_cast<const uint8_t*>(extra) + n);
  if (required) {
    Challenge c;
    std::memcpy(c.data(), g.data() + 5, c.size());
    const Mac mac = computeMac(secret, purpose, c, extra, n);
    out.insert(out.end(), mac.begin(), mac.end());
  }
  if (!out.empty()) s.sendAll(out.data(), out.size(), deadline, "handshake");
  if (!required) return;
  uint8_t verdict = 0;
  try {
    s.recvAll(&verdict, 1, deadline, "verdict");
  } catch (const TimeoutError&) {
    throw;
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("authentication failed: {} closed the connection (a wrong job secret?): {}",
                                      who, e.what()));
  }
  if (verdict != kAccepted)
    throw RendezvousError(fmt::format("authentication failed: {} refused this process's job secret", who));
}

}  // namespace dtrain::comm::net

namespace dtrain::comm {

std::string jobSecretFrom(const char* secret, const char* secret_file) {
  const bool has_secret = secret && *secret, has_file = secret_file && *secret_file;
  DTRAIN_CHECK(!(has_secret && has_file), InvalidArgument,
               "both DTRAIN_SECRET and DTRAIN_SECRET_FILE are set: give the job secret one way");
  if (has_secret) return secret;
  if (!has_file) return "";
  const int fd = ::open(secret_file, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0)
    throw InvalidArgument(fmt::format("DTRAIN_SECRET_FILE {}: cannot open it: {}", secret_file, std::strerror(errno)));
  net::Fd guard(fd);
  struct stat st{};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw InvalidArgument(fmt::format("DTRAIN_SECRET_FILE {}: not a regular file", secret_file));
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0)
    throw InvalidArgument(fmt::format("DTRAIN_SECRET_FILE {}: must belong to this user and be readable by nobody "
                                      "else (it is mode {:04o}, owner {}): chmod 600 it",
                                      secret_file, st.st_mode & 07777, st.st_uid));
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw InvalidArgument(fmt::format("DTRAIN_SECRET_FILE {}: {}", secret_file, std::strerror(errno)));
    out.append(buf, static_cast<size_t>(n));
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  DTRAIN_CHECK(!out.empty(), InvalidArgument, "DTRAIN_SECRET_FILE {}: empty", secret_file);
  return out;
}

}  // namespace dtrain::comm
