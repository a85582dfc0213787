// The shm-pull data path (kvtransfer/shm/): pages pulled by the receiver out of the sender's
// shared region, in process over the loopback transport with the fake clock, and the regions
// themselves across a real second process (fork). What must hold: pulled pages verify exactly
// like sent ones; the receiver copies only after every header check and only inside the
// announced region; each page's ack word is written once its landing is over (landed, refused or
// failed) and only then does the sender's page send complete; a sender that cannot pull (no
// region, pages outside it, another host) goes by active messages; a page changed after its
// checksum fails only its own request.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/shm/shared_memory.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/ticket_proto.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

using shm::AckState;
using shm::AckWord;

constexpr uint32_t kPages = 8;
constexpr uint64_t kPageBytes = 16 * 1024;

class ShmPullTest : public ::testing::Test {
 protected:
  ShmPullTest() {
    absl::StatusOr<ShmPullParts> parts = MakeShmPullParts(64, kPages * kPageBytes);
    EXPECT_TRUE(parts.ok()) << parts.status();
    if (parts.ok()) {
      acks_ = std::move(parts->acks);
      region_ = std::move(parts->region);
      pull_ = std::move(parts->pull);
    }
    receiver_ = MakePullReceiver(network_.NewReceiveEnd(), acks_.get(), clock_, &released_);
    pool_.assign(kPages, std::vector<std::byte>(kPageBytes));
    puller_ = std::make_unique<TransferSender>(*send_end_, clock_,
                                               SenderOptions{.shm_pull = pull_.get()});
  }

  Ticket Expect(uint64_t request_id, uint32_t first, uint32_t count) {
    auto ticket = receiver_->Expect(SpecOverPool(pool_, request_id, 7, first, count, kPageBytes));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : Ticket{};
  }

  // The sender's page `i` of its shared region.
  std::span<const std::byte> SourcePage(uint32_t i) const {
    return region_->bytes().subspan(i * kPageBytes, kPageBytes);
  }

  // Fills region pages [first, first + count) with FillPattern(seed, slot) and prepares a
  // transfer of them through `sender` (all posted, commit asked).
  std::unique_ptr<Transfer> Send(TransferSender& sender, const Ticket& ticket, uint64_t seed,
                                 uint32_t first) {
    std::vector<std::span<const std::byte>> sources;
    for (uint32_t slot = 0; slot < ticket.pages.size(); ++slot) {
      FillPattern(region_->bytes().subspan((first + slot) * kPageBytes, kPageBytes), seed, slot);
      sources.push_back(SourcePage(first + slot));
    }
    auto transfer = sender.Prepare(ticket, sources);
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    if (!transfer.ok()) return nullptr;
    EXPECT_TRUE((*transfer)->PostAll().ok());
    EXPECT_TRUE((*transfer)->Commit(16, 3).ok());
    return std::move(*transfer);
  }

  TransferOutcome RunUntilDecided(uint64_t ticket_id, Transfer* transfer) {
    return testing::RunUntilDecided(*receiver_, clock_, ticket_id, transfer, &last_poll_);
  }

  bool PagesMatch(uint64_t seed, uint32_t first, uint32_t count) const {
    for (uint32_t i = 0; i < count; ++i) {
      if (!MatchesPattern(pool_[first + i], seed, i)) return false;
    }
    return true;
  }

  // Sends one raw kPageRef message (bypassing TransferSender).
  void SendRef(const Ticket& ticket, uint32_t slot, uint64_t checksum, const shm::PageRef& ref) {
    const auto header = EncodePageHeader(HeaderFor(ticket, slot, checksum));
    raw_messages_.push_back(shm::EncodePageRefMessage(header, ref));
    auto peer = raw_end_->Connect(receiver_->worker_address(), 1);
    ASSERT_TRUE(peer.ok()) << peer.status();
    auto op = raw_end_->Send(*peer, WireKind::kPageRef, {}, raw_messages_.back());
    ASSERT_TRUE(op.ok()) << op.status();
    raw_ops_.push_back(std::move(*op));
  }

