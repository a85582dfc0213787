#include "engine/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "engine/quant.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sink_attention.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

namespace {

std::string Prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + ".self_attn"; }

// serving::kPoisonWord (a quiet NaN), what a freed or never-written pool page holds in debug
// builds; repeated here because the engine does not depend on serving.
float UnwrittenRowValue() { return std::bit_cast<float>(uint32_t{0x7FC57FC5u}); }

}  // namespace

Attention::Attention(const ModelConfig& config, const Weights& weights, int64_t layer,
                     const RopeTable* main_rope, const RopeTable* compress_rope,
                     IndexerFault indexer_fault, bool bf16_state, Fp8Emulation fp8)
    : config_(config),
      type_(config.layer_types.at(static_cast<size_t>(layer))),
      rate_(config.CompressRate(type_)),
      rope_(type_ == LayerType::kSlidingAttention ? main_rope : compress_rope),
      bf16_state_(bf16_state),
      fp8_(fp8.ForDense()),
      q_a_proj_(weights.At(Prefix(layer) + ".q_a_proj.weight")),
      q_a_norm_(weights.At(Prefix(layer) + ".q_a_norm.weight")),
      q_b_proj_(weights.At(Prefix(layer) + ".q_b_proj.weight")),
      kv_proj_(weights.At(Prefix(layer) + ".kv_proj.weight")),
      kv_norm_(weights.At(Prefix(layer) + ".kv_norm.weight")),
      o_a_proj_(weights.At(Prefix(layer) + ".o_a_proj.weight")),
      o_b_proj_(weights.At(Prefix(layer) + ".o_b_proj.weight")),
      sinks_(weights.At(Prefix(layer) + ".sinks")) {
  const float eps = static_cast<float>(config.rms_norm_eps);
  const std::string compressor = Prefix(layer) + ".compressor";
  if (type_ == LayerType::kHeavilyCompressedAttention) {
    compressor_ = std::make_unique<Compressor>(weights, compressor, rate_, config.head_dim,
                                               /*overlapping=*/false, config.hidden_size, eps,
                                               compress_rope, bf16_state, fp8);
  } else if (type_ == LayerType::kCompressedSparseAttention) {
    compressor_ = std::make_unique<Compressor>(weights, compressor, rate_, config.head_dim,
                                               /*overlapping=*/true, config.hidden_size, eps,
                                               compress_rope, bf16_state, fp8);
    indexer_compressor_ = std::make_unique<Compressor>(
        weights, compressor + ".indexer", rate_, config.index_head_dim,
        /*overlapping=*/true, config.hidden_size, eps, compress_rope, bf16_state, fp8);
    indexer_ = std::make_unique<Indexer>(config, weights, compressor + ".indexer", compress_rope,
                                         indexer_fault, fp8);
  }
}

LayerState Attention::NewState() const {
  LayerState s;
  s.window_kv = Tensor({0, config_.head_dim});
  if (compressor_) s.compressor = compressor_->NewState();
  if (indexer_compressor_) s.indexer = indexer_compressor_->NewState();
  return s;
}

