#include <cuda_fp8.h>

#include <cstring>

#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/swiglu_math.cuh"
#include "kernels/env_switch.h"

namespace pdserve::kernels::cuda {
namespace {

namespace bs = block_scaled;

// One CUDA block: kTileRows rows x one 128-column block; 16 half-warps, each two rows (r0 + h and
// r0 + h + 16), each thread 8 columns of both.
constexpr int kThreads = 256;
constexpr int kTileRows = 32;
constexpr int kHalfWarps = kThreads / 16;
constexpr int kPerThread = 8;

// Sources: Load(r, c, v) puts the 8 bf16 values of row r, columns c..c+7 (as floats) in v and,
// where the source has a bf16 copy to write, writes it.
struct Bf16Source {
  const __nv_bfloat16* x;
  int64_t stride;
  __device__ __forceinline__ void Load(int64_t r, int64_t c, float* v) const {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + r * stride + c);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(words[i] << 16);
      v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
    }
  }
};

// v (fp32, 8 values) -> bf16 (nearest even) in place; stores the 8 bf16 at y when not null.
__device__ __forceinline__ void RoundToBf16(float* v, __nv_bfloat16* y) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat16 lo = __float2bfloat16_rn(v[2 * i]);
    const __nv_bfloat16 hi = __float2bfloat16_rn(v[2 * i + 1]);
    v[2 * i] = __bfloat162float(lo);
    v[2 * i + 1] = __bfloat162float(hi);
    uint16_t lo_bits;
    uint16_t hi_bits;
    memcpy(&lo_bits, &lo, sizeof(lo_bits));
    memcpy(&hi_bits, &hi, sizeof(hi_bits));
    words[i] = static_cast<uint32_t>(lo_bits) | (static_cast<uint32_t>(hi_bits) << 16);
  }
  if (y != nullptr)
    *reinterpret_cast<uint4*>(y) = make_uint4(words[0], words[1], words[2], words[3]);
}

__device__ __forceinline__ void Load8(const float* p, float* v) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

struct F32Source {
  const float* x;
  int64_t stride;
  __nv_bfloat16* y;
  int64_t y_stride;
  __device__ __forceinline__ void Load(int64_t r, int64_t c, float* v) const {
    Load8(x + r * stride + c, v);
    RoundToBf16(v, y != nullptr ? y + r * y_stride + c : nullptr);
  }
};

struct SwiGluSource {
  const float* gate;
  const float* up;
  int64_t stride;
  float limit;
  __nv_bfloat16* y;
  int64_t y_stride;
  __device__ __forceinline__ void Load(int64_t r, int64_t c, float* v) const {
    float u[kPerThread];
    Load8(gate + r * stride + c, v);
    Load8(up + r * stride + c, u);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) v[i] = ClampedSwiGluValue(v[i], u[i], limit);
    RoundToBf16(v, y != nullptr ? y + r * y_stride + c : nullptr);
  }
};

