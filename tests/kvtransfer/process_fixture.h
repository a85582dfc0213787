// Fixture of the process tests: this process is the decode side (a TransferReceiver on a small
// pool of pages and a fake clock); kv_test_peer processes are prefill senders.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {

class ReceiverProcessTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kPoolPages = 8;
  static constexpr uint64_t kPageBytes = 256 * 1024;
  // The receiver's lease. Its fake clock stands still unless a test advances it, while the peer
  // process checks a ticket's deadline against the wall clock, so every ticket a test makes must
  // reach its peer within this long of the fixture's start (200 rounds of LifecycleTest under
  // UCX's v2 protocols on a loaded 2-core machine took over 10 s).
  static constexpr absl::Duration kLease = absl::Seconds(120);

  // UCX reads UCX_TLS when the context is created, so the receiver and its peers agree on it;
  // `protocols` goes to the receiver and to every sender StartSender starts.
  void StartReceiver(const std::string& tls, UcxProtocols protocols = UcxProtocols::kV1) {
    tls_ = tls;
    protocols_ = protocols;
    setenv("UCX_TLS", tls.c_str(), 1);
    pool_.assign(kPoolPages, std::vector<std::byte>(kPageBytes));
    auto receiver = CreateUcxReceiver(
        {.lease = kLease, .heartbeat_interval = absl::Milliseconds(100), .incarnation = 1}, clock_,
        [this](uint64_t ticket_id, uint64_t, const absl::Status&) {
          released_.push_back(ticket_id);
        },
        nullptr, /*lanes=*/1, protocols);
    ASSERT_TRUE(receiver.ok()) << receiver.status();
    receiver_ = std::move(*receiver);
  }

  std::unique_ptr<PeerProcess> StartSender() {
    auto peer = PeerProcess::Start({PDSERVE_KV_TEST_PEER, "send", UcxProtocolsName(protocols_)},
                                   {"UCX_TLS=" + tls_});
    EXPECT_TRUE(peer.ok()) << peer.status();
    if (!peer.ok()) return nullptr;
    auto ready = (*peer)->ReadLine(absl::Seconds(20));
    EXPECT_TRUE(ready.ok() && *ready == "ready")
        << (ready.ok() ? *ready : ready.status().ToString());
    return std::move(*peer);
  }

  // A ticket for `request_id` over pool pages [first, first + count).
  Ticket Expect(uint64_t request_id, uint64_t epoch, uint32_t first, uint32_t count,
                uint64_t page_bytes = kPageBytes) {
    auto ticket =
        receiver_->Expect(SpecOverPool(pool_, request_id, epoch, first, count, page_bytes));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : Ticket{};
  }

  static void Send(PeerProcess& peer, uint64_t seed, const Ticket& ticket,
                   const std::string& faults = "") {
    ASSERT_TRUE(
        peer.WriteLine(absl::StrCat("send ", seed, " ", ToHex(EncodeTicket(ticket)), " ", faults))
            .ok());
  }

  // Runs the receiver until `peer` prints a line starting with `prefix`; returns the line.
  std::string RunUntilLine(PeerProcess& peer, const std::string& prefix,
                           absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time until = absl::Now() + timeout;
    while (absl::Now() < until) {
      receiver_->RunFor(absl::Milliseconds(2));
      auto line = peer.ReadLine(absl::Milliseconds(1));
      if (line.ok() && absl::StartsWith(*line, prefix)) return *line;
      if (!line.ok() && line.status().code() == absl::StatusCode::kUnavailable) break;
    }
    return "<no line starting with " + prefix + ">";
  }

  // Runs the receiver until the ticket leaves kReceiving (or `timeout`).
  TransferOutcome RunUntilDecided(uint64_t ticket_id, absl::Duration timeout = absl::Seconds(20)) {
    const absl::Time until = absl::Now() + timeout;
    while (absl::Now() < until) {
      receiver_->RunFor(absl::Milliseconds(2));
      auto outcome = receiver_->Outcome(ticket_id);
      if (!outcome.ok()) return {TransferState::kFailed, outcome.status(), std::nullopt};
      if (outcome->state != TransferState::kReceiving) return *outcome;
    }
    return {TransferState::kReceiving, absl::DeadlineExceededError("undecided"), std::nullopt};
  }

  bool PagesMatch(uint64_t seed, uint32_t first, uint32_t count,
                  uint64_t page_bytes = kPageBytes) const {
    for (uint32_t i = 0; i < count; ++i) {
      if (!MatchesPattern(std::span(pool_[first + i]).first(page_bytes), seed, i)) return false;
    }
    return true;
  }

  std::string tls_;
  UcxProtocols protocols_ = UcxProtocols::kV1;
  FakeClock clock_;
  std::vector<std::vector<std::byte>> pool_;
  std::unique_ptr<TransferReceiver> receiver_;
  std::vector<uint64_t> released_;
};

}  // namespace pdserve::kv::testing
