// Every receiver rule, in process over the loopback transport with the fake clock and faults on
// either side (the UCX process tests check the same rules between real processes): delivery,
// the header checks before a byte lands, checksums and digests, the commit and the missing-page
// grace, quarantine, the abort fence, abandonment, leases and heartbeats, late and stray pages,
// and the outcome callback.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kvtransfer/page_header.h"
#include "tests/kvtransfer/loopback_fixture.h"

namespace pdserve::kv::testing {
namespace {

using Action = FaultRule::Action;

TEST_F(LoopbackReceiverTest, PagesArriveIntactAndVerifyByRendezvousAndEagerly) {
  for (uint64_t page_bytes : {kPageBytes, kEagerBytes}) {
    const Ticket ticket = Expect(page_bytes, 11, 0, kPoolPages, page_bytes);
    auto transfer = Send(ticket, 500 + page_bytes);
    const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
    ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
    ASSERT_TRUE(outcome.commit.has_value());
    EXPECT_EQ(outcome.commit->first_token, static_cast<int32_t>((500 + page_bytes) % 1000));
    EXPECT_TRUE(PagesMatch(500 + page_bytes, 0, kPoolPages, page_bytes));
    Pump(transfer.get());
    ASSERT_TRUE(last_poll_.ok() && *last_poll_) << last_poll_.status();
    EXPECT_TRUE(transfer->Release().ok());
  }
  EXPECT_EQ(receiver_->stats().pages_landed, 2 * kPoolPages);
  EXPECT_TRUE(released_.empty());
}

TEST_F(LoopbackReceiverTest, FlippedByteFailsOnlyThatRequestAndQuarantinesItsPages) {
  send_faults_.AddRule({.action = Action::kCorruptByte, .slot = 2, .offset = 77});
  const Ticket bad = Expect(1, 5, 0, 4);
  auto bad_transfer = Send(bad, 1);
  const Ticket good = Expect(2, 6, 4, 4);
  auto good_transfer = Send(good, 2);
  const TransferOutcome bad_outcome = RunUntilDecided(bad.ticket_id, bad_transfer.get());
  const TransferOutcome good_outcome = RunUntilDecided(good.ticket_id, good_transfer.get());
  EXPECT_EQ(GetIsolationError(bad_outcome.status), IsolationError::kChecksum) << bad_outcome.status;
  EXPECT_TRUE(absl::StrContains(bad_outcome.status.message(), "slot 2"));
  EXPECT_EQ(good_outcome.state, TransferState::kVerified) << good_outcome.status;
  EXPECT_TRUE(PagesMatch(2, 4, 4));
  // Quarantined until the lease ends, then released.
  Pump();
  EXPECT_TRUE(released_.empty());
  clock_.Advance(absl::Seconds(11));
  Pump();
  EXPECT_EQ(released_, std::vector<uint64_t>{bad.ticket_id});
}

TEST_F(LoopbackReceiverTest, ByteFlippedOnTheReceiveSideGivesChecksumError) {
  receive_faults_->AddRule({.action = Action::kCorruptByte, .slot = 1, .offset = 5});
  EXPECT_EQ(FailureKind(), IsolationError::kChecksum) << last_status_;
}

// Pages whose headers carry their payloads' true checksums all land; only the commit's per-layer
// digests (from the sender's own checksums) can tell that they are not the pages it sent.
TEST_F(LoopbackReceiverTest, LayerDigestMismatchGivesChecksumError) {
  const Ticket ticket = Expect(1, 5, 0, 4, kEagerBytes);
  std::vector<uint64_t> checksums;
  std::vector<std::vector<std::byte>> payloads;
  for (uint32_t slot = 0; slot < 4; ++slot) {
    payloads.emplace_back(kEagerBytes);
    FillPattern(payloads.back(), 1, slot);
    checksums.push_back(PayloadChecksum(payloads.back()));
    SendRaw(WireKind::kPage, RawHeader(ticket, slot, checksums.back()), payloads.back());
  }
  receiver_->Progress();
  ASSERT_EQ(receiver_->stats().pages_landed, 4u);
  ControlMessage commit{.kind = WireKind::kCommit,
                        .request_id = 1,
                        .ticket_id = ticket.ticket_id,
                        .epoch = 5,
                        .pages_sent = 4,
                        .layer_digests = {LayerDigest(std::span(checksums).first(2)),
                                          LayerDigest(std::span(checksums).last(2)) ^ 1}};
  SendControl(commit);
  const absl::Status status = receiver_->Outcome(ticket.ticket_id)->status;
  EXPECT_EQ(GetIsolationError(status), IsolationError::kChecksum) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "layer digests")) << status;
}

