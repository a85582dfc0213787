#include "engine/rope_table.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace pdserve::engine {
namespace {

// Dimension index at which a frequency completes `rotations` turns over `max_positions`.
double CorrectionDim(double rotations, double dim, double base, double max_positions) {
  return dim * std::log(max_positions / (rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(base));
}

}  // namespace

RopeTable::RopeTable(const RopeParams& params, int64_t rope_dim, int64_t max_position_embeddings)
    : rope_dim_(rope_dim) {
  const int64_t half = rope_dim / 2;
  const double base = params.rope_theta;
  std::vector<float> pos_freq(static_cast<size_t>(half));
  inv_freq_.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    // torch: base ** (arange(0, dim, 2).float() / dim), all float32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rope_dim);
    pos_freq[i] = std::pow(static_cast<float>(base), exponent);
    inv_freq_[i] = 1.0f / pos_freq[i];
  }
  if (params.rope_type != "yarn") return;

  const double factor = params.factor;
  const double original_max = params.original_max_position_embeddings > 0
                                  ? params.original_max_position_embeddings
                                  : static_cast<double>(max_position_embeddings);
  const double beta_fast = params.beta_fast > 0 ? params.beta_fast : 32.0;
  const double beta_slow = params.beta_slow > 0 ? params.beta_slow : 1.0;
  // transformers reads `truncate` from the top level of config.rope_parameters, which for V4 only
  // holds the nested "main" / "compress" dicts, so it is always true for this model.
  double low = std::floor(CorrectionDim(beta_fast, rope_dim, base, original_max));
  double high = std::ceil(CorrectionDim(beta_slow, rope_dim, base, original_max));
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rope_dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const float ramp = std::clamp(
        (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f,
        1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    const float extrapolation = 1.0f / pos_freq[i];
    const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freq[i]);
    inv_freq_[i] =
        interpolation * (1.0f - extrapolation_weight) + extrapolation * extrapolation_weight;
  }
  attention_scaling_ = static_cast<float>(params.attention_factor);
}

void RopeTable::Compute(const std::vector<int64_t>& positions, std::vector<float>* cos,
                        std::vector<float>* sin) const {
  const size_t half = inv_freq_.size();
  cos->resize(positions.size() * half);
  sin->resize(positions.size() * half);
  for (size_t p = 0; p < positions.size(); ++p) {
    const float pos = static_cast<float>(positions[p]);
    for (size_t i = 0; i < half; ++i) {
      const float angle = inv_freq_[i] * pos;
      (*cos)[p * half + i] =
          static_cast<float>(std::cos(static_cast<double>(angle))) * attention_scaling_;
      (*sin)[p * half + i] =
          static_cast<float>(std::sin(static_cast<double>(angle))) * attention_scaling_;
    }
  }
}

}  // namespace pdserve::engine
