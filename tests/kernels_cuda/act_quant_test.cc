// kernels/cuda/act_quant.cuh (both act_quant variants, the fused fp32 cast and clamped SwiGLU
// producers) against kernels/cpu/fp8_gemm.h's QuantizeActivations, bit for bit (e4m3 bytes and
// fp32 scales), and fp8_gemm_quantized (fp8_gemm.cuh) against fp8_gemm on the same activations
// (equal bits on the cuBLASLt path) and against Fp8GemmReference. Fresh random inputs each run
// (seed printed; PDSERVE_TEST_SEED replays), rows of 2^-20 and 2^20 scales, NaN / Inf rows, odd
// row counts, guard bands around every output, the kernel before the reference.
#include "kernels/cuda/act_quant.cuh"

#include <cublasLt.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/activations.h"
#include "kernels/cpu/fp8_gemm.h"
#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/launch_check.h"
#include "tests/kernels_cuda/block_scaled_test_util.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::FromBf16;
using testing::GuardedBuffer;
using testing::ToBf16;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// fp32 rows [rows, stride] of N(0, 1) times 2^[-6, 6] per row, made extreme: row 0 scaled so its
// scales are near 2^-20, row 1 near 2^20, row 2 with a NaN and row 3 with an Inf in block 0, row
// 4's block 0 all zero (amax clamped to 1e-4), and the padding columns k .. stride-1 NaN (never
// read). Rows past the count are left as drawn.
std::vector<float> ExtremeRows(std::mt19937_64& rng, int64_t rows, int64_t k, int64_t stride) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<float> x(static_cast<size_t>(rows * stride));
  for (int64_t r = 0; r < rows; ++r) {
    const int e = exponent(rng);
    for (int64_t c = 0; c < stride; ++c) {
      x[r * stride + c] = c < k ? std::ldexp(normal(rng), e) : kNaN;
    }
  }
  const auto row = [&](int64_t r) { return &x[r * stride]; };
  if (rows > 0) {
    for (int64_t c = 0; c < k; ++c) row(0)[c] = 448.0f * std::ldexp(normal(rng) / 4, -20);
  }
  if (rows > 1) {
    for (int64_t c = 0; c < k; ++c) row(1)[c] = 448.0f * std::ldexp(normal(rng) / 4, 20);
  }
  if (rows > 2) row(2)[5] = kNaN;
  if (rows > 3) row(3)[17] = -kInf;
  if (rows > 4) {
    for (int64_t c = 0; c < kActQuantBlock; ++c) row(4)[c] = 0.0f;
  }
  return x;
}

std::vector<uint16_t> Bf16Bits(const std::vector<float>& x) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = ToBf16(x[i]);
  return bits;
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> s;  // in `layout`
};

// QuantizeActivations of `v` (bf16 values held as float, [rows, stride]), scales moved to `layout`.
Quantized Reference(const std::vector<float>& v, int64_t rows, int64_t k, int64_t stride,
                    bool ue8m0, ActScaleLayout layout) {
  const int64_t kb = k / kActQuantBlock;
  Quantized ref;
  ref.q.resize(static_cast<size_t>(rows * k));
  std::vector<float> column_major(static_cast<size_t>(rows * kb));
  cpu::QuantizeActivations(v.data(), rows, k, stride, ue8m0, ref.q.data(), column_major.data());
  ref.s.resize(column_major.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < kb; ++b) {
      ref.s[ActScaleIndex(r, b, rows, kb, layout)] = column_major[b * rows + r];
    }
  }
  return ref;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// The kernel's xq / xs (downloaded from guarded buffers) equal `ref` bit for bit.
void ExpectSameBits(GuardedBuffer<uint8_t>& xq, GuardedBuffer<float>& xs, const Quantized& ref,
                    int64_t k, const std::string& what) {
  ASSERT_TRUE(xq.GuardsIntact()) << what << ": xq written out of bounds";
  ASSERT_TRUE(xs.GuardsIntact()) << what << ": xs written out of bounds";
  const std::vector<uint8_t> q = xq.Download();
  const std::vector<float> s = xs.Download();
  for (size_t i = 0; i < ref.q.size(); ++i) {
    ASSERT_EQ(q[i], ref.q[i]) << what << ": e4m3 byte of row " << i / k << " column " << i % k
                              << " (reference " << cpu::E4m3Value(ref.q[i]) << ")";
  }
  for (size_t i = 0; i < ref.s.size(); ++i) {
    ASSERT_EQ(Bits(s[i]), Bits(ref.s[i]))
        << what << ": scale " << i << " = " << s[i] << ", reference " << ref.s[i];
  }
}

