// kernels/cuda/moe_gemm (grouped GEMM of the routed experts, FP8 and FP4 weights, and the
// combine) against kernels/cpu/fp8_gemm.h's MoeGemmReference: fresh random weights, scales,
// activations and routings each run (seed printed; PDSERVE_TEST_SEED replays), the kernel before
// the reference.
#include "kernels/cuda/moe_gemm.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/fp8_gemm.h"
#include "kernels/cuda/moe_gemm_workspace.h"
#include "tests/kernels_cuda/block_scaled_test_util.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;

constexpr uint16_t kSentinel = 0xA5A5;

struct MoeCase {
  bool fp4 = false;
  int64_t n_experts = 16;
  int64_t n = 192;
  int64_t k = 512;
  int64_t tokens = 1;
  int64_t top_k = 6;
  bool x_per_pick = false;
  bool weighted = false;
  bool ue8m0 = false;
  int64_t x_stride = 512;
  int64_t out_stride = 192;
  std::vector<uint16_t> x;
  std::vector<int32_t> experts;
  std::vector<float> pick_weights;
  std::vector<uint8_t> w;
  std::vector<float> scale;
  std::vector<uint8_t> scale_e8m0;
};

// Distinct experts per token drawn from the first `used` experts (the rest get no tokens).
MoeCase MakeMoe(std::mt19937_64& rng, bool fp4, int64_t tokens, int64_t top_k, int64_t used,
                bool x_per_pick, bool weighted) {
  MoeCase c;
  c.fp4 = fp4;
  c.tokens = tokens;
  c.top_k = top_k;
  c.x_per_pick = x_per_pick;
  c.weighted = weighted;
  c.ue8m0 = tokens % 2 == 1;
  c.x_stride = c.k + 8 * (tokens % 2);
  c.out_stride = c.n + 3;
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
  const auto size = [&](int64_t per_expert) {
    return static_cast<size_t>(c.n_experts * per_expert);
  };
  if (fp4) {
    c.w = testing::RandomBytes(rng, size(c.n * c.k / 2));
    c.scale_e8m0 = testing::RandomUe8m0(rng, size(c.n * c.k / 32));
  } else {
    c.w = testing::RandomE4m3(rng, size(c.n * c.k));
    c.scale = testing::RandomScales(rng, size(((c.n + 127) / 128) * (c.k / 128)));
  }
  return c;
}

// Whether environment switch `name` is set to `value` (tests whose comparison it would empty skip).
bool SwitchIs(const char* name, const std::string& value) {
  const char* set = std::getenv(name);
  return set != nullptr && value == set;
}

// Draws c's activations (x_rows rows), weights and scales anew for inner size k (n_experts, n and
// the format as they are).
void Resize(MoeCase& c, std::mt19937_64& rng, int64_t k, int64_t x_rows) {
  c.k = k;
  c.x_stride = k + 8;
  c.x = testing::RandomActivations(rng, x_rows, c.x_stride);
  const auto per_experts = [&](int64_t n) { return static_cast<size_t>(c.n_experts * n); };
  if (c.fp4) {
    c.w = testing::RandomBytes(rng, per_experts(c.n * k / 2));
    c.scale_e8m0 = testing::RandomUe8m0(rng, per_experts(c.n * k / 32));
  } else {
    c.w = testing::RandomE4m3(rng, per_experts(c.n * k));
    c.scale = testing::RandomScales(rng, per_experts(((c.n + 127) / 128) * (k / 128)));
  }
}

