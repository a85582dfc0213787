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
#include "engine/random_weights.h"
#include "engine/safetensors.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

using Json = nlohmann::json;

constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kRandomFile[] = "random_weights.json";

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
absl::StatusOr<std::vector<SafetensorsFile>> OpenFilesImpl(const std::string& dir) {
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
// `<name>_scale_inv` under transformers' FP8 names (`….weight_scale_inv`, and
// `…experts.gate_up_proj_scale_inv` for the stacked experts).
const Stored* FindScale(const std::map<std::string, Stored, std::less<>>& stored,
                        std::string_view weight_name) {
  for (const std::string& candidate : BlockScaleNames(weight_name)) {
    auto it = stored.find(candidate);
    if (it != stored.end()) return &it->second;
  }
  return nullptr;
}

// How a stored tensor becomes float32.
enum class Encoding { kPlain, kFp8, kFp4, kExpertIds };

// One stored tensor, checked and placed: where its values go and how to decode them.
struct Job {
  Stored stored;
  const Stored* scale = nullptr;
  Encoding encoding = Encoding::kPlain;
  std::string canonical;
  int64_t offset = 0;          // element offset inside the canonical tensor
  std::vector<int64_t> shape;  // logical element shape of the stored tensor
};

// Logical element shape of a stored tensor: packed FP4 in I8 / U8 holds two per byte.
std::vector<int64_t> LogicalShape(const TensorInfo& info, bool has_scale) {
  std::vector<int64_t> shape = info.shape;
  if (has_scale && (info.dtype == DType::kI8 || info.dtype == DType::kU8) && !shape.empty()) {
    shape.back() *= 2;
  }
  return shape;
}

// Picks the encoding from the dtype and checks the block scales' dtype and shape.
absl::StatusOr<Encoding> CheckEncoding(const Stored& s, const Stored* scale, bool integer,
                                       const std::vector<int64_t>& shape) {
  const DType dtype = s.info->dtype;
  if (integer) {
    if (dtype == DType::kI32 || dtype == DType::kI64) return Encoding::kExpertIds;
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": wrong dtype ", DTypeName(dtype), " (expected I32 or I64)"));
  }
  if (dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16 ||
      dtype == DType::kF64) {
    return Encoding::kPlain;
  }
  const bool fp8 = dtype == DType::kF8E4M3;
  const bool fp4 = dtype == DType::kF4 || ((dtype == DType::kI8 || dtype == DType::kU8) && scale);
  if (!fp8 && !fp4) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": wrong dtype ", DTypeName(dtype), " (expected F32, BF16 or F16)"));
  }
  if (scale == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(s), ": ", DTypeName(dtype),
        " weight without its block scales (expected a .scale or .weight_scale_inv tensor beside "
        "it)"));
  }
  if (shape.size() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": quantized tensors must have at least 2 dimensions"));
  }
  const int64_t rows = shape[shape.size() - 2], cols = shape.back();
  if (fp4 && cols % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(s), ": packed FP4 rows need an even element count, got ", cols));
  }
  // One scale grid per matrix: 128 x 128 blocks for FP8, 1 x 32 for FP4.
  std::vector<int64_t> want(shape.begin(), shape.end() - 2);
  want.push_back(fp8 ? (rows + kFp8BlockRows - 1) / kFp8BlockRows : rows);
  want.push_back((cols + (fp8 ? kFp8BlockCols : kFp4BlockCols) - 1) /
                 (fp8 ? kFp8BlockCols : kFp4BlockCols));
  const TensorInfo& info = *scale->info;
  if (info.dtype != DType::kF32 && info.dtype != DType::kF8E8M0 && info.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(*scale), ": wrong dtype ", DTypeName(info.dtype), " for the scales of ",
                     s.info->name, " (expected F32, BF16 or F8_E8M0)"));
  }
  if (info.shape != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(*scale), ": wrong shape ", info.ShapeString(), " for the scales of ", s.info->name,
        " ", s.info->ShapeString(), ", expected [", absl::StrJoin(want, ", "), "]"));
  }
  return fp8 ? Encoding::kFp8 : Encoding::kFp4;
}

