// GPU destination pages (docs/protocol.md, "Same-host device-to-device pages (CUDA IPC)"), in
// process over the loopback transport with the fake clock and a host stand-in for the GPU: the
// "arena" and the "device" destinations are host memory, and the lander (FakeLander) copies and
// checksums with memcpy and the CPU's XXH3, in the batches the real one
// (kvtransfer/cuda_ipc/cuda_page_lander.h) runs on the GPU. What must hold: a ticket whose pages
// are GPU memory takes only page references into a GPU arena (never a page message, a
// shared-memory reference or a page in another element type), lands them in batches, verifies
// them like any page (a changed page fails only its request), acknowledges each slot, and a
// sender can send it nothing else; a reference the lander refuses fails its landing and the
// sender's transfer, which has no host copy to send instead.
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/shm/shared_memory.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/ticket_proto.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "tests/kvtransfer/fake_device_lander.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

using shm::AckState;
using shm::AckWord;

constexpr uint32_t kPages = 8;
constexpr uint64_t kPageBytes = 16 * 1024;
constexpr char kBusId[] = "0000:19:00.0";

class DevicePagesTest : public ::testing::Test {
 protected:
  DevicePagesTest() {
    absl::StatusOr<ShmPullParts> parts = MakeShmPullParts(64, kPages * kPageBytes);
    EXPECT_TRUE(parts.ok()) << parts.status();
    if (parts.ok()) {
      acks_ = std::move(parts->acks);
      region_ = std::move(parts->region);
      pull_ = std::move(parts->pull);
    }
    arena_.assign(kPages * kPageBytes, std::byte{0});
    fake_.arenas[7] = arena_;
    arena_name_.memory[0] = std::byte{7};
    arena_name_.bytes = arena_.size();
    arena_name_.pci_bus_id = kBusId;
    arena_name_.boot_id = acks_->boot_id();
    MakeReceiver(/*with_lander=*/true);
    pool_.assign(kPages, std::vector<std::byte>(kPageBytes));
    sender_ = std::make_unique<TransferSender>(*send_end_, clock_,
                                               SenderOptions{.shm_pull = pull_.get()});
  }

  void MakeReceiver(bool with_lander) {
    receiver_.reset();
    std::unique_ptr<ReceiveTransport> end = network_.NewReceiveEnd();
    if (with_lander) {
      EXPECT_TRUE(
          end->SetDeviceLanders([this]() -> absl::StatusOr<std::unique_ptr<shm::DevicePageLander>> {
               return std::make_unique<FakeLander>(fake_, &flushes_, &gate_);
             })
              .ok());
    }
    receiver_ = MakePullReceiver(std::move(end), acks_.get(), clock_, &released_);
  }

  Ticket ExpectDevice(uint64_t request_id, uint32_t count, uint32_t first = 0) {
    ReceiveSpec spec = SpecOverPool(pool_, request_id, 7, first, count, kPageBytes);
    spec.device_pci_bus_id = kBusId;
    auto ticket = receiver_->Expect(std::move(spec));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : Ticket{};
  }

  // Fills arena pages [0, count) with FillPattern(seed, slot) and describes them (checksums of
  // what is there now).
  DevicePages Arena(const Ticket& ticket, uint64_t seed) {
    DevicePages pages{.arena = arena_name_};
    for (uint32_t slot = 0; slot < ticket.pages.size(); ++slot) {
      const std::span<std::byte> page = std::span(arena_).subspan(slot * kPageBytes, kPageBytes);
      FillPattern(page, seed, slot);
      pages.pages.push_back({.offset = slot * kPageBytes,
                             .length = kPageBytes,
                             .element = ticket.pages[slot].element,
                             .xxh3 = PayloadChecksum(page)});
    }
    return pages;
  }

  std::unique_ptr<Transfer> Send(const Ticket& ticket, DevicePages pages) {
    auto transfer = sender_->PrepareDevice(ticket, std::move(pages));
    EXPECT_TRUE(transfer.ok()) << transfer.status();
    if (!transfer.ok()) return nullptr;
    EXPECT_TRUE((*transfer)->PostAll().ok());
    EXPECT_TRUE((*transfer)->Commit(16, 3).ok());
    return std::move(*transfer);
  }

  TransferOutcome RunUntilDecided(uint64_t ticket_id, Transfer* transfer) {
    return testing::RunUntilDecided(*receiver_, clock_, ticket_id, transfer, &last_poll_);
  }

