// Shared pieces of the kvtransfer tests and their peer binary: deterministic page contents, a
// hand-moved clock, hex coding of tickets, and a child process driven over pipes.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/shm/shared_memory.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"

namespace pdserve::kv::testing {

// Fills `page` with bytes determined by (seed, slot): a different request or slot gives
// different bytes, so a page that landed in the wrong place or stale is visible.
void FillPattern(std::span<std::byte> page, uint64_t seed, uint32_t slot);
bool MatchesPattern(std::span<const std::byte> page, uint64_t seed, uint32_t slot);

// `num_pages` descriptors of `page_bytes` each over `num_layers` layers, layer-major.
std::vector<PageDescriptor> MakeDescriptors(uint32_t num_pages, uint32_t num_layers,
                                            uint64_t page_bytes);

// A receive spec for `request_id` over `pool` pages [first, first + count), `page_bytes` of each,
// with MakeDescriptors(count, 2, page_bytes).
ReceiveSpec SpecOverPool(std::vector<std::vector<std::byte>>& pool, uint64_t request_id,
                         uint64_t epoch, uint32_t first, uint32_t count, uint64_t page_bytes);

// The true header of `ticket`'s page `slot` with `checksum`, its payload in `element`.
PageHeader HeaderFor(const Ticket& ticket, uint32_t slot, uint64_t checksum,
                     serving::ElementType element = serving::ElementType::kFloat32);

std::string ToHex(std::span<const std::byte> bytes);
std::vector<std::byte> FromHex(const std::string& hex);

class FakeClock final : public Clock {
 public:
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::Now();  // Tickets carry wall-clock deadlines to other processes.
};

// A decode worker's ack table of `ack_words` words and a prefill worker's page region of
// `region_bytes` with its PullSender: what every shm-pull test sets up. Errors: their Create's.
struct ShmPullParts {
  std::unique_ptr<shm::AckTable> acks;
  std::unique_ptr<shm::SharedRegion> region;
  std::unique_ptr<shm::PullSender> pull;
};
absl::StatusOr<ShmPullParts> MakeShmPullParts(uint64_t ack_words, size_t region_bytes);

// The shm-pull tests' receiver over `end` (lease 10 s, heartbeats 1 s, grace 200 ms, ack table
// `acks`) on `clock`, each released ticket appended to `released`.
std::unique_ptr<TransferReceiver> MakePullReceiver(std::unique_ptr<ReceiveTransport> end,
                                                   shm::AckTable* acks, const Clock& clock,
                                                   std::vector<uint64_t>* released);

// Polls `transfer` (when not null) and progresses `receiver` until ticket `ticket_id` is decided:
// 32 rounds, then the clock one second on, twice. Returns the outcome (kReceiving with
// DeadlineExceeded "undecided" when it was not); `last_poll` gets the transfer's last Poll().
TransferOutcome RunUntilDecided(TransferReceiver& receiver, FakeClock& clock, uint64_t ticket_id,
                                Transfer* transfer, absl::StatusOr<bool>* last_poll);

// A child process running `argv` with `env_overrides` ("NAME=value") added, its stdin and stdout
// connected to us. The destructor kills (SIGKILL) and reaps it.
class PeerProcess {
 public:
  static absl::StatusOr<std::unique_ptr<PeerProcess>> Start(
      const std::vector<std::string>& argv, const std::vector<std::string>& env_overrides);
  ~PeerProcess();

  absl::Status WriteLine(const std::string& line);
  // The next line, or DeadlineExceeded after `timeout`, or Unavailable at end of file.
  absl::StatusOr<std::string> ReadLine(absl::Duration timeout);
  void Kill();
  pid_t pid() const { return pid_; }

 private:
  PeerProcess(pid_t pid, int in_fd, int out_fd) : pid_(pid), in_fd_(in_fd), out_fd_(out_fd) {}
  pid_t pid_;
  int in_fd_;
  int out_fd_;
  std::string buffered_;
  bool reaped_ = false;
};

}  // namespace pdserve::kv::testing
