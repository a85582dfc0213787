// Scoring a whole token sequence with a fresh state: the logits of every position, computed in a
// chosen split of Forward calls (one-shot prefill, chunked prefill, prefill-then-decode). Used by
// `pdserve score` and the equivalence tests. Thread-safe like Model::Forward (own state).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/tensor.h"

namespace pdserve::engine {

// Feeds `tokens` in consecutive Forward calls of chunk_sizes[0], chunk_sizes[1], ... tokens, the
// last size repeating until the sequence ends (a final chunk may be shorter); sizes of 0 are
// skipped. Returns float32 logits [tokens.size(), vocab_size]. InvalidArgument for empty
// `tokens`, no positive chunk size, or anything Model::Forward rejects.
absl::StatusOr<Tensor> ScoreInChunks(const Model& model, const std::vector<int32_t>& tokens,
                                     const std::vector<int64_t>& chunk_sizes);

// Prefills the first `prefill` tokens in one call (0: none), then decodes one token at a time.
inline absl::StatusOr<Tensor> ScorePrefillThenDecode(const Model& model,
                                                     const std::vector<int32_t>& tokens,
                                                     int64_t prefill) {
  return ScoreInChunks(model, tokens, {prefill, 1});
}

}  // namespace pdserve::engine