  // Sends one raw message of `kind` (bypassing TransferSender).
  void SendRaw(WireKind kind, std::span<const std::byte> header, std::vector<std::byte> payload) {
    raw_messages_.emplace_back(header.begin(), header.end());
    raw_messages_.push_back(std::move(payload));
    auto peer = raw_end_->Connect(receiver_->worker_address(), 1);
    ASSERT_TRUE(peer.ok()) << peer.status();
    auto op =
        raw_end_->Send(*peer, kind, raw_messages_[raw_messages_.size() - 2], raw_messages_.back());
    ASSERT_TRUE(op.ok()) << op.status();
    raw_ops_.push_back(std::move(*op));
  }

  FakeClock clock_;
  LoopbackNetwork network_;
  FakeArenas fake_;
  FakeLanderGate gate_;
  std::vector<size_t> flushes_;
  std::vector<uint64_t> released_;  // on_release's tickets
  std::vector<std::byte> arena_;
  shm::IpcRegionName arena_name_;
  std::unique_ptr<shm::AckTable> acks_;
  std::unique_ptr<shm::SharedRegion> region_;
  std::unique_ptr<shm::PullSender> pull_;
  std::vector<std::vector<std::byte>> pool_;
  std::unique_ptr<TransferReceiver> receiver_;
  std::unique_ptr<PageTransport> send_end_ = network_.NewSendEnd();
  std::unique_ptr<TransferSender> sender_;
  std::unique_ptr<PageTransport> raw_end_ = network_.NewSendEnd();
  std::deque<std::vector<std::byte>> raw_messages_;
  std::vector<std::unique_ptr<SendOp>> raw_ops_;
  absl::StatusOr<bool> last_poll_ = false;
};

TEST_F(DevicePagesTest, ArenaPagesLandInBatchesVerifyAndEachSlotIsAcknowledged) {
  const Ticket ticket = ExpectDevice(1, 4);
  ASSERT_TRUE(ticket.shm_pull.has_value());
  EXPECT_EQ(ticket.shm_pull->device_pci_bus_id, kBusId);
  auto transfer = Send(ticket, Arena(ticket, 41));
  ASSERT_NE(transfer, nullptr);
  EXPECT_TRUE(transfer->pulled());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_TRUE(MatchesPattern(pool_[slot], 41, slot)) << "slot " << slot;
    EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + slot),
              AckWord(ticket.ticket_id, AckState::kLanded));
  }
  // The four references arrived in one Progress: one batch of four, not four of one.
  ASSERT_FALSE(flushes_.empty());
  EXPECT_EQ(flushes_.front(), 4u);
  for (int i = 0; i < 4 && !(last_poll_.ok() && *last_poll_); ++i) last_poll_ = transfer->Poll();
  ASSERT_TRUE(last_poll_.ok() && *last_poll_) << last_poll_.status();
  EXPECT_EQ(transfer->pages_completed(), 4u);
  EXPECT_TRUE(transfer->Release().ok());
}

// A prefill prepares its GPU-arena transfer before it computes the pages
// (DevicePages::checksums_pending): nothing can be posted before the checksums are given, its
// polls keep the decode worker's lease alive meanwhile (past the 10 s lease here), and the pages
// then land and verify under the checksums given later; a wrong count is refused.
// An aborted ticket's GPU pages go back only once the lander reported every page it queued for
// them: neither the sender's fence nor the lease's end releases pages a batch not yet run would
// still write (the decode worker would give them to another request).
TEST_F(DevicePagesTest, AnAbortedTicketsPagesGoBackOnlyAfterItsQueuedPagesLanded) {
  const Ticket ticket = ExpectDevice(1, 4);
  gate_.hold = true;
  auto transfer = Send(ticket, Arena(ticket, 5));
  ASSERT_NE(transfer, nullptr);
  for (int i = 0; i < 4; ++i) {
    transfer->Poll().IgnoreError();
    receiver_->Progress();
  }
  ASSERT_EQ(acks_->Read(ticket.shm_pull->ack_index), 0u);  // queued, not landed
  ASSERT_TRUE(receiver_->Abort(ticket.ticket_id).ok());
  receiver_->ConfirmFence(ticket.ticket_id);
  clock_.Advance(absl::Seconds(11));  // past the lease too
  receiver_->Progress();
  EXPECT_TRUE(released_.empty());
  EXPECT_EQ(receiver_->stats().tickets_held, 1u);
  gate_.hold = false;
  receiver_->Progress();
  ASSERT_EQ(released_.size(), 1u);
  EXPECT_EQ(released_[0], ticket.ticket_id);
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + slot),
              AckWord(ticket.ticket_id, AckState::kLanded))
        << "slot " << slot;
  }
}

