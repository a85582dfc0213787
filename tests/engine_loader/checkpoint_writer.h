// Test helpers that write (possibly broken) safetensors checkpoints, so each loader test builds
// exactly the checkpoint it needs. Not thread-safe across tests that share a directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/tensor.h"

namespace pdserve::engine::testing {

// One tensor as it will be stored: header dtype string, header shape, raw little-endian bytes.
struct StoredTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string F32Bytes(const std::vector<float>& values);
// Round-to-nearest-even bfloat16.
std::string Bf16Bytes(const std::vector<float>& values);
std::string I64Bytes(const std::vector<int64_t>& values);
std::string I32Bytes(const std::vector<int32_t>& values);

// Writes `tensors` (in order) as a safetensors file at `path`.
void WriteSafetensors(const std::string& path, const std::vector<StoredTensor>& tensors);

// A fresh empty directory under the test temp dir, unique per call.
std::string MakeTempDir(const std::string& stem);

// Copies a file (config.json and friends).
void CopyFile(const std::string& from, const std::string& to);

// All tensors of a fixture checkpoint file as stored (raw bytes kept).
std::vector<StoredTensor> ReadAllTensors(const std::string& safetensors_path);

}  // namespace pdserve::engine::testing
