#include <math_constants.h>

#include <cub/block/block_reduce.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sampling.cuh"
#include "kernels/cuda/sampling_workspace.h"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kRowThreads = 512;
constexpr int kPrepareThreads = 256;
constexpr int kPrepareBlocksPerRow = 32;
using sampling_workspace::kAlign;
using sampling_workspace::kMaxRows;
using sampling_workspace::kMaxVocab;

constexpr int32_t kFlagBad = 1;
constexpr int32_t kFlagAllMasked = 2;

// Per-row results of the row kernel, read by the draw kernel.
struct RowState {
  double log_normalizer;  // raw log-softmax: max + log(sum exp(logit - max))
  int32_t flags;
  int32_t argmax;  // of the processed z (lowest id on ties)
  int32_t sampled;
  int32_t pad;
};

static_assert(sizeof(RowState) == sampling_workspace::kRowStateBytes);
static_assert(sizeof(SampledRow) == sampling_workspace::kSampledRowBytes);

// The workspace: sampling_workspace.h's layout, then CUB's temporary storage.
struct Layout {
  sampling_workspace::Layout parts;
  size_t temp_bytes = 0;
  size_t total = 0;
};

Layout MakeLayout(int64_t rows, int64_t vocab) {
  Layout l;
  l.parts = sampling_workspace::MakeLayout(rows, vocab);
  const auto n = static_cast<size_t>(rows * vocab);
  cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, l.temp_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(n),
      static_cast<int>(rows), static_cast<const int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr));
  l.total = l.parts.temp + sampling_workspace::AlignUp(l.temp_bytes);
  return l;
}

// Order-preserving 64-bit key of a double (larger double, larger key); -0.0 keys as +0.0, which
// the CPU's comparisons treat as equal.
__device__ __forceinline__ uint64_t OrderedKey(double z) {
  const auto u = static_cast<uint64_t>(__double_as_longlong(__dadd_rn(z, 0.0)));
  return (u >> 63) ? ~u : (u | (uint64_t{1} << 63));
}

__device__ __forceinline__ double FromOrderedKey(uint64_t key) {
  const uint64_t u = (key >> 63) ? (key & ~(uint64_t{1} << 63)) : ~key;
  return __longlong_as_double(static_cast<long long>(u));
}

// Philox-4x32-10 (serving/philox.cc), one block, and the 53-bit uniform of words 0 and 1.
__device__ double PhiloxUniform(uint32_t position, uint32_t choice, uint64_t seed) {
  uint32_t x[4] = {position, choice, 0u, 0u};
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * x[0];
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * x[2];
    const uint32_t y0 = static_cast<uint32_t>(p1 >> 32) ^ x[1] ^ k0;
    const uint32_t y2 = static_cast<uint32_t>(p0 >> 32) ^ x[3] ^ k1;
    x[0] = y0;
    x[1] = static_cast<uint32_t>(p1);
    x[2] = y2;
    x[3] = static_cast<uint32_t>(p0);
  }
  const uint64_t word = (static_cast<uint64_t>(x[0]) << 32) | x[1];
  return static_cast<double>(word >> 11) * 0x1.0p-53;
}

// A (value, id) candidate ordered by value descending, then id ascending.
struct Ranked {
  double value;
  int32_t id;
};

struct BetterOf {
  __device__ __forceinline__ Ranked operator()(const Ranked& a, const Ranked& b) const {
    if (b.id < 0) return a;
    if (a.id < 0) return b;
    return (a.value > b.value || (a.value == b.value && a.id < b.id)) ? a : b;
  }
};

struct MaxOf {
  __device__ __forceinline__ double operator()(double a, double b) const { return a > b ? a : b; }
};

using BlockReduceD = cub::BlockReduce<double, kRowThreads>;
using BlockReduceR = cub::BlockReduce<Ranked, kRowThreads>;
using BlockReduceI = cub::BlockReduce<int, kRowThreads>;
union ReduceStorage {
  typename BlockReduceD::TempStorage d;
  typename BlockReduceR::TempStorage r;
  typename BlockReduceI::TempStorage i;
};