TEST_F(LoopbackReceiverTest, WrongEpochInAPageGivesEpochError) {
  RewriteSentPage(1, [](PageHeader& header) { header.epoch = 999; });
  EXPECT_EQ(FailureKind(), IsolationError::kEpoch) << last_status_;
  // Refused before a byte landed: the page's destination is still zero.
  EXPECT_TRUE(PageIsZero(1));
}

TEST_F(LoopbackReceiverTest, WrongEpochInTheCommitGivesEpochError) {
  const Ticket ticket = Expect(1, 5, 0, 4);
  SendControl({.kind = WireKind::kCommit,
               .request_id = 1,
               .ticket_id = ticket.ticket_id,
               .epoch = 6,
               .pages_sent = 4});
  EXPECT_EQ(GetIsolationError(receiver_->Outcome(ticket.ticket_id)->status),
            IsolationError::kEpoch);
}

TEST_F(LoopbackReceiverTest, PageNamingAnUnknownTicketGivesHeaderError) {
  RewriteSentPage(1, [](PageHeader& header) { header.ticket_id = 777; });
  EXPECT_EQ(FailureKind(), IsolationError::kHeader) << last_status_;
  EXPECT_TRUE(absl::StrContains(last_status_.message(), "naming ticket 777")) << last_status_;
}

TEST_F(LoopbackReceiverTest, PageNamingAnotherRequestsTicketFailsThatTicketUntouched) {
  const Ticket victim = Expect(2, 6, 4, 4);
  RewriteSentPage(0, [&](PageHeader& header) { header.ticket_id = victim.ticket_id; });
  const Ticket ticket = Expect(1, 5, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  const TransferOutcome outcome = *receiver_->Outcome(victim.ticket_id);
  EXPECT_EQ(GetIsolationError(outcome.status), IsolationError::kHeader) << outcome.status;
  for (uint32_t page = 4; page < 8; ++page) EXPECT_TRUE(PageIsZero(page)) << page;
}

TEST_F(LoopbackReceiverTest, PageBeyondTheTicketOrWithAnotherShapeGivesHeaderError) {
  RewriteSentPage(2, [](PageHeader& header) { header.slot = 9; });
  EXPECT_EQ(FailureKind(), IsolationError::kHeader) << last_status_;
  EXPECT_TRUE(absl::StrContains(last_status_.message(), "beyond")) << last_status_;
}

TEST_F(LoopbackReceiverTest, PageWithAnotherLayerGivesHeaderError) {
  RewriteSentPage(2, [](PageHeader& header) { header.token_end += 1; });
  EXPECT_EQ(FailureKind(), IsolationError::kHeader) << last_status_;
  EXPECT_TRUE(absl::StrContains(last_status_.message(), "the ticket says")) << last_status_;
}

TEST_F(LoopbackReceiverTest, PageOfAnotherSizeGivesHeaderError) {
  const Ticket ticket = Expect(1, 5, 0, 4);
  const std::vector<std::byte> payload(kEagerBytes);
  SendRaw(WireKind::kPage, RawHeader(ticket, 0, PayloadChecksum(payload)), payload);
  receiver_->Progress();
  EXPECT_EQ(GetIsolationError(receiver_->Outcome(ticket.ticket_id)->status),
            IsolationError::kHeader);
}

TEST_F(LoopbackReceiverTest, DuplicatePageGivesDuplicateErrorOnEitherSide) {
  send_faults_.AddRule({.action = Action::kDuplicate, .slot = 3});
  EXPECT_EQ(FailureKind(), IsolationError::kDuplicate) << last_status_;
}

TEST_F(LoopbackReceiverTest, DuplicateArrivingAtTheReceiverGivesDuplicateError) {
  receive_faults_->AddRule({.action = Action::kDuplicate, .slot = 0});
  EXPECT_EQ(FailureKind(), IsolationError::kDuplicate) << last_status_;
}

TEST_F(LoopbackReceiverTest, DroppedPageGivesMissingErrorAfterTheGrace) {
  send_faults_.AddRule({.action = Action::kDrop, .slot = 0});
  const Ticket ticket = Expect(1, 5, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving)
      << "failed inside the missing-page grace";
  clock_.Advance(absl::Milliseconds(201));
  Pump(transfer.get());
  const absl::Status status = receiver_->Outcome(ticket.ticket_id)->status;
  EXPECT_EQ(GetIsolationError(status), IsolationError::kMissing) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "without slots 0")) << status;
}

