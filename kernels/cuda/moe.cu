#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/moe.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int64_t kMaxElements = int64_t{1} << 62;

// ---------------------------------------------------------------------------------------------
// Router: one warp per row; the row's scores live in shared memory.

constexpr int kRouteWarps = 4;

// exp and log1p in fp64, rounded once to fp32: the correctly rounded fp32 values, which is what
// glibc's expf / log1pf give the CPU reference.
__device__ __forceinline__ float ExpF(float v) {
  return static_cast<float>(exp(static_cast<double>(v)));
}
__device__ __forceinline__ float Log1pF(float v) {
  return static_cast<float>(log1p(static_cast<double>(v)));
}

// kernels/cpu/activations.h: Sigmoid and SqrtSoftplus (softplus linear above 20). The _rn
// intrinsics keep nvcc from fusing operations the CPU rounds separately.
__device__ __forceinline__ float Score(float logit, MoeScoring scoring) {
  if (scoring == MoeScoring::kSigmoid) return __fdiv_rn(1.0f, __fadd_rn(1.0f, ExpF(-logit)));
  const float softplus = logit > 20.0f ? logit : Log1pF(ExpF(logit));
  return __fsqrt_rn(softplus);
}

// kernels/cpu/topk.h's order: larger value first, equal values -> lower index first. best < 0
// means "nothing yet".
__device__ __forceinline__ bool Better(float value, int index, float best_value, int best) {
  return best < 0 || value > best_value || (value == best_value && index < best);
}

