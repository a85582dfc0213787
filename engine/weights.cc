#include "engine/weights.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine/checkpoint_layout.h"
#include "engine/quant.h"
#include "engine/safetensors.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

using Json = nlohmann::json;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

// A tensor as stored: which file, which header entry.
struct Stored {
  const SafetensorsFile* file = nullptr;
  const TensorInfo* info = nullptr;
};

std::string Where(const Stored& s) {
  return absl::StrCat(s.file->path(), ": tensor \"", s.info->name, "\"");
}

absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Opens model.safetensors, or every shard model.safetensors.index.json names, and checks that
// each tensor the index lists is in the shard it names.
absl::StatusOr<std::vector<SafetensorsFile>> OpenFiles(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string index_path = absl::StrCat(dir, "/", kIndexFile);
  std::vector<SafetensorsFile> files;
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    const std::string single = absl::StrCat(dir, "/", kSingleFile);
    if (!fs::exists(single, ec)) {
      return absl::NotFoundError(absl::StrCat(dir, ": no checkpoint: neither ", kSingleFile,
                                              " nor ", kIndexFile, " exists"));
    }
    PDSERVE_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single));
    files.push_back(std::move(file));
    return files;
  }
  PDSERVE_ASSIGN_OR_RETURN(std::string text, ReadText(index_path));
  const Json index = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": malformed JSON"));
  }
  auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": no \"weight_map\" object"));
  }
  std::map<std::string, size_t> shard_of_file;
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    if (!it->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": weight_map entry \"", it.key(), "\" is not a file name"));
    }
    const std::string shard = it->get<std::string>();
    // Shards live beside the index; anything else could read files outside the model.
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry \"", it.key(),
                                                     "\" names bad shard \"", shard, "\""));
    }
    if (!shard_of_file.count(shard)) {
      PDSERVE_ASSIGN_OR_RETURN(SafetensorsFile file,
                               SafetensorsFile::Open(absl::StrCat(dir, "/", shard)));
      shard_of_file[shard] = files.size();
      files.push_back(std::move(file));
    }
    const SafetensorsFile& file = files[shard_of_file[shard]];
    if (file.Find(it.key()) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor \"", it.key(),
                                                     "\" is listed in ", file.path(),
                                                     ", which does not contain it"));
    }
  }
  return files;
}

bool IsQuantizedDType(DType t) {
  return t == DType::kF8E4M3 || t == DType::kF4 || t == DType::kI8 || t == DType::kU8;
}

// The block-scale companion of a quantized weight: `<module>.scale` under DeepSeek's names,
// `<module>.weight_scale_inv` under transformers' FP8 names.
const Stored* FindScale(const std::map<std::string, Stored, std::less<>>& stored,
                        std::string_view weight_name) {
  if (!weight_name.ends_with(".weight")) return nullptr;
  const std::string base(weight_name.substr(0, weight_name.size() - 7));
  for (const std::string& candidate :
       {absl::StrCat(base, ".scale"), absl::StrCat(base, ".weight_scale_inv")}) {
    auto it = stored.find(candidate);
    if (it != stored.end()) return &it->second;
  }
  return nullptr;
}

// Reads a block-scale tensor to float, checking its dtype and shape.
absl::StatusOr<std::vector<float>> ReadScales(const Stored& scale, const Stored& weight,
                                              const std::vector<int64_t>& expected_shape) {
  const TensorInfo& info = *scale.info;
  if (info.dtype != DType::kF32 && info.dtype != DType::kF8E8M0 && info.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(scale), ": wrong dtype ", DTypeName(info.dtype), " for the scales of ",
                     weight.info->name, " (expected F32, BF16 or F8_E8M0)"));
  }
  if (info.shape != expected_shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(scale), ": wrong shape ", info.ShapeString(), " for the scales of ",
                     weight.info->name, " ", weight.info->ShapeString(), ", expected [",
                     absl::StrJoin(expected_shape, ", "), "]"));
  }
  std::vector<float> values(static_cast<size_t>(info.NumElements()));
  PDSERVE_RETURN_IF_ERROR(ConvertToFloat(info.dtype, scale.file->Bytes(info), values));
  return values;
}

