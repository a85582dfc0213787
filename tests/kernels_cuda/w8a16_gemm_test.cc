// W8A16 (FP8 weights, bf16 activations): kernels/cuda fp8_gemm_w8a16 and moe_grouped_gemm with
// ExpertFormat::kFp8W8A16, against kernels/cpu/fp8_gemm.h's W8a16GemmReference /
// MoeGemmReference (bf16_activations): fresh random e4m3 weights, fp32 block scales, bf16
// activations and routings each run (seed printed; PDSERVE_TEST_SEED replays), the kernel before
// the reference. Besides the whole-output normalized error (ExpectBf16Rows), every row is compared
// against its own magnitude: W8A16 has no activation rounding, so a row of 2^-20 values must be as
// exact as a row of 2^20 ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/fp8_gemm.h"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "tests/kernels_cuda/block_scaled_test_util.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::CheckMaxRegisters;
using testing::FreshRng;
using testing::GuardedBuffer;

constexpr uint16_t kSentinel = 0xA5A5;  // GuardedBuffer's fill, as bf16 bits

// Per row r of [rows, n] with check[r]: finite entries within 2^-7 of the row's largest finite
// reference magnitude (one bf16 rounding is 2^-9; the rest is fp32 summation order), non-finite
// ones equal in class (NaN, +Inf, -Inf).
void ExpectRowsClose(const std::vector<uint16_t>& got, int64_t rows, int64_t n, int64_t stride,
                     const std::vector<float>& want, const std::vector<bool>& check,
                     const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!check.empty() && !check[r]) continue;
    double row_max = 0.0;
    for (int64_t c = 0; c < n; ++c) {
      const float w = want[r * n + c];
      if (std::isfinite(w)) row_max = std::max(row_max, std::fabs(double{w}));
    }
    int bad = 0;
    for (int64_t c = 0; c < n && bad < 3; ++c) {
      const float g = testing::FromBf16(got[r * stride + c]);
      const float w = want[r * n + c];
      const bool ok = std::isnan(w)   ? std::isnan(g)
                      : std::isinf(w) ? g == w
                                      : std::isfinite(g) &&
                                            std::fabs(double{g} - w) <= 0x1p-7 * row_max + 1e-38;
      if (!ok) {
        ++bad;
        ADD_FAILURE() << what << ": row " << r << " column " << c << " got " << g << " want " << w
                      << " (row max " << row_max << ")";
      }
    }
  }
}

struct DenseCase {
  int64_t m = 1;
  int64_t n = 64;
  int64_t k = 128;
  int64_t x_stride = 128;
  int64_t out_stride = 64;
  std::vector<uint16_t> x;
  std::vector<uint8_t> w;
  std::vector<float> w_scale;
};

DenseCase MakeDense(std::mt19937_64& rng, int64_t m, int64_t n, int64_t k) {
  DenseCase c;
  c.m = m;
  c.n = n;
  c.k = k;
  c.x_stride = k + 8 * (m % 3);  // padded rows for some sizes
  c.out_stride = n + (m % 2 == 1 ? 5 : 0);
  c.x = testing::RandomActivations(rng, m, c.x_stride);
  c.w = testing::RandomE4m3(rng, static_cast<size_t>(n * k));
  c.w_scale = testing::RandomScales(rng, static_cast<size_t>(((n + 127) / 128) * (k / 128)));
  return c;
}

// Weight blocks scaled by 2^-20 and 2^20; activation rows 0 and 1 times 2^-20 and 2^20.
DenseCase ExtremeScales(std::mt19937_64& rng) {
  DenseCase c = MakeDense(rng, 9, 256, 512);
  testing::MakeScalesExtreme(c);
  return c;
}

// kDispatch: fp8_gemm_w8a16 (its path by token count); kMma / kWgmma: that path explicitly.
enum class Path { kDispatch, kMma, kWgmma };

