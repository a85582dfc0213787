#include "engine/score.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::engine {

absl::StatusOr<Tensor> ScoreInChunks(const Model& model, const std::vector<int32_t>& tokens,
                                     const std::vector<int64_t>& chunk_sizes) {
  if (tokens.empty()) return absl::InvalidArgumentError("ScoreInChunks: no tokens");
  if (chunk_sizes.empty() || chunk_sizes.back() <= 0) {
    return absl::InvalidArgumentError("ScoreInChunks: the last chunk size must be positive");
  }
  ModelState state = model.NewState();
  const int64_t total = static_cast<int64_t>(tokens.size());
  Tensor logits({0, model.config().vocab_size});
  logits.data.reserve(static_cast<size_t>(total * model.config().vocab_size));
  int64_t pos = 0;
  for (size_t i = 0; pos < total; ++i) {
    const int64_t size = chunk_sizes[std::min(i, chunk_sizes.size() - 1)];
    if (size <= 0) continue;
    const int64_t n = std::min(size, total - pos);
    PDSERVE_ASSIGN_OR_RETURN(Tensor chunk,
                             model.Forward(&state, std::vector<int32_t>(tokens.begin() + pos,
                                                                        tokens.begin() + pos + n)));
    AppendRows(&logits, chunk.ptr(), n);
    pos += n;
  }
  return logits;
}

}  // namespace pdserve::engine