// A batch that fails part way (a CUDA error after its copy ran for some pages) fails every page
// of it: none counts as landed although some bytes arrived, the sender's transfer fails (no
// host copy to send instead), the ticket never verifies, and its pages go back once the sender
// fenced; the sender takes the decode worker's next ticket for GPU pages.
TEST_F(DevicePagesTest, ABatchThatFailsPartWayLandsNoneOfItsPages) {
  const Ticket ticket = ExpectDevice(1, 4);
  gate_.fail = 1;
  auto transfer = Send(ticket, Arena(ticket, 9));
  ASSERT_NE(transfer, nullptr);
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  EXPECT_NE(outcome.state, TransferState::kVerified);
  EXPECT_EQ(receiver_->stats().pages_landed, 0u);
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + slot),
              AckWord(ticket.ticket_id, AckState::kFailed))
        << "slot " << slot;
  }
  ASSERT_FALSE(last_poll_.ok());
  EXPECT_TRUE(absl::StrContains(last_poll_.status().message(), "GPU arena")) << last_poll_.status();
  transfer.reset();  // the sender's fence
  receiver_->Progress();
  EXPECT_EQ(released_.size(), 1u);
  // The decode worker decides whether its next tickets ask for GPU pages: the sender takes them.
  const Ticket next = ExpectDevice(2, 4);
  auto again = Send(next, Arena(next, 10));
  ASSERT_NE(again, nullptr);
  const TransferOutcome verified = RunUntilDecided(next.ticket_id, again.get());
  EXPECT_EQ(verified.state, TransferState::kVerified) << verified.status;
}

TEST_F(DevicePagesTest, ChecksumsGivenAfterPrepareKeepTheLeaseAndVerify) {
  const Ticket ticket = ExpectDevice(1, 4);
  DevicePages pages = Arena(ticket, 17);
  std::vector<uint64_t> sums;
  for (DeviceSourcePage& page : pages.pages) {
    sums.push_back(page.xxh3);
    page.xxh3 = 0;  // Not known at Prepare: ignored.
  }
  pages.checksums_pending = true;
  auto transfer = sender_->PrepareDevice(ticket, std::move(pages));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  EXPECT_EQ((*transfer)->PostAll().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*transfer)->PostLayer(0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*transfer)->pages_posted(), 0u);
  // The prompt "runs" 15 s: the sender's heartbeats renew the lease.
  for (int second = 0; second < 15; ++second) {
    const absl::StatusOr<bool> polled = (*transfer)->Poll();
    ASSERT_TRUE(polled.ok()) << polled.status();
    EXPECT_FALSE(*polled);
    for (int i = 0; i < 4; ++i) receiver_->Progress();
    auto outcome = receiver_->Outcome(ticket.ticket_id);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    ASSERT_EQ(outcome->state, TransferState::kReceiving) << "second " << second;
    clock_.Advance(absl::Seconds(1));
  }
  EXPECT_EQ((*transfer)->SetDeviceChecksums(std::span(sums).first(3)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*transfer)->SetDeviceChecksums(sums).ok());
  ASSERT_TRUE((*transfer)->PostAll().ok());
  EXPECT_EQ((*transfer)->SetDeviceChecksums(sums).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*transfer)->Commit(16, 3).ok());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer->get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_TRUE(MatchesPattern(pool_[slot], 17, slot)) << "slot " << slot;
  }
}

// A checksum given later that does not match the page's bytes fails the request as any
// mismatch does.
TEST_F(DevicePagesTest, AWrongChecksumGivenLaterFailsTheRequest) {
  const Ticket ticket = ExpectDevice(1, 2);
  DevicePages pages = Arena(ticket, 23);
  std::vector<uint64_t> sums = {pages.pages[0].xxh3, pages.pages[1].xxh3 ^ 1};
  pages.checksums_pending = true;
  auto transfer = sender_->PrepareDevice(ticket, std::move(pages));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->SetDeviceChecksums(sums).ok());
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(16, 3).ok());
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer->get());
  ASSERT_EQ(outcome.state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(outcome.status), IsolationError::kChecksum) << outcome.status;
}

