// The sender's window (SenderOptions::max_in_flight_bytes) against a scripted transport, no UCX:
// how many pages reach the transport, when their checksums are taken, what the commit carries,
// and that a destroyed transfer never hands over the pages it still held back.
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <vector>

#include "kvtransfer/page_header.h"
#include "kvtransfer/transfer_sender.h"
#include "tests/kvtransfer/test_support.h"
#include "xxhash.h"

namespace pdserve::kv::testing {
namespace {

constexpr uint64_t kPageBytes = uint64_t{64} * 1024;

// Records every message; a message other than the fence completes only when the test says so.
class ScriptedTransport final : public PageTransport {
 public:
  struct Sent {
    WireKind kind;
    std::vector<std::byte> header;
    std::vector<std::byte> payload;
    std::optional<absl::Status> result;
  };

  absl::StatusOr<PeerId> Connect(std::span<const std::byte>, uint64_t) override { return 1; }
  absl::StatusOr<std::unique_ptr<SendOp>> Send(PeerId, WireKind kind,
                                               std::span<const std::byte> header,
                                               std::span<const std::byte> payload) override {
    sent_.push_back(std::make_unique<Sent>(Sent{
        kind, {header.begin(), header.end()}, {payload.begin(), payload.end()}, std::nullopt}));
    // The fence is the last thing a destroyed transfer waits for.
    if (kind == WireKind::kFence) sent_.back()->result = absl::OkStatus();
    return std::unique_ptr<SendOp>(new Op(*sent_.back()));
  }
  void Progress() override {}
  absl::Status PeerStatus(PeerId) const override { return absl::OkStatus(); }
  void Disconnect(PeerId) override {}

  // Completes every message sent so far.
  void CompleteAll() {
    for (auto& sent : sent_) {
      if (!sent->result.has_value()) sent->result = absl::OkStatus();
    }
  }
  void Complete(size_t index) { sent_[index]->result = absl::OkStatus(); }
  std::vector<const Sent*> Of(WireKind kind) const {
    std::vector<const Sent*> out;
    for (const auto& sent : sent_) {
      if (sent->kind == kind) out.push_back(sent.get());
    }
    return out;
  }

 private:
  class Op final : public SendOp {
   public:
    explicit Op(Sent& sent) : sent_(sent) {}
    std::optional<absl::Status> Test() override { return sent_.result; }
    void Cancel() override {
      if (!sent_.result.has_value()) sent_.result = absl::CancelledError("cancelled");
    }

   private:
    Sent& sent_;
  };

  std::vector<std::unique_ptr<Sent>> sent_;
};

class SenderWindowTest : public ::testing::Test {
 protected:
  SenderWindowTest() : sources_(4, std::vector<std::byte>(kPageBytes)) {
    for (uint32_t slot = 0; slot < 4; ++slot) FillPattern(sources_[slot], 5, slot);
    ticket_.ticket_id = 3;
    ticket_.epoch = 1;
    ticket_.request_id = 77;
    ticket_.pages = MakeDescriptors(4, 2, kPageBytes);
    ticket_.lease_deadline = clock_.Now() + absl::Seconds(10);
  }

  std::unique_ptr<Transfer> Prepare(size_t window_bytes) {
    TransferSender sender(transport_, clock_, {.max_in_flight_bytes = window_bytes});
    auto transfer = sender.Prepare(ticket_, {sources_.begin(), sources_.end()});
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    return transfer.ok() ? std::move(*transfer) : nullptr;
  }

