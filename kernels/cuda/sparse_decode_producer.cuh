// The split kernel's producer warpgroup (sparse_decode_attention.cu has the design): the queries
// into shared memory (cp.async, or TMA multicast for kClusterMerge), the lookups' prefetch, and
// every tile's rows into the stage ring. Internal to kernels/cuda/sparse_decode_attention.cu.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/sparse_decode_layout.cuh"
#include "kernels/cuda/sparse_decode_merge.cuh"

namespace pdserve::kernels::cuda {
// Unnamed: each including .cu file gets its own copy.
namespace {

using hopper::MbarrierArrive;
using hopper::MbarrierWait;
using hopper::TmaLoad2dMulticast;
using sparse_decode::RequestEntries;
using sparse_decode::WindowRows;

// One arrival, made when every cp.async this thread issued before it has landed.
__device__ __forceinline__ void MbarrierArriveOnCopies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void CopyAsync16Shared(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Per-block facts every role needs, from the request's window length and compressed entries
// written (its list: window rows first, then compressed slots).
struct BlockWork {
  int64_t b = 0;    // request
  int head0 = 0;    // first head of the block
  int window = 0;   // window rows of the request
  int begin = 0;    // first list entry of this split
  int end = 0;      // one past its last
  int n_tiles = 0;  // 32-row tiles of the split
  int active = 1;   // splits with entries (at least 1: split 0 writes the zeros of an empty list)
};

__device__ __forceinline__ BlockWork GetBlockWork(const SparseDecodeParams& p, int window_len,
                                                  int n_compressed) {
  BlockWork w;
  w.b = blockIdx.y;
  w.head0 = static_cast<int>(blockIdx.z) * kHeads;
  w.window = WindowRows(p, window_len);
  const int total = RequestEntries(p, window_len, n_compressed);
  w.begin = static_cast<int>(blockIdx.x) * static_cast<int>(p.entries_per_split);
  w.end = min(total, w.begin + static_cast<int>(p.entries_per_split));
  w.n_tiles = max(0, (w.end - w.begin + kRows - 1) / kRows);
  const int per_split = static_cast<int>(p.entries_per_split);
  w.active = max(1, (total + per_split - 1) / per_split);
  return w;
}

// Producer warps: the queries of the block, 16 bytes per copy, consecutive lanes on consecutive
// bytes of a head; the copies land on the q_full barrier. Needs nothing loaded first, so they go
// out before anything else.
__device__ __forceinline__ void IssueQueries(const SparseDecodeParams& p, uint32_t base) {
  const int lane = threadIdx.x & 31;
  const int pw = (static_cast<int>(threadIdx.x) - kConsumerThreads) >> 5;
  const __nv_bfloat16* const q =
      p.q + (int64_t{blockIdx.y} * p.heads + int64_t{blockIdx.z} * kHeads) * kDim;
#pragma unroll 4
  for (int i = pw; i < kHeads * kDim / 8 / 32; i += kProducerWarps) {
    const int unit_index = i * 32 + lane;
    const int head = unit_index >> 6;
    const int unit = unit_index & 63;
    CopyAsync16Shared(base + kQOffset + SwizzledOffset(head, unit, kQRegionBytes),
                      q + head * kDim + unit * 8, true);
  }
  MbarrierArriveOnCopies(base + kBarrierOffset + kQBarrier * 8);
}

// kDependentLaunch's producer warps, before the request's lengths are known: every 128-byte line of
// the request's page-table row (up to 64 lines) and of the CSA indices this split can need
// (whatever the window length) is prefetched into L1, so the first tiles' lookups, which wait on
// the lengths, then on the index, then on the page, wait on one round trip to L2 instead of
// three. Prefetches do not fault and change no result.
__device__ __forceinline__ void PrefetchLookups(const SparseDecodeParams& p) {
  const int t = static_cast<int>(threadIdx.x) - kConsumerThreads;
  const int64_t b = blockIdx.y;
  const auto prefetch = [](const int32_t* address) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(address));
  };
  if (p.compressed_slots > 0) {
    const int64_t lines = min((p.page_table_stride + 31) / 32, int64_t{64});
    for (int64_t l = t; l < lines; l += kThreads - kConsumerThreads) {
      prefetch(p.page_table + b * p.page_table_stride + 32 * l);
    }
  }
  if (p.indices != nullptr) {
    const int64_t begin = int64_t{blockIdx.x} * p.entries_per_split;
    const int64_t lo = max(int64_t{0}, begin - p.window_size);
    const int64_t hi = min(p.compressed_slots, begin + p.entries_per_split);
    for (int64_t i = lo + 32 * t; i < hi; i += 32 * (kThreads - kConsumerThreads)) {
      prefetch(p.indices + b * p.compressed_slots + i);
    }
  }
}

// The producer warps: every tile's rows into the stage ring. Producer warp pw owns rows 8 pw ..
// 8 pw + 7 of every tile. The row lookups run in blocks of four tiles: lane l resolves row
// 8 pw + l % 8 of tile 4 blk + l / 8, the CSA indices two blocks ahead and their pool pages one
// block ahead, so a dependent global load is waited for at most once per four tiles. For the
// copies 8 lanes take one 128-byte region row, so a warp instruction moves 4 rows' worth of one
// region and every 32-byte sector is requested whole.
__device__ void Produce(const SparseDecodeParams& p, const BlockWork& w, int n_compressed,
                        int window_page, uint32_t base, unsigned char* valid_bytes) {
  const int lane = threadIdx.x & 31;
  const int pw = (static_cast<int>(threadIdx.x) - kConsumerThreads) >> 5;
  if (w.n_tiles == 0) return;
  const __nv_bfloat16* const window_rows =
      p.window_pool + int64_t{window_page} * p.window_size * kDim;
  const int my_row = kRowsPerProducer * pw + (lane & 7);  // the row this lane resolves
  const int my_sub = lane >> 3;                           // of tile 4 blk + my_sub
  const auto entry_index = [&](int block) {
    return w.begin + (4 * block + my_sub) * kRows + my_row;
  };
  // Compressed entry of this lane's row of `block` (CSA index or HCA slot), -1 for window rows
  // and rows past the split.
  const auto entry_of = [&](int block) -> int {
    const int e = entry_index(block);
    if (e >= w.end || e < w.window) return -1;
    if (p.indices == nullptr) return e - w.window;
    return p.indices[w.b * p.compressed_slots + (e - w.window)];
  };
  // Its pool page, -1 when it is not attended (index -1 or past the entries written).
  const auto page_of = [&](int c) -> int {
    if (c < 0 || c >= n_compressed) return -1;
    return p.page_table[w.b * p.page_table_stride + c / p.page_size];
  };
  int entry0 = entry_of(0);
  int entry1 = entry_of(1);
  int page0 = page_of(entry0);
  const int n_blocks = (w.n_tiles + 3) / 4;
  const int part = lane & 7;
  for (int block = 0; block < n_blocks; ++block) {
    // The next blocks' CSA indices go out before this block waits for its stages; their pages
    // once this block's first tile is out (page_of waits for the index), so the first tile never
    // waits on a lookup it does not need.
    const int entry2 = entry_of(block + 2);
    int page1 = -1;
    const int e = entry_index(block);
    const __nv_bfloat16* src = nullptr;
    if (e < w.end) {
      if (e < w.window) {
        src = window_rows + int64_t{e} * kDim;
      } else if (page0 >= 0) {
        src = p.kv_pool + (int64_t{page0} * p.page_size + entry0 % p.page_size) * kDim;
      }
    }
    const uint32_t attended = __ballot_sync(0xFFFFFFFFu, src != nullptr);
    for (int sub = 0; sub < 4; ++sub) {
      const int it = 4 * block + sub;
      if (it >= w.n_tiles) break;
      const int stage = it % kStages;
      if (it >= kStages) {
        MbarrierWait(base + kBarrierOffset + (kEmptyBarrier + stage) * 8, ((it / kStages) - 1) & 1);
      }
      if (lane == 0)
        valid_bytes[stage * 4 + pw] = static_cast<unsigned char>(attended >> (8 * sub));
      const uint32_t tile = base + kTileOffset + stage * kTileBytes;
#pragma unroll 1
      for (int group = 0; group < kRowsPerProducer / 4; ++group) {
        const int local = 4 * group + (lane >> 3);
        const int row = kRowsPerProducer * pw + local;
        const auto row_src = reinterpret_cast<const __nv_bfloat16*>(
            __shfl_sync(0xFFFFFFFFu, reinterpret_cast<uintptr_t>(src), 8 * sub + local));
        const bool ok = row_src != nullptr;
        // A row not attended is zero-filled from a dummy source that is never read.
        const __nv_bfloat16* const from = (ok ? row_src : p.q) + part * 8;
        const uint32_t to = tile + row * 128 + ((part ^ (row & 7)) << 4);
#pragma unroll
        for (int region = 0; region < 8; ++region) {
          CopyAsync16Shared(to + region * kTileRegionBytes, from + region * 64, ok);
        }
      }
      const uint32_t full = base + kBarrierOffset + (kFullBarrier + stage) * 8;
      MbarrierArrive(full);          // the valid flags
      MbarrierArriveOnCopies(full);  // the rows
      if (sub == 0) page1 = page_of(entry1);
    }
    entry0 = entry1;
    entry1 = entry2;
    page0 = page1;
  }
}

// Clusters with multicast_queries (kClusterMerge, kDependentLaunch with query_cluster > 1), one
// producer thread per block: the block of rank r fetches 64-dim regions r, r + C, ... of the
// group's queries (64 heads x 128 bytes each, laid out and swizzled by the tensor map as
// IssueQueries lays them out) into every block of its cluster of C (consecutive splits of one
// request and head group); each block's q_full barrier expects all 64 KB.
__device__ __forceinline__ void IssueQueriesMulticast(const SparseDecodeParams& p,
                                                      const CUtensorMap* q_map, uint32_t base) {
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int blocks = static_cast<int>(cluster.num_blocks());
  const auto all = static_cast<uint16_t>((1u << blocks) - 1u);
  const auto row = static_cast<int32_t>(int64_t{blockIdx.y} * p.heads + blockIdx.z * kHeads);
  for (int region = static_cast<int>(cluster.block_rank()); region < kDim / 64; region += blocks) {
    TmaLoad2dMulticast(base + kQOffset + region * kQRegionBytes, q_map, region * 64, row,
                       base + kBarrierOffset + kQBarrier * 8, all);
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