TEST_F(DevicePagesTest, APageChangedAfterItsChecksumFailsOnlyItsRequest) {
  const Ticket first = ExpectDevice(1, 2);
  DevicePages pages = Arena(first, 5);
  arena_[kPageBytes + 100] ^= std::byte{0x10};  // Slot 1 changes after its checksum was taken.
  auto transfer = Send(first, std::move(pages));
  ASSERT_NE(transfer, nullptr);
  const TransferOutcome failed = RunUntilDecided(first.ticket_id, transfer.get());
  ASSERT_EQ(failed.state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(failed.status), IsolationError::kChecksum) << failed.status;
  EXPECT_TRUE(absl::StrContains(failed.status.message(), "slot 1")) << failed.status;
  transfer.reset();
  // The next request over the same receiver (its own pages) is untouched.
  const Ticket second = ExpectDevice(2, 2, /*first=*/4);
  auto again = Send(second, Arena(second, 6));
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(RunUntilDecided(second.ticket_id, again.get()).state, TransferState::kVerified);
  EXPECT_TRUE(MatchesPattern(pool_[4], 6, 0));
  EXPECT_TRUE(MatchesPattern(pool_[5], 6, 1));
}

TEST_F(DevicePagesTest, AReferenceOutsideTheArenaFailsTheTransferAndIsNotSentAgain) {
  const Ticket ticket = ExpectDevice(1, 2);
  DevicePages pages = Arena(ticket, 9);
  // The lander's arena is smaller than the one the sender names: slot 1 lies outside it.
  fake_.arenas[7] = std::span(arena_).first(kPageBytes + 10);
  auto transfer = Send(ticket, std::move(pages));
  ASSERT_NE(transfer, nullptr);
  RunUntilDecided(ticket.ticket_id, transfer.get());
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + 1),
            AckWord(ticket.ticket_id, AckState::kFailed));
  for (int i = 0; i < 8 && last_poll_.ok(); ++i) last_poll_ = transfer->Poll();
  ASSERT_FALSE(last_poll_.ok());
  EXPECT_TRUE(absl::StrContains(last_poll_.status().message(), "GPU arena")) << last_poll_.status();
  EXPECT_FALSE(transfer->pulled() && transfer->pages_completed() == 2);
  // No page message followed: nothing else reached the receiver's slot 1.
  EXPECT_FALSE(MatchesPattern(pool_[1], 9, 1));
}

// The A/B switch: a sender writing one version-2 reference a page (what a decode worker built
// before version 3 reads) lands and verifies the same.
TEST_F(DevicePagesTest, VersionTwoReferencesStillLandAndVerify) {
  sender_ = std::make_unique<TransferSender>(
      *send_end_, clock_, SenderOptions{.shm_pull = pull_.get(), .device_ref_version = 2});
  const Ticket ticket = ExpectDevice(1, 4);
  auto transfer = Send(ticket, Arena(ticket, 43));
  ASSERT_NE(transfer, nullptr);
  const TransferOutcome outcome = RunUntilDecided(ticket.ticket_id, transfer.get());
  ASSERT_EQ(outcome.state, TransferState::kVerified) << outcome.status;
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_TRUE(MatchesPattern(pool_[slot], 43, slot)) << "slot " << slot;
  }
  ASSERT_FALSE(flushes_.empty());
  EXPECT_EQ(flushes_.front(), 4u);
}

// One hostile entry of a version-3 batch (a range past the arena) fails only its own landing:
// the batch's other pages land and are acknowledged, that slot stays empty with a "failed" word.
TEST_F(DevicePagesTest, AHostileEntryOfABatchFailsOnlyItsSlot) {
  const Ticket ticket = ExpectDevice(1, 4);
  const DevicePages pages = Arena(ticket, 12);
  std::vector<shm::DeviceRefEntry> entries(4);
  for (uint32_t slot = 0; slot < 4; ++slot) {
    entries[slot].header = EncodePageHeader(
        HeaderFor(ticket, slot, pages.pages[slot].xxh3, ticket.pages[slot].element));
    entries[slot].offset = pages.pages[slot].offset;
    entries[slot].length = kPageBytes;
  }
  entries[2].offset = arena_.size() - 8;
  std::vector<std::byte> message;
  shm::AppendDeviceRefBatch(arena_name_, entries, message);
  SendRaw(WireKind::kPageRef, {}, std::move(message));
  receiver_->Progress();
  for (uint32_t slot = 0; slot < 4; ++slot) {
    EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + slot),
              AckWord(ticket.ticket_id, slot == 2 ? AckState::kFailed : AckState::kLanded))
        << "slot " << slot;
    EXPECT_EQ(MatchesPattern(pool_[slot], 12, slot), slot != 2) << "slot " << slot;
  }
  EXPECT_EQ(receiver_->stats().pages_landed, 3u);
  ASSERT_FALSE(flushes_.empty());
  EXPECT_EQ(flushes_.front(), 3u);  // The three good pages in one batch.
}

