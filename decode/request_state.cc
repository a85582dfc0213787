#include "decode/request_state.h"

#include <optional>

#include "common/transition.h"

namespace pdserve::decode {
namespace {

using S = RequestState;
using E = RequestEvent;

// The transition table; nullopt: the event cannot happen in that state.
std::optional<S> Next(S state, E event) {
  switch (state) {
    case S::kReceiving:
    case S::kAbortedReceiving: {
      const bool aborted = state == S::kAbortedReceiving;
      // The transfer's end (verified, failed, lost, released) is the same for both; only a
      // receiving request joins the batch, only an aborted one is refused by its Reserve.
      if (event == E::kAbort) return S::kAbortedReceiving;
      if (event == E::kJoinBatch && !aborted) return S::kDecoding;
      if (event == E::kRefused && aborted) return S::kFenced;
      if (event == E::kTransferEnded) return S::kFenced;
      if (event == E::kEndAtStart || event == E::kTransferLost || event == E::kReleased) {
        return S::kDone;
      }
      return std::nullopt;
    }
    case S::kDecoding:
      if (event == E::kAbort) return S::kAbortedDecoding;
      if (event == E::kFinalQueued) return S::kFinishing;
      return std::nullopt;
    case S::kFinishing:
    case S::kAbortedDecoding:
      if (event == E::kAbort) return S::kAbortedDecoding;
      if (event == E::kLeaveBatch) return S::kDone;
      return std::nullopt;
    case S::kFenced:
      if (event == E::kAbort) return S::kFenced;
      if (event == E::kReleased) return S::kDone;
      return std::nullopt;
    case S::kDone:
      // An Abort after the end changes nothing; a refusal finds the pages already released.
      if (event == E::kAbort || event == E::kRefused) return S::kDone;
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<RequestState> NextRequestState(RequestState state, RequestEvent event) {
  return CheckedTransition(Next(state, event), "request", RequestEventName(event),
                           RequestStateName(state));
}

bool HoldsPages(RequestState state) { return state != S::kDone; }

bool FinalQueued(RequestState state) { return state != S::kReceiving && state != S::kDecoding; }

bool Receiving(RequestState state) {
  return state == S::kReceiving || state == S::kAbortedReceiving;
}

bool InBatch(RequestState state) {
  return state == S::kDecoding || state == S::kFinishing || state == S::kAbortedDecoding;
}

bool Quarantined(RequestState state) {
  return state == S::kAbortedReceiving || state == S::kAbortedDecoding || state == S::kFenced;
}

bool Ended(RequestState state) { return state == S::kFenced || state == S::kDone; }

const char* RequestStateName(RequestState state) {
  switch (state) {
    case S::kReceiving:
      return "receiving";
    case S::kAbortedReceiving:
      return "aborted_receiving";
    case S::kDecoding:
      return "decoding";
    case S::kFinishing:
      return "finishing";
    case S::kAbortedDecoding:
      return "aborted_decoding";
    case S::kFenced:
      return "fenced";
    case S::kDone:
      return "done";
  }
  return "unknown";
}

const char* RequestEventName(RequestEvent event) {
  switch (event) {
    case E::kAbort:
      return "abort";
    case E::kJoinBatch:
      return "join_batch";
    case E::kEndAtStart:
      return "end_at_start";
    case E::kTransferEnded:
      return "transfer_ended";
    case E::kTransferLost:
      return "transfer_lost";
    case E::kReleased:
      return "released";
    case E::kRefused:
      return "refused";
    case E::kFinalQueued:
      return "final_queued";
    case E::kLeaveBatch:
      return "leave_batch";
  }
  return "unknown";
}

}  // namespace pdserve::decode
