#include "kvtransfer/ucx/lane_address.h"

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/ucx/ucx_lane.h"

namespace pdserve::kv {
namespace {

constexpr std::array<std::byte, 4> kBundleMagic = {std::byte{0x0F}, std::byte{'P'}, std::byte{'D'},
                                                   std::byte{'L'}};
constexpr uint16_t kBundleVersion = 1;
constexpr size_t kBundleHeaderBytes = 4 + 2 + 2;

}  // namespace

std::vector<std::byte> EncodeLaneAddresses(std::span<const std::vector<std::byte>> addresses) {
  if (addresses.size() == 1) return addresses[0];
  size_t total = kBundleHeaderBytes;
  for (const auto& address : addresses) total += 4 + address.size();
  std::vector<std::byte> out(total);
  std::copy(kBundleMagic.begin(), kBundleMagic.end(), out.begin());
  StoreLe(out, 4, kBundleVersion, 2);
  StoreLe(out, 6, addresses.size(), 2);
  size_t at = kBundleHeaderBytes;
  for (const auto& address : addresses) {
    StoreLe(out, at, address.size(), 4);
    std::copy(address.begin(), address.end(), out.begin() + static_cast<ptrdiff_t>(at + 4));
    at += 4 + address.size();
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<std::byte>>> DecodeLaneAddresses(
    std::span<const std::byte> bytes) {
  if (bytes.size() < kBundleMagic.size() ||
      !std::equal(kBundleMagic.begin(), kBundleMagic.end(), bytes.begin())) {
    return std::vector<std::vector<std::byte>>{{bytes.begin(), bytes.end()}};
  }
  if (bytes.size() < kBundleHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("lane address bundle of ", bytes.size(), " bytes is truncated"));
  }
  const uint64_t version = LoadLe(bytes, 4, 2);
  const uint64_t count = LoadLe(bytes, 6, 2);
  if (version != kBundleVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("lane address bundle version ", version, ", expected ", kBundleVersion));
  }
  if (count < 2 || count > static_cast<uint64_t>(kMaxTransferLanes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lane address bundle names ", count, " lanes; 2 .. ", kMaxTransferLanes, " are allowed"));
  }
  std::vector<std::vector<std::byte>> addresses;
  size_t at = kBundleHeaderBytes;
  for (uint64_t lane = 0; lane < count; ++lane) {
    if (bytes.size() - at < 4) {
      return absl::InvalidArgumentError(absl::StrCat("lane address bundle ends in lane ", lane));
    }
    const uint64_t length = LoadLe(bytes, at, 4);
    at += 4;
    if (length == 0 || bytes.size() - at < length) {
      return absl::InvalidArgumentError(absl::StrCat("lane ", lane, " of the address bundle has ",
                                                     length, " bytes of ", bytes.size() - at,
                                                     " left"));
    }
    addresses.emplace_back(bytes.begin() + static_cast<ptrdiff_t>(at),
                           bytes.begin() + static_cast<ptrdiff_t>(at + length));
    at += length;
  }
  if (at != bytes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("lane address bundle has ", bytes.size() - at, " trailing bytes"));
  }
  return addresses;
}

}  // namespace pdserve::kv