// kernels/cpu/softmax.h: max by fmax (NaN ignored), fp32 exp(x - max), fp64 sum, one fp32
// reciprocal; an all -inf row becomes zeros. The sum's order differs from the CPU's (lanes, then a
// butterfly), which moves the fp64 sum by ~1e-16 relative: invisible after rounding to fp32.
__device__ void SoftmaxRow(const float* logits, int n, int lane, float* scores) {
  float max_value = -INFINITY;
  for (int e = lane; e < n; e += 32) max_value = fmaxf(max_value, logits[e]);
  for (int offset = 16; offset > 0; offset >>= 1) {
    max_value = fmaxf(max_value, __shfl_xor_sync(kFullMask, max_value, offset));
  }
  if (max_value == -INFINITY) {
    for (int e = lane; e < n; e += 32) scores[e] = 0.0f;
    return;
  }
  double sum = 0.0;
  for (int e = lane; e < n; e += 32) {
    scores[e] = ExpF(__fsub_rn(logits[e], max_value));
    sum += scores[e];
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(kFullMask, sum, offset);
  const float inv = static_cast<float>(1.0 / sum);
  for (int e = lane; e < n; e += 32) scores[e] = __fmul_rn(scores[e], inv);
}

// Returns, on every lane, the best expert not yet taken by score + bias. Lane l owns experts
// l, l + 32, ...; bit q of `taken` marks expert l + 32 q.
__device__ int PickBest(const float* scores, const float* bias, int n, int lane, uint32_t taken) {
  float best_value = 0.0f;
  int best = -1;
  for (int q = 0, e = lane; e < n; ++q, e += 32) {
    if ((taken >> q) & 1u) continue;
    const float value = __fadd_rn(scores[e], bias != nullptr ? bias[e] : 0.0f);
    if (Better(value, e, best_value, best)) {
      best_value = value;
      best = e;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_value = __shfl_xor_sync(kFullMask, best_value, offset);
    const int other = __shfl_xor_sync(kFullMask, best, offset);
    if (other >= 0 && Better(other_value, other, best_value, best)) {
      best_value = other_value;
      best = other;
    }
  }
  // Lane 0's answer for everyone (NaN breaks the order's transitivity; lanes could disagree).
  return __shfl_sync(kFullMask, best, 0);
}

__global__ void __launch_bounds__(kRouteWarps * 32)
    RouteKernel(const float* logits, int64_t rows, int n_experts, int k, MoeScoring scoring,
                const float* bias, const int32_t* tid2eid, const int32_t* token_ids, float scale,
                int32_t* experts, float* weights) {
  extern __shared__ float route_scores[];
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp;
  if (row >= rows) return;  // uniform per warp; no block barrier follows
  float* scores = route_scores + warp * n_experts;
  const float* row_logits = logits + row * n_experts;
  if (scoring == MoeScoring::kSoftmax) {
    SoftmaxRow(row_logits, n_experts, lane, scores);
  } else {
    for (int e = lane; e < n_experts; e += 32) scores[e] = Score(row_logits[e], scoring);
  }
  __syncwarp();

  int pick = -1;  // lane j < k holds pick j
  if (tid2eid != nullptr) {
    const int32_t token = token_ids[row];
    if (lane < k && token >= 0) pick = tid2eid[static_cast<int64_t>(token) * k + lane];
  } else {
    uint32_t taken = 0;
    for (int j = 0; j < k; ++j) {
      const int best = PickBest(scores, bias, n_experts, lane, taken);  // >= 0: k <= n_experts
      if (best % 32 == lane) taken |= 1u << (best / 32);
      if (lane == j) pick = best;
    }
  }
  const bool valid = pick >= 0 && pick < n_experts;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int p = __shfl_sync(kFullMask, pick, j);
    if (p >= 0 && p < n_experts) sum = __fadd_rn(sum, scores[p]);
  }
  const float norm = __fdiv_rn(scale, __fadd_rn(sum, 1e-20f));
  if (lane < k) {
    experts[row * k + lane] = pick;
    weights[row * k + lane] = valid ? __fmul_rn(scores[pick], norm) : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Experts: (1) group the picks by expert into tiles of up to kTileRows picks; (2) gate_up
// products + ClampedSwiGlu per tile into the fp32 activations; then per chunk of output columns:
// (3) down products per tile times the pick's weight into the contributions buffer; (4) each row
// adds its contributions to out in ascending perm position (= ascending expert, then pick).

constexpr int kTileRows = 8;
constexpr int kWeightRows = 4;  // weight rows one warp streams per tile
static_assert(kTileRows * kWeightRows == 32, "a warp reduces exactly one value per lane");
constexpr int kGateUpCols = kWeightRows / 2;  // intermediate columns per warp (gate and up rows)
constexpr int kDownCols = kWeightRows;        // output columns per warp
constexpr int kExpertWarps = 8;
constexpr int kExpertThreads = kExpertWarps * 32;
constexpr int kGroupThreads = static_cast<int>(kMaxMoeExperts);  // one thread per expert
// Blocks the tile passes aim for (several per SM of an H200); the rest loops over tiles.
constexpr int64_t kTargetBlocks = 1024;
constexpr int kCombineThreads = 256;
// The contributions buffer holds max(inter, kMinChunk) output columns per pick.
constexpr int64_t kMinChunk = 512;

// The workspace: [n_tiles int32, padding to 16 B][perm int32 x picks][pos int32 x picks]
// [tiles int4 x max_tiles][act fp32 x picks x inter][contrib fp32 x picks x chunk]. perm lists
// pick indices (r * k + j) grouped by expert, ascending within an expert; pos is its inverse (-1
// for an invalid expert id); tile t covers perm[start .. start + count) of one expert (int4:
// expert, start, count, unused), tiles in ascending expert order; act and contrib row p belong to
// pick perm[p].
struct WorkspaceLayout {
  int64_t picks = 0;
  int64_t max_tiles = 0;
  int64_t chunk = 0;
  size_t perm_offset = 0;
  size_t pos_offset = 0;
  size_t tiles_offset = 0;
  size_t act_offset = 0;
  size_t contrib_offset = 0;
  size_t bytes = 0;
};

struct ExpertsWorkspace {
  int32_t* n_tiles;
  int32_t* perm;
  int32_t* pos;
  int4* tiles;
  float* act;
  float* contrib;
};

size_t RoundUp16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Fills `layout` and returns nullptr, or returns the check the sizes failed.
const char* MakeLayout(int64_t rows, int64_t k, int64_t inter, WorkspaceLayout* layout) {
  if (rows < 0) return "rows >= 0";
  if (inter < 0) return "inter >= 0";
  if (k < 1) return "k >= 1";
  if (k > kMaxMoeTopK) return "k <= kMaxMoeTopK";
  if (rows > INT32_MAX / k) return "rows <= INT32_MAX / k";
  const int64_t picks = rows * k;
  const int64_t chunk = inter > kMinChunk ? inter : kMinChunk;
  if (picks > kMaxElements / 16 / chunk)
    return "rows * k <= kMaxElements / 16 / max(inter, kMinChunk)";
  layout->picks = picks;
  layout->chunk = chunk;
  // Tiles: at most one partial tile per expert that has picks, plus full tiles.
  layout->max_tiles = (picks < kMaxMoeExperts ? picks : kMaxMoeExperts) + picks / kTileRows;
  layout->perm_offset = 16;
  layout->pos_offset = layout->perm_offset + RoundUp16(static_cast<size_t>(picks) * 4);
  layout->tiles_offset = layout->pos_offset + RoundUp16(static_cast<size_t>(picks) * 4);
  layout->act_offset = layout->tiles_offset + static_cast<size_t>(layout->max_tiles) * 16;
  layout->contrib_offset = layout->act_offset + static_cast<size_t>(picks * inter) * 4;
  layout->bytes = layout->contrib_offset + static_cast<size_t>(picks * chunk) * 4;
  return nullptr;
}

ExpertsWorkspace Bind(const WorkspaceLayout& layout, void* workspace) {
  auto* base = static_cast<unsigned char*>(workspace);
  return {reinterpret_cast<int32_t*>(base),
          reinterpret_cast<int32_t*>(base + layout.perm_offset),
          reinterpret_cast<int32_t*>(base + layout.pos_offset),
          reinterpret_cast<int4*>(base + layout.tiles_offset),
          reinterpret_cast<float*>(base + layout.act_offset),
          reinterpret_cast<float*>(base + layout.contrib_offset)};
}

template <typename T>
__device__ __forceinline__ T WarpInclusiveScan(T v, int lane) {
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T up = __shfl_up_sync(kFullMask, v, offset);
    if (lane >= offset) v += up;
  }
  return v;
}

// One block of kMaxMoeExperts threads, thread e for expert e: a counting sort of the picks by
// expert that keeps pick order within an expert (no atomics-order dependence: shared-memory
// atomics only count; the scatter runs on one warp in pick order).
__global__ void __launch_bounds__(kGroupThreads)
    GroupKernel(const int32_t* experts, int picks, int n_experts, ExpertsWorkspace ws) {
  __shared__ int cursor[kGroupThreads];
  __shared__ int warp_picks[32];
  __shared__ int warp_tiles[32];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  cursor[tid] = 0;
  __syncthreads();
  for (int p = tid; p < picks; p += kGroupThreads) {
    const int e = experts[p];
    if (e >= 0 && e < n_experts) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();
  const int count = cursor[tid];
  const int tiles = (count + kTileRows - 1) / kTileRows;
  const int picks_incl = WarpInclusiveScan(count, lane);
  const int tiles_incl = WarpInclusiveScan(tiles, lane);
  if (lane == 31) {
    warp_picks[warp] = picks_incl;
    warp_tiles[warp] = tiles_incl;
  }
  __syncthreads();
  if (warp == 0) {
    const int wp = warp_picks[lane];
    const int wt = warp_tiles[lane];
    const int wp_incl = WarpInclusiveScan(wp, lane);
    const int wt_incl = WarpInclusiveScan(wt, lane);
    warp_picks[lane] = wp_incl - wp;
    warp_tiles[lane] = wt_incl - wt;
  }
  __syncthreads();
  const int offset = warp_picks[warp] + picks_incl - count;
  const int tile_base = warp_tiles[warp] + tiles_incl - tiles;
  for (int t = 0; t < tiles; ++t) {
    const int rest = count - t * kTileRows;
    ws.tiles[tile_base + t] =
        make_int4(tid, offset + t * kTileRows, rest < kTileRows ? rest : kTileRows, 0);
  }
  if (tid == kGroupThreads - 1) *ws.n_tiles = tile_base + tiles;
  cursor[tid] = offset;
  __syncthreads();
  if (warp != 0) return;
  for (int base = 0; base < picks; base += 32) {
    const int p = base + lane;
    const int e = p < picks ? experts[p] : -1;
    const bool valid = e >= 0 && e < n_experts;
    const unsigned peers = __match_any_sync(kFullMask, valid ? e : -1);
    const int before = __popc(peers & ((1u << lane) - 1u));
    if (valid) ws.perm[cursor[e] + before] = p;
    if (p < picks) ws.pos[p] = valid ? cursor[e] + before : -1;
    __syncwarp();
    if (valid && before == 0) cursor[e] += __popc(peers);
    __syncwarp();
  }
}

// Eight bf16 (little-endian pairs in four words) -> fp32: a bf16 is the high half of its fp32.
__device__ __forceinline__ void UnpackBf16x8(const uint32_t (&u)[4], float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xFFFF0000u);
  }
}

// VEC consecutive elements -> fp32. VEC = 8 needs 16-byte (bf16) / 32-byte (fp32) alignment.
// Weights (STREAMING) bypass L1: each is read once per tile; activations go through it: every
// warp of the block reads the same tile rows.
template <int VEC, bool STREAMING>
__device__ __forceinline__ void LoadBf16(const __nv_bfloat16* p, float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    uint32_t u[4];
    if constexpr (STREAMING) {
      asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(u[0]), "=r"(u[1]), "=r"(u[2]), "=r"(u[3])
          : "l"(p));
    } else {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      u[0] = v.x;
      u[1] = v.y;
      u[2] = v.z;
      u[3] = v.w;
    }
    UnpackBf16x8(u, f);
  } else {
    f[0] = __bfloat162float(p[0]);
  }
}

