#include "engine/model.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/attention.h"
#include "engine/hyper_connection.h"
#include "engine/moe.h"
#include "engine/rope_table.h"
#include "engine/tensor_spec.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/rms_norm.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

namespace {

HyperConnectionWeights SiteWeights(const Weights& w, const std::string& prefix) {
  return {&w.At(prefix + ".fn"), &w.At(prefix + ".base"), &w.At(prefix + ".scale")};
}

absl::Status ValidateConfig(const ModelConfig& c) {
  const auto positive = {c.vocab_size,       c.hidden_size,         c.num_hidden_layers,
                         c.head_dim,         c.q_lora_rank,         c.num_attention_heads,
                         c.o_groups,         c.o_lora_rank,         c.hc_mult,
                         c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.sliding_window,   c.hc_sinkhorn_iters};
  for (int64_t v : positive) {
    if (v <= 0) return absl::InvalidArgumentError("config: sizes must be positive");
  }
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_hidden_layers ||
      static_cast<int64_t>(c.mlp_layer_types.size()) != c.num_hidden_layers) {
    return absl::InvalidArgumentError("config: layer_types / mlp_layer_types length mismatch");
  }
  if (c.qk_rope_head_dim <= 0 || c.qk_rope_head_dim % 2 != 0 || c.qk_rope_head_dim > c.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("config: qk_rope_head_dim ", c.qk_rope_head_dim,
                                                   " must be positive, even and <= head_dim"));
  }
  // The engine rotates qk_rope_head_dim channels on every path, while transformers sizes each
  // rope type by its own partial_rotary_factor; a config where they disagree would silently
  // compute something else, so it is refused.
  for (const auto& [name, rope] :
       {std::pair{"main", &c.rope_main}, {"compress", &c.rope_compress}}) {
    const auto dim =
        static_cast<int64_t>(static_cast<double>(c.head_dim) * rope->partial_rotary_factor);
    if (dim != c.qk_rope_head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: rope_parameters.", name, " rotates ", dim,
          " channels but partial_rotary_factor / qk_rope_head_dim say ", c.qk_rope_head_dim));
    }
  }
  if ((c.num_attention_heads * c.head_dim) % c.o_groups != 0) {
    return absl::InvalidArgumentError("config: num_attention_heads * head_dim % o_groups != 0");
  }
  if (c.num_experts_per_tok > c.n_routed_experts) {
    return absl::InvalidArgumentError("config: num_experts_per_tok > n_routed_experts");
  }
  for (LayerType t : c.layer_types) {
    if (t != LayerType::kSlidingAttention && c.CompressRate(t) <= 0) {
      return absl::InvalidArgumentError("config: compress rates must be positive");
    }
    if (t == LayerType::kCompressedSparseAttention &&
        (c.index_topk <= 0 || c.index_n_heads <= 0 || c.index_head_dim < c.qk_rope_head_dim)) {
      return absl::InvalidArgumentError(
          "config: indexer sizes must be positive and index_head_dim >= qk_rope_head_dim");
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct Model::Impl {
  Impl(ModelConfig c, Weights w)
      : config(std::move(c)),
        weights(std::move(w)),
        main_rope(config.rope_main, config.qk_rope_head_dim, config.max_position_embeddings),
        compress_rope(config.rope_compress, config.qk_rope_head_dim,
                      config.max_position_embeddings) {}

  ModelConfig config;
  Weights weights;
  ModelOptions options;
  RopeTable main_rope;
  RopeTable compress_rope;
  struct Layer {
    std::unique_ptr<Attention> attention;
    std::unique_ptr<Moe> moe;
    HyperConnectionWeights attn_hc;
    HyperConnectionWeights ffn_hc;
    const Tensor* input_norm;
    const Tensor* post_attention_norm;
  };
  std::vector<Layer> layers;
};

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;
Model::~Model() = default;

const ModelConfig& Model::config() const { return impl_->config; }
const ModelOptions& Model::options() const { return impl_->options; }

absl::StatusOr<Model> Model::Load(const std::string& model_dir, ModelOptions options) {
  PDSERVE_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Load(model_dir));
  PDSERVE_ASSIGN_OR_RETURN(Weights weights, Weights::Load(model_dir, config));
  return FromWeights(std::move(config), std::move(weights), std::move(options));
}

absl::StatusOr<Model> Model::FromWeights(ModelConfig config, Weights weights,
                                         ModelOptions options) {
  PDSERVE_RETURN_IF_ERROR(ValidateConfig(config));
  if (config.tie_word_embeddings && !weights.Get("lm_head.weight").ok()) {
    auto embed = weights.Get("model.embed_tokens.weight");
    if (embed.ok()) weights.Set("lm_head.weight", **embed);
  }
  PDSERVE_RETURN_IF_ERROR(ValidateWeights(config, weights));
  auto impl = std::make_unique<Impl>(std::move(config), std::move(weights));
  impl->options = std::move(options);
  const ModelConfig& c = impl->config;
  const Weights& w = impl->weights;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l);
    Impl::Layer layer;
    layer.attention = std::make_unique<Attention>(
        c, w, l, &impl->main_rope, &impl->compress_rope, impl->options.indexer_fault,
        impl->options.bf16_state, impl->options.fp8_emulation);
    layer.moe = std::make_unique<Moe>(c, w, l, impl->options.bf16_expert_input,
                                      impl->options.fp8_emulation);
    layer.attn_hc = SiteWeights(w, p + ".attn_hc");
    layer.ffn_hc = SiteWeights(w, p + ".ffn_hc");
    layer.input_norm = &w.At(p + ".input_layernorm.weight");
    layer.post_attention_norm = &w.At(p + ".post_attention_layernorm.weight");
    impl->layers.push_back(std::move(layer));
  }
  return Model(std::move(impl));
}