// z = logits with the bitset applied; flags NaN / +inf.
__global__ void PrepareKernel(const float* logits, int64_t stride, int64_t vocab,
                              SamplingBatch batch, double* z, RowState* state) {
  const int64_t r = blockIdx.y;
  const SamplingRow& row = batch.rows[r];
  const float* in = logits + r * stride;
  double* zr = z + r * vocab;
  const uint32_t* mask = row.mask_word >= 0 ? batch.mask_words + row.mask_word : nullptr;
  int bad = 0;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < vocab;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = in[t];
    if (isnan(v) || v == CUDART_INF_F) bad = 1;
    double zt = v;
    if (mask != nullptr && !((mask[t >> 5] >> (t & 31)) & 1u)) zt = -CUDART_INF;
    zr[t] = zt;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(&state[r].flags, kFlagBad);
}

// Steps 1-4: end ids, logit_bias, repetition / presence / frequency penalties. Entries of one
// list name distinct tokens (end ids may repeat: the -inf they write is the same).
__global__ void SparseKernel(SamplingBatch batch, int64_t vocab, double* z) {
  const int64_t r = blockIdx.x;
  const SamplingRow& row = batch.rows[r];
  double* zr = z + r * vocab;
  if (row.generated < row.min_tokens) {
    for (int i = threadIdx.x; i < row.end_count; i += blockDim.x) {
      zr[batch.end_ids[row.end_begin + i]] = -CUDART_INF;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < row.bias_count; i += blockDim.x) {
    const int32_t t = batch.bias_tokens[row.bias_begin + i];
    zr[t] = __dadd_rn(zr[t], batch.bias_values[row.bias_begin + i]);
  }
  __syncthreads();
  const double penalty = row.repetition_penalty;
  for (int i = threadIdx.x; i < row.history_count; i += blockDim.x) {
    const HistoryEntry e = batch.history[row.history_begin + i];
    double v = zr[e.token];
    if (penalty != 1.0 && e.repeat) v = v > 0.0 ? __ddiv_rn(v, penalty) : __dmul_rn(v, penalty);
    if (e.count > 0) {
      v = __dsub_rn(v, __dadd_rn(__dmul_rn(static_cast<double>(e.count), row.frequency_penalty),
                                 row.presence_penalty));
    }
    zr[e.token] = v;
  }
}

// The raw log-softmax normalizer, the argmax of z; for sampled rows z / T as sort keys (in place)
// and the segment of the sort.
__global__ void __launch_bounds__(kRowThreads)
    RowKernel(const float* logits, int64_t stride, int64_t vocab, SamplingBatch batch, double* z,
              int32_t* ids, int32_t* begin, int32_t* end, RowState* state) {
  __shared__ ReduceStorage storage;
  __shared__ double shared_max;
  __shared__ Ranked shared_best;
  const int64_t r = blockIdx.x;
  const SamplingRow& row = batch.rows[r];
  const float* in = logits + r * stride;
  double* zr = z + r * vocab;
  begin[r] = static_cast<int32_t>(r * vocab);
  end[r] = static_cast<int32_t>(r * vocab);
  if (state[r].flags & kFlagBad) return;

  double local_max = -CUDART_INF;
  Ranked best = {-CUDART_INF, -1};
  for (int64_t t = threadIdx.x; t < vocab; t += blockDim.x) {
    local_max = fmax(local_max, static_cast<double>(in[t]));
    best = BetterOf()(best, Ranked{zr[t], static_cast<int32_t>(t)});
  }
  const double max_raw = BlockReduceD(storage.d).Reduce(local_max, MaxOf());
  if (threadIdx.x == 0) shared_max = max_raw;
  __syncthreads();
  const Ranked top = BlockReduceR(storage.r).Reduce(best, BetterOf());
  if (threadIdx.x == 0) shared_best = top;
  __syncthreads();
  double sum = 0.0;
  for (int64_t t = threadIdx.x; t < vocab; t += blockDim.x) {
    sum = __dadd_rn(sum, exp(__dsub_rn(static_cast<double>(in[t]), shared_max)));
  }
  const double total = BlockReduceD(storage.d).Sum(sum);
  const bool all_masked = shared_best.value == -CUDART_INF;
  const bool sampled = !all_masked && row.temperature >= kGreedyTemperatureDevice;
  if (threadIdx.x == 0) {
    state[r].log_normalizer = __dadd_rn(shared_max, log(total));
    state[r].argmax = shared_best.id;
    state[r].sampled = sampled ? 1 : 0;
    if (all_masked) state[r].flags |= kFlagAllMasked;
    if (sampled) end[r] = static_cast<int32_t>((r + 1) * vocab);
  }
  if (!sampled) return;
  auto* keys = reinterpret_cast<uint64_t*>(zr);
  int32_t* idr = ids + r * vocab;
  for (int64_t t = threadIdx.x; t < vocab; t += blockDim.x) {
    keys[t] = OrderedKey(__ddiv_rn(zr[t], row.temperature));
    idr[t] = static_cast<int32_t>(t);
  }
}

// Steps 6-7 on one thread over the sorted weights w (n candidates, `total` their sum), exactly
// as serving's DrawFiltered walks them. Returns the index into the sorted order.
__device__ int64_t DrawIndex(const double* w, int64_t n, double total, const SamplingRow& row,
                             double uniform) {
  auto truncate = [&](int64_t keep) {
    if (keep >= n) return;
    n = keep;
    total = 0.0;
    for (int64_t i = 0; i < n; ++i) total = __dadd_rn(total, w[i]);
  };
  if (row.top_k > 0) truncate(row.top_k);
  if (row.top_p < 1.0) {
    const double threshold = __dmul_rn(row.top_p, total);
    double cumulative = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      cumulative = __dadd_rn(cumulative, w[i]);
      if (cumulative >= threshold) {
        truncate(i + 1);
        break;
      }
    }
  }
  if (row.min_p > 0.0) {
    int64_t kept = 1;
    while (kept < n && w[kept] >= row.min_p) ++kept;
    truncate(kept);
  }
  const double target = __dmul_rn(uniform, total);
  double cumulative = 0.0;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] <= 0.0) break;
    cumulative = __dadd_rn(cumulative, w[i]);
    last_positive = i;
    if (cumulative > target) return i;
  }
  return last_positive;
}