template <int VEC>
__device__ __forceinline__ void LoadActivations(const __nv_bfloat16* p, float (&f)[VEC]) {
  LoadBf16<VEC, false>(p, f);
}

template <int VEC>
__device__ __forceinline__ void LoadActivations(const float* p, float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    const float4 lo = reinterpret_cast<const float4*>(p)[0];
    const float4 hi = reinterpret_cast<const float4*>(p)[1];
    const float values[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = values[i];
  } else {
    f[0] = p[0];
  }
}

// acc[m * kWeightRows + r] = this lane's share of dot(a_rows[m], w_rows[r]) over len elements
// (len % VEC == 0), for m < count; lane l takes elements l * VEC + 32 * VEC * i. Each weight
// element is loaded once and used for every row of the tile.
template <int VEC, typename A>
__device__ __forceinline__ void TileDot(const A* const (&a_rows)[kTileRows], int count,
                                        const __nv_bfloat16* const (&w_rows)[kWeightRows],
                                        int64_t len, int lane, float (&acc)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
#pragma unroll 2
  for (int64_t i = static_cast<int64_t>(lane) * VEC; i < len; i += 32 * VEC) {
    float w[kWeightRows][VEC];
#pragma unroll
    for (int r = 0; r < kWeightRows; ++r) LoadBf16<VEC, true>(w_rows[r] + i, w[r]);
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      if (m >= count) break;
      float a[VEC];
      LoadActivations<VEC>(a_rows[m] + i, a);
#pragma unroll
      for (int r = 0; r < kWeightRows; ++r) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          acc[m * kWeightRows + r] = fmaf(a[v], w[r][v], acc[m * kWeightRows + r]);
        }
      }
    }
  }
}