// act_quant of kTileRows rows x one 128-column block (blockIdx.x: row tile, blockIdx.y: block).
// Every lane runs the shuffles (rows past the end take amax 0 and store nothing).
template <typename Source>
__global__ void __launch_bounds__(kThreads)
    ActQuantVectorKernel(Source src, int64_t rows, bool ue8m0, uint8_t* xq, float* xs,
                         ActScaleLayout layout, ActGroups groups) {
  bs::GridDependencyTrigger();  // the GEMM may start streaming its weights now
  bs::GridDependencyWait();     // xq / xs may still be read by the kernel before
  // Column group g = blocks [g * kbg, (g + 1) * kbg), quantized as a [rows, group_cols] matrix of
  // its own at xq + g * group_bytes, its scales at xs + g * group_scales.
  const int64_t kbg = groups.cols / kActQuantBlock;
  const int64_t g = blockIdx.y / kbg;
  const int64_t b = blockIdx.y - g * kbg;
  const int half = threadIdx.x / 16;
  const int sub = threadIdx.x % 16;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kActQuantBlock + kPerThread * sub;
  uint8_t* group_q = xq + g * groups.bytes + b * kActQuantBlock + kPerThread * sub;
  float* group_s = xs + g * groups.scales;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileRows + half;
  float v[2][kPerThread];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int64_t r = r0 + u * kHalfWarps;
    if (r < rows) {
      src.Load(r, c, v[u]);
    } else {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) v[u][i] = 0.0f;
    }
  }
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int64_t r = r0 + u * kHalfWarps;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) amax = fmaxf(amax, fabsf(v[u][i]));
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
    }
    amax = fmaxf(amax, 1e-4f);
    float s = amax / 448.0f;
    if (ue8m0) s = bs::RoundUpToPowerOfTwo(s);
    // With ue8m0, s is a power of two (or Inf) and 1 / s exact, so v * (1 / s) == v / s; the
    // branch is uniform (one path per launch).
    float scaled[kPerThread];
    if (ue8m0) {
      const float inv = 1.0f / s;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) scaled[i] = v[u][i] * inv;
    } else {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) scaled[i] = v[u][i] / s;
    }
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int p = 0; p < kPerThread / 2; ++p) {
      // Element 2p in the low byte (cvt.rn.satfinite.e4m3x2.f32 takes x.x into the low half).
      const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(
          make_float2(scaled[2 * p], scaled[2 * p + 1]), __NV_SATFINITE, __NV_E4M3);
      packed[p / 2] |= static_cast<uint32_t>(q) << (16 * (p % 2));
    }
    if (r < rows) {
      *reinterpret_cast<uint2*>(group_q + r * groups.cols) = make_uint2(packed[0], packed[1]);
      if (sub == 0) group_s[ActScaleIndex(r, b, rows, kbg, layout)] = s;
    }
  }
}

// groups.cols of 0: one group of k columns.
template <typename Source>
cudaError_t LaunchVector(const Source& src, int64_t rows, int64_t k, bool ue8m0, uint8_t* xq,
                         float* xs, ActScaleLayout layout, cudaStream_t stream,
                         ActGroups groups = {}) {
  if (groups.cols == 0) groups = ActGroups{k, 0, 0};
  const dim3 grid(static_cast<unsigned>((rows + kTileRows - 1) / kTileRows),
                  static_cast<unsigned>(k / kActQuantBlock));
  return bs::LaunchDependent(ActQuantVectorKernel<Source>, grid, dim3(kThreads), stream, src, rows,
                             ue8m0, xq, xs, layout, groups);
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The checks every launcher shares (rows, k, the input stride, the outputs).
#define PDSERVE_ACT_QUANT_COMMON(launcher, k, in_stride)                    \
  PDSERVE_LAUNCH_REQUIRE(launcher, rows >= 0);                              \
  PDSERVE_LAUNCH_REQUIRE(launcher, k > 0 && k % kActQuantBlock == 0);       \
  PDSERVE_LAUNCH_REQUIRE(launcher, in_stride >= k);                         \
  PDSERVE_LAUNCH_REQUIRE(launcher, k / kActQuantBlock <= 65535);            \
  PDSERVE_LAUNCH_REQUIRE(launcher, rows <= (int64_t{1} << 62) / in_stride); \
  if (rows == 0) return cudaSuccess;                                        \
  PDSERVE_LAUNCH_REQUIRE(launcher, xq != nullptr && Aligned(xq, 8));        \
  PDSERVE_LAUNCH_REQUIRE(launcher, xs != nullptr && Aligned(xs, 4))

cudaError_t CheckBf16Copy(const char* launcher, const __nv_bfloat16* y, int64_t y_stride,
                          int64_t k) {
  if (y == nullptr) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(launcher, Aligned(y, 16));
  PDSERVE_LAUNCH_REQUIRE(launcher, y_stride >= k && y_stride % 8 == 0);
  return cudaSuccess;
}

}  // namespace

ActQuantVariant act_quant_default_variant() {
  static const ActQuantVariant variant =
      ReadSwitch("PDSERVE_ACT_QUANT",
                 {{"vectorized", ActQuantVariant::kHalfWarpVectorized},
                  {"warp", ActQuantVariant::kWarpPerBlock}},
                 ActQuantVariant::kHalfWarpVectorized, "the default (the vectorized kernel)");
  return variant;
}

