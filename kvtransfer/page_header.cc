#include "kvtransfer/page_header.h"

#include "absl/strings/str_cat.h"
#include "kvtransfer/wire_kind.h"
#include "xxhash.h"
#if defined(__x86_64__)
#include "xxh_x86dispatch.h"
#endif

namespace pdserve::kv {

void StoreLe(std::span<std::byte> out, size_t offset, uint64_t value, size_t width) {
  for (size_t i = 0; i < width; ++i) out[offset + i] = static_cast<std::byte>(value >> (8 * i));
}

uint64_t LoadLe(std::span<const std::byte> in, size_t offset, size_t width) {
  uint64_t value = 0;
  for (size_t i = 0; i < width; ++i) value |= static_cast<uint64_t>(in[offset + i]) << (8 * i);
  return value;
}

std::array<std::byte, kPageHeaderBytes> EncodePageHeader(const PageHeader& header) {
  std::array<std::byte, kPageHeaderBytes> out{};
  StoreLe(out, 0, kWireMagic, 4);
  StoreLe(out, 4, kWireVersion, 2);
  StoreLe(out, 6, static_cast<uint16_t>(WireKind::kPage), 2);
  StoreLe(out, 8, header.request_id, 8);
  StoreLe(out, 16, header.ticket_id, 8);
  StoreLe(out, 24, header.epoch, 8);
  StoreLe(out, 32, header.slot, 4);
  StoreLe(out, 36, header.layer, 4);
  StoreLe(out, 40, header.page_index, 4);
  StoreLe(out, 44, header.token_begin, 4);
  StoreLe(out, 48, header.token_end, 4);
  StoreLe(out, 52, static_cast<uint16_t>(header.element), 2);
  StoreLe(out, 56, header.payload_xxh3, 8);
  return out;
}

absl::StatusOr<PageHeader> DecodePageHeader(std::span<const std::byte> bytes) {
  if (bytes.size() != kPageHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("page header must be ", kPageHeaderBytes, " bytes, got ", bytes.size()));
  }
  if (LoadLe(bytes, 0, 4) != kWireMagic) return absl::InvalidArgumentError("bad page magic");
  if (LoadLe(bytes, 4, 2) != kWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported page header version ", LoadLe(bytes, 4, 2)));
  }
  if (LoadLe(bytes, 6, 2) != static_cast<uint16_t>(WireKind::kPage)) {
    return absl::InvalidArgumentError("not a page header");
  }
  if (LoadLe(bytes, 54, 2) != 0) return absl::InvalidArgumentError("reserved header bits set");
  const uint64_t element = LoadLe(bytes, 52, 2);
  if (!serving::IsElementType(element)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown page element type ", element));
  }
  PageHeader header;
  header.request_id = LoadLe(bytes, 8, 8);
  header.ticket_id = LoadLe(bytes, 16, 8);
  header.epoch = LoadLe(bytes, 24, 8);
  header.slot = static_cast<uint32_t>(LoadLe(bytes, 32, 4));
  header.layer = static_cast<uint32_t>(LoadLe(bytes, 36, 4));
  header.page_index = static_cast<uint32_t>(LoadLe(bytes, 40, 4));
  header.token_begin = static_cast<uint32_t>(LoadLe(bytes, 44, 4));
  header.token_end = static_cast<uint32_t>(LoadLe(bytes, 48, 4));
  header.element = static_cast<serving::ElementType>(element);
  header.payload_xxh3 = LoadLe(bytes, 56, 8);
  return header;
}

uint64_t PayloadChecksum(std::span<const std::byte> payload) {
#if defined(__x86_64__)
  // The same function as XXH3_64bits (same value), with the widest vector unit this CPU has;
  // libxxhash's plain entry point is built for SSE2, 1.4x slower on cached pages.
  return XXH3_64bits_dispatch(payload.data(), payload.size());
#else
  return XXH3_64bits(payload.data(), payload.size());
#endif
}

}  // namespace pdserve::kv
