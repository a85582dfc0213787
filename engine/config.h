// DeepSeek-V4 model configuration, read from a Hugging Face model directory's config.json.
//
// Field meanings and defaults follow transformers 5.17
// models/deepseek_v4/configuration_deepseek_v4.py (DeepseekV4Config), including the legacy keys
// it folds in: `compress_ratios` (per-layer 0 / 4 / 128 -> layer types), `compress_rate_csa`,
// `compress_rate_hca`, `num_hash_layers` (-> mlp layer types) and `qk_rope_head_dim`
// (-> partial rotary factor). Immutable after Load(); safe to share across threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::engine {

enum class LayerType {
  kSlidingAttention,            // "sliding_attention": window only, "main" RoPE
  kCompressedSparseAttention,   // "compressed_sparse_attention" (CSA): window + indexer top-k
  kHeavilyCompressedAttention,  // "heavily_compressed_attention" (HCA): window + all entries
};

enum class MlpLayerType { kHashMoe, kMoe };

enum class ScoringFunc { kSqrtSoftplus, kSigmoid, kSoftmax };

// RoPE parameters of one rope type ("main" or "compress").
struct RopeParams {
  std::string rope_type = "default";  // "default" or "yarn"
  double rope_theta = 10000.0;
  double partial_rotary_factor = 0.125;
  // YaRN only (transformers modeling_rope_utils._compute_yarn_parameters).
  double factor = 1.0;
  // Parse() always fills it (max_position_embeddings where the config leaves it out).
  double original_max_position_embeddings = 0.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // Parse() resolves it: given, or 1.0 injected by V4 for a flat yarn config, or YaRN's
  // 0.1 * ln(factor) + 1 (mscale ratio when mscale / mscale_all_dim are set) for a nested one.
  double attention_factor = 1.0;
  bool truncate = true;
};

struct ModelConfig {
  std::string model_type = "deepseek_v4";
  int64_t vocab_size = 129280;
  int64_t hidden_size = 4096;
  int64_t moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 43;
  int64_t num_attention_heads = 64;
  int64_t num_key_value_heads = 1;
  int64_t head_dim = 512;
  // int(head_dim * partial_rotary_factor) of the config. The rotary dim a layer actually uses is
  // int(head_dim * rope.partial_rotary_factor) of its RopeParams (they differ only when a nested
  // rope_parameters sub-dict omits partial_rotary_factor: transformers then uses 1.0).
  int64_t qk_rope_head_dim = 64;
  int64_t q_lora_rank = 1024;
  int64_t num_experts_per_tok = 6;
  int64_t n_routed_experts = 256;
  int64_t n_shared_experts = 1;
  ScoringFunc scoring_func = ScoringFunc::kSqrtSoftplus;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.5;
  int64_t max_position_embeddings = 1048576;

  std::vector<LayerType> layer_types;
  std::vector<MlpLayerType> mlp_layer_types;
  int64_t compress_rate_csa = 4;
  int64_t compress_rate_hca = 128;
  RopeParams rope_main;      // sliding layers and nothing else
  RopeParams rope_compress;  // CSA / HCA layers, their compressors and the indexer

  int64_t hc_mult = 4;
  int64_t hc_sinkhorn_iters = 20;
  double hc_eps = 1e-6;
  double swiglu_limit = 10.0;
  int64_t sliding_window = 128;
  int64_t o_groups = 8;
  int64_t o_lora_rank = 1024;
  int64_t index_n_heads = 64;
  int64_t index_head_dim = 128;
  int64_t index_topk = 512;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = 0;                  // -1 when config.json has null
  std::vector<int64_t> eos_token_ids = {1};  // an int or a list in config.json; null -> empty

  int64_t CompressRate(LayerType t) const {
    return t == LayerType::kCompressedSparseAttention    ? compress_rate_csa
           : t == LayerType::kHeavilyCompressedAttention ? compress_rate_hca
                                                         : 0;
  }

  // Parses `<model_dir>/config.json`. Errors (InvalidArgument / NotFound) name the file and key:
  // missing file, malformed JSON, model_type other than "deepseek_v4", wrong value types,
  // inconsistent sizes (e.g. layer_types length != num_hidden_layers, hidden_size not positive).
  static absl::StatusOr<ModelConfig> Load(const std::string& model_dir);
  // Same, from JSON text; `source` names the origin in error messages.
  static absl::StatusOr<ModelConfig> Parse(const std::string& json_text, const std::string& source);
};

const char* LayerTypeName(LayerType t);

}  // namespace pdserve::engine
