// Replays deterministic mutations of a valid safetensors file through the fuzz target, so the
// header parser's robustness is checked in every build (the libFuzzer binary needs clang).
#include <cstdint>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine_loader/checkpoint_writer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace pdserve::engine {
namespace {

TEST(HeaderFuzzSmokeTest, MutatedFilesNeverCrashTheParser) {
  const std::string dir = testing::MakeTempDir("fuzz_seed");
  testing::WriteSafetensors(dir + "/seed.safetensors",
                            {{"a", "F32", {2, 3}, testing::F32Bytes({1, 2, 3, 4, 5, 6})},
                             {"b", "F4", {2, 4}, std::string(4, '\x21')},
                             {"c", "I64", {1}, testing::I64Bytes({7})}});
  std::ifstream in(dir + "/seed.safetensors", std::ios::binary);
  const std::vector<uint8_t> seed((std::istreambuf_iterator<char>(in)),
                                  std::istreambuf_iterator<char>());
  ASSERT_GT(seed.size(), 16u);
  LLVMFuzzerTestOneInput(seed.data(), seed.size());

  std::mt19937 rng(1234);
  const std::string tokens[] = {"{",
                                "}",
                                "[",
                                "]",
                                ",",
                                ":",
                                "\"",
                                "-1",
                                "1e30",
                                "18446744073709551615",
                                "\"dtype\"",
                                "\"shape\"",
                                "\"data_offsets\"",
                                "null",
                                "\"F4\""};
  for (int iter = 0; iter < 20000; ++iter) {
    std::vector<uint8_t> bytes = seed;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[pos] = static_cast<uint8_t>(rng());
          break;
        case 1:
          bytes.resize(pos);
          break;
        case 2: {
          const std::string& t = tokens[rng() % std::size(tokens)];
          bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(pos), t.begin(), t.end());
          break;
        }
        default:
          bytes[pos % 8] = static_cast<uint8_t>(rng());  // the header length prefix
          break;
      }
      if (bytes.empty()) break;
    }
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
}

}  // namespace
}  // namespace pdserve::engine
