#include "engine/checkpoint_layout.h"

#include <array>
#include <charconv>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {
namespace {

struct NamePair {
  std::string_view original;
  std::string_view canonical;
};

// Whole-model tensors: original name -> canonical name.
constexpr std::array<NamePair, 6> kModelNames = {{
    {"embed.weight", "model.embed_tokens.weight"},
    {"head.weight", "lm_head.weight"},
    {"norm.weight", "model.norm.weight"},
    {"hc_head_fn", "model.hc_head.hc_fn"},
    {"hc_head_base", "model.hc_head.hc_base"},
    {"hc_head_scale", "model.hc_head.hc_scale"},
}};

// Per-layer tensors below "layers.N." (original) / "model.layers.N." (canonical). Where two
// original spellings exist, the first is DeepSeek's release name (what OriginalName() returns)
// and the second what transformers 5.17 save_pretrained writes (observed in
// tests/fixtures/engine/*/name_map.json: it reverts self_attn.kv_norm to attn.norm).
constexpr std::array<NamePair, 33> kLayerNames = {{
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"hc_attn_fn", "attn_hc.fn"},
    {"hc_attn_base", "attn_hc.base"},
    {"hc_attn_scale", "attn_hc.scale"},
    {"hc_ffn_fn", "ffn_hc.fn"},
    {"hc_ffn_base", "ffn_hc.base"},
    {"hc_ffn_scale", "ffn_hc.scale"},
    {"attn.attn_sink", "self_attn.sinks"},
    {"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
    {"attn.q_norm.weight", "self_attn.q_a_norm.weight"},
    {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
    {"attn.wkv.weight", "self_attn.kv_proj.weight"},
    {"attn.kv_norm.weight", "self_attn.kv_norm.weight"},
    {"attn.norm.weight", "self_attn.kv_norm.weight"},
    {"attn.wo_a.weight", "self_attn.o_a_proj.weight"},
    {"attn.wo_b.weight", "self_attn.o_b_proj.weight"},
    {"attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"},
    {"attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"},
    {"attn.compressor.ape", "self_attn.compressor.position_bias"},
    {"attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"},
    {"attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"},
    {"attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"},
    {"attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"},
    {"attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"},
    {"attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"},
    {"attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"},
    {"ffn.gate.weight", "mlp.gate.weight"},
    {"ffn.gate.bias", "mlp.gate.e_score_correction_bias"},
    {"ffn.gate.tid2eid", "mlp.gate.tid2eid"},
    {"ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
    {"ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
    {"ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
}};

// absl::string_view is not std::string_view in Debian's absl, so prefix handling is local.
bool ConsumePrefix(std::string_view& s, std::string_view prefix) {
  if (!s.starts_with(prefix)) return false;
  s.remove_prefix(prefix.size());
  return true;
}

// Parses a decimal index at the start of `s` followed by '.', consuming both.
std::optional<int64_t> TakeIndex(std::string_view& s) {
  int64_t value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end == s.data() || end == s.data() + s.size() || *end != '.' ||
      value < 0) {
    return std::nullopt;
  }
  s.remove_prefix(static_cast<size_t>(end - s.data()) + 1);
  return value;
}

std::optional<TensorTarget> ResolveExpert(int64_t layer, std::string_view rest) {
  // rest = "E.w1.weight" after "ffn.experts."
  const std::optional<int64_t> expert = TakeIndex(rest);
  if (!expert) return std::nullopt;
  TensorTarget t;
  t.expert = *expert;
  const std::string prefix = absl::StrCat("model.layers.", layer, ".mlp.experts.");
  if (rest == "w1.weight") {
    t.part = TensorTarget::Part::kExpertGate;
    t.canonical = prefix + "gate_up_proj";
  } else if (rest == "w3.weight") {
    t.part = TensorTarget::Part::kExpertUp;
    t.canonical = prefix + "gate_up_proj";
  } else if (rest == "w2.weight") {
    t.part = TensorTarget::Part::kExpertDown;
    t.canonical = prefix + "down_proj";
  } else {
    return std::nullopt;
  }
  return t;
}

std::optional<TensorTarget> ResolveOriginal(std::string_view name) {
  for (const NamePair& p : kModelNames) {
    if (name == p.original) return TensorTarget{std::string(p.canonical)};
  }
  if (!ConsumePrefix(name, "layers.")) return std::nullopt;
  const std::optional<int64_t> layer = TakeIndex(name);
  if (!layer) return std::nullopt;
  if (ConsumePrefix(name, "ffn.experts.")) return ResolveExpert(*layer, name);
  for (const NamePair& p : kLayerNames) {
    if (name == p.original) {
      return TensorTarget{absl::StrCat("model.layers.", *layer, ".", std::string(p.canonical))};
    }
  }
  return std::nullopt;
}

// A name below DeepseekV4Model in transformers' module layout (whether the config has it is
// checked by the loader, which then reports the exact tensor).
bool LooksCanonical(std::string_view rest) {
  if (rest.starts_with("embed_tokens.") || rest.starts_with("hc_head.")) return true;
  if (!ConsumePrefix(rest, "layers.") || !TakeIndex(rest)) return false;
  for (std::string_view module : {"self_attn.", "mlp.", "attn_hc.", "ffn_hc.", "input_layernorm.",
                                  "post_attention_layernorm."}) {
    if (rest.starts_with(module)) return true;
  }
  return false;
}

}  // namespace

std::optional<TensorTarget> ResolveTensorName(std::string_view stored_name) {
  if (stored_name == "lm_head.weight") return TensorTarget{std::string(stored_name)};
  // transformers writes original names below the base-model prefix ("model.layers.0.attn.wkv")
  // and keeps some canonical ones ("model.embed_tokens.weight"); DeepSeek writes no prefix.
  std::string_view rest = stored_name;
  ConsumePrefix(rest, "model.");
  if (auto t = ResolveOriginal(rest)) return t;
  // Canonical names; without the prefix when saved from the base model (DeepseekV4Model).
  if (LooksCanonical(rest)) return TensorTarget{absl::StrCat("model.", std::string(rest))};
  return std::nullopt;
}

std::string OriginalName(const TensorTarget& target) {
  std::string_view name = target.canonical;
  for (const NamePair& p : kModelNames) {
    if (name == p.canonical) return std::string(p.original);
  }
  if (!ConsumePrefix(name, "model.layers.")) return target.canonical;
  const std::optional<int64_t> layer = TakeIndex(name);
  if (!layer) return target.canonical;
  switch (target.part) {
    case TensorTarget::Part::kExpertGate:
      return absl::StrCat("layers.", *layer, ".ffn.experts.", target.expert, ".w1.weight");
    case TensorTarget::Part::kExpertUp:
      return absl::StrCat("layers.", *layer, ".ffn.experts.", target.expert, ".w3.weight");
    case TensorTarget::Part::kExpertDown:
      return absl::StrCat("layers.", *layer, ".ffn.experts.", target.expert, ".w2.weight");
    case TensorTarget::Part::kWhole:
      break;
  }
  for (const NamePair& p : kLayerNames) {
    if (name == p.canonical) return absl::StrCat("layers.", *layer, ".", std::string(p.original));
  }
  return target.canonical;
}

bool IsIgnoredTensorName(std::string_view stored_name) {
  return stored_name.starts_with("mtp.") || stored_name.find(".mtp.") != std::string_view::npos;
}

std::map<std::string, RequiredTensor> RequiredTensors(const ModelConfig& c) {
  std::map<std::string, RequiredTensor> specs;
  auto add = [&specs](std::string name, std::vector<int64_t> shape, bool integer = false) {
    specs[std::move(name)] = RequiredTensor{std::move(shape), integer};
  };
  const int64_t h = c.hidden_size, hc = c.hc_mult, hd = c.head_dim, qr = c.q_lora_rank;
  const int64_t nh = c.num_attention_heads, ihd = c.index_head_dim;
  const int64_t e = c.n_routed_experts, inter = c.moe_intermediate_size;
  const int64_t mix = (2 + hc) * hc;

  add("model.embed_tokens.weight", {c.vocab_size, h});
  add("model.norm.weight", {h});
  add("model.hc_head.hc_fn", {hc, hc * h});
  add("model.hc_head.hc_base", {hc});
  add("model.hc_head.hc_scale", {1});
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h});

  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = absl::StrCat("model.layers.", i, ".");
    for (const char* site : {"attn_hc.", "ffn_hc."}) {
      add(absl::StrCat(l, site, "fn"), {mix, hc * h});
      add(absl::StrCat(l, site, "base"), {mix});
      add(absl::StrCat(l, site, "scale"), {3});
    }
    add(l + "input_layernorm.weight", {h});
    add(l + "post_attention_layernorm.weight", {h});

    const std::string a = l + "self_attn.";
    add(a + "q_a_proj.weight", {qr, h});
    add(a + "q_a_norm.weight", {qr});
    add(a + "q_b_proj.weight", {nh * hd, qr});
    add(a + "kv_proj.weight", {hd, h});
    add(a + "kv_norm.weight", {hd});
    add(a + "o_a_proj.weight", {c.o_groups * c.o_lora_rank, nh * hd / c.o_groups});
    add(a + "o_b_proj.weight", {h, c.o_groups * c.o_lora_rank});
    add(a + "sinks", {nh});

    const LayerType type = c.layer_types[static_cast<size_t>(i)];
    const std::string comp = a + "compressor.";
    if (type == LayerType::kCompressedSparseAttention) {
      // Two overlapping series (Ca, Cb) per token: projections are 2 * head_dim wide.
      add(comp + "kv_proj.weight", {2 * hd, h});
      add(comp + "gate_proj.weight", {2 * hd, h});
      add(comp + "position_bias", {c.compress_rate_csa, 2 * hd});
      add(comp + "kv_norm.weight", {hd});
      const std::string idx = comp + "indexer.";
      add(idx + "kv_proj.weight", {2 * ihd, h});
      add(idx + "gate_proj.weight", {2 * ihd, h});
      add(idx + "position_bias", {c.compress_rate_csa, 2 * ihd});
      add(idx + "kv_norm.weight", {ihd});
      add(idx + "q_b_proj.weight", {c.index_n_heads * ihd, qr});
      add(idx + "scorer.weights_proj.weight", {c.index_n_heads, h});
    } else if (type == LayerType::kHeavilyCompressedAttention) {
      add(comp + "kv_proj.weight", {hd, h});
      add(comp + "gate_proj.weight", {hd, h});
      add(comp + "position_bias", {c.compress_rate_hca, hd});
      add(comp + "kv_norm.weight", {hd});
    }

    const std::string m = l + "mlp.";
    add(m + "gate.weight", {e, h});
    if (c.mlp_layer_types[static_cast<size_t>(i)] == MlpLayerType::kHashMoe) {
      add(m + "gate.tid2eid", {c.vocab_size, c.num_experts_per_tok}, /*integer=*/true);
    } else {
      add(m + "gate.e_score_correction_bias", {e});
    }
    add(m + "experts.gate_up_proj", {e, 2 * inter, h});
    add(m + "experts.down_proj", {e, h, inter});
    add(m + "shared_experts.gate_proj.weight", {inter, h});
    add(m + "shared_experts.up_proj.weight", {inter, h});
    add(m + "shared_experts.down_proj.weight", {h, inter});
  }
  return specs;
}

}  // namespace pdserve::engine
