#include "engine/stored_experts.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/checkpoint_layout.h"
#include "engine/quant.h"
#include "engine/weights.h"
#include "kernels/cpu/fp8_gemm.h"

namespace pdserve::engine {
namespace {

constexpr uint8_t kE4m3Nan = 0x7F;

bool IsFp4(DType d) { return d == DType::kF4 || d == DType::kI8 || d == DType::kU8; }

size_t PieceIndex(TensorTarget::Part part) { return part == TensorTarget::Part::kExpertUp ? 1 : 0; }

}  // namespace

Fp8Blocks Fp4ToFp8Blocks(const uint8_t* packed, const float* group_scales, int64_t rows,
                         int64_t cols) {
  Fp8Blocks out;
  out.rows = rows;
  out.cols = cols;
  const int64_t row_blocks = (rows + kFp8BlockRows - 1) / kFp8BlockRows;
  const int64_t col_blocks = cols / kFp8BlockCols;
  const int64_t groups = cols / kFp4BlockCols;
  out.weight.resize(static_cast<size_t>(rows * cols));
  out.scales.assign(static_cast<size_t>(row_blocks * col_blocks), 0.0f);
  std::array<float, 16> e2m1{};
  for (uint8_t n = 0; n < 16; ++n) e2m1[n] = E2M1ToFloat(n);
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    const int64_t r0 = rb * kFp8BlockRows;
    const int64_t r1 = std::min(rows, r0 + kFp8BlockRows);
    for (int64_t cb = 0; cb < col_blocks; ++cb) {
      const int64_t g0 = cb * (kFp8BlockCols / kFp4BlockCols);
      const int64_t g1 = g0 + kFp8BlockCols / kFp4BlockCols;
      float smax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t g = g0; g < g1; ++g) {
          const float s = group_scales[r * groups + g];
          if (std::isfinite(s)) smax = std::max(smax, std::fabs(s));
        }
      }
      const float block_scale = smax > 0.0f ? std::ldexp(smax, -6) : 0.0f;
      out.scales[static_cast<size_t>(rb * col_blocks + cb)] = block_scale;
      // One code per nibble and group scale: the block's groups mostly share a few scales
      // (ue8m0: powers of two), so the 16 roundings are made once per distinct scale.
      std::vector<std::pair<float, std::array<uint8_t, 16>>> codes;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t g = g0; g < g1; ++g) {
          const float s = group_scales[r * groups + g];
          auto hit = std::find_if(codes.begin(), codes.end(), [&](const auto& c) {
            return c.first == s || (std::isnan(c.first) && std::isnan(s));
          });
          if (hit == codes.end()) {
            std::array<uint8_t, 16> code{};
            for (size_t n = 0; n < 16; ++n) {
              if (!std::isfinite(s)) {
                code[n] = kE4m3Nan;
              } else if (block_scale > 0.0f) {
                code[n] = kernels::cpu::E4m3FromFloat(e2m1[n] * (s / block_scale));
              }
            }
            codes.emplace_back(s, code);
            hit = codes.end() - 1;
          }
          const std::array<uint8_t, 16>& code = hit->second;
          const uint8_t* in = packed + r * (cols / 2) + g * (kFp4BlockCols / 2);
          uint8_t* dst = out.weight.data() + r * cols + g * kFp4BlockCols;
          for (int64_t i = 0; i < kFp4BlockCols / 2; ++i) {
            dst[2 * i] = code[in[i] & 0xF];
            dst[2 * i + 1] = code[in[i] >> 4];
          }
        }
      }
    }
  }
  return out;
}

