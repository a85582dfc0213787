// common/model_fingerprint.h on copies of the bundled model and on small made-up directories.
#include "common/model_fingerprint.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace pdserve::common {
namespace {

namespace fs = std::filesystem;

class ModelFingerprintTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("pdserve_fingerprint_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A copy of the bundled model's files that a worker reads.
  fs::path CopyBundled(const std::string& name) {
    const fs::path dir = root_ / name;
    fs::create_directories(dir);
    for (const char* file : {"config.json", "generation_config.json", "tokenizer.json",
                             "tokenizer_config.json", "model.safetensors"}) {
      fs::copy_file(fs::path(PDSERVE_BUNDLED_MODEL) / file, dir / file);
    }
    return dir;
  }
  static void Write(const fs::path& path, const std::string& text) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  }
  static void FlipByte(const fs::path& path, std::streamoff offset) {
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(offset);
    char c = 0;
    f.get(c);
    f.seekp(offset);
    f.put(static_cast<char>(c ^ 0x5a));
  }
  static uint64_t Fingerprint(const fs::path& dir) {
    absl::StatusOr<uint64_t> f = ModelFingerprint(dir.string());
    EXPECT_TRUE(f.ok()) << f.status();
    return f.value_or(0);
  }
  // A safetensors file: 8-byte little-endian header length, the header, `data_bytes` bytes.
  static void WriteSafetensors(const fs::path& path, const std::string& header, size_t data_bytes) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    bytes += header;
    for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<char>(i * 7));
    Write(path, bytes);
  }

  fs::path root_;
};

TEST_F(ModelFingerprintTest, ACopyElsewhereFingerprintsAlike) {
  const uint64_t original = Fingerprint(PDSERVE_BUNDLED_MODEL);
  EXPECT_NE(original, 0u);
  EXPECT_EQ(Fingerprint(CopyBundled("a")), original);
  EXPECT_EQ(FingerprintHex(0x1234), "0000000000001234");
}

// Logs print the hex digits and the decimal number the Health RPC's uint64 field shows.
TEST(FingerprintTextTest, HexAndTheHealthRpcsDecimal) {
  EXPECT_EQ(FingerprintText(42), "0x000000000000002a (42)");
  EXPECT_EQ(FingerprintText(0xfedcba9876543210), "0xfedcba9876543210 (18364758544493064720)");
}

TEST_F(ModelFingerprintTest, ConfigTokenizerAndSampledWeightBytesChangeIt) {
  const uint64_t original = Fingerprint(PDSERVE_BUNDLED_MODEL);
  const fs::path config = CopyBundled("config");
  Write(config / "config.json", "{}");
  EXPECT_NE(Fingerprint(config), original);

  const fs::path tokenizer = CopyBundled("tokenizer");
  FlipByte(tokenizer / "tokenizer.json", 1000);
  EXPECT_NE(Fingerprint(tokenizer), original);

  // The header (a tensor's name, dtype, shape or offsets) is hashed whole.
  const fs::path header = CopyBundled("header");
  FlipByte(header / "model.safetensors", 40);
  EXPECT_NE(Fingerprint(header), original);

  // The first and the last bytes of the data are in samples.
  const fs::path last = CopyBundled("last");
  FlipByte(last / "model.safetensors",
           static_cast<std::streamoff>(fs::file_size(last / "model.safetensors") - 1));
  EXPECT_NE(Fingerprint(last), original);
}

TEST_F(ModelFingerprintTest, RandomWeightSeedsDiffer) {
  const fs::path a = root_ / "seed7", b = root_ / "seed8", c = root_ / "seed7again";
  for (const fs::path& dir : {a, b, c}) {
    fs::create_directories(dir);
    fs::copy_file(fs::path(PDSERVE_BUNDLED_MODEL) / "config.json", dir / "config.json");
  }
  Write(a / "random_weights.json", R"({"seed": 7})");
  Write(b / "random_weights.json", R"({"seed": 8})");
  Write(c / "random_weights.json", R"({"seed": 7})");
  EXPECT_TRUE(HasWeightsFiles(a.string()));
  EXPECT_NE(Fingerprint(a), Fingerprint(b));
  EXPECT_EQ(Fingerprint(a), Fingerprint(c));
}

TEST_F(ModelFingerprintTest, ShardedCheckpointHashesEveryShardOfTheIndex) {
  const fs::path dir = root_ / "sharded";
  fs::create_directories(dir);
  Write(dir / "config.json", "{}");
  Write(dir / "model.safetensors.index.json",
        R"({"weight_map": {"a.weight": "s-1.safetensors", "b.weight": "s-2.safetensors"}})");
  WriteSafetensors(dir / "s-1.safetensors", R"({"a.weight":{"dtype":"F32"}})", 100000);
  WriteSafetensors(dir / "s-2.safetensors", R"({"b.weight":{"dtype":"F32"}})", 100000);
  const uint64_t before = Fingerprint(dir);
  FlipByte(dir / "s-2.safetensors",  // the second shard's last byte
           static_cast<std::streamoff>(fs::file_size(dir / "s-2.safetensors") - 1));
  EXPECT_NE(Fingerprint(dir), before);
}

TEST_F(ModelFingerprintTest, RefusesMissingConfigAndTruncatedSafetensors) {
  const fs::path empty = root_ / "empty";
  fs::create_directories(empty);
  EXPECT_FALSE(HasWeightsFiles(empty.string()));
  EXPECT_EQ(ModelFingerprint(empty.string()).status().code(), absl::StatusCode::kNotFound);
  const fs::path cut = root_ / "cut";
  fs::create_directories(cut);
  Write(cut / "config.json", "{}");
  WriteSafetensors(cut / "model.safetensors", R"({"a":1})", 0);
  fs::resize_file(cut / "model.safetensors", 10);  // the header says 7 bytes; 2 are there
  EXPECT_EQ(ModelFingerprint(cut.string()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::common
