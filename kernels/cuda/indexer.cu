#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/grid_dependency.cuh"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/indexer.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps, 16 keys of each tile apiece
constexpr int kBlocksPerSm = 2;
constexpr int kTileKeys = 64;
constexpr int kHeads = static_cast<int>(kIndexHeads);
constexpr int kDim = static_cast<int>(kIndexHeadDim);
// Key tile loads: 16 consecutive threads copy the 16 16-byte chunks of one 256-byte key row, so
// each warp instruction reads two whole rows (16 full 32-byte sectors).
constexpr int kChunksPerRow = kDim * 2 / 16;
constexpr int kRowsPerPass = kThreads / kChunksPerRow;
constexpr int kRowsPerThread = kTileKeys / kRowsPerPass;
// Row pitch in shared memory: 8 bf16 of padding puts the 8 rows an ldmatrix phase reads, and the
// 8 chunks a copy phase writes, on distinct banks.
constexpr int kPitch = kDim + 8;
constexpr int kStages = 5;  // key tiles per block: 4 in flight while one is scored
constexpr size_t kStageBytes = sizeof(__nv_bfloat16) * kTileKeys * kPitch;
// Requests per launch: the per-request tile table lives in shared memory.
constexpr int64_t kMaxBatchPerLaunch = 1024;

// n / d and n % d for 0 <= n < 2^31 by one 64-bit multiply (page_size is a run-time value). With
// L = ceil(log2 d), shift = 31 + L and m = ceil(2^shift / d) < 2^32: n * m / 2^shift = n / d + e
// with 0 <= e < 2^31 / 2^shift <= 1 / d, which never reaches the next integer. d is page_size
// clamped to 2^31 (any larger page holds every key at its own index).
struct Divider {
  uint32_t d;
  uint32_t m;
  uint32_t shift;

  __device__ __forceinline__ int Quotient(int n) const {
    return static_cast<int>((static_cast<uint64_t>(n) * m) >> shift);
  }
  // n % d given q = n / d (exact in 32-bit unsigned arithmetic; the result is below n).
  __device__ __forceinline__ int Remainder(int n, int q) const {
    return static_cast<int>(static_cast<uint32_t>(n) - static_cast<uint32_t>(q) * d);
  }
};

Divider MakeDivider(int64_t divisor) {
  const uint64_t d = static_cast<uint64_t>(std::min<int64_t>(divisor, int64_t{1} << 31));
  uint32_t log2_ceil = 0;
  while ((uint64_t{1} << log2_ceil) < d) ++log2_ceil;
  const uint32_t shift = 31 + log2_ceil;
  return {static_cast<uint32_t>(d), static_cast<uint32_t>(((uint64_t{1} << shift) + d - 1) / d),
          shift};
}

__device__ __forceinline__ int VisibleKeys(const IndexerParams& p, int64_t b) {
  const int64_t by_position = (static_cast<int64_t>(p.positions[b]) + 1) / p.rate;
  const int64_t n = min(static_cast<int64_t>(p.n_keys[b]), by_position);
  return static_cast<int>(max(int64_t{0}, min(n, p.max_keys)));
}

__device__ __forceinline__ int Tiles(int visible) { return (visible + kTileKeys - 1) / kTileKeys; }

// A key tile of the launch's flat tile order: request b (index within the launch), tile `tile`
// of that request.
struct TileCursor {
  int b;
  int tile;
};

// Moves to the next tile, skipping requests with no visible key. vis_s: [nb] visible counts.
__device__ __forceinline__ void Advance(TileCursor& c, const int32_t* vis_s, int nb) {
  if (++c.tile < Tiles(vis_s[c.b])) return;
  c.tile = 0;
  do {
    ++c.b;
  } while (c.b < nb && vis_s[c.b] == 0);
}

// Page lookups of one tile: with kWholePages (page_size a multiple of kTileKeys) a tile lies in
// one pool page and pages[0] is that page; otherwise pages[i] is the page of this thread's row i.
// Rows past `visible` look nothing up.
template <bool kWholePages>
constexpr int kPagesPerTile = kWholePages ? 1 : kRowsPerThread;