// Sums v[i] over the warp and returns the total of v[lane] on each lane: a butterfly that halves
// the values each step (31 shuffles for 32 sums). Every total runs through the same tree, so a
// value's result does not depend on its index.
template <int HALF>
__device__ __forceinline__ void ReduceStep(float (&v)[32], int lane) {
  const bool upper = (lane & HALF) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float send = upper ? v[i] : v[i + HALF];
    const float keep = upper ? v[i + HALF] : v[i];
    v[i] = keep + __shfl_xor_sync(kFullMask, send, HALF);
  }
}

__device__ __forceinline__ float ReduceTransposed(float (&v)[32], int lane) {
  ReduceStep<16>(v, lane);
  ReduceStep<8>(v, lane);
  ReduceStep<4>(v, lane);
  ReduceStep<2>(v, lane);
  ReduceStep<1>(v, lane);
  return v[0];
}

// kernels/cuda/activations.cu's clamped SwiGLU (std::min / std::clamp: NaN passes through).
__device__ __forceinline__ float ClampedSwiGlu(float gate, float up, float limit) {
  const float g = limit < gate ? limit : gate;
  const float u = up < -limit ? -limit : (limit < up ? limit : up);
  const float sigmoid = 1.0f / (1.0f + expf(-g));
  return __fmul_rn(__fmul_rn(g, sigmoid), u);
}

