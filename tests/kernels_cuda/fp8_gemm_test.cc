// kernels/cuda/fp8_gemm (own kernel and the cuBLASLt path) against kernels/cpu/fp8_gemm.h's
// Fp8GemmReference: fresh random e4m3 weights, fp32 block scales and bf16 activations each run
// (seed printed; PDSERVE_TEST_SEED replays), the kernel before the reference.
#include "kernels/cuda/fp8_gemm.cuh"

#include <cublasLt.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/fp8_gemm.h"
#include "tests/kernels_cuda/block_scaled_test_util.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::CheckMaxRegisters;
using testing::FreshRng;
using testing::GuardedBuffer;

constexpr uint16_t kSentinel = 0xA5A5;  // GuardedBuffer's fill, as bf16 bits

struct DenseCase {
  int64_t m = 1;
  int64_t n = 64;
  int64_t k = 128;
  int64_t x_stride = 128;
  int64_t out_stride = 64;
  bool ue8m0 = false;
  std::vector<uint16_t> x;
  std::vector<uint8_t> w;
  std::vector<float> w_scale;
};

DenseCase MakeDense(std::mt19937_64& rng, int64_t m, int64_t n, int64_t k, bool ue8m0) {
  DenseCase c;
  c.m = m;
  c.n = n;
  c.k = k;
  c.x_stride = k + 8 * (m % 3);  // padded rows for some sizes
  c.out_stride = n + (m % 2 == 1 ? 5 : 0);
  c.ue8m0 = ue8m0;
  c.x = testing::RandomActivations(rng, m, c.x_stride);
  c.w = testing::RandomE4m3(rng, static_cast<size_t>(n * k));
  c.w_scale = testing::RandomScales(rng, static_cast<size_t>(((n + 127) / 128) * (k / 128)));
  return c;
}

// Weight blocks scaled by 2^-20 and 2^20; activation rows 0 and 1 times 2^-20 and 2^20.
DenseCase ExtremeScales(std::mt19937_64& rng) {
  DenseCase c = MakeDense(rng, 9, 256, 512, false);
  testing::MakeScalesExtreme(c);
  return c;
}

// NaN and +-Inf activations and NaN weights: whole output rows / columns become NaN.
DenseCase NonFinite(std::mt19937_64& rng) {
  DenseCase c = MakeDense(rng, 11, 136, 384, false);
  c.x[2 * c.x_stride + 5] = testing::kBf16NaN;      // row 2 all NaN
  c.x[6 * c.x_stride + 200] = 0x7F80;               // +Inf: row 6 all NaN (Inf / Inf)
  c.x[9 * c.x_stride + 383] = 0xFF80;               // -Inf
  c.w[static_cast<size_t>(17 * c.k + 130)] = 0x7F;  // NaN weight: column 17 all NaN
  c.w[static_cast<size_t>(135 * c.k + 0)] = 0xFF;   // column 135
  return c;
}

// kOwn: fp8_gemm (its dispatch), kMma / kWgmma: one path explicitly.
enum class Path { kOwn, kCublasLt, kMma, kWgmma };

const char* PathName(Path path) {
  switch (path) {
    case Path::kOwn:
      return "fp8_gemm";
    case Path::kCublasLt:
      return "fp8_gemm_cublaslt";
    case Path::kMma:
      return "fp8_gemm_mma";
    default:
      return "fp8_gemm_wgmma";
  }
}