  FakeClock clock_;
  LoopbackNetwork network_;
  std::unique_ptr<shm::AckTable> acks_;
  std::unique_ptr<shm::SharedRegion> region_;
  std::unique_ptr<shm::PullSender> pull_;
  std::vector<std::vector<std::byte>> pool_;
  std::vector<uint64_t> released_;
  std::unique_ptr<TransferReceiver> receiver_;
  std::unique_ptr<PageTransport> send_end_ = network_.NewSendEnd();
  std::unique_ptr<TransferSender> puller_;  // Made once pull_ is.
  TransferSender plain_{*send_end_, clock_};
  std::unique_ptr<PageTransport> raw_end_ = network_.NewSendEnd();
  std::deque<std::vector<std::byte>> raw_messages_;
  std::vector<std::unique_ptr<SendOp>> raw_ops_;
  absl::StatusOr<bool> last_poll_ = false;
};

TEST_F(ShmPullTest, PulledPagesVerifyAndEachSlotIsAcknowledged) {
  const Ticket ticket = Expect(1, 0, 4);
  ASSERT_TRUE(ticket.shm_pull.has_value());
  EXPECT_EQ(ticket.shm_pull->acks, acks_->name());
  auto transfer = Send(*puller_, ticket, 41, 0);
  ASSERT_NE(transfer, nullptr);
  EXPECT_TRUE(transfer->pulled());
  EXPECT_TRUE(transfer->pull_refusal().ok());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_TRUE(PagesMatch(41, 0, 4));
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + slot),
              AckWord(ticket.ticket_id, AckState::kLanded));
  }
  for (int i = 0; i < 4 && !(last_poll_.ok() && *last_poll_); ++i) last_poll_ = transfer->Poll();
  ASSERT_TRUE(last_poll_.ok() && *last_poll_) << last_poll_.status();
  EXPECT_EQ(transfer->pages_completed(), 4u);
  EXPECT_TRUE(transfer->Release().ok());
  EXPECT_EQ(receiver_->stats().bytes_landed, 4 * kPageBytes);
}

TEST_F(ShmPullTest, ReferencesGoSeveralToAMessage) {
  const Ticket ticket = Expect(1, 0, kPages);
  auto transfer = Send(*puller_, ticket, 12, 0);
  ASSERT_NE(transfer, nullptr);
  // All eight references in one message (up to 32 fit one), not eight messages.
  EXPECT_EQ(network_.pending(), 1u);
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_TRUE(PagesMatch(12, 0, kPages));
  EXPECT_EQ(receiver_->stats().pages_landed, kPages);
}

TEST_F(ShmPullTest, PageSendCompletesOnlyOnceItsAckIsWritten) {
  const Ticket ticket = Expect(1, 0, 2);
  auto transfer = Send(*puller_, ticket, 5, 0);
  ASSERT_NE(transfer, nullptr);
  // The messages went out, but the receiver has not run: no page may count as sent.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(transfer->Poll().ok());
  EXPECT_EQ(transfer->pages_completed(), 0u);
  receiver_->Progress();
  ASSERT_TRUE(transfer->Poll().ok());
  EXPECT_EQ(transfer->pages_completed(), 2u);
}

TEST_F(ShmPullTest, AcksThatNeverComeFailTheTransferAfterTheLeaseLength) {
  const Ticket ticket = Expect(1, 0, 2);
  auto transfer = Send(*puller_, ticket, 5, 0);
  ASSERT_NE(transfer, nullptr);
  // The receiver never runs (a stopped decode worker whose transport still takes the heartbeats,
  // which renew the sender's lease): the missing acks end the transfer one lease length (10 s)
  // after the page references went.
  absl::StatusOr<bool> poll = false;
  int seconds = 0;
  for (; seconds < 30 && poll.ok(); ++seconds) {
    poll = transfer->Poll();
    clock_.Advance(absl::Seconds(1));
  }
  ASSERT_FALSE(poll.ok());
  EXPECT_EQ(poll.status().code(), absl::StatusCode::kDeadlineExceeded) << poll.status();
  EXPECT_TRUE(absl::StrContains(poll.status().message(), "no ack from the decode worker"))
      << poll.status();
  EXPECT_GE(seconds, 10);
  EXPECT_LE(seconds, 13);
  EXPECT_EQ(transfer->pages_completed(), 0u);
}

TEST_F(ShmPullTest, SenderWithoutARegionSendsActiveMessages) {
  const Ticket ticket = Expect(1, 0, 4);
  ASSERT_TRUE(ticket.shm_pull.has_value());
  auto transfer = Send(plain_, ticket, 9, 0);
  ASSERT_NE(transfer, nullptr);
  EXPECT_FALSE(transfer->pulled());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_TRUE(PagesMatch(9, 0, 4));
}