// Pool pages of tile c for this thread (0 past `visible`): loaded one tile ahead, so the copies
// never wait on the page table.
template <bool kWholePages>
__device__ __forceinline__ void LoadPages(const IndexerParams& p, int64_t b, TileCursor c,
                                          int visible, Divider div,
                                          int32_t (&pages)[kPagesPerTile<kWholePages>]) {
  const int32_t* table = p.page_table + b * p.page_table_stride;
  const int first_key = c.tile * kTileKeys;
  if constexpr (kWholePages) {
    pages[0] = table[div.Quotient(first_key)];
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int key = first_key + static_cast<int>(threadIdx.x) / kChunksPerRow + i * kRowsPerPass;
      pages[i] = key < visible ? table[div.Quotient(key)] : 0;
    }
  }
}

// Stages tile c into dst; rows past `visible` become zeros and their pool slots (addresses inside
// a page the request owns, or page 0) are not read. Layout: [kTileKeys, kPitch] bf16, or with
// kSwizzled the wgmma K-major layout with the 128-byte swizzle: two 8 KB regions (dims 0-63,
// 64-127) of 64 rows x 128 bytes, 16-byte unit u of row r at unit u ^ (r % 8) (PTX ISA "Shared
// Memory Matrix Layout"). A thread's rows are row0 + 8 i, all with r % 8 == row0, so its
// destinations are 1024 bytes (512 bf16) apart in either layout's own step.
template <bool kWholePages, bool kSwizzled = false>
__device__ __forceinline__ void LoadKeyTile(const IndexerParams& p, TileCursor c, int visible,
                                            Divider div,
                                            const int32_t (&pages)[kPagesPerTile<kWholePages>],
                                            __nv_bfloat16* dst) {
  const int chunk = static_cast<int>(threadIdx.x) % kChunksPerRow;
  const int row0 = static_cast<int>(threadIdx.x) / kChunksPerRow;
  const int first_key = c.tile * kTileKeys;
  static_assert(kRowsPerPass == 8, "the swizzled step assumes 8 rows per pass");
  constexpr int kDstStep = kSwizzled ? kRowsPerPass * 128 / 2 : kRowsPerPass * kPitch;
  __nv_bfloat16* const dst_row0 =
      kSwizzled
          ? dst + ((chunk >> 3) * (kTileKeys * 128) + row0 * 128 + (((chunk & 7) ^ row0) << 4)) / 2
          : dst + row0 * kPitch + chunk * 8;
  if constexpr (kWholePages) {
    // The tile's rows are consecutive pool rows of one page.
    const int64_t pool_row = static_cast<int64_t>(pages[0]) * p.page_size +
                             div.Remainder(first_key, div.Quotient(first_key)) + row0;
    const __nv_bfloat16* src = p.key_pool + pool_row * kDim + chunk * 8;
    const int rows_left = visible - first_key - row0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      CopyAsync16(dst_row0 + i * kDstStep, src + i * kRowsPerPass * kDim,
                  i * kRowsPerPass < rows_left);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int key = first_key + row0 + i * kRowsPerPass;
      const int64_t pool_row =
          static_cast<int64_t>(pages[i]) * p.page_size + div.Remainder(key, div.Quotient(key));
      CopyAsync16(dst_row0 + i * kDstStep, p.key_pool + pool_row * kDim + chunk * 8, key < visible);
    }
  }
}

// The A operand of one m16n8k16 product (16 rows x 16 columns, row-major in shared memory):
// lane l passes the address of row l % 16, column 8 * (l / 16).
__device__ __forceinline__ void LoadA(const __nv_bfloat16* row_ptr, uint32_t (&a)[4]) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// Request b's queries as B fragments (heads 8j + g, dims 16ks + 2t.. and + 8) and this lane's
// head weights (heads 8j + 2t and 8j + 2t + 1), straight from global memory.
__device__ __forceinline__ void LoadQuery(const IndexerParams& p, int64_t b,
                                          uint32_t (&qf)[kHeads / 8][kDim / 16][2],
                                          float (&w)[kHeads / 8][2]) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const __nv_bfloat16* q = p.q + b * kHeads * kDim;
#pragma unroll
  for (int j = 0; j < kHeads / 8; ++j) {
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const __nv_bfloat16* qh = q + (8 * j + g) * kDim + 16 * ks + 2 * t;
      qf[j][ks][0] = LoadPair(qh);
      qf[j][ks][1] = LoadPair(qh + 8);
    }
    w[j][0] = p.weights[b * kHeads + 8 * j + 2 * t];
    w[j][1] = p.weights[b * kHeads + 8 * j + 2 * t + 1];
  }
}

