// Random inputs for the block-scaled GEMM tests (fp8_gemm_test.cc, moe_gemm_test.cc): e4m3 and
// packed e2m1 weights, fp32 and ue8m0 scales, bf16 activations, and the comparison of a bf16 GPU
// output against the float32 CPU reference. Test-only; not thread-safe.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/fp8_gemm.cuh"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda::testing {

// " config=w,s,t[,cluster][,smem_scales][,reg][,alternate][,in_flight]": an fp8_gemm_wgmma config
// as failure messages name it.
inline std::string WgmmaConfigLabel(const Fp8WgmmaConfig& c) {
  return " config=" + std::to_string(c.warpgroups) + "," + std::to_string(c.stages) + "," +
         std::to_string(c.target_blocks) + (c.cluster_reduce ? ",cluster" : "") +
         (c.smem_scales ? ",smem_scales" : "") + (c.a16_register_weights ? ",reg" : "") +
         (c.alternate_turns ? ",alternate" : "") + (c.two_in_flight ? ",in_flight" : "") +
         (c.max_registers != 0 ? ",max_registers=" + std::to_string(c.max_registers) : "") +
         (c.a16_cluster_reduce_tokens != 0
              ? ",a16_cluster_reduce_tokens=" + std::to_string(c.a16_cluster_reduce_tokens)
              : "");
}

// The WgmmaMaxRegisters tests (W8A8: a16 false, W8A16: true) over the default decode config, one
// warpgroup with 4 stages and 2 stages with cluster_reduce (the plan takes max_registers at <= 64
// tokens), then two warpgroups and two blocks in flight (it does not): at every token tile 8..64
// and odd counts (72 and 130 run uncapped), k = 128, 384, 1280 and n = 200, `run` (the GEMM
// of a fresh case, checked against the reference) with each cap gives the uncapped
// build's bits, and fp8_gemm_wgmma_kernel_registers says the capped build ran (at most the cap)
// or did not (the uncapped build's count). `run(m, k, configs)` returns one output per config.
template <typename Run>
void CheckMaxRegisters(bool a16, const Run& run) {
  struct Base {
    Fp8WgmmaConfig config;
    bool capped;
  };
  const Base bases[] = {{kFp8WgmmaDecodeConfig, true},
                        {{1, 4, 0, false, false, false}, true},
                        {{1, 2, 4096, true, true, true}, true},
                        {{2, 4, 264, false, true, true}, false},
                        {{0, 4, 264, false, true, true, false, true}, false}};
  for (const Base& base : bases) {
    for (int64_t k : {128, 384, 1280}) {
      for (int64_t m : {1, 8, 16, 17, 24, 32, 33, 40, 48, 56, 64, 72, 130}) {
        const int uncapped_registers = fp8_gemm_wgmma_kernel_registers(m, 200, k, base.config, a16);
        EXPECT_GT(uncapped_registers, 0);
        std::vector<Fp8WgmmaConfig> configs = {base.config};
        for (const int cap : {96, 128}) {
          configs.push_back(base.config);
          configs.back().max_registers = cap;
        }
        const std::vector<std::vector<uint16_t>> outs = run(m, k, configs);
        ASSERT_EQ(outs.size(), configs.size());
        ASSERT_FALSE(outs[0].empty());
        for (size_t i = 1; i < configs.size(); ++i) {
          const int cap = configs[i].max_registers;
          EXPECT_EQ(outs[0], outs[i]) << "m=" << m << " k=" << k << " cap=" << cap;
          const int registers = fp8_gemm_wgmma_kernel_registers(m, 200, k, configs[i], a16);
          if (base.capped && m <= 64) {
            EXPECT_LE(registers, cap) << "m=" << m << " k=" << k;
          } else {
            EXPECT_EQ(registers, uncapped_registers) << "m=" << m << " k=" << k << " cap=" << cap;
          }
        }
      }
    }
  }
}

// Random finite e4m3 codes (never the NaN codes 0x7F / 0xFF).
inline std::vector<uint8_t> RandomE4m3(std::mt19937_64& rng, size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) {
    do {
      b = static_cast<uint8_t>(byte(rng));
    } while ((b & 0x7F) == 0x7F);
  }
  return v;
}

inline std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(byte(rng));
  return v;
}

// Powers of two 2^[-4, 4] times a random mantissa in [1, 2).
inline std::vector<float> RandomScales(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-4, 4);
  std::vector<float> v(n);
  for (float& s : v) s = std::ldexp(mantissa(rng), exponent(rng));
  return v;
}

// ue8m0 exponents 127 +- 4.
inline std::vector<uint8_t> RandomUe8m0(std::mt19937_64& rng, size_t n) {
  std::uniform_int_distribution<int> e(123, 131);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(e(rng));
  return v;
}

// bf16 bits of N(0, 1) values times 2^[-6, 6] per row (rows of very different magnitudes).
inline std::vector<uint16_t> RandomActivations(std::mt19937_64& rng, int64_t rows, int64_t stride) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<uint16_t> v(static_cast<size_t>(rows * stride));
  for (int64_t r = 0; r < rows; ++r) {
    const int e = exponent(rng);
    for (int64_t c = 0; c < stride; ++c) v[r * stride + c] = ToBf16(std::ldexp(normal(rng), e));
  }
  return v;
}

inline std::vector<float> ToFloatsBf16(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = FromBf16(bits[i]);
  return v;
}

// A dense case (fields w_scale, x, x_stride, k; at least 2 rows) made extreme: weight blocks
// scaled by 2^-20 and 2^20 alternately, activation rows 0 and 1 times 2^-20 and 2^20.
template <typename Case>
void MakeScalesExtreme(Case& c) {
  for (size_t i = 0; i < c.w_scale.size(); ++i) {
    c.w_scale[i] = std::ldexp(1.0f, i % 2 == 0 ? -20 : 20);
  }
  for (int64_t col = 0; col < c.k; ++col) {
    c.x[0 * c.x_stride + col] = ToBf16(std::ldexp(FromBf16(c.x[col]), -20));
    c.x[1 * c.x_stride + col] = ToBf16(std::ldexp(FromBf16(c.x[c.x_stride + col]), 20));
  }
}

// Compares rows [rows, n] of a bf16 GPU output (row stride `stride`) with the float32 reference
// [rows, n] rounded to bf16: NaN / Inf at the same positions, normalized error <= 4e-3 (one bf16
// rounding plus the fp32 summation order), columns n .. stride-1 still holding `sentinel`. Only
// rows with check[r] (empty: all) are compared; the others must hold `sentinel` entirely.
inline void ExpectBf16Rows(const std::vector<uint16_t>& got, int64_t rows, int64_t n,
                           int64_t stride, const std::vector<float>& want,
                           const std::vector<bool>& check, uint16_t sentinel,
                           const std::string& what) {
  std::vector<double> g;
  std::vector<double> w;
  for (int64_t r = 0; r < rows; ++r) {
    const bool compared = check.empty() || check[r];
    for (int64_t c = 0; c < stride; ++c) {
      const uint16_t bits = got[r * stride + c];
      if (!compared || c >= n) {
        ASSERT_EQ(bits, sentinel) << what << ": row " << r << " column " << c << " written";
        continue;
      }
      g.push_back(FromBf16(bits));
      w.push_back(FromBf16(ToBf16(want[r * n + c])));
    }
  }
  ExpectNear(g, w, 4e-3, what);
}

}  // namespace pdserve::kernels::cuda::testing
