#include <cmath>
#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sink_attention.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr size_t kMaxSharedBytes = 200 * 1024;

// The row attended as key j of query row `r` (window keys first, then compressed slots), or
// nullptr when key j is not attended.
__device__ __forceinline__ const __nv_bfloat16* KeyRow(const SinkAttentionParams& p, int64_t r,
                                                       int64_t j, int64_t t, int64_t slot) {
  if (j < p.window) {
    const int64_t pos = t - p.window + 1 + j;
    if (pos < 0) return nullptr;
    const int64_t first = p.first_position[r];
    if (pos >= first) return p.new_kv + (p.first_row[r] + pos - first) * p.head_dim;
    return p.window_ring + (slot * p.window + pos % p.window) * p.head_dim;
  }
  if (p.entries == nullptr) return nullptr;
  const int64_t c = j - p.window;
  const int64_t e = p.indices != nullptr ? p.indices[r * p.compressed_slots + c] : c;
  const int64_t visible = min(p.entry_capacity, (t + 1) / p.rate);
  if (e < 0 || e >= visible) return nullptr;
  return p.entries + EntryRow(p.entry_pages, slot, p.entry_capacity, e) * p.head_dim;
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

// One block per (row, head): scores of every key into shared memory, softmax with the sink, then
// each thread accumulates its output channels over the attended keys in key order.
__global__ void __launch_bounds__(kThreads)
    SinkAttentionKernel(SinkAttentionParams p, int64_t n_keys, float* out) {
  extern __shared__ unsigned char smem[];
  const __nv_bfloat16** key_rows = reinterpret_cast<const __nv_bfloat16**>(smem);
  float* scores = reinterpret_cast<float*>(key_rows + n_keys);
  float* q = scores + n_keys;
  __shared__ float reduce[kWarps];

  const int64_t r = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t t = p.position_of_row[r];
  const int64_t slot = p.slot_of_row[r];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const float* q_row = p.q + (r * p.heads + h) * p.head_dim;
  for (int64_t d = threadIdx.x; d < p.head_dim; d += kThreads) q[d] = q_row[d];
  __syncthreads();

  float local_max = -INFINITY;
  for (int64_t j = warp; j < n_keys; j += kWarps) {
    const __nv_bfloat16* row = KeyRow(p, r, j, t, slot);
    float s = -INFINITY;
    if (row != nullptr) {
      float dot = 0.0f;
      for (int64_t d = lane; d < p.head_dim; d += 32) dot += q[d] * __bfloat162float(row[d]);
      s = WarpSum(dot) * p.softmax_scale;
    }
    if (lane == 0) {
      key_rows[j] = row;
      scores[j] = s;
    }
    local_max = fmaxf(local_max, s);
  }
  local_max = WarpMax(local_max);
  if (lane == 0) reduce[warp] = local_max;
  __syncthreads();
  const float sink = p.sinks[h];
  float max_value = sink;
  for (int w = 0; w < kWarps; ++w) max_value = fmaxf(max_value, reduce[w]);
  __syncthreads();

  float local_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < n_keys; j += kThreads) {
    const float e = key_rows[j] != nullptr ? expf(scores[j] - max_value) : 0.0f;
    scores[j] = e;
    local_sum += e;
  }
  local_sum = WarpSum(local_sum);
  if (lane == 0) reduce[warp] = local_sum;
  __syncthreads();
  float denom = expf(sink - max_value);
  for (int w = 0; w < kWarps; ++w) denom += reduce[w];
  const float inv = 1.0f / denom;

  float* out_row = out + (r * p.heads + h) * p.head_dim;
  for (int64_t d = threadIdx.x; d < p.head_dim; d += kThreads) {
    float acc = 0.0f;
    for (int64_t j = 0; j < n_keys; ++j) {
      const __nv_bfloat16* row = key_rows[j];
      if (row != nullptr) acc += scores[j] * __bfloat162float(row[d]);
    }
    out_row[d] = acc * inv;
  }
}

}  // namespace

cudaError_t sink_attention(const SinkAttentionParams& p, float* out, cudaStream_t stream) {
  constexpr const char* kLauncher = "sink_attention";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.heads > 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.head_dim > 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.head_dim <= 1024);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.window > 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.compressed_slots >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rate > 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.entries == nullptr || p.entry_capacity >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, EntryPagesValid(p.entry_pages, p.entry_capacity));
  if (p.rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.q != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.slot_of_row != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.position_of_row != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.first_position != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.first_row != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.new_kv != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.window_ring != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.sinks != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, out != nullptr);
  const int64_t n_keys = p.window + (p.entries != nullptr ? p.compressed_slots : 0);
  const size_t shared = static_cast<size_t>(n_keys) * (sizeof(void*) + sizeof(float)) +
                        static_cast<size_t>(p.head_dim) * sizeof(float);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, shared <= kMaxSharedBytes);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rows <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.heads <= 65535);
  const cudaError_t attr = cudaFuncSetAttribute(
      SinkAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
  if (attr != cudaSuccess) return attr;
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.heads));
  SinkAttentionKernel<<<grid, kThreads, shared, stream>>>(p, n_keys, out);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