// Runs the GPU path, then the reference, and compares (sentinels in the stride padding and the
// guard bands included). Returns the output bits (empty on a failed launch).
std::vector<uint16_t> RunAndCheck(const DenseCase& c, Path path,
                                  const Fp8WgmmaConfig& config = {}) {
  const std::string what =
      std::string(PathName(path)) + " m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
      " k=" + std::to_string(c.k) +
      (path == Path::kWgmma ? testing::WgmmaConfigLabel(config) : std::string());
  GuardedBuffer<uint16_t> x(c.x.size());
  GuardedBuffer<uint8_t> w(c.w.size());
  GuardedBuffer<float> w_scale(c.w_scale.size());
  GuardedBuffer<uint16_t> out(static_cast<size_t>(c.m * c.out_stride));
  x.Upload(c.x);
  w.Upload(c.w);
  w_scale.Upload(c.w_scale);
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.get());
  auto* op = reinterpret_cast<__nv_bfloat16*>(out.get());
  std::string refusal;
  if (path == Path::kCublasLt) {
    cublasLtHandle_t handle = nullptr;
    EXPECT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
    GuardedBuffer<uint8_t> ws(fp8_gemm_cublaslt_workspace_bytes(c.m, c.n, c.k));
    EXPECT_TRUE(ws.ok() && out.ok());
    const cudaError_t status =
        fp8_gemm_cublaslt(handle, xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, c.ue8m0,
                          op, c.out_stride, ws.get(), ws.size(), nullptr, &refusal);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status) << ": " << refusal;
    if (status != cudaSuccess) return {};
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cublasLtDestroy(handle);
  } else {
    const size_t ws_bytes = path == Path::kWgmma
                                ? fp8_gemm_wgmma_workspace_bytes(c.m, c.n, c.k, config)
                                : fp8_gemm_workspace_bytes(c.m, c.n, c.k);
    GuardedBuffer<uint8_t> ws(ws_bytes);
    EXPECT_TRUE(ws.ok() && out.ok());
    cudaError_t status = cudaSuccess;
    if (path == Path::kOwn) {
      status = fp8_gemm(xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, c.ue8m0, op,
                        c.out_stride, ws.get(), ws.size(), nullptr, &refusal);
    } else if (path == Path::kMma) {
      status = fp8_gemm_mma(xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, c.ue8m0, op,
                            c.out_stride, ws.get(), ws.size(), nullptr, &refusal);
    } else {
      status = fp8_gemm_wgmma(xp, c.m, c.k, c.x_stride, w.get(), w_scale.get(), c.n, c.ue8m0, op,
                              c.out_stride, ws.get(), ws.size(), nullptr, config, &refusal);
    }
    EXPECT_EQ(status, cudaSuccess) << what << ": " << cudaGetErrorString(status) << ": " << refusal;
    if (status != cudaSuccess) return {};
    const cudaError_t sync = cudaDeviceSynchronize();
    EXPECT_EQ(sync, cudaSuccess) << what << ": " << cudaGetErrorString(sync);
    if (sync != cudaSuccess) return {};
    EXPECT_TRUE(ws.GuardsIntact()) << what;
  }
  const std::vector<uint16_t> got = out.Download();
  EXPECT_TRUE(out.GuardsIntact()) << what;

  std::vector<float> want(static_cast<size_t>(c.m * c.n));
  const std::vector<float> xf = testing::ToFloatsBf16(c.x);
  cpu::Fp8GemmReference(xf.data(), c.m, c.k, c.x_stride, c.w.data(), c.w_scale.data(), c.n, c.ue8m0,
                        want.data());
  testing::ExpectBf16Rows(got, c.m, c.n, c.out_stride, want, {}, kSentinel, what);
  return got;
}

TEST(CudaFp8GemmTest, OddTokenCountsAndShapes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // n = 200 and 72: partial 64-row tiles and a partial 128-row scale block; k = 1024 with small n
  // splits k over blocks (the reduction path), n = 2048 does not.
  for (int64_t m : {1, 3, 8, 13, 33, 77, 130}) {
    RunAndCheck(MakeDense(rng, m, 200, 384, m % 2 == 0), Path::kOwn);
    RunAndCheck(MakeDense(rng, m, 72, 1024, false), Path::kOwn);
  }
  RunAndCheck(MakeDense(rng, 5, 2048, 256, true), Path::kOwn);
  RunAndCheck(MakeDense(rng, 64, 2048, 256, false), Path::kOwn);
  // Prefill-sized m with n a multiple of 16 but not of 128 (the bundled model's kv_proj, n = 64).
  for (int64_t m : {33, 64, 300}) {
    RunAndCheck(MakeDense(rng, m, 64, 256, false), Path::kOwn);
    RunAndCheck(MakeDense(rng, m, 192, 256, true), Path::kOwn);
  }
}

TEST(CudaFp8GemmTest, ExtremeScalesAndMagnitudes) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  DenseCase c = ExtremeScales(rng);
  RunAndCheck(c, Path::kOwn);
  c.ue8m0 = true;
  RunAndCheck(c, Path::kOwn);
}

TEST(CudaFp8GemmTest, NanAndInfPropagateToTheSamePositions) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  RunAndCheck(NonFinite(rng), Path::kOwn);
  RunAndCheck(NonFinite(rng), Path::kMma);
}

