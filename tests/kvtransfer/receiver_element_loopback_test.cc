// Pages sent in another element type than the receiver's (docs/protocol.md, "Element types"):
// the receiver checks the size in the sent type, the checksum over the bytes sent, and converts
// into the destination only after both passed. The engine-level path (real states, PlanTransfer
// on both sides) is tests/runtime/mixed_element_transfer_test.cc.
#include <cstring>

#include "serving/element_type.h"
#include "tests/kvtransfer/loopback_fixture.h"

namespace pdserve::kv::testing {
namespace {

using serving::ElementType;

class ReceiverElementTest : public LoopbackReceiverTest {
 protected:
  // Sends the ticket's pages in bf16 (half the fp32 descriptors' bytes): value i of slot s is
  // 1 + s + (i % 16) / 16, exact in bf16 and in fp32.
  std::unique_ptr<Transfer> SendBf16(const Ticket& ticket) {
    auto& sources = sources_.emplace_back();
    std::vector<SourcePage> pages;
    for (uint32_t slot = 0; slot < ticket.pages.size(); ++slot) {
      std::vector<std::byte>& page = sources.emplace_back(ticket.pages[slot].bytes / 2);
      for (size_t i = 0; i < page.size() / 2; ++i) {
        const uint16_t bits = serving::FloatToBf16(1.0f + static_cast<float>(slot) +
                                                   static_cast<float>(i % 16) / 16.0f);
        std::memcpy(page.data() + 2 * i, &bits, 2);
      }
      pages.push_back({page, ElementType::kBfloat16});
    }
    auto transfer = sender_.PrepareWithElements(ticket, std::move(pages));
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    if (!transfer.ok()) return nullptr;
    EXPECT_TRUE((*transfer)->PostAll().ok());
    EXPECT_TRUE((*transfer)->Commit(256, 1).ok());
    return std::move(*transfer);
  }

  bool WidenedInPlace(uint32_t page, uint32_t slot) const {
    for (size_t i = 0; i < kPageBytes / 4; ++i) {
      float value;
      std::memcpy(&value, pool_[page].data() + 4 * i, 4);
      if (value != 1.0f + static_cast<float>(slot) + static_cast<float>(i % 16) / 16.0f) {
        return false;
      }
    }
    return true;
  }
};

TEST_F(ReceiverElementTest, Bf16PagesIntoFp32PagesArriveWidenedWithHalfTheBytes) {
  const Ticket ticket = Expect(1, 5, 0, 3);  // fp32 destinations of 16 KiB
  auto transfer = SendBf16(ticket);
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  for (uint32_t slot = 0; slot < 3; ++slot) EXPECT_TRUE(WidenedInPlace(slot, slot)) << slot;
  EXPECT_EQ(receiver_->stats().bytes_landed, 3 * kPageBytes / 2);
}

TEST_F(ReceiverElementTest, ACorruptedBf16ByteFailsTheChecksumAndIsNeverConverted) {
  send_faults_.AddRule({.action = FaultRule::Action::kCorruptByte, .slot = 1, .offset = 5});
  const Ticket ticket = Expect(1, 5, 0, 3);
  auto transfer = SendBf16(ticket);
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  EXPECT_EQ(outcome.state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(outcome.status), IsolationError::kChecksum) << outcome.status;
  EXPECT_TRUE(PageIsZero(1));
}

// A bf16 header on a payload of the fp32 size (or the reverse) does not fit the slot.
TEST_F(ReceiverElementTest, AnElementTypeThatDoesNotFitTheSizeIsAHeaderError) {
  RewriteSentPage(0, [](PageHeader& h) { h.element = ElementType::kBfloat16; });
  EXPECT_EQ(FailureKind(), IsolationError::kHeader) << last_status_;
  EXPECT_TRUE(PageIsZero(0));
}

TEST_F(ReceiverElementTest, TheSenderRefusesSourcesOfTheWrongSizeForTheirType) {
  const Ticket ticket = Expect(1, 5, 0, 1);
  std::vector<std::byte> page(kPageBytes);  // fp32-sized, claimed bf16
  auto transfer =
      sender_.PrepareWithElements(ticket, std::vector<SourcePage>{{page, ElementType::kBfloat16}});
  EXPECT_TRUE(absl::IsInvalidArgument(transfer.status())) << transfer.status();
}

}  // namespace
}  // namespace pdserve::kv::testing
