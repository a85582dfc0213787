// The abort fence, abandonment, leases, heartbeats, landings in flight and the outcome callback,
// in process over the loopback transport (lifecycle_process_test and endpoint_lease_test check
// the same rules over UCX).
#include <gtest/gtest.h>

#include "tests/kvtransfer/loopback_fixture.h"

namespace pdserve::kv::testing {
namespace {

using Action = FaultRule::Action;

// A request aborted mid-transfer, then at once a new request on the same pages, 200 times: the
// new request always holds exactly what its sender sent.
TEST_F(LoopbackReceiverTest, AbortMidTransferThenImmediateReuse200Times) {
  for (uint64_t round = 0; round < 200; ++round) {
    send_faults_.AddRule({.action = Action::kDelay, .slot = 2, .delay = absl::Hours(1)});
    const Ticket aborted = Expect(2 * round + 1, 2 * round + 1, 0, 4);
    auto stale = Send(aborted, 1000 + round);
    Pump(stale.get(), 2);
    ASSERT_GE(receiver_->stats().pages_landed, 4 * round + 1) << "round " << round;
    ASSERT_TRUE(receiver_->Abort(aborted.ticket_id).ok());
    Pump();
    ASSERT_FALSE(Released(aborted.ticket_id)) << "released before the sender's fence";
    stale.reset();  // The sender stops: cancels its sends and fences.
    Pump();
    ASSERT_TRUE(Released(aborted.ticket_id)) << "round " << round;

    const Ticket next = Expect(2 * round + 2, 2 * round + 2, 0, 4);
    auto transfer = Send(next, 5000 + round);
    const TransferOutcome outcome = RunUntilDecided(next.ticket_id, transfer.get());
    ASSERT_EQ(outcome.state, TransferState::kVerified) << "round " << round << outcome.status;
    ASSERT_TRUE(PagesMatch(5000 + round, 0, 4)) << "round " << round;
  }
}

// Even when the fence is confirmed while the aborted request's sender still writes (a control
// plane that lied), its late pages are refused and never land in the pages' next owner.
TEST_F(LoopbackReceiverTest, LatePagesOfAnAbortedTicketNeverLand) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 1, .delay = absl::Seconds(1), .uses = 3});
  const Ticket aborted = Expect(1, 1, 0, 4);
  auto stale = Send(aborted, 1);
  Pump(stale.get(), 2);
  ASSERT_TRUE(receiver_->Abort(aborted.ticket_id).ok());
  receiver_->ConfirmFence(aborted.ticket_id);
  ASSERT_TRUE(Released(aborted.ticket_id));

  const Ticket next = Expect(2, 2, 0, 4);
  auto transfer = Send(next, 2);
  EXPECT_EQ(RunUntilDecided(next.ticket_id, transfer.get()).state, TransferState::kVerified);
  clock_.Advance(absl::Seconds(2));  // The stale sender's held page goes out now: refused.
  Pump(stale.get());
  EXPECT_FALSE(last_poll_.ok());
  EXPECT_EQ(last_poll_.status().code(), absl::StatusCode::kCancelled) << last_poll_.status();
  EXPECT_TRUE(PagesMatch(2, 0, 4));
  EXPECT_GE(receiver_->stats().stray_messages, 1u);
}

// A page accepted before the abort is still being received (rendezvous): the pages come back
// only once that receive finished, even though the fence is already confirmed.
TEST_F(LoopbackReceiverTest, ReleaseWaitsForALandingInFlight) {
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  ASSERT_TRUE(transfer->Poll().ok());  // Every page handed to the transport.
  receiver_->Progress();               // Headers accepted; payloads land next Progress.
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  receiver_->ConfirmFence(ticket.ticket_id);
  EXPECT_FALSE(Released(ticket.ticket_id)) << "released while receives were in flight";
  receiver_->Progress();
  EXPECT_TRUE(Released(ticket.ticket_id));
}