std::string Label(int64_t rows, int64_t k, bool ue8m0, ActScaleLayout layout) {
  return "rows=" + std::to_string(rows) + " k=" + std::to_string(k) + (ue8m0 ? " ue8m0" : "") +
         (layout == ActScaleLayout::kGemmSplit ? " split" : "");
}

struct Shape {
  int64_t rows;
  int64_t k;
};
const Shape kShapes[] = {{1, 128},   {3, 256},  {5, 128},    {6, 384},
                         {33, 1024}, {77, 512}, {130, 2048}, {257, 128}};

class CudaActQuantTest : public ::testing::TestWithParam<ActQuantVariant> {};

TEST_P(CudaActQuantTest, Bf16MatchesCpuBitForBit) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  for (const Shape& shape : kShapes) {
    for (bool ue8m0 : {false, true}) {
      for (ActScaleLayout layout : {ActScaleLayout::kColumnMajor, ActScaleLayout::kGemmSplit}) {
        const int64_t stride = shape.k + 8 * (shape.rows % 3);
        const std::vector<uint16_t> bits = Bf16Bits(ExtremeRows(rng, shape.rows, shape.k, stride));
        GuardedBuffer<uint16_t> x(bits.size());
        x.Upload(bits);
        GuardedBuffer<uint8_t> xq(static_cast<size_t>(shape.rows * shape.k));
        GuardedBuffer<float> xs(static_cast<size_t>(shape.rows * shape.k / kActQuantBlock));
        PDSERVE_CUDA_OK(act_quant(reinterpret_cast<const __nv_bfloat16*>(x.get()), shape.rows,
                                  shape.k, stride, ue8m0, xq.get(), xs.get(), layout, GetParam(),
                                  nullptr));
        PDSERVE_CUDA_OK(cudaDeviceSynchronize());
        std::vector<float> values(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) values[i] = FromBf16(bits[i]);
        const Quantized ref = Reference(values, shape.rows, shape.k, stride, ue8m0, layout);
        ExpectSameBits(xq, xs, ref, shape.k, Label(shape.rows, shape.k, ue8m0, layout));
      }
    }
  }
}

