// The fixed 64-byte header that travels with each state page (docs/protocol.md, "Page header").
//
// Wire layout, little-endian, offsets in bytes:
//   0 magic u32 "PDKV"   4 version u16 (1)   6 message kind u16 (kPage)
//   8 request_id u64    16 ticket_id u64    24 epoch u64
//  32 slot u32          36 layer u32        40 page_index u32
//  44 token_begin u32   48 token_end u32    52 element u16 (serving::ElementType of the
//  payload; 0 fp32)    54 reserved u16 (0)
//  56 payload_xxh3 u64  -- xxh3-64 (seed 0) of the payload; the payload size is the message's.
// Thread-safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "serving/element_type.h"

namespace pdserve::kv {

inline constexpr size_t kPageHeaderBytes = 64;
inline constexpr uint32_t kWireMagic = 0x564B4450;  // "PDKV" in little-endian byte order.
inline constexpr uint16_t kWireVersion = 1;

struct PageHeader {
  uint64_t request_id = 0;
  uint64_t ticket_id = 0;
  uint64_t epoch = 0;
  uint32_t slot = 0;
  uint32_t layer = 0;
  uint32_t page_index = 0;
  uint32_t token_begin = 0;
  uint32_t token_end = 0;
  // The element type of the payload's values: the sender's storage (docs/protocol.md).
  serving::ElementType element = serving::ElementType::kFloat32;
  uint64_t payload_xxh3 = 0;

  bool operator==(const PageHeader&) const = default;
};

std::array<std::byte, kPageHeaderBytes> EncodePageHeader(const PageHeader& header);
// Errors: InvalidArgument when the size, magic, version or kind is wrong, the element type is
// unknown or reserved bits are set
// (a header that is not ours is rejected, never guessed at).
absl::StatusOr<PageHeader> DecodePageHeader(std::span<const std::byte> bytes);

// xxh3-64 with seed 0 of `payload` (libxxhash XXH3_64bits).
uint64_t PayloadChecksum(std::span<const std::byte> payload);

// Little-endian field access shared by the wire codecs of this folder.
void StoreLe(std::span<std::byte> out, size_t offset, uint64_t value, size_t width);
uint64_t LoadLe(std::span<const std::byte> in, size_t offset, size_t width);

}  // namespace pdserve::kv