TEST_F(DevicePagesTest, GpuPagesTakeNoHostPageAndHostPagesNoArenaPage) {
  const Ticket device = ExpectDevice(1, 2);
  // A sender with host pages is refused before it sends anything.
  std::vector<std::span<const std::byte>> host;
  for (uint32_t slot = 0; slot < 2; ++slot)
    host.push_back(region_->bytes().subspan(slot * kPageBytes, kPageBytes));
  auto refused = sender_->Prepare(device, host);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "GPU pages")) << refused.status();
  // Raw messages that a broken sender could send: a page message and a shared-memory reference
  // for the GPU ticket, each fails its landing (the slot stays empty) and the request then fails.
  std::vector<std::byte> payload(kPageBytes);
  FillPattern(payload, 3, 0);
  SendRaw(WireKind::kPage, EncodePageHeader(HeaderFor(device, 0, PayloadChecksum(payload))),
          payload);
  const auto header1 = EncodePageHeader(HeaderFor(device, 1, 0));
  SendRaw(WireKind::kPageRef, {},
          shm::EncodePageRefMessage(
              header1, {.region = region_->name(), .offset = kPageBytes, .length = kPageBytes}));
  receiver_->Progress();
  receiver_->Progress();
  EXPECT_EQ(acks_->Read(device.shm_pull->ack_index + 0),
            AckWord(device.ticket_id, AckState::kFailed));
  EXPECT_EQ(acks_->Read(device.shm_pull->ack_index + 1),
            AckWord(device.ticket_id, AckState::kFailed));
  EXPECT_EQ(receiver_->stats().pages_landed, 0u);
  EXPECT_FALSE(MatchesPattern(pool_[0], 3, 0));
  // An arena page for a ticket of host pages: refused by the sender, and failed by the receiver.
  auto host_ticket = receiver_->Expect(SpecOverPool(pool_, 2, 7, 4, 2, kPageBytes));
  ASSERT_TRUE(host_ticket.ok()) << host_ticket.status();
  auto no_device = sender_->PrepareDevice(*host_ticket, Arena(*host_ticket, 4));
  EXPECT_EQ(no_device.status().code(), absl::StatusCode::kFailedPrecondition) << no_device.status();
  const auto header2 = EncodePageHeader(HeaderFor(*host_ticket, 0, 0));
  SendRaw(WireKind::kPageRef, {},
          shm::EncodePageRefMessage(header2,
                                    {.device = arena_name_, .offset = 0, .length = kPageBytes}));
  receiver_->Progress();
  EXPECT_EQ(acks_->Read(host_ticket->shm_pull->ack_index + 0),
            AckWord(host_ticket->ticket_id, AckState::kFailed));
}

TEST_F(DevicePagesTest, AReceiverWithoutALanderFailsArenaPagesLoudly) {
  MakeReceiver(/*with_lander=*/false);
  const Ticket ticket = ExpectDevice(1, 2);
  auto transfer = Send(ticket, Arena(ticket, 8));
  ASSERT_NE(transfer, nullptr);
  RunUntilDecided(ticket.ticket_id, transfer.get());
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index + 0),
            AckWord(ticket.ticket_id, AckState::kFailed));
  for (int i = 0; i < 8 && last_poll_.ok(); ++i) last_poll_ = transfer->Poll();
  EXPECT_FALSE(last_poll_.ok());
}

TEST_F(DevicePagesTest, APageInAnotherElementTypeIsAHeaderError) {
  const Ticket ticket = ExpectDevice(1, 1);
  std::vector<std::byte> page(kPageBytes / 2);
  const auto header = EncodePageHeader(
      HeaderFor(ticket, 0, PayloadChecksum(page), serving::ElementType::kBfloat16));
  SendRaw(WireKind::kPageRef, {},
          shm::EncodePageRefMessage(header,
                                    {.device = arena_name_, .offset = 0, .length = page.size()}));
  receiver_->Progress();
  auto outcome = receiver_->Outcome(ticket.ticket_id);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  ASSERT_EQ(outcome->state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(outcome->status), IsolationError::kHeader) << outcome->status;
  EXPECT_EQ(acks_->Read(ticket.shm_pull->ack_index), AckWord(ticket.ticket_id, AckState::kRefused));
}

