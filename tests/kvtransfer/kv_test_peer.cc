// The other process of the kvtransfer process tests, driven over stdin / stdout.
//
//   kv_test_peer send [v1|v2]  reads commands, one per line (v1 / v2: UCX's protocols, ucx.h):
//       send <seed> <ticket hex> [fault...]   writes the ticket's pages (FillPattern(seed, slot)),
//                                             commits, prints "done <ticket> OK" or
//                                             "done <ticket> <code> <message>"
//       abort                                 destroys the transfer in progress (the fence),
//                                             prints "aborted <ticket>"
//     faults: corrupt:S drop:S dup:S epoch:S:V ticket:S:V delayfrom:S:MS (slots >= S held MS)
//   kv_test_peer recv <pages> <page bytes>    expects one request, prints "ticket <hex>", then
//                                             "landed <n>" whenever more pages landed
// Transports come from UCX_TLS in the environment.
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::kv::testing {
namespace {

void Say(const std::string& line) { std::cout << line << std::endl; }

bool StdinReadable() {
  pollfd pfd{STDIN_FILENO, POLLIN, 0};
  return poll(&pfd, 1, 0) > 0;
}

void AddFault(FaultInjectingTransport& faults, const std::string& spec, size_t num_pages) {
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  const uint32_t slot = static_cast<uint32_t>(std::stoul(parts[1]));
  FaultRule rule;
  rule.slot = slot;
  if (parts[0] == "corrupt") {
    rule.action = FaultRule::Action::kCorruptByte;
    rule.offset = 4097;
  } else if (parts[0] == "drop") {
    rule.action = FaultRule::Action::kDrop;
  } else if (parts[0] == "dup") {
    rule.action = FaultRule::Action::kDuplicate;
  } else if (parts[0] == "epoch" || parts[0] == "ticket") {
    const uint64_t value = std::stoull(parts[2]);
    const bool epoch = parts[0] == "epoch";
    rule.action = FaultRule::Action::kRewriteHeader;
    rule.rewrite = [value, epoch](PageHeader& header) {
      (epoch ? header.epoch : header.ticket_id) = value;
    };
  } else if (parts[0] == "delayfrom") {
    for (uint32_t s = slot; s < num_pages; ++s) {
      faults.AddRule({.action = FaultRule::Action::kDelay,
                      .slot = s,
                      .delay = absl::Milliseconds(std::stoll(parts[2]))});
    }
    return;
  }
  faults.AddRule(std::move(rule));
}

// One transfer in progress with the buffers and fault wrapper it borrows.
struct Job {
  std::vector<std::vector<std::byte>> buffers;
  std::unique_ptr<FaultInjectingTransport> faults;
  std::unique_ptr<TransferSender> sender;
  std::unique_ptr<Transfer> transfer;
  uint64_t ticket_id = 0;
};

int RunSender(UcxProtocols protocols) {
  SystemClock clock;
  auto transport = UcxTransport::Create(1, true, protocols);
  if (!transport.ok()) {
    Say("error " + transport.status().ToString());
    return 1;
  }
  Say("ready");
  std::unique_ptr<Job> job;
  while (true) {
    if (job != nullptr && job->transfer != nullptr) {
      absl::StatusOr<bool> done = job->transfer->Poll();
      if (!done.ok() || *done) {
        Say(absl::StrCat("done ", job->ticket_id, " ",
                         done.ok() ? "OK" : absl::StatusCodeToString(done.status().code()), " ",
                         done.ok() ? "" : std::string(done.status().message())));
        if (done.ok()) job->transfer->Release().IgnoreError();  // Delivered: nothing to fence.
        job.reset();
      }
    } else {
      (*transport)->Progress();
      usleep(200);
    }
    if (!StdinReadable()) continue;
    std::string line;
    if (!std::getline(std::cin, line)) return 0;
    std::istringstream words(line);
    std::string command;
    words >> command;
    if (command == "abort") {
      const uint64_t id = job != nullptr ? job->ticket_id : 0;
      job.reset();
      Say(absl::StrCat("aborted ", id));
      continue;
    }
    uint64_t seed = 0;
    std::string hex;
    words >> seed >> hex;
    auto ticket = DecodeTicket(FromHex(hex));
    if (!ticket.ok()) {
      Say("error " + ticket.status().ToString());
      continue;
    }
    job = std::make_unique<Job>();
    job->ticket_id = ticket->ticket_id;
    job->faults = std::make_unique<FaultInjectingTransport>(**transport, clock);
    std::string fault;
    while (words >> fault) AddFault(*job->faults, fault, ticket->pages.size());
    std::vector<std::span<const std::byte>> sources;
    for (uint32_t slot = 0; slot < ticket->pages.size(); ++slot) {
      job->buffers.emplace_back(ticket->pages[slot].bytes);
      FillPattern(job->buffers.back(), seed, slot);
      sources.push_back(job->buffers.back());
    }
    job->sender = std::make_unique<TransferSender>(*job->faults, clock);
    auto transfer = job->sender->Prepare(*ticket, std::move(sources));
    absl::Status status = transfer.status();
    if (status.ok()) {
      job->transfer = std::move(*transfer);
      status = job->transfer->PostAll();
    }
    if (status.ok()) {
      status = job->transfer->Commit(static_cast<int32_t>(ticket->pages.size() * 64),
                                     static_cast<int32_t>(seed % 1000));
    }
    if (!status.ok()) {
      Say(absl::StrCat("done ", job->ticket_id, " ", absl::StatusCodeToString(status.code()), " ",
                       status.message()));
      job.reset();
    }
  }
}

int RunReceiver(uint32_t num_pages, uint64_t page_bytes) {
  SystemClock clock;
  auto receiver = CreateUcxReceiver({.incarnation = static_cast<uint64_t>(getpid())}, clock,
                                    [](uint64_t, uint64_t, const absl::Status&) {});
  if (!receiver.ok()) {
    Say("error " + receiver.status().ToString());
    return 1;
  }
  std::vector<std::vector<std::byte>> pages(num_pages, std::vector<std::byte>(page_bytes));
  ReceiveSpec spec{.request_id = 1, .epoch = 1, .pages = MakeDescriptors(num_pages, 2, page_bytes)};
  for (auto& page : pages) spec.destinations.push_back(page);
  auto ticket = (*receiver)->Expect(std::move(spec));
  if (!ticket.ok()) {
    Say("error " + ticket.status().ToString());
    return 1;
  }
  Say("ticket " + ToHex(EncodeTicket(*ticket)));
  uint64_t reported = 0;
  while (true) {
    (*receiver)->RunFor(absl::Milliseconds(5));
    const uint64_t landed = (*receiver)->stats().pages_landed;
    if (landed != reported) {
      reported = landed;
      Say(absl::StrCat("landed ", landed));
    }
  }
}

}  // namespace
}  // namespace pdserve::kv::testing

int main(int argc, char** argv) {
  const std::string role = argc > 1 ? argv[1] : "";
  if (role == "send" && argc <= 3) {
    auto protocols = pdserve::kv::ParseUcxProtocols(argc == 3 ? argv[2] : "v1");
    if (protocols.ok()) return pdserve::kv::testing::RunSender(*protocols);
  }
  if (role == "recv" && argc == 4) {
    return pdserve::kv::testing::RunReceiver(static_cast<uint32_t>(std::stoul(argv[2])),
                                             std::stoull(argv[3]));
  }
  std::fprintf(stderr, "usage: kv_test_peer send [v1|v2] | recv <pages> <page bytes>\n");
  return 2;
}
