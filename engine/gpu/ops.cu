#include "engine/gpu/ops.cuh"

namespace pdserve::engine::gpu {
namespace {

constexpr int kThreads = 256;

unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void CastKernel(const float* x, int64_t n, __nv_bfloat16* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void EmbedKernel(const int32_t* tokens, const __nv_bfloat16* embed, int64_t vocab,
                            int64_t hidden, int64_t hc, float* streams) {
  const int64_t r = blockIdx.x;
  const int64_t token = tokens[r];
  const bool valid = token >= 0 && token < vocab;
  for (int64_t c = threadIdx.x; c < hidden; c += kThreads) {
    const float v = valid ? __bfloat162float(embed[token * hidden + c]) : 0.0f;
    for (int64_t j = 0; j < hc; ++j) streams[(r * hc + j) * hidden + c] = v;
  }
}

// grid (segments, max_tokens): block (b, i) copies the segment's i-th new row if it is among
// the last `window` ones.
__global__ void WindowAppendKernel(SegmentArrays s, const __nv_bfloat16* new_rows, int64_t dim,
                                   int64_t window, __nv_bfloat16* ring) {
  const int64_t b = blockIdx.x;
  const int64_t i = blockIdx.y;
  const int64_t n = s.n_tokens[b];
  if (i >= n || i < n - window) return;
  const int64_t position = s.first_position[b] + i;
  const __nv_bfloat16* from = new_rows + (s.row_offset[b] + i) * dim;
  __nv_bfloat16* to = ring + (s.slot[b] * window + position % window) * dim;
  for (int64_t c = threadIdx.x; c < dim; c += kThreads) to[c] = from[c];
}

__global__ void CastF32Kernel(const __nv_bfloat16* x, int64_t n, float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) y[i] = __bfloat162float(x[i]);
}

__global__ void PageTableKernel(const int32_t* slot, const int32_t* position, int64_t window,
                                int64_t rate, int64_t capacity, int64_t page_size,
                                const int32_t* slot_pages, int32_t* window_len,
                                int32_t* n_compressed, int32_t* page_table) {
  const int64_t r = blockIdx.x;
  const int64_t t = position[r];
  const int64_t pages = capacity / page_size;
  if (threadIdx.x == 0) {
    window_len[r] = static_cast<int32_t>(min(t + 1, window));
    n_compressed[r] = static_cast<int32_t>(min((t + 1) / rate, capacity));
  }
  for (int64_t i = threadIdx.x; i < pages; i += kThreads) {
    page_table[r * pages + i] = slot_pages != nullptr ? slot_pages[slot[r] * pages + i]
                                                      : static_cast<int32_t>(slot[r] * pages + i);
  }
}

__global__ void UnmaskSlotsKernel(int32_t* picks, int64_t n, int64_t topk) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (picks[i] < 0) picks[i] = static_cast<int32_t>(i % topk);
  }
}

__global__ void ScaleKernel(float* x, int64_t n, float scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) x[i] *= scale;
}

__global__ void CastRowsKernel(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                               __nv_bfloat16* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < rows * cols) y[i] = __float2bfloat16_rn(x[(i / cols) * x_stride + i % cols]);
}

__global__ void ScaleRowsKernel(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                                float scale, float* y) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < rows * cols) y[i] = x[(i / cols) * x_stride + i % cols] * scale;
}

__global__ void SumPartsKernel(const float* parts, int64_t n_parts, int64_t n, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  float sum = parts[i];
  for (int64_t p = 1; p < n_parts; ++p) sum += parts[p * n + i];
  out[i] = sum;
}

__global__ void AddIntoKernel(float* y, const float* x, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) y[i] += x[i];
}

__global__ void LocalExpertIdsKernel(const int32_t* experts, int64_t n, int32_t first,
                                     int32_t count, int32_t* local) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const int32_t e = experts[i];
  local[i] = e >= first && e - first < count ? e - first : -1;
}

}  // namespace

cudaError_t CastToBf16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (x == nullptr || y == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  CastKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, y);
  return cudaGetLastError();
}

cudaError_t EmbedStreams(const int32_t* tokens, int64_t rows, const __nv_bfloat16* embed,
                         int64_t vocab, int64_t hidden, int64_t hc, float* streams,
                         cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 || hidden <= 0 || hc <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (tokens == nullptr || embed == nullptr || streams == nullptr) return cudaErrorInvalidValue;
  EmbedKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(tokens, embed, vocab, hidden,
                                                                    hc, streams);
  return cudaGetLastError();
}

