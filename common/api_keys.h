// API keys for the router's fronts (docs/security.md): the keys a deployment accepts, read from a
// file, and the check of a request's `Authorization: Bearer <key>` header (what the OpenAI SDK
// always sends) or gRPC `authorization` metadata.
//
// Keys are held only as SHA-256 digests and a presented key is compared against every one of them
// with CRYPTO_memcmp, so neither the time taken nor a log line (keys are never logged) tells an
// attacker how much of a guess was right or which key matched.
//
// Thread-safety: immutable after LoadFile; Matches may be called from any thread.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::common {

class ApiKeys {
 public:
  // Reads one key per line; blank lines and lines starting with '#' are skipped, surrounding
  // spaces and tabs are trimmed. Errors: NotFound / PermissionDenied when the file cannot be
  // read; InvalidArgument (naming the line, never the key) when a key holds spaces or control
  // characters, or the file holds no key at all (a deployment that names a key file and lets
  // nobody in is a mistake, not a policy).
  static absl::StatusOr<std::shared_ptr<const ApiKeys>> LoadFile(const std::string& path);
  // The same from text (tests); `source` names it in errors.
  static absl::StatusOr<std::shared_ptr<const ApiKeys>> FromText(std::string_view text,
                                                                 const std::string& source);

  // True when `authorization` is "Bearer <key>" (scheme case-insensitive, RFC 7235 2.1) for one
  // of the keys.
  bool Matches(std::string_view authorization) const;

  size_t size() const { return digests_.size(); }

 private:
  using Digest = std::array<unsigned char, 32>;
  explicit ApiKeys(std::vector<Digest> digests) : digests_(std::move(digests)) {}
  static Digest Hash(std::string_view key);

  std::vector<Digest> digests_;
};

}  // namespace pdserve::common
