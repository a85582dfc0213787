// The routed experts of a checkpoint in their stored precision, handed out expert by expert as
// FP8 e4m3 with 128 x 128 block scales, the format kernels/cuda/moe_gemm.cuh reads.
//
// FP8 experts are passed through (bytes copied from the mapping, scales converted to fp32). FP4
// experts (e2m1 + one scale per 1 x 32 group, DeepSeek-V4's release) become FP8 here, on the host,
// one expert at a time: moe_gemm.cuh measured FP4 instruction-bound (24-37% of the read floor on
// an H200) and FP8 at 81-82%, so the GPU holds FP8. The conversion (Fp4ToFp8Blocks) is exact for
// every group whose scale is within 2^-14 of its block's largest scale (ue8m0 scales: powers of
// two); smaller ones are rounded to the nearest e4m3 (ties to even).
//
// Which tensors: the per-expert pieces (DeepSeek's `layers.N.ffn.experts.E.w1/w2/w3.weight`, or
// transformers' per-expert names) stored F8_E4M3 or packed FP4 (I8 / U8 / F4) with scales
// (engine/weights.h, BlockScaleNames). A stacked canonical tensor is listed only when every one
// of its experts' pieces is there in one of those formats.
//
// Host memory: the shards stay mapped read-only; Expert() copies one expert (2I x H bytes for
// gate_up) and drops the mapped pages it read (SafetensorsFile::Release).
// Thread-safety: immutable after Open; concurrent Expert() calls are safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/safetensors.h"

namespace pdserve::engine {

// One expert's matrix as FP8: weight [rows, cols] e4m3 row-major; scales
// [ceil(rows / 128), cols / 128] fp32 row-major; value = e4m3(w) * scale[r / 128][c / 128].
struct Fp8Blocks {
  std::vector<uint8_t> weight;
  std::vector<float> scales;
  int64_t rows = 0;
  int64_t cols = 0;
};

// FP4 -> FP8, the CPU reference and the loader's conversion alike.
//   packed [rows, cols / 2] (element 2i in the low nibble of byte i); group_scales [rows, cols /
//   32] fp32 (the stored ue8m0 / bf16 / f32 scales as values); cols a multiple of 128.
// Per 128 x 128 block: S = max finite group scale * 2^-6 (so 6 * 2^6 = 384 <= 448 fits), each
// element e2m1 * (s_group / S) rounded to e4m3 (ties to the even code). A NaN or Inf group scale
// makes its 32 elements NaN (0x7F) and is left out of the block's maximum; a block without a
// positive finite scale gets S = 0 and zero codes (its values are 0, as e2m1 * 0).
Fp8Blocks Fp4ToFp8Blocks(const uint8_t* packed, const float* group_scales, int64_t rows,
                         int64_t cols);

class StoredExperts {
 public:
  // Opens model_dir's checkpoint (engine/weights.h, OpenCheckpointFiles) and lists the stacked
  // expert tensors `config` requires whose pieces are all stored FP8 or FP4 with scales. NotFound
  // without a checkpoint; the files' errors. Shapes and scales are checked by Weights::Load, which
  // runs first; a piece that disagrees with the config is an InvalidArgument from Expert().
  static absl::StatusOr<StoredExperts> Open(const std::string& model_dir,
                                            const ModelConfig& config);

  // True when every expert of canonical `…experts.gate_up_proj` / `…experts.down_proj` is stored
  // quantized (FP8 or FP4).
  bool Has(std::string_view canonical) const;
  // Expert `expert` of `canonical` as FP8: gate_up [2 * I, H] (w1's rows, then w3's; the two are
  // separate 128-row scale blocks when I is a multiple of 128), down [H, I]. NotFound when not
  // listed; InvalidArgument for a piece of the wrong shape, naming file and tensor.
  absl::StatusOr<Fp8Blocks> Expert(std::string_view canonical, int64_t expert) const;

 private:
  struct Piece {
    size_t file = 0;
    std::string weight;
    size_t scale_file = 0;
    std::string scale;
    bool fp4 = false;
  };
  // (canonical, expert) -> w1 / w3 (gate_up) or w2 (down).
  using Key = std::pair<std::string, int64_t>;
  absl::Status AppendPiece(const Piece& piece, int64_t rows, int64_t cols, Fp8Blocks* out) const;

  ModelConfig config_;
  std::vector<SafetensorsFile> files_;
  std::map<Key, std::vector<Piece>, std::less<>> pieces_;
  std::map<std::string, int64_t, std::less<>> complete_;
};

}  // namespace pdserve::engine
