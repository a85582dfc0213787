#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kDim = static_cast<int>(kSparseHeadDim);
constexpr int kHeads = static_cast<int>(kSparseHeadsPerBlock);
constexpr int kTile = static_cast<int>(kSparseTile);
// 8 warps: warp w owns heads 16 * (w % 4) .. +15 and output dims 256 * (w / 4) .. +255. Each
// warp computes the scores of its heads over its half of the dims; the two halves are summed
// through shared memory, so both warps of a head group see identical scores.
constexpr int kThreads = 256;
constexpr int kHalf = kDim / 2;
constexpr int kPitch = kDim + 8;  // bf16; 16 bytes of padding keep fragment loads conflict-free
constexpr float kLog2e = 1.4426950408889634f;
// Tiles in flight per block: enough bytes in flight to cover memory latency at one block per SM.
constexpr int kStages = 4;

struct Smem {
  __nv_bfloat16 q[kHeads * kPitch];
  __nv_bfloat16 rows[kStages][kTile * kPitch];
  float exchange[2][4][16][32];  // [dim half][head group][accumulator value][lane]
  int valid[kStages][kTile];
};

// Number of list entries of request b (window rows first, then compressed slots).
__device__ __forceinline__ void EntryCounts(const SparseDecodeParams& p, int64_t b, int* window,
                                            int* total) {
  const int w = static_cast<int>(min(max(int64_t{p.window_len[b]}, int64_t{0}), p.window_size));
  int64_t compressed = p.compressed_slots;
  if (p.indices == nullptr) {
    compressed = min(max(int64_t{p.n_compressed[b]}, int64_t{0}), p.compressed_slots);
  }
  *window = w;
  *total = w + static_cast<int>(compressed);
}

// Stages list entries [first, first + kTile) of request b into `dst`; entries that are not
// attended become zero rows and valid = 0.
__device__ __forceinline__ void LoadRows(const SparseDecodeParams& p, int64_t b, int first, int end,
                                         int window, __nv_bfloat16* dst, int* valid) {
  const int row = threadIdx.x >> 3;
  const int part = threadIdx.x & 7;
  const int e = first + row;
  const __nv_bfloat16* src = p.kv_pool;
  bool ok = false;
  if (e < end && e < window) {
    src = p.window_pool + (p.window_page[b] * p.window_size + e) * kDim;
    ok = true;
  } else if (e < end) {
    const int slot = e - window;
    const int64_t c = p.indices == nullptr ? slot : p.indices[b * p.compressed_slots + slot];
    if (c >= 0 && c < p.n_compressed[b]) {
      const int64_t page = p.page_table[b * p.page_table_stride + c / p.page_size];
      src = p.kv_pool + (page * p.page_size + c % p.page_size) * kDim;
      ok = true;
    }
  }
  for (int i = 0; i < 8; ++i) {
    const int col = (part + 8 * i) * 8;
    CopyAsync16(dst + row * kPitch + col, src + col, ok);
  }
  if (part == 0) valid[row] = ok;
}