// A decode worker with transfer.shm_pull off (or a full ack table) issues tickets without an
// offer: a prefill worker with it on sends messages and says why, once (the operator turned it on
// and sees no pulls otherwise).
TEST_F(ShmPullTest, TicketWithoutAnOfferGoesByActiveMessagesAndSaysWhy) {
  Ticket ticket = Expect(1, 0, 2);
  ticket.shm_pull.reset();
  auto transfer = Send(*puller_, ticket, 13, 0);
  ASSERT_NE(transfer, nullptr);
  EXPECT_FALSE(transfer->pulled());
  EXPECT_TRUE(absl::StrContains(transfer->pull_refusal().message(), "no shm-pull offer"))
      << transfer->pull_refusal();
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_TRUE(PagesMatch(13, 0, 2));
}

TEST_F(ShmPullTest, PagesOutsideTheRegionGoByActiveMessages) {
  const Ticket ticket = Expect(1, 0, 2);
  std::vector<std::vector<std::byte>> heap(2, std::vector<std::byte>(kPageBytes));
  for (uint32_t slot = 0; slot < 2; ++slot) FillPattern(heap[slot], 12, slot);
  auto transfer = puller_->Prepare(ticket, {heap[0], heap[1]});
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  EXPECT_FALSE((*transfer)->pulled());
  EXPECT_TRUE(absl::StrContains((*transfer)->pull_refusal().message(), "outside the shared region"))
      << (*transfer)->pull_refusal();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(16, 3).ok());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer->get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_TRUE(PagesMatch(12, 0, 2));
}

TEST_F(ShmPullTest, OfferFromAnotherHostGoesByActiveMessages) {
  Ticket ticket = Expect(1, 0, 2);
  ASSERT_TRUE(ticket.shm_pull.has_value());
  ticket.shm_pull->boot_id = "00000000-0000-0000-0000-000000000000";
  auto transfer = Send(*puller_, ticket, 13, 0);
  ASSERT_NE(transfer, nullptr);
  EXPECT_FALSE(transfer->pulled());
  EXPECT_TRUE(absl::StrContains(transfer->pull_refusal().message(), "another host"));
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
}

TEST_F(ShmPullTest, PageChangedAfterItsChecksumFailsOnlyItsRequest) {
  const Ticket bad = Expect(1, 0, 4);
  const Ticket good = Expect(2, 4, 4);
  auto bad_transfer = Send(*puller_, bad, 1, 0);
  auto good_transfer = Send(*puller_, good, 2, 4);
  ASSERT_NE(bad_transfer, nullptr);
  ASSERT_NE(good_transfer, nullptr);
  // The sender checksummed slot 2 when it posted it; the receiver has not copied it yet.
  region_->bytes()[2 * kPageBytes + 100] ^= std::byte{0x40};
  const TransferOutcome bad_outcome = RunUntilDecided(bad.ticket_id, bad_transfer.get());
  const TransferOutcome good_outcome = RunUntilDecided(good.ticket_id, good_transfer.get());
  EXPECT_EQ(bad_outcome.state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(bad_outcome.status), IsolationError::kChecksum) << bad_outcome.status;
  ASSERT_EQ(good_outcome.state, TransferState::kVerified) << good_outcome.status;
  EXPECT_TRUE(PagesMatch(2, 4, 4));
}

TEST_F(ShmPullTest, AbortedTicketRefusesPulledPagesUnreadAndTheSenderLearnsIt) {
  const Ticket ticket = Expect(1, 0, 2);
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  auto transfer = Send(*puller_, ticket, 3, 0);
  ASSERT_NE(transfer, nullptr);
  receiver_->Progress();
  absl::StatusOr<bool> polled = transfer->Poll();
  EXPECT_EQ(polled.status().code(), absl::StatusCode::kCancelled) << polled.status();
  EXPECT_TRUE(absl::StrContains(polled.status().message(), "refused")) << polled.status();
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index), AckWord(ticket.ticket_id, AckState::kRefused));
  for (uint32_t page = 0; page < 2; ++page) {
    EXPECT_TRUE(std::all_of(pool_[page].begin(), pool_[page].end(),
                            [](std::byte b) { return b == std::byte{0}; }));
  }
}

