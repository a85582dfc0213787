#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
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

// Stages tile c into dst ([kTileKeys, kPitch] bf16); rows past `visible` become zeros and their
// pool slots (addresses inside a page the request owns, or page 0) are not read.
template <bool kWholePages>
__device__ __forceinline__ void LoadKeyTile(const IndexerParams& p, TileCursor c, int visible,
                                            Divider div,
                                            const int32_t (&pages)[kPagesPerTile<kWholePages>],
                                            __nv_bfloat16* dst) {
  const int chunk = static_cast<int>(threadIdx.x) % kChunksPerRow;
  const int row0 = static_cast<int>(threadIdx.x) / kChunksPerRow;
  const int first_key = c.tile * kTileKeys;
  __nv_bfloat16* const dst_row0 = dst + row0 * kPitch + chunk * 8;
  if constexpr (kWholePages) {
    // The tile's rows are consecutive pool rows of one page.
    const int64_t pool_row = static_cast<int64_t>(pages[0]) * p.page_size +
                             div.Remainder(first_key, div.Quotient(first_key)) + row0;
    const __nv_bfloat16* src = p.key_pool + pool_row * kDim + chunk * 8;
    const int rows_left = visible - first_key - row0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      CopyAsync16(dst_row0 + i * kRowsPerPass * kPitch, src + i * kRowsPerPass * kDim,
                  i * kRowsPerPass < rows_left);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int key = first_key + row0 + i * kRowsPerPass;
      const int64_t pool_row =
          static_cast<int64_t>(pages[i]) * p.page_size + div.Remainder(key, div.Quotient(key));
      CopyAsync16(dst_row0 + i * kRowsPerPass * kPitch, p.key_pool + pool_row * kDim + chunk * 8,
                  key < visible);
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
  if (begin == end) return;
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
  const TileCursor start{lo, static_cast<int>(begin - first_s[lo])};

  // Prologue: page ids of the first kStages - 1 tiles in one round trip, then their copies.
  TileCursor load = start;
  TileCursor ahead_tiles[kStages - 1];
  int32_t ahead_pages[kStages - 1][kPagesPerTile<kWholePages>];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    ahead_tiles[s] = load;
    if (s < n_local) {
      LoadPages<kWholePages>(p, b0 + load.b, load, vis_s[load.b], div, ahead_pages[s]);
      Advance(load, vis_s, nb);
    }
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_local) {
      const TileCursor c = ahead_tiles[s];
      LoadKeyTile<kWholePages>(p, c, vis_s[c.b], div, ahead_pages[s], k_s + s * kTileKeys * kPitch);
    }
    CopyAsyncCommit();
  }
  int32_t pages[kPagesPerTile<kWholePages>];
  if (kStages - 1 < n_local) {
    LoadPages<kWholePages>(p, b0 + load.b, load, vis_s[load.b], div, pages);
  }

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
    const int ahead = it + kStages - 1;
    if (ahead < n_local) {
      LoadKeyTile<kWholePages>(p, load, vis_s[load.b], div, pages,
                               k_s + (ahead % kStages) * kTileKeys * kPitch);
      Advance(load, vis_s, nb);
      if (ahead + 1 < n_local) {
        LoadPages<kWholePages>(p, b0 + load.b, load, vis_s[load.b], div, pages);
      }
    }
    CopyAsyncCommit();

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
  static const cudaError_t attribute_status = [] {
    const int bytes = static_cast<int>(SmemBytes(kMaxBatchPerLaunch));
    const cudaError_t whole = cudaFuncSetAttribute(
        IndexerScoresKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (whole != cudaSuccess) return whole;
    return cudaFuncSetAttribute(IndexerScoresKernel<false>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  }();
  if (attribute_status != cudaSuccess) return attribute_status;
  const Divider div = MakeDivider(p.page_size);
  const auto kernel =
      p.page_size % kTileKeys == 0 ? IndexerScoresKernel<true> : IndexerScoresKernel<false>;
  // Fixed grid per launch: kBlocksPerSm blocks per SM (one wave), never more than the tiles of the
  // longest possible requests; each block takes an equal share of the tiles that are visible.
  const int64_t max_tiles = std::max<int64_t>(1, (p.max_keys + kTileKeys - 1) / kTileKeys);
  for (int64_t b0 = 0; b0 < p.batch; b0 += kMaxBatchPerLaunch) {
    const int64_t nb = std::min(kMaxBatchPerLaunch, p.batch - b0);
    const int64_t blocks = std::min<int64_t>(nb * max_tiles, int64_t{kBlocksPerSm} * SmCount());
    kernel<<<static_cast<unsigned>(blocks), kThreads, SmemBytes(nb), stream>>>(
        p, b0, static_cast<int>(nb), div, scores, visible);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

cudaError_t lightning_indexer(const IndexerParams& params, int64_t topk, float* scores,
                              int32_t* visible, int32_t* picks, cudaStream_t stream) {
  const cudaError_t status = indexer_scores(params, scores, visible, stream);
  if (status != cudaSuccess) return status;
  return top_k(scores, params.batch, params.max_keys, visible, topk, picks, stream);
}

}  // namespace pdserve::kernels::cuda
