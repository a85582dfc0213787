// Several lanes (docs/protocol.md, "Lanes"), in one process over real UCX (tcp and shared
// memory): pages spread over every lane land intact and identical to one lane's; a corrupted page
// on one lane fails only its request with the checksum error; one lane's endpoint dying
// mid-transfer fails that transfer loudly, leaves another sender's request alone, and every page
// is handed back; and the lane address bundle's parser refuses malformed bundles.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/lane_address.h"
#include "kvtransfer/ucx/ucx_lane.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

constexpr uint32_t kPages = 16;

// One decode-side receiver with `lanes` receive lanes over a pool of kPages pages per request,
// and the ticket outcomes and releases it reported.
class LaneHarness {
 public:
  LaneHarness(const std::string& tls, int lanes, uint64_t page_bytes) : page_bytes_(page_bytes) {
    setenv("UCX_TLS", tls.c_str(), 1);
    auto transport = UcxReceiveTransport::Create(lanes);
    EXPECT_TRUE(transport.ok()) << transport.status();
    if (!transport.ok()) return;
    rx_ = transport->get();
    receiver_ = std::make_unique<TransferReceiver>(
        std::move(*transport),
        ReceiverOptions{.lease = absl::Seconds(10), .heartbeat_interval = absl::Seconds(1)}, clock_,
        [this](uint64_t ticket_id, uint64_t, const absl::Status&) {
          absl::MutexLock lock(&mu_);
          released_.push_back(ticket_id);
        });
  }

  // A ticket for `request_id` over pool pages [first, first + kPages).
  Ticket Expect(uint64_t request_id, uint32_t first) {
    if (pool_.size() < first + kPages) pool_.resize(first + kPages);
    for (auto& page : pool_) page.resize(page_bytes_);
    auto ticket = receiver_->Expect(SpecOverPool(pool_, request_id, 1, first, kPages, page_bytes_));
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    return ticket.ok() ? *ticket : Ticket{};
  }

  std::vector<std::vector<std::byte>> Sources(uint64_t seed) const {
    std::vector<std::vector<std::byte>> sources(kPages, std::vector<std::byte>(page_bytes_));
    for (uint32_t slot = 0; slot < kPages; ++slot) FillPattern(sources[slot], seed, slot);
    return sources;
  }

  // Polls `transfers` and the receiver until every transfer is delivered or failed and every
  // ticket in `tickets` is decided, or 20 s pass. Returns each transfer's last Poll status.
  std::vector<absl::Status> Drive(const std::vector<Transfer*>& transfers,
                                  const std::vector<uint64_t>& tickets) {
    std::vector<absl::Status> last(transfers.size());
    std::vector<bool> done(transfers.size(), false);
    const absl::Time until = absl::Now() + absl::Seconds(20);
    while (absl::Now() < until) {
      bool all = true;
      for (size_t i = 0; i < transfers.size(); ++i) {
        if (done[i]) continue;
        absl::StatusOr<bool> polled = transfers[i]->Poll();
        if (!polled.ok()) last[i] = polled.status();
        done[i] = !polled.ok() || *polled;
        all = all && done[i];
      }
      receiver_->Progress();
      for (uint64_t ticket : tickets) {
        auto outcome = receiver_->Outcome(ticket);
        all = all && outcome.ok() && outcome->state != TransferState::kReceiving;
      }
      if (all) break;
    }
    return last;
  }

