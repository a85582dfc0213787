// Issue 27: the host costs of the same-host device-to-device path (docs/protocol.md, "Same-host
// device-to-device pages (CUDA IPC)") without a GPU: TransferSender::PrepareDevice's page
// references over UCX (transport from UCX_TLS, one process, --lanes lanes on each side) to a
// TransferReceiver whose lanes land them through a host stand-in for the CUDA lander: the
// "arena" is host memory, and a Flush either copies each page and takes the XXH3-64 of the
// landed bytes (--lander copy, what CudaPageLander does on the GPU) or only reports each page
// with its known hash (--lander null: the protocol's own costs, no byte moved).
//
// Per page count (--pages, the V4-Flash 8-layer states of 4K / 32K / 128K-token prompts are 148 /
// 1056 / 4176 pages of ~42 KB) and repeat: post ms (PrepareDevice + PostAll + Commit), drain ms
// (then until Poll reports the commit delivered: every page acked), verify ms (then until the
// receiver's outcome is verified), kPageRef messages sent, lander flushes, host us per page
// (post + drain over pages). Medians over --repeats after one warm-up. Markdown on stdout.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/shm/shared_memory.h"
#include "kvtransfer/transfer_receiver.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "kvtransfer/ucx/ucx_transport.h"

namespace pdserve::bench {
namespace {

constexpr char kBusId[] = "0000:19:00.0";

struct Flags {
  int lanes = 1;
  std::string pages = "148,1056,4176";
  uint64_t page_bytes = 43008;
  int repeats = 5;
  std::string lander = "null";
  int refs = 3;
};

// What the stand-in landers did, over all lanes.
struct LanderCounts {
  std::atomic<uint64_t> flushes{0};
  std::atomic<uint64_t> pages{0};
};

// The host stand-in for CudaPageLander: the arena is `arena` (any handle names it); Flush lands
// the batch (copy: memcpy + XXH3 of the landed bytes; null: the page's known hash, no copy).
class HostLander final : public kv::shm::DevicePageLander {
 public:
  HostLander(std::span<const std::byte> arena, const std::vector<uint64_t>& hashes,
             uint64_t page_bytes, bool copy, LanderCounts& counts)
      : arena_(arena), hashes_(hashes), page_bytes_(page_bytes), copy_(copy), counts_(counts) {}
  absl::Status Add(const kv::shm::PageRef& ref, const kv::LandingTarget& target) override {
    if (!ref.device.has_value()) return absl::InvalidArgumentError("not a GPU arena page");
    return AddFromArena(*ref.device, ref.offset, ref.length, target);
  }
  absl::Status AddFromArena(const kv::shm::IpcRegionName& /*arena*/, uint64_t offset,
                            uint64_t length, const kv::LandingTarget& target) override {
    if (offset > arena_.size() || length > arena_.size() - offset ||
        length != target.destination.size()) {
      return absl::UnavailableError("cuda ipc: outside the arena");
    }
    queued_.push_back({offset, target});
    return absl::OkStatus();
  }
  void Flush(const std::function<void(const kv::LandingTarget&, absl::Status, uint64_t)>& landed)
      override {
    counts_.flushes.fetch_add(1, std::memory_order_relaxed);
    counts_.pages.fetch_add(queued_.size(), std::memory_order_relaxed);
    std::vector<Queued> batch;
    batch.swap(queued_);
    for (const Queued& q : batch) {
      uint64_t hash = hashes_[q.offset / page_bytes_];
      if (copy_) {
        std::memcpy(q.target.destination.data(), arena_.data() + q.offset,
                    q.target.destination.size());
        hash = kv::PayloadChecksum(q.target.destination);
      }
      landed(q.target, absl::OkStatus(), hash);
    }
  }
  size_t pending() const override { return queued_.size(); }