TEST_F(LoopbackReceiverTest, SenderSilentPastTheLeaseFreesPagesWithLeaseError) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 1, .delay = absl::Hours(1)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  transfer.release();  // The sender vanishes without a word (no fence, no heartbeat).
  clock_.Advance(absl::Seconds(9));
  Pump();
  EXPECT_TRUE(released_.empty()) << "pages must stay held until the lease ends";
  clock_.Advance(absl::Seconds(2));
  Pump();
  EXPECT_TRUE(Released(ticket.ticket_id));
  EXPECT_EQ(receiver_->stats().isolation_errors[IsolationError::kLease], 1u);
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LoopbackReceiverTest, HeartbeatsKeepTheLeaseAliveWhileAPageIsHeld) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 3, .delay = absl::Seconds(30)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  // 25 s of fake time against a 10 s lease: only the once-a-second heartbeats keep it.
  for (int second = 0; second < 25; ++second) {
    clock_.Advance(absl::Seconds(1));
    Pump(transfer.get(), 2);
    ASSERT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving)
        << "lease lost after " << second + 1 << " s";
  }
  clock_.Advance(absl::Seconds(6));  // The held page goes out.
  EXPECT_EQ(RunUntilDecided(ticket.ticket_id, transfer.get()).state, TransferState::kVerified);
  EXPECT_TRUE(released_.empty());
}

TEST_F(LoopbackReceiverTest, HeartbeatsLostAtTheReceiverLetTheLeaseEnd) {
  receive_faults_->AddRule({.action = Action::kDrop, .kind = WireKind::kHeartbeat, .uses = -1});
  send_faults_.AddRule({.action = Action::kDelay, .slot = 3, .delay = absl::Seconds(30)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  for (int second = 0; second < 11; ++second) {
    clock_.Advance(absl::Seconds(1));
    Pump(transfer.get(), 2);
  }
  ASSERT_EQ(decided_.size(), 1u);  // Failed and released in one sweep: the pushed outcome.
  EXPECT_EQ(GetIsolationError(decided_[0].second.status), IsolationError::kLease)
      << decided_[0].second.status;
  EXPECT_TRUE(Released(ticket.ticket_id));
}

TEST_F(LoopbackReceiverTest, IdleReceiverSweepsAnExpiredLease) {
  const Ticket ticket = Expect(1, 1, 0, 4);
  clock_.Advance(absl::Seconds(11));
  // No message arrives and nobody calls Progress(): RunFor's timed wait still sweeps.
  receiver_->RunFor(absl::Milliseconds(5));
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_EQ(receiver_->stats().isolation_errors[IsolationError::kLease], 1u);
}

TEST_F(LoopbackReceiverTest, AbortWaitsForTheFenceOrTheLease) {
  const Ticket fenced = Expect(1, 1, 0, 4);
  ASSERT_TRUE(receiver_->Abort(fenced.ticket_id).ok());
  Pump();
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(receiver_->Outcome(fenced.ticket_id)->state, TransferState::kAborted);
  EXPECT_EQ(receiver_->Outcome(fenced.ticket_id)->status.code(), absl::StatusCode::kCancelled);
  receiver_->ConfirmFence(fenced.ticket_id);
  EXPECT_EQ(released_, std::vector<uint64_t>{fenced.ticket_id});

  const Ticket unfenced = Expect(2, 2, 4, 4);
  ASSERT_TRUE(receiver_->Abort(unfenced.ticket_id).ok());
  clock_.Advance(absl::Seconds(9));
  Pump();
  EXPECT_EQ(released_.size(), 1u);
  clock_.Advance(absl::Seconds(2));
  Pump();
  EXPECT_EQ(released_, (std::vector<uint64_t>{fenced.ticket_id, unfenced.ticket_id}));
}

// The sender's fence message (its Transfer destroyed before the commit) does what ConfirmFence
// does: an aborted ticket's pages come back at once.
TEST_F(LoopbackReceiverTest, TheSendersFenceMessageLiftsTheAbortFence) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 3, .delay = absl::Hours(1)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  Pump();
  EXPECT_TRUE(released_.empty());
  transfer.reset();
  Pump();
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
}

// The decode side aborts after every page landed and before the commit: the sender commits only
// once every page send completed, so its commit for the ticket's epoch lifts the fence; a commit
// of another epoch (a stale writer) does not.
TEST_F(LoopbackReceiverTest, OnlyACommitOfTheTicketsEpochLiftsTheAbortFence) {
  const Ticket ticket = Expect(1, 1, 0, 4);
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  ControlMessage commit{.kind = WireKind::kCommit,
                        .request_id = 1,
                        .ticket_id = ticket.ticket_id,
                        .epoch = 2,
                        .pages_sent = 4};
  SendControl(commit);
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kAborted);
  commit.epoch = 1;
  SendControl(commit);
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_TRUE(receiver_->stats().isolation_errors.empty());
}

