// Device code shared by fp8_gemm.cu and moe_gemm.cu: the block-scaled weight-streaming GEMM on
// the FP8 tensor cores (mma.sync m16n8k32 e4m3, sm_89+), activation quantization per 1 x 128 and
// the split-K reduction. Internal to kernels/cuda; the launchers in fp8_gemm.cuh / moe_gemm.cuh
// document the math and validate the arguments.
//
// The GEMM is computed transposed, out^T[n, token] = W[n, :] . xq[token, :], so the weight rows
// fill the 16 rows of the mma's A operand and up to 8 tokens its B columns: decode batches use
// the tensor cores without padding tokens to 64 or 128. Each warp owns 16 weight rows and streams
// them once per k-range with 16-byte loads (4-byte for FP4); a block is 4 warps = 64 rows.
//
// Fragment layouts (PTX ISA, "mma.m16n8k32", 8-bit types; g = lane / 4, t = lane % 4): A reg 0 =
// row g, logical k 4t..4t+3; reg 1 = row g + 8, same k; reg 2 = row g, k 16+4t..; reg 3 = row g +
// 8, k 16+4t..; B reg 0 = k 4t..4t+3 of column g, reg 1 = k 16+4t..; C c0, c1 = (row g, columns
// 2t, 2t+1), c2, c3 = (row g + 8, same columns). Since k is summed over, any permutation of the 32
// physical k positions of one mma works when A and B use the same one; the loads below pick the
// permutation that lets each thread read contiguous bytes:
// - FP8: thread t reads bytes 16t .. 16t+15 of each 64-byte half of a 128-k block; mma step q of
//   that half takes bytes 8q .. 8q+3 (logical 4t..) and 8q+4 .. 8q+7 (logical 16+4t..).
// - FP4: the mma step s covers exactly the 32-element scale group s of the 128-k block (the
//   group's ue8m0 scale is applied per row to that step's fp32 result); thread t takes elements
//   8t .. 8t+7 of the group (4 packed bytes), low half -> logical 4t.., high half -> 16+4t...
//
// W8A16 (A16 = true, FP8 weights only): the activations stay bf16 (x read directly, no act-quant
// kernel), the e4m3 weights are converted exactly to bf16 in registers and the products run on the
// bf16 tensor cores (mma.sync m16n8k16: A reg 0 = row g, logical k 2t, 2t+1; reg 1 = row g + 8,
// same k; reg 2 = row g, k 8+2t, 8+2t+1; reg 3 = row g + 8, k 8+2t..; B reg 0 = k 2t, 2t+1 of
// column g, reg 1 = k 8+2t, 8+2t+1; C as above). The weight loads are FP8's; mma step q of half h
// takes word q of the thread's 16 bytes (physical k 64h + 16t + 4q .. +3): bytes 0, 1 -> logical
// 2t, 2t+1, bytes 2, 3 -> 8+2t, 8+2t+1; the B operand reads the same 4 physical k of token g as
// two bf16 pairs. The block's fp32 result is multiplied by the weight block's scale, as FP8's.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/moe_gemm_workspace.h"
#include "kernels/env_switch.h"

