#include <algorithm>
#include <cstdint>

#include "kernels/cuda/indexer_generic.cuh"
#include "kernels/cuda/launch_check.h"

namespace pdserve::kernels::cuda {
namespace {

// A block scores one row against a tile of kTileKeys keys. Each thread owns a 4-head x 4-key
// register tile (keys kg, kg + 16, kg + 32, kg + 48 of the tile, so the 8 threads of a 16-byte
// shared-memory phase read 8 different keys); head groups beyond the block's threads loop.
constexpr int kTileKeys = 64;
constexpr int kKeyGroups = kTileKeys / 4;
constexpr int kMaxThreads = 256;
constexpr int kMaxHeadGroupsPerPass = kMaxThreads / kKeyGroups;
// contrib row pitch: heads 4 apart (the two head groups of a warp) land 16 banks apart.
constexpr int kContribPitch = kTileKeys + 4;
constexpr size_t kMaxSmemBytes = 200 * 1024;

struct Shape {
  int heads;
  int head_dim;
  int head_groups;  // ceil(heads / 4)
  int dim_padded;   // head_dim rounded up to 4 (zeros past head_dim)
  int key_pitch;    // dim_padded, plus 4 when dim_padded / 4 is even: rows 16 bytes x odd apart
};

Shape MakeShape(int64_t heads, int64_t head_dim) {
  Shape s{};
  s.heads = static_cast<int>(heads);
  s.head_dim = static_cast<int>(head_dim);
  s.head_groups = static_cast<int>((heads + 3) / 4);
  s.dim_padded = static_cast<int>((head_dim + 3) / 4 * 4);
  s.key_pitch = s.dim_padded % 8 == 0 ? s.dim_padded + 4 : s.dim_padded;
  return s;
}

size_t SmemFloats(const Shape& s) {
  return static_cast<size_t>(4 * s.head_groups) * s.dim_padded +
         static_cast<size_t>(kTileKeys) * s.key_pitch +
         static_cast<size_t>(s.heads) * kContribPitch;
}

__device__ __forceinline__ void Fma4(float (&acc)[4][4], const float4 (&qv)[4],
                                     const float4 (&kv)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = fmaf(qv[i].x, kv[j].x, acc[i][j]);
      acc[i][j] = fmaf(qv[i].y, kv[j].y, acc[i][j]);
      acc[i][j] = fmaf(qv[i].z, kv[j].z, acc[i][j]);
      acc[i][j] = fmaf(qv[i].w, kv[j].w, acc[i][j]);
    }
  }
}

