#include "tests/engine_loader/checkpoint_writer.h"

#include <atomic>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/safetensors.h"
#include "gtest/gtest.h"

namespace pdserve::engine::testing {

namespace {
template <typename T>
std::string RawBytes(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}
}  // namespace

std::string F32Bytes(const std::vector<float>& values) { return RawBytes(values); }
std::string I64Bytes(const std::vector<int64_t>& values) { return RawBytes(values); }
std::string I32Bytes(const std::vector<int32_t>& values) { return RawBytes(values); }

std::string Bf16Bytes(const std::vector<float>& values) {
  std::vector<uint16_t> halves;
  for (float v : values) {
    const uint32_t bits = std::bit_cast<uint32_t>(v);
    const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
    halves.push_back(static_cast<uint16_t>((bits + rounding) >> 16));
  }
  return RawBytes(halves);
}

void WriteSafetensors(const std::string& path, const std::vector<StoredTensor>& tensors) {
  std::vector<TensorBytes> out;
  for (const StoredTensor& t : tensors) {
    const std::optional<DType> dtype = DTypeFromName(t.dtype);
    ASSERT_TRUE(dtype.has_value()) << t.dtype;
    out.push_back({t.name, *dtype, t.shape, t.bytes});
  }
  const absl::Status status = engine::WriteSafetensors(path, out);
  ASSERT_TRUE(status.ok()) << status;
}

std::string MakeTempDir(const std::string& stem) {
  static std::atomic<int> counter{0};
  const std::string dir = ::testing::TempDir() + "/pdserve_loader_" + stem + "_" +
                          std::to_string(::getpid()) + "_" + std::to_string(counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void CopyFile(const std::string& from, const std::string& to) {
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
}

std::vector<StoredTensor> ReadAllTensors(const std::string& safetensors_path) {
  std::vector<StoredTensor> out;
  auto file = SafetensorsFile::Open(safetensors_path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (const TensorInfo& info : file->tensors()) {
    auto bytes = file->Bytes(info);
    out.push_back({info.name, DTypeName(info.dtype), info.shape,
                   std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size())});
  }
  return out;
}

}  // namespace pdserve::engine::testing