namespace pdserve::kernels::cuda::block_scaled {
// Unnamed: each including .cu file gets its own copy of the kernels.
namespace {

inline constexpr int kWarps = 4;
inline constexpr int kRowsPerBlock = 16 * kWarps;
inline constexpr int kBlockK = 128;  // quantization block along k (activations and FP8 weights)
inline constexpr int kFp4Group = 32;

// One piece of work along z: `count` (<= 8 * NT) consecutive entries of the entry list starting
// at `first`, all for expert `expert`.
struct WorkItem {
  int32_t expert;
  int32_t first;
  int32_t count;
};
static_assert(sizeof(WorkItem) == moe_workspace::kWorkItemBytes);

struct GemmArgs {
  const uint8_t* w;         // FP8: [E, n, k] e4m3; FP4: [E, n, k / 2] packed e2m1
  const float* w_scale;     // FP8: [E, ceil(n / 128), k / 128] fp32
  const uint8_t* w_scale8;  // FP4: [E, n, k / 32] ue8m0
  const uint8_t* xq;        // [x_rows, k] e4m3 (quantized activations)
  const float* xs;          // [k / 128, x_rows] fp32 (per-row scale of each 128-k block)
  const __nv_bfloat16* xb;  // W8A16: [x_rows, xb_stride] bf16 activations (xq, xs unused)
  int64_t xb_stride;
  int64_t x_rows;
  int64_t n;
  int64_t k;
  // Entries: nullptr items and pick_experts = dense (item z covers entries z * 8NT ..; entry i =
  // x row i = out row i; `dense_rows` entries). Else items[0 .. *n_items) and entry i maps to pick
  // entry_pick[i]: x row = pick / x_row_div, out row = pick. Direct picks (pick_experts set, items
  // and entry_pick null): item j is pick j alone, of expert pick_experts[j] (none when outside
  // [0, n_experts)); entry i is pick i. The same bits as the grouped items: an entry's sums do not
  // depend on the other entries of its item.
  // Identity routing (identity_tokens > 0, items, entry_pick and pick_experts null): every token
  // picks every expert in order (top_k = n_experts, pick t * n_experts + e is expert e); item j
  // is expert j / p's tokens 8 NT (j % p) .. (p = ceil(identity_tokens / 8 NT)), entry i is
  // token i % identity_tokens of expert i / identity_tokens.
  const WorkItem* items;
  const int32_t* n_items;
  const int32_t* entry_pick;
  const int32_t* pick_experts;
  int32_t n_experts;
  int32_t x_row_div;
  int64_t dense_rows;
  const float* row_weight;  // [out rows] multiplier of each out row; nullptr = 1
  int32_t k_splits;
  // Dense only: the k splits of a block's tile run as one thread-block cluster (1 x 1 x k_splits,
  // at most kMaxClusterSplits) and reduce in the kernel (ClusterReduce), no `partial`.
  int32_t cluster_reduce;
  float* partial;  // k_splits > 1 and !cluster_reduce: [k_splits, out_rows, n] fp32
  int64_t out_rows;
  __nv_bfloat16* out;  // k_splits == 1: [out_rows, out_stride] bf16
  float* out_f32;      // set: the output is fp32 here instead (same layout), out unused
  int64_t out_stride;
  int32_t identity_tokens;  // identity routing (see Entries above); 0 otherwise
};

// out_f32[i] = v when out_f32 is set (fp32 output), else out[i] = bf16(v) (round to nearest).
__device__ __forceinline__ void StoreOut(__nv_bfloat16* out, float* out_f32, int64_t i, float v) {
  if (out_f32 != nullptr) {
    out_f32[i] = v;
  } else {
    out[i] = __float2bfloat16_rn(v);
  }
}

__device__ __forceinline__ void MmaE4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 values (16 bits, element 0 in the low byte) -> two bf16 (element 0 in the low half),
// exact: e4m3 -> f16 is exact (cvt.rn.f16x2.e4m3x2), f16 -> f32 exact, and every e4m3 value has a
// bf16 (3 mantissa bits, exponents 2^-9 .. 2^8); NaN stays NaN.
__device__ __forceinline__ uint32_t E4m3x2ToBf16x2(uint32_t x16) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x16 & 0xFFFFu), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 b = __float22bfloat162_rn(f);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Four packed e2m1 values (16 bits, element 0 in the low nibble) -> four e4m3 bytes, exact
// (every e2m1 value is an e4m3 value): magnitude by byte-permute lookup, sign moved to bit 7.
__device__ __forceinline__ uint32_t E2m1x4ToE4m3x4(uint32_t x16) {
  constexpr uint32_t kLutLo = 0x3C383000u;  // 0, 0.5, 1, 1.5
  constexpr uint32_t kLutHi = 0x4C484440u;  // 2, 3, 4, 6
  const uint32_t magnitude = __byte_perm(kLutLo, kLutHi, x16 & 0x7777u);
  uint32_t spread = (x16 | (x16 << 8)) & 0x00FF00FFu;
  spread = (spread | (spread << 4)) & 0x0F0F0F0Fu;
  return magnitude | ((spread << 4) & 0x80808080u);
}

// ue8m0 -> fp32: 2^(e - 127); 0xFF is NaN (as engine/quant.h's E8M0ToFloat).
__device__ __forceinline__ float E8m0ToFloat(uint32_t e) {
  if (e == 0xFFu) return __uint_as_float(0x7FC00000u);
  return e == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(e << 23);
}

// The x row and out row of entry `i` of the item.
// IDENTITY: the kernel instantiated for identity routing (a.identity_tokens > 0), the only
// one that reads it.
template <bool IDENTITY = false>
__device__ __forceinline__ void EntryRows(const GemmArgs& a, int64_t i, int64_t* x_row,
                                          int64_t* out_row) {
  if constexpr (IDENTITY) {
    const int32_t pick = static_cast<int32_t>(i % a.identity_tokens) * a.n_experts +
                         static_cast<int32_t>(i / a.identity_tokens);
    *x_row = pick / a.x_row_div;
    *out_row = pick;
  } else if (a.items == nullptr && a.pick_experts == nullptr) {
    *x_row = i;
    *out_row = i;
  } else {
    const int32_t pick = a.entry_pick != nullptr ? a.entry_pick[i] : static_cast<int32_t>(i);
    *x_row = pick / a.x_row_div;
    *out_row = pick;
  }
}

template <bool FP4>
struct WeightRegs {
  // FP8: [row g / g+8][half h] 16 bytes; FP4: [row][group s] 4 bytes + the 4 group scales.
  uint4 v[2][2];
  uint32_t sc[2];
};

template <bool FP4>
__device__ __forceinline__ void LoadWeights(const GemmArgs& a, const uint8_t* w_rows,
                                            const uint8_t* sc_rows, bool valid0, bool valid1,
                                            int64_t kb, int t, WeightRegs<FP4>& r) {
  const bool valid[2] = {valid0, valid1};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint8_t* row = w_rows + (h == 0 ? 0 : 8 * (FP4 ? a.k / 2 : a.k));
    if constexpr (FP4) {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(row + kb * 64 + 4 * t);
      r.v[h][0] = valid[h] ? make_uint4(__ldg(p), __ldg(p + 4), __ldg(p + 8), __ldg(p + 12))
                           : make_uint4(0, 0, 0, 0);
      const uint8_t* s = sc_rows + (h == 0 ? 0 : 8 * (a.k / kFp4Group)) + kb * 4;
      r.sc[h] = valid[h] ? __ldg(reinterpret_cast<const uint32_t*>(s)) : 0x7F7F7F7Fu;
    } else {
      const uint4* p = reinterpret_cast<const uint4*>(row + kb * kBlockK + 16 * t);
      r.v[h][0] = valid[h] ? __ldg(p) : make_uint4(0, 0, 0, 0);
      r.v[h][1] = valid[h] ? __ldg(p + 4) : make_uint4(0, 0, 0, 0);
    }
  }
}

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// acc[j] += the 128-k block kb's contribution of token tile j, for the tiles holding entries.
template <bool FP4, int NT>
__device__ __forceinline__ void BlockProduct(const GemmArgs& a, const WeightRegs<FP4>& w,
                                             float w_scale, int64_t kb, int t, int tiles,
                                             const int32_t (&x_row)[NT],
                                             const int32_t (&xs_row)[NT][2], float (&acc)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= tiles) break;
    const uint8_t* x = a.xq + int64_t{x_row[j]} * a.k + kb * kBlockK;
    const float s0 = a.xs[kb * a.x_rows + xs_row[j][0]];
    const float s1 = a.xs[kb * a.x_rows + xs_row[j][1]];
    if constexpr (FP4) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(x + 32 * s + 8 * t));
        const uint32_t w0 = Word(w.v[0][0], s);
        const uint32_t w1 = Word(w.v[1][0], s);
        const uint32_t frag[4] = {E2m1x4ToE4m3x4(w0 & 0xFFFFu), E2m1x4ToE4m3x4(w1 & 0xFFFFu),
                                  E2m1x4ToE4m3x4(w0 >> 16), E2m1x4ToE4m3x4(w1 >> 16)};
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        MmaE4m3(d, frag, b.x, b.y);
        const float g0 = E8m0ToFloat((w.sc[0] >> (8 * s)) & 0xFFu);
        const float g1 = E8m0ToFloat((w.sc[1] >> (8 * s)) & 0xFFu);
        acc[j][0] += d[0] * (g0 * s0);
        acc[j][1] += d[1] * (g0 * s1);
        acc[j][2] += d[2] * (g1 * s0);
        acc[j][3] += d[3] * (g1 * s1);
      }
    } else {
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(x + 64 * h + 16 * t));
        const uint32_t f0[4] = {w.v[0][h].x, w.v[1][h].x, w.v[0][h].y, w.v[1][h].y};
        MmaE4m3(d, f0, b.x, b.y);
        const uint32_t f1[4] = {w.v[0][h].z, w.v[1][h].z, w.v[0][h].w, w.v[1][h].w};
        MmaE4m3(d, f1, b.z, b.w);
      }
      acc[j][0] += d[0] * (w_scale * s0);
      acc[j][1] += d[1] * (w_scale * s1);
      acc[j][2] += d[2] * (w_scale * s0);
      acc[j][3] += d[3] * (w_scale * s1);
    }
  }
}

