#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/indexer.cuh"
#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps, 16 keys each
constexpr int kTileKeys = 64;
constexpr int kHeads = static_cast<int>(kIndexHeads);
constexpr int kDim = static_cast<int>(kIndexHeadDim);
// Row pitch in shared memory: 8 bf16 of padding puts the 8 rows a fragment load touches on
// distinct banks.
constexpr int kPitch = kDim + 8;
constexpr int kStages = 3;  // key tiles in flight per block
constexpr size_t kSmemBytes = sizeof(__nv_bfloat16) * kPitch * (kHeads + kStages * kTileKeys);

__device__ __forceinline__ int VisibleKeys(const IndexerParams& p, int64_t b) {
  const int64_t by_position = (static_cast<int64_t>(p.positions[b]) + 1) / p.rate;
  const int64_t n = min(static_cast<int64_t>(p.n_keys[b]), by_position);
  return static_cast<int>(max(int64_t{0}, min(n, p.max_keys)));
}

// Stages keys [tile * 64, tile * 64 + 64) of request b; keys past `visible` become zeros.
__device__ __forceinline__ void LoadKeyTile(const IndexerParams& p, int64_t b, int tile,
                                            int visible, __nv_bfloat16* dst) {
  const int row = threadIdx.x >> 1;
  const int half = threadIdx.x & 1;
  const int key = tile * kTileKeys + row;
  const bool valid = key < visible;
  const __nv_bfloat16* src = p.key_pool;
  if (valid) {
    const int64_t page = p.page_table[b * p.page_table_stride + key / p.page_size];
    src = p.key_pool + (page * p.page_size + key % p.page_size) * kDim;
  }
  for (int c = 0; c < 8; ++c) {
    const int col = (half * 8 + c) * 8;
    CopyAsync16(dst + row * kPitch + col, src + col, valid);
  }
}

__global__ void __launch_bounds__(kThreads)
    IndexerScoresKernel(IndexerParams p, float* scores, int32_t* visible_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  // kStages key-tile buffers of kTileKeys rows follow q.
  __nv_bfloat16* const k_s = q_s + kHeads * kPitch;
  const int64_t b = blockIdx.y;
  const int visible = VisibleKeys(p, b);
  if (blockIdx.x == 0 && threadIdx.x == 0) visible_out[b] = visible;
  const int n_tiles = (visible + kTileKeys - 1) / kTileKeys;
  if (static_cast<int>(blockIdx.x) >= n_tiles) return;
  // This block's tiles: blockIdx.x + i * gridDim.x for i < n_local.
  const int n_local = (n_tiles - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;

  const __nv_bfloat16* q = p.q + b * kHeads * kDim;
  for (int c = threadIdx.x; c < kHeads * kDim / 8; c += kThreads) {
    const int h = c / (kDim / 8);
    const int col = (c % (kDim / 8)) * 8;
    CopyAsync16(q_s + h * kPitch + col, q + h * kDim + col, true);
  }
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n_local) {
      LoadKeyTile(p, b, blockIdx.x + i * gridDim.x, visible, k_s + i * kTileKeys * kPitch);
    }
    CopyAsyncCommit();
  }

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  // This lane's head weights: heads 8j + 2t and 8j + 2t + 1.
  float w[kHeads / 8][2];
