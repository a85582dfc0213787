#include <cstdint>

#include "kernels/cuda/hyper_connection.cuh"
#include "kernels/cuda/hyper_connection_math.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sinkhorn.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // hidden columns per block

// One block per (row, chunk of kThreads hidden columns): the row's pre weights go to shared
// memory, then each thread collapses one column over the hc streams in index order. With MIXING
// (hyper_connection_pre) the chunk-0 block also writes the row's post weights and comb logits.
template <bool MIXING>
__global__ void __launch_bounds__(kThreads)
    CollapseKernel(const float* mix, int64_t mix_stride, const float* streams, int hc,
                   int64_t hidden, int64_t chunks, const float* base, const float* scale, float eps,
                   float* post, float* comb, float* collapsed) {
  __shared__ float pre[kMaxSinkhornN];
  const int64_t row = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x % chunks;
  const float* m = mix + row * mix_stride;
  if (static_cast<int>(threadIdx.x) < hc) {
    const int j = threadIdx.x;
    pre[j] = __fadd_rn(HcSigmoid(HcScaleShift(m[j], scale[0], base[j])), eps);
  }
  if constexpr (MIXING) {
    if (chunk == 0) {
      if (static_cast<int>(threadIdx.x) < hc) {
        const int j = threadIdx.x;
        post[row * hc + j] = 2.0f * HcSigmoid(HcScaleShift(m[hc + j], scale[1], base[hc + j]));
      }
      for (int i = threadIdx.x; i < hc * hc; i += kThreads) {
        comb[row * hc * hc + i] = HcScaleShift(m[2 * hc + i], scale[2], base[2 * hc + i]);
      }
    }
  }
  __syncthreads();
  const int64_t c = chunk * kThreads + threadIdx.x;
  if (c >= hidden) return;
  const float* s = streams + row * hc * hidden + c;
  float acc = 0.0f;
  for (int j = 0; j < hc; ++j) acc = __fadd_rn(acc, __fmul_rn(pre[j], s[j * hidden]));
  collapsed[row * hidden + c] = acc;
}

// One block per (row, chunk of kThreads hidden columns). Each thread first copies its column's
// old stream values to its own slice of shared memory (reads before any write of the token), then
// writes the new values, summing over j in index order.
__global__ void __launch_bounds__(kThreads)
    PostKernel(const float* post, const float* comb, const float* y, int hc, int64_t hidden,
               int64_t chunks, float* streams) {
  extern __shared__ float smem[];
  float* comb_s = smem;              // [hc, hc]
  float* post_s = comb_s + hc * hc;  // [hc]
  float* old = post_s + hc;          // [hc, kThreads]
  const int64_t row = blockIdx.x / chunks;
  const int64_t chunk = blockIdx.x % chunks;
  for (int i = threadIdx.x; i < hc * hc; i += kThreads) comb_s[i] = comb[row * hc * hc + i];
  if (static_cast<int>(threadIdx.x) < hc) post_s[threadIdx.x] = post[row * hc + threadIdx.x];
  const int64_t c = chunk * kThreads + threadIdx.x;
  const bool active = c < hidden;
  float* s = streams + row * hc * hidden + c;
  if (active) {
    for (int j = 0; j < hc; ++j) old[j * kThreads + threadIdx.x] = s[j * hidden];
  }
  __syncthreads();
  if (!active) return;
  const float yc = y[row * hidden + c];
  for (int k = 0; k < hc; ++k) {
    float o = __fmul_rn(post_s[k], yc);
    for (int j = 0; j < hc; ++j) {
      o = __fadd_rn(o, __fmul_rn(comb_s[j * hc + k], old[j * kThreads + threadIdx.x]));
    }
    s[k * hidden] = o;
  }
}