// Returns the output bits (empty when the launch failed).
std::vector<uint16_t> RunAndCheckDense(const DenseCase& c, Path path = Path::kDispatch,
                                       const Fp8WgmmaConfig& config = {}) {
  const char* name = path == Path::kDispatch ? "fp8_gemm_w8a16"
                     : path == Path::kMma    ? "fp8_gemm_w8a16_mma"
                                             : "fp8_gemm_w8a16_wgmma";
  const std::string what =
      std::string(name) + " m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
      " k=" + std::to_string(c.k) +
      (path == Path::kWgmma ? testing::WgmmaConfigLabel(config) : std::string());
  GuardedBuffer<uint16_t> x(c.x.size());
  GuardedBuffer<uint8_t> w(c.w.size());
  GuardedBuffer<float> w_scale(c.w_scale.size());
  GuardedBuffer<uint16_t> out(static_cast<size_t>(c.m * c.out_stride));
  // At least one byte, so the buffer has guards even when no split-k workspace is needed.
  const size_t ws_bytes = path == Path::kWgmma
                              ? fp8_gemm_w8a16_wgmma_workspace_bytes(c.m, c.n, c.k, config)
                              : fp8_gemm_w8a16_workspace_bytes(c.m, c.n, c.k);
  GuardedBuffer<uint8_t> ws(std::max<size_t>(256, ws_bytes));
  EXPECT_TRUE(ws.ok() && out.ok()) << what;
  if (!ws.ok() || !out.ok()) return {};
  EXPECT_LE(fp8_gemm_w8a16_workspace_bytes(c.m, c.n, c.k), fp8_gemm_workspace_bytes(c.m, c.n, c.k));
  x.Upload(c.x);
  w.Upload(c.w);
  w_scale.Upload(c.w_scale);
  std::string refusal;
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.get());
  auto* op = reinterpret_cast<__nv_bfloat16*>(out.get());
  const cudaError_t status =
      path == Path::kDispatch
          ? fp8_gemm_w8a16(xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, op, c.out_stride,
                           ws.get(), ws.size(), nullptr, &refusal)
      : path == Path::kMma
          ? fp8_gemm_w8a16_mma(xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, op,
                               c.out_stride, ws.get(), ws.size(), nullptr, &refusal)
          : fp8_gemm_w8a16_wgmma(xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, op,
                                 c.out_stride, ws.get(), ws.size(), nullptr, config, &refusal);
  EXPECT_EQ(status, cudaSuccess) << what << ": " << refusal;
  if (status != cudaSuccess) return {};
  const cudaError_t sync = cudaDeviceSynchronize();
  EXPECT_EQ(sync, cudaSuccess) << what << ": " << cudaGetErrorString(sync);
  if (sync != cudaSuccess) return {};
  const std::vector<uint16_t> got = out.Download();
  EXPECT_TRUE(out.GuardsIntact()) << what;
  EXPECT_TRUE(ws.GuardsIntact()) << what;

  std::vector<float> want(static_cast<size_t>(c.m * c.n));
  const std::vector<float> xf = testing::ToFloatsBf16(c.x);
  cpu::W8a16GemmReference(xf.data(), c.m, c.k, c.x_stride, c.w.data(), c.w_scale.data(), c.n,
                          want.data());
  testing::ExpectBf16Rows(got, c.m, c.n, c.out_stride, want, {}, kSentinel, what);
  ExpectRowsClose(got, c.m, c.n, c.out_stride, want, {}, what);
  return got;
}

TEST(CudaW8a16GemmTest, OddTokenCountsAndShapes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // n = 200 and 72: partial 64-row tiles and a partial 128-row scale block; k = 1024 with small n
  // splits k over blocks (reduced in the kernel at 9-16 tokens, a16_cluster_reduce_tokens, by
  // the reduction kernel at 17 and 33), n = 2048 does not. m up to 130: 1, 2 and 4 tiles of 8
  // tokens, several token chunks.
  for (int64_t m : {1, 2, 3, 8, 9, 13, 16, 17, 33, 77, 130}) {
    RunAndCheckDense(MakeDense(rng, m, 200, 384));
    RunAndCheckDense(MakeDense(rng, m, 72, 1024));
  }
  RunAndCheckDense(MakeDense(rng, 5, 2048, 256));
  RunAndCheckDense(MakeDense(rng, 64, 2048, 256));
}

// One weight byte at a time: exactly one nonzero weight (value 1) at row `row`, column `col`, and
// x = identity-like rows, so any swapped k or row position in the fragment layout shows as a wrong
// column or a wrong value.
TEST(CudaW8a16GemmTest, EveryKPositionLandsOnItsOwnProduct) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  DenseCase c = MakeDense(rng, 8, 16, 128);
  // Weight row n: e4m3 of (n + 1) at column (n * 9) % 128, zero elsewhere; x row r: bf16 of
  // (column + 1) * 2^r at every column. out[r, n] = (n + 1) * (col_n + 1) * 2^r, exact in bf16
  // only where it has <= 8 significant bits: checked against the reference all the same.
  std::fill(c.w.begin(), c.w.end(), 0);
  for (int64_t n = 0; n < c.n; ++n) c.w[n * c.k + (n * 9) % 128] = cpu::E4m3FromFloat(n + 1.0f);
  std::fill(c.w_scale.begin(), c.w_scale.end(), 1.0f);
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.x_stride; ++col) {
      c.x[r * c.x_stride + col] =
          testing::ToBf16(std::ldexp(col % 128 + 1.0f, static_cast<int>(r)));
    }
  }
  for (const Path path : {Path::kMma, Path::kWgmma}) {
    RunAndCheckDense(c, path);
    // All 128 k positions of every row: weights of a single nonzero column each, swept.
    for (int64_t col = 0; col < 128; col += 1) {
      DenseCase d = c;
      std::fill(d.w.begin(), d.w.end(), 0);
      for (int64_t n = 0; n < d.n; ++n) d.w[n * d.k + col] = cpu::E4m3FromFloat(n + 1.0f);
      if (col % 16 == 0 || col % 16 == 7 || col % 16 == 13 || path == Path::kWgmma) {
        RunAndCheckDense(d, path);
      }
    }
  }
}