// A commit that arrived before the abort (a page still inside the missing-page grace) already
// said the sender finished writing: the abort releases the pages without waiting for more.
TEST_F(LoopbackReceiverTest, AbortAfterTheCommitReleasesAtOnce) {
  send_faults_.AddRule({.action = Action::kDrop, .slot = 3});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  ASSERT_TRUE(last_poll_.ok() && *last_poll_) << "commit not delivered";
  ASSERT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_TRUE(receiver_->stats().isolation_errors.empty());
}

TEST_F(LoopbackReceiverTest, FenceBeforeTheCommitAbandonsWithoutAnIsolationError) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 3, .delay = absl::Hours(1)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  transfer.reset();  // The prefill side gave up: cancels, fences.
  Pump();
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  ASSERT_EQ(decided_.size(), 1u);
  EXPECT_EQ(decided_[0].second.state, TransferState::kAbandoned);
  EXPECT_EQ(decided_[0].second.status.code(), absl::StatusCode::kAborted);
  const ReceiverStats stats = receiver_->stats();
  EXPECT_TRUE(stats.isolation_errors.empty());
  EXPECT_EQ(stats.abandoned, 1u);
  EXPECT_EQ(stats.tickets_held, 0u);
}

// A fence after the commit does not abandon: the sender claimed every page delivered, and the
// missing-page check decides.
TEST_F(LoopbackReceiverTest, FenceAfterTheCommitLeavesTheMissingPageCheckToDecide) {
  send_faults_.AddRule({.action = Action::kDrop, .slot = 3});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  receiver_->ConfirmFence(ticket.ticket_id);
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  clock_.Advance(absl::Milliseconds(201));
  Pump();
  EXPECT_EQ(GetIsolationError(receiver_->Outcome(ticket.ticket_id)->status),
            IsolationError::kMissing);
}

// A page for a ticket that is no longer receiving (here aborted, its fence not yet in) is refused
// before a byte lands, and its sender learns it at once (Cancelled).
TEST_F(LoopbackReceiverTest, PageForAnAbortedTicketIsRefusedBeforeItLands) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 3, .delay = absl::Seconds(1)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  clock_.Advance(absl::Seconds(2));  // The held page goes out now.
  Pump(transfer.get());
  EXPECT_FALSE(last_poll_.ok());
  EXPECT_EQ(last_poll_.status().code(), absl::StatusCode::kCancelled) << last_poll_.status();
  EXPECT_TRUE(PageIsZero(3));
  EXPECT_EQ(receiver_->stats().pages_landed, 3u);
}

// Verified pages belong to the request: an Abort then is refused and releases nothing.
TEST_F(LoopbackReceiverTest, AbortOfAVerifiedTicketIsRefused) {
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  ASSERT_EQ(RunUntilDecided(ticket.ticket_id, transfer.get()).state, TransferState::kVerified);
  EXPECT_EQ(receiver_->Abort(ticket.ticket_id).code(), absl::StatusCode::kFailedPrecondition);
  receiver_->ConfirmFence(ticket.ticket_id);
  Pump();
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kVerified);
}

