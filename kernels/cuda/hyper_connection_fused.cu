#include <cstdint>

#include "kernels/cuda/grid_dependency.cuh"
#include "kernels/cuda/hyper_connection_fused.cuh"
#include "kernels/cuda/hyper_connection_math.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sinkhorn_rows.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kSlice = static_cast<int>(kHcFusedSlice);
constexpr int kDotsThreads = 256;
constexpr int kDotsWarps = kDotsThreads / 32;
constexpr int kMixThreads = 512;
constexpr int kMixWarps = kMixThreads / 32;
constexpr int kCollapseThreads = kMixThreads - 32;  // warps 1 .. kMixWarps - 1
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int Outputs(int hc) { return (2 + hc) * hc; }

// Kernel 1. The block stages its fn slice (weights: read before the grid dependency wait, so
// with programmatic launch that overlaps the previous kernel's tail), then a warp takes one row
// at a time: lane l multiplies the slice's columns l, l + 32, ... into O + 1 running sums (fused
// multiply-adds), which a butterfly over the warp totals (every lane ends with the same bits);
// lane o stores sum o.
template <int HC>
__global__ void __launch_bounds__(kDotsThreads)
    HcPreDotsKernel(const float* streams, int64_t rows, int64_t flat_dim, const float* fn,
                    float* partials) {
  constexpr int kOut = Outputs(HC);
  constexpr int kWidth = kOut + 1;
  static_assert(kWidth <= 32, "one lane stores each sum");
  __shared__ float fn_s[kOut][kSlice];
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kSlice;
  const int width = static_cast<int>(flat_dim - k0 < kSlice ? flat_dim - k0 : kSlice);
  for (int i = threadIdx.x; i < kOut * kSlice; i += kDotsThreads) {
    const int o = i / kSlice;
    const int c = i % kSlice;
    fn_s[o][c] = c < width ? fn[o * flat_dim + k0 + c] : 0.0f;
  }
  GridDependencyWait();
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t first_row = static_cast<int64_t>(blockIdx.y) * kHcFusedRowsPerBlock;
  const int64_t end_row =
      rows - first_row < kHcFusedRowsPerBlock ? rows : first_row + kHcFusedRowsPerBlock;
  // Uniform per warp: every lane runs the shuffles.
  for (int64_t r = first_row + warp; r < end_row; r += kDotsWarps) {
    const float* x = streams + r * flat_dim + k0;
    float acc[kWidth];
#pragma unroll
    for (int o = 0; o < kWidth; ++o) acc[o] = 0.0f;
#pragma unroll
    for (int i = 0; i < kSlice / 32; ++i) {
      const int c = lane + 32 * i;
      const float v = c < width ? x[c] : 0.0f;
#pragma unroll
      for (int o = 0; o < kOut; ++o) acc[o] = fmaf(v, fn_s[o][c], acc[o]);
      acc[kOut] = fmaf(v, v, acc[kOut]);
    }
    float mine = 0.0f;
#pragma unroll
    for (int o = 0; o < kWidth; ++o) {
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        acc[o] += __shfl_xor_sync(kFullMask, acc[o], offset);
      }
      if (lane == o) mine = acc[o];
    }
    if (lane < kWidth) partials[(blockIdx.x * rows + r) * kWidth + lane] = mine;
  }
  GridDependencyLaunchDependents();
}

// Warps 1 .. kMixWarps - 1 only (named barrier 1; barrier 0 is __syncthreads).
__device__ __forceinline__ void CollapseWarpsSync() {
  asm volatile("bar.sync 1, %0;\n" ::"r"(kCollapseThreads) : "memory");
}

