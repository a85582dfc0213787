#include <cstdint>

#include "kernels/cuda/compressor.cuh"
#include "kernels/cuda/launch_check.h"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// One segment's device values, n clamped to the launch bound.
struct Segment {
  int64_t p0;
  int64_t n;
  int64_t row_offset;
  int64_t slot;
};

// False when the segment has nothing to do (no rows, or a negative first position).
__device__ __forceinline__ bool ReadSegment(const CompressorParams& p, int64_t b, Segment* s) {
  s->p0 = p.first_position[b];
  s->n = min(max(static_cast<int64_t>(p.n_tokens[b]), int64_t{0}), p.max_tokens);
  s->row_offset = p.row_offset[b];
  s->slot = p.slot[b];
  return s->p0 >= 0 && s->n > 0;
}

__device__ __forceinline__ double BlockSum(double v, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) v += scratch[w];
  return v;
}

// Block (x, b) emits the x-th window of segment b whose last position is in [p0, p0 + n), if any:
// window w = p0 / m + x. Threads first resolve each slot's kv / gate / bias row (new rows or ring),
// then pool channels, normalize and rotate.
__global__ void __launch_bounds__(kThreads)
    EmitKernel(CompressorParams p, int64_t width, int64_t source_stride) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ double scratch[kThreads / 32];
  const int64_t m = p.rate;
  const int64_t max_slots = p.overlapping ? 2 * m : m;
  const float** kv_rows = reinterpret_cast<const float**>(smem_raw);
  const float** gate_rows = kv_rows + max_slots;
  const float** bias_rows = gate_rows + max_slots;
  float* pooled = reinterpret_cast<float*>(bias_rows + max_slots);

  Segment s;
  if (!ReadSegment(p, blockIdx.y, &s)) return;
  const int64_t w = s.p0 / m + blockIdx.x;
  if ((w + 1) * m > s.p0 + s.n || w >= p.entry_capacity) return;

  // Slot order of engine/compressor.cc: window w-1's Ca rows first (overlapping, w >= 1), then
  // window w's own rows (Cb half when overlapping).
  const bool has_overlap = p.overlapping && w >= 1;
  const int slots = static_cast<int>(has_overlap ? 2 * m : m);
  const int64_t own_offset = p.overlapping ? p.dim : 0;
  for (int i = threadIdx.x; i < slots; i += kThreads) {
    const bool overlap_slot = has_overlap && i < m;
    const int64_t r = overlap_slot ? i : i - (has_overlap ? m : 0);
    const int64_t q = (overlap_slot ? w - 1 : w) * m + r;
    const int64_t col = overlap_slot ? 0 : own_offset;
    // Positions before p0 come from the ring, which holds [p0 - 2m, p0).
    const int64_t offset = q >= s.p0 ? (s.row_offset + (q - s.p0)) * source_stride
                                     : (s.slot * 2 * m + q % (2 * m)) * width;
    kv_rows[i] = (q >= s.p0 ? p.kv : p.ring_kv) + offset + col;
    gate_rows[i] = (q >= s.p0 ? p.gate : p.ring_gate) + offset + col;
    bias_rows[i] = p.position_bias + r * width + col;
  }
  __syncthreads();

  // kernels/cpu/gated_pool.cc per channel, sums in slot order, products not fused.
  double sum_sq = 0.0;
  for (int64_t c = threadIdx.x; c < p.dim; c += kThreads) {
    float max_gate = -INFINITY;
    for (int i = 0; i < slots; ++i) max_gate = fmaxf(max_gate, gate_rows[i][c] + bias_rows[i][c]);
    float out = 0.0f;
    if (max_gate != -INFINITY) {
      float denom = 0.0f;
      float acc = 0.0f;
      for (int i = 0; i < slots; ++i) {
        const float e = expf((gate_rows[i][c] + bias_rows[i][c]) - max_gate);
        denom = __fadd_rn(denom, e);
        acc = __fadd_rn(acc, __fmul_rn(e, kv_rows[i][c]));
      }
      out = acc / denom;
    }
    pooled[c] = out;
    sum_sq += static_cast<double>(out) * out;
  }
  // The barrier inside also publishes `pooled`.
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv = 1.0f / sqrtf(static_cast<float>(sum_sq / static_cast<double>(p.dim)) + p.eps);

  __nv_bfloat16* entry = p.entries + EntryRow(p.entry_pages, s.slot, p.entry_capacity, w) * p.dim;
  const int64_t nope = p.dim - p.rope_dim;
  for (int64_t c = threadIdx.x; c < nope; c += kThreads) {
    entry[c] = __float2bfloat16_rn(p.norm_weight[c] * (pooled[c] * inv));
  }
  // Rope pairs (nope + 2i, nope + 2i + 1) at position w * m, angles as kernels/cuda/rope.cu.
  const float position = static_cast<float>(w * m);
  for (int64_t i = threadIdx.x; i < p.rope_dim / 2; i += kThreads) {
    const int64_t c = nope + 2 * i;
    const float a = p.norm_weight[c] * (pooled[c] * inv);
    const float b = p.norm_weight[c + 1] * (pooled[c + 1] * inv);
    const float angle = p.inv_freq[i] * position;
    double sin_d = 0.0;
    double cos_d = 0.0;
    sincos(static_cast<double>(angle), &sin_d, &cos_d);
    const float cos_f = static_cast<float>(cos_d) * p.attention_scaling;
    const float sin_f = static_cast<float>(sin_d) * p.attention_scaling;
    entry[c] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, cos_f), __fmul_rn(b, sin_f)));
    entry[c + 1] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, cos_f), __fmul_rn(a, sin_f)));
  }
}

