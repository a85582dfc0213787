// A landed page's checksum and element conversion (LandingTarget::finish, kvtransfer/
// receive_transport.h) run outside the receiver's mutex, so lanes verify in parallel: driven here
// through a hand-held transport with two lanes, as a lane thread would call the sink. While the
// receiver's mutex is held elsewhere, two threads finish pages of two requests (one sent in bf16
// into fp32 pages, one in fp32); a corrupted page's finish reports the mismatching checksum and
// never writes its destination, and only its request fails (isolation: the other verifies).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "kvtransfer/page_header.h"
#include "kvtransfer/transfer_receiver.h"
#include "serving/element_type.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

using serving::ElementType;

constexpr uint32_t kPages = 4;
constexpr uint64_t kPageBytes = 256;  // fp32 destination pages: 64 values.

// The wire end a lane thread would drive: the test calls the sink itself.
class HandTransport final : public ReceiveTransport {
 public:
  void SetSink(PageSink* sink) override { sink_ = sink; }
  std::vector<std::byte> address() const override { return {std::byte{1}}; }
  absl::Status RegisterMemory(std::span<std::byte>) override { return absl::OkStatus(); }
  void Progress() override {}
  std::function<void(absl::Duration)> ArmWait() override {
    return [](absl::Duration) {};
  }
  int lanes() const override { return 2; }
  void SetSinkMutex(absl::Mutex* sink_mutex) override { sink_mutex_ = sink_mutex; }

  PageSink* sink_ = nullptr;
  absl::Mutex* sink_mutex_ = nullptr;
};

// One request's pages as sent: payload bytes (in `element`) and their headers.
struct Sent {
  std::vector<std::vector<std::byte>> payloads;
  std::vector<PageHeader> headers;
};

// Value i of slot s is 1 + s + (i % 16) / 16 (exact in bf16 and fp32), sent as `element`.
Sent MakePages(const Ticket& ticket, ElementType element) {
  Sent sent;
  for (uint32_t slot = 0; slot < ticket.pages.size(); ++slot) {
    const PageDescriptor& page = ticket.pages[slot];
    const size_t values = page.bytes / 4;
    std::vector<std::byte>& payload =
        sent.payloads.emplace_back(element == ElementType::kBfloat16 ? 2 * values : 4 * values);
    for (size_t i = 0; i < values; ++i) {
      const float value = 1.0f + static_cast<float>(slot) + static_cast<float>(i % 16) / 16.0f;
      if (element == ElementType::kBfloat16) {
        const uint16_t bits = serving::FloatToBf16(value);
        std::memcpy(payload.data() + 2 * i, &bits, 2);
      } else {
        std::memcpy(payload.data() + 4 * i, &value, 4);
      }
    }
    sent.headers.push_back(HeaderFor(ticket, slot, PayloadChecksum(payload), element));
  }
  return sent;
}

bool Widened(std::span<const std::byte> page, uint32_t slot) {
  for (size_t i = 0; i < page.size() / 4; ++i) {
    float value;
    std::memcpy(&value, page.data() + 4 * i, 4);
    if (value != 1.0f + static_cast<float>(slot) + static_cast<float>(i % 16) / 16.0f) {
      return false;
    }
  }
  return true;
}

class ReceiverFinishTest : public ::testing::Test {
 protected:
  ReceiverFinishTest() {
    auto transport = std::make_unique<HandTransport>();
    hand_ = transport.get();
    receiver_ = std::make_unique<TransferReceiver>(std::move(transport), ReceiverOptions{}, clock_,
                                                   [](uint64_t, uint64_t, const absl::Status&) {});
    pool_.assign(2 * kPages, std::vector<std::byte>(kPageBytes));
  }

  Ticket Expect(uint64_t request_id, uint32_t first) {
    auto ticket = receiver_->Expect(SpecOverPool(pool_, request_id, 1, first, kPages, kPageBytes));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : Ticket{};
  }

  // The sink's OnPageHeader for every page, under the receiver's mutex as a lane thread calls it;
  // the payloads are copied into their targets outside it, as UCX lands them.
  std::vector<LandingTarget> Land(const Sent& sent) {
    std::vector<LandingTarget> targets;
    for (size_t slot = 0; slot < sent.headers.size(); ++slot) {
      const auto header = EncodePageHeader(sent.headers[slot]);
      std::optional<LandingTarget> target;
      {
        absl::MutexLock lock(hand_->sink_mutex_);
        target = hand_->sink_->OnPageHeader(header, sent.payloads[slot].size());
      }
      EXPECT_TRUE(target.has_value());
      if (!target.has_value()) continue;
      EXPECT_EQ(target->destination.size(), sent.payloads[slot].size());
      std::memcpy(target->destination.data(), sent.payloads[slot].data(),
                  sent.payloads[slot].size());
      targets.push_back(std::move(*target));
    }
    return targets;
  }

  // Finishes every target of both requests on two threads while this thread holds the
  // receiver's mutex: a finish that took it would never return.
  std::vector<std::vector<uint64_t>> FinishWhileLocked(
      const std::vector<std::vector<LandingTarget>>& requests) {
    std::vector<std::vector<uint64_t>> finished(requests.size());
    absl::MutexLock lock(hand_->sink_mutex_);
    std::vector<std::thread> lanes;
    for (size_t r = 0; r < requests.size(); ++r) {
      lanes.emplace_back([&, r] {
        for (const LandingTarget& target : requests[r]) {
          finished[r].push_back(FinishLanding(target));
        }
      });
    }
    for (std::thread& lane : lanes) lane.join();
    return finished;
  }