// Grid (intermediate column groups, tile slots); each warp owns kGateUpCols intermediate columns
// i0, i0 + 1 (their gate and up rows) and loops over the tiles of its slot.
template <int VEC>
__global__ void __launch_bounds__(kExpertThreads, 2)
    GateUpKernel(const __nv_bfloat16* x, int64_t hidden, int64_t inter, int k,
                 const __nv_bfloat16* gate_up, float limit, ExpertsWorkspace ws) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * kExpertWarps + warp) * kGateUpCols;
  if (i0 >= inter) return;                          // no block barrier in this kernel
  const int64_t i1 = i0 + 1 < inter ? i0 + 1 : i0;  // a tail warp reads row i0 twice
  const int n_tiles = *ws.n_tiles;
  for (int t = static_cast<int>(blockIdx.y); t < n_tiles; t += static_cast<int>(gridDim.y)) {
    const int4 tile = ws.tiles[t];
    const int start = tile.y;
    const int count = tile.z;
    const int lane_pick = lane < count ? ws.perm[start + lane] : ws.perm[start];
    const __nv_bfloat16* a_rows[kTileRows];
#pragma unroll
    for (int m = 0; m < kTileRows; ++m) {
      a_rows[m] = x + static_cast<int64_t>(__shfl_sync(kFullMask, lane_pick, m) / k) * hidden;
    }
    const __nv_bfloat16* w = gate_up + static_cast<int64_t>(tile.x) * 2 * inter * hidden;
    const __nv_bfloat16* const w_rows[kWeightRows] = {
        w + i0 * hidden, w + i1 * hidden, w + (inter + i0) * hidden, w + (inter + i1) * hidden};
    float acc[32];
    TileDot<VEC>(a_rows, count, w_rows, hidden, lane, acc);
    const float value = ReduceTransposed(acc, lane);  // lane = m * kWeightRows + r
    const float up = __shfl_down_sync(kFullMask, value, kGateUpCols);
    const int m = lane / kWeightRows;
    const int r = lane % kWeightRows;
    if (r < kGateUpCols && m < count && i0 + r < inter) {
      ws.act[static_cast<int64_t>(start + m) * inter + i0 + r] = ClampedSwiGlu(value, up, limit);
    }
  }
}

// Grid (output column groups of the chunk, tile slots); each warp owns kDownCols columns
// c_begin + c0 .. c_begin + c0 + 3 and writes weight * (down_e act) of each pick of its tiles to
// contrib. Lane = m * kDownCols + column.
template <int VEC>
__global__ void __launch_bounds__(kExpertThreads, 2)
    DownKernel(int64_t hidden, int64_t inter, int64_t c_begin, int64_t c_count, int64_t chunk,
               const __nv_bfloat16* down, const float* weights, ExpertsWorkspace ws) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kExpertWarps + warp) * kDownCols;
  if (c0 >= c_count) return;  // no block barrier in this kernel
  const int m = lane / kDownCols;
  const int64_t column = c0 + lane % kDownCols;
  const int n_tiles = *ws.n_tiles;
  for (int t = static_cast<int>(blockIdx.y); t < n_tiles; t += static_cast<int>(gridDim.y)) {
    const int4 tile = ws.tiles[t];
    const int start = tile.y;
    const int count = tile.z;
    const int lane_pick = lane < count ? ws.perm[start + lane] : ws.perm[start];
    const float weight = weights[__shfl_sync(kFullMask, lane_pick, m)];  // issued early
    const float* a_rows[kTileRows];
#pragma unroll
    for (int i = 0; i < kTileRows; ++i) {
      a_rows[i] = ws.act + static_cast<int64_t>(start + (i < count ? i : 0)) * inter;
    }
    const __nv_bfloat16* w = down + (static_cast<int64_t>(tile.x) * hidden + c_begin) * inter;
    const __nv_bfloat16* w_rows[kWeightRows];
#pragma unroll
    for (int r = 0; r < kWeightRows; ++r) w_rows[r] = w + (c0 + r < c_count ? c0 + r : c0) * inter;
    float acc[32];
    TileDot<VEC>(a_rows, count, w_rows, inter, lane, acc);
    const float value = ReduceTransposed(acc, lane);
    if (m < count && column < c_count) {
      ws.contrib[static_cast<int64_t>(start + m) * chunk + column] = __fmul_rn(weight, value);
    }
  }
}