// Decodes one stored float tensor (plain, FP8 or FP4) of logical shape `shape` into `out`.
absl::Status DecodeFloat(const Stored& s, const Stored* scale, const std::vector<int64_t>& shape,
                         float* out) {
  const TensorInfo& info = *s.info;
  const int64_t n = Tensor::NumElements(shape);
  const bool fp8 = info.dtype == DType::kF8E4M3;
  const bool fp4 = info.dtype == DType::kF4 || info.dtype == DType::kI8 || info.dtype == DType::kU8;
  if (!fp8 && !fp4) {
    if (IsIntegerDType(info.dtype) || info.dtype == DType::kF8E5M2 ||
        info.dtype == DType::kF8E8M0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(s), ": wrong dtype ", DTypeName(info.dtype), " (expected F32, BF16 or F16)"));
    }
    return ConvertToFloat(info.dtype, s.file->Bytes(info), std::span<float>(out, n));
  }
  if (scale == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": ", DTypeName(info.dtype), " weight without its block scales (",
                     "expected a .scale or .weight_scale_inv tensor beside it)"));
  }
  if (shape.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": quantized tensors must have at least 2 dimensions"));
  }
  const int64_t cols = shape.back();
  const int64_t rows = shape[shape.size() - 2];
  const int64_t batch = n / std::max<int64_t>(rows * cols, 1);
  std::vector<int64_t> scale_shape(shape.begin(), shape.end() - 2);
  if (fp8) {
    scale_shape.push_back((rows + kFp8BlockRows - 1) / kFp8BlockRows);
    scale_shape.push_back((cols + kFp8BlockCols - 1) / kFp8BlockCols);
  } else {
    scale_shape.push_back(rows);
    scale_shape.push_back((cols + kFp4BlockCols - 1) / kFp4BlockCols);
  }
  if (fp4 && cols % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": packed FP4 rows need an even element count, got ", cols));
  }
  PDSERVE_ASSIGN_OR_RETURN(std::vector<float> scales, ReadScales(*scale, s, scale_shape));
  const uint8_t* bytes = s.file->Bytes(info).data();
  const int64_t scales_per_matrix = scale_shape[scale_shape.size() - 2] * scale_shape.back();
  for (int64_t b = 0; b < batch; ++b) {
    const float* sc = scales.data() + b * scales_per_matrix;
    if (fp8) {
      DequantizeFp8(bytes + b * rows * cols, rows, cols, sc, out + b * rows * cols);
    } else {
      DequantizeFp4(bytes + b * rows * cols / 2, rows, cols, sc, out + b * rows * cols);
    }
  }
  return absl::OkStatus();
}

// Integer tensors (tid2eid: expert ids) become float values; ids must name an expert.
absl::Status DecodeExpertIds(const Stored& s, int64_t n_experts, float* out) {
  const TensorInfo& info = *s.info;
  if (info.dtype != DType::kI32 && info.dtype != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": wrong dtype ", DTypeName(info.dtype), " (expected I32 or I64)"));
  }
  const int64_t n = info.NumElements();
  PDSERVE_RETURN_IF_ERROR(ConvertToFloat(info.dtype, s.file->Bytes(info), {out, size_t(n)}));
  for (int64_t i = 0; i < n; ++i) {
    if (!(out[i] >= 0 && out[i] < static_cast<float>(n_experts))) {
      return absl::InvalidArgumentError(absl::StrCat(Where(s), ": entry ", i, " is expert id ",
                                                     out[i], ", outside [0, ", n_experts, ")"));
    }
  }
  return absl::OkStatus();
}

// Logical element shape of a stored tensor: packed FP4 in I8 / U8 holds two per byte.
std::vector<int64_t> LogicalShape(const TensorInfo& info, bool has_scale) {
  std::vector<int64_t> shape = info.shape;
  if (has_scale && (info.dtype == DType::kI8 || info.dtype == DType::kU8) && !shape.empty()) {
    shape.back() *= 2;
  }
  return shape;
}

