#include "engine/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

using Json = nlohmann::json;

// Typed access to one JSON object with errors that name the source and key. A key that is absent
// or null keeps the caller's default, as a dataclass field left at None does in transformers.
class Fields {
 public:
  Fields(const Json& object, std::string source) : object_(object), source_(std::move(source)) {}

  bool Has(const std::string& key) const {
    auto it = object_.find(key);
    return it != object_.end() && !it->is_null();
  }
  bool IsNull(const std::string& key) const {
    auto it = object_.find(key);
    return it != object_.end() && it->is_null();
  }
  const Json& Raw(const std::string& key) const { return object_.at(key); }

  absl::Status Int(const std::string& key, int64_t& out) const {
    if (!Has(key)) return absl::OkStatus();
    const Json& v = Raw(key);
    // transformers' @strict dataclass rejects a float for an int field, even 4096.0.
    if (!v.is_number_integer()) return TypeError(key, "an integer", v);
    out = v.get<int64_t>();
    return absl::OkStatus();
  }
  absl::Status Float(const std::string& key, double& out) const {
    if (!Has(key)) return absl::OkStatus();
    const Json& v = Raw(key);
    if (!v.is_number()) return TypeError(key, "a number", v);
    out = v.get<double>();
    return absl::OkStatus();
  }
  absl::Status Bool(const std::string& key, bool& out) const {
    if (!Has(key)) return absl::OkStatus();
    const Json& v = Raw(key);
    if (!v.is_boolean()) return TypeError(key, "a boolean", v);
    out = v.get<bool>();
    return absl::OkStatus();
  }
  absl::Status String(const std::string& key, std::string& out) const {
    if (!Has(key)) return absl::OkStatus();
    const Json& v = Raw(key);
    if (!v.is_string()) return TypeError(key, "a string", v);
    out = v.get<std::string>();
    return absl::OkStatus();
  }
  absl::Status StringList(const std::string& key,
                          std::optional<std::vector<std::string>>& out) const {
    if (!Has(key)) return absl::OkStatus();
    const Json& v = Raw(key);
    if (!v.is_array()) return TypeError(key, "a list of strings", v);
    std::vector<std::string> items;
    for (const Json& item : v) {
      if (!item.is_string()) return TypeError(key, "a list of strings", v);
      items.push_back(item.get<std::string>());
    }
    out = std::move(items);
    return absl::OkStatus();
  }
  absl::Status IntList(const std::string& key, std::optional<std::vector<int64_t>>& out) const {
    if (!Has(key)) return absl::OkStatus();
    const Json& v = Raw(key);
    if (!v.is_array()) return TypeError(key, "a list of integers", v);
    std::vector<int64_t> items;
    for (const Json& item : v) {
      if (!item.is_number_integer()) return TypeError(key, "a list of integers", v);
      items.push_back(item.get<int64_t>());
    }
    out = std::move(items);
    return absl::OkStatus();
  }

  absl::Status Error(const std::string& key, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": key \"", key, "\": ", what));
  }

 private:
  absl::Status TypeError(const std::string& key, const char* expected, const Json& v) const {
    return Error(key, absl::StrCat("expected ", expected, ", got ", v.dump()));
  }

  const Json& object_;
  std::string source_;
};

absl::StatusOr<LayerType> ParseLayerType(const std::string& s) {
  if (s == "sliding_attention") return LayerType::kSlidingAttention;
  if (s == "compressed_sparse_attention") return LayerType::kCompressedSparseAttention;
  if (s == "heavily_compressed_attention") return LayerType::kHeavilyCompressedAttention;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layer type \"", s,
                   "\" (expected sliding_attention, compressed_sparse_attention or "
                   "heavily_compressed_attention)"));
}