// Kernel 2, one block per row. All warps: the partials' totals (warp w sums splits w, w +
// kMixWarps, ...; warp 0 then the warps' sums in warp order). Warp 0: mix, pre and post, then
// (while the other warps collapse) the comb logits and their Sinkhorn projection (lane j holds
// comb row j), which is the long serial part. Warps 1..: the collapse into shared memory and
// the RMSNorm, their sum of squares in fp64 over a named barrier.
template <int HC>
__global__ void __launch_bounds__(kMixThreads, 1)
    HcPreMixKernel(const float* partials, int64_t splits, const float* streams, int64_t rows,
                   int64_t hidden, const float* base, const float* scale, float hc_eps,
                   int64_t iters, const float* weight, float rms_eps, float* post, float* comb,
                   float* collapsed) {
  constexpr int kOut = Outputs(HC);
  constexpr int kWidth = kOut + 1;
  __shared__ float part_s[kMixWarps][32];
  __shared__ float mix_s[32];
  __shared__ float pre_s[HC];
  __shared__ double square_s[kMixWarps];
  extern __shared__ float collapsed_s[];  // [hidden]
  const int64_t row = blockIdx.x;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  GridDependencyWait();
  float part = 0.0f;
  if (lane < kWidth) {
    for (int64_t p = warp; p < splits; p += kMixWarps) {
      part += partials[(p * rows + row) * kWidth + lane];
    }
  }
  part_s[warp][lane] = part;
  __syncthreads();
  if (warp == 0) {
    float total = 0.0f;
    for (int w = 0; w < kMixWarps; ++w) total += part_s[w][lane];
    const float sum_sq = __shfl_sync(kFullMask, total, kOut);
    const double flat_dim = static_cast<double>(HC * hidden);
    const float inv_rms =
        1.0f / sqrtf(static_cast<float>(static_cast<double>(sum_sq) / flat_dim) + rms_eps);
    mix_s[lane] = __fmul_rn(total, inv_rms);
    __syncwarp();
    if (lane < HC) {
      pre_s[lane] = __fadd_rn(HcSigmoid(HcScaleShift(mix_s[lane], scale[0], base[lane])), hc_eps);
      post[row * HC + lane] =
          2.0f * HcSigmoid(HcScaleShift(mix_s[HC + lane], scale[1], base[HC + lane]));
    }
  }
  __syncthreads();
  if (warp == 0) {
    const bool owner = lane < HC;
    const int j = owner ? lane : 0;
    float m[HC];
#pragma unroll
    for (int c = 0; c < HC; ++c) {
      const int i = 2 * HC + j * HC + c;
      m[c] = owner ? HcScaleShift(mix_s[i], scale[2], base[i]) : 0.0f;
    }
    SinkhornRowsInRegisters<HC>(m, /*first_lane=*/0, iters, hc_eps);
    if (owner) {
#pragma unroll
      for (int c = 0; c < HC; ++c) comb[(row * HC + j) * HC + c] = m[c];
    }
    return;
  }

  const int t = threadIdx.x - 32;
  const float* s = streams + row * HC * hidden;
  double square = 0.0;
  for (int64_t c = t; c < hidden; c += kCollapseThreads) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < HC; ++j) acc = __fadd_rn(acc, __fmul_rn(pre_s[j], s[j * hidden + c]));
    collapsed_s[c] = acc;
    const double f = acc;
    square += f * f;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    square += __shfl_xor_sync(kFullMask, square, offset);
  }
  if (lane == 0) square_s[warp] = square;
  CollapseWarpsSync();
  double total_square = 0.0;
  for (int w = 1; w < kMixWarps; ++w) total_square += square_s[w];
  const float inv =
      1.0f / sqrtf(static_cast<float>(total_square / static_cast<double>(hidden)) + rms_eps);
  float* out = collapsed + row * hidden;
  for (int64_t c = t; c < hidden; c += kCollapseThreads) {
    const float normed = collapsed_s[c] * inv;
    out[c] = weight != nullptr ? weight[c] * normed : normed;
  }
}

int64_t Splits(int64_t hc, int64_t hidden) { return (hc * hidden + kSlice - 1) / kSlice; }

// cudaLaunchKernelEx with programmatic stream serialization when `programmatic`.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, int threads, size_t smem,
                         cudaStream_t stream, bool programmatic, Args... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = programmatic ? &attribute : nullptr;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <int HC>