// W8A16: this thread's bf16 activations of one 128-k block for the B fragments of the products
// (token x_row: elements 64h + 16t .. + 15, b[h][0] = 0..7, b[h][1] = 8..15).
struct XRegs {
  uint4 b[2][2];
};
__device__ __forceinline__ void LoadX(const GemmArgs& a, int32_t x_row, int64_t kb, int t,
                                      XRegs& x) {
  const __nv_bfloat16* row = a.xb + int64_t{x_row} * a.xb_stride + kb * kBlockK;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4* p = reinterpret_cast<const uint4*>(row + 64 * h + 16 * t);
    x.b[h][0] = __ldg(p);
    x.b[h][1] = __ldg(p + 1);
  }
}

// W8A16: the e4m3 weights of one 128-k block converted exactly to bf16 A fragments:
// wb[h][q] = the A fragment of mma step q of half h.
__device__ __forceinline__ void ConvertA16(const WeightRegs<false>& w, uint32_t (&wb)[2][4][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t r0 = Word(w.v[0][h], q);
      const uint32_t r1 = Word(w.v[1][h], q);
      wb[h][q][0] = E4m3x2ToBf16x2(r0);
      wb[h][q][1] = E4m3x2ToBf16x2(r1);
      wb[h][q][2] = E4m3x2ToBf16x2(r0 >> 16);
      wb[h][q][3] = E4m3x2ToBf16x2(r1 >> 16);
    }
  }
}