// The launch covers requests [b0, b0 + nb). Fills vis_s[nb] (visible keys) and first_s[nb + 1]
// (the launch's tiles before each request), writes visible_out from block 0, and returns this
// block's share of the tiles (gridDim.x equal contiguous ranges of the flat tile order) and its
// first tile in `start`; 0 when the share is empty. Every thread of the block must call it.
__device__ __forceinline__ int BlockRange(const IndexerParams& p, int64_t b0, int nb,
                                          int64_t* first_s, int32_t* vis_s, int32_t* visible_out,
                                          TileCursor& start) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  // Launched with programmatic stream serialization: nothing is read or written before the kernel
  // before this one has completed; the kernel after it may begin launching now.
  GridDependencyWait();
  GridDependencyLaunchDependents();

  for (int b = threadIdx.x; b < nb; b += kThreads) {
    const int visible = VisibleKeys(p, b0 + b);
    vis_s[b] = visible;
    if (blockIdx.x == 0) visible_out[b0 + b] = visible;
  }
  __syncthreads();
  if (warp == 0) {
    int64_t running = 0;
    for (int base = 0; base < nb; base += 32) {
      const int b = base + lane;
      const int64_t tiles = b < nb ? Tiles(vis_s[b]) : 0;
      int64_t inclusive = tiles;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int64_t below = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
        if (lane >= offset) inclusive += below;
      }
      if (b < nb) first_s[b] = running + inclusive - tiles;
      running += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
    }
    if (lane == 0) first_s[nb] = running;
  }
  __syncthreads();
  const int64_t total = first_s[nb];
  const int64_t begin = total * blockIdx.x / gridDim.x;
  const int64_t end = total * (blockIdx.x + 1) / gridDim.x;
  if (begin == end) return 0;
  const int n_local = static_cast<int>(end - begin);
  // The request holding tile `begin`: first_s[lo] <= begin < first_s[hi] throughout, and a request
  // with no tiles shares its start with the next one, so the search ends on a request with tiles.
  int lo = 0;
  int hi = nb;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_s[mid] <= begin) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  start = TileCursor{lo, static_cast<int>(begin - first_s[lo])};
  return n_local;
}

// The key tiles of a block's share in flight: STAGES - 1 tiles ahead of the one being scored,
// their pool pages looked up one tile ahead of their copies. Layout of a stage as LoadKeyTile's
// kSwizzled; k_s: STAGES stages of kStageElems bf16.
template <bool kWholePages, bool kSwizzled, int STAGES = kStages>
struct KeyPipeline {
  static constexpr int kStageElems = kSwizzled ? kTileKeys * kDim : kTileKeys * kPitch;

  const IndexerParams& p;
  int64_t b0;
  int nb;
  const int32_t* vis_s;
  Divider div;
  int n_local;
  __nv_bfloat16* k_s;
  TileCursor load;  // the next tile to copy
  int32_t pages[kPagesPerTile<kWholePages>];

  // Prologue: page ids of the first STAGES - 1 tiles in one round trip, then their copies (one
  // commit group per stage, empty past n_local).
  __device__ __forceinline__ KeyPipeline(const IndexerParams& params, int64_t first_b, int n_b,
                                         const int32_t* visible_s, Divider divider,
                                         TileCursor start, int n, __nv_bfloat16* stages)
      : p(params),
        b0(first_b),
        nb(n_b),
        vis_s(visible_s),
        div(divider),
        n_local(n),
        k_s(stages),
        load(start) {
    TileCursor ahead_tiles[STAGES - 1];
    int32_t ahead_pages[STAGES - 1][kPagesPerTile<kWholePages>];
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      ahead_tiles[s] = load;
      if (s < n_local) {
        LoadPages<kWholePages>(p, b0 + load.b, load, vis_s[load.b], div, ahead_pages[s]);
        Advance(load, vis_s, nb);
      }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_local) {
        const TileCursor c = ahead_tiles[s];
        LoadKeyTile<kWholePages, kSwizzled>(p, c, vis_s[c.b], div, ahead_pages[s],
                                            k_s + s * kStageElems);
      }
      CopyAsyncCommit();
    }
    if (STAGES - 1 < n_local)
      LoadPages<kWholePages>(p, b0 + load.b, load, vis_s[load.b], div, pages);
  }

  // At tile it, once every thread is done with tile it - 1: copies tile it + STAGES - 1 into that
  // stage (one commit group, empty past n_local) and looks up the pages of the tile after it.
  __device__ __forceinline__ void IssueAhead(int it) {
    const int ahead = it + STAGES - 1;
    if (ahead < n_local) {
      LoadKeyTile<kWholePages, kSwizzled>(p, load, vis_s[load.b], div, pages,
                                          k_s + (ahead % STAGES) * kStageElems);
      Advance(load, vis_s, nb);
      if (ahead + 1 < n_local) {
        LoadPages<kWholePages>(p, b0 + load.b, load, vis_s[load.b], div, pages);
      }
    }
    CopyAsyncCommit();
  }
};

