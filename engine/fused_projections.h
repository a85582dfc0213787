// Fused projections (issue 25's decode goal): the projections of one DeepSeek-V4 layer that read
// the same input, stacked along their output dimension into one weight so that one GEMM computes
// all of them (engine/gpu/gpu_model.h, GpuModelOptions::fused_projections). This file is the
// host-side layout: which projections form a group, where each part's rows go, and the stacking
// of weight rows and FP8 128 x 128 block scales. No CUDA.
//
// Groups (engine/gpu/gpu_model.cc, Attention and Moe, read the same input in one dtype path):
// - attention input (the attention sublayer's normalized input, `collapsed` as bf16): q_a_proj,
//   kv_proj, then on compressed layers the compressor's kv_proj and gate_proj, then on CSA
//   layers the indexer compressor's kv_proj and gate_proj and the indexer's weights_proj;
// - FFN input (the MoE sublayer's normalized input): the shared expert's gate_proj and up_proj.
// Not in a group: the MoE router (an fp32 GEMM of the same FFN input: another dtype path),
// q_b_proj and the indexer's q_b_proj (they read q_a's normalized output), o_a / o_b and the
// shared expert's down_proj (each reads its own input).
//
// Layout: part i's rows start at row_offset[i], a multiple of kFusedRowAlign (128), so each
// part's FP8 block scales start on a whole scale row of the stacked weight and keep their values;
// the rows between a part's end and the next part's offset are zero padding (zero weights, the
// part's last scale row covers them). The last part is not padded. On V4-Flash and V4-Pro every
// part but the last (the indexer's weights_proj, 64 rows) is a multiple of 128 rows: no padding
// there (tests/engine/fused_projections_test.cc).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"

namespace pdserve::engine {

inline constexpr int64_t kFusedRowAlign = 128;

// Where the parts of one group go in the stacked weight [rows, cols].
struct FusedLayout {
  std::vector<int64_t> part_rows;   // rows of each part, in stacking order
  std::vector<int64_t> row_offset;  // first row of each part (a multiple of kFusedRowAlign)
  int64_t rows = 0;                 // stacked rows: last offset + last part's rows
  int64_t cols = 0;                 // the common input width
  // Rows of zero padding between the parts.
  int64_t padding_rows() const;
  // Scale rows of the stacked FP8 weight: ceil(rows / 128).
  int64_t scale_rows() const;
};

// The layout of parts with `part_rows` rows each over inputs of width `cols`. InvalidArgument for
// no parts, a part of < 1 row or cols < 1.
absl::StatusOr<FusedLayout> PlanFusedLayout(const std::vector<int64_t>& part_rows, int64_t cols);

// The parts (part i: [part_rows[i], cols] row-major at parts[i]) stacked into [rows, cols]
// row-major at layout.row_offset, every other element T{} (zero).
template <typename T>
std::vector<T> StackRows(const FusedLayout& layout, const std::vector<const T*>& parts) {
  std::vector<T> out(static_cast<size_t>(layout.rows * layout.cols), T{});
  for (size_t i = 0; i < parts.size() && i < layout.part_rows.size(); ++i) {
    std::memcpy(out.data() + layout.row_offset[i] * layout.cols, parts[i],
                static_cast<size_t>(layout.part_rows[i] * layout.cols) * sizeof(T));
  }
  return out;
}

// FP8 block scales of the parts (part i: [ceil(part_rows[i] / 128), ceil(cols / 128)] fp32 at
// scales[i]) stacked into the stacked weight's [scale_rows(), ceil(cols / 128)]: part i's at scale
// row row_offset[i] / 128. Scale rows no part covers (none with this layout) stay 0.
std::vector<float> StackBlockScales(const FusedLayout& layout,
                                    const std::vector<const float*>& scales);

// Canonical weight names (engine/checkpoint_layout.h) of layer `layer`'s attention-input group
// and FFN-input group, in stacking order, and their output rows from `config`. A sliding layer's
// attention group is q_a and kv only.
struct FusedGroupSpec {
  std::vector<std::string> names;
  std::vector<int64_t> rows;
  int64_t cols = 0;
};
FusedGroupSpec AttentionInputGroup(const ModelConfig& config, int64_t layer);
FusedGroupSpec FfnInputGroup(const ModelConfig& config, int64_t layer);

// The widest stacked output of any group of `config` (the GPU engine's fused output buffer is
// [max_rows, this] fp32), and the padding rows of all groups of all layers together.
int64_t FusedOutputWidth(const ModelConfig& config);
int64_t FusedPaddingRows(const ModelConfig& config);

}  // namespace pdserve::engine