// W8A16: one token tile's products of the block (8 bf16 mma.sync, in k order), added to acc
// scaled by the block's weight scale.
__device__ __forceinline__ void MmaA16(const uint32_t (&wb)[2][4][4], const XRegs& x, float w_scale,
                                       float (&acc)[4]) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    MmaBf16(d, wb[h][0], x.b[h][0].x, x.b[h][0].y);
    MmaBf16(d, wb[h][1], x.b[h][0].z, x.b[h][0].w);
    MmaBf16(d, wb[h][2], x.b[h][1].x, x.b[h][1].y);
    MmaBf16(d, wb[h][3], x.b[h][1].z, x.b[h][1].w);
  }
  acc[0] += d[0] * w_scale;
  acc[1] += d[1] * w_scale;
  acc[2] += d[2] * w_scale;
  acc[3] += d[3] * w_scale;
}

// W8A16: acc[j] += the 128-k block kb's contribution of token tile j (bf16 activations, weights
// converted to bf16 once per block and shared by the tiles).
template <int NT>
__device__ __forceinline__ void BlockProductA16(const GemmArgs& a, const WeightRegs<false>& w,
                                                float w_scale, int64_t kb, int t, int tiles,
                                                const int32_t (&x_row)[NT], float (&acc)[NT][4]) {
  uint32_t wb[2][4][4];
  ConvertA16(w, wb);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= tiles) break;
    const __nv_bfloat16* x = a.xb + int64_t{x_row[j]} * a.xb_stride + kb * kBlockK;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Elements 64h + 16t .. +15 of token g: b0 = elements 0..7, b1 = 8..15 (LoadX's order).
      const uint4* p = reinterpret_cast<const uint4*>(x + 64 * h + 16 * t);
      const uint4 b0 = __ldg(p);
      const uint4 b1 = __ldg(p + 1);
      MmaBf16(d, wb[h][0], b0.x, b0.y);
      MmaBf16(d, wb[h][1], b0.z, b0.w);
      MmaBf16(d, wb[h][2], b1.x, b1.y);
      MmaBf16(d, wb[h][3], b1.z, b1.w);
    }
    acc[j][0] += d[0] * w_scale;
    acc[j][1] += d[1] * w_scale;
    acc[j][2] += d[2] * w_scale;
    acc[j][3] += d[3] * w_scale;
  }
}

// BlockProductA16 for one token tile with its activations already loaded (LoadX): the same
// products in the same order, so the same bits; the kernel loads the next block's x once these
// are issued.
__device__ __forceinline__ void BlockProductA16Loaded(const WeightRegs<false>& w, float w_scale,
                                                      const XRegs& x, float (&acc)[4]) {
  uint32_t wb[2][4][4];
  ConvertA16(w, wb);
  MmaA16(wb, x, w_scale, acc);
}

// Programmatic dependent launch (sm_90): a kernel launched with LaunchDependent may start while
// the kernel before it still runs; GridDependencyWait blocks until that kernel has finished and
// its writes are visible (a no-op when launched normally), GridDependencyTrigger lets the next
// one start.
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void GridDependencyTrigger() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

inline constexpr int kMaxClusterSplits = 8;

// cluster_reduce's epilogue (dense GEMMs; every thread of the block): the block's sums [8 NT
// entries x 64 rows] go to its dynamic shared memory, the cluster synchronizes, then block r of
// the cluster adds entries-x-rows elements [r E / S, (r + 1) E / S) over the S blocks in ascending
// rank (= split) order from their shared memory and writes bf16(sum * row weight): exactly
// SplitKReduceKernel's sum (0.0f + split 0 + split 1 ...), without the partial sums in HBM. The
// second barrier keeps each block's shared memory until every peer has read it.
template <int NT>
__device__ __forceinline__ void ClusterReduce(const GemmArgs& a, const WorkItem& item,
                                              const float (&acc)[NT][4]) {
  namespace cg = cooperative_groups;
  extern __shared__ float cluster_sums[];  // [8 NT][kRowsPerBlock]
  cg::cluster_group cluster = cg::this_cluster();
  const int lane = threadIdx.x % 32;
  const int row_base = (threadIdx.x / 32) * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int e = j * 8 + 2 * (lane % 4) + (c & 1);
      cluster_sums[e * kRowsPerBlock + row_base + (c >= 2 ? 8 : 0)] = acc[j][c];
    }
  }
  cluster.sync();
  const int splits = a.k_splits;
  const int rank = static_cast<int>(cluster.block_rank());
  const int elements = 8 * NT * kRowsPerBlock;
  const int end = elements * (rank + 1) / splits;
  for (int i = elements * rank / splits + static_cast<int>(threadIdx.x); i < end;
       i += static_cast<int>(blockDim.x)) {
    const int e = i / kRowsPerBlock;
    const int64_t n = int64_t{blockIdx.y} * kRowsPerBlock + i % kRowsPerBlock;
    if (e >= item.count || n >= a.n) continue;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += cluster.map_shared_rank(cluster_sums, s)[i];
    int64_t x_row = 0;
    int64_t out_row = 0;
    EntryRows(a, item.first + e, &x_row, &out_row);
    const float weight = a.row_weight != nullptr ? a.row_weight[out_row] : 1.0f;
    StoreOut(a.out, a.out_f32, out_row * a.out_stride + n, sum * weight);
  }
  cluster.sync();
}