// fp8_gemm_wgmma: every token tile (N = 8..128, the instantiation picked by m) and odd token
// counts, n = 200 (a partial 64-row tile and a partial 128-row scale block), k = 384 (3 k blocks:
// fewer than the ring's stages, not a multiple of them), without and with a k split.
TEST(CudaFp8GemmTest, WgmmaEveryTokenTileAndOddCounts) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig whole{2, 4, 0};
  const Fp8WgmmaConfig split{2, 4, 4096};
  std::vector<int64_t> counts = {1, 3, 17, 100, 127};
  for (int64_t m = 8; m <= 128; m += 8) counts.push_back(m);
  for (int64_t m : counts) {
    const DenseCase c = MakeDense(rng, m, 200, 384, m % 3 == 0);
    ASSERT_EQ(fp8_gemm_wgmma_splits(c.m, c.n, c.k, whole), 1);
    RunAndCheck(c, Path::kWgmma, whole);
    ASSERT_EQ(fp8_gemm_wgmma_splits(c.m, c.n, c.k, split), 3);  // one k block per split
    RunAndCheck(c, Path::kWgmma, split);
  }
}

// Tile and ring variants (the bench's sweep), k = 1280 (10 k blocks: wraps every ring size,
// never a multiple of 4 or 6), token tiles past 128 (m = 130, 300: three tiles, a partial last).
TEST(CudaFp8GemmTest, WgmmaConfigsAndTokenTiles) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const Fp8WgmmaConfig config :
       {Fp8WgmmaConfig{1, 2, 0}, Fp8WgmmaConfig{1, 3, 264}, Fp8WgmmaConfig{2, 6, 132},
        Fp8WgmmaConfig{2, 8, 528}, Fp8WgmmaConfig{1, 8, 0}}) {
    for (int64_t m : {5, 64, 130})
      RunAndCheck(MakeDense(rng, m, 136, 1280, false), Path::kWgmma, config);
  }
  RunAndCheck(MakeDense(rng, 300, 320, 512, true), Path::kWgmma, Fp8WgmmaConfig{2, 4, 264});
}

// The split-k sums are added in a fixed order: two runs give the same bits.
TEST(CudaFp8GemmTest, WgmmaSplitKIsDeterministic) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const DenseCase c = MakeDense(rng, 24, 256, 2048, false);
  const Fp8WgmmaConfig config{2, 4, 264};
  ASSERT_GT(fp8_gemm_wgmma_splits(c.m, c.n, c.k, config), 1);
  const std::vector<uint16_t> first = RunAndCheck(c, Path::kWgmma, config);
  const std::vector<uint16_t> second = RunAndCheck(c, Path::kWgmma, config);
  ASSERT_FALSE(first.empty());
  EXPECT_EQ(first, second);
}

TEST(CudaFp8GemmTest, WgmmaExtremeScalesAndNonFinite) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  DenseCase c = ExtremeScales(rng);
  for (const Fp8WgmmaConfig config : {Fp8WgmmaConfig{2, 4, 0}, Fp8WgmmaConfig{1, 4, 264}}) {
    RunAndCheck(c, Path::kWgmma, config);
    c.ue8m0 = !c.ue8m0;
    RunAndCheck(c, Path::kWgmma, config);
  }
  const DenseCase d = NonFinite(rng);
  RunAndCheck(d, Path::kWgmma, Fp8WgmmaConfig{2, 4, 0});
  RunAndCheck(d, Path::kWgmma, Fp8WgmmaConfig{2, 4, 4096});
}