  // Registers every page of the pool with the receiver's transport (after the last Expect: the
  // pages must not move afterwards).
  absl::Status RegisterPool() {
    for (auto& page : pool_) {
      if (absl::Status s = receiver_->RegisterMemory(page); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  TransferReceiver& receiver() { return *receiver_; }
  UcxReceiveTransport& rx() { return *rx_; }
  FakeClock& clock() { return clock_; }
  const std::vector<std::vector<std::byte>>& pool() const { return pool_; }
  std::vector<uint64_t> released() {
    absl::MutexLock lock(&mu_);
    return released_;
  }

 private:
  const uint64_t page_bytes_;
  FakeClock clock_;
  UcxReceiveTransport* rx_ = nullptr;  // Owned by receiver_.
  std::vector<std::vector<std::byte>> pool_;
  std::unique_ptr<TransferReceiver> receiver_;
  absl::Mutex mu_;
  std::vector<uint64_t> released_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<UcxTransport> MakeSender(int lanes) {
  auto transport = UcxTransport::Create(lanes);
  EXPECT_TRUE(transport.ok()) << transport.status();
  return transport.ok() ? std::move(*transport) : nullptr;
}

std::vector<std::span<const std::byte>> Spans(const std::vector<std::vector<std::byte>>& pages) {
  return {pages.begin(), pages.end()};
}

// Sends one request of kPages pages over `lanes` lanes on both sides and returns the landed pool.
std::vector<std::vector<std::byte>> SendOne(const std::string& tls, int lanes, uint64_t page_bytes,
                                            std::vector<uint64_t>* sent_per_lane,
                                            std::vector<uint64_t>* received_per_lane) {
  LaneHarness harness(tls, lanes, page_bytes);
  auto transport = MakeSender(lanes);
  if (transport == nullptr) return {};
  const Ticket ticket = harness.Expect(1, 0);
  const auto sources = harness.Sources(7);
  TransferSender sender(*transport, harness.clock());
  auto transfer = sender.Prepare(ticket, Spans(sources));
  EXPECT_TRUE(transfer.ok()) << transfer.status();
  if (!transfer.ok()) return {};
  EXPECT_TRUE((*transfer)->PostAll().ok());
  EXPECT_TRUE((*transfer)->Commit(256, 7).ok());
  const auto last = harness.Drive({transfer->get()}, {ticket.ticket_id});
  EXPECT_TRUE(last[0].ok()) << last[0];
  auto outcome = harness.receiver().Outcome(ticket.ticket_id);
  EXPECT_TRUE(outcome.ok() && outcome->state == TransferState::kVerified)
      << (outcome.ok() ? outcome->status.ToString() : outcome.status().ToString());
  EXPECT_TRUE((*transfer)->Release().ok());
  *sent_per_lane = transport->pages_per_lane();
  *received_per_lane = harness.rx().pages_per_lane();
  return harness.pool();
}

class LanesTest : public ::testing::TestWithParam<std::tuple<std::string, int, uint64_t>> {};

TEST_P(LanesTest, PagesSpreadOverEveryLaneLandIntact) {
  const auto& [tls, lanes, page_bytes] = GetParam();
  std::vector<uint64_t> sent;
  std::vector<uint64_t> received;
  const auto pool = SendOne(tls, lanes, page_bytes, &sent, &received);
  ASSERT_EQ(pool.size(), kPages);
  for (uint32_t slot = 0; slot < kPages; ++slot) {
    EXPECT_TRUE(MatchesPattern(pool[slot], 7, slot)) << "slot " << slot;
  }
  // Round-robin: kPages / lanes pages on every lane of the sender, and every receive lane (lane i
  // of the sender connects to lane i of the receiver) got them.
  ASSERT_EQ(sent.size(), static_cast<size_t>(lanes));
  ASSERT_EQ(received.size(), static_cast<size_t>(lanes));
  for (int lane = 0; lane < lanes; ++lane) {
    EXPECT_EQ(sent[lane], kPages / lanes) << "lane " << lane;
    EXPECT_EQ(received[lane], kPages / lanes) << "lane " << lane;
  }
}

INSTANTIATE_TEST_SUITE_P(TransportsLanesPages, LanesTest,
                         ::testing::Combine(::testing::Values("tcp", "shm,self"),
                                            ::testing::Values(1, 2, 4),
                                            ::testing::Values(uint64_t{4096}, uint64_t{256} << 10)),
                         [](const auto& param_info) {
                           std::string tls = std::get<0>(param_info.param);
                           for (char& c : tls) {
                             if (c == ',') c = '_';
                           }
                           return tls + "_lanes" + std::to_string(std::get<1>(param_info.param)) +
                                  "_" + std::to_string(std::get<2>(param_info.param) >> 10) + "KiB";
                         });

TEST(LanesIdentityTest, OneLaneAndFourLanesLandTheSameBytes) {
  std::vector<uint64_t> sent;
  std::vector<uint64_t> received;
  const auto one = SendOne("tcp", 1, 64 << 10, &sent, &received);
  const auto four = SendOne("tcp", 4, 64 << 10, &sent, &received);
  ASSERT_EQ(one.size(), kPages);
  ASSERT_EQ(four.size(), kPages);
  for (uint32_t slot = 0; slot < kPages; ++slot) {
    ASSERT_EQ(one[slot].size(), four[slot].size());
    EXPECT_EQ(std::memcmp(one[slot].data(), four[slot].data(), one[slot].size()), 0)
        << "slot " << slot;
  }
}

// Registered page memory (docs/protocol.md, "Registered page memory"): the sender's sources and
// the receiver's pool registered once with each transport, so every page send and rendezvous
// receive passes a handle; the pages land byte for byte and the request verifies, under the
// protocols of the run (the v2 suite runs it again with UCX_PROTO_ENABLE=y).
class RegisteredPagesTest : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(RegisteredPagesTest, PagesFromAndIntoRegisteredMemoryLandIntact) {
  const auto& [tls, lanes] = GetParam();
  LaneHarness harness(tls, lanes, 64 << 10);
  auto transport = MakeSender(lanes);
  ASSERT_NE(transport, nullptr);
  const Ticket ticket = harness.Expect(1, 0);
  ASSERT_TRUE(harness.RegisterPool().ok());
  const auto sources = harness.Sources(23);
  for (const auto& page : sources) ASSERT_TRUE(transport->RegisterMemory(page).ok());
  EXPECT_EQ(transport->registered_regions(), kPages);
  TransferSender sender(*transport, harness.clock());
  auto transfer = sender.Prepare(ticket, Spans(sources));
  ASSERT_TRUE(transfer.ok()) << transfer.status();
  ASSERT_TRUE((*transfer)->PostAll().ok());
  ASSERT_TRUE((*transfer)->Commit(256, 7).ok());
  const auto last = harness.Drive({transfer->get()}, {ticket.ticket_id});
  EXPECT_TRUE(last[0].ok()) << last[0];
  auto outcome = harness.receiver().Outcome(ticket.ticket_id);
  ASSERT_TRUE(outcome.ok());
  EXPECT_EQ(outcome->state, TransferState::kVerified) << outcome->status;
  EXPECT_TRUE((*transfer)->Release().ok());
  for (uint32_t slot = 0; slot < kPages; ++slot) {
    EXPECT_TRUE(MatchesPattern(harness.pool()[slot], 23, slot)) << "slot " << slot;
  }
}

INSTANTIATE_TEST_SUITE_P(TransportsLanes, RegisteredPagesTest,
                         ::testing::Combine(::testing::Values("tcp", "shm,self"),
                                            ::testing::Values(1, 4)),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) == "tcp" ? "tcp"
                                                                                     : "shm") +
                                  "_lanes" + std::to_string(std::get<1>(param_info.param));
                         });

// Two requests over four lanes; slot 1 of the first rides lane 1 (pages go round-robin from lane
// 0 in post order) and is corrupted in flight. Only that request fails, with the checksum error;
// the other verifies with its bytes intact.
// Two requests over 4 lanes, one page of the first corrupted on its way (after its checksum was
// taken, on the sender's thread or on `checksum_pool`): only that request fails, with the
// checksum error naming the slot; the other lands intact.
void CorruptedPageFailsOnlyItsRequest(TaskPool* checksum_pool) {
  LaneHarness harness("tcp", 4, 64 << 10);
  auto transport = MakeSender(4);
  ASSERT_NE(transport, nullptr);
  const Ticket a = harness.Expect(1, 0);
  const Ticket b = harness.Expect(2, kPages);
  FaultInjectingTransport faulty(*transport, harness.clock());
  faulty.AddRule({.action = FaultRule::Action::kCorruptByte,
                  .slot = 1,
                  .offset = 5,
                  .ticket_id = a.ticket_id});
  const auto sources_a = harness.Sources(11);
  const auto sources_b = harness.Sources(12);
  TransferSender sender(faulty, harness.clock(), {.checksum_pool = checksum_pool});
  auto ta = sender.Prepare(a, Spans(sources_a));
  auto tb = sender.Prepare(b, Spans(sources_b));
  ASSERT_TRUE(ta.ok() && tb.ok());
  ASSERT_TRUE((*ta)->PostAll().ok());
  ASSERT_TRUE((*tb)->PostAll().ok());
  EXPECT_EQ(transport->pages_per_lane(), (std::vector<uint64_t>{8, 8, 8, 8}));
  ASSERT_TRUE((*ta)->Commit(256, 7).ok());
  ASSERT_TRUE((*tb)->Commit(256, 7).ok());
  harness.Drive({ta->get(), tb->get()}, {a.ticket_id, b.ticket_id});

  auto failed = harness.receiver().Outcome(a.ticket_id);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state, TransferState::kFailed);
  EXPECT_EQ(GetIsolationError(failed->status), IsolationError::kChecksum) << failed->status;
  EXPECT_NE(failed->status.message().find("slot 1 "), std::string::npos) << failed->status;
  auto verified = harness.receiver().Outcome(b.ticket_id);
  ASSERT_TRUE(verified.ok());
  EXPECT_EQ(verified->state, TransferState::kVerified) << verified->status;
  for (uint32_t slot = 0; slot < kPages; ++slot) {
    EXPECT_TRUE(MatchesPattern(harness.pool()[kPages + slot], 12, slot)) << "slot " << slot;
  }
  EXPECT_EQ(harness.receiver().stats().isolation_errors.at(IsolationError::kChecksum), 1u);
}