// Shape checks shared by the three entry points; sets *blocks to rows * ceil(hidden / kThreads)
// (at least one chunk per row).
// cudaSuccess with the grid's chunks per row and blocks, or `launcher`'s refusal.
cudaError_t CheckShape(const char* launcher, int64_t rows, int64_t hc, int64_t hidden,
                       int64_t* chunks, int64_t* blocks) {
  PDSERVE_LAUNCH_REQUIRE(launcher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(launcher, hidden >= 0);
  PDSERVE_LAUNCH_REQUIRE(launcher, hc >= 1);
  PDSERVE_LAUNCH_REQUIRE(launcher, hc <= kMaxSinkhornN);
  PDSERVE_LAUNCH_REQUIRE(launcher, hidden <= (int64_t{1} << 62) / hc);
  PDSERVE_LAUNCH_REQUIRE(launcher, hidden == 0 || rows <= (int64_t{1} << 62) / (hc * hidden));
  *chunks = hidden == 0 ? 1 : (hidden + kThreads - 1) / kThreads;
  PDSERVE_LAUNCH_REQUIRE(launcher, rows <= INT32_MAX / *chunks);
  *blocks = rows * *chunks;
  return cudaSuccess;
}

cudaError_t Collapse(const float* mix, int64_t mix_stride, const float* streams, int64_t hc,
                     int64_t hidden, int64_t chunks, int64_t blocks, const float* base,
                     const float* scale, float eps, float* post, float* comb, float* collapsed,
                     cudaStream_t stream) {
  const bool mixing = post != nullptr;
  if (mixing) {
    CollapseKernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        mix, mix_stride, streams, static_cast<int>(hc), hidden, chunks, base, scale, eps, post,
        comb, collapsed);
  } else {
    CollapseKernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        mix, mix_stride, streams, static_cast<int>(hc), hidden, chunks, base, scale, eps, post,
        comb, collapsed);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t hyper_connection_pre(const float* mix, const float* streams, int64_t rows, int64_t hc,
                                 int64_t hidden, const float* base, const float* scale, float eps,
                                 int64_t sinkhorn_iters, float* post, float* comb, float* collapsed,
                                 cudaStream_t stream) {
  int64_t chunks = 0;
  int64_t blocks = 0;
  constexpr const char* kLauncher = "hyper_connection_pre";
  if (const cudaError_t e = CheckShape(kLauncher, rows, hc, hidden, &chunks, &blocks); e) return e;
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, mix != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, streams != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, base != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, scale != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, post != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, comb != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, collapsed != nullptr);
  const cudaError_t status = Collapse(mix, (2 + hc) * hc, streams, hc, hidden, chunks, blocks, base,
                                      scale, eps, post, comb, collapsed, stream);
  if (status != cudaSuccess) return status;
  return sinkhorn_project(comb, rows, hc, sinkhorn_iters, eps, stream);
}

cudaError_t hyper_connection_post(const float* post, const float* comb, const float* y,
                                  int64_t rows, int64_t hc, int64_t hidden, float* streams,
                                  cudaStream_t stream) {
  int64_t chunks = 0;
  int64_t blocks = 0;
  constexpr const char* kLauncher = "hyper_connection_post";
  if (const cudaError_t e = CheckShape(kLauncher, rows, hc, hidden, &chunks, &blocks); e) return e;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, post != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, comb != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, y != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, streams != nullptr);
  const size_t smem = sizeof(float) * static_cast<size_t>(hc * hc + hc + hc * kThreads);
  PostKernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
      post, comb, y, static_cast<int>(hc), hidden, chunks, streams);
  return cudaGetLastError();
}

cudaError_t hyper_head(const float* mix, const float* streams, int64_t rows, int64_t hc,
                       int64_t hidden, const float* base, const float* scale, float eps, float* out,
                       cudaStream_t stream) {
  int64_t chunks = 0;
  int64_t blocks = 0;
  constexpr const char* kLauncher = "hyper_head";
  if (const cudaError_t e = CheckShape(kLauncher, rows, hc, hidden, &chunks, &blocks); e) return e;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, mix != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, streams != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, base != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, scale != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, out != nullptr);
  return Collapse(mix, hc, streams, hc, hidden, chunks, blocks, base, scale, eps, nullptr, nullptr,
                  out, stream);
}

}  // namespace pdserve::kernels::cuda
