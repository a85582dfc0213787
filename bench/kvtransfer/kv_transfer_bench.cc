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
//                  UCX's protocols: UCX_PROTO_ENABLE in the environment (v1 when unset);
//                  PDSERVE_BENCH_REGISTER_PAGES=1: both sides register their page memory once
//                  and pass its handle with each page (transfer.register_pages: docs/protocol.md,
//                  "Registered page memory"); =0: neither registers; unset: only the receiver
//                  registers its pool (this bench's behaviour before the switch);
//                  PDSERVE_BENCH_SHM_PULL=1: the receiver pulls every page out of the sender's
//                  shared region (transfer.shm_pull: docs/protocol.md, "Same-host pages by shared
//                  memory"); UCX carries only headers, the commit and heartbeats
//         get-proto  a receiver-pulled protocol's shape (below, before main): P's pages in
//                  UCX-allocated memory, a small AM per page, D pulls it with ucp_get_nbx,
//                  checksums on both sides, an answer per page; timed on P until all answered
//         am | tag | put  raw ucp_am_send_nbx (receiver lands with ucp_am_recv_data_nbx) /
//                  ucp_tag_send_nbx into pre-posted receives / ucp_put_nbx + flush into
//                  registered memory; timed on the sender from the first post to completion
//         am-hot   raw AM as `am`, but every message is sent from and lands in one page-sized
//                  buffer on each side, as ucx_perftest does: the buffers stay in cache, so this
//                  separates how we drive UCX from what moving distinct memory costs
//         get      the other direction of put: the timed process pulls every page with
//                  ucp_get_nbx from the other's memory (registered with ucp_mem_map, as a
//                  prefill worker's pages would be) into its own distinct pages; over shared
//                  memory UCX 1.13 emulates that with active messages (cma is no RMA lane
//                  there: docs/perf.md, "A receiver-pulled data path?")
//         get-alloc | put-alloc  get / put where the untimed process's pages were allocated by
//                  UCX (ucp_mem_map UCP_MEM_MAP_ALLOCATE: a sysv or posix segment, as
//                  UCX_ALLOC_PRIO says, that the peer attaches and copies from or into)
//         am-alloc raw AM as `am`, sent from memory UCX allocated (its memh passed with each send)
//                  PDSERVE_BENCH_EP_INFO=1 prints the timed process's endpoint (ucp_ep_print_info)
//                  to stderr in the raw modes
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
  bool am() const { return mode == "am" || mode == "am-hot" || mode == "am-alloc"; }
  bool get() const { return mode == "get" || mode == "get-alloc"; }
  bool put() const { return mode == "put" || mode == "put-alloc"; }
  // The untimed process's pages were allocated by UCX (get-alloc, put-alloc).
  bool peer_allocated() const { return mode == "get-alloc" || mode == "put-alloc"; }
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

// PDSERVE_BENCH_REGISTER_PAGES: 1, 0, or -1 when unset or empty.
int RegisterPagesFromEnvironment() {
  const char* value = std::getenv("PDSERVE_BENCH_REGISTER_PAGES");
  if (value == nullptr || *value == '\0') return -1;
  return std::string(value) == "1" ? 1 : 0;
}

bool ShmPullFromEnvironment() {
  const char* value = std::getenv("PDSERVE_BENCH_SHM_PULL");
  return value != nullptr && std::string(value) == "1";
}