// The draw of sampled rows and every row's logprobs.
__global__ void __launch_bounds__(kRowThreads)
    DrawKernel(const float* logits, int64_t stride, int64_t vocab, SamplingBatch batch,
               double* weights, const uint64_t* keys, const int32_t* ids, const RowState* state,
               SampledRow* out) {
  __shared__ ReduceStorage storage;
  __shared__ double shared_total;
  __shared__ int64_t shared_n;
  __shared__ Ranked shared_best;
  const int64_t r = blockIdx.x;
  const SamplingRow& row = batch.rows[r];
  const RowState st = state[r];
  SampledRow& o = out[r];
  if (st.flags != 0) {
    if (threadIdx.x == 0) {
      o.status = (st.flags & kFlagBad) ? kSampleBadLogits : kSampleAllMasked;
      o.token = -1;
      o.num_top = 0;
    }
    return;
  }
  int32_t token = st.argmax;
  if (st.sampled) {
    const uint64_t* kr = keys + r * vocab;
    double* wr = weights + r * vocab;
    const double max_z = FromOrderedKey(kr[0]);
    double sum = 0.0;
    int count = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const double zi = FromOrderedKey(kr[i]);
      const double wi = zi == -CUDART_INF ? 0.0 : exp(__dsub_rn(zi, max_z));
      wr[i] = wi;
      if (zi != -CUDART_INF) {
        sum = __dadd_rn(sum, wi);
        ++count;
      }
    }
    const double total = BlockReduceD(storage.d).Sum(sum);
    __syncthreads();
    const int n = BlockReduceI(storage.i).Sum(count);
    if (threadIdx.x == 0) {
      shared_total = total;
      shared_n = n;
    }
    __syncthreads();  // the weights and the sums are visible to thread 0
    if (threadIdx.x == 0) {
      const double u = PhiloxUniform(row.position, row.choice, row.seed);
      const int64_t index = DrawIndex(wr, shared_n, shared_total, row, u);
      shared_best.id = ids[r * vocab + index];
    }
    __syncthreads();
    token = shared_best.id;
    __syncthreads();
  }
  const float* in = logits + r * stride;
  const double log_normalizer = st.log_normalizer;
  if (threadIdx.x == 0) {
    o.token = token;
    o.status = kSampleOk;
    o.logprob = static_cast<float>(__dsub_rn(static_cast<double>(in[token]), log_normalizer));
  }
  // Top logprobs: k passes, each the best raw logit after the previous pick in (desc, id asc).
  const int k = row.top_logprobs < vocab ? row.top_logprobs : static_cast<int>(vocab);
  Ranked previous = {CUDART_INF, -1};
  for (int j = 0; j < k; ++j) {
    Ranked best = {-CUDART_INF, -1};
    for (int64_t t = threadIdx.x; t < vocab; t += blockDim.x) {
      const double v = in[t];
      const bool after =
          previous.id < 0 || v < previous.value || (v == previous.value && t > previous.id);
      if (after) best = BetterOf()(best, Ranked{v, static_cast<int32_t>(t)});
    }
    const Ranked top = BlockReduceR(storage.r).Reduce(best, BetterOf());
    if (threadIdx.x == 0) {
      shared_best = top;
      o.top_tokens[j] = top.id;
      o.top_logprobs[j] = static_cast<float>(__dsub_rn(top.value, log_normalizer));
    }
    __syncthreads();
    previous = shared_best;
    __syncthreads();
  }
  if (threadIdx.x == 0) o.num_top = k;
}

}  // namespace

