#include "router/lifecycle.h"

#include <optional>

#include "common/transition.h"

namespace pdserve::router {
namespace {

using CS = ChoiceState;
using CE = ChoiceEvent;
using AS = AttemptState;
using AE = AttemptEvent;

std::optional<CS> NextChoice(CS state, CE event) {
  if (event == CE::kRequestEnded) return state == CS::kDone ? CS::kDone : CS::kEnded;
  switch (state) {
    case CS::kTrying:
      if (event == CE::kQueue) return CS::kQueued;
      if (event == CE::kToken) return CS::kStreaming;
      if (event == CE::kFinish) return CS::kDone;
      return std::nullopt;
    case CS::kQueued:
      if (event == CE::kLeaveQueue) return CS::kTrying;
      return std::nullopt;
    case CS::kStreaming:
      if (event == CE::kToken) return CS::kStreaming;
      if (event == CE::kFinish) return CS::kDone;
      return std::nullopt;
    case CS::kDone:
      return std::nullopt;
    case CS::kEnded:
      // The queue was trying the choice when the request ended: that try finds it ended.
      if (event == CE::kLeaveQueue) return CS::kEnded;
      return std::nullopt;
  }
  return std::nullopt;
}

std::optional<AS> NextAttempt(AS state, AE event) {
  switch (state) {
    case AS::kReserving:
      if (event == AE::kReserved) return AS::kPrefilling;
      if (event == AE::kEnd) return AS::kEnded;
      if (event == AE::kAbort) return AS::kAborted;
      return std::nullopt;
    case AS::kPrefilling:
    case AS::kPrefilled:
      if (event == AE::kPrefillAnswered && state == AS::kPrefilling) return AS::kPrefilled;
      if (event == AE::kEnd) return AS::kEnded;
      if (event == AE::kAbort) return AS::kAborted;
      return std::nullopt;
    case AS::kEnded:
      // A Prefill answering after the attempt ended changes nothing.
      if (event == AE::kPrefillAnswered) return AS::kEnded;
      return std::nullopt;
    case AS::kAborted:
      // Whatever comes after the abort is ignored (an abort is sent once).
      if (event == AE::kReserved) return std::nullopt;
      return AS::kAborted;
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<ChoiceState> NextChoiceState(ChoiceState state, ChoiceEvent event) {
  return CheckedTransition(NextChoice(state, event), "choice", ChoiceEventName(event),
                           ChoiceStateName(state));
}

absl::StatusOr<AttemptState> NextAttemptState(AttemptState state, AttemptEvent event) {
  return CheckedTransition(NextAttempt(state, event), "attempt", AttemptEventName(event),
                           AttemptStateName(state));
}

const char* ChoiceStateName(ChoiceState state) {
  switch (state) {
    case CS::kTrying:
      return "trying";
    case CS::kQueued:
      return "queued";
    case CS::kStreaming:
      return "streaming";
    case CS::kDone:
      return "done";
    case CS::kEnded:
      return "ended";
  }
  return "unknown";
}

const char* ChoiceEventName(ChoiceEvent event) {
  switch (event) {
    case CE::kQueue:
      return "queue";
    case CE::kLeaveQueue:
      return "leave_queue";
    case CE::kToken:
      return "token";
    case CE::kFinish:
      return "finish";
    case CE::kRequestEnded:
      return "request_ended";
  }
  return "unknown";
}

const char* AttemptStateName(AttemptState state) {
  switch (state) {
    case AS::kReserving:
      return "reserving";
    case AS::kPrefilling:
      return "prefilling";
    case AS::kPrefilled:
      return "prefilled";
    case AS::kEnded:
      return "ended";
    case AS::kAborted:
      return "aborted";
  }
  return "unknown";
}

const char* AttemptEventName(AttemptEvent event) {
  switch (event) {
    case AE::kReserved:
      return "reserved";
    case AE::kPrefillAnswered:
      return "prefill_answered";
    case AE::kEnd:
      return "end";
    case AE::kAbort:
      return "abort";
  }
  return "unknown";
}

}  // namespace pdserve::router