TEST_P(CudaActQuantTest, ZeroRowsWriteNothingAndBadArgumentsAreRefused) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(4 * 264);
  GuardedBuffer<uint8_t> xq(4 * 256);
  GuardedBuffer<float> xs(8);
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x.get());
  const ActQuantVariant v = GetParam();
  const ActScaleLayout cm = ActScaleLayout::kColumnMajor;
  EXPECT_EQ(act_quant(xb, 0, 256, 256, false, xq.get(), xs.get(), cm, v, nullptr), cudaSuccess);
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(xq.GuardsIntact());
  for (const uint8_t byte : xq.Download()) ASSERT_EQ(byte, GuardedBuffer<uint8_t>::kPattern);
  EXPECT_EQ(act_quant(xb, 4, 200, 264, false, xq.get(), xs.get(), cm, v, nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(TakeLaunchRefusal().find("k % kActQuantBlock == 0"), std::string::npos);
  EXPECT_EQ(act_quant(xb, 4, 256, 128, false, xq.get(), xs.get(), cm, v, nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(TakeLaunchRefusal().find("x_stride >= k"), std::string::npos);
  EXPECT_EQ(act_quant(xb, -1, 256, 256, false, xq.get(), xs.get(), cm, v, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(act_quant(xb, 4, 256, 256, false, nullptr, xs.get(), cm, v, nullptr),
            cudaErrorInvalidValue);
  // x one bf16 past a 16-byte boundary: the vectorized kernel refuses it, the warp kernel
  // refuses anything not 8-byte aligned.
  EXPECT_EQ(act_quant(xb + 1, 2, 256, 264, false, xq.get(), xs.get(), cm, v, nullptr),
            cudaErrorInvalidValue);
  EXPECT_FALSE(TakeLaunchRefusal().empty());
  if (v == ActQuantVariant::kHalfWarpVectorized) {
    EXPECT_EQ(act_quant(xb, 2, 256, 260, false, xq.get(), xs.get(), cm, v, nullptr),
              cudaErrorInvalidValue);
    EXPECT_NE(TakeLaunchRefusal().find("x_stride % 8 == 0"), std::string::npos);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaActQuantTest,
                         ::testing::Values(ActQuantVariant::kWarpPerBlock,
                                           ActQuantVariant::kHalfWarpVectorized),
                         [](const auto& param_info) {
                           return param_info.param == ActQuantVariant::kWarpPerBlock ? "Warp"
                                                                                     : "Vectorized";
                         });

TEST(CudaActQuantF32Test, CastAndQuantizeMatchCpuBitForBit) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  for (const Shape& shape : kShapes) {
    for (bool ue8m0 : {false, true}) {
      for (ActScaleLayout layout : {ActScaleLayout::kColumnMajor, ActScaleLayout::kGemmSplit}) {
        const int64_t stride = shape.k + 4 * (shape.rows % 3);
        const int64_t y_stride = shape.k + 8;
        const std::vector<float> host = ExtremeRows(rng, shape.rows, shape.k, stride);
        GuardedBuffer<float> x(host.size());
        x.Upload(host);
        GuardedBuffer<uint16_t> y(static_cast<size_t>(shape.rows * y_stride));
        GuardedBuffer<uint8_t> xq(static_cast<size_t>(shape.rows * shape.k));
        GuardedBuffer<float> xs(static_cast<size_t>(shape.rows * shape.k / kActQuantBlock));
        const bool with_copy = shape.rows % 2 == 1;  // the bf16 copy is optional
        PDSERVE_CUDA_OK(
            act_quant_f32(x.get(), shape.rows, shape.k, stride, ue8m0,
                          with_copy ? reinterpret_cast<__nv_bfloat16*>(y.get()) : nullptr, y_stride,
                          xq.get(), xs.get(), layout, nullptr));
        PDSERVE_CUDA_OK(cudaDeviceSynchronize());
        const std::string what = "f32 " + Label(shape.rows, shape.k, ue8m0, layout);
        std::vector<float> values(host.size());
        for (size_t i = 0; i < host.size(); ++i) values[i] = FromBf16(ToBf16(host[i]));
        ExpectSameBits(xq, xs, Reference(values, shape.rows, shape.k, stride, ue8m0, layout),
                       shape.k, what);
        ASSERT_TRUE(y.GuardsIntact()) << what;
        const std::vector<uint16_t> got = y.Download();
        for (int64_t r = 0; r < shape.rows; ++r) {
          for (int64_t c = 0; c < y_stride; ++c) {
            const uint16_t bits = got[r * y_stride + c];
            if (!with_copy || c >= shape.k) {
              ASSERT_EQ(bits, 0xA5A5) << what << ": y row " << r << " column " << c << " written";
            } else if (std::isnan(host[r * stride + c])) {
              ASSERT_TRUE(std::isnan(FromBf16(bits))) << what << ": y row " << r << " col " << c;
            } else {
              ASSERT_EQ(bits, ToBf16(host[r * stride + c]))
                  << what << ": y row " << r << " col " << c;
            }
          }
        }
      }
    }
  }
}

// group_cols: each group of columns quantized as its own matrix at its own (256-byte aligned)
// offsets, as o_a's per-group GEMMs read them.
TEST(CudaActQuantF32Test, ColumnGroupsAreQuantizedAsTheirOwnMatrices) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  for (const Shape& shape : {Shape{5, 512}, Shape{77, 1024}, Shape{64, 256}}) {
    for (int64_t groups : {int64_t{2}, shape.k / kActQuantBlock}) {
      const int64_t cols = shape.k / groups;
      const int64_t stride = shape.k + 4;
      const ActScaleLayout layout = ActScaleLayout::kGemmSplit;
      const std::vector<float> host = ExtremeRows(rng, shape.rows, shape.k, stride);
      GuardedBuffer<float> x(host.size());
      x.Upload(host);
      const int64_t group_bytes = ActGroupBytes(shape.rows, cols);
      const int64_t group_scales = ActGroupScales(shape.rows, cols);
      GuardedBuffer<uint8_t> xq(static_cast<size_t>(groups * group_bytes));
      GuardedBuffer<float> xs(static_cast<size_t>(groups * group_scales));
      PDSERVE_CUDA_OK(act_quant_f32(x.get(), shape.rows, shape.k, stride, false, nullptr, 0,
                                    xq.get(), xs.get(), layout, nullptr, cols));
      PDSERVE_CUDA_OK(cudaDeviceSynchronize());
      const std::string what =
          "groups of " + std::to_string(cols) + " " + Label(shape.rows, shape.k, false, layout);
      ASSERT_TRUE(xq.GuardsIntact()) << what;
      ASSERT_TRUE(xs.GuardsIntact()) << what;
      const std::vector<uint8_t> q = xq.Download();
      const std::vector<float> s = xs.Download();
      std::vector<float> values(host.size());
      for (size_t i = 0; i < host.size(); ++i) values[i] = FromBf16(ToBf16(host[i]));
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<float> part(static_cast<size_t>(shape.rows * cols));
        for (int64_t r = 0; r < shape.rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) part[r * cols + c] = values[r * stride + g * cols + c];
        }
        const Quantized ref = Reference(part, shape.rows, cols, cols, false, layout);
        for (size_t i = 0; i < ref.q.size(); ++i) {
          ASSERT_EQ(q[g * group_bytes + i], ref.q[i]) << what << ": group " << g << " byte " << i;
        }
        for (size_t i = 0; i < ref.s.size(); ++i) {
          ASSERT_EQ(Bits(s[g * group_scales + i]), Bits(ref.s[i]))
              << what << ": group " << g << " scale " << i;
        }
      }
    }
  }
}

// Against the GPU's own clamped_swiglu (fp32) then bf16 rounding and QuantizeActivations on the
// host: the fused kernel must give the same bits as the two kernels it replaces (the SwiGLU itself
// is checked against the CPU in activations_test.cc).
TEST(CudaSwiGluActQuantTest, EqualsSwiGluThenCastThenActQuant) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  const float limit = 7.0f;
  for (const Shape& shape : kShapes) {
    for (bool ue8m0 : {false, true}) {
      const ActScaleLayout layout =
          ue8m0 ? ActScaleLayout::kGemmSplit : ActScaleLayout::kColumnMajor;
      const int64_t cols = shape.k;
      const int64_t in_stride = 2 * cols + 4;  // [gate | up | pad]
      std::vector<float> host = ExtremeRows(rng, shape.rows, in_stride, in_stride);
      if (shape.rows > 5) host[5 * in_stride + cols + 3] = 100.0f;  // up clamped to the limit
      GuardedBuffer<float> in(host.size());
      in.Upload(host);
      GuardedBuffer<uint8_t> xq(static_cast<size_t>(shape.rows * cols));
      GuardedBuffer<float> xs(static_cast<size_t>(shape.rows * cols / kActQuantBlock));
      GuardedBuffer<uint16_t> y(static_cast<size_t>(shape.rows * cols));
      PDSERVE_CUDA_OK(clamped_swiglu_act_quant(
          in.get(), in.get() + cols, shape.rows, cols, in_stride, limit, ue8m0,
          reinterpret_cast<__nv_bfloat16*>(y.get()), cols, xq.get(), xs.get(), layout, nullptr));
      GuardedBuffer<float> act(static_cast<size_t>(shape.rows * cols));
      PDSERVE_CUDA_OK(clamped_swiglu(in.get(), in.get() + cols, shape.rows, cols, in_stride, limit,
                                     act.get(), cols, nullptr));
      PDSERVE_CUDA_OK(cudaDeviceSynchronize());
      std::vector<float> values = act.Download();
      for (float& v : values) v = FromBf16(ToBf16(v));
      const std::string what = "swiglu " + Label(shape.rows, cols, ue8m0, layout);
      ExpectSameBits(xq, xs, Reference(values, shape.rows, cols, cols, ue8m0, layout), cols, what);
      const std::vector<uint16_t> got = y.Download();
      for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(values[i])) {
          ASSERT_TRUE(std::isnan(FromBf16(got[i]))) << what << ": y " << i;
        } else {
          ASSERT_EQ(got[i], ToBf16(values[i])) << what << ": y " << i;
        }
      }
    }
  }
}

