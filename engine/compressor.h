// The DeepSeek-V4 KV compressor, incremental form (CPU backend, float32).
//
// Every `rate` source tokens become one compressed entry: per channel, a softmax over the window's
// gate rows (gate_proj(x) + position_bias) weights the kv rows (kv_proj(x)); the pooled vector is
// kv_norm'ed and its trailing rope slice rotated at position w * rate with the "compress" rope.
// Overlapping form (CSA compressor and the lightning indexer's compressor, paper §2.3.1): the
// projections are 2 * dim wide, a Ca half and a Cb half; entry w pools window w's Cb rows together
// with window w-1's Ca rows (2 * rate slots; window 0 has no Ca partner). Non-overlapping form
// (HCA, paper §2.3.2): dim wide, entry w pools window w only. Reference: transformers 5.17
// modeling_deepseek_v4.py, DeepseekV4CSACompressor / DeepseekV4HCACompressor / DeepseekV4Indexer
// (the one-shot path: entries depend only on their source tokens, so feeding tokens in any chunks
// gives the same entries). Immutable after construction; Extend may run concurrently on distinct
// states.
#pragma once

#include <cstdint>

#include "engine/fp8_emulation.h"
#include "engine/rope_table.h"
#include "engine/state.h"
#include "engine/weights.h"

namespace pdserve::engine {

class Compressor {
 public:
  // `prefix` names the module, e.g. "model.layers.3.self_attn.compressor"; its tensors
  // kv_proj.weight [width, hidden], gate_proj.weight [width, hidden], position_bias [rate, width]
  // and kv_norm.weight [dim] must exist in `weights` (validated by the model). `weights` and
  // `rope` must outlive the compressor.
  Compressor(const Weights& weights, const std::string& prefix, int64_t rate, int64_t dim,
             bool overlapping, int64_t hidden, float norm_eps, const RopeTable* rope,
             bool bf16_entries = false, Fp8Emulation fp8 = {});

  // Returns an empty state with the right column counts.
  CompressorState NewState() const;

  // Consumes `tokens` rows of x [tokens, hidden] (the attention input), appending an entry to
  // state->entries for every window they complete and keeping the rest in the buffer.
  void Extend(const float* x, int64_t tokens, CompressorState* state) const;

 private:
  void EmitEntry(const float* kv, const float* gate, CompressorState* state) const;

  int64_t rate_;
  int64_t dim_;
  bool overlapping_;
  int64_t width_;
  int64_t hidden_;
  float norm_eps_;
  const RopeTable* rope_;
  bool bf16_entries_;  // ModelOptions::bf16_state: entries rounded to bf16
  Fp8Emulation fp8_;   // ModelOptions::fp8_emulation
  const Tensor& kv_proj_;
  const Tensor& gate_proj_;
  const Tensor& position_bias_;
  const Tensor& kv_norm_;
};

}  // namespace pdserve::engine