// Decodes one planned tensor into `out` (the job's slot in its canonical tensor).
absl::Status Execute(const Job& job, int64_t n_experts, float* out) {
  const TensorInfo& info = *job.stored.info;
  const std::span<const uint8_t> bytes = job.stored.file->Bytes(info);
  const int64_t n = Tensor::NumElements(job.shape);
  switch (job.encoding) {
    case Encoding::kPlain:
      return ConvertToFloat(info.dtype, bytes, std::span<float>(out, static_cast<size_t>(n)));
    case Encoding::kExpertIds:
      PDSERVE_RETURN_IF_ERROR(
          ConvertToFloat(info.dtype, bytes, std::span<float>(out, static_cast<size_t>(n))));
      for (int64_t i = 0; i < n; ++i) {
        if (!(out[i] >= 0 && out[i] < static_cast<float>(n_experts))) {
          return absl::InvalidArgumentError(absl::StrCat(Where(job.stored), ": entry ", i,
                                                         " is expert id ", out[i], ", outside [0, ",
                                                         n_experts, ")"));
        }
      }
      return absl::OkStatus();
    case Encoding::kFp8:
    case Encoding::kFp4:
      break;
  }
  const TensorInfo& scale_info = *job.scale->info;
  std::vector<float> scales(static_cast<size_t>(scale_info.NumElements()));
  PDSERVE_RETURN_IF_ERROR(
      ConvertToFloat(scale_info.dtype, job.scale->file->Bytes(scale_info), scales));
  const int64_t rows = job.shape[job.shape.size() - 2], cols = job.shape.back();
  const int64_t matrices = n / std::max<int64_t>(rows * cols, 1);
  const int64_t scales_per_matrix =
      scale_info.shape[scale_info.shape.size() - 2] * scale_info.shape.back();
  for (int64_t b = 0; b < matrices; ++b) {
    const float* sc = scales.data() + b * scales_per_matrix;
    if (job.encoding == Encoding::kFp8) {
      DequantizeFp8(bytes.data() + b * rows * cols, rows, cols, sc, out + b * rows * cols);
    } else {
      DequantizeFp4(bytes.data() + b * rows * cols / 2, rows, cols, sc, out + b * rows * cols);
    }
  }
  return absl::OkStatus();
}

// Checks every stored tensor against the config and records where it goes, before anything is
// allocated or decoded: a bad checkpoint costs no memory beyond its header.
class Planner {
 public:
  explicit Planner(const ModelConfig& config) : config_(config), specs_(RequiredTensors(config)) {}

  absl::Status Add(const Stored& s, const TensorTarget& target, const Stored* scale) {
    auto spec_it = specs_.find(target.canonical);
    if (spec_it == specs_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(Where(s), ": unexpected tensor (it would be ",
                                                     target.canonical,
                                                     ", which this config.json does not have)"));
    }
    Job job{s, scale, Encoding::kPlain, target.canonical, 0, spec_it->second.shape};
    if (target.part != TensorTarget::Part::kWhole) {
      if (target.expert >= config_.n_routed_experts) {
        return absl::InvalidArgumentError(absl::StrCat(Where(s), ": unexpected tensor (expert ",
                                                       target.expert, " but n_routed_experts is ",
                                                       config_.n_routed_experts, ")"));
      }
      const int64_t inter = config_.moe_intermediate_size, h = config_.hidden_size;
      const bool down = target.part == TensorTarget::Part::kExpertDown;
      job.shape = down ? std::vector<int64_t>{h, inter} : std::vector<int64_t>{inter, h};
    }
    if (!MarkFilled(target)) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(s), ": duplicate tensor: ", OriginalName(target), " / ",
                       target.canonical, " is already loaded from another stored name"));
    }
    if (LogicalShape(*s.info, scale != nullptr) != job.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(s), ": wrong shape ", s.info->ShapeString(), ", expected [",
                       absl::StrJoin(job.shape, ", "), "] for ", target.canonical));
    }
    PDSERVE_ASSIGN_OR_RETURN(job.encoding,
                             CheckEncoding(s, scale, spec_it->second.integer, job.shape));
    // After the shape check, so the products are bounded by the stored bytes.
    if (target.part != TensorTarget::Part::kWhole) {
      const int64_t piece = Tensor::NumElements(job.shape);
      job.offset = target.part == TensorTarget::Part::kExpertDown
                       ? target.expert * piece
                       : target.expert * 2 * piece +
                             (target.part == TensorTarget::Part::kExpertUp ? piece : 0);
    }
    jobs_.push_back(std::move(job));
    return absl::OkStatus();
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

  // The projections (`…_proj.weight`, 2-D, whole) stored FP8 with block scales: what
  // WeightsLoadOptions::skip_fp8_matrices leaves in the checkpoint.
  std::set<std::string, std::less<>> Fp8Matrices() const {
    std::set<std::string, std::less<>> names;
    for (const Job& job : jobs_) {
      if (job.encoding == Encoding::kFp8 && job.shape.size() == 2 &&
          job.shape == specs_.at(job.canonical).shape && job.canonical.ends_with("_proj.weight")) {
        names.insert(job.canonical);
      }
    }
    return names;
  }

  // The stacked routed-expert tensors whose every stored piece is a per-expert FP8 or FP4 matrix
  // with its scales: what WeightsLoadOptions::skip_quantized_experts leaves in the checkpoint.
  std::set<std::string, std::less<>> QuantizedExperts() const {
    std::map<std::string, bool, std::less<>> all_quantized;
    for (const Job& job : jobs_) {
      if (!job.canonical.ends_with("experts.gate_up_proj") &&
          !job.canonical.ends_with("experts.down_proj")) {
        continue;
      }
      const bool quantized = (job.encoding == Encoding::kFp8 || job.encoding == Encoding::kFp4) &&
                             job.shape.size() == 2;
      auto [it, inserted] = all_quantized.emplace(job.canonical, quantized);
      if (!inserted) it->second = it->second && quantized;
    }
    std::set<std::string, std::less<>> names;
    // The widths the FP8 expert GEMM takes (kernels/cuda/moe_gemm.cuh): whole 128-blocks.
    if (config_.hidden_size % kFp8BlockCols != 0 ||
        config_.moe_intermediate_size % kFp8BlockCols != 0) {
      return names;
    }
    for (const auto& [name, quantized] : all_quantized) {
      if (quantized) names.insert(name);
    }
    return names;
  }

  // Allocates every canonical tensor but `skip` and decodes the stored ones into place, one pass
  // each.
  absl::StatusOr<std::map<std::string, Tensor, std::less<>>> Run(
      const std::set<std::string, std::less<>>& skip) const {
    std::map<std::string, Tensor, std::less<>> tensors;
    for (const auto& [name, spec] : specs_) {
      if (!skip.count(name)) tensors.emplace(name, Tensor(spec.shape));
    }
    for (const Job& job : jobs_) {
      if (skip.count(job.canonical)) continue;
      PDSERVE_RETURN_IF_ERROR(
          Execute(job, config_.n_routed_experts, tensors.at(job.canonical).ptr() + job.offset));
    }
    return tensors;
  }

 private:
  // Slot bitmap per stacked experts tensor: gate_up has 2 slots per expert (w1, w3), down one.
  bool MarkFilled(const TensorTarget& t) {
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
  std::vector<Job> jobs_;
  std::set<std::string> whole_filled_;
  std::map<std::string, std::vector<bool>> expert_slots_;
};