absl::StatusOr<StoredExperts> StoredExperts::Open(const std::string& model_dir,
                                                  const ModelConfig& config) {
  StoredExperts out;
  out.config_ = config;
  PDSERVE_ASSIGN_OR_RETURN(out.files_, OpenCheckpointFiles(model_dir));
  std::map<std::string, size_t, std::less<>> file_of;
  for (size_t f = 0; f < out.files_.size(); ++f) {
    for (const TensorInfo& info : out.files_[f].tensors()) file_of[info.name] = f;
  }
  std::map<std::string, int64_t, std::less<>> pieces_per_name;
  for (size_t f = 0; f < out.files_.size(); ++f) {
    for (const TensorInfo& info : out.files_[f].tensors()) {
      const bool fp4 = IsFp4(info.dtype);
      if ((info.dtype != DType::kF8E4M3 && !fp4) || info.shape.size() != 2) continue;
      const std::optional<TensorTarget> target = ResolveTensorName(info.name);
      if (!target || target->part == TensorTarget::Part::kWhole) continue;
      if (target->expert < 0 || target->expert >= config.n_routed_experts) continue;
      Piece piece{f, info.name, 0, "", fp4};
      for (const std::string& name : BlockScaleNames(info.name)) {
        auto it = file_of.find(name);
        if (piece.scale.empty() && it != file_of.end()) {
          piece.scale_file = it->second;
          piece.scale = name;
        }
      }
      if (piece.scale.empty()) continue;
      std::vector<Piece>& slots = out.pieces_[Key{target->canonical, target->expert}];
      slots.resize(target->part == TensorTarget::Part::kExpertDown ? 1 : 2);
      if (slots[PieceIndex(target->part)].weight.empty()) ++pieces_per_name[target->canonical];
      slots[PieceIndex(target->part)] = std::move(piece);
    }
  }
  for (const auto& [name, count] : pieces_per_name) {
    const int64_t want = config.n_routed_experts * (name.ends_with("down_proj") ? 1 : 2);
    if (count == want) out.complete_[name] = count;
  }
  return out;
}

bool StoredExperts::Has(std::string_view canonical) const { return complete_.count(canonical) > 0; }

absl::Status StoredExperts::AppendPiece(const Piece& piece, int64_t rows, int64_t cols,
                                        Fp8Blocks* out) const {
  const SafetensorsFile& file = files_[piece.file];
  const TensorInfo& info = *file.Find(piece.weight);
  const SafetensorsFile& scale_file = files_[piece.scale_file];
  const TensorInfo& scale_info = *scale_file.Find(piece.scale);
  const int64_t stored_cols = piece.fp4 && info.dtype != DType::kF4 ? cols / 2 : cols;
  const std::vector<int64_t> want_scale =
      piece.fp4
          ? std::vector<int64_t>{rows, cols / kFp4BlockCols}
          : std::vector<int64_t>{(rows + kFp8BlockRows - 1) / kFp8BlockRows, cols / kFp8BlockCols};
  if (info.shape != std::vector<int64_t>{rows, stored_cols} || scale_info.shape != want_scale ||
      cols % kFp8BlockCols != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": tensor \"", info.name, "\" ", info.ShapeString(), " with scales ",
        scale_info.ShapeString(), " is not an expert piece of [", rows, ", ", cols, "]"));
  }
  std::vector<float> scales(static_cast<size_t>(scale_info.NumElements()));
  PDSERVE_RETURN_IF_ERROR(
      ConvertToFloat(scale_info.dtype, scale_file.Bytes(scale_info), std::span<float>(scales)));
  const std::span<const uint8_t> bytes = file.Bytes(info);
  if (piece.fp4) {
    const Fp8Blocks q = Fp4ToFp8Blocks(bytes.data(), scales.data(), rows, cols);
    out->weight.insert(out->weight.end(), q.weight.begin(), q.weight.end());
    out->scales.insert(out->scales.end(), q.scales.begin(), q.scales.end());
  } else {
    out->weight.insert(out->weight.end(), bytes.begin(), bytes.end());
    out->scales.insert(out->scales.end(), scales.begin(), scales.end());
  }
  file.Release(info);
  scale_file.Release(scale_info);
  return absl::OkStatus();
}

absl::StatusOr<Fp8Blocks> StoredExperts::Expert(std::string_view canonical, int64_t expert) const {
  auto it = pieces_.find(Key{std::string(canonical), expert});
  if (!Has(canonical) || it == pieces_.end()) {
    return absl::NotFoundError(absl::StrCat("no quantized expert ", expert, " stored for \"",
                                            std::string(canonical), "\""));
  }
  const int64_t inter = config_.moe_intermediate_size;
  const int64_t hidden = config_.hidden_size;
  const bool down = canonical.ends_with("down_proj");
  if (!down && inter % kFp8BlockRows != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", std::string(canonical), "\": moe_intermediate_size ", inter,
                     " is not a multiple of ", kFp8BlockRows, " (w1 and w3 share no scale block)"));
  }
  Fp8Blocks out;
  out.rows = down ? hidden : 2 * inter;
  out.cols = down ? inter : hidden;
  out.weight.reserve(static_cast<size_t>(out.rows * out.cols));
  for (const Piece& piece : it->second) {
    PDSERVE_RETURN_IF_ERROR(AppendPiece(piece, down ? hidden : inter, down ? inter : hidden, &out));
  }
  return out;
}

}  // namespace pdserve::engine