// UCX does not order a rendezvous page before a later eager commit: a page that lands after the
// commit, inside the grace, verifies.
TEST_F(LoopbackReceiverTest, PageReorderedAfterTheCommitVerifiesWithinTheGrace) {
  receive_faults_->AddRule({.action = Action::kDelay, .slot = 1, .delay = absl::Milliseconds(150)});
  const Ticket ticket = Expect(1, 5, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  EXPECT_EQ(receive_faults_->held(), 1u);
  clock_.Advance(absl::Milliseconds(150));
  Pump(transfer.get());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kVerified);
  EXPECT_TRUE(PagesMatch(1, 0, 4));
}

// The receiver stopped right after the commit came (SIGSTOP, a paused VM, a starved process):
// a page still on its way could not land meanwhile, so that time does not count against the
// grace. Here the first sweep after the stall runs before the page is delivered, as a lane
// thread may deliver it only after the transfer loop's sweep.
TEST_F(LoopbackReceiverTest, ReceiverStallDoesNotCountAgainstTheMissingPageGrace) {
  receive_faults_->AddRule({.action = Action::kDelay, .slot = 1, .delay = absl::Seconds(3)});
  const Ticket ticket = Expect(1, 5, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  ASSERT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  ASSERT_EQ(receive_faults_->held(), 1u);
  Elapse(absl::Milliseconds(2900));  // Stopped: no sweep, no delivery.
  Pump(transfer.get());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving)
      << receiver_->Outcome(ticket.ticket_id)->status;
  EXPECT_EQ(receive_faults_->held(), 1u);
  Elapse(absl::Milliseconds(100));  // Running again: the page comes, inside the grace.
  Pump(transfer.get());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kVerified)
      << receiver_->Outcome(ticket.ticket_id)->status;
  EXPECT_TRUE(PagesMatch(1, 0, 4));
}

// A stall only pauses the grace: a page that is really missing still fails the request once the
// receiver has run for the grace after the stall.
TEST_F(LoopbackReceiverTest, DroppedPageStillGivesMissingErrorAfterAStall) {
  send_faults_.AddRule({.action = Action::kDrop, .slot = 0});
  const Ticket ticket = Expect(1, 5, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  Elapse(absl::Seconds(3));
  Pump(transfer.get());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  for (int step = 0; step < 3; ++step) {
    Elapse(absl::Milliseconds(70));
    Pump(transfer.get());
  }
  const absl::Status status = receiver_->Outcome(ticket.ticket_id)->status;
  EXPECT_EQ(GetIsolationError(status), IsolationError::kMissing) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "without slots 0")) << status;
}

TEST_F(LoopbackReceiverTest, CommitCountingFewerPagesGivesMissingError) {
  const Ticket ticket = Expect(1, 5, 0, 4);
  SendControl({.kind = WireKind::kCommit,
               .request_id = 1,
               .ticket_id = ticket.ticket_id,
               .epoch = 5,
               .pages_sent = 3});
  const absl::Status status = receiver_->Outcome(ticket.ticket_id)->status;
  EXPECT_EQ(GetIsolationError(status), IsolationError::kMissing) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "3 pages sent of 4")) << status;
}

TEST_F(LoopbackReceiverTest, StrayAndUndecodableMessagesAreCountedAndDropped) {
  const Ticket ticket = Expect(1, 5, 0, 4);
  std::vector<std::byte> garbage(64, std::byte{'X'});
  SendRaw(WireKind::kPage, garbage, std::vector<std::byte>(kEagerBytes));
  SendRaw(WireKind::kCommit, {}, garbage);
  SendControl({.kind = WireKind::kHeartbeat, .request_id = 2, .ticket_id = ticket.ticket_id});
  EXPECT_EQ(receiver_->stats().stray_messages, 3u);
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
}