// A model directory with random_weights.json ({"seed": N}) and no checkpoint: FastRandomWeights
// of the config, the same values in every process that loads it (benchmarks at real layer shapes
// without a checkpoint of hundreds of GB: tools/gpu/make_random_model.py).
absl::StatusOr<Weights> RandomFromDir(const std::string& model_dir, const ModelConfig& config) {
  namespace fs = std::filesystem;
  const std::string path = absl::StrCat(model_dir, "/", kRandomFile);
  std::error_code ec;
  for (const char* checkpoint : {kSingleFile, kIndexFile}) {
    if (fs::exists(absl::StrCat(model_dir, "/", checkpoint), ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat(model_dir, ": holds both ", kRandomFile, " and ", checkpoint,
                       "; keep one (random weights or the checkpoint)"));
    }
  }
  PDSERVE_ASSIGN_OR_RETURN(std::string text, ReadText(path));
  const Json spec = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (spec.is_discarded() || !spec.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": malformed JSON"));
  }
  for (auto it = spec.begin(); it != spec.end(); ++it) {
    if (it.key() != "seed") {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown key \"", it.key(), "\" (only \"seed\")"));
    }
  }
  const auto seed = spec.find("seed");
  if (seed == spec.end() || !seed->is_number_unsigned()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": \"seed\" must be a non-negative integer"));
  }
  return FastRandomWeights(config, seed->get<uint64_t>());
}

}  // namespace

std::vector<std::string> BlockScaleNames(std::string_view weight_name) {
  std::vector<std::string> names = {absl::StrCat(std::string(weight_name), "_scale_inv")};
  if (weight_name.ends_with(".weight")) {
    names.push_back(
        absl::StrCat(std::string(weight_name.substr(0, weight_name.size() - 7)), ".scale"));
  }
  return names;
}

absl::StatusOr<std::vector<SafetensorsFile>> OpenCheckpointFiles(const std::string& model_dir) {
  return OpenFilesImpl(model_dir);
}

bool HasCheckpointFiles(const std::string& model_dir) {
  std::error_code ec;
  return std::filesystem::exists(absl::StrCat(model_dir, "/", kSingleFile), ec) ||
         std::filesystem::exists(absl::StrCat(model_dir, "/", kIndexFile), ec);
}

absl::StatusOr<Weights> Weights::Load(const std::string& model_dir, const ModelConfig& config) {
  return Load(model_dir, config, WeightsLoadOptions{});
}

absl::StatusOr<Weights> Weights::Load(const std::string& model_dir, const ModelConfig& config,
                                      const WeightsLoadOptions& options) {
  std::error_code exists_ec;
  if (std::filesystem::exists(absl::StrCat(model_dir, "/", kRandomFile), exists_ec)) {
    return RandomFromDir(model_dir, config);
  }
  PDSERVE_ASSIGN_OR_RETURN(std::vector<SafetensorsFile> files, OpenCheckpointFiles(model_dir));

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

  Planner planner(config);
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
        planner.Add(s, *target, scale_it == scale_of.end() ? nullptr : scale_it->second));
  }
  PDSERVE_RETURN_IF_ERROR(planner.CheckComplete(model_dir));

  Weights weights;
  if (options.skip_fp8_matrices) weights.left_stored_ = planner.Fp8Matrices();
  if (options.skip_quantized_experts) weights.left_stored_.merge(planner.QuantizedExperts());
  PDSERVE_ASSIGN_OR_RETURN(weights.tensors_, planner.Run(weights.left_stored_));
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