__global__ void __launch_bounds__(kThreads, 1)
    SparseDecodeSplitKernel(SparseDecodeParams p, float* part_out, float* part_max, float* part_sum,
                            __nv_bfloat16* out_final) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int split = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int head0 = blockIdx.z * kHeads;
  int window = 0;
  int total = 0;
  EntryCounts(p, b, &window, &total);
  const int begin = split * static_cast<int>(p.entries_per_split);
  // Splits past the request's entries write nothing: the combine kernel ignores them. Split 0
  // always runs so that a single-split launch still writes zeros for an empty request.
  if (split > 0 && begin >= total) return;
  const int end = min(total, begin + static_cast<int>(p.entries_per_split));
  const int n_tiles = (end - begin + kTile - 1) / kTile;

  const __nv_bfloat16* q = p.q + (b * p.heads + head0) * kDim;
  for (int c = threadIdx.x; c < kHeads * kDim / 8; c += kThreads) {
    const int h = c / (kDim / 8);
    const int col = (c % (kDim / 8)) * 8;
    CopyAsync16(s.q + h * kPitch + col, q + h * kDim + col, true);
  }
  // Pipeline: tiles it + 1 .. it + kStages - 1 are in flight while tile it is computed.
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n_tiles) LoadRows(p, b, begin + i * kTile, end, window, s.rows[i], s.valid[i]);
    CopyAsyncCommit();
  }

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int group = warp & 3;
  const int half = warp >> 2;
  const int g = lane >> 2;
  const int t = lane & 3;
  const __nv_bfloat16* q0 = s.q + (16 * group + g) * kPitch;
  const __nv_bfloat16* q1 = q0 + 8 * kPitch;
  const float scale = p.softmax_scale * kLog2e;

  float out[kHalf / 8][4] = {};
  float running_max[2] = {-INFINITY, -INFINITY};
  float running_sum[2] = {0.0f, 0.0f};
  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it % kStages;
    CopyAsyncWait<kStages - 2>();
    __syncthreads();  // tile it is visible; every warp is done with tile it - 1
    const int ahead = it + kStages - 1;
    if (ahead < n_tiles) {
      const int slot = ahead % kStages;
      LoadRows(p, b, begin + ahead * kTile, end, window, s.rows[slot], s.valid[slot]);
    }
    CopyAsyncCommit();
    const __nv_bfloat16* rows = s.rows[buf];

    float score[kTile / 8][4] = {};
    for (int k0 = half * kHalf; k0 < (half + 1) * kHalf; k0 += 16) {
      const uint32_t a[4] = {LoadPair(q0 + k0 + 2 * t), LoadPair(q1 + k0 + 2 * t),
                             LoadPair(q0 + k0 + 8 + 2 * t), LoadPair(q1 + k0 + 8 + 2 * t)};
      for (int j = 0; j < kTile / 8; ++j) {
        const __nv_bfloat16* r = rows + (8 * j + g) * kPitch + k0 + 2 * t;
        const uint32_t bk[2] = {LoadPair(r), LoadPair(r + 8)};
        MmaBf16(score[j], a, bk);
      }
    }
    for (int j = 0; j < kTile / 8; ++j) {
      for (int c = 0; c < 4; ++c) s.exchange[half][group][4 * j + c][lane] = score[j][c];
    }
    __syncthreads();

    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int j = 0; j < kTile / 8; ++j) {
      for (int c = 0; c < 4; ++c) {
        const float full = score[j][c] + s.exchange[half ^ 1][group][4 * j + c][lane];
        const bool ok = s.valid[buf][8 * j + 2 * t + (c & 1)] != 0;
        score[j][c] = ok ? full * scale : -INFINITY;
        tile_max[c >> 1] = fmaxf(tile_max[c >> 1], score[j][c]);
      }
    }
    float alpha[2];
    float base[2];
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 2));
      const float new_max = fmaxf(running_max[r], tile_max[r]);
      // With nothing visible yet the maximum is -inf; subtracting 0 keeps exp2 at 0, not NaN.
      base[r] = new_max == -INFINITY ? 0.0f : new_max;
      alpha[r] = exp2f(running_max[r] - base[r]);
      running_max[r] = new_max;
      running_sum[r] *= alpha[r];
    }
    for (int j = 0; j < kTile / 8; ++j) {
      for (int c = 0; c < 4; ++c) {
        score[j][c] = exp2f(score[j][c] - base[c >> 1]);
        running_sum[c >> 1] += score[j][c];
      }
    }
    for (int n = 0; n < kHalf / 8; ++n) {
      out[n][0] *= alpha[0];
      out[n][1] *= alpha[0];
      out[n][2] *= alpha[1];
      out[n][3] *= alpha[1];
    }
    for (int kk = 0; kk < kTile / 16; ++kk) {
      const uint32_t a[4] = {PackBf16(score[2 * kk][0], score[2 * kk][1]),
                             PackBf16(score[2 * kk][2], score[2 * kk][3]),
                             PackBf16(score[2 * kk + 1][0], score[2 * kk + 1][1]),
                             PackBf16(score[2 * kk + 1][2], score[2 * kk + 1][3])};
      const __nv_bfloat16* row_ptr =
          rows + (16 * kk + (lane & 15)) * kPitch + half * kHalf + (lane >> 4) * 8;
      for (int n = 0; n < kHalf / 16; ++n) {
        uint32_t b0[2];
        uint32_t b1[2];
        LoadBTransposed(row_ptr + 16 * n, b0, b1);
        MmaBf16(out[2 * n], a, b0);
        MmaBf16(out[2 * n + 1], a, b1);
      }
    }
  }

  for (int r = 0; r < 2; ++r) {
    running_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, running_sum[r], 1);
    running_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, running_sum[r], 2);
  }
  if (gridDim.x == 1) {
    // One split: finish here (sink and normalization), no combine pass over partials.
    for (int r = 0; r < 2; ++r) {
      const int head = head0 + 16 * group + g + 8 * r;
      const float sink = p.sinks[head] * kLog2e;
      const float top = fmaxf(running_max[r], sink);
      float weight = 0.0f;
      float inv = 0.0f;
      if (top != -INFINITY) {
        weight = exp2f(running_max[r] - top);
        inv = 1.0f / (running_sum[r] * weight + exp2f(sink - top));
      }
      __nv_bfloat16* o = out_final + (b * p.heads + head) * kDim + half * kHalf + 2 * t;
      for (int n = 0; n < kHalf / 8; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(o + 8 * n) =
            __floats2bfloat162_rn(out[n][2 * r] * weight * inv, out[n][2 * r + 1] * weight * inv);
      }
    }
    return;
  }
  const int64_t splits = gridDim.x;
  const int64_t row0 = (b * splits + split) * p.heads + head0 + 16 * group + g;
  const int64_t row1 = row0 + 8;
  for (int n = 0; n < kHalf / 8; ++n) {
    const int col = half * kHalf + 8 * n + 2 * t;
    *reinterpret_cast<float2*>(part_out + row0 * kDim + col) = make_float2(out[n][0], out[n][1]);
    *reinterpret_cast<float2*>(part_out + row1 * kDim + col) = make_float2(out[n][2], out[n][3]);
  }
  if (half == 0 && t == 0) {
    part_max[row0] = running_max[0];
    part_sum[row0] = running_sum[0];
    part_max[row1] = running_max[1];
    part_sum[row1] = running_sum[1];
  }
}

