// sample_tokens' device workspace (kernels/cuda/sampling.cuh) as host arithmetic, without CUDA:
// sampling.cu lays its workspace out with it, and the memory plan (engine/gpu_workspace_plan.h)
// counts the GPU sampler's workspace with it (runtime/cuda/gpu_sampler.cc allocates
// sampling_workspace_bytes(max_rows, vocab) and max_rows SampledRows).
// Layout (each part 256-byte aligned): z / sort keys in, double [rows, vocab] | sort keys out,
// uint64 [rows, vocab] | ids in, ids out, int32 [rows, vocab] | segment begins, ends, int32 [rows]
// | row states [rows] | CUB's temporary storage for the segmented radix sort. CUB's bytes are its
// own (sampling.cu asks cub::DeviceSegmentedRadixSort, which needs a device): CubSortTempBytes is
// what CUDA 13's CUB asks for, its alternate key and value buffers and its alignment slack
// (cub/device/dispatch/dispatch_radix_sort.cuh, DispatchSegmentedRadixSort;
// detail::AliasTemporaries), which the memory plan counts; a GPU test compares the two.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pdserve::kernels::cuda::sampling_workspace {

inline constexpr int64_t kMaxRows = 4096;
inline constexpr int64_t kMaxVocab = int64_t{1} << 24;
inline constexpr size_t kAlign = 256;
inline constexpr size_t kRowStateBytes = 24;  // sizeof(RowState) in sampling.cu
// sizeof(SampledRow) (sampling.cuh): token, status, logprob, num_top, 20 top tokens and logprobs.
inline constexpr size_t kSampledRowBytes = 4 * 4 + 20 * 4 * 2;

inline size_t AlignUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The offsets of each part for `rows` rows of `vocab` tokens; total without CUB's bytes (`temp`
// is where they start).
struct Layout {
  size_t z = 0, keys_out = 0, ids_in = 0, ids_out = 0, begin = 0, end = 0, state = 0, temp = 0;
};
inline Layout MakeLayout(int64_t rows, int64_t vocab) {
  Layout l;
  const auto n = static_cast<size_t>(rows * vocab);
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t offset = at;
    at += AlignUp(bytes);
    return offset;
  };
  l.z = take(n * sizeof(double));
  l.keys_out = take(n * sizeof(uint64_t));
  l.ids_in = take(n * sizeof(int32_t));
  l.ids_out = take(n * sizeof(int32_t));
  l.begin = take(static_cast<size_t>(rows) * sizeof(int32_t));
  l.end = take(static_cast<size_t>(rows) * sizeof(int32_t));
  l.state = take(static_cast<size_t>(rows) * kRowStateBytes);
  l.temp = at;
  return l;
}

// CUB's temporary storage for a segmented sort of n uint64 keys with int32 values (see above).
inline size_t CubSortTempBytes(int64_t n) {
  return AlignUp(static_cast<size_t>(n) * 8) + AlignUp(static_cast<size_t>(n) * 4) + kAlign - 1;
}

// sampling_workspace_bytes(rows, vocab) with CubSortTempBytes for CUB's part; 0 outside the
// kernel's limits.
inline size_t Bytes(int64_t rows, int64_t vocab) {
  if (rows < 1 || rows > kMaxRows || vocab < 1 || vocab > kMaxVocab ||
      rows * vocab >= (int64_t{1} << 31)) {
    return 0;
  }
  return MakeLayout(rows, vocab).temp + AlignUp(CubSortTempBytes(rows * vocab));
}

}  // namespace pdserve::kernels::cuda::sampling_workspace