TEST(CudaW8a16GemmTest, ExtremeScalesAndMagnitudes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const DenseCase c = ExtremeScales(rng);
  RunAndCheckDense(c);
  // Every e4m3 code (subnormals, +-448) in the weights, scale 1.
  DenseCase e = MakeDense(rng, 3, 64, 256);
  for (size_t i = 0; i < e.w.size(); ++i) {
    e.w[i] = static_cast<uint8_t>(i % 256);
    if ((e.w[i] & 0x7F) == 0x7F) e.w[i] = 0x7E;
  }
  std::fill(e.w_scale.begin(), e.w_scale.end(), 1.0f);
  RunAndCheckDense(e);
}

TEST(CudaW8a16GemmTest, NanAndInfPropagateToTheSamePositions) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  DenseCase c = MakeDense(rng, 11, 136, 384);
  c.x[2 * c.x_stride + 5] = testing::kBf16NaN;      // row 2 all NaN
  c.x[6 * c.x_stride + 200] = 0x7F80;               // +Inf: row 6 +-Inf (or NaN where w = 0)
  c.x[9 * c.x_stride + 383] = 0xFF80;               // -Inf
  c.w[static_cast<size_t>(17 * c.k + 130)] = 0x7F;  // NaN weight: column 17 all NaN
  c.w[static_cast<size_t>(135 * c.k + 0)] = 0xFF;   // column 135
  RunAndCheckDense(c);
}

// fp8_gemm_w8a16_wgmma: every token tile (N = 8..128) and odd token counts, k = 384 (fewer k
// blocks than stages), without and with a k split; tile and ring variants at k = 1280; token tiles
// past 128; extreme scales and non-finite inputs; the mma.sync path on its own.
TEST(CudaW8a16GemmTest, WgmmaTilesSplitsAndConfigs) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig whole{2, 4, 0};
  const Fp8WgmmaConfig split{2, 4, 4096};
  std::vector<int64_t> counts = {1, 3, 17, 100, 127};
  for (int64_t m = 8; m <= 128; m += 8) counts.push_back(m);
  for (int64_t m : counts) {
    const DenseCase c = MakeDense(rng, m, 200, 384);
    RunAndCheckDense(c, Path::kWgmma, whole);
    RunAndCheckDense(c, Path::kWgmma, split);
  }
  for (const Fp8WgmmaConfig config : {Fp8WgmmaConfig{1, 2, 0}, Fp8WgmmaConfig{1, 3, 264},
                                      Fp8WgmmaConfig{2, 6, 132}, Fp8WgmmaConfig{2, 8, 528}}) {
    for (int64_t m : {5, 64, 130}) {
      RunAndCheckDense(MakeDense(rng, m, 136, 1280), Path::kWgmma, config);
    }
  }
  for (int64_t m : {1, 13, 77}) RunAndCheckDense(MakeDense(rng, m, 200, 384), Path::kMma);
}

// Non-finite inputs as NanAndInfPropagateToTheSamePositions has them, on a wgmma config.
DenseCase NonFiniteDense(std::mt19937_64& rng) {
  DenseCase d = MakeDense(rng, 11, 136, 384);
  d.x[2 * d.x_stride + 5] = testing::kBf16NaN;
  d.x[6 * d.x_stride + 200] = 0x7F80;
  d.x[9 * d.x_stride + 383] = 0xFF80;
  d.w[static_cast<size_t>(17 * d.k + 130)] = 0x7F;
  d.w[static_cast<size_t>(135 * d.k + 0)] = 0xFF;
  return d;
}

TEST(CudaW8a16GemmTest, WgmmaExtremeScalesAndNonFinite) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const DenseCase c = ExtremeScales(rng);
  const DenseCase d = NonFiniteDense(rng);
  for (const Fp8WgmmaConfig config : {Fp8WgmmaConfig{2, 4, 0}, Fp8WgmmaConfig{1, 4, 264}}) {
    RunAndCheckDense(c, Path::kWgmma, config);
    RunAndCheckDense(d, Path::kWgmma, config);
  }
}