__global__ void __launch_bounds__(kMaxThreads)
    IndexerScoresGenericKernel(const float* q, const float* head_weights, int64_t rows, Shape sh,
                               const __nv_bfloat16* keys, int64_t key_capacity,
                               const int32_t* slot_of_row, const int32_t* position_of_row,
                               int64_t rate, float score_scale, int64_t max_keys, float* scores,
                               int32_t* visible_out, EntryPages pages) {
  extern __shared__ float4 smem4[];
  float* q_s = reinterpret_cast<float*>(smem4);           // [4 * head_groups, dim_padded]
  float* k_s = q_s + 4 * sh.head_groups * sh.dim_padded;  // [kTileKeys, key_pitch]
  float* contrib = k_s + kTileKeys * sh.key_pitch;        // [heads, kContribPitch]
  const int tid = threadIdx.x;
  const int kg = tid % kKeyGroups;
  const int tile_start = blockIdx.x * kTileKeys;

  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t by_position = (static_cast<int64_t>(position_of_row[row]) + 1) / rate;
    const int visible =
        static_cast<int>(max(int64_t{0}, min(by_position, min(key_capacity, max_keys))));
    if (blockIdx.x == 0 && tid == 0) visible_out[row] = visible;
    if (tile_start >= visible) continue;  // uniform over the block

    const float* qr = q + row * sh.heads * sh.head_dim;
    for (int e = tid; e < 4 * sh.head_groups * sh.dim_padded; e += blockDim.x) {
      const int h = e / sh.dim_padded;
      const int d = e % sh.dim_padded;
      q_s[e] = h < sh.heads && d < sh.head_dim ? qr[h * sh.head_dim + d] : 0.0f;
    }
    const int64_t slot = slot_of_row[row];
    for (int e = tid; e < kTileKeys * sh.dim_padded; e += blockDim.x) {
      const int key = e / sh.dim_padded;
      const int d = e % sh.dim_padded;
      const bool valid = tile_start + key < visible && d < sh.head_dim;
      k_s[key * sh.key_pitch + d] =
          valid ? __bfloat162float(
                      keys[EntryRow(pages, slot, key_capacity, tile_start + key) * sh.head_dim + d])
                : 0.0f;
    }
    __syncthreads();

    for (int hg = tid / kKeyGroups; hg < sh.head_groups; hg += blockDim.x / kKeyGroups) {
      float acc[4][4] = {};
      const float* qh = q_s + 4 * hg * sh.dim_padded;
      const float* kk = k_s + kg * sh.key_pitch;
      for (int d = 0; d < sh.dim_padded; d += 4) {
        float4 qv[4];
        float4 kv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          qv[i] = *reinterpret_cast<const float4*>(qh + i * sh.dim_padded + d);
          kv[i] = *reinterpret_cast<const float4*>(kk + i * kKeyGroups * sh.key_pitch + d);
        }
        Fma4(acc, qv, kv);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = 4 * hg + i;
        if (h >= sh.heads) break;
        const float w = head_weights[row * sh.heads + h];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float dot = acc[i][j];
          const float relu = dot < 0.0f ? 0.0f : dot;  // std::max(dot, 0.0f): NaN stays NaN
          contrib[h * kContribPitch + kg + j * kKeyGroups] =
              __fmul_rn(__fmul_rn(relu, score_scale), w);
        }
      }
    }
    __syncthreads();

    for (int key = tid; key < kTileKeys && tile_start + key < visible; key += blockDim.x) {
      float score = 0.0f;
      for (int h = 0; h < sh.heads; ++h) score = __fadd_rn(score, contrib[h * kContribPitch + key]);
      scores[row * max_keys + tile_start + key] = score;
    }
    __syncthreads();  // the next row's loads overwrite q_s, k_s and contrib
  }
}

}  // namespace

cudaError_t indexer_scores_generic(const float* q, const float* head_weights, int64_t rows,
                                   int64_t heads, int64_t head_dim, const __nv_bfloat16* keys,
                                   int64_t key_capacity, const int32_t* slot_of_row,
                                   const int32_t* position_of_row, int64_t rate, float score_scale,
                                   int64_t max_keys, float* scores, int32_t* visible,
                                   cudaStream_t stream, EntryPages key_pages) {
  constexpr const char* kLauncher = "indexer_scores_generic";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, heads >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, head_dim >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, key_capacity >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rate >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, max_keys >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, max_keys <= INT32_MAX - kTileKeys);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, heads <= 4096);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, head_dim <= 4096);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, EntryPagesValid(key_pages, key_capacity));
  const Shape shape = MakeShape(heads, head_dim);
  const size_t smem_bytes = sizeof(float) * SmemFloats(shape);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, smem_bytes <= kMaxSmemBytes);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= (int64_t{1} << 62) / (heads * head_dim + max_keys));
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, q != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, head_weights != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, keys != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, slot_of_row != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, position_of_row != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, scores != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, visible != nullptr);
  const cudaError_t attribute_status = SetMaxDynamicSharedMemory(
      reinterpret_cast<const void*>(IndexerScoresGenericKernel), static_cast<int>(kMaxSmemBytes));
  if (attribute_status != cudaSuccess) return attribute_status;
  // Threads: 16 per head group up to 16 groups, whole warps.
  const int threads =
      (kKeyGroups * std::min(shape.head_groups, kMaxHeadGroupsPerPass) + 31) / 32 * 32;
  // One block column per key tile of the longest possible row (at least one, so that visible is
  // written when max_keys is 0); rows past the grid's y limit loop.
  const int64_t tiles = std::max<int64_t>(1, (max_keys + kTileKeys - 1) / kTileKeys);
  const dim3 grid(static_cast<unsigned>(tiles),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  IndexerScoresGenericKernel<<<grid, threads, smem_bytes, stream>>>(
      q, head_weights, rows, shape, keys, key_capacity, slot_of_row, position_of_row, rate,
      score_scale, max_keys, scores, visible, key_pages);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