TEST_F(DevicePagesTest, GpuDestinationsNeedTheAckTable) {
  TransferReceiver no_acks(network_.NewReceiveEnd(), ReceiverOptions{.incarnation = 2}, clock_,
                           [](uint64_t, uint64_t, const absl::Status&) {});
  ReceiveSpec spec = SpecOverPool(pool_, 1, 7, 0, 1, kPageBytes);
  spec.device_pci_bus_id = kBusId;
  EXPECT_EQ(no_acks.Expect(spec).status().code(), absl::StatusCode::kFailedPrecondition);
  spec.device_pci_bus_id = std::string(32, '0');
  EXPECT_EQ(receiver_->Expect(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

// Over real UCX with two lanes on each side (their threads deliver and flush the landers): the
// landers are set while the lanes run (through the receiver, without a lock-order inversion:
// absl's deadlock detector aborted the GPU benchmark when the receiver held its mutex there), and
// a layer's pages land in batches on the lanes and verify.
//
// Under a rendezvous threshold below a batch's size (an operator's UCX_RNDV_THRESH=256), the
// reference messages still go eager: the receiver refuses a rendezvous one, and before they were
// forced eager every pulled transfer then failed ("page send: Unsupported operation"; breaker57).
TEST(DevicePagesUcxTest, LanesLandArenaPagesInBatchesAndVerify) {
  setenv("UCX_TLS", "tcp", 1);
  setenv("UCX_RNDV_THRESH", "256", 1);
  struct Unset {
    ~Unset() { unsetenv("UCX_RNDV_THRESH"); }
  } unset;
  FakeClock clock;
  auto parts = MakeShmPullParts(64, kPageBytes);
  ASSERT_TRUE(parts.ok()) << parts.status();
  auto receiver = CreateUcxReceiver(
      {.lease = absl::Seconds(10), .incarnation = 3, .acks = parts->acks.get()}, clock,
      [](uint64_t, uint64_t, const absl::Status&) {}, nullptr, /*lanes=*/2);
  ASSERT_TRUE(receiver.ok()) << receiver.status();
  FakeArenas fake;
  std::vector<size_t> flushes;  // Written on the lane threads, read after the outcome.
  absl::Mutex flushes_mu;
  ASSERT_TRUE(
      (*receiver)
          ->SetDeviceLanders([&]() -> absl::StatusOr<std::unique_ptr<shm::DevicePageLander>> {
            absl::MutexLock lock(&flushes_mu);
            return std::make_unique<FakeLander>(fake, nullptr);
          })
          .ok());
  constexpr uint32_t kSlots = 16;
  std::vector<std::byte> arena(kSlots * kPageBytes);
  fake.arenas[7] = arena;
  std::vector<std::vector<std::byte>> pool(kSlots, std::vector<std::byte>(kPageBytes));
  ReceiveSpec spec = SpecOverPool(pool, 1, 7, 0, kSlots, kPageBytes);
  spec.device_pci_bus_id = kBusId;
  auto ticket = (*receiver)->Expect(std::move(spec));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  shm::IpcRegionName name{
      .bytes = arena.size(), .pci_bus_id = kBusId, .boot_id = parts->acks->boot_id()};
  name.memory[0] = std::byte{7};
  DevicePages pages{.arena = name};
  for (uint32_t slot = 0; slot < kSlots; ++slot) {
    const std::span<std::byte> page = std::span(arena).subspan(slot * kPageBytes, kPageBytes);
    FillPattern(page, 77, slot);
    pages.pages.push_back({.offset = slot * kPageBytes,
                           .length = kPageBytes,
                           .element = ticket->pages[slot].element,
                           .xxh3 = PayloadChecksum(page)});
  }
  auto transport = UcxTransport::Create(2);
  ASSERT_TRUE(transport.ok()) << transport.status();
  TransferSender sender(**transport, clock, {.shm_pull = parts->pull.get()});
  auto transfer = sender.PrepareDevice(*ticket, std::move(pages));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(16, 3).ok());
  absl::StatusOr<bool> done = false;
  absl::StatusOr<TransferOutcome> outcome = (*receiver)->Outcome(ticket->ticket_id);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until &&
         (!(done.ok() && *done) || (outcome.ok() && outcome->state == TransferState::kReceiving))) {
    if (done.ok() && !*done) done = (*transfer)->Poll();
    (*receiver)->Progress();
    outcome = (*receiver)->Outcome(ticket->ticket_id);
    absl::SleepFor(absl::Microseconds(100));
  }
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  ASSERT_EQ(outcome->state, TransferState::kVerified) << outcome->status;
  for (uint32_t slot = 0; slot < kSlots; ++slot) {
    EXPECT_TRUE(MatchesPattern(pool[slot], 77, slot)) << "slot " << slot;
  }
  EXPECT_TRUE((*transfer)->Release().ok());
}

TEST(DevicePageRefTest, RoundTripsAndRefusesMalformedMessages) {
  const auto header = EncodePageHeader({.request_id = 1, .ticket_id = 2, .slot = 3});
  shm::IpcRegionName arena{.allocation_offset = 512,
                           .bytes = 1 << 30,
                           .pci_bus_id = "0000:19:00.0",
                           .boot_id = "4b1c7a9e-0d2f-4c39-9a51-8f0e2b6d7c13"};
  arena.memory[0] = std::byte{0xab};
  arena.memory[63] = std::byte{0xcd};
  const shm::PageRef ref{.device = arena, .offset = 4096, .length = 65536};
  std::vector<std::byte> message = shm::EncodePageRefMessage(header, ref);
  ASSERT_EQ(message.size(), kPageHeaderBytes + shm::kDevicePageRefBytes);
  auto decoded = shm::DecodePageRef(message);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, ref);
  EXPECT_FALSE(shm::DecodePageRef(std::span(message).first(message.size() - 1)).ok());
  // Magic, version, reserved fields; a bus id and a boot id that fill their fields (no NUL).
  for (size_t at : {size_t{64}, size_t{68}, size_t{70}, size_t{64 + 176}, size_t{64 + 191}}) {
    std::vector<std::byte> bad = message;
    bad[at] ^= std::byte{1};
    EXPECT_FALSE(shm::DecodePageRef(bad).ok()) << "byte " << at;
  }
  std::vector<std::byte> long_bus = message;
  std::memset(long_bus.data() + 64 + 88, 'a', 32);
  EXPECT_FALSE(shm::DecodePageRef(long_bus).ok());
  std::vector<std::byte> long_boot = message;
  std::memset(long_boot.data() + 64 + 120, 'b', 40);
  EXPECT_FALSE(shm::DecodePageRef(long_boot).ok());
}

