// Connections that prove they belong to the job: challenge-response with a keyed MAC (HMAC-SHA256 from
// OpenSSL's libcrypto) over a fresh random challenge, so the job secret never crosses the wire and a
// captured handshake cannot be replayed (docs/SECURITY.md).
//
// Every listener (the store server, the tcp transport's) first sends a greeting: "DTAU", whether it
// requires the secret, and a fresh 32-byte challenge. A connector that has the secret answers with
// its first bytes (`extra`, e.g. the transport's hello) followed by HMAC(secret, purpose | challenge |
// extra); the listener answers one verdict byte and closes the connection if it is 'R'. Without a
// secret on either side the greeting is all there is (no MAC, no verdict).
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "comm/net/socket.h"

namespace dtrain::comm::net {

constexpr size_t kChallengeBytes = 32;
constexpr size_t kMacBytes = 32;
constexpr size_t kGreetingBytes = 4 + 1 + kChallengeBytes;
constexpr uint8_t kAccepted = 'A';
constexpr uint8_t kRefused = 'R';

using Challenge = std::array<uint8_t, kChallengeBytes>;
using Mac = std::array<uint8_t, kMacBytes>;
using Greeting = std::array<uint8_t, kGreetingBytes>;

// A fresh challenge from the system's random source (IoError if it has none).
Challenge freshChallenge();
// The greeting a listener sends; requires_secret when it has one.
Greeting greeting(bool requires_secret, const Challenge& c);
// HMAC-SHA256(secret, purpose | challenge | extra).
Mac computeMac(const std::string& secret, const char* purpose, const Challenge& c, const void* extra, size_t n);
// Constant-time comparison of what arrived with what the secret gives.
bool macMatches(const std::string& secret, const char* purpose, const Challenge& c, const void* extra, size_t n,
                const uint8_t* got);

// The connector's side, blocking until the deadline: reads the greeting, sends extra[n] (and the MAC
// when the listener requires the secret) and reads the verdict. RendezvousError starting
// "authentication failed" and naming `who` when the listener refuses, when it requires a secret this
// process does not have, or when this process has one and the listener does not ask for it.
void authenticate(const Socket& s, const std::string& secret, const char* purpose, const void* extra, size_t n,
                  Deadline deadline, const std::string& who);

}  // namespace dtrain::comm::net