void Attention::Forward(const float* x, int64_t tokens, int64_t first_position, LayerState* state,
                        float* out) const {
  const int64_t hidden = config_.hidden_size;
  const int64_t heads = config_.num_attention_heads;
  const int64_t hd = config_.head_dim;
  const int64_t q_lora = config_.q_lora_rank;
  const int64_t window = config_.sliding_window;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) positions[i] = first_position + i;
  std::vector<float> cos;
  std::vector<float> sin;
  rope_->Compute(positions, &cos, &sin);

  std::vector<float> q_res(static_cast<size_t>(tokens * q_lora));
  EmulatedLinear(fp8_, x, tokens, hidden, q_a_proj_.ptr(), q_lora, q_res.data());
  cpu::RmsNorm(q_res.data(), q_a_norm_.ptr(), tokens, q_lora, eps, q_res.data());
  std::vector<float> q(static_cast<size_t>(tokens * heads * hd));
  EmulatedLinear(fp8_, q_res.data(), tokens, q_lora, q_b_proj_.ptr(), heads * hd, q.data());
  cpu::RmsNorm(q.data(), nullptr, tokens * heads, hd, eps, q.data());
  cpu::ApplyInterleavedRope(q.data(), tokens, heads * hd, heads, hd, rope_->rope_dim(), cos.data(),
                            sin.data(), /*inverse=*/false);

  // Keys of this call: the carried window rows followed by the new tokens' rows.
  Tensor& keys = state->window_kv;
  const int64_t carried = keys.dim(0);
  const int64_t keys_first_position = first_position - carried;
  std::vector<float> kv(static_cast<size_t>(tokens * hd));
  EmulatedLinear(fp8_, x, tokens, hidden, kv_proj_.ptr(), hd, kv.data());
  cpu::RmsNorm(kv.data(), kv_norm_.ptr(), tokens, hd, eps, kv.data());
  cpu::ApplyInterleavedRope(kv.data(), tokens, hd, 1, hd, rope_->rope_dim(), cos.data(), sin.data(),
                            /*inverse=*/false);
  if (bf16_state_) RoundToBf16(kv.data(), tokens * hd);
  AppendRows(&keys, kv.data(), tokens);

  std::vector<int32_t> picks;
  if (compressor_) compressor_->Extend(x, tokens, &state->compressor);
  if (indexer_) {
    indexer_compressor_->Extend(x, tokens, &state->indexer);
    indexer_->Select(x, q_res.data(), tokens, first_position, state->indexer.entries, &picks);
  }
  const Tensor& entries = state->compressor.entries;

  // Attention in blocks of queries: the union of the block's keys (a contiguous run of window
  // rows, then the compressed entries any of its queries sees) is gathered once, and a per-query
  // mask keeps each query to its own keys.
  std::vector<float> attn(static_cast<size_t>(tokens * heads * hd));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  constexpr int64_t kBlock = 16;
  std::vector<int32_t> block_entries;
  std::vector<float> block_keys;
  std::vector<uint8_t> visible;
  for (int64_t b0 = 0; b0 < tokens; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, tokens - b0);
    const int64_t last = positions[b0 + nb - 1];
    const int64_t window_from = std::max(positions[b0] - window + 1, keys_first_position);
    const int64_t window_rows = last - window_from + 1;
    block_entries.clear();
    if (type_ == LayerType::kHeavilyCompressedAttention) {
      const int64_t n = std::min(entries.dim(0), (last + 1) / rate_);
      for (int64_t w = 0; w < n; ++w) block_entries.push_back(static_cast<int32_t>(w));
    } else if (indexer_) {
      const auto first = picks.begin() + b0 * indexer_->topk();
      block_entries.assign(first, first + nb * indexer_->topk());
      std::sort(block_entries.begin(), block_entries.end());
      block_entries.erase(std::unique(block_entries.begin(), block_entries.end()),
                          block_entries.end());
      block_entries.erase(block_entries.begin(),
                          std::upper_bound(block_entries.begin(), block_entries.end(), -1));
    }
    const int64_t n_keys = window_rows + static_cast<int64_t>(block_entries.size());
    block_keys.resize(static_cast<size_t>(n_keys * hd));
    std::copy_n(keys.ptr() + (window_from - keys_first_position) * hd, window_rows * hd,
                block_keys.data());
    for (size_t e = 0; e < block_entries.size(); ++e) {
      float* to = block_keys.data() + (window_rows + static_cast<int64_t>(e)) * hd;
      if (block_entries[e] < entries.dim(0)) {
        std::copy_n(entries.ptr() + block_entries[e] * hd, hd, to);
      } else {
        // Only a faulty indexer (IndexerFault::kUnmaskedSlots) names an entry that does not
        // exist yet; a kernel would read a never-written row, which pool pages hold as poison.
        std::fill_n(to, hd, UnwrittenRowValue());
      }
    }
    visible.assign(static_cast<size_t>(nb * n_keys), 0);
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t t = positions[b0 + j];
      uint8_t* row = visible.data() + j * n_keys;
      for (int64_t p = std::max(t - window + 1, window_from); p <= t; ++p) row[p - window_from] = 1;
      if (type_ == LayerType::kHeavilyCompressedAttention) {
        const int64_t n = std::min(entries.dim(0), (t + 1) / rate_);
        std::fill(row + window_rows, row + window_rows + n, 1);
      } else if (indexer_) {
        for (int64_t k = 0; k < indexer_->topk(); ++k) {
          const int32_t w = picks[static_cast<size_t>((b0 + j) * indexer_->topk() + k)];
          if (w < 0) continue;
          const auto at = std::lower_bound(block_entries.begin(), block_entries.end(), w);
          row[window_rows + (at - block_entries.begin())] = 1;
        }
      }
    }
    cpu::SinkAttention(q.data() + b0 * heads * hd, nb, heads, hd, block_keys.data(), n_keys,
                       visible.data(), sinks_.ptr(), scale, attn.data() + b0 * heads * hd);
  }
  cpu::ApplyInterleavedRope(attn.data(), tokens, heads * hd, heads, hd, rope_->rope_dim(),
                            cos.data(), sin.data(), /*inverse=*/true);

  // Grouped output projection: group g's heads [tokens, heads * hd / G] -> [tokens, o_lora].
  const int64_t groups = config_.o_groups;
  const int64_t group_in = heads * hd / groups;
  const int64_t o_lora = config_.o_lora_rank;
  std::vector<float> grouped(static_cast<size_t>(tokens * groups * o_lora));
  for (int64_t g = 0; g < groups; ++g) {
    EmulatedLinear(fp8_, attn.data() + g * group_in, tokens, group_in, heads * hd,
                   o_a_proj_.ptr() + g * o_lora * group_in, o_lora, grouped.data() + g * o_lora,
                   groups * o_lora);
  }
  EmulatedLinear(fp8_, grouped.data(), tokens, groups * o_lora, o_b_proj_.ptr(), hidden, out);

  DropFrontRows(&keys, keys.dim(0) - std::max<int64_t>(window - 1, 0));
}

}  // namespace pdserve::engine
