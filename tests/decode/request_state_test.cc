#include "decode/request_state.h"

#include <map>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/common/transition_table.h"

namespace pdserve::decode {
namespace {

using S = RequestState;
using E = RequestEvent;

const std::vector<S> kStates = {S::kReceiving, S::kAbortedReceiving, S::kDecoding,
                                S::kFinishing, S::kAbortedDecoding,  S::kFenced,
                                S::kDone};
const std::vector<E> kEvents = {E::kAbort,         E::kJoinBatch,    E::kEndAtStart,
                                E::kTransferEnded, E::kTransferLost, E::kReleased,
                                E::kRefused,       E::kFinalQueued,  E::kLeaveBatch};

// Every legal transition, as decode/request_state.h draws them; any pair not listed is illegal.
const std::map<std::pair<S, E>, S> kLegal = {
    {{S::kReceiving, E::kAbort}, S::kAbortedReceiving},
    {{S::kReceiving, E::kJoinBatch}, S::kDecoding},
    {{S::kReceiving, E::kEndAtStart}, S::kDone},
    {{S::kReceiving, E::kTransferEnded}, S::kFenced},
    {{S::kReceiving, E::kTransferLost}, S::kDone},
    {{S::kReceiving, E::kReleased}, S::kDone},
    {{S::kAbortedReceiving, E::kAbort}, S::kAbortedReceiving},
    {{S::kAbortedReceiving, E::kEndAtStart}, S::kDone},
    {{S::kAbortedReceiving, E::kTransferEnded}, S::kFenced},
    {{S::kAbortedReceiving, E::kTransferLost}, S::kDone},
    {{S::kAbortedReceiving, E::kReleased}, S::kDone},
    {{S::kAbortedReceiving, E::kRefused}, S::kFenced},
    {{S::kDecoding, E::kAbort}, S::kAbortedDecoding},
    {{S::kDecoding, E::kFinalQueued}, S::kFinishing},
    {{S::kFinishing, E::kAbort}, S::kAbortedDecoding},
    {{S::kFinishing, E::kLeaveBatch}, S::kDone},
    {{S::kAbortedDecoding, E::kAbort}, S::kAbortedDecoding},
    {{S::kAbortedDecoding, E::kLeaveBatch}, S::kDone},
    {{S::kFenced, E::kAbort}, S::kFenced},
    {{S::kFenced, E::kReleased}, S::kDone},
    {{S::kDone, E::kAbort}, S::kDone},
    {{S::kDone, E::kRefused}, S::kDone},
};

TEST(RequestStateTest, TransitionsFollowTheTableAndRejectEveryOtherEvent) {
  testing::ExpectTransitionTable(kStates, kEvents, kLegal, NextRequestState, RequestStateName,
                                 RequestEventName);
}

TEST(RequestStateTest, OnlyDoneHoldsNoPages) {
  for (S state : kStates) EXPECT_EQ(HoldsPages(state), state != S::kDone);
}

TEST(RequestStateTest, TheFinalEventIsQueuedOnceTheRequestLeavesReceivingOrDecoding) {
  for (S state : kStates) {
    EXPECT_EQ(FinalQueued(state), state != S::kReceiving && state != S::kDecoding)
        << RequestStateName(state);
  }
}

TEST(RequestStateTest, AbortedAndFencedPagesCountAsQuarantined) {
  for (S state : kStates) {
    const bool expected =
        state == S::kAbortedReceiving || state == S::kAbortedDecoding || state == S::kFenced;
    EXPECT_EQ(Quarantined(state), expected) << RequestStateName(state);
  }
}

TEST(RequestStateTest, ReceivingInBatchAndEndedPartitionTheStates) {
  for (S state : kStates) {
    EXPECT_EQ(Receiving(state) + InBatch(state) + Ended(state), 1) << RequestStateName(state);
  }
  EXPECT_TRUE(Receiving(S::kAbortedReceiving));
  EXPECT_TRUE(InBatch(S::kFinishing));
  EXPECT_TRUE(Ended(S::kFenced));
}

TEST(RequestStateTest, AnAbortedRequestNeverRejoinsTheBatch) {
  EXPECT_FALSE(NextRequestState(S::kAbortedReceiving, E::kJoinBatch).ok());
  EXPECT_FALSE(NextRequestState(S::kAbortedDecoding, E::kFinalQueued).ok());
}

TEST(RequestStateTest, PagesInTheBatchAreNeverReleasedByTheReceiver) {
  for (S state : {S::kDecoding, S::kFinishing, S::kAbortedDecoding}) {
    EXPECT_FALSE(NextRequestState(state, E::kReleased).ok()) << RequestStateName(state);
  }
}

}  // namespace
}  // namespace pdserve::decode