// Grid: x = work item (fastest, so the items of one expert, or the token chunks of a dense
// GEMM, run together and share the weight tile through L2; with direct picks, one pick each),
// y = 64-row tile of n, z = k split. 128 threads. Weights are streamed three 128-k blocks deep
// (two in flight while one is used); a dense GEMM issues its first two weight loads before
// waiting for the act-quant kernel. A16: W8A16 (FP4 false): x from a.xb in bf16; with one token
// tile (NT 1) the next block's x is loaded after this block's products (LoadX,
// BlockProductA16Loaded), else at them (BlockProductA16).
template <bool FP4, bool A16, int NT, bool IDENTITY = false>
__global__ void __launch_bounds__(128) BlockScaledGemmKernel(const GemmArgs a) {
  static_assert(!(FP4 && A16), "W8A16 takes FP8 weights");
  constexpr bool identity = IDENTITY;  // a.identity_tokens > 0
  const bool dense = !identity && a.items == nullptr && a.pick_experts == nullptr;
  // Dense and identity-routed blocks know their weights from their index, so they issue their
  // first weight loads before waiting for the kernel before; the items come from the grouping
  // kernel, direct picks from the routing, read after the wait.
  const bool known = dense || identity;
  if (!known) GridDependencyWait();
  WorkItem item;
  if (dense) {
    item.expert = 0;
    item.first = static_cast<int32_t>(blockIdx.x) * 8 * NT;
    item.count = static_cast<int32_t>(min(int64_t{8 * NT}, a.dense_rows - item.first));
  } else if constexpr (identity) {
    const int32_t per_expert = (a.identity_tokens + 8 * NT - 1) / (8 * NT);
    const int32_t chunk = static_cast<int32_t>(blockIdx.x) % per_expert;
    item.expert = static_cast<int32_t>(blockIdx.x) / per_expert;
    item.first = item.expert * a.identity_tokens + chunk * 8 * NT;
    item.count = min(8 * NT, a.identity_tokens - chunk * 8 * NT);
  } else if (a.pick_experts != nullptr) {
    item.expert = a.pick_experts[blockIdx.x];
    if (item.expert < 0 || item.expert >= a.n_experts) return;
    item.first = static_cast<int32_t>(blockIdx.x);
    item.count = 1;
  } else {
    if (static_cast<int32_t>(blockIdx.x) >= *a.n_items) return;
    item = a.items[blockIdx.x];
  }
  if (item.count <= 0) return;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int64_t n0 = int64_t{blockIdx.y} * kRowsPerBlock + (threadIdx.x / 32) * 16;
  // With cluster_reduce a warp past n stays (zero weights) for the cluster barriers.
  if (n0 >= a.n && a.cluster_reduce == 0) return;
  const int tiles = (item.count + 7) / 8;
  const int64_t kblocks = a.k / kBlockK;
  const int64_t kb_begin = kblocks * blockIdx.z / a.k_splits;
  const int64_t kb_end = kblocks * (blockIdx.z + 1) / a.k_splits;
  const int64_t row_bytes = FP4 ? a.k / 2 : a.k;
  const uint8_t* w_rows = a.w + (int64_t{item.expert} * a.n + n0 + g) * row_bytes;
  const uint8_t* sc_rows =
      FP4 ? a.w_scale8 + (int64_t{item.expert} * a.n + n0 + g) * (a.k / kFp4Group) : nullptr;
  const float* w_scale = FP4 ? nullptr
                             : a.w_scale + (int64_t{item.expert} * ((a.n + kBlockK - 1) / kBlockK) +
                                            min(n0, a.n - 1) / kBlockK) *
                                               kblocks;
  const bool valid0 = n0 + g < a.n;
  const bool valid1 = n0 + g + 8 < a.n;
  WeightRegs<FP4> cur;
  WeightRegs<FP4> ahead;
  if (kb_begin < kb_end) LoadWeights<FP4>(a, w_rows, sc_rows, valid0, valid1, kb_begin, t, cur);
  if (kb_begin + 1 < kb_end) {
    LoadWeights<FP4>(a, w_rows, sc_rows, valid0, valid1, kb_begin + 1, t, ahead);
  }
  if (known) GridDependencyWait();  // xq / xs (or x) come from the kernel before
  GridDependencyTrigger();

  // Per tile: this thread's B row (token g of the tile) and the x rows of its C columns.
  int32_t x_row[NT];
  int32_t xs_row[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    int64_t row = 0;
    int64_t out_row = 0;
    const int last = item.count - 1;
    EntryRows<IDENTITY>(a, item.first + min(j * 8 + g, last), &row, &out_row);
    x_row[j] = static_cast<int32_t>(row);
    EntryRows<IDENTITY>(a, item.first + min(j * 8 + 2 * t, last), &row, &out_row);
    xs_row[j][0] = static_cast<int32_t>(row);
    EntryRows<IDENTITY>(a, item.first + min(j * 8 + 2 * t + 1, last), &row, &out_row);
    xs_row[j][1] = static_cast<int32_t>(row);
  }
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // W8A16 with one token tile (1-8 tokens, and the routed experts' items of up to 8 picks): the
  // next k block's activations are loaded while this one's products run (LoadX), as the weights
  // two blocks ahead; with more tiles they are loaded at their products.
  constexpr bool kPrefetchX = A16 && NT == 1;
  XRegs x_cur{};
  if constexpr (kPrefetchX) {
    if (kb_begin < kb_end) LoadX(a, x_row[0], kb_begin, t, x_cur);
  }
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    WeightRegs<FP4> next = ahead;
    if (kb + 2 < kb_end) LoadWeights<FP4>(a, w_rows, sc_rows, valid0, valid1, kb + 2, t, next);
    const float ws = FP4 ? 1.0f : __ldg(w_scale + kb);
    if constexpr (kPrefetchX) {
      BlockProductA16Loaded(cur, ws, x_cur, acc[0]);
      if (kb + 1 < kb_end) LoadX(a, x_row[0], kb + 1, t, x_cur);
    } else if constexpr (A16) {
      BlockProductA16<NT>(a, cur, ws, kb, t, tiles, x_row, acc);
    } else {
      BlockProduct<FP4, NT>(a, cur, ws, kb, t, tiles, x_row, xs_row, acc);
    }
    cur = ahead;
    ahead = next;
  }

  if (a.cluster_reduce != 0) {
    ClusterReduce<NT>(a, item, acc);
    return;
  }
  // Epilogue: c0, c1 = row n0 + g, columns 2t, 2t + 1; c2, c3 = row n0 + g + 8.
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    if (j >= tiles) break;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int e = j * 8 + 2 * t + (c & 1);
      const int64_t n = n0 + g + (c >= 2 ? 8 : 0);
      if (e >= item.count || n >= a.n) continue;
      int64_t x_row = 0;
      int64_t out_row = 0;
      EntryRows<IDENTITY>(a, item.first + e, &x_row, &out_row);
      if (a.k_splits > 1) {
        a.partial[(int64_t{blockIdx.z} * a.out_rows + out_row) * a.n + n] = acc[j][c];
      } else {
        const float weight = a.row_weight != nullptr ? a.row_weight[out_row] : 1.0f;
        StoreOut(a.out, a.out_f32, out_row * a.out_stride + n, acc[j][c] * weight);
      }
    }
  }
}