TEST(CudaW8a16GemmTest, RefusalsNameTheArgument) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(4096);
  GuardedBuffer<uint8_t> w(4096);
  GuardedBuffer<float> s(16);
  GuardedBuffer<uint16_t> out(4096);
  GuardedBuffer<uint8_t> ws(1 << 20);
  const auto refusal_of = [&](int64_t m, int64_t k, int64_t x_stride, const uint8_t* wp, int64_t n,
                              size_t ws_bytes) {
    std::string refusal;
    const cudaError_t status = fp8_gemm_w8a16(
        reinterpret_cast<const __nv_bfloat16*>(x.get()), m, k, x_stride, wp, s.get(), n,
        reinterpret_cast<__nv_bfloat16*>(out.get()), n, ws.get(), ws_bytes, nullptr, &refusal);
    EXPECT_EQ(status, cudaErrorInvalidValue);
    return refusal;
  };
  const size_t all = ws.size();
  EXPECT_NE(refusal_of(2, 100, 128, w.get(), 16, all).find("k:"), std::string::npos);
  EXPECT_NE(refusal_of(2, 128, 120, w.get(), 16, all).find("x_stride:"), std::string::npos);
  EXPECT_NE(refusal_of(-1, 128, 128, w.get(), 16, all).find("m:"), std::string::npos);
  EXPECT_NE(refusal_of(2, 128, 128, nullptr, 16, all).find("w:"), std::string::npos);
  // k = 1024, n = 2, 24 tokens (the wgmma path, a 24-token tile): split k and reduced by the
  // second kernel, so the partial sums need a workspace. (Tiles up to
  // kFp8WgmmaDecodeConfig.a16_cluster_reduce_tokens reduce in the kernel and need none.)
  EXPECT_NE(refusal_of(24, 1024, 1024, w.get(), 2, 8).find("workspace_bytes:"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Grouped routed experts.

struct MoeCase {
  int64_t n_experts = 16;
  int64_t n = 192;
  int64_t k = 512;
  int64_t tokens = 1;
  int64_t top_k = 6;
  bool x_per_pick = false;
  bool weighted = false;
  int64_t x_stride = 512;
  int64_t out_stride = 195;
  std::vector<uint16_t> x;
  std::vector<int32_t> experts;
  std::vector<float> pick_weights;
  std::vector<uint8_t> w;
  std::vector<float> scale;
};

// Distinct experts per token drawn from the first `used` experts (the rest get no tokens).
MoeCase MakeMoe(std::mt19937_64& rng, int64_t tokens, int64_t top_k, int64_t used, bool x_per_pick,
                bool weighted) {
  MoeCase c;
  c.tokens = tokens;
  c.top_k = top_k;
  c.x_per_pick = x_per_pick;
  c.weighted = weighted;
  c.x_stride = c.k + 8 * (tokens % 2);
  const int64_t rows = x_per_pick ? tokens * top_k : tokens;
  c.x = testing::RandomActivations(rng, rows, c.x_stride);
  std::vector<int32_t> order(static_cast<size_t>(used));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    c.experts.insert(c.experts.end(), order.begin(), order.begin() + top_k);
  }
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  if (weighted) {
    c.pick_weights.resize(c.experts.size());
    for (float& v : c.pick_weights) v = unit(rng);
  }
  c.w = testing::RandomE4m3(rng, static_cast<size_t>(c.n_experts * c.n * c.k));
  c.scale = testing::RandomScales(
      rng, static_cast<size_t>(c.n_experts * ((c.n + 127) / 128) * (c.k / 128)));
  return c;
}

void RunAndCheckMoe(const MoeCase& c, const std::string& what) {
  const int64_t picks = c.tokens * c.top_k;
  GuardedBuffer<uint16_t> x(c.x.size());
  GuardedBuffer<int32_t> experts(c.experts.size());
  GuardedBuffer<float> pick_weights(std::max<size_t>(1, c.pick_weights.size()));
  GuardedBuffer<uint8_t> w(c.w.size());
  GuardedBuffer<float> scale(c.scale.size());
  GuardedBuffer<uint16_t> out(static_cast<size_t>(picks * c.out_stride));
  x.Upload(c.x);
  experts.Upload(c.experts);
  if (c.weighted) pick_weights.Upload(c.pick_weights);
  w.Upload(c.w);
  scale.Upload(c.scale);
  ExpertWeights ew;
  ew.format = ExpertFormat::kFp8W8A16;
  ew.w = w.get();
  ew.scale = scale.get();
  ew.n_experts = c.n_experts;
  ew.n = c.n;
  ew.k = c.k;
  const int64_t rows = c.x_per_pick ? picks : c.tokens;
  const size_t ws_bytes = moe_grouped_gemm_workspace_bytes(c.tokens, c.top_k, rows, ew);
  ExpertWeights as_fp8 = ew;
  as_fp8.format = ExpertFormat::kFp8;
  EXPECT_LE(ws_bytes, moe_grouped_gemm_workspace_bytes(c.tokens, c.top_k, rows, as_fp8)) << what;
  GuardedBuffer<uint8_t> ws(ws_bytes);
  ASSERT_TRUE(ws.ok() && out.ok() && ws.size() > 0) << what;
  std::string refusal;
  // ue8m0 true: ignored by W8A16 (the reference quantizes nothing either).
  const cudaError_t status =
      moe_grouped_gemm(reinterpret_cast<const __nv_bfloat16*>(x.get()), c.x_stride, c.x_per_pick,
                       experts.get(), c.weighted ? pick_weights.get() : nullptr, c.tokens, c.top_k,
                       ew, /*ue8m0_act_scale=*/true, reinterpret_cast<__nv_bfloat16*>(out.get()),
                       c.out_stride, ws.get(), ws.size(), nullptr, &refusal);
  ASSERT_EQ(status, cudaSuccess) << what << ": " << refusal;
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = out.Download();
  EXPECT_TRUE(out.GuardsIntact()) << what;
  EXPECT_TRUE(ws.GuardsIntact()) << what;

  std::vector<float> want(static_cast<size_t>(picks * c.n), 0.0f);
  const std::vector<float> xf = testing::ToFloatsBf16(c.x);
  cpu::ExpertWeightsRef ref;
  ref.w = c.w.data();
  ref.scale = c.scale.data();
  ref.n_experts = c.n_experts;
  ref.n = c.n;
  ref.k = c.k;
  ref.bf16_activations = true;
  cpu::MoeGemmReference(xf.data(), c.x_stride, c.x_per_pick, c.experts.data(),
                        c.weighted ? c.pick_weights.data() : nullptr, c.tokens, c.top_k, ref,
                        /*ue8m0=*/true, want.data());
  std::vector<bool> valid(static_cast<size_t>(picks));
  for (int64_t p = 0; p < picks; ++p) valid[p] = c.experts[p] >= 0 && c.experts[p] < c.n_experts;
  testing::ExpectBf16Rows(got, picks, c.n, c.out_stride, want, valid, kSentinel, what);
  ExpectRowsClose(got, picks, c.n, c.out_stride, want, valid, what);
}

TEST(CudaW8a16MoeGemmTest, OddTokenCountsZeroTokenExperts) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (int64_t tokens : {1, 2, 5, 37, 128}) {
    const std::string what = "w8a16 tokens " + std::to_string(tokens);
    // Experts 12..15 get no tokens; gate/up form (x per token) and down form (x per pick,
    // weighted).
    RunAndCheckMoe(MakeMoe(rng, tokens, 6, 12, false, false), what + " gate/up");
    RunAndCheckMoe(MakeMoe(rng, tokens, 6, 12, true, true), what + " down");
  }
}