// One block per (request, head): merges the splits that had entries and the sink.
__global__ void __launch_bounds__(kDim / 4)
    SparseDecodeCombineKernel(SparseDecodeParams p, int splits, const float* part_out,
                              const float* part_max, const float* part_sum, __nv_bfloat16* out) {
  const int64_t b = blockIdx.x;
  const int64_t h = blockIdx.y;
  int window = 0;
  int total = 0;
  EntryCounts(p, b, &window, &total);
  const int per_split = static_cast<int>(p.entries_per_split);
  const int active = min(splits, (total + per_split - 1) / per_split);
  const float sink = p.sinks[h] * kLog2e;  // a logit, not scaled by softmax_scale
  float top = sink;
  for (int sp = 0; sp < active; ++sp) top = fmaxf(top, part_max[(b * splits + sp) * p.heads + h]);
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float denom = 0.0f;
  if (top != -INFINITY) {
    denom = exp2f(sink - top);
    for (int sp = 0; sp < active; ++sp) {
      const int64_t row = (b * splits + sp) * p.heads + h;
      const float weight = exp2f(part_max[row] - top);
      denom += weight * part_sum[row];
      const float4 v = reinterpret_cast<const float4*>(part_out + row * kDim)[threadIdx.x];
      acc.x += weight * v.x;
      acc.y += weight * v.y;
      acc.z += weight * v.z;
      acc.w += weight * v.w;
    }
  }
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  __nv_bfloat16* o = out + (b * p.heads + h) * kDim + 4 * threadIdx.x;
  reinterpret_cast<__nv_bfloat162*>(o)[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  reinterpret_cast<__nv_bfloat162*>(o)[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
}

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

size_t PartialRows(const SparseDecodeParams& p) {
  return static_cast<size_t>(p.batch) * static_cast<size_t>(SparseDecodeSplits(p)) *
         static_cast<size_t>(p.heads);
}

}  // namespace

int64_t SparseDecodeSplits(const SparseDecodeParams& p) {
  if (p.entries_per_split <= 0) return 0;
  const int64_t entries = p.window_size + p.compressed_slots;
  return std::max<int64_t>(1, (entries + p.entries_per_split - 1) / p.entries_per_split);
}

int64_t SparseDecodeEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                    int sm_count) {
  // One block fits per multiprocessor; more splits than fill one wave only add partial traffic.
  const int64_t blocks = std::max<int64_t>(1, batch * (heads / kSparseHeadsPerBlock));
  const int64_t splits = std::max<int64_t>(1, sm_count / blocks);
  const int64_t per_split = (max_entries + splits - 1) / splits;
  return std::max<int64_t>(kTile, (per_split + kTile - 1) / kTile * kTile);
}

