#include "kernels/cpu/fp8_gemm.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

constexpr float kE4m3Max = 448.0f;

// Values of the finite non-negative e4m3 codes 0x00 .. 0x7E, ascending.
const std::array<float, 127>& PositiveE4m3() {
  static const std::array<float, 127> table = [] {
    std::array<float, 127> t{};
    for (int c = 0; c < 127; ++c) t[c] = E4m3Value(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// The smallest power of two >= s (s finite, positive, normal); Inf stays Inf.
float RoundUpToPowerOfTwo(float s) {
  uint32_t u;
  std::memcpy(&u, &s, sizeof(u));
  if ((u & 0x007FFFFFu) != 0) u = (u & 0x7F800000u) + 0x00800000u;
  float r;
  std::memcpy(&r, &u, sizeof(r));
  return r;
}

// Row-major [rows, k] float32 of dequantized activations.
std::vector<float> DequantizedActivations(const float* x, int64_t rows, int64_t k, int64_t x_stride,
                                          bool ue8m0) {
  std::vector<uint8_t> q(static_cast<size_t>(rows * k));
  std::vector<float> s(static_cast<size_t>(rows * (k / kQuantBlock)));
  QuantizeActivations(x, rows, k, x_stride, ue8m0, q.data(), s.data());
  std::vector<float> out(q.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      out[r * k + c] = E4m3Value(q[r * k + c]) * s[(c / kQuantBlock) * rows + r];
    }
  }
  return out;
}

// Row-major [rows, k] float32 copy of x's first k columns (W8A16: no quantization).
std::vector<float> PlainActivations(const float* x, int64_t rows, int64_t k, int64_t x_stride) {
  std::vector<float> out(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r) std::copy(x + r * x_stride, x + r * x_stride + k, &out[r * k]);
  return out;
}

float Dot(const float* a, const float* b, int64_t k) {
  float sum = 0.0f;
  for (int64_t i = 0; i < k; ++i) sum += a[i] * b[i];
  return sum;
}

// Expert e's weights dequantized to [n, k] float32.
std::vector<float> DequantizedExpert(const ExpertWeightsRef& w, int64_t e) {
  std::vector<float> out(static_cast<size_t>(w.n * w.k));
  const int64_t kblocks = w.k / kQuantBlock;
  const int64_t nblocks = (w.n + kQuantBlock - 1) / kQuantBlock;
  for (int64_t r = 0; r < w.n; ++r) {
    for (int64_t c = 0; c < w.k; ++c) {
      float v;
      if (w.fp4) {
        const uint8_t byte = w.w[(e * w.n + r) * (w.k / 2) + c / 2];
        const float scale =
            Ue8m0Value(w.scale_e8m0[(e * w.n + r) * (w.k / kFp4Group) + c / kFp4Group]);
        v = E2m1Value(c % 2 == 0 ? byte & 0xF : byte >> 4) * scale;
      } else {
        const float scale = w.scale[(e * nblocks + r / kQuantBlock) * kblocks + c / kQuantBlock];
        v = E4m3Value(w.w[(e * w.n + r) * w.k + c]) * scale;
      }
      out[r * w.k + c] = v;
    }
  }
  return out;
}

}  // namespace

float E4m3Value(uint8_t bits) {
  const int exp = (bits >> 3) & 0xF;
  const int mant = bits & 0x7;
  if (exp == 0xF && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9)
                           : std::ldexp(static_cast<float>(8 + mant), exp - 10);
  return (bits & 0x80u) ? -v : v;
}

uint8_t E4m3FromFloat(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const float a = std::min(std::fabs(v), kE4m3Max);
  const auto& table = PositiveE4m3();
  const auto upper = std::lower_bound(table.begin(), table.end(), a);
  int code = static_cast<int>(upper - table.begin());
  if (code > 0 && table[code] != a) {
    const float below = a - table[code - 1];
    const float above = table[code] - a;
    if (below < above || (below == above && (code - 1) % 2 == 0)) --code;
  }
  return static_cast<uint8_t>(sign | code);
}

float E2m1Value(uint8_t nibble) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMagnitude[nibble & 0x7u];
  return (nibble & 0x8u) ? -v : v;
}

float Ue8m0Value(uint8_t bits) {
  if (bits == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(bits) - 127);
}

void QuantizeActivations(const float* x, int64_t rows, int64_t k, int64_t x_stride, bool ue8m0,
                         uint8_t* xq, float* xs) {
  const int64_t kblocks = k / kQuantBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < kblocks; ++b) {
      const float* src = x + r * x_stride + b * kQuantBlock;
      float amax = 1e-4f;
      for (int64_t i = 0; i < kQuantBlock; ++i) amax = std::fmax(amax, std::fabs(src[i]));
      float s = amax / kE4m3Max;
      if (ue8m0) s = RoundUpToPowerOfTwo(s);
      for (int64_t i = 0; i < kQuantBlock; ++i) {
        xq[r * k + b * kQuantBlock + i] = E4m3FromFloat(src[i] / s);
      }
      xs[b * rows + r] = s;
    }
  }
}

void Fp8GemmReference(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* w,
                      const float* w_scale, int64_t n, bool ue8m0, float* out) {
  const std::vector<float> xd = DequantizedActivations(x, m, k, x_stride, ue8m0);
  const ExpertWeightsRef one{false, w, w_scale, nullptr, 1, n, k};
  const std::vector<float> wd = DequantizedExpert(one, 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) out[r * n + c] = Dot(&xd[r * k], &wd[c * k], k);
  }
}

void W8a16GemmReference(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* w,
                        const float* w_scale, int64_t n, float* out) {
  const std::vector<float> xd = PlainActivations(x, m, k, x_stride);
  const ExpertWeightsRef one{false, w, w_scale, nullptr, 1, n, k};
  const std::vector<float> wd = DequantizedExpert(one, 0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) out[r * n + c] = Dot(&xd[r * k], &wd[c * k], k);
  }
}

void MoeGemmReference(const float* x, int64_t x_stride, bool x_per_pick, const int32_t* experts,
                      const float* pick_weights, int64_t tokens, int64_t top_k,
                      const ExpertWeightsRef& weights, bool ue8m0, float* out) {
  const int64_t rows = x_per_pick ? tokens * top_k : tokens;
  const int64_t k = weights.k;
  const std::vector<float> xd = weights.bf16_activations
                                    ? PlainActivations(x, rows, k, x_stride)
                                    : DequantizedActivations(x, rows, k, x_stride, ue8m0);
  for (int64_t e = 0; e < weights.n_experts; ++e) {
    std::vector<float> wd;
    for (int64_t p = 0; p < tokens * top_k; ++p) {
      if (experts[p] != e) continue;
      if (wd.empty()) wd = DequantizedExpert(weights, e);
      const float* row = &xd[(x_per_pick ? p : p / top_k) * k];
      const float weight = pick_weights != nullptr ? pick_weights[p] : 1.0f;
      for (int64_t c = 0; c < weights.n; ++c) {
        out[p * weights.n + c] = Dot(row, &wd[c * k], k) * weight;
      }
    }
  }
}

}  // namespace pdserve::kernels::cpu