// The output rows (the sentinel where nothing was written) of moe_grouped_gemm (no `grouping`)
// or of its mma.sync path with `grouping`, for `format` (kFp4 needs c.fp4); nullopt (with the
// failure reported) when a buffer, the launch, the run or a guard failed.
std::optional<std::vector<uint16_t>> RunGemm(const MoeCase& c, ExpertFormat format,
                                             std::optional<MoeMmaGrouping> grouping,
                                             const std::string& what,
                                             GuardedBuffer<uint8_t>* shared_ws = nullptr,
                                             bool dispatcher = false) {
  const int64_t picks = c.tokens * c.top_k;
  GuardedBuffer<uint16_t> x(c.x.size());
  GuardedBuffer<int32_t> experts(c.experts.size());
  GuardedBuffer<float> pick_weights(std::max<size_t>(1, c.pick_weights.size()));
  GuardedBuffer<uint8_t> w(c.w.size());
  GuardedBuffer<float> scale(std::max<size_t>(1, c.scale.size()));
  GuardedBuffer<uint8_t> scale_e8m0(std::max<size_t>(1, c.scale_e8m0.size()));
  GuardedBuffer<uint16_t> out(static_cast<size_t>(picks * c.out_stride));
  x.Upload(c.x);
  experts.Upload(c.experts);
  if (c.weighted) pick_weights.Upload(c.pick_weights);
  w.Upload(c.w);
  if (c.fp4) {
    scale_e8m0.Upload(c.scale_e8m0);
  } else {
    scale.Upload(c.scale);
  }
  ExpertWeights ew;
  ew.format = format;
  ew.w = w.get();
  ew.scale = c.fp4 ? nullptr : scale.get();
  ew.scale_e8m0 = c.fp4 ? scale_e8m0.get() : nullptr;
  ew.n_experts = c.n_experts;
  ew.n = c.n;
  ew.k = c.k;
  const int64_t rows = c.x_per_pick ? picks : c.tokens;
  // shared_ws (when given): a workspace of the caller's, kept between calls (kReuse).
  // dispatcher: moe_grouped_gemm with `grouping`, as the engine calls it; else a grouping means
  // moe_grouped_gemm_mma.
  const bool mma_only = grouping.has_value() && !dispatcher;
  GuardedBuffer<uint8_t> own_ws(
      shared_ws != nullptr ? 0
      : mma_only           ? moe_grouped_gemm_mma_workspace_bytes(c.tokens, c.top_k, rows, ew)
                           : moe_grouped_gemm_workspace_bytes(c.tokens, c.top_k, rows, ew));
  GuardedBuffer<uint8_t>& ws = shared_ws != nullptr ? *shared_ws : own_ws;
  if (!ws.ok() || !out.ok() || ws.size() == 0) {
    ADD_FAILURE() << what << ": no buffers";
    return std::nullopt;
  }
  const auto* xb = reinterpret_cast<const __nv_bfloat16*>(x.get());
  const float* weights = c.weighted ? pick_weights.get() : nullptr;
  auto* ob = reinterpret_cast<__nv_bfloat16*>(out.get());
  std::string refusal;
  const cudaError_t status =
      mma_only ? moe_grouped_gemm_mma(xb, c.x_stride, c.x_per_pick, experts.get(), weights,
                                      c.tokens, c.top_k, ew, c.ue8m0, ob, c.out_stride, ws.get(),
                                      ws.size(), nullptr, &refusal, *grouping)
               : moe_grouped_gemm(xb, c.x_stride, c.x_per_pick, experts.get(), weights, c.tokens,
                                  c.top_k, ew, c.ue8m0, ob, c.out_stride, ws.get(), ws.size(),
                                  nullptr, &refusal, grouping.value_or(MoeMmaGrouping::kAuto));
  EXPECT_EQ(status, cudaSuccess) << what << ": " << refusal;
  const cudaError_t ran = cudaDeviceSynchronize();
  EXPECT_EQ(ran, cudaSuccess) << what;
  EXPECT_TRUE(out.GuardsIntact()) << what;
  EXPECT_TRUE(ws.GuardsIntact()) << what;
  if (status != cudaSuccess || ran != cudaSuccess || !out.GuardsIntact() || !ws.GuardsIntact()) {
    return std::nullopt;
  }
  return out.Download();
}