ModelState Model::NewState() const {
  ModelState state;
  for (const auto& layer : impl_->layers) state.layers.push_back(layer.attention->NewState());
  return state;
}

absl::StatusOr<Tensor> Model::Forward(ModelState* state, const std::vector<int32_t>& tokens,
                                      const LayerHook& after_layer, ChunkLogits rows) const {
  const ModelConfig& c = impl_->config;
  const Weights& w = impl_->weights;
  if (tokens.empty()) return absl::InvalidArgumentError("Forward: empty token chunk");
  for (int32_t id : tokens) {
    if (id < 0 || id >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward: token id ", id, " outside [0, ", c.vocab_size, ")"));
    }
  }
  if (state->layers.size() != impl_->layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: state has ", state->layers.size(),
                                                   " layers, model has ", impl_->layers.size()));
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t hidden = c.hidden_size;
  const int64_t hc = c.hc_mult;
  const float eps = static_cast<float>(c.rms_norm_eps);

  std::vector<float> streams(static_cast<size_t>(n * hc * hidden));
  const float* embed = w.At("model.embed_tokens.weight").ptr();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < hc; ++j) {
      std::copy_n(embed + static_cast<int64_t>(tokens[t]) * hidden, hidden,
                  streams.data() + (t * hc + j) * hidden);
    }
  }
  std::vector<float> collapsed(static_cast<size_t>(n * hidden));
  std::vector<float> sublayer_out(collapsed.size());
  for (size_t l = 0; l < impl_->layers.size(); ++l) {
    const Impl::Layer& layer = impl_->layers[l];
    HyperMix mix = HyperConnectionPre(c, layer.attn_hc, streams.data(), n, collapsed.data());
    cpu::RmsNorm(collapsed.data(), layer.input_norm->ptr(), n, hidden, eps, collapsed.data());
    layer.attention->Forward(collapsed.data(), n, state->position, &state->layers[l],
                             sublayer_out.data());
    if (after_layer) after_layer(static_cast<int64_t>(l), state->layers[l], state->position + n);
    HyperConnectionPost(c, mix, sublayer_out.data(), n, streams.data());

    mix = HyperConnectionPre(c, layer.ffn_hc, streams.data(), n, collapsed.data());
    cpu::RmsNorm(collapsed.data(), layer.post_attention_norm->ptr(), n, hidden, eps,
                 collapsed.data());
    layer.moe->Forward(collapsed.data(), n, tokens.data(), sublayer_out.data());
    HyperConnectionPost(c, mix, sublayer_out.data(), n, streams.data());
  }
  // The head is per row: kLastRow runs it on the last row's streams alone.
  const int64_t first = rows == ChunkLogits::kLastRow ? n - 1 : 0;
  const int64_t head_rows = n - first;
  HyperHead(c, w.At("model.hc_head.hc_fn"), w.At("model.hc_head.hc_base"),
            w.At("model.hc_head.hc_scale"), streams.data() + first * hc * hidden, head_rows,
            collapsed.data());
  cpu::RmsNorm(collapsed.data(), w.At("model.norm.weight").ptr(), head_rows, hidden, eps,
               collapsed.data());
  Tensor logits({head_rows, c.vocab_size});
  cpu::Linear(collapsed.data(), head_rows, hidden, w.At("lm_head.weight").ptr(), c.vocab_size,
              logits.ptr());
  state->position += n;
  return logits;
}

}  // namespace pdserve::engine
