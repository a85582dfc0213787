// The FP8 e4m3 block-scaled matrices of a checkpoint as stored: the bytes stay in the mmapped
// safetensors shards and are handed out tensor by tensor, so a GPU engine can copy them to the
// device without a float32 copy of the tensor on the host (engine/gpu/gpu_model.h,
// WeightFormat::kFp8Block).
//
// Which tensors: every whole (not per-expert) tensor stored F8_E4M3 with a 2-D shape and its block
// scales beside it (`<module>.scale` under DeepSeek's names, `<name>_scale_inv` under
// transformers'; engine/weights.h, BlockScaleNames), under its canonical (transformers) name
// (engine/checkpoint_layout.h). The scales are [ceil(rows / 128), ceil(cols / 128)], one per
// 128 x 128 block, stored F32, BF16 or F8_E8M0 and returned as fp32. Routed experts are not listed
// (they are stacked from per-expert tensors; a later step).
//
// Host memory: the shards are mapped read-only (pages the kernel can drop), a Get() copies only
// the scales (1 / 16384 of the weight's elements). Thread-safety: immutable after Open;
// concurrent Get() calls are safe.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/safetensors.h"

namespace pdserve::engine {

// One stored FP8 matrix: weight [rows, cols] e4m3 row-major inside the file mapping (valid while
// its StoredFp8Weights lives), scales [ceil(rows / 128), ceil(cols / 128)] fp32 row-major.
struct StoredFp8Matrix {
  std::span<const uint8_t> weight;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> scales;
};

class StoredFp8Weights {
 public:
  // Opens model_dir's checkpoint (engine/weights.h, OpenCheckpointFiles: headers parsed, data
  // mapped) and lists its FP8 block-scaled matrices. NotFound without a checkpoint; the files'
  // errors; InvalidArgument for an FP8 matrix whose scales are missing or of the wrong shape or
  // dtype (naming file and tensor). A checkpoint without FP8 tensors opens with none listed.
  static absl::StatusOr<StoredFp8Weights> Open(const std::string& model_dir);

  // Canonical names of the listed matrices, sorted.
  std::vector<std::string> Names() const;
  bool Has(std::string_view canonical) const { return entries_.count(canonical) > 0; }
  // The matrix stored for canonical name `canonical`, or NotFound; its bytes are not copied.
  absl::StatusOr<StoredFp8Matrix> Get(std::string_view canonical) const;
  // Drops the mapped pages of `canonical`'s weight once its bytes are copied elsewhere
  // (SafetensorsFile::Release); the spans Get() returned stay valid (read again from the file).
  // Unknown names are ignored.
  void Release(std::string_view canonical) const;

 private:
  struct Entry {
    size_t file = 0;
    std::string weight;  // stored names
    std::string scale;
  };
  std::vector<SafetensorsFile> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

// weight * scale per 128 x 128 block into float32 [rows, cols]: the values engine::Weights::Load
// gives for the same tensor (engine/quant.h, DequantizeFp8). For a matrix a GPU keeps in bf16.
std::vector<float> DequantizeStored(const StoredFp8Matrix& m);

}  // namespace pdserve::engine
