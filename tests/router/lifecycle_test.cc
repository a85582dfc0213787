#include "router/lifecycle.h"

#include <map>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/common/transition_table.h"

namespace pdserve::router {
namespace {

using CS = ChoiceState;
using CE = ChoiceEvent;
using AS = AttemptState;
using AE = AttemptEvent;

const std::vector<CS> kChoiceStates = {CS::kTrying, CS::kQueued, CS::kStreaming, CS::kDone,
                                       CS::kEnded};
const std::vector<CE> kChoiceEvents = {CE::kQueue, CE::kLeaveQueue, CE::kToken, CE::kFinish,
                                       CE::kRequestEnded};
const std::vector<AS> kAttemptStates = {AS::kReserving, AS::kPrefilling, AS::kPrefilled, AS::kEnded,
                                        AS::kAborted};
const std::vector<AE> kAttemptEvents = {AE::kReserved, AE::kPrefillAnswered, AE::kEnd, AE::kAbort};

// Every legal transition, as router/lifecycle.h draws them; any pair not listed is illegal.
const std::map<std::pair<CS, CE>, CS> kChoiceLegal = {
    {{CS::kTrying, CE::kQueue}, CS::kQueued},
    {{CS::kTrying, CE::kToken}, CS::kStreaming},
    {{CS::kTrying, CE::kFinish}, CS::kDone},
    {{CS::kTrying, CE::kRequestEnded}, CS::kEnded},
    {{CS::kQueued, CE::kLeaveQueue}, CS::kTrying},
    {{CS::kQueued, CE::kRequestEnded}, CS::kEnded},
    {{CS::kStreaming, CE::kToken}, CS::kStreaming},
    {{CS::kStreaming, CE::kFinish}, CS::kDone},
    {{CS::kStreaming, CE::kRequestEnded}, CS::kEnded},
    {{CS::kDone, CE::kRequestEnded}, CS::kDone},
    {{CS::kEnded, CE::kLeaveQueue}, CS::kEnded},
    {{CS::kEnded, CE::kRequestEnded}, CS::kEnded},
};

const std::map<std::pair<AS, AE>, AS> kAttemptLegal = {
    {{AS::kReserving, AE::kReserved}, AS::kPrefilling},
    {{AS::kReserving, AE::kEnd}, AS::kEnded},
    {{AS::kReserving, AE::kAbort}, AS::kAborted},
    {{AS::kPrefilling, AE::kPrefillAnswered}, AS::kPrefilled},
    {{AS::kPrefilling, AE::kEnd}, AS::kEnded},
    {{AS::kPrefilling, AE::kAbort}, AS::kAborted},
    {{AS::kPrefilled, AE::kEnd}, AS::kEnded},
    {{AS::kPrefilled, AE::kAbort}, AS::kAborted},
    {{AS::kEnded, AE::kPrefillAnswered}, AS::kEnded},
    {{AS::kAborted, AE::kPrefillAnswered}, AS::kAborted},
    {{AS::kAborted, AE::kEnd}, AS::kAborted},
    {{AS::kAborted, AE::kAbort}, AS::kAborted},
};

TEST(ChoiceLifecycleTest, TransitionsFollowTheTableAndRejectEveryOtherEvent) {
  testing::ExpectTransitionTable(kChoiceStates, kChoiceEvents, kChoiceLegal, NextChoiceState,
                                 ChoiceStateName, ChoiceEventName);
}

TEST(AttemptLifecycleTest, TransitionsFollowTheTableAndRejectEveryOtherEvent) {
  testing::ExpectTransitionTable(kAttemptStates, kAttemptEvents, kAttemptLegal, NextAttemptState,
                                 AttemptStateName, AttemptEventName);
}

TEST(AttemptLifecycleTest, OverAndStreamsStartedFollowTheState) {
  for (AS state : kAttemptStates) {
    EXPECT_EQ(AttemptOver(state), state == AS::kEnded || state == AS::kAborted)
        << AttemptStateName(state);
    EXPECT_EQ(StreamsStarted(state), state == AS::kPrefilling || state == AS::kPrefilled)
        << AttemptStateName(state);
  }
}

TEST(AttemptLifecycleTest, AnAbortIsNeverUndoneByALateReserveAnswer) {
  EXPECT_FALSE(NextAttemptState(AS::kAborted, AE::kReserved).ok());
  EXPECT_FALSE(NextAttemptState(AS::kEnded, AE::kAbort).ok());
}

}  // namespace
}  // namespace pdserve::router