TEST_F(ShmPullTest, ReferenceOutsideTheRegionCopiesNothingAndIsAcknowledgedFailed) {
  const Ticket ticket = Expect(1, 0, 1);
  FillPattern(region_->bytes().first(kPageBytes), 4, 0);
  const uint64_t checksum = PayloadChecksum(SourcePage(0));
  // Past the end, and wrapping around 2^64.
  SendRef(ticket, 0, checksum,
          {.region = region_->name(), .offset = kPages * kPageBytes - 8, .length = kPageBytes});
  receiver_->Progress();
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index), AckWord(ticket.ticket_id, AckState::kFailed));
  EXPECT_TRUE(
      std::all_of(pool_[0].begin(), pool_[0].end(), [](std::byte b) { return b == std::byte{0}; }));
  SendRef(ticket, 0, checksum,
          {.region = region_->name(), .offset = ~uint64_t{0} - 10, .length = kPageBytes});
  receiver_->Progress();
  EXPECT_EQ(receiver_->stats().pages_landed, 0u);
  // The slot is still empty: the true page lands and the ticket verifies with its commit.
  SendRef(ticket, 0, checksum, {.region = region_->name(), .offset = 0, .length = kPageBytes});
  receiver_->Progress();
  EXPECT_EQ(receiver_->stats().pages_landed, 1u);
  EXPECT_TRUE(MatchesPattern(pool_[0], 4, 0));
}

TEST_F(ShmPullTest, ReferenceToARegionThatCannotBeMappedFailsThePage) {
  const Ticket ticket = Expect(1, 0, 1);
  shm::RegionName forged = region_->name();
  forged.token[0] ^= 1;  // Not the memfd behind that fd.
  SendRef(ticket, 0, 0, {.region = forged, .offset = 0, .length = kPageBytes});
  receiver_->Progress();
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index), AckWord(ticket.ticket_id, AckState::kFailed));
  EXPECT_EQ(receiver_->stats().pages_landed, 0u);
}

// A receiver that cannot open the sender's memfd while the sender can map its ack table (the
// prefill worker runs as root, the decode worker as another user): the first page's "failed" ack
// must not fail the request; the page goes again as a message, and so does the rest.
TEST_F(ShmPullTest, PagesTheReceiverCannotReadGoAgainAsMessages) {
  // The receiver opens the region through /proc/<pid>/fd/<fd>: another file behind that fd is
  // what a receiver that may not open it sees (the sender's own mapping stays).
  const int fd = static_cast<int>(region_->name().fd);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(null_fd, 0);
  ASSERT_EQ(dup2(null_fd, fd), fd);
  close(null_fd);
  const Ticket ticket = Expect(1, 0, 4);
  auto transfer = Send(*puller_, ticket, 5, 0);
  ASSERT_NE(transfer, nullptr);
  ASSERT_TRUE(transfer->pulled());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  EXPECT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  EXPECT_TRUE(last_poll_.ok()) << last_poll_.status();
  EXPECT_TRUE(PagesMatch(5, 0, 4));
  EXPECT_FALSE(transfer->pulled());
  // Later tickets to this receiver go by active messages, and say why.
  const Ticket next = Expect(2, 4, 2);
  auto second = Send(*puller_, next, 6, 4);
  ASSERT_NE(second, nullptr);
  EXPECT_FALSE(second->pulled());
  EXPECT_TRUE(absl::StrContains(second->pull_refusal().message(), "could not read"))
      << second->pull_refusal();
  EXPECT_EQ(RunUntilDecided(next.ticket_id, second.get()).state, TransferState::kVerified);
  EXPECT_TRUE(PagesMatch(6, 4, 2));
}

TEST_F(ShmPullTest, HeaderChecksRunBeforeTheCopy) {
  const Ticket ticket = Expect(1, 0, 2);
  FillPattern(region_->bytes().first(kPageBytes), 4, 0);
  // A length that is not the slot's page: a header error, nothing copied.
  SendRef(ticket, 1, PayloadChecksum(SourcePage(0)),
          {.region = region_->name(), .offset = 0, .length = kPageBytes / 2});
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, nullptr);
  EXPECT_EQ(GetIsolationError(outcome.status), IsolationError::kHeader) << outcome.status;
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + 1),
            AckWord(ticket.ticket_id, AckState::kRefused));
  EXPECT_TRUE(
      std::all_of(pool_[1].begin(), pool_[1].end(), [](std::byte b) { return b == std::byte{0}; }));
}