// At kMoeSplitMaxBlocks blocks and more the grouped mma.sync path does not split k (the path
// V4-Flash's batch 1 takes, 384 blocks): 24 row tiles (n = 1536) x the 16 routed experts of 3
// tokens x top-6 (one of them an invalid id), k = 1024, gate/up and weighted down forms, against
// the reference (the other grouped cases here have at most 48 blocks and split k in two).
TEST(CudaW8a16MoeGemmTest, UnsplitAtTheBlockThreshold) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const bool down : {false, true}) {
    MoeCase c = MakeMoe(rng, 3, 6, 16, down, down);
    c.n = 1536;
    c.k = 1024;
    c.x_stride = c.k + 8;
    c.out_stride = c.n + 3;
    const int64_t rows = down ? 3 * 6 : 3;
    c.x = testing::RandomActivations(rng, rows, c.x_stride);
    c.w = testing::RandomE4m3(rng, static_cast<size_t>(c.n_experts * c.n * c.k));
    c.scale = testing::RandomScales(
        rng, static_cast<size_t>(c.n_experts * ((c.n + 127) / 128) * (c.k / 128)));
    c.experts[5] = -1;
    const moe_workspace::MmaSizes plan =
        moe_workspace::Mma(3, 6, rows, c.n_experts, c.n, c.k, true);
    ASSERT_EQ(plan.splits, 1);
    ASSERT_EQ(plan.partial_bytes, 0u);
    RunAndCheckMoe(c, down ? "unsplit down" : "unsplit gate/up");
  }
}

TEST(CudaW8a16MoeGemmTest, AllTokensOnOneExpert) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // 141 tokens, top-1, all on expert 9: several work items of one expert.
  MoeCase c = MakeMoe(rng, 141, 1, 16, false, true);
  std::fill(c.experts.begin(), c.experts.end(), 9);
  RunAndCheckMoe(c, "w8a16 one expert");
}

TEST(CudaW8a16MoeGemmTest, InvalidExpertIdsLeaveRowsUntouched) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  MoeCase c = MakeMoe(rng, 7, 3, 16, false, true);
  c.experts[0] = -1;
  c.experts[4] = 16;
  c.experts[20] = -7;
  RunAndCheckMoe(c, "w8a16 invalid ids");
}

TEST(CudaW8a16MoeGemmTest, ExtremeScalesAndMagnitudes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  MoeCase c = MakeMoe(rng, 3, 6, 16, true, false);
  for (size_t i = 0; i < c.scale.size(); ++i) c.scale[i] = std::ldexp(1.0f, i % 2 ? 20 : -20);
  for (int64_t col = 0; col < c.k; ++col) {
    c.x[0 * c.x_stride + col] = testing::ToBf16(std::ldexp(testing::FromBf16(c.x[col]), -20));
    c.x[1 * c.x_stride + col] =
        testing::ToBf16(std::ldexp(testing::FromBf16(c.x[c.x_stride + col]), 20));
  }
  RunAndCheckMoe(c, "w8a16 scales and rows 2^+-20");
}

TEST(CudaW8a16MoeGemmTest, NanAndInfMatchInPosition) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  MoeCase c = MakeMoe(rng, 5, 6, 16, false, false);
  c.x[1 * c.x_stride + 3] = testing::kBf16NaN;
  c.x[3 * c.x_stride + 300] = 0x7F80;
  c.w[static_cast<size_t>((c.experts[0] * c.n + 50) * c.k + 7)] = 0x7F;  // token 0's expert
  RunAndCheckMoe(c, "w8a16 NaN/Inf");
}

