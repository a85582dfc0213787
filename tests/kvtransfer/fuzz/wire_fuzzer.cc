// libFuzzer target for the transfer protocol's parsers of untrusted bytes: page header, ticket,
// page references (every version of a kPageRef message) and control messages. Whatever decodes must
// re-encode to the same bytes (the formats have no slack), and nothing may crash. Without libFuzzer
// (GCC), main() sweeps every single-byte change and every truncation of valid encodings instead, so
// the ctest still exercises the parsers.
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
  // Every kPageRef message (any version) parses into pages whose headers lie inside it; a whole
  // version-3 batch re-encodes to the same bytes.
  const shm::ParsedRefs parsed = shm::ParsePageRefs(bytes);
  Check(parsed.pages.empty() == (size == 0), "a message without pages");
  bool one_batch = parsed.arenas.size() == 1 && size >= shm::kDeviceRefBatchFirstBytes &&
                   LoadLe(bytes, kPageHeaderBytes + 4, 2) == shm::kDeviceRefBatchVersion;
  std::vector<shm::DeviceRefEntry> entries;
  for (const shm::ParsedRef& page : parsed.pages) {
    Check(page.header.data() >= bytes.data() &&
              page.header.data() + page.header.size() <= bytes.data() + size,
          "a page header outside the message");
    one_batch = one_batch && page.error.ok() && page.arena == &parsed.arenas.front() &&
                page.header.size() == kPageHeaderBytes;
    if (!one_batch) continue;
    shm::DeviceRefEntry& entry = entries.emplace_back();
    std::memcpy(entry.header.data(), page.header.data(), kPageHeaderBytes);
    entry.offset = page.offset;
    entry.length = page.length;
  }
  if (one_batch) {
    std::vector<std::byte> again;
    shm::AppendDeviceRefBatch(parsed.arenas.front(), entries, again);
    Check(again.size() == size && std::memcmp(again.data(), data, size) == 0,
          "version-3 batch does not round-trip");
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
  // A version-3 batch of three pages, and one after a version-1 reference in one message.
  const shm::IpcRegionName arena{
      .allocation_offset = 512, .bytes = 1 << 20, .pci_bus_id = "0000:19:00.0", .boot_id = "b"};
  std::vector<shm::DeviceRefEntry> batch(3);
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].header = header;
    batch[i].offset = 4096 * i;
    batch[i].length = 4000 + i;
  }
  std::vector<std::byte> compact;
  shm::AppendDeviceRefBatch(arena, batch, compact);
  seeds.push_back(compact);
  std::vector<std::byte> mixed = seeds[3];
  mixed.insert(mixed.end(), compact.begin(), compact.end());
  seeds.push_back(std::move(mixed));
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
