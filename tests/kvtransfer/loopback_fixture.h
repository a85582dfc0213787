// Fixture of the in-process receiver tests: a TransferReceiver over the loopback transport with
// fault injection on both sides and a fake clock, a TransferSender on a send end of the same
// network, and a small pool of destination pages. Nothing runs on its own: the tests drive both
// sides (Pump), so every run is the same.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "kvtransfer/fault_receive_transport.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {

class LoopbackReceiverTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kPoolPages = 8;
  static constexpr uint64_t kPageBytes = 16 * 1024;  // By rendezvous (>= 8 KiB).
  static constexpr uint64_t kEagerBytes = 2048;

  LoopbackReceiverTest() {
    auto faults =
        std::make_unique<FaultInjectingReceiveTransport>(network_.NewReceiveEnd(), clock_);
    receive_faults_ = faults.get();
    receiver_ = std::make_unique<TransferReceiver>(
        std::move(faults),
        ReceiverOptions{
            .lease = absl::Seconds(10),
            .heartbeat_interval = absl::Seconds(1),
            .missing_grace = absl::Milliseconds(200),
            .run_clock = &run_clock_,
            .incarnation = 1,
            .on_layer = [this](uint64_t ticket_id, uint64_t,
                               uint32_t layer) { layers_.emplace_back(ticket_id, layer); }},
        clock_,
        [this](uint64_t ticket_id, uint64_t, const absl::Status&) {
          released_.push_back(ticket_id);
        },
        [this](uint64_t ticket_id, uint64_t, const TransferOutcome& outcome) {
          decided_.emplace_back(ticket_id, outcome);
        });
    pool_.assign(kPoolPages, std::vector<std::byte>(kPageBytes));
  }

  // A ticket for `request_id` over pool pages [first, first + count).
  Ticket Expect(uint64_t request_id, uint64_t epoch, uint32_t first, uint32_t count,
                uint64_t page_bytes = kPageBytes) {
    auto ticket =
        receiver_->Expect(SpecOverPool(pool_, request_id, epoch, first, count, page_bytes));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : Ticket{};
  }

  // Prepares a transfer of the ticket's pages filled with FillPattern(seed, slot), posts them all
  // and asks for the commit (prompt_tokens 256, first_token seed % 1000).
  std::unique_ptr<Transfer> Send(const Ticket& ticket, uint64_t seed) {
    auto& sources = sources_.emplace_back();
    for (uint32_t slot = 0; slot < ticket.pages.size(); ++slot) {
      sources.emplace_back(ticket.pages[slot].bytes);
      FillPattern(sources.back(), seed, slot);
    }
    auto transfer = sender_.Prepare(ticket, {sources.begin(), sources.end()});
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    if (!transfer.ok()) return nullptr;
    EXPECT_TRUE((*transfer)->PostAll().ok());
    EXPECT_TRUE((*transfer)->Commit(256, static_cast<int32_t>(seed % 1000)).ok());
    return std::move(*transfer);
  }

  // Moves both clocks: between two sweeps, a gap the receiver did not run through (a stall,
  // ReceiverOptions::run_clock) when it is longer than the missing-page grace.
  void Elapse(absl::Duration d) {
    clock_.Advance(d);
    run_clock_.Advance(d);
  }

  // Drives the sender (if any) and the receiver `rounds` times; no time passes.
  void Pump(Transfer* transfer = nullptr, int rounds = 8) {
    for (int i = 0; i < rounds; ++i) {
      if (transfer != nullptr) last_poll_ = transfer->Poll();
      receiver_->Progress();
    }
  }

  // Pumps until the ticket leaves kReceiving; if it does not, moves the clock past the
  // missing-page grace and pumps again.
  TransferOutcome RunUntilDecided(uint64_t ticket_id, Transfer* transfer = nullptr) {
    for (int attempt = 0; attempt < 2; ++attempt) {
      for (int i = 0; i < 32; ++i) {
        Pump(transfer, 1);
        auto outcome = receiver_->Outcome(ticket_id);
        if (!outcome.ok()) return {TransferState::kFailed, outcome.status(), std::nullopt};
        if (outcome->state != TransferState::kReceiving) return *outcome;
      }
      clock_.Advance(absl::Seconds(1));
    }
    return {TransferState::kReceiving, absl::DeadlineExceededError("undecided"), std::nullopt};
  }

  // The isolation error of a 4-page request on pages [0, 4) sent with the faults already added.
  std::optional<IsolationError> FailureKind() {
    const Ticket ticket = Expect(1, 5, 0, 4);
    auto transfer = Send(ticket, 1);
    const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
    EXPECT_EQ(outcome.state, TransferState::kFailed) << outcome.status;
    last_status_ = outcome.status;
    return GetIsolationError(outcome.status);
  }

  // The sender's page in `slot` goes out under a header `rewrite` changed (once).
  void RewriteSentPage(uint32_t slot, std::function<void(PageHeader&)> rewrite) {
    send_faults_.AddRule(
        {.action = FaultRule::Action::kRewriteHeader, .slot = slot, .rewrite = std::move(rewrite)});
  }
  bool PageIsZero(uint32_t page) const {
    return std::all_of(pool_[page].begin(), pool_[page].end(),
                       [](std::byte b) { return b == std::byte{0}; });
  }

  bool PagesMatch(uint64_t seed, uint32_t first, uint32_t count,
                  uint64_t page_bytes = kPageBytes) const {
    for (uint32_t i = 0; i < count; ++i) {
      if (!MatchesPattern(std::span(pool_[first + i]).first(page_bytes), seed, i)) return false;
    }
    return true;
  }

  // The true header of the ticket's page `slot` with `checksum`.
  static std::vector<std::byte> RawHeader(const Ticket& ticket, uint32_t slot, uint64_t checksum) {
    const auto header = EncodePageHeader(HeaderFor(ticket, slot, checksum));
    return {header.begin(), header.end()};
  }

  // Sends one raw message to the receiver, bypassing TransferSender (and its checks).
  void SendRaw(WireKind kind, std::span<const std::byte> header,
               std::span<const std::byte> payload) {
    auto peer = raw_end_->Connect(receiver_->worker_address(), 1);
    ASSERT_TRUE(peer.ok()) << peer.status();
    auto op = raw_end_->Send(*peer, kind, header, payload);
    ASSERT_TRUE(op.ok()) << op.status();
    raw_ops_.push_back(std::move(*op));
  }
  void SendControl(const ControlMessage& message) {
    const std::vector<std::byte> bytes = EncodeControl(message);
    SendRaw(message.kind, {}, bytes);
    receiver_->Progress();
  }
  bool Released(uint64_t ticket_id) const {
    return std::find(released_.begin(), released_.end(), ticket_id) != released_.end();
  }

  // Declared before the receiver, which lands into and reports to them until it is destroyed.
  FakeClock clock_;
  // Whether the receiver ran (ReceiverOptions::run_clock): moved only by the stall tests.
  FakeClock run_clock_;
  LoopbackNetwork network_;
  std::vector<std::vector<std::byte>> pool_;
  std::vector<uint64_t> released_;
  std::vector<std::pair<uint64_t, TransferOutcome>> decided_;
  // (ticket, layer) as on_layer reported them, in order.
  std::vector<std::pair<uint64_t, uint32_t>> layers_;
  std::deque<std::vector<std::vector<std::byte>>> sources_;  // Stable while transfers live.
  FaultInjectingReceiveTransport* receive_faults_ = nullptr;
  std::unique_ptr<TransferReceiver> receiver_;
  std::unique_ptr<PageTransport> send_end_ = network_.NewSendEnd();
  FaultInjectingTransport send_faults_{*send_end_, clock_};
  TransferSender sender_{send_faults_, clock_};
  std::unique_ptr<PageTransport> raw_end_ = network_.NewSendEnd();
  std::vector<std::unique_ptr<SendOp>> raw_ops_;
  absl::StatusOr<bool> last_poll_ = false;
  absl::Status last_status_;
};

}  // namespace pdserve::kv::testing
