#include "common/reason_latch.h"

#include <string>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(ReasonLatchTest, AFailureIsLoggedOncePerChangeOfReason) {
  ReasonLatch<> latch;
  EXPECT_TRUE(latch.Record({"protocols v2, this worker v1"}));
  EXPECT_FALSE(latch.Record({"protocols v2, this worker v1"}));
  EXPECT_FALSE(latch.Record({"protocols v2, this worker v1"}));
  EXPECT_TRUE(latch.Record({"fingerprint 1a, this worker 2b"}));
  EXPECT_TRUE(latch.Record({"protocols v2, this worker v1"}));  // back to the first: a change
  EXPECT_EQ(latch.last().reason, "protocols v2, this worker v1");
}

TEST(ReasonLatchTest, ASuccessIsRecordedButNotLoggedAndTheNextFailureIs) {
  ReasonLatch<> latch;
  EXPECT_FALSE(latch.Record({""}));
  EXPECT_TRUE(latch.Record({"down"}));
  EXPECT_FALSE(latch.Record({""}));
  EXPECT_EQ(latch.last().reason, "");
  EXPECT_TRUE(latch.Record({"down"}));
}

// The router keeps whether the failure is a mismatch with its reason; only the reason decides.
TEST(ReasonLatchTest, OtherMembersTravelWithTheReason) {
  struct Failure {
    std::string reason;
    bool mismatch = false;
  };
  ReasonLatch<Failure> latch;
  EXPECT_TRUE(latch.Record({"refused", true}));
  EXPECT_FALSE(latch.Record({"refused", false}));
  EXPECT_FALSE(latch.last().mismatch);
}

TEST(ReasonLatchTest, WithoutRequestIdMakesTwoRequestsOneReason) {
  EXPECT_EQ(WithoutRequestId("request 17: the ticket's decode worker uses UCX protocols v2"),
            "the ticket's decode worker uses UCX protocols v2");
  EXPECT_EQ(WithoutRequestId("request 18: the ticket's decode worker uses UCX protocols v2"),
            WithoutRequestId("request 4096: the ticket's decode worker uses UCX protocols v2"));
  // Anything else is kept whole.
  EXPECT_EQ(WithoutRequestId("request x: y"), "request x: y");
  EXPECT_EQ(WithoutRequestId("request : y"), "request : y");
  EXPECT_EQ(WithoutRequestId("request 12 was aborted"), "request 12 was aborted");
  EXPECT_EQ(WithoutRequestId("request 12"), "request 12");
  EXPECT_EQ(WithoutRequestId("slot 3 of the ticket"), "slot 3 of the ticket");
}

}  // namespace
}  // namespace pdserve
