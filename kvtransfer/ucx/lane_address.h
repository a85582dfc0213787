// The worker address a multi-lane receiver puts in its tickets: the packed UCX worker address of
// each of its lanes in one byte string (docs/protocol.md, "Lanes"). A one-lane receiver's address
// is its plain UCX worker address, byte for byte as before lanes existed.
//
// Bundle layout (little-endian): byte 0x0F (a UCX address header with format version 15, which
// no UCX writes, so a bundle is never mistaken for a plain address), "PDL", version u16 (1),
// lane count u16 (2 .. kMaxTransferLanes), then per lane: length u32 and the address bytes.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::kv {

// One address: returned unchanged; several: the bundle. REQUIRES: !addresses.empty().
std::vector<std::byte> EncodeLaneAddresses(std::span<const std::vector<std::byte>> addresses);

// A bundle's lane addresses, or {bytes} for a plain address (no bundle prefix). The ticket is
// input from the network: InvalidArgument for a truncated bundle, an unknown version, a lane
// count outside 2 .. kMaxTransferLanes, an empty lane address or trailing bytes.
absl::StatusOr<std::vector<std::vector<std::byte>>> DecodeLaneAddresses(
    std::span<const std::byte> bytes);

}  // namespace pdserve::kv
