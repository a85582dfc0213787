// kernels/cuda/hyper_connection_fused (the fused pre-mix, two launches) against the composition
// the engine runs without it (engine/gpu/gpu_model.cc HcPre): rms_norm of the flat streams on the
// GPU, the mixing GEMM on the host in fp64 (the tests link no cuBLAS), hyper_connection_pre and
// the weighted rms_norm on the GPU.
//
// Tolerance (kTolerance, normalized error of post, comb and collapsed): the only operations that
// round differently are the mix dot products. The fused kernel sums K = hc * hidden fp32 products
// of the unnormalized streams in ~40 roundings deep (4 fused multiply-adds a lane, a 5-level warp
// butterfly, the slices in split order) and scales the sum by inv_rms once; the reference sums in
// fp64 after the normalization. With these inputs (streams ~ N(0, 1), fn ~ N(0, 1 / K)) |mix| ~ 1
// and each rounding errs by ~2^-24 |partial sum|, so mix errs by ~1e-6 at K = 16384 (random walk
// over the depth; the bound of depth * 2^-24 * sum|terms| is ~3e-4 but is not approached). The
// sigmoids (slope <= 1/4), the Sinkhorn projection (iterated normalizations, gain O(1)) and the
// collapse and RMSNorm (linear, then a renormalization) pass that on without amplification, so
// 1e-5 leaves a margin of ~10. Each case prints its errors so a run shows how close they come.
#include "kernels/cuda/hyper_connection_fused.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/hyper_connection.cuh"
#include "kernels/cuda/rms_norm.cuh"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;
using testing::NormalizedError;
using testing::NormalValues;
using testing::Widen;

constexpr float kHcEps = 1e-6f;
constexpr float kRmsEps = 1e-6f;
constexpr int64_t kIters = 20;
constexpr double kTolerance = 1e-5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One site: streams [rows, hc, hidden], fn [outputs, hc * hidden], base [outputs], scale [3],
// the sublayer norm's weight [hidden].
struct Site {
  int64_t rows;
  int64_t hc;
  int64_t hidden;
  std::vector<float> streams, fn, base, scale, weight;
  int64_t outputs() const { return (2 + hc) * hc; }
  int64_t flat() const { return hc * hidden; }
};

Site MakeSite(std::mt19937_64& rng, int64_t rows, int64_t hc, int64_t hidden) {
  Site s{rows, hc, hidden, {}, {}, {}, {}, {}};
  s.streams = NormalValues(rng, static_cast<size_t>(rows * s.flat()), 0.0f, 1.0f);
  s.fn = NormalValues(rng, static_cast<size_t>(s.outputs() * s.flat()), 0.0f,
                      1.0f / std::sqrt(static_cast<float>(s.flat())));
  s.base = NormalValues(rng, static_cast<size_t>(s.outputs()), 0.0f, 0.5f);
  s.scale = NormalValues(rng, 3, 1.0f, 0.5f);
  s.weight = NormalValues(rng, static_cast<size_t>(hidden), 1.0f, 0.2f);
  return s;
}

struct Outputs {
  std::vector<float> post, comb, collapsed;
};

// The site's device inputs.
struct DeviceSite {
  explicit DeviceSite(const Site& s)
      : streams(s.streams.size()),
        fn(s.fn.size()),
        base(s.base.size()),
        scale(s.scale.size()),
        weight(s.weight.size()) {
    streams.Upload(s.streams);
    fn.Upload(s.fn);
    base.Upload(s.base);
    scale.Upload(s.scale);
    weight.Upload(s.weight);
  }
  GuardedBuffer<float> streams, fn, base, scale, weight;
};

// Guarded outputs and workspace of one fused call.
struct FusedBuffers {
  explicit FusedBuffers(const Site& s)
      : workspace(hyper_connection_pre_fused_workspace(s.rows, s.hc, s.hidden)),
        partials(static_cast<size_t>(workspace)),
        post(static_cast<size_t>(s.rows * s.hc)),
        comb(static_cast<size_t>(s.rows * s.hc * s.hc)),
        collapsed(static_cast<size_t>(s.rows * s.hidden)) {}
  cudaError_t Run(const Site& s, DeviceSite& d, cudaStream_t stream, bool programmatic = false) {
    return hyper_connection_pre_fused(d.streams.get(), s.rows, s.hc, s.hidden, d.fn.get(),
                                      d.base.get(), d.scale.get(), kHcEps, kIters, d.weight.get(),
                                      kRmsEps, partials.get(), workspace, post.get(), comb.get(),
                                      collapsed.get(), stream, programmatic);
  }
  bool GuardsIntact() const {
    return partials.GuardsIntact() && post.GuardsIntact() && comb.GuardsIntact() &&
           collapsed.GuardsIntact();
  }
  Outputs Download() const { return {post.Download(), comb.Download(), collapsed.Download()}; }
  int64_t workspace;
  GuardedBuffer<float> partials, post, comb, collapsed;
};

