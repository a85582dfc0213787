// One process, real UCX over tcp loopback: the endpoint cache across receiver restarts and
// transient failures, heartbeats renewing the lease, and the idle sweep.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "kvtransfer/fault_transport.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

constexpr uint64_t kPageBytes = 64 * 1024;

class InProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    auto transport = UcxTransport::Create();
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = std::move(*transport);
    pool_.assign(4, std::vector<std::byte>(kPageBytes));
    sources_.assign(4, std::vector<std::byte>(kPageBytes));
    for (uint32_t slot = 0; slot < 4; ++slot) FillPattern(sources_[slot], 9, slot);
  }

  std::unique_ptr<TransferReceiver> MakeReceiver(uint64_t incarnation) {
    auto receiver =
        CreateUcxReceiver({.lease = absl::Seconds(10),
                           .heartbeat_interval = absl::Seconds(1),
                           .incarnation = incarnation},
                          clock_, [this](uint64_t ticket_id, uint64_t, const absl::Status&) {
                            released_.push_back(ticket_id);
                          });
    EXPECT_TRUE(receiver.ok()) << receiver.status();
    return receiver.ok() ? std::move(*receiver) : nullptr;
  }

  Ticket Expect(TransferReceiver& receiver, uint64_t request_id) {
    ReceiveSpec spec{
        .request_id = request_id, .epoch = 1, .pages = MakeDescriptors(4, 2, kPageBytes)};
    for (auto& page : pool_) spec.destinations.push_back(page);
    auto ticket = receiver.Expect(std::move(spec));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return *ticket;
  }

  // Sends the four source pages through `transport` and drives both sides to the outcome.
  TransferState SendAndVerify(TransferReceiver& receiver, const Ticket& ticket,
                              PageTransport& transport) {
    TransferSender sender(transport, clock_);
    auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    if (!transfer.ok()) return TransferState::kFailed;
    EXPECT_TRUE((*transfer)->PostAll().ok());
    EXPECT_TRUE((*transfer)->Commit(256, 7).ok());
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until) {
      absl::StatusOr<bool> done = (*transfer)->Poll();
      EXPECT_TRUE(done.ok()) << done.status();
      receiver.Progress();
      auto outcome = receiver.Outcome(ticket.ticket_id);
      if (done.ok() && *done && outcome.ok() && outcome->state != TransferState::kReceiving) {
        EXPECT_TRUE((*transfer)->Release().ok());
        return outcome->state;
      }
      if (!done.ok()) return TransferState::kFailed;
    }
    return TransferState::kReceiving;
  }

  // Commits, drives both sides until the commit is delivered, releases the transfer and lets the
  // receiver handle the commit.
  void DeliverCommit(TransferReceiver& receiver, Transfer& transfer) {
    ASSERT_TRUE(transfer.Commit(256, 7).ok());
    const absl::Time until = absl::Now() + absl::Seconds(20);
    absl::StatusOr<bool> delivered = false;
    while (delivered.ok() && !*delivered && absl::Now() < until) {
      delivered = transfer.Poll();
      receiver.Progress();
    }
    ASSERT_TRUE(delivered.ok() && *delivered) << delivered.status();
    EXPECT_TRUE(transfer.Release().ok());
    receiver.RunFor(absl::Milliseconds(20));
  }

  FakeClock clock_;
  std::unique_ptr<UcxTransport> transport_;
  std::vector<std::vector<std::byte>> pool_;
  std::vector<std::vector<std::byte>> sources_;
  std::vector<uint64_t> released_;
};

TEST_F(InProcessTest, RestartedReceiverGetsAFreshEndpoint) {
  auto first = MakeReceiver(1);
  const std::vector<std::byte> address = first->worker_address();
  auto peer = transport_->Connect(address, 1);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(*transport_->Connect(address, 1), *peer) << "a healthy endpoint is reused";
  EXPECT_EQ(SendAndVerify(*first, Expect(*first, 1), *transport_), TransferState::kVerified);

  first.reset();
  auto second = MakeReceiver(2);
  auto fresh = transport_->Connect(second->worker_address(), 2);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(*fresh, *peer);
  EXPECT_EQ(SendAndVerify(*second, Expect(*second, 2), *transport_), TransferState::kVerified);
  EXPECT_EQ(transport_->endpoints_created(), 2u);
}

TEST_F(InProcessTest, SameAddressWithNewIncarnationDropsTheCachedEndpoint) {
  auto receiver = MakeReceiver(1);
  auto old_peer = transport_->Connect(receiver->worker_address(), 1);
  auto new_peer = transport_->Connect(receiver->worker_address(), 2);
  ASSERT_TRUE(old_peer.ok() && new_peer.ok());
  EXPECT_NE(*old_peer, *new_peer);
  EXPECT_EQ(transport_->PeerStatus(*old_peer).code(), absl::StatusCode::kNotFound);
}