// cluster_reduce (fp8_gemm.cuh): the same bits as the two-kernel split-k reduction with the same
// splits, at partial row tiles (n = 200) and 2, 4, 8 splits (m = 130: token tiles past 64 ignore
// the flag); the split cap at k = 2560; extreme scales and NaN / Inf as the reference has them.
TEST(CudaW8a16GemmTest, WgmmaClusterReduceEqualsTwoPassBitForBit) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  struct Case {
    int wgs;
    int target;
    int64_t m;
    int32_t splits;
  };
  for (const Case& t : {Case{1, 16, 1, 4}, Case{1, 32, 9, 8}, Case{1, 16, 130, 2},
                        Case{2, 8, 40, 4}, Case{2, 16, 130, 4}}) {
    const DenseCase c = MakeDense(rng, t.m, 200, 1024);
    const Fp8WgmmaConfig two_pass{t.wgs, 4, t.target, false};
    const Fp8WgmmaConfig cluster{t.wgs, 4, t.target, true};
    ASSERT_EQ(fp8_gemm_wgmma_splits(c.m, c.n, c.k, two_pass), t.splits) << "m=" << t.m;
    ASSERT_EQ(fp8_gemm_wgmma_splits(c.m, c.n, c.k, cluster), t.splits) << "m=" << t.m;
    if (t.m <= 64) {  // token tiles past 64 ignore the flag
      EXPECT_EQ(fp8_gemm_w8a16_wgmma_workspace_bytes(c.m, c.n, c.k, cluster), 0u);
    }
    const std::vector<uint16_t> first = RunAndCheckDense(c, Path::kWgmma, two_pass);
    const std::vector<uint16_t> second = RunAndCheckDense(c, Path::kWgmma, cluster);
    ASSERT_FALSE(first.empty());
    EXPECT_EQ(first, second) << "m=" << t.m << " wgs=" << t.wgs;
  }
  const Fp8WgmmaConfig cluster{1, 4, 64, true};
  RunAndCheckDense(MakeDense(rng, 5, 200, 2560), Path::kWgmma, cluster);
  RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, cluster);
  DenseCase d = MakeDense(rng, 11, 136, 384);
  d.x[2 * d.x_stride + 5] = testing::kBf16NaN;
  d.x[6 * d.x_stride + 200] = 0x7F80;
  d.w[static_cast<size_t>(17 * d.k + 130)] = 0x7F;
  RunAndCheckDense(d, Path::kWgmma, cluster);
}

// smem_scales (and register weights): the same bits as the weight scales read per k block (token
// tiles of 8..128 and two tiles at m = 130, 10 k blocks unevenly split, with and without
// cluster_reduce).
TEST(CudaW8a16GemmTest, WgmmaSmemScalesEqualPerBlockScales) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const Fp8WgmmaConfig config :
       {Fp8WgmmaConfig{1, 4, 0, false, true}, Fp8WgmmaConfig{2, 4, 264, true, true, true}}) {
    Fp8WgmmaConfig plain = config;
    plain.smem_scales = false;
    for (int64_t m : {1, 64, 130}) {
      const DenseCase c = MakeDense(rng, m, 200, 1280);
      const std::vector<uint16_t> first = RunAndCheckDense(c, Path::kWgmma, plain);
      const std::vector<uint16_t> second = RunAndCheckDense(c, Path::kWgmma, config);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, second) << "m=" << m << " wgs=" << config.warpgroups;
    }
  }
  RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, Fp8WgmmaConfig{1, 4, 264, true, true});
}

// a16_register_weights (each thread converts its own wgmma A fragment from the e4m3 stage): every
// k position of every row of all four warps of a warpgroup (n = 72: a full 64-row tile and a
// partial one) lands on its own product; then token tiles 8..64 (and 72 and 130, where the flag is
// ignored), split and cluster-reduced, extreme scales and NaN / Inf against the reference.
TEST(CudaW8a16GemmTest, WgmmaRegisterWeights) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig reg{1, 4, 0, false, false, true};
  DenseCase c = MakeDense(rng, 5, 72, 256);
  std::fill(c.w_scale.begin(), c.w_scale.end(), 1.0f);
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.x_stride; ++col) {
      c.x[r * c.x_stride + col] =
          testing::ToBf16(std::ldexp(col % 128 + 1.0f, static_cast<int>(r)));
    }
  }
  for (int64_t col = 0; col < 256; ++col) {
    std::fill(c.w.begin(), c.w.end(), 0);
    for (int64_t n = 0; n < c.n; ++n) c.w[n * c.k + col] = cpu::E4m3FromFloat(n % 16 + 1.0f);
    RunAndCheckDense(c, Path::kWgmma, reg);
  }
  for (const Fp8WgmmaConfig config : {reg, Fp8WgmmaConfig{2, 4, 264, true, true, true},
                                      Fp8WgmmaConfig{1, 3, 4096, false, false, true}}) {
    for (int64_t m : {1, 8, 17, 33, 64, 72, 130}) {
      RunAndCheckDense(MakeDense(rng, m, 200, 1280), Path::kWgmma, config);
    }
  }
  RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, reg);
  DenseCase d = MakeDense(rng, 11, 136, 384);
  d.x[2 * d.x_stride + 5] = testing::kBf16NaN;
  d.x[6 * d.x_stride + 200] = 0x7F80;
  d.w[static_cast<size_t>(17 * d.k + 130)] = 0x7F;
  d.w[static_cast<size_t>(135 * d.k + 0)] = 0xFF;
  RunAndCheckDense(d, Path::kWgmma, reg);
  RunAndCheckDense(d, Path::kWgmma, Fp8WgmmaConfig{1, 4, 264, true, true, true});
}