TEST_F(ShmPullTest, TicketsGoWithoutAnOfferWhenTheAckTableIsFull) {
  // 64 words: eight tickets of 8 pages.
  std::vector<Ticket> tickets;
  for (uint64_t request = 1; request <= 8; ++request) {
    tickets.push_back(Expect(request, 0, kPages));
    EXPECT_TRUE(tickets.back().shm_pull.has_value());
  }
  const Ticket ninth = Expect(9, 0, 1);
  EXPECT_FALSE(ninth.shm_pull.has_value());
  // An aborted ticket keeps its words until it is released (past its lease).
  ASSERT_TRUE(receiver_->Abort(tickets[0].ticket_id).ok());
  receiver_->Progress();
  EXPECT_FALSE(Expect(10, 0, 1).shm_pull.has_value());
  clock_.Advance(absl::Seconds(11));
  receiver_->Progress();
  ASSERT_FALSE(released_.empty());
  const Ticket eleventh = Expect(11, 0, kPages);
  ASSERT_TRUE(eleventh.shm_pull.has_value());
  // A verified ticket gives its words back at once: its sender read them all before committing.
  auto transfer = Send(*puller_, eleventh, 8, 0);
  ASSERT_NE(transfer, nullptr);
  ASSERT_EQ(RunUntilDecided(eleventh.ticket_id, transfer.get()).state, TransferState::kVerified);
  EXPECT_TRUE(Expect(12, 0, kPages).shm_pull.has_value());
}

TEST(AckTableTest, ReservesRunsAndCoalescesFreedOnes) {
  auto table = shm::AckTable::Create(10);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ((*table)->Reserve(4), 0u);
  EXPECT_EQ((*table)->Reserve(4), 4u);
  EXPECT_EQ((*table)->Reserve(3), std::nullopt);
  (*table)->Write(5, 77);
  EXPECT_EQ((*table)->Read(5), 77u);
  (*table)->Free(0, 4);
  (*table)->Free(4, 4);
  // Freed runs merge with the 2-word tail: 10 in one run, zeroed when reserved again.
  EXPECT_EQ((*table)->Reserve(10), 0u);
  EXPECT_EQ((*table)->Read(5), 0u);
  EXPECT_EQ((*table)->Reserve(1), std::nullopt);
  EXPECT_EQ((*table)->Reserve(0), std::nullopt);
}

TEST(PageRefTest, RoundTripsAndRefusesMalformedMessages) {
  const auto header = EncodePageHeader({.request_id = 1, .ticket_id = 2, .slot = 3});
  shm::PageRef ref{.region = {.pid = 10, .fd = 11, .bytes = 4096}, .offset = 64, .length = 128};
  ref.region.token[5] = 9;
  std::vector<std::byte> message = shm::EncodePageRefMessage(header, ref);
  ASSERT_EQ(message.size(), kPageHeaderBytes + shm::kPageRefBytes);
  auto decoded = shm::DecodePageRef(message);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, ref);
  EXPECT_FALSE(shm::DecodePageRef(std::span(message).first(message.size() - 1)).ok());
  for (size_t at : {size_t{64}, size_t{68}, size_t{70}, size_t{120}}) {
    std::vector<std::byte> bad = message;
    bad[at] ^= std::byte{1};
    EXPECT_FALSE(shm::DecodePageRef(bad).ok()) << "byte " << at;
  }
}

TEST(PageRefTest, MessagesSplitIntoTheirEntries) {
  const auto header = EncodePageHeader({.request_id = 1, .ticket_id = 2, .slot = 3});
  const std::vector<std::byte> host = shm::EncodePageRefMessage(
      header, {.region = {.pid = 10, .fd = 11, .bytes = 4096}, .offset = 64, .length = 128});
  const std::vector<std::byte> device = shm::EncodePageRefMessage(
      header, {.device = shm::IpcRegionName{.bytes = 4096, .pci_bus_id = "b", .boot_id = "c"},
               .offset = 0,
               .length = 64});
  std::vector<std::byte> message;
  for (const auto* entry : {&host, &device, &host}) {
    message.insert(message.end(), entry->begin(), entry->end());
  }
  auto entries = shm::SplitPageRefs(message);
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].size(), host.size());
  EXPECT_EQ(entries[1].size(), device.size());
  for (const auto& entry : entries) EXPECT_TRUE(shm::DecodePageRef(entry).ok());
  // A reference of unknown version takes the rest of the message (one entry, which then fails
  // to decode: a header error for its ticket, the entries before it unaffected).
  std::vector<std::byte> bad = message;
  bad[host.size() + kPageHeaderBytes + 4] = std::byte{9};
  entries = shm::SplitPageRefs(bad);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_TRUE(shm::DecodePageRef(entries[0]).ok());
  EXPECT_EQ(entries[1].size(), bad.size() - host.size());
  EXPECT_FALSE(shm::DecodePageRef(entries[1]).ok());
  // A message cut inside its last entry: that entry is the short rest.
  entries = shm::SplitPageRefs(std::span(message).first(message.size() - 5));
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_FALSE(shm::DecodePageRef(entries[2]).ok());
  EXPECT_TRUE(shm::SplitPageRefs({}).empty());
}