size_t SparseDecodeWorkspaceBytes(const SparseDecodeParams& p) {
  const size_t rows = PartialRows(p);
  return AlignUp(rows * kDim * sizeof(float)) + 2 * AlignUp(rows * sizeof(float));
}

cudaError_t sparse_decode_attention(const SparseDecodeParams& p, void* workspace,
                                    size_t workspace_bytes, __nv_bfloat16* out,
                                    cudaStream_t stream) {
  if (p.batch < 0 || p.batch > 65535 || p.heads <= 0 || p.heads % kHeads != 0 ||
      p.heads / kHeads > 65535 || p.window_size < 0 || p.compressed_slots < 0 || p.page_size < 1 ||
      p.entries_per_split <= 0 || p.entries_per_split % kTile != 0 ||
      p.window_size + p.compressed_slots > INT32_MAX / 2) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (p.q == nullptr || p.window_len == nullptr || p.n_compressed == nullptr ||
      p.sinks == nullptr || out == nullptr || workspace == nullptr ||
      workspace_bytes < SparseDecodeWorkspaceBytes(p) ||
      (p.window_size > 0 && (p.window_pool == nullptr || p.window_page == nullptr)) ||
      (p.compressed_slots > 0 && (p.kv_pool == nullptr || p.page_table == nullptr))) {
    return cudaErrorInvalidValue;
  }
  static const cudaError_t attribute_status =
      cudaFuncSetAttribute(SparseDecodeSplitKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(sizeof(Smem)));
  if (attribute_status != cudaSuccess) return attribute_status;
  const int64_t splits = SparseDecodeSplits(p);
  const size_t rows = PartialRows(p);
  auto* base = static_cast<unsigned char*>(workspace);
  auto* part_out = reinterpret_cast<float*>(base);
  auto* part_max = reinterpret_cast<float*>(base + AlignUp(rows * kDim * sizeof(float)));
  auto* part_sum = part_max + AlignUp(rows * sizeof(float)) / sizeof(float);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.heads / kHeads));
  SparseDecodeSplitKernel<<<grid, kThreads, sizeof(Smem), stream>>>(p, part_out, part_max, part_sum,
                                                                    out);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || splits == 1) return status;
  const dim3 combine_grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.heads));
  SparseDecodeCombineKernel<<<combine_grid, kDim / 4, 0, stream>>>(
      p, static_cast<int>(splits), part_out, part_max, part_sum, out);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
