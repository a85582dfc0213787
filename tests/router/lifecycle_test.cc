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

// An n = 4 request's group, as RouterService walks it (router/request.h): the lead reserves for
// all; its members start reserved; the Prefill answer moves all to prefilled; the choices queue
// and leave the queue together; a group abort ends every live attempt, after which answers are
// ignored; a finished member stays finished when the request ends.
TEST(GroupWalkTest, LeadAndMembersMoveTogether) {
  auto step = [](AS state, AE event) {
    absl::StatusOr<AS> next = NextAttemptState(state, event);
    EXPECT_TRUE(next.ok()) << next.status();
    return next.value_or(state);
  };
  auto move = [](CS state, CE event) {
    absl::StatusOr<CS> next = NextChoiceState(state, event);
    EXPECT_TRUE(next.ok()) << next.status();
    return next.value_or(state);
  };
  std::vector<CS> choices(4, CS::kTrying);
  for (CS& c : choices) c = move(c, CE::kQueue);  // every decode worker full: the group waits
  for (CS& c : choices) EXPECT_EQ(c, CS::kQueued);
  for (CS& c : choices) c = move(c, CE::kLeaveQueue);
  std::vector<AS> attempts = {step(AS::kReserving, AE::kReserved)};  // the lead's Reserve
  for (int k = 1; k < 4; ++k) attempts.push_back(step(AS::kReserving, AE::kReserved));
  for (AS a : attempts) EXPECT_EQ(a, AS::kPrefilling);
  // Member 2 streams and finishes before the Prefill answers (no logprobs asked).
  choices[2] = move(move(choices[2], CE::kToken), CE::kFinish);
  attempts[2] = step(attempts[2], AE::kEnd);
  for (AS& a : attempts) a = step(a, AE::kPrefillAnswered);
  EXPECT_EQ(attempts[0], AS::kPrefilled);
  EXPECT_EQ(attempts[2], AS::kEnded);
  // The client goes: every live attempt is aborted; a late answer changes nothing.
  for (AS& a : attempts) {
    if (!AttemptOver(a)) a = step(a, AE::kAbort);
  }
  EXPECT_EQ(attempts, (std::vector<AS>{AS::kAborted, AS::kAborted, AS::kEnded, AS::kAborted}));
  for (AS& a : attempts) {
    if (a == AS::kAborted) a = step(a, AE::kPrefillAnswered);
  }
  for (CS& c : choices) c = move(c, CE::kRequestEnded);
  EXPECT_EQ(choices, (std::vector<CS>{CS::kEnded, CS::kEnded, CS::kDone, CS::kEnded}));
  // A member cannot be reserved again once its group was aborted.
  EXPECT_FALSE(NextAttemptState(AS::kAborted, AE::kReserved).ok());
}

}  // namespace
}  // namespace pdserve::router
