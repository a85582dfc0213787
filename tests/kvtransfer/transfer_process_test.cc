// Real UCX over loopback between this process (decode side) and kv_test_peer senders: delivery
// over tcp and shared memory, and each verification rule's precise isolation error.
#include <gtest/gtest.h>

#include "tests/kvtransfer/process_fixture.h"

namespace pdserve::kv::testing {
namespace {

class IntactTransferTest : public ReceiverProcessTest,
                           public ::testing::WithParamInterface<const char*> {};

TEST_P(IntactTransferTest, PagesArriveIntactAndVerify) {
  StartReceiver(GetParam());
  auto peer = StartSender();
  ASSERT_NE(peer, nullptr);
  // 256 KiB pages go by rendezvous, 2 KiB ones eagerly: both paths land and verify.
  for (uint64_t page_bytes : {kPageBytes, uint64_t{2048}}) {
    const Ticket ticket = Expect(page_bytes, 11, 0, kPoolPages, page_bytes);
    Send(*peer, 500 + page_bytes, ticket);
    EXPECT_EQ(RunUntilLine(*peer, "done"), absl::StrCat("done ", ticket.ticket_id, " OK "));
    const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id);
    EXPECT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
    ASSERT_TRUE(outcome.commit.has_value());
    EXPECT_EQ(outcome.commit->first_token, static_cast<int32_t>((500 + page_bytes) % 1000));
    EXPECT_TRUE(PagesMatch(500 + page_bytes, 0, kPoolPages, page_bytes));
  }
  EXPECT_EQ(receiver_->stats().pages_landed, 2 * kPoolPages);
}

INSTANTIATE_TEST_SUITE_P(Transports, IntactTransferTest, ::testing::Values("tcp", "shm,self"),
                         [](const auto& param_info) {
                           return std::string(param_info.param == std::string("tcp") ? "Tcp"
                                                                                     : "Shm");
                         });

class FaultTest : public ReceiverProcessTest {
 protected:
  void SetUp() override { StartReceiver("tcp"); }

  // Sends one 4-page request with `faults` and returns its isolation error kind.
  std::optional<IsolationError> SendWithFault(const std::string& faults) {
    auto peer = StartSender();
    if (peer == nullptr) return std::nullopt;
    const Ticket ticket = Expect(1, 5, 0, 4);
    Send(*peer, 1, ticket, faults);
    RunUntilLine(*peer, "done");
    TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, absl::Milliseconds(500));
    if (outcome.state == TransferState::kReceiving) {
      // Past the missing-page grace after the commit.
      clock_.Advance(ReceiverOptions{}.missing_grace + absl::Seconds(1));
      outcome = RunUntilDecided(ticket.ticket_id);
    }
    EXPECT_EQ(outcome.state, TransferState::kFailed);
    last_status_ = outcome.status;
    return GetIsolationError(outcome.status);
  }
  absl::Status last_status_;
};

TEST_F(FaultTest, FlippedByteFailsOnlyThatRequestWithChecksumError) {
  auto bad_sender = StartSender();
  auto good_sender = StartSender();
  ASSERT_NE(bad_sender, nullptr);
  ASSERT_NE(good_sender, nullptr);
  const Ticket bad = Expect(1, 5, 0, 4);
  const Ticket good = Expect(2, 6, 4, 4);
  Send(*bad_sender, 1, bad, "corrupt:2");
  Send(*good_sender, 2, good);
  const TransferOutcome bad_outcome = RunUntilDecided(bad.ticket_id);
  const TransferOutcome good_outcome = RunUntilDecided(good.ticket_id);
  EXPECT_EQ(bad_outcome.state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(bad_outcome.status), IsolationError::kChecksum) << bad_outcome.status;
  EXPECT_NE(bad_outcome.status.message().find("slot 2"), absl::string_view::npos);
  EXPECT_EQ(good_outcome.state, TransferState::kVerified) << good_outcome.status;
  EXPECT_TRUE(PagesMatch(2, 4, 4));
  // The failed request's pages stay quarantined until its lease ends, then come back.
  receiver_->RunFor(absl::Milliseconds(20));
  EXPECT_TRUE(released_.empty());
  clock_.Advance(kLease + absl::Seconds(1));
  receiver_->RunFor(absl::Milliseconds(20));
  EXPECT_EQ(released_, std::vector<uint64_t>{bad.ticket_id});
}

TEST_F(FaultTest, WrongEpochGivesEpochError) {
  EXPECT_EQ(SendWithFault("epoch:1:999"), IsolationError::kEpoch) << last_status_;
}

TEST_F(FaultTest, PageNamingAnotherTicketGivesHeaderError) {
  EXPECT_EQ(SendWithFault("ticket:1:777"), IsolationError::kHeader) << last_status_;
}

TEST_F(FaultTest, DuplicatePageGivesDuplicateError) {
  EXPECT_EQ(SendWithFault("dup:3"), IsolationError::kDuplicate) << last_status_;
}

TEST_F(FaultTest, DroppedPageGivesMissingError) {
  EXPECT_EQ(SendWithFault("drop:0"), IsolationError::kMissing) << last_status_;
  EXPECT_NE(last_status_.message().find("without slots 0"), absl::string_view::npos);
}

}  // namespace
}  // namespace pdserve::kv::testing