TEST_F(LoopbackReceiverTest, LatePageOfAReleasedTicketIsStrayAndSparesTheRetry) {
  const Ticket first = Expect(1, 5, 0, 4);
  receiver_->ConfirmFence(first.ticket_id);
  ASSERT_EQ(released_, std::vector<uint64_t>{first.ticket_id});
  const Ticket retry = Expect(1, 6, 0, 4);
  RewriteSentPage(0, [&](PageHeader& header) {
    header.ticket_id = first.ticket_id;
    header.epoch = 5;
  });
  auto transfer = Send(retry, 1);  // Slot 0 goes out under the old ticket: refused.
  Pump(transfer.get());
  EXPECT_GE(receiver_->stats().stray_messages, 1u);
  EXPECT_EQ(receiver_->Outcome(retry.ticket_id)->state, TransferState::kReceiving);
  EXPECT_TRUE(receiver_->stats().isolation_errors.empty());
}

TEST_F(LoopbackReceiverTest, SecondTicketForAReceivingRequestIsRefused) {
  Expect(1, 5, 0, 4);
  ReceiveSpec spec{.request_id = 1, .epoch = 5, .pages = MakeDescriptors(1, 1, kPageBytes)};
  spec.destinations.push_back(pool_[5]);
  EXPECT_EQ(receiver_->Expect(spec).status().code(), absl::StatusCode::kAlreadyExists);
}

// More destinations than descriptors: every descriptor has a matching destination, only the
// count check refuses it.
TEST_F(LoopbackReceiverTest, ExpectRejectsMoreDestinationsThanPages) {
  ReceiveSpec spec{.request_id = 1, .pages = MakeDescriptors(1, 1, kPageBytes)};
  spec.destinations = {pool_[0], pool_[1]};
  EXPECT_EQ(receiver_->Expect(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

// The default grace covers a lane whose pages come a few hundred milliseconds after the commit:
// on a loaded 2-core host one lane's pages landed 234-285 ms after it (docs/protocol.md, "Lanes").
TEST(ReceiverDefaultsTest, APageLanding300MsAfterTheCommitVerifies) {
  FakeClock clock;
  LoopbackNetwork network;
  constexpr uint64_t kBytes = 16 * 1024;
  std::vector<std::vector<std::byte>> pool(4, std::vector<std::byte>(kBytes));
  auto faults = std::make_unique<FaultInjectingReceiveTransport>(network.NewReceiveEnd(), clock);
  faults->AddRule({.action = Action::kDelay, .slot = 1, .delay = absl::Milliseconds(300)});
  TransferReceiver receiver(std::move(faults), ReceiverOptions{}, clock,
                            [](uint64_t, uint64_t, const absl::Status&) {});
  absl::StatusOr<Ticket> ticket = receiver.Expect(SpecOverPool(pool, 1, 5, 0, 4, kBytes));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  std::vector<std::vector<std::byte>> sources(4, std::vector<std::byte>(kBytes));
  for (uint32_t slot = 0; slot < 4; ++slot) FillPattern(sources[slot], 1, slot);
  std::unique_ptr<PageTransport> send_end = network.NewSendEnd();
  TransferSender sender(*send_end, clock);
  absl::StatusOr<std::unique_ptr<Transfer>> transfer =
      sender.Prepare(*ticket, {sources.begin(), sources.end()});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(256, 1).ok());
  for (int step = 0; step <= 6; ++step) {  // 50 ms at a time, the receiver sweeping throughout
    for (int round = 0; round < 4; ++round) {
      (*transfer)->Poll().IgnoreError();
      receiver.Progress();
    }
    if (step < 6) clock.Advance(absl::Milliseconds(50));
  }
  absl::StatusOr<TransferOutcome> outcome = receiver.Outcome(ticket->ticket_id);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->state, TransferState::kVerified) << outcome->status;
  for (uint32_t slot = 0; slot < 4; ++slot) EXPECT_TRUE(MatchesPattern(pool[slot], 1, slot));
}

}  // namespace
}  // namespace pdserve::kv::testing
