// The content digest of digest.h: SHA-256 through OpenSSL's EVP interface.
#include "comm/util/digest.h"

#include <openssl/evp.h>

#include <fmt/format.h>

#include "dtrain/comm/error.h"

namespace dtrain::detail {

struct Digest::Impl {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  ~Impl() { EVP_MD_CTX_free(ctx); }
};

Digest::Digest() : impl_(std::make_unique<Impl>()) {
  if (!impl_->ctx || EVP_DigestInit_ex(impl_->ctx, EVP_sha256(), nullptr) != 1)
    throw IoError("content digest: SHA-256 unavailable (OpenSSL EVP_DigestInit_ex failed)");
}

Digest::~Digest() = default;

void Digest::update(const void* data, size_t n) {
  if (n && EVP_DigestUpdate(impl_->ctx, data, n) != 1) throw IoError("content digest: EVP_DigestUpdate failed");
}

std::string Digest::text() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(impl_->ctx, md, &len) != 1) throw IoError("content digest: EVP_DigestFinal_ex failed");
  std::string out = "sha256:";
  for (unsigned int i = 0; i < len; ++i) out += fmt::format("{:02x}", md[i]);
  return out;
}

}  // namespace dtrain::detail