TEST_F(InProcessTest, TransientFailureDoesNotMarkThePeerDeadForever) {
  auto receiver = MakeReceiver(1);
  auto peer = transport_->Connect(receiver->worker_address(), 1);
  ASSERT_TRUE(peer.ok());
  transport_->Disconnect(*peer);
  EXPECT_EQ(transport_->PeerStatus(*peer).code(), absl::StatusCode::kUnavailable);
  auto again = transport_->Connect(receiver->worker_address(), 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, *peer);
  EXPECT_TRUE(transport_->PeerStatus(*again).ok());
  EXPECT_EQ(SendAndVerify(*receiver, Expect(*receiver, 1), *transport_), TransferState::kVerified);
}

TEST_F(InProcessTest, HeartbeatsKeepTheLeaseAliveWhileAPageIsHeld) {
  auto receiver = MakeReceiver(1);
  const Ticket ticket = Expect(*receiver, 1);
  FaultInjectingTransport faults(*transport_, clock_);
  faults.AddRule({.action = FaultRule::Action::kDelay, .slot = 3, .delay = absl::Seconds(30)});
  TransferSender sender(faults, clock_);
  auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(256, 7).ok());
  // 25 s of fake time against a 10 s lease: only the once-a-second heartbeats keep it.
  for (int second = 0; second < 25; ++second) {
    clock_.Advance(absl::Seconds(1));
    const absl::Time until = absl::Now() + absl::Milliseconds(20);
    while (absl::Now() < until) {
      ASSERT_TRUE((*transfer)->Poll().ok());
      receiver->Progress();
    }
    ASSERT_EQ(receiver->Outcome(ticket.ticket_id)->state, TransferState::kReceiving)
        << "lease lost after " << second + 1 << " s";
  }
  clock_.Advance(absl::Seconds(6));  // The held page goes out.
  const absl::Time until = absl::Now() + absl::Seconds(20);
  absl::StatusOr<bool> done = false;
  while (done.ok() && !*done && absl::Now() < until) {
    done = (*transfer)->Poll();
    receiver->Progress();
  }
  ASSERT_TRUE(done.ok() && *done) << done.status();
  receiver->RunFor(absl::Milliseconds(20));
  EXPECT_EQ(receiver->Outcome(ticket.ticket_id)->state, TransferState::kVerified);
  EXPECT_TRUE(released_.empty());
}

TEST_F(InProcessTest, IdleReceiverSweepsAnExpiredLease) {
  auto receiver = MakeReceiver(1);
  const Ticket ticket = Expect(*receiver, 1);
  clock_.Advance(absl::Seconds(11));
  // No message arrives and nobody calls Progress(): RunFor's timed wait still sweeps.
  receiver->RunFor(absl::Milliseconds(30));
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_EQ(receiver->stats().isolation_errors[IsolationError::kLease], 1u);
}

// RunFor sleeps on the UCX event fd without the receiver's lock: a Reserve's Prepare (here
// Expect) on another thread returns while the idle receiver sleeps out a 2 s poll interval.
TEST_F(InProcessTest, PrepareDoesNotWaitForAnIdleReceiversSleep) {
  auto receiver = MakeReceiver(1);
  std::thread runner([&] { receiver->RunFor(absl::Seconds(3), absl::Seconds(2)); });
  absl::SleepFor(absl::Milliseconds(200));  // the runner is asleep on the fd by now
  const absl::Time start = absl::Now();
  const Ticket ticket = Expect(*receiver, 1);
  const absl::Duration took = absl::Now() - start;
  runner.join();
  EXPECT_GT(ticket.ticket_id, 0u);
  EXPECT_LT(took, absl::Seconds(1)) << "Prepare waited for the sleep: " << took;
}

TEST_F(InProcessTest, AbortWaitsForTheFenceOrTheLease) {
  auto receiver = MakeReceiver(1);
  const Ticket fenced = Expect(*receiver, 1);
  ASSERT_TRUE(receiver->Abort(fenced.ticket_id).ok());
  receiver->RunFor(absl::Milliseconds(10));
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(receiver->Outcome(fenced.ticket_id)->state, TransferState::kAborted);
  receiver->ConfirmFence(fenced.ticket_id);
  EXPECT_EQ(released_, std::vector<uint64_t>{fenced.ticket_id});

  const Ticket unfenced = Expect(*receiver, 2);
  ASSERT_TRUE(receiver->Abort(unfenced.ticket_id).ok());
  clock_.Advance(absl::Seconds(11));
  receiver->RunFor(absl::Milliseconds(10));
  EXPECT_EQ(released_, (std::vector<uint64_t>{fenced.ticket_id, unfenced.ticket_id}));
}