cudaError_t act_quant(const __nv_bfloat16* x, int64_t rows, int64_t k, int64_t x_stride, bool ue8m0,
                      uint8_t* xq, float* xs, ActScaleLayout layout, ActQuantVariant variant,
                      cudaStream_t stream) {
  constexpr const char* kLauncher = "act_quant";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, k > 0 && k % kActQuantBlock == 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, x_stride >= k);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, k / kActQuantBlock <= 65535);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= (int64_t{1} << 62) / x_stride);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows < (int64_t{1} << 31));
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, x != nullptr && xq != nullptr && xs != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, Aligned(xs, 4));
  if (variant == ActQuantVariant::kHalfWarpVectorized) {
    PDSERVE_LAUNCH_REQUIRE(kLauncher, Aligned(x, 16) && x_stride % 8 == 0);
    PDSERVE_LAUNCH_REQUIRE(kLauncher, Aligned(xq, 8));
    return LaunchVector(Bf16Source{x, x_stride}, rows, k, ue8m0, xq, xs, layout, stream);
  }
  PDSERVE_LAUNCH_REQUIRE(kLauncher, Aligned(x, 8) && x_stride % 4 == 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, Aligned(xq, 4));
  // The warp kernel writes [k / 128, its rows]: kGemmSplit is two launches, m4 rows then the rest.
  const int64_t m4 = layout == ActScaleLayout::kGemmSplit ? (rows & ~int64_t{3}) : rows;
  if (m4 > 0) {
    const cudaError_t status = bs::LaunchActQuantWarp(x, m4, k, x_stride, ue8m0, xq, xs, stream);
    if (status != cudaSuccess || m4 == rows) return status;
  }
  return bs::LaunchActQuantWarp(x + m4 * x_stride, rows - m4, k, x_stride, ue8m0, xq + m4 * k,
                                xs + m4 * (k / kActQuantBlock), stream);
}

cudaError_t act_quant_f32(const float* x, int64_t rows, int64_t k, int64_t x_stride, bool ue8m0,
                          __nv_bfloat16* y, int64_t y_stride, uint8_t* xq, float* xs,
                          ActScaleLayout layout, cudaStream_t stream, int64_t group_cols) {
  constexpr const char* kLauncher = "act_quant_f32";
  PDSERVE_ACT_QUANT_COMMON(kLauncher, k, x_stride);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, x != nullptr && Aligned(x, 16) && x_stride % 4 == 0);
  if (group_cols == 0) group_cols = k;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, group_cols % kActQuantBlock == 0 && k % group_cols == 0);
  const cudaError_t copy = CheckBf16Copy(kLauncher, y, y_stride, k);
  if (copy != cudaSuccess) return copy;
  const ActGroups groups{group_cols, ActGroupBytes(rows, group_cols),
                         ActGroupScales(rows, group_cols)};
  return LaunchVector(F32Source{x, x_stride, y, y_stride}, rows, k, ue8m0, xq, xs, layout, stream,
                      groups);
}

cudaError_t clamped_swiglu_act_quant(const float* gate, const float* up, int64_t rows, int64_t cols,
                                     int64_t in_stride, float limit, bool ue8m0, __nv_bfloat16* y,
                                     int64_t y_stride, uint8_t* xq, float* xs,
                                     ActScaleLayout layout, cudaStream_t stream) {
  constexpr const char* kLauncher = "clamped_swiglu_act_quant";
  PDSERVE_ACT_QUANT_COMMON(kLauncher, cols, in_stride);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, gate != nullptr && Aligned(gate, 16));
  PDSERVE_LAUNCH_REQUIRE(kLauncher, up != nullptr && Aligned(up, 16));
  PDSERVE_LAUNCH_REQUIRE(kLauncher, in_stride % 4 == 0);
  const cudaError_t copy = CheckBf16Copy(kLauncher, y, y_stride, cols);
  if (copy != cudaSuccess) return copy;
  return LaunchVector(SwiGluSource{gate, up, in_stride, limit, y, y_stride}, rows, cols, ue8m0, xq,
                      xs, layout, stream);
}

#undef PDSERVE_ACT_QUANT_COMMON

}  // namespace pdserve::kernels::cuda