// out[r, n] = bf16(weight[r] * sum_s partial[s, r, n]) (out_f32 set: fp32, unrounded, there) for
// rows r with valid[r] (nullptr: all), summed in ascending s. trigger_first: the next kernel on
// the stream may launch at once (its GridDependencyWait still waits for this grid to end), so the
// next GEMM streams its first weight boxes while this and the GEMM before finish; else only when
// this grid ends.
__global__ void SplitKReduceKernel(const float* partial, int32_t splits, int64_t rows, int64_t n,
                                   const float* row_weight, const int32_t* row_expert,
                                   int32_t n_experts, __nv_bfloat16* out, float* out_f32,
                                   int64_t out_stride, bool trigger_first) {
  if (trigger_first) GridDependencyTrigger();
  GridDependencyWait();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / n;
    if (row_expert != nullptr && (row_expert[r] < 0 || row_expert[r] >= n_experts)) continue;
    float sum = 0.0f;
    for (int32_t s = 0; s < splits; ++s) sum += partial[(s * rows + r) * n + i % n];
    const float weight = row_weight != nullptr ? row_weight[r] : 1.0f;
    StoreOut(out, out_f32, r * out_stride + i % n, sum * weight);
  }
}

// The smallest power of two >= s, for finite positive normal s (Inf stays Inf).
__device__ __forceinline__ float RoundUpToPowerOfTwo(float s) {
  const uint32_t u = __float_as_uint(s);
  return __uint_as_float((u & 0x007FFFFFu) != 0 ? (u & 0x7F800000u) + 0x00800000u : u);
}

