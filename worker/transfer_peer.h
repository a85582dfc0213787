// How a prefill worker tells the router that a Prefill failed in the state transfer to the
// decode worker (connecting to it, posting pages, its commit or delivery) rather than in the
// prefill itself: the failed call's grpc::Status carries error_details kTransferPeerFailed. The
// router then counts the failure against that decode worker, not against the prefill worker, and
// retries on another decode worker (router/dispatch.cc). A worker that predates the marker sends
// no details, and the failure counts against the prefill worker as before.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"

namespace pdserve::worker {

inline constexpr char kTransferPeerFailed[] = "pdserve.worker.v1/transfer_peer_failed";

// A Prefill refused because its ticket does not fit this worker's model: the ticket's page list
// differs from this worker's plan for the prompt (another page geometry), or it states another
// model fingerprint. The pair cannot work together: the router's canary tries the worker it
// checks with another partner instead of blaming the prefill worker (router/worker_pool.h).
inline constexpr char kTicketMismatch[] = "pdserve.worker.v1/ticket_mismatch";

// `status` with `marker` (one of the above) as an absl payload (ToGrpc turns it into
// error_details); an OK status stays as it is.
inline absl::Status WithMarker(absl::Status status, const char* marker) {
  if (!status.ok()) status.SetPayload(marker, absl::Cord("1"));
  return status;
}

inline absl::Status MarkTransferPeerFailure(absl::Status status) {
  return WithMarker(std::move(status), kTransferPeerFailed);
}
inline bool IsTransferPeerFailure(const absl::Status& status) {
  return status.GetPayload(kTransferPeerFailed).has_value();
}

inline absl::Status MarkTicketMismatch(absl::Status status) {
  return WithMarker(std::move(status), kTicketMismatch);
}
inline bool IsTicketMismatch(const absl::Status& status) {
  return status.GetPayload(kTicketMismatch).has_value();
}

}  // namespace pdserve::worker
