// Conversions between the transfer layer's values and their pdserve.worker.v1 messages, so the
// prefill and decode services pass tickets, commits and isolation errors over gRPC unchanged.
// Thread-safety: pure functions.
#pragma once

#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/ticket.h"
#include "pdserve/worker/v1/worker.pb.h"

namespace pdserve::kv {

// `now`: the issuing (decode) worker's clock; the lease travels as the time left from it as well
// as the deadline, so the receiving host's wall clock need not agree with this one's.
pdserve::worker::v1::TransferTicket TicketToProto(const Ticket& ticket, absl::Time now);
// `now`: the reading (prefill) worker's clock: the ticket's lease_deadline is now + the lease left
// that the ticket states, or its lease_deadline_unix_ms where it states none.
// Errors: InvalidArgument when a descriptor's slot is not its position in the list or a field
// is out of range (a ticket from the wire is untrusted).
absl::StatusOr<Ticket> TicketFromProto(const pdserve::worker::v1::TransferTicket& proto,
                                       absl::Time now);

pdserve::worker::v1::TransferCommit CommitToProto(const ControlMessage& commit);

// ISOLATION_ERROR_UNSPECIFIED for a status that carries no isolation error.
pdserve::worker::v1::IsolationError IsolationErrorToProto(const absl::Status& status);

}  // namespace pdserve::kv