  void Landed(const std::vector<LandingTarget>& targets, const std::vector<uint64_t>& finished) {
    absl::MutexLock lock(hand_->sink_mutex_);
    for (size_t i = 0; i < targets.size(); ++i) {
      hand_->sink_->OnPageLanded(targets[i].ticket_id, targets[i].slot, absl::OkStatus(),
                                 finished[i]);
    }
  }

  void Commit(const Ticket& ticket, const Sent& sent) {
    ControlMessage commit{.kind = WireKind::kCommit,
                          .request_id = ticket.request_id,
                          .ticket_id = ticket.ticket_id,
                          .epoch = ticket.epoch,
                          .pages_sent = kPages,
                          .prompt_tokens = 128,
                          .first_token = 7};
    std::vector<std::vector<uint64_t>> per_layer;
    for (size_t slot = 0; slot < sent.headers.size(); ++slot) {
      const uint32_t layer = ticket.pages[slot].layer;
      if (per_layer.size() <= layer) per_layer.resize(layer + 1);
      per_layer[layer].push_back(sent.headers[slot].payload_xxh3);
    }
    for (const auto& checksums : per_layer) commit.layer_digests.push_back(LayerDigest(checksums));
    const std::vector<std::byte> bytes = EncodeControl(commit);
    absl::MutexLock lock(hand_->sink_mutex_);
    hand_->sink_->OnControl(bytes);
  }

  FakeClock clock_;
  HandTransport* hand_ = nullptr;
  std::unique_ptr<TransferReceiver> receiver_;
  std::vector<std::vector<std::byte>> pool_;
};

TEST_F(ReceiverFinishTest, TwoRequestsAreChecksummedAndConvertedWhileTheMutexIsHeld) {
  const Ticket bf16 = Expect(1, 0);
  const Ticket fp32 = Expect(2, kPages);
  const Sent bf16_sent = MakePages(bf16, ElementType::kBfloat16);
  const Sent fp32_sent = MakePages(fp32, ElementType::kFloat32);
  const std::vector<LandingTarget> bf16_targets = Land(bf16_sent);
  const std::vector<LandingTarget> fp32_targets = Land(fp32_sent);
  ASSERT_EQ(bf16_targets.size(), kPages);
  ASSERT_EQ(fp32_targets.size(), kPages);
  // The bf16 pages land in conversion buffers (half the size), not in the pool.
  EXPECT_EQ(bf16_targets[0].destination.size(), kPageBytes / 2);
  EXPECT_FALSE(Widened(pool_[0], 0));

  const auto finished = FinishWhileLocked({bf16_targets, fp32_targets});
  for (uint32_t slot = 0; slot < kPages; ++slot) {
    EXPECT_EQ(finished[0][slot], bf16_sent.headers[slot].payload_xxh3) << slot;
    EXPECT_EQ(finished[1][slot], fp32_sent.headers[slot].payload_xxh3) << slot;
    // Converted by the finish itself, before the receiver's bookkeeping ran.
    EXPECT_TRUE(Widened(pool_[slot], slot)) << slot;
    EXPECT_TRUE(Widened(pool_[kPages + slot], slot)) << slot;
  }
  Landed(bf16_targets, finished[0]);
  Landed(fp32_targets, finished[1]);
  Commit(bf16, bf16_sent);
  Commit(fp32, fp32_sent);
  for (const Ticket& ticket : {bf16, fp32}) {
    auto outcome = receiver_->Outcome(ticket.ticket_id);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->state, TransferState::kVerified) << outcome->status;
  }
  EXPECT_EQ(receiver_->stats().bytes_landed, kPages * kPageBytes / 2 + kPages * kPageBytes);
}

TEST_F(ReceiverFinishTest, ACorruptedPageIsNeverConvertedAndFailsOnlyItsRequest) {
  const Ticket bad = Expect(1, 0);
  const Ticket good = Expect(2, kPages);
  const Sent bad_sent = MakePages(bad, ElementType::kBfloat16);
  const Sent good_sent = MakePages(good, ElementType::kBfloat16);
  const std::vector<LandingTarget> bad_targets = Land(bad_sent);
  const std::vector<LandingTarget> good_targets = Land(good_sent);
  ASSERT_EQ(bad_targets.size(), kPages);
  bad_targets[2].destination[5] ^= std::byte{0x10};  // Flipped on the wire, after the checksum.

  const auto finished = FinishWhileLocked({bad_targets, good_targets});
  EXPECT_NE(finished[0][2], bad_sent.headers[2].payload_xxh3);
  EXPECT_EQ(finished[0][1], bad_sent.headers[1].payload_xxh3);
  // The corrupted page's destination was never written; its neighbours were converted.
  EXPECT_EQ(pool_[2], std::vector<std::byte>(kPageBytes));
  EXPECT_TRUE(Widened(pool_[1], 1));
  Landed(bad_targets, finished[0]);
  Landed(good_targets, finished[1]);
  Commit(bad, bad_sent);
  Commit(good, good_sent);

  auto bad_outcome = receiver_->Outcome(bad.ticket_id);
  ASSERT_TRUE(bad_outcome.ok()) << bad_outcome.status();
  EXPECT_EQ(bad_outcome->state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(bad_outcome->status), IsolationError::kChecksum)
      << bad_outcome->status;
  EXPECT_NE(bad_outcome->status.message().find("slot 2"), absl::string_view::npos)
      << bad_outcome->status;
  auto good_outcome = receiver_->Outcome(good.ticket_id);
  ASSERT_TRUE(good_outcome.ok()) << good_outcome.status();
  EXPECT_EQ(good_outcome->state, TransferState::kVerified) << good_outcome->status;
  EXPECT_EQ(receiver_->stats().isolation_errors.at(IsolationError::kChecksum), 1u);
}

}  // namespace
}  // namespace pdserve::kv::testing