void RunAndCheck(const MoeCase& c, const std::string& what) {
  const int64_t picks = c.tokens * c.top_k;
  const std::optional<std::vector<uint16_t>> run =
      RunGemm(c, c.fp4 ? ExpertFormat::kFp4 : ExpertFormat::kFp8, std::nullopt, what);
  ASSERT_TRUE(run.has_value()) << what;
  const std::vector<uint16_t>& got = *run;

  std::vector<float> want(static_cast<size_t>(picks * c.n), 0.0f);
  const std::vector<float> xf = testing::ToFloatsBf16(c.x);
  cpu::ExpertWeightsRef ref{c.fp4, c.w.data(), c.scale.data(), c.scale_e8m0.data(), c.n_experts,
                            c.n,   c.k};
  cpu::MoeGemmReference(xf.data(), c.x_stride, c.x_per_pick, c.experts.data(),
                        c.weighted ? c.pick_weights.data() : nullptr, c.tokens, c.top_k, ref,
                        c.ue8m0, want.data());
  std::vector<bool> valid(static_cast<size_t>(picks));
  for (int64_t p = 0; p < picks; ++p) valid[p] = c.experts[p] >= 0 && c.experts[p] < c.n_experts;
  testing::ExpectBf16Rows(got, picks, c.n, c.out_stride, want, valid, kSentinel, what);
}

TEST(CudaMoeGemmTest, OddTokenCountsZeroTokenExpertsBothFormats) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool fp4 : {false, true}) {
    for (int64_t tokens : {1, 5, 37}) {
      const std::string what =
          std::string(fp4 ? "fp4" : "fp8") + " tokens " + std::to_string(tokens);
      // Experts 12..15 get no tokens; gate/up form (x per token) and down form (x per pick,
      // weighted).
      RunAndCheck(MakeMoe(rng, fp4, tokens, 6, 12, false, false), what + " gate/up");
      RunAndCheck(MakeMoe(rng, fp4, tokens, 6, 12, true, true), what + " down");
    }
  }
}

// One token: the picks handed to the GEMM directly (MoeMmaGrouping::kAuto) give the grouped
// path's bits, every format and form, with invalid ids and an expert picked twice, with k split
// (k 512: the plan's 2 splits and their reduce kernel) and unsplit (k 256: the GEMM writes the
// rows itself, as at V4-Flash's batch 1); rows of invalid picks keep the sentinel in both.
TEST(CudaMoeGemmTest, OneTokenDirectPicksMatchGroupedBits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  if (SwitchIs("PDSERVE_MOE_DIRECT", "group")) {
    GTEST_SKIP() << "PDSERVE_MOE_DIRECT=group: kAuto groups too, nothing to compare";
  }
  auto rng = FreshRng();
  for (ExpertFormat format : {ExpertFormat::kFp8, ExpertFormat::kFp4, ExpertFormat::kFp8W8A16}) {
    const bool fp4 = format == ExpertFormat::kFp4;
    for (bool down : {false, true}) {
      for (const auto& [k, splits] : {std::pair<int64_t, int32_t>{512, 2}, {256, 1}}) {
        MoeCase c = MakeMoe(rng, fp4, 1, 6, 12, down, down);
        Resize(c, rng, k, down ? 6 : 1);
        c.experts[1] = -1;
        c.experts[3] = 16;            // = n_experts: invalid
        c.experts[5] = c.experts[0];  // the same expert twice
        const std::string what = "format " + std::to_string(static_cast<int>(format)) +
                                 (down ? " down" : " gate/up") + " k " + std::to_string(k);
        ASSERT_EQ(moe_workspace::Mma(1, 6, down ? 6 : 1, c.n_experts, c.n, k,
                                     format == ExpertFormat::kFp8W8A16)
                      .splits,
                  splits)
            << what;
        const std::optional<std::vector<uint16_t>> direct =
            RunGemm(c, format, MoeMmaGrouping::kAuto, what);
        const std::optional<std::vector<uint16_t>> grouped =
            RunGemm(c, format, MoeMmaGrouping::kGroupPicks, what);
        ASSERT_TRUE(direct.has_value() && grouped.has_value()) << what;
        ASSERT_EQ(direct->size(), grouped->size()) << what;
        int64_t written = 0;
        for (size_t i = 0; i < direct->size(); ++i) {
          ASSERT_EQ((*direct)[i], (*grouped)[i]) << what << " element " << i;
          const int64_t row = static_cast<int64_t>(i) / c.out_stride;
          const int64_t col = static_cast<int64_t>(i) % c.out_stride;
          const bool valid = c.experts[row] >= 0 && c.experts[row] < c.n_experts;
          if (!valid || col >= c.n) {
            ASSERT_EQ((*direct)[i], kSentinel) << what << " element " << i;
          } else {
            written += (*direct)[i] != kSentinel;
          }
        }
        EXPECT_EQ(written, 4 * c.n) << what;  // 4 valid picks x n columns (none the sentinel)
      }
    }
  }
}

