// kernels/cuda moe_grouped_gemm_wgmma (the routed experts' grouped GEMM on the warpgroup MMA, FP8
// and W8A16 experts) against kernels/cpu/fp8_gemm.h's MoeGemmReference, the reference
// moe_gemm_test.cc holds the mma.sync path to: fresh random weights, scales, activations and
// routings each run (seed printed; PDSERVE_TEST_SEED replays), the kernel before the reference,
// sentinels around and between the output rows, both token tiles (64, 128).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/fp8_gemm.h"
#include "kernels/cuda/moe_gemm.cuh"
#include "tests/kernels_cuda/block_scaled_test_util.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;

constexpr uint16_t kSentinel = 0xA5A5;

struct Case {
  bool a16 = false;  // ExpertFormat::kFp8W8A16, else kFp8
  int64_t n_experts = 16;
  int64_t n = 192;
  int64_t k = 512;
  int64_t tokens = 1;
  int64_t top_k = 6;
  bool x_per_pick = false;
  bool weighted = false;
  bool ue8m0 = false;
  int64_t x_stride = 512;
  int64_t out_stride = 195;
  std::vector<uint16_t> x;
  std::vector<int32_t> experts;
  std::vector<float> pick_weights;
  std::vector<uint8_t> w;
  std::vector<float> scale;
};

std::string Name(const Case& c) {
  return std::string(c.a16 ? "w8a16" : "fp8") + " tokens " + std::to_string(c.tokens) + " top_k " +
         std::to_string(c.top_k) + " n " + std::to_string(c.n) +
         (c.x_per_pick ? " down" : " gate/up");
}

// Distinct experts per token drawn from the first `used` experts (the rest get no tokens).
Case MakeCase(std::mt19937_64& rng, bool a16, int64_t tokens, int64_t top_k, int64_t used,
              bool x_per_pick, int64_t n = 192) {
  Case c;
  c.a16 = a16;
  c.n = n;
  c.out_stride = n + 3;
  c.tokens = tokens;
  c.top_k = top_k;
  c.x_per_pick = x_per_pick;
  c.weighted = x_per_pick;  // the down projection carries the routing weights
  c.ue8m0 = tokens % 2 == 1;
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
  if (c.weighted) {
    c.pick_weights.resize(c.experts.size());
    for (float& v : c.pick_weights) v = unit(rng);
  }
  c.w = testing::RandomE4m3(rng, static_cast<size_t>(c.n_experts * c.n * c.k));
  c.scale = testing::RandomScales(
      rng, static_cast<size_t>(c.n_experts * ((c.n + 127) / 128) * (c.k / 128)));
  return c;
}

// The GPU output [picks, out_stride] bf16 bits of one call with `config` (sentinels elsewhere).
std::vector<uint16_t> RunGpu(const Case& c, const MoeWgmmaConfig& config, const std::string& what) {
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
  ew.format = c.a16 ? ExpertFormat::kFp8W8A16 : ExpertFormat::kFp8;
  ew.w = w.get();
  ew.scale = scale.get();
  ew.n_experts = c.n_experts;
  ew.n = c.n;
  ew.k = c.k;
  const int64_t rows = c.x_per_pick ? picks : c.tokens;
  GuardedBuffer<uint8_t> ws(
      moe_grouped_gemm_wgmma_workspace_bytes(c.tokens, c.top_k, rows, ew, config));
  EXPECT_TRUE(ws.ok() && out.ok() && ws.size() > 0) << what;
  std::string refusal;
  const cudaError_t status = moe_grouped_gemm_wgmma(
      reinterpret_cast<const __nv_bfloat16*>(x.get()), c.x_stride, c.x_per_pick, experts.get(),
      c.weighted ? pick_weights.get() : nullptr, c.tokens, c.top_k, ew, c.ue8m0,
      reinterpret_cast<__nv_bfloat16*>(out.get()), c.out_stride, ws.get(), ws.size(), nullptr,
      config, &refusal);
  EXPECT_EQ(status, cudaSuccess) << what << ": " << refusal;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  std::vector<uint16_t> got = out.Download();
  EXPECT_TRUE(out.GuardsIntact()) << what;
  EXPECT_TRUE(ws.GuardsIntact()) << what;
  return got;
}