// Quantizes x [rows, k] bf16 (row stride x_stride) per 1 x 128 block, as DeepSeek's act_quant:
// amax = max(max |x|, 1e-4) (NaN ignored), s = amax / 448 (ue8m0: 2^ceil(log2(amax / 448))),
// xq = e4m3(x / s) saturated to +-448 (NaN stays NaN), xs[kb, row] = s. One warp per block of
// 128, 4 values per lane.
__global__ void ActQuantKernel(const __nv_bfloat16* x, int64_t rows, int64_t k, int64_t x_stride,
                               bool ue8m0, uint8_t* xq, float* xs) {
  GridDependencyTrigger();  // the GEMM may start streaming its weights now
  GridDependencyWait();     // launched early (LaunchActQuant): xq / xs may still be read before
  const int64_t kblocks = k / kBlockK;
  const int64_t warp = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * kblocks) return;
  const int64_t r = warp / kblocks;
  const int64_t kb = warp % kblocks;
  const __nv_bfloat16* src = x + r * x_stride + kb * kBlockK + 4 * lane;
  const uint2 raw = *reinterpret_cast<const uint2*>(src);
  const __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  const float v[4] = {__low2float(p0), __high2float(p0), __low2float(p1), __high2float(p1)};
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int offset = 16; offset > 0; offset >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  }
  amax = fmaxf(amax, 1e-4f);
  float s = amax / 448.0f;
  if (ue8m0) s = RoundUpToPowerOfTwo(s);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(v[i] / s, __NV_SATFINITE, __NV_E4M3);
    packed |= static_cast<uint32_t>(q) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(xq + r * k + kb * kBlockK + 4 * lane) = packed;
  if (lane == 0) xs[kb * rows + r] = s;
}

// ---------------------------------------------------------------------------------------------
// Host side: refusals, the split-K choice and the launch.

// Writes "<what>" to *refusal (when given) and returns cudaErrorInvalidValue.
inline cudaError_t Refuse(std::string* refusal, const std::string& what) {
  if (refusal != nullptr) *refusal = what;
  return cudaErrorInvalidValue;
}

// a * b <= limit for a, b >= 0, without overflow.
inline bool ProductAtMost(int64_t a, int64_t b, int64_t limit) { return a == 0 || b <= limit / a; }

inline bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline constexpr int64_t kMaxElements = int64_t{1} << 62;
inline constexpr int64_t kMaxN = int64_t{65535} * kRowsPerBlock;  // grid.y limit

// Workspace and tiling arithmetic, shared with the memory plan (kernels/cuda/moe_gemm_workspace.h).
using moe_workspace::AlignUp;
using moe_workspace::ChooseKSplits;
using moe_workspace::TilesFor;
static_assert(moe_workspace::kBlockK == kBlockK &&
              moe_workspace::kMmaRowsPerBlock == kRowsPerBlock);

// Launches kernel<<<grid, block, 0, stream>>>(args...) with programmatic stream serialization
// (it may start before the previous kernel on `stream` ends; see GridDependencyWait), or plainly
// when the runtime refuses that.
template <typename... Params, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                            Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  if (cudaLaunchKernelEx(&config, kernel, args...) == cudaSuccess) return cudaSuccess;
  (void)cudaGetLastError();
  kernel<<<grid, block, 0, stream>>>(args...);
  return cudaGetLastError();
}

