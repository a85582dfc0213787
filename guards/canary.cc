#include "guards/canary.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace pdserve::guards {

bool CanarySampler::Picks(absl::string_view request_id) const {
  if (every_ <= 0) return false;
  return XXH3_64bits(request_id.data(), request_id.size()) % static_cast<uint64_t>(every_) == 0;
}

absl::StatusOr<CanaryResult> CheckLastTokenLogits(const engine::Model& model,
                                                  const std::vector<int32_t>& tokens,
                                                  std::span<const float> served, double tolerance) {
  const engine::ModelConfig& config = model.config();
  if (tokens.empty() || static_cast<int64_t>(tokens.size()) > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("canary: sequence of ", tokens.size(),
                                                   " tokens outside [1, ",
                                                   config.max_position_embeddings, "]"));
  }
  if (static_cast<int64_t>(served.size()) != config.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("canary: ", served.size(), " served logits, vocabulary ", config.vocab_size));
  }
  engine::ModelState state = model.NewState();
  PDSERVE_ASSIGN_OR_RETURN(engine::Tensor logits,
                           model.Forward(&state, tokens, nullptr, engine::ChunkLogits::kLastRow));
  const float* ref = logits.ptr() + (logits.dim(0) - 1) * config.vocab_size;
  return CompareLogits(served, std::span<const float>(ref, served.size()), tolerance);
}

absl::StatusOr<CanaryResult> CompareLogits(std::span<const float> served,
                                           std::span<const float> ref, double tolerance) {
  if (served.empty() || served.size() != ref.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("canary: ", served.size(), " served logits against ", ref.size()));
  }
  CanaryResult r;
  bool finite = true;
  for (size_t i = 0; i < served.size(); ++i) {
    const double a = served[i];
    const double b = ref[i];
    if (!std::isfinite(a) || !std::isfinite(b)) {
      finite = false;
      continue;
    }
    r.max_abs_diff = std::max(r.max_abs_diff, std::abs(a - b));
    r.max_abs_ref = std::max(r.max_abs_ref, std::abs(b));
  }
  r.error = r.max_abs_ref > 0 ? r.max_abs_diff / r.max_abs_ref : r.max_abs_diff;
  if (!finite) r.error = INFINITY;
  r.pass = finite && r.error <= tolerance;
  return r;
}

absl::Status CanaryMismatchError(absl::string_view who, const CanaryResult& result,
                                 double tolerance) {
  return absl::InternalError(
      absl::StrFormat("canary mismatch: %s: logits differ from a fresh one-shot forward by %.3g "
                      "(max|diff| %.3g, max|ref| %.3g, tolerance %.3g)",
                      who, result.error, result.max_abs_diff, result.max_abs_ref, tolerance));
}

}  // namespace pdserve::guards
