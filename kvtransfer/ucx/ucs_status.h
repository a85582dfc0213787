// The one adapter from UCX status codes to absl::Status (house style: one adapter per foreign
// error type). Thread-safe: pure function.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ucs/type/status.h"

namespace pdserve::kv {

// Maps `status` to an absl::Status whose message is "<what>: <ucs_status_string>".
// UCS_OK -> OK; UCS_INPROGRESS is a caller bug here and maps to Internal.
// Peer loss (connection reset, endpoint timeout, unreachable) -> Unavailable, so callers may retry
// with a fresh endpoint; UCS_ERR_CANCELED -> Cancelled; UCS_ERR_NO_MEMORY / NO_RESOURCE ->
// ResourceExhausted; UCS_ERR_TIMED_OUT -> DeadlineExceeded; invalid parameters -> InvalidArgument;
// unsupported -> Unimplemented; everything else -> Internal.
absl::Status UcsToStatus(ucs_status_t status, absl::string_view what);

}  // namespace pdserve::kv