// cluster_reduce: the k splits of a tile reduced in-kernel through distributed shared memory give
// the same bits as the two-kernel reduction with the same splits (n = 200: partial row tiles; 2,
// 4 and 8 splits; m = 128 and 130, token tiles past 64, ignore the flag and must still match), and
// match the reference.
TEST(CudaFp8GemmTest, WgmmaClusterReduceEqualsTwoPassBitForBit) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  struct Case {
    int wgs;
    int target;
    int64_t m;
    int32_t splits;
  };
  // Tiles: ceil(m / 128) token tiles x ceil(200 / (64 wgs)) row tiles; splits = round(target /
  // tiles), at most 8 (k = 1024: 8 k blocks).
  for (const Case& t :
       {Case{1, 16, 1, 4}, Case{1, 32, 7, 8}, Case{1, 16, 130, 2}, Case{2, 8, 33, 4},
        Case{2, 32, 128, 8}, Case{2, 16, 130, 4}, Case{1, 8, 64, 2}}) {
    const DenseCase c = MakeDense(rng, t.m, 200, 1024, t.m % 2 == 0);
    const Fp8WgmmaConfig two_pass{t.wgs, 4, t.target, false};
    const Fp8WgmmaConfig cluster{t.wgs, 4, t.target, true};
    ASSERT_EQ(fp8_gemm_wgmma_splits(c.m, c.n, c.k, two_pass), t.splits) << "m=" << t.m;
    ASSERT_EQ(fp8_gemm_wgmma_splits(c.m, c.n, c.k, cluster), t.splits) << "m=" << t.m;
    if (t.m <= 64) {  // token tiles past 64 ignore the flag
      EXPECT_LT(fp8_gemm_wgmma_workspace_bytes(c.m, c.n, c.k, cluster),
                fp8_gemm_wgmma_workspace_bytes(c.m, c.n, c.k, two_pass));
    }
    const std::vector<uint16_t> first = RunAndCheck(c, Path::kWgmma, two_pass);
    const std::vector<uint16_t> second = RunAndCheck(c, Path::kWgmma, cluster);
    ASSERT_FALSE(first.empty());
    EXPECT_EQ(first, second) << "m=" << t.m << " wgs=" << t.wgs;
  }
}

// cluster_reduce caps the splits at kFp8WgmmaClusterSplits (k = 2560: 20 k blocks, 16 splits
// asked for), rounds them down to a power of two (12 / 4 tiles: 3 -> 2; k = 640: 5 k blocks,
// uneven per split) and keeps extreme scales and NaN / Inf positions as the reference has them.
TEST(CudaFp8GemmTest, WgmmaClusterReduceCapsSplitsAndKeepsNonFinite) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig cluster{1, 4, 64, true};
  const DenseCase big_k = MakeDense(rng, 5, 200, 2560, false);
  ASSERT_EQ(fp8_gemm_wgmma_splits(big_k.m, big_k.n, big_k.k, cluster), kFp8WgmmaClusterSplits);
  RunAndCheck(big_k, Path::kWgmma, cluster);
  const DenseCase odd = MakeDense(rng, 3, 200, 640, true);
  ASSERT_EQ(fp8_gemm_wgmma_splits(odd.m, odd.n, odd.k, Fp8WgmmaConfig{1, 4, 12, true}), 2);
  RunAndCheck(odd, Path::kWgmma, Fp8WgmmaConfig{1, 4, 12, true});
  DenseCase c = ExtremeScales(rng);
  ASSERT_GT(fp8_gemm_wgmma_splits(c.m, c.n, c.k, cluster), 1);
  RunAndCheck(c, Path::kWgmma, cluster);
  c.ue8m0 = !c.ue8m0;
  RunAndCheck(c, Path::kWgmma, cluster);
  const DenseCase d = NonFinite(rng);
  ASSERT_GT(fp8_gemm_wgmma_splits(d.m, d.n, d.k, cluster), 1);
  RunAndCheck(d, Path::kWgmma, cluster);
  RunAndCheck(d, Path::kWgmma, Fp8WgmmaConfig{2, 4, 4096, true});
}

// smem_scales (the split's scales staged in shared memory) gives the same bits as reading the
// scales per k block: token tiles of 8..64 (128 and 130, two tiles, ignore the flag), 10 k blocks
// unevenly split, with and without cluster_reduce; extreme scales and NaN / Inf too.
TEST(CudaFp8GemmTest, WgmmaSmemScalesEqualPerBlockScales) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const Fp8WgmmaConfig config :
       {Fp8WgmmaConfig{1, 4, 0, false, true}, Fp8WgmmaConfig{2, 4, 264, true, true, true},
        Fp8WgmmaConfig{1, 3, 4096, false, true, true}}) {
    Fp8WgmmaConfig plain = config;
    plain.smem_scales = false;
    for (int64_t m : {1, 17, 64, 128, 130}) {
      const DenseCase c = MakeDense(rng, m, 200, 1280, m % 2 == 1);
      const std::vector<uint16_t> first = RunAndCheck(c, Path::kWgmma, plain);
      const std::vector<uint16_t> second = RunAndCheck(c, Path::kWgmma, config);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, second) << "m=" << m << " wgs=" << config.warpgroups;
    }
  }
  DenseCase e = ExtremeScales(rng);
  RunAndCheck(e, Path::kWgmma, Fp8WgmmaConfig{1, 4, 264, true, true});
  e.ue8m0 = !e.ue8m0;
  RunAndCheck(e, Path::kWgmma, Fp8WgmmaConfig{2, 4, 0, false, true});
  RunAndCheck(NonFinite(rng), Path::kWgmma, Fp8WgmmaConfig{1, 4, 264, true, true});
}

