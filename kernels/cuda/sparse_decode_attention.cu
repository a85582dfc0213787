#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda {
namespace {

// Design (sm_90a): one block of two warpgroups per (split, request, 64-head group). The 64 query
// heads are the M = 64 of Hopper's warpgroup MMA (wgmma), so every K/V row staged in shared memory
// is read once per warpgroup instead of once per 16-head mma.sync tile. Warpgroup w computes the
// scores over dims 256w .. 256w + 255 (S_w = Q[:, half w] K[:, half w]^T, both operands from
// shared memory); the two halves are added through shared memory (fp32, the same order in both, so
// both warpgroups hold identical scores and probabilities), and warpgroup w then accumulates
// O[:, half w] += P V[:, half w] with P from registers. Rows are staged 64 at a time, two stages
// deep, by cp.async into the 128-byte-swizzled layout wgmma reads; the row lookups (CSA index,
// page table) run two and three tiles ahead, also by cp.async, so no thread waits on them.
constexpr int kDim = static_cast<int>(kSparseHeadDim);
constexpr int kHeads = static_cast<int>(kSparseHeadsPerBlock);
constexpr int kRows = static_cast<int>(kSparseTile);  // K/V rows per tile
constexpr int kThreads = 256;
constexpr int kHalf = kDim / 2;
constexpr int kStages = 2;
constexpr float kLog2e = 1.4426950408889634f;
// A 64-row operand (Q, or a K/V tile) is 8 regions of 64 rows x 128 bytes (64 dims each); in a
// region row r starts at r * 128 and its 16-byte unit u sits at unit u ^ (r % 8) (the 128-byte
// swizzle of the wgmma shared-memory layouts, PTX ISA "Shared Memory Matrix Layout"). Regions are
// 1024-byte aligned so the swizzle pattern starts at each one.
constexpr int kRegionBytes = 64 * 128;
constexpr int kOperandBytes = 8 * kRegionBytes;  // 64 KB
constexpr int kQOffset = 0;
constexpr int kTileOffset = kOperandBytes;
constexpr int kExchangeOffset = kTileOffset + kStages * kOperandBytes;
constexpr int kExchangeBytes = 2 * 32 * 128 * 4;  // [warpgroup][accumulator][thread] fp32
constexpr int kValidOffset = kExchangeOffset + kExchangeBytes;  // [stage][row] int32
// Row lookups run ahead of the copies: the CSA index of a tile's rows three tiles ahead, their
// pool page two tiles ahead, both fetched by cp.async so no thread waits on them.
constexpr int kIndexRing = 3;
constexpr int kPageRing = 2;
constexpr int kIndexOffset = kValidOffset + kStages * kRows * 4;        // [kIndexRing][row] int32
constexpr int kPageOffset = kIndexOffset + kIndexRing * kRows * 4;      // [kPageRing][row] int32
constexpr int kSmemBytes = kPageOffset + kPageRing * kRows * 4 + 1024;  // + alignment slack
static_assert(kHeads == 64 && kDim == 512, "the layout assumes 64 heads of 512 dims");

// Byte offset of (row, 16-byte unit 0..63) inside a 64-row operand.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int unit) {
  return static_cast<uint32_t>((unit >> 3) * kRegionBytes + row * 128 +
                               (((unit & 7) ^ (row & 7)) << 4));
}

// wgmma shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets (each >> 4), layout type 1 (PTX ISA "Matrix Descriptor Format").
__device__ __forceinline__ uint64_t SmemDescriptor(uint32_t address, uint32_t leading_bytes,
                                                   uint32_t stride_bytes) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaWaitAll() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of an accumulator across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Generic-proxy writes to shared memory (cp.async, stores) before async-proxy reads (wgmma).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d[64 x 64] += A[64 x 16] * B[16 x 64] (fp32 accumulate), A and B bf16 K-major in shared
// memory, given by descriptors.
__device__ __forceinline__ void WgmmaQk(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b));
}

