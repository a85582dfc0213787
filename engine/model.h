// The DeepSeek-V4 causal language model on the CPU backend (float32, OpenBLAS GEMMs, threads).
//
// Math: transformers 5.17 models/deepseek_v4/modeling_deepseek_v4.py (DeepseekV4ForCausalLM),
// one-shot semantics: the logits of a token are those of the one-shot forward over the whole
// sequence, whatever the split into Forward calls (prefill, chunked prefill, token-by-token
// decode). docs/engine.md describes the pieces and the one place the reference's own cache path
// differs.
//
// Thread-safety: a Model is immutable after construction; Forward may run concurrently on
// distinct ModelStates (each state is advanced by one caller at a time).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/chunk_logits.h"
#include "engine/config.h"
#include "engine/model_options.h"
#include "engine/state.h"
#include "engine/tensor.h"
#include "engine/weights.h"

namespace pdserve::engine {

class Model {
 public:
  // Loads config.json and the safetensors weights of a Hugging Face model directory
  // (ModelConfig::Load, Weights::Load) and validates them. `options`: implementation switches
  // and test-only faults (engine/model_options.h); the default is the production engine.
  static absl::StatusOr<Model> Load(const std::string& model_dir, ModelOptions options = {});
  // Builds a model from parts already in memory. InvalidArgument names the first missing or
  // mis-shaped tensor (see engine/tensor_spec.h) or an unsupported config value.
  static absl::StatusOr<Model> FromWeights(ModelConfig config, Weights weights,
                                           ModelOptions options = {});

  Model(Model&&) noexcept;
  Model& operator=(Model&&) noexcept;
  ~Model();

  const ModelConfig& config() const;
  const ModelOptions& options() const;

  // An empty state (position 0) for a new request.
  ModelState NewState() const;

  // Extends `state` by `tokens` (any number >= 1, at positions state->position onward) and
  // returns their logits, float32 [tokens.size(), vocab_size], or with rows =
  // ChunkLogits::kLastRow only the last token's, [1, vocab_size] (the final hyper-connection
  // head, norm and lm_head then run on that row alone; its values are the same bits as the last
  // row of kAllRows, every row's head being its own). InvalidArgument, with `state`
  // untouched, for an empty chunk, a token id outside [0, vocab_size) or a state with another
  // layer count. `state` must come from this model's NewState().
  //
  // `after_layer`, when set, is called once per decoder layer, in layer order, as soon as that
  // layer's attention has extended its state: `layer_state` then holds the layer's state after
  // `position` = state->position + tokens.size() tokens, and this Forward changes it no more (the
  // layer's MoE and the later layers still run). The prefill worker stores and ships layer l's
  // pages from here while layers l+1.. compute. Called on the calling thread; it must not modify
  // the state. The logits do not depend on it.
  using LayerHook =
      std::function<void(int64_t layer, const LayerState& layer_state, int64_t position)>;
  absl::StatusOr<Tensor> Forward(ModelState* state, const std::vector<int32_t>& tokens,
                                 const LayerHook& after_layer = nullptr,
                                 ChunkLogits rows = ChunkLogits::kAllRows) const;

 private:
  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::engine