// kernel<<<grid, block, smem, stream>>>(args...), as clusters of cluster.x x cluster.y x
// cluster.z blocks when that is more than one, with programmatic stream serialization when the
// runtime takes it (without it, griddepcontrol.wait is a no-op).
template <typename... Params, typename... Args>
cudaError_t LaunchClustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                            dim3 cluster_dims, cudaStream_t stream, const Args&... args) {
  const bool cluster = cluster_dims.x * cluster_dims.y * cluster_dims.z > 1;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_dims.x;
  attr[0].val.clusterDim.y = cluster_dims.y;
  attr[0].val.clusterDim.z = cluster_dims.z;
  attr[cluster ? 1 : 0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[cluster ? 1 : 0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = cluster ? 2 : 1;
  if (cudaLaunchKernelEx(&config, kernel, args...) == cudaSuccess) return cudaSuccess;
  (void)cudaGetLastError();
  config.numAttrs = cluster ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <bool FP4, bool A16 = false>
cudaError_t LaunchGemm(const GemmArgs& a, int tiles, int64_t items, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(items),
                  static_cast<unsigned>((a.n + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>(a.k_splits));
  if (a.cluster_reduce != 0) {
    const size_t smem = static_cast<size_t>(8 * tiles * kRowsPerBlock) * sizeof(float);
    const dim3 z(1, 1, static_cast<unsigned>(a.k_splits));  // the splits of a tile: one cluster
    switch (tiles) {
      case 1:
        return LaunchClustered(BlockScaledGemmKernel<FP4, A16, 1>, grid, dim3(128), smem, z, stream,
                               a);
      case 2:
        return LaunchClustered(BlockScaledGemmKernel<FP4, A16, 2>, grid, dim3(128), smem, z, stream,
                               a);
      default:
        return LaunchClustered(BlockScaledGemmKernel<FP4, A16, 4>, grid, dim3(128), smem, z, stream,
                               a);
    }
  }
  switch (tiles) {
    case 1:
      return LaunchDependent(BlockScaledGemmKernel<FP4, A16, 1>, grid, dim3(128), stream, a);
    case 2:
      return LaunchDependent(BlockScaledGemmKernel<FP4, A16, 2>, grid, dim3(128), stream, a);
    default:
      return LaunchDependent(BlockScaledGemmKernel<FP4, A16, 4>, grid, dim3(128), stream, a);
  }
}

// LaunchGemm for identity routing (a.identity_tokens > 0; never cluster_reduce): the kernel
// instantiated for it, so that the other instantiations' code does not carry its branches.
template <bool FP4, bool A16 = false>
cudaError_t LaunchGemmIdentity(const GemmArgs& a, int tiles, int64_t items, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(items),
                  static_cast<unsigned>((a.n + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>(a.k_splits));
  switch (tiles) {
    case 1:
      return LaunchDependent(BlockScaledGemmKernel<FP4, A16, 1, true>, grid, dim3(128), stream, a);
    case 2:
      return LaunchDependent(BlockScaledGemmKernel<FP4, A16, 2, true>, grid, dim3(128), stream, a);
    default:
      return LaunchDependent(BlockScaledGemmKernel<FP4, A16, 4, true>, grid, dim3(128), stream, a);
  }
}

inline cudaError_t LaunchActQuantWarp(const __nv_bfloat16* x, int64_t rows, int64_t k,
                                      int64_t x_stride, bool ue8m0, uint8_t* xq, float* xs,
                                      cudaStream_t stream) {
  const int64_t warps = rows * (k / kBlockK);
  if (warps == 0) return cudaSuccess;
  // Programmatic launch: the blocks are resident when the kernel before ends (its launch latency
  // hidden); they wait for it before touching memory, so the order of effects is unchanged.
  return LaunchDependent(ActQuantKernel, dim3(static_cast<unsigned>((warps + 7) / 8)), dim3(256),
                         stream, x, rows, k, x_stride, ue8m0, xq, xs);
}

// The GEMMs' act quant ([k / 128, rows] scales): act_quant_default_variant() where its
// alignment holds, else ActQuantKernel.
inline cudaError_t LaunchActQuant(const __nv_bfloat16* x, int64_t rows, int64_t k, int64_t x_stride,
                                  bool ue8m0, uint8_t* xq, float* xs, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const ActQuantVariant variant = act_quant_default_variant();
  if (variant == ActQuantVariant::kHalfWarpVectorized && Aligned(x, 16) && x_stride % 8 == 0 &&
      Aligned(xq, 8) && Aligned(xs, 4)) {
    return act_quant(x, rows, k, x_stride, ue8m0, xq, xs, ActScaleLayout::kColumnMajor, variant,
                     stream);
  }
  return LaunchActQuantWarp(x, rows, k, x_stride, ue8m0, xq, xs, stream);
}

// SplitKReduceKernel's trigger_first: off (the next kernel launches when the reduce ends) unless
// PDSERVE_SPLITK_EARLY_TRIGGER=1 (read once per process). Opt-in until tools/gpu/run_dense54.sh
// has measured it on a GPU (docs/perf.md, "Split-K reduce, activation multicast and split
// tokens").
inline bool ReduceTriggersFirst() {
  static const bool on = ReadSwitchFlag("PDSERVE_SPLITK_EARLY_TRIGGER", false, "the default (off)");
  return on;
}

inline cudaError_t LaunchReduce(const float* partial, int32_t splits, int64_t rows, int64_t n,
                                const float* row_weight, const int32_t* row_expert,
                                int32_t n_experts, __nv_bfloat16* out, int64_t out_stride,
                                cudaStream_t stream, float* out_f32 = nullptr) {
  const int64_t total = rows * n;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(4096, (total + 255) / 256));
  return LaunchDependent(SplitKReduceKernel, dim3(blocks), dim3(256), stream, partial, splits, rows,
                         n, row_weight, row_expert, n_experts, out, out_f32, out_stride,
                         ReduceTriggersFirst());
}

}  // namespace
}  // namespace pdserve::kernels::cuda::block_scaled
