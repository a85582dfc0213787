// Replays deterministic mutations of valid inputs through the fuzz entry points, so the parsers'
// robustness is checked in every build (the libFuzzer binaries need clang).
#include <cstdint>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine_loader/checkpoint_writer.h"
#include "tests/engine_loader/fuzz_targets.h"

namespace pdserve::engine {
namespace {

// Applies 1-4 random edits (byte flips, truncation, token insertion, length-prefix damage).
std::vector<uint8_t> Mutate(const std::vector<uint8_t>& seed, std::mt19937& rng) {
  static const std::string kTokens[] = {
      "{",         "}",         "[",    "]",      ",",
      ":",         "\"",        "-1",   "1e30",   "18446744073709551615",
      "\"dtype\"", "\"shape\"", "null", "\"F4\"", "\"layer_types\"",
      "\"yarn\""};
  std::vector<uint8_t> bytes = seed;
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits && !bytes.empty(); ++e) {
    const size_t pos = rng() % bytes.size();
    switch (rng() % 4) {
      case 0:
        bytes[pos] = static_cast<uint8_t>(rng());
        break;
      case 1:
        bytes.resize(pos);
        break;
      case 2: {
        const std::string& t = kTokens[rng() % std::size(kTokens)];
        bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(pos), t.begin(), t.end());
        break;
      }
      default:
        bytes[pos % 8] = static_cast<uint8_t>(rng());
        break;
    }
  }
  return bytes;
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Runs the seed, then `iterations` mutations of it, through `target` (which aborts on a broken
// invariant; ASan / UBSan builds also catch memory errors).
void Replay(const std::vector<uint8_t>& seed, uint32_t rng_seed, int iterations,
            int (*target)(const uint8_t*, size_t)) {
  target(seed.data(), seed.size());
  std::mt19937 rng(rng_seed);
  for (int iter = 0; iter < iterations; ++iter) {
    const std::vector<uint8_t> bytes = Mutate(seed, rng);
    target(bytes.data(), bytes.size());
  }
}

TEST(FuzzSmokeTest, MutatedConfigsNeverCrashTheParser) {
  const std::vector<uint8_t> seed =
      ReadFile(std::string(PDSERVE_FIXTURES_DIR) + "/engine/mixed_yarn_f32/model/config.json");
  ASSERT_GT(seed.size(), 100u);
  Replay(seed, 99, 5000, testing::FuzzModelConfig);
}

TEST(FuzzSmokeTest, MutatedSafetensorsNeverCrashTheParser) {
  const std::string dir = testing::MakeTempDir("fuzz_seed");
  testing::WriteSafetensors(dir + "/seed.safetensors",
                            {{"a", "F32", {2, 3}, testing::F32Bytes({1, 2, 3, 4, 5, 6})},
                             {"b", "F4", {2, 4}, std::string(4, '\x21')},
                             {"c", "I64", {1}, testing::I64Bytes({7})}});
  const std::vector<uint8_t> seed = ReadFile(dir + "/seed.safetensors");
  ASSERT_GT(seed.size(), 16u);
  Replay(seed, 1234, 20000, testing::FuzzSafetensorsHeader);
}

}  // namespace
}  // namespace pdserve::engine