// The decode side aborts after every page landed and before the prefill side commits (the
// client's disconnect reached only the decode worker). The sender commits only once every page
// send completed, so its commit is the word that no write is in flight: the pages come back at
// once, long before the 10 s lease (the fake clock never moves).
TEST_F(InProcessTest, CommitAfterTheAbortLiftsTheFence) {
  auto receiver = MakeReceiver(1);
  const Ticket ticket = Expect(*receiver, 1);
  TransferSender sender(*transport_, clock_);
  auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (receiver->stats().pages_landed < 4 && absl::Now() < until) {
    ASSERT_TRUE((*transfer)->Poll().ok());
    receiver->Progress();
  }
  ASSERT_EQ(receiver->stats().pages_landed, 4u);
  ASSERT_TRUE(receiver->Abort(ticket.ticket_id).ok());
  receiver->RunFor(absl::Milliseconds(10));
  EXPECT_TRUE(released_.empty()) << "released before the sender said it finished writing";

  DeliverCommit(*receiver, **transfer);
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_EQ(receiver->Outcome(ticket.ticket_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(receiver->stats().isolation_errors.empty());
}

// Only a commit for the ticket's own epoch stands for the fence: a stale writer's commit (another
// epoch) leaves the aborted ticket's pages held.
TEST_F(InProcessTest, ACommitOfAnotherEpochDoesNotLiftTheAbortFence) {
  auto receiver = MakeReceiver(1);
  const Ticket ticket = Expect(*receiver, 1);
  ASSERT_TRUE(receiver->Abort(ticket.ticket_id).ok());
  auto peer = transport_->Connect(receiver->worker_address(), 1);
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto send_commit = [&](uint64_t epoch) {
    const std::vector<std::byte> bytes = EncodeControl({.kind = WireKind::kCommit,
                                                        .request_id = ticket.request_id,
                                                        .ticket_id = ticket.ticket_id,
                                                        .epoch = epoch,
                                                        .pages_sent = 4,
                                                        .prompt_tokens = 256,
                                                        .first_token = 7});
    auto op = transport_->Send(*peer, WireKind::kCommit, {}, bytes);
    ASSERT_TRUE(op.ok()) << op.status();
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (!(*op)->Test().has_value() && absl::Now() < until) {
      transport_->Progress();
      receiver->Progress();
    }
    ASSERT_TRUE((*op)->Test().has_value());
    receiver->RunFor(absl::Milliseconds(20));
  };
  send_commit(ticket.epoch + 1);
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(receiver->Outcome(ticket.ticket_id)->state, TransferState::kAborted);
  send_commit(ticket.epoch);
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
}

// A commit that arrived before the abort (a page still inside the missing-page grace) already
// said the sender finished writing: the abort releases the pages without waiting for more.
TEST_F(InProcessTest, AbortAfterTheCommitReleasesAtOnce) {
  auto receiver = MakeReceiver(1);
  const Ticket ticket = Expect(*receiver, 1);
  FaultInjectingTransport faults(*transport_, clock_);
  faults.AddRule({.action = FaultRule::Action::kDrop, .slot = 3});
  TransferSender sender(faults, clock_);
  auto transfer = sender.Prepare(ticket, {sources_.begin(), sources_.end()});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  DeliverCommit(*receiver, **transfer);
  ASSERT_EQ(receiver->Outcome(ticket.ticket_id)->state, TransferState::kReceiving);
  EXPECT_EQ(receiver->stats().pages_landed, 3u);
  ASSERT_TRUE(receiver->Abort(ticket.ticket_id).ok());
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_TRUE(receiver->stats().isolation_errors.empty());
}

TEST_F(InProcessTest, FenceForAReceivingTicketAbandonsItWithoutAnIsolationError) {
  auto receiver = MakeReceiver(1);
  const Ticket ticket = Expect(*receiver, 1);
  // The sender's word that it stopped with nothing in flight, before any commit: released at
  // once, well inside the lease, and not counted as an isolation error.
  receiver->ConfirmFence(ticket.ticket_id);
  EXPECT_EQ(released_, std::vector<uint64_t>{ticket.ticket_id});
  EXPECT_EQ(receiver->Outcome(ticket.ticket_id).status().code(), absl::StatusCode::kNotFound);
  const ReceiverStats stats = receiver->stats();
  EXPECT_TRUE(stats.isolation_errors.empty());
  EXPECT_EQ(stats.abandoned, 1u);
  EXPECT_EQ(stats.tickets_held, 0u);
}

TEST_F(InProcessTest, ExpectRejectsMismatchedDestinations) {
  auto receiver = MakeReceiver(1);
  ReceiveSpec spec{.request_id = 1, .pages = MakeDescriptors(2, 1, kPageBytes)};
  spec.destinations.push_back(pool_[0]);
  EXPECT_EQ(receiver->Expect(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.destinations.push_back(std::span(pool_[1]).first(100));
  EXPECT_EQ(receiver->Expect(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::kv::testing