// YaRN's attention factor when the config leaves it unset (transformers
// modeling_rope_utils._compute_yarn_parameters, get_mscale).
double YarnMscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// Reads one rope sub-dict as transformers' rope init functions read it. `default_prf` is what
// `.get("partial_rotary_factor", ...)` falls back to: 1.0 for the nested form (the sub-dict is
// used as-is) and the config's factor for the flat form (it is injected explicitly).
absl::StatusOr<RopeParams> ParseRope(const Json& dict, const std::string& source,
                                     double default_prf, int64_t max_position_embeddings) {
  if (!dict.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": expected an object"));
  }
  Fields f(dict, source);
  RopeParams p;
  p.partial_rotary_factor = default_prf;
  // validate_rope: rope_type falls back to the legacy "type" key, then "default".
  PDSERVE_RETURN_IF_ERROR(f.String("type", p.rope_type));
  PDSERVE_RETURN_IF_ERROR(f.String("rope_type", p.rope_type));
  if (p.rope_type != "default" && p.rope_type != "yarn") {
    return f.Error("rope_type", absl::StrCat("unsupported rope type \"", p.rope_type,
                                             "\" (DeepSeek-V4 uses default or yarn)"));
  }
  if (!f.Has("rope_theta")) return f.Error("rope_theta", "missing");
  PDSERVE_RETURN_IF_ERROR(f.Float("rope_theta", p.rope_theta));
  PDSERVE_RETURN_IF_ERROR(f.Float("partial_rotary_factor", p.partial_rotary_factor));
  if (p.rope_type != "yarn") return p;

  if (!f.Has("original_max_position_embeddings")) {
    return f.Error("original_max_position_embeddings", "missing (required by yarn)");
  }
  PDSERVE_RETURN_IF_ERROR(
      f.Float("original_max_position_embeddings", p.original_max_position_embeddings));
  if (p.original_max_position_embeddings <= 0) {
    return f.Error("original_max_position_embeddings", "must be positive");
  }
  if (f.Has("factor")) {
    PDSERVE_RETURN_IF_ERROR(f.Float("factor", p.factor));
  } else {
    p.factor = static_cast<double>(max_position_embeddings) / p.original_max_position_embeddings;
  }
  // `beta_fast or 32`: zero counts as unset, as in Python.
  double beta_fast = 0.0, beta_slow = 0.0;
  PDSERVE_RETURN_IF_ERROR(f.Float("beta_fast", beta_fast));
  PDSERVE_RETURN_IF_ERROR(f.Float("beta_slow", beta_slow));
  p.beta_fast = beta_fast != 0.0 ? beta_fast : 32.0;
  p.beta_slow = beta_slow != 0.0 ? beta_slow : 1.0;
  PDSERVE_RETURN_IF_ERROR(f.Bool("truncate", p.truncate));
  if (f.Has("attention_factor")) {
    PDSERVE_RETURN_IF_ERROR(f.Float("attention_factor", p.attention_factor));
  } else {
    double mscale = 0.0, mscale_all_dim = 0.0;
    PDSERVE_RETURN_IF_ERROR(f.Float("mscale", mscale));
    PDSERVE_RETURN_IF_ERROR(f.Float("mscale_all_dim", mscale_all_dim));
    p.attention_factor = (mscale != 0.0 && mscale_all_dim != 0.0)
                             ? YarnMscale(p.factor, mscale) / YarnMscale(p.factor, mscale_all_dim)
                             : YarnMscale(p.factor, 1.0);
  }
  return p;
}

constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = 65536;
constexpr int64_t kMaxPositions = int64_t{1} << 32;
constexpr int64_t kMaxSinkhornIters = 1000;

