// The lifecycle of one request in the decode worker: one RequestState, changed only through
// NextRequestState(state, event). DecodeWorker keeps the state in its Request record and applies
// every event through it; what a state implies (pages held, final event queued, in the batch)
// is asked of the helpers below, never kept in flags beside the state.
//
//   kReceiving --kAbort--> kAbortedReceiving --kRefused--> kFenced --kReleased--> kDone
//   kReceiving --kJoinBatch--> kDecoding --kFinalQueued--> kFinishing --kLeaveBatch--> kDone
//   kDecoding / kFinishing --kAbort--> kAbortedDecoding --kLeaveBatch--> kDone
//   kReceiving / kAbortedReceiving --kTransferEnded--> kFenced;  --kEndAtStart, kTransferLost,
//   kReleased--> kDone
//
// Thread-safety: pure functions.
#pragma once

#include "absl/status/statusor.h"

namespace pdserve::decode {

enum class RequestState {
  kReceiving,         // pages held; the transfer runs (no ticket yet while Reserve registers it)
  kAbortedReceiving,  // aborted before its transfer ended ("abort" queued); pages held until the
                      // receiver releases them or a verified commit hands them back
  kDecoding,          // in the continuous batch
  kFinishing,         // in the batch, its final event queued; leaves after the step in flight
  kAbortedDecoding,   // in the batch, aborted; leaves after the step in flight
  kFenced,            // ended before decoding; pages held until the receiver releases them
  kDone,              // ended; pages free
};

enum class RequestEvent {
  kAbort,          // Abort, a cancelled Generate stream, or Drain ending it
  kJoinBatch,      // verified; the sequence was added to the runner
  kEndAtStart,     // verified but not decoded (aborted, first token final, bad commit, runner
                   // error): the pages are ours and go back to the pool
  kTransferEnded,  // failed verification, abandoned or aborted: the receiver releases the pages
  kTransferLost,   // the receiver forgot the ticket without releasing it: the pages go back here
  kReleased,       // the receiver released the pages (fence, lease, abandoned)
  kRefused,        // Reserve refused the request (aborted while being registered)
  kFinalQueued,    // a decoding request's final event (its last token, or an error) was queued
  kLeaveBatch,     // removed from the batch after the step that used its pages
};

// The state `event` leads to from `state`. Errors: FailedPrecondition naming both for an event
// that cannot happen in that state (a bug in the caller).
absl::StatusOr<RequestState> NextRequestState(RequestState state, RequestEvent event);

// The request's state pages are allocated (every state but kDone).
bool HoldsPages(RequestState state);
// The stream's final event was queued (every state but kReceiving and kDecoding).
bool FinalQueued(RequestState state);
// The transfer is still watched (kReceiving, kAbortedReceiving).
bool Receiving(RequestState state);
// The sequence is in the runner's batch (kDecoding, kFinishing, kAbortedDecoding).
bool InBatch(RequestState state);
// Aborted or failed with pages not yet back: they count as quarantined.
bool Quarantined(RequestState state);
// Ended (kFenced, kDone): nothing more is streamed.
bool Ended(RequestState state);

const char* RequestStateName(RequestState state);
const char* RequestEventName(RequestEvent event);

}  // namespace pdserve::decode
