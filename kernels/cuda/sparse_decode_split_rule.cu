// The split size rule of sparse_decode_attention (sparse_decode_attention.cuh): host arithmetic,
// a cost model fitted to H200 measurements (sparse_decode_workspace.h has it).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda {

int64_t SparseDecodeSplits(const SparseDecodeParams& p) {
  return sparse_decode_workspace::Splits(p.window_size + p.compressed_slots, p.entries_per_split);
}

int64_t SparseDecodeEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                    int sm_count) {
  return sparse_decode_workspace::EntriesPerSplit(batch, heads, max_entries, sm_count);
}

int64_t SparseDecodeClusterEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                           int sm_count, const int* max_active_clusters) {
  const int64_t per = SparseDecodeEntriesPerSplit(batch, heads, max_entries, sm_count);
  const int64_t tiles = std::max<int64_t>(1, (max_entries + kSparseTile - 1) / kSparseTile);
  const int64_t clusters = std::max<int64_t>(1, batch * (heads / kSparseHeadsPerBlock));
  int64_t splits = std::min((tiles * kSparseTile + per - 1) / per, kSparseMaxClusterSplits);
  while (splits > 1 && max_active_clusters[splits] < clusters) --splits;
  const int64_t tiles_per_split = (tiles + splits - 1) / splits;
  return tiles_per_split * kSparseTile;
}

}  // namespace pdserve::kernels::cuda