// The unfused composition (GpuModel's HcPre without the option), the GEMM on the host in fp64.
Outputs Unfused(const Site& s, DeviceSite& d) {
  const int64_t flat = s.flat();
  const int64_t outputs = s.outputs();
  GuardedBuffer<float> normed(static_cast<size_t>(s.rows * flat));
  EXPECT_EQ(rms_norm(d.streams.get(), nullptr, s.rows, flat, flat, kRmsEps, normed.get(), nullptr),
            cudaSuccess);
  const std::vector<float> x = normed.Download();
  std::vector<float> mix(static_cast<size_t>(s.rows * outputs));
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t o = 0; o < outputs; ++o) {
      double dot = 0.0;
      for (int64_t i = 0; i < flat; ++i) dot += double{x[r * flat + i]} * s.fn[o * flat + i];
      mix[r * outputs + o] = static_cast<float>(dot);
    }
  }
  GuardedBuffer<float> mix_d(mix.size());
  mix_d.Upload(mix);
  GuardedBuffer<float> post(static_cast<size_t>(s.rows * s.hc));
  GuardedBuffer<float> comb(static_cast<size_t>(s.rows * s.hc * s.hc));
  GuardedBuffer<float> collapsed(static_cast<size_t>(s.rows * s.hidden));
  EXPECT_EQ(hyper_connection_pre(mix_d.get(), d.streams.get(), s.rows, s.hc, s.hidden, d.base.get(),
                                 d.scale.get(), kHcEps, kIters, post.get(), comb.get(),
                                 collapsed.get(), nullptr),
            cudaSuccess);
  EXPECT_EQ(rms_norm(collapsed.get(), d.weight.get(), s.rows, s.hidden, s.hidden, kRmsEps,
                     collapsed.get(), nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {post.Download(), comb.Download(), collapsed.Download()};
}

std::string Describe(const Site& s) {
  return "rows " + std::to_string(s.rows) + " hc " + std::to_string(s.hc) + " hidden " +
         std::to_string(s.hidden);
}

void ExpectClose(const Outputs& got, const Outputs& want, const std::string& what) {
  const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>>
      parts[] = {{"post", {&got.post, &want.post}},
                 {"comb", {&got.comb, &want.comb}},
                 {"collapsed", {&got.collapsed, &want.collapsed}}};
  for (const auto& [name, pair] : parts) {
    const testing::ErrorReport e = NormalizedError(Widen(*pair.first), Widen(*pair.second));
    std::printf("%s %s: normalized error %.3g\n", what.c_str(), name, e.normalized);
    EXPECT_EQ(e.mismatched, 0) << what << " " << name << ": NaN/Inf positions differ";
    EXPECT_LE(e.normalized, kTolerance) << what << " " << name;
  }
}

// The fused call first (before the reference allocates), then the composition.
void CheckAgainstUnfused(const Site& s) {
  DeviceSite d(s);
  FusedBuffers fused(s);
  ASSERT_EQ(fused.Run(s, d, nullptr), cudaSuccess) << Describe(s);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Outputs got = fused.Download();
  EXPECT_TRUE(fused.GuardsIntact()) << Describe(s);
  ExpectClose(got, Unfused(s, d), Describe(s));
}

TEST(CudaHyperConnectionFusedTest, V4FlashShapeMatchesUnfused) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  for (const int64_t rows : {1, 3, 32, 128}) CheckAgainstUnfused(MakeSite(rng, rows, 4, 4096));
}

// Rows past one dots block's tile (kHcFusedRowsPerBlock) and a prefill-sized count.
TEST(CudaHyperConnectionFusedTest, RowTilesMatchUnfused) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  for (const int64_t rows : {33, 300}) CheckAgainstUnfused(MakeSite(rng, rows, 4, 4096));
}

// A last K-slice shorter than kHcFusedSlice (3 * 257 = 771 columns), odd rows, every supported hc.
TEST(CudaHyperConnectionFusedTest, SmallOddShapesMatchUnfused) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  CheckAgainstUnfused(MakeSite(rng, 5, 3, 257));
  CheckAgainstUnfused(MakeSite(rng, 7, 1, 100));
  CheckAgainstUnfused(MakeSite(rng, 3, 2, 33));
  CheckAgainstUnfused(MakeSite(rng, 2, 4, 8192));
}