// Block (k, b) copies the k-th of segment b's last min(n, 2m) new rows into the ring.
__global__ void __launch_bounds__(kThreads)
    RingKernel(CompressorParams p, int64_t width, int64_t source_stride) {
  Segment s;
  if (!ReadSegment(p, blockIdx.y, &s)) return;
  const int64_t ring_rows = 2 * p.rate;
  const int64_t count = min(s.n, ring_rows);
  if (static_cast<int64_t>(blockIdx.x) >= count) return;
  const int64_t q = s.p0 + s.n - count + blockIdx.x;
  const int64_t src = (s.row_offset + (q - s.p0)) * source_stride;
  const int64_t dst = (s.slot * ring_rows + q % ring_rows) * width;
  for (int64_t c = threadIdx.x; c < width; c += kThreads) {
    p.ring_kv[dst + c] = p.kv[src + c];
    p.ring_gate[dst + c] = p.gate[src + c];
  }
}

constexpr const char* kLauncher = "compressor_update";

cudaError_t CheckShape(const CompressorParams& p) {
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rate >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rate <= kMaxCompressorRate);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.dim >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.dim <= kMaxCompressorDim);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rope_dim >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rope_dim % 2 == 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rope_dim <= p.dim);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.segments >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.segments <= kMaxCompressorSegments);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.max_tokens >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.max_tokens <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.entry_capacity >= 0);
  PDSERVE_LAUNCH_REQUIRE(
      kLauncher, p.source_stride == 0 || p.source_stride >= (p.overlapping ? 2 * p.dim : p.dim));
  PDSERVE_LAUNCH_REQUIRE(kLauncher, EntryPagesValid(p.entry_pages, p.entry_capacity));
  return cudaSuccess;
}

cudaError_t CheckPointers(const CompressorParams& p) {
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.kv != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.gate != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.first_position != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.n_tokens != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.row_offset != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.slot != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.ring_kv != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.ring_gate != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.position_bias != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.norm_weight != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.entry_capacity == 0 || p.entries != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.rope_dim == 0 || p.inv_freq != nullptr);
  return cudaSuccess;
}

}  // namespace

cudaError_t compressor_update(const CompressorParams& params, cudaStream_t stream) {
  if (const cudaError_t e = CheckShape(params); e != cudaSuccess) return e;
  if (params.segments == 0 || params.max_tokens == 0) return cudaSuccess;
  if (const cudaError_t e = CheckPointers(params); e != cudaSuccess) return e;
  const int64_t width = params.overlapping ? 2 * params.dim : params.dim;
  const int64_t source_stride = params.source_stride > 0 ? params.source_stride : width;
  const auto segments = static_cast<unsigned>(params.segments);

  // Windows whose last position lies in [p0, p0 + n): at most (n - 1) / m + 1.
  if (params.entry_capacity > 0) {
    const int64_t windows = (params.max_tokens - 1) / params.rate + 1;
    const int64_t max_slots = params.overlapping ? 2 * params.rate : params.rate;
    const size_t smem =
        3 * static_cast<size_t>(max_slots) * sizeof(const float*) + params.dim * sizeof(float);
    EmitKernel<<<dim3(static_cast<unsigned>(windows), segments), kThreads, smem, stream>>>(
        params, width, source_stride);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) return launched;
  }
  // Stream-ordered after every emission's ring reads.
  const int64_t ring_rows =
      params.max_tokens < 2 * params.rate ? params.max_tokens : 2 * params.rate;
  RingKernel<<<dim3(static_cast<unsigned>(ring_rows), segments), kThreads, 0, stream>>>(
      params, width, source_stride);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
