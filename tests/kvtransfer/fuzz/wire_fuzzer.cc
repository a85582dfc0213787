// libFuzzer target for the transfer protocol's parsers of untrusted bytes: page header, ticket and
// control messages. Whatever decodes must re-encode to the same bytes (the formats have no slack),
// and nothing may crash. Without libFuzzer (GCC), main() sweeps every single-byte change and every
// truncation of valid encodings instead, so the ctest still exercises the parsers.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "kvtransfer/page_header.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/ticket.h"

namespace {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "wire_fuzzer: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pdserve::kv;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  if (auto header = DecodePageHeader(bytes); header.ok()) {
    const auto again = EncodePageHeader(*header);
    Check(std::memcmp(again.data(), data, size) == 0, "page header does not round-trip");
  }
  if (auto ticket = DecodeTicket(bytes); ticket.ok()) {
    const std::vector<std::byte> again = EncodeTicket(*ticket);
    Check(again.size() == size && std::memcmp(again.data(), data, size) == 0,
          "ticket does not round-trip");
  }
  if (auto ref = shm::DecodePageRef(bytes); ref.ok()) {
    const std::vector<std::byte> again =
        shm::EncodePageRefMessage(bytes.first(kPageHeaderBytes), *ref);
    Check(again.size() == size && std::memcmp(again.data(), data, size) == 0,
          "page reference does not round-trip");
  }
  if (auto control = DecodeControl(bytes); control.ok()) {
    const std::vector<std::byte> again = EncodeControl(*control);
    Check(again.size() == size && std::memcmp(again.data(), data, size) == 0,
          "control message does not round-trip");
  }
  return 0;
}

#ifndef PDSERVE_LIBFUZZER
int main() {
  using namespace pdserve::kv;
  std::vector<std::vector<std::byte>> seeds;
  const auto header = EncodePageHeader({.request_id = 1,
                                        .ticket_id = 2,
                                        .epoch = 3,
                                        .slot = 4,
                                        .layer = 5,
                                        .page_index = 6,
                                        .token_begin = 64,
                                        .token_end = 128,
                                        .payload_xxh3 = 7});
  seeds.emplace_back(header.begin(), header.end());
  seeds.push_back(EncodeTicket({.ticket_id = 9,
                                .epoch = 8,
                                .request_id = 7,
                                .worker_address = {std::byte{1}, std::byte{2}},
                                .pages = {{.layer = 1, .bytes = 4096}, {.layer = 2, .bytes = 16}},
                                .lease_deadline = absl::FromUnixSeconds(1'800'000'000)}));
  Ticket offered{.ticket_id = 9,
                 .worker_address = {std::byte{1}},
                 .pages = {{.layer = 1, .bytes = 4096}},
                 .lease_deadline = absl::FromUnixSeconds(1'800'000'000)};
  offered.shm_pull = ShmPullOffer{.boot_id = "boot",
                                  .acks = {.pid = 3, .fd = 4, .bytes = 64},
                                  .ack_index = 5,
                                  .device_pci_bus_id = "0000:19:00.0"};
  seeds.push_back(EncodeTicket(offered));
  seeds.push_back(shm::EncodePageRefMessage(
      header, {.region = {.pid = 3, .fd = 4, .bytes = 8192}, .offset = 64, .length = 128}));
  seeds.push_back(
      shm::EncodePageRefMessage(header, {.device = shm::IpcRegionName{.allocation_offset = 0,
                                                                      .bytes = 1 << 20,
                                                                      .pci_bus_id = "0000:19:00.0",
                                                                      .boot_id = "boot"},
                                         .offset = 64,
                                         .length = 128}));
  seeds.push_back(EncodeControl(
      {.kind = WireKind::kCommit, .ticket_id = 1, .pages_sent = 2, .layer_digests = {3, 4}}));
  size_t runs = 0;
  for (const auto& seed : seeds) {
    for (size_t cut = 0; cut <= seed.size(); ++cut) {
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(seed.data()), cut);
      ++runs;
    }
    for (size_t at = 0; at < seed.size(); ++at) {
      for (unsigned value : {0x00u, 0x01u, 0x7Fu, 0x80u, 0xFFu}) {
        std::vector<std::byte> mutated = seed;
        mutated[at] = static_cast<std::byte>(value);
        LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(mutated.data()), mutated.size());
        ++runs;
      }
    }
  }
  std::printf("wire_fuzzer: %zu inputs\n", runs);
  return 0;
}
#endif
