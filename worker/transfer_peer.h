// How a prefill worker tells the router that a Prefill failed in the state transfer to the
// decode worker (connecting to it, posting pages, its commit or delivery) rather than in the
// prefill itself: the failed call's grpc::Status carries error_details kTransferPeerFailed. The
// router then counts the failure against that decode worker, not against the prefill worker, and
// retries on another decode worker (router/dispatch.cc). A worker that predates the marker sends
// no details, and the failure counts against the prefill worker as before.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/cord.h"

namespace pdserve::worker {

inline constexpr char kTransferPeerFailed[] = "pdserve.worker.v1/transfer_peer_failed";

// `status` with the marker as an absl payload (ToGrpc turns it into error_details).
inline absl::Status MarkTransferPeerFailure(absl::Status status) {
  if (!status.ok()) status.SetPayload(kTransferPeerFailed, absl::Cord("1"));
  return status;
}

inline bool IsTransferPeerFailure(const absl::Status& status) {
  return status.GetPayload(kTransferPeerFailed).has_value();
}

}  // namespace pdserve::worker