// The launch covers requests [b0, b0 + nb). Its key tiles, request by request, are split into
// gridDim.x equal contiguous ranges, one per block, whatever the lengths: a block streams its
// range through a kStages-deep cp.async pipeline and reloads the queries when the range enters
// the next request.
template <bool kWholePages>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    IndexerScoresKernel(IndexerParams p, int64_t b0, int nb, Divider div, float* scores,
                        int32_t* visible_out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* const k_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kStages][kTileKeys][kPitch]
  // first_s[b]: the launch's tiles before request b (first_s[nb]: all of them); vis_s[b]: its
  // visible keys.
  auto* const first_s = reinterpret_cast<int64_t*>(smem_raw + kStages * kStageBytes);
  auto* const vis_s = reinterpret_cast<int32_t*>(first_s + nb + 1);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  TileCursor start;
  const int n_local = BlockRange(p, b0, nb, first_s, vis_s, visible_out, start);
  if (n_local == 0) return;

  KeyPipeline<kWholePages, false> pipeline(p, b0, nb, vis_s, div, start, n_local, k_s);

  const int g = lane >> 2;
  const int t = lane & 3;
  // The current request's queries stay in registers as B fragments (128 registers), so the inner
  // loop reads only keys from shared memory.
  uint32_t qf[kHeads / 8][kDim / 16][2] = {};
  float w[kHeads / 8][2] = {};
  int query_b = -1;
  TileCursor tile = start;
  for (int it = 0; it < n_local; ++it) {
    if (tile.b != query_b) {
      query_b = tile.b;
      LoadQuery(p, b0 + query_b, qf, w);
    }
    CopyAsyncWait<kStages - 2>();
    __syncthreads();  // tile it is visible; every warp is done with tile it - 1
    pipeline.IssueAhead(it);

    const __nv_bfloat16* keys =
        k_s + ((it % kStages) * kTileKeys + warp * 16 + (lane & 15)) * kPitch + (lane >> 4) * 8;
    float acc[kHeads / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      uint32_t a[4];
      LoadA(keys + 16 * ks, a);
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
    const int visible = vis_s[tile.b];
    float* score_row = scores + (b0 + tile.b) * p.max_keys;
    const int key0 = tile.tile * kTileKeys + warp * 16 + g;
    if (t == 0 && key0 < visible) score_row[key0] = s0 * p.softmax_scale;
    if (t == 0 && key0 + 8 < visible) score_row[key0 + 8] = s1 * p.softmax_scale;
    Advance(tile, vis_s, nb);
  }
}

// The warpgroup-MMA variants (IndexerScoresVariant::kWgmma, kWgmmaQueryRegisters): same work
// split, tile order and copy pipeline; each 64-key tile is one m64n64k16 chain of 8 wgmma (heads
// x keys, fp32), so the tensor cores read each staged key once per block, not once per 8-head
// group. kWgmma keeps the current request's queries in shared memory (16 KB, the wgmma layout of
// LoadKeyTile<.., true>); kWgmmaQueryRegisters holds them in registers as wgmma A fragments and
// runs three smaller blocks per multiprocessor where they fit. Shared memory: 1024-byte-aligned
// queries (kWgmma only), then the key stages, then the cross-warp sums [4][64] fp32, then the
// request table of BlockRange.
constexpr int kWgQueryBytes = kHeads * kDim * 2;    // 16 KB: two 8 KB swizzle regions
constexpr int kWgTileBytes = kTileKeys * kDim * 2;  // 16 KB
constexpr int kWgRegionBytes = kTileKeys * 128;     // 64 rows x 128 bytes
// kWgmmaQueryRegisters: 4 stages (3 tiles in flight) in 67 KB, so that three blocks share a
// multiprocessor where the request table is small (12 warps and 9 tiles in flight per SM).
constexpr int kQrStages = 4;
constexpr int kQrBlocksPerSm = 3;
constexpr size_t kSmemPerSm = 228 * 1024;  // shared memory of an H100 / H200 multiprocessor
constexpr size_t kSmemReservedPerBlock = 1024;
static_assert(kHeads == 64 && kTileKeys == 64 && kDim == 128, "the wgmma shapes assume these");
static_assert(kWgRegionBytes == kHeads * 128, "queries and keys share the region size");

