// The lifecycles of a router request's parts: each choice (ChoiceState) and each try of a choice
// on one (prefill, decode) pair (AttemptState). Each changes only through its transition function;
// RouterService::Request::Move applies them (router/request.h), and an illegal event fails the
// request with a 500 instead of going on silently.
//
//   Choice:  kTrying --kQueue--> kQueued --kLeaveQueue--> kTrying --kToken--> kStreaming
//            kTrying / kStreaming --kFinish--> kDone;  any but kDone --kRequestEnded--> kEnded
//   Attempt: kReserving --kReserved--> kPrefilling --kPrefillAnswered--> kPrefilled
//            any live --kEnd--> kEnded;  any live --kAbort--> kAborted
//
// Thread-safety: pure functions.
#pragma once

#include "absl/status/statusor.h"

namespace pdserve::router {

enum class ChoiceState {
  kTrying,     // an attempt is being picked or runs; no token reached the client yet
  kQueued,     // waiting in the admission queue for room on a decode worker
  kStreaming,  // a token reached the client: it is never retried
  kDone,       // finished (its final delta was sent)
  kEnded,      // the request ended (failed or cancelled) before the choice finished
};

enum class ChoiceEvent {
  kQueue,         // every decode worker was full: it waits in the admission queue
  kLeaveQueue,    // the queue tries it again, or its wait expired
  kToken,         // a token of it was sent to the client
  kFinish,        // its last delta was sent
  kRequestEnded,  // the request failed or was cancelled
};

enum class AttemptState {
  kReserving,   // Reserve is out
  kPrefilling,  // reserved; Prefill and Generate are out, Prefill has not answered
  kPrefilled,   // Prefill answered (the first token's logprobs are known); Generate streams
  kEnded,       // over without an abort of ours: the choice finished there, or Reserve failed
                // or came back for a request that no longer wants it
  kAborted,     // over, and both workers were told to abort it
};

enum class AttemptEvent {
  kReserved,         // Reserve succeeded and the streams start
  kPrefillAnswered,  // Prefill answered (or it no longer matters: the commit already arrived)
  kEnd,              // the attempt is over; later answers are ignored
  kAbort,            // abort it on its workers; later answers are ignored
};

// Errors: FailedPrecondition naming the state and the event when the event cannot happen there.
absl::StatusOr<ChoiceState> NextChoiceState(ChoiceState state, ChoiceEvent event);
absl::StatusOr<AttemptState> NextAttemptState(AttemptState state, AttemptEvent event);

// Later answers and events of an attempt in these states are ignored (kEnded, kAborted).
inline bool AttemptOver(AttemptState state) {
  return state == AttemptState::kEnded || state == AttemptState::kAborted;
}
// Prefill and Generate were sent (kPrefilling, kPrefilled).
inline bool StreamsStarted(AttemptState state) {
  return state == AttemptState::kPrefilling || state == AttemptState::kPrefilled;
}

const char* ChoiceStateName(ChoiceState state);
const char* ChoiceEventName(ChoiceEvent event);
const char* AttemptStateName(AttemptState state);
const char* AttemptEventName(AttemptEvent event);

}  // namespace pdserve::router