// The identity routing (V4's grouped o_a: every token picks every group in order) without a
// grouping kernel (MoeMmaGrouping::kIdentity) gives the grouped path's bits: FP8, FP4 and W8A16,
// x per pick (as o_a) and per token, 1 / 3 / 5 / 37 tokens (items of 8, 16 and 32 entries, one
// expert's tokens over several items), k split and unsplit; kIdentity with top_k != n_experts is
// refused.
TEST(CudaMoeGemmTest, IdentityRoutingMatchesGroupedBits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (ExpertFormat format : {ExpertFormat::kFp8, ExpertFormat::kFp4, ExpertFormat::kFp8W8A16}) {
    const bool fp4 = format == ExpertFormat::kFp4;
    for (int64_t tokens : {1, 3, 5, 37}) {
      for (bool per_pick : {true, false}) {
        MoeCase c = MakeMoe(rng, fp4, tokens, 8, 8, per_pick, per_pick);
        c.n_experts = 8;
        // k 256 at 5 tokens: no k split.
        Resize(c, rng, tokens == 5 ? 256 : 512, per_pick ? tokens * 8 : tokens);
        for (size_t i = 0; i < c.experts.size(); ++i) c.experts[i] = static_cast<int32_t>(i % 8);
        const std::string what = "format " + std::to_string(static_cast<int>(format)) + " tokens " +
                                 std::to_string(tokens) +
                                 (per_pick ? " x per pick" : " x per token");
        const std::optional<std::vector<uint16_t>> identity =
            RunGemm(c, format, MoeMmaGrouping::kIdentity, what, nullptr, /*dispatcher=*/true);
        const std::optional<std::vector<uint16_t>> grouped =
            RunGemm(c, format, MoeMmaGrouping::kGroupPicks, what);
        ASSERT_TRUE(identity.has_value() && grouped.has_value()) << what;
        ASSERT_EQ(*identity, *grouped) << what;
        // The blocks take their group from their index, not from the routing: with every pick
        // saying group 0 (valid ids: the split-K reduce still checks them) the result is the same.
        MoeCase all_zero = c;
        std::fill(all_zero.experts.begin(), all_zero.experts.end(), 0);
        const std::optional<std::vector<uint16_t>> from_index =
            RunGemm(all_zero, format, MoeMmaGrouping::kIdentity, what + " (routing all 0)", nullptr,
                    /*dispatcher=*/true);
        ASSERT_TRUE(from_index.has_value()) << what;
        ASSERT_EQ(*from_index, *identity) << what;
        int64_t written = 0;
        for (size_t i = 0; i < identity->size(); ++i) {
          const bool in_row = static_cast<int64_t>(i) % c.out_stride < c.n;
          if (!in_row) {
            ASSERT_EQ((*identity)[i], kSentinel) << what << " element " << i;
          }
          written += in_row && (*identity)[i] != kSentinel;
        }
        EXPECT_EQ(written, tokens * 8 * c.n) << what;
      }
    }
  }
  // top_k 6 of 16 experts: not an identity routing.
  MoeCase c = MakeMoe(rng, false, 3, 6, 12, false, false);
  const std::string what = "kIdentity, top_k != n_experts";
  GuardedBuffer<uint16_t> x(c.x.size());
  GuardedBuffer<int32_t> experts(c.experts.size());
  GuardedBuffer<uint8_t> w(c.w.size());
  GuardedBuffer<float> scale(c.scale.size());
  GuardedBuffer<uint16_t> out(static_cast<size_t>(c.tokens * c.top_k * c.out_stride));
  ExpertWeights ew;
  ew.w = w.get();
  ew.scale = scale.get();
  ew.n_experts = c.n_experts;
  ew.n = c.n;
  ew.k = c.k;
  GuardedBuffer<uint8_t> ws(moe_grouped_gemm_mma_workspace_bytes(c.tokens, c.top_k, c.tokens, ew));
  std::string refusal;
  EXPECT_EQ(moe_grouped_gemm_mma(reinterpret_cast<const __nv_bfloat16*>(x.get()), c.x_stride, false,
                                 experts.get(), nullptr, c.tokens, c.top_k, ew, false,
                                 reinterpret_cast<__nv_bfloat16*>(out.get()), c.out_stride,
                                 ws.get(), ws.size(), nullptr, &refusal, MoeMmaGrouping::kIdentity),
            cudaErrorInvalidValue)
      << what;
  EXPECT_NE(refusal.find("kIdentity"), std::string::npos) << refusal;
  refusal.clear();
  EXPECT_EQ(moe_grouped_gemm(reinterpret_cast<const __nv_bfloat16*>(x.get()), c.x_stride, false,
                             experts.get(), nullptr, c.tokens, c.top_k, ew, false,
                             reinterpret_cast<__nv_bfloat16*>(out.get()), c.out_stride, ws.get(),
                             ws.size(), nullptr, &refusal, MoeMmaGrouping::kIdentity),
            cudaErrorInvalidValue)
      << what << " (moe_grouped_gemm)";
  EXPECT_NE(refusal.find("kIdentity"), std::string::npos) << refusal;
}