template <bool kRegisterQueries>
struct WgLayout {
  static constexpr int kStageCount = kRegisterQueries ? kQrStages : kStages;
  static constexpr int kQueryBytes = kRegisterQueries ? 0 : kWgQueryBytes;
  static constexpr int kSumOffset = kQueryBytes + kStageCount * kWgTileBytes;
  static constexpr int kTableOffset = kSumOffset + 4 * kTileKeys * 4;
};

// d[64 heads x 64 keys] (+)= A[64 x 16] * B[16 x 64]ᵀ, both bf16 K-major in shared memory.
__device__ __forceinline__ void WgmmaScores(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                            int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Request b's queries and head weights, as this thread stages them: 16-byte units index = i *
// kThreads + tid of the [kHeads][kDim] bf16 queries (head index / kChunksPerRow, unit index %
// kChunksPerRow), and the weights of heads 16 warp + g and + 8 (the accumulator rows it holds).
struct QueryShare {
  static constexpr int kUnits = kHeads * kChunksPerRow / kThreads;
  uint4 units[kUnits];
  float w[2];
};

// Loads request b's share into registers (plain loads: the values are consumed later, so a load
// issued tiles ahead of its use hides its latency).
__device__ __forceinline__ void LoadQueryShare(const IndexerParams& p, int64_t b, QueryShare& q) {
  const int tid = static_cast<int>(threadIdx.x);
  const uint4* src = reinterpret_cast<const uint4*>(p.q + b * kHeads * kDim);
#pragma unroll
  for (int i = 0; i < QueryShare::kUnits; ++i) q.units[i] = src[i * kThreads + tid];
  const int head0 = 16 * (tid >> 5) + ((tid & 31) >> 2);
  q.w[0] = p.weights[b * kHeads + head0];
  q.w[1] = p.weights[b * kHeads + head0 + 8];
}

// Writes a share into q_s (the swizzled layout of LoadKeyTile<.., true>). Call only while no
// wgmma reads q_s; the writes reach wgmma after FenceProxyAsync and a block barrier.
__device__ __forceinline__ void StoreQueryShare(const QueryShare& q, unsigned char* q_s) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int i = 0; i < QueryShare::kUnits; ++i) {
    const int index = i * kThreads + tid;
    const int head = index / kChunksPerRow;
    const int unit = index % kChunksPerRow;
    *reinterpret_cast<uint4*>(q_s + (unit >> 3) * kWgRegionBytes + head * 128 +
                              (((unit & 7) ^ (head & 7)) << 4)) = q.units[i];
  }
}