// two_in_flight gives the bits of one k block at a time (token tiles 8..64, odd counts; 72 and
// 130 ignore the flag; 1, 2, 3 and 10 k blocks unevenly split; 2 stages; smem scales or not; with
// alternate turns too); alternate_turns (ignored past 64 tokens for W8A8) is deterministic and
// matches the reference; both with extreme scales (ue8m0 too) and NaN / Inf.
TEST(CudaFp8GemmTest, WgmmaTwoInFlightAndAlternateTurns) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (Fp8WgmmaConfig config :
       {Fp8WgmmaConfig{1, 4, 0, false, true}, Fp8WgmmaConfig{0, 2, 264, false, false},
        Fp8WgmmaConfig{1, 3, 4096, false, true, false, true}}) {
    for (int64_t k : {128, 256, 384, 1280}) {
      for (int64_t m : {1, 3, 8, 17, 33, 64, 72, 130}) {
        const DenseCase c = MakeDense(rng, m, 200, k, m % 2 == 1);
        config.two_in_flight = false;
        const std::vector<uint16_t> first = RunAndCheck(c, Path::kWgmma, config);
        config.two_in_flight = true;
        const std::vector<uint16_t> second = RunAndCheck(c, Path::kWgmma, config);
        ASSERT_FALSE(first.empty());
        EXPECT_EQ(first, second) << "m=" << m << " k=" << k << " stages=" << config.stages;
      }
    }
  }
  const Fp8WgmmaConfig alternate{0, 0, 264, false, true, false, true};
  for (int64_t k : {128, 1280}) {
    for (int64_t m : {1, 9, 40, 64, 100, 130}) {
      const DenseCase c = MakeDense(rng, m, 200, k, m % 2 == 0);
      const std::vector<uint16_t> first = RunAndCheck(c, Path::kWgmma, alternate);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, RunAndCheck(c, Path::kWgmma, alternate)) << "m=" << m << " k=" << k;
    }
  }
  for (const Fp8WgmmaConfig config :
       {alternate, Fp8WgmmaConfig{0, 4, 264, false, true, false, false, true}}) {
    DenseCase e = ExtremeScales(rng);
    RunAndCheck(e, Path::kWgmma, config);
    e.ue8m0 = !e.ue8m0;
    RunAndCheck(e, Path::kWgmma, config);
    RunAndCheck(NonFinite(rng), Path::kWgmma, config);
  }
}

// The wgmma path with `config` at k = 128, 384, 1280 (1, 3, 10 k blocks) and each token count
// of `tokens` (n weight rows): against the reference and two runs the same bits; then extreme
// scales (ue8m0 too) and NaN / Inf.
void SweepWgmmaOption(std::mt19937_64& rng, const Fp8WgmmaConfig& config,
                      std::initializer_list<int64_t> tokens, int64_t n) {
  for (int64_t k : {128, 384, 1280}) {
    for (int64_t m : tokens) {
      const DenseCase c = MakeDense(rng, m, n, k, m % 2 == 1);
      const std::vector<uint16_t> first = RunAndCheck(c, Path::kWgmma, config);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, RunAndCheck(c, Path::kWgmma, config)) << "m=" << m << " k=" << k;
    }
  }
  DenseCase e = ExtremeScales(rng);
  RunAndCheck(e, Path::kWgmma, config);
  e.ue8m0 = !e.ue8m0;
  RunAndCheck(e, Path::kWgmma, config);
  RunAndCheck(NonFinite(rng), Path::kWgmma, config);
}

