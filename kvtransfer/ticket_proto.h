// Conversions between the transfer layer's values and their pdserve.worker.v1 messages, so the
// prefill and decode services pass tickets, commits and isolation errors over gRPC unchanged.
// Thread-safety: pure functions.
#pragma once

#include <optional>

#include "absl/status/statusor.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/ticket.h"
#include "pdserve/worker/v1/worker.pb.h"

namespace pdserve::kv {

pdserve::worker::v1::TransferTicket TicketToProto(const Ticket& ticket);
// Errors: InvalidArgument when a descriptor's slot is not its position in the list or a field
// is out of range (a ticket from the wire is untrusted).
absl::StatusOr<Ticket> TicketFromProto(const pdserve::worker::v1::TransferTicket& proto);

pdserve::worker::v1::TransferCommit CommitToProto(const ControlMessage& commit);

// ISOLATION_ERROR_UNSPECIFIED for a status that carries no isolation error.
pdserve::worker::v1::IsolationError IsolationErrorToProto(const absl::Status& status);

}  // namespace pdserve::kv
