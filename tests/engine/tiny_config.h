// A tiny DeepSeek-V4 config covering every layer type (sliding, CSA, HCA), hash and routed MoE,
// small enough that whole-sequence tests run in milliseconds.
#pragma once

#include "engine/config.h"

namespace pdserve::engine::testing {

inline ModelConfig TinyConfig() {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.head_dim = 16;
  c.qk_rope_head_dim = 8;
  c.rope_main.partial_rotary_factor = 0.5;  // head_dim * factor = qk_rope_head_dim
  c.rope_compress.partial_rotary_factor = 0.5;
  c.q_lora_rank = 24;
  c.num_experts_per_tok = 2;
  c.n_routed_experts = 4;
  c.layer_types = {LayerType::kSlidingAttention, LayerType::kCompressedSparseAttention,
                   LayerType::kHeavilyCompressedAttention, LayerType::kCompressedSparseAttention};
  c.mlp_layer_types = {MlpLayerType::kHashMoe, MlpLayerType::kMoe, MlpLayerType::kMoe,
                       MlpLayerType::kMoe};
  c.compress_rate_csa = 4;
  c.compress_rate_hca = 8;
  c.rope_main.rope_theta = 10000.0;
  c.rope_compress.rope_type = "yarn";
  c.rope_compress.rope_theta = 160000.0;
  c.rope_compress.factor = 16.0;
  c.rope_compress.original_max_position_embeddings = 64;
  c.max_position_embeddings = 1024;
  c.hc_mult = 2;
  c.hc_sinkhorn_iters = 5;
  c.sliding_window = 6;
  c.o_groups = 2;
  c.o_lora_rank = 8;
  c.index_n_heads = 2;
  c.index_head_dim = 12;
  c.index_topk = 3;
  c.swiglu_limit = 1.5;
  return c;
}

}  // namespace pdserve::engine::testing
