// SafetensorsFile / ParseSafetensors: a valid file round-trips, each malformed header is a precise
// error naming the file (and tensor), never a crash.
#include "engine/safetensors.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine_loader/checkpoint_writer.h"

namespace pdserve::engine {
namespace {

using testing::F32Bytes;
using ::testing::HasSubstr;
using testing::StoredTensor;

std::vector<uint8_t> FileWithHeader(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> file(8 + header.size() + data_bytes, 0);
  uint64_t len = header.size();
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = (len >> (8 * i)) & 0xff;
  std::copy(header.begin(), header.end(), file.begin() + 8);
  return file;
}

std::string ParseError(const std::string& header, size_t data_bytes) {
  const std::vector<uint8_t> file = FileWithHeader(header, data_bytes);
  auto layout = ParseSafetensors(file, "f.safetensors");
  EXPECT_FALSE(layout.ok());
  return layout.ok() ? "" : std::string(layout.status().message());
}

TEST(SafetensorsTest, OpensAndReadsTensorBytes) {
  const std::string dir = testing::MakeTempDir("st_ok");
  const std::string path = dir + "/a.safetensors";
  testing::WriteSafetensors(path, {StoredTensor{"x", "F32", {2, 2}, F32Bytes({1, 2, 3, 4})},
                                   StoredTensor{"y", "F32", {1}, F32Bytes({5})}});
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors().size(), 2u);
  const TensorInfo* y = file->Find("y");
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->dtype, DType::kF32);
  float value = 0;
  std::memcpy(&value, file->Bytes(*y).data(), 4);
  EXPECT_EQ(value, 5.0f);
  EXPECT_EQ(file->Find("z"), nullptr);
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  auto file = SafetensorsFile::Open("/nonexistent/model.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("/nonexistent/model.safetensors"));
}

TEST(SafetensorsTest, FileShorterThanLengthPrefix) {
  const std::vector<uint8_t> file = {1, 2, 3};
  auto layout = ParseSafetensors(file, "f.safetensors");
  ASSERT_FALSE(layout.ok());
  EXPECT_THAT(layout.status().message(), HasSubstr("f.safetensors: bad safetensors header"));
}

TEST(SafetensorsTest, HeaderLengthBeyondFileIsTruncation) {
  std::vector<uint8_t> file = FileWithHeader("{}", 0);
  file[0] = 200;
  auto layout = ParseSafetensors(file, "f.safetensors");
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(layout.status().message(), HasSubstr("header length 200 exceeds the file"));
}

TEST(SafetensorsTest, HeaderThatIsNotJson) {
  EXPECT_THAT(ParseError("{not json", 0), HasSubstr("header is not valid JSON"));
}

TEST(SafetensorsTest, UnknownDtypeNamesTensor) {
  EXPECT_THAT(ParseError(R"({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}})", 1),
              HasSubstr("tensor \"w\" has unknown dtype \"F7\""));
}

TEST(SafetensorsTest, ByteCountMustMatchShapeAndDtype) {
  EXPECT_THAT(
      ParseError(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", 24),
      HasSubstr("tensor \"w\" holds 20 bytes but F32 [2, 3] needs 24"));
}

TEST(SafetensorsTest, NegativeDimensionIsRejected) {
  EXPECT_THAT(ParseError(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4),
              HasSubstr("not a non-negative integer"));
}

TEST(SafetensorsTest, OffsetsPastDataSectionAreTruncation) {
  const std::vector<uint8_t> file =
      FileWithHeader(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8);
  auto layout = ParseSafetensors(file, "f.safetensors");
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(layout.status().message(),
              HasSubstr("tensor \"w\": data_offsets [0, 16) run past the end of the data section "
                        "(8 bytes): file truncated"));
}

TEST(SafetensorsTest, OverflowingShapeIsRejected) {
  EXPECT_THAT(ParseError(R"({"w": {"dtype": "F64", "shape": [4294967296, 4294967296],
                                  "data_offsets": [0, 0]}})",
                         0),
              HasSubstr("too many elements"));
}

TEST(SafetensorsTest, PackedF4CountsElementsInShape) {
  // safetensors records float4_e2m1fn_x2 as "F4" with the element (not byte) count.
  const std::vector<uint8_t> file =
      FileWithHeader(R"({"w": {"dtype": "F4", "shape": [2, 8], "data_offsets": [0, 8]}})", 8);
  auto layout = ParseSafetensors(file, "f.safetensors");
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->tensors[0].NumElements(), 16);
}

TEST(SafetensorsTest, TruncatedFileOnDiskNamesFileAndTensor) {
  const std::string dir = testing::MakeTempDir("st_trunc");
  const std::string path = dir + "/a.safetensors";
  testing::WriteSafetensors(path, {StoredTensor{"x", "F32", {4}, F32Bytes({1, 2, 3, 4})}});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 3);
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_THAT(file.status().message(), HasSubstr(path + ": tensor \"x\""));
  EXPECT_THAT(file.status().message(), HasSubstr("file truncated"));
}

TEST(SafetensorsTest, WriterRejectsByteCountMismatch) {
  const std::string dir = testing::MakeTempDir("st_write");
  const std::string bytes(10, '\0');
  const absl::Status status =
      WriteSafetensors(dir + "/a.safetensors", {TensorBytes{"x", DType::kF32, {3}, bytes}});
  EXPECT_THAT(status.message(), HasSubstr("tensor \"x\": 10 bytes do not fit F32 3"));
}

}  // namespace
}  // namespace pdserve::engine
