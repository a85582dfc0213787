#include "engine/stored_fp8.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/checkpoint_layout.h"
#include "engine/quant.h"
#include "engine/weights.h"

namespace pdserve::engine {
namespace {

int64_t BlocksOf(int64_t n) { return (n + kFp8BlockRows - 1) / kFp8BlockRows; }

}  // namespace

absl::StatusOr<StoredFp8Weights> StoredFp8Weights::Open(const std::string& model_dir) {
  StoredFp8Weights out;
  PDSERVE_ASSIGN_OR_RETURN(out.files_, OpenCheckpointFiles(model_dir));
  for (size_t f = 0; f < out.files_.size(); ++f) {
    const SafetensorsFile& file = out.files_[f];
    for (const TensorInfo& info : file.tensors()) {
      if (info.dtype != DType::kF8E4M3 || info.shape.size() != 2) continue;
      const std::optional<TensorTarget> target = ResolveTensorName(info.name);
      if (!target || target->part != TensorTarget::Part::kWhole) continue;
      const TensorInfo* scale = nullptr;
      for (const std::string& name : BlockScaleNames(info.name)) {
        for (const SafetensorsFile& other : out.files_) {
          if (scale == nullptr) scale = other.Find(name);
        }
      }
      const std::string where = absl::StrCat(file.path(), ": tensor \"", info.name, "\"");
      if (scale == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": F8_E4M3 without block scales"));
      }
      const std::vector<int64_t> want = {BlocksOf(info.shape[0]), BlocksOf(info.shape[1])};
      const bool dtype_ok = scale->dtype == DType::kF32 || scale->dtype == DType::kBF16 ||
                            scale->dtype == DType::kF8E8M0;
      if (scale->shape != want || !dtype_ok) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": scales \"", scale->name, "\" are ", DTypeName(scale->dtype), " ",
                         scale->ShapeString(), ", expected F32 / BF16 / F8_E8M0 [", want[0], ", ",
                         want[1], "]"));
      }
      // The scales may sit in another shard: find its file again at Get time by name.
      out.entries_[target->canonical] = Entry{f, info.name, scale->name};
    }
  }
  return out;
}

std::vector<std::string> StoredFp8Weights::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

absl::StatusOr<StoredFp8Matrix> StoredFp8Weights::Get(std::string_view canonical) const {
  auto it = entries_.find(canonical);
  if (it == entries_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no FP8 block-scaled tensor stored for \"", std::string(canonical), "\""));
  }
  const SafetensorsFile& file = files_[it->second.file];
  const TensorInfo* info = file.Find(it->second.weight);
  const TensorInfo* scale = nullptr;
  const SafetensorsFile* scale_file = nullptr;
  for (const SafetensorsFile& other : files_) {
    if (scale == nullptr && (scale = other.Find(it->second.scale)) != nullptr) scale_file = &other;
  }
  StoredFp8Matrix m;
  m.weight = file.Bytes(*info);
  m.rows = info->shape[0];
  m.cols = info->shape[1];
  m.scales.resize(static_cast<size_t>(scale->NumElements()));
  PDSERVE_RETURN_IF_ERROR(ConvertToFloat(scale->dtype, scale_file->Bytes(*scale), m.scales));
  return m;
}

void StoredFp8Weights::Release(std::string_view canonical) const {
  auto it = entries_.find(canonical);
  if (it == entries_.end()) return;
  const SafetensorsFile& file = files_[it->second.file];
  if (const TensorInfo* info = file.Find(it->second.weight)) file.Release(*info);
}

std::vector<float> DequantizeStored(const StoredFp8Matrix& m) {
  std::vector<float> out(static_cast<size_t>(m.rows * m.cols));
  DequantizeFp8(m.weight.data(), m.rows, m.cols, m.scales.data(), out.data());
  return out;
}

}  // namespace pdserve::engine
