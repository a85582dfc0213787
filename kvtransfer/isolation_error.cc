#include "kvtransfer/isolation_error.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {
constexpr absl::string_view kPayloadUrl = "type.pdserve/pdserve.kv.IsolationError";
}  // namespace

absl::string_view IsolationErrorName(IsolationError kind) {
  switch (kind) {
    case IsolationError::kChecksum:
      return "checksum";
    case IsolationError::kHeader:
      return "header";
    case IsolationError::kEpoch:
      return "epoch";
    case IsolationError::kLease:
      return "lease";
    case IsolationError::kDuplicate:
      return "duplicate";
    case IsolationError::kMissing:
      return "missing";
  }
  return "unknown";
}

absl::Status MakeIsolationError(IsolationError kind, absl::string_view detail) {
  const std::string message =
      absl::StrCat("isolation error (", IsolationErrorName(kind), "): ", detail);
  absl::Status status = kind == IsolationError::kLease ? absl::DeadlineExceededError(message)
                                                       : absl::FailedPreconditionError(message);
  status.SetPayload(kPayloadUrl, absl::Cord(std::to_string(static_cast<int>(kind))));
  return status;
}

std::optional<IsolationError> GetIsolationError(const absl::Status& status) {
  const auto payload = status.GetPayload(kPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  const std::string text(*payload);
  if (text.size() != 1 || text[0] < '1' || text[0] > '6') return std::nullopt;
  return static_cast<IsolationError>(text[0] - '0');
}

}  // namespace pdserve::kv