// A sender lost while its page was being received: the slot stays empty and the lease decides.
TEST_F(LoopbackReceiverTest, SenderLostMidPageLeavesTheSlotToTheLease) {
  receive_faults_->AddRule({.action = Action::kDisconnect, .slot = 2});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get());
  EXPECT_EQ(receiver_->stats().pages_landed, 3u);
  EXPECT_EQ(receiver_->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  clock_.Advance(absl::Milliseconds(201));
  Pump();
  EXPECT_EQ(GetIsolationError(receiver_->Outcome(ticket.ticket_id)->status),
            IsolationError::kMissing);
}

TEST_F(LoopbackReceiverTest, ReceiverGoneFailsTheSenderWithUnavailable) {
  send_faults_.AddRule({.action = Action::kDelay, .slot = 3, .delay = absl::Seconds(1)});
  const Ticket ticket = Expect(1, 1, 0, 4);
  auto transfer = Send(ticket, 1);
  Pump(transfer.get(), 2);
  receiver_.reset();
  clock_.Advance(absl::Seconds(2));
  const absl::StatusOr<bool> polled = transfer->Poll();
  ASSERT_FALSE(polled.ok());
  EXPECT_EQ(polled.status().code(), absl::StatusCode::kUnavailable) << polled.status();
}

TEST_F(LoopbackReceiverTest, EveryOutcomeIsPushedOnceWhenDecided) {
  const Ticket verified = Expect(1, 1, 0, 2);
  auto transfer = Send(verified, 1);
  Pump(transfer.get());
  const Ticket aborted = Expect(2, 2, 2, 2);
  ASSERT_TRUE(receiver_->Abort(aborted.ticket_id).ok());
  const Ticket lapsed = Expect(3, 3, 4, 2);
  clock_.Advance(absl::Seconds(11));
  Pump(transfer.get());
  ASSERT_EQ(decided_.size(), 3u);
  EXPECT_EQ(decided_[0].first, verified.ticket_id);
  EXPECT_EQ(decided_[0].second.state, TransferState::kVerified);
  ASSERT_TRUE(decided_[0].second.commit.has_value());
  EXPECT_EQ(decided_[0].second.commit->first_token, 1);
  EXPECT_EQ(decided_[1].first, aborted.ticket_id);
  EXPECT_EQ(decided_[1].second.state, TransferState::kAborted);
  EXPECT_EQ(decided_[2].first, lapsed.ticket_id);
  EXPECT_EQ(GetIsolationError(decided_[2].second.status), IsolationError::kLease);
  // The pushed verified outcome counts as read: forgotten once its lease ended.
  EXPECT_EQ(receiver_->Outcome(verified.ticket_id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LoopbackReceiverTest, UnreadVerifiedOutcomeOutlivesItsLeaseByOneLease) {
  // Without an outcome callback a verified outcome is kept until it was read (or a lease later).
  auto receiver = std::make_unique<TransferReceiver>(network_.NewReceiveEnd(),
                                                     ReceiverOptions{.lease = absl::Seconds(10)},
                                                     clock_, [](auto, auto, const auto&) {});
  ReceiveSpec spec{.request_id = 1, .epoch = 1, .pages = MakeDescriptors(2, 1, kPageBytes)};
  spec.destinations = {pool_[0], pool_[1]};
  const Ticket ticket = *receiver->Expect(std::move(spec));
  auto transfer = Send(ticket, 1);
  for (int i = 0; i < 8; ++i) {
    (void)transfer->Poll();
    receiver->Progress();
  }
  clock_.Advance(absl::Seconds(11));
  receiver->Progress();
  EXPECT_EQ(receiver->Outcome(ticket.ticket_id)->state, TransferState::kVerified);
  receiver->Progress();  // Read once and past the lease: forgotten.
  EXPECT_EQ(receiver->Outcome(ticket.ticket_id).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve::kv::testing