#pragma unroll
  for (int j = 0; j < kHeads / 8; ++j) {
    w[j][0] = p.weights[b * kHeads + 8 * j + 2 * t];
    w[j][1] = p.weights[b * kHeads + 8 * j + 2 * t + 1];
  }
  float* score_row = scores + b * p.max_keys;

  // The queries stay in registers as B fragments for the whole block (128 registers), so the
  // inner loop reads only keys from shared memory.
  uint32_t qf[kHeads / 8][kDim / 16][2];
  CopyAsyncWait<kStages - 2>();
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kHeads / 8; ++j) {
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const __nv_bfloat16* qh = q_s + (8 * j + g) * kPitch + 16 * ks + 2 * t;
      qf[j][ks][0] = LoadPair(qh);
      qf[j][ks][1] = LoadPair(qh + 8);
    }
  }

  for (int it = 0; it < n_local; ++it) {
    if (it > 0) {
      CopyAsyncWait<kStages - 2>();
      __syncthreads();  // tile it is visible; every warp is done with tile it - 1
    }
    const int ahead = it + kStages - 1;
    if (ahead < n_local) {
      LoadKeyTile(p, b, blockIdx.x + ahead * gridDim.x, visible,
                  k_s + (ahead % kStages) * kTileKeys * kPitch);
    }
    CopyAsyncCommit();
    const __nv_bfloat16* keys = k_s + ((it % kStages) * kTileKeys + warp * 16) * kPitch;
    float acc[kHeads / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const int k0 = 16 * ks;
      const uint32_t a[4] = {LoadPair(keys + g * kPitch + k0 + 2 * t),
                             LoadPair(keys + (g + 8) * kPitch + k0 + 2 * t),
                             LoadPair(keys + g * kPitch + k0 + 8 + 2 * t),
                             LoadPair(keys + (g + 8) * kPitch + k0 + 8 + 2 * t)};
#pragma unroll
      for (int j = 0; j < kHeads / 8; ++j) MmaBf16(acc[j], a, qf[j][ks]);
    }
    float s0 = 0.0f;
    float s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < kHeads / 8; ++j) {
      s0 += fmaxf(acc[j][0], 0.0f) * w[j][0] + fmaxf(acc[j][1], 0.0f) * w[j][1];
      s1 += fmaxf(acc[j][2], 0.0f) * w[j][0] + fmaxf(acc[j][3], 0.0f) * w[j][1];
    }
    s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, 1);
    s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, 2);
    s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, 1);
    s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, 2);
    const int key0 = (blockIdx.x + it * gridDim.x) * kTileKeys + warp * 16 + g;
    if (t == 0 && key0 < visible) score_row[key0] = s0 * p.softmax_scale;
    if (t == 0 && key0 + 8 < visible) score_row[key0 + 8] = s1 * p.softmax_scale;
  }
}

int SmCount() {
  static const int count = [] {
    int device = 0;
    int sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return 1;
    }
    return sms;
  }();
  return count;
}

}  // namespace

cudaError_t indexer_scores(const IndexerParams& p, float* scores, int32_t* visible,
                           cudaStream_t stream) {
  if (p.batch < 0 || p.max_keys < 0 || p.page_size < 1 || p.rate < 1 || p.batch > 65535 ||
      p.max_keys > INT32_MAX - kTileKeys) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (p.q == nullptr || p.weights == nullptr || p.key_pool == nullptr || p.page_table == nullptr ||
      p.n_keys == nullptr || p.positions == nullptr || scores == nullptr || visible == nullptr ||
      p.page_table_stride * p.page_size < p.max_keys) {
    return cudaErrorInvalidValue;
  }
  static const cudaError_t attribute_status = cudaFuncSetAttribute(
      IndexerScoresKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (attribute_status != cudaSuccess) return attribute_status;
  // Fixed grid: enough blocks per request to fill the GPU about twice over, never more
  // than the tiles of the longest possible request.
  const int64_t max_tiles = std::max<int64_t>(1, (p.max_keys + kTileKeys - 1) / kTileKeys);
  const int64_t per_request = std::max<int64_t>(1, 2 * SmCount() / p.batch);
  const dim3 grid(static_cast<unsigned>(std::min(max_tiles, per_request)),
                  static_cast<unsigned>(p.batch));
  IndexerScoresKernel<<<grid, kThreads, kSmemBytes, stream>>>(p, scores, visible);
  return cudaGetLastError();
}

cudaError_t lightning_indexer(const IndexerParams& params, int64_t topk, float* scores,
                              int32_t* visible, int32_t* picks, cudaStream_t stream) {
  const cudaError_t status = indexer_scores(params, scores, visible, stream);
  if (status != cudaSuccess) return status;
  return top_k(scores, params.batch, params.max_keys, visible, topk, picks, stream);
}

}  // namespace pdserve::kernels::cuda