// The routed experts' down projection reusing the gate+up call's grouping on the same workspace
// (MoeMmaGrouping::kReuse, through moe_grouped_gemm as the engine calls it): honoured (with the
// stored item count zeroed after the gate+up call, the down call finds no items and writes
// nothing), and with the grouping intact it gives the bits of a down call that groups again:
// FP8, FP4 and W8A16, 5 and 37 tokens (k split and unsplit), an invalid id and an expert picked
// twice by one token.
TEST(CudaMoeGemmTest, DownReusingTheGateUpGroupingMatchesGroupedBits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  if (SwitchIs("PDSERVE_MOE_GEMM", "wgmma")) {
    GTEST_SKIP() << "PDSERVE_MOE_GEMM=wgmma: moe_grouped_gemm groups itself, kReuse is not taken";
  }
  auto rng = FreshRng();
  for (ExpertFormat format : {ExpertFormat::kFp8, ExpertFormat::kFp4, ExpertFormat::kFp8W8A16}) {
    const bool fp4 = format == ExpertFormat::kFp4;
    for (int64_t tokens : {5, 37}) {
      MoeCase gate_up = MakeMoe(rng, fp4, tokens, 6, 12, false, false);
      gate_up.experts[2] = -1;
      gate_up.experts[7] = gate_up.experts[6];
      MoeCase down = MakeMoe(rng, fp4, tokens, 6, 12, true, true);
      down.experts = gate_up.experts;
      if (tokens == 5) Resize(down, rng, 256, tokens * 6);  // k 256: no k split
      const std::string what = "format " + std::to_string(static_cast<int>(format)) + " tokens " +
                               std::to_string(tokens);
      ExpertWeights sizes;
      sizes.format = format;
      sizes.n_experts = down.n_experts;
      sizes.n = down.n;
      sizes.k = std::max(down.k, gate_up.k);
      GuardedBuffer<uint8_t> ws(moe_grouped_gemm_workspace_bytes(tokens, 6, tokens * 6, sizes));
      // The workspace's item count (moe_gemm_workspace.h: entry_pick | items | counts ...).
      const moe_workspace::MmaSizes plan = moe_workspace::Mma(
          tokens, 6, tokens * 6, down.n_experts, down.n, down.k, format == ExpertFormat::kFp8W8A16);
      const std::optional<std::vector<uint16_t>> grouped =
          RunGemm(down, format, MoeMmaGrouping::kGroupPicks, what + " down grouped");
      ASSERT_TRUE(grouped.has_value()) << what;
      ASSERT_TRUE(RunGemm(gate_up, format, std::nullopt, what + " gate/up", &ws).has_value());
      ASSERT_EQ(cudaMemset(ws.get() + plan.entry_bytes + plan.item_bytes, 0, sizeof(int32_t)),
                cudaSuccess);
      const std::optional<std::vector<uint16_t>> no_items = RunGemm(
          down, format, MoeMmaGrouping::kReuse, what + " down, no items", &ws, /*dispatcher=*/true);
      ASSERT_TRUE(no_items.has_value()) << what;
      if (plan.splits == 1) {  // nothing written at all
        for (size_t i = 0; i < no_items->size(); ++i) {
          ASSERT_EQ((*no_items)[i], kSentinel) << what << " element " << i << ": grouped again?";
        }
      } else {  // the split-K reduce still writes the rows, from partial sums nobody computed
        EXPECT_NE(*no_items, *grouped) << what << ": grouped again?";
      }
      ASSERT_TRUE(RunGemm(gate_up, format, std::nullopt, what + " gate/up", &ws).has_value());
      const std::optional<std::vector<uint16_t>> reused = RunGemm(
          down, format, MoeMmaGrouping::kReuse, what + " down reused", &ws, /*dispatcher=*/true);
      ASSERT_TRUE(reused.has_value()) << what;
      ASSERT_EQ(*reused, *grouped) << what;
    }
  }
}