// MoeGemmReference's [picks, n] output for the case.
std::vector<float> Reference(const Case& c) {
  std::vector<float> want(static_cast<size_t>(c.tokens * c.top_k * c.n), 0.0f);
  const std::vector<float> xf = testing::ToFloatsBf16(c.x);
  cpu::ExpertWeightsRef ref;
  ref.w = c.w.data();
  ref.scale = c.scale.data();
  ref.n_experts = c.n_experts;
  ref.n = c.n;
  ref.k = c.k;
  ref.bf16_activations = c.a16;
  cpu::MoeGemmReference(xf.data(), c.x_stride, c.x_per_pick, c.experts.data(),
                        c.weighted ? c.pick_weights.data() : nullptr, c.tokens, c.top_k, ref,
                        c.ue8m0, want.data());
  return want;
}

// Both token tiles and the default config, each against the reference (computed after the first
// GPU run, so that its memory cannot fake a pass).
void RunAndCheck(const Case& c, const std::string& label = "") {
  const int64_t picks = c.tokens * c.top_k;
  std::vector<bool> valid(static_cast<size_t>(picks));
  for (int64_t p = 0; p < picks; ++p) valid[p] = c.experts[p] >= 0 && c.experts[p] < c.n_experts;
  std::vector<float> want;
  for (int tile : {0, 64, 128}) {
    const std::string what = Name(c) + label + " tile " + std::to_string(tile);
    const std::vector<uint16_t> got = RunGpu(c, MoeWgmmaConfig{tile, 0, false}, what);
    if (::testing::Test::HasFailure()) return;
    if (want.empty()) want = Reference(c);
    testing::ExpectBf16Rows(got, picks, c.n, c.out_stride, want, valid, kSentinel, what);
  }
}

TEST(CudaMoeGemmWgmmaTest, OddTokenCountsZeroTokenExpertsBothForms) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    // Experts 12..15 get no tokens; 200 tokens average 100 picks per expert (two items of 64,
    // one of 128).
    for (int64_t tokens : {1, 5, 37, 200}) {
      RunAndCheck(MakeCase(rng, a16, tokens, 6, 12, false));
      RunAndCheck(MakeCase(rng, a16, tokens, 6, 12, true));
    }
  }
}

TEST(CudaMoeGemmWgmmaTest, PartialRowTilesAndTheLastExpert) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    // n = 200: a partial 64-row group and a partial 128-row scale block; every expert used, so the
    // last expert's row tile reads past the weight tensor (zeros, never stored).
    RunAndCheck(MakeCase(rng, a16, 77, 4, 16, false, 200));
    RunAndCheck(MakeCase(rng, a16, 77, 4, 16, true, 200));
    RunAndCheck(MakeCase(rng, a16, 33, 2, 16, true, 72));
  }
}

TEST(CudaMoeGemmWgmmaTest, AllTokensOnOneExpert) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    for (int64_t expert : {9, 15}) {
      // 301 tokens, top-1, all on one expert: several work items of one expert, a partial last.
      Case c = MakeCase(rng, a16, 301, 1, 16, true);
      std::fill(c.experts.begin(), c.experts.end(), static_cast<int32_t>(expert));
      RunAndCheck(c, " one expert " + std::to_string(expert));
    }
  }
}

TEST(CudaMoeGemmWgmmaTest, InvalidExpertIdsLeaveRowsUntouched) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    Case c = MakeCase(rng, a16, 7, 3, 16, true);
    c.experts[0] = -1;
    c.experts[4] = 16;
    c.experts[20] = -7;
    RunAndCheck(c, " invalid ids");
  }
}

TEST(CudaMoeGemmWgmmaTest, ExtremeScalesAndMagnitudes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    for (bool per_pick : {false, true}) {
      Case c = MakeCase(rng, a16, 3, 6, 16, per_pick);
      for (size_t i = 0; i < c.scale.size(); ++i) c.scale[i] = std::ldexp(1.0f, i % 2 ? 20 : -20);
      for (int64_t col = 0; col < c.k; ++col) {
        c.x[0 * c.x_stride + col] = testing::ToBf16(std::ldexp(testing::FromBf16(c.x[col]), -20));
        c.x[1 * c.x_stride + col] =
            testing::ToBf16(std::ldexp(testing::FromBf16(c.x[c.x_stride + col]), 20));
      }
      RunAndCheck(c, " scales and rows 2^+-20");
    }
  }
}