size_t sampling_workspace_bytes(int64_t max_rows, int64_t vocab) {
  if (max_rows < 1 || max_rows > kMaxRows || vocab < 1 || vocab > kMaxVocab ||
      max_rows * vocab >= (int64_t{1} << 31)) {
    return 0;
  }
  return MakeLayout(max_rows, vocab).total;
}

cudaError_t sample_tokens(const float* logits, int64_t rows, int64_t stride, int64_t vocab,
                          const SamplingBatch& batch, SampledRow* out, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* kName = "sample_tokens";
  PDSERVE_LAUNCH_REQUIRE(kName, logits != nullptr && out != nullptr && workspace != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kName, batch.rows != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kName, rows >= 1 && rows <= kMaxRows);
  PDSERVE_LAUNCH_REQUIRE(kName, vocab >= 1 && vocab <= kMaxVocab && vocab <= stride);
  PDSERVE_LAUNCH_REQUIRE(kName, rows * vocab < (int64_t{1} << 31));
  PDSERVE_LAUNCH_REQUIRE(kName, reinterpret_cast<uintptr_t>(workspace) % kAlign == 0);
  const Layout l = MakeLayout(rows, vocab);
  PDSERVE_LAUNCH_REQUIRE(kName, workspace_bytes >= l.total);
  auto* base = static_cast<char*>(workspace);
  auto* z = reinterpret_cast<double*>(base + l.parts.z);
  auto* keys_out = reinterpret_cast<uint64_t*>(base + l.parts.keys_out);
  auto* ids_in = reinterpret_cast<int32_t*>(base + l.parts.ids_in);
  auto* ids_out = reinterpret_cast<int32_t*>(base + l.parts.ids_out);
  auto* begin = reinterpret_cast<int32_t*>(base + l.parts.begin);
  auto* end = reinterpret_cast<int32_t*>(base + l.parts.end);
  auto* state = reinterpret_cast<RowState*>(base + l.parts.state);

  cudaError_t err = cudaMemsetAsync(state, 0, static_cast<size_t>(rows) * sizeof(RowState), stream);
  if (err != cudaSuccess) return err;
  PrepareKernel<<<dim3(kPrepareBlocksPerRow, static_cast<unsigned>(rows)), kPrepareThreads, 0,
                  stream>>>(logits, stride, vocab, batch, z, state);
  SparseKernel<<<static_cast<unsigned>(rows), 256, 0, stream>>>(batch, vocab, z);
  RowKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(logits, stride, vocab, batch,
                                                                     z, ids_in, begin, end, state);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  size_t temp_bytes = l.temp_bytes;
  err = cub::DeviceSegmentedRadixSort::SortPairsDescending(
      base + l.parts.temp, temp_bytes, reinterpret_cast<const uint64_t*>(z), keys_out, ids_in,
      ids_out, static_cast<int>(rows * vocab), static_cast<int>(rows), begin, end, 0, 64, stream);
  if (err != cudaSuccess) return err;
  DrawKernel<<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(
      logits, stride, vocab, batch, z, keys_out, ids_out, state, out);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
