#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/page_copy_block.cuh"
#include "kernels/cuda/xxh3.cuh"
#include "kernels/cuda/xxh3_scalar.cuh"

namespace pdserve::kernels::cuda {
namespace {

using xxh3::kBlockBytes;
using xxh3::kStripeBytes;
using xxh3::kStripesPerBlock;

constexpr int kThreads = 256;
constexpr int kLanes = 8;
// 1024-byte blocks summed at once: one thread per (block, lane).
constexpr int kTileBlocks = kThreads / kLanes;
static_assert(kTileBlocks >= kStripesPerBlock, "the last block's stripes fit one tile row each");

__constant__ xxh3::Secret kSecret = xxh3::kDefaultSecret;

// READ_ONLY: the bytes are not written during the kernel, so aligned words may come through the
// read-only (non-coherent) path; copy_pages_xxh3 hashes what its own block just wrote and must not.
template <bool ALIGNED, bool READ_ONLY>
__device__ __forceinline__ uint64_t LoadWord(const uint8_t* p) {
  if constexpr (ALIGNED && READ_ONLY) {
    return __ldg(reinterpret_cast<const unsigned long long*>(p));
  } else if constexpr (ALIGNED) {
    return *reinterpret_cast<const unsigned long long*>(p);
  } else {
    return xxh3::Load64(p);
  }
}

// This thread's share of one block's accumulate steps for lane `lane`: the products of `stripes`
// stripes' words (at stride 64 from `words`) and, in `sum`, their plain sum (which belongs to
// lane ^ 1).
template <bool ALIGNED, bool READ_ONLY>
__device__ __forceinline__ uint64_t StripeProducts(const uint8_t* words, int stripes, int lane,
                                                   const uint64_t* secret64, uint64_t& sum) {
  uint64_t products = 0;
#pragma unroll
  for (int n = 0; n < kStripesPerBlock; ++n) {
    if (n < stripes) {
      const uint64_t w = LoadWord<ALIGNED, READ_ONLY>(words + n * kStripeBytes);
      const uint64_t v = w ^ secret64[n + lane];
      products += (v & 0xFFFFFFFFull) * (v >> 32);
      sum += w;
    }
  }
  return products;
}

// The long hash (> 240 bytes) of one page by the whole thread block. Returns the hash in thread 0.
template <bool ALIGNED, bool READ_ONLY>
__device__ uint64_t LongHash(const uint8_t* in, uint64_t len, const uint8_t* secret,
                             uint64_t (&tile_sum)[kTileBlocks][kLanes]) {
  const int t = threadIdx.x;
  const int lane = t % kLanes;
  const int row = t / kLanes;
  const auto* secret64 = reinterpret_cast<const uint64_t*>(secret);
  // Lane t's accumulator, kept by threads 0..7 only.
  uint64_t acc = 0;
  if (t < kLanes) {
    uint64_t init[kLanes];
    xxh3::InitLongAcc(init);
    acc = init[t];
  }
  const uint64_t scramble_word = secret64[xxh3::kScrambleOffset / 8 + lane];
  const uint64_t full_blocks = (len - 1) / kBlockBytes;
  for (uint64_t tile = 0; tile < full_blocks; tile += kTileBlocks) {
    const uint64_t block = tile + row;
    uint64_t sum = 0;
    uint64_t products = 0;
    if (block < full_blocks) {
      products = StripeProducts<ALIGNED, READ_ONLY>(in + block * kBlockBytes + lane * 8,
                                                    kStripesPerBlock, lane, secret64, sum);
    }
    tile_sum[row][lane] = products + __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    __syncthreads();
    if (t < kLanes) {
      const uint64_t left = full_blocks - tile;
      const int count = left < kTileBlocks ? static_cast<int>(left) : kTileBlocks;
      for (int j = 0; j < count; ++j) acc = xxh3::Scramble(acc + tile_sum[j][t], scramble_word);
    }
    __syncthreads();
  }
  // The last block: its full stripes but the last, one per tile row, no scramble.
  const uint64_t last = full_blocks * kBlockBytes;
  const int last_stripes = static_cast<int>((len - last - 1) / kStripeBytes);
  {
    uint64_t sum = 0;
    uint64_t products = 0;
    if (row < last_stripes) {
      products = StripeProducts<ALIGNED, READ_ONLY>(in + last + row * kStripeBytes + lane * 8, 1,
                                                    lane, secret64 + row, sum);
    }
    tile_sum[row][lane] = products + __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  }
  __syncthreads();
  // The input's last 64 bytes as a stripe (any alignment), by warp 0; threads 0..7 sum up.
  if (t < 32) {
    const uint64_t w = xxh3::Load64(in + len - kStripeBytes + lane * 8);
    const uint64_t v = w ^ xxh3::Load64(secret + xxh3::kLastStripeOffset + lane * 8);
    const uint64_t neighbour = __shfl_xor_sync(0xFFFFFFFFu, w, 1);
    if (t < kLanes) {
      for (int n = 0; n < last_stripes; ++n) acc += tile_sum[n][t];
      acc += (v & 0xFFFFFFFFull) * (v >> 32) + neighbour;
    }
  }
  __syncthreads();
  if (t < kLanes) tile_sum[0][t] = acc;
  __syncthreads();
  if (t != 0) return 0;
  uint64_t all[kLanes];
  for (int i = 0; i < kLanes; ++i) all[i] = tile_sum[0][i];
  return xxh3::FinalMerge(all, len, secret);
}

// The XXH3-64 of `length` bytes at `in` by the whole block, in thread 0 (`secret` and
// `tile_sum` in shared memory).
template <bool READ_ONLY>
__device__ uint64_t PageHash(const uint8_t* in, uint64_t length, const uint8_t* secret,
                             uint64_t (&tile_sum)[kTileBlocks][kLanes]) {
  if (length <= xxh3::kMidSizeMax) {
    if (threadIdx.x != 0) return 0;
    return length <= 16 ? xxh3::Xxh3Short(in, length, secret)
                        : xxh3::Xxh3Medium(in, length, secret);
  }
  if ((reinterpret_cast<uintptr_t>(in) & 7) == 0) {
    return LongHash<true, READ_ONLY>(in, length, secret, tile_sum);
  }
  return LongHash<false, READ_ONLY>(in, length, secret, tile_sum);
}

__device__ __forceinline__ void LoadSecret(uint8_t* secret) {
  if (threadIdx.x < xxh3::kSecretBytes / 8) {
    reinterpret_cast<uint64_t*>(secret)[threadIdx.x] =
        reinterpret_cast<const uint64_t*>(kSecret.bytes)[threadIdx.x];
  }
}

__global__ void __launch_bounds__(kThreads)
    Xxh3PagesKernel(const Xxh3Page* pages, uint64_t* hashes) {
  __shared__ alignas(8) uint8_t secret[xxh3::kSecretBytes];
  __shared__ uint64_t tile_sum[kTileBlocks][kLanes];
  LoadSecret(secret);
  __syncthreads();
  const Xxh3Page page = pages[blockIdx.x];
  const uint64_t hash =
      PageHash<true>(static_cast<const uint8_t*>(page.data), page.length, secret, tile_sum);
  if (threadIdx.x == 0) hashes[blockIdx.x] = hash;
}

__global__ void __launch_bounds__(kThreads)
    CopyXxh3PagesKernel(const PageCopy* copies, uint64_t* hashes) {
  __shared__ alignas(8) uint8_t secret[xxh3::kSecretBytes];
  __shared__ uint64_t tile_sum[kTileBlocks][kLanes];
  LoadSecret(secret);
  const PageCopy c = copies[blockIdx.x];
  CopyPageBlock<kThreads>(c);
  // The block's writes are visible to all its threads past the barrier; the hash reads the
  // destination (the landed bytes) through the coherent path.
  __syncthreads();
  const uint64_t hash =
      PageHash<false>(static_cast<const uint8_t*>(c.dst), c.length, secret, tile_sum);
  if (threadIdx.x == 0) hashes[blockIdx.x] = hash;
}

}  // namespace

cudaError_t xxh3_64_pages(const Xxh3Page* pages, int64_t num_pages, uint64_t* hashes,
                          cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("xxh3_64_pages", num_pages >= 0);
  PDSERVE_LAUNCH_REQUIRE("xxh3_64_pages", num_pages < (int64_t{1} << 31));
  if (num_pages == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("xxh3_64_pages", pages != nullptr);
  PDSERVE_LAUNCH_REQUIRE("xxh3_64_pages", hashes != nullptr);
  Xxh3PagesKernel<<<static_cast<unsigned>(num_pages), kThreads, 0, stream>>>(pages, hashes);
  return cudaGetLastError();
}

cudaError_t copy_pages_xxh3(const PageCopy* copies, int64_t num_pages, uint64_t* hashes,
                            cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("copy_pages_xxh3", num_pages >= 0);
  PDSERVE_LAUNCH_REQUIRE("copy_pages_xxh3", num_pages < (int64_t{1} << 31));
  if (num_pages == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("copy_pages_xxh3", copies != nullptr);
  PDSERVE_LAUNCH_REQUIRE("copy_pages_xxh3", hashes != nullptr);
  CopyXxh3PagesKernel<<<static_cast<unsigned>(num_pages), kThreads, 0, stream>>>(copies, hashes);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