cudaError_t Launch(const float* streams, int64_t rows, int64_t hidden, const float* fn,
                   const float* base, const float* scale, float hc_eps, int64_t iters,
                   const float* weight, float rms_eps, float* partials, float* post, float* comb,
                   float* collapsed, cudaStream_t stream, bool programmatic) {
  const int64_t splits = Splits(HC, hidden);
  const dim3 dots_grid(
      static_cast<unsigned>(splits),
      static_cast<unsigned>((rows + kHcFusedRowsPerBlock - 1) / kHcFusedRowsPerBlock));
  const int64_t flat_dim = HC * hidden;
  if (const cudaError_t e = LaunchKernel(HcPreDotsKernel<HC>, dots_grid, kDotsThreads, 0, stream,
                                         programmatic, streams, rows, flat_dim, fn, partials);
      e != cudaSuccess) {
    return e;
  }
  const size_t smem = sizeof(float) * static_cast<size_t>(hidden);
  return LaunchKernel(HcPreMixKernel<HC>, dim3(static_cast<unsigned>(rows)), kMixThreads, smem,
                      stream, programmatic, partials, splits, streams, rows, hidden, base, scale,
                      hc_eps, iters, weight, rms_eps, post, comb, collapsed);
}

}  // namespace

bool hyper_connection_pre_fused_supports(int64_t hc, int64_t hidden, int64_t outputs) {
  return hc >= 1 && hc <= kHcFusedMaxHc && hidden >= 1 && hidden <= kHcFusedMaxHidden &&
         outputs == (2 + hc) * hc;
}

int64_t hyper_connection_pre_fused_workspace(int64_t rows, int64_t hc, int64_t hidden) {
  if (rows <= 0 || !hyper_connection_pre_fused_supports(hc, hidden, (2 + hc) * hc)) return 0;
  return Splits(hc, hidden) * rows * ((2 + hc) * hc + 1);
}

cudaError_t hyper_connection_pre_fused(const float* streams, int64_t rows, int64_t hc,
                                       int64_t hidden, const float* fn, const float* base,
                                       const float* scale, float hc_eps, int64_t sinkhorn_iters,
                                       const float* norm_weight, float rms_eps, float* partials,
                                       int64_t partials_floats, float* post, float* comb,
                                       float* collapsed, cudaStream_t stream, bool programmatic) {
  constexpr const char* kLauncher = "hyper_connection_pre_fused";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hc >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hc <= kHcFusedMaxHc);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hidden >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hidden <= kHcFusedMaxHidden);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher,
                         (rows + kHcFusedRowsPerBlock - 1) / kHcFusedRowsPerBlock <= 65535);
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, streams != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, fn != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, base != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, scale != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, partials != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher,
                         partials_floats >= hyper_connection_pre_fused_workspace(rows, hc, hidden));
  PDSERVE_LAUNCH_REQUIRE(kLauncher, post != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, comb != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, collapsed != nullptr);
  switch (hc) {
    case 1:
      return Launch<1>(streams, rows, hidden, fn, base, scale, hc_eps, sinkhorn_iters, norm_weight,
                       rms_eps, partials, post, comb, collapsed, stream, programmatic);
    case 2:
      return Launch<2>(streams, rows, hidden, fn, base, scale, hc_eps, sinkhorn_iters, norm_weight,
                       rms_eps, partials, post, comb, collapsed, stream, programmatic);
    case 3:
      return Launch<3>(streams, rows, hidden, fn, base, scale, hc_eps, sinkhorn_iters, norm_weight,
                       rms_eps, partials, post, comb, collapsed, stream, programmatic);
    default:
      return Launch<4>(streams, rows, hidden, fn, base, scale, hc_eps, sinkhorn_iters, norm_weight,
                       rms_eps, partials, post, comb, collapsed, stream, programmatic);
  }
}

}  // namespace pdserve::kernels::cuda