TEST(CudaHyperConnectionFusedTest, NaNStaysInItsRow) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  Site s = MakeSite(rng, 40, 4, 4096);
  const int64_t bad = 33;  // in the second row tile of the dots kernel
  s.streams[bad * s.flat() + 5000] = kNaN;
  DeviceSite d(s);
  FusedBuffers fused(s);
  ASSERT_EQ(fused.Run(s, d, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Outputs got = fused.Download();
  EXPECT_TRUE(fused.GuardsIntact());
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.hidden; ++c) {
      const float v = got.collapsed[r * s.hidden + c];
      ASSERT_EQ(std::isnan(v), r == bad) << "row " << r << " column " << c;
    }
    for (int64_t j = 0; j < s.hc; ++j) {
      ASSERT_EQ(std::isnan(got.post[r * s.hc + j]), r == bad) << "row " << r;
    }
  }
  // The composition makes the same NaNs (and the same finite comb of a NaN row: the softmax's
  // max ignores NaN), and the other rows match it.
  ExpectClose(got, Unfused(s, d), "NaN row");
}

// Two eager runs, and graph replays with and without programmatic launches, give the same bits.
TEST(CudaHyperConnectionFusedTest, DeterministicAndGraphReplayMatchesEager) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng = FreshRng();
  const Site s = MakeSite(rng, 32, 4, 4096);
  DeviceSite d(s);
  FusedBuffers eager(s);
  ASSERT_EQ(eager.Run(s, d, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Outputs first = eager.Download();
  ASSERT_EQ(eager.Run(s, d, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Outputs second = eager.Download();
  EXPECT_EQ(first.post, second.post);
  EXPECT_EQ(first.comb, second.comb);
  EXPECT_EQ(first.collapsed, second.collapsed);

  for (const bool programmatic : {false, true}) {
    SCOPED_TRACE(programmatic ? "programmatic" : "plain");
    FusedBuffers captured(s);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const cudaError_t launched = captured.Run(s, d, stream, programmatic);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(launched, cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int i = 0; i < 2; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const Outputs replayed = captured.Download();
    EXPECT_TRUE(captured.GuardsIntact());
    EXPECT_EQ(replayed.post, first.post);
    EXPECT_EQ(replayed.comb, first.comb);
    EXPECT_EQ(replayed.collapsed, first.collapsed);
    // Eager on the stream with programmatic launches too.
    FusedBuffers streamed(s);
    ASSERT_EQ(streamed.Run(s, d, stream, programmatic), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(streamed.Download().collapsed, first.collapsed);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

TEST(CudaHyperConnectionFusedTest, ZeroRowsWritesNothing) {
  EXPECT_EQ(
      hyper_connection_pre_fused(nullptr, 0, 4, 4096, nullptr, nullptr, nullptr, kHcEps, kIters,
                                 nullptr, kRmsEps, nullptr, 0, nullptr, nullptr, nullptr, nullptr),
      cudaSuccess);
  EXPECT_EQ(hyper_connection_pre_fused_workspace(0, 4, 4096), 0);
}

// Argument checks run before any launch, so these need no GPU.
TEST(CudaHyperConnectionFusedTest, RejectsBadArguments) {
  float dummy = 0.0f;
  float* p = &dummy;
  const int64_t need = hyper_connection_pre_fused_workspace(2, 4, 4096);
  EXPECT_EQ(need, 128 * 2 * 25);
  auto call = [&](int64_t rows, int64_t hc, int64_t hidden, int64_t workspace, float* fn) {
    return hyper_connection_pre_fused(p, rows, hc, hidden, fn, p, p, kHcEps, kIters, nullptr,
                                      kRmsEps, p, workspace, p, p, p, nullptr);
  };
  EXPECT_EQ(call(-1, 4, 4096, need, p), cudaErrorInvalidValue);
  EXPECT_EQ(call(2, 5, 4096, need, p), cudaErrorInvalidValue);
  EXPECT_EQ(call(2, 0, 4096, need, p), cudaErrorInvalidValue);
  EXPECT_EQ(call(2, 4, 0, need, p), cudaErrorInvalidValue);
  EXPECT_EQ(call(2, 4, kHcFusedMaxHidden + 1, need, p), cudaErrorInvalidValue);
  EXPECT_EQ(call(2, 4, 4096, need - 1, p), cudaErrorInvalidValue);
  EXPECT_EQ(call(2, 4, 4096, need, nullptr), cudaErrorInvalidValue);
  EXPECT_TRUE(hyper_connection_pre_fused_supports(4, 4096, 24));
  EXPECT_FALSE(hyper_connection_pre_fused_supports(4, 4096, 23));
  EXPECT_FALSE(hyper_connection_pre_fused_supports(8, 4096, 80));
}

}  // namespace
}  // namespace pdserve::kernels::cuda