// d[64 x 256] += A[64 x 16] * B[16 x 256] (fp32 accumulate), A bf16 in registers (the accumulator
// layout of WgmmaQk packed to bf16 pairs), B bf16 MN-major in shared memory.
__device__ __forceinline__ void WgmmaPv(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "
      "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, "
      "%99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "
      "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, "
      "%129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ void CopyAsync16Shared(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void CopyAsync4(int* smem_dst, const int32_t* src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

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

__global__ void __launch_bounds__(kThreads, 1)
    SparseDecodeSplitKernel(SparseDecodeParams p, float* part_out, float* part_max, float* part_sum,
                            __nv_bfloat16* out_final) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  float* const exchange = reinterpret_cast<float*>(smem + kExchangeOffset);
  int* const valid = reinterpret_cast<int*>(smem + kValidOffset);

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
  const int n_tiles = max(0, (end - begin + kRows - 1) / kRows);
  const int n_compressed = p.n_compressed[b];
  const __nv_bfloat16* const window_rows =
      p.window_size > 0 ? p.window_pool + int64_t{p.window_page[b]} * p.window_size * kDim
                        : nullptr;

  const int tid = threadIdx.x;
  const int wg = tid >> 7;  // warpgroup: score dims and output dims 256 * wg ..
  const int tid_wg = tid & 127;
  const int warp_wg = tid_wg >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  // Loader role: rows row_a and row_a + 32 of each tile, 16-byte units part + 8c (8 threads
  // cover one 128-byte region row, conflict-free under the swizzle).
  const int row_a = tid >> 3;
  const int part = tid & 7;

  const __nv_bfloat16* const q = p.q + (b * p.heads + head0) * kDim;
  int* const index_ring = reinterpret_cast<int*>(smem + kIndexOffset);
  int* const page_ring = reinterpret_cast<int*>(smem + kPageOffset);
  // Lookup step 1 (threads 0..63, one tile row each): the row's compressed entry (CSA index or
  // HCA slot), -1 for window rows and rows past `end`.
  const auto fetch_index = [&](int tile) {
    if (tid >= kRows || tile >= n_tiles) return;
    const int e = begin + tile * kRows + tid;
    int* const dst = index_ring + (tile % kIndexRing) * kRows + tid;
    if (e < end && e >= window) {
      if (p.indices != nullptr) {
        CopyAsync4(dst, p.indices + b * p.compressed_slots + (e - window));
      } else {
        *dst = e - window;
      }
    } else {
      *dst = -1;
    }
  };
  // Lookup step 2: the entry's pool page, -1 when it is not attended (index -1 or past the
  // entries written).
  const auto fetch_page = [&](int tile) {
    if (tid >= kRows || tile >= n_tiles) return;
    const int c = index_ring[(tile % kIndexRing) * kRows + tid];
    int* const dst = page_ring + (tile % kPageRing) * kRows + tid;
    if (c >= 0 && c < n_compressed) {
      CopyAsync4(dst, p.page_table + b * p.page_table_stride + c / p.page_size);
    } else {
      *dst = -1;
    }
  };
  // Lookup step 3: the address of tile row r, nullptr when the row is not attended.
  const auto source = [&](int tile, int r) -> const __nv_bfloat16* {
    const int e = begin + tile * kRows + r;
    if (e >= end) return nullptr;
    if (e < window) return window_rows + int64_t{e} * kDim;
    const int page = page_ring[(tile % kPageRing) * kRows + r];
    if (page < 0) return nullptr;
    const int c = index_ring[(tile % kIndexRing) * kRows + r];
    return p.kv_pool + (int64_t{page} * p.page_size + c % p.page_size) * kDim;
  };
  const auto issue = [&](int tile) {
    const uint32_t dst = base + kTileOffset + (tile % kStages) * kOperandBytes;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = row_a + 32 * k;
      const __nv_bfloat16* const src = source(tile, r);
      const bool ok = src != nullptr;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int unit = part + 8 * c;
        CopyAsync16Shared(dst + SwizzledOffset(r, unit), ok ? src + unit * 8 : q, ok);
      }
      if (part == 0) valid[(tile % kStages) * kRows + r] = ok;
    }
  };

#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = row_a + 32 * k;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int unit = part + 8 * c;
      CopyAsync16Shared(base + kQOffset + SwizzledOffset(r, unit), q + r * kDim + unit * 8, true);
    }
  }
  // Prologue: indices of tiles 0..2, pages of tiles 0..1, then the rows of tile 0.
  for (int tile = 0; tile < kIndexRing; ++tile) fetch_index(tile);
  CopyAsyncCommit();
  CopyAsyncWait<0>();
  __syncthreads();
  for (int tile = 0; tile < kPageRing; ++tile) fetch_page(tile);
  CopyAsyncCommit();
  CopyAsyncWait<0>();
  __syncthreads();
  if (n_tiles > 0) issue(0);
  CopyAsyncCommit();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float running_max[2] = {-INFINITY, -INFINITY};
  float running_sum[2] = {0.0f, 0.0f};
  const float scale = p.softmax_scale * kLog2e;
  float* const mine = exchange + wg * 32 * 128 + tid_wg;
  const float* const other = exchange + (wg ^ 1) * 32 * 128 + tid_wg;

  for (int it = 0; it < n_tiles; ++it) {
    CopyAsyncWait<0>();
    FenceProxyAsync();
    __syncthreads();  // tile it is visible to wgmma; every thread is done with tile it - 1
    if (it + 1 < n_tiles) issue(it + 1);
    fetch_page(it + 2);
    fetch_index(it + 3);
    CopyAsyncCommit();

    const uint32_t tile = base + kTileOffset + (it % kStages) * kOperandBytes;
    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kHalf / 16; ++ks) {
      const uint32_t offset = (4 * wg + ks / 4) * kRegionBytes + (ks % 4) * 32;
      WgmmaQk(s, SmemDescriptor(base + kQOffset + offset, 16, 1024),
              SmemDescriptor(tile + offset, 16, 1024));
    }
    WgmmaCommit();
    WgmmaWaitAll();
    FenceRegisters(s);

    // Full scores: own half + the other warpgroup's half (fp32 addition commutes, so both
    // warpgroups get the same bits).