TEST(LanesFaultTest, CorruptedPageOnOneLaneFailsOnlyItsRequest) {
  CorruptedPageFailsOnlyItsRequest(nullptr);
}

// The same with the sender's checksums taken on a pool of threads (the prefill engine's).
TEST(LanesFaultTest, CorruptedPageWithPooledChecksumsFailsOnlyItsRequest) {
  TaskPool pool(4);
  CorruptedPageFailsOnlyItsRequest(&pool);
}

// One lane's endpoint dies while its pages are in flight: the transfer fails loudly
// (Unavailable naming the lane), a request from another prefill worker to the same receiver
// verifies, the failed ticket's pages come back at its lease end, the sender's lanes are idle
// again, and a retry on a fresh connection verifies.
TEST(LanesFaultTest, OneLaneEndpointDyingFailsOnlyThatTransfer) {
  LaneHarness harness("tcp", 4, 256 << 10);
  auto dying = MakeSender(4);
  auto other = MakeSender(4);
  ASSERT_TRUE(dying != nullptr && other != nullptr);
  const Ticket a = harness.Expect(1, 0);
  const Ticket b = harness.Expect(2, kPages);
  const auto sources_a = harness.Sources(21);
  const auto sources_b = harness.Sources(22);
  TransferSender sender_a(*dying, harness.clock());
  TransferSender sender_b(*other, harness.clock());
  auto ta = sender_a.Prepare(a, Spans(sources_a));
  auto tb = sender_b.Prepare(b, Spans(sources_b));
  ASSERT_TRUE(ta.ok() && tb.ok());
  ASSERT_TRUE((*ta)->PostLayer(0).ok());
  ASSERT_TRUE((*tb)->PostAll().ok());
  ASSERT_TRUE((*tb)->Commit(256, 7).ok());
  dying->CloseLaneEndpoint(/*peer=*/1, /*lane=*/2);
  // Layer 1's first page goes to the transport after the lane died: the post fails at once.
  EXPECT_EQ((*ta)->PostLayer(1).code(), absl::StatusCode::kUnavailable);
  const auto last = harness.Drive({ta->get(), tb->get()}, {b.ticket_id});
  EXPECT_EQ(last[0].code(), absl::StatusCode::kUnavailable) << last[0];
  EXPECT_NE(last[0].message().find("lane 2 endpoint closed"), std::string::npos) << last[0];
  EXPECT_TRUE(last[1].ok()) << last[1];
  auto verified = harness.receiver().Outcome(b.ticket_id);
  ASSERT_TRUE(verified.ok());
  EXPECT_EQ(verified->state, TransferState::kVerified) << verified->status;
  for (uint32_t slot = 0; slot < kPages; ++slot) {
    EXPECT_TRUE(MatchesPattern(harness.pool()[kPages + slot], 22, slot)) << "slot " << slot;
  }
  EXPECT_TRUE((*tb)->Release().ok());

  // The failed sender fences nothing (its connection is down); the receiver holds the pages
  // until the lease, then fails the ticket (lease) and hands them back once no landing is in
  // flight (TransferReceiver::Sweep: a page UCX may still write is never handed back). On a
  // 2-core host (2026-12-04) that took 17-20 s after the lease in 3 of 40 runs and 0.01 s in the
  // others, most likely a landing from the dead lane that UCX had not failed yet (not traced).
  // The wait allows 60 s; the 10 s it had failed 1 run in 30 and one fresh-clone `make test`.
  ta->reset();
  harness.clock().Advance(absl::Seconds(11));
  const absl::Time until = absl::Now() + absl::Seconds(60);
  while (harness.released().empty() && absl::Now() < until) {
    harness.receiver().RunFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(harness.released(), std::vector<uint64_t>{a.ticket_id});
  EXPECT_EQ(harness.receiver().stats().tickets_held, 0u);

  // A transient failure is no verdict on the address: the retry gets fresh endpoints.
  const Ticket retry = harness.Expect(3, 0);
  auto tr = sender_a.Prepare(retry, Spans(sources_a));
  ASSERT_TRUE(tr.ok()) << tr.status();
  EXPECT_EQ(dying->endpoints_created(), 2u);
  ASSERT_TRUE((*tr)->PostAll().ok());
  ASSERT_TRUE((*tr)->Commit(256, 7).ok());
  const auto retried = harness.Drive({tr->get()}, {retry.ticket_id});
  EXPECT_TRUE(retried[0].ok()) << retried[0];
  EXPECT_EQ(harness.receiver().Outcome(retry.ticket_id)->state, TransferState::kVerified);
  EXPECT_TRUE((*tr)->Release().ok());
}

TEST(LaneAddressTest, OneAddressIsUnchangedAndABundleRoundTrips) {
  const std::vector<std::byte> plain = {std::byte{0x01}, std::byte{0x22}, std::byte{0x33}};
  EXPECT_EQ(EncodeLaneAddresses(std::vector<std::vector<std::byte>>{plain}), plain);
  EXPECT_EQ(*DecodeLaneAddresses(plain), std::vector<std::vector<std::byte>>{plain});
  const std::vector<std::vector<std::byte>> lanes = {
      plain, {std::byte{0x10}}, {std::byte{0x00}, std::byte{0xFF}}};
  const std::vector<std::byte> bundle = EncodeLaneAddresses(lanes);
  EXPECT_EQ(bundle.size(), 8u + 3 * 4 + 3 + 1 + 2);
  EXPECT_EQ(*DecodeLaneAddresses(bundle), lanes);
}

TEST(LaneAddressTest, MalformedBundlesAreRefused) {
  const std::vector<std::vector<std::byte>> lanes = {{std::byte{0x01}}, {std::byte{0x02}}};
  const std::vector<std::byte> bundle = EncodeLaneAddresses(lanes);
  for (size_t cut = 4; cut < bundle.size(); ++cut) {
    EXPECT_FALSE(DecodeLaneAddresses(std::span(bundle).first(cut)).ok()) << "cut at " << cut;
  }
  std::vector<std::byte> trailing = bundle;
  trailing.push_back(std::byte{0});
  EXPECT_FALSE(DecodeLaneAddresses(trailing).ok());
  std::vector<std::byte> one_lane = bundle;
  one_lane[6] = std::byte{1};
  EXPECT_FALSE(DecodeLaneAddresses(one_lane).ok());
  std::vector<std::byte> too_many = bundle;
  too_many[6] = std::byte{kMaxTransferLanes + 1};
  EXPECT_FALSE(DecodeLaneAddresses(too_many).ok());
  std::vector<std::byte> version = bundle;
  version[4] = std::byte{2};
  EXPECT_FALSE(DecodeLaneAddresses(version).ok());
}

TEST(LaneAddressTest, DefaultLanesFollowTheCores) {
  EXPECT_EQ(DefaultTransferLanes(0), 1);
  EXPECT_EQ(DefaultTransferLanes(2), 1);
  EXPECT_EQ(DefaultTransferLanes(16), 4);
  EXPECT_EQ(DefaultTransferLanes(256), kMaxTransferLanes);
  EXPECT_FALSE(UcxTransport::Create(0).ok());
  EXPECT_FALSE(UcxReceiveTransport::Create(kMaxTransferLanes + 1).ok());
}

TEST(LaneLingerTest, EnvironmentTextIsCheckedAndBounded) {
  EXPECT_EQ(ParseLaneLingerUs(nullptr).value, kDefaultLaneLingerUs);
  EXPECT_TRUE(ParseLaneLingerUs("").warning.empty());
  const kernels::SwitchReading<int64_t> ok = ParseLaneLingerUs("500");
  EXPECT_EQ(ok.value, 500);
  EXPECT_TRUE(ok.warning.empty());
  EXPECT_EQ(ParseLaneLingerUs(" +700 ").value, 700);  // as absl::SimpleAtoi took it
  EXPECT_EQ(ParseLaneLingerUs("10000").value, kMaxLaneLingerUs);
  EXPECT_TRUE(ParseLaneLingerUs("10000").warning.empty());
  // Past the maximum (LLONG_MAX, or past it): clamped, not a lane that never sleeps again.
  for (const char* huge : {"10001", "99999999999999", "9223372036854775807"}) {
    const kernels::SwitchReading<int64_t> clamped = ParseLaneLingerUs(huge);
    EXPECT_EQ(clamped.value, kMaxLaneLingerUs) << huge;
    EXPECT_EQ(clamped.warning,
              absl::StrCat("PDSERVE_LANE_LINGER_US=", huge, " is outside [0, 10000]; using 10000"));
  }
  // Negative: 0, with a warning.
  const kernels::SwitchReading<int64_t> negative = ParseLaneLingerUs("-3");
  EXPECT_EQ(negative.value, 0);
  EXPECT_EQ(negative.warning, "PDSERVE_LANE_LINGER_US=-3 is outside [0, 10000]; using 0");
  // Not a whole number: the default, named in the warning (strtoll read "1e9" as 1 and "abc" as
  // 0 without a word).
  for (const char* bad : {"abc", "1e9", "5.5", "500us", "99999999999999999999"}) {
    const kernels::SwitchReading<int64_t> refused = ParseLaneLingerUs(bad);
    EXPECT_EQ(refused.value, kDefaultLaneLingerUs) << bad;
    EXPECT_EQ(refused.warning, absl::StrCat("PDSERVE_LANE_LINGER_US='", bad,
                                            "' is not accepted (accepted: a whole number in [0, "
                                            "10000]); ignored, using the default, 0"));
  }
}

}  // namespace
}  // namespace pdserve::kv::testing