TEST(ShmPullTicketTest, OfferRoundTripsThroughTheCompactFormAndProto) {
  const absl::Time kNow = absl::FromUnixMillis(1699999990000);  // both ends' clock
  Ticket ticket{.ticket_id = 4, .epoch = 5, .request_id = 6, .worker_address = {std::byte{7}}};
  ticket.pages.push_back(
      {.layer = 1, .page_index = 2, .token_begin = 0, .token_end = 64, .bytes = 4096});
  ticket.lease_deadline = absl::FromUnixMillis(1700000000000);
  ticket.heartbeat_interval = absl::Milliseconds(250);
  ShmPullOffer offer{
      .boot_id = "b0b0", .acks = {.pid = 12, .fd = 13, .bytes = 800}, .ack_index = 9};
  offer.acks.token[15] = 0xab;
  ticket.shm_pull = offer;
  auto compact = DecodeTicket(EncodeTicket(ticket));
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_EQ(*compact, ticket);
  auto proto = TicketFromProto(TicketToProto(ticket, kNow), kNow);
  ASSERT_TRUE(proto.ok()) << proto.status();
  EXPECT_EQ(proto->shm_pull, ticket.shm_pull);
  // Without an offer both forms are as before.
  ticket.shm_pull.reset();
  EXPECT_EQ(*DecodeTicket(EncodeTicket(ticket)), ticket);
  EXPECT_FALSE(TicketFromProto(TicketToProto(ticket, kNow), kNow)->shm_pull.has_value());
  // A truncated offer, an over-long boot id, a token of the wrong size.
  ticket.shm_pull = offer;
  std::vector<std::byte> bytes = EncodeTicket(ticket);
  bytes.pop_back();
  EXPECT_FALSE(DecodeTicket(bytes).ok());
  ticket.shm_pull->boot_id = std::string(65, 'x');
  EXPECT_FALSE(DecodeTicket(EncodeTicket(ticket)).ok());
  auto bad_proto = TicketToProto(ticket, kNow);
  bad_proto.mutable_shm_pull()->set_boot_id("b");
  bad_proto.mutable_shm_pull()->set_token("short");
  EXPECT_FALSE(TicketFromProto(bad_proto, kNow).ok());
}

// An exporter could shrink an unsealed memfd under a peer's mapping, and the peer's next copy
// from the lost range would die of SIGBUS (the whole decode worker): regions are sealed against
// resizing, and a mapper refuses one that is not.
TEST(SharedRegionTest, RegionsAreSealedAgainstResizingAndUnsealedOnesAreRefused) {
  auto region = shm::SharedRegion::Create(shm::kPagesPurpose, 8192);
  ASSERT_TRUE(region.ok()) << region.status();
  const int fd = static_cast<int>((*region)->name().fd);
  EXPECT_NE(ftruncate(fd, 4096), 0);
  EXPECT_NE(ftruncate(fd, 16384), 0);
  auto mapped = shm::PeerRegion::Map(shm::kPagesPurpose, (*region)->name(), false);
  ASSERT_TRUE(mapped.ok()) << mapped.status();

  shm::Token token{};
  token[3] = 7;
  const int unsealed = memfd_create(shm::MemfdName(shm::kPagesPurpose, token).c_str(), MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(ftruncate(unsealed, 8192), 0);
  const shm::RegionName name{.pid = static_cast<uint32_t>(getpid()),
                             .fd = static_cast<uint32_t>(unsealed),
                             .bytes = 8192,
                             .token = token};
  auto refused = shm::PeerRegion::Map(shm::kPagesPurpose, name, false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "sealed")) << refused.status();
  close(unsealed);
}

