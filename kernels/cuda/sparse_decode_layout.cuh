// The split kernel's shapes and shared-memory layout (sparse_decode_attention.cuh; the kernel and
// its design: sparse_decode_attention.cu). Internal to kernels/cuda/sparse_decode_attention.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda {
// Unnamed: each including .cu file gets its own copy.
namespace {

constexpr int kDim = static_cast<int>(kSparseHeadDim);
constexpr int kHeads = static_cast<int>(kSparseHeadsPerBlock);
constexpr int kRows = static_cast<int>(kSparseTile);  // K/V rows per stage
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup
// Registers per thread after setmaxnreg: the producer warpgroup gives most of its share to the
// consumers, whose accumulators need them (56 + 2 x 224 = 504 = 3 x 168, the launch's share).
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;
constexpr int kProducerWarps = 4;
constexpr int kRowsPerProducer = kRows / kProducerWarps;
constexpr int kHalf = kDim / 2;
constexpr int kStages = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kRescaleSlack = 8.0f;  // log2 units: probabilities up to 256 before a rescale
// An operand of n rows (Q: 64 heads; a stage: 32 rows) is 8 regions of n rows x 128 bytes (64
// dims each); in a region row r starts at r * 128 and its 16-byte unit u sits at unit u ^ (r % 8)
// (the 128-byte swizzle of the wgmma shared-memory layouts, PTX ISA "Shared Memory Matrix
// Layout"). Regions are 1024-byte aligned so the swizzle pattern starts at each one.
constexpr int kQRegionBytes = kHeads * 128;
constexpr int kTileRegionBytes = kRows * 128;
constexpr int kQBytes = 8 * kQRegionBytes;        // 64 KB
constexpr int kTileBytes = 8 * kTileRegionBytes;  // 32 KB
constexpr int kQOffset = 0;
constexpr int kTileOffset = kQOffset + kQBytes;
// P handed between the consumer warpgroups: [from][k][thread] uint4 (bf16 pairs), and the
// reference maxima with it: [from][thread] float2 (at the end: the sums).
constexpr int kPOffset = kTileOffset + kStages * kTileBytes;
constexpr int kPBytes = 2 * 2 * 128 * 16;
constexpr int kRefOffset = kPOffset + kPBytes;
constexpr int kRefBytes = 2 * 128 * 8;
// [stage] uint32: bit r set when row r of the stage is attended (written by producer warp r / 8 as
// byte r / 8).
constexpr int kValidOffset = kRefOffset + kRefBytes;
constexpr int kBarrierOffset = kValidOffset + kStages * 4;
// mbarriers: full[stage] (the stage's rows landed), empty[stage] (its consumers are done), and
// q_full (the queries landed).
constexpr int kFullBarrier = 0;
constexpr int kEmptyBarrier = kStages;
constexpr int kQBarrier = 2 * kStages;
// kClusterMerge: the block's maxima and sums [64 heads] float2 for the cluster's merge.
constexpr int kStatsOffset = (kBarrierOffset + (2 * kStages + 1) * 8 + 15) / 16 * 16;
constexpr int kSmemBytes = kStatsOffset + kHeads * 8 + 1024;  // + alignment slack
static_assert(kHeads == 64 && kDim == 512 && kRows == 32 && kRowsPerProducer == 8,
              "the layout assumes these shapes");
static_assert(kQBytes == kHeads * kDim * 2, "the bf16 output is staged in the query area");
static_assert(kSmemBytes <= 227 * 1024, "one block per multiprocessor");

// Byte offset of (row, 16-byte unit 0..63) inside an operand whose regions are `region_bytes`.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int unit, int region_bytes) {
  return static_cast<uint32_t>((unit >> 3) * region_bytes + row * 128 +
                               (((unit & 7) ^ (row & 7)) << 4));
}

}  // namespace
}  // namespace pdserve::kernels::cuda
