// A content digest (SHA-256, OpenSSL's libcrypto) for integrity checks of what dtrain wrote and reads back:
// checkpoints and peer snapshots carry the digest of their content, and a load recomputes it, so a bit that
// flipped on disk or in transit is an error naming the file instead of a silently different model. Not for
// security (the job secret covers connections: net/auth.h). Internal to dtrain; no OpenSSL header here.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

namespace dtrain::detail {

class Digest {
 public:
  Digest();
  ~Digest();
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;
  void update(const void* data, size_t n);
  // "sha256:<64 hex digits>"; the digest is finished (no update after).
  std::string text();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::detail
