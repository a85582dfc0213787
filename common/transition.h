// The shared tail of every lifecycle's transition function (decode/request_state.h,
// router/lifecycle.h): a state machine looks its next state up in its own table, and an event
// the table does not allow in that state is an error naming the lifecycle, the event and the
// state, which the caller reports loudly (never ignores).
//
// Thread-safety: pure function.
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace pdserve {

// `next`: the table's answer (nullopt: not allowed). Errors: FailedPrecondition "illegal
// <lifecycle> transition: event <event> in state <state>".
template <typename State>
absl::StatusOr<State> CheckedTransition(std::optional<State> next, const char* lifecycle,
                                        const char* event, const char* state) {
  if (next) return *next;
  return absl::FailedPreconditionError(
      absl::StrCat("illegal ", lifecycle, " transition: event ", event, " in state ", state));
}

}  // namespace pdserve