void PdserveReceiver(const Config& config, Channel& channel) {
  SystemClock clock;
  std::unique_ptr<shm::AckTable> acks;
  if (ShmPullFromEnvironment()) {
    auto table = shm::AckTable::Create(config.pages() + 1);
    if (!table.ok()) Die(table.status());
    acks = std::move(*table);
  }
  auto receiver = CreateUcxReceiver(
      {.lease = absl::Seconds(60), .acks = acks.get()}, clock, [](auto, auto, const auto&) {},
      nullptr, config.lanes);
  if (!receiver.ok()) Die(receiver.status());
  std::vector<std::byte> pool(config.total_bytes);
  if (RegisterPagesFromEnvironment() != 0) {
    if (absl::Status s = (*receiver)->RegisterMemory(pool); !s.ok()) Die(s);
  }
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
  std::vector<std::byte> heap;
  std::unique_ptr<shm::SharedRegion> region;
  std::unique_ptr<shm::PullSender> puller;
  std::span<std::byte> source;
  if (ShmPullFromEnvironment()) {
    auto made = shm::SharedRegion::Create(shm::kPagesPurpose, config.total_bytes);
    if (!made.ok()) Die(made.status());
    region = std::move(*made);
    auto pull = shm::PullSender::Create(*region);
    if (!pull.ok()) Die(pull.status());
    puller = std::move(*pull);
    source = region->bytes();
  } else {
    heap.resize(config.total_bytes);
    source = heap;
  }
  std::fill(source.begin(), source.end(), std::byte{0x5A});
  if (RegisterPagesFromEnvironment() == 1) {
    if (absl::Status s = (*transport)->RegisterMemory(source); !s.ok()) Die(s);
  }
  std::unique_ptr<TaskPool> pool;
  SenderOptions options;
  if (config.checksum_threads > 0) {
    pool = std::make_unique<TaskPool>(config.checksum_threads);
    options.checksum_pool = pool.get();
    options.max_in_flight_bytes = InFlightBytesForLanes(config.lanes);
  }
  options.shm_pull = puller.get();
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
    if (puller != nullptr && !(*transfer)->pulled()) {
      Die((*transfer)->pull_refusal().ok() ? absl::FailedPreconditionError("ticket without offer")
                                           : (*transfer)->pull_refusal());
    }
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

void SetHandler(UcxWorker& worker, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  handler.id = id;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = cb;
  handler.arg = arg;
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker.get(), &handler); s != UCS_OK) {
    Die(UcsToStatus(s, "set_am_recv_handler"));
  }
}

