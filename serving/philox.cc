#include "serving/philox.h"

namespace pdserve::serving {
namespace {

// Multipliers and Weyl key increments from Salmon et al. 2011, section 4.2.
constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;

PhiloxCounter Round(const PhiloxCounter& x, const PhiloxKey& key) {
  const uint64_t product0 = static_cast<uint64_t>(kMultiplier0) * x[0];
  const uint64_t product1 = static_cast<uint64_t>(kMultiplier1) * x[2];
  const auto hi0 = static_cast<uint32_t>(product0 >> 32);
  const auto lo0 = static_cast<uint32_t>(product0);
  const auto hi1 = static_cast<uint32_t>(product1 >> 32);
  const auto lo1 = static_cast<uint32_t>(product1);
  return {hi1 ^ x[1] ^ key[0], lo1, hi0 ^ x[3] ^ key[1], lo0};
}

}  // namespace

PhiloxCounter Philox4x32(PhiloxCounter counter, PhiloxKey key) {
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      key[0] += kWeyl0;
      key[1] += kWeyl1;
    }
    counter = Round(counter, key);
  }
  return counter;
}

double PhiloxUniform(PhiloxCounter counter, PhiloxKey key) {
  const PhiloxCounter bits = Philox4x32(counter, key);
  const uint64_t word = (static_cast<uint64_t>(bits[0]) << 32) | bits[1];
  return static_cast<double>(word >> 11) * 0x1.0p-53;
}

}  // namespace pdserve::serving