cudaError_t WindowAppend(const SegmentArrays& segments, const __nv_bfloat16* new_rows, int64_t dim,
                         int64_t window, __nv_bfloat16* ring, cudaStream_t stream) {
  if (segments.segments < 0 || segments.max_tokens < 0 || dim <= 0 || window <= 0) {
    return cudaErrorInvalidValue;
  }
  if (segments.segments == 0 || segments.max_tokens == 0) return cudaSuccess;
  if (new_rows == nullptr || ring == nullptr || segments.first_position == nullptr ||
      segments.n_tokens == nullptr || segments.row_offset == nullptr || segments.slot == nullptr) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(segments.segments),
                  static_cast<unsigned>(segments.max_tokens));
  WindowAppendKernel<<<grid, kThreads, 0, stream>>>(segments, new_rows, dim, window, ring);
  return cudaGetLastError();
}

cudaError_t CastToF32(const __nv_bfloat16* x, int64_t n, float* y, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (x == nullptr || y == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  CastF32Kernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, y);
  return cudaGetLastError();
}

cudaError_t DecodePageTables(const int32_t* slot, const int32_t* position, int64_t rows,
                             int64_t window, int64_t rate, int64_t capacity, int64_t page_size,
                             const int32_t* slot_pages, int32_t* window_len, int32_t* n_compressed,
                             int32_t* page_table, cudaStream_t stream) {
  if (rows < 0 || window <= 0 || rate <= 0 || capacity < 0 || page_size <= 0 ||
      capacity % page_size != 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (slot == nullptr || position == nullptr || window_len == nullptr || n_compressed == nullptr ||
      (capacity > 0 && page_table == nullptr)) {
    return cudaErrorInvalidValue;
  }
  PageTableKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      slot, position, window, rate, capacity, page_size, slot_pages, window_len, n_compressed,
      page_table);
  return cudaGetLastError();
}

cudaError_t Scale(float* x, int64_t n, float scale, cudaStream_t stream) {
  if (n < 0 || (n > 0 && x == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  ScaleKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, scale);
  return cudaGetLastError();
}

cudaError_t CastRowsToBf16(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                           __nv_bfloat16* y, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || x_stride < cols) return cudaErrorInvalidValue;
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
  CastRowsKernel<<<Blocks(n), kThreads, 0, stream>>>(x, rows, cols, x_stride, y);
  return cudaGetLastError();
}

cudaError_t ScaleRows(const float* x, int64_t rows, int64_t cols, int64_t x_stride, float scale,
                      float* y, cudaStream_t stream) {
  if (rows < 0 || cols < 0 || x_stride < cols) return cudaErrorInvalidValue;
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || y == nullptr) return cudaErrorInvalidValue;
  ScaleRowsKernel<<<Blocks(n), kThreads, 0, stream>>>(x, rows, cols, x_stride, scale, y);
  return cudaGetLastError();
}

cudaError_t UnmaskSlots(int32_t* picks, int64_t rows, int64_t topk, cudaStream_t stream) {
  if (rows < 0 || topk < 0 || (rows * topk > 0 && picks == nullptr)) return cudaErrorInvalidValue;
  const int64_t n = rows * topk;
  if (n == 0) return cudaSuccess;
  UnmaskSlotsKernel<<<Blocks(n), kThreads, 0, stream>>>(picks, n, topk);
  return cudaGetLastError();
}

cudaError_t SumParts(const float* parts, int64_t n_parts, int64_t n, float* out,
                     cudaStream_t stream) {
  if (n_parts < 1 || n < 0 || (n > 0 && (parts == nullptr || out == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  SumPartsKernel<<<Blocks(n), kThreads, 0, stream>>>(parts, n_parts, n, out);
  return cudaGetLastError();
}

cudaError_t AddInto(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (x == nullptr || y == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  AddIntoKernel<<<Blocks(n), kThreads, 0, stream>>>(y, x, n);
  return cudaGetLastError();
}

cudaError_t LocalExpertIds(const int32_t* experts, int64_t n, int64_t first, int64_t count,
                           int32_t* local, cudaStream_t stream) {
  if (n < 0 || first < 0 || count < 0 || first + count > INT32_MAX ||
      (n > 0 && (experts == nullptr || local == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  LocalExpertIdsKernel<<<Blocks(n), kThreads, 0, stream>>>(experts, n, static_cast<int32_t>(first),
                                                           static_cast<int32_t>(count), local);
  return cudaGetLastError();
}

}  // namespace pdserve::engine::gpu