// split_tokens (two consumer warpgroups per block on one weight box, each half of the block's
// tokens): token counts 1 (ignored), 9..130 odd and even (tiles of 2 x 8 .. 2 x 64, the second
// group partly or wholly past m), 1, 3 and 10 k blocks, with and without a k split, smem scales
// or not, two blocks in flight, 2 and 3 stages, 2 warpgroups and cluster_reduce asked for (taken
// as 1 and off): against the reference and two runs the same bits; extreme scales (ue8m0 too)
// and NaN / Inf.
TEST(CudaFp8GemmTest, WgmmaSplitTokens) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const Fp8WgmmaConfig configs[] = {{0, 0, 264, false, true, true, false, false, true},
                                    {1, 4, 0, false, false, false, false, false, true},
                                    {2, 3, 4096, true, true, true, false, true, true},
                                    {0, 2, 132, false, true, true, false, true, true}};
  for (const Fp8WgmmaConfig& config : configs) {
    SweepWgmmaOption(rng, config, {1, 9, 16, 17, 33, 64, 65, 100, 128, 130}, 200);
  }
}

// max_registers (the kernel built with at most 96 / 128 registers a thread): CheckMaxRegisters
// (block_scaled_test_util.h: the capped builds' bits equal the uncapped build's, and the capped
// build ran where the plan takes it); then extreme scales and NaN / Inf with each cap.
TEST(CudaFp8GemmTest, WgmmaMaxRegisters) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  CheckMaxRegisters(false, [&](int64_t m, int64_t k, const std::vector<Fp8WgmmaConfig>& configs) {
    const DenseCase c = MakeDense(rng, m, 200, k, m % 2 == 1);
    std::vector<std::vector<uint16_t>> outs;
    for (const Fp8WgmmaConfig& config : configs)
      outs.push_back(RunAndCheck(c, Path::kWgmma, config));
    return outs;
  });
  for (const int cap : {96, 128}) {
    Fp8WgmmaConfig capped = kFp8WgmmaDecodeConfig;
    capped.max_registers = cap;
    DenseCase e = ExtremeScales(rng);
    RunAndCheck(e, Path::kWgmma, capped);
    e.ue8m0 = !e.ue8m0;
    RunAndCheck(e, Path::kWgmma, capped);
    RunAndCheck(NonFinite(rng), Path::kWgmma, capped);
  }
}

// multicast_activations (clusters of two row tiles loading each activation box once): 256 and
// 700 weight rows (4 and 11 row tiles: the odd count runs without), token counts whose block
// tiles are and are not a multiple of 16, with split_tokens (and tiles wholly past m), stagger_k,
// two blocks in flight, a k split or not: against the reference and two runs the same bits;
// extreme scales and NaN / Inf.
TEST(CudaFp8GemmTest, WgmmaMulticastActivations) {
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
// blocks (offsets 0..9, with and without a k split), token tiles 8..128 and odd counts, with smem
// scales or not, two blocks in flight, alternate turns and split_tokens: against the reference
// and two runs the same bits; extreme scales (ue8m0 too) and NaN / Inf.
TEST(CudaFp8GemmTest, WgmmaStaggerK) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  Fp8WgmmaConfig configs[] = {{0, 0, 264, false, true, true},
                              {1, 4, 0, false, false},
                              {0, 4, 4096, false, true, true, false, true},
                              {0, 4, 264, false, true, true, true},
                              {0, 3, 264, false, true, true, false, false, true}};
  for (Fp8WgmmaConfig& config : configs) {
    config.stagger_k = true;
    SweepWgmmaOption(rng, config, {1, 9, 33, 64, 100, 130}, 300);
  }
}

// fp8_gemm picks mma.sync up to kFp8MmaMaxTokens tokens and the wgmma path above; fp8_gemm_w8a16
// mma.sync up to kW8a16MmaMaxTokens and wgmma above (unless PDSERVE_FP8_GEMM forces one);
// cuBLASLt's output through fp8_gemm matches, and the mma.sync path stays correct on its own.
// fp8_gemm_mma's k splits (2, 4, 8 at k = 512, 1024, 2048 with 4 row tiles; summed by the reduce
// kernel): two runs give the same bits, every token count of a tile (1..32, 33 = two items)
// matches the reference, and extreme scales and NaN / Inf keep their positions.
TEST(CudaFp8GemmTest, MmaSplitKIsDeterministic) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (int64_t k : {512, 1024, 2048}) {
    for (int64_t m : {1, 7, 8, 13, 33}) {
      const DenseCase c = MakeDense(rng, m, 200, k, m % 2 == 0);
      const std::vector<uint16_t> first = RunAndCheck(c, Path::kMma);
      const std::vector<uint16_t> second = RunAndCheck(c, Path::kMma);
      ASSERT_FALSE(first.empty());
      EXPECT_EQ(first, second) << "m=" << m << " k=" << k;
    }
  }
  DenseCase e = ExtremeScales(rng);
  RunAndCheck(e, Path::kMma);
  e.ue8m0 = !e.ue8m0;
  RunAndCheck(e, Path::kMma);
  RunAndCheck(NonFinite(rng), Path::kMma);
}

