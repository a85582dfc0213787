#include "engine/tensor_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve::engine {

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc;
  std::vector<TensorSpec> specs = {
      {"model.embed_tokens.weight", {c.vocab_size, h}},
      {"model.norm.weight", {h}},
      {"model.hc_head.hc_fn", {hc, hc * h}},
      {"model.hc_head.hc_base", {hc}},
      {"model.hc_head.hc_scale", {1}},
      {"lm_head.weight", {c.vocab_size, h}},
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const auto add = [&](const std::string& name, std::vector<int64_t> shape) {
      specs.push_back({p + name, std::move(shape)});
    };
    add("input_layernorm.weight", {h});
    add("post_attention_layernorm.weight", {h});
    for (const char* site : {"attn_hc", "ffn_hc"}) {
      add(absl::StrCat(site, ".fn"), {mix, hc * h});
      add(absl::StrCat(site, ".base"), {mix});
      add(absl::StrCat(site, ".scale"), {3});
    }
    const int64_t hd = c.head_dim;
    const int64_t heads = c.num_attention_heads;
    add("self_attn.q_a_proj.weight", {c.q_lora_rank, h});
    add("self_attn.q_a_norm.weight", {c.q_lora_rank});
    add("self_attn.q_b_proj.weight", {heads * hd, c.q_lora_rank});
    add("self_attn.kv_proj.weight", {hd, h});
    add("self_attn.kv_norm.weight", {hd});
    add("self_attn.o_a_proj.weight", {c.o_groups * c.o_lora_rank, heads * hd / c.o_groups});
    add("self_attn.o_b_proj.weight", {h, c.o_groups * c.o_lora_rank});
    add("self_attn.sinks", {heads});
    const LayerType type = c.layer_types.at(static_cast<size_t>(l));
    if (type != LayerType::kSlidingAttention) {
      const int64_t rate = c.CompressRate(type);
      const int64_t width = type == LayerType::kCompressedSparseAttention ? 2 * hd : hd;
      add("self_attn.compressor.kv_proj.weight", {width, h});
      add("self_attn.compressor.gate_proj.weight", {width, h});
      add("self_attn.compressor.position_bias", {rate, width});
      add("self_attn.compressor.kv_norm.weight", {hd});
    }
    if (type == LayerType::kCompressedSparseAttention) {
      const int64_t ihd = c.index_head_dim;
      const std::string ip = "self_attn.compressor.indexer.";
      add(ip + "kv_proj.weight", {2 * ihd, h});
      add(ip + "gate_proj.weight", {2 * ihd, h});
      add(ip + "position_bias", {c.compress_rate_csa, 2 * ihd});
      add(ip + "kv_norm.weight", {ihd});
      add(ip + "q_b_proj.weight", {c.index_n_heads * ihd, c.q_lora_rank});
      add(ip + "scorer.weights_proj.weight", {c.index_n_heads, h});
    }
    const int64_t e = c.n_routed_experts;
    const int64_t inter = c.moe_intermediate_size;
    add("mlp.gate.weight", {e, h});
    if (c.mlp_layer_types.at(static_cast<size_t>(l)) == MlpLayerType::kHashMoe) {
      add("mlp.gate.tid2eid", {c.vocab_size, c.num_experts_per_tok});
    } else {
      add("mlp.gate.e_score_correction_bias", {e});
    }
    add("mlp.experts.gate_up_proj", {e, 2 * inter, h});
    add("mlp.experts.down_proj", {e, h, inter});
    add("mlp.shared_experts.gate_proj.weight", {inter, h});
    add("mlp.shared_experts.up_proj.weight", {inter, h});
    add("mlp.shared_experts.down_proj.weight", {h, inter});
  }
  return specs;
}

absl::Status ValidateWeights(const ModelConfig& config, const Weights& weights) {
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    auto tensor = weights.Get(spec.name);
    if (!tensor.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor ", spec.name));
    }
    if ((*tensor)->shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", spec.name, " has shape ",
                                                     (*tensor)->ShapeString(), ", expected [",
                                                     absl::StrJoin(spec.shape, ", "), "]"));
    }
    if (spec.name.ends_with(".tid2eid")) {
      for (float v : (*tensor)->data) {
        if (v < 0 || v >= static_cast<float>(config.n_routed_experts) || std::floor(v) != v) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", spec.name, " holds expert id ",
                                                         v, " outside [0, ",
                                                         config.n_routed_experts, ")"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::engine