TEST(CudaMoeGemmTest, AllTokensOnOneExpert) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (bool fp4 : {false, true}) {
    // 141 tokens, top-1, all on expert 9: several work items of one expert.
    MoeCase c = MakeMoe(rng, fp4, 141, 1, 16, false, true);
    std::fill(c.experts.begin(), c.experts.end(), 9);
    RunAndCheck(c, fp4 ? "fp4 one expert" : "fp8 one expert");
  }
}

TEST(CudaMoeGemmTest, InvalidExpertIdsLeaveRowsUntouched) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  MoeCase c = MakeMoe(rng, true, 7, 3, 16, false, true);
  c.experts[0] = -1;
  c.experts[4] = 16;
  c.experts[20] = -7;
  RunAndCheck(c, "invalid ids");
}

TEST(CudaMoeGemmTest, ExtremeScales) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  MoeCase fp8 = MakeMoe(rng, false, 3, 6, 16, false, false);
  for (size_t i = 0; i < fp8.scale.size(); ++i) fp8.scale[i] = std::ldexp(1.0f, i % 2 ? 20 : -20);
  RunAndCheck(fp8, "fp8 scales 2^+-20");
  MoeCase fp4 = MakeMoe(rng, true, 3, 6, 16, true, false);
  for (size_t i = 0; i < fp4.scale_e8m0.size(); ++i) fp4.scale_e8m0[i] = i % 3 ? 147 : 107;
  RunAndCheck(fp4, "fp4 scales 2^+-20");
}