TEST(CudaFp8GemmTest, DispatchAndMmaPath) {
  PDSERVE_SKIP_WITHOUT_GPU();
  if (std::getenv("PDSERVE_FP8_GEMM") == nullptr) {
    EXPECT_EQ(fp8_gemm_path(1), Fp8GemmPath::kMma);
    EXPECT_EQ(fp8_gemm_path(kFp8MmaMaxTokens), Fp8GemmPath::kMma);
    EXPECT_EQ(fp8_gemm_path(kFp8MmaMaxTokens + 1), Fp8GemmPath::kWgmma);
    EXPECT_EQ(fp8_gemm_path(kFp8LtMinTokens - 1), Fp8GemmPath::kWgmma);
    EXPECT_EQ(fp8_gemm_path(kFp8LtMinTokens), Fp8GemmPath::kCublasLt);
    EXPECT_EQ(fp8_gemm_path(4096), Fp8GemmPath::kCublasLt);
    EXPECT_EQ(fp8_gemm_w8a16_path(1), Fp8GemmPath::kMma);
    EXPECT_EQ(fp8_gemm_w8a16_path(kW8a16MmaMaxTokens), Fp8GemmPath::kMma);
    EXPECT_EQ(fp8_gemm_w8a16_path(kW8a16MmaMaxTokens + 1), Fp8GemmPath::kWgmma);
    EXPECT_EQ(fp8_gemm_w8a16_path(4096), Fp8GemmPath::kWgmma);
  }
  EXPECT_GE(fp8_gemm_workspace_bytes(100, 4096, 2048),
            fp8_gemm_wgmma_workspace_bytes(100, 4096, 2048, fp8_gemm_wgmma_default_config()));
  auto rng = FreshRng();
  DenseCase lt = MakeDense(rng, 256, 384, 512, false);
  lt.out_stride = lt.n + 8;  // cuBLASLt's requirements hold
  RunAndCheck(lt, Path::kOwn);
  // Through the dispatch at cuBLASLt's sizes: k / 128 of 2 (padded weight scales), m not a
  // multiple of 4 (mma.sync tail), n not a multiple of 128 (the wgmma path instead).
  for (int64_t m : {64, 77, 130}) {
    RunAndCheck(MakeDense(rng, m, 2048, 256, false), Path::kOwn);
    RunAndCheck(MakeDense(rng, m, 200, 256, false), Path::kOwn);
  }
  EXPECT_GE(fp8_gemm_workspace_bytes(100, 4096, 2048),
            fp8_gemm_cublaslt_workspace_bytes(100, 4096, 2048));
  for (int64_t m : {1, 13, 77}) RunAndCheck(MakeDense(rng, m, 200, 384, false), Path::kMma);
}

TEST(CudaFp8GemmTest, WgmmaRefusesASmallWorkspace) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(4096);
  GuardedBuffer<uint8_t> w(4096);
  GuardedBuffer<float> s(16);
  GuardedBuffer<uint16_t> out(4096);
  GuardedBuffer<uint8_t> ws(1 << 12);
  std::string refusal;
  const cudaError_t status =
      fp8_gemm_wgmma(reinterpret_cast<const __nv_bfloat16*>(x.get()), 16, 128, 128, w.get(),
                     s.get(), 16, false, reinterpret_cast<__nv_bfloat16*>(out.get()), 16, ws.get(),
                     64, nullptr, Fp8WgmmaConfig{}, &refusal);
  EXPECT_EQ(status, cudaErrorInvalidValue);
  EXPECT_NE(refusal.find("workspace_bytes:"), std::string::npos) << refusal;
}