// The size fields that must be positive for any tensor shape to make sense.
absl::Status CheckSizes(const ModelConfig& c, const Fields& f) {
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"head_dim", c.head_dim},
      {"q_lora_rank", c.q_lora_rank},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"n_routed_experts", c.n_routed_experts},
      {"hc_mult", c.hc_mult},
      {"hc_sinkhorn_iters", c.hc_sinkhorn_iters},
      {"sliding_window", c.sliding_window},
      {"o_groups", c.o_groups},
      {"o_lora_rank", c.o_lora_rank},
      {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim},
      {"index_topk", c.index_topk},
      {"max_position_embeddings", c.max_position_embeddings},
  };
  for (const auto& [key, value] : positive) {
    if (value <= 0) return f.Error(key, absl::StrCat("must be positive, got ", value));
  }
  // Bounds far above any released model keep every shape product inside int64 and the
  // per-layer / per-expert bookkeeping small, whatever a config.json says.
  const std::pair<const char*, int64_t> bounded[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"num_attention_heads", c.num_attention_heads},
      {"head_dim", c.head_dim},
      {"q_lora_rank", c.q_lora_rank},
      {"hc_mult", c.hc_mult},
      {"o_groups", c.o_groups},
      {"o_lora_rank", c.o_lora_rank},
      {"index_n_heads", c.index_n_heads},
      {"index_head_dim", c.index_head_dim},
      {"compress_rate_csa", c.compress_rate_csa},
      {"compress_rate_hca", c.compress_rate_hca},
  };
  for (const auto& [key, value] : bounded) {
    if (value > kMaxDim) return f.Error(key, absl::StrCat(value, " exceeds ", kMaxDim));
  }
  const std::pair<const char*, int64_t> also_bounded[] = {
      {"index_topk", c.index_topk},
      {"sliding_window", c.sliding_window},
  };
  for (const auto& [key, value] : also_bounded) {
    if (value > kMaxDim) return f.Error(key, absl::StrCat(value, " exceeds ", kMaxDim));
  }
  if (c.max_position_embeddings > kMaxPositions) {
    return f.Error("max_position_embeddings",
                   absl::StrCat(c.max_position_embeddings, " exceeds ", kMaxPositions));
  }
  if (c.hc_sinkhorn_iters > kMaxSinkhornIters) {
    return f.Error("hc_sinkhorn_iters",
                   absl::StrCat(c.hc_sinkhorn_iters, " exceeds ", kMaxSinkhornIters));
  }
  if (c.num_key_value_heads != 1) {
    return f.Error(
        "num_key_value_heads",
        absl::StrCat("DeepSeek-V4 attention has one shared K=V head, got ", c.num_key_value_heads));
  }
  if (!(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0)) {
    return f.Error("rms_norm_eps",
                   absl::StrCat("must be finite and positive, got ", c.rms_norm_eps));
  }
  if (!(std::isfinite(c.hc_eps) && c.hc_eps >= 0)) {
    return f.Error("hc_eps", absl::StrCat("must be finite and >= 0, got ", c.hc_eps));
  }
  if (!(std::isfinite(c.swiglu_limit) && c.swiglu_limit > 0)) {
    return f.Error("swiglu_limit",
                   absl::StrCat("must be finite and positive, got ", c.swiglu_limit));
  }
  if (!std::isfinite(c.routed_scaling_factor)) {
    return f.Error("routed_scaling_factor", "must be finite");
  }
  if (c.bos_token_id >= c.vocab_size || c.bos_token_id < -1) {
    return f.Error("bos_token_id", absl::StrCat(c.bos_token_id, " is outside the vocabulary"));
  }
  for (int64_t eos : c.eos_token_ids) {
    if (eos < 0 || eos >= c.vocab_size) {
      return f.Error("eos_token_id", absl::StrCat(eos, " is outside the vocabulary"));
    }
  }
  if (c.n_routed_experts > kMaxExperts) {
    return f.Error("n_routed_experts", absl::StrCat(c.n_routed_experts, " exceeds ", kMaxExperts));
  }
  if (c.num_experts_per_tok > c.n_routed_experts) {
    return f.Error("num_experts_per_tok",
                   absl::StrCat(c.num_experts_per_tok, " exceeds n_routed_experts (",
                                c.n_routed_experts, ")"));
  }
  if ((c.num_attention_heads * c.head_dim) % c.o_groups != 0) {
    return f.Error("o_groups", absl::StrCat("num_attention_heads * head_dim (",
                                            c.num_attention_heads * c.head_dim,
                                            ") is not divisible by o_groups (", c.o_groups, ")"));
  }
  const bool has_csa = std::count(c.layer_types.begin(), c.layer_types.end(),
                                  LayerType::kCompressedSparseAttention) > 0;
  const bool has_hca = std::count(c.layer_types.begin(), c.layer_types.end(),
                                  LayerType::kHeavilyCompressedAttention) > 0;
  if (has_csa && c.compress_rate_csa <= 0) {
    return f.Error("compress_rates", "compressed_sparse_attention rate must be positive");
  }
  if (has_hca && c.compress_rate_hca <= 0) {
    return f.Error("compress_rates", "heavily_compressed_attention rate must be positive");
  }
  for (const RopeParams* rope : {&c.rope_main, &c.rope_compress}) {
    if (!(rope->partial_rotary_factor > 0.0 && rope->partial_rotary_factor <= 1.0)) {
      return f.Error("rope_parameters",
                     absl::StrCat("partial_rotary_factor must be in (0, 1], got ",
                                  rope->partial_rotary_factor));
    }
    const auto rope_dim =
        static_cast<int64_t>(static_cast<double>(c.head_dim) * rope->partial_rotary_factor);

    if (rope_dim <= 0 || rope_dim % 2 != 0 || rope_dim > c.head_dim ||
        rope_dim > c.index_head_dim) {
      return f.Error("rope_parameters",
                     absl::StrCat("rotary dim head_dim * partial_rotary_factor = ", rope_dim,
                                  " must be even, positive and at most head_dim and "
                                  "index_head_dim"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseLayerSchedules(const Fields& f, ModelConfig& c) {
  const int64_t n = c.num_hidden_layers;
  std::optional<std::vector<std::string>> layer_types;
  std::optional<std::vector<int64_t>> compress_ratios;
  PDSERVE_RETURN_IF_ERROR(f.StringList("layer_types", layer_types));
  PDSERVE_RETURN_IF_ERROR(f.IntList("compress_ratios", compress_ratios));
  if (!layer_types && compress_ratios) {
    layer_types.emplace();
    for (int64_t r : *compress_ratios) {
      // The legacy per-layer ratios are a fixed lookup, independent of compress_rates.
      if (r == 0) {
        layer_types->push_back("sliding_attention");
      } else if (r == 4) {
        layer_types->push_back("compressed_sparse_attention");
      } else if (r == 128) {
        layer_types->push_back("heavily_compressed_attention");
      } else {
        return f.Error("compress_ratios", absl::StrCat("entry ", r, " is not one of 0, 4, 128"));
      }
    }
  }
  if (!layer_types) {
    // V4-Pro default: two HCA layers, then CSA / HCA interleaved starting with HCA.
    layer_types.emplace();
    for (int64_t i = 0; i < std::min<int64_t>(n, 2); ++i) {
      layer_types->push_back("heavily_compressed_attention");
    }
    for (int64_t i = 0; i < std::max<int64_t>(n - 2, 0); ++i) {
      layer_types->push_back(i % 2 ? "compressed_sparse_attention"
                                   : "heavily_compressed_attention");
    }
  }
  // Longer lists are truncated (legacy lists carry the MTP layers); shorter ones are an error.
  if (static_cast<int64_t>(layer_types->size()) < n) {
    return f.Error("layer_types",
                   absl::StrCat("has ", layer_types->size(), " entries, num_hidden_layers is ", n));
  }
  c.layer_types.clear();
  for (int64_t i = 0; i < n; ++i) {
    auto t = ParseLayerType((*layer_types)[i]);
    if (!t.ok()) return f.Error("layer_types", std::string(t.status().message()));
    c.layer_types.push_back(*t);
  }

  std::optional<std::vector<std::string>> mlp_types;
  PDSERVE_RETURN_IF_ERROR(f.StringList("mlp_layer_types", mlp_types));
  if (!mlp_types) {
    int64_t n_hash = 3;
    PDSERVE_RETURN_IF_ERROR(f.Int("num_hash_layers", n_hash));
    mlp_types.emplace();
    for (int64_t i = 0; i < n; ++i) mlp_types->push_back(i < n_hash ? "hash_moe" : "moe");
  }
  if (static_cast<int64_t>(mlp_types->size()) < n) {
    return f.Error("mlp_layer_types",
                   absl::StrCat("has ", mlp_types->size(), " entries, num_hidden_layers is ", n));
  }
  c.mlp_layer_types.clear();
  for (int64_t i = 0; i < n; ++i) {
    const std::string& s = (*mlp_types)[i];
    if (s == "hash_moe") {
      c.mlp_layer_types.push_back(MlpLayerType::kHashMoe);
    } else if (s == "moe") {
      c.mlp_layer_types.push_back(MlpLayerType::kMoe);
    } else {
      return f.Error("mlp_layer_types",
                     absl::StrCat("unknown entry \"", s, "\" (expected hash_moe or moe)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseCompressRates(const Fields& f, const std::string& source, ModelConfig& c) {
  if (f.Has("compress_rates")) {
    const Json& rates = f.Raw("compress_rates");
    if (!rates.is_object()) return f.Error("compress_rates", "expected an object");
    Fields r(rates, absl::StrCat(source, ": compress_rates"));
    PDSERVE_RETURN_IF_ERROR(r.Int("compressed_sparse_attention", c.compress_rate_csa));
    PDSERVE_RETURN_IF_ERROR(r.Int("heavily_compressed_attention", c.compress_rate_hca));
  }
  PDSERVE_RETURN_IF_ERROR(f.Int("compress_rate_csa", c.compress_rate_csa));
  PDSERVE_RETURN_IF_ERROR(f.Int("compress_rate_hca", c.compress_rate_hca));
  return absl::OkStatus();
}

// rope_parameters as DeepseekV4Config.__post_init__ leaves them, after the base class folded a
// legacy `rope_scaling` in (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict).
absl::Status ParseRopeParameters(const Fields& f, const std::string& source, double rope_theta,
                                 double compress_rope_theta, double prf, ModelConfig& c) {
  Json rp = Json::object();
  if (f.Has("rope_scaling")) {
    rp = f.Raw("rope_scaling");
  } else if (f.Has("rope_parameters")) {
    rp = f.Raw("rope_parameters");
  }
  if (!rp.is_object()) return f.Error("rope_parameters", "expected an object");
  const std::string where = absl::StrCat(source, ": rope_parameters");
  auto main_it = rp.find("main");
  auto compress_it = rp.find("compress");
  if (main_it != rp.end() && main_it->is_object() && compress_it != rp.end() &&
      compress_it->is_object()) {
    PDSERVE_ASSIGN_OR_RETURN(c.rope_main, ParseRope(*main_it, absl::StrCat(where, ".main"), 1.0,
                                                    c.max_position_embeddings));
    PDSERVE_ASSIGN_OR_RETURN(
        c.rope_compress,
        ParseRope(*compress_it, absl::StrCat(where, ".compress"), 1.0, c.max_position_embeddings));
    return absl::OkStatus();
  }
  // Flat form: the dict is the compress (yarn) rope; main is plain RoPE at rope_theta.
  Json compress = Json::object();
  for (auto it = rp.begin(); it != rp.end(); ++it) {
    if (it.key() != "main" && it.key() != "compress") compress[it.key()] = it.value();
  }
  if (!compress.contains("rope_type")) {
    compress["rope_type"] = compress.contains("type") ? compress["type"] : Json("default");
  }
  if ((compress["rope_type"] == "yarn") && !compress.contains("original_max_position_embeddings")) {
    compress["original_max_position_embeddings"] = c.max_position_embeddings;
  }
  compress["rope_theta"] = compress_rope_theta;
  compress["partial_rotary_factor"] = prf;
  if (compress["rope_type"] == "yarn" && !compress.contains("attention_factor")) {
    // The V4 reference does not scale cos/sin by YaRN's mscale.
    compress["attention_factor"] = 1.0;
  }
  const Json main = {
      {"rope_type", "default"}, {"rope_theta", rope_theta}, {"partial_rotary_factor", prf}};
  PDSERVE_ASSIGN_OR_RETURN(
      c.rope_main, ParseRope(main, absl::StrCat(where, ".main"), prf, c.max_position_embeddings));
  PDSERVE_ASSIGN_OR_RETURN(c.rope_compress,
                           ParseRope(compress, where, prf, c.max_position_embeddings));
  return absl::OkStatus();
}

absl::Status ParseTokenIds(const Fields& f, ModelConfig& c) {
  if (f.IsNull("bos_token_id")) c.bos_token_id = -1;
  PDSERVE_RETURN_IF_ERROR(f.Int("bos_token_id", c.bos_token_id));
  if (f.IsNull("eos_token_id")) c.eos_token_ids.clear();
  if (!f.Has("eos_token_id")) return absl::OkStatus();
  const Json& eos = f.Raw("eos_token_id");
  if (eos.is_number_integer()) {
    c.eos_token_ids = {eos.get<int64_t>()};
    return absl::OkStatus();
  }
  std::optional<std::vector<int64_t>> ids;
  PDSERVE_RETURN_IF_ERROR(f.IntList("eos_token_id", ids));
  c.eos_token_ids = std::move(*ids);
  return absl::OkStatus();
}

absl::Status ParseScalars(const Fields& f, ModelConfig& c) {
  // transformers' attribute_map routes these aliases onto the V4 fields, after the fields.
  const std::pair<const char*, int64_t*> ints[] = {
      {"vocab_size", &c.vocab_size},
      {"hidden_size", &c.hidden_size},
      {"moe_intermediate_size", &c.moe_intermediate_size},
      {"intermediate_size", &c.moe_intermediate_size},
      {"num_hidden_layers", &c.num_hidden_layers},
      {"num_attention_heads", &c.num_attention_heads},
      {"num_key_value_heads", &c.num_key_value_heads},
      {"head_dim", &c.head_dim},
      {"q_lora_rank", &c.q_lora_rank},
      {"num_experts_per_tok", &c.num_experts_per_tok},
      {"n_routed_experts", &c.n_routed_experts},
      {"num_local_experts", &c.n_routed_experts},
      {"n_shared_experts", &c.n_shared_experts},
      {"max_position_embeddings", &c.max_position_embeddings},
      {"hc_mult", &c.hc_mult},
      {"hc_sinkhorn_iters", &c.hc_sinkhorn_iters},
      {"sliding_window", &c.sliding_window},
      {"o_groups", &c.o_groups},
      {"o_lora_rank", &c.o_lora_rank},
      {"index_n_heads", &c.index_n_heads},
      {"index_head_dim", &c.index_head_dim},
      {"index_topk", &c.index_topk},
  };
  for (const auto& [key, out] : ints) PDSERVE_RETURN_IF_ERROR(f.Int(key, *out));
  const std::pair<const char*, double*> floats[] = {
      {"routed_scaling_factor", &c.routed_scaling_factor},
      {"hc_eps", &c.hc_eps},
      {"swiglu_limit", &c.swiglu_limit},
      {"rms_norm_eps", &c.rms_norm_eps},
  };
  for (const auto& [key, out] : floats) PDSERVE_RETURN_IF_ERROR(f.Float(key, *out));
  PDSERVE_RETURN_IF_ERROR(f.Bool("norm_topk_prob", c.norm_topk_prob));
  PDSERVE_RETURN_IF_ERROR(f.Bool("tie_word_embeddings", c.tie_word_embeddings));

  std::string scoring = "sqrtsoftplus";
  PDSERVE_RETURN_IF_ERROR(f.String("scoring_func", scoring));
  if (scoring == "sqrtsoftplus") {
    c.scoring_func = ScoringFunc::kSqrtSoftplus;
  } else if (scoring == "sigmoid") {
    c.scoring_func = ScoringFunc::kSigmoid;
  } else if (scoring == "softmax") {
    c.scoring_func = ScoringFunc::kSoftmax;
  } else {
    return f.Error("scoring_func", absl::StrCat("unknown scoring function \"", scoring,
                                                "\" (expected sqrtsoftplus, sigmoid or softmax)"));
  }
  // The engine implements the architecture DeepSeek ships; refuse variants it would get wrong.
  std::string hidden_act = "silu";
  PDSERVE_RETURN_IF_ERROR(f.String("hidden_act", hidden_act));
  if (hidden_act != "silu") {
    return f.Error("hidden_act", absl::StrCat("unsupported \"", hidden_act, "\" (only silu)"));
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    bool bias = false;
    PDSERVE_RETURN_IF_ERROR(f.Bool(key, bias));
    if (bias) return f.Error(key, "biases are not supported (DeepSeek-V4 has none)");
  }
  return absl::OkStatus();
}

}  // namespace

const char* LayerTypeName(LayerType t) {
  switch (t) {
    case LayerType::kSlidingAttention:
      return "sliding_attention";
    case LayerType::kCompressedSparseAttention:
      return "compressed_sparse_attention";
    case LayerType::kHeavilyCompressedAttention:
      return "heavily_compressed_attention";
  }
  return "unknown";
}

absl::StatusOr<ModelConfig> ModelConfig::Parse(const std::string& json_text,
                                               const std::string& source) {
  const Json root = Json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON"));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": expected a JSON object"));
  }
  Fields f(root, source);
  ModelConfig c;
  c.model_type.clear();
  PDSERVE_RETURN_IF_ERROR(f.String("model_type", c.model_type));
  if (c.model_type != "deepseek_v4") {
    return f.Error("model_type", absl::StrCat("unknown model_type \"", c.model_type,
                                              "\" (expected \"deepseek_v4\")"));
  }
  PDSERVE_RETURN_IF_ERROR(ParseScalars(f, c));
  PDSERVE_RETURN_IF_ERROR(ParseTokenIds(f, c));
  PDSERVE_RETURN_IF_ERROR(ParseCompressRates(f, source, c));
  // Checked before the per-layer schedules are built from it.
  if (c.num_hidden_layers <= 0 || c.num_hidden_layers > kMaxLayers) {
    return f.Error("num_hidden_layers",
                   absl::StrCat("must be in [1, ", kMaxLayers, "], got ", c.num_hidden_layers));
  }
  PDSERVE_RETURN_IF_ERROR(ParseLayerSchedules(f, c));

  // The rope dimension below divides by head_dim: a zero one is named here, not as a bad
  // qk_rope_head_dim.
  if (c.head_dim <= 0)
    return f.Error("head_dim", absl::StrCat("must be positive, got ", c.head_dim));
  double prf = 64.0 / 512.0;
  if (f.Has("partial_rotary_factor")) {
    PDSERVE_RETURN_IF_ERROR(f.Float("partial_rotary_factor", prf));
  } else if (f.Has("qk_rope_head_dim")) {
    int64_t legacy_rope_dim = 0;
    PDSERVE_RETURN_IF_ERROR(f.Int("qk_rope_head_dim", legacy_rope_dim));
    prf = static_cast<double>(legacy_rope_dim) / static_cast<double>(c.head_dim);
  }
  if (!(prf > 0.0 && prf <= 1.0)) {
    return f.Error(f.Has("partial_rotary_factor") ? "partial_rotary_factor" : "qk_rope_head_dim",
                   absl::StrCat("partial rotary factor must be in (0, 1], got ", prf));
  }
  c.qk_rope_head_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * prf);
  double rope_theta = 10000.0, compress_rope_theta = 160000.0;
  PDSERVE_RETURN_IF_ERROR(f.Float("rope_theta", rope_theta));
  PDSERVE_RETURN_IF_ERROR(f.Float("compress_rope_theta", compress_rope_theta));
  PDSERVE_RETURN_IF_ERROR(ParseRopeParameters(f, source, rope_theta, compress_rope_theta, prf, c));
  PDSERVE_RETURN_IF_ERROR(CheckSizes(c, f));
  return c;
}

absl::StatusOr<ModelConfig> ModelConfig::Load(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open model config"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return Parse(text.str(), path);
}

}  // namespace pdserve::engine
