// The loopback soak's driver (loopback_soak_test.cc): one receiver on a small PagePool, one
// sender, a fake clock, fault injection on both sides, and requests that come and go at random.
// Deterministic for a given seed.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kvtransfer/fault_receive_transport.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/loopback_transport.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "serving/page_pool.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {

enum class SoakFault {
  kNone,
  kFlippedByte,       // -> kChecksum
  kDropped,           // -> kMissing
  kDuplicated,        // -> kDuplicate
  kReorderedInGrace,  // A page shown after the commit, inside the grace -> verified
  kReorderedLate,     // ... past the grace -> kMissing; the late page is refused
  kForeign,           // A page naming a ticket or request not its own -> kHeader
  kStaleEpoch,        // A page of an older epoch of the pages -> kEpoch
  kAborted,           // Aborted mid-transfer, the sender fences; the pages are reused at once
  kSilent,            // The sender goes silent (no page, heartbeat or fence) -> kLease
};
inline constexpr int kNumSoakFaults = 10;
const char* SoakFaultName(SoakFault fault);

struct SoakCounts {
  uint64_t events = 0;
  uint64_t finished = 0;
  std::array<uint64_t, kNumSoakFaults> by_fault{};
  std::array<uint64_t, kNumSoakFaults> receive_side{};  // Injected at the receiver.
  uint64_t reused_at_once = 0;  // Aborted requests whose pages went to the next request at once.
  uint64_t page_checks = 0;
  std::string Summary() const;
};

class SoakDriver {
 public:
  explicit SoakDriver(uint64_t seed);
  ~SoakDriver();

  // Runs until `requests` requests finished. Errors: Internal naming the first broken rule.
  absl::Status Run(uint64_t requests);
  const SoakCounts& counts() const { return counts_; }

 private:
  struct Request;

  // A new request for `demand` pages (random when nullopt). ResourceExhausted when they are
  // not free.
  absl::Status Start(std::optional<serving::PageDemand> demand = std::nullopt);
  void InjectFault(Request& request);
  absl::Status Step();
  absl::Status Finish(Request& request);
  // Every pool page against its owner (see loopback_soak_test.cc).
  absl::Status CheckPages();
  absl::Status CheckOutcome(const Request& request) const;

  std::mt19937_64 rng_;
  FakeClock clock_;
  LoopbackNetwork network_{LoopbackOptions{.rendezvous_bytes = 512}};
  std::unique_ptr<serving::PagePool> pool_;
  std::vector<std::span<std::byte>> page_bytes_;           // Every pool page, by index.
  std::map<uint64_t, std::unique_ptr<Request>> requests_;  // Live, by request id.
  std::map<uint64_t, uint64_t> by_ticket_;
  std::vector<uint64_t> released_;  // Tickets on_release returned, not yet handled.
  FaultInjectingReceiveTransport* receive_faults_ = nullptr;
  std::unique_ptr<TransferReceiver> receiver_;
  std::unique_ptr<PageTransport> send_end_;
  std::unique_ptr<FaultInjectingTransport> send_faults_;
  std::unique_ptr<TransferSender> sender_;
  uint64_t next_request_ = 1;
  uint64_t started_ = 0;
  uint64_t target_ = 0;
  SoakCounts counts_;
};

}  // namespace pdserve::kv::testing
