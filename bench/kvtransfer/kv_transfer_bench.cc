// Transfer bandwidth between two processes over loopback UCX (transport from UCX_TLS).
//
//   kv_transfer_bench <mode> <total MiB> <page KiB> <iterations> [lanes] [checksum threads]
//   mode: pdserve  the full protocol: headers, xxh3 on both sides, commit and verification;
//                  timed from the sender's first post to the receiver's verified outcome;
//                  `lanes` (default 1) UCX workers, endpoints and threads on each side
//                  (docs/protocol.md, "Lanes"); `checksum threads` (default 0: none) a
//                  SenderOptions::checksum_pool of that many threads, as the CUDA prefill
//                  uses, and the window InFlightBytesForLanes(lanes); also prints where the
//                  sender's time went (medians): "post" (the PostLayer calls: checksums and the
//                  sends handed over), "drain" (the Poll loop after the last post, to the
//                  delivered commit)
//                  UCX's protocols: UCX_PROTO_ENABLE in the environment (v1 when unset)
//         am | tag | put  raw ucp_am_send_nbx (receiver lands with ucp_am_recv_data_nbx) /
//                  ucp_tag_send_nbx into pre-posted receives / ucp_put_nbx + flush into
//                  registered memory; timed on the sender from the first post to completion
//         am-hot   raw AM as `am`, but every message is sent from and lands in one page-sized
//                  buffer on each side, as ucx_perftest does: the buffers stay in cache, so this
//                  separates how we drive UCX from what moving distinct memory costs
//         memcpy   one process copies the total, page by page, between two distinct buffers: the
//                  machine's single-core memory-copy bound for distinct pages (no UCX)
// Raw modes connect as pdserve does: with peer error handling where UCX allows it (tcp), without
// it where UCX 1.13 refuses it (shared memory alone).
// Prints one line per iteration and "best <GB/s> median <GB/s>" (GB = 1e9 bytes).
// The receiver is the parent, the sender a forked child (fork happens before UCX starts).
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/task_pool.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucs_status.h"
#include "kvtransfer/ucx/ucx.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"