// fp8_gemm_w8a16_mma's k splits (2, 4, 8): with one token tile (m <= 8) reduced in the kernel
// through a cluster, with more by the reduce kernel; two runs give the same bits and match the
// reference, extreme scales and NaN / Inf included.
TEST(CudaW8a16GemmTest, MmaClusterReduceIsDeterministic) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (int64_t k : {512, 1024, 2048}) {
    for (int64_t m : {1, 8, 13, 33}) {
      const DenseCase c = MakeDense(rng, m, 200, k);
      const std::vector<uint16_t> first = RunAndCheckDense(c, Path::kMma);
      const std::vector<uint16_t> second = RunAndCheckDense(c, Path::kMma);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, second) << "m=" << m << " k=" << k;
    }
  }
  RunAndCheckDense(ExtremeScales(rng), Path::kMma);
  DenseCase d = MakeDense(rng, 11, 136, 384);
  d.x[2 * d.x_stride + 5] = testing::kBf16NaN;
  d.x[6 * d.x_stride + 200] = 0x7F80;
  d.w[static_cast<size_t>(17 * d.k + 130)] = 0x7F;
  RunAndCheckDense(d, Path::kMma);
}

// two_in_flight (two k blocks' products in flight per consumer warpgroup) gives the bits of one
// block at a time: token tiles 8..64 with odd counts (72 and 130: the flag ignored), 1, 2, 3 and
// 10 k blocks (odd and even counts per warpgroup, the tail paths), unevenly split, 2 and 3 stages
// (the ring as deep as the blocks in flight), with alternate turns too; then extreme scales and
// NaN / Inf against the reference.
TEST(CudaW8a16GemmTest, WgmmaTwoInFlightEqualsOneAtATimeBitForBit) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (Fp8WgmmaConfig config :
       {Fp8WgmmaConfig{1, 4, 0, false, true, true}, Fp8WgmmaConfig{0, 2, 264, false, true, true},
        Fp8WgmmaConfig{1, 3, 4096, false, false, true},
        Fp8WgmmaConfig{0, 4, 0, false, true, true, true}}) {
    for (int64_t k : {128, 256, 384, 1280}) {
      for (int64_t m : {1, 3, 8, 17, 33, 64, 72, 130}) {
        const DenseCase c = MakeDense(rng, m, 200, k);
        config.two_in_flight = false;
        const std::vector<uint16_t> first = RunAndCheckDense(c, Path::kWgmma, config);
        config.two_in_flight = true;
        const std::vector<uint16_t> second = RunAndCheckDense(c, Path::kWgmma, config);
        ASSERT_FALSE(first.empty());
        EXPECT_EQ(first, second) << "m=" << m << " k=" << k << " stages=" << config.stages;
      }
    }
  }
  const Fp8WgmmaConfig in_flight{0, 4, 264, false, true, true, false, true};
  RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, in_flight);
  RunAndCheckDense(NonFiniteDense(rng), Path::kWgmma, in_flight);
  RunAndCheckDense(NonFiniteDense(rng), Path::kWgmma,
                   Fp8WgmmaConfig{1, 2, 0, false, false, true, false, true});
}

// alternate_turns (two consumer warpgroups on one row group, even / odd k blocks, sums added at
// the end): every token tile 8..128 and odd counts, 1 k block (the second warpgroup has none), 3
// and 10 blocks, with and without a split, register weights and the shared-memory conversion,
// cluster_reduce asked for (ignored) and 2 warpgroups asked for (taken as 1); two runs give the
// same bits; extreme scales and NaN / Inf against the reference.
TEST(CudaW8a16GemmTest, WgmmaAlternateTurns) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig configs[] = {{0, 0, 264, false, true, true, true},
                                    {1, 4, 0, false, false, false, true},
                                    {2, 3, 4096, true, true, true, true},
                                    {0, 2, 132, false, true, false, true}};
  for (const Fp8WgmmaConfig& config : configs) {
    EXPECT_EQ(fp8_gemm_w8a16_wgmma_workspace_bytes(9, 200, 1280, config) > 0,
              fp8_gemm_wgmma_splits(9, 200, 1280, config) > 1);
    for (int64_t k : {128, 384, 1280}) {
      for (int64_t m : {1, 5, 8, 17, 33, 64, 72, 100, 128, 130}) {
        const DenseCase c = MakeDense(rng, m, 200, k);
        const std::vector<uint16_t> first = RunAndCheckDense(c, Path::kWgmma, config);
        const std::vector<uint16_t> second = RunAndCheckDense(c, Path::kWgmma, config);
        ASSERT_FALSE(first.empty());
        EXPECT_EQ(first, second) << "m=" << m << " k=" << k;
      }
    }
    RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, config);
    RunAndCheckDense(NonFiniteDense(rng), Path::kWgmma, config);
  }
}