TEST(CudaMoeGemmWgmmaTest, NanAndInfMatchInPosition) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    Case c = MakeCase(rng, a16, 5, 6, 16, false);
    c.x[1 * c.x_stride + 3] = testing::kBf16NaN;
    c.x[3 * c.x_stride + 300] = 0x7F80;                                    // +Inf
    c.w[static_cast<size_t>((c.experts[0] * c.n + 50) * c.k + 7)] = 0x7F;  // token 0's expert
    RunAndCheck(c, " NaN/Inf");
  }
}

TEST(CudaMoeGemmWgmmaTest, EqualBitsAcrossRuns) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    for (int tile : {64, 128}) {
      const Case c = MakeCase(rng, a16, 150, 6, 16, true);
      const std::string what = Name(c) + " tile " + std::to_string(tile);
      const std::vector<uint16_t> first = RunGpu(c, MoeWgmmaConfig{tile, 0, false}, what);
      const std::vector<uint16_t> second =
          RunGpu(c, MoeWgmmaConfig{tile, 3, false}, what + " 3 stages");
      ASSERT_EQ(first, second) << what;
    }
  }
}

// multicast_activations: the same bits as without (an even number of row tiles: n = 192, 200,
// 4 x 128), and the reference; odd token counts, one expert, both forms, both tiles.
TEST(CudaMoeGemmWgmmaMulticastTest, SameBitsAsWithoutAndTheReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool a16 : {false, true}) {
    std::vector<Case> cases = {MakeCase(rng, a16, 37, 6, 12, false),
                               MakeCase(rng, a16, 200, 6, 16, true, 200),
                               MakeCase(rng, a16, 9, 6, 16, true, 512)};
    Case one = MakeCase(rng, a16, 301, 1, 16, false);
    std::fill(one.experts.begin(), one.experts.end(), 15);
    cases.push_back(one);
    for (const Case& c : cases) {
      std::vector<float> want;  // after the first GPU run
      const int64_t picks = c.tokens * c.top_k;
      for (int tile : {64, 128}) {
        const std::string what = Name(c) + " tile " + std::to_string(tile);
        const std::vector<uint16_t> plain = RunGpu(c, MoeWgmmaConfig{tile, 0, false}, what);
        const std::vector<uint16_t> multicast =
            RunGpu(c, MoeWgmmaConfig{tile, 0, true}, what + " multicast");
        ASSERT_EQ(plain, multicast) << what;
        if (want.empty()) want = Reference(c);
        testing::ExpectBf16Rows(multicast, picks, c.n, c.out_stride, want, {}, kSentinel, what);
      }
    }
  }
}

TEST(CudaMoeGemmWgmmaTest, RefusalsNameTheArgument) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(4096);
  GuardedBuffer<int32_t> experts(64);
  GuardedBuffer<uint8_t> w(4096);
  GuardedBuffer<float> scale(64);
  GuardedBuffer<uint16_t> out(4096);
  GuardedBuffer<uint8_t> ws(1 << 20);
  ExpertWeights ew;
  ew.format = ExpertFormat::kFp4;
  ew.w = w.get();
  ew.scale_e8m0 = w.get();
  ew.n_experts = 4;
  ew.n = 16;
  ew.k = 128;
  const auto refusal_of = [&](const ExpertWeights& weights, size_t ws_bytes) {
    std::string refusal;
    const cudaError_t status = moe_grouped_gemm_wgmma(
        reinterpret_cast<const __nv_bfloat16*>(x.get()), 128, false, experts.get(), nullptr, 2, 2,
        weights, false, reinterpret_cast<__nv_bfloat16*>(out.get()), 16, ws.get(), ws_bytes,
        nullptr, MoeWgmmaConfig{}, &refusal);
    EXPECT_EQ(status, cudaErrorInvalidValue);
    return refusal;
  };
  EXPECT_NE(refusal_of(ew, ws.size()).find("weights.format:"), std::string::npos);
  EXPECT_EQ(moe_grouped_gemm_wgmma_workspace_bytes(2, 2, 2, ew), 0u);
  EXPECT_EQ(moe_grouped_gemm_path(4096, 6, ew), MoeGemmPath::kMma);  // FP4: mma.sync only
  ExpertWeights fp8 = ew;
  fp8.format = ExpertFormat::kFp8;
  fp8.scale = scale.get();
  EXPECT_NE(refusal_of(fp8, 16).find("workspace_bytes:"), std::string::npos);
  ExpertWeights bad_k = fp8;
  bad_k.k = 96;
  EXPECT_NE(refusal_of(bad_k, ws.size()).find("weights.k:"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