namespace pdserve::kv {
namespace {

struct Config {
  std::string mode;
  uint64_t total_bytes = 0;
  uint64_t page_bytes = 0;
  int iterations = 0;
  int lanes = 1;             // pdserve mode only
  int checksum_threads = 0;  // pdserve mode only
  uint64_t pages() const { return total_bytes / page_bytes; }
  bool hot() const { return mode == "am-hot"; }
  // Where page p lives in a buffer of buffer_bytes(): its own place, or the one hot page.
  uint64_t offset(uint64_t page) const { return hot() ? 0 : page * page_bytes; }
  uint64_t buffer_bytes() const { return hot() ? page_bytes : total_bytes; }
};

// CLOCK_MONOTONIC is one clock for both processes of the machine.
int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000ll + ts.tv_nsec;
}

void Die(const absl::Status& status) {
  std::fprintf(stderr, "kv_transfer_bench: %s\n", status.ToString().c_str());
  std::exit(1);
}

// A line-oriented pipe between the two processes (unbuffered reads, so Ready() is exact).
class Channel {
 public:
  Channel(int read_fd, int write_fd) : read_fd_(read_fd), write_fd_(write_fd) {}
  void Write(const std::string& line) {
    const std::string data = line + "\n";
    if (write(write_fd_, data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
      Die(absl::UnavailableError("pipe write"));
    }
  }
  std::string Read() {
    std::string line;
    char c;
    while (read(read_fd_, &c, 1) == 1 && c != '\n') line += c;
    return line;
  }
  bool Ready() const {
    pollfd pfd{read_fd_, POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;
  }

 private:
  int read_fd_;
  int write_fd_;
};

std::string Hex(std::span<const std::byte> bytes) {
  std::string out;
  for (std::byte b : bytes)
    out += absl::StrCat(absl::Hex(static_cast<unsigned>(b), absl::kZeroPad2));
  return out;
}
std::vector<std::byte> Unhex(const std::string& hex) {
  std::vector<std::byte> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoul(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

void Report(const Config& config, std::vector<double> seconds) {
  std::vector<double> gbps;
  for (double s : seconds) gbps.push_back(static_cast<double>(config.total_bytes) / s / 1e9);
  for (size_t i = 0; i < gbps.size(); ++i) std::printf("iteration %zu %.3f GB/s\n", i, gbps[i]);
  std::sort(gbps.begin(), gbps.end());
  std::printf("best %.3f median %.3f\n", gbps.back(), gbps[gbps.size() / 2]);
}

// ---- memory-copy bound -------------------------------------------------------------------------

void MemcpyBound(const Config& config) {
  std::vector<std::byte> source(config.total_bytes, std::byte{0x5A});
  std::vector<std::byte> destination(config.total_bytes);
  std::vector<double> seconds;
  for (int it = 0; it < config.iterations; ++it) {
    const int64_t start = NowNs();
    for (uint64_t p = 0; p < config.pages(); ++p) {
      std::memcpy(destination.data() + p * config.page_bytes, source.data() + p * config.page_bytes,
                  config.page_bytes);
    }
    seconds.push_back(static_cast<double>(NowNs() - start) / 1e9);
  }
  Report(config, seconds);
}

// ---- pdserve protocol -------------------------------------------------------------------------

void PdserveReceiver(const Config& config, Channel& channel) {
  SystemClock clock;
  auto receiver = CreateUcxReceiver(
      {.lease = absl::Seconds(60)}, clock, [](auto, auto, const auto&) {}, nullptr, config.lanes);
  if (!receiver.ok()) Die(receiver.status());
  std::vector<std::byte> pool(config.total_bytes);
  if (absl::Status s = (*receiver)->RegisterMemory(pool); !s.ok()) Die(s);
  std::vector<double> seconds;
  std::vector<double> post_ms;
  std::vector<double> drain_ms;
  for (int it = 0; it < config.iterations; ++it) {
    ReceiveSpec spec{.request_id = static_cast<uint64_t>(it + 1), .epoch = 1};
    for (uint64_t p = 0; p < config.pages(); ++p) {
      spec.pages.push_back({.layer = static_cast<uint32_t>(p % 61),
                            .page_index = static_cast<uint32_t>(p / 61),
                            .bytes = config.page_bytes});
      spec.destinations.push_back(
          std::span(pool).subspan(p * config.page_bytes, config.page_bytes));
    }
    auto ticket = (*receiver)->Expect(std::move(spec));
    if (!ticket.ok()) Die(ticket.status());
    channel.Write(Hex(EncodeTicket(*ticket)));
    while ((*receiver)->Outcome(ticket->ticket_id)->state == TransferState::kReceiving) {
      // One lane: this thread drives the worker. Several: the lane threads land the pages and
      // this one only looks for the outcome, leaving them the receiver's lock.
      if (config.lanes == 1) {
        (*receiver)->Progress();
      } else {
        absl::SleepFor(absl::Microseconds(50));
      }
    }
    const int64_t end = NowNs();
    auto outcome = (*receiver)->Outcome(ticket->ticket_id);
    if (outcome->state != TransferState::kVerified) Die(outcome->status);
    // "<start ns> <post ns> <drain ns>" from the sender.
    const std::vector<std::string> times = absl::StrSplit(channel.Read(), ' ');
    seconds.push_back(static_cast<double>(end - std::stoll(times[0])) / 1e9);
    post_ms.push_back(static_cast<double>(std::stoll(times[1])) / 1e6);
    drain_ms.push_back(static_cast<double>(std::stoll(times[2])) / 1e6);
  }
  Report(config, seconds);
  std::sort(post_ms.begin(), post_ms.end());
  std::sort(drain_ms.begin(), drain_ms.end());
  std::printf("sender median ms: post %.2f drain %.2f\n", post_ms[post_ms.size() / 2],
              drain_ms[drain_ms.size() / 2]);
}

void PdserveSender(const Config& config, Channel& channel) {
  SystemClock clock;
  auto transport = UcxTransport::Create(config.lanes);
  if (!transport.ok()) Die(transport.status());
  std::vector<std::byte> source(config.total_bytes, std::byte{0x5A});
  std::unique_ptr<TaskPool> pool;
  SenderOptions options;
  if (config.checksum_threads > 0) {
    pool = std::make_unique<TaskPool>(config.checksum_threads);
    options.checksum_pool = pool.get();
    options.max_in_flight_bytes = InFlightBytesForLanes(config.lanes);
  }
  TransferSender sender(**transport, clock, options);
  for (int it = 0; it < config.iterations; ++it) {
    auto ticket = DecodeTicket(Unhex(channel.Read()));
    if (!ticket.ok()) Die(ticket.status());
    std::vector<std::span<const std::byte>> pages;
    for (uint64_t p = 0; p < config.pages(); ++p) {
      pages.push_back(std::span(source).subspan(p * config.page_bytes, config.page_bytes));
    }
    const int64_t start = NowNs();
    auto transfer = sender.Prepare(*ticket, std::move(pages));
    if (!transfer.ok()) Die(transfer.status());
    // Post layer by layer, as a prefill worker does while it computes the next layer.
    int64_t post_ns = 0;
    for (uint32_t layer = 0; layer < 61; ++layer) {
      const int64_t post_start = NowNs();
      if (absl::Status s = (*transfer)->PostLayer(layer); !s.ok()) Die(s);
      post_ns += NowNs() - post_start;
      if (absl::StatusOr<bool> done = (*transfer)->Poll(); !done.ok()) Die(done.status());
    }
    const int64_t drain_start = NowNs();
    if (absl::Status s = (*transfer)->Commit(1, 1); !s.ok()) Die(s);
    absl::StatusOr<bool> done = false;
    while (done.ok() && !*done) done = (*transfer)->Poll();
    if (!done.ok()) Die(done.status());
    const int64_t drain_ns = NowNs() - drain_start;
    if (absl::Status s = (*transfer)->Release(); !s.ok()) Die(s);
    channel.Write(absl::StrCat(start, " ", post_ns, " ", drain_ns));
  }
}

// ---- raw UCX operations -----------------------------------------------------------------------

constexpr unsigned kRawAmId = 9;

struct RawAmState {
  UcxWorker* worker;
  std::byte* pool;
  const Config* config;
  uint64_t landed = 0;
};

void OnRawLanded(void* request, ucs_status_t, size_t, void* user_data) {
  ++static_cast<RawAmState*>(user_data)->landed;
  ucp_request_free(request);
}

ucs_status_t OnRawAm(void* arg, const void* header, size_t, void* data, size_t length,
                     const ucp_am_recv_param_t* param) {
  auto* state = static_cast<RawAmState*>(arg);
  uint64_t page = 0;
  std::memcpy(&page, header, sizeof(page));
  std::byte* destination = state->pool + state->config->offset(page);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    std::memcpy(destination, data, length);
    ++state->landed;
    return UCS_OK;
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  rp.cb.recv_am = &OnRawLanded;
  rp.user_data = state;
  ucp_am_recv_data_nbx(state->worker->get(), data, destination, length, &rp);
  return UCS_OK;
}

void RawReceiver(const Config& config, Channel& channel) {
  auto context = UcxContext::Create();
  if (!context.ok()) Die(context.status());
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) Die(worker.status());
  std::vector<std::byte> pool(config.buffer_bytes());
  auto memory = UcxMemory::Register(*context, pool.data(), pool.size());
  if (!memory.ok()) Die(memory.status());
  auto rkey = memory->PackRemoteKey();
  if (!rkey.ok()) Die(rkey.status());
  RawAmState am{&*worker, pool.data(), &config};
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  handler.id = kRawAmId;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = &OnRawAm;
  handler.arg = &am;
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker->get(), &handler); s != UCS_OK) {
    Die(UcsToStatus(s, "set_am_recv_handler"));
  }
  channel.Write(absl::StrCat(Hex(worker->address()), " ", Hex(*rkey), " ",
                             reinterpret_cast<uintptr_t>(pool.data())));
  for (int it = 0; it < config.iterations; ++it) {
    std::vector<ucs_status_ptr_t> receives;
    if (config.mode == "tag") {
      for (uint64_t p = 0; p < config.pages(); ++p) {
        ucp_request_param_t rp{};
        receives.push_back(ucp_tag_recv_nbx(worker->get(), pool.data() + p * config.page_bytes,
                                            config.page_bytes, p, ~ucp_tag_t{0}, &rp));
      }
    }
    channel.Write("go");
    while (!channel.Ready()) worker->Progress();  // Rendezvous and emulated put need us.
    channel.Read();                               // "done": the sender timed itself.
    for (ucs_status_ptr_t request : receives) {
      if (absl::Status s = WaitRequest(*worker, request, "tag receive"); !s.ok()) Die(s);
    }
    channel.Write("next");
    while (config.mode != "tag" && config.mode != "put" && am.landed < config.pages() * (it + 1))
      worker->Progress();
  }
  while (!channel.Ready()) worker->Progress();  // Up until the sender's report is written.
  channel.Read();
}

void RawSender(const Config& config, Channel& channel) {
  auto context = UcxContext::Create();
  if (!context.ok()) Die(context.status());
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) Die(worker.status());
  const std::string hello = channel.Read();
  const size_t s1 = hello.find(' ');
  const size_t s2 = hello.find(' ', s1 + 1);
  const std::vector<std::byte> address = Unhex(hello.substr(0, s1));
  auto endpoint = UcxEndpoint::Create(*worker, address, true, nullptr);
  if (!endpoint.ok()) endpoint = UcxEndpoint::Create(*worker, address, false, nullptr);
  if (!endpoint.ok()) Die(endpoint.status());
  auto rkey = UcxRemoteKey::Unpack(**endpoint, Unhex(hello.substr(s1 + 1, s2 - s1 - 1)));
  if (!rkey.ok()) Die(rkey.status());
  const uint64_t remote_base = std::stoull(hello.substr(s2 + 1));
  std::vector<std::byte> source(config.buffer_bytes(), std::byte{0x5A});
  std::vector<double> seconds;
  for (int it = 0; it < config.iterations; ++it) {
    channel.Read();  // "go": receives are posted.
    const int64_t start = NowNs();
    std::vector<ucs_status_ptr_t> sends;
    std::vector<uint64_t> headers(config.pages());
    for (uint64_t p = 0; p < config.pages(); ++p) {
      ucp_request_param_t rp{};
      std::byte* data = source.data() + config.offset(p);
      headers[p] = p;
      if (config.mode == "put") {
        sends.push_back(ucp_put_nbx((*endpoint)->get(), data, config.page_bytes,
                                    remote_base + p * config.page_bytes, rkey->get(), &rp));
      } else if (config.mode == "tag") {
        sends.push_back(ucp_tag_send_nbx((*endpoint)->get(), data, config.page_bytes, p, &rp));
      } else {
        sends.push_back(ucp_am_send_nbx((*endpoint)->get(), kRawAmId, &headers[p], sizeof(uint64_t),
                                        data, config.page_bytes, &rp));
      }
      worker->Progress();
    }
    for (ucs_status_ptr_t request : sends) {
      if (absl::Status s = WaitRequest(*worker, request, config.mode); !s.ok()) Die(s);
    }
    if (config.mode == "put") {
      ucp_request_param_t rp{};
      if (absl::Status s = WaitRequest(*worker, ucp_ep_flush_nbx((*endpoint)->get(), &rp), "flush");
          !s.ok()) {
        Die(s);
      }
    }
    seconds.push_back(static_cast<double>(NowNs() - start) / 1e9);
    channel.Write("done");
    channel.Read();  // "next"
  }
  Report(config, seconds);
  channel.Write("bye");
}

}  // namespace
}  // namespace pdserve::kv