TEST(CudaActQuantF32Test, FusedProducersRefuseBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> x(4 * 512);
  GuardedBuffer<uint8_t> xq(4 * 256);
  GuardedBuffer<float> xs(8);
  const ActScaleLayout cm = ActScaleLayout::kColumnMajor;
  EXPECT_EQ(act_quant_f32(x.get(), 4, 192, 256, false, nullptr, 0, xq.get(), xs.get(), cm, nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(TakeLaunchRefusal().find("k % kActQuantBlock == 0"), std::string::npos);
  EXPECT_EQ(
      act_quant_f32(x.get() + 1, 2, 256, 260, false, nullptr, 0, xq.get(), xs.get(), cm, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(act_quant_f32(x.get(), 2, 256, 256, false, reinterpret_cast<__nv_bfloat16*>(xq.get()),
                          100, xq.get(), xs.get(), cm, nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(TakeLaunchRefusal().find("y_stride >= k"), std::string::npos);
  EXPECT_EQ(clamped_swiglu_act_quant(x.get(), x.get() + 256, 2, 256, 510, 7.0f, false, nullptr, 0,
                                     xq.get(), xs.get(), cm, nullptr),
            cudaErrorInvalidValue);
  EXPECT_NE(TakeLaunchRefusal().find("in_stride % 4 == 0"), std::string::npos);
}

// fp8_gemm_quantized on act_quant's output (kGemmSplit, vectorized kernel) against
// fp8_gemm_cublaslt on the bf16 activations (its own act quant: the vectorized kernel, the warp
// kernel with PDSERVE_ACT_QUANT=warp): the same bits where fp8_gemm_quantized takes cuBLASLt
// (m >= kFp8LtMinTokens, n a multiple of 128; m % 4 of 0 and not), and every case against
// Fp8GemmReference (m of 5 and 13: fp8_gemm_mma over both parts).
TEST(CudaFp8GemmQuantizedTest, EqualsFp8GemmOnTheCublasLtPathAndMatchesReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  struct Case {
    int64_t m, n, k;
  };
  for (const Case& c : {Case{64, 256, 512}, Case{77, 128, 256}, Case{130, 384, 384},
                        Case{5, 256, 256}, Case{13, 128, 1024}}) {
    const std::string what =
        "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k);
    const std::vector<uint16_t> x = testing::RandomActivations(rng, c.m, c.k);
    const std::vector<uint8_t> w = testing::RandomE4m3(rng, static_cast<size_t>(c.n * c.k));
    const std::vector<float> w_scale =
        testing::RandomScales(rng, static_cast<size_t>(((c.n + 127) / 128) * (c.k / 128)));
    GuardedBuffer<uint16_t> dx(x.size());
    GuardedBuffer<uint8_t> dw(w.size());
    GuardedBuffer<float> dws(w_scale.size());
    dx.Upload(x);
    dw.Upload(w);
    dws.Upload(w_scale);
    GuardedBuffer<uint8_t> xq(static_cast<size_t>(c.m * c.k));
    GuardedBuffer<float> xs(static_cast<size_t>(c.m * c.k / 128));
    const auto* xb = reinterpret_cast<const __nv_bfloat16*>(dx.get());
    PDSERVE_CUDA_OK(act_quant(xb, c.m, c.k, c.k, false, xq.get(), xs.get(),
                              ActScaleLayout::kGemmSplit, ActQuantVariant::kHalfWarpVectorized,
                              nullptr));
    const size_t ws_bytes = std::max(fp8_gemm_quantized_workspace_bytes(c.m, c.n, c.k),
                                     fp8_gemm_cublaslt_workspace_bytes(c.m, c.n, c.k));
    GuardedBuffer<uint8_t> ws(ws_bytes + 256);
    void* ws_ptr =
        reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.get()) + 255) & ~uintptr_t{255});
    GuardedBuffer<float> got(static_cast<size_t>(c.m * c.n));
    GuardedBuffer<float> plain(static_cast<size_t>(c.m * c.n));
    std::string refusal;
    PDSERVE_CUDA_OK(fp8_gemm_quantized(xq.get(), xs.get(), c.m, c.k, dw.get(), dws.get(), c.n,
                                       got.get(), c.n, ws_ptr, ws_bytes, nullptr, &refusal));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    const bool lt_path = fp8_gemm_path(c.m) == Fp8GemmPath::kCublasLt && c.n % 128 == 0;
    bool lt_ran = false;
    if (lt_path) {
      const cudaError_t status =
          fp8_gemm_cublaslt(lt, xb, c.m, c.k, c.k, dw.get(), dws.get(), c.n, false, plain.get(),
                            c.n, ws_ptr, ws_bytes, nullptr, &refusal);
      // No fp32-output algorithm: fp8_gemm_quantized took fp8_gemm_mma instead, other bits.
      lt_ran = status == cudaSuccess;
      if (!lt_ran)
        std::printf("%s: cuBLASLt refused (%s): no bit comparison\n", what.c_str(),
                    refusal.c_str());
      (void)cudaGetLastError();
    }
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(got.GuardsIntact()) << what;
    const std::vector<float> g = got.Download();
    if (lt_ran) {
      const std::vector<float> p = plain.Download();
      for (size_t i = 0; i < g.size(); ++i) {
        ASSERT_EQ(Bits(g[i]), Bits(p[i]))
            << what << ": element " << i << " " << g[i] << " vs " << p[i];
      }
    }
    std::vector<float> ref(static_cast<size_t>(c.m * c.n));
    const std::vector<float> xf = testing::ToFloatsBf16(x);
    cpu::Fp8GemmReference(xf.data(), c.m, c.k, c.k, w.data(), w_scale.data(), c.n, false,
                          ref.data());
    testing::ExpectNear(testing::Widen(g), testing::Widen(ref), 5e-4, what);
  }
  cublasLtDestroy(lt);
}

TEST(CudaFp8GemmQuantizedTest, RefusesMisalignedScalesAndASmallWorkspace) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint8_t> xq(64 * 256);
  GuardedBuffer<float> xs(64 * 2 + 4);
  GuardedBuffer<uint8_t> w(128 * 256);
  GuardedBuffer<float> ws_scale(2);
  GuardedBuffer<float> out(64 * 128);
  const size_t ws_bytes = fp8_gemm_quantized_workspace_bytes(64, 128, 256);
  ASSERT_GT(ws_bytes, 0u);
  GuardedBuffer<uint8_t> ws(ws_bytes + 256);
  void* ws_ptr =
      reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(ws.get()) + 255) & ~uintptr_t{255});
  std::string refusal;
  EXPECT_EQ(fp8_gemm_quantized(xq.get(), xs.get() + 1, 64, 256, w.get(), ws_scale.get(), 128,
                               out.get(), 128, ws_ptr, ws_bytes, nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_NE(refusal.find("xs"), std::string::npos) << refusal;
  EXPECT_EQ(fp8_gemm_quantized(xq.get(), xs.get(), 64, 256, w.get(), ws_scale.get(), 128, out.get(),
                               128, ws_ptr, ws_bytes - 1, nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_NE(refusal.find("workspace_bytes"), std::string::npos) << refusal;
  EXPECT_EQ(fp8_gemm_quantized(xq.get(), xs.get(), 64, 200, w.get(), ws_scale.get(), 128, out.get(),
                               128, ws_ptr, ws_bytes, nullptr, &refusal),
            cudaErrorInvalidValue);
  EXPECT_NE(refusal.find("k:"), std::string::npos) << refusal;
  EXPECT_TRUE(out.GuardsIntact());
}

}  // namespace
}  // namespace pdserve::kernels::cuda