// Fills the canonical tensors from the stored ones and tracks what has been filled.
class Assembler {
 public:
  Assembler(const ModelConfig& config, std::map<std::string, RequiredTensor> specs)
      : config_(config), specs_(std::move(specs)) {}

  absl::Status Add(const Stored& s, const TensorTarget& target, const Stored* scale) {
    auto spec_it = specs_.find(target.canonical);
    if (spec_it == specs_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(Where(s), ": unexpected tensor (it would be ",
                                                     target.canonical,
                                                     ", which this config.json does not have)"));
    }
    const RequiredTensor& spec = spec_it->second;
    Tensor& dst = tensors_[target.canonical];
    if (dst.shape.empty()) dst = Tensor(spec.shape);

    std::vector<int64_t> want = spec.shape;
    int64_t offset = 0;
    if (target.part != TensorTarget::Part::kWhole) {
      if (target.expert >= config_.n_routed_experts) {
        return absl::InvalidArgumentError(absl::StrCat(Where(s), ": unexpected tensor (expert ",
                                                       target.expert, " but n_routed_experts is ",
                                                       config_.n_routed_experts, ")"));
      }
      const int64_t inter = config_.moe_intermediate_size, h = config_.hidden_size;
      want = target.part == TensorTarget::Part::kExpertDown ? std::vector<int64_t>{h, inter}
                                                            : std::vector<int64_t>{inter, h};
      offset = target.expert * Tensor::NumElements(want) *
               (target.part == TensorTarget::Part::kExpertDown ? 1 : 2);
      if (target.part == TensorTarget::Part::kExpertUp) offset += inter * h;
    }
    if (!MarkFilled(s, target)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(s), ": duplicate tensor: ", OriginalName(target), " / ",
                       target.canonical, " is already loaded from another stored name"));
    }
    const std::vector<int64_t> have = LogicalShape(*s.info, scale != nullptr);
    if (have != want) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(s), ": wrong shape ", s.info->ShapeString(), ", expected [",
                       absl::StrJoin(want, ", "), "] for ", target.canonical));
    }
    float* out = dst.ptr() + offset;
    if (spec.integer) return DecodeExpertIds(s, config_.n_routed_experts, out);
    return DecodeFloat(s, scale, want, out);
  }

  // NotFound naming the first missing tensor under both names, with a count of the rest.
  absl::Status CheckComplete(const std::string& dir) const {
    std::vector<TensorTarget> missing;
    for (const auto& [name, spec] : specs_) {
      if (name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj")) {
        MissingExperts(name, missing);
      } else if (!whole_filled_.count(name)) {
        missing.push_back(TensorTarget{name});
      }
    }
    if (missing.empty()) return absl::OkStatus();
    const TensorTarget& first = missing.front();
    return absl::NotFoundError(absl::StrCat(
        dir, ": missing tensor ", first.canonical,
        first.part == TensorTarget::Part::kWhole ? "" : absl::StrCat(" expert ", first.expert),
        " (DeepSeek name ", OriginalName(first), ")",
        missing.size() > 1 ? absl::StrCat(" and ", missing.size() - 1, " more") : ""));
  }

  std::map<std::string, Tensor, std::less<>> Release() { return std::move(tensors_); }

 private:
  // Slot bitmap per stacked experts tensor: gate_up has 2 slots per expert (w1, w3), down one.
  bool MarkFilled(const Stored& s, const TensorTarget& t) {
    (void)s;
    if (t.part == TensorTarget::Part::kWhole) {
      if (whole_filled_.count(t.canonical) || expert_slots_.count(t.canonical)) return false;
      whole_filled_.insert(t.canonical);
      return true;
    }
    if (whole_filled_.count(t.canonical)) return false;
    const int64_t per_expert = t.part == TensorTarget::Part::kExpertDown ? 1 : 2;
    std::vector<bool>& slots = expert_slots_[t.canonical];
    slots.resize(static_cast<size_t>(config_.n_routed_experts * per_expert));
    const size_t slot = static_cast<size_t>(t.expert * per_expert +
                                            (t.part == TensorTarget::Part::kExpertUp ? 1 : 0));
    if (slots[slot]) return false;
    slots[slot] = true;
    return true;
  }

  void MissingExperts(const std::string& name, std::vector<TensorTarget>& missing) const {
    if (whole_filled_.count(name)) return;
    const bool down = name.ends_with("down_proj");
    auto it = expert_slots_.find(name);
    for (int64_t e = 0; e < config_.n_routed_experts; ++e) {
      for (int part = 0; part < (down ? 1 : 2); ++part) {
        const size_t slot = static_cast<size_t>(e * (down ? 1 : 2) + part);
        if (it != expert_slots_.end() && it->second[slot]) continue;
        missing.push_back(TensorTarget{name,
                                       down        ? TensorTarget::Part::kExpertDown
                                       : part == 0 ? TensorTarget::Part::kExpertGate
                                                   : TensorTarget::Part::kExpertUp,
                                       e});
      }
    }
  }

  const ModelConfig& config_;
  std::map<std::string, RequiredTensor> specs_;
  std::map<std::string, Tensor, std::less<>> tensors_;
  std::set<std::string> whole_filled_;
  std::map<std::string, std::vector<bool>> expert_slots_;
};

}  // namespace

