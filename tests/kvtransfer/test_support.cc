#include "tests/kvtransfer/test_support.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pdserve::kv::testing {
namespace {

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

void FillPattern(std::span<std::byte> page, uint64_t seed, uint32_t slot) {
  uint64_t state = seed * 1'000'003 + slot;
  for (size_t i = 0; i < page.size(); i += 8) {
    const uint64_t word = SplitMix(state);
    for (size_t b = 0; b < 8 && i + b < page.size(); ++b) {
      page[i + b] = static_cast<std::byte>(word >> (8 * b));
    }
  }
}

bool MatchesPattern(std::span<const std::byte> page, uint64_t seed, uint32_t slot) {
  std::vector<std::byte> expected(page.size());
  FillPattern(expected, seed, slot);
  return std::memcmp(expected.data(), page.data(), page.size()) == 0;
}

std::vector<PageDescriptor> MakeDescriptors(uint32_t num_pages, uint32_t num_layers,
                                            uint64_t page_bytes) {
  std::vector<PageDescriptor> pages;
  const uint32_t per_layer = (num_pages + num_layers - 1) / num_layers;
  for (uint32_t i = 0; i < num_pages; ++i) {
    const uint32_t index = i % per_layer;
    pages.push_back({.layer = i / per_layer,
                     .page_index = index,
                     .token_begin = index * 64,
                     .token_end = (index + 1) * 64,
                     .bytes = page_bytes});
  }
  return pages;
}

ReceiveSpec SpecOverPool(std::vector<std::vector<std::byte>>& pool, uint64_t request_id,
                         uint64_t epoch, uint32_t first, uint32_t count, uint64_t page_bytes) {
  ReceiveSpec spec{
      .request_id = request_id, .epoch = epoch, .pages = MakeDescriptors(count, 2, page_bytes)};
  for (uint32_t i = 0; i < count; ++i) {
    spec.destinations.push_back(std::span(pool[first + i]).first(page_bytes));
  }
  return spec;
}

PageHeader HeaderFor(const Ticket& ticket, uint32_t slot, uint64_t checksum,
                     serving::ElementType element) {
  return SlotHeader(ticket, slot, element, checksum);
}

std::string ToHex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (std::byte b : bytes) {
    hex += kDigits[static_cast<unsigned>(b) >> 4];
    hex += kDigits[static_cast<unsigned>(b) & 15];
  }
  return hex;
}

std::vector<std::byte> FromHex(const std::string& hex) {
  std::vector<std::byte> bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<std::byte>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<PeerProcess>> PeerProcess::Start(
    const std::vector<std::string>& argv, const std::vector<std::string>& env_overrides) {
  int to_child[2];
  int from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) {
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // A test binary that is killed (timeout, SIGKILL, a debugger) takes its peers with it instead
    // of leaving worker processes that hold ports and CPU for the next tests.
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(1);
    dup2(to_child[0], STDIN_FILENO);
    dup2(from_child[1], STDOUT_FILENO);
    close(to_child[0]);
    close(to_child[1]);
    close(from_child[0]);
    close(from_child[1]);
    for (const std::string& setting : env_overrides) {
      const size_t eq = setting.find('=');
      setenv(setting.substr(0, eq).c_str(), setting.substr(eq + 1).c_str(), 1);
    }
    std::vector<char*> args;
    for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  return std::unique_ptr<PeerProcess>(new PeerProcess(pid, to_child[1], from_child[0]));
}

PeerProcess::~PeerProcess() {
  Kill();
  close(in_fd_);
  close(out_fd_);
}

void PeerProcess::Kill() {
  if (reaped_) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  reaped_ = true;
}

absl::Status PeerProcess::WriteLine(const std::string& line) {
  const std::string data = line + "\n";
  if (write(in_fd_, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
    return absl::UnavailableError(absl::StrCat("write to peer: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> PeerProcess::ReadLine(absl::Duration timeout) {
  const absl::Time until = absl::Now() + timeout;
  while (true) {
    const size_t newline = buffered_.find('\n');
    if (newline != std::string::npos) {
      std::string line = buffered_.substr(0, newline);
      buffered_.erase(0, newline + 1);
      return line;
    }
    const absl::Duration left = until - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("no line from peer");
    pollfd pfd{out_fd_, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(out_fd_, chunk, sizeof(chunk));
    if (n <= 0) return absl::UnavailableError("peer closed its output");
    buffered_.append(chunk, static_cast<size_t>(n));
  }
}

TransferOutcome RunUntilDecided(TransferReceiver& receiver, FakeClock& clock, uint64_t ticket_id,
                                Transfer* transfer, absl::StatusOr<bool>* last_poll) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (int i = 0; i < 32; ++i) {
      if (transfer != nullptr) *last_poll = transfer->Poll();
      receiver.Progress();
      auto outcome = receiver.Outcome(ticket_id);
      if (!outcome.ok()) return {TransferState::kFailed, outcome.status(), std::nullopt};
      if (outcome->state != TransferState::kReceiving) return *outcome;
    }
    clock.Advance(absl::Seconds(1));
  }
  return {TransferState::kReceiving, absl::DeadlineExceededError("undecided"), std::nullopt};
}

absl::StatusOr<ShmPullParts> MakeShmPullParts(uint64_t ack_words, size_t region_bytes) {
  ShmPullParts parts;
  auto acks = shm::AckTable::Create(ack_words);
  if (!acks.ok()) return acks.status();
  parts.acks = std::move(*acks);
  auto region = shm::SharedRegion::Create(shm::kPagesPurpose, region_bytes);
  if (!region.ok()) return region.status();
  parts.region = std::move(*region);
  auto pull = shm::PullSender::Create(*parts.region);
  if (!pull.ok()) return pull.status();
  parts.pull = std::move(*pull);
  return parts;
}

std::unique_ptr<TransferReceiver> MakePullReceiver(std::unique_ptr<ReceiveTransport> end,
                                                   shm::AckTable* acks, const Clock& clock,
                                                   std::vector<uint64_t>* released) {
  return std::make_unique<TransferReceiver>(
      std::move(end),
      ReceiverOptions{.lease = absl::Seconds(10),
                      .heartbeat_interval = absl::Seconds(1),
                      .missing_grace = absl::Milliseconds(200),
                      .incarnation = 1,
                      .acks = acks},
      clock, [released](uint64_t ticket_id, uint64_t, const absl::Status&) {
        released->push_back(ticket_id);
      });
}

}  // namespace pdserve::kv::testing