 private:
  struct Queued {
    uint64_t offset;
    kv::LandingTarget target;
  };
  const std::span<const std::byte> arena_;
  const std::vector<uint64_t>& hashes_;
  const uint64_t page_bytes_;
  const bool copy_;
  LanderCounts& counts_;
  std::vector<Queued> queued_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Ms(absl::Time from, absl::Time to) { return absl::ToDoubleMilliseconds(to - from); }

absl::Status Run(const Flags& flags) {
  std::vector<uint32_t> counts;
  for (absl::string_view part : absl::StrSplit(flags.pages, ',')) {
    counts.push_back(static_cast<uint32_t>(std::stoul(std::string(part))));
  }
  const uint32_t most = *std::max_element(counts.begin(), counts.end());
  // The arena: distinct pages, and their hashes (the "GPU checksums" of the prefill side).
  std::vector<std::byte> arena(static_cast<size_t>(most) * flags.page_bytes);
  for (size_t i = 0; i < arena.size(); i += 8) {
    const uint64_t word = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(arena.data() + i, &word, std::min<size_t>(8, arena.size() - i));
  }
  std::vector<uint64_t> hashes(most);
  for (uint32_t p = 0; p < most; ++p) {
    hashes[p] =
        kv::PayloadChecksum(std::span(arena).subspan(p * flags.page_bytes, flags.page_bytes));
  }
  std::vector<std::byte> pool(arena.size());
  SystemClock clock;
  auto acks = kv::shm::AckTable::Create(uint64_t{1} << 16);
  if (!acks.ok()) return acks.status();
  auto region = kv::shm::SharedRegion::Create(kv::shm::kPagesPurpose, 4096);
  if (!region.ok()) return region.status();
  auto puller = kv::shm::PullSender::Create(**region);
  if (!puller.ok()) return puller.status();
  auto receiver = kv::CreateUcxReceiver(
      {.lease = absl::Seconds(60), .acks = acks->get()}, clock,
      [](uint64_t, uint64_t, const absl::Status&) {}, nullptr, flags.lanes);
  if (!receiver.ok()) return receiver.status();
  LanderCounts landed;
  const bool copy = flags.lander == "copy";
  absl::Status set = (*receiver)->SetDeviceLanders(
      [&]() -> absl::StatusOr<std::unique_ptr<kv::shm::DevicePageLander>> {
        return std::make_unique<HostLander>(arena, hashes, flags.page_bytes, copy, landed);
      });
  if (!set.ok()) return set;
  auto transport = kv::UcxTransport::Create(flags.lanes);
  if (!transport.ok()) return transport.status();
  kv::TransferSender sender(**transport, clock,
                            {.max_in_flight_bytes = kv::InFlightBytesForLanes(flags.lanes),
                             .path = "cuda-ipc",
                             .shm_pull = puller->get(),
                             .device_ref_version = flags.refs});
  kv::shm::IpcRegionName name{
      .bytes = arena.size(), .pci_bus_id = kBusId, .boot_id = (*acks)->boot_id()};
  std::printf(
      "| lanes | refs | lander | pages | MB | messages | flushes | pages / flush | post ms | "
      "drain ms | verify ms | total ms | host us / page |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  uint64_t request = 1;
  for (uint32_t count : counts) {
    std::vector<double> post, drain, verify;
    uint64_t messages = 0, flushes = 0, flushed_pages = 0;
    for (int r = 0; r <= flags.repeats; ++r) {  // Repeat 0 warms up.
      kv::ReceiveSpec spec{.request_id = request++, .epoch = 7, .device_pci_bus_id = kBusId};
      kv::DevicePages pages{.arena = name};
      for (uint32_t i = 0; i < count; ++i) {
        const uint32_t per_layer = (count + 7) / 8;
        spec.pages.push_back({.layer = i / per_layer,
                              .page_index = i % per_layer,
                              .token_begin = (i % per_layer) * 64,
                              .token_end = (i % per_layer + 1) * 64,
                              .bytes = flags.page_bytes,
                              .element = serving::ElementType::kBfloat16});
        spec.destinations.push_back(
            std::span(pool).subspan(i * flags.page_bytes, flags.page_bytes));
        pages.pages.push_back({.offset = i * flags.page_bytes,
                               .length = flags.page_bytes,
                               .element = serving::ElementType::kBfloat16,
                               .xxh3 = hashes[i]});
      }
      auto ticket = (*receiver)->Expect(std::move(spec));
      if (!ticket.ok()) return ticket.status();
      const uint64_t messages_before = [&] {
        uint64_t n = 0;
        for (uint64_t m : (*transport)->pages_per_lane()) n += m;
        return n;
      }();
      const uint64_t flushes_before = landed.flushes.load();
      const uint64_t pages_before = landed.pages.load();
      const absl::Time t0 = absl::Now();
      auto transfer = sender.PrepareDevice(*ticket, std::move(pages));
      if (!transfer.ok()) return transfer.status();
      if (absl::Status s = (*transfer)->PostAll(); !s.ok()) return s;
      if (absl::Status s = (*transfer)->Commit(static_cast<int32_t>(count), 0); !s.ok()) return s;
      const absl::Time posted = absl::Now();
      absl::StatusOr<bool> done = false;
      while (done.ok() && !*done) {
        done = (*transfer)->Poll();
        if (flags.lanes == 1) (*receiver)->Progress();
      }
      if (!done.ok()) return done.status();
      const absl::Time delivered = absl::Now();
      absl::StatusOr<kv::TransferOutcome> outcome;
      for (;;) {
        if (flags.lanes == 1) (*receiver)->Progress();
        outcome = (*receiver)->Outcome(ticket->ticket_id);
        if (!outcome.ok()) return outcome.status();
        if (outcome->state != kv::TransferState::kReceiving) break;
      }
      const absl::Time verified = absl::Now();
      if (outcome->state != kv::TransferState::kVerified) return outcome->status;
      if (absl::Status s = (*transfer)->Release(); !s.ok()) return s;
      transfer->reset();
      if (r == 0) continue;
      post.push_back(Ms(t0, posted));
      drain.push_back(Ms(posted, delivered));
      verify.push_back(Ms(delivered, verified));
      uint64_t after = 0;
      for (uint64_t m : (*transport)->pages_per_lane()) after += m;
      messages = after - messages_before;
      flushes = landed.flushes.load() - flushes_before;
      flushed_pages = landed.pages.load() - pages_before;
    }
    const double p = Median(post), d = Median(drain), v = Median(verify);
    std::printf(
        "| %d | v%d | %s | %u | %.1f | %llu | %llu | %.1f | %.3f | %.3f | %.3f | %.3f | %.2f |\n",
        flags.lanes, flags.refs, flags.lander.c_str(), count,
        static_cast<double>(count) * static_cast<double>(flags.page_bytes) / 1e6,
        static_cast<unsigned long long>(messages), static_cast<unsigned long long>(flushes),
        flushes > 0 ? static_cast<double>(flushed_pages) / static_cast<double>(flushes) : 0, p, d,
        v, p + d + v, 1e3 * (p + d) / count);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app("Host costs of the CUDA IPC page-reference path, with a host stand-in lander");
  app.add_option("--lanes", flags.lanes, "UCX lanes on each side");
  app.add_option("--pages", flags.pages, "Page counts, comma-separated");
  app.add_option("--page-bytes", flags.page_bytes, "Bytes per page");
  app.add_option("--repeats", flags.repeats, "Transfers per count (median; one more warms up)");
  app.add_option("--lander", flags.lander, "copy: memcpy + XXH3 per page; null: no copy")
      ->check(CLI::IsMember({"copy", "null"}));
  app.add_option("--refs", flags.refs, "Device reference version the sender writes (2 or 3)")
      ->check(CLI::IsMember({2, 3}));
  CLI11_PARSE(app, argc, argv);
  const absl::Status status = pdserve::bench::Run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "device_ref_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