absl::StatusOr<Weights> Weights::Load(const std::string& model_dir, const ModelConfig& config) {
  PDSERVE_ASSIGN_OR_RETURN(std::vector<SafetensorsFile> files, OpenFiles(model_dir));

  std::map<std::string, Stored, std::less<>> stored;
  for (const SafetensorsFile& file : files) {
    for (const TensorInfo& info : file.tensors()) {
      auto [it, inserted] = stored.emplace(info.name, Stored{&file, &info});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            file.path(), ": tensor \"", info.name, "\" also appears in ", it->second.file->path()));
      }
    }
  }

  // Pair quantized weights with their scales first, so scales are not taken for weights.
  std::map<std::string, const Stored*, std::less<>> scale_of;
  std::set<std::string, std::less<>> scale_names;
  for (const auto& [name, s] : stored) {
    if (!IsQuantizedDType(s.info->dtype)) continue;
    if (const Stored* scale = FindScale(stored, name)) {
      scale_of[name] = scale;
      scale_names.insert(scale->info->name);
    }
  }

  Assembler assembler(config, RequiredTensors(config));
  for (const auto& [name, s] : stored) {
    if (scale_names.count(name) || IsIgnoredTensorName(name)) continue;
    const std::optional<TensorTarget> target = ResolveTensorName(name);
    if (!target) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(s), ": unexpected tensor (not a DeepSeek-V4 tensor name)"));
    }
    // Tied embeddings: transformers ignores a stored head and reuses the embeddings.
    if (config.tie_word_embeddings && target->canonical == "lm_head.weight") continue;
    auto scale_it = scale_of.find(name);
    PDSERVE_RETURN_IF_ERROR(
        assembler.Add(s, *target, scale_it == scale_of.end() ? nullptr : scale_it->second));
  }
  PDSERVE_RETURN_IF_ERROR(assembler.CheckComplete(model_dir));

  Weights weights;
  weights.tensors_ = assembler.Release();
  if (config.tie_word_embeddings) {
    weights.tensors_["lm_head.weight"] = weights.tensors_.at("model.embed_tokens.weight");
  }
  return weights;
}

absl::StatusOr<const Tensor*> Weights::Get(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("no weight named \"", std::string(name), "\""));
  }
  return &it->second;
}

const Tensor& Weights::At(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    std::fprintf(stderr, "pdserve: Weights::At: no weight named \"%.*s\"\n",
                 static_cast<int>(name.size()), name.data());
    std::abort();
  }
  return it->second;
}

}  // namespace pdserve::engine