  FakeClock clock_;
  ScriptedTransport transport_;
  std::vector<std::vector<std::byte>> sources_;
  Ticket ticket_;
};

TEST_F(SenderWindowTest, HandsAtMostTheWindowToTheTransport) {
  auto transfer = Prepare(2 * kPageBytes);
  ASSERT_TRUE(transfer->PostAll().ok());
  EXPECT_EQ(transfer->pages_posted(), 4u);
  EXPECT_EQ(transport_.Of(WireKind::kPage).size(), 2u);
  ASSERT_TRUE(transfer->Poll().ok());
  EXPECT_EQ(transport_.Of(WireKind::kPage).size(), 2u);  // Nothing completed yet.
  transport_.Complete(0);
  ASSERT_TRUE(transfer->Poll().ok());
  EXPECT_EQ(transport_.Of(WireKind::kPage).size(), 3u);
  EXPECT_EQ(transfer->pages_completed(), 1u);
}

TEST_F(SenderWindowTest, APageLargerThanTheWindowStillGoesAlone) {
  auto transfer = Prepare(kPageBytes / 2);
  ASSERT_TRUE(transfer->PostAll().ok());
  EXPECT_EQ(transport_.Of(WireKind::kPage).size(), 1u);
}

TEST_F(SenderWindowTest, PagesGoInPostOrderWithTheirPayloadChecksum) {
  auto transfer = Prepare(kPageBytes);
  ASSERT_TRUE(transfer->PostLayer(1).ok());  // Slots 2 and 3.
  ASSERT_TRUE(transfer->PostLayer(0).ok());  // Slots 0 and 1.
  for (int i = 0; i < 8 && transport_.Of(WireKind::kPage).size() < 4; ++i) {
    transport_.CompleteAll();
    ASSERT_TRUE(transfer->Poll().ok());
  }
  const auto pages = transport_.Of(WireKind::kPage);
  ASSERT_EQ(pages.size(), 4u);
  const uint32_t expected_slots[] = {2, 3, 0, 1};
  for (size_t i = 0; i < pages.size(); ++i) {
    auto header = DecodePageHeader(pages[i]->header);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(header->slot, expected_slots[i]);
    const auto& source = sources_[header->slot];
    EXPECT_EQ(header->payload_xxh3, XXH3_64bits(source.data(), source.size()));
    EXPECT_EQ(pages[i]->payload, source);
  }
}

TEST_F(SenderWindowTest, CommitWaitsForTheLastPageAndCarriesEveryLayersDigest) {
  auto transfer = Prepare(kPageBytes);
  ASSERT_TRUE(transfer->PostAll().ok());
  ASSERT_TRUE(transfer->Commit(300, 9).ok());
  for (int i = 0; i < 8 && transport_.Of(WireKind::kCommit).empty(); ++i) {
    EXPECT_EQ(transport_.Of(WireKind::kCommit).size(), 0u);
    transport_.CompleteAll();
    ASSERT_TRUE(transfer->Poll().ok());
  }
  const auto commits = transport_.Of(WireKind::kCommit);
  ASSERT_EQ(commits.size(), 1u);
  EXPECT_EQ(transport_.Of(WireKind::kPage).size(), 4u);
  auto commit = DecodeControl(commits[0]->payload);
  ASSERT_TRUE(commit.ok()) << commit.status();
  EXPECT_EQ(commit->pages_sent, 4u);
  EXPECT_EQ(commit->prompt_tokens, 300);
  EXPECT_EQ(commit->first_token, 9);
  std::vector<uint64_t> sums;
  for (const auto& source : sources_) sums.push_back(XXH3_64bits(source.data(), source.size()));
  ASSERT_EQ(commit->layer_digests.size(), 2u);
  EXPECT_EQ(commit->layer_digests[0], LayerDigest(std::span(sums).first(2)));
  EXPECT_EQ(commit->layer_digests[1], LayerDigest(std::span(sums).last(2)));
  transport_.CompleteAll();
  absl::StatusOr<bool> delivered = transfer->Poll();
  ASSERT_TRUE(delivered.ok()) << delivered.status();
  EXPECT_TRUE(*delivered);
  EXPECT_TRUE(transfer->Release().ok());
}

// Checksums taken on a pool of threads at post time (SenderOptions::checksum_pool) give the
// same headers, payloads and commit as the one-thread path: each a page's own xxh3.
TEST_F(SenderWindowTest, ChecksumsTakenOnAPoolEqualOneThreads) {
  TaskPool pool(3);
  std::vector<std::vector<std::byte>> headers[2];
  std::vector<std::byte> commits[2];
  for (int pooled = 0; pooled < 2; ++pooled) {
    ScriptedTransport transport;
    TransferSender sender(
        transport, clock_,
        {.max_in_flight_bytes = kPageBytes, .checksum_pool = pooled == 1 ? &pool : nullptr});
    auto transfer = sender.Prepare(ticket_, {sources_.begin(), sources_.end()});
    ASSERT_TRUE(transfer.ok()) << transfer.status();
    ASSERT_TRUE((*transfer)->PostLayer(1).ok());
    ASSERT_TRUE((*transfer)->PostLayer(0).ok());
    ASSERT_TRUE((*transfer)->Commit(300, 9).ok());
    for (int i = 0; i < 8 && transport.Of(WireKind::kCommit).empty(); ++i) {
      transport.CompleteAll();
      ASSERT_TRUE((*transfer)->Poll().ok());
    }
    for (const auto* page : transport.Of(WireKind::kPage)) {
      headers[pooled].push_back(page->header);
      auto header = DecodePageHeader(page->header);
      ASSERT_TRUE(header.ok()) << header.status();
      const auto& source = sources_[header->slot];
      EXPECT_EQ(header->payload_xxh3, XXH3_64bits(source.data(), source.size()));
      EXPECT_EQ(page->payload, source);
    }
    ASSERT_EQ(transport.Of(WireKind::kCommit).size(), 1u);
    commits[pooled] = transport.Of(WireKind::kCommit)[0]->payload;
    transport.CompleteAll();
    ASSERT_TRUE((*transfer)->Poll().ok());
    ASSERT_TRUE((*transfer)->Release().ok());
  }
  ASSERT_EQ(headers[0].size(), 4u);
  EXPECT_EQ(headers[0], headers[1]);
  EXPECT_EQ(commits[0], commits[1]);
}

TEST_F(SenderWindowTest, DestroyedTransferNeverHandsOverHeldBackPages) {
  auto transfer = Prepare(kPageBytes);
  ASSERT_TRUE(transfer->PostAll().ok());
  ASSERT_EQ(transport_.Of(WireKind::kPage).size(), 1u);
  transfer.reset();  // Cancels slot 0's send, then fences.
  EXPECT_EQ(transport_.Of(WireKind::kPage).size(), 1u);
  EXPECT_EQ(transport_.Of(WireKind::kFence).size(), 1u);
}

}  // namespace
}  // namespace pdserve::kv::testing