void RawReceiver(const Config& config, Channel& channel) {
  auto context = UcxContext::Create();
  if (!context.ok()) Die(context.status());
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) Die(worker.status());
  // The pages the other process writes into (am, tag, put) or reads from (get): distinct,
  // already touched, registered or allocated by UCX.
  std::vector<std::byte> owned;
  absl::StatusOr<UcxMemory> memory = absl::UnknownError("unset");
  if (config.peer_allocated()) {
    memory = UcxMemory::Allocate(*context, config.buffer_bytes());
    if (memory.ok()) std::memset(memory->data(), 0x5A, config.buffer_bytes());
  } else {
    owned.assign(config.buffer_bytes(), std::byte{0x5A});
    memory = UcxMemory::Register(*context, owned.data(), owned.size());
  }
  if (!memory.ok()) Die(memory.status());
  std::byte* const pool = memory->data();
  auto rkey = memory->PackRemoteKey();
  if (!rkey.ok()) Die(rkey.status());
  RawAmState am{&*worker, pool, &config};
  SetHandler(*worker, kRawAmId, &OnRawAm, &am);
  channel.Write(absl::StrCat(Hex(worker->address()), " ", Hex(*rkey), " ",
                             reinterpret_cast<uintptr_t>(pool)));
  for (int it = 0; it < config.iterations; ++it) {
    std::vector<ucs_status_ptr_t> receives;
    if (config.mode == "tag") {
      for (uint64_t p = 0; p < config.pages(); ++p) {
        ucp_request_param_t rp{};
        receives.push_back(ucp_tag_recv_nbx(worker->get(), pool + p * config.page_bytes,
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
    while (config.am() && am.landed < config.pages() * (it + 1)) worker->Progress();
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
  if (std::getenv("PDSERVE_BENCH_EP_INFO") != nullptr) {
    ucp_ep_print_info((*endpoint)->get(), stderr);
  }
  // The pages sent from (am, tag, put) or pulled into (get); am-alloc's from UCX.
  std::vector<std::byte> owned;
  absl::StatusOr<UcxMemory> local = absl::UnknownError("unset");
  std::byte* source = nullptr;
  if (config.mode == "am-alloc") {
    local = UcxMemory::Allocate(*context, config.buffer_bytes());
    if (!local.ok()) Die(local.status());
    source = local->data();
    std::memset(source, 0x5A, config.buffer_bytes());
  } else {
    owned.assign(config.buffer_bytes(), std::byte{0x5A});
    source = owned.data();
  }
  std::vector<double> seconds;
  for (int it = 0; it < config.iterations; ++it) {
    channel.Read();  // "go": receives are posted.
    const int64_t start = NowNs();
    std::vector<ucs_status_ptr_t> sends;
    std::vector<uint64_t> headers(config.pages());
    for (uint64_t p = 0; p < config.pages(); ++p) {
      ucp_request_param_t rp{};
      std::byte* data = source + config.offset(p);
      headers[p] = p;
      if (config.get()) {
        sends.push_back(ucp_get_nbx((*endpoint)->get(), data, config.page_bytes,
                                    remote_base + p * config.page_bytes, rkey->get(), &rp));
      } else if (config.put()) {
        sends.push_back(ucp_put_nbx((*endpoint)->get(), data, config.page_bytes,
                                    remote_base + p * config.page_bytes, rkey->get(), &rp));
      } else if (config.mode == "tag") {
        sends.push_back(ucp_tag_send_nbx((*endpoint)->get(), data, config.page_bytes, p, &rp));
      } else {
        if (local.ok()) {
          rp.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
          rp.memh = local->get();
        }
        sends.push_back(ucp_am_send_nbx((*endpoint)->get(), kRawAmId, &headers[p], sizeof(uint64_t),
                                        data, config.page_bytes, &rp));
      }
      worker->Progress();
    }
    for (ucs_status_ptr_t request : sends) {
      if (absl::Status s = WaitRequest(*worker, request, config.mode); !s.ok()) Die(s);
    }
    if (config.put()) {
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

// ---- a receiver-pulled protocol (issue 27's question) ------------------------------------------
//
// get-proto: the timed process is P. Its pages live in memory UCX allocated (a sysv or posix
// segment, UcxMemory::Allocate); per page it takes the xxh3-64 and sends a small AM (page index,
// checksum, address; no payload). D, in its own loop after each progress, pulls each requested
// page with ucp_get_nbx into a distinct destination page, takes the xxh3-64 of the landed bytes,
// compares, and answers with a small AM (page index, ok). P keeps at most 8 MiB unanswered (the
// one-lane window of TransferSender) and is timed until every page is answered. The protocol's
// shape without the receiver's ticket bookkeeping: both checksums, one request and one answer
// per page, D deciding before the bytes move.

constexpr unsigned kGetRequestId = 10;
constexpr unsigned kGetAnswerId = 11;

struct GetRequest {
  uint64_t page = 0;
  uint64_t checksum = 0;
  uint64_t address = 0;
};
struct GetAnswer {
  uint64_t page = 0;
  uint64_t ok = 0;
};

struct GetProtoD {
  std::vector<GetRequest> requested;  // Arrived, get not posted yet.
  std::vector<GetRequest> landed;     // Get completed, not checked yet.
  uint64_t mismatches = 0;
};

struct GetInFlight {
  GetProtoD* d;
  GetRequest request;
};

ucs_status_t OnGetRequest(void* arg, const void* header, size_t header_length, void*, size_t,
                          const ucp_am_recv_param_t*) {
  GetRequest request;
  if (header_length != sizeof(request)) return UCS_OK;  // Not ours: dropped.
  std::memcpy(&request, header, sizeof(request));
  static_cast<GetProtoD*>(arg)->requested.push_back(request);
  return UCS_OK;
}

void OnGetDone(void* request, ucs_status_t status, void* user_data) {
  std::unique_ptr<GetInFlight> get(static_cast<GetInFlight*>(user_data));
  if (status == UCS_OK) {
    get->d->landed.push_back(get->request);
  } else {
    ++get->d->mismatches;
    std::fprintf(stderr, "get of page %lu: %s\n", static_cast<unsigned long>(get->request.page),
                 ucs_status_string(status));
  }
  ucp_request_free(request);
}

// A small send's header, kept until UCX is done with it (a send can wait in UCX's queue).
void FreeOnDone(void* request, ucs_status_t, void* user_data) {
  delete static_cast<std::vector<std::byte>*>(user_data);
  ucp_request_free(request);
}

// Small sends (requests, answers): the header is copied and freed when the send completes.
void SendSmall(ucp_ep_h ep, unsigned id, const void* header, size_t bytes) {
  const auto* begin = static_cast<const std::byte*>(header);
  auto* copy = new std::vector<std::byte>(begin, begin + bytes);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = &FreeOnDone;
  rp.user_data = copy;
  const ucs_status_ptr_t request = ucp_am_send_nbx(ep, id, copy->data(), bytes, nullptr, 0, &rp);
  if (UCS_PTR_IS_ERR(request)) Die(UcsToStatus(UCS_PTR_STATUS(request), "small AM"));
  if (request == nullptr) delete copy;  // Completed at once: no callback.
}

void GetProtoReceiver(const Config& config, Channel& channel) {
  auto context = UcxContext::Create();
  if (!context.ok()) Die(context.status());
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) Die(worker.status());
  std::vector<std::byte> pool(config.total_bytes);
  GetProtoD d;
  SetHandler(*worker, kGetRequestId, &OnGetRequest, &d);
  channel.Write(Hex(worker->address()));
  // "<P's worker address> <rkey of P's pages>".
  const std::vector<std::string> hello = absl::StrSplit(channel.Read(), ' ');
  auto endpoint = UcxEndpoint::Create(*worker, Unhex(hello[0]), true, nullptr);
  if (!endpoint.ok()) endpoint = UcxEndpoint::Create(*worker, Unhex(hello[0]), false, nullptr);
  if (!endpoint.ok()) Die(endpoint.status());
  auto rkey = UcxRemoteKey::Unpack(**endpoint, Unhex(hello[1]));
  if (!rkey.ok()) Die(rkey.status());
  if (std::getenv("PDSERVE_BENCH_EP_INFO") != nullptr) {
    ucp_ep_print_info((*endpoint)->get(), stderr);
  }
  while (true) {
    worker->Progress();
    for (const GetRequest& request : d.requested) {
      ucp_request_param_t rp{};
      rp.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      rp.cb.send = &OnGetDone;
      rp.user_data = new GetInFlight{&d, request};
      const ucs_status_ptr_t get =
          ucp_get_nbx((*endpoint)->get(), pool.data() + request.page * config.page_bytes,
                      config.page_bytes, request.address, rkey->get(), &rp);
      if (UCS_PTR_IS_ERR(get)) Die(UcsToStatus(UCS_PTR_STATUS(get), "ucp_get_nbx"));
    }
    d.requested.clear();
    if (!d.landed.empty()) worker->Progress();
    for (const GetRequest& request : d.landed) {
      const uint64_t sum = PayloadChecksum(
          std::span(pool).subspan(request.page * config.page_bytes, config.page_bytes));
      const GetAnswer answer{request.page, sum == request.checksum ? 1u : 0u};
      if (answer.ok == 0) {
        ++d.mismatches;
        std::fprintf(stderr, "page %lu: checksum mismatch\n",
                     static_cast<unsigned long>(request.page));
      }
      SendSmall((*endpoint)->get(), kGetAnswerId, &answer, sizeof(answer));
    }
    d.landed.clear();
    if (channel.Ready()) {
      if (channel.Read() == "bye") break;
    }
  }
  if (d.mismatches != 0) Die(absl::DataLossError(absl::StrCat(d.mismatches, " pages failed")));
}

struct GetProtoP {
  uint64_t answered = 0;
  uint64_t failed = 0;
};

ucs_status_t OnGetAnswer(void* arg, const void* header, size_t header_length, void*, size_t,
                         const ucp_am_recv_param_t*) {
  GetAnswer answer;
  if (header_length != sizeof(answer)) return UCS_OK;
  std::memcpy(&answer, header, sizeof(answer));
  auto* p = static_cast<GetProtoP*>(arg);
  ++p->answered;
  if (answer.ok == 0) ++p->failed;
  return UCS_OK;
}

void GetProtoSender(const Config& config, Channel& channel) {
  auto context = UcxContext::Create();
  if (!context.ok()) Die(context.status());
  auto worker = UcxWorker::Create(*context);
  if (!worker.ok()) Die(worker.status());
  GetProtoP p;
  SetHandler(*worker, kGetAnswerId, &OnGetAnswer, &p);
  const std::vector<std::byte> address = Unhex(channel.Read());
  auto endpoint = UcxEndpoint::Create(*worker, address, true, nullptr);
  if (!endpoint.ok()) endpoint = UcxEndpoint::Create(*worker, address, false, nullptr);
  if (!endpoint.ok()) Die(endpoint.status());
  auto memory = UcxMemory::Allocate(*context, config.total_bytes);
  if (!memory.ok()) Die(memory.status());
  std::memset(memory->data(), 0x5A, config.total_bytes);
  auto rkey = memory->PackRemoteKey();
  if (!rkey.ok()) Die(rkey.status());
  channel.Write(absl::StrCat(Hex(worker->address()), " ", Hex(*rkey)));
  const uint64_t window_pages = std::max<uint64_t>(1, (uint64_t{8} << 20) / config.page_bytes);
  std::vector<double> seconds;
  for (int it = 0; it < config.iterations; ++it) {
    const uint64_t base = p.answered;
    const int64_t start = NowNs();
    for (uint64_t page = 0; page < config.pages(); ++page) {
      while (page - (p.answered - base) >= window_pages) worker->Progress();
      std::byte* data = memory->data() + page * config.page_bytes;
      const GetRequest request{page, PayloadChecksum({data, config.page_bytes}),
                               reinterpret_cast<uint64_t>(data)};
      SendSmall((*endpoint)->get(), kGetRequestId, &request, sizeof(request));
      worker->Progress();
    }
    while (p.answered - base < config.pages()) worker->Progress();
    seconds.push_back(static_cast<double>(NowNs() - start) / 1e9);
  }
  if (p.failed != 0) Die(absl::DataLossError(absl::StrCat(p.failed, " pages failed")));
  Report(config, seconds);
  channel.Write("bye");
}

}  // namespace
}  // namespace pdserve::kv

int main(int argc, char** argv) {
  using pdserve::kv::Channel;
  if (argc < 5 || argc > 7) {
    std::fprintf(stderr,
                 "usage: kv_transfer_bench "
                 "pdserve|get-proto|am|am-hot|am-alloc|tag|put|put-alloc|get|get-alloc|memcpy "
                 "<total MiB> <page KiB> "
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
    } else if (config.mode == "get-proto") {
      pdserve::kv::GetProtoSender(config, channel);
    } else {
      pdserve::kv::RawSender(config, channel);
    }
    std::fflush(stdout);
    _exit(0);
  }
  Channel channel(to_receiver[0], to_sender[1]);
  if (config.mode == "pdserve") {
    pdserve::kv::PdserveReceiver(config, channel);
  } else if (config.mode == "get-proto") {
    pdserve::kv::GetProtoReceiver(config, channel);
  } else {
    pdserve::kv::RawReceiver(config, channel);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
