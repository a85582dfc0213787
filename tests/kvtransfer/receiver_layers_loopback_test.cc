// ReceiverOptions::on_layer, what the CUDA decode worker's early import starts each layer's copy
// from: a layer is reported once, when every one of its pages has landed with its header's
// checksum, in the order the layers complete (not the layer order), all of them before the
// verified outcome; a layer with a corrupt page, and every layer after a failure, never is.
#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

#include "tests/kvtransfer/loopback_fixture.h"

namespace pdserve::kv::testing {
namespace {

using Action = FaultRule::Action;
using Reported = std::vector<std::pair<uint64_t, uint32_t>>;

class ReceiverLayersTest : public LoopbackReceiverTest {
 protected:
  // A transfer of the ticket's pages (FillPattern(seed, slot)), prepared, nothing posted.
  absl::StatusOr<std::unique_ptr<Transfer>> Prepared(const Ticket& ticket, uint64_t seed) {
    auto& sources = sources_.emplace_back();
    for (uint32_t slot = 0; slot < ticket.pages.size(); ++slot) {
      sources.emplace_back(ticket.pages[slot].bytes);
      FillPattern(sources.back(), seed, slot);
    }
    return sender_.Prepare(ticket, {sources.begin(), sources.end()});
  }
};

TEST_F(ReceiverLayersTest, EachLayerIsReportedOnceWhenItsPagesLandedInCompletionOrder) {
  // 8 pages in 2 layers (pages 0-3 layer 0, 4-7 layer 1), layer 1 sent first.
  const Ticket ticket = Expect(7, 3, 0, kPoolPages);
  auto transfer = Prepared(ticket, 42);
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostLayer(1).ok());
  Pump(transfer->get());
  EXPECT_EQ(layers_, (Reported{{ticket.ticket_id, 1}}));
  EXPECT_TRUE(decided_.empty());
  ASSERT_TRUE((*transfer)->PostLayer(0).ok());
  Pump(transfer->get());
  EXPECT_EQ(layers_, (Reported{{ticket.ticket_id, 1}, {ticket.ticket_id, 0}}));
  // Both layers are in place, but nothing is verified before the commit.
  EXPECT_TRUE(decided_.empty());
  ASSERT_TRUE((*transfer)->Commit(256, 9).ok());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer->get());
  EXPECT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_EQ(layers_.size(), 2u);  // not again at the verification
}

TEST_F(ReceiverLayersTest, ALayerWithACorruptPageIsNeverReported) {
  // Page 5 (layer 1) is corrupted on the wire: layer 1 fails its checksum.
  send_faults_.AddRule({.action = Action::kCorruptByte, .slot = 5, .offset = 3});
  const Ticket ticket = Expect(8, 3, 0, kPoolPages);
  auto transfer = Send(ticket, 8);
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  EXPECT_EQ(GetIsolationError(outcome.status), IsolationError::kChecksum) << outcome.status;
  for (const auto& [id, layer] : layers_) EXPECT_NE(layer, 1u);
}

TEST_F(ReceiverLayersTest, NoLayerIsReportedAfterTheTicketFailed) {
  // Layer 0's page 1 fails first; layer 1's pages land after that and are not reported.
  send_faults_.AddRule({.action = Action::kCorruptByte, .slot = 1, .offset = 3});
  const Ticket ticket = Expect(9, 3, 0, kPoolPages);
  auto transfer = Prepared(ticket, 9);
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostLayer(0).ok());
  Pump(transfer->get());
  ASSERT_EQ(decided_.size(), 1u);
  EXPECT_EQ(decided_[0].second.state, TransferState::kFailed);
  ASSERT_TRUE((*transfer)->PostLayer(1).ok());
  Pump(transfer->get());
  EXPECT_TRUE(layers_.empty());
}

}  // namespace
}  // namespace pdserve::kv::testing