// The wgmma path with `config` at k = 128, 384, 1280 (1, 3, 10 k blocks) and each token count
// of `tokens` (n weight rows): against the reference and two runs the same bits; then extreme
// scales and NaN / Inf.
void SweepWgmmaOption(std::mt19937_64& rng, const Fp8WgmmaConfig& config,
                      std::initializer_list<int64_t> tokens, int64_t n) {
  for (int64_t k : {128, 384, 1280}) {
    for (int64_t m : tokens) {
      const DenseCase c = MakeDense(rng, m, n, k);
      const std::vector<uint16_t> first = RunAndCheckDense(c, Path::kWgmma, config);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, RunAndCheckDense(c, Path::kWgmma, config)) << "m=" << m << " k=" << k;
    }
  }
  RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, config);
  RunAndCheckDense(NonFiniteDense(rng), Path::kWgmma, config);
}

// split_tokens (two consumer warpgroups per block on one weight box, each half of the block's
// tokens): token counts 1 (ignored), 9..130 (tiles of 2 x 8 .. 2 x 64, the second group partly or
// wholly past m), 1, 3 and 10 k blocks, with and without a k split, register weights and the
// shared-memory conversion, two blocks in flight: against the reference and two runs the same
// bits; extreme scales and NaN / Inf.
TEST(CudaW8a16GemmTest, WgmmaSplitTokens) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig configs[] = {{0, 0, 264, false, true, true, false, false, true},
                                    {1, 4, 0, false, false, false, false, false, true},
                                    {0, 2, 4096, false, true, true, false, true, true},
                                    {2, 3, 132, true, true, true, false, false, true}};
  for (const Fp8WgmmaConfig& config : configs) {
    SweepWgmmaOption(rng, config, {1, 9, 16, 17, 33, 64, 65, 100, 128, 130}, 200);
  }
}

// max_registers (the kernel built with at most 96 / 128 registers a thread): CheckMaxRegisters
// (block_scaled_test_util.h: the capped builds' bits equal the uncapped build's, and the capped
// build ran where the plan takes it); then extreme scales and NaN / Inf with each cap.
TEST(CudaW8a16GemmTest, WgmmaMaxRegisters) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  CheckMaxRegisters(true, [&](int64_t m, int64_t k, const std::vector<Fp8WgmmaConfig>& configs) {
    const DenseCase c = MakeDense(rng, m, 200, k);
    std::vector<std::vector<uint16_t>> outs;
    for (const Fp8WgmmaConfig& config : configs)
      outs.push_back(RunAndCheckDense(c, Path::kWgmma, config));
    return outs;
  });
  for (const int cap : {96, 128}) {
    Fp8WgmmaConfig capped = kFp8WgmmaDecodeConfig;
    capped.max_registers = cap;
    RunAndCheckDense(ExtremeScales(rng), Path::kWgmma, capped);
    RunAndCheckDense(NonFiniteDense(rng), Path::kWgmma, capped);
  }
}

// multicast_activations (clusters of two row tiles loading each activation box once): 256 and
// 700 weight rows (4 and 11 row tiles: the odd count runs without), token counts whose block
// tiles are and are not a multiple of 16, with split_tokens (and tiles wholly past m), stagger_k,
// two blocks in flight, a k split or not: against the reference and two runs the same bits;
// extreme scales and NaN / Inf.
TEST(CudaW8a16GemmTest, WgmmaMulticastActivations) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  Fp8WgmmaConfig configs[] = {{0, 0, 264, false, true, true},
                              {1, 4, 0, false, false, false},
                              {0, 4, 264, false, true, true, false, true, true},
                              {0, 2, 4096, false, true, true, false, false, true, true}};
  for (Fp8WgmmaConfig& config : configs) {
    config.multicast_activations = true;
    SweepWgmmaOption(rng, config, {1, 9, 16, 33, 64, 100, 128, 130}, 256);
  }
  SweepWgmmaOption(rng, configs[2], {17, 130}, 700);
}

// stagger_k (each block's k blocks from a row-tile offset on, wrapping around): 1, 3 and 10 k
// blocks (offsets 0..9, with and without a k split), token tiles 8..128, register weights and the
// shared-memory conversion, two blocks in flight, alternate turns and split_tokens: against the
// reference and two runs the same bits; extreme scales and NaN / Inf.
TEST(CudaW8a16GemmTest, WgmmaStaggerK) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  Fp8WgmmaConfig configs[] = {{0, 0, 264, false, true, true},
                              {1, 4, 0, false, false, false},
                              {0, 4, 4096, false, true, true, false, true},
                              {0, 4, 264, false, true, true, true},
                              {0, 2, 264, false, true, true, false, false, true}};
  for (Fp8WgmmaConfig& config : configs) {
    config.stagger_k = true;
    SweepWgmmaOption(rng, config, {1, 9, 33, 64, 100, 130}, 300);
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
