// Model weights of a DeepSeek-V4 checkpoint, dequantized to float32 for the CPU engine.
//
// Load() reads a Hugging Face model directory: a single model.safetensors or shards listed in
// model.safetensors.index.json. Tensors may be F32 / BF16 / F16, FP8 E4M3 with block scales, or
// FP4 (E2M1, two per byte) experts with their scales; all are dequantized on load. Both the
// transformers names (model.layers.0.self_attn.q_a_proj.weight, experts as stacked
// gate_up_proj / down_proj) and DeepSeek's original names (layers.0.attn.wq_a.weight,
// layers.0.ffn.experts.3.w1.weight, ...) are accepted; every tensor is stored under its
// canonical transformers name, so the model code uses one naming. The mapping is documented in
// docs/checkpoints.md. Immutable after Load(); concurrent reads are safe.
#pragma once

#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/safetensors.h"
#include "engine/tensor.h"

namespace pdserve::engine {

struct WeightsLoadOptions {
  // Leaves out the projections (canonical names ending in `_proj.weight`, not the routed experts)
  // that the checkpoint stores FP8 e4m3 with block scales: no float32 copy of them is made, and
  // left_stored() names them. For a GPU engine that copies their stored bytes itself
  // (engine/stored_fp8.h); such Weights are not for the CPU engine (engine::Model), which needs
  // every tensor.
  bool skip_fp8_matrices = false;
  // Leaves out the stacked routed experts (`…experts.gate_up_proj`, `…experts.down_proj`) whose
  // every per-expert piece the checkpoint stores FP8 or FP4 with scales; left_stored() names
  // them. For a GPU engine that reads them itself (engine/stored_experts.h).
  bool skip_quantized_experts = false;
};

class Weights {
 public:
  // Loads and validates every tensor the config requires (RequiredTensors() in
  // engine/checkpoint_layout.h): missing, unexpected, wrong-shape or wrong-dtype tensors and
  // truncated data are errors naming the file and tensor; every check runs before any tensor is
  // allocated. Afterwards all() holds exactly the required tensors, plus lm_head.weight as a copy
  // of model.embed_tokens.weight when tie_word_embeddings is set. Expert tensors are stacked
  // (gate_up_proj [E, 2I, H] = per-expert w1 then w3; down_proj [E, H, I]); tid2eid [V, top-k]
  // holds expert ids as exact float values. Formats and sources: docs/checkpoints.md.
  // A directory with random_weights.json ({"seed": N}) instead of a checkpoint loads
  // FastRandomWeights(config, N) (engine/random_weights.h); with a checkpoint beside it, or a
  // malformed file, InvalidArgument.
  static absl::StatusOr<Weights> Load(const std::string& model_dir, const ModelConfig& config);
  // The same with options; the checks are the same (every stored tensor, skipped or not).
  static absl::StatusOr<Weights> Load(const std::string& model_dir, const ModelConfig& config,
                                      const WeightsLoadOptions& options);

  // The tensor stored under canonical (transformers) `name`, or NotFound.
  absl::StatusOr<const Tensor*> Get(std::string_view name) const;
  // Like Get(), for names Load() has already validated: aborts with the name on a miss.
  const Tensor& At(std::string_view name) const;

  // Test hook and tooling: replace or add a tensor.
  void Set(const std::string& name, Tensor t) { tensors_[name] = std::move(t); }
  const std::map<std::string, Tensor, std::less<>>& all() const { return tensors_; }
  // The canonical names Load left in the checkpoint (WeightsLoadOptions::skip_fp8_matrices,
  // skip_quantized_experts).
  const std::set<std::string, std::less<>>& left_stored() const { return left_stored_; }

 private:
  std::map<std::string, Tensor, std::less<>> tensors_;
  std::set<std::string, std::less<>> left_stored_;
};

// The checkpoint files of `model_dir`: model.safetensors, or every shard
// model.safetensors.index.json names (each tensor the index lists checked to be in its shard).
// Only headers are parsed; data is mapped, not read. Errors as Weights::Load's for the files.
absl::StatusOr<std::vector<SafetensorsFile>> OpenCheckpointFiles(const std::string& model_dir);
// The names the block scales of quantized weight `weight_name` may be stored under, in the order
// tried: `<name>_scale_inv` (transformers' FP8 names) and, for `<module>.weight`, `<module>.scale`
// (DeepSeek's).
std::vector<std::string> BlockScaleNames(std::string_view weight_name);
// True when `model_dir` holds model.safetensors or model.safetensors.index.json.
bool HasCheckpointFiles(const std::string& model_dir);

}  // namespace pdserve::engine