TEST(CudaMoeGemmTest, NanAndInfMatchInPosition) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  MoeCase c = MakeMoe(rng, false, 5, 6, 16, false, false);
  c.x[1 * c.x_stride + 3] = testing::kBf16NaN;
  c.x[3 * c.x_stride + 300] = 0x7F80;
  c.w[static_cast<size_t>((c.experts[0] * c.n + 50) * c.k + 7)] = 0x7F;  // token 0's expert
  RunAndCheck(c, "fp8 NaN/Inf");
  MoeCase f = MakeMoe(rng, true, 5, 6, 16, true, false);
  f.x[2 * f.x_stride + 3] = testing::kBf16NaN;
  f.scale_e8m0[static_cast<size_t>((f.experts[7] * f.n + 9) * (f.k / 32) + 2)] = 0xFF;  // NaN
  RunAndCheck(f, "fp4 NaN scale");
}

TEST(CudaMoeGemmTest, CombineSumsValidPicksInOrder) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const int64_t tokens = 13;
  const int64_t top_k = 6;
  const int64_t n = 100;
  const int64_t y_stride = 104;
  const int64_t out_stride = 101;
  std::vector<uint16_t> y = testing::RandomActivations(rng, tokens * top_k, y_stride);
  std::vector<int32_t> experts(static_cast<size_t>(tokens * top_k));
  std::uniform_int_distribution<int32_t> id(-1, 8);  // -1 and 8 (= n_experts) are invalid
  for (int32_t& e : experts) e = id(rng);
  std::vector<float> out_init(static_cast<size_t>(tokens * out_stride));
  std::normal_distribution<float> normal;
  for (float& v : out_init) v = normal(rng);
  GuardedBuffer<uint16_t> yd(y.size());
  GuardedBuffer<int32_t> ed(experts.size());
  GuardedBuffer<float> od(out_init.size());
  yd.Upload(y);
  ed.Upload(experts);
  od.Upload(out_init);
  PDSERVE_CUDA_OK(moe_combine(reinterpret_cast<const __nv_bfloat16*>(yd.get()), y_stride, ed.get(),
                              tokens, top_k, 8, n, od.get(), out_stride, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = od.Download();
  EXPECT_TRUE(od.GuardsIntact());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < out_stride; ++c) {
      float want = out_init[t * out_stride + c];
      if (c < n) {
        for (int64_t j = 0; j < top_k; ++j) {
          const int32_t e = experts[t * top_k + j];
          if (e >= 0 && e < 8) want += testing::FromBf16(y[(t * top_k + j) * y_stride + c]);
        }
      }
      ASSERT_EQ(got[t * out_stride + c], want) << "token " << t << " column " << c;
    }
  }
}

TEST(CudaMoeGemmTest, RefusalsNameTheArgument) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(4096);
  GuardedBuffer<int32_t> experts(64);
  GuardedBuffer<uint8_t> w(4096);
  GuardedBuffer<uint16_t> out(4096);
  GuardedBuffer<uint8_t> ws(1 << 20);
  ExpertWeights ew;
  ew.format = ExpertFormat::kFp4;
  ew.w = w.get();
  ew.n_experts = 4;
  ew.n = 16;
  ew.k = 128;
  const auto refusal_of = [&](const ExpertWeights& weights, int64_t top_k) {
    std::string refusal;
    const cudaError_t status = moe_grouped_gemm(
        reinterpret_cast<const __nv_bfloat16*>(x.get()), 128, false, experts.get(), nullptr, 2,
        top_k, weights, false, reinterpret_cast<__nv_bfloat16*>(out.get()), 16, ws.get(), ws.size(),
        nullptr, &refusal);
    EXPECT_EQ(status, cudaErrorInvalidValue);
    return refusal;
  };
  EXPECT_NE(refusal_of(ew, 2).find("weights.scale_e8m0:"), std::string::npos);
  EXPECT_NE(refusal_of(ew, 0).find("top_k:"), std::string::npos);
  ExpertWeights bad_k = ew;
  bad_k.k = 96;
  EXPECT_NE(refusal_of(bad_k, 2).find("weights.k:"), std::string::npos);
  ExpertWeights many = ew;
  many.n_experts = 2000;
  EXPECT_NE(refusal_of(many, 2).find("weights.n_experts:"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