// Version 3: the arena once, then per page its header, offset and length.
std::vector<std::byte> Batch(size_t count, shm::IpcRegionName* arena_out = nullptr) {
  shm::IpcRegionName arena{.allocation_offset = 256,
                           .bytes = 1 << 30,
                           .pci_bus_id = "0000:19:00.0",
                           .boot_id = "4b1c7a9e-0d2f-4c39-9a51-8f0e2b6d7c13"};
  arena.memory[1] = std::byte{0x5c};
  std::vector<shm::DeviceRefEntry> entries(count);
  for (size_t i = 0; i < count; ++i) {
    entries[i].header = EncodePageHeader(
        {.request_id = 1, .ticket_id = 2, .slot = static_cast<uint32_t>(i), .payload_xxh3 = i});
    entries[i].offset = 65536 * i;
    entries[i].length = 40000 + i;
  }
  std::vector<std::byte> message;
  shm::AppendDeviceRefBatch(arena, entries, message);
  if (arena_out != nullptr) *arena_out = arena;
  return message;
}

TEST(DeviceRefBatchTest, ABatchNamesItsArenaOnceAndRoundTrips) {
  shm::IpcRegionName arena;
  const std::vector<std::byte> message = Batch(shm::kMaxDeviceRefsPerBatch, &arena);
  EXPECT_EQ(message.size(), shm::kDeviceRefBatchFirstBytes +
                                (shm::kMaxDeviceRefsPerBatch - 1) * shm::kDeviceRefBatchEntryBytes);
  EXPECT_LE(message.size(), 8000u);  // One eager fragment of UCX's shm and tcp transports.
  const shm::ParsedRefs parsed = shm::ParsePageRefs(message);
  ASSERT_EQ(parsed.pages.size(), shm::kMaxDeviceRefsPerBatch);
  ASSERT_EQ(parsed.arenas.size(), 1u);
  EXPECT_EQ(parsed.arenas.front(), arena);
  for (size_t i = 0; i < parsed.pages.size(); ++i) {
    const shm::ParsedRef& page = parsed.pages[i];
    ASSERT_TRUE(page.error.ok()) << page.error;
    EXPECT_EQ(page.arena, &parsed.arenas.front());
    EXPECT_EQ(page.offset, 65536 * i);
    EXPECT_EQ(page.length, 40000 + i);
    auto header = DecodePageHeader(page.header);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(header->slot, i);
  }
}