// One block per row: out[r, c_begin + c] += its picks' contributions one at a time, in ascending
// perm position, i.e. ascending expert and then pick order (the CPU reference's order).
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(int k, int64_t hidden, int64_t c_begin, int64_t c_count, int64_t chunk,
                  ExpertsWorkspace ws, float* out) {
  __shared__ int order[kMaxMoeTopK];
  __shared__ int n_valid;
  const int64_t row = blockIdx.x;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    const int p = lane < k ? ws.pos[row * k + lane] : -1;
    int rank = 0;  // valid positions are distinct
    for (int j = 0; j < k; ++j) {
      const int q = __shfl_sync(kFullMask, p, j);
      if (q >= 0 && q < p) ++rank;
    }
    if (p >= 0) order[rank] = p;
    const unsigned valid = __ballot_sync(kFullMask, p >= 0);
    if (lane == 0) n_valid = __popc(valid);
  }
  __syncthreads();
  if (n_valid == 0) return;
  float* out_row = out + row * hidden + c_begin;
  for (int64_t c = threadIdx.x; c < c_count; c += kCombineThreads) {
    float total = out_row[c];
    for (int i = 0; i < n_valid; ++i) {
      total = __fadd_rn(total, ws.contrib[static_cast<int64_t>(order[i]) * chunk + c]);
    }
    out_row[c] = total;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Grid of a tile pass: column groups x tile slots, about kTargetBlocks blocks but no more slots
// than tiles.
dim3 TileGrid(int64_t columns, int64_t columns_per_block, int64_t tile_slots) {
  const int64_t column_blocks = (columns + columns_per_block - 1) / columns_per_block;
  int64_t slots = (kTargetBlocks + column_blocks - 1) / column_blocks;
  if (slots > tile_slots) slots = tile_slots;
  if (slots > 65535) slots = 65535;
  return dim3(static_cast<unsigned>(column_blocks), static_cast<unsigned>(slots));
}

template <int VEC>
cudaError_t LaunchGateUp(const __nv_bfloat16* x, int64_t hidden, int64_t inter, int k,
                         const __nv_bfloat16* gate_up, float limit, int64_t tile_slots,
                         const ExpertsWorkspace& ws, cudaStream_t stream) {
  const dim3 grid = TileGrid(inter, kExpertWarps * kGateUpCols, tile_slots);
  GateUpKernel<VEC><<<grid, kExpertThreads, 0, stream>>>(x, hidden, inter, k, gate_up, limit, ws);
  return cudaGetLastError();
}

template <int VEC>
cudaError_t LaunchDown(int64_t hidden, int64_t inter, int64_t c_begin, int64_t c_count,
                       int64_t chunk, const __nv_bfloat16* down, const float* weights,
                       int64_t tile_slots, const ExpertsWorkspace& ws, cudaStream_t stream) {
  const dim3 grid = TileGrid(c_count, kExpertWarps * kDownCols, tile_slots);
  DownKernel<VEC><<<grid, kExpertThreads, 0, stream>>>(hidden, inter, c_begin, c_count, chunk, down,
                                                       weights, ws);
  return cudaGetLastError();
}

}  // namespace