// A prefill worker that exits and is not replaced: its page pool must not stay mapped (and its
// memory in use) in the decode worker until some other region's first page.
TEST(PeerRegionsTest, DropGoneUnmapsRegionsWhoseExporterIsGone) {
  auto kept = shm::SharedRegion::Create(shm::kPagesPurpose, 4096);
  auto gone = shm::SharedRegion::Create(shm::kPagesPurpose, 4096);
  ASSERT_TRUE(kept.ok() && gone.ok());
  shm::PeerRegions regions;
  ASSERT_TRUE(regions.Get((*kept)->name()).ok());
  auto held = regions.Get((*gone)->name());
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(regions.mapped(), 2u);
  gone->reset();  // Its fd closed: the exporter no longer holds it.
  regions.DropGone();
  EXPECT_EQ(regions.mapped(), 1u);
  EXPECT_EQ((*held)->bytes().size(), 4096u);  // A user still holding it keeps its mapping.
}

// A child process that exports a region made by `make` (which also keeps it alive: it returns
// the owner and the name), passes the name back and holds the region until Exit().
class Exporter {
 public:
  using Make = std::function<std::pair<std::shared_ptr<void>, shm::RegionName>()>;
  explicit Exporter(const Make& make) {
    if (pipe(to_parent_) != 0 || pipe(to_child_) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      auto [owner, name] = make();
      if (owner == nullptr) _exit(2);
      if (write(to_parent_[1], &name, sizeof(name)) != sizeof(name)) _exit(3);
      char go = 0;
      if (read(to_child_[0], &go, 1) != 1) _exit(4);
      _exit(0);  // The region goes with the process.
    }
    shm::RegionName name;
    if (pid_ > 0 && read(to_parent_[0], &name, sizeof(name)) == sizeof(name)) {
      name_ = name;
      ok_ = true;
    }
  }
  ~Exporter() {
    Exit();
    for (int fd : {to_parent_[0], to_parent_[1], to_child_[0], to_child_[1]}) close(fd);
  }
  bool ok() const { return ok_; }
  pid_t pid() const { return pid_; }
  const shm::RegionName& name() const { return name_; }
  // Lets the child exit and returns its wait status (-1 when there is none).
  int Exit() {
    if (pid_ <= 0) return -1;
    int status = -1;
    if (write(to_child_[1], "g", 1) == 1) waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  int to_parent_[2] = {-1, -1};
  int to_child_[2] = {-1, -1};
  pid_t pid_ = -1;
  bool ok_ = false;
  shm::RegionName name_;
};

// A second process exports a region; this one maps it by name, reads what it wrote, and is
// refused for a wrong token or size; once the exporter exits the name maps no more.
TEST(SharedRegionTest, AnotherProcessMapsTheRegionByNameOnly) {
  Exporter exporter([] {
    auto region = shm::SharedRegion::Create(shm::kPagesPurpose, 8192);
    if (!region.ok()) return std::make_pair(std::shared_ptr<void>(), shm::RegionName{});
    FillPattern((*region)->bytes(), 99, 1);
    const shm::RegionName name = (*region)->name();
    return std::make_pair(std::shared_ptr<void>(std::move(*region)), name);
  });
  ASSERT_TRUE(exporter.ok());
  const shm::RegionName name = exporter.name();
  EXPECT_EQ(name.pid, static_cast<uint32_t>(exporter.pid()));
  {
    auto mapped = shm::PeerRegion::Map(shm::kPagesPurpose, name, /*writable=*/false);
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    EXPECT_TRUE(MatchesPattern((*mapped)->bytes(), 99, 1));
    shm::RegionName wrong_token = name;
    wrong_token.token[3] ^= 0x10;
    EXPECT_EQ(shm::PeerRegion::Map(shm::kPagesPurpose, wrong_token, false).status().code(),
              absl::StatusCode::kFailedPrecondition);
    shm::RegionName wrong_size = name;
    wrong_size.bytes = 4096;
    EXPECT_EQ(shm::PeerRegion::Map(shm::kPagesPurpose, wrong_size, false).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(shm::PeerRegion::Map(shm::kAcksPurpose, name, false).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  shm::PeerRegions regions;
  ASSERT_TRUE(regions.Get(name).ok());
  EXPECT_EQ(regions.mapped(), 1u);
  const int status = exporter.Exit();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_FALSE(shm::PeerRegion::Map(shm::kPagesPurpose, name, false).ok());
  // The cached mapping of the exited exporter is dropped at the next miss.
  shm::RegionName other = name;
  other.fd += 1000;
  EXPECT_FALSE(regions.Get(other).ok());
  EXPECT_EQ(regions.mapped(), 0u);
}

// A decode worker that exits: the prefill side's mapping of its ack table goes at a later AcksFor
// (checks are a second apart), not only when another table is first mapped.
TEST(PullSenderTest, AckTableOfAGoneDecodeWorkerIsUnmapped) {
  auto region = shm::SharedRegion::Create(shm::kPagesPurpose, 4096);
  ASSERT_TRUE(region.ok());
  auto pull = shm::PullSender::Create(**region);
  ASSERT_TRUE(pull.ok());
  Exporter exporter([] {
    auto table = shm::AckTable::Create(16);
    if (!table.ok()) return std::make_pair(std::shared_ptr<void>(), shm::RegionName{});
    const shm::RegionName name = (*table)->name();
    return std::make_pair(std::shared_ptr<void>(std::move(*table)), name);
  });
  ASSERT_TRUE(exporter.ok());
  auto mine = shm::AckTable::Create(16);
  ASSERT_TRUE(mine.ok());
  const ShmPullOffer gone{.boot_id = (*mine)->boot_id(), .acks = exporter.name(), .ack_index = 0};
  const ShmPullOffer here{.boot_id = (*mine)->boot_id(), .acks = (*mine)->name(), .ack_index = 0};
  ASSERT_TRUE((*pull)->AcksFor(gone, 4).ok());
  ASSERT_TRUE((*pull)->AcksFor(here, 4).ok());
  EXPECT_EQ((*pull)->tables_mapped(), 2u);
  exporter.Exit();
  absl::SleepFor(absl::Milliseconds(1100));     // Past the next check.
  ASSERT_TRUE((*pull)->AcksFor(here, 4).ok());  // A hit: no new mapping, only the check.
  EXPECT_EQ((*pull)->tables_mapped(), 1u);
}

TEST(PullSenderTest, DisabledDecodeWorkerIsRefusedWithTheReason) {
  auto region = shm::SharedRegion::Create(shm::kPagesPurpose, 4096);
  ASSERT_TRUE(region.ok());
  auto pull = shm::PullSender::Create(**region);
  ASSERT_TRUE(pull.ok());
  auto table = shm::AckTable::Create(8);
  ASSERT_TRUE(table.ok());
  const ShmPullOffer offer{
      .boot_id = (*table)->boot_id(), .acks = (*table)->name(), .ack_index = 2};
  auto acks = (*pull)->AcksFor(offer, 6);
  ASSERT_TRUE(acks.ok()) << acks.status();
  (*table)->Write(4, 123);
  EXPECT_EQ(acks->words[2].load(), 123u);
  EXPECT_FALSE((*pull)->AcksFor(offer, 7).ok());  // Past the table's end.
  (*pull)->Disable(offer.acks, absl::UnavailableError("cannot read"));
  EXPECT_EQ((*pull)->AcksFor(offer, 6).status().message(), "cannot read");
  // A disable that has run out (here at once) lets the next ticket try again.
  auto brief = shm::PullSender::Create(**region, absl::ZeroDuration());
  ASSERT_TRUE(brief.ok());
  (*brief)->Disable(offer.acks, absl::UnavailableError("cannot read"));
  EXPECT_TRUE((*brief)->AcksFor(offer, 6).ok());
}

// A region that failed to map gets its cached error until the retry interval passed, then one
// more try.
TEST(PeerRegionsTest, FailedMapsAreRetriedAfterTheInterval) {
  auto region = shm::SharedRegion::Create(shm::kPagesPurpose, 4096);
  ASSERT_TRUE(region.ok());
  shm::RegionName bad = (*region)->name();
  bad.token[0] ^= 1;
  shm::PeerRegions patient(shm::kPagesPurpose, false, absl::Hours(1));
  EXPECT_FALSE(patient.Get(bad).ok());
  EXPECT_FALSE(patient.Get(bad).ok());
  EXPECT_EQ(patient.attempts(), 1u);
  shm::PeerRegions eager(shm::kPagesPurpose, false, absl::ZeroDuration());
  EXPECT_FALSE(eager.Get(bad).ok());
  EXPECT_FALSE(eager.Get(bad).ok());
  EXPECT_EQ(eager.attempts(), 2u);
  // A mapped region is never mapped again.
  EXPECT_TRUE(eager.Get((*region)->name()).ok());
  EXPECT_TRUE(eager.Get((*region)->name()).ok());
  EXPECT_EQ(eager.attempts(), 3u);
}

}  // namespace
}  // namespace pdserve::kv::testing