// d[64 heads x 64 keys] (+)= A[64 x 16] * B[16 x 64]ᵀ with A from registers (the fragments of
// QueryFragments) and B bf16 K-major in shared memory.
__device__ __forceinline__ void WgmmaScoresRegisterA(float (&d)[32], const uint32_t (&a)[4],
                                                     uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// Request b's queries as wgmma A fragments of this thread (PTX ISA "Register Fragments" of
// wgmma .m64nNk16, as mma.m16n8k16's A per warp: warp w holds heads 16 w .. 16 w + 15; with g =
// lane / 4, t = lane % 4, a[ks] = (head 16 w + g, dims 16 ks + 2 t, + 1), (head + 8, same dims),
// (head, dims + 8), (head + 8, dims + 8)), and the weights of heads 16 w + g and + 8 (the
// accumulator rows it holds).
struct QueryFragments {
  uint32_t a[kDim / 16][4];
  float w[2];
};

__device__ __forceinline__ void LoadQueryFragments(const IndexerParams& p, int64_t b,
                                                   QueryFragments& q) {
  const int tid = static_cast<int>(threadIdx.x);
  const int head0 = 16 * (tid >> 5) + ((tid & 31) >> 2);
  const __nv_bfloat16* lo = p.q + (b * kHeads + head0) * kDim + 2 * (tid & 3);
  const __nv_bfloat16* hi = lo + 8 * kDim;
#pragma unroll
  for (int ks = 0; ks < kDim / 16; ++ks) {
    q.a[ks][0] = LoadPair(lo + 16 * ks);
    q.a[ks][1] = LoadPair(hi + 16 * ks);
    q.a[ks][2] = LoadPair(lo + 16 * ks + 8);
    q.a[ks][3] = LoadPair(hi + 16 * ks + 8);
  }
  q.w[0] = p.weights[b * kHeads + head0];
  q.w[1] = p.weights[b * kHeads + head0 + 8];
}

// One step of the warp's reduce-scatter over lanes differing in bit MASK: of v[0 .. 2 HALF) a lane
// keeps one half (the upper one when its MASK bit is set) plus its partner's copy of that half, in
// v[0 .. HALF).
template <int MASK, int HALF>
__device__ __forceinline__ void ReduceScatterStep(float (&v)[16], int lane) {
  const bool upper = (lane & MASK) != 0;
#pragma unroll
  for (int i = 0; i < HALF; ++i) {
    const float keep = upper ? v[i + HALF] : v[i];
    const float send = upper ? v[i] : v[i + HALF];
    v[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, MASK);
  }
}

template <bool kWholePages, bool kRegisterQueries>
__global__ void __launch_bounds__(kThreads, kRegisterQueries ? kQrBlocksPerSm : kBlocksPerSm)
    IndexerScoresWgmmaKernel(IndexerParams p, int64_t b0, int nb, Divider div, float* scores,
                             int32_t* visible_out) {
  using Layout = WgLayout<kRegisterQueries>;
  constexpr int kSt = Layout::kStageCount;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw_address = hopper::SharedAddress(smem_raw);
  unsigned char* const smem = smem_raw + (((raw_address + 1023) & ~1023u) - raw_address);
  unsigned char* const q_s = smem;
  auto* const k_s = reinterpret_cast<__nv_bfloat16*>(smem + Layout::kQueryBytes);
  auto* const sum_s = reinterpret_cast<float*>(smem + Layout::kSumOffset);  // [4 warps][64 keys]
  auto* const first_s = reinterpret_cast<int64_t*>(smem + Layout::kTableOffset);
  auto* const vis_s = reinterpret_cast<int32_t*>(first_s + nb + 1);
  const uint32_t q_address = hopper::SharedAddress(q_s);
  const uint32_t k_address = hopper::SharedAddress(k_s);
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  TileCursor start;
  const int n_local = BlockRange(p, b0, nb, first_s, vis_s, visible_out, start);
  if (n_local == 0) return;

  KeyPipeline<kWholePages, true, kSt> pipeline(p, b0, nb, vis_s, div, start, n_local, k_s);

  // After the xor-16/8/4 reduce-scatter below, this lane holds the sums of keys 8 g + 2 t and
  // + 1 (lane bit 4, 3, 2 = g's bit 2, 1, 0 picks the half kept at each step).
  const int g = lane >> 2;
  const int t = lane & 3;
  float w[2] = {};
  int query_b = -1;
  // The next request's queries, loaded into registers when the copies ahead first reach it
  // (kSt - 1 tiles before it is scored), so a range that enters a new request does not wait on
  // global memory there. next_b: that request, or -1. With kRegisterQueries `current` holds the
  // request being scored.
  using Query = std::conditional_t<kRegisterQueries, QueryFragments, QueryShare>;
  const auto load_query = [&](int b, Query& q) {
    if constexpr (kRegisterQueries) {
      LoadQueryFragments(p, b0 + b, q);
    } else {
      LoadQueryShare(p, b0 + b, q);
    }
  };
  Query next;
  Query current;
  int next_b = -1;
  TileCursor tile = start;
  for (int it = 0; it < n_local; ++it) {
    if (tile.b != query_b) {  // every thread: the block's tile order is uniform
      query_b = tile.b;
      if (next_b != query_b) load_query(query_b, next);
      if constexpr (kRegisterQueries) {
        current = next;
      } else {
        StoreQueryShare(next, q_s);
      }
      w[0] = next.w[0];
      w[1] = next.w[1];
      next_b = -1;
    }
    CopyAsyncWait<kSt - 2>();
    hopper::FenceProxyAsync();  // this thread's key copies and query stores, before wgmma reads
    __syncthreads();            // tile it and the queries are visible; tile it - 1 is done
    pipeline.IssueAhead(it);
    if (next_b < 0 && it + kSt < n_local && pipeline.load.b != query_b) {
      next_b = pipeline.load.b;  // the request of tile it + kSt, the next one copied
      load_query(next_b, next);
    }

    const uint32_t tile_address = k_address + (it % kSt) * kWgTileBytes;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    hopper::FenceRegisters(acc);
    hopper::WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const uint32_t offset = (ks / 4) * kWgRegionBytes + (ks % 4) * 32;
      if constexpr (kRegisterQueries) {
        WgmmaScoresRegisterA(acc, current.a[ks],
                             hopper::SmemDescriptor(tile_address + offset, 16, 1024), ks > 0);
      } else {
        WgmmaScores(acc, hopper::SmemDescriptor(q_address + offset, 16, 1024),
                    hopper::SmemDescriptor(tile_address + offset, 16, 1024), ks > 0);
      }
    }
    hopper::WgmmaCommit();
    hopper::WgmmaWait<0>();
    hopper::FenceRegisters(acc);

    // v[2 j + e]: this thread's two heads, weighted, at key 8 j + 2 t + e.
    float v[16];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[2 * j] = fmaxf(acc[4 * j], 0.0f) * w[0] + fmaxf(acc[4 * j + 2], 0.0f) * w[1];
      v[2 * j + 1] = fmaxf(acc[4 * j + 1], 0.0f) * w[0] + fmaxf(acc[4 * j + 3], 0.0f) * w[1];
    }
    // Sum over the warp's 16 heads (lanes differing in g): at each step a lane keeps half its
    // values and adds its partner's copy of them.
    ReduceScatterStep<16, 8>(v, lane);
    ReduceScatterStep<8, 4>(v, lane);
    ReduceScatterStep<4, 2>(v, lane);
    *reinterpret_cast<float2*>(sum_s + warp * kTileKeys + 8 * g + 2 * t) = make_float2(v[0], v[1]);
    __syncthreads();
    if (tid < kTileKeys) {
      const int key = tile.tile * kTileKeys + tid;
      if (key < vis_s[tile.b]) {
        const float score = ((sum_s[tid] + sum_s[kTileKeys + tid]) +
                             (sum_s[2 * kTileKeys + tid] + sum_s[3 * kTileKeys + tid]));
        scores[(b0 + tile.b) * p.max_keys + key] = score * p.softmax_scale;
      }
    }
    Advance(tile, vis_s, nb);
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

size_t SmemBytes(int64_t nb) {
  return kStages * kStageBytes + sizeof(int64_t) * (nb + 1) + sizeof(int32_t) * nb;
}

// + 1024: slack to align the wgmma operands.
template <bool kRegisterQueries>
size_t WgmmaSmemBytes(int64_t nb) {
  return 1024 + WgLayout<kRegisterQueries>::kTableOffset + sizeof(int64_t) * (nb + 1) +
         sizeof(int32_t) * nb;
}
static_assert(kBlocksPerSm * (1024 + WgLayout<false>::kTableOffset + 12 * (kMaxBatchPerLaunch + 1) +
                              1024) <=
                  228 * 1024,
              "kBlocksPerSm wgmma blocks fit one multiprocessor");
static_assert(kBlocksPerSm * (1024 + WgLayout<true>::kTableOffset + 12 * (kMaxBatchPerLaunch + 1) +
                              kSmemReservedPerBlock) <=
                  kSmemPerSm,
              "at least kBlocksPerSm wgmma blocks with register queries fit one multiprocessor");

}  // namespace