int main(int argc, char** argv) {
  using pdserve::kv::Channel;
  if (argc < 5 || argc > 7) {
    std::fprintf(stderr,
                 "usage: kv_transfer_bench pdserve|am|am-hot|tag|put|memcpy <total MiB> <page KiB> "
                 "<iterations> [lanes] [checksum threads]\n");
    return 2;
  }
  pdserve::kv::Config config{.mode = argv[1],
                             .total_bytes = std::stoull(argv[2]) << 20,
                             .page_bytes = std::stoull(argv[3]) << 10,
                             .iterations = std::stoi(argv[4]),
                             .lanes = argc >= 6 ? std::stoi(argv[5]) : 1,
                             .checksum_threads = argc == 7 ? std::stoi(argv[6]) : 0};
  if (config.mode == "memcpy") {
    pdserve::kv::MemcpyBound(config);
    return 0;
  }
  int to_sender[2];
  int to_receiver[2];
  if (pipe(to_sender) != 0 || pipe(to_receiver) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {
    Channel channel(to_sender[0], to_receiver[1]);
    if (config.mode == "pdserve") {
      pdserve::kv::PdserveSender(config, channel);
    } else {
      pdserve::kv::RawSender(config, channel);
    }
    std::fflush(stdout);
    _exit(0);
  }
  Channel channel(to_receiver[0], to_sender[1]);
  if (config.mode == "pdserve") {
    pdserve::kv::PdserveReceiver(config, channel);
  } else {
    pdserve::kv::RawReceiver(config, channel);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
