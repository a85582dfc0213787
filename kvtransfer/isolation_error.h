// Isolation errors: why a request's transferred state was rejected (docs/protocol.md,
// "Verification"). The kind travels inside an absl::Status (code FailedPrecondition for all but
// kLease, which is DeadlineExceeded) as a payload, so it survives every layer that forwards the
// status and maps 1:1 to pdserve.worker.v1.IsolationError.
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pdserve::kv {

enum class IsolationError {
  kChecksum = 1,   // A payload did not match the xxh3-64 in its header or a layer digest.
  kHeader = 2,     // Header malformed, or names another ticket / slot / layer / range / size.
  kEpoch = 3,      // Header names this ticket with another epoch.
  kLease = 4,      // The lease expired before the transfer was committed and verified.
  kDuplicate = 5,  // A slot arrived more than once.
  kMissing = 6,    // The commit arrived but a slot never did.
};

// Every kind, in value order (the decode worker exports each one's failure counter from the start).
inline constexpr IsolationError kAllIsolationErrors[] = {
    IsolationError::kChecksum, IsolationError::kHeader,    IsolationError::kEpoch,
    IsolationError::kLease,    IsolationError::kDuplicate, IsolationError::kMissing};

absl::string_view IsolationErrorName(IsolationError kind);

// "isolation error (<name>): <detail>" with the kind attached as a payload.
absl::Status MakeIsolationError(IsolationError kind, absl::string_view detail);

// The kind attached by MakeIsolationError, or nullopt for any other status.
std::optional<IsolationError> GetIsolationError(const absl::Status& status);

}  // namespace pdserve::kv