cudaError_t indexer_scores(const IndexerParams& p, float* scores, int32_t* visible,
                           cudaStream_t stream) {
  constexpr const char* kLauncher = "indexer_scores";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.batch >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.max_keys >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.page_size >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rate >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.batch <= 65535);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.max_keys <= INT32_MAX - kTileKeys);
  if (p.batch == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.q != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.weights != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.key_pool != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.page_table != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.n_keys != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.positions != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, scores != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, visible != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.page_table_stride * p.page_size >= p.max_keys);
  const IndexerScoresVariant variant = p.scores_variant;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, variant == IndexerScoresVariant::kMmaSync ||
                                        variant == IndexerScoresVariant::kWgmma ||
                                        variant == IndexerScoresVariant::kWgmmaQueryRegisters);
  if (variant == IndexerScoresVariant::kWgmma) {
    // The wgmma kernel stages the queries with 16-byte loads.
    PDSERVE_LAUNCH_REQUIRE(kLauncher, reinterpret_cast<uintptr_t>(p.q) % 16 == 0);
  }
  using Kernel = void (*)(IndexerParams, int64_t, int, Divider, float*, int32_t*);
  // [variant][whole pages]
  static constexpr Kernel kKernels[3][2] = {
      {IndexerScoresKernel<false>, IndexerScoresKernel<true>},
      {IndexerScoresWgmmaKernel<false, false>, IndexerScoresWgmmaKernel<true, false>},
      {IndexerScoresWgmmaKernel<false, true>, IndexerScoresWgmmaKernel<true, true>}};
  const auto smem_bytes = [](IndexerScoresVariant v, int64_t nb) {
    return v == IndexerScoresVariant::kMmaSync
               ? SmemBytes(nb)
               : (v == IndexerScoresVariant::kWgmma ? WgmmaSmemBytes<false>(nb)
                                                    : WgmmaSmemBytes<true>(nb));
  };
  const cudaError_t attribute_status = [&] {
    for (int v = 0; v < 3; ++v) {
      const int size =
          static_cast<int>(smem_bytes(static_cast<IndexerScoresVariant>(v), kMaxBatchPerLaunch));
      for (const Kernel kernel : kKernels[v]) {
        const cudaError_t status =
            SetMaxDynamicSharedMemory(reinterpret_cast<const void*>(kernel), size);
        if (status != cudaSuccess) return status;
      }
    }
    return cudaSuccess;
  }();
  if (attribute_status != cudaSuccess) return attribute_status;
  const Divider div = MakeDivider(p.page_size);
  const bool whole_pages = p.page_size % kTileKeys == 0;
  const Kernel kernel = kKernels[static_cast<int>(variant)][whole_pages ? 1 : 0];
  // Fixed grid per launch: kBlocksPerSm blocks per SM (one wave), never more than the tiles of the
  // longest possible requests; each block takes an equal share of the tiles that are visible.
  const int64_t max_tiles = std::max<int64_t>(1, (p.max_keys + kTileKeys - 1) / kTileKeys);
  for (int64_t b0 = 0; b0 < p.batch; b0 += kMaxBatchPerLaunch) {
    const int64_t nb = std::min(kMaxBatchPerLaunch, p.batch - b0);
    // kWgmmaQueryRegisters: three blocks per SM where the request table leaves room, else two.
    const int64_t per_sm =
        variant == IndexerScoresVariant::kWgmmaQueryRegisters
            ? std::min<int64_t>(kQrBlocksPerSm,
                                kSmemPerSm / (smem_bytes(variant, nb) + kSmemReservedPerBlock))
            : kBlocksPerSm;
    const int64_t blocks = std::min<int64_t>(nb * max_tiles, per_sm * SmCount());
    cudaLaunchAttribute serialization = {};
    serialization.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    serialization.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(blocks));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = smem_bytes(variant, nb);
    config.stream = stream;
    config.attrs = &serialization;
    config.numAttrs = 1;
    const cudaError_t status =
        cudaLaunchKernelEx(&config, kernel, p, b0, static_cast<int>(nb), div, scores, visible);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

cudaError_t lightning_indexer(const IndexerParams& params, int64_t topk, float* scores,
                              int32_t* visible, int32_t* picks, cudaStream_t stream) {
  const cudaError_t status = indexer_scores(params, scores, visible, stream);
  if (status != cudaSuccess) return status;
  return top_k_variant(scores, params.batch, params.max_keys, visible, topk, params.topk_variant, 0,
                       picks, stream);
}

}  // namespace pdserve::kernels::cuda