#pragma unroll
    for (int i = 0; i < 32; ++i) mine[i * 128] = s[i];
    __syncthreads();
    const int* const tile_valid = valid + (it % kStages) * kRows;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = 4 * j + c;
        const float full = s[i] + other[i * 128];
        const bool ok = tile_valid[8 * j + 2 * t + (c & 1)] != 0;
        s[i] = ok ? full * scale : -INFINITY;
        tile_max[c >> 1] = fmaxf(tile_max[c >> 1], s[i]);
      }
    }
    float alpha[2];
    float shift[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 2));
      const float new_max = fmaxf(running_max[r], tile_max[r]);
      // With nothing visible yet the maximum is -inf; subtracting 0 keeps exp2 at 0, not NaN.
      shift[r] = new_max == -INFINITY ? 0.0f : new_max;
      alpha[r] = exp2f(running_max[r] - shift[r]);
      running_max[r] = new_max;
      running_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      s[i] = exp2f(s[i] - shift[(i & 3) >> 1]);
      running_sum[(i & 3) >> 1] += s[i];
    }
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      o[4 * n] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
    uint32_t a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[kk][r] = PackBf16(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    }
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      // B = rows 16kk .. 16kk + 15 of the tile, dims 256 * wg ..: MN-major (dims contiguous),
      // leading byte offset = one region (64 dims), stride byte offset = 8 rows.
      WgmmaPv(o, a[kk],
              SmemDescriptor(tile + 4 * wg * kRegionBytes + kk * 16 * 128, kRegionBytes, 1024));
    }
    WgmmaCommit();
    WgmmaWaitAll();
    FenceRegisters(o);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    running_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, running_sum[r], 1);
    running_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, running_sum[r], 2);
  }
  const int head_lo = 16 * warp_wg + g;  // this thread's heads: head_lo and head_lo + 8
  if (gridDim.x == 1) {
    // One split: finish here (sink and normalization), no combine pass over partials.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = head0 + head_lo + 8 * r;
      const float sink = p.sinks[head] * kLog2e;
      const float top = fmaxf(running_max[r], sink);
      float weight = 0.0f;
      float inv = 0.0f;
      if (top != -INFINITY) {
        weight = exp2f(running_max[r] - top);
        inv = 1.0f / (running_sum[r] * weight + exp2f(sink - top));
      }
      __nv_bfloat16* const dst = out_final + (b * p.heads + head) * kDim + wg * kHalf + 2 * t;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) = __floats2bfloat162_rn(
            o[4 * n + 2 * r] * weight * inv, o[4 * n + 2 * r + 1] * weight * inv);
      }
    }
    return;
  }
  const int64_t splits = gridDim.x;
  const int64_t row0 = (b * splits + split) * p.heads + head0 + head_lo;
  const int64_t row1 = row0 + 8;
#pragma unroll
  for (int n = 0; n < 32; ++n) {
    const int col = wg * kHalf + 8 * n + 2 * t;
    *reinterpret_cast<float2*>(part_out + row0 * kDim + col) = make_float2(o[4 * n], o[4 * n + 1]);
    *reinterpret_cast<float2*>(part_out + row1 * kDim + col) =
        make_float2(o[4 * n + 2], o[4 * n + 3]);
  }
  if (wg == 0 && t == 0) {
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
  return std::max<int64_t>(kSparseTile, (per_split + kSparseTile - 1) / kSparseTile * kSparseTile);
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
      p.entries_per_split <= 0 || p.entries_per_split % kSparseTile != 0 ||
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
  static const cudaError_t attribute_status = cudaFuncSetAttribute(
      SparseDecodeSplitKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (attribute_status != cudaSuccess) return attribute_status;
  const int64_t splits = SparseDecodeSplits(p);
  const size_t rows = PartialRows(p);
  auto* base = static_cast<unsigned char*>(workspace);
  auto* part_out = reinterpret_cast<float*>(base);
  auto* part_max = reinterpret_cast<float*>(base + AlignUp(rows * kDim * sizeof(float)));
  auto* part_sum = part_max + AlignUp(rows * sizeof(float)) / sizeof(float);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.heads / kHeads));
  SparseDecodeSplitKernel<<<grid, kThreads, kSmemBytes, stream>>>(p, part_out, part_max, part_sum,
                                                                  out);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || splits == 1) return status;
  const dim3 combine_grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.heads));
  SparseDecodeCombineKernel<<<combine_grid, kDim / 4, 0, stream>>>(
      p, static_cast<int>(splits), part_out, part_max, part_sum, out);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