TEST(CudaFp8GemmTest, CublasLtMatchesReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // Token counts that are and are not multiples of 4 (the last m % 4 rows go through mma.sync;
  // 1 and 2 tokens only through it), k / 128 of 4 (DeepSeek's scales as they are) and of 2 and
  // 3 (padded copies: unpadded, m = 64 x n = 2048 x k = 256 was wrong on the H200, 2026-12-04).
  for (int64_t m : {1, 4, 16, 77, 80, 256}) {
    DenseCase c = MakeDense(rng, m, 384, 512, m == 80);
    c.out_stride = c.n + 8;  // multiple of 8, columns past n untouched
    RunAndCheck(c, Path::kCublasLt);
  }
  for (int64_t k : {256, 384}) {
    for (int64_t m : {64, 130}) {
      DenseCase c = MakeDense(rng, m, 2048, k, false);
      c.out_stride = c.n;
      RunAndCheck(c, Path::kCublasLt);
    }
  }
}

TEST(CudaFp8GemmTest, CublasLtWithoutAnAlgorithmSaysSo) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  DenseCase c = MakeDense(rng, 1, 256, 256, false);
  c.out_stride = c.n;  // a multiple of 8, so only cuBLASLt can refuse
  GuardedBuffer<uint16_t> x(c.x.size());
  GuardedBuffer<uint8_t> w(c.w.size());
  GuardedBuffer<float> w_scale(c.w_scale.size());
  GuardedBuffer<uint16_t> out(static_cast<size_t>(c.m * c.out_stride));
  GuardedBuffer<uint8_t> ws(fp8_gemm_cublaslt_workspace_bytes(c.m, c.n, c.k));
  cublasLtHandle_t handle = nullptr;
  ASSERT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
  std::string refusal;
  const cudaError_t status = fp8_gemm_cublaslt(
      handle, reinterpret_cast<const __nv_bfloat16*>(x.get()), c.m, c.k, c.x_stride, w.get(),
      w_scale.get(), c.n, false, reinterpret_cast<__nv_bfloat16*>(out.get()), c.out_stride,
      ws.get(), ws.size(), nullptr, &refusal);
  cublasLtDestroy(handle);
  // Either cuBLASLt runs it (a newer library) or the refusal names the cuBLASLt step.
  if (status != cudaSuccess) {
    EXPECT_EQ(status, cudaErrorNotSupported);
    EXPECT_NE(refusal.find("cuBLASLt heuristic"), std::string::npos) << refusal;
  }
}

TEST(CudaFp8GemmTest, RefusalsNameTheArgument) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<uint16_t> x(4096);
  GuardedBuffer<uint8_t> w(4096);
  GuardedBuffer<float> s(16);
  GuardedBuffer<uint16_t> out(4096);
  GuardedBuffer<uint8_t> ws(1 << 20);
  const auto* xp = reinterpret_cast<const __nv_bfloat16*>(x.get());
  auto* op = reinterpret_cast<__nv_bfloat16*>(out.get());
  const auto refusal_of = [&](int64_t m, int64_t k, int64_t x_stride, const uint8_t* wp, int64_t n,
                              size_t ws_bytes) {
    std::string refusal;
    const cudaError_t status = fp8_gemm(xp, m, k, x_stride, wp, s.get(), n, false, op, n, ws.get(),
                                        ws_bytes, nullptr, &refusal);
    EXPECT_EQ(status, cudaErrorInvalidValue);
    return refusal;
  };
  const size_t all = ws.size();
  EXPECT_NE(refusal_of(2, 100, 128, w.get(), 16, all).find("k:"), std::string::npos);
  EXPECT_NE(refusal_of(2, 128, 120, w.get(), 16, all).find("x_stride:"), std::string::npos);
  EXPECT_NE(refusal_of(-1, 128, 128, w.get(), 16, all).find("m:"), std::string::npos);
  EXPECT_NE(refusal_of(2, 128, 128, nullptr, 16, all).find("w:"), std::string::npos);
  EXPECT_NE(refusal_of(2, 128, 128, w.get(), 16, 8).find("workspace_bytes:"), std::string::npos);
  EXPECT_NE(refusal_of(int64_t{1} << 20, 128, int64_t{1} << 50, w.get(), 16, all).find("2^62"),
            std::string::npos);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