TEST(DeviceRefBatchTest, CutOrMalformedBatchesAreOneRefusedEntry) {
  const std::vector<std::byte> message = Batch(3);
  std::vector<std::vector<std::byte>> bad;
  bad.emplace_back(message.begin(), message.end() - 1);   // cut in the last entry
  bad.emplace_back(message.begin(), message.end() - 80);  // count says 3, 2 there
  bad.push_back(message);
  bad.back().push_back(std::byte{0});  // one byte past its end
  bad.emplace_back(message.begin(), message.begin() + shm::kDeviceRefBatchFirstBytes - 1);
  for (uint64_t count : {uint64_t{0}, uint64_t{4}, uint64_t{shm::kMaxDeviceRefsPerBatch + 1}}) {
    bad.push_back(message);
    StoreLe(bad.back(), kPageHeaderBytes + 6, count, 2);
  }
  bad.push_back(message);
  std::memset(bad.back().data() + kPageHeaderBytes + 88, 'a', 32);  // bus id without its NUL
  for (size_t i = 0; i < bad.size(); ++i) {
    const shm::ParsedRefs parsed = shm::ParsePageRefs(bad[i]);
    ASSERT_EQ(parsed.pages.size(), 1u) << "case " << i;
    EXPECT_FALSE(parsed.pages[0].error.ok()) << "case " << i;
    EXPECT_EQ(parsed.pages[0].header.data(), bad[i].data()) << "case " << i;
  }
}

// A decode worker built before version 3 splits references with SplitPageRefs and decodes each
// with DecodePageRef: a version-3 batch is one entry for it that does not decode, so it checks
// the first page's header with length 0 (a header error: that ticket fails, loudly) and lands
// nothing.
TEST(DeviceRefBatchTest, AReceiverBeforeVersionThreeRefusesABatchWhole) {
  const std::vector<std::byte> message = Batch(5);
  const std::vector<std::span<const std::byte>> entries = shm::SplitPageRefs(message);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_EQ(entries[0].size(), message.size());
  EXPECT_FALSE(shm::DecodePageRef(entries[0]).ok());
  // And a version-1 reference followed by a batch in one message: both parse.
  const auto header = EncodePageHeader({.request_id = 1, .ticket_id = 2, .slot = 9});
  std::vector<std::byte> mixed =
      shm::EncodePageRefMessage(header, {.region = {.pid = 3}, .offset = 64, .length = 128});
  mixed.insert(mixed.end(), message.begin(), message.end());
  const shm::ParsedRefs parsed = shm::ParsePageRefs(mixed);
  ASSERT_EQ(parsed.pages.size(), 6u);
  EXPECT_EQ(parsed.pages[0].arena, nullptr);
  EXPECT_EQ(parsed.pages[0].region.pid, 3u);
  for (const shm::ParsedRef& page : parsed.pages) EXPECT_TRUE(page.error.ok()) << page.error;
}

TEST(DevicePageTicketTest, TheOffersDeviceRoundTripsThroughTheCompactFormAndProto) {
  const absl::Time kNow = absl::FromUnixMillis(1699999990000);  // both ends' clock
  Ticket ticket{.ticket_id = 4, .epoch = 5, .request_id = 6, .worker_address = {std::byte{7}}};
  ticket.pages.push_back(
      {.layer = 1, .page_index = 2, .token_begin = 0, .token_end = 64, .bytes = 4096});
  ticket.lease_deadline = absl::FromUnixMillis(1700000000000);
  ticket.shm_pull = ShmPullOffer{.boot_id = "b0b0",
                                 .acks = {.pid = 12, .fd = 13, .bytes = 800},
                                 .ack_index = 9,
                                 .device_pci_bus_id = kBusId};
  auto compact = DecodeTicket(EncodeTicket(ticket));
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_EQ(*compact, ticket);
  auto proto = TicketFromProto(TicketToProto(ticket, kNow), kNow);
  ASSERT_TRUE(proto.ok()) << proto.status();
  EXPECT_EQ(proto->shm_pull, ticket.shm_pull);
  // A truncated device part, and a bus id over 31 characters in either form.
  std::vector<std::byte> bytes = EncodeTicket(ticket);
  bytes.pop_back();
  EXPECT_FALSE(DecodeTicket(bytes).ok());
  ticket.shm_pull->device_pci_bus_id = std::string(32, '0');
  EXPECT_FALSE(DecodeTicket(EncodeTicket(ticket)).ok());
  EXPECT_FALSE(TicketFromProto(TicketToProto(ticket, kNow), kNow).ok());
}

}  // namespace
}  // namespace pdserve::kv::testing
