// Checks a lifecycle's transition function (common/transition.h) against its table, written out
// in the test as the header's diagram draws it: every listed (state, event) leads to the listed
// state, and every pair not listed is rejected with FailedPrecondition naming the state and the
// event.
#pragma once

#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace pdserve::testing {

template <typename State, typename Event, typename Next, typename StateName, typename EventName>
void ExpectTransitionTable(const std::vector<State>& states, const std::vector<Event>& events,
                           const std::map<std::pair<State, Event>, State>& legal, Next next,
                           StateName state_name, EventName event_name) {
  int rejected = 0;
  for (State state : states) {
    for (Event event : events) {
      SCOPED_TRACE(::testing::Message()
                   << "event " << event_name(event) << " in state " << state_name(state));
      const absl::StatusOr<State> got = next(state, event);
      auto it = legal.find({state, event});
      if (it != legal.end()) {
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_EQ(state_name(*got), std::string_view(state_name(it->second)));
        continue;
      }
      ASSERT_FALSE(got.ok()) << "accepted, leading to " << state_name(*got);
      EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(got.status().message().find(state_name(state)), std::string_view::npos);
      EXPECT_NE(got.status().message().find(event_name(event)), std::string_view::npos);
      ++rejected;
    }
  }
  // The table names only states and events of the lists, so the rest were all rejected.
  EXPECT_EQ(rejected, static_cast<int>(states.size() * events.size() - legal.size()));
}

}  // namespace pdserve::testing