cudaError_t moe_route(const float* logits, int64_t rows, int64_t n_experts, int64_t k,
                      MoeScoring scoring, const float* correction_bias, const int32_t* tid2eid,
                      const int32_t* token_ids, float routed_scaling_factor, int32_t* experts,
                      float* weights, cudaStream_t stream) {
  constexpr const char* kLauncher = "moe_route";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, n_experts >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, n_experts <= kMaxMoeExperts);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, k >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, k <= kMaxMoeTopK);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, scoring == MoeScoring::kSoftmax ||
                                        scoring == MoeScoring::kSigmoid ||
                                        scoring == MoeScoring::kSqrtSoftplus);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, tid2eid != nullptr || k <= n_experts);
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, logits != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, experts != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, weights != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, tid2eid == nullptr || token_ids != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= kMaxElements / kMaxMoeExperts);
  const int64_t blocks = (rows + kRouteWarps - 1) / kRouteWarps;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, blocks <= INT32_MAX);
  const size_t shared_bytes = sizeof(float) * kRouteWarps * static_cast<size_t>(n_experts);
  RouteKernel<<<static_cast<unsigned>(blocks), kRouteWarps * 32, shared_bytes, stream>>>(
      logits, rows, static_cast<int>(n_experts), static_cast<int>(k), scoring, correction_bias,
      tid2eid, token_ids, routed_scaling_factor, experts, weights);
  return cudaGetLastError();
}

size_t moe_experts_workspace_bytes(int64_t rows, int64_t k, int64_t inter) {
  WorkspaceLayout layout;
  return MakeLayout(rows, k, inter, &layout) == nullptr ? layout.bytes : 0;
}

cudaError_t moe_experts(const __nv_bfloat16* x, int64_t rows, int64_t hidden, int64_t inter,
                        int64_t k, int64_t n_experts, const __nv_bfloat16* gate_up,
                        const __nv_bfloat16* down, const int32_t* experts, const float* weights,
                        float swiglu_limit, void* workspace, size_t workspace_bytes, float* out,
                        cudaStream_t stream) {
  WorkspaceLayout layout;
  constexpr const char* kLauncher = "moe_experts";
  if (const char* failed = MakeLayout(rows, k, inter, &layout))
    return RefuseLaunch(kLauncher, failed);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hidden >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, n_experts >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, n_experts <= kMaxMoeExperts);
  if (rows == 0 || hidden == 0 || inter == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, x != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, gate_up != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, down != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, experts != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, weights != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, out != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, workspace != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, workspace_bytes >= layout.bytes);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, Aligned16(workspace));
  // Every tensor under 2^62 elements: x / out, and one expert's weights times n_experts.
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hidden <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, inter <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= kMaxElements / hidden);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, hidden <= kMaxElements / (2 * inter * n_experts));
  const ExpertsWorkspace ws = Bind(layout, workspace);
  const int picks = static_cast<int>(layout.picks);
  GroupKernel<<<1, kGroupThreads, 0, stream>>>(experts, picks, static_cast<int>(n_experts), ws);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  // Tiles this launch can have: one partial per expert with picks, plus full ones.
  const int64_t tile_slots =
      (layout.picks < n_experts ? layout.picks : n_experts) + layout.picks / kTileRows;
  const int ki = static_cast<int>(k);
  status =
      hidden % 8 == 0 && Aligned16(x) && Aligned16(gate_up)
          ? LaunchGateUp<8>(x, hidden, inter, ki, gate_up, swiglu_limit, tile_slots, ws, stream)
          : LaunchGateUp<1>(x, hidden, inter, ki, gate_up, swiglu_limit, tile_slots, ws, stream);
  if (status != cudaSuccess) return status;
  // act rows are 32-byte aligned when inter % 8 == 0 (the workspace and act_offset are 16-aligned,
  // float4 loads need 16).
  const bool down_vectorized = inter % 8 == 0 && Aligned16(down);
  for (int64_t c_begin = 0; c_begin < hidden; c_begin += layout.chunk) {
    const int64_t c_count = hidden - c_begin < layout.chunk ? hidden - c_begin : layout.chunk;
    status = down_vectorized ? LaunchDown<8>(hidden, inter, c_begin, c_count, layout.chunk, down,
                                             weights, tile_slots, ws, stream)
                             : LaunchDown<1>(hidden, inter, c_begin, c_count, layout.chunk, down,
                                             weights, tile_slots, ws, stream);
    if (status != cudaSuccess) return status;
    CombineKernel<<<static_cast<unsigned>(rows), kCombineThreads, 0, stream>>>(
        ki, hidden, c_begin, c_count, layout.chunk, ws, out);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace pdserve::kernels::cuda
